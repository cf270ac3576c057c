//! Lifetimes of mapped views across processes: a lease lasts as long as any
//! view of the attached buffer, and a mapping (or lease) goes only after the
//! work queued through its views, on every stream they used, is done.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use cuda_ipc::exchange::{Publisher, PublisherConfig, Subscriber, SubscriberConfig};
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::share::SharedBuffer;
use cuda_ipc::{Device, DeviceMemory, Dtype, Error, Mechanism, WithStream};
use serde_json::json;

use super::common::{Parent, Peer, role};
use crate::test_name;

const MIB: usize = 1 << 20;
const SOCKET_ENV: &str = "CUDA_IPC_TEST_SOCKET";
/// What the subscriber's slow kernel writes.
const WRITTEN: Pattern = Pattern::ramp(7, 3);

fn publisher_and_peer(test: &str) -> (tempfile::TempDir, Publisher, Peer) {
    let device = Device::open(0).unwrap();
    let dir = tempfile::Builder::new()
        .prefix("cuda-ipc-gpu")
        .tempdir()
        .unwrap();
    let socket = dir.path().join("lifetimes.sock");
    let publisher = Publisher::bind(&device, socket.as_path(), PublisherConfig::default()).unwrap();
    let peer = Peer::spawn_with(test, "subscriber", |c| {
        c.env(SOCKET_ENV, &socket);
    });
    (dir, publisher, peer)
}

fn subscriber() -> (Parent, Device, Subscriber) {
    let parent = Parent::new();
    let device = Device::open(0).unwrap();
    let socket = PathBuf::from(std::env::var(SOCKET_ENV).unwrap());
    let sub = Subscriber::connect(&device, socket.as_path(), SubscriberConfig::default()).unwrap();
    (parent, device, sub)
}

/// Waits up to 10 s for the publisher to hold no lease.
fn wait_no_leases(publisher: &Publisher) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !publisher.leases().is_empty() {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

/// The subscriber's side of `dropping_waits_for_slow_work_on_every_stream`:
/// for each request, a view on a stream of its own starts a slow kernel
/// writing the mapping, then the view and the attachment go at once (by
/// drop, or by an explicit release).
fn slow_writer() {
    let (parent, device, sub) = subscriber();
    parent.send(&json!({ "ready": true }));
    while let Some(req) = parent.recv() {
        let name = req["name"].as_str().unwrap();
        let a = sub.attach::<u32>(name).unwrap();
        let stream = device.context().new_stream().unwrap();
        let view = a.buffer().clone().with_stream(stream).unwrap();
        kernels::fill_u32(&view, WRITTEN, Speed::Slow).unwrap();
        let t = Instant::now();
        drop(view);
        let released = if req["how"] == "release" {
            sub.release(a).map_err(|e| e.to_string())
        } else {
            drop(a);
            Ok(())
        };
        parent.send(
            &json!({ "released": released.is_ok(), "error": released.err(),
                             "ms": t.elapsed().as_secs_f64() * 1e3 }),
        );
    }
}

/// A subscriber drops (or releases) a mapping while a slow kernel queued on
/// another stream still writes it: the lease ends only after that kernel,
/// so the publisher, once the lease is gone, sees every element written.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn dropping_waits_for_slow_work_on_every_stream() {
    if role().as_deref() == Some("subscriber") {
        return slow_writer();
    }
    let (_dir, publisher, mut peer) =
        publisher_and_peer(&test_name!("dropping_waits_for_slow_work_on_every_stream"));
    assert_eq!(peer.recv()["ready"], true);
    let device = Device::open(0).unwrap();
    for m in [Mechanism::Vmm, Mechanism::Pool, Mechanism::Legacy] {
        for how in ["drop", "release"] {
            let name = format!("slow-{m}-{how}");
            let buf = SharedBuffer::alloc(&device, 16 * MIB, Some(m)).unwrap();
            kernels::fill_u32(&buf, Pattern::constant(0), Speed::Full).unwrap();
            publisher.publish(&name, buf, Dtype::U32, None).unwrap();
            peer.send(&json!({ "name": name, "how": how }));
            let r = peer.recv();
            assert_eq!(r["released"], true, "{m} {how}: {r}");
            assert!(wait_no_leases(&publisher), "{m} {how}: the lease stayed");
            let back = publisher
                .unpublish(&name, Some(Duration::from_secs(5)))
                .unwrap();
            assert_eq!(
                kernels::check_u32(back.as_ref(), WRITTEN).unwrap(),
                None,
                "{m} {how}: the lease ended before the subscriber's kernel finished ({r})"
            );
        }
    }
    // Closing its input ends the child's loop.
    assert!(peer.finish());
}

/// The subscriber's side of `a_lease_lasts_while_a_view_lives`.
fn view_keeper() {
    let (parent, _device, sub) = subscriber();
    let refused = |r: Result<(), Error>| match r {
        Err(Error::ViewsAlive { views, .. }) => json!(views),
        other => json!(format!("{other:?}")),
    };
    let a = sub.attach::<u32>("kept").unwrap();
    let view = a.buffer().slice(0..16).unwrap().cast::<u8>().unwrap();
    let kept_refused = refused(sub.release(a));
    let ring = sub.attach_ring::<u32>("ring").unwrap();
    parent.send(&json!({ "refused": kept_refused }));
    // The parent publishes one frame.
    parent.recv();
    let frame = sub.next_frame(&ring, Duration::from_secs(10)).unwrap();
    // Every slot's buffer holds the ring's lease; a clone of one keeps it.
    let slot = frame.buffer.clone();
    sub.ack(&ring, frame).unwrap();
    parent.send(&json!({ "ring_refused": refused(sub.release_ring(ring)) }));
    // The parent checks the leases are still held, then lets us drop the views.
    parent.recv();
    assert_eq!(view.to_vec::<u8>().unwrap().len(), 64);
    drop(view);
    drop(slot);
    parent.send(&json!({ "dropped": true }));
    parent.recv();
}

fn leases_on(publisher: &Publisher, name: &str) -> usize {
    publisher.leases().iter().filter(|l| l.name == name).count()
}

/// An explicit release while another view (a cast of a slice, a clone of a
/// ring slot) lives is refused with the count of views, the lease stays,
/// and it ends when the last view drops.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_lease_lasts_while_a_view_lives() {
    if role().as_deref() == Some("subscriber") {
        return view_keeper();
    }
    let (_dir, publisher, mut peer) =
        publisher_and_peer(&test_name!("a_lease_lasts_while_a_view_lives"));
    let device = Device::open(0).unwrap();
    let buf = SharedBuffer::alloc(&device, MIB, None).unwrap();
    kernels::fill_u32(&buf, Pattern::constant(1), Speed::Full).unwrap();
    publisher.publish("kept", buf, Dtype::U32, None).unwrap();
    let ring = publisher.ring("ring", 2, 4096, None).unwrap();
    let r = peer.recv();
    assert_eq!(r["refused"], 1, "{r}");
    let (slot, _) = ring.acquire(Some(Duration::from_secs(10))).unwrap();
    ring.publish(slot).unwrap();
    peer.send(&json!({ "published": true }));
    let r = peer.recv();
    assert_eq!(r["ring_refused"], 1, "{r}");
    assert_eq!(leases_on(&publisher, "kept"), 1, "the buffer's lease stays");
    assert_eq!(ring.subscribers().len(), 1, "the ring's lease stays");
    peer.send(&json!({ "drop": true }));
    assert_eq!(peer.recv()["dropped"], true);
    assert!(wait_no_leases(&publisher), "{:?}", publisher.leases());
    assert!(ring.subscribers().is_empty());
    peer.send(&json!({ "exit": true }));
    assert!(peer.finish());
}

/// The subscriber's side of `a_ring_frame_outlives_its_subscription`.
fn frame_keeper() {
    let (parent, _device, sub) = subscriber();
    let first = sub.attach_ring::<u32>("frames").unwrap();
    let second = sub.attach_ring::<u32>("frames").unwrap();
    parent.send(&json!({ "ready": true }));
    // The parent publishes one frame, which each subscription receives.
    parent.recv();
    let a = sub.next_frame(&first, Duration::from_secs(10)).unwrap();
    let b = sub.next_frame(&second, Duration::from_secs(10)).unwrap();
    // A frame is acknowledged with its own subscription only.
    let Err(wrong) = sub.ack(&second, a) else {
        panic!("a frame was acknowledged with another subscription")
    };
    sub.ack(&second, b).unwrap();
    // A frame owns its view: it stays readable after its subscription is
    // dropped, and holds the subscription's lease until it goes.
    let kept = sub.next_frame(&first, Duration::from_secs(10)).unwrap();
    drop(first);
    let value = kept.buffer.to_vec::<u32>().map(|v| v[0]);
    parent.send(&json!({ "wrong": wrong.to_string(), "kept": format!("{value:?}") }));
    // The parent checks that both leases are still held.
    parent.recv();
    drop(kept);
    drop(second);
    parent.send(&json!({ "dropped": true }));
    parent.recv();
}

/// A ring frame owns what it reads: acknowledging it with another
/// subscription is refused, and one kept past its subscription's drop
/// reads its slot and holds the lease until it goes.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_ring_frame_outlives_its_subscription() {
    if role().as_deref() == Some("subscriber") {
        return frame_keeper();
    }
    let (_dir, publisher, mut peer) =
        publisher_and_peer(&test_name!("a_ring_frame_outlives_its_subscription"));
    let ring = publisher.ring("frames", 2, 4096, None).unwrap();
    assert_eq!(peer.recv()["ready"], true);
    let (slot, buf) = ring.acquire(Some(Duration::from_secs(10))).unwrap();
    kernels::fill_u32(buf, Pattern::constant(41), Speed::Full).unwrap();
    ring.publish(slot).unwrap();
    let (slot, buf) = ring.acquire(Some(Duration::from_secs(10))).unwrap();
    kernels::fill_u32(buf, Pattern::constant(42), Speed::Full).unwrap();
    ring.publish(slot).unwrap();
    peer.send(&json!({ "published": true }));
    let r = peer.recv();
    let wrong = r["wrong"].as_str().unwrap();
    assert!(
        wrong.contains("another") || wrong.contains("not from this one"),
        "{r}"
    );
    assert_eq!(r["kept"], "Ok(42)", "{r}");
    assert_eq!(ring.subscribers().len(), 2, "the kept frame's lease went");
    peer.send(&json!({ "drop": true }));
    assert_eq!(peer.recv()["dropped"], true);
    assert!(wait_no_leases(&publisher), "{:?}", publisher.leases());
    peer.send(&json!({ "exit": true }));
    assert!(peer.finish());
}
