//! Spins: how a waiting thread polls before it sleeps (the back-off of a
//! spin that catches nothing, the server-wide limit on spinning threads,
//! the polling loop). How long it spins is the configs' `spin` field.

use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec, poll};

/// The most waits a [`Backoff`] lets sleep at once after spins that
/// caught nothing, before it tries a spin again.
pub(crate) const MAX_SKIPPED_SPINS: u32 = 63;

/// Spins in a row that may catch nothing before a [`Backoff`] skips any.
pub(crate) const TOLERATED_MISSES: u32 = 3;

/// When a waiting thread spins: after a spin that caught the message, or
/// fewer than [`TOLERATED_MISSES`] in a row that caught nothing, the next
/// wait spins; after more, the next `1, 3, 7, …, 63` waits sleep at once.
/// So a peer whose messages come close together now and then (an attach
/// after a pause, then its release at once) keeps the spin, and one whose
/// messages never come within it (paced far apart, or sharing this
/// thread's core, so that it cannot run while we spin) soon costs at most
/// one spin in 64 waits.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Backoff {
    /// Spins in a row that caught nothing.
    misses: u32,
    /// Waits left to sleep at once.
    skip: u32,
}

impl Backoff {
    /// How long the next wait spins, of at most `spin`.
    pub(crate) fn next(&mut self, spin: Duration) -> Duration {
        if self.skip > 0 {
            self.skip -= 1;
            Duration::ZERO
        } else {
            spin
        }
    }

    /// Records how a wait that spun for `spun` ended: `waited` after it
    /// began (a wait that ended within its spin caught its message).
    pub(crate) fn record(&mut self, spun: Duration, waited: Duration) {
        if spun.is_zero() {
            return;
        }
        if waited < spun {
            self.misses = 0;
        } else {
            self.misses = (self.misses + 1).min(TOLERATED_MISSES + 6);
            if self.misses > TOLERATED_MISSES {
                self.skip = (1 << (self.misses - TOLERATED_MISSES)) - 1;
            }
            debug_assert!(self.skip <= MAX_SKIPPED_SPINS);
        }
    }
}

/// How many threads may spin at once, server-wide: however many
/// connections its clients open and however they time their messages,
/// the readers' spins take at most this many cores; a reader that finds
/// every place taken sleeps at once, as without a spin. Connections of
/// users other than the server's own take at most half of the places
/// (none where there is one): however busy they keep their readers, the
/// server's own user finds a place to spin, and its requests are
/// answered without a thread wake-up.
#[derive(Debug)]
pub(crate) struct Spinners {
    busy: AtomicUsize,
    /// Of `busy`, the places held for other users' connections.
    foreign: AtomicUsize,
    max: usize,
}

/// A place among the [`Spinners`], given back when dropped.
pub(crate) struct SpinSlot<'a> {
    spinners: &'a Spinners,
    foreign: bool,
}

impl Drop for SpinSlot<'_> {
    fn drop(&mut self) {
        if self.foreign {
            self.spinners.foreign.fetch_sub(1, Ordering::Release);
        }
        self.spinners.busy.fetch_sub(1, Ordering::Release);
    }
}

/// Takes a place in `count` if it holds fewer than `max`.
fn take(count: &AtomicUsize, max: usize) -> bool {
    let mut n = count.load(Ordering::Relaxed);
    loop {
        if n >= max {
            return false;
        }
        match count.compare_exchange_weak(n, n + 1, Ordering::Acquire, Ordering::Relaxed) {
            Ok(_) => return true,
            Err(now) => n = now,
        }
    }
}

impl Spinners {
    /// At most `max` spinning at once.
    pub(crate) fn new(max: usize) -> Spinners {
        Spinners {
            busy: AtomicUsize::new(0),
            foreign: AtomicUsize::new(0),
            max,
        }
    }

    /// A quarter of this machine's cores (at least one).
    pub(crate) fn for_this_machine() -> Spinners {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        Spinners::new((cores / 4).max(1))
    }

    /// A place to spin in, if one is free: for a connection of the
    /// server's own user, or of another user (`foreign`), which may hold
    /// only half of the places.
    pub(crate) fn try_enter(&self, foreign: bool) -> Option<SpinSlot<'_>> {
        if foreign && !take(&self.foreign, self.max / 2) {
            return None;
        }
        if !take(&self.busy, self.max) {
            if foreign {
                self.foreign.fetch_sub(1, Ordering::Release);
            }
            return None;
        }
        Some(SpinSlot {
            spinners: self,
            foreign,
        })
    }
}

/// Pause instructions between two polls of a spin (about a microsecond
/// with the `poll(2)` call), so that it does not call the kernel back to
/// back.
const SPIN_PAUSES: u32 = 16;

/// Polls `fd` without sleeping until it is readable (or hung up, or
/// failed) or `end`: whether it became so.
///
/// # References
/// [poll(2)](https://man7.org/linux/man-pages/man2/poll.2.html).
pub(crate) fn spin_until_readable(fd: BorrowedFd<'_>, end: Instant) -> bool {
    let zero = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    loop {
        let mut p = [PollFd::from_borrowed_fd(fd, PollFlags::IN)];
        if matches!(poll(&mut p, Some(&zero)), Ok(n) if n > 0) {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        for _ in 0..SPIN_PAUSES {
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_more_than_the_limit_spin_at_once() {
        let s = Spinners::new(2);
        let a = s.try_enter(false).unwrap();
        let b = s.try_enter(false).unwrap();
        assert!(s.try_enter(false).is_none());
        drop(a);
        let c = s.try_enter(false).unwrap();
        assert!(s.try_enter(false).is_none());
        drop((b, c));
        assert!(s.try_enter(false).is_some());
        assert!(Spinners::for_this_machine().max >= 1);
    }

    #[test]
    fn other_users_hold_at_most_half_of_the_places() {
        let s = Spinners::new(4);
        let foreign: Vec<_> = (0..2).map(|_| s.try_enter(true).unwrap()).collect();
        // However busy other users keep their readers, ours find a place.
        assert!(s.try_enter(true).is_none());
        let own: Vec<_> = (0..2).map(|_| s.try_enter(false).unwrap()).collect();
        // A full house refuses everyone.
        assert!(s.try_enter(false).is_none());
        drop(own);
        // Room again, but not for a third place of other users.
        assert!(s.try_enter(true).is_none());
        drop(foreign);
        let again = s.try_enter(true).unwrap();
        drop(again);
        // With one place (a two-core machine), other users never spin.
        let one = Spinners::new(1);
        assert!(one.try_enter(true).is_none());
        assert!(one.try_enter(false).is_some());
    }

    #[test]
    fn a_spin_sees_a_readable_socket_and_keeps_its_end() {
        use std::io::Write;
        use std::os::fd::AsFd;
        let (mut a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let t = Instant::now();
        assert!(!spin_until_readable(
            b.as_fd(),
            t + Duration::from_millis(2)
        ));
        assert!(t.elapsed() >= Duration::from_millis(2));
        a.write_all(b"x").unwrap();
        assert!(spin_until_readable(b.as_fd(), Instant::now()));
        drop(a);
    }

    const SPIN: Duration = Duration::from_micros(50);

    #[test]
    fn a_spin_that_catches_keeps_spinning() {
        let mut b = Backoff::default();
        for _ in 0..100 {
            assert_eq!(b.next(SPIN), SPIN);
            b.record(SPIN, Duration::from_micros(10));
        }
    }

    #[test]
    fn spins_that_miss_back_off_to_one_in_64() {
        let mut b = Backoff::default();
        let mut spins = 0;
        for _ in 0..10_000 {
            let s = b.next(SPIN);
            if !s.is_zero() {
                spins += 1;
            }
            // Nothing came within the spin (or at once, unspun).
            b.record(s, Duration::from_micros(300));
        }
        // 3, then 1 + 2 + 4 + ... then one in 64.
        assert!(spins <= 10_000 / 64 + 12, "{spins}");
        assert!(spins >= 10_000 / 64, "{spins}");
    }

    #[test]
    fn a_catch_after_misses_spins_again_at_once() {
        let mut b = Backoff::default();
        for _ in 0..20 {
            let s = b.next(SPIN);
            b.record(s, Duration::from_millis(1));
        }
        // Sleeping waits that end quickly do not count: only a spin that
        // catches turns spinning back on.
        while b.next(SPIN).is_zero() {
            b.record(Duration::ZERO, Duration::from_micros(1));
        }
        b.record(SPIN, Duration::from_micros(5));
        assert_eq!(b.next(SPIN), SPIN);
    }

    #[test]
    fn a_spin_that_catches_every_other_time_keeps_spinning() {
        let mut b = Backoff::default();
        for i in 0..1000 {
            assert_eq!(b.next(SPIN), SPIN, "{i}");
            let waited = if i % 2 == 0 { 300 } else { 10 };
            b.record(SPIN, Duration::from_micros(waited));
        }
    }

    #[test]
    fn a_zero_spin_never_spins() {
        let mut b = Backoff::default();
        for _ in 0..100 {
            assert_eq!(b.next(Duration::ZERO), Duration::ZERO);
            b.record(Duration::ZERO, Duration::from_secs(1));
        }
    }
}
