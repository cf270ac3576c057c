//! Where this process runs: which Linux namespaces it shares with the
//! machine's init process, whether it looks like a container, and whether
//! `pidfd_getfd` is allowed here.
//!
//! This decides what works for sharing across containers. File-descriptor
//! mechanisms (vmm, pool) opened from a bare [`Descriptor`](crate::Descriptor)
//! fetch the exporter's descriptor with `pidfd_getfd`, which needs the
//! exporter's pid to be visible (the same or an ancestor PID namespace) and
//! the syscall to be allowed (seccomp profiles of container runtimes often
//! refuse it). The channel carries the descriptors itself and needs neither.
//! Interprocess events need a shared `/dev/shm`.
//!
//! Nothing here needs a GPU or privileges; what cannot be read (another
//! process's namespaces without ptrace rights) is reported as unknown.
//!
//! # References
//! [namespaces(7)](https://man7.org/linux/man-pages/man7/namespaces.7.html),
//! [pid_namespaces(7)](https://man7.org/linux/man-pages/man7/pid_namespaces.7.html),
//! [pidfd_getfd(2)](https://man7.org/linux/man-pages/man2/pidfd_getfd.2.html).

use std::path::Path;

use serde::Serialize;

/// The namespace kinds under `/proc/self/ns`, in the order they are reported.
pub(crate) const NAMESPACE_KINDS: [&str; 8] =
    ["cgroup", "ipc", "mnt", "net", "pid", "time", "user", "uts"];

/// The inode numbers the kernel gives its initial namespaces (fixed since
/// Linux 3.8: `PROC_*_INIT_INO` in `include/linux/proc_ns.h`); mount and
/// network namespaces have none.
fn initial_inode(kind: &str) -> Option<u64> {
    match kind {
        "ipc" => Some(0xEFFF_FFFF),
        "uts" => Some(0xEFFF_FFFE),
        "user" => Some(0xEFFF_FFFD),
        "pid" => Some(0xEFFF_FFFC),
        "cgroup" => Some(0xEFFF_FFFB),
        "time" => Some(0xEFFF_FFFA),
        _ => None,
    }
}

/// The inode number in a namespace link's target, such as `pid:[4026531836]`
/// for `kind` "pid"; `None` if the text is not of that form.
#[must_use]
pub(crate) fn parse_namespace_link(kind: &str, target: &str) -> Option<u64> {
    let rest = target.strip_prefix(kind)?.strip_prefix(":[")?;
    rest.strip_suffix(']')?.parse().ok()
}

/// One namespace of this process, compared with the initial one.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct NamespaceState {
    /// The kind, as under `/proc/self/ns` ("pid", "mnt", ...).
    pub kind: &'static str,
    /// Its inode number, if `/proc/self/ns/<kind>` could be read.
    pub inode: Option<u64>,
    /// Whether it differs from the machine's initial namespace of that
    /// kind; `None` when that cannot be told from here.
    pub differs: Option<bool>,
}

/// Whether a namespace of `kind` with inode `own` differs from the
/// machine's initial one. `init_pid1` is the inode of the same kind of
/// `/proc/1/ns`, if readable; it stands for the machine's init only when our
/// PID namespace is the initial one (`pid_ns_initial`), since inside a new
/// PID namespace `/proc/1` is that namespace's first process.
#[must_use]
pub(crate) fn namespace_differs(
    kind: &str,
    own: Option<u64>,
    init_pid1: Option<u64>,
    pid_ns_initial: Option<bool>,
) -> Option<bool> {
    let own = own?;
    if let Some(initial) = initial_inode(kind) {
        return Some(own != initial);
    }
    match (init_pid1, pid_ns_initial) {
        (Some(init), Some(true)) => Some(own != init),
        _ => None,
    }
}

/// Hints that this process runs in a container, as read from the system.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ContainerHints {
    /// `/.dockerenv` exists (Docker).
    pub dockerenv: bool,
    /// `/run/.containerenv` exists (Podman, CRI-O).
    pub containerenv: bool,
    /// The text of `/proc/1/cgroup` (or `/proc/self/cgroup`), if readable.
    pub cgroup: Option<String>,
    /// The name of PID 1 (`/proc/1/comm`), if readable.
    pub pid1_comm: Option<String>,
    /// Whether our PID namespace is the initial one, if known.
    pub pid_ns_initial: Option<bool>,
}

impl ContainerHints {
    /// Reads the hints from this system.
    #[must_use]
    pub fn read() -> ContainerHints {
        let read = |p: &str| std::fs::read_to_string(p).ok();
        let pid_ns = std::fs::read_link("/proc/self/ns/pid")
            .ok()
            .and_then(|t| parse_namespace_link("pid", &t.to_string_lossy()));
        ContainerHints {
            dockerenv: Path::new("/.dockerenv").exists(),
            containerenv: Path::new("/run/.containerenv").exists(),
            cgroup: read("/proc/1/cgroup").or_else(|| read("/proc/self/cgroup")),
            pid1_comm: read("/proc/1/comm").map(|s| s.trim().to_owned()),
            pid_ns_initial: namespace_differs("pid", pid_ns, None, None).map(|d| !d),
        }
    }

    /// Why this looks like a container: one reason per hint that says so;
    /// empty when nothing does.
    #[must_use]
    pub fn reasons(&self) -> Vec<String> {
        let mut why = Vec::new();
        if self.dockerenv {
            why.push("/.dockerenv exists (Docker)".to_owned());
        }
        if self.containerenv {
            why.push("/run/.containerenv exists (Podman or CRI-O)".to_owned());
        }
        if let Some(cgroup) = &self.cgroup {
            for hint in ["docker", "kubepods", "containerd", "libpod", "lxc", "crio"] {
                if cgroup.contains(hint) {
                    why.push(format!("the cgroup path names {hint}"));
                    break;
                }
            }
        }
        if self.pid_ns_initial == Some(false) {
            why.push("this process runs in a PID namespace of its own".to_owned());
        }
        if let Some(comm) = &self.pid1_comm
            && !matches!(comm.as_str(), "systemd" | "init" | "openrc-init" | "runit")
        {
            why.push(format!("PID 1 is {comm:?}, not an init system"));
        }
        why
    }
}

/// Whether this process may take a descriptor from a process with
/// `pidfd_getfd`, tried on itself: `Ok(())`, or why not (the kernel lacks
/// it, or a seccomp profile refuses it). Taking one from *another* process
/// needs, in addition, its pid to be visible and ptrace rights over it.
#[doc(alias = "pidfd_getfd")]
pub fn pidfd_getfd_allowed() -> Result<(), String> {
    use rustix::process::{PidfdFlags, PidfdGetfdFlags, getpid, pidfd_getfd, pidfd_open};
    let pidfd = pidfd_open(getpid(), PidfdFlags::empty())
        .map_err(|e| format!("pidfd_open on this process failed: {e}"))?;
    let own = std::os::fd::AsRawFd::as_raw_fd(&pidfd);
    pidfd_getfd(&pidfd, own, PidfdGetfdFlags::empty())
        .map(drop)
        .map_err(|e| match e {
            rustix::io::Errno::NOSYS => {
                "this kernel has no pidfd_getfd (Linux 5.6+ needed)".to_owned()
            }
            rustix::io::Errno::PERM | rustix::io::Errno::ACCESS => format!(
                "pidfd_getfd is refused even on this process ({e}): a seccomp profile \
                 (a container runtime's default) forbids it"
            ),
            e => format!("pidfd_getfd on this process failed: {e}"),
        })
}

/// This process's namespaces compared with the machine's initial ones, in
/// the order of their names: cgroup, ipc, mnt, net, pid, time, user, uts.
#[must_use]
pub fn namespaces() -> Vec<NamespaceState> {
    let link = |who: &str, kind: &str| {
        std::fs::read_link(format!("/proc/{who}/ns/{kind}"))
            .ok()
            .and_then(|t| parse_namespace_link(kind, &t.to_string_lossy()))
    };
    let own_pid = link("self", "pid");
    let pid_ns_initial = namespace_differs("pid", own_pid, None, None).map(|d| !d);
    NAMESPACE_KINDS
        .iter()
        .map(|&kind| {
            let inode = link("self", kind);
            NamespaceState {
                kind,
                inode,
                differs: namespace_differs(kind, inode, link("1", kind), pid_ns_initial),
            }
        })
        .collect()
}

/// Whether this process runs in a PID namespace other than the machine's
/// initial one (`None` if `/proc/self/ns/pid` cannot be read). There, the
/// pid of a process in the parent namespace or in another container is not
/// visible.
#[must_use]
pub(crate) fn in_nested_pid_namespace() -> Option<bool> {
    let own = std::fs::read_link("/proc/self/ns/pid")
        .ok()
        .and_then(|t| parse_namespace_link("pid", &t.to_string_lossy()));
    namespace_differs("pid", own, None, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_links_parse_strictly() {
        assert_eq!(
            parse_namespace_link("pid", "pid:[4026531836]"),
            Some(4_026_531_836)
        );
        assert_eq!(
            parse_namespace_link("mnt", "mnt:[4026532301]"),
            Some(4_026_532_301)
        );
        for bad in [
            "pid:[]",
            "pid:[x]",
            "net:[1]",
            "pid:4026531836",
            "pid:[1",
            "pid:[-1]",
            "",
        ] {
            assert_eq!(parse_namespace_link("pid", bad), None, "{bad}");
        }
    }

    #[test]
    fn the_initial_inodes_decide_where_the_kernel_fixes_them() {
        // pid: the kernel's constant decides, whatever /proc/1 says.
        assert_eq!(
            namespace_differs("pid", Some(0xEFFF_FFFC), Some(7), Some(true)),
            Some(false)
        );
        assert_eq!(
            namespace_differs("pid", Some(4_026_532_500), None, None),
            Some(true)
        );
        assert_eq!(
            namespace_differs("user", Some(0xEFFF_FFFD), None, None),
            Some(false)
        );
        assert_eq!(
            namespace_differs("ipc", Some(0xEFFF_FFFF), None, None),
            Some(false)
        );
        assert_eq!(namespace_differs("ipc", None, Some(1), Some(true)), None);
    }

    #[test]
    fn mount_and_network_compare_with_init_only_from_the_initial_pid_namespace() {
        assert_eq!(
            namespace_differs("mnt", Some(5), Some(5), Some(true)),
            Some(false)
        );
        assert_eq!(
            namespace_differs("net", Some(5), Some(6), Some(true)),
            Some(true)
        );
        // Inside a new PID namespace, /proc/1 is not the machine's init.
        assert_eq!(
            namespace_differs("mnt", Some(5), Some(6), Some(false)),
            None
        );
        // /proc/1/ns unreadable (no ptrace rights over PID 1).
        assert_eq!(namespace_differs("net", Some(5), None, Some(true)), None);
    }

    #[test]
    fn container_hints_give_reasons() {
        let host = ContainerHints {
            cgroup: Some("0::/init.scope\n".into()),
            pid1_comm: Some("systemd".into()),
            pid_ns_initial: Some(true),
            ..ContainerHints::default()
        };
        assert!(host.reasons().is_empty(), "{:?}", host.reasons());
        let docker = ContainerHints {
            dockerenv: true,
            cgroup: Some("0::/system.slice/docker-3f2a.scope\n".into()),
            pid1_comm: Some("python3".into()),
            pid_ns_initial: Some(false),
            ..ContainerHints::default()
        };
        let why = docker.reasons();
        assert_eq!(why.len(), 4, "{why:?}");
        assert!(why[0].contains("/.dockerenv"));
        assert!(why[1].contains("docker"));
        assert!(why[3].contains("python3"));
        let k8s = ContainerHints {
            cgroup: Some("12:pids:/kubepods/besteffort/pod1/abc\n".into()),
            ..ContainerHints::default()
        };
        assert_eq!(
            k8s.reasons(),
            vec!["the cgroup path names kubepods".to_owned()]
        );
        let podman = ContainerHints {
            containerenv: true,
            ..ContainerHints::default()
        };
        assert_eq!(podman.reasons().len(), 1);
    }

    #[test]
    fn this_process_reads_its_namespaces() {
        let ns = namespaces();
        assert_eq!(ns.len(), NAMESPACE_KINDS.len());
        let pid = ns.iter().find(|n| n.kind == "pid").unwrap();
        assert!(pid.inode.is_some(), "{pid:?}");
        assert_eq!(pid.differs, in_nested_pid_namespace());
    }

    #[test]
    fn pidfd_getfd_on_ourselves_answers() {
        // Allowed or refused with a reason; never a panic.
        if let Err(why) = pidfd_getfd_allowed() {
            assert!(!why.is_empty());
        }
    }
}
