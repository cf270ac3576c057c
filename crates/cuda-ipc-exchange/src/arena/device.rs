//! Chunks of device memory: one [`SharedBuffer`] each, exported once.
#![allow(unsafe_code)] // only `unsafe impl DeviceMemory`, justified there

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use cudarc::driver::CudaStream;

use super::{Arena, ArenaBuffer, ChunkBacking, MIB};
use crate::descriptor::{Descriptor, Dtype, Mechanism};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::memory::vmm::{self, ShareableTypes};
use crate::memory::{DeviceMemory, impl_cudarc_traits};
use crate::set::{MemberPlace, SetChunk, SetLayout, SetLayouts, SetRecord};
use crate::share::{self, Export, SharedBuffer};

/// An arena of device memory.
pub type DeviceArena = Arena<DeviceChunks>;

/// A buffer of a [`DeviceArena`]: device memory, usable with the kernels
/// and copies of [`DeviceMemory`] and as a cudarc device slice of bytes.
pub type DeviceArenaBuffer = ArenaBuffer<DeviceChunks>;

/// Makes chunks of device memory on one device with one mechanism, each
/// exported once when it is created.
#[derive(Clone, Debug)]
pub struct DeviceChunks {
    device: Device,
    mechanism: Mechanism,
    granularity: u64,
}

impl DeviceChunks {
    /// Chunks on `device` shared with `mechanism` (`None`: the best the
    /// device supports, VMM where VMM file descriptors work).
    pub fn new(device: &Device, mechanism: Option<Mechanism>) -> Result<Self> {
        let caps = device.capabilities()?;
        let mechanism = match mechanism {
            Some(m) => {
                share::check_mechanism(&caps, m)?;
                m
            }
            None => share::best_mechanism(&caps)?,
        };
        // Legacy and pool chunks round to 2 MiB as the crate's other
        // allocations do; VMM chunks to the driver's granularity.
        let granularity = match mechanism {
            Mechanism::Vmm => vmm::granularity(device, ShareableTypes::FD)?,
            Mechanism::Fabric => vmm::granularity(device, ShareableTypes::FD_AND_FABRIC)?,
            // Legacy, pool, and any mechanism added later.
            _ => 2 * MIB,
        }
        .max(2 * MIB);
        Ok(DeviceChunks {
            device: device.clone(),
            mechanism,
            granularity,
        })
    }

    /// The device the chunks live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The mechanism the chunks are shared with.
    pub fn mechanism(&self) -> Mechanism {
        self.mechanism
    }

    /// A VMM chunk of `len` bytes made again from `fd`, the export of a
    /// chunk that another process made (for [`Arena::restore`]): imported
    /// and owned here, its export a duplicate of `fd`
    /// ([`SharedBuffer::adopt_vmm`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when these chunks are not VMM ones; the
    /// driver's, when `fd` is not a VMM allocation of `len` bytes.
    pub fn adopt(&self, fd: OwnedFd, len: u64) -> Result<DeviceChunk> {
        if self.mechanism != Mechanism::Vmm {
            return Err(Error::arg(
                "chunk",
                format!(
                    "only vmm chunks can be taken back from a file descriptor, and these are {}",
                    self.mechanism
                ),
            ));
        }
        let buffer = SharedBuffer::adopt_vmm(&self.device, fd, len)?;
        let export = buffer.export()?;
        Ok(DeviceChunk { buffer, export })
    }
}

impl ChunkBacking for DeviceChunks {
    type Chunk = DeviceChunk;

    fn granularity(&self) -> u64 {
        self.granularity
    }

    #[doc(alias = "cuMemCreate")]
    #[doc(alias = "cuMemExportToShareableHandle")]
    fn create(&self, len: u64) -> Result<DeviceChunk> {
        let len = usize::try_from(len)
            .map_err(|_| Error::arg("size", format!("{len} bytes is too large")))?;
        let buffer = SharedBuffer::alloc(&self.device, len, Some(self.mechanism))?;
        let export = buffer.export()?;
        tracing::debug!(
            mechanism = %self.mechanism,
            len,
            generation = buffer.generation(),
            "created and exported an arena chunk"
        );
        Ok(DeviceChunk { buffer, export })
    }

    fn chunk_len(chunk: &DeviceChunk) -> u64 {
        chunk.buffer.byte_len() as u64
    }
}

/// A VMM chunk to take back by its file descriptor
/// ([`Publisher::restore_arena`](crate::exchange::Publisher::restore_arena)):
/// its index in its arena, the descriptor, its size, and its ranges still
/// in use as (offset, length) in bytes.
#[derive(Debug)]
#[non_exhaustive]
pub struct KeptChunk {
    /// Its index in its arena.
    pub index: u64,
    /// The allocation's file descriptor.
    pub fd: OwnedFd,
    /// Its size in bytes.
    pub len: u64,
    /// Its ranges in use: (offset, length).
    pub ranges: Vec<(u64, u64)>,
}

impl KeptChunk {
    /// Chunk `index` of `len` bytes behind `fd`, with its ranges in use.
    pub fn new(index: u64, fd: OwnedFd, len: u64, ranges: Vec<(u64, u64)>) -> Self {
        KeptChunk {
            index,
            fd,
            len,
            ranges,
        }
    }
}

/// One chunk of device memory and its export, made once.
#[derive(Debug)]
pub struct DeviceChunk {
    buffer: SharedBuffer,
    export: Export,
}

impl DeviceChunk {
    /// The chunk's memory.
    pub fn buffer(&self) -> &SharedBuffer {
        &self.buffer
    }

    /// The descriptor of the whole chunk (bytes), made when it was created.
    /// A buffer at offset `o` of the chunk starts `descriptor().offset + o`
    /// bytes into the allocation the descriptor names.
    pub fn descriptor(&self) -> &Descriptor {
        &self.export.descriptor
    }

    /// The file descriptors that travel with the descriptor (none for
    /// legacy and fabric chunks). They live as long as the chunk.
    pub fn fds(&self) -> &[OwnedFd] {
        &self.export.fds
    }
}

// SAFETY: the arena hands out a buffer only for a range it allocated inside
// the chunk (`offset + len <= chunk length`), and the buffer keeps its chunk
// (and so the chunk's memory) alive; the stream is the chunk buffer's own.
unsafe impl DeviceMemory for DeviceArenaBuffer {
    fn device(&self) -> &Device {
        self.chunk().backing().buffer.device()
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.chunk().backing().buffer.stream()
    }
    fn device_address(&self) -> u64 {
        self.chunk().backing().buffer.device_address() + self.offset()
    }
    fn byte_len(&self) -> usize {
        // The inherent `ArenaBuffer::byte_len` (a u64), the same count.
        ArenaBuffer::byte_len(self) as usize
    }
    fn foreign_use(&self) -> Option<&crate::memory::ForeignUse> {
        self.chunk().backing().buffer.foreign_use()
    }
}

impl_cudarc_traits!(DeviceArenaBuffer, u8);

impl DeviceArenaBuffer {
    /// A descriptor of this buffer alone, holding `dtype` elements with an
    /// optional shape: the chunk's descriptor narrowed to the buffer, with no
    /// new export. It shares the chunk's handle or file descriptor, so a
    /// consumer that opens it maps (and can read) the whole chunk.
    pub fn descriptor(&self, dtype: Dtype, shape: Option<Vec<u64>>) -> Result<Descriptor> {
        let chunk = self.chunk().backing().descriptor();
        let mut d = chunk.clone();
        d.offset = chunk.offset + self.offset();
        d.byte_len = self.byte_len();
        d.dtype = dtype;
        d.shape = shape;
        d.strides = None;
        d.validate()?;
        Ok(d)
    }
}

/// One buffer of a set, for [`DeviceArena::describe_set`] and
/// [`Publisher::publish_set`](crate::exchange::Publisher::publish_set):
/// `SetMember::new(name, dtype, shape, &buffer)`, with
/// [`at`](SetMember::at) for a byte range inside the buffer.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct SetMember<'a> {
    /// The buffer's name in the set.
    pub name: &'a str,
    /// What it holds.
    pub dtype: Dtype,
    /// Its dimensions in elements (row-major, contiguous).
    pub shape: &'a [u64],
    /// Where it lives.
    pub buffer: &'a DeviceArenaBuffer,
    /// Bytes from the buffer's first byte to the member's: 0 for a member
    /// that starts its buffer, more for a byte range inside it (a tensor
    /// that a caching allocator placed in a larger arena buffer). A
    /// multiple of the dtype's size; the member's bytes end inside the
    /// buffer.
    pub offset: u64,
}

impl<'a> SetMember<'a> {
    /// A member called `name` of `dtype` elements in `shape` that starts
    /// at the first byte of `buffer`.
    pub fn new(
        name: &'a str,
        dtype: Dtype,
        shape: &'a [u64],
        buffer: &'a DeviceArenaBuffer,
    ) -> Self {
        SetMember {
            name,
            dtype,
            shape,
            buffer,
            offset: 0,
        }
    }

    /// The same member, starting `offset` bytes into its buffer (checked
    /// when the set is described: aligned to the dtype, inside the buffer).
    #[must_use]
    pub fn at(mut self, offset: u64) -> Self {
        self.offset = offset;
        self
    }
}

/// The length in bytes of a member of `dtype` with `shape` that starts
/// `offset` bytes into a buffer of `buffer_len` bytes: an error that names
/// the member when it does not fit in the buffer or starts off the dtype's
/// alignment.
pub(crate) fn member_len(
    name: &str,
    dtype: Dtype,
    shape: &[u64],
    offset: u64,
    buffer_len: u64,
) -> Result<u64> {
    if !offset.is_multiple_of(dtype.size()) {
        return Err(Error::arg(
            "set member",
            format!(
                "{name:?} starts {offset} bytes into its buffer, not a multiple of {}'s {} bytes",
                dtype,
                dtype.size()
            ),
        ));
    }
    let len = shape
        .iter()
        .try_fold(1u64, |a, d| a.checked_mul(*d))
        .and_then(|n| n.checked_mul(dtype.size()));
    match len {
        Some(len) if Error::check_range(offset, len, buffer_len).is_ok() => Ok(len),
        _ if offset == 0 => Err(Error::arg(
            "set member",
            format!(
                "{name:?}: shape {shape:?} of {dtype} does not fit in its {buffer_len}-byte buffer"
            ),
        )),
        _ => Err(Error::arg(
            "set member",
            format!(
                "{name:?}: shape {shape:?} of {dtype} from byte {offset} does not fit in its \
                 {buffer_len}-byte buffer"
            ),
        )),
    }
}

impl DeviceArena {
    /// The set record of `members`: one entry per member, in order, and the
    /// descriptor of every chunk they use, once. Each member's bytes
    /// (elements of its shape times its dtype's size), from its offset, must
    /// fit in its buffer, and the offset must be a multiple of the dtype's
    /// size.
    pub fn describe_set<'a>(
        &self,
        name: &str,
        members: impl IntoIterator<Item = SetMember<'a>>,
    ) -> Result<SetRecord> {
        let (chunks, places) = self.places(members)?;
        SetRecord::new(
            name.to_string(),
            self.id(),
            chunks,
            places.iter().map(MemberPlace::entry).collect(),
        )
    }

    /// [`describe_set`](Self::describe_set) through `layouts`: a set whose
    /// members and chunks are those of a layout kept there shares its
    /// checked entries and encoded table ([`SetLayouts`]); another is
    /// described and kept. Returns the record and its layout.
    pub fn describe_set_with<'a>(
        &self,
        name: &str,
        members: impl IntoIterator<Item = SetMember<'a>>,
        layouts: &SetLayouts,
    ) -> Result<(SetRecord, Arc<SetLayout>)> {
        let (chunks, places) = self.places(members)?;
        layouts.describe(name, self.id(), chunks, &places)
    }

    /// Each member's place (its chunk, offset and length, checked against
    /// its buffer), and the table of the chunks they use, by id.
    fn places<'a>(
        &self,
        members: impl IntoIterator<Item = SetMember<'a>>,
    ) -> Result<(Vec<SetChunk>, Vec<MemberPlace<'a>>)> {
        let members = members.into_iter();
        let mut chunks = BTreeMap::new();
        let mut places = Vec::with_capacity(members.size_hint().0);
        // Members mostly follow each other in a chunk: its id is looked up
        // in the table only when it changes.
        let mut last_chunk = None;
        for m in members {
            let chunk = m.buffer.chunk();
            let id = chunk.id();
            if id.arena != self.id() {
                return Err(Error::arg(
                    "set member",
                    format!("{:?} is a buffer of another arena", m.name),
                ));
            }
            let len = member_len(m.name, m.dtype, m.shape, m.offset, m.buffer.byte_len())?;
            if last_chunk != Some(id.index) {
                chunks
                    .entry(id.index)
                    .or_insert_with(|| chunk.backing().descriptor().clone());
                last_chunk = Some(id.index);
            }
            places.push(MemberPlace {
                name: m.name,
                dtype: m.dtype,
                shape: m.shape,
                chunk: id.index,
                offset: m.buffer.offset() + m.offset,
                len,
            });
        }
        let chunks = chunks
            .into_iter()
            .map(|(id, descriptor)| SetChunk { id, descriptor })
            .collect();
        Ok((chunks, places))
    }
}
