//! Fuzz target `checkpoint_index`: see `fuzz/src/checkpoint_index.rs` for the properties checked.
#![no_main]

#[path = "../src/checkpoint_index.rs"]
mod property;

libfuzzer_sys::fuzz_target!(|data: &[u8]| property::checkpoint_index(data));
