//! VMM allocations taken over from another process ([`VmmBuffer::adopt_fd`]).

use std::os::fd::{AsFd, OwnedFd};

use crate::device::Device;
use crate::driver::result::vmm;
use crate::error::{Error, Result};
use crate::memory::owned::Owned;
use crate::memory::vmm::{ShareableTypes, VmmBuffer, map_rw_or_release};

impl VmmBuffer {
    /// Takes over the VMM allocation behind `fd` (`size` bytes: the
    /// allocation's whole size, a multiple of the granularity), made and
    /// exported by another process that may be gone: imported, mapped
    /// read-write here and owned as if this process had made it, released
    /// on drop (the memory goes when no process holds it any more).
    /// [`export_fd`](Self::export_fd) then hands out duplicates of `fd`.
    /// This is how a restarted service takes back the chunks that a keeper
    /// held while it was down.
    #[doc(alias = "cuMemImportFromShareableHandle")]
    pub fn adopt_fd(device: &Device, fd: OwnedFd, size: u64) -> Result<Self> {
        device.bind()?;
        let ordinal = device.ordinal() as i32;
        let types = ShareableTypes::FD;
        let gran = vmm::granularity(&vmm::device_prop(ordinal, types.to_sys()))?;
        if size == 0 || !size.is_multiple_of(gran) {
            return Err(Error::arg(
                "VMM allocation size",
                format!(
                    "{size} bytes is not a positive multiple of the {gran}-byte granularity; \
                     pass the allocation's size as it was made"
                ),
            ));
        }
        let len = usize::try_from(size)
            .map_err(|_| Error::arg("size", format!("{size} bytes is too large")))?;
        let handle = vmm::import_fd(fd.as_fd())?;
        let ptr = map_rw_or_release(handle, size, gran, ordinal)?;
        Ok(VmmBuffer {
            core: Owned::new(device, ptr, len),
            handle,
            alloc_size: size,
            types,
            adopted: Some(fd),
        })
    }
}
