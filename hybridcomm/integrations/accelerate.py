"""hybridcomm under Hugging Face Accelerate: the DDP hook, or the optimizer (forward overlap).

:func:`register` puts hybridcomm's DDP hook (:mod:`hybridcomm.ddp`) on the DDP
model ``accelerator.prepare`` returned (Accelerate's own ``comm_hook`` setting
knows only torch's hooks); everything else stays Accelerate's. For forward
overlap, :func:`prepare` stands in for ``accelerator.prepare``: no DDP, a
``hybridcomm.DistributedOptimizer`` instead, and :func:`synchronize` before
clipping or reading the weights. Usage, launching and what works:
docs/INTEGRATIONS.md, "Accelerate".
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DDPCommunicationHookType, DistributedType

from ..ddp import HybridState, hybrid_hook
from ..base.errors import HybridCommError
from ..optimizer import DistributedOptimizer, _DistributedOptimizer

log = logging.getLogger("hybridcomm")

__all__ = ["register", "prepare", "synchronize", "find_ddp"]


def find_ddp(model) -> Optional[torch.nn.parallel.DistributedDataParallel]:
    """The ``DistributedDataParallel`` module ``model`` is, or wraps through
    ``torch.compile`` (``_orig_mod``); None if there is none."""
    seen = set()
    while model is not None and id(model) not in seen:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return model
        seen.add(id(model))
        model = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
    return None


def register(accelerator: Accelerator, model, **state_kwargs) -> Optional[HybridState]:
    """Register hybridcomm's DDP communication hook on the model ``prepare`` returned.

    Call it once per prepared model, after ``accelerator.prepare(model, ...)``
    and before the first backward, on every process.

    Args:
        accelerator: the ``accelerate.Accelerator`` that prepared ``model``.
        model: the module ``accelerator.prepare`` returned (the DDP wrapper,
            not ``accelerator.unwrap_model(model)``).
        **state_kwargs: passed to :class:`hybridcomm.ddp.HybridState`
            (``cost_model``, ``timeout``, ``process_group``; the group
            defaults to the one DDP reduces over).

    Returns:
        The hook's :class:`~hybridcomm.ddp.HybridState` (``state.algorithms``
        fills as DDP's buckets run), or None in a single-process run, where
        Accelerate does not wrap the model and there is nothing to reduce.

    Raises:
        TypeError: ``accelerator`` is not an ``Accelerator`` or ``model`` not a module.
        HybridCommError: several processes but ``model`` is not DDP (the
            unwrapped module was passed, or the run uses DeepSpeed, FSDP or
            another non-DDP wrapper), the Accelerator registers a hook of its
            own (``DistributedDataParallelKwargs(comm_hook=...)``), or the DDP
            model already has a hook.

    Example::

        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        state = hybridcomm.integrations.accelerate.register(accelerator, model)
    """
    if not isinstance(accelerator, Accelerator):
        raise TypeError(
            f"register() takes the accelerate.Accelerator first, got {type(accelerator).__name__}"
        )
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"register() takes the model accelerator.prepare returned, got {type(model).__name__}"
        )
    ddp = find_ddp(model)
    if ddp is None:
        if accelerator.num_processes <= 1:
            log.debug(
                "hybridcomm: one process (%s), no DDP model: nothing to reduce, no hook registered",
                accelerator.distributed_type,
            )
            return None
        _check_data_parallel(accelerator, "hybridcomm's hook needs a DistributedDataParallel model")
        raise HybridCommError(
            f"{type(model).__name__} is not DistributedDataParallel: pass the model "
            f"accelerator.prepare returned (not the one given to it, nor "
            f"accelerator.unwrap_model(...)); a model without trainable parameters is not "
            f"wrapped either"
        )
    handler = accelerator.ddp_handler
    if handler is not None and handler.comm_hook != DDPCommunicationHookType.NO:
        raise HybridCommError(
            f"the Accelerator registers DDP hook {handler.comm_hook} itself "
            f"(DistributedDataParallelKwargs(comm_hook=...)), and DDP takes one hook: "
            f"drop that comm_hook to use hybridcomm's"
        )
    if "process_group" not in state_kwargs and ddp.process_group is not dist.group.WORLD:
        state_kwargs["process_group"] = ddp.process_group
    state = HybridState(**state_kwargs)
    try:
        ddp.register_comm_hook(state, hybrid_hook)
    except RuntimeError as e:  # the reducer takes one hook, once
        raise HybridCommError(
            f"DDP refused hybridcomm's hook (a DDP model takes one "
            f"communication hook: is one registered already?): {e}"
        ) from e
    state.prepare(accelerator.device)  # the set-up now, not in the first backward
    log.debug("hybridcomm: DDP hook registered on the prepared %s", type(ddp.module).__name__)
    return state


def _check_data_parallel(accelerator: Accelerator, what: str) -> None:
    kind = accelerator.distributed_type
    if kind not in (DistributedType.MULTI_GPU, DistributedType.MULTI_CPU):
        raise HybridCommError(
            f"{what}; this Accelerator runs {kind} over "
            f"{accelerator.num_processes} processes, not DDP data parallelism"
        )


def prepare(
    accelerator: Accelerator, model, optimizer, *others, overlap: str = "forward", **options
):
    """``accelerator.prepare(model, optimizer, *others)`` with hybridcomm's optimizer.

    For forward overlap (``overlap="forward"``, the default; ``"backward"``
    and ``"none"`` are the optimizer's other modes). The model is prepared
    by Accelerate without DDP (``prepare_model(..., evaluation_mode=True)``:
    device placement and mixed-precision autocast only), the optimizer is
    wrapped in :func:`hybridcomm.DistributedOptimizer` (which reduces the
    gradients itself) and then prepared with ``others`` (data loaders, LR
    schedulers). ``accelerator.accumulate(model)`` works unchanged: the
    optimizer launches its buckets in the last of
    ``accelerator.gradient_accumulation_steps`` backward passes. Call
    :func:`synchronize` before clipping and before reading or saving the
    weights (forward overlap applies the last update in the next forward).

    Args:
        accelerator: the ``accelerate.Accelerator``.
        model: the plain module (not yet prepared).
        optimizer: the torch optimizer over ``model``'s parameters (not yet prepared).
        *others: more objects for ``accelerator.prepare`` (data loaders, schedulers).
        overlap: ``"forward"``, ``"backward"`` or ``"none"`` (DistributedOptimizer's).
        **options: more DistributedOptimizer arguments;
            ``backward_passes_per_step`` defaults to the Accelerator's
            gradient accumulation steps.

    Returns:
        ``(model, optimizer, *others)`` as ``accelerator.prepare`` returns them.
        In one process it is ``accelerator.prepare(model, optimizer, *others)``:
        nothing to reduce, no DistributedOptimizer.

    Raises:
        HybridCommError: the model is DDP already, the run is not DDP data
            parallelism (DeepSpeed, FSDP, ...), or fp16 mixed precision
            (Accelerate's GradScaler hides the scaler from the optimizer's
            step: use :func:`register` for fp16).

    Example::

        model, optimizer, loader = hybridcomm.integrations.accelerate.prepare(
            accelerator, model, optimizer, loader)
    """
    if not isinstance(accelerator, Accelerator):
        raise TypeError(
            f"prepare() takes the accelerate.Accelerator first, got {type(accelerator).__name__}"
        )
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"prepare() takes the model second, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(
        optimizer, AcceleratedOptimizer
    ):
        raise TypeError(
            f"prepare() takes the torch optimizer third, not yet prepared, got "
            f"{type(optimizer).__name__}"
        )
    if accelerator.num_processes <= 1:
        log.debug(
            "hybridcomm: one process (%s): accelerator.prepare as it is, nothing to reduce",
            accelerator.distributed_type,
        )
        return accelerator.prepare(model, optimizer, *others)
    if find_ddp(model) is not None:
        raise HybridCommError(
            "the model is DistributedDataParallel already: pass the plain "
            "module (DistributedOptimizer reduces the gradients itself), or "
            "use register() for the DDP hook"
        )
    _check_data_parallel(
        accelerator,
        "hybridcomm.DistributedOptimizer under Accelerate needs plain DDP data parallelism",
    )
    if accelerator.scaler is not None:
        raise HybridCommError(
            "fp16 mixed precision: Accelerate's optimizer wrapper calls GradScaler.step "
            "through a patched step() that hides the scaler from DistributedOptimizer; use "
            "hybridcomm.integrations.accelerate.register() (the DDP hook) for fp16, or bf16"
        )
    model = accelerator.prepare_model(model, evaluation_mode=True)  # placed, autocast, no DDP
    options.setdefault("backward_passes_per_step", accelerator.gradient_accumulation_steps)
    optimizer = DistributedOptimizer(optimizer, model=model, overlap=overlap, **options)
    prepared = accelerator.prepare(optimizer, *others)
    return (model, *prepared) if others else (model, prepared)


def synchronize(optimizer) -> None:
    """Finish the communication and updates of the optimizer :func:`prepare` returned:
    ``.grad`` then holds the averaged gradients (to clip them) and the weights
    every update so far. A no-op for any other optimizer (one process, or the
    hook's route, where backward leaves ``.grad`` averaged)."""
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    if isinstance(optimizer, _DistributedOptimizer):
        optimizer.synchronize()
