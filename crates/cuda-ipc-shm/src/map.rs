//! The one module with `unsafe` code: mapping a memfd and viewing the
//! mapping as a slice of atomic words.
//!
//! # Safety contract (written once, for [`Mapping`])
//! A `Mapping` owns `words * 8` bytes of a `MAP_SHARED`, read-write mapping
//! at a page-aligned address, mapped in [`Mapping::map`] and unmapped only
//! in `Drop`. Another process maps the same file and may write any bytes
//! at any time, so the memory is only ever accessed through
//! [`AtomicU64`]: every bit pattern is a valid `u64`, and a concurrent
//! write by the peer is a race between atomic accesses (each of ours sees
//! some value), never undefined behaviour. No plain reference to the bytes
//! (`&[u8]`, `&u64`) is ever made. The file cannot shrink under us (the
//! creator seals it against shrinking, and the opener checks the seal
//! before mapping; see `Area`), so no access faults with `SIGBUS`.
#![allow(unsafe_code)]

use std::os::fd::BorrowedFd;
use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;

use rustix::mm::{MapFlags, ProtFlags, mmap, munmap};

/// A shared, read-write mapping of a whole memfd, seen as atomic words.
pub(crate) struct Mapping {
    ptr: NonNull<AtomicU64>,
    words: usize,
}

// SAFETY: the mapping is plain memory reached only through atomics (see
// the module's contract), so sharing and sending it between threads is as
// safe as sharing a `[AtomicU64]`.
unsafe impl Send for Mapping {}
// SAFETY: as for `Send`.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps the first `len` bytes of `fd` shared and read-write. `len` must
    /// be a non-zero multiple of 8 and at most the file's size; the caller
    /// checks the size and the seals first.
    ///
    /// # References
    /// [mmap(2)](https://man7.org/linux/man-pages/man2/mmap.2.html).
    #[doc(alias = "mmap")]
    pub(crate) fn map(fd: BorrowedFd<'_>, len: usize) -> std::io::Result<Mapping> {
        if len == 0 || !len.is_multiple_of(8) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "a mapping must be a non-zero multiple of 8 bytes",
            ));
        }
        // SAFETY: a null address lets the kernel choose a new range, so no
        // existing memory of this process is replaced; the result is only
        // used as the contract above says.
        let ptr = unsafe {
            mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd,
                0,
            )
        }?;
        let ptr = NonNull::new(ptr.cast::<AtomicU64>())
            .ok_or_else(|| std::io::Error::other("mmap returned a null address"))?;
        Ok(Mapping {
            ptr,
            words: len / 8,
        })
    }

    /// The mapping as atomic words.
    pub(crate) fn words(&self) -> &[AtomicU64] {
        // SAFETY: `ptr` is page aligned (so aligned for `AtomicU64`) and
        // points to `words` words that stay mapped while `self` lives (the
        // returned slice borrows `self`); `AtomicU64` has interior
        // mutability, so the peer's writes through its own mapping do not
        // break the shared reference's rules.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.words) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the range is the one `map` got from mmap, and no slice
        // from `words` outlives `self`. An error (which cannot happen for a
        // range we mapped) would leave the pages mapped: ignored, since a
        // drop must not panic and there is nothing else to do.
        let _ = unsafe { munmap(self.ptr.as_ptr().cast(), self.words * 8) };
    }
}
