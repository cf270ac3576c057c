//! Unit tests: the record encoding, two mappings of one memfd, hostile
//! writes into the area, and the wake-up logic with threads.

use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::*;

/// Both ends of an area mapped twice (as two processes would): the
/// creator's sender and receiver, the opener's, the memfd, and a second
/// descriptor of each side's wake-up end (for tests that act as a peer
/// doing what it likes with its own end).
struct Pair {
    creator: (Sender, Receiver),
    opener: (Sender, Receiver),
    memfd: OwnedFd,
    creator_wake: OwnedFd,
    opener_wake: OwnedFd,
}

fn pair(capacity: usize) -> Pair {
    let (area, memfd) = Area::create(capacity).unwrap();
    let theirs = Area::open(&memfd, capacity).unwrap();
    let (ours, other) = wake_pair().unwrap();
    let (creator_wake, opener_wake) = (ours.try_clone().unwrap(), other.try_clone().unwrap());
    let creator = area.split(Side::Creator, ours).unwrap();
    let opener = theirs.split(Side::Opener, other).unwrap();
    Pair {
        creator,
        opener,
        memfd,
        creator_wake,
        opener_wake,
    }
}

fn record(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|k| (i * 31 + k) as u8).collect()
}

#[test]
fn records_cross_between_two_mappings_both_ways() {
    let mut p = pair(MIN_CAPACITY);
    let mut buf = Vec::new();
    for i in 0..2000 {
        let r = record(i, i % 97);
        assert!(p.creator.0.send(&r).unwrap());
        assert!(p.opener.1.recv(&mut buf).unwrap());
        assert_eq!(buf, r);
        assert!(p.opener.0.send(&r).unwrap());
        assert!(p.creator.1.recv(&mut buf).unwrap());
        assert_eq!(buf, r);
    }
    assert!(!p.opener.1.recv(&mut buf).unwrap());
    assert!(!p.creator.1.recv(&mut buf).unwrap());
}

#[test]
fn records_as_long_as_the_ring_wrap_at_every_word_intact() {
    // Records of every length near the longest, each starting one word
    // further on: their words wrap around the end of the data area at
    // every offset, and their last, partial word too.
    let mut p = pair(MIN_CAPACITY);
    let max = p.creator.0.max_record();
    assert_eq!(max, MIN_CAPACITY - 8);
    let mut buf = Vec::new();
    for i in 0..(MIN_CAPACITY / 8 + 9) {
        let r = record(i, max - i % 13);
        assert!(p.creator.0.send(&r).unwrap(), "record {i} was refused");
        assert!(p.opener.1.recv(&mut buf).unwrap());
        assert_eq!(buf, r, "record {i}");
        // Shifts the next record's start by one word.
        assert!(p.creator.0.send(&[i as u8]).unwrap());
        assert!(p.opener.1.recv(&mut buf).unwrap());
        assert_eq!(buf, [i as u8]);
    }
    assert!(
        !p.creator.0.send(&record(0, max + 1)).unwrap(),
        "longer than the ring"
    );
}

#[test]
fn a_full_ring_refuses_and_takes_again_once_read() {
    let mut p = pair(MIN_CAPACITY);
    let r = record(1, 100);
    // 8 + 104 bytes a record.
    let fits = MIN_CAPACITY / 112;
    for _ in 0..fits {
        assert!(p.creator.0.send(&r).unwrap());
    }
    assert!(!p.creator.0.send(&r).unwrap(), "a full ring took a record");
    let mut buf = Vec::new();
    assert!(p.opener.1.recv(&mut buf).unwrap());
    assert!(p.creator.0.send(&r).unwrap());
    let too_long = vec![0u8; MIN_CAPACITY - 7];
    assert!(!p.opener.0.send(&too_long).unwrap());
    assert!(p.opener.0.send(&too_long[..MIN_CAPACITY - 8]).unwrap());
    assert!(p.creator.1.recv(&mut buf).unwrap());
    assert_eq!(buf.len(), MIN_CAPACITY - 8);
}

#[test]
fn open_checks_capacity_size_seals_and_headers() {
    assert!(Area::create(5000).is_err());
    assert!(Area::create(MIN_CAPACITY / 2).is_err());
    let (_area, memfd) = Area::create(MIN_CAPACITY).unwrap();
    assert!(matches!(
        Area::open(&memfd, 2 * MIN_CAPACITY),
        Err(ShmError::BadArea { .. })
    ));
    // A memfd without seals (it could shrink under us): refused.
    let plain = rustix::fs::memfd_create("plain", MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&plain, area_len(MIN_CAPACITY) as u64).unwrap();
    let e = Area::open(&plain, MIN_CAPACITY).unwrap_err();
    assert!(e.to_string().contains("seal"), "{e}");
    // The creator's seals hold: the peer cannot shrink it.
    assert!(rustix::fs::ftruncate(&memfd, 0).is_err());
    // A bad magic.
    rustix::io::pwrite(&memfd, b"garbage!", 0).unwrap();
    assert!(matches!(
        Area::open(&memfd, MIN_CAPACITY),
        Err(ShmError::BadArea { .. })
    ));
}

#[test]
fn an_impossible_head_or_tail_is_corrupt() {
    let mut p = pair(MIN_CAPACITY);
    let mut buf = Vec::new();
    // Ring 0's head, written by a hostile creator, far past the tail.
    rustix::io::pwrite(&p.memfd, &u64::MAX.to_le_bytes(), 64).unwrap();
    assert!(matches!(
        p.opener.1.recv(&mut buf),
        Err(ShmError::Corrupt { .. })
    ));
    // Ring 0's tail, written by a hostile opener, ahead of the head.
    rustix::io::pwrite(&p.memfd, &8u64.to_le_bytes(), 128).unwrap();
    assert!(matches!(
        p.creator.0.send(b"x"),
        Err(ShmError::Corrupt { .. })
    ));
}

#[test]
fn a_record_longer_than_what_was_written_is_corrupt() {
    let mut p = pair(MIN_CAPACITY);
    assert!(p.creator.0.send(b"12345678").unwrap());
    // The length word of the first record (ring 0's data starts at 256).
    rustix::io::pwrite(&p.memfd, &9u64.to_le_bytes(), 256).unwrap();
    let mut buf = Vec::new();
    let e = p.opener.1.recv(&mut buf).unwrap_err();
    assert!(e.to_string().contains("claims 9 bytes"), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Any sequence of sends and receives through a small ring gives the
    /// records back in order, and a send is refused only when full.
    #[test]
    fn the_ring_is_a_fifo(ops in prop::collection::vec((any::<bool>(), 0usize..600), 1..400)) {
        let mut p = pair(MIN_CAPACITY);
        let mut model = std::collections::VecDeque::new();
        let mut used = 0usize;
        let mut buf = Vec::new();
        for (i, (send, len)) in ops.into_iter().enumerate() {
            if send {
                let r = record(i, len);
                let need = 8 + len.div_ceil(8) * 8;
                let took = p.creator.0.send(&r).unwrap();
                prop_assert_eq!(took, used + need <= MIN_CAPACITY);
                if took {
                    used += need;
                    model.push_back(r);
                }
            } else {
                let got = p.opener.1.recv(&mut buf).unwrap();
                match model.pop_front() {
                    Some(r) => {
                        prop_assert!(got);
                        used -= 8 + r.len().div_ceil(8) * 8;
                        prop_assert_eq!(&buf, &r);
                    }
                    None => prop_assert!(!got),
                }
            }
        }
    }

    /// Random bytes written anywhere in the area, at any time, give
    /// records or errors, never a panic or a hang (each call returns, and
    /// a receiver reads at most a ring's worth before it is empty or
    /// broken).
    #[test]
    fn hostile_writes_give_errors_never_panics(
        before in 0usize..40,
        writes in prop::collection::vec((0usize..2 * (HEADER_BYTES + MIN_CAPACITY), prop::collection::vec(any::<u8>(), 1..64)), 1..20),
    ) {
        let mut p = pair(MIN_CAPACITY);
        for i in 0..before {
            let _ = p.creator.0.send(&record(i, i * 7));
            let _ = p.opener.0.send(&record(i, i * 5));
        }
        let len = area_len(MIN_CAPACITY);
        for (at, bytes) in writes {
            let n = bytes.len().min(len - at);
            rustix::io::pwrite(&p.memfd, &bytes[..n], at as u64).unwrap();
        }
        let mut buf = Vec::new();
        for rx in [&mut p.opener.1, &mut p.creator.1] {
            for _ in 0..=MIN_CAPACITY / 8 {
                match rx.recv(&mut buf) {
                    Ok(true) => prop_assert!(buf.len() <= MIN_CAPACITY - 8),
                    Ok(false) | Err(_) => break,
                }
            }
            let w = rx.wait(Duration::ZERO, Some(Instant::now()), None);
            prop_assert!(w.is_ok());
        }
        for tx in [&mut p.creator.0, &mut p.opener.0] {
            let _ = tx.send(b"after the scribbles");
        }
    }
}

/// Waits (no spin, up to 10 s) for the next record and takes it.
fn sleep_for_record(rx: &mut Receiver) -> (Ready, Vec<u8>) {
    let r = rx
        .wait(
            Duration::ZERO,
            Some(Instant::now() + Duration::from_secs(10)),
            None,
        )
        .unwrap();
    let mut buf = Vec::new();
    assert!(rx.recv(&mut buf).unwrap());
    (r, buf)
}

#[test]
fn a_sleeping_consumer_is_woken_by_its_wake_up_socket() {
    let Pair {
        creator: (mut tx, _),
        opener: (_, mut rx),
        ..
    } = pair(MIN_CAPACITY);
    let t = std::thread::spawn(move || {
        let started = Instant::now();
        let (r, buf) = sleep_for_record(&mut rx);
        (r, started.elapsed(), rx.sleeps(), buf)
    });
    std::thread::sleep(Duration::from_millis(100));
    assert!(tx.send(b"wake up").unwrap());
    let (ready, took, sleeps, buf) = t.join().unwrap();
    assert_eq!(ready, Ready::Ring);
    assert!(took < Duration::from_secs(5), "woke after {took:?}");
    assert!(sleeps >= 1);
    assert_eq!(tx.wakes(), 1, "the producer sent one wake-up");
    assert_eq!(buf, b"wake up");
}

#[test]
fn a_spinning_consumer_needs_no_wake_up() {
    let Pair {
        creator: (mut tx, _),
        opener: (_, mut rx),
        ..
    } = pair(MIN_CAPACITY);
    let (go_tx, go_rx) = std::sync::mpsc::channel();
    let t = std::thread::spawn(move || {
        go_tx.send(()).unwrap();
        let r = rx.wait(Duration::from_secs(5), None, None).unwrap();
        (r, rx.sleeps())
    });
    go_rx.recv().unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert!(tx.send(b"x").unwrap());
    let (r, sleeps) = t.join().unwrap();
    assert_eq!(r, Ready::Ring);
    assert_eq!(sleeps, 0);
    assert_eq!(tx.wakes(), 0, "no system call on the hot path");
}

#[test]
fn a_consumer_wakes_when_the_other_descriptor_hangs_up_and_times_out_otherwise() {
    let Pair {
        opener: (_, mut rx),
        ..
    } = pair(MIN_CAPACITY);
    let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
    let started = Instant::now();
    let r = rx
        .wait(
            Duration::ZERO,
            Some(Instant::now() + Duration::from_millis(50)),
            Some(a.as_fd()),
        )
        .unwrap();
    assert_eq!(r, Ready::Timeout);
    assert!(started.elapsed() >= Duration::from_millis(50));
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        drop(b);
    });
    let started = Instant::now();
    let r = rx
        .wait(
            Duration::from_micros(20),
            Some(Instant::now() + Duration::from_secs(10)),
            Some(a.as_fd()),
        )
        .unwrap();
    killer.join().unwrap();
    assert_eq!(r, Ready::Other);
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn many_records_stream_between_threads() {
    let Pair {
        creator: (mut tx, _),
        opener: (_, mut rx),
        ..
    } = pair(MIN_CAPACITY);
    let n = 20_000;
    let t = std::thread::spawn(move || {
        let mut buf = Vec::new();
        for i in 0..n {
            loop {
                if rx.recv(&mut buf).unwrap() {
                    break;
                }
                let deadline = Some(Instant::now() + Duration::from_secs(10));
                assert_ne!(
                    rx.wait(Duration::from_micros(5), deadline, None).unwrap(),
                    Ready::Timeout
                );
            }
            assert_eq!(buf, record(i, i % 200));
        }
    });
    for i in 0..n {
        let r = record(i, i % 200);
        while !tx.send(&r).unwrap() {
            std::thread::yield_now();
        }
    }
    t.join().unwrap();
}

/// Sends wake-ups on `peer_end` (the peer's end of a receiver's wake-up
/// socket) every `every` from another thread until the returned flag is
/// set, as a peer that wakes the consumer without records would; the
/// thread returns how many sends it made.
fn flood(
    peer_end: &OwnedFd,
    every: Duration,
) -> (
    std::sync::Arc<std::sync::atomic::AtomicBool>,
    std::thread::JoinHandle<u64>,
) {
    let wake = peer_end.try_clone().unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = std::sync::Arc::clone(&stop);
    let t = std::thread::spawn(move || {
        let mut writes = 0;
        while !flag.load(std::sync::atomic::Ordering::Relaxed) {
            let _ = rustix::net::send(&wake, &[1], rustix::net::SendFlags::DONTWAIT);
            writes += 1;
            std::thread::sleep(every);
        }
        writes
    });
    (stop, t)
}

/// A peer that sends wake-ups without records wakes a sleeping wait
/// only [`EMPTY_WAKES_TOLERATED`] times; then the wait naps on, looking
/// at the ring after each nap, so the flood costs a wake-up per nap, not
/// per write. The wait still ends at its deadline.
#[test]
fn a_peer_that_wakes_without_records_is_ignored_after_a_few() {
    let Pair {
        creator: (_tx, _),
        opener: (_, mut rx),
        creator_wake,
        ..
    } = pair(MIN_CAPACITY);
    let (stop, flooder) = flood(&creator_wake, Duration::from_micros(20));
    let started = Instant::now();
    let r = rx
        .wait(
            Duration::ZERO,
            Some(started + Duration::from_millis(300)),
            None,
        )
        .unwrap();
    let took = started.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let writes = flooder.join().unwrap();
    assert_eq!(r, Ready::Timeout);
    assert!(took >= Duration::from_millis(300), "{took:?}");
    assert_eq!(rx.empty_wakes(), u64::from(EMPTY_WAKES_TOLERATED));
    // 8 wake-ups, then naps of 1, 2, 4, 8 and 16 ms to the deadline:
    // about 25 sleeps, where every write (thousands) woke it before.
    assert!(
        rx.sleeps() < 60,
        "{} sleeps for {writes} writes",
        rx.sleeps()
    );
    assert!(writes > 200, "the flood made only {writes} writes");
}

/// A record sent during such a flood is still taken, within a nap; the
/// next wait starts trusting the wake-up socket again.
#[test]
fn a_record_during_a_flood_is_taken_within_a_nap() {
    let Pair {
        creator: (mut tx, _),
        opener: (_, mut rx),
        creator_wake,
        ..
    } = pair(MIN_CAPACITY);
    let (stop, flooder) = flood(&creator_wake, Duration::from_micros(20));
    let t = std::thread::spawn(move || {
        let (r, buf) = sleep_for_record(&mut rx);
        (r, buf, Instant::now(), rx)
    });
    // Long enough for the wait to be napping at the longest nap.
    std::thread::sleep(Duration::from_millis(150));
    let sent = Instant::now();
    assert!(tx.send(b"through the flood").unwrap());
    let (r, buf, taken, mut rx) = t.join().unwrap();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    flooder.join().unwrap();
    assert_eq!(
        (r, buf.as_slice()),
        (Ready::Ring, &b"through the flood"[..])
    );
    let late = taken.saturating_duration_since(sent);
    assert!(
        late < IGNORED_NAP_MAX + Duration::from_millis(100),
        "taken {late:?} after it was sent"
    );
    assert!(rx.empty_wakes() >= u64::from(EMPTY_WAKES_TOLERATED));
    // A well-behaved record later wakes a fresh wait through the socket.
    let before = rx.empty_wakes();
    let t = std::thread::spawn(move || {
        let started = Instant::now();
        let (r, buf) = sleep_for_record(&mut rx);
        (r, buf, started.elapsed(), rx)
    });
    std::thread::sleep(Duration::from_millis(50));
    assert!(tx.send(b"after").unwrap());
    let (r, buf, _, rx) = t.join().unwrap();
    assert_eq!((r, buf.as_slice()), (Ready::Ring, &b"after"[..]));
    // At most the one wake-up the flood left unread.
    assert!(
        rx.empty_wakes() <= before + 1,
        "{} after {before}",
        rx.empty_wakes()
    );
}

/// Records that come one at a time, each with its wake-up (a ping-pong:
/// each side sleeps until the other's record), never make a wait count
/// more than the one stale wake-up the protocol allows, and are taken
/// without a nap: a well-behaved producer never looks like a flood.
#[test]
fn a_well_behaved_producer_never_looks_like_a_flood() {
    let Pair {
        creator: (mut tx, mut echoes),
        opener: (mut echo, mut rx),
        ..
    } = pair(MIN_CAPACITY);
    let n = 300;
    let t = std::thread::spawn(move || {
        // The most empty wake-ups of one wait, and the waits that lasted
        // as long as a nap.
        let (mut streak, mut slow) = (0, 0);
        for i in 0..n {
            let (started, before) = (Instant::now(), rx.empty_wakes());
            let (r, buf) = sleep_for_record(&mut rx);
            assert_eq!((r, buf.as_slice()), (Ready::Ring, record(i, 24).as_slice()));
            streak = streak.max(rx.empty_wakes() - before);
            slow += usize::from(started.elapsed() >= IGNORED_NAP_MIN);
            assert!(echo.send(&buf).unwrap());
        }
        (streak, slow)
    });
    for i in 0..n {
        // Long enough for the other side to fall asleep.
        std::thread::sleep(Duration::from_micros(100));
        assert!(tx.send(&record(i, 24)).unwrap());
        assert_eq!(sleep_for_record(&mut echoes), (Ready::Ring, record(i, 24)));
    }
    let (streak, slow) = t.join().unwrap();
    assert!(streak <= 1, "{streak} empty wake-ups in one wait");
    // Each wait lasts the pause and a wake-up, not a nap; a loaded
    // machine may stretch a few.
    assert!(slow < n / 4, "{slow} of {n} waits lasted a nap");
}

/// Sets the *sleeping* flag of ring `ring` through the memfd, as a peer
/// that claims to sleep for ever would.
fn claim_sleep(memfd: &OwnedFd, ring: usize, capacity: usize) {
    let at = (ring * (HEADER_BYTES + capacity) + W_SLEEPING * 8) as u64;
    rustix::io::pwrite(memfd, &1u64.to_le_bytes(), at).unwrap();
}

/// Runs `f` on another thread and fails the test if it has not returned
/// within `limit` (a blocked call would hang the test otherwise).
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done_tx.send(f());
    });
    done_rx
        .recv_timeout(limit)
        .unwrap_or_else(|_| panic!("the call did not return within {limit:?}: it blocked"))
}

/// The worst a peer can do to the wake-up descriptor it was given: clear
/// `O_NONBLOCK` on it, never read it, and claim to sleep so that every
/// record wakes it. The sender's wake-ups fill the socket and then fail
/// with `EAGAIN`; it never blocks. (With an eventfd shared between the two
/// sides, the peer's `fcntl` cleared the flag on ours too, and the write
/// after the counter filled blocked for ever.)
#[test]
fn a_peer_cannot_make_the_sender_block() {
    let Pair {
        creator: (mut tx, _),
        opener: (_, mut rx),
        memfd,
        opener_wake,
        ..
    } = pair(MIN_CAPACITY);
    let flags = rustix::fs::fcntl_getfl(&opener_wake).unwrap();
    rustix::fs::fcntl_setfl(&opener_wake, flags - rustix::fs::OFlags::NONBLOCK).unwrap();
    // Shrinks the buffer our wake-ups fill, so that it fills soon.
    rustix::net::sockopt::set_socket_recv_buffer_size(&opener_wake, 1).unwrap();
    let n = 200_000;
    let (sent, wakes) = within(Duration::from_secs(60), move || {
        let mut buf = Vec::new();
        for i in 0..n {
            claim_sleep(&memfd, 0, MIN_CAPACITY);
            assert!(tx.send(&record(i, 8)).unwrap());
            assert!(rx.recv(&mut buf).unwrap());
        }
        (n, tx.wakes())
    });
    assert_eq!(wakes, sent as u64, "every record found the peer asleep");
    drop(opener_wake);
}

/// A peer cannot read this side's wake-ups away (it holds only its own end
/// of the pair), and one that closes its end cannot make a wait spin: the
/// wait notes the closed socket and naps from then on, still taking the
/// peer's records within a nap.
#[test]
fn a_peer_that_closes_its_wake_up_end_makes_waits_nap() {
    let Pair {
        creator: (_, mut rx),
        opener: (mut tx, _),
        opener_wake,
        ..
    } = pair(MIN_CAPACITY);
    rustix::net::shutdown(&opener_wake, rustix::net::Shutdown::Both).unwrap();
    let started = Instant::now();
    let r = within(Duration::from_secs(10), move || {
        let r = rx.wait(
            Duration::ZERO,
            Some(Instant::now() + Duration::from_millis(200)),
            None,
        );
        (r.unwrap(), rx)
    });
    let (ready, mut rx) = r;
    assert_eq!(ready, Ready::Timeout);
    assert!(started.elapsed() >= Duration::from_millis(200));
    assert!(rx.wake_closed());
    // Naps of 1 to 16 ms over 200 ms, not a poll returning at once.
    assert!(rx.sleeps() < 40, "{} sleeps", rx.sleeps());
    // The peer's records still come through, within a nap.
    let t = std::thread::spawn(move || {
        let (r, buf) = sleep_for_record(&mut rx);
        (r, buf, Instant::now())
    });
    std::thread::sleep(Duration::from_millis(50));
    let sent = Instant::now();
    assert!(tx.send(b"still here").unwrap());
    let (r, buf, taken) = t.join().unwrap();
    assert_eq!((r, buf.as_slice()), (Ready::Ring, &b"still here"[..]));
    assert!(taken - sent < IGNORED_NAP_MAX + Duration::from_millis(100));
}

/// `split` takes only a Unix stream socket as the wake-up end: not an
/// eventfd or a pipe (whose flags the peer would share), nor a datagram
/// socket.
#[test]
fn split_refuses_a_wake_up_end_that_is_not_a_stream_socket() {
    let area = || Area::create(MIN_CAPACITY).unwrap().0;
    let eventfd = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).unwrap();
    let e = area().split(Side::Creator, eventfd).unwrap_err();
    assert!(e.to_string().contains("not a Unix stream socket"), "{e}");
    let (r, _w) = rustix::pipe::pipe().unwrap();
    assert!(matches!(
        area().split(Side::Creator, r),
        Err(ShmError::BadArea { .. })
    ));
    let (d, _d2) = rustix::net::socketpair(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::DGRAM,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )
    .unwrap();
    let e = area().split(Side::Creator, d).unwrap_err();
    assert!(e.to_string().contains("a datagram socket"), "{e}");
}
