//! The run's progress on standard error.

use std::time::Instant;

/// A progress bar on standard error; where standard error is not a
/// terminal, one line per step instead.
pub struct Progress {
    bar: indicatif::ProgressBar,
    started: Instant,
}

impl Progress {
    pub(crate) fn new(steps: u64) -> Progress {
        let bar = indicatif::ProgressBar::with_draw_target(
            Some(steps),
            indicatif::ProgressDrawTarget::stderr(),
        );
        if let Ok(style) = indicatif::ProgressStyle::with_template(
            "{elapsed_precise} [{bar:30}] {pos}/{len} {msg}",
        ) {
            bar.set_style(style.progress_chars("=> "));
        }
        Progress {
            bar,
            started: Instant::now(),
        }
    }

    /// Starts a step.
    pub fn step(&self, what: &str) {
        if self.bar.is_hidden() {
            eprintln!(
                "bench [{:6.1} s] {what}",
                self.started.elapsed().as_secs_f64()
            );
        } else {
            self.bar.set_message(what.to_string());
        }
    }

    /// Ends a step.
    pub fn done(&self) {
        self.bar.inc(1);
    }

    /// A line that stays (a warning).
    pub fn note(&self, text: &str) {
        if self.bar.is_hidden() {
            eprintln!("bench: {text}");
        } else {
            self.bar.println(text);
        }
    }

    pub(crate) fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
