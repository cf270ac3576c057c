//! The subscriber's mapping budget: cached chunk mappings kept for reuse,
//! evicted least recently used first when the cache passes its budget, but
//! only those that nothing holds (no lease, no view).

use std::collections::HashMap;
use std::hash::Hash;

/// How many cached mappings a [`Subscriber`](super::Subscriber) keeps, in
/// bytes and in count. Mappings that a lease or a view holds are never
/// evicted, so the cache may pass the budget while they live; it comes back
/// under it as they are released.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct MappingBudget {
    /// The most bytes of cached mappings (`None`: no limit).
    pub bytes: Option<u64>,
    /// The most cached mappings (`None`: no limit).
    pub count: Option<usize>,
}

impl Default for MappingBudget {
    /// No byte limit and at most 1,024 mappings: every chunk a consumer maps
    /// stays mapped for reuse until it passes 1,024 idle chunks.
    fn default() -> Self {
        MappingBudget {
            bytes: None,
            count: Some(1024),
        }
    }
}

impl MappingBudget {
    /// A budget of at most `bytes` bytes and `count` mappings.
    pub fn new(bytes: Option<u64>, count: Option<usize>) -> Self {
        MappingBudget { bytes, count }
    }

    fn over(&self, bytes: u64, count: usize) -> bool {
        self.bytes.is_some_and(|b| bytes > b) || self.count.is_some_and(|c| count > c)
    }
}

/// Something the cache holds that may be in use elsewhere.
pub(super) trait Held {
    /// Whether anything besides the cache holds it (a lease, a view).
    fn held(&self) -> bool;
}

struct Slot<V> {
    value: V,
    bytes: u64,
    used: u64,
}

/// A least-recently-used cache under a [`MappingBudget`].
pub(super) struct LruCache<K, V> {
    budget: MappingBudget,
    slots: HashMap<K, Slot<V>>,
    bytes: u64,
    clock: u64,
}

impl<K: Eq + Hash + Clone, V: Held> LruCache<K, V> {
    pub(super) fn new(budget: MappingBudget) -> Self {
        LruCache {
            budget,
            slots: HashMap::new(),
            bytes: 0,
            clock: 0,
        }
    }

    /// The cached value of `key`, marked as used now.
    pub(super) fn get(&mut self, key: &K) -> Option<&V> {
        self.clock += 1;
        let clock = self.clock;
        self.slots.get_mut(key).map(|s| {
            s.used = clock;
            &s.value
        })
    }

    /// Caches `value` (of `bytes` bytes) under `key`, then evicts what the
    /// budget asks for; returns the evicted values (and a value that `key`
    /// held before) for the caller to undo outside any lock.
    pub(super) fn insert(&mut self, key: K, value: V, bytes: u64) -> Vec<V> {
        self.clock += 1;
        let mut out = Vec::new();
        if let Some(old) = self.slots.insert(
            key,
            Slot {
                value,
                bytes,
                used: self.clock,
            },
        ) {
            self.bytes -= old.bytes;
            out.push(old.value);
        }
        self.bytes += bytes;
        out.extend(self.evict());
        out
    }

    /// Evicts idle values, least recently used first, until the cache is
    /// within its budget or only held values are left.
    pub(super) fn evict(&mut self) -> Vec<V> {
        let mut out = Vec::new();
        while self.budget.over(self.bytes, self.slots.len()) {
            let victim = self
                .slots
                .iter()
                .filter(|(_, s)| !s.value.held())
                .min_by_key(|(_, s)| s.used)
                .map(|(k, _)| k.clone());
            let Some(k) = victim else { break };
            if let Some(s) = self.slots.remove(&k) {
                self.bytes -= s.bytes;
                out.push(s.value);
            }
        }
        out
    }

    /// Removes every idle value.
    pub(super) fn drain_idle(&mut self) -> Vec<V> {
        let idle: Vec<K> = self
            .slots
            .iter()
            .filter(|(_, s)| !s.value.held())
            .map(|(k, _)| k.clone())
            .collect();
        idle.into_iter()
            .filter_map(|k| self.slots.remove(&k))
            .map(|s| {
                self.bytes -= s.bytes;
                s.value
            })
            .collect()
    }

    /// Cached values, and their bytes.
    pub(super) fn usage(&self) -> (usize, u64) {
        (self.slots.len(), self.bytes)
    }

    /// Every cached value.
    pub(super) fn values(&self) -> impl Iterator<Item = &V> {
        self.slots.values().map(|s| &s.value)
    }

    /// Every cached key, with its value and bytes.
    pub(super) fn entries(&self) -> impl Iterator<Item = (&K, &V, u64)> {
        self.slots.iter().map(|(k, s)| (k, &s.value, s.bytes))
    }

    /// The cached value of `key`, to change, without marking it as used.
    pub(super) fn peek_mut(&mut self, key: &K) -> Option<&mut V> {
        self.slots.get_mut(key).map(|s| &mut s.value)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use proptest::prelude::*;

    use super::*;

    impl Held for Arc<u32> {
        fn held(&self) -> bool {
            Arc::strong_count(self) > 1
        }
    }

    #[test]
    fn evicts_the_least_recently_used_idle_mapping() {
        let mut c = LruCache::new(MappingBudget::new(None, Some(2)));
        assert!(c.insert(1, Arc::new(1), 10).is_empty());
        assert!(c.insert(2, Arc::new(2), 10).is_empty());
        c.get(&1); // 2 is now the least recently used
        let out = c.insert(3, Arc::new(3), 10);
        assert_eq!(out.iter().map(|v| **v).collect::<Vec<_>>(), [2]);
        assert_eq!(c.usage(), (2, 20));
    }

    #[test]
    fn never_evicts_a_held_mapping() {
        let mut c = LruCache::new(MappingBudget::new(Some(15), None));
        let held = Arc::new(1);
        assert!(c.insert(1, held.clone(), 10).is_empty());
        // Over the budget, but the only other candidate is the new one.
        let out = c.insert(2, Arc::new(2), 10);
        assert_eq!(out.iter().map(|v| **v).collect::<Vec<_>>(), [2]);
        assert_eq!(c.usage(), (1, 10));
        // A held mapping over budget stays until released.
        let out = c.insert(3, Arc::new(3), 100);
        assert_eq!(out.iter().map(|v| **v).collect::<Vec<_>>(), [3]);
        drop(held);
        assert_eq!(c.evict().len(), 0, "10 bytes is within 15");
        assert_eq!(c.drain_idle().len(), 1);
        assert_eq!(c.usage(), (0, 0));
    }

    #[test]
    fn replacing_a_key_returns_the_old_value() {
        let mut c = LruCache::new(MappingBudget::default());
        c.insert(7, Arc::new(1), 5);
        let out = c.insert(7, Arc::new(2), 6);
        assert_eq!(out.iter().map(|v| **v).collect::<Vec<_>>(), [1]);
        assert_eq!(c.usage(), (1, 6));
    }

    proptest! {
        /// Random inserts, uses and releases against a model: the cache is
        /// within budget whenever its idle values alone could make it so,
        /// never evicts a held value, and evicts the least recently used.
        #[test]
        fn lru_under_budget(
            ops in proptest::collection::vec((0u8..3, 0u32..12, 1u64..64), 1..200),
            max_bytes in 1u64..300,
            max_count in 1usize..8,
        ) {
            let budget = MappingBudget::new(Some(max_bytes), Some(max_count));
            let mut c = LruCache::new(budget);
            let mut held: HashMap<u32, Arc<u32>> = HashMap::new();
            let mut order: Vec<u32> = Vec::new(); // least recent first
            let mut sizes: HashMap<u32, u64> = HashMap::new();
            for (op, key, bytes) in ops {
                match op {
                    0 => {
                        let v = Arc::new(key);
                        if key % 2 == 0 { held.insert(key, v.clone()); }
                        let existed = order.contains(&key);
                        let mut out = c.insert(key, v, bytes).into_iter();
                        if existed {
                            out.next(); // the value `key` held before
                        }
                        order.retain(|k| *k != key);
                        order.push(key);
                        sizes.insert(key, bytes);
                        let idle_in_order: Vec<u32> = order.iter().copied()
                            .filter(|k| !held.contains_key(k)).collect();
                        for (i, v) in out.enumerate() {
                            prop_assert_eq!(Some(&*v), idle_in_order.get(i), "not the least recent idle value");
                            order.retain(|o| *o != *v);
                            sizes.remove(&*v);
                        }
                    }
                    1 => { if c.get(&key).is_some() { order.retain(|k| *k != key); order.push(key); } }
                    _ => { held.remove(&key); }
                }
                let (n, b) = c.usage();
                prop_assert_eq!(n, order.len());
                prop_assert_eq!(b, order.iter().map(|k| sizes[k]).sum::<u64>());
                let idle = order.iter().filter(|k| !held.contains_key(k)).count();
                if budget.over(b, n) && op == 0 {
                    prop_assert_eq!(idle, 0, "over budget with idle values cached");
                }
            }
        }
    }
}
