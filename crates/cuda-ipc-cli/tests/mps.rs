//! MPS without a GPU or MPS: what `info` says about the control daemon, and
//! `demo --stream --mps` with a stand-in `nvidia-cuda-mps-control` (a
//! shell script that records its calls): started, stopped, and its exit
//! code and errors when the demo itself fails. `CUDA_IPC_DISABLE_DRIVER`
//! makes the driver missing on GPU hosts too.

use std::path::Path;
use std::process::{Command, Output, Stdio};

/// `cuda-ipc ARGS` without a driver, with PATH holding `dir`/bin first,
/// TMPDIR `dir`/tmp and CUDA_MPS_PIPE_DIRECTORY `pipe` (unset if None).
fn run(dir: &Path, pipe: Option<&Path>, args: &[&str]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_cuda-ipc"));
    c.args(args)
        .env("CUDA_IPC_DISABLE_DRIVER", "1")
        .env(
            "PATH",
            format!("{}:/usr/bin:/bin", dir.join("bin").display()),
        )
        .env("TMPDIR", dir.join("tmp"))
        .env_remove("CUDA_MPS_PIPE_DIRECTORY")
        .stdin(Stdio::null());
    if let Some(p) = pipe {
        c.env("CUDA_MPS_PIPE_DIRECTORY", p);
    }
    c.output().expect("run cuda-ipc")
}

fn scratch() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("bin")).unwrap();
    std::fs::create_dir_all(dir.path().join("tmp")).unwrap();
    dir
}

/// A stand-in control program: `-d` makes the control entry, `quit`
/// removes it; every call is recorded in `dir`/record.
fn fake_control(dir: &Path) {
    use std::os::unix::fs::PermissionsExt as _;
    let record = dir.join("record");
    let script = format!(
        "#!/bin/sh\n\
         echo \"call $* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY\" >> '{r}'\n\
         if [ \"$1\" = -d ]; then touch \"$CUDA_MPS_PIPE_DIRECTORY/control\"; exit 0; fi\n\
         read -r cmd; echo \"got $cmd\" >> '{r}'\n\
         rm -f \"$CUDA_MPS_PIPE_DIRECTORY/control\"\n",
        r = record.display()
    );
    let path = dir.join("bin/nvidia-cuda-mps-control");
    std::fs::write(&path, script).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn info_says_when_no_mps_daemon_answers() {
    let dir = scratch();
    let pipe = dir.path().join("pipe");
    let o = run(dir.path(), Some(&pipe), &["info"]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(3), "{err}");
    let line = out
        .lines()
        .find(|l| l.trim_start().starts_with("MPS:"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(
        line.contains("no MPS control daemon at") && line.contains(pipe.to_str().unwrap()),
        "{line}"
    );
    assert!(line.contains("(CUDA_MPS_PIPE_DIRECTORY)"), "{line}");
    assert!(
        out.contains("what MPS changes: processes on one GPU share it"),
        "{out}"
    );
    // The default folder when the variable is not set.
    let o = run(dir.path(), None, &["info", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON on stdout");
    let mps = &v["environment"]["mps"];
    assert_eq!(mps["pipe_directory"], "/tmp/nvidia-mps", "{mps}");
    assert_eq!(mps["from_environment"], false, "{mps}");
    assert!(
        v["environment"]["mps_text"]
            .as_str()
            .unwrap()
            .contains("the default")
    );
}

#[test]
fn info_says_when_an_mps_daemon_answers() {
    let dir = scratch();
    let pipe = dir.path().join("pipe");
    std::fs::create_dir_all(&pipe).unwrap();
    let _listener = std::os::unix::net::UnixListener::bind(pipe.join("control")).unwrap();
    let o = run(dir.path(), Some(&pipe), &["info", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON on stdout");
    assert_eq!(
        v["environment"]["mps"]["control"]["state"], "reachable",
        "{v}"
    );
    let o = run(dir.path(), Some(&pipe), &["info"]);
    let (out, _) = text(&o);
    assert!(out.contains("an MPS control daemon answers at"), "{out}");
}

#[test]
fn demo_mps_needs_stream_and_no_namespaces() {
    let dir = scratch();
    let o = run(dir.path(), None, &["demo", "--mps"]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--mps") && err.contains("--stream"), "{err}");
    let o = run(
        dir.path(),
        None,
        &["demo", "--stream", "--mps", "--consumer-namespaces", "pid"],
    );
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("do not go together"), "{err}");
    assert!(!dir.path().join("record").exists(), "no daemon was started");
}

#[test]
fn demo_mps_without_the_control_program_says_what_to_install() {
    let dir = scratch();
    let o = run(dir.path(), None, &["demo", "--stream", "--mps"]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(
        err.contains("nvidia-cuda-mps-control") && err.contains("not on PATH"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn demo_mps_runs_the_demo_as_a_client_and_stops_the_daemon() {
    let dir = scratch();
    fake_control(dir.path());
    // The demo under the daemon finds no driver: its exit code (3) and
    // its error come through, and the daemon is stopped.
    let o = run(
        dir.path(),
        None,
        &["demo", "--stream", "--mps", "--seconds", "1"],
    );
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(err.contains("CUDA driver"), "{err}");
    let record = std::fs::read_to_string(dir.path().join("record")).unwrap();
    let first = record.lines().next().unwrap();
    let tmp = dir.path().join("tmp");
    assert!(
        first.starts_with("call -d pipe=") && first.contains(tmp.to_str().unwrap()),
        "{record}"
    );
    assert!(record.contains("got quit"), "{record}");
    let t = std::time::Instant::now();
    while std::fs::read_dir(&tmp).unwrap().next().is_some() {
        assert!(t.elapsed().as_secs() < 10, "the private folder stayed");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}
