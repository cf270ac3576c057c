//! The one error type of the crate.
//!
//! Every fallible function returns [`Error`]. A failed driver call names the
//! C function and keeps the raw `CUresult` code; user-facing messages say what
//! to do next. [`Error::kind`] sorts errors into the few classes a caller (or
//! the command-line tool's exit code) acts on.

use std::fmt;

use cudarc::driver::sys::CUresult;

/// A `Result` whose error is this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A CUDA driver version as `cuDriverGetVersion` reports it (`1000 * major + 10 * minor`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub struct DriverVersion(pub i32);

impl DriverVersion {
    /// The major version (13 for CUDA 13.0).
    pub fn major(self) -> i32 {
        self.0 / 1000
    }
    /// The minor version (0 for CUDA 13.0).
    pub fn minor(self) -> i32 {
        (self.0 % 1000) / 10
    }
}

impl serde::Serialize for DriverVersion {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl fmt::Display for DriverVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major(), self.minor())
    }
}

/// What went wrong, in the classes a caller acts on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// No usable driver or device, or the device or platform lacks a feature.
    Unavailable,
    /// The caller's input was malformed or inconsistent (a handle, a
    /// descriptor, a size, a range, a frame).
    InvalidInput,
    /// The other process is gone, or refused us.
    Peer,
    /// A wait ran out of time.
    Timeout,
    /// A driver call or a system call failed at run time.
    Failed,
}

/// The error type of every fallible function in this crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `libcuda.so.1` could not be loaded.
    #[error("the CUDA driver library (libcuda.so.1) could not be loaded: {reason}")]
    DriverNotFound {
        /// Why loading failed, and what to do about it.
        reason: String,
    },

    /// The driver is older than the CUDA version this crate was built for.
    #[error(
        "the NVIDIA driver supports CUDA {found}, older than CUDA {required} which cuda-ipc \
         needs; update the driver (R580 or newer)"
    )]
    DriverTooOld {
        /// The version the driver reports.
        found: DriverVersion,
        /// The oldest version we accept.
        required: DriverVersion,
    },

    /// The driver loaded but shows no device, or not the one asked for.
    #[error(
        "CUDA device {ordinal} is not available: the driver sees {count} device(s). \
         Check `nvidia-smi`, CUDA_VISIBLE_DEVICES, and (in a container) that the GPU is passed in"
    )]
    NoDevice {
        /// The ordinal that was asked for.
        ordinal: usize,
        /// How many devices the driver reports.
        count: usize,
    },

    /// A lease was released explicitly while other views of its buffer
    /// (clones, slices, casts) were alive.
    #[error(
        "lease {lease} on \"{name}\" is still held by {views} other view(s) of its buffer \
         (clones, slices or casts); drop them first. The lease is released when the last \
         view drops"
    )]
    ViewsAlive {
        /// The entry's (or ring's) name.
        name: String,
        /// The lease id.
        lease: u64,
        /// How many other views hold it.
        views: usize,
    },

    /// Something was asked to close while others still use it.
    #[error(
        "{what} is still used by {users} lease holder(s) (attachments, sets, rings or views of them); {then}"
    )]
    StillInUse {
        /// What could not be closed.
        what: &'static str,
        /// How many hold it.
        users: usize,
        /// What to do.
        then: &'static str,
    },

    /// A driver call returned an error.
    #[error("{call} failed with {name} ({code}){}", hint_suffix(*.hint))]
    Driver {
        /// The C function that failed, for example `cuIpcOpenMemHandle`.
        call: &'static str,
        /// The raw `CUresult`.
        code: i32,
        /// The same `CUresult`, typed (compare with its variants, not with
        /// numbers).
        result: CUresult,
        /// The `CUresult` name, for example `CUDA_ERROR_INVALID_CONTEXT`.
        name: String,
        /// What this failure usually means and what to do, where known.
        hint: Option<&'static str>,
    },

    /// The device, driver or platform does not offer what was asked for.
    #[error("{what} is not available here: {why}")]
    Unsupported {
        /// The feature, for example "fabric handles".
        what: &'static str,
        /// Why, and what would make it work.
        why: String,
    },

    /// Memory from a stream-ordered allocator cannot be shared with a legacy IPC handle.
    #[error(
        "the memory at {ptr:#x} was allocated stream-ordered (cuMemAllocAsync, the default \
         allocator of cudarc's `CudaStream::alloc`), and legacy IPC handles cannot share it. \
         Allocate it with `LegacyBuffer::alloc` or cudarc's `result::malloc_sync`, or from a \
         shareable memory pool (`pool::SharedPool`)"
    )]
    StreamOrdered {
        /// The pointer that was to be exported.
        ptr: u64,
    },

    /// A legacy handle was opened by the process that exported it.
    #[error(
        "this IPC handle was exported by this same process, and CUDA cannot open a process's \
         own IPC handles (cuIpcOpenMemHandle fails with CUDA_ERROR_INVALID_CONTEXT). \
         Use the exported buffer directly, or open the handle in another process"
    )]
    SameProcess,

    /// Bytes or text that should have been a handle were not one.
    #[error("invalid {what}: {reason}")]
    InvalidHandle {
        /// Which kind of handle, for example "IPC memory handle".
        what: &'static str,
        /// What was wrong with it.
        reason: String,
    },

    /// A descriptor field was missing or malformed.
    #[error("descriptor field `{field}`: {reason}")]
    Descriptor {
        /// The field, as named in the JSON.
        field: String,
        /// What was wrong with it.
        reason: String,
    },

    /// An argument was out of its domain.
    #[error("invalid {what}: {reason}")]
    InvalidArgument {
        /// The argument, for example "size".
        what: &'static str,
        /// What was wrong with it and what is accepted.
        reason: String,
    },

    /// A range did not fit inside the memory it was to view.
    #[error(
        "range of {len} bytes at offset {offset} does not fit in {size} bytes of shared memory"
    )]
    OutOfBounds {
        /// The offset asked for.
        offset: u64,
        /// The length asked for.
        len: u64,
        /// The size of the memory.
        size: u64,
    },

    /// A checkpoint file (a `.safetensors` file or a sharded checkpoint's
    /// index) was malformed or inconsistent with the others.
    #[error("checkpoint {}: {field}: {reason}", .file.display())]
    Checkpoint {
        /// The file that was wrong.
        file: std::path::PathBuf,
        /// The field or part of the file, for example `weight_map` or
        /// `header` or a tensor's name.
        field: String,
        /// What was wrong with it, and what to do.
        reason: String,
    },

    /// Loading a checkpoint's tensor onto the device failed: the file and
    /// the tensor, and what failed (a driver call, usually). Its
    /// [`kind`](Error::kind) is the cause's.
    #[error("loading tensor {tensor} of {}: {source}", .file.display())]
    Load {
        /// The checkpoint file the tensor is read from.
        file: std::path::PathBuf,
        /// The tensor's name, as in the file.
        tensor: String,
        /// What failed.
        #[source]
        source: Box<Error>,
    },

    /// Saving a tensor to a safetensors file failed: the file and the
    /// tensor, and what failed (a driver call or a write). Its
    /// [`kind`](Error::kind) is the cause's.
    #[error("saving tensor {tensor} to {}: {source}", .file.display())]
    Save {
        /// The file being written.
        file: std::path::PathBuf,
        /// The tensor's name in the file.
        tensor: String,
        /// What failed.
        #[source]
        source: Box<Error>,
    },

    /// A PyTorch sharing record was malformed or of an unsupported kind.
    #[error("PyTorch share record: {0}")]
    Torch(String),

    /// The exchange channel failed.
    #[error(transparent)]
    Channel(#[from] crate::channel::ChannelError),

    /// A system call failed.
    #[error("{context}: {source}")]
    Io {
        /// What we were doing.
        context: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
}

fn hint_suffix(hint: Option<&'static str>) -> String {
    match hint {
        Some(h) => format!(": {h}"),
        None => String::new(),
    }
}

impl Error {
    /// The class of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::DriverNotFound { .. }
            | Error::DriverTooOld { .. }
            | Error::NoDevice { .. }
            | Error::Unsupported { .. } => ErrorKind::Unavailable,
            Error::StreamOrdered { .. }
            | Error::SameProcess
            | Error::InvalidHandle { .. }
            | Error::Descriptor { .. }
            | Error::InvalidArgument { .. }
            | Error::OutOfBounds { .. }
            | Error::ViewsAlive { .. }
            | Error::StillInUse { .. }
            | Error::Checkpoint { .. }
            | Error::Torch(_) => ErrorKind::InvalidInput,
            Error::Driver { call, result, .. } => driver_kind(call, *result),
            Error::Channel(e) => channel_kind(e.kind()),
            Error::Io { .. } => ErrorKind::Failed,
            Error::Load { source, .. } | Error::Save { source, .. } => source.kind(),
        }
    }

    /// The `CUresult` if this is a driver error.
    pub fn driver_result(&self) -> Option<CUresult> {
        match self {
            Error::Driver { result, .. } => Some(*result),
            Error::Load { source, .. } | Error::Save { source, .. } => source.driver_result(),
            _ => None,
        }
    }

    /// An I/O error with a sentence of context.
    #[doc(hidden)]
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// An invalid argument.
    #[doc(hidden)]
    pub fn arg(what: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            what,
            reason: reason.into(),
        }
    }

    /// [`Error::OutOfBounds`] unless `len` bytes at `offset` lie inside
    /// `size` bytes (an offset and length whose sum overflows do not): the
    /// one range check of the crates.
    #[doc(hidden)]
    pub fn check_range(offset: u64, len: u64, size: u64) -> Result<()> {
        if in_bounds(offset, len, size) {
            Ok(())
        } else {
            Err(Error::OutOfBounds { offset, len, size })
        }
    }
}

/// Whether `len` bytes starting at `offset` end inside `size` bytes (an
/// offset and length whose sum overflows do not).
pub(crate) fn in_bounds(offset: u64, len: u64, size: u64) -> bool {
    offset.checked_add(len).is_some_and(|end| end <= size)
}

/// The crate's class of a channel error.
fn channel_kind(kind: crate::channel::ChannelErrorKind) -> ErrorKind {
    use crate::channel::ChannelErrorKind as K;
    match kind {
        K::InvalidInput => ErrorKind::InvalidInput,
        K::Peer => ErrorKind::Peer,
        K::Timeout => ErrorKind::Timeout,
        _ => ErrorKind::Failed,
    }
}

/// Codes that mean "this machine cannot do it", as opposed to a failure.
fn driver_kind(call: &str, result: CUresult) -> ErrorKind {
    use CUresult as R;
    match result {
        // The driver cannot start in this process (a new PID namespace
        // that still sees its parent's /proc).
        R::CUDA_ERROR_OPERATING_SYSTEM if call == "cuInit" => ErrorKind::Unavailable,
        R::CUDA_ERROR_NO_DEVICE
        | R::CUDA_ERROR_INVALID_DEVICE
        | R::CUDA_ERROR_DEVICE_UNAVAILABLE
        | R::CUDA_ERROR_NOT_PERMITTED
        | R::CUDA_ERROR_NOT_SUPPORTED
        | R::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED
        | R::CUDA_ERROR_SYSTEM_NOT_READY => ErrorKind::Unavailable,
        // INVALID_CONTEXT: opening one's own handle; ALREADY_MAPPED: the
        // same allocation mapped twice.
        R::CUDA_ERROR_INVALID_VALUE
        | R::CUDA_ERROR_INVALID_HANDLE
        | R::CUDA_ERROR_INVALID_CONTEXT
        | R::CUDA_ERROR_ALREADY_MAPPED => ErrorKind::InvalidInput,
        _ => ErrorKind::Failed,
    }
}

/// What a driver error usually means for the call that returned it.
pub(crate) fn driver_hint(call: &'static str, result: CUresult) -> Option<&'static str> {
    use CUresult as R;
    Some(match (call, result) {
        ("cuInit", R::CUDA_ERROR_OPERATING_SYSTEM) => {
            "the driver cannot start in this process; on an H200 with driver 580 this is what a \
             process in a new PID namespace gets while /proc is still its parent's (unshare --pid \
             without --mount-proc): give the namespace its own /proc (unshare --pid --fork \
             --mount-proc, as container runtimes do)"
        }
        ("cuIpcOpenMemHandle", R::CUDA_ERROR_INVALID_CONTEXT) => {
            "a process cannot open an IPC handle it exported itself; open it in another process"
        }
        ("cuIpcOpenMemHandle", R::CUDA_ERROR_INVALID_VALUE | R::CUDA_ERROR_INVALID_HANDLE) => {
            "the handle does not name live memory: it is malformed, or the exporter freed the \
             memory or exited"
        }
        (
            "cuIpcOpenMemHandle",
            R::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED
            | R::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
            | R::CUDA_ERROR_PEER_ACCESS_NOT_ENABLED,
        ) => {
            "the memory lives on another GPU without peer access to this one; open it with \
             OpenFlags::LAZY_ENABLE_PEER_ACCESS on a device with peer access"
        }
        ("cuIpcOpenEventHandle", R::CUDA_ERROR_INVALID_VALUE | R::CUDA_ERROR_INVALID_HANDLE) => {
            "the event handle is malformed, or its exporter destroyed the event or exited"
        }
        ("cuIpcOpenEventHandle", R::CUDA_ERROR_MAP_FAILED) => {
            "the event's shared memory in /dev/shm is not shared with the exporter: this process \
             has a /dev/shm of its own (a container's private /dev/shm, or a new mount \
             namespace) or runs as another user; the exchange then synchronises with GPU-side \
             fences instead (SubscriberConfig sync auto or fence), or share /dev/shm \
             (docker --ipc=shareable / container:NAME, or one emptyDir volume at /dev/shm)"
        }
        ("cuIpcOpenMemHandle", R::CUDA_ERROR_MAP_FAILED) => {
            "the exporter's memory could not be mapped here: legacy handles need the exporter's \
             /dev/shm and user (a container with its own /dev/shm, or another user); use a vmm \
             or pool export over the channel, whose descriptors need neither"
        }
        (
            "cuMemImportFromShareableHandle" | "cuMemPoolImportFromShareableHandle",
            R::CUDA_ERROR_INVALID_VALUE | R::CUDA_ERROR_UNKNOWN,
        ) => {
            "the file descriptor is not the shareable handle of a CUDA allocation or pool (a \
             wrong or stale descriptor, or one of another kind)"
        }
        ("cuMemMap", R::CUDA_ERROR_INVALID_VALUE | R::CUDA_ERROR_NOT_SUPPORTED) => {
            "the mapping's size does not match the imported allocation; pass the exporter's \
             allocation size (the descriptor's alloc_size)"
        }
        ("cuMemPoolImportPointer", R::CUDA_ERROR_INVALID_VALUE) => {
            "the export data does not name a live allocation of this pool (malformed, or freed \
             by the exporter)"
        }
        ("cuIpcGetMemHandle", R::CUDA_ERROR_INVALID_VALUE) => {
            "the pointer is not from cuMemAlloc: stream-ordered (cuMemAllocAsync) and VMM \
             memory need the pool or VMM mechanism instead"
        }
        ("cuIpcGetEventHandle", R::CUDA_ERROR_INVALID_VALUE) => {
            "the event was not created with CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING"
        }
        (_, R::CUDA_ERROR_OUT_OF_MEMORY) => {
            "the device is out of memory; free memory or ask for less"
        }
        (_, R::CUDA_ERROR_NOT_INITIALIZED | R::CUDA_ERROR_DEINITIALIZED) => {
            "the driver is not initialised or is shutting down"
        }
        (_, R::CUDA_ERROR_DEVICE_UNAVAILABLE) => {
            "the device is in exclusive-process or prohibited compute mode, or busy; check \
             `nvidia-smi -q -d COMPUTE`"
        }
        (_, R::CUDA_ERROR_NO_DEVICE) => {
            "no CUDA device is visible; check nvidia-smi and CUDA_VISIBLE_DEVICES"
        }
        (_, R::CUDA_ERROR_NOT_PERMITTED) => {
            "the operation is not permitted here; fabric handles need an IMEX channel \
             (/dev/nvidia-caps-imex-channels) and a running IMEX service"
        }
        (_, R::CUDA_ERROR_NOT_SUPPORTED) => {
            "not supported on this device or platform (CUDA IPC is not available on Windows \
             or WSL, or on devices without unified addressing)"
        }
        (_, R::CUDA_ERROR_UNKNOWN) => {
            "the driver reported an unknown error; check dmesg and nvidia-smi"
        }
        _ => return None,
    })
}

/// Converts a cudarc driver error into ours, naming the call.
pub fn from_cudarc(call: &'static str, err: cudarc::driver::DriverError) -> Error {
    driver_error(call, err.0)
}

/// Builds an [`Error::Driver`] from a raw result.
pub(crate) fn driver_error(call: &'static str, result: cudarc::driver::sys::CUresult) -> Error {
    Error::Driver {
        call,
        code: result as i32,
        result,
        // The bindings' Debug output is the C enumerator's name; no driver call,
        // so this works when the driver is in a bad state.
        name: format!("{result:?}"),
        hint: driver_hint(call, result),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::driver::sys::CUresult;

    #[test]
    fn driver_error_names_call_code_and_hint() {
        let e = driver_error("cuIpcOpenMemHandle", CUresult::CUDA_ERROR_INVALID_CONTEXT);
        let text = e.to_string();
        assert!(
            text.starts_with("cuIpcOpenMemHandle failed with CUDA_ERROR_INVALID_CONTEXT (201)")
        );
        assert!(text.contains("exported itself"), "{text}");
        assert_eq!(e.driver_result().map(|r| r as i32), Some(201));
        assert_eq!(
            e.driver_result(),
            Some(CUresult::CUDA_ERROR_INVALID_CONTEXT)
        );
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
    }

    #[test]
    fn import_failures_say_what_was_wrong() {
        let e = driver_error(
            "cuMemImportFromShareableHandle",
            CUresult::CUDA_ERROR_UNKNOWN,
        );
        assert!(
            e.to_string()
                .contains("not the shareable handle of a CUDA allocation"),
            "{e}"
        );
        let e = driver_error("cuMemMap", CUresult::CUDA_ERROR_NOT_SUPPORTED);
        assert!(e.to_string().contains("alloc_size"), "{e}");
        assert!(!e.to_string().contains("Windows"), "{e}");
        let e = driver_error("cuIpcOpenEventHandle", CUresult::CUDA_ERROR_MAP_FAILED);
        assert!(e.to_string().contains("/dev/shm is not shared"), "{e}");
        assert!(e.to_string().contains("fences"), "{e}");
        let e = driver_error("cuIpcOpenMemHandle", CUresult::CUDA_ERROR_MAP_FAILED);
        assert!(e.to_string().contains("over the channel"), "{e}");
    }

    #[test]
    fn unknown_pairs_have_no_hint() {
        let e = driver_error("cuMemcpyDtoH", CUresult::CUDA_ERROR_LAUNCH_FAILED);
        assert_eq!(
            e.to_string(),
            "cuMemcpyDtoH failed with CUDA_ERROR_LAUNCH_FAILED (719)"
        );
        assert_eq!(e.kind(), ErrorKind::Failed);
    }

    #[test]
    fn unavailable_codes() {
        for r in [
            CUresult::CUDA_ERROR_NOT_SUPPORTED,
            CUresult::CUDA_ERROR_NOT_PERMITTED,
            CUresult::CUDA_ERROR_NO_DEVICE,
        ] {
            assert_eq!(
                driver_error("cuMemCreate", r).kind(),
                ErrorKind::Unavailable
            );
        }
    }

    #[test]
    fn channel_errors_keep_their_class() {
        use crate::channel::ChannelError;
        let cases = [
            (ChannelError::PeerGone, ErrorKind::Peer),
            (
                ChannelError::Timeout {
                    what: "a reply".into(),
                    after: std::time::Duration::from_secs(1),
                },
                ErrorKind::Timeout,
            ),
            (
                ChannelError::NotFound { name: "a".into() },
                ErrorKind::InvalidInput,
            ),
            (ChannelError::ShutDown, ErrorKind::Failed),
        ];
        for (e, kind) in cases {
            let e = Error::from(e);
            assert_eq!(e.kind(), kind, "{e}");
        }
    }

    #[test]
    fn a_driver_that_cannot_start_is_unavailable_with_a_hint() {
        let e = driver_error("cuInit", CUresult::CUDA_ERROR_OPERATING_SYSTEM);
        assert_eq!(e.kind(), ErrorKind::Unavailable);
        assert!(e.to_string().contains("--mount-proc"), "{e}");
        // The same code from another call is a plain failure.
        let e = driver_error("cuMemMap", CUresult::CUDA_ERROR_OPERATING_SYSTEM);
        assert_eq!(e.kind(), ErrorKind::Failed);
    }

    #[test]
    fn every_hinted_result_keeps_its_raw_code() {
        for r in [
            CUresult::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED,
            CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,
            CUresult::CUDA_ERROR_PEER_ACCESS_NOT_ENABLED,
        ] {
            let e = driver_error("cuIpcOpenMemHandle", r);
            assert_eq!(e.driver_result().map(|r| r as i32), Some(r as i32));
            assert!(e.to_string().contains("peer access"), "{e}");
        }
        assert!(Error::SameProcess.driver_result().is_none());
    }

    #[test]
    fn versions_display() {
        assert_eq!(DriverVersion(13000).to_string(), "13.0");
        assert_eq!(DriverVersion(12090).to_string(), "12.9");
    }

    #[test]
    fn the_range_check_takes_the_end_and_refuses_overflow() {
        assert!(in_bounds(0, 0, 0));
        assert!(in_bounds(4, 4, 8), "a range may end at the end");
        assert!(!in_bounds(5, 4, 8));
        assert!(!in_bounds(u64::MAX, 2, u64::MAX), "offset + len overflows");
        assert!(matches!(
            Error::check_range(6, 4, 8),
            Err(Error::OutOfBounds {
                offset: 6,
                len: 4,
                size: 8
            })
        ));
        assert!(Error::check_range(0, 8, 8).is_ok());
    }
}
