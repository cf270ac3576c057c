//! Devices, their identities and what each can share.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, sys};

use crate::driver::result::device::{self as dev, Attr};
use crate::error::{DriverVersion, Error, Result, from_cudarc};

/// The largest special stream handle: 0 (the null stream), 1
/// (`CU_STREAM_LEGACY`) and 2 (`CU_STREAM_PER_THREAD`) each name a default
/// stream of the calling thread's current context.
const PER_THREAD_STREAM: u64 = 2;

/// A CUDA device made ready for sharing: the driver loaded, the device's
/// primary context retained, and a non-blocking stream for our work.
///
/// Cheap to clone (a reference count). The context is cudarc's, so a
/// `Device` works with everything cudarc offers: [`Device::context`] and
/// [`Device::stream`] are the cudarc objects.
#[derive(Clone)]
pub struct Device {
    inner: Arc<Inner>,
}

struct Inner {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    uuid: DeviceUuid,
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("ordinal", &self.ordinal())
            .field("uuid", &self.inner.uuid)
            .finish_non_exhaustive()
    }
}

impl Device {
    /// Opens device `ordinal`: loads and initialises the driver, retains the
    /// device's primary context (shared with the CUDA runtime, PyTorch and
    /// CuPy in this process) and creates a non-blocking stream.
    #[doc(alias = "cuDevicePrimaryCtxRetain")]
    pub fn open(ordinal: usize) -> Result<Self> {
        let mut phases = crate::phases::Phases::start("device.open");
        crate::driver::init()?;
        let count = dev::count()?;
        if ordinal >= count {
            return Err(Error::NoDevice { ordinal, count });
        }
        phases.mark("driver");
        let ctx =
            CudaContext::new(ordinal).map_err(|e| from_cudarc("cuDevicePrimaryCtxRetain", e))?;
        phases.mark("context");
        let stream = ctx
            .new_stream()
            .map_err(|e| from_cudarc("cuStreamCreate", e))?;
        phases.mark("stream");
        let uuid = DeviceUuid(dev::uuid(ctx.cu_device())?);
        phases.mark("uuid");
        Ok(Device {
            inner: Arc::new(Inner { ctx, stream, uuid }),
        })
    }

    /// The cudarc context (the device's primary context).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.inner.ctx
    }

    /// This device's stream for our copies, fills and event records.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.inner.stream
    }

    /// Wraps `raw`, a stream another library made in this device's context
    /// (PyTorch's current stream, a CuPy stream), so that our work can be
    /// ordered after it (the exchange's `Publisher::publish_set_after` and
    /// `update_set_after`).
    /// The wrapper borrows it: dropping it destroys nothing. The handles 0
    /// (the legacy default stream), 1 (`CU_STREAM_LEGACY`) and 2
    /// (`CU_STREAM_PER_THREAD`) name this context's default streams: they
    /// are taken as they are; any other handle costs one driver call
    /// (`cuStreamGetCtx`) that checks its context.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the driver says the stream belongs to
    /// another context (another device's, or not the primary one), or does
    /// not know it.
    ///
    /// # Safety
    /// `raw` is a live stream of this process, or a special handle, and
    /// stays live while the wrapper is used; the driver cannot tell a
    /// destroyed stream from a live one.
    #[doc(alias = "cuStreamGetCtx")]
    #[allow(unsafe_code)] // a handle from another library, to the driver: see # Safety
    pub unsafe fn borrow_stream(&self, raw: u64) -> Result<Arc<CudaStream>> {
        self.bind()?;
        let handle = raw as cudarc::driver::sys::CUstream;
        if raw <= PER_THREAD_STREAM {
            // A special handle names a default stream of the calling
            // thread's current context, which bind() just made this
            // device's: nothing for the driver to check (a call saved on
            // every update ordered after PyTorch's default stream).
            // SAFETY: a stream of this context, live as long as it is.
            return Ok(unsafe { self.inner.ctx.wrap_borrowed_stream(handle) });
        }
        // SAFETY: the caller's contract.
        let ctx = unsafe { crate::driver::result::stream::context(handle) }.map_err(|e| {
            Error::arg(
                "stream",
                format!("{raw:#x} is not a stream the driver knows in this process: {e}"),
            )
        })?;
        if ctx != self.inner.ctx.cu_ctx() {
            return Err(Error::arg(
                "stream",
                format!(
                    "{raw:#x} belongs to another CUDA context than device {}'s primary one; \
                     pass a stream of that device",
                    self.ordinal()
                ),
            ));
        }
        // SAFETY: a live stream of this context (checked above, and the
        // caller's contract for its life).
        Ok(unsafe { self.inner.ctx.wrap_borrowed_stream(handle) })
    }

    /// The device ordinal in this process (after CUDA_VISIBLE_DEVICES).
    pub fn ordinal(&self) -> usize {
        self.inner.ctx.ordinal()
    }

    /// The device's UUID: the same in every process, whatever the ordinals.
    pub fn uuid(&self) -> DeviceUuid {
        self.inner.uuid
    }

    /// Makes this device's context current on the calling thread.
    #[doc(hidden)]
    pub fn bind(&self) -> Result<()> {
        self.inner
            .ctx
            .bind_to_thread()
            .map_err(|e| from_cudarc("cuCtxSetCurrent", e))
    }

    /// Waits until all work on this device's stream is done.
    #[doc(alias = "cuStreamSynchronize")]
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        self.inner
            .stream
            .synchronize()
            .map_err(|e| from_cudarc("cuStreamSynchronize", e))
    }

    /// Free and total device memory, in bytes.
    #[doc(alias = "cuMemGetInfo")]
    pub fn memory_info(&self) -> Result<(u64, u64)> {
        self.bind()?;
        crate::driver::result::mem::info()
    }

    /// Lets this device's context read and write `peer`'s memory directly
    /// (`cuCtxEnablePeerAccess`): plain device pointers of `peer` then work
    /// in this device's kernels and copies, and `cuMemcpyPeer` runs over
    /// the direct link instead of staging through the host. Calling it
    /// again is harmless; access is one way (call it on `peer` too for the
    /// other way).
    ///
    /// Mappings from other processes do not need it: legacy handles open
    /// with [`OpenFlags::LAZY_ENABLE_PEER_ACCESS`](crate::OpenFlags), and
    /// VMM and pool imports grant access per mapping.
    ///
    /// # Errors
    /// [`ErrorKind::Unavailable`](crate::ErrorKind::Unavailable) when the
    /// two devices cannot reach each other (`cuDeviceCanAccessPeer` says
    /// no: no NVLink or PCIe peer-to-peer path), and
    /// [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput) when
    /// `peer` is this device.
    #[doc(alias = "cuCtxEnablePeerAccess")]
    pub fn enable_peer_access(&self, peer: &Device) -> Result<()> {
        if peer.ordinal() == self.ordinal() {
            return Err(Error::arg(
                "peer device",
                format!(
                    "device {} is this device; peer access is between two different devices",
                    peer.ordinal()
                ),
            ));
        }
        let (a, b) = (self.inner.ctx.cu_device(), peer.inner.ctx.cu_device());
        if !dev::can_access_peer(a, b)? {
            return Err(Error::Unsupported {
                what: "peer access between these two devices",
                why: format!(
                    "cuDeviceCanAccessPeer says device {} cannot reach device {} directly (no \
                     NVLink, and PCIe peer-to-peer is off or crosses an unsupported bridge); \
                     copy through host memory instead",
                    self.ordinal(),
                    peer.ordinal()
                ),
            });
        }
        self.bind()?;
        crate::driver::result::context::enable_peer_access(peer.inner.ctx.cu_ctx())
    }

    /// What this device can share.
    pub fn capabilities(&self) -> Result<Capabilities> {
        Capabilities::query(self.ordinal())
    }
}

/// A device UUID, printed as `nvidia-smi` does (`GPU-xxxxxxxx-xxxx-...`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceUuid(pub [u8; 16]);

crate::json::read::field_from_str!(DeviceUuid);

impl fmt::Display for DeviceUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = &self.0;
        write!(f, "GPU-")?;
        for (i, byte) in b.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                write!(f, "-")?;
            }
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for DeviceUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl FromStr for DeviceUuid {
    type Err = Error;
    /// Parses `GPU-` followed by 32 hex digits in the 8-4-4-4-12 grouping.
    fn from_str(s: &str) -> Result<Self> {
        let bad = |reason: &str| Error::InvalidArgument {
            what: "device UUID",
            reason: format!("{s:?}: {reason}; expected GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"),
        };
        let rest = s
            .strip_prefix("GPU-")
            .ok_or_else(|| bad("missing the GPU- prefix"))?;
        let groups: Vec<&str> = rest.split('-').collect();
        if groups.iter().map(|g| g.len()).collect::<Vec<_>>() != [8, 4, 4, 4, 12] {
            return Err(bad("wrong grouping"));
        }
        let mut out = [0u8; 16];
        hex::decode_to_slice(groups.concat(), &mut out).map_err(|_| bad("not hex"))?;
        Ok(DeviceUuid(out))
    }
}

impl serde::Serialize for DeviceUuid {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for DeviceUuid {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str> as serde::Deserialize>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// A device's compute mode, which decides whether other processes may use it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ComputeMode {
    /// Any number of processes may use the device.
    Default,
    /// No process may create a context: nothing can run.
    Prohibited,
    /// One process at a time: a consumer cannot open the producer's memory.
    ExclusiveProcess,
    /// A value this crate does not know.
    Other(i32),
}

impl ComputeMode {
    fn from_raw(v: i32) -> Self {
        match v {
            0 => ComputeMode::Default,
            2 => ComputeMode::Prohibited,
            3 => ComputeMode::ExclusiveProcess,
            v => ComputeMode::Other(v),
        }
    }
}

/// What one device offers for sharing memory, read from its attributes.
///
/// These are the driver's claims; `cuda-ipc info --probe` also tries each
/// mechanism, since an attribute can say yes where the system says no
/// (fabric handles without an IMEX channel, for instance).
#[derive(Clone, Debug, serde::Serialize)]
#[allow(clippy::struct_excessive_bools)] // one flag per device attribute, as the driver reports them
#[non_exhaustive]
pub struct Capabilities {
    /// Ordinal in this process.
    pub ordinal: usize,
    /// Marketing name, for example "NVIDIA H200".
    pub name: String,
    /// UUID, the same in every process.
    pub uuid: DeviceUuid,
    /// PCI bus id, for example "0000:19:00.0".
    pub pci_bus_id: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Compute mode.
    pub compute_mode: ComputeMode,
    /// Total memory in bytes.
    pub total_memory: u64,
    /// Unified virtual addressing (needed by legacy IPC).
    pub unified_addressing: bool,
    /// Interprocess events.
    pub ipc_events: bool,
    /// Legacy IPC handles (`cuIpcGetMemHandle`): unified addressing and IPC events,
    /// on a platform with CUDA IPC (not Windows or WSL).
    pub legacy_ipc: bool,
    /// VMM allocations (`cuMemCreate`).
    pub vmm: bool,
    /// VMM allocations exportable as POSIX file descriptors.
    pub posix_fd: bool,
    /// VMM allocations exportable as fabric handles.
    pub fabric: bool,
    /// Stream-ordered memory pools.
    pub memory_pools: bool,
    /// Handle types memory pools can be shared with (bit 1: POSIX fd, bit 8: fabric).
    pub mempool_handle_types: i32,
    /// Whether contexts this process creates on the device go through an MPS
    /// server (`CU_DEVICE_ATTRIBUTE_MPS_ENABLED`): the driver decides when it
    /// starts, from the MPS control daemon it reaches (`CUDA_MPS_PIPE_DIRECTORY`,
    /// default `/tmp/nvidia-mps`). `None` where the driver does not report it.
    pub mps: Option<bool>,
}

impl Capabilities {
    /// Reads device `ordinal`'s attributes (no context is created).
    pub(crate) fn query(ordinal: usize) -> Result<Self> {
        crate::driver::init()?;
        let count = dev::count()?;
        if ordinal >= count {
            return Err(Error::NoDevice { ordinal, count });
        }
        let d = dev::get(ordinal)?;
        let attr = |a: Attr| dev::attribute(d, a);
        let flag = |a: Attr| attr(a).map(|v| v != 0);
        let unified_addressing = flag(Attr::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING)?;
        let ipc_events = flag(Attr::CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED)?;
        Ok(Capabilities {
            ordinal,
            name: dev::name(d)?,
            uuid: DeviceUuid(dev::uuid(d)?),
            pci_bus_id: dev::pci_bus_id(d)?,
            compute_capability: (
                attr(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attr(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            ),
            compute_mode: ComputeMode::from_raw(attr(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_MODE)?),
            total_memory: dev::total_mem(d)?,
            unified_addressing,
            ipc_events,
            legacy_ipc: unified_addressing && ipc_events && cfg!(target_os = "linux"),
            vmm: flag(Attr::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED)?,
            posix_fd: flag(Attr::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)?,
            fabric: flag(Attr::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED)?,
            memory_pools: flag(Attr::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)?,
            mempool_handle_types: attr(Attr::CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES)?,
            // Drivers before CUDA 12.x do not know the attribute: unknown, not an error.
            mps: flag(Attr::CU_DEVICE_ATTRIBUTE_MPS_ENABLED).ok(),
        })
    }
}

/// The driver and every device it sees.
#[derive(Clone, Debug, serde::Serialize)]
#[non_exhaustive]
pub struct SystemInfo {
    /// The driver's CUDA version, for example "13.0".
    pub driver_version: DriverVersion,
    /// One entry per device.
    pub devices: Vec<Capabilities>,
}

impl SystemInfo {
    /// Loads the driver and reads every device's capabilities.
    pub fn query() -> Result<Self> {
        let driver_version = crate::driver::init()?;
        let count = dev::count()?;
        let devices = (0..count).map(Capabilities::query).collect::<Result<_>>()?;
        Ok(SystemInfo {
            driver_version,
            devices,
        })
    }
}

/// The ordinal, in this process, of the device with `uuid`, if it is visible.
pub fn ordinal_of(uuid: DeviceUuid) -> Result<Option<usize>> {
    crate::driver::init()?;
    for i in 0..dev::count()? {
        if dev::uuid(dev::get(i)?)? == uuid.0 {
            return Ok(Some(i));
        }
    }
    Ok(None)
}

/// How two devices reach each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct PeerLink {
    /// Whether `from` can map `to`'s memory.
    pub access_supported: bool,
    /// Whether atomics work natively over the link.
    pub native_atomics: bool,
    /// The driver's relative performance rank of the link (lower is faster).
    pub performance_rank: i32,
}

/// Peer attributes between two device ordinals.
#[doc(alias = "cuDeviceGetP2PAttribute")]
pub fn peer_link(from: usize, to: usize) -> Result<PeerLink> {
    crate::driver::init()?;
    let (a, b) = (dev::get(from)?, dev::get(to)?);
    let attr = |x| dev::p2p_attribute(x, a, b);
    Ok(PeerLink {
        access_supported: dev::can_access_peer(a, b)?,
        native_atomics: attr(
            sys::CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED,
        )? != 0,
        performance_rank: attr(
            sys::CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK,
        )?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_round_trip() {
        let u = DeviceUuid([
            0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 1, 2, 3, 4, 5, 6, 7, 8,
        ]);
        let s = u.to_string();
        assert_eq!(s, "GPU-12345678-9abc-def0-0102-030405060708");
        assert_eq!(s.parse::<DeviceUuid>().unwrap(), u);
        for bad in [
            "12345678-9abc-def0-0102-030405060708",
            "GPU-1234",
            "GPU-12345678-9abc-def0-0102-03040506070g",
        ] {
            assert!(bad.parse::<DeviceUuid>().is_err(), "{bad}");
        }
    }
}
