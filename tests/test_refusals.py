"""What cannot work is refused when the optimizer is made, on every rank, with
hybridcomm's own error naming the cause and the fix (issue 39): a model DDP
already synchronizes, and parameters a lazy module has not made yet. Before,
the first failed within a few steps (an in-place write into a bucket in flight,
on one rank, the other in a raw gloo timeout) and the second came out as
torch's message about ``load_state_dict``."""
import time

import torch
import torch.nn as nn

import hybridcomm
from multiproc import run_ranks


def _make(rank, world, case):
    torch.manual_seed(0)
    if case == "ddp":
        inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
        model = nn.parallel.DistributedDataParallel(inner)
    elif case == "ddp_inside":  # a submodule wrapped, the whole handed over
        model = nn.Sequential(nn.parallel.DistributedDataParallel(nn.Linear(4, 4)),
                              nn.Linear(4, 2))
    else:
        model = nn.Sequential(nn.LazyLinear(4), nn.Tanh(), nn.Linear(4, 2))
    t0 = time.monotonic()
    try:
        hybridcomm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        model=model, timeout=30)
    except hybridcomm.HybridCommError as e:
        return str(e), time.monotonic() - t0
    return None, time.monotonic() - t0


def test_a_model_ddp_synchronizes_and_a_lazy_module_are_refused_on_every_rank():
    for case, says in (("ddp", ["the model is wrapped in DistributedDataParallel",
                                "ddp_model.module", "hybridcomm.ddp.register"]),
                       ("ddp_inside", ["the module '0' is wrapped in DistributedDataParallel"]),
                       ("lazy", ["'0.weight', '0.bias' are not initialized yet",
                                 "run one forward pass"])):
        for error, seconds in run_ranks(2, _make, case, timeout=120):
            assert error is not None, case
            for text in says:
                assert text in error, (case, error)
            assert seconds < 20, (case, seconds)  # no rank waited out a timeout


def _lazy_after_a_forward(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(4), nn.Tanh(), nn.Linear(4, 2))
    model(torch.zeros(1, 3))  # materialized: accepted
    opt = hybridcomm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                          model=model, timeout=30)
    n = sum(len(b.params) for b in opt.plan.buckets)
    opt.close()
    return n


def test_a_lazy_module_after_its_first_forward_is_accepted():
    assert run_ranks(2, _lazy_after_a_forward, timeout=120) == [4, 4]
