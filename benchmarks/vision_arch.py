"""ResNet-18 and VGG-11, written here from their papers, with torchvision's module names.

For machines where torchvision cannot load (PyPI's wheel fails beside the CPU torch build
``make test`` installs), ``models.py`` builds these instead.

- **ResNet-18** (He et al. 2016, "Deep Residual Learning for Image Recognition", Table 1,
  the 18-layer column): a 7x7 stride-2 convolution to 64 channels, batch norm, ReLU and a
  3x3 stride-2 max pool; four stages of two basic blocks with 64, 128, 256 and 512
  channels, the first block of stages 2-4 striding by 2; global average pooling and one
  fully connected layer. A basic block (their Figure 2, left) is two 3x3 convolutions,
  each followed by batch norm, ReLU after the first and after the sum with the shortcut:
  the identity, or where the shape changes a 1x1 projection with batch norm (their
  option B). Convolutions have no bias (batch norm follows each).
- **VGG-11** (Simonyan and Zisserman 2015, "Very Deep Convolutional Networks for
  Large-Scale Image Recognition", Table 1, configuration A): 3x3 convolutions with
  padding 1, each followed by ReLU, in the channel plan 64 M 128 M 256 256 M 512 512 M
  512 512 M (M: a 2x2 stride-2 max pool), then fully connected layers 4096, 4096 and the
  classes, with ReLU and dropout 0.5 after the first two. The 7x7 adaptive pool before
  them makes the first one 512 x 7 x 7 inputs wide whatever the image size.

Module and parameter names, and the order modules are registered in, follow torchvision's
(``conv1``, ``layer2.0.downsample.0``, ``features.3``, ``classifier.6``, ...), so that the
tests (tests/test_benchmark_models.py) pin these models to the real torchvision's names and
shapes, and ``models.build`` draws the same weights on both. The weights are drawn there
(torchvision's distributions, in module order, from the seed alone); these constructors
leave PyTorch's defaults.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch
from torch import nn

__version__ = "ResNet-18 and VGG-11 written here (names as torchvision 0.28.0's)"

VGG11_PLAN = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


def _conv(cin: int, cout: int, kernel: int, stride: int = 1) -> nn.Conv2d:
    """A bias-free convolution padded to keep the size (before batch norm)."""
    return nn.Conv2d(cin, cout, kernel_size=kernel, stride=stride, padding=kernel // 2, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm, and the shortcut added before the last ReLU."""

    expansion = 1

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = _conv(cin, cout, 3, stride)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv(cout, cout, 3)
        self.bn2 = nn.BatchNorm2d(cout)
        # a projection only where the shape changes (option B); registered last
        self.downsample = (
            nn.Sequential(_conv(cin, cout, 1, stride), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return self.relu(out + shortcut)


class ResNet(nn.Module):
    """A ResNet of basic blocks: ``blocks[i]`` blocks in stage ``i + 1`` (``layer1``..)."""

    def __init__(self, blocks: Sequence[int] = (2, 2, 2, 2), num_classes: int = 1000):
        super().__init__()
        self.conv1 = _conv(3, 64, 7, 2)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        cin = 64
        for i, (width, count) in enumerate(zip((64, 128, 256, 512), blocks)):
            first = BasicBlock(cin, width, stride=1 if i == 0 else 2)
            rest = [BasicBlock(width, width) for _ in range(count - 1)]
            setattr(self, f"layer{i + 1}", nn.Sequential(first, *rest))
            cin = width
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def vgg_features(plan: Sequence[Union[int, str]]) -> nn.Sequential:
    """The convolutional part of a VGG: ``plan`` lists output channels, "M" a max pool."""
    layers, cin = [], 3
    for v in plan:
        if v == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            layers += [nn.Conv2d(cin, v, kernel_size=3, padding=1), nn.ReLU(inplace=True)]
            cin = v
    return nn.Sequential(*layers)


class VGG(nn.Module):
    """A VGG: ``features``, a 7x7 adaptive pool, three fully connected layers."""

    def __init__(
        self,
        plan: Sequence[Union[int, str]] = VGG11_PLAN,
        num_classes: int = 1000,
        dropout: float = 0.5,
    ):
        super().__init__()
        self.features = vgg_features(plan)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def resnet18(num_classes: int = 1000) -> ResNet:
    return ResNet((2, 2, 2, 2), num_classes)


def vgg11(num_classes: int = 1000) -> VGG:
    return VGG(VGG11_PLAN, num_classes)
