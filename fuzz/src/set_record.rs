//! The properties of fuzz target `set_record` (`SetRecord::from_json`,
//! `from_value` and serde): never a panic; a record that decodes is valid,
//! round-trips through `to_json` to an equal record and the same text, and
//! every entry narrows to a valid descriptor; every error says something.
//!
//! Kept apart from `lib.rs` so that the target, and the corpus replay in
//! `crates/cuda-ipc/tests/set_record.rs`, include this one file.

use cuda_ipc::set::SetRecord;

/// The checks of `SetRecord` decoding on arbitrary bytes; panics if a
/// property fails.
pub fn set_record(data: &[u8]) {
    if let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) {
        let _ = SetRecord::from_value(&value).map_err(|e| explained(&e));
    }
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let parsed = SetRecord::from_json(text);
    let via_serde = serde_json::from_str::<SetRecord>(text);
    assert_eq!(
        parsed.is_ok(),
        via_serde.is_ok(),
        "from_json and serde disagree on {text:?}"
    );
    let record = match parsed {
        Ok(r) => r,
        Err(e) => return explained(&e),
    };
    record
        .validate()
        .expect("a decoded set record must validate");
    let json = record.to_json();
    let again = SetRecord::from_json(&json)
        .unwrap_or_else(|e| panic!("to_json wrote {json:?}, which does not parse: {e}"));
    assert_eq!(
        again, record,
        "the round trip through {json:?} changed the record"
    );
    assert_eq!(again.to_json(), json, "to_json is not canonical");
    assert_eq!(
        via_serde.ok().as_ref(),
        Some(&record),
        "serde decoded another record"
    );
    for i in 0..record.entries.len() {
        let d = record
            .entry_descriptor(i)
            .unwrap_or_else(|e| panic!("entry {i} of a valid set has no valid descriptor: {e}"));
        assert_eq!(d.byte_len, record.entries[i].len);
    }
}

fn explained(e: &impl std::fmt::Display) {
    assert!(!e.to_string().is_empty(), "an error printed as nothing");
}
