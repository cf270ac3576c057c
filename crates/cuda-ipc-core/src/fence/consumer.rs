//! The consumer's side: another process's block, mapped, waited on.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use cudarc::driver::CudaStream;

use super::host::{HostWords, check_memfd, host_len};
use super::wire::{FenceBlock, FenceRef, Placement};
use super::{ABANDONED, WORD, check_seq, check_support, check_word};
use crate::device::Device;
use crate::driver::result::{mem, stream as rstream, stream_mem as raw};
use crate::error::{Error, Result, from_cudarc};
use crate::memory::buffer::{Mapping, UsedStreams};

/// The consumer's side: a [`Fence`](super::Fence) block of another process, mapped.
#[derive(Debug)]
pub struct FenceMapping {
    /// Shared with the release retired at drop, which lets go of it.
    words: Arc<MappedWords>,
    /// The streams waits were queued on, waited for before the words go.
    streams: UsedStreams,
    block: FenceBlock,
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
                let mapping = crate::share::open_mapping(
                    device,
                    d,
                    fds,
                    crate::mechanism::Access::ReadWrite,
                )?;
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
            block: block.clone(),
        })
    }

    /// The record this mapping was opened from: its number of words, its
    /// identity and where the words live.
    pub fn block(&self) -> &FenceBlock {
        &self.block
    }

    /// Checks that `r` names a word of this block, and returns the word.
    pub fn resolve(&self, r: &FenceRef) -> Result<u32> {
        if r.block != self.block.id() {
            return Err(Error::arg(
                "fence reference",
                format!(
                    "it names fence block {:#x}, but this mapping is block {:#x}; open the block it names first",
                    r.block,
                    self.block.id()
                ),
            ));
        }
        check_word(r.word, self.block.words)?;
        Ok(r.word)
    }

    /// The device address of `word`.
    pub(super) fn addr(&self, word: u32) -> Result<u64> {
        check_word(word, self.block.words)?;
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
            None => (0, self.block.words),
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
    pub(crate) fn device(&self) -> &Device {
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
            move || crate::sync::reaper::work_done(|| drop(words)),
        );
    }
}
