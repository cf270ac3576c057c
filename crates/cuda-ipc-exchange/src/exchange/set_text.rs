//! A set record's text published as hidden entries of at most
//! [`SET_PART_BYTES`] each, cut at character boundaries.

use serde_json::{Value, json};

use crate::channel::Server;
use crate::channel::wire::Meta;
use crate::error::Result;

/// Set records longer than this (bytes of JSON) travel in parts.
pub const SET_PART_BYTES: usize = 96 * 1024;

/// Publishes `text` as hidden entries `PREFIX/0`, `PREFIX/1`, ... of at
/// most [`SET_PART_BYTES`] each, metadata `{"text": piece}` (written
/// here, not encoded); returns their names. On an error none stays.
pub(super) fn publish_pieces(server: &Server, prefix: &str, text: &str) -> Result<Vec<String>> {
    let mut parts: Vec<String> = Vec::new();
    for (i, piece) in split_utf8(text, SET_PART_BYTES).into_iter().enumerate() {
        let part = format!("{prefix}/{i}");
        let mut meta_text = String::with_capacity(piece.len() + 16);
        meta_text.push_str("{\"text\":");
        crate::json::push_string(&mut meta_text, piece);
        meta_text.push('}');
        let published = meta_with_text(json!({ "text": piece }), meta_text)
            .and_then(|meta| Ok(server.publish(&part, meta, Vec::new())?));
        if let Err(e) = published {
            unpublish_all(server, &parts);
            return Err(e);
        }
        parts.push(part);
    }
    Ok(parts)
}

/// Unpublishes `names` (their leases, if any, stay until released).
pub(super) fn unpublish_all(server: &Server, names: &[String]) {
    for n in names {
        let _ = server.unpublish(n);
    }
}

/// Metadata of `value` with `text`, its JSON text as written here.
pub(super) fn meta_with_text(value: Value, text: String) -> Result<Meta> {
    Ok(Meta::with_text(value, text)?)
}

/// `text` in pieces of at most `max` bytes, cut at character boundaries.
pub(super) fn split_utf8(text: &str, max: usize) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let mut cut = max.min(rest.len());
        while !rest.is_char_boundary(cut) {
            cut -= 1;
        }
        let (a, b) = rest.split_at(cut);
        out.push(a);
        rest = b;
    }
    out
}
