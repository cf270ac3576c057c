//! The command-line contract, without a GPU: parsing, exit codes and the
//! no-driver path. `CUDA_IPC_DISABLE_DRIVER` makes the no-driver path
//! deterministic on GPU hosts too.

use std::process::{Command, Output, Stdio};

fn cuda_ipc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cuda-ipc"))
        .args(args)
        .env("CUDA_IPC_DISABLE_DRIVER", "1")
        .stdin(Stdio::null())
        .output()
        .expect("run cuda-ipc")
}

fn code(o: &Output) -> i32 {
    o.status.code().expect("exited, not killed")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn assert_no_panic(o: &Output) {
    let e = stderr(o);
    assert!(!e.contains("panicked"), "cuda-ipc panicked: {e}");
}

const HANDLE: &str = "abababababababababababababababababababababababababababababababababababababababababababababababababababababababababababababababab";

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
        &["attach", "--socket", "/nonexistent/x.sock"],
        &["demo", "--stream", "--seconds", "1"],
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
            "not a number of seconds",
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
