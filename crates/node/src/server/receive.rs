//! Bounds on frames still arriving: the receive budget and the frame clock.
//!
//! A PUT's payload is read straight into pool blocks, so a block is
//! allocated (and may evict a stored one) before its bytes arrive. Without a
//! bound, a client that declares large blocks and then stalls makes the node
//! evict stored blocks for memory nobody fills. Two bounds stop that:
//!
//! - The **receive budget** (`--receive-budget`): bytes held for frames
//!   still arriving (request metas buffered, PUT blocks allocated but not
//!   yet filled), node-wide, apart from the cache. A connection reserves a
//!   frame's meta and then each block before it allocates; when the budget
//!   is spent it waits, holding nothing, until other frames arrive or are
//!   cut. Per connection at most one meta (≤ the longest legal meta) and one
//!   block (≤ the largest block) are held at a time, since a connection's
//!   frames are read one after another.
//! - The **frame clock** (`--frame-grace`, `--min-receive-rate`): once a
//!   frame's header has started to arrive, the whole frame must be in
//!   within the grace plus its length at the minimum rate. A legal 128 MiB
//!   frame on a slow link is not cut; a stalled one is answered `timeout`
//!   and its connection closed, which gives back everything it reserved.
//!   One peer (see `admission.rs`) may hold at most its share of the
//!   budget (`--receive-budget-per-peer`): a client that stalls many frames
//!   fills its own share, and another peer's frames still find room.
//!   Time spent waiting for the budget counts against the clock too: frames
//!   queued behind stalled ones are cut when their own time is up, so the
//!   queue empties at the pace of the clock and a frame that arrives later
//!   gets the budget within one allowance. (Were the wait added, every
//!   queued stalled frame would hold the budget for a full allowance in
//!   turn, and an honest frame behind them would wait for all of them.)

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvplane_protocol::io::timeout_if_pending;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::admission::{Peer, MAX_TRACKED_PEERS};

/// The node-wide receive budget, and each peer's share of it.
pub(crate) struct ReceiveBudget {
    permits: Arc<Semaphore>,
    bytes: usize,
    /// Most one peer may hold at once.
    per_peer: usize,
    peers: Mutex<HashMap<Peer, Arc<Semaphore>>>,
    /// Reservations that had to wait for the budget (or their peer's share).
    pub(crate) waits: AtomicU64,
}

/// One peer's share of the budget, as a connection of it holds it.
pub(crate) struct PeerShare(Arc<Semaphore>);

/// Bytes of the budget (and of the peer's share) held until dropped.
#[derive(Default)]
pub(crate) struct Reserved {
    _peer: Option<OwnedSemaphorePermit>,
    _permit: Option<OwnedSemaphorePermit>,
}

impl ReceiveBudget {
    pub(crate) fn new(bytes: usize, per_peer: usize) -> ReceiveBudget {
        ReceiveBudget {
            permits: Arc::new(Semaphore::new(bytes)),
            bytes,
            per_peer: per_peer.clamp(1, bytes.max(1)),
            peers: Mutex::default(),
            waits: AtomicU64::new(0),
        }
    }

    pub(crate) fn per_peer_bytes(&self) -> usize {
        self.per_peer
    }

    /// `peer`'s share, made on first use; a connection takes it once, when
    /// it starts, so reserving takes no lock. Shares no connection holds are
    /// forgotten once many peers were seen, so the table stays small.
    pub(crate) fn share(&self, peer: Peer) -> PeerShare {
        PeerShare(self.share_of(peer))
    }

    fn share_of(&self, peer: Peer) -> Arc<Semaphore> {
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        if peers.len() >= MAX_TRACKED_PEERS && !peers.contains_key(&peer) {
            peers.retain(|_, s| Arc::strong_count(s) > 1 || s.available_permits() < self.per_peer);
        }
        Arc::clone(peers.entry(peer).or_insert_with(|| Arc::new(Semaphore::new(self.per_peer))))
    }

    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    pub(crate) fn used_bytes(&self) -> usize {
        self.bytes.saturating_sub(self.permits.available_permits())
    }

    /// Reserves `n` bytes, waiting while the budget is spent. The node checks at start that the budget holds
    /// the longest meta and the largest block together, so one connection
    /// alone always gets what it needs; `n` above the whole budget (a
    /// caller's bug) is capped to it rather than waiting forever.
    pub(crate) async fn reserve(&self, share: &PeerShare, n: usize) -> Reserved {
        if n == 0 {
            return Reserved::default();
        }
        // The peer's share first: a peer over it waits without holding any
        // of the node's budget.
        let own = u32::try_from(n.min(self.per_peer)).unwrap_or(u32::MAX);
        let peer_permit = self.take(Arc::clone(&share.0), own).await;
        let n = u32::try_from(n.min(self.bytes)).unwrap_or(u32::MAX);
        let permit = self.take(Arc::clone(&self.permits), n).await;
        Reserved { _peer: peer_permit, _permit: permit }
    }

    async fn take(&self, from: Arc<Semaphore>, n: u32) -> Option<OwnedSemaphorePermit> {
        if let Ok(p) = Arc::clone(&from).try_acquire_many_owned(n) {
            return Some(p);
        }
        self.waits.fetch_add(1, Ordering::Relaxed);
        from.acquire_many_owned(n).await.ok()
    }
}

/// How long a frame may take to arrive.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FrameClock {
    pub(crate) grace: Duration,
    /// Bytes per second a frame must keep up on average after the grace.
    pub(crate) min_rate: u64,
}

impl FrameClock {
    /// When a frame of `frame_len` bytes whose header was in at `from` must
    /// be in whole.
    pub(crate) fn deadline(&self, from: std::time::Instant, frame_len: u64) -> Instant {
        Instant::from_std(from) + self.allowance(frame_len)
    }

    pub(crate) fn allowance(&self, frame_len: u64) -> Duration {
        self.grace + Duration::from_secs_f64(frame_len as f64 / self.min_rate.max(1) as f64)
    }
}

/// A frame did not arrive in time.
#[derive(Debug)]
pub(crate) struct Stalled;

/// `read` under `deadline`; a read that needs no waiting (its bytes are
/// buffered) makes no timer (see `timeout_if_pending`).
pub(crate) async fn within<T>(deadline: Instant, read: impl std::future::Future<Output = T>) -> Result<T, Stalled> {
    timeout_if_pending(|| deadline, read).await.ok_or(Stalled)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PEER: Peer = Peer::Uid(1);

    #[tokio::test]
    async fn a_spent_budget_makes_the_next_reservation_wait_until_one_is_given_back() {
        let budget = Arc::new(ReceiveBudget::new(100, 100));
        let held = budget.reserve(&budget.share(PEER), 80).await;
        assert_eq!(budget.used_bytes(), 80);
        let b = Arc::clone(&budget);
        let waiting = tokio::spawn(async move { b.reserve(&b.share(Peer::Uid(2)), 40).await });
        while budget.waits.load(Ordering::Relaxed) == 0 {
            tokio::task::yield_now().await;
        }
        assert!(!waiting.is_finished(), "40 more bytes do not fit in 100 with 80 held");
        drop(held);
        let _second = waiting.await.unwrap();
        assert_eq!(budget.used_bytes(), 40);
    }

    #[tokio::test]
    async fn a_peer_past_its_share_waits_while_another_peer_is_served() {
        let budget = Arc::new(ReceiveBudget::new(100, 30));
        let _held = budget.reserve(&budget.share(PEER), 30).await;
        let b = Arc::clone(&budget);
        let same_peer = tokio::spawn(async move { b.reserve(&b.share(PEER), 10).await });
        while budget.waits.load(Ordering::Relaxed) == 0 {
            tokio::task::yield_now().await;
        }
        assert!(!same_peer.is_finished(), "the peer holds its whole share");
        let other = tokio::time::timeout(Duration::from_secs(10), budget.reserve(&budget.share(Peer::Uid(2)), 30)).await;
        assert!(other.is_ok(), "another peer found room");
        assert_eq!(budget.used_bytes(), 60);
    }

    #[test]
    fn a_frame_gets_the_grace_plus_its_length_at_the_minimum_rate() {
        let clock = FrameClock { grace: Duration::from_secs(10), min_rate: 1 << 20 };
        assert_eq!(clock.allowance(128 << 20), Duration::from_secs(10 + 128));
        assert_eq!(clock.allowance(0), Duration::from_secs(10));
    }
}
