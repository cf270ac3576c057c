//! NVIDIA's Multi-Process Service (MPS): whether a control daemon is
//! reachable, and a private one for the length of a run.
//!
//! Without MPS, two processes on one GPU each have a context, and the GPU
//! time-slices between them: a frame handed from one to the other waits
//! for a context switch. Under MPS the processes are clients of one MPS
//! server and share the GPU without switching contexts.
//!
//! A process becomes an MPS client when the driver starts (`cuInit`) and
//! reaches a control daemon through the control socket in
//! `CUDA_MPS_PIPE_DIRECTORY` (default `/tmp/nvidia-mps`); a process that
//! started without one stays outside MPS for its whole life. So a run
//! "under MPS" is a set of processes started with that variable.
//!
//! [`PrivateDaemon`] starts `nvidia-cuda-mps-control -d` with its own pipe
//! and log directories in a fresh temporary folder, gives their variables
//! only to the commands it is asked to prepare ([`PrivateDaemon::command`]),
//! and stops it (`quit` on the control program's standard input, with the
//! same variables) when dropped. A small watchdog (`sh`, in its own process
//! group so that Ctrl-C in a terminal does not reach it) stops the daemon
//! and removes the folder if this process dies first, whatever kills it.
//! Nothing here changes the GPU's compute mode or any other setting.

use std::ffi::OsStr;
use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt as _, FileTypeExt as _};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

/// The MPS control program, looked up on `PATH`.
pub const CONTROL_PROGRAM: &str = "nvidia-cuda-mps-control";
/// The variable naming the pipe directory of the daemon a client reaches.
pub const PIPE_VAR: &str = "CUDA_MPS_PIPE_DIRECTORY";
/// The variable naming the daemon's log directory.
pub const LOG_VAR: &str = "CUDA_MPS_LOG_DIRECTORY";
/// The pipe directory when [`PIPE_VAR`] is not set.
pub const DEFAULT_PIPE_DIRECTORY: &str = "/tmp/nvidia-mps";
/// What MPS changes, in one line.
pub const WHAT_IT_CHANGES: &str = "processes on one GPU share it through one MPS server \
     instead of time-slicing their contexts, so a hand-off between two processes does not wait \
     for a context switch";

/// How long the daemon gets to start, and to stop.
const START_TIMEOUT: Duration = Duration::from_secs(10);
const STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest Unix socket path (sun_path holds 108 bytes with its NUL),
/// less the longest name the daemon puts in its pipe directory.
const MAX_PIPE_DIR: usize = 107 - "/control_privileged".len();

/// What a look at an MPS pipe directory found.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum ControlState {
    /// No control socket there: no daemon for this directory.
    Absent,
    /// The control socket accepted a connection (closed at once, nothing sent).
    Reachable,
    /// There is a control entry, but it does not accept connections.
    Unreachable {
        /// Why (a daemon that died leaves its socket; another user's
        /// daemon may refuse us).
        why: String,
    },
}

/// Whether an MPS control daemon is reachable for this process.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Detected {
    /// The pipe directory looked at.
    pub pipe_directory: PathBuf,
    /// Whether it came from [`PIPE_VAR`] (else the default).
    pub from_environment: bool,
    /// What is there.
    pub control: ControlState,
}

impl Detected {
    /// One line for people.
    pub fn describe(&self) -> String {
        let dir = self.pipe_directory.display();
        let source = if self.from_environment {
            PIPE_VAR
        } else {
            "the default; CUDA_MPS_PIPE_DIRECTORY is not set"
        };
        match &self.control {
            ControlState::Absent => format!(
                "no MPS control daemon at {dir} ({source}): processes here time-slice the GPU"
            ),
            ControlState::Reachable => format!(
                "an MPS control daemon answers at {dir} ({source}): CUDA processes started with \
                 this environment become MPS clients"
            ),
            ControlState::Unreachable { why } => format!(
                "{dir}/control exists ({source}) but no daemon answers there ({why}): processes \
                 here time-slice the GPU"
            ),
        }
    }
}

/// Looks for an MPS control daemon as this process's CUDA driver would:
/// the control socket in [`PIPE_VAR`]'s directory, or the default one.
/// Changes nothing: at most one connection, closed at once with nothing sent.
pub fn detect() -> Detected {
    match std::env::var_os(PIPE_VAR).filter(|v| !v.is_empty()) {
        Some(dir) => detect_in(Path::new(&dir), true),
        None => detect_in(Path::new(DEFAULT_PIPE_DIRECTORY), false),
    }
}

/// [`detect`] for the pipe directory `dir`.
pub fn detect_in(dir: &Path, from_environment: bool) -> Detected {
    let control = dir.join("control");
    let state = match std::fs::symlink_metadata(&control) {
        Err(_) => ControlState::Absent,
        Ok(m) if !m.file_type().is_socket() => ControlState::Unreachable {
            why: "it is not a socket".into(),
        },
        Ok(_) => match answers(&control) {
            Ok(()) => ControlState::Reachable,
            Err(e) => ControlState::Unreachable { why: e.to_string() },
        },
    };
    Detected {
        pipe_directory: dir.to_path_buf(),
        from_environment,
        control: state,
    }
}

/// Whether a process listens on the Unix socket `control`: a stream
/// connection is made and closed at once, nothing sent. The MPS control
/// daemon's socket is not a stream socket: connecting to it as one fails
/// with `EPROTOTYPE`, which the kernel reports only when a socket is bound
/// there (a socket whose process is gone refuses the connection), so that
/// counts as an answer.
fn answers(control: &Path) -> std::io::Result<()> {
    match std::os::unix::net::UnixStream::connect(control) {
        Ok(_) => Ok(()),
        Err(e) if e.raw_os_error() == Some(rustix::io::Errno::PROTOTYPE.raw_os_error()) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Why a private daemon could not be started.
#[derive(Debug, PartialEq, Eq)]
pub enum StartError {
    /// `nvidia-cuda-mps-control` is not on `PATH` (exit 3 in the CLI).
    Missing(String),
    /// It is there but the daemon did not start (exit 4 in the CLI).
    Failed(String),
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StartError::Missing(s) | StartError::Failed(s) => f.write_str(s),
        }
    }
}

impl From<StartError> for cuda_ipc::Error {
    fn from(e: StartError) -> Self {
        match e {
            StartError::Missing(why) => cuda_ipc::Error::Unsupported { what: "MPS", why },
            StartError::Failed(why) => cuda_ipc::Error::Io {
                context: "--mps".into(),
                source: std::io::Error::other(why),
            },
        }
    }
}

/// The first executable file named `name` in the `PATH`-style list `path`.
pub fn find_program(name: &str, path: &OsStr) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt as _;
    std::env::split_paths(path)
        .filter(|d| !d.as_os_str().is_empty())
        .map(|d| d.join(name))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// A private MPS control daemon, stopped when dropped.
#[derive(Debug)]
pub struct PrivateDaemon {
    program: PathBuf,
    root: PathBuf,
    pipe: PathBuf,
    log: PathBuf,
    /// Its standard input: "stopped" when we stopped the daemon ourselves;
    /// its end (we died) makes it stop the daemon.
    watchdog_in: Option<ChildStdin>,
    watchdog: Option<Child>,
    stopped: bool,
}

/// What the watchdog runs: wait for our word or our death; unless we said
/// we took care of the daemon, stop it and, once stopped, remove the folder.
const WATCHDOG: &str = r#"read -r word
[ "$word" = stopped ] && exit 0
if [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ]; then
  echo quit | "$CUDA_IPC_MPS_PROGRAM" >/dev/null 2>&1 || exit 1
fi
rm -rf "$CUDA_IPC_MPS_ROOT"
"#;

impl PrivateDaemon {
    /// Starts a private daemon: `nvidia-cuda-mps-control` from `PATH`, its
    /// folder under the system's temporary directory.
    pub fn start() -> Result<PrivateDaemon, StartError> {
        let path = std::env::var_os("PATH").unwrap_or_default();
        PrivateDaemon::start_with(&path, &std::env::temp_dir())
    }

    /// [`PrivateDaemon::start`] with the program looked up in `path` and
    /// the folder made under `tmp` (`/tmp` where `tmp` makes the socket
    /// paths too long).
    pub fn start_with(path: &OsStr, tmp: &Path) -> Result<PrivateDaemon, StartError> {
        PrivateDaemon::start_within(path, tmp, START_TIMEOUT)
    }

    fn start_within(
        path: &OsStr,
        tmp: &Path,
        timeout: Duration,
    ) -> Result<PrivateDaemon, StartError> {
        let program = find_program(CONTROL_PROGRAM, path).ok_or_else(|| {
            StartError::Missing(format!(
                "--mps needs {CONTROL_PROGRAM}, which is not on PATH: it comes with the NVIDIA \
                 driver (Ubuntu: the nvidia-compute-utils package of your driver version); \
                 install it or add its folder to PATH, or run without --mps"
            ))
        })?;
        let root = make_root(tmp).map_err(StartError::Failed)?;
        let mut daemon = PrivateDaemon {
            program,
            pipe: root.join("pipe"),
            log: root.join("log"),
            root,
            watchdog_in: None,
            watchdog: None,
            stopped: false,
        };
        // Dropping `daemon` on any error below stops what was started.
        daemon.start_watchdog()?;
        daemon.start_daemon(timeout)?;
        Ok(daemon)
    }

    /// Its private folder (removed when it stops): room for files of the run.
    pub fn folder(&self) -> &Path {
        &self.root
    }

    /// The pipe directory its clients must name in [`PIPE_VAR`].
    pub fn pipe_directory(&self) -> &Path {
        &self.pipe
    }

    /// Its log directory (`control.log`, `server.log`).
    pub fn log_directory(&self) -> &Path {
        &self.log
    }

    /// The variables that make a process a client of this daemon.
    pub fn env(&self) -> [(&'static str, &Path); 2] {
        [(PIPE_VAR, &self.pipe), (LOG_VAR, &self.log)]
    }

    /// `program` with this daemon's variables, ready to be started as a client.
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut c = Command::new(program);
        c.envs(self.env());
        c
    }

    /// Runs the control program with `args` and `input` on its standard
    /// input, out of the terminal's foreground group (Ctrl-C is not for
    /// it); its exit status and what it printed (for an error message).
    fn run_control(
        &self,
        args: &[&str],
        input: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<(std::process::ExitStatus, String), String> {
        let said_path = self.root.join("control.out");
        let said_file = std::fs::File::create(&said_path).map_err(|e| e.to_string())?;
        let said_err = said_file.try_clone().map_err(|e| e.to_string())?;
        let mut child = self
            .command(&self.program)
            .args(args)
            .process_group(0)
            .stdin(if input.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(said_file)
            .stderr(said_err)
            .spawn()
            .map_err(|e| format!("could not be run ({e})"))?;
        if let (Some(mut stdin), Some(bytes)) = (child.stdin.take(), input) {
            let _ = stdin.write_all(bytes);
        }
        let status = wait_timeout(&mut child, timeout)?;
        let text = std::fs::read_to_string(&said_path).unwrap_or_default();
        let text = text.trim();
        let shown = if text.is_empty() {
            String::new()
        } else {
            format!(": {}", cuda_ipc::units::shorten(text, 300))
        };
        Ok((status, shown))
    }

    fn start_watchdog(&mut self) -> Result<(), StartError> {
        let mut child = self
            .control_env(Command::new("sh"))
            .args(["-c", WATCHDOG])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(|e| StartError::Failed(format!("--mps: starting sh (the watchdog): {e}")))?;
        self.watchdog_in = child.stdin.take();
        self.watchdog = Some(child);
        Ok(())
    }

    fn control_env(&self, mut c: Command) -> Command {
        c.envs(self.env())
            .env("CUDA_IPC_MPS_PROGRAM", &self.program)
            .env("CUDA_IPC_MPS_ROOT", &self.root);
        c
    }

    fn start_daemon(&mut self, timeout: Duration) -> Result<(), StartError> {
        let shown = self.program.display().to_string();
        let fail = |what: String| {
            StartError::Failed(format!(
                "--mps: the private MPS control daemon did not start: {what}. Its log is in \
                 {}; `cuda-ipc info` says whether another MPS daemon runs here. Run without \
                 --mps to measure without MPS",
                self.log.display()
            ))
        };
        // `-d` forks the daemon and returns; the daemon may keep what it
        // inherits open, so its output goes to a file, not a pipe.
        let out = self
            .run_control(&["-d"], None, timeout)
            .map_err(|e| fail(format!("{shown} -d {e}")))?;
        if !out.0.success() {
            return Err(fail(format!("{shown} -d exited with {}{}", out.0, out.1)));
        }
        let started = Instant::now();
        while !self.pipe.join("control").exists() {
            if started.elapsed() > timeout {
                return Err(fail(format!(
                    "its control socket {} did not appear within {timeout:?}",
                    self.pipe.join("control").display()
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Stops the daemon (`quit`), waits until its control socket stops
    /// answering, removes the folder and lets the watchdog go. Stopping
    /// twice does nothing the second time.
    pub fn stop(&mut self) -> Result<(), String> {
        if self.stopped {
            return Ok(());
        }
        self.stopped = true;
        let result = self.quit();
        // A daemon that would not stop keeps its folder: the warning names it.
        if result.is_ok() {
            let _ = std::fs::remove_dir_all(&self.root);
        }
        if let Some(mut w) = self.watchdog_in.take() {
            let _ = w.write_all(b"stopped\n");
        }
        if let Some(mut w) = self.watchdog.take() {
            let _ = wait_timeout(&mut w, STOP_TIMEOUT);
        }
        result
    }

    fn quit(&self) -> Result<(), String> {
        let control = self.pipe.join("control");
        if !control.exists() {
            return Ok(());
        }
        let out = self
            .run_control(&[], Some(b"quit\n"), STOP_TIMEOUT)
            .map_err(|e| format!("{} (quit) {e}", self.program.display()))?;
        if !out.0.success() {
            return Err(format!("quit exited with {}{}", out.0, out.1));
        }
        let waited = Instant::now();
        while answers(&control).is_ok() {
            if waited.elapsed() > STOP_TIMEOUT {
                return Err(format!(
                    "it still answers at {} {STOP_TIMEOUT:?} after quit",
                    control.display()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }
}

impl Drop for PrivateDaemon {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            eprintln!(
                "warning: stopping the private MPS control daemon failed: {e}; stop it with \
                 `echo quit | {PIPE_VAR}={} {CONTROL_PROGRAM}`",
                self.pipe.display()
            );
        }
    }
}

/// Makes a fresh folder (mode 0700) for the pipe and log directories.
fn make_root(tmp: &Path) -> Result<PathBuf, String> {
    let base = if tmp
        .join("cuda-ipc-mps-0000000000-00/pipe")
        .as_os_str()
        .len()
        + 10
        > MAX_PIPE_DIR
    {
        Path::new("/tmp")
    } else {
        tmp
    };
    let pid = std::process::id();
    let mut last = None;
    for n in 0..100u32 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let root = base.join(format!("cuda-ipc-mps-{pid}-{:08x}", nanos ^ n));
        match std::fs::DirBuilder::new().mode(0o700).create(&root) {
            Ok(()) => {
                for sub in ["pipe", "log"] {
                    std::fs::DirBuilder::new()
                        .mode(0o700)
                        .create(root.join(sub))
                        .map_err(|e| {
                            format!("--mps: creating {}: {e}", root.join(sub).display())
                        })?;
                }
                return Ok(root);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => {
                return Err(format!(
                    "--mps: creating a folder in {}: {e}; set TMPDIR to a writable folder",
                    base.display()
                ));
            }
        }
    }
    Err(format!(
        "--mps: no fresh folder could be made in {} ({})",
        base.display(),
        last.map_or_else(String::new, |e| e.to_string())
    ))
}

/// Waits for `child` up to `timeout`; kills it past that.
fn wait_timeout(child: &mut Child, timeout: Duration) -> Result<std::process::ExitStatus, String> {
    let started = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Ok(status),
            Ok(None) if started.elapsed() > timeout => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("did not finish within {timeout:?} (killed)"));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => return Err(e.to_string()),
        }
    }
}

#[cfg(test)]
#[path = "mps_tests.rs"]
mod tests;
