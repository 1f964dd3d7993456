"""hybridcomm under ``transformers.Trainer``: a callback that registers the DDP hook.

:class:`HybridCommCallback` (or :func:`enable`) registers hybridcomm's hook
(:mod:`hybridcomm.ddp`) on ``trainer.model_wrapped`` at ``on_train_begin``;
the rest is the Trainer's. Forward overlap is not offered: the Trainer always
wraps a multi-process model in DDP, which would reduce the gradients too.
Usage and what works: docs/INTEGRATIONS.md, "transformers.Trainer".
"""

from __future__ import annotations

import logging
from typing import Optional

from transformers import Trainer, TrainerCallback

from ..ddp import HybridState
from .accelerate import find_ddp, register

log = logging.getLogger("hybridcomm")

__all__ = ["HybridCommCallback", "enable"]


class HybridCommCallback(TrainerCallback):
    """Registers hybridcomm's DDP hook on the Trainer's DDP model when training begins.

    Args:
        trainer: the ``transformers.Trainer`` this callback is added to (the
            callback needs it: callbacks get the unwrapped model only).
        **state_kwargs: passed to :class:`hybridcomm.ddp.HybridState`
            (``cost_model``, ``timeout``).

    ``callback.state`` is the hook's ``HybridState`` once training began in
    several processes (None before, and in one process). A second ``train()``
    on the same DDP model (resuming) keeps the hook it has.

    Raises (from ``trainer.train()``):
        HybridCommError: several processes but the Trainer's model is not DDP
            (DeepSpeed, FSDP), or another DDP hook is registered.

    Example::

        trainer = Trainer(model=model, args=args, train_dataset=train_set)
        trainer.add_callback(HybridCommCallback(trainer))
        trainer.train()
    """

    def __init__(self, trainer: Trainer, **state_kwargs):
        if not isinstance(trainer, Trainer):
            raise TypeError(
                f"HybridCommCallback takes the transformers.Trainer it is added to, "
                f"got {type(trainer).__name__}"
            )
        self.trainer = trainer
        self.state_kwargs = state_kwargs
        self.state: Optional[HybridState] = None
        self._hooked = None  # the DDP model the hook is on

    def on_train_begin(self, args, state, control, **kwargs):
        # The one hook point after train() wrapped the model in DDP and before the
        # first backward; callbacks get the unwrapped model, so read the Trainer's
        wrapped = self.trainer.model_wrapped
        ddp = find_ddp(wrapped)
        if ddp is not None and ddp is self._hooked:
            return  # train() again on the same DDP model: the hook is in place
        self.state = register(self.trainer.accelerator, wrapped, **self.state_kwargs)
        self._hooked = ddp
        if self.state is not None:
            log.debug("hybridcomm: DDP hook registered on the Trainer's model")


def enable(trainer: Trainer, **state_kwargs) -> HybridCommCallback:
    """Add a :class:`HybridCommCallback` to ``trainer``; return it.

    Example::

        callback = hybridcomm.integrations.transformers.enable(trainer)
        trainer.train()
    """
    callback = HybridCommCallback(trainer, **state_kwargs)
    trainer.add_callback(callback)
    return callback
