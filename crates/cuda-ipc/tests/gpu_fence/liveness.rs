//! A consumer whose producer dies: the word keeps its last value, a wait
//! with a host deadline returns, and a stream already waiting on the device
//! is released by abandoning the fence.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use cuda_ipc::Device;
use cuda_ipc::fence::{ABANDONED, Fence};
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::share::{self, SharedBuffer};
use serde_json::json;

use crate::common::{Parent, Peer, role};
use crate::{open_fence, test_name};

/// Set in the producer's environment to make it use host words.
const HOST_ENV: &str = "CUDA_IPC_FENCE_HOST_WORDS";

/// The producer that will be killed: signals 1 after a fill, then idles.
fn doomed_producer() {
    let device = Device::open(0).unwrap();
    share::allow_fd_fetching().unwrap();
    let parent = Parent::new();
    let fence = if std::env::var_os(HOST_ENV).is_some() {
        Fence::new_host(&device, 1).unwrap()
    } else {
        Fence::new(&device, 1, None).unwrap()
    };
    let data = SharedBuffer::alloc(&device, 1 << 20, None).unwrap();
    kernels::fill_u32(&data, Pattern::constant(7), Speed::Full).unwrap();
    fence.signal(device.stream(), 0, 1).unwrap();
    device.synchronize().unwrap();
    let fe = fence.export().unwrap();
    parent.send(&json!({ "fence": fe.block }));
    // Wait to be killed (or for the parent to hang up).
    while parent.recv().is_some() {}
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_waiting_consumer_gets_out_when_the_producer_is_killed() {
    if role().as_deref() == Some("producer") {
        return doomed_producer();
    }
    dead_producer(
        false,
        &test_name!("a_waiting_consumer_gets_out_when_the_producer_is_killed"),
    );
}

/// The same with the sequence word in host memory (a memfd).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_waiting_consumer_gets_out_when_the_producer_is_killed_host_words() {
    if role().as_deref() == Some("producer") {
        return doomed_producer();
    }
    dead_producer(
        true,
        &test_name!("a_waiting_consumer_gets_out_when_the_producer_is_killed_host_words"),
    );
}

fn dead_producer(host: bool, test: &str) {
    let device = Device::open(0).unwrap();
    let peer = Peer::spawn_with(test, "producer", |c| {
        if host {
            c.env(HOST_ENV, "1");
        }
    });
    let r = peer.recv();
    let fence = open_fence(&device, &r["fence"]);
    assert!(
        fence.wait_host(0, 1, Duration::from_secs(10)).unwrap(),
        "the producer's signal never arrived"
    );
    peer.kill();
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        fence.value(0).unwrap(),
        1,
        "the word changed when its producer died"
    );

    // A host deadline before queuing: returns in time, queues nothing.
    let stream = device.context().new_stream().unwrap();
    let t = Instant::now();
    assert!(
        !fence
            .wait_within(&stream, 0, 2, Duration::from_millis(200))
            .unwrap()
    );
    let waited = t.elapsed();
    assert!(
        waited >= Duration::from_millis(200) && waited < Duration::from_secs(2),
        "wait_within took {waited:?} for a 200 ms deadline"
    );
    stream.synchronize().unwrap();

    // A wait queued on the device blocks the stream until the fence is abandoned.
    fence.wait(&stream, 0, 2).unwrap();
    let (tx, rx) = mpsc::channel();
    let waiting = stream.clone();
    std::thread::spawn(move || {
        let _ = tx.send(waiting.synchronize().map_err(|e| e.to_string()));
    });
    assert!(
        rx.recv_timeout(Duration::from_millis(500)).is_err(),
        "the stream went on although nobody signalled 2"
    );
    let t = Instant::now();
    fence.abandon(None).unwrap();
    let done = rx.recv_timeout(Duration::from_secs(10));
    assert!(
        matches!(done, Ok(Ok(()))),
        "abandoning did not release the waiting stream: {done:?}"
    );
    assert_eq!(fence.value(0).unwrap(), ABANDONED);
    assert!(fence.value(0).unwrap() >= 2);
    println!(
        "dead producer ({} words): deadline wait returned after {:.0} ms; the queued wait was released {:.2} ms after abandon",
        if host { "host" } else { "device" },
        waited.as_secs_f64() * 1e3,
        t.elapsed().as_secs_f64() * 1e3
    );
}
