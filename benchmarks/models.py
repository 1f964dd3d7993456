"""The model of the training benchmark: a small VGG-like CNN sized for a 2-core CPU.

The thesis experiment needs the layer shape that makes hybrid all-reduce pay:
a few convolution layers with few parameters (their gradients come last in
backward and are needed first in the next forward: short sync windows, small
messages) followed by large fully-connected layers that hold most of the
parameters (long windows, big messages). ``vgg_small`` keeps that shape at a
size where one step on 4 ranks sharing 2 cores takes tens of milliseconds.
"""
from __future__ import annotations

import torch
from torch import nn

IMAGE_SHAPE = (3, 32, 32)
NUM_CLASSES = 10


class VggSmall(nn.Module):
    """conv(3->16) conv(16->32) pool conv(32->64) pool | fc(4096->fc) fc(fc->fc) fc(fc->10)."""

    def __init__(self, fc_width: int = 512, num_classes: int = NUM_CLASSES):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Linear(64 * 8 * 8, fc_width), nn.ReLU(inplace=True),
            nn.Linear(fc_width, fc_width), nn.ReLU(inplace=True),
            nn.Linear(fc_width, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


def vgg_small(seed: int = 0) -> VggSmall:
    """A fresh model whose weights depend only on ``seed`` (identical on every rank)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return VggSmall()


def param_counts(model: nn.Module) -> dict:
    """Parameter counts and bytes, split into conv and fully-connected layers."""
    conv = sum(p.numel() for m in model.modules() if isinstance(m, nn.Conv2d)
               for p in m.parameters(recurse=False))
    fc = sum(p.numel() for m in model.modules() if isinstance(m, nn.Linear)
             for p in m.parameters(recurse=False))
    total = sum(p.numel() for p in model.parameters())
    layers = [(name, p.numel()) for name, p in model.named_parameters()]
    return {"name": type(model).__name__, "params": total, "conv_params": conv, "fc_params": fc,
            "bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "tensors": len(layers), "largest_tensor": max(n for _, n in layers)}
