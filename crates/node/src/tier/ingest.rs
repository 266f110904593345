//! Copying blocks into the second tier behind the client's back.
//!
//! A PUT (mode `all`), a block read often enough (`hot`) or one the memory
//! tier evicts (`on-evict`) is queued here and written by a few writer
//! tasks in batches. Why it is shaped this way:
//!
//! * **A bound on bytes, not items.** Queued blocks hold pool memory (an
//!   evicted block is only freed once written), so [`Budget`] counts bytes
//!   waiting or being written. At the bound a producer waits (`block`) or
//!   the block is not copied (`skip`); both are counted, neither is silent.
//! * **One writer per key.** A key always goes to the same writer (by its
//!   hash), so two PUTs of a key reach the store in the order they were
//!   made, and a DELETE queued behind a PUT of the same key cannot be
//!   overtaken by it.
//! * **Evicted blocks are still served while queued.** An evicted block
//!   waiting for its writer is in neither tier: [`Queued`] keeps it
//!   findable until the write is done, so a GET in that window gets the
//!   block, not a miss. Blocks queued from the memory tier (`all`, `hot`)
//!   are not listed there: the memory tier never evicts a block the queue
//!   still holds (its reference count is above one), so they are found there.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use kvplane_config::AtBound;
use kvplane_protocol::KvError;
use kvplane_runtime::worlds::Operation;
use tokio::sync::{mpsc, oneshot, Notify};

use super::retry::{plugin_error, Attempts};
use super::TierShared;
use crate::memory::Block;

/// How long a writer waits between rounds while the store is unreachable:
/// growing by this each round, up to [`OUTAGE_RETRY_MAX`].
const OUTAGE_RETRY_FIRST: std::time::Duration = std::time::Duration::from_millis(100);
const OUTAGE_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(2);

/// Items a writer puts in one backend call at most.
const BATCH_ITEMS: usize = 32;
/// Bytes a writer puts in one backend call at most (one block may exceed it).
const BATCH_BYTES: usize = 8 << 20;

/// Bytes queued for or being written to the second tier.
pub(crate) struct Budget {
    in_flight: AtomicU64,
    bound: u64,
    room: Notify,
}

impl Budget {
    pub(crate) fn new(bound: u64) -> Budget {
        Budget { in_flight: AtomicU64::new(0), bound, room: Notify::new() }
    }

    pub(crate) fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Takes `n` bytes if they fit (a block larger than the whole bound fits
    /// only into an empty budget, so it is never refused for good).
    fn try_take(&self, n: u64) -> bool {
        self.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| (cur == 0 || cur + n <= self.bound).then_some(cur + n))
            .is_ok()
    }

    /// Waits until `n` bytes fit, then takes them.
    async fn take(&self, n: u64) {
        loop {
            // Registered before the check, so a release between the check
            // and the wait still wakes this producer.
            let notified = self.room.notified();
            if self.try_take(n) {
                return;
            }
            notified.await;
        }
    }

    /// Returns once nothing is queued or being written.
    pub(crate) async fn emptied(&self) {
        loop {
            let notified = self.room.notified();
            if self.in_flight() == 0 {
                return;
            }
            notified.await;
        }
    }

    fn give_back(&self, n: u64) {
        self.in_flight.fetch_sub(n, Ordering::AcqRel);
        self.room.notify_waiters();
    }
}

/// Blocks queued for the second tier whose write has not finished: the
/// latest queued block of each key, tagged with its queueing number so an
/// older write finishing does not withdraw a newer block.
#[derive(Default)]
pub(crate) struct Queued {
    blocks: Mutex<HashMap<Bytes, (u64, Block)>>,
    next: AtomicU64,
}

impl Queued {
    fn add(&self, key: Bytes, block: Block) -> u64 {
        let seq = self.next.fetch_add(1, Ordering::Relaxed);
        self.blocks.lock().unwrap_or_else(|p| p.into_inner()).insert(key, (seq, block));
        seq
    }

    /// The writes of `done` finished (stored or given up on).
    fn finished(&self, done: &mut Vec<(Bytes, u64)>) {
        if done.is_empty() {
            return;
        }
        let mut blocks = self.blocks.lock().unwrap_or_else(|p| p.into_inner());
        for (key, seq) in done.drain(..) {
            if blocks.get(&key).is_some_and(|(s, _)| *s == seq) {
                blocks.remove(&key);
            }
        }
    }

    /// The block queued under `key`, if its write has not finished.
    pub(crate) fn get(&self, key: &[u8]) -> Option<Block> {
        self.blocks.lock().unwrap_or_else(|p| p.into_inner()).get(key).map(|(_, b)| b.clone())
    }

    pub(crate) fn len(&self) -> usize {
        self.blocks.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

/// Work for one writer, in the order it was queued.
pub(crate) enum Job {
    Put {
        key: Bytes,
        /// The block itself: its checksum, known to the pool since the PUT
        /// checked it, goes into its trailer without another pass.
        value: Block,
        /// Its number in [`Queued`], for an evicted block.
        seq: Option<u64>,
    },
    /// Deletes `keys` after every PUT queued before it, then answers.
    Delete { keys: Vec<Vec<u8>>, done: oneshot::Sender<Result<Vec<Result<(), KvError>>, KvError>> },
}

/// The queues of the writers.
pub(crate) struct Ingest {
    writers: Vec<mpsc::UnboundedSender<Job>>,
    hasher: foldhash::fast::RandomState,
}

/// Why a block was not queued.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Refused {
    /// `at_bound: skip` and the bound was reached.
    Skipped,
    /// The node is shutting down.
    Closed,
}

impl Ingest {
    /// Starts `writers` writer tasks on the current runtime.
    pub(crate) fn start(shared: &Arc<TierShared>, writers: usize) -> (Ingest, Vec<tokio::task::JoinHandle<()>>) {
        let mut senders = Vec::with_capacity(writers);
        let mut tasks = Vec::with_capacity(writers);
        for _ in 0..writers.max(1) {
            let (tx, rx) = mpsc::unbounded_channel();
            senders.push(tx);
            tasks.push(tokio::spawn(write_loop(Arc::clone(shared), rx)));
        }
        (Ingest { writers: senders, hasher: foldhash::fast::RandomState::default() }, tasks)
    }

    fn writer(&self, key: &[u8]) -> &mpsc::UnboundedSender<Job> {
        let i = (self.hasher.hash_one(key) % self.writers.len() as u64) as usize;
        &self.writers[i]
    }

    /// Queues a copy of `block` under `key`, waiting for room or skipping at
    /// the bound as configured. An `evicted` block (in no tier until it is
    /// written) is listed in [`Queued`] meanwhile.
    pub(crate) async fn offer(&self, shared: &TierShared, key: Bytes, block: Block, evicted: bool) -> Result<(), Refused> {
        let n = block.len() as u64;
        if !shared.budget.try_take(n) {
            match shared.settings.at_bound {
                AtBound::Skip => {
                    shared.metrics.ingest_skipped.fetch_add(1, Ordering::Relaxed);
                    return Err(Refused::Skipped);
                }
                AtBound::Block => {
                    shared.metrics.ingest_waited.fetch_add(1, Ordering::Relaxed);
                    shared.budget.take(n).await;
                }
            }
        }
        let seq = evicted.then(|| shared.queued.add(key.clone(), block.clone()));
        let writer = self.writer(&key);
        if writer.send(Job::Put { key: key.clone(), value: block, seq }).is_err() {
            if let Some(seq) = seq {
                shared.queued.finished(&mut vec![(key, seq)]);
            }
            shared.budget.give_back(n);
            return Err(Refused::Closed);
        }
        Ok(())
    }

    /// Deletes `keys` from the second tier after every write of them queued
    /// so far. One answer per key, in order.
    pub(crate) async fn delete(&self, keys: &[Bytes]) -> Result<Vec<Result<(), KvError>>, KvError> {
        // Split by writer, keeping each key's index.
        let mut per_writer: Vec<(Vec<usize>, Vec<Vec<u8>>)> = vec![(Vec::new(), Vec::new()); self.writers.len()];
        for (i, k) in keys.iter().enumerate() {
            let w = (self.hasher.hash_one(k.as_ref()) % self.writers.len() as u64) as usize;
            per_writer[w].0.push(i);
            per_writer[w].1.push(k.to_vec());
        }
        let mut waiting = Vec::new();
        for (w, (indices, keys)) in per_writer.into_iter().enumerate() {
            if keys.is_empty() {
                continue;
            }
            let (done, answer) = oneshot::channel();
            self.writers[w].send(Job::Delete { keys, done }).map_err(|_| KvError::Unavailable("the node is shutting down".into()))?;
            waiting.push((indices, answer));
        }
        let mut out: Vec<Result<(), KvError>> = (0..keys.len()).map(|_| Ok(())).collect();
        for (indices, answer) in waiting {
            let results = answer.await.map_err(|_| KvError::Internal("a second-tier writer stopped".into()))??;
            for (i, r) in indices.into_iter().zip(results) {
                out[i] = r;
            }
        }
        Ok(out)
    }
}

/// One writer: takes what is queued (up to a batch), writes it, repeats;
/// ends when the node drops the queue.
async fn write_loop(shared: Arc<TierShared>, mut rx: mpsc::UnboundedReceiver<Job>) {
    let mut batch: Vec<(Vec<u8>, Block)> = Vec::new();
    // The batch's evicted keys and their numbers, for `Queued::finished`.
    let mut written: Vec<(Bytes, u64)> = Vec::new();
    while let Some(first) = rx.recv().await {
        let mut next = Some(first);
        let mut bytes = 0usize;
        while let Some(job) = next.take() {
            match job {
                Job::Put { key, value, seq } => {
                    bytes += value.len();
                    batch.push((key.to_vec(), value));
                    if let Some(seq) = seq {
                        written.push((key, seq));
                    }
                }
                Job::Delete { keys, done } => {
                    write_batch(&shared, &mut batch).await;
                    shared.queued.finished(&mut written);
                    let _ = done.send(shared.delete_now(keys).await);
                }
            }
            if batch.len() >= BATCH_ITEMS || bytes >= BATCH_BYTES {
                break;
            }
            next = rx.try_recv().ok();
        }
        write_batch(&shared, &mut batch).await;
        shared.queued.finished(&mut written);
    }
}

/// Writes `batch` (retrying keys that failed transiently), counts the
/// outcome and gives its bytes back to the budget. Each block goes with its
/// trailer (see `envelope`), in the same call: the block's own bytes are
/// lent as they are, the trailer is a few dozen bytes of its own.
async fn write_batch(shared: &TierShared, batch: &mut Vec<(Vec<u8>, Block)>) {
    if batch.is_empty() {
        return;
    }
    let total: u64 = batch.iter().map(|(_, v)| v.len() as u64).sum();
    // (store key, value, whether it is a trailer)
    let mut pending: Vec<(Vec<u8>, Bytes, bool)> = Vec::with_capacity(batch.len() * 2);
    for (key, block) in std::mem::take(batch) {
        let trailer = (super::envelope::trailer_key(&key), super::envelope::trailer(&key, block.len(), block.crc()), true);
        pending.push((key, block.into_bytes(), false));
        pending.push(trailer);
    }
    let mut attempts = Attempts::new();
    // Rounds of retries the store did not take during an outage.
    let mut outage_rounds = 0u32;
    loop {
        let started = Instant::now();
        let n = pending.len();
        let result = shared.backend.put(pending.iter().map(|(k, v, _)| (k.clone(), v.clone())).collect(), super::NO_OPTIONS).await;
        shared.metrics.record(Operation::Put, started.elapsed());
        let results = match result {
            Ok(r) => r,
            Err(e) => (0..n).map(|_| Err(plugin_error(&e))).collect(),
        };
        let mut failed = Vec::new();
        let mut first_error = None;
        for ((key, value, is_trailer), r) in pending.into_iter().zip(results) {
            match r {
                Ok(()) if is_trailer => {}
                Ok(()) => {
                    shared.metrics.ingest_stored.fetch_add(1, Ordering::Relaxed);
                    shared.metrics.written_bytes.fetch_add(value.len() as u64, Ordering::Relaxed);
                }
                Err(e) => {
                    shared.metrics.error(Operation::Put, &e);
                    if first_error.is_none() {
                        first_error = Some(e);
                    }
                    failed.push((key, value, is_trailer));
                }
            }
        }
        let Some(error) = first_error else { break };
        if shared.retry_after(Operation::Put, &mut attempts, &error).await {
            pending = failed;
            continue;
        }
        // The PUT was answered from memory (write-behind): the store must
        // get the copy. Past the retry policy's deadline, while the store is
        // only unreachable, the blocks are kept (their bytes stay counted
        // against maxInFlight, so PUTs wait or skip at the bound as
        // `atBound` says) and offered again, less and less often.
        if super::retry::transient(&error) {
            outage_rounds += 1;
            if outage_rounds == 1 || outage_rounds % 30 == 0 {
                let named: Vec<String> = failed.iter().take(8).map(|(k, _, _)| String::from_utf8_lossy(k).into_owned()).collect();
                tracing::warn!(writes = failed.len(), keys = ?named, rounds = outage_rounds, %error, "second tier: the store is not taking writes; keeping the blocks and retrying until it does");
            }
            shared.metrics.retries.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(OUTAGE_RETRY_FIRST.saturating_mul(outage_rounds.min(20)).min(OUTAGE_RETRY_MAX)).await;
            attempts = Attempts::new();
            pending = failed;
            continue;
        }
        // Named, so a block that never reached the store can be traced (the
        // first few keys, and the count). A block whose trailer was not
        // written reads back as a miss.
        let blocks = failed.iter().filter(|(_, _, t)| !t).count();
        let named: Vec<String> = failed.iter().take(8).map(|(k, _, _)| String::from_utf8_lossy(k).into_owned()).collect();
        tracing::warn!(blocks, trailers = failed.len() - blocks, keys = ?named, %error, "second tier: given up, not written");
        // A block counts once, whether its bytes, its trailer or both failed.
        let lost: std::collections::HashSet<&[u8]> = failed.iter().map(|(k, _, _)| super::envelope::block_key(k)).collect();
        shared.metrics.ingest_failed.fetch_add(lost.len() as u64, Ordering::Relaxed);
        break;
    }
    shared.budget.give_back(total);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_budget_blocks_at_its_bound_and_wakes_on_release() {
        let b = Arc::new(Budget::new(100));
        assert!(b.try_take(60));
        assert!(!b.try_take(60), "60 + 60 is past the bound of 100");
        let waiter = {
            let b = Arc::clone(&b);
            tokio::spawn(async move { b.take(60).await })
        };
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        b.give_back(60);
        tokio::time::timeout(std::time::Duration::from_secs(10), waiter).await.expect("woken by the release").unwrap();
        assert_eq!(b.in_flight(), 60);
    }

    #[test]
    fn a_block_larger_than_the_bound_fits_an_empty_budget() {
        let b = Budget::new(10);
        assert!(b.try_take(1000));
        assert!(!b.try_take(1));
        b.give_back(1000);
        assert_eq!(b.in_flight(), 0);
    }
}
