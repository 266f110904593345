//! Which entry goes first under memory pressure: the public choice and the
//! per-shard dispatch to its implementation.

use std::fmt;
use std::str::FromStr;

use super::lru::Lru;
use super::s3fifo::S3Fifo;
use super::shard::{Entry, Node};

/// The eviction policy of a [`BlockCache`](super::BlockCache).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EvictionPolicy {
    /// S3-FIFO (Yang et al., SOSP'23). The default because KV prefixes are
    /// dominated by one-hit blocks (abandoned conversations, unique
    /// suffixes) that LRU lets flush the shared, re-read prefixes.
    #[default]
    S3Fifo,
    /// Least recently used; kept as the baseline to compare against.
    Lru,
}

impl EvictionPolicy {
    /// The names accepted by `FromStr`, as shown in errors and `--help`.
    pub const NAMES: [&'static str; 2] = ["s3-fifo", "lru"];

    pub fn name(self) -> &'static str {
        match self {
            EvictionPolicy::S3Fifo => "s3-fifo",
            EvictionPolicy::Lru => "lru",
        }
    }
}

impl fmt::Display for EvictionPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

/// An eviction policy name that is not one of [`EvictionPolicy::NAMES`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown eviction policy `{0}`: expected `s3-fifo` or `lru`")]
pub struct ParsePolicyError(pub String);

impl FromStr for EvictionPolicy {
    type Err = ParsePolicyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let name = s.trim();
        if name.eq_ignore_ascii_case("s3-fifo") {
            Ok(EvictionPolicy::S3Fifo)
        } else if name.eq_ignore_ascii_case("lru") {
            Ok(EvictionPolicy::Lru)
        } else {
            Err(ParsePolicyError(s.to_owned()))
        }
    }
}

/// A shard's policy state. An enum rather than a trait object: the choice is
/// made once per cache, and a match keeps every call inlinable on the hot
/// path of `get`.
pub(super) enum Policy {
    S3Fifo(S3Fifo),
    Lru(Lru),
}

impl Policy {
    pub(super) fn new(kind: EvictionPolicy) -> Self {
        match kind {
            EvictionPolicy::S3Fifo => Policy::S3Fifo(S3Fifo::new()),
            EvictionPolicy::Lru => Policy::Lru(Lru::new()),
        }
    }

    /// A new entry, already stored in `nodes[idx]`, joins the queues.
    pub(super) fn insert(&mut self, nodes: &mut [Node], idx: u32) {
        match self {
            Policy::S3Fifo(p) => p.insert(nodes, idx),
            Policy::Lru(p) => p.insert(nodes, idx),
        }
    }

    /// A read of the entry.
    pub(super) fn touch(&mut self, nodes: &mut [Node], idx: u32) {
        match self {
            Policy::S3Fifo(p) => p.touch(nodes, idx),
            Policy::Lru(p) => p.touch(nodes, idx),
        }
    }

    /// Takes the entry off the queues (a removal).
    pub(super) fn unlink(&mut self, nodes: &mut [Node], idx: u32) {
        match self {
            Policy::S3Fifo(p) => p.unlink(nodes, idx),
            Policy::Lru(p) => p.unlink(nodes, idx),
        }
    }

    /// The entry's block was replaced, one of `old_len` bytes by one of
    /// `new_len` (the slot holds the new one already); the new value counts
    /// as an access.
    pub(super) fn replaced(&mut self, nodes: &mut [Node], idx: u32, old_len: u64, new_len: u64) {
        match self {
            Policy::S3Fifo(p) => p.replaced(nodes, idx, old_len, new_len),
            Policy::Lru(p) => p.replaced(nodes, idx, old_len, new_len),
        }
    }

    /// Picks the next entry to evict among those `evictable` accepts and takes
    /// it off the queues; `None` when none is evictable. Entries refused by
    /// `evictable` stay cached. Work is bounded by a few passes over the
    /// shard, so a shard full of pinned entries answers quickly.
    pub(super) fn victim(&mut self, nodes: &mut [Node], evictable: impl FnMut(&Entry) -> bool) -> Option<u32> {
        match self {
            Policy::S3Fifo(p) => p.victim(nodes, evictable),
            Policy::Lru(p) => p.victim(nodes, evictable),
        }
    }
}
