//! 04: a stream of frames through a ring of shared buffers: the producer
//! fills a free slot and publishes it, the consumer reads it and acks, and
//! the slot comes back for the next frame (back-pressure, no copy).
//!
//! ```text
//! cargo run --release -p cuda-ipc --example 04-ring
//! ```

mod common;

use std::time::Duration;

use cuda_ipc::exchange::{Publisher, PublisherConfig, Subscriber, SubscriberConfig};
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::{Device, DeviceMemory};

const FRAMES: u32 = 1000;

fn main() -> std::process::ExitCode {
    common::main("04-ring", || {
        let device = Device::open(0)?;
        if let Some((_, socket)) = common::role() {
            let subscriber =
                Subscriber::connect(&device, socket.as_str(), SubscriberConfig::default())?;
            let ring = subscriber.attach_ring::<u32>("frames")?; // every slot mapped once
            println!("consumer: attached");
            for _ in 0..FRAMES {
                let frame = subscriber.next_frame(&ring, Duration::from_secs(10))?;
                if frame.seq % 250 == 0 {
                    println!(
                        "consumer: frame {} starts with {:?}",
                        frame.seq,
                        &frame.buffer.to_vec::<u32>()?[..2]
                    );
                }
                subscriber.ack(&ring, frame)?; // the slot goes back to the producer
            }
            return subscriber.release_ring(ring);
        }
        let socket = format!("example-04-{}", std::process::id());
        let publisher = Publisher::bind(&device, socket.as_str(), PublisherConfig::default())?;
        let ring = publisher.ring("frames", 8, 1 << 20, None)?; // 8 slots of 1 MiB
        let mut consumer = common::Second::start("consumer", &socket)?;
        consumer.line()?; // it has attached
        for n in 1..=FRAMES {
            let (slot, buffer) = ring.acquire(Some(Duration::from_secs(10)))?; // waits for a free slot
            kernels::fill_u32(buffer, Pattern::ramp(n, 0), Speed::Full)?;
            ring.publish(slot)?; // an event after the fill, and a notice
        }
        consumer.wait()
    })
}
