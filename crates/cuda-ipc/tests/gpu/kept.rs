//! Lifetimes that hold across processes and never block: a view kept after
//! its set, attachment and `Subscriber` are gone keeps its lease (the
//! publisher neither reuses nor frees the memory under it), a fence block
//! outlives the signals queued on other streams, and drops return at once
//! even while the GPU is busy or the publisher is stopped.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use cuda_ipc::arena::SetMember;
use cuda_ipc::exchange::{Publisher, PublisherConfig, Subscriber, SubscriberConfig};
use cuda_ipc::fence::Fence;
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::share::SharedBuffer;
use cuda_ipc::{Device, DeviceMemory, Dtype, WithStream, reaper};
use serde_json::json;

use super::common::{Parent, Peer, role};
use crate::test_name;

const MIB: usize = 1 << 20;
const SOCKET_ENV: &str = "CUDA_IPC_TEST_SOCKET";

fn socket_dir() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::Builder::new()
        .prefix("cuda-ipc-gpu")
        .tempdir()
        .unwrap();
    let socket = dir.path().join("kept.sock");
    (dir, socket)
}

fn leases_on(publisher: &Publisher, name: &str) -> usize {
    publisher.leases().iter().filter(|l| l.name == name).count()
}

/// Waits up to 10 s for `done`.
fn eventually(mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

/// The consumer of `a_view_kept_after_its_subscriber_keeps_its_lease`:
/// keeps one view of a set and one of a single buffer, drops the set, the
/// attachment and the subscriber, and later reads the views.
fn keeper() {
    let parent = Parent::new();
    let device = Device::open(0).unwrap();
    let socket = PathBuf::from(std::env::var(SOCKET_ENV).unwrap());
    let sub = Subscriber::connect(&device, socket.as_path(), SubscriberConfig::default()).unwrap();
    let set = sub.attach_set("model").unwrap();
    let kept = set.get::<u32>("w").unwrap();
    let a = sub.attach::<u32>("single").unwrap();
    let kept_single = a.buffer().clone();
    let t = Instant::now();
    drop(set);
    drop(a);
    drop(sub);
    let drop_ms = t.elapsed().as_secs_f64() * 1e3;
    parent.send(&json!({ "dropped": true, "drop_ms": drop_ms }));
    // The publisher tried to take the memory back and wrote new data.
    parent.recv();
    let w = kept.to_vec::<u32>().unwrap();
    let s = kept_single.to_vec::<u32>().unwrap();
    parent.send(&json!({
        "w_bad": w.iter().filter(|&&x| x != 7).count(),
        "single_bad": s.iter().filter(|&&x| x != 7).count(),
    }));
    parent.recv();
    drop(kept);
    drop(kept_single);
    let settled = reaper::settle(Duration::from_secs(10));
    parent.send(&json!({ "let_go": settled }));
    parent.recv();
}

/// A consumer keeps a view of a set and of a single buffer after dropping
/// the set, the attachment and its `Subscriber`. The publisher's unpublish
/// waits for those views (and times out), the new buffers it allocates
/// never land under them, and the views read the values they were given;
/// the leases end when the views go.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_view_kept_after_its_subscriber_keeps_its_lease() {
    if role().as_deref() == Some("keeper") {
        return keeper();
    }
    let device = Device::open(0).unwrap();
    let (_dir, socket) = socket_dir();
    let publisher = Publisher::bind(&device, socket.as_path(), PublisherConfig::default()).unwrap();
    let w = publisher.alloc(4 * MIB as u64).unwrap();
    kernels::fill_u32(&w, Pattern::constant(7), Speed::Full).unwrap();
    let shape = [MIB as u64];
    publisher
        .publish_set("model", &[SetMember::new("w", Dtype::U32, &shape, &w)])
        .unwrap();
    let single = SharedBuffer::alloc(&device, 4 * MIB, None).unwrap();
    kernels::fill_u32(&single, Pattern::constant(7), Speed::Full).unwrap();
    publisher
        .publish("single", single, Dtype::U32, None)
        .unwrap();
    let mut peer = Peer::spawn_with(
        &test_name!("a_view_kept_after_its_subscriber_keeps_its_lease"),
        "keeper",
        |c| {
            c.env(SOCKET_ENV, &socket);
        },
    );
    let r = peer.recv();
    assert_eq!(r["dropped"], true, "{r}");
    assert!(
        r["drop_ms"].as_f64().unwrap() < 100.0,
        "dropping the subscriber waited: {r}"
    );
    assert_eq!(leases_on(&publisher, "model"), 1, "the set's lease stays");
    assert_eq!(
        leases_on(&publisher, "single"),
        1,
        "the buffer's lease stays"
    );

    let t = Instant::now();
    assert!(
        publisher
            .unpublish_set("model", Some(Duration::from_secs(2)))
            .is_err(),
        "unpublish_set returned while a consumer's view lives"
    );
    assert!(t.elapsed() >= Duration::from_millis(1900));
    assert!(
        publisher
            .unpublish("single", Some(Duration::from_secs(1)))
            .is_err(),
        "unpublish returned while a consumer's view lives"
    );
    // New data: the arena must not hand out the kept ranges.
    drop(w);
    let fresh: Vec<_> = (0..4)
        .map(|_| publisher.alloc(4 * MIB as u64).unwrap())
        .collect();
    for b in &fresh {
        kernels::fill_u32(b, Pattern::constant(9), Speed::Full).unwrap();
    }
    let names: Vec<String> = (0..fresh.len()).map(|i| format!("w{i}")).collect();
    let members: Vec<_> = fresh
        .iter()
        .zip(&names)
        .map(|(b, n)| SetMember::new(n, Dtype::U32, &shape, b))
        .collect();
    publisher.publish_set("model2", &members).unwrap();
    device.synchronize().unwrap();

    peer.send(&json!({ "check": true }));
    let r = peer.recv();
    assert_eq!(
        r["w_bad"], 0,
        "new data landed under the kept set view: {r}"
    );
    assert_eq!(r["single_bad"], 0, "the kept buffer view changed: {r}");
    assert_eq!(leases_on(&publisher, "model"), 1);

    peer.send(&json!({ "let_go": true }));
    assert_eq!(peer.recv()["let_go"], true);
    assert!(
        eventually(|| leases_on(&publisher, "model") + leases_on(&publisher, "single") == 0),
        "{:?}",
        publisher.leases()
    );
    assert!(eventually(|| {
        publisher.reap();
        publisher.retired_sets() == 0
    }));
    peer.send(&json!({ "exit": true }));
    assert!(peer.finish());
}

/// A fence block dropped while a signal is still queued behind slow work
/// on another stream stays until that stream has passed: the stream
/// finishes without a fault, and the drop returns at once.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_fence_outlives_signals_queued_on_other_streams() {
    let device = Device::open(0).unwrap();
    for host in [false, true] {
        let stream = device.context().new_stream().unwrap();
        let fence = if host {
            Fence::new_host(&device, 4).unwrap()
        } else {
            Fence::new(&device, 4, None).unwrap()
        };
        let buf = SharedBuffer::alloc(&device, 16 * MIB, None)
            .unwrap()
            .with_stream(stream.clone())
            .unwrap();
        kernels::fill_u32(&buf, Pattern::constant(1), Speed::Slow).unwrap();
        fence.signal(&stream, 0, 1).unwrap();
        let t = Instant::now();
        drop(fence);
        drop(buf);
        let dropped = t.elapsed();
        assert!(
            dropped < Duration::from_millis(20),
            "host words {host}: the drops waited {dropped:?}"
        );
        assert!(reaper::retiring() >= 1, "nothing was retired");
        stream
            .synchronize()
            .unwrap_or_else(|e| panic!("host words {host}: the queued signal faulted: {e}"));
        assert!(reaper::settle(Duration::from_secs(10)));
        device.synchronize().unwrap();
    }
}

/// The consumer of `close_refuses_while_views_live`.
fn closer() {
    let parent = Parent::new();
    let device = Device::open(0).unwrap();
    let socket = PathBuf::from(std::env::var(SOCKET_ENV).unwrap());
    let connect =
        || Subscriber::connect(&device, socket.as_path(), SubscriberConfig::default()).unwrap();
    let sub = connect();
    let set = sub.attach_set("model").unwrap();
    let kept = set.get::<u32>("w").unwrap();
    drop(set);
    let refused = match sub.close() {
        Err(cuda_ipc::Error::StillInUse { users, .. }) => json!(users),
        other => json!(format!("{other:?}")),
    };
    let still_reads = kept.to_vec::<u32>().unwrap().iter().all(|&x| x == 7);
    drop(kept);
    let sub = connect();
    let set = sub.attach_set("model").unwrap();
    drop(set);
    let closed = sub.close().map_err(|e| e.to_string());
    parent
        .send(&json!({ "refused": refused, "still_reads": still_reads, "closed": closed.is_ok() }));
    parent.recv();
}

/// `Subscriber::close` refuses while a view lives (the subscriber is
/// dropped all the same, its connection kept for the view), and closes at
/// once when nothing is held.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn close_refuses_while_views_live() {
    if role().as_deref() == Some("closer") {
        return closer();
    }
    let device = Device::open(0).unwrap();
    let (_dir, socket) = socket_dir();
    let publisher = Publisher::bind(&device, socket.as_path(), PublisherConfig::default()).unwrap();
    let w = publisher.alloc(MIB as u64).unwrap();
    kernels::fill_u32(&w, Pattern::constant(7), Speed::Full).unwrap();
    let shape = [(MIB / 4) as u64];
    publisher
        .publish_set("model", &[SetMember::new("w", Dtype::U32, &shape, &w)])
        .unwrap();
    let mut peer = Peer::spawn_with(
        &test_name!("close_refuses_while_views_live"),
        "closer",
        |c| {
            c.env(SOCKET_ENV, &socket);
        },
    );
    let r = peer.recv();
    assert_eq!(r["refused"], 1, "{r}");
    assert_eq!(r["still_reads"], true, "{r}");
    assert_eq!(r["closed"], true, "{r}");
    assert!(eventually(|| leases_on(&publisher, "model") == 0));
    peer.send(&json!({ "exit": true }));
    assert!(peer.finish());
}

/// The publisher of `drops_return_while_the_publisher_is_stopped`.
fn stoppable_publisher() {
    let parent = Parent::new();
    let device = Device::open(0).unwrap();
    let socket = PathBuf::from(std::env::var(SOCKET_ENV).unwrap());
    let publisher = Publisher::bind(&device, socket.as_path(), PublisherConfig::default()).unwrap();
    let buffers: Vec<_> = (0..8)
        .map(|_| publisher.alloc(2 * MIB as u64).unwrap())
        .collect();
    let names: Vec<String> = (0..buffers.len()).map(|i| format!("t{i}")).collect();
    let shape = [(MIB / 2) as u64];
    let members: Vec<_> = buffers
        .iter()
        .zip(&names)
        .map(|(b, n)| SetMember::new(n, Dtype::U32, &shape, b))
        .collect();
    publisher.publish_set("model", &members).unwrap();
    parent.send(&json!({ "ready": std::process::id() }));
    while parent.recv().is_some() {}
}

/// A consumer drops its views, its set and its subscriber while the
/// publisher is stopped (SIGSTOP): every drop returns at once, and the
/// releases go out when the publisher runs again.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn drops_return_while_the_publisher_is_stopped() {
    if role().as_deref() == Some("publisher") {
        return stoppable_publisher();
    }
    let device = Device::open(0).unwrap();
    let (_dir, socket) = socket_dir();
    let mut peer = Peer::spawn_with(
        &test_name!("drops_return_while_the_publisher_is_stopped"),
        "publisher",
        |c| {
            c.env(SOCKET_ENV, &socket);
        },
    );
    let pid = peer.recv()["ready"].as_u64().unwrap() as i32;
    let sub = Subscriber::connect(&device, socket.as_path(), SubscriberConfig::default()).unwrap();
    let set = sub.attach_set("model").unwrap();
    let views: Vec<_> = (0..set.len())
        .map(|i| set.view::<u32>(i).unwrap())
        .collect();
    // Work still queued on the views when they go.
    kernels::fill_u32(&views[0], Pattern::constant(3), Speed::Slow).unwrap();
    let stop = |sig: &str| {
        assert!(
            std::process::Command::new("kill")
                .args([sig, &pid.to_string()])
                .status()
                .unwrap()
                .success()
        );
    };
    stop("-STOP");
    let t = Instant::now();
    drop(views);
    drop(set);
    drop(sub);
    let dropped = t.elapsed();
    stop("-CONT");
    assert!(
        dropped < Duration::from_millis(50),
        "dropping while the publisher was stopped waited {dropped:?}"
    );
    assert!(reaper::settle(Duration::from_secs(10)));
    peer.send(&json!({ "exit": true }));
    assert!(peer.finish());
}

/// Memory used on another stream through cudarc's traits is ordered with
/// events, not host waits: the use returns while that stream is still busy,
/// work on the memory's own stream sees its result, and the memory dropped
/// right after such a use stays until the use has run (no fault, no wait).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn uses_on_other_streams_are_ordered_by_events() {
    let device = Device::open(0).unwrap();
    let other = device.context().new_stream().unwrap();
    // Slow work ahead of every use on the other stream.
    let slow = SharedBuffer::alloc(&device, 256 * MIB, None)
        .unwrap()
        .with_stream(other.clone())
        .unwrap();
    for mechanism in [
        cuda_ipc::Mechanism::Legacy,
        cuda_ipc::Mechanism::Vmm,
        cuda_ipc::Mechanism::Pool,
    ] {
        let mut buf = SharedBuffer::alloc(&device, 16 * MIB, Some(mechanism)).unwrap();
        kernels::fill_u32(&buf, Pattern::constant(7), Speed::Full).unwrap();
        kernels::fill_u32(&slow, Pattern::constant(1), Speed::Slow).unwrap();
        other.memset_zeros::<u8, _>(&mut buf).unwrap();
        let behind = other.record_event(None).unwrap();
        assert!(
            !behind.is_complete(),
            "{mechanism}: the use on another stream waited on the host"
        );
        let seen = buf.to_vec::<u32>().unwrap();
        assert!(
            seen.iter().all(|&x| x == 0),
            "{mechanism}: the buffer's own stream read before the other stream's write"
        );

        kernels::fill_u32(&slow, Pattern::constant(2), Speed::Slow).unwrap();
        other.memset_zeros::<u8, _>(&mut buf).unwrap();
        let t = Instant::now();
        drop(buf);
        let dropped = t.elapsed();
        assert!(
            dropped < Duration::from_millis(20),
            "{mechanism}: the drop waited {dropped:?}"
        );
        assert!(reaper::retiring() >= 1, "{mechanism}: nothing was retired");
        other
            .synchronize()
            .unwrap_or_else(|e| panic!("{mechanism}: the use on another stream faulted: {e}"));
        assert!(reaper::settle(Duration::from_secs(10)));
    }
    device.synchronize().unwrap();
}
