//! The properties of fuzz target `admin_body` (the JSON bodies of the
//! weight service's admin calls, `cuda_ipc::service::admin`): the input,
//! if it is JSON, is decoded as the request and as the answer of every
//! method in `admin::BODIES` (a method added there is fuzzed without
//! changing this file). Nothing panics; what decodes encodes to a body
//! that decodes and encodes to the same JSON again (decode, encode, decode
//! round-trips); decoding drops no field it was given (but `null`s, the
//! same as absent, and `false`s, which flags such as `in_place` leave out
//! so that older services read the body); a refusal names the method.
//!
//! Kept apart from `lib.rs` so that the target, and the corpus replay in
//! `crates/cuda-ipc/tests/decoders.rs`, include this one file.

use cuda_ipc::service::admin::BODIES;
use serde_json::Value;

/// One body decoder on `body`: true if it accepts it.
fn check(
    method: &str,
    what: &str,
    decoder: fn(&Value) -> Result<Value, String>,
    body: &Value,
) -> bool {
    match decoder(body) {
        Ok(encoded) => {
            let Some(fields) = encoded.as_object() else {
                panic!("the {method} {what} encoded as {encoded}, not an object");
            };
            for (key, value) in body.as_object().expect("only objects decode") {
                assert!(
                    value.is_null() || *value == Value::Bool(false) || fields.contains_key(key),
                    "the {method} {what} dropped field {key:?}"
                );
            }
            let again = decoder(&encoded).unwrap_or_else(|e| {
                panic!("the {method} {what} encoded as {encoded}, which does not decode: {e}")
            });
            assert_eq!(
                again, encoded,
                "the {method} {what} changed in a round trip"
            );
            true
        }
        Err(e) => {
            assert!(
                e.contains(method),
                "the {method} {what} error {e:?} does not name the method"
            );
            false
        }
    }
}

/// The checks of every admin body decoder on arbitrary bytes; panics if a
/// property fails.
pub fn admin_body(data: &[u8]) {
    let _ = is_valid(data);
}

/// Runs the checks; whether some method's request or answer takes `data`
/// (the corpus replay checks that the seeds hold some).
pub fn is_valid(data: &[u8]) -> bool {
    let Ok(body) = serde_json::from_slice::<Value>(data) else {
        return false;
    };
    let mut any = false;
    for b in BODIES {
        any |= check(b.method, "request", b.request, &body);
        any |= check(b.method, "answer", b.answer, &body);
    }
    any
}
