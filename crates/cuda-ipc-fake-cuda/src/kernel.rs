//! Modules and launches: the three kernels of cuda-ipc's `kernels.ptx`
//! (`fill_affine_u32`, `check_affine_u32`, `map_affine_u32`), run on the
//! stream's worker as host loops. Any other kernel is
//! `CUDA_ERROR_NOT_FOUND` when its function is looked up.

use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_uint, c_void};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use cudarc::driver::sys::{CUfunction, CUmodule, CUstream, cudaError_enum as E};

use crate::memory::queue;
use crate::stream::Raw;
use crate::{ctx_ok, lock, put};

/// The kernels the fake can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    /// `fill_affine_u32(ptr, n, base, step)`: `ptr[i] = base + step * i`.
    Fill,
    /// `check_affine_u32(ptr, n, base, step, bad)`: the first `i` where
    /// `ptr[i] != base + step * i`, into `*bad` with an atomic minimum.
    Check,
    /// `map_affine_u32(ptr, n, mul, add)`: `ptr[i] = ptr[i] * mul + add`.
    Map,
}

impl Kernel {
    const ALL: [(Kernel, &'static str); 3] = [
        (Kernel::Fill, "fill_affine_u32"),
        (Kernel::Check, "check_affine_u32"),
        (Kernel::Map, "map_affine_u32"),
    ];

    /// The function handle of this kernel (the same in every module).
    fn handle(self) -> CUfunction {
        (0xf0_0000 + self as usize * 16) as CUfunction
    }

    fn from_handle(f: CUfunction) -> Option<Kernel> {
        Kernel::ALL
            .iter()
            .map(|(k, _)| *k)
            .find(|k| k.handle() == f)
    }
}

/// Loaded modules: handle -> the entry names its PTX declares.
static MODULES: Mutex<Option<HashMap<usize, Vec<String>>>> = Mutex::new(None);

fake! {
    /// `cuModuleLoadData`: PTX text; its `.entry` names are kept.
    fn cuModuleLoadData(module: *mut CUmodule, image: *const c_void) {
        ctx_ok()?;
        if image.is_null() {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the driver takes PTX as NUL-terminated text.
        let text = unsafe { CStr::from_ptr(image.cast::<c_char>()) }.to_string_lossy();
        if !text.contains(".version") || !text.contains(".target") {
            return Err(E::CUDA_ERROR_INVALID_IMAGE);
        }
        let entries: Vec<String> = text
            .split(".entry")
            .skip(1)
            .filter_map(|rest| rest.split('(').next().map(|n| n.trim().to_string()))
            .collect();
        let mut modules = lock(&MODULES);
        let map = modules.get_or_insert_with(HashMap::new);
        let h = 0xe0_0000 + map.len() * 16 + 16;
        map.insert(h, entries);
        // SAFETY: the caller's out-pointer.
        unsafe { put(module, h as CUmodule) }
    }
}

fake! {
    /// `cuModuleGetFunction`: the fake runs only the three kernels of
    /// `kernels.ptx`, and only from a module that declares them.
    fn cuModuleGetFunction(hfunc: *mut CUfunction, hmod: CUmodule, name: *const c_char) {
        ctx_ok()?;
        if name.is_null() {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: a NUL-terminated name, by the driver API's contract.
        let name = unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned();
        let modules = lock(&MODULES);
        let entries = modules.as_ref().and_then(|m| m.get(&(hmod as usize))).ok_or(E::CUDA_ERROR_INVALID_HANDLE)?;
        if !entries.contains(&name) {
            return Err(E::CUDA_ERROR_NOT_FOUND);
        }
        let (k, _) = Kernel::ALL.iter().find(|(_, n)| *n == name).ok_or(E::CUDA_ERROR_NOT_FOUND)?;
        // SAFETY: the caller's out-pointer.
        unsafe { put(hfunc, k.handle()) }
    }
}

fake! {
    /// `cuModuleUnload`.
    fn cuModuleUnload(hmod: CUmodule) {
        ctx_ok()?;
        lock(&MODULES).as_mut().and_then(|m| m.remove(&(hmod as usize))).map(drop).ok_or(E::CUDA_ERROR_INVALID_HANDLE)
    }
}

/// Reads launch parameter `i` as a `T`.
///
/// # Safety
/// `params` has at least `i + 1` entries, each pointing at its parameter.
unsafe fn param<T: Copy>(params: *mut *mut c_void, i: usize) -> T {
    // SAFETY: the caller's contract.
    unsafe { (*params.add(i)).cast::<T>().read_unaligned() }
}

/// How long a one-warp launch over `n` elements takes: a deliberately slow
/// writer on a GPU (cuda-ipc's `Speed::Slow`) takes tens of milliseconds
/// for a large buffer, which tests rely on to catch readers that do not
/// wait.
fn slow_pace(threads: u64, n: u64) -> Option<Duration> {
    (threads <= 32 && n >= 1024).then(|| Duration::from_nanos((n * 4).min(300_000_000)))
}

/// Runs `f` on each of `n` elements, in 16 slices, pausing between slices
/// when the launch is slow.
fn for_each(ptr: Raw, n: u64, pace: Option<Duration>, f: impl Fn(u64, &mut u32)) {
    // SAFETY: `n` aligned words of device memory, checked just before the
    // run and kept mapped while the launch is queued.
    let words = unsafe { std::slice::from_raw_parts_mut(ptr.0 as *mut u32, n as usize) };
    let slice = (n as usize).div_ceil(16).max(1);
    for (c, chunk) in words.chunks_mut(slice).enumerate() {
        for (j, w) in chunk.iter_mut().enumerate() {
            f((c * slice + j) as u64, w);
        }
        if let Some(p) = pace {
            std::thread::sleep(p / 16);
        }
    }
}

fake! {
    /// `cuLaunchKernel`: one of the three kernels, on the stream's worker.
    /// Memory it may not touch fails the context (`CUDA_ERROR_ILLEGAL_ADDRESS`).
    #[allow(clippy::too_many_arguments)]
    fn cuLaunchKernel(
        f: CUfunction,
        gridDimX: c_uint,
        gridDimY: c_uint,
        gridDimZ: c_uint,
        blockDimX: c_uint,
        blockDimY: c_uint,
        blockDimZ: c_uint,
        sharedMemBytes: c_uint,
        hStream: CUstream,
        kernelParams: *mut *mut c_void,
        extra: *mut *mut c_void,
    ) {
        ctx_ok()?;
        let _ = sharedMemBytes;
        let k = Kernel::from_handle(f).ok_or(E::CUDA_ERROR_INVALID_HANDLE)?;
        let grid = u64::from(gridDimX) * u64::from(gridDimY) * u64::from(gridDimZ);
        let block = u64::from(blockDimX) * u64::from(blockDimY) * u64::from(blockDimZ);
        if grid == 0 || block == 0 || block > 1024 || kernelParams.is_null() || !extra.is_null() {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller passes the kernel's parameters: (u64, u64, u32, u32[, u64]).
        let (ptr, n, a, b): (u64, u64, u32, u32) = unsafe {
            (param(kernelParams, 0), param(kernelParams, 1), param(kernelParams, 2), param(kernelParams, 3))
        };
        let pace = slow_pace(grid * block, n);
        let at = Raw(ptr as usize);
        match k {
            Kernel::Fill => queue(hStream, "a kernel (fill_affine_u32)", vec![(ptr, n * 4, true)], false, move || {
                for_each(at, n, pace, |i, w| *w = a.wrapping_add(b.wrapping_mul(i as u32)));
            }),
            Kernel::Map => queue(hStream, "a kernel (map_affine_u32)", vec![(ptr, n * 4, true)], false, move || {
                for_each(at, n, pace, |_, w| *w = w.wrapping_mul(a).wrapping_add(b));
            }),
            Kernel::Check => {
                // SAFETY: the fifth parameter of check_affine_u32.
                let bad: u64 = unsafe { param(kernelParams, 4) };
                let touches = vec![(ptr, n * 4, false), (bad, 8, true)];
                queue(hStream, "a kernel (check_affine_u32)", touches, false, move || {
                    // SAFETY: checked device memory, as in `for_each`.
                    let words = unsafe { std::slice::from_raw_parts(at.0 as *const u32, n as usize) };
                    let first = (0..n).find(|&i| words[i as usize] != a.wrapping_add(b.wrapping_mul(i as u32)));
                    if let Some(i) = first {
                        // SAFETY: an aligned device word, checked just before the run.
                        let word = unsafe { &*(bad as *const AtomicU64) };
                        word.fetch_min(i, Ordering::SeqCst);
                    }
                })
            }
        }
    }
}
