//! The service's admin protocol: its methods (channel calls,
//! [`Client::call`](crate::channel::Client::call)) and their JSON bodies,
//! shared by the service and its clients (`cuda-ipc load`, `ls`, `stats`,
//! `drop`).
//!
//! | method | request | answer | who |
//! |---|---|---|---|
//! | `load` | [`LoadRequest`] | [`LoadAnswer`] | any allowed uid (its quota) |
//! | `ls` | [`LsRequest`] | [`LsAnswer`] | any allowed uid |
//! | `stats` | [`StatsRequest`] | [`StatsAnswer`] | any allowed uid |
//! | `drop` | [`DropRequest`] | [`DropAnswer`] | the set's owner uid, the service's uid |
//! | `shutdown` | [`ShutdownRequest`] | [`ShutdownAnswer`] | the service's uid |
//! | `open_write` | [`OpenWriteRequest`] | [`OpenWriteAnswer`] | the set's owner uid, the service's; any allowed uid for a new set |
//! | `commit` | [`CommitRequest`] | [`CommitAnswer`] | the connection that opened the write |
//! | `abort` | [`AbortRequest`] | [`AbortAnswer`] | the connection that opened the write |
//! | `aside` | [`AsideRequest`] | [`AsideAnswer`] | any allowed uid (a reader stepping aside for an in-place write) |
//! | `back` | [`BackRequest`] | [`BackAnswer`] | any allowed uid (the same reader, coming back) |
//! | `ready` | [`ReadyRequest`] | [`ReadyAnswer`] | any allowed uid (a reader connecting again after a restart) |
//! | `reconnected` | [`ReconnectedRequest`] | [`ReconnectedAnswer`] | any allowed uid (the same reader, once it took its leases back) |
//!
//! Decoding is strict both ways: an unknown field, a missing one or one of
//! the wrong type is an error naming it ([`decode`]). Refusals travel as
//! channel errors whose code is [`CatalogError::code`](super::CatalogError::code)
//! or one of `bad_request`, `checkpoint`, `not_readable`, `load_failed`,
//! `not_allowed`, `unknown_method`, `layout_mismatch`, `write_failed`
//! (the catalog's include `too_many_writes`).

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::catalog::{Holder, UidUsage};
mod aside;
mod tp;
pub use aside::{
    AsideAnswer, AsideRequest, BackAnswer, BackRequest, MAX_BACK_WAIT_MS, MAX_RECONNECTED_PENDING,
    ReadyAnswer, ReadyRequest, ReconnectedAnswer, ReconnectedRequest,
};
pub use tp::TpRequest;

/// The longest checkpoint path a load request carries, in bytes (a request
/// must fit in the channel's 4 KiB).
pub const MAX_PATH_LEN: usize = 2048;

/// A request of the admin protocol: its method and its answer's type.
pub trait Request: Serialize + DeserializeOwned {
    /// The method's name on the channel.
    const METHOD: &'static str;
    /// What the service answers.
    type Answer: Serialize + DeserializeOwned;
}

/// Decodes a body strictly (a JSON object of exactly the type's fields),
/// naming the method and the field at fault.
///
/// # Errors
/// A sentence naming `what` and serde's reason.
pub fn decode<T: DeserializeOwned>(what: &str, body: &Value) -> Result<T, String> {
    if !body.is_object() {
        return Err(format!(
            "a malformed {what} body: expected a JSON object, found {}",
            match body {
                Value::Null => "null",
                Value::Bool(_) => "a boolean",
                Value::Number(_) => "a number",
                Value::String(_) => "a string",
                Value::Array(_) => "an array",
                Value::Object(_) => "an object",
            }
        ));
    }
    T::deserialize(body).map_err(|e| format!("a malformed {what} body: {e}"))
}

/// Encodes a body.
///
/// # Panics
/// Never: these types have string keys and no custom `Serialize`.
pub fn encode<T: Serialize>(body: &T) -> Value {
    serde_json::to_value(body).expect("an admin body always encodes")
}

/// `load`: the service loads a safetensors checkpoint (a file, a sharded
/// checkpoint's index or a directory) from `path` itself, as its own uid,
/// and holds it as set `set`, counted against the caller's quota.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct LoadRequest {
    /// The set's name.
    pub set: String,
    /// The checkpoint, an absolute path (the service's working directory
    /// is not the caller's).
    pub path: String,
    /// Streams the copies run on (default: the loader's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub streams: Option<usize>,
    /// The size of each staging buffer in bytes (default: the loader's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staging: Option<u64>,
    /// One tensor-parallel rank's shard, into set `{set}.tp{rank}-of-{world}`
    /// (default: whole tensors into `set`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp: Option<TpRequest>,
}

impl LoadRequest {
    /// A load of `path` into set `set` with the loader's defaults.
    pub fn new(set: impl Into<String>, path: impl Into<String>) -> LoadRequest {
        LoadRequest {
            set: set.into(),
            path: path.into(),
            streams: None,
            staging: None,
            tp: None,
        }
    }

    /// The same request on `streams` streams with staging buffers of
    /// `staging` bytes (`None`: the loader's default).
    #[must_use]
    pub fn with_copies(mut self, streams: Option<usize>, staging: Option<u64>) -> LoadRequest {
        self.streams = streams;
        self.staging = staging;
        self
    }

    /// Checks what needs no file: the set name (a channel entry name not of
    /// the publisher's reserved prefix; a shard's name too), the shard and
    /// the path (absolute, at most [`MAX_PATH_LEN`] bytes).
    ///
    /// # Errors
    /// A sentence naming the field.
    pub fn validate(&self) -> Result<(), String> {
        validate_set_name(&self.set)?;
        self.target()?;
        if !self.path.starts_with('/') {
            return Err(format!(
                "path {:?} is not absolute; the service resolves paths in its own working \
                 directory, so send an absolute one",
                crate::units::shorten(&self.path, 80)
            ));
        }
        if self.path.len() > MAX_PATH_LEN {
            return Err(format!(
                "path is {} bytes long, more than {MAX_PATH_LEN}",
                self.path.len()
            ));
        }
        Ok(())
    }
}

/// Checks a set name: a channel entry name, not of the publisher's
/// reserved prefix.
///
/// # Errors
/// A sentence naming the set.
pub fn validate_set_name(set: &str) -> Result<(), String> {
    crate::channel::validate_entry_name(set).map_err(|e| format!("set name: {e}"))?;
    if set.starts_with(crate::exchange::HIDDEN_ENTRY_PREFIX) {
        return Err(format!(
            "set name {set:?}: names starting with {:?} are the publisher's own",
            crate::exchange::HIDDEN_ENTRY_PREFIX
        ));
    }
    Ok(())
}

impl Request for LoadRequest {
    const METHOD: &'static str = "load";
    type Answer = LoadAnswer;
}

/// What a load did.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct LoadAnswer {
    /// The set's name.
    pub set: String,
    /// Its version.
    pub version: u64,
    /// The checkpoint, as the service opened it.
    pub path: String,
    /// Files read.
    pub files: usize,
    /// Tensors loaded.
    pub tensors: usize,
    /// Bytes of tensors copied.
    pub bytes: u64,
    /// Device bytes held (counted against the quota).
    pub allocated: u64,
    /// Streams copied on.
    pub streams: usize,
    /// Seconds from the first allocation to the last copy.
    pub load_s: f64,
    /// Bytes of tensors per second, in GB/s (10^9 bytes).
    pub gb_per_s: f64,
}

/// `ls`: what the service holds. The body is `{}`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LsRequest {}

impl Request for LsRequest {
    const METHOD: &'static str = "ls";
    type Answer = LsAnswer;
}

/// One set, as `ls` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct SetRow {
    /// The name.
    pub name: String,
    /// Device bytes held.
    pub bytes: u64,
    /// Bytes of tensors.
    pub payload_bytes: u64,
    /// Tensors.
    pub tensors: usize,
    /// Its version.
    pub version: u64,
    /// The uid that loaded it.
    pub owner_uid: u32,
    /// The checkpoint it came from.
    pub loaded_from: String,
    /// When it was loaded, in seconds since the Unix epoch.
    pub created_unix: u64,
    /// The readers holding leases on it, one per lease.
    pub leases: Vec<Holder>,
    /// `committed`, or `writing` while a writer holds it (absent in
    /// answers of services without writers: `committed`).
    #[serde(default)]
    pub state: SetState,
    /// The writer holding it, and the version it writes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writer: Option<WriterRow>,
    /// Restarts of the serving process this version was kept through (0:
    /// loaded or committed by the process serving it now).
    #[serde(default)]
    pub restarts: u64,
    /// Readers of the serving process before a restart that may map it and
    /// have not connected again (a write in place waits for them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_reconnected: Vec<Holder>,
}

/// Whether a set is being written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SetState {
    /// Its current version is committed; no writer.
    #[default]
    Committed,
    /// A writer fills its next version (readers read the current one; a
    /// new set has none yet: version 0; in place, readers stepped aside).
    Writing,
    /// An in-place write of it was cut short: its bytes are partly the next
    /// version's. Attaches are refused (`torn`) until a write commits.
    Torn,
}

/// A set's writer, as `ls` shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct WriterRow {
    /// The writer's process id.
    pub pid: u32,
    /// Its uid.
    pub uid: u32,
    /// The version it writes.
    pub version: u64,
    /// Device bytes of its staging version.
    pub bytes: u64,
}

/// The answer to `ls`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct LsAnswer {
    /// Every set, in name order.
    pub sets: Vec<SetRow>,
}

/// `stats`: per-uid use, totals, the device's memory. The body is `{}`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StatsRequest {}

impl Request for StatsRequest {
    const METHOD: &'static str = "stats";
    type Answer = StatsAnswer;
}

/// The answer to `stats`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct StatsAnswer {
    /// The service's process id.
    pub pid: u32,
    /// The service's uid.
    pub service_uid: u32,
    /// The quota of a uid other than the service's without an override
    /// (`None`: no limit).
    pub default_quota: Option<u64>,
    /// Each uid that holds a set or an old version, is loading or writing
    /// one, or has its own quota.
    pub uids: Vec<UidUsage>,
    /// How many sets.
    pub sets: usize,
    /// Device bytes of every set's current version and of every old
    /// version (replaced, or dropped with `force`) that readers still keep.
    pub total_bytes: u64,
    /// Loads in progress.
    pub loads_in_progress: usize,
    /// Leases readers hold on sets (current versions, and old versions
    /// they keep).
    pub leases: usize,
    /// Free device memory in bytes (`cuMemGetInfo`), if it could be read.
    pub device_free: Option<u64>,
    /// Total device memory in bytes, if it could be read.
    pub device_total: Option<u64>,
    /// Whether the service is stopping.
    pub stopping: bool,
}

/// `drop`: forget a set and give its memory back once no reader maps it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct DropRequest {
    /// The set.
    pub set: String,
    /// Drop it even while readers hold leases (they keep what they
    /// mapped; the memory goes when they let go).
    #[serde(default)]
    pub force: bool,
}

impl DropRequest {
    /// A drop of `set`, forced or not.
    pub fn new(set: impl Into<String>, force: bool) -> DropRequest {
        DropRequest {
            set: set.into(),
            force,
        }
    }
}

impl Request for DropRequest {
    const METHOD: &'static str = "drop";
    type Answer = DropAnswer;
}

/// What a drop did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct DropAnswer {
    /// The set.
    pub set: String,
    /// Device bytes it held.
    pub bytes: u64,
    /// The readers that still held it (a forced drop).
    pub held_by: Vec<Holder>,
}

/// `shutdown`: the service stops as on SIGTERM. The body is `{}`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShutdownRequest {}

impl Request for ShutdownRequest {
    const METHOD: &'static str = "shutdown";
    type Answer = ShutdownAnswer;
}

/// The answer to `shutdown`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct ShutdownAnswer {
    /// Always true: the service is stopping.
    pub stopping: bool,
}

/// One tensor of a layout: what a writer gives for a new set.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct TensorSpec {
    /// Its name in the set (a state dict's key).
    pub name: String,
    /// Its type, as a descriptor names it (`bf16`, `f32`, `f8e4m3fn`, ...).
    pub dtype: String,
    /// Its shape, in elements; no dimension of 0.
    pub shape: Vec<u64>,
}

impl TensorSpec {
    /// A tensor `name` of `dtype` and `shape`.
    pub fn new(
        name: impl Into<String>,
        dtype: cuda_ipc_core::Dtype,
        shape: Vec<u64>,
    ) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            dtype: dtype.to_string(),
            shape,
        }
    }
}

/// `open_write`: open a write session on a set (one writer at a time; the
/// caller's connection is the lock). For an existing set give no layout:
/// the staging version has its layout (names, dtypes, shapes) and
/// undefined contents, so the writer writes every byte. For a new set
/// give the layout.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct OpenWriteRequest {
    /// The set.
    pub set: String,
    /// The tensors of a new set, in order.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "layout_objects"
    )]
    pub layout: Option<Vec<TensorSpec>>,
    /// Write the current version's memory in place (an existing set; no
    /// second copy): its readers must step aside first (`aside`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub in_place: bool,
    /// In place: how long to wait for every reader to step aside, in
    /// milliseconds (default [`DEFAULT_ASIDE_WAIT_MS`], at most
    /// [`MAX_ASIDE_WAIT_MS`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_ms: Option<u64>,
}

/// How long an in-place `open_write` waits for readers to step aside,
/// unless it says.
pub const DEFAULT_ASIDE_WAIT_MS: u64 = 10_000;
/// The longest wait an in-place `open_write` may ask for.
pub const MAX_ASIDE_WAIT_MS: u64 = 600_000;

/// A layout whose entries are JSON objects: serde alone would also build
/// a [`TensorSpec`] from an array of its fields in order, which the
/// protocol does not have.
fn layout_objects<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<Vec<TensorSpec>>, D::Error> {
    let raw: Option<Vec<serde_json::Map<String, Value>>> = Option::deserialize(d)?;
    raw.map(|entries| {
        entries
            .into_iter()
            .map(|m| TensorSpec::deserialize(Value::Object(m)).map_err(serde::de::Error::custom))
            .collect()
    })
    .transpose()
}

impl OpenWriteRequest {
    /// A write of a new version of the existing set `set`.
    pub fn existing(set: impl Into<String>) -> OpenWriteRequest {
        OpenWriteRequest {
            set: set.into(),
            layout: None,
            in_place: false,
            wait_ms: None,
        }
    }

    /// A write of the existing set `set` in place, waiting up to `wait_ms`
    /// for its readers to step aside (`None`: the default).
    pub fn in_place(set: impl Into<String>, wait_ms: Option<u64>) -> OpenWriteRequest {
        OpenWriteRequest {
            set: set.into(),
            layout: None,
            in_place: true,
            wait_ms,
        }
    }

    /// A write of a new set `set` with these tensors.
    pub fn new_set(set: impl Into<String>, layout: Vec<TensorSpec>) -> OpenWriteRequest {
        OpenWriteRequest {
            set: set.into(),
            layout: Some(layout),
            in_place: false,
            wait_ms: None,
        }
    }
}

impl Request for OpenWriteRequest {
    const METHOD: &'static str = "open_write";
    type Answer = OpenWriteAnswer;
}

/// What `open_write` opened.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct OpenWriteAnswer {
    /// The set.
    pub set: String,
    /// The version a commit makes current.
    pub version: u64,
    /// The hidden entry of the staging version: attach it read-write
    /// ([`Subscriber::attach_set_with`](crate::exchange::Subscriber::attach_set_with));
    /// told only to the writer, left out of listings.
    pub staging: String,
    /// Its tensors.
    pub tensors: usize,
    /// Bytes of tensors.
    pub payload_bytes: u64,
    /// Device bytes, counted against the set owner's quota.
    pub bytes: u64,
    /// The staging version's layout hash, which the commit must name
    /// ([`layout_hash`](super::layout::layout_hash)).
    pub layout_hash: String,
    /// Whether the set is new.
    pub creates: bool,
    /// Whether the staging entry is the current version's own memory
    /// (an in-place write: `bytes` is 0).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub in_place: bool,
}

/// `commit`: make the staging version current, after the writer's work on
/// it has finished. `layout_hash` is the one of the staging version the
/// writer attached.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct CommitRequest {
    /// The set.
    pub set: String,
    /// The staging version's layout hash, as the writer saw it.
    pub layout_hash: String,
}

impl CommitRequest {
    /// A commit of `set` whose staging version has `layout_hash`.
    pub fn new(set: impl Into<String>, layout_hash: impl Into<String>) -> CommitRequest {
        CommitRequest {
            set: set.into(),
            layout_hash: layout_hash.into(),
        }
    }
}

impl Request for CommitRequest {
    const METHOD: &'static str = "commit";
    type Answer = CommitAnswer;
}

/// What a commit did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct CommitAnswer {
    /// The set.
    pub set: String,
    /// Its version now.
    pub version: u64,
    /// The version it replaced, kept until its readers let go.
    pub retired_version: Option<u64>,
    /// Readers of the replaced version told (an update notice each).
    pub readers_told: usize,
}

/// `abort`: discard the staging version; the current one stays.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct AbortRequest {
    /// The set.
    pub set: String,
}

impl AbortRequest {
    /// An abort of the write of `set`.
    pub fn new(set: impl Into<String>) -> AbortRequest {
        AbortRequest { set: set.into() }
    }
}

impl Request for AbortRequest {
    const METHOD: &'static str = "abort";
    type Answer = AbortAnswer;
}

/// What an abort discarded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct AbortAnswer {
    /// The set.
    pub set: String,
    /// The version that was not committed.
    pub version: u64,
}

/// Every method, in the table's order.
pub const METHODS: [&str; 12] = [
    LoadRequest::METHOD,
    LsRequest::METHOD,
    StatsRequest::METHOD,
    DropRequest::METHOD,
    ShutdownRequest::METHOD,
    OpenWriteRequest::METHOD,
    CommitRequest::METHOD,
    AbortRequest::METHOD,
    AsideRequest::METHOD,
    BackRequest::METHOD,
    ReadyRequest::METHOD,
    ReconnectedRequest::METHOD,
];

/// One method's bodies, with the types erased: its name, and its request's
/// and its answer's decoders, each of which decodes a body strictly (as
/// [`decode`] does) and encodes what it got again (as [`encode`] does).
#[derive(Clone, Copy, Debug)]
pub struct MethodBodies {
    /// The method's name on the channel.
    pub method: &'static str,
    /// Decodes a request body and encodes it again.
    pub request: fn(&Value) -> Result<Value, String>,
    /// Decodes an answer body and encodes it again.
    pub answer: fn(&Value) -> Result<Value, String>,
}

fn request_body<R: Request>(body: &Value) -> Result<Value, String> {
    decode::<R>(R::METHOD, body).map(|r| encode(&r))
}

fn answer_body<R: Request>(body: &Value) -> Result<Value, String> {
    decode::<R::Answer>(&format!("{} answer", R::METHOD), body).map(|a| encode(&a))
}

const fn bodies<R: Request>() -> MethodBodies {
    MethodBodies {
        method: R::METHOD,
        request: request_body::<R>,
        answer: answer_body::<R>,
    }
}

/// Every method with its bodies, in [`METHODS`]'s order (a unit test
/// checks that they list the same methods): what checks every method's
/// decoding (the `admin_body` fuzz target, the tests that replay its
/// corpus) iterates over, so that a method listed here is checked without
/// changing them.
pub const BODIES: [MethodBodies; 12] = [
    bodies::<LoadRequest>(),
    bodies::<LsRequest>(),
    bodies::<StatsRequest>(),
    bodies::<DropRequest>(),
    bodies::<ShutdownRequest>(),
    bodies::<OpenWriteRequest>(),
    bodies::<CommitRequest>(),
    bodies::<AbortRequest>(),
    bodies::<AsideRequest>(),
    bodies::<BackRequest>(),
    bodies::<ReadyRequest>(),
    bodies::<ReconnectedRequest>(),
];

#[cfg(test)]
mod tests;
