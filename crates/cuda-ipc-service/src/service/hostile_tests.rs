//! Hostile peers of the service's methods, without a GPU: malformed
//! bodies of every method, commits and aborts from connections that hold
//! no session, floods of opens and aborts and of concurrent calls, and
//! bodies at the size limit, each refused with its code while the
//! connection (and every other) goes on.
//!
//! The calls travel over a real channel server configured as the service
//! configures its own (`MAX_CALL_BYTES`), through the service's
//! [`dispatch`](super::dispatch::dispatch) and close hook, to stand-in
//! operations ([`Books`]) kept in a real [`Catalog`]: everything but the
//! device memory (which `tests/gpu/service_write.rs` covers on a GPU).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::channel::{
    CallError, CallHandler, ChannelError, Client, ClientConfig, MAX_PAYLOAD, Message, Server,
    ServerConfig, UNLISTED_ENTRY_PREFIX,
};

use super::admin::{
    AbortAnswer, AbortRequest, CommitAnswer, CommitRequest, DropAnswer, DropRequest, LoadAnswer,
    LoadRequest, LsAnswer, OpenWriteAnswer, OpenWriteRequest, SetRow, SetState, StatsAnswer,
};
use super::catalog::{
    Catalog, MAX_WRITES_PER_CONNECTION, MAX_WRITES_PER_UID, Quotas, Staged, WriterId,
};
use super::dispatch::{self, MAX_ERROR_MESSAGE_BYTES, Ops, bad_request};
use super::layout::{self, Tensor};
use super::{MAX_CALL_BYTES, locked, refused};

/// The service's operations on its books alone: a real catalog, layouts
/// and staging hashes, no device memory.
struct Books {
    catalog: Mutex<Catalog>,
    /// Committed layouts, by set.
    layouts: Mutex<HashMap<String, Vec<Tensor>>>,
    /// Open sessions' layouts and hashes, by set.
    staging: Mutex<HashMap<String, (Vec<Tensor>, String)>>,
    next: AtomicU64,
    stop: AtomicBool,
    readers: Mutex<super::readers::Readers>,
}

impl Books {
    fn new() -> Books {
        Books {
            catalog: Mutex::new(Catalog::new(
                rustix::process::geteuid().as_raw(),
                Quotas::unlimited(),
            )),
            layouts: Mutex::new(HashMap::new()),
            staging: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
            stop: AtomicBool::new(false),
            readers: Mutex::new(super::readers::Readers::new()),
        }
    }

    fn closed(&self, connection: u64) {
        for s in locked(&self.catalog).writer_gone(connection) {
            locked(&self.staging).remove(&s.set);
        }
    }

    fn sessions(&self) -> usize {
        locked(&self.catalog).write_sessions().count()
    }
}

impl Ops for Books {
    fn load(&self, _uid: u32, r: &LoadRequest) -> Result<LoadAnswer, CallError> {
        Err(CallError::new(
            "checkpoint",
            format!("no checkpoint at {} in this test", r.path),
        ))
    }

    fn ls(&self) -> LsAnswer {
        let catalog = locked(&self.catalog);
        let sets = catalog
            .sets()
            .map(|s| SetRow {
                name: s.name.clone(),
                bytes: s.bytes,
                payload_bytes: s.payload_bytes,
                tensors: s.tensors,
                version: s.version,
                owner_uid: s.owner_uid,
                loaded_from: s.loaded_from.clone(),
                created_unix: s.created_unix,
                leases: Vec::new(),
                state: if catalog.writing(&s.name).is_some() {
                    SetState::Writing
                } else {
                    SetState::Committed
                },
                writer: None,
                restarts: 0,
                not_reconnected: Vec::new(),
            })
            .collect();
        LsAnswer { sets }
    }

    fn stats(&self) -> StatsAnswer {
        let catalog = locked(&self.catalog);
        StatsAnswer {
            pid: std::process::id(),
            service_uid: catalog.service_uid(),
            default_quota: None,
            uids: catalog.usage(),
            sets: catalog.sets().count(),
            total_bytes: catalog.total_bytes(),
            loads_in_progress: 0,
            leases: 0,
            device_free: None,
            device_total: None,
            stopping: catalog.is_stopping(),
        }
    }

    fn drop_set(&self, caller: u32, r: &DropRequest) -> Result<DropAnswer, CallError> {
        let mut catalog = locked(&self.catalog);
        catalog
            .check_drop(caller, &r.set, &[], r.force)
            .map_err(|e| refused(&e))?;
        catalog.abort_any(&r.set);
        let info = catalog.remove(&r.set);
        locked(&self.layouts).remove(&r.set);
        locked(&self.staging).remove(&r.set);
        Ok(DropAnswer {
            set: r.set.clone(),
            bytes: info.map_or(0, |i| i.bytes),
            held_by: Vec::new(),
        })
    }

    fn service_uid(&self) -> u32 {
        locked(&self.catalog).service_uid()
    }

    fn ask_stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }

    fn open_write(
        &self,
        caller: WriterId,
        r: &OpenWriteRequest,
    ) -> Result<OpenWriteAnswer, CallError> {
        let tensors = if let Some(specs) = &r.layout {
            layout::check(specs).map_err(bad_request)?
        } else {
            let Some(t) = locked(&self.layouts).get(&r.set).cloned() else {
                return Err(refused(&locked(&self.catalog).no_layout(&r.set)));
            };
            t
        };
        let staged = Staged {
            bytes: layout::device_bytes(&tensors),
            payload_bytes: tensors.iter().map(|t| t.bytes).sum(),
            tensors: tensors.len(),
        };
        let n = self.next.fetch_add(1, Ordering::SeqCst);
        let entry = format!("{UNLISTED_ENTRY_PREFIX}stage/{n:032x}");
        let version = locked(&self.catalog)
            .open_write(caller, &r.set, entry.clone(), staged, r.layout.is_some())
            .map_err(|e| refused(&e))?
            .version;
        let hash = format!("{n:016x}");
        locked(&self.staging).insert(r.set.clone(), (tensors, hash.clone()));
        Ok(OpenWriteAnswer {
            set: r.set.clone(),
            version,
            staging: entry,
            tensors: staged.tensors,
            payload_bytes: staged.payload_bytes,
            bytes: staged.bytes,
            layout_hash: hash,
            creates: r.layout.is_some(),
            in_place: false,
        })
    }

    fn commit(&self, caller: WriterId, r: &CommitRequest) -> Result<CommitAnswer, CallError> {
        let mut catalog = locked(&self.catalog);
        catalog
            .check_writer(&r.set, caller.connection)
            .map_err(|e| refused(&e))?;
        let mut staging = locked(&self.staging);
        let Some((tensors, hash)) = staging.get(&r.set).cloned() else {
            return Err(CallError::new("not_writing", "no staging version"));
        };
        if hash != r.layout_hash {
            return Err(CallError::new(
                "layout_mismatch",
                format!(
                    "the commit names {} but the staging version has {hash}",
                    r.layout_hash
                ),
            ));
        }
        let done = catalog
            .commit_write(caller.connection, &r.set)
            .map_err(|e| refused(&e))?;
        staging.remove(&r.set);
        locked(&self.layouts).insert(r.set.clone(), tensors);
        Ok(CommitAnswer {
            set: r.set.clone(),
            version: done.info.version,
            retired_version: done.retired.map(|o| o.version),
            readers_told: 0,
        })
    }

    fn abort(&self, caller: WriterId, r: &AbortRequest) -> Result<AbortAnswer, CallError> {
        let s = locked(&self.catalog)
            .abort_write(caller.connection, &r.set)
            .map_err(|e| refused(&e))?;
        locked(&self.staging).remove(&r.set);
        Ok(AbortAnswer {
            set: r.set.clone(),
            version: s.version,
        })
    }

    fn aside(
        &self,
        _caller: WriterId,
        r: &super::admin::AsideRequest,
    ) -> Result<super::admin::AsideAnswer, CallError> {
        let version = self.version_of(&r.set)?;
        super::admin::decode(
            "aside",
            &json!({"set": r.set, "version": version, "writing_in_place": false}),
        )
        .map_err(bad_request)
    }

    fn back(
        &self,
        _caller: WriterId,
        r: &super::admin::BackRequest,
    ) -> Result<super::admin::BackAnswer, CallError> {
        let version = self.version_of(&r.set)?;
        super::admin::decode("back", &json!({"set": r.set, "version": version}))
            .map_err(bad_request)
    }

    fn reconnected(&self, caller: WriterId, pending: &[String]) -> super::admin::ReconnectedAnswer {
        let mut readers = locked(&self.readers);
        readers.reconnected(caller.pid, caller.uid, pending);
        super::admin::decode(
            "reconnected",
            &json!({"not_reconnected": readers.orphans().len()}),
        )
        .expect("an answer")
    }
}

impl Books {
    fn version_of(&self, set: &str) -> Result<u64, CallError> {
        locked(&self.catalog)
            .get(set)
            .map(|i| i.version)
            .ok_or_else(|| refused(&super::CatalogError::NotFound { name: set.into() }))
    }
}

/// A channel server configured as the service's, answering through
/// `dispatch` into `books`.
fn serve(books: &Arc<Books>) -> (tempfile::TempDir, Server) {
    let dir = tempfile::tempdir().unwrap();
    let mut config =
        ServerConfig::new(dir.path().join("svc.sock")).with_max_request_bytes(MAX_CALL_BYTES);
    let calls = Arc::clone(books);
    let closes = Arc::clone(books);
    config.call_handler = Some(
        CallHandler::new(move |ctx, method, body| {
            let caller = WriterId {
                pid: ctx.peer.pid,
                uid: ctx.peer.uid,
                connection: ctx.connection,
            };
            dispatch::dispatch(&*calls, caller, method, body)
        })
        .on_close(move |connection| closes.closed(connection)),
    );
    (dir, Server::bind(config).unwrap())
}

fn client(server: &Server) -> Client {
    Client::connect(
        server.path(),
        ClientConfig::default().with_timeout(Duration::from_secs(20)),
    )
    .unwrap()
}

/// The refusal's code and message.
fn refusal(r: Result<Value, ChannelError>) -> (String, String) {
    match r {
        Err(ChannelError::Remote { code, message }) => (code, message),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// Polls `f` until it holds (a connection's end reaches the server's
/// close hook on its reader thread).
fn eventually(what: &str, f: impl Fn() -> bool) {
    let end = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < end, "{what} did not happen within 10 s");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn layout_of(n: usize) -> Value {
    Value::Array(
        (0..n)
            .map(|i| json!({"name": format!("t{i}"), "dtype": "f32", "shape": [4, 4]}))
            .collect(),
    )
}

/// The malformed bodies of every method: wrong types, unknown or missing
/// fields, bad names, paths, sizes and layouts.
fn malformed() -> Vec<(&'static str, Value)> {
    let long = "n".repeat(300);
    let mut cases = vec![
        ("load", json!(null)),
        ("load", json!([])),
        ("load", json!({})),
        ("load", json!({"set": 5, "path": "/x"})),
        ("load", json!({"set": "m", "path": "relative/x"})),
        (
            "load",
            json!({"set": "m", "path": format!("/{}", "a".repeat(3000))}),
        ),
        ("load", json!({"set": "m", "path": "/x", "streams": -1})),
        ("load", json!({"set": "m", "path": "/x", "streams": 1.5})),
        ("load", json!({"set": "m", "path": "/x", "streams": "8"})),
        ("load", json!({"set": "m", "path": "/x", "staging": -4096})),
        ("load", json!({"set": "m", "path": "/x", "staging": 1e300})),
        ("load", json!({"set": "m", "path": "/x", "extra": 1})),
        ("load", json!({"set": "", "path": "/x"})),
        ("load", json!({"set": "a\u{0}b", "path": "/x"})),
        ("load", json!({"set": long, "path": "/x"})),
        ("load", json!({"set": ".cuda-ipc/arena", "path": "/x"})),
        ("ls", json!(null)),
        ("ls", json!("ls")),
        ("ls", json!({"all": true})),
        ("stats", json!(7)),
        ("stats", json!({"pid": 1})),
        ("drop", json!({})),
        ("drop", json!({"set": "m", "force": "yes"})),
        ("drop", json!({"set": "m", "force": 1})),
        ("drop", json!({"set": "m", "x": true})),
        ("drop", json!({"set": ""})),
        ("drop", json!({"set": long})),
        ("drop", json!({"set": "tab\there"})),
        (
            "drop",
            json!({"set": format!("{UNLISTED_ENTRY_PREFIX}stage/00")}),
        ),
        ("shutdown", json!([])),
        ("shutdown", json!({"now": true})),
        ("ready", json!({"wait": true})),
        ("ready", json!([])),
        ("open_write", json!({})),
        ("open_write", json!({"set": 1})),
        ("open_write", json!({"set": "m", "layout": {}})),
        ("open_write", json!({"set": "m", "layout": []})),
        ("open_write", json!({"set": "m", "layout": null, "x": 0})),
        (
            "open_write",
            json!({"set": format!("{UNLISTED_ENTRY_PREFIX}stage/1")}),
        ),
        ("open_write", json!({"set": long})),
        ("abort", json!("m")),
        ("abort", json!({"set": null})),
        ("abort", json!({"set": "m", "force": true})),
        ("abort", json!({"set": ""})),
        ("commit", json!({"set": "m"})),
        ("commit", json!({"set": "m", "layout_hash": 5})),
        ("commit", json!({"set": "m", "layout_hash": "zz"})),
        ("commit", json!({"set": "m", "layout_hash": "0".repeat(17)})),
        ("commit", json!({"set": "m", "layout_hash": "g".repeat(16)})),
        (
            "commit",
            json!({"set": "m", "layout_hash": "0".repeat(100_000)}),
        ),
        (
            "commit",
            json!({"set": "m", "layout_hash": "0".repeat(16), "x": 1}),
        ),
    ];
    for spec in [
        json!({"name": "w", "dtype": "f32", "shape": [-1]}),
        json!({"name": "w", "dtype": "f32", "shape": [1.5]}),
        json!({"name": "w", "dtype": "f32", "shape": [0]}),
        json!({"name": "w", "dtype": "f32", "shape": vec![1; 33]}),
        json!({"name": "w", "dtype": "f32", "shape": [u64::MAX, 2]}),
        json!({"name": "w", "dtype": "f33", "shape": [1]}),
        json!({"name": "w", "dtype": 4, "shape": [1]}),
        json!({"name": "", "dtype": "f32", "shape": [1]}),
        json!({"name": "a\nb", "dtype": "f32", "shape": [1]}),
        json!({"name": "n".repeat(257), "dtype": "f32", "shape": [1]}),
        json!({"name": "w", "dtype": "f32", "shape": [1], "offset": 0}),
        json!({"name": "w", "dtype": "f32"}),
        json!(["w", "f32", [1]]),
    ] {
        cases.push(("open_write", json!({"set": "m", "layout": [spec]})));
    }
    let twice = json!({"name": "w", "dtype": "f32", "shape": [1]});
    cases.push(("open_write", json!({"set": "m", "layout": [twice, twice]})));
    cases
}

#[test]
fn every_method_refuses_malformed_bodies_before_any_operation() {
    let books = Arc::new(Books::new());
    let (_dir, server) = serve(&books);
    let c = client(&server);
    for (method, body) in malformed() {
        let (code, message) = refusal(c.call(method, &body));
        assert_eq!(code, "bad_request", "{method} {body:.200}: {message:.300}");
        assert!(message.len() <= MAX_ERROR_MESSAGE_BYTES + 64, "{method}");
    }
    // Nothing reached the books, and the connection goes on.
    assert_eq!(books.sessions(), 0);
    assert!(!books.stop.load(Ordering::SeqCst));
    assert_eq!(c.call("ls", &json!({})).unwrap(), json!({"sets": []}));
    // A layout of more tensors than a set holds (too long for a call
    // body, so straight to the dispatch), and unknown methods.
    let me = WriterId {
        pid: 1,
        uid: 2,
        connection: 3,
    };
    let many = json!({"set": "m", "layout": layout_of(crate::set::MAX_SET_ENTRIES + 1)});
    let e = dispatch::dispatch(&*books, me, "open_write", &many).unwrap_err();
    assert_eq!(e.code, "bad_request");
    assert!(e.message.contains("more than"), "{}", e.message);
    let (code, _) = refusal(c.call("open_writes", &json!({})));
    assert_eq!(code, "unknown_method");
    // A method the channel refuses by its name is not even sent (the
    // server's own refusal, `invalid_method`, is the channel's test).
    assert!(matches!(
        c.call("Load", &json!({})),
        Err(ChannelError::InvalidArgument { .. })
    ));
    // NaN is not JSON: no peer can send it, and no body holds it.
    assert!(Message::decode(br#"{"type":"call","id":1,"method":"load","body":NaN}"#).is_err());
    assert_eq!(json!(f64::NAN), Value::Null);
    c.ping().unwrap();
}

#[test]
fn commits_and_aborts_belong_to_the_connection_that_opened_the_write() {
    let books = Arc::new(Books::new());
    let (_dir, server) = serve(&books);
    let (a, b) = (client(&server), client(&server));
    let opened = a
        .call("open_write", &json!({"set": "m", "layout": layout_of(2)}))
        .unwrap();
    let hash = opened["layout_hash"].as_str().unwrap().to_owned();
    let pid = std::process::id();
    // Another connection (same process, same uid) can neither commit nor
    // abort it, nor open the set, even with the right hash.
    for (method, body) in [
        ("commit", json!({"set": "m", "layout_hash": hash})),
        ("abort", json!({"set": "m"})),
    ] {
        let (code, message) = refusal(b.call(method, &body));
        assert_eq!(code, "not_writing", "{method}: {message}");
        assert!(message.contains(&format!("pid {pid}")), "{message}");
    }
    let (code, _) = refusal(b.call("open_write", &json!({"set": "m", "layout": layout_of(2)})));
    assert_eq!(code, "writing");
    let (code, _) = refusal(b.call("drop", &json!({"set": "m"})));
    assert_eq!(
        code, "not_found",
        "a set being created is not yet droppable"
    );
    // A wrong hash keeps the session; the right one commits.
    let (code, _) = refusal(a.call(
        "commit",
        &json!({"set": "m", "layout_hash": "0".repeat(16)}),
    ));
    assert_eq!(code, "layout_mismatch");
    let done = a
        .call("commit", &json!({"set": "m", "layout_hash": hash}))
        .unwrap();
    assert_eq!(done["version"], 1);
    // Nothing to commit or abort any more, from either connection.
    for c in [&a, &b] {
        let (code, message) = refusal(c.call("abort", &json!({"set": "m"})));
        assert_eq!(code, "not_writing");
        assert!(!message.contains("held by"), "{message}");
    }
    // A session whose connection closes ends; another connection opens.
    a.call("open_write", &json!({"set": "m"})).unwrap();
    let (code, _) = refusal(b.call("open_write", &json!({"set": "m"})));
    assert_eq!(code, "writing");
    drop(a);
    eventually("the closed writer's session ending", || {
        books.sessions() == 0
    });
    let again = b.call("open_write", &json!({"set": "m"})).unwrap();
    assert_eq!(
        again["version"], 2,
        "an aborted version's number is not reused"
    );
    b.call("abort", &json!({"set": "m"})).unwrap();
}

#[test]
fn floods_of_opens_aborts_and_concurrent_calls_leave_nothing_behind() {
    let books = Arc::new(Books::new());
    let (_dir, server) = serve(&books);
    let c = client(&server);
    let opened = c
        .call("open_write", &json!({"set": "m", "layout": layout_of(3)}))
        .unwrap();
    c.call(
        "commit",
        &json!({"set": "m", "layout_hash": opened["layout_hash"]}),
    )
    .unwrap();
    for _ in 0..2000 {
        c.call("open_write", &json!({"set": "m"})).unwrap();
        c.call("abort", &json!({"set": "m"})).unwrap();
    }
    assert_eq!(books.sessions(), 0);
    let usage = c.call("stats", &json!({})).unwrap();
    assert_eq!(
        usage["total_bytes"],
        3 * 256,
        "aborted versions left bytes: {usage}"
    );

    // One connection holds at most MAX_WRITES_PER_CONNECTION sessions.
    for i in 0..MAX_WRITES_PER_CONNECTION {
        c.call(
            "open_write",
            &json!({"set": format!("n{i}"), "layout": layout_of(1)}),
        )
        .unwrap();
    }
    let (code, message) = refusal(c.call(
        "open_write",
        &json!({"set": "n-more", "layout": layout_of(1)}),
    ));
    assert_eq!(code, "too_many_writes", "{message}");
    assert!(message.contains("this connection"), "{message}");
    // One uid holds at most MAX_WRITES_PER_UID, over its connections.
    let others: Vec<Client> = (0..MAX_WRITES_PER_UID / MAX_WRITES_PER_CONNECTION)
        .map(|_| client(&server))
        .collect();
    let mut refused_uid = None;
    'outer: for (k, o) in others.iter().enumerate() {
        for i in 0..MAX_WRITES_PER_CONNECTION {
            let body = json!({"set": format!("o{k}-{i}"), "layout": layout_of(1)});
            if let Err(e) = o.call("open_write", &body) {
                refused_uid = Some(refusal(Err(e)));
                break 'outer;
            }
        }
    }
    let (code, message) = refused_uid.expect("the uid's limit was never reached");
    assert_eq!(code, "too_many_writes");
    assert!(
        message.contains(&format!("holds {MAX_WRITES_PER_UID}")),
        "{message}"
    );
    assert_eq!(books.sessions(), MAX_WRITES_PER_UID);
    // Closing the connections ends every session they held.
    drop(others);
    drop(c);
    eventually("every session ending with its connection", || {
        books.sessions() == 0
    });

    // Many connections calling at once: every call answered, no panic.
    let threads: Vec<_> = (0..12)
        .map(|t| {
            let path = server.path().to_path_buf();
            std::thread::spawn(move || {
                let c = Client::connect(
                    &path,
                    ClientConfig::default().with_timeout(Duration::from_secs(20)),
                )
                .unwrap();
                let set = format!("c{t}");
                for i in 0..100 {
                    let body = json!({"set": set, "layout": layout_of(1 + i % 3)});
                    let a = c.call("open_write", &body).unwrap();
                    if i % 2 == 0 {
                        c.call("abort", &json!({"set": set})).unwrap();
                    } else {
                        let h = &a["layout_hash"];
                        c.call("commit", &json!({"set": set, "layout_hash": h}))
                            .unwrap();
                        c.call("drop", &json!({"set": set})).unwrap();
                    }
                    for m in ["ls", "stats"] {
                        c.call(m, &json!({})).unwrap();
                    }
                    let (code, _) = refusal(c.call(
                        "commit",
                        &json!({"set": "m", "layout_hash": "0".repeat(16)}),
                    ));
                    assert_eq!(code, "not_writing");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a calling thread failed");
    }
    eventually("the callers' connections closing", || books.sessions() == 0);
    let c = client(&server);
    let ls = c.call("ls", &json!({})).unwrap();
    assert_eq!(ls["sets"].as_array().unwrap().len(), 1, "{ls}");
}

/// A body whose call message is `at` bytes on the wire: an `open_write`
/// whose set name is padded.
fn call_of_size(id: u64, at: usize) -> Value {
    let body = |pad: usize| json!({"set": "x".repeat(pad)});
    let size = |pad: usize| {
        Message::Call {
            id,
            method: "open_write".into(),
            body: body(pad),
        }
        .encode()
        .len()
    };
    let base = size(0);
    body(at - base)
}

#[test]
fn a_body_at_the_size_limit_is_refused_by_its_content_and_one_over_is_never_sent() {
    let books = Arc::new(Books::new());
    let (_dir, server) = serve(&books);
    let c = client(&server);
    let limit = MAX_PAYLOAD as usize;
    // The client numbers its requests; an id of as many digits gives the
    // same length, within a few bytes of the limit.
    let at_limit = call_of_size(1_000_000, limit - 16);
    let (code, message) = refusal(c.call("open_write", &at_limit));
    // A name of a mebibyte is refused as a name, quoted only in part (not
    // `reply_too_large`: the refusal is bounded).
    assert_eq!(code, "bad_request", "{message:.300}");
    assert!(message.contains("set name"), "{message:.300}");
    assert!(message.len() <= MAX_ERROR_MESSAGE_BYTES + 64);
    // A commit's hash and an unknown field of that size, likewise.
    let hash = json!({"set": "m", "layout_hash": "0".repeat(limit - 200)});
    let (code, _) = refusal(c.call("commit", &hash));
    assert_eq!(code, "bad_request");
    let mut field = serde_json::Map::new();
    field.insert("k".repeat(limit - 200), json!(1));
    let (code, message) = refusal(c.call("ls", &Value::Object(field)));
    assert_eq!(code, "bad_request");
    assert!(message.len() <= MAX_ERROR_MESSAGE_BYTES + 64);
    // Over the limit: the client does not send it, and the connection goes on.
    let over = call_of_size(1_000_000, limit + 16);
    match c.call("open_write", &over) {
        Err(ChannelError::Remote { code, .. }) => panic!("sent and answered {code}"),
        Err(_) => {}
        Ok(v) => panic!("answered {v:.100}"),
    }
    assert_eq!(c.call("ls", &json!({})).unwrap(), json!({"sets": []}));
    assert_eq!(books.sessions(), 0);
}
