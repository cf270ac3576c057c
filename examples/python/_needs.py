"""What an example needs, checked before it starts any work.

A missing need ends the example at once (well within 2 s: nothing heavy is
imported to check) with one sentence on standard error and the exit
status of the ``cuda-ipc`` command: 2 for a usage mistake, 3 for what this
machine lacks (a package, the driver, a GPU, the ``cuda-ipc`` command).

    import _needs
    _needs.check("torch", gpu=True)
"""

import importlib.util
import os
import shutil
import subprocess
import sys

EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3

# How to get each package an example may need.
INSTALL = {
    "cuda_ipc": "pip install ./python (see README.md)",
    "torch": "pip install torch",
    "transformers": "pip install transformers",
    "safetensors": "pip install safetensors",
}


def _program():
    return os.path.splitext(os.path.basename(sys.argv[0]))[0] or "example"


def fail(code, sentence):
    """Ends the example: ``sentence`` on standard error, exit status ``code``."""
    print(f"{_program()}: {sentence}", file=sys.stderr)
    sys.exit(code)


def usage(sentence):
    """Ends the example for a usage mistake (exit status 2)."""
    fail(EXIT_USAGE, sentence)


def check(*packages, gpu=False, device=0):
    """Exits with status 3 unless every package in ``packages`` (and
    ``cuda_ipc``) can be imported and, with ``gpu``, the CUDA driver loads
    and device ``device`` exists. Imports nothing but ``cuda_ipc``."""
    missing = [p for p in ("cuda_ipc", *packages) if importlib.util.find_spec(p) is None]
    if missing:
        hints = "; ".join(f"{p}: {INSTALL.get(p, 'pip install ' + p)}" for p in missing)
        fail(EXIT_UNAVAILABLE, f"needs {', '.join(missing)}, which Python cannot import here ({hints})")
    if not gpu:
        return
    import cuda_ipc

    try:
        cuda_ipc.driver_version()
        count = cuda_ipc.device_count()
    except cuda_ipc.CudaIpcError as e:
        fail(EXIT_UNAVAILABLE, f"needs an NVIDIA GPU and its driver: {e}")
    if device >= count:
        fail(EXIT_UNAVAILABLE, f"needs CUDA device {device}, and this machine has {count}")


def find_cli(given=None):
    """The ``cuda-ipc`` executable: ``given``, else this checkout's
    ``target/release`` or ``target/debug`` build, else the one on PATH; exits
    with status 3 when there is none."""
    if given:
        if not os.access(given, os.X_OK):
            usage(f"--cli {given} is not an executable file")
        return given
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    for profile in ("release", "debug"):
        path = os.path.join(root, "target", profile, "cuda-ipc")
        if os.access(path, os.X_OK):
            return path
    found = shutil.which("cuda-ipc")
    if found is None:
        fail(EXIT_UNAVAILABLE, "needs the cuda-ipc command: build it with `cargo build --release -p cuda-ipc-cli`, "
                               "or pass --cli PATH")
    return found


def start_service(cli, socket, device=0):
    """Starts ``cuda-ipc serve --service SOCKET`` and returns the process
    once it serves (its first line, JSON, is read). A service that exits
    instead ends the example with its own message and exit status."""
    serving = subprocess.Popen([cli, "serve", "--service", socket, "--device", str(device)],
                               stdout=subprocess.PIPE, text=True)
    if not serving.stdout.readline():
        code = serving.wait()
        fail(code if code in (EXIT_USAGE, EXIT_UNAVAILABLE) else 1,
             f"the weight service exited (status {code}) before it served; its reason is above")
    return serving
