//! The arena's accounting, without a GPU: chunks are host records that
//! count themselves, and every step of random sequences of allocations,
//! drops, leases, pins, reserves and trims is checked against a model.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use proptest::prelude::*;

use super::*;

/// Chunks of nothing: a length, counted while alive.
#[derive(Clone, Default)]
struct HostChunks {
    live: Arc<AtomicU64>,
    live_bytes: Arc<AtomicU64>,
    made: Arc<std::sync::Mutex<Vec<u64>>>,
    fail: Arc<AtomicBool>,
}

struct HostChunk {
    len: u64,
    live: Arc<AtomicU64>,
    live_bytes: Arc<AtomicU64>,
}

impl Drop for HostChunk {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::SeqCst);
        self.live_bytes.fetch_sub(self.len, Ordering::SeqCst);
    }
}

const GRANULE: u64 = 4096;

impl ChunkBacking for HostChunks {
    type Chunk = HostChunk;
    fn granularity(&self) -> u64 {
        GRANULE
    }
    fn create(&self, len: u64) -> Result<HostChunk> {
        if self.fail.load(Ordering::SeqCst) {
            return Err(Error::arg("size", "the test backing refused"));
        }
        assert!(len.is_multiple_of(GRANULE), "asked for {len} bytes");
        self.live.fetch_add(1, Ordering::SeqCst);
        self.live_bytes.fetch_add(len, Ordering::SeqCst);
        self.made.lock().unwrap().push(len);
        Ok(HostChunk {
            len,
            live: self.live.clone(),
            live_bytes: self.live_bytes.clone(),
        })
    }
    fn chunk_len(chunk: &HostChunk) -> u64 {
        chunk.len
    }
}

fn options(alignment: u64) -> ArenaOptions {
    ArenaOptions {
        chunk_size: 64 * KIB,
        max_chunk_size: 256 * KIB,
        alignment,
        limit: None,
        max_buffers_per_chunk: 64,
    }
}

fn arena(alignment: u64) -> (Arena<HostChunks>, HostChunks) {
    let backing = HostChunks::default();
    (
        Arena::new(backing.clone(), options(alignment)).unwrap(),
        backing,
    )
}

#[test]
fn buffers_are_aligned_views_of_their_chunk() {
    for alignment in [1, 8, 256, 4096] {
        let (a, _) = arena(alignment);
        let bufs: Vec<_> = (1..40).map(|i| a.alloc(i * 37).unwrap()).collect();
        for b in &bufs {
            assert!(b.offset().is_multiple_of(alignment), "{b:?}");
            assert!(b.reserved_len() >= b.byte_len());
            assert!(b.offset() + b.reserved_len() <= b.chunk().byte_len());
            assert_eq!(b.view().chunk.arena, a.id());
        }
        if alignment <= 256 {
            assert_eq!(a.stats().chunks, 1);
        }
    }
}

#[test]
fn a_range_is_reused_only_after_its_last_lease() {
    let (a, _) = arena(256);
    let b = a.alloc(1000).unwrap();
    let view = b.view();
    let l1 = b.lease();
    let l2 = l1.clone();
    assert_eq!(b.leases(), 2);
    drop(b);
    let s = a.stats();
    assert_eq!((s.buffers, s.leases, s.held_by_leases_only), (1, 2, 1));
    let other = a.alloc(1000).unwrap();
    assert_ne!(other.offset(), view.offset, "reused a leased range");
    drop(l1);
    let again = a.alloc(1000).unwrap();
    assert_ne!(
        again.offset(),
        view.offset,
        "reused a range one lease still holds"
    );
    drop(l2);
    let s = a.stats();
    assert_eq!((s.buffers, s.leases, s.held_by_leases_only), (2, 0, 0));
    let reused = a.alloc(1000).unwrap();
    assert_eq!(
        reused.offset(),
        view.offset,
        "the freed range should be first fit"
    );
}

/// Leases taken together (a set's) count as leases taken one by one, in
/// each buffer's own arena, whatever the order of the arenas.
#[test]
fn leases_taken_together_count_as_leases_taken_one_by_one() {
    let ((a, _), (b, _)) = (arena(256), arena(256));
    let bufs = [
        a.alloc(100).unwrap(),
        a.alloc(100).unwrap(),
        b.alloc(100).unwrap(),
    ];
    let order = [&bufs[0], &bufs[2], &bufs[1], &bufs[0], &bufs[2]];
    let leases = ArenaBuffer::lease_each(order);
    assert_eq!(leases.len(), 5);
    for (lease, buf) in leases.iter().zip(order) {
        assert_eq!(lease.view(), buf.view());
    }
    assert_eq!(
        bufs.iter().map(ArenaBuffer::leases).collect::<Vec<_>>(),
        [2, 1, 2]
    );
    assert_eq!((a.stats().leases, b.stats().leases), (3, 2));
    let first = bufs[0].view();
    drop(bufs);
    assert_eq!(a.stats().held_by_leases_only, 2);
    assert_ne!(a.alloc(100).unwrap().offset(), first.offset, "still leased");
    drop(leases);
    let (sa, sb) = (a.stats(), b.stats());
    assert_eq!((sa.leases, sa.held_by_leases_only, sb.leases), (0, 0, 0));
    assert!(ArenaBuffer::<HostChunks>::lease_each([]).is_empty());
}

#[test]
fn chunks_outlive_the_arena_handle_while_buffers_live() {
    let (a, backing) = arena(256);
    let b = a.alloc(10).unwrap();
    let lease = b.lease();
    drop(a);
    drop(b);
    assert_eq!(backing.live.load(Ordering::SeqCst), 1);
    assert_eq!(lease.chunk().byte_len(), 64 * KIB);
    drop(lease);
    assert_eq!(backing.live.load(Ordering::SeqCst), 0);
}

#[test]
fn growth_doubles_up_to_the_cap_and_large_buffers_get_their_own_chunk() {
    let (a, backing) = arena(256);
    let _keep: Vec<_> = (0..12).map(|_| a.alloc(60 * KIB).unwrap()).collect();
    let huge = a.alloc(KIB * 1000 + 1).unwrap();
    let made = backing.made.lock().unwrap().clone();
    // 64, 64, 128, 256 (capped), 256, ... then one of its own.
    assert_eq!(&made[..4], &[64 * KIB, 64 * KIB, 128 * KIB, 256 * KIB]);
    assert!(
        made[4..made.len() - 1].iter().all(|l| *l == 256 * KIB),
        "{made:?}"
    );
    assert_eq!(*made.last().unwrap(), 1004 * KIB);
    assert_eq!(huge.offset(), 0);
}

#[test]
fn reserve_exports_ahead_and_trim_releases_idle_chunks_only() {
    let (a, backing) = arena(256);
    assert_eq!(a.reserve(1000 * KIB).unwrap(), 1000 * KIB);
    assert_eq!(a.reserve(1000 * KIB).unwrap(), 0, "already reserved");
    let b = a.alloc(100 * KIB).unwrap();
    assert_eq!(a.stats().chunks, 1, "the reserved chunk served it");
    let (c0, extra) = (b.view().chunk, a.alloc(999 * KIB).unwrap());
    assert_eq!(a.stats().chunks, 2);
    let pin = a.pin(extra.view().chunk).unwrap();
    drop(extra);
    assert_eq!(a.trim(), 0, "a pinned chunk stays, a chunk in use stays");
    drop(pin);
    let released = a.trim();
    assert!(released >= 999 * KIB, "{released}");
    assert_eq!(a.stats().chunks, 1);
    assert_eq!(backing.live.load(Ordering::SeqCst), 1);
    drop(b);
    a.trim();
    assert_eq!(backing.live.load(Ordering::SeqCst), 0);
    // Indices are never reused.
    let next = a.alloc(1).unwrap();
    assert!(next.view().chunk.index > c0.index);
    let e = a.pin(c0).unwrap_err();
    assert!(e.to_string().contains("trimmed"), "{e}");
    let (other, _) = arena(256);
    let e = other.pin(next.view().chunk).unwrap_err();
    assert!(e.to_string().contains("another arena"), "{e}");
}

#[test]
fn the_limit_trims_idle_chunks_first_then_refuses() {
    let backing = HostChunks::default();
    let a = Arena::new(
        backing.clone(),
        ArenaOptions {
            limit: Some(128 * KIB),
            ..options(256)
        },
    )
    .unwrap();
    let b = a.alloc(64 * KIB).unwrap();
    drop(b);
    let big = a.alloc(128 * KIB).unwrap();
    assert_eq!(
        a.stats().chunk_bytes,
        128 * KIB,
        "the idle chunk was trimmed"
    );
    let e = a.alloc(1).unwrap_err();
    assert!(e.to_string().contains("limit"), "{e}");
    assert_eq!(e.kind(), cuda_ipc_core::ErrorKind::Unavailable);
    drop(big);
    assert!(a.alloc(1).is_ok());
}

#[test]
fn errors_are_clear_and_leave_the_accounting_intact() {
    let (a, backing) = arena(256);
    assert!(a.alloc(0).unwrap_err().to_string().contains("empty"));
    backing.fail.store(true, Ordering::SeqCst);
    assert!(a.alloc(1).unwrap_err().to_string().contains("refused"));
    assert!(a.reserve(1).is_err());
    backing.fail.store(false, Ordering::SeqCst);
    assert_eq!(a.stats(), ArenaStats::default());
    assert!(a.alloc(u64::MAX).is_err());
    assert!(a.alloc(1).is_ok());
    for (bad, what) in [
        (
            ArenaOptions {
                alignment: 3,
                ..options(256)
            },
            "power of two",
        ),
        (
            ArenaOptions {
                alignment: 4 * MIB,
                ..options(256)
            },
            "power of two",
        ),
        (
            ArenaOptions {
                chunk_size: 0,
                ..options(256)
            },
            "at least",
        ),
        (
            ArenaOptions {
                max_chunk_size: 1,
                ..options(256)
            },
            "less than",
        ),
        (
            ArenaOptions {
                max_buffers_per_chunk: 0,
                ..options(256)
            },
            "from 1",
        ),
    ] {
        let e = Arena::new(HostChunks::default(), bad).unwrap_err();
        assert!(e.to_string().contains(what), "{e}");
    }
}

#[test]
fn huge_chunks_count_in_larger_units() {
    assert_eq!(core_unit(GIB, 1), 1);
    assert_eq!(core_unit(4 * GIB, 1), 4);
    assert_eq!(core_unit(4 * GIB, 256), 256);
    assert_eq!(core_unit(1 << 40, 256), 1024);
}

fn core_unit(len: u64, alignment: u64) -> u64 {
    let mut unit = alignment;
    while len / unit > 1 << 30 {
        unit *= 2;
    }
    unit
}

#[test]
fn many_threads_allocate_and_free() {
    let (a, backing) = arena(64);
    let a = Arc::new(a);
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let a = a.clone();
            s.spawn(move || {
                for i in 0..500u64 {
                    let b = a.alloc(1 + (i * 7 + t) % 3000).unwrap();
                    let l = b.lease();
                    drop(b);
                    drop(l);
                }
            });
        }
    });
    let s = a.stats();
    assert_eq!(
        (s.buffers, s.leases, s.used_bytes, s.requested_bytes),
        (0, 0, 0, 0)
    );
    a.trim();
    assert_eq!(backing.live.load(Ordering::SeqCst), 0);
}

// ---------------------------------------------------------------------------
// Random sequences against a model

#[derive(Clone, Debug)]
enum Op {
    Alloc(u64),
    DropBuffer(usize),
    Lease(usize),
    LeaseOfLease(usize),
    DropLease(usize),
    Pin(usize),
    Unpin(usize),
    Reserve(u64),
    Trim,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => prop_oneof![1u64..512, 1u64..70_000, 200_000u64..600_000].prop_map(Op::Alloc),
        3 => any::<usize>().prop_map(Op::DropBuffer),
        3 => any::<usize>().prop_map(Op::Lease),
        1 => any::<usize>().prop_map(Op::LeaseOfLease),
        3 => any::<usize>().prop_map(Op::DropLease),
        1 => any::<usize>().prop_map(Op::Pin),
        1 => any::<usize>().prop_map(Op::Unpin),
        1 => (1u64..400_000).prop_map(Op::Reserve),
        1 => Just(Op::Trim),
    ]
}

struct Model {
    arena: Arena<HostChunks>,
    backing: HostChunks,
    buffers: Vec<ArenaBuffer<HostChunks>>,
    leases: Vec<ArenaLease<HostChunks>>,
    pins: Vec<ChunkPin<HostChunks>>,
    alignment: u64,
    limit: Option<u64>,
}

impl Model {
    fn step(&mut self, op: &Op) {
        match *op {
            Op::Alloc(len) => {
                let before = self.arena.stats();
                match self.arena.alloc(len) {
                    Ok(b) => {
                        assert!(b.byte_len() == len && b.reserved_len() >= len);
                        let after = self.arena.stats();
                        if before.chunks == 0 {
                            assert_eq!(
                                after.chunks, 1,
                                "an empty arena grew by more than one chunk"
                            );
                        }
                        if after.chunks_created > before.chunks_created {
                            self.check_growth(&before, &b);
                        }
                        self.buffers.push(b);
                    }
                    Err(e) => {
                        // Only the limit refuses an allocation here.
                        assert!(self.limit.is_some(), "{e}");
                        assert!(e.to_string().contains("limit"), "{e}");
                    }
                }
            }
            Op::DropBuffer(i) if !self.buffers.is_empty() => {
                let n = self.buffers.len();
                self.buffers.swap_remove(i % n);
            }
            Op::Lease(i) if !self.buffers.is_empty() => {
                let n = self.buffers.len();
                self.leases.push(self.buffers[i % n].lease());
            }
            Op::LeaseOfLease(i) if !self.leases.is_empty() => {
                let n = self.leases.len();
                self.leases.push(self.leases[i % n].clone());
            }
            Op::DropLease(i) if !self.leases.is_empty() => {
                let n = self.leases.len();
                self.leases.swap_remove(i % n);
            }
            Op::Pin(i) => {
                let chunks = self.arena.chunks();
                if !chunks.is_empty() {
                    let id = chunks[i % chunks.len()].id;
                    self.pins.push(self.arena.pin(id).unwrap());
                }
            }
            Op::Unpin(i) if !self.pins.is_empty() => {
                let n = self.pins.len();
                self.pins.swap_remove(i % n);
            }
            Op::Reserve(bytes) => match self.arena.reserve(bytes) {
                Ok(made) => {
                    assert!(made == 0 || made >= self.arena.options().chunk_size);
                    let s = self.arena.stats();
                    let free: u64 = self.arena.chunks().iter().map(|c| c.free).sum();
                    assert!(free >= bytes, "reserved {bytes} but {free} free ({s:?})");
                }
                Err(e) => assert!(
                    self.limit.is_some() && e.to_string().contains("limit"),
                    "{e}"
                ),
            },
            Op::Trim => {
                let before = self.arena.stats();
                let released = self.arena.trim();
                let after = self.arena.stats();
                assert_eq!(after.idle_chunks, 0);
                assert_eq!(after.chunks, before.chunks - before.idle_chunks);
                assert_eq!(after.chunk_bytes, before.chunk_bytes - released);
            }
            _ => {}
        }
        self.check();
    }

    /// A chunk made for an allocation is as large as the arena was (within
    /// the bounds), or as large as the buffer if that is larger.
    fn check_growth(&self, before: &ArenaStats, b: &ArenaBuffer<HostChunks>) {
        let o = self.arena.options();
        let grown = before.chunk_bytes.clamp(o.chunk_size, o.max_chunk_size);
        let want = grown
            .max(b.byte_len())
            .next_multiple_of(GRANULE)
            .next_multiple_of(self.alignment);
        assert_eq!(
            b.chunk().byte_len(),
            want,
            "growth from {before:?} for {} bytes",
            b.byte_len()
        );
    }

    /// Every invariant of the accounting.
    fn check(&self) {
        // The live ranges, each once: held by the producer, leases or both.
        let mut ranges: BTreeMap<(u64, u64), (u64, u64, bool, usize)> = BTreeMap::new();
        for b in &self.buffers {
            let e = ranges.entry((b.view().chunk.index, b.offset())).or_insert((
                b.byte_len(),
                b.reserved_len(),
                false,
                0,
            ));
            assert!(!e.2, "two buffers share a range: {b:?}");
            e.2 = true;
        }
        for l in &self.leases {
            let v = l.view();
            let e = ranges.entry((v.chunk.index, v.offset)).or_insert((
                v.byte_len,
                v.byte_len.next_multiple_of(self.alignment),
                false,
                0,
            ));
            assert_eq!(e.0, v.byte_len, "a lease and a buffer disagree on a range");
            e.3 += 1;
        }
        let chunks: BTreeMap<u64, ChunkInfo> = self
            .arena
            .chunks()
            .into_iter()
            .map(|c| (c.id.index, c))
            .collect();
        let mut end_of_last: Option<(u64, u64)> = None;
        for (&(chunk, offset), &(len, _, _, _)) in &ranges {
            let info = chunks
                .get(&chunk)
                .expect("a live range's chunk was released");
            assert!(
                offset.is_multiple_of(self.alignment),
                "misaligned offset {offset}"
            );
            assert!(offset.is_multiple_of(info.unit));
            let reserved = len.div_ceil(info.unit) * info.unit;
            assert!(
                offset + reserved <= info.len,
                "range passes its chunk's end"
            );
            if let Some((c, end)) = end_of_last
                && c == chunk
            {
                assert!(
                    offset >= end,
                    "ranges overlap in chunk {chunk} at {offset} (< {end})"
                );
            }
            end_of_last = Some((chunk, offset + reserved));
        }
        let s = self.arena.stats();
        assert_eq!(s.buffers, ranges.len());
        assert_eq!(s.leases, self.leases.len());
        assert_eq!(s.pins, self.pins.len());
        assert_eq!(
            s.held_by_leases_only,
            ranges.values().filter(|r| !r.2 && r.3 > 0).count()
        );
        assert_eq!(s.requested_bytes, ranges.values().map(|r| r.0).sum::<u64>());
        let used: u64 = ranges
            .iter()
            .map(|(&(c, _), r)| r.0.div_ceil(chunks[&c].unit) * chunks[&c].unit)
            .sum();
        assert_eq!(s.used_bytes, used);
        assert_eq!(s.chunks, chunks.len());
        assert_eq!(s.chunk_bytes, chunks.values().map(|c| c.len).sum::<u64>());
        assert_eq!(self.backing.live.load(Ordering::SeqCst), s.chunks as u64);
        assert_eq!(
            self.backing.live_bytes.load(Ordering::SeqCst),
            s.chunk_bytes
        );
        assert_eq!(
            s.idle_chunks,
            chunks
                .values()
                .filter(|c| c.buffers == 0 && c.pins == 0)
                .count()
        );
        for c in chunks.values() {
            let n = ranges.keys().filter(|(i, _)| *i == c.id.index).count();
            assert_eq!(
                c.buffers, n,
                "chunk {} counts {} ranges, holds {n}",
                c.id, c.buffers
            );
        }
        if let Some(limit) = self.limit {
            assert!(
                s.chunk_bytes <= limit,
                "{} bytes of chunks over the limit {limit}",
                s.chunk_bytes
            );
        }
        assert_eq!(s.chunks_created - s.chunks_released, s.chunks as u64);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// No overlap, alignment, reuse only after the last lease, growth,
    /// trimming and every count, after random sequences of operations; and
    /// everything is released at the end.
    #[test]
    fn accounting_holds_after_random_operations(
        alignment in prop_oneof![Just(1u64), Just(16), Just(256), Just(4096)],
        limit in prop_oneof![Just(None), (256u64..2048).prop_map(|k| Some(k * KIB))],
        ops in prop::collection::vec(op(), 1..160),
    ) {
        let backing = HostChunks::default();
        let arena = Arena::new(backing.clone(), ArenaOptions { limit, ..options(alignment) }).unwrap();
        let mut m = Model {
            arena,
            backing: backing.clone(),
            buffers: Vec::new(),
            leases: Vec::new(),
            pins: Vec::new(),
            alignment,
            limit,
        };
        for op in &ops {
            m.step(op);
        }
        m.buffers.clear();
        m.check();
        m.pins.clear();
        m.leases.clear();
        m.check();
        let s = m.arena.stats();
        prop_assert_eq!((s.buffers, s.used_bytes, s.leases, s.pins), (0, 0, 0, 0));
        prop_assert_eq!(s.idle_chunks, s.chunks);
        m.arena.trim();
        prop_assert_eq!(backing.live.load(Ordering::SeqCst), 0);
    }
}

#[test]
fn set_members_are_byte_ranges_inside_their_buffer() {
    use super::device::member_len;
    use crate::descriptor::Dtype;
    // A member that starts its buffer, and ranges inside one.
    assert_eq!(member_len("w", Dtype::F32, &[4, 8], 0, 128).unwrap(), 128);
    assert_eq!(member_len("w", Dtype::F32, &[8], 96, 128).unwrap(), 32);
    assert_eq!(member_len("w", Dtype::F64, &[], 120, 128).unwrap(), 8);
    assert_eq!(member_len("w", Dtype::U8, &[1], 127, 128).unwrap(), 1);
    assert_eq!(member_len("w", Dtype::Bf16, &[0], 64, 128).unwrap(), 0);
    // Past the end, from the start or from an offset.
    let e = member_len("w", Dtype::F32, &[33], 0, 128).unwrap_err();
    assert!(
        e.to_string()
            .contains("does not fit in its 128-byte buffer"),
        "{e}"
    );
    let e = member_len("w", Dtype::F32, &[8], 100, 128).unwrap_err();
    assert!(e.to_string().contains("from byte 100 does not fit"), "{e}");
    assert_eq!(e.kind(), cuda_ipc_core::ErrorKind::InvalidInput);
    let e = member_len("w", Dtype::U8, &[1], 128, 128).unwrap_err();
    assert!(e.to_string().contains("from byte 128"), "{e}");
    // Off the dtype's alignment.
    let e = member_len("layer.bias", Dtype::F32, &[1], 2, 128).unwrap_err();
    assert!(
        e.to_string()
            .contains("\"layer.bias\" starts 2 bytes into its buffer"),
        "{e}"
    );
    assert!(member_len("w", Dtype::I64, &[1], 4, 128).is_err());
    assert!(member_len("w", Dtype::F16, &[1], 2, 128).is_ok());
    // Overflow in the shape or in the end is refused, not wrapped.
    assert!(member_len("w", Dtype::F32, &[u64::MAX, 2], 0, 128).is_err());
    assert!(member_len("w", Dtype::U8, &[2], u64::MAX - 1, u64::MAX).is_err());
}
