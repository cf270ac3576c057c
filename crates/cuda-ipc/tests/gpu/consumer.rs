//! The generic child process of the GPU tests: it opens what the parent
//! exports, checks and transforms it, exports buffers of its own, and tries
//! bad handles, one JSON request at a time.
//!
//! Requests (`op`):
//! - `open`: `{descriptor, expect: {base, step}, transform?: [mul, add]}` maps
//!   the descriptor (waiting on its event), checks every word against the
//!   pattern, optionally transforms and records an event; answers
//!   `{bad, open_ms, event?}`. The mapping stays until `close`.
//! - `close`: drops every mapping and event; answers `{closed: n}`.
//! - `recheck`: checks the open mappings again; answers `{results: [..]}`.
//! - `race`: `{descriptor, event, expect}` checks once without waiting on the
//!   producer's event, then waits and checks again; answers
//!   `{unwaited_bad, waited_bad}`.
//! - `export`: `{mechanism, size, offset, pattern}` exports a buffer of its
//!   own; answers `{descriptor}`; `check_export`: `{expect}` waits on the
//!   event in the request and checks its buffer; answers `{bad}`.
//! - `handles`: `{handles: [hex]}` tries to open each legacy handle;
//!   answers `{results: [error text or "opened"]}`.
//! - `typed`: `{descriptor}` exercises typed views; answers `{ok, detail}`.
//! - `exit`.

use std::time::Instant;

use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::share::{self, SharedBuffer};
use cuda_ipc::{
    Descriptor, Device, DeviceMemory, Dtype, IpcEvent, LegacyMapping, MappedBuffer, OpenFlags,
};
use serde_json::{Value, json};

use super::common::Parent;

/// Parses `{base, step}`.
pub fn pattern(v: &Value) -> Pattern {
    Pattern::ramp(
        v["base"].as_u64().expect("base") as u32,
        v["step"].as_u64().expect("step") as u32,
    )
}

/// `{base, step}` of a pattern.
pub fn pattern_json(p: Pattern) -> Value {
    json!({ "base": p.base, "step": p.step })
}

/// Runs the child's request loop until `exit` or the end of input.
#[allow(clippy::too_many_lines)] // one arm per request, documented above
pub fn serve() {
    let parent = Parent::new();
    let ordinal = std::env::var("CUDA_IPC_TEST_DEVICE")
        .ok()
        .and_then(|d| d.parse().ok())
        .unwrap_or(0);
    let device = Device::open(ordinal).expect("child opens its device");
    let mut mappings: Vec<(MappedBuffer<u32>, Pattern)> = Vec::new();
    let mut events: Vec<IpcEvent> = Vec::new();
    let mut own: Option<SharedBuffer> = None;
    let mut own_exports = Vec::new();
    while let Some(req) = parent.recv() {
        let reply = match req["op"].as_str().unwrap_or_default() {
            "exit" => break,
            "open" => {
                let d = Descriptor::from_value(&req["descriptor"]).expect("descriptor");
                let want = pattern(&req["expect"]);
                let t = Instant::now();
                match share::open::<u32>(&device, &d, Vec::new()) {
                    Err(e) => json!({ "error": e.to_string() }),
                    Ok(buf) => {
                        let open_ms = t.elapsed().as_secs_f64() * 1e3;
                        let bad = kernels::check_u32(&buf, want).expect("check");
                        let mut reply = json!({ "bad": bad, "open_ms": open_ms });
                        let mut now = want;
                        if let Some(tr) = req["transform"].as_array() {
                            let (mul, add) = (
                                tr[0].as_u64().unwrap() as u32,
                                tr[1].as_u64().unwrap() as u32,
                            );
                            kernels::map_u32(&buf, mul, add).expect("map");
                            let ev = IpcEvent::new(&device).expect("event");
                            ev.record(buf.stream()).expect("record");
                            reply["event"] = json!(ev.handle().expect("handle").to_string());
                            events.push(ev);
                            now = want.mapped(mul, add);
                        }
                        mappings.push((buf, now));
                        reply
                    }
                }
            }
            "close" => {
                let n = mappings.len();
                mappings.clear();
                events.clear();
                // Drops retire the unmaps to the reaper: "closed" means
                // unmapped, so the parent's memory counts see them done.
                let settled = cuda_ipc::reaper::settle(std::time::Duration::from_secs(10));
                json!({ "closed": n, "settled": settled })
            }
            "recheck" => {
                let results: Vec<Value> = mappings
                    .iter()
                    .map(|(b, p)| match kernels::check_u32(b, *p) {
                        Ok(bad) => json!({ "bad": bad }),
                        Err(e) => json!({ "error": e.to_string() }),
                    })
                    .collect();
                json!({ "results": results })
            }
            "race" => {
                let mut d = Descriptor::from_value(&req["descriptor"]).expect("descriptor");
                d.event = None;
                let want = pattern(&req["expect"]);
                let buf = share::open::<u32>(&device, &d, Vec::new()).expect("open");
                let unwaited = kernels::check_u32(&buf, want).expect("check");
                let ev = IpcEvent::open(&device, req["event"].as_str().unwrap().parse().unwrap())
                    .expect("open event");
                ev.wait_on(buf.stream()).expect("wait");
                let waited = kernels::check_u32(&buf, want).expect("check");
                json!({ "unwaited_bad": unwaited, "waited_bad": waited })
            }
            "export" => {
                let mechanism = req["mechanism"].as_str().unwrap().parse().unwrap();
                let size = req["size"].as_u64().unwrap();
                let offset = req["offset"].as_u64().unwrap();
                let p = pattern(&req["pattern"]);
                let buf = SharedBuffer::alloc(&device, (offset + size) as usize, Some(mechanism))
                    .expect("alloc");
                let region = buf.region(offset, size).unwrap();
                kernels::fill_u32(&region, p, Speed::Full).unwrap();
                let ev = IpcEvent::new(&device).unwrap();
                ev.record(buf.stream()).unwrap();
                share::allow_fd_fetching().unwrap();
                let mut export = buf.export_region(offset, size, Dtype::U32, None).unwrap();
                export.descriptor.event = Some(ev.handle().unwrap());
                let reply = json!({ "descriptor": export.descriptor.to_value() });
                own_exports.push(export);
                events.push(ev);
                own = Some(buf);
                reply
            }
            "check_export" => {
                let buf = own.as_ref().expect("an export");
                let ev = IpcEvent::open(&device, req["event"].as_str().unwrap().parse().unwrap())
                    .unwrap();
                ev.wait_on(buf.stream()).unwrap();
                let offset = req["offset"].as_u64().unwrap();
                let size = req["size"].as_u64().unwrap();
                let bad =
                    kernels::check_u32(&buf.region(offset, size).unwrap(), pattern(&req["expect"]))
                        .unwrap();
                json!({ "bad": bad })
            }
            "handles" => {
                let results: Vec<Value> = req["handles"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|h| {
                        let h = h.as_str().unwrap().parse().unwrap();
                        match LegacyMapping::open(&device, h, OpenFlags::default()) {
                            Ok(_) => json!("opened"),
                            Err(e) => json!(e.to_string()),
                        }
                    })
                    .collect();
                json!({ "results": results })
            }
            "open_without_flag" => {
                let h = req["handle"].as_str().unwrap().parse().unwrap();
                match LegacyMapping::open(&device, h, OpenFlags::NONE) {
                    Ok(_) => json!({ "error": null }),
                    Err(e) => json!({ "error": e.to_string() }),
                }
            }
            "peer_bandwidth" => super::peer::bandwidth(
                &device,
                &Descriptor::from_value(&req["descriptor"]).unwrap(),
            ),
            "typed" => typed_views(
                &device,
                &Descriptor::from_value(&req["descriptor"]).unwrap(),
            ),
            other => json!({ "error": format!("unknown op {other}") }),
        };
        parent.send(&reply);
    }
}

/// Exercises typed views over a descriptor filled with `ramp(0, 1)` words.
fn typed_views(device: &Device, d: &Descriptor) -> Value {
    let check = || -> Result<(), String> {
        let bytes = share::open::<u8>(device, d, Vec::new()).map_err(|e| e.to_string())?;
        let words: MappedBuffer<u32> = bytes.cast().map_err(|e| e.to_string())?;
        if words.len() * 4 != bytes.len() {
            return Err("cast changed the length".into());
        }
        let part: Vec<u32> = words
            .slice(10..20)
            .map_err(|e| e.to_string())?
            .to_vec()
            .map_err(|e| e.to_string())?;
        if part != (10..20).collect::<Vec<u32>>() {
            return Err(format!("slice 10..20 read {part:?}"));
        }
        let floats: MappedBuffer<f32> = words.cast().map_err(|e| e.to_string())?;
        let f: Vec<f32> = floats
            .slice(1..2)
            .map_err(|e| e.to_string())?
            .to_vec()
            .map_err(|e| e.to_string())?;
        if f[0].to_bits() != 1 {
            return Err("f32 view does not alias the u32 words".into());
        }
        if words.slice(5..words.len() + 1).is_ok() {
            return Err("an out-of-bounds slice was accepted".into());
        }
        // The parent exports at an 8-byte aligned offset, so 4 bytes in is misaligned for u64.
        let odd = bytes.slice(4..bytes.len() - 4).map_err(|e| e.to_string())?;
        match odd.cast::<u64>() {
            Ok(_) => return Err("a misaligned u64 view was accepted".into()),
            Err(e) if !e.to_string().contains("aligned") => {
                return Err(format!("wrong error for a misaligned view: {e}"));
            }
            Err(_) => {}
        }
        // Write through one view, read through another.
        let w = words.slice(0..4).map_err(|e| e.to_string())?;
        w.write_from(&[7u32, 8, 9, 10]).map_err(|e| e.to_string())?;
        let back: Vec<u8> = bytes
            .slice(0..16)
            .map_err(|e| e.to_string())?
            .to_vec()
            .map_err(|e| e.to_string())?;
        if back
            != [7u32, 8, 9, 10]
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect::<Vec<u8>>()
        {
            return Err("write through the u32 view not seen through the byte view".into());
        }
        // cudarc's own copy through the DevicePtr implementation.
        let via_cudarc: Vec<u32> = words
            .stream()
            .clone_dtoh(&words.slice(4..8).map_err(|e| e.to_string())?)
            .map_err(|e| format!("{e:?}"))?;
        if via_cudarc != [4, 5, 6, 7] {
            return Err(format!("cudarc read {via_cudarc:?} through DevicePtr"));
        }
        Ok(())
    };
    match check() {
        Ok(()) => json!({ "ok": true }),
        Err(detail) => json!({ "ok": false, "detail": detail }),
    }
}
