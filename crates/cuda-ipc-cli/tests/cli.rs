//! The command-line contract, without a GPU: parsing, exit codes and the
//! no-driver path. `CUDA_IPC_DISABLE_DRIVER` makes the no-driver path
//! deterministic on GPU hosts too.

mod common;

use std::process::{Command, Stdio};

use common::*;

#[test]
fn every_subcommand_has_help() {
    for sub in ["info", "demo", "export", "open", "serve", "attach", "bench"] {
        let o = cuda_ipc(&[sub, "--help"]);
        assert_eq!(code(&o), 0, "{sub} --help: {}", stderr(&o));
        assert!(
            String::from_utf8_lossy(&o.stdout).contains("Usage"),
            "{sub}"
        );
    }
}

#[test]
fn no_driver_exits_3_with_a_clear_message() {
    for args in [
        &["info"][..],
        &["info", "--json"],
        &["demo"],
        &["demo", "--mechanism", "vmm", "--size", "2MiB"],
        &[
            "export",
            "--size",
            "4096",
            "--fill-u32",
            "0x1",
            "--mechanism",
            "legacy",
        ],
        &[
            "export",
            "--size",
            "1MiB",
            "--offset",
            "4096",
            "--fill-u32",
            "7",
        ],
        &[
            "open",
            "--handle",
            HANDLE,
            "--size",
            "4096",
            "--expect-u32",
            "1",
        ],
        &["serve", "--size", "1MiB", "--fill-u32", "3"],
        &["demo", "--stream", "--seconds", "1"],
        &["demo", "--stream", "--seconds", "1.5s"],
        &["demo", "--stream", "--seconds", "500ms"],
        &[
            "serve",
            "--size",
            "4096",
            "--fill-u32",
            "1",
            "--release-timeout",
            "1m",
        ],
        &["bench", "--quick", "--no-torch"],
        &["bench", "--quick", "--devices", "0,1", "--only", "peer"],
    ] {
        let o = cuda_ipc(args);
        assert_no_panic(&o);
        assert_eq!(code(&o), 3, "{args:?}: {}", stderr(&o));
        let text = stderr(&o) + &String::from_utf8_lossy(&o.stdout);
        assert!(text.contains("libcuda.so.1"), "{args:?}: {text}");
    }
}

#[test]
fn info_json_without_a_driver_is_json() {
    let o = cuda_ipc(&["info", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON on stdout");
    assert!(v["error"].as_str().unwrap().contains("CUDA driver"));
    assert!(v["environment"]["notes"].is_array());
}

#[test]
fn info_reports_containers_namespaces_and_pidfd_getfd() {
    let o = cuda_ipc(&["info", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON on stdout");
    let env = &v["environment"];
    assert!(env["container"].is_boolean(), "{env}");
    assert!(env["container_reasons"].is_array(), "{env}");
    assert!(env["pidfd_getfd"]["allowed"].is_boolean(), "{env}");
    let kinds: Vec<&str> = env["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["kind"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        ["cgroup", "ipc", "mnt", "net", "pid", "time", "user", "uts"]
    );
    // In a new PID namespace (where root may create one), the pid namespace
    // is reported as its own and the process as containerised.
    let probe = Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "true"])
        .output();
    if !probe.is_ok_and(|p| p.status.success()) {
        println!("skipped the PID namespace half: unshare --pid is not allowed here");
        return;
    }
    let o = Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "--"])
        .arg(env!("CARGO_BIN_EXE_cuda-ipc"))
        .args(["info", "--json"])
        .env("CUDA_IPC_DISABLE_DRIVER", "1")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON on stdout");
    let env = &v["environment"];
    assert_eq!(env["container"], true, "{env}");
    assert!(
        env["namespaces_not_initial"]
            .as_array()
            .unwrap()
            .contains(&"pid".into()),
        "{env}"
    );
}

#[test]
fn bad_input_exits_2_naming_the_problem() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["export", "--size", "12XB", "--fill-u32", "1"],
            "unknown unit",
        ),
        (
            &["export", "--size", "4096", "--fill-u32", "0x1_0000_0000"],
            "32-bit",
        ),
        (
            &["export", "--size", "6", "--fill-u32", "1"],
            "multiple of 4",
        ),
        (
            &[
                "export",
                "--size",
                "4096",
                "--fill-u32",
                "1",
                "--mechanism",
                "carrier-pigeon",
            ],
            "not one of",
        ),
        (&["demo", "--size", "0"], "positive multiple of 4"),
        (&["open"], "required"),
        (
            &["open", "--handle", "xyz", "--size", "4096"],
            "not a hex digit",
        ),
        (
            &["open", "--handle", "abcd", "--size", "4096"],
            "expected 128 hex digits",
        ),
        (&["open", "--descriptor", "{\"cuda_ipc\":1}"], "mechanism"),
        (&["open", "--descriptor", "not json"], "not valid JSON"),
        (
            &["open", "--descriptor", "{\"cuda_ipc\":2}"],
            "format 2 is not supported",
        ),
        (&["open", "--size", "4096"], "required"),
        (&["frobnicate"], "unrecognized subcommand"),
        (
            &["serve", "--size", "6", "--fill-u32", "1"],
            "multiple of 4",
        ),
        (
            &["demo", "--stream", "--seconds", "soon"],
            "expected a duration",
        ),
        (&["bench", "--devices", "0,0"], "the two GPUs must differ"),
        (&["bench", "--devices", "0"], "two device ordinals"),
        (
            &["bench", "--only", "peer"],
            "the peer section needs two GPUs",
        ),
    ];
    for (args, why) in cases {
        let o = cuda_ipc(args);
        assert_no_panic(&o);
        assert_eq!(code(&o), 2, "{args:?}: {}", stderr(&o));
        assert!(
            stderr(&o).contains(why),
            "{args:?}: expected {why:?} in {}",
            stderr(&o)
        );
    }
}

#[test]
fn a_descriptor_is_validated_before_the_driver_is_needed() {
    let d = r#"{"cuda_ipc":1,"mechanism":"legacy","handle":"HANDLE","alloc_size":4096,"offset":4096,"len":4,"dtype":"u32","device_uuid":"GPU-00000000-0000-0000-0000-000000000000","pid":1}"#
        .replace("HANDLE", HANDLE);
    let o = cuda_ipc(&["open", "--descriptor", &d]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("passes the end"), "{}", stderr(&o));
    let fixed = d.replace("\"offset\":4096", "\"offset\":0");
    let o = cuda_ipc(&["open", "--descriptor", &fixed]);
    assert_eq!(
        code(&o),
        3,
        "a valid descriptor reaches the driver check: {}",
        stderr(&o)
    );
}

#[test]
fn durations_take_units_and_have_a_limit() {
    for (args, why) in [
        (
            &["demo", "--stream", "--seconds", "1e20"][..],
            "expected a duration",
        ),
        (
            &["demo", "--stream", "--seconds", "31d"],
            "longer than 30 days",
        ),
        (
            &["demo", "--stream", "--seconds", "-1"],
            "must be non-negative",
        ),
        (
            &[
                "serve",
                "--size",
                "4096",
                "--fill-u32",
                "1",
                "--release-timeout",
                "1e20",
            ],
            "expected a duration",
        ),
        (
            &[
                "serve",
                "--size",
                "4096",
                "--fill-u32",
                "1",
                "--release-timeout",
                "99999999999999999999999s",
            ],
            "longer than 30 days",
        ),
    ] {
        assert_error(args, &cuda_ipc(args), 2, why);
    }
}

#[test]
fn negative_numbers_say_they_must_be_non_negative() {
    let cases: &[&[&str]] = &[
        &["demo", "--size", "-4096"],
        &["demo", "--device", "-1"],
        &["demo", "--stream", "--slots", "-2"],
        &["export", "--size", "4096", "--fill-u32", "-1"],
        &[
            "export",
            "--size",
            "4096",
            "--fill-u32",
            "1",
            "--offset",
            "-4",
        ],
        &[
            "serve",
            "--size",
            "4096",
            "--fill-u32",
            "1",
            "--allow-uid",
            "-1",
        ],
        &[
            "serve",
            "--size",
            "4096",
            "--fill-u32",
            "1",
            "--buffers",
            "-1",
        ],
        &["attach", "--allow-uid", "-1"],
        &["attach", "--expect-u32", "-7"],
        &["open", "--handle", HANDLE, "--size", "-4096"],
    ];
    for args in cases {
        assert_error(args, &cuda_ipc(args), 2, "must be non-negative");
    }
}

#[test]
fn a_bad_number_names_the_argument_and_what_it_expected() {
    for (args, why) in [
        (&["demo", "--device", "abc"][..], "'--device <DEVICE>'"),
        (&["demo", "--device", "abc"], "not a device ordinal"),
        (
            &[
                "serve",
                "--size",
                "4096",
                "--fill-u32",
                "1",
                "--allow-uid",
                "abc",
            ],
            "not a user id",
        ),
        (
            &["attach", "--allow-uid", "me"],
            "'--allow-uid <ALLOW_UID>'",
        ),
        (&["demo", "--stream", "--slots", "many"], "not a count"),
    ] {
        assert_error(args, &cuda_ipc(args), 2, why);
    }
}

#[test]
fn a_full_or_closed_standard_output_is_an_error_not_a_panic() {
    for args in [
        &["info"][..],
        &["info", "--json"],
        &["--help"],
        &["demo", "--help"],
    ] {
        let o = command(args)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create("/dev/full").unwrap())
            .output()
            .unwrap();
        assert_error(
            args,
            &o,
            4,
            "cannot write to standard output: No space left",
        );
    }
    // `cuda-ipc info | head -0`: the reader is gone; say nothing more.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let o = command(&["info"])
        .stdin(Stdio::null())
        .stdout(writer)
        .output()
        .unwrap();
    assert_no_panic(&o);
    assert_eq!(code(&o), 4);
    assert_eq!(stderr(&o), "");
}

#[test]
fn info_prints_the_driver_error_once() {
    let o = cuda_ipc(&["info"]);
    let all = stderr(&o) + &String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        all.matches("libcuda.so.1) could not be loaded").count(),
        1,
        "{all}"
    );
    assert_eq!(code(&o), 3);
}

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
fn open_honours_size_and_offset_with_a_descriptor() {
    let d = descriptor(16);
    for (args, exit, why) in [
        (
            vec!["--size", "32"],
            2,
            "passes the end of the described region (16 bytes)",
        ),
        (vec!["--offset", "20"], 2, "passes the end"),
        (vec!["--offset", "8", "--size", "16"], 2, "passes the end"),
        (vec!["--offset", "8"], 3, "libcuda.so.1"),
        (vec!["--offset", "4", "--size", "8"], 3, "libcuda.so.1"),
        (vec!["--size", "16"], 3, "libcuda.so.1"),
    ] {
        let mut full = vec!["open", "--descriptor", &d];
        full.extend(args);
        assert_error(&full, &cuda_ipc(&full), exit, why);
    }
    // With a handle, --size is still required.
    let o = cuda_ipc(&["open", "--handle", HANDLE, "--offset", "8"]);
    assert_error(&["open"], &o, 2, "--size");
}

#[test]
fn a_descriptor_on_standard_input_is_one_bounded_utf8_line() {
    let args = ["open", "--descriptor", "-"];
    let pretty = serde_json::to_string_pretty(
        &serde_json::from_str::<serde_json::Value>(&descriptor(16)).unwrap(),
    )
    .unwrap();
    for (input, exit, why) in [
        (Vec::new(), 2, "standard input is empty"),
        (b"\n".to_vec(), 2, "the first line is empty"),
        (pretty.into_bytes(), 2, "not a whole JSON document"),
        (b"{\"cuda_ipc\":1,\xff}\n".to_vec(), 2, "not UTF-8"),
        (descriptor(16).into_bytes(), 3, "libcuda.so.1"),
        (
            format!("{}\nmore\n", descriptor(16)).into_bytes(),
            3,
            "libcuda.so.1",
        ),
    ] {
        let (o, _) = cuda_ipc_with_input(&args, input);
        assert_error(&args, &o, exit, why);
        if exit == 2 {
            assert!(stderr(&o).contains("one line of JSON"), "{}", stderr(&o));
        }
    }
    // 64 MiB with no newline: refused after 1 MiB, without reading the rest.
    let (o, taken) = cuda_ipc_with_input(&args, vec![b'x'; 64 << 20]);
    assert_error(&args, &o, 2, "longer than 1MiB");
    assert!(taken < 8 << 20, "cuda-ipc read {taken} bytes");
}

#[test]
fn long_arguments_are_not_echoed_in_full() {
    let long = "9".repeat(120_000);
    let junk = "x".repeat(120_000);
    for args in [
        &["demo", "--size", &long][..],
        &["demo", "--device", &long],
        &["demo", "--stream", "--seconds", &long],
        &["export", "--size", "4096", "--fill-u32", &long],
        &["attach", "--socket", &junk],
        &["open", "--descriptor", &junk],
        &[&junk],
        &["info", &junk],
    ] {
        let o = cuda_ipc(args);
        assert_no_panic(&o);
        assert_eq!(code(&o), 2, "{}", &stderr(&o)[..200.min(stderr(&o).len())]);
        assert!(
            stderr(&o).len() < 1200,
            "{} bytes: {}",
            stderr(&o).len(),
            &stderr(&o)[..1200]
        );
    }
}

#[test]
fn a_descriptor_with_a_key_twice_or_a_huge_size_is_refused() {
    let d = descriptor(16);
    let twice = d.replacen('{', "{\"len\":4,", 1);
    assert_error(
        &["open"],
        &cuda_ipc(&["open", "--descriptor", &twice]),
        2,
        "appears twice",
    );
    let huge = d.replace("\"alloc_size\":4096", "\"alloc_size\":18446744073709551616");
    assert_error(
        &["open"],
        &cuda_ipc(&["open", "--descriptor", &huge]),
        2,
        "too large",
    );
}

#[test]
fn a_descriptor_quoting_a_long_value_is_cut_short() {
    let long = "q".repeat(5000);
    let d = descriptor(16);
    for (from, to) in [
        (
            "\"mechanism\":\"legacy\"",
            format!("\"mechanism\":\"{long}\""),
        ),
        ("\"dtype\":\"u32\"", format!("\"dtype\":\"{long}\"")),
        ("\"pid\":1", format!("\"pid\":1,\"{long}\":1")),
    ] {
        let bad = d.replace(from, &to);
        let o = cuda_ipc(&["open", "--descriptor", &bad]);
        assert_error(&["open"], &o, 2, "more characters");
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
