//! Sizes with units (`4096`, `2MiB`, `1GiB`) and 32-bit values in decimal or hex.
//!
//! Used by the command-line tool and by anything else that takes sizes from
//! people. Parsing is strict: no fractions, no negative numbers, no overflow,
//! no trailing garbage; every error says what was accepted.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// One mebibyte.
pub const MIB: u64 = 1 << 20;
/// One gibibyte.
pub const GIB: u64 = 1 << 30;

/// A number of bytes, parsed from and printed with binary units.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

const UNITS: &[(&str, u64)] = &[
    ("", 1),
    ("b", 1),
    ("k", 1 << 10),
    ("kb", 1000),
    ("kib", 1 << 10),
    ("m", 1 << 20),
    ("mb", 1_000_000),
    ("mib", 1 << 20),
    ("g", 1 << 30),
    ("gb", 1_000_000_000),
    ("gib", 1 << 30),
    ("t", 1 << 40),
    ("tb", 1_000_000_000_000),
    ("tib", 1 << 40),
];

const ACCEPTED: &str = "a whole number of bytes with an optional unit: 4096, 0x1000, 64KiB, 2MiB, \
                        1GiB (K/M/G/T and KiB.. are powers of 1024; KB/MB/GB/TB powers of 1000)";

impl FromStr for ByteSize {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self> {
        let bad = |reason: String| Error::arg("size", format!("{reason}; expected {ACCEPTED}"));
        let s = text.trim();
        if s.is_empty() {
            return Err(bad("empty size".into()));
        }
        if let Some(hex) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
            // from_str_radix takes a leading '+'; a size has no sign.
            if hex.starts_with('+') {
                return Err(bad(format!(
                    "{text:?} is not a hex number (a sign after 0x)"
                )));
            }
            return u64::from_str_radix(hex, 16)
                .map(ByteSize)
                .map_err(|e| bad(format!("{text:?} is not a hex number ({e})")));
        }
        let digits_end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (digits, unit) = s.split_at(digits_end);
        if digits.is_empty() {
            return Err(bad(format!("{text:?} does not start with a number")));
        }
        let unit_lower = unit.trim_start().to_ascii_lowercase();
        let Some(&(_, factor)) = UNITS.iter().find(|(u, _)| *u == unit_lower) else {
            return Err(bad(format!("unknown unit {unit:?} in {text:?}")));
        };
        let n: u64 = digits
            .parse()
            .map_err(|_| bad(format!("{digits:?} does not fit in 64 bits")))?;
        n.checked_mul(factor)
            .map(ByteSize)
            .ok_or_else(|| bad(format!("{text:?} does not fit in 64 bits")))
    }
}

impl fmt::Display for ByteSize {
    /// Prints the largest binary unit that divides the size exactly
    /// (`64MiB`, `1536KiB`, `4097`), so that the output parses back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN: &[(&str, u64)] = &[
            ("TiB", 1 << 40),
            ("GiB", 1 << 30),
            ("MiB", 1 << 20),
            ("KiB", 1 << 10),
        ];
        let n = self.0;
        for (unit, factor) in SHOWN {
            if n != 0 && n.is_multiple_of(*factor) {
                return write!(f, "{}{unit}", n / factor);
            }
        }
        write!(f, "{n}")
    }
}

impl ByteSize {
    /// The size as `usize`, or an error on a 32-bit target where it does not fit.
    pub fn as_usize(self) -> Result<usize> {
        usize::try_from(self.0)
            .map_err(|_| Error::arg("size", format!("{} does not fit in usize", self.0)))
    }
}

/// Parses a 32-bit value written in decimal or with a `0x` prefix in hex.
pub fn parse_u32(text: &str) -> Result<u32> {
    let s = text.trim();
    let bad = |why: &dyn std::fmt::Display| {
        Error::arg(
            "value",
            format!(
                "{text:?} is not a 32-bit unsigned value ({why}); write it in decimal (305419896) or hex (0x12345678)"
            ),
        )
    };
    let hex = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X"));
    // from_str_radix and parse take a leading '+'; a value has no sign.
    if hex.unwrap_or(s).starts_with('+') {
        return Err(bad(&"a sign is not accepted"));
    }
    let parsed = match hex {
        Some(hex) => u32::from_str_radix(hex, 16),
        None => s.parse::<u32>(),
    };
    parsed.map_err(|e| bad(&e))
}

/// Rounds `n` up to a multiple of `align` (a power of two), or `None` on overflow.
pub fn round_up(n: u64, align: u64) -> Option<u64> {
    debug_assert!(align.is_power_of_two());
    n.checked_add(align - 1).map(|v| v & !(align - 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        for (s, n) in [
            ("4096", 4096),
            ("0x1000", 4096),
            ("2MiB", 2 << 20),
            ("2mib", 2 << 20),
            ("1GiB", 1 << 30),
            ("1 GiB", 1 << 30),
            ("64M", 64 << 20),
            ("1KB", 1000),
            ("8GiB", 8 << 30),
            ("7b", 7),
        ] {
            assert_eq!(s.parse::<ByteSize>().unwrap(), ByteSize(n), "{s}");
        }
    }

    #[test]
    fn bad_sizes_say_why() {
        for (s, why) in [
            ("", "empty"),
            ("MiB", "does not start with a number"),
            ("1.5GiB", "unknown unit"),
            ("-1", "does not start with a number"),
            ("12XB", "unknown unit"),
            ("99999999999999999999", "does not fit"),
            ("17179869184GiB", "does not fit"),
            ("0xZZ", "not a hex number"),
        ] {
            let e = s.parse::<ByteSize>().unwrap_err().to_string();
            assert!(e.contains(why), "{s:?}: {e}");
            assert!(e.contains("expected a whole number"), "{e}");
        }
    }

    #[test]
    fn display_parses_back() {
        for n in [0, 1, 4097, 1024, 1536 * 1024, 64 << 20, 3 << 30, u64::MAX] {
            let shown = ByteSize(n).to_string();
            assert_eq!(shown.parse::<ByteSize>().unwrap(), ByteSize(n), "{shown}");
        }
        assert_eq!(ByteSize(64 << 20).to_string(), "64MiB");
    }

    #[test]
    fn values() {
        assert_eq!(parse_u32("0x12345678").unwrap(), 0x1234_5678);
        assert_eq!(parse_u32("42").unwrap(), 42);
        assert_eq!(parse_u32("0XFFFFFFFF").unwrap(), u32::MAX);
        assert!(parse_u32("0x100000000").is_err());
        assert!(parse_u32("-1").is_err());
        assert!(
            parse_u32("ten")
                .unwrap_err()
                .to_string()
                .contains("\"ten\"")
        );
    }

    #[test]
    fn rounding() {
        assert_eq!(round_up(1, 2 << 20), Some(2 << 20));
        assert_eq!(round_up(2 << 20, 2 << 20), Some(2 << 20));
        assert_eq!(round_up(0, 4096), Some(0));
        assert_eq!(round_up(u64::MAX, 4096), None);
    }
}
