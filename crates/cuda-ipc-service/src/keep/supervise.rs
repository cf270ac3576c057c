//! The keeper's loop: run the serving process, keep what it sends, run it
//! again (or hand a standby the descriptors) when it dies.

use std::io;
use std::os::fd::OwnedFd;
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, poll};
use rustix::process::{Pid, PidfdFlags, Signal, kill_process, pidfd_open};

use super::handover::{self, HANDOVER_NAME};
use super::keeper::{Keeper, KeeperEvent, KeeperExit, MAX_FAILED_STARTS};

/// How many standbys may die before they take over, before the keeper
/// stops starting them.
const MAX_FAILED_STANDBYS: u32 = 3;

/// A process and the descriptor that says when it exits.
struct Running {
    child: Child,
    pidfd: OwnedFd,
}

impl Running {
    fn new(child: Child) -> io::Result<Running> {
        let pid = Pid::from_raw(child.id() as i32).ok_or_else(|| io::Error::other("pid 0"))?;
        let pidfd = pidfd_open(pid, PidfdFlags::empty())?;
        Ok(Running { child, pidfd })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn signal(&self, signal: Signal) {
        let _ = kill_process(Pid::from_child(&self.child), signal);
    }

    /// Kills it and waits for it.
    fn end(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A standby serving process and the keeper's end of its hand-over pair.
struct Standby {
    running: Running,
    pair: OwnedFd,
}

/// How one serving process ended.
struct Ended {
    pid: u32,
    status: ExitStatus,
    ready: bool,
    on_purpose: bool,
}

impl Keeper {
    /// Runs `make()` as the serving process with `$NOTIFY_SOCKET` and the
    /// kept descriptors, and again each time it dies without stopping on
    /// purpose (or hands them to a standby started ahead, see
    /// [`Keeper::with_standby`]); keeps what it sends meanwhile. Returns
    /// when it stops on purpose (exit 0 after `STOPPING=1`; the kept
    /// descriptors are closed), when `stop` is set (the child gets SIGTERM
    /// and is waited for), or when it keeps failing before it serves, or
    /// fails with exit 2 or 3 (a bad option, no driver or device) before
    /// it serves. `upgrade`, when set, kills the child (SIGKILL: what it
    /// committed is kept, as after a crash) and any standby, to run
    /// `make()` again, a new build if the file changed; it is cleared.
    ///
    /// # Errors
    /// Spawning's and the socket's.
    pub fn supervise(
        &mut self,
        make: &mut dyn FnMut() -> Command,
        stop: &AtomicBool,
        upgrade: &AtomicBool,
        events: &mut dyn FnMut(KeeperEvent),
    ) -> io::Result<KeeperExit> {
        let mut failed_starts = 0;
        let mut failed_standbys = 0;
        let mut standby: Option<Standby> = None;
        loop {
            // A standby takes over if one waits and takes the descriptors.
            let serving = match standby.take() {
                Some(s) if handover::send(&s.pair, &self.kept).is_ok() => s.running,
                Some(s) => {
                    s.running.end();
                    self.start(make)?
                }
                None => self.start(make)?,
            };
            let began = Instant::now();
            events(KeeperEvent::Started {
                pid: serving.pid(),
                fds: self.kept.len(),
            });
            let ended = self.serve(
                serving,
                began,
                &mut standby,
                (make, stop, upgrade, events),
                (&mut failed_starts, &mut failed_standbys),
            )?;
            let refused = !ended.ready && matches!(ended.status.code(), Some(2 | 3));
            let gave_up = !ended.on_purpose && (failed_starts >= MAX_FAILED_STARTS || refused);
            events(KeeperEvent::Exited {
                pid: ended.pid,
                status: ended.status,
                restart: !ended.on_purpose && !gave_up,
            });
            if ended.on_purpose || gave_up {
                if let Some(s) = standby.take() {
                    s.running.end();
                }
                self.kept.clear();
                return Ok(if ended.on_purpose {
                    KeeperExit::Stopped(ended.status)
                } else {
                    KeeperExit::GaveUp(ended.status)
                });
            }
        }
    }

    fn start(&self, make: &mut dyn FnMut() -> Command) -> io::Result<Running> {
        Running::new(self.spawn(&mut make(), &self.kept_list())?)
    }

    /// Watches one serving process until it exits: its notifications,
    /// the stop and upgrade flags, and the standby (started once it
    /// serves, started again if it dies).
    #[allow(clippy::type_complexity)]
    fn serve(
        &mut self,
        mut serving: Running,
        began: Instant,
        standby: &mut Option<Standby>,
        (make, stop, upgrade, events): (
            &mut dyn FnMut() -> Command,
            &AtomicBool,
            &AtomicBool,
            &mut dyn FnMut(KeeperEvent),
        ),
        (failed_starts, failed_standbys): (&mut u32, &mut u32),
    ) -> io::Result<Ended> {
        let pid = serving.pid();
        let mut ready = false;
        let mut stopping = false;
        let mut asked_to_stop = false;
        loop {
            if stop.load(Ordering::SeqCst) && !asked_to_stop {
                asked_to_stop = true;
                serving.signal(Signal::TERM);
                if let Some(s) = standby.take() {
                    s.running.end();
                }
            }
            if upgrade.swap(false, Ordering::SeqCst) {
                if let Some(s) = standby.take() {
                    s.running.end();
                }
                serving.signal(Signal::KILL);
            }
            if ready
                && standby.is_none()
                && self.standby
                && !asked_to_stop
                && *failed_standbys < MAX_FAILED_STANDBYS
            {
                let (mine, theirs) = handover::pair()?;
                let child = self.spawn(&mut make(), &[(HANDOVER_NAME, &theirs)])?;
                drop(theirs);
                let running = Running::new(child)?;
                events(KeeperEvent::Standby { pid: running.pid() });
                *standby = Some(Standby {
                    running,
                    pair: mine,
                });
            }
            let mut fds = vec![
                PollFd::new(&self.socket, PollFlags::IN),
                PollFd::new(&serving.pidfd, PollFlags::IN),
            ];
            if let Some(s) = standby.as_ref() {
                fds.push(PollFd::new(&s.running.pidfd, PollFlags::IN));
            }
            let tick = rustix::time::Timespec {
                tv_sec: 0,
                tv_nsec: 100_000_000,
            };
            match poll(&mut fds, Some(&tick)) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
            drop(fds);
            // Notifications first: those sent just before an exit count.
            while let Some(n) = self.receive(pid, events)? {
                if n.ready && !ready {
                    ready = true;
                    *failed_starts = 0;
                    events(KeeperEvent::Ready {
                        pid,
                        after: began.elapsed(),
                    });
                }
                stopping |= n.stopping;
            }
            if let Some(s) = standby.as_mut()
                && let Some(status) = s.running.child.try_wait()?
            {
                *failed_standbys += 1;
                events(KeeperEvent::Exited {
                    pid: s.running.pid(),
                    status,
                    restart: *failed_standbys < MAX_FAILED_STANDBYS,
                });
                *standby = None;
                std::thread::sleep(Duration::from_millis(100));
            }
            if let Some(status) = serving.child.try_wait()? {
                if !ready {
                    *failed_starts += 1;
                }
                return Ok(Ended {
                    pid,
                    status,
                    ready,
                    on_purpose: asked_to_stop || (stopping && status.success()),
                });
            }
        }
    }
}
