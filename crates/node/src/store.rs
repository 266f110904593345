//! The node's store: the memory tier and, behind it, the optional second
//! tier, offered as one set of operations.
//!
//! The server speaks the protocol and asks the store; it never asks which
//! tier holds a key, or whether there is a second one (the architecture
//! test checks that `server/` names no tier type). What each operation
//! does with two tiers:
//!
//! - **put**: a checked block goes into the memory tier and, by the
//!   second tier's mode, to the store behind it ([`Store::put`]); with
//!   `write: through` the blocks of a PUT go to the store first and into
//!   memory only once it took them ([`Store::put_through`]).
//! - **get**: the memory tier first, then a read-through of the misses,
//!   verified and kept in the memory tier ([`Store::get`]).
//! - **exists** / **delete**: both tiers.
//! - **match-prefix**: the chain in the memory tier, then its rest read
//!   through and pinned like the first part.

use std::time::Duration;

use bytes::Bytes;
use kvplane_protocol::KvError;

use crate::cache::{BlockCache, CachedBlock, NewEntry};
use crate::memory::{Block, BlockMut};
use crate::tier::{SecondTier, TierSetup};

/// A block as a reader gets it. Its CRC-32C may not be computed yet (a
/// block put through shared memory without one): [`Found::checksummed`]
/// computes it in a pass of its own, a reader that copies the bytes anyway
/// may compute it on that copy and [`Found::record_crc`] it.
pub(crate) struct Found {
    pub(crate) block: Block,
}

impl Found {
    /// The bytes and their CRC-32C (computed now if it never was).
    pub(crate) fn checksummed(self) -> (Bytes, u32) {
        let crc = self.block.crc();
        (self.block.into_bytes(), crc)
    }

    /// Records the CRC-32C a reader computed from these very bytes.
    pub(crate) fn record_crc(&self, crc: u32) {
        self.block.set_crc(crc);
    }
}

impl From<CachedBlock> for Found {
    fn from(hit: CachedBlock) -> Found {
        Found { block: hit.block }
    }
}

/// A checked PUT block waiting for the store under `write: through`.
pub(crate) struct Staged {
    pub(crate) key: Bytes,
    pub(crate) block: Block,
    /// Its CRC-32C when known (else computed from the stored bytes when a
    /// reader first needs it).
    pub(crate) crc: Option<u32>,
}

/// The memory tier and the optional second tier behind it.
pub(crate) struct Store {
    cache: BlockCache,
    tier: Option<SecondTier>,
}

impl Store {
    /// The memory tier `cache`, and the second tier `setup` declares (its
    /// writers and prober start here: needs a Tokio runtime).
    pub(crate) fn start(cache: BlockCache, setup: Option<TierSetup>) -> Store {
        let tier = setup.map(|t| SecondTier::start(t, cache.pool().capacity_bytes()));
        Store { cache, tier }
    }

    /// The memory tier (for what is about the memory tier alone: its
    /// counters, RDMA leases on its blocks, a cluster hand-off or repair).
    pub(crate) fn cache(&self) -> &BlockCache {
        &self.cache
    }

    /// The second tier's series in `/metrics` (none without one); `cache`:
    /// the memory tier's counters, read once for the whole scrape.
    pub(crate) fn encode_metrics(
        &self,
        e: &mut prometheus_client::encoding::DescriptorEncoder,
        cache: &crate::cache::CacheStats,
    ) -> std::fmt::Result {
        self.tier.as_ref().map_or(Ok(()), |t| t.encode_metrics(e, cache))
    }

    /// The largest block the memory tier holds.
    pub(crate) fn max_block_bytes(&self) -> usize {
        self.cache.pool().max_block_bytes()
    }

    /// A pool block for a PUT of `len` bytes (in `on-evict` mode what the
    /// allocation evicts is queued for the second tier first).
    pub(crate) async fn allocate(&self, len: usize) -> Result<BlockMut, KvError> {
        match &self.tier {
            Some(tier) => tier.allocate(&self.cache, len).await,
            None => self.cache.allocate(len),
        }
    }

    /// Pool blocks for `lens`, appended to `out` in order, taken together
    /// while the pool has room and nothing needs evicting: how many were
    /// appended (see [`MemoryPool::try_allocate_many`](crate::memory::MemoryPool::try_allocate_many)).
    /// The caller allocates the rest one at a time ([`Store::allocate`]).
    /// None with a second tier: it sees every allocation (the block sizes
    /// it expects, what `on-evict` mode takes from an eviction).
    pub(crate) fn try_allocate_many(&self, lens: &[usize], out: &mut Vec<BlockMut>) -> usize {
        if self.tier.is_some() {
            return 0;
        }
        self.cache.pool().try_allocate_many(lens, out)
    }

    /// [`Store::put`] of every entry; without a second tier the memory
    /// tier takes them as one batch ([`BlockCache::insert_many`]).
    pub(crate) async fn put_many(&self, entries: Vec<NewEntry>) {
        if self.tier.is_some() {
            for e in entries {
                self.put(e.key, e.block, e.crc).await;
            }
            return;
        }
        self.cache.insert_many(entries);
    }

    /// Whether a PUT's blocks go through [`Store::put_through`] (answered
    /// once the store holds them) rather than [`Store::put`].
    pub(crate) fn writes_through(&self) -> bool {
        self.tier.as_ref().is_some_and(SecondTier::writes_through)
    }

    /// Makes a checked block visible under `key`, and offers it to the
    /// second tier by its mode. Keys are copied by the caller out of the
    /// frame's meta: a stored slice would keep the whole frame alive.
    pub(crate) async fn put(&self, key: Bytes, block: Block, crc: Option<u32>) {
        if let Some(tier) = &self.tier {
            // Known before the copy is queued: its trailer takes it as is.
            if let Some(crc) = crc {
                block.set_crc(crc);
            }
            tier.stored(&key, &block).await;
        }
        self.insert(key, block, crc);
    }

    /// Write-through: `staged` goes to the store, then into memory what it
    /// took. Per block: stored, or the store's error (the block is then not
    /// kept in memory either).
    pub(crate) async fn put_through(&self, staged: Vec<Staged>) -> Vec<Result<(), KvError>> {
        let Some(tier) = self.tier.as_ref().filter(|_| !staged.is_empty()) else {
            return staged.into_iter().map(|s| self.insert(s.key, s.block, s.crc)).map(Ok).collect();
        };
        for s in &staged {
            if let Some(crc) = s.crc {
                s.block.set_crc(crc);
            }
        }
        let entries: Vec<(Bytes, Block)> = staged.iter().map(|s| (s.key.clone(), s.block.clone())).collect();
        let written = tier.write_through(&entries).await;
        staged
            .into_iter()
            .zip(written)
            .map(|(s, w)| {
                w?;
                self.insert(s.key, s.block, s.crc);
                Ok(())
            })
            .collect()
    }

    fn insert(&self, key: Bytes, block: Block, crc: Option<u32>) {
        match crc {
            Some(crc) => self.cache.insert(key, block, crc),
            None => self.cache.insert_unchecked(key, block),
        }
    }

    /// Each key from the memory tier, else read through the second tier
    /// (verified, and kept in the memory tier). `Ok(None)`: a miss.
    ///
    /// The caller reads every found block's bytes next, one block after
    /// another (the kernel's copy into a socket, or a copy into shared
    /// memory): their first lines are asked for here, all at once (see
    /// `Block::prefetch_bytes`).
    pub(crate) async fn get(&self, keys: &[Bytes]) -> Vec<Result<Option<Found>, KvError>> {
        let mut results = Vec::with_capacity(keys.len());
        let mut missing = Vec::new();
        for (i, (k, hit)) in keys.iter().zip(self.cache.get_many(keys)).enumerate() {
            match hit {
                Some(hit) => {
                    if let Some(tier) = &self.tier {
                        tier.read_hit(k, &hit).await;
                    }
                    results.push(Ok(Some(Found::from(hit))));
                }
                None => {
                    missing.push(i);
                    results.push(Ok(None));
                }
            }
        }
        if let (Some(tier), false) = (&self.tier, missing.is_empty()) {
            let wanted: Vec<&[u8]> = missing.iter().map(|&i| keys[i].as_ref()).collect();
            for (i, r) in missing.iter().zip(tier.read_through(&self.cache, &wanted).await) {
                results[*i] = r.map(|found| found.map(Found::from));
            }
        }
        for found in results.iter().flatten().flatten() {
            found.block.prefetch_bytes();
        }
        results
    }

    /// Whether each key is in either tier (or queued for the second).
    pub(crate) async fn exists(&self, keys: &[Bytes]) -> Vec<Result<bool, KvError>> {
        let mut results: Vec<Result<bool, KvError>> = keys.iter().map(|k| Ok(self.cache.contains(k))).collect();
        if let Some(tier) = &self.tier {
            let missing: Vec<usize> = (0..keys.len()).filter(|&i| matches!(results[i], Ok(false))).collect();
            if !missing.is_empty() {
                let found = tier.exists(missing.iter().map(|&i| keys[i].to_vec()).collect()).await;
                for (i, r) in missing.into_iter().zip(found) {
                    results[i] = r;
                }
            }
        }
        results
    }

    /// Removes each key from both tiers; `true` where either held it.
    pub(crate) async fn delete(&self, keys: &[Bytes]) -> Vec<Result<bool, KvError>> {
        let mut results: Vec<Result<bool, KvError>> = keys.iter().map(|k| Ok(self.cache.remove(k))).collect();
        if let Some(tier) = &self.tier {
            for (slot, removed) in results.iter_mut().zip(tier.delete(keys).await) {
                *slot = match (&*slot, removed) {
                    (_, Err(e)) => Err(e),
                    (Ok(true), _) | (_, Ok(true)) => Ok(true),
                    _ => Ok(false),
                };
            }
        }
        results
    }

    /// How many leading keys of the chain are held, pinning them for
    /// `lease`: the memory tier's part, then the rest read through the
    /// second tier and pinned like it. A block evicted again before its pin
    /// just ends the match there.
    pub(crate) async fn match_prefix(&self, keys: &[Bytes], lease: Option<Duration>) -> usize {
        let mut matched = self.cache.match_prefix(keys, lease);
        if let (Some(tier), true) = (&self.tier, matched < keys.len()) {
            let rest: Vec<&[u8]> = keys[matched..].iter().map(|k| k.as_ref()).collect();
            let fetched = tier.read_through(&self.cache, &rest).await;
            let contiguous = fetched.iter().take_while(|r| matches!(r, Ok(Some(_)))).count();
            drop(fetched);
            matched += self.cache.match_prefix(&keys[matched..matched + contiguous], lease);
        }
        matched
    }

    /// Whether the node may take traffic as far as its store goes.
    pub(crate) fn ready(&self) -> Result<(), String> {
        self.tier.as_ref().map_or(Ok(()), SecondTier::ready)
    }

    /// The second tier's counters (none without one).
    pub(crate) fn stats(&self) -> Vec<(String, u64)> {
        self.tier.as_ref().map(SecondTier::stats).unwrap_or_default()
    }

    /// Lets the second tier write what is queued, up to `deadline`; false
    /// when the deadline passed first (logged with what was left).
    pub(crate) async fn drain(&self, deadline: Duration) -> bool {
        let Some(tier) = &self.tier else { return true };
        let drained = tier.drain(deadline).await;
        if !drained {
            tracing::warn!(
                ?deadline,
                bytes = tier.in_flight_bytes(),
                "drain deadline passed; blocks queued for the second tier are not written"
            );
        }
        drained
    }
}
