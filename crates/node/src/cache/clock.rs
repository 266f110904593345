//! The time the cache reads for pin leases.
//!
//! Injected through [`CacheConfig::clock`](super::CacheConfig::clock) so that
//! lease tests advance a [`ManualClock`] instead of sleeping past a lease and
//! hoping the machine kept up. The cache asks for the time once per call that
//! needs it (one dynamic call where it used to call `Instant::now()`), so the
//! indirection costs nothing measurable next to the shard lock.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A source of monotonic time.
pub trait Clock: Send + Sync + fmt::Debug {
    fn now(&self) -> Instant;
}

/// The real monotonic clock: what a node runs with.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    #[inline]
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// A clock that stands still until [`ManualClock::advance`] moves it, for
/// tests: a lease expires exactly when the test says so, however slow the
/// machine is.
#[derive(Debug)]
pub struct ManualClock {
    origin: Instant,
    /// Nanoseconds since `origin`.
    elapsed: AtomicU64,
}

impl ManualClock {
    /// Starts at the current real time and stays there.
    pub fn new() -> ManualClock {
        ManualClock { origin: Instant::now(), elapsed: AtomicU64::new(0) }
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        let nanos = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        let _ = self.elapsed.fetch_update(Ordering::AcqRel, Ordering::Acquire, |e| Some(e.saturating_add(nanos)));
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        ManualClock::new()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.origin + Duration::from_nanos(self.elapsed.load(Ordering::Acquire))
    }
}
