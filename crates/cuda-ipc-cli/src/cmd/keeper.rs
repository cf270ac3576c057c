//! `serve --service` as a keeper (the default): binds the keeper's socket
//! next to the service's, runs this same command as the serving process
//! with `$NOTIFY_SOCKET` pointing at it, and runs it again whenever it dies
//! (see `cuda_ipc::keep`). SIGTERM and SIGINT stop the service (one
//! SIGTERM to the serving process, which drops its sets and exits); SIGHUP
//! runs the command again, a new build if the file was replaced, keeping
//! the sets.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use cuda_ipc::Error;
use cuda_ipc::keep::{Keeper, KeeperEvent, KeeperExit, exit_text};

use crate::Outcome;
use crate::out::errln;

/// The keeper's socket: the service's path with `.keeper` added.
pub fn keeper_path(socket: &Path) -> PathBuf {
    let mut p = socket.as_os_str().to_owned();
    p.push(".keeper");
    PathBuf::from(p)
}

fn io(context: String) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { context, source }
}

/// Runs the keeper until the service stops.
pub fn keep(socket: &Path, standby: bool) -> Result<Outcome, Error> {
    let path = keeper_path(socket);
    let mut keeper = Keeper::bind(&path)
        .map_err(io(format!(
            "cannot bind the keeper's socket {}",
            path.display()
        )))?
        .with_standby(standby);
    let exe = std::env::current_exe().map_err(io("cannot find this program's file".into()))?;
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let upgrade = Arc::new(AtomicBool::new(false));
    for (signal, flag) in [
        (signal_hook::consts::SIGTERM, &stop),
        (signal_hook::consts::SIGINT, &stop),
        (signal_hook::consts::SIGHUP, &upgrade),
    ] {
        signal_hook::flag::register(signal, Arc::clone(flag))
            .map_err(io(format!("cannot handle signal {signal}")))?;
    }
    let mut make = || {
        let mut c = Command::new(&exe);
        // Its own process group: Ctrl-C reaches the keeper, which stops it once.
        c.args(&args).process_group(0);
        c
    };
    let mut log = |e: KeeperEvent| match e {
        KeeperEvent::Started { pid, fds } if fds > 0 => {
            errln!("cuda-ipc: keeper: serving process {pid} started with {fds} kept descriptor(s)");
        }
        KeeperEvent::Ready { pid, after } => {
            errln!(
                "cuda-ipc: keeper (pid {}) holds the service's weights on {}; stop with SIGTERM \
                 (kill {}) or Ctrl-C, run a new build with SIGHUP",
                std::process::id(),
                path.display(),
                std::process::id()
            );
            errln!(
                "cuda-ipc: keeper: serving process {pid} serves, {:.1} ms after its start",
                after.as_secs_f64() * 1e3
            );
        }
        KeeperEvent::Exited {
            pid,
            status,
            restart,
        } => {
            errln!(
                "cuda-ipc: keeper: serving process {pid} ended ({}){}",
                exit_text(&status),
                if restart { "; running it again" } else { "" }
            );
        }
        KeeperEvent::Standby { pid } => {
            errln!("cuda-ipc: keeper: standby serving process {pid} waits to take over");
        }
        KeeperEvent::Refused { why } => {
            errln!("cuda-ipc: keeper: refused {why}");
        }
        _ => {}
    };
    let exit = keeper.supervise(&mut make, &stop, &upgrade, &mut log);
    let _ = std::fs::remove_file(&path);
    match exit.map_err(io("the keeper failed".into()))? {
        KeeperExit::Stopped(status) => Ok(match status.code() {
            Some(0) => Outcome::Ok,
            Some(c) => Outcome::Exit(u8::try_from(c).unwrap_or(crate::EXIT_FAILED)),
            None => Outcome::Exit(crate::EXIT_FAILED),
        }),
        KeeperExit::GaveUp(status) if matches!(status.code(), Some(2 | 3)) => {
            // The serving process said why; its exit code is the answer.
            Ok(Outcome::Exit(
                status
                    .code()
                    .and_then(|c| u8::try_from(c).ok())
                    .unwrap_or(crate::EXIT_FAILED),
            ))
        }
        KeeperExit::GaveUp(status) => {
            errln!(
                "cuda-ipc: keeper: the serving process failed before serving {} times in a row \
                 (last: {}); gave up, and the kept weights are dropped",
                cuda_ipc::keep::MAX_FAILED_STARTS,
                exit_text(&status)
            );
            Ok(Outcome::Exit(
                status
                    .code()
                    .and_then(|c| u8::try_from(c).ok())
                    .unwrap_or(crate::EXIT_FAILED),
            ))
        }
        _ => Ok(Outcome::Exit(crate::EXIT_FAILED)),
    }
}
