//! GPU-side fences: ordering two processes' GPU work through a shared
//! 64-bit word, with no interprocess event and no host wait.
//!
//! A [`Fence`] is a small block of shared device memory holding `words`
//! sequence words (one per fence: one per ring slot, one per published
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
//!   stays mapped for as long as the consumer's [`FenceMapping`] lives, and
//!   no driver error reaches the consumer. A stream already waiting on a
//!   value that will never come would wait for ever. Two ways out:
//!   - wait with a host-side deadline before queuing anything
//!     ([`FenceMapping::wait_within`], [`FenceMapping::wait_host`]);
//!   - or queue waits freely and, when the producer is known to be gone
//!     (the exchange learns it from the socket or a pidfd), call
//!     [`FenceMapping::abandon`]: it writes [`ABANDONED`] into the words
//!     from this side, which releases every queued wait. The data behind
//!     an abandoned fence is whatever the producer left; the caller that
//!     abandons must not use it.
//!
//! # Wire form
//! The block travels once as a [`FenceBlock`] (its [`Descriptor`] and the
//! number of words, with the block's file descriptors beside it); each
//! publish names its word and sequence number with a small [`FenceRef`].
//! Both are serde types decoded strictly, ready to be embedded in the
//! exchange's messages.
#![allow(unsafe_code)]

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cudarc::driver::CudaStream;
use serde::{Deserialize, Serialize};

use crate::buffer::Mapping;
use crate::descriptor::{Descriptor, Dtype, Mechanism};
use crate::device::Device;
use crate::error::{Error, Result, from_cudarc};
use crate::memory::DeviceMemory;
use crate::result::{device as dev, mem, stream as rstream};
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

/// The driver symbols this module calls, checked when the driver loads.
pub(crate) const SYMBOLS: &[&str] = &["cuStreamWriteValue64_v2", "cuStreamWaitValue64_v2"];

/// Checked stream memory operations, one function per driver call.
mod raw {
    use cudarc::driver::sys::{self, CUstreamWaitValue_flags, CUstreamWriteValue_flags};

    use crate::error::Result;
    use crate::result::check;

    /// `cuStreamWriteValue64_v2` with the default flags: a memory barrier,
    /// then the write, after the work queued before it on `stream`.
    ///
    /// # Safety
    /// `stream` must be live and `addr` an 8-byte aligned word of device
    /// memory that stays mapped until the stream has passed this write.
    #[doc(alias = "cuStreamWriteValue64")]
    pub(super) unsafe fn write_value64(stream: sys::CUstream, addr: u64, value: u64) -> Result<()> {
        let flags = CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32;
        // SAFETY: the caller's contract; the symbol was checked at load.
        check("cuStreamWriteValue64", unsafe {
            sys::cuStreamWriteValue64_v2(stream, addr, value, flags)
        })
    }

    /// `cuStreamWaitValue64_v2` with `CU_STREAM_WAIT_VALUE_GEQ`: holds
    /// `stream` until `(int64_t)(*addr - value) >= 0`.
    ///
    /// # Safety
    /// As [`write_value64`].
    #[doc(alias = "cuStreamWaitValue64")]
    pub(super) unsafe fn wait_value64_geq(
        stream: sys::CUstream,
        addr: u64,
        value: u64,
    ) -> Result<()> {
        let flags = CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
        // SAFETY: the caller's contract; the symbol was checked at load.
        check("cuStreamWaitValue64", unsafe {
            sys::cuStreamWaitValue64_v2(stream, addr, value, flags)
        })
    }
}

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

/// The producer's side: a block of sequence words in shared device memory.
///
/// Dropping it frees the block once every consumer has unmapped it (as
/// for any shared buffer); a consumer's mapping keeps the memory alive.
#[derive(Debug)]
pub struct Fence {
    buffer: SharedBuffer,
    words: u32,
    last: Box<[AtomicU64]>,
}

impl Fence {
    /// Allocates a block of `words` sequence words on `device`, all 0,
    /// shared with `mechanism` (`None`: the best the device supports; file
    /// descriptor mechanisms first).
    ///
    /// # Errors
    /// [`Error::Unsupported`] when the device has no 64-bit stream memory
    /// operations ([`check_support`]) or cannot share memory that way;
    /// [`Error::InvalidArgument`] for 0 words or more than [`MAX_WORDS`].
    pub fn new(device: &Device, words: u32, mechanism: Option<Mechanism>) -> Result<Self> {
        if words == 0 || words > MAX_WORDS {
            return Err(Error::arg(
                "fence words",
                format!("{words} is outside 1..={MAX_WORDS}"),
            ));
        }
        check_support(device)?;
        let buffer = SharedBuffer::alloc(device, words as usize * WORD as usize, mechanism)?;
        device.bind()?;
        let s = buffer.stream().cu_stream();
        // SAFETY: the buffer holds `words` 8-byte words, so `2 * words`
        // 4-byte words from its (aligned) start; we wait for the set.
        unsafe {
            mem::set_d32_async(buffer.device_address(), 0, 2 * words as usize, s)?;
            rstream::synchronize(s)?;
        }
        Ok(Fence {
            buffer,
            words,
            last: (0..words).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    /// The number of sequence words.
    pub fn words(&self) -> u32 {
        self.words
    }

    /// The block's identity on the wire (its allocation's generation).
    pub fn id(&self) -> u64 {
        self.buffer.generation()
    }

    /// The mechanism the block is shared with.
    pub fn mechanism(&self) -> Mechanism {
        self.buffer.mechanism()
    }

    /// The last sequence number signalled on `word` (0: none yet).
    pub fn last_signalled(&self, word: u32) -> Result<u64> {
        check_word(word, self.words)?;
        Ok(self.last[word as usize].load(Ordering::Acquire))
    }

    /// Exports the block: its [`FenceBlock`] and the file descriptors to
    /// hand over with it (none for legacy). Each call makes new descriptors.
    pub fn export(&self) -> Result<FenceExport> {
        let e = self.buffer.export_region(
            0,
            u64::from(self.words) * WORD,
            Dtype::U64,
            Some(vec![u64::from(self.words)]),
        )?;
        Ok(FenceExport {
            block: FenceBlock::new(e.descriptor, self.words)?,
            fds: e.fds,
        })
    }

    /// The reference a consumer needs to wait for `seq` on `word`.
    pub fn reference(&self, word: u32, seq: u64) -> Result<FenceRef> {
        check_word(word, self.words)?;
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
    /// writer, increasing numbers).
    #[doc(alias = "cuStreamWriteValue64")]
    pub fn signal(&self, stream: &CudaStream, word: u32, seq: u64) -> Result<()> {
        check_word(word, self.words)?;
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
        self.buffer.device().bind()?;
        let addr = self.buffer.device_address() + u64::from(word) * WORD;
        // SAFETY: `addr` is an aligned word of this block, which stays
        // allocated while any stream still uses it (the buffer's drop waits
        // for the device); the stream is live (borrowed).
        unsafe { raw::write_value64(stream.cu_stream(), addr, seq) }
    }

    /// The device this block lives on.
    pub fn device(&self) -> &Device {
        self.buffer.device()
    }
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
    mapping: Arc<dyn Mapping>,
    base: u64,
    words: u32,
    id: u64,
    /// A stream of our own for host reads and writes of the words, which
    /// must not queue behind the caller's streams (one may be waiting).
    host_stream: Arc<CudaStream>,
}

impl FenceMapping {
    /// Maps the block that `block` describes; `fds` are the file
    /// descriptors that came with it (empty: fetched from the exporter with
    /// `pidfd_getfd`, as for any descriptor).
    ///
    /// # Errors
    /// [`Error::Unsupported`] when this device has no 64-bit stream memory
    /// operations, and every error of [`crate::share::open_mapping`].
    pub fn open(device: &Device, block: &FenceBlock, fds: Vec<OwnedFd>) -> Result<Self> {
        block.validate()?;
        check_support(device)?;
        let d = &block.descriptor;
        let mapping = crate::share::open_mapping(device, d, fds)?;
        if d.offset + d.len > mapping.size() {
            return Err(Error::OutOfBounds {
                offset: d.offset,
                len: d.len,
                size: mapping.size(),
            });
        }
        device.bind()?;
        let host_stream = device
            .context()
            .new_stream()
            .map_err(|e| from_cudarc("cuStreamCreate", e))?;
        Ok(FenceMapping {
            base: mapping.base() + d.offset,
            mapping,
            words: block.words,
            id: block.id(),
            host_stream,
        })
    }

    /// The number of sequence words.
    pub fn words(&self) -> u32 {
        self.words
    }

    /// The block's identity ([`Fence::id`] in the producer).
    pub fn id(&self) -> u64 {
        self.id
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
        check_word(r.word, self.words)?;
        Ok(r.word)
    }

    fn addr(&self, word: u32) -> Result<u64> {
        check_word(word, self.words)?;
        Ok(self.base + u64::from(word) * WORD)
    }

    /// Queues on `stream` a wait (on the device, not the host) until `word`
    /// holds `seq` or more (`cuStreamWaitValue64`, `GEQ`). Does not wait.
    ///
    /// If the producer dies before signalling, the stream waits until
    /// [`FenceMapping::abandon`] releases it; see the module's contract.
    #[doc(alias = "cuStreamWaitValue64")]
    pub fn wait(&self, stream: &CudaStream, word: u32, seq: u64) -> Result<()> {
        check_seq(seq)?;
        let addr = self.addr(word)?;
        self.mapping.device().bind()?;
        // SAFETY: `addr` is an aligned word of this mapping, which stays
        // mapped while `self` lives; callers must keep `self` until the
        // stream has passed the wait (the exchange holds mappings for as
        // long as their streams use them).
        unsafe { raw::wait_value64_geq(stream.cu_stream(), addr, seq) }
    }

    /// [`FenceMapping::wait`] for a reference received from the producer.
    pub fn wait_ref(&self, stream: &CudaStream, r: &FenceRef) -> Result<()> {
        let word = self.resolve(r)?;
        self.wait(stream, word, r.seq)
    }

    /// Polls `word` from the host for up to `timeout`; when it reaches
    /// `seq`, queues the device-side wait on `stream` (which then costs
    /// nothing) and returns true. Returns false, having queued nothing,
    /// when the deadline passes: the way out when the producer may be gone.
    pub fn wait_within(
        &self,
        stream: &CudaStream,
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

    /// The value `word` holds now, read from the host with an 8-byte copy
    /// on a stream of this mapping's own.
    #[doc(alias = "cuMemcpyDtoHAsync")]
    pub fn value(&self, word: u32) -> Result<u64> {
        let addr = self.addr(word)?;
        self.mapping.device().bind()?;
        let mut v = 0u64;
        let s = self.host_stream.cu_stream();
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
            None => (0, self.words),
        };
        let addr = self.addr(first)?;
        let values = vec![ABANDONED; count as usize];
        self.mapping.device().bind()?;
        let s = self.host_stream.cu_stream();
        // SAFETY: `count` words from `addr` lie inside the mapping; the host
        // vector outlives the copy because we wait for the stream.
        unsafe {
            mem::copy_htod_async(addr, values.as_ptr().cast(), values.len() * 8, s)?;
            rstream::synchronize(s)
        }
    }

    /// The device the block is mapped on.
    pub fn device(&self) -> &Device {
        self.mapping.device()
    }
}

impl Drop for FenceMapping {
    fn drop(&mut self) {
        // Our host stream's copies were all waited for. Streams of the
        // caller that still wait on a word must be done before the mapping
        // goes (the contract of `wait`); errors cannot be raised from drop.
        let _ = self.host_stream.synchronize();
    }
}

// ---------------------------------------------------------------------------
// Wire form

/// A fence block as it travels once from producer to consumer: the
/// block's descriptor and its number of words. Serialises as
/// `{"descriptor": {...}, "words": N}`; decoding checks that the
/// descriptor is a valid export of exactly `words` 8-byte words with a
/// generation (the block's identity), and refuses unknown fields.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawFenceBlock", into = "RawFenceBlock")]
pub struct FenceBlock {
    descriptor: Descriptor,
    words: u32,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFenceBlock {
    descriptor: serde_json::Value,
    words: u32,
}

impl TryFrom<RawFenceBlock> for FenceBlock {
    type Error = Error;
    fn try_from(raw: RawFenceBlock) -> Result<Self> {
        FenceBlock::new(Descriptor::from_value(&raw.descriptor)?, raw.words)
    }
}

impl From<FenceBlock> for RawFenceBlock {
    fn from(b: FenceBlock) -> Self {
        RawFenceBlock {
            descriptor: b.descriptor.to_value(),
            words: b.words,
        }
    }
}

impl FenceBlock {
    /// A block record, checked as decoding checks it.
    pub fn new(descriptor: Descriptor, words: u32) -> Result<Self> {
        let b = FenceBlock { descriptor, words };
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
        let d = &self.descriptor;
        d.validate()?;
        if d.dtype != Dtype::U64 {
            return Err(bad(format!(
                "its descriptor holds {}, not u64 sequence words",
                d.dtype
            )));
        }
        if d.len != u64::from(self.words) * WORD {
            return Err(bad(format!(
                "its descriptor exports {} bytes, not {} words of 8 bytes",
                d.len, self.words
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

    /// The block's descriptor.
    pub fn descriptor(&self) -> &Descriptor {
        &self.descriptor
    }

    /// The number of sequence words.
    pub fn words(&self) -> u32 {
        self.words
    }

    /// The block's identity (its descriptor's generation).
    pub fn id(&self) -> u64 {
        self.descriptor.generation.unwrap_or_default()
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
