//! GPU tests of GPU-side fences (`cuda_ipc::fence`): real multi-process
//! tests on a real device, and the fence benchmark.
//!
//! Every test here is `#[ignore = "needs an NVIDIA GPU"]`. On a GPU host run
//! `cargo test --release --test gpu_fence -- --ignored --test-threads=1 --nocapture`,
//! or `FOLDER/tests/gpu_fence --ignored --test-threads=1 --nocapture` from the
//! bundle built by `scripts/gpu-bundle.sh`.

#[path = "../gpu/common.rs"]
mod common;

mod bench;
mod containers;
mod liveness;
mod ordering;

use cuda_ipc::Device;
use cuda_ipc::fence::{FenceBlock, FenceMapping};
use serde_json::Value;

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

/// Maps the fence block a message carries (its file descriptors are taken
/// from the exporter with `pidfd_getfd`).
pub(crate) fn open_fence(device: &Device, block: &Value) -> FenceMapping {
    let block: FenceBlock = serde_json::from_value(block.clone()).expect("a fence block");
    FenceMapping::open(device, &block, Vec::new()).expect("map the fence block")
}

/// Bytes in one ring frame.
pub(crate) const FRAME: u64 = 4096;

/// Fails the test if a child's answer carries an `error`.
pub(crate) fn assert_no_error(answer: &Value) {
    assert!(answer.get("error").is_none(), "the child answered {answer}");
}
