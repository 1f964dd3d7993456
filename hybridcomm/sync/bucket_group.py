"""The buckets of one plan: their memory, their phases, their engine.

Each parameter's ``.grad`` is a view of its bucket's contiguous buffer
(buckets.py): backward accumulates into it in place, the all-reduce runs in
place, and the optimizer reads it. A bucket's host-side state
(:class:`BucketState`) moves through the phases of ``EDGES``, written only by
:meth:`BucketGroup.to`. A bucket's path and phases: docs/ARCHITECTURE.md.

Example::

    group = BucketGroup(plan, params, names, links, config, state=StepState())
    group.open(group.states[0]); group.launch(group.states[0])
    group.consume(group.states[0])       # waits: .grad holds the reduced gradients
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass
from operator import attrgetter, is_
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..algorithms import REDUCE_SCATTER
from ..algorithms.lowrank import POWERSGD
from ..algorithms.topk import TOPK
from ..base.errors import HybridCommError
from ..comm.compression import TopK
from ..comm.engine import CommEngine
from ..comm.powersgd import PowerSGD
from ..config.config import SyncConfig
from ..plan.planner import Plan
from . import grad_fields
from .buckets import GradBucket, copy_into
from .join import ROUND
from .memory import Allocator
from .scatter import is_released, unscatter
from .used import UsedAgreement

log = logging.getLogger("hybridcomm")


class Phase(enum.Enum):
    IDLE = "idle"  # not in a round: holds the last reduced gradients, or nothing
    ACCUMULATING = "accumulating"  # backward adds this rank's gradients into the views
    LAUNCHED = "launched"  # waits for its turn in the issue order: not to be touched
    IN_FLIGHT = "in flight"  # issued: neither read nor written until waited for
    PENDING = "pending"  # forward mode: step() took it; the update waits for a first read

    # The members are singletons: hashed by identity, in C. (Enum's own hash is a Python
    # call, ~1K instructions a look-up in EDGES or GUARDED, several per bucket and step.)
    __hash__ = object.__hash__


# The edges BucketGroup.to accepts:
#
#   IDLE --first gradient of a round--> ACCUMULATING --launch--> LAUNCHED
#   LAUNCHED --the issue order reaches it (engine)--> IN_FLIGHT
#   IN_FLIGHT --finish (step, synchronize)--> IDLE      .grad: the reduced gradients
#   IN_FLIGHT --defer (forward-mode step)--> PENDING --first read--> IDLE
#   IN_FLIGHT --another gradient (late pass, or dropped)--> ACCUMULATING
#   IDLE --defer (reduced by synchronize(), then step())--> PENDING
#   ACCUMULATING --finish with nothing added (a no-op round)--> IDLE
#
# A LAUNCHED bucket is never written: its launch waits for its turn in the plan's
# fixed issue order, so a gradient that comes meanwhile goes into a tensor of
# autograd's own (``detached``), folded in when the bucket next opens.
EDGES = {
    Phase.IDLE: {Phase.IDLE, Phase.ACCUMULATING, Phase.PENDING},
    Phase.ACCUMULATING: {Phase.ACCUMULATING, Phase.LAUNCHED, Phase.IDLE},
    Phase.LAUNCHED: {Phase.IN_FLIGHT},
    Phase.IN_FLIGHT: {Phase.IDLE, Phase.ACCUMULATING, Phase.PENDING},
    Phase.PENDING: {Phase.IDLE},
}
_IS_SPARSE, _GRAD = attrgetter("is_sparse"), attrgetter("grad")
# where autograd must not add into a bucket's views unchecked (grad_hooks.py arms
# the parameters' pre-hooks there, and under shard while its buffer is reduce-scattered)
GUARDED = frozenset({Phase.LAUNCHED, Phase.IN_FLIGHT, Phase.PENDING})


def wants_guard(s: "BucketState") -> bool:
    """Whether autograd must not add into bucket ``s``'s views unchecked: in a GUARDED
    phase, or holding a reduce-scattered buffer (shard.py: each rank's part alone
    is whole)."""
    return s.phase in GUARDED or s.scattered


class BucketState:
    """A bucket's bookkeeping on the host (its memory is ``bucket``)."""

    __slots__ = (
        "index",
        "bucket",
        "_phase",
        "content",
        "touched",
        "pass_id",
        "launched_pass",
        "launched_epoch",
        "launched_at",
        "complete",
        "hyper",
        "taken",
        "reopened",
        "detached",
        "marked",
        "agreed",
        "gathered",
        "scattered",
        "guards",
        "armed",
        "closer",
        "closer_steps",
        "closed_in",
        "kept",
        "zeroed",
        "rebound",
    )

    def __init__(self, index: int, bucket: GradBucket):
        self.index, self.bucket = index, bucket
        self._phase = Phase.IDLE
        self.content: set = set()  # positions whose view holds a gradient (local or reduced)
        self.touched: set = set()  # positions autograd added to in pass ``pass_id``
        self.pass_id = -1
        self.launched_pass = -1
        self.launched_epoch = -1  # the step state's epoch at its last launch
        self.launched_at = None  # a clock stamp, on measured launches only
        self.complete = False  # launched with a gradient at every position
        self.hyper = None  # PENDING: the hyper-parameters of the deferring step()
        self.taken: set = set()  # PENDING: positions whose .grad the step took (not zeroed)
        self.zeroed = False  # PENDING: zero_grad() since: .grad reads None (deferred.py)
        # PENDING: a .grad of its parameters may have been written since step() (True:
        # not known; False: each field is as step() found it, not read again: deferred.py)
        self.rebound = True
        self.reopened = False  # a gradient came after its launch: it must be launched again
        self.detached: set = set()  # positions whose late additions wait in autograd's tensor
        self.marked: List[int] = []  # the positions this rank launched with a gradient
        self.agreed = None  # control.HostMax over ``marked``, posted as the launch is issued
        self.gathered = None  # PENDING under shard: completes the parameters' all-gather
        self.scattered = False  # under shard: reduce-scattered, each rank's part alone whole
        self.guards: list = []  # its parameters' pre-hooks (grad_hooks.py)
        self.armed = False  # they are wanted on (BucketGroup.rearm)
        # grad_hooks.py: the position whose gradient completed it, in how many passes
        # in a row, and the last such pass
        self.closer, self.closer_steps, self.closed_in = -1, 0, -1
        self.kept = None  # kept_apart's list, found by the closer's hook for absorb to take

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def launched(self) -> bool:
        """Launched and not yet waited for (issued or not)."""
        return self._phase in (Phase.LAUNCHED, Phase.IN_FLIGHT)


def memory_beyond_gradients(bucket: GradBucket) -> Dict[str, int]:
    """Bytes a bucket holds beyond its parameters' gradients, by what they are for
    (alignment padding between views, the usage flags, the wire copy under
    compression, top-k's residual, velocity and gathered messages)."""
    item = bucket.buffer.element_size()
    grads = sum(v.numel() for v in bucket.views) * item
    extra = {"padding": bucket.grads.numel() * item - grads, "flags": bucket.flags.numel() * item}
    if bucket.wire is not None:
        extra["wire copy"] = bucket.wire.numel() * bucket.wire.element_size()
    tk = bucket.topk
    if tk is not None:
        for name in ("residual", "velocity", "gathered"):
            t = getattr(tk, name, None)
            if t is not None:
                extra[f"top-k {name}"] = t.numel() * t.element_size()
    lr = bucket.lowrank
    if lr is not None:
        for name, t in (("residual", lr.residual), ("P", lr.p), ("Q", lr.q)):
            extra[f"powersgd {name}"] = t.numel() * t.element_size()
    return extra


def _refuse_sparse(names: Sequence[str], pos: int, b: GradBucket) -> None:
    raise HybridCommError(
        f"parameter {names[b.spec.params[pos]]!r} has a sparse gradient; "
        "hybridcomm reduces dense gradients (sparse=True modules only on the CPU path)"
    )


def _log_memory(bucket: GradBucket) -> None:
    extra = memory_beyond_gradients(bucket)
    log.debug(
        "hybridcomm bucket %d: %d bytes of gradients, %d bytes more (%s)",
        bucket.spec.index,
        sum(v.numel() for v in bucket.views) * bucket.buffer.element_size(),
        sum(extra.values()),
        ", ".join(f"{k} {v}" for k, v in extra.items() if v),
    )


@dataclass
class StepState:
    """Counters the synchronizer's parts share; they outlive a re-plan's buckets."""

    steps: int = 0  # completed steps
    epoch: int = 0  # a step, or a closure call in one: each bucket launched once in it
    launches: int = 0  # buckets launched in all (the stall inspector compares them)
    exposed_s: float = 0.0  # the host waited for communication since the last step


@dataclass
class Links:
    """What a bucket group talks to (made once per synchronizer)."""

    channel: object
    transport: object
    alloc: Allocator
    used: UsedAgreement
    clock: object  # stamps on the planner's clock (the GPU's on a GPU)
    timeline: object
    rank: int
    world: int
    scale: Optional[float]  # 1/P for an average
    servers: object = None
    on_device: bool = False
    on_slow: Optional[Callable[[int], Optional[str]]] = None  # a wait turned slow
    slow_after: float = 0.0
    joining: object = None  # in a join context, while this rank trains (join.py: JoinState)
    guard: Optional[Callable[["BucketState", bool], None]] = None  # grad_hooks: GUARDED in, out


def kept_apart(b: GradBucket) -> Optional[list]:
    """``b``'s gradients if autograd (or the user) put every one in a tensor of its
    own: none None, none its view (checked in C); else None."""
    return grad_fields.kept_apart(b.params, b.views)


def _carry(s: BucketState, pos: int, old: BucketState, old_pos: int) -> None:
    """A re-plan: the old bucket's gradient (and error feedback) at ``old_pos`` moves
    to position ``pos`` of ``s``."""
    b = s.bucket
    if old.bucket.holds(old_pos):
        b.views[pos].copy_(old.bucket.views[old_pos])
        b.bind(pos)
        if old_pos in old.content:
            s.content.add(pos)
    # top-k's error feedback survives a re-plan (topk_state: None without top-k)
    carried = old.bucket.topk_state(old_pos) if b.topk is not None else None
    if carried is not None:
        for new_view, old_view in zip(b.topk_state(pos), carried):
            if new_view is not None and old_view is not None:
                new_view.copy_(old_view)
    # so do PowerSGD's error feedback and warm start (state: None where sent whole)
    if b.lowrank is not None and old.bucket.lowrank is not None:
        mine, theirs = b.lowrank.state(pos), old.bucket.lowrank.state(old_pos)
        if mine is not None and theirs is not None:
            for new_view, old_view in zip(mine, theirs):
                new_view.copy_(old_view)


class BucketGroup:
    """The buckets of ``plan`` over ``params`` and the engine that reduces them.

    ``carry``: the group this one replaces (a re-plan): the gradients its buckets
    held move into the new views, each ``.grad`` bound to its new view, and
    top-k's error feedback survives; any other ``.grad`` (a parameter that just
    joined) is folded in when its bucket next opens.
    """

    def __init__(
        self,
        plan: Plan,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        links: Links,
        config: SyncConfig,
        state: StepState,
        measuring_next: Callable[[], bool],
        carry: Optional["BucketGroup"] = None,
    ):
        self.plan, self.names, self.links, self.config = plan, names, links, config
        self.state = state
        self._measuring_next = measuring_next  # stamp launches whose next use is measured
        old_where = carry.where if carry is not None else {}
        self.states: List[BucketState] = []
        self.where: Dict[int, Tuple[BucketState, int]] = {}  # id(param) -> (state, position)
        self.zeroing_others: Optional[tuple] = None  # DeferredUpdates.zero_grads' look-up
        for b in plan.buckets:
            ps = [params[i] for i in b.params]
            dtype = getattr(torch, b.dtype.replace("torch.", ""))
            bucket = GradBucket(b, ps, dtype, wire_dtype=config.wire_dtype, alloc=links.alloc)
            if b.algorithm == TOPK:
                bucket.topk = TopK(
                    bucket.grads.numel(),
                    params=len(ps),
                    ratio=config.topk,
                    rank=links.rank,
                    world=links.world,
                    momentum=config.correction_momentum,
                    alloc=links.alloc,
                )
            if b.compressor == POWERSGD:
                rank, start = config.low_rank
                bucket.lowrank = PowerSGD(
                    [v.shape for v in bucket.views],
                    offsets=bucket.offsets,
                    ids=b.params,
                    rank=rank,
                    start=start,
                    world=links.world,
                    alloc=links.alloc,
                )
            s = BucketState(b.index, bucket)
            for pos, p in enumerate(ps):
                self.where[id(p)] = (s, pos)
                old = old_where.get(id(p))
                if old is not None:
                    _carry(s, pos, *old)
            self.states.append(s)
            if log.isEnabledFor(logging.DEBUG):
                _log_memory(bucket)
        self.engine: Optional[CommEngine] = CommEngine(
            plan,
            [s.bucket for s in self.states],
            links.channel,
            links.transport,
            scale=links.scale,
            timeout=config.timeout,
            servers=links.servers,
            timed_ops=True,
        )
        if config.shard:  # each rank steps its part of every bucket (shard.py)
            self.engine.phase = REDUCE_SCATTER
        if links.on_slow is not None:
            self.engine.on_slow, self.engine.slow_after = links.on_slow, links.slow_after
        if links.used.on_host:
            self.engine.on_issue = self._issuing
        self.engine.on_issued = self._issued
        self.in_flight_release = None  # shard="gradients" on a GPU (shard.py: reserve, drop)

    def _issuing(self, index: int) -> None:
        """Bucket ``index``'s launch is being issued: its used-parameter agreement is
        posted (``find_unused_parameters`` on a GPU: a host collective, in plan order)."""
        self.links.used.post(self.states[index])

    def _issued(self, index: int) -> None:
        s = self.states[index]
        self.to(s, Phase.IN_FLIGHT)
        if s.bucket.part is not None and self.in_flight_release is not None:
            self.in_flight_release.drop(s)  # (its part reserved at the launch)

    # ---- the one writer of a phase -------------------------------------------------------
    def to(self, s: BucketState, phase: Phase) -> None:
        """Move bucket ``s`` to ``phase`` along an edge of ``EDGES``."""
        if phase not in EDGES[s.phase]:
            raise HybridCommError(
                f"internal error: bucket {s.index} cannot go from {s.phase.value} to {phase.value}"
            )
        s._phase = phase
        self.rearm(s)

    def rearm(self, s: BucketState) -> None:
        """Its parameters' pre-hooks on or off (grad_hooks.py) as ``wants_guard`` says."""
        on = wants_guard(s)
        if on is not s.armed:
            s.armed = on
            if self.links.guard is not None:
                self.links.guard(s, on)

    # ---- a round: open, launch, wait ---------------------------------------------------
    def open(self, s: BucketState, apply_pending: Callable[[BucketState], None]) -> bool:
        """Start (or resume) a round: afterwards backward may add into the bucket.
        False, and nothing changed, when its launch is still to be issued.
        ``apply_pending(s)``: a PENDING bucket's deferred update is applied first."""
        if s.phase is Phase.PENDING:
            apply_pending(s)  # (under shard="gradients" its gather then frees the memory)
        elif s.phase is Phase.LAUNCHED:
            s.reopened = True
            return False
        elif s.phase is Phase.IN_FLIGHT:
            self.settle(s)  # a late gradient, or a dropped one: the reduction ends first
        if s.scattered:  # (shard: a late pass) whole again before more is added
            unscatter(self, s)  # (its part put back first where backward released the rest)
        elif s.bucket.released:  # (shard="gradients": freed since the last step)
            s.bucket.restore()
        if s.detached:
            b = s.bucket
            for pos in s.detached:
                g = b.params[pos].grad
                if g is not None and g is not b.views[pos]:
                    b.views[pos].add_(g)  # what came while the launch was still to be issued
                    b.bind(pos)
                    s.content.add(pos)
            s.detached.clear()
        self.to(s, Phase.ACCUMULATING)
        return True

    def absorb(self, s: BucketState) -> None:
        """Every gradient of the accumulating bucket ``s`` into its view, each ``.grad``
        the view: those autograd (or the user) put in tensors of their own are
        copied in, in one multi-tensor copy; a view whose ``.grad`` is None holds
        nothing of this round: it is zeroed (it is summed with the other ranks')
        and bound, so that what other ranks send lands in ``.grad``."""
        b = s.bucket
        grads = s.kept or kept_apart(b)  # (the closer's hook may have found them)
        s.kept = None
        if grads is not None:  # (the usual step)
            try:
                copy_into(b.views, grads)
            except RuntimeError:  # (a sparse gradient is found here, not looked for each step)
                if any(map(_IS_SPARSE, grads)):
                    _refuse_sparse(
                        self.names, next(i for i, g in enumerate(grads) if g.is_sparse), b
                    )
                raise
            s.content.update(range(len(grads)))
            grad_fields.set_grads(b.params, b.views)
            return
        views, grads, taken, stale = [], [], [], []
        for pos, p in enumerate(b.params):
            g = p.grad
            view = b.views[pos]
            if g is view:
                continue
            if g is None:
                stale.append(pos)
                continue
            if g.is_sparse:
                _refuse_sparse(self.names, pos, b)
            views.append(view)
            grads.append(g)
            taken.append(pos)
        if views:
            copy_into(views, grads)
            s.content.update(taken)
        if stale:
            b.zero(stale)
            s.content.difference_update(stale)
            taken += stale
        for pos in taken:
            b.bind(pos)

    def launch(self, s: BucketState, pass_id: int) -> None:
        """Hand the bucket to the engine (it issues it when the order reaches it)."""
        if s.phase is not Phase.ACCUMULATING:
            raise HybridCommError(f"internal error: bucket {s.index} launched from {s.phase.value}")
        joining = self.links.joining
        if joining is not None and self.engine.at_round_start():
            joining.notify(ROUND)  # before anything of the round is issued
        self.absorb(s)
        s.complete = len(s.content) == len(s.bucket.params)
        used = self.links.used
        if used.on_host:
            used.mark(s)
        lowrank = s.bucket.lowrank
        if not used.on_host or s.bucket.topk is not None or lowrank is not None:
            s.bucket.set_flags(s.content)  # top-k and PowerSGD send them in their messages
        if lowrank is not None:  # exact for its first steps, then low rank
            lowrank.active = self.state.steps >= lowrank.start
        self.to(s, Phase.LAUNCHED)
        s.reopened = False
        s.launched_pass, s.launched_epoch = pass_id, self.state.epoch
        # A stamp only where the next forward's use is measured (an event each on a GPU)
        s.launched_at = self.links.clock.stamp() if self._measuring_next() else None
        self.state.launches += 1
        keep = None  # shard="gradients" on a GPU: the part kept, copied behind the reduction
        if self.in_flight_release is not None:
            keep = self.in_flight_release.reserve(s)
        self.engine.launch(s.index, keep)  # issued now if its turn came: then IN_FLIGHT

    def launch_rest(self, open_: Callable[[BucketState], bool], pass_id: int) -> None:
        """Launch every bucket not launched in this epoch yet."""
        for s in self.states:
            if s.launched_epoch != self.state.epoch:
                self.open_and_launch(s, open_, pass_id)

    def launch_round(self, open_: Callable[[BucketState], bool], pass_id: int) -> None:
        """Launch every bucket again (a relaunch is always a whole round of the order)."""
        self.launch_rest(open_, pass_id)
        for s in self.states:
            self.open_and_launch(s, open_, pass_id)

    def launch_nothing(self, open_: Callable[[BucketState], bool], pass_id: int) -> None:
        """A joined rank's share of a round (join.py): every bucket launched holding
        nothing of this rank's (zeros, no position used)."""
        for s in self.states:
            if s.phase is not Phase.ACCUMULATING and not open_(s):
                raise HybridCommError(
                    f"internal error: bucket {s.index} shadowed before its last launch was issued"
                )
            for p in s.bucket.params:
                p.grad = None  # absorb zeroes the view and marks the position unused
            self.launch(s, pass_id)

    def open_and_launch(
        self, s: BucketState, open_: Callable[[BucketState], bool], pass_id: int
    ) -> None:
        """Launch ``s``, opening it first if it is not accumulating."""
        if s.phase is not Phase.ACCUMULATING and not open_(s):
            raise HybridCommError(
                f"internal error: bucket {s.index} launched again before its last launch was issued"
            )
        self.launch(s, pass_id)

    def wait(self, s: BucketState) -> None:
        """The bucket's reduction is done (host) or the trainer's stream waits for it."""
        waited = self.engine.wait(s.index)
        self.state.exposed_s += waited
        if waited > 1e-5:
            now = time.perf_counter()
            self.links.timeline.add(f"wait bucket {s.index}", "wait", now - waited, now)

    def settle(self, s: BucketState, waited: bool = False, views_bound: bool = False) -> List[int]:
        """Wait for the bucket's reduction (unless the caller just ``waited``); its
        content is now the reduced gradients of the positions some rank used
        (returned). The phase is the caller's to set. ``views_bound``: the caller knows
        that every ``.grad`` is its view (not read again)."""
        if not waited:
            self.wait(s)
        b = s.bucket
        if not b.released and b.buffer._version != self.engine.version(s.index):
            raise HybridCommError(
                f"bucket {s.index} ({', '.join(b.spec.layers)}): a gradient was written in "
                "place while it was being all-reduced or while its update waited for the next "
                "forward (e.g. p.grad.zero_() or zero_grad(set_to_none=False) on the module "
                "after backward, or a torch.distributed.pipelining schedule's gradient scaling: "
                "build it with scale_grads=False and divide the loss by the micro-batch count): "
                "modify gradients only after opt.synchronize(), and zero them with zero_grad() "
                "(set_to_none=True, the default)"
            )
        used = self.links.used.positions(s, self.links.on_device)
        s.scattered = self.engine.phase is REDUCE_SCATTER
        if views_bound or b.released or (s.complete and grad_fields.bound(b.params, b.views)):
            s.content = set(used)  # (the usual bucket; or released in flight: its part)
            return used
        bound = list(map(is_, map(_GRAD, b.params), b.views))
        s.content = {pos for pos in used if bound[pos]}  # (forward mode: none after zero_grad)
        return used

    def consume(self, s: BucketState) -> None:
        """``.grad`` <- the reduced gradients; None where no rank had one (as one
        process on the whole batch would leave it)."""
        used = self.settle(s)
        b = s.bucket
        if len(s.content) == len(b.params):  # every .grad its view, every one used
            self.to(s, Phase.IDLE)
            return
        used = set(used)
        for pos, p in enumerate(b.params):
            if p.grad is b.views[pos]:
                if pos not in used:
                    p.grad = None
            elif p.grad is not None and pos in used:
                raise HybridCommError(
                    f"p.grad of {self.names[b.spec.params[pos]]!r} was replaced while it was "
                    "being all-reduced: gradients are reduced in place; change them after "
                    "opt.synchronize() (then step inside opt.skip_synchronize())"
                )
        self.to(s, Phase.IDLE)

    # ---- whole-group verbs -------------------------------------------------------------
    def set_by_hand(self) -> bool:
        """Whether some ``.grad`` is neither None nor its view: set without a backward
        pass (``p.grad = g`` after ``torch.autograd.grad``), to be reduced too."""
        return any(
            p.grad is not None and p.grad is not s.bucket.views[pos] and not is_released(p.grad)
            for s in self.states
            for pos, p in enumerate(s.bucket.params)
        )

    def needs_round(self) -> bool:
        """A gradient came after some bucket's launch: every bucket goes again."""
        return any(s.reopened or s.phase is Phase.ACCUMULATING for s in self.states)

    def finish(self) -> None:
        """Every launched bucket consumed (after a flush: every bucket is issued)."""
        for s in self.states:
            if s.launched:
                self.consume(s)
            elif s.phase is Phase.ACCUMULATING:  # opened, never added to: a no-op round
                self.to(s, Phase.IDLE)

    def quiesce(self) -> None:
        """Nothing in flight (after a flush, with nothing pending): every bucket IDLE,
        ``.grad`` None where no rank had a gradient (as ``consume`` leaves it: a
        parameter frozen since must not be stepped on a zeroed view)."""
        for s in self.states:
            if s.launched:
                self.drop_unused(s, self.settle(s))
            if s.scattered:  # (shard) the next buckets take whole gradients
                unscatter(self, s)
            self.to(s, Phase.IDLE)

    @staticmethod
    def drop_unused(s: BucketState, used) -> None:
        """``.grad`` None where no rank had a gradient (``used``: the positions some
        rank had), as one process on the whole batch leaves it."""
        b = s.bucket
        if len(used) == len(b.params):
            return
        used = set(used)
        for pos, p in enumerate(b.params):
            if pos not in used and p.grad is b.views[pos]:
                p.grad = None

    def zero_in_place(self) -> None:
        """Before gradients are zeroed in place: a reduction in flight is waited for;
        a bucket whose launch is still to be issued keeps its content, and its
        gradients become separate zero tensors (its result is dropped when done)."""
        for s in self.states:
            if s.phase is Phase.IN_FLIGHT:
                self.settle(s)
                self.to(s, Phase.ACCUMULATING)
            elif s.phase is Phase.LAUNCHED:
                s.reopened = True
                b = s.bucket
                for pos, p in enumerate(b.params):
                    if b.holds(pos):
                        p.grad = torch.zeros_like(p)
                        s.detached.discard(pos)

    def drop(self, release: Callable[[BucketState], None]) -> None:
        """A loaded checkpoint supersedes what is in flight or deferred."""
        for s in self.states:
            if s.launched or s.phase is Phase.PENDING:
                s.hyper = None
                release(s)
                self.settle(s)
            self.to(s, Phase.IDLE)

    def running(self) -> List[List[str]]:
        """The layers of each bucket not launched in this epoch or still running."""
        return [
            s.bucket.spec.layers
            for s in self.states
            if s.launched_epoch != self.state.epoch
            or (s.launched and not self.engine.done(s.index))
        ]

    def topk_views(self) -> List[tuple]:
        """(param, residual view, velocity view or None) of every top-k bucket."""
        return [
            (p, *s.bucket.topk_state(pos))
            for s in self.states
            if s.bucket.topk is not None
            for pos, p in enumerate(s.bucket.params)
        ]

    def topk_param_ids(self) -> set:
        return {id(p) for s in self.states if s.bucket.topk is not None for p in s.bucket.params}

    def release_unheld(self) -> None:
        """Before a re-plan's buckets are made: the buffer of every bucket that holds
        nothing to carry (no ``.grad`` bound to it, no reduced content, no error
        feedback: a loaded checkpoint superseded it, or no gradient came since
        ``zero_grad()``) goes first, so that the old buffers and the new never
        take memory together."""
        for s in self.states:
            b = s.bucket
            if b.released or b.topk is not None or b.spec.compressor is not None:
                continue
            if s.content or s.scattered or any(map(b.holds, range(len(b.params)))):
                continue
            b.release()

    def retire(self) -> None:
        """A re-plan replaced this group: the engine's callbacks hold it, and with it
        its buckets' memory, in a reference cycle; dropping them frees it at once."""
        if self.engine is not None:
            self.engine.on_issue = self.engine.on_issued = self.engine.on_slow = None
        self.in_flight_release = None  # (shard.py's Shards holds the group too)

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()
