//! Writer sessions of the weight service on a real device, across
//! processes: a writer child creates a set and commits it; a reader child
//! reads version 1 by content; a second writer writes version 2 while a
//! third is refused, naming it, and the reader still reads version 1; the
//! commit tells the reader, which reads version 2 by attaching again; a
//! writer killed in the middle of a write leaves readers on version 2
//! (checked by content) and the service frees its staging version.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cuda_ipc::Device;
use cuda_ipc::channel::ChannelError;
use cuda_ipc::exchange::{SetAttachment, Subscriber, SubscriberConfig};
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::service::admin::{SetState, TensorSpec};
use cuda_ipc::service::{Service, ServiceConfig, Writer};
use cuda_ipc::{Dtype, Error};
use serde_json::{Value, json};

use super::common::{Parent, Peer, role};
use crate::{assert_ok, test_name};

pub(super) const SOCKET_ENV: &str = "CUDA_IPC_TEST_WRITE_SOCKET";
const SEED_ENV: &str = "CUDA_IPC_TEST_WRITE_SEED";
pub(super) const SET: &str = "trained";

pub(super) fn socket() -> PathBuf {
    PathBuf::from(std::env::var(SOCKET_ENV).unwrap())
}

fn seed() -> u32 {
    std::env::var(SEED_ENV).unwrap().parse().unwrap()
}

/// The set's layout: u32 tensors, so that the pattern kernels write and
/// check them.
pub(super) fn layout() -> Vec<TensorSpec> {
    vec![
        TensorSpec::new("embed.weight", Dtype::U32, vec![1000, 64]),
        TensorSpec::new("norm.weight", Dtype::U32, vec![64]),
        TensorSpec::new("lm_head.weight", Dtype::U32, vec![333, 64]),
    ]
}

/// What version `seed` holds in tensor `i` of [`layout`].
pub(super) fn pattern(seed: u32, i: usize) -> Pattern {
    Pattern::ramp(seed * 10_000_000 + i as u32 * 1_000_000, 1)
}

/// What version `seed` holds in the tensor called `name` (whatever its
/// place in a set: a set restored from a file has the file's order).
pub(super) fn pattern_of(seed: u32, name: &str) -> Pattern {
    let i = layout().iter().position(|t| t.name == name).unwrap();
    pattern(seed, i)
}

pub(super) fn connect(device: &Device) -> Subscriber {
    Subscriber::connect(device, socket().as_path(), SubscriberConfig::default()).unwrap()
}

/// The first tensor of `set` that does not hold version `seed`.
pub(super) fn check(set: &SetAttachment, seed: u32) -> Value {
    for i in 0..set.len() {
        let view = set.view::<u32>(i).unwrap();
        let want = pattern_of(seed, &set.entries()[i].name);
        if let Some(at) = kernels::check_u32(&view, want).unwrap() {
            return json!(format!(
                "{} differs from version seed {seed} at element {at}",
                set.entries()[i].name
            ));
        }
    }
    Value::Null
}

/// A writer child: opens a write (of a new set when its seed is 1), fills
/// every tensor with its seed's pattern, tells the parent, and commits
/// when the parent says `commit` (or is killed before).
pub(super) fn writer() {
    let parent = Parent::new();
    let device = Device::open(0).unwrap();
    let sub = connect(&device);
    let seed = seed();
    let layout = (seed == 1).then(layout);
    let w = match Writer::open(&sub, SET, layout) {
        Ok(w) => w,
        Err(e) => return parent.send(&json!({"bad": e.to_string()})),
    };
    for i in 0..w.staging().len() {
        let view = w.staging().view::<u32>(i).unwrap();
        let pattern = pattern_of(seed, &w.staging().entries()[i].name);
        kernels::fill_u32(&view, pattern, Speed::Full).unwrap();
    }
    device.synchronize().unwrap();
    parent.send(&json!({
        "bad": null,
        "pid": std::process::id(),
        "version": w.opened().version,
        "staging_read_only": w.staging().read_only(),
    }));
    match parent.recv() {
        Some(v) if v == json!("commit") => {}
        _ => return,
    }
    match w.commit() {
        Ok(a) => parent.send(&json!({"bad": null, "version": a.version, "told": a.readers_told})),
        Err(e) => parent.send(&json!({"bad": e.to_string()})),
    }
    let _ = parent.recv();
}

/// A reader child: attaches the set, checks it holds the seed the parent
/// names at each `check`, waits for an update at `update` and attaches
/// again.
pub(super) fn reader() {
    let parent = Parent::new();
    let device = Device::open(0).unwrap();
    let sub = connect(&device);
    let mut set = sub.attach_set(SET).unwrap();
    parent.send(&json!({"bad": null, "read_only": set.read_only(), "pid": std::process::id()}));
    while let Some(ask) = parent.recv() {
        let seed = ask["seed"].as_u64().unwrap() as u32;
        if ask["update"] == json!(true) {
            if let Err(e) = sub.wait_set_update(&set, Duration::from_secs(30)) {
                parent.send(&json!({"bad": format!("no update: {e}")}));
                continue;
            }
            // The old version is unchanged until released.
            let old = check(&set, seed - 1);
            let newer = sub.attach_set(SET).unwrap();
            let old_set = std::mem::replace(&mut set, newer);
            sub.release_set(old_set).unwrap();
            if !old.is_null() {
                parent.send(&json!({"bad": old}));
                continue;
            }
        }
        parent.send(&json!({"bad": check(&set, seed), "read_only": set.read_only()}));
    }
    let _ = sub.release_set(set);
}

pub(super) fn spawn(test: &str, role: &str, socket: &Path, seed: u32) -> Peer {
    Peer::spawn_with(test, role, |c| {
        c.env(SOCKET_ENV, socket).env(SEED_ENV, seed.to_string());
    })
}

/// Tells writer `peer` to commit; its answer.
pub(super) fn commit(peer: &mut Peer, what: &str) -> Value {
    peer.send(&json!("commit"));
    let done = peer.recv();
    assert_ok!(&done, "{what}");
    done
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let started = Instant::now();
    while !done() {
        assert!(started.elapsed() < Duration::from_secs(20), "{what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn writers_commit_versions_one_at_a_time_and_a_killed_writer_changes_nothing() {
    match role().as_deref() {
        Some("writer") => return writer(),
        Some("reader") => return reader(),
        _ => {}
    }
    let test =
        test_name!("writers_commit_versions_one_at_a_time_and_a_killed_writer_changes_nothing");
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("svc.sock");
    let device = Device::open(0).unwrap();
    let service = Service::start(&device, socket.as_path(), ServiceConfig::default()).unwrap();

    // Version 1: a new set, written and committed by a child.
    let mut first = spawn(&test, "writer", &socket, 1);
    let opened = first.recv();
    assert_ok!(&opened, "the first writer");
    assert_eq!(opened["version"], 1);
    assert_eq!(
        opened["staging_read_only"], false,
        "the writer maps read-write"
    );
    assert_eq!(commit(&mut first, "the first commit")["version"], 1);
    drop(first);
    let one_version = service.ls().sets[0].bytes;

    // A reader reads version 1, read-only.
    let mut reading = spawn(&test, "reader", &socket, 0);
    let hello = reading.recv();
    assert_ok!(&hello, "the reader");
    assert_eq!(
        hello["read_only"], true,
        "readers map the service's sets read-only"
    );
    reading.send(&json!({"seed": 1}));
    assert_ok!(&reading.recv(), "the reader on version 1");

    // A second writer writes version 2; a third is refused, naming it.
    let mut second = spawn(&test, "writer", &socket, 2);
    let opened = second.recv();
    assert_ok!(&opened, "the second writer");
    assert_eq!(opened["version"], 2);
    let writer_pid = opened["pid"].as_u64().unwrap() as u32;
    let row = service
        .ls()
        .sets
        .into_iter()
        .find(|s| s.name == SET)
        .unwrap();
    assert_eq!(row.state, SetState::Writing);
    assert_eq!(row.writer.map(|w| w.pid), Some(writer_pid));
    let parent_sub = connect_here(&socket, &device);
    match Writer::open(&parent_sub, SET, None) {
        Err(Error::Channel(ChannelError::Remote { code, message })) => {
            assert_eq!(code, "writing", "{message}");
            assert!(message.contains(&format!("pid {writer_pid}")), "{message}");
        }
        other => panic!("a second writer must be refused, got {other:?}"),
    }
    // Staging bytes count while it writes: two versions.
    assert_eq!(service.stats().uids[0].reserved, one_version);
    // The reader still reads version 1.
    reading.send(&json!({"seed": 1}));
    assert_ok!(&reading.recv(), "the reader during the write");

    // The commit tells the reader, which moves to version 2 by attaching again.
    let done = commit(&mut second, "the second commit");
    assert_eq!(done["version"], 2);
    assert_eq!(done["told"], 1);
    reading.send(&json!({"seed": 2, "update": true}));
    assert_ok!(&reading.recv(), "the reader after the update");
    drop(second);
    // Version 1 goes back once the reader let go of it.
    wait_for("version 1 is freed", || {
        service.stats().uids[0].used == one_version
    });

    // A writer killed in the middle leaves version 2, and its staging goes.
    let third = spawn(&test, "writer", &socket, 3);
    assert_ok!(&third.recv(), "the third writer");
    assert_eq!(service.stats().uids[0].reserved, one_version);
    third.kill();
    wait_for("the killed writer's session ends", || {
        service.ls().sets.iter().all(|s| s.writer.is_none())
    });
    let stats = service.stats();
    assert_eq!(
        (stats.uids[0].used, stats.uids[0].reserved),
        (one_version, 0)
    );
    assert_eq!(service.ls().sets[0].version, 2);
    reading.send(&json!({"seed": 2}));
    assert_ok!(&reading.recv(), "the reader after the killed writer");
    let mut late = spawn(&test, "reader", &socket, 0);
    assert_ok!(&late.recv(), "a new reader");
    late.send(&json!({"seed": 2}));
    assert_ok!(&late.recv(), "a new reader after the killed writer");
    drop(late);
    drop(reading);

    // A new writer may take the set again: the version the killed one
    // would have made is given again.
    let mut fourth = spawn(&test, "writer", &socket, 4);
    let opened = fourth.recv();
    assert_ok!(&opened, "the fourth writer");
    assert_eq!(opened["version"], 3);
    commit(&mut fourth, "the fourth commit");
    drop(fourth);
    assert_eq!(service.ls().sets[0].version, 3);
    drop(parent_sub);
    let report = service.shutdown(Duration::from_secs(5));
    assert_eq!(report.dropped.len(), 1);
}

/// A service on a socket of its own, holding version 1 of [`SET`]
/// (written and committed by a writer child of `test`): the folder (kept
/// while the test runs), the socket, the device and the service.
pub(super) fn service_with_version_one(
    test: &str,
) -> (tempfile::TempDir, PathBuf, Device, Service) {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("svc.sock");
    let device = Device::open(0).unwrap();
    let service = Service::start(&device, socket.as_path(), ServiceConfig::default()).unwrap();
    let mut first = spawn(test, "writer", &socket, 1);
    assert_ok!(&first.recv(), "the first writer");
    commit(&mut first, "version 1");
    drop(first);
    (dir, socket, device, service)
}

fn connect_here(socket: &Path, device: &Device) -> Subscriber {
    Subscriber::connect(device, socket, SubscriberConfig::default()).unwrap()
}
