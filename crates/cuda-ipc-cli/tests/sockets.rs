//! The commands that meet over a Unix socket (serve, attach, the set mode,
//! the demo's consumer), without a GPU: their arguments are checked before
//! the driver is needed, and the demo's consumer runs in new namespaces.

mod common;

use std::process::Stdio;

use common::*;

#[test]
fn socket_paths_are_checked_before_the_driver() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("file");
    std::fs::write(&file, "").unwrap();
    let file = file.to_str().unwrap();
    let sub = dir.path().to_str().unwrap();
    let missing = dir.path().join("missing.sock");
    let missing = missing.to_str().unwrap();
    let no_dir = dir.path().join("no/such/dir.sock");
    let no_dir = no_dir.to_str().unwrap();
    let long_name = "n".repeat(200);
    let serve = |socket: &str| -> Vec<String> {
        [
            "serve",
            "--size",
            "4096",
            "--fill-u32",
            "1",
            "--socket",
            socket,
        ]
        .iter()
        .map(ToString::to_string)
        .collect()
    };
    let cases: Vec<(Vec<String>, i32, &str)> = vec![
        (
            vec!["attach".into(), "--socket".into(), "/etc/passwd".into()],
            2,
            "is a regular file, not a socket",
        ),
        (
            vec![
                "attach".into(),
                "--list".into(),
                "--socket".into(),
                file.into(),
            ],
            2,
            "is a regular file, not a socket",
        ),
        (
            vec!["attach".into(), "--socket".into(), sub.into()],
            2,
            "is a directory, not a socket",
        ),
        (
            vec!["attach".into(), "--socket".into(), String::new()],
            2,
            "--socket: it is empty",
        ),
        (
            vec!["attach".into(), "--socket".into(), "a:b".into()],
            2,
            "is not a socket name",
        ),
        (
            vec!["attach".into(), "--socket".into(), long_name.clone()],
            2,
            "more characters",
        ),
        (
            vec!["attach".into(), "--socket".into(), missing.into()],
            4,
            "nothing serves there",
        ),
        (
            vec![
                "attach".into(),
                "--list".into(),
                "--socket".into(),
                missing.into(),
            ],
            4,
            "nothing serves there",
        ),
        (serve(file), 2, "refusing to replace it"),
        (serve(sub), 2, "is a directory, not a socket"),
        (serve(""), 2, "--socket: it is empty"),
        (serve("bad name"), 2, "is not a socket name"),
        (serve(no_dir), 2, "does not exist"),
        (
            serve(&format!("/tmp/{}", "x".repeat(120))),
            2,
            "at most 107",
        ),
    ];
    for (args, exit, why) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        assert_error(&args, &cuda_ipc(&args), exit, why);
    }
}

#[test]
fn a_real_socket_gets_as_far_as_the_driver() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let path = path.to_str().unwrap();
    for args in [
        &["attach", "--socket", path][..],
        &[
            "serve",
            "--size",
            "4096",
            "--fill-u32",
            "1",
            "--socket",
            path,
        ],
        &["attach", "--socket", "some-name-nobody-serves-on"],
    ] {
        let o = cuda_ipc(args);
        assert_no_panic(&o);
        let exit = if args.contains(&"some-name-nobody-serves-on") {
            4
        } else {
            3
        };
        assert_eq!(code(&o), exit, "{args:?}: {}", stderr(&o));
    }
}

#[test]
fn set_mode_arguments_are_checked_before_the_driver() {
    let cases: &[(&[&str], &str)] = &[
        // Sizes that cannot be drawn: fewer bytes than one fp32 word per
        // buffer, a size not in words, no buffer at all.
        (
            &["serve", "--set", "3", "--size", "8"],
            "cannot draw 3 buffers",
        ),
        (
            &["serve", "--set", "2", "--size", "1026"],
            "cannot draw 2 buffers",
        ),
        (
            &["serve", "--set", "0", "--size", "4096"],
            "cannot draw 0 buffers",
        ),
        (
            &["demo", "--set", "100", "--size", "256"],
            "cannot draw 100 buffers",
        ),
        (&["serve", "--set", "-1", "--size", "4096"], "negative"),
        (&["serve", "--set", "many", "--size", "4096"], "not a count"),
        // A set has its own values and names.
        (
            &["serve", "--set", "2", "--size", "4096", "--fill-u32", "1"],
            "cannot be used with",
        ),
        (
            &["serve", "--set", "2", "--size", "4096", "--buffers", "3"],
            "cannot be used with",
        ),
        (&["serve", "--size", "4096"], "--fill-u32"),
        (&["demo", "--set", "2", "--stream"], "cannot be used with"),
        (
            &["attach", "--set", "weights", "--buffer", "buf0"],
            "cannot be used with",
        ),
        (
            &["attach", "--set", "weights", "--expect-u32", "1"],
            "cannot be used with",
        ),
        (
            &["attach", "--set", "weights", "--list"],
            "cannot be used with",
        ),
        (&["attach", "--set"], "a value is required"),
    ];
    for (args, why) in cases {
        let o = cuda_ipc(args);
        assert_no_panic(&o);
        assert_eq!(code(&o), 2, "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(why), "{args:?}: {}", stderr(&o));
    }
}

#[test]
fn set_mode_with_good_arguments_gets_as_far_as_the_driver() {
    // The same draw as the benchmark's weight sets; without a driver the
    // commands stop at the device with the no-driver exit, not a usage error.
    for args in [
        &[
            "serve",
            "--set",
            "3",
            "--size",
            "12",
            "--socket",
            "set-mode-args-test",
        ][..],
        &["demo", "--set", "1000", "--size", "64MiB"][..],
    ] {
        let o = cuda_ipc(args);
        assert_no_panic(&o);
        let e = stderr(&o);
        assert_eq!(code(&o), 3, "{args:?}: {e}");
        assert!(e.contains("libcuda"), "{args:?}: {e}");
    }
}

#[test]
fn demo_consumer_namespaces_are_checked_before_the_driver() {
    for args in [
        &["demo", "--consumer-namespaces", "pid,net"][..],
        &["demo", "--stream", "--consumer-namespaces", "uts"],
    ] {
        let o = cuda_ipc(args);
        assert_error(
            args,
            &o,
            2,
            "is not a namespace a consumer can be given; choose from pid, ipc, mount, user, shm",
        );
    }
    for args in [
        &["demo", "--consumer-namespaces", "shm,ipc,shm"][..],
        &["demo", "--stream", "--consumer-namespaces", "ipc,ipc"],
        &["demo", "--set", "4", "--consumer-namespaces", "pid,pid"],
    ] {
        let o = cuda_ipc(args);
        assert_error(args, &o, 2, "names");
        assert!(stderr(&o).contains("twice; give each namespace once"));
    }
    // Without unshare: exit 3, saying so, before the driver is loaded.
    let o = command(&["demo", "--consumer-namespaces", "pid,ipc"])
        .env("PATH", "/nonexistent")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_error(&[], &o, 3, "util-linux `unshare` is not installed");
    assert!(!stderr(&o).contains("libcuda"), "{}", stderr(&o));
}

/// The demo's consumer, this executable, started through the same wrapper
/// the demo uses, in new PID, IPC and mount namespaces with a private
/// /dev/shm: it runs, and answers on its standard output.
#[test]
fn the_demo_consumer_runs_in_new_namespaces() {
    use cuda_ipc_bench::namespaces::{ConsumerNamespaces, Namespace};
    let ns = ConsumerNamespaces::new(&[Namespace::Pid, Namespace::Ipc, Namespace::Shm]).unwrap();
    if let Err(e) = ns.check_allowed() {
        println!("skipped: {e}");
        return;
    }
    let exe = env!("CARGO_BIN_EXE_cuda-ipc");
    let help = ns.command(exe).arg("--help").output().unwrap();
    assert!(help.status.success(), "{}", stderr(&help));
    assert!(String::from_utf8_lossy(&help.stdout).contains("Usage: cuda-ipc"));
    // The consumer of `demo --consumer-namespaces`: without a driver it
    // answers with the error, as one JSON line.
    let o = ns
        .command(exe)
        .args(["__demo-consumer", "--socket", "/nonexistent/demo.sock"])
        .env("CUDA_IPC_DISABLE_DRIVER", "1")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_no_panic(&o);
    let line = String::from_utf8_lossy(&o.stdout);
    let v: serde_json::Value = serde_json::from_str(line.trim()).expect("one JSON line");
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains("CUDA_IPC_DISABLE_DRIVER"),
        "{v}"
    );
    // With the namespaces allowed, the demo gets as far as the driver.
    for extra in [&[][..], &["--stream"], &["--set", "3", "--size", "1MiB"]] {
        let mut args = vec!["demo", "--consumer-namespaces", "pid,ipc,shm"];
        args.extend(extra);
        let o = cuda_ipc(&args);
        assert_error(&args, &o, 3, "CUDA_IPC_DISABLE_DRIVER");
    }
}
