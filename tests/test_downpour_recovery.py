"""Downpour's parameter servers survive SIGKILL: a restarted shard resumes from its
checkpoint and the workers replay what it missed (bitwise with one worker, no
update lost with several); pushes beyond the replay log are counted, not
hidden. Also the wire format's checks, the loopback default, and clear errors.

Servers are real processes (forked) on 127.0.0.1 with free ports; every test
kills what it started."""

import contextlib
import multiprocessing as mp
import os
import socket
import tempfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hybridcomm import HybridCommError
from hybridcomm.strategies import DownpourSGD, init_downpour, serve
from hybridcomm.strategies.downpour import wire as ps_wire
from hybridcomm.strategies.downpour.server import ParameterShard, ShardServer
from optim_models import ConvNet, batch, flat, make_model

CTX = mp.get_context("fork")
STEPS = 20


def _serve(index, rdv, workers, every):
    torch.set_num_threads(1)
    serve(index=index, workers=workers, rendezvous=rdv, checkpoint_every=every, timeout=10)


@contextlib.contextmanager
def _servers(rdv, n, workers, every):
    """``n`` server processes; the test may kill and restart ``procs[i]``."""
    procs = {}

    def start(i):
        procs[i] = CTX.Process(target=_serve, args=(i, rdv, workers, every), daemon=True)
        procs[i].start()

    for i in range(n):
        start(i)
    try:
        yield procs, start
        for p in procs.values():
            p.join(timeout=10)
            assert p.exitcode == 0, "a server did not stop cleanly"
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
            p.join()


def _kill(procs, i):
    procs[i].kill()  # SIGKILL: no chance to checkpoint or say goodbye
    procs[i].join()


def _train(rdv, rule, kill_at=None, every=5, replay_log=None):
    """One worker, two shards, ``STEPS`` deterministic steps; server 0 killed after
    step ``kill_at`` and started again. Returns (params, opt, pushes per shard)."""
    with _servers(rdv, 2, 1, every) as (procs, start):
        model = make_model()
        opt = DownpourSGD(
            model,
            ["server0", "server1"],
            lr=0.05,
            rule=rule,
            timeout=10,
            worker=0,
            rendezvous=rdv,
            replay_log=replay_log,
        )
        for s in range(STEPS):
            x, y = batch(s)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
            if s + 1 == kill_at:
                _kill(procs, 0)
                start(0)
        opt.close()
    pushes = [
        torch.load(os.path.join(rdv, f"server{i}.pt"), weights_only=True)["pushes"]
        for i in range(2)
    ]
    return flat(model.parameters()), opt, pushes


@pytest.mark.parametrize("rule", ["sgd", "adagrad"])
def test_a_server_killed_mid_training_resumes_bitwise_with_one_worker(rule):
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        straight, _, _ = _train(a, rule)
        resumed, opt, pushes = _train(b, rule, kill_at=13)
    assert torch.equal(resumed, straight)
    # checkpoints at pushes 5 and 10; 11-13 applied, then lost with the process;
    # push 14 went to the dead one: all four replayed from the log
    assert (opt.reconnects, opt.replayed, opt.lost) == (1, 4, 0)
    assert pushes == [STEPS, STEPS]


def test_pushes_beyond_the_replay_log_are_counted_lost():
    with tempfile.TemporaryDirectory() as rdv:
        _, opt, pushes = _train(rdv, "sgd", kill_at=7, every=100, replay_log=2)
    # only the set-up checkpoint (0 pushes); the log holds 7 and 8 when the
    # reconnect comes (push 8 went to the dead server): 1-6 are lost
    assert (opt.reconnects, opt.replayed, opt.lost) == (1, 2, 6)
    assert pushes == [STEPS - 6, STEPS]


def _ones_worker(rank, rdv, steps, signal, out):
    """Every push is ones at lr 1 from zeros: a lost or doubled push shows in the sum."""
    torch.set_num_threads(1)
    import time

    model = nn.Linear(4, 3)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt = DownpourSGD(
        model, ["server0", "server1"], lr=1.0, timeout=10, worker=rank, rendezvous=rdv
    )
    for s in range(steps):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        if rank == 0 and s == steps // 3:
            signal.set()
        time.sleep(0.02)
    opt.close()
    out.put((rank, opt.reconnects, opt.replayed, opt.lost))


def test_several_workers_lose_no_update_across_a_server_restart():
    workers, steps = 3, 30
    signal, out = CTX.Event(), CTX.Queue()
    with tempfile.TemporaryDirectory() as rdv:
        with _servers(rdv, 2, workers, 7) as (procs, start):
            ws = [
                CTX.Process(target=_ones_worker, args=(r, rdv, steps, signal, out), daemon=True)
                for r in range(workers)
            ]
            try:
                for w in ws:
                    w.start()
                assert signal.wait(timeout=30)
                _kill(procs, 0)
                start(0)
                results = sorted(out.get(timeout=60) for _ in ws)
            finally:
                for w in ws:
                    w.join(timeout=10)
                    if w.is_alive():
                        w.kill()
                        w.join()
        final = [
            torch.load(os.path.join(rdv, f"server{i}.pt"), weights_only=True) for i in range(2)
        ]
    assert [f["pushes"] for f in final] == [workers * steps] * 2  # every push, once
    for f in final:
        for v in f["params"].values():
            assert torch.equal(v, torch.full_like(v, -workers * steps))
    assert all(r[3] == 0 for r in results), results  # nothing lost
    assert sum(r[1] for r in results) == workers  # each worker reconnected to server0 once


def test_wire_round_trips_tensors_and_rejects_malformed_messages(monkeypatch):
    monkeypatch.setattr(ps_wire, "_PART", 40)  # large payloads arrive in parts: test the joins
    a, b = socket.socketpair()
    with a, b:
        tensors = {
            "f": torch.randn(3, 5),
            "h": torch.randn(7).half(),
            "bf": torch.randn(2, 3).bfloat16(),
            "d": torch.randn(()).double(),
            "empty": torch.zeros(0, 4),
            "strided": torch.randn(4, 6)[:, ::2],
        }
        ps_wire.send(a, {"op": "x", "n": [1, 2]}, tensors, timeout=5)
        header, got = ps_wire.recv(b, timeout=5)
        assert header == {"op": "x", "n": [1, 2]} and list(got) == list(tensors)
        for k, t in tensors.items():
            assert got[k].dtype == t.dtype and torch.equal(got[k], t)
        with pytest.raises(HybridCommError, match="dtype"):
            ps_wire.send(a, {"op": "x"}, {"i": torch.ones(2, dtype=torch.int64)}, timeout=5)

        def raw(head, payload=b"", magic=ps_wire.MAGIC):
            a.sendall(ps_wire._PREFIX.pack(magic, len(head), len(payload)) + head + payload)
            with pytest.raises(HybridCommError) as e:
                ps_wire.recv(b, timeout=5)
            return str(e.value)

        assert "not JSON" in raw(b"\x80\x04pickle")
        assert "bad tensor" in raw(b'{"op": "x", "tensors": [["w", "object", [1]]]}', bytes(8))
        assert "too short" in raw(b'{"op": "x", "tensors": [["w", "float32", [4]]]}', bytes(8))
        assert "payload is" in raw(b'{"op": "x", "tensors": [["w", "float32", [1]]]}', bytes(16))
        assert "magic" in raw(b"{}", magic=b"EVIL")
    with pytest.raises(HybridCommError, match="timed out"):
        c, d = socket.socketpair()
        with c, d:
            ps_wire.recv(c, timeout=0.1)


def test_a_server_listens_on_loopback_by_default_and_publishes_its_address():
    with tempfile.TemporaryDirectory() as rdv:
        server = ShardServer(3, workers=1, rendezvous=rdv, timeout=5)
        try:
            host, port = server._listener.getsockname()[:2]
            assert host == "127.0.0.1" and port > 0
            assert ps_wire.lookup(rdv, "server3") == f"127.0.0.1:{port}"
        finally:
            server._listener.close()


def test_checkpoints_load_with_weights_only_and_a_finished_job_is_not_resumed():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "server0.pt")
        shard = ParameterShard({"w": torch.ones(3)}, "adagrad", 0.1, path=path, checkpoint_every=2)
        shard.hello(0, "s")
        for seq in (1, 2, 2):  # the second 2 is a replay: applied once
            shard.push({"w": torch.ones(3)}, 0, "s", seq)
        back = ParameterShard.restore(path)
        assert (back.pushes, back.workers, back.durable) == (2, {0: ["s", 2]}, {0: 2})
        assert torch.equal(back.params["w"], shard.params["w"])
        assert torch.equal(back.sums["w"], shard.sums["w"])
        shard.close(0)
        with pytest.raises(HybridCommError, match="finished job"):
            ShardServer(0, workers=1, checkpoint_dir=d, timeout=5)


def test_bad_input_is_a_clear_error():
    model = ConvNet()
    with pytest.raises(ValueError, match="rule"):
        DownpourSGD(model, ["server0"], lr=0.1, rule="adam", worker=0, rendezvous="/nonexistent")
    with pytest.raises(ValueError, match="there must be servers"):
        DownpourSGD(model, [], lr=0.1, worker=0, rendezvous="/nonexistent")
    with pytest.raises(ValueError, match="neither host:port"):
        DownpourSGD(model, ["server0"], lr=0.1, worker=0)
    with pytest.raises(HybridCommError, match="file://"):
        init_downpour(0, 1, 1, "tcp://127.0.0.1:29500")
    with pytest.raises(ValueError, match="rendezvous directory or a checkpoint_dir"):
        ShardServer(0, workers=1, timeout=5)
    with socket.create_server(("127.0.0.1", 0)) as s:
        closed = f"127.0.0.1:{s.getsockname()[1]}"  # a free port nobody listens on
    with pytest.raises(HybridCommError, match="unreachable for 0.5s"):
        DownpourSGD(model, [closed], lr=0.1, worker=0, timeout=0.5)


def test_a_worker_that_disagrees_with_the_shard_is_refused_by_name():
    import threading

    with tempfile.TemporaryDirectory() as rdv:
        server = ShardServer(0, workers=1, rendezvous=rdv, timeout=10)
        t = threading.Thread(target=server.run)
        t.start()
        try:
            first = DownpourSGD(nn.Linear(4, 3), ["server0"], lr=0.1, worker=0, rendezvous=rdv)
            with pytest.raises(
                HybridCommError,
                match="server0 refused setting up its shard.*asked for sgd at lr 0.2",
            ):
                DownpourSGD(nn.Linear(4, 3), ["server0"], lr=0.2, worker=1, rendezvous=rdv)
            with pytest.raises(
                HybridCommError,
                match=r"\(4, 4\) does not match the shard's "
                r"torch.float32 \(3, 4\)",
            ):
                DownpourSGD(nn.Linear(4, 4), ["server0"], lr=0.1, worker=2, rendezvous=rdv)
        finally:
            first.close()
            t.join(timeout=10)
