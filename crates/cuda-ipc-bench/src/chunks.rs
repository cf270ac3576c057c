//! The consumer's side of arena hand-offs while the library's exchange has
//! no arena API: a set record ([`SetRecord`]) arrives as one JSON line, each
//! chunk it names is mapped once (the cache is keyed by arena and chunk id,
//! never by address), every entry becomes a view, and the consumer waits
//! on the record's one event. The producer's side is in
//! `sections/arena.rs` and `sections/sets.rs`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use cuda_ipc::buffer::{MappedBuffer, Mapping};
use cuda_ipc::handle::IpcEventHandle;
use cuda_ipc::kernels::Pattern;
use cuda_ipc::set::SetRecord;
use cuda_ipc::{Device, Error, IpcEvent, share};
use serde_json::{Value, json};

use crate::proto::{failure, mono_ns};

/// The pattern of entry `j` of a set filled with `p`: distinct per entry,
/// so a view at the wrong offset is caught.
pub fn entry_pattern(p: Pattern, j: usize) -> Pattern {
    Pattern::ramp(
        p.base.wrapping_add((j as u32).wrapping_mul(0x9E37_79B9)),
        p.step,
    )
}

/// A set the consumer holds: its views and its event.
struct Held {
    views: Vec<MappedBuffer<u32>>,
    event: Option<IpcEventHandle>,
}

/// The consumer's mappings of arena chunks, opened events and held sets.
#[derive(Default)]
pub struct Chunks {
    maps: HashMap<(u64, u64), Arc<dyn Mapping>>,
    events: HashMap<IpcEventHandle, IpcEvent>,
    held: HashMap<String, Held>,
    /// How many chunk mappings were opened (the cache's misses).
    opened: u64,
}

impl Chunks {
    /// Decodes the set record `set`, maps the chunks not mapped yet, makes
    /// a view of every entry and waits on the record's event; then (not
    /// timed) checks every entry against `p` and keeps the set if `hold`.
    pub fn attach(
        &mut self,
        device: &Device,
        r: &Value,
        t_recv: u64,
        p: Pattern,
    ) -> Result<Value, Error> {
        let set = SetRecord::from_value(&r["set"])?;
        let mut views = Vec::with_capacity(set.entries.len());
        for e in &set.entries {
            let chunk = set.chunk(e.chunk).ok_or_else(|| {
                failure(
                    "the set record",
                    format!("no chunk {} in its table", e.chunk),
                )
            })?;
            let key = (set.arena.0, e.chunk);
            let mapping = if let Some(m) = self.maps.get(&key) {
                m.clone()
            } else {
                let m = share::open_mapping(device, &chunk.descriptor, Vec::new())?;
                self.opened += 1;
                self.maps.insert(key, m.clone());
                m
            };
            views.push(MappedBuffer::<u32>::from_bytes(
                mapping,
                chunk.descriptor.offset + e.offset,
                e.len,
            )?);
        }
        self.wait(device, set.event)?;
        let t_done = mono_ns();
        let checked = Instant::now();
        check(&views, p)?;
        let verify_ms = checked.elapsed().as_secs_f64() * 1e3;
        if r["hold"].as_bool() == Some(true) {
            self.held.insert(
                set.name.clone(),
                Held {
                    views,
                    event: set.event,
                },
            );
        }
        Ok(json!({
            "t_recv": t_recv,
            "t_done": t_done,
            "verify_ms": verify_ms,
            "entries": set.entries.len(),
            "opened": self.opened,
        }))
    }

    /// The update of held set `name`: waits on its event, then (not timed)
    /// checks every entry against `p`.
    pub fn update(
        &mut self,
        device: &Device,
        name: &str,
        t_recv: u64,
        p: Pattern,
    ) -> Result<Value, Error> {
        let event = self
            .held
            .get(name)
            .ok_or_else(|| failure("set_update", format!("{name:?} is not held")))?
            .event;
        self.wait(device, event)?;
        let t_done = mono_ns();
        let checked = Instant::now();
        check(&self.held[name].views, p)?;
        Ok(json!({
            "t_recv": t_recv,
            "t_done": t_done,
            "verify_ms": checked.elapsed().as_secs_f64() * 1e3,
        }))
    }

    /// Drops held set `name`.
    pub fn drop_set(&mut self, name: &str) -> Result<Value, Error> {
        self.held
            .remove(name)
            .ok_or_else(|| failure("set_drop", format!("{name:?} is not held")))?;
        Ok(json!({ "ok": true }))
    }

    /// Drops every view, mapping and event (the producer frees its arena next).
    pub fn close(&mut self) -> Value {
        let n = self.maps.len();
        self.held.clear();
        self.maps.clear();
        self.events.clear();
        json!({ "closed": n })
    }

    /// Makes the device's stream wait on `event` (opened once per handle)
    /// and synchronises it.
    fn wait(&mut self, device: &Device, event: Option<IpcEventHandle>) -> Result<(), Error> {
        if let Some(h) = event {
            let e = match self.events.entry(h) {
                std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert(IpcEvent::open(device, h)?)
                }
            };
            e.wait_on(device.stream())?;
        }
        device
            .stream()
            .synchronize()
            .map_err(|e| failure("synchronising the consumer's stream", format!("{e:?}")))
    }
}

/// Checks the first and last words of every view against its entry's pattern.
fn check(views: &[MappedBuffer<u32>], p: Pattern) -> Result<(), Error> {
    for (j, v) in views.iter().enumerate() {
        if let Some(m) = crate::worker::verify(v, entry_pattern(p, j))? {
            return Err(failure(format!("checking entry {j} of the set"), m));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_get_distinct_patterns() {
        let p = Pattern::ramp(7, 1);
        assert_eq!(entry_pattern(p, 0), p);
        assert_ne!(entry_pattern(p, 1), entry_pattern(p, 2));
        assert_eq!(entry_pattern(p, 5).step, 1);
    }
}
