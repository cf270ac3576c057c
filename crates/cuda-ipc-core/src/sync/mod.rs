//! The ordering layer: interprocess events, and the reaper that finishes
//! what a drop retired once the GPU work on it is done.
//!
//! - [`event`]: [`IpcEvent`](event::IpcEvent), an event shared between
//!   processes, with which one process orders its stream after another's.
//! - [`reaper`]: deferred destruction; a drop records events and hands the
//!   unmap, the free or the lease release to the reaper, which runs it once
//!   those events complete.
//!
//! This folder imports the driver layer, [`device`](crate::device),
//! [`handle`](crate::handle) and [`error`](crate::error), never the memory
//! types: [`memory`](crate::memory) hands its drops to the reaper, and
//! [`share`](crate::share) opens a descriptor's event, so both sit above.
//!
//! The fences (the [`fence`](crate::fence) module) order work too, but stay
//! out of this folder: their words are shared buffers made and opened
//! through [`share`](crate::share) (`SharedBuffer`, `open_mapping`,
//! `fetch_fd`), and `share` waits on events from here, so a folder holding
//! both events and fences would import `share` and be imported by it. The
//! fence sits above `share` instead.
//!
//! Both modules are also reachable at the crate root, as
//! `cuda_ipc::event` and `cuda_ipc::reaper`.

pub mod event;
pub mod reaper;
