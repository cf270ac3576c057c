//! One module per subcommand.

pub mod demo;
pub mod export;
pub mod info;
pub mod open;
pub mod serve;
pub mod stream;

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

/// Parses a number of seconds (fractions allowed) for clap.
pub fn parse_seconds(s: &str) -> Result<std::time::Duration, String> {
    s.parse::<f64>()
        .ok()
        .filter(|v| v.is_finite() && *v >= 0.0)
        .map(std::time::Duration::from_secs_f64)
        .ok_or_else(|| format!("{s:?} is not a number of seconds"))
}

/// Nanoseconds of CLOCK_MONOTONIC, comparable between processes of one machine.
pub fn mono_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// A byte count in binary units for people.
pub fn human(n: u64) -> String {
    cuda_ipc::units::ByteSize(n).to_string()
}
