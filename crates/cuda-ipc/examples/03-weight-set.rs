//! 03: a model's tensors as one set: buffers of the publisher's arena
//! (exported once per chunk, not per buffer) handed off in one message,
//! then updated in place with one event for the whole set.
//!
//! ```text
//! cargo run --release -p cuda-ipc --example 03-weight-set
//! ```

mod common;

use std::time::Duration;

use cuda_ipc::arena::SetMember;
use cuda_ipc::exchange::{Publisher, PublisherConfig, Subscriber, SubscriberConfig};
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::{Device, DeviceMemory, Dtype};

fn main() -> std::process::ExitCode {
    common::main("03-weight-set", || {
        let device = Device::open(0)?;
        if let Some((_, socket)) = common::role() {
            let subscriber =
                Subscriber::connect(&device, socket.as_str(), SubscriberConfig::default())?;
            let set = subscriber.attach_set("weights")?; // one lease; each chunk mapped once
            let weight = set.get::<u32>("fc.weight")?; // a typed view
            println!("consumer: fc.weight {:?}...", &weight.to_vec::<u32>()?[..4]);
            let version = subscriber.wait_set_update(&set, Duration::from_secs(10))?;
            println!(
                "consumer: version {version}: {:?}...",
                &weight.to_vec::<u32>()?[..4]
            );
            drop(weight);
            return subscriber.release_set(set);
        }
        let socket = format!("example-03-{}", std::process::id());
        let publisher = Publisher::bind(&device, socket.as_str(), PublisherConfig::default())?;
        let (w, b) = (publisher.alloc(4 << 20)?, publisher.alloc(4 << 10)?); // no export
        kernels::fill_u32(&w, Pattern::ramp(0, 1), Speed::Full)?;
        kernels::fill_u32(&b, Pattern::ramp(0, 0), Speed::Full)?;
        let members = [
            SetMember::new("fc.weight", Dtype::U32, &[1024, 1024], &w),
            SetMember::new("fc.bias", Dtype::U32, &[1024], &b),
        ];
        publisher.publish_set("weights", &members)?; // one entry, one event
        let mut consumer = common::Second::start("consumer", &socket)?;
        consumer.line()?; // it has attached and read the first version
        kernels::fill_u32(&w, Pattern::ramp(100, 1), Speed::Full)?; // new values, in place
        publisher.update_set("weights")?; // one event and one notice for the whole set
        consumer.wait()?;
        publisher.unpublish_set("weights", Some(Duration::from_secs(10)))
    })
}
