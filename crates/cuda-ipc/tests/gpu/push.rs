//! Push across processes: a producer publishes blocks into its arena and
//! pushes each to a stream; a consumer child takes each one without asking
//! (`next_pushed_set`) and checks its bytes; a hoarding child that never
//! takes holds at most `PUSH_LIMIT` pushed leases and is skipped after
//! that while the consumer is never held up; unsubscribing releases what
//! was pushed and not taken, and the blocks' memory goes back.

use std::path::Path;
use std::time::{Duration, Instant};

use cuda_ipc::Device;
use cuda_ipc::Dtype;
use cuda_ipc::arena::SetMember;
use cuda_ipc::exchange::{PUSH_LIMIT, Publisher, PublisherConfig, Subscriber, SubscriberConfig};
use cuda_ipc::kernels::{self, Pattern, Speed};
use serde_json::{Value, json};

use super::common::{Parent, Peer, role};
use crate::{assert_ok, test_name};

const SOCKET_ENV: &str = "CUDA_IPC_TEST_PUSH_SOCKET";
const STREAM: &str = "kv";
const BLOCK_WORDS: u64 = 64 << 10; // 256 KiB

fn pattern(i: u64) -> Pattern {
    Pattern::ramp((i * 1_000_003) as u32, 1)
}

fn connect(device: &Device) -> Subscriber {
    let socket = std::env::var(SOCKET_ENV).unwrap();
    Subscriber::connect(device, Path::new(&socket), SubscriberConfig::default()).unwrap()
}

/// A consumer child: subscribes, then for each `take` takes the next
/// pushed block, checks it, releases it and says which it was.
fn consumer() {
    let parent = Parent::new();
    let device = Device::open(0).unwrap();
    let sub = connect(&device);
    let stream = sub.subscribe(STREAM).unwrap();
    parent.send(&json!({"bad": null}));
    while let Some(ask) = parent.recv() {
        if ask == json!("unsubscribe") {
            break;
        }
        let set = match sub.next_pushed_set(&stream, Duration::from_secs(10)) {
            Ok(s) => s,
            Err(e) => {
                parent.send(&json!({"bad": e.to_string()}));
                continue;
            }
        };
        let i = ask["i"].as_u64().unwrap();
        let view = set.view::<u32>(0).unwrap();
        let bad = kernels::check_u32(&view, pattern(i)).unwrap();
        drop(view);
        let name = set.name().to_owned();
        sub.release_set(set).unwrap();
        parent.send(&json!({"bad": bad, "name": name}));
    }
    let released = sub.unsubscribe(stream).unwrap();
    parent.send(&json!({"bad": null, "released": released}));
    let _ = parent.recv();
}

fn spawn(test: &str, socket: &Path) -> Peer {
    Peer::spawn_with(test, "consumer", |c| {
        c.env(SOCKET_ENV, socket);
    })
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn pushed_blocks_are_taken_without_asking_and_a_hoarder_is_bounded() {
    if role().as_deref() == Some("consumer") {
        return consumer();
    }
    let test = test_name!("pushed_blocks_are_taken_without_asking_and_a_hoarder_is_bounded");
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("push.sock");
    let device = Device::open(0).unwrap();
    let publisher = Publisher::bind(&device, socket.as_path(), PublisherConfig::default()).unwrap();
    publisher.publish_stream(STREAM).unwrap();
    let mut taker = spawn(&test, &socket);
    assert_ok!(&taker.recv(), "the consumer subscribes");
    let mut hoarder = spawn(&test, &socket);
    assert_ok!(&hoarder.recv(), "the hoarder subscribes");
    let rounds = PUSH_LIMIT as u64 + 8;
    let mut skipped = 0;
    for i in 0..rounds {
        let buffer = publisher.alloc(BLOCK_WORDS * 4).unwrap();
        kernels::fill_u32(&buffer, pattern(i), Speed::Full).unwrap();
        let name = format!("block.{i}");
        let member = [SetMember::new("k", Dtype::U32, &[BLOCK_WORDS], &buffer)];
        publisher.publish_set(&name, &member).unwrap();
        let report = publisher.push_set(&name, STREAM).unwrap();
        taker.send(&json!({"i": i}));
        let got = taker.recv();
        assert_ok!(&got, "block {i}");
        assert_eq!(got["name"], Value::from(name.clone()));
        // The hoarder takes nothing: pushed to until its bound, then skipped.
        let expected = if i < PUSH_LIMIT as u64 { 2 } else { 1 };
        assert_eq!(report.leases.len(), expected, "block {i}: {report:?}");
        skipped += report.skipped.len();
        publisher.unpublish_set(&name, None).unwrap();
    }
    assert_eq!(skipped, 8, "the hoarder was skipped once at its bound");
    let held = |p: &Publisher| {
        p.leases()
            .iter()
            .filter(|l| l.name.starts_with("block."))
            .count()
    };
    assert_eq!(
        held(&publisher),
        PUSH_LIMIT,
        "the hoarder holds its bound, no more"
    );
    // Unsubscribing releases what was pushed and not taken.
    hoarder.send(&json!("unsubscribe"));
    let done = hoarder.recv();
    assert_ok!(&done, "the hoarder unsubscribes");
    assert_eq!(done["released"], PUSH_LIMIT);
    let deadline = Instant::now() + Duration::from_secs(10);
    while held(&publisher) > 0 {
        assert!(Instant::now() < deadline, "the hoarded leases end");
        std::thread::sleep(Duration::from_millis(10));
    }
    publisher.reap();
    assert_eq!(
        publisher.arena().unwrap().stats().buffers,
        0,
        "every block's memory back"
    );
    taker.send(&json!("unsubscribe"));
    assert_eq!(taker.recv()["released"], 0);
    drop(taker);
    drop(hoarder);
}
