//! The element types of safetensors files, as this crate's [`Dtype`].
//!
//! | safetensors | [`Dtype`] | PyTorch |
//! |---|---|---|
//! | `BOOL` | `bool` | `bool` |
//! | `U8` `I8` `U16` `I16` `U32` `I32` `U64` `I64` | `u8` ... `i64` | `uint8` ... `int64` |
//! | `F16` `BF16` `F32` `F64` | `f16` `bf16` `f32` `f64` | `float16` `bfloat16` `float32` `float64` |
//! | `F8_E4M3` | `f8e4m3fn` | `float8_e4m3fn` |
//! | `F8_E5M2` | `f8e5m2` | `float8_e5m2` |
//! | `F8_E4M3FNUZ` | `f8e4m3fnuz` | `float8_e4m3fnuz` |
//! | `F8_E5M2FNUZ` | `f8e5m2fnuz` | `float8_e5m2fnuz` |
//! | `F8_E8M0` | `f8e8m0fnu` | `float8_e8m0fnu` |
//! | `F4` | `f4e2m1fnx2`, last dimension halved | `float4_e2m1fn_x2` |
//! | `C64` | `c64` | `complex64` |
//! | `F6_E2M3` `F6_E3M2` | refused | none |
//!
//! A safetensors shape counts `F4` values (4 bits each); ours counts bytes,
//! two values each, as PyTorch's `float4_e2m1fn_x2` does. An `F4` tensor
//! whose last dimension is odd (or that has no dimension) has no such shape
//! and is refused, naming it. The 6-bit types have no byte-addressable form
//! here and are refused; so is any type a later safetensors adds.

use safetensors::Dtype as StDtype;

use crate::descriptor::Dtype;

/// This crate's element type and shape for a safetensors tensor of `dtype`
/// and `shape`, or why it cannot be carried (a sentence that names the
/// safetensors type).
pub(crate) fn from_safetensors(
    dtype: StDtype,
    shape: &[usize],
) -> Result<(Dtype, Vec<u64>), String> {
    let mut dims: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
    let ours = match dtype {
        StDtype::BOOL => Dtype::Bool,
        StDtype::U8 => Dtype::U8,
        StDtype::I8 => Dtype::I8,
        StDtype::U16 => Dtype::U16,
        StDtype::I16 => Dtype::I16,
        StDtype::U32 => Dtype::U32,
        StDtype::I32 => Dtype::I32,
        StDtype::U64 => Dtype::U64,
        StDtype::I64 => Dtype::I64,
        StDtype::F16 => Dtype::F16,
        StDtype::BF16 => Dtype::Bf16,
        StDtype::F32 => Dtype::F32,
        StDtype::F64 => Dtype::F64,
        StDtype::F8_E4M3 => Dtype::F8E4m3fn,
        StDtype::F8_E5M2 => Dtype::F8E5m2,
        StDtype::F8_E4M3FNUZ => Dtype::F8E4m3fnuz,
        StDtype::F8_E5M2FNUZ => Dtype::F8E5m2fnuz,
        StDtype::F8_E8M0 => Dtype::F8E8m0fnu,
        StDtype::C64 => Dtype::C64,
        StDtype::F4 => {
            match dims.last_mut() {
                Some(last) if *last % 2 == 0 => *last /= 2,
                _ => {
                    return Err(format!(
                        "dtype F4 with shape {shape:?}: packed two to a byte as \
                         f4e2m1fnx2, the last dimension must be even"
                    ));
                }
            }
            Dtype::F4E2m1fnX2
        }
        other => {
            return Err(format!(
                "dtype {other} has no counterpart here (carried: {}); convert the \
                 tensor to one of those before loading",
                CARRIED.join(", ")
            ));
        }
    };
    Ok((ours, dims))
}

/// The safetensors type and shape of a tensor of this crate's `dtype` and
/// `shape`: the inverse of [`from_safetensors`] (an `f4e2m1fnx2` shape
/// counts bytes, the file's counts values: its last dimension doubled), or
/// why the tensor has no safetensors form (a sentence naming the type).
pub(crate) fn to_safetensors(dtype: Dtype, shape: &[u64]) -> Result<(StDtype, Vec<usize>), String> {
    let too_large = || format!("shape {shape:?} is too large for this machine");
    let mut dims = shape
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| too_large()))
        .collect::<Result<Vec<usize>, String>>()?;
    let theirs = match dtype {
        Dtype::Bool => StDtype::BOOL,
        Dtype::U8 => StDtype::U8,
        Dtype::I8 => StDtype::I8,
        Dtype::U16 => StDtype::U16,
        Dtype::I16 => StDtype::I16,
        Dtype::U32 => StDtype::U32,
        Dtype::I32 => StDtype::I32,
        Dtype::U64 => StDtype::U64,
        Dtype::I64 => StDtype::I64,
        Dtype::F16 => StDtype::F16,
        Dtype::Bf16 => StDtype::BF16,
        Dtype::F32 => StDtype::F32,
        Dtype::F64 => StDtype::F64,
        Dtype::F8E4m3fn => StDtype::F8_E4M3,
        Dtype::F8E5m2 => StDtype::F8_E5M2,
        Dtype::F8E4m3fnuz => StDtype::F8_E4M3FNUZ,
        Dtype::F8E5m2fnuz => StDtype::F8_E5M2FNUZ,
        Dtype::F8E8m0fnu => StDtype::F8_E8M0,
        Dtype::C64 => StDtype::C64,
        Dtype::F4E2m1fnX2 => {
            let last = dims.last_mut().ok_or_else(|| {
                "dtype f4e2m1fnx2 with no dimension has no safetensors form (F4 counts \
                 values, two to a byte, along the last dimension)"
                    .to_string()
            })?;
            *last = last.checked_mul(2).ok_or_else(too_large)?;
            StDtype::F4
        }
        other => {
            return Err(format!(
                "dtype {other} has no safetensors type; convert the tensor to one that has \
                 (c128: to c64, or two f64 tensors) before saving"
            ));
        }
    };
    Ok((theirs, dims))
}

/// The safetensors type names that [`from_safetensors`] carries.
pub(crate) const CARRIED: [&str; 20] = [
    "BOOL",
    "U8",
    "I8",
    "U16",
    "I16",
    "U32",
    "I32",
    "U64",
    "I64",
    "F16",
    "BF16",
    "F32",
    "F64",
    "F8_E4M3",
    "F8_E5M2",
    "F8_E4M3FNUZ",
    "F8_E5M2FNUZ",
    "F8_E8M0",
    "F4",
    "C64",
];

#[cfg(test)]
mod tests {
    use super::*;

    /// Every carried type by its name in a header, parsed by the crate.
    fn st(name: &str) -> StDtype {
        serde_json::from_value(serde_json::Value::String(name.into())).unwrap()
    }

    #[test]
    fn every_carried_type_maps_to_one_of_the_same_bit_width() {
        let mut seen = std::collections::HashSet::new();
        for name in CARRIED {
            let dtype = st(name);
            assert_eq!(dtype.to_string(), name);
            let (ours, dims) = from_safetensors(dtype, &[3, 4]).unwrap();
            assert!(seen.insert(ours), "{name} maps to {ours}, as another does");
            // Bytes agree: elements * size == safetensors' bits / 8.
            let bytes = dims.iter().product::<u64>() * ours.size();
            assert_eq!(bytes, 12 * dtype.bitsize() as u64 / 8, "{name}");
        }
    }

    #[test]
    fn to_safetensors_inverts_from_safetensors() {
        for name in CARRIED {
            let shape: &[usize] = if name == "F4" { &[3, 8] } else { &[3, 4] };
            let (ours, dims) = from_safetensors(st(name), shape).unwrap();
            let (back, back_shape) = to_safetensors(ours, &dims).unwrap();
            assert_eq!((back, back_shape.as_slice()), (st(name), shape), "{name}");
        }
        let e = to_safetensors(Dtype::C128, &[2]).unwrap_err();
        assert!(e.contains("c128"), "{e}");
        let e = to_safetensors(Dtype::F4E2m1fnX2, &[]).unwrap_err();
        assert!(e.contains("f4e2m1fnx2"), "{e}");
    }

    #[test]
    fn the_fp8_names_follow_pytorch() {
        assert_eq!(
            from_safetensors(st("F8_E4M3"), &[1]).unwrap().0,
            Dtype::F8E4m3fn
        );
        assert_eq!(
            from_safetensors(st("F8_E8M0"), &[1]).unwrap().0,
            Dtype::F8E8m0fnu
        );
        assert_eq!(
            from_safetensors(st("F4"), &[2, 6]).unwrap(),
            (Dtype::F4E2m1fnX2, vec![2, 3])
        );
    }

    #[test]
    fn what_cannot_be_carried_is_named() {
        for name in ["F6_E2M3", "F6_E3M2"] {
            let e = from_safetensors(st(name), &[4]).unwrap_err();
            assert!(e.contains(name), "{e}");
        }
        for shape in [&[3usize][..], &[]] {
            let e = from_safetensors(st("F4"), shape).unwrap_err();
            assert!(e.contains("F4") && e.contains("even"), "{e}");
        }
    }
}
