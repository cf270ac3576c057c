//! The weight service on a real device, across processes: a loader child
//! asks the service to load a sharded checkpoint and is killed, and the
//! set stays; a reader child attaches it read-only and compares every byte
//! with the files; a second load over the quota is refused; a drop is
//! refused while the reader holds its lease and allowed after; and a
//! shutdown waits out its grace for a reader that holds on, naming it.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cuda_ipc::channel::{ChannelError, Client, ClientConfig};
use cuda_ipc::checkpoint::{Checkpoint, PlanOptions};
use cuda_ipc::exchange::{Subscriber, SubscriberConfig};
use cuda_ipc::service::admin::{self, DropRequest, LoadAnswer, LoadRequest, LsAnswer};
use cuda_ipc::service::{Holder, Quotas, Service, ServiceConfig};
use cuda_ipc::{Device, DeviceMemory};
use serde_json::{Value, json};

use super::checkpoint_load::sharded;
use super::common::{Parent, Peer, role};
use crate::{assert_ok, test_name};

const SOCKET_ENV: &str = "CUDA_IPC_TEST_SERVICE_SOCKET";
const DIR_ENV: &str = "CUDA_IPC_TEST_SERVICE_CHECKPOINT";
const SET: &str = "model";

pub(super) fn env_path(var: &str) -> PathBuf {
    PathBuf::from(std::env::var(var).unwrap())
}

/// A reader child's start: its parent, the device, the checkpoint at
/// the path in `dir_env` and a subscriber of the service at the socket in
/// `socket_env`.
pub(super) fn reader_start(
    socket_env: &str,
    dir_env: &str,
) -> (Parent, Device, Checkpoint, Subscriber) {
    let parent = Parent::new();
    let device = Device::open(0).unwrap();
    let ckpt = Checkpoint::open(env_path(dir_env)).unwrap();
    let sub = Subscriber::connect(
        &device,
        env_path(socket_env).as_path(),
        SubscriberConfig::default(),
    )
    .unwrap();
    (parent, device, ckpt, sub)
}

/// The loader child: asks the service to load the checkpoint as `SET`,
/// answers with what it did, then waits to be killed.
fn loader() {
    let parent = Parent::new();
    let client = Client::connect(env_path(SOCKET_ENV), ClientConfig::default()).unwrap();
    let dir = env_path(DIR_ENV);
    let request = LoadRequest::new(SET, dir.to_str().unwrap());
    let answer = client.call_within("load", &admin::encode(&request), Duration::from_secs(120));
    match answer {
        Ok(a) => parent.send(&json!({"bad": null, "load": a})),
        Err(e) => parent.send(&json!({"bad": e.to_string()})),
    }
    let _ = parent.recv();
}

/// The reader child: attaches `SET`, compares every tensor with the
/// checkpoint, answers, and holds its lease until its stdin closes.
fn reader() {
    let (parent, _device, ckpt, sub) = reader_start(SOCKET_ENV, DIR_ENV);
    let set = sub.attach_set(SET).unwrap();
    let mut bad = Value::Null;
    let mut bytes = 0u64;
    for (i, e) in set.entries().iter().enumerate() {
        let Some(t) = ckpt.tensor(&e.name) else {
            bad = json!(format!("{} is not in the checkpoint", e.name));
            break;
        };
        let want = ckpt.bytes(t).unwrap();
        let got: Vec<u8> = set.view::<u8>(i).unwrap().to_vec().unwrap();
        if (t.dtype, &t.shape[..]) != (e.dtype, &e.shape[..]) || got != want {
            bad = json!(format!("{}: dtype, shape or bytes differ", e.name));
            break;
        }
        bytes += got.len() as u64;
    }
    parent.send(&json!({
        "bad": bad,
        "tensors": set.len(),
        "bytes": bytes,
        "read_only": set.read_only(),
        "pid": std::process::id(),
    }));
    while parent.recv().is_some() {}
    // After a service's shutdown the connection is gone: nothing to release.
    let _ = sub.release_set(set);
}

fn spawn(test: &str, role: &str, socket: &Path, dir: &Path) -> Peer {
    Peer::spawn_with(test, role, |c| {
        c.env(SOCKET_ENV, socket).env(DIR_ENV, dir);
    })
}

fn remote(e: ChannelError) -> (String, String) {
    match e {
        ChannelError::Remote { code, message } => (code, message),
        other => panic!("expected the service's refusal, got {other}"),
    }
}

/// The bytes a load of the checkpoint in `dir` holds (what counts against
/// a quota).
fn held_bytes(dir: &Path) -> u64 {
    Checkpoint::open(dir)
        .unwrap()
        .plan(&PlanOptions::default())
        .unwrap()
        .total_bytes()
}

/// Waits until no reader holds a lease on `SET`.
fn wait_unleased(service: &Service) {
    let started = Instant::now();
    while service.ls().sets.iter().any(|s| !s.leases.is_empty()) {
        assert!(started.elapsed() < Duration::from_secs(20), "leases stay");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_service_keeps_a_set_its_loader_left_and_enforces_quotas_and_leases() {
    match role().as_deref() {
        Some("loader") => return loader(),
        Some("reader") => return reader(),
        _ => {}
    }
    let dir = tempfile::tempdir().unwrap();
    let want = sharded(dir.path());
    let payload: u64 = want.values().map(|b| b.len() as u64).sum();
    let held = held_bytes(dir.path());
    let socket = dir.path().join("svc.sock");
    let device = Device::open(0).unwrap();
    // Room for one load, not two. The loads come from the service's own
    // uid, which the default quota leaves unlimited: give it one.
    let own = rustix::process::geteuid().as_raw();
    let quotas = Quotas::unlimited().with_uid(own, held + held / 2);
    let service = Service::start(
        &device,
        socket.as_path(),
        ServiceConfig::default().with_quotas(quotas),
    )
    .unwrap();

    // A loader loads and is killed: the set is the service's.
    let test = test_name!("a_service_keeps_a_set_its_loader_left_and_enforces_quotas_and_leases");
    let loading = spawn(&test, "loader", &socket, dir.path());
    let answer = loading.recv_within(Duration::from_secs(180));
    assert_ok!(&answer, "the loader");
    let load: LoadAnswer = admin::decode("load", &answer["load"]).unwrap();
    assert_eq!(
        (load.tensors, load.bytes, load.allocated),
        (want.len(), payload, held)
    );
    assert_eq!(load.version, 1);
    loading.kill();
    let ls: LsAnswer = service.ls();
    assert_eq!(ls.sets.len(), 1, "the set stays after its loader is killed");
    assert_eq!(ls.sets[0].owner_uid, rustix::process::geteuid().as_raw());

    // A reader maps it read-only and reads every byte.
    let reading = spawn(&test, "reader", &socket, dir.path());
    let answer = reading.recv();
    assert_ok!(&answer, "the reader");
    assert_eq!(answer["tensors"], want.len());
    assert_eq!(answer["bytes"], payload);
    assert_eq!(answer["read_only"], true);
    let reader_pid = answer["pid"].as_u64().unwrap() as u32;
    let rows = service.ls().sets;
    assert!(
        rows[0].leases.iter().any(|h| h.pid == reader_pid),
        "ls names the reader: {rows:?}"
    );

    // Over the quota: refused, naming the numbers.
    let client = Client::connect(&socket, ClientConfig::default()).unwrap();
    let second = LoadRequest::new("model2", dir.path().to_str().unwrap());
    let (code, message) = remote(
        client
            .call_within("load", &admin::encode(&second), Duration::from_secs(120))
            .unwrap_err(),
    );
    assert_eq!(code, "over_quota", "{message}");
    assert!(message.contains(&held.to_string()), "{message}");
    assert_eq!(service.stats().sets, 1);

    // A drop while the reader holds its lease is refused, naming it.
    let drop_body = admin::encode(&DropRequest::new(SET, false));
    let (code, message) = remote(client.call("drop", &drop_body).unwrap_err());
    assert_eq!(code, "leased", "{message}");
    assert!(message.contains(&format!("pid {reader_pid}")), "{message}");
    assert!(reading.finish(), "the reader failed");
    wait_unleased(&service);
    let dropped = client.call("drop", &drop_body).unwrap();
    assert_eq!(dropped["bytes"], held);
    assert!(service.ls().sets.is_empty());
    assert_eq!(service.stats().total_bytes, 0);

    // The name is free again: a new load is version 2.
    let again = client
        .call_within(
            "load",
            &admin::encode(&LoadRequest::new(SET, dir.path().to_str().unwrap())),
            Duration::from_secs(120),
        )
        .unwrap();
    assert_eq!(again["version"], 2);
    let report = service.shutdown(Duration::from_secs(5));
    assert!(report.held_at_timeout.is_empty(), "{report:?}");
    assert_eq!(report.dropped.len(), 1);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_shutdown_waits_out_its_grace_for_a_reader_and_names_it() {
    if role().as_deref() == Some("reader") {
        return reader();
    }
    let dir = tempfile::tempdir().unwrap();
    sharded(dir.path());
    let socket = dir.path().join("svc.sock");
    let device = Device::open(0).unwrap();
    let service = Service::start(&device, socket.as_path(), ServiceConfig::default()).unwrap();
    let uid = rustix::process::geteuid().as_raw();
    let request = LoadRequest::new(SET, dir.path().to_str().unwrap());
    let load = service.load(uid, &request).unwrap();
    let test = test_name!("a_shutdown_waits_out_its_grace_for_a_reader_and_names_it");
    let reading = spawn(&test, "reader", &socket, dir.path());
    let answer = reading.recv();
    assert_ok!(&answer, "the reader");
    let pid = answer["pid"].as_u64().unwrap() as u32;

    let grace = Duration::from_secs(2);
    let report = service.shutdown(grace);
    assert!(report.waited >= grace, "{report:?}");
    assert_eq!(
        report.held_at_timeout,
        [(SET.to_owned(), Holder { pid, uid })]
    );
    assert_eq!(report.dropped.len(), 1);
    assert_eq!(report.dropped[0].bytes, load.allocated);
    // The reader's connection ended with the service; it exits cleanly.
    assert!(reading.finish(), "the reader failed after the shutdown");
}
