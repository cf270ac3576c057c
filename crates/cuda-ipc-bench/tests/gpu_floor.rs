//! The driver floor (`cuda_ipc::floor`) the bench measures against, between
//! two real processes on a real GPU: what the producer writes, the consumer
//! reads through the floor's mapping; a view longer than the allocation is
//! refused; closing twice is impossible (the close consumes the mapping).
//!
//! The test binary re-runs itself as the consumer (`GPU_FLOOR_ROLE` set).
//! On a GPU host: `cargo test --release -p cuda-ipc-bench --test gpu_floor
//! -- --ignored --test-threads=1`, or from the bundle built by
//! `scripts/gpu-bundle.sh`: `./tests/gpu_floor --ignored --test-threads=1`.

use std::os::fd::AsFd;
use std::process::Command;

use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::{Device, DeviceMemory, ErrorKind, IpcEvent, LegacyBuffer, channel, floor};

const ROLE: &str = "GPU_FLOOR_ROLE";
const LEN: usize = 4 << 20;
const PATTERN: Pattern = Pattern::ramp(0xF100_0000, 3);

/// Re-runs this binary as the consumer of test `name`, with `env`, and
/// asserts that it succeeded.
fn consumer(name: &str, env: &[(&str, String)]) {
    let exe = std::env::current_exe().expect("our own executable");
    let out = Command::new(exe)
        .args([
            name,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, "consumer")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .expect("start the consumer");
    assert!(
        out.status.success(),
        "the consumer failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn var(key: &str) -> String {
    std::env::var(key).unwrap_or_else(|_| panic!("{key} is not set"))
}

/// Checks every word of `memory` against `PATTERN`.
fn check(memory: &impl DeviceMemory) {
    let words: Vec<u32> = memory.to_vec().expect("read the mapping");
    assert_eq!(words.len(), LEN / 4);
    for (i, w) in words.iter().enumerate() {
        assert_eq!(*w, PATTERN.at(i as u64), "word {i}");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn legacy_floor_hands_a_buffer_over() {
    let device = Device::open(0).expect("device 0");
    if std::env::var_os(ROLE).is_some() {
        let event = IpcEvent::open(&device, var("EVENT").parse().unwrap()).unwrap();
        let handle = var("HANDLE").parse().unwrap();
        let opened = floor::open_legacy(&device, &handle, &event).unwrap();
        assert_ne!(opened.device_address(), 0);
        check(&opened.memory(LEN).unwrap());
        let e = opened.memory(usize::MAX / 2).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
        opened.close().unwrap();
        return;
    }
    let buffer = LegacyBuffer::alloc(&device, LEN).unwrap();
    kernels::fill_u32(&buffer, PATTERN, Speed::Full).unwrap();
    buffer.synchronize().unwrap();
    let event = IpcEvent::new(&device).unwrap();
    let handle = floor::export_legacy(&buffer, &event, device.stream()).unwrap();
    consumer(
        "legacy_floor_hands_a_buffer_over",
        &[
            ("EVENT", event.handle().unwrap().to_string()),
            ("HANDLE", handle.to_string()),
        ],
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn vmm_floor_hands_a_buffer_over() {
    let device = Device::open(0).expect("device 0");
    if std::env::var_os(ROLE).is_some() {
        let event = IpcEvent::open(&device, var("EVENT").parse().unwrap()).unwrap();
        let client =
            channel::Client::connect(var("SOCKET"), channel::ClientConfig::default()).unwrap();
        let size: u64 = var("SIZE").parse().unwrap();
        let granularity =
            cuda_ipc::vmm::granularity(&device, cuda_ipc::vmm::ShareableTypes::FD).unwrap();
        let a = client.attach("floor").unwrap();
        let ordinal = device.ordinal() as i32;
        let mapped = floor::import_vmm(
            &device,
            a.fds[0].as_fd(),
            size,
            granularity,
            &[ordinal],
            &event,
        )
        .unwrap();
        assert_eq!(mapped.size(), size);
        check(&mapped.memory(LEN).unwrap());
        let e = mapped.memory(size as usize + 4).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
        mapped.unmap().unwrap();
        // More than the allocation: the driver refuses the map, and the
        // floor's error names the call.
        let e = floor::import_vmm(
            &device,
            a.fds[0].as_fd(),
            size * 4,
            granularity,
            &[ordinal],
            &event,
        )
        .unwrap_err();
        assert!(e.to_string().starts_with("cuMem"), "{e}");
        drop(a.fds);
        client.release(a.lease).unwrap();
        return;
    }
    let buffer = cuda_ipc::vmm::VmmBuffer::alloc(&device, LEN).unwrap();
    kernels::fill_u32(&buffer, PATTERN, Speed::Full).unwrap();
    buffer.synchronize().unwrap();
    let event = IpcEvent::new(&device).unwrap();
    let fd = floor::export_vmm(&buffer, &event, device.stream()).unwrap();
    let dir = tempfile_dir();
    let path = dir.join("floor.sock");
    let server = channel::Server::bind(channel::ServerConfig::new(&path)).unwrap();
    server
        .publish("floor", serde_json::json!({}), vec![fd])
        .unwrap();
    consumer(
        "vmm_floor_hands_a_buffer_over",
        &[
            ("EVENT", event.handle().unwrap().to_string()),
            ("SOCKET", path.display().to_string()),
            ("SIZE", buffer.alloc_size().to_string()),
        ],
    );
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A fresh folder for the socket.
fn tempfile_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("cuda-ipc-gpu-floor-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
