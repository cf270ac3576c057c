//! One module per subcommand.

pub mod demo;
pub mod export;
pub mod info;
pub mod open;

use std::time::Instant;

/// Milliseconds since `t`.
pub fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Parses a size with units for clap.
pub fn parse_size(s: &str) -> Result<u64, String> {
    s.parse::<cuda_ipc::units::ByteSize>()
        .map(|b| b.0)
        .map_err(|e| e.to_string())
}

/// Parses a 32-bit value (decimal or 0x hex) for clap.
pub fn parse_value(s: &str) -> Result<u32, String> {
    cuda_ipc::units::parse_u32(s).map_err(|e| e.to_string())
}

/// Parses a mechanism name (or `auto`) for clap.
pub fn parse_mechanism(s: &str) -> Result<Option<cuda_ipc::Mechanism>, String> {
    if s == "auto" {
        Ok(None)
    } else {
        s.parse()
            .map(Some)
            .map_err(|e: cuda_ipc::Error| e.to_string())
    }
}

/// A byte count in binary units for people.
pub fn human(n: u64) -> String {
    cuda_ipc::units::ByteSize(n).to_string()
}
