//! Fuzz target `checkpoint_header`: see `fuzz/src/checkpoint_header.rs` for the properties checked.
#![no_main]

#[path = "../src/checkpoint_header.rs"]
mod property;

libfuzzer_sys::fuzz_target!(|data: &[u8]| property::checkpoint_header(data));
