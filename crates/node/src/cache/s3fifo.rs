//! S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction",
//! SOSP'23), per shard.
//!
//! Most blocks are read once or never (a conversation abandoned after one
//! turn, a prompt suffix nobody shares). A small probationary FIFO lets those
//! one-hit wonders leave quickly, before they push out the re-read prefixes
//! living in the main FIFO; a ghost FIFO of recently evicted key hashes sends
//! a key that comes back soon straight to main, since its first stay was too
//! short to prove it. Hits, and rewrites of a stored key, only bump a 2-bit
//! counter — no list move — which is what keeps a hit cheaper than LRU's.

use std::collections::VecDeque;

use hashbrown::HashTable;

use super::list::List;
use super::shard::{Entry, Node};

/// Share of the shard's bytes the small queue may hold before eviction takes
/// from it (the paper's 10%).
const SMALL_PERCENT: u64 = 10;
/// Counter ceiling: 2 bits, so a burst of reads buys at most three extra
/// trips round the main queue.
const MAX_FREQ: u8 = 3;
/// Ghost capacity floor, so a shard that is still small keeps some history.
const MIN_GHOST: usize = 64;

pub(super) struct S3Fifo {
    small: List,
    main: List,
    ghost: Ghost,
}

impl S3Fifo {
    pub(super) fn new() -> Self {
        S3Fifo { small: List::new(), main: List::new(), ghost: Ghost::new() }
    }

    pub(super) fn insert(&mut self, nodes: &mut [Node], idx: u32) {
        let Some(entry) = nodes[idx as usize].entry.as_mut() else {
            return;
        };
        entry.freq = 0;
        entry.in_main = self.ghost.take(entry.hash);
        if entry.in_main {
            self.main.push_back(nodes, idx);
        } else {
            self.small.push_back(nodes, idx);
        }
    }

    pub(super) fn touch(&mut self, nodes: &mut [Node], idx: u32) {
        if let Some(entry) = nodes[idx as usize].entry.as_mut() {
            entry.freq = (entry.freq + 1).min(MAX_FREQ);
        }
    }

    pub(super) fn unlink(&mut self, nodes: &mut [Node], idx: u32) {
        if nodes[idx as usize].entry.as_ref().is_some_and(|e| e.in_main) {
            self.main.unlink(nodes, idx);
        } else {
            self.small.unlink(nodes, idx);
        }
    }

    /// A replaced value keeps its place in its queue and counts as an
    /// access, as a hit does. In a KV cache a key names its tokens, so a
    /// rewrite is the same data computed again: a use of the key, and
    /// S3-FIFO moves nothing on a use. (Moving it to the tail, as before,
    /// wrote three other slots a replacement: its two neighbours and the
    /// tail.) Only the queue's byte count follows the new size.
    pub(super) fn replaced(&mut self, nodes: &mut [Node], idx: u32, old_len: u64, new_len: u64) {
        self.touch(nodes, idx);
        let in_main = nodes[idx as usize].entry.as_ref().is_some_and(|e| e.in_main);
        let queue = if in_main { &mut self.main } else { &mut self.small };
        queue.resized(old_len, new_len);
    }

    /// The paper's eviction loop, driven by bytes. Entries `evictable`
    /// refuses (pinned, being read) are rotated to the tail of their queue
    /// without touching their counter; a queue is given up once a whole pass
    /// over it found only such entries, which bounds the work at a few passes
    /// over the shard (each main entry can be decremented at most
    /// `MAX_FREQ` times, each small entry promoted once).
    pub(super) fn victim(&mut self, nodes: &mut [Node], mut evictable: impl FnMut(&Entry) -> bool) -> Option<u32> {
        let mut small_skipped = 0;
        let mut main_skipped = 0;
        loop {
            let small_left = small_skipped < self.small.len();
            let main_left = main_skipped < self.main.len();
            let total = self.small.bytes() + self.main.bytes();
            let small_over = self.small.bytes() * 100 >= total * SMALL_PERCENT;
            if small_left && (small_over || !main_left) {
                let idx = self.small.front()?;
                let entry = nodes[idx as usize].entry.as_mut()?;
                if !evictable(entry) {
                    self.small.move_to_back(nodes, idx);
                    small_skipped += 1;
                } else if entry.freq >= 1 {
                    entry.in_main = true;
                    self.small.unlink(nodes, idx);
                    self.main.push_back(nodes, idx);
                } else {
                    let hash = entry.hash;
                    self.small.unlink(nodes, idx);
                    let cap = (self.small.len() + self.main.len()).max(MIN_GHOST);
                    self.ghost.push(hash, cap);
                    return Some(idx);
                }
            } else if main_left {
                let idx = self.main.front()?;
                let entry = nodes[idx as usize].entry.as_mut()?;
                if !evictable(entry) {
                    self.main.move_to_back(nodes, idx);
                    main_skipped += 1;
                } else if entry.freq > 0 {
                    entry.freq -= 1;
                    self.main.move_to_back(nodes, idx);
                    // Progress: the pass that gives up on main must see only
                    // unevictable entries, not ones still spending credit.
                    main_skipped = 0;
                } else {
                    self.main.unlink(nodes, idx);
                    return Some(idx);
                }
            } else {
                return None;
            }
        }
    }
}

/// Hashes of keys recently evicted from the small queue, oldest first.
///
/// A FIFO plus a set: the FIFO bounds the memory and sets the order, the set
/// answers membership. A hash taken out by a re-insert leaves its FIFO item
/// behind; the sequence number tells that stale item from a later push of the
/// same hash, so expiring it cannot drop the newer one.
struct Ghost {
    order: VecDeque<(u64, u64)>,
    /// (hash, sequence of its latest push); keyed by the hash itself, which
    /// is already a good hash.
    live: HashTable<(u64, u64)>,
    seq: u64,
}

impl Ghost {
    fn new() -> Self {
        Ghost { order: VecDeque::new(), live: HashTable::new(), seq: 0 }
    }

    /// `cap` follows the shard's entry count (about the main queue's size in
    /// steady state, as in the paper), so the ghost remembers roughly one
    /// cache-worth of departures.
    fn push(&mut self, hash: u64, cap: usize) {
        self.seq += 1;
        let seq = self.seq;
        match self.live.find_mut(hash, |&(h, _)| h == hash) {
            Some(item) => item.1 = seq,
            None => {
                self.live.insert_unique(hash, (hash, seq), |&(h, _)| h);
            }
        }
        self.order.push_back((hash, seq));
        while self.order.len() > cap {
            let Some((old, old_seq)) = self.order.pop_front() else {
                break;
            };
            if let Ok(item) = self.live.find_entry(old, |&(h, s)| h == old && s == old_seq) {
                item.remove();
            }
        }
    }

    /// Whether `hash` was evicted recently; forgets it either way, so a key
    /// earns one express admission per eviction.
    fn take(&mut self, hash: u64) -> bool {
        match self.live.find_entry(hash, |&(h, _)| h == hash) {
            Ok(item) => {
                item.remove();
                true
            }
            Err(_) => false,
        }
    }
}
