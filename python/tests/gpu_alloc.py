"""The ``alloc`` cases of gpu_interop.py (a GPU host runs them; not a
script): tensors born shareable (``cuda_ipc.torch.shareable``): a model
built in a publisher's arena and published with no copy and no warning,
checked byte for byte by another process; training steps in place seen
after ``update_state_dict``; freed tensors giving their segments back to
the arena; a closed publisher's tensors staying valid; a model in one chunk with
``reserve``; an allocation
larger than the GPU raising torch's ``OutOfMemoryError``.

gpu_interop.py registers the worker ops (:func:`register`) and its Runner
takes the cases from :class:`AllocCases`. They use gpu_sets.py's ops
``sets_leases``, ``sets_release_sd`` and ``sets_drop``, and its Runner
method ``_sets_close``.
"""

import os
import tempfile

from gpu_harness import MIB, CaseError, register_ops


# --- the worker side -------------------------------------------------------------


def alloc_net(torch):
    """The model of the alloc cases: linear layers, a LayerNorm and a
    BatchNorm (whose num_batches_tracked is a 0-d int64), seeded."""
    torch.manual_seed(1234)
    nn = torch.nn
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.LayerNorm(512),
                         nn.BatchNorm1d(512), nn.Linear(512, 10))


def alloc_digests(np, torch, sd):
    """A sha256 of every tensor's bytes, by key (compared across processes)."""
    import hashlib

    out = {}
    for key, t in sd.items():
        raw = t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy()
        out[key] = hashlib.sha256(raw.tobytes()).hexdigest()
    return out


def _alloc_publish_model(self, case):
    """Builds alloc_net inside shareable(pub), publishes its state dict:
    no warning, every published tensor the model's own memory."""
    import warnings

    ci, torch = self.ci, self.torch
    path = os.path.join(tempfile.mkdtemp(prefix="cuda-ipc-alloc-"), "p.sock")
    pub = ci.Publisher(path)
    before = ci.torch.segments()
    with ci.torch.shareable(pub):
        model = alloc_net(torch).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    segments = ci.torch.segments()
    if segments[0] <= before[0]:
        raise AssertionError(f"the allocator holds {segments} segments after building the model, {before} before")
    sd = model.state_dict()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shared = pub.publish_state_dict("weights", sd)
    if caught:
        raise AssertionError(f"publishing a model born in the arena warned: {caught[0].message}")
    moved = [k for k, t in sd.items() if t.numel() and shared[k].data_ptr() != t.data_ptr()]
    if moved:
        raise AssertionError(f"{len(moved)} tensors were copied, e.g. {moved[0]}")
    self.state[case] = dict(pub=pub, model=model, opt=opt, shared=shared, path=path, set="weights")
    stats = pub.arena_stats()
    return {"path": path, "tensors": len(sd), "digests": alloc_digests(self.np, torch, sd),
            "segments": segments[0] - before[0], "segment_bytes": segments[1] - before[1],
            "chunks": stats["chunks"], "mechanism": pub.arena_mechanism}


def _alloc_train(self, case, steps):
    """`steps` SGD steps in place on the model, then update_state_dict."""
    s, torch = self.state[case], self.torch
    model, opt = s["model"], s["opt"]
    ptrs = {k: t.data_ptr() for k, t in model.state_dict().items()}
    g = torch.Generator(device="cuda").manual_seed(99)
    for _ in range(steps):
        x = torch.randn(32, 64, device="cuda", generator=g)
        y = torch.randint(0, 10, (32,), device="cuda", generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    sd = model.state_dict()
    moved = [k for k, t in sd.items() if t.data_ptr() != ptrs[k]]
    if moved:
        raise AssertionError(f"training moved {len(moved)} tensors out of the arena, e.g. {moved[0]}")
    version = s["pub"].update_state_dict("weights")
    return {"version": version, "digests": alloc_digests(self.np, torch, sd), "loss": float(loss)}


def _alloc_attach(self, case, path, digests):
    """Attaches "weights" as a state dict; every tensor's bytes as `digests`."""
    ci, torch = self.ci, self.torch
    sub = ci.Subscriber(path)
    sd = sub.attach_state_dict("weights")
    _alloc_compare(self.np, torch, sd, digests, "the attached state dict")
    self.state[case] = dict(sub=sub, sd=sd)
    return {"tensors": len(sd)}


def _alloc_compare(np, torch, sd, digests, what):
    got = alloc_digests(np, torch, sd)
    if sorted(got) != sorted(digests):
        raise AssertionError(f"{what}: keys {sorted(got)[:4]}..., expected {sorted(digests)[:4]}...")
    bad = [k for k in digests if got[k] != digests[k]]
    if bad:
        raise AssertionError(f"{what}: {len(bad)} tensors differ from the publisher's, e.g. {bad[0]}")


def _alloc_wait(self, case, digests, timeout=60.0):
    s = self.state[case]
    g = s["sd"].wait_update(timeout)
    _alloc_compare(self.np, self.torch, s["sd"], digests, f"the state dict after update {g}")
    return {"version": g}


def _alloc_freed_space(self):
    """Tensors made and freed in the pool: torch.cuda.empty_cache() keeps
    the segments of the pool in use (PyTorch's rule), and
    cuda_ipc.torch.empty_cache(pub) gives them back (refused inside a
    shareable block): the arena's used bytes come back to where they were."""
    import gc

    ci, torch = self.ci, self.torch
    path = os.path.join(tempfile.mkdtemp(prefix="cuda-ipc-alloc-"), "p.sock")
    with ci.Publisher(path) as pub:
        pub.reserve(1)  # the arena exists: its counts start from here
        before, used0 = ci.torch.segments(), pub.arena_stats()["used_bytes"]
        with ci.torch.shareable(pub):
            ts = [torch.full((16 * MIB // 4,), float(i), device="cuda") for i in range(8)]
        during, used1 = ci.torch.segments(), pub.arena_stats()["used_bytes"]
        if during[1] - before[1] < 8 * 16 * MIB or used1 - used0 < 8 * 16 * MIB:
            raise AssertionError(f"8 tensors of 16 MiB: segments {before} -> {during}, arena used {used0} -> {used1}")
        if any(float(t[0]) != i for i, t in enumerate(ts)):
            raise AssertionError("a tensor in the arena does not hold its value")
        del ts
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        kept = ci.torch.segments()
        if kept != during:
            # If a later PyTorch empties pools in use, this case says so.
            raise AssertionError(f"torch.cuda.empty_cache() emptied a pool in use: segments {during} -> {kept}")
        with ci.torch.shareable(pub):
            try:
                ci.torch.empty_cache(pub)
            except ci.InvalidInput:
                pass
            else:
                raise AssertionError("cuda_ipc.torch.empty_cache(pub) inside shareable(pub) did not raise")
        ci.torch.empty_cache(pub)
        after, used2 = ci.torch.segments(), pub.arena_stats()["used_bytes"]
        if after != before or used2 != used0:
            raise AssertionError(f"after empty_cache: segments {during} -> {after} (before {before}), "
                                 f"arena used {used1} -> {used2} (before {used0})")
        err = ci.torch.last_error()
        if err:
            raise AssertionError(f"the allocator recorded an error: {err}")
    return {"segment_bytes": during[1] - before[1], "arena_used": used1 - used0}


def _alloc_close(self):
    """Closing the publisher: tensors made in its pool stay valid and
    writable; a new segment in its pool raises OutOfMemoryError saying why;
    a new shareable block on the closed publisher is refused."""
    import gc

    ci, torch = self.ci, self.torch
    path = os.path.join(tempfile.mkdtemp(prefix="cuda-ipc-alloc-"), "p.sock")
    pub = ci.Publisher(path)
    before = ci.torch.segments()
    oom = inside = None
    # Caught inside the block, the error is torch's and last_error() says
    # why; once it leaves the block, the reason is part of its message.
    try:
        with ci.torch.shareable(pub):
            kept = torch.arange(4 * MIB, device="cuda", dtype=torch.int32)
            pub.close()
            try:
                torch.empty(512 * MIB, dtype=torch.uint8, device="cuda")
            except torch.cuda.OutOfMemoryError:
                inside = ci.torch.last_error()
            torch.empty(512 * MIB, dtype=torch.uint8, device="cuda")
    except torch.cuda.OutOfMemoryError as e:
        oom = str(e)
    if inside is None or "no publisher is active" not in inside:
        raise AssertionError(f"a new segment after close, caught in the block: last_error() is {inside!r}")
    if oom is None or "no publisher is active" not in oom:
        raise AssertionError(f"a new segment after close: expected OutOfMemoryError naming the cause, got {oom!r}")
    want = torch.arange(4 * MIB, device="cuda", dtype=torch.int32)
    if not torch.equal(kept, want):
        raise AssertionError("a tensor made in the pool changed after the publisher closed")
    kept.add_(1)
    if not torch.equal(kept, want + 1):
        raise AssertionError("a tensor made in the pool is not writable after the publisher closed")
    try:
        with ci.torch.shareable(pub):
            pass
    except ci.CudaIpcError as e:
        refused = str(e)
    else:
        raise AssertionError("shareable() on a closed publisher did not raise")
    del kept, want
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    after = ci.torch.segments()
    if after != before:
        raise AssertionError(f"segments {before} before, {after} after the tensors were freed")
    return {"refused": refused[:80]}


def _alloc_reserved(self):
    """A model of 6 x 64 MiB built in shareable(): without a reservation the
    arena grows to two chunks or more (256 MiB, 256 MiB, ...); with
    ``reserve=reserve_bytes(the model on the meta device)`` it holds the
    model in one chunk made before the block, every tensor in it."""
    import gc

    ci, torch = self.ci, self.torch

    def net():
        torch.manual_seed(7)
        return torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(6)])

    with torch.device("meta"):
        size = ci.torch.reserve_bytes(net())
    out = {"reserve": size}
    for reserve in (None, size):
        path = os.path.join(tempfile.mkdtemp(prefix="cuda-ipc-alloc-"), "p.sock")
        with ci.Publisher(path) as pub:
            with ci.torch.shareable(pub, reserve=reserve):
                if reserve and pub.arena_stats()["chunks"] != 1:
                    raise AssertionError(f"reserve={reserve}: {pub.arena_stats()['chunks']} chunks before the block")
                model = net().cuda()
            stats = pub.arena_stats()
            if ci.torch.reserve_bytes(model) != size:
                raise AssertionError(f"reserve_bytes of the model {ci.torch.reserve_bytes(model)}, "
                                     f"on the meta device {size}")
            outside = [k for k, t in model.state_dict().items()
                       if pub._c.arena_buffer_containing(t.data_ptr(), t.numel() * t.element_size()) is None]
            if outside:
                raise AssertionError(f"reserve={reserve}: {len(outside)} tensors outside the arena, e.g. {outside[0]}")
            out["reserved" if reserve else "grown"] = stats["chunks"]
            del model
            gc.collect()
            torch.cuda.synchronize()
            ci.torch.empty_cache(pub)
    if out["reserved"] != 1 or out["grown"] < 2:
        raise AssertionError(f"chunks without a reservation {out['grown']} (expected 2 or more), "
                             f"with it {out['reserved']} (expected 1)")
    return out


def _alloc_oom(self):
    """An allocation larger than the GPU inside shareable(): torch's
    OutOfMemoryError; caught in the block, last_error() gives the arena's
    reason, and leaving the block, the message carries it; the process and
    the pool still work afterwards."""
    ci, torch = self.ci, self.torch
    total = torch.cuda.get_device_properties(0).total_memory
    path = os.path.join(tempfile.mkdtemp(prefix="cuda-ipc-alloc-"), "p.sock")
    with ci.Publisher(path) as pub:
        with ci.torch.shareable(pub):
            try:
                torch.empty(2 * total, dtype=torch.uint8, device="cuda")
            except torch.cuda.OutOfMemoryError:
                reason = ci.torch.last_error()
            else:
                raise AssertionError(f"allocating {2 * total} bytes did not raise")
        if not reason:
            raise AssertionError("after an OutOfMemoryError in the block, last_error() is empty")
        msg = None
        try:
            with ci.torch.shareable(pub):
                torch.empty(2 * total, dtype=torch.uint8, device="cuda")
        except torch.cuda.OutOfMemoryError as e:
            msg = str(e)
        if msg is None or "cuda_ipc.torch.shareable:" not in msg:
            raise AssertionError(f"the OutOfMemoryError leaving the block does not say the arena's reason: "
                                 f"{(msg or '')[-300:]!r}")
        with ci.torch.shareable(pub):
            small = torch.ones(MIB, device="cuda")
            if float(small.sum()) != MIB:
                raise AssertionError("a small allocation in the pool after the failure is wrong")
            found = pub._c.arena_buffer_containing(small.data_ptr(), small.numel() * 4)
            if found is None:
                raise AssertionError("the small tensor after the failure is not in the arena")
            del small
        torch.cuda.empty_cache()
    return {"reason": reason[:120], "message": msg.splitlines()[-1][:160]}


def register(worker_cls):
    """Adds the worker ops (``op_alloc_*``) to gpu_interop's Worker."""
    register_ops(worker_cls, globals(), "_alloc_")


class AllocCases:
    """The alloc cases: methods of gpu_interop's Runner."""

    def _alloc_drop(self, worker, case):
        try:
            worker.call("sets_drop", case=case, timeout=60)
        except Exception:
            pass

    def alloc_zero_copy(self):
        self.need("a", "torch")
        self.need("b", "torch")
        a, b = self.w("a"), self.w("b")
        case = self.case_id()
        r = a.call("alloc_publish_model", case=case, timeout=300)
        try:
            got = b.call("alloc_attach", case=case, path=r["path"], digests=r["digests"], timeout=300)
            a.call("sets_leases", case=case, want=1, name="weights")
            b.call("sets_release_sd", case=case)
            a.call("sets_leases", case=case, want=0)
        except BaseException:
            self._alloc_drop(b, case)
            raise
        finally:
            self._sets_close(a, case)
        return (f"{r['mechanism']}: {got['tensors']} tensors in {r['segments']} segments "
                f"({r['segment_bytes'] / MIB:.0f} MiB, {r['chunks']} chunks), no copy, no warning, every byte checked")

    def alloc_training(self, rounds, steps):
        self.need("a", "torch")
        self.need("b", "torch")
        a, b = self.w("a"), self.w("b")
        case = self.case_id()
        r = a.call("alloc_publish_model", case=case, timeout=300)
        try:
            b.call("alloc_attach", case=case, path=r["path"], digests=r["digests"], timeout=300)
            for _ in range(rounds):
                t = a.call("alloc_train", case=case, steps=steps, timeout=120)
                got = b.call("alloc_wait", case=case, digests=t["digests"], timeout=120)["version"]
                if got != t["version"]:
                    raise CaseError(f"the publisher says version {t['version']}, the subscriber {got}")
            b.call("sets_release_sd", case=case)
            a.call("sets_leases", case=case, want=0)
        except BaseException:
            self._alloc_drop(b, case)
            raise
        finally:
            self._sets_close(a, case)
        return f"{rounds} updates of {steps} SGD steps in place, each seen byte for byte; last loss {t['loss']:.3f}"

    def alloc_freed(self):
        self.need("a", "torch")
        r = self.w("a").call("alloc_freed_space", timeout=120)
        return f"{r['segment_bytes'] / MIB:.0f} MiB of segments, arena used +{r['arena_used'] / MIB:.0f} MiB, all back"

    def alloc_close(self):
        self.need("a", "torch")
        r = self.w("a").call("alloc_close", timeout=120)
        return f"tensors kept; shareable() then refused: {r['refused']}"

    def alloc_reserved(self):
        self.need("a", "torch")
        r = self.w("a").call("alloc_reserved", timeout=300)
        return (f"a model of 384 MiB: {r['grown']} chunks grown, 1 chunk with reserve="
                f"{r['reserve'] / MIB:.0f} MiB")

    def alloc_oom(self):
        self.need("a", "torch")
        r = self.w("a").call("alloc_oom", timeout=300)
        return r["message"]
