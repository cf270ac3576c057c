//! The fence benchmark: frames of 4 KiB through a ring, with fences and
//! with interprocess events, next to the producer's own floor. Prints one
//! line per figure, each starting with `fence bench:`.
//!
//! - floor: the producer's per-frame work (a fill launch and a signal)
//!   with nobody consuming;
//! - ring, fences on the device only: the consumer queues its waits ahead
//!   and no process waits on the host;
//! - ring, fences + notices and ring, events + notices: one JSON line per
//!   frame each way between the processes (as the exchange's notices),
//!   the same protocol with the two ways of ordering the GPU work;
//! - unloaded frame: one frame at a time, the time from the producer's
//!   fill launch until the producer sees the consumer's hand-back.
//!
//! The targets of issue 15: ring with fences >= 250,000 frames/s and
//! <= 1.2x the floor's time per frame; an unloaded frame <= 0.02 ms.

use std::time::{Duration, Instant};

use cuda_ipc::fence::{Fence, FenceMapping};
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::memory::Region;
use cuda_ipc::share::{self, SharedBuffer};
use cuda_ipc::{Descriptor, Device, DeviceMemory, Dtype, IpcEvent, IpcEventHandle, MappedBuffer};
use serde_json::{Value, json};

use crate::common::{Parent, Peer, role};
use crate::{FRAME, open_fence, test_name};

const SLOTS: u64 = 8;
const RING_FRAMES: u64 = 20_000;
const NOTICE_FRAMES: u64 = 10_000;
const UNLOADED: u64 = 500;

fn events_of(device: &Device, v: &Value) -> Vec<IpcEvent> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|h| {
            IpcEvent::open(
                device,
                h.as_str().unwrap().parse::<IpcEventHandle>().unwrap(),
            )
            .unwrap()
        })
        .collect()
}

fn handles(events: &[IpcEvent]) -> Value {
    events
        .iter()
        .map(|e| e.handle().unwrap().to_string())
        .collect()
}

fn slot_of(ring: &MappedBuffer<u32>, k: u64) -> Region<'_, MappedBuffer<u32>> {
    ring.region(k * FRAME, FRAME).unwrap()
}

/// The consumer: one phase per message, frames numbered on from `base`.
fn consumer() {
    let device = Device::open(0).unwrap();
    share::allow_fd_fetching().unwrap();
    let parent = Parent::new();
    let m = parent.recv().unwrap();
    let full = [
        open_fence(&device, &m["full"]),
        open_fence(&device, &m["full_host"]),
    ];
    let full_events = events_of(&device, &m["full_events"]);
    let ring = share::open::<u32>(
        &device,
        &Descriptor::from_value(&m["ring"]).unwrap(),
        Vec::new(),
    )
    .unwrap();
    let free = [
        Fence::new(&device, SLOTS as u32, None).unwrap(),
        Fence::new_host(&device, SLOTS as u32).unwrap(),
    ];
    let exports = [free[0].export().unwrap(), free[1].export().unwrap()];
    let free_events: Vec<IpcEvent> = (0..SLOTS)
        .map(|_| IpcEvent::new(&device).unwrap())
        .collect();
    let sink = SharedBuffer::alloc(&device, (SLOTS * FRAME) as usize, None).unwrap();
    parent.send(&json!({
        "free": exports[0].block, "free_host": exports[1].block, "free_events": handles(&free_events),
    }));
    let stream = device.stream();
    let consume = |k: u64| {
        sink.region(k * FRAME, FRAME)
            .unwrap()
            .copy_from_device(&slot_of(&ring, k))
            .unwrap();
    };
    while let Some(m) = parent.recv() {
        let (op, base, n) = (
            m["op"].as_str().unwrap().to_string(),
            m["base"].as_u64().unwrap(),
            m["n"].as_u64().unwrap(),
        );
        let (full, free) = if m["host"] == true {
            (&full[1], &free[1])
        } else {
            (&full[0], &free[0])
        };
        let t = Instant::now();
        for i in base + 1..=base + n {
            let k = (i - 1) % SLOTS;
            match op.as_str() {
                "fences" | "unloaded_fences" => {
                    full.wait(stream, k as u32, i).unwrap();
                    consume(k);
                    free.signal(stream, k as u32, i).unwrap();
                }
                "fences_notices" => {
                    assert_eq!(parent.recv().unwrap()["f"], i);
                    full.wait(stream, k as u32, i).unwrap();
                    consume(k);
                    free.signal(stream, k as u32, i).unwrap();
                    parent.send(&json!({ "freed": i }));
                }
                "events_notices" | "unloaded_events" => {
                    assert_eq!(parent.recv().unwrap()["f"], i);
                    full_events[k as usize].wait_on(stream).unwrap();
                    consume(k);
                    free_events[k as usize].record(stream).unwrap();
                    parent.send(&json!({ "freed": i }));
                }
                other => panic!("unknown phase {other}"),
            }
        }
        device.synchronize().unwrap();
        parent.send(&json!({ "done": true, "ms": t.elapsed().as_secs_f64() * 1e3 }));
    }
}

struct Producer<'a> {
    device: &'a Device,
    peer: Peer,
    ring: SharedBuffer,
    /// Device words, then host words.
    full: [Fence; 2],
    full_events: Vec<IpcEvent>,
    /// Device words, then host words.
    free: [FenceMapping; 2],
    free_events: Vec<IpcEvent>,
    base: u64,
}

impl Producer<'_> {
    fn fill(&self, i: u64) {
        let k = (i - 1) % SLOTS;
        let slot = self.ring.region(k * FRAME, FRAME).unwrap();
        kernels::fill_u32(&slot, Pattern::constant(i as u32), Speed::Full).unwrap();
    }

    /// Runs phase `op` of `n` frames with device or host words; returns
    /// the seconds it took.
    fn phase(&mut self, op: &str, n: u64, host: bool) -> f64 {
        let (base, s) = (self.base, self.device.stream().clone());
        self.base += n;
        if op != "floor" {
            self.peer
                .send(&json!({ "op": op, "base": base, "n": n, "host": host }));
        }
        let (full, free) = (&self.full[usize::from(host)], &self.free[usize::from(host)]);
        let t = Instant::now();
        for i in base + 1..=base + n {
            let k = (i - 1) % SLOTS;
            let reuse = i > base + SLOTS;
            match op {
                "floor" => {
                    self.fill(i);
                    full.signal(&s, k as u32, i).unwrap();
                }
                "fences" => {
                    if reuse {
                        free.wait(&s, k as u32, i - SLOTS).unwrap();
                    }
                    self.fill(i);
                    full.signal(&s, k as u32, i).unwrap();
                }
                "fences_notices" => {
                    if reuse {
                        assert_eq!(self.peer.recv()["freed"], i - SLOTS);
                        free.wait(&s, k as u32, i - SLOTS).unwrap();
                    }
                    self.fill(i);
                    full.signal(&s, k as u32, i).unwrap();
                    self.peer.send(&json!({ "f": i }));
                }
                "events_notices" => {
                    if reuse {
                        assert_eq!(self.peer.recv()["freed"], i - SLOTS);
                        self.free_events[k as usize].wait_on(&s).unwrap();
                    }
                    self.fill(i);
                    self.full_events[k as usize].record(&s).unwrap();
                    self.peer.send(&json!({ "f": i }));
                }
                other => panic!("unknown phase {other}"),
            }
        }
        if matches!(op, "fences_notices" | "events_notices") {
            for j in (base + n).saturating_sub(SLOTS).max(base) + 1..=base + n {
                assert_eq!(self.peer.recv()["freed"], j);
            }
        }
        self.device.synchronize().unwrap();
        if op != "floor" {
            assert_eq!(self.peer.recv()["done"], true);
        }
        t.elapsed().as_secs_f64()
    }

    /// One frame at a time; returns the sorted round trips in ms.
    fn unloaded(&mut self, events: bool, host: bool) -> Vec<f64> {
        let (base, s) = (self.base, self.device.stream().clone());
        self.base += UNLOADED;
        let op = if events {
            "unloaded_events"
        } else {
            "unloaded_fences"
        };
        self.peer
            .send(&json!({ "op": op, "base": base, "n": UNLOADED, "host": host }));
        let (full, free) = (&self.full[usize::from(host)], &self.free[usize::from(host)]);
        let mut times = Vec::new();
        for i in base + 1..=base + UNLOADED {
            let k = (i - 1) % SLOTS;
            let t = Instant::now();
            self.fill(i);
            if events {
                self.full_events[k as usize].record(&s).unwrap();
                self.peer.send(&json!({ "f": i }));
                assert_eq!(self.peer.recv()["freed"], i);
                self.free_events[k as usize].synchronize().unwrap();
            } else {
                full.signal(&s, k as u32, i).unwrap();
                assert!(
                    free.wait_host(k as u32, i, Duration::from_secs(10))
                        .unwrap()
                );
            }
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        assert_eq!(self.peer.recv()["done"], true);
        times.sort_by(f64::total_cmp);
        times
    }
}

fn rate(frames: u64, secs: f64) -> String {
    format!(
        "{:.0} frames/s of 4 KiB ({:.2} us/frame)",
        frames as f64 / secs,
        secs / frames as f64 * 1e6
    )
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fences_against_events_4kib_frames() {
    if role().as_deref() == Some("consumer") {
        return consumer();
    }
    let device = Device::open(0).unwrap();
    share::allow_fd_fetching().unwrap();
    let full = [
        Fence::new(&device, SLOTS as u32, None).unwrap(),
        Fence::new_host(&device, SLOTS as u32).unwrap(),
    ];
    let ring = SharedBuffer::alloc(&device, (SLOTS * FRAME) as usize, None).unwrap();
    let full_events: Vec<IpcEvent> = (0..SLOTS)
        .map(|_| IpcEvent::new(&device).unwrap())
        .collect();
    let exports = [full[0].export().unwrap(), full[1].export().unwrap()];
    let re = ring
        .export_region(0, SLOTS * FRAME, Dtype::U32, None)
        .unwrap();
    let mut peer = Peer::spawn(&test_name!("fences_against_events_4kib_frames"), "consumer");
    peer.send(&json!({
        "full": exports[0].block, "full_host": exports[1].block,
        "full_events": handles(&full_events), "ring": re.descriptor.to_value(),
    }));
    let r = peer.recv();
    let free = [
        open_fence(&device, &r["free"]),
        open_fence(&device, &r["free_host"]),
    ];
    let free_events = events_of(&device, &r["free_events"]);
    let mut p = Producer {
        device: &device,
        peer,
        ring,
        full,
        full_events,
        free,
        free_events,
        base: 0,
    };
    println!(
        "fence bench: {SLOTS} slots of 4 KiB, device words shared with {:?}; host words in sealed memfds",
        p.full[0].mechanism()
    );

    // Warm up every path once.
    for host in [false, true] {
        for op in ["floor", "fences", "fences_notices", "events_notices"] {
            p.phase(op, 1000, host);
        }
    }
    for host in [false, true] {
        let words = if host { "host words" } else { "device words" };
        let floor = p.phase("floor", RING_FRAMES, host);
        println!(
            "fence bench: floor with {words} (fill launch + signal, nobody consuming): {}",
            rate(RING_FRAMES, floor)
        );
        let fences = p.phase("fences", RING_FRAMES, host);
        let ratio = fences / floor;
        println!(
            "fence bench: ring with fences ({words}), on the device only: {} = {ratio:.2}x the floor (targets >= 250000 frames/s, <= 1.2x): {}",
            rate(RING_FRAMES, fences),
            if RING_FRAMES as f64 / fences >= 250_000.0 && ratio <= 1.2 {
                "met"
            } else {
                "NOT met"
            }
        );
        let with_notices = p.phase("fences_notices", NOTICE_FRAMES, host);
        println!(
            "fence bench: ring with fences ({words}) + per-frame notices both ways: {}",
            rate(NOTICE_FRAMES, with_notices)
        );
    }
    let events = p.phase("events_notices", NOTICE_FRAMES, false);
    println!(
        "fence bench: ring with IPC events + per-frame notices both ways: {}",
        rate(NOTICE_FRAMES, events)
    );
    for (events, host) in [(false, false), (false, true), (true, false)] {
        let t = p.unloaded(events, host);
        let (median, p99) = (t[t.len() / 2], t[t.len() * 99 / 100]);
        println!(
            "fence bench: unloaded frame with {}: median {median:.4} ms, p99 {p99:.4} ms, from fill launch to the producer seeing the hand-back (target <= 0.02 ms){}",
            match (events, host) {
                (true, _) => "IPC events + notices",
                (false, false) => "fences, device words (host polls with a copy)",
                (false, true) => "fences, host words (host polls memory)",
            },
            if events {
                ""
            } else if median <= 0.02 {
                ": met"
            } else {
                ": NOT met"
            }
        );
    }
    assert!(p.peer.finish(), "the consumer failed");
}
