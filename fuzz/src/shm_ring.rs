//! The properties of fuzz target `shm_ring` (`cuda_ipc_shm`: reading
//! records out of a ring whose header, counters and bytes a hostile peer
//! wrote): whatever the area holds, a receiver gives exactly the records
//! and the outcome (empty, or corrupt) of a plain model of the documented
//! layout, each record at most the ring's largest, never more bytes than
//! the ring holds, and it never panics or loops; senders and waits on the
//! scribbled rings return.
//!
//! An input is: one byte, how many records each side sends first (mod 32);
//! one byte, how many of them the other side reads (so that the tails are
//! not zero); one byte that sets their lengths; then patches written over
//! the area, each two bytes of offset (little-endian, mod the area's
//! length), one byte of length, and that many bytes.
//!
//! Kept apart from `lib.rs` so that the target, and the corpus replay in
//! `crates/cuda-ipc-shm/tests/fuzzed.rs`, include this one file.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use cuda_ipc_shm::{Area, MIN_CAPACITY, Receiver, Side, area_len, wake_pair};

const CAP: usize = MIN_CAPACITY;
/// A ring header's size in bytes, and the byte offset of its head.
const HEADER: usize = 256;
const HEAD: usize = 64;

/// What a receiver did until the ring was empty or broken.
#[derive(Debug, PartialEq, Eq)]
struct Drain {
    records: Vec<Vec<u8>>,
    corrupt: bool,
}

fn record_bytes(len: u64) -> u64 {
    8 + len.div_ceil(8) * 8
}

/// The documented layout read by hand: ring `ring` of `area`, its
/// consumer's tail at `tail`.
fn model(area: &[u8], ring: usize, mut tail: u64) -> Drain {
    let base = ring * (HEADER + CAP);
    let word = |at: usize| u64::from_le_bytes(area[at..at + 8].try_into().unwrap());
    let head = word(base + HEAD);
    let cap = CAP as u64;
    let data = |pos: u64| area[base + HEADER + (pos % cap) as usize];
    let mut records = Vec::new();
    loop {
        let used = head.wrapping_sub(tail);
        if used == 0 {
            return Drain {
                records,
                corrupt: false,
            };
        }
        if used > cap || used % 8 != 0 {
            return Drain {
                records,
                corrupt: true,
            };
        }
        let len = word(base + HEADER + (tail % cap) as usize);
        if len > used - 8 {
            return Drain {
                records,
                corrupt: true,
            };
        }
        records.push((0..len).map(|i| data(tail + 8 + i)).collect());
        tail += record_bytes(len);
    }
}

/// What `rx` reads until the ring is empty or broken (at most a ring's
/// worth of records: one more is a loop).
fn drain(rx: &mut Receiver) -> Drain {
    let mut records = Vec::new();
    let mut buf = Vec::new();
    for _ in 0..=CAP / 8 {
        match rx.recv(&mut buf) {
            Ok(true) => {
                assert!(buf.len() <= CAP - 8, "a record of {} bytes", buf.len());
                records.push(buf.clone());
            }
            Ok(false) => {
                assert!(!rx.has_data(), "empty, yet has_data");
                return Drain {
                    records,
                    corrupt: false,
                };
            }
            Err(e) => {
                assert!(!e.to_string().is_empty(), "an error printed as nothing");
                return Drain {
                    records,
                    corrupt: true,
                };
            }
        }
    }
    panic!("read more records than a ring holds");
}

/// The checks of the ring's reader on an area built from arbitrary bytes;
/// panics if a property fails.
pub fn shm_ring(data: &[u8]) {
    let &[sends, reads, size, ref patches @ ..] = data else {
        return;
    };
    let (sends, reads) = (usize::from(sends % 32), usize::from(reads));
    let mut patches: &[u8] = patches;
    let (area, memfd) = Area::create(CAP).expect("an area");
    let theirs = Area::open(&memfd, CAP).expect("the same area");
    let (ours, other) = wake_pair().expect("a wake-up socket pair");
    let mut creator = area.split(Side::Creator, ours).expect("the creator's ends");
    let mut opener = theirs
        .split(Side::Opener, other)
        .expect("the opener's ends");
    // Records both ways, some of them read: the tails each receiver keeps.
    let mut tails = [0u64; 2];
    let mut buf = Vec::new();
    for i in 0..sends {
        let len = (usize::from(size) * (i + 1) * 37) % 700;
        let record: Vec<u8> = (0..len).map(|k| (i * 31 + k) as u8).collect();
        for tx in [&mut creator.0, &mut opener.0] {
            let _ = tx.send(&record).expect("a sender on a clean ring");
        }
    }
    for (ring, rx) in [&mut opener.1, &mut creator.1].into_iter().enumerate() {
        for _ in 0..reads.min(sends) {
            if rx.recv(&mut buf).expect("a clean ring") {
                tails[ring] += record_bytes(buf.len() as u64);
            }
        }
    }
    // The peer's scribbles.
    let file = File::from(memfd);
    let len = area_len(CAP);
    while let &[lo, hi, n, ref rest @ ..] = patches {
        let at = usize::from(u16::from_le_bytes([lo, hi])) % len;
        let n = usize::from(n).min(rest.len()).min(len - at);
        file.write_all_at(&rest[..n], at as u64)
            .expect("a write into the memfd");
        patches = &rest[n..];
    }
    let mut area = vec![0u8; len];
    file.read_exact_at(&mut area, 0)
        .expect("a read of the memfd");
    // Ring 0 goes to the opener, ring 1 to the creator.
    for (ring, rx) in [&mut opener.1, &mut creator.1].into_iter().enumerate() {
        let expected = model(&area, ring, tails[ring]);
        let got = drain(rx);
        let bytes: u64 = got
            .records
            .iter()
            .map(|r| record_bytes(r.len() as u64))
            .sum();
        assert!(
            bytes <= CAP as u64,
            "read {bytes} bytes out of a ring of {CAP}"
        );
        assert_eq!(
            got, expected,
            "ring {ring} read otherwise than its layout says"
        );
        let waited = rx.wait(Duration::ZERO, Some(Instant::now()), None);
        assert!(waited.is_ok(), "{waited:?}");
    }
    for tx in [&mut creator.0, &mut opener.0] {
        if let Err(e) = tx.send(b"after the scribbles") {
            assert!(!e.to_string().is_empty(), "an error printed as nothing");
        }
    }
}

/// Whether an input gives a ring with records to read (the corpus replay
/// checks that the seeds hold some).
#[allow(dead_code)] // The targets need only the checks.
pub fn is_valid(data: &[u8]) -> bool {
    data.len() >= 3 && data[0] % 32 > data[1].min(data[0] % 32)
}
