//! Publish kicks ([`ServerConfig::publish_kick`]): which readers a publish
//! kicks, and that a kicked reader still answers as before.

use std::time::Duration;

use serde_json::json;

use crate::{Client, ClientConfig, NoticePath, Server, ServerConfig, lock};

fn server(config: impl FnOnce(ServerConfig) -> ServerConfig) -> (tempfile::TempDir, Server) {
    let dir = tempfile::tempdir().unwrap();
    let base = ServerConfig::new(dir.path().join("s.sock"))
        .with_notices(NoticePath::Shm)
        .with_spin(Duration::from_micros(50))
        .with_publish_kick(true);
    let server = Server::bind(config(base)).unwrap();
    (dir, server)
}

fn client(server: &Server, path: NoticePath) -> Client {
    Client::connect(
        server.path(),
        ClientConfig::default()
            .with_timeout(Duration::from_secs(5))
            .with_notices(path),
    )
    .unwrap()
}

/// The connection ids the next publish would kick.
fn kicked(server: &Server) -> Vec<u64> {
    let st = lock(&server.shared.state);
    let mut ids: Vec<u64> = server
        .shared
        .readers_to_kick(&st)
        .iter()
        .map(|c| c.id)
        .collect();
    ids.sort_unstable();
    ids
}

fn conn_ids(server: &Server) -> Vec<u64> {
    let mut ids: Vec<u64> = lock(&server.shared.state).conns.keys().copied().collect();
    ids.sort_unstable();
    ids
}

#[test]
fn a_publish_kicks_only_the_readers_of_recent_attachers_with_rings() {
    let (_dir, server) = server(|c| c);
    server.publish("e", json!({}), vec![]).unwrap();
    let pinger = client(&server, NoticePath::Shm);
    pinger.ping().unwrap();
    let before = conn_ids(&server);
    let attacher = client(&server, NoticePath::Shm);
    let a = attacher.attach("e").unwrap();
    attacher.release(a.lease).unwrap();
    let attacher_id = *conn_ids(&server)
        .iter()
        .find(|id| !before.contains(id))
        .unwrap();
    // A client on the socket path has no ring to be kicked through.
    let on_socket = client(&server, NoticePath::Socket);
    let b = on_socket.attach("e").unwrap();
    on_socket.release(b.lease).unwrap();
    assert_eq!(
        kicked(&server),
        vec![attacher_id],
        "only the ring client that attached"
    );
    // The kicked reader answers as before: a publish, then the attach.
    server.publish("f", json!({"n": 1}), vec![]).unwrap();
    let f = attacher.attach("f").unwrap();
    assert_eq!(f.meta, json!({"n": 1}));
    attacher.release(f.lease).unwrap();
    pinger.ping().unwrap();
}

#[test]
fn no_reader_is_kicked_with_kicks_or_the_spin_off() {
    let offs: [fn(ServerConfig) -> ServerConfig; 2] = [
        |c| c.with_publish_kick(false),
        |c| c.with_spin(Duration::ZERO),
    ];
    for off in offs {
        let (_dir, server) = server(off);
        server.publish("e", json!({}), vec![]).unwrap();
        let c = client(&server, NoticePath::Shm);
        let a = c.attach("e").unwrap();
        c.release(a.lease).unwrap();
        assert!(kicked(&server).is_empty());
        server.publish("f", json!({}), vec![]).unwrap();
        let f = c.attach("f").unwrap();
        c.release(f.lease).unwrap();
    }
}

#[test]
fn kicked_readers_keep_answering_through_many_publishes() {
    // Every publish kicks the attacher's reader, asleep or spinning; each
    // attach is still answered once and in order.
    let (_dir, server) = server(|c| c);
    let c = client(&server, NoticePath::Shm);
    for i in 0..300 {
        let name = format!("e{i}");
        server.publish(&name, json!({ "i": i }), vec![]).unwrap();
        if i % 3 == 0 {
            std::thread::sleep(Duration::from_micros(200));
        }
        let a = c.attach(&name).unwrap();
        assert_eq!(a.meta, json!({ "i": i }));
        c.release(a.lease).unwrap();
        server.unpublish(&name).unwrap();
    }
    assert_eq!(server.lease_count("e299"), 0);
}

#[test]
fn the_environment_turns_kicks_on_with_1_only() {
    use super::config::kick_from_env;
    assert!(!kick_from_env(None));
    assert!(kick_from_env(Some("1")));
    assert!(kick_from_env(Some(" 1 ")));
    assert!(!kick_from_env(Some("0")));
    // Anything else keeps the default, with a warning.
    assert!(!kick_from_env(Some("on")));
    assert!(!kick_from_env(Some("")));
}
