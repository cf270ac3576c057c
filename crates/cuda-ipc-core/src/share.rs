//! One export and import API over every mechanism.
//!
//! The caller says what to share; [`SharedBuffer::alloc`] picks the best
//! mechanism the device supports (VMM file descriptors, then pool file
//! descriptors, then legacy handles), or uses the one the caller forces.
//! An [`Export`] holds the [`Descriptor`] and the file descriptors to hand
//! over; [`open`] maps a descriptor in another process, whichever mechanism
//! made it.
//!
//! File descriptors reach the importer in one of two ways: over the
//! [`channel`](crate::channel) (preferred: the socket's peer is checked),
//! or, for scripts, by `pidfd_getfd` from the exporting process, using the
//! descriptor's `pid` and `fd` (which needs the right to ptrace the
//! exporter: same user, and `kernel.yama.ptrace_scope` allowing it or the
//! exporter calling [`allow_fd_fetching`]).
#![allow(unsafe_code)] // only `unsafe impl DeviceMemory`, justified there

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytemuck::Pod;
use cudarc::driver::CudaStream;

use crate::descriptor::{Descriptor, Dtype, Mechanism, Source};
use crate::device::{Capabilities, Device};
use crate::error::{Error, Result};
use crate::mechanism::Access;
use crate::memory::buffer::{MappedBuffer, Mapping};
use crate::memory::legacy::{LegacyBuffer, LegacyMapping, OpenFlags};
use crate::memory::pool::{ImportedPool, PoolBuffer, SharedPool};
use crate::memory::vmm::{ShareableTypes, VmmBuffer, VmmMapping};
use crate::memory::{DeviceMemory, WithStream, impl_cudarc_traits};
use crate::sync::event::IpcEvent;

/// Numbers allocations of this process, so that an address reused for a new
/// allocation never looks like the old one to a consumer's cache.
static GENERATION: AtomicU64 = AtomicU64::new(1);

fn next_generation() -> u64 {
    // Mixed with the pid so that two exporters never share a generation.
    (u64::from(std::process::id()) << 40) | GENERATION.fetch_add(1, Ordering::Relaxed)
}

/// The mechanism `auto` picks on a device with these capabilities.
pub fn best_mechanism(caps: &Capabilities) -> Result<Mechanism> {
    if caps.vmm && caps.posix_fd {
        Ok(Mechanism::Vmm)
    } else if caps.memory_pools && caps.mempool_handle_types & 1 != 0 {
        Ok(Mechanism::Pool)
    } else if caps.legacy_ipc {
        Ok(Mechanism::Legacy)
    } else {
        Err(Error::Unsupported {
            what: "sharing device memory",
            why: format!(
                "device {} ({}) supports none of VMM file descriptors, shareable memory pools or legacy IPC \
                 (CUDA IPC is not available on Windows or WSL)",
                caps.ordinal, caps.name
            ),
        })
    }
}

/// Checks that `caps` allows `mechanism`, with the reason if not.
pub fn check_mechanism(caps: &Capabilities, mechanism: Mechanism) -> Result<()> {
    let (ok, why) = match mechanism {
        Mechanism::Legacy => (
            caps.legacy_ipc,
            "the device lacks unified addressing or IPC events, or the platform has no CUDA IPC",
        ),
        Mechanism::Vmm => (
            caps.vmm && caps.posix_fd,
            "the device does not support VMM allocations with POSIX file descriptors",
        ),
        Mechanism::Pool => (
            caps.memory_pools && caps.mempool_handle_types & 1 != 0,
            "the device's memory pools cannot be shared with POSIX file descriptors",
        ),
        Mechanism::Fabric => (caps.fabric, "the device does not support fabric handles"),
    };
    if ok {
        Ok(())
    } else {
        Err(Error::Unsupported {
            what: match mechanism {
                Mechanism::Legacy => "the legacy mechanism",
                Mechanism::Vmm => "the vmm mechanism",
                Mechanism::Pool => "the pool mechanism",
                Mechanism::Fabric => "the fabric mechanism",
            },
            why: format!("device {} ({}): {why}", caps.ordinal, caps.name),
        })
    }
}

/// The allocation behind a [`SharedBuffer`].
#[derive(Debug)]
enum Allocation {
    Legacy(LegacyBuffer),
    Vmm(VmmBuffer),
    Pool(PoolBuffer),
}

/// Device memory allocated for sharing by one mechanism.
#[derive(Debug)]
pub struct SharedBuffer {
    allocation: Allocation,
    mechanism: Mechanism,
    generation: u64,
}

impl SharedBuffer {
    /// Allocates `len` bytes on `device` for sharing with `mechanism`
    /// (`None`: the best the device supports).
    pub fn alloc(device: &Device, len: usize, mechanism: Option<Mechanism>) -> Result<Self> {
        let caps = device.capabilities()?;
        let mechanism = match mechanism {
            Some(m) => {
                check_mechanism(&caps, m)?;
                m
            }
            None => best_mechanism(&caps)?,
        };
        Self::alloc_unchecked(device, len, mechanism, None)
    }

    /// Allocates from an existing shareable pool (the pool mechanism).
    pub fn alloc_in_pool(pool: &Arc<SharedPool>, len: usize) -> Result<Self> {
        Self::alloc_unchecked(pool.device(), len, Mechanism::Pool, Some(pool))
    }

    /// Takes over a VMM allocation another process made and exported as
    /// `fd` (`size` bytes, its whole size): see [`VmmBuffer::adopt_fd`].
    /// Its exports are duplicates of `fd`.
    pub fn adopt_vmm(device: &Device, fd: OwnedFd, size: u64) -> Result<Self> {
        Ok(SharedBuffer {
            allocation: Allocation::Vmm(VmmBuffer::adopt_fd(device, fd, size)?),
            mechanism: Mechanism::Vmm,
            generation: next_generation(),
        })
    }

    fn alloc_unchecked(
        device: &Device,
        len: usize,
        mechanism: Mechanism,
        pool: Option<&Arc<SharedPool>>,
    ) -> Result<Self> {
        let allocation = match mechanism {
            Mechanism::Legacy => Allocation::Legacy(LegacyBuffer::alloc(device, len)?),
            Mechanism::Vmm => Allocation::Vmm(VmmBuffer::alloc(device, len)?),
            Mechanism::Fabric => Allocation::Vmm(VmmBuffer::alloc_with(
                device,
                len,
                ShareableTypes::FD_AND_FABRIC,
            )?),
            Mechanism::Pool => {
                let pool = match pool {
                    Some(p) => p.clone(),
                    None => SharedPool::new(device)?,
                };
                Allocation::Pool(pool.alloc(len)?)
            }
        };
        Ok(SharedBuffer {
            allocation,
            mechanism,
            generation: next_generation(),
        })
    }

    /// The mechanism this buffer is shared with.
    pub fn mechanism(&self) -> Mechanism {
        self.mechanism
    }

    /// The generation number that descriptors of this buffer carry.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Exports the whole buffer as bytes.
    pub fn export(&self) -> Result<Export> {
        self.export_region(0, self.byte_len() as u64, Dtype::U8, None)
    }

    /// Exports `len` bytes at `offset` holding `dtype` elements, with an
    /// optional shape. Each call creates new file descriptors (for fd
    /// mechanisms), owned by the returned [`Export`].
    #[tracing::instrument(level = "debug", skip(self, shape), fields(mechanism = %self.mechanism))]
    pub fn export_region(
        &self,
        offset: u64,
        len: u64,
        dtype: Dtype,
        shape: Option<Vec<u64>>,
    ) -> Result<Export> {
        Error::check_range(offset, len, self.byte_len() as u64)?;
        let device = self.device();
        let (source, alloc_size, base_offset, fds) = match &self.allocation {
            Allocation::Legacy(b) => {
                let e = b.export()?;
                (
                    Source::Legacy { handle: e.handle },
                    e.alloc_size,
                    e.offset,
                    Vec::new(),
                )
            }
            Allocation::Vmm(b) if self.mechanism == Mechanism::Fabric => (
                Source::Fabric {
                    handle: b.export_fabric()?,
                },
                b.alloc_size(),
                0,
                Vec::new(),
            ),
            Allocation::Vmm(b) => {
                let fd = b.export_fd()?;
                (
                    Source::Vmm { fd: fd.as_raw_fd() },
                    b.alloc_size(),
                    0,
                    vec![fd],
                )
            }
            Allocation::Pool(b) => {
                // The pool first: the driver exports pointers of shared pools only.
                let fd = b.pool().export_fd()?;
                let ptr = b.export()?;
                (
                    Source::Pool {
                        fd: fd.as_raw_fd(),
                        ptr,
                    },
                    b.byte_len() as u64,
                    0,
                    vec![fd],
                )
            }
        };
        let descriptor = Descriptor {
            source,
            alloc_size,
            offset: base_offset + offset,
            byte_len: len,
            dtype,
            shape,
            strides: None,
            device_uuid: device.uuid(),
            pid: std::process::id(),
            event: None,
            generation: Some(self.generation),
        };
        descriptor.validate()?;
        Ok(Export { descriptor, fds })
    }
}

/// Evaluates `$e` with `$b` bound to the allocation, whichever mechanism made it.
macro_rules! on_allocation {
    ($self:ident, $b:ident => $e:expr) => {
        match &$self.allocation {
            Allocation::Legacy($b) => $e,
            Allocation::Vmm($b) => $e,
            Allocation::Pool($b) => $e,
        }
    };
}

impl WithStream for SharedBuffer {
    fn with_stream(self, stream: Arc<CudaStream>) -> Result<Self> {
        let allocation = match self.allocation {
            Allocation::Legacy(b) => Allocation::Legacy(b.with_stream(stream)?),
            Allocation::Vmm(b) => Allocation::Vmm(b.with_stream(stream)?),
            Allocation::Pool(b) => Allocation::Pool(b.with_stream(stream)?),
        };
        Ok(SharedBuffer { allocation, ..self })
    }
}

// SAFETY: each allocation implements `DeviceMemory` for memory it owns;
// the buffer owns the allocation and forwards to it unchanged.
unsafe impl DeviceMemory for SharedBuffer {
    fn device(&self) -> &Device {
        on_allocation!(self, b => b.device())
    }
    fn stream(&self) -> &Arc<CudaStream> {
        on_allocation!(self, b => b.stream())
    }
    fn device_address(&self) -> u64 {
        on_allocation!(self, b => b.device_address())
    }
    fn byte_len(&self) -> usize {
        on_allocation!(self, b => b.byte_len())
    }
    fn foreign_use(&self) -> Option<&crate::memory::ForeignUse> {
        on_allocation!(self, b => b.foreign_use())
    }
}

impl_cudarc_traits!(SharedBuffer, u8);

/// An export: the descriptor and the file descriptors to hand over with it.
///
/// For fd mechanisms the descriptor's `fd` field is the number of the first
/// descriptor in this process, valid while the `Export` lives (for
/// `pidfd_getfd`). Over the channel, the descriptors travel themselves.
#[derive(Debug)]
#[non_exhaustive]
pub struct Export {
    /// The descriptor.
    pub descriptor: Descriptor,
    /// The file descriptors (none for legacy and fabric).
    pub fds: Vec<OwnedFd>,
}

/// Exports `len` bytes at `ptr`, device memory this process holds from any
/// allocator: `cuMemAlloc` (legacy handle), a shareable memory pool (pool
/// mechanism) or `cuMemCreate` with the file descriptor handle type (vmm).
/// For example a cudarc slice, whichever allocator made it:
/// `result::malloc_sync` memory works with legacy handles, and stream-ordered
/// memory works when its pool is shareable; the device's default pool
/// (cudarc's `CudaStream::alloc`) is not, and gets an error that says which
/// allocator to use instead.
#[doc(alias = "cuIpcGetMemHandle")]
#[doc(alias = "cuMemPoolExportPointer")]
#[doc(alias = "cuMemRetainAllocationHandle")]
pub fn export_pointer(device: &Device, ptr: u64, len: u64, dtype: Dtype) -> Result<Export> {
    let descriptor = |source, alloc_size, offset| Descriptor {
        source,
        alloc_size,
        offset,
        byte_len: len,
        dtype,
        shape: None,
        strides: None,
        device_uuid: device.uuid(),
        pid: std::process::id(),
        event: None,
        generation: Some(next_generation()),
    };
    let (d, fds) = match crate::memory::legacy::export_pointer(device, ptr, len) {
        Ok(e) => (
            descriptor(Source::Legacy { handle: e.handle }, e.alloc_size, e.offset),
            Vec::new(),
        ),
        Err(Error::StreamOrdered { .. }) => {
            let (fd, data, base, size) = crate::memory::pool::export_existing(device, ptr)?;
            (
                descriptor(
                    Source::Pool {
                        fd: fd.as_raw_fd(),
                        ptr: data,
                    },
                    size,
                    ptr - base,
                ),
                vec![fd],
            )
        }
        Err(Error::Unsupported { .. }) => {
            let (fd, base, size) = crate::memory::vmm::export_existing(device, ptr)?;
            (
                descriptor(Source::Vmm { fd: fd.as_raw_fd() }, size, ptr - base),
                vec![fd],
            )
        }
        Err(e) => return Err(e),
    };
    d.validate()?;
    Ok(Export { descriptor: d, fds })
}

/// Lets processes of the same user take file descriptors from this one with
/// `pidfd_getfd` even where `kernel.yama.ptrace_scope` is 1 (Ubuntu's
/// default), by naming any process as an allowed tracer
/// (`PR_SET_PTRACER_ANY`). This widens who may ptrace this process to every
/// process of the same user, so the command-line `export` calls it only for
/// fd mechanisms; programs should prefer the channel, and a process whose
/// consumer is a child of its own [`allow_fd_fetching_by`].
pub fn allow_fd_fetching() -> Result<()> {
    set_ptracer(rustix::process::PTracer::Any)
}

/// Lets process `pid` alone take file descriptors from this one with
/// `pidfd_getfd` where `kernel.yama.ptrace_scope` is 1, by naming it as this
/// process's allowed tracer (`PR_SET_PTRACER pid`), until the returned
/// value drops: then no process is named any more (`PR_SET_PTRACER 0`).
/// For a process that hands descriptors to a child of its own (the
/// command line's `info` and `demo`) without letting every process of its
/// user ptrace it, as [`allow_fd_fetching`] does. Yama keeps one tracer per
/// process: this replaces an earlier [`allow_fd_fetching`], and the drop
/// does not bring it back.
pub fn allow_fd_fetching_by(pid: u32) -> Result<FdFetcher> {
    let p = rustix::process::Pid::from_raw(pid as i32)
        .ok_or_else(|| Error::arg("pid", format!("{pid} is not a process id")))?;
    set_ptracer(rustix::process::PTracer::ProcessID(p))?;
    Ok(FdFetcher { _pid: pid })
}

/// The one process [`allow_fd_fetching_by`] lets take file descriptors
/// from this one; dropping it names no process any more.
#[derive(Debug)]
#[must_use = "dropping it takes the permission back at once"]
pub struct FdFetcher {
    _pid: u32,
}

impl Drop for FdFetcher {
    fn drop(&mut self) {
        // An error leaves the one process named, no wider than before.
        let _ = set_ptracer(rustix::process::PTracer::None);
    }
}

fn set_ptracer(who: rustix::process::PTracer) -> Result<()> {
    match rustix::process::set_ptracer(who) {
        // EINVAL: the kernel has no Yama, so the classic rule (same user) applies.
        Ok(()) | Err(rustix::io::Errno::INVAL) => Ok(()),
        Err(e) => Err(Error::io(
            "allowing other processes to fetch our file descriptors (prctl PR_SET_PTRACER)",
            e.into(),
        )),
    }
}

/// Why `pidfd_open` found no process with the descriptor's pid: it has
/// exited, or, from a PID namespace of our own, it may be alive but not
/// visible (in the parent namespace or another container).
fn exporter_not_found() -> String {
    match crate::container::in_nested_pid_namespace() {
        Some(false) => "the exporting process has exited".to_owned(),
        nested => format!(
            "the exporting process is not visible from this PID namespace (a container?){}; \
             pass descriptors over the channel (`cuda-ipc serve`/`attach`), which carries \
             the fds itself",
            if nested.is_none() {
                ", or it has exited"
            } else {
                ""
            }
        ),
    }
}

/// Takes a duplicate of file descriptor `fd` of process `pid` (`pidfd_getfd`).
///
/// The pid must be visible from this process's PID namespace: from another
/// container, or from a new PID namespace (`unshare --pid`), the exporter
/// cannot be found and the error says so; pass the descriptors over the
/// channel there.
pub fn fetch_fd(pid: u32, fd: i32) -> Result<OwnedFd> {
    let p = rustix::process::Pid::from_raw(pid as i32)
        .ok_or_else(|| Error::arg("pid", format!("{pid} is not a process id")))?;
    let pidfd =
        rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()).map_err(|e| {
            let why = match e {
                rustix::io::Errno::SRCH => exporter_not_found(),
                rustix::io::Errno::NOSYS => {
                    "this kernel has no pidfd_open (Linux 5.3+ needed); use the channel instead"
                        .to_string()
                }
                e => e.to_string(),
            };
            Error::Unsupported {
                what: "fetching the exporter's file descriptor",
                why: format!("pidfd_open({pid}) failed: {why}"),
            }
        })?;
    rustix::process::pidfd_getfd(&pidfd, fd, rustix::process::PidfdGetfdFlags::empty()).map_err(|e| {
        let why = match e {
            rustix::io::Errno::PERM => format!(
                "not permitted to take descriptors from process {pid}: pidfd_getfd needs ptrace rights over it \
                 (the same user, and kernel.yama.ptrace_scope 0, or the exporter allowing it, or CAP_SYS_PTRACE). \
                 Containers often forbid it. Pass descriptors over the channel instead (cuda-ipc serve / attach)"
            ),
            rustix::io::Errno::BADF => format!("process {pid} has no open file descriptor {fd}: it closed the export"),
            rustix::io::Errno::NOSYS => "this kernel has no pidfd_getfd (Linux 5.6+ needed); use the channel instead".into(),
            e => e.to_string(),
        };
        Error::Unsupported {
            what: "fetching the exporter's file descriptor",
            why,
        }
    })
}

/// Opens the device a descriptor's memory lives on, found by its UUID among
/// the devices this process sees: the right GPU whatever this process's
/// `CUDA_VISIBLE_DEVICES` says (another order, a subset, or the
/// `GPU-xxxxxxxx-...` UUID form), since ordinals differ between processes
/// and UUIDs do not.
///
/// # Errors
/// [`Error::Unsupported`] when no visible device has that UUID (hide fewer
/// devices, or open the memory from a device with peer access to it by
/// ordinal with [`open_mapping`]).
#[doc(alias = "cuDeviceGetUuid")]
pub fn device_for(descriptor: &Descriptor) -> Result<Device> {
    match crate::device::ordinal_of(descriptor.device_uuid)? {
        Some(ordinal) => Device::open(ordinal),
        None => Err(Error::Unsupported {
            what: "opening the exporter's device",
            why: format!(
                "no device visible to this process has UUID {} (check CUDA_VISIBLE_DEVICES: \
                 it must include that GPU, by ordinal or as its UUID)",
                descriptor.device_uuid
            ),
        }),
    }
}

/// Maps the whole allocation a descriptor names. `fds` are the descriptors
/// that travelled with it (over the channel); when empty for an fd
/// mechanism, they are fetched from the exporter with `pidfd_getfd`.
/// `access` is [`Access::ReadWrite`], or [`Access::ReadOnly`], which maps VMM
/// memory (the vmm and fabric mechanisms) with
/// `CU_MEM_ACCESS_FLAGS_PROT_READ`, so that writes through the mapping fail
/// ([`Mapping::read_only`] says so).
///
/// # Errors
/// [`Error::Unsupported`] for a read-only mapping of legacy or pool memory
/// (see [`Mechanism::check_access`]), before anything is opened.
#[tracing::instrument(level = "debug", skip_all, fields(mechanism = %descriptor.mechanism(), pid = descriptor.pid, len = descriptor.byte_len, %access))]
pub fn open_mapping(
    device: &Device,
    descriptor: &Descriptor,
    fds: Vec<OwnedFd>,
    access: Access,
) -> Result<Arc<dyn Mapping>> {
    descriptor.validate()?;
    descriptor.mechanism().check_access(access)?;
    let mut fds = fds.into_iter();
    let mut take_fd = |number: i32| -> Result<OwnedFd> {
        match fds.next() {
            Some(fd) => Ok(fd),
            None => fetch_fd(descriptor.pid, number),
        }
    };
    Ok(match descriptor.source {
        Source::Legacy { handle } => {
            // The flag is required by the driver, and enables peer access
            // when the memory lives on another GPU.
            LegacyMapping::open(device, handle, OpenFlags::LAZY_ENABLE_PEER_ACCESS)?
        }
        Source::Vmm { fd } => {
            // Memory of another GPU of this process: grant that GPU access too.
            let owner = if descriptor.device_uuid == device.uuid() {
                None
            } else {
                crate::device::ordinal_of(descriptor.device_uuid)?
            };
            VmmMapping::import_fd_with(
                device,
                take_fd(fd)?,
                descriptor.alloc_size,
                owner.as_slice(),
                access,
            )?
        }
        Source::Fabric { handle } => {
            VmmMapping::import_fabric(device, handle, descriptor.alloc_size, access)?
        }
        Source::Pool { fd, ptr } => {
            let pool = ImportedPool::import(device, take_fd(fd)?)?;
            pool.import_pointer(ptr, descriptor.alloc_size)?
        }
    })
}

/// Maps the exported bytes of a descriptor as a buffer of `T` and, if the
/// descriptor carries an event, makes the buffer's stream wait on it.
///
/// `T`'s size must match the descriptor's element size, or be 1 (bytes).
pub fn open<T: Pod>(
    device: &Device,
    descriptor: &Descriptor,
    fds: Vec<OwnedFd>,
) -> Result<MappedBuffer<T>> {
    let size = std::mem::size_of::<T>() as u64;
    if size != 1 && size != descriptor.dtype.size() {
        return Err(Error::arg(
            "element type",
            format!(
                "{} is {size} bytes but the descriptor holds {} ({} bytes)",
                std::any::type_name::<T>(),
                descriptor.dtype,
                descriptor.dtype.size()
            ),
        ));
    }
    let mapping = open_mapping(device, descriptor, fds, Access::ReadWrite)?;
    let buffer = MappedBuffer::<T>::from_bytes(mapping, descriptor.offset, descriptor.byte_len)?;
    if let Some(handle) = descriptor.event {
        let event = IpcEvent::open(device, handle)?;
        event.wait_on(buffer.stream())?;
    }
    Ok(buffer)
}
