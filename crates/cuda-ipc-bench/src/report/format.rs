//! How figures are written: sizes in binary units, milliseconds with
//! enough digits for microsecond-scale figures.

/// A size in binary units.
pub fn human(n: u64) -> String {
    cuda_ipc::units::ByteSize(n).to_string()
}

/// Milliseconds with enough digits for microsecond-scale figures.
pub fn fmt_ms(v: f64) -> String {
    if !v.is_finite() {
        "-".into()
    } else if v.abs() < 1.0 {
        format!("{v:.4}")
    } else if v.abs() < 100.0 {
        format!("{v:.3}")
    } else {
        format!("{v:.1}")
    }
}
