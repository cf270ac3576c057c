//! How this machine's processors idle, which decides what waking a
//! sleeping consumer costs.
//!
//! A consumer that waits asleep (in `poll(2)` on its wake-up socket) leaves its
//! processor idle; the notice that wakes it pays for that processor to
//! leave its idle state. On bare metal that is the exit latency of the
//! deepest idle state the cpuidle driver may enter (listed by the kernel
//! under `/sys/devices/system/cpu/cpu*/cpuidle`), and a CPU latency
//! request (`/dev/cpu_dma_latency`, root) keeps processors out of the deep
//! ones. In a virtual machine without a cpuidle driver an idle processor
//! executes `HLT`, which hands it back to the hypervisor: the wake-up is
//! then the host's to schedule, no latency request inside the guest
//! changes it (with no driver the kernel has no other idle state to
//! choose), and only a consumer that does not sleep (one that spins:
//! `SubscriberConfig::with_spin`) avoids it. The `haltpoll` driver of KVM guests
//! polls for a while before halting.
//!
//! On the H200 machines the bench has run on, the processors are a KVM
//! guest's with no cpuidle driver: the wake-up after 1 ms idle differed
//! several times between machines of one kind, and holding a CPU latency
//! request of 0 µs changed nothing.
//!
//! [`IdleStates::read`] reads all of it without privileges; nothing here
//! changes a setting.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// One idle state of processor 0, as its cpuidle driver lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdleState {
    /// The driver's name for it (`C1`, `C6`, `POLL`, ...).
    pub name: String,
    /// Its exit latency, µs.
    pub exit_latency_us: u64,
    /// Whether it is disabled (the kernel never enters it).
    pub disabled: bool,
}

/// What this machine's processors do when idle.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct IdleStates {
    /// Whether the processor says it runs under a hypervisor (the
    /// `hypervisor` flag of `/proc/cpuinfo`); `None` when unreadable.
    pub virtualised: Option<bool>,
    /// The cpuidle driver (`intel_idle`, `acpi_idle`, `haltpoll`, or
    /// `none`); `None` when the kernel does not say.
    pub driver: Option<String>,
    /// Processor 0's idle states, shallowest first (none without a driver).
    pub states: Vec<IdleState>,
    /// With the `haltpoll` driver: how long an idle processor polls before
    /// it halts, ns.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub halt_poll_ns: Option<u64>,
}

impl IdleStates {
    /// This machine's, from `/proc` and `/sys`.
    pub fn read() -> IdleStates {
        IdleStates::read_from(Path::new("/"))
    }

    /// As [`read`](Self::read), with `/proc` and `/sys` under `root`.
    pub fn read_from(root: &Path) -> IdleStates {
        let text = |p: &str| {
            std::fs::read_to_string(root.join(p))
                .ok()
                .map(|s| s.trim().to_owned())
        };
        let virtualised = text("proc/cpuinfo").map(|info| {
            info.lines()
                .filter(|l| l.starts_with("flags"))
                .any(|l| l.split_whitespace().any(|f| f == "hypervisor"))
        });
        let driver =
            text("sys/devices/system/cpu/cpuidle/current_driver").filter(|s| !s.is_empty());
        let mut states = Vec::new();
        for i in 0.. {
            let dir = format!("sys/devices/system/cpu/cpu0/cpuidle/state{i}");
            let (Some(name), Some(latency)) = (
                text(&format!("{dir}/name")),
                text(&format!("{dir}/latency")),
            ) else {
                break;
            };
            let Ok(exit_latency_us) = latency.parse() else {
                break;
            };
            states.push(IdleState {
                name,
                exit_latency_us,
                disabled: text(&format!("{dir}/disable")).as_deref() == Some("1"),
            });
        }
        let halt_poll_ns = (driver.as_deref() == Some("haltpoll"))
            .then(|| {
                text("sys/module/haltpoll/parameters/guest_halt_poll_ns")?
                    .parse()
                    .ok()
            })
            .flatten();
        IdleStates {
            virtualised,
            driver,
            states,
            halt_poll_ns,
        }
    }

    /// The deepest state the kernel may enter: the one with the longest
    /// exit latency that is not disabled.
    pub fn deepest(&self) -> Option<&IdleState> {
        self.states
            .iter()
            .filter(|s| !s.disabled)
            .max_by_key(|s| s.exit_latency_us)
    }

    /// What they are, and what they mean for a consumer that waits asleep,
    /// in one line.
    pub fn describe(&self) -> String {
        let vm = self.virtualised == Some(true);
        let spin = "a consumer that spins instead of sleeping (its config's spin, \
                    SubscriberConfig::with_spin) avoids it, at a processor's cost while it waits";
        match self.driver.as_deref() {
            None | Some("none") if vm => format!(
                "a virtual machine without a cpuidle driver: an idle processor halts to the \
                 hypervisor, so waking a sleeping consumer is the host's to schedule; a CPU \
                 latency request (/dev/cpu_dma_latency) cannot shorten it here; {spin}"
            ),
            None | Some("none") => format!(
                "no cpuidle driver: an idle processor halts, and waking a sleeping consumer \
                 costs the halt's exit; {spin}"
            ),
            Some("haltpoll") => match self.halt_poll_ns {
                Some(0) => format!(
                    "a KVM guest's haltpoll driver with its poll off (guest_halt_poll_ns 0): an \
                     idle processor halts to the hypervisor at once, so waking a sleeping \
                     consumer is the host's to schedule; {spin}"
                ),
                poll => format!(
                    "a KVM guest's haltpoll driver: an idle processor polls for up to {} before \
                     it halts to the hypervisor; a consumer woken within that pays no halt, \
                     later ones the host's scheduling; {spin}",
                    poll.map_or_else(
                        || "a while".into(),
                        |ns| {
                            if ns >= 1000 {
                                format!("{} us", ns / 1000)
                            } else {
                                format!("{ns} ns")
                            }
                        }
                    )
                ),
            },
            Some(driver) => match self.deepest() {
                Some(deep) => format!(
                    "cpuidle driver {driver}, states {}: a sleeping consumer's processor may \
                     need up to {} us to leave {}; a CPU latency request (/dev/cpu_dma_latency, \
                     root) keeps processors out of deep states; {spin}",
                    self.states
                        .iter()
                        .map(|s| format!(
                            "{} {} us{}",
                            s.name,
                            s.exit_latency_us,
                            if s.disabled { " (disabled)" } else { "" }
                        ))
                        .collect::<Vec<_>>()
                        .join(", "),
                    deep.exit_latency_us,
                    deep.name
                ),
                None => format!("cpuidle driver {driver}, no idle state listed for processor 0"),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake `/proc` and `/sys` holding `files` (path, contents).
    fn root(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("a temporary folder");
        for (path, contents) in files {
            let p = dir.path().join(path);
            std::fs::create_dir_all(p.parent().expect("a parent")).expect("its folder");
            std::fs::write(p, contents).expect("the file");
        }
        dir
    }

    const GUEST_CPUINFO: &str = "processor\t: 0\nflags\t\t: fpu vme sse2 hypervisor avx\n";
    const METAL_CPUINFO: &str = "processor\t: 0\nflags\t\t: fpu vme sse2 avx\n";

    #[test]
    fn a_guest_without_a_driver_is_said_to_halt_to_the_hypervisor() {
        let r = root(&[
            ("proc/cpuinfo", GUEST_CPUINFO),
            ("sys/devices/system/cpu/cpuidle/current_driver", "none\n"),
            (
                "sys/module/haltpoll/parameters/guest_halt_poll_ns",
                "200000\n",
            ),
        ]);
        let idle = IdleStates::read_from(r.path());
        assert_eq!(idle.virtualised, Some(true));
        assert_eq!(idle.driver.as_deref(), Some("none"));
        assert!(idle.states.is_empty());
        // The module's parameter is not in effect without its driver.
        assert_eq!(idle.halt_poll_ns, None);
        let text = idle.describe();
        assert!(
            text.contains("virtual machine without a cpuidle driver"),
            "{text}"
        );
        assert!(text.contains("cannot shorten it"), "{text}");
        assert!(text.contains("SubscriberConfig::with_spin"), "{text}");
    }

    #[test]
    fn bare_metal_states_name_the_deepest_enabled_one() {
        let mut files = vec![
            ("proc/cpuinfo", METAL_CPUINFO),
            (
                "sys/devices/system/cpu/cpuidle/current_driver",
                "intel_idle\n",
            ),
        ];
        let states = [
            ("POLL", "0", "0"),
            ("C1", "2", "0"),
            ("C6", "170", "1"),
            ("C1E", "10", "0"),
        ];
        let paths: Vec<[String; 3]> = (0..states.len())
            .map(|i| {
                let d = format!("sys/devices/system/cpu/cpu0/cpuidle/state{i}");
                [
                    format!("{d}/name"),
                    format!("{d}/latency"),
                    format!("{d}/disable"),
                ]
            })
            .collect();
        for (p, (name, latency, disable)) in paths.iter().zip(states) {
            files.push((&p[0], name));
            files.push((&p[1], latency));
            files.push((&p[2], disable));
        }
        let r = root(&files);
        let idle = IdleStates::read_from(r.path());
        assert_eq!(idle.virtualised, Some(false));
        assert_eq!(idle.states.len(), 4);
        assert!(idle.states[2].disabled);
        // C6 is disabled: the deepest the kernel may enter is C1E.
        assert_eq!(idle.deepest().map(|s| s.name.as_str()), Some("C1E"));
        let text = idle.describe();
        assert!(text.contains("cpuidle driver intel_idle"), "{text}");
        assert!(text.contains("C6 170 us (disabled)"), "{text}");
        assert!(text.contains("up to 10 us to leave C1E"), "{text}");
        assert!(text.contains("/dev/cpu_dma_latency"), "{text}");
    }

    #[test]
    fn haltpoll_says_how_long_it_polls() {
        let r = root(&[
            ("proc/cpuinfo", GUEST_CPUINFO),
            ("sys/devices/system/cpu/cpuidle/current_driver", "haltpoll"),
            (
                "sys/module/haltpoll/parameters/guest_halt_poll_ns",
                "200000",
            ),
            ("sys/devices/system/cpu/cpu0/cpuidle/state0/name", "POLL"),
            ("sys/devices/system/cpu/cpu0/cpuidle/state0/latency", "0"),
            (
                "sys/devices/system/cpu/cpu0/cpuidle/state1/name",
                "haltpoll",
            ),
            ("sys/devices/system/cpu/cpu0/cpuidle/state1/latency", "1"),
        ]);
        let idle = IdleStates::read_from(r.path());
        assert_eq!(idle.halt_poll_ns, Some(200_000));
        assert_eq!(idle.states.len(), 2);
        let text = idle.describe();
        assert!(text.contains("polls for up to 200 us"), "{text}");
    }

    #[test]
    fn haltpoll_with_its_poll_off_halts_at_once() {
        let r = root(&[
            ("proc/cpuinfo", GUEST_CPUINFO),
            ("sys/devices/system/cpu/cpuidle/current_driver", "haltpoll"),
            ("sys/module/haltpoll/parameters/guest_halt_poll_ns", "0"),
        ]);
        let text = IdleStates::read_from(r.path()).describe();
        assert!(text.contains("poll off (guest_halt_poll_ns 0)"), "{text}");
        assert!(text.contains("at once"), "{text}");
    }

    #[test]
    fn nothing_readable_reads_as_unknown_and_still_describes() {
        let r = root(&[]);
        let idle = IdleStates::read_from(r.path());
        assert_eq!(idle, IdleStates::default());
        let text = idle.describe();
        assert!(text.starts_with("no cpuidle driver"), "{text}");
    }

    #[test]
    fn a_state_with_an_unreadable_latency_ends_the_list() {
        let r = root(&[
            ("sys/devices/system/cpu/cpuidle/current_driver", "acpi_idle"),
            ("sys/devices/system/cpu/cpu0/cpuidle/state0/name", "C1"),
            ("sys/devices/system/cpu/cpu0/cpuidle/state0/latency", "1"),
            ("sys/devices/system/cpu/cpu0/cpuidle/state1/name", "C2"),
            ("sys/devices/system/cpu/cpu0/cpuidle/state1/latency", "lots"),
        ]);
        let idle = IdleStates::read_from(r.path());
        assert_eq!(idle.states.len(), 1);
        assert_eq!(idle.virtualised, None);
        let text = idle.describe();
        assert!(text.contains("up to 1 us to leave C1"), "{text}");
    }

    #[test]
    fn it_travels_in_json_and_back() {
        let idle = IdleStates {
            virtualised: Some(true),
            driver: Some("haltpoll".into()),
            states: vec![IdleState {
                name: "POLL".into(),
                exit_latency_us: 0,
                disabled: false,
            }],
            halt_poll_ns: Some(200_000),
        };
        let text = serde_json::to_string(&idle).expect("JSON");
        let back: IdleStates = serde_json::from_str(&text).expect("back");
        assert_eq!(back, idle);
    }
}
