//! A fake CUDA driver: a `libcuda.so` that keeps "device memory" in host
//! memory, so that the logic of the GPU-only tests (the exchange, leases,
//! arenas, sets, the reaper's ordering, the weight service's states) runs
//! on a machine without a GPU. It is not a replacement for runs on a real
//! GPU: it says nothing about speed, the real driver's quirks or the
//! hardware.
//!
//! # What it models
//! - One device (ordinal 0, "cuda-ipc fake GPU", compute capability 9.0,
//!   16 GiB) that supports legacy IPC, VMM with POSIX file descriptors,
//!   memory pools shareable as file descriptors, interprocess events and
//!   64-bit stream memory operations; no fabric handles, no peers.
//!   `CUDA_VISIBLE_DEVICES` is honoured (`0` or the fake's UUID).
//! - Device memory is memfd-backed host memory mapped `MAP_SHARED`, so
//!   device pointers are host addresses and other processes can map the
//!   same pages: a legacy IPC handle names an allocation that the
//!   exporter's small server (an abstract Unix socket, so handles open
//!   across PID, IPC, mount and user namespaces as the driver's do) hands
//!   over as a descriptor; VMM and pool handles are duplicated descriptors,
//!   a pool is one sparse memfd with a first-fit allocator, and a pool
//!   pointer's export data carries its offset.
//!   `cuMemGetInfo` counts this process's allocations only.
//! - Each stream has a worker thread that runs its queued operations in
//!   order (copies, fills, the three kernels of `kernels.ptx` run on the
//!   host, host functions, event records, waits), so asynchronous work is
//!   asynchronous. Events record a position in a stream; interprocess
//!   events are counters in a file under `/dev/shm` (as the real driver's
//!   are), and `cuStreamWaitValue64` polls the word, across processes.
//! - Memory access rights: a copy into read-only memory is refused by the
//!   call (`CUDA_ERROR_INVALID_VALUE`); a kernel that writes there, or
//!   touches memory that is not mapped, makes the context fail with
//!   `CUDA_ERROR_ILLEGAL_ADDRESS` from then on, as on an H200.
//! - Checks a real driver does not make: freeing or unmapping memory
//!   (`cuMemFree`, `cuMemFreeAsync`, `cuMemUnmap`, `cuIpcCloseMemHandle`,
//!   `cuMemFreeHost`, `cuMemHostUnregister`, `cuMemPoolDestroy`) while work
//!   queued on a stream that has not finished still uses it prints what
//!   was freed and by which call, and aborts the process. Set
//!   `CUDA_IPC_FAKE_DELAY_US` to delay every queued operation by that many
//!   microseconds, so that such ordering mistakes show reliably, and
//!   `CUDA_IPC_FAKE_TRACE=1` to print every call and its result.
//!
//! # What it does not model
//! More than one device or context, peer access, fabric handles, graphs,
//! managed memory, any kernel but the three of `kernels.ptx`, timing that
//! means anything, legacy handles across network namespaces (where the
//! exporter's abstract socket is out of reach), and the legacy default stream's
//! implicit synchronisation (handles 0, 1 and 2 are one ordinary stream).
//! A call it does not implement is absent, so the library's loader says
//! which symbol is missing; unsupported arguments are error codes, never
//! a crash.
//!
//! # Running the tests against it
//! `scripts/fake-gpu-tests.sh` builds this library, links it as
//! `libcuda.so` in a folder of its own, puts that folder on
//! `LD_LIBRARY_PATH` (children and the `cuda-ipc` binary inherit it) and
//! runs the GPU tests with `--ignored`, skipping those listed in
//! `crates/cuda-ipc-fake-cuda/skips.txt` with their reasons.
#![allow(unsafe_code)]
// every item here is a C function of the driver API
// The driver API's names (cuMemAlloc_v2, CUresult) are the contract.
#![allow(non_snake_case)]

use std::ffi::{CStr, c_char};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

use cudarc::driver::sys::{CUresult, cudaError_enum as E};

/// The result of a call's body: `Err` carries the code to return.
pub(crate) type Res = Result<(), CUresult>;

/// Defines one exported driver function. The body returns [`Res`]; the
/// macro checks that the signature is cudarc's for the same symbol, turns
/// a panic into `CUDA_ERROR_UNKNOWN` and traces the call when asked.
macro_rules! fake {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// The driver API's contract for this call: every pointer is valid
        /// for what the call reads and writes, and handles are the fake's.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> cudarc::driver::sys::CUresult {
            // The same parameters as cudarc's binding of this symbol.
            const _: unsafe fn($($ty),*) -> cudarc::driver::sys::CUresult =
                cudarc::driver::sys::$name;
            $crate::guard(stringify!($name), move || -> $crate::Res { $body })
        }
    };
}

mod device;
mod event;
mod ipc;
mod kernel;
mod memory;
mod pool;
mod registry;
mod stream;
mod vmm;

/// Runs a call's body: its result as a `CUresult`, a panic as
/// `CUDA_ERROR_UNKNOWN` with the call named on standard error.
pub(crate) fn guard(call: &'static str, body: impl FnOnce() -> Res) -> CUresult {
    let r = match std::panic::catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => E::CUDA_SUCCESS,
        Ok(Err(e)) => e,
        Err(_) => {
            eprintln!(
                "cuda-ipc fake driver: {call} panicked (a bug of the fake); returning CUDA_ERROR_UNKNOWN"
            );
            E::CUDA_ERROR_UNKNOWN
        }
    };
    if trace() {
        eprintln!("[fake cuda {}] {call} -> {r:?}", std::process::id());
    }
    r
}

/// Whether `CUDA_IPC_FAKE_TRACE` asks for every call on standard error.
fn trace() -> bool {
    static TRACE: OnceLock<bool> = OnceLock::new();
    *TRACE.get_or_init(|| std::env::var_os("CUDA_IPC_FAKE_TRACE").is_some_and(|v| v != "0"))
}

/// Locks `m`, ignoring poisoning: a panic inside the fake was already
/// reported as an error code, and its state stays consistent per call.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Writes `v` through the out-pointer `p`; a null pointer is
/// `CUDA_ERROR_INVALID_VALUE`, as the driver answers.
///
/// # Safety
/// A non-null `p` is valid for a write of `T`.
pub(crate) unsafe fn put<T>(p: *mut T, v: T) -> Res {
    if p.is_null() {
        return Err(E::CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null, and the caller's contract.
    unsafe { p.write(v) };
    Ok(())
}

/// The sticky error of the (one) context: set when a kernel faulted, after
/// which every call that needs the context fails with it, as on a GPU.
static STICKY: AtomicU32 = AtomicU32::new(0);

/// Marks the context as failed with `e` (the first failure stays).
pub(crate) fn set_sticky(e: CUresult) {
    let _ = STICKY.compare_exchange(0, e as u32, Ordering::AcqRel, Ordering::Acquire);
}

/// `Ok` when the context is usable: it is current on this thread
/// (`CUDA_ERROR_INVALID_CONTEXT` otherwise) and no kernel faulted.
pub(crate) fn ctx_ok() -> Res {
    if STICKY.load(Ordering::Acquire) != 0 {
        return Err(E::CUDA_ERROR_ILLEGAL_ADDRESS);
    }
    if !device::is_current() {
        return Err(E::CUDA_ERROR_INVALID_CONTEXT);
    }
    Ok(())
}

/// Whether `cuInit` succeeded in this process.
pub(crate) fn initialised() -> Res {
    if device::INIT.get().is_some() {
        Ok(())
    } else {
        Err(E::CUDA_ERROR_NOT_INITIALIZED)
    }
}

/// The name and description of each result code, made once per code and
/// kept for the life of the process (the driver returns static strings).
fn error_strings(e: CUresult) -> (&'static CStr, &'static CStr) {
    static STRINGS: Mutex<Vec<(u32, &'static CStr, &'static CStr)>> = Mutex::new(Vec::new());
    let mut strings = lock(&STRINGS);
    if let Some((_, n, d)) = strings.iter().find(|(c, _, _)| *c == e as u32) {
        return (n, d);
    }
    let name = format!("{e:?}");
    let description = match e {
        E::CUDA_SUCCESS => "no error".to_string(),
        E::CUDA_ERROR_INVALID_VALUE => "invalid argument".to_string(),
        E::CUDA_ERROR_OUT_OF_MEMORY => "out of memory".to_string(),
        E::CUDA_ERROR_NOT_INITIALIZED => "initialization error".to_string(),
        E::CUDA_ERROR_NO_DEVICE => "no CUDA-capable device is detected".to_string(),
        E::CUDA_ERROR_INVALID_CONTEXT => "invalid device context".to_string(),
        E::CUDA_ERROR_ILLEGAL_ADDRESS => "an illegal memory access was encountered".to_string(),
        E::CUDA_ERROR_NOT_SUPPORTED => "operation not supported".to_string(),
        E::CUDA_ERROR_NOT_READY => "device not ready".to_string(),
        other => format!("{other:?} (cuda-ipc fake driver)"),
    };
    let leak = |s: String| -> &'static CStr {
        Box::leak(
            std::ffi::CString::new(s)
                .unwrap_or_default()
                .into_boxed_c_str(),
        )
    };
    let (n, d) = (leak(name), leak(description));
    strings.push((e as u32, n, d));
    (n, d)
}

fake! {
    /// `cuGetErrorString`: a static description of `error`.
    fn cuGetErrorString(error: CUresult, pStr: *mut *const c_char) {
        // SAFETY: the caller's out-pointer.
        unsafe { put(pStr, error_strings(error).1.as_ptr()) }
    }
}

fake! {
    /// `cuGetErrorName`: the static name of `error` (`CUDA_ERROR_...`).
    fn cuGetErrorName(error: CUresult, pStr: *mut *const c_char) {
        // SAFETY: the caller's out-pointer.
        unsafe { put(pStr, error_strings(error).0.as_ptr()) }
    }
}
