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
//!
//! This module holds what the tests share (the consumer child, the set
//! rig, the checks); the tests are in `layouts` and `scale`, under their
//! old names.

use std::path::{Path, PathBuf};
use std::time::Duration;

use cuda_ipc::arena::{DeviceArenaBuffer, DeviceChunks, SetMember};
use cuda_ipc::exchange::{
    Attachment, Publisher, PublisherConfig, SetAttachment, Sharing, Subscriber, SubscriberConfig,
};
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::{Device, DeviceMemory, Dtype, Mechanism};
use serde_json::{Value, json};

use super::common::{Parent, Peer, open_fds};

mod layouts;
mod scale;

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
