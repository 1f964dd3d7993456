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
    return torch.randn(GLOBAL_BATCH, 2, 6, 6, generator=g), torch.randn(
        GLOBAL_BATCH, 3, generator=g
    )


def shard(t, rank, world):
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]


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


# ---- the compression tests' task --------------------------------------------------------


def teacher_task(n, seed):
    """``n`` inputs of 64 features, labelled by a fixed random linear teacher (10
    classes): learnable, so compression's cost shows in the accuracy."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(64, 10, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, 64, generator=g)
    return x, (x @ teacher).argmax(1)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


def compressed_steps(rank, world, compression, steps=3, momentum=0.0):
    """An MLP and hybridcomm with ``compression`` after ``steps`` steps on this
    rank's share of a small teacher task: ``(model, optimizer)``."""
    import hybridcomm

    model = mlp()
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum),
        model=model,
        compression=compression,
        timeout=60,
    )
    x, y = teacher_task(300, 3)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[rank::world]), y[rank::world]).backward()
        opt.step()
    return model, opt


def train_compressed(
    rank, world, compression, overlap, *, samples, batch, epochs, steps=None, **options
):
    """hybridcomm with ``compression`` on this rank's share of the teacher task:
    test accuracy, bytes sent, the parameters, the plan and the optimizer's state."""
    import hybridcomm

    model = mlp()
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        model=model,
        compression=compression,
        overlap=overlap,
        timeout=60,
        **options,
    )
    x, y = teacher_task(samples, 1)
    x, y = x[rank::world], y[rank::world]
    sent, done = 0, 0
    for _ in range(epochs):
        for i in range(0, len(x) - batch + 1, batch):
            if steps is not None and done == steps:
                break
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[i : i + batch]), y[i : i + batch]).backward()
            opt.step()
            sent += opt.last_step_stats["bytes_sent"]
            done += 1
    opt.synchronize()
    xt, yt = teacher_task(1000, 2)
    acc = (model(xt).argmax(1) == yt).float().mean().item()
    out = {
        "acc": acc,
        "sent": sent,
        "params": flat(model.parameters()),
        "plan": str(opt.plan),
        "state": opt.state_dict(),
    }
    opt.close()
    return out
