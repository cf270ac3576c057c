//! GPU tests: real multi-process tests on a real device.
//!
//! Every test here is `#[ignore = "needs an NVIDIA GPU"]`, so a plain
//! `cargo test` (CI, no GPU) lists them as ignored. On a GPU host run
//! `cargo test --release --test gpu -- --ignored --test-threads=1`, or the
//! bundle built by `scripts/gpu-bundle.sh`.

mod common;
mod consumer;
mod exchange;
mod legacy;
mod mechanisms;

/// The full name of test `name` in module `module` (for `--exact`).
#[macro_export]
macro_rules! test_name {
    ($name:literal) => {
        format!(
            "{}::{}",
            module_path!().split_once("::").map_or("", |(_, rest)| rest),
            $name
        )
    };
}
