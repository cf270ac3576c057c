//! Fuzz target `shm_ring`: see `fuzz/src/shm_ring.rs` for the properties checked.
#![no_main]

#[path = "../src/shm_ring.rs"]
mod property;

libfuzzer_sys::fuzz_target!(|data: &[u8]| property::shm_ring(data));
