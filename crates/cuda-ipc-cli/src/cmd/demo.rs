//! `cuda-ipc demo`: a producer and a consumer process share a buffer.
//!
//! The producer fills the buffer on the GPU with a ramp, records an
//! interprocess event and exports the buffer. The consumer maps it, waits on
//! the producer's event, checks every value, transforms every value
//! (`x -> 2x + 1`) with a kernel and records its own event. The producer
//! waits on that event and checks every value again. Both directions are
//! checked element by element; each step is timed.
//!
//! With `--consumer-namespaces` the consumer runs in new namespaces (as in
//! a container), where it can neither fetch file descriptors by the
//! producer's pid nor, with a private `/dev/shm`, open its events; the
//! buffer then travels over the channel instead, synchronised by the
//! publisher's event or, where events cannot open, its fence, and the
//! consumer's release (which waits for its kernel) hands the buffer back.

use std::process::Stdio;
use std::time::{Duration, Instant};

use cuda_ipc::device::Capabilities;
use cuda_ipc::exchange::{Endpoint, Publisher, PublisherConfig, Subscriber, SubscriberConfig};
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::share::{self, SharedBuffer};
use cuda_ipc::{
    Descriptor, Device, DeviceMemory, Dtype, Error, IpcEvent, IpcEventHandle, MappedBuffer,
};
use cuda_ipc_bench::namespaces::{ConsumerNamespaces, Namespace};
use serde_json::{Value, json};

use super::demo_args::{Args, ConsumerArgs};
use crate::Outcome;
use crate::out::outln;
use cuda_ipc_bench::lines::{self, LineReader, field};

const PATTERN: Pattern = Pattern::ramp(0xC0DA_0000, 1);
const MUL: u32 = 2;
const ADD: u32 = 1;
const CHILD_TIMEOUT: Duration = Duration::from_secs(120);

struct Steps(Vec<(&'static str, String, f64)>);

impl Steps {
    fn add(&mut self, who: &'static str, what: impl Into<String>, ms: f64) {
        self.0.push((who, what.into(), ms));
    }
}

/// `demo --set N`: a set of `n` buffers handed off from an arena to a
/// consumer process (`attach --set`), which checks every value.
fn run_set(args: &Args, n: usize, namespaces: &ConsumerNamespaces) -> Result<Outcome, Error> {
    let sizes = super::serve::set_sizes(n, args.size)?;
    let t = Instant::now();
    let device = Device::open(args.device)?;
    let name = format!("demo-set-{}", std::process::id());
    let config =
        PublisherConfig::default().with_sharing(super::serve::arena_sharing(args.mechanism));
    let publisher = Publisher::bind(&device, name.as_str(), config)?;
    let buffers = super::serve::publish_set(&publisher, &sizes)?;
    let mechanism = publisher.arena()?.backing().mechanism();
    let chunks = publisher.arena()?.stats().chunks;
    let publish_ms = super::ms_since(t);
    outln!(
        "cuda-ipc demo: a set of {n} buffers, {} in all, in {chunks} {mechanism} chunk(s) of one arena ({publish_ms:.3} ms to allocate, fill and publish)",
        super::human(args.size)
    )?;
    if !namespaces.is_empty() {
        outln!("  the consumer runs in new namespaces: {namespaces}")?;
    }
    let socket = publisher.path().to_string_lossy().into_owned();
    let device_arg = args.device.to_string();
    let child = super::spawn_self_in(
        namespaces,
        "consumer",
        &[
            "attach",
            "--socket",
            &socket,
            "--set",
            super::serve::SET_NAME,
            "--device",
            &device_arg,
        ],
        Stdio::null(),
    )?;
    let out = child.wait_with_output().map_err(|e| Error::Io {
        context: "waiting for the consumer".into(),
        source: e,
    })?;
    let report = String::from_utf8_lossy(&out.stdout);
    outln!("  consumer: {}", report.trim())?;
    publisher.unpublish_set(super::serve::SET_NAME, Some(Duration::from_secs(10)))?;
    drop(buffers);
    if !out.status.success() {
        outln!("FAILED: the consumer process exited with {}", out.status)?;
        return Ok(Outcome::Mismatch);
    }
    outln!("OK: the consumer checked every value of all {n} buffers")?;
    Ok(Outcome::Ok)
}

pub fn run(args: &Args) -> Result<Outcome, Error> {
    let namespaces = super::consumer_namespaces(&args.consumer_namespaces)?;
    if let Some(n) = args.set {
        return run_set(args, n, &namespaces);
    }
    if args.size == 0 || !args.size.is_multiple_of(4) {
        return Err(Error::InvalidArgument {
            what: "size",
            reason: format!(
                "{} is not a positive multiple of 4 bytes (the demo shares 32-bit values)",
                args.size
            ),
        });
    }
    if !namespaces.is_empty() {
        return run_over_channel(args, &namespaces);
    }
    let words = args.size / 4;
    let mut steps = Steps(Vec::new());
    let (device, caps, buffer) = open_and_allocate(args, &mut steps)?;
    let mechanism = buffer.mechanism();

    let t = Instant::now();
    kernels::fill_u32(&buffer, PATTERN, Speed::Full)?;
    let ready = IpcEvent::new(&device)?;
    ready.record(buffer.stream())?;
    steps.add(
        "producer",
        "queue the fill kernel and record an event",
        super::ms_since(t),
    );

    let t = Instant::now();
    let mut export = buffer.export_region(0, args.size, Dtype::U32, Some(vec![words]))?;
    export.descriptor.event = Some(ready.handle()?);
    steps.add(
        "producer",
        "export the buffer and the event",
        super::ms_since(t),
    );

    outln!(
        "cuda-ipc demo: sharing {} between two processes on GPU {} ({}) with the {mechanism} mechanism",
        super::human(args.size),
        caps.ordinal,
        caps.name
    )?;

    let t = Instant::now();
    let device_arg = args.device.to_string();
    let mut child = super::spawn_self(
        "consumer",
        &["__demo-consumer", "--device", &device_arg],
        Stdio::piped(),
    )?;
    // The consumer takes an fd export from us with pidfd_getfd: it alone
    // may (if this fails, the consumer's error says why it could not).
    let fetcher = mechanism
        .uses_fd()
        .then(|| share::allow_fd_fetching_by(child.id()));
    let mut to_child = child.stdin.take().expect("piped");
    let from_child = LineReader::new(child.stdout.take().expect("piped"), "consumer process");
    let outcome = talk_to_consumer(
        &device,
        &buffer,
        &export.descriptor,
        &mut to_child,
        &from_child,
        &mut steps,
        t,
    );
    drop(to_child);
    let status = child.wait().map_err(|e| Error::Io {
        context: "waiting for the consumer".into(),
        source: e,
    })?;
    drop(fetcher);
    for (who, what, ms) in &steps.0 {
        outln!("  {who:<9} {what:<52} {ms:>10.3} ms")?;
    }
    let outcome = outcome?;
    if !status.success() {
        outln!("FAILED: the consumer process exited with {status}")?;
        return Ok(Outcome::Mismatch);
    }
    match outcome {
        Outcome::Ok => outln!(
            "OK: both processes saw each other's writes ({words} values checked in each direction, no copy)"
        )?,
        Outcome::Mismatch | Outcome::Exit(_) => outln!("FAILED: the data did not match")?,
    }
    drop(export);
    drop(buffer);
    Ok(outcome)
}

/// Sends the descriptor, collects the consumer's timings and event, and
/// checks the consumer's writes.
fn talk_to_consumer(
    device: &Device,
    buffer: &SharedBuffer,
    descriptor: &Descriptor,
    to_child: &mut std::process::ChildStdin,
    from_child: &LineReader,
    steps: &mut Steps,
    t: Instant,
) -> Result<Outcome, Error> {
    let words = buffer.byte_len() / 4;
    lines::send(to_child, &json!({ "descriptor": descriptor.to_value() }))?;
    let reply = from_child.next(CHILD_TIMEOUT)?;
    steps.add(
        "both",
        "spawn the consumer and exchange descriptors",
        super::ms_since(t),
    );
    if let Some(err) = reply.get("error") {
        return Err(Error::InvalidArgument {
            what: "consumer",
            reason: err.as_str().unwrap_or("failed").to_string(),
        });
    }
    for step in field(&reply, "steps")?.as_array().into_iter().flatten() {
        let name = step["what"].as_str().unwrap_or("?").to_string();
        steps.add("consumer", name, step["ms"].as_f64().unwrap_or(f64::NAN));
    }
    if reply["mismatch"].is_u64() {
        outln!(
            "consumer saw word {} differ from what the producer wrote",
            reply["mismatch"]
        )?;
        return Ok(Outcome::Mismatch);
    }
    let handle: IpcEventHandle = field(&reply, "event")?
        .as_str()
        .unwrap_or_default()
        .parse()?;

    let t = Instant::now();
    let done = IpcEvent::open(device, handle)?;
    done.wait_on(buffer.stream())?;
    let bad = kernels::check_u32(buffer, PATTERN.mapped(MUL, ADD))?;
    steps.add(
        "producer",
        format!("wait on the consumer's event and check {words} values"),
        super::ms_since(t),
    );
    drop(done);
    lines::send(to_child, &json!({ "bye": true }))?;
    Ok(match bad {
        None => Outcome::Ok,
        Some(i) => {
            outln!("producer saw word {i} differ from what the consumer wrote")?;
            Outcome::Mismatch
        }
    })
}

/// The channel entry the demo publishes with `--consumer-namespaces`.
const ENTRY: &str = "demo";

/// Which of `/proc/self/ns` a requested namespace makes new.
fn kind_of(n: Namespace) -> &'static str {
    match n {
        Namespace::Pid => "pid",
        Namespace::Ipc => "ipc",
        Namespace::Mount | Namespace::Shm => "mnt",
        Namespace::User => "user",
    }
}

/// This process's namespaces as `{kind: inode}`.
fn own_namespaces() -> Value {
    cuda_ipc::container::namespaces()
        .into_iter()
        .map(|n| (n.kind.to_string(), n.inode.map_or(Value::Null, Value::from)))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// The producer's first two steps, timed: start CUDA and open the
/// device, then allocate the buffer with the chosen mechanism.
fn open_and_allocate(
    args: &Args,
    steps: &mut Steps,
) -> Result<(Device, Capabilities, SharedBuffer), Error> {
    let t = Instant::now();
    let device = Device::open(args.device)?;
    let caps = device.capabilities()?;
    steps.add(
        "producer",
        "start CUDA and open the device",
        super::ms_since(t),
    );
    let t = Instant::now();
    let buffer = SharedBuffer::alloc(&device, args.size as usize, args.mechanism.0)?;
    steps.add(
        "producer",
        format!(
            "allocate {} ({})",
            super::human(args.size),
            buffer.mechanism()
        ),
        super::ms_since(t),
    );
    Ok((device, caps, buffer))
}

/// `demo --consumer-namespaces`: the consumer runs in new namespaces, where
/// it can neither fetch descriptors by our pid (a PID namespace of its own)
/// nor, with `shm`, open our events; so the buffer travels over the
/// channel, with its file descriptors, its event and its fence. The
/// consumer attaches (waiting on the event, or on the fence where events
/// cannot open), checks every value, transforms every value and releases
/// the lease, which waits for its kernel first; the producer unpublishes
/// (which returns once the lease is released) and checks every value again.
fn run_over_channel(args: &Args, namespaces: &ConsumerNamespaces) -> Result<Outcome, Error> {
    let words = args.size / 4;
    let mut steps = Steps(Vec::new());
    let (device, caps, buffer) = open_and_allocate(args, &mut steps)?;
    let mechanism = buffer.mechanism();
    let t = Instant::now();
    kernels::fill_u32(&buffer, PATTERN, Speed::Full)?;
    steps.add("producer", "queue the fill kernel", super::ms_since(t));

    let t = Instant::now();
    let publisher = Publisher::bind(
        &device,
        Endpoint::Name(format!("demo-{}", std::process::id())),
        PublisherConfig::default(),
    )?;
    let shared = publisher.publish(ENTRY, buffer, Dtype::U32, Some(vec![words]))?;
    steps.add(
        "producer",
        "publish it on the channel (an event and a fence)",
        super::ms_since(t),
    );
    outln!(
        "cuda-ipc demo: sharing {} between two processes on GPU {} ({}) with the {mechanism} \
         mechanism, the consumer in new namespaces ({namespaces}) and the buffer over the channel",
        super::human(args.size),
        caps.ordinal,
        caps.name
    )?;

    let t = Instant::now();
    let device_arg = args.device.to_string();
    let mut child = super::spawn_self_in(
        namespaces,
        "consumer",
        &[
            std::ffi::OsStr::new("__demo-consumer"),
            std::ffi::OsStr::new("--device"),
            std::ffi::OsStr::new(&device_arg),
            std::ffi::OsStr::new("--socket"),
            publisher.path().as_os_str(),
        ],
        Stdio::null(),
    )?;
    let from_child = LineReader::new(child.stdout.take().expect("piped"), "consumer process");
    let reply = from_child.next(CHILD_TIMEOUT);
    steps.add(
        "both",
        "spawn the consumer, which attaches, checks, transforms and releases",
        super::ms_since(t),
    );
    // Returns once the consumer's lease is released (its kernel finished)
    // or the consumer is gone.
    let t = Instant::now();
    let unpublished = publisher.unpublish(ENTRY, Some(Duration::from_secs(30)));
    let status = child.wait().map_err(|e| Error::Io {
        context: "waiting for the consumer".into(),
        source: e,
    })?;
    let reply = reply?;
    if let Some(err) = reply.get("error") {
        return Err(Error::Io {
            context: format!("the consumer in new namespaces ({namespaces})"),
            source: std::io::Error::other(err.as_str().unwrap_or("failed").to_string()),
        });
    }
    unpublished?;
    // Not checked again when the consumer already saw a difference.
    let bad = if reply["mismatch"].is_u64() {
        None
    } else {
        kernels::check_u32(shared.as_ref(), PATTERN.mapped(MUL, ADD))?
    };
    let check_ms = super::ms_since(t);
    for step in field(&reply, "steps")?.as_array().into_iter().flatten() {
        let name = step["what"].as_str().unwrap_or("?").to_string();
        steps.add("consumer", name, step["ms"].as_f64().unwrap_or(f64::NAN));
    }
    steps.add(
        "producer",
        format!("wait for the consumer's release and check {words} values"),
        check_ms,
    );
    for (who, what, ms) in &steps.0 {
        outln!("  {who:<9} {what:<58} {ms:>10.3} ms")?;
    }
    check_namespaces(&reply, namespaces)?;
    verdict(&reply, bad, status, words)
}

/// The demo's outcome: the consumer's exit `status`, the first word it saw
/// differ (in `reply`) and the first the producer saw differ (`bad`).
fn verdict(
    reply: &Value,
    bad: Option<u64>,
    status: std::process::ExitStatus,
    words: u64,
) -> Result<Outcome, Error> {
    if !status.success() {
        outln!("FAILED: the consumer process exited with {status}")?;
        return Ok(Outcome::Mismatch);
    }
    match (reply["mismatch"].as_u64(), bad) {
        (Some(i), _) => {
            outln!("FAILED: the consumer saw word {i} differ from what the producer wrote")?;
            Ok(Outcome::Mismatch)
        }
        (None, Some(i)) => {
            outln!("FAILED: the producer saw word {i} differ from what the consumer wrote")?;
            Ok(Outcome::Mismatch)
        }
        _ => {
            outln!(
                "OK: both processes saw each other's writes across namespaces ({words} values \
                 checked in each direction, no copy)"
            )?;
            Ok(Outcome::Ok)
        }
    }
}

/// Prints which namespaces of the consumer (as its `reply` reports them)
/// are not the producer's, and how it synchronised; an error if one it
/// was to get new is still ours (the wrapper did not work).
fn check_namespaces(reply: &Value, namespaces: &ConsumerNamespaces) -> Result<(), Error> {
    let theirs = field(reply, "namespaces")?;
    let ours = own_namespaces();
    let differ: Vec<&str> = cuda_ipc::container::namespaces()
        .into_iter()
        .map(|n| n.kind)
        .filter(|k| !theirs[*k].is_null() && theirs[*k] != ours[*k])
        .collect();
    outln!(
        "  the consumer's own namespaces: {}; it synchronised with the publisher's {}",
        if differ.is_empty() {
            "none".to_string()
        } else {
            differ.join(", ")
        },
        reply["sync"].as_str().unwrap_or("?")
    )?;
    match namespaces_of(namespaces).find(|n| !differ.contains(&kind_of(*n))) {
        Some(n) => Err(Error::Io {
            context: "demo --consumer-namespaces".into(),
            source: std::io::Error::other(format!(
                "the consumer ran in the producer's {} namespace, not a new one",
                kind_of(n)
            )),
        }),
        None => Ok(()),
    }
}

/// The namespaces of `set`, one by one.
fn namespaces_of(set: &ConsumerNamespaces) -> impl Iterator<Item = Namespace> + '_ {
    Namespace::ALL.into_iter().filter(|n| set.contains(*n))
}

/// The consumer of `demo --consumer-namespaces`: attaches the buffer over
/// the channel, checks it, transforms it, releases it, and reports (its
/// steps, how it synchronised, its namespaces) on standard output.
fn consumer_over_channel(device: usize, socket: &std::path::Path) -> Result<Outcome, Error> {
    let reply = (|| -> Result<Value, Error> {
        let mut steps = Vec::new();
        let t = Instant::now();
        let device = Device::open(device)?;
        steps.push(json!({ "what": "start CUDA and open the device", "ms": super::ms_since(t) }));

        let t = Instant::now();
        let sub = Subscriber::connect(&device, socket, SubscriberConfig::default())?;
        let attached = sub.attach::<u32>(ENTRY)?;
        let sync = if attached.uses_fence() {
            "fence"
        } else {
            "event"
        };
        steps.push(json!({
            "what": format!("connect, map the buffer ({}) and wait on the {sync}", attached.descriptor().mechanism()),
            "ms": super::ms_since(t),
        }));

        let t = Instant::now();
        let bad = kernels::check_u32(attached.buffer(), PATTERN)?;
        steps.push(json!({
            "what": format!("check {} values", attached.buffer().len()),
            "ms": super::ms_since(t),
        }));
        if bad.is_none() {
            let t = Instant::now();
            kernels::map_u32(attached.buffer(), MUL, ADD)?;
            steps.push(
                json!({ "what": "queue x -> 2x+1 on every value", "ms": super::ms_since(t) }),
            );
        }

        let t = Instant::now();
        sub.release(attached)?;
        steps.push(
            json!({ "what": "finish the kernel and release the lease", "ms": super::ms_since(t) }),
        );
        let mut reply = json!({ "steps": steps, "sync": sync, "namespaces": own_namespaces() });
        if let Some(i) = bad {
            reply["mismatch"] = i.into();
        }
        Ok(reply)
    })();
    let value = reply.unwrap_or_else(|e| json!({ "error": e.to_string() }));
    lines::send(&mut std::io::stdout().lock(), &value)?;
    Ok(Outcome::Ok)
}

/// What the consumer keeps until the producer has waited on its event.
type Kept = (IpcEvent, MappedBuffer<u32>);

/// The consumer process of the demo.
pub fn consumer(args: &ConsumerArgs) -> Result<Outcome, Error> {
    if let Some(socket) = &args.stream_socket {
        return super::stream::consumer(args.device, socket, args.check_every);
    }
    if let Some(socket) = &args.socket {
        return consumer_over_channel(args.device, socket);
    }
    let mut out = std::io::stdout().lock();
    let input = LineReader::new(std::io::stdin(), "producer process");
    let reply = (|| -> Result<(Value, Option<Kept>), Error> {
        let mut steps = Vec::new();
        let msg = input.next(CHILD_TIMEOUT)?;
        let descriptor = Descriptor::from_value(field(&msg, "descriptor")?)?;

        let t = Instant::now();
        let device = Device::open(args.device)?;
        steps.push(json!({ "what": "start CUDA and open the device", "ms": super::ms_since(t) }));

        let t = Instant::now();
        let buffer = share::open::<u32>(&device, &descriptor, Vec::new())?;
        steps.push(json!({ "what": format!("map the buffer ({}) and wait on the event", descriptor.mechanism()), "ms": super::ms_since(t) }));

        let t = Instant::now();
        let bad = kernels::check_u32(&buffer, PATTERN)?;
        steps.push(
            json!({ "what": format!("check {} values", buffer.len()), "ms": super::ms_since(t) }),
        );
        if let Some(i) = bad {
            return Ok((json!({ "steps": steps, "mismatch": i }), None));
        }

        let t = Instant::now();
        kernels::map_u32(&buffer, MUL, ADD)?;
        let done = IpcEvent::new(&device)?;
        done.record(buffer.stream())?;
        let handle = done.handle()?;
        steps.push(json!({ "what": "queue x -> 2x+1 on every value, record an event", "ms": super::ms_since(t) }));
        // The mapping and the event stay until the producer has waited on the event.
        Ok((
            json!({ "steps": steps, "event": handle.to_string() }),
            Some((done, buffer)),
        ))
    })();
    let (value, keep) = match reply {
        Ok(r) => r,
        Err(e) => (json!({ "error": e.to_string() }), None),
    };
    lines::send(&mut out, &value)?;
    if keep.is_some() {
        // Wait for the producer's goodbye (or its exit) before letting go.
        let _ = input.next(CHILD_TIMEOUT);
    }
    drop(keep);
    Ok(Outcome::Ok)
}
