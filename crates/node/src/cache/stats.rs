//! What the cache reports, and the per-shard counters it is summed from.

/// A snapshot of the cache, summed over the shards (each shard is read under
/// its own lock, so the sum is not one atomic instant).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Keys present.
    pub entries: u64,
    /// Bytes of the cached blocks (their lengths, not their size classes).
    pub bytes_stored: u64,
    /// `get` calls that found the key.
    pub hits: u64,
    /// `get` calls that did not.
    pub misses: u64,
    /// `insert` calls, replacements included.
    pub inserts: u64,
    /// Entries dropped to make room for an allocation.
    pub evictions: u64,
    /// Entries dropped by `remove`.
    pub removals: u64,
    /// Entries with an unexpired pin.
    pub pinned: u64,
}

/// Monotonic counters of one shard. Plain integers: they are only touched
/// under the shard's lock, which the operation holds anyway, so atomics
/// would add cost and no safety.
#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) hits: u64,
    pub(super) misses: u64,
    pub(super) inserts: u64,
    pub(super) evictions: u64,
    pub(super) removals: u64,
}

impl Counters {
    pub(super) fn add_to(&self, stats: &mut CacheStats) {
        stats.hits += self.hits;
        stats.misses += self.misses;
        stats.inserts += self.inserts;
        stats.evictions += self.evictions;
        stats.removals += self.removals;
    }
}
