//! Publishing a state dict: each tensor read and checked, planned (found
//! in the publisher's arena already, tied to an earlier key, or to be
//! copied), placed in one set, and published
//! (`_core.publish_state_dict_c`).

use std::collections::HashMap;
use std::sync::Arc;

use cuda_ipc::Result;
use cuda_ipc::arena::{DeviceArenaBuffer, SetMember};
use cuda_ipc::descriptor::Dtype;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};

use crate::errors::IntoPyResult;
use crate::peers::{After, PyPublisher};
use crate::phases::Phases;
use crate::sets::{ArenaBuffer, alloc_registered};
use crate::torch_c::{TensorMeta, TorchExchange};

use super::names::{alias_entry_name, check_entry_name, empty_name, invalid, repr};
use super::{ALIGN, StateDictRecord, Torch, items_with_keys};

/// One tensor of a state dict being published.
pub(super) struct Item<'py> {
    key: String,
    tensor: Bound<'py, PyAny>,
    dtype_obj: Bound<'py, PyAny>,
    dt: Dtype,
    meta: TensorMeta,
    nbytes: u64,
    /// Its entry name where that is not its key (an empty tensor's).
    entry: Option<String>,
    /// Its set member's shape.
    member_shape: cuda_ipc::set::Shape,
    found: Option<(Arc<DeviceArenaBuffer>, u64)>,
}

impl Item<'_> {
    /// Its entry name in the set.
    fn entry(&self) -> &str {
        self.entry.as_deref().unwrap_or(&self.key)
    }
}

/// Where each key of the state dict went: its item, or (with the key) the
/// item it is tied to.
pub(super) enum Slot {
    Item(usize),
    Alias(usize, String),
}

/// Arena ranges found for different keys may overlap (slices of one
/// storage); set entries cannot: each found range that overlaps one before
/// it (by address) is copied instead.
pub(super) fn keep_apart(plan: &mut [Item<'_>]) {
    let mut ranges: Vec<(u64, u64, usize)> = plan
        .iter()
        .enumerate()
        .filter(|(_, it)| it.found.is_some())
        .map(|(i, it)| (it.meta.ptr, it.meta.ptr.saturating_add(it.nbytes), i))
        .collect();
    ranges.sort_unstable();
    let mut end: Option<u64> = None;
    for (start, stop, i) in ranges {
        match end {
            Some(e) if start < e => plan[i].found = None,
            _ => end = Some(end.map_or(stop, |e| e.max(stop))),
        }
    }
}

pub(super) fn round_up(n: u64) -> u64 {
    n.div_ceil(ALIGN).saturating_mul(ALIGN)
}

/// The tensors of `given`, read and checked, each where it goes: an item
/// (with the arena buffer that holds it already, if one does) or a tie to
/// an earlier item; nothing is allocated.
pub(super) fn plan_items<'py>(
    p: &PyPublisher,
    torch: &Torch<'_, 'py>,
    given: Vec<(String, Bound<'py, PyAny>)>,
) -> PyResult<(Vec<Item<'py>>, Vec<Slot>)> {
    let ordinal = p.device.ordinal();
    let mut plan: Vec<Item<'py>> = Vec::with_capacity(given.len());
    let mut slots = Vec::with_capacity(given.len());
    // The last item that starts at an address, and for each item the one
    // before it that starts at the same address (usize::MAX: none).
    let mut last_at: HashMap<u64, usize, foldhash::fast::RandomState> =
        HashMap::with_capacity_and_hasher(given.len(), foldhash::fast::RandomState::default());
    let mut before_at: Vec<usize> = Vec::with_capacity(given.len());
    let mut last_found = LastFound::default();
    for (key, t) in given {
        let (dtype_obj, dt, meta) = torch.read(&key, &t)?;
        let nbytes = meta
            .numel()
            .and_then(|n| n.checked_mul(dt.size()))
            .ok_or_else(|| invalid("tensor", format!("{}: its size overflows", repr(&key))))
            .py()?;
        let entry = if nbytes > 0 {
            // The same view of the same memory (tied weights) is one entry
            // and an alias; looked at only where two tensors start together.
            let mut at = last_at.get(&meta.ptr).copied().unwrap_or(usize::MAX);
            while at != usize::MAX {
                let o = &plan[at];
                if o.dt == dt && o.meta == meta {
                    break;
                }
                at = before_at[at];
            }
            if at != usize::MAX {
                slots.push(Slot::Alias(at, key));
                continue;
            }
            before_at.push(last_at.insert(meta.ptr, plan.len()).unwrap_or(usize::MAX));
            None
        } else {
            before_at.push(usize::MAX);
            Some(empty_name(&key, &meta.shape).py()?)
        };
        check_entry_name(&key, entry.as_deref().unwrap_or(&key)).py()?;
        // An empty tensor's member is one element (its shape is in its name).
        let member_shape = if nbytes > 0 {
            // Dimensions are never negative (read_known checks).
            meta.shape.iter().map(|&d| d as u64).collect()
        } else {
            smallvec::smallvec![1]
        };
        // A tensor inside a buffer of this publisher's arena is published
        // where it is.
        let found = (nbytes > 0 && meta.on_cuda(ordinal) && meta.is_contiguous())
            .then(|| last_found.containing(p, meta.ptr, nbytes))
            .flatten();
        slots.push(Slot::Item(plan.len()));
        plan.push(Item {
            key,
            tensor: t,
            dtype_obj,
            dt,
            meta,
            nbytes,
            entry,
            member_shape,
            found,
        });
    }
    keep_apart(&mut plan);
    Ok((plan, slots))
}

/// The arena buffer that held the last tensor looked up: a state dict's
/// tensors lie mostly in a few buffers (the framework's segments), so most
/// look-ups end here, without the registry's lock and search.
#[derive(Default)]
pub(super) struct LastFound(Option<Arc<DeviceArenaBuffer>>);

impl LastFound {
    /// The buffer of `p`'s arena that holds the `nbytes` bytes from `ptr`,
    /// and `ptr`'s offset in it.
    fn containing(
        &mut self,
        p: &PyPublisher,
        ptr: u64,
        nbytes: u64,
    ) -> Option<(Arc<DeviceArenaBuffer>, u64)> {
        // Held here, the buffer is live; a range it does not hold whole
        // goes to the registry, which answers for every buffer.
        if let Some(b) = &self.0
            && let Some(offset) = crate::peers::offset_within(b, ptr, nbytes)
        {
            return Some((Arc::clone(b), offset));
        }
        let (b, offset) = p.arena_buffers.containing(ptr, nbytes)?;
        self.0 = Some(Arc::clone(&b));
        Some((b, offset))
    }
}

/// A set member: what its entry is, its buffer, and its offset in the
/// buffer.
pub(super) struct Member {
    entry: MemberEntry,
    buffer: Arc<DeviceArenaBuffer>,
    offset: u64,
}

/// What a member's entry is: an item of the plan (its entry name and shape
/// are the item's), or an alias entry (its name; one byte).
pub(super) enum MemberEntry {
    Item(usize),
    Alias(String),
}

/// An alias entry's shape and an empty tensor's: one element.
const ONE: [u64; 1] = [1];

/// What placing the items made: the members, each item's tensor and
/// address, and what was copied (count, bytes, the first key).
pub(super) struct Placed<'py> {
    members: Vec<Member>,
    made: Vec<Bound<'py, PyAny>>,
    ptrs: Vec<u64>,
    copied: usize,
    copied_bytes: u64,
    first_copied: Option<String>,
}

/// Gives every item and tie its set member: the arena buffer that holds it,
/// or a new one it is copied into (`copy_in`), or for an empty tensor a
/// new one of one element (`empty` makes the tensor returned).
pub(super) fn place<'py>(
    p: &PyPublisher,
    py: Python<'py>,
    plan: &[Item<'py>],
    slots: &[Slot],
    copy_in: &Bound<'py, PyAny>,
    empty: &Bound<'py, PyAny>,
) -> PyResult<Placed<'py>> {
    let aliases = slots
        .iter()
        .filter(|s| matches!(s, Slot::Alias(..)))
        .count() as u64;
    let need = plan
        .iter()
        .filter(|it| it.found.is_none())
        .map(|it| round_up(it.nbytes.max(it.dt.size())))
        .sum::<u64>()
        + round_up(1) * aliases;
    if need > 0 {
        // One chunk for everything copied, when it fits one.
        let publisher = p.get()?;
        py.detach(|| publisher.arena()?.reserve(need)).py()?;
    }
    let mut out = Placed {
        members: Vec::with_capacity(slots.len()),
        made: Vec::with_capacity(plan.len()),
        ptrs: Vec::with_capacity(plan.len()),
        copied: 0,
        copied_bytes: 0,
        first_copied: None,
    };
    for (item, it) in plan.iter().enumerate() {
        let (buffer, offset, dst, ptr) = if let Some((b, offset)) = &it.found {
            (b.clone(), *offset, it.tensor.clone(), it.meta.ptr)
        } else {
            let b = alloc_registered(p, py, it.nbytes.max(it.dt.size()))?;
            let ptr = cuda_ipc::memory::DeviceMemory::device_address(&*b);
            let dst = if it.nbytes > 0 {
                let obj = Bound::new(py, ArenaBuffer::new(b.clone(), p.device.clone()))?;
                out.copied += 1;
                out.copied_bytes += it.nbytes;
                out.first_copied.get_or_insert_with(|| it.key.clone());
                copy_in.call1((obj, &it.tensor, it.dt.name(), &it.member_shape[..]))?
            } else {
                empty.call1((&it.tensor,))?
            };
            (b, 0, dst, ptr)
        };
        out.members.push(Member {
            entry: MemberEntry::Item(item),
            buffer,
            offset,
        });
        out.made.push(dst);
        out.ptrs.push(ptr);
    }
    for slot in slots {
        if let Slot::Alias(i, key) = slot {
            let entry = alias_entry_name(*i, key);
            check_entry_name(key, &entry).py()?;
            let b = alloc_registered(p, py, 1)?;
            out.members.push(Member {
                entry: MemberEntry::Alias(entry),
                buffer: b,
                offset: 0,
            });
        }
    }
    Ok(out)
}

/// `_core.publish_state_dict_c(publisher, name, state_dict, api, dtypes,
/// refuse, copy_in, empty)`: publishes `state_dict` as the set `name`.
///
/// `dtypes` maps torch dtypes to descriptor names; `refuse(dtype, what)`
/// raises for a dtype a set does not hold; `copy_in(buffer, tensor, dtype,
/// shape)` copies a tensor into an `ArenaBuffer` and returns the copy;
/// `empty(tensor)` returns a new empty tensor like it on the publisher's
/// device; `stream`, the raw handle of the stream the tensors were written
/// and copied on (PyTorch's current stream; `None`: every stream of the
/// device, waited for on the host). Returns `(tensors, record, copied,
/// copied_bytes, first_copied)`.
#[pyfunction]
#[pyo3(signature = (publisher, name, state_dict, api, dtypes, refuse, copy_in, empty, stream=None))]
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub(super) fn publish_state_dict_c<'py>(
    py: Python<'py>,
    publisher: &Bound<'py, PyPublisher>,
    name: &str,
    state_dict: &Bound<'py, PyAny>,
    api: &TorchExchange,
    dtypes: &Bound<'py, PyDict>,
    refuse: &Bound<'py, PyAny>,
    copy_in: &Bound<'py, PyAny>,
    empty: &Bound<'py, PyAny>,
    stream: Option<u64>,
) -> PyResult<(
    Bound<'py, PyDict>,
    StateDictRecord,
    usize,
    u64,
    Option<String>,
)> {
    let mut phases = Phases::start("publish_state_dict");
    let p = publisher.get();
    let torch = Torch::new(api, dtypes, refuse);
    let (given, key_objs): (Vec<_>, Vec<_>) = items_with_keys(state_dict)?
        .into_iter()
        .map(|g| ((g.key, g.value), g.key_obj))
        .unzip();
    phases.mark("items");
    let (mut plan, slots) = plan_items(p, &torch, given)?;
    phases.mark("plan");
    let placed = place(p, py, &plan, &slots, copy_in, empty)?;
    phases.mark("place");
    let dev = p.device.clone();
    let publisher_arc = p.get()?;
    // The set's event after the copies queued above and the tensors'
    // writes (on `stream`, or every stream of the context).
    let after = After::of(stream);
    let m: Vec<SetMember<'_>> = placed
        .members
        .iter()
        .map(|mb| {
            match &mb.entry {
                MemberEntry::Alias(name) => SetMember::new(name, Dtype::U8, &ONE, &mb.buffer),
                MemberEntry::Item(i) => {
                    let it = &plan[*i];
                    SetMember::new(it.entry(), it.dt, &it.member_shape, &mb.buffer)
                }
            }
            .at(mb.offset)
        })
        .collect();
    phases.mark("members");
    let clock = &mut phases;
    py.detach(move || -> Result<()> {
        after.run(&dev, |stream| {
            // The context's wait (none when ordered after a stream).
            clock.mark("sync");
            match stream {
                Some(s) => publisher_arc.publish_set_after(name, &m, s)?,
                None => publisher_arc.publish_set(name, &m)?,
            }
            clock.mark("publish_set");
            Ok(())
        })
    })
    .py()?;
    // The returned dict and the record, in the state dict's order.
    let out = PyDict::new(py);
    let n = slots.len();
    let mut record = StateDictRecord {
        keys: Vec::with_capacity(n),
        index: std::sync::OnceLock::new(),
        tensors: Vec::with_capacity(n),
        dtypes: Vec::with_capacity(n),
        shapes: Vec::with_capacity(n),
        ptrs: Vec::with_capacity(n),
        _buffers: placed.members.into_iter().map(|m| m.buffer).collect(),
    };
    // One slot per item of the state dict, in its order.
    for (slot, key_obj) in slots.into_iter().zip(key_objs) {
        let (i, key) = match slot {
            // An item's own slot comes once: its key moves to the record.
            Slot::Item(i) => (i, std::mem::take(&mut plan[i].key)),
            Slot::Alias(i, key) => (i, key),
        };
        // The caller's key object where it is a plain str (a subclass's
        // methods stay out of the dict returned).
        if key_obj.is_exact_instance_of::<PyString>() {
            out.set_item(key_obj, &placed.made[i])?;
        } else {
            out.set_item(&key, &placed.made[i])?;
        }
        record.keys.push(key);
        record.tensors.push(placed.made[i].clone().unbind());
        record.dtypes.push(plan[i].dtype_obj.clone().unbind());
        record.shapes.push(plan[i].meta.shape.clone());
        record.ptrs.push(placed.ptrs[i]);
    }
    phases.mark("dict_and_record");
    Ok((
        out,
        record,
        placed.copied,
        placed.copied_bytes,
        placed.first_copied,
    ))
}
