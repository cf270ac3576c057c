//! Deadlines from caller-given timeouts, without overflow.

use std::time::{Duration, Instant};

/// How far away a deadline is put when `now + timeout` cannot be
/// represented: a century, "never" for any process.
const FAR: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// `Instant::now() + timeout`, saturating: a timeout too long to add (such
/// as [`Duration::MAX`], a common way of saying "wait for ever") gives a
/// deadline a century away instead of a panic.
pub fn deadline_in(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .or_else(|| now.checked_add(FAR))
        // An `Instant` that cannot move a century ahead does not exist on
        // the platforms we build for; an hour is still "long" if it did.
        .unwrap_or_else(|| now + Duration::from_secs(3600))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ordinary_timeout_is_added() {
        let before = Instant::now();
        let d = deadline_in(Duration::from_millis(250));
        assert!(d >= before + Duration::from_millis(250));
        assert!(d <= Instant::now() + Duration::from_millis(250));
    }

    #[test]
    fn the_longest_timeouts_saturate_instead_of_panicking() {
        for t in [Duration::MAX, Duration::from_secs(u64::MAX), FAR * 2] {
            let d = deadline_in(t);
            assert!(
                d > Instant::now() + Duration::from_secs(365 * 24 * 3600),
                "{t:?}"
            );
        }
        assert!(deadline_in(Duration::ZERO) <= Instant::now());
    }
}
