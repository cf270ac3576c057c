//! A consumer's stream waits on the device for the producer's work: a slow
//! fill, and a ring of 10,000 frames with data and fences both ways.

use std::time::Instant;

use cuda_ipc::fence::Fence;
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::share::{self, SharedBuffer};
use cuda_ipc::{Descriptor, Device, DeviceMemory, Dtype};
use serde_json::{Value, json};

use crate::common::{Parent, Peer, role};
use crate::{FRAME, open_fence, test_name};

const MIB: u64 = 1 << 20;

fn pattern_of(v: &Value) -> Pattern {
    Pattern::ramp(v[0].as_u64().unwrap() as u32, v[1].as_u64().unwrap() as u32)
}

/// The consumer of the slow-fill test: queues its wait before the producer
/// has started writing, then checks the data behind it.
fn slow_fill_consumer() {
    let device = Device::open(0).unwrap();
    let parent = Parent::new();
    let mut opened = None;
    while let Some(m) = parent.recv() {
        let (fence, data) = opened.get_or_insert_with(|| {
            let d = Descriptor::from_value(&m["data"]).unwrap();
            (
                open_fence(&device, &m["fence"]),
                share::open::<u32>(&device, &d, Vec::new()).unwrap(),
            )
        });
        let seq = m["seq"].as_u64().unwrap();
        let before = fence.value(0).unwrap();
        fence.wait(device.stream(), 0, seq).unwrap();
        parent.send(&json!({ "waiting": true, "before": before }));
        let bad = kernels::check_u32(&*data, pattern_of(&m["expect"])).unwrap();
        parent.send(&json!({ "bad": bad, "before": before }));
    }
}

/// The producer fills 64 MiB with one block of 32 threads (tens of
/// milliseconds) and signals; the consumer, whose stream was already
/// waiting, sees every value. Three rounds on one word.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_slow_fill_is_waited_for_on_the_device() {
    if role().as_deref() == Some("consumer") {
        return slow_fill_consumer();
    }
    let device = Device::open(0).unwrap();
    share::allow_fd_fetching().unwrap();
    let fence = Fence::new(&device, 1, None).unwrap();
    let data = SharedBuffer::alloc(&device, (64 * MIB) as usize, None).unwrap();
    let fe = fence.export().unwrap();
    let de = data.export_region(0, 64 * MIB, Dtype::U32, None).unwrap();
    let mut peer = Peer::spawn(
        &test_name!("a_slow_fill_is_waited_for_on_the_device"),
        "consumer",
    );
    for round in 1..=3u64 {
        let p = Pattern::ramp(round as u32 * 1000, 3);
        peer.send(&json!({
            "fence": fe.block, "data": de.descriptor.to_value(), "seq": round, "expect": [p.base, p.step],
        }));
        let r = peer.recv();
        assert_eq!(r["waiting"], true, "{r}");
        assert!(
            r["before"].as_u64().unwrap() < round,
            "the word was already {round}: {r}"
        );
        let t = Instant::now();
        kernels::fill_u32(&data, p, Speed::Slow).unwrap();
        fence.signal(device.stream(), 0, round).unwrap();
        let r = peer.recv();
        crate::assert_no_error(&r);
        assert!(
            r["bad"].is_null(),
            "round {round}: the consumer read before the fill was done: {r}"
        );
        println!(
            "round {round}: slow fill + signal + consumer check took {:.1} ms; the word was {} when the consumer queued its wait",
            t.elapsed().as_secs_f64() * 1e3,
            r["before"]
        );
    }
    assert!(peer.finish(), "the consumer failed");
}

const FRAMES: u64 = 10_000;
const SLOTS: u64 = 4;

/// The consumer of the ring: copies each frame out, transforms it in place
/// (`x * 3 + 1`), and hands the slot back with its own fence.
fn ring_consumer() {
    let device = Device::open(0).unwrap();
    share::allow_fd_fetching().unwrap();
    let parent = Parent::new();
    let m = parent.recv().unwrap();
    let full = open_fence(&device, &m["full"]);
    let ring = share::open::<u32>(
        &device,
        &Descriptor::from_value(&m["ring"]).unwrap(),
        Vec::new(),
    )
    .unwrap();
    let free = if m["host"] == true {
        Fence::new_host(&device, SLOTS as u32).unwrap()
    } else {
        Fence::new(&device, SLOTS as u32, None).unwrap()
    };
    let fe = free.export().unwrap();
    let seen = SharedBuffer::alloc(&device, (FRAMES * FRAME) as usize, None).unwrap();
    parent.send(&json!({ "free": fe.block }));
    assert_eq!(parent.recv().unwrap()["op"], "go");
    let s = device.stream();
    let t = Instant::now();
    for i in 1..=FRAMES {
        let k = (i - 1) % SLOTS;
        let slot = ring.region(k * FRAME, FRAME).unwrap();
        full.wait(s, k as u32, i).unwrap();
        seen.region((i - 1) * FRAME, FRAME)
            .unwrap()
            .copy_from_device(&slot)
            .unwrap();
        kernels::map_u32(&slot, 3, 1).unwrap();
        free.signal(s, k as u32, i).unwrap();
    }
    device.synchronize().unwrap();
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let bad = kernels::check_u32(&seen, Pattern::ramp(FRAME as u32 / 4, 1)).unwrap();
    parent.send(&json!({ "bad": bad, "ms": ms }));
    // Keep the fence and the mapping until the producer is done with them.
    let _ = parent.recv();
}

/// 10,000 frames of 4 KiB through a ring of 4 slots, with no host wait
/// anywhere: the producer's stream waits on the consumer's fence before
/// reusing a slot, the consumer's on the producer's before reading. Data
/// goes both ways (the consumer transforms each frame in place and the
/// producer reads it back before refilling), and both sides check all of it.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn ping_pong_10000_frames_both_ways() {
    if role().as_deref() == Some("consumer") {
        return ring_consumer();
    }
    ring(false, &test_name!("ping_pong_10000_frames_both_ways"));
}

/// The same ring with the sequence words in host memory (memfds).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn ping_pong_10000_frames_both_ways_host_words() {
    if role().as_deref() == Some("consumer") {
        return ring_consumer();
    }
    ring(
        true,
        &test_name!("ping_pong_10000_frames_both_ways_host_words"),
    );
}

fn ring(host: bool, test: &str) {
    let device = Device::open(0).unwrap();
    share::allow_fd_fetching().unwrap();
    let full = if host {
        Fence::new_host(&device, SLOTS as u32).unwrap()
    } else {
        Fence::new(&device, SLOTS as u32, None).unwrap()
    };
    let ring = SharedBuffer::alloc(&device, (SLOTS * FRAME) as usize, None).unwrap();
    let back = SharedBuffer::alloc(&device, (FRAMES * FRAME) as usize, None).unwrap();
    let fe = full.export().unwrap();
    let re = ring
        .export_region(0, SLOTS * FRAME, Dtype::U32, None)
        .unwrap();
    let mut peer = Peer::spawn(test, "consumer");
    peer.send(&json!({ "full": fe.block, "ring": re.descriptor.to_value(), "host": host }));
    let answer = peer.recv();
    let free = open_fence(&device, &answer["free"]);
    let stream = device.stream();
    peer.send(&json!({ "op": "go" }));
    let t = Instant::now();
    for i in 1..=FRAMES + SLOTS {
        let k = (i - 1) % SLOTS;
        let slot = ring.region(k * FRAME, FRAME).unwrap();
        if i > SLOTS {
            let j = i - SLOTS;
            free.wait(stream, k as u32, j).unwrap();
            back.region((j - 1) * FRAME, FRAME)
                .unwrap()
                .copy_from_device(&slot)
                .unwrap();
        }
        if i <= FRAMES {
            // Frame i holds i * 1024 + e at element e, so that all frames
            // side by side are one ramp (1024 + g at element g).
            kernels::fill_u32(&slot, Pattern::ramp((i * FRAME / 4) as u32, 1), Speed::Full)
                .unwrap();
            full.signal(stream, k as u32, i).unwrap();
        }
    }
    device.synchronize().unwrap();
    let producer_ms = t.elapsed().as_secs_f64() * 1e3;
    let r = peer.recv();
    crate::assert_no_error(&r);
    assert!(
        r["bad"].is_null(),
        "the consumer saw a frame before it was written, or a wrong one: {r}"
    );
    let bad = kernels::check_u32(&back, Pattern::ramp(FRAME as u32 / 4, 1).mapped(3, 1)).unwrap();
    assert_eq!(
        bad, None,
        "the producer reused a slot before the consumer was done with it"
    );
    println!(
        "{FRAMES} frames of 4 KiB both ways through {SLOTS} slots, {} words: producer {producer_ms:.1} ms, consumer {:.1} ms",
        if host { "host" } else { "device" },
        r["ms"].as_f64().unwrap()
    );
    peer.send(&json!({ "op": "bye" }));
    assert!(peer.finish(), "the consumer failed");
}
