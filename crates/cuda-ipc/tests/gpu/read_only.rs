//! Read-only readers across processes on a real device: a set published by
//! a publisher whose readers map read-only, and sets that a reader asks to
//! map read-only itself. A child process attaches, tries to write through
//! its mapping (a host-to-device copy, or a kernel), and says what happened;
//! the publisher then checks that its bytes did not change. A read-write
//! attach of the same set (in the same child, and in a later one) still
//! writes, and the read-only mapping sees what it wrote.
//!
//! What the driver does with a write through a `CU_MEM_ACCESS_FLAGS_PROT_READ`
//! mapping is not pinned down here: the call may fail, or (a kernel, an
//! asynchronous copy) the error may surface at the next synchronisation,
//! most likely `CUDA_ERROR_ILLEGAL_ADDRESS`, which leaves the child's
//! context unusable; or the child may die. Each counts as the write
//! failing, and is printed; a write that reports success fails the test,
//! and so does any change of the publisher's bytes.

use std::path::Path;
use std::time::Duration;

use cuda_ipc::arena::{DeviceArenaBuffer, DeviceChunks, SetMember};
use cuda_ipc::exchange::{
    Publisher, PublisherConfig, SetAttachment, Sharing, Subscriber, SubscriberConfig,
};
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::share::SharedBuffer;
use cuda_ipc::{Access, Device, DeviceMemory, Dtype, Error, Mechanism};
use serde_json::{Value, json};

use super::common::{Parent, Peer, TIMEOUT};
use crate::test_name;

const MIB: u64 = 1 << 20;
const SOCKET_ENV: &str = "CUDA_IPC_TEST_SOCKET";
/// How the child's subscriber maps (`ro` or `rw`).
const ACCESS_ENV: &str = "CUDA_IPC_TEST_ACCESS";
const SET: &str = "weights";
const SIZES: [u64; 4] = [3 * MIB, 1 << 16, 5 * MIB, 4096];

/// The values of buffer `i` of a set filled from `base`.
fn pattern(base: u32, i: usize) -> Pattern {
    Pattern::ramp(base.wrapping_add((i as u32).wrapping_mul(0x0001_0001)), 1)
}

fn socket_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("cuda-ipc-gpu-ro")
        .tempdir()
        .expect("temp dir")
}

/// The publisher's set: `SIZES` buffers, buffer `i` holding `pattern(base, i)`.
struct Set {
    buffers: Vec<DeviceArenaBuffer>,
    names: Vec<String>,
    shapes: Vec<[u64; 1]>,
}

impl Set {
    fn publish(publisher: &Publisher, base: u32) -> Set {
        let buffers: Vec<_> = SIZES.iter().map(|s| publisher.alloc(*s).unwrap()).collect();
        for (i, b) in buffers.iter().enumerate() {
            kernels::fill_u32(b, pattern(base, i), Speed::Full).unwrap();
        }
        let set = Set {
            names: (0..SIZES.len())
                .map(|i| format!("layer{i}.weight"))
                .collect(),
            shapes: SIZES.iter().map(|s| [s / 4]).collect(),
            buffers,
        };
        let members: Vec<SetMember<'_>> = set
            .buffers
            .iter()
            .zip(&set.names)
            .zip(&set.shapes)
            .map(|((buffer, name), shape)| SetMember::new(name, Dtype::U32, shape, buffer))
            .collect();
        publisher.publish_set(SET, &members).unwrap();
        set
    }

    /// The publisher's own check of buffer `i` (in its own context, which
    /// no reader's fault touches): the first word that is not `want`.
    fn check(&self, i: usize, want: Pattern) -> Option<u64> {
        kernels::check_u32(&self.buffers[i], want).unwrap()
    }
}

/// The first bad `[buffer, word]` of `set` against `pattern(base, _)`.
fn check_set(set: &SetAttachment, base: u32) -> Value {
    for i in 0..set.len() {
        let v = set.view::<u32>(i).unwrap();
        if let Some(w) = kernels::check_u32(&v, pattern(base, i)).unwrap() {
            return json!([i, w]);
        }
    }
    Value::Null
}

fn err_text(r: cuda_ipc::Result<()>) -> Value {
    match r {
        Ok(()) => Value::Null,
        Err(e) => json!(e.to_string()),
    }
}

/// Tries to write `value` into buffer `index` of `set`: `copy` (host to
/// device, waited for) or `kernel` (a fill, then a wait on its stream).
/// Then a device-wide wait, and a read, to see whether the context still works.
fn try_write(device: &Device, set: &SetAttachment, index: usize, how: &str, value: u32) -> Value {
    let view = set.view::<u32>(index).unwrap();
    let write = match how {
        "copy" => view.write_from(&vec![value; view.len()]),
        "kernel" => kernels::fill_u32(&view, Pattern::constant(value), Speed::Full)
            .and_then(|()| view.synchronize()),
        other => return json!({ "error": format!("unknown write {other}") }),
    };
    let sync = device.synchronize();
    let read = view.slice(0..1).and_then(|v| v.to_vec::<u32>()).map(drop);
    json!({
        "bad": null,
        "read_only": view.mapping().read_only(),
        "write_error": err_text(write),
        "sync_error": err_text(sync),
        "context_error": err_text(read),
    })
}

/// The reader child: one request at a time.
fn reader() {
    let parent = Parent::new();
    let device = Device::open(0).unwrap();
    let socket = std::env::var(SOCKET_ENV).unwrap();
    let access = match std::env::var(ACCESS_ENV).as_deref() {
        Ok("ro") => Access::ReadOnly,
        _ => Access::ReadWrite,
    };
    let config = SubscriberConfig::default().with_access(access);
    let sub = Subscriber::connect(&device, Path::new(&socket), config).unwrap();
    parent.send(&json!({ "connected": true }));
    let mut sets: Vec<SetAttachment> = Vec::new();
    let mut single = Vec::new();
    while let Some(req) = parent.recv() {
        let base = req["base"].as_u64().unwrap_or(0) as u32;
        let which = req["which"].as_u64().unwrap_or(0) as usize;
        let index = req["index"].as_u64().unwrap_or(0) as usize;
        let value = req["value"].as_u64().unwrap_or(0) as u32;
        let reply = match req["op"].as_str().unwrap_or_default() {
            "attach" => {
                let attached = match req["access"].as_str().unwrap_or_default() {
                    "ro" => sub.attach_set_with(SET, Access::ReadOnly),
                    "rw" => sub.attach_set_with(SET, Access::ReadWrite),
                    _ => sub.attach_set(SET),
                };
                match attached {
                    Ok(s) => {
                        let views_agree = (0..s.len()).all(|i| {
                            s.view::<u8>(i).unwrap().mapping().read_only() == s.read_only()
                        });
                        let bad = if req["check"] == false {
                            Value::Null
                        } else {
                            check_set(&s, base)
                        };
                        let r = json!({
                            "bad": bad,
                            "read_only": s.read_only(),
                            "views_agree": views_agree,
                            "opens": sub.opens(),
                            "cached": sub.cached_mappings().0,
                        });
                        sets.push(s);
                        r
                    }
                    Err(e) => json!({ "error": e.to_string() }),
                }
            }
            "attach_buffer" => match sub.attach::<u32>("one") {
                Ok(a) => {
                    let bad = kernels::check_u32(a.buffer(), pattern(base, 0)).unwrap();
                    let r = json!({ "bad": bad, "read_only": a.read_only() });
                    single.push(a);
                    r
                }
                Err(e) => json!({ "error": e.to_string() }),
            },
            "write" => try_write(
                &device,
                &sets[which],
                index,
                req["how"].as_str().unwrap_or_default(),
                value,
            ),
            "check_constant" => {
                let v = sets[which].view::<u32>(index).unwrap();
                json!({ "bad": kernels::check_u32(&v, Pattern::constant(value)).unwrap() })
            }
            "exit" => {
                // The context may be broken by a fault: leave without
                // unmapping (the process's exit releases everything).
                parent.send(&json!({ "bye": true }));
                std::process::exit(0);
            }
            other => json!({ "error": format!("unknown op {other}") }),
        };
        parent.send(&reply);
    }
}

fn child_or(f: impl FnOnce()) {
    super::common::child_or("reader", reader, f);
}

/// A reader child on `socket`, its subscriber mapping with `access` (`ro` or `rw`).
fn spawn(test: &str, socket: &Path, access: &str) -> Peer {
    let p = Peer::spawn_with(test, "reader", |c| {
        c.env(SOCKET_ENV, socket).env(ACCESS_ENV, access);
    });
    assert_eq!(p.recv()["connected"], true);
    p
}

/// Sends `req` and returns the answer, which must report success.
fn ask(p: &mut Peer, req: &Value) -> Value {
    p.send(req);
    let r = p.recv();
    assert!(
        r.get("error").is_none() && r.get("bad").is_some_and(Value::is_null),
        "{req}: the child answered {r}"
    );
    r
}

/// Asks the child to write; returns how the write failed (`None`: it did
/// not), having printed what the child saw.
fn write_fails(p: &mut Peer, req: &Value) -> Option<String> {
    p.send(req);
    let Some(r) = p.try_recv_within(TIMEOUT) else {
        let status = p.exited();
        assert!(
            status.is_some(),
            "{req}: the child neither answered nor exited within {TIMEOUT:?}"
        );
        let how = format!("the child died ({status:?})");
        println!("{req}: {how}");
        return Some(how);
    };
    assert!(r.get("error").is_none(), "{req}: the child answered {r}");
    println!("{req}: the child saw {r}");
    ["write_error", "sync_error"]
        .iter()
        .find_map(|k| r[*k].as_str().map(|e| format!("{k}: {e}")))
}

/// Ends a child (whose context may be broken) and waits for it.
fn exit(mut p: Peer) {
    p.send(&json!({ "op": "exit" }));
    let _ = p.try_recv_within(TIMEOUT);
    let _ = p.finish();
}

fn vmm_or_skip(device: &Device) -> bool {
    match DeviceChunks::new(device, Some(Mechanism::Vmm)) {
        Ok(_) => true,
        Err(e) => {
            println!("skipping: this device has no vmm chunks ({e})");
            false
        }
    }
}

/// A publisher with read-only readers: every reader maps its set and arena
/// buffer read-only even when it asked for nothing; a copy and a kernel
/// writing through the mapping both fail, each in a reader of its own, and
/// the publisher's bytes do not change. What cannot carry the policy is
/// refused on the publisher's side.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_publisher_with_read_only_readers_keeps_its_bytes() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        if !vmm_or_skip(&device) {
            return;
        }
        let dir = socket_dir();
        let ro = PublisherConfig::default().with_read_only_readers(true);
        for m in [Mechanism::Legacy, Mechanism::Pool] {
            let refused = Publisher::bind(
                &device,
                dir.path().join("refused.sock"),
                ro.clone().with_sharing(Sharing::arena(m)),
            );
            assert!(
                matches!(refused, Err(Error::InvalidArgument { .. })),
                "{m}: {refused:?}"
            );
        }
        let publisher = Publisher::bind(&device, dir.path().join("s.sock"), ro).unwrap();
        assert!(publisher.read_only_readers());
        assert_eq!(
            publisher.arena().unwrap().backing().mechanism(),
            Mechanism::Vmm,
            "an auto arena of a publisher with read-only readers is made of vmm chunks"
        );
        let set = Set::publish(&publisher, 31);
        // Every chunk so far holds a buffer of the set.
        let chunks = publisher.arena().unwrap().stats().chunks as u64;
        let one = publisher.alloc(2 * MIB).unwrap();
        kernels::fill_u32(&one, pattern(77, 0), Speed::Full).unwrap();
        publisher
            .publish_buffer("one", &one, Dtype::U32, &[2 * MIB / 4])
            .unwrap();
        let isolated = SharedBuffer::alloc(&device, 4096, Some(Mechanism::Vmm)).unwrap();
        let e = publisher
            .publish("isolated", isolated, Dtype::U8, None)
            .unwrap_err();
        assert!(e.to_string().contains("read-only"), "{e}");
        assert!(publisher.ring("ring", 2, 4096, None).is_err());
        let test = test_name!("a_publisher_with_read_only_readers_keeps_its_bytes");
        for (how, index) in [("copy", 0), ("kernel", 2)] {
            // The reader asks for read-write; the policy maps it read-only.
            let mut p = spawn(&test, publisher.path(), "rw");
            let r = ask(&mut p, &json!({ "op": "attach", "base": 31 }));
            assert_eq!(r["read_only"], true, "{r}");
            assert_eq!(r["views_agree"], true, "{r}");
            assert_eq!(r["opens"], chunks, "{r}");
            let r = ask(&mut p, &json!({ "op": "attach_buffer", "base": 77 }));
            assert_eq!(r["read_only"], true, "{r}");
            let req = json!({ "op": "write", "which": 0, "index": index, "how": how, "value": 0xDEAD_BEEFu32 });
            let failed = write_fails(&mut p, &req);
            assert!(
                failed.is_some(),
                "{how}: a write through a read-only mapping succeeded"
            );
            println!(
                "{how}: the write failed as it should: {}",
                failed.unwrap_or_default()
            );
            for i in 0..SIZES.len() {
                assert_eq!(
                    set.check(i, pattern(31, i)),
                    None,
                    "{how}: buffer {i} changed"
                );
            }
            assert_eq!(
                kernels::check_u32(&one, pattern(77, 0)).unwrap(),
                None,
                "{how}: the arena buffer changed"
            );
            exit(p);
        }
        publisher
            .unpublish_set(SET, Some(Duration::from_secs(10)))
            .unwrap();
        publisher
            .unpublish_set("one", Some(Duration::from_secs(10)))
            .unwrap();
    });
}

/// A publisher without the policy: a reader that asks for read-only cannot
/// write (the read-only and read-write mappings of one chunk are cached
/// apart, and the read-only one sees what the read-write one wrote); a
/// subscriber configured read-only cannot write either; a read-write
/// reader after them still writes, and the publisher sees it.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_reader_that_asks_for_read_only_cannot_write_and_a_writer_still_can() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        if !vmm_or_skip(&device) {
            return;
        }
        let dir = socket_dir();
        let publisher = Publisher::bind(
            &device,
            dir.path().join("s.sock"),
            PublisherConfig::default().with_sharing(Sharing::arena(Mechanism::Vmm)),
        )
        .unwrap();
        assert!(!publisher.read_only_readers());
        let set = Set::publish(&publisher, 41);
        let chunks = publisher.arena().unwrap().stats().chunks as u64;
        let test =
            test_name!("a_reader_that_asks_for_read_only_cannot_write_and_a_writer_still_can");

        // One reader, the set attached read-only and read-write.
        let mut p = spawn(&test, publisher.path(), "rw");
        let r = ask(
            &mut p,
            &json!({ "op": "attach", "access": "ro", "base": 41 }),
        );
        assert_eq!(
            (r["read_only"].clone(), r["opens"].clone()),
            (json!(true), json!(chunks)),
            "{r}"
        );
        let r = ask(
            &mut p,
            &json!({ "op": "attach", "access": "rw", "base": 41 }),
        );
        assert_eq!(r["read_only"], false, "{r}");
        assert_eq!(
            r["opens"],
            2 * chunks,
            "each chunk mapped once per access: {r}"
        );
        assert_eq!(r["cached"], 2 * chunks, "{r}");
        let written = 0x1234_5678u32;
        let req =
            json!({ "op": "write", "which": 1, "index": 0, "how": "kernel", "value": written });
        assert_eq!(write_fails(&mut p, &req), None, "a read-write write failed");
        ask(
            &mut p,
            &json!({ "op": "check_constant", "which": 0, "index": 0, "value": written }),
        );
        assert_eq!(set.check(0, Pattern::constant(written)), None);
        let req = json!({ "op": "write", "which": 0, "index": 1, "how": "copy", "value": 0xBAD0_BAD0u32 });
        let failed = write_fails(&mut p, &req);
        assert!(
            failed.is_some(),
            "a copy into a read-only mapping succeeded"
        );
        for i in 1..SIZES.len() {
            assert_eq!(set.check(i, pattern(41, i)), None, "buffer {i} changed");
        }
        exit(p);

        // A subscriber configured read-only.
        let mut p = spawn(&test, publisher.path(), "ro");
        let r = ask(&mut p, &json!({ "op": "attach", "check": false }));
        assert_eq!(r["read_only"], true, "{r}");
        let req = json!({ "op": "write", "which": 0, "index": 2, "how": "kernel", "value": 0xBAD1_BAD1u32 });
        assert!(
            write_fails(&mut p, &req).is_some(),
            "a kernel wrote through a read-only mapping"
        );
        for i in 1..SIZES.len() {
            assert_eq!(set.check(i, pattern(41, i)), None, "buffer {i} changed");
        }
        exit(p);

        // A read-write reader after the faults: it still writes.
        let mut p = spawn(&test, publisher.path(), "rw");
        let r = ask(&mut p, &json!({ "op": "attach", "check": false }));
        assert_eq!(r["read_only"], false, "{r}");
        let written = 0x0BAD_F00Du32;
        let req = json!({ "op": "write", "which": 0, "index": 2, "how": "copy", "value": written });
        assert_eq!(write_fails(&mut p, &req), None, "a read-write copy failed");
        assert_eq!(set.check(2, Pattern::constant(written)), None);
        exit(p);
        publisher
            .unpublish_set(SET, Some(Duration::from_secs(10)))
            .unwrap();
    });
}

/// Legacy and pool memory cannot be mapped read-only: a read-only attach
/// is refused, naming the vmm mechanism, and leaves nothing behind (a
/// read-write attach after it works, and the set's leases all end).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn read_only_attaches_of_legacy_and_pool_sets_are_refused() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        let test = test_name!("read_only_attaches_of_legacy_and_pool_sets_are_refused");
        for m in [Mechanism::Legacy, Mechanism::Pool] {
            if let Err(e) = DeviceChunks::new(&device, Some(m)) {
                println!("skipping {m}: {e}");
                continue;
            }
            let dir = socket_dir();
            let publisher = Publisher::bind(
                &device,
                dir.path().join("s.sock"),
                PublisherConfig::default().with_sharing(Sharing::arena(m)),
            )
            .unwrap();
            let set = Set::publish(&publisher, 51);
            let mut p = spawn(&test, publisher.path(), "rw");
            p.send(&json!({ "op": "attach", "access": "ro", "base": 51 }));
            let r = p.recv();
            let e = r["error"].as_str().unwrap_or_default();
            assert!(
                e.contains("mapping memory read-only") && e.contains(m.name()) && e.contains("vmm"),
                "{m}: {r}"
            );
            let r = ask(
                &mut p,
                &json!({ "op": "attach", "access": "rw", "base": 51 }),
            );
            assert_eq!(r["read_only"], false, "{m}: {r}");
            exit(p);
            publisher
                .unpublish_set(SET, Some(Duration::from_secs(10)))
                .unwrap();
            drop(set);
            println!("{m}: a read-only attach is refused, a read-write one works");
        }
    });
}
