//! The properties of fuzz target `catalog_image` (the catalog image a
//! restarted weight service reads back from its keeper,
//! `cuda_ipc::keep`): nothing panics; what decodes encodes to an image
//! that decodes and encodes to the same bytes; a refusal says why.
//!
//! Kept apart from `lib.rs` so that the target, and the corpus replay in
//! `crates/cuda-ipc/tests/decoders.rs`, include this one file.

use cuda_ipc::keep::image_round_trip;

/// The checks on arbitrary bytes; panics if a property fails.
pub fn catalog_image(data: &[u8]) {
    let _ = is_valid(data);
}

/// Runs the checks; whether `data` is an image (the corpus replay checks
/// that the seeds hold some).
pub fn is_valid(data: &[u8]) -> bool {
    match image_round_trip(data) {
        Ok(encoded) => {
            let again = image_round_trip(&encoded)
                .unwrap_or_else(|e| panic!("an image encoded to bytes that do not decode: {e}"));
            assert_eq!(again, encoded, "an image changed in a round trip");
            true
        }
        Err(e) => {
            assert!(!e.is_empty(), "a refusal without a reason");
            false
        }
    }
}
