"""The descriptor cases of gpu_interop.py (a GPU host runs them; not a
script): one tensor or array exported as a descriptor and mapped in
another process.

- ``py2cli``: PyTorch (and CuPy) export tensors of every dtype both share,
  at non-zero offsets, 1-D to 4-D, transposed and strided; ``cuda-ipc open
  --expect-u32 V --fill-u32 W`` maps each in a separate process, checks
  every word and writes; the exporter then checks, byte by byte, that
  exactly the exported range changed, and that its memory is released once
  it closes the export.
- ``cli2py``: ``cuda-ipc export --mechanism legacy|vmm|pool`` (at an
  offset) mapped with ``cuda_ipc.open(...).as_torch()`` and ``.as_cupy()``.
- ``py2py``: PyTorch exports, CuPy (and PyTorch) in another process map and
  compare element by element; and CuPy exports to PyTorch.
- ``expandable``: PyTorch with ``expandable_segments:True``.
- ``memory``: device free memory comes back after a 256 MiB export.
- ``errors``: an exited exporter, one's own handle, a bogus handle.
- ``record``: PyTorch share records written for the Rust fixtures
  (``--record-dir``).

The layouts and values (:data:`LAYOUTS`, :func:`values_np`) serve the Rust
examples' cases (gpu_examples.py) too. gpu_interop.py's Worker takes the
ops from :class:`MechanismOps` and its Runner the cases from
:class:`MechanismCases`; its ``cases`` lists them.
"""

import json
import os
import time

from gpu_harness import MIB, CaseError, Skip, _compare, signed32


# dtypes both PyTorch and CuPy share (CuPy has no bfloat16 of its own).
TORCH_DTYPES = ["float32", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64", "float64", "bool"]
CUPY_DTYPES = [d for d in TORCH_DTYPES if d != "bfloat16"]

# Layouts: a base shape and a view of it, written so that the same code runs
# on torch tensors, numpy arrays and cupy arrays. "cli" layouts keep the
# exported range 4-byte aligned and a whole number of 32-bit words for every
# dtype (so cuda-ipc open --expect-u32 applies).


def _permute(x, axes):
    return x.permute(*axes) if hasattr(x, "permute") else x.transpose(*axes)


LAYOUTS = {
    "whole1d": ((4096,), lambda x: x, True),
    "slice1d": ((4096,), lambda x: x[1024:3072], True),
    "rows2d": ((64, 48), lambda x: x[8:40], True),
    "transpose2d": ((48, 64), lambda x: _permute(x, (1, 0)), True),
    "strided2d": ((16, 32), lambda x: x[1::2], True),
    "permute3d": ((8, 12, 16), lambda x: _permute(x, (2, 0, 1)), True),
    "slice4d": ((3, 4, 5, 8), lambda x: x[1:, :, 1:3, :], True),
    "odd_slice1d": ((4099,), lambda x: x[3:4098], False),
    "scalar0d": ((64,), lambda x: x[37], False),
}
CLI_LAYOUTS = [k for k, v in LAYOUTS.items() if v[2]]

V_DEFAULT, W_DEFAULT = 0x11223344, 0x55667788
V_BOOL, W_BOOL = 0x01000101, 0x00010100


def patterns(dtype):
    return (V_BOOL, W_BOOL) if dtype == "bool" else (V_DEFAULT, W_DEFAULT)


def values_np(np, shape, dtype):
    """The test values of a base tensor, computed with numpy only. bfloat16
    comes back as its raw bits (int16)."""
    n = 1
    for s in shape:
        n *= s
    i = np.arange(n, dtype=np.int64)
    if dtype == "bool":
        v = i % 3 == 0
    elif dtype == "uint8":
        v = (i % 101).astype(np.uint8)
    elif dtype in ("float16", "float32", "float64"):
        v = (((i % 101) - 50) * 0.5).astype(dtype)
    elif dtype == "bfloat16":
        f = (((i % 101) - 50) * 0.5).astype(np.float32)
        v = (f.view(np.uint32) >> 16).astype(np.uint16).view(np.int16)
    else:
        v = ((i % 101) - 50).astype(dtype)
    return v.reshape(shape)


def written_np(np, dtype):
    """What consumers write into a view, as numpy would store it."""
    if dtype == "bool":
        return np.bool_(True)
    if dtype == "bfloat16":
        return np.int16(0x40E0)  # 7.0
    return np.dtype(dtype).type(7)


# --- the worker side -------------------------------------------------------------


class MechanismOps:
    """The descriptor cases' ops: methods of gpu_interop's Worker."""

    def op_export(self, case, framework, dtype, layout, fill, nbytes=None, elems=None):
        """Makes a base tensor/array, a view of it per `layout`, exports the
        view. fill "u32": every word of the base is the dtype's V pattern;
        fill "values": values_np. `elems` overrides the base shape (1-D)."""
        np = self.np
        self._empty_caches()
        baseline = self._allocated(framework)
        free0 = self._mem_free() if nbytes else None
        shape, fn, _ = LAYOUTS[layout]
        if elems is not None:
            shape = (elems,)
        if framework == "torch":
            torch = self.torch
            tdt = self._torch_dtype(dtype)
            if fill == "u32":
                v, _ = patterns(dtype)
                base = torch.empty(shape, dtype=tdt, device="cuda")
                base.reshape(-1).view(torch.uint8).view(torch.int32).fill_(signed32(v))
            else:
                host = values_np(np, shape, dtype)
                base = torch.from_numpy(host).cuda()
                if dtype == "bfloat16":
                    base = base.view(torch.bfloat16)
            view = fn(base)
            export = self.ci.export_torch(view)
            base_ptr, view_ptr = base.data_ptr(), view.data_ptr()
        else:
            cp = self.cupy
            if fill == "u32":
                v, _ = patterns(dtype)
                base = cp.empty(shape, dtype=dtype)
                base.reshape(-1).view(cp.uint8).view(cp.int32).fill(signed32(v))
            else:
                base = cp.asarray(values_np(np, shape, dtype))
            view = fn(base)
            export = self.ci.export_cupy(view)
            base_ptr, view_ptr = base.data.ptr, view.data.ptr
        self._sync()
        self.state[case] = dict(framework=framework, dtype=dtype, layout=layout, base=base, view=view,
                                export=export, baseline=baseline, free0=free0, base_ptr=base_ptr,
                                view_ptr=view_ptr, shape=shape)
        return {"descriptor": export.descriptor, "kind": export.kind,
                "view_offset": view_ptr - base_ptr, "base_nbytes": int(base.nbytes)}

    def op_verify_u32(self, case):
        """After a consumer filled the exported range with W: the range's bytes
        are W's, every other byte of the base still V's."""
        np = self.np
        s = self.state[case]
        self._sync()
        v, w = patterns(s["dtype"])
        got = self._bytes_of(s["base"], s["framework"])
        start = s["view_ptr"] - s["base_ptr"]
        length = s["export"].descriptor["len"]
        expected = np.frombuffer(np.array([v], dtype="<u4").tobytes() * (got.size // 4), dtype=np.uint8).copy()
        expected[start:start + length] = np.frombuffer(np.array([w], dtype="<u4").tobytes() * (length // 4 + 1), dtype=np.uint8)[
            (start % 4):(start % 4) + length]
        bad = np.flatnonzero(got != expected)
        if bad.size:
            i = int(bad[0])
            where = "inside" if start <= i < start + length else "outside"
            raise AssertionError(
                f"byte {i} of the base ({where} the exported range {start}..{start + length}) is "
                f"0x{got[i]:02x}, expected 0x{expected[i]:02x} ({bad.size} bytes differ)")
        return {"checked_bytes": int(got.size)}

    def op_verify_values(self, case):
        """After a consumer wrote written_np into the view: every element of
        the base equals the original values with the view overwritten."""
        np = self.np
        s = self.state[case]
        self._sync()
        fn = LAYOUTS[s["layout"]][1]
        expected = values_np(np, s["shape"], s["dtype"])
        target = fn(expected)
        if isinstance(target, np.ndarray):
            target[...] = written_np(np, s["dtype"])
        else:
            # numpy gives a scalar (a copy) for a 0-d index: write by position.
            index = (s["view_ptr"] - s["base_ptr"]) // expected.itemsize
            expected.reshape(-1)[index] = written_np(np, s["dtype"])
        got = self._host(s["base"], s["framework"], s["dtype"])
        return _compare(np, got, expected, "base")

    def _host(self, x, framework, dtype):
        if framework == "torch":
            if dtype == "bfloat16":
                x = x.view(self.torch.int16)
            return x.cpu().numpy()
        return self.cupy.asnumpy(x)

    def op_release(self, case, check_memory=True):
        """Closes the export, frees the base, and checks that the memory went
        back: the allocator's count to its baseline, and (for big cases)
        device free memory to within 16 MiB of what it was."""
        import gc

        s = self.state.pop(case)
        s["export"].close()
        framework, baseline, free0 = s["framework"], s["baseline"], s["free0"]
        del s
        gc.collect()
        self._sync()
        result = {}
        if check_memory:
            now = self._allocated(framework)
            result["allocated_delta"] = now - baseline
            if now != baseline:
                raise AssertionError(
                    f"{framework} still holds {now - baseline} bytes more than before the case "
                    "after the export was closed (memory not released)")
        if free0 is not None:
            self._empty_caches()
            free1 = self._mem_free()
            result["free_delta_mib"] = (free1 - free0) / MIB
            if free1 < free0 - 16 * MIB:
                raise AssertionError(
                    f"device free memory is {(free0 - free1) / MIB:.1f} MiB lower than before the "
                    "export, after the consumer finished and the export closed")
        return result

    def op_consume_u32(self, descriptor, framework, expect, fill, as_dtype=None):
        """Maps, checks that every 32-bit word equals `expect`, fills with
        `fill`, closes; checks the view outlives a dropped mapping and that
        everything is unmapped after."""
        import gc

        ci = self.ci
        m = ci.open(descriptor)
        nwords = m.nbytes // 4
        if framework == "torch":
            torch = self.torch
            typed = m.as_torch()
            want_dtype = getattr(torch, ci.dtypes.by_name(m.dtype).torch)
            if typed.dtype != want_dtype:
                raise AssertionError(f"as_torch() gave {typed.dtype}, expected {want_dtype}")
            words = m.as_torch(dtype="int32") if m.dtype in ("u32", "i32", "f32") else typed.reshape(-1).view(torch.int32)
            del m  # the views must keep the mapping alive
            gc.collect()
            bad = (words != signed32(expect)).nonzero()
            if bad.numel():
                i = int(bad[0].item())
                raise AssertionError(f"word {i} is 0x{int(words.reshape(-1)[i].item()) & 0xFFFFFFFF:08x}, expected 0x{expect:08x}")
            words.fill_(signed32(fill))
            torch.cuda.synchronize()
            del typed, words
        else:
            cp = self.cupy
            typed = m.as_cupy()
            if typed.dtype.name != ci.dtypes.by_name(m.dtype).numpy:
                raise AssertionError(f"as_cupy() gave {typed.dtype}, expected {m.dtype}")
            words = typed.reshape(-1).view(cp.uint32)
            del m
            gc.collect()
            bad = cp.flatnonzero(words != cp.uint32(expect))
            if bad.size:
                i = int(bad[0])
                raise AssertionError(f"word {i} is 0x{int(words[i]):08x}, expected 0x{expect:08x}")
            words.fill(cp.uint32(fill))
            cp.cuda.Device().synchronize()
            del typed, words
        gc.collect()
        ci.settle(10)
        live = ci.live_mappings()
        self._empty_caches()
        if live:
            raise AssertionError(f"{live} mapping(s) still open after the views died")
        return {"words": nwords}

    def op_consume_values(self, descriptor, framework, dtype, layout):
        """Maps, compares every element with values_np viewed per `layout`,
        writes written_np into every element, closes."""
        import gc

        np, ci = self.np, self.ci
        shape, fn, _ = LAYOUTS[layout]
        expected = np.asarray(fn(values_np(np, shape, dtype)))
        with ci.open(descriptor) as m:
            if framework == "torch":
                torch = self.torch
                t = m.as_torch()
                if str(t.dtype) != f"torch.{dtype}":
                    raise AssertionError(f"as_torch() gave {t.dtype}, expected torch.{dtype}")
                got = (t.view(torch.int16) if dtype == "bfloat16" else t).cpu().numpy()
                res = _compare(np, got, expected, "mapped tensor")
                t.fill_(7 if dtype != "bool" else True)
                torch.cuda.synchronize()
                del t
            else:
                cp = self.cupy
                a = m.as_cupy(dtype="int16" if dtype == "bfloat16" else None)
                got = cp.asnumpy(a)
                res = _compare(np, got, expected, "mapped array")
                a.fill(written_np(np, dtype))
                cp.cuda.Device().synchronize()
                del a
        gc.collect()
        ci.settle(10)
        live = ci.live_mappings()
        self._empty_caches()
        if live:
            raise AssertionError(f"{live} mapping(s) still open after close")
        return res

    def op_record(self, case, directory, label):
        """Writes the torch share record of the case's view (and of a fresh
        slice) to `directory`, for the Rust fixtures."""
        import torch

        s = self.state[case]
        rec = self.ci.torch_share_record(s["view"])
        storage = self.ci.parse_storage_handle(bytes.fromhex(rec["storage_handle"]))
        if storage["type"] == "c":
            expect = "legacy"
        elif len(storage["handles"]) == 1:
            expect = "vmm" if storage["kind"] == "fd" else "fabric"
        else:
            expect = "segments"
        name = f"torch-{torch.__version__.split('+')[0]}-{label}.json"
        with open(os.path.join(directory, name), "w") as f:
            json.dump({"torch_version": torch.__version__, "label": label, "expect": expect,
                       "handle_version": storage["version"], "handle_type": storage["type"],
                       "record": rec}, f, indent=1, sort_keys=True)
        return {"file": name, "expect": expect}

    def op_open_expect_error(self, descriptor):
        """Opens `descriptor` and expects a CudaIpcError (never a crash)."""
        try:
            m = self.ci.open(descriptor)
        except self.ci.CudaIpcError as e:
            return {"error": f"{type(e).__name__}: {e}", "call": e.call, "code": e.code}
        m.close()
        raise AssertionError("the open succeeded")

    def op_open_own(self, case):
        return self.op_open_expect_error(self.state[case]["export"].descriptor)

    def op_export_without_fd(self, elems):
        """Exports a fresh float32 tensor of `elems` with allow_fd=False and
        expects it refused (this worker's tensors lie in expandable
        segments, shared by file descriptors)."""
        t = self.torch.zeros((elems,), dtype=self.torch.float32, device="cuda")
        try:
            e = self.ci.export_torch(t, allow_fd=False)
        except self.ci.CudaIpcError as err:
            return {"error": f"{type(err).__name__}: {err}", "unsupported": isinstance(err, self.ci.Unsupported)}
        e.close()
        raise AssertionError(f"exported as {e.kind} although allow_fd=False")


def _consume_values_n(self, descriptor, elems):
    """consume_values for a flat float32 tensor of `elems` (whole1d of a
    custom size)."""
    import gc

    np, ci = self.np, self.ci
    expected = values_np(np, (elems,), "float32")
    with ci.open(descriptor) as m:
        t = m.as_torch()
        got = t.cpu().numpy()
        res = _compare(np, got, expected, "mapped tensor")
        t.fill_(7)
        self.torch.cuda.synchronize()
        del t
    gc.collect()
    ci.settle(10)
    live = ci.live_mappings()
    self._empty_caches()
    if live:
        raise AssertionError(f"{live} mapping(s) still open after close")
    res["mechanism"] = m.mechanism
    return res


MechanismOps.op_consume_values_n = _consume_values_n


class MechanismCases:
    """The descriptor cases: methods of gpu_interop's Runner."""

    # --- py2cli ---------------------------------------------------------------

    def py2cli(self, framework, dtype, layout):
        self.need("a", framework)
        v, w = patterns(dtype)
        case = self.case_id()
        a = self.w("a")
        exp = a.call("export", case=case, framework=framework, dtype=dtype, layout=layout, fill="u32")
        try:
            d = exp["descriptor"]
            if exp["kind"] != "descriptor":
                raise CaseError(f"expected a descriptor, got {exp['kind']}")
            self.cli.run("open", "--descriptor", json.dumps(d), "--expect-u32", hex(v), "--fill-u32", hex(w))
            a.call("verify_u32", case=case)
        except BaseException:
            self._drop(a, case)
            raise
        a.call("release", case=case)
        return f"{d['mechanism']} offset {d['offset']} len {d['len']}" + (" strided" if "strides" in d else "")

    # --- cli2py ---------------------------------------------------------------

    def cli2py(self, framework, mechanism, offset, size):
        self.need("b", framework)
        v, w = 0x0BADCAFE, 0x600DF00D
        exp = self.cli.export(size, v, offset, mechanism)
        try:
            d = exp.descriptor
            if d["mechanism"] != mechanism:
                raise CaseError(f"asked for {mechanism}, the CLI exported {d['mechanism']}")
            r = self.w("b").call("consume_u32", descriptor=d, framework=framework, expect=v, fill=w)
            self.cli.run("open", "--descriptor", json.dumps(d), "--expect-u32", hex(w))
        except BaseException:
            exp.kill()
            raise
        exp.finish()
        return f"{r['words']} words at offset {d['offset']}"

    # --- py2py ----------------------------------------------------------------

    def py2py(self, producer, consumer, dtype, layout):
        pw, cw = ("a", "b")
        self.need(pw, producer)
        self.need(cw, consumer)
        case = self.case_id()
        p = self.w(pw)
        exp = p.call("export", case=case, framework=producer, dtype=dtype, layout=layout, fill="values")
        try:
            r = self.w(cw).call("consume_values", descriptor=exp["descriptor"], framework=consumer,
                                dtype=dtype, layout=layout)
            p.call("verify_values", case=case)
        except BaseException:
            self._drop(p, case)
            raise
        p.call("release", case=case)
        return f"{r['elements']} elements, offset {exp['descriptor']['offset']}"

    # --- expandable segments --------------------------------------------------

    def expandable(self, elems, consumer):
        self.need("e", "torch")
        e = self.w("e")
        case = self.case_id()
        info = e.info or {}
        if info.get("alloc_conf") != "expandable_segments:True":
            raise CaseError(f"worker e runs with PYTORCH_CUDA_ALLOC_CONF={info.get('alloc_conf')}")
        if consumer == "cli":
            v, w = patterns("float32")
            exp = e.call("export", case=case, framework="torch", dtype="float32", layout="whole1d",
                         fill="u32", elems=elems)
        else:
            exp = e.call("export", case=case, framework="torch", dtype="float32", layout="whole1d",
                         fill="values", elems=elems)
        try:
            d = exp["descriptor"]
            if self.args.record_dir:
                e.call("record", case=case, directory=self.args.record_dir, label=f"e-{elems}")
            if consumer == "cli":
                if exp["kind"] != "descriptor":
                    raise Skip(f"the tensor spans several segments ({exp['kind']}); the CLI cannot map it")
                self.cli.run("open", "--descriptor", json.dumps(d), "--expect-u32", hex(v), "--fill-u32", hex(w))
                e.call("verify_u32", case=case)
            else:
                self.need("b", "torch")
                self.w("b").call("consume_values_n", descriptor=d, elems=elems)
                e.call("verify_values", case=case)
        except BaseException:
            self._drop(e, case)
            raise
        e.call("release", case=case)
        kind = exp["kind"] if exp["kind"] != "descriptor" else d["mechanism"]
        return f"{kind}, {elems * 4 / MIB:.1f} MiB"

    def expandable_without_fd(self, elems):
        """allow_fd=False: a tensor in expandable segments is refused, with
        a message that names the flag (and nothing is shared)."""
        self.need("e", "torch")
        r = self.w("e").call("export_without_fd", elems=elems)
        if not r["unsupported"] or "allow_fd=True" not in r["error"]:
            raise CaseError(f"expected Unsupported naming allow_fd=True, got {r['error']}")
        return r["error"][:120]

    # --- memory ---------------------------------------------------------------

    def memory(self, framework):
        self.need("a", framework)
        self.need("b", framework)
        case = self.case_id()
        a = self.w("a")
        elems = 256 * MIB // 4
        exp = a.call("export", case=case, framework=framework, dtype="int32", layout="whole1d", fill="u32",
                     nbytes=256 * MIB, elems=elems)
        try:
            v, w = patterns("int32")
            self.w("b").call("consume_u32", descriptor=exp["descriptor"], framework=framework, expect=v, fill=w)
            a.call("verify_u32", case=case)
        except BaseException:
            self._drop(a, case)
            raise
        r = a.call("release", case=case)
        return f"free memory {r.get('free_delta_mib', 0):+.1f} MiB after release"

    # --- errors ---------------------------------------------------------------

    def exporter_gone(self, mechanism):
        self.need("b", "torch")
        exp = self.cli.export(4096, 1, 0, mechanism)
        d = exp.descriptor
        exp.finish()
        time.sleep(0.2)
        r = self.w("b").call("open_expect_error", descriptor=d)
        return r["error"][:120]

    def own_handle(self):
        self.need("a", "torch")
        case = self.case_id()
        a = self.w("a")
        a.call("export", case=case, framework="torch", dtype="float32", layout="slice1d", fill="values")
        try:
            r = a.call("open_own", case=case)
        finally:
            self._drop(a, case)
        if r["code"] != 201:
            raise CaseError(f"expected CUDA_ERROR_INVALID_CONTEXT (201), got {r['error']}")
        return r["error"][:120]

    def bogus_handle(self):
        self.need("b", "torch")
        uuid = self.w("b").info["device"]
        d = {"cuda_ipc": 1, "mechanism": "legacy", "handle": "5a" * 64, "alloc_size": 4096, "offset": 0,
             "len": 64, "dtype": "u8", "device_uuid": uuid, "pid": 1}
        return self.w("b").call("open_expect_error", descriptor=d)["error"][:120]

    def record_c(self):
        if not self.args.record_dir:
            raise Skip("no --record-dir")
        self.need("a", "torch")
        case = self.case_id()
        a = self.w("a")
        a.call("export", case=case, framework="torch", dtype="float16", layout="rows2d", fill="values")
        try:
            r = a.call("record", case=case, directory=self.args.record_dir, label="c-rows2d-f16")
        finally:
            self._drop(a, case)
        return r["file"]
