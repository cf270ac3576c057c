//! 01: one buffer, shared with another process without a channel: export it
//! as a descriptor (one line of JSON, for a program in any language) and
//! map it there.
//!
//! ```text
//! cargo run --release -p cuda-ipc --example 01-share-buffer
//! ```

mod common;

use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::share::{self, SharedBuffer};
use cuda_ipc::{Descriptor, Device, DeviceMemory, Dtype, IpcEvent};

const BYTES: usize = 4 << 20;

fn main() -> std::process::ExitCode {
    common::main("01-share-buffer", || {
        let device = Device::open(0)?;
        if let Some((_, json)) = common::role() {
            // The second process: map it; its stream waits on the event.
            let descriptor = Descriptor::from_json(&json)?;
            let buffer = share::open::<u32>(&device, &descriptor, Vec::new())?;
            println!("second process: {:?}...", &buffer.to_vec::<u32>()?[..4]);
            return Ok(());
        }
        let buffer = SharedBuffer::alloc(&device, BYTES, None)?; // the best mechanism here
        kernels::fill_u32(&buffer, Pattern::ramp(0, 1), Speed::Full)?;
        let ready = IpcEvent::new(&device)?; // recorded after the fill
        ready.record(buffer.stream())?;
        if buffer.mechanism().uses_fd() {
            share::allow_fd_fetching()?; // the other process takes our fd (pidfd_getfd)
        }
        let mut export = buffer.export_region(0, BYTES as u64, Dtype::U32, None)?;
        export.descriptor.event = Some(ready.handle()?);
        println!("first process: {}", export.descriptor);
        // The buffer and the event stay alive until the other process is done.
        common::Second::start("open", &export.descriptor.to_string())?.wait()
    })
}
