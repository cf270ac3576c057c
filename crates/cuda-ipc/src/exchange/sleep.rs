//! A subscriber's sleep and wake: every mapping it holds unmapped at once,
//! its addresses kept, then mapped again at the same addresses (issue 26:
//! CUDA graphs captured over attached weights stay valid across a sleep).
//!
//! What sleeps: every mapping the subscriber opened that is still alive
//! (the chunks of attached sets, cached or held, and per-buffer mappings),
//! each through [`Mapping::sleep`]. Leases are kept: the publisher still
//! counts the memory as in use, and the physical memory stays where it is
//! (the subscriber gives back its mappings, not the memory). Only vmm and
//! fabric mappings can sleep; a subscriber holding legacy or pool mappings
//! is refused before anything is unmapped.
//!
//! While it sleeps, the subscriber's tensors and views point at reserved,
//! unmapped addresses: a kernel or copy through them faults (the caller
//! must not run work on them); an attach that would hand out a sleeping
//! mapping is refused until [`Subscriber::wake`]; an attach of memory not
//! mapped before maps it awake, and a later wake leaves it as it is.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::mechanism::Mechanism;
use crate::memory::buffer::Mapping;

use super::lock;
use super::subscriber::Subscriber;

/// What a sleep or a wake did: how many mappings, of how many bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Slept {
    /// Mappings unmapped (sleep) or mapped again (wake).
    pub mappings: usize,
    /// Their bytes.
    pub bytes: u64,
}

impl Subscriber {
    /// The live mappings, each once.
    fn live_mappings(&self) -> Vec<Arc<dyn Mapping>> {
        let mut live = lock(&self.live);
        live.retain(|w| w.strong_count() > 0);
        let mut out: Vec<Arc<dyn Mapping>> =
            live.iter().filter_map(std::sync::Weak::upgrade).collect();
        out.sort_by_key(|m| m.base());
        out.dedup_by_key(|m| m.base());
        out
    }

    /// Unmaps every mapping this subscriber holds, keeping their address
    /// ranges and leases (its tensors then point at unmapped addresses: run
    /// no work on them until [`Subscriber::wake`]); blocks until the work
    /// queued through them has finished. Mappings that already sleep are
    /// left as they are. Refused, before anything is unmapped, when a
    /// mapping cannot sleep (legacy IPC or pool memory: [`Error::Unsupported`]).
    /// If one fails, those put to sleep by this call are woken again.
    pub fn sleep(&self) -> Result<Slept> {
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
        let mut done = Slept::default();
        let mut slept: Vec<&Arc<dyn Mapping>> = Vec::new();
        for m in live.iter().filter(|m| !m.asleep()) {
            if let Err(e) = m.sleep() {
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
        Ok(done)
    }

    /// Maps every sleeping mapping of this subscriber again at the
    /// addresses it had, with the access it had. Returns what it mapped;
    /// the first failure stops it (the rest still sleep: call again).
    pub fn wake(&self) -> Result<Slept> {
        let mut done = Slept::default();
        for m in self.live_mappings().iter().filter(|m| m.asleep()) {
            m.wake()?;
            done.mappings += 1;
            done.bytes += m.size();
        }
        Ok(done)
    }

    /// Whether any mapping of this subscriber sleeps.
    pub fn asleep(&self) -> bool {
        self.live_mappings().iter().any(|m| m.asleep())
    }
}
