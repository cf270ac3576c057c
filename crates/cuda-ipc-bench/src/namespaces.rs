//! Consumer processes in Linux namespaces of their own
//! (`--consumer-namespaces` of `bench` and `demo`), as a container would
//! run them: each consumer is started through util-linux `unshare`.
//!
//! What each name asks for, and the `unshare` options it becomes:
//! - `pid`: a new PID namespace with its own `/proc` (`--pid --fork
//!   --kill-child --mount-proc`). It must get its own `/proc`: the driver
//!   does not start in a new PID namespace that still sees its parent's
//!   (`cuInit` fails with CUDA_ERROR_OPERATING_SYSTEM on driver 580).
//!   `--kill-child` ends the consumer when `unshare` is killed.
//! - `ipc`: a new IPC namespace (`--ipc`).
//! - `mount`: a new mount namespace with the same view of the files
//!   (`--mount`).
//! - `user`: a new user namespace, our user mapped to root in it (`--user
//!   --map-root-user`).
//! - `shm`: a new mount namespace with a private tmpfs over `/dev/shm`
//!   (`--mount` and `sh -c 'mount -t tmpfs tmpfs /dev/shm && exec "$0"
//!   "$@"'`): interprocess events cannot be opened there, so the exchange
//!   synchronises with GPU-side fences.
//!
//! Standard input and output (the pipes the producer talks to its
//! consumers over) pass through `unshare` and `sh` unchanged, and the
//! channel's Unix socket stays reachable: no namespace here changes the
//! files a consumer sees, except `/proc` and `/dev/shm`. Descriptors travel
//! over that socket; fetching one from the producer by pid (`pidfd_getfd`)
//! does not work from a new PID namespace, which is why consumers in one
//! attach over the channel.
//!
//! # References
//! [unshare(1)](https://man7.org/linux/man-pages/man1/unshare.1.html),
//! [namespaces(7)](https://man7.org/linux/man-pages/man7/namespaces.7.html).

use std::ffi::{OsStr, OsString};
use std::process::{Command, Stdio};

use cuda_ipc::Error;

/// The `unshare` program (util-linux), found on `PATH`.
const UNSHARE: &str = "unshare";

/// The shell wrapper of `shm`: mounts a private tmpfs over `/dev/shm`, then
/// becomes the consumer (`$0`, with its arguments).
const SHM_SCRIPT: &str = r#"mount -t tmpfs tmpfs /dev/shm && exec "$0" "$@""#;

/// A namespace a consumer can be given (`--consumer-namespaces`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Namespace {
    /// A new PID namespace with its own `/proc`.
    Pid,
    /// A new IPC namespace.
    Ipc,
    /// A new mount namespace (the same files).
    Mount,
    /// A new user namespace, our user mapped to root.
    User,
    /// A new mount namespace with a private tmpfs over `/dev/shm`.
    Shm,
}

impl Namespace {
    /// Every namespace, in the order they are listed and reported.
    pub const ALL: [Namespace; 5] = [
        Namespace::Pid,
        Namespace::Ipc,
        Namespace::Mount,
        Namespace::User,
        Namespace::Shm,
    ];

    /// The name on the command line and in the bench's JSON.
    pub fn name(self) -> &'static str {
        match self {
            Namespace::Pid => "pid",
            Namespace::Ipc => "ipc",
            Namespace::Mount => "mount",
            Namespace::User => "user",
            Namespace::Shm => "shm",
        }
    }

    /// Parses a namespace name (any case) for clap.
    pub fn parse(s: &str) -> Result<Namespace, String> {
        Namespace::ALL
            .into_iter()
            .find(|n| n.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| {
                format!(
                    "{:?} is not a namespace a consumer can be given; choose from {}",
                    s.trim(),
                    Namespace::ALL.map(Namespace::name).join(", ")
                )
            })
    }
}

impl std::fmt::Display for Namespace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The namespaces every consumer process runs in: none (the producer's
/// own, the default) or a set of [`Namespace`]s, each once.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConsumerNamespaces(Vec<Namespace>);

impl ConsumerNamespaces {
    /// The set `list` names (`--consumer-namespaces` as clap parsed it);
    /// a name given twice is an error naming it.
    pub fn new(list: &[Namespace]) -> Result<ConsumerNamespaces, String> {
        let mut set: Vec<Namespace> = Vec::with_capacity(list.len());
        for n in list {
            if set.contains(n) {
                return Err(format!(
                    "--consumer-namespaces names {n} twice; give each namespace once"
                ));
            }
            set.push(*n);
        }
        set.sort_unstable();
        Ok(ConsumerNamespaces(set))
    }

    /// Whether consumers run in the producer's namespaces.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `n` is one of them.
    pub fn contains(&self, n: Namespace) -> bool {
        self.0.contains(&n)
    }

    /// The names, in the order of [`Namespace::ALL`].
    pub fn names(&self) -> Vec<&'static str> {
        self.0.iter().map(|n| n.name()).collect()
    }

    /// The options of `unshare` that create them (empty for none).
    pub fn unshare_options(&self) -> Vec<&'static str> {
        let mut o = Vec::new();
        // The user namespace first in the list: unshare creates it before
        // the others, which it then owns.
        if self.contains(Namespace::User) {
            o.extend(["--user", "--map-root-user"]);
        }
        if self.contains(Namespace::Pid) {
            o.extend(["--pid", "--fork", "--kill-child", "--mount-proc"]);
        }
        if self.contains(Namespace::Ipc) {
            o.push("--ipc");
        }
        if self.contains(Namespace::Mount) || self.contains(Namespace::Shm) {
            o.push("--mount");
        }
        o
    }

    /// The whole command line that runs `program` in these namespaces,
    /// program first (`program` alone for none); the caller adds
    /// `program`'s arguments after it.
    pub fn argv(&self, program: &OsStr) -> Vec<OsString> {
        self.argv_using(OsStr::new(UNSHARE), program)
    }

    /// [`ConsumerNamespaces::argv`] with `unshare` found at `unshare`.
    fn argv_using(&self, unshare: &OsStr, program: &OsStr) -> Vec<OsString> {
        if self.is_empty() {
            return vec![program.to_owned()];
        }
        let mut v: Vec<OsString> = vec![unshare.to_owned()];
        v.extend(
            self.unshare_options()
                .into_iter()
                .chain(["--"])
                .map(OsString::from),
        );
        if self.contains(Namespace::Shm) {
            v.extend(["sh", "-c", SHM_SCRIPT].map(OsString::from));
        }
        v.push(program.to_owned());
        v
    }

    /// A [`Command`] that runs `program` in these namespaces; add its
    /// arguments, pipes and environment as usual.
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        self.command_using(OsStr::new(UNSHARE), program.as_ref())
    }

    fn command_using(&self, unshare: &OsStr, program: &OsStr) -> Command {
        let argv = self.argv_using(unshare, program);
        let mut c = Command::new(&argv[0]);
        c.args(&argv[1..]);
        c
    }

    /// The command line in words, for headers: "unshare --ipc -- PROGRAM",
    /// or "" for none.
    pub fn shown(&self) -> String {
        if self.is_empty() {
            return String::new();
        }
        self.argv(OsStr::new("CONSUMER"))
            .iter()
            .map(|a| {
                let a = a.to_string_lossy();
                if a.contains(' ') {
                    format!("'{a}'")
                } else {
                    a.into_owned()
                }
            })
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Checks, once, that consumers can be started here: runs `true` the
    /// way a consumer will run. An error of kind `Unavailable` (exit 3)
    /// says why not: `unshare` missing, or refused (creating most
    /// namespaces needs root, or a user namespace).
    pub fn check_allowed(&self) -> Result<(), Error> {
        self.check_using(OsStr::new(UNSHARE))
    }

    /// [`ConsumerNamespaces::check_allowed`] with `unshare` at `unshare`.
    fn check_using(&self, unshare: &OsStr) -> Result<(), Error> {
        if self.is_empty() {
            return Ok(());
        }
        let unavailable = |why: String| Error::Unsupported {
            what: "running consumers in new namespaces (--consumer-namespaces)",
            why,
        };
        let out = self
            .command_using(unshare, OsStr::new("true"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .map_err(|e| {
                unavailable(if e.kind() == std::io::ErrorKind::NotFound {
                    "util-linux `unshare` is not installed (or not on PATH); install util-linux"
                        .into()
                } else {
                    format!("`unshare` cannot be run: {e}")
                })
            })?;
        if out.status.success() {
            return Ok(());
        }
        let said = String::from_utf8_lossy(&out.stderr);
        let said = said.trim();
        Err(unavailable(format!(
            "`{}` failed ({}){}; creating namespaces needs root (or CAP_SYS_ADMIN), or add \
             `user` to create them inside a user namespace of your own where the system \
             allows it",
            self.shown().replace("CONSUMER", "true"),
            out.status,
            if said.is_empty() {
                String::new()
            } else {
                format!(": {said}")
            }
        )))
    }
}

impl std::fmt::Display for ConsumerNamespaces {
    /// "pid, ipc", or "none".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&self.names().join(", "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(names: &str) -> Result<ConsumerNamespaces, String> {
        let list = names
            .split(',')
            .map(Namespace::parse)
            .collect::<Result<Vec<_>, _>>()?;
        ConsumerNamespaces::new(&list)
    }

    fn argv(names: &str) -> Vec<String> {
        set(names)
            .unwrap()
            .argv(OsStr::new("/bin/consumer"))
            .into_iter()
            .map(|a| a.into_string().unwrap())
            .collect()
    }

    #[test]
    fn names_parse_in_any_case_and_unknown_ones_list_the_valid() {
        assert_eq!(Namespace::parse(" PID "), Ok(Namespace::Pid));
        assert_eq!(Namespace::parse("Shm"), Ok(Namespace::Shm));
        for bad in ["net", "", "pid+ipc"] {
            let e = Namespace::parse(bad).unwrap_err();
            assert!(e.contains("choose from pid, ipc, mount, user, shm"), "{e}");
        }
        for n in Namespace::ALL {
            assert_eq!(Namespace::parse(n.name()), Ok(n));
        }
    }

    #[test]
    fn duplicates_are_errors_and_the_order_is_fixed() {
        let e = set("pid,ipc,PID").unwrap_err();
        assert_eq!(
            e,
            "--consumer-namespaces names pid twice; give each namespace once"
        );
        assert_eq!(set("shm,ipc,pid").unwrap().names(), ["pid", "ipc", "shm"]);
        assert_eq!(set("ipc,pid").unwrap(), set("pid,ipc").unwrap());
        assert!(ConsumerNamespaces::default().is_empty());
        assert_eq!(ConsumerNamespaces::default().to_string(), "none");
        assert_eq!(set("user,pid").unwrap().to_string(), "pid, user");
    }

    #[test]
    fn the_command_line_for_each_namespace() {
        let none = ConsumerNamespaces::default().argv(OsStr::new("/bin/consumer"));
        assert_eq!(none, [OsString::from("/bin/consumer")]);
        let pid = ["--pid", "--fork", "--kill-child", "--mount-proc"];
        let with = |opts: &[&str], tail: &[&str]| -> Vec<String> {
            std::iter::once("unshare")
                .chain(opts.iter().copied())
                .chain(["--"])
                .chain(tail.iter().copied())
                .map(str::to_owned)
                .collect()
        };
        assert_eq!(argv("pid"), with(&pid, &["/bin/consumer"]));
        assert_eq!(argv("ipc"), with(&["--ipc"], &["/bin/consumer"]));
        assert_eq!(argv("mount"), with(&["--mount"], &["/bin/consumer"]));
        assert_eq!(
            argv("user"),
            with(&["--user", "--map-root-user"], &["/bin/consumer"])
        );
        let shm_tail = ["sh", "-c", SHM_SCRIPT, "/bin/consumer"];
        assert_eq!(argv("shm"), with(&["--mount"], &shm_tail));
        assert_eq!(
            argv("ipc,pid"),
            with(&[&pid[..], &["--ipc"]].concat(), &["/bin/consumer"])
        );
        // mount and shm share one mount namespace; user comes first
        assert_eq!(
            argv("shm,mount,user,ipc,pid"),
            with(
                &[
                    &["--user", "--map-root-user"][..],
                    &pid,
                    &["--ipc", "--mount"]
                ]
                .concat(),
                &shm_tail
            )
        );
        assert_eq!(
            set("pid,shm").unwrap().shown(),
            "unshare --pid --fork --kill-child --mount-proc --mount -- sh -c \
             'mount -t tmpfs tmpfs /dev/shm && exec \"$0\" \"$@\"' CONSUMER"
        );
        assert_eq!(ConsumerNamespaces::default().shown(), "");
    }

    /// Runs `sh -c SCRIPT` through the wrapper of `names`; `None` (with the
    /// reason printed) where `unshare` is not allowed here.
    fn run_in(names: &str, script: &str) -> Option<std::process::Output> {
        let ns = set(names).unwrap();
        if let Err(e) = ns.check_allowed() {
            println!("skipped {names}: {e}");
            return None;
        }
        let out = ns
            .command("sh")
            .args(["-c", script])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{names}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        Some(out)
    }

    fn link(kind: &str) -> String {
        std::fs::read_link(format!("/proc/self/ns/{kind}"))
            .unwrap()
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn a_consumer_runs_through_the_wrapper_in_new_namespaces() {
        // A file in our /dev/shm that a private one does not have.
        let marker = format!("/dev/shm/cuda-ipc-bench-ns-{}", std::process::id());
        std::fs::write(&marker, "").unwrap();
        let script = format!(
            "readlink /proc/self/ns/pid /proc/self/ns/ipc /proc/self/ns/mnt; echo $$; \
             test -e {marker} && echo shared || echo private"
        );
        let out = run_in("pid,ipc,shm", &script);
        std::fs::remove_file(&marker).unwrap();
        let Some(out) = out else {
            return;
        };
        let text = String::from_utf8_lossy(&out.stdout);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 5, "{text}");
        assert_ne!(lines[0], link("pid"), "{text}");
        assert_ne!(lines[1], link("ipc"), "{text}");
        assert_ne!(lines[2], link("mnt"), "{text}");
        // the first process of its PID namespace, with /proc of its own
        assert_eq!(lines[3], "1", "{text}");
        assert_eq!(lines[4], "private", "{text}");
    }

    #[test]
    fn pipes_pass_through_the_wrapper() {
        use std::io::Write;
        let ns = set("pid,ipc").unwrap();
        if let Err(e) = ns.check_allowed() {
            println!("skipped: {e}");
            return;
        }
        let mut child = ns
            .command("sh")
            .args(["-c", "read line; echo \"got $line\""])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(b"{\"op\": \"ping\"}\n")
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success());
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "got {\"op\": \"ping\"}\n"
        );
    }

    #[test]
    fn user_and_mount_namespaces() {
        let Some(out) = run_in(
            "user,mount",
            "id -u; readlink /proc/self/ns/user /proc/self/ns/mnt",
        ) else {
            return;
        };
        let text = String::from_utf8_lossy(&out.stdout);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines, ["0", lines[1], lines[2]], "{text}");
        assert_ne!(lines[1], link("user"), "{text}");
        assert_ne!(lines[2], link("mnt"), "{text}");
    }

    #[test]
    fn a_missing_unshare_is_unavailable_and_says_so() {
        // An unshare that is not there: the same check as a missing one.
        let ns = set("ipc").unwrap();
        let e = ns
            .check_using(OsStr::new("/nonexistent/unshare"))
            .unwrap_err();
        assert_eq!(e.kind(), cuda_ipc::ErrorKind::Unavailable);
        assert!(
            e.to_string()
                .contains("util-linux `unshare` is not installed"),
            "{e}"
        );
    }
}
