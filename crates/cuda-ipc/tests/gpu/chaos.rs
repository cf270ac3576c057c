//! Chaos and bad input with real mappings: subscribers killed with SIGKILL
//! at random points while they attach, map, check and release buffers of
//! every mechanism; and file descriptors and export data that are not what
//! they claim, for the fd mechanisms.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use cuda_ipc::descriptor::Source;
use cuda_ipc::exchange::{Publisher, PublisherConfig, Subscriber, SubscriberConfig};
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::share::{self, SharedBuffer};
use cuda_ipc::{Descriptor, Device, Dtype, Mechanism, PoolPtrHandle};
use serde_json::{Value, json};

use super::common::{Parent, Peer, free_memory, open_fds, role};
use crate::test_name;

const MIB: usize = 1 << 20;
const SOCKET_ENV: &str = "CUDA_IPC_TEST_SOCKET";
const NAMES: [&str; 3] = ["chaos-vmm", "chaos-pool", "chaos-legacy"];

/// The victim: attaches, checks and releases every buffer, for ever.
fn victim() {
    let device = Device::open(0).unwrap();
    let socket = PathBuf::from(std::env::var(SOCKET_ENV).unwrap());
    let sub = Subscriber::connect(&device, socket.as_path(), SubscriberConfig::default()).unwrap();
    Parent::new().send(&json!({ "ready": true }));
    let mut held = Vec::new();
    loop {
        for (k, name) in NAMES.iter().enumerate() {
            let a = sub.attach::<u32>(name).unwrap();
            assert_eq!(
                kernels::check_u32(a.buffer(), Pattern::constant(k as u32 + 1)).unwrap(),
                None
            );
            if k == 1 {
                // Keep some leases over the loop, so kills find leases held too.
                held.push(a);
            } else {
                sub.release(a).unwrap();
            }
        }
    }
}

/// 40 subscriber processes (`CUDA_IPC_CHAOS_ROUNDS` to change) killed at
/// random points: after each, every lease is released within a second; at
/// the end device memory and the publisher's descriptors are as before.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn subscribers_killed_at_random_points() {
    if role().as_deref() == Some("victim") {
        return victim();
    }
    let device = Device::open(0).unwrap();
    let dir = tempfile::Builder::new()
        .prefix("cuda-ipc-chaos")
        .tempdir()
        .unwrap();
    let socket = dir.path().join("chaos.sock");
    let publisher = Publisher::bind(&device, socket.as_path(), PublisherConfig::default()).unwrap();
    for (k, (name, m)) in NAMES
        .iter()
        .zip([Mechanism::Vmm, Mechanism::Pool, Mechanism::Legacy])
        .enumerate()
    {
        let b = SharedBuffer::alloc(&device, 8 * MIB, Some(m)).unwrap();
        kernels::fill_u32(&b, Pattern::constant(k as u32 + 1), Speed::Full).unwrap();
        publisher.publish(name, b, Dtype::U32, None).unwrap();
    }
    device.synchronize().unwrap();
    let (mem, fds) = (free_memory(&device), open_fds());
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    println!("seed {seed:#x}");
    let rounds: u32 = std::env::var("CUDA_IPC_CHAOS_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40);
    let mut held_at_kill = 0;
    for round in 0..rounds {
        let peer = Peer::spawn_with(
            &test_name!("subscribers_killed_at_random_points"),
            "victim",
            |c| {
                c.env(SOCKET_ENV, &socket);
            },
        );
        assert_eq!(peer.recv()["ready"], true, "round {round}");
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        std::thread::sleep(Duration::from_micros(seed % 20_000));
        held_at_kill += publisher.leases().len();
        peer.kill();
        let t = Instant::now();
        for name in NAMES {
            publisher
                .server()
                .wait_released(name, Some(Duration::from_secs(1)))
                .unwrap_or_else(|e| {
                    panic!("round {round}: a lease on {name} outlived its process by a second: {e}")
                });
        }
        assert!(t.elapsed() < Duration::from_secs(1));
    }
    device.synchronize().unwrap();
    // The last leases are released before the server has closed the dead
    // subscribers' sockets: give it a moment to, within bounds.
    let deadline = Instant::now() + Duration::from_secs(5);
    while open_fds() > fds && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let (mem2, fds2) = (free_memory(&device), open_fds());
    println!(
        "chaos: {rounds} subscribers killed holding {held_at_kill} leases in all; free memory {mem} -> {mem2}, fds {fds} -> {fds2}"
    );
    assert_eq!(fds, fds2, "the publisher leaked descriptors");
    assert!(
        mem2 + 4 * MIB as u64 >= mem,
        "device memory leaked: {mem} -> {mem2}"
    );
    assert!(
        held_at_kill > 0,
        "no kill found a lease held: the test did not test"
    );
}

/// The consumer side of the bad-input test: every open must fail cleanly.
fn bad_opener() {
    let parent = Parent::new();
    let device = Device::open(0).unwrap();
    while let Some(req) = parent.recv() {
        if req["op"] == "exit" {
            break;
        }
        let d = Descriptor::from_value(&req["descriptor"]).unwrap();
        let fds = if req["memfd"] == true {
            let fd = rustix::fs::memfd_create("not-cuda", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
            rustix::fs::ftruncate(&fd, 64 << 20).unwrap();
            vec![fd]
        } else {
            Vec::new()
        };
        let answer = match share::open_mapping(&device, &d, fds, cuda_ipc::Access::ReadWrite) {
            Ok(m) => json!({ "opened": m.size() }),
            Err(e) => json!({ "error": e.to_string() }),
        };
        parent.send(&answer);
    }
}

/// For the fd mechanisms: a memfd passed off as a VMM or pool descriptor,
/// a wrong allocation size, random pointer export data, a closed fd
/// number. Each is an error in the consumer, which keeps working.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn bad_descriptors_of_fd_mechanisms_are_errors() {
    if role().as_deref() == Some("bad") {
        return bad_opener();
    }
    let device = Device::open(0).unwrap();
    share::allow_fd_fetching().unwrap();
    let vmm = SharedBuffer::alloc(&device, 4 * MIB, Some(Mechanism::Vmm)).unwrap();
    let pool = SharedBuffer::alloc(&device, 4 * MIB, Some(Mechanism::Pool)).unwrap();
    let ve = vmm.export().unwrap();
    let pe = pool.export().unwrap();
    let mut peer = Peer::spawn(
        &test_name!("bad_descriptors_of_fd_mechanisms_are_errors"),
        "bad",
    );
    let mut random = [0u8; 64];
    for (i, b) in random.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(151).wrapping_add(7);
    }
    let cases: Vec<(&str, Descriptor, bool)> = vec![
        ("a memfd as a VMM allocation", ve.descriptor.clone(), true),
        ("a memfd as a memory pool", pe.descriptor.clone(), true),
        (
            "a VMM allocation twice its size",
            {
                let mut d = ve.descriptor.clone();
                d.alloc_size = 8 * MIB as u64;
                d
            },
            false,
        ),
        (
            "a VMM allocation of a size off the granularity",
            {
                let mut d = ve.descriptor.clone();
                d.alloc_size = 3 * MIB as u64;
                d.byte_len = MIB as u64;
                d
            },
            false,
        ),
        (
            "random pointer export data in a real pool",
            {
                let mut d = pe.descriptor.clone();
                d.source = Source::Pool {
                    fd: match pe.descriptor.source {
                        Source::Pool { fd, .. } => fd,
                        _ => unreachable!(),
                    },
                    ptr: PoolPtrHandle::from(random),
                };
                d
            },
            false,
        ),
        (
            "an fd number the exporter does not have",
            {
                let mut d = ve.descriptor.clone();
                d.source = Source::Vmm { fd: 987_654 };
                d
            },
            false,
        ),
    ];
    for (what, d, memfd) in &cases {
        peer.send(&json!({ "op": "open", "descriptor": d.to_value(), "memfd": memfd }));
        let r = peer.recv();
        let e = r["error"]
            .as_str()
            .unwrap_or_else(|| panic!("{what}: opened instead of failing: {r}"));
        println!("{what}: {e}");
    }
    // The consumer still works: a good descriptor opens.
    peer.send(&json!({ "op": "open", "descriptor": ve.descriptor.to_value(), "memfd": false }));
    let r: Value = peer.recv();
    assert_eq!(r["opened"], 4 * MIB, "{r}");
    peer.send(&json!({ "op": "exit" }));
    assert!(peer.finish(), "the consumer crashed");
}
