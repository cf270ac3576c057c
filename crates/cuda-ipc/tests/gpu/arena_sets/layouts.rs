//! Sets on every chunk mechanism, members that are byte ranges of one
//! buffer, a set ordered after another library's stream, and a layout
//! published again with one member changed.

use std::time::{Duration, Instant};

use cuda_ipc::arena::SetMember;
use cuda_ipc::exchange::Sharing;
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::set::weight_sizes;
use cuda_ipc::{Device, DeviceMemory, Dtype};
use serde_json::{Value, json};

use super::super::common::{queued_fill, stream_done};
use crate::test_name;

use super::*;

/// For each chunk mechanism: a set of 100 buffers attached and checked, an
/// arena buffer attached with the per-buffer API, an update in place seen
/// by the consumer after its event, release, unpublish, trim.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn sets_on_every_chunk_mechanism() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        for m in mechanisms(&device) {
            let dir = socket_dir();
            let publisher = publisher_on(&device, dir.path(), Sharing::arena(m));
            let sizes = weight_sizes(100, 64 * MIB, 1).unwrap();
            let set = Set::new(&publisher, &sizes, 11);
            set.publish(&publisher, "weights");
            let single = publisher.alloc(3 * MIB).unwrap();
            kernels::fill_u32(&single, pattern(77, 0), Speed::Full).unwrap();
            publisher
                .publish_buffer("one", &single, Dtype::U32, &[3 * MIB / 4])
                .unwrap();
            let mut p = spawn(
                &test_name!("sets_on_every_chunk_mechanism"),
                publisher.path(),
            );
            let r = ask(
                &mut p,
                &json!({ "op": "attach_set", "name": "weights", "base": 11 }),
            );
            assert_eq!(r["len"], 100, "{m}");
            let chunks = publisher.arena().unwrap().stats().chunks as u64;
            assert_eq!(r["opens"], chunks, "{m}: each chunk mapped once");
            let r = ask(
                &mut p,
                &json!({ "op": "attach_buffer", "name": "one", "base": 77 }),
            );
            drop(r);
            // Update in place: new contents, one event for the set.
            set.fill(12);
            assert_eq!(publisher.update_set("weights").unwrap(), 1);
            let r = ask(&mut p, &json!({ "op": "wait_update", "base": 12 }));
            assert_eq!(r["version"], 1, "{m}");
            ask(&mut p, &json!({ "op": "release" }));
            // The same layout again under another name: the subscriber
            // reuses the entry table it read, and the values are right.
            set.publish(&publisher, "weights-again");
            let r = ask(
                &mut p,
                &json!({ "op": "attach_set", "name": "weights-again", "base": 12 }),
            );
            assert_eq!(
                (r["len"].clone(), r["table_hits"].clone()),
                (json!(100), json!(1)),
                "{m}"
            );
            // ... and the publisher described it from the layout it kept.
            assert_eq!(publisher.set_layouts().hits(), 1, "{m}");
            ask(&mut p, &json!({ "op": "release" }));
            for name in ["weights", "weights-again", "one"] {
                publisher
                    .unpublish_set(name, Some(Duration::from_secs(10)))
                    .unwrap();
            }
            p.send(&json!({ "op": "exit" }));
            assert!(p.finish(), "{m}: the child failed");
            drop(set);
            drop(single);
            let stats = publisher.arena().unwrap().stats();
            assert_eq!(stats.buffers, 0, "{m}: {stats:?}");
            // The child has exited, but the publisher learns that it let go
            // of the chunks a moment later (its hang-up is read on the
            // server's thread): wait for that, within bounds.
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut trimmed = publisher.trim().unwrap();
            while trimmed == 0 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
                trimmed = publisher.trim().unwrap();
            }
            assert!(trimmed > 0, "{m}");
            println!("{m}: set of 100 buffers, update and per-buffer attach checked");
        }
    });
}

/// Members that are byte ranges of one arena buffer (what a caching
/// allocator on the arena makes of its segments): the consumer sees each
/// range's own values; a range past the buffer's end or off its dtype's
/// alignment is refused before anything is published.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn members_that_are_byte_ranges_of_one_buffer() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        let m = mechanisms(&device)[0];
        let dir = socket_dir();
        let publisher = publisher_on(&device, dir.path(), Sharing::arena(m));
        let buffer = publisher.alloc(4 * MIB).unwrap();
        kernels::fill_u32(&buffer, Pattern { base: 5, step: 1 }, Speed::Full).unwrap();
        // (name, offset in bytes, elements)
        let ranges: [(&str, u64, u64); 3] = [
            ("head", 0, 256),
            ("middle", 4096 + 512, 1000),
            ("tail", 4 * MIB - 1024, 256),
        ];
        let shapes: Vec<[u64; 1]> = ranges.iter().map(|r| [r.2]).collect();
        let members: Vec<SetMember<'_>> = ranges
            .iter()
            .zip(&shapes)
            .map(|((name, offset, _), shape)| {
                SetMember::new(name, Dtype::U32, shape, &buffer).at(*offset)
            })
            .collect();
        for (offset, elements, what) in [
            (2, 1, "not a multiple"),
            (4 * MIB - 1020, 256, "does not fit"),
        ] {
            let e = publisher
                .publish_set(
                    "bad",
                    &[SetMember::new("w", Dtype::U32, &[elements], &buffer).at(offset)],
                )
                .unwrap_err();
            assert!(e.to_string().contains(what), "{e}");
        }
        publisher.publish_set("ranges", &members).unwrap();
        let mut p = spawn(
            &test_name!("members_that_are_byte_ranges_of_one_buffer"),
            publisher.path(),
        );
        let patterns: Vec<Value> = ranges
            .iter()
            .map(|(_, offset, _)| json!([5 + offset / 4, 1]))
            .collect();
        let r = ask(
            &mut p,
            &json!({ "op": "attach_ranges", "name": "ranges", "patterns": patterns }),
        );
        assert_eq!(r["len"], 3);
        assert!(
            buffer.leases() > 0,
            "the published ranges hold their buffer"
        );
        ask(&mut p, &json!({ "op": "release" }));
        publisher
            .unpublish_set("ranges", Some(Duration::from_secs(10)))
            .unwrap();
        p.send(&json!({ "op": "exit" }));
        assert!(p.finish(), "the child failed");
        println!("{m}: three byte ranges of one buffer published and checked");
    });
}

/// A set written on a stream the library does not know (a raw stream
/// standing in for PyTorch's, borrowed with `Device::borrow_stream`) is
/// published and updated after it (`publish_set_after`,
/// `update_set_after`), then updated after the legacy default stream
/// (handle 1, which `borrow_stream` takes without asking the driver): each
/// call returns with the writes still queued behind 300 ms of the stream's
/// time, and the consumer's attach and waits see every byte written.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_set_ordered_after_a_borrowed_stream() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        let m = mechanisms(&device)[0];
        let dir = socket_dir();
        let publisher = publisher_on(&device, dir.path(), Sharing::arena(m));
        let buffer = publisher.alloc(64 * MIB).unwrap();
        kernels::fill_u32(&buffer, Pattern { base: 5, step: 1 }, Speed::Full).unwrap();
        let words = [16 * MIB];
        let members = [SetMember::new("w", Dtype::U32, &words, &buffer)];
        let writer = device.context().new_stream().unwrap();
        // The writer's fills come after the one above, on the arena's stream.
        writer.join(buffer.stream()).unwrap();
        // SAFETY: the handles of a stream this test holds, and the legacy
        // default stream.
        let borrowed = unsafe { device.borrow_stream(writer.cu_stream() as u64) }.unwrap();
        unsafe { device.borrow_stream(0) }.unwrap();
        queued_fill(&writer, &buffer, 0x11);
        publisher
            .publish_set_after("w", &members, &borrowed)
            .unwrap();
        assert!(
            !stream_done(&writer),
            "publish_set_after waited for the writer's stream"
        );
        let mut p = spawn(
            &test_name!("a_set_ordered_after_a_borrowed_stream"),
            publisher.path(),
        );
        ask(
            &mut p,
            &json!({ "op": "attach_ranges", "name": "w", "patterns": [[0x1111_1111u32, 0]] }),
        );
        // Each update: a fill queued on `stream` behind 300 ms, the update
        // ordered after it returning at once, the consumer seeing the fill.
        let mut update_after = |stream: &cudarc::driver::CudaStream, byte: u8, version: u64| {
            queued_fill(stream, &buffer, byte);
            assert_eq!(publisher.update_set_after("w", stream).unwrap(), version);
            assert!(
                !stream_done(stream),
                "update_set_after waited for the stream ({version})"
            );
            let word = u32::from_ne_bytes([byte; 4]);
            let r = ask(
                &mut p,
                &json!({ "op": "wait_ranges", "patterns": [[word, 0]] }),
            );
            assert_eq!(r["version"], version);
        };
        update_after(&borrowed, 0x22, 1);
        // The special handles name the context's default streams without a
        // driver check: an update ordered after the legacy default stream
        // (where the writer's fills are done: the consumer saw them).
        // SAFETY: special handles, live with the context.
        let legacy = unsafe { device.borrow_stream(1) }.unwrap();
        unsafe { device.borrow_stream(2) }.unwrap();
        update_after(&legacy, 0x33, 2);
        ask(&mut p, &json!({ "op": "release" }));
        publisher
            .unpublish_set("w", Some(Duration::from_secs(10)))
            .unwrap();
        p.send(&json!({ "op": "exit" }));
        assert!(p.finish(), "the child failed");
        println!(
            "{m}: a publish and two updates after borrowed streams' queued writes (a stream of \
             its own, the legacy default stream), checked"
        );
    });
}

/// A set published again with the members of one before shares the
/// layout the publisher kept; one member changed (its shape) is a new
/// layout, which the consumer sees; the first layout again is found again.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_layout_published_again_and_one_member_changed() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        let dir = socket_dir();
        let publisher = publisher_on(&device, dir.path(), Sharing::auto());
        let sizes = weight_sizes(100, 64 * MIB, 3).unwrap();
        let mut set = Set::new(&publisher, &sizes, 21);
        let elements = |set: &Set| set.shapes.iter().map(|s| s[0]).sum::<u64>();
        let full = elements(&set);
        set.publish(&publisher, "v1");
        let hits = publisher.set_layouts().hits();
        set.publish(&publisher, "v2");
        assert_eq!(publisher.set_layouts().hits(), hits + 1, "the same layout");
        let whole = set.shapes[7];
        set.shapes[7] = [whole[0] / 2];
        set.publish(&publisher, "v3");
        assert_eq!(publisher.set_layouts().hits(), hits + 1, "a member changed");
        let half = elements(&set);
        set.shapes[7] = whole;
        set.publish(&publisher, "v4");
        assert_eq!(publisher.set_layouts().hits(), hits + 2, "the first again");
        let mut p = spawn(
            &test_name!("a_layout_published_again_and_one_member_changed"),
            publisher.path(),
        );
        for (name, want) in [("v1", full), ("v2", full), ("v3", half), ("v4", full)] {
            let r = ask(
                &mut p,
                &json!({ "op": "attach_set", "name": name, "base": 21 }),
            );
            assert_eq!(
                (r["len"].clone(), r["elements"].clone(), r["bad"].clone()),
                (json!(100), json!(want), Value::Null),
                "{name}"
            );
            ask(&mut p, &json!({ "op": "release" }));
        }
        for name in ["v1", "v2", "v3", "v4"] {
            publisher
                .unpublish_set(name, Some(Duration::from_secs(10)))
                .unwrap();
        }
        p.send(&json!({ "op": "exit" }));
        assert!(p.finish(), "the child failed");
        println!(
            "a layout published again shared, one member changed seen: {full} and {half} elements"
        );
    });
}
