//! How two GPUs are connected: NVLink, PCIe (and how far apart in the PCIe
//! tree), or no peer-to-peer path at all. The CUDA driver only says whether
//! peer access works and ranks the link; NVML (libnvidia-ml.so.1, loaded at
//! run time, never linked) says what the link is, as `nvidia-smi topo -m`
//! does.

use std::fmt;

use cuda_ipc::device::DeviceUuid;
use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::{P2pCapabilitiesIndex, P2pStatus, TopologyLevel};
use serde::Serialize;

/// NVML's shared library as the driver installs it (the unversioned
/// `libnvidia-ml.so` is only in development packages).
const NVML_LIBRARY: &str = "libnvidia-ml.so.1";

/// The most NVLinks a GPU has (NVML_NVLINK_MAX_LINKS).
const MAX_NVLINKS: u32 = 18;

/// The path between two GPUs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Link {
    /// Peer-to-peer over NVLink (directly or through NVSwitches).
    Nvlink {
        /// Active NVLinks on the first GPU, where NVML reports them.
        active_links: Option<u32>,
    },
    /// Peer-to-peer over PCIe.
    Pcie {
        /// The closest common ancestor in the PCIe tree, in words.
        path: String,
    },
    /// NVML says the two GPUs cannot reach each other directly.
    NoPeerToPeer {
        /// NVML's reason.
        why: String,
    },
    /// NVML could not say (not installed, or a query failed).
    Unknown {
        /// Why.
        why: String,
    },
}

impl fmt::Display for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Link::Nvlink {
                active_links: Some(n),
            } => write!(f, "NVLink ({n} active links)"),
            Link::Nvlink { active_links: None } => write!(f, "NVLink"),
            Link::Pcie { path } => write!(f, "PCIe ({path})"),
            Link::NoPeerToPeer { why } => write!(f, "no peer-to-peer path ({why})"),
            Link::Unknown { why } => write!(f, "unknown ({why})"),
        }
    }
}

/// The PCIe distance in `nvidia-smi topo -m`'s terms.
fn pcie_path(level: TopologyLevel) -> &'static str {
    match level {
        TopologyLevel::Internal => "on one board",
        TopologyLevel::Single => "PIX: through one PCIe switch",
        TopologyLevel::Multiple => "PXB: through several PCIe switches",
        TopologyLevel::HostBridge => "PHB: through a PCIe host bridge",
        TopologyLevel::Node => "NODE: across host bridges of one NUMA node",
        TopologyLevel::System => "SYS: across NUMA nodes, over the CPUs' interconnect",
    }
}

fn status_words(s: P2pStatus) -> &'static str {
    match s {
        P2pStatus::Ok => "supported",
        P2pStatus::ChipsetNotSupported => "the chipset does not support it",
        P2pStatus::GpuNotSupported => "the GPU does not support it",
        P2pStatus::IohTopologyNotSupported => "the I/O hub topology does not support it",
        P2pStatus::DisabledByRegkey => "disabled by a driver registry key",
        P2pStatus::NotSupported => "not supported",
        P2pStatus::Unknown => "unknown status",
    }
}

/// Decides the link from NVML's answers: peer-to-peer over NVLink, over
/// PCIe reads, the number of active NVLinks and the PCIe distance.
pub fn classify(
    nvlink: &Result<P2pStatus, String>,
    read: &Result<P2pStatus, String>,
    active_links: Option<u32>,
    level: Option<TopologyLevel>,
) -> Link {
    match (nvlink, read) {
        (Ok(P2pStatus::Ok), _) => Link::Nvlink {
            active_links: active_links.filter(|n| *n > 0),
        },
        (_, Ok(P2pStatus::Ok)) => Link::Pcie {
            path: level.map_or("distance unknown", pcie_path).to_string(),
        },
        (_, Ok(other)) => Link::NoPeerToPeer {
            why: format!("NVML: peer-to-peer reads {}", status_words(*other)),
        },
        (_, Err(e)) => Link::Unknown {
            why: format!("NVML's peer-to-peer status: {e}"),
        },
    }
}

/// NVML, loaded once for several queries.
pub struct Topology {
    nvml: Nvml,
}

impl Topology {
    /// Loads NVML; the error says why it could not (for [`Link::Unknown`]).
    pub fn open() -> Result<Topology, String> {
        Nvml::builder()
            .lib_path(NVML_LIBRARY.as_ref())
            .init()
            .map(|nvml| Topology { nvml })
            .map_err(|e| format!("NVML ({NVML_LIBRARY}) did not load: {e}"))
    }

    /// The link from GPU `a` to GPU `b`, named by UUID (NVML's device order
    /// need not be CUDA's).
    pub fn between(&self, a: DeviceUuid, b: DeviceUuid) -> Link {
        let get = |u: DeviceUuid| {
            self.nvml
                .device_by_uuid(u.to_string())
                .map_err(|e| format!("NVML does not know {u}: {e}"))
        };
        let (da, db) = match (get(a), get(b)) {
            (Ok(x), Ok(y)) => (x, y),
            (Err(why), _) | (_, Err(why)) => return Link::Unknown { why },
        };
        let status = |index| da.p2p_status(&db, index).map_err(|e| e.to_string());
        let nvlink = status(P2pCapabilitiesIndex::NvLink);
        let read = status(P2pCapabilitiesIndex::Read);
        let mut active = 0;
        for i in 0..MAX_NVLINKS {
            match da.link_wrapper_for(i).is_active() {
                Ok(true) => active += 1,
                Ok(false) => {}
                Err(_) => break,
            }
        }
        let level = self
            .nvml
            .device_by_uuid(b.to_string())
            .and_then(|db| da.topology_common_ancestor(db))
            .ok();
        classify(&nvlink, &read, Some(active), level)
    }
}

/// The link between two GPUs, or why it is unknown.
pub fn between(a: DeviceUuid, b: DeviceUuid) -> Link {
    match Topology::open() {
        Ok(t) => t.between(a, b),
        Err(why) => Link::Unknown { why },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvlink_wins_and_counts_links() {
        let l = classify(&Ok(P2pStatus::Ok), &Ok(P2pStatus::Ok), Some(18), None);
        assert_eq!(
            l,
            Link::Nvlink {
                active_links: Some(18)
            }
        );
        assert_eq!(l.to_string(), "NVLink (18 active links)");
        // NVLink through NVSwitches may report no per-GPU link state.
        let l = classify(&Ok(P2pStatus::Ok), &Err("x".into()), Some(0), None);
        assert_eq!(l.to_string(), "NVLink");
    }

    #[test]
    fn pcie_says_how_far() {
        let l = classify(
            &Ok(P2pStatus::NotSupported),
            &Ok(P2pStatus::Ok),
            Some(0),
            Some(TopologyLevel::Single),
        );
        assert_eq!(l.to_string(), "PCIe (PIX: through one PCIe switch)");
        let l = classify(&Err("not supported".into()), &Ok(P2pStatus::Ok), None, None);
        assert_eq!(l.to_string(), "PCIe (distance unknown)");
    }

    #[test]
    fn no_path_and_unknown_say_why() {
        let l = classify(
            &Ok(P2pStatus::NotSupported),
            &Ok(P2pStatus::ChipsetNotSupported),
            None,
            Some(TopologyLevel::System),
        );
        assert!(matches!(l, Link::NoPeerToPeer { .. }));
        assert!(l.to_string().contains("chipset"), "{l}");
        let l = classify(&Err("a".into()), &Err("NVML not loaded".into()), None, None);
        assert!(l.to_string().starts_with("unknown ("), "{l}");
        assert!(l.to_string().contains("NVML not loaded"), "{l}");
    }

    #[test]
    fn json_names_the_kind() {
        let v = serde_json::to_value(Link::Nvlink {
            active_links: Some(18),
        })
        .unwrap();
        assert_eq!(v, serde_json::json!({"kind": "nvlink", "active_links": 18}));
        let v = serde_json::to_value(Link::Pcie { path: "p".into() }).unwrap();
        assert_eq!(v["kind"], "pcie");
    }

    /// Without a GPU (CI), NVML is either missing or finds no such device:
    /// either way the answer is "unknown" with a reason, never a panic.
    #[test]
    fn unknown_devices_are_unknown() {
        let a = DeviceUuid([1; 16]);
        let b = DeviceUuid([2; 16]);
        match between(a, b) {
            Link::Unknown { why } => assert!(!why.is_empty()),
            other => panic!("{other:?}"),
        }
    }
}
