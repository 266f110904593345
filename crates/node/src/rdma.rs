//! The node's side of RDMA: whether it offers one-sided READs of its pool,
//! the queue pair of each connection that asked, and the leases that keep a
//! described block in place while a remote reader may READ it.
//!
//! Why leases hold the block itself: a READ runs on the node's NIC without
//! the node's knowledge, so from the moment a descriptor leaves until its
//! lease ends, the block's memory must neither be evicted nor handed to
//! another block. The lease table holds a [`Block`] handle (a counted
//! reference): the pool takes the memory back only after the last handle
//! drops, and eviction skips blocks someone holds. The key is pinned as by
//! MATCH_PREFIX too, so the cache's `pinned` count shows it and eviction
//! leaves the entry alone even once the reader is done with its copy.
//!
//! Why one clock: lease times are Unix-epoch milliseconds (a remote reader
//! compares them with its own wall clock), derived from the cache's
//! injected [`Clock`] plus the wall time at start, so a test that advances
//! a `ManualClock` expires both the pin and the lease. `kvplane-rdma` itself
//! reads no clock.
//!
//! Without the `rdma` feature, or without a device at start, the node offers
//! no RDMA: the handshake never grants `RDMA`, and RDMA_CONNECT and
//! RDMA_DESCRIBE are answered `unsupported` with the reason.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use kvplane_protocol::{ErrorCode, Response};
use kvplane_rdma::{Lease, LeaseError, Leases};

use crate::cache::{BlockCache, Clock};
use crate::memory::Block;

/// Most leases a node holds at once; each pins one block (memory eviction
/// cannot reclaim), so a client that asks for descriptors and never reads
/// cannot pin the whole pool.
pub(crate) const MAX_LEASES: usize = 65_536;

/// Longest a sweep of ended leases waits.
pub(crate) const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// Unix-epoch milliseconds read off the cache's clock.
#[derive(Debug)]
pub(crate) struct WallClock {
    clock: Arc<dyn Clock>,
    at: Instant,
    unix_ms: u64,
}

impl WallClock {
    /// `clock`'s now is `unix_ms` on the wall clock.
    pub(crate) fn new(clock: Arc<dyn Clock>, unix_ms: u64) -> WallClock {
        let at = clock.now();
        WallClock { clock, at, unix_ms }
    }

    /// The real wall clock's milliseconds now.
    pub(crate) fn system_unix_ms() -> u64 {
        SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(1)
    }

    pub(crate) fn now_ms(&self) -> u64 {
        let elapsed = self.clock.now().saturating_duration_since(self.at);
        self.unix_ms.saturating_add(u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX))
    }
}

/// A block described under a lease (read by the verbs side only).
#[derive(Debug)]
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
pub(crate) struct Pinned {
    pub(crate) block: Block,
    pub(crate) crc: u32,
    pub(crate) lease: Lease,
}

/// The node's leases: which blocks stay in place for remote readers, until when.
pub(crate) struct LeaseTable {
    leases: Mutex<Leases<Block>>,
    clock: WallClock,
}

impl LeaseTable {
    pub(crate) fn new(capacity: usize, clock: WallClock) -> LeaseTable {
        // Ids start past any a previous run of this node handed out (its
        // start time in ms, times 1000 for the grants within a millisecond),
        // so an old descriptor is never taken for a lease of this run.
        let first = clock.now_ms().saturating_mul(1000).max(1);
        LeaseTable { leases: Mutex::new(Leases::starting_at(capacity, first)), clock }
    }

    fn lock(&self) -> MutexGuard<'_, Leases<Block>> {
        // A panic under this lock left the table consistent (HashMap ops).
        self.leases.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Pins `key`'s block for `ttl`: a hit as a GET counts one, the key
    /// pinned in the cache, the block held by a lease. `NotFound` when the
    /// memory tier does not hold the key, `Capacity` when every lease is taken.
    pub(crate) fn pin(&self, cache: &BlockCache, key: &[u8], ttl: Duration) -> Result<Pinned, ErrorCode> {
        let hit = cache.get(key).ok_or(ErrorCode::NotFound)?;
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
        let lease = {
            let mut leases = self.lock();
            leases.grant(&hit.block, self.clock.now_ms(), ttl_ms).map_err(|e| match e {
                LeaseError::Full { .. } => ErrorCode::Capacity,
                _ => ErrorCode::Internal,
            })?
        };
        cache.match_prefix(&[key], Some(ttl));
        let crc = hit.crc();
        Ok(Pinned { block: hit.block, crc, lease })
    }

    /// Lets go of every lease that has ended: their blocks may be evicted
    /// and their memory reused. How many.
    pub(crate) fn sweep(&self) -> usize {
        let now = self.clock.now_ms();
        self.lock().release_expired(now)
    }

    /// Leases held (ended ones until the next sweep).
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }

    /// How long until the next lease ends, capped at [`SWEEP_EVERY`].
    pub(crate) fn next_sweep_in(&self) -> Duration {
        let now = self.clock.now_ms();
        match self.lock().next_expiry() {
            Some(at) => Duration::from_millis(at.saturating_sub(now)).min(SWEEP_EVERY),
            None => SWEEP_EVERY,
        }
    }
}

/// What the node offers: a registered pool, or why not.
pub(crate) struct Rdma {
    offer: Result<verbs::Offer, String>,
    pub(crate) leases: LeaseTable,
}

impl Rdma {
    /// Opens the first RDMA device and registers `cache`'s pool with it
    /// (feature `rdma`); without the feature or a device, offers nothing and
    /// says why.
    pub(crate) fn start(cache: &BlockCache, clock: WallClock) -> Rdma {
        let offer = verbs::Offer::open(cache);
        match &offer {
            Ok(o) => tracing::info!(device = o.device_name(), "RDMA offered: the pool is registered for remote reads"),
            Err(why) => tracing::info!("{why}"),
        }
        Rdma { offer, leases: LeaseTable::new(MAX_LEASES, clock) }
    }

    pub(crate) fn offered(&self) -> bool {
        self.offer.is_ok()
    }

    /// Why a request for RDMA is `unsupported` on a connection: the node's
    /// reason, or that the HELLO did not ask.
    fn refusal(&self) -> Response {
        let message = match &self.offer {
            Err(why) => why.clone(),
            Ok(_) => "RDMA was not agreed on this connection: its HELLO did not ask for feature bit 3 (RDMA)".into(),
        };
        Response::Error { code: ErrorCode::Unsupported, message }
    }
}

/// One connection's RDMA state: its queue pair, once it asked.
#[derive(Default)]
pub(crate) struct ConnRdma {
    qp: Mutex<Option<verbs::ConnQueuePair>>,
}

impl ConnRdma {
    /// RDMA_CONNECT: a queue pair for this connection, connected to the
    /// client's; answered with its endpoint. `agreed`: the handshake
    /// granted `RDMA`.
    pub(crate) fn connect(&self, rdma: &Rdma, agreed: bool, remote: &kvplane_protocol::rdma::QueuePairEndpoint) -> Response {
        let offer = match (&rdma.offer, agreed) {
            (Ok(offer), true) => offer,
            _ => return rdma.refusal(),
        };
        match offer.connect(remote) {
            Ok(qp) => {
                let endpoint = qp.endpoint();
                *self.qp.lock().unwrap_or_else(|e| e.into_inner()) = Some(qp);
                Response::RdmaConnect { endpoint }
            }
            Err(message) => Response::Error { code: ErrorCode::Unavailable, message },
        }
    }

    /// RDMA_DESCRIBE: per key, a descriptor under a lease of `lease_ms`
    /// (clamped to `max_lease_ms`), or the key's status.
    pub(crate) fn describe(
        &self,
        rdma: &Rdma,
        agreed: bool,
        cache: &BlockCache,
        keys: &[Bytes],
        lease_ms: u32,
        max_lease_ms: u32,
    ) -> Response {
        let offer = match (&rdma.offer, agreed) {
            (Ok(offer), true) => offer,
            _ => return rdma.refusal(),
        };
        if lease_ms == 0 {
            return Response::Error { code: ErrorCode::Invalid, message: "rdma_describe.lease_ms: a lease of 0 ms".into() };
        }
        let guard = self.qp.lock().unwrap_or_else(|e| e.into_inner());
        let Some(qp) = guard.as_ref() else {
            return Response::Error { code: ErrorCode::Invalid, message: "RDMA_DESCRIBE before RDMA_CONNECT".into() };
        };
        // Ended leases are let go by the node's sweeper (and by a grant
        // that finds the table full), not here.
        let ttl = Duration::from_millis(lease_ms.min(max_lease_ms).max(1) as u64);
        let results = keys
            .iter()
            .map(|key| {
                let pinned = rdma.leases.pin(cache, key, ttl)?;
                offer.describe(qp, &pinned).map_err(|e| {
                    tracing::warn!(error = %e, "describing a pinned block failed");
                    ErrorCode::Internal
                })
            })
            .collect();
        Response::RdmaDescribe { results }
    }
}

/// The verbs side: a device and the registered pool.
#[cfg(feature = "rdma")]
#[allow(unsafe_code)] // registering the pool (ibv_reg_mr); see `Offer::open`.
mod verbs {
    use std::sync::Arc;

    use kvplane_protocol::rdma::{Descriptor, QueuePairEndpoint};
    use kvplane_rdma::verbs::{Device, MemoryRegion, QueuePair, RdmaError};

    use super::Pinned;
    use crate::cache::BlockCache;
    use crate::memory::MemoryPool;

    pub(crate) struct Offer {
        // Dropped first (fields drop in order): the region is deregistered
        // while the pool it covers is still mapped.
        region: MemoryRegion,
        device: Arc<Device>,
        _pool: Arc<MemoryPool>,
    }

    pub(crate) struct ConnQueuePair(QueuePair);

    impl ConnQueuePair {
        pub(crate) fn endpoint(&self) -> QueuePairEndpoint {
            self.0.endpoint()
        }
    }

    impl Offer {
        pub(crate) fn open(cache: &BlockCache) -> Result<Offer, String> {
            let device = Device::open_first()
                .map_err(|e| format!("this node offers no RDMA: no RDMA device was found at start ({e}); blocks go over the socket"))?;
            let pool = Arc::clone(cache.pool());
            let (base, len) = pool.arena_range();
            // SAFETY: `base..base + len` is the pool's arena, mapped for as
            // long as the pool lives; `Offer` holds the pool and drops the
            // region before it. Remote readers only READ (the region grants
            // remote read alone), and a block they are told about is held by
            // a lease, so its memory is not reused until the lease ends.
            let region = unsafe { device.register(base.as_ptr(), len) }
                .map_err(|e| format!("this node offers no RDMA: registering the {len}-byte pool with {} failed: {e}", device.name()))?;
            Ok(Offer { region, device, _pool: pool })
        }

        pub(crate) fn device_name(&self) -> &str {
            self.device.name()
        }

        pub(crate) fn connect(&self, remote: &QueuePairEndpoint) -> Result<ConnQueuePair, String> {
            let mut qp = QueuePair::new(&self.device).map_err(|e| format!("making a queue pair: {e}"))?;
            qp.connect(remote).map_err(|e| format!("connecting to the client's queue pair {:#x}: {e}", remote.qp_num))?;
            Ok(ConnQueuePair(qp))
        }

        pub(crate) fn describe(&self, qp: &ConnQueuePair, pinned: &Pinned) -> Result<Descriptor, RdmaError> {
            let len = u32::try_from(pinned.block.len()).map_err(|_| RdmaError::Range {
                offset: pinned.block.arena_offset(),
                len: pinned.block.len(),
                region_len: self.region.len(),
            })?;
            self.region.describe(qp.0.qp_num(), pinned.block.arena_offset(), len, pinned.crc, pinned.lease)
        }
    }
}

/// Without the feature there is never an offer.
#[cfg(not(feature = "rdma"))]
mod verbs {
    use kvplane_protocol::rdma::{Descriptor, QueuePairEndpoint};

    use super::Pinned;
    use crate::cache::BlockCache;

    /// Cannot be made: without the feature, [`Offer::open`] always refuses.
    pub(crate) enum Offer {}
    pub(crate) enum ConnQueuePair {}

    impl ConnQueuePair {
        pub(crate) fn endpoint(&self) -> QueuePairEndpoint {
            match *self {}
        }
    }

    impl Offer {
        pub(crate) fn open(_: &BlockCache) -> Result<Offer, String> {
            Err("this node offers no RDMA: it was built without the rdma feature; blocks go over the socket".into())
        }

        pub(crate) fn device_name(&self) -> &str {
            match *self {}
        }

        pub(crate) fn connect(&self, _: &QueuePairEndpoint) -> Result<ConnQueuePair, String> {
            match *self {}
        }

        pub(crate) fn describe(&self, _: &ConnQueuePair, _: &Pinned) -> Result<Descriptor, String> {
            match *self {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{CacheConfig, ManualClock};
    use crate::memory::{MemoryPool, PoolConfig};

    const MIB: usize = 1 << 20;

    /// A cache of `blocks` 1 MiB blocks with a clock that moves only when
    /// the test says, and a lease table on the same clock.
    fn setup(blocks: usize) -> (Arc<ManualClock>, BlockCache, LeaseTable) {
        let clock = Arc::new(ManualClock::new());
        let pool = MemoryPool::new(PoolConfig { max_block_bytes: MIB, ..PoolConfig::new(blocks * MIB) }).unwrap();
        let cache = BlockCache::new(pool, CacheConfig { shards: 1, clock: clock.clone(), ..CacheConfig::default() });
        let leases = LeaseTable::new(4, WallClock::new(clock.clone(), 1_000_000));
        (clock, cache, leases)
    }

    fn put(cache: &BlockCache, key: &str, byte: u8) {
        let mut b = cache.allocate(MIB).unwrap();
        b.as_mut_slice().fill(byte);
        let crc = crc32c::crc32c(b.as_slice());
        cache.insert(Bytes::copy_from_slice(key.as_bytes()), b.freeze(), crc);
    }

    #[test]
    fn a_lease_pins_its_block_until_it_expires_and_is_swept() {
        let (clock, cache, leases) = setup(2);
        put(&cache, "a", 1);
        put(&cache, "b", 2);
        let pinned = leases.pin(&cache, b"a", Duration::from_millis(500)).unwrap();
        assert_eq!(pinned.lease.expires_at_ms, 1_000_500);
        assert_eq!(pinned.crc, crc32c::crc32c(&[1u8; MIB]));
        let held = pinned.block.clone();
        drop(pinned);
        assert_eq!(cache.stats().pinned, 1);
        assert_eq!(held.ref_count(), 3, "the cache, the lease and this test");

        // The pool is full: a new block must evict, and only `b` may go.
        put(&cache, "c", 3);
        assert!(cache.contains(b"a") && !cache.contains(b"b"));

        // Deleting the key does not free the memory under a reader either.
        assert!(cache.remove(b"a"));
        assert_eq!(held.ref_count(), 2, "the lease and this test");
        assert!(held.iter().all(|&x| x == 1));

        // Just before the end nothing is released; at the end it is.
        clock.advance(Duration::from_millis(499));
        assert_eq!(leases.sweep(), 0);
        assert_eq!(held.ref_count(), 2);
        clock.advance(Duration::from_millis(1));
        assert_eq!(leases.sweep(), 1);
        assert_eq!(held.ref_count(), 1, "the lease let go of the block");
        assert_eq!(leases.len(), 0);
        assert_eq!(cache.stats().pinned, 0);
        drop(held);
        // Its memory is the pool's again.
        assert!(cache.allocate(MIB).is_ok());
    }

    #[test]
    fn an_expired_pin_lets_eviction_take_the_block_after_the_sweep() {
        let (clock, cache, leases) = setup(2);
        put(&cache, "a", 1);
        put(&cache, "b", 2);
        leases.pin(&cache, b"a", Duration::from_millis(100)).unwrap();
        leases.pin(&cache, b"b", Duration::from_millis(100)).unwrap();
        assert!(cache.allocate(MIB).is_err(), "both blocks are leased");
        clock.advance(Duration::from_millis(100));
        assert_eq!(leases.next_sweep_in(), Duration::ZERO);
        assert_eq!(leases.sweep(), 2);
        assert!(cache.allocate(MIB).is_ok(), "ended leases no longer keep eviction away");
    }

    #[test]
    fn a_full_table_and_a_missing_key_are_per_key_statuses() {
        let (clock, cache, leases) = setup(2);
        put(&cache, "a", 1);
        assert_eq!(leases.pin(&cache, b"nope", Duration::from_millis(10)).unwrap_err(), ErrorCode::NotFound);
        for _ in 0..4 {
            leases.pin(&cache, b"a", Duration::from_millis(10)).unwrap();
        }
        assert_eq!(leases.pin(&cache, b"a", Duration::from_millis(10)).unwrap_err(), ErrorCode::Capacity);
        // Once they have ended a grant makes room by itself.
        clock.advance(Duration::from_millis(10));
        assert!(leases.pin(&cache, b"a", Duration::from_millis(10)).is_ok());
        assert_eq!(leases.len(), 1);
    }

    #[test]
    fn without_the_feature_or_a_device_nothing_is_offered_and_requests_are_unsupported() {
        let (clock, cache, _) = setup(2);
        let rdma = Rdma::start(&cache, WallClock::new(clock, 1_000));
        if cfg!(feature = "rdma") && rdma.offered() {
            // A machine with a device: the refusal is for connections that
            // did not ask.
            return;
        }
        assert!(!rdma.offered());
        let conn = ConnRdma::default();
        let endpoint = kvplane_protocol::rdma::QueuePairEndpoint { gid: kvplane_protocol::rdma::Gid::default(), lid: 1, qp_num: 1, psn: 1 };
        for (response, agreed) in [
            (conn.connect(&rdma, true, &endpoint), true),
            (conn.describe(&rdma, true, &cache, &[Bytes::from_static(b"a")], 100, 1000), true),
        ] {
            match response {
                Response::Error { code: ErrorCode::Unsupported, message } => {
                    assert!(message.starts_with("this node offers no RDMA: "), "{message}");
                    if !cfg!(feature = "rdma") {
                        assert!(message.contains("built without the rdma feature"), "{message}");
                    }
                }
                other => panic!("agreed {agreed}: {other:?}"),
            }
        }
    }
}
