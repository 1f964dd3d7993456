"""Forward mode's first-use rule (first_use.py) when the synchronizer applies
updates together: a bucket whose update was applied with another one, before
its own first read, still has that first read learned. The synchronizer does
this after the measured steps (updates whose reductions are done go in one
optimizer call), and whether a reduction is done is a matter of timing: these
tests drive FirstUse with the batching decided by the test, so they are
deterministic where the multi-rank runs are not."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from hybridcomm.first_use import FirstUse


class ParentReadsHead(nn.Module):
    """The root reads ``head.weight`` itself (head's forward never runs)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return F.linear(torch.relu(self.body(x)), self.head.weight, self.head.bias)


class Updates:
    """The synchronizer's side: which buckets are pending, and an update that
    changes the weights (+1) so a stale read shows in the output. With
    ``together``, applying any bucket applies every pending one."""

    def __init__(self, model):
        self.model = model
        self.params = list(model.parameters())
        self.buckets = [[0, 1], [2, 3]]  # body, head
        self.pending, self.together, self.applied = set(), False, []

    def apply(self, b):
        for c in sorted(self.pending) if self.together else [b]:
            self.pending.discard(c)
            self.applied.append(c)
            with torch.no_grad():
                for i in self.buckets[c]:
                    self.params[i].add_(1.0)

    def apply_all(self):  # as the synchronizer's apply_pending: the watch ends first
        self.fu.stop_watching()
        for b in sorted(self.pending):
            self.apply(b)

    def first_use(self):
        fu = FirstUse(self.model, {id(p): i for i, p in enumerate(self.params)},
                      [n for n, _ in self.model.named_parameters()],
                      bucket_of=lambda i: 0 if i < 2 else 1,
                      pending=lambda b: b in self.pending, apply=self.apply,
                      apply_all=self.apply_all)
        fu.set_buckets([["body"], ["head"]], [[self.params[i] for i in b] for b in self.buckets])
        self.fu = fu
        return fu


def _fresh_output(model, x):
    with torch.no_grad():
        return model(x)


def test_a_bucket_applied_with_another_before_its_first_read_still_learns_that_read():
    torch.manual_seed(0)
    model, x = ParentReadsHead(), torch.randn(3, 4)
    up = Updates(model)
    fu = up.first_use()
    # The watched forward: body's read applies both (head's reduction was done).
    up.pending, up.together = {0, 1}, True
    fu.watch()
    model(x)
    assert up.applied == [0, 1]
    # A later forward: head's update is still pending when the root reads it.
    up.pending, up.together, up.applied = {0, 1}, False, []
    out = model(x)
    assert up.applied == [1, 0]  # the root's pre-hook applies head, body's applies body
    assert torch.equal(out, _fresh_output(model, x)), "the root read a stale head.weight"
    fu.close()


class SkipsHeadSometimes(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4)
        self.skip = False

    def forward(self, x):
        h = torch.relu(self.body(x))
        return h if self.skip else self.head(h)


def test_a_layer_the_watched_forward_skips_is_applied_before_its_owner_runs():
    torch.manual_seed(0)
    model, x = SkipsHeadSometimes(), torch.randn(3, 4)
    up = Updates(model)
    fu = up.first_use()
    up.pending, model.skip = {1}, True
    fu.watch()
    model(x)  # the watched forward never reads head: applied when the root returns
    assert up.applied == [1]
    up.pending, up.applied, model.skip = {1}, [], False
    out = model(x)
    assert up.applied == [1]
    assert torch.equal(out, _fresh_output(model, x)), "head ran on a stale weight"
    fu.close()


def test_reads_between_step_and_forward_mark_every_layer_read_eager():
    """An EMA reads every parameter after step(): the first read applies both
    buckets together, and the second bucket is marked eager all the same."""
    torch.manual_seed(0)
    model = ParentReadsHead()
    up = Updates(model)
    fu = up.first_use()
    up.pending, up.together = {0, 1}, True
    fu.watch()
    with torch.no_grad():
        ema = [p.detach().clone() for p in model.parameters()]
        for e, p in zip(ema, model.parameters()):
            e.mul_(0.9).add_(p, alpha=0.1)
    assert sorted(fu.eager()) == [0, 1]
    assert fu.eager_layers == {"body", "head"}
    fu.close()
