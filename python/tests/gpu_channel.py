"""The ``channel`` cases of gpu_interop.py (a GPU host runs them; not a
script): the exchange channel from Python, with every mechanism: a Python
``Publisher`` attached by ``cuda-ipc attach`` (checks and writes every
word), ``cuda-ipc serve`` attached by a Python ``Subscriber``, Python to
Python with updates (``wait_update``) and a ring; a lease that follows the
tensors made from an attachment, and ``kill -9`` of a consumer holding
tensors ending its leases.

gpu_interop.py registers the worker ops (:func:`register`) and its Runner
takes the cases from :class:`ChannelCases`.
"""

import os
import queue
import subprocess
import tempfile
import threading
import time

from gpu_harness import MIB, CaseError, Skip, _finish, register_ops, signed32


def _chan_publish(self, case, mechanism, nbytes, fill):
    """Publishes "x": int32 words all `fill`, in shareable memory of
    `mechanism`, on a socket in a fresh private folder."""
    ci, torch = self.ci, self.torch
    folder = tempfile.mkdtemp(prefix="cuda-ipc-chan-")
    path = os.path.join(folder, "p.sock")
    pub = ci.Publisher(path)
    src = torch.full((nbytes // 4,), signed32(fill), dtype=torch.int32, device="cuda")
    try:
        p = pub.publish("x", src, mechanism=mechanism)
    except ci.Unavailable as e:
        pub.close()
        return {"skip": str(e)[:300]}
    self.state[case] = dict(pub=pub, published=p, path=path)
    return {"path": path, "mechanism": p.mechanism}


def _chan_check(self, case, expect):
    """Every word of the published "x" equals `expect`."""
    t = self.state[case]["published"].as_torch()
    self.torch.cuda.synchronize()
    bad = (t != signed32(expect)).nonzero()
    if bad.numel():
        i = int(bad[0].item())
        raise AssertionError(f"word {i} of x is 0x{int(t[i].item()) & 0xFFFFFFFF:08x}, expected 0x{expect:08x}")
    return {"words": int(t.numel())}


# About 0.1 s of a GPU's time (torch.cuda._sleep counts clock cycles), and
# about 5 ms a ring frame: writes queued behind it are still running when
# the producer's call returns.
QUEUED_UPDATE_CYCLES = 200_000_000
QUEUED_FRAME_CYCLES = 10_000_000


def _chan_update(self, case, value, stream=False):
    """Writes `value` into every word of "x" and publishes the update. With
    `stream`, the write runs on a side stream behind a GPU sleep and the
    update is ordered after that stream (update(name, stream=)): returns
    whether the write was still queued when the call returned."""
    s, torch = self.state[case], self.torch
    t = s["published"].as_torch()
    if not stream:
        t.fill_(value)
        del t
        return {"version": s["pub"].update("x")}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(QUEUED_UPDATE_CYCLES)
        t.fill_(value)
    version = s["pub"].update("x", stream=side)
    queued = not side.query()
    s["pending"] = (t, side)  # alive until the GPU is done with them
    return {"version": version, "queued": queued}


def _chan_leases(self, case, want, timeout=5.0):
    """Waits up to `timeout` s until the publisher holds `want` leases."""
    pub = self.state[case]["pub"]
    deadline = time.time() + timeout
    while True:
        n = len(pub.leases())
        if n == want or time.time() > deadline:
            break
        time.sleep(0.02)
    if n != want:
        raise AssertionError(f"the publisher holds {n} lease(s) after {timeout} s, expected {want}")
    return {"leases": n}


def _chan_close(self, case):
    s = self.state.pop(case, None)
    if s is None:
        return {}
    if "ring_thread" in s:
        s["ring_thread"].join(60)
    try:
        s["pub"].unpublish("x", timeout=10)
    except self.ci.CudaIpcError:
        pass
    s["pub"].close()
    del s
    self._empty_caches()
    return {}


def _chan_attach_check(self, path, name, expect, fill):
    """Attaches `name` at `path`, checks every word, fills, releases."""
    import gc

    ci, torch = self.ci, self.torch
    with ci.Subscriber(path) as sub:
        a = sub.attach(name)
        t = a.as_torch(dtype="int32")
        bad = (t != signed32(expect)).nonzero()
        if bad.numel():
            i = int(bad[0].item())
            raise AssertionError(f"word {i} is 0x{int(t[i].item()) & 0xFFFFFFFF:08x}, expected 0x{expect:08x}")
        t.fill_(signed32(fill))
        torch.cuda.synchronize()
        words = int(t.numel())
        mechanism = a.mechanism
        del t
        gc.collect()
        a.release()
    return {"words": words, "mechanism": mechanism}


def _chan_subscribe(self, case, path, hold="attachment"):
    """Attaches "x" and keeps a tensor of it. `hold`: "attachment" keeps
    the attachment too; "tensor" keeps only the tensor (the lease then
    follows it)."""
    ci = self.ci
    sub = ci.Subscriber(path)
    a = sub.attach("x")
    t = a.as_torch()
    if hold == "tensor":
        try:
            a.release()
        except ci.InvalidInput as e:
            if "still held" not in str(e):
                raise
        else:
            raise AssertionError("release() succeeded while a tensor of the attachment was alive")
        a = None
    self.state[case] = dict(sub=sub, att=a, t=t)
    return {"lease": None if a is None else a.lease}


def _chan_wait(self, case, expect, timeout=10.0):
    s = self.state[case]
    g = s["att"].wait_update(timeout)
    t = s["t"]
    if not bool((t == expect).all().item()):
        raise AssertionError(f"after update {g}, x is not all {expect}")
    return {"version": g}


def _chan_drop(self, case, what):
    """Drops the held tensor ("tensor"), or releases everything ("all")."""
    import gc

    s = self.state[case]
    if what == "tensor":
        s.pop("t", None)
    else:
        s.pop("t", None)
        if s.get("att") is not None:
            s["att"].release()
        s["sub"].close()
        self.state.pop(case)
    gc.collect()
    return {}


def _chan_ring_create(self, case, slots, slot_bytes, mechanism, fences_only=False):
    ci = self.ci
    folder = tempfile.mkdtemp(prefix="cuda-ipc-ring-")
    path = os.path.join(folder, "r.sock")
    pub = ci.Publisher(path)
    try:
        ring = pub.ring("r", slots, slot_bytes, mechanism, fences_only=fences_only)
    except ci.Unavailable as e:
        pub.close()
        return {"skip": str(e)[:300]}
    self.state[case] = dict(pub=pub, ring=ring, path=path)
    return {"path": path}


def _chan_ring_produce(self, case, frames, stream=False):
    """Starts a thread that publishes `frames` frames: frame i fills its slot
    with int32 i and says {"i": i} in its notice. With `stream`, each fill
    runs on a side stream behind a GPU sleep and the frame is published
    after that stream (publish(slot, extra, stream=)); ring_join says how
    many frames were still being written when their publish returned."""
    s, torch = self.state[case], self.torch
    ring, errors, queued = s["ring"], [], []

    def produce():
        try:
            side = torch.cuda.Stream() if stream else None
            deadline = time.time() + 30
            while ring.subscribers() < 1 and time.time() < deadline:
                time.sleep(0.01)
            for i in range(frames):
                slot = ring.acquire(timeout=30)
                t = ring.as_torch(slot, "int32")
                if side is None:
                    t.fill_(i)
                    del t
                    ring.publish(slot, {"i": i})
                    continue
                with torch.cuda.stream(side):
                    torch.cuda._sleep(QUEUED_FRAME_CYCLES)
                    t.fill_(i)
                ring.publish(slot, {"i": i}, stream=side)
                queued.append(not side.query())
                del t
            if side is not None:
                side.synchronize()
        except Exception as e:  # reported by ring_join
            errors.append(f"{type(e).__name__}: {e}")

    th = threading.Thread(target=produce, daemon=True)
    th.start()
    s["ring_thread"], s["ring_errors"], s["ring_queued"] = th, errors, queued
    return {}


def _chan_ring_join(self, case):
    s = self.state[case]
    s["ring_thread"].join(60)
    if s["ring_thread"].is_alive():
        raise AssertionError("the ring producer did not finish within 60 s")
    if s["ring_errors"]:
        raise AssertionError(s["ring_errors"][0])
    s.pop("ring_thread")
    return {"queued": sum(s["ring_queued"]), "frames": len(s["ring_queued"])}


def _chan_ring_consume(self, path, frames):
    """Subscribes to ring "r" and checks `frames` frames in order."""
    ci = self.ci
    seen = 0
    with ci.Subscriber(path) as sub:
        ring = sub.attach_ring("r", timeout=30)
        fence, spins = ring.uses_fences, ring.spins
        for frame in ring:
            with frame:
                i = frame.notice["i"]
                if i != seen:
                    raise AssertionError(f"frame {seen} says i={i}")
                t = frame.as_torch("int32")
                if not bool((t == i).all().item()):
                    raise AssertionError(f"frame {i} (slot {frame.slot}) does not hold {i} everywhere")
                del t
            seen += 1
            if seen == frames:
                break
        ring.release()
    return {"frames": seen, "fence": fence, "spins": spins}


def register(worker_cls):
    """Adds the worker ops (``op_chan_*``) to gpu_interop's Worker."""
    register_ops(worker_cls, globals(), "_chan_")


class ChannelCases:
    """The channel cases: methods of gpu_interop's Runner."""

    def _chan_published(self, worker, mech, fill, nbytes=MIB):
        case = self.case_id()
        r = self.w(worker).call("chan_publish", case=case, mechanism=mech, nbytes=nbytes, fill=fill)
        if "skip" in r:
            raise Skip(f"{mech} is unavailable here: {r['skip']}")
        return case, r

    def chan_py2cli(self, mech):
        self.need("a", "torch")
        if not self.cli.path:
            raise Skip("no --cli given")
        v, w = 0x1A2B3C4D, 0x5E6F7081
        a = self.w("a")
        case, r = self._chan_published("a", mech, v)
        try:
            self.cli.run("attach", "--socket", r["path"], "--buffer", "x", "--expect-u32", hex(v), "--fill-u32", hex(w))
            res = a.call("chan_check", case=case, expect=w)
            a.call("chan_leases", case=case, want=0)
        finally:
            self._chan_close(a, case)
        return f"{r['mechanism']}: {res['words']} words checked and written by cuda-ipc attach"

    def chan_cli2py(self, mech):
        self.need("b", "torch")
        if not self.cli.path:
            raise Skip("no --cli given")
        v, w = 0x0C0FFEE0, 0x7E57AB1E
        path = os.path.join(tempfile.mkdtemp(prefix="cuda-ipc-serve-"), "s.sock")
        p = subprocess.Popen([self.cli.path, "serve", "--socket", path, "--size", str(MIB), "--fill-u32", hex(v),
                              "--mechanism", mech], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        try:
            q = queue.Queue()
            threading.Thread(target=lambda: q.put(p.stdout.readline()), daemon=True).start()
            line = q.get(timeout=120)
            if not line.strip():
                rc = p.wait(30)
                err = p.stderr.read().strip()[-300:]
                if rc == 3:
                    raise Skip(f"cuda-ipc serve says {mech} is unavailable here: {err}")
                raise CaseError(f"cuda-ipc serve exited {rc}: {err}")
            r = self.w("b").call("chan_attach_check", path=path, name="buf0", expect=v, fill=w)
            self.cli.run("attach", "--socket", path, "--buffer", "buf0", "--expect-u32", hex(w))
        except BaseException:
            p.kill()
            p.wait(30)
            raise
        _finish(p, "cuda-ipc serve")
        return f"{r['mechanism']}: {r['words']} words checked and written by a Python subscriber"

    def chan_updates(self, mech, stream=False):
        self.need("a", "torch")
        self.need("b", "torch")
        a, b = self.w("a"), self.w("b")
        case, r = self._chan_published("a", mech, 0)
        try:
            b.call("chan_subscribe", case=case, path=r["path"])
            for k in (1, 2, 3):
                u = a.call("chan_update", case=case, value=k, stream=stream)
                if stream and not u["queued"]:
                    raise CaseError(f"update {k}: update(stream=) waited for the GPU's write")
                g = u["version"]
                got = b.call("chan_wait", case=case, expect=k)["version"]
                if got != g:
                    raise CaseError(f"update {k}: the publisher says version {g}, the subscriber {got}")
            b.call("chan_drop", case=case, what="all")
            a.call("chan_leases", case=case, want=0)
        except BaseException:
            self._chan_drop(b, case)
            raise
        finally:
            self._chan_close(a, case)
        if stream:
            return (f"{r['mechanism']}: 3 updates written behind a GPU sleep on a side stream, each "
                    f"update(stream=) returned with the write queued, every word seen by the subscriber")
        return f"{r['mechanism']}: 3 updates seen in order"

    def chan_lease_follows_tensor(self):
        self.need("a", "torch")
        self.need("b", "torch")
        a, b = self.w("a"), self.w("b")
        case, r = self._chan_published("a", None, 5)
        try:
            b.call("chan_subscribe", case=case, path=r["path"], hold="tensor")
            a.call("chan_leases", case=case, want=1, timeout=0.5)
            b.call("chan_drop", case=case, what="tensor")
            a.call("chan_leases", case=case, want=0)
            b.call("chan_drop", case=case, what="all")
        except BaseException:
            self._chan_drop(b, case)
            raise
        finally:
            self._chan_close(a, case)
        return "the lease ended with the last tensor"

    def chan_kill9(self):
        self.need("a", "torch")
        self.need("b", "torch")
        a, b = self.w("a"), self.w("b")
        case, r = self._chan_published("a", None, 5)
        try:
            b.call("chan_subscribe", case=case, path=r["path"], hold="tensor")
            a.call("chan_leases", case=case, want=1, timeout=0.5)
            b.kill()  # SIGKILL, tensors and all
            a.call("chan_leases", case=case, want=0)
        finally:
            self._chan_close(a, case)
        return "kill -9 of the consumer ended its lease"

    def chan_ring(self, mech, fences_only=False, stream=False):
        self.need("a", "torch")
        self.need("b", "torch")
        a, b = self.w("a"), self.w("b")
        case = self.case_id()
        r = a.call("chan_ring_create", case=case, slots=3, slot_bytes=256 * 1024, mechanism=mech,
                   fences_only=fences_only)
        if "skip" in r:
            raise Skip(f"{mech} is unavailable here: {r['skip']}")
        try:
            # The subscriber attaches first (in its own thread of this
            # parent, since the worker answers when it has seen every frame).
            out = queue.Queue()

            def consume():
                try:
                    out.put(b.call("chan_ring_consume", path=r["path"], frames=50, timeout=120))
                except BaseException as e:  # noqa: BLE001 - handed to the case
                    out.put(e)

            th = threading.Thread(target=consume, daemon=True)
            th.start()
            # The producer waits for the subscriber before its first frame.
            a.call("chan_ring_produce", case=case, frames=50, stream=stream)
            th.join(150)
            res = out.get(timeout=1)
            if isinstance(res, BaseException):
                raise res
            joined = a.call("chan_ring_join", case=case)
        finally:
            self._chan_close(a, case)
        if fences_only and res.get("fence") is not True:
            raise AssertionError(f"the reader of a fences-only ring did not wait on its fence: {res}")
        if not isinstance(res.get("spins"), bool):
            raise AssertionError(f"Ring.spins is not a bool: {res}")
        if stream:
            # Most publishes return with their frame's write still queued
            # (one whose slot was just freed may find the GPU done).
            if joined["frames"] != 50 or joined["queued"] < 40:
                raise AssertionError(f"publish(stream=) waited for the GPU's writes: {joined}")
            return (f"{res['frames']} frames written behind a GPU sleep on a side stream, "
                    f"{joined['queued']} of them still queued when publish(stream=) returned, every "
                    f"word seen by the subscriber")
        return f"{res['frames']} frames through a ring of 3 slots" + (
            ", fences only (the reader waited on the fence)" if fences_only else "") + (
            ", the reader spinning" if res["spins"] else ", the reader sleeping between frames")

    def _chan_close(self, worker, case):
        try:
            worker.call("chan_close", case=case, timeout=60)
        except Exception:
            pass

    def _chan_drop(self, worker, case):
        try:
            worker.call("chan_drop", case=case, what="all", timeout=60)
        except Exception:
            pass
