"""Every public entry point that communicates, called before
``torch.distributed.init_process_group``: hybridcomm's own HybridCommError saying
what to call first (not torch's bare ValueError about a default process group).
One process, no group."""

import pytest
import torch
import torch.distributed as dist

import hybridcomm
import hybridcomm.comm.calibration
import hybridcomm.comm.servers
import hybridcomm.strategies
from hybridcomm.averager import TensorAverager

pytestmark = pytest.mark.fast  # in this process alone (tests/tiers.py)


@pytest.fixture(autouse=True)
def _no_group():
    assert not dist.is_initialized()  # the mistake under test
    yield


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


CALLS = {
    "broadcast_parameters": lambda: hybridcomm.broadcast_parameters(
        _model().state_dict(), root_rank=0
    ),
    "broadcast_parameters(named pairs)": lambda: hybridcomm.broadcast_parameters(
        list(_model().named_parameters())
    ),
    "broadcast_optimizer_state": lambda: hybridcomm.broadcast_optimizer_state(_sgd(_model())),
    "all_reduce": lambda: hybridcomm.all_reduce(torch.ones(3), op="avg"),
    "all_reduce(ring)": lambda: hybridcomm.all_reduce(torch.ones(3), algorithm="ring"),
    "DistributedOptimizer": lambda: hybridcomm.DistributedOptimizer(_sgd(m := _model()), model=m),
    "TensorAverager.average_": lambda: TensorAverager().average_([torch.ones(3)]),
    "ps.split_world": lambda: hybridcomm.comm.servers.split_world(1),
    "calibration.agree": lambda: hybridcomm.comm.calibration.agree(timeout=5),
    "LocalSGD": lambda: hybridcomm.strategies.LocalSGD(_sgd(m := _model()), m, period=2),
    "ParallelSGD": lambda: hybridcomm.strategies.ParallelSGD(_sgd(m := _model()), m),
    "ADMM": lambda: hybridcomm.strategies.ADMM(_sgd(m := _model()), m),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_a_call_before_init_process_group_says_what_to_call(name):
    with pytest.raises(hybridcomm.HybridCommError) as e:
        CALLS[name]()
    assert "init_process_group" in str(e.value), str(e.value)
    assert "Default process group" not in str(e.value)  # not torch's words, ours


@pytest.mark.parametrize("name", ["broadcast_parameters", "broadcast_optimizer_state"])
def test_the_broadcasts_name_themselves(name):
    with pytest.raises(hybridcomm.HybridCommError, match=name):
        CALLS[name]()
