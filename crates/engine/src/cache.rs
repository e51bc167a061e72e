//! Bounded cache of decoded multi-block REPLACE units (v3 compression factor > 4 KiB).
//!
//! A unit of up to 256 KiB is decompressed as a whole even when a read needs one block
//! of it; sequential 4 KiB reads (loop readahead split, unaligned requests) would
//! otherwise decode the same unit up to 64 times. Sharded by op index so concurrent
//! readers rarely contend; each shard evicts its least recently used entries once over
//! its byte budget. Shards hold few entries (budget / unit size), so a linear scan for
//! the victim is cheaper than maintaining an ordered structure on every hit.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

const SHARDS: usize = 16;

#[derive(Debug)]
pub(crate) struct UnitCache {
    shards: Vec<Mutex<Shard>>,
    shard_budget: usize,
    clock: AtomicU64,
}

#[derive(Debug, Default)]
struct Shard {
    map: HashMap<u32, (Arc<Vec<u8>>, u64)>,
    bytes: usize,
}

impl UnitCache {
    pub(crate) fn new(budget_bytes: usize) -> UnitCache {
        UnitCache {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            shard_budget: budget_bytes / SHARDS,
            clock: AtomicU64::new(0),
        }
    }

    pub(crate) fn enabled(&self) -> bool {
        self.shard_budget > 0
    }

    fn shard(&self, key: u32) -> std::sync::MutexGuard<'_, Shard> {
        // Poisoning only means another reader panicked mid-update of plain data; the map
        // is still consistent enough to serve or evict from.
        self.shards[key as usize % SHARDS]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn get(&self, key: u32) -> Option<Arc<Vec<u8>>> {
        let tick = self.clock.fetch_add(1, Ordering::Relaxed);
        let mut shard = self.shard(key);
        let entry = shard.map.get_mut(&key)?;
        entry.1 = tick;
        Some(entry.0.clone())
    }

    pub(crate) fn insert(&self, key: u32, data: Arc<Vec<u8>>) {
        if !self.enabled() {
            return;
        }
        let tick = self.clock.fetch_add(1, Ordering::Relaxed);
        let mut shard = self.shard(key);
        let len = data.len();
        if let Some(old) = shard.map.insert(key, (data, tick)) {
            shard.bytes -= old.0.len();
        }
        shard.bytes += len;
        while shard.bytes > self.shard_budget && shard.map.len() > 1 {
            let victim = shard
                .map
                .iter()
                .filter(|(k, _)| **k != key)
                .min_by_key(|(_, v)| v.1)
                .map(|(k, _)| *k);
            match victim.and_then(|k| shard.map.remove(&k)) {
                Some((old, _)) => shard.bytes -= old.len(),
                None => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recently_used_within_budget() {
        // One shard's budget holds two 100-byte entries.
        let cache = UnitCache::new(SHARDS * 200);
        let k = |i: u32| i * SHARDS as u32; // all in shard 0
        cache.insert(k(1), Arc::new(vec![1; 100]));
        cache.insert(k(2), Arc::new(vec![2; 100]));
        assert_eq!(cache.get(k(1)).unwrap()[0], 1); // 1 is now more recent than 2
        cache.insert(k(3), Arc::new(vec![3; 100]));
        assert!(cache.get(k(2)).is_none());
        assert_eq!(cache.get(k(1)).unwrap()[0], 1);
        assert_eq!(cache.get(k(3)).unwrap()[0], 3);
    }

    #[test]
    fn zero_budget_disables() {
        let cache = UnitCache::new(0);
        cache.insert(1, Arc::new(vec![0; 10]));
        assert!(cache.get(1).is_none());
    }
}
