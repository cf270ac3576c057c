//! GPU-side fences: ordering two processes' GPU work through a shared
//! 64-bit word, with no interprocess event and no host wait.
//!
//! A [`Fence`] is a small block of shared memory (device memory, or host
//! memory registered with the driver) holding `words` sequence words (one per fence: one per ring slot, one per published
//! entry, or one for a whole stream of frames). The producer, after queuing
//! its writes, queues [`Fence::signal`] on the same stream: the device
//! writes the sequence number into the word once the work before it is done
//! (`cuStreamWriteValue64`, preceded by a memory barrier). The consumer maps
//! the block once ([`FenceMapping::open`]) and, before reading, queues
//! [`FenceMapping::wait`] on its stream: the device holds the stream until
//! the word reaches the sequence number (`cuStreamWaitValue64`,
//! `CU_STREAM_WAIT_VALUE_GEQ`).
//!
//! Interprocess events live in `/dev/shm`, so a consumer with its own
//! `/dev/shm` (every Docker container by default) cannot open them
//! (`cuIpcOpenEventHandle` fails with `CUDA_ERROR_MAP_FAILED`). A fence is
//! plain shared memory, exported like any buffer (VMM file descriptors where
//! the device has them, which pass over the channel as capabilities; legacy
//! handles where that is all there is), so it works wherever the memory
//! itself can be shared.
//!
//! # Contract
//! - **One writer per word.** Only the producer that created the block
//!   signals, and a word's signals come from one stream (or streams ordered
//!   with each other). [`Fence::signal`] refuses a sequence number that is
//!   not larger than the word's previous one.
//! - **Sequence numbers** start at 1 (a new word holds 0: nothing signalled),
//!   increase strictly, never wrap, and stay at most [`MAX_SEQ`] (2^62 - 1:
//!   a billion signals a second for 146 years). The device compares
//!   cyclically (`(int64_t)(*word - seq) >= 0`), and the limit keeps that
//!   equal to a plain `>=`.
//! - **Waiting for `seq` is satisfied by any later value**, so a consumer
//!   that falls behind is never stuck, and a ring can reuse a word per slot.
//! - **When the producer dies** the word keeps its last value: the memory
//!   stays mapped for as long as the consumer's [`FenceMapping`] lives (the
//!   GPU tests check this for VMM device words and for host words), and no
//!   driver error reaches the consumer. A stream already waiting on a
//!   value that will never come would wait for ever. Two ways out:
//!   - wait with a host-side deadline before queuing anything
//!     ([`FenceMapping::wait_within`], [`FenceMapping::wait_host`]);
//!   - or queue waits freely and, when the producer is known to be gone
//!     (the exchange learns it from the socket or a pidfd), call
//!     [`FenceMapping::abandon`]: it writes [`ABANDONED`] into the words
//!     from this side, which releases every queued wait. The data behind
//!     an abandoned fence is whatever the producer left; the caller that
//!     abandons must not use it.
//! - **Dropping a block never waits, and never frees words a stream still
//!   uses.** [`Fence::signal`] and [`FenceMapping::wait`] record the stream
//!   they queue on; dropping the [`Fence`] or the [`FenceMapping`] retires
//!   the words to the [reaper](crate::reaper) until every such stream has
//!   passed the work queued so far. A wait that never ends (a producer that
//!   died without signalling, and no [`FenceMapping::abandon`]) keeps the
//!   words mapped, and the reaper logs it.
//!
//! # Where the words live
//! - **Device words** ([`Fence::new`], the default): the block is device
//!   memory exported like any buffer. The device reads and writes it at
//!   full speed; the host reads a word with a small copy (microseconds).
//! - **Host words** ([`Fence::new_host`]): the block is a sealed memfd,
//!   mapped into both processes and registered with the driver
//!   (`cuMemHostRegister`). The device writes and waits on it across the
//!   bus; the CPU of either side reads it directly (nanoseconds), so host
//!   waits ([`FenceMapping::wait_host`]) cost no driver call. A memfd is not
//!   in `/dev/shm`, so this works in containers too; it travels as a file
//!   descriptor, like a VMM export.
//!
//! # In the exchange
//! A publisher holds one block of host words for its entries (two words per
//! entry: the one the device signals, and one the host writes with the last
//! sequence number queued, for subscribers that attach late) and one block
//! per ring (a word per slot). Every publish, update and ring frame records
//! the publisher's event *and* signals the entry's or slot's word; the
//! block's [`FenceBlock`] travels in the entry's metadata and its memfd beside
//! the entry's descriptors, so each subscriber receives it with what it
//! attaches. The sync mode is the subscriber's choice
//! (`exchange::SyncMode`): the event where it opens, else the fence (a
//! private `/dev/shm`, another user), or either one always. A fence wait
//! starts with a host-side deadline ([`FenceMapping::wait_within`]); when
//! the socket says the publisher is gone, the word is abandoned.
//!
//! # Wire form
//! The block travels once as a [`FenceBlock`] (the number of words, and
//! for device words the block's [`Descriptor`], for host words the memfd's
//! number and the exporter's pid; the file descriptors travel beside it); each
//! publish names its word and sequence number with a small [`FenceRef`].
//! Both are serde types decoded strictly, ready to be embedded in the
//! exchange's messages.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cudarc::driver::CudaStream;
use serde::{Deserialize, Serialize};

use crate::buffer::{Mapping, UsedStreams};
use crate::descriptor::{Descriptor, Dtype, Mechanism};
use crate::device::{Capabilities, Device};
use crate::error::{Error, Result, from_cudarc};
use crate::memory::DeviceMemory;
use crate::result::{device as dev, mem, stream as rstream, stream_mem as raw};
use crate::share::SharedBuffer;

/// The largest sequence number a fence accepts (2^62 - 1).
pub const MAX_SEQ: u64 = (1 << 62) - 1;

/// The value [`FenceMapping::abandon`] writes: larger than every sequence
/// number, so that every wait on the word is satisfied.
pub const ABANDONED: u64 = 1 << 62;

/// The most words one block holds (512 KiB of sequence words).
pub const MAX_WORDS: u32 = 1 << 16;

/// The size of one sequence word in bytes.
const WORD: u64 = 8;

/// Checks that `device` can queue 64-bit stream memory operations
/// (`CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS`), which fences need.
///
/// # Errors
/// [`Error::Unsupported`] (kind `Unavailable`) when it cannot.
#[doc(alias = "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS")]
pub fn check_support(device: &Device) -> Result<()> {
    let attr = dev::Attr::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS;
    if dev::attribute(device.context().cu_device(), attr)? == 1 {
        Ok(())
    } else {
        Err(Error::Unsupported {
            what: "GPU-side fences",
            why: format!(
                "device {} cannot queue 64-bit stream memory operations \
                 (CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS is 0); use interprocess events instead",
                device.ordinal()
            ),
        })
    }
}

fn check_seq(seq: u64) -> Result<()> {
    if seq == 0 || seq > MAX_SEQ {
        return Err(Error::arg(
            "sequence number",
            format!("{seq} is outside 1..={MAX_SEQ}; sequence numbers start at 1 and never wrap"),
        ));
    }
    Ok(())
}

fn check_word(word: u32, words: u32) -> Result<()> {
    if word >= words {
        return Err(Error::arg(
            "fence word",
            format!("index {word} is past the block's {words} words"),
        ));
    }
    Ok(())
}

/// Numbers host blocks of this process; mixed with the pid, and with bit 39
/// set so that no host block shares an identity with a device block
/// (whose identity is its allocation's generation).
static HOST_BLOCKS: AtomicU64 = AtomicU64::new(1);

fn next_host_id() -> u64 {
    (u64::from(std::process::id()) << 40) | (1 << 39) | HOST_BLOCKS.fetch_add(1, Ordering::Relaxed)
}

/// The bytes of a host block of `words` words: whole pages.
fn host_len(words: u32) -> usize {
    (u64::from(words) * WORD).next_multiple_of(4096) as usize
}

/// Creates a sealed memfd of `len` bytes: it can never shrink or grow, so
/// that no process holding it can make another's mapping fault.
fn create_memfd(len: usize) -> Result<OwnedFd> {
    use rustix::fs::{MemfdFlags, SealFlags};
    let io = |what: &str, e: rustix::io::Errno| {
        Error::io(format!("creating a fence block ({what})"), e.into())
    };
    let fd = rustix::fs::memfd_create(
        "cuda-ipc-fence",
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )
    .map_err(|e| io("memfd_create", e))?;
    rustix::fs::ftruncate(&fd, len as u64).map_err(|e| io("ftruncate", e))?;
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
        .map_err(|e| io("fcntl F_ADD_SEALS", e))?;
    Ok(fd)
}

/// Checks that `fd`, received from another process, is a memfd sealed
/// against shrinking and holds at least `len` bytes.
fn check_memfd(fd: &OwnedFd, len: usize) -> Result<()> {
    let bad = |reason: String| Error::arg("fence block's file descriptor", reason);
    let seals = rustix::fs::fcntl_get_seals(fd).map_err(|e| {
        bad(format!(
            "it is not a sealed memfd ({e}); host fence blocks come from Fence::new_host"
        ))
    })?;
    if !seals.contains(rustix::fs::SealFlags::SHRINK) {
        return Err(bad(
            "its memfd can still shrink, which would fault our mapping; the exporter must seal it"
                .into(),
        ));
    }
    let size = rustix::fs::fstat(fd)
        .map_err(|e| Error::io("reading the fence block's size (fstat)", e.into()))?
        .st_size;
    if u64::try_from(size).unwrap_or(0) < len as u64 {
        return Err(bad(format!(
            "its memfd holds {size} bytes, fewer than the {len} its words need"
        )));
    }
    Ok(())
}

/// Sequence words in a memfd mapped into this process and registered with
/// the driver, reachable by the CPU at `ptr` and by the device at `dptr`.
#[derive(Debug)]
struct HostWords {
    device: Device,
    fd: OwnedFd,
    ptr: *mut c_void,
    len: usize,
    dptr: u64,
}

// SAFETY: the mapping is process-wide memory, accessed only through atomics
// and driver calls that bind the context first.
unsafe impl Send for HostWords {}
// SAFETY: as above.
unsafe impl Sync for HostWords {}

impl HostWords {
    /// Maps `len` bytes of `fd` and registers them with the driver.
    fn map(device: &Device, fd: OwnedFd, len: usize) -> Result<Self> {
        use rustix::mm::{MapFlags, ProtFlags};
        // SAFETY: a new shared mapping of a sealed memfd of at least `len`
        // bytes (checked by the callers): it aliases no Rust object.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                0,
            )
        }
        .map_err(|e| Error::io("mapping a fence block (mmap)", e.into()))?;
        let unmap = || {
            // SAFETY: mapped above, not yet registered or shared.
            let _ = unsafe { rustix::mm::munmap(ptr, len) };
        };
        let registered = device.bind().and_then(|()| {
            // SAFETY: `ptr..ptr + len` is the page-aligned mapping made above,
            // unregistered in drop before it is unmapped.
            unsafe { raw::host_register(ptr, len) }
        });
        if let Err(e) = registered {
            unmap();
            return Err(e);
        }
        // SAFETY: registered just above.
        match unsafe { raw::host_device_pointer(ptr) } {
            Ok(dptr) => Ok(HostWords {
                device: device.clone(),
                fd,
                ptr,
                len,
                dptr,
            }),
            Err(e) => {
                // SAFETY: registered above; nothing has used it.
                let _ = unsafe { raw::host_unregister(ptr) };
                unmap();
                Err(e)
            }
        }
    }

    /// Word `i`, which the caller has checked is in range.
    fn word(&self, i: u32) -> &AtomicU64 {
        // SAFETY: `ptr` is page-aligned, the mapping holds at least `i + 1`
        // words and lives as long as `self`; other processes and the device
        // touch it only with aligned 64-bit accesses.
        unsafe { &*self.ptr.cast::<AtomicU64>().add(i as usize) }
    }
}

impl Drop for HostWords {
    fn drop(&mut self) {
        // Errors cannot be raised from drop: an unregister that fails leaves
        // pinned pages until the process exits, a failed unmap the same.
        // The words are dropped only by the release a `Fence` or
        // `FenceMapping` retired, after every stream that signalled or
        // waited on them has finished (see their `Drop`).
        let _ = self.device.bind();
        // SAFETY: registered in `map`, unregistered once, then unmapped once.
        unsafe {
            let _ = raw::host_unregister(self.ptr);
            let _ = rustix::mm::munmap(self.ptr, self.len);
        }
    }
}

/// Where a block's words are.
#[derive(Debug)]
enum Words {
    Device(SharedBuffer),
    Host(HostWords),
}

/// The producer's side: a block of sequence words in shared device memory
/// ([`Fence::new`]) or in host memory registered with the driver
/// ([`Fence::new_host`]).
///
/// Dropping it frees the block once every consumer has unmapped it (as
/// for any shared buffer, or memfd); a consumer's mapping keeps the memory
/// alive.
#[derive(Debug)]
pub struct Fence {
    /// Shared with the release retired at drop, which lets go of it.
    words: Arc<Words>,
    /// The streams signals were queued on, waited for before the words go.
    streams: UsedStreams,
    count: u32,
    id: u64,
    last: Box<[AtomicU64]>,
}

impl Fence {
    /// Allocates a block of `words` sequence words in device memory on
    /// `device`, all 0, shared with `mechanism` (`None`: the best the device
    /// supports; file descriptor mechanisms first).
    ///
    /// # Errors
    /// [`Error::Unsupported`] when the device has no 64-bit stream memory
    /// operations ([`check_support`]) or cannot share memory that way;
    /// [`Error::InvalidArgument`] for 0 words or more than [`MAX_WORDS`].
    pub fn new(device: &Device, words: u32, mechanism: Option<Mechanism>) -> Result<Self> {
        check_count(words)?;
        check_support(device)?;
        let mechanism = fence_mechanism(&device.capabilities()?, mechanism)?;
        let buffer = SharedBuffer::alloc(device, words as usize * WORD as usize, Some(mechanism))?;
        device.bind()?;
        let s = buffer.stream().cu_stream();
        // SAFETY: the buffer holds `words` 8-byte words, so `2 * words`
        // 4-byte words from its (aligned) start; we wait for the set.
        unsafe {
            mem::set_d32_async(buffer.device_address(), 0, 2 * words as usize, s)?;
            rstream::synchronize(s)?;
        }
        Ok(Fence {
            id: buffer.generation(),
            words: Arc::new(Words::Device(buffer)),
            streams: UsedStreams::default(),
            count: words,
            last: (0..words).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    /// Allocates a block of `words` sequence words in host memory (a sealed
    /// memfd registered with the driver), all 0: the device reaches them
    /// across the bus, the CPU of both sides directly. See the module's
    /// "Where the words live".
    ///
    /// # Errors
    /// As [`Fence::new`], and [`Error::Io`] when the memfd cannot be made
    /// or mapped.
    #[doc(alias = "cuMemHostRegister")]
    pub fn new_host(device: &Device, words: u32) -> Result<Self> {
        check_count(words)?;
        check_support(device)?;
        let len = host_len(words);
        // A new memfd reads as zeros.
        let host = HostWords::map(device, create_memfd(len)?, len)?;
        Ok(Fence {
            words: Arc::new(Words::Host(host)),
            streams: UsedStreams::default(),
            count: words,
            id: next_host_id(),
            last: (0..words).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    /// The number of sequence words.
    pub fn words(&self) -> u32 {
        self.count
    }

    /// The block's identity on the wire (for device words, its
    /// allocation's generation).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Whether the words live in host memory ([`Fence::new_host`]).
    pub fn is_host(&self) -> bool {
        matches!(*self.words, Words::Host(_))
    }

    /// The mechanism a device block is shared with (`None` for host words).
    pub fn mechanism(&self) -> Option<Mechanism> {
        match &*self.words {
            Words::Device(b) => Some(b.mechanism()),
            Words::Host(_) => None,
        }
    }

    /// The last sequence number signalled on `word` (0: none yet).
    pub fn last_signalled(&self, word: u32) -> Result<u64> {
        check_word(word, self.count)?;
        Ok(self.last[word as usize].load(Ordering::Acquire))
    }

    /// Exports the block: its [`FenceBlock`] and the file descriptors to
    /// hand over with it (none for legacy). Each call makes new descriptors.
    pub fn export(&self) -> Result<FenceExport> {
        match &*self.words {
            Words::Device(buffer) => {
                let e = buffer.export_region(
                    0,
                    u64::from(self.count) * WORD,
                    Dtype::U64,
                    Some(vec![u64::from(self.count)]),
                )?;
                Ok(FenceExport {
                    block: FenceBlock::new(e.descriptor, self.count)?,
                    fds: e.fds,
                })
            }
            Words::Host(host) => {
                let fd = host
                    .fd
                    .try_clone()
                    .map_err(|e| Error::io("duplicating the fence block's memfd", e))?;
                Ok(FenceExport {
                    block: FenceBlock::host(
                        fd.as_raw_fd(),
                        std::process::id(),
                        self.id,
                        self.count,
                    )?,
                    fds: vec![fd],
                })
            }
        }
    }

    /// The reference a consumer needs to wait for `seq` on `word`.
    pub fn reference(&self, word: u32, seq: u64) -> Result<FenceRef> {
        check_word(word, self.count)?;
        check_seq(seq)?;
        Ok(FenceRef {
            block: self.id(),
            word,
            seq,
        })
    }

    /// Queues on `stream` the write of `seq` into `word`, after the work
    /// already queued there (`cuStreamWriteValue64`, with a memory barrier
    /// first, so that consumers that see `seq` see the work's writes).
    /// Does not wait.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `word` is out of range, or `seq` is 0,
    /// above [`MAX_SEQ`] or not above the word's previous signal (one
    /// writer, increasing numbers). A driver error (the stream's context
    /// is broken) spends the number all the same: the next signal on the
    /// word must use a larger one.
    #[doc(alias = "cuStreamWriteValue64")]
    pub fn signal(&self, stream: &Arc<CudaStream>, word: u32, seq: u64) -> Result<()> {
        check_word(word, self.count)?;
        check_seq(seq)?;
        let last = &self.last[word as usize];
        last.fetch_update(Ordering::AcqRel, Ordering::Acquire, |prev| {
            (seq > prev).then_some(seq)
        })
        .map_err(|prev| {
            Error::arg(
                "sequence number",
                format!("{seq} is not above {prev}, the last one signalled on word {word}"),
            )
        })?;
        self.device().bind()?;
        let addr = match &*self.words {
            Words::Device(b) => b.device_address(),
            Words::Host(h) => h.dptr,
        } + u64::from(word) * WORD;
        self.streams.record(stream);
        // SAFETY: `addr` is an aligned word of this block, which stays
        // mapped while any stream still uses it (the stream is recorded:
        // dropping the block retires the words until it has finished); the
        // stream is live (borrowed).
        unsafe { raw::write_value64(stream.cu_stream(), addr, seq) }
    }

    /// Stores `value` into `word` from the host, now (host words only): for
    /// words the device never signals, such as the last sequence number a
    /// producer queued, which a consumer that attaches late reads to know
    /// what to wait for. A word is either signalled or announced, never both.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for device words; [`Error::InvalidArgument`]
    /// if `word` is out of range.
    pub fn announce(&self, word: u32, value: u64) -> Result<()> {
        check_word(word, self.count)?;
        match &*self.words {
            Words::Host(h) => {
                h.word(word).store(value, Ordering::Release);
                Ok(())
            }
            Words::Device(_) => Err(Error::Unsupported {
                what: "announcing a fence word from the host",
                why: "the block's words are device memory; use a block of host words \
                      (Fence::new_host)"
                    .into(),
            }),
        }
    }

    /// The device this block belongs to.
    pub fn device(&self) -> &Device {
        match &*self.words {
            Words::Device(b) => b.device(),
            Words::Host(h) => &h.device,
        }
    }
}

/// The mechanism for a block of device words: `requested`, or VMM where
/// VMM file descriptors work and legacy IPC otherwise. Never a memory pool:
/// on driver 580 `cuStreamWaitValue64` on an imported pool pointer fails
/// with CUDA_ERROR_INVALID_VALUE (measured on an H200), so a consumer could
/// not wait on the words.
fn fence_mechanism(caps: &Capabilities, requested: Option<Mechanism>) -> Result<Mechanism> {
    match requested {
        Some(Mechanism::Pool) => Err(Error::Unsupported {
            what: "fence words in pool memory",
            why: "a consumer cannot queue cuStreamWaitValue64 on an imported pool pointer \
                  (CUDA_ERROR_INVALID_VALUE); put the words in vmm or legacy memory, or in host memory \
                  (Fence::new_host)"
                .into(),
        }),
        Some(m) => Ok(m),
        None if caps.vmm && caps.posix_fd => Ok(Mechanism::Vmm),
        None => Ok(Mechanism::Legacy),
    }
}

fn check_count(words: u32) -> Result<()> {
    if words == 0 || words > MAX_WORDS {
        return Err(Error::arg(
            "fence words",
            format!("{words} is outside 1..={MAX_WORDS}"),
        ));
    }
    Ok(())
}

/// An export of a [`Fence`]: the record to send and the file descriptors
/// to send with it.
#[derive(Debug)]
pub struct FenceExport {
    /// The record, for the exchange's messages.
    pub block: FenceBlock,
    /// The file descriptors (none for legacy and fabric).
    pub fds: Vec<OwnedFd>,
}

/// The consumer's side: a [`Fence`] block of another process, mapped.
#[derive(Debug)]
pub struct FenceMapping {
    /// Shared with the release retired at drop, which lets go of it.
    words: Arc<MappedWords>,
    /// The streams waits were queued on, waited for before the words go.
    streams: UsedStreams,
    count: u32,
    id: u64,
}

/// Where a mapped block's words are.
#[derive(Debug)]
enum MappedWords {
    Device {
        mapping: Arc<dyn Mapping>,
        base: u64,
        /// A stream of our own for host reads and writes of the words,
        /// which must not queue behind the caller's streams (one may be
        /// waiting on a word).
        host_stream: Arc<CudaStream>,
    },
    Host(HostWords),
}

impl FenceMapping {
    /// Maps the block that `block` describes; `fds` are the file
    /// descriptors that came with it (empty: fetched from the exporter with
    /// `pidfd_getfd`, as for any descriptor).
    ///
    /// # Errors
    /// [`Error::Unsupported`] when this device has no 64-bit stream memory
    /// operations; for device words every error of
    /// [`crate::share::open_mapping`]; for host words
    /// [`Error::InvalidArgument`] when the file descriptor is not a sealed
    /// memfd large enough for the words.
    pub fn open(device: &Device, block: &FenceBlock, fds: Vec<OwnedFd>) -> Result<Self> {
        block.validate()?;
        check_support(device)?;
        let words = match &block.placement {
            Placement::Device(d) => {
                let mapping = crate::share::open_mapping(device, d, fds)?;
                if d.offset + d.byte_len > mapping.size() {
                    return Err(Error::OutOfBounds {
                        offset: d.offset,
                        len: d.byte_len,
                        size: mapping.size(),
                    });
                }
                device.bind()?;
                let host_stream = device
                    .context()
                    .new_stream()
                    .map_err(|e| from_cudarc("cuStreamCreate", e))?;
                MappedWords::Device {
                    base: mapping.base() + d.offset,
                    mapping,
                    host_stream,
                }
            }
            Placement::Host { fd, pid, .. } => {
                let fd = match fds.into_iter().next() {
                    Some(fd) => fd,
                    None => crate::share::fetch_fd(*pid, *fd)?,
                };
                let len = host_len(block.words);
                check_memfd(&fd, len)?;
                MappedWords::Host(HostWords::map(device, fd, len)?)
            }
        };
        Ok(FenceMapping {
            words: Arc::new(words),
            streams: UsedStreams::default(),
            count: block.words,
            id: block.id(),
        })
    }

    /// The number of sequence words.
    pub fn words(&self) -> u32 {
        self.count
    }

    /// The block's identity ([`Fence::id`] in the producer).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Whether the words live in host memory ([`Fence::new_host`]).
    pub fn is_host(&self) -> bool {
        matches!(*self.words, MappedWords::Host(_))
    }

    /// Checks that `r` names a word of this block, and returns the word.
    pub fn resolve(&self, r: &FenceRef) -> Result<u32> {
        if r.block != self.id {
            return Err(Error::arg(
                "fence reference",
                format!(
                    "it names fence block {:#x}, but this mapping is block {:#x}; open the block it names first",
                    r.block, self.id
                ),
            ));
        }
        check_word(r.word, self.count)?;
        Ok(r.word)
    }

    /// The device address of `word`.
    fn addr(&self, word: u32) -> Result<u64> {
        check_word(word, self.count)?;
        let base = match &*self.words {
            MappedWords::Device { base, .. } => *base,
            MappedWords::Host(h) => h.dptr,
        };
        Ok(base + u64::from(word) * WORD)
    }

    /// Queues on `stream` a wait (on the device, not the host) until `word`
    /// holds `seq` or more (`cuStreamWaitValue64`, `GEQ`). Does not wait.
    ///
    /// If the producer dies before signalling, the stream waits until
    /// [`FenceMapping::abandon`] releases it; see the module's contract.
    #[doc(alias = "cuStreamWaitValue64")]
    pub fn wait(&self, stream: &Arc<CudaStream>, word: u32, seq: u64) -> Result<()> {
        check_seq(seq)?;
        let addr = self.addr(word)?;
        self.device().bind()?;
        self.streams.record(stream);
        // SAFETY: `addr` is an aligned word of this mapping, which stays
        // mapped while `self` lives and, the stream being recorded, after
        // `self` is dropped until the stream has passed the wait.
        unsafe { raw::wait_value64_geq(stream.cu_stream(), addr, seq) }
    }

    /// [`FenceMapping::wait`] for a reference received from the producer.
    pub fn wait_ref(&self, stream: &Arc<CudaStream>, r: &FenceRef) -> Result<()> {
        let word = self.resolve(r)?;
        self.wait(stream, word, r.seq)
    }

    /// Polls `word` from the host for up to `timeout`; when it reaches
    /// `seq`, queues the device-side wait on `stream` (which then costs
    /// nothing) and returns true. Returns false, having queued nothing,
    /// when the deadline passes: the way out when the producer may be gone.
    pub fn wait_within(
        &self,
        stream: &Arc<CudaStream>,
        word: u32,
        seq: u64,
        timeout: Duration,
    ) -> Result<bool> {
        if !self.wait_host(word, seq, timeout)? {
            return Ok(false);
        }
        self.wait(stream, word, seq)?;
        Ok(true)
    }

    /// The value `word` holds now: for host words a load, for device words
    /// an 8-byte copy on a stream of this mapping's own.
    #[doc(alias = "cuMemcpyDtoHAsync")]
    pub fn value(&self, word: u32) -> Result<u64> {
        let addr = self.addr(word)?;
        let (mapping, host_stream) = match &*self.words {
            MappedWords::Host(h) => return Ok(h.word(word).load(Ordering::Acquire)),
            MappedWords::Device {
                mapping,
                host_stream,
                ..
            } => (mapping, host_stream),
        };
        mapping.device().bind()?;
        let mut v = 0u64;
        let s = host_stream.cu_stream();
        // SAFETY: `addr` is an aligned word of the mapping; `v` outlives the
        // copy because we wait for the stream before returning.
        unsafe {
            mem::copy_dtoh_async((&raw mut v).cast(), addr, 8, s)?;
            rstream::synchronize(s)?;
        }
        Ok(v)
    }

    /// Whether `word` has reached `seq` (or was abandoned).
    pub fn is_reached(&self, word: u32, seq: u64) -> Result<bool> {
        check_seq(seq)?;
        Ok(self.value(word)? >= seq)
    }

    /// Blocks the calling thread until `word` reaches `seq` (true) or
    /// `timeout` passes (false). Polls: spinning for the first 50 µs, then
    /// sleeping a little longer each time, up to 1 ms.
    pub fn wait_host(&self, word: u32, seq: u64, timeout: Duration) -> Result<bool> {
        check_seq(seq)?;
        let started = Instant::now();
        let mut nap = Duration::from_micros(10);
        loop {
            if self.value(word)? >= seq {
                return Ok(true);
            }
            let elapsed = started.elapsed();
            if elapsed >= timeout {
                return Ok(false);
            }
            if elapsed > Duration::from_micros(50) {
                std::thread::sleep(nap.min(timeout.saturating_sub(elapsed)));
                nap = (nap * 2).min(Duration::from_millis(1));
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// Writes [`ABANDONED`] into `word` (`None`: every word) from this
    /// side, releasing every stream that waits on it, and waits for the
    /// write. For use when the producer is known to be gone; the data the
    /// fence guarded must then not be used.
    #[doc(alias = "cuMemcpyHtoDAsync")]
    pub fn abandon(&self, word: Option<u32>) -> Result<()> {
        let (first, count) = match word {
            Some(w) => (w, 1),
            None => (0, self.count),
        };
        let addr = self.addr(first)?;
        let (mapping, host_stream) = match &*self.words {
            MappedWords::Host(h) => {
                for w in first..first + count {
                    h.word(w).store(ABANDONED, Ordering::Release);
                }
                return Ok(());
            }
            MappedWords::Device {
                mapping,
                host_stream,
                ..
            } => (mapping, host_stream),
        };
        let values = vec![ABANDONED; count as usize];
        mapping.device().bind()?;
        let s = host_stream.cu_stream();
        // SAFETY: `count` words from `addr` lie inside the mapping; the host
        // vector outlives the copy because we wait for the stream.
        unsafe {
            mem::copy_htod_async(addr, values.as_ptr().cast(), values.len() * 8, s)?;
            rstream::synchronize(s)
        }
    }

    /// The device the block is mapped on.
    pub fn device(&self) -> &Device {
        match &*self.words {
            MappedWords::Device { mapping, .. } => mapping.device(),
            MappedWords::Host(h) => &h.device,
        }
    }
}

impl Drop for FenceMapping {
    fn drop(&mut self) {
        // Our host stream's copies were all waited for. The streams waits
        // were queued on may still wait on a word (a producer that never
        // signals keeps them waiting): the words are let go of once they
        // have passed, by the reaper, never here.
        let words = self.words.clone();
        self.streams.retire(
            self.device().stream(),
            "unmapping a fence block",
            move || crate::reaper::work_done(|| drop(words)),
        );
    }
}

impl Drop for Fence {
    fn drop(&mut self) {
        // Signals queued on the recorded streams write the words: they are
        // let go of once those streams (and the block's own) have finished,
        // by the reaper, never here.
        let words = self.words.clone();
        let own = match &*self.words {
            Words::Device(b) => b.stream().clone(),
            Words::Host(h) => h.device.stream().clone(),
        };
        self.streams
            .retire(&own, "releasing a fence block", move || {
                crate::reaper::work_done(|| drop(words));
            });
    }
}

// ---------------------------------------------------------------------------
// Wire form

/// A fence block as it travels once from producer to consumer: where its
/// words are and how many. Serialises as `{"descriptor": {...}, "words":
/// N}` for device words and `{"host": {"fd": F, "pid": P, "id": I},
/// "words": N}` for host words (a memfd, whose descriptor travels beside
/// the record, or is fetched from process `pid` as descriptor `fd`).
/// Decoding refuses unknown fields, both or neither placement, and a
/// descriptor that is not a valid export of exactly `words` 8-byte words
/// with a generation (the block's identity).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawFenceBlock", into = "RawFenceBlock")]
pub struct FenceBlock {
    placement: Placement,
    words: u32,
}

/// Where a block's words are, on the wire.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Placement {
    Device(Box<Descriptor>),
    Host { fd: i32, pid: u32, id: u64 },
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFenceBlock {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    descriptor: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    host: Option<RawHost>,
    words: u32,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHost {
    fd: i32,
    pid: u32,
    id: u64,
}

impl TryFrom<RawFenceBlock> for FenceBlock {
    type Error = Error;
    fn try_from(raw: RawFenceBlock) -> Result<Self> {
        match (raw.descriptor, raw.host) {
            (Some(d), None) => FenceBlock::new(Descriptor::from_value(&d)?, raw.words),
            (None, Some(h)) => FenceBlock::host(h.fd, h.pid, h.id, raw.words),
            (Some(_), Some(_)) => Err(Error::arg(
                "fence block",
                "it has both `descriptor` (device words) and `host` (host words); it needs one",
            )),
            (None, None) => Err(Error::arg(
                "fence block",
                "it has neither `descriptor` (device words) nor `host` (host words)",
            )),
        }
    }
}

impl From<FenceBlock> for RawFenceBlock {
    fn from(b: FenceBlock) -> Self {
        let (descriptor, host) = match b.placement {
            Placement::Device(d) => (Some(d.to_value()), None),
            Placement::Host { fd, pid, id } => (None, Some(RawHost { fd, pid, id })),
        };
        RawFenceBlock {
            descriptor,
            host,
            words: b.words,
        }
    }
}

impl FenceBlock {
    /// A record of device words, checked as decoding checks it.
    pub fn new(descriptor: Descriptor, words: u32) -> Result<Self> {
        let b = FenceBlock {
            placement: Placement::Device(Box::new(descriptor)),
            words,
        };
        b.validate()?;
        Ok(b)
    }

    /// A record of host words: the memfd is descriptor `fd` of process
    /// `pid`, and the block's identity is `id`.
    pub fn host(fd: i32, pid: u32, id: u64, words: u32) -> Result<Self> {
        let b = FenceBlock {
            placement: Placement::Host { fd, pid, id },
            words,
        };
        b.validate()?;
        Ok(b)
    }

    fn validate(&self) -> Result<()> {
        let bad = |reason: String| Error::arg("fence block", reason);
        if self.words == 0 || self.words > MAX_WORDS {
            return Err(bad(format!(
                "{} words is outside 1..={MAX_WORDS}",
                self.words
            )));
        }
        let d = match &self.placement {
            Placement::Host { fd, pid, .. } => {
                if *fd < 0 {
                    return Err(bad(format!("{fd} is not a file descriptor number")));
                }
                if *pid == 0 {
                    return Err(bad("process id 0 names no exporting process".into()));
                }
                return Ok(());
            }
            Placement::Device(d) => d,
        };
        d.validate()?;
        if d.dtype != Dtype::U64 {
            return Err(bad(format!(
                "its descriptor holds {}, not u64 sequence words",
                d.dtype
            )));
        }
        if d.byte_len != u64::from(self.words) * WORD {
            return Err(bad(format!(
                "its descriptor exports {} bytes, not {} words of 8 bytes",
                d.byte_len, self.words
            )));
        }
        if !d.offset.is_multiple_of(WORD) {
            return Err(bad(format!("offset {} is not 8-byte aligned", d.offset)));
        }
        if d.generation.is_none() {
            return Err(bad(
                "its descriptor has no generation, which is the block's identity".into(),
            ));
        }
        Ok(())
    }

    /// The block's descriptor, for device words.
    pub fn descriptor(&self) -> Option<&Descriptor> {
        match &self.placement {
            Placement::Device(d) => Some(d),
            Placement::Host { .. } => None,
        }
    }

    /// Whether the words live in host memory.
    pub fn is_host(&self) -> bool {
        matches!(self.placement, Placement::Host { .. })
    }

    /// The number of sequence words.
    pub fn words(&self) -> u32 {
        self.words
    }

    /// The block's identity ([`Fence::id`] in the producer).
    pub fn id(&self) -> u64 {
        match &self.placement {
            Placement::Device(d) => d.generation.unwrap_or_default(),
            Placement::Host { id, .. } => *id,
        }
    }
}

/// Which word of which block to wait on, and for which sequence number:
/// what a publish carries. Serialises as `{"block": id, "word": i, "seq":
/// n}`; decoding refuses unknown fields, a sequence number outside
/// `1..=MAX_SEQ` and a word index past [`MAX_WORDS`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "RawFenceRef", into = "RawFenceRef")]
pub struct FenceRef {
    /// The block's identity ([`FenceBlock::id`]).
    pub block: u64,
    /// The word's index in the block.
    pub word: u32,
    /// The sequence number to wait for.
    pub seq: u64,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFenceRef {
    block: u64,
    word: u32,
    seq: u64,
}

impl TryFrom<RawFenceRef> for FenceRef {
    type Error = Error;
    fn try_from(raw: RawFenceRef) -> Result<Self> {
        check_word(raw.word, MAX_WORDS)?;
        check_seq(raw.seq)?;
        Ok(FenceRef {
            block: raw.block,
            word: raw.word,
            seq: raw.seq,
        })
    }
}

impl From<FenceRef> for RawFenceRef {
    fn from(r: FenceRef) -> Self {
        RawFenceRef {
            block: r.block,
            word: r.word,
            seq: r.seq,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::OwnedFd;

    use super::{check_memfd, create_memfd, fence_mechanism, host_len};
    use crate::device::{Capabilities, ComputeMode, DeviceUuid};
    use crate::{ErrorKind, Mechanism};

    fn caps(vmm_fds: bool) -> Capabilities {
        Capabilities {
            ordinal: 0,
            name: "test".into(),
            uuid: DeviceUuid([0; 16]),
            pci_bus_id: String::new(),
            compute_capability: (9, 0),
            compute_mode: ComputeMode::Default,
            total_memory: 1 << 30,
            unified_addressing: true,
            ipc_events: true,
            legacy_ipc: true,
            vmm: vmm_fds,
            posix_fd: vmm_fds,
            fabric: false,
            memory_pools: true,
            mempool_handle_types: 1,
            mps: None,
        }
    }

    #[test]
    fn words_never_live_in_pool_memory() {
        assert_eq!(fence_mechanism(&caps(true), None).unwrap(), Mechanism::Vmm);
        assert_eq!(
            fence_mechanism(&caps(false), None).unwrap(),
            Mechanism::Legacy
        );
        assert_eq!(
            fence_mechanism(&caps(true), Some(Mechanism::Legacy)).unwrap(),
            Mechanism::Legacy
        );
        let e = fence_mechanism(&caps(true), Some(Mechanism::Pool)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unavailable);
        assert!(e.to_string().contains("cuStreamWaitValue64"), "{e}");
    }

    #[test]
    fn host_blocks_are_whole_pages() {
        assert_eq!(host_len(1), 4096);
        assert_eq!(host_len(512), 4096);
        assert_eq!(host_len(513), 8192);
        assert_eq!(host_len(super::MAX_WORDS), 512 * 1024);
    }

    #[test]
    fn a_block_memfd_is_sealed_and_sized() {
        let fd = create_memfd(8192).unwrap();
        check_memfd(&fd, 8192).unwrap();
        let e = check_memfd(&fd, 12288).unwrap_err().to_string();
        assert!(e.contains("fewer than"), "{e}");
        assert!(
            rustix::fs::ftruncate(&fd, 4096).is_err(),
            "a sealed memfd shrank"
        );
    }

    #[test]
    fn an_unsealed_or_foreign_descriptor_is_refused() {
        let open = rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&open, 4096).unwrap();
        // Without ALLOW_SEALING a memfd carries F_SEAL_SEAL only.
        let e = check_memfd(&open, 4096).unwrap_err().to_string();
        assert!(e.contains("can still shrink"), "{e}");
        let file: OwnedFd = std::fs::File::open("/dev/null").unwrap().into();
        let e = check_memfd(&file, 4096).unwrap_err().to_string();
        assert!(e.contains("not a sealed memfd"), "{e}");
    }
}
