//! Least-recently-used order: one recency list per shard.

use super::list::List;
use super::shard::{Entry, Node};

pub(super) struct Lru {
    /// Head is the least recently used entry.
    order: List,
}

impl Lru {
    pub(super) fn new() -> Self {
        Lru { order: List::new() }
    }

    pub(super) fn insert(&mut self, nodes: &mut [Node], idx: u32) {
        self.order.push_back(nodes, idx);
    }

    pub(super) fn touch(&mut self, nodes: &mut [Node], idx: u32) {
        self.order.move_to_back(nodes, idx);
    }

    pub(super) fn unlink(&mut self, nodes: &mut [Node], idx: u32) {
        self.order.unlink(nodes, idx);
    }

    /// A replacement is a use: the entry goes to the recent end.
    pub(super) fn replaced(&mut self, nodes: &mut [Node], idx: u32, old_len: u64, new_len: u64) {
        self.order.resized(old_len, new_len);
        self.order.move_to_back(nodes, idx);
    }

    /// An entry that cannot go now (pinned or being read) is moved to the
    /// recent end: it is about to be read, and leaving it at the head would
    /// make every later eviction walk past it again.
    pub(super) fn victim(&mut self, nodes: &mut [Node], mut evictable: impl FnMut(&Entry) -> bool) -> Option<u32> {
        let mut skipped = 0;
        while skipped < self.order.len() {
            let idx = self.order.front()?;
            if nodes[idx as usize].entry.as_ref().is_some_and(&mut evictable) {
                self.order.unlink(nodes, idx);
                return Some(idx);
            }
            self.order.move_to_back(nodes, idx);
            skipped += 1;
        }
        None
    }
}
