"""Downpour SGD with model-parallel replicas (DownpourStage): each replica a
2-stage pipeline on its own ranks, each stage fetching and pushing only its own
parameters to the same sharded servers.

Real processes (forked, gloo on 127.0.0.1 through a FileStore: no port to pick;
the servers listen on free ports): workers are ranks ``replica * 2 + stage``,
the servers the ranks after them."""

import os
import tempfile
import threading
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hybridcomm import HybridCommError, HybridCommTimeout
from hybridcomm.strategies import DownpourSGD, DownpourStage, init_downpour, serve
from hybridcomm.strategies.downpour.server import ShardServer
from multiproc import run_ranks

STAGES = 2


def _stages(seed=0):
    """A 2-stage MLP: stage 0 then stage 1 is the unsplit model."""
    torch.manual_seed(seed)
    return [
        nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 12), nn.Tanh()),
        nn.Sequential(nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 3)),
    ]


def _teacher_batch(step, replica, n=16):
    """A regression task: y = a fixed random tanh layer of x (learnable by the MLP)."""
    g = torch.Generator().manual_seed(1000 * replica + step)
    x = torch.randn(n, 6, generator=g)
    w = torch.randn(6, 3, generator=torch.Generator().manual_seed(7))
    return x, torch.tanh(x @ w)


def _job(rank, world, workers, rdv, steps, n_fetch, n_push, lr):
    torch.set_num_threads(1)
    role, name = init_downpour(rank, workers, world - workers, f"file://{rdv}", timeout=10)
    servers = [f"server{i}" for i in range(world - workers)]
    if role == "server":
        return ("server", serve(timeout=10))
    replica, stage = divmod(rank, STAGES)
    pipe = DownpourStage(
        _stages()[stage],
        servers,
        lr=lr,
        stage=stage,
        peers=[replica * STAGES + s for s in range(STAGES)],
        loss_fn=F.mse_loss,
        n_fetch=n_fetch,
        n_push=n_push,
        timeout=10,
    )
    losses = []
    for s in range(steps):
        x, y = _teacher_batch(s, replica)  # each stage process makes the same batches
        loss = pipe.step(x) if stage == 0 else pipe.step(y=y)
        if loss is not None:
            losses.append(loss)
    # inference through the pipeline: the output comes back to stage 0
    x = _teacher_batch(steps, replica)[0]
    out = pipe.forward(x) if stage == 0 else pipe.forward()
    pipe.close()
    params = [p.detach().clone() for p in pipe.module.parameters()]
    return ("worker", stage, params, losses, pipe.pushes, pipe.lost, out)


@pytest.mark.parametrize("shards", [1, 2])
def test_one_replica_of_two_stages_equals_one_process_with_plain_sgd(shards):
    steps, lr = 8, 0.1
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(
            STAGES + shards, _job, STAGES, os.path.join(tmp, "rdv"), steps, 1, 1, lr, timeout=60
        )
    # the reference: the unsplit model, torch.optim.SGD, the same batches
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: the same kernels, the same summation order
    try:
        model = nn.Sequential(*_stages())
        sgd = torch.optim.SGD(model.parameters(), lr=lr)
        for s in range(steps):
            sgd.zero_grad()
            F.mse_loss(model(_teacher_batch(s, 0)[0]), _teacher_batch(s, 0)[1]).backward()
            sgd.step()
    finally:
        torch.set_num_threads(threads)
    split = results[0][2] + results[1][2]
    # Bitwise: the split does the unsplit model's operations on the same values
    # (stage 1's input gradient is what autograd passes between the halves), the
    # server's update is SGD's (p -= lr * g), and n_fetch = n_push = 1 pushes one
    # step's gradient (0 + g: exact) and fetches the result before the next step.
    for got, want in zip(split, model.parameters(), strict=True):
        assert torch.equal(got, want.detach())
    with torch.no_grad():
        assert torch.equal(results[0][6], model(_teacher_batch(steps, 0)[0]))
    assert results[1][6] is None


def test_two_replicas_of_two_stages_converge_and_every_push_lands():
    replicas, shards, steps, n_fetch, n_push = 2, 2, 90, 2, 3
    workers = replicas * STAGES
    with tempfile.TemporaryDirectory() as tmp:
        rdv = os.path.join(tmp, "rdv")
        results = run_ranks(
            workers + shards, _job, workers, rdv, steps, n_fetch, n_push, 0.2, timeout=90
        )
        final = [
            torch.load(os.path.join(rdv, f"server{i}.pt"), weights_only=True) for i in range(shards)
        ]
    stage_runs = results[:workers]
    # converges: the baseline predictor (0, the targets' mean) has the targets'
    # mean square as its loss; the last 10 steps' loss must be under a tenth of it
    baseline = (
        torch.stack([_teacher_batch(s, r)[1] for s in range(steps) for r in range(replicas)])
        .pow(2)
        .mean()
        .item()
    )
    for r in range(replicas):
        losses = stage_runs[r * STAGES + STAGES - 1][3]
        assert len(losses) == steps
        assert sum(losses[-10:]) / 10 < 0.1 * baseline, (losses[:3], losses[-3:], baseline)
    # every shard holds part of both stages, and applied every push sent to it
    for f in final:
        assert sorted(f["parts"]) == ["stage0", "stage1"]
    for i in range(shards):
        sent = [run[4][i] for run in stage_runs]
        assert sent == [steps // n_push] * workers  # each stage process pushed to each shard
        assert results[workers + i] == ("server", sum(sent)) == ("server", final[i]["pushes"])
    assert all(run[5] == 0 for run in stage_runs)  # nothing lost


def test_two_parts_claiming_one_name_and_bad_stages_are_refused():
    with tempfile.TemporaryDirectory() as rdv:
        server = ShardServer(0, workers=2, rendezvous=rdv, timeout=10)
        t = threading.Thread(target=server.run)
        t.start()
        try:
            # split by hand, unprefixed: both halves have '0.weight' and '0.bias'
            first = DownpourSGD(
                nn.Sequential(nn.Linear(4, 3)),
                ["server0"],
                lr=0.1,
                worker=0,
                rendezvous=rdv,
                part="front",
            )
            with pytest.raises(
                HybridCommError,
                match=r"part 'back' claims \['0.bias', "
                r"'0.weight'\], which part 'front' holds",
            ):
                DownpourSGD(
                    nn.Sequential(nn.Linear(3, 2)),
                    ["server0"],
                    lr=0.1,
                    worker=1,
                    rendezvous=rdv,
                    part="back",
                )
            # a stage whose slice differs from the part its first process set up
            with pytest.raises(
                HybridCommError,
                match=r"0.weight: torch.float32 \(3, 5\) does "
                r"not match the shard's",
            ):
                DownpourSGD(
                    nn.Sequential(nn.Linear(5, 3)),
                    ["server0"],
                    lr=0.1,
                    worker=1,
                    rendezvous=rdv,
                    part="front",
                )
            # a push of a name the servers do not hold
            with pytest.raises(HybridCommError, match="stray: not held by this shard"):
                first.links[0].push({"stray": torch.ones(1)})
                first.links[0].finish_push()
            second = DownpourSGD(
                nn.Sequential(nn.Linear(4, 3)),
                ["server0"],
                lr=0.1,
                worker=1,
                rendezvous=rdv,
                part="front",
            )
            second.close()
        finally:
            first.close()
            t.join(timeout=10)
    with pytest.raises(HybridCommError, match="0 <= stage < len"):
        DownpourStage(
            nn.Linear(2, 2), ["server0"], lr=0.1, stage=2, peers=[0, 1], worker=0, rendezvous=rdv
        )
    with pytest.raises(HybridCommError, match="init_process_group first"):
        DownpourStage(
            nn.Linear(2, 2), ["server0"], lr=0.1, stage=0, peers=[0, 1], worker=0, rendezvous=rdv
        )
    with pytest.raises(HybridCommError, match="needs loss_fn"):
        DownpourStage(
            nn.Linear(2, 2), ["server0"], lr=0.1, stage=0, peers=[0], worker=0, rendezvous=rdv
        )


def _claimed_twice(rank, world):
    if rank == 1:  # rank 1 says it is stage 0 too (refused before any server is asked)
        DownpourStage(
            nn.Linear(2, 2),
            ["127.0.0.1:1"],
            lr=0.1,
            stage=0,
            peers=[0, 1],
            worker=rank,
            loss_fn=F.mse_loss,
        )


def test_a_stage_claimed_by_the_wrong_rank_is_refused():
    results = run_ranks(2, _claimed_twice, allow_errors=True, timeout=60)
    assert results[0] is None
    assert "stage 0 of peers [0, 1] is rank 0, but this process is rank 1" in results[1]


def _silent_first_stage(rank, world, rdv):
    role, _ = init_downpour(rank, STAGES, world - STAGES, f"file://{rdv}", timeout=10)
    if role == "server":
        return serve(timeout=10)
    pipe = DownpourStage(
        _stages()[rank],
        ["server0"],
        lr=0.1,
        stage=rank,
        peers=[0, 1],
        loss_fn=F.mse_loss,
        timeout=1,
    )
    error = None
    if rank == 0:
        time.sleep(2)  # never sends its activations
    else:
        t0 = time.monotonic()
        with pytest.raises(HybridCommTimeout, match="receiving from rank 0") as e:
            pipe.step(y=torch.zeros(16, 3))
        error = (time.monotonic() - t0, str(e.value))
    pipe.close()
    return error


def test_a_stage_whose_peer_is_silent_raises_within_its_timeout():
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(STAGES + 1, _silent_first_stage, os.path.join(tmp, "rdv"), timeout=60)
    waited, message = results[1]
    assert 0.9 < waited < 5, message  # the 1 s timeout, not the process group's 60 s
