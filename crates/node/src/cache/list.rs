//! Intrusive doubly linked lists threaded through the shard's slot array.
//!
//! Both policies move entries between queues all the time (LRU on every hit,
//! S3-FIFO on every eviction step). Keeping the links in the slot itself makes
//! each move O(1) without allocating, and lets a removed entry be unlinked
//! on the spot, so no stale queue item is left behind to be mistaken for a
//! live entry later. A replaced entry stays linked (LRU then moves it to the
//! recent end); only its list's byte count follows its new size.

use super::shard::Node;

/// Marks the end of a list (and a slot that is on no list).
pub(super) const NIL: u32 = u32::MAX;

/// One queue: head is the oldest (next to evict), tail the newest.
#[derive(Debug)]
pub(super) struct List {
    head: u32,
    tail: u32,
    len: usize,
    /// Bytes of the entries on the list, so S3-FIFO can size its small queue
    /// by memory rather than by entry count.
    bytes: u64,
}

impl List {
    pub(super) const fn new() -> Self {
        List { head: NIL, tail: NIL, len: 0, bytes: 0 }
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn bytes(&self) -> u64 {
        self.bytes
    }

    pub(super) fn front(&self) -> Option<u32> {
        (self.head != NIL).then_some(self.head)
    }

    /// Appends `idx`, which must be on no list. Its size is read now (a
    /// replacement in place tells the list with `resized`).
    pub(super) fn push_back(&mut self, nodes: &mut [Node], idx: u32) {
        let tail = self.tail;
        let node = &mut nodes[idx as usize];
        node.prev = tail;
        node.next = NIL;
        let size = node.size();
        if tail == NIL {
            self.head = idx;
        } else {
            nodes[tail as usize].next = idx;
        }
        self.tail = idx;
        self.len += 1;
        self.bytes += size;
    }

    /// An entry on this list now holds `new_len` bytes instead of
    /// `old_len`, in place.
    pub(super) fn resized(&mut self, old_len: u64, new_len: u64) {
        self.bytes = self.bytes - old_len + new_len;
    }

    /// Removes `idx`, which must be on this list.
    pub(super) fn unlink(&mut self, nodes: &mut [Node], idx: u32) {
        let node = &mut nodes[idx as usize];
        let (prev, next, size) = (node.prev, node.next, node.size());
        node.prev = NIL;
        node.next = NIL;
        if prev == NIL {
            self.head = next;
        } else {
            nodes[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            nodes[next as usize].prev = prev;
        }
        self.len -= 1;
        self.bytes -= size;
    }

    pub(super) fn move_to_back(&mut self, nodes: &mut [Node], idx: u32) {
        if self.tail != idx {
            self.unlink(nodes, idx);
            self.push_back(nodes, idx);
        }
    }
}
