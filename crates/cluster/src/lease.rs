//! When a member's lease is still surely alive, in the member's own clock.
//!
//! The member cannot see etcd's countdown, only when it asked for a renewal
//! and what TTL came back. etcd restarted the countdown at some moment after
//! the request was sent, so "sent + TTL" is a lower bound of etcd's expiry:
//! a member that believes itself expired from that moment on never believes
//! itself registered while the others may already see it gone. The times are
//! passed in, never read here, so the rule is tested without waiting.

use std::time::Duration;

use tokio::time::Instant;

#[derive(Debug, Clone)]
pub(crate) struct LeaseClock {
    ttl: Duration,
    expires: Instant,
    next_renewal: Instant,
}

impl LeaseClock {
    /// A lease of `ttl` granted by a request sent at `sent`.
    pub(crate) fn granted(sent: Instant, ttl: Duration) -> LeaseClock {
        LeaseClock { ttl, expires: sent + ttl, next_renewal: sent + ttl / 3 }
    }

    /// A renewal sent at `sent` was confirmed with `ttl` left.
    pub(crate) fn renewed(&mut self, sent: Instant, ttl: Duration) {
        self.ttl = ttl;
        self.expires = self.expires.max(sent + ttl);
        self.next_renewal = sent + ttl / 3;
    }

    /// A renewal failed at `now`: try again soon, a few times before expiry.
    pub(crate) fn failed(&mut self, now: Instant) {
        self.next_renewal = now + (self.ttl / 10).clamp(Duration::from_millis(100), Duration::from_secs(1));
    }

    pub(crate) fn expired(&self, now: Instant) -> bool {
        now >= self.expires
    }

    pub(crate) fn expires(&self) -> Instant {
        self.expires
    }

    pub(crate) fn ttl(&self) -> Duration {
        self.ttl
    }

    /// When to wake up next: to renew, or to declare the lease gone.
    pub(crate) fn next_wakeup(&self) -> Instant {
        self.next_renewal.min(self.expires)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn renewals_are_a_third_of_the_ttl_apart_and_expiry_counts_from_sending() {
        let t0 = Instant::now();
        let mut lease = LeaseClock::granted(t0, 3 * S);
        assert_eq!(lease.next_wakeup(), t0 + S);
        assert!(!lease.expired(t0 + 3 * S - Duration::from_millis(1)));
        assert!(lease.expired(t0 + 3 * S));
        // Sent at t0 + 1 s, confirmed much later: still t0 + 1 s + TTL.
        lease.renewed(t0 + S, 3 * S);
        assert_eq!(lease.expires(), t0 + 4 * S);
        assert_eq!(lease.next_wakeup(), t0 + 2 * S);
    }

    #[test]
    fn failures_retry_quickly_but_never_past_expiry() {
        let t0 = Instant::now();
        let mut lease = LeaseClock::granted(t0, 2 * S);
        lease.failed(t0 + S);
        assert_eq!(lease.next_wakeup(), t0 + S + Duration::from_millis(200));
        lease.failed(t0 + 2 * S - Duration::from_millis(50));
        assert_eq!(lease.next_wakeup(), t0 + 2 * S, "wakes to declare expiry, not later");
        assert!(lease.expired(lease.next_wakeup()));
    }

    #[test]
    fn a_late_confirmation_of_an_older_request_does_not_shorten_the_lease() {
        let t0 = Instant::now();
        let mut lease = LeaseClock::granted(t0 + S, 5 * S);
        lease.renewed(t0, 5 * S);
        assert_eq!(lease.expires(), t0 + 6 * S);
    }
}
