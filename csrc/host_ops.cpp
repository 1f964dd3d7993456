// hybridcomm's host-side per-parameter loops in C++ (hybridcomm/sync/grad_fields.py).
//
// What DDP's Reducer does in C++ and hybridcomm did in Python, one call per bucket:
// read and write the ``.grad`` fields of a bucket's parameters, compare them with the
// bucket's views, read ``requires_grad``, and copy gradients into the views. Each
// function has a plain-Python twin in grad_fields.py with the same meaning (the
// fallback where this does not build, and the reference the tests compare with).
//
// Only plain tensors and Parameters are handled here, with no torch function or
// dispatch mode on: anything else (a pending parameter of forward mode, a DTensor, the
// GPU simulator's mode) gets NotImplemented, and the Python twin runs, so whatever a
// subclass or a mode makes of these reads and writes, it still sees them.
#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <memory>
#include <vector>

#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/dynamo/compiled_autograd.h>

namespace {

enum Unpacked { OK, NOT_MINE, FAILED };

// Whether a torch function or dispatch mode is on: it is to see every op (the GPU
// simulator's checks), so the Python twin runs instead.
bool modes_on() {
  return at::impl::torch_function_mode_enabled() ||
         c10::impl::TorchDispatchModeTLS::stack_len() > 0;
}

// Every item of ``seq`` (a list or tuple) as a tensor (``none_ok``: or None). NOT_MINE
// where one is a tensor subclass other than Parameter (a pending parameter, a DTensor:
// its own ``__torch_function__`` decides) or a mode is on; FAILED (a TypeError set)
// where one is no tensor.
Unpacked unpack(PyObject* seq, std::vector<const at::Tensor*>& out, bool none_ok = false) {
  if (modes_on()) return NOT_MINE;
  PyObject* fast = PySequence_Fast(seq, "expected a list of tensors");
  if (fast == nullptr) return FAILED;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  PyObject** items = PySequence_Fast_ITEMS(fast);
  out.clear();
  out.reserve(n);
  Unpacked result = OK;
  for (Py_ssize_t i = 0; i < n && result == OK; ++i) {
    if (none_ok && items[i] == Py_None) {
      out.push_back(nullptr);
    } else if (THPVariable_CheckExact(items[i])) {
      out.push_back(&THPVariable_Unpack(items[i]));
    } else if (THPVariable_Check(items[i])) {
      result = NOT_MINE;
    } else {
      PyErr_Format(PyExc_TypeError, "item %zd is not a tensor", i);
      result = FAILED;
    }
  }
  Py_DECREF(fast);  // (the tensors stay alive: the caller's list holds them)
  return result;
}

// What a function returns for an unpack that was not OK.
PyObject* not_ok(Unpacked u) {
  if (u == FAILED) return nullptr;
  Py_RETURN_NOTIMPLEMENTED;
}

bool two_args(Py_ssize_t nargs, const char* name) {
  if (nargs == 2) return true;
  PyErr_Format(PyExc_TypeError, "%s() takes 2 arguments (%zd given)", name, nargs);
  return false;
}

// Both lists unpacked, of one length: OK, NOT_MINE or FAILED (an error set).
Unpacked unpack_pair(PyObject* a, PyObject* b, std::vector<const at::Tensor*>& as,
                     std::vector<const at::Tensor*>& bs, bool b_none_ok = false) {
  Unpacked u = unpack(a, as);
  if (u == OK) u = unpack(b, bs, b_none_ok);
  if (u == OK && as.size() != bs.size()) {
    PyErr_SetString(PyExc_ValueError, "the two lists differ in length");
    u = FAILED;
  }
  return u;
}

bool same(const at::Tensor& a, const at::Tensor& b) {
  return a.unsafeGetTensorImpl() == b.unsafeGetTensorImpl();
}

PyObject* grad_list(const std::vector<const at::Tensor*>& ps) {
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(ps.size()));
  if (out == nullptr) return nullptr;
  for (size_t i = 0; i < ps.size(); ++i) {
    const at::Tensor& g = ps[i]->grad();
    PyObject* item = g.defined() ? THPVariable_Wrap(g) : (Py_INCREF(Py_None), Py_None);
    if (item == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), item);
  }
  return out;
}

// C++ exceptions become Python's RuntimeError (none may cross into the interpreter).
#define GUARDED(...)                                    \
  try {                                                 \
    __VA_ARGS__                                         \
  } catch (const std::exception& e) {                   \
    PyErr_SetString(PyExc_RuntimeError, e.what());      \
    return nullptr;                                     \
  }

// Each function returns NotImplemented where unpack says NOT_MINE: the Python twin runs.

// kept_apart(params, views) -> the grads if every one is defined and none is its
// view (autograd put each in a tensor of its own), else None.
PyObject* kept_apart(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!two_args(nargs, "kept_apart")) return nullptr;
  GUARDED({
    std::vector<const at::Tensor*> ps, vs;
    Unpacked u = unpack_pair(args[0], args[1], ps, vs);
    if (u != OK) return not_ok(u);
    for (size_t i = 0; i < ps.size(); ++i) {
      const at::Tensor& g = ps[i]->grad();
      if (!g.defined() || same(g, *vs[i])) Py_RETURN_NONE;
    }
    return grad_list(ps);
  })
}

// bound(params, views) -> whether every p.grad is its view
PyObject* bound(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!two_args(nargs, "bound")) return nullptr;
  GUARDED({
    std::vector<const at::Tensor*> ps, vs;
    Unpacked u = unpack_pair(args[0], args[1], ps, vs);
    if (u != OK) return not_ok(u);
    for (size_t i = 0; i < ps.size(); ++i) {
      if (!same(ps[i]->grad(), *vs[i])) Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
  })
}

// set_grads(params, values): p.grad = value for each pair; ``values`` None: every
// p.grad None. The checks torch's setter makes (dtype, device, shape) come first.
PyObject* set_grads(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!two_args(nargs, "set_grads")) return nullptr;
  GUARDED({
    std::vector<const at::Tensor*> ps, vs;
    if (args[1] == Py_None) {
      Unpacked u = unpack(args[0], ps);
      if (u != OK) return not_ok(u);
      for (const at::Tensor* p : ps) p->mutable_grad().reset();
      Py_RETURN_NONE;
    }
    Unpacked u = unpack_pair(args[0], args[1], ps, vs, /*b_none_ok=*/true);
    if (u != OK) return not_ok(u);
    for (size_t i = 0; i < ps.size(); ++i) {
      const at::Tensor* v = vs[i];
      if (v != nullptr && (v->dtype() != ps[i]->dtype() || v->device() != ps[i]->device() ||
                           v->sizes() != ps[i]->sizes())) {
        PyErr_Format(PyExc_RuntimeError, "value %zu does not match its parameter's dtype, "
                     "device and shape", i);
        return nullptr;
      }
    }
    for (size_t i = 0; i < ps.size(); ++i) {
      if (vs[i] == nullptr) {
        ps[i]->mutable_grad().reset();
      } else {
        ps[i]->mutable_grad() = *vs[i];
      }
    }
    Py_RETURN_NONE;
  })
}

// requires_grad(params) -> [p.requires_grad]
PyObject* requires_grad(PyObject*, PyObject* params) {
  GUARDED({
    std::vector<const at::Tensor*> ps;
    Unpacked u = unpack(params, ps);
    if (u != OK) return not_ok(u);
    PyObject* out = PyList_New(static_cast<Py_ssize_t>(ps.size()));
    if (out == nullptr) return nullptr;
    for (size_t i = 0; i < ps.size(); ++i) {
      PyObject* flag = ps[i]->requires_grad() ? Py_True : Py_False;
      Py_INCREF(flag);
      PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), flag);
    }
    return out;
  })
}

// The bytes copied by a loop the compiler vectorizes (AVX2 where the CPU has it), not
// by memcpy: glibc's memcpy moves a gradient with ``rep movsb``, which valgrind counts
// as one instruction per byte, so benchmarks/host_instructions.py would see a copy
// 8x dearer than torch's own (its loops are vectorized too) while it is not.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
void copy_bytes(char* __restrict dst, const char* __restrict src, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = src[i];
}

// A pair whose bytes copied are exactly what ``view.copy_(grad)`` would leave: dense, contiguous,
// one dtype and shape, neither needing autograd, no lazy conj/neg, two storages.
bool bytewise_ok(const at::Tensor& v, const at::Tensor& g) {
  return v.layout() == at::kStrided && g.layout() == at::kStrided && v.is_contiguous() &&
         g.is_contiguous() && v.dtype() == g.dtype() && v.sizes() == g.sizes() &&
         !v.requires_grad() && !g.requires_grad() && !v.is_conj() && !g.is_conj() &&
         !v.is_neg() && !g.is_neg() && !v.storage().is_alias_of(g.storage());
}

// copy_into(views, grads): views[i].copy_(grads[i]) for each pair of CPU tensors, a
// byte copy where bytewise_ok (the view's version bumped, as copy_ does); NotImplemented,
// copying nothing, where one is not on the CPU (a device's multi-tensor copy is one
// launch: the caller's).
PyObject* copy_into(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!two_args(nargs, "copy_into")) return nullptr;
  GUARDED({
    std::vector<const at::Tensor*> vs, gs;
    Unpacked u = unpack_pair(args[0], args[1], vs, gs);
    if (u != OK) return not_ok(u);
    for (size_t i = 0; i < vs.size(); ++i) {
      if (!vs[i]->device().is_cpu() || !gs[i]->device().is_cpu()) Py_RETURN_NOTIMPLEMENTED;
    }
    for (size_t i = 0; i < vs.size(); ++i) {
      const at::Tensor& v = *vs[i];
      const at::Tensor& g = *gs[i];
      if (bytewise_ok(v, g)) {
        if (v.nbytes() > 0) {
          copy_bytes(static_cast<char*>(v.data_ptr()),
                     static_cast<const char*>(g.const_data_ptr()), v.nbytes());
        }
        v.unsafeGetTensorImpl()->bump_version();
      } else {
        at::Tensor(v).copy_(g);
      }
    }
    Py_RETURN_NONE;
  })
}

// ---- the pre-hook switch (grad_hooks.py: GradientHooks._set) --------------------------
// An entry is (param, key, hook, alone): the library's pre-hook ``hook`` under ``key`` in
// the param's ``_backward_hooks`` dict, ``alone`` the dict handed to torch when the param
// has none. Torch's dict is read from the tensor's Python object (what its getter
// returns) and assigned through torch's own setter (which hands it to autograd), called
// directly; the dicts are changed through the mapping protocol (an OrderedDict keeps
// its order). A user's hooks in the same dict stay.

setter set_backward_hooks = nullptr;

bool find_setter() {
  if (set_backward_hooks != nullptr) return true;
  PyObject* descr = PyObject_GetAttrString(THPVariableClass, "_backward_hooks");
  if (descr == nullptr) return false;
  if (Py_TYPE(descr) == &PyGetSetDescr_Type)
    set_backward_hooks = reinterpret_cast<PyGetSetDescrObject*>(descr)->d_getset->set;
  Py_DECREF(descr);
  if (set_backward_hooks == nullptr)
    PyErr_SetString(PyExc_RuntimeError, "torch.Tensor._backward_hooks has no setter");
  return set_backward_hooks != nullptr;
}

PyObject* hooks_of(PyObject* param) {  // borrowed; nullptr: None
  PyObject* hooks = reinterpret_cast<THPVariable*>(param)->backward_hooks;
  return hooks == Py_None ? nullptr : hooks;
}

// The entries as (param, key, hook, alone) tuples; NOT_MINE if a param is a subclass.
Unpacked entries_of(PyObject* seq, PyObject*& fast) {
  if (modes_on()) return NOT_MINE;
  fast = PySequence_Fast(seq, "expected a list of (param, key, hook, dict) tuples");
  if (fast == nullptr) return FAILED;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  PyObject** items = PySequence_Fast_ITEMS(fast);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!PyTuple_Check(items[i]) || PyTuple_GET_SIZE(items[i]) != 4) {
      PyErr_Format(PyExc_TypeError, "entry %zd is not a (param, key, hook, dict) tuple", i);
      return FAILED;
    }
    if (!THPVariable_CheckExact(PyTuple_GET_ITEM(items[i], 0))) return NOT_MINE;
  }
  return OK;
}

// fn(param, key, hook, alone) -> false (a Python error set) to stop, for each entry.
template <typename F>
PyObject* each_entry(PyObject* entries, F fn) {
  PyObject* fast = nullptr;
  Unpacked u = entries_of(entries, fast);
  bool ok = u == OK && find_setter();
  for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(fast); ++i) {
    PyObject* entry = PySequence_Fast_ITEMS(fast)[i];
    ok = fn(PyTuple_GET_ITEM(entry, 0), PyTuple_GET_ITEM(entry, 1), PyTuple_GET_ITEM(entry, 2),
            PyTuple_GET_ITEM(entry, 3));
  }
  Py_XDECREF(fast);
  if (u != OK) return not_ok(u);
  if (!ok) return nullptr;
  Py_RETURN_NONE;
}

// arm(entries): each library pre-hook on (into torch's dict, or ``alone`` handed to torch)
PyObject* arm(PyObject*, PyObject* entries) {
  return each_entry(entries, [](PyObject* p, PyObject* key, PyObject* hook, PyObject* alone) {
    PyObject* hooks = hooks_of(p);
    if (hooks != nullptr) {
      int has = PySequence_Contains(hooks, key);
      return has == 1 || (has == 0 && PyObject_SetItem(hooks, key, hook) == 0);
    }
    int alone_has = PySequence_Contains(alone, key);
    if (alone_has < 0) return false;
    if (PyObject_Size(alone) != 1 || alone_has == 0) {  // (a user's hook went in)
      PyObject* cleared = PyObject_CallMethod(alone, "clear", nullptr);
      if (cleared == nullptr) return false;
      Py_DECREF(cleared);
      if (PyObject_SetItem(alone, key, hook) != 0) return false;
    }
    return set_backward_hooks(p, alone, nullptr) == 0;
  });
}

// disarm(entries): each library pre-hook off; torch's dict dropped where it held only it
// (autograd then calls no pre-hook at all)
PyObject* disarm(PyObject*, PyObject* entries) {
  return each_entry(entries, [](PyObject* p, PyObject* key, PyObject*, PyObject*) {
    PyObject* hooks = hooks_of(p);
    if (hooks == nullptr) return true;
    int has = PySequence_Contains(hooks, key);
    if (has != 1) return has == 0;
    return PyObject_Size(hooks) == 1 ? set_backward_hooks(p, Py_None, nullptr) == 0
                                     : PyObject_DelItem(hooks, key) == 0;
  });
}

// ---- the class switches of forward mode's pending parameters (pending.py) ------------
// switch_classes(objs, classes, every): each object's class becomes classes[its class].
// Where ``every`` and some class is not in ``classes``: False, nothing switched (the
// caller makes the missing class). Else objects whose class is not in it stay as they are.
//
// The first switch of a pair of classes goes through ``object.__class__``'s own setter,
// called directly (its checks: the layouts are compatible); once it succeeded, the pair
// is known, and later switches of it set the type as that setter does after its checks
// (a tenth of the time: ``compatible_for_assignment`` and the setter's audit event are
// skipped, so an audit hook sees a pair's first switch only). Known pairs hold
// references to both classes, so an address is never a reused one.

setter set_class = nullptr;
std::vector<std::pair<PyTypeObject*, PyTypeObject*>> known_switches;

bool known_switch(PyTypeObject* from, PyTypeObject* to) {
  for (const auto& pair : known_switches) {
    if (pair.first == from && pair.second == to) return true;
  }
  return false;
}

// Whether a switch between these classes may be done as object_set_class does it once
// compatible_for_assignment said yes (CPython up to 3.12; 3.13 keeps a managed dict
// another way: the setter every time there).
bool may_set_directly(PyTypeObject* from, PyTypeObject* to) {
#if PY_VERSION_HEX >= 0x030D0000
  return false;
#endif
  return (from->tp_flags & Py_TPFLAGS_HEAPTYPE) && (to->tp_flags & Py_TPFLAGS_HEAPTYPE);
}

int switch_class(PyObject* obj, PyObject* cls, bool known) {
  PyTypeObject* from = Py_TYPE(obj);
  PyTypeObject* to = reinterpret_cast<PyTypeObject*>(cls);
#ifdef Py_TPFLAGS_MANAGED_DICT
  // (a managed dict's inline values are keyed by the class: made a dict first, as the
  // setter does; where that fails, the setter says why)
  if (known && (from->tp_flags & Py_TPFLAGS_MANAGED_DICT) &&
      _PyObject_GetDictPtr(obj) == nullptr) {
    PyErr_Clear();
    known = false;
  }
#endif
  if (known) {
    Py_INCREF(to);
    Py_SET_TYPE(obj, to);
    Py_DECREF(from);
    return 0;
  }
  int rc = set_class(obj, cls, nullptr);
  if (rc == 0 && PyType_Check(cls) && may_set_directly(from, to) && !known_switch(from, to)) {
    Py_INCREF(from);
    Py_INCREF(to);
    known_switches.emplace_back(from, to);
  }
  return rc;
}

PyObject* switch_classes(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_Format(PyExc_TypeError, "switch_classes() takes 3 arguments (%zd given)", nargs);
    return nullptr;
  }
  PyObject* classes = args[1];
  bool every = PyObject_IsTrue(args[2]) == 1;
  if (!PyDict_CheckExact(classes)) {
    PyErr_SetString(PyExc_TypeError, "classes must be a dict");
    return nullptr;
  }
  if (set_class == nullptr) {
    PyObject* descr = PyDict_GetItemString(PyBaseObject_Type.tp_dict, "__class__");  // borrowed
    if (descr == nullptr || Py_TYPE(descr) != &PyGetSetDescr_Type) {
      PyErr_SetString(PyExc_RuntimeError, "object.__class__ has no setter");
      return nullptr;
    }
    set_class = reinterpret_cast<PyGetSetDescrObject*>(descr)->d_getset->set;
  }
  PyObject* fast = PySequence_Fast(args[0], "expected a list");
  if (fast == nullptr) return nullptr;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  PyObject** items = PySequence_Fast_ITEMS(fast);
  // The objects of a bucket share one class as a rule: one look-up per run of a class.
  PyTypeObject* from = nullptr;
  PyObject* to = nullptr;  // borrowed: classes[from]
  auto target = [&](PyObject* obj) {
    if (Py_TYPE(obj) != from) {
      from = Py_TYPE(obj);
      to = PyDict_GetItem(classes, reinterpret_cast<PyObject*>(from));
    }
    return to;
  };
  PyObject* result = Py_True;
  for (Py_ssize_t i = 0; every && i < n; ++i) {
    if (target(items[i]) == nullptr) {
      result = Py_False;
      break;
    }
  }
  from = nullptr;  // (a class a switch below made is looked up again)
  PyTypeObject* known_from = nullptr;  // the run's pair, and whether it is known
  PyObject* known_to = nullptr;
  bool known = false;
  for (Py_ssize_t i = 0; result == Py_True && i < n; ++i) {
    PyObject* cls = target(items[i]);
    if (cls == nullptr) continue;
    if (Py_TYPE(items[i]) != known_from || cls != known_to) {
      known_from = Py_TYPE(items[i]);
      known_to = cls;
      known = known_switch(known_from, reinterpret_cast<PyTypeObject*>(cls));
    }
    if (switch_class(items[i], cls, known) != 0) result = nullptr;
  }
  Py_DECREF(fast);
  Py_XINCREF(result);
  return result;
}

// ---- the guards: a pre-hook of C++ on each parameter's gradient accumulator ----------
// (grad_hooks.py). Torch's Python pre-hooks go on and off only through the tensor's
// ``_backward_hooks`` setter, which makes or frees a hook object each time (~0.3 us a
// parameter each way, twice a step); an armed one costs each pass a call into Python.
// This one stays on the parameter's AccumulateGrad node (held, as DDP's Reducer holds
// its accumulators, so that autograd finds the same node each pass) and reads its
// switch: off, autograd's call is a load; on, it calls ``fn()`` before the add.
// Turning it on or off is a store. Node pre-hooks run when the node runs: in
// backward(), not in autograd.grad(), which adds into no ``.grad``.
//
// Compiled autograd traces no hook of C++: it asks each hook for what to call
// (compiled_args) and puts that in its graph. A guard that is on hands it a Python
// callable made once from ``fn`` by the function set_compiled_autograd_hook() was
// given (grad_fields.py: ``fn`` behind torch._dynamo.disable, so the graph calls it
// eagerly, in order, before the node's add); a guard that is off hands it nothing, as
// eager autograd calls nothing. Compiled autograd keys its graphs by the hooks, so the
// two states are two cached graphs.
using torch::autograd::variable_list;

PyObject* compiled_autograd_hook = nullptr;  // fn -> what compiled autograd calls

struct GuardHook : torch::autograd::FunctionPreHook {
  GuardHook(PyObject* fn, std::shared_ptr<std::atomic<bool>> on) : fn(fn), on(std::move(on)) {
    Py_INCREF(fn);
  }
  ~GuardHook() override {
    if (Py_IsInitialized()) {
      pybind11::gil_scoped_acquire gil;
      Py_DECREF(fn);
      Py_XDECREF(traced);
    }
  }
  variable_list operator()(const variable_list& grads) override {
    if (on->load(std::memory_order_acquire)) {
      pybind11::gil_scoped_acquire gil;
      PyObject* result = PyObject_CallNoArgs(fn);
      if (result == nullptr) {
        python_error error;
        error.persist();  // (rethrown by backward() on the calling thread)
        throw error;
      }
      Py_DECREF(result);
    }
    return grads;
  }
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) const override {
    if (!on->load(std::memory_order_acquire)) return;
    pybind11::gil_scoped_acquire gil;
    if (traced == nullptr) {
      TORCH_CHECK(compiled_autograd_hook != nullptr,
                  "hybridcomm's gradient guards: no set_compiled_autograd_hook() was made "
                  "(hybridcomm.sync.grad_fields makes it when it loads this extension)");
      traced = PyObject_CallOneArg(compiled_autograd_hook, fn);
      if (traced == nullptr) throw python_error();
    }
    Py_INCREF(traced);
    args.add_pre_hook(c10::SafePyObject(traced, getPyInterpreter()));
  }
  PyObject* fn;
  mutable PyObject* traced = nullptr;  // compiled autograd's callable, made on first need
  std::shared_ptr<std::atomic<bool>> on;
};

struct Guard {
  c10::intrusive_ptr<torch::autograd::Node> node;
  GuardHook* hook;  // (owned by the node)
  std::shared_ptr<std::atomic<bool>> on;
};

const char* GUARD = "hybridcomm_guard";

// The hook off its node (once), and the node let go.
void take_off(Guard* guard) {
  if (guard->hook == nullptr) return;
  auto& hooks = guard->node->pre_hooks();
  hooks.erase(std::remove_if(hooks.begin(), hooks.end(),
                             [guard](const std::unique_ptr<torch::autograd::FunctionPreHook>& h) {
                               return h.get() == guard->hook;
                             }),
              hooks.end());
  guard->hook = nullptr;
  guard->node.reset();
}

void drop_guard(PyObject* capsule) {
  auto* guard = static_cast<Guard*>(PyCapsule_GetPointer(capsule, GUARD));
  if (guard == nullptr) return;
  take_off(guard);
  delete guard;
}

// add_guard(param, fn) -> a capsule: the guard on ``param`` (a leaf that requires
// grad), off; dropping the capsule takes the hook off the node.
PyObject* add_guard(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!two_args(nargs, "add_guard")) return nullptr;
  if (!THPVariable_Check(args[0]) || !PyCallable_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "add_guard(param, fn): a tensor and a callable");
    return nullptr;
  }
  try {
    auto node = torch::autograd::impl::grad_accumulator(THPVariable_Unpack(args[0]));
    if (!node) {
      PyErr_SetString(PyExc_ValueError, "add_guard: the tensor is no leaf that requires grad");
      return nullptr;
    }
    auto on = std::make_shared<std::atomic<bool>>(false);
    auto hook = std::make_unique<GuardHook>(args[1], on);
    std::unique_ptr<Guard> owned(new Guard{node, hook.get(), on});
    node->add_pre_hook(std::move(hook));
    Guard* guard = owned.release();  // (the capsule's from here: nothing leaks on a throw)
    PyObject* capsule = PyCapsule_New(guard, GUARD, drop_guard);
    if (capsule == nullptr) {
      take_off(guard);
      delete guard;
    }
    return capsule;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// fn(guard) for each capsule of the list ``guards``.
template <typename F>
PyObject* each_guard(PyObject* guards, F fn) {
  PyObject* fast = PySequence_Fast(guards, "a list of guards");
  if (fast == nullptr) return nullptr;
  PyObject** items = PySequence_Fast_ITEMS(fast);
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    auto* guard = static_cast<Guard*>(PyCapsule_GetPointer(items[i], GUARD));
    if (guard == nullptr) {
      Py_DECREF(fast);
      return nullptr;
    }
    fn(guard);
  }
  Py_DECREF(fast);
  Py_RETURN_NONE;
}

// set_guards(guards, on): each guard's switch.
PyObject* set_guards(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!two_args(nargs, "set_guards")) return nullptr;
  int on = PyObject_IsTrue(args[1]);
  if (on < 0) return nullptr;
  return each_guard(args[0], [on](Guard* g) { g->on->store(on != 0, std::memory_order_release); });
}

// set_compiled_autograd_hook(make): ``make(fn)`` is what compiled autograd calls for a
// guard that is on (GuardHook::compiled_args).
PyObject* set_compiled_autograd_hook(PyObject*, PyObject* make) {
  if (!PyCallable_Check(make)) {
    PyErr_SetString(PyExc_TypeError, "set_compiled_autograd_hook(make): a callable");
    return nullptr;
  }
  Py_INCREF(make);
  Py_XDECREF(compiled_autograd_hook);
  compiled_autograd_hook = make;
  Py_RETURN_NONE;
}

// drop_guards(guards): each hook off its node now (its capsule may live on, inert).
PyObject* drop_guards(PyObject*, PyObject* guards) { return each_guard(guards, take_off); }

PyMethodDef methods[] = {
    {"kept_apart", reinterpret_cast<PyCFunction>(kept_apart), METH_FASTCALL,
     "the grads if each is a tensor of its own (none None, none its view), else None"},
    {"bound", reinterpret_cast<PyCFunction>(bound), METH_FASTCALL,
     "whether every p.grad is its view"},
    {"set_grads", reinterpret_cast<PyCFunction>(set_grads), METH_FASTCALL,
     "p.grad = value for each pair (values None: every p.grad None)"},
    {"requires_grad", requires_grad, METH_O, "[p.requires_grad for p in params]"},
    {"copy_into", reinterpret_cast<PyCFunction>(copy_into), METH_FASTCALL,
     "views[i].copy_(grads[i]) for CPU tensors (NotImplemented: not all were)"},
    {"arm", arm, METH_O, "each library pre-hook of the (param, key, hook, dict) entries on"},
    {"disarm", disarm, METH_O, "each library pre-hook of the entries off"},
    {"switch_classes", reinterpret_cast<PyCFunction>(switch_classes), METH_FASTCALL,
     "each object's class becomes classes[its class]"},
    {"add_guard", reinterpret_cast<PyCFunction>(add_guard), METH_FASTCALL,
     "a pre-hook of C++ on the param's gradient accumulator calling fn() while on"},
    {"set_guards", reinterpret_cast<PyCFunction>(set_guards), METH_FASTCALL,
     "each guard on or off"},
    {"drop_guards", drop_guards, METH_O, "each guard's hook off its node"},
    {"set_compiled_autograd_hook", set_compiled_autograd_hook, METH_O,
     "make(fn): what compiled autograd calls for a guard that is on"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "hybridcomm_host", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_hybridcomm_host() { return PyModule_Create(&module); }
