//! The driver layer: loading the CUDA driver, the one fallible entry point,
//! and every raw driver call.
//!
//! Everything in this folder sits on cudarc's generated bindings and
//! imports nothing from the crate but [`error`](crate::error) and
//! [`handle`](crate::handle) (the 64-byte tokens some calls take and return).
//! It is the only place that calls `cudarc::driver::sys`:
//!
//! - this module loads the library and checks its symbols;
//! - `result` (private to the crate) has one checked function per C call,
//!   grouped by area, the fence's stream memory operations included.
//!
//! The owning types above ([`device`](crate::device),
//! [`memory`](crate::memory), [`event`](crate::event)) call `result`; nothing
//! here imports them.
//!
//! # Loading
//! The driver library (`libcuda.so.1`) is loaded at run time. A missing
//! library, a driver older than CUDA 13.0, a library that lacks one of the
//! functions we call, or a machine with no device is an [`Error`] with a
//! message that says what to check, never a panic. (cudarc, which we build
//! on, panics on first use when the library or a symbol is missing: every
//! path into the driver in this crate goes through [`load`] first.)
#![allow(unsafe_code)]

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cudarc::driver::sys;

use crate::error::{DriverVersion, Error, Result};

#[doc(hidden)]
pub mod result;

/// The oldest driver API version we accept: the bindings are CUDA 13.0's.
pub(crate) const REQUIRED: DriverVersion = DriverVersion(13000);

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
            reason: format!(
                "{DISABLE_ENV} is set, so the driver is not used; unset it to use the GPU"
            ),
        });
    }
    // SAFETY: loading the library runs its initialisers; libcuda is made to be loaded this way.
    if !unsafe { sys::is_culib_present() } {
        return Err(why_not_loaded());
    }
    // SAFETY: `is_culib_present` just loaded it, so `culib` cannot reach its panic.
    let lib = unsafe { sys::culib() };
    for symbol in result::SYMBOLS {
        // SAFETY: we only look the symbol up; it is never called through this pointer.
        let found = unsafe { lib.get::<unsafe extern "C" fn()>(symbol.as_bytes()) }.is_ok();
        if !found {
            return Err(Error::DriverNotFound {
                reason: format!(
                    "the loaded libcuda lacks {symbol}; the driver is older than CUDA {REQUIRED} or damaged: \
                     install an NVIDIA driver for CUDA {REQUIRED} or newer (R580+)"
                ),
            });
        }
    }
    let version = DriverVersion(result::driver::version()?);
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

/// Why libcuda did not load: no file of that name where the dynamic loader
/// looks, a link to a file that is gone, or a file that is there but is not
/// a library the loader can use (a stray file, a truncated copy, the wrong
/// architecture), with the loader's own words.
///
/// The two cases are told apart by looking for the file, not by the
/// loader's message: `libloading` reports only "dlopen failed", and the
/// wording of `dlerror` differs between C libraries.
fn why_not_loaded() -> Error {
    let ld_library_path = std::env::var_os("LD_LIBRARY_PATH");
    let cache = std::fs::read(LD_SO_CACHE).unwrap_or_default();
    for name in LIBRARY_NAMES {
        let Some(found) = find_library(name, ld_library_path.as_deref(), &cache, STANDARD_DIRS)
        else {
            continue;
        };
        // SAFETY: as in `load`: loading libcuda runs only its own initialisers.
        let words = match unsafe { libloading::Library::new(name) } {
            // Loadable now (it appeared meanwhile): cudarc will find it on the next try.
            Ok(_) => continue,
            Err(e) => loader_words(&e),
        };
        let reason = match found {
            Found::File(path) => format!(
                "a file named {name} was found at {} but it is not a loadable library ({words}); \
                 reinstall the NVIDIA driver, or remove the stray file from the loader path",
                path.display()
            ),
            Found::DanglingLink(path) => format!(
                "{} is a symbolic link to a file that does not exist ({words}); the NVIDIA \
                 driver is partly removed: reinstall it, or remove the link",
                path.display()
            ),
        };
        return Error::DriverNotFound { reason };
    }
    Error::DriverNotFound {
        reason: "no library named libcuda.so.1 (or libcuda.so) was found on the loader path \
                 (LD_LIBRARY_PATH, /etc/ld.so.cache, the system library directories). Install the \
                 NVIDIA driver and check that `nvidia-smi` works; if it does, make libcuda.so.1 \
                 findable (`ldconfig -p | grep libcuda`, or LD_LIBRARY_PATH)"
            .into(),
    }
}

/// The loader's explanation of a failed load (`dlerror`), which `libloading`
/// keeps as the error's source.
fn loader_words(e: &libloading::Error) -> String {
    match std::error::Error::source(e) {
        Some(source) => source.to_string(),
        None => e.to_string(),
    }
}

/// The dynamic loader's cache of library paths (`ldconfig` writes it).
const LD_SO_CACHE: &str = "/etc/ld.so.cache";

/// The directories the dynamic loader searches after LD_LIBRARY_PATH and its
/// cache (glibc's trusted directories, with Debian's multiarch ones).
const STANDARD_DIRS: &[&str] = &[
    #[cfg(target_arch = "x86_64")]
    "/lib/x86_64-linux-gnu",
    #[cfg(target_arch = "x86_64")]
    "/usr/lib/x86_64-linux-gnu",
    #[cfg(target_arch = "aarch64")]
    "/lib/aarch64-linux-gnu",
    #[cfg(target_arch = "aarch64")]
    "/usr/lib/aarch64-linux-gnu",
    "/lib64",
    "/usr/lib64",
    "/lib",
    "/usr/lib",
];

/// What [`find_library`] found at a library's name.
#[derive(Debug, PartialEq, Eq)]
enum Found {
    /// A file (or a link to one).
    File(PathBuf),
    /// A symbolic link whose target does not exist.
    DanglingLink(PathBuf),
}

/// Looks for a file named `name` where the dynamic loader looks for it, in
/// its order: the directories of `ld_library_path` (an empty entry is the
/// current directory), the paths that `cache` (the bytes of
/// `/etc/ld.so.cache`) lists under that file name, then `dirs`. Returns the
/// first file there, or else the first link to a missing file.
fn find_library(
    name: &str,
    ld_library_path: Option<&OsStr>,
    cache: &[u8],
    dirs: &[&str],
) -> Option<Found> {
    let from_env = ld_library_path
        .map(|p| {
            p.as_bytes()
                .split(|&b| b == b':' || b == b';')
                .map(|dir| match dir {
                    b"" => Path::new(".").join(name),
                    dir => Path::new(OsStr::from_bytes(dir)).join(name),
                })
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    // The cache's string table holds the full path of every library it
    // lists, each ending in a NUL: no need to decode its entries (whose
    // layout changed between glibc versions) to find them.
    let from_cache = cache
        .split(|&b| b == 0)
        .filter(|s| s.starts_with(b"/"))
        .map(|s| PathBuf::from(OsStr::from_bytes(s)))
        .filter(|p| p.file_name() == Some(OsStr::new(name)));
    let from_dirs = dirs.iter().map(|d| Path::new(d).join(name));
    let mut dangling = None;
    for path in from_env.into_iter().chain(from_cache).chain(from_dirs) {
        if path.is_file() {
            return Some(Found::File(path));
        }
        if dangling.is_none() && path.is_symlink() {
            dangling = Some(Found::DanglingLink(path));
        }
    }
    dangling
}

/// Loads the driver and initialises it (`cuInit`). A machine whose driver
/// sees no device gets [`Error::NoDevice`].
#[doc(alias = "cuInit")]
pub(crate) fn init() -> Result<DriverVersion> {
    let version = load()?;
    match result::driver::init() {
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

/// The number of CUDA devices the driver sees (loading and initialising
/// the driver first, `cuInit`).
#[doc(alias = "cuDeviceGetCount")]
pub fn device_count() -> Result<usize> {
    init()?;
    result::device::count()
}

#[cfg(test)]
mod tests {
    use super::*;

    const NAME: &str = "libcuda.so.1";

    fn env(dirs: &[&Path]) -> std::ffi::OsString {
        std::env::join_paths(dirs).unwrap()
    }

    #[test]
    fn nothing_anywhere_is_none() {
        let empty = tempfile::tempdir().unwrap();
        let empty_path = empty.path().to_str().unwrap();
        let env = env(&[empty.path()]);
        assert_eq!(find_library(NAME, Some(&env), b"", &[empty_path]), None);
        assert_eq!(find_library(NAME, None, b"", &[]), None);
    }

    #[test]
    fn a_file_on_ld_library_path_is_found_first() {
        let first = tempfile::tempdir().unwrap();
        let second = tempfile::tempdir().unwrap();
        std::fs::write(second.path().join(NAME), b"x").unwrap();
        std::fs::write(first.path().join(NAME), b"x").unwrap();
        let env = env(&[first.path(), second.path()]);
        let dir = second.path().to_str().unwrap();
        assert_eq!(
            find_library(NAME, Some(&env), b"", &[dir]),
            Some(Found::File(first.path().join(NAME)))
        );
        // Other names in the directory are not it.
        assert_eq!(find_library("libcuda.so", Some(&env), b"", &[dir]), None);
    }

    #[test]
    fn the_cache_and_the_standard_dirs_are_searched() {
        let dir = tempfile::tempdir().unwrap();
        let lib = dir.path().join(NAME);
        std::fs::write(&lib, b"x").unwrap();
        // As in the cache: NUL-terminated names and paths amid binary data.
        let mut cache = b"glibc-ld.so.cache1.1\x03\x00\x00\x00libcuda.so.1\x00".to_vec();
        cache.extend_from_slice(lib.as_os_str().as_bytes());
        cache.extend_from_slice(b"\x00/usr/lib/libother.so.1\x00");
        assert_eq!(
            find_library(NAME, None, &cache, &[]),
            Some(Found::File(lib.clone()))
        );
        // A cache entry whose file is gone is skipped.
        std::fs::remove_file(&lib).unwrap();
        assert_eq!(find_library(NAME, None, &cache, &[]), None);
        std::fs::write(&lib, b"x").unwrap();
        let d = dir.path().to_str().unwrap();
        assert_eq!(find_library(NAME, None, b"", &[d]), Some(Found::File(lib)));
    }

    #[test]
    fn a_link_to_nothing_is_reported_unless_a_file_comes_later() {
        let links = tempfile::tempdir().unwrap();
        let files = tempfile::tempdir().unwrap();
        let link = links.path().join(NAME);
        std::os::unix::fs::symlink(links.path().join("libcuda.so.580.1"), &link).unwrap();
        let env = env(&[links.path()]);
        assert_eq!(
            find_library(NAME, Some(&env), b"", &[]),
            Some(Found::DanglingLink(link))
        );
        std::fs::write(files.path().join(NAME), b"x").unwrap();
        let f = files.path().to_str().unwrap();
        assert_eq!(
            find_library(NAME, Some(&env), b"", &[f]),
            Some(Found::File(files.path().join(NAME)))
        );
    }

    #[test]
    fn an_empty_ld_library_path_entry_is_the_current_directory() {
        assert_eq!(
            find_library("Cargo.toml", Some(OsStr::new(":/nonexistent")), b"", &[]),
            Some(Found::File(Path::new(".").join("Cargo.toml")))
        );
    }
}
