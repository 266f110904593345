//! The second tier: a backend plugin behind the memory tier.
//!
//! The memory tier ([`crate::cache`]) answers first. A key it does not hold
//! is read from the backend plugin straight into a pool block (the block is
//! the plugin's destination buffer, so the bytes are written once, by the
//! host's socket read) and kept in the memory tier for the next reader.
//! Blocks go the other way through [`ingest`], by mode: every PUT (`all`),
//! blocks the memory tier evicts (`on-evict`), or blocks read `hotReads`
//! times (`hot`).
//!
//! Every backend call goes through [`retry`] (the retry-policy plugin, or
//! the node's own rule) within the request's deadline. What a failure that
//! survives the retries means is the backend declaration's failure policy:
//! fail-open turns it into a miss (the engine recomputes the block), fail-closed into a typed error for the client.

pub mod envelope;
pub(crate) mod ingest;
pub(crate) mod retry;
mod telemetry;

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvplane_config::{IngestMode, TieringConfig, WriteMode};
use kvplane_protocol::{ErrorKind, KvError};
use kvplane_runtime::worlds::{BackendCallOptions, Operation};
use kvplane_runtime::{Backend, FailurePolicy, RetryPolicy, WritableMemory};

use crate::cache::{Allocation, BlockCache, CachedBlock, Evicted};
use crate::memory::{Block, BlockMut};
use ingest::{Budget, Ingest, Queued};
use retry::{plugin_error, Attempts, Next, Retrier};

/// The second tier's calls use the store's configured namespace and TTL.
pub(crate) const NO_OPTIONS: BackendCallOptions = BackendCallOptions { ttl_ms: None, namespace: None };

/// `reads` of a block the memory tier got from the second tier: it is
/// already there, so neither `hot` nor `on-evict` copies it back.
pub const FROM_SECOND_TIER: u32 = u32::MAX;

/// What a node needs to serve a second tier: the loaded plugins and the
/// settings. Built by whoever loaded the plugins (the `kvplane node` command).
#[derive(Clone)]
pub struct TierSetup {
    /// The backend plugin's declared name (the retry policy's `target`).
    pub name: String,
    pub backend: Arc<Backend>,
    pub retry: Option<Arc<RetryPolicy>>,
    pub settings: TieringConfig,
}

impl fmt::Debug for TierSetup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TierSetup")
            .field("backend", &self.name)
            .field("retry", &self.retry.as_ref().map(|r| r.plugin.decl().name.clone()))
            .field("settings", &self.settings)
            .finish()
    }
}

/// Counters of the second tier, read at scrape time.
#[derive(Default)]
pub(crate) struct TierMetrics {
    pub(crate) hits: AtomicU64,
    pub(crate) misses: AtomicU64,
    pub(crate) read_bytes: AtomicU64,
    pub(crate) written_bytes: AtomicU64,
    pub(crate) retries: AtomicU64,
    pub(crate) ingest_stored: AtomicU64,
    pub(crate) ingest_failed: AtomicU64,
    pub(crate) ingest_skipped: AtomicU64,
    pub(crate) ingest_waited: AtomicU64,
    /// GETs answered from a block queued for the writers (evicted from the
    /// memory tier, not yet in the second).
    pub(crate) queued_hits: AtomicU64,
    /// Failures that became misses under fail-open.
    pub(crate) failed_open: AtomicU64,
    /// Blocks read back that failed their trailer's check (never served).
    pub(crate) corrupt: AtomicU64,
    /// Blocks read a second time because they disagreed with their sound
    /// trailer (a read between an overwrite's block and its trailer looks
    /// so); those that disagree again count in `corrupt` too.
    pub(crate) corrupt_rereads: AtomicU64,
    /// Blocks read back without a trailer (written before it): misses.
    pub(crate) unsealed: AtomicU64,
    /// Whether the store answered its last call (or probe): a call that
    /// found it unreachable clears it and wakes the prober (see
    /// [`SecondTier::start`]), which sets it again once the store answers.
    pub(crate) reachable: AtomicBool,
    unreachable: tokio::sync::Notify,
    pub(crate) latency: [crate::telemetry::LatencyHistogram; 4],
    /// (operation, error kind) → count; errors are rare, a lock is fine.
    pub(crate) errors: Mutex<Vec<((Operation, ErrorKind), u64)>>,
}

pub(crate) const OPERATIONS: [Operation; 4] = [Operation::Put, Operation::Get, Operation::Exists, Operation::Delete];

pub(crate) fn operation_name(op: Operation) -> &'static str {
    match op {
        Operation::Put => "put",
        Operation::Get => "get",
        Operation::Exists => "exists",
        Operation::Delete => "delete",
    }
}

impl TierMetrics {
    fn record(&self, op: Operation, elapsed: Duration) {
        self.latency[op as usize].record(elapsed);
    }

    fn error(&self, op: Operation, e: &KvError) {
        let kind = e.kind();
        if kind == ErrorKind::Unavailable && self.reachable.swap(false, Ordering::AcqRel) {
            tracing::warn!(error = %e, "second tier: the store is unreachable; probing until it answers");
            self.unreachable.notify_one();
        }
        let mut errors = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        match errors.iter_mut().find(|(k, _)| *k == (op, kind)) {
            Some((_, n)) => *n += 1,
            None => errors.push(((op, kind), 1)),
        }
    }
}

/// What the writer tasks share with the request path.
pub(crate) struct TierShared {
    pub(crate) backend: Arc<Backend>,
    pub(crate) retrier: Retrier,
    pub(crate) settings: TieringConfig,
    pub(crate) budget: Budget,
    /// Evicted blocks queued for the writers, served by GETs until written.
    pub(crate) queued: Queued,
    pub(crate) metrics: TierMetrics,
    fail_open: bool,
}

impl TierShared {
    /// Deletes now (the caller has ordered it behind earlier writes), each
    /// block with its trailer; the answers are the blocks'.
    async fn delete_now(&self, keys: Vec<Vec<u8>>) -> Result<Vec<Result<(), KvError>>, KvError> {
        let n = keys.len();
        let mut both = keys.clone();
        both.extend(keys.iter().map(|k| envelope::trailer_key(k)));
        let mut answers = self.whole_batch(Operation::Delete, || self.backend.delete(both.clone(), NO_OPTIONS)).await?;
        answers.truncate(n);
        Ok(answers)
    }

    /// Calls `call` (one batch) until no key failed transiently, as the
    /// retry policy allows: the answers, or the error it gave up on.
    async fn whole_batch<T, F, Fut>(&self, op: Operation, mut call: F) -> Result<Vec<Result<T, KvError>>, KvError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<Vec<Result<T, KvError>>, kvplane_runtime::PluginError>>,
    {
        let mut attempts = Attempts::new();
        loop {
            let started = Instant::now();
            let result = call().await;
            self.metrics.record(op, started.elapsed());
            let error = match result {
                Ok(results) => match results.iter().find_map(|r| r.as_ref().err().filter(|e| retry::transient(e))) {
                    None => return Ok(results),
                    Some(e) => e.clone(),
                },
                Err(e) => plugin_error(&e),
            };
            self.metrics.error(op, &error);
            if !self.retry_after(op, &mut attempts, &error).await {
                return Err(error);
            }
        }
    }

    /// The one place a second-tier call is retried: asks the retry policy
    /// (the declared plugin, or the node's own rule) about `error` within
    /// the request's deadline, and when it says retry, counts it and waits
    /// as told before answering true. False: give up. Every loop over the
    /// store (a batch, a read-through, the writers) decides through this.
    pub(crate) async fn retry_after(&self, op: Operation, attempts: &mut Attempts, error: &KvError) -> bool {
        match self.retrier.next(op, true, attempts, error).await {
            Next::RetryAfter(wait) => {
                self.metrics.retries.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(wait).await;
                true
            }
            Next::GiveUp => false,
        }
    }
}

/// Bounds of the prober's wait between two tries of an unreachable store.
const PROBE_FIRST: Duration = Duration::from_millis(200);
const PROBE_MAX: Duration = Duration::from_secs(5);

/// Starts an instance of the backend (its `open` connects to the store)
/// until one starts, then waits for a call to find the store unreachable
/// again. A node starts while its store is down (the `kvplane node` command
/// does not stop on an unreachable store): it serves its memory tier, and
/// this says when the store answers. Ends with the node.
async fn probe(shared: std::sync::Weak<TierShared>) {
    let mut wait = PROBE_FIRST;
    loop {
        let Some(s) = shared.upgrade() else { return };
        if s.metrics.reachable.load(Ordering::Acquire) {
            // Woken by a call that found the store gone, or after a while to
            // see whether the node is still there (this holds it meanwhile).
            let _ = tokio::time::timeout(PROBE_MAX, s.metrics.unreachable.notified()).await;
            wait = PROBE_FIRST;
            continue;
        }
        match s.backend.plugin.warm_up().await {
            Ok(()) => {
                tracing::info!("second tier: the store answers");
                s.metrics.reachable.store(true, Ordering::Release);
            }
            Err(e) => {
                tracing::debug!(error = %e, ?wait, "second tier: the store is still unreachable");
                drop(s);
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(PROBE_MAX);
            }
        }
    }
}

/// A pool block lent to the backend plugin as a GET destination.
impl WritableMemory for BlockMut {
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

/// What a read-through lends the plugin per key: the pool block for the
/// block's bytes, and a small buffer for its trailer (see `envelope`).
enum Destination {
    Block(BlockMut),
    Trailer(Vec<u8>),
}

impl WritableMemory for Destination {
    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Destination::Block(b) => b.as_mut_slice(),
            Destination::Trailer(t) => t,
        }
    }
}

/// The second tier of a running node.
pub(crate) struct SecondTier {
    shared: Arc<TierShared>,
    ingest: Ingest,
    writers: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// The size a read-through allocates first: the largest block seen so
    /// far (0: none yet, so the pool's largest class).
    expected_len: AtomicUsize,
}

impl SecondTier {
    /// Starts the writer tasks (needs a Tokio runtime). `pool_bytes` is the
    /// memory tier's size: a queued block keeps its pool memory until it is
    /// written (an evicted one has nothing else holding it; a cached one
    /// cannot be evicted while queued), so at most an eighth of the pool may
    /// wait, whatever `maxInFlight` says — else a slow store would leave the
    /// memory tier no room for new blocks.
    pub(crate) fn start(setup: TierSetup, pool_bytes: usize) -> SecondTier {
        let fail_open = setup.backend.plugin.decl().failure_policy == FailurePolicy::FailOpen;
        let bound = setup.settings.max_in_flight.bytes().min(pool_bytes as u64 / 8).max(1);
        let shared = Arc::new(TierShared {
            retrier: Retrier { policy: setup.retry, target: setup.name, deadline: Duration::from_millis(setup.settings.deadline_ms) },
            budget: Budget::new(bound),
            queued: Queued::default(),
            backend: setup.backend,
            settings: setup.settings,
            metrics: TierMetrics::default(),
            fail_open,
        });
        let (ingest, mut writers) = Ingest::start(&shared, shared.settings.writers as usize);
        writers.push(tokio::spawn(probe(Arc::downgrade(&shared))));
        SecondTier { shared, ingest, writers: Mutex::new(writers), expected_len: AtomicUsize::new(0) }
    }

    /// Whether the node may take traffic as far as the second tier goes:
    /// not while the store is unreachable under fail-closed (every miss
    /// would be an error); under fail-open a miss is only a miss.
    pub(crate) fn ready(&self) -> Result<(), String> {
        if self.shared.fail_open || self.shared.metrics.reachable.load(Ordering::Acquire) {
            Ok(())
        } else {
            Err("the second tier's store is unreachable (failClosed)".into())
        }
    }

    pub(crate) fn metrics(&self) -> &TierMetrics {
        &self.shared.metrics
    }

    /// The second tier's counters, as a STATS answer lists them.
    pub(crate) fn stats(&self) -> Vec<(String, u64)> {
        let m = &self.shared.metrics;
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut out = vec![
            ("backend_hits".to_string(), load(&m.hits)),
            ("backend_misses".into(), load(&m.misses)),
            ("backend_read_bytes".into(), load(&m.read_bytes)),
            ("backend_written_bytes".into(), load(&m.written_bytes)),
            ("backend_retries".into(), load(&m.retries)),
            ("backend_failed_open".into(), load(&m.failed_open)),
            ("backend_reachable".into(), u64::from(m.reachable.load(Ordering::Relaxed))),
            ("backend_corrupt".into(), load(&m.corrupt)),
            ("backend_corrupt_rereads".into(), load(&m.corrupt_rereads)),
            ("backend_unsealed".into(), load(&m.unsealed)),
            ("tier_ingest_stored".into(), load(&m.ingest_stored)),
            ("tier_ingest_failed".into(), load(&m.ingest_failed)),
            ("tier_ingest_skipped".into(), load(&m.ingest_skipped)),
            ("tier_ingest_waits".into(), load(&m.ingest_waited)),
            ("tier_in_flight_bytes".into(), self.in_flight_bytes()),
            ("tier_queued_hits".into(), load(&m.queued_hits)),
            ("tier_queued_blocks".into(), self.shared.queued.len() as u64),
        ];
        let errors: u64 = m.errors.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|(_, n)| n).sum();
        out.push(("backend_errors".into(), errors));
        out
    }

    pub(crate) fn in_flight_bytes(&self) -> u64 {
        self.shared.budget.in_flight()
    }

    /// Lets the writers finish what is queued, up to `deadline`. False when
    /// the deadline passed first (the rest is not written).
    pub(crate) async fn drain(&self, deadline: Duration) -> bool {
        // The writers end once their queues are empty and closed; the queues
        // close when `self.ingest` is dropped, which the caller does by
        // dropping the node state. Here: wait for the budget to empty.
        let emptied = tokio::time::timeout(deadline, self.shared.budget.emptied()).await.is_ok();
        if !emptied {
            let left: Vec<_> = std::mem::take(&mut *self.writers.lock().unwrap_or_else(|p| p.into_inner()));
            left.iter().for_each(|w| w.abort());
        }
        emptied
    }

    /// The evicted block queued under `key`, not yet written (only
    /// `on-evict` queues evicted blocks: other modes skip the lookup).
    fn queued(&self, key: &[u8]) -> Option<Block> {
        (self.shared.settings.mode == IngestMode::OnEvict).then(|| self.shared.queued.get(key)).flatten()
    }

    /// A block for a PUT of `len` bytes. In `on-evict` mode what the memory
    /// tier evicts to make room is queued for the second tier first.
    pub(crate) async fn allocate(&self, cache: &BlockCache, len: usize) -> Result<BlockMut, KvError> {
        self.expected_len.fetch_max(len, Ordering::Relaxed);
        if self.shared.settings.mode != IngestMode::OnEvict {
            return cache.allocate(len);
        }
        let mut evicted = 0u64;
        loop {
            match cache.allocate_or_evict(len, evicted)? {
                Allocation::Block(b) => return Ok(b),
                Allocation::Evicted(victim) => self.evicted(victim).await,
            }
            evicted += 1;
        }
    }

    async fn evicted(&self, victim: Evicted) {
        if victim.reads == FROM_SECOND_TIER {
            return;
        }
        let _ = self.ingest.offer(&self.shared, victim.key, victim.block, true).await;
    }

    /// After a PUT stored `block` in the memory tier.
    pub(crate) async fn stored(&self, key: &Bytes, block: &Block) {
        if self.shared.settings.mode == IngestMode::All && !self.writes_through() {
            let _ = self.ingest.offer(&self.shared, key.clone(), block.clone(), false).await;
        }
    }

    /// Whether a PUT is answered only once the store holds it too
    /// (`tiering.write: through`; the config checked it goes with mode
    /// `all` and a fail-closed backend).
    pub(crate) fn writes_through(&self) -> bool {
        self.shared.settings.write == WriteMode::Through
    }

    /// Writes `entries` (checked blocks of one PUT) to the store now, each
    /// with its trailer, within the request's deadline and retry policy.
    /// Per entry: stored, or the store's error (the caller then does not
    /// keep the block in memory either, and answers the error).
    pub(crate) async fn write_through(&self, entries: &[(Bytes, Block)]) -> Vec<Result<(), KvError>> {
        let mut writes: Vec<(Vec<u8>, Bytes)> = Vec::with_capacity(entries.len() * 2);
        for (key, block) in entries {
            writes.push((key.to_vec(), block.clone().into_bytes()));
            writes.push((envelope::trailer_key(key), envelope::trailer(key, block.len(), block.crc())));
        }
        let m = &self.shared.metrics;
        let answers = match self.shared.whole_batch(Operation::Put, || self.shared.backend.put(writes.clone(), NO_OPTIONS)).await {
            Ok(a) => a,
            Err(e) => (0..writes.len()).map(|_| Err(e.clone())).collect(),
        };
        let mut answers = answers.into_iter();
        let mut out = Vec::with_capacity(entries.len());
        for (key, block) in entries {
            let (data, trailer) = (answers.next(), answers.next());
            out.push(match (data, trailer) {
                (Some(Ok(())), Some(Ok(()))) => {
                    m.ingest_stored.fetch_add(1, Ordering::Relaxed);
                    m.written_bytes.fetch_add(block.len() as u64, Ordering::Relaxed);
                    Ok(())
                }
                (Some(Err(e)), _) | (_, Some(Err(e))) => {
                    m.ingest_failed.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(key = %String::from_utf8_lossy(key), error = %e, "second tier (write-through): not written; the PUT is answered the error");
                    Err(e)
                }
                _ => Err(KvError::Internal("the store answered fewer results than writes".into())),
            });
        }
        out
    }

    /// After a GET found `hit` in the memory tier.
    pub(crate) async fn read_hit(&self, key: &[u8], hit: &CachedBlock) {
        if self.shared.settings.mode == IngestMode::Hot && hit.reads == self.shared.settings.hot_reads {
            let _ = self.ingest.offer(&self.shared, Bytes::copy_from_slice(key), hit.block.clone(), false).await;
        }
    }

    /// Reads `keys` (memory-tier misses) from the second tier into pool
    /// blocks and stores them in the memory tier. One answer per key:
    /// `Ok(None)` a miss (or a failure under fail-open), `Err` a failure
    /// under fail-closed.
    ///
    /// A block queued for the writers (evicted, not yet written) is
    /// answered from the queue: it is in neither tier meanwhile. It is not
    /// put back into the memory tier (a PUT of the key since could be
    /// overwritten by it), so a MATCH_PREFIX's pin ends before it.
    pub(crate) async fn read_through(&self, cache: &BlockCache, keys: &[&[u8]]) -> Vec<Result<Option<CachedBlock>, KvError>> {
        let mut out: Vec<Result<Option<CachedBlock>, KvError>> = (0..keys.len()).map(|_| Ok(None)).collect();
        let expected = match self.expected_len.load(Ordering::Relaxed) {
            0 => cache.pool().max_block_bytes(),
            n => n,
        };
        // (index into keys, destination size)
        let mut pending: Vec<(usize, usize)> = Vec::with_capacity(keys.len());
        for (i, key) in keys.iter().enumerate() {
            match self.queued(key) {
                Some(block) => {
                    self.shared.metrics.queued_hits.fetch_add(1, Ordering::Relaxed);
                    out[i] = Ok(Some(CachedBlock { block, reads: FROM_SECOND_TIER }));
                }
                None => pending.push((i, expected)),
            }
        }
        let mut attempts = Attempts::new();
        // Keys read again because block and trailer disagreed (once each).
        let mut reread: Vec<usize> = Vec::new();
        while !pending.is_empty() {
            // Two entries per key: its block into a pool block, then its
            // trailer (see `envelope`).
            let mut entries = Vec::with_capacity(pending.len() * 2);
            let mut asked = Vec::with_capacity(pending.len());
            for &(i, size) in &pending {
                match self.allocate(cache, size).await {
                    Ok(block) => {
                        entries.push((keys[i].to_vec(), Destination::Block(block)));
                        entries.push((envelope::trailer_key(keys[i]), Destination::Trailer(vec![0; envelope::trailer_len(keys[i])])));
                        asked.push((i, size));
                    }
                    // No room in the memory tier: the block cannot be served
                    // from here; the client sees what the pool said.
                    Err(e) => out[i] = Err(e),
                }
            }
            if entries.is_empty() {
                break;
            }
            let started = Instant::now();
            let (memories, result) = self.shared.backend.get(entries, NO_OPTIONS).await;
            self.shared.metrics.record(Operation::Get, started.elapsed());
            let results = match result {
                Ok(r) => r,
                Err(e) => (0..memories.len()).map(|_| Err(plugin_error(&e))).collect(),
            };
            pending = Vec::new();
            let mut first_error = None;
            let mut answers = memories.into_iter().zip(results);
            for (i, size) in asked {
                let (Some((Destination::Block(mut block), r)), Some((Destination::Trailer(trailer), t))) = (answers.next(), answers.next())
                else {
                    unreachable!("two destinations per key, lent and given back in order");
                };
                let trailer = match t {
                    Ok(n) => Some(&trailer[..n]),
                    Err(_) => None,
                };
                match r {
                    Ok(len) => {
                        block.truncate(len);
                        match envelope::open(keys[i], block.as_slice(), trailer) {
                            envelope::Opened::Block { crc } => {
                                let block = self.right_sized(cache, block).freeze();
                                self.expected_len.fetch_max(len, Ordering::Relaxed);
                                self.shared.metrics.hits.fetch_add(1, Ordering::Relaxed);
                                self.shared.metrics.read_bytes.fetch_add(len as u64, Ordering::Relaxed);
                                let key = Bytes::copy_from_slice(keys[i]);
                                cache.insert_from_lower_tier(key, block.clone(), crc);
                                out[i] = Ok(Some(CachedBlock { block, reads: FROM_SECOND_TIER }));
                            }
                            envelope::Opened::Unsealed => {
                                self.shared.metrics.unsealed.fetch_add(1, Ordering::Relaxed);
                                self.shared.metrics.misses.fetch_add(1, Ordering::Relaxed);
                                tracing::debug!(key = %String::from_utf8_lossy(keys[i]), "second tier: a block without a trailer (written before it); a miss");
                            }
                            envelope::Opened::Mismatch(_) if !reread.contains(&i) => {
                                // Perhaps read between an overwrite's block
                                // and its trailer (see `envelope`): once more.
                                reread.push(i);
                                self.shared.metrics.corrupt_rereads.fetch_add(1, Ordering::Relaxed);
                                pending.push((i, size));
                            }
                            envelope::Opened::Corrupt(why) | envelope::Opened::Mismatch(why) => {
                                self.shared.metrics.corrupt.fetch_add(1, Ordering::Relaxed);
                                let key = String::from_utf8_lossy(keys[i]);
                                tracing::warn!(%key, bytes = len, reason = %why, "second tier: a block failed its check; not served, not cached");
                                out[i] = Err(KvError::Corrupt(format!("the second tier's block for {key:?}: {why}")));
                            }
                        }
                    }
                    Err(KvError::NotFound) => {
                        self.shared.metrics.misses.fetch_add(1, Ordering::Relaxed);
                    }
                    // Longer than the destination: once more with the
                    // pool's largest block.
                    Err(KvError::Capacity(_)) if size < cache.pool().max_block_bytes() => {
                        pending.push((i, cache.pool().max_block_bytes()));
                    }
                    Err(e) => {
                        self.shared.metrics.error(Operation::Get, &e);
                        if retry::transient(&e) {
                            pending.push((i, size));
                            first_error.get_or_insert(e);
                        } else {
                            out[i] = self.failed(e);
                        }
                    }
                }
            }
            if let Some(error) = first_error {
                if !self.shared.retry_after(Operation::Get, &mut attempts, &error).await {
                    for (i, _) in std::mem::take(&mut pending) {
                        out[i] = self.failed(error.clone());
                    }
                }
            }
        }
        out
    }

    /// A value much shorter than the block it was read into is copied into
    /// a block of its own size class, so a guessed-too-large destination
    /// does not pin a large class for a small value. The common case (the
    /// guess was the block size in use) keeps the block as it is.
    fn right_sized(&self, cache: &BlockCache, block: BlockMut) -> BlockMut {
        if block.len() >= block.capacity() / 2 {
            return block;
        }
        match cache.allocate(block.len()) {
            Ok(mut fitted) if fitted.capacity() < block.capacity() => {
                fitted.as_mut_slice().copy_from_slice(block.as_slice());
                fitted
            }
            _ => block,
        }
    }

    /// Whether each key (absent from the memory tier) is in the second tier
    /// or queued for it.
    pub(crate) async fn exists(&self, keys: Vec<Vec<u8>>) -> Vec<Result<bool, KvError>> {
        let mut out: Vec<Result<bool, KvError>> = keys.iter().map(|k| Ok(self.queued(k).is_some())).collect();
        let (asked, keys): (Vec<usize>, Vec<Vec<u8>>) = keys.into_iter().enumerate().filter(|(i, _)| matches!(out[*i], Ok(false))).unzip();
        if keys.is_empty() {
            return out;
        }
        let answers: Vec<Result<bool, KvError>> =
            match self.shared.whole_batch(Operation::Exists, || self.shared.backend.exists(keys.clone(), NO_OPTIONS)).await {
                Ok(results) => results
                    .into_iter()
                    .map(|r| match r {
                        Ok(b) => Ok(b),
                        Err(KvError::NotFound) => Ok(false),
                        Err(e) => self.fail(e).map(|()| false),
                    })
                    .collect(),
                Err(error) => (0..keys.len()).map(|_| self.fail(error.clone()).map(|()| false)).collect(),
            };
        for (i, r) in asked.into_iter().zip(answers) {
            out[i] = r;
        }
        out
    }

    /// Deletes `keys` from the second tier, after any write of them queued
    /// before. `Ok(true)`: it was there (or the store does not say).
    pub(crate) async fn delete(&self, keys: &[Bytes]) -> Vec<Result<bool, KvError>> {
        match self.ingest.delete(keys).await {
            Ok(results) => results
                .into_iter()
                .map(|r| match r {
                    Ok(()) => Ok(true),
                    Err(KvError::NotFound) => Ok(false),
                    Err(e) => self.fail(e).map(|()| false),
                })
                .collect(),
            Err(e) => keys.iter().map(|_| self.fail(e.clone()).map(|()| false)).collect(),
        }
    }

    /// A failure the retries did not cure: a miss under fail-open, the
    /// error under fail-closed.
    fn failed<T>(&self, e: KvError) -> Result<Option<T>, KvError> {
        self.fail(e).map(|()| None)
    }

    /// As `failed`, for answers that are a plain "no".
    fn fail(&self, e: KvError) -> Result<(), KvError> {
        if self.shared.fail_open {
            self.shared.metrics.failed_open.fetch_add(1, Ordering::Relaxed);
            Ok(())
        } else {
            Err(e)
        }
    }
}
