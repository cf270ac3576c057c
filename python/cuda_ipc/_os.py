"""Linux process calls through ctypes: pidfd_getfd (Python has no
os.pidfd_getfd) and prctl(PR_SET_PTRACER)."""

import ctypes
import errno
import os
import platform

from .errors import Unsupported

# pidfd_getfd is 438 on every architecture with the generic syscall table
# (and on x86-64).
_SYS_PIDFD_GETFD = {"x86_64": 438, "aarch64": 438, "arm64": 438}
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value

_libc = None


def _c():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
        _libc.prctl.restype = ctypes.c_int
    return _libc


def fetch_fd(pid, fd):
    """A duplicate (in this process) of file descriptor ``fd`` of process
    ``pid``, with ``pidfd_getfd``. The caller closes it."""
    number = _SYS_PIDFD_GETFD.get(platform.machine())
    if number is None:
        raise Unsupported(f"pidfd_getfd is not wired up for {platform.machine()} in cuda_ipc")
    try:
        pidfd = os.pidfd_open(int(pid))
    except ProcessLookupError:
        raise Unsupported(
            f"fetching the exporter's file descriptor: process {pid} has exited"
        ) from None
    except OSError as e:
        if e.errno == errno.ENOSYS:
            raise Unsupported("this kernel has no pidfd_open (Linux 5.3+ needed)") from None
        raise Unsupported(f"pidfd_open({pid}) failed: {e}") from None
    try:
        got = _c().syscall(ctypes.c_long(number), ctypes.c_int(pidfd), ctypes.c_int(int(fd)), ctypes.c_uint(0))
        if got < 0:
            err = ctypes.get_errno()
            if err == errno.EPERM:
                why = (
                    f"not permitted to take descriptors from process {pid}: pidfd_getfd needs "
                    "ptrace rights over it (the same user, and kernel.yama.ptrace_scope 0, or the "
                    "exporter allowing it with prctl(PR_SET_PTRACER), or CAP_SYS_PTRACE). "
                    "Containers often forbid it; pass descriptors over the cuda-ipc channel instead"
                )
            elif err == errno.EBADF:
                why = f"process {pid} has no open file descriptor {fd}: it closed the export"
            elif err == errno.ENOSYS:
                why = "this kernel has no pidfd_getfd (Linux 5.6+ needed)"
            elif err == errno.ESRCH:
                why = f"process {pid} has exited"
            else:
                why = os.strerror(err)
            raise Unsupported(f"fetching the exporter's file descriptor: {why}")
        return int(got)
    finally:
        os.close(pidfd)


def allow_fd_fetching():
    """Lets processes of the same user take this process's file descriptors
    with pidfd_getfd even where kernel.yama.ptrace_scope is 1
    (``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)``). This widens who may
    ptrace this process to every process of the same user."""
    rc = _c().prctl(ctypes.c_int(_PR_SET_PTRACER), ctypes.c_ulong(_PR_SET_PTRACER_ANY),
                    ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    if rc != 0:
        err = ctypes.get_errno()
        # EINVAL: no Yama LSM here, so there is nothing to allow.
        if err != errno.EINVAL:
            raise Unsupported(f"prctl(PR_SET_PTRACER) failed: {os.strerror(err)}")
