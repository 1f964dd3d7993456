"""Small models and a single-process reference for the optimizer tests."""
import torch
import torch.nn as nn

GLOBAL_BATCH = 12


class ConvNet(nn.Module):
    """Conv layers first, then fully-connected layers (the thesis's shape), tiny."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.fc1 = nn.Linear(4 * 6 * 6, 32)
        self.fc2 = nn.Linear(32, 3)

    def forward(self, x):
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def make_model(seed=0, cls=ConvNet):
    torch.manual_seed(seed)
    return cls()


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 2, 6, 6, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


def shard(t, rank, world):
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n]


def make_optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    raise ValueError(name)


def make_scheduler(name, opt):
    """AdamW runs with a schedule that changes lr every step."""
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if name == "adamw" else None


def train_single(opt_name, steps, cls=ConvNet, data=batch):
    """The reference: one process on the whole batch (``data(step)``)."""
    model = make_model(cls=cls)
    opt = make_optimizer(opt_name, model.parameters())
    sched = make_scheduler(opt_name, opt)
    for s in range(steps):
        x, y = data(s)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if sched:
            sched.step()
    return [p.detach().clone() for p in model.parameters()]


def flat(params):
    return torch.cat([p.detach().reshape(-1) for p in params])
