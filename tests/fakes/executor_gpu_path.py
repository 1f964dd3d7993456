"""The executor's stream-ordered GPU path, as proposed for hybridcomm/executor.py.

Kept here, line for line the proposal, so the fake tests (and tests/gpu) run
it until executor.py carries it; then they should call the executor instead.
"""
from hybridcomm import trace
from hybridcomm.kernels import reduce


def execute_async(schedule, buf, transport, *, scale=None, scratch=None, ready=None,
                  timeout=None):
    """Queue the whole schedule on the transport's comm stream; return its done event.

    The comm stream first waits for ``ready`` (default: the caller's stream as
    it is now). No host synchronization; ``timeout`` arms the watchdog.
    """
    streams = transport.streams
    if ready is None:
        ready = streams.new_event()
        ready.record(streams.current_stream())
    transport.wait_event(ready)
    n, itemsize = len(schedule.steps), buf.element_size()
    with transport.stream_context():
        for i, st in enumerate(schedule.steps):
            recvs, reductions, offset = [], [], 0
            for r in st.recvs:
                if r.reduce:
                    landing = scratch[offset:offset + r.stop - r.start]
                    offset += r.stop - r.start
                    reductions.append((r, landing))
                else:
                    landing = buf[r.start:r.stop]
                recvs.append((r.peer, landing))
            sends = [(s.peer, buf[s.start:s.stop]) for s in st.sends]
            with trace.step_range(schedule.algorithm, i, n, st, itemsize):
                transport.exchange(sends, recvs, label=(schedule.algorithm, i))
                for r, landing in reductions:
                    reduce(buf[r.start:r.stop], landing, scale=scale if r.final else None)
    done = transport.record_event()
    if timeout is not None:
        transport.watch(done, timeout, f"{schedule.algorithm} all-reduce of {buf.numel()}")
    return done
