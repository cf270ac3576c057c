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
//!   increase strictly, never wrap, and stay at most 2^62 - 1 (a billion
//!   signals a second for 146 years; [`ABANDONED`] is the next number).
//!   Blocks hold 1 to 2^16 words. The device compares
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
//! for device words the block's [`Descriptor`](crate::descriptor::Descriptor), for host words the memfd's
//! number and the exporter's pid; the file descriptors travel beside it); each
//! publish names its word and sequence number with a small [`FenceRef`].
//! Both are serde types decoded strictly, ready to be embedded in the
//! exchange's messages.
//!
//! # Layer
//! The fence orders work like the [`event`](crate::event)s, but it
//! is not in that folder: device words are a
//! [`SharedBuffer`](crate::share::SharedBuffer), opened with
//! [`share::open_mapping`](crate::share::open_mapping), and `share` itself
//! waits on events from `sync`, so a folder holding both would import
//! `share` and be imported by it. The fence sits above `share` (and below
//! the exchange, which uses it); its raw calls
//! (`cuStreamWriteValue64`, `cuStreamWaitValue64`, host registration) are in
//! the driver layer's `result::stream_mem`.
#![allow(unsafe_code)]

use crate::device::Device;
use crate::driver::result::device as dev;
use crate::error::{Error, Result};

mod consumer;
mod host;
mod producer;
mod wire;

pub use consumer::FenceMapping;
pub use producer::{Fence, FenceExport};
pub use wire::{FenceBlock, FenceRef};

/// The largest sequence number a fence accepts (2^62 - 1).
pub(crate) const MAX_SEQ: u64 = (1 << 62) - 1;

/// The value [`FenceMapping::abandon`] writes: larger than every sequence
/// number, so that every wait on the word is satisfied.
pub const ABANDONED: u64 = 1 << 62;

/// The most words one block holds (512 KiB of sequence words).
pub(crate) const MAX_WORDS: u32 = 1 << 16;

/// The size of one sequence word in bytes.
const WORD: u64 = 8;

/// Checks that `device` can queue 64-bit stream memory operations
/// (`CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS`), which fences need.
///
/// # Errors
/// [`Error::Unsupported`] (kind `Unavailable`) when it cannot.
#[doc(alias = "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS")]
pub(crate) fn check_support(device: &Device) -> Result<()> {
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

#[cfg(test)]
mod tests {
    use std::os::fd::OwnedFd;

    use super::host::{check_memfd, create_memfd, host_len};
    use super::producer::fence_mechanism;
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
