//! The properties of fuzz target `readers_book` (the book of readers a
//! restarted weight service reads back from its keeper, to wait for the
//! readers of the process before; `cuda_ipc::keep`): nothing panics; what
//! decodes encodes to a book that decodes and encodes to the same bytes;
//! a refusal says why. The input stands for the book's first bytes, the
//! rest zeros.
//!
//! Kept apart from `lib.rs` so that the target, and the corpus replay in
//! `crates/cuda-ipc/tests/decoders.rs`, include this one file.

use cuda_ipc::service::readers_book_round_trip;

/// The checks on arbitrary bytes; panics if a property fails.
pub fn readers_book(data: &[u8]) {
    let _ = is_valid(data);
}

/// Runs the checks; whether `data` is a book (the corpus replay checks
/// that the seeds hold some).
pub fn is_valid(data: &[u8]) -> bool {
    match readers_book_round_trip(data) {
        Ok(encoded) => {
            let again = readers_book_round_trip(&encoded)
                .unwrap_or_else(|e| panic!("a book encoded to bytes that do not decode: {e}"));
            assert_eq!(again, encoded, "a book changed in a round trip");
            true
        }
        Err(e) => {
            assert!(!e.is_empty(), "a refusal without a reason");
            false
        }
    }
}
