//! The two ends of a ring: [`Sender`] (the producer) and [`Receiver`]
//! (the consumer), and the consumer's wait.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering, fence};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::io::Errno;
use rustix::net::{RecvFlags, SendFlags};

use crate::map::Mapping;
use crate::{HEADER_BYTES, ShmError, W_HEAD, W_SLEEPING, W_TAIL};

/// One ring of a mapping: where its header and data words are.
struct RingView {
    map: Arc<Mapping>,
    /// The first word of the header.
    header: usize,
    /// The first word of the data area.
    data: usize,
    /// Data bytes (a power of two, checked when the area was mapped).
    capacity: u64,
}

impl RingView {
    fn new(map: Arc<Mapping>, ring: usize, capacity: usize) -> RingView {
        let header = ring * (HEADER_BYTES + capacity) / 8;
        RingView {
            map,
            header,
            data: header + HEADER_BYTES / 8,
            capacity: capacity as u64,
        }
    }

    fn field(&self, word: usize) -> &AtomicU64 {
        &self.map.words()[self.header + word]
    }

    /// The data word at byte position `pos` (any value: it wraps).
    fn data_word(&self, pos: u64) -> &AtomicU64 {
        let (first, _) = self.data_words(pos, 1);
        &first[0]
    }

    /// The `n` data words (at most the capacity's) from byte position
    /// `pos` (a multiple of 8, any value: it wraps), as the run up to the
    /// end of the data area and the run from its start (empty unless they
    /// wrap): a record is copied in at most two loops over contiguous
    /// words, with no division per word.
    fn data_words(&self, pos: u64, n: usize) -> (&[AtomicU64], &[AtomicU64]) {
        // The capacity is a power of two: the mask is the modulo.
        let words = (self.capacity / 8) as usize;
        let area = &self.map.words()[self.data..self.data + words];
        let start = ((pos / 8) as usize) & (words - 1);
        let first = n.min(words - start);
        (&area[start..start + first], &area[..n - first])
    }
}

/// `bytes` as little-endian words, the last padded with zeros.
fn words_of(bytes: &[u8]) -> impl Iterator<Item = u64> + '_ {
    let full = bytes.chunks_exact(8);
    let rest = full.remainder();
    full.map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .chain((!rest.is_empty()).then(|| {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            u64::from_le_bytes(w)
        }))
}

/// Bytes a record of `len` bytes takes in the ring: its length word and
/// its bytes rounded up to whole words.
fn record_bytes(len: usize) -> u64 {
    8 + (len as u64).div_ceil(8) * 8
}

/// The producer's end of a ring. Not `Clone`: one producer per ring.
pub struct Sender {
    ring: RingView,
    /// Bytes written so far: our own copy, never read back.
    head: u64,
    /// This side's end of the wake-up socket (shared with our receiver):
    /// a byte is sent on it when the consumer sleeps.
    wake: Arc<OwnedFd>,
    wakes: u64,
}

impl std::fmt::Debug for Sender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sender")
            .field("head", &self.head)
            .field("wakes", &self.wakes)
            .finish_non_exhaustive()
    }
}

impl Sender {
    pub(crate) fn new(
        map: Arc<Mapping>,
        ring: usize,
        capacity: usize,
        wake: Arc<OwnedFd>,
    ) -> Sender {
        // An area is split once, new: its counters start at zero (if the
        // peer wrote others, the first check against them fails).
        Sender {
            ring: RingView::new(map, ring, capacity),
            head: 0,
            wake,
            wakes: 0,
        }
    }

    /// The longest record this ring takes, in bytes.
    pub fn max_record(&self) -> usize {
        self.ring.capacity as usize - 8
    }

    /// How many times this sender woke the consumer (it slept).
    pub fn wakes(&self) -> u64 {
        self.wakes
    }

    /// Appends one record and wakes the consumer if it sleeps. `Ok(false)`
    /// when it does not fit now (the ring is full, or the record is longer
    /// than [`max_record`](Self::max_record)): nothing was written.
    /// [`ShmError::Corrupt`] when the consumer's tail is impossible.
    pub fn send(&mut self, record: &[u8]) -> Result<bool, ShmError> {
        let need = record_bytes(record.len());
        if need > self.ring.capacity {
            return Ok(false);
        }
        let tail = self.ring.field(W_TAIL).load(Ordering::Acquire);
        let used = self.head.wrapping_sub(tail);
        if used > self.ring.capacity || !tail.is_multiple_of(8) {
            return Err(ShmError::Corrupt {
                reason: format!(
                    "the consumer's tail {tail} is not within {} bytes below the head {}",
                    self.ring.capacity, self.head
                ),
            });
        }
        if need > self.ring.capacity - used {
            return Ok(false);
        }
        // The length word, then the record's words (`need` covers both
        // and fits in the free space, checked above).
        let (a, b) = self.ring.data_words(self.head, (need / 8) as usize);
        let values = std::iter::once(record.len() as u64).chain(words_of(record));
        for (word, value) in a.iter().chain(b).zip(values) {
            word.store(value, Ordering::Relaxed);
        }
        self.head = self.head.wrapping_add(need);
        self.ring.field(W_HEAD).store(self.head, Ordering::Release);
        // Pairs with the fence in `Receiver::wait`: either it sees the new
        // head, or we see its flag.
        fence(Ordering::SeqCst);
        if self.ring.field(W_SLEEPING).load(Ordering::Relaxed) != 0 {
            self.wake_peer();
        }
        Ok(true)
    }

    /// Sends the consumer a wake-up byte. The send never blocks and
    /// never raises `SIGPIPE`, whatever the peer did to its end (the
    /// flags are per call, not the socket's): a full socket (`EAGAIN`)
    /// holds unread wake-ups already, and any other error means the
    /// peer's end is gone, which the connection's socket reports.
    fn wake_peer(&mut self) {
        self.wakes += 1;
        let _ = rustix::net::send(&*self.wake, &[1], SendFlags::DONTWAIT | SendFlags::NOSIGNAL);
    }
}

/// What [`Receiver::wait`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Ready {
    /// The ring has data (or what claims to be: [`Receiver::recv`] checks).
    Ring,
    /// The other descriptor is readable, hung up or failed.
    Other,
    /// The deadline passed.
    Timeout,
}

/// The consumer's end of a ring. Not `Clone`: one consumer per ring.
pub struct Receiver {
    ring: RingView,
    /// Bytes read so far: our own copy, never read back.
    tail: u64,
    /// This side's end of the wake-up socket (shared with our sender):
    /// the producer sends on it when we sleep.
    wake: Arc<OwnedFd>,
    sleeps: u64,
    /// Wake-ups that found no record and nothing on the other descriptor.
    empty_wakes: u64,
    /// The peer closed its end of the wake-up socket (or it failed): it
    /// can wake us no more, so waits nap as for a flood.
    wake_closed: bool,
}

impl std::fmt::Debug for Receiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Receiver")
            .field("tail", &self.tail)
            .field("sleeps", &self.sleeps)
            .field("empty_wakes", &self.empty_wakes)
            .finish_non_exhaustive()
    }
}

/// Pause instructions between two looks at the ring while spinning.
const SPIN_PAUSES: u32 = 16;

/// While spinning, the other descriptor is polled once every this many looks
/// at the ring (a `poll(2)` costs far more than a look).
const POLL_EVERY: u32 = 4;

/// Wake-ups that bring nothing, within one [`Receiver::wait`], before it
/// stops sleeping on its wake-up socket. A producer following the
/// protocol causes at most one per wait (a wake-up sent for a record the
/// wait took without sleeping, left unread); more is a peer sending
/// wake-ups to make this thread run.
pub const EMPTY_WAKES_TOLERATED: u32 = 8;

/// Past [`EMPTY_WAKES_TOLERATED`], the wait sleeps on the other
/// descriptor alone and looks at the ring after each nap: the first nap
/// this long, each next one twice the last, up to [`IGNORED_NAP_MAX`].
pub const IGNORED_NAP_MIN: Duration = Duration::from_millis(1);

/// The longest nap of a wait that ignores its wake-up socket: the most a
/// record from a peer that floods it (or closed its end) waits before it
/// is seen.
pub const IGNORED_NAP_MAX: Duration = Duration::from_millis(16);

/// Unread wake-up bytes taken per `recv(2)`, and `recv`s per wake-up at
/// most: a peer that filled the socket costs one wake-up a few calls, and
/// what is left keeps the socket readable, which counts as a wake-up with
/// nothing to take (see [`EMPTY_WAKES_TOLERATED`]).
const DRAIN_BYTES: usize = 256;
const DRAIN_CALLS: usize = 4;

impl Receiver {
    pub(crate) fn new(
        map: Arc<Mapping>,
        ring: usize,
        capacity: usize,
        wake: Arc<OwnedFd>,
    ) -> Receiver {
        Receiver {
            ring: RingView::new(map, ring, capacity),
            tail: 0,
            wake,
            sleeps: 0,
            empty_wakes: 0,
            wake_closed: false,
        }
    }

    /// How many times this receiver slept in `poll(2)`.
    pub fn sleeps(&self) -> u64 {
        self.sleeps
    }

    /// How many times its wake-up socket woke it with nothing to take: no
    /// record, nothing on the other descriptor (see [`wait`](Self::wait)).
    pub fn empty_wakes(&self) -> u64 {
        self.empty_wakes
    }

    /// Whether the peer closed its end of the wake-up socket (it can no
    /// longer wake this receiver, whose waits then nap; see
    /// [`wait`](Self::wait)).
    pub fn wake_closed(&self) -> bool {
        self.wake_closed
    }

    /// Whether the producer's head differs from our tail: a record to
    /// read, or a corruption that [`recv`](Self::recv) reports.
    pub fn has_data(&self) -> bool {
        self.ring.field(W_HEAD).load(Ordering::Acquire) != self.tail
    }

    /// Takes the next record into `out` (replacing its contents):
    /// `Ok(true)` if there was one, `Ok(false)` if the ring is empty.
    /// The record is copied out of shared memory before this returns, and
    /// its space given back to the producer.
    pub fn recv(&mut self, out: &mut Vec<u8>) -> Result<bool, ShmError> {
        // The head is loaded once: everything below is checked against
        // this value and the private tail.
        let head = self.ring.field(W_HEAD).load(Ordering::Acquire);
        let used = head.wrapping_sub(self.tail);
        if used == 0 {
            return Ok(false);
        }
        let corrupt = |reason: String| Err(ShmError::Corrupt { reason });
        if used > self.ring.capacity || !used.is_multiple_of(8) {
            return corrupt(format!(
                "the producer's head {head} is not a whole number of words within {} bytes \
                 above the tail {}",
                self.ring.capacity, self.tail
            ));
        }
        let len = self.ring.data_word(self.tail).load(Ordering::Relaxed);
        let avail = used - 8;
        if len > avail {
            return corrupt(format!(
                "a record claims {len} bytes, but only {avail} were written"
            ));
        }
        let len = len as usize;
        out.clear();
        // Whole words (the last one's padding is cut off below); `len`
        // is within what was written, so within the capacity.
        let words = len.div_ceil(8);
        out.resize(words * 8, 0);
        let (a, b) = self.ring.data_words(self.tail.wrapping_add(8), words);
        for (bytes, word) in out.chunks_exact_mut(8).zip(a.iter().chain(b)) {
            bytes.copy_from_slice(&word.load(Ordering::Relaxed).to_le_bytes());
        }
        out.truncate(len);
        self.tail = self.tail.wrapping_add(record_bytes(len));
        self.ring.field(W_TAIL).store(self.tail, Ordering::Release);
        Ok(true)
    }

    /// Waits until the ring has data, `other` (the socket) is readable or
    /// hung up, or `deadline` passes: first by spinning for up to `spin`
    /// (looking at the ring, and now and then polling `other`), then by
    /// setting the sleeping flag, looking once more, and sleeping in
    /// `poll(2)` on the wake-up socket and `other`. A zero spin sleeps at
    /// once; a deadline already past still reports what is ready now.
    ///
    /// A peer can send wake-ups without a record, to make this thread
    /// run. After [`EMPTY_WAKES_TOLERATED`] such wake-ups in one wait, the
    /// wait stops polling the wake-up socket: it sleeps on `other` alone
    /// (or just sleeps) in naps from [`IGNORED_NAP_MIN`] doubling to
    /// [`IGNORED_NAP_MAX`], looking at the ring after each. The flood then
    /// costs this thread a wake-up per nap, not per send, and a record
    /// from such a peer waits up to one nap; a peer that follows the
    /// protocol never gets there. A peer that closed its end of the
    /// wake-up socket is treated so from then on, in every wait.
    ///
    /// Nothing the peer does to its descriptors makes this block past the
    /// deadline: the wake-up socket is read with `MSG_DONTWAIT`, whatever
    /// the socket's own flags say.
    ///
    /// # References
    /// [poll(2)](https://man7.org/linux/man-pages/man2/poll.2.html),
    /// [recv(2)](https://man7.org/linux/man-pages/man2/recv.2.html).
    pub fn wait(
        &mut self,
        spin: Duration,
        deadline: Option<Instant>,
        other: Option<BorrowedFd<'_>>,
    ) -> Result<Ready, ShmError> {
        if self.has_data() {
            return Ok(Ready::Ring);
        }
        if !spin.is_zero() {
            let end = Instant::now() + spin;
            let end = deadline.map_or(end, |d| d.min(end));
            let mut looks = 0u32;
            while Instant::now() < end {
                for _ in 0..SPIN_PAUSES {
                    std::hint::spin_loop();
                }
                if self.has_data() {
                    return Ok(Ready::Ring);
                }
                looks += 1;
                if looks.is_multiple_of(POLL_EVERY) && other.is_some_and(ready_now) {
                    return Ok(Ready::Other);
                }
            }
        }
        let flag = self.ring.field(W_SLEEPING);
        // Empty wake-ups in this wait, and the nap while the wake-up
        // socket is ignored.
        let (mut empty, mut ignored_nap) = (0u32, Duration::ZERO);
        loop {
            flag.store(1, Ordering::Relaxed);
            // Pairs with the fence in `Sender::send`.
            fence(Ordering::SeqCst);
            if self.has_data() {
                flag.store(0, Ordering::Relaxed);
                return Ok(Ready::Ring);
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            let ignoring = self.wake_closed || empty >= EMPTY_WAKES_TOLERATED;
            if ignoring {
                ignored_nap = (ignored_nap * 2).clamp(IGNORED_NAP_MIN, IGNORED_NAP_MAX);
            }
            let nap = [left, ignoring.then_some(ignored_nap)]
                .into_iter()
                .flatten()
                .min();
            let timeout = nap.map(|d| {
                Timespec::try_from(d).unwrap_or(Timespec {
                    tv_sec: i64::MAX,
                    tv_nsec: 0,
                })
            });
            let mut fds = Vec::with_capacity(2);
            if !ignoring {
                fds.push(PollFd::new(&*self.wake, PollFlags::IN));
            }
            if let Some(o) = other {
                fds.push(PollFd::from_borrowed_fd(o, PollFlags::IN));
            }
            self.sleeps += 1;
            let polled = poll(&mut fds, timeout.as_ref());
            flag.store(0, Ordering::Relaxed);
            // Readable, hung up or failed: the drain tells which.
            let woke = !ignoring && !fds[0].revents().is_empty();
            let other_ready = fds
                .get(usize::from(!ignoring))
                .is_some_and(|f| !f.revents().is_empty());
            drop(fds);
            match polled {
                Ok(_) | Err(Errno::INTR) => {}
                Err(e) => return Err(ShmError::io("poll on the ring's wake-up socket failed", e)),
            }
            if woke && drain_wakes(&self.wake) {
                self.wake_closed = true;
            }
            if other_ready {
                return Ok(Ready::Other);
            }
            if self.has_data() {
                return Ok(Ready::Ring);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(Ready::Timeout);
            }
            if woke {
                empty += 1;
                self.empty_wakes += 1;
            }
        }
    }
}

/// Reads the wake-up bytes waiting on `wake` (never blocking: the flag is
/// per call): whether the socket is closed at the peer's end or failed.
fn drain_wakes(wake: &OwnedFd) -> bool {
    let mut buf = [0u8; DRAIN_BYTES];
    for _ in 0..DRAIN_CALLS {
        match rustix::net::recv(wake, &mut buf, RecvFlags::DONTWAIT) {
            Ok((n, _)) if n == DRAIN_BYTES => {}
            Ok((0, _)) => return true,
            Ok(_) | Err(Errno::AGAIN | Errno::INTR) => return false,
            Err(_) => return true,
        }
    }
    false
}

/// Whether `fd` is readable, hung up or failed now.
fn ready_now(fd: BorrowedFd<'_>) -> bool {
    let mut p = [PollFd::from_borrowed_fd(fd, PollFlags::IN)];
    let zero = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    matches!(poll(&mut p, Some(&zero)), Ok(n) if n > 0)
}
