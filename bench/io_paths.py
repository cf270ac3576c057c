#!/usr/bin/env python3
"""The host paths a checkpoint can take to and from the device, measured
against each other on one machine (issue 57, items 2 and 3): which one
the loader and the saver should use. Driver API through ctypes, no
PyTorch; one file of SIZE bytes in each of DIRS (page cache warmed).
JSON lines:

  {"kind": "floor", "way": "h2d"|"d2h", "gb_per_s": X}
  {"kind": "load", "path": P, "dir": D, "threads": T, "piece_mib": M, "gb_per_s": X, ...}
  {"kind": "save", "path": P, "dir": D, "threads": T, "piece_mib": M, "gb_per_s": X, ...}
  {"kind": "error", "what": ..., "message": ...}

Load paths (file -> device):
  pread: T threads, each with two page-locked buffers of M MiB and a
      stream; `preadv` into one while the other copies (the loader today).
  registered: the file mapped read-only (`mmap`), each thread registers
      its windows of M MiB (`cuMemHostRegister`, read-only), copies them
      straight from the page cache, and unregisters a window once its copy
      has finished; no CPU copy. `register_s` sums the threads' time in
      `cuMemHostRegister`.
  pageable: the same mapping copied unregistered (`cuMemcpyHtoDAsync`
      stages it in the driver).
  readonly: `pread` alone (no device): the host's copy ceiling.
Save paths (device -> file):
  pwrite: T threads, two page-locked buffers each: D2H into one while the
      other is written (`pwrite`) (the saver today).
  mmap: D2H into page-locked buffers, copied into the file's shared
      mapping (page faults in parallel; `pwrite` holds the inode's lock).
  registered: the file sized (`ftruncate`), mapped shared read-write, each
      thread registers its windows and the device writes the file's pages
      itself (`cuMemcpyDtoHAsync`); then `fsync`.
Every load is checked against the file (a sample of words per window)
and every save read back the same way.

Usage: io_paths.py [--size 4GiB] [--dirs /dev/shm,/tmp] [--reps 2]
"""

import argparse
import ctypes
import json
import mmap
import os
import sys
import threading
import time

MIB = 1 << 20
READ_ONLY = 0x08
PROT_READ, PROT_WRITE, MAP_SHARED = 1, 2, 1


def emit(rec):
    print(json.dumps(rec), flush=True)


class Cuda:
    def __init__(self, device):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.mmap.restype = ctypes.c_void_p
        self.libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                   ctypes.c_int, ctypes.c_int, ctypes.c_long]
        self.libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.check("cuInit", 0)
        dev = ctypes.c_int()
        self.check("cuDeviceGet", ctypes.byref(dev), device)
        self.ctx = ctypes.c_void_p()
        self.check("cuDevicePrimaryCtxRetain", ctypes.byref(self.ctx), dev)
        self.bind()

    def check(self, name, *args):
        fn = getattr(self.lib, name)
        r = fn(*args)
        if r != 0:
            raise RuntimeError("%s failed with CUresult %d" % (name, r))

    def bind(self):
        self.check("cuCtxSetCurrent", self.ctx)

    def alloc(self, n):
        p = ctypes.c_uint64()
        self.check("cuMemAlloc_v2", ctypes.byref(p), ctypes.c_size_t(n))
        return p.value

    def free(self, p):
        self.check("cuMemFree_v2", ctypes.c_uint64(p))

    def host_alloc(self, n):
        p = ctypes.c_void_p()
        self.check("cuMemHostAlloc", ctypes.byref(p), ctypes.c_size_t(n), 0)
        return p.value

    def host_free(self, p):
        self.check("cuMemFreeHost", ctypes.c_void_p(p))

    def stream(self):
        s = ctypes.c_void_p()
        self.check("cuStreamCreate", ctypes.byref(s), 1)
        return s

    def event(self):
        e = ctypes.c_void_p()
        self.check("cuEventCreate", ctypes.byref(e), 2)  # CU_EVENT_DISABLE_TIMING
        return e

    def h2d(self, dst, src, n, s):
        self.check("cuMemcpyHtoDAsync_v2", ctypes.c_uint64(dst), ctypes.c_void_p(src),
                   ctypes.c_size_t(n), s)

    def d2h(self, dst, src, n, s):
        self.check("cuMemcpyDtoHAsync_v2", ctypes.c_void_p(dst), ctypes.c_uint64(src),
                   ctypes.c_size_t(n), s)

    def register(self, p, n, flags):
        self.check("cuMemHostRegister_v2", ctypes.c_void_p(p), ctypes.c_size_t(n), flags)

    def unregister(self, p):
        self.check("cuMemHostUnregister", ctypes.c_void_p(p))

    def sync(self, s):
        self.check("cuStreamSynchronize", s)

    def record(self, e, s):
        self.check("cuEventRecord", e, s)

    def wait(self, e):
        self.check("cuEventSynchronize", e)

    def mmap(self, fd, n, prot):
        p = self.libc.mmap(None, n, prot, MAP_SHARED, fd, 0)
        if p in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        return p


def run_threads(cuda, threads, work):
    """Runs ``work(i)`` on ``threads`` threads (each bound to the context);
    returns (seconds, [results])."""
    out, errs = [None] * threads, []

    def body(i):
        try:
            cuda.bind()
            out[i] = work(i)
        except Exception as e:  # noqa: BLE001 - reported below
            errs.append(e)

    ts = [threading.Thread(target=body, args=(i,)) for i in range(threads)]
    t0 = time.monotonic()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    took = time.monotonic() - t0
    if errs:
        raise errs[0]
    return took, out


def floor(cuda, way, reps):
    n = 1 << 30
    host, dev, s = cuda.host_alloc(n), cuda.alloc(n), cuda.stream()
    best = 0.0
    for _ in range(reps + 1):
        t0 = time.monotonic()
        (cuda.h2d(dev, host, n, s) if way == "h2d" else cuda.d2h(host, dev, n, s))
        cuda.sync(s)
        best = max(best, n / (time.monotonic() - t0) / 1e9)
    cuda.host_free(host)
    cuda.free(dev)
    emit({"kind": "floor", "way": way, "gb_per_s": round(best, 2)})
    return best


def windows(size, piece, threads, i):
    return [(off, min(piece, size - off)) for off in range(i * piece, size, piece * threads)]


def pread_load(cuda, fd, size, dev, threads, piece, device=True):
    def setup(_i):
        return [cuda.host_alloc(piece), cuda.host_alloc(piece)], [cuda.event(), cuda.event()], cuda.stream()

    _, kit = run_threads(cuda, threads, setup)

    def work(i):
        bufs, evs, s = kit[i]
        used = [False, False]
        for k, (off, n) in enumerate(windows(size, piece, threads, i)):
            slot = k % 2
            if used[slot]:
                cuda.wait(evs[slot])
            view = (ctypes.c_char * n).from_address(bufs[slot])
            got = os.preadv(fd, [memoryview(view).cast("B")], off)
            if got != n:
                raise OSError("short read")
            if device:
                cuda.h2d(dev + off, bufs[slot], n, s)
                cuda.record(evs[slot], s)
                used[slot] = True
        cuda.sync(s)
        return 0.0

    took, _ = run_threads(cuda, threads, work)
    for bufs, _, _ in kit:
        for b in bufs:
            cuda.host_free(b)
    return took, {}


def registered_windows(cuda, base, size, threads, piece, flags, copy):
    """T threads, each registering its windows of the mapping at ``base``
    (``flags``; ``None``: not registered), queuing ``copy(off, n,
    stream)`` and unregistering a window once its copy has passed;
    returns (seconds, seconds in ``cuMemHostRegister`` summed)."""
    def work(i):
        s = cuda.stream()
        evs = [cuda.event(), cuda.event()]
        pending = [None, None]
        reg_s = 0.0
        for k, (off, n) in enumerate(windows(size, piece, threads, i)):
            slot = k % 2
            if pending[slot] is not None:
                cuda.wait(evs[slot])
                cuda.unregister(pending[slot])
                pending[slot] = None
            if flags is not None:
                t0 = time.monotonic()
                cuda.register(base + off, n, flags)
                reg_s += time.monotonic() - t0
                pending[slot] = base + off
            copy(off, n, s)
            cuda.record(evs[slot], s)
        cuda.sync(s)
        for p in pending:
            if p is not None:
                cuda.unregister(p)
        return reg_s

    took, regs = run_threads(cuda, threads, work)
    return took, round(sum(regs), 4)


def registered_load(cuda, base, size, dev, threads, piece, register=True):
    took, reg_s = registered_windows(cuda, base, size, threads, piece, READ_ONLY if register else None,
                                     lambda off, n, s: cuda.h2d(dev + off, base + off, n, s))
    return took, {"register_s": reg_s}


def staged_d2h(cuda, dev, size, threads, piece, sink):
    """T threads, each copying its windows from the device into two
    page-locked buffers in turn (the next copy runs while ``sink(off,
    ptr, n)`` takes the last one); returns the seconds."""
    def work(i):
        bufs = [cuda.host_alloc(piece), cuda.host_alloc(piece)]
        evs, s = [cuda.event(), cuda.event()], cuda.stream()
        wins = windows(size, piece, threads, i)

        def start(k):
            off, n = wins[k]
            cuda.d2h(bufs[k % 2], dev + off, n, s)
            cuda.record(evs[k % 2], s)
        if wins:
            start(0)
        for k, (off, n) in enumerate(wins):
            if k + 1 < len(wins):
                start(k + 1)
            cuda.wait(evs[k % 2])
            sink(off, bufs[k % 2], n)
        cuda.sync(s)
        for b in bufs:
            cuda.host_free(b)
        return 0.0

    took, _ = run_threads(cuda, threads, work)
    return took


def flushed(fd, t_all, copy_s):
    """fsyncs ``fd`` and closes it: (seconds in all, parts)."""
    t0 = time.monotonic()
    os.fsync(fd)
    flush_s = time.monotonic() - t0
    os.close(fd)
    return time.monotonic() - t_all, {"copy_s": round(copy_s, 4), "flush_s": round(flush_s, 4)}


def pwrite_save(cuda, path, size, dev, threads, piece):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    t_all = time.monotonic()
    os.ftruncate(fd, size)

    def sink(off, ptr, n):
        os.pwrite(fd, memoryview((ctypes.c_char * n).from_address(ptr)).cast("B"), off)

    return flushed(fd, t_all, staged_d2h(cuda, dev, size, threads, piece, sink))


def mmap_save(cuda, path, size, dev, threads, piece):
    """D2H into page-locked staging, then copied into the file's shared
    mapping: page faults in parallel, no inode lock (pwrite holds it)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    t_all = time.monotonic()
    os.ftruncate(fd, size)
    base = cuda.mmap(fd, size, PROT_READ | PROT_WRITE)
    try:
        copy_s = staged_d2h(cuda, dev, size, threads, piece,
                            lambda off, ptr, n: ctypes.memmove(base + off, ptr, n))
    finally:
        cuda.libc.munmap(ctypes.c_void_p(base), size)
    return flushed(fd, t_all, copy_s)


def registered_save(cuda, path, size, dev, threads, piece):
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    t_all = time.monotonic()
    os.ftruncate(fd, size)
    base = cuda.mmap(fd, size, PROT_READ | PROT_WRITE)
    try:
        copy_s, reg_s = registered_windows(cuda, base, size, threads, piece, 0,
                                           lambda off, n, s: cuda.d2h(base + off, dev + off, n, s))
    finally:
        cuda.libc.munmap(ctypes.c_void_p(base), size)
    took, parts = flushed(fd, t_all, copy_s)
    parts["register_s"] = reg_s
    return took, parts


def sample_offsets(size):
    step = max(4096, size // 4096) // 8 * 8
    return list(range(0, size - 8, step))


def check_device(cuda, dev, size, path):
    """A sample of 8-byte words of the device buffer equals the file's."""
    want = open(path, "rb")
    host = cuda.host_alloc(8)
    s = cuda.stream()
    for off in sample_offsets(size):
        cuda.d2h(host, dev + off, 8, s)
        cuda.sync(s)
        got = ctypes.string_at(host, 8)
        want.seek(off)
        if got != want.read(8):
            raise RuntimeError("byte mismatch at offset %d" % off)
    cuda.host_free(host)
    want.close()


def make_file(path, size):
    """SIZE bytes whose every 8-byte word is its own offset, xored."""
    try:
        import numpy

        def words(a, b):
            return numpy.arange(a, b, dtype=numpy.uint64).tobytes()
    except ImportError:  # slower, the same bytes
        import array

        def words(a, b):
            return array.array("Q", range(a, b)).tobytes()

    chunk = 64 * MIB
    with open(path, "wb") as f:
        for off in range(0, size, chunk):
            n = min(chunk, size - off)
            f.write(words(off // 8, (off + n) // 8))
    with open(path, "rb") as f:  # warm the page cache
        while f.read(chunk):
            pass


def parse_size(text):
    units = {"GiB": 1 << 30, "MiB": MIB}
    for u, m in units.items():
        if text.endswith(u):
            return int(float(text[: -len(u)]) * m)
    return int(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="4GiB")
    ap.add_argument("--dirs", default="/dev/shm,/tmp")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--loads", default="readonly:4:4,readonly:8:4,readonly:16:4,pread:8:2,pread:16:4,"
                    "registered:8:256,registered:16:256")
    ap.add_argument("--saves", default="pwrite:4:8,mmap:4:8,mmap:8:8,mmap:16:4,registered:16:64")
    args = ap.parse_args()
    size = parse_size(args.size)
    cuda = Cuda(args.device)
    floor(cuda, "h2d", 3)
    floor(cuda, "d2h", 3)
    dev = cuda.alloc(size)
    for d in [x for x in args.dirs.split(",") if x]:
        path = os.path.join(d, "cuda-ipc-io-paths.bin")
        try:
            make_file(path, size)
        except OSError as e:
            emit({"kind": "error", "what": "write %s" % path, "message": str(e)})
            continue
        fd = os.open(path, os.O_RDONLY)
        base = cuda.mmap(fd, size, PROT_READ)
        for spec in args.loads.split(","):
            name, t, m = spec.split(":")
            t, piece = int(t), int(m) * MIB
            for rep in range(args.reps):
                try:
                    if name in ("pread", "readonly"):
                        took, extra = pread_load(cuda, fd, size, dev, t, piece, name == "pread")
                    else:
                        took, extra = registered_load(cuda, base, size, dev, t, piece, name == "registered")
                    if name != "readonly":
                        check_device(cuda, dev, size, path)
                    emit(dict(kind="load", path=name, dir=d, threads=t, piece_mib=int(m), rep=rep,
                              seconds=round(took, 4), gb_per_s=round(size / took / 1e9, 2), **extra))
                except Exception as e:  # noqa: BLE001
                    emit({"kind": "error", "what": "load %s in %s" % (spec, d), "message": str(e)})
                    break
        # The saves write what the device holds: the file, whatever loads ran.
        pread_load(cuda, fd, size, dev, 8, 4 * MIB)
        check_device(cuda, dev, size, path)
        cuda.libc.munmap(ctypes.c_void_p(base), size)
        os.close(fd)
        out = os.path.join(d, "cuda-ipc-io-paths.out")
        for spec in args.saves.split(","):
            name, t, m = spec.split(":")
            t, piece = int(t), int(m) * MIB
            for rep in range(args.reps):
                try:
                    if os.path.exists(out):
                        os.unlink(out)
                    fn = {"pwrite": pwrite_save, "mmap": mmap_save, "registered": registered_save}[name]
                    took, extra = fn(cuda, out, size, dev, t, piece)
                    check_file(cuda, out, path)
                    emit(dict(kind="save", path=name, dir=d, threads=t, piece_mib=int(m), rep=rep,
                              seconds=round(took, 4), gb_per_s=round(size / took / 1e9, 2), **extra))
                except Exception as e:  # noqa: BLE001
                    emit({"kind": "error", "what": "save %s in %s" % (spec, d), "message": str(e)})
                    break
        for p in (path, out):
            if os.path.exists(p):
                os.unlink(p)
    return 0


def check_file(_cuda, got_path, want_path):
    size = os.path.getsize(want_path)
    if os.path.getsize(got_path) != size:
        raise RuntimeError("saved file has the wrong size")
    with open(got_path, "rb") as g, open(want_path, "rb") as w:
        for off in sample_offsets(size):
            g.seek(off)
            w.seek(off)
            if g.read(8) != w.read(8):
                raise RuntimeError("saved byte mismatch at offset %d" % off)


if __name__ == "__main__":
    sys.exit(main())
