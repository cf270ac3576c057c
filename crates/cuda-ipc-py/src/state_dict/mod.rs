//! State dicts through the DLPack C exchange API: one call publishes a
//! state dict, one attaches it, one checks an update, each looping over the
//! tensors here rather than in Python.
//!
//! The rules are those of `cuda_ipc.sets` (the path Python takes when the
//! framework has no exchange API): a tied tensor (the same view of the same
//! memory under two keys) is one entry and an alias entry
//! (`.cuda-ipc/alias/<index>/<key>`); an empty tensor travels as a
//! one-element entry named `.cuda-ipc/empty/<dims>/<key>`; a tensor already
//! in the publisher's arena is published where it is, any other is copied
//! into the arena (by Python's `copy_in`, on the framework's stream), as is
//! one whose range overlaps another's. Python keeps the rarely taken paths
//! (a refused dtype's message, the copies, empty tensors) and hands them in
//! as functions.
//!
//! Lifetimes: every tensor made for a subscriber holds the set's lease and
//! mappings ([`Keep`]) until its storage dies; the publisher's record holds
//! the tensors it returned and the arena buffers of the set.

mod names;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use cuda_ipc::Result;
use cuda_ipc::arena::{DeviceArenaBuffer, SetMember};
use cuda_ipc::descriptor::Dtype;
use cuda_ipc::set::{MAX_SET_DIMS, SetEntry};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

use crate::errors::{IntoPyResult, closed_error};
use crate::keep::Keep;
use crate::peers::{After, PyPublisher};
use crate::phases::Phases;
use crate::sets::{ArenaBuffer, SetAttachment, alloc_registered};
use crate::torch_c::{Dims, TensorMeta, TorchExchange, as_bytes, fill_contiguous_strides};

use names::{EntryRole, RESERVED, alias_entry_name, check_entry_name, empty_name, invalid, repr};

/// Arena buffers are placed at multiples of this.
const ALIGN: u64 = 256;

/// `(key, value)` of every item of a state dict, after the checks that
/// need no tensor (Python's `_check_items`).
fn items<'py>(state_dict: &Bound<'py, PyAny>) -> PyResult<Vec<(String, Bound<'py, PyAny>)>> {
    Ok(items_with_keys(state_dict)?
        .into_iter()
        .map(|g| (g.key, g.value))
        .collect())
}

/// An item of a state dict: its key, as text and as the Python string it
/// was (a dict made of these items reuses it, and its cached hash).
struct Given<'py> {
    key: String,
    key_obj: Bound<'py, PyString>,
    value: Bound<'py, PyAny>,
}

/// As [`items`], keeping each key's Python string.
fn items_with_keys<'py>(state_dict: &Bound<'py, PyAny>) -> PyResult<Vec<Given<'py>>> {
    let py = state_dict.py();
    let pairs: Vec<(Bound<'py, PyAny>, Bound<'py, PyAny>)> =
        if let Ok(d) = state_dict.cast::<PyDict>() {
            d.iter().collect()
        } else if state_dict.hasattr(intern!(py, "items"))? {
            state_dict
                .call_method0(intern!(py, "items"))?
                .try_iter()?
                .map(|kv| kv.and_then(|kv| kv.extract()))
                .collect::<PyResult<_>>()?
        } else {
            return Err(invalid(
                "state dict",
                format!(
                    "expected a state dict (a mapping of names to tensors), not {}",
                    state_dict.get_type().name()?
                ),
            ))
            .py();
        };
    if pairs.is_empty() {
        return Err(invalid(
            "state dict",
            "the state dict is empty; a set holds at least one tensor".to_owned(),
        ))
        .py();
    }
    pairs
        .into_iter()
        .map(|(k, v)| {
            let key_obj = k.cast::<PyString>().ok().cloned();
            // The string's own UTF-8 (kept by the object), copied once.
            let key = key_obj
                .as_ref()
                .map(|s| s.to_str().map(str::to_owned))
                .transpose()?
                .filter(|s| !s.is_empty());
            let (Some(key), Some(key_obj)) = (key, key_obj) else {
                return Err(invalid(
                    "state dict key",
                    format!(
                        "state dict keys must be non-empty strings, not {}",
                        k.repr()?
                    ),
                ))
                .py();
            };
            if key.starts_with(RESERVED) {
                return Err(invalid(
                    "state dict key",
                    format!(
                        "{}: keys starting with {} are reserved",
                        repr(&key),
                        repr(RESERVED)
                    ),
                ))
                .py();
            }
            Ok(Given {
                key,
                key_obj,
                value: v,
            })
        })
        .collect()
}

/// What Python hands in: the exchange API, the set's dtypes by torch dtype
/// object, and the functions of the rare paths.
struct Torch<'a, 'py> {
    api: &'a TorchExchange,
    /// torch dtype -> descriptor name.
    dtypes: &'a Bound<'py, PyDict>,
    /// `refuse(dtype, what)` raises `InvalidInput` for a dtype a set does
    /// not hold.
    refuse: &'a Bound<'py, PyAny>,
    /// The dtypes met so far, by their torch dtype object (a state dict
    /// holds a few): a look-up in `dtypes` and the name's parse once each.
    seen: std::cell::RefCell<Vec<(Py<PyAny>, Dtype)>>,
}

impl<'a, 'py> Torch<'a, 'py> {
    fn new(
        api: &'a TorchExchange,
        dtypes: &'a Bound<'py, PyDict>,
        refuse: &'a Bound<'py, PyAny>,
    ) -> Self {
        Torch {
            api,
            dtypes,
            refuse,
            seen: std::cell::RefCell::new(Vec::new()),
        }
    }

    /// The set dtype of the torch dtype object `dtype` of `key`'s tensor.
    fn dtype_of(&self, key: &str, dtype: &Bound<'py, PyAny>) -> PyResult<Dtype> {
        if let Some((_, dt)) = self.seen.borrow().iter().find(|(o, _)| dtype.is(o)) {
            return Ok(*dt);
        }
        let Some(name) = self.dtypes.get_item(dtype)? else {
            self.refuse.call1((dtype, repr(key)))?;
            return Err(invalid(
                "dtype",
                format!("{}: {dtype} is not held", repr(key)),
            ))
            .py();
        };
        let dt = crate::args::dtype(&name.extract::<String>()?).py()?;
        self.seen.borrow_mut().push((dtype.clone().unbind(), dt));
        Ok(dt)
    }
}

impl Torch<'_, '_> {
    /// The tensor `t` of `key`: its torch dtype object, set dtype and layout.
    fn read<'py>(
        &self,
        key: &str,
        t: &Bound<'py, PyAny>,
    ) -> PyResult<(Bound<'py, PyAny>, Dtype, TensorMeta)> {
        let py = t.py();
        if !t.is_instance(self.api.tensor_type(py))? {
            return Err(invalid(
                "state dict value",
                format!(
                    "{} is a {}, not a torch tensor",
                    repr(key),
                    t.get_type().name()?
                ),
            ))
            .py();
        }
        let dtype = t.getattr(intern!(py, "dtype"))?;
        let dt = self.dtype_of(key, &dtype)?;
        // The type was checked above.
        Ok((dtype, dt, self.api.read_known(t)?))
    }
}

/// One tensor of a state dict being published.
struct Item<'py> {
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
enum Slot {
    Item(usize),
    Alias(usize, String),
}

/// Arena ranges found for different keys may overlap (slices of one
/// storage); set entries cannot: each found range that overlaps one before
/// it (by address) is copied instead.
fn keep_apart(plan: &mut [Item<'_>]) {
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

fn round_up(n: u64) -> u64 {
    n.div_ceil(ALIGN).saturating_mul(ALIGN)
}

/// What a published state dict keeps: the tensors it returned (in the
/// state dict's order, tied keys sharing one), their layouts, and the
/// arena buffers of the set. `Publisher.update_state_dict` checks a new
/// state dict against it (`changed`).
#[pyclass(module = "cuda_ipc._core", frozen)]
pub(crate) struct StateDictRecord {
    keys: Vec<String>,
    /// Position by key, made at the first update that passes a state dict.
    index: std::sync::OnceLock<HashMap<String, usize>>,
    tensors: Vec<Py<PyAny>>,
    dtypes: Vec<Py<PyAny>>,
    shapes: Vec<Dims>,
    ptrs: Vec<u64>,
    _buffers: Vec<Arc<DeviceArenaBuffer>>,
}

impl StateDictRecord {
    fn index(&self) -> &HashMap<String, usize> {
        self.index.get_or_init(|| {
            self.keys
                .iter()
                .enumerate()
                .map(|(i, k)| (k.clone(), i))
                .collect()
        })
    }
}

#[pymethods]
impl StateDictRecord {
    /// The published tensors, `{key: tensor}` in the state dict's order.
    #[getter]
    fn tensors<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, t) in self.keys.iter().zip(&self.tensors) {
            d.set_item(k, t)?;
        }
        Ok(d)
    }

    /// Checks `state_dict` against the published one (the same keys, each
    /// tensor of the same dtype and shape) and returns `[(published,
    /// new)]`, the tensors to copy: all but the empty ones and those that
    /// are the published tensor's memory, contiguous.
    fn changed<'py>(
        &self,
        state_dict: &Bound<'py, PyAny>,
        api: &TorchExchange,
        dtypes: &Bound<'py, PyDict>,
        refuse: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let py = state_dict.py();
        let given = items(state_dict)?;
        let have: HashSet<&str> = given.iter().map(|(k, _)| k.as_str()).collect();
        let missing: Vec<&String> = self
            .keys
            .iter()
            .filter(|k| !have.contains(k.as_str()))
            .collect();
        let extra: Vec<&String> = given
            .iter()
            .map(|(k, _)| k)
            .filter(|k| !self.index().contains_key(*k))
            .collect();
        if !missing.is_empty() || !extra.is_empty() {
            let list = |v: &[&String]| {
                let shown: Vec<String> = v.iter().take(5).map(|k| repr(k)).collect();
                let more = if v.len() > 5 { " ..." } else { "" };
                format!("[{}]{more}", shown.join(", "))
            };
            let mut parts = Vec::new();
            if !missing.is_empty() {
                parts.push(format!("missing {}", list(&missing)));
            }
            if !extra.is_empty() {
                parts.push(format!("unknown {}", list(&extra)));
            }
            return Err(invalid(
                "state dict",
                format!(
                    "the state dict does not have the keys of the published one: {}",
                    parts.join("; ")
                ),
            ))
            .py();
        }
        let torch = Torch::new(api, dtypes, refuse);
        let out = PyList::empty(py);
        for (key, src) in &given {
            let i = self.index()[key.as_str()];
            let (dtype, _, meta) = torch.read(key, src)?;
            let dst_dtype = self.dtypes[i].bind(py);
            if !dtype.is(dst_dtype) || meta.shape != self.shapes[i] {
                return Err(invalid(
                    "state dict value",
                    format!(
                        "{} is {dtype} {:?}; the published tensor is {dst_dtype} {:?}",
                        repr(key),
                        meta.shape,
                        self.shapes[i]
                    ),
                ))
                .py();
            }
            if meta.numel() == Some(0) || (meta.ptr == self.ptrs[i] && meta.is_contiguous()) {
                continue;
            }
            out.append((self.tensors[i].bind(py), src))?;
        }
        Ok(out)
    }
}

/// The tensors of `given`, read and checked, each where it goes: an item
/// (with the arena buffer that holds it already, if one does) or a tie to
/// an earlier item; nothing is allocated.
fn plan_items<'py>(
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
struct LastFound(Option<Arc<DeviceArenaBuffer>>);

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
struct Member {
    entry: MemberEntry,
    buffer: Arc<DeviceArenaBuffer>,
    offset: u64,
}

/// What a member's entry is: an item of the plan (its entry name and shape
/// are the item's), or an alias entry (its name; one byte).
enum MemberEntry {
    Item(usize),
    Alias(String),
}

/// An alias entry's shape and an empty tensor's: one element.
const ONE: [u64; 1] = [1];

/// What placing the items made: the members, each item's tensor and
/// address, and what was copied (count, bytes, the first key).
struct Placed<'py> {
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
fn place<'py>(
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
fn publish_state_dict_c<'py>(
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

/// Makes the tensors of an attached set's entries through the exchange
/// API: each holds `keep` (the set's lease).
struct Maker<'a> {
    api: &'a TorchExchange,
    keep: Keep,
    ordinal: usize,
    shape: [i64; MAX_SET_DIMS],
    strides: [i64; MAX_SET_DIMS],
}

impl Maker<'_> {
    /// The tensor of entry `e`, as `target` (its torch dtype).
    fn tensor<'py>(
        &mut self,
        py: Python<'py>,
        e: &SetEntry,
        ptr: u64,
        target: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let count = e.shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
        let fits = count
            .and_then(|c| c.checked_mul(e.dtype.size()))
            .is_some_and(|b| b <= e.len);
        if !fits
            || e.shape.len() > MAX_SET_DIMS
            || e.shape.iter().any(|&d| i64::try_from(d).is_err())
        {
            return Err(invalid(
                "set entry",
                format!(
                    "{}: shape {:?} of {} does not fit in its {} bytes",
                    repr(&e.name),
                    e.shape,
                    e.dtype,
                    e.len
                ),
            ))
            .py();
        }
        // At most MAX_SET_DIMS dimensions, each within i64 (checked above).
        let n = e.shape.len();
        for (s, &d) in self.shape.iter_mut().zip(&e.shape) {
            *s = d as i64;
        }
        fill_contiguous_strides(&self.shape[..n], &mut self.strides[..n]);
        let bytes = as_bytes(e.dtype);
        let at = crate::torch_c::At {
            ptr,
            ordinal: self.ordinal,
            dtype: crate::dlpack::data_type(e.dtype, bytes),
            shape: &self.shape[..n],
            strides: &self.strides[..n],
        };
        let t = self.api.make(py, self.keep.clone(), &at)?.into_bound(py);
        if bytes {
            t.call_method1(intern!(py, "view"), (target,))
        } else {
            Ok(t)
        }
    }
}

/// The torch dtype of each set dtype met so far (a set holds a few), from
/// the dict Python hands in.
struct Targets<'a, 'py> {
    dtypes: &'a Bound<'py, PyDict>,
    seen: Vec<(Dtype, Bound<'py, PyAny>)>,
}

impl<'py> Targets<'_, 'py> {
    fn of(&mut self, dt: Dtype) -> PyResult<Bound<'py, PyAny>> {
        if let Some((_, t)) = self.seen.iter().find(|(d, _)| *d == dt) {
            return Ok(t.clone());
        }
        let t = self
            .dtypes
            .get_item(dt.name())?
            .ok_or_else(|| invalid("dtype", format!("unknown dtype {}", dt.name())))
            .py()?;
        if let Ok(missing) = t.cast::<PyString>() {
            return Err(invalid(
                "dtype",
                format!("this PyTorch has no torch.{missing}"),
            ))
            .py();
        }
        self.seen.push((dt, t.clone()));
        Ok(t)
    }
}

/// The dict keys made for the entries of the sets attached last, by their
/// entries (the last [`KEPT_KEYS`] layouts): a set attached again in a
/// layout its subscriber kept (the same entries, shared:
/// `Subscriber::entry_tables`) gets the same key strings, their hashes
/// made already, instead of new ones.
static KEYS: std::sync::Mutex<Vec<(Arc<[SetEntry]>, Keys)>> = std::sync::Mutex::new(Vec::new());

/// The dict keys of a set's entries, in the entries' order.
type Keys = Arc<Vec<Py<PyString>>>;

/// How many layouts' keys [`KEYS`] holds (two: double-buffered weights).
const KEPT_KEYS: usize = 2;

/// The keys kept for `entries`, if any.
fn kept_keys(entries: &Arc<[SetEntry]>) -> Option<Keys> {
    let kept = crate::errors::lock(&KEYS);
    kept.iter()
        .find(|(e, _)| Arc::ptr_eq(e, entries))
        .map(|(_, k)| Arc::clone(k))
}

/// Keeps `keys` for `entries`, the least recently kept going first.
fn keep_keys(entries: &Arc<[SetEntry]>, keys: Vec<Py<PyString>>) {
    let mut kept = crate::errors::lock(&KEYS);
    kept.insert(0, (Arc::clone(entries), Arc::new(keys)));
    kept.truncate(KEPT_KEYS);
}

/// `_core.attach_state_dict_c(attachment, out, api, dtypes, empty)`: fills
/// the dict `out` with a tensor of every entry of the set `attachment`
/// (a `SetAttachment`), each holding its lease; tied keys get the same
/// tensor, empty entries `empty(shape, dtype)`. `dtypes` maps descriptor
/// names to torch dtypes (or, for a type this PyTorch lacks, its name).
#[pyfunction]
fn attach_state_dict_c(
    attachment: &Bound<'_, SetAttachment>,
    out: &Bound<'_, PyDict>,
    api: &TorchExchange,
    dtypes: &Bound<'_, PyDict>,
    empty: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let mut phases = Phases::start("attach_state_dict");
    let py = attachment.py();
    let a = attachment.get();
    let keep = crate::errors::lock(&a.keep)
        .clone()
        .ok_or_else(|| closed_error("set", "attach it again"))?;
    let mut maker = Maker {
        api,
        keep,
        ordinal: a.ordinal,
        shape: [0; MAX_SET_DIMS],
        strides: [0; MAX_SET_DIMS],
    };
    let mut targets = Targets {
        dtypes,
        seen: Vec::new(),
    };
    let mut keys: Vec<Bound<'_, PyString>> = Vec::with_capacity(a.ptrs.len());
    let before = out.len();
    let entries = a.set_entries();
    let kept = kept_keys(entries);
    // The entry's key: kept, or made from `key` (its name or the key its
    // name carries).
    let key_of = |i: usize, key: &str| match &kept {
        Some(k) => k[i].bind(py).clone(),
        None => PyString::new(py, key),
    };
    for (i, (e, &ptr)) in entries.iter().zip(&a.ptrs).enumerate() {
        let target = targets.of(e.dtype)?;
        let (key, value) = match EntryRole::of(&e.name) {
            EntryRole::Alias { index, key } => {
                let Some(first) = keys.get(index) else {
                    return Err(invalid(
                        "set entry",
                        format!(
                            "{}: {} is an alias of entry {index}, which is not before it",
                            repr(&a.name),
                            repr(key)
                        ),
                    ))
                    .py();
                };
                let v = out
                    .get_item(first)?
                    .ok_or_else(|| invalid("set entry", format!("{} is gone", repr(key))))
                    .py()?;
                (key_of(i, key), v)
            }
            EntryRole::Empty { key, shape } => (
                key_of(i, key),
                empty.call1((PyTuple::new(py, shape)?, &target))?,
            ),
            EntryRole::Tensor { .. } => (key_of(i, &e.name), maker.tensor(py, e, ptr, &target)?),
        };
        out.set_item(&key, value)?;
        if out.len() == before + keys.len() {
            // The key replaced an earlier one (the caller clears the dict).
            return Err(invalid(
                "set entry",
                format!(
                    "{} holds {} twice",
                    repr(&a.name),
                    repr(&key.extract::<String>()?)
                ),
            ))
            .py();
        }
        keys.push(key);
    }
    if kept.is_none() {
        keep_keys(entries, keys.into_iter().map(Bound::unbind).collect());
    }
    phases.mark("entries");
    Ok(())
}

/// Registers the functions and `StateDictRecord`.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<StateDictRecord>()?;
    m.add_function(wrap_pyfunction!(publish_state_dict_c, m)?)?;
    m.add_function(wrap_pyfunction!(attach_state_dict_c, m)?)?;
    names::register(m)
}
