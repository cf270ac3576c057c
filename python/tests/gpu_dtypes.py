"""The ``dtypes`` cases of gpu_interop.py (a GPU host runs them; they are
not run by ``unittest discover``): every element type a checkpoint
carries, through a state dict between two Python processes.

- A state dict mixing the five float8 types, ``float4_e2m1fn_x2``,
  ``complex64``, ``complex128`` and ``bfloat16`` (contiguous, transposed,
  0-d and empty tensors) is published by one process and attached by
  another: the same torch dtype and shape come back, and every byte is
  compared. An update copied in from a new state dict (transposed sources
  too) is seen after ``wait_update``. Before that, a state dict with a
  ``complex32`` tensor is refused naming it, and the arena is untouched.
- The same set attached with ``attach_set``: CuPy sees the fp8/fp4 entries
  as their bits (uint8) and the complex entries as complex, byte for byte.

gpu_interop.py registers the worker ops (:func:`register`) and lists the
cases (:func:`cases`).
"""

import os
import tempfile
import time

from gpu_harness import register_ops

# The torch dtypes of the state dict; bfloat16 stands for the types sets
# held before.
CHECKPOINT = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
              "float4_e2m1fn_x2", "complex64", "complex128", "bfloat16"]
BITS_ONLY = {"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
             "float4_e2m1fn_x2"}
SET = "ckpt"


def republish_is_free(pub, shared):
    """Publishing the tensors ``publish_state_dict`` returned (they live in
    the arena) again, as "again": no warning, no copy, the same memory;
    then unpublishes "again"."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = pub.publish_state_dict("again", shared)
    if caught:
        raise AssertionError(f"republishing the shared tensors warned: {caught[0].message}")
    moved = [k for k in shared if shared[k].numel() and again[k].data_ptr() != shared[k].data_ptr()]
    if moved:
        raise AssertionError(f"republishing the shared tensors copied {len(moved)} of them, e.g. {moved[0]}")
    pub.unpublish("again", timeout=10)


def dt_spec():
    """(key, torch dtype name, shape, transposed) of the test state dict."""
    out = []
    for k, name in enumerate(CHECKPOINT):
        out.append((f"layers.{k}.{name}.w", name, (64, 48), False))
        out.append((f"layers.{k}.{name}.t", name, (16, 24), True))
        out.append((f"layers.{k}.{name}.s", name, (), False))
        out.append((f"layers.{k}.{name}.e", name, (0, 5), False))
    return out


def dt_values(torch, k, name, shape, version, transposed=False):
    """Tensor k at `version`: a pattern over every byte value, made as
    uint8 and viewed as the type (PyTorch has little arithmetic on fp8 and
    fp4); transposed ones are the transpose of a contiguous tensor."""
    if transposed:
        return dt_values(torch, k, name, tuple(reversed(shape)), version).t()
    dtype = getattr(torch, name)
    n = 1
    for d in shape:
        n *= d
    i = torch.arange(n * dtype.itemsize, device="cuda", dtype=torch.int64)
    b = ((i * 31 + k * 7 + version * 11) % 256).to(torch.uint8)
    return b.view(dtype).reshape(shape)


def dt_make(torch, version):
    return {key: dt_values(torch, k, name, shape, version, tr) for k, (key, name, shape, tr) in enumerate(dt_spec())}


def _bits(torch, t):
    """t's elements as same-sized integers (strides kept), complex128 as
    pairs of int64: compared exactly, NaN bit patterns included."""
    size = t.dtype.itemsize
    if size == 16:
        return t.contiguous().reshape(-1).view(torch.int64)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])


def dt_check(torch, got, version, what):
    """Every tensor of `got` has dt_make's dtype, shape and bytes."""
    want = dt_make(torch, version)
    if list(got) != list(want):
        raise AssertionError(f"{what}: keys {list(got)[:4]}..., expected {list(want)[:4]}...")
    nbytes = 0
    for key, w in want.items():
        g = got[key]
        if g.dtype != w.dtype or tuple(g.shape) != tuple(w.shape):
            raise AssertionError(f"{what}: {key} is {g.dtype} {list(g.shape)}, expected {w.dtype} {list(w.shape)}")
        gb, wb = _bits(torch, g), _bits(torch, w)
        if not torch.equal(gb, wb):
            bad = int((gb.reshape(-1) != wb.reshape(-1)).sum().item())
            raise AssertionError(f"{what}: {key} ({g.dtype}): {bad} elements differ")
        nbytes += g.numel() * g.element_size()
    return nbytes


def _dtypes_publish(self, case):
    """Refuses a state dict holding complex32 before allocating; then
    publishes dt_make(0) as SET (copied: one warning) and checks what it
    returned; republishing the returned tensors copies none."""
    import warnings

    ci, torch = self.ci, self.torch
    path = os.path.join(tempfile.mkdtemp(prefix="cuda-ipc-dtypes-"), "p.sock")
    pub = ci.Publisher(path)
    before = pub.arena_stats()
    bad = {"ok": dt_values(torch, 0, "float8_e4m3fn", (8,), 0), "half": torch.empty(4, dtype=torch.complex32,
                                                                                    device="cuda")}
    try:
        pub.publish_state_dict("bad", bad)
        raise AssertionError("a state dict with a complex32 tensor was published")
    except ci.InvalidInput as e:
        if "'half' is complex32" not in str(e) or "t.view(torch.uint8)" not in str(e):
            raise AssertionError(f"the refusal does not name the tensor and say what to do: {e}")
    after = pub.arena_stats()
    if (after["chunks_created"], after["buffers"]) != (before["chunks_created"], before["buffers"]):
        raise AssertionError(f"the refused state dict allocated: {before} -> {after}")
    sd = dt_make(torch, 0)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        shared = pub.publish_state_dict(SET, sd)
        publish_ms = (time.perf_counter() - t0) * 1e3
    if len([w for w in caught if "copied" in str(w.message)]) != 1:
        raise AssertionError(f"expected one warning about the copies, got {[str(w.message) for w in caught]}")
    dt_check(torch, shared, 0, "the tensors publish_state_dict returned")
    republish_is_free(pub, shared)
    self.state[case] = dict(pub=pub, shared=shared, path=path, set=SET)
    return {"path": path, "mechanism": pub.arena_mechanism, "publish_ms": publish_ms}


def _dtypes_update(self, case, version):
    """Copies dt_make(version) in (transposed fp8/fp4 sources too)."""
    s = self.state[case]
    return {"version": s["pub"].update_state_dict(SET, dt_make(self.torch, version))}


def _dtypes_attach(self, case, path, version):
    """Attaches SET as a state dict: every dtype, shape and byte checked;
    the tensors are views of the set. Keeps it."""
    ci, torch = self.ci, self.torch
    sub = ci.Subscriber(path)
    sd = sub.attach_state_dict(SET)
    nbytes = dt_check(torch, sd, version, "the attached state dict")
    ptrs = {e[0]: e[3] for e in sd.attachment.entries}
    copied = [k for k, t in sd.items() if t.numel() and ptrs.get(k) != t.data_ptr()]
    if copied:
        raise AssertionError(f"{len(copied)} attached tensors are not views of the set, e.g. {copied[0]}")
    names = {e[0]: e[1] for e in sd.attachment.entries}
    want = {"float8_e4m3fn": "f8e4m3fn", "float4_e2m1fn_x2": "f4e2m1fnx2", "complex128": "c128"}
    for key, name, _shape, _tr in dt_spec():
        if key in names and name in want and names[key] != want[name]:
            raise AssertionError(f"entry {key} carries dtype {names[key]!r}, expected {want[name]!r}")
    self.state[case] = dict(sub=sub, sd=sd)
    return {"tensors": len(sd), "bytes": nbytes}


def _dtypes_wait(self, case, version):
    s = self.state[case]
    g = s["sd"].wait_update(30)
    dt_check(self.torch, s["sd"], version, f"the state dict after update {g}")
    return {"version": g}


def _dtypes_cupy(self, case, path, version):
    """attach_set(SET) as CuPy arrays: the fp8/fp4 entries are uint8 (their
    bits), complex entries complex; each array's bytes are the tensor's."""
    ci, torch, cupy = self.ci, self.torch, self.cupy
    sub = ci.Subscriber(path)
    checked = 0
    try:
        with sub.attach_set(SET) as a:
            for k, (key, name, shape, tr) in enumerate(dt_spec()):
                if key not in a or name == "bfloat16":
                    continue  # empty tensors travel under another name; bf16 needs ml_dtypes in CuPy
                arr = a.as_cupy(key)
                want_dtype = "uint8" if name in BITS_ONLY else name
                if arr.dtype.name != want_dtype:
                    raise AssertionError(f"{key}: CuPy sees {arr.dtype.name}, expected {want_dtype}")
                want = _bits(torch, dt_values(torch, k, name, shape, version, tr)).cpu().numpy().tobytes()
                if cupy.asnumpy(arr).tobytes() != want:
                    raise AssertionError(f"{key}: the CuPy array's bytes differ from the tensor's")
                del arr
                checked += 1
    finally:
        sub.close()
    return {"arrays": checked}


def register(worker_cls):
    """Adds the worker ops (``op_dtypes_*``) to gpu_interop's Worker."""
    register_ops(worker_cls, globals(), "_dtypes_")


def state_dict_case(runner):
    runner.need("a", "torch")
    runner.need("b", "torch")
    a, b = runner.w("a"), runner.w("b")
    case = runner.case_id()
    r = a.call("dtypes_publish", case=case, timeout=300)
    try:
        got = b.call("dtypes_attach", case=case, path=r["path"], version=0, timeout=300)
        g = a.call("dtypes_update", case=case, version=1, timeout=120)["version"]
        w = b.call("dtypes_wait", case=case, version=1, timeout=120)["version"]
        if g != w:
            raise AssertionError(f"the publisher says version {g}, the subscriber {w}")
        b.call("sets_release_sd", case=case)
        a.call("sets_leases", case=case, want=0)
    except BaseException:
        runner._sets_drop(b, case)
        raise
    finally:
        runner._sets_close(a, case)
    return (f"{r['mechanism']}: {got['tensors']} tensors ({', '.join(CHECKPOINT)}), {got['bytes']} bytes, every "
            f"byte compared; a complex32 tensor refused before allocating; an update copied in seen")


def cupy_case(runner):
    runner.need("a", "torch")
    runner.need("b", "torch")
    runner.need("b", "cupy")
    a, b = runner.w("a"), runner.w("b")
    case = runner.case_id()
    r = a.call("dtypes_publish", case=case, timeout=300)
    try:
        got = b.call("dtypes_cupy", case=case, path=r["path"], version=0, timeout=300)
        a.call("sets_leases", case=case, want=0)
    finally:
        runner._sets_close(a, case)
    return f"{got['arrays']} arrays: fp8/fp4 as their bits (uint8), complex as complex, byte for byte"


def cases(runner):
    """(name, function) of every dtypes case, for Runner.cases."""
    return [
        ("dtypes: a state dict of fp8, fp4, complex and bf16 tensors, Python -> Python, every byte compared",
         lambda: state_dict_case(runner)),
        ("dtypes: attach_set -> CuPy: fp8/fp4 entries as their bits, complex as complex",
         lambda: cupy_case(runner)),
    ]
