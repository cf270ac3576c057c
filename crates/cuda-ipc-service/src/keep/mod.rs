//! Weights that outlive the serving process.
//!
//! A VMM allocation lives while any process holds its exported file
//! descriptor. The service hands every chunk's descriptor, its catalog
//! image (a sealed memfd: sets, versions, owners, every tensor's place)
//! and its listening socket to a store that does not die with it:
//! systemd's file-descriptor store, or a [`Keeper`], a small process
//! without CUDA that speaks the same protocol and runs the service again
//! when it dies. The next serving process takes them back
//! ([`store::Store::from_env`]), maps the same chunks, and serves the same
//! sets at the same versions without reading a byte from disk.
//!
//! The order that makes a crash at any point safe: a chunk's descriptor
//! is stored before any image names it; an image is stored before the
//! previous one is removed; a chunk no image names any more is removed
//! last. The next process serves the newest image it can read and lets go
//! of every chunk that image does not name (a write session or load cut
//! short by the crash), so it serves the last committed version, never a
//! torn one.

mod handover;
pub(crate) mod image;
mod keeper;
pub mod store;
mod supervise;

pub use keeper::{Keeper, KeeperEvent, KeeperExit, MAX_FAILED_STARTS, MAX_KEPT, exit_text};
pub use store::Store;

/// Decodes `bytes` as a restarted service decodes a kept catalog image and
/// encodes what decoded again (for the fuzz target `catalog_image`, which
/// checks that nothing panics and that the pair round-trips).
///
/// # Errors
/// Why the bytes are not a catalog image this build serves.
#[doc(hidden)]
pub fn image_round_trip(bytes: &[u8]) -> Result<Vec<u8>, String> {
    image::Image::decode(bytes).map(|i| i.encode())
}
