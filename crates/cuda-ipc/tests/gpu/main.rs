//! GPU tests: real multi-process tests on a real device.
//!
//! Every test here is `#[ignore = "needs an NVIDIA GPU"]` (one, on ptrace
//! rules, needs the GPU host's Yama and root instead), so a plain
//! `cargo test` (CI, no GPU) lists them as ignored. On a GPU host run
//! `cargo test --release --test gpu -- --ignored --test-threads=1`, or the
//! bundle built by `scripts/gpu-bundle.sh`.

mod arena_sets;
mod chaos;
mod checkpoint_load;
mod common;
mod consumer;
mod containers;
mod exchange;
mod fd_fetching;
mod keeper;
mod kept;
mod legacy;
mod lifetimes;
mod mechanisms;
mod peer;
mod push;
mod read_only;
mod save;
mod service;
mod service_in_place;
mod service_limits;
mod service_write;
mod set_fences;
mod sleep;
mod sleep_updates;
mod survive;
mod survive_readers;
mod survive_upgrade;
mod tensor_parallel;

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

/// Asserts that a child's answer reports success: no `error`, and a `bad`
/// field that is null (no mismatching element).
#[macro_export]
macro_rules! assert_ok {
    ($answer:expr) => {
        $crate::assert_ok!($answer, "")
    };
    ($answer:expr, $($fmt:tt)+) => {{
        let answer: &serde_json::Value = $answer;
        assert!(
            answer.get("error").is_none() && answer.get("bad").is_some_and(serde_json::Value::is_null),
            "{}: the child answered {}",
            format!($($fmt)+),
            answer
        );
    }};
}
