//! Legacy IPC handles and events across processes.

use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::share::{self, SharedBuffer};
use cuda_ipc::{
    Device, DeviceMemory, Dtype, Error, IpcEvent, LegacyBuffer, LegacyMapping, Mechanism, OpenFlags,
};
use serde_json::{Value, json};

use super::common::Peer;
use super::consumer::{self, pattern_json};
use crate::{assert_ok, test_name};

const MIB: usize = 1 << 20;

fn child_or(f: impl FnOnce()) {
    super::common::child_or("consumer", consumer::serve, f);
}

/// Producer writes, consumer checks and transforms, producer checks the
/// transform: both directions through one legacy mapping, ordered by events.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn round_trip_both_directions() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        let buf = LegacyBuffer::alloc(&device, 64 * MIB).unwrap();
        assert_eq!(buf.alloc_size(), 64 * MIB as u64);
        let p = Pattern::ramp(0xA000_0000, 3);
        kernels::fill_u32(&buf, p, Speed::Full).unwrap();
        let ready = IpcEvent::new(&device).unwrap();
        ready.record(buf.stream()).unwrap();
        let e = buf.export().unwrap();
        assert_eq!((e.offset, e.len), (0, 64 * MIB as u64));
        let descriptor = cuda_ipc::Descriptor::new(
            cuda_ipc::descriptor::Source::Legacy { handle: e.handle },
            e.alloc_size,
            device.uuid(),
            std::process::id(),
        )
        .with_range(0, e.len)
        .with_dtype(Dtype::U32)
        .with_event(ready.handle().unwrap());
        let mut peer = Peer::spawn(&test_name!("round_trip_both_directions"), "consumer");
        peer.send(&json!({ "op": "open", "descriptor": descriptor.to_value(), "expect": pattern_json(p), "transform": [5, 7] }));
        let r = peer.recv();
        assert_ok!(&r, "consumer saw producer's data wrong: {r}");
        let done = IpcEvent::open(&device, r["event"].as_str().unwrap().parse().unwrap()).unwrap();
        done.wait_on(buf.stream()).unwrap();
        assert_eq!(
            kernels::check_u32(&buf, p.mapped(5, 7)).unwrap(),
            None,
            "producer saw consumer's writes wrong"
        );
        peer.send(&json!({ "op": "exit" }));
        assert!(peer.finish());
    });
}

/// Exports at offsets inside one allocation: the handle names the whole
/// allocation and the offset travels separately.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn offsets_inside_an_allocation() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        let buf = SharedBuffer::alloc(&device, 8 * MIB, Some(Mechanism::Legacy)).unwrap();
        let whole = Pattern::ramp(0, 1);
        kernels::fill_u32(&buf, whole, Speed::Full).unwrap();
        buf.synchronize().unwrap();
        let mut peer = Peer::spawn(&test_name!("offsets_inside_an_allocation"), "consumer");
        let mut handles = Vec::new();
        for (offset, len) in [
            (0u64, 4096u64),
            (4096, 4096),
            (MIB as u64 + 4, 4 * MIB as u64),
            (8 * MIB as u64 - 4, 4),
        ] {
            let e = buf.export_region(offset, len, Dtype::U32, None).unwrap();
            assert_eq!(e.descriptor.offset, offset);
            handles.push(e.descriptor.source);
            peer.send(&json!({ "op": "open", "descriptor": e.descriptor.to_value(), "expect": pattern_json(whole.skip(offset / 4)) }));
            let r = peer.recv();
            assert_ok!(&r, "region {offset}+{len}: {r}");
        }
        assert!(
            handles.windows(2).all(|w| w[0] == w[1]),
            "one allocation, one handle"
        );
        // A raw cuMemAlloc pointer (cudarc's synchronous allocator), exported from its middle.
        let raw = unsafe { cuda_ipc::cudarc::driver::result::malloc_sync(4 * MIB) }.unwrap();
        let ramp = Pattern::ramp(0x5555_0000, 1);
        let words: Vec<u32> = (0..(MIB as u64)).map(|i| ramp.at(i)).collect();
        unsafe { cuda_ipc::cudarc::driver::result::memcpy_htod_sync(raw, &words) }.unwrap();
        let e =
            share::export_pointer(&device, raw + 2 * MIB as u64, MIB as u64, Dtype::U32).unwrap();
        assert_eq!(e.descriptor.offset, 2 * MIB as u64);
        assert_eq!(e.descriptor.alloc_size, 4 * MIB as u64);
        assert_eq!(e.descriptor.mechanism(), Mechanism::Legacy);
        peer.send(&json!({ "op": "open", "descriptor": e.descriptor.to_value(), "expect": pattern_json(ramp.skip(2 * MIB as u64 / 4)) }));
        let r = peer.recv();
        assert_ok!(&r, "raw pointer at an offset: {r}");
        peer.send(&json!({ "op": "close" }));
        let _ = peer.recv();
        peer.send(&json!({ "op": "exit" }));
        assert!(peer.finish());
        unsafe { cuda_ipc::cudarc::driver::result::free_sync(raw) }.unwrap();
    });
}

/// Typed views: casts, slices, alignment, writes through one view seen by
/// another, and cudarc's copies through our DevicePtr implementation.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn typed_views() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        let buf = SharedBuffer::alloc(&device, 2 * MIB, Some(Mechanism::Legacy)).unwrap();
        kernels::fill_u32(&buf, Pattern::ramp(0, 1), Speed::Full).unwrap();
        buf.synchronize().unwrap();
        let e = buf
            .export_region(0, 2 * MIB as u64, Dtype::U8, None)
            .unwrap();
        let mut peer = Peer::spawn(&test_name!("typed_views"), "consumer");
        peer.send(&json!({ "op": "typed", "descriptor": e.descriptor.to_value() }));
        let r = peer.recv();
        assert_eq!(r["ok"], true, "{r}");
        // The consumer wrote 7, 8, 9, 10 into the first words.
        assert_eq!(&buf.to_vec::<u32>().unwrap()[..5], &[7, 8, 9, 10, 4]);
        peer.send(&json!({ "op": "exit" }));
        assert!(peer.finish());
    });
}

/// A slow writer and an event: the consumer that waits on the producer's
/// event never sees a half-written buffer. The consumer also checks once
/// without waiting, to show that the race is real (reported, not asserted:
/// the hardware decides whether it shows).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn events_order_producer_before_consumer() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        let mut peer = Peer::spawn(
            &test_name!("events_order_producer_before_consumer"),
            "consumer",
        );
        let mut races = 0;
        for round in 0..5u32 {
            let buf = SharedBuffer::alloc(&device, 64 * MIB, Some(Mechanism::Legacy)).unwrap();
            kernels::fill_u32(&buf, Pattern::constant(0), Speed::Full).unwrap();
            buf.synchronize().unwrap();
            let p = Pattern::ramp(round << 24, 1);
            // One block of 32 threads writing 16 Mi words: tens of milliseconds.
            kernels::fill_u32(&buf, p, Speed::Slow).unwrap();
            let ready = IpcEvent::new(&device).unwrap();
            ready.record(buf.stream()).unwrap();
            let e = buf
                .export_region(0, 64 * MIB as u64, Dtype::U32, None)
                .unwrap();
            peer.send(&json!({ "op": "race", "descriptor": e.descriptor.to_value(), "event": ready.handle().unwrap().to_string(), "expect": pattern_json(p) }));
            let r = peer.recv();
            assert_eq!(
                r["waited_bad"],
                Value::Null,
                "round {round}: consumer saw a half-written buffer after waiting: {r}"
            );
            if !r["unwaited_bad"].is_null() {
                races += 1;
            }
            buf.synchronize().unwrap();
        }
        println!(
            "without waiting on the event the consumer saw unfinished data in {races} of 5 rounds"
        );
        peer.send(&json!({ "op": "exit" }));
        assert!(peer.finish());
    });
}

/// Opening a handle in the process that exported it is a clear error.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn same_process_open_is_a_clear_error() {
    let device = Device::open(0).unwrap();
    let buf = LegacyBuffer::alloc(&device, 4096).unwrap();
    let e = buf.export().unwrap();
    let err = LegacyMapping::open(&device, e.handle, OpenFlags::NONE).unwrap_err();
    assert!(matches!(err, Error::SameProcess), "{err}");
    assert!(err.to_string().contains("same process"), "{err}");
}

/// Stream-ordered memory (cudarc's default allocator) cannot be exported
/// with a legacy handle, and the error says what to use instead.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn stream_ordered_memory_gets_a_clear_error() {
    let device = Device::open(0).unwrap();
    let slice = device.stream().alloc_zeros::<u32>(1 << 20).unwrap();
    let (ptr, _sync) = cuda_ipc::cudarc::driver::DevicePtr::device_ptr(&slice, device.stream());
    let err = cuda_ipc::legacy::export_pointer(&device, ptr, 4096).unwrap_err();
    assert!(matches!(err, Error::StreamOrdered { .. }), "{err}");
    let err = share::export_pointer(&device, ptr, 4096, Dtype::U32).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("SharedPool") && text.contains("default pool"),
        "{text}"
    );
}

/// A handle whose memory the exporter freed, and 64 random handles: each is
/// an error in the consumer, never a crash.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn freed_and_random_handles_are_errors() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        let buf = LegacyBuffer::alloc(&device, 2 * MIB).unwrap();
        let freed = buf.export().unwrap().handle;
        drop(buf);
        let mut handles = vec![freed.to_string()];
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..64 {
            let mut bytes = [0u8; 64];
            for b in &mut bytes {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                *b = state as u8;
            }
            handles.push(cuda_ipc::IpcMemHandle::from(bytes).to_string());
        }
        let mut peer = Peer::spawn(
            &test_name!("freed_and_random_handles_are_errors"),
            "consumer",
        );
        peer.send(&json!({ "op": "handles", "handles": handles }));
        let r = peer.recv();
        let results = r["results"].as_array().unwrap();
        assert_eq!(results.len(), 65);
        for (i, res) in results.iter().enumerate() {
            let text = res.as_str().unwrap();
            assert_ne!(text, "opened", "handle {i} opened");
            assert!(text.contains("cuIpcOpenMemHandle"), "handle {i}: {text}");
        }
        println!("freed handle: {}", results[0]);
        // Without the flag the driver refuses even a live handle, and the error says which flag fixes it.
        let live = LegacyBuffer::alloc(&device, 2 * MIB).unwrap();
        peer.send(
            &json!({ "op": "open_without_flag", "handle": live.export().unwrap().handle.to_string() }),
        );
        let r = peer.recv();
        let text = r["error"]
            .as_str()
            .expect("open without the flag must fail");
        assert!(text.contains("LAZY_ENABLE_PEER_ACCESS"), "{text}");
        peer.send(&json!({ "op": "exit" }));
        assert!(peer.finish(), "the consumer crashed");
    });
}
