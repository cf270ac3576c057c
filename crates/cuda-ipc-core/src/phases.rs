//! Where the time of a call goes, by the call's own clock.
//!
//! A call on a hand-off path (a set's publish, attach and update, a
//! buffer's attach, and the Python extension's bulk calls over them)
//! reads the clock at the end of each of its phases, about 20 ns a read,
//! and keeps the durations of its last run on this thread. [`last`]
//! returns them. The bench prints them as parts of its rows, and
//! `bench/attach_parts.py` through `cuda_ipc._core._last_phases`: that is
//! how a GPU host without a profiler shows which phase of a hand-off costs
//! what.
//!
//! Keeping them costs one small allocation a run; nothing is kept for a
//! call never made, and reading them never blocks. All of this is the
//! feature `phases`: without it [`Phases`] keeps no clock and [`last`] is
//! always empty, so that the library's hot paths cost nothing for it.

#[cfg(feature = "phases")]
use std::cell::RefCell;
#[cfg(feature = "phases")]
use std::time::Instant;

/// A call's phases: `(phase, µs)`, in order.
pub(crate) type Durations = Vec<(&'static str, f64)>;

#[cfg(feature = "phases")]
thread_local! {
    /// The last run's phases of each call made on this thread.
    static LAST: RefCell<Vec<(&'static str, Durations)>> = const { RefCell::new(Vec::new()) };
}

/// The clock of one run of a call; its phases are kept when it drops.
#[cfg(feature = "phases")]
#[derive(Debug)]
pub struct Phases {
    call: &'static str,
    last: Instant,
    done: Durations,
}

#[cfg(feature = "phases")]
impl Phases {
    /// Starts the clock of a run of `call`.
    pub fn start(call: &'static str) -> Phases {
        Phases {
            call,
            last: Instant::now(),
            done: Vec::with_capacity(8),
        }
    }

    /// Ends the phase `name`, which began at the previous mark (or the
    /// start).
    pub fn mark(&mut self, name: &'static str) {
        let now = Instant::now();
        self.done
            .push((name, now.duration_since(self.last).as_secs_f64() * 1e6));
        self.last = now;
    }
}

#[cfg(feature = "phases")]
impl Drop for Phases {
    /// Keeps this run's phases as the call's last on this thread (a run
    /// that failed part way keeps those it finished).
    fn drop(&mut self) {
        let done = std::mem::take(&mut self.done);
        let call = self.call;
        // During the thread's own teardown there is nowhere to keep them.
        let _ = LAST.try_with(|last| {
            if let Ok(mut last) = last.try_borrow_mut() {
                match last.iter_mut().find(|(c, _)| *c == call) {
                    Some(slot) => slot.1 = done,
                    None => last.push((call, done)),
                }
            }
        });
    }
}

/// The phases of the last run of `call` on this thread, `(phase, µs)` in
/// order; empty before its first run.
#[cfg(feature = "phases")]
pub fn last(call: &str) -> Durations {
    LAST.try_with(|last| {
        last.try_borrow()
            .ok()
            .and_then(|l| l.iter().find(|(c, _)| *c == call).map(|(_, d)| d.clone()))
    })
    .ok()
    .flatten()
    .unwrap_or_default()
}

/// The clock of one run of a call: without the feature `phases`, none.
#[cfg(not(feature = "phases"))]
#[derive(Debug)]
pub struct Phases;

#[cfg(not(feature = "phases"))]
impl Phases {
    /// Starts nothing.
    #[inline]
    pub fn start(_call: &'static str) -> Phases {
        Phases
    }

    /// Keeps nothing.
    #[inline]
    pub fn mark(&mut self, _name: &'static str) {}
}

/// The phases of the last run of `call`: without the feature `phases`,
/// always empty.
#[cfg(not(feature = "phases"))]
pub fn last(_call: &str) -> Durations {
    Vec::new()
}

#[cfg(all(test, feature = "phases"))]
mod tests {
    use super::*;

    #[test]
    fn a_run_keeps_its_phases_in_order_and_replaces_the_last() {
        {
            let mut p = Phases::start("test-call");
            std::thread::sleep(std::time::Duration::from_millis(2));
            p.mark("first");
            p.mark("second");
        }
        let got = last("test-call");
        let names: Vec<_> = got.iter().map(|p| p.0).collect();
        assert_eq!(names, ["first", "second"]);
        assert!(got[0].1 >= 2000.0, "{got:?}");
        assert!(got[1].1 < got[0].1, "{got:?}");
        {
            let mut p = Phases::start("test-call");
            p.mark("only");
        }
        assert_eq!(last("test-call").len(), 1);
        assert!(last("never-run").is_empty());
    }

    #[test]
    fn phases_are_kept_per_thread() {
        {
            let mut p = Phases::start("per-thread");
            p.mark("here");
        }
        let there = std::thread::spawn(|| last("per-thread")).join().unwrap();
        assert!(there.is_empty());
        assert_eq!(last("per-thread").len(), 1);
    }
}
