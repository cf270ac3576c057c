//! Fuzz target `readers_book`: see `fuzz/src/readers_book.rs` for the properties checked.
#![no_main]

#[path = "../src/readers_book.rs"]
mod property;

libfuzzer_sys::fuzz_target!(|data: &[u8]| property::readers_book(data));
