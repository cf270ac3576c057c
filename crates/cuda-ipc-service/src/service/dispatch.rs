//! The service's call handler without the GPU: a call's method and body
//! decoded strictly and routed to the service's operations ([`Ops`]), the
//! caller's uid checked where a method needs it, the answer encoded.
//!
//! What needs no state is checked here, before any operation runs: the
//! body's fields and types, set names, a load's path, a new set's layout.
//! Every refusal's message is bounded ([`MAX_ERROR_MESSAGE_BYTES`]), so
//! that a body that quotes a huge string back (a name, a field, a value of
//! the wrong type) is answered with its own code, not `reply_too_large`.

use std::fmt::Write as _;

use serde_json::Value;

use crate::channel::CallError;

use super::admin::{
    self, AbortAnswer, AbortRequest, AsideAnswer, AsideRequest, BackAnswer, BackRequest,
    CommitAnswer, CommitRequest, DropAnswer, DropRequest, LoadAnswer, LoadRequest, LsAnswer,
    LsRequest, OpenWriteAnswer, OpenWriteRequest, ReadyAnswer, ReadyRequest, ReconnectedAnswer,
    ReconnectedRequest, Request, ShutdownAnswer, ShutdownRequest, StatsAnswer, StatsRequest,
    decode, encode,
};
use super::catalog::WriterId;

/// What the service does for each method.
pub(super) trait Ops {
    fn load(&self, uid: u32, request: &LoadRequest) -> Result<LoadAnswer, CallError>;
    fn ls(&self) -> LsAnswer;
    fn stats(&self) -> StatsAnswer;
    fn drop_set(&self, uid: u32, request: &DropRequest) -> Result<DropAnswer, CallError>;
    /// The uid the service runs as.
    fn service_uid(&self) -> u32;
    /// Asks the service to stop (as SIGTERM does).
    fn ask_stop(&self);
    /// Opens a write session for `caller` (its connection is the lock).
    fn open_write(
        &self,
        caller: WriterId,
        request: &OpenWriteRequest,
    ) -> Result<OpenWriteAnswer, CallError>;
    /// Commits the session `caller`'s connection holds.
    fn commit(&self, caller: WriterId, request: &CommitRequest) -> Result<CommitAnswer, CallError>;
    /// Aborts the session `caller`'s connection holds.
    fn abort(&self, caller: WriterId, request: &AbortRequest) -> Result<AbortAnswer, CallError>;
    /// `caller`'s connection stepped aside from a set (in-place writes).
    fn aside(&self, caller: WriterId, request: &AsideRequest) -> Result<AsideAnswer, CallError>;
    /// Waits for a set's in-place write to end; `caller` comes back.
    fn back(&self, caller: WriterId, request: &BackRequest) -> Result<BackAnswer, CallError>;
    /// `caller`'s process connected again after a restart and took back
    /// all but `pending`.
    fn reconnected(&self, caller: WriterId, pending: &[String]) -> ReconnectedAnswer;
}

/// The longest message of a refusal, in bytes; longer ones are cut (at a
/// character boundary) and say how long they were.
pub(super) const MAX_ERROR_MESSAGE_BYTES: usize = 2048;

/// The error for a body that does not decode.
pub(super) fn bad_request(message: String) -> CallError {
    CallError::new("bad_request", message)
}

/// `e` with its message cut to [`MAX_ERROR_MESSAGE_BYTES`].
fn bounded(mut e: CallError) -> CallError {
    if e.message.len() > MAX_ERROR_MESSAGE_BYTES {
        let total = e.message.len();
        let mut cut = MAX_ERROR_MESSAGE_BYTES;
        while !e.message.is_char_boundary(cut) {
            cut -= 1;
        }
        e.message.truncate(cut);
        let _ = write!(e.message, "... (cut: {total} bytes in all)");
    }
    e
}

/// Answers one call of `caller` (its credentials and connection).
pub(super) fn dispatch(
    ops: &impl Ops,
    caller: WriterId,
    method: &str,
    body: &Value,
) -> Result<Value, CallError> {
    route(ops, caller, method, body).map_err(bounded)
}

fn route(ops: &impl Ops, caller: WriterId, method: &str, body: &Value) -> Result<Value, CallError> {
    let uid = caller.uid;
    match method {
        LoadRequest::METHOD => {
            let r: LoadRequest = decode(method, body).map_err(bad_request)?;
            r.validate().map_err(bad_request)?;
            ops.load(uid, &r).map(|a| encode(&a))
        }
        LsRequest::METHOD => {
            let _: LsRequest = decode(method, body).map_err(bad_request)?;
            Ok(encode(&ops.ls()))
        }
        StatsRequest::METHOD => {
            let _: StatsRequest = decode(method, body).map_err(bad_request)?;
            Ok(encode(&ops.stats()))
        }
        DropRequest::METHOD => {
            let r: DropRequest = decode(method, body).map_err(bad_request)?;
            admin::validate_set_name(&r.set).map_err(bad_request)?;
            ops.drop_set(uid, &r).map(|a| encode(&a))
        }
        ShutdownRequest::METHOD => {
            let _: ShutdownRequest = decode(method, body).map_err(bad_request)?;
            let service = ops.service_uid();
            if uid != service {
                return Err(CallError::new(
                    "not_allowed",
                    format!("only the service's uid ({service}) may stop it, not uid {uid}"),
                ));
            }
            ops.ask_stop();
            Ok(encode(&ShutdownAnswer { stopping: true }))
        }
        OpenWriteRequest::METHOD => {
            let r: OpenWriteRequest = decode(method, body).map_err(bad_request)?;
            admin::validate_set_name(&r.set).map_err(bad_request)?;
            if let Some(specs) = &r.layout {
                super::layout::check(specs).map_err(bad_request)?;
            }
            ops.open_write(caller, &r).map(|a| encode(&a))
        }
        CommitRequest::METHOD => {
            let r: CommitRequest = decode(method, body).map_err(bad_request)?;
            admin::validate_set_name(&r.set).map_err(bad_request)?;
            if r.layout_hash.len() != 16 || !r.layout_hash.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(bad_request(format!(
                    "layout_hash must be the 16 hex digits the open_write answer named, not {} \
                     bytes",
                    r.layout_hash.len()
                )));
            }
            ops.commit(caller, &r).map(|a| encode(&a))
        }
        AbortRequest::METHOD => {
            let r: AbortRequest = decode(method, body).map_err(bad_request)?;
            admin::validate_set_name(&r.set).map_err(bad_request)?;
            ops.abort(caller, &r).map(|a| encode(&a))
        }
        AsideRequest::METHOD => {
            let r: AsideRequest = decode(method, body).map_err(bad_request)?;
            admin::validate_set_name(&r.set).map_err(bad_request)?;
            ops.aside(caller, &r).map(|a| encode(&a))
        }
        BackRequest::METHOD => {
            let r: BackRequest = decode(method, body).map_err(bad_request)?;
            admin::validate_set_name(&r.set).map_err(bad_request)?;
            ops.back(caller, &r).map(|a| encode(&a))
        }
        ReadyRequest::METHOD => {
            let _: ReadyRequest = decode(method, body).map_err(bad_request)?;
            // The handler answers no call before the kept sets are served.
            Ok(encode(&ReadyAnswer {
                sets: ops.ls().sets.len(),
            }))
        }
        ReconnectedRequest::METHOD => {
            let r: ReconnectedRequest = decode(method, body).map_err(bad_request)?;
            if r.pending.len() > admin::MAX_RECONNECTED_PENDING {
                return Err(bad_request(format!(
                    "pending names {} sets, more than {}",
                    r.pending.len(),
                    admin::MAX_RECONNECTED_PENDING
                )));
            }
            for set in &r.pending {
                admin::validate_set_name(set).map_err(bad_request)?;
            }
            Ok(encode(&ops.reconnected(caller, &r.pending)))
        }
        other => Err(CallError::new(
            "unknown_method",
            format!(
                "the service has no method {other:?}; it has {}",
                admin::METHODS.join(", ")
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use serde_json::json;

    use super::*;
    use crate::service::catalog::Holder;

    /// Records what it was asked; answers fixed values.
    #[derive(Default)]
    struct Fake {
        asked: RefCell<Vec<String>>,
    }

    impl Ops for Fake {
        fn load(&self, uid: u32, r: &LoadRequest) -> Result<LoadAnswer, CallError> {
            self.asked
                .borrow_mut()
                .push(format!("load {uid} {}", r.set));
            Err(CallError::new("over_quota", "no room"))
        }
        fn ls(&self) -> LsAnswer {
            self.asked.borrow_mut().push("ls".into());
            admin::decode("ls", &json!({"sets": []})).unwrap()
        }
        fn stats(&self) -> StatsAnswer {
            self.asked.borrow_mut().push("stats".into());
            admin::decode(
                "stats",
                &json!({"pid": 1, "service_uid": 5, "default_quota": null, "uids": [],
                        "sets": 0, "total_bytes": 0, "loads_in_progress": 0, "leases": 0,
                        "device_free": null, "device_total": null, "stopping": false}),
            )
            .unwrap()
        }
        fn drop_set(&self, uid: u32, r: &DropRequest) -> Result<DropAnswer, CallError> {
            self.asked
                .borrow_mut()
                .push(format!("drop {uid} {} {}", r.set, r.force));
            admin::decode(
                "drop",
                &json!({"set": r.set, "bytes": 7, "held_by": [Holder { pid: 1, uid: 2 }]}),
            )
            .map_err(bad_request)
        }
        fn service_uid(&self) -> u32 {
            5
        }
        fn ask_stop(&self) {
            self.asked.borrow_mut().push("stop".into());
        }
        fn open_write(
            &self,
            c: WriterId,
            r: &OpenWriteRequest,
        ) -> Result<OpenWriteAnswer, CallError> {
            self.asked.borrow_mut().push(format!(
                "open_write {} {} {} {} {}",
                c.pid,
                c.uid,
                c.connection,
                r.set,
                r.layout.as_ref().map_or(0, Vec::len)
            ));
            admin::decode(
                "open_write",
                &json!({"set": r.set, "version": 2, "staging": ".cuda-ipc/unlisted/stage/x",
                        "tensors": 1, "payload_bytes": 4, "bytes": 256,
                        "layout_hash": "00", "creates": false}),
            )
            .map_err(bad_request)
        }
        fn commit(&self, c: WriterId, r: &CommitRequest) -> Result<CommitAnswer, CallError> {
            self.asked.borrow_mut().push(format!(
                "commit {} {} {}",
                c.connection, r.set, r.layout_hash
            ));
            Err(CallError::new("layout_mismatch", "no"))
        }
        fn abort(&self, c: WriterId, r: &AbortRequest) -> Result<AbortAnswer, CallError> {
            self.asked
                .borrow_mut()
                .push(format!("abort {} {}", c.connection, r.set));
            Ok(AbortAnswer {
                set: r.set.clone(),
                version: 2,
            })
        }
        fn aside(&self, c: WriterId, r: &AsideRequest) -> Result<AsideAnswer, CallError> {
            self.asked
                .borrow_mut()
                .push(format!("aside {} {}", c.connection, r.set));
            admin::decode(
                "aside",
                &json!({"set": r.set, "version": 3, "writing_in_place": true}),
            )
            .map_err(bad_request)
        }
        fn back(&self, c: WriterId, r: &BackRequest) -> Result<BackAnswer, CallError> {
            self.asked.borrow_mut().push(format!(
                "back {} {} {:?}",
                c.connection, r.set, r.timeout_ms
            ));
            Err(CallError::new("torn", "cut short"))
        }
        fn reconnected(&self, c: WriterId, pending: &[String]) -> ReconnectedAnswer {
            self.asked
                .borrow_mut()
                .push(format!("reconnected {} {}", c.pid, pending.join(",")));
            ReconnectedAnswer {
                not_reconnected: pending.len(),
            }
        }
    }

    fn caller(uid: u32) -> WriterId {
        WriterId {
            pid: 77,
            uid,
            connection: 3,
        }
    }

    #[test]
    fn write_calls_are_decoded_strictly_and_routed_with_the_callers_connection() {
        let f = Fake::default();
        let a = dispatch(&f, caller(9), "open_write", &json!({"set": "m"})).unwrap();
        assert_eq!(a["version"], 2);
        let layout = json!([{"name": "w", "dtype": "bf16", "shape": [2, 3]}]);
        dispatch(
            &f,
            caller(9),
            "open_write",
            &json!({"set": "n", "layout": layout}),
        )
        .unwrap();
        let e = dispatch(
            &f,
            caller(9),
            "commit",
            &json!({"set": "m", "layout_hash": "00000000000000ab"}),
        )
        .unwrap_err();
        assert_eq!(e.code, "layout_mismatch");
        let a = dispatch(&f, caller(9), "abort", &json!({"set": "m"})).unwrap();
        assert_eq!(a, json!({"set": "m", "version": 2}));
        assert_eq!(
            *f.asked.borrow(),
            [
                "open_write 77 9 3 m 0",
                "open_write 77 9 3 n 1",
                "commit 3 m 00000000000000ab",
                "abort 3 m"
            ]
        );
        for (method, body) in [
            ("open_write", json!({})),
            ("open_write", json!({"set": "m", "layout": {}})),
            (
                "open_write",
                json!({"set": "m", "layout": [{"name": "w", "dtype": "f32"}]}),
            ),
            (
                "open_write",
                json!({"set": "m", "layout": [{"name": "w", "dtype": "f32", "shape": [1], "x": 1}]}),
            ),
            ("open_write", json!({"set": ".cuda-ipc/unlisted/stage/x"})),
            ("open_write", json!({"set": ""})),
            ("commit", json!({"set": "m"})),
            ("commit", json!({"set": "m", "layout_hash": 5})),
            ("abort", json!({"set": "m", "force": true})),
            ("abort", json!("m")),
            ("open_write", json!({"set": "m", "in_place": "yes"})),
            (
                "open_write",
                json!({"set": "m", "in_place": true, "wait_ms": -1}),
            ),
            ("aside", json!({"set": ""})),
            ("aside", json!({"set": "m", "version": 1})),
            ("back", json!({"set": "m", "timeout_ms": "1s"})),
            ("ready", json!({"set": "m"})),
            ("ready", json!(null)),
        ] {
            let e = dispatch(&f, caller(9), method, &body).unwrap_err();
            assert_eq!(e.code, "bad_request", "{method} {body}: {}", e.message);
        }
        assert_eq!(f.asked.borrow().len(), 4);
    }

    #[test]
    fn ready_answers_with_the_sets_served() {
        let f = Fake::default();
        let a = dispatch(&f, caller(9), "ready", &json!({})).unwrap();
        assert_eq!(a, json!({"sets": 0}));
        assert_eq!(*f.asked.borrow(), ["ls"]);
    }

    #[test]
    fn in_place_calls_are_routed_with_the_callers_connection() {
        let f = Fake::default();
        let body = json!({"set": "m", "in_place": true, "wait_ms": 500});
        dispatch(&f, caller(9), "open_write", &body).unwrap();
        let a = dispatch(&f, caller(9), "aside", &json!({"set": "m"})).unwrap();
        assert_eq!(
            a,
            json!({"set": "m", "version": 3, "writing_in_place": true})
        );
        let e = dispatch(&f, caller(9), "back", &json!({"set": "m", "timeout_ms": 5})).unwrap_err();
        assert_eq!(e.code, "torn");
        dispatch(&f, caller(9), "back", &json!({"set": "m"})).unwrap_err();
        assert_eq!(
            *f.asked.borrow(),
            [
                "open_write 77 9 3 m 0",
                "aside 3 m",
                "back 3 m Some(5)",
                "back 3 m None"
            ]
        );
    }

    #[test]
    fn calls_are_decoded_strictly_and_routed_with_the_callers_uid() {
        let f = Fake::default();
        assert_eq!(
            dispatch(&f, caller(9), "ls", &json!({})).unwrap(),
            json!({"sets": []})
        );
        assert_eq!(
            dispatch(&f, caller(9), "stats", &json!({})).unwrap()["service_uid"],
            5
        );
        let e = dispatch(&f, caller(9), "load", &json!({"set": "m", "path": "/m"})).unwrap_err();
        assert_eq!(e.code, "over_quota");
        let a = dispatch(&f, caller(9), "drop", &json!({"set": "m", "force": true})).unwrap();
        assert_eq!(a["bytes"], 7);
        assert_eq!(
            *f.asked.borrow(),
            ["ls", "stats", "load 9 m", "drop 9 m true"]
        );

        // Malformed bodies never reach the operations.
        for (method, body) in [
            ("ls", json!(null)),
            ("ls", json!({"x": 1})),
            ("load", json!({"set": "m"})),
            ("drop", json!({"set": "m", "force": "yes"})),
            ("shutdown", json!([])),
        ] {
            let e = dispatch(&f, caller(9), method, &body).unwrap_err();
            assert_eq!(e.code, "bad_request", "{method} {body}: {}", e.message);
            assert!(e.message.contains(method), "{}", e.message);
        }
        assert_eq!(f.asked.borrow().len(), 4);

        let e = dispatch(&f, caller(9), "sleep", &json!({})).unwrap_err();
        assert_eq!(e.code, "unknown_method");
        assert!(
            e.message.contains("load, ls, stats, drop, shutdown"),
            "{}",
            e.message
        );
    }

    #[test]
    fn only_the_service_uid_may_stop_it() {
        let f = Fake::default();
        let e = dispatch(&f, caller(9), "shutdown", &json!({})).unwrap_err();
        assert_eq!(e.code, "not_allowed");
        assert!(f.asked.borrow().is_empty());
        let a = dispatch(&f, caller(5), "shutdown", &json!({})).unwrap();
        assert_eq!(a, json!({"stopping": true}));
        assert_eq!(*f.asked.borrow(), ["stop"]);
    }
}
