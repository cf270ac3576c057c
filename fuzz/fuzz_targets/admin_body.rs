//! Fuzz target `admin_body`: see `fuzz/src/admin_body.rs` for the properties checked.
#![no_main]

#[path = "../src/admin_body.rs"]
mod property;

libfuzzer_sys::fuzz_target!(|data: &[u8]| property::admin_body(data));
