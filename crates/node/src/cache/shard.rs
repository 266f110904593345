//! One shard: a hash table of slot indices over a slot array, the policy's
//! queues threaded through the same slots, the pins, and the counters.
//!
//! Everything a request touches for one key lives behind one mutex, so a
//! lookup, its policy update and its statistics cost a single lock.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use hashbrown::HashTable;

use super::list::NIL;
use super::policy::{EvictionPolicy, Policy};
use super::stats::{CacheStats, Counters};
use super::tenants::TenantAccount;
use super::{CachedBlock, Evicted};
use crate::memory::{prefetch, Block};

/// Keys [`Shard::get_many`] looks up together: enough to overlap the misses
/// of a batch's keys in one shard (a batch of 32 over 16 shards puts two or
/// three in each), few enough that the candidates stay on the stack.
const LOOKUP_PASS: usize = 16;

/// Asks the CPU to bring all of `object`'s cache lines in (a node spans two
/// or three), without waiting for them.
fn prefetch_object<T>(object: &T) {
    const LINE: usize = 64;
    let start = (object as *const T).cast::<u8>();
    let size = std::mem::size_of::<T>();
    for at in (0..size).step_by(LINE).chain([size.saturating_sub(1)]) {
        prefetch(start.wrapping_add(at));
    }
}

/// A cached block and what the cache knows about it.
pub(super) struct Entry {
    pub(super) key: Bytes,
    /// Hash of `key` under the cache's hasher; kept so the table can grow
    /// and the ghost can remember the key without hashing again.
    pub(super) hash: u64,
    /// Its CRC-32C is kept with the block ([`Block::crc`]), computed when
    /// first needed, not here.
    pub(super) block: Block,
    /// `Some` while the pin is counted in [`Shard::pinned`]. It can be in the
    /// past for a moment (until the expiry heap catches up); eviction
    /// compares it with the clock, so such a pin no longer protects anything.
    pub(super) pin_until: Option<Instant>,
    /// S3-FIFO's 2-bit access counter (unused by LRU).
    pub(super) freq: u8,
    /// S3-FIFO: on the main queue rather than the small one.
    pub(super) in_main: bool,
    /// GET hits since the block was stored (saturating), for the second
    /// tier's `hot` ingest mode.
    pub(super) reads: u32,
    /// The tenant the key belongs to, charged for the block's bytes and
    /// its pin while the entry lives (none without a tenants file).
    pub(super) account: Option<Arc<TenantAccount>>,
}

/// A slot of the array: list links plus the entry, if occupied.
pub(super) struct Node {
    pub(super) prev: u32,
    pub(super) next: u32,
    /// Bumped each time the slot is freed, so a pin expiry recorded for a
    /// previous occupant is recognised as stale.
    generation: u32,
    pub(super) entry: Option<Entry>,
}

impl Node {
    /// Bytes the entry charges to its queue.
    pub(super) fn size(&self) -> u64 {
        self.entry.as_ref().map_or(0, |e| e.block.len() as u64)
    }
}

/// Pin expiry: (when, slot, generation of the slot's occupant).
type PinExpiry = Reverse<(Instant, u32, u32)>;

pub(super) struct Shard {
    /// Slot indices, keyed by `Entry::hash`, compared by `Entry::key`.
    table: HashTable<u32>,
    nodes: Vec<Node>,
    free: Vec<u32>,
    policy: Policy,
    bytes: u64,
    counters: Counters,
    /// One item per pin set or extended; the earliest expiry on top. Only
    /// for the `pinned` statistic: eviction reads `Entry::pin_until`.
    pins: BinaryHeap<PinExpiry>,
    /// Entries whose `pin_until` is `Some`.
    pinned: u64,
}

impl Shard {
    pub(super) fn new(policy: EvictionPolicy) -> Self {
        Shard {
            table: HashTable::new(),
            nodes: Vec::new(),
            free: Vec::new(),
            policy: Policy::new(policy),
            bytes: 0,
            counters: Counters::default(),
            pins: BinaryHeap::new(),
            pinned: 0,
        }
    }

    fn find(&self, hash: u64, key: &[u8]) -> Option<u32> {
        let nodes = &self.nodes;
        self.table.find(hash, |&idx| nodes[idx as usize].entry.as_ref().is_some_and(|e| e.key.as_ref() == key)).copied()
    }

    pub(super) fn get(&mut self, hash: u64, key: &[u8]) -> Option<CachedBlock> {
        let Some(idx) = self.find(hash, key) else {
            self.counters.misses += 1;
            return None;
        };
        self.hit(idx)
    }

    /// A GET's hit on the entry in slot `idx`: counted, recorded for the
    /// policy, its block shared with the reader.
    fn hit(&mut self, idx: u32) -> Option<CachedBlock> {
        let entry = self.nodes[idx as usize].entry.as_mut()?;
        entry.reads = entry.reads.saturating_add(1);
        let found = CachedBlock { block: entry.block.clone(), reads: entry.reads };
        self.policy.touch(&mut self.nodes, idx);
        self.counters.hits += 1;
        Some(found)
    }

    /// [`Shard::get`] of each `(hash, key, place)` of `lookups`, answered
    /// into `found[place]` in order, in passes over [`LOOKUP_PASS`] keys at
    /// a time so that the cache misses of different keys overlap. One key
    /// after another, a lookup waits on four or five misses in a row (the
    /// table's control bytes and slot, the slot's node, the key's bytes,
    /// the block's count), and the count's atomic increment keeps the next
    /// key's loads from starting early. Here the first pass finds each
    /// key's first candidate (its hash tag matches) and prefetches its
    /// node, the second prefetches the candidates' key bytes and block
    /// counts, the third checks each candidate and takes the hit; a key
    /// whose first candidate is not it goes the one-key way (a later
    /// candidate, or a miss). Nothing here inserts or removes, so a slot
    /// found in the first pass still holds its entry in the third.
    pub(super) fn get_many(&mut self, lookups: &[(u64, &[u8], usize)], found: &mut [Option<CachedBlock>]) {
        for pass in lookups.chunks(LOOKUP_PASS) {
            let mut first = [NIL; LOOKUP_PASS];
            for (slot, &(hash, ..)) in first.iter_mut().zip(pass) {
                if let Some(&idx) = self.table.iter_hash(hash).next() {
                    *slot = idx;
                    prefetch_object(&self.nodes[idx as usize]);
                }
            }
            for &idx in first.iter().take(pass.len()).filter(|&&idx| idx != NIL) {
                if let Some(entry) = &self.nodes[idx as usize].entry {
                    prefetch(entry.key.as_ptr());
                    entry.block.prefetch_count();
                }
            }
            for (&idx, &(hash, key, place)) in first.iter().zip(pass) {
                let is_it = idx != NIL && self.nodes[idx as usize].entry.as_ref().is_some_and(|e| e.key.as_ref() == key);
                found[place] = if is_it { self.hit(idx) } else { self.get(hash, key) };
            }
        }
    }

    pub(super) fn stored_len(&self, hash: u64, key: &[u8]) -> Option<u64> {
        self.find(hash, key).map(|idx| self.nodes[idx as usize].size())
    }

    pub(super) fn pin_state(&self, hash: u64, key: &[u8], now: Instant) -> Option<(u64, bool)> {
        let node = &self.nodes[self.find(hash, key)? as usize];
        let entry = node.entry.as_ref()?;
        Some((entry.block.len() as u64, entry.pin_until.is_some_and(|until| until > now)))
    }

    pub(super) fn contains(&self, hash: u64, key: &[u8]) -> bool {
        self.find(hash, key).is_some()
    }

    /// Stores or replaces; returns the block the caller must drop once the
    /// shard is unlocked (the replaced one, or the new one if it was refused).
    pub(super) fn insert(&mut self, hash: u64, key: Bytes, block: Block, account: Option<Arc<TenantAccount>>) -> Option<Block> {
        self.insert_with_reads(hash, key, block, 0, account)
    }

    /// As `insert`, starting the entry's read count at `reads`. `account`
    /// is the key's tenant (used for a new entry; a replaced one keeps
    /// its own, the same since the key is the same).
    pub(super) fn insert_with_reads(
        &mut self,
        hash: u64,
        key: Bytes,
        block: Block,
        reads: u32,
        account: Option<Arc<TenantAccount>>,
    ) -> Option<Block> {
        self.counters.inserts += 1;
        if let Some(idx) = self.find(hash, &key) {
            let Some(entry) = self.nodes[idx as usize].entry.as_mut() else {
                return Some(block);
            };
            let (old_len, new_len) = (entry.block.len() as u64, block.len() as u64);
            self.bytes = self.bytes - old_len + new_len;
            if let Some(a) = &entry.account {
                a.charge(Some(new_len), Some(old_len));
                if entry.pin_until.is_some() {
                    a.pin(Some(new_len), Some(old_len));
                }
            }
            entry.reads = reads;
            let old = std::mem::replace(&mut entry.block, block);
            self.policy.replaced(&mut self.nodes, idx, old_len, new_len);
            return Some(old);
        }
        let idx = match self.free.pop() {
            Some(idx) => idx,
            // Slot indices are u32 with NIL reserved; the pool cannot hold
            // that many blocks, so only the same block inserted under
            // billions of keys gets here.
            None if self.nodes.len() >= NIL as usize => return Some(block),
            None => {
                self.nodes.push(Node { prev: NIL, next: NIL, generation: 0, entry: None });
                (self.nodes.len() - 1) as u32
            }
        };
        self.bytes += block.len() as u64;
        if let Some(a) = &account {
            a.charge(Some(block.len() as u64), None);
        }
        self.nodes[idx as usize].entry = Some(Entry { key, hash, block, pin_until: None, freq: 0, in_main: false, reads, account });
        let nodes = &self.nodes;
        self.table.insert_unique(hash, idx, |&i| nodes[i as usize].entry.as_ref().map_or(0, |e| e.hash));
        self.policy.insert(&mut self.nodes, idx);
        None
    }

    /// Appends every entry (key, block) to `out`.
    pub(super) fn entries(&self, out: &mut Vec<(Bytes, Block)>) {
        out.extend(self.nodes.iter().filter_map(|n| n.entry.as_ref()).map(|e| (e.key.clone(), e.block.clone())));
    }

    /// Returns the removed block so it is dropped outside the lock.
    pub(super) fn remove(&mut self, hash: u64, key: &[u8]) -> Option<Block> {
        let idx = self.find(hash, key)?;
        self.policy.unlink(&mut self.nodes, idx);
        let entry = self.free_slot(idx)?;
        self.counters.removals += 1;
        Some(entry.block)
    }

    /// Evicts one entry that is neither pinned at `now` nor being read. A
    /// reader's clone would keep the memory allocated anyway, so evicting it
    /// would lose the entry without relieving the pool.
    pub(super) fn evict(&mut self, now: Instant) -> Option<Evicted> {
        self.evict_where(now, |_| true)
    }

    /// As `evict`, among the entries of tenants above their memory quota
    /// only (see `tenants.rs`, the cache's accounting): what eviction
    /// takes first while there are any.
    pub(super) fn evict_over_quota(&mut self, now: Instant) -> Option<Evicted> {
        self.evict_where(now, |e| e.account.as_ref().is_some_and(|a| a.over_quota()))
    }

    fn evict_where(&mut self, now: Instant, mut wanted: impl FnMut(&Entry) -> bool) -> Option<Evicted> {
        if self.table.is_empty() {
            return None;
        }
        let idx = self
            .policy
            .victim(&mut self.nodes, |e| e.pin_until.is_none_or(|until| until <= now) && e.block.ref_count() <= 1 && wanted(e))?;
        let entry = self.free_slot(idx)?;
        self.counters.evictions += 1;
        if let Some(a) = &entry.account {
            a.evictions.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Some(Evicted { key: entry.key, block: entry.block, reads: entry.reads })
    }

    /// Whether `key` is present; if so and `until` is later than both `now`
    /// and its current pin, pins it until then.
    pub(super) fn pin(&mut self, hash: u64, key: &[u8], until: Option<Instant>, now: Instant) -> bool {
        self.expire_pins(now);
        let Some(idx) = self.find(hash, key) else {
            return false;
        };
        let Some(until) = until.filter(|&until| until > now) else {
            return true;
        };
        let node = &mut self.nodes[idx as usize];
        let generation = node.generation;
        let Some(entry) = node.entry.as_mut() else {
            return true;
        };
        match entry.pin_until {
            Some(current) if current >= until => return true,
            Some(_) => {}
            None => {
                // A tenant's chain is pinned only as far as its pinnedBytes:
                // the match ends at the block that would pass it.
                if let Some(a) = &entry.account {
                    if !a.try_pin(entry.block.len() as u64) {
                        return false;
                    }
                }
                self.pinned += 1;
            }
        }
        entry.pin_until = Some(until);
        self.pins.push(Reverse((until, idx, generation)));
        true
    }

    /// Clears the pins that ran out by `now`, so `pinned` counts live pins
    /// only and the heap does not outgrow the pins set within one lease.
    pub(super) fn expire_pins(&mut self, now: Instant) {
        while let Some(&Reverse((at, idx, generation))) = self.pins.peek() {
            if at > now {
                break;
            }
            self.pins.pop();
            let node = &mut self.nodes[idx as usize];
            if node.generation != generation {
                continue;
            }
            // A later `at` means the pin was extended; its own item is still
            // in the heap.
            if let Some(entry) = node.entry.as_mut().filter(|e| e.pin_until == Some(at)) {
                entry.pin_until = None;
                self.pinned -= 1;
                if let Some(a) = &entry.account {
                    a.pin(None, Some(entry.block.len() as u64));
                }
            }
        }
    }

    /// Takes the entry out of the table and frees its slot; the entry must
    /// already be off the policy's queues.
    fn free_slot(&mut self, idx: u32) -> Option<Entry> {
        let node = &mut self.nodes[idx as usize];
        let entry = node.entry.take()?;
        node.generation = node.generation.wrapping_add(1);
        node.prev = NIL;
        node.next = NIL;
        if let Ok(found) = self.table.find_entry(entry.hash, |&i| i == idx) {
            found.remove();
        }
        self.free.push(idx);
        self.bytes -= entry.block.len() as u64;
        if entry.pin_until.is_some() {
            self.pinned -= 1;
        }
        if let Some(a) = &entry.account {
            a.charge(None, Some(entry.block.len() as u64));
            if entry.pin_until.is_some() {
                a.pin(None, Some(entry.block.len() as u64));
            }
        }
        Some(entry)
    }

    pub(super) fn add_stats(&mut self, now: Instant, stats: &mut CacheStats) {
        self.expire_pins(now);
        stats.entries += self.table.len() as u64;
        stats.bytes_stored += self.bytes;
        stats.pinned += self.pinned;
        self.counters.add_to(stats);
    }
}
