//! Small GPU kernels for filling, checking and transforming shared buffers
//! of `u32` values, used by the samples, the command-line tool, the tests
//! and the benchmarks.
//!
//! They are hand-written PTX (`kernels.ptx`), loaded through the driver on
//! first use, so building the crate needs no CUDA compiler. Values follow an
//! affine [`Pattern`] of the element index, so a check catches wrong
//! offsets, not only wrong values.
#![allow(unsafe_code)]

use std::ffi::{CStr, c_void};
use std::sync::{Arc, Mutex, Weak};

use cudarc::driver::{CudaContext, sys};

use crate::device::Device;
use crate::driver::result::{mem, module};
use crate::error::{Error, Result};
use crate::memory::DeviceMemory;

const PTX: &str = concat!(include_str!("kernels.ptx"), "\0");

/// The value of element `i` is `base + step * i` (wrapping).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Pattern {
    /// Value of element 0.
    pub base: u32,
    /// Increment per element.
    pub step: u32,
}

impl Pattern {
    /// Every element equal to `value`.
    #[must_use]
    pub const fn constant(value: u32) -> Self {
        Pattern {
            base: value,
            step: 0,
        }
    }

    /// `base, base + step, base + 2 * step, ...`.
    #[must_use]
    pub const fn ramp(base: u32, step: u32) -> Self {
        Pattern { base, step }
    }

    /// The expected value of element `i`.
    pub fn at(&self, i: u64) -> u32 {
        self.base.wrapping_add(self.step.wrapping_mul(i as u32))
    }

    #[must_use]
    /// The pattern after `x -> x * mul + add` has been applied to every element.
    pub fn mapped(&self, mul: u32, add: u32) -> Self {
        Pattern {
            base: self.base.wrapping_mul(mul).wrapping_add(add),
            step: self.step.wrapping_mul(mul),
        }
    }

    #[must_use]
    /// The pattern of the elements from index `first` on.
    pub fn skip(&self, first: u64) -> Self {
        Pattern {
            base: self.at(first),
            step: self.step,
        }
    }
}

/// How many threads a launch uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Speed {
    /// Enough blocks to fill the device.
    #[default]
    Full,
    /// One block of 32 threads: a deliberately slow writer, for tests that
    /// must catch a reader that does not wait for the writer.
    Slow,
}

/// The modules loaded so far, one per cudarc context (that is, per
/// [`Device::open`]), kept while the context lives.
static LOADED: Mutex<Vec<Arc<Kernels>>> = Mutex::new(Vec::new());

/// The helper kernels of `device`'s context, loaded on first use.
fn kernels(device: &Device) -> Result<Arc<Kernels>> {
    let mut loaded = LOADED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    // Modules of contexts that are gone: their drop does nothing more.
    loaded.retain(|k| k.ctx.strong_count() > 0);
    let ctx = device.context();
    if let Some(k) = loaded
        .iter()
        .find(|k| std::ptr::eq(k.ctx.as_ptr(), Arc::as_ptr(ctx)))
    {
        return Ok(k.clone());
    }
    device.bind()?;
    let k = Arc::new(Kernels::load(device)?);
    loaded.push(k.clone());
    Ok(k)
}

/// The loaded module of one context.
struct Kernels {
    /// Weak, so that the cache does not keep a context alive.
    ctx: Weak<CudaContext>,
    module: sys::CUmodule,
    fill: sys::CUfunction,
    check: sys::CUfunction,
    map: sys::CUfunction,
    /// A device word for `check`'s result; the lock serialises checks.
    scratch: Mutex<u64>,
}

// SAFETY: the module and function handles are process-wide driver objects
// usable from any thread once their context is current, which every method
// ensures; the scratch word is guarded by its mutex.
unsafe impl Send for Kernels {}
// SAFETY: as above.
unsafe impl Sync for Kernels {}

impl Kernels {
    /// Loads the PTX into the (current) context of `device`.
    fn load(device: &Device) -> Result<Self> {
        let ptx = CStr::from_bytes_with_nul(PTX.as_bytes()).map_err(|e| Error::Unsupported {
            what: "helper kernels",
            why: format!("embedded PTX is malformed: {e}"),
        })?;
        let module = module::load_ptx(ptx)?;
        let get = |name: &CStr| {
            // SAFETY: `module` was just loaded and is live.
            unsafe { module::function(module, name) }
        };
        let loaded = (|| {
            Ok((
                get(c"fill_affine_u32")?,
                get(c"check_affine_u32")?,
                get(c"map_affine_u32")?,
            ))
        })();
        let (fill, check, map) = match loaded {
            Ok(f) => f,
            Err(e) => {
                // SAFETY: loaded above and not shared yet.
                let _ = unsafe { module::unload(module) };
                return Err(e);
            }
        };
        let scratch = mem::alloc(8)?;
        Ok(Kernels {
            ctx: Arc::downgrade(device.context()),
            module,
            fill,
            check,
            map,
            scratch: Mutex::new(scratch),
        })
    }
}

impl Drop for Kernels {
    fn drop(&mut self) {
        // Errors cannot be raised from drop. Once our cudarc context is
        // gone no driver call is safe here: releasing the primary context
        // freed both, or another `Device` of the same ordinal still holds it
        // and the module and the 8-byte word stay until that one goes.
        let Some(ctx) = self.ctx.upgrade() else {
            return;
        };
        let _ = ctx.bind_to_thread();
        let scratch = *self
            .scratch
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // SAFETY: allocated in `load`, used only under the lock, freed once.
        let _ = unsafe { mem::free(scratch) };
        // SAFETY: loaded in `load`, unloaded once.
        let _ = unsafe { module::unload(self.module) };
    }
}

fn grid_for(count: u64, speed: Speed) -> (u32, u32) {
    match speed {
        Speed::Slow => (1, 32),
        Speed::Full => {
            const BLOCK: u64 = 256;
            // Four waves of 132 SMs x 8 blocks is plenty for a grid-stride loop.
            (count.div_ceil(BLOCK).clamp(1, 4096) as u32, BLOCK as u32)
        }
    }
}

fn words(memory: &(impl DeviceMemory + ?Sized)) -> Result<u64> {
    let len = memory.byte_len() as u64;
    if !len.is_multiple_of(4) || !memory.device_address().is_multiple_of(4) {
        return Err(Error::arg(
            "buffer",
            format!(
                "u32 kernels need a 4-byte aligned buffer whose length is a multiple of 4, got {len} bytes"
            ),
        ));
    }
    Ok(len / 4)
}

/// Fills `memory` with `pattern` on its stream (asynchronously).
pub fn fill_u32(
    memory: &(impl DeviceMemory + ?Sized),
    pattern: Pattern,
    speed: Speed,
) -> Result<()> {
    let stream = memory.stream();
    let k = kernels(memory.device())?;
    let mut ptr = memory.device_address();
    let mut n = words(memory)?;
    let (mut base, mut step) = (pattern.base, pattern.step);
    let mut params: [*mut c_void; 4] = [
        (&raw mut ptr).cast(),
        (&raw mut n).cast(),
        (&raw mut base).cast(),
        (&raw mut step).cast(),
    ];
    let (grid, block) = grid_for(n, speed);
    memory.device().bind()?;
    // SAFETY: the parameters match `fill_affine_u32(u64, u64, u32, u32)`;
    // the memory is `n` aligned words that outlive the launch per DeviceMemory's contract.
    unsafe { module::launch(k.fill, grid, block, stream.cu_stream(), &mut params) }
}

/// Applies `x -> x * mul + add` to every element of `memory` on its stream.
pub fn map_u32(memory: &(impl DeviceMemory + ?Sized), mul: u32, add: u32) -> Result<()> {
    let stream = memory.stream();
    let k = kernels(memory.device())?;
    let mut ptr = memory.device_address();
    let mut n = words(memory)?;
    let (mut m, mut a) = (mul, add);
    let mut params: [*mut c_void; 4] = [
        (&raw mut ptr).cast(),
        (&raw mut n).cast(),
        (&raw mut m).cast(),
        (&raw mut a).cast(),
    ];
    let (grid, block) = grid_for(n, Speed::Full);
    memory.device().bind()?;
    // SAFETY: as in `fill_u32`, for `map_affine_u32(u64, u64, u32, u32)`.
    unsafe { module::launch(k.map, grid, block, stream.cu_stream(), &mut params) }
}

/// Checks every element of `memory` against `pattern` after the work
/// already queued on its stream, and returns the index of the first mismatch
/// (`None` when all match). Blocks until the check is done.
pub fn check_u32(memory: &(impl DeviceMemory + ?Sized), pattern: Pattern) -> Result<Option<u64>> {
    let stream = memory.stream();
    let k = kernels(memory.device())?;
    let scratch = k
        .scratch
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut ptr = memory.device_address();
    let mut n = words(memory)?;
    let (mut base, mut step) = (pattern.base, pattern.step);
    let mut bad = *scratch;
    let mut params: [*mut c_void; 5] = [
        (&raw mut ptr).cast(),
        (&raw mut n).cast(),
        (&raw mut base).cast(),
        (&raw mut step).cast(),
        (&raw mut bad).cast(),
    ];
    let (grid, block) = grid_for(n, Speed::Full);
    let s = stream.cu_stream();
    memory.device().bind()?;
    let mut first_bad = 0u64;
    // SAFETY: the scratch word is 8 bytes of device memory owned by `k` and
    // held under the lock; the launch parameters match
    // `check_affine_u32(u64, u64, u32, u32, u64)`; `first_bad` outlives the
    // copy because we synchronise before returning.
    unsafe {
        mem::set_d32_async(*scratch, u32::MAX, 2, s)?;
        module::launch(k.check, grid, block, s, &mut params)?;
        mem::copy_dtoh_async((&raw mut first_bad).cast(), *scratch, 8, s)?;
        crate::driver::result::stream::synchronize(s)?;
    }
    Ok((first_bad != u64::MAX).then_some(first_bad))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_algebra() {
        let p = Pattern::ramp(7, 3);
        assert_eq!(p.at(0), 7);
        assert_eq!(p.at(10), 37);
        let m = p.mapped(2, 1);
        for i in [0u64, 1, 5, 1 << 33] {
            assert_eq!(m.at(i), p.at(i).wrapping_mul(2).wrapping_add(1));
            assert_eq!(p.skip(100).at(i), p.at(i + 100));
        }
        assert_eq!(Pattern::constant(9).at(123_456), 9);
    }

    #[test]
    fn ptx_declares_every_entry_we_load() {
        for name in ["fill_affine_u32", "check_affine_u32", "map_affine_u32"] {
            assert!(PTX.contains(&format!(".visible .entry {name}(")), "{name}");
        }
        assert!(PTX.ends_with('\0'));
    }

    #[test]
    fn grids() {
        assert_eq!(grid_for(1, Speed::Full), (1, 256));
        assert_eq!(grid_for(1 << 40, Speed::Full), (4096, 256));
        assert_eq!(grid_for(1 << 20, Speed::Slow), (1, 32));
    }
}
