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

/// `info --json`'s output, parsed.
fn info_json() -> serde_json::Value {
    let o = cuda_ipc(&["info", "--json"]);
    serde_json::from_slice(&o.stdout).expect("JSON on stdout")
}

/// The line of `info`'s text that starts (after its indent) with `prefix`.
fn info_line(prefix: &str) -> String {
    let o = cuda_ipc(&["info"]);
    let out = String::from_utf8_lossy(&o.stdout);
    out.lines()
        .find(|l| l.trim_start().starts_with(prefix))
        .unwrap_or_else(|| panic!("no {prefix:?} line: {out}"))
        .to_owned()
}

#[test]
fn info_json_without_a_driver_is_json() {
    let v = info_json();
    assert!(v["error"].as_str().unwrap().contains("CUDA driver"));
    assert!(v["environment"]["notes"].is_array());
}

/// `info` measures this machine's wake-up floor (no GPU needed): the JSON
/// has both medians, the text says them.
#[test]
fn info_reports_the_machines_wake_up_floor() {
    let v = info_json();
    let wake = &v["environment"]["wake"];
    assert_eq!(wake["idle_ms"], 1.0, "{wake}");
    assert_eq!(wake["samples"], 21, "{wake}");
    assert!(wake["asleep"].as_u64().is_some_and(|n| n <= 21), "{wake}");
    for key in ["asleep_p50_ms", "spinning_p50_ms"] {
        let ms = wake[key]
            .as_f64()
            .unwrap_or_else(|| panic!("{key}: {wake}"));
        assert!(ms > 0.0 && ms < 1000.0, "{key}: {wake}");
    }
    let line = info_line("wake-up:");
    assert!(
        line.contains("reaches a thread asleep for 1 ms in") && line.contains("p50 of 21"),
        "{line}"
    );
}

/// `info` says how this machine's processors idle (what a sleeping
/// consumer's wake-up pays): the JSON holds what the kernel lists here, the
/// text the same description.
#[test]
fn info_reports_how_the_processors_idle() {
    let v = info_json();
    let env = &v["environment"];
    let idle: cuda_ipc_bench::idle::IdleStates =
        serde_json::from_value(env["idle"].clone()).expect("the idle states");
    assert_eq!(idle, cuda_ipc_bench::idle::IdleStates::read(), "{env}");
    let text = env["idle_text"].as_str().expect("idle_text");
    assert_eq!(text, idle.describe());
    let line = info_line("idle processors:");
    assert!(line.ends_with(text), "{line}");
}

#[test]
fn info_reports_containers_namespaces_and_pidfd_getfd() {
    let v = info_json();
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
