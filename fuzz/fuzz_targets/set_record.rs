//! Fuzz target `set_record`: see `fuzz/src/set_record.rs` for the properties checked.
#![no_main]

#[path = "../src/set_record.rs"]
mod property;

libfuzzer_sys::fuzz_target!(|data: &[u8]| property::set_record(data));
