//! 02: a buffer published by name on a Unix socket (the channel): the
//! channel carries the handles, checks the peer's user, and hands out a
//! lease that keeps the memory until the consumer releases it.
//!
//! ```text
//! cargo run --release -p cuda-ipc --example 02-channel
//! ```

mod common;

use std::time::Duration;

use cuda_ipc::exchange::{Publisher, PublisherConfig, Subscriber, SubscriberConfig};
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::share::SharedBuffer;
use cuda_ipc::{Device, DeviceMemory, Dtype};

fn main() -> std::process::ExitCode {
    common::main("02-channel", || {
        let device = Device::open(0)?;
        if let Some((_, socket)) = common::role() {
            // The consumer: attach (mapped; its stream waits on the publish
            // event), read, release.
            let subscriber =
                Subscriber::connect(&device, socket.as_str(), SubscriberConfig::default())?;
            let weights = subscriber.attach::<u32>("weights")?;
            println!("consumer: {:?}...", &weights.buffer().to_vec::<u32>()?[..4]);
            return subscriber.release(weights);
        }
        // A socket of our own, in a directory only this user can open.
        let socket = format!("example-02-{}", std::process::id());
        let publisher = Publisher::bind(&device, socket.as_str(), PublisherConfig::default())?;
        let buffer = SharedBuffer::alloc(&device, 64 << 20, None)?;
        kernels::fill_u32(&buffer, Pattern::ramp(0, 1), Speed::Full)?;
        publisher.publish("weights", buffer, Dtype::U32, None)?; // an event after the fill
        common::Second::start("consumer", &socket)?.wait()?;
        // Taken back once every lease is released (here: at once).
        publisher.unpublish("weights", Some(Duration::from_secs(10)))?;
        println!("producer: the buffer is ours again");
        Ok(())
    })
}
