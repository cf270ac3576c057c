"""The ``sets`` cases of gpu_interop.py (a GPU host runs them; not a
script): state dicts over arena sets: 1,000 tensors of mixed sizes and
dtypes (0-d, empty and transposed ones too) published by one Python
process and checked value by value in another, updates in place and copied
in, tied tensors, ``kill -9`` of a consumer holding the tensors, ``cuda-ipc
serve --set`` attached from Python, a Python set attached by ``cuda-ipc
attach --set``, and the example ``examples/python/weight_sync.py``.

gpu_interop.py registers the worker ops (:func:`register`) and its Runner
takes the cases from :class:`SetsCases`. Other modules' cases use these
ops (``sets_leases``, ``sets_release_sd``, ``sets_drop``, ``sets_close``)
and Runner methods (``_sets_drop``, ``_sets_close``) too.
"""

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

import gpu_dtypes
from gpu_harness import MIB, PYTHON_DIR, CaseError, Skip, _finish, _package_parent, _readline, register_ops


# --- the worker side -------------------------------------------------------------

# dtypes of the state dict cases (the set record's, that PyTorch computes with).
SD_DTYPES = ["float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool", "float64"]


def sd_spec(n):
    """The tensors of the test state dict: (key, shape, dtype, transposed),
    mixed sizes (ten of 3-6 MiB, a hundred of 24K elements, the rest small),
    0-d and empty tensors, and transposed (non-contiguous) sources."""
    out = []
    for k in range(n):
        dt = SD_DTYPES[k % len(SD_DTYPES)]
        if k % 100 == 0:
            shape, dt = (1024, 1536), ("float32" if k % 200 == 0 else "bfloat16")
        elif k % 97 == 1:
            shape = ()
        elif k % 89 == 2:
            shape = (0, 7)
        elif k % 10 == 5:
            shape = (96, 256)
        else:
            shape = (k % 37 + 1, k % 13 + 3)
        transposed = len(shape) == 2 and 0 not in shape and k % 7 == 3
        out.append((f"layer{k // 10}.p{k % 10}", shape, dt, transposed))
    return out


def sd_values(torch, k, shape, dtype, version, transposed=False):
    """Tensor k's values at `version`: small integers, exact in every dtype."""
    if transposed:
        return sd_values(torch, k, tuple(reversed(shape)), dtype, version).t()
    n = 1
    for d in shape:
        n *= d
    i = torch.arange(n, device="cuda", dtype=torch.int64)
    v = (i * 7 + k * 13 + version * 5) % 251
    if dtype == "bool":
        t = v % 3 == 0
    elif dtype == "uint8":
        t = v.to(torch.uint8)
    else:
        t = (v - 125).to(getattr(torch, dtype))
    return t.reshape(shape)


def sd_make(torch, n, version):
    return {key: sd_values(torch, k, shape, dt, version, tr) for k, (key, shape, dt, tr) in enumerate(sd_spec(n))}


def sd_check(torch, got, n, version, what):
    """Every tensor of `got` equals sd_make's (dtype, shape, every value)."""
    want = sd_make(torch, n, version)
    if list(got) != list(want):
        missing = [k for k in want if k not in got][:3]
        extra = [k for k in got if k not in want][:3]
        raise AssertionError(f"{what}: keys differ (missing {missing}, unexpected {extra})")
    nbytes = 0
    for key, w in want.items():
        g = got[key]
        if g.dtype != w.dtype or tuple(g.shape) != tuple(w.shape):
            raise AssertionError(f"{what}: {key} is {g.dtype} {list(g.shape)}, expected {w.dtype} {list(w.shape)}")
        if not torch.equal(g, w):
            bad = (g.reshape(-1) != w.reshape(-1)).nonzero()
            i = int(bad[0].item()) if bad.numel() else -1
            raise AssertionError(f"{what}: {key}[{i}] (flat) is {g.reshape(-1)[i].item()!r}, expected "
                                 f"{w.reshape(-1)[i].item()!r} ({bad.numel()} elements differ)")
        nbytes += g.numel() * g.element_size()
    return nbytes


def _sets_publish_sd(self, case, n):
    """Publishes the test state dict as "model" (copied: one warning), then
    the tensors it returned as "again" (no copy: no warning, same memory)."""
    import warnings

    ci, torch = self.ci, self.torch
    folder = tempfile.mkdtemp(prefix="cuda-ipc-sets-")
    path = os.path.join(folder, "p.sock")
    pub = ci.Publisher(path)
    sd = sd_make(torch, n, 0)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        shared = pub.publish_state_dict("model", sd)
        publish_ms = (time.perf_counter() - t0) * 1e3
    copies = [w for w in caught if "copied" in str(w.message)]
    if len(copies) != 1 or f"copied {n - sum(1 for _, s, _, _ in sd_spec(n) if 0 in s)} tensors" not in str(copies[0].message):
        raise AssertionError(f"expected one warning about the copies, got {[str(w.message) for w in caught]}")
    sd_check(torch, shared, n, 0, "the tensors publish_state_dict returned")
    del sd
    gpu_dtypes.republish_is_free(pub, shared)
    self.state[case] = dict(pub=pub, shared=shared, path=path, n=n)
    return {"path": path, "mechanism": pub.arena_mechanism, "publish_ms": publish_ms}


def _sets_update_sd(self, case, version, mode):
    """Publishes the state dict's values at `version`: "inplace" writes the
    shared tensors and calls update_state_dict(name); "copy" passes a new
    state dict."""
    s, torch = self.state[case], self.torch
    new = sd_make(torch, s["n"], version)
    if mode == "inplace":
        with torch.no_grad():
            for key, t in s["shared"].items():
                t.copy_(new[key])
        return {"version": s["pub"].update_state_dict("model")}
    return {"version": s["pub"].update_state_dict("model", new)}


# About 0.2 s of a GPU's time (torch.cuda._sleep counts clock cycles): the
# writes queued behind it are still running when the producer's call returns
# and the consumer's wait begins.
QUEUED_SLEEP_CYCLES = 400_000_000


def _sets_update_queued(self, case, version, how):
    """Writes the state dict's values at `version` behind a GPU sleep and
    publishes them at once, without waiting for the GPU: "current" on
    PyTorch's current stream, then update_state_dict(name); "copy" passes
    them to update_state_dict(name, new), whose copies queue behind the
    sleep; "side" on a stream of its own, then update_state_dict(name,
    stream=s) from the default stream; "set" the same with update_set(name,
    stream=s); "publish" on the current stream, then publish_state_dict of
    the shared tensors as "again" (no copy). Returns whether the writes
    were still queued when the call returned."""
    s, torch = self.state[case], self.torch
    pub = s["pub"]
    new = sd_make(torch, s["n"], version)
    side = torch.cuda.Stream() if how in ("side", "set") else None
    stream = side or torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        torch.cuda._sleep(QUEUED_SLEEP_CYCLES)
        if how != "copy":
            for key, t in s["shared"].items():
                t.copy_(new[key])
    if how == "current":
        v = pub.update_state_dict("model")
    elif how == "copy":
        v = pub.update_state_dict("model", new)
    elif how == "side":
        v = pub.update_state_dict("model", stream=side)
    elif how == "set":
        v = pub.update_set("model", stream=side)
    else:
        pub.publish_state_dict("again", s["shared"])
        v = 0
    queued = not stream.query()
    # The sources and the stream live until the next call (the GPU uses them).
    s["pending"] = (new, side)
    return {"version": v, "queued": queued}


def _sets_attach_sd(self, case, path, n, version, hold="state_dict", name="model"):
    """Attaches `name` as a state dict and checks every value; keeps it.
    hold "tensors": keeps only the tensors (the lease then follows them)."""
    ci, torch = self.ci, self.torch
    sub = ci.Subscriber(path)
    t0 = time.perf_counter()
    sd = sub.attach_state_dict(name)
    attach_ms = (time.perf_counter() - t0) * 1e3
    if not isinstance(sd, dict) or len(sd) != n:
        raise AssertionError(f"attach_state_dict gave a {type(sd).__name__} of {len(sd)} tensors, expected {n}")
    nbytes = sd_check(torch, sd, n, version, "the attached state dict")
    ptrs = {e[0]: e[3] for e in sd.attachment.entries}
    copied = [k for k, t in sd.items() if t.numel() and ptrs.get(k) != t.data_ptr()]
    if copied:
        raise AssertionError(f"{len(copied)} attached tensors are not views of the set, e.g. {copied[0]}")
    if hold == "tensors":
        tensors = dict(sd)
        sd.__exit__(None, None, None)
        self.state[case] = dict(sub=sub, tensors=tensors, n=n)
    else:
        self.state[case] = dict(sub=sub, sd=sd, n=n)
    return {"tensors": len(sd) if hold != "tensors" else len(tensors), "bytes": nbytes, "attach_ms": attach_ms}


def _sets_wait_sd(self, case, version, timeout=30.0):
    s = self.state[case]
    g = s["sd"].wait_update(timeout)
    sd_check(self.torch, s["sd"], s["n"], version, f"the state dict after update {g}")
    return {"version": g}


def _sets_release_sd(self, case):
    """Releases the state dict (its lease) and disconnects."""
    import gc

    s = self.state.pop(case)
    s["sd"].release()
    s["sub"].close()
    del s
    gc.collect()
    return {}


def _sets_drop(self, case):
    import gc

    s = self.state.pop(case, None)
    if s is not None:
        s.pop("tensors", None)
        if "sd" in s:
            s["sd"].__exit__(None, None, None)
        s["sub"].close()
    del s
    gc.collect()
    return {}


def _sets_leases(self, case, want=None, at_least=None, name=None, timeout=10.0):
    """Waits until the publisher holds `want` (or `at_least`) leases on
    `name` (every entry when None)."""
    pub = self.state[case]["pub"]
    deadline = time.time() + timeout
    while True:
        n = sum(1 for l in pub.leases() if name is None or l["name"] == name)
        ok = n == want if want is not None else n >= at_least
        if ok or time.time() > deadline:
            break
        time.sleep(0.02)
    if not ok:
        raise AssertionError(f"the publisher holds {n} lease(s) on {name or 'its entries'} after {timeout} s, "
                             f"expected {want if want is not None else f'at least {at_least}'}")
    return {"leases": n}


def _sets_unpublish(self, case, name, wait):
    """Unpublishes `name` waiting up to `wait` s for its leases (raises if not)."""
    t0 = time.perf_counter()
    self.state[case]["pub"].unpublish(name, timeout=wait)
    return {"ms": (time.perf_counter() - t0) * 1e3}


def _sets_close(self, case):
    s = self.state.pop(case, None)
    if s is None:
        return {}
    try:
        s["pub"].unpublish(s.get("set", "model"), timeout=10)
    except (self.ci.CudaIpcError, KeyError):
        pass
    s["pub"].close()
    del s
    self._empty_caches()
    return {}


def cli_set_base(i):
    """The first word of buffer i of `cuda-ipc serve --set` (a ramp of step 1)."""
    return ((i * 0x01000193) & 0xFFFFFFFF) ^ 0x5E7DA7A0


def _ramp_check(torch, t, i, what):
    """Every u32 word of `t` (any 4-byte dtype) is buffer i's ramp."""
    got = t.reshape(-1).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    want = (cli_set_base(i) + torch.arange(got.numel(), device=got.device, dtype=torch.int64)) & 0xFFFFFFFF
    bad = (got != want).nonzero()
    if bad.numel():
        j = int(bad[0].item())
        raise AssertionError(f"{what} word {j} is 0x{int(got[j].item()):08x}, expected 0x{int(want[j].item()):08x}")
    return got.numel()


def _sets_check_cli_set(self, path, n):
    """Attaches the CLI's set "weights" with attach_set and attach_state_dict
    and checks every word of every buffer."""
    import gc

    ci, torch = self.ci, self.torch
    words = 0
    with ci.Subscriber(path) as sub:
        s = sub.attach_set("weights")
        if len(s) != n or s.names != [f"w{i}" for i in range(n)]:
            raise AssertionError(f"the set has {len(s)} entries {s.names[:3]}..., expected w0..w{n - 1}")
        for i, (name, dtype, shape, _ptr, nbytes) in enumerate(s.entries):
            if dtype != "u32" or nbytes != 4 * shape[0]:
                raise AssertionError(f"{name} is {dtype} {shape} in {nbytes} bytes")
            words += _ramp_check(torch, s.as_torch(i, dtype="i32"), i, name)
        total = s.nbytes
        s.release()
        sd = sub.attach_state_dict("weights")
        for i in range(n):
            _ramp_check(torch, sd[f"w{i}"], i, f"state dict w{i}")
        sd.release()
        del s, sd
        gc.collect()
    return {"words": words, "bytes": total}


def _sets_publish_ramps(self, case, n, nbytes):
    """Publishes a set "weights" laid out as `cuda-ipc serve --set` does:
    buffers w0..w{n-1} of u32, each buffer's ramp."""
    ci, torch = self.ci, self.torch
    folder = tempfile.mkdtemp(prefix="cuda-ipc-sets-")
    path = os.path.join(folder, "p.sock")
    pub = ci.Publisher(path)
    members, buffers = [], []
    words = max(1, nbytes // 4 // n)
    for i in range(n):
        w = words + i % 7
        b = pub.alloc(4 * w)
        v = (cli_set_base(i) + torch.arange(w, device="cuda", dtype=torch.int64)) & 0xFFFFFFFF
        b.as_torch("i32", [w]).copy_(torch.where(v >= 1 << 31, v - (1 << 32), v).to(torch.int32))
        members.append((f"w{i}", b, "u32", [w]))
        buffers.append(b)
    pub.publish_set("weights", members)
    self.state[case] = dict(pub=pub, buffers=buffers, path=path, set="weights")
    return {"path": path, "mechanism": pub.arena_mechanism}


def _tied_sd(torch, version):
    """A state dict with tied tensors: "emb" and "head" one tensor, "a" and
    "b" overlapping slices of one storage, "c" on its own."""
    emb = torch.arange(4096, device="cuda", dtype=torch.float32) + version
    base = torch.arange(1000, device="cuda", dtype=torch.int32) * 3 + version
    return {"emb": emb, "a": base[0:600], "head": emb, "b": base[400:1000], "c": base[100:200] * 2}


def _sets_publish_tied(self, case):
    """Publishes _tied_sd as "tied"; checks the returned dict keeps the tie."""
    import warnings

    ci, torch = self.ci, self.torch
    folder = tempfile.mkdtemp(prefix="cuda-ipc-tied-")
    path = os.path.join(folder, "p.sock")
    pub = ci.Publisher(path)
    sd = _tied_sd(torch, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shared = pub.publish_state_dict("tied", sd)
    if list(shared) != list(sd):
        raise AssertionError(f"the returned keys {list(shared)} are not the state dict's {list(sd)}")
    if shared["emb"] is not shared["head"]:
        raise AssertionError("publish_state_dict returned two tensors for the tied emb and head")
    for k, t in sd.items():
        if not torch.equal(shared[k], t):
            raise AssertionError(f"the returned {k} differs from the state dict's")
    # Republishing the returned tensors: the tie is seen again, nothing copied.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = pub.publish_state_dict("again", shared)
    if caught:
        raise AssertionError(f"republishing the returned tensors warned: {caught[0].message}")
    if again["emb"] is not again["head"] or again["emb"].data_ptr() != shared["emb"].data_ptr():
        raise AssertionError("republishing the returned tensors lost the tie or moved them")
    pub.unpublish("again", timeout=10)
    # Overlapping slices of one arena buffer: the first is published where
    # it is, the second copied apart (set entries cannot overlap).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parts = pub.publish_state_dict("overlap", {"x": shared["a"][0:100], "y": shared["a"][50:150]})
    if parts["x"].data_ptr() != shared["a"].data_ptr() or parts["y"].data_ptr() == shared["a"][50:].data_ptr():
        raise AssertionError("expected x in place and y copied apart")
    if len(caught) != 1 or "copied 1 tensors" not in str(caught[0].message):
        raise AssertionError(f"expected one warning about one copy, got {[str(w.message) for w in caught]}")
    if not torch.equal(parts["y"], shared["a"][50:150]):
        raise AssertionError("the copied slice differs")
    pub.unpublish("overlap", timeout=10)
    self.state[case] = dict(pub=pub, shared=shared, path=path, set="tied")
    return {"path": path}


def _sets_update_tied(self, case, version):
    """Writes version `version` into the shared tensors in place; update."""
    s, torch = self.state[case], self.torch
    new = _tied_sd(torch, version)
    with torch.no_grad():
        for k, t in s["shared"].items():
            t.copy_(new[k])
    return {"version": s["pub"].update_state_dict("tied")}


def _sets_attach_tied(self, case, path):
    """Attaches "tied": emb and head the same tensor, every value checked."""
    ci, torch = self.ci, self.torch
    sub = ci.Subscriber(path)
    sd = sub.attach_state_dict("tied")
    want = _tied_sd(torch, 0)
    if sorted(sd) != sorted(want):
        raise AssertionError(f"attached keys {sorted(sd)}, expected {sorted(want)}")
    if sd["emb"] is not sd["head"]:
        raise AssertionError("the consumer got two tensors for the tied emb and head")
    for k, t in want.items():
        if not torch.equal(sd[k], t):
            raise AssertionError(f"attached {k} differs")
    self.state[case] = dict(sub=sub, sd=sd)
    return {"tensors": len(sd), "entries": len(sd.attachment.entries)}


def _sets_wait_tied(self, case, version):
    s, torch = self.state[case], self.torch
    g = s["sd"].wait_update(timeout=30)
    want = _tied_sd(torch, version)
    for k, t in want.items():
        if not torch.equal(s["sd"][k], t):
            raise AssertionError(f"after update {g}: {k} differs")
    return {"version": g}


def register(worker_cls):
    """Adds the worker ops (``op_sets_*``) to gpu_interop's Worker."""
    register_ops(worker_cls, globals(), "_sets_")


class SetsCases:
    """The sets cases: methods of gpu_interop's Runner."""

    def _sets_close(self, worker, case):
        try:
            worker.call("sets_close", case=case, timeout=60)
        except Exception:
            pass

    def _sets_drop(self, worker, case):
        try:
            worker.call("sets_drop", case=case, timeout=60)
        except Exception:
            pass

    @contextlib.contextmanager
    def _sets_published(self, op="sets_publish_sd", timeout=300, drop=("",), **publish):
        """Workers a and b (both with torch), a having published by ``op``
        (``**publish``) under a new case id: yields ``(a, b, case, answer)``.
        If the body fails, b drops what it holds of the cases ``case +
        suffix`` for each suffix of ``drop``; a closes the case either way."""
        self.need("a", "torch")
        self.need("b", "torch")
        a, b = self.w("a"), self.w("b")
        case = self.case_id()
        r = a.call(op, case=case, timeout=timeout, **publish)
        try:
            yield a, b, case, r
        except BaseException:
            for suffix in drop:
                self._sets_drop(b, case + suffix)
            raise
        finally:
            self._sets_close(a, case)

    def _sets_updates_seen(self, a, b, case, op, arg, steps):
        """For each ``(version, how)`` of ``steps``: worker a's ``op``
        (``arg=how``) publishes the state dict's values at ``version``, and
        b's wait sees that version with every value checked. An answer with
        ``queued`` false (the call waited for the GPU's writes) fails."""
        for version, how in steps:
            g = a.call(op, case=case, version=version, timeout=120, **{arg: how})
            if g.get("queued") is False:
                raise CaseError(f"update {version} ({how}): the call waited for the GPU's writes")
            got = b.call("sets_wait_sd", case=case, version=version, timeout=120)["version"]
            if got != g["version"]:
                raise CaseError(f"update {version} ({how}): the publisher says version {g['version']}, "
                                f"the subscriber {got}")

    def sets_state_dict(self, n):
        with self._sets_published(n=n) as (a, b, case, r):
            got = b.call("sets_attach_sd", case=case, path=r["path"], n=n, version=0, timeout=300)
            a.call("sets_leases", case=case, want=1, name="model")
            b.call("sets_release_sd", case=case)
            a.call("sets_leases", case=case, want=0)
            a.call("sets_unpublish", case=case, name="model", wait=10)
        return (f"{r['mechanism']}: {got['tensors']} tensors, {got['bytes'] / MIB:.1f} MiB, every value checked; "
                f"publish {r['publish_ms']:.0f} ms (one copy warning; republishing the returned tensors copied "
                f"none), attach {got['attach_ms']:.0f} ms")

    def sets_updates(self, n):
        with self._sets_published(n=n) as (a, b, case, r):
            b.call("sets_attach_sd", case=case, path=r["path"], n=n, version=0, timeout=300)
            self._sets_updates_seen(a, b, case, "sets_update_sd", "mode",
                                    ((1, "inplace"), (2, "copy"), (3, "inplace")))
            b.call("sets_release_sd", case=case)
            a.call("sets_leases", case=case, want=0)
        return f"{r['mechanism']}: 3 updates of {n} tensors (in place, copied in, in place) seen in order, every value checked"

    def sets_stream_order(self, n):
        with self._sets_published(n=n, drop=("", "/again")) as (a, b, case, r):
            b.call("sets_attach_sd", case=case, path=r["path"], n=n, version=0, timeout=300)
            self._sets_updates_seen(a, b, case, "sets_update_queued", "how",
                                    ((1, "current"), (2, "copy"), (3, "side"), (4, "set")))
            g = a.call("sets_update_queued", case=case, version=5, how="publish", timeout=120)
            if not g["queued"]:
                raise CaseError("publish_state_dict waited for the GPU's writes")
            again = case + "/again"
            b.call("sets_attach_sd", case=again, path=r["path"], n=n, version=5, name="again", timeout=300)
            b.call("sets_release_sd", case=again)
            b.call("sets_release_sd", case=case)
            a.call("sets_leases", case=case, want=0)
            a.call("sets_unpublish", case=case, name="again", wait=10)
        return (f"{r['mechanism']}: 4 updates and a publish of {n} tensors written behind a GPU sleep, each call "
                f"returned with the writes still queued (PyTorch's current stream, copies, a side stream with "
                f"update_state_dict and update_set(stream=)), every value checked by the subscriber")

    def sets_tied(self):
        with self._sets_published("sets_publish_tied", timeout=120) as (a, b, case, r):
            got = b.call("sets_attach_tied", case=case, path=r["path"], timeout=120)
            a.call("sets_update_tied", case=case, version=1, timeout=120)
            b.call("sets_wait_tied", case=case, version=1, timeout=120)
            b.call("sets_release_sd", case=case)
            a.call("sets_leases", case=case, want=0)
        return (f"{got['tensors']} tensors in {got['entries']} entries: the tied pair one tensor on both sides, "
                f"overlapping slices copied apart, an update in place seen")

    def sets_kill9(self, n):
        # b is killed: nothing of it to drop.
        with self._sets_published(n=n, drop=()) as (a, b, case, r):
            b.call("sets_attach_sd", case=case, path=r["path"], n=n, version=0, hold="tensors", timeout=300)
            a.call("sets_leases", case=case, want=1, name="model")
            held = a.call("sets_leases", case=case, at_least=2)["leases"]
            b.kill()  # SIGKILL, tensors and all
            a.call("sets_leases", case=case, want=0)
            u = a.call("sets_unpublish", case=case, name="model", wait=10)
        return f"{held} leases (the set's and its chunks') ended; unpublish took {u['ms']:.1f} ms"

    def _serve_set(self, n, size):
        if not self.cli.path:
            raise Skip("no --cli given")
        path = os.path.join(tempfile.mkdtemp(prefix="cuda-ipc-serve-"), "s.sock")
        p = subprocess.Popen([self.cli.path, "serve", "--socket", path, "--set", str(n), "--size", str(size)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            info = json.loads(_readline(p, 120, "cuda-ipc serve --set"))
        except BaseException:
            p.kill()
            p.wait(30)
            raise
        return p, path, info

    def sets_cli2py(self, n):
        self.need("b", "torch")
        p, path, info = self._serve_set(n, 64 * MIB)
        try:
            r = self.w("b").call("sets_check_cli_set", path=path, n=n, timeout=300)
        except BaseException:
            p.kill()
            p.wait(30)
            raise
        _finish(p, "cuda-ipc serve --set")
        return (f"{info.get('mechanism')}: {n} buffers, {r['bytes'] / MIB:.1f} MiB, every word checked "
                f"(attach_set and attach_state_dict)")

    def sets_py2cli(self, n):
        self.need("a", "torch")
        if not self.cli.path:
            raise Skip("no --cli given")
        a = self.w("a")
        case = self.case_id()
        r = a.call("sets_publish_ramps", case=case, n=n, nbytes=16 * MIB, timeout=300)
        try:
            out = self.cli.run("attach", "--socket", r["path"], "--set", "weights")
            a.call("sets_leases", case=case, want=0)
        finally:
            self._sets_close(a, case)
        return f"{r['mechanism']}: {out.stdout.strip()[-160:]}"

    def sets_example(self, steps):
        self.need("a", "torch")
        script = os.path.join(os.path.dirname(PYTHON_DIR), "examples", "python", "weight_sync.py")
        if not os.path.isfile(script):
            raise Skip(f"no {script}")
        env = dict(os.environ)
        env["PYTHONPATH"] = _package_parent() + os.pathsep + env.get("PYTHONPATH", "")
        try:
            r = subprocess.run([sys.executable, script, "--steps", str(steps)], capture_output=True, text=True,
                               timeout=540, env=env)
        except subprocess.TimeoutExpired:
            raise CaseError("weight_sync.py did not finish within 540 s")
        if r.returncode != 0:
            raise CaseError(f"weight_sync.py exited {r.returncode}: {(r.stderr.strip() or r.stdout.strip())[-600:]}")
        return r.stdout.strip().splitlines()[-1][-200:] if r.stdout.strip() else "exit 0"
