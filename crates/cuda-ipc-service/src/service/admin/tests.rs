//! The admin bodies: the documented JSON, round trips, strict decoding.

use proptest::prelude::*;
use serde_json::json;

use super::*;
use crate::service::catalog::{Holder, UidUsage};

#[test]
fn load_bodies_match_the_documented_json() {
    let r = LoadRequest::new("model", "/data/m.safetensors");
    assert_eq!(
        encode(&r),
        json!({"set": "model", "path": "/data/m.safetensors"})
    );
    let r = r.with_copies(Some(8), Some(2 << 20));
    assert_eq!(
        encode(&r),
        json!({"set": "model", "path": "/data/m.safetensors", "streams": 8, "staging": 2_097_152})
    );
    assert_eq!(decode::<LoadRequest>("load", &encode(&r)).unwrap(), r);
    let a = LoadAnswer {
        set: "model".into(),
        version: 1,
        path: "/data/m.safetensors".into(),
        files: 1,
        tensors: 3,
        bytes: 100,
        allocated: 768,
        streams: 8,
        load_s: 0.5,
        gb_per_s: 2e-7,
    };
    assert_eq!(decode::<LoadAnswer>("load", &encode(&a)).unwrap(), a);
}

#[test]
fn decoding_is_strict_and_names_the_field() {
    let e =
        decode::<LoadRequest>("load", &json!({"set": "m", "path": "/p", "mode": "w"})).unwrap_err();
    assert!(
        e.contains("unknown field `mode`") && e.contains("load"),
        "{e}"
    );
    let e = decode::<LoadRequest>("load", &json!({"set": "m"})).unwrap_err();
    assert!(e.contains("path"), "{e}");
    let e = decode::<DropRequest>("drop", &json!({"set": 5})).unwrap_err();
    assert!(e.contains("invalid type"), "{e}");
    assert!(decode::<LsRequest>("ls", &json!({"all": true})).is_err());
    assert!(decode::<LsRequest>("ls", &json!([])).is_err());
    assert_eq!(decode::<LsRequest>("ls", &json!({})).unwrap(), LsRequest {});
    // force defaults to false.
    assert_eq!(
        decode::<DropRequest>("drop", &json!({"set": "m"})).unwrap(),
        DropRequest::new("m", false)
    );
    let e = decode::<StatsAnswer>("stats", &json!({"pid": 1})).unwrap_err();
    assert!(e.contains("missing field"), "{e}");
}

#[test]
fn load_requests_are_checked_before_any_file_is_opened() {
    assert!(LoadRequest::new("model", "/m").validate().is_ok());
    let e = LoadRequest::new("model", "m.safetensors")
        .validate()
        .unwrap_err();
    assert!(e.contains("not absolute"), "{e}");
    let e = LoadRequest::new("", "/m").validate().unwrap_err();
    assert!(e.contains("set name"), "{e}");
    let hidden = format!("{}x", crate::exchange::HIDDEN_ENTRY_PREFIX);
    assert!(LoadRequest::new(hidden, "/m").validate().is_err());
    let long = format!("/{}", "a".repeat(MAX_PATH_LEN));
    assert!(LoadRequest::new("m", long).validate().is_err());
}

#[test]
fn a_shard_s_load_names_its_set_and_is_checked() {
    use crate::checkpoint::{TpRule, TpShard};
    let shard = TpShard::new(
        3,
        8,
        vec![TpRule::split("experts", 1), TpRule::replicate("bias")],
    )
    .unwrap();
    let r = LoadRequest::new("model", "/m").with_tp(Some(&shard));
    assert_eq!(
        encode(&r),
        json!({"set": "model", "path": "/m",
               "tp": {"rank": 3, "world": 8, "rules": [["experts", 1], ["bias", null]]}})
    );
    assert_eq!(decode::<LoadRequest>("load", &encode(&r)).unwrap(), r);
    assert_eq!(r.target().unwrap(), ("model.tp3-of-8".into(), Some(shard)));
    // No rules: the field is left out, and a body without it decodes.
    let plain = TpShard::new(0, 2, vec![]).unwrap();
    let r = LoadRequest::new("model", "/m").with_tp(Some(&plain));
    assert_eq!(encode(&r)["tp"], json!({"rank": 0, "world": 2}));
    assert_eq!(
        LoadRequest::new("m", "/m").target().unwrap(),
        ("m".into(), None)
    );
    let e = decode::<LoadRequest>(
        "load",
        &json!({"set": "m", "path": "/p", "tp": {"rank": 0, "world": 2, "dims": 1}}),
    )
    .unwrap_err();
    assert!(e.contains("unknown field `dims`"), "{e}");
    // Bad shards, rules and names are refused by validate, naming them.
    let body = |tp: serde_json::Value| {
        decode::<LoadRequest>("load", &json!({"set": "model", "path": "/m", "tp": tp})).unwrap()
    };
    for (tp, word) in [
        (json!({"rank": 2, "world": 2}), "rank 2 of 2"),
        (json!({"rank": 0, "world": 0}), "0 ranks"),
        (json!({"rank": 0, "world": 65}), "65 ranks"),
        (
            json!({"rank": 0, "world": 2, "rules": [["", 0]]}),
            "pattern",
        ),
    ] {
        let e = body(tp).validate().unwrap_err();
        assert!(e.contains("tp:") && e.contains(word), "{e}");
    }
    let long = "m".repeat(crate::channel::MAX_ENTRY_NAME_LEN - 3);
    assert!(LoadRequest::new(&long, "/m").validate().is_ok());
    let e = LoadRequest::new(&long, "/m")
        .with_tp(Some(&plain))
        .validate()
        .unwrap_err();
    assert!(e.contains("set name"), "{e}");
}

#[test]
fn answers_round_trip() {
    let holder = Holder { pid: 7, uid: 1000 };
    let ls = LsAnswer {
        sets: vec![SetRow {
            name: "m".into(),
            bytes: 512,
            payload_bytes: 100,
            tensors: 2,
            version: 3,
            owner_uid: 1000,
            loaded_from: "/m".into(),
            created_unix: 1,
            leases: vec![holder],
            state: SetState::Writing,
            writer: Some(WriterRow {
                pid: 8,
                uid: 1000,
                version: 4,
                bytes: 512,
            }),
            restarts: 2,
            not_reconnected: vec![Holder { pid: 9, uid: 0 }],
        }],
    };
    assert_eq!(decode::<LsAnswer>("ls", &encode(&ls)).unwrap(), ls);
    assert_eq!(encode(&ls)["sets"][0]["not_reconnected"][0]["pid"], 9);
    assert_eq!(encode(&ls)["sets"][0]["state"], "writing");
    // A row of a service without writers reads as committed.
    let mut row = encode(&ls)["sets"][0].clone();
    let obj = row.as_object_mut().unwrap();
    obj.remove("state");
    obj.remove("writer");
    obj.remove("not_reconnected");
    let old: SetRow = decode("ls", &row).unwrap();
    assert_eq!((old.state, old.writer), (SetState::Committed, None));
    assert!(old.not_reconnected.is_empty());
    // None: left out, so older clients read the row.
    let mut none = ls.sets[0].clone();
    none.not_reconnected.clear();
    assert!(encode(&none).get("not_reconnected").is_none());
    let stats = StatsAnswer {
        pid: 1,
        service_uid: 1000,
        default_quota: None,
        uids: vec![UidUsage {
            uid: 1000,
            used: 512,
            held: 0,
            reserved: 0,
            quota: Some(1 << 30),
            sets: 1,
        }],
        sets: 1,
        total_bytes: 512,
        loads_in_progress: 0,
        leases: 1,
        device_free: Some(1),
        device_total: None,
        stopping: false,
    };
    assert_eq!(
        decode::<StatsAnswer>("stats", &encode(&stats)).unwrap(),
        stats
    );
    let dropped = DropAnswer {
        set: "m".into(),
        bytes: 512,
        held_by: vec![holder],
    };
    assert_eq!(
        decode::<DropAnswer>("drop", &encode(&dropped)).unwrap(),
        dropped
    );
    let stop = ShutdownAnswer { stopping: true };
    assert_eq!(
        decode::<ShutdownAnswer>("shutdown", &encode(&stop)).unwrap(),
        stop
    );
}

#[test]
fn method_names_are_valid_channel_methods() {
    for m in METHODS {
        crate::channel::server::validate_method(m).unwrap();
    }
}

#[test]
fn bodies_list_every_method_in_order() {
    let listed: Vec<&str> = BODIES.iter().map(|b| b.method).collect();
    assert_eq!(listed, METHODS, "add the new method to BODIES too");
    for b in BODIES {
        let err = (b.request)(&json!(null)).unwrap_err();
        assert!(err.contains(b.method), "{err}");
        let err = (b.answer)(&json!([])).unwrap_err();
        assert!(err.contains(&format!("{} answer", b.method)), "{err}");
    }
    let load = (BODIES[0].request)(&json!({"set": "m", "path": "/p", "staging": null})).unwrap();
    assert_eq!(load, json!({"set": "m", "path": "/p"}));
}

proptest! {
    #[test]
    fn load_requests_round_trip(
        set in ".{0,20}",
        path in ".{0,40}",
        streams in prop::option::of(any::<usize>()),
        staging in prop::option::of(any::<u64>()),
    ) {
        let r = LoadRequest::new(set, path).with_copies(streams, staging);
        prop_assert_eq!(decode::<LoadRequest>("load", &encode(&r)).unwrap(), r.clone());
        let shard = crate::checkpoint::TpShard::new(0, 4, vec![]).unwrap();
        let r = r.with_tp(Some(&shard));
        prop_assert_eq!(decode::<LoadRequest>("load", &encode(&r)).unwrap(), r);
    }

    #[test]
    fn decode_never_panics(body in prop_oneof![
        Just(json!(null)), Just(json!({})), Just(json!({"set": "m", "force": 1})),
        ".{0,20}".prop_map(|s| json!({"set": s, "path": s})),
        any::<u64>().prop_map(|n| json!({"set": "m", "path": "/p", "streams": n})),
    ]) {
        let _ = decode::<LoadRequest>("load", &body);
        let _ = decode::<DropRequest>("drop", &body);
        let _ = decode::<LsRequest>("ls", &body);
    }
}

#[test]
fn write_bodies_match_the_documented_json_and_are_strict() {
    let r = OpenWriteRequest::existing("model");
    assert_eq!(encode(&r), json!({"set": "model"}));
    let r = OpenWriteRequest::new_set(
        "model",
        vec![TensorSpec::new("w", cuda_ipc_core::Dtype::Bf16, vec![2, 3])],
    );
    assert_eq!(
        encode(&r),
        json!({"set": "model", "layout": [{"name": "w", "dtype": "bf16", "shape": [2, 3]}]})
    );
    assert_eq!(
        decode::<OpenWriteRequest>("open_write", &encode(&r)).unwrap(),
        r
    );
    let c = CommitRequest::new("model", "00ff");
    assert_eq!(encode(&c), json!({"set": "model", "layout_hash": "00ff"}));
    assert_eq!(encode(&AbortRequest::new("m")), json!({"set": "m"}));
    for (method, body) in [
        ("open_write", json!({"set": "m", "mode": "w"})),
        (
            "open_write",
            json!({"set": "m", "layout": [{"name": "w", "dtype": "f32", "shape": [1], "offset": 0}]}),
        ),
        (
            "open_write",
            json!({"set": "m", "layout": [{"name": "w", "shape": [1]}]}),
        ),
        (
            "open_write",
            json!({"set": "m", "layout": [{"name": "w", "dtype": "f32", "shape": [-1]}]}),
        ),
    ] {
        assert!(decode::<OpenWriteRequest>(method, &body).is_err(), "{body}");
    }
    assert!(decode::<CommitRequest>("commit", &json!({"set": "m"})).is_err());
    assert!(
        decode::<CommitRequest>("commit", &json!({"set": "m", "layout_hash": "a", "v": 1}))
            .is_err()
    );
    assert!(decode::<AbortRequest>("abort", &json!({})).is_err());
    let a = OpenWriteAnswer {
        set: "m".into(),
        version: 2,
        staging: ".cuda-ipc/unlisted/stage/ab".into(),
        tensors: 1,
        payload_bytes: 12,
        bytes: 256,
        layout_hash: "0123456789abcdef".into(),
        creates: false,
        in_place: false,
    };
    assert_eq!(
        decode::<OpenWriteAnswer>("open_write", &encode(&a)).unwrap(),
        a
    );
    let a = CommitAnswer {
        set: "m".into(),
        version: 2,
        retired_version: Some(1),
        readers_told: 3,
    };
    assert_eq!(
        encode(&a),
        json!({"set": "m", "version": 2, "retired_version": 1, "readers_told": 3})
    );
    assert_eq!(decode::<CommitAnswer>("commit", &encode(&a)).unwrap(), a);
    let a = AbortAnswer {
        set: "m".into(),
        version: 2,
    };
    assert_eq!(decode::<AbortAnswer>("abort", &encode(&a)).unwrap(), a);
}
