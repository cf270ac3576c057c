//! Sets and arena buffers synchronised through GPU-side fences: a set of
//! 100 buffers and one arena buffer attached and updated with the
//! consumer's `SyncMode::Fence` (and `HostFence`) on the host, and with `auto` in a mount
//! namespace with a private tmpfs `/dev/shm` (where the publisher's event
//! cannot be opened, so `auto` must pick the fence and `event` must fail).
//! Every value of every buffer is checked after the attach and after each
//! update.

use std::path::Path;
use std::time::{Duration, Instant};

use cuda_ipc::arena::{DeviceArenaBuffer, SetMember};
use cuda_ipc::exchange::{
    Attachment, Publisher, PublisherConfig, SetAttachment, Subscriber, SubscriberConfig, SyncMode,
};
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::{Device, Dtype};
use serde_json::{Value, json};

use super::common::{Parent, Peer};
use super::containers::{unshare_refused, wrapper};
use crate::test_name;

const SOCKET_ENV: &str = "CUDA_IPC_TEST_SOCKET";
const SYNC_ENV: &str = "CUDA_IPC_TEST_SYNC";
const BUFFERS: usize = 100;
const UPDATES: u32 = 5;

/// The values of buffer `i` of the set filled from `base`.
fn pattern(base: u32, i: usize) -> Pattern {
    Pattern::ramp(base.wrapping_add((i as u32).wrapping_mul(0x0001_0003)), 7)
}

/// Checks every value of every buffer of `set`: the first bad `[buffer, word]`.
fn check_set(set: &SetAttachment, base: u32) -> Value {
    for i in 0..set.len() {
        let v = set.view::<u32>(i).unwrap();
        if let Some(w) = kernels::check_u32(&v, pattern(base, i)).unwrap() {
            return json!([i, w]);
        }
    }
    Value::Null
}

/// The subscriber child: connects with the sync mode of `SYNC_ENV`, then
/// answers one request at a time.
fn subscriber() {
    let parent = Parent::new();
    let device = Device::open(0).unwrap();
    let socket = std::env::var(SOCKET_ENV).unwrap();
    let sync: SyncMode = std::env::var(SYNC_ENV).unwrap().parse().unwrap();
    let config = SubscriberConfig::default().with_sync(sync);
    let sub = Subscriber::connect(&device, socket.as_str(), config).unwrap();
    parent.send(&json!({ "connected": true }));
    let mut set: Option<SetAttachment> = None;
    let mut one: Option<Attachment<u32>> = None;
    while let Some(req) = parent.recv() {
        let base = req["base"].as_u64().unwrap_or(0) as u32;
        let reply = match req["op"].as_str().unwrap_or_default() {
            "attach_set" => match sub.attach_set("weights") {
                Ok(s) => {
                    let r = json!({ "bad": check_set(&s, base), "len": s.len(), "fence": s.uses_fence() });
                    set = Some(s);
                    r
                }
                Err(e) => json!({ "error": e.to_string() }),
            },
            "update_set" => {
                let s = set.as_ref().unwrap();
                match sub.wait_set_update(s, Duration::from_secs(10)) {
                    Ok(v) => json!({ "bad": check_set(s, base), "version": v }),
                    Err(e) => json!({ "error": e.to_string() }),
                }
            }
            "attach_one" => match sub.attach::<u32>("one") {
                Ok(a) => {
                    let bad = kernels::check_u32(a.buffer(), pattern(base, 0)).unwrap();
                    let r = json!({ "bad": bad, "fence": a.uses_fence() });
                    one = Some(a);
                    r
                }
                Err(e) => json!({ "error": e.to_string() }),
            },
            "update_one" => {
                let a = one.as_ref().unwrap();
                match sub.wait_update(a, Duration::from_secs(10)) {
                    Ok(v) => json!({
                        "bad": kernels::check_u32(a.buffer(), pattern(base, 0)).unwrap(),
                        "version": v
                    }),
                    Err(e) => json!({ "error": e.to_string() }),
                }
            }
            "release" => {
                if let Some(s) = set.take() {
                    sub.release_set(s).unwrap();
                }
                if let Some(a) = one.take() {
                    sub.release(a).unwrap();
                }
                json!({ "bad": null })
            }
            other => json!({ "error": format!("unknown op {other}") }),
        };
        parent.send(&reply);
    }
}

fn child_or(f: impl FnOnce()) {
    super::common::child_or("subscriber", subscriber, f);
}

fn ask(peer: &mut Peer, req: &Value) -> Value {
    peer.send(req);
    peer.recv()
}

/// Publishes a set of [`BUFFERS`] buffers and one arena buffer, runs a
/// subscriber child (spawned by `spawn`) through attach and [`UPDATES`]
/// updates of each, every value checked. Returns whether the child's set
/// waited on the fence, or the child's error at the set's attach.
fn sets_with(device: &Device, socket: &Path, spawn: impl FnOnce() -> Peer) -> Result<bool, String> {
    let publisher = Publisher::bind(device, socket, PublisherConfig::default()).unwrap();
    // Sizes from 4 KiB to about 1 MiB, so that chunks hold many buffers.
    let buffers: Vec<DeviceArenaBuffer> = (0..BUFFERS)
        .map(|i| publisher.alloc(4096 * (1 + (i as u64 * 37) % 256)).unwrap())
        .collect();
    let names: Vec<String> = (0..BUFFERS).map(|i| format!("layer{i}.weight")).collect();
    let shapes: Vec<[u64; 1]> = buffers.iter().map(|b| [b.byte_len() / 4]).collect();
    let fill = |base: u32| {
        for (i, b) in buffers.iter().enumerate() {
            kernels::fill_u32(b, pattern(base, i), Speed::Full).unwrap();
        }
    };
    let members: Vec<SetMember<'_>> = buffers
        .iter()
        .zip(&names)
        .zip(&shapes)
        .map(|((buffer, name), shape)| SetMember::new(name, Dtype::U32, shape, buffer))
        .collect();
    fill(1);
    publisher.publish_set("weights", &members).unwrap();
    let single = publisher.alloc(1 << 20).unwrap();
    kernels::fill_u32(&single, pattern(1, 0), Speed::Full).unwrap();
    publisher
        .publish_buffer("one", &single, Dtype::U32, &[1 << 18])
        .unwrap();

    let mut peer = spawn();
    assert_eq!(peer.recv()["connected"], true);
    let r = ask(&mut peer, &json!({ "op": "attach_set", "base": 1 }));
    if let Some(e) = r["error"].as_str() {
        peer.send(&json!({ "op": "release" }));
        let _ = peer.recv();
        drop(peer);
        return Err(e.to_owned());
    }
    crate::assert_ok!(&r, "attach_set");
    assert_eq!(r["len"], BUFFERS);
    let fence = r["fence"] == true;
    let r = ask(&mut peer, &json!({ "op": "attach_one", "base": 1 }));
    crate::assert_ok!(&r, "attach_one");
    assert_eq!(
        r["fence"] == true,
        fence,
        "the set and the buffer chose alike"
    );
    for u in 1..=UPDATES {
        let base = 1 + u * 0x100;
        fill(base);
        assert_eq!(publisher.update_set("weights").unwrap(), u64::from(u));
        let r = ask(&mut peer, &json!({ "op": "update_set", "base": base }));
        crate::assert_ok!(&r, "update {u} of the set");
        assert_eq!(r["version"], u);
        kernels::fill_u32(&single, pattern(base, 0), Speed::Full).unwrap();
        // `update` of an arena buffer goes through `update_set`.
        publisher.update("one").unwrap();
        let r = ask(&mut peer, &json!({ "op": "update_one", "base": base }));
        crate::assert_ok!(&r, "update {u} of the arena buffer");
    }
    let r = ask(&mut peer, &json!({ "op": "release" }));
    crate::assert_ok!(&r, "release");
    drop(peer);
    publisher
        .unpublish_set("weights", Some(Duration::from_secs(10)))
        .unwrap();
    publisher
        .unpublish_set("one", Some(Duration::from_secs(10)))
        .unwrap();
    Ok(fence)
}

fn spawn_subscriber(test: &str, socket: &Path, sync: &str, exe: Option<&Path>) -> Peer {
    let adjust = |c: &mut std::process::Command| {
        c.env(SOCKET_ENV, socket).env(SYNC_ENV, sync);
    };
    match exe {
        Some(exe) => Peer::spawn_exe_with(exe, test, "subscriber", adjust),
        None => Peer::spawn_with(test, "subscriber", adjust),
    }
}

/// A set of 100 buffers and an arena buffer through fences: forced
/// (`SyncMode::Fence`) with the consumer on the host, and chosen by `auto`
/// with the consumer in a private `/dev/shm`, where `event` must fail.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn sets_through_fences_on_the_host_and_in_a_private_dev_shm() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        let test = test_name!("sets_through_fences_on_the_host_and_in_a_private_dev_shm");
        let dir = tempfile::tempdir().unwrap();
        let t = Instant::now();
        let socket = dir.path().join("host-fence.sock");
        let fence = sets_with(&device, &socket, || {
            spawn_subscriber(&test, &socket, "fence", None)
        });
        assert_eq!(fence, Ok(true), "host, sync=fence");
        let socket = dir.path().join("host-event.sock");
        let fence = sets_with(&device, &socket, || {
            spawn_subscriber(&test, &socket, "event", None)
        });
        assert_eq!(fence, Ok(false), "host, sync=event");
        let socket = dir.path().join("host-host-fence.sock");
        let fence = sets_with(&device, &socket, || {
            spawn_subscriber(&test, &socket, "host-fence", None)
        });
        assert_eq!(fence, Ok(true), "host, sync=host-fence");
        println!(
            "host: {BUFFERS} buffers + 1, {UPDATES} updates each, fence, event and host-fence, in {:.2} s",
            t.elapsed().as_secs_f64()
        );

        let flags = ["--mount"];
        if let Some(why) = unshare_refused(&flags) {
            println!("private /dev/shm: skipped: {why}");
            return;
        }
        let exe = wrapper(dir.path(), &flags, "mount -t tmpfs tmpfs /dev/shm &&");
        let t = Instant::now();
        let socket = dir.path().join("shm-auto.sock");
        let fence = sets_with(&device, &socket, || {
            spawn_subscriber(&test, &socket, "auto", Some(&exe))
        });
        assert_eq!(fence, Ok(true), "private /dev/shm, sync=auto");
        let socket = dir.path().join("shm-fence.sock");
        let fence = sets_with(&device, &socket, || {
            spawn_subscriber(&test, &socket, "fence", Some(&exe))
        });
        assert_eq!(fence, Ok(true), "private /dev/shm, sync=fence");
        let socket = dir.path().join("shm-event.sock");
        let r = sets_with(&device, &socket, || {
            spawn_subscriber(&test, &socket, "event", Some(&exe))
        });
        assert!(r.is_err(), "private /dev/shm, sync=event must fail: {r:?}");
        println!(
            "private /dev/shm: auto and fence through fences, event refused ({}), in {:.2} s",
            r.unwrap_err(),
            t.elapsed().as_secs_f64()
        );
    });
}

/// Publish, update and ring over the channel with `sync = host-fence` (the
/// host's wait alone, no stream operation), data checked both ways.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn host_fences_over_the_channel_publish_update_ring() {
    super::containers::child_or(|| {
        let device = Device::open(0).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("host-fence.sock");
        let test = test_name!("host_fences_over_the_channel_publish_update_ring");
        let fence = super::containers::exchange_with(&device, &socket, || {
            super::containers::spawn_subscriber(&test, &socket, "host-fence", None)
        });
        assert!(fence, "sync=host-fence must wait on fences");
    });
}
