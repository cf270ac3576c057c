//! Containers: the exchange across PID, IPC, mount and user namespaces,
//! fences as the sync mode where events cannot be opened (a private
//! `/dev/shm`), fences under a ring with subscribers killed at random, and
//! a consumer that sees the GPU under another name (`CUDA_VISIBLE_DEVICES`
//! in UUID form).
//!
//! Children run through util-linux `unshare` (a small shell script wraps
//! this executable); these tests need root to create the namespaces and
//! print why they skip a case where `unshare` is refused.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use cuda_ipc::exchange::{
    Attachment, Publisher, PublisherConfig, RingPublisher, RingSync, Subscriber, SubscriberConfig,
    SyncMode,
};
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::share::{self, SharedBuffer};
use cuda_ipc::{Device, Dtype, Mechanism};
use serde_json::json;

use super::common::{Parent, Peer, role};
use super::consumer::{pattern, pattern_json};
use crate::test_name;

const MIB: usize = 1 << 20;
const SOCKET_ENV: &str = "CUDA_IPC_TEST_SOCKET";
const SYNC_ENV: &str = "CUDA_IPC_TEST_SYNC";
const ENTRIES: [(&str, Mechanism); 3] = [
    ("vmm", Mechanism::Vmm),
    ("pool", Mechanism::Pool),
    ("legacy", Mechanism::Legacy),
];
const RING_FRAMES: u32 = 200;

/// Why `unshare FLAGS true` cannot run here, if it cannot.
pub(super) fn unshare_refused(flags: &[&str]) -> Option<String> {
    match Command::new("unshare")
        .args(flags)
        .arg("true")
        .stdin(Stdio::null())
        .output()
    {
        Err(e) => Some(format!("util-linux unshare cannot be run: {e}")),
        Ok(o) if !o.status.success() => Some(format!(
            "`unshare {}` is refused: {}",
            flags.join(" "),
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Ok(_) => None,
    }
}

/// A script that runs this executable through `unshare FLAGS`, after
/// `setup` (shell commands run inside, before the test starts).
pub(super) fn wrapper(dir: &Path, flags: &[&str], setup: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let exe = std::env::current_exe().unwrap();
    let path = dir.join("in-namespaces.sh");
    let script = format!(
        "#!/bin/sh\nexec unshare {} -- sh -c '{setup} exec \"$0\" \"$@\"' '{}' \"$@\"\n",
        flags.join(" "),
        exe.display()
    );
    std::fs::write(&path, script).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// The subscriber child: connects with the sync mode of `SYNC_ENV`, then
/// serves the parent's requests.
fn subscriber_child() {
    let parent = Parent::new();
    let device = Device::open(0).expect("child opens its device");
    let socket = std::env::var(SOCKET_ENV).unwrap();
    let sync: SyncMode = std::env::var(SYNC_ENV)
        .unwrap_or("auto".into())
        .parse()
        .unwrap();
    // A child running as another user accepts a publisher running as root.
    let config = SubscriberConfig::default().with_sync(sync).with_allow_uids(
        std::env::var("CUDA_IPC_TEST_SERVER_UID")
            .ok()
            .and_then(|u| u.parse().ok()),
    );
    let sub = match Subscriber::connect(&device, socket.as_str(), config) {
        Ok(s) => s,
        Err(e) => {
            parent.send(&json!({ "error": e.to_string() }));
            return;
        }
    };
    parent.send(&json!({ "connected": true }));
    let mut held: HashMap<String, Attachment<u32>> = HashMap::new();
    while let Some(req) = parent.recv() {
        let name = req["name"].as_str().unwrap_or_default().to_owned();
        let reply = match req["op"].as_str().unwrap_or_default() {
            // Attach, check the producer's data, write ours back.
            "attach" => match sub.attach::<u32>(&name) {
                Err(e) => json!({ "error": e.to_string() }),
                Ok(a) => {
                    let bad = kernels::check_u32(a.buffer(), pattern(&req["expect"])).unwrap();
                    kernels::map_u32(a.buffer(), 3, 1).unwrap();
                    let back = pattern(&req["expect"]).mapped(3, 1);
                    let bad_back = kernels::check_u32(a.buffer(), back).unwrap();
                    let fence = a.uses_fence();
                    held.insert(name, a);
                    json!({ "bad": bad, "bad_back": bad_back, "fence": fence })
                }
            },
            "update" => {
                let a = &held[&name];
                match sub.wait_update(a, Duration::from_secs(10)) {
                    Err(e) => json!({ "error": e.to_string() }),
                    Ok(v) => {
                        json!({ "version": v, "bad": kernels::check_u32(a.buffer(), pattern(&req["expect"])).unwrap() })
                    }
                }
            }
            "ring" => match sub.attach_ring::<u32>(&name) {
                Err(e) => json!({ "error": e.to_string() }),
                Ok(ring) => {
                    parent.send(&json!({
                        "attached": true,
                        "fence": ring.uses_fences(),
                        "spins": ring.spins(),
                    }));
                    let mut bad = 0;
                    for _ in 0..req["frames"].as_u64().unwrap() {
                        let f = sub.next_frame(&ring, Duration::from_secs(10)).unwrap();
                        let v = f.notice["value"].as_u64().unwrap() as u32;
                        if kernels::check_u32(&f.buffer, Pattern::constant(v))
                            .unwrap()
                            .is_some()
                        {
                            bad += 1;
                        }
                        sub.ack(&ring, f).unwrap();
                    }
                    sub.release_ring(ring).unwrap();
                    json!({ "bad_frames": bad })
                }
            },
            "release" => {
                for (_, a) in held.drain() {
                    sub.release(a).unwrap();
                }
                json!({ "released": true })
            }
            other => json!({ "error": format!("unknown op {other}") }),
        };
        parent.send(&reply);
    }
}

pub(super) fn child_or(f: impl FnOnce()) {
    match role().as_deref() {
        Some("subscriber") => subscriber_child(),
        Some("victim") => ring_victim(),
        Some("uuid") => uuid_child(),
        Some(other) => panic!("unknown role {other}"),
        None => f(),
    }
}

/// Publishes one buffer per mechanism and a ring, and runs a subscriber
/// child (spawned by `spawn`) through attach (data both ways), update and
/// the ring. Returns whether the child used fences for the entries.
pub(super) fn exchange_with(device: &Device, socket: &Path, spawn: impl FnOnce() -> Peer) -> bool {
    exchange_entries(device, socket, &ENTRIES, PublisherConfig::default(), spawn)
}

/// As [`exchange_with`], for `entries`, with a publisher configured so.
fn exchange_entries(
    device: &Device,
    socket: &Path,
    entries: &[(&'static str, Mechanism)],
    config: PublisherConfig,
    spawn: impl FnOnce() -> Peer,
) -> bool {
    let publisher = Publisher::bind(device, socket, config).unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        // Where the test's directory lets another user in, so does the socket.
        std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    }
    let mut patterns = HashMap::new();
    for (k, (name, m)) in entries.iter().enumerate() {
        let b = SharedBuffer::alloc(device, 4 * MIB, Some(*m)).unwrap();
        let p = Pattern::ramp(0x1000 * (k as u32 + 1), 3);
        kernels::fill_u32(&b, p, Speed::Full).unwrap();
        publisher.publish(name, b, Dtype::U32, None).unwrap();
        patterns.insert(*name, p);
    }
    let ring = publisher.ring("frames", 4, 4096, None).unwrap();
    let mut peer = spawn();
    let hello = peer.recv();
    assert_eq!(hello["connected"], true, "{hello}");
    let mut fences = Vec::new();
    for &(name, _) in entries {
        let p = patterns[name];
        peer.send(&json!({ "op": "attach", "name": name, "expect": pattern_json(p) }));
        let r = peer.recv();
        assert!(
            r["error"].is_null() && r["bad"].is_null() && r["bad_back"].is_null(),
            "{name}: {r}"
        );
        fences.push(r["fence"] == true);
        // The child's writes, seen here.
        let b = publisher.buffer(name).unwrap();
        assert_eq!(
            kernels::check_u32(&*b, p.mapped(3, 1)).unwrap(),
            None,
            "{name}: the child's writes"
        );
        // An update: new contents, then the notice.
        let p2 = Pattern::ramp(0xABC0 + name.len() as u32, 7);
        kernels::fill_u32(&*b, p2, Speed::Full).unwrap();
        publisher.update(name).unwrap();
        peer.send(&json!({ "op": "update", "name": name, "expect": pattern_json(p2) }));
        let r = peer.recv();
        assert!(
            r["error"].is_null() && r["bad"].is_null(),
            "{name} update: {r}"
        );
    }
    peer.send(&json!({ "op": "ring", "name": "frames", "frames": RING_FRAMES }));
    let r = peer.recv();
    assert_eq!(r["attached"], true, "{r}");
    send_frames(&ring, 1..=RING_FRAMES);
    let r = peer.recv();
    assert_eq!(r["bad_frames"], 0, "{r}");
    peer.send(&json!({ "op": "release" }));
    assert_eq!(peer.recv()["released"], true);
    assert!(peer.finish(), "the child failed");
    assert!(
        fences.iter().all(|f| *f == fences[0]),
        "mixed sync modes: {fences:?}"
    );
    fences[0]
}

pub(super) fn spawn_subscriber(test: &str, socket: &Path, sync: &str, exe: Option<&Path>) -> Peer {
    let adjust = |c: &mut Command| {
        c.env(SOCKET_ENV, socket).env(SYNC_ENV, sync);
    };
    match exe {
        Some(exe) => Peer::spawn_exe_with(exe, test, "subscriber", adjust),
        None => Peer::spawn_with(test, "subscriber", adjust),
    }
}

/// Publish, update and ring over the channel with `sync = fence`, data
/// checked both ways.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fences_over_the_channel_publish_update_ring() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("fence.sock");
        let test = test_name!("fences_over_the_channel_publish_update_ring");
        let fence = exchange_with(&device, &socket, || {
            spawn_subscriber(&test, &socket, "fence", None)
        });
        assert!(fence, "sync=fence must wait on fences");
        // And the event mode, for comparison, on the same machine.
        let socket = dir.path().join("event.sock");
        let fence = exchange_with(&device, &socket, || {
            spawn_subscriber(&test, &socket, "event", None)
        });
        assert!(!fence, "sync=event must wait on events");
    });
}

/// Publishes one frame of `ring` per value of `values`: the slot filled
/// with the value (a kernel), the value in the frame's notice.
fn send_frames(ring: &RingPublisher, values: std::ops::RangeInclusive<u32>) {
    for v in values {
        let (slot, buf) = ring.acquire(Some(Duration::from_secs(10))).unwrap();
        kernels::fill_u32(buf, Pattern::constant(v), Speed::Full).unwrap();
        let mut extra = serde_json::Map::new();
        extra.insert("value".into(), v.into());
        ring.publish_with(slot, extra).unwrap();
    }
}

/// A fences-only ring (`RingSync::FencesOnly`: no event recorded per
/// frame): readers with `auto`, `fence` and `host-fence` take every frame
/// through its fence, every value checked (only the host-fence reader
/// spinning for its frames); a reader that asks for events is refused at
/// attach, saying why, and the ring serves the next reader.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_fences_only_ring_serves_fence_readers_and_refuses_event_readers() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("fenced.sock");
        let test = test_name!("a_fences_only_ring_serves_fence_readers_and_refuses_event_readers");
        let publisher =
            Publisher::bind(&device, socket.as_path(), PublisherConfig::default()).unwrap();
        let ring = publisher
            .ring_with("frames", 4, 4096, None, RingSync::FencesOnly)
            .unwrap();
        let mut value = 0u32;
        for sync in ["event", "auto", "fence", "host-fence"] {
            let mut peer = spawn_subscriber(&test, &socket, sync, None);
            assert_eq!(peer.recv()["connected"], true, "{sync}");
            peer.send(&json!({ "op": "ring", "name": "frames", "frames": RING_FRAMES }));
            let r = peer.recv();
            if sync == "event" {
                let e = r["error"].as_str().unwrap_or_default();
                assert!(
                    e.contains("fences-only") && e.contains("SyncMode::Auto"),
                    "an event reader of a fences-only ring: {r}"
                );
            } else {
                assert_eq!(r["attached"], true, "{sync}: {r}");
                assert_eq!(r["fence"], true, "{sync} must wait on the fence: {r}");
                // Only a reader that waits from the host spins for its frames.
                assert_eq!(r["spins"], sync == "host-fence", "{sync}: {r}");
                send_frames(&ring, value + 1..=value + RING_FRAMES);
                value += RING_FRAMES;
                let r = peer.recv();
                assert_eq!(r["bad_frames"], 0, "{sync}: {r}");
            }
            peer.send(&json!({ "op": "release" }));
            assert_eq!(peer.recv()["released"], true, "{sync}");
            assert!(peer.finish(), "the {sync} child failed");
        }
        // A publisher without fences cannot make one.
        let socket = dir.path().join("no-fences.sock");
        let bare = Publisher::bind(
            &device,
            socket.as_path(),
            PublisherConfig::default().with_fences(false),
        )
        .unwrap();
        let e = bare
            .ring_with("frames", 2, 4096, None, RingSync::FencesOnly)
            .err()
            .expect("a fences-only ring without fences");
        assert!(e.to_string().contains("no fences"), "{e}");
    });
}

/// The consumer in new namespaces, over the channel, sync = auto: a new
/// PID namespace with its own /proc; PID + IPC; a new user namespace
/// (root mapped to ours); and a mount namespace with a private tmpfs over
/// /dev/shm, where events cannot open and fences must be chosen. Every
/// mechanism, data checked both ways. (A new PID namespace that still sees
/// the parent's /proc cannot start the driver on the H200 with driver 580:
/// `cuInit` fails with CUDA_ERROR_OPERATING_SYSTEM; `run.sh containers`
/// checks the error the command gives there.)
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn every_mechanism_with_the_consumer_in_new_namespaces() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        let test = test_name!("every_mechanism_with_the_consumer_in_new_namespaces");
        let cases: [(&str, &[&str], &str, Option<bool>); 5] = [
            (
                "pid",
                &["--pid", "--fork", "--kill-child", "--mount-proc"],
                "",
                Some(false),
            ),
            (
                "pid+ipc",
                &["--pid", "--ipc", "--fork", "--kill-child", "--mount-proc"],
                "",
                Some(false),
            ),
            ("user", &["--user", "--map-root-user"], "", Some(false)),
            (
                "private /dev/shm",
                &["--mount"],
                "mount -t tmpfs tmpfs /dev/shm &&",
                Some(true),
            ),
            (
                "pid+ipc+private /dev/shm",
                &["--pid", "--ipc", "--fork", "--kill-child", "--mount-proc"],
                "mount -t tmpfs tmpfs /dev/shm &&",
                Some(true),
            ),
        ];
        let mut ran = 0;
        for (label, flags, setup, want_fence) in cases {
            if let Some(why) = unshare_refused(flags) {
                println!("{label}: skipped: {why}");
                continue;
            }
            let dir = tempfile::tempdir().unwrap();
            let socket = dir.path().join("ns.sock");
            let exe = wrapper(dir.path(), flags, setup);
            let t = Instant::now();
            let fence = exchange_with(&device, &socket, || {
                spawn_subscriber(&test, &socket, "auto", Some(&exe))
            });
            println!(
                "{label}: every mechanism, update and {RING_FRAMES} ring frames in {:.2} s; sync: {}",
                t.elapsed().as_secs_f64(),
                if fence { "fence" } else { "event" }
            );
            if let Some(want) = want_fence {
                assert_eq!(
                    fence,
                    want,
                    "{label}: sync auto chose {}",
                    if fence { "fences" } else { "events" }
                );
            }
            ran += 1;
        }
        assert!(ran > 0, "no namespace could be created here (run as root)");
    });
}

/// A ring subscriber killed at random points: receives frames, waiting on
/// fences, until killed.
fn ring_victim() {
    let parent = Parent::new();
    let device = Device::open(0).unwrap();
    let socket = std::env::var(SOCKET_ENV).unwrap();
    let sub = Subscriber::connect(
        &device,
        socket.as_str(),
        SubscriberConfig::default().with_sync(SyncMode::Fence),
    )
    .unwrap();
    let ring = sub.attach_ring::<u32>("frames").unwrap();
    assert!(ring.uses_fences());
    parent.send(&json!({ "ready": true }));
    loop {
        let Ok(f) = sub.next_frame(&ring, Duration::from_secs(30)) else {
            return;
        };
        let v = f.notice["value"].as_u64().unwrap() as u32;
        assert_eq!(
            kernels::check_u32(&f.buffer, Pattern::constant(v)).unwrap(),
            None
        );
        sub.ack(&ring, f).unwrap();
    }
}

/// Fences under a ring with subscribers killed at random points
/// (`CUDA_IPC_FENCE_CHAOS_ROUNDS`, 20 by default): the producer never
/// blocks for longer than the channel's release of a dead subscriber.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fences_under_a_ring_with_chaos_kills() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("chaos.sock");
        let publisher =
            Publisher::bind(&device, socket.as_path(), PublisherConfig::default()).unwrap();
        let ring = publisher.ring("frames", 4, 4096, None).unwrap();
        let rounds: u32 = std::env::var("CUDA_IPC_FENCE_CHAOS_ROUNDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(20);
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut frames = 0u32;
        for round in 0..rounds {
            let peer = Peer::spawn_with(
                &test_name!("fences_under_a_ring_with_chaos_kills"),
                "victim",
                |c| {
                    c.env(SOCKET_ENV, &socket);
                },
            );
            assert_eq!(peer.recv()["ready"], true, "round {round}");
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let kill_after = Duration::from_micros(seed % 30_000);
            let started = Instant::now();
            while started.elapsed() < kill_after {
                let Ok((slot, buf)) = ring.acquire(Some(Duration::from_secs(2))) else {
                    break;
                };
                frames += 1;
                kernels::fill_u32(buf, Pattern::constant(frames), Speed::Full).unwrap();
                let mut extra = serde_json::Map::new();
                extra.insert("value".into(), frames.into());
                ring.publish_with(slot, extra).unwrap();
            }
            peer.kill();
            let t = Instant::now();
            while !ring.subscribers().is_empty() {
                assert!(
                    t.elapsed() < Duration::from_secs(2),
                    "round {round}: a dead subscriber held the ring"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            // With nobody subscribed, the ring keeps going.
            let (slot, _) = ring
                .acquire(Some(Duration::from_secs(2)))
                .unwrap_or_else(|e| panic!("round {round}: the ring is stuck: {e}"));
            frames += 1;
            let mut extra = serde_json::Map::new();
            extra.insert("value".into(), frames.into());
            ring.publish_with(slot, extra).unwrap();
        }
        println!("fence chaos: {rounds} ring subscribers killed, {frames} frames published");
    });
}

/// The child of the UUID test: sees one GPU, named by its UUID.
fn uuid_child() {
    let parent = Parent::new();
    let req = parent.recv().unwrap();
    let d = cuda_ipc::Descriptor::from_value(&req["descriptor"]).unwrap();
    let reply = match share::device_for(&d) {
        Err(e) => json!({ "error": e.to_string() }),
        Ok(device) => {
            let buf = share::open::<u32>(&device, &d, Vec::new()).unwrap();
            json!({
                "ordinal": device.ordinal(),
                "uuid": device.uuid().to_string(),
                "bad": kernels::check_u32(&buf, pattern(&req["expect"])).unwrap(),
            })
        }
    };
    parent.send(&reply);
}

/// A consumer whose CUDA_VISIBLE_DEVICES names the GPU by UUID (and, as a
/// second case, by this process's ordinal) lands on the exporter's GPU.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn the_consumer_finds_the_gpu_by_uuid_whatever_cuda_visible_devices_says() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        let uuid = device.uuid().to_string();
        let b = SharedBuffer::alloc(&device, 2 * MIB, Some(Mechanism::Legacy)).unwrap();
        let p = Pattern::ramp(0x5151, 5);
        kernels::fill_u32(&b, p, Speed::Full).unwrap();
        device.synchronize().unwrap();
        let e = b
            .export_region(0, 2 * MIB as u64, Dtype::U32, None)
            .unwrap();
        for visible in [uuid.clone(), device.ordinal().to_string()] {
            let mut peer = Peer::spawn_with(
                &test_name!(
                    "the_consumer_finds_the_gpu_by_uuid_whatever_cuda_visible_devices_says"
                ),
                "uuid",
                |c| {
                    c.env("CUDA_VISIBLE_DEVICES", &visible);
                },
            );
            peer.send(&json!({ "descriptor": e.descriptor.to_value(), "expect": pattern_json(p) }));
            let r = peer.recv();
            assert!(
                r["error"].is_null() && r["bad"].is_null(),
                "CUDA_VISIBLE_DEVICES={visible}: {r}"
            );
            assert_eq!(r["uuid"], uuid.as_str(), "CUDA_VISIBLE_DEVICES={visible}");
            assert_eq!(r["ordinal"], 0, "CUDA_VISIBLE_DEVICES={visible}");
            assert!(peer.finish());
        }
    });
}

/// Two users: a consumer running as uid 65534, admitted by the publisher's
/// allowlist, receives the vmm and pool descriptors and the fence's memfd
/// over the channel (capabilities, not names) and shares the memory with
/// fences, data checked both ways. Events cannot serve here (the driver's
/// `cuIpcOpenEventHandle` fails for another user with `CUDA_ERROR_MAP_FAILED`).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn another_user_shares_through_fences() {
    child_or(|| {
        if !rustix::process::geteuid().is_root() {
            println!("SKIPPED: needs root to run a child as another user");
            return;
        }
        let device = Device::open(0).unwrap();
        let dir = tempfile::Builder::new()
            .prefix("cuda-ipc-fence-user")
            .tempdir_in("/tmp")
            .unwrap();
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        // The executable must be reachable by the other user.
        let exe = dir.path().join("gpu-tests");
        std::fs::copy(std::env::current_exe().unwrap(), &exe).unwrap();
        let socket = dir.path().join("users.sock");
        let test = test_name!("another_user_shares_through_fences");
        let entries = [("vmm", Mechanism::Vmm), ("pool", Mechanism::Pool)];
        let config = PublisherConfig::default().with_allow_uids([65534]);
        let fence = exchange_entries(&device, &socket, &entries, config, || {
            Peer::spawn_exe_with(&exe, &test, "subscriber", |c| {
                std::os::unix::process::CommandExt::uid(c, 65534);
                std::os::unix::process::CommandExt::gid(c, 65534);
                c.current_dir("/tmp")
                    .env(SOCKET_ENV, &socket)
                    .env(SYNC_ENV, "auto")
                    .env(
                        "CUDA_IPC_TEST_SERVER_UID",
                        rustix::process::geteuid().as_raw().to_string(),
                    );
            })
        });
        println!(
            "another user (uid 65534): vmm and pool shared, update and ring frames checked; sync: {}",
            if fence { "fence" } else { "event" }
        );
    });
}
