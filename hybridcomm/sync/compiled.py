"""Forward mode under torch.compile: compiled code reads every update, per bucket.

Forward mode applies a bucket's update at the first read of one of its
parameters, through the parameter's class (pending.py); compiled code runs no
``__torch_function__``, so each way a compiled region can read a parameter is
covered here: a block compiled alone gets its updates applied as it begins
(:class:`ApplyAtCompiledEntry`); a whole compiled forward gets them in
``step()``; any other read calls the operator ``hybridcomm::apply_pending_``
in the graph, and its bucket moves to one of the first two from the next step.
Each fallback is said once in the plan's notes and logged at INFO.
docs/ARCHITECTURE.md ("torch.compile") has the details.

Example::

    reads = CompiledReads(model, whole_hook)
    reads.scan()                   # entries on the model's compiled blocks
    reads.review(group)            # a step begins: what compiled graphs read since
    for s in reads.in_step_states: # step(): these are applied, not deferred
        deferred.apply(s)
    reads.close()
"""

from __future__ import annotations

import logging
import sys
from typing import Dict, List, Optional, Set

import torch

from . import pending

log = logging.getLogger("hybridcomm")

# Parameters (ids) whose pending update a compiled graph applied, in this process; every
# synchronizer reads it (CompiledReads.review), when its version moved
_read_in_graph: Set[int] = set()
_counts: Dict[str, int] = {"in_graph": 0, "at_entry": 0, "version": 0}


def stats() -> Dict[str, int]:
    """How many pending parameters a compiled graph's operator applied (``in_graph``)
    and how many a compiled block's entry did (``at_entry``), in this process
    (applying one applies its bucket)."""
    return {k: v for k, v in _counts.items() if k != "version"}


def _apply_pending(param: torch.Tensor, key: int) -> None:
    """The operator's body, at run time: apply the pending update of the parameter
    registered under ``key``, then make ``param`` (the graph's value of it: the
    parameter itself, or a copy functionalization made before this call) hold it.
    Costly (an operator call per read, and a recompile: the pending class is in
    dynamo's guards), so the read is noted and ``CompiledReads.review`` moves the
    bucket to a block's entry or to ``step()``."""
    p = pending.registered(key)
    if p is None:
        return
    if pending.is_pending(p):
        _counts["in_graph"] += 1
        _read_in_graph.add(key)
        # (every read moves the version, not only a key's first: a key is an id, and a
        # parameter freed earlier in the process may have had the same one)
        _counts["version"] += 1
        pending.resolve(p)
    if param.data_ptr() != p.data_ptr():  # (aot_eager: the graph reads its copy from here on;
        # on torch 2.13 the update lands at trace time, before any copy is made)
        with torch.no_grad(), pending.DISABLED():
            param.copy_(p)


def _register_operator() -> Optional[object]:
    """``hybridcomm::apply_pending_(Tensor(a!) param, int key) -> ()``: declared to write
    ``param``, so every read of it in the graph comes after it (None on a torch
    without ``torch.library.custom_op``: pending.py then breaks the graph)."""
    custom_op = getattr(torch.library, "custom_op", None)
    if custom_op is None:
        return None
    op = custom_op("hybridcomm::apply_pending_", mutates_args=("param",))(_apply_pending)

    @op.register_fake
    def _(param, key):
        return None

    return torch.ops.hybridcomm.apply_pending_.default


_OPERATOR = _register_operator()
if _OPERATOR is not None:
    pending.apply_in_graph_with(_OPERATOR)


class ApplyAtCompiledEntry:
    """A compiled block's forward pre-hook: its parameters' pending updates applied
    as it begins (the ``OptimizedModule`` runs it eagerly, outside its graph). A
    plain object holding the block's parameters: a deep copy of the model maps
    them to the copy's, and in a copy it only applies what is pending."""

    def __init__(self, params: List[torch.Tensor]):
        self.params = params

    def __call__(self, module, args) -> None:
        is_pending, resolve = pending.is_pending, pending.resolve
        for p in self.params:
            if is_pending(p):  # (its bucket's update applies the bucket's others too)
                _counts["at_entry"] += 1
                resolve(p)


def compiled_blocks(model: torch.nn.Module):
    """``(with_entry, without)``: the model's modules compiled on their own that run
    their hooks before their graph (``OptimizedModule``s below the root), and
    those whose hooks are inside it (``module.compile()``)."""
    optimized = _optimized_module_class()
    with_entry, without = [], []
    for m in model.modules():
        if optimized is not None and isinstance(m, optimized) and m is not model:
            with_entry.append(m)
        elif getattr(m, "_compiled_call_impl", None) is not None:
            without.append(m)
    return with_entry, without


def _optimized_module_class():
    dynamo = sys.modules.get("torch._dynamo")  # (none loaded: nothing is compiled)
    return getattr(getattr(dynamo, "eval_frame", None), "OptimizedModule", None)


class CompiledReads:
    """One synchronizer's view of its model's compiled code (module doc): the
    entries it put on compiled blocks, and the buckets whose updates are
    applied in ``step()`` instead of deferred."""

    def __init__(self, model: Optional[torch.nn.Module], whole_hook=None):
        pending.arm_compiled_forward_hook()  # (the hook's flags read from the first trace on)
        self.model = model
        self.whole_hook = whole_hook  # pending.ApplyBeforeCompiledForward (compiled_whole)
        self._entries: Dict[int, tuple] = {}  # id(block) -> (block, hook handle)
        self.at_entry: Set[int] = set()  # ids of parameters a block's entry applies
        self.in_step: Set[int] = set()  # ids of parameters read with no eager point before
        self.in_step_states: List = []  # the current group's buckets step() applies
        self._was_whole = False
        self._seen = _counts["version"]  # (reads before this synchronizer are not its own)
        self.told: Set[str] = set()
        self.note: Optional[str] = None  # for the plan's notes

    @property
    def whole(self) -> bool:
        """Whether the model's whole forward was compiled (its pre-hook was traced)."""
        return bool(self.whole_hook is not None and self.whole_hook.compiled_whole)

    def scan(self) -> None:
        """Entries on the model's compiled blocks not seen yet; the parameters of
        modules compiled with ``module.compile()`` are applied in ``step()``."""
        if self.model is None:
            return
        with_entry, without = compiled_blocks(self.model)
        for block in with_entry:
            if id(block) not in self._entries:
                params = [p for p in block.parameters() if p.requires_grad]
                handle = block.register_forward_pre_hook(ApplyAtCompiledEntry(params))
                self._entries[id(block)] = (block, handle)
                self.at_entry.update(map(id, params))
        for m in without:
            self.in_step.update(id(p) for p in m.parameters())

    def review(self, group, again: bool = False) -> bool:
        """A step begins (``again``: ``group`` is new): take in the parameters a compiled
        graph applied since (the model is searched again: a block compiled since may
        cover them; those none covers are applied in ``step()`` from now on), and
        list ``group``'s buckets ``step()`` applies (:attr:`in_step_states`).
        Whether that changed."""
        whole, version = self.whole, _counts["version"]
        if not (version != self._seen or again or whole != self._was_whole):
            return False
        if version != self._seen:
            self._seen = version
            self.scan()
            self.in_step.update(_read_in_graph - self.at_entry)
        self._was_whole = whole
        if whole:
            self.in_step_states = list(group.states)
            self._say("the model's forward is compiled whole", self.in_step_states)
        else:
            where, found = group.where, {}
            for pid in self.in_step:
                w = where.get(pid)
                if w is not None:
                    found[w[0].index] = w[0]
            self.in_step_states = [found[i] for i in sorted(found)]
            self._say("their parameters are read inside compiled code", self.in_step_states)
        return True

    def _say(self, why: str, states) -> None:
        """The plan's note, and once per reason an INFO line."""
        if not states:
            return
        self.note = (
            f"forward mode under torch.compile: bucket(s) {[s.index for s in states]} "
            f"updated in step(), not overlapped with the next forward ({why}, with no "
            "eager point before the reads; compile blocks alone to keep the overlap)"
        )
        if why not in self.told:
            self.told.add(why)
            log.info("hybridcomm: %s", self.note)

    def entry_note(self) -> Optional[str]:
        """The plan's note on compiled blocks whose entries apply their updates."""
        if not self._entries:
            return None
        return (
            f"forward mode under torch.compile: {len(self._entries)} compiled block(s) "
            "apply their parameters' updates as they begin"
        )

    def close(self) -> None:
        for _, handle in self._entries.values():
            handle.remove()
        self._entries.clear()
        self.at_entry.clear()
