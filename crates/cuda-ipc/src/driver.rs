//! Loading the CUDA driver: the one fallible entry point.
//!
//! The driver library (`libcuda.so.1`) is loaded at run time. A missing
//! library, a driver older than CUDA 13.0, a library that lacks one of the
//! functions we call, or a machine with no device is an [`Error`] with a
//! message that says what to check, never a panic. (cudarc, which we build
//! on, panics on first use when the library or a symbol is missing: every
//! path into the driver in this crate goes through [`load`] first.)
#![allow(unsafe_code)]

use std::sync::OnceLock;

use cudarc::driver::sys;

use crate::error::{DriverVersion, Error, Result};

/// The oldest driver API version we accept: the bindings are CUDA 13.0's.
pub const REQUIRED: DriverVersion = DriverVersion(13000);

/// Set this environment variable to make [`load`] behave as if no driver
/// were installed (for testing the no-driver paths on a GPU host).
pub const DISABLE_ENV: &str = "CUDA_IPC_DISABLE_DRIVER";

static LOADED: OnceLock<DriverVersion> = OnceLock::new();

/// Loads `libcuda.so.1`, checks every driver function this crate uses, and
/// returns the driver's CUDA version. Cheap after the first success.
#[doc(alias = "cuDriverGetVersion")]
pub fn load() -> Result<DriverVersion> {
    if let Some(v) = LOADED.get() {
        return Ok(*v);
    }
    if std::env::var_os(DISABLE_ENV).is_some() {
        return Err(Error::DriverNotFound {
            reason: format!("{DISABLE_ENV} is set"),
        });
    }
    // SAFETY: loading the library runs its initialisers; libcuda is made to be loaded this way.
    if !unsafe { sys::is_culib_present() } {
        return Err(why_not_loaded());
    }
    // SAFETY: `is_culib_present` just loaded it, so `culib` cannot reach its panic.
    let lib = unsafe { sys::culib() };
    for symbol in crate::result::SYMBOLS.iter().chain(crate::fence::SYMBOLS) {
        // SAFETY: we only look the symbol up; it is never called through this pointer.
        let found = unsafe { lib.get::<unsafe extern "C" fn()>(symbol.as_bytes()) }.is_ok();
        if !found {
            return Err(Error::DriverNotFound {
                reason: format!(
                    "the loaded libcuda lacks {symbol}; the driver is older than CUDA {REQUIRED} or damaged"
                ),
            });
        }
    }
    let version = DriverVersion(crate::result::driver::version()?);
    if version < REQUIRED {
        return Err(Error::DriverTooOld {
            found: version,
            required: REQUIRED,
        });
    }
    Ok(*LOADED.get_or_init(|| version))
}

/// The names the loader is asked for first (cudarc tries these, then a few
/// Windows-style names that do not exist on Linux).
const LIBRARY_NAMES: [&str; 2] = ["libcuda.so", "libcuda.so.1"];

/// Why libcuda did not load: missing from the loader path, or found but not
/// a library the loader can use (a stray file, a truncated copy, the wrong
/// architecture), with the loader's own words.
fn why_not_loaded() -> Error {
    for name in LIBRARY_NAMES {
        // SAFETY: as in `load`: loading libcuda runs only its own initialisers.
        match unsafe { libloading::Library::new(name) } {
            // Loadable now (it appeared meanwhile): cudarc will find it on the next try.
            Ok(_) => {}
            Err(e) => {
                let text = e.to_string();
                if !text.contains("cannot open shared object file") {
                    return Error::DriverNotFound {
                        reason: format!(
                            "a file named {name} was found but it is not a loadable library \
                             ({text}); reinstall the NVIDIA driver, or remove the stray file \
                             from the loader path"
                        ),
                    };
                }
            }
        }
    }
    Error::DriverNotFound {
        reason: "no library named libcuda.so.1 (or libcuda.so) was found on the loader path".into(),
    }
}

/// Loads the driver and initialises it (`cuInit`). A machine whose driver
/// sees no device gets [`Error::NoDevice`].
#[doc(alias = "cuInit")]
pub fn init() -> Result<DriverVersion> {
    let version = load()?;
    match crate::result::driver::init() {
        Ok(()) => Ok(version),
        Err(e) if e.driver_result() == Some(sys::CUresult::CUDA_ERROR_NO_DEVICE) => {
            Err(Error::NoDevice {
                ordinal: 0,
                count: 0,
            })
        }
        Err(e) => Err(e),
    }
}

/// The number of CUDA devices the driver sees (after [`init`]).
#[doc(alias = "cuDeviceGetCount")]
pub fn device_count() -> Result<usize> {
    init()?;
    crate::result::device::count()
}
