//! Fuzz target `catalog_image`: see `fuzz/src/catalog_image.rs` for the properties checked.
#![no_main]

#[path = "../src/catalog_image.rs"]
mod property;

libfuzzer_sys::fuzz_target!(|data: &[u8]| property::catalog_image(data));
