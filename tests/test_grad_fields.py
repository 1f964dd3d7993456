"""The per-bucket ``.grad`` loops (hybridcomm.sync.grad_fields): the host C++
extension and its Python twins mean the same, on awkward sizes and dtypes; a
tensor subclass or a torch function mode still sees every access; the extension
can be turned off, and a failed build is reported, not raised, and not retried;
training gives the same bits with the extension on and off."""

import logging
import sys

import pytest
import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from hybridcomm.sync import grad_fields, host_ext

from multiproc import run_ranks
from optim_models import batch, flat, make_model, shard


@pytest.fixture(params=["cpp", "python"])
def impl(request, monkeypatch):
    """grad_fields with its loops in C++ (the extension must load: this machine has
    a compiler) or in Python."""
    if request.param == "cpp":
        assert host_ext.load() is not None, host_ext.why_not()
        monkeypatch.setattr(grad_fields, "_ext", host_ext.load())
    else:
        monkeypatch.setattr(grad_fields, "_ext", False)
    return grad_fields


def _bucket(shapes, dtype=torch.float32):
    params = [
        nn.Parameter(torch.randn(s).to(dtype), requires_grad=dtype.is_floating_point)
        for s in shapes
    ]
    buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype)
    views, at = [], 0
    for p in params:
        views.append(buffer[at : at + p.numel()].view(p.shape))
        at += p.numel()
    return params, views, buffer


SHAPES = [(7, 3), (1,), (0,), (5,), (2, 3, 4)]


def test_reads_and_writes(impl):
    params, views, _ = _bucket(SHAPES)
    assert [p.grad for p in params] == [None] * len(params)
    assert impl.kept_apart(params, views) is None and not impl.bound(params, views)
    impl.set_grads(params, views)
    assert all(p.grad is v for p, v in zip(params, views))
    assert impl.bound(params, views) and impl.kept_apart(params, views) is None
    own = [torch.randn(s) for s in SHAPES]
    impl.set_grads(params, own)
    kept = impl.kept_apart(params, views)
    assert kept is not None and all(k is g for k, g in zip(kept, own))
    assert not impl.bound(params, views)
    mixed = [views[0], None, own[2], views[3], None]
    impl.set_grads(params, mixed)
    assert all(p.grad is t for p, t in zip(params, mixed))
    assert params[0].grad is views[0] and params[1].grad is None
    assert impl.kept_apart(params, views) is None and not impl.bound(params, views)
    impl.set_grads(params)
    assert [p.grad for p in params] == [None] * len(params)
    params[1].requires_grad_(False)
    assert impl.requires_grad(params) == [True, False, True, True, True]


def test_bad_values_are_refused(impl):
    params, views, _ = _bucket([(3,), (2,)])
    with pytest.raises(RuntimeError):
        impl.set_grads(params, [torch.zeros(3), torch.zeros(5)])  # a shape
    with pytest.raises(RuntimeError):
        impl.set_grads(params, [torch.zeros(3, dtype=torch.float64), None])  # a dtype
    with pytest.raises((TypeError, AttributeError)):
        impl.kept_apart([params[0], "not a tensor"], views)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64]
)
def test_copy_into_copies_as_copy_does(impl, dtype):
    """Every pair as ``view.copy_(grad)`` would leave it, bit for bit, each view's
    version bumped: contiguous ones, a transposed and a channels-last gradient, one
    of another dtype (converted), an empty one."""
    shapes = [(7, 3), (3, 7), (2, 3, 4, 5), (1,), (0,), (6,)]
    params, views, buffer = _bucket(shapes, dtype)
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(s, generator=g).mul(100).to(dtype) for s in shapes]
    grads[1] = torch.randn(7, 3, generator=g).mul(100).to(dtype).t()  # not contiguous
    grads[2] = grads[2].contiguous(memory_format=torch.channels_last)
    grads[5] = torch.randn(6, generator=g, dtype=torch.float64).mul(100)  # another dtype
    _, expected_views, expected = _bucket(shapes, dtype)
    for v, gr in zip(expected_views, grads):
        v.copy_(gr)
    before = [v._version for v in views]
    from hybridcomm.sync.buckets import copy_into

    copy_into(views, grads)
    assert torch.equal(buffer, expected)
    assert all(v._version > b for v, b in zip(views, before))


def test_copy_into_bumps_versions_as_a_multi_tensor_copy_does(impl):
    """A bucket's views share its buffer's version counter: the copy moves it as
    ``torch._foreach_copy_`` does (once per view), which is how a write into a
    bucket since the step is told from none (grad_hooks.py: the lean hooks)."""
    from hybridcomm.sync.buckets import copy_into

    shapes = [(7, 3), (5,), (2, 2, 2)]
    _, views, buffer = _bucket(shapes)
    _, reference_views, reference = _bucket(shapes)
    grads = [torch.randn(s) for s in shapes]
    before = buffer._version, reference._version
    copy_into(views, grads)
    torch._foreach_copy_(reference_views, grads)
    assert buffer._version - before[0] == reference._version - before[1] == len(shapes)


def test_copy_into_on_host_leaves_what_it_cannot_do(impl):
    """Not every tensor on the CPU, or a subclass: nothing copied, False (the
    caller's multi-tensor copy then); the twins never copy."""
    views, grads = [torch.zeros(3), torch.zeros(2)], [torch.ones(3), torch.ones(2)]
    done = impl.copy_into_on_host(views, grads)
    assert done == (impl._ext is not False)
    assert all(torch.equal(v, g) for v, g in zip(views, grads)) == done
    meta = [torch.zeros(3), torch.zeros(2, device="meta")]
    assert impl.copy_into_on_host(meta, grads) is False
    assert torch.equal(meta[0], torch.zeros(3))


class _Watched(torch.Tensor):
    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(getattr(func, "__name__", str(func)))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


class _Recording(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_a_subclass_and_a_mode_see_every_access(impl):
    """A tensor subclass (as forward mode's pending parameter) and a torch function
    mode (as the GPU simulator's) see the reads and writes: the C++ loops decline
    them, the twins run."""
    params, views, _ = _bucket([(3,), (2,)])
    watched = nn.Parameter(torch.zeros(2))
    watched.__class__ = type("WatchedParameter", (_Watched, nn.Parameter), {})
    _Watched.seen = []
    both = [params[0], watched]
    impl.set_grads(both, [views[0], views[1]])
    assert impl.bound(both, [views[0], views[1]])
    assert _Watched.seen.count("__set__") == 1 and _Watched.seen.count("__get__") == 1
    with _Recording() as mode:
        impl.set_grads(params)
        assert [p.grad for p in params] == [None, None]
    assert mode.seen.count("__set__") == 2 and mode.seen.count("__get__") == 2


def test_off_and_failed_builds_fall_back_to_python(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(host_ext, "_state", {})
    monkeypatch.setenv("HYBRIDCOMM_HOST_EXT", "0")
    assert host_ext.load() is None and host_ext.why_not() == "HYBRIDCOMM_HOST_EXT=0"
    # a source that does not compile: a warning with the compiler's words, no error,
    # and the next process does not compile it again
    monkeypatch.setenv("HYBRIDCOMM_HOST_EXT", "1")
    src = tmp_path / "src"
    src.mkdir()
    (src / host_ext.SOURCE).write_text("#error this source is broken on purpose\n")
    monkeypatch.setenv("HYBRIDCOMM_CSRC", str(src))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(host_ext, "_state", {})
    with caplog.at_level(logging.WARNING, logger="hybridcomm"):
        assert host_ext.load() is None
    assert "broken on purpose" in host_ext.why_not() and "broken on purpose" in caplog.text
    failed = host_ext.built_path(src / host_ext.SOURCE).with_suffix(".failed")
    assert failed.is_file()
    failed.write_text("kept from the first build")
    monkeypatch.setattr(host_ext, "_state", {})
    assert host_ext.load() is None and "kept from the first build" in host_ext.why_not()


def _train(rank, world, overlap, use_ext):
    import hybridcomm
    from hybridcomm.sync import grad_fields as fields

    fields._ext = None if use_ext else False
    model = make_model()
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model=model, overlap=overlap
    )
    for s in range(5):
        x, y = batch(s)
        opt.zero_grad()
        nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
        opt.step()
    opt.synchronize()
    assert (fields._ext is not False) == use_ext
    out = flat(model.parameters())
    opt.close()
    return out


@pytest.mark.parametrize("overlap", ["forward", "backward", "none"])
def test_training_gives_the_same_bits_with_the_extension_on_and_off(overlap):
    on = run_ranks(2, _train, overlap, True, timeout=120)
    off = run_ranks(2, _train, overlap, False, timeout=120)
    for a, b in zip(on, off):
        assert torch.equal(a, b)


def _entry(p, calls, name):
    from collections import OrderedDict
    from torch.utils.hooks import RemovableHandle

    key = RemovableHandle(OrderedDict()).id

    def hook(grad):
        calls.append(name)

    return (p, key, hook, OrderedDict({key: hook}))


def _backward(params):
    sum(p.sum() for p in params).backward()


def test_pre_hooks_go_on_and_off_beside_a_users(impl):
    """arm / disarm: autograd calls the library's pre-hook only while armed; with
    no other hook the tensor holds none at all when disarmed; a user's hook,
    registered while armed or disarmed, stays and keeps running."""
    calls = []
    params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))]
    entries = [_entry(p, calls, f"ours{i}") for i, p in enumerate(params)]
    impl.arm(entries)
    impl.arm(entries)  # (twice: still one hook)
    assert all(p._backward_hooks is e[3] and len(e[3]) == 1 for p, e in zip(params, entries))
    _backward(params)
    assert sorted(calls) == ["ours0", "ours1"]
    impl.disarm(entries)
    assert all(p._backward_hooks is None for p in params)
    calls.clear()
    _backward(params)
    assert calls == []
    # a user's hook registered while armed goes into the same dict: it stays when
    # ours goes off, and ours rejoins it
    impl.arm(entries)
    params[0].register_hook(lambda g: calls.append("user0"))
    impl.disarm(entries)
    assert len(params[0]._backward_hooks) == 1 and params[1]._backward_hooks is None
    _backward(params)
    assert calls == ["user0"]
    calls.clear()
    impl.arm(entries)
    _backward(params)
    assert sorted(calls) == ["ours0", "ours1", "user0"]
    # a user's hook registered while disarmed: ours goes into torch's dict beside it
    impl.disarm(entries)
    params[1].register_hook(lambda g: calls.append("user1"))
    impl.arm(entries)
    assert entries[1][1] in params[1]._backward_hooks and len(params[1]._backward_hooks) == 2
    calls.clear()
    _backward(params)
    assert sorted(calls) == ["ours0", "ours1", "user0", "user1"]
    impl.disarm(entries)
    calls.clear()
    _backward(params)
    assert sorted(calls) == ["user0", "user1"]


def test_guards_of_cpp_call_before_the_add_only_while_on():
    """add_guard / set_guards / drop_guards (the extension's pre-hooks on the
    gradient accumulator): called only while on, before autograd adds into
    ``.grad``, beside a user's own hooks, in backward() (not autograd.grad(),
    which adds into no field); an error in one reaches backward()'s caller;
    compiled autograd's graph calls one that is on, before the add, and none that
    is off, with no setting to change; a dropped guard is never called again."""
    assert host_ext.load() is not None, host_ext.why_not()
    params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))]
    seen = []  # (name, .grad as the guard found it)

    def before(i):
        return lambda: seen.append((i, None if params[i].grad is None else params[i].grad.clone()))

    guards = [grad_fields.add_guard(p, before(i)) for i, p in enumerate(params)]
    _backward(params)
    assert seen == []  # off
    grad_fields.set_guards(guards, True)
    params[0].register_hook(lambda g: seen.append(("user", None)))  # after ours: both run
    _backward(params)
    assert sorted(s[0] for s in seen if s[0] != "user") == [0, 1] and ("user", None) in seen
    assert all(torch.equal(g, torch.ones_like(g)) for i, g in seen if i != "user")  # before
    assert all(torch.equal(p.grad, torch.full_like(p, 2.0)) for p in params)
    seen.clear()
    torch.autograd.grad(params[1].sum(), params[1])
    assert seen == []
    grad_fields.set_guards(guards[:1], False)
    _backward(params)
    assert [s[0] for s in seen if s[0] != "user"] == [1]

    def fails():
        raise ValueError("from a guard")

    failing = grad_fields.add_guard(params[1], fails)
    grad_fields.set_guards([failing], True)
    with pytest.raises(ValueError, match="from a guard"):
        _backward(params)
    grad_fields.drop_guards([failing])
    compiled_autograd = getattr(pytest.importorskip("torch._dynamo"), "compiled_autograd", None)
    if hasattr(compiled_autograd, "_enable"):  # (its entry point is private: where it is)
        seen.clear()
        held = [p.grad.clone() for p in params]
        with compiled_autograd._enable(lambda gm: torch.compile(gm, backend="eager")):
            _backward(params)
        assert [s[0] for s in seen if s[0] != "user"] == [1]  # on: called; off: not
        assert torch.equal(seen[-1][1] if seen[-1][0] == 1 else seen[0][1], held[1])  # before
        assert all(torch.equal(p.grad, h + 1) for p, h in zip(params, held))
    grad_fields.drop_guards(guards)
    grad_fields.set_guards(guards, True)  # (dropped: inert)
    seen.clear()
    _backward(params)
    assert [s[0] for s in seen] == ["user"]


def test_class_switches(impl):
    """switch_classes: forward mode's pending class on and off (pending.defer and
    release_all run through it), all or nothing where ``every``; object.__class__'s
    own checks stay (an incompatible class is refused)."""
    from hybridcomm.sync import pending

    params = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))]
    Marked = type("Marked", (nn.Parameter,), {})
    assert impl.switch_classes(params, {}, True) is False
    assert all(type(p) is nn.Parameter for p in params)
    assert impl.switch_classes(params[:1], {nn.Parameter: Marked}, False) is True
    assert type(params[0]) is Marked and type(params[1]) is nn.Parameter
    with pytest.raises(TypeError):
        impl.switch_classes(params[1:], {nn.Parameter: int}, False)
    impl.switch_classes(params, {Marked: nn.Parameter}, False)
    # a pair switched before takes the short way: each class's references balance
    counts = sys.getrefcount(Marked), sys.getrefcount(nn.Parameter)
    for _ in range(50):
        assert impl.switch_classes(params, {nn.Parameter: Marked}, False) is True
        assert all(type(p) is Marked for p in params)
        assert impl.switch_classes(params, {Marked: nn.Parameter}, False) is True
    assert (sys.getrefcount(Marked), sys.getrefcount(nn.Parameter)) == counts
    late = nn.Parameter(torch.ones(1))  # never switched, its pair known: its attributes stay
    late.tag = "kept"
    impl.switch_classes([late], {nn.Parameter: Marked}, False)
    assert type(late) is Marked and late.tag == "kept" and vars(late) == {"tag": "kept"}
    impl.switch_classes([late], {Marked: nn.Parameter}, False)
    assert type(late) is nn.Parameter and late.tag == "kept" and late.tolist() == [1.0]
    assert all(type(p) is nn.Parameter for p in params)
    with pytest.raises(TypeError):  # (the checks stay for a pair not switched before)
        impl.switch_classes(params, {nn.Parameter: int}, False)
    applied = []

    def apply(p):
        applied.append(p)
        pending.release_all(params)

    pending.defer(params, apply)
    assert all(pending.is_pending(p) for p in params)
    params[1] * 2  # a read applies it
    assert applied == [params[1]] and not any(pending.is_pending(p) for p in params)
    assert all(type(p) is nn.Parameter for p in params)
    pending.forget(apply)
