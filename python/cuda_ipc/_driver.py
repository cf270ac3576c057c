"""The CUDA driver through ctypes: one checked wrapper per call.

libcuda.so.1 is loaded on first use, never at import; a missing driver is a
:class:`DriverNotFound`, a failed call a :class:`DriverError` naming the C
function and the ``CUresult``. Nothing here segfaults on bad input: handles
are passed as fixed-size structures built from validated bytes.
"""

import ctypes
import threading
from ctypes import POINTER, Structure, byref, c_char_p, c_int, c_size_t, c_uint, c_uint64, c_ulonglong, c_void_p

from .errors import DriverError, DriverNotFound

CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_HANDLE_TYPE_FABRIC = 8
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class _Bytes64(Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]

    @classmethod
    def of(cls, data):
        data = bytes(data)
        if len(data) != 64:
            raise ValueError(f"expected 64 bytes, got {len(data)}")
        h = cls()
        ctypes.memmove(h.reserved, data, 64)
        return h

    def bytes(self):
        return bytes(self.reserved)


class CUipcMemHandle(_Bytes64):
    pass


class CUipcEventHandle(_Bytes64):
    pass


class CUmemPoolPtrExportData(_Bytes64):
    pass


class CUmemFabricHandle(_Bytes64):
    pass


class CUuuid(Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class CUmemLocation(Structure):
    _fields_ = [("type", c_int), ("id", c_int)]


class CUmemAccessDesc(Structure):
    _fields_ = [("location", CUmemLocation), ("flags", c_int)]


_PROTOTYPES = {
    "cuInit": [c_uint],
    "cuDriverGetVersion": [POINTER(c_int)],
    "cuDeviceGetCount": [POINTER(c_int)],
    "cuDeviceGet": [POINTER(c_int), c_int],
    "cuDeviceGetUuid": [POINTER(CUuuid), c_int],
    "cuDevicePrimaryCtxRetain": [POINTER(c_void_p), c_int],
    "cuCtxPushCurrent": [c_void_p],
    "cuCtxPopCurrent": [POINTER(c_void_p)],
    "cuCtxSynchronize": [],
    "cuIpcGetMemHandle": [POINTER(CUipcMemHandle), c_uint64],
    "cuIpcOpenMemHandle": [POINTER(c_uint64), CUipcMemHandle, c_uint],
    "cuIpcCloseMemHandle": [c_uint64],
    "cuIpcGetEventHandle": [POINTER(CUipcEventHandle), c_void_p],
    "cuIpcOpenEventHandle": [POINTER(c_void_p), CUipcEventHandle],
    "cuEventDestroy": [c_void_p],
    "cuStreamWaitEvent": [c_void_p, c_void_p, c_uint],
    "cuEventQuery": [c_void_p],
    "cuStreamSynchronize": [c_void_p],
    "cuMemGetAddressRange": [POINTER(c_uint64), POINTER(c_size_t), c_uint64],
    "cuMemGetInfo": [POINTER(c_size_t), POINTER(c_size_t)],
    "cuMemImportFromShareableHandle": [POINTER(c_uint64), c_void_p, c_int],
    "cuMemAddressReserve": [POINTER(c_uint64), c_size_t, c_size_t, c_uint64, c_ulonglong],
    "cuMemMap": [c_uint64, c_size_t, c_size_t, c_uint64, c_ulonglong],
    "cuMemSetAccess": [c_uint64, c_size_t, POINTER(CUmemAccessDesc), c_size_t],
    "cuMemUnmap": [c_uint64, c_size_t],
    "cuMemAddressFree": [c_uint64, c_size_t],
    "cuMemRelease": [c_uint64],
    "cuMemPoolImportFromShareableHandle": [POINTER(c_void_p), c_void_p, c_int, c_ulonglong],
    "cuMemPoolImportPointer": [POINTER(c_uint64), c_void_p, POINTER(CUmemPoolPtrExportData)],
    "cuMemPoolGetAccess": [POINTER(c_int), c_void_p, POINTER(CUmemLocation)],
    "cuMemPoolSetAccess": [c_void_p, POINTER(CUmemAccessDesc), c_size_t],
    "cuMemPoolDestroy": [c_void_p],
    "cuMemFree": [c_uint64],
}

# Versioned symbols, newest first (the C headers map the plain names to these).
_SYMBOLS = {
    "cuDeviceGetUuid": ("cuDeviceGetUuid_v2", "cuDeviceGetUuid"),
    "cuCtxPushCurrent": ("cuCtxPushCurrent_v2", "cuCtxPushCurrent"),
    "cuCtxPopCurrent": ("cuCtxPopCurrent_v2", "cuCtxPopCurrent"),
    "cuIpcOpenMemHandle": ("cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle"),
    "cuEventDestroy": ("cuEventDestroy_v2", "cuEventDestroy"),
    "cuMemGetAddressRange": ("cuMemGetAddressRange_v2", "cuMemGetAddressRange"),
    "cuMemGetInfo": ("cuMemGetInfo_v2", "cuMemGetInfo"),
    "cuMemFree": ("cuMemFree_v2", "cuMemFree"),
}


def hint(call, code):
    """What a driver error usually means for the call that returned it."""
    table = {
        ("cuIpcOpenMemHandle", 201): "a process cannot open an IPC handle it exported itself; open it in another process",
        ("cuIpcOpenMemHandle", 1): "the handle does not name live memory: it is malformed, or the exporter freed the memory or exited",
        ("cuIpcOpenMemHandle", 400): "the handle does not name live memory: it is malformed, or the exporter freed the memory or exited",
        ("cuIpcOpenMemHandle", 217): "the memory lives on another GPU without peer access to this one",
        ("cuIpcOpenMemHandle", 704): "the memory lives on another GPU without peer access to this one",
        ("cuIpcOpenEventHandle", 1): "the event handle is malformed, or its exporter destroyed the event or exited",
        ("cuIpcOpenEventHandle", 400): "the event handle is malformed, or its exporter destroyed the event or exited",
        ("cuIpcGetMemHandle", 1): "the pointer is not from cudaMalloc/cuMemAlloc: stream-ordered (cudaMallocAsync) and VMM memory cannot be shared with a legacy handle",
        ("cuMemImportFromShareableHandle", 1): "the file descriptor is not a CUDA allocation's shareable handle",
        ("cuMemPoolImportFromShareableHandle", 1): "the file descriptor is not a CUDA memory pool's shareable handle",
        ("cuMemPoolImportPointer", 1): "the export data does not name a live allocation of this pool (the exporter freed it?)",
    }
    if (call, code) in table:
        return table[(call, code)]
    generic = {
        2: "the device is out of memory; free memory or ask for less",
        3: "the driver is not initialised or is shutting down",
        4: "the driver is not initialised or is shutting down",
        46: "the device is in exclusive-process or prohibited compute mode, or busy; check `nvidia-smi -q -d COMPUTE`",
        100: "no CUDA device is visible; check nvidia-smi and CUDA_VISIBLE_DEVICES",
        800: "the operation is not permitted here; fabric handles need an IMEX channel and a running IMEX service",
        801: "not supported on this device or platform (CUDA IPC is not available on Windows or WSL)",
        999: "the driver reported an unknown error; check dmesg and nvidia-smi",
    }
    return generic.get(code)


# cuEventQuery's answer for a record that has not completed yet.
CUDA_ERROR_NOT_READY = 600


class Driver:
    """The loaded driver. Use :func:`driver` to get the process's one."""

    def __init__(self, path="libcuda.so.1"):
        try:
            self._lib = ctypes.CDLL(path)
        except OSError as e:
            raise DriverNotFound(
                f"the CUDA driver library ({path}) could not be loaded: {e}. Install the NVIDIA "
                "driver and check that `nvidia-smi` works; if it does, make libcuda.so.1 findable "
                "(`ldconfig -p | grep libcuda`, or LD_LIBRARY_PATH)"
            ) from None
        self._fns = {}
        self._error_name = getattr(self._lib, "cuGetErrorName", None)
        if self._error_name is not None:
            self._error_name.argtypes = [c_int, POINTER(c_char_p)]
            self._error_name.restype = c_int
        rc = self._fn("cuInit")(0)
        if rc != 0:
            name = self.error_name(rc)
            raise DriverNotFound(
                f"cuInit failed with {name} ({rc}): the driver is installed but cannot start"
                + (f" ({hint('cuInit', rc)})" if hint("cuInit", rc) else "")
            )
        self.contexts = {}
        self.lock = threading.Lock()

    def _fn(self, name):
        f = self._fns.get(name)
        if f is not None:
            return f
        for symbol in _SYMBOLS.get(name, (name,)):
            f = getattr(self._lib, symbol, None)
            if f is not None:
                break
        if f is None:
            raise DriverNotFound(f"the CUDA driver has no {name}: it is too old; update it (R580 or newer)")
        f.argtypes = _PROTOTYPES[name]
        f.restype = c_int
        self._fns[name] = f
        return f

    def error_name(self, code):
        if self._error_name is not None:
            p = c_char_p()
            if self._error_name(int(code), byref(p)) == 0 and p.value:
                return p.value.decode()
        return f"CUDA_ERROR_{int(code)}"

    def call(self, name, *args):
        """Calls ``name`` and raises :class:`DriverError` unless it succeeds."""
        rc = self._fn(name)(*args)
        if rc != 0:
            raise DriverError(name, rc, self.error_name(rc), hint(name, rc))

    # --- devices and contexts ----------------------------------------------

    def version(self):
        v = c_int()
        self.call("cuDriverGetVersion", byref(v))
        return v.value

    def device_count(self):
        n = c_int()
        self.call("cuDeviceGetCount", byref(n))
        return n.value

    def device_uuid(self, ordinal):
        dev = c_int()
        self.call("cuDeviceGet", byref(dev), int(ordinal))
        u = CUuuid()
        self.call("cuDeviceGetUuid", byref(u), dev.value)
        return format_uuid(bytes(u.bytes))

    def ordinal_of(self, uuid):
        """The ordinal (in this process) of the device with ``uuid``, or None."""
        uuid = uuid.lower()
        for i in range(self.device_count()):
            if self.device_uuid(i).lower() == uuid:
                return i
        return None

    def primary_context(self, ordinal):
        """The device's primary context (shared with the CUDA runtime, PyTorch
        and CuPy), retained once for the life of the process."""
        with self.lock:
            ctx = self.contexts.get(ordinal)
            if ctx is None:
                dev = c_int()
                self.call("cuDeviceGet", byref(dev), int(ordinal))
                c = c_void_p()
                self.call("cuDevicePrimaryCtxRetain", byref(c), dev.value)
                ctx = self.contexts[ordinal] = c.value
            return ctx

    def bound(self, ordinal):
        """A context manager that makes the device's primary context current
        on this thread for its duration (and restores the previous one)."""
        return _Bound(self, self.primary_context(ordinal))

    # --- memory ---------------------------------------------------------------

    def address_range(self, ptr):
        base, size = c_uint64(), c_size_t()
        self.call("cuMemGetAddressRange", byref(base), byref(size), c_uint64(ptr))
        return base.value, size.value

    def mem_info(self):
        free, total = c_size_t(), c_size_t()
        self.call("cuMemGetInfo", byref(free), byref(total))
        return free.value, total.value

    def ipc_get_mem_handle(self, ptr):
        h = CUipcMemHandle()
        self.call("cuIpcGetMemHandle", byref(h), c_uint64(ptr))
        return h.bytes()

    def ipc_open_mem_handle(self, handle, flags=CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS):
        p = c_uint64()
        self.call("cuIpcOpenMemHandle", byref(p), CUipcMemHandle.of(handle), c_uint(flags))
        return p.value

    def ipc_close_mem_handle(self, ptr):
        self.call("cuIpcCloseMemHandle", c_uint64(ptr))

    def ipc_open_event_handle(self, handle):
        e = c_void_p()
        self.call("cuIpcOpenEventHandle", byref(e), CUipcEventHandle.of(handle))
        return e.value

    def ipc_get_event_handle(self, event):
        h = CUipcEventHandle()
        self.call("cuIpcGetEventHandle", byref(h), c_void_p(event))
        return h.bytes()

    def event_destroy(self, event):
        self.call("cuEventDestroy", c_void_p(event))

    def event_complete(self, event):
        """Whether the event's most recent record has completed (cuEventQuery)."""
        rc = self._fn("cuEventQuery")(c_void_p(event))
        if rc == 0:
            return True
        if rc == CUDA_ERROR_NOT_READY:
            return False
        raise DriverError("cuEventQuery", rc, self.error_name(rc), hint("cuEventQuery", rc))

    def stream_wait_event(self, stream, event):
        self.call("cuStreamWaitEvent", c_void_p(stream or None), c_void_p(event), c_uint(0))

    def stream_synchronize(self, stream):
        self.call("cuStreamSynchronize", c_void_p(stream or None))

    def ctx_synchronize(self):
        self.call("cuCtxSynchronize")

    def access_desc(self, ordinal):
        return CUmemAccessDesc(CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, int(ordinal)), CU_MEM_ACCESS_FLAGS_PROT_READWRITE)

    def import_fd(self, fd):
        h = c_uint64()
        self.call("cuMemImportFromShareableHandle", byref(h), c_void_p(int(fd)), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return h.value

    def import_fabric(self, handle):
        h = c_uint64()
        f = CUmemFabricHandle.of(handle)
        self.call("cuMemImportFromShareableHandle", byref(h), ctypes.cast(byref(f), c_void_p), CU_MEM_HANDLE_TYPE_FABRIC)
        return h.value

    def address_reserve(self, size):
        p = c_uint64()
        self.call("cuMemAddressReserve", byref(p), c_size_t(size), c_size_t(0), c_uint64(0), c_ulonglong(0))
        return p.value

    def mem_map(self, ptr, size, handle):
        self.call("cuMemMap", c_uint64(ptr), c_size_t(size), c_size_t(0), c_uint64(handle), c_ulonglong(0))

    def mem_set_access(self, ptr, size, ordinal):
        d = self.access_desc(ordinal)
        self.call("cuMemSetAccess", c_uint64(ptr), c_size_t(size), byref(d), c_size_t(1))

    def mem_unmap(self, ptr, size):
        self.call("cuMemUnmap", c_uint64(ptr), c_size_t(size))

    def address_free(self, ptr, size):
        self.call("cuMemAddressFree", c_uint64(ptr), c_size_t(size))

    def mem_release(self, handle):
        self.call("cuMemRelease", c_uint64(handle))

    def pool_import_fd(self, fd):
        p = c_void_p()
        self.call("cuMemPoolImportFromShareableHandle", byref(p), c_void_p(int(fd)), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, c_ulonglong(0))
        return p.value

    def pool_ensure_access(self, pool, ordinal):
        flags = c_int()
        loc = CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, int(ordinal))
        self.call("cuMemPoolGetAccess", byref(flags), c_void_p(pool), byref(loc))
        if flags.value != CU_MEM_ACCESS_FLAGS_PROT_READWRITE:
            d = self.access_desc(ordinal)
            self.call("cuMemPoolSetAccess", c_void_p(pool), byref(d), c_size_t(1))

    def pool_import_pointer(self, pool, data):
        p = c_uint64()
        d = CUmemPoolPtrExportData.of(data)
        self.call("cuMemPoolImportPointer", byref(p), c_void_p(pool), byref(d))
        return p.value

    def pool_destroy(self, pool):
        self.call("cuMemPoolDestroy", c_void_p(pool))

    def mem_free(self, ptr):
        self.call("cuMemFree", c_uint64(ptr))


class _Bound:
    def __init__(self, drv, ctx):
        self.drv, self.ctx = drv, ctx

    def __enter__(self):
        self.drv.call("cuCtxPushCurrent", c_void_p(self.ctx))
        return self

    def __exit__(self, *exc):
        old = c_void_p()
        self.drv.call("cuCtxPopCurrent", byref(old))
        return False


def format_uuid(b):
    """16 bytes as nvidia-smi prints a UUID: ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``."""
    h = bytes(b).hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


_DRIVER = None
_DRIVER_LOCK = threading.Lock()


def driver():
    """The process's :class:`Driver`, loaded and initialised on first use."""
    global _DRIVER
    with _DRIVER_LOCK:
        if _DRIVER is None:
            _DRIVER = Driver()
        return _DRIVER


def available():
    """Whether libcuda.so.1 loads and initialises here (never raises)."""
    try:
        driver()
        return True
    except Exception:
        return False
