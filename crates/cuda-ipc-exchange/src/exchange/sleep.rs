//! A subscriber's sleep and wake: every mapping it holds unmapped at once,
//! its addresses kept, then mapped again at the same addresses (CUDA graphs
//! captured over attached weights stay valid across a sleep).
//!
//! What sleeps: every mapping the subscriber opened that is still alive
//! (the chunks of attached sets, cached or held, and per-buffer mappings),
//! each through [`Mapping::sleep`]. Leases are kept: the publisher still
//! counts the memory as in use, and the physical memory stays where it is
//! (the subscriber gives back its mappings, not the memory). Only vmm and
//! fabric mappings can sleep; a subscriber holding legacy or pool mappings
//! is refused before anything is unmapped.
//!
//! A kernel or copy through a sleeping address faults and poisons the
//! CUDA context, so a mapping sleeps only where nothing can use it:
//! [`Subscriber::sleep`](super::Subscriber::sleep) refuses while any view, attachment, set, ring or
//! tensor holds one of the mappings (only the subscriber's own cache may),
//! and keeps attaches from handing one out until it is done. A caller that
//! keeps its views (and the CUDA graphs captured over them) across the
//! sleep uses [`Subscriber::sleep_unchecked`](super::Subscriber::sleep_unchecked), an `unsafe fn` whose contract
//! is that nothing touches them until [`Subscriber::wake`](super::Subscriber::wake). While the
//! subscriber sleeps, an attach that would hand out a sleeping mapping is
//! refused until the wake; an attach of memory not mapped before maps it
//! awake, and a later wake leaves it as it is.
#![allow(unsafe_code)] // `Mapping::sleep`, under the checks or contract below

use std::sync::Arc;

use crate::Mechanism;
use crate::error::{Error, Result};
use crate::memory::buffer::Mapping;

use super::chunk_cache::ChunkCache;
use super::lock;
use super::slept::Slept;
use super::subscriber::Subscriber;

/// How long a checked sleep waits for views dropped just before to finish
/// going (their releases retired to the reaper) before it refuses.
const SETTLE_BEFORE_REFUSING: std::time::Duration = std::time::Duration::from_secs(10);

/// How many references to `live` mappings there are besides the
/// subscriber's own (its chunk cache's, and the one in `live` itself):
/// views, attachments, sets, rings, tensors.
fn users(live: &[Arc<dyn Mapping>], chunks: &ChunkCache) -> usize {
    live.iter()
        .map(|m| {
            let cached = chunks
                .values()
                .filter(|c| Arc::ptr_eq(&c.mapping, m))
                .count();
            Arc::strong_count(m).saturating_sub(1 + cached)
        })
        .sum()
}

impl Subscriber {
    /// The live mappings, each once.
    pub(super) fn live_mappings(&self) -> Vec<Arc<dyn Mapping>> {
        let mut live = lock(&self.live);
        live.retain(|w| w.strong_count() > 0);
        let mut out: Vec<Arc<dyn Mapping>> =
            live.iter().filter_map(std::sync::Weak::upgrade).collect();
        out.sort_by_key(|m| m.base());
        out.dedup_by_key(|m| m.base());
        out
    }

    /// The work of [`Subscriber::sleep`](super::Subscriber::sleep).
    pub(super) fn do_sleep(&self) -> Result<Slept> {
        // SAFETY: checked, `sleep_all` puts nothing to sleep while anything
        // but this subscriber holds a mapping, and keeps attaches from
        // handing one out until it is done: no view of a sleeping mapping
        // exists, so nothing can queue work on it before the wake.
        unsafe { self.sleep_all(true) }
    }

    /// As [`Subscriber::sleep`](super::Subscriber::sleep), without refusing while views, attachments,
    /// sets, rings or tensors hold the mappings: for a caller that keeps
    /// them (and CUDA graphs captured over them) across the sleep, at the
    /// same addresses after [`Subscriber::wake`](super::Subscriber::wake).
    ///
    /// # Safety
    /// From this call until [`Subscriber::wake`](super::Subscriber::wake) has returned, nothing may
    /// touch this subscriber's memory: no kernel, copy or CUDA graph queued
    /// on it by any thread, on any stream, through a view, a tensor or a
    /// raw address, and no view read or written from the host (work queued
    /// before the call is waited for here). A use faults and poisons the
    /// CUDA context of this process. See [`Mapping::sleep`].
    ///
    /// # Errors
    /// [`Error::Unsupported`] as for [`Subscriber::sleep`](super::Subscriber::sleep).
    pub unsafe fn sleep_unchecked(&self) -> Result<Slept> {
        // SAFETY: the caller keeps this function's contract.
        unsafe { self.sleep_all(false) }
    }

    /// Puts every live mapping to sleep; with `check`, refuses while
    /// anything but this subscriber holds one.
    ///
    /// # Safety
    /// Without `check`, the caller keeps [`Subscriber::sleep_unchecked`](super::Subscriber::sleep_unchecked)'s
    /// contract.
    unsafe fn sleep_all(&self, check: bool) -> Result<Slept> {
        if check && users(&self.live_mappings(), &lock(&self.chunks)) > 0 {
            // Views dropped just before may still be on their way out (a
            // lease's release holds its mappings until the reaper runs it).
            crate::reaper::settle(SETTLE_BEFORE_REFUSING);
        }
        // Attaches hand out mappings from these two caches, under their
        // locks (and check that what they hand out is awake): held until
        // the sleep is done, no attach can hand one out after it was
        // counted. Lock order: chunks, then cache, then live.
        let chunks = lock(&self.chunks);
        let cache = lock(&self.cache);
        let live = self.live_mappings();
        if let Some(m) = live
            .iter()
            .find(|m| !matches!(m.mechanism(), Mechanism::Vmm | Mechanism::Fabric))
        {
            return Err(Error::Unsupported {
                what: "sleeping a subscriber",
                why: format!(
                    "it holds a {} mapping at {:#x}, which cannot be mapped again at the same \
                     address; only vmm (and fabric) memory sleeps: attach from a vmm publisher, \
                     or release that attachment first",
                    m.mechanism(),
                    m.base()
                ),
            });
        }
        if check {
            let users = users(&live, &chunks);
            if users > 0 {
                return Err(Error::StillInUse {
                    what: "the subscriber's mappings (a sleep)",
                    users,
                    then: "drop the sets, attachments, rings, views and tensors that hold them \
                           first; to keep them across the sleep, use sleep_unchecked (Python: \
                           sleep(unchecked=True)) and run no work on them until wake()",
                });
            }
        }
        let mut done = Slept::default();
        let mut slept: Vec<&Arc<dyn Mapping>> = Vec::new();
        for m in live.iter().filter(|m| !m.asleep()) {
            // SAFETY: with `check`, nothing but this subscriber holds `m`
            // and no attach can hand it out (the locks above) until it is
            // awake again; without, the caller keeps `sleep_unchecked`'s
            // contract, which is `Mapping::sleep`'s for every mapping.
            if let Err(e) = unsafe { m.sleep() } {
                for back in slept {
                    if let Err(again) = back.wake() {
                        tracing::warn!(error = %again, base = back.base(), "waking a mapping after a failed sleep failed");
                    }
                }
                return Err(e);
            }
            slept.push(m);
            done.mappings += 1;
            done.bytes += m.size();
        }
        drop((cache, chunks));
        Ok(done)
    }

    /// The work of [`Subscriber::wake`](super::Subscriber::wake).
    pub(super) fn do_wake(&self) -> Result<Slept> {
        let mut done = Slept::default();
        for m in self.live_mappings().iter().filter(|m| m.asleep()) {
            m.wake()?;
            done.mappings += 1;
            done.bytes += m.size();
        }
        Ok(done)
    }
}
