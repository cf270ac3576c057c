//! Publishing from an arena and sets, across processes on a real device:
//! every chunk mechanism, sets of 1 to 10,000 buffers with every value
//! checked, buffers the producer dropped kept while a consumer holds them,
//! consumers killed in the middle of set hand-offs, a set hand-off soak
//! with device memory and descriptors unchanged, a set published and
//! updated after another library's stream with its writes still queued,
//! and a crude timing of a fresh hand-off from an arena.
//!
//! Knobs: `CUDA_IPC_SET_CHAOS_ROUNDS` (default 10),
//! `CUDA_IPC_SET_SOAK_CYCLES` (default 100,000).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cuda_ipc::arena::{DeviceArenaBuffer, DeviceChunks, SetMember};
use cuda_ipc::exchange::{
    Attachment, Publisher, PublisherConfig, SetAttachment, Sharing, Subscriber, SubscriberConfig,
};
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::set::weight_sizes;
use cuda_ipc::{Device, DeviceMemory, Dtype, Mechanism};
use serde_json::{Value, json};

use super::common::{Parent, Peer, free_memory, open_fds, queued_fill, stream_done};
use crate::test_name;

const MIB: u64 = 1 << 20;
const SOCKET_ENV: &str = "CUDA_IPC_TEST_SOCKET";
const MECHANISMS: [Mechanism; 3] = [Mechanism::Vmm, Mechanism::Pool, Mechanism::Legacy];

/// The values of buffer `i` of a set filled from `base`.
fn pattern(base: u32, i: usize) -> Pattern {
    Pattern::ramp(base.wrapping_add((i as u32).wrapping_mul(0x0001_0001)), 1)
}

fn socket_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("cuda-ipc-gpu-set")
        .tempdir()
        .expect("temp dir")
}

fn spawn(test: &str, socket: &Path) -> Peer {
    let p = Peer::spawn_with(test, "subscriber", |c| {
        c.env(SOCKET_ENV, socket);
    });
    assert_eq!(p.recv()["connected"], true);
    p
}

fn env_count(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A set of `sizes` in the publisher's arena, every buffer filled from `base`.
struct Set {
    buffers: Vec<DeviceArenaBuffer>,
    names: Vec<String>,
    shapes: Vec<[u64; 1]>,
}

impl Set {
    fn new(publisher: &Publisher, sizes: &[u64], base: u32) -> Set {
        let buffers: Vec<_> = sizes.iter().map(|s| publisher.alloc(*s).unwrap()).collect();
        let set = Set {
            names: (0..sizes.len())
                .map(|i| format!("layer{i}.weight"))
                .collect(),
            shapes: sizes.iter().map(|s| [s / 4]).collect(),
            buffers,
        };
        set.fill(base);
        set
    }

    fn fill(&self, base: u32) {
        for (i, b) in self.buffers.iter().enumerate() {
            kernels::fill_u32(b, pattern(base, i), Speed::Full).unwrap();
        }
    }

    fn members(&self) -> Vec<SetMember<'_>> {
        self.buffers
            .iter()
            .zip(&self.names)
            .zip(&self.shapes)
            .map(|((buffer, name), shape)| SetMember::new(name, Dtype::U32, shape, buffer))
            .collect()
    }

    fn publish(&self, publisher: &Publisher, name: &str) {
        publisher.publish_set(name, &self.members()).unwrap();
    }
}

/// Checks every value of every buffer of `set`: the first bad `[buffer, word]`.
/// Each buffer's place as `entry_places` works it out (without a view) must
/// be its view's.
fn check_set(set: &SetAttachment, base: u32) -> Value {
    let places = set.entry_places().unwrap();
    assert_eq!(places.len(), set.len());
    for (i, place) in places.iter().enumerate() {
        let v = set.view::<u32>(i).unwrap();
        let m = v.mapping();
        assert_eq!(
            (place.mapping_base, place.mapping_size, place.address),
            (m.base(), m.size(), m.base() + v.offset()),
            "entry {i}"
        );
        if let Some(w) = kernels::check_u32(&v, pattern(base, i)).unwrap() {
            return json!([i, w]);
        }
    }
    Value::Null
}

/// Checks entry i of `set` against the ramp `req["patterns"][i]` =
/// `[base, step]`: the first bad `[entry, word]`.
fn check_ranges(set: &SetAttachment, req: &Value) -> Value {
    for (i, p) in req["patterns"].as_array().into_iter().flatten().enumerate() {
        let pattern = Pattern {
            base: p[0].as_u64().unwrap_or(0) as u32,
            step: p[1].as_u64().unwrap_or(0) as u32,
        };
        let v = set.view::<u32>(i).unwrap();
        if let Some(w) = kernels::check_u32(&v, pattern).unwrap() {
            return json!([i, w]);
        }
    }
    Value::Null
}

/// The elements of every entry of `set` together.
fn elements_of(set: &SetAttachment) -> u64 {
    set.entries()
        .iter()
        .map(|e| e.shape.iter().product::<u64>())
        .sum()
}

fn base_of(req: &Value) -> u32 {
    req["base"].as_u64().unwrap_or(0) as u32
}

/// The subscriber child: one request at a time.
fn subscriber() {
    let parent = Parent::new();
    let device = Device::open(0).unwrap();
    let socket = PathBuf::from(std::env::var(SOCKET_ENV).unwrap());
    let sub = Subscriber::connect(&device, socket.as_path(), SubscriberConfig::default()).unwrap();
    parent.send(&json!({ "connected": true }));
    let mut sets: Vec<SetAttachment> = Vec::new();
    let mut single: Vec<Attachment<u32>> = Vec::new();
    while let Some(req) = parent.recv() {
        let name = req["name"].as_str().unwrap_or_default().to_string();
        let reply = match req["op"].as_str().unwrap_or_default() {
            "exit" => break,
            "attach_set" => match sub.attach_set(&name) {
                Ok(s) => {
                    let bad = if req["check"] == false {
                        Value::Null
                    } else {
                        check_set(&s, base_of(&req))
                    };
                    let r = json!({
                        "bad": bad,
                        "len": s.len(),
                        "opens": sub.opens(),
                        "table_hits": sub.entry_tables().hits(), "elements": elements_of(&s),
                    });
                    sets.push(s);
                    r
                }
                Err(e) => json!({ "error": e.to_string() }),
            },
            "attach_ranges" => match sub.attach_set(&name) {
                Ok(s) => {
                    let r = json!({ "bad": check_ranges(&s, &req), "len": s.len() });
                    sets.push(s);
                    r
                }
                Err(e) => json!({ "error": e.to_string() }),
            },
            "wait_ranges" => match sub.wait_set_update(&sets[0], Duration::from_secs(30)) {
                Ok(version) => json!({ "bad": check_ranges(&sets[0], &req), "version": version }),
                Err(e) => json!({ "error": e.to_string() }),
            },
            "check_held" => {
                json!({ "bad": check_set(&sets[0], base_of(&req)) })
            }
            "wait_update" => match sub.wait_set_update(&sets[0], Duration::from_secs(30)) {
                Ok(version) => {
                    json!({ "bad": check_set(&sets[0], base_of(&req)), "version": version })
                }
                Err(e) => json!({ "error": e.to_string() }),
            },
            "release" => {
                let r = sets
                    .drain(..)
                    .map(|s| sub.release_set(s))
                    .collect::<Result<Vec<_>, _>>();
                for a in single.drain(..) {
                    sub.release(a).unwrap();
                }
                match r {
                    Ok(_) => json!({ "bad": null, "cached": sub.cached_mappings().0 }),
                    Err(e) => json!({ "error": e.to_string() }),
                }
            }
            "attach_buffer" => match sub.attach::<u32>(&name) {
                Ok(a) => {
                    let bad = kernels::check_u32(a.buffer(), pattern(base_of(&req), 0)).unwrap();
                    single.push(a);
                    json!({ "bad": bad })
                }
                Err(e) => json!({ "error": e.to_string() }),
            },
            "cycle" => {
                // Attach, read the first word of the first buffer, release.
                match sub.attach_set(&name) {
                    Ok(s) => {
                        let first: Vec<u32> = s
                            .view::<u32>(0)
                            .unwrap()
                            .slice(0..1)
                            .unwrap()
                            .to_vec()
                            .unwrap();
                        sub.release_set(s).unwrap();
                        json!({ "bad": if first[0] == pattern(base_of(&req), 0).at(0) { Value::Null } else { json!(first[0]) } })
                    }
                    Err(e) => json!({ "error": e.to_string() }),
                }
            }
            "fds" => json!({ "fds": open_fds(), "bad": null }),
            other => json!({ "error": format!("unknown op {other}") }),
        };
        parent.send(&reply);
    }
}

fn child_or(f: impl FnOnce()) {
    super::common::child_or("subscriber", subscriber, f);
}

fn ask(p: &mut Peer, req: &Value) -> Value {
    p.send(req);
    let r = p.recv();
    assert!(
        r.get("error").is_none() && r.get("bad").is_some_and(Value::is_null),
        "{req}: the child answered {r}"
    );
    r
}

/// The mechanisms this device's arenas can use.
fn mechanisms(device: &Device) -> Vec<Mechanism> {
    MECHANISMS
        .into_iter()
        .filter(|m| match DeviceChunks::new(device, Some(*m)) {
            Ok(_) => true,
            Err(e) => {
                println!("skipping {m}: {e}");
                false
            }
        })
        .collect()
}

fn publisher_on(device: &Device, dir: &Path, sharing: Sharing) -> Publisher {
    Publisher::bind(
        device,
        dir.join("s.sock"),
        PublisherConfig::default().with_sharing(sharing),
    )
    .unwrap()
}

/// For each chunk mechanism: a set of 100 buffers attached and checked, an
/// arena buffer attached with the per-buffer API, an update in place seen
/// by the consumer after its event, release, unpublish, trim.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn sets_on_every_chunk_mechanism() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        for m in mechanisms(&device) {
            let dir = socket_dir();
            let publisher = publisher_on(&device, dir.path(), Sharing::arena(m));
            let sizes = weight_sizes(100, 64 * MIB, 1).unwrap();
            let set = Set::new(&publisher, &sizes, 11);
            set.publish(&publisher, "weights");
            let single = publisher.alloc(3 * MIB).unwrap();
            kernels::fill_u32(&single, pattern(77, 0), Speed::Full).unwrap();
            publisher
                .publish_buffer("one", &single, Dtype::U32, &[3 * MIB / 4])
                .unwrap();
            let mut p = spawn(
                &test_name!("sets_on_every_chunk_mechanism"),
                publisher.path(),
            );
            let r = ask(
                &mut p,
                &json!({ "op": "attach_set", "name": "weights", "base": 11 }),
            );
            assert_eq!(r["len"], 100, "{m}");
            let chunks = publisher.arena().unwrap().stats().chunks as u64;
            assert_eq!(r["opens"], chunks, "{m}: each chunk mapped once");
            let r = ask(
                &mut p,
                &json!({ "op": "attach_buffer", "name": "one", "base": 77 }),
            );
            drop(r);
            // Update in place: new contents, one event for the set.
            set.fill(12);
            assert_eq!(publisher.update_set("weights").unwrap(), 1);
            let r = ask(&mut p, &json!({ "op": "wait_update", "base": 12 }));
            assert_eq!(r["version"], 1, "{m}");
            ask(&mut p, &json!({ "op": "release" }));
            // The same layout again under another name: the subscriber
            // reuses the entry table it read, and the values are right.
            set.publish(&publisher, "weights-again");
            let r = ask(
                &mut p,
                &json!({ "op": "attach_set", "name": "weights-again", "base": 12 }),
            );
            assert_eq!(
                (r["len"].clone(), r["table_hits"].clone()),
                (json!(100), json!(1)),
                "{m}"
            );
            // ... and the publisher described it from the layout it kept.
            assert_eq!(publisher.set_layouts().hits(), 1, "{m}");
            ask(&mut p, &json!({ "op": "release" }));
            for name in ["weights", "weights-again", "one"] {
                publisher
                    .unpublish_set(name, Some(Duration::from_secs(10)))
                    .unwrap();
            }
            p.send(&json!({ "op": "exit" }));
            assert!(p.finish(), "{m}: the child failed");
            drop(set);
            drop(single);
            let stats = publisher.arena().unwrap().stats();
            assert_eq!(stats.buffers, 0, "{m}: {stats:?}");
            // The child has exited, but the publisher learns that it let go
            // of the chunks a moment later (its hang-up is read on the
            // server's thread): wait for that, within bounds.
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut trimmed = publisher.trim().unwrap();
            while trimmed == 0 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
                trimmed = publisher.trim().unwrap();
            }
            assert!(trimmed > 0, "{m}");
            println!("{m}: set of 100 buffers, update and per-buffer attach checked");
        }
    });
}

/// Members that are byte ranges of one arena buffer (what a caching
/// allocator on the arena makes of its segments): the consumer sees each
/// range's own values; a range past the buffer's end or off its dtype's
/// alignment is refused before anything is published.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn members_that_are_byte_ranges_of_one_buffer() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        let m = mechanisms(&device)[0];
        let dir = socket_dir();
        let publisher = publisher_on(&device, dir.path(), Sharing::arena(m));
        let buffer = publisher.alloc(4 * MIB).unwrap();
        kernels::fill_u32(&buffer, Pattern { base: 5, step: 1 }, Speed::Full).unwrap();
        // (name, offset in bytes, elements)
        let ranges: [(&str, u64, u64); 3] = [
            ("head", 0, 256),
            ("middle", 4096 + 512, 1000),
            ("tail", 4 * MIB - 1024, 256),
        ];
        let shapes: Vec<[u64; 1]> = ranges.iter().map(|r| [r.2]).collect();
        let members: Vec<SetMember<'_>> = ranges
            .iter()
            .zip(&shapes)
            .map(|((name, offset, _), shape)| {
                SetMember::new(name, Dtype::U32, shape, &buffer).at(*offset)
            })
            .collect();
        for (offset, elements, what) in [
            (2, 1, "not a multiple"),
            (4 * MIB - 1020, 256, "does not fit"),
        ] {
            let e = publisher
                .publish_set(
                    "bad",
                    &[SetMember::new("w", Dtype::U32, &[elements], &buffer).at(offset)],
                )
                .unwrap_err();
            assert!(e.to_string().contains(what), "{e}");
        }
        publisher.publish_set("ranges", &members).unwrap();
        let mut p = spawn(
            &test_name!("members_that_are_byte_ranges_of_one_buffer"),
            publisher.path(),
        );
        let patterns: Vec<Value> = ranges
            .iter()
            .map(|(_, offset, _)| json!([5 + offset / 4, 1]))
            .collect();
        let r = ask(
            &mut p,
            &json!({ "op": "attach_ranges", "name": "ranges", "patterns": patterns }),
        );
        assert_eq!(r["len"], 3);
        assert!(
            buffer.leases() > 0,
            "the published ranges hold their buffer"
        );
        ask(&mut p, &json!({ "op": "release" }));
        publisher
            .unpublish_set("ranges", Some(Duration::from_secs(10)))
            .unwrap();
        p.send(&json!({ "op": "exit" }));
        assert!(p.finish(), "the child failed");
        println!("{m}: three byte ranges of one buffer published and checked");
    });
}

/// A set written on a stream the library does not know (a raw stream
/// standing in for PyTorch's, borrowed with `Device::borrow_stream`) is
/// published and updated after it (`publish_set_after`,
/// `update_set_after`), then updated after the legacy default stream
/// (handle 1, which `borrow_stream` takes without asking the driver): each
/// call returns with the writes still queued behind 300 ms of the stream's
/// time, and the consumer's attach and waits see every byte written.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_set_ordered_after_a_borrowed_stream() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        let m = mechanisms(&device)[0];
        let dir = socket_dir();
        let publisher = publisher_on(&device, dir.path(), Sharing::arena(m));
        let buffer = publisher.alloc(64 * MIB).unwrap();
        kernels::fill_u32(&buffer, Pattern { base: 5, step: 1 }, Speed::Full).unwrap();
        let words = [16 * MIB];
        let members = [SetMember::new("w", Dtype::U32, &words, &buffer)];
        let writer = device.context().new_stream().unwrap();
        // The writer's fills come after the one above, on the arena's stream.
        writer.join(buffer.stream()).unwrap();
        // SAFETY: the handles of a stream this test holds, and the legacy
        // default stream.
        let borrowed = unsafe { device.borrow_stream(writer.cu_stream() as u64) }.unwrap();
        unsafe { device.borrow_stream(0) }.unwrap();
        queued_fill(&writer, &buffer, 0x11);
        publisher
            .publish_set_after("w", &members, &borrowed)
            .unwrap();
        assert!(
            !stream_done(&writer),
            "publish_set_after waited for the writer's stream"
        );
        let mut p = spawn(
            &test_name!("a_set_ordered_after_a_borrowed_stream"),
            publisher.path(),
        );
        ask(
            &mut p,
            &json!({ "op": "attach_ranges", "name": "w", "patterns": [[0x1111_1111u32, 0]] }),
        );
        // Each update: a fill queued on `stream` behind 300 ms, the update
        // ordered after it returning at once, the consumer seeing the fill.
        let mut update_after = |stream: &cudarc::driver::CudaStream, byte: u8, version: u64| {
            queued_fill(stream, &buffer, byte);
            assert_eq!(publisher.update_set_after("w", stream).unwrap(), version);
            assert!(
                !stream_done(stream),
                "update_set_after waited for the stream ({version})"
            );
            let word = u32::from_ne_bytes([byte; 4]);
            let r = ask(
                &mut p,
                &json!({ "op": "wait_ranges", "patterns": [[word, 0]] }),
            );
            assert_eq!(r["version"], version);
        };
        update_after(&borrowed, 0x22, 1);
        // The special handles name the context's default streams without a
        // driver check: an update ordered after the legacy default stream
        // (where the writer's fills are done: the consumer saw them).
        // SAFETY: special handles, live with the context.
        let legacy = unsafe { device.borrow_stream(1) }.unwrap();
        unsafe { device.borrow_stream(2) }.unwrap();
        update_after(&legacy, 0x33, 2);
        ask(&mut p, &json!({ "op": "release" }));
        publisher
            .unpublish_set("w", Some(Duration::from_secs(10)))
            .unwrap();
        p.send(&json!({ "op": "exit" }));
        assert!(p.finish(), "the child failed");
        println!(
            "{m}: a publish and two updates after borrowed streams' queued writes (a stream of \
             its own, the legacy default stream), checked"
        );
    });
}

/// A set published again with the members of one before shares the
/// layout the publisher kept; one member changed (its shape) is a new
/// layout, which the consumer sees; the first layout again is found again.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_layout_published_again_and_one_member_changed() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        let dir = socket_dir();
        let publisher = publisher_on(&device, dir.path(), Sharing::auto());
        let sizes = weight_sizes(100, 64 * MIB, 3).unwrap();
        let mut set = Set::new(&publisher, &sizes, 21);
        let elements = |set: &Set| set.shapes.iter().map(|s| s[0]).sum::<u64>();
        let full = elements(&set);
        set.publish(&publisher, "v1");
        let hits = publisher.set_layouts().hits();
        set.publish(&publisher, "v2");
        assert_eq!(publisher.set_layouts().hits(), hits + 1, "the same layout");
        let whole = set.shapes[7];
        set.shapes[7] = [whole[0] / 2];
        set.publish(&publisher, "v3");
        assert_eq!(publisher.set_layouts().hits(), hits + 1, "a member changed");
        let half = elements(&set);
        set.shapes[7] = whole;
        set.publish(&publisher, "v4");
        assert_eq!(publisher.set_layouts().hits(), hits + 2, "the first again");
        let mut p = spawn(
            &test_name!("a_layout_published_again_and_one_member_changed"),
            publisher.path(),
        );
        for (name, want) in [("v1", full), ("v2", full), ("v3", half), ("v4", full)] {
            let r = ask(
                &mut p,
                &json!({ "op": "attach_set", "name": name, "base": 21 }),
            );
            assert_eq!(
                (r["len"].clone(), r["elements"].clone(), r["bad"].clone()),
                (json!(100), json!(want), Value::Null),
                "{name}"
            );
            ask(&mut p, &json!({ "op": "release" }));
        }
        for name in ["v1", "v2", "v3", "v4"] {
            publisher
                .unpublish_set(name, Some(Duration::from_secs(10)))
                .unwrap();
        }
        p.send(&json!({ "op": "exit" }));
        assert!(p.finish(), "the child failed");
        println!(
            "a layout published again shared, one member changed seen: {full} and {half} elements"
        );
    });
}

/// Sets of 1, 100, 1,000 and 10,000 buffers (256 MiB in all), every value
/// of every buffer checked by the consumer; the chunks are mapped once.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn sets_of_1_to_10000_buffers() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        let dir = socket_dir();
        let publisher = publisher_on(&device, dir.path(), Sharing::auto());
        let mut p = spawn(
            &test_name!("sets_of_1_to_10000_buffers"),
            dir.path().join("s.sock").as_path(),
        );
        for (k, n) in [1usize, 100, 1000, 10_000].into_iter().enumerate() {
            let sizes = weight_sizes(n, 256 * MIB, 42).unwrap();
            let base = 1000 * k as u32;
            let set = Set::new(&publisher, &sizes, base);
            let name = format!("set{n}");
            set.publish(&publisher, &name);
            let t = Instant::now();
            let r = ask(
                &mut p,
                &json!({ "op": "attach_set", "name": name, "base": base }),
            );
            assert_eq!(r["len"], n);
            println!(
                "set of {n}: attached and every value checked in {:?}",
                t.elapsed()
            );
            assert_eq!(r["table_hits"], k, "{n}: a new layout is read");
            // Published again (10,000 entries travel in parts): the table
            // read for the first is reused, the values checked again.
            let again = format!("{name}-again");
            set.publish(&publisher, &again);
            let t = Instant::now();
            let r = ask(
                &mut p,
                &json!({ "op": "attach_set", "name": again, "base": base }),
            );
            assert_eq!(
                (r["len"].clone(), r["table_hits"].clone()),
                (json!(n), json!(k + 1))
            );
            println!(
                "set of {n} again (its entry table kept): attached and checked in {:?}",
                t.elapsed()
            );
            ask(&mut p, &json!({ "op": "release" }));
            for name in [&name, &again] {
                publisher
                    .unpublish_set(name, Some(Duration::from_secs(10)))
                    .unwrap();
            }
        }
        p.send(&json!({ "op": "exit" }));
        assert!(p.finish());
    });
}

/// The producer drops buffers a consumer still holds: their ranges stay
/// allocated (new buffers land elsewhere, and the consumer still reads the
/// old values) until the consumer releases the set.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn dropped_buffers_stay_until_the_consumer_releases() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        let dir = socket_dir();
        let publisher = publisher_on(&device, dir.path(), Sharing::auto());
        let sizes = weight_sizes(64, 128 * MIB, 3).unwrap();
        let set = Set::new(&publisher, &sizes, 5);
        set.publish(&publisher, "w");
        let mut p = spawn(
            &test_name!("dropped_buffers_stay_until_the_consumer_releases"),
            dir.path().join("s.sock").as_path(),
        );
        ask(
            &mut p,
            &json!({ "op": "attach_set", "name": "w", "base": 5 }),
        );
        publisher.unpublish_set("w", None).unwrap();
        drop(set);
        let stats = publisher.arena().unwrap().stats();
        assert_eq!(stats.held_by_leases_only, 64, "{stats:?}");
        assert_eq!(publisher.retired_sets(), 1);
        // New buffers of the same sizes, filled with other values.
        let other = Set::new(&publisher, &sizes, 999);
        for b in &other.buffers {
            b.synchronize().unwrap();
        }
        ask(&mut p, &json!({ "op": "check_held", "base": 5 }));
        ask(&mut p, &json!({ "op": "release" }));
        let deadline = Instant::now() + Duration::from_secs(10);
        while publisher.reap() == 0 && publisher.retired_sets() > 0 {
            assert!(
                Instant::now() < deadline,
                "the released set was never reaped"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let stats = publisher.arena().unwrap().stats();
        assert_eq!(stats.buffers, 64, "only the new set is left: {stats:?}");
        drop(other);
        p.send(&json!({ "op": "exit" }));
        assert!(p.finish());
    });
}

/// Consumers killed in the middle of set hand-offs (before, during and
/// after attaching): the channel ends their leases, the publisher gets its
/// ranges back, and a healthy consumer still sees every value.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn chaos_kills_in_the_middle_of_set_handoffs() {
    child_or(|| {
        let rounds = env_count("CUDA_IPC_SET_CHAOS_ROUNDS", 10);
        let device = Device::open(0).unwrap();
        let dir = socket_dir();
        let socket = dir.path().join("s.sock");
        let publisher = publisher_on(&device, dir.path(), Sharing::auto());
        let sizes = weight_sizes(1000, 256 * MIB, 9).unwrap();
        let test = test_name!("chaos_kills_in_the_middle_of_set_handoffs");
        for round in 0..rounds {
            let base = round as u32 * 31;
            let set = Set::new(&publisher, &sizes, base);
            let name = format!("round{round}");
            set.publish(&publisher, &name);
            let mut p = spawn(&test, &socket);
            p.send(&json!({ "op": "attach_set", "name": name, "base": base }));
            // Kill at a different moment each round: 0 to 9 ms into the hand-off.
            std::thread::sleep(Duration::from_micros(round * 1000 % 10_000));
            p.kill();
            publisher.unpublish_set(&name, None).unwrap();
            drop(set);
            let deadline = Instant::now() + Duration::from_secs(10);
            while publisher.retired_sets() > 0 {
                publisher.reap();
                assert!(
                    Instant::now() < deadline,
                    "round {round}: leases of a killed consumer stayed"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            assert_eq!(
                publisher.arena().unwrap().stats().buffers,
                0,
                "round {round}"
            );
        }
        // A healthy consumer after the chaos.
        let set = Set::new(&publisher, &sizes, 4242);
        set.publish(&publisher, "after");
        let mut p = spawn(&test, &socket);
        ask(
            &mut p,
            &json!({ "op": "attach_set", "name": "after", "base": 4242 }),
        );
        p.send(&json!({ "op": "exit" }));
        assert!(p.finish());
        println!("{rounds} consumers killed in the middle of set hand-offs; ranges all came back");
    });
}

/// A set hand-off soak: every cycle allocates a fresh set of 16 buffers,
/// publishes it, the consumer attaches, reads and releases it, the producer
/// unpublishes and drops it. Device memory (cuMemGetInfo) and the open
/// descriptors of both processes are the same at the end as after warm-up.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn set_handoff_soak_a_hundred_thousand_cycles() {
    child_or(|| {
        let cycles = env_count("CUDA_IPC_SET_SOAK_CYCLES", 100_000);
        let device = Device::open(0).unwrap();
        let dir = socket_dir();
        let publisher = publisher_on(&device, dir.path(), Sharing::auto());
        publisher.arena().unwrap().reserve(256 * MIB).unwrap();
        let sizes = weight_sizes(16, 64 * MIB, 5).unwrap();
        let mut p = spawn(
            &test_name!("set_handoff_soak_a_hundred_thousand_cycles"),
            dir.path().join("s.sock").as_path(),
        );
        let warm = 100.min(cycles);
        let mut before = None;
        let started = Instant::now();
        for c in 0..cycles {
            if c == warm {
                device.stream().synchronize().unwrap();
                let child = ask(&mut p, &json!({ "op": "fds" }))["fds"]
                    .as_u64()
                    .unwrap();
                before = Some((free_memory(&device), open_fds(), child));
            }
            let base = c as u32;
            let set = Set::new(&publisher, &sizes, base);
            set.publish(&publisher, "soak");
            ask(
                &mut p,
                &json!({ "op": "cycle", "name": "soak", "base": base }),
            );
            publisher
                .unpublish_set("soak", Some(Duration::from_secs(10)))
                .unwrap();
            drop(set);
        }
        device.stream().synchronize().unwrap();
        let child = ask(&mut p, &json!({ "op": "fds" }))["fds"]
            .as_u64()
            .unwrap();
        let after = (free_memory(&device), open_fds(), child);
        if let Some(before) = before {
            assert_eq!(
                before, after,
                "(free device memory, our fds, the consumer's fds)"
            );
        }
        assert_eq!(publisher.arena().unwrap().stats().buffers, 0);
        p.send(&json!({ "op": "exit" }));
        assert!(p.finish());
        println!(
            "{cycles} set hand-offs in {:?}; device memory and fds unchanged",
            started.elapsed()
        );
    });
}

/// A fresh hand-off from an arena, timed crudely (publish to the consumer
/// holding the buffer checked, over this test's pipe): prints the p50. The
/// real figure comes from `cuda-ipc bench`.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fresh_handoff_from_an_arena_p50() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        for m in mechanisms(&device) {
            let dir = socket_dir();
            let publisher = publisher_on(&device, dir.path(), Sharing::arena(m));
            publisher.arena().unwrap().reserve(512 * MIB).unwrap();
            let mut p = spawn(
                &test_name!("fresh_handoff_from_an_arena_p50"),
                dir.path().join("s.sock").as_path(),
            );
            let mut times = Vec::new();
            for i in 0..200u32 {
                let b = publisher.alloc(64 * MIB).unwrap();
                kernels::fill_u32(&b, pattern(i, 0), Speed::Full).unwrap();
                b.synchronize().unwrap();
                let t = Instant::now();
                publisher
                    .publish_buffer("fresh", &b, Dtype::U32, &[16 * MIB])
                    .unwrap();
                p.send(&json!({ "op": "cycle", "name": "fresh", "base": i }));
                let r = p.recv();
                times.push(t.elapsed());
                assert!(r["bad"].is_null(), "{r}");
                publisher
                    .unpublish_set("fresh", Some(Duration::from_secs(10)))
                    .unwrap();
            }
            times.sort();
            println!(
                "{m}: fresh 64 MiB hand-off from an arena, publish to checked first word (with a pipe round trip): p50 {:?}",
                times[times.len() / 2]
            );
            p.send(&json!({ "op": "exit" }));
            assert!(p.finish());
        }
    });
}
