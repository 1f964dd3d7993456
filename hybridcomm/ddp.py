"""hybridcomm's all-reduce as a DDP communication hook (backward overlap).

For code that configures DDP rather than wrapping the optimizer::

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    hybridcomm.ddp.register(ddp)        # register_comm_hook + the set-up, before training

Each DDP bucket is averaged with the cost model's algorithm for its size,
through the optimizer's one ordered channel; the result equals DDP's (up to
summation order), bitwise identical on every rank. No forward overlap: DDP
waits for every hook before ``step()``. Details: docs/API.md, "hybridcomm.ddp";
frameworks: docs/INTEGRATIONS.md.
"""

import logging
from typing import Dict, Optional

import torch
import torch.distributed as dist

from .comm import calibration, control
from .config import env
from .comm.channel import open_channel
from .collectives import resolve_algorithm
from .plan.cost_model import MODELED, NATIVE, CostModel
from .comm.executor import reduce_operation

log = logging.getLogger("hybridcomm")

# auto's three plus the process group's own all-reduce where the agreed model
# measured it (DDP's ``native`` baseline); not hierarchical, which the hook never offered.
_CANDIDATES = MODELED + (NATIVE,)


class HybridState:
    """State of :func:`hybrid_hook`: the process group, the cost model, the channel.

    Args:
        process_group: the group DDP reduces over (None: the world).
        cost_model: a ``CostModel``; None: rank 0's saved calibration, else a probe;
            ``"probe"``: always probe; ``"default"``: the built-in constants.
        timeout: seconds any wait may take (default ``HYBRIDCOMM_TIMEOUT``).

    Picklable, as ``PowerSGDState`` is: the group and the channel are not
    pickled; they are made again (collectively) on first use after unpickling.

    Example::

        >>> ddp = torch.nn.parallel.DistributedDataParallel(model)
        >>> state = hybridcomm.ddp.HybridState()
        >>> ddp.register_comm_hook(state, hybridcomm.ddp.hybrid_hook)
        >>> x, y = loader[0]; loss_fn(ddp(x), y).backward()
        >>> state.algorithms        # {bucket index: algorithm}, filled as buckets run
        {0: 'butterfly'}
    """

    __slots__ = (
        "process_group",
        "cost_model",
        "timeout",
        "algorithms",
        "_transport",
        "_channel",
        "_world",
    )

    def __init__(
        self,
        process_group=None,
        cost_model: Optional[CostModel] = None,
        timeout: Optional[float] = None,
    ):
        if not (
            cost_model is None
            or isinstance(cost_model, CostModel)
            or cost_model in ("default", "probe")
        ):
            raise ValueError(
                f"cost_model must be a CostModel, None, 'probe' or 'default', got {cost_model!r}"
            )
        self.process_group = process_group
        self.cost_model = cost_model
        self.timeout = env.timeout(timeout)
        self.algorithms: Dict[int, str] = {}
        self._transport = self._channel = None
        self._world = 0

    def __getstate__(self):
        return {
            "cost_model": self.cost_model,
            "timeout": self.timeout,
            "algorithms": dict(self.algorithms),
        }

    def __setstate__(self, state):
        self.process_group = None  # as PowerSGDState: the default group after unpickling
        self.cost_model, self.timeout = state["cost_model"], state["timeout"]
        self.algorithms = state["algorithms"]
        self._transport = self._channel = None
        self._world = 0

    def prepare(self, device) -> "HybridState":
        """Agree on the cost model and make the channel for ``device`` now
        (collective: every rank of the group calls it). Idempotent; ``register``
        calls it, else the first hook call does (and logs it): the set-up (a
        start-up probe unless one was saved, the NCCL communicator) is slow, and
        the first backward should not pay it."""
        control.require_initialized("hybridcomm.ddp.HybridState.prepare")
        if self._world:
            return self
        device = torch.device(device)
        self._world = dist.get_world_size(self.process_group)
        if isinstance(self.cost_model, str):  # "default" or "probe": the same on every rank
            self.cost_model = calibration.resolve(self.cost_model, self.process_group, self.timeout)
        else:  # given or saved on rank 0: rank 0's
            self.cost_model = calibration.agree(
                self.cost_model, group=self.process_group, timeout=self.timeout
            )
        self._transport, self._channel = open_channel(device, self.process_group, self.timeout)
        return self

    def algorithm(self, index: int, nbytes: int) -> str:
        """The algorithm for DDP bucket ``index`` (chosen once, from its size): ``auto``'s
        choice under the agreed cost model, with ``native`` competing
        (``HYBRIDCOMM_ALGO`` forces one)."""
        algo = self.algorithms.get(index)
        if algo is None:
            algo = resolve_algorithm(
                "auto", nbytes, self._world, model=self.cost_model, candidates=_CANDIDATES
            )
            self.algorithms[index] = algo
            log.info("hybridcomm DDP hook: bucket %d, %d bytes -> %s", index, nbytes, algo)
        return algo


def hybrid_hook(state: HybridState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average ``bucket``'s gradients with hybridcomm.

    Register with ``ddp_model.register_comm_hook(HybridState(), hybrid_hook)``.
    DDP launches buckets in index order on every rank, so every rank issues them
    in one order. The bucket goes through the same one ordered channel (and the same
    ``executor.reduce_operation``) as the optimizer's buckets. On a GPU the
    reduction waits for an event on the caller's current stream (where DDP wrote
    the bucket), whichever thread issues it. The future completes with the
    averaged buffer; on CUDA it is bound to the comm stream, so DDP's wait is a
    stream wait, not a host synchronization.
    """
    buf = bucket.buffer()
    if not state._world:
        log.info(
            "hybridcomm DDP hook: setting up inside the first backward (agreement, "
            "probe, communicator); hybridcomm.ddp.register(ddp) does it at registration"
        )
        state.prepare(buf.device)
    t, channel = state._transport, state._channel
    nbytes = buf.numel() * buf.element_size()
    name = state.algorithm(bucket.index(), nbytes)
    what = f"DDP bucket {bucket.index()} ({name}, {nbytes} bytes)"
    ready = None
    if channel.stream_ordered:
        rt = t.runtime
        rt.expect_write(buf)  # the reducer's copies into the bucket (for the simulator)
        # DDP wrote the bucket (in autograd's hooks) on this thread's current stream:
        # the reduction waits for it there (an issuing thread's is another stream).
        ready = rt.new_event()
        ready.record(rt.current_stream())
    op = reduce_operation(
        buf,
        t,
        name,
        scale=1.0 / state._world,
        timeout=state.timeout,
        label=what,
        range_id=f"DDP {bucket.index()}",
        ready=ready,
        stream_ordered=channel.stream_ordered,
    )
    if channel.stream_ordered:  # device path: queued on the comm stream
        channel.take_busy()  # forget finished operations' timing events (no host sync)
        channel.submit(op, what)  # issued when it returns (by an issuing thread or here)
        if not buf.is_cuda:  # the simulated GPU: a CPU tensor's future has no stream
            return rt.stream_future(buf, t.stream)
        fut = torch.futures.Future(devices=[buf.device])
        with t.stream_context():
            fut.set_result(buf)  # recorded on the comm stream, after the work
        return fut
    fut = torch.futures.Future()

    def run():
        try:
            op()
        except BaseException as e:
            fut.set_exception(e)
            raise
        fut.set_result(buf)

    channel.submit(run, what)
    return fut


def register(
    ddp: torch.nn.parallel.DistributedDataParallel, state: Optional[HybridState] = None
) -> HybridState:
    """Register :func:`hybrid_hook` on ``ddp`` and set it up now (collective).

    ``state`` defaults to a ``HybridState`` on the DDP model's process group.
    Returns the state (its ``algorithms`` fill in as buckets run).

    Example::

        >>> ddp = torch.nn.parallel.DistributedDataParallel(model)
        >>> state = hybridcomm.ddp.register(ddp)      # every rank, before training
    """
    if state is None:
        group = ddp.process_group if ddp.process_group is not dist.group.WORLD else None
        state = HybridState(process_group=group)
    ddp.register_comm_hook(state, hybrid_hook)
    return state.prepare(next(ddp.module.parameters()).device)
