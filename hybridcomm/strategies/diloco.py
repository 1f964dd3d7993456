"""DiLoCo and Streaming DiLoCo: H inner steps on each rank, then the averaged
pseudo-gradient through an outer optimizer.

DiLoCo (Douillard et al. 2023, https://arxiv.org/abs/2311.08105): each rank
runs H steps of its inner optimizer from the global parameters; then
Δ = θ_global − θ_local is averaged over the ranks with hybridcomm's all-reduce
and an outer optimizer (Nesterov SGD) steps θ_global with ``.grad = Δ̄``.
Streaming DiLoCo (Douillard et al. 2025, https://arxiv.org/abs/2501.18512)
syncs the model in fragments at staggered steps (fragments.py), lets a
fragment's all-reduce run behind the next ``delay`` inner steps, mixes the
arrived update into the local parameters, and may quantize what it sends.

A fragment's sync reads as its steps: :meth:`DiLoCo._start_sync` (Δ against
the global copy, the all-reduce started), :meth:`DiLoCo._finish_sync` (wait,
the outer step from the global copy, the merge).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Set

import torch
import torch.distributed as dist

from ..averager import PendingAverage, TensorAverager
from ..base.errors import HybridCommError
from ..broadcast import broadcast_parameters
from ..comm import control
from ..config import env
from ..gpu.runtime import runtime_for
from ..sync.stall import StallInspector
from . import fragments as fragmenting
from .averaging import gather_per_rank, load_own, state_tensors

log = logging.getLogger("hybridcomm")


@dataclass
class _InFlight:
    """A fragment's sync between its start and its merge."""

    average: PendingAverage
    started_at: int  # the inner step after which it started
    merge_at: int  # the inner step after which it is merged


class DiLoCo:
    """DiLoCo (``fragments=1, delay=0``) and Streaming DiLoCo, used like an optimizer.

    Every rank trains ``model`` with ``inner_optimizer`` (AdamW in the papers) on
    its own data. Every ``sync_every`` (H) inner steps, a fragment's pseudo-gradient
    Δ = θ_global − θ_local is averaged over the ranks (planned buckets, butterfly
    or ring per bucket, through one ordered channel in the background) and
    ``outer_optimizer`` steps the global copy with ``.grad = Δ̄``; the rank then
    goes on from the new global parameters, the same bits on every rank.

    Args:
        inner_optimizer: the optimizer every ``step()`` steps (on the model's
            parameters).
        model: the module; its parameters start from rank 0's (broadcast here).
        outer_optimizer: a torch optimizer built on ``model.parameters()`` (e.g.
            ``SGD(lr=0.7, momentum=0.9, nesterov=True)``); it steps the global
            copy. Every trainable parameter must be in it.
        sync_every: H, inner steps between two syncs of a fragment.
        fragments: K, runs of consecutive layers of about equal bytes, each
            synced at its own step of the period (fragments.py); ``K <= H``.
        delay: tau, inner steps a fragment's all-reduce runs behind before its
            update is merged (``0 <= tau < H``).
        mixing: with ``delay > 0``, how an update is merged. A weight in [0, 1]:
            θ ← mixing·θ_local + (1 − mixing)·θ_global (the Streaming DiLoCo
            paper's rule; 0 drops the tau steps' local progress). ``"carry"``:
            θ ← θ_global + (θ_local − θ_local at the sync's start), the new global
            parameters plus the rank's own progress while the sync was in flight
            (one more copy of the parameters, kept in ``state_dict()``). With
            ``delay=0`` the parameters become the global ones.
        compression: what Δ travels as: None (its dtype), ``"fp16"``,
            ``"bf16"``, ``"int8"`` or ``"int4"`` (blockwise-scaled integers:
            comm/quantized.py states the error).
        global_device: where the global copy lives (None: beside the
            parameters; ``"cpu"``: host memory, which costs a copy per sync).
        group: the process group (None: the world).
        timeout: seconds any wait may take (default ``HYBRIDCOMM_TIMEOUT``): a
            dead or stalled peer is a ``HybridCommError`` (``HybridCommTimeout``
            when it did not answer in time) naming the ranks, never a hang.
        cost_model, strategy, fusion_bytes: the averager's (``TensorAverager``:
            by default, quantized, a fragment's Δ travels in as few buckets as 32
            MiB on the wire each allows; otherwise as the link's fusion cuts it).
        shard: not supported (sharded optimizer state); leave it None.

    ``synchronize()`` completes every fragment's sync now, so that every rank
    holds the same parameters (before an evaluation, a checkpoint, the end of
    training): fragments in flight are merged without mixing, and the others
    are synced at once, an outer step each. ``bytes_sent`` counts this rank's;
    ``wait_seconds`` the time ``step()`` and ``synchronize()`` waited for syncs'
    results (the communication not hidden behind inner steps).

    Example::

        >>> inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        >>> outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        >>> opt = DiLoCo(inner, model, outer, sync_every=2, timeout=60)
        >>> for x, y in loader:
        ...     opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
        >>> opt.synchronize(); opt.steps, opt.bytes_sent        # one rank: nothing sent
        (2, 0)
        >>> opt.close()
    """

    def __init__(
        self,
        inner_optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        outer_optimizer: torch.optim.Optimizer,
        sync_every: int = 100,
        fragments: int = 1,
        delay: int = 0,
        *,
        mixing: float = 0.5,
        compression=None,
        global_device=None,
        group=None,
        timeout: Optional[float] = None,
        cost_model=None,
        strategy: str = "hybrid",
        fusion_bytes: Optional[int] = None,
        shard=None,
    ):
        control.require_initialized("hybridcomm.strategies.DiLoCo")
        self.inner_optimizer, self.model, self.outer_optimizer = (
            inner_optimizer,
            model,
            outer_optimizer,
        )
        self.sync_every, self.delay, self.mixing = sync_every, delay, mixing
        self.compression, self.group, self.timeout = compression, group, env.timeout(timeout)
        # The synced parameters: the outer optimizer's, in the model's order.
        outer = {id(p) for g in outer_optimizer.param_groups for p in g["params"]}
        self._params = [p for p in model.parameters() if id(p) in outer]
        layers = fragmenting.layers_of(model, self._params)
        problem = _refusal(
            inner_optimizer, model, outer_optimizer, sync_every, fragments, delay, mixing, layers
        )
        problem = problem or _compression_refusal(compression) or _shard_refusal(shard)
        self._agree(problem, (sync_every, fragments, delay, mixing, str(compression)), layers)
        self.schedule = fragmenting.SyncSchedule(
            sync_every=sync_every,
            offsets=fragmenting.offsets(sync_every, fragments),
            delay=delay,
        )
        self.fragments = fragmenting.split(layers, fragments, sync_every)
        log.debug("%s", fragmenting.describe(self.fragments, self.schedule))
        broadcast_parameters(model.state_dict(), process_group=group, timeout=self.timeout)
        with torch.no_grad():
            # θ_global: the same on every rank after every sync; Δ is taken against it
            self._global = [_global_copy(p, global_device) for p in self._params]
            # Δ, then Δ̄ (the averager's result lands here), per parameter
            self._deltas = [torch.zeros_like(p) for p in self._params]
            # mixing="carry": θ_local at each in-flight sync's start, per parameter
            carries = mixing == "carry" and delay > 0
            self._started_from = [torch.zeros_like(p) for p in self._params] if carries else None
        # A slow sync names the ranks that have not started it (their counts in the
        # rendezvous store, which answers while the data connections hang)
        self._stall = StallInspector(group, self.timeout)
        self._averager = TensorAverager(
            group,
            timeout=self.timeout,
            cost_model=cost_model,
            strategy=strategy,
            compression=compression,
            on_slow=self._stalled if self._stall.enabled else None,
            slow_after=self._stall.warn_s,
            fusion_bytes=fusion_bytes,
        )
        for f in self.fragments:  # (the set-up off the training clock: a collective)
            self._averager.prepare([self._deltas[i] for i in f.params])
        self._in_flight: Dict[int, _InFlight] = {}  # by fragment, in start order
        self._fresh: Set[int] = set(range(fragments))  # fragments whose θ is θ_global now
        self.steps = 0
        self.bytes_sent = 0
        self.wait_seconds = 0.0  # the trainer blocked on syncs' results (the wire not hidden)
        self._started = 0  # syncs started, in the same order on every rank

    # -- the optimizer's verbs ----------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        """An inner step; then the syncs the schedule starts after it, then the
        merges that are due (a sync started now with ``delay=0`` among them)."""
        loss = self.inner_optimizer.step(closure)
        self.steps += 1
        self._fresh.clear()
        for k in self.schedule.launches_at(self.steps):
            self._start_sync(k)
        for k in [k for k, s in self._in_flight.items() if s.merge_at == self.steps]:
            self._finish_sync(k, mix=True)
        return loss

    def synchronize(self) -> None:
        """Every rank ends with the same parameters, the global ones: the fragments
        in flight merged without mixing, the others synced now (collective)."""
        for k in list(self._in_flight):
            self._finish_sync(k, mix=False)
        due = [f.index for f in self.fragments if f.index not in self._fresh]
        for k in due:  # all started before the first wait: one stream of buckets
            self._start_sync(k)
        for k in due:
            self._finish_sync(k, mix=False)

    # -- a fragment's sync ---------------------------------------------------------------
    def _start_sync(self, k: int) -> None:
        """Δ of fragment ``k`` against the global copy; its average started."""
        idx = self.fragments[k].params
        with torch.no_grad(), self._device_work():
            for i in idx:
                # Δ = θ_global − θ_local: never against this rank's own earlier θ, which
                # differs between ranks after a mixed merge
                g = self._global[i]
                torch.sub(g.to(self._deltas[i].device), self._params[i], out=self._deltas[i])
                if self._started_from is not None:
                    self._started_from[i].copy_(self._params[i])
        self._started += 1
        self._stall.publish(self._started, self.steps)
        average = self._averager.start_average_([self._deltas[i] for i in idx])
        self.bytes_sent += average.bytes_sent
        self._in_flight[k] = _InFlight(
            average, started_at=self.steps, merge_at=self.schedule.merge_step(self.steps)
        )

    def _finish_sync(self, k: int, *, mix: bool) -> None:
        """Wait for fragment ``k``'s Δ̄; step the global copy with it; merge."""
        sync = self._in_flight.pop(k)
        t0 = time.perf_counter()
        try:
            sync.average.wait()
        except HybridCommError as e:
            raise type(e)(
                f"DiLoCo: fragment {k}'s sync (started after inner step {sync.started_at}) "
                f"failed: {e}"
            ) from e
        self.wait_seconds += time.perf_counter() - t0
        idx = self.fragments[k].params
        params = [self._params[i] for i in idx]
        merged = mix and self.delay > 0  # (else θ becomes θ_global)
        carry = merged and self.mixing == "carry"
        mixing = self.mixing if merged and not carry else 0.0
        with torch.no_grad(), self._device_work():
            local = [p.detach().clone() for p in params] if mixing else None
            if carry:  # θ at the start − θ now: minus the progress since
                progress_back = [self._started_from[i] for i in idx]
                torch._foreach_sub_(progress_back, params)
            for p, i in zip(params, idx):
                # the update applies to the global copy, not to the τ steps' local θ
                p.copy_(self._global[i])
            self._outer_step(params, [self._deltas[i] for i in idx])
            for p, i in zip(params, idx):
                self._global[i].copy_(p)  # the outer step's result: the same on every rank
            if mixing:
                torch._foreach_lerp_(params, local, mixing)
            if carry:
                torch._foreach_sub_(params, progress_back)
        if not (mixing or carry):
            self._fresh.add(k)

    def _outer_step(self, params: List[torch.nn.Parameter], grads: List[torch.Tensor]) -> None:
        """The outer optimizer's step on ``params`` alone (``.grad = Δ̄``): every other
        parameter shows no gradient to it meanwhile, so it skips them."""
        held = [(p, p.grad) for p in self._params]
        for p in self._params:
            p.grad = None
        try:
            for p, g in zip(params, grads):
                p.grad = g
            self.outer_optimizer.step()
        finally:
            for p, g in held:
                p.grad = g

    def _stalled(self, what: str) -> Optional[str]:
        """A sync's wait turned slow: which ranks have started fewer syncs (logged)."""
        try:
            why = self._stall.explain(
                f"DiLoCo's sync ({what})",
                self._started,
                self.steps,
                unit="syncs",
                hint="A rank behind is dead, stalled, or steps less often than this one; every "
                "rank must call step() as often",
            )
        except Exception as e:  # noqa: BLE001 - the inspector must never break a wait
            why = f"the stall inspector failed: {e}"
        if why:
            log.warning(why)
        return why

    def _device_work(self):
        rt = runtime_for(self._params[0].device) if self._params else None
        return rt.watched() if rt is not None else contextlib.nullcontext()

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The inner and outer optimizers' state, the global copy, the step, the
        syncs in flight (their Δ̄, waited for: no rank merges them early) and every
        rank's own parameters and inner state (rank 0 may write it alone). A
        collective. Load the model's state first, then this."""
        in_flight = []
        for k, sync in self._in_flight.items():
            sync.average.wait()
            deltas = [self._deltas[i].detach().cpu().clone() for i in self.fragments[k].params]
            in_flight.append((k, sync.started_at, sync.merge_at, deltas))
        return {
            "settings": self._settings(),
            "inner": self.inner_optimizer.state_dict(),
            "outer": self.outer_optimizer.state_dict(),
            "global": [g.detach().cpu().clone() for g in self._global],
            "steps": self.steps,
            "started": self._started,
            "in_flight": in_flight,
            "fresh": sorted(self._fresh),
            "per_rank": gather_per_rank(self._own(), self.group, self.timeout),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`: bitwise at the same world size; at another
        one every rank starts from the global copy (the syncs in flight merged at
        their steps all the same)."""
        if tuple(state["settings"]) != self._settings():
            raise HybridCommError(
                f"DiLoCo.load_state_dict: saved with (sync_every, fragments, delay) = "
                f"{tuple(state['settings'])}, this DiLoCo has {self._settings()}: build it "
                "with the saved settings"
            )
        for k in list(self._in_flight):  # (a fresh DiLoCo has none)
            self._in_flight.pop(k).average.wait()
        self.inner_optimizer.load_state_dict(state["inner"])
        self.outer_optimizer.load_state_dict(state["outer"])
        self.steps, self._started = int(state["steps"]), int(state["started"])
        with torch.no_grad():
            for g, saved in zip(self._global, state["global"]):
                g.copy_(saved)
            for k, started_at, merge_at, deltas in state["in_flight"]:
                for i, d in zip(self.fragments[k].params, deltas):
                    self._deltas[i].copy_(d)
                arrived = PendingAverage(self._averager, None, [], None, 0)
                self._in_flight[k] = _InFlight(arrived, started_at=started_at, merge_at=merge_at)
            self._fresh = set(state["fresh"])
            if not load_own(self._own(), state["per_rank"], self.group):
                for p, g in zip(self._params, self._global):
                    p.copy_(g)  # another world size: every rank from the global copy
                if self._started_from is not None:  # (its progress counts from here)
                    torch._foreach_copy_(self._started_from, self._params)
                self._fresh = {f.index for f in self.fragments if f.index not in self._in_flight}

    def global_parameters(self) -> List[torch.Tensor]:
        """The global copy (θ_global), one tensor per synced parameter in the model's
        order: the same bits on every rank after every sync. Read-only."""
        return list(self._global)

    def close(self) -> None:
        for sync in self._in_flight.values():
            try:
                sync.average.wait()
            except HybridCommError:
                pass  # closing after a failure: nothing left to finish
        self._in_flight = {}
        self._averager.close()
        self._stall.close()

    def _settings(self) -> tuple:
        return (self.sync_every, len(self.fragments), self.delay)

    def _own(self) -> List[torch.Tensor]:
        """This rank's own state: its parameters, its inner optimizer's, and with
        ``mixing="carry"`` its parameters at the start of each sync."""
        carried = self._started_from or []
        return list(self._params) + state_tensors(self.inner_optimizer) + carried

    def _agree(self, problem: Optional[str], settings: tuple, layers) -> None:
        """Every rank raises the same error if any rank's input is wrong or the ranks'
        settings or layers differ (else the first sync would hang or mix buffers)."""
        mine = (problem, settings, [(layer.name, layer.nbytes) for layer in layers])
        everyone = control.all_gather_object(
            mine, group=self.group, timeout=self.timeout, what="DiLoCo's settings"
        )
        wrong = [(r, p) for r, (p, _, _) in enumerate(everyone) if p]
        if wrong:
            ranks = ", ".join(str(r) for r, _ in wrong)
            raise HybridCommError(f"DiLoCo on rank(s) {ranks}: {wrong[0][1]}")
        for r, (_, theirs, their_layers) in enumerate(everyone):
            if (theirs, their_layers) != mine[1:]:
                raise HybridCommError(
                    f"DiLoCo: rank {r}'s (sync_every, fragments, delay, mixing, compression) "
                    f"{theirs} or layers differ from rank {dist.get_rank(self.group)}'s "
                    f"{settings}: build the same model and DiLoCo on every rank"
                )


def _global_copy(p: torch.Tensor, device) -> torch.Tensor:
    """θ_global's tensor for ``p`` on ``device`` (None: ``p``'s); host memory for a GPU
    parameter is pinned, so its copies to and from the GPU run at full speed (they
    stay synchronous: the host reads the copy, e.g. in ``state_dict``)."""
    g = p.detach().to(device, copy=True)
    return g.pin_memory() if p.is_cuda and g.device.type == "cpu" else g


def _refusal(inner, model, outer, sync_every, fragments, delay, mixing, layers) -> Optional[str]:
    """Why these arguments cannot work (None: they can), naming the fix."""
    if outer is inner:
        return (
            "outer_optimizer is inner_optimizer: build a second optimizer on "
            "model.parameters() for the outer steps (e.g. SGD(lr=0.7, momentum=0.9, "
            "nesterov=True))"
        )
    names = {id(p): n for n, p in model.named_parameters()}
    for g in outer.param_groups:
        for p in g["params"]:
            if id(p) not in names:
                return (
                    f"outer_optimizer holds a parameter of shape {tuple(p.shape)} that is not "
                    "one of model's: build it on model.parameters()"
                )
    outer_ids = {id(p) for g in outer.param_groups for p in g["params"]}
    for n, p in model.named_parameters():
        if p.requires_grad and id(p) not in outer_ids:
            return (
                f"model parameter {n!r} is trainable but not in outer_optimizer: it would "
                "drift apart between ranks; build outer_optimizer on model.parameters()"
            )
    if not isinstance(sync_every, int) or sync_every < 1:
        return f"sync_every must be an int >= 1, got {sync_every!r}"
    if not isinstance(fragments, int) or fragments < 1:
        return f"fragments must be an int >= 1, got {fragments!r}"
    if fragments > len(layers):
        return (
            f"fragments={fragments} but the model has {len(layers)} layers (modules that own "
            f"parameters): a fragment is one or more whole layers; use fragments <= {len(layers)}"
        )
    if fragments > sync_every:
        return (
            f"fragments={fragments} > sync_every={sync_every}: each fragment syncs at its own "
            "step of the period; use fragments <= sync_every"
        )
    if not isinstance(delay, int) or delay < 0:
        return f"delay must be an int >= 0, got {delay!r}"
    if delay >= sync_every:
        return (
            f"delay={delay} reaches each fragment's own next sync (sync_every={sync_every} "
            f"steps later): its update must be merged before; use delay <= {sync_every - 1}"
        )
    if mixing != "carry" and not (isinstance(mixing, (int, float)) and 0.0 <= mixing <= 1.0):
        return f"mixing must be a weight in [0, 1] or 'carry', got {mixing!r}"
    return None


def _compression_refusal(compression) -> Optional[str]:
    if compression not in (None, "fp16", "bf16", "int8", "int4"):
        return f"compression must be None, 'fp16', 'bf16', 'int8' or 'int4', got {compression!r}"
    return None


def _shard_refusal(shard) -> Optional[str]:
    if shard is None:
        return None
    return (
        f"shard={shard!r} does not combine with DiLoCo: every rank keeps whole parameters, "
        "the global copy and Δ, and the inner optimizer's state never crosses the wire; "
        "leave shard=None (or shard the inner steps' gradients with DistributedOptimizer "
        "instead of DiLoCo)"
    )
