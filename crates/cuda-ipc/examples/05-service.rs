//! 05: the weight service: a process that owns a set's memory. A writer
//! (another process) creates the set, fills it and commits, then exits; the
//! weights stay, and a reader (a third process) maps them read-only.
//!
//! ```text
//! cargo run --release -p cuda-ipc --example 05-service
//! ```

mod common;

use std::time::Duration;

use cuda_ipc::exchange::{Subscriber, SubscriberConfig};
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::service::admin::TensorSpec;
use cuda_ipc::service::{Service, ServiceConfig, Writer};
use cuda_ipc::{Device, DeviceMemory, Dtype};

fn main() -> std::process::ExitCode {
    common::main("05-service", || {
        let device = Device::open(0)?;
        if let Some((role, socket)) = common::role() {
            let client =
                Subscriber::connect(&device, socket.as_str(), SubscriberConfig::default())?;
            if role == "writer" {
                let layout = vec![TensorSpec::new("w", Dtype::U32, vec![1 << 20])];
                let writer = Writer::open(&client, "model", Some(layout))?; // a new set
                let w = writer.staging().get::<u32>("w")?; // mapped read-write
                kernels::fill_u32(&w, Pattern::ramp(0, 1), Speed::Full)?;
                w.synchronize()?;
                drop(w);
                let committed = writer.commit()?; // readers now see this version
                println!("writer: committed {committed:?}, and exits");
                return Ok(());
            }
            let set = client.attach_set("model")?; // read-only: the service's rule
            println!(
                "reader: {:?}...",
                &set.get::<u32>("w")?.to_vec::<u32>()?[..4]
            );
            return client.release_set(set);
        }
        let socket = format!("example-05-{}", std::process::id());
        let service = Service::start(&device, socket.as_str(), ServiceConfig::default())?;
        common::Second::start("writer", &socket)?.wait()?;
        common::Second::start("reader", &socket)?.wait()?;
        let report = service.shutdown(Duration::from_secs(5));
        println!("service: stopped ({report:?})");
        Ok(())
    })
}
