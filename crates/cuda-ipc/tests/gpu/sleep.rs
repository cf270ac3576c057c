//! Sleep and wake across processes on a real device: a reader child
//! attaches a vmm set, notes every view's address and checks the bytes, is
//! refused a (checked) sleep while it holds the set, sleeps unchecked
//! (every mapping unmapped, addresses and leases kept), is refused a new
//! attach while asleep, and wakes: the views have the same addresses and
//! read what the publisher wrote meanwhile (the same memory, mapped again).
//! A reader that released its set sleeps checked (its cached chunks) and
//! finds them at the same addresses after the wake. A reader holding
//! legacy mappings is refused a sleep and still reads its set afterwards.

use std::path::Path;
use std::time::{Duration, Instant};

use cuda_ipc::arena::{DeviceArenaBuffer, DeviceChunks, SetMember};
use cuda_ipc::exchange::{
    Publisher, PublisherConfig, SetAttachment, Sharing, Subscriber, SubscriberConfig,
};
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::{Device, DeviceMemory, Dtype, Mechanism};
use serde_json::{Value, json};

use super::common::{Parent, Peer};
use crate::test_name;

const MIB: u64 = 1 << 20;
const SOCKET_ENV: &str = "CUDA_IPC_TEST_SOCKET";
const SET: &str = "weights";
const SIZES: [u64; 3] = [6 * MIB, 1 << 16, 3 * MIB];

fn pattern(base: u32, i: usize) -> Pattern {
    Pattern::ramp(base.wrapping_add((i as u32).wrapping_mul(0x0001_0001)), 1)
}

/// The publisher's buffers, published as one set.
fn publish(publisher: &Publisher, base: u32) -> Vec<DeviceArenaBuffer> {
    let buffers: Vec<_> = SIZES.iter().map(|s| publisher.alloc(*s).unwrap()).collect();
    fill(&buffers, base);
    let names: Vec<String> = (0..SIZES.len()).map(|i| format!("w{i}")).collect();
    let shapes: Vec<[u64; 1]> = SIZES.iter().map(|s| [s / 4]).collect();
    let members: Vec<SetMember<'_>> = buffers
        .iter()
        .zip(&names)
        .zip(&shapes)
        .map(|((b, n), s)| SetMember::new(n, Dtype::U32, s, b))
        .collect();
    publisher.publish_set(SET, &members).unwrap();
    buffers
}

fn fill(buffers: &[DeviceArenaBuffer], base: u32) {
    for (i, b) in buffers.iter().enumerate() {
        kernels::fill_u32(b, pattern(base, i), Speed::Full).unwrap();
        b.synchronize().unwrap();
    }
}

/// Every view's address, and the first `[buffer, word]` that is not `base`'s pattern.
fn look(set: &SetAttachment, base: u32) -> (Vec<u64>, Value) {
    let mut addresses = Vec::new();
    let mut bad = Value::Null;
    for i in 0..set.len() {
        let v = set.view::<u32>(i).unwrap();
        addresses.push(v.device_address());
        if bad.is_null()
            && let Some(w) = kernels::check_u32(&v, pattern(base, i)).unwrap()
        {
            bad = json!([i, w]);
        }
    }
    (addresses, bad)
}

fn reader() {
    let parent = Parent::new();
    let device = Device::open(0).unwrap();
    let socket = std::env::var(SOCKET_ENV).unwrap();
    let sub =
        Subscriber::connect(&device, Path::new(&socket), SubscriberConfig::default()).unwrap();
    parent.send(&json!({ "connected": true }));
    let mut set: Option<SetAttachment> = None;
    while let Some(req) = parent.recv() {
        let base = req["base"].as_u64().unwrap_or(0) as u32;
        let reply = match req["op"].as_str().unwrap_or_default() {
            "attach" => match sub.attach_set(SET) {
                Ok(s) => {
                    let (addresses, bad) = look(&s, base);
                    set = Some(s);
                    json!({ "addresses": addresses, "bad": bad })
                }
                Err(e) => json!({ "error": e.to_string() }),
            },
            "look" => {
                let (addresses, bad) = look(set.as_ref().unwrap(), base);
                json!({ "addresses": addresses, "bad": bad })
            }
            "sleep" => slept(&sub, sub.sleep()),
            // SAFETY: the parent asks for no look until the wake, and the
            // set's views made by `look` are gone: nothing touches the
            // memory while it sleeps (the set itself is kept).
            "sleep_unchecked" => slept(&sub, unsafe { sub.sleep_unchecked() }),
            "wake" => {
                let t = Instant::now();
                match sub.wake() {
                    Ok(s) => json!({
                        "mappings": s.mappings,
                        "bytes": s.bytes,
                        "asleep": sub.asleep(),
                        "ranges": sub.sleeping_ranges().len(),
                        "wake_ms": t.elapsed().as_secs_f64() * 1e3,
                    }),
                    Err(e) => json!({ "error": e.to_string() }),
                }
            }
            "attach_again" => match sub.attach_set(SET) {
                Ok(_) => json!({ "attached": true }),
                Err(e) => json!({ "attached": false, "error": e.to_string() }),
            },
            "release" => {
                drop(set.take());
                json!({ "released": true })
            }
            other => json!({ "error": format!("unknown op {other}") }),
        };
        parent.send(&reply);
    }
}

/// The answer to a sleep.
fn slept(sub: &Subscriber, r: cuda_ipc::Result<cuda_ipc::exchange::Slept>) -> Value {
    match r {
        Ok(s) => {
            let ranges = sub.sleeping_ranges();
            json!({
                "mappings": s.mappings,
                "bytes": s.bytes,
                "asleep": sub.asleep(),
                "ranges": ranges.len(),
                "ranges_bytes": ranges.iter().map(|r| r.1).sum::<u64>(),
                "ranges_sorted": ranges.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0),
            })
        }
        Err(e) => json!({
            "error": e.to_string(),
            "in_use": matches!(e, cuda_ipc::Error::StillInUse { .. }),
            "asleep": sub.asleep(),
        }),
    }
}

fn child_or(f: impl FnOnce()) {
    super::common::child_or("reader", reader, f);
}

fn ask(p: &mut Peer, req: &Value) -> Value {
    p.send(req);
    let r = p.recv();
    println!("{req} -> {r}");
    r
}

fn publisher_with(device: &Device, dir: &Path, m: Mechanism) -> Option<Publisher> {
    if let Err(e) = DeviceChunks::new(device, Some(m)) {
        println!("skipping {m}: this device has no {m} chunks ({e})");
        return None;
    }
    let config = PublisherConfig::default().with_sharing(Sharing::arena(m));
    Some(Publisher::bind(device, dir.join(format!("{m}.sock")), config).unwrap())
}

/// A vmm set: a checked sleep is refused while the reader holds the set;
/// an unchecked sleep unmaps every chunk, a new attach is refused while
/// asleep, and wake maps the same memory at the same addresses (the
/// publisher's writes during the sleep are read after it). Sleep and wake
/// twice are no-ops the second time.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_sleeping_reader_wakes_at_the_same_addresses_on_the_same_memory() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let Some(publisher) = publisher_with(&device, dir.path(), Mechanism::Vmm) else {
            return;
        };
        let buffers = publish(&publisher, 5);
        let test = test_name!("a_sleeping_reader_wakes_at_the_same_addresses_on_the_same_memory");
        let mut p = Peer::spawn_with(&test, "reader", |c| {
            c.env(SOCKET_ENV, publisher.path());
        });
        assert_eq!(p.recv()["connected"], true);
        let before = ask(&mut p, &json!({ "op": "attach", "base": 5 }));
        assert!(before["bad"].is_null(), "{before}");
        let refused = ask(&mut p, &json!({ "op": "sleep" }));
        assert_eq!(refused["in_use"], true, "{refused}");
        assert_eq!(refused["asleep"], false, "{refused}");
        let still = ask(&mut p, &json!({ "op": "look", "base": 5 }));
        assert!(still["bad"].is_null(), "{still}");
        let slept = ask(&mut p, &json!({ "op": "sleep_unchecked" }));
        assert!(slept.get("error").is_none(), "{slept}");
        assert_eq!(slept["asleep"], true, "{slept}");
        assert_eq!(slept["ranges"], slept["mappings"], "{slept}");
        assert_eq!(slept["ranges_bytes"], slept["bytes"], "{slept}");
        assert_eq!(slept["ranges_sorted"], true, "{slept}");
        assert!(slept["mappings"].as_u64().unwrap() >= 1, "{slept}");
        let again = ask(&mut p, &json!({ "op": "sleep_unchecked" }));
        assert_eq!(
            again["mappings"], 0,
            "a second sleep unmaps nothing: {again}"
        );
        let refused = ask(&mut p, &json!({ "op": "attach_again" }));
        assert_eq!(refused["attached"], false, "{refused}");
        assert!(
            refused["error"].as_str().unwrap().contains("wake()"),
            "{refused}"
        );
        // Written while the reader sleeps, read by it after the wake.
        fill(&buffers, 9);
        let woke = ask(&mut p, &json!({ "op": "wake" }));
        assert!(woke.get("error").is_none(), "{woke}");
        assert_eq!(woke["mappings"], slept["mappings"], "{woke}");
        assert_eq!(woke["asleep"], false, "{woke}");
        assert_eq!(woke["ranges"], 0, "{woke}");
        println!("woke {} bytes in {} ms", woke["bytes"], woke["wake_ms"]);
        let after = ask(&mut p, &json!({ "op": "look", "base": 9 }));
        assert!(after["bad"].is_null(), "{after}");
        assert_eq!(
            after["addresses"], before["addresses"],
            "the views keep their addresses"
        );
        let twice = ask(&mut p, &json!({ "op": "wake" }));
        assert_eq!(twice["mappings"], 0, "{twice}");
        let attached = ask(&mut p, &json!({ "op": "attach_again" }));
        assert_eq!(attached["attached"], true, "{attached}");
        ask(&mut p, &json!({ "op": "release" }));
        assert!(p.finish(), "the reader child failed");
        publisher
            .unpublish_set(SET, Some(Duration::from_secs(10)))
            .unwrap();
    });
}

/// A reader that released its set sleeps without `unsafe`: its cached
/// chunks are unmapped, an attach is refused until the wake, and the set
/// attached after the wake lies at the same addresses and reads what the
/// publisher wrote meanwhile.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_reader_with_no_views_left_sleeps_without_unsafe() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let Some(publisher) = publisher_with(&device, dir.path(), Mechanism::Vmm) else {
            return;
        };
        let buffers = publish(&publisher, 21);
        let test = test_name!("a_reader_with_no_views_left_sleeps_without_unsafe");
        let mut p = Peer::spawn_with(&test, "reader", |c| {
            c.env(SOCKET_ENV, publisher.path());
        });
        assert_eq!(p.recv()["connected"], true);
        let before = ask(&mut p, &json!({ "op": "attach", "base": 21 }));
        assert!(before["bad"].is_null(), "{before}");
        ask(&mut p, &json!({ "op": "release" }));
        let slept = ask(&mut p, &json!({ "op": "sleep" }));
        assert!(slept.get("error").is_none(), "{slept}");
        assert_eq!(slept["asleep"], true, "{slept}");
        assert_eq!(slept["ranges"], slept["mappings"], "{slept}");
        assert_eq!(slept["ranges_bytes"], slept["bytes"], "{slept}");
        assert_eq!(slept["ranges_sorted"], true, "{slept}");
        assert!(slept["mappings"].as_u64().unwrap() >= 1, "{slept}");
        let refused = ask(&mut p, &json!({ "op": "attach_again" }));
        assert_eq!(refused["attached"], false, "{refused}");
        fill(&buffers, 23);
        let woke = ask(&mut p, &json!({ "op": "wake" }));
        assert_eq!(woke["mappings"], slept["mappings"], "{woke}");
        let after = ask(&mut p, &json!({ "op": "attach", "base": 23 }));
        assert!(after["bad"].is_null(), "{after}");
        assert_eq!(
            after["addresses"], before["addresses"],
            "the cached chunks keep their addresses"
        );
        ask(&mut p, &json!({ "op": "release" }));
        assert!(p.finish(), "the reader child failed");
        publisher
            .unpublish_set(SET, Some(Duration::from_secs(10)))
            .unwrap();
    });
}

/// A reader holding legacy mappings is refused a sleep before anything is
/// unmapped: it still reads its set, and says it is awake.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_reader_of_legacy_memory_is_refused_a_sleep_and_keeps_reading() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let Some(publisher) = publisher_with(&device, dir.path(), Mechanism::Legacy) else {
            return;
        };
        let _buffers = publish(&publisher, 11);
        let test = test_name!("a_reader_of_legacy_memory_is_refused_a_sleep_and_keeps_reading");
        let mut p = Peer::spawn_with(&test, "reader", |c| {
            c.env(SOCKET_ENV, publisher.path());
        });
        assert_eq!(p.recv()["connected"], true);
        let first = ask(&mut p, &json!({ "op": "attach", "base": 11 }));
        assert!(first["bad"].is_null(), "{first}");
        let refused = ask(&mut p, &json!({ "op": "sleep" }));
        let e = refused["error"].as_str().unwrap_or_default();
        assert!(e.contains("legacy") && e.contains("vmm"), "{refused}");
        assert_eq!(refused["asleep"], false, "{refused}");
        let still = ask(&mut p, &json!({ "op": "look", "base": 11 }));
        assert!(still["bad"].is_null(), "{still}");
        ask(&mut p, &json!({ "op": "release" }));
        assert!(p.finish(), "the reader child failed");
        publisher
            .unpublish_set(SET, Some(Duration::from_secs(10)))
            .unwrap();
    });
}
