//! Saving a service's set as a safetensors file, and a service started
//! again from it, across processes: a saver child saves version 1 while a
//! writer holds version 2's session open (the save pauses neither); the
//! file holds version 1 byte for byte, named in its metadata; a second save
//! refuses to replace it unless asked, then saves version 2; a second
//! service loads the directory and serves version 2 at that version, which
//! a reader child checks by content.

use std::path::{Path, PathBuf};
use std::time::Duration;

use cuda_ipc::Device;
use cuda_ipc::saver::SaveOptions;
use cuda_ipc::service::{SET_KEY, Service, ServiceConfig, VERSION_KEY};
use serde_json::{Value, json};

use super::common::{Parent, Peer, role};
use super::service_write::{
    SET, SOCKET_ENV, commit, connect, layout, pattern, reader, spawn, writer,
};
use crate::{assert_ok, test_name};

const DIR_ENV: &str = "CUDA_IPC_TEST_SAVE_DIR";
const OVERWRITE_ENV: &str = "CUDA_IPC_TEST_SAVE_OVERWRITE";

/// A saver child: saves the set into the directory it is given, in small
/// pieces on three streams (many pieces per tensor), and says what it did.
fn saver() {
    let parent = Parent::new();
    let device = Device::open(0).unwrap();
    let sub = connect(&device);
    let dir = PathBuf::from(std::env::var(DIR_ENV).unwrap());
    let options = SaveOptions::default()
        .with_streams(3)
        .with_piece_size(64 << 10)
        .with_overwrite(std::env::var_os(OVERWRITE_ENV).is_some());
    match cuda_ipc::service::save(&sub, &device, SET, &dir, &options, &mut |_, _| {}) {
        Ok(s) => parent.send(&json!({
            "bad": null,
            "version": s.version,
            "path": s.report.path,
            "tensors": s.report.tensors,
            "bytes": s.report.payload_bytes,
        })),
        Err(e) => parent.send(&json!({"bad": e.to_string()})),
    }
}

fn save(test: &str, socket: &Path, dir: &Path, overwrite: bool) -> Value {
    let peer = Peer::spawn_with(test, "saver", |c| {
        c.env(SOCKET_ENV, socket).env(DIR_ENV, dir);
        if overwrite {
            c.env(OVERWRITE_ENV, "1");
        }
    });
    let answer = peer.recv();
    assert!(peer.finish(), "the saver exits cleanly");
    answer
}

/// The first tensor of the file at `path` that does not hold version
/// `seed`, checked element by element on the host; and the metadata.
fn check_file(path: &Path, seed: u32) -> (Value, Value) {
    let bytes = std::fs::read(path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta = json!(header.metadata());
    assert_eq!(file.len(), layout().len());
    for (i, spec) in layout().iter().enumerate() {
        let t = file.tensor(&spec.name).unwrap();
        assert_eq!(t.dtype(), safetensors::Dtype::U32, "{}", spec.name);
        let shape: Vec<u64> = t.shape().iter().map(|&d| d as u64).collect();
        assert_eq!(shape, spec.shape, "{}", spec.name);
        let want = pattern(seed, i);
        for (k, word) in t.data().chunks_exact(4).enumerate() {
            let got = u32::from_le_bytes(word.try_into().unwrap());
            if got != want.at(k as u64) {
                return (json!(format!("{} element {k}: {got}", spec.name)), meta);
            }
        }
    }
    (Value::Null, meta)
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_saved_set_holds_its_version_and_a_service_restores_it() {
    match role().as_deref() {
        Some("writer") => return writer(),
        Some("reader") => return reader(),
        Some("saver") => return saver(),
        _ => {}
    }
    let test = test_name!("a_saved_set_holds_its_version_and_a_service_restores_it");
    let dir = tempfile::tempdir().unwrap();
    let saved = dir.path().join("saved");
    std::fs::create_dir(&saved).unwrap();
    let socket_a = dir.path().join("a.sock");
    let device = Device::open(0).unwrap();
    let a = Service::start(&device, socket_a.as_path(), ServiceConfig::default()).unwrap();

    let mut first = spawn(&test, "writer", &socket_a, 1);
    assert_ok!(&first.recv(), "the first writer");
    commit(&mut first, "version 1");
    drop(first);
    // Version 2 is written, not committed, while version 1 is saved.
    let mut second = spawn(&test, "writer", &socket_a, 2);
    assert_ok!(&second.recv(), "the second writer");
    let one = save(&test, &socket_a, &saved, false);
    assert_ok!(&one, "the save of version 1");
    assert_eq!(one["version"], 1);
    let file = PathBuf::from(one["path"].as_str().unwrap());
    assert_eq!(file, saved.join(format!("{SET}.safetensors")));
    assert_eq!(
        commit(&mut second, "version 2 after the save")["version"],
        2
    );
    drop(second);
    let (bad, meta) = check_file(&file, 1);
    assert!(bad.is_null(), "the file holds version 1: {bad}");
    assert_eq!(meta[SET_KEY], SET);
    assert_eq!(meta[VERSION_KEY], "1");
    assert_eq!(meta["format"], "pt");

    // The file is not replaced unless asked.
    let refused = save(&test, &socket_a, &saved, false);
    let why = refused["bad"].as_str().unwrap_or_default();
    assert!(why.contains("exists"), "{refused}");
    assert!(check_file(&file, 1).0.is_null(), "left as it was");
    let two = save(&test, &socket_a, &saved, true);
    assert_ok!(&two, "the save of version 2");
    assert_eq!(two["version"], 2);
    let (bad, meta) = check_file(&file, 2);
    assert!(bad.is_null(), "the file holds version 2: {bad}");
    assert_eq!(meta[VERSION_KEY], "2");
    let names: Vec<_> = std::fs::read_dir(&saved)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 1, "no partial file is left: {names:?}");
    a.shutdown(Duration::from_secs(5));

    // A second service serves the saved version from the file.
    let socket_b = dir.path().join("b.sock");
    let b = Service::start(&device, socket_b.as_path(), ServiceConfig::default()).unwrap();
    let loads = b.load_saved(&saved).unwrap();
    assert_eq!(loads.len(), 1);
    let answer = loads[0].outcome.as_ref().unwrap().as_ref().unwrap();
    assert_eq!((answer.set.as_str(), answer.version), (SET, 2));
    assert_eq!(answer.bytes, two["bytes"].as_u64().unwrap());
    let mut reading = spawn(&test, "reader", &socket_b, 0);
    assert_ok!(&reading.recv(), "a reader of the restored set");
    reading.send(&json!({"seed": 2}));
    assert_ok!(&reading.recv(), "the restored set holds version 2");
    drop(reading);
    // A set the service holds is left as it is.
    let again = b.load_saved(&saved).unwrap();
    assert!(
        matches!(again[0].outcome, Ok(None)),
        "{:?}",
        again[0].outcome
    );
    assert_eq!(b.ls().sets[0].version, 2);
    b.shutdown(Duration::from_secs(5));
}
