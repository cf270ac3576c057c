"""The ``torch C API`` cases of gpu_interop.py (a GPU host runs them; they
are not run by ``unittest discover``): state dicts through PyTorch's DLPack
C exchange API (``cuda_ipc._torch_c``) and through the Python path it
replaces (forced with ``CUDA_IPC_TORCH_C_API=0`` in workers ``fa`` and
``fb``), in every pairing of publisher and subscriber.

Each case publishes a state dict mixing bf16, fp32, fp16, int8, bool,
float8_e4m3fn and complex64 tensors (contiguous and transposed), a 0-d
tensor, an empty one, a tied pair and an overlapping slice; the tensors
returned are checked, and republishing them copies none. The subscriber
checks every dtype, shape and byte, that the tied keys are one tensor and
the tensors views of the set, attaches it again (the same values; through
the C API the same key objects, kept with the layout), then that a tensor
it keeps holds the lease past ``release()``. Two updates follow: one written in place and published
with ``update_state_dict(name, shared)`` (nothing to copy), one copied in
from a new state dict; each is seen after ``wait_update``.

gpu_interop.py registers the worker ops (:func:`register`), the two
workers of the Python path (:data:`WORKERS`) and the cases (:func:`cases`).
"""

import gc
import os
import tempfile
import time

import gpu_dtypes
from gpu_harness import register_ops

SET = "tc"
# The dtypes of the numbered tensors, in turn.
DTYPES = ["bfloat16", "float32", "int8", "bool", "float8_e4m3fn", "complex64", "float16"]
# Workers whose cuda_ipc takes the Python path.
WORKERS = {"fa": {"CUDA_IPC_TORCH_C_API": "0"}, "fb": {"CUDA_IPC_TORCH_C_API": "0"}}


def tc_values(torch, k, name, shape, version, transposed=False):
    """Tensor k at `version`: a byte pattern viewed as the dtype (bool
    bytes are 0 or 1)."""
    if transposed:
        return tc_values(torch, k, name, tuple(reversed(shape)), version).t()
    t = gpu_dtypes.dt_values(torch, k, "uint8" if name == "bool" else name, shape, version)
    return (t & 1).view(torch.bool) if name == "bool" else t


def tc_make(torch, n, version):
    """The state dict at `version`: n numbered tensors, then the special ones."""
    sd = {}
    for k in range(n):
        name = DTYPES[k % len(DTYPES)]
        sd[f"layers.{k}.{name}"] = tc_values(torch, k, name, (17 + k % 5, 8), version, transposed=k % 7 == 3)
    sd["scalar"] = tc_values(torch, n, "float32", (), version)
    sd["empty"] = torch.empty((0, 5), dtype=torch.float16, device="cuda")
    emb = tc_values(torch, n + 1, "bfloat16", (32, 16), version)
    sd["embed.weight"] = emb
    sd["lm_head.weight"] = emb
    base = tc_values(torch, n + 2, "float32", (64,), version)
    sd["base"] = base
    sd["slice"] = base[8:40]
    return sd


def tc_check(torch, got, n, version, what):
    """Every tensor of `got` is tc_make's, byte for byte; the tied pair is
    one tensor."""
    want = tc_make(torch, n, version)
    # The set's order is the set's own (entries sorted by name), not the
    # dict's insertion order: the keys are compared as sets.
    if set(got) != set(want):
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        raise AssertionError(f"{what}: keys missing {missing[:4]}, unexpected {extra[:4]}")
    for key, w in want.items():
        g = got[key]
        if g.dtype != w.dtype or tuple(g.shape) != tuple(w.shape):
            raise AssertionError(f"{what}: {key} is {g.dtype} {list(g.shape)}, expected {w.dtype} {list(w.shape)}")
        if not torch.equal(gpu_dtypes._bits(torch, g), gpu_dtypes._bits(torch, w)):
            raise AssertionError(f"{what}: {key} ({g.dtype}) differs")
    if got["embed.weight"] is not got["lm_head.weight"]:
        raise AssertionError(f"{what}: the tied embed.weight and lm_head.weight are two tensors")


def _tc_publish(self, case, n):
    import warnings

    ci, torch = self.ci, self.torch
    path = os.path.join(tempfile.mkdtemp(prefix="cuda-ipc-tc-"), "p.sock")
    pub = ci.Publisher(path)
    sd = tc_make(torch, n, 0)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        shared = pub.publish_state_dict(SET, sd)
        publish_ms = (time.perf_counter() - t0) * 1e3
    tc_check(torch, shared, n, 0, "the tensors publish_state_dict returned")
    gpu_dtypes.republish_is_free(pub, shared)
    t0 = time.perf_counter()
    again_ms = None
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        pub.publish_state_dict("timed", shared)
        again_ms = (time.perf_counter() - t0) * 1e3
    pub.unpublish("timed", timeout=10)
    self.state[case] = dict(pub=pub, shared=shared, path=path, set=SET, n=n)
    return {"path": path, "c_api": list(ci._torch_c.status()), "publish_ms": publish_ms,
            "republish_ms": again_ms, "torch": torch.__version__}


def _tc_attach(self, case, path, n, version):
    ci, torch = self.ci, self.torch
    sub = ci.Subscriber(path)
    t0 = time.perf_counter()
    sd = sub.attach_state_dict(SET)
    attach_ms = (time.perf_counter() - t0) * 1e3
    tc_check(torch, sd, n, version, "the attached state dict")
    ptrs = {e[0]: e[3] for e in sd.attachment.entries}
    views = [k for k, t in sd.items() if t.numel() and k in ptrs and ptrs[k] != t.data_ptr()]
    if views:
        raise AssertionError(f"{len(views)} attached tensors are not views of the set, e.g. {views[0]}")
    # The same layout attached again: the same values, and (through the C
    # API) the same key objects, kept with the layout's entry table.
    again = sub.attach_state_dict(SET)
    tc_check(torch, again, n, version, "the state dict attached again")
    first = {k: k for k in sd}
    keys_kept = all(first[k] is k for k in again)
    del again
    gc.collect()
    ci.settle(10)
    self.state[case] = dict(sub=sub, sd=sd, n=n, kept=sd["layers.0.bfloat16"])
    return {"c_api": list(ci._torch_c.status()), "tensors": len(sd), "attach_ms": attach_ms,
            "keys_kept": keys_kept, "torch": torch.__version__}


def _tc_update(self, case, version, mode):
    """"inplace" writes version's values into the shared tensors and
    publishes them (nothing to copy); "copy" copies a new state dict in."""
    s, torch = self.state[case], self.torch
    new = tc_make(torch, s["n"], version)
    if mode == "inplace":
        with torch.no_grad():
            for key, t in s["shared"].items():
                if not t.numel():
                    continue
                if t.element_size() == 1:  # fp8 (few kernels), bool, int8: as bytes
                    t.view(torch.uint8).copy_(new[key].view(torch.uint8))
                else:
                    t.copy_(new[key])
        torch.cuda.synchronize()
        src = s["shared"]
    else:
        src = new
    t0 = time.perf_counter()
    g = s["pub"].update_state_dict(SET, src)
    return {"version": g, "ms": (time.perf_counter() - t0) * 1e3}


def _tc_wait(self, case, version):
    s = self.state[case]
    t0 = time.perf_counter()
    g = s["sd"].wait_update(30)
    ms = (time.perf_counter() - t0) * 1e3
    tc_check(self.torch, s["sd"], s["n"], version, f"the state dict after update {g}")
    return {"version": g, "ms": ms}


def _tc_release(self, case):
    """release() while a tensor is kept: refused, the lease stays; the
    caller checks it, then calls tc_drop_kept."""
    s = self.state[case]
    try:
        s["sd"].release()
    except self.ci.InvalidInput:
        pass
    else:
        raise AssertionError("release() ended the lease while a tensor of the state dict was alive")
    gc.collect()
    return {}


def _tc_drop_kept(self, case):
    s = self.state.pop(case)
    s.pop("kept")
    s["sub"].close()
    del s
    gc.collect()
    self.ci.settle(10)
    return {}


def _at_least(version, major, minor):
    """Whether torch `version` ("2.11.0+cu130") is major.minor or later."""
    try:
        got = tuple(int(p) for p in version.split("+")[0].split(".")[:2])
    except ValueError:
        return False
    return got >= (major, minor)


def register(worker_cls):
    """Adds the worker ops (``op_tc_*``) to gpu_interop's Worker."""
    register_ops(worker_cls, globals(), "_tc_")


def pair_case(runner, pub_worker, sub_worker, n):
    runner.need(pub_worker, "torch")
    runner.need(sub_worker, "torch")
    a, b = runner.w(pub_worker), runner.w(sub_worker)
    case = runner.case_id()
    r = a.call("tc_publish", case=case, n=n, timeout=300)
    try:
        got = b.call("tc_attach", case=case, path=r["path"], n=n, version=0, timeout=300)
        for worker, res in ((pub_worker, r), (sub_worker, got)):
            forced = worker in WORKERS
            if res["c_api"][0] == forced or (not forced and not res["c_api"][0] and _at_least(res["torch"], 2, 10)):
                raise AssertionError(f"worker {worker} (torch {res['torch']}) took the "
                                     f"{'C API' if res['c_api'][0] else 'Python path: ' + str(res['c_api'][1])}")
        if got["c_api"][0] and not got["keys_kept"]:
            raise AssertionError("the layout attached again through the C API made new key strings")
        updates = []
        for version, mode in ((1, "inplace"), (2, "copy")):
            u = a.call("tc_update", case=case, version=version, mode=mode, timeout=120)
            w = b.call("tc_wait", case=case, version=version, timeout=120)
            if u["version"] != w["version"]:
                raise AssertionError(f"update {version}: the publisher says {u['version']}, "
                                     f"the subscriber {w['version']}")
            updates.append(f"{mode} {u['ms']:.2f} ms")
        b.call("tc_release", case=case)
        a.call("sets_leases", case=case, want=1, name=SET)
        b.call("tc_drop_kept", case=case)
        a.call("sets_leases", case=case, want=0)
    except BaseException:
        runner._sets_drop(b, case)
        raise
    finally:
        runner._sets_close(a, case)

    def path(s):
        return "C API" if s[0] else f"Python ({s[1]})"

    return (f"publisher {path(r['c_api'])}, subscriber {path(got['c_api'])}: {got['tensors']} tensors checked; "
            f"publish {r['publish_ms']:.1f} ms (copied), republish {r['republish_ms']:.2f} ms, attach "
            f"{got['attach_ms']:.2f} ms; update_state_dict {', '.join(updates)}; a kept tensor held the lease")


def cases(runner, n=1000):
    """(name, function) of every case, for Runner.cases."""
    out = []
    for pw, sw, what in (("a", "b", "C API -> C API"), ("fa", "fb", "Python path -> Python path"),
                         ("a", "fb", "C API -> Python path"), ("fa", "b", "Python path -> C API")):
        out.append((f"torch C API: {n} mixed tensors, {what}: dtypes, tied, 0-d, empty, non-contiguous, "
                    f"updates, a kept tensor's lease", lambda p=pw, s=sw: pair_case(runner, p, s, n)))
    return out
