//! One module per subcommand.

pub mod bench;
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

/// `--mechanism`: `auto` (the best the device supports) or one mechanism.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MechanismArg(pub Option<cuda_ipc::Mechanism>);

/// Parses a mechanism name (or `auto`) for clap.
pub fn parse_mechanism(s: &str) -> Result<MechanismArg, String> {
    if s == "auto" {
        Ok(MechanismArg(None))
    } else {
        s.parse()
            .map(|m| MechanismArg(Some(m)))
            .map_err(|e: cuda_ipc::Error| format!("{e} (or auto)"))
    }
}

/// A byte count in binary units for people.
pub fn human(n: u64) -> String {
    cuda_ipc::units::ByteSize(n).to_string()
}
