//! Push: entries handed to a stream's subscribers with a lease each,
//! bounded per subscriber, released as any lease.

use super::*;
use cuda_ipc_channel::{Notice, PushedEntry};

/// The pushed entry of the next update `client` gets (on `stream_lease`).
fn next_pushed(client: &Client, stream_lease: u64) -> PushedEntry {
    let u = client.next_update(Duration::from_secs(5)).unwrap();
    assert_eq!(u.lease, stream_lease);
    let Notice::Updated { data, .. } = u.notice else {
        panic!("a push comes as an update, not {:?}", u.notice);
    };
    PushedEntry::from_notice(&data)
        .expect("a pushed notice")
        .unwrap()
}

#[test]
fn a_push_grants_each_subscriber_a_lease_within_its_bound() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "push");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    server
        .publish("kv", json!({"stream": true}), vec![])
        .unwrap();
    for i in 0..4 {
        server
            .publish(
                &format!("block{i}"),
                json!({"block": i}),
                vec![memfd_with(&[i; 8])],
            )
            .unwrap();
    }
    let taker = quick_client(&path);
    let hoarder = quick_client(&path);
    let t = taker.attach("kv").unwrap().lease;
    let h = hoarder.attach("kv").unwrap().lease;

    let r = server.push("block0", "kv", 2).unwrap();
    assert_eq!((r.leases.len(), r.skipped.len()), (2, 0));
    let got = next_pushed(&taker, t);
    assert_eq!(
        (got.name.as_str(), got.meta.clone()),
        ("block0", json!({"block": 0}))
    );
    assert!(r.leases.contains(&got.lease));
    // The lease is held from the push on, by the subscriber's connection.
    let held = server.leases();
    let pushed = held.iter().find(|l| l.lease == got.lease).unwrap();
    assert_eq!(pushed.name, "block0");
    let stream = held.iter().find(|l| l.lease == t).unwrap();
    assert_eq!(pushed.connection, stream.connection);
    taker.release(got.lease).unwrap();
    assert_eq!(next_pushed(&hoarder, h).name, "block0");

    // The hoarder takes nothing more and releases nothing: at its bound
    // it is skipped; the taker is not held up.
    server.push("block1", "kv", 2).unwrap();
    let r = server.push("block2", "kv", 2).unwrap();
    assert_eq!((r.leases.len(), r.skipped.clone()), (1, vec![h]));
    for name in ["block1", "block2"] {
        let p = next_pushed(&taker, t);
        assert_eq!(p.name, name);
        taker.release(p.lease).unwrap();
    }
    assert_eq!(server.lease_count("block2"), 0);
    assert_eq!(
        server.lease_count("block0") + server.lease_count("block1"),
        2
    );

    // Its connection's end releases what it was pushed.
    drop(hoarder);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while server.lease_count("block0") + server.lease_count("block1") > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the hoarder's leases end with it"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // A stream or an entry not published is refused, nothing pushed.
    assert!(matches!(
        server.push("block3", "nostream", 2),
        Err(ChannelError::NotFound { .. })
    ));
    assert!(matches!(
        server.push("nothing", "kv", 2),
        Err(ChannelError::NotFound { .. })
    ));
    assert_eq!(server.lease_count("block3"), 0);
    assert!(PushedEntry::from_notice(&json!({"fence_seq": 3})).is_none());
    assert!(
        PushedEntry::from_notice(&json!({"pushed": {"lease": 1}}))
            .unwrap()
            .is_err()
    );
}
