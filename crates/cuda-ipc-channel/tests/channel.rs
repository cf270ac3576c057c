//! Tests of the exchange channel (`cuda_ipc::channel`), without a GPU.
//!
//! Multi-process tests re-run this executable in a child role: the child
//! runs the same test function with `CUDA_IPC_CHANNEL_CHILD=<role>` set, and
//! the function acts as the child when it sees the variable. Nothing here
//! forks. Children talk to the parent through their stdout (a `CHILD-READY`
//! line) and stop when their stdin closes or they are killed; a guard
//! kills them if a test fails. Every wait has a deadline.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

mod support;
use support::{ChildProc, memfd_with, pattern, read_fd, test_command};

use cuda_ipc_channel::ChannelErrorKind as ErrorKind;
use cuda_ipc_channel::frame::{
    FrameError, HEADER_LEN, Header, KIND_JSON, MAGIC, MAX_FDS, MAX_PAYLOAD, Message,
    PROTOCOL_VERSION, decode_header, encode_frame, encode_header,
};
use cuda_ipc_channel::socket::{peer_credentials, recv_frame, send_bytes, send_frame};
use cuda_ipc_channel::{
    ChannelError, Client, ClientConfig, EntryKind, Notice, Server, ServerConfig, Side,
    default_socket_dir, default_socket_path, ensure_private_dir, validate_socket_name,
};
use proptest::prelude::*;
use serde_json::{Value, json};

// ---------------------------------------------------------------------------
// Helpers

const CHILD_ENV: &str = "CUDA_IPC_CHANNEL_CHILD";
const PATH_ENV: &str = "CUDA_IPC_CHANNEL_PATH";
const NAME_ENV: &str = "CUDA_IPC_CHANNEL_NAME";

/// Frames sent through a ring in the load test.
const RING_FRAMES: u64 = 300;

/// The fifty consumers: child processes and threads.
const FIFTY_PROCESSES: usize = 25;
const FIFTY_THREADS: usize = 25;

/// How long a child may live at most, in case its parent forgets it.
const CHILD_LIFETIME: Duration = Duration::from_secs(30);

/// Serialises the tests that spawn children, so that their timing checks
/// do not compete with each other for the CI machine's two cores.
static SPAWN_LOCK: Mutex<()> = Mutex::new(());

fn spawn_lock() -> std::sync::MutexGuard<'static, ()> {
    SPAWN_LOCK
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn tmp_socket(dir: &tempfile::TempDir, name: &str) -> PathBuf {
    dir.path().join(format!("{name}.sock"))
}

fn quick_client(path: &Path) -> Client {
    Client::connect(path, ClientConfig::default()).unwrap()
}

/// This test executable re-run for `test` in `role`, against the socket
/// at `path` and the entry `name`.
fn spawn_child(test: &str, role: &str, path: &Path, name: &str) -> ChildProc {
    let mut cmd = test_command(&std::env::current_exe().unwrap(), test);
    cmd.env(CHILD_ENV, role)
        .env(PATH_ENV, path)
        .env(NAME_ENV, name);
    ChildProc::start(cmd).expect("cannot re-run the test executable")
}

/// If this process is a child, runs its role and returns true.
fn run_child_role() -> bool {
    let Ok(role) = std::env::var(CHILD_ENV) else {
        return false;
    };
    let path = PathBuf::from(std::env::var_os(PATH_ENV).unwrap());
    let name = std::env::var(NAME_ENV).unwrap();
    match role.as_str() {
        // Attach, check the bytes, report, and hold the lease until stdin closes.
        "hold" | "verify" => {
            let client = quick_client(&path);
            let a = client.attach(&name).unwrap();
            let len = a.meta["len"].as_u64().unwrap() as usize;
            let seed = a.meta["seed"].as_u64().unwrap() as u8;
            assert_eq!(read_fd(&a.fds[0], len), pattern(len, seed));
            println!("CHILD-READY lease={}", a.lease);
            wait_for_stdin_close();
            if role == "verify" {
                client.release(a.lease).unwrap();
            }
        }
        // Subscribe to a ring, never ack, hold until stdin closes.
        "ring-hold" => {
            let client = quick_client(&path);
            let r = client.attach_ring(&name).unwrap();
            println!("CHILD-READY lease={}", r.lease);
            wait_for_stdin_close();
        }
        // Serve an entry until killed (or stdin closes).
        "producer" => {
            let server = Server::bind(ServerConfig::new(&path)).unwrap();
            let bytes = pattern(8192, 9);
            server
                .publish(
                    &name,
                    json!({"len": 8192, "seed": 9}),
                    vec![memfd_with(&bytes)],
                )
                .unwrap();
            println!("CHILD-READY");
            wait_for_stdin_close();
        }
        other => panic!("unknown child role {other}"),
    }
    true
}

/// Blocks until stdin reaches end of file (the parent closed it or died),
/// or the child's lifetime is over.
fn wait_for_stdin_close() {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
        let _ = tx.send(());
    });
    let _ = rx.recv_timeout(CHILD_LIFETIME);
}

// ---------------------------------------------------------------------------
// Wire format

#[test]
fn handles_can_be_shared_between_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Server>();
    send_sync::<Client>();
    send_sync::<cuda_ipc_channel::RingProducer>();
    send_sync::<ChannelError>();
}

#[test]
fn header_round_trips() {
    let h = Header::json(1234, 3);
    let bytes = encode_header(&h);
    assert_eq!(&bytes[..4], b"CIPC");
    assert_eq!(bytes.len(), HEADER_LEN);
    assert_eq!(decode_header(&bytes).unwrap(), h);
    // Trailing bytes are ignored.
    let mut longer = bytes.to_vec();
    longer.extend_from_slice(b"{}");
    assert_eq!(decode_header(&longer).unwrap(), h);
    // The layout is little-endian, as documented.
    assert_eq!(
        bytes,
        [
            b'C', b'I', b'P', b'C', 1, 0, 1, 0, 0xd2, 0x04, 0, 0, 3, 0, 0, 0
        ]
    );
}

#[test]
fn malformed_headers_are_rejected_precisely() {
    let good = encode_header(&Header::json(10, 0));
    let with = |f: &dyn Fn(&mut [u8; HEADER_LEN])| {
        let mut b = good;
        f(&mut b);
        decode_header(&b).unwrap_err()
    };

    assert_eq!(
        decode_header(&good[..7]).unwrap_err(),
        FrameError::Truncated {
            what: "frame header",
            expected: 16,
            got: 7
        }
    );
    assert_eq!(
        with(&|b| b[..4].copy_from_slice(b"HTTP")),
        FrameError::BadMagic { found: *b"HTTP" }
    );
    assert_eq!(
        with(&|b| b[4] = 2),
        FrameError::UnsupportedVersion {
            found: 2,
            supported: PROTOCOL_VERSION
        }
    );
    assert_eq!(with(&|b| b[6] = 9), FrameError::UnknownKind { found: 9 });
    assert_eq!(
        with(&|b| b[15] = 1),
        FrameError::ReservedNotZero { found: 0x100 }
    );
    assert_eq!(
        with(&|b| b[8..12].copy_from_slice(&(MAX_PAYLOAD + 1).to_le_bytes())),
        FrameError::PayloadTooLarge {
            len: u64::from(MAX_PAYLOAD) + 1,
            max: MAX_PAYLOAD
        }
    );
    assert_eq!(
        with(&|b| b[12] = 17),
        FrameError::TooManyFds {
            count: 17,
            max: MAX_FDS
        }
    );
    // The limits themselves are accepted.
    assert!(decode_header(&encode_header(&Header::json(MAX_PAYLOAD, MAX_FDS as u16))).is_ok());

    // Messages say what was found and what was expected.
    let text = with(&|b| b[4] = 2).to_string();
    assert!(
        text.contains("version 2") && text.contains("speaks version 1"),
        "{text}"
    );
    let text = with(&|b| b[..4].copy_from_slice(b"HTTP")).to_string();
    assert!(
        text.contains("bad magic") && text.contains("CIPC"),
        "{text}"
    );
}

#[test]
fn messages_round_trip_and_match_the_documented_json() {
    let m = Message::Attach {
        id: 7,
        name: "weights".into(),
    };
    assert_eq!(
        serde_json::from_slice::<Value>(&m.encode()).unwrap(),
        json!({"type": "attach", "id": 7, "name": "weights"})
    );
    assert_eq!(Message::decode(&m.encode()).unwrap(), m);

    let e = Message::Error {
        id: None,
        code: "refused".into(),
        message: "no".into(),
        details: json!({"uid": 5}),
    };
    assert_eq!(Message::decode(&e.encode()).unwrap(), e);
    // Optional fields may be left out.
    assert_eq!(
        Message::decode(br#"{"type":"list","id":1}"#).unwrap(),
        Message::List { id: 1, after: None }
    );
    assert_eq!(
        Message::decode(br#"{"type":"error","id":null,"code":"c","message":"m"}"#).unwrap(),
        Message::Error {
            id: None,
            code: "c".into(),
            message: "m".into(),
            details: Value::Null
        }
    );

    let frame = encode_frame(&m, 0).unwrap();
    let h = decode_header(&frame).unwrap();
    assert_eq!(h.kind, KIND_JSON);
    assert_eq!(h.len as usize, frame.len() - HEADER_LEN);
    assert_eq!(Message::decode(&frame[HEADER_LEN..]).unwrap(), m);
}

#[test]
fn malformed_payloads_are_rejected_precisely() {
    let err = |bytes: &[u8]| Message::decode(bytes).unwrap_err();

    assert_eq!(
        err(b"{\"type\":\"ping\",\"id\":1\xff}"),
        FrameError::InvalidUtf8 { valid_up_to: 21 }
    );
    assert!(matches!(err(b""), FrameError::InvalidJson { .. }));
    assert!(matches!(err(b"{\"type\":"), FrameError::InvalidJson { .. }));
    assert!(matches!(err(b"{} x"), FrameError::InvalidJson { .. }));
    let deep = "[".repeat(10_000);
    assert!(matches!(
        err(deep.as_bytes()),
        FrameError::InvalidJson { .. }
    ));

    assert!(matches!(err(b"[1,2]"), FrameError::NotAMessage { found } if found == "an array"));
    assert!(
        matches!(err(b"{\"id\":1}"), FrameError::NotAMessage { found } if found.contains("without"))
    );
    assert!(
        matches!(err(b"{\"type\":5}"), FrameError::NotAMessage { found } if found.contains("a number"))
    );
    assert_eq!(
        err(br#"{"type":"frobnicate"}"#),
        FrameError::UnknownType {
            found: "frobnicate".into()
        }
    );
    let missing = err(br#"{"type":"attach","id":1}"#);
    assert!(
        matches!(&missing, FrameError::InvalidMessage { kind, reason } if kind == "attach" && reason.contains("name")),
        "{missing:?}"
    );
    let extra = err(br#"{"type":"ping","id":1,"extra":true}"#);
    assert!(
        matches!(&extra, FrameError::InvalidMessage { reason, .. } if reason.contains("unknown field")),
        "{extra:?}"
    );
    let wrong = err(br#"{"type":"hello","protocol":70000,"pid":1}"#);
    assert!(
        matches!(&wrong, FrameError::InvalidMessage { reason, .. } if reason.contains("70000")),
        "{wrong:?}"
    );
    let negative = err(br#"{"type":"ping","id":-1}"#);
    assert!(matches!(negative, FrameError::InvalidMessage { .. }));

    let big = vec![b' '; MAX_PAYLOAD as usize + 1];
    assert!(matches!(err(&big), FrameError::PayloadTooLarge { .. }));

    // The unknown-type message lists the known types.
    let text = err(br#"{"type":"frobnicate"}"#).to_string();
    assert!(
        text.contains("attach_ring") && text.contains("frobnicate"),
        "{text}"
    );
}

#[test]
fn encode_frame_enforces_limits() {
    let huge = Message::Attached {
        id: 1,
        lease: 1,
        meta: Value::String("x".repeat(MAX_PAYLOAD as usize)),
        fds: 0,
    };
    assert!(matches!(
        encode_frame(&huge, 0),
        Err(FrameError::PayloadTooLarge { .. })
    ));
    assert!(matches!(
        encode_frame(&Message::Ping { id: 1 }, MAX_FDS + 1),
        Err(FrameError::TooManyFds { .. })
    ));
}

fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        ".{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map(".{0,6}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn arb_message() -> impl Strategy<Value = Message> {
    let name = ".{0,16}";
    prop_oneof![
        (any::<u16>(), any::<u32>()).prop_map(|(protocol, pid)| Message::Hello { protocol, pid }),
        (any::<u64>(), prop::option::of(name)).prop_map(|(id, after)| Message::List { id, after }),
        (any::<u64>(), name).prop_map(|(id, name)| Message::Attach { id, name }),
        (any::<u64>(), any::<u64>()).prop_map(|(id, lease)| Message::Release { id, lease }),
        (any::<u64>(), name).prop_map(|(id, name)| Message::AttachRing { id, name }),
        (any::<u64>(), any::<u32>(), any::<u64>()).prop_map(|(lease, slot, seq)| Message::Ack {
            lease,
            slot,
            seq
        }),
        any::<u64>().prop_map(|id| Message::Ping { id }),
        (any::<u16>(), any::<u32>()).prop_map(|(protocol, pid)| Message::Welcome { protocol, pid }),
        (
            any::<u64>(),
            prop::collection::vec(
                (name, any::<bool>(), arb_json()).prop_map(|(name, ring, meta)| {
                    cuda_ipc_channel::ListedEntry {
                        name,
                        kind: if ring {
                            EntryKind::Ring
                        } else {
                            EntryKind::Entry
                        },
                        meta,
                    }
                }),
                0..3
            ),
            prop::option::of(name)
        )
            .prop_map(|(id, entries, next)| Message::Listing { id, entries, next }),
        (any::<u64>(), any::<u64>(), arb_json(), any::<u16>()).prop_map(
            |(id, lease, meta, fds)| Message::Attached {
                id,
                lease,
                meta,
                fds
            }
        ),
        any::<u64>().prop_map(|id| Message::Released { id }),
        (any::<u64>(), any::<u64>(), any::<u32>(), arb_json()).prop_map(
            |(id, lease, slots, meta)| Message::RingAttached {
                id,
                lease,
                slots,
                meta
            }
        ),
        (
            any::<u64>(),
            any::<u64>(),
            any::<u32>(),
            arb_json(),
            any::<u16>()
        )
            .prop_map(|(id, lease, slot, meta, fds)| Message::RingSlot {
                id,
                lease,
                slot,
                meta,
                fds
            }),
        (any::<u64>(), name, any::<u64>(), arb_json()).prop_map(
            |(lease, name, generation, notice)| Message::Update {
                lease,
                name,
                generation,
                notice
            }
        ),
        (any::<u64>(), any::<u32>(), any::<u64>(), arb_json()).prop_map(
            |(lease, slot, seq, notice)| Message::RingFrame {
                lease,
                slot,
                seq,
                notice
            }
        ),
        (any::<u64>(), name).prop_map(|(lease, name)| Message::Unpublished { lease, name }),
        any::<u64>().prop_map(|id| Message::Pong { id }),
        (prop::option::of(any::<u64>()), name, name, arb_json()).prop_map(
            |(id, code, message, details)| Message::Error {
                id,
                code,
                message,
                details
            }
        ),
    ]
}

/// Text that looks like messages, to get past the JSON parser into the
/// message checks.
fn arb_message_like() -> impl Strategy<Value = String> {
    let ty = prop_oneof![
        prop::sample::select(Message::TYPES.to_vec()).prop_map(str::to_owned),
        "[a-z_]{0,12}",
    ];
    let field = prop_oneof![
        Just("id"),
        Just("name"),
        Just("lease"),
        Just("slot"),
        Just("seq"),
        Just("meta"),
        Just("fds"),
        Just("protocol"),
        Just("pid"),
        Just("code"),
        Just("message"),
        Just("entries"),
        Just("x"),
    ];
    let value = prop_oneof![
        Just("1".to_owned()),
        Just("-1".to_owned()),
        Just("null".to_owned()),
        Just("\"s\"".to_owned()),
        Just("[]".to_owned()),
        Just("{}".to_owned()),
        Just("1e400".to_owned()),
        Just("18446744073709551616".to_owned()),
        any::<u64>().prop_map(|n| n.to_string()),
    ];
    (ty, prop::collection::vec((field, value), 0..6)).prop_map(|(ty, fields)| {
        let mut s = format!("{{\"type\":\"{ty}\"");
        for (f, v) in fields {
            let _ = write!(s, ",\"{f}\":{v}");
        }
        s.push('}');
        s
    })
}

proptest! {
    #[test]
    fn decode_header_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..40)) {
        let _ = decode_header(&bytes);
    }

    #[test]
    fn decode_header_accepts_exactly_valid_headers(len in any::<u32>(), fds in any::<u16>()) {
        let bytes = encode_header(&Header::json(len, fds));
        let valid = len <= MAX_PAYLOAD && usize::from(fds) <= MAX_FDS;
        prop_assert_eq!(decode_header(&bytes).is_ok(), valid);
        if valid {
            prop_assert_eq!(decode_header(&bytes).unwrap(), Header::json(len, fds));
        }
    }

    #[test]
    fn message_decode_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = Message::decode(&bytes);
    }

    #[test]
    fn message_decode_never_panics_on_message_like_json(text in arb_message_like()) {
        let _ = Message::decode(text.as_bytes());
    }

    #[test]
    fn messages_round_trip(m in arb_message()) {
        let bytes = m.encode();
        prop_assert_eq!(Message::decode(&bytes).unwrap(), m.clone());
        let frame = encode_frame(&m, 0).unwrap();
        let h = decode_header(&frame).unwrap();
        prop_assert_eq!(h.len as usize, bytes.len());
    }
}

// ---------------------------------------------------------------------------
// The socket layer

#[test]
fn frames_carry_fds_over_a_socket_pair() {
    let (a, b) = UnixStream::pair().unwrap();
    let bytes = pattern(4096, 1);
    let fd = memfd_with(&bytes);
    let m = Message::Attached {
        id: 1,
        lease: 2,
        meta: json!({"len": 4096}),
        fds: 2,
    };
    send_frame(&a, &m, &[fd.as_fd(), fd.as_fd()], None).unwrap();
    drop(fd);
    let (got, fds) = recv_frame(&b, Some(Instant::now() + Duration::from_secs(5))).unwrap();
    assert_eq!(got, m);
    assert_eq!(fds.len(), 2);
    assert_eq!(read_fd(&fds[1], 4096), bytes);
    // Received descriptors are close-on-exec.
    let flags = rustix::io::fcntl_getfd(&fds[0]).unwrap();
    assert!(flags.contains(rustix::io::FdFlags::CLOEXEC));

    // Many frames in a row stay in step, each with its own descriptors.
    for i in 0..50u64 {
        let fd = memfd_with(&[i as u8; 8]);
        let m = Message::RingSlot {
            id: i,
            lease: 1,
            slot: i as u32,
            meta: json!(i),
            fds: 1,
        };
        send_frame(&a, &m, &[fd.as_fd()], None).unwrap();
        send_frame(&a, &Message::Pong { id: i }, &[], None).unwrap();
    }
    for i in 0..50u64 {
        let (m, fds) = recv_frame(&b, None).unwrap();
        assert!(matches!(m, Message::RingSlot { id, .. } if id == i));
        assert_eq!(read_fd(&fds[0], 8), vec![i as u8; 8]);
        let (m, fds) = recv_frame(&b, None).unwrap();
        assert_eq!(m, Message::Pong { id: i });
        assert!(fds.is_empty());
    }
}

#[test]
fn send_frame_checks_the_fd_count() {
    let (a, _b) = UnixStream::pair().unwrap();
    let fd = memfd_with(b"x");
    let e = send_frame(&a, &Message::Ping { id: 1 }, &[fd.as_fd()], None).unwrap_err();
    assert!(matches!(e, ChannelError::InvalidArgument { .. }), "{e}");
}

#[test]
fn recv_frame_times_out_and_stays_in_step() {
    let (a, b) = UnixStream::pair().unwrap();
    let started = Instant::now();
    let e = recv_frame(&b, Some(Instant::now() + Duration::from_millis(50))).unwrap_err();
    assert!(matches!(e, ChannelError::Timeout { .. }), "{e}");
    assert_eq!(e.kind(), ErrorKind::Timeout);
    assert!(started.elapsed() < Duration::from_secs(2));
    send_frame(&a, &Message::Ping { id: 3 }, &[], None).unwrap();
    assert_eq!(recv_frame(&b, None).unwrap().0, Message::Ping { id: 3 });
}

#[test]
fn recv_frame_reports_eof_and_truncation() {
    // End of file between frames: the peer is gone.
    let (a, b) = UnixStream::pair().unwrap();
    drop(a);
    assert!(matches!(recv_frame(&b, None), Err(ChannelError::PeerGone)));

    // End of file inside a header or payload: truncated.
    let (mut a, b) = UnixStream::pair().unwrap();
    a.write_all(&encode_header(&Header::json(10, 0))[..5])
        .unwrap();
    drop(a);
    assert!(matches!(
        recv_frame(&b, None),
        Err(ChannelError::Frame(FrameError::Truncated {
            what: "frame header",
            expected: 16,
            got: 5
        }))
    ));

    let (mut a, b) = UnixStream::pair().unwrap();
    a.write_all(&encode_header(&Header::json(10, 0))).unwrap();
    a.write_all(b"{\"ty").unwrap();
    drop(a);
    assert!(matches!(
        recv_frame(&b, None),
        Err(ChannelError::Frame(FrameError::Truncated {
            what: "payload",
            expected: 10,
            got: 4
        }))
    ));
}

/// Sends `bytes` with `fds` attached using `sendmsg` directly (no limit on
/// the number of descriptors).
fn sendmsg_raw(stream: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags, sendmsg};
    let mut space = vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(64))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    assert!(control.push(SendAncillaryMessage::ScmRights(fds)));
    let n = sendmsg(
        stream,
        &[std::io::IoSlice::new(bytes)],
        &mut control,
        SendFlags::NOSIGNAL,
    )
    .unwrap();
    assert_eq!(n, bytes.len());
}

#[test]
fn recv_frame_rejects_fd_mismatches() {
    let payload = Message::Ping { id: 1 }.encode();
    let frame = |fds: u16| {
        let mut f = encode_header(&Header::json(payload.len() as u32, fds)).to_vec();
        f.extend_from_slice(&payload);
        f
    };
    let fd = memfd_with(b"x");

    // Announced one, none came.
    let (a, b) = UnixStream::pair().unwrap();
    send_bytes(&a, &frame(1), &[], None).unwrap();
    assert!(matches!(
        recv_frame(&b, None),
        Err(ChannelError::Frame(FrameError::FdCountMismatch {
            expected: 1,
            received: 0
        }))
    ));

    // Announced none, one came (and is closed again).
    let (a, b) = UnixStream::pair().unwrap();
    send_bytes(&a, &frame(0), &[fd.as_fd()], None).unwrap();
    assert!(matches!(
        recv_frame(&b, None),
        Err(ChannelError::Frame(FrameError::FdCountMismatch {
            expected: 0,
            received: 1
        }))
    ));

    // The header and the frame agree, but a ping carries no descriptors.
    let (a, b) = UnixStream::pair().unwrap();
    send_bytes(&a, &frame(1), &[fd.as_fd()], None).unwrap();
    let e = recv_frame(&b, None).unwrap_err();
    assert!(matches!(e, ChannelError::Protocol { .. }), "{e}");

    // More descriptors than the receive buffer holds: MSG_CTRUNC.
    let (a, b) = UnixStream::pair().unwrap();
    let many: Vec<BorrowedFd<'_>> = (0..20).map(|_| fd.as_fd()).collect();
    sendmsg_raw(&a, &frame(16), &many);
    let e = recv_frame(&b, None).unwrap_err();
    assert!(
        matches!(e, ChannelError::Frame(FrameError::FdsTruncated { max: 16 })),
        "{e}"
    );
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
}

#[test]
fn peer_credentials_are_ours() {
    let (a, _b) = UnixStream::pair().unwrap();
    let cred = peer_credentials(&a).unwrap();
    assert_eq!(cred.pid, std::process::id());
    assert_eq!(cred.uid, rustix::process::geteuid().as_raw());
    assert_eq!(cred.gid, rustix::process::getegid().as_raw());
}

// ---------------------------------------------------------------------------
// Errors, names, directories

#[test]
fn error_kinds_and_messages() {
    let cases: Vec<(ChannelError, ErrorKind, &str)> = vec![
        (
            ChannelError::PeerGone,
            ErrorKind::Peer,
            "closed the connection",
        ),
        (
            ChannelError::Refused {
                by: Side::Server,
                uid: 5,
                allowed: vec![6],
            },
            ErrorKind::Peer,
            "uid 5",
        ),
        (
            ChannelError::Remote {
                code: "x".into(),
                message: "y".into(),
            },
            ErrorKind::Peer,
            "(x): y",
        ),
        (
            ChannelError::Timeout {
                what: "a thing".into(),
                after: Duration::from_millis(5),
            },
            ErrorKind::Timeout,
            "waiting for a thing",
        ),
        (
            ChannelError::Protocol { reason: "r".into() },
            ErrorKind::InvalidInput,
            "protocol",
        ),
        (
            ChannelError::NotFound { name: "n".into() },
            ErrorKind::InvalidInput,
            "no entry named \"n\"",
        ),
        (
            ChannelError::AlreadyExists { name: "n".into() },
            ErrorKind::InvalidInput,
            "already published",
        ),
        (
            ChannelError::InvalidName {
                name: "n".into(),
                reason: "r".into(),
            },
            ErrorKind::InvalidInput,
            "invalid name",
        ),
        (
            ChannelError::Busy {
                path: "/p.sock".into(),
            },
            ErrorKind::Failed,
            "another publisher is serving /p.sock",
        ),
        (
            ChannelError::InsecureDirectory {
                path: "/d".into(),
                reason: "r".into(),
            },
            ErrorKind::Failed,
            "refusing to use the socket directory /d",
        ),
    ];
    for (e, kind, text) in cases {
        assert_eq!(e.kind(), kind, "{e}");
        assert!(e.to_string().contains(text), "{e}");
    }
}

#[test]
fn socket_names_are_validated() {
    for ok in ["a", "demo", "cam-0.frames_v2", &"x".repeat(64)] {
        validate_socket_name(ok).unwrap();
    }
    for bad in [
        "",
        ".hidden",
        "a/b",
        "a b",
        "ü",
        &"x".repeat(65),
        "..",
        "a\0",
    ] {
        let e = validate_socket_name(bad).unwrap_err();
        assert!(matches!(e, ChannelError::InvalidName { .. }), "{bad:?}");
    }
    assert!(default_socket_path("../etc/passwd").is_err());
    let p = default_socket_path("demo").unwrap();
    assert_eq!(p.file_name().unwrap(), "demo.sock");
}

#[test]
fn default_socket_dir_is_private() {
    let dir = default_socket_dir().unwrap();
    let meta = std::fs::symlink_metadata(&dir).unwrap();
    assert!(meta.is_dir());
    assert_eq!(meta.permissions().mode() & 0o777, 0o700);
    assert_eq!(meta.uid(), rustix::process::geteuid().as_raw());
}

#[test]
fn private_dirs_are_created_and_bad_ones_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let fresh = tmp.path().join("fresh");
    ensure_private_dir(&fresh).unwrap();
    assert_eq!(
        std::fs::metadata(&fresh).unwrap().permissions().mode() & 0o777,
        0o700
    );
    ensure_private_dir(&fresh).unwrap();

    let open = tmp.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).unwrap();
    let e = ensure_private_dir(&open).unwrap_err();
    assert!(matches!(e, ChannelError::InsecureDirectory { .. }), "{e}");
    assert!(e.to_string().contains("chmod 700"), "{e}");
    // Refused directories are not changed.
    assert_eq!(
        std::fs::metadata(&open).unwrap().permissions().mode() & 0o777,
        0o755
    );

    let link = tmp.path().join("link");
    std::os::unix::fs::symlink(&fresh, &link).unwrap();
    let e = ensure_private_dir(&link).unwrap_err();
    assert!(e.to_string().contains("symbolic link"), "{e}");

    let file = tmp.path().join("file");
    std::fs::write(&file, b"").unwrap();
    assert!(matches!(
        ensure_private_dir(&file),
        Err(ChannelError::InsecureDirectory { .. })
    ));

    let missing_parent = tmp.path().join("no/such");
    assert!(matches!(
        ensure_private_dir(&missing_parent),
        Err(ChannelError::Io { .. })
    ));

    if rustix::process::geteuid().is_root() {
        let theirs = tmp.path().join("theirs");
        std::fs::create_dir(&theirs).unwrap();
        std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::chown(&theirs, Some(54321), None).unwrap();
        let e = ensure_private_dir(&theirs).unwrap_err();
        assert!(e.to_string().contains("owned by uid 54321"), "{e}");
    } else {
        eprintln!("skipped the foreign-owner check: it needs root to chown");
    }
}

// ---------------------------------------------------------------------------
// Server basics

#[test]
fn socket_file_is_0600_and_removed_on_drop() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "mode");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    let meta = std::fs::symlink_metadata(&path).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    assert_eq!(server.path(), path);
    drop(server);
    assert!(!path.exists());
}

#[test]
fn bind_refuses_a_live_server_and_replaces_a_stale_socket() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "busy");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    let e = Server::bind(ServerConfig::new(&path)).unwrap_err();
    assert!(
        matches!(&e, ChannelError::Busy { path: p } if p == &path),
        "{e}"
    );
    assert!(e.to_string().contains("another publisher is serving"));
    // The live server still works.
    quick_client(&path).ping().unwrap();
    drop(server);

    // A socket file that nobody listens on is stale and replaced.
    let stale = tmp_socket(&tmp, "stale");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    assert!(stale.exists());
    let e = Client::connect(&stale, ClientConfig::default()).unwrap_err();
    assert!(e.to_string().contains("nothing is listening"), "{e}");
    let server = Server::bind(ServerConfig::new(&stale)).unwrap();
    quick_client(&stale).ping().unwrap();
    drop(server);

    // Anything else at the path is left alone.
    let file = tmp_socket(&tmp, "file");
    std::fs::write(&file, b"precious").unwrap();
    let e = Server::bind(ServerConfig::new(&file)).unwrap_err();
    assert!(e.to_string().contains("is not a socket"), "{e}");
    assert_eq!(std::fs::read(&file).unwrap(), b"precious");

    // Paths too long for a socket address are refused clearly.
    let long = tmp.path().join("x".repeat(120));
    let e = Server::bind(ServerConfig::new(long)).unwrap_err();
    assert!(e.to_string().contains("bytes long"), "{e}");

    // So is an empty allow-list.
    let e = Server::bind(ServerConfig {
        allowed_uids: vec![],
        ..ServerConfig::new(tmp_socket(&tmp, "nobody"))
    })
    .unwrap_err();
    assert!(e.to_string().contains("allowed_uids"), "{e}");

    // A missing socket says so.
    let e = Client::connect(tmp_socket(&tmp, "missing"), ClientConfig::default()).unwrap_err();
    assert!(e.to_string().contains("does not exist"), "{e}");
}

#[test]
fn attach_passes_memfd_contents() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "memfd");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    let a = pattern(1 << 16, 3);
    let b = pattern(100, 4);
    server
        .publish(
            "tensor",
            json!({"len": a.len(), "dtype": "u8"}),
            vec![memfd_with(&a), memfd_with(&b)],
        )
        .unwrap();

    let client = quick_client(&path);
    assert_eq!(client.server_pid(), std::process::id());
    let att = client.attach("tensor").unwrap();
    assert_eq!(att.name, "tensor");
    assert_eq!(att.meta, json!({"len": 65536, "dtype": "u8"}));
    assert_eq!(att.fds.len(), 2);
    assert_eq!(read_fd(&att.fds[0], a.len()), a);
    assert_eq!(read_fd(&att.fds[1], b.len()), b);

    // The same bytes through a shared mapping.
    let len = a.len();
    // SAFETY: we map a memfd we own for reading, with the length it has,
    // read it while the mapping lives, and unmap it once.
    unsafe {
        let ptr = rustix::mm::mmap(
            std::ptr::null_mut(),
            len,
            rustix::mm::ProtFlags::READ,
            rustix::mm::MapFlags::SHARED,
            &att.fds[0],
            0,
        )
        .unwrap();
        let mapped = std::slice::from_raw_parts(ptr.cast::<u8>(), len);
        assert_eq!(mapped, &a[..]);
        rustix::mm::munmap(ptr, len).unwrap();
    }

    // Writes by the consumer are seen by the producer's memfd (shared file).
    rustix::io::pwrite(&att.fds[1], b"ZZ", 0).unwrap();
    let again = client.attach("tensor").unwrap();
    assert_eq!(&read_fd(&again.fds[1], 2), b"ZZ");

    let leases = server.leases();
    assert_eq!(leases.len(), 2);
    assert!(
        leases.iter().all(|l| l.name == "tensor"
            && l.kind == EntryKind::Entry
            && l.pid == std::process::id())
    );
    assert_eq!(server.lease_count("tensor"), 2);
    client.release(att.lease).unwrap();
    client.release(again.lease).unwrap();
    assert_eq!(server.lease_count("tensor"), 0);

    // A lease can be released once, by its holder.
    let e = client.release(att.lease).unwrap_err();
    assert!(matches!(e, ChannelError::InvalidArgument { .. }), "{e}");
}

#[test]
fn listing_attach_errors_and_names() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "list");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    let client = quick_client(&path);
    assert!(client.list().unwrap().is_empty());

    server.publish("b", json!({"n": 2}), vec![]).unwrap();
    server.publish("a", json!({"n": 1}), vec![]).unwrap();
    let _ring = server
        .create_ring("r", json!("ring"), vec![(json!(0), vec![])])
        .unwrap();
    let listed = client.list().unwrap();
    let names: Vec<_> = listed.iter().map(|e| (e.name.as_str(), e.kind)).collect();
    assert_eq!(
        names,
        [
            ("a", EntryKind::Entry),
            ("b", EntryKind::Entry),
            ("r", EntryKind::Ring)
        ]
    );
    assert_eq!(listed[0].meta, json!({"n": 1}));

    let e = server.publish("a", json!(null), vec![]).unwrap_err();
    assert!(matches!(e, ChannelError::AlreadyExists { .. }), "{e}");
    let e = client.attach("nope").unwrap_err();
    assert!(
        matches!(&e, ChannelError::NotFound { name } if name == "nope"),
        "{e}"
    );
    let e = client.attach("r").unwrap_err();
    assert!(
        matches!(&e, ChannelError::Remote { code, .. } if code == "wrong_kind"),
        "{e}"
    );
    let e = client.attach_ring("a").unwrap_err();
    assert!(
        matches!(&e, ChannelError::Remote { code, .. } if code == "wrong_kind"),
        "{e}"
    );
    assert!(matches!(
        server.publish("", json!(null), vec![]),
        Err(ChannelError::InvalidName { .. })
    ));
    assert!(matches!(
        server.publish("a\nb", json!(null), vec![]),
        Err(ChannelError::InvalidName { .. })
    ));
    let too_many: Vec<OwnedFd> = (0..17).map(|_| memfd_with(b"")).collect();
    assert!(matches!(
        server.publish("many", json!(null), too_many),
        Err(ChannelError::InvalidArgument { .. })
    ));
    let huge = json!("x".repeat(300 * 1024));
    assert!(matches!(
        server.publish("huge", huge.clone(), vec![]),
        Err(ChannelError::InvalidArgument { .. })
    ));
    assert!(matches!(
        server.update("a", huge),
        Err(ChannelError::InvalidArgument { .. })
    ));
    // The client checks names before asking.
    assert!(matches!(
        client.attach(""),
        Err(ChannelError::InvalidName { .. })
    ));
    // The connection survived every error above.
    client.ping().unwrap();
}

#[test]
fn long_listings_come_in_pages() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "pages");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    // 40 entries of ~64 KiB of metadata each: more than one frame holds.
    let blob = "m".repeat(64 * 1024);
    for i in 0..40 {
        server
            .publish(&format!("e{i:02}"), json!({"i": i, "blob": blob}), vec![])
            .unwrap();
    }
    let listed = quick_client(&path).list().unwrap();
    assert_eq!(listed.len(), 40);
    for (i, e) in listed.iter().enumerate() {
        assert_eq!(e.name, format!("e{i:02}"));
        assert_eq!(e.meta["i"], json!(i));
    }
}

#[test]
fn unpublish_and_wait_released() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "unpub");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    server
        .publish("x", json!({"len": 4}), vec![memfd_with(b"abcd")])
        .unwrap();
    // Nothing to wait for yet.
    server.wait_released("x", None).unwrap();
    server
        .wait_released("never-published", Some(Duration::ZERO))
        .unwrap();

    let client = quick_client(&path);
    let a = client.attach("x").unwrap();
    let e = server
        .wait_released("x", Some(Duration::from_millis(100)))
        .unwrap_err();
    assert!(matches!(e, ChannelError::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("1 lease"), "{e}");

    server.unpublish("x").unwrap();
    assert!(matches!(
        server.unpublish("x"),
        Err(ChannelError::NotFound { .. })
    ));
    // No new attaches; the name is free for a new entry at once.
    assert!(matches!(
        client.attach("x"),
        Err(ChannelError::NotFound { .. })
    ));
    assert!(client.list().unwrap().is_empty());
    server
        .publish("x", json!({"len": 4}), vec![memfd_with(b"efgh")])
        .unwrap();
    let b = client.attach("x").unwrap();
    assert_eq!(read_fd(&b.fds[0], 4), b"efgh");
    // The holder of the old entry is told, and its memory is intact.
    let u = client.next_update(Duration::from_secs(5)).unwrap();
    assert_eq!(u.lease, a.lease);
    assert_eq!(u.name, "x");
    assert_eq!(u.notice, Notice::Unpublished);
    assert_eq!(read_fd(&a.fds[0], 4), b"abcd");
    assert_eq!(server.lease_count("x"), 2);

    // Releasing from another thread wakes a waiter without a timeout.
    let server = Arc::new(server);
    let waiter = {
        let server = Arc::clone(&server);
        std::thread::spawn(move || {
            let started = Instant::now();
            server.wait_released("x", None).unwrap();
            started.elapsed()
        })
    };
    std::thread::sleep(Duration::from_millis(50));
    client.release(a.lease).unwrap();
    assert_eq!(server.lease_count("x"), 1);
    client.release(b.lease).unwrap();
    let blocked_for = waiter.join().unwrap();
    assert!(blocked_for < Duration::from_secs(5));
    server
        .wait_released("x", Some(Duration::from_millis(10)))
        .unwrap();
}

/// Frames larger than the socket's buffer: the server starts them from the
/// calling thread and its writer thread finishes them. They must arrive
/// whole, with their descriptors, and in order with the frames after them.
#[test]
fn frames_larger_than_the_socket_buffer_arrive_whole_and_in_order() {
    // Just under the 256 KiB limit of meta and update data; a Unix
    // socket's buffer holds about 200 KiB by default.
    const BLOB: usize = 250 * 1024;
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "large");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    let blob = |c: char| c.to_string().repeat(BLOB);
    let a = pattern(4096, 7);
    let b = pattern(8192, 9);
    server
        .publish(
            "big",
            json!({ "blob": blob('m') }),
            vec![memfd_with(&a), memfd_with(&b)],
        )
        .unwrap();

    // A client that has read nothing yet gets a 250 KiB answer.
    let client = quick_client(&path);
    let att = client.attach("big").unwrap();
    assert_eq!(att.meta["blob"].as_str().map(str::len), Some(BLOB));
    assert_eq!(att.meta, json!({ "blob": blob('m') }));
    assert_eq!(att.fds.len(), 2);
    assert_eq!(read_fd(&att.fds[0], a.len()), a);
    assert_eq!(read_fd(&att.fds[1], b.len()), b);

    // Large notices while the client does not read: the first one fills
    // the socket part-way, the rest queue behind it.
    let letters: Vec<char> = ('a'..='p').collect();
    for (i, c) in letters.iter().enumerate() {
        assert_eq!(server.update("big", json!(blob(*c))).unwrap(), i as u64 + 1);
    }
    std::thread::sleep(Duration::from_millis(50));
    for (i, c) in letters.iter().enumerate() {
        let u = client.next_update(Duration::from_secs(10)).unwrap();
        assert_eq!(u.lease, att.lease);
        assert_eq!(
            u.notice,
            Notice::Updated {
                generation: i as u64 + 1,
                data: json!(blob(*c))
            },
            "update {i}"
        );
    }
    // The connection is still in step.
    client.ping().unwrap();
    client.release(att.lease).unwrap();
    assert_eq!(server.lease_count("big"), 0);
}

#[test]
fn updates_reach_every_holder_in_order() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "updates");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    server.publish("frame", json!(null), vec![]).unwrap();
    server.publish("other", json!(null), vec![]).unwrap();
    // No holders yet: the generation still counts.
    assert_eq!(server.update("frame", json!("early")).unwrap(), 1);

    let clients: Vec<Client> = (0..3).map(|_| quick_client(&path)).collect();
    let leases: Vec<u64> = clients
        .iter()
        .map(|c| c.attach("frame").unwrap().lease)
        .collect();
    let other = clients[0].attach("other").unwrap();
    for i in 0..100u64 {
        assert_eq!(server.update("frame", json!({"i": i})).unwrap(), i + 2);
    }
    server.update("other", json!("o")).unwrap();
    assert!(matches!(
        server.update("missing", json!(1)),
        Err(ChannelError::NotFound { .. })
    ));

    // Pushed frames that arrive while a request waits are kept.
    clients[0].ping().unwrap();
    for (c, lease) in clients.iter().zip(&leases) {
        for i in 0..100u64 {
            let u = c.next_update(Duration::from_secs(5)).unwrap();
            assert_eq!(u.lease, *lease);
            assert_eq!(u.name, "frame");
            assert_eq!(
                u.notice,
                Notice::Updated {
                    generation: i + 2,
                    data: json!({"i": i})
                }
            );
        }
    }
    let u = clients[0].next_update(Duration::from_secs(5)).unwrap();
    assert_eq!(u.lease, other.lease);

    // A zero timeout polls: it takes what has arrived, and does not wait.
    for i in 0..3 {
        server.update("frame", json!(i)).unwrap();
    }
    clients[2].ping().unwrap(); // the updates are now in the socket or queue
    std::thread::sleep(Duration::from_millis(20));
    for _ in 0..3 {
        clients[1].next_update(Duration::ZERO).unwrap();
    }
    let polled = Instant::now();
    assert!(matches!(
        clients[1].next_update(Duration::ZERO),
        Err(ChannelError::Timeout { .. })
    ));
    assert!(polled.elapsed() < Duration::from_millis(100));
    let e = clients[1]
        .next_update(Duration::from_millis(20))
        .unwrap_err();
    assert!(matches!(e, ChannelError::Timeout { .. }), "{e}");
}

#[test]
fn one_client_serves_several_threads() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "threads");
    let server = Arc::new(Server::bind(ServerConfig::new(&path)).unwrap());
    server.publish("e", json!(null), vec![]).unwrap();
    server
        .publish("w", json!(null), vec![memfd_with(b"1234")])
        .unwrap();
    let client = Arc::new(quick_client(&path));
    let lease = client.attach("e").unwrap().lease;

    // One thread waits for updates while others make requests.
    let waiter = {
        let client = Arc::clone(&client);
        std::thread::spawn(move || {
            (0..20)
                .map(|_| client.next_update(Duration::from_secs(10)).unwrap())
                .collect::<Vec<_>>()
        })
    };
    let workers: Vec<_> = (0..4)
        .map(|_| {
            let client = Arc::clone(&client);
            std::thread::spawn(move || {
                for _ in 0..25 {
                    client.ping().unwrap();
                    let a = client.attach("w").unwrap();
                    assert_eq!(read_fd(&a.fds[0], 4), b"1234");
                    client.release(a.lease).unwrap();
                }
            })
        })
        .collect();
    for i in 0..20 {
        server.update("e", json!(i)).unwrap();
        std::thread::sleep(Duration::from_millis(2));
    }
    for w in workers {
        w.join().unwrap();
    }
    let updates = waiter.join().unwrap();
    for (i, u) in updates.iter().enumerate() {
        assert_eq!(u.lease, lease);
        assert_eq!(
            u.notice,
            Notice::Updated {
                generation: i as u64 + 1,
                data: json!(i)
            }
        );
    }
    assert_eq!(server.lease_count("e"), 1);
    assert_eq!(server.lease_count("w"), 0);
}

// ---------------------------------------------------------------------------
// Rings

fn ring_slots(n: usize) -> Vec<(Value, Vec<OwnedFd>)> {
    (0..n)
        .map(|i| (json!({"slot": i}), vec![memfd_with(&[i as u8; 16])]))
        .collect()
}

#[test]
fn ring_back_pressure_and_acks() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "ring");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    let ring = Arc::new(
        server
            .create_ring("frames", json!({"w": 64}), ring_slots(3))
            .unwrap(),
    );
    assert_eq!(ring.slot_count(), 3);
    assert_eq!(ring.name(), "frames");

    let c1 = quick_client(&path);
    let c2 = quick_client(&path);
    let s1 = c1.attach_ring("frames").unwrap();
    let s2 = c2.attach_ring("frames").unwrap();
    assert_eq!(s1.meta, json!({"w": 64}));
    assert_eq!(s1.slots.len(), 3);
    for (i, (meta, fds)) in s1.slots.iter().enumerate() {
        assert_eq!(meta, &json!({"slot": i}));
        assert_eq!(read_fd(&fds[0], 16), vec![i as u8; 16]);
    }
    assert_eq!(ring.subscribers().len(), 2);

    // Fill every slot.
    for i in 0..3 {
        assert_eq!(ring.acquire(Some(Duration::from_secs(1))).unwrap(), i);
        assert_eq!(ring.publish(i, json!({"i": i})).unwrap(), i as u64 + 1);
    }
    let e = ring.acquire(Some(Duration::from_millis(100))).unwrap_err();
    assert!(matches!(e, ChannelError::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("slot 0"), "{e}");

    // A producer thread blocks until both subscribers ack slot 0.
    let blocked = {
        let ring = Arc::clone(&ring);
        std::thread::spawn(move || ring.acquire(Some(Duration::from_secs(10))))
    };
    for (c, s) in [(&c1, &s1), (&c2, &s2)] {
        let f = c.next_frame(s.lease, Duration::from_secs(5)).unwrap();
        assert_eq!((f.lease, f.slot, f.seq), (s.lease, 0, 1));
        assert_eq!(f.notice, json!({"i": 0}));
    }
    c1.ack(s1.lease, 0, 1).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        !blocked.is_finished(),
        "one ack of two must not free the slot"
    );
    let acked = Instant::now();
    c2.ack(s2.lease, 0, 1).unwrap();
    assert_eq!(blocked.join().unwrap().unwrap(), 0);
    assert!(acked.elapsed() < Duration::from_secs(1));

    // Stale and duplicate acks are ignored; bad ones are refused locally.
    c1.ack(s1.lease, 0, 1).unwrap();
    c1.ack(s1.lease, 1, 99).unwrap();
    assert!(matches!(
        c1.ack(s1.lease, 3, 1),
        Err(ChannelError::InvalidArgument { .. })
    ));
    assert!(matches!(
        c1.ack(12345, 0, 1),
        Err(ChannelError::InvalidArgument { .. })
    ));
    assert!(matches!(
        c1.next_frame(12345, Duration::from_millis(1)),
        Err(ChannelError::InvalidArgument { .. })
    ));
    // Publishing a slot that was not acquired is refused.
    assert!(matches!(
        ring.publish(1, json!(null)),
        Err(ChannelError::InvalidArgument { .. })
    ));
    ring.cancel(0).unwrap();
    assert!(ring.cancel(0).is_err());

    // A subscriber that releases its lease frees its pending slots.
    c1.release(s1.lease).unwrap();
    for (slot, seq) in [(1, 2), (2, 3)] {
        let f = c2.next_frame(s2.lease, Duration::from_secs(5)).unwrap();
        assert_eq!((f.slot, f.seq), (slot, seq));
        c2.ack(s2.lease, f.slot, f.seq).unwrap();
    }
    assert_eq!(ring.acquire(Some(Duration::from_secs(1))).unwrap(), 1);
    assert_eq!(ring.acquire(Some(Duration::from_secs(1))).unwrap(), 2);
    assert_eq!(ring.subscribers().len(), 1);

    // Dropping the producer unpublishes the ring: after the frames already
    // sent, the subscriber learns it.
    ring.publish(1, json!("last")).unwrap();
    drop(ring);
    let f = c2.next_frame(s2.lease, Duration::from_secs(5)).unwrap();
    assert_eq!(f.notice, json!("last"));
    let e = c2.next_frame(s2.lease, Duration::from_secs(5)).unwrap_err();
    assert!(
        matches!(&e, ChannelError::Unpublished { name, lease } if name == "frames" && *lease == s2.lease),
        "{e}"
    );
    assert_eq!(server.lease_count("frames"), 1);
    c2.release(s2.lease).unwrap();
    assert_eq!(server.lease_count("frames"), 0);
    assert!(c2.list().unwrap().is_empty());
}

#[test]
fn ring_frames_arrive_in_order_under_load() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "ringload");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    let ring = server.create_ring("r", json!(null), ring_slots(3)).unwrap();
    let client = quick_client(&path);
    let sub = client.attach_ring("r").unwrap();
    let consumer = std::thread::spawn(move || {
        for seq in 1..=RING_FRAMES {
            let f = client
                .next_frame(sub.lease, Duration::from_secs(10))
                .unwrap();
            assert_eq!(f.seq, seq);
            assert_eq!(f.slot as u64, (seq - 1) % 3);
            assert_eq!(f.notice, json!(seq));
            client.ack(sub.lease, f.slot, f.seq).unwrap();
        }
    });
    for seq in 1..=RING_FRAMES {
        let slot = ring.acquire(Some(Duration::from_secs(10))).unwrap();
        assert_eq!(ring.publish(slot, json!(seq)).unwrap(), seq);
    }
    consumer.join().unwrap();
}

#[test]
fn ring_without_subscribers_never_blocks() {
    let tmp = tempfile::tempdir().unwrap();
    let server = Server::bind(ServerConfig::new(tmp_socket(&tmp, "lonely"))).unwrap();
    let ring = server.create_ring("r", json!(null), ring_slots(2)).unwrap();
    for i in 0..10 {
        let slot = ring.acquire(Some(Duration::ZERO)).unwrap();
        assert_eq!(slot, i % 2);
        ring.publish(slot, json!(i)).unwrap();
    }
    assert!(matches!(
        server.create_ring("empty", json!(null), vec![]),
        Err(ChannelError::InvalidArgument { .. })
    ));
    server.unpublish("r").unwrap();
    assert!(matches!(
        ring.acquire(Some(Duration::ZERO)),
        Err(ChannelError::NotFound { .. })
    ));
}

// ---------------------------------------------------------------------------
// Peers: credentials, malformed frames, slow clients

#[test]
fn peer_checks_refuse_other_users() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "peer");
    let me = rustix::process::geteuid().as_raw();
    let other = me.wrapping_add(4242);

    let server = Server::bind(ServerConfig {
        allowed_uids: vec![other],
        ..ServerConfig::new(&path)
    })
    .unwrap();
    let e = Client::connect(&path, ClientConfig::default()).unwrap_err();
    match &e {
        ChannelError::Refused { by, uid, allowed } => {
            assert_eq!(*by, Side::Server);
            assert_eq!(*uid, me);
            assert_eq!(allowed, &vec![other]);
        }
        e => panic!("expected a refusal, got {e}"),
    }
    assert_eq!(e.kind(), ErrorKind::Peer);
    assert!(e.to_string().contains(&format!("uid {me}")), "{e}");
    assert_eq!(server.connection_count(), 0);
    drop(server);

    // The client checks the server too.
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    let e = Client::connect(
        &path,
        ClientConfig {
            allowed_server_uids: vec![other],
            ..ClientConfig::default()
        },
    )
    .unwrap_err();
    assert!(
        matches!(&e, ChannelError::Refused { by: Side::Client, uid, .. } if *uid == me),
        "{e}"
    );
    quick_client(&path).ping().unwrap();
    drop(server);
}

/// Connects a raw stream and, if asked, shakes hands.
fn raw_connect(path: &Path, handshake: bool) -> UnixStream {
    let s = UnixStream::connect(path).unwrap();
    if handshake {
        send_frame(
            &s,
            &Message::Hello {
                protocol: PROTOCOL_VERSION,
                pid: std::process::id(),
            },
            &[],
            None,
        )
        .unwrap();
        let (m, _) = recv_frame(&s, Some(Instant::now() + Duration::from_secs(5))).unwrap();
        assert!(matches!(m, Message::Welcome { protocol: 1, .. }), "{m:?}");
    }
    s
}

fn raw_frame(header: [u8; HEADER_LEN], payload: &[u8]) -> Vec<u8> {
    let mut f = header.to_vec();
    f.extend_from_slice(payload);
    f
}

fn json_frame(payload: &[u8], fds: u16) -> Vec<u8> {
    raw_frame(
        encode_header(&Header::json(payload.len() as u32, fds)),
        payload,
    )
}

/// Something to send over a raw connection.
type Sender<'a> = Box<dyn Fn(&UnixStream) + 'a>;

#[test]
#[allow(clippy::too_many_lines)] // a table of cases
fn malformed_frames_get_an_error_and_a_close_and_the_server_carries_on() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "fuzz");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    server
        .publish("good", json!({"len": 4}), vec![memfd_with(b"good")])
        .unwrap();
    let steady = quick_client(&path);
    let steady_lease = steady.attach("good").unwrap();
    let fd = memfd_with(b"x");

    let ping = Message::Ping { id: 1 }.encode();
    let with_header = |f: &dyn Fn(&mut [u8; HEADER_LEN])| {
        let mut h = encode_header(&Header::json(ping.len() as u32, 0));
        f(&mut h);
        raw_frame(h, &ping)
    };
    let bytes = |b: Vec<u8>| -> Sender<'_> {
        Box::new(move |s: &UnixStream| send_bytes(s, &b, &[], None).unwrap())
    };
    let cases: Vec<(&str, bool, Sender<'_>, &str, &str)> = vec![
        (
            "bad magic",
            false,
            bytes(with_header(&|h| h[..4].copy_from_slice(b"GET "))),
            "malformed_frame",
            "bad magic",
        ),
        (
            "bad version",
            true,
            bytes(with_header(&|h| h[4] = 2)),
            "malformed_frame",
            "protocol version 2",
        ),
        (
            "bad kind",
            true,
            bytes(with_header(&|h| h[6] = 7)),
            "malformed_frame",
            "frame kind 7",
        ),
        (
            "reserved",
            true,
            bytes(with_header(&|h| h[14] = 1)),
            "malformed_frame",
            "reserved",
        ),
        (
            "oversize",
            true,
            bytes(with_header(&|h| {
                h[8..12].copy_from_slice(&(MAX_PAYLOAD * 2).to_le_bytes());
            })),
            "malformed_frame",
            "exceeds the limit",
        ),
        (
            "too many fds",
            true,
            bytes(with_header(&|h| h[12] = 40)),
            "malformed_frame",
            "40 file descriptors",
        ),
        (
            "short header",
            true,
            Box::new(|s: &UnixStream| {
                send_bytes(s, &MAGIC, &[], None).unwrap();
                s.shutdown(std::net::Shutdown::Write).unwrap();
            }),
            "malformed_frame",
            "frame header truncated",
        ),
        (
            "short payload",
            true,
            Box::new(|s: &UnixStream| {
                send_bytes(s, &json_frame(&ping, 0)[..HEADER_LEN + 3], &[], None).unwrap();
                s.shutdown(std::net::Shutdown::Write).unwrap();
            }),
            "malformed_frame",
            "payload truncated",
        ),
        (
            "not utf-8",
            true,
            bytes(json_frame(b"{\"type\":\xc0}", 0)),
            "malformed_frame",
            "UTF-8",
        ),
        (
            "not json",
            true,
            bytes(json_frame(b"{type: ping}", 0)),
            "malformed_frame",
            "not valid JSON",
        ),
        (
            "not an object",
            true,
            bytes(json_frame(b"42", 0)),
            "malformed_frame",
            "not a message",
        ),
        (
            "unknown type",
            true,
            bytes(json_frame(br#"{"type":"shutdown"}"#, 0)),
            "malformed_frame",
            "unknown message type \"shutdown\"",
        ),
        (
            "missing field",
            true,
            bytes(json_frame(br#"{"type":"attach","id":3}"#, 0)),
            "malformed_frame",
            "missing field `name`",
        ),
        (
            "extra field",
            true,
            bytes(json_frame(br#"{"type":"ping","id":3,"admin":true}"#, 0)),
            "malformed_frame",
            "unknown field `admin`",
        ),
        (
            "announced fd missing",
            true,
            bytes(json_frame(&ping, 1)),
            "malformed_frame",
            "announced 1 file descriptors but 0",
        ),
        (
            "unannounced fd",
            true,
            Box::new(|s: &UnixStream| {
                send_bytes(s, &json_frame(&ping, 0), &[fd.as_fd()], None).unwrap();
            }),
            "malformed_frame",
            "announced 0 file descriptors but 1",
        ),
        (
            "fd with a ping",
            true,
            Box::new(|s: &UnixStream| {
                send_bytes(s, &json_frame(&ping, 1), &[fd.as_fd()], None).unwrap();
            }),
            "protocol",
            "file descriptors",
        ),
        (
            "fd flood",
            true,
            Box::new(|s: &UnixStream| {
                let many: Vec<BorrowedFd<'_>> = (0..40).map(|_| fd.as_fd()).collect();
                sendmsg_raw(s, &json_frame(&ping, 16), &many);
            }),
            "malformed_frame",
            "discarded",
        ),
        (
            "server message",
            true,
            bytes(json_frame(&Message::Pong { id: 1 }.encode(), 0)),
            "protocol",
            "server message",
        ),
        (
            "no hello",
            false,
            bytes(json_frame(&ping, 0)),
            "protocol",
            "expected a \"hello\" message first",
        ),
        (
            "second hello",
            true,
            bytes(json_frame(
                &Message::Hello {
                    protocol: 1,
                    pid: 1,
                }
                .encode(),
                0,
            )),
            "protocol",
            "second \"hello\"",
        ),
        (
            "old protocol",
            false,
            bytes(json_frame(
                &Message::Hello {
                    protocol: 9,
                    pid: 1,
                }
                .encode(),
                0,
            )),
            "unsupported_protocol",
            "protocol 9",
        ),
        (
            "well-formed attach",
            true,
            bytes(json_frame(
                &Message::Attach {
                    id: 1,
                    name: "good".into(),
                }
                .encode(),
                0,
            )),
            "",
            "",
        ),
    ];

    for (what, handshake, send, code, text) in &cases {
        let s = raw_connect(&path, *handshake);
        send(&s);
        let deadline = Some(Instant::now() + Duration::from_secs(5));
        if code.is_empty() {
            // A well-formed request: answered, connection kept.
            let (m, fds) = recv_frame(&s, deadline).unwrap();
            assert!(matches!(m, Message::Attached { .. }), "{what}: {m:?}");
            assert_eq!(fds.len(), 1);
            send_bytes(&s, &json_frame(&ping, 0), &[], None).unwrap();
            assert_eq!(recv_frame(&s, deadline).unwrap().0, Message::Pong { id: 1 });
            continue;
        }
        match recv_frame(&s, deadline) {
            Ok((
                Message::Error {
                    id: None,
                    code: c,
                    message,
                    ..
                },
                fds,
            )) => {
                assert_eq!(&c, code, "{what}: {message}");
                assert!(message.contains(text), "{what}: {message:?} lacks {text:?}");
                assert!(fds.is_empty());
            }
            other => panic!("{what}: expected an error frame, got {other:?}"),
        }
        // Then the server closes the connection.
        match recv_frame(&s, deadline) {
            Err(ChannelError::PeerGone) => {}
            other => panic!("{what}: expected the connection closed, got {other:?}"),
        }
        // Everyone else is still served.
        steady.ping().unwrap();
    }

    // A peer that connects and says nothing is dropped after the handshake timeout.
    let impatient = tmp_socket(&tmp, "impatient");
    let server2 = Server::bind(ServerConfig {
        handshake_timeout: Duration::from_millis(100),
        ..ServerConfig::new(&impatient)
    })
    .unwrap();
    let s = raw_connect(&impatient, false);
    let (m, _) = recv_frame(&s, Some(Instant::now() + Duration::from_secs(5))).unwrap();
    assert!(
        matches!(&m, Message::Error { code, message, .. } if code == "protocol" && message.contains("no \"hello\"")),
        "{m:?}"
    );
    drop(server2);

    // Garbage connections left no leases behind; the steady client is fine.
    assert_eq!(server.lease_count("good"), 1);
    let a = quick_client(&path).attach("good").unwrap();
    assert_eq!(read_fd(&a.fds[0], 4), b"good");
    steady.release(steady_lease.lease).unwrap();
}

#[test]
fn a_client_that_does_not_read_is_disconnected() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "slow");
    let server = Server::bind(ServerConfig {
        max_queued_frames: 8,
        send_timeout: Duration::from_millis(200),
        ..ServerConfig::new(&path)
    })
    .unwrap();
    server.publish("e", json!(null), vec![]).unwrap();
    let lazy = quick_client(&path);
    let _lease = lazy.attach("e").unwrap();
    let reader = quick_client(&path);
    let blob = json!("b".repeat(128 * 1024));
    // The lazy client never reads: its socket buffer fills, its queue
    // overflows or its sends time out, and it is cut off. The producer
    // never blocks.
    let started = Instant::now();
    for _ in 0..200 {
        server.update("e", blob.clone()).unwrap();
    }
    assert!(started.elapsed() < Duration::from_secs(5));
    server
        .wait_released("e", Some(Duration::from_secs(5)))
        .unwrap();
    reader.ping().unwrap();
    // The lazy client gets what was sent, then learns the connection ended.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match lazy.next_update(Duration::from_secs(5)) {
            Ok(_) => assert!(Instant::now() < deadline),
            Err(ChannelError::PeerGone) => break,
            Err(e) => panic!("expected PeerGone, got {e}"),
        }
    }
    assert!(!lazy.is_alive());
}

// ---------------------------------------------------------------------------
// Processes: killed consumers and producers, many consumers

#[test]
fn killed_consumer_releases_its_leases() {
    if run_child_role() {
        return;
    }
    let _serial = spawn_lock();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "killed-consumer");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    let bytes = pattern(4096, 5);
    server
        .publish(
            "buf",
            json!({"len": 4096, "seed": 5}),
            vec![memfd_with(&bytes)],
        )
        .unwrap();

    let mut child = spawn_child("killed_consumer_releases_its_leases", "hold", &path, "buf");
    child.line("CHILD-READY", Duration::from_secs(20));
    let leases = server.leases();
    assert_eq!(leases.len(), 1);
    assert_eq!(leases[0].pid, child.pid());

    let killed = Instant::now();
    child.kill();
    server
        .wait_released("buf", Some(Duration::from_secs(1)))
        .unwrap();
    let took = killed.elapsed();
    assert!(took < Duration::from_secs(1), "took {took:?}");
    assert!(server.leases().is_empty());
}

#[test]
fn killed_ring_subscriber_frees_its_slots() {
    if run_child_role() {
        return;
    }
    let _serial = spawn_lock();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "killed-sub");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    let ring = server.create_ring("r", json!(null), ring_slots(2)).unwrap();
    let mut child = spawn_child(
        "killed_ring_subscriber_frees_its_slots",
        "ring-hold",
        &path,
        "r",
    );
    child.line("CHILD-READY", Duration::from_secs(20));
    assert_eq!(ring.subscribers().len(), 1);
    for i in 0..2 {
        let slot = ring.acquire(Some(Duration::from_secs(1))).unwrap();
        ring.publish(slot, json!(i)).unwrap();
    }
    assert!(matches!(
        ring.acquire(Some(Duration::from_millis(100))),
        Err(ChannelError::Timeout { .. })
    ));
    let killed = Instant::now();
    child.kill();
    assert_eq!(ring.acquire(Some(Duration::from_secs(1))).unwrap(), 0);
    assert!(killed.elapsed() < Duration::from_secs(1));
    assert!(ring.subscribers().is_empty());
}

#[test]
fn killed_producer_is_noticed_at_once() {
    if run_child_role() {
        return;
    }
    let _serial = spawn_lock();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "killed-producer");
    let mut child = spawn_child("killed_producer_is_noticed_at_once", "producer", &path, "p");
    child.line("CHILD-READY", Duration::from_secs(20));

    let client = Arc::new(quick_client(&path));
    assert_eq!(client.server_pid(), child.pid());
    let a = client.attach("p").unwrap();
    assert_eq!(read_fd(&a.fds[0], 8192), pattern(8192, 9));
    assert!(client.is_alive());

    // A thread already waiting for an update must be woken too.
    let waiter = {
        let client = Arc::clone(&client);
        std::thread::spawn(move || {
            let started = Instant::now();
            let r = client.next_update(Duration::from_secs(20));
            (r, started)
        })
    };
    std::thread::sleep(Duration::from_millis(50));
    let killed = Instant::now();
    child.kill();
    while client.is_alive() {
        assert!(
            killed.elapsed() < Duration::from_secs(1),
            "is_alive still true after 1 s"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let (r, _) = waiter.join().unwrap();
    assert!(matches!(r, Err(ChannelError::PeerGone)), "{r:?}");
    assert!(matches!(client.ping(), Err(ChannelError::PeerGone)));
    assert!(matches!(client.attach("p"), Err(ChannelError::PeerGone)));
    assert!(matches!(client.list(), Err(ChannelError::PeerGone)));
    assert!(matches!(
        client.next_update(Duration::from_secs(10)),
        Err(ChannelError::PeerGone)
    ));
    assert!(killed.elapsed() < Duration::from_secs(1));
    // The memory the producer shared outlives it in the consumer.
    assert_eq!(read_fd(&a.fds[0], 8192), pattern(8192, 9));
}

#[test]
fn fifty_consumers_at_once() {
    if run_child_role() {
        return;
    }
    let _serial = spawn_lock();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "fifty");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    let len = 1 << 16;
    let bytes = pattern(len, 77);
    server
        .publish(
            "shared",
            json!({"len": len, "seed": 77}),
            vec![memfd_with(&bytes)],
        )
        .unwrap();

    let mut children: Vec<ChildProc> = (0..FIFTY_PROCESSES)
        .map(|_| spawn_child("fifty_consumers_at_once", "verify", &path, "shared"))
        .collect();
    let attached = Arc::new(Barrier::new(FIFTY_THREADS + 1));
    let release = Arc::new(Barrier::new(FIFTY_THREADS + 1));
    let threads: Vec<_> = (0..FIFTY_THREADS)
        .map(|_| {
            let (path, bytes) = (path.clone(), bytes.clone());
            let (attached, release) = (Arc::clone(&attached), Arc::clone(&release));
            std::thread::spawn(move || {
                let client = quick_client(&path);
                let a = client.attach("shared").unwrap();
                assert_eq!(read_fd(&a.fds[0], bytes.len()), bytes);
                attached.wait();
                release.wait();
                client.release(a.lease).unwrap();
            })
        })
        .collect();
    attached.wait();
    for c in &mut children {
        c.line("CHILD-READY", Duration::from_secs(30));
    }
    // All fifty hold a lease at the same time.
    assert_eq!(
        server.lease_count("shared"),
        FIFTY_PROCESSES + FIFTY_THREADS
    );
    let pids: std::collections::HashSet<u32> = server.leases().iter().map(|l| l.pid).collect();
    assert_eq!(pids.len(), FIFTY_PROCESSES + 1);

    release.wait();
    for c in &mut children {
        c.close_stdin();
    }
    for t in threads {
        t.join().unwrap();
    }
    for c in &mut children {
        c.wait_success(Duration::from_secs(20));
    }
    server
        .wait_released("shared", Some(Duration::from_secs(5)))
        .unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Whatever bytes a client sends, the server answers or closes the
    /// connection within the deadline, and keeps serving everyone else.
    #[test]
    fn the_server_survives_garbage(
        handshake in any::<bool>(),
        bytes in prop::collection::vec(any::<u8>(), 0..200),
        valid_header in any::<bool>(),
    ) {
        // A server of its own per case: its socket and directory go with it
        // (a server in a static would never be dropped and leave both behind).
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp_socket(&tmp, "garbage");
        let server = Server::bind(ServerConfig::new(&path)).unwrap();
        server
            .publish("e", json!({"len": 4}), vec![memfd_with(b"abcd")])
            .unwrap();
        let steady = quick_client(&path);
        let s = raw_connect(&path, handshake);
        let sent = if valid_header {
            json_frame(&bytes, 0)
        } else {
            bytes.clone()
        };
        send_bytes(&s, &sent, &[], None).unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        let deadline = Some(Instant::now() + Duration::from_secs(10));
        // Read until the server closes: every frame must be well formed.
        loop {
            match recv_frame(&s, deadline) {
                Ok(_) => {}
                Err(ChannelError::PeerGone) => break,
                Err(e) => prop_assert!(false, "unexpected {e}"),
            }
        }
        prop_assert!(steady.ping().is_ok());
        prop_assert_eq!(server.lease_count("e"), 0);
    }
}

#[test]
fn shutdown_disconnects_clients_and_wakes_waiters() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "shutdown");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    server
        .publish("e", json!(null), vec![memfd_with(b"data")])
        .unwrap();
    let ring = Arc::new(server.create_ring("r", json!(null), ring_slots(1)).unwrap());
    let client = quick_client(&path);
    let a = client.attach("e").unwrap();
    let sub = client.attach_ring("r").unwrap();
    let slot = ring.acquire(Some(Duration::from_secs(1))).unwrap();
    ring.publish(slot, json!(1)).unwrap();
    let blocked = {
        let ring = Arc::clone(&ring);
        std::thread::spawn(move || ring.acquire(Some(Duration::from_secs(20))))
    };
    std::thread::sleep(Duration::from_millis(50));

    let started = Instant::now();
    server.shutdown();
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(!path.exists());
    let r = blocked.join().unwrap();
    assert!(matches!(r, Err(ChannelError::ShutDown)), "{r:?}");
    assert!(started.elapsed() < Duration::from_secs(2));
    // The client gets the frame already sent, then learns the server is gone.
    assert_eq!(
        client
            .next_frame(sub.lease, Duration::from_secs(5))
            .unwrap()
            .seq,
        1
    );
    assert!(matches!(
        client.next_frame(sub.lease, Duration::from_secs(5)),
        Err(ChannelError::PeerGone)
    ));
    assert!(!client.is_alive());
    assert!(matches!(client.ping(), Err(ChannelError::PeerGone)));
    // Its descriptors remain valid.
    assert_eq!(read_fd(&a.fds[0], 4), b"data");
    assert!(matches!(
        server.publish("f", json!(null), vec![]),
        Err(ChannelError::ShutDown)
    ));
    assert!(matches!(
        server.update("e", json!(null)),
        Err(ChannelError::ShutDown)
    ));
    assert!(matches!(server.unpublish("e"), Err(ChannelError::ShutDown)));
    assert!(server.leases().is_empty());
    server.wait_released("e", None).unwrap();
    server.shutdown();
    drop(server);
}
