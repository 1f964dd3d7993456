"""hybridcomm as a DDP communication hook: DDP's numbers, identical on every rank,
on the host path and on the simulated GPU (there also with backward on a side
stream while the transport has an issuing thread: no race)."""

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

        for mod, name in (
            (hybridcomm.ddp.calibration, "agree"),
            (hybridcomm.ddp.calibration, "resolve"),
            (hybridcomm.ddp.control, "new_group_like"),
            (hybridcomm.ddp, "open_channel"),
        ):
            setattr(mod, name, refused)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for s in range(4):
        x, y = batch(s)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
        opt.step()
    algos = dict(state.algorithms) if state else {}
    return (
        flat(model.parameters()),
        algos,
        pickle.loads(pickle.dumps(state)).algorithms if state else {},
    )


@pytest.mark.parametrize("hook,algo", [("hand", None), ("register", "ring"), ("hand", "butterfly")])
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


def _train_simulated(rank, world, hook, algo):
    import os

    os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "1"
    from hybridcomm.testing import simgpu

    out = _train(rank, world, hook, algo)
    simgpu.check()
    return out


@pytest.mark.parametrize("hook", ["hand", "register"])
def test_hook_gives_ddps_numbers_on_the_simulated_gpu(hook):
    """The stream path: DDP's reducer reads (and next writes) the bucket only after
    the reduction queued on the comm stream, through the hook's future (on CUDA
    a future bound to the comm stream; a CPU tensor's would complete at once)."""
    plain = run_ranks(2, _train, False, None)[0][0]
    results = run_ranks(2, _train_simulated, hook, None, timeout=120)
    eps = torch.finfo(torch.float32).eps
    assert torch.allclose(results[0][0], plain, rtol=64 * eps, atol=64 * eps)
    assert torch.equal(results[0][0], results[1][0])


def _side_stream(rank, world, algo):
    """DDP with the hook on the simulated GPU, backward on a side stream, while the
    transport has an issuing thread (the optimizer's channel makes one): the
    parameters after _train's four steps and the defects the simulator found."""
    import os

    os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "1"
    os.environ["HYBRIDCOMM_ALGO"] = algo
    from hybridcomm.comm.channel import issuer_for
    from hybridcomm.testing import simgpu

    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    state = hybridcomm.ddp.register(ddp, hybridcomm.ddp.HybridState(timeout=60))
    issuer_for(state._transport)  # issues everything on the transport from now on
    rt = state._transport.runtime
    side = rt.new_stream()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for s in range(4):  # as _train
        x, y = batch(s)
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(shard(x, rank, world)), shard(y, rank, world))
        forward = rt.new_event()
        forward.record(rt.current_stream())
        side.wait_event(forward)
        with rt.use(side):
            loss.backward()
        backward = rt.new_event()
        backward.record(side)
        rt.current_stream().wait_event(backward)
        opt.step()
    simgpu.check()
    return flat(model.parameters()), [str(e) for e in simgpu.errors()]


@pytest.mark.parametrize("algo", ["ring", "native"])
def test_backward_on_a_side_stream_with_an_issuing_thread(algo):
    """Issue 29's defect 4: the bucket's ready event must be recorded on the stream
    backward wrote it on (the hook's caller's), not on the issuing thread's current
    stream, or NCCL reads the gradients before they are written (a race here)."""
    plain = run_ranks(2, _train, False, None)[0][0]
    results = run_ranks(2, _side_stream, algo, timeout=120)
    eps = torch.finfo(torch.float32).eps
    for params, errors in results:
        assert errors == []
        assert torch.allclose(params, plain, rtol=64 * eps, atol=64 * eps)
    assert torch.equal(results[0][0], results[1][0])


def test_state_takes_the_optimizers_cost_model_names_and_refuses_others():
    """ "default" and "probe" as DistributedOptimizer takes them (resolved on first
    use, alike on every rank: test_integrations_lightning runs "default"); anything
    else fails at construction, not inside the first backward."""
    for name in ("default", "probe", None):
        assert hybridcomm.ddp.HybridState(cost_model=name).cost_model == name
    with pytest.raises(ValueError, match="cost_model must be"):
        hybridcomm.ddp.HybridState(cost_model="fast")
