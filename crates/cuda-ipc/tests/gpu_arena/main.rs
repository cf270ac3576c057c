//! GPU tests of arenas and set records: real multi-process tests on a real
//! device, `#[ignore = "needs an NVIDIA GPU"]` like every GPU test. On a GPU
//! host: `cargo test --release --test gpu_arena -- --ignored --test-threads=1`,
//! or the bundle of `scripts/gpu-bundle.sh` (`run.sh tests`).
//!
//! For every chunk mechanism (vmm, pool, legacy): buffers of mixed sizes
//! (one larger than a chunk, which gets a chunk of its own) are filled by a
//! kernel; a child process decodes the set record, maps each chunk once and
//! checks every buffer's values; the producer drops a buffer the child still
//! holds a lease on, allocates and fills new buffers, and the child finds
//! the leased bytes unchanged; after the lease ends the range is reused; and
//! trimming gives the chunks and their file descriptors back.

#[path = "../gpu/common.rs"]
mod common;

use std::collections::HashMap;
use std::sync::Arc;

use cuda_ipc::arena::{Arena, ArenaOptions, DeviceArena, DeviceChunks, SetMember};
use cuda_ipc::buffer::{MappedBuffer, Mapping};
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::set::SetRecord;
use cuda_ipc::{Device, DeviceMemory, Dtype, Mechanism, share};
use serde_json::{Value, json};

use common::{Parent, Peer, open_fds, role};

const MIB: u64 = 1 << 20;

fn pattern_of(i: usize, round: u32) -> Pattern {
    Pattern::ramp(i as u32 * 1000 + round, 3 + round)
}

fn pattern_json(p: Pattern) -> Value {
    json!([p.base, p.step])
}

/// The child: maps each chunk of a set once (cached by arena and chunk id),
/// checks the entries it is told to against their patterns.
fn consumer() {
    let parent = Parent::new();
    let device = Device::open(0).expect("child opens device 0");
    let mut cache: HashMap<(u64, u64), Arc<dyn Mapping>> = HashMap::new();
    let mut maps = 0;
    while let Some(req) = parent.recv() {
        let reply = match req["op"].as_str().unwrap_or_default() {
            "exit" => break,
            "close" => {
                let n = cache.len();
                cache.clear();
                json!({ "closed": n, "bad": null })
            }
            "check" => {
                let set = SetRecord::from_value(&req["set"]).expect("the set record decodes");
                let mut bad = Value::Null;
                for (i, p) in req["expect"].as_array().unwrap().iter().enumerate() {
                    if p.is_null() {
                        continue;
                    }
                    let want =
                        Pattern::ramp(p[0].as_u64().unwrap() as u32, p[1].as_u64().unwrap() as u32);
                    let e = &set.entries[i];
                    let chunk = set.chunk(e.chunk).unwrap();
                    let mapping = cache
                        .entry((set.arena.0, e.chunk))
                        .or_insert_with(|| {
                            maps += 1;
                            share::open_mapping(
                                &device,
                                &chunk.descriptor,
                                Vec::new(),
                                cuda_ipc::Access::ReadWrite,
                            )
                            .expect("chunk maps")
                        })
                        .clone();
                    let view = MappedBuffer::<u32>::from_bytes(
                        mapping,
                        chunk.descriptor.offset + e.offset,
                        e.len,
                    )
                    .expect("entry view");
                    if let Some(at) = kernels::check_u32(&view, want).expect("check") {
                        bad = json!({ "entry": e.name, "element": at });
                        break;
                    }
                }
                json!({ "bad": bad, "maps": maps })
            }
            other => json!({ "error": format!("unknown op {other}") }),
        };
        parent.send(&reply);
    }
}

fn arena_of(device: &Device, m: Mechanism) -> DeviceArena {
    let options = ArenaOptions::default()
        .with_chunk_size(64 * MIB)
        .with_max_chunk_size(128 * MIB);
    Arena::new(DeviceChunks::new(device, Some(m)).unwrap(), options).unwrap()
}

fn check(peer: &mut Peer, set: &SetRecord, expect: &[Option<Pattern>]) -> Value {
    let expect: Vec<Value> = expect
        .iter()
        .map(|p| p.map_or(Value::Null, pattern_json))
        .collect();
    peer.send(&json!({ "op": "check", "set": set.to_value(), "expect": expect }));
    let r = peer.recv();
    assert!(
        r["bad"].is_null() && r.get("error").is_none(),
        "the child saw: {r}"
    );
    r
}

/// Every chunk mechanism: fill, check in another process, keep leased
/// memory, reuse after the lease, trim.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn every_chunk_mechanism_hands_off_sets_and_keeps_leased_memory() {
    if role().as_deref() == Some("consumer") {
        return consumer();
    }
    let device = Device::open(0).unwrap();
    share::allow_fd_fetching().unwrap();
    let mut peer = Peer::spawn(
        "every_chunk_mechanism_hands_off_sets_and_keeps_leased_memory",
        "consumer",
    );
    for m in [Mechanism::Vmm, Mechanism::Pool, Mechanism::Legacy] {
        let arena = arena_of(&device, m);
        assert_eq!(arena.reserve(32 * MIB).unwrap(), 64 * MIB);
        let sizes = [4096, MIB + 256, 3 * MIB, 200 * MIB, 8, 60 * MIB];
        let buffers: Vec<_> = sizes.iter().map(|s| arena.alloc(*s).unwrap()).collect();
        for (i, b) in buffers.iter().enumerate() {
            assert!(b.offset().is_multiple_of(256) && b.device_address().is_multiple_of(256));
            kernels::fill_u32(b, pattern_of(i, 0), Speed::Full).unwrap();
        }
        buffers[0].synchronize().unwrap();
        let s = arena.stats();
        let fds_with_chunks = open_fds();
        assert!(
            s.chunks >= 3,
            "{m}: 200 MiB should get a chunk of its own: {s:?}"
        );
        let shapes: Vec<Vec<u64>> = sizes.iter().map(|s| vec![s / 4]).collect();
        let names: Vec<String> = (0..sizes.len()).map(|i| format!("t{i}")).collect();
        let members = |bufs: &[&cuda_ipc::arena::DeviceArenaBuffer]| -> SetRecord {
            arena
                .describe_set(
                    &format!("set-{m}"),
                    bufs.iter()
                        .enumerate()
                        .map(|(i, b)| SetMember::new(&names[i], Dtype::U32, &shapes[i], b)),
                )
                .unwrap()
        };
        let set = members(&buffers.iter().collect::<Vec<_>>());
        assert_eq!(
            set.chunks.len(),
            s.chunks,
            "{m}: one table row per chunk used"
        );
        let expect: Vec<_> = (0..sizes.len()).map(|i| Some(pattern_of(i, 0))).collect();
        let r = check(&mut peer, &set, &expect);
        println!(
            "{m:>6}: {} buffers in {} chunks checked in the child ({} maps)",
            sizes.len(),
            set.chunks.len(),
            r["maps"]
        );

        // The producer drops buffer 2 while the child's lease holds it.
        let mut buffers = buffers;
        let leased = buffers.remove(2);
        let view = leased.view();
        let lease = leased.lease();
        drop(leased);
        assert_eq!(arena.stats().held_by_leases_only, 1);
        let fresh: Vec<_> = (0..4).map(|_| arena.alloc(3 * MIB).unwrap()).collect();
        for (k, f) in fresh.iter().enumerate() {
            let v = f.view();
            assert!(
                v.chunk != view.chunk
                    || v.offset >= view.offset + view.byte_len
                    || v.offset + v.byte_len <= view.offset,
                "{m}: a leased range was handed out again"
            );
            kernels::fill_u32(f, Pattern::constant(0xDEAD_0000 + k as u32), Speed::Full).unwrap();
        }
        fresh[0].synchronize().unwrap();
        let only_leased: Vec<_> = (0..sizes.len())
            .map(|i| (i == 2).then(|| pattern_of(2, 0)))
            .collect();
        check(&mut peer, &set, &only_leased);
        drop(lease);
        assert_eq!(arena.stats().held_by_leases_only, 0);
        drop(fresh);
        drop(buffers);
        peer.send(&json!({ "op": "close" }));
        assert!(peer.recv()["closed"].as_u64().unwrap() >= 1);
        let s = arena.stats();
        assert_eq!((s.buffers, s.leases, s.used_bytes), (0, 0, 0), "{m}: {s:?}");
        let released = arena.trim();
        assert_eq!(released, s.chunk_bytes, "{m}");
        assert_eq!(arena.stats().chunks, 0);
        if m.uses_fd() {
            // Each chunk held one exported file descriptor until trimmed.
            assert!(
                open_fds() + 3 <= fds_with_chunks,
                "{m}: trimmed chunks kept their descriptors"
            );
        }
    }
    peer.send(&json!({ "op": "exit" }));
    assert!(peer.finish());
}

/// A set of 1,000 buffers from one arena, every value checked in the child,
/// then refilled in place and checked again through the cached mappings.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_thousand_buffer_set_is_checked_and_updated_in_place() {
    if role().as_deref() == Some("consumer") {
        return consumer();
    }
    let device = Device::open(0).unwrap();
    share::allow_fd_fetching().unwrap();
    let mut peer = Peer::spawn(
        "a_thousand_buffer_set_is_checked_and_updated_in_place",
        "consumer",
    );
    let arena = arena_of(&device, Mechanism::Vmm);
    let sizes: Vec<u64> = (0..1000u64)
        .map(|i| 4 * (1 + (i * 7919) % 65_536))
        .collect();
    arena
        .reserve(sizes.iter().map(|s| s.next_multiple_of(256)).sum())
        .unwrap();
    let created = arena.stats().chunks_created;
    let buffers: Vec<_> = sizes.iter().map(|s| arena.alloc(*s).unwrap()).collect();
    assert_eq!(
        arena.stats().chunks_created,
        created,
        "reserve made room for the whole set"
    );
    let shapes: Vec<Vec<u64>> = sizes.iter().map(|s| vec![s / 4]).collect();
    let names: Vec<String> = (0..sizes.len())
        .map(|i| format!("layers.{i}.weight"))
        .collect();
    let set = arena
        .describe_set(
            "weights",
            buffers
                .iter()
                .enumerate()
                .map(|(i, b)| SetMember::new(&names[i], Dtype::U32, &shapes[i], b)),
        )
        .unwrap();
    for round in 0..2 {
        for (i, b) in buffers.iter().enumerate() {
            kernels::fill_u32(b, pattern_of(i, round), Speed::Full).unwrap();
        }
        buffers[0].synchronize().unwrap();
        let expect: Vec<_> = (0..sizes.len())
            .map(|i| Some(pattern_of(i, round)))
            .collect();
        let r = check(&mut peer, &set, &expect);
        assert_eq!(
            r["maps"].as_u64().unwrap() as usize,
            set.chunks.len(),
            "each chunk mapped once"
        );
    }
    println!(
        "1,000 buffers in {} chunk(s), checked twice",
        set.chunks.len()
    );
    peer.send(&json!({ "op": "exit" }));
    assert!(peer.finish());
}
