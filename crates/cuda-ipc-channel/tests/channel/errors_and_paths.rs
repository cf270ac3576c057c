//! Error kinds and messages, socket names, socket directories.

use super::*;

#[test]
fn error_kinds_and_messages() {
    let cases: Vec<(ChannelError, ErrorKind, &str)> = vec![
        (
            ChannelError::PeerGone,
            ErrorKind::Peer,
            "closed the connection",
        ),
        (
            ChannelError::Refused {
                by: Side::Server,
                uid: 5,
                allowed: vec![6],
            },
            ErrorKind::Peer,
            "uid 5",
        ),
        (
            ChannelError::Remote {
                code: "x".into(),
                message: "y".into(),
            },
            ErrorKind::Peer,
            "(x): y",
        ),
        (
            ChannelError::Timeout {
                what: "a thing".into(),
                after: Duration::from_millis(5),
            },
            ErrorKind::Timeout,
            "waiting for a thing",
        ),
        (
            ChannelError::Protocol { reason: "r".into() },
            ErrorKind::InvalidInput,
            "protocol",
        ),
        (
            ChannelError::NotFound { name: "n".into() },
            ErrorKind::InvalidInput,
            "no entry named \"n\"",
        ),
        (
            ChannelError::AlreadyExists { name: "n".into() },
            ErrorKind::InvalidInput,
            "already published",
        ),
        (
            ChannelError::InvalidName {
                name: "n".into(),
                reason: "r".into(),
            },
            ErrorKind::InvalidInput,
            "invalid name",
        ),
        (
            ChannelError::Busy {
                path: "/p.sock".into(),
            },
            ErrorKind::Failed,
            "another publisher is serving /p.sock",
        ),
        (
            ChannelError::InsecureDirectory {
                path: "/d".into(),
                reason: "r".into(),
            },
            ErrorKind::Failed,
            "refusing to use the socket directory /d",
        ),
    ];
    for (e, kind, text) in cases {
        assert_eq!(e.kind(), kind, "{e}");
        assert!(e.to_string().contains(text), "{e}");
    }
}

#[test]
fn socket_names_are_validated() {
    for ok in ["a", "demo", "cam-0.frames_v2", &"x".repeat(64)] {
        validate_socket_name(ok).unwrap();
    }
    for bad in [
        "",
        ".hidden",
        "a/b",
        "a b",
        "ü",
        &"x".repeat(65),
        "..",
        "a\0",
    ] {
        let e = validate_socket_name(bad).unwrap_err();
        assert!(matches!(e, ChannelError::InvalidName { .. }), "{bad:?}");
    }
    assert!(default_socket_path("../etc/passwd").is_err());
    let p = default_socket_path("demo").unwrap();
    assert_eq!(p.file_name().unwrap(), "demo.sock");
}

#[test]
fn default_socket_dir_is_private() {
    let dir = default_socket_dir().unwrap();
    let meta = std::fs::symlink_metadata(&dir).unwrap();
    assert!(meta.is_dir());
    assert_eq!(meta.permissions().mode() & 0o777, 0o700);
    assert_eq!(meta.uid(), rustix::process::geteuid().as_raw());
}

#[test]
fn private_dirs_are_created_and_bad_ones_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let fresh = tmp.path().join("fresh");
    ensure_private_dir(&fresh).unwrap();
    assert_eq!(
        std::fs::metadata(&fresh).unwrap().permissions().mode() & 0o777,
        0o700
    );
    ensure_private_dir(&fresh).unwrap();

    let open = tmp.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).unwrap();
    let e = ensure_private_dir(&open).unwrap_err();
    assert!(matches!(e, ChannelError::InsecureDirectory { .. }), "{e}");
    assert!(e.to_string().contains("chmod 700"), "{e}");
    // Refused directories are not changed.
    assert_eq!(
        std::fs::metadata(&open).unwrap().permissions().mode() & 0o777,
        0o755
    );

    let link = tmp.path().join("link");
    std::os::unix::fs::symlink(&fresh, &link).unwrap();
    let e = ensure_private_dir(&link).unwrap_err();
    assert!(e.to_string().contains("symbolic link"), "{e}");

    let file = tmp.path().join("file");
    std::fs::write(&file, b"").unwrap();
    assert!(matches!(
        ensure_private_dir(&file),
        Err(ChannelError::InsecureDirectory { .. })
    ));

    let missing_parent = tmp.path().join("no/such");
    assert!(matches!(
        ensure_private_dir(&missing_parent),
        Err(ChannelError::Io { .. })
    ));

    if rustix::process::geteuid().is_root() {
        let theirs = tmp.path().join("theirs");
        std::fs::create_dir(&theirs).unwrap();
        std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::chown(&theirs, Some(54321), None).unwrap();
        let e = ensure_private_dir(&theirs).unwrap_err();
        assert!(e.to_string().contains("owned by uid 54321"), "{e}");
    } else {
        eprintln!("skipped the foreign-owner check: it needs root to chown");
    }
}

#[test]
fn peer_credentials_are_ours() {
    let (a, _b) = UnixStream::pair().unwrap();
    let cred = peer_credentials(&a).unwrap();
    assert_eq!(cred.pid, std::process::id());
    assert_eq!(cred.uid, rustix::process::geteuid().as_raw());
    assert_eq!(cred.gid, rustix::process::getegid().as_raw());
}

/// A path that is not a socket is named for what it is, not taken for a
/// socket left by a producer that exited.
#[test]
fn connecting_to_a_file_or_directory_says_what_it_is() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("file.sock");
    std::fs::write(&file, b"").unwrap();
    let dir = tmp.path().join("dir.sock");
    std::fs::create_dir(&dir).unwrap();
    for (path, what) in [(&file, "is a regular file"), (&dir, "is a directory")] {
        let e = Client::connect(path, ClientConfig::default()).unwrap_err();
        let text = e.to_string();
        assert!(text.contains(what), "{text}");
        assert!(!text.contains("exited"), "{text}");
    }
    // A socket nobody serves is still called that.
    let stale = tmp.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    let e = Client::connect(&stale, ClientConfig::default()).unwrap_err();
    assert!(e.to_string().contains("no server serves"), "{e}");
}

#[test]
fn refused_attaches_get_the_refusal_and_held_leases_stay() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "refuse");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    server
        .publish("w", json!({"n": 1}), vec![memfd_with(&[7; 8])])
        .unwrap();
    let client = quick_client(&path);
    let held = client.attach("w").unwrap();
    server.refuse_attaches("w", "busy_here", "w is written; try again");
    match client.attach("w") {
        Err(ChannelError::Remote { code, message }) => {
            assert_eq!(code, "busy_here");
            assert_eq!(message, "w is written; try again");
        }
        other => panic!("a refused name must be refused, got {other:?}"),
    }
    // A name not yet published is refused the same way, and others are not.
    server.refuse_attaches("later", "busy_here", "later");
    assert!(matches!(
        client.attach("later"),
        Err(ChannelError::Remote { .. })
    ));
    assert!(matches!(
        client.attach("nothing"),
        Err(ChannelError::NotFound { .. })
    ));
    // The lease held before stays, and says which connection holds it.
    let leases = server.leases();
    assert_eq!(leases.len(), 1);
    assert_eq!(leases[0].lease, held.lease);
    let connection = leases[0].connection;
    server.allow_attaches("w");
    let again = client.attach("w").unwrap();
    let leases = server.leases();
    assert_eq!(leases.len(), 2);
    assert!(
        leases.iter().all(|l| l.connection == connection),
        "one connection"
    );
    client.release(again.lease).unwrap();
    client.release(held.lease).unwrap();
}
