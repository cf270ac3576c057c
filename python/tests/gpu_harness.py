"""The harness of gpu_interop.py's cases, shared by the modules that hold
them (gpu_mechanisms.py, gpu_channel.py, gpu_sets.py, ...). Not a script: a
GPU host runs gpu_interop.py.

- The worker side: :class:`WorkerBase`, how a worker process starts (numpy,
  cuda_ipc, and torch and CuPy when importable), its helpers and the ops
  ``hello`` and ``drop``; gpu_interop.py's ``Worker`` adds the ops of every
  module (``register_ops``). ``signed32``, ``_has`` and ``_compare`` for
  the ops.
- The parent side: :class:`WorkerProc` (a worker process: gpu_interop.py
  run with ``--worker NAME``, restarted when it dies), :class:`Cli` and
  :class:`CliExport` (the ``cuda-ipc`` command), ``_readline`` and
  ``_finish`` for other children, and what a case raises: ``CaseError``,
  ``Skip``.
"""

import json
import os
import queue
import subprocess
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.dirname(HERE)
# The entry point: worker processes run it with --worker NAME.
SCRIPT = os.path.join(HERE, "gpu_interop.py")

MIB = 1 << 20


def signed32(v):
    return v - (1 << 32) if v >= 1 << 31 else v


def register_ops(worker_cls, functions, prefix):
    """Adds each function of `functions` (a module's globals()) whose name
    starts with `prefix` to `worker_cls` as an op: ``_chan_check`` becomes
    ``op_chan_check``."""
    for name, fn in list(functions.items()):
        if name.startswith(prefix):
            setattr(worker_cls, "op_" + name[1:], fn)


# =============================================================================
# The worker side.
# =============================================================================


class WorkerBase:
    """What every worker starts with: `state` (by case), `np`, `ci`
    (cuda_ipc), `torch` and `cupy` (None when not importable)."""

    def __init__(self, name):
        self.name = name
        self.state = {}
        import numpy
        import cuda_ipc

        self.np = numpy
        self.ci = cuda_ipc
        try:
            import torch

            self.torch = torch
            torch.zeros(1, device="cuda")  # start CUDA once
        except ImportError:
            self.torch = None
        try:
            import cupy

            self.cupy = cupy
            cupy.zeros(1)
        except ImportError:
            self.cupy = None

    # --- helpers --------------------------------------------------------------

    def _sync(self):
        if self.torch is not None:
            self.torch.cuda.synchronize()
        if self.cupy is not None:
            self.cupy.cuda.Device().synchronize()

    def _mem_free(self):
        # Releases run on the library's thread: let them finish first.
        self.ci.settle(10)
        return self.ci.mem_info(0)[0]

    def _empty_caches(self):
        import gc

        gc.collect()
        self.ci.settle(10)
        self._sync()
        if self.torch is not None:
            self.torch.cuda.empty_cache()
        if self.cupy is not None:
            self.cupy.get_default_memory_pool().free_all_blocks()

    def _torch_dtype(self, name):
        return getattr(self.torch, name)

    def _allocated(self, framework):
        if framework == "torch":
            return self.torch.cuda.memory_allocated()
        return self.cupy.get_default_memory_pool().used_bytes()

    def _bytes_of(self, x, framework):
        """The bytes of a contiguous base (a copy on the host)."""
        if framework == "torch":
            return x.reshape(-1).view(self.torch.uint8).cpu().numpy()
        return self.cupy.asnumpy(x.reshape(-1).view(self.cupy.uint8))

    # --- ops ------------------------------------------------------------------

    def op_hello(self):
        return {
            "pid": os.getpid(),
            "torch": getattr(self.torch, "__version__", None),
            "cupy": getattr(self.cupy, "__version__", None),
            "ml_dtypes": _has("ml_dtypes"),
            "device": self.ci.device_uuid(0),
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        }

    def op_drop(self, case):
        self.state.pop(case, None)
        self._empty_caches()
        return {}


def _has(module):
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def _compare(np, got, expected, what):
    if got.shape != expected.shape:
        raise AssertionError(f"{what} has shape {got.shape}, expected {expected.shape}")
    got, expected = np.atleast_1d(got), np.atleast_1d(expected)
    if got.dtype.kind == "f":
        bad = np.argwhere(~((got == expected) | (np.isnan(got) & np.isnan(expected))))
    else:
        bad = np.argwhere(got != expected)
    if bad.size:
        i = tuple(int(x) for x in bad[0])
        raise AssertionError(f"{what}{list(i)} is {got[i]!r}, expected {expected[i]!r} ({len(bad)} elements differ)")
    return {"elements": int(got.size)}


# =============================================================================
# The parent side: worker processes, the cuda-ipc command, other children.
# =============================================================================


def _package_parent():
    """The folder holding the cuda_ipc package this script imports (an
    installed wheel's, or this checkout's python/), for the workers."""
    import cuda_ipc

    return os.path.dirname(os.path.dirname(os.path.abspath(cuda_ipc.__file__)))


class CaseError(Exception):
    pass


class Skip(Exception):
    pass


class WorkerProc:
    def __init__(self, name, log_dir, env=None):
        self.name, self.log_dir, self.env = name, log_dir, env or {}
        self.p = None
        self.info = None
        self.starts = 0
        self.broken = None  # why the worker cannot start, once known

    def start(self):
        env = dict(os.environ)
        env.update(self.env)
        env["PYTHONPATH"] = _package_parent() + os.pathsep + env.get("PYTHONPATH", "")
        self.starts += 1
        self.log_path = os.path.join(self.log_dir, f"worker-{self.name}-{self.starts}.log")
        self.log = open(self.log_path, "w")
        self.p = subprocess.Popen([sys.executable, SCRIPT, "--worker", self.name],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                  text=True, env=env)
        self.q = queue.Queue()
        p, q = self.p, self.q

        def pump():
            for line in p.stdout:
                q.put(line)
            q.put(None)

        threading.Thread(target=pump, daemon=True).start()
        try:
            self.info = self.call("hello", timeout=300)
        except CaseError as e:
            self.kill()
            self.broken = str(e)
            raise

    def alive(self):
        return self.p is not None and self.p.poll() is None

    def _tail(self):
        try:
            self.log.flush()
            with open(self.log_path) as f:
                return " | ".join(f.read().strip().splitlines()[-6:])[-800:]
        except OSError:
            return ""

    def kill(self):
        if self.p is not None:
            try:
                self.p.kill()
                self.p.wait(10)
            except Exception:
                pass
        self.p = None

    def call(self, op, timeout=120, **args):
        if not self.alive() and op != "hello":
            if self.broken:
                raise CaseError(f"worker {self.name} could not start: {self.broken}")
            self.start()
        try:
            self.p.stdin.write(json.dumps({"op": op, "args": args}) + "\n")
            self.p.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            self.kill()
            raise CaseError(f"worker {self.name} is gone ({e}): {self._tail()}")
        try:
            line = self.q.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise CaseError(f"worker {self.name} did not answer {op} within {timeout} s (killed)")
        if line is None:
            rc = self.p.wait()
            self.p = None
            raise CaseError(f"worker {self.name} died (exit {rc}) during {op}: {self._tail()}")
        resp = json.loads(line)
        if not resp["ok"]:
            if os.environ.get("GPU_INTEROP_TRACE"):
                sys.stderr.write(resp.get("trace", ""))
            raise CaseError(resp["error"])
        return resp["result"]

    def stop(self):
        if self.alive():
            try:
                self.p.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.p.stdin.close()
                self.p.wait(30)
            except Exception:
                self.kill()


class Cli:
    def __init__(self, path):
        self.path = path

    def run(self, *args, expect=0, timeout=120):
        if not self.path:
            raise Skip("no --cli given")
        r = subprocess.run([self.path, *args], capture_output=True, text=True, timeout=timeout)
        if r.returncode != expect:
            raise CaseError(f"cuda-ipc {args[0]} exited {r.returncode} (expected {expect}): "
                            f"{(r.stderr.strip() or r.stdout.strip())[-500:]}")
        return r

    def export(self, size, fill, offset=0, mechanism="legacy"):
        return CliExport(self, size, fill, offset, mechanism)


class CliExport:
    """`cuda-ipc export` running in the background; stdin EOF ends it."""

    def __init__(self, cli, size, fill, offset, mechanism):
        if not cli.path:
            raise Skip("no --cli given")
        args = [cli.path, "export", "--size", str(size), "--fill-u32", hex(fill), "--mechanism", mechanism]
        if offset:
            args += ["--offset", str(offset)]
        self.p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        q = queue.Queue()
        threading.Thread(target=lambda: q.put(self.p.stdout.readline()), daemon=True).start()
        try:
            line = q.get(timeout=120)
        except queue.Empty:
            self.p.kill()
            raise CaseError("cuda-ipc export printed no descriptor within 120 s")
        if not line.strip():
            rc = self.p.wait(30)
            err = self.p.stderr.read()
            if rc == 3:
                raise Skip(f"cuda-ipc export says {mechanism} is unavailable here: {err.strip()[-300:]}")
            raise CaseError(f"cuda-ipc export exited {rc}: {err.strip()[-500:]}")
        self.descriptor = json.loads(line)

    def finish(self):
        """Closes stdin and expects exit 0."""
        try:
            self.p.stdin.close()
        except OSError:
            pass
        try:
            rc = self.p.wait(60)
        except subprocess.TimeoutExpired:
            self.p.kill()
            raise CaseError("cuda-ipc export did not exit within 60 s of stdin closing")
        if rc != 0:
            raise CaseError(f"cuda-ipc export exited {rc}: {self.p.stderr.read().strip()[-500:]}")

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(30)


def _readline(p, timeout, what):
    """One line of a child's stdout, or CaseError after `timeout` seconds."""
    q = queue.Queue()
    threading.Thread(target=lambda: q.put(p.stdout.readline()), daemon=True).start()
    try:
        line = q.get(timeout=timeout)
    except queue.Empty:
        raise CaseError(f"{what} printed nothing within {timeout} s")
    if not line.strip():
        rc = p.wait(30)
        raise CaseError(f"{what} exited {rc}: {p.stderr.read().strip()[-500:]}")
    return line.strip()


def _finish(p, what):
    """Closes a child's stdin and expects exit 0."""
    try:
        p.stdin.close()
    except OSError:
        pass
    try:
        rc = p.wait(60)
    except subprocess.TimeoutExpired:
        p.kill()
        raise CaseError(f"{what} did not exit within 60 s of stdin closing")
    if rc != 0:
        raise CaseError(f"{what} exited {rc}: {p.stderr.read().strip()[-500:]}")
