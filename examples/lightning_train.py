"""PyTorch Lightning with hybridcomm: the DDP hook, or HybridStrategy (forward overlap).

    python examples/lightning_train.py --devices 2 --route strategy --overlap forward
    python examples/lightning_train.py --devices 2 --route hook
    python examples/lightning_train.py --devices 2 --route ddp          # stock DDP, to compare
    python examples/lightning_train.py --devices 1 --batch-size 32      # one process, whole batch

Lightning starts the other processes itself (CPU, gloo). A small CNN trains on
synthetic data; ``--out`` writes the final parameters (rank 0) for the tests,
``--ckpt-dir`` saves a checkpoint each epoch and ``--resume`` continues from one.
"""

import argparse
import json
import os

import pytorch_lightning as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from pytorch_lightning.strategies import DDPStrategy

import hybridcomm
import hybridcomm.ddp
from hybridcomm.integrations.lightning import HybridDDPStrategy, HybridStrategy

SAMPLES = 192  # a multiple of every global batch the tests use


class Net(pl.LightningModule):
    """Conv layers, then fully-connected ones (no batch norm: its statistics would
    differ between one process on the whole batch and P on its shards)."""

    def __init__(self, optimizer: str, lr: float, batch_size: int):
        super().__init__()
        self.optimizer_name, self.lr, self.batch_size = optimizer, lr, batch_size
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * 8 * 8, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.relu(self.conv2(x))
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("loss", loss)
        return loss

    def train_dataloader(self):
        # In order, rank r taking samples r, r+P, ...: P ranks' batches together are
        # one process's batch of P times the size (Lightning's own sampler shuffles).
        data = dataset()
        sampler = torch.utils.data.DistributedSampler(
            data, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank, shuffle=False
        )
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size, sampler=sampler)

    def configure_optimizers(self):
        if self.optimizer_name == "adam":
            opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.8)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def dataset():
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, 3, 16, 16, generator=g)
    y = torch.randint(0, 10, (SAMPLES,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def strategy_for(args):
    if args.devices == 1:
        return "auto"
    if args.route == "strategy":
        return HybridStrategy(
            overlap=args.overlap,
            process_group_backend="gloo",
            hybridcomm_options=json.loads(args.hybridcomm_options),
        )
    if args.route == "hook":  # on GPUs, DDPStrategy(ddp_comm_hook=..., ddp_comm_state=...) too
        return HybridDDPStrategy(
            hybridcomm.ddp.HybridState(cost_model="default"), process_group_backend="gloo"
        )
    return DDPStrategy(process_group_backend="gloo")


def proof_of_hybridcomm(trainer) -> dict:
    """What shows that hybridcomm reduced the gradients (the tests check it)."""
    strategy = trainer.strategy
    if isinstance(strategy, HybridStrategy):
        return {
            "wrapped": [
                type(o).__name__
                for o in strategy.optimizers
                if isinstance(o, hybridcomm.optimizer._DistributedOptimizer)
            ],
            "buckets": [len(o.plan.buckets) for o in strategy.optimizers],
            "defers": [o.plan.defer_updates for o in strategy.optimizers],
        }
    state = getattr(strategy, "_ddp_comm_state", None)
    if isinstance(state, hybridcomm.ddp.HybridState):
        return {"algorithms": sorted(set(state.algorithms.values()))}
    return {}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--route", choices=["strategy", "hook", "ddp"], default="strategy")
    ap.add_argument("--overlap", choices=["forward", "backward", "none"], default="forward")
    ap.add_argument(
        "--hybridcomm-options",
        default='{"cost_model": "default"}',
        metavar="JSON",
        help="DistributedOptimizer's keyword arguments (route strategy)",
    )
    ap.add_argument("--batch-size", type=int, default=16, help="per process")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--max-steps", type=int, default=-1)
    ap.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    ap.add_argument("--clip", type=float, default=None, help="gradient_clip_val")
    ap.add_argument("--precision", default="32-true", help='e.g. "bf16-mixed"')
    ap.add_argument("--ckpt-dir", default=None, help="save a checkpoint at each epoch's end")
    ap.add_argument("--resume", default=None, metavar="CKPT")
    ap.add_argument("--out", default=None, metavar="PATH", help="final parameters (rank 0)")
    args = ap.parse_args(argv)

    pl.seed_everything(0, workers=True)
    model = Net(args.optimizer, args.lr, args.batch_size)
    callbacks = []
    if args.ckpt_dir:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=args.ckpt_dir, save_top_k=-1, every_n_epochs=1, filename="{epoch}"
            )
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy_for(args),
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=args.clip,
        precision=args.precision,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(args.ckpt_dir),
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(model, ckpt_path=args.resume)
    proof = proof_of_hybridcomm(trainer)
    if trainer.is_global_zero:
        print(
            f"steps {trainer.global_step}, loss {float(trainer.callback_metrics['loss']):.5f}, "
            f"hybridcomm {json.dumps(proof)}"
        )
        if args.out:
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            torch.save({"params": flat, "steps": trainer.global_step, "proof": proof}, args.out)
    return 0


def close() -> None:
    """Tear the process group down once every rank is done. Lightning leaves it up,
    and a process that exits with gloo's threads still running may abort
    ("terminate called without an active exception") or hang in its exit."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    code = main()
    close()
    raise SystemExit(code)
