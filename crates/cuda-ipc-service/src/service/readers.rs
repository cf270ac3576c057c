//! Who reads which sets, written where the next serving process finds it.
//!
//! A reader's mappings outlive the serving process, but its leases do not:
//! after a crash the next process does not know who maps what until each
//! reader connects again (at its next call). A write in place opened in
//! that gap would write under a reader that never stepped aside. So every
//! process that holds a set's lease is written, as it is granted and before
//! its holder hears of it, into a small memfd that the store keeps
//! ([`crate::keep`]). The next serving process reads it back: each process
//! written there is an **orphan** until it connects again and says so (the
//! `reconnected` call its library makes once it took back what it could),
//! or exits. A write in place waits for the orphans that may map its set
//! as it waits for readers that have not stepped aside.
//!
//! What is written is a process (pid, its start time, uid), a 64-bit
//! filter of the names of the sets it leases (two bits per name: a set
//! whose bits are all in an orphan's filter may be mapped by it) and the
//! filter of those it stepped aside from (its mappings asleep). An orphan
//! aside from everything it leased (the aside filter covers the other)
//! maps nothing awake, and is not waited for. A false match costs a wait,
//! never a missed reader. At most [`SLOTS`] processes
//! are written, more than the channel serves connections at its largest
//! setting; a process whose pid the service cannot see (a peer in a PID
//! namespace outside the service's: pid 0) cannot be told from another,
//! nor checked, so it is not written: the service's docs say so.
//!
//! The file is 32 bytes of header and [`SLOTS`] slots of 48 bytes, little
//! endian: owner (the serving process's pid; 0 = free), pid, uid, 0, start
//! time (clock ticks after boot, `/proc/PID/stat`), filter, aside filter,
//! 0. A slot is written with one `pwrite`, so a crash leaves it whole or
//! as before. Every change is written before the client hears of it: a
//! lease before the attach's answer, an aside once marked, the end of one
//! before `back` answers.

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::fs::{MemfdFlags, SealFlags};

use super::catalog::Holder;
use crate::exchange::HIDDEN_ENTRY_PREFIX;

/// The name the file is kept under in the store.
pub(crate) const KEPT_NAME: &str = crate::keep::image::READERS_NAME;
/// How many processes the file has room for.
pub(crate) const SLOTS: usize = 8192;
const MAGIC: &[u8; 16] = b"cuda-ipc readers";
const FORMAT: u32 = 1;
const HEADER: usize = 32;
const SLOT: usize = 48;
/// The file's length.
pub(crate) const FILE_BYTES: usize = HEADER + SLOTS * SLOT;

/// The two filter bits of a set's name (FNV-1a, 64 bits: the same in
/// every build, since the next process may be a newer one).
pub(crate) fn name_bits(name: &str) -> u64 {
    use std::hash::Hasher;
    let mut hasher = fnv::FnvHasher::default();
    hasher.write(name.as_bytes());
    let h = hasher.finish();
    (1 << (h & 63)) | (1 << ((h >> 6) & 63))
}

/// A process's start time (field 22 of `/proc/PID/stat`), or `None` when
/// it is not running.
pub(crate) fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces.
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(19)?.parse().ok()
}

/// A reader of the serving process before, not connected again yet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Orphan {
    pub(crate) pid: u32,
    pub(crate) uid: u32,
    start: u64,
    filter: u64,
    aside: u64,
    slot: usize,
}

impl Orphan {
    /// Whether it may map `bits`'s set awake.
    fn may_map(&self, bits: u64) -> bool {
        self.filter & bits == bits && self.aside & self.filter != self.filter
    }
}

/// A process holding set leases now.
#[derive(Debug, Default)]
struct Live {
    start: u64,
    /// Leases held on each set name.
    names: HashMap<String, u32>,
    slot: Option<usize>,
}

/// The book (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct Readers {
    file: Option<OwnedFd>,
    me: u32,
    live: HashMap<(u32, u32), Live>,
    /// The filter of the sets each process stepped aside from (whether it
    /// holds a lease now or not: a reader connecting again steps aside
    /// before it takes its leases back).
    aside: HashMap<(u32, u32), u64>,
    orphans: Vec<Orphan>,
    /// Free slots, the lowest last.
    free: Vec<usize>,
    full_told: bool,
}

impl Readers {
    /// A book that keeps nothing yet (see [`adopt`](Self::adopt) and
    /// [`create`](Self::create)).
    pub(crate) fn new() -> Readers {
        Readers {
            me: std::process::id(),
            ..Readers::default()
        }
    }

    /// Takes the file the store handed back: its processes become orphans
    /// (those no longer running are left out), the rest of it is free.
    ///
    /// # Errors
    /// Why the file is not one this build reads (the caller makes a new
    /// one and says that readers of before are not known).
    pub(crate) fn adopt(&mut self, fd: OwnedFd) -> Result<usize, String> {
        let bytes = read_all(fd.as_fd()).map_err(|e| format!("cannot read it: {e}"))?;
        let mut orphans = decode(&bytes)?;
        orphans.retain(|o| {
            let running = o.pid != 0 && start_time(o.pid) == Some(o.start);
            if !running {
                let _ = write_slot(fd.as_fd(), o.slot, &[0; SLOT]);
            }
            running
        });
        self.use_file(fd, orphans);
        Ok(self.orphans.len())
    }

    /// Keeps `fd` as the file, `orphans` in their slots, the other slots
    /// free, and writes the processes granted leases before it came.
    fn use_file(&mut self, fd: OwnedFd, orphans: Vec<Orphan>) {
        self.orphans = orphans;
        self.file = Some(fd);
        self.rewrite_free();
        self.write_live();
    }

    /// Makes a new, empty file (fixed in size) and returns a descriptor of
    /// it for the store.
    ///
    /// # Errors
    /// `memfd_create`'s, `ftruncate`'s, the header's write.
    pub(crate) fn create(&mut self) -> std::io::Result<BorrowedFd<'_>> {
        let fd = rustix::fs::memfd_create(
            "cuda-ipc-readers",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )?;
        rustix::fs::ftruncate(&fd, FILE_BYTES as u64)?;
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
        let mut header = [0u8; HEADER];
        header[..16].copy_from_slice(MAGIC);
        header[16..20].copy_from_slice(&FORMAT.to_le_bytes());
        header[20..24].copy_from_slice(&(SLOTS as u32).to_le_bytes());
        pwrite_all(fd.as_fd(), &header, 0)?;
        self.use_file(fd, Vec::new());
        Ok(self.file.as_ref().expect("just set").as_fd())
    }

    /// Whether a file is kept.
    pub(crate) fn is_kept(&self) -> bool {
        self.file.is_some()
    }

    fn rewrite_free(&mut self) {
        let taken: std::collections::HashSet<usize> = self.orphans.iter().map(|o| o.slot).collect();
        self.free = (0..SLOTS).rev().filter(|s| !taken.contains(s)).collect();
        for l in self.live.values_mut() {
            l.slot = None;
        }
    }

    /// Writes every live process (those granted before the file came).
    fn write_live(&mut self) {
        let keys: Vec<(u32, u32)> = self.live.keys().copied().collect();
        for k in keys {
            self.write(k);
        }
    }

    /// A lease on `name` granted to (or ended for) process `pid` of `uid`.
    /// Hidden entries (chunks, staging versions) are not sets and are not
    /// written; nor is a pid the service cannot see (0).
    pub(crate) fn lease(&mut self, granted: bool, name: &str, pid: u32, uid: u32) {
        if pid == 0 || name.starts_with(HIDDEN_ENTRY_PREFIX) {
            return;
        }
        let key = (pid, uid);
        if granted {
            let live = self.live.entry(key).or_insert_with(|| Live {
                start: start_time(pid).unwrap_or(0),
                ..Live::default()
            });
            let n = live.names.entry(name.to_owned()).or_default();
            *n += 1;
            if *n > 1 {
                return; // the filter is as it was
            }
        } else {
            let Some(live) = self.live.get_mut(&key) else {
                return;
            };
            match live.names.get_mut(name) {
                Some(n) if *n > 1 => {
                    *n -= 1;
                    return;
                }
                Some(_) => {
                    live.names.remove(name);
                }
                None => return,
            }
        }
        self.write(key);
    }

    /// Writes process `key`'s slot as it is now (freed when it holds no
    /// set any more).
    fn write(&mut self, key: (u32, u32)) {
        let Some(live) = self.live.get_mut(&key) else {
            return;
        };
        let Some(fd) = self.file.as_ref() else {
            if live.names.is_empty() {
                self.live.remove(&key);
            }
            return;
        };
        if live.names.is_empty() {
            if let Some(slot) = live.slot {
                let _ = write_slot(fd.as_fd(), slot, &[0; SLOT]);
                self.free.push(slot);
            }
            self.live.remove(&key);
            return;
        }
        let Some(slot) = live.slot.or_else(|| self.free.pop()) else {
            if !self.full_told {
                self.full_told = true;
                tracing::error!(
                    slots = SLOTS,
                    "the readers' book is full: readers past it are not known to a serving \
                     process after a restart"
                );
            }
            return;
        };
        live.slot = Some(slot);
        let filter = live.names.keys().fold(0, |f, n| f | name_bits(n));
        let aside = self.aside.get(&key).copied().unwrap_or(0);
        let bytes = encode_slot(self.me, key.0, key.1, live.start, filter, aside);
        if let Err(e) = write_slot(fd.as_fd(), slot, &bytes) {
            tracing::warn!(error = %e, "cannot write the readers' book");
        }
    }

    /// The sets each process stepped aside from now, by pid and uid (the
    /// service's marks); the others stepped aside from none.
    pub(crate) fn set_aside(&mut self, aside: &HashMap<(u32, u32), Vec<String>>) {
        let now: HashMap<(u32, u32), u64> = aside
            .iter()
            .map(|(key, names)| (*key, names.iter().fold(0, |f, n| f | name_bits(n))))
            .filter(|(_, filter)| *filter != 0)
            .collect();
        let changed: Vec<(u32, u32)> = self
            .live
            .keys()
            .filter(|key| now.get(key) != self.aside.get(key))
            .copied()
            .collect();
        self.aside = now;
        for key in changed {
            self.write(key);
        }
    }

    /// Process `pid` of `uid` connected again and took back what it could;
    /// `pending` are the sets it still maps and could not take back yet.
    /// Its orphan then covers only those (none: it is no orphan).
    pub(crate) fn reconnected(&mut self, pid: u32, uid: u32, pending: &[String]) {
        let filter = pending.iter().fold(0, |f, n| f | name_bits(n));
        let Some(fd) = self.file.as_ref() else {
            return;
        };
        let me = self.me;
        let free = &mut self.free;
        self.orphans.retain_mut(|o| {
            if (o.pid, o.uid) != (pid, uid) {
                return true;
            }
            if filter == 0 {
                let _ = write_slot(fd.as_fd(), o.slot, &[0; SLOT]);
                free.push(o.slot);
                return false;
            }
            o.filter = filter;
            o.aside = 0;
            let bytes = encode_slot(me, pid, uid, o.start, filter, 0);
            let _ = write_slot(fd.as_fd(), o.slot, &bytes);
            true
        });
    }

    /// The orphans that may map `set`, still running, and that hold no
    /// lease on it now (one that does is waited for as any reader is);
    /// `aside(pid, uid)` says whether one of its connections stepped aside
    /// from the set. Orphans found gone are forgotten.
    pub(crate) fn orphans_of(
        &mut self,
        set: &str,
        aside: impl Fn(u32, u32) -> bool,
    ) -> Vec<Holder> {
        let bits = name_bits(set);
        let mut out = Vec::new();
        let mut gone = Vec::new();
        for (i, o) in self.orphans.iter().enumerate() {
            if !o.may_map(bits) {
                continue;
            }
            if start_time(o.pid) != Some(o.start) {
                gone.push(i);
                continue;
            }
            let holds = self
                .live
                .get(&(o.pid, o.uid))
                .is_some_and(|l| l.names.contains_key(set));
            if !holds && !aside(o.pid, o.uid) {
                out.push(Holder {
                    pid: o.pid,
                    uid: o.uid,
                });
            }
        }
        for i in gone.into_iter().rev() {
            let o = self.orphans.remove(i);
            if let Some(fd) = self.file.as_ref() {
                let _ = write_slot(fd.as_fd(), o.slot, &[0; SLOT]);
            }
            self.free.push(o.slot);
        }
        out
    }

    /// The orphans that may map `set` and hold no lease on it now, aside
    /// or not, without looking whether they still run (for `ls`).
    pub(crate) fn orphans_mapping(&self, set: &str) -> Vec<Holder> {
        let bits = name_bits(set);
        self.orphans
            .iter()
            .filter(|o| {
                o.filter & bits == bits
                    && !self
                        .live
                        .get(&(o.pid, o.uid))
                        .is_some_and(|l| l.names.contains_key(set))
            })
            .map(|o| Holder {
                pid: o.pid,
                uid: o.uid,
            })
            .collect()
    }

    /// The orphans (for `reconnected`'s answer and the tests).
    pub(crate) fn orphans(&self) -> &[Orphan] {
        &self.orphans
    }
}

fn encode_slot(owner: u32, pid: u32, uid: u32, start: u64, filter: u64, aside: u64) -> [u8; SLOT] {
    let mut b = [0u8; SLOT];
    b[0..4].copy_from_slice(&owner.to_le_bytes());
    b[4..8].copy_from_slice(&pid.to_le_bytes());
    b[8..12].copy_from_slice(&uid.to_le_bytes());
    b[16..24].copy_from_slice(&start.to_le_bytes());
    b[24..32].copy_from_slice(&filter.to_le_bytes());
    b[32..40].copy_from_slice(&aside.to_le_bytes());
    b
}

/// The processes a file names (every slot with an owner).
///
/// # Errors
/// A file of another length, magic, format or slot count.
pub(crate) fn decode(bytes: &[u8]) -> Result<Vec<Orphan>, String> {
    if bytes.len() != FILE_BYTES {
        return Err(format!(
            "it is {} bytes long, not {FILE_BYTES}",
            bytes.len()
        ));
    }
    if &bytes[..16] != MAGIC {
        return Err("it is not a readers' book".into());
    }
    let word = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
    let long = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    if word(16) != FORMAT || word(20) as usize != SLOTS {
        return Err(format!(
            "its format {} with {} slots is not this build's ({FORMAT}, {SLOTS})",
            word(16),
            word(20)
        ));
    }
    Ok((0..SLOTS)
        .filter_map(|slot| {
            let at = HEADER + slot * SLOT;
            (word(at) != 0).then(|| Orphan {
                pid: word(at + 4),
                uid: word(at + 8),
                start: long(at + 16),
                filter: long(at + 24),
                aside: long(at + 32),
                slot,
            })
        })
        .collect())
}

/// The file that names `orphans` (each in its slot), as a serving process
/// writes it.
pub(crate) fn encode(orphans: &[Orphan], owner: u32) -> Vec<u8> {
    let mut out = vec![0u8; FILE_BYTES];
    out[..16].copy_from_slice(MAGIC);
    out[16..20].copy_from_slice(&FORMAT.to_le_bytes());
    out[20..24].copy_from_slice(&(SLOTS as u32).to_le_bytes());
    for o in orphans {
        let at = HEADER + o.slot * SLOT;
        out[at..at + SLOT].copy_from_slice(&encode_slot(
            owner, o.pid, o.uid, o.start, o.filter, o.aside,
        ));
    }
    out
}

/// Decodes `bytes` as a restarted service decodes the readers' book it
/// kept (zeros added up to the book's length, so that short inputs stand
/// for whole files) and encodes what decoded again (for the fuzz target
/// `readers_book`, which checks that nothing panics and that a second
/// round trip changes nothing).
///
/// # Errors
/// Why the bytes are not a book this build reads.
#[doc(hidden)]
pub fn readers_book_round_trip(bytes: &[u8]) -> Result<Vec<u8>, String> {
    let mut whole = bytes.to_vec();
    if whole.len() < FILE_BYTES {
        whole.resize(FILE_BYTES, 0);
    }
    let orphans = decode(&whole)?;
    let owner = orphans.first().map_or(1, |o| {
        let at = HEADER + o.slot * SLOT;
        u32::from_le_bytes(whole[at..at + 4].try_into().expect("4 bytes"))
    });
    Ok(encode(&orphans, owner))
}

fn write_slot(fd: BorrowedFd<'_>, slot: usize, bytes: &[u8; SLOT]) -> std::io::Result<()> {
    pwrite_all(fd, bytes, (HEADER + slot * SLOT) as u64)
}

fn pwrite_all(fd: BorrowedFd<'_>, bytes: &[u8], at: u64) -> std::io::Result<()> {
    let mut done = 0;
    while done < bytes.len() {
        done += rustix::io::pwrite(fd, &bytes[done..], at + done as u64)?;
    }
    Ok(())
}

fn read_all(fd: BorrowedFd<'_>) -> std::io::Result<Vec<u8>> {
    crate::keep::store::read_up_to(fd, FILE_BYTES as u64, "a readers' book")
}

#[cfg(test)]
#[path = "readers_tests.rs"]
mod tests;
