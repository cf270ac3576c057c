//! An entry's metadata as the messages about it carry it.

use std::sync::OnceLock;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;
use serde_json::value::RawValue;

/// An entry's metadata in a message: the producer's JSON value, and the
/// text it encodes to, made once (by the server when the entry is
/// published, where its length is checked; else at the first encoding)
/// and kept. The server shares one `Meta` (behind an `Arc`) with every
/// answer about the entry, so metadata that is large (a set's record of a
/// thousand entries) is written out once, rather than at every attach.
/// Reads through `Deref` see the value; equality is the value's.
#[derive(Debug, Clone)]
pub struct Meta {
    value: Value,
    text: OnceLock<Box<RawValue>>,
}

impl Meta {
    /// Metadata holding `value`.
    pub fn new(value: Value) -> Meta {
        Meta {
            value,
            text: OnceLock::new(),
        }
    }

    /// Metadata holding `value` with its text made now (a server's entry:
    /// the text's length is checked at publish, and every answer about the
    /// entry sends the text as it is). A producer that must know the
    /// length before it publishes makes its metadata so, and hands the
    /// `Meta` to [`Server::publish`](crate::server::Server::publish), which
    /// then encodes nothing again.
    pub fn encoded(value: Value) -> Meta {
        let meta = Meta::new(value);
        meta.text();
        meta
    }

    /// Metadata holding `value`, with `text` its JSON text as the caller
    /// wrote it (the same value; keys in any order): checked to be one JSON
    /// value, which is faster than encoding the value, and sent as it is.
    /// For a producer that writes long metadata faster than a value encodes
    /// (a set record whose base64 table is copied in whole).
    ///
    /// # Errors
    /// [`ChannelError::InvalidArgument`](crate::ChannelError::InvalidArgument)
    /// when `text` is not one JSON value.
    pub fn with_text(value: Value, text: String) -> Result<Meta, crate::ChannelError> {
        let raw = RawValue::from_string(text).map_err(|e| {
            crate::ChannelError::arg("metadata", format!("its text is not JSON: {e}"))
        })?;
        debug_assert_eq!(
            serde_json::from_str::<Value>(raw.get()).ok().as_ref(),
            Some(&value),
            "the text of metadata is its value's"
        );
        Ok(Meta {
            value,
            text: OnceLock::from(raw),
        })
    }

    /// The length in bytes of the value as compact JSON text (made once).
    pub fn text_len(&self) -> usize {
        self.text().get().len()
    }

    /// The value.
    pub fn value(&self) -> &Value {
        &self.value
    }

    /// The value, taken out.
    pub fn into_value(self) -> Value {
        self.value
    }

    /// The value as compact JSON text, made once.
    fn text(&self) -> &RawValue {
        self.text.get_or_init(|| {
            serde_json::value::to_raw_value(&self.value)
                .expect("a JSON value always encodes as JSON text")
        })
    }
}

impl From<Value> for Meta {
    fn from(value: Value) -> Meta {
        Meta::new(value)
    }
}

impl std::ops::Deref for Meta {
    type Target = Value;
    fn deref(&self) -> &Value {
        &self.value
    }
}

impl PartialEq for Meta {
    fn eq(&self, other: &Meta) -> bool {
        self.value == other.value
    }
}

impl Serialize for Meta {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.text().serialize(s)
    }
}

impl<'de> Deserialize<'de> for Meta {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Meta, D::Error> {
        Value::deserialize(d).map(Meta::new)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn it_encodes_as_its_value_does_once_and_again() {
        let v = json!({"b": [1, 2.5, "x\"y"], "a": {"n": null, "t": true}, "e": "\u{e9}"});
        let m = Meta::new(v.clone());
        let want = serde_json::to_string(&v).unwrap();
        assert_eq!(serde_json::to_string(&m).unwrap(), want);
        assert!(m.text.get().is_some(), "the text is kept");
        assert_eq!(serde_json::to_string(&m).unwrap(), want, "and used again");
        let back: Meta = serde_json::from_str(&want).unwrap();
        assert_eq!(back, m);
        assert_eq!(back.into_value(), v);
        let e = Meta::encoded(v.clone());
        assert!(e.text.get().is_some(), "made at once");
        assert_eq!(e.text_len(), want.len());
    }

    #[test]
    fn text_given_with_the_value_is_sent_as_it_is() {
        let v = json!({"b": "QUJD", "a": 1});
        // The caller's key order and spacing travel as they are.
        let text = r#"{"b":"QUJD", "a":1}"#;
        let m = Meta::with_text(v.clone(), text.to_owned()).unwrap();
        assert_eq!(m.text_len(), text.len());
        assert_eq!(serde_json::to_string(&m).unwrap(), text);
        let back: Meta = serde_json::from_str(text).unwrap();
        assert_eq!(back, m);
        for bad in ["", "{", r#"{"a":1} x"#, "{\"a\":\"\u{1}\"}"] {
            let e = Meta::with_text(v.clone(), bad.to_owned()).unwrap_err();
            assert!(e.to_string().contains("not JSON"), "{bad:?}: {e}");
        }
    }
}
