//! Sizes with units (`4096`, `2MiB`, `1GiB`), durations with units (`10s`,
//! `500ms`, `1m`) and 32-bit values in decimal or hex.
//!
//! Used by the command-line tool and by anything else that takes sizes and
//! times from people. Parsing is strict: no negative numbers, no overflow, no
//! trailing garbage, fractions only in durations; every error says what was
//! accepted and quotes at most the start of a long input.

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
        let shown = shorten(text, 40);
        let s = text.trim();
        if s.is_empty() {
            return Err(bad("empty size".into()));
        }
        if s.starts_with('-') {
            return Err(bad(format!(
                "{shown} is negative; a size must be non-negative"
            )));
        }
        if let Some(hex) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
            // from_str_radix takes a leading '+'; a size has no sign.
            if hex.starts_with('+') {
                return Err(bad(format!(
                    "{shown} is not a hex number (a sign after 0x)"
                )));
            }
            return u64::from_str_radix(hex, 16)
                .map(ByteSize)
                .map_err(|e| bad(format!("{shown} is not a hex number ({e})")));
        }
        let digits_end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (digits, unit) = s.split_at(digits_end);
        if digits.is_empty() {
            return Err(bad(format!("{shown} does not start with a number")));
        }
        let unit_lower = unit.trim_start().to_ascii_lowercase();
        let Some(&(_, factor)) = UNITS.iter().find(|(u, _)| *u == unit_lower) else {
            return Err(bad(format!(
                "unknown unit {} in {shown}",
                shorten(unit, 20)
            )));
        };
        let n: u64 = digits
            .parse()
            .map_err(|_| bad(format!("{shown} does not fit in 64 bits")))?;
        n.checked_mul(factor)
            .map(ByteSize)
            .ok_or_else(|| bad(format!("{shown} does not fit in 64 bits")))
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

/// A length of time, parsed from and printed with units: `10s`, `500ms`,
/// `1m`, `1.5s`, `250us`, `2h`. A number without a unit counts seconds.
///
/// Parsing is strict: a decimal number (fractions allowed, no exponent, no
/// sign) and one unit (`ns`, `us`, `ms`, `s`, `m`, `h`, `d`), at most
/// [`Duration::MAX`], so a deadline computed from it (`Instant::now() + d`)
/// cannot overflow. Fractions finer than a nanosecond are refused rather
/// than rounded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Duration(pub std::time::Duration);

impl Duration {
    /// The longest duration accepted: 30 days.
    pub const MAX: std::time::Duration = std::time::Duration::from_secs(30 * 24 * 3600);
}

const DURATION_UNITS: &[(&str, u128)] = &[
    ("ns", 1),
    ("us", 1_000),
    ("ms", 1_000_000),
    ("", 1_000_000_000),
    ("s", 1_000_000_000),
    ("sec", 1_000_000_000),
    ("m", 60_000_000_000),
    ("min", 60_000_000_000),
    ("h", 3_600_000_000_000),
    ("d", 86_400_000_000_000),
];

const DURATION_ACCEPTED: &str = "a duration such as 10s, 500ms, 1.5s, 2m, 1h or 250us \
                                 (a number alone counts seconds), at most 30d";

impl FromStr for Duration {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self> {
        let bad = |reason: String| {
            Error::arg(
                "duration",
                format!("{reason}; expected {DURATION_ACCEPTED}"),
            )
        };
        let shown = shorten(text, 40);
        let s = text.trim();
        if s.is_empty() {
            return Err(bad("empty duration".into()));
        }
        if s.starts_with('-') {
            return Err(bad(format!(
                "{shown} is negative; a duration must be non-negative"
            )));
        }
        let number_end = s
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(s.len());
        let (number, unit) = s.split_at(number_end);
        let (whole, frac) = number.split_once('.').unwrap_or((number, ""));
        if whole.is_empty() && frac.is_empty() {
            return Err(bad(format!("{shown} does not start with a number")));
        }
        if frac.contains('.') {
            return Err(bad(format!("{shown} has more than one decimal point")));
        }
        let unit_lower = unit.trim_start().to_ascii_lowercase();
        let Some(&(_, ns_per_unit)) = DURATION_UNITS.iter().find(|(u, _)| *u == unit_lower) else {
            return Err(bad(format!(
                "unknown unit {} in {shown}",
                shorten(unit, 20)
            )));
        };
        let too_long = || bad(format!("{shown} is longer than 30 days"));
        // Leading zeros are harmless; more than 20 significant digits is past any limit.
        let whole = whole.trim_start_matches('0');
        if whole.len() > 20 {
            return Err(too_long());
        }
        let whole: u128 = if whole.is_empty() {
            0
        } else {
            whole.parse().map_err(|_| too_long())?
        };
        // The fraction, exactly, in units of 10^-frac.len().
        let frac = frac.trim_end_matches('0');
        if frac.len() > 18 {
            return Err(bad(format!("{shown} is finer than a nanosecond")));
        }
        let scale = 10u128.pow(frac.len() as u32);
        let frac_value: u128 = if frac.is_empty() {
            0
        } else {
            frac.parse().map_err(|_| too_long())?
        };
        let frac_ns = frac_value * ns_per_unit;
        if !frac_ns.is_multiple_of(scale) {
            return Err(bad(format!("{shown} is finer than a nanosecond")));
        }
        let ns = whole
            .checked_mul(ns_per_unit)
            .and_then(|n| n.checked_add(frac_ns / scale))
            .ok_or_else(too_long)?;
        if ns > Duration::MAX.as_nanos() {
            return Err(too_long());
        }
        let ns = ns as u64; // at most 30 days in nanoseconds, far below 2^64
        Ok(Duration(std::time::Duration::from_nanos(ns)))
    }
}

impl fmt::Display for Duration {
    /// Prints the largest unit that divides the duration exactly (`90s`,
    /// `1500ms`, `2h`), so that the output parses back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN: &[(&str, u128)] = &[
            ("d", 86_400_000_000_000),
            ("h", 3_600_000_000_000),
            ("m", 60_000_000_000),
            ("s", 1_000_000_000),
            ("ms", 1_000_000),
            ("us", 1_000),
        ];
        let ns = self.0.as_nanos();
        if ns == 0 {
            return f.write_str("0s");
        }
        for (unit, factor) in SHOWN {
            if ns.is_multiple_of(*factor) {
                return write!(f, "{}{unit}", ns / factor);
            }
        }
        write!(f, "{ns}ns")
    }
}

/// `text` as a quoted string of at most `max` characters; a longer one is
/// cut, with the number of characters left out, so that an error about a
/// huge argument stays one readable line.
pub fn shorten(text: &str, max: usize) -> String {
    let count = text.chars().count();
    if count <= max {
        return format!("{text:?}");
    }
    let head: String = text.chars().take(max).collect();
    format!("{head:?}... ({} more characters)", count - max)
}

/// Parses a 32-bit value written in decimal or with a `0x` prefix in hex.
pub fn parse_u32(text: &str) -> Result<u32> {
    let s = text.trim();
    let shown = shorten(text, 40);
    let bad = |why: &dyn std::fmt::Display| {
        Error::arg(
            "value",
            format!(
                "{shown} is not a 32-bit unsigned value ({why}); write it in decimal (305419896) or hex (0x12345678)"
            ),
        )
    };
    if s.starts_with('-') {
        return Err(bad(&"it is negative; the value must be non-negative"));
    }
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
pub(crate) fn round_up(n: u64, align: u64) -> Option<u64> {
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
            ("-1", "must be non-negative"),
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
        assert!(
            parse_u32("-1")
                .unwrap_err()
                .to_string()
                .contains("must be non-negative")
        );
        assert!(
            parse_u32("ten")
                .unwrap_err()
                .to_string()
                .contains("\"ten\"")
        );
    }

    #[test]
    fn durations() {
        use std::time::Duration as D;
        for (s, d) in [
            ("10", D::from_secs(10)),
            ("0.5", D::from_millis(500)),
            ("10s", D::from_secs(10)),
            ("500ms", D::from_millis(500)),
            ("1m", D::from_secs(60)),
            ("1.5s", D::from_millis(1500)),
            (".25s", D::from_millis(250)),
            ("2h", D::from_secs(7200)),
            ("250us", D::from_micros(250)),
            ("7ns", D::from_nanos(7)),
            ("1 MS", D::from_millis(1)),
            ("30d", Duration::MAX),
            ("0", D::ZERO),
            ("0.000000001", D::from_nanos(1)),
        ] {
            assert_eq!(s.parse::<Duration>().unwrap(), Duration(d), "{s}");
        }
    }

    #[test]
    fn bad_durations_say_why() {
        for (s, why) in [
            ("", "empty"),
            ("s", "does not start with a number"),
            ("-1", "must be non-negative"),
            ("1e20", "unknown unit"),
            ("1e20s", "unknown unit"),
            ("10 parsecs", "unknown unit"),
            ("31d", "longer than 30 days"),
            ("99999999999999999999999999999999", "longer than 30 days"),
            ("0.0000000001", "finer than a nanosecond"),
            ("1.2.3s", "more than one decimal point"),
            ("NaN", "does not start with a number"),
            ("inf", "does not start with a number"),
        ] {
            let e = s.parse::<Duration>().unwrap_err().to_string();
            assert!(e.contains(why), "{s:?}: {e}");
            assert!(e.contains("expected a duration"), "{e}");
        }
    }

    #[test]
    fn long_inputs_are_not_echoed_in_full() {
        let long = "9".repeat(100_000) + "XB";
        for e in [
            long.parse::<ByteSize>().unwrap_err().to_string(),
            long.parse::<Duration>().unwrap_err().to_string(),
            parse_u32(&long).unwrap_err().to_string(),
        ] {
            assert!(e.len() < 400, "{} bytes: {}", e.len(), &e[..400]);
            assert!(e.contains("more characters"), "{e}");
        }
        assert_eq!(shorten("abc", 3), "\"abc\"");
        assert_eq!(shorten("abcd", 3), "\"abc\"... (1 more characters)");
    }

    proptest::proptest! {
        #[test]
        fn duration_display_parses_back(ns in 0..=Duration::MAX.as_nanos() as u64) {
            let d = Duration(std::time::Duration::from_nanos(ns));
            let shown = d.to_string();
            proptest::prop_assert_eq!(shown.parse::<Duration>().unwrap(), d);
        }

        #[test]
        fn duration_parsing_never_panics_and_stays_bounded(s in "\\PC{0,40}") {
            if let Ok(d) = s.parse::<Duration>() {
                proptest::prop_assert!(d.0 <= Duration::MAX);
                // A deadline from any accepted duration is representable.
                proptest::prop_assert!(std::time::Instant::now().checked_add(d.0).is_some());
            }
        }

        #[test]
        fn decimal_seconds_parse_exactly(whole in 0u64..2_592_000, millis in 0u64..1000) {
            let s = format!("{whole}.{millis:03}");
            let want = std::time::Duration::from_millis(whole * 1000 + millis);
            proptest::prop_assert_eq!(s.parse::<Duration>().unwrap().0, want);
            let with_unit = format!("{}ms", whole * 1000 + millis);
            proptest::prop_assert_eq!(with_unit.parse::<Duration>().unwrap().0, want);
        }

        #[test]
        fn size_parsing_never_panics(s in "\\PC{0,40}") {
            let _ = s.parse::<ByteSize>();
            let _ = parse_u32(&s);
        }
    }

    #[test]
    fn rounding() {
        assert_eq!(round_up(1, 2 << 20), Some(2 << 20));
        assert_eq!(round_up(2 << 20, 2 << 20), Some(2 << 20));
        assert_eq!(round_up(0, 4096), Some(0));
        assert_eq!(round_up(u64::MAX, 4096), None);
    }
}
