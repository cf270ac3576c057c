//! The premise of a weight service whose weights outlive its own crash: a
//! VMM allocation lives as long as any process holds its exported file
//! descriptor, even a process with no CUDA context, after the process that
//! made it was killed. The design of a keeper rests on this; it is checked
//! here on the device.

use std::os::fd::AsRawFd;

use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::vmm::{VmmBuffer, VmmMapping};
use cuda_ipc::{Device, MappedBuffer, share};
use serde_json::json;

use super::common::{Parent, Peer, free_memory, role};
use crate::test_name;

/// The allocation's size: a model's worth would do the same; 1 GiB shows in
/// the device's free memory beyond any context's noise.
const LEN: u64 = 1 << 30;

/// The slack allowed between two readings of the device's free memory
/// from different processes (their contexts differ a little).
const SLACK: u64 = 256 << 20;

/// What the exporter writes and the importer checks.
const PATTERN: Pattern = Pattern::ramp(7, 3);

/// Makes the allocation, fills it, exports it, lets the parent take the
/// descriptor, and waits to be killed.
fn exporter() {
    let parent = Parent::new();
    let device = Device::open(0).expect("open device 0");
    let free_before = free_memory(&device);
    let buf = VmmBuffer::alloc(&device, LEN as usize).expect("allocate");
    kernels::fill_u32(&buf, PATTERN, Speed::Full).expect("fill");
    device.synchronize().expect("synchronize");
    let fd = buf.export_fd().expect("export");
    let _fetcher =
        share::allow_fd_fetching_by(std::os::unix::process::parent_id()).expect("allow the parent");
    parent.send(&json!({
        "pid": std::process::id(),
        "fd": fd.as_raw_fd(),
        "free_before": free_before,
        "free_allocated": free_memory(&device),
    }));
    // Killed here, holding the allocation, the export and a context.
    while parent.recv().is_some() {}
}

/// Reports the device's free memory; with a descriptor to fetch, imports
/// the allocation through it and checks every word first.
fn importer() {
    let parent = Parent::new();
    let req = parent.recv().expect("a request");
    let device = Device::open(0).expect("open device 0");
    let free_now = free_memory(&device);
    if req["fd"].is_null() {
        parent.send(&json!({ "free": free_now }));
        return;
    }
    let fd = share::fetch_fd(
        req["pid"].as_u64().unwrap() as u32,
        req["fd"].as_i64().unwrap() as i32,
    )
    .expect("take the keeper's descriptor");
    let mapping = VmmMapping::import_fd(&device, fd, LEN).expect("import");
    let buf = MappedBuffer::<u32>::new(mapping, 0, (LEN / 4) as usize).expect("view");
    let bad = kernels::check_u32(&buf, PATTERN).expect("check");
    drop(buf);
    parent.send(&json!({ "free": free_now, "bad": bad }));
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_vmm_allocation_outlives_its_killed_exporter_while_a_process_without_cuda_holds_its_fd() {
    match role().as_deref() {
        Some("exporter") => return exporter(),
        Some("importer") => return importer(),
        Some(other) => panic!("unknown role {other}"),
        None => {}
    }
    // This process is the keeper: it never loads the driver.
    let test = test_name!(
        "a_vmm_allocation_outlives_its_killed_exporter_while_a_process_without_cuda_holds_its_fd"
    );
    let exporter = Peer::spawn(&test, "exporter");
    let made = exporter.recv();
    let free_before = made["free_before"].as_u64().unwrap();
    let free_allocated = made["free_allocated"].as_u64().unwrap();
    assert!(
        free_before - free_allocated >= LEN,
        "the allocation does not show in free memory: {made}"
    );
    let held = share::fetch_fd(
        made["pid"].as_u64().unwrap() as u32,
        made["fd"].as_i64().unwrap() as i32,
    )
    .expect("the keeper takes the descriptor with pidfd_getfd");
    exporter.kill(); // SIGKILL, then reaped

    let mut importer = Peer::spawn(&test, "importer");
    let _fetcher = share::allow_fd_fetching_by(importer.pid()).expect("allow the importer");
    importer.send(&json!({ "pid": std::process::id(), "fd": held.as_raw_fd() }));
    let read = importer.recv();
    assert!(importer.finish(), "the importer failed");
    assert!(
        read["bad"].is_null(),
        "a word of the allocation changed after its exporter died: {read}"
    );
    let free_held = read["free"].as_u64().unwrap();
    assert!(
        free_held + LEN <= free_before + SLACK,
        "the allocation did not stay while only the keeper held it: {free_held} bytes free, \
         {free_before} before it was made"
    );

    drop(held);
    let mut prober = Peer::spawn(&test, "importer");
    prober.send(&json!({ "fd": null }));
    let after = prober.recv()["free"].as_u64().unwrap();
    assert!(prober.finish(), "the prober failed");
    assert!(
        after + SLACK >= free_before,
        "the allocation stayed after the keeper let go: {after} bytes free, {free_before} before"
    );
    println!(
        "1 GiB kept by a process without CUDA after its exporter's SIGKILL: free {} MiB before, \
         {} MiB while kept, {} MiB after; every word read back",
        free_before >> 20,
        free_held >> 20,
        after >> 20
    );
}
