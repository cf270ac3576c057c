//! `cuda-ipc bench` arguments, without a GPU: everything that can be checked
//! without one is an error with exit code 2 before the driver is loaded
//! (`CUDA_IPC_DISABLE_DRIVER` would otherwise make it exit 3).

use std::process::{Command, Output, Stdio};

fn bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cuda-ipc"))
        .arg("bench")
        .args(args)
        .env("CUDA_IPC_DISABLE_DRIVER", "1")
        .stdin(Stdio::null())
        .output()
        .expect("run cuda-ipc")
}

/// Exit code 2, no panic, and `expected` in the one error line.
fn usage_error(args: &[&str], expected: &str) {
    let o = bench(args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    assert!(
        err.contains(expected),
        "{args:?}: expected {expected:?} in {err}"
    );
    assert!(
        !err.contains("no driver") && !err.contains("libcuda"),
        "{err}"
    );
}

#[test]
fn output_paths_are_checked_before_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing/run.json");
    usage_error(
        &["--quick", "--json-out", missing.to_str().unwrap()],
        "does not exist; create it first",
    );
    usage_error(&["--plot", dir.path().to_str().unwrap()], "is a folder");
    let same = dir.path().join("x");
    let same = same.to_str().unwrap();
    usage_error(&["--json-out", same, "--plot", same], "both name");
    // A good path gets past the checks to the driver: exit 3, not 2, and
    // nothing written.
    let good = dir.path().join("run.json");
    let o = bench(&["--quick", "--json-out", good.to_str().unwrap()]);
    assert_eq!(
        o.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(!good.exists());
}

#[test]
fn a_missing_torch_script_is_an_error_up_front() {
    usage_error(
        &["--torch-script", "/nonexistent/torch_share.py"],
        "--torch-script /nonexistent/torch_share.py is not a file",
    );
}

/// The bench refuses `var=bad` before it loads the driver (exit 2, naming
/// the variable and its value), and gets past its checks with `var=good`
/// (to the missing driver: exit 3).
fn env_checked_up_front(var: &str, bad: &str, good: &str) {
    let run = |value: &str| {
        Command::new(env!("CARGO_BIN_EXE_cuda-ipc"))
            .args(["bench", "--quick"])
            .env("CUDA_IPC_DISABLE_DRIVER", "1")
            .env(var, value)
            .stdin(Stdio::null())
            .output()
            .expect("run cuda-ipc")
    };
    let o = run(bad);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains(&format!("{var}={bad:?}")), "{err}");
    let o = run(good);
    assert_eq!(
        o.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn a_pad_that_is_not_a_count_is_an_error_up_front() {
    env_checked_up_front("CUDA_IPC_BENCH_PAD", "1k", "1000");
}

#[test]
fn an_awake_poll_that_is_not_microseconds_is_an_error_up_front() {
    env_checked_up_front("CUDA_IPC_BENCH_AWAKE_US", "20ms", "20000");
    env_checked_up_front("CUDA_IPC_BENCH_AWAKE_US", "60000", "0");
    env_checked_up_front("CUDA_IPC_BENCH_AWAKE_US", "-1", "");
}

#[test]
fn reps_zero_is_an_error() {
    usage_error(&["--reps", "0"], "at least 1 sample");
    usage_error(&["--reps", "-1"], "not a whole number");
}

#[test]
fn duplicates_name_the_duplicate() {
    usage_error(
        &["--mechanisms", "vmm,pool,vmm"],
        "--mechanisms names vmm twice",
    );
    usage_error(
        &["--sizes", "2MiB,2097152"],
        "--sizes names 2MiB (2097152 bytes) twice",
    );
    usage_error(&["--only", "ring,ring"], "--only names ring twice");
}

#[test]
fn mechanisms_are_case_insensitive() {
    // Accepted, so the run gets as far as the (disabled) driver.
    let o = bench(&["--mechanisms", "VMM,Legacy", "--sizes", "2MIB"]);
    assert_eq!(
        o.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    usage_error(&["--mechanisms", "FABRIC"], "\"FABRIC\" is not a mechanism");
}

#[test]
fn device_ordinals_say_what_is_wrong() {
    usage_error(&["--device", "-1"], "\"-1\" is not a device ordinal");
    usage_error(&["--devices", "a,b"], "\"a\" is not a device ordinal");
}

#[test]
fn consumer_namespaces_are_checked_before_the_driver() {
    usage_error(
        &["--consumer-namespaces", "pid,net"],
        "\"net\" is not a namespace a consumer can be given; choose from pid, ipc, mount, user, shm",
    );
    usage_error(
        &["--consumer-namespaces", "pid,ipc,Pid"],
        "--consumer-namespaces names pid twice",
    );
    // No unshare to run the consumers with: exit 3, saying so, before the
    // driver (which would say CUDA_IPC_DISABLE_DRIVER).
    let o = Command::new(env!("CARGO_BIN_EXE_cuda-ipc"))
        .args(["bench", "--quick", "--consumer-namespaces", "pid,ipc"])
        .env("CUDA_IPC_DISABLE_DRIVER", "1")
        .env("PATH", "/nonexistent")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(
        err.contains("util-linux `unshare` is not installed") && !err.contains("libcuda"),
        "{err}"
    );
}

/// A stand-in `nvidia-cuda-mps-control` in `dir`/bin that records its calls
/// in `dir`/record: `-d` makes the control entry, `quit` removes it.
fn fake_mps_control(dir: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt as _;
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let record = dir.join("record");
    let script = format!(
        "#!/bin/sh\n\
         echo \"call $* pipe=$CUDA_MPS_PIPE_DIRECTORY\" >> '{r}'\n\
         if [ \"$1\" = -d ]; then touch \"$CUDA_MPS_PIPE_DIRECTORY/control\"; exit 0; fi\n\
         read -r cmd; echo \"got $cmd\" >> '{r}'\n\
         rm -f \"$CUDA_MPS_PIPE_DIRECTORY/control\"\n",
        r = record.display()
    );
    let path = bin.join("nvidia-cuda-mps-control");
    std::fs::write(&path, script).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::create_dir_all(dir.join("tmp")).unwrap();
}

/// `bench` with PATH holding only `dir`/bin (and the shell's folders) and
/// TMPDIR `dir`/tmp.
fn bench_in(dir: &std::path::Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cuda-ipc"))
        .arg("bench")
        .args(args)
        .env("CUDA_IPC_DISABLE_DRIVER", "1")
        .env(
            "PATH",
            format!("{}:/usr/bin:/bin", dir.join("bin").display()),
        )
        .env("TMPDIR", dir.join("tmp"))
        .stdin(Stdio::null())
        .output()
        .expect("run cuda-ipc")
}

#[test]
fn mps_with_consumer_namespaces_is_refused() {
    usage_error(
        &["--quick", "--mps", "--consumer-namespaces", "pid"],
        "--mps and --consumer-namespaces do not go together",
    );
}

#[test]
fn mps_without_the_control_program_says_what_to_install() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("bin")).unwrap();
    std::fs::create_dir_all(dir.path().join("tmp")).unwrap();
    let o = bench_in(dir.path(), &["--quick", "--mps"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(
        err.contains("nvidia-cuda-mps-control") && err.contains("without --mps"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn an_mps_run_that_fails_later_stops_its_daemon() {
    let dir = tempfile::tempdir().unwrap();
    fake_mps_control(dir.path());
    // The daemon starts, then the driver is missing: exit 3, daemon stopped.
    let o = bench_in(dir.path(), &["--quick", "--mps"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(3), "{err}");
    let record = std::fs::read_to_string(dir.path().join("record")).unwrap();
    let mut lines = record.lines();
    let start = lines.next().unwrap();
    assert!(start.starts_with("call -d pipe="), "{record}");
    assert!(
        start.contains(&dir.path().join("tmp").display().to_string()),
        "{record}"
    );
    assert!(record.contains("got quit"), "{record}");
    // The watchdog has nothing left to do, and the folder is gone.
    let t = std::time::Instant::now();
    while std::fs::read_dir(dir.path().join("tmp"))
        .unwrap()
        .next()
        .is_some()
    {
        assert!(t.elapsed().as_secs() < 10, "the private folder stayed");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}
