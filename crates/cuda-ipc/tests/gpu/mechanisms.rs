//! Every mechanism across processes, both ways, at several sizes, with
//! offsets and events; fabric handles; a pool allocation freed while mapped;
//! and no leak over many export/import cycles.

use std::time::Instant;

use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::share::{self, SharedBuffer};
use cuda_ipc::{Device, DeviceMemory, Dtype, Error, ErrorKind, IpcEvent, Mechanism};
use serde_json::json;

use super::common::{Peer, free_memory, open_fds};
use super::consumer::{self, pattern_json};
use crate::{assert_ok, test_name};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn child_or(f: impl FnOnce()) {
    super::common::child_or("consumer", consumer::serve, f);
}

/// Parent exports `size` bytes at `offset` with `m`; the child maps, checks,
/// transforms; the parent checks the transform.
fn parent_to_child(device: &Device, peer: &mut Peer, m: Mechanism, size: u64, offset: u64) -> f64 {
    let buf = SharedBuffer::alloc(device, (offset + size) as usize, Some(m)).unwrap();
    assert_eq!(buf.mechanism(), m);
    let region = buf.region(offset, size).unwrap();
    let p = Pattern::ramp((size >> 20) as u32, 7);
    kernels::fill_u32(&region, p, Speed::Full).unwrap();
    let ready = IpcEvent::new(device).unwrap();
    ready.record(buf.stream()).unwrap();
    let mut e = buf.export_region(offset, size, Dtype::U32, None).unwrap();
    e.descriptor.event = Some(ready.handle().unwrap());
    peer.send(&json!({ "op": "open", "descriptor": e.descriptor.to_value(), "expect": pattern_json(p), "transform": [3, 1] }));
    let r = peer.recv();
    assert_ok!(&r, "{m} {size}@{offset}: child saw wrong data: {r}");
    let done = IpcEvent::open(device, r["event"].as_str().unwrap().parse().unwrap()).unwrap();
    done.wait_on(buf.stream()).unwrap();
    assert_eq!(
        kernels::check_u32(&region, p.mapped(3, 1)).unwrap(),
        None,
        "{m} {size}@{offset}: parent saw wrong data"
    );
    peer.send(&json!({ "op": "close" }));
    assert_eq!(peer.recv()["closed"], 1);
    r["open_ms"].as_f64().unwrap()
}

/// The child exports; the parent maps, checks, transforms; the child checks.
fn child_to_parent(device: &Device, peer: &mut Peer, m: Mechanism, size: u64, offset: u64) {
    let p = Pattern::ramp(0xBEEF, 3);
    peer.send(&json!({ "op": "export", "mechanism": m.name(), "size": size, "offset": offset, "pattern": pattern_json(p) }));
    let r = peer.recv();
    let d = cuda_ipc::Descriptor::from_value(&r["descriptor"]).unwrap();
    assert_eq!(d.mechanism(), m);
    let buf = share::open::<u32>(device, &d, Vec::new()).unwrap();
    assert_eq!(buf.len() as u64, size / 4);
    assert_eq!(
        kernels::check_u32(&buf, p).unwrap(),
        None,
        "{m} {size}@{offset}: parent saw child's data wrong"
    );
    kernels::map_u32(&buf, 5, 5).unwrap();
    let done = IpcEvent::new(device).unwrap();
    done.record(buf.stream()).unwrap();
    peer.send(&json!({ "op": "check_export", "event": done.handle().unwrap().to_string(), "offset": offset, "size": size, "expect": pattern_json(p.mapped(5, 5)) }));
    let r = peer.recv();
    assert_ok!(&r, "{m} {size}@{offset}: child saw parent's writes wrong");
}

/// Legacy, VMM and pool, both ways, 2 MiB to 8 GiB, at offsets.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn every_mechanism_both_ways_at_every_size() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        share::allow_fd_fetching().unwrap();
        let mut peer = Peer::spawn(
            &test_name!("every_mechanism_both_ways_at_every_size"),
            "consumer",
        );
        for m in [Mechanism::Legacy, Mechanism::Vmm, Mechanism::Pool] {
            for (size, offset) in [
                (2 * MIB, 0),
                (64 * MIB, 4096),
                (GIB, MIB + 256),
                (8 * GIB, 2 * MIB),
            ] {
                if m == Mechanism::Pool && offset + size > cuda_ipc::pool::MAX_SHARED_ALLOCATION {
                    let e = SharedBuffer::alloc(&device, (offset + size) as usize, Some(m))
                        .unwrap_err();
                    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
                    assert!(e.to_string().contains("vmm mechanism"), "{e}");
                    println!("{m:>6} {:>5} MiB: refused as documented: {e}", size / MIB);
                    continue;
                }
                let open_ms = parent_to_child(&device, &mut peer, m, size, offset);
                println!(
                    "{m:>6} {:>5} MiB at offset {offset:>8}: child's open {open_ms:.3} ms",
                    size / MIB
                );
            }
            for (size, offset) in [(2 * MIB, 0), (GIB, 4096)] {
                child_to_parent(&device, &mut peer, m, size, offset);
            }
        }
        peer.send(&json!({ "op": "exit" }));
        assert!(peer.finish());
    });
}

/// Fabric handles: on a machine with IMEX they must round-trip; without it
/// the error must say why (the H200 test machine has no IMEX channel).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fabric_works_or_says_why() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        match SharedBuffer::alloc(&device, 2 * MIB as usize, Some(Mechanism::Fabric)) {
            Ok(_) => {
                let mut peer = Peer::spawn(&test_name!("fabric_works_or_says_why"), "consumer");
                parent_to_child(&device, &mut peer, Mechanism::Fabric, 2 * MIB, 0);
                peer.send(&json!({ "op": "exit" }));
                assert!(peer.finish());
                println!("fabric handles work here");
            }
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
                let text = e.to_string();
                assert!(text.contains("IMEX") || text.contains("fabric"), "{text}");
                println!("fabric handles unavailable, as reported: {text}");
            }
        }
    });
}

/// What happens when the exporter frees a pool allocation while a consumer
/// still maps it: the consumer must not crash, and keeps getting answers.
/// (The driver keeps the physical memory alive for the importer, or the
/// consumer reads reused memory: this test reports which.)
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn pool_allocation_freed_while_mapped() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        share::allow_fd_fetching().unwrap();
        let mut peer = Peer::spawn(
            &test_name!("pool_allocation_freed_while_mapped"),
            "consumer",
        );
        let pool = cuda_ipc::pool::SharedPool::new(&device).unwrap();
        let buf = SharedBuffer::alloc_in_pool(&pool, 64 * MIB as usize).unwrap();
        let p = Pattern::ramp(1, 1);
        kernels::fill_u32(&buf, p, Speed::Full).unwrap();
        buf.synchronize().unwrap();
        let e = buf.export_region(0, 64 * MIB, Dtype::U32, None).unwrap();
        peer.send(&json!({ "op": "open", "descriptor": e.descriptor.to_value(), "expect": pattern_json(p) }));
        assert_ok!(&peer.recv());
        drop(e);
        drop(buf);
        device.synchronize().unwrap();
        // Reuse the pool's memory for something else.
        let other = SharedBuffer::alloc_in_pool(&pool, 64 * MIB as usize).unwrap();
        kernels::fill_u32(&other, Pattern::constant(0xDEAD_BEEF), Speed::Full).unwrap();
        other.synchronize().unwrap();
        peer.send(&json!({ "op": "recheck" }));
        let r = peer.recv();
        println!("consumer's view after the exporter freed the allocation: {r}");
        assert!(r["results"].is_array(), "the consumer answered");
        peer.send(&json!({ "op": "close" }));
        let _ = peer.recv();
        peer.send(&json!({ "op": "exit" }));
        assert!(peer.finish(), "the consumer crashed");
    });
}

/// 1,000 export/import cycles of each mechanism: device memory and open
/// file descriptors are the same before and after.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn no_leak_over_a_thousand_cycles() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        share::allow_fd_fetching().unwrap();
        let mut peer = Peer::spawn(&test_name!("no_leak_over_a_thousand_cycles"), "consumer");
        for m in [Mechanism::Legacy, Mechanism::Vmm, Mechanism::Pool] {
            // Warm up: first allocations grow driver-internal pools.
            for _ in 0..10 {
                cycle(&device, &mut peer, m);
            }
            device.synchronize().unwrap();
            let (mem_before, fds_before) = (free_memory(&device), open_fds());
            let t = Instant::now();
            for _ in 0..1000 {
                cycle(&device, &mut peer, m);
            }
            device.synchronize().unwrap();
            let (mem_after, fds_after) = (free_memory(&device), open_fds());
            println!(
                "{m}: 1000 cycles in {:.0} ms; free memory {} -> {} bytes, open fds {fds_before} -> {fds_after}",
                t.elapsed().as_secs_f64() * 1e3,
                mem_before,
                mem_after
            );
            assert_eq!(fds_before, fds_after, "{m} leaked file descriptors");
            assert!(
                mem_after + 4 * MIB >= mem_before,
                "{m} leaked device memory: {mem_before} -> {mem_after}"
            );
        }
        peer.send(&json!({ "op": "exit" }));
        assert!(peer.finish());
    });
}

fn cycle(device: &Device, peer: &mut Peer, m: Mechanism) {
    let buf = SharedBuffer::alloc(device, 2 * MIB as usize, Some(m)).unwrap();
    let p = Pattern::constant(0x0C0C_0C0C);
    kernels::fill_u32(&buf, p, Speed::Full).unwrap();
    buf.synchronize().unwrap();
    let e = buf.export_region(0, 2 * MIB, Dtype::U32, None).unwrap();
    peer.send(
        &json!({ "op": "open", "descriptor": e.descriptor.to_value(), "expect": pattern_json(p) }),
    );
    assert_ok!(&peer.recv());
    peer.send(&json!({ "op": "close" }));
    assert_eq!(peer.recv()["closed"], 1);
}

/// An export that asks for a mechanism the device lacks, or a bad size, is a
/// clear error (and no driver state is left behind).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn bad_requests_are_clear_errors() {
    let device = Device::open(0).unwrap();
    let e = SharedBuffer::alloc(&device, 0, Some(Mechanism::Vmm)).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    let buf = SharedBuffer::alloc(&device, 4096, Some(Mechanism::Vmm)).unwrap();
    let e = buf.export_region(4000, 200, Dtype::U8, None).unwrap_err();
    assert!(matches!(e, Error::OutOfBounds { .. }), "{e}");
    let e = buf.export_region(2, 8, Dtype::U32, None).unwrap_err();
    assert!(e.to_string().contains("offset"), "{e}");
}
