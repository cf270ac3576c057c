//! The properties of fuzz target `set_table` (format 2's entry table,
//! `cuda_ipc::set::table::decode_bytes`): never a panic; a table that
//! decodes re-encodes to the same bytes (one encoding per table: integers
//! in their shortest form, nothing after the last entry); every error says
//! something.
//!
//! Kept apart from `lib.rs` so that the target, and the corpus replay in
//! `crates/cuda-ipc/tests/set_record/main.rs`, include this one file.

use cuda_ipc::set::table::{decode_bytes, encode_bytes};

/// The checks of the entry table's decoder on arbitrary bytes; panics if a
/// property fails.
pub fn set_table(data: &[u8]) {
    match decode_bytes(data) {
        Ok(entries) => assert_eq!(
            encode_bytes(&entries),
            data,
            "the table decoded to {entries:?}, which encodes to other bytes"
        ),
        Err(e) => assert!(!e.to_string().is_empty(), "an error printed as nothing"),
    }
}
