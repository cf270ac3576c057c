//! The producer's side: a block of sequence words it signals.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::CudaStream;

use super::host::{HostWords, create_memfd, host_len, next_host_id};
use super::wire::{FenceBlock, FenceRef};
use super::{MAX_WORDS, WORD, check_seq, check_support, check_word};
use crate::descriptor::{Dtype, Mechanism};
use crate::device::{Capabilities, Device};
use crate::driver::result::{mem, stream as rstream, stream_mem as raw};
use crate::error::{Error, Result};
use crate::memory::DeviceMemory;
use crate::memory::buffer::UsedStreams;
use crate::share::SharedBuffer;

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
    /// operations or cannot share memory that way;
    /// [`Error::InvalidArgument`] for 0 words or more than 2^16 (65,536).
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

    /// The mechanism a device block is shared with (`None` for host words,
    /// [`Fence::new_host`]).
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
            block: self.id,
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
    /// above 2^62 - 1 or not above the word's previous signal (one
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
    pub(crate) fn device(&self) -> &Device {
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
pub(super) fn fence_mechanism(
    caps: &Capabilities,
    requested: Option<Mechanism>,
) -> Result<Mechanism> {
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
                crate::sync::reaper::work_done(|| drop(words));
            });
    }
}
