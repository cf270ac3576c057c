//! Calls over a real socket: answers, errors, no handler, a panicking
//! handler, method names, a handler set after binding.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use proptest::prelude::*;
use serde_json::{Value, json};

use super::{CallError, CallHandler, MAX_METHOD_LEN, validate_method};
use crate::{ChannelError, Client, ClientConfig, Server, ServerConfig, own_uid};

fn pair(handler: Option<CallHandler>) -> (tempfile::TempDir, Server, Client) {
    let dir = tempfile::tempdir().unwrap();
    let mut config = ServerConfig::new(dir.path().join("s.sock"));
    config.call_handler = handler;
    let server = Server::bind(config).unwrap();
    let client = Client::connect(
        server.path(),
        ClientConfig::default().with_timeout(Duration::from_secs(5)),
    )
    .unwrap();
    (dir, server, client)
}

fn remote(e: ChannelError) -> (String, String) {
    match e {
        ChannelError::Remote { code, message } => (code, message),
        other => panic!("expected a remote error, got {other:?}"),
    }
}

#[test]
fn a_call_is_answered_by_the_handler_with_the_callers_credentials() {
    let handler = CallHandler::new(|ctx, method, body| match method {
        "echo" => Ok(json!({"body": body, "uid": ctx.peer.uid, "pid": ctx.peer.pid})),
        "refuse" => Err(CallError::new("quota", "over quota").with_details(json!({"used": 1}))),
        other => Err(CallError::new(
            "unknown_method",
            format!("no method {other}"),
        )),
    });
    let (_dir, _server, client) = pair(Some(handler));
    let answer = client.call("echo", &json!({"a": [1, 2]})).unwrap();
    assert_eq!(answer["body"], json!({"a": [1, 2]}));
    assert_eq!(answer["uid"], json!(own_uid()));
    assert_eq!(answer["pid"], json!(std::process::id()));

    let (code, message) = remote(client.call("refuse", &Value::Null).unwrap_err());
    assert_eq!((code.as_str(), message.as_str()), ("quota", "over quota"));
    let (code, _) = remote(client.call("nope", &Value::Null).unwrap_err());
    assert_eq!(code, "unknown_method");
    // The connection goes on after errors.
    assert!(client.call("echo", &json!(1)).is_ok());
    client.ping().unwrap();
}

#[test]
fn a_server_without_a_handler_says_so_and_keeps_the_connection() {
    let (_dir, server, client) = pair(None);
    let (code, message) = remote(client.call("ls", &json!({})).unwrap_err());
    assert_eq!(code, "no_handler");
    assert!(message.contains("cuda-ipc serve --service"), "{message}");
    client.ping().unwrap();

    // A handler set later answers (and can be removed again).
    server.set_call_handler(Some(CallHandler::new(|_, _, _| Ok(json!("late")))));
    assert_eq!(client.call("ls", &json!({})).unwrap(), json!("late"));
    server.set_call_handler(None);
    let (code, _) = remote(client.call("ls", &json!({})).unwrap_err());
    assert_eq!(code, "no_handler");
}

#[test]
fn a_panicking_handler_answers_internal_and_the_server_goes_on() {
    let calls = Arc::new(AtomicU64::new(0));
    let seen = Arc::clone(&calls);
    let handler = CallHandler::new(move |_, method, _| {
        seen.fetch_add(1, Ordering::SeqCst);
        assert!(method != "boom", "the handler's own bug");
        Ok(json!(true))
    });
    let (_dir, _server, client) = pair(Some(handler));
    let (code, message) = remote(client.call("boom", &Value::Null).unwrap_err());
    assert_eq!(code, "internal");
    assert!(message.contains("boom"), "{message}");
    assert_eq!(client.call("fine", &Value::Null).unwrap(), json!(true));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[test]
fn method_names_are_checked_on_both_sides() {
    let (_dir, _server, client) = pair(Some(CallHandler::new(|_, _, _| Ok(Value::Null))));
    for bad in ["", "LS", "a b", "ls/x", "é"] {
        let e = client.call(bad, &Value::Null).unwrap_err();
        assert!(
            matches!(e, ChannelError::InvalidArgument { .. }),
            "{bad:?}: {e:?}"
        );
    }
    let long = "a".repeat(MAX_METHOD_LEN + 1);
    assert!(client.call(&long, &Value::Null).is_err());
    assert!(
        client
            .call(&"a".repeat(MAX_METHOD_LEN), &Value::Null)
            .is_ok()
    );
    assert!(client.call("service.ls_2", &Value::Null).is_ok());
}

#[test]
fn a_slow_call_waits_as_long_as_the_caller_allows() {
    let handler = CallHandler::new(|_, _, _| {
        std::thread::sleep(Duration::from_millis(300));
        Ok(json!("done"))
    });
    let dir = tempfile::tempdir().unwrap();
    let server =
        Server::bind(ServerConfig::new(dir.path().join("s.sock")).with_call_handler(handler))
            .unwrap();
    let client = Client::connect(
        server.path(),
        ClientConfig::default().with_timeout(Duration::from_millis(50)),
    )
    .unwrap();
    let e = client.call("slow", &Value::Null).unwrap_err();
    assert!(matches!(e, ChannelError::Timeout { .. }), "{e:?}");
    // The late answer to the first call is dropped; the next one is waited for.
    assert_eq!(
        client
            .call_within("slow", &Value::Null, Duration::from_secs(5))
            .unwrap(),
        json!("done")
    );
}

#[test]
fn an_answer_too_long_for_the_wire_is_an_error_for_that_call() {
    let handler = CallHandler::new(|_, _, _| Ok(json!("x".repeat(2 << 20))));
    let (_dir, _server, client) = pair(Some(handler));
    let (code, _) = remote(client.call("big", &Value::Null).unwrap_err());
    assert_eq!(code, "reply_too_large");
    client.ping().unwrap();
}

proptest! {
    #[test]
    fn validate_method_accepts_exactly_the_documented_names(m in "[a-zA-Z0-9_. /-]{0,70}") {
        let ok = !m.is_empty()
            && m.len() <= MAX_METHOD_LEN
            && m.chars().all(|c| matches!(c, 'a'..='z' | '0'..='9' | '_' | '.'));
        prop_assert_eq!(validate_method(&m).is_ok(), ok);
    }
}

#[test]
fn a_call_longer_than_the_request_limit_ends_only_its_connection() {
    let (_dir, server, client) = pair(Some(CallHandler::new(|_, _, b| Ok(b.clone()))));
    let big = json!("a".repeat(5000)); // over the default 4 KiB request limit
    assert!(client.call("echo", &big).is_err());
    assert!(!client.is_alive() || client.ping().is_err());
    // Other clients are served as before.
    let other = Client::connect(server.path(), ClientConfig::default()).unwrap();
    assert_eq!(other.call("echo", &json!([1])).unwrap(), json!([1]));
}

#[test]
fn the_close_hook_hears_each_connection_that_ends_with_its_id() {
    let closed = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = Arc::new(AtomicU64::new(0));
    let (c, s) = (Arc::clone(&closed), Arc::clone(&seen));
    let handler = CallHandler::new(move |ctx, _, _| {
        s.store(ctx.connection, Ordering::SeqCst);
        Ok(json!(ctx.connection))
    })
    .on_close(move |conn| c.lock().unwrap().push(conn));
    let (_dir, server, client) = pair(Some(handler));
    let id = client.call("who", &json!({})).unwrap();
    assert_eq!(id, json!(seen.load(Ordering::SeqCst)));
    assert!(closed.lock().unwrap().is_empty());
    drop(client);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while closed.lock().unwrap().is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        closed
            .lock()
            .unwrap()
            .contains(&seen.load(Ordering::SeqCst)),
        "{:?}",
        closed.lock().unwrap()
    );
    assert_eq!(server.connection_count(), 0);
}

#[test]
fn the_lease_watch_hears_each_lease_granted_before_its_holder_and_each_that_ends() {
    type Seen = Vec<(bool, String, u64, u64, u32)>;
    let seen: Arc<std::sync::Mutex<Seen>> = Arc::default();
    let s = Arc::clone(&seen);
    let handler = CallHandler::new(|_, _, _| Ok(json!(null))).on_lease(move |e| {
        s.lock()
            .unwrap()
            .push((e.granted, e.name.to_owned(), e.lease, e.connection, e.uid));
    });
    let (_dir, server, client) = pair(Some(handler));
    server.publish("w", json!({}), Vec::new()).unwrap();
    server.publish("v", json!({}), Vec::new()).unwrap();
    let a = client.attach("w").unwrap();
    // Heard before the answer reached the client.
    let conn = {
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 1, "{seen:?}");
        let (granted, name, lease, conn, uid) = seen[0].clone();
        assert!(granted);
        assert_eq!((name.as_str(), lease, uid), ("w", a.lease, own_uid()));
        assert_eq!(server.leases()[0].connection, conn);
        conn
    };
    let b = client.attach("v").unwrap();
    client.release(a.lease).unwrap();
    assert_eq!(
        seen.lock().unwrap()[1..],
        [
            (true, "v".to_owned(), b.lease, conn, own_uid()),
            (false, "w".to_owned(), a.lease, conn, own_uid())
        ]
    );
    // The rest end with the connection.
    drop(client);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while seen.lock().unwrap().len() < 4 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        seen.lock().unwrap()[3..],
        [(false, "v".to_owned(), b.lease, conn, own_uid())]
    );
    // A handler set later brings its watch; one without takes it away.
    server.set_call_handler(Some(CallHandler::new(|_, _, _| Ok(json!(null)))));
    let c = Client::connect(server.path(), ClientConfig::default()).unwrap();
    c.attach("w").unwrap();
    assert_eq!(seen.lock().unwrap().len(), 4);
}

#[test]
fn a_replaced_entry_tells_its_holders_and_lives_until_they_release_it() {
    let (_dir, server, client) = pair(None);
    assert!(matches!(
        server.replace("w", json!({"v": 2}), Vec::new(), json!({})),
        Err(ChannelError::NotFound { .. })
    ));
    server.publish("w", json!({"v": 1}), Vec::new()).unwrap();
    let old = client.attach("w").unwrap();
    assert_eq!(old.meta, json!({"v": 1}));
    let r = server
        .replace("w", json!({"v": 2}), Vec::new(), json!({"seq": 7}))
        .unwrap();
    assert_eq!((r.version, r.told), (1, 1));
    let u = client.next_update(Duration::from_secs(5)).unwrap();
    assert_eq!(u.lease, old.lease);
    match u.notice {
        crate::Notice::Updated { version, data } => {
            assert_eq!((version, data), (1, json!({"seq": 7})));
        }
        other => panic!("expected an update, got {other:?}"),
    }
    // New attaches get the new entry; the old one lives while leased.
    let new = client.attach("w").unwrap();
    assert_eq!(new.meta, json!({"v": 2}));
    assert_eq!(server.entry_lease_count(r.old_entry), 1);
    assert_eq!(server.entry_lease_count(r.new_entry), 1);
    assert_eq!(server.lease_count("w"), 2);
    // The leases say which entry each holds: the same name, two entries.
    let by_entry: Vec<(u64, u64)> = server.leases().iter().map(|l| (l.lease, l.entry)).collect();
    assert_eq!(
        by_entry,
        [(old.lease, r.old_entry), (new.lease, r.new_entry)]
    );
    client.release(old.lease).unwrap();
    assert_eq!(server.entry_lease_count(r.old_entry), 0);
    assert_eq!(server.lease_count("w"), 1);
    // A replace with no holder drops the old entry at once.
    let r2 = server
        .replace("w", json!({"v": 3}), Vec::new(), json!({}))
        .unwrap();
    assert_eq!(r2.told, 1);
    client.release(new.lease).unwrap();
    let r3 = server
        .replace("w", json!({"v": 4}), Vec::new(), json!({}))
        .unwrap();
    assert_eq!(r3.told, 0);
    assert_eq!(client.attach("w").unwrap().meta, json!({"v": 4}));
    // Unlisted entries are attached by name only.
    let hidden = format!("{}stage/abc", crate::UNLISTED_ENTRY_PREFIX);
    server
        .publish(&hidden, json!({"s": 1}), Vec::new())
        .unwrap();
    let names: Vec<String> = client.list().unwrap().into_iter().map(|e| e.name).collect();
    assert_eq!(names, ["w"]);
    assert_eq!(client.attach(&hidden).unwrap().meta, json!({"s": 1}));
}

#[test]
fn a_held_server_accepts_nobody_until_it_starts_accepting() {
    let dir = tempfile::tempdir().unwrap();
    let server =
        Server::bind(ServerConfig::new(dir.path().join("s.sock")).with_accept_held(true)).unwrap();
    server.publish("w", json!({"v": 1}), Vec::new()).unwrap();
    // A client whose timeout runs out first: an error, not a hang.
    let short = Client::connect(
        server.path(),
        ClientConfig::default().with_timeout(Duration::from_millis(200)),
    );
    assert!(short.is_err(), "{short:?}");
    let path = server.path().to_path_buf();
    let waiting = std::thread::spawn(move || {
        let c = Client::connect(
            &path,
            ClientConfig::default().with_timeout(Duration::from_secs(10)),
        )?;
        c.attach("w").map(|a| a.meta)
    });
    std::thread::sleep(Duration::from_millis(300));
    assert!(!waiting.is_finished(), "served before start_accepting");
    assert_eq!(server.connection_count(), 0);
    server.start_accepting();
    assert_eq!(waiting.join().unwrap().unwrap(), json!({"v": 1}));
    // Again is nothing new; later clients are served at once.
    server.start_accepting();
    let c = Client::connect(server.path(), ClientConfig::default()).unwrap();
    assert!(c.ping().is_ok());
}
