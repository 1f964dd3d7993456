"""The Python stack from the hook to the wire, recorded, against docs/ARCHITECTURE.md.

At every call of the transport's ``exchange`` (a schedule step's sends and
receives: the wire) each rank records the stack, and at every submission to
the channel the submitter's. A trace is the stack of the call that submitted
the operation, from where the gradient entered (the hook; none mode:
``step()``), followed by the stack that runs it from the channel on: the host
channel's worker or the NCCL communicator's thread across the hand-off, or the
trainer's own thread where the channel runs it there (in the submit, or in a
wait for an operation the worker has not started). Two checks on every trace:

* its files are the ones the table "How many files from the hook to the wire" in
  docs/ARCHITECTURE.md lists for that path (parsed from the doc, so the doc stays
  true), as many as its count column says;
* every frame on it is a named function or method: no ``<lambda>``, no function
  nested in another (``<locals>``), so a stack trace or a breakpoint shows the steps.

Backward and forward mode from the gradient hook, none mode from ``step()``; on
the host path (gloo) and on the simulated GPU (CuPy NCCL's transport, its
communicator's thread).
"""

import os
import re
import sys

import pytest
import torch
import torch.nn as nn

import hybridcomm
from multiproc import run_ranks
from optim_models import batch, make_model, shard

PACKAGE = os.path.dirname(os.path.abspath(hybridcomm.__file__)) + os.sep
DOC = os.path.join(os.path.dirname(PACKAGE.rstrip(os.sep)), "docs", "ARCHITECTURE.md")
HOOK, STEP = "sync/grad_hooks.py", "optimizer.py"  # where a traced path starts
CHANNEL = ("comm/channel.py", "comm/transport/comm_thread.py")  # where it is run
STEPS = 5
# what is traced: name -> (overlap, compression); top-k's and PowerSGD's buckets
# are operations of their own (comm/engine.py)
MODES = {
    "backward": ("backward", None),
    "forward": ("forward", None),
    "none": ("none", None),
    "topk": ("backward", "topk:0.25"),
    "powersgd": ("forward", "powersgd:1:1"),
}
OWN_OPERATION = {"topk": "TopkReduction.", "powersgd": "LowRankReduction."}


def doc_table() -> dict:
    """The table under "How many files from the hook to the wire": row label ->
    (the files it lists, its count)."""
    with open(DOC) as f:
        text = f.read()
    section = text.split("### How many files from the hook to the wire", 1)[1]
    table = section[section.index("\n|") + 1 :].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[2].isdigit():
            continue  # (the header and its rule)
        rows[cells[0]] = (re.findall(r"`([\w/]+\.py)`", cells[1]), int(cells[2]))
    return rows


def doc_row(mode: str, path: str):
    rows = doc_table()
    found = [k for k in rows if k.startswith(mode) and path in k]
    assert len(found) == 1, (mode, path, list(rows))
    return found[0], rows[found[0]]


def _frames(frame) -> list:
    """``(file under the package or None, qualified name)`` of each frame, outermost
    first."""
    out = []
    while frame is not None:
        name = frame.f_code.co_filename
        out.append((name[len(PACKAGE) :] if name.startswith(PACKAGE) else None, frame))
        frame = frame.f_back
    return [(f, fr.f_code.co_qualname) for f, fr in reversed(out)]


def _from_origin(frames: list) -> list:
    """The package's frames from the first one in the hook's or step()'s file on (none
    where neither is on the stack: a launch at a pass's end)."""
    for i, (f, _) in enumerate(frames):
        if f in (HOOK, STEP):
            return [(f, q) for f, q in frames[i:] if f is not None]
    return []


def _from_channel(frames: list) -> list:
    """The package's frames from the channel on: its worker or the communicator's
    thread, or the call that runs the operation in the trainer's thread (the submit,
    or a wait that runs an operation not started yet)."""
    for i, (f, _) in enumerate(frames):
        if f in CHANNEL:
            return [(f, q) for f, q in frames[i:] if f is not None]
    raise AssertionError(f"the operation ran outside the channel: {frames}")


def _operation_on(frame, submitted: dict):
    """The submitted operation that a frame on this stack runs (a local of one), and
    the stack that submitted it."""
    f = frame
    while f is not None:
        for v in list(f.f_locals.values()):
            hit = submitted.get(id(v))
            if hit is not None and hit[0] is v:
                return hit
        f = f.f_back
    raise AssertionError(f"an exchange outside any submitted operation: {_frames(frame)}")


def _traced_run(rank, world, simulate):
    if simulate:
        os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "1"
    from hybridcomm.comm.channel import HostChannel, StreamChannel
    from hybridcomm.comm.transport.cupy_nccl import CupyNcclTransport
    from hybridcomm.comm.transport.torch_dist import TorchDistTransport

    submitted = {}  # id(operation) -> (operation, the submitter's frames)
    traces = []  # (mode, the traced path: (file, qualified name) from origin to the wire)
    mode = [None]

    def recording_submit(cls):
        submit = cls.submit

        def recorded(self, fn, *args, **kwargs):
            submitted[id(fn)] = (fn, _frames(sys._getframe(1)))
            return submit(self, fn, *args, **kwargs)

        cls.submit = recorded

    def recording_exchange(cls):
        exchange = cls.exchange
        wire = sys.modules[cls.__module__].__file__[len(PACKAGE) :]

        def recorded(self, *args, **kwargs):
            frame = sys._getframe(1)
            _, submitter = _operation_on(frame, submitted)
            path = _from_origin(submitter) + _from_channel(_frames(frame))
            traces.append((mode[0], path + [(wire, f"{cls.__name__}.exchange")]))
            return exchange(self, *args, **kwargs)

        cls.exchange = recorded

    for cls in (HostChannel, StreamChannel):
        recording_submit(cls)
    for cls in (TorchDistTransport, CupyNcclTransport):
        recording_exchange(cls)
    for name, (overlap, compression) in MODES.items():
        mode[0] = name
        # forward mode defers its updates to the next forward whatever the plan says
        os.environ["HYBRIDCOMM_DEFER"] = "always" if overlap == "forward" else "measured"
        model = make_model()
        opt = hybridcomm.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            model=model,
            overlap=overlap,
            compression=compression,
            fusion_bytes=0,
            cost_model="default",
            measure_iters=2,
            timeout=60,
        )
        for s in range(STEPS):
            x, y = batch(s)
            opt.zero_grad()
            nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
            opt.step()
        opt.synchronize()
        opt.close()
        submitted.clear()
    return traces


@pytest.fixture(scope="module", params=["host", "simgpu"])
def traces(request):
    simulate = request.param == "simgpu"
    ranks = run_ranks(2, _traced_run, simulate, timeout=240)
    return request.param, [t for rank in ranks for t in rank]


def test_the_doc_table_counts_its_own_files():
    rows = doc_table()
    assert len(rows) >= 4, rows
    for label, (files, count) in rows.items():
        assert files and len(files) == len(set(files)) == count, (label, files, count)
        for f in files:
            assert os.path.isfile(os.path.join(PACKAGE, f)), (label, f)


@pytest.mark.parametrize("mode", list(MODES))
def test_the_stack_from_the_hook_to_the_wire_is_the_docs(traces, mode):
    """Every traced path of ``mode`` starts where the doc's row says (the hook; none
    mode: ``step()``) and crosses exactly the files the row lists."""
    path_kind, recorded = traces
    label, (files, count) = doc_row(
        "none" if mode == "none" else "backward and forward",
        "host" if path_kind == "host" else "CuPy NCCL",
    )
    origin = STEP if mode == "none" else HOOK
    mine = [path for m, path in recorded if m == mode and path[0][0] == origin]
    assert mine, f"no exchange of {mode} mode was traced from {origin}"
    for path in mine:
        seen = {f for f, _ in path}
        assert seen == set(files), (
            f"{label}: the stack crosses {sorted(seen)}, the doc lists {sorted(files)}; "
            f"the stack: {_readable(path)}"
        )
        assert len(seen) == count
    if mode in OWN_OPERATION:  # (the compressed buckets were traced, not only exact ones)
        assert any(q.startswith(OWN_OPERATION[mode]) for p in mine for _, q in p), mode


def _readable(path) -> str:
    return " -> ".join(f"{f}: {q}" for f, q in path)


def test_no_frame_from_the_hook_to_the_wire_is_a_lambda_or_a_nested_function(traces):
    path_kind, recorded = traces
    assert recorded
    for mode, path in recorded:
        unnamed = [(f, q) for f, q in path if "<lambda>" in q or "<locals>" in q]
        assert not unnamed, f"{path_kind}, {mode} mode: {unnamed} in {_readable(path)}"
