//! The driver floor (`floor_setup`, `floor_legacy`, `floor_vmm`) and the
//! bandwidth copies (`bandwidth`) of the consumer.

use std::os::fd::AsFd;

use cuda_ipc::cudarc::driver::sys::CUevent_flags;
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::{Device, DeviceMemory, Error, LegacyBuffer, floor};
use serde_json::{Value, json};

use super::{Floor, State, int, mismatch, pattern, text, verify};
use crate::proto::{failure, mono_ns};
use crate::stats::ns_to_ms;

impl State {
    pub(super) fn floor(&self) -> Result<&Floor, Error> {
        self.floor
            .as_ref()
            .ok_or_else(|| failure("the floor", "floor_setup was not sent"))
    }

    pub(super) fn floor_legacy(&self, r: &Value) -> Result<Value, Error> {
        let f = self.floor()?;
        let handle: cuda_ipc::IpcMemHandle = text(r, "handle")?.parse()?;
        let len = int(r, "len")? as usize;
        let pattern = pattern(r)?;
        bind(&self.device)?;
        let t_c = mono_ns();
        let opened = floor::open_legacy(&self.device, &handle, &f.event)?;
        let t_d = mono_ns();
        let bad = opened.memory(len).and_then(|mem| verify(&mem, pattern));
        bind(&self.device)?;
        let t_e = mono_ns();
        let closed = opened.close();
        let t_f = mono_ns();
        if let Some(m) = bad? {
            return Err(mismatch("the legacy floor's mapping", &m));
        }
        closed?;
        Ok(json!({ "open_ms": ns_to_ms(t_c, t_d), "close_ms": ns_to_ms(t_e, t_f) }))
    }

    pub(super) fn floor_vmm(&self, r: &Value) -> Result<Value, Error> {
        let f = self.floor()?;
        let name = text(r, "name")?;
        let size = int(r, "size")?;
        let len = int(r, "len")? as usize;
        let pattern = pattern(r)?;
        let a = f.client.attach(name)?;
        let result = (|| {
            let fd = a.fds.first().ok_or_else(|| {
                failure("the vmm floor", "no file descriptor came with the entry")
            })?;
            let mut devices = vec![self.device.ordinal() as i32];
            if r.get("also").is_some() {
                devices.push(int(r, "also")? as i32);
            }
            bind(&self.device)?;
            let t_c = mono_ns();
            let mapped = floor::import_vmm(
                &self.device,
                fd.as_fd(),
                size,
                f.granularity,
                &devices,
                &f.event,
            )?;
            let t_d = mono_ns();
            let bad = mapped.memory(len).and_then(|mem| verify(&mem, pattern));
            bind(&self.device)?;
            let t_e = mono_ns();
            let unmapped = mapped.unmap();
            let t_f = mono_ns();
            if let Some(m) = bad? {
                return Err(mismatch("the vmm floor's mapping", &m));
            }
            unmapped?;
            Ok(json!({ "open_ms": ns_to_ms(t_c, t_d), "close_ms": ns_to_ms(t_e, t_f) }))
        })();
        let lease = a.lease;
        drop(a.fds);
        f.client.release(lease)?;
        result
    }

    /// A buffer of `size` bytes on GPU `ordinal`, with peer access from
    /// this consumer's GPU to it (for cuMemcpyPeer at full speed).
    pub(super) fn remote(&mut self, ordinal: usize, size: usize) -> Result<&LegacyBuffer, Error> {
        let fits = self
            .remote
            .as_ref()
            .is_some_and(|(d, b)| d.ordinal() == ordinal && b.byte_len() == size);
        if !fits {
            self.remote = None;
            let other = Device::open(ordinal)?;
            self.device.enable_peer_access(&other)?;
            let buffer = LegacyBuffer::alloc(&other, size)?;
            self.remote = Some((other, buffer));
        }
        Ok(&self.remote.as_ref().expect("just made").1)
    }

    pub(super) fn bandwidth(&mut self, r: &Value) -> Result<Value, Error> {
        let name = text(r, "name")?;
        let warmup = int(r, "warmup")? as usize;
        let reps = int(r, "reps")? as usize;
        let written = pattern(r)?;
        let peer_device = r
            .get("peer_device")
            .map(|_| int(r, "peer_device"))
            .transpose()?;
        let a = self.sub()?.attach::<u32>(name)?;
        let result = self.copies(a.buffer(), written, warmup, reps, peer_device);
        self.sub()?.release(a)?;
        result
    }

    /// Times copies out of `mapped`, local ones, into `mapped` and (with
    /// `peer_device`) cuMemcpyPeer from that GPU, interleaved; checks what
    /// the mapping held first (`written`) and what the copies into it left.
    pub(super) fn copies(
        &mut self,
        mapped: &impl DeviceMemory,
        written: Pattern,
        warmup: usize,
        reps: usize,
        peer_device: Option<u64>,
    ) -> Result<Value, Error> {
        mapped.synchronize()?;
        let size = mapped.byte_len();
        if self
            .local
            .as_ref()
            .is_none_or(|(s, _)| s.byte_len() != size)
        {
            self.local = None;
            self.local = Some((
                LegacyBuffer::alloc(&self.device, size)?,
                LegacyBuffer::alloc(&self.device, size)?,
            ));
        }
        if let Some(d) = peer_device {
            self.remote(d as usize, size)?;
        }
        let remote = peer_device.and(self.remote.as_ref()).map(|(_, b)| b);
        let (src, dst) = self.local.as_ref().expect("just allocated");
        // What the producer wrote, read through the mapping.
        dst.copy_from_device(mapped)?;
        if let Some(bad) = verify(dst, written)? {
            return Err(mismatch("the data read through the mapping", &bad));
        }
        let back = Pattern::ramp(written.base ^ 0x5A5A_5A5A, written.step.wrapping_add(1));
        kernels::fill_u32(src, back, Speed::Full)?;
        let ctx = self.device.context();
        let stream = self.device.stream();
        let cuda = |what: &str, e: cuda_ipc::cudarc::driver::DriverError| {
            failure(format!("timing copies ({what})"), format!("{e:?}"))
        };
        let start = ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| cuda("cuEventCreate", e))?;
        let end = ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| cuda("cuEventCreate", e))?;
        let time = |copy: &dyn Fn() -> Result<(), Error>| -> Result<f64, Error> {
            start.record(stream).map_err(|e| cuda("cuEventRecord", e))?;
            copy()?;
            end.record(stream).map_err(|e| cuda("cuEventRecord", e))?;
            let ms = start
                .elapsed_ms(&end)
                .map_err(|e| cuda("cuEventElapsedTime", e))?;
            Ok(f64::from(ms))
        };
        let (mut from, mut peer, mut local, mut into) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for i in 0..warmup + reps {
            // Interleaved, so that drift affects every kind alike.
            let from_ms = time(&|| dst.copy_from_device(mapped))?;
            let peer_ms = match remote {
                Some(remote) => Some(time(&|| dst.copy_from_peer(remote))?),
                None => None,
            };
            let local_ms = time(&|| dst.copy_from_device(src))?;
            let into_ms = time(&|| mapped.copy_from_device(src))?;
            if i >= warmup {
                from.push(from_ms);
                peer.extend(peer_ms);
                local.push(local_ms);
                into.push(into_ms);
            }
        }
        stream
            .synchronize()
            .map_err(|e| cuda("cuStreamSynchronize", e))?;
        // The writes reached the producer's buffer.
        if let Some(bad) = verify(mapped, back)? {
            return Err(mismatch("the data written into the mapping", &bad));
        }
        let mut answer = json!({
            "size": size,
            "from_mapping_ms": from,
            "local_ms": local,
            "into_mapping_ms": into,
            "checked": true,
        });
        if remote.is_some() {
            answer["memcpy_peer_ms"] = peer.into();
        }
        Ok(answer)
    }
}

/// Makes the device's context current on this thread (for raw driver calls).
fn bind(device: &Device) -> Result<(), Error> {
    device
        .context()
        .bind_to_thread()
        .map_err(|e| failure("cuCtxSetCurrent", format!("{e:?}")))
}
