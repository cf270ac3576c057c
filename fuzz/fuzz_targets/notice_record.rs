//! Fuzz target `notice_record`: see `fuzz/src/notice_record.rs` for the properties checked.
#![no_main]

#[path = "../src/notice_record.rs"]
mod property;

libfuzzer_sys::fuzz_target!(|data: &[u8]| property::notice_record(data));
