//! A Rust consumer of a PyTorch tensor exported with `cuda_ipc.export_torch`.
//!
//! It reads one line of JSON from standard input (a cuda-ipc descriptor, or a
//! PyTorch share record from `cuda_ipc.torch_share_record`), maps the memory
//! on the device with that UUID (waiting on the exporter's event), applies
//! `x -> 2x + 1` to every 32-bit element with our kernel, records an
//! interprocess event after the kernel and prints its handle. It keeps the
//! mapping and the event until its standard input ends.
//!
//! The Python side (the tensor must be `int32` or `uint32` and contiguous):
//!
//! ```python
//! import subprocess, torch, cuda_ipc
//!
//! x = torch.arange(1 << 20, dtype=torch.int32, device="cuda")
//! t = x[4096:]                                   # at an offset inside the allocation
//! e = cuda_ipc.export_torch(t)
//! p = subprocess.Popen(["target/release/examples/torch_consumer"],
//!                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
//! p.stdin.write(e.json() + "\n"); p.stdin.flush()
//! done = torch.cuda.Event.from_ipc_handle(t.device, bytes.fromhex(p.stdout.readline().strip()))
//! done.wait(torch.cuda.current_stream())         # order our reads after the Rust kernel
//! expected = torch.arange(4096, 1 << 20, dtype=torch.int32, device="cuda") * 2 + 1
//! assert torch.equal(t, expected) and torch.equal(x[:4096], torch.arange(4096, dtype=torch.int32, device="cuda"))
//! p.stdin.close(); p.wait()
//! e.close()                                      # only after the consumer is done
//! ```
//!
//! ```text
//! cargo build --release --example torch_consumer
//! ```
//!
//! Errors are one line on standard error; the exit code is 2 for bad input,
//! 3 without a driver or device, 4 otherwise.

use std::io::{BufRead, Read};
use std::process::ExitCode;

use cuda_ipc::descriptor::Source;
use cuda_ipc::device::SystemInfo;
use cuda_ipc::kernels;
use cuda_ipc::torch::{self, ShareRecord};
use cuda_ipc::{Descriptor, Device, DeviceMemory, Dtype, Error, ErrorKind, IpcEvent, share};

/// The descriptor in `line`: ours, or a PyTorch share record converted.
fn descriptor_from(line: &str) -> Result<Descriptor, Box<dyn std::error::Error>> {
    let value: serde_json::Value = serde_json::from_str(line)?;
    if value.get(torch::RECORD_KEY).is_some() {
        // A PyTorch share record: 'c' blocks and one-allocation expandable
        // segments become descriptors; several segments need
        // vmm::VmmMapping::import_segments, which this example does not do.
        Ok(ShareRecord::from_value(&value)?.to_descriptor()?)
    } else {
        Ok(Descriptor::from_value(&value)?)
    }
}

/// The device with the descriptor's UUID (ordinals differ between processes).
fn device_for(descriptor: &Descriptor) -> Result<Device, Box<dyn std::error::Error>> {
    let info = SystemInfo::query()?;
    let caps = info
        .devices
        .iter()
        .find(|d| d.uuid == descriptor.device_uuid)
        .ok_or_else(|| {
            format!(
                "device {} is not visible here (check CUDA_VISIBLE_DEVICES)",
                descriptor.device_uuid
            )
        })?;
    Ok(Device::open(caps.ordinal)?)
}

fn bad_input(reason: String) -> Error {
    Error::InvalidArgument {
        what: "tensor",
        reason,
    }
}

fn main() -> ExitCode {
    let Err(e) = run() else {
        return ExitCode::SUCCESS;
    };
    eprintln!("torch_consumer: error: {e}");
    let kind = e.downcast_ref::<Error>().map(Error::kind);
    let bad_json = e.downcast_ref::<serde_json::Error>().is_some();
    ExitCode::from(match kind {
        Some(ErrorKind::InvalidInput) => 2,
        None if bad_json => 2,
        Some(ErrorKind::Unavailable) => 3,
        _ => 4,
    })
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    let descriptor = descriptor_from(line.trim())?;
    if !matches!(descriptor.dtype, Dtype::I32 | Dtype::U32) {
        return Err(bad_input(format!(
            "this example transforms 32-bit integers; the tensor holds {}",
            descriptor.dtype
        ))
        .into());
    }
    if descriptor.strides.is_some() {
        return Err(bad_input(
            "this example needs a contiguous tensor (call .contiguous() first)".into(),
        )
        .into());
    }
    let device = device_for(&descriptor)?;
    // Maps the memory (pidfd_getfd for fd mechanisms) and makes the
    // buffer's stream wait on the exporter's event.
    let buffer = share::open::<u32>(&device, &descriptor, Vec::new())?;
    let how = match descriptor.source {
        Source::Legacy { .. } => "a legacy IPC handle",
        Source::Vmm { .. } => "a VMM file descriptor (PyTorch expandable segment)",
        Source::Pool { .. } => "a memory pool",
        Source::Fabric { .. } => "a fabric handle",
        _ => "a mechanism newer than this example",
    };
    eprintln!(
        "torch_consumer: mapped {} elements at offset {} through {how}",
        buffer.len(),
        descriptor.offset
    );
    kernels::map_u32(&buffer, 2, 1)?;
    let done = IpcEvent::new(&device)?;
    done.record(buffer.stream())?;
    println!("{}", done.handle()?);
    // Keep the event and the mapping until the exporter has waited on it.
    std::io::stdin().lock().read_to_end(&mut Vec::new())?;
    drop(done);
    drop(buffer);
    Ok(())
}
