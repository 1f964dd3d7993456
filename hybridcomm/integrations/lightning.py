"""PyTorch Lightning: hybridcomm's forward overlap under Lightning's own loop.

Two strategies: :class:`HybridStrategy` (forward overlap: no DDP, each optimizer
wrapped in :func:`hybridcomm.DistributedOptimizer`) and
:class:`HybridDDPStrategy` (backward overlap: Lightning's DDP with hybridcomm's
hook, on any device). Usage and what works: docs/INTEGRATIONS.md, "PyTorch
Lightning".
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable, Optional

import pytorch_lightning as pl
from pytorch_lightning.strategies import DDPStrategy

from ..ddp import HybridState, hybrid_hook
from ..optimizer import DistributedOptimizer, _DistributedOptimizer

log = logging.getLogger("hybridcomm")


class HybridDDPStrategy(DDPStrategy):
    """Lightning's DDP with hybridcomm's communication hook, on any device.

    Args:
        state: the hook's :class:`hybridcomm.ddp.HybridState` (default: a new one).
        **kwargs: ``DDPStrategy``'s.

    Example::

        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=HybridDDPStrategy())
    """

    strategy_name = "hybridcomm_ddp_hook"

    def __init__(self, state: Optional[HybridState] = None, **kwargs: Any) -> None:
        super().__init__(
            ddp_comm_state=state if state is not None else HybridState(),
            ddp_comm_hook=hybrid_hook,
            **kwargs,
        )

    def _register_ddp_hooks(self) -> None:
        # Lightning registers a DDP hook on CUDA devices only (and drops it elsewhere
        # without a word), so on other devices it is registered here
        if self.root_device.type == "cuda":  # Lightning's own registration
            super()._register_ddp_hooks()
        else:
            self.model.register_comm_hook(self._ddp_comm_state, self._ddp_comm_hook)
        self._ddp_comm_state.prepare(self.root_device)  # the set-up now, not in backward
        log.debug("hybridcomm: the DDP hook registered on %s", self.root_device)


def _drive(scheduler, opt) -> None:
    """Point ``scheduler`` at the wrapped ``opt``, with the step tracking torch's
    schedulers patch onto their optimizer (else they warn on every step)."""
    scheduler.optimizer = opt
    step = opt.step

    @functools.wraps(step)
    def tracked_step(*args, **kwargs):
        opt._opt_called = True
        return step(*args, **kwargs)

    tracked_step._wrapped_by_lr_sched = True
    opt.step = tracked_step


class HybridStrategy(DDPStrategy):
    """Lightning's DDP strategy with hybridcomm's optimizer wrapper instead of DDP.

    Args:
        overlap: ``"forward"`` (default), ``"backward"`` or ``"none"``: see
            :func:`hybridcomm.DistributedOptimizer`.
        hybridcomm_options: other keyword arguments of ``DistributedOptimizer``
            (``strategy``, ``compression``, ``cost_model``, ``timeout``, ...).
        **kwargs: ``DDPStrategy``'s (process group backend, timeout, cluster
            environment...); DDP's own module options do not apply.

    ``strategy.optimizers`` are the wrapped optimizers: ``print(opt.plan)``
    shows each one's plan.

    Example::

        trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=100,
                             gradient_clip_val=1.0, accumulate_grad_batches=2,
                             strategy=HybridStrategy(overlap="forward"))
        trainer.fit(lit_model, train_loader)
    """

    strategy_name = "hybridcomm"

    def __init__(
        self, overlap: str = "forward", hybridcomm_options: Optional[dict] = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self._overlap = overlap
        self._hc_options = dict(hybridcomm_options or {})

    # ---- no DDP wrapper: the optimizers reduce ----------------------------------------------
    def configure_ddp(self) -> None:
        """Keep the module as it is (a DDP wrapper would reduce every gradient twice)."""

    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        """Lightning's optimizers, each wrapped in ``DistributedOptimizer`` (collective:
        every rank agrees on a plan); schedulers then drive the wrapped ones."""
        super().setup_optimizers(trainer)
        wrapped = []
        for opt in self.optimizers:
            if not isinstance(opt, _DistributedOptimizer):
                hc = DistributedOptimizer(
                    opt, model=self.lightning_module, overlap=self._overlap, **self._hc_options
                )
                for config in self.lr_scheduler_configs:
                    if getattr(config.scheduler, "optimizer", None) is opt:
                        _drive(config.scheduler, hc)
                opt = hc
            wrapped.append(opt)
        self.optimizers = wrapped
        log.debug(
            "hybridcomm: HybridStrategy wrapped %d optimizer(s), overlap=%s",
            len(wrapped),
            self._overlap,
        )

    @contextlib.contextmanager
    def block_backward_sync(self):
        """Accumulation's early micro-batches: no communication."""
        with contextlib.ExitStack() as stack:
            for opt in self._hybrid_optimizers():
                stack.enter_context(opt.no_sync())
            yield None

    # ---- the step -------------------------------------------------------------------------
    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any):
        """Lightning's step, with the gradients reduced before anything after the
        closure reads them (clipping, the scaler's inf check, hooks); otherwise the
        wrapped optimizer's step defers the update (forward mode)."""
        hc = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's own
        if isinstance(hc, _DistributedOptimizer) and self._reads_grads_after_closure():
            inner = closure

            def closure():
                out = inner()
                hc.synchronize()
                return out

        return super().optimizer_step(optimizer, closure, model, **kwargs)

    def _reads_grads_after_closure(self) -> bool:
        """Whether something between the closure and the step reads ``.grad``."""
        trainer, module = self.lightning_module.trainer, self.lightning_module
        if trainer.gradient_clip_val:
            return True
        if getattr(self.precision_plugin, "scaler", None) is not None:
            return True
        overridden = (
            type(module).on_before_optimizer_step is not pl.LightningModule.on_before_optimizer_step
            or type(module).configure_gradient_clipping
            is not pl.LightningModule.configure_gradient_clipping
        )
        return overridden or any(
            type(cb).on_before_optimizer_step is not pl.Callback.on_before_optimizer_step
            for cb in trainer.callbacks
        )

    def _hybrid_optimizers(self):
        return [o for o in self.optimizers if isinstance(o, _DistributedOptimizer)]

    def teardown(self) -> None:
        """Finish pending updates, stop hybridcomm's channels, then Lightning's teardown."""
        for opt in self._hybrid_optimizers():
            opt.close()
        super().teardown()
