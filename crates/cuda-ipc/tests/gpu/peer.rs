//! Two GPUs: memory exported on GPU 0 and mapped by a process whose
//! context is on GPU 1 (peer mappings), for legacy handles (with
//! LAZY_ENABLE_PEER_ACCESS), VMM file descriptors (access granted to GPU 1)
//! and pool pointers; events across devices; the error without the flag;
//! and the bandwidth of a copy out of a peer mapping against cuMemcpyPeer.
//!
//! On a machine with one GPU these tests say so and pass without running:
//! they need `nvidia-h200-x2` or any host with two peer-capable GPUs.

use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::share::{self, SharedBuffer};
use cuda_ipc::{Descriptor, Device, DeviceMemory, Dtype, IpcEvent, LegacyBuffer, Mechanism};
use serde_json::{Value, json};

use super::common::{Peer, role};
use super::consumer;
use crate::{assert_ok, test_name};

const MIB: usize = 1 << 20;

/// Two devices, or a printed reason why the test cannot run here.
fn two_devices() -> Option<Device> {
    let n = cuda_ipc::driver::device_count().unwrap();
    if n < 2 {
        println!("SKIPPED: {n} GPU(s) here; peer mappings need two");
        return None;
    }
    let link = cuda_ipc::device::peer_link(1, 0).unwrap();
    println!("GPU 1 -> GPU 0: {link:?}");
    assert!(link.access_supported, "GPU 1 cannot access GPU 0: {link:?}");
    Some(Device::open(0).unwrap())
}

fn spawn_on_gpu1(test: &str) -> Peer {
    Peer::spawn_with(test, "consumer", |c| {
        c.env("CUDA_IPC_TEST_DEVICE", "1");
    })
}

/// Every mechanism, exported on GPU 0 and mapped on GPU 1: the consumer
/// checks and transforms with a kernel on GPU 1, records an event there; the
/// producer waits on it on GPU 0 and checks.
#[test]
#[ignore = "needs two NVIDIA GPUs"]
fn peer_mappings_every_mechanism() {
    if role().is_some() {
        return consumer::serve();
    }
    let Some(device) = two_devices() else { return };
    share::allow_fd_fetching().unwrap();
    let mut peer = spawn_on_gpu1(&test_name!("peer_mappings_every_mechanism"));
    for m in [Mechanism::Legacy, Mechanism::Vmm, Mechanism::Pool] {
        let buf = SharedBuffer::alloc(&device, 64 * MIB, Some(m)).unwrap();
        let p = Pattern::ramp(m as u32 * 1000, 3);
        kernels::fill_u32(&buf, p, Speed::Full).unwrap();
        let ready = IpcEvent::new(&device).unwrap();
        ready.record(buf.stream()).unwrap();
        let mut e = buf
            .export_region(4096, 32 * MIB as u64, Dtype::U32, None)
            .unwrap();
        e.descriptor.event = Some(ready.handle().unwrap());
        let expect = p.skip(1024);
        peer.send(
            &json!({ "op": "open", "descriptor": e.descriptor.to_value(),
                           "expect": consumer::pattern_json(expect), "transform": [2, 9] }),
        );
        let r = peer.recv();
        assert_ok!(&r, "{m} on GPU 1");
        let done = IpcEvent::open(&device, r["event"].as_str().unwrap().parse().unwrap()).unwrap();
        done.wait_on(buf.stream()).unwrap();
        let region = buf.region(4096, 32 * MIB as u64).unwrap();
        assert_eq!(
            kernels::check_u32(&region, expect.mapped(2, 9)).unwrap(),
            None,
            "{m}: GPU 0 saw GPU 1's writes wrong"
        );
        peer.send(&json!({ "op": "close" }));
        assert_eq!(peer.recv()["closed"], 1);
        println!(
            "{m}: GPU 1 mapped GPU 0's memory, open {:.3} ms, both directions checked",
            r["open_ms"].as_f64().unwrap()
        );
    }
    peer.send(&json!({ "op": "exit" }));
    assert!(peer.finish());
}

/// Without LAZY_ENABLE_PEER_ACCESS the open fails, and says which flag fixes it.
#[test]
#[ignore = "needs two NVIDIA GPUs"]
fn peer_open_without_the_flag_says_which_flag() {
    if role().is_some() {
        return consumer::serve();
    }
    let Some(device) = two_devices() else { return };
    let buf = LegacyBuffer::alloc(&device, 2 * MIB).unwrap();
    let mut peer = spawn_on_gpu1(&test_name!("peer_open_without_the_flag_says_which_flag"));
    peer.send(
        &json!({ "op": "open_without_flag", "handle": buf.export().unwrap().handle.to_string() }),
    );
    let r = peer.recv();
    let text = r["error"]
        .as_str()
        .expect("the open without the flag must fail");
    assert!(text.contains("LAZY_ENABLE_PEER_ACCESS"), "{text}");
    peer.send(&json!({ "op": "exit" }));
    assert!(peer.finish());
}

/// A copy out of a peer mapping into GPU 1's memory against cuMemcpyPeer
/// between the same devices, timed with CUDA events in the consumer.
#[test]
#[ignore = "needs two NVIDIA GPUs"]
fn peer_bandwidth_against_memcpy_peer() {
    if role().is_some() {
        return consumer::serve();
    }
    let Some(device) = two_devices() else { return };
    share::allow_fd_fetching().unwrap();
    let mut peer = spawn_on_gpu1(&test_name!("peer_bandwidth_against_memcpy_peer"));
    for m in [Mechanism::Legacy, Mechanism::Vmm] {
        let buf = SharedBuffer::alloc(&device, 1 << 30, Some(m)).unwrap();
        kernels::fill_u32(&buf, Pattern::ramp(0, 1), Speed::Full).unwrap();
        buf.synchronize().unwrap();
        let e = buf.export_region(0, 1 << 30, Dtype::U32, None).unwrap();
        peer.send(&json!({ "op": "peer_bandwidth", "descriptor": e.descriptor.to_value() }));
        let r = peer.recv();
        assert!(r.get("error").is_none(), "{m}: {r}");
        let (mapped, memcpy_peer) = (
            r["mapping_gbps"].as_f64().unwrap(),
            r["memcpy_peer_gbps"].as_f64().unwrap(),
        );
        println!(
            "{m}: GPU 0 -> GPU 1, 1 GiB: copy out of a peer mapping {mapped:.0} GB/s, cuMemcpyPeer {memcpy_peer:.0} GB/s, ratio {:.3}",
            mapped / memcpy_peer
        );
        assert!(mapped > 0.0 && memcpy_peer > 0.0);
        assert_eq!(r["checked"], true, "{m}: the copied data differ: {r}");
    }
    peer.send(&json!({ "op": "exit" }));
    assert!(peer.finish());
}

/// In the consumer (GPU 1): times copies of the mapped bytes into GPU 1's
/// memory, and cuMemcpyPeer of a GPU 0 buffer of the same size into it.
pub fn bandwidth(device: &Device, d: &Descriptor) -> Value {
    let run = || -> Result<Value, cuda_ipc::Error> {
        let mapped = share::open::<u32>(device, d, Vec::new())?;
        let local = LegacyBuffer::alloc(device, mapped.byte_len())?;
        let gpu0 = Device::open(0)?;
        // cuMemcpyPeer at its best: peer access enabled from GPU 1 to GPU 0
        // (twice: the second call must be harmless).
        device.enable_peer_access(&gpu0)?;
        device.enable_peer_access(&gpu0)?;
        let remote = LegacyBuffer::alloc(&gpu0, mapped.byte_len())?;
        remote.copy_from_device(&mapped)?;
        remote.synchronize()?;
        let time = |f: &dyn Fn() -> Result<(), cuda_ipc::Error>| -> Result<f64, cuda_ipc::Error> {
            let ctx = device.context();
            let flags = Some(cuda_ipc::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
            let err = |e| cuda_ipc::Error::Io {
                context: "a timing event".into(),
                source: std::io::Error::other(format!("{e:?}")),
            };
            let (start, end) = (
                ctx.new_event(flags).map_err(err)?,
                ctx.new_event(flags).map_err(err)?,
            );
            f()?;
            local.synchronize()?;
            start.record(local.stream()).map_err(err)?;
            for _ in 0..10 {
                f()?;
            }
            end.record(local.stream()).map_err(err)?;
            end.synchronize().map_err(err)?;
            let ms = start.elapsed_ms(&end).map_err(err)?;
            Ok(10.0 * 2.0 * local.byte_len() as f64 / (f64::from(ms) * 1e-3) / 1e9)
        };
        let mapping_gbps = time(&|| local.copy_from_device(&mapped))?;
        let memcpy_peer_gbps = time(&|| local.copy_from_peer(&remote))?;
        local.copy_from_device(&mapped)?;
        let checked = kernels::check_u32(&local, Pattern::ramp(0, 1))?.is_none();
        Ok(
            json!({ "mapping_gbps": mapping_gbps, "memcpy_peer_gbps": memcpy_peer_gbps, "checked": checked }),
        )
    };
    run().unwrap_or_else(|e| json!({ "error": e.to_string() }))
}

/// Peer access is between two devices: asking a device for access to
/// itself is refused with an error that says so (runs on one GPU too).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn peer_access_to_itself_is_refused() {
    let d = Device::open(0).unwrap();
    let e = d.enable_peer_access(&d.clone()).unwrap_err();
    assert_eq!(e.kind(), cuda_ipc::ErrorKind::InvalidInput, "{e}");
    assert!(e.to_string().contains("two different devices"), "{e}");
}
