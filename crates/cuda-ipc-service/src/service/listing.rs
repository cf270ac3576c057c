//! The `ls` answer: every set, its version, state, writer and readers.

use std::collections::HashMap;

use super::admin::{LsAnswer, SetRow, SetState, WriterRow};
use super::catalog::Holder;
use super::{Inner, locked};

impl Inner {
    pub(super) fn ls_answer(&self) -> LsAnswer {
        self.sweep_retired();
        let restarts: HashMap<String, u64> = locked(&self.held)
            .iter()
            .map(|(n, h)| (n.clone(), h.restarts))
            .collect();
        let leases = self.publisher.leases();
        let catalog = locked(&self.catalog);
        let writer = |name: &str| {
            catalog.writing(name).map(|w| WriterRow {
                pid: w.writer.pid,
                uid: w.writer.uid,
                version: w.version,
                bytes: w.bytes,
            })
        };
        let state = |name: &str, w: &Option<WriterRow>| {
            if w.is_some() {
                SetState::Writing
            } else if catalog.is_torn(name) {
                SetState::Torn
            } else {
                SetState::Committed
            }
        };
        // Sets being written for the first time have no version yet.
        let new_sets = catalog.write_sessions().filter(|w| w.creates).map(|w| {
            let row = writer(&w.set);
            SetRow {
                name: w.set.clone(),
                bytes: 0,
                payload_bytes: 0,
                tensors: w.staged.tensors,
                version: 0,
                owner_uid: w.owner_uid,
                loaded_from: String::new(),
                created_unix: 0,
                leases: Vec::new(),
                state: state(&w.set, &row),
                writer: row,
                restarts: 0,
                not_reconnected: Vec::new(),
            }
        });
        let mut sets: Vec<SetRow> = catalog
            .sets()
            .map(|s| {
                let row = writer(&s.name);
                SetRow {
                    name: s.name.clone(),
                    bytes: s.bytes,
                    payload_bytes: s.payload_bytes,
                    tensors: s.tensors,
                    version: s.version,
                    owner_uid: s.owner_uid,
                    loaded_from: s.loaded_from.clone(),
                    created_unix: s.created_unix,
                    leases: leases
                        .iter()
                        .filter(|l| l.name == s.name)
                        .map(|l| Holder {
                            pid: l.pid,
                            uid: l.uid,
                        })
                        .collect(),
                    state: state(&s.name, &row),
                    writer: row,
                    restarts: restarts.get(&s.name).copied().unwrap_or(0),
                    not_reconnected: locked(&self.readers).orphans_mapping(&s.name),
                }
            })
            .chain(new_sets)
            .collect();
        sets.sort_by(|a, b| a.name.cmp(&b.name));
        LsAnswer { sets }
    }
}
