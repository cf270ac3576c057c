//! The service's access rule, without a GPU: files of every owner and
//! mode, a link flipped between a secret and the caller's own file while
//! loads open it, and what a refusal says.
//!
//! The files of other owners are made with `chown`, which needs root (CI
//! runs as root); as another user those tests skip, saying why.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::{may_read_as, open_for, room_for};
use crate::checkpoint::FileMeta;

/// The caller of another uid: `nobody` on most Linux systems.
const OTHER: u32 = 65534;

fn meta(uid: u32, mode: u32, is_dir: bool) -> FileMeta {
    FileMeta {
        uid,
        gid: uid,
        mode,
        len: 1,
        is_dir,
    }
}

#[test]
fn other_uids_load_only_their_own_or_public_files() {
    let (owner, service) = (1000, 0);
    let other = 1001;
    let file = Path::new("/m/model.safetensors");
    let check =
        |caller: u32, mode: u32| may_read_as(caller, service, file, &meta(owner, mode, false));
    assert!(check(owner, 0o600).is_ok(), "its owner");
    let e = check(other, 0o600).unwrap_err();
    assert!(
        e.contains(&format!("uid {other}")) && e.contains("0600"),
        "{e}"
    );
    assert!(check(service, 0o600).is_ok(), "the service's own uid");
    assert!(
        check(other, 0o640).is_err(),
        "group permissions are not trusted"
    );
    assert!(check(other, 0o644).is_ok(), "anyone may read it");
    assert!(
        check(owner, 0o044).is_ok(),
        "readable by anyone, its owner too"
    );
    assert!(
        check(owner, 0o200).is_err(),
        "not even its owner may read it"
    );
    // A directory is searched only if the caller could list it.
    let dir = |caller: u32, mode: u32| may_read_as(caller, service, file, &meta(owner, mode, true));
    assert!(dir(other, 0o711).is_err());
    assert!(dir(other, 0o755).is_ok());
    assert!(dir(owner, 0o700).is_ok());
}

/// Says that and why a test did not run.
fn skip(test: &str, why: &str) {
    let _ = writeln!(std::io::stderr().lock(), "SKIPPED {test}: {why}");
}

fn root(test: &str) -> bool {
    let euid = rustix::process::geteuid().as_raw();
    if euid != 0 {
        skip(
            test,
            &format!("running as uid {euid}; chown needs root (CI runs as root)"),
        );
    }
    euid == 0
}

/// A safetensors file holding one tensor `name` of 64 bytes of `byte`.
fn checkpoint(path: &Path, name: &str, byte: u8) {
    let header = serde_json::json!({name: {"dtype": "U8", "shape": [64], "data_offsets": [0, 64]}});
    let text = header.to_string();
    let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(text.as_bytes());
    bytes.extend([byte; 64]);
    std::fs::write(path, bytes).unwrap();
}

fn own(path: &Path, uid: u32, mode: u32) {
    std::os::unix::fs::chown(path, Some(uid), Some(uid)).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// No quota: every size passes.
#[allow(clippy::unnecessary_wraps)] // the quota check's signature
fn no_quota(_: u64) -> Result<(), crate::channel::CallError> {
    Ok(())
}

#[test]
fn a_link_flipped_between_a_secret_and_the_callers_file_never_loads_the_secret() {
    if !root("a_link_flipped_between_a_secret_and_the_callers_file_never_loads_the_secret") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let secret = dir.path().join("secret.safetensors");
    checkpoint(&secret, "secret", 0x5a);
    own(&secret, 0, 0o600);
    let mine = dir.path().join("mine.safetensors");
    checkpoint(&mine, "mine", 0x11);
    own(&mine, OTHER, 0o600);
    let link = dir.path().join("model.safetensors");
    std::os::unix::fs::symlink(&mine, &link).unwrap();
    // The caller flips the link as fast as it can (a new link renamed over
    // the old one: the path always names one of the two).
    let stop = Arc::new(AtomicBool::new(false));
    let flipper = {
        let (stop, dir) = (Arc::clone(&stop), dir.path().to_path_buf());
        let (secret, mine, link) = (secret.clone(), mine.clone(), link.clone());
        std::thread::spawn(move || {
            let tmp = dir.join("next");
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let _ = std::fs::remove_file(&tmp);
                let target = if n.is_multiple_of(2) { &secret } else { &mine };
                std::os::unix::fs::symlink(target, &tmp).unwrap();
                std::fs::rename(&tmp, &link).unwrap();
                n += 1;
            }
        })
    };
    let (mut mine_loaded, mut refused, mut secret_loaded) = (0, 0, 0);
    for _ in 0..300 {
        match open_for(OTHER, 0, &link, &no_quota) {
            Ok(ckpt) => {
                let bytes = ckpt.bytes(&ckpt.tensors()[0]).unwrap();
                if ckpt.tensor("secret").is_some() || bytes.contains(&0x5a) {
                    secret_loaded += 1;
                } else {
                    mine_loaded += 1;
                }
            }
            Err(e) => {
                assert_eq!(e.code, "not_readable", "{e:?}");
                assert!(!e.message.contains("\"secret\""), "{}", e.message);
                refused += 1;
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    flipper.join().unwrap();
    assert_eq!(
        secret_loaded, 0,
        "the secret was opened for uid {OTHER} {secret_loaded} times (its own file \
         {mine_loaded}, refused {refused})"
    );
    assert_eq!(mine_loaded + refused, 300);
}

#[test]
fn a_file_the_caller_may_not_read_is_refused_before_a_byte_of_it_is_read() {
    if !root("a_file_the_caller_may_not_read_is_refused_before_a_byte_of_it_is_read") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    // A root-only file whose header is damaged: an error about it would
    // quote the tensor's name.
    let secret = dir.path().join("secret.safetensors");
    let text = r#"{"the-secret-name":{"dtype":"U8","shape":[1],"data_offsets":[0,9]}}"#;
    let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(text.as_bytes());
    bytes.push(0);
    std::fs::write(&secret, bytes).unwrap();
    own(&secret, 0, 0o600);
    let e = open_for(OTHER, 0, &secret, &no_quota).unwrap_err();
    assert_eq!(e.code, "not_readable", "{e:?}");
    assert!(!e.message.contains("the-secret-name"), "{}", e.message);
    assert!(e.message.contains("0600"), "{}", e.message);
    // The service's own uid gets the header's error.
    let e = open_for(0, 0, &secret, &no_quota).unwrap_err();
    assert_eq!(e.code, "checkpoint", "{e:?}");
    assert!(e.message.contains("the-secret-name"), "{}", e.message);
    // A directory only root may list: nothing of it is said.
    let private = dir.path().join("private");
    std::fs::create_dir(&private).unwrap();
    let hidden = private.join("a-private-name.safetensors");
    checkpoint(&hidden, "w", 1);
    own(&hidden, 0, 0o600);
    own(&private, 0, 0o711);
    let e = open_for(OTHER, 0, &private, &no_quota).unwrap_err();
    assert_eq!(e.code, "not_readable", "{e:?}");
    assert!(!e.message.contains("a-private-name"), "{}", e.message);
    // A sharded checkpoint whose index the caller may read but one of
    // whose shards it may not (the directories on the way are not
    // checked: the shard's own mode decides).
    let index = dir.path().join("model.safetensors.index.json");
    std::fs::write(
        &index,
        r#"{"weight_map": {"w": "private/a-private-name.safetensors"}}"#,
    )
    .unwrap();
    own(&index, OTHER, 0o600);
    let e = open_for(OTHER, 0, &index, &no_quota).unwrap_err();
    assert_eq!(e.code, "not_readable", "{e:?}");
    // Its own file, in a directory it may list, loads.
    let mine = dir.path().join("mine.safetensors");
    checkpoint(&mine, "mine", 2);
    own(&mine, OTHER, 0o400);
    assert!(open_for(OTHER, 0, &mine, &no_quota).is_ok());
}

#[test]
fn the_quota_is_asked_before_any_header_is_read() {
    let dir = tempfile::tempdir().unwrap();
    // 64 GiB of tensors on paper (a hole: 4 KiB on disk), after a header
    // of 8 MiB that is not even JSON: parsing it would be the work.
    let path = dir.path().join("huge.safetensors");
    let f = std::fs::File::create(&path).unwrap();
    let n: u64 = 8 << 20;
    std::os::unix::fs::FileExt::write_all_at(&f, &n.to_le_bytes(), 0).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, b"{not json", 8).unwrap();
    f.set_len(8 + n + (64 << 30)).unwrap();
    let uid = rustix::process::geteuid().as_raw();
    let catalog = std::sync::Mutex::new(crate::service::Catalog::new(
        uid.wrapping_add(1),
        crate::service::Quotas::unlimited().with_uid(uid, 1 << 30),
    ));
    let started = std::time::Instant::now();
    let e = open_for(
        uid,
        uid.wrapping_add(1),
        &path,
        &room_for(&catalog, uid, "big"),
    )
    .unwrap_err();
    assert_eq!(e.code, "over_quota", "{e:?}");
    assert!(
        e.message.contains(&(64u64 << 30).to_string()),
        "{}",
        e.message
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(1));
    // A name taken is refused before the work too.
    let mut c = crate::service::catalog::Catalog::new(
        uid.wrapping_add(1),
        crate::service::Quotas::unlimited(),
    );
    let ticket = c.admit(uid, "big", 1).unwrap();
    let catalog = std::sync::Mutex::new(c);
    let e = open_for(
        uid,
        uid.wrapping_add(1),
        &path,
        &room_for(&catalog, uid, "big"),
    )
    .unwrap_err();
    assert_eq!(e.code, "loading", "{e:?}");
    locked_cancel(&catalog, ticket);
}

fn locked_cancel(
    catalog: &std::sync::Mutex<crate::service::Catalog>,
    ticket: crate::service::catalog::Ticket,
) {
    catalog.lock().unwrap().cancel(ticket);
}
