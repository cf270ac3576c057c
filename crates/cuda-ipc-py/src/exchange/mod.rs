//! The exchange channel from Python: `Publisher` (publish, update,
//! unpublish, rings) and `Subscriber` (attach, wait for an update, release,
//! ring frames), over `cuda_ipc::exchange`.
//!
//! The bindings of arenas and sets (`Publisher.arena_alloc`,
//! `publish_set`, `Subscriber.attach_set`, ...) are in `sets.rs`; the
//! methods here only hand over to it.
//!
//! Synchronisation with the frameworks: Python code writes with PyTorch or
//! CuPy on their own streams, which the library does not know. Before a
//! publish or an update the context is synchronised (every stream of it),
//! so the event the library records covers those writes; after an attach
//! or an update is received, the host waits for the publisher's event, so
//! any stream may read at once.
//!
//! The classes are one file each here: `publisher`, `subscriber`, the
//! subscriber's `attachment`, and `rings`.

mod attachment;
mod publisher;
mod rings;
mod subscriber;

use pyo3::prelude::*;

use crate::peers::{PyPublisher, PySubscriber};
use attachment::Attachment;
use publisher::{Allocation, Published};
use rings::{PyRingPublisher, Ring, RingFrameView};

/// Registers this module's classes.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPublisher>()?;
    m.add_class::<PySubscriber>()?;
    m.add_class::<PyRingPublisher>()?;
    m.add_class::<Allocation>()?;
    m.add_class::<Published>()?;
    m.add_class::<Attachment>()?;
    m.add_class::<Ring>()?;
    m.add_class::<RingFrameView>()?;
    Ok(())
}
