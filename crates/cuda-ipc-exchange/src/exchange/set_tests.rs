//! The publisher's arena bookkeeping without a GPU: chunks are memfds, the
//! channel is real (a server and clients over a socket), and a consumer
//! killed while it holds a set is a real child process.

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rustix::fs::{MemfdFlags, ftruncate, memfd_create};

use super::*;
use crate::arena::ArenaOptions;
use crate::channel::{Client, ClientConfig, ServerConfig};
use crate::descriptor::Dtype;
use crate::exchange::lock;
use crate::exchange::set_attach::read_record;
use crate::exchange::set_order::{ChunkStream, SetHold};
use crate::exchange::set_text::split_utf8;
use crate::set::SetEntry;
use crate::set::SetRecord;

/// Chunks of host memory in memfds: what a chunk entry carries, without a
/// GPU. Chunk `i` gets lane `i % lanes` as its stream.
pub(super) struct MemChunks {
    pub(super) lanes: Vec<Arc<Lane>>,
    made: AtomicUsize,
}

impl MemChunks {
    /// Chunks over `lanes` stand-in streams (at least one).
    pub(super) fn new(lanes: usize) -> Self {
        MemChunks {
            lanes: (0..lanes.max(1))
                .map(|_| Arc::new(Lane::default()))
                .collect(),
            made: AtomicUsize::new(0),
        }
    }
}

/// A stand-in for a CUDA stream: counts how often a chunk was asked for it
/// (each ask is where a device chunk orders its uses on other streams).
#[derive(Debug, Default)]
pub(super) struct Lane {
    pub(super) asked: AtomicUsize,
}

impl Lane {
    pub(super) fn asked(&self) -> usize {
        self.asked.load(Ordering::Relaxed)
    }
}

pub(super) struct MemChunk {
    fd: OwnedFd,
    len: u64,
    lane: Arc<Lane>,
}

impl ChunkBacking for MemChunks {
    type Chunk = MemChunk;
    fn granularity(&self) -> u64 {
        4096
    }
    fn create(&self, len: u64) -> Result<MemChunk> {
        let fd = memfd_create("cuda-ipc-test-chunk", MemfdFlags::CLOEXEC)
            .map_err(|e| Error::arg("memfd", e.to_string()))?;
        ftruncate(&fd, len).map_err(|e| Error::arg("memfd", e.to_string()))?;
        let i = self.made.fetch_add(1, Ordering::Relaxed);
        let lane = self.lanes[i % self.lanes.len()].clone();
        Ok(MemChunk { fd, len, lane })
    }
    fn chunk_len(chunk: &MemChunk) -> u64 {
        chunk.len
    }
}

impl ChunkStream for MemChunk {
    type Stream = Lane;
    fn stream(&self) -> &Arc<Lane> {
        self.lane.asked.fetch_add(1, Ordering::Relaxed);
        &self.lane
    }
}

/// What the book holds for a set of `leases`.
pub(super) fn hold(leases: Vec<ArenaLease<MemChunks>>) -> SetHold<MemChunks> {
    SetHold::new(leases)
}

impl ChunkEntry for MemChunk {
    fn entry(&self) -> Result<(Value, Vec<OwnedFd>)> {
        let fd = self
            .fd
            .try_clone()
            .map_err(|e| Error::arg("memfd", e.to_string()))?;
        Ok((json!({ "memfd": self.len }), vec![fd]))
    }
}

/// An arena of 1 MiB chunks over `lanes` stand-in streams.
pub(super) fn arena_on(lanes: usize) -> Arena<MemChunks> {
    Arena::new(
        MemChunks::new(lanes),
        ArenaOptions {
            chunk_size: 1 << 20,
            max_chunk_size: 1 << 20,
            ..ArenaOptions::default()
        },
    )
    .unwrap()
}

fn arena() -> Arena<MemChunks> {
    arena_on(1)
}

pub(super) fn server(dir: &tempfile::TempDir) -> Server {
    Server::bind(ServerConfig::new(dir.path().join("s.sock"))).unwrap()
}

/// A server in a temporary folder (kept while the first value lives), a
/// 1 MiB-chunk arena and an empty book.
pub(super) fn setup() -> (tempfile::TempDir, Server, Arena<MemChunks>, Book<MemChunks>) {
    let dir = tempfile::tempdir().unwrap();
    let server = server(&dir);
    (dir, server, arena(), Book::default())
}

pub(super) fn client(server: &Server) -> Client {
    Client::connect(server.path(), ClientConfig::default()).unwrap()
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A record's stand-in: the set entry's metadata is whatever JSON the
/// publisher built (the set record's own decoder is tested in `set`).
pub(super) fn record(n: usize) -> Value {
    json!({ SET_VERSION_KEY: 1, "entries": (0..n).map(|i| format!("w{i}")).collect::<Vec<_>>() })
}

#[test]
fn chunk_descriptors_travel_once_per_subscriber_and_sets_carry_none() {
    let (_dir, server, arena, mut book) = setup();
    // Three buffers over two chunks (each chunk holds 1 MiB).
    let a = arena.alloc(600 << 10).unwrap();
    let b = arena.alloc(300 << 10).unwrap();
    let c = arena.alloc(600 << 10).unwrap();
    assert_eq!(a.chunk().id(), b.chunk().id());
    assert_ne!(a.chunk().id(), c.chunk().id());
    let leases = vec![a.lease(), b.lease(), c.lease()];
    book.publish(&server, &arena, "weights", record(3), hold(leases), None)
        .unwrap();
    // One hidden entry per chunk, published once.
    let names: Vec<String> = client(&server)
        .list()
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    for ch in [a.chunk().id(), c.chunk().id()] {
        assert!(names.contains(&chunk_entry_name(ch)), "{names:?}");
    }
    // A second set on the same chunks publishes no chunk again.
    book.publish(
        &server,
        &arena,
        "weights2",
        record(1),
        hold(vec![b.lease()]),
        None,
    )
    .unwrap();
    assert_eq!(client(&server).list().unwrap().len(), 4);
    assert!(matches!(
        book.publish(
            &server,
            &arena,
            "weights",
            record(1),
            hold(vec![b.lease()]),
            None
        ),
        Err(Error::Channel(ChannelError::AlreadyExists { .. }))
    ));

    let consumer = client(&server);
    let set = consumer.attach("weights").unwrap();
    assert!(set.fds.is_empty(), "a set entry carries no descriptor");
    assert!(is_set_meta(&set.meta));
    let chunk = consumer.attach(&chunk_entry_name(a.chunk().id())).unwrap();
    assert_eq!(chunk.fds.len(), 1);
    assert_eq!(chunk.meta, json!({ "memfd": 1u64 << 20 }));
    // An update of the set reaches its holder as one notice.
    assert_eq!(server.update("weights", json!({})).unwrap(), 1);
    let u = consumer.next_update(Duration::from_secs(5)).unwrap();
    assert_eq!(u.lease, set.lease);
}

#[test]
fn large_records_travel_in_parts_that_rebuild_the_record() {
    let (_dir, server, arena, mut book) = setup();
    let buf = arena.alloc(4096).unwrap();
    // About the size of a record of 10,000 buffers, with multibyte names.
    let big = json!({ SET_VERSION_KEY: 1, "entries": (0..10_000).map(|i| format!("layer{i}.wéight")).collect::<Vec<_>>() });
    book.publish(
        &server,
        &arena,
        "big",
        big.clone(),
        hold(vec![buf.lease()]),
        None,
    )
    .unwrap();
    let consumer = client(&server);
    let a = consumer.attach("big").unwrap();
    assert!(is_set_meta(&a.meta));
    let parts = a.meta[PARTS_KEY].as_array().unwrap();
    assert!(parts.len() >= 2, "{} parts", parts.len());
    let mut text = String::new();
    for p in parts {
        let part = consumer.attach(p.as_str().unwrap()).unwrap();
        assert!(part.fds.is_empty());
        text.push_str(part.meta["text"].as_str().unwrap());
        consumer.release(part.lease).unwrap();
    }
    assert_eq!(a.meta["bytes"], text.len());
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), big);
    // Unpublishing the set takes its parts with it.
    book.unpublish(&server, "big").unwrap();
    let left: Vec<String> = consumer
        .list()
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert!(
        left.iter().all(|n| n.starts_with(".cuda-ipc/chunk/")),
        "{left:?}"
    );
}

/// A real set record of `n` entries over two chunks.
pub(in crate::exchange) fn set_record(n: usize) -> SetRecord {
    use crate::descriptor::{Descriptor, Source};
    use crate::device::DeviceUuid;
    use crate::set::SetChunk;
    let chunk = |id: u64, fd: i32| SetChunk {
        id,
        descriptor: Descriptor::new(Source::Vmm { fd }, 1 << 30, DeviceUuid([7; 16]), 4242)
            .with_generation(u64::from(fd.unsigned_abs())),
    };
    let entries = (0..n)
        .map(|i| SetEntry {
            name: format!("model.layers.{i}.mlp.weight"),
            dtype: Dtype::F32,
            shape: [64, 16][..].into(),
            chunk: (i % 2) as u64,
            offset: (i / 2) as u64 * 4096,
            len: 4096,
        })
        .collect();
    SetRecord::new(
        "weights".into(),
        crate::arena::ArenaId(99),
        if n == 1 {
            vec![chunk(0, 3)]
        } else {
            vec![chunk(0, 3), chunk(1, 4)]
        },
        entries,
    )
    .unwrap()
}

#[test]
fn set_records_of_1_to_10000_entries_come_back_whole_through_the_channel() {
    let (_dir, server, arena, mut book) = setup();
    let buf = arena.alloc(4096).unwrap();
    let consumer = client(&server);
    for n in [1, 100, 1000, 10_000] {
        let record = set_record(n);
        let name = format!("set{n}");
        book.publish(
            &server,
            &arena,
            &name,
            record.to_value(),
            hold(vec![buf.lease()]),
            None,
        )
        .unwrap();
        let a = consumer.attach(&name).unwrap();
        let parts = a
            .meta
            .get(PARTS_KEY)
            .map_or(0, |p| p.as_array().unwrap().len());
        assert_eq!(parts > 0, record.to_json().len() > SET_PART_BYTES, "{n}");
        // The largest set still travels in parts, so that path stays tested.
        assert!(n < 10_000 || parts > 0, "{n} entries in one message");
        assert_eq!(
            read_record(&consumer, &a.meta, None).unwrap(),
            record,
            "{n}"
        );
        consumer.release(a.lease).unwrap();
        book.unpublish(&server, &name).unwrap();
    }
    // Bad parts: not an array, a missing part, too many parts.
    for (meta, why) in [
        (json!({ PARTS_KEY: 5 }), "array"),
        (json!({ PARTS_KEY: ["nope"] }), "nope"),
        (
            json!({ PARTS_KEY: vec!["x"; MAX_PARTS + 1] }),
            "parts is more",
        ),
    ] {
        let e = read_record(&consumer, &meta, None).unwrap_err();
        assert!(e.to_string().contains(why), "{e}");
    }
}

#[test]
fn split_utf8_cuts_at_character_boundaries() {
    let s = "aé€😀".repeat(50);
    for max in [4, 5, 7, 100] {
        let parts = split_utf8(&s, max);
        assert!(parts.iter().all(|p| p.len() <= max && !p.is_empty()));
        assert_eq!(parts.concat(), s);
    }
    assert!(split_utf8("", 4).is_empty());
}

#[test]
fn ranges_come_back_after_release_and_unpublish_in_either_order() {
    let (_dir, server, arena, mut book) = setup();
    let a = arena.alloc(4096).unwrap();
    book.publish(&server, &arena, "s", record(1), hold(vec![a.lease()]), None)
        .unwrap();
    let consumer = client(&server);
    let lease = consumer.attach("s").unwrap().lease;
    drop(a);
    assert_eq!(arena.stats().held_by_leases_only, 1, "published: kept");
    book.unpublish(&server, "s").unwrap();
    assert_eq!(book.retired(), 1, "leased: kept");
    assert_eq!(arena.stats().buffers, 1);
    consumer.release(lease).unwrap();
    assert_eq!(book.reap(&server), 1);
    assert_eq!(arena.stats().buffers, 0, "{:?}", arena.stats());
    // Nothing maps the chunk any more: trim takes it and its hidden entry.
    assert_eq!(book.trim(&server, &arena), 1 << 20);
    assert_eq!(arena.stats().chunks, 0);
    assert!(consumer.list().unwrap().is_empty());
}

#[test]
fn a_mapped_chunk_is_not_trimmed_until_its_consumer_lets_go() {
    let (_dir, server, arena, mut book) = setup();
    let a = arena.alloc(4096).unwrap();
    book.publish(&server, &arena, "s", record(1), hold(vec![a.lease()]), None)
        .unwrap();
    let consumer = client(&server);
    let chunk = consumer.attach(&chunk_entry_name(a.chunk().id())).unwrap();
    book.unpublish(&server, "s").unwrap();
    drop(a);
    assert_eq!(arena.stats().buffers, 0);
    assert_eq!(book.trim(&server, &arena), 0, "the consumer maps the chunk");
    assert_eq!(arena.stats().chunks, 1);
    consumer.release(chunk.lease).unwrap();
    assert_eq!(book.trim(&server, &arena), 1 << 20);
}

const CHILD_ENV: &str = "CUDA_IPC_TEST_SET_HOLDER";

/// The consumer of [`a_consumer_killed_while_holding_a_set_gives_its_ranges_back`]:
/// attaches the set and its chunk, says so, and waits to be killed.
fn holder(socket: &str) {
    let c = Client::connect(socket, ClientConfig::default()).unwrap();
    let set = c.attach("weights").unwrap();
    let _chunks: Vec<_> = (0..2)
        .map(|i| {
            let id = ChunkId {
                arena: ArenaId(set.meta["arena"].as_u64().unwrap()),
                index: i,
            };
            c.attach(&chunk_entry_name(id)).unwrap()
        })
        .collect();
    println!("holding");
    std::thread::sleep(Duration::from_secs(60));
}

use crate::arena::{ArenaBuffer, ArenaId};

#[test]
fn a_consumer_killed_while_holding_a_set_gives_its_ranges_back() {
    if let Ok(socket) = std::env::var(CHILD_ENV) {
        holder(&socket);
        return;
    }
    let (_dir, server, arena, mut book) = setup();
    let bufs: Vec<_> = [700 << 10, 700 << 10, 4096]
        .iter()
        .map(|n| arena.alloc(*n).unwrap())
        .collect();
    let mut rec = record(3);
    rec["arena"] = arena.id().0.into();
    book.publish(
        &server,
        &arena,
        "weights",
        rec,
        hold(bufs.iter().map(ArenaBuffer::lease).collect()),
        None,
    )
    .unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "exchange::set_book::tests::a_consumer_killed_while_holding_a_set_gives_its_ranges_back",
            "--nocapture",
        ])
        .env(CHILD_ENV, server.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            std::io::BufRead::read_line(&mut out, &mut line).unwrap() > 0,
            "the holder exited early"
        );
        if line.contains("holding") {
            break;
        }
    }
    assert_eq!(server.leases().len(), 3, "{:?}", server.leases());
    // The producer lets go of everything; the holder keeps it all.
    book.unpublish(&server, "weights").unwrap();
    drop(bufs);
    assert_eq!(book.trim(&server, &arena), 0);
    assert_eq!(arena.stats().held_by_leases_only, 3);
    child.kill().unwrap();
    child.wait().unwrap();
    wait_until("the channel to end the dead consumer's leases", || {
        server.leases().is_empty()
    });
    assert_eq!(book.reap(&server), 1);
    assert_eq!(arena.stats().buffers, 0, "{:?}", arena.stats());
    assert_eq!(book.trim(&server, &arena), 2 << 20);
    assert_eq!(arena.stats().chunks, 0);
}

/// A set's fence as the publisher sends it, with a memfd for the block.
fn set_fence(slots: &std::sync::Arc<std::sync::Mutex<sync::Slots>>) -> SetFence {
    let slot = FenceSlot::take(slots).unwrap();
    let s = slot.slot();
    let fd = memfd_create("cuda-ipc-test-fence", MemfdFlags::CLOEXEC).unwrap();
    SetFence {
        meta: crate::exchange::wire::FenceMeta {
            block: crate::fence::FenceBlock::host(0, 42, 9, 16).unwrap(),
            fd: 0,
            word: 2 * s,
            announce: Some(2 * s + 1),
        },
        fd,
        slot,
    }
}

#[test]
fn a_set_fence_travels_beside_the_record_and_its_slot_outlives_the_last_lease() {
    let (_dir, server, arena, mut book) = setup();
    let slots = sync::Slots::new(4);
    let a = arena.alloc(4096).unwrap();
    let fence = set_fence(&slots);
    let word = fence.meta.word;
    book.publish(
        &server,
        &arena,
        "s",
        record(1),
        hold(vec![a.lease()]),
        Some(fence),
    )
    .unwrap();
    let slot_of = |book: &Book<MemChunks>, name| book.update_of(name).and_then(|(_, slot)| slot);
    assert_eq!(slot_of(&book, "s"), Some(word / 2));
    assert_eq!(slot_of(&book, "nope"), None);
    // A large record (in parts) carries its fence beside the parts too.
    let b = arena.alloc(4096).unwrap();
    let big = json!({ SET_VERSION_KEY: 1, "pad": "x".repeat(SET_PART_BYTES + 10) });
    book.publish(
        &server,
        &arena,
        "big",
        big.clone(),
        hold(vec![b.lease()]),
        Some(set_fence(&slots)),
    )
    .unwrap();
    assert_eq!(lock(&slots).in_use(), 2);

    let consumer = client(&server);
    for name in ["s", "big"] {
        let mut at = consumer.attach(name).unwrap();
        assert_eq!(
            at.fds.len(),
            1,
            "{name}: the fence block is the only descriptor"
        );
        let f = sync::take_set_fence(&mut at.meta).unwrap().unwrap();
        assert_eq!(f.fd, 0);
        assert!(is_set_meta(&at.meta), "{name}");
        // The record decodes strictly once the fence is off.
        if name == "s" {
            assert_eq!(at.meta, record(1));
            assert_eq!(f.word, word);
        } else {
            assert_eq!(read_record_text(&consumer, &at.meta), big.to_string());
        }
        if name == "big" {
            consumer.release(at.lease).unwrap();
        } else {
            // Keep the lease on "s": its slot must stay taken after unpublish.
            let lease = at.lease;
            book.unpublish(&server, "s").unwrap();
            assert_eq!(lock(&slots).in_use(), 2, "unpublished but leased: kept");
            consumer.release(lease).unwrap();
            assert_eq!(book.reap(&server), 1);
            assert_eq!(lock(&slots).in_use(), 1, "last lease ended: given back");
        }
    }
    book.unpublish(&server, "big").unwrap();
    book.reap(&server);
    assert_eq!(lock(&slots).in_use(), 0);
}

/// A record handed to the book with its text (as a publisher writes it,
/// the table copied in) travels as the same record as one handed as a
/// value: whole or in parts at the same sizes, its fence beside it; a
/// subscriber reads the record and the fence back.
#[test]
fn records_written_with_their_text_travel_as_their_values_do() {
    let (_dir, server, arena, mut book) = setup();
    let slots = sync::Slots::new(4);
    let buf = arena.alloc(4096).unwrap();
    let consumer = client(&server);
    // The size at which a record with a fence goes in parts, either way.
    let padded = |pad: usize| json!({ SET_VERSION_KEY: 1, "pad": "x".repeat(pad) });
    let mut records: Vec<(Value, String)> = [1, 1000, 10_000]
        .into_iter()
        .map(|n| {
            let r = set_record(n);
            (r.to_value(), r.to_json())
        })
        .collect();
    for pad in (SET_PART_BYTES - 300..SET_PART_BYTES - 100).step_by(25) {
        let v = padded(pad);
        records.push((v.clone(), v.to_string()));
    }
    for (i, (value, text)) in records.into_iter().enumerate() {
        for with_fence in [false, true] {
            let fence = || with_fence.then(|| set_fence(&slots));
            let (by_value, by_text) = (format!("v{i}{with_fence}"), format!("t{i}{with_fence}"));
            book.publish(
                &server,
                &arena,
                &by_value,
                value.clone(),
                hold(vec![buf.lease()]),
                fence(),
            )
            .unwrap();
            let written = RecordJson {
                value: value.clone(),
                text: text.clone(),
            };
            book.publish(
                &server,
                &arena,
                &by_text,
                written,
                hold(vec![buf.lease()]),
                fence(),
            )
            .unwrap();
            let mut a = consumer.attach(&by_value).unwrap();
            let mut b = consumer.attach(&by_text).unwrap();
            let (fa, fb) = (
                sync::take_set_fence(&mut a.meta).unwrap(),
                sync::take_set_fence(&mut b.meta).unwrap(),
            );
            assert_eq!(
                (fa.is_some(), fb.is_some()),
                (with_fence, with_fence),
                "{i}"
            );
            assert_eq!(
                a.meta.get(PARTS_KEY).is_some(),
                b.meta.get(PARTS_KEY).is_some(),
                "{i} {with_fence}: whole or in parts alike"
            );
            let back = if b.meta.get(PARTS_KEY).is_some() {
                serde_json::from_str(&read_record_text(&consumer, &b.meta)).unwrap()
            } else {
                b.meta.clone()
            };
            assert_eq!(back, value, "{i} {with_fence}");
            for (at, name) in [(a, &by_value), (b, &by_text)] {
                consumer.release(at.lease).unwrap();
                book.unpublish(&server, name).unwrap();
            }
            book.reap(&server);
        }
    }
    assert_eq!(lock(&slots).in_use(), 0);
}

/// The text of a record that travelled in parts.
fn read_record_text(consumer: &Client, meta: &Value) -> String {
    let mut text = String::new();
    for p in meta[PARTS_KEY].as_array().unwrap() {
        let a = consumer.attach(p.as_str().unwrap()).unwrap();
        text.push_str(a.meta["text"].as_str().unwrap());
        consumer.release(a.lease).unwrap();
    }
    text
}

/// The publisher's read-only policy travels in the record, in one message
/// and in parts, and makes the subscriber map read-only whatever it asked.
#[test]
fn the_read_only_policy_comes_back_with_the_record() {
    use crate::Access;
    use crate::exchange::set_attach::set_access;
    let (_dir, server, arena, mut book) = setup();
    let buf = arena.alloc(4096).unwrap();
    let consumer = client(&server);
    for n in [2, 10_000] {
        let mut record = set_record(n);
        record.read_only = true;
        let name = format!("ro{n}");
        book.publish(
            &server,
            &arena,
            &name,
            record.to_value(),
            hold(vec![buf.lease()]),
            None,
        )
        .unwrap();
        let a = consumer.attach(&name).unwrap();
        assert_eq!(a.meta.get(PARTS_KEY).is_some(), n == 10_000, "{n}");
        let back = read_record(&consumer, &a.meta, None).unwrap();
        assert!(back.read_only, "{n}");
        assert_eq!(back, record);
        assert_eq!(set_access(&back, Access::ReadWrite), Access::ReadOnly);
        assert_eq!(set_access(&back, Access::ReadOnly), Access::ReadOnly);
        consumer.release(a.lease).unwrap();
        book.unpublish(&server, &name).unwrap();
    }
    // Without the policy, the subscriber's wish decides.
    let plain = set_record(2);
    assert_eq!(set_access(&plain, Access::ReadWrite), Access::ReadWrite);
    assert_eq!(set_access(&plain, Access::ReadOnly), Access::ReadOnly);
}
