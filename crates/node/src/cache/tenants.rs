//! Per-tenant accounting: what each tenant's blocks hold of the memory
//! tier, kept exact by the shards themselves.
//!
//! A block is charged the pool memory it takes — its size class (a power
//! of two, at least the pool's smallest class), not the bytes it carries:
//! a 1-byte block holds a 4 KiB block of the pool, and a tenant charged
//! one byte for it could hold 4096 times its quota in 1-byte blocks and
//! evict every other tenant's (`TenantAccount::held_by`).
//!
//! A key belongs to the tenant its tag names (see `crate::tenants`: every
//! key a tenant stores starts with its tag). Each entry holds its
//! tenant's [`TenantAccount`], looked up once when the key is first
//! stored; the shard charges the account as the entry's bytes come and go
//! (insert, replacement, removal, eviction) and as its pin is set, extended
//! over a replacement, or runs out. Those charges are atomic adds made under
//! the shard lock the operation holds anyway, so an account is exact
//! whichever path stored the block: a client's PUT, a read-through from the
//! second tier, or a copy from another cluster member.
//!
//! Eviction asks [`TenantAccounts::any_over_quota`] (one atomic load) and,
//! while some tenant holds more than its `memoryBytes`, takes from such
//! tenants first. A tenant gets there although its PUTs are refused at the
//! quota: through read-throughs and cluster copies (which are not refused:
//! they bring back what it stored), concurrent PUTs that each fit, or a
//! reload that lowered its quota.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// A quota of "none".
pub const UNLIMITED: u64 = u64::MAX;

/// After an over-quota eviction pass found nothing to evict (every block
/// of the tenants over their quota pinned or being read), how long
/// eviction keeps to the policy's order alone before such a pass looks
/// again. A pass that finds nothing has walked every entry of every shard:
/// repeated for every eviction, a tenant that got over its quota (a
/// read-through, a lowered quota) and pinned its blocks would make each
/// PUT on the node cost a walk of the whole cache. Counted in
/// `kvplane_tenants_fruitless_eviction_passes`.
pub const OVER_QUOTA_RETRY: Duration = Duration::from_millis(50);

/// One tenant's share of the cache and its counters. Shared (an `Arc`) by
/// the tenant's entries, its connections and `/metrics`; it outlives a
/// reload (the same name keeps the same account) and the tenant's removal
/// from the file (its blocks still count until they leave).
#[derive(Debug)]
pub struct TenantAccount {
    name: String,
    memory_quota: AtomicU64,
    pinned_quota: AtomicU64,
    bytes: AtomicU64,
    pinned: AtomicU64,
    /// Whether `bytes` was above `memory_quota` at the last change; its
    /// transitions keep [`TenantAccounts::over`] counting such accounts.
    over: AtomicBool,
    over_count: Arc<AtomicUsize>,
    /// The pool's smallest size class (see [`TenantAccount::held_by`]).
    min_block: Arc<AtomicU64>,
    /// Bytes the tenant's PUTs in flight were let in with and have not
    /// been answered yet (see [`TenantAccount::reserve`]).
    reserved: AtomicU64,
    /// GET and GET_SHM keys found / not found, counted by the tenant's
    /// connections.
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    /// The tenant's entries evicted to make room.
    pub evictions: AtomicU64,
    /// Requests refused for the tenant's quotas: `memoryBytes`,
    /// `pinnedBytes`, `maxConnections`.
    pub refused_memory: AtomicU64,
    pub refused_pinned: AtomicU64,
    pub refused_connections: AtomicU64,
}

impl TenantAccount {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Bytes of the memory tier the tenant's blocks hold now.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Bytes of the tenant's blocks under an unexpired pin.
    pub fn pinned_bytes(&self) -> u64 {
        self.pinned.load(Ordering::Relaxed)
    }

    pub fn memory_quota(&self) -> u64 {
        self.memory_quota.load(Ordering::Relaxed)
    }

    pub fn pinned_quota(&self) -> u64 {
        self.pinned_quota.load(Ordering::Relaxed)
    }

    /// Bytes reserved by the tenant's PUTs in flight.
    pub fn reserved(&self) -> u64 {
        self.reserved.load(Ordering::Relaxed)
    }

    /// Reserves `bytes` for a PUT if what the tenant holds, what its other
    /// PUTs in flight reserved and `bytes` stay within `quota`. Reserved
    /// first and checked after, so two PUTs racing on two connections
    /// cannot both pass by counting without the other: each PUT checked
    /// against what is stored alone let 16 connections of a 1 MiB tenant
    /// store 8 MiB at once. A PUT racing another may be refused where it
    /// would just have fitted, never let in past the quota. Released by
    /// [`TenantAccount::release`] once the PUT is answered (its blocks are
    /// then counted in [`TenantAccount::bytes`]).
    /// `quota` is the tenant's, plus what the blocks the PUT replaces
    /// free (the PUT still reserves all it brings: see `Tenant::fits`).
    pub fn reserve(&self, bytes: u64, quota: u64) -> bool {
        let before = self.reserved.fetch_add(bytes, Ordering::Relaxed);
        if self.bytes().saturating_add(before).saturating_add(bytes) <= quota {
            return true;
        }
        self.reserved.fetch_sub(bytes, Ordering::Relaxed);
        false
    }

    /// Gives back what [`TenantAccount::reserve`] took.
    pub fn release(&self, bytes: u64) {
        if bytes > 0 {
            self.reserved.fetch_sub(bytes, Ordering::Relaxed);
        }
    }

    /// Sets both quotas ([`UNLIMITED`]: none), as a reload does.
    pub fn set_quotas(&self, memory: u64, pinned: u64) {
        self.memory_quota.store(memory, Ordering::Relaxed);
        self.pinned_quota.store(pinned, Ordering::Relaxed);
        self.settle();
    }

    /// Whether the tenant holds more than its memory quota (as of the last
    /// change of either).
    pub fn over_quota(&self) -> bool {
        self.over.load(Ordering::Relaxed)
    }

    /// The pool memory a block of `len` bytes takes, which is what the
    /// tenant is charged for it: the size class the pool carves it from
    /// (the next power of two, at least the smallest class; see
    /// `memory::MemoryPool`).
    pub fn held_by(&self, len: u64) -> u64 {
        len.max(1).checked_next_power_of_two().unwrap_or(u64::MAX).max(self.min_block.load(Ordering::Relaxed))
    }

    /// Charges a block of `add_len` bytes stored and one of `sub_len` gone
    /// (block lengths, charged by [`TenantAccount::held_by`]; `None`: no
    /// block, since a block of 0 bytes still takes a block of the pool).
    pub(super) fn charge(&self, add_len: Option<u64>, sub_len: Option<u64>) {
        let (add, sub) = (self.class_of(add_len), self.class_of(sub_len));
        if add == sub {
            return;
        }
        if add > sub {
            self.bytes.fetch_add(add - sub, Ordering::Relaxed);
        } else {
            self.bytes.fetch_sub(sub - add, Ordering::Relaxed);
        }
        self.settle();
    }

    /// Pins a block of `len` bytes if the tenant's pinned bytes stay
    /// within its `pinnedBytes`; a block that would pass it is refused
    /// (counted in `refused_pinned`) and the MATCH_PREFIX whose lease
    /// asked for it matches up to the block before. The server cuts a
    /// lease's keys to what fits before it reaches the cache (see
    /// `Tenant::may_pin`); this is exact for what that could not know:
    /// blocks read through from the second tier, leases racing on other
    /// connections.
    pub(super) fn try_pin(&self, len: u64) -> bool {
        let held = self.held_by(len);
        if self.pinned_bytes().saturating_add(held) > self.pinned_quota() {
            self.refused_pinned.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        self.pinned.fetch_add(held, Ordering::Relaxed);
        true
    }

    /// As [`TenantAccount::charge`], for the pinned bytes.
    pub(super) fn pin(&self, add_len: Option<u64>, sub_len: Option<u64>) {
        let (add, sub) = (self.class_of(add_len), self.class_of(sub_len));
        if add >= sub {
            self.pinned.fetch_add(add - sub, Ordering::Relaxed);
        } else {
            self.pinned.fetch_sub(sub - add, Ordering::Relaxed);
        }
    }

    /// [`TenantAccount::held_by`], with 0 for no block.
    fn class_of(&self, len: Option<u64>) -> u64 {
        len.map_or(0, |len| self.held_by(len))
    }

    /// Brings `over` (and the count of accounts over quota) in line with
    /// the bytes and the quota. Two changes racing may leave `over` one
    /// change stale; the count always agrees with the flags, and the next
    /// change corrects both.
    fn settle(&self) {
        let now = self.bytes() > self.memory_quota();
        if self.over.swap(now, Ordering::Relaxed) != now {
            if now {
                self.over_count.fetch_add(1, Ordering::Relaxed);
            } else {
                self.over_count.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

/// The accounts of every tenant this node has seen, by tag (the bytes a
/// tenant's keys start with). Given to the cache by [`CacheConfig::tenants`]
/// when the node has a tenants file.
///
/// [`CacheConfig::tenants`]: super::CacheConfig::tenants
#[derive(Debug, Default)]
pub struct TenantAccounts {
    by_tag: RwLock<HashMap<Box<[u8]>, Arc<TenantAccount>>>,
    over: Arc<AtomicUsize>,
    /// The pool's smallest size class, set by the cache built on them
    /// ([`TenantAccounts::set_min_block`]); every account shares it.
    min_block: Arc<AtomicU64>,
    /// When (the cache's clock, nanoseconds from its start, plus 1; 0:
    /// never) an over-quota pass last found nothing (see
    /// [`OVER_QUOTA_RETRY`]).
    fruitless_at: AtomicU64,
    /// Over-quota eviction passes that found nothing to evict.
    pub fruitless_passes: AtomicU64,
}

impl TenantAccounts {
    /// The account of tenant `name` (whose tag is `tag`), made with no
    /// quota when new.
    pub fn account(&self, tag: &[u8], name: &str) -> Arc<TenantAccount> {
        if let Some(a) = self.by_tag.read().unwrap_or_else(|e| e.into_inner()).get(tag) {
            return Arc::clone(a);
        }
        let mut map = self.by_tag.write().unwrap_or_else(|e| e.into_inner());
        Arc::clone(map.entry(tag.into()).or_insert_with(|| {
            Arc::new(TenantAccount {
                name: name.to_string(),
                memory_quota: AtomicU64::new(UNLIMITED),
                pinned_quota: AtomicU64::new(UNLIMITED),
                bytes: AtomicU64::new(0),
                pinned: AtomicU64::new(0),
                over: AtomicBool::new(false),
                over_count: Arc::clone(&self.over),
                min_block: Arc::clone(&self.min_block),
                reserved: AtomicU64::new(0),
                hits: AtomicU64::new(0),
                misses: AtomicU64::new(0),
                evictions: AtomicU64::new(0),
                refused_memory: AtomicU64::new(0),
                refused_pinned: AtomicU64::new(0),
                refused_connections: AtomicU64::new(0),
            })
        }))
    }

    /// The account a stored `key` is charged to: its tag's. A key with no
    /// valid tag (only the cluster role can store one) is charged to none.
    /// A tag of a tenant this node does not know (a member whose tenants
    /// file lists more) gets an account with no quota.
    pub fn account_of(&self, key: &[u8]) -> Option<Arc<TenantAccount>> {
        let (tag, name) = crate::tenants::tag_of(key)?;
        if let Some(a) = self.by_tag.read().unwrap_or_else(|e| e.into_inner()).get(tag) {
            return Some(Arc::clone(a));
        }
        Some(self.account(tag, name))
    }

    /// Sets the pool's smallest size class, which every block takes at
    /// least: the cache does, when built on these accounts and its pool,
    /// before anything is stored.
    pub fn set_min_block(&self, bytes: u64) {
        self.min_block.store(bytes, Ordering::Relaxed);
    }

    /// Whether some tenant holds more than its memory quota: one load, so
    /// eviction asks it every time.
    pub fn any_over_quota(&self) -> bool {
        self.over.load(Ordering::Relaxed) > 0
    }

    /// Whether eviction should look among the blocks of tenants over their
    /// quota at `now` (nanoseconds of the cache's clock): not within
    /// [`OVER_QUOTA_RETRY`] of a look that found nothing.
    pub(super) fn over_quota_pass_due(&self, now: u64) -> bool {
        match self.fruitless_at.load(Ordering::Relaxed) {
            0 => true,
            at => now.saturating_sub(at - 1) >= OVER_QUOTA_RETRY.as_nanos() as u64,
        }
    }

    /// Records an over-quota pass at `now` that found nothing to evict.
    pub(super) fn over_quota_pass_fruitless(&self, now: u64) {
        self.fruitless_at.store(now.saturating_add(1), Ordering::Relaxed);
        self.fruitless_passes.fetch_add(1, Ordering::Relaxed);
    }

    /// Every account, in name order (for `/metrics`).
    pub fn all(&self) -> Vec<Arc<TenantAccount>> {
        let mut all: Vec<_> = self.by_tag.read().unwrap_or_else(|e| e.into_inner()).values().cloned().collect();
        all.sort_by(|a, b| a.name.cmp(&b.name));
        all
    }
}
