"""A process group made by ``init_process_group()`` without a backend: one backend
per device type ("cpu:gloo" here, "cpu:gloo,cuda:nccl" on a GPU machine), and
``get_backend()`` answers "undefined" on torch 2.13. hybridcomm must read the
per-device backend (docs: issue 20, defect 2)."""

import torch
import torch.distributed as dist

import hybridcomm
from hybridcomm.comm import backend, control
from hybridcomm.comm.transport.torch_dist import TorchDistTransport
from multiproc import run_ranks


def test_backend_configs_are_read_per_device():
    assert backend.parse_backend_config("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert backend.parse_backend_config("gloo") == {"cpu": "gloo", "cuda": "gloo"}
    assert backend.parse_backend_config("nccl") == {"cuda": "nccl"}


def test_a_mixed_group_communicates_on_the_gpu_when_one_is_there(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "undefined")
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    assert backend.backend_for("cuda") == "nccl" and backend.backend_for("cpu") == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert backend.comm_device() == torch.device("cuda", 0)  # not gloo on the CPU
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo")
    assert backend.comm_device() == torch.device("cpu")


def _no_backend(rank, world, store_path):
    # Both ranks through the launcher's gloo handshake first: destroying the group while
    # the peer still connects closes its socket mid-handshake (seen once in make test).
    dist.barrier()
    dist.destroy_process_group()
    dist.init_process_group(store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    seen = (str(dist.get_backend()), str(dist.get_backend_config()))
    model = torch.nn.Linear(4, 2)
    torch.manual_seed(0)
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model=model, overlap="backward", timeout=60
    )
    x = torch.full((3, 4), float(rank + 1))
    model(x).sum().backward()
    opt.step()
    grad = model.weight.grad.clone()
    opt.close()
    t = hybridcomm.all_reduce(torch.full((5,), float(rank + 1)), algorithm="ring", timeout=60)
    return (seen, TorchDistTransport().backend, control.control_group(None) is None, grad, t)


def test_a_group_made_without_a_backend_works(tmp_path):
    for seen, transport_backend, own_group, grad, t in run_ranks(
        2, _no_backend, str(tmp_path / "store"), timeout=120
    ):
        assert seen[1] == "cpu:gloo"  # (and seen[0] "undefined" on torch 2.13)
        assert transport_backend == "gloo"
        assert own_group  # gloo for CPU objects already: no extra group made
        assert torch.equal(grad, torch.full((2, 4), 3 * 1.5))  # mean of 3x1 and 3x2 inputs
        assert torch.equal(t, torch.full((5,), 3.0))
