//! 06: push, not pull: a producer (a prefill process) writes KV-cache
//! blocks into its arena and pushes each to a stream as it is done; a
//! consumer (a decode process) takes them as they come, without asking,
//! reads them and lets go. Each hand-off is timed, producer's clock to the
//! consumer's, on one machine's clock.
//!
//! ```text
//! cargo run --release -p cuda-ipc --example 06-push
//! ```

mod common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use cuda_ipc::arena::SetMember;
use cuda_ipc::exchange::{Publisher, PublisherConfig, Subscriber, SubscriberConfig};
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::{Device, DeviceMemory, Dtype};

const BLOCKS: u64 = 200;
const BLOCK_BYTES: u64 = 256 << 10;

/// Microseconds on a clock both processes share.
fn now_us() -> f64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as f64 * 1e6 + t.tv_nsec as f64 / 1e3
}

fn main() -> std::process::ExitCode {
    common::main("06-push", || {
        let device = Device::open(0)?;
        if let Some((_, socket)) = common::role() {
            // The consumer: subscribes, then takes every block pushed.
            let sub = Subscriber::connect(&device, socket.as_str(), SubscriberConfig::default())?;
            let stream = sub.subscribe("kv")?;
            println!("consumer: subscribed");
            let mut us = Vec::new();
            for i in 0..BLOCKS {
                let block = sub.next_pushed_set(&stream, Duration::from_secs(30))?;
                device.synchronize()?;
                let view = block.view::<u32>(0)?;
                let first = view.region(0, 4)?.to_vec::<u32>()?[0];
                let sent: f64 = block
                    .name()
                    .rsplit('@')
                    .next()
                    .unwrap_or("0")
                    .parse()
                    .unwrap_or(0.0);
                us.push(now_us() - sent);
                assert_eq!(first, i as u32 * 1000, "block {i} holds another's bytes");
                drop(view);
                sub.release_set(block)?;
            }
            us.sort_by(f64::total_cmp);
            println!(
                "consumer: {BLOCKS} blocks of {} KiB taken; hand-off p50 {:.1} us, p99 {:.1} us",
                BLOCK_BYTES >> 10,
                us[us.len() / 2],
                us[us.len() * 99 / 100]
            );
            sub.unsubscribe(stream)?;
            return Ok(());
        }
        let nonce = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let socket = format!("example-06-{}-{nonce:x}", std::process::id());
        let publisher = Publisher::bind(&device, socket.as_str(), PublisherConfig::default())?;
        publisher.publish_stream("kv")?;
        let mut consumer = common::Second::start("consumer", &socket)?;
        consumer.line()?; // subscribed
        for i in 0..BLOCKS {
            let block = publisher.alloc(BLOCK_BYTES)?; // from the arena: no export
            kernels::fill_u32(&block, Pattern::ramp(i as u32 * 1000, 1), Speed::Full)?;
            block.synchronize()?;
            // The name carries the time it was pushed, for the consumer's clock.
            let name = format!("block.{i}@{:.3}", now_us());
            let shape = [BLOCK_BYTES / 4];
            publisher.publish_set(&name, &[SetMember::new("k", Dtype::U32, &shape, &block)])?;
            publisher.push_set(&name, "kv")?; // the consumer holds it from now on
            publisher.unpublish_set(&name, None)?; // its memory goes back once released
            // A prefill makes its blocks over time: one a millisecond here.
            std::thread::sleep(Duration::from_millis(1));
        }
        consumer.wait()?;
        println!("producer: {BLOCKS} blocks pushed");
        Ok(())
    })
}
