//! The weight service's limits on a real device: a shutdown during a long
//! load returns within two seconds; a set dropped with `force` while a
//! reader child holds it stays counted against that reader's uid until it
//! lets go; without a quota given, a uid other than the service's may hold
//! a quarter of the device, and a sparse file larger than that is refused
//! before anything is read or allocated.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cuda_ipc::Device;
use cuda_ipc::channel::{Client, ClientConfig};
use cuda_ipc::exchange::{Subscriber, SubscriberConfig};
use cuda_ipc::service::admin::{self, DropRequest, LoadRequest};
use cuda_ipc::service::{Quotas, Service, ServiceConfig};
use serde_json::json;

use super::common::{Parent, Peer, role};
use crate::{assert_ok, test_name};

const SOCKET_ENV: &str = "CUDA_IPC_TEST_LIMITS_SOCKET";
const SET: &str = "held";

/// A checkpoint of `tensors` U8 tensors of `each` bytes, all a hole (a
/// sparse file: nothing on disk, zeros when read).
fn sparse(path: &Path, tensors: u64, each: u64) {
    let map: serde_json::Map<String, serde_json::Value> = (0..tensors)
        .map(|i| {
            let entry =
                json!({"dtype": "U8", "shape": [each], "data_offsets": [i * each, (i + 1) * each]});
            (format!("t{i}"), entry)
        })
        .collect();
    let text = serde_json::Value::Object(map).to_string();
    let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(text.as_bytes());
    let f = std::fs::File::create(path).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &bytes, 0).unwrap();
    f.set_len(bytes.len() as u64 + tensors * each).unwrap();
}

fn uid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// The reader child: attaches `SET`, says its pid, holds the lease until
/// its stdin closes.
fn reader() {
    let parent = Parent::new();
    let device = Device::open(0).unwrap();
    let socket = PathBuf::from(std::env::var(SOCKET_ENV).unwrap());
    let sub = Subscriber::connect(&device, socket.as_path(), SubscriberConfig::default()).unwrap();
    let set = sub.attach_set(SET).unwrap();
    parent.send(&json!({"bad": null, "pid": std::process::id(), "tensors": set.len()}));
    while parent.recv().is_some() {}
    let _ = sub.release_set(set);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_shutdown_stops_a_running_load_within_two_seconds() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.safetensors");
    // 16 GiB copied through one stream in 16 KiB pieces: many seconds.
    sparse(&path, 16, 1 << 30);
    let socket = dir.path().join("svc.sock");
    let device = Device::open(0).unwrap();
    let config = ServiceConfig::default().with_quotas(Quotas::unlimited());
    let service = Service::start(&device, socket.as_path(), config).unwrap();
    let request =
        LoadRequest::new("big", path.to_str().unwrap()).with_copies(Some(1), Some(16 << 10));
    let loading = {
        let socket = socket.clone();
        std::thread::spawn(move || {
            let client = Client::connect(&socket, ClientConfig::default()).unwrap();
            let started = Instant::now();
            let r = client.call_within("load", &admin::encode(&request), Duration::from_secs(120));
            (r, started.elapsed())
        })
    };
    let started = Instant::now();
    while service.stats().loads_in_progress == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the load never started"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(500));
    let stopping = Instant::now();
    let report = service.shutdown(Duration::from_secs(30));
    let took = stopping.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "the shutdown took {took:?}: {report:?}"
    );
    assert!(report.dropped.is_empty(), "{report:?}");
    let (answer, load_took) = loading.join().unwrap();
    let e = answer.expect_err("the load was stopped");
    assert!(e.to_string().contains("stopped"), "{e}");
    assert!(load_took < Duration::from_secs(20), "{load_took:?}");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_forced_drop_counts_against_its_reader_until_the_reader_lets_go() {
    if role().as_deref() == Some("reader") {
        return reader();
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    sparse(&path, 4, 16 << 20);
    let socket = dir.path().join("svc.sock");
    let device = Device::open(0).unwrap();
    // Room for one set of 64 MiB, not two.
    let quota: u64 = 100 << 20;
    let config = ServiceConfig::default().with_quotas(Quotas::unlimited().with_uid(uid(), quota));
    let service = Service::start(&device, socket.as_path(), config).unwrap();
    let request = LoadRequest::new(SET, path.to_str().unwrap());
    let load = service.load(uid(), &request).unwrap();
    let test = test_name!("a_forced_drop_counts_against_its_reader_until_the_reader_lets_go");
    let reading = Peer::spawn_with(&test, "reader", |c| {
        c.env(SOCKET_ENV, &socket);
    });
    let answer = reading.recv();
    assert_ok!(&answer, "the reader");

    let dropped = service
        .drop_set(uid(), &DropRequest::new(SET, true))
        .unwrap();
    assert_eq!(dropped.held_by.len(), 1, "{dropped:?}");
    let stats = service.stats();
    assert_eq!(
        (stats.sets, stats.total_bytes),
        (0, load.allocated),
        "{stats:?}"
    );
    let me = stats.uids.iter().find(|u| u.uid == uid()).unwrap();
    assert_eq!(
        (me.used, me.held),
        (load.allocated, load.allocated),
        "{me:?}"
    );
    // The memory is still there: a second set does not fit.
    let other = LoadRequest::new("other", path.to_str().unwrap());
    let e = service.load(uid(), &other).unwrap_err();
    assert_eq!(e.code, "over_quota", "{e:?}");

    // The reader lets go: the memory and the quota come back.
    assert!(reading.finish(), "the reader failed");
    let started = Instant::now();
    while service.stats().total_bytes > 0 {
        assert!(started.elapsed() < Duration::from_secs(20), "still held");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(service.stats().uids.iter().all(|u| u.used == 0));
    service.load(uid(), &other).unwrap();
    let report = service.shutdown(Duration::from_secs(5));
    assert_eq!(report.dropped.len(), 1);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn other_uids_have_a_quarter_of_the_device_by_default() {
    let dir = tempfile::tempdir().unwrap();
    let device = Device::open(0).unwrap();
    let (_, total) = device.memory_info().unwrap();
    let socket = dir.path().join("svc.sock");
    let service = Service::start(&device, socket.as_path(), ServiceConfig::default()).unwrap();
    let stats = service.stats();
    assert_eq!(stats.default_quota, Some(total / 4), "{stats:?}");
    // A sparse file of more than a quarter of the device (a few KiB on
    // disk), asked for by another uid: refused before the work.
    let path = dir.path().join("sparse.safetensors");
    sparse(&path, 1, total / 4 + (1 << 20));
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let request = LoadRequest::new("sparse", path.to_str().unwrap());
    let started = Instant::now();
    let e = service.load(65534, &request).unwrap_err();
    assert_eq!(e.code, "over_quota", "{e:?}");
    assert!(started.elapsed() < Duration::from_secs(1));
    assert_eq!(service.stats().total_bytes, 0);
    // The service's own uid has no default quota.
    let own = service.stats().uids.into_iter().find(|u| u.uid == uid());
    assert!(own.is_none_or(|u| u.quota.is_none()), "{own:?}");
    let _ = service.shutdown(Duration::from_secs(1));
}
