//! What a bench run found: the model (sections of rows with raw samples
//! and summaries, and the JSON document), the targets checked against
//! them, and the text table. Pure data and formatting; no GPU.

mod format;
mod model;
mod render;
pub mod targets;
#[cfg(test)]
pub(crate) mod tests;
#[cfg(test)]
mod tests_mps;
#[cfg(test)]
mod tests_python;
#[cfg(test)]
mod tests_sections;

pub use format::human;
pub use model::{DeviceInfo, MpsPass, PeerInfo, Report, Row, Section, SectionId, Status};
pub use render::render;
pub use targets::{SPIN_IDLE_US, WAKE_IDLE_US, WAKE_ROWS, WAKE_SERIES};
