"""benchmarks/models.py: the benchmark's models, pinned to the real torchvision's parameters.

The resnet18/vgg11 constants below were printed from torchvision 0.28.0 itself (the PyPI
wheel, imported beside torch 2.13.0+cpu after defining the two op schemas its C library
fails to register, torchvision::nms and ::qnms) as
``[(n, tuple(p.shape)) for n, p in models.build(name, use_torchvision=True).named_parameters()]``,
i.e. ``torchvision.models.resnet18/vgg11(num_classes=10)`` with models.py's CIFAR adaptation.
The in-repo architectures (benchmarks/vision_arch.py, written from the papers with
torchvision's names), which these tests build where torchvision cannot load, must give the
same; where torchvision loads, the two must give bitwise the same state_dict for a seed.
vgg_small's are the thesis model's (2,389,034 params, as benchmarks/README.md shows).
"""

import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
)
import models  # noqa: E402
import vision_arch  # noqa: E402

VGG_SMALL_PARAMS = 2389034
VGG_SMALL_SHAPES = [
    ("features.0.weight", (16, 3, 3, 3)),
    ("features.0.bias", (16,)),
    ("features.2.weight", (32, 16, 3, 3)),
    ("features.2.bias", (32,)),
    ("features.5.weight", (64, 32, 3, 3)),
    ("features.5.bias", (64,)),
    ("classifier.0.weight", (512, 4096)),
    ("classifier.0.bias", (512,)),
    ("classifier.2.weight", (512, 512)),
    ("classifier.2.bias", (512,)),
    ("classifier.4.weight", (10, 512)),
    ("classifier.4.bias", (10,)),
]
VGG11_PARAMS = 9225610
VGG11_SHAPES = [
    ("features.0.weight", (64, 3, 3, 3)),
    ("features.0.bias", (64,)),
    ("features.3.weight", (128, 64, 3, 3)),
    ("features.3.bias", (128,)),
    ("features.6.weight", (256, 128, 3, 3)),
    ("features.6.bias", (256,)),
    ("features.8.weight", (256, 256, 3, 3)),
    ("features.8.bias", (256,)),
    ("features.11.weight", (512, 256, 3, 3)),
    ("features.11.bias", (512,)),
    ("features.13.weight", (512, 512, 3, 3)),
    ("features.13.bias", (512,)),
    ("features.16.weight", (512, 512, 3, 3)),
    ("features.16.bias", (512,)),
    ("features.18.weight", (512, 512, 3, 3)),
    ("features.18.bias", (512,)),
    ("classifier.0.weight", (10, 512)),
    ("classifier.0.bias", (10,)),
]
RESNET18_PARAMS = 11173962
RESNET18_SHAPES = [
    ("conv1.weight", (64, 3, 3, 3)),
    ("bn1.weight", (64,)),
    ("bn1.bias", (64,)),
    ("layer1.0.conv1.weight", (64, 64, 3, 3)),
    ("layer1.0.bn1.weight", (64,)),
    ("layer1.0.bn1.bias", (64,)),
    ("layer1.0.conv2.weight", (64, 64, 3, 3)),
    ("layer1.0.bn2.weight", (64,)),
    ("layer1.0.bn2.bias", (64,)),
    ("layer1.1.conv1.weight", (64, 64, 3, 3)),
    ("layer1.1.bn1.weight", (64,)),
    ("layer1.1.bn1.bias", (64,)),
    ("layer1.1.conv2.weight", (64, 64, 3, 3)),
    ("layer1.1.bn2.weight", (64,)),
    ("layer1.1.bn2.bias", (64,)),
    ("layer2.0.conv1.weight", (128, 64, 3, 3)),
    ("layer2.0.bn1.weight", (128,)),
    ("layer2.0.bn1.bias", (128,)),
    ("layer2.0.conv2.weight", (128, 128, 3, 3)),
    ("layer2.0.bn2.weight", (128,)),
    ("layer2.0.bn2.bias", (128,)),
    ("layer2.0.downsample.0.weight", (128, 64, 1, 1)),
    ("layer2.0.downsample.1.weight", (128,)),
    ("layer2.0.downsample.1.bias", (128,)),
    ("layer2.1.conv1.weight", (128, 128, 3, 3)),
    ("layer2.1.bn1.weight", (128,)),
    ("layer2.1.bn1.bias", (128,)),
    ("layer2.1.conv2.weight", (128, 128, 3, 3)),
    ("layer2.1.bn2.weight", (128,)),
    ("layer2.1.bn2.bias", (128,)),
    ("layer3.0.conv1.weight", (256, 128, 3, 3)),
    ("layer3.0.bn1.weight", (256,)),
    ("layer3.0.bn1.bias", (256,)),
    ("layer3.0.conv2.weight", (256, 256, 3, 3)),
    ("layer3.0.bn2.weight", (256,)),
    ("layer3.0.bn2.bias", (256,)),
    ("layer3.0.downsample.0.weight", (256, 128, 1, 1)),
    ("layer3.0.downsample.1.weight", (256,)),
    ("layer3.0.downsample.1.bias", (256,)),
    ("layer3.1.conv1.weight", (256, 256, 3, 3)),
    ("layer3.1.bn1.weight", (256,)),
    ("layer3.1.bn1.bias", (256,)),
    ("layer3.1.conv2.weight", (256, 256, 3, 3)),
    ("layer3.1.bn2.weight", (256,)),
    ("layer3.1.bn2.bias", (256,)),
    ("layer4.0.conv1.weight", (512, 256, 3, 3)),
    ("layer4.0.bn1.weight", (512,)),
    ("layer4.0.bn1.bias", (512,)),
    ("layer4.0.conv2.weight", (512, 512, 3, 3)),
    ("layer4.0.bn2.weight", (512,)),
    ("layer4.0.bn2.bias", (512,)),
    ("layer4.0.downsample.0.weight", (512, 256, 1, 1)),
    ("layer4.0.downsample.1.weight", (512,)),
    ("layer4.0.downsample.1.bias", (512,)),
    ("layer4.1.conv1.weight", (512, 512, 3, 3)),
    ("layer4.1.bn1.weight", (512,)),
    ("layer4.1.bn1.bias", (512,)),
    ("layer4.1.conv2.weight", (512, 512, 3, 3)),
    ("layer4.1.bn2.weight", (512,)),
    ("layer4.1.bn2.bias", (512,)),
    ("fc.weight", (10, 512)),
    ("fc.bias", (10,)),
]

# torchvision 0.28.0's resnet18/vgg11(num_classes=10) before the CIFAR adaptation
UNADAPTED_PARAMS = {"resnet18": 11181642, "vgg11": 128807306}
EXPECTED = {
    "vgg_small": (VGG_SMALL_PARAMS, VGG_SMALL_SHAPES),
    "vgg11": (VGG11_PARAMS, VGG11_SHAPES),
    "resnet18": (RESNET18_PARAMS, RESNET18_SHAPES),
}
TORCHVISION = models._torchvision_models() is not None


def _shapes(model):
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def test_every_name_is_offered_and_the_default_is_the_thesis_model():
    assert list(models.MODELS) == ["vgg_small", "vgg11", "resnet18"] == list(EXPECTED)
    assert models.DEFAULT_MODEL == "vgg_small"
    with pytest.raises(ValueError, match="unknown model"):
        models.build("resnet50")


@pytest.mark.parametrize("name", list(EXPECTED))
def test_parameters_are_torchvisions(name):
    params, shapes = EXPECTED[name]
    model = models.build(name, seed=0)  # torchvision where it imports, else vision_arch
    assert _shapes(model) == shapes
    counts = models.param_counts(model)
    assert counts["params"] == params and counts["bytes"] == 4 * params
    if name != "vgg_small":  # vision_arch in particular, whichever build() took
        assert _shapes(models.build(name, seed=0, use_torchvision=False)) == shapes


@pytest.mark.parametrize("name", ["resnet18", "vgg11"])
def test_the_in_repo_architecture_before_the_cifar_adaptation_has_torchvisions_size(name):
    with torch.device("meta"):  # vgg11's 128.8M parameters are never allocated
        model = getattr(vision_arch, name)(num_classes=10)
    assert sum(p.numel() for p in model.parameters()) == UNADAPTED_PARAMS[name]


@pytest.mark.parametrize("name", list(EXPECTED))
def test_forward_backward_on_a_cifar_batch(name):
    model = models.build(name, seed=0)
    x, y = torch.randn(2, *models.IMAGE_SHAPE), torch.tensor([3, 7])
    out = model(x)
    assert out.shape == (2, models.NUM_CLASSES)
    F.cross_entropy(out, y).backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n


@pytest.mark.parametrize("name", ["resnet18", "vgg11"])
def test_weights_depend_on_the_seed_alone_and_follow_torchvisions_init(name):
    a, b = models.build(name, seed=5), models.build(name, seed=5)
    assert all(torch.equal(u, v) for u, v in zip(a.state_dict().values(), b.state_dict().values()))
    c = models.build(name, seed=6)
    assert not torch.equal(next(a.parameters()), next(c.parameters()))
    for n, m in a.named_modules():
        if isinstance(m, torch.nn.Conv2d):  # kaiming_normal_(fan_out, relu)
            fan_out = m.out_channels * m.kernel_size[0] * m.kernel_size[1]
            if m.weight.numel() >= 4096:  # enough draws for the spread to be near its std
                assert m.weight.std().item() == pytest.approx((2 / fan_out) ** 0.5, rel=0.1), n
        elif isinstance(m, torch.nn.BatchNorm2d):
            assert (m.weight == 1).all() and (m.bias == 0).all() and (m.running_var == 1).all()
    if name == "vgg11":  # Linear: normal(0, 0.01), zero bias
        assert a.classifier[-1].weight.std().item() == pytest.approx(0.01, rel=0.15)
        assert (a.classifier[-1].bias == 0).all()


@pytest.mark.skipif(not TORCHVISION, reason="torchvision cannot be imported here")
@pytest.mark.parametrize("name", ["resnet18", "vgg11"])
def test_torchvision_and_the_in_repo_architecture_give_the_same_model(name):
    real = models.build(name, seed=1234, use_torchvision=True)
    copy = models.build(name, seed=1234, use_torchvision=False)
    assert type(real).__module__.startswith("torchvision.")
    assert type(copy).__module__ == "vision_arch"
    ra, ca = real.state_dict(), copy.state_dict()
    assert list(ra) == list(ca) and all(torch.equal(ra[k], ca[k]) for k in ra)
    assert models.model_source(name).startswith("torchvision ")


@pytest.mark.skipif(TORCHVISION, reason="torchvision imports here")
def test_without_torchvision_the_in_repo_architecture_is_used_and_said_so():
    assert type(models.build("resnet18")).__module__ == "vision_arch"
    assert models.model_source("resnet18") == f"in-repo: {vision_arch.__version__}"
    assert models.model_source("vgg_small") == "in-repo"
    with pytest.raises(RuntimeError, match="torchvision cannot be imported"):
        models.build("vgg11", use_torchvision=True)
