//! How a subscriber's streams wait for the publisher's work: interprocess
//! events, or GPU-side fences where events cannot be opened.
//!
//! Every publish, update and ring frame records the publisher's event *and*
//! (unless [`PublisherConfig::fences`](super::PublisherConfig) is off)
//! signals a fence word: the stream that did the work writes the sequence
//! number after it (`cuStreamWriteValue64`, one stream operation). The
//! fence block is a sealed memfd of host words ([`Fence::new_host`]), which
//! travels as one more file descriptor beside the entry's, so it needs no
//! `/dev/shm`, no visible pid and no shared user: it works wherever the
//! channel does.
//!
//! The subscriber chooses ([`SyncMode`]): the event where it can open it,
//! else the fence (`Auto`, the default); or one of them always. A fence
//! wait is first a host-side wait with a deadline
//! ([`FenceMapping::wait_within`]), so no stream ever waits for a publisher
//! that is gone: when the socket says it is gone, the fence is abandoned
//! ([`FenceMapping::abandon`]) and the call fails with
//! [`ChannelError::PeerGone`].
//!
//! # Layout of a publisher's block
//! Entry `i` (in the order of publishing; freed words are reused) owns
//! words `2i` and `2i + 1`: the device signals `2i` after each publish or
//! update, and the host writes into `2i + 1` the last sequence number
//! queued ([`Fence::announce`]), which a subscriber that attaches late
//! reads to know what to wait for. A ring has a block of its own, one word
//! per slot, signalled with the ring's frame counter.
//!
//! # Sets and arena buffers
//! A set (or an arena buffer, a set of one) takes one entry slot for the
//! whole set: [`Publisher::publish_set`](super::Publisher::publish_set) and
//! [`Publisher::update_set`](super::Publisher::update_set) signal it after
//! the work queued on the set's streams. Its [`FenceMeta`] travels beside
//! the set record, under [`SET_FENCE_KEY`] of the entry's metadata (the
//! exchange takes it off before the record is decoded), and the block's
//! file descriptor is the set entry's only one. The slot stays taken while
//! the set is published and, after that, until its last lease ends
//! ([`FenceSlot`]).

use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::CudaStream;
use serde::{Deserialize, Serialize};

use crate::channel::ChannelError;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::event::IpcEvent;
use crate::fence::{Fence, FenceMapping};

use super::lock;
use super::wire::{FenceMeta, UpdateBody};

/// How a subscriber's streams wait for the publisher's work.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum SyncMode {
    /// The interprocess event where it opens, else the fence (when the
    /// publisher sends one). The default.
    #[default]
    Auto,
    /// Always the interprocess event: fails where it cannot be opened (a
    /// consumer with its own `/dev/shm`).
    Event,
    /// Always the fence: fails if the publisher sends none.
    Fence,
    /// The fence, waited on by the calling thread only (`host-fence`): once
    /// the host has seen the fence word reach the sequence number, the
    /// publisher's work is complete and its writes visible, so the stream
    /// gets no wait operation and the consumer's context runs nothing for
    /// the hand-off itself (on a GPU time-sliced between the two
    /// processes, each stream operation costs a context switch). The
    /// calling thread blocks until the publisher's work is done, which
    /// [`Fence`](SyncMode::Fence) leaves to the stream. Fails if the
    /// publisher sends no fence.
    HostFence,
}

impl std::str::FromStr for SyncMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(SyncMode::Auto),
            "event" => Ok(SyncMode::Event),
            "fence" => Ok(SyncMode::Fence),
            "host-fence" => Ok(SyncMode::HostFence),
            other => Err(Error::arg(
                "sync mode",
                format!("{other:?} is not one of auto, event, fence, host-fence"),
            )),
        }
    }
}

/// The publisher's fence block for entries: two words per entry.
#[derive(Debug)]
pub(super) struct EntryFences {
    fence: Fence,
    /// Which entry slots are in use.
    slots: Arc<Mutex<Slots>>,
}

/// How many entries one publisher's block serves at once.
pub(super) const ENTRY_SLOTS: u32 = 1024;

/// Which entry slots of a fence block are in use.
#[derive(Debug)]
pub(super) struct Slots {
    used: Vec<bool>,
}

impl Slots {
    /// `n` free slots.
    pub(super) fn new(n: u32) -> Arc<Mutex<Self>> {
        Arc::new(Mutex::new(Slots {
            used: vec![false; n as usize],
        }))
    }

    fn take(&mut self) -> Option<u32> {
        let i = self.used.iter().position(|u| !u)?;
        self.used[i] = true;
        Some(i as u32)
    }

    fn give_back(&mut self, slot: u32) {
        if let Some(u) = self.used.get_mut(slot as usize) {
            *u = false;
        }
    }

    /// Slots in use.
    #[cfg(test)]
    pub(super) fn in_use(&self) -> usize {
        self.used.iter().filter(|u| **u).count()
    }
}

/// An entry slot held by a set: given back when dropped (when the set is
/// unpublished and its last lease has ended).
#[derive(Debug)]
pub(super) struct FenceSlot {
    slots: Arc<Mutex<Slots>>,
    slot: u32,
}

impl FenceSlot {
    /// Takes a free slot of `slots`; `None` when all are in use.
    pub(super) fn take(slots: &Arc<Mutex<Slots>>) -> Option<Self> {
        let slot = lock(slots).take()?;
        Some(FenceSlot {
            slots: slots.clone(),
            slot,
        })
    }

    /// The slot's index.
    pub(super) fn slot(&self) -> u32 {
        self.slot
    }
}

impl Drop for FenceSlot {
    fn drop(&mut self) {
        lock(&self.slots).give_back(self.slot);
    }
}

impl EntryFences {
    /// A block for [`ENTRY_SLOTS`] entries; `None` (logged) where the device
    /// cannot signal fences, so that publishing still works with events.
    pub(super) fn new(device: &Device) -> Option<Self> {
        match Fence::new_host(device, 2 * ENTRY_SLOTS) {
            Ok(fence) => Some(EntryFences {
                fence,
                slots: Slots::new(ENTRY_SLOTS),
            }),
            Err(e) => {
                tracing::warn!(error = %e, "publishing without fences (events only)");
                None
            }
        }
    }

    /// Takes a free entry slot; `None` when all are in use (the entry then
    /// goes without a fence).
    pub(super) fn take(&mut self) -> Option<u32> {
        lock(&self.slots).take()
    }

    /// Takes a free entry slot for a set, given back when the returned
    /// guard drops; `None` when all are in use.
    pub(super) fn take_held(&self) -> Option<FenceSlot> {
        FenceSlot::take(&self.slots)
    }

    /// Gives an entry slot back (after its last lease is released).
    pub(super) fn give_back(&mut self, slot: u32) {
        lock(&self.slots).give_back(slot);
    }

    /// Signals entry `slot`'s next sequence number after the work queued on
    /// `stream`, and announces it.
    pub(super) fn signal(&self, stream: &Arc<CudaStream>, slot: u32) -> Result<u64> {
        let word = 2 * slot;
        let seq = self.fence.last_signalled(word)? + 1;
        self.fence.signal(stream, word, seq)?;
        self.fence.announce(word + 1, seq)?;
        Ok(seq)
    }

    /// The metadata and the file descriptor for entry `slot`, whose file
    /// descriptor will be the entry's `fd_index`-th.
    pub(super) fn export(&self, slot: u32, fd_index: usize) -> Result<(FenceMeta, OwnedFd)> {
        export(&self.fence, 2 * slot, Some(2 * slot + 1), fd_index)
    }
}

/// What a set entry carries for its fence: the metadata (beside the
/// record), the block's file descriptor and the slot it holds.
#[derive(Debug)]
pub(super) struct SetFence {
    /// The metadata, put under [`SET_FENCE_KEY`].
    pub(super) meta: FenceMeta,
    /// The block's file descriptor (the entry's only one).
    pub(super) fd: OwnedFd,
    /// The slot, held while the set is published and leased.
    pub(super) slot: FenceSlot,
}

/// The key of a set entry's metadata that carries its [`FenceMeta`].
pub(super) const SET_FENCE_KEY: &str = "cuda_ipc_fence";

/// Puts a fence's metadata `v`, as a JSON value, into a set entry's
/// metadata `meta` (a JSON object).
pub(super) fn put_set_fence(meta: &mut serde_json::Value, v: serde_json::Value) -> Result<()> {
    match meta.as_object_mut() {
        Some(m) => {
            m.insert(SET_FENCE_KEY.into(), v);
            Ok(())
        }
        None => Err(Error::arg(
            "set entry",
            "its metadata is not a JSON object, so it cannot carry a fence",
        )),
    }
}

/// Takes a set entry's fence off its metadata (so that the record decodes
/// strictly); `None` when the publisher sent none.
pub(super) fn take_set_fence(meta: &mut serde_json::Value) -> Result<Option<FenceMeta>> {
    let Some(v) = meta.as_object_mut().and_then(|m| m.remove(SET_FENCE_KEY)) else {
        return Ok(None);
    };
    FenceMeta::deserialize(v)
        .map(Some)
        .map_err(|e| Error::Descriptor {
            field: SET_FENCE_KEY.into(),
            reason: format!("expected a fence (block, fd, word, announce): {e}"),
        })
}

/// Takes the fence's file descriptor (number `fence.fd`) out of an entry's
/// `fds`, checking that it is there.
pub(super) fn take_fence_fd(
    fence: Option<FenceMeta>,
    fds: &mut Vec<OwnedFd>,
) -> Result<Option<(OwnedFd, FenceMeta)>> {
    match fence {
        Some(f) if f.fd < fds.len() => Ok(Some((fds.remove(f.fd), f))),
        Some(f) => Err(Error::Descriptor {
            field: "fence.fd".into(),
            reason: format!(
                "the fence's file descriptor is number {} of the entry's, which has {}",
                f.fd,
                fds.len()
            ),
        }),
        None => Ok(None),
    }
}

/// A ring's fence block: one word per slot.
pub(super) fn ring_fence(device: &Device, slots: usize) -> Option<Fence> {
    let words = u32::try_from(slots).ok()?;
    match Fence::new_host(device, words) {
        Ok(f) => Some(f),
        Err(e) => {
            tracing::warn!(error = %e, "ring without fences (events only)");
            None
        }
    }
}

/// The metadata and file descriptor of `word` of `fence`.
pub(super) fn export(
    fence: &Fence,
    word: u32,
    announce: Option<u32>,
    fd_index: usize,
) -> Result<(FenceMeta, OwnedFd)> {
    let e = fence.export()?;
    let fd = e.fds.into_iter().next().ok_or_else(|| Error::Unsupported {
        what: "fences over the channel",
        why: "the fence block exported no file descriptor".into(),
    })?;
    Ok((
        FenceMeta {
            block: e.block,
            fd: fd_index,
            word,
            announce,
        },
        fd,
    ))
}

/// How one attached buffer or ring slot waits.
#[derive(Debug, Clone)]
pub(crate) enum Waiter {
    /// On the publisher's interprocess event.
    Event(Arc<IpcEvent>),
    /// On a word of a mapped fence block.
    Fence {
        /// The block.
        mapping: Arc<FenceMapping>,
        /// The word the device signals.
        word: u32,
        /// The word announcing what to wait for, for entries.
        announce: Option<u32>,
        /// Whether the host's wait is all ([`SyncMode::HostFence`]): no
        /// stream operation once the host has seen the word.
        host_only: bool,
    },
}

/// How often a fence wait checks whether the publisher is still there.
const SLICE: Duration = Duration::from_millis(50);

impl Waiter {
    /// Whether this waits on a fence.
    pub(crate) fn is_fence(&self) -> bool {
        matches!(self, Waiter::Fence { .. })
    }

    /// Whether it waits on a fence from the host only
    /// ([`SyncMode::HostFence`] on a fence in host memory): no stream
    /// operation per wait.
    pub(crate) fn is_host_only(&self) -> bool {
        matches!(
            self,
            Waiter::Fence {
                host_only: true,
                mapping,
                ..
            } if mapping.block().is_host()
        )
    }

    /// Makes `stream` wait for the publisher's latest work (at attach): the
    /// event's last record, or the fence's announced sequence number.
    pub(super) fn wait_latest(
        &self,
        stream: &Arc<CudaStream>,
        alive: &dyn Fn() -> bool,
        timeout: Duration,
    ) -> Result<()> {
        match self {
            Waiter::Event(e) => e.wait_on(stream),
            Waiter::Fence {
                mapping, announce, ..
            } => {
                let seq = match announce {
                    Some(a) => mapping.value(*a)?,
                    None => 0,
                };
                self.wait_seq(stream, seq, alive, timeout)
            }
        }
    }

    /// Makes `stream` wait for the work of the update whose notice carried
    /// `data`: the event's last record, or the fence's sequence number the
    /// notice names.
    pub(super) fn wait_update(
        &self,
        stream: &Arc<CudaStream>,
        data: &serde_json::Value,
        alive: &dyn Fn() -> bool,
        timeout: Duration,
    ) -> Result<()> {
        if let Waiter::Event(e) = self {
            return e.wait_on(stream);
        }
        match update_seq(data)? {
            Some(seq) => self.wait_seq(stream, seq, alive, timeout),
            None => Err(Error::arg(
                "update notice",
                "it has no fence sequence number, but this attachment waits on the fence",
            )),
        }
    }

    /// Makes `stream` wait until sequence number `seq` (0: nothing yet) was
    /// signalled; for an event, its last record.
    pub(super) fn wait_seq(
        &self,
        stream: &Arc<CudaStream>,
        seq: u64,
        alive: &dyn Fn() -> bool,
        timeout: Duration,
    ) -> Result<()> {
        let (mapping, word) = match self {
            Waiter::Event(e) => return e.wait_on(stream),
            Waiter::Fence { mapping, word, .. } => (mapping, *word),
        };
        if seq == 0 {
            return Ok(());
        }
        // Host words are written by the publisher's stream after its work
        // (with the write's memory barrier): seen here, the work is done.
        let host_only = self.is_host_only();
        let deadline = crate::channel::deadline_in(timeout);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let reached = if host_only {
                mapping.wait_host(word, seq, left.min(SLICE))?
            } else {
                mapping.wait_within(stream, word, seq, left.min(SLICE))?
            };
            if reached {
                return Ok(());
            }
            if !alive() {
                // Release any stream of ours already waiting on the word.
                mapping.abandon(Some(word))?;
                return Err(ChannelError::PeerGone.into());
            }
            if left.is_zero() {
                return Err(ChannelError::Timeout {
                    what: format!("the publisher's work before fence sequence number {seq}"),
                    after: timeout,
                }
                .into());
            }
        }
    }
}

/// The fence sequence number an update notice's `data` carries.
fn update_seq(data: &serde_json::Value) -> Result<Option<u64>> {
    UpdateBody::deserialize(data)
        .map(|n| n.fence_seq)
        .map_err(|e| Error::arg("update notice", e.to_string()))
}

/// Chooses how to wait, per `mode`: opens the event (`event`, through the
/// subscriber's cache) or the fence (`fence`, through its cache).
pub(super) fn choose(
    mode: SyncMode,
    event: impl FnOnce() -> Result<Arc<IpcEvent>>,
    fence: Option<(&FenceMeta, impl FnOnce() -> Result<Arc<FenceMapping>>)>,
) -> Result<Waiter> {
    let host_only = mode == SyncMode::HostFence;
    let open_fence = |(meta, open): (&FenceMeta, _)| -> Result<Waiter> {
        let open: Box<dyn FnOnce() -> Result<Arc<FenceMapping>>> = Box::new(open);
        Ok(Waiter::Fence {
            mapping: open()?,
            word: meta.word,
            announce: meta.announce,
            host_only,
        })
    };
    match mode {
        SyncMode::Event => Ok(Waiter::Event(event()?)),
        SyncMode::Fence | SyncMode::HostFence => match fence {
            Some(f) => open_fence(f),
            None => Err(Error::Unsupported {
                what: "fence synchronisation",
                why: "the publisher sends no fence (it runs an older version, turned fences \
                      off, or its device cannot signal them); use SyncMode::Event or Auto"
                    .into(),
            }),
        },
        SyncMode::Auto => match event() {
            Ok(e) => Ok(Waiter::Event(e)),
            Err(e) => match fence {
                Some(f) => {
                    tracing::info!(error = %e, "the publisher's event cannot be opened here; using its fence");
                    open_fence(f)
                }
                None => Err(e),
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fence::FenceBlock;

    #[test]
    fn sync_modes_parse_and_serialise() {
        for (s, m) in [
            ("auto", SyncMode::Auto),
            ("event", SyncMode::Event),
            ("fence", SyncMode::Fence),
            ("host-fence", SyncMode::HostFence),
        ] {
            assert_eq!(s.parse::<SyncMode>().unwrap(), m);
            assert_eq!(serde_json::to_value(m).unwrap(), s);
        }
        let e = "fences".parse::<SyncMode>().unwrap_err();
        assert!(
            e.to_string().contains("auto, event, fence, host-fence"),
            "{e}"
        );
        assert_eq!(SyncMode::default(), SyncMode::Auto);
    }

    #[test]
    fn fence_meta_decodes_strictly() {
        let block = FenceBlock::host(5, 42, (1 << 39) | 3, 8).unwrap();
        let meta = FenceMeta {
            block,
            fd: 1,
            word: 2,
            announce: Some(3),
        };
        let v = serde_json::to_value(&meta).unwrap();
        let back: FenceMeta = serde_json::from_value(v.clone()).unwrap();
        assert_eq!(back, meta);
        let mut extra = v.clone();
        extra["surprise"] = 1.into();
        assert!(serde_json::from_value::<FenceMeta>(extra).is_err());
        let mut ring = v;
        ring.as_object_mut().unwrap().remove("announce");
        let ring: FenceMeta = serde_json::from_value(ring).unwrap();
        assert_eq!(ring.announce, None);
    }

    type OpenFence = fn() -> Result<Arc<FenceMapping>>;

    #[test]
    fn auto_falls_back_to_the_fence_only_when_the_event_fails() {
        let no_fence: Option<(&FenceMeta, OpenFence)> = None;
        let failed = || Err(Error::arg("event", "cannot be opened here"));
        let e = choose(SyncMode::Auto, failed, no_fence).unwrap_err();
        assert!(e.to_string().contains("cannot be opened"), "{e}");
        for mode in [SyncMode::Fence, SyncMode::HostFence] {
            let e = choose(mode, failed, no_fence).unwrap_err();
            assert!(e.to_string().contains("sends no fence"), "{e}");
        }
        let block = FenceBlock::host(5, 42, (1 << 39) | 3, 8).unwrap();
        let meta = FenceMeta {
            block,
            fd: 0,
            word: 0,
            announce: None,
        };
        // The fence is tried after the event failed: its own error shows.
        let fence_fails = || -> Result<Arc<FenceMapping>> { Err(Error::arg("fence", "tried")) };
        let e = choose(SyncMode::Auto, failed, Some((&meta, fence_fails))).unwrap_err();
        assert!(e.to_string().contains("tried"), "{e}");
        let e = choose(SyncMode::Event, failed, Some((&meta, fence_fails))).unwrap_err();
        assert!(e.to_string().contains("cannot be opened"), "{e}");
    }

    #[test]
    fn set_fences_travel_beside_the_record_and_come_off_before_it_decodes() {
        let block = FenceBlock::host(0, 42, (1 << 39) | 3, 2048).unwrap();
        let meta = FenceMeta {
            block,
            fd: 0,
            word: 10,
            announce: Some(11),
        };
        let record = serde_json::json!({ "cuda_ipc_set": 1, "name": "w" });
        let mut v = record.clone();
        put_set_fence(&mut v, super::super::wire::to_value(&meta).unwrap()).unwrap();
        assert_eq!(v[SET_FENCE_KEY]["word"], 10);
        assert_eq!(take_set_fence(&mut v).unwrap(), Some(meta.clone()));
        assert_eq!(v, record, "only the fence comes off");
        assert_eq!(take_set_fence(&mut v).unwrap(), None, "none sent: none");
        // A fence that is not one is an error that names the key.
        let mut bad = record.clone();
        bad[SET_FENCE_KEY] = serde_json::json!({ "word": "ten" });
        let e = take_set_fence(&mut bad).unwrap_err();
        assert!(e.to_string().contains(SET_FENCE_KEY), "{e}");
        let mut not_object = serde_json::json!([1]);
        let e = put_set_fence(
            &mut not_object,
            super::super::wire::to_value(&meta).unwrap(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("not a JSON object"), "{e}");
        assert_eq!(take_set_fence(&mut not_object).unwrap(), None);
    }

    fn memfd() -> OwnedFd {
        rustix::fs::memfd_create("cuda-ipc-test-fence", rustix::fs::MemfdFlags::CLOEXEC).unwrap()
    }

    #[test]
    fn the_fence_descriptor_comes_out_of_the_entry_descriptors_by_index() {
        use std::os::fd::AsRawFd;
        let block = FenceBlock::host(0, 42, 7, 8).unwrap();
        let meta = |fd| FenceMeta {
            block: block.clone(),
            fd,
            word: 0,
            announce: None,
        };
        let mut fds = vec![memfd(), memfd(), memfd()];
        let raw: Vec<i32> = fds.iter().map(AsRawFd::as_raw_fd).collect();
        let (fd, m) = take_fence_fd(Some(meta(1)), &mut fds).unwrap().unwrap();
        assert_eq!(fd.as_raw_fd(), raw[1]);
        assert_eq!(m.fd, 1);
        let left: Vec<i32> = fds.iter().map(AsRawFd::as_raw_fd).collect();
        assert_eq!(
            left,
            [raw[0], raw[2]],
            "the memory's descriptors stay in order"
        );
        let e = take_fence_fd(Some(meta(2)), &mut fds).unwrap_err();
        assert!(
            e.to_string()
                .contains("number 2 of the entry's, which has 2"),
            "{e}"
        );
        assert!(take_fence_fd(None, &mut fds).unwrap().is_none());
        assert_eq!(fds.len(), 2);
    }

    #[test]
    fn a_set_holds_its_fence_slot_until_the_guard_drops() {
        let slots = Slots::new(2);
        let a = FenceSlot::take(&slots).unwrap();
        let b = FenceSlot::take(&slots).unwrap();
        assert_ne!(a.slot(), b.slot());
        assert!(FenceSlot::take(&slots).is_none(), "all in use");
        assert_eq!(lock(&slots).in_use(), 2);
        let freed = a.slot();
        drop(a);
        assert_eq!(lock(&slots).in_use(), 1);
        let c = FenceSlot::take(&slots).unwrap();
        assert_eq!(c.slot(), freed, "a freed slot is reused");
        drop((b, c));
        assert_eq!(lock(&slots).in_use(), 0);
    }
}
