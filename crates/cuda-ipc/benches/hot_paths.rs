//! GPU-less hot paths of a hand-off, measured with divan:
//! descriptor encoding and decoding, handle hex formatting and parsing, and
//! the channel's round trips over a Unix socket (ping, attach + release of
//! an entry with a memfd, a whole publish-attach-release-unpublish cycle,
//! an update notice), and a weight set's record (encoding, decoding with
//! its checks, through the channel, and an attach's answer carrying it
//! decoded from its payload) at 100 and 1,000 tensors, a publisher's
//! description of a set in a new layout and in one it kept at 1,000 and
//! 10,000, and the
//! channel's share of a set's update at 100, 1,000 and 10,000 tensors (which
//! should not depend on the number). Server
//! and client run in this one process, on separate threads, over a real
//! socket.
//!
//! Run: `cargo bench -p cuda-ipc --bench hot_paths`.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use cuda_ipc::arena::ArenaId;
use cuda_ipc::channel::{Client, ClientConfig, Notice, Server, ServerConfig, default_socket_path};
use cuda_ipc::descriptor::Source;
use cuda_ipc::device::DeviceUuid;
use cuda_ipc::set::{SetChunk, SetEntry, SetRecord};
use cuda_ipc::{Descriptor, Dtype, IpcEventHandle, IpcMemHandle, PoolPtrHandle};
use divan::{Bencher, black_box};
use rustix::fs::{MemfdFlags, memfd_create};

fn main() {
    divan::main();
}

fn bytes(seed: u8) -> [u8; 64] {
    let mut b = [0u8; 64];
    for (i, x) in b.iter_mut().enumerate() {
        *x = (i as u8).wrapping_mul(37).wrapping_add(seed);
    }
    b
}

/// A descriptor as a publish sends it: the handle, an event, a shape;
/// `mechanism` is "legacy" or "pool" (which also carries a descriptor number).
fn descriptor(mechanism: &str) -> Descriptor {
    let source = if mechanism == "pool" {
        Source::Pool {
            fd: 7,
            ptr: PoolPtrHandle::from(bytes(3)),
        }
    } else {
        Source::Legacy {
            handle: IpcMemHandle::from(bytes(1)),
        }
    };
    Descriptor::new(source, 64 << 20, DeviceUuid([0x5a; 16]), 4242)
        .with_dtype(Dtype::U32)
        .with_shape(vec![16 << 20])
        .with_event(IpcEventHandle::from(bytes(2)))
        .with_generation((0x1092 << 40) | 0x11)
}

mod descriptors {
    use super::{Bencher, Descriptor, black_box, descriptor};

    #[divan::bench(args = ["legacy", "pool"])]
    fn encode(bencher: Bencher, mechanism: &str) {
        let d = descriptor(mechanism);
        bencher.bench_local(|| black_box(&d).to_json());
    }

    #[divan::bench(args = ["legacy", "pool"])]
    fn decode(bencher: Bencher, mechanism: &str) {
        let text = descriptor(mechanism).to_json();
        bencher.bench_local(|| Descriptor::from_json(black_box(&text)).unwrap());
    }
}

mod handles {
    use super::{Bencher, IpcMemHandle, black_box, bytes};

    #[divan::bench]
    fn format(bencher: Bencher) {
        let h = IpcMemHandle::from(bytes(9));
        bencher.bench_local(|| black_box(&h).to_string());
    }

    #[divan::bench]
    fn parse(bencher: Bencher) {
        let text = IpcMemHandle::from(bytes(9)).to_string();
        bencher.bench_local(|| black_box(&text).parse::<IpcMemHandle>().unwrap());
    }
}

/// A server on a fresh socket and a client connected to it.
fn pair() -> (Server, Client) {
    static N: AtomicU64 = AtomicU64::new(0);
    let name = format!(
        "hot-paths-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    );
    let path = default_socket_path(&name).expect("socket path");
    let server = Server::bind(ServerConfig::new(&path)).expect("bind");
    let client = Client::connect(&path, ClientConfig::default()).expect("connect");
    (server, client)
}

fn memfd() -> OwnedFd {
    let fd = memfd_create("cuda-ipc-hot-paths", MemfdFlags::CLOEXEC).expect("memfd");
    rustix::fs::ftruncate(&fd, 4096).expect("ftruncate");
    fd
}

fn meta() -> serde_json::Value {
    serde_json::json!({ "descriptor": descriptor("pool").to_value() })
}

mod channel {
    use super::{Bencher, Duration, Notice, memfd, meta, pair};

    /// A new client's connect: the socket, the peer check, the handshake
    /// and the shared-memory notice ring the server makes and sends (the
    /// `connect` part of a fresh process's first attach), then its close.
    #[divan::bench]
    fn connect(bencher: Bencher) {
        let (server, _first) = pair();
        let path = server.path().to_path_buf();
        bencher
            .bench_local(|| super::Client::connect(&path, super::ClientConfig::default()).unwrap());
    }

    /// A request and its answer.
    #[divan::bench]
    fn ping(bencher: Bencher) {
        let (_server, client) = pair();
        bencher.bench_local(|| client.ping().unwrap());
    }

    /// Attach to a published entry (receiving a duplicate of its memfd
    /// with SCM_RIGHTS) and release the lease: what a consumer does.
    #[divan::bench]
    fn attach_release(bencher: Bencher) {
        let (server, client) = pair();
        server.publish("weights", meta(), vec![memfd()]).unwrap();
        bencher.bench_local(|| {
            let a = client.attach("weights").unwrap();
            drop(a.fds);
            client.release(a.lease).unwrap();
        });
    }

    /// Attach to an entry without descriptors (a set's record, whose
    /// chunks the consumer has mapped) and release the lease: the
    /// request's round trip of a fresh hand-off from an arena.
    #[divan::bench]
    fn attach_release_no_fds(bencher: Bencher) {
        let (server, client) = pair();
        server.publish("weights", meta(), Vec::new()).unwrap();
        bencher.bench_local(|| {
            let a = client.attach("weights").unwrap();
            client.release(a.lease).unwrap();
        });
    }

    /// The channel's share of a fresh hand-off: publish an entry with a
    /// memfd, attach, release, unpublish and wait until it is released.
    #[divan::bench]
    fn publish_attach_release_unpublish(bencher: Bencher) {
        let (server, client) = pair();
        bencher.with_inputs(memfd).bench_local_values(|fd| {
            server.publish("fresh", meta(), vec![fd]).unwrap();
            let a = client.attach("fresh").unwrap();
            drop(a.fds);
            client.release(a.lease).unwrap();
            server.unpublish("fresh").unwrap();
            server
                .wait_released("fresh", Some(Duration::from_secs(5)))
                .unwrap();
        });
    }

    /// The channel's share of a cached hand-off: the producer's update
    /// reaches a consumer that holds a lease.
    #[divan::bench]
    fn update_notice(bencher: Bencher) {
        let (server, client) = pair();
        server.publish("cached", meta(), vec![memfd()]).unwrap();
        let a = client.attach("cached").unwrap();
        bencher.bench_local(|| {
            server.update("cached", serde_json::json!({})).unwrap();
            let u = client.next_update(Duration::from_secs(5)).unwrap();
            assert!(matches!(u.notice, Notice::Updated { .. }));
        });
        client.release(a.lease).unwrap();
    }
}

/// The record of a set of `n` tensors of 4 KiB in 8 vmm chunks, named as a
/// transformer's weights are.
fn set_record(n: u64) -> SetRecord {
    let chunks = (0..8u64)
        .map(|c| {
            let d = Descriptor::new(
                Source::Vmm { fd: 10 + c as i32 },
                512 << 20,
                DeviceUuid([0x5a; 16]),
                4242,
            );
            SetChunk::new(c, d.with_generation(c))
        })
        .collect();
    let entries = (0..n)
        .map(|i| {
            let name = format!("model.layers.{}.mlp.w{}", i / 10, i % 10);
            SetEntry::new(name, Dtype::F32, vec![32, 32], i % 8, (i / 8) * 4096, 4096)
        })
        .collect();
    SetRecord::new("weights".into(), ArenaId(7), chunks, entries).expect("a valid record")
}

mod sets {
    use cuda_ipc::exchange::{HIDDEN_ENTRY_PREFIX, SET_PART_BYTES};

    use cuda_ipc::set::{MemberPlace, SetLayouts};

    use super::{Bencher, Duration, Notice, SetRecord, black_box, pair, set_record};

    /// The record as JSON text: what `publish_set` sends.
    #[divan::bench(args = [100, 1000])]
    fn encode(bencher: Bencher, n: u64) {
        let r = set_record(n);
        bencher.bench_local(|| black_box(&r).to_json());
    }

    /// Each entry of `r` as the member that describes it.
    fn places(r: &SetRecord) -> Vec<MemberPlace<'_>> {
        r.entries.iter().map(MemberPlace::from).collect()
    }

    /// A publisher's description of a set of a new layout: its entries
    /// made and checked, and their table encoded (what `publish_set` does
    /// besides reading its members' buffers).
    #[divan::bench(args = [1000, 10_000])]
    fn describe_new(bencher: Bencher, n: u64) {
        let r = set_record(n);
        let places = places(&r);
        bencher.bench_local(|| {
            let (record, layout) = SetLayouts::new()
                .describe("weights", r.arena, r.chunks.clone(), black_box(&places))
                .unwrap();
            (record, layout.table().len())
        });
    }

    /// As `describe_new`, for a set in a layout the publisher described
    /// before (compared with it, its entries and table shared).
    #[divan::bench(args = [1000, 10_000])]
    fn describe_kept(bencher: Bencher, n: u64) {
        let r = set_record(n);
        let places = places(&r);
        let layouts = SetLayouts::new();
        layouts
            .describe("weights", r.arena, r.chunks.clone(), &places)
            .unwrap();
        bencher.bench_local(|| {
            let (record, layout) = layouts
                .describe("weights", r.arena, r.chunks.clone(), black_box(&places))
                .unwrap();
            (record, layout.table().len())
        });
    }

    /// JSON text to a checked record (names, chunks, overlaps): what
    /// `attach_set` decodes.
    #[divan::bench(args = [100, 1000, 10_000])]
    fn decode(bencher: Bencher, n: u64) {
        let text = set_record(n).to_json();
        bencher.bench_local(|| SetRecord::from_json(black_box(&text)).unwrap());
    }

    /// As `decode`, for a subscriber that read the same table before (a
    /// set published again where it was): the table is found among the
    /// kept ones, the rest of the record decoded and checked.
    #[divan::bench(args = [100, 1000, 10_000])]
    fn decode_kept(bencher: Bencher, n: u64) {
        let text = set_record(n).to_json();
        let tables = cuda_ipc::set::EntryTables::new();
        SetRecord::from_json_with(&text, Some(&tables)).unwrap();
        bencher.bench_local(|| SetRecord::from_json_with(black_box(&text), Some(&tables)).unwrap());
    }

    /// As `decode_kept`, for a record whose table travels by reference
    /// (set format 3, what a publisher sends from 300 entries on): the
    /// short record, its table found among the kept ones by reference.
    #[divan::bench(args = [1000, 10_000])]
    fn decode_ref_kept(bencher: Bencher, n: u64) {
        let r = set_record(n);
        let table = r.to_value()["entries"].as_str().unwrap().to_owned();
        let named = cuda_ipc::set::TableRef {
            parts: vec![".cuda-ipc/set-table/1/1/0".into()],
            bytes: table.len() as u64,
        };
        let text = r.to_value_with_ref(&named).to_string();
        let tables = cuda_ipc::set::EntryTables::new();
        let mut fetch = |_: &cuda_ipc::set::TableRef| Ok(table.clone());
        SetRecord::from_json_fetching(&text, Some(&tables), Some(&mut fetch)).unwrap();
        bencher.bench_local(|| SetRecord::from_json_with(black_box(&text), Some(&tables)).unwrap());
    }

    /// The layout hash of a set's entries (what a service writer commits,
    /// and what the Python binding works out at every attach).
    #[divan::bench(args = [100, 1000])]
    fn layout_hash(bencher: Bencher, n: u64) {
        let r = set_record(n);
        bencher.bench_local(|| cuda_ipc::service::layout::layout_hash(black_box(&r.entries)));
    }

    /// An index of the entries by name, as an attach builds it.
    #[divan::bench(args = [100, 1000])]
    fn name_index(bencher: Bencher, n: u64) {
        let r = set_record(n);
        bencher.bench_local(|| black_box(&r).name_index());
    }

    /// The record through the channel: published as an entry's metadata,
    /// attached (the metadata read back), decoded, released.
    #[divan::bench(args = [100, 1000])]
    fn attach_over_the_channel(bencher: Bencher, n: u64) {
        let (server, client) = pair();
        let r = set_record(n);
        server.publish("weights", r.to_value(), vec![]).unwrap();
        bencher.bench_local(|| {
            let a = client.attach("weights").unwrap();
            let back = SetRecord::from_value(&a.meta).unwrap();
            client.release(a.lease).unwrap();
            back
        });
    }

    /// An attach's answer (the record as the entry's metadata) decoded
    /// from its payload, as the client reads it.
    #[divan::bench(args = [10, 100])]
    fn answer_decode(bencher: Bencher, n: u64) {
        let payload = cuda_ipc::channel::Message::Attached {
            id: 7,
            lease: 9,
            meta: std::sync::Arc::new(set_record(n).to_value().into()),
            fds: 0,
        }
        .encode();
        bencher.bench_local(|| cuda_ipc::channel::Message::decode(black_box(&payload)).unwrap());
    }

    /// The channel's share of `Publisher::update_set` for a set of `n`
    /// tensors held by a consumer: the notice (the fence's sequence number,
    /// as the publisher sends it) from `Server::update` until
    /// `Client::next_update` returns. The set is published as a publisher
    /// does: its record as the entry's metadata or, past
    /// [`SET_PART_BYTES`], in parts (entries of their own) that the entry
    /// lists; the notice carries none of it.
    #[divan::bench(args = [100, 1000, 10_000])]
    fn update_notice(bencher: Bencher, n: u64) {
        let (server, client) = pair();
        let text = set_record(n).to_json();
        let meta = if text.len() <= SET_PART_BYTES {
            serde_json::from_str(&text).unwrap()
        } else {
            let parts: Vec<String> = text
                .as_bytes()
                .chunks(SET_PART_BYTES)
                .enumerate()
                .map(|(i, piece)| {
                    let name = format!("{HIDDEN_ENTRY_PREFIX}set-part/bench/{i}");
                    // The record is ASCII: every cut is a character boundary.
                    let piece = std::str::from_utf8(piece).unwrap();
                    server
                        .publish(&name, serde_json::json!({ "text": piece }), vec![])
                        .unwrap();
                    name
                })
                .collect();
            serde_json::json!({ "cuda_ipc_set_parts": parts, "bytes": text.len() })
        };
        server.publish("weights", meta, vec![]).unwrap();
        let a = client.attach("weights").unwrap();
        let mut seq = 0u64;
        bencher.bench_local(|| {
            seq += 1;
            server
                .update("weights", serde_json::json!({ "fence_seq": seq }))
                .unwrap();
            let u = client.next_update(Duration::from_secs(5)).unwrap();
            assert!(matches!(u.notice, Notice::Updated { .. }));
        });
        client.release(a.lease).unwrap();
    }
}
