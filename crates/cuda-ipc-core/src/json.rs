//! Strict, field-by-field decoding of JSON objects, for the decoders of
//! untrusted records (descriptors, PyTorch share records): every error names
//! the field and says what was found, and a document that names a key twice
//! is refused rather than read as its last value.

use std::fmt;
use std::str::FromStr;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// What a JSON value is, in words.
pub fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Parses a JSON document as [`serde_json::from_str`] does, but refuses an
/// object that has the same key twice (serde_json keeps the last one, so two
/// readers of one document could disagree on what it says). The error is
/// serde_json's, or names the duplicate key.
pub fn parse_strict(text: &str) -> serde_json::Result<Value> {
    serde_json::from_str::<Strict>(text).map(|s| s.0)
}

/// A JSON value read with no duplicate keys at any depth.
pub struct Strict(pub Value);

impl<'de> Deserialize<'de> for Strict {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor).map(Strict)
    }
}

struct StrictVisitor;

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> std::result::Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> std::result::Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> std::result::Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E>(self, v: f64) -> std::result::Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, v: &str) -> std::result::Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> std::result::Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> std::result::Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> std::result::Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> std::result::Result<Value, D::Error> {
        Strict::deserialize(d).map(|s| s.0)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(Strict(v)) = seq.next_element()? {
            items.push(v);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let Strict(v) = map.next_value()?;
            if out.contains_key(&key) {
                return Err(de::Error::custom(format_args!(
                    "the key {} appears twice in one object",
                    crate::units::shorten(&key, 40)
                )));
            }
            out.insert(key, v);
        }
        Ok(Value::Object(out))
    }
}

/// The fields of one JSON object, with the decoder's way of building an
/// error for a field (`field`, `reason`). [`Fields::req`] and
/// [`Fields::opt`] read a field as any [`Field`] type.
pub struct Fields<'a> {
    map: &'a Map<String, Value>,
    err: fn(&str, String) -> Error,
}

impl<'a> Fields<'a> {
    /// The fields of `map`; `err` builds the error about a field.
    pub fn new(map: &'a Map<String, Value>, err: fn(&str, String) -> Error) -> Self {
        Fields { map, err }
    }

    /// An error about `key`.
    fn err(&self, key: &str, reason: impl Into<String>) -> Error {
        (self.err)(key, reason.into())
    }

    /// The first key that is not in `known`.
    pub fn unknown(&self, known: &[&str]) -> Option<&'a str> {
        self.map
            .keys()
            .map(String::as_str)
            .find(|k| !known.contains(k))
    }

    /// The field `key` as a `T`; missing (or `null`) is an error.
    pub fn req<T: Field<'a>>(&self, key: &str) -> Result<T> {
        match self.opt(key)? {
            Some(v) => Ok(v),
            None => Err(self.err(key, "missing")),
        }
    }

    /// The field `key` as a `T`, or `None` when it is missing or `null`.
    pub fn opt<T: Field<'a>>(&self, key: &str) -> Result<Option<T>> {
        match self.map.get(key).filter(|v| !v.is_null()) {
            Some(v) => T::read(self, key, v).map(Some),
            None => Ok(None),
        }
    }
}

/// A type [`Fields::req`] and [`Fields::opt`] read a field as: the raw
/// `&Value`, `bool`, `u64`, `u32`, `&str`, `Vec<u64>` and `Vec<i64>`
/// (arrays of whole numbers), `Vec<u8>` (a string of hex digits), and this
/// crate's types that parse from a string (the handles, [`DeviceUuid`],
/// [`Dtype`], [`Mechanism`]), with the parser's error as the reason.
///
/// [`DeviceUuid`]: crate::device::DeviceUuid
/// [`Dtype`]: crate::descriptor::Dtype
/// [`Mechanism`]: crate::descriptor::Mechanism
pub trait Field<'a>: Sized + read::Read<'a> {}

impl<'a, T: read::Read<'a>> Field<'a> for T {}

pub(crate) mod read {
    use super::{Error, Fields, FromStr, Result, Value, kind_of};

    /// How a field is read: `v` is the value of `key`, never `null`.
    pub trait Read<'a>: Sized {
        fn read(f: &Fields<'a>, key: &str, v: &'a Value) -> Result<Self>;
    }

    impl<'a> Read<'a> for &'a Value {
        fn read(_: &Fields<'a>, _: &str, v: &'a Value) -> Result<Self> {
            Ok(v)
        }
    }

    impl<'a> Read<'a> for bool {
        fn read(f: &Fields<'a>, key: &str, v: &'a Value) -> Result<Self> {
            v.as_bool()
                .ok_or_else(|| f.err(key, format!("expected true or false, found {}", kind_of(v))))
        }
    }

    impl<'a> Read<'a> for u64 {
        fn read(f: &Fields<'a>, key: &str, v: &'a Value) -> Result<Self> {
            v.as_u64().ok_or_else(|| match v {
                // serde_json reads a whole number past u64 (2^64 and up) as a float.
                Value::Number(n)
                    if n.as_f64()
                        .is_some_and(|x| x >= 18_446_744_073_709_551_616.0) =>
                {
                    f.err(
                        key,
                        format!("{n} is too large (the largest accepted is {})", u64::MAX),
                    )
                }
                Value::Number(n) if n.as_f64().is_some_and(|x| x < 0.0) => {
                    f.err(key, format!("{n} is negative"))
                }
                Value::Number(n) => f.err(key, format!("{n} is not a whole number")),
                other => f.err(
                    key,
                    format!(
                        "expected a non-negative whole number, found {}",
                        kind_of(other)
                    ),
                ),
            })
        }
    }

    impl<'a> Read<'a> for u32 {
        fn read(f: &Fields<'a>, key: &str, v: &'a Value) -> Result<Self> {
            let n = u64::read(f, key, v)?;
            u32::try_from(n).map_err(|_| f.err(key, format!("{n} is too large")))
        }
    }

    impl<'a> Read<'a> for &'a str {
        fn read(f: &Fields<'a>, key: &str, v: &'a Value) -> Result<Self> {
            v.as_str()
                .ok_or_else(|| f.err(key, format!("expected a string, found {}", kind_of(v))))
        }
    }

    /// A string of hex digits, as bytes.
    impl<'a> Read<'a> for Vec<u8> {
        fn read(f: &Fields<'a>, key: &str, v: &'a Value) -> Result<Self> {
            let s = v.as_str().ok_or_else(|| {
                f.err(key, format!("expected a hex string, found {}", kind_of(v)))
            })?;
            if let Some((i, c)) = s.char_indices().find(|(_, c)| !c.is_ascii_hexdigit()) {
                return Err(f.err(
                    key,
                    format!("character {c:?} at position {i} is not a hex digit"),
                ));
            }
            if !s.len().is_multiple_of(2) {
                return Err(f.err(
                    key,
                    format!("{} hex digits is not a whole number of bytes", s.len()),
                ));
            }
            hex::decode(s).map_err(|e| f.err(key, e.to_string()))
        }
    }

    fn array_of<'a>(f: &Fields<'a>, key: &str, v: &'a Value) -> Result<&'a Vec<Value>> {
        v.as_array().ok_or_else(|| {
            f.err(
                key,
                format!("expected an array of whole numbers, found {}", kind_of(v)),
            )
        })
    }

    impl<'a> Read<'a> for Vec<u64> {
        fn read(f: &Fields<'a>, key: &str, v: &'a Value) -> Result<Self> {
            array_of(f, key, v)?
                .iter()
                .enumerate()
                .map(|(i, item)| u64::read(f, &format!("{key}[{i}]"), item))
                .collect()
        }
    }

    impl<'a> Read<'a> for Vec<i64> {
        fn read(f: &Fields<'a>, key: &str, v: &'a Value) -> Result<Self> {
            array_of(f, key, v)?
                .iter()
                .enumerate()
                .map(|(i, item)| {
                    let k = format!("{key}[{i}]");
                    item.as_i64().ok_or_else(|| match item {
                        Value::Number(n) if n.is_f64() => {
                            f.err(&k, format!("{n} is not a whole number"))
                        }
                        Value::Number(n) => f.err(&k, format!("{n} is too large")),
                        other => f.err(
                            &k,
                            format!("expected a whole number, found {}", kind_of(other)),
                        ),
                    })
                })
                .collect()
        }
    }

    /// A string field parsed with `FromStr`, the parser's error as the reason.
    pub(crate) fn parsed<'a, T: FromStr<Err = Error>>(
        f: &Fields<'a>,
        key: &str,
        v: &'a Value,
    ) -> Result<T> {
        let text = <&str>::read(f, key, v)?;
        text.parse().map_err(|e: Error| {
            // The parsers quote what they were given; quote a long value cut short.
            let reason = e
                .to_string()
                .replace(&format!("{text:?}"), &crate::units::shorten(text, 40));
            f.err(key, reason)
        })
    }

    /// Makes a type that parses from a string (`FromStr` with this
    /// crate's error) a [`Field`](super::Field), where the type is defined.
    macro_rules! field_from_str {
        ($($ty:ty),*) => {$(
            impl<'a> $crate::json::read::Read<'a> for $ty {
                fn read(
                    f: &$crate::json::Fields<'a>,
                    key: &str,
                    v: &'a serde_json::Value,
                ) -> $crate::error::Result<Self> {
                    $crate::json::read::parsed(f, key, v)
                }
            }
        )*};
    }
    pub(crate) use field_from_str;
}

/// Implements `FromStr`, `Display`, `Serialize` and `Deserialize` for a
/// record type through its strict JSON decoder and encoder
/// (`from_json`, `from_value`, `to_json`, `to_value`), so that every way in
/// goes through the same validation.
#[doc(hidden)]
#[macro_export]
macro_rules! json_record {
    ($ty:ty) => {
        impl std::str::FromStr for $ty {
            type Err = $crate::error::Error;
            fn from_str(s: &str) -> $crate::error::Result<Self> {
                <$ty>::from_json(s)
            }
        }

        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(&self.to_json())
            }
        }

        impl serde::Serialize for $ty {
            fn serialize<S: serde::Serializer>(
                &self,
                s: S,
            ) -> std::result::Result<S::Ok, S::Error> {
                self.to_value().serialize(s)
            }
        }

        impl<'de> serde::Deserialize<'de> for $ty {
            fn deserialize<D: serde::Deserializer<'de>>(
                d: D,
            ) -> std::result::Result<Self, D::Error> {
                let $crate::json::Strict(v) = $crate::json::Strict::deserialize(d)?;
                <$ty>::from_value(&v).map_err(serde::de::Error::custom)
            }
        }
    };
}
#[doc(hidden)]
pub use crate::json_record;

/// Appends `s` to `out` as a JSON string: quoted and escaped as
/// `serde_json` escapes it (the same text), with runs of 8 bytes that need
/// no escape found a word at a time (long text that is mostly base64, a
/// set record's, is copied in whole).
pub fn push_string(out: &mut String, s: &str) {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    const HEX: &[u8; 16] = b"0123456789abcdef";
    // Whether a byte of `w` is zero / less than 0x20 (exact tests).
    let zero = |w: u64| w.wrapping_sub(ONES) & !w & HIGH != 0;
    let control = |w: u64| w.wrapping_sub(ONES * 0x20) & !w & HIGH != 0;
    let plain = |w: u64| !(zero(w ^ (ONES * 0x22)) || zero(w ^ (ONES * 0x5c)) || control(w));
    out.reserve(s.len() + 2);
    out.push('"');
    let bytes = s.as_bytes();
    let (mut copied, mut i) = (0, 0);
    while i < bytes.len() {
        if let Some(word) = bytes.get(i..i + 8)
            && plain(u64::from_le_bytes(word.try_into().expect("8 bytes")))
        {
            i += 8;
            continue;
        }
        let unicode;
        let escape = match bytes[i] {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            b'\n' => "\\n",
            b'\r' => "\\r",
            b'\t' => "\\t",
            0x08 => "\\b",
            0x0c => "\\f",
            b @ 0..=0x1f => {
                unicode = [
                    b'\\',
                    b'u',
                    b'0',
                    b'0',
                    HEX[usize::from(b >> 4)],
                    HEX[usize::from(b & 0xf)],
                ];
                std::str::from_utf8(&unicode).expect("ASCII")
            }
            _ => {
                i += 1;
                continue;
            }
        };
        out.push_str(&s[copied..i]);
        out.push_str(escape);
        i += 1;
        copied = i;
    }
    out.push_str(&s[copied..]);
    out.push('"');
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::push_string;

    fn pushed(s: &str) -> String {
        let mut out = String::from("x");
        push_string(&mut out, s);
        out
    }

    #[test]
    fn strings_are_escaped_as_serde_json_escapes_them() {
        for s in [
            "",
            "plain",
            "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo=",
            "a\"b\\c\n\r\t\u{8}\u{c}\u{1}\u{1f}\u{7f} é€😀",
            "\"\"\"\"\"\"\"\"\"",
            "0123456\"",
            "01234567\\",
            "abcdefgh\u{1}ijklmnop",
        ] {
            assert_eq!(
                pushed(s),
                format!("x{}", serde_json::to_string(s).unwrap()),
                "{s:?}"
            );
        }
    }

    proptest! {
        #[test]
        fn any_string_is_escaped_as_serde_json_escapes_it(
            s in "([A-Za-z0-9+/=]{0,20}|\\PC|[\"\\\\\u{0}-\u{1f}\u{7f}-\u{ff}]){0,40}"
        ) {
            prop_assert_eq!(pushed(&s), format!("x{}", serde_json::to_string(&s).unwrap()));
        }
    }
}
