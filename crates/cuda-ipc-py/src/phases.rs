//! Where the time of the binding's bulk calls goes.
//!
//! A bulk call (`publish_state_dict_c`, `attach_set`,
//! `attach_state_dict_c`) reads the clock at the end of each of its phases
//! (about 20 ns a read) and, when it returns, keeps the durations of its
//! last run. `_core._last_phases(call)` returns them as `[(phase, µs)]`;
//! `bench/attach_parts.py` prints them, so that a run on a GPU host shows
//! which phase of a Python hand-off costs what, without a profiler there.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use pyo3::prelude::*;

type Durations = Vec<(&'static str, f64)>;

/// The last run's phases of each call, by call.
static LAST: Mutex<Option<HashMap<&'static str, Durations>>> = Mutex::new(None);

/// The clock of one run of a bulk call.
pub(crate) struct Phases {
    call: &'static str,
    last: Instant,
    done: Durations,
}

impl Phases {
    pub(crate) fn start(call: &'static str) -> Phases {
        Phases {
            call,
            last: Instant::now(),
            done: Vec::with_capacity(8),
        }
    }

    /// Ends the phase `name` (which began at the previous mark or start).
    pub(crate) fn mark(&mut self, name: &'static str) {
        let now = Instant::now();
        self.done
            .push((name, now.duration_since(self.last).as_secs_f64() * 1e6));
        self.last = now;
    }

    /// Records `secs` spent in `name` inside the current phase (a sum of
    /// many short spans, each timed with two clock reads); the phase's own
    /// mark still counts them.
    pub(crate) fn add(&mut self, name: &'static str, secs: f64) {
        self.done.push((name, secs * 1e6));
    }
}

impl Drop for Phases {
    /// Keeps this run's phases as the call's last (a run that failed part
    /// way keeps the phases it finished).
    fn drop(&mut self) {
        let done = std::mem::take(&mut self.done);
        crate::errors::lock(&LAST)
            .get_or_insert_with(HashMap::new)
            .insert(self.call, done);
    }
}

/// `[(phase, µs)]` of the last run of `call` in this process; empty before
/// its first run.
#[pyfunction]
#[pyo3(name = "_last_phases")]
fn last_phases(call: &str) -> Vec<(&'static str, f64)> {
    crate::errors::lock(&LAST)
        .as_ref()
        .and_then(|m| m.get(call).cloned())
        .unwrap_or_default()
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(last_phases, m)?)
}

#[cfg(test)]
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
        let got = last_phases("test-call");
        assert_eq!(
            got.iter().map(|p| p.0).collect::<Vec<_>>(),
            ["first", "second"]
        );
        assert!(got[0].1 >= 2000.0, "{got:?}");
        assert!(got[1].1 < got[0].1, "{got:?}");
        {
            let mut p = Phases::start("test-call");
            p.mark("only");
        }
        assert_eq!(last_phases("test-call").len(), 1);
        assert!(last_phases("never-run").is_empty());
    }
}
