//! The service's wait for its readers at shutdown, without the GPU: every
//! set hidden from new readers (those committed late too), then a wait of
//! at most the grace for the readers' leases and the loads in progress to
//! end.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use super::catalog::Holder;

/// What the wait needs from the service.
pub(super) trait Stopping {
    /// The names of the sets the service holds now.
    fn set_names(&self) -> Vec<String>;
    /// Hides a set from new readers (its readers are told).
    fn hide(&self, name: &str);
    /// The readers holding leases on any of `names`.
    fn holders_of(&self, names: &BTreeSet<String>) -> Vec<(String, Holder)>;
    /// How many loads are still running.
    fn loads_in_progress(&self) -> usize;
}

/// Hides every set and waits until no reader holds one and no load runs,
/// or `grace` has passed, looking every `poll`; returns the readers still
/// holding sets and how long it waited.
pub(super) fn wait_for_readers(
    service: &impl Stopping,
    grace: Duration,
    poll: Duration,
) -> (Vec<(String, Holder)>, Duration) {
    let started = Instant::now();
    let mut hidden = BTreeSet::new();
    loop {
        // Loads admitted before the stop may still commit: hide those too.
        for name in service.set_names() {
            if hidden.insert(name.clone()) {
                service.hide(&name);
            }
        }
        let held = service.holders_of(&hidden);
        let loading = service.loads_in_progress();
        if (held.is_empty() && loading == 0) || started.elapsed() >= grace {
            return (held, started.elapsed());
        }
        std::thread::sleep(poll.min(grace.saturating_sub(started.elapsed())));
    }
}

#[cfg(test)]
mod tests {
    use std::cell::{Cell, RefCell};

    use super::*;

    /// Sets, readers that let go after some looks, a load that commits late.
    struct Fake {
        sets: RefCell<Vec<String>>,
        hidden: RefCell<Vec<String>>,
        /// Looks until the reader of "a" lets go (`None`: never).
        reader_leaves_after: Option<usize>,
        /// Looks until the late load commits "late".
        load_ends_after: usize,
        looks: Cell<usize>,
    }

    impl Fake {
        fn new(reader_leaves_after: Option<usize>, load_ends_after: usize) -> Fake {
            Fake {
                sets: RefCell::new(vec!["a".into(), "b".into()]),
                hidden: RefCell::new(Vec::new()),
                reader_leaves_after,
                load_ends_after,
                looks: Cell::new(0),
            }
        }
    }

    impl Stopping for Fake {
        fn set_names(&self) -> Vec<String> {
            self.looks.set(self.looks.get() + 1);
            if self.looks.get() == self.load_ends_after + 1 {
                self.sets.borrow_mut().push("late".into());
            }
            self.sets.borrow().clone()
        }
        fn hide(&self, name: &str) {
            self.hidden.borrow_mut().push(name.into());
        }
        fn holders_of(&self, names: &BTreeSet<String>) -> Vec<(String, Holder)> {
            let gone = self
                .reader_leaves_after
                .is_some_and(|n| self.looks.get() > n);
            if names.contains("a") && !gone {
                vec![("a".into(), Holder { pid: 42, uid: 7 })]
            } else {
                Vec::new()
            }
        }
        fn loads_in_progress(&self) -> usize {
            usize::from(self.looks.get() <= self.load_ends_after)
        }
    }

    const POLL: Duration = Duration::from_millis(1);

    #[test]
    fn it_returns_as_soon_as_readers_and_loads_are_done_hiding_late_sets_too() {
        let f = Fake::new(Some(3), 2);
        let (held, waited) = wait_for_readers(&f, Duration::from_secs(10), POLL);
        assert!(held.is_empty());
        assert!(waited < Duration::from_secs(5), "{waited:?}");
        assert_eq!(*f.hidden.borrow(), ["a", "b", "late"], "each hidden once");
        assert_eq!(f.looks.get(), 4);
    }

    #[test]
    fn a_reader_that_holds_on_is_named_once_the_grace_has_passed() {
        let f = Fake::new(None, 0);
        let grace = Duration::from_millis(50);
        let (held, waited) = wait_for_readers(&f, grace, POLL);
        assert_eq!(held, [("a".to_owned(), Holder { pid: 42, uid: 7 })]);
        assert!(waited >= grace && waited < grace * 20, "{waited:?}");
    }

    #[test]
    fn no_grace_still_hides_every_set_and_names_the_readers() {
        let f = Fake::new(None, 100);
        let (held, _) = wait_for_readers(&f, Duration::ZERO, POLL);
        assert_eq!(held.len(), 1);
        assert_eq!(*f.hidden.borrow(), ["a", "b"]);
    }
}
