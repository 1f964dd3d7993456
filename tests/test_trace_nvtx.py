"""NVTX ranges: names carry algorithm, bytes and peers; off means no work at all;
on CPU the real ``nvtx`` package is a cheap no-op (torch.cuda.nvtx is never used)."""

import pytest

from hybridcomm.base import trace
from hybridcomm.algorithms import get_schedule


@pytest.fixture(autouse=True)
def restore():
    yield
    trace.set_nvtx(None)


class RecordingDomain:
    def __init__(self):
        self.log = []

    def get_event_attributes(self, message=None, color=None):
        return (message, color)

    def push_range(self, attributes):
        self.log.append(("push", attributes[0]))

    def pop_range(self):
        self.log.append(("pop",))


def test_names():
    st = get_schedule("ring", 0, 3, 48).steps[0]  # three aligned chunks of 16 elements
    assert trace.step_range_name("ring", 0, 4, st, 4) == "ring step 1/4 send 64B->1 recv 64B<-2"
    assert trace.bucket_range_name(3, "butterfly", 3 << 20, 8) == "bucket 3 butterfly 3M P=8"


def test_env_rules():
    assert trace._nvtx_wanted({"HYBRIDCOMM_NVTX": "1"})
    assert not trace._nvtx_wanted({"HYBRIDCOMM_NVTX": "0", "NVTX_INJECTION64_PATH": "/x.so"})
    assert trace._nvtx_wanted({"NVTX_INJECTION64_PATH": "/opt/nsys/libToolsInjection64.so"})
    assert not trace._nvtx_wanted({})


def test_off_formats_nothing(monkeypatch):
    trace.set_nvtx(False)
    monkeypatch.setattr(trace, "step_range_name", lambda *a: pytest.fail("formatted while off"))
    monkeypatch.setattr(trace, "bucket_range_name", lambda *a: pytest.fail("formatted while off"))
    st = get_schedule("ring", 0, 2, 2).steps[0]
    with trace.bucket_range(0, "ring", 8, 2), trace.step_range("ring", 0, 2, st, 4):
        pass
    assert not trace.nvtx_enabled()


def test_on_pushes_nested_ranges(monkeypatch):
    dom = RecordingDomain()
    monkeypatch.setattr(trace, "_domain", dom)
    sched = get_schedule("halving_doubling", 1, 4, 16)
    with trace.bucket_range(7, sched.algorithm, 64, 4):
        for i, st in enumerate(sched.steps):
            with trace.step_range(sched.algorithm, i, len(sched.steps), st, 4):
                pass
    names = [e[1] for e in dom.log if e[0] == "push"]
    assert names[0] == "bucket 7 halving_doubling 64B P=4"
    peer = sched.steps[0].sends[0].peer
    assert names[1].startswith(f"halving_doubling step 1/{len(sched.steps)} send 32B->{peer} ")
    assert len(names) == 1 + len(sched.steps)
    assert [e[0] for e in dom.log] == ["push"] + ["push", "pop"] * len(sched.steps) + ["pop"]


def test_real_nvtx_is_a_no_op_on_cpu():
    try:
        import nvtx  # noqa: F401
    except ImportError:
        pytest.skip("nvtx not installed")
    assert trace.set_nvtx(True)
    st = get_schedule("butterfly", 0, 2, 4).steps[0]
    for _ in range(3):
        with trace.bucket_range(0, "butterfly", 16, 2), trace.step_range("butterfly", 0, 1, st, 4):
            pass


def test_buckets_and_steps_show_in_a_torch_profiler_trace():
    import torch

    from hybridcomm.algorithms import get_schedule

    st = get_schedule("ring", 0, 4, 40).steps[0]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with trace.bucket_range(2, "ring", 160, 4):
            with trace.step_range("ring", 0, 6, st, 4):
                torch.ones(3).sum()
    names = {e.name for e in prof.events()}
    assert "hybridcomm: bucket 2 ring 160B P=4" in names
    assert any(n.startswith("hybridcomm: ring step 1/6") for n in names)
    assert trace.bucket_range(2, "ring", 160, 4) is trace._NULL or trace.nvtx_enabled()
