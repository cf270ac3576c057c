//! `serve --service` and its clients `load`, `ls`, `stats`, `drop` without
//! a GPU: options refused (exit 2) before the driver or the socket; a
//! missing service says how to start one; and the clients against a
//! stand-in service (a channel server answering the admin methods with the
//! documented JSON), so that their requests, output and exit codes are
//! checked end to end.

mod common;

use std::sync::{Arc, Mutex};

use common::{assert_error, assert_no_panic, code, cuda_ipc, stderr};
use cuda_ipc::channel::{CallError, CallHandler, Server, ServerConfig};
use serde_json::{Value, json};

#[test]
fn service_options_are_checked_before_the_driver() {
    for (args, why) in [
        (
            vec!["serve", "--service", "s", "--size", "4096"],
            "cannot be used with",
        ),
        (
            vec!["serve", "--service", "s", "--checkpoint", "/m"],
            "cannot be used with",
        ),
        (
            vec!["serve", "--service", "s", "--socket", "t"],
            "cannot be used with",
        ),
        (
            vec![
                "serve",
                "--size",
                "4096",
                "--fill-u32",
                "1",
                "--quota",
                "1GiB",
            ],
            "--quota applies only with --service",
        ),
        (
            vec![
                "serve",
                "--size",
                "4096",
                "--fill-u32",
                "1",
                "--grace",
                "1s",
            ],
            "--grace applies only with --service",
        ),
        (
            vec!["serve", "--service", "--quota-uid", "1000"],
            "not UID=BYTES",
        ),
        (
            vec![
                "serve",
                "--service",
                "--quota-uid",
                "1=1GiB",
                "--quota-uid",
                "1=2GiB",
            ],
            "uid 1 is given twice",
        ),
        (vec!["serve", "--service", "--quota", "lots"], "lots"),
        (vec!["serve", "--service", "--grace", "-1"], "-1"),
        (
            vec!["serve", "--service", "a/b/c/no/such/dir/s.sock"],
            "does not exist",
        ),
        (
            vec!["serve", "--service", "--restore", "/no/such/saved"],
            "is not a directory",
        ),
        (
            vec![
                "serve",
                "--size",
                "4096",
                "--fill-u32",
                "1",
                "--restore",
                "/tmp",
            ],
            "--restore applies only with --service",
        ),
    ] {
        assert_error(&args, &cuda_ipc(&args), 2, why);
    }
    // Good options get as far as the driver.
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("svc.sock");
    let s = sock.to_str().unwrap();
    let args = [
        "serve",
        "--service",
        s,
        "--quota",
        "1GiB",
        "--quota-uid",
        "1000=2GiB",
        "--grace",
        "1s",
    ];
    assert_error(&args, &cuda_ipc(&args), 3, "libcuda.so.1");
    // `none` is no limit; no --quota at all is the device's quarter.
    for quota in [&["--quota", "none"][..], &[]] {
        let args: Vec<&str> = ["serve", "--service", s]
            .iter()
            .chain(quota)
            .copied()
            .collect();
        assert_error(&args, &cuda_ipc(&args), 3, "libcuda.so.1");
    }
}

#[test]
fn client_options_are_checked_before_anything_is_sent() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("m.safetensors");
    std::fs::write(&file, b"x").unwrap();
    let f = file.to_str().unwrap();
    let missing = dir.path().join("missing.safetensors");
    // A set name that fits, whose shard name does not.
    let long_set = "m".repeat(250);
    for (args, why) in [
        (vec!["load", "--set", "", f], "must not be empty"),
        (
            vec!["load", "--set", ".cuda-ipc/x", f],
            "the publisher's own",
        ),
        (
            vec!["load", missing.to_str().unwrap()],
            "missing.safetensors",
        ),
        (vec!["load", "--streams", "0", f], "0 is not from 1 to 1024"),
        (vec!["load", "--staging", "0", f], "at least one byte"),
        (vec!["load"], "PATH"),
        (vec!["load", "--tp", "2/2", f], "rank 2 of 2"),
        (vec!["load", "--tp", "3", f], "not R/N"),
        (vec!["load", "--tp", "0/65", f], "65 ranks"),
        (vec!["load", "--tp-rule", "x=1", f], "--tp <R/N>"),
        (
            vec!["load", "--tp", "0/2", "--tp-rule", "x", f],
            "PATTERN=DIM",
        ),
        (
            vec!["load", "--tp", "0/2", "--set", &long_set, f],
            "set name",
        ),
        (vec!["drop"], "SET"),
        (vec!["drop", ""], "must not be empty"),
        (vec!["ls", "--service", ""], "it is empty"),
        (
            vec!["save", "--staging", "1KiB", f],
            "outside 64 KiB to 1 GiB",
        ),
        (vec!["save", "--streams", "65", f], "outside 1 to 64"),
        (vec!["save", "--set", "", f], "must not be empty"),
        (vec!["save"], "PATH"),
    ] {
        assert_error(&args, &cuda_ipc(&args), 2, why);
    }
    let sock = dir.path().join("none.sock");
    let s = sock.to_str().unwrap();
    for args in [
        vec!["ls", "--service", s],
        vec!["stats", "--service", s],
        vec!["drop", "--service", s, "m"],
        vec!["load", "--service", s, f],
        vec!["save", "--service", s, f],
    ] {
        assert_error(
            &args,
            &cuda_ipc(&args),
            4,
            "start one with `cuda-ipc serve --service",
        );
    }
}

/// The calls a stand-in service was asked: method and body.
type Asked = Arc<Mutex<Vec<(String, Value)>>>;

/// A stand-in service: answers the admin methods as `cuda_ipc::service`
/// documents them, and records what it was asked.
fn stand_in(dir: &std::path::Path) -> (Server, Asked) {
    let asked = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&asked);
    let handler = CallHandler::new(move |ctx, method, body| {
        log.lock().unwrap().push((method.to_owned(), body.clone()));
        let uid = ctx.peer.uid;
        match method {
            "ls" => Ok(json!({"sets": [{
                "name": "model", "bytes": 1_048_576, "payload_bytes": 1_000_000,
                "tensors": 3, "version": 2, "owner_uid": uid,
                "loaded_from": "/m/model.safetensors", "created_unix": 1,
                "leases": [{"pid": 4242, "uid": uid}]
            }, {
                "name": "trained", "bytes": 512, "payload_bytes": 400,
                "tensors": 2, "version": 1, "owner_uid": uid,
                "loaded_from": "written by pid 5151 (uid 0)", "created_unix": 1,
                "leases": [], "state": "writing",
                "writer": {"pid": 5151, "uid": uid, "version": 2, "bytes": 512}
            }]})),
            "stats" => Ok(json!({
                "pid": 7, "service_uid": uid, "default_quota": 2_147_483_648_u64,
                "uids": [{"uid": uid, "used": 1_048_576, "reserved": 0,
                          "quota": 2_147_483_648_u64, "sets": 1}],
                "sets": 1, "total_bytes": 1_048_576, "loads_in_progress": 0, "leases": 1,
                "device_free": 1_073_741_824, "device_total": 2_147_483_648_u64,
                "stopping": false
            })),
            "drop" if body["force"] == json!(true) => Ok(json!({
                "set": body["set"], "bytes": 1_048_576,
                "held_by": [{"pid": 4242, "uid": uid}]
            })),
            "drop" => Err(CallError::new(
                "leased",
                "set \"model\" is held by 1 reader lease(s): pid 4242 (uid 1000); they must \
                 release it (or exit) first, or drop it with --force",
            )),
            "load" if body["set"] == json!("big") => Err(CallError::new(
                "over_quota",
                "uid 1000 asks for 5000 bytes, but it uses 0 (and 0 more for loads in \
                 progress) of its quota of 4096",
            )),
            "load" if body["set"] == json!("bad") => Err(CallError::new(
                "checkpoint",
                "invalid checkpoint /m: not a safetensors file",
            )),
            "load" => Ok(json!({
                "set": body["set"], "version": 1, "path": body["path"], "files": 1,
                "tensors": 3, "bytes": 1_000_000, "allocated": 1_048_576, "streams": 8,
                "load_s": 0.25, "gb_per_s": 0.004
            })),
            other => Err(CallError::new("unknown_method", other.to_owned())),
        }
    });
    let server =
        Server::bind(ServerConfig::new(dir.join("svc.sock")).with_call_handler(handler)).unwrap();
    (server, asked)
}

fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn the_clients_speak_the_admin_protocol() {
    let dir = tempfile::tempdir().unwrap();
    let (server, asked) = stand_in(dir.path());
    let s = server.path().to_str().unwrap().to_owned();
    let file = dir.path().join("m.safetensors");
    std::fs::write(&file, b"x").unwrap();
    let f = file.to_str().unwrap();

    let o = cuda_ipc(&["ls", "--service", &s]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("SET") && out.contains("model"), "{out}");
    assert!(out.contains("1MiB") && out.contains("pid 4242"), "{out}");
    assert!(out.contains("committed"), "{out}");
    assert!(out.contains("writing v2 (pid 5151"), "{out}");

    let o = cuda_ipc(&["ls", "--service", &s, "--json"]);
    let v: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(v["sets"][0]["name"], json!("model"));

    let o = cuda_ipc(&["stats", "--service", &s]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("1 set(s)") && out.contains("2GiB"), "{out}");
    assert!(out.contains("device memory: 1GiB free of 2GiB"), "{out}");

    let o = cuda_ipc(&["drop", "--service", &s, "model"]);
    assert_error(&["drop"], &o, 4, "pid 4242");
    let o = cuda_ipc(&["drop", "--service", &s, "model", "--force"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stdout(&o).contains("dropped set model (1MiB)"));
    assert!(stderr(&o).contains("readers still held it: pid 4242"));

    let o = cuda_ipc(&["load", "--service", &s, "--set", "m", f, "--streams", "2"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("loaded set m (version 1): 3 tensors") && out.contains("0.250 s"),
        "{out}"
    );
    let o = cuda_ipc(&["load", "--service", &s, "--set", "big", f]);
    assert_error(&["load"], &o, 4, "quota of 4096");
    let o = cuda_ipc(&["load", "--service", &s, "--set", "bad", f]);
    assert_error(&["load"], &o, 2, "not a safetensors file");
    assert_no_panic(&o);
    let o = cuda_ipc(&[
        "load",
        "--service",
        &s,
        "--set",
        "m",
        f,
        "--tp",
        "1/4",
        "--tp-rule",
        "norm=replicate",
        "--tp-rule",
        "experts=1",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));

    // What the service was asked: strict bodies, an absolute path.
    let asked = asked.lock().unwrap();
    let methods: Vec<&str> = asked.iter().map(|(m, _)| m.as_str()).collect();
    assert_eq!(
        methods,
        [
            "ls", "ls", "stats", "drop", "drop", "load", "load", "load", "load"
        ]
    );
    assert_eq!(asked[0].1, json!({}));
    assert_eq!(asked[3].1, json!({"set": "model", "force": false}));
    let load = &asked[5].1;
    assert_eq!(load["set"], json!("m"));
    assert_eq!(load["streams"], json!(2));
    assert!(load["path"].as_str().unwrap().starts_with('/'), "{load}");
    assert!(load.get("staging").is_none(), "{load}");
    assert!(load.get("tp").is_none(), "{load}");
    // A shard: the set's name, the rank, the world and the rules in order.
    let load = &asked[8].1;
    assert_eq!(load["set"], json!("m"));
    assert_eq!(
        load["tp"],
        json!({"rank": 1, "world": 4, "rules": [["norm", null], ["experts", 1]]})
    );
}
