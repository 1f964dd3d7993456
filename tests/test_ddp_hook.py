"""hybridcomm as a DDP communication hook: DDP's numbers, identical on every rank."""
import pickle

import pytest
import torch
import torch.nn as nn

import hybridcomm
import hybridcomm.ddp
from multiproc import run_ranks
from optim_models import batch, flat, make_model, shard


def _train(rank, world, hook, algo):
    import os

    if algo:
        os.environ["HYBRIDCOMM_ALGO"] = algo
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)  # several buckets
    state = None
    if hook == "hand":  # set up in the first hook call
        state = hybridcomm.ddp.HybridState(timeout=60)
        ddp.register_comm_hook(state, hybridcomm.ddp.hybrid_hook)
    elif hook == "register":  # set up now: nothing collective may run in backward
        state = hybridcomm.ddp.register(ddp, hybridcomm.ddp.HybridState(timeout=60))

        def refused(*a, **k):
            raise AssertionError("set-up inside backward")
        for mod, name in ((hybridcomm.ddp.calibration, "agree"),
                          (hybridcomm.ddp.calibration, "resolve"),
                          (hybridcomm.ddp.control, "new_group_like"),
                          (hybridcomm.ddp, "open_channel")):
            setattr(mod, name, refused)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for s in range(4):
        x, y = batch(s)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
        opt.step()
    algos = dict(state.algorithms) if state else {}
    return flat(model.parameters()), algos, pickle.loads(pickle.dumps(state)).algorithms \
        if state else {}


@pytest.mark.parametrize("hook,algo", [("hand", None), ("register", "ring"),
                                       ("hand", "butterfly")])
def test_hook_gives_ddps_numbers_on_every_rank(hook, algo):
    """By hand the hook sets itself up in the first backward; ``register`` sets
    it up before (the first backward would fail on any collective set-up)."""
    plain = run_ranks(3, _train, False, None)[0][0]
    results = run_ranks(3, _train, hook, algo)
    params, algos, unpickled = results[0]
    eps = torch.finfo(torch.float32).eps
    assert torch.allclose(params, plain, rtol=64 * eps, atol=64 * eps)
    assert all(torch.equal(r[0], params) for r in results)
    assert len(algos) > 1 and unpickled == algos  # several buckets; the state pickles
    if algo:
        assert set(algos.values()) == {algo}


def test_state_takes_the_optimizers_cost_model_names_and_refuses_others():
    """"default" and "probe" as DistributedOptimizer takes them (resolved on first
    use, alike on every rank: test_integrations_lightning runs "default"); anything
    else fails at construction, not inside the first backward."""
    for name in ("default", "probe", None):
        assert hybridcomm.ddp.HybridState(cost_model=name).cost_model == name
    with pytest.raises(ValueError, match="cost_model must be"):
        hybridcomm.ddp.HybridState(cost_model="fast")
