//! Fuzz target `set_table`: see `fuzz/src/set_table.rs` for the properties checked.
#![no_main]

#[path = "../src/set_table.rs"]
mod property;

libfuzzer_sys::fuzz_target!(|data: &[u8]| property::set_table(data));
