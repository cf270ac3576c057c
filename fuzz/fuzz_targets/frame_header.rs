//! Fuzz target `frame_header`: see `cuda_ipc_fuzz::frame_header` for the properties checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| cuda_ipc_fuzz::frame_header(data));
