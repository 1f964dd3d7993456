"""The gradient hooks, passes and buckets of ``DistributedOptimizer`` in the test's own
process: a group of one rank (tests/fakes/world.py), where the numbers must be plain
PyTorch's bitwise, in every overlap mode and loop shape the library promises to leave
unchanged (several backward passes a step, ``no_sync``, clipping after
``synchronize()``, a layer some steps leave unused, reads of the model between
``step()`` and the next forward). Nothing is sent; what the hooks decide (which
bucket a gradient lands in, when a bucket is launched, which pass, which update
waits for a first read) all runs. The multi-rank loops are tests/test_training_loops.py."""

import copy

import pytest
import torch

import hybridcomm
from fakes.world import one_rank_group
from optim_models import ConvNet, batch, make_model

pytestmark = pytest.mark.fast
# The library's process-wide state outlives these tests: nothing forks ranks after
# them in this process (tests/tiers.py, ``last_in_their_process``)
RUN_LAST = True

MODES = ["forward", "backward", "none"]


class Branchy(ConvNet):
    """A ConvNet whose extra layer only odd steps use (its .grad stays None otherwise)."""

    def __init__(self):
        super().__init__()
        self.extra = torch.nn.Linear(3, 3)
        self.use_extra = False

    def forward(self, x):
        out = super().forward(x)
        return self.extra(out) if self.use_extra else out


def _pair(cls=ConvNet, **kwargs):
    model = make_model(cls=cls)
    ref = copy.deepcopy(model)
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3),
        model=model,
        cost_model="default",
        **kwargs,
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    return model, opt, ref, ref_opt


def _same(model, ref, where):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.detach(), q.detach()), f"{where}: {name}"


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


@pytest.mark.parametrize("overlap", MODES)
def test_plain_loop_and_accumulation_are_plain_pytorchs(tmp_path, overlap):
    with one_rank_group(tmp_path):
        model, opt, ref, ref_opt = _pair(overlap=overlap)
        for step in range(6):  # past the re-plan after measure_iters (3) steps
            x, y = batch(step)
            passes = 2 if step % 2 else 1  # accumulation on odd steps
            for o, m in ((opt, model), (ref_opt, ref)):
                o.zero_grad()
                for k in range(passes):
                    half = slice(k * 6, (k + 1) * 6) if passes == 2 else slice(None)
                    _loss(m, x[half], y[half]).backward()
                o.step()
            _same(model, ref, f"{overlap}, step {step}")  # (a read: pending updates apply)
        opt.close()


@pytest.mark.parametrize("overlap", MODES)
def test_no_sync_and_clipping_after_synchronize(tmp_path, overlap):
    with one_rank_group(tmp_path):
        model, opt, ref, ref_opt = _pair(overlap=overlap)
        for step in range(4):
            x, y = batch(step)
            opt.zero_grad()
            ref_opt.zero_grad()
            with opt.no_sync():  # a local pass first, reduced with the next
                _loss(model, x[:6], y[:6]).backward()
            _loss(model, x[6:], y[6:]).backward()
            _loss(ref, x[:6], y[:6]).backward()
            _loss(ref, x[6:], y[6:]).backward()
            opt.synchronize()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            assert torch.equal(norm, ref_norm)
            with opt.skip_synchronize():
                opt.step()
            ref_opt.step()
            _same(model, ref, f"{overlap}, step {step}")
        opt.close()


@pytest.mark.parametrize("overlap", MODES)
def test_a_layer_some_steps_leave_unused_is_not_stepped_then(tmp_path, overlap):
    """A parameter with no gradient keeps ``.grad`` None and is not stepped, as one
    process leaves it (even weight decay must not touch it)."""
    with one_rank_group(tmp_path):
        model, opt, ref, ref_opt = _pair(cls=Branchy, overlap=overlap)
        for step in range(6):
            x, y = batch(step)
            model.use_extra = ref.use_extra = step % 2 == 1
            for o, m in ((opt, model), (ref_opt, ref)):
                o.zero_grad()
                _loss(m, x, y).backward()
                o.step()
            if not model.use_extra:
                opt.synchronize()
                assert model.extra.weight.grad is None
            _same(model, ref, f"{overlap}, step {step}")
        opt.close()


def test_forward_mode_defers_invisibly(tmp_path):
    """Between ``step()`` and the next forward, every read of the model sees the
    updated parameters: the parameter itself, ``state_dict()``, a copy."""
    with one_rank_group(tmp_path):
        model, opt, ref, ref_opt = _pair(overlap="forward", measure_iters=0)
        for step in range(3):
            x, y = batch(step)
            for o, m in ((opt, model), (ref_opt, ref)):
                o.zero_grad()
                _loss(m, x, y).backward()
                o.step()
            sd = model.state_dict()
            for name, q in ref.state_dict().items():
                assert torch.equal(sd[name], q), name
            assert torch.equal(copy.deepcopy(model).fc1.weight, ref.fc1.weight)
        opt.close()
