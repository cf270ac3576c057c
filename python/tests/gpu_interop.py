#!/usr/bin/env python3
"""Cross-language GPU interop checks for cuda_ipc, for a GPU host.

    python3 python/tests/gpu_interop.py --cli PATH_TO_cuda-ipc [--only TEXT]
                                        [--examples DIR] [--record-dir DIR]
                                        [--log-dir DIR] [--list]

Directions covered, each case independent (one failure hides nothing else):

- ``py2cli`` (``gpu_mechanisms.py``): PyTorch (and CuPy) export tensors of
  every dtype both share, at non-zero offsets, 1-D to 4-D, transposed and
  strided; ``cuda-ipc open --expect-u32 V --fill-u32 W`` maps each in a
  separate process, checks every word and writes; the exporter then checks,
  byte by byte, that exactly the exported range changed, and that its memory
  is released (``torch.cuda.memory_allocated`` / the CuPy pool) once it
  closes the export.
- ``cli2py`` (``gpu_mechanisms.py``): ``cuda-ipc export --mechanism
  legacy|vmm|pool`` (at an offset); a Python process maps it with
  ``cuda_ipc.open(...).as_torch()`` and ``.as_cupy()``, checks every word,
  writes; ``cuda-ipc open --expect-u32`` verifies the write.
- ``py2py`` (``gpu_mechanisms.py``): PyTorch exports, CuPy (and PyTorch) in
  another process map and compare element by element with values computed
  independently, write; the exporter checks every element inside and outside
  the view. And CuPy exports to PyTorch.
- ``expandable`` (``gpu_mechanisms.py``): PyTorch with
  ``expandable_segments:True`` (storage handle ``'e'``): one segment gives a
  vmm descriptor (checked with the CLI), several give a PyTorch share record
  (mapped by ``cuda_ipc.open``).
- ``memory`` (``gpu_mechanisms.py``): a 256 MiB tensor and array: device
  free memory (``cuMemGetInfo``) comes back after the consumer is done and
  the exporter closes.
- ``example`` (``gpu_examples.py``): the Rust examples ``torch_consumer``
  (maps a PyTorch export, transforms it, answers with an event) and
  ``torch_producer`` (exports to PyTorch, waits on PyTorch's event, checks),
  when ``--examples`` (default: ``examples/`` next to ``--cli``) has them.
- ``errors`` (``gpu_mechanisms.py``): opening memory whose exporter exited,
  one's own handle, or a bogus handle raises ``CudaIpcError``, never
  crashes.
- ``channel`` (``gpu_channel.py``): the exchange channel from Python, with
  every mechanism: a Python ``Publisher`` attached by ``cuda-ipc attach``
  (checks and writes every word), ``cuda-ipc serve`` attached by a Python
  ``Subscriber``, Python to Python with updates (``wait_update``) and a
  ring; a lease that follows the tensors made from an attachment, and
  ``kill -9`` of a consumer holding tensors ending its leases.
- ``sets`` (``gpu_sets.py``): state dicts over arena sets: 1,000 tensors of
  mixed sizes and dtypes (0-d, empty and transposed ones too) published by
  one Python process and checked value by value in another, updates in place
  and copied in, ``kill -9`` of a consumer holding the tensors, ``cuda-ipc
  serve --set`` attached from Python, a Python set attached by ``cuda-ipc
  attach --set``, and the example ``examples/python/weight_sync.py``.
- ``dtypes`` (``gpu_dtypes.py``): a state dict of the float8 types,
  ``float4_e2m1fn_x2``, complex64/128 and bfloat16 between two processes,
  every byte compared, an update seen, a complex32 tensor refused before
  anything is allocated; CuPy reading the fp8/fp4 entries as their bits.
- ``torch C API`` (``gpu_torch_c.py``): state dicts through PyTorch's DLPack
  C exchange API and through the Python path (workers with
  ``CUDA_IPC_TORCH_C_API=0``), every pairing of the two: mixed dtypes, tied,
  0-d, empty and non-contiguous tensors, updates, a kept tensor's lease.
- ``alloc`` (``gpu_alloc.py``): tensors born shareable
  (``cuda_ipc.torch.shareable``): a model built in a publisher's arena and
  published with no copy and no warning, checked byte for byte by another
  process; training steps in place seen after ``update_state_dict``; freed
  tensors giving their segments back to the arena; a closed publisher's
  tensors staying valid; an allocation larger than the GPU raising torch's
  ``OutOfMemoryError``.

This script is the one to run. Each area's module (named above, next to
it; ``record``, for ``--record-dir``, is in ``gpu_mechanisms.py``) holds
the area's worker ops and ``Runner`` methods; this script assembles the
``Worker`` and the ``Runner``, lists every case in order
(``Runner.cases``) and runs them. ``gpu_harness.py`` holds what the
modules share: the worker's base, the worker processes, the ``cuda-ipc``
command.

GPU work runs in worker processes (the script re-runs itself with
``--worker``); a worker that crashes or hangs fails only the case it was
running and is restarted. The last line is ``N passed, M failed`` (skips
are listed but not counted as failures); the exit status is 1 if anything
failed. On a machine without the driver, a GPU, PyTorch or the cuda_ipc
package, it prints one line saying which and exits 77 (skipped) before
any case runs.
"""

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

# The modules of the cases lie next to this script (its directory is sys.path[0]).
from gpu_harness import MIB, PYTHON_DIR, CaseError, Cli, Skip, WorkerBase, WorkerProc

try:
    import cuda_ipc._core  # an installed build (a wheel on PYTHONPATH, pip install ./python)
except ImportError:
    # This checkout, after `maturin develop` put the extension module in it.
    if PYTHON_DIR not in sys.path:
        sys.path.insert(0, PYTHON_DIR)
    sys.modules.pop("cuda_ipc", None)

import gpu_alloc  # noqa: E402
import gpu_channel  # noqa: E402
import gpu_dtypes  # noqa: E402
import gpu_examples  # noqa: E402
import gpu_mechanisms  # noqa: E402
import gpu_sets  # noqa: E402
import gpu_torch_c  # noqa: E402
from gpu_mechanisms import CLI_LAYOUTS, CUPY_DTYPES, LAYOUTS, TORCH_DTYPES  # noqa: E402


# =============================================================================
# The worker: runs GPU work on request, one JSON request per stdin line.
# =============================================================================


class Worker(gpu_mechanisms.MechanismOps, gpu_examples.ExampleOps, WorkerBase):
    """The ops of a worker process (this script run with ``--worker NAME``):
    gpu_harness.WorkerBase starts it (numpy, cuda_ipc, torch and CuPy when
    importable) and has its helpers; the cases' modules add theirs."""


# The channel (op_chan_*): gpu_channel.py.
gpu_channel.register(Worker)
# State dicts over arena sets (op_sets_*): gpu_sets.py.
gpu_sets.register(Worker)
# Every dtype a checkpoint carries (fp8, fp4, complex): gpu_dtypes.py.
gpu_dtypes.register(Worker)
# State dicts through PyTorch's DLPack C exchange API: gpu_torch_c.py.
gpu_torch_c.register(Worker)
# Tensors born shareable (op_alloc_*): gpu_alloc.py.
gpu_alloc.register(Worker)


def worker_main(name):
    # The protocol owns the real stdout; everything else printed goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        w = Worker(name)
        start_error = None
    except Exception:
        w, start_error = None, traceback.format_exc()
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "quit":
            break
        try:
            if w is None:
                raise RuntimeError(f"the worker could not start:\n{start_error}")
            result = getattr(w, "op_" + req["op"])(**req.get("args", {}))
            resp = {"ok": True, "result": result}
        except Exception as e:
            resp = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        proto.write(json.dumps(resp) + "\n")
    return 0


# =============================================================================
# The parent: cases, workers, the CLI.
# =============================================================================


class Runner(gpu_mechanisms.MechanismCases, gpu_channel.ChannelCases, gpu_sets.SetsCases, gpu_alloc.AllocCases,
             gpu_examples.ExampleCases):
    """The cases (their methods come from the modules of gpu_interop's
    layout; :meth:`cases` lists them all, in order) and their run."""

    def __init__(self, args):
        self.args = args
        self.cli = Cli(args.cli)
        self.log_dir = args.log_dir or os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu-interop-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.workers = {
            # Producer and consumer are different processes: a process cannot
            # open its own legacy handles.
            "a": WorkerProc("a", self.log_dir),
            "b": WorkerProc("b", self.log_dir),
            "e": WorkerProc("e", self.log_dir, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
        }
        for name, env in gpu_torch_c.WORKERS.items():
            self.workers[name] = WorkerProc(name, self.log_dir, env)
        self.results = []
        self.counter = 0

    def w(self, name):
        return self.workers[name]

    def need(self, worker, module):
        w = self.w(worker)
        if w.broken:
            raise CaseError(f"worker {worker} could not start: {w.broken}")
        if not w.alive():
            try:
                w.start()
            except CaseError as e:
                raise CaseError(f"worker {worker} could not start: {e}")
        if not self.w(worker).info.get(module):
            raise Skip(f"{module} is not importable in worker {worker}")

    def case_id(self):
        self.counter += 1
        return f"c{self.counter}"

    def _drop(self, worker, case):
        try:
            worker.call("drop", case=case, timeout=60)
        except Exception:
            pass

    # --- the list ---------------------------------------------------------------

    def cases(self):
        out = []
        for dtype in TORCH_DTYPES:
            for layout in CLI_LAYOUTS:
                out.append((f"py2cli torch {dtype} {layout}", lambda d=dtype, l=layout: self.py2cli("torch", d, l)))
        for dtype in CUPY_DTYPES:
            for layout in ("slice1d", "transpose2d", "strided2d", "slice4d"):
                out.append((f"py2cli cupy {dtype} {layout}", lambda d=dtype, l=layout: self.py2cli("cupy", d, l)))
        for mech in ("legacy", "vmm", "pool"):
            for fw in ("torch", "cupy"):
                out.append((f"cli2py {mech} -> {fw} at offset 1MiB+4KiB",
                            lambda m=mech, f=fw: self.cli2py(f, m, MIB + 4096, 3 * MIB)))
            out.append((f"cli2py {mech} -> torch, whole 64 KiB",
                        lambda m=mech: self.cli2py("torch", m, 0, 64 * 1024)))
        for dtype in TORCH_DTYPES:
            for layout in LAYOUTS:
                out.append((f"py2py torch -> cupy {dtype} {layout}",
                            lambda d=dtype, l=layout: self.py2py("torch", "cupy", d, l)))
        for dtype in TORCH_DTYPES:
            for layout in ("slice1d", "transpose2d", "odd_slice1d", "slice4d"):
                out.append((f"py2py torch -> torch {dtype} {layout}",
                            lambda d=dtype, l=layout: self.py2py("torch", "torch", d, l)))
        for dtype in CUPY_DTYPES:
            for layout in ("slice1d", "transpose2d", "strided2d", "odd_slice1d", "slice4d"):
                out.append((f"py2py cupy -> torch {dtype} {layout}",
                            lambda d=dtype, l=layout: self.py2py("cupy", "torch", d, l)))
        out.append(("expandable torch 1 MiB (one segment) -> cli", lambda: self.expandable(256 * 1024, "cli")))
        out.append(("expandable torch 1 MiB (one segment) -> python", lambda: self.expandable(256 * 1024, "python")))
        out.append(("expandable torch 48 MiB (several segments) -> python",
                    lambda: self.expandable(12 * MIB, "python")))
        out.append(("expandable torch 1 MiB, allow_fd=False: refused",
                    lambda: self.expandable_without_fd(256 * 1024)))
        out.append(("expandable torch 48 MiB, allow_fd=False: refused",
                    lambda: self.expandable_without_fd(12 * MIB)))
        out.append(("memory torch 256 MiB released", lambda: self.memory("torch")))
        out.append(("memory cupy 256 MiB released", lambda: self.memory("cupy")))
        for mech in ("legacy", "vmm", "pool"):
            out.append((f"errors: {mech} exporter exited", lambda m=mech: self.exporter_gone(m)))
        out.append(("errors: opening one's own export", self.own_handle))
        out.append(("errors: a bogus legacy handle", self.bogus_handle))
        out.append(("record torch 'c' share record", self.record_c))
        for mech in ("legacy", "vmm", "pool", "fabric"):
            out.append((f"channel {mech}: Python publisher -> cuda-ipc attach",
                        lambda m=mech: self.chan_py2cli(m)))
            out.append((f"channel {mech}: cuda-ipc serve -> Python subscriber",
                        lambda m=mech: self.chan_cli2py(m)))
            out.append((f"channel {mech}: Python -> Python, 3 updates",
                        lambda m=mech: self.chan_updates(m)))
            out.append((f"channel {mech}: Python ring of 3 slots, 50 frames",
                        lambda m=mech: self.chan_ring(m)))
        out.append(("channel vmm: Python ring of 3 slots, 50 frames, fences only (no event per frame)",
                    lambda: self.chan_ring("vmm", fences_only=True)))
        out.append(("channel vmm: updates ordered after a side stream, not waiting for the GPU",
                    lambda: self.chan_updates("vmm", stream=True)))
        out.append(("channel vmm: ring frames ordered after a side stream, not waiting for the GPU",
                    lambda: self.chan_ring("vmm", stream=True)))
        out.append(("channel: a lease follows the tensors of an attachment", self.chan_lease_follows_tensor))
        out.append(("channel: kill -9 of a consumer holding tensors ends its lease", self.chan_kill9))
        out.append(("sets: state dict of 1000 tensors, Python -> Python, every value checked",
                    lambda: self.sets_state_dict(1000)))
        out.append(("sets: state dict updates (in place and copied in) seen after wait_update",
                    lambda: self.sets_updates(1000)))
        out.append(("sets: updates and a publish ordered after the writer's stream, not waiting for the GPU",
                    lambda: self.sets_stream_order(200)))
        out.append(("sets: tied tensors stay tied through a state dict; overlapping slices are copied apart",
                    self.sets_tied))
        out.append(("sets: kill -9 of a consumer holding state dict tensors ends its leases",
                    lambda: self.sets_kill9(100)))
        out.append(("sets: cuda-ipc serve --set 100 -> Python attach_set and attach_state_dict",
                    lambda: self.sets_cli2py(100)))
        out.append(("sets: Python publish_set 'weights' -> cuda-ipc attach --set", lambda: self.sets_py2cli(100)))
        out.append(("sets: example weight_sync.py --steps 100", lambda: self.sets_example(100)))
        out.extend(gpu_dtypes.cases(self))
        out.extend(gpu_torch_c.cases(self))
        out.append(("alloc: a model built in shareable() published with no copy, no warning; the consumer sees every value",
                    self.alloc_zero_copy))
        out.append(("alloc: training steps in place seen by the consumer after update_state_dict",
                    lambda: self.alloc_training(3, 5)))
        out.append(("alloc: tensors freed in the pool give their segments back to the arena (cuda_ipc.torch.empty_cache)",
                    self.alloc_freed))
        out.append(("alloc: closing the publisher keeps its tensors; a new segment raises OutOfMemoryError",
                    self.alloc_close))
        out.append(("alloc: shareable(reserve=reserve_bytes(model on meta)) holds the model in one chunk",
                    self.alloc_reserved))
        out.append(("alloc: more than the GPU has raises torch's OutOfMemoryError, not a crash", self.alloc_oom))
        out.append(("example torch_consumer (Rust maps a PyTorch export)", self.example_torch_consumer))
        for mech in ("legacy", "vmm", "pool"):
            out.append((f"example torch_producer {mech} (PyTorch maps a Rust export)",
                        lambda m=mech: self.example_torch_producer(m)))
        return out

    def run(self):
        cases = self.cases()
        if self.args.only:
            cases = [c for c in cases if all(t in c[0] for t in self.args.only)]
        if self.args.list:
            for name, _ in cases:
                print(name)
            return 0
        print(f"logs: {self.log_dir}", flush=True)
        passed = failed = skipped = 0
        started = time.time()
        for name, fn in cases:
            t0 = time.time()
            try:
                detail = fn()
                passed += 1
                print(f"PASS  {name} ({time.time() - t0:.2f} s){': ' + detail if detail else ''}", flush=True)
            except Skip as e:
                skipped += 1
                print(f"SKIP  {name}: {e}", flush=True)
            except Exception as e:
                failed += 1
                msg = str(e) if isinstance(e, CaseError) else f"{type(e).__name__}: {e}"
                print(f"FAIL  {name}: {msg}", flush=True)
        for w in self.workers.values():
            w.stop()
            if w.info:
                print(f"worker {w.name}: {json.dumps(w.info)} (started {w.starts}x)")
        print(f"total {time.time() - started:.0f} s; {skipped} skipped")
        print(f"{passed} passed, {failed} failed")
        return 1 if failed else 0


# The exit status when the machine lacks what the checks need (no driver, no
# GPU, no PyTorch, no cuda_ipc): skipped, not failed (automake's convention).
EXIT_SKIPPED = 77


def missing_requirement():
    """What this machine lacks for the checks, as one sentence, or None."""
    import importlib.util

    try:
        import cuda_ipc
    except ImportError:
        return ("the cuda_ipc package (with its extension module cuda_ipc._core) is not importable; "
                "install the wheel (cd python && maturin build) or run `maturin develop` in python/")
    try:
        cuda_ipc.driver_version()
        if cuda_ipc.device_count() == 0:
            return "it needs an NVIDIA GPU, and the driver sees none"
    except cuda_ipc.CudaIpcError as e:
        return f"it needs the CUDA driver and a GPU: {e}"
    if importlib.util.find_spec("torch") is None:
        return "it needs PyTorch with CUDA (pip install torch), which is not installed"
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=f"Exit status: 0 all passed, 1 a case failed, {EXIT_SKIPPED} skipped "
                                        "(no driver, GPU, PyTorch or cuda_ipc here; one line says which).")
    ap.add_argument("--cli", help="path to the cuda-ipc command (cases that need it are skipped without it)")
    ap.add_argument("--only", action="append", default=[], help="run only cases whose name contains this (repeatable: all must match)")
    ap.add_argument("--examples", help="folder with the Rust examples torch_consumer and torch_producer (default: examples/ next to --cli)")
    ap.add_argument("--record-dir", help="write PyTorch share records of real tensors here (for the Rust fixtures)")
    ap.add_argument("--log-dir", help="where worker logs go (default: $OUT, else a temporary folder)")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker_main(args.worker)
    if not args.list:
        missing = missing_requirement()
        if missing:
            print(f"gpu_interop: skipped: {missing}", flush=True)
            return EXIT_SKIPPED
    if args.cli and not os.access(args.cli, os.X_OK):
        ap.error(f"--cli {args.cli} is not an executable file")
    if args.record_dir:
        os.makedirs(args.record_dir, exist_ok=True)
    if args.examples is None and args.cli:
        guess = os.path.join(os.path.dirname(os.path.abspath(args.cli)), "examples")
        args.examples = guess if os.path.isdir(guess) else None
    return Runner(args).run()


if __name__ == "__main__":
    sys.exit(main())
