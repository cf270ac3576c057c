//! Fuzz target `frame_message`: see `cuda_ipc_fuzz::frame_message` for the properties checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| cuda_ipc_fuzz::frame_message(data));
