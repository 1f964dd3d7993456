"""The model of the training benchmark: a small VGG-like CNN sized for a 2-core CPU.

The thesis experiment needs the layer shape that makes hybrid all-reduce pay:
a few convolution layers with few parameters (their gradients come last in
backward and are needed first in the next forward: short sync windows, small
messages) followed by large fully-connected layers that hold most of the
parameters (long windows, big messages). ``vgg_small`` keeps that shape at a
size where one step on 4 ranks sharing 2 cores takes tens of milliseconds.

``build(name, seed)`` also makes two real architectures for the same 32x32, 10-class data,
adapted the usual CIFAR way (``MODELS`` says how): ``resnet18`` and ``vgg11`` from
``torchvision.models`` where torchvision imports, else from ``vision_arch.py``, the two
architectures written here from their papers with torchvision's names (PyPI's torchvision
cannot load beside the CPU torch build). Both paths give the same parameter names and shapes, and the same weights for a seed.

``build("transformer", seed)`` (``TOKEN_MODELS``; kept apart from ``MODELS``, the image
models) is a stack of ``nn.TransformerEncoderLayer`` over synthetic token embeddings (its
input is the embeddings themselves, ``input_shape("transformer")`` = (tokens, width)),
mean-pooled into a 10-class head: the shape of a language model's body at CPU size, for
the sharded-optimizer comparison (issue 40).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

IMAGE_SHAPE = (3, 32, 32)
NUM_CLASSES = 10
DEFAULT_MODEL = "vgg_small"  # the thesis model: the regime map and the demo run it
# name -> what it is (--help prints these)
MODELS = {
    "vgg_small": "the thesis model: 3 small convs, 3 large FC layers, 2.39M params",
    "vgg11": "torchvision's VGG-11 with a CIFAR head (global pool + Linear(512, 10)), 9.23M params",
    "resnet18": "torchvision's ResNet-18 with the CIFAR stem (3x3 stride-1 conv1, no maxpool), "
    "fc 512->10, 11.17M params",
}

# Models whose input is a sequence of token embeddings rather than an image (not in MODELS,
# which lists the image models; train.py offers both).
TOKEN_MODELS = {
    "transformer": "4 nn.TransformerEncoderLayer (width 256, 4 heads, FF 1024, no dropout) "
    "on 32 synthetic token embeddings, mean-pooled, Linear(256, 10); 3.16M params",
}
ALL_MODELS = {**MODELS, **TOKEN_MODELS}
TOKENS, WIDTH = 32, 256


def input_shape(name: str) -> tuple:
    """One sample's shape for ``build(name)``: an image, or (tokens, width) embeddings."""
    return (TOKENS, WIDTH) if name in TOKEN_MODELS else IMAGE_SHAPE


class VggSmall(nn.Module):
    """conv(3->16) conv(16->32) pool conv(32->64) pool | fc(4096->fc) fc(fc->fc) fc(fc->10)."""

    def __init__(self, fc_width: int = 512, num_classes: int = NUM_CLASSES):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Linear(64 * 8 * 8, fc_width),
            nn.ReLU(inplace=True),
            nn.Linear(fc_width, fc_width),
            nn.ReLU(inplace=True),
            nn.Linear(fc_width, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


def vgg_small(seed: int = 0) -> VggSmall:
    """A fresh model whose weights depend only on ``seed`` (identical on every rank)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return VggSmall()


class TokenTransformer(nn.Module):
    """``layers`` x nn.TransformerEncoderLayer(width, heads, ff) on (batch, tokens, width)
    embeddings, mean over the tokens, Linear(width, classes). Dropout 0, so every
    config of the benchmark trains on the same numbers."""

    def __init__(
        self,
        layers: int = 4,
        width: int = WIDTH,
        heads: int = 4,
        ff: int = 1024,
        num_classes: int = NUM_CLASSES,
    ):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, ff, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(dim=1))


def transformer(seed: int = 0) -> TokenTransformer:
    """A fresh TokenTransformer whose weights depend only on ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TokenTransformer()


# ---------------------------------------------------------------- real architectures


@functools.lru_cache(maxsize=None)
def _torchvision_models():
    """``torchvision.models``, or None where torchvision is missing or cannot load."""
    try:
        import torchvision.models
    except Exception:  # absent, or its C ops fail to register beside this torch build
        return None
    return torchvision.models


def _arch_module(use_torchvision=None):
    """Where resnet18/vgg11 come from: torchvision.models (None: where it imports) or the copy."""
    tv = _torchvision_models() if use_torchvision in (None, True) else None
    if use_torchvision and tv is None:
        raise RuntimeError("torchvision cannot be imported here")
    if tv is not None:
        return tv
    import vision_arch

    return vision_arch


def model_source(name: str, use_torchvision=None) -> str:
    """Where ``build(name)`` takes the architecture from, in words."""
    if name in ("vgg_small", "transformer"):
        return "in-repo"
    if _arch_module(use_torchvision).__name__ == "vision_arch":
        import vision_arch

        return f"in-repo: {vision_arch.__version__}"
    import torchvision

    return f"torchvision {torchvision.__version__}"


def _cifar_resnet(model: nn.Module) -> None:
    """The CIFAR stem (He et al. 2016's CIFAR ResNets; the usual CIFAR ResNet-18): a 3x3
    stride-1 conv1 and no maxpool, so layer1..4 see 32, 16, 8, 4 pixels; torchvision's
    7x7/2 stem + maxpool would leave 8x8 for layer1 and 1x1 for layer4. 7,680 fewer params
    (11,181,642 -> 11,173,962); about 4x the compute (430 ms forward+backward at batch 8 on
    one core here, against 115 ms)."""
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()


def _cifar_vgg(model: nn.Module) -> None:
    """A CIFAR head: the 32x32 input leaves 512x1x1 after VGG-11's five pools, which
    torchvision's AdaptiveAvgPool2d((7, 7)) would copy 49 times into a 25088-4096-4096-10
    classifier (128.8M params in all: 515 MB of gradients, a minute per all-reduce at
    100 Mbit/s). Global pool + one Linear(512, 10) instead (the usual CIFAR VGG), kept in a
    Sequential so ``classifier[-1]`` is the last layer as in torchvision; no dropout left,
    so every config trains on the same numbers."""
    model.avgpool = nn.AdaptiveAvgPool2d((1, 1))
    model.classifier = nn.Sequential(nn.Linear(512, NUM_CLASSES))


# name -> (CIFAR adaptation, how torchvision initialises its Linear layers)
_ADAPT = {"resnet18": (_cifar_resnet, "default"), "vgg11": (_cifar_vgg, "normal")}


def _init_like_torchvision(model: nn.Module, seed: int, linear: str) -> None:
    """torchvision's initialisation, drawn in module order from ``seed`` alone: conv
    kaiming_normal_(fan_out, relu) and zero bias, batch norm 1/0 with fresh running
    statistics, Linear normal(0, 0.01) and zero bias (VGG) or PyTorch's default (ResNet).
    The distributions are torchvision's; the numbers differ from what torchvision draws for
    the same seed (it draws PyTorch's default init first), but are the same on both paths."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                m.reset_parameters()  # weight 1, bias 0, running mean 0 / var 1, count 0
            elif isinstance(m, nn.Linear):
                if linear == "normal":
                    nn.init.normal_(m.weight, 0, 0.01)
                    nn.init.zeros_(m.bias)
                else:
                    m.reset_parameters()


def build(name: str = DEFAULT_MODEL, seed: int = 0, use_torchvision=None) -> nn.Module:
    """A fresh ``name`` model (one of ``MODELS``) whose weights depend only on ``seed``.

    ``use_torchvision``: None takes torchvision.models where it imports, else the in-repo
    copy; True or False insists. Built on the meta device first, so torchvision's VGG-11
    classifier (128.8M params, replaced by the CIFAR head) is never allocated nor drawn.
    """
    if name == "vgg_small":
        return vgg_small(seed)
    if name == "transformer":
        return transformer(seed)
    if name not in _ADAPT:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(ALL_MODELS)}")
    adapt, linear = _ADAPT[name]
    arch = getattr(_arch_module(use_torchvision), name)
    with torch.device("meta"):
        model = arch(num_classes=NUM_CLASSES)
        adapt(model)
    model = model.to_empty(device="cpu")
    _init_like_torchvision(model, seed, linear)
    return model


def param_counts(model: nn.Module) -> dict:
    """Parameter counts and bytes, split into conv and fully-connected layers."""
    conv = sum(
        p.numel()
        for m in model.modules()
        if isinstance(m, nn.Conv2d)
        for p in m.parameters(recurse=False)
    )
    fc = sum(
        p.numel()
        for m in model.modules()
        if isinstance(m, nn.Linear)
        for p in m.parameters(recurse=False)
    )
    total = sum(p.numel() for p in model.parameters())
    layers = [(name, p.numel()) for name, p in model.named_parameters()]
    return {
        "name": type(model).__name__,
        "params": total,
        "conv_params": conv,
        "fc_params": fc,
        "bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "tensors": len(layers),
        "largest_tensor": max(n for _, n in layers),
    }
