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
//!   Time spent waiting for the budget counts against the clock too: frames
//!   queued behind stalled ones are cut when their own time is up, so the
//!   queue empties at the pace of the clock and a frame that arrives later
//!   gets the budget within one allowance. (Were the wait added, every
//!   queued stalled frame would hold the budget for a full allowance in
//!   turn, and an honest frame behind them would wait for all of them.)

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// The node-wide receive budget.
pub(crate) struct ReceiveBudget {
    permits: Arc<Semaphore>,
    bytes: usize,
    /// Reservations that had to wait for the budget.
    pub(crate) waits: AtomicU64,
}

/// Bytes of the budget held until dropped.
#[derive(Default)]
pub(crate) struct Reserved {
    _permit: Option<OwnedSemaphorePermit>,
}

impl ReceiveBudget {
    pub(crate) fn new(bytes: usize) -> ReceiveBudget {
        ReceiveBudget { permits: Arc::new(Semaphore::new(bytes)), bytes, waits: AtomicU64::new(0) }
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
    pub(crate) async fn reserve(&self, n: usize) -> Reserved {
        if n == 0 {
            return Reserved { _permit: None };
        }
        let n = u32::try_from(n.min(self.bytes)).unwrap_or(u32::MAX);
        if let Ok(p) = Arc::clone(&self.permits).try_acquire_many_owned(n) {
            return Reserved { _permit: Some(p) };
        }
        self.waits.fetch_add(1, Ordering::Relaxed);
        Reserved { _permit: Arc::clone(&self.permits).acquire_many_owned(n).await.ok() }
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
    /// When a frame of `frame_len` bytes whose header began now must be in.
    pub(crate) fn deadline(&self, frame_len: u64) -> Instant {
        Instant::now() + self.allowance(frame_len)
    }

    pub(crate) fn allowance(&self, frame_len: u64) -> Duration {
        self.grace + Duration::from_secs_f64(frame_len as f64 / self.min_rate.max(1) as f64)
    }
}

/// A frame did not arrive in time.
#[derive(Debug)]
pub(crate) struct Stalled;

/// `read` under `deadline`.
pub(crate) async fn within<T>(deadline: Instant, read: impl std::future::Future<Output = T>) -> Result<T, Stalled> {
    tokio::time::timeout_at(deadline, read).await.map_err(|_| Stalled)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_spent_budget_makes_the_next_reservation_wait_until_one_is_given_back() {
        let budget = Arc::new(ReceiveBudget::new(100));
        let held = budget.reserve(80).await;
        assert_eq!(budget.used_bytes(), 80);
        let b = Arc::clone(&budget);
        let waiting = tokio::spawn(async move { b.reserve(40).await });
        while budget.waits.load(Ordering::Relaxed) == 0 {
            tokio::task::yield_now().await;
        }
        assert!(!waiting.is_finished(), "40 more bytes do not fit in 100 with 80 held");
        drop(held);
        let _second = waiting.await.unwrap();
        assert_eq!(budget.used_bytes(), 40);
    }

    #[test]
    fn a_frame_gets_the_grace_plus_its_length_at_the_minimum_rate() {
        let clock = FrameClock { grace: Duration::from_secs(10), min_rate: 1 << 20 };
        assert_eq!(clock.allowance(128 << 20), Duration::from_secs(10 + 128));
        assert_eq!(clock.allowance(0), Duration::from_secs(10));
    }
}
