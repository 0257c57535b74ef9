//! A least-recently-used map bounded by bytes, shared by a process's threads: what the
//! pipeline's per-process caches (prompt embeddings, VAE traces) are made of.
//!
//! Values are handed out as `Arc`s, so an entry evicted while a request still reads it
//! stays alive until that request drops it; the capacity bounds what the cache holds,
//! not what requests hold.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard};

pub struct ByteLru<K, V> {
    capacity: usize,
    inner: Mutex<Inner<K, V>>,
}

struct Inner<K, V> {
    /// Key → (value, bytes, last use).
    map: HashMap<K, (Arc<V>, usize, u64)>,
    /// Last use → key: the eviction order.
    order: BTreeMap<u64, K>,
    bytes: usize,
    clock: u64,
}

impl<K: Hash + Eq + Clone, V> ByteLru<K, V> {
    pub fn new(capacity: usize) -> Self {
        ByteLru {
            capacity,
            inner: Mutex::new(Inner {
                map: HashMap::new(),
                order: BTreeMap::new(),
                bytes: 0,
                clock: 0,
            }),
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn lock(&self) -> MutexGuard<'_, Inner<K, V>> {
        // Every method leaves the maps consistent before anything can panic.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The value under `key`, now the most recently used.
    pub fn get(&self, key: &K) -> Option<Arc<V>> {
        let mut g = self.lock();
        let inner = &mut *g;
        inner.clock += 1;
        let (v, _, used) = inner.map.get_mut(key)?;
        let k = inner.order.remove(used).expect("every entry is ordered");
        *used = inner.clock;
        inner.order.insert(inner.clock, k);
        Some(v.clone())
    }

    /// Keeps `value` (of `bytes`) under `key`, evicting the least recently used entries
    /// until it fits; false (nothing kept, nothing evicted) when it exceeds the whole
    /// capacity. Replaces an entry of the same key.
    pub fn insert(&self, key: K, value: Arc<V>, bytes: usize) -> bool {
        if bytes > self.capacity {
            return false;
        }
        let mut g = self.lock();
        let inner = &mut *g;
        if let Some((_, b, used)) = inner.map.remove(&key) {
            inner.order.remove(&used);
            inner.bytes -= b;
        }
        while inner.bytes + bytes > self.capacity {
            let (_, old) = inner.order.pop_first().expect("bytes held means entries");
            let (_, b, _) = inner.map.remove(&old).expect("every ordered key is mapped");
            inner.bytes -= b;
        }
        inner.clock += 1;
        inner.order.insert(inner.clock, key.clone());
        inner.map.insert(key, (value, bytes, inner.clock));
        inner.bytes += bytes;
        true
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }

    /// Keys, least recently used first.
    pub fn keys(&self) -> Vec<K> {
        self.lock().order.values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The brute-force model: a list in use order, evicting from the front.
    #[derive(Default)]
    struct Model {
        list: Vec<(u8, usize)>,
    }

    impl Model {
        fn get(&mut self, k: u8) -> bool {
            match self.list.iter().position(|e| e.0 == k) {
                Some(i) => {
                    let e = self.list.remove(i);
                    self.list.push(e);
                    true
                }
                None => false,
            }
        }

        fn insert(&mut self, cap: usize, k: u8, b: usize) -> bool {
            if b > cap {
                return false;
            }
            self.list.retain(|e| e.0 != k);
            while self.list.iter().map(|e| e.1).sum::<usize>() + b > cap {
                self.list.remove(0);
            }
            self.list.push((k, b));
            true
        }
    }

    proptest! {
        #[test]
        fn equals_a_brute_force_lru(
            cap in 0usize..40,
            ops in prop::collection::vec((any::<bool>(), 0u8..8, 0usize..20), 0..80),
        ) {
            let lru = ByteLru::new(cap);
            let mut model = Model::default();
            for (is_get, k, b) in ops {
                if is_get {
                    prop_assert_eq!(lru.get(&k).is_some(), model.get(k));
                } else {
                    prop_assert_eq!(lru.insert(k, Arc::new(b), b), model.insert(cap, k, b));
                }
                let keys: Vec<u8> = model.list.iter().map(|e| e.0).collect();
                prop_assert_eq!(lru.keys(), keys);
                prop_assert_eq!(lru.bytes(), model.list.iter().map(|e| e.1).sum::<usize>());
                prop_assert!(lru.bytes() <= cap);
            }
        }
    }
}
