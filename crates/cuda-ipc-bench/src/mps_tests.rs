//! The MPS module without a GPU or MPS: a stand-in `nvidia-cuda-mps-control`
//! (a shell script) on a private PATH starts, refuses or stalls; the guard's
//! folders, variables and cleanup are checked against what it recorded.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::*;

/// A fresh folder for one test, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir =
            std::env::temp_dir().join(format!("cuda-ipc-mps-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("bin")).unwrap();
        std::fs::create_dir_all(dir.join("tmp")).unwrap();
        Scratch(dir)
    }
    fn bin(&self) -> std::ffi::OsString {
        self.0.join("bin").into_os_string()
    }
    fn tmp(&self) -> PathBuf {
        self.0.join("tmp")
    }
    fn record(&self) -> String {
        std::fs::read_to_string(self.0.join("record")).unwrap_or_default()
    }
    /// Installs a stand-in control program: `start` is the shell run for
    /// `-d` (after the call is recorded); `quit` removes the control entry.
    fn control(&self, start: &str) {
        let record = self.0.join("record");
        let script = format!(
            "#!/bin/sh\n\
             echo \"call $* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY\" >> '{r}'\n\
             if [ \"$1\" = -d ]; then\n{start}\nexit $?\nfi\n\
             read -r cmd\n\
             echo \"got $cmd\" >> '{r}'\n\
             [ \"$cmd\" = quit ] && rm -f \"$CUDA_MPS_PIPE_DIRECTORY/control\"\n\
             exit 0\n",
            r = record.display()
        );
        let path = self.0.join("bin").join(CONTROL_PROGRAM);
        std::fs::write(&path, script).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    /// What is left in the temporary folder.
    fn left(&self) -> Vec<String> {
        std::fs::read_dir(self.tmp())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const STARTS: &str = "touch \"$CUDA_MPS_PIPE_DIRECTORY/control\"";

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let t = std::time::Instant::now();
    while !f() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn finds_only_executable_files_on_the_path() {
    let s = Scratch::new("find");
    assert_eq!(find_program(CONTROL_PROGRAM, &s.bin()), None);
    let plain = s.0.join("bin").join(CONTROL_PROGRAM);
    std::fs::write(&plain, "#!/bin/sh\n").unwrap();
    assert_eq!(
        find_program(CONTROL_PROGRAM, &s.bin()),
        None,
        "not executable"
    );
    s.control(STARTS);
    let path = std::env::join_paths([Path::new("/no/such/dir"), &s.0.join("bin")]).unwrap();
    assert_eq!(find_program(CONTROL_PROGRAM, &path), Some(plain));
    assert_eq!(find_program(CONTROL_PROGRAM, OsStr::new("")), None);
}

#[test]
fn a_missing_program_says_what_to_install_and_leaves_nothing() {
    let s = Scratch::new("missing");
    let e = PrivateDaemon::start_with(&s.bin(), &s.tmp()).unwrap_err();
    let StartError::Missing(why) = &e else {
        panic!("{e:?}")
    };
    assert!(
        why.contains("nvidia-cuda-mps-control") && why.contains("PATH"),
        "{why}"
    );
    assert!(why.contains("without --mps"), "{why}");
    assert_eq!(
        cuda_ipc::Error::from(e).kind(),
        cuda_ipc::ErrorKind::Unavailable
    );
    assert!(s.left().is_empty(), "{:?}", s.left());
}

#[test]
fn starts_with_private_folders_and_stops_when_dropped() {
    let s = Scratch::new("start");
    s.control(STARTS);
    let d = PrivateDaemon::start_with(&s.bin(), &s.tmp()).unwrap();
    let (pipe, log) = (
        d.pipe_directory().to_path_buf(),
        d.log_directory().to_path_buf(),
    );
    let root = pipe.parent().unwrap().to_path_buf();
    assert_eq!(root.parent(), Some(s.tmp().as_path()));
    assert!(
        root.file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("cuda-ipc-mps-")
    );
    assert_eq!(log.parent(), Some(root.as_path()));
    for dir in [&root, &pipe, &log] {
        let mode = std::fs::metadata(dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700, "{}", dir.display());
    }
    // The daemon got the same variables its clients get.
    let want = format!("call -d pipe={} log={}", pipe.display(), log.display());
    assert_eq!(s.record().lines().next(), Some(want.as_str()));
    let c = d.command("true");
    let env: Vec<_> = c.get_envs().collect();
    assert!(env.contains(&(OsStr::new(PIPE_VAR), Some(pipe.as_os_str()))));
    assert!(env.contains(&(OsStr::new(LOG_VAR), Some(log.as_os_str()))));
    // Our own environment is left alone.
    assert_ne!(
        std::env::var_os(PIPE_VAR).as_deref(),
        Some(pipe.as_os_str())
    );
    drop(d);
    let record = s.record();
    assert!(
        record.contains(&format!("call  pipe={}", pipe.display())),
        "{record}"
    );
    assert!(record.contains("got quit"), "{record}");
    assert!(!root.exists(), "the folder is removed");
    assert!(s.left().is_empty(), "{:?}", s.left());
}

#[test]
fn stopping_twice_quits_once() {
    let s = Scratch::new("twice");
    s.control(STARTS);
    let mut d = PrivateDaemon::start_with(&s.bin(), &s.tmp()).unwrap();
    assert_eq!(d.stop(), Ok(()));
    assert_eq!(d.stop(), Ok(()));
    drop(d);
    assert_eq!(s.record().matches("got quit").count(), 1, "{}", s.record());
}

#[test]
fn a_daemon_that_refuses_to_start_is_an_error_naming_its_words() {
    let s = Scratch::new("refuses");
    s.control("echo 'An instance of this daemon is already running' >&2; exit 1");
    let e = PrivateDaemon::start_with(&s.bin(), &s.tmp()).unwrap_err();
    let StartError::Failed(why) = &e else {
        panic!("{e:?}")
    };
    assert!(why.contains("did not start"), "{why}");
    assert!(why.contains("already running"), "{why}");
    assert!(why.contains("without --mps"), "{why}");
    assert_eq!(cuda_ipc::Error::from(e).kind(), cuda_ipc::ErrorKind::Failed);
    assert!(
        !s.record().contains("got quit"),
        "nothing to stop: {}",
        s.record()
    );
    assert!(s.left().is_empty(), "{:?}", s.left());
}

#[test]
fn a_daemon_whose_socket_never_appears_is_an_error() {
    let s = Scratch::new("stalls");
    s.control("exit 0");
    let e =
        PrivateDaemon::start_within(&s.bin(), &s.tmp(), Duration::from_millis(200)).unwrap_err();
    assert!(e.to_string().contains("did not appear"), "{e}");
    assert!(s.left().is_empty(), "{:?}", s.left());
}

#[test]
fn a_start_that_hangs_is_killed() {
    let s = Scratch::new("hangs");
    s.control("exec sleep 30");
    let t = std::time::Instant::now();
    let e =
        PrivateDaemon::start_within(&s.bin(), &s.tmp(), Duration::from_millis(300)).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(10));
    assert!(e.to_string().contains("did not finish"), "{e}");
    assert!(s.left().is_empty(), "{:?}", s.left());
}

#[test]
fn the_watchdog_stops_the_daemon_when_we_are_gone() {
    let s = Scratch::new("watchdog");
    s.control(STARTS);
    let mut d = PrivateDaemon::start_with(&s.bin(), &s.tmp()).unwrap();
    let root = d.pipe_directory().parent().unwrap().to_path_buf();
    // Our death closes the watchdog's standard input without a word.
    drop(d.watchdog_in.take());
    let mut w = d.watchdog.take().unwrap();
    wait_until("the watchdog", || w.try_wait().unwrap().is_some());
    assert!(s.record().contains("got quit"), "{}", s.record());
    assert!(!root.exists());
    d.stopped = true;
}

#[test]
fn a_long_temporary_folder_falls_back_to_tmp() {
    let long = Path::new("/nonexistent").join("x".repeat(120));
    let root = make_root(&long).unwrap();
    assert!(
        root.to_string_lossy().starts_with("/tmp/cuda-ipc-mps-"),
        "{}",
        root.display()
    );
    assert!(root.join("pipe/control_privileged").as_os_str().len() < 108);
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn detects_no_daemon_a_stale_socket_and_a_live_one() {
    let s = Scratch::new("detect");
    let dir = s.0.join("pipe");
    let d = detect_in(&dir, false);
    assert_eq!(d.control, ControlState::Absent);
    assert!(
        d.describe().contains("no MPS control daemon"),
        "{}",
        d.describe()
    );
    assert!(d.describe().contains("CUDA_MPS_PIPE_DIRECTORY is not set"));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("control"), "").unwrap();
    let d = detect_in(&dir, true);
    assert!(
        matches!(&d.control, ControlState::Unreachable { why } if why.contains("not a socket"))
    );
    std::fs::remove_file(dir.join("control")).unwrap();
    let listener = std::os::unix::net::UnixListener::bind(dir.join("control")).unwrap();
    let d = detect_in(&dir, true);
    assert_eq!(d.control, ControlState::Reachable);
    assert!(
        d.describe().contains("(CUDA_MPS_PIPE_DIRECTORY)"),
        "{}",
        d.describe()
    );
    drop(listener); // the socket file stays, as a dead daemon's does
    let d = detect_in(&dir, true);
    assert!(
        matches!(d.control, ControlState::Unreachable { .. }),
        "{d:?}"
    );
    assert!(
        d.describe().contains("no daemon answers"),
        "{}",
        d.describe()
    );
    let v = serde_json::to_value(&d).unwrap();
    assert_eq!(v["control"]["state"], "unreachable");
}

/// The MPS control daemon listens on a socket that is not a stream socket
/// (the H200's answered a stream connection with EPROTOTYPE): a live one
/// of another type is found, and stays unreachable once its process is gone.
#[test]
fn detects_a_live_control_socket_of_another_type() {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketType, bind, listen, socket};
    let s = Scratch::new("seqpacket");
    let dir = s.0.join("pipe");
    std::fs::create_dir_all(&dir).unwrap();
    let sock = socket(AddressFamily::UNIX, SocketType::SEQPACKET, None).unwrap();
    bind(&sock, &SocketAddrUnix::new(dir.join("control")).unwrap()).unwrap();
    listen(&sock, 4).unwrap();
    let d = detect_in(&dir, true);
    assert_eq!(d.control, ControlState::Reachable, "{d:?}");
    drop(sock);
    let d = detect_in(&dir, true);
    assert!(
        matches!(d.control, ControlState::Unreachable { .. }),
        "{d:?}"
    );
}
