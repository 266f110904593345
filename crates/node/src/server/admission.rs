//! Who may hold a connection: a share of the slots per peer, and a brake on
//! peers that keep failing the handshake.
//!
//! Both are decided at accept time, before a connection task exists, so a
//! peer that is refused costs the node one short write. A peer is a TCP
//! client's IP address (its ports are free to pick, its address is not) or
//! a Unix-socket client's uid from `SO_PEERCRED` (every process of one user
//! counts as one peer). Both tables hold one entry per peer that currently
//! has a connection or a recent failure, and the failure table is capped at
//! [`MAX_TRACKED_PEERS`], so a flood from many addresses cannot grow them
//! without bound.

use std::collections::HashMap;
use std::fmt;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Who is on the other end of a connection, for per-peer bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Peer {
    Ip(IpAddr),
    Uid(u32),
    /// A Unix-socket client whose credentials could not be read: all such
    /// connections share one entry, which errs on the side of refusing.
    Unknown,
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Peer::Ip(ip) => write!(f, "{ip}"),
            Peer::Uid(uid) => write!(f, "unix uid {uid}"),
            Peer::Unknown => f.write_str("unix peer of unknown uid"),
        }
    }
}

/// Connections per peer, against the share one peer may hold.
pub(crate) struct PeerSlots {
    limit: usize,
    held: Mutex<HashMap<Peer, usize>>,
}

/// One connection's place in its peer's share; given back when dropped.
pub(crate) struct PeerSlot {
    slots: Arc<PeerSlots>,
    peer: Peer,
}

impl PeerSlots {
    pub(crate) fn new(limit: usize) -> Arc<PeerSlots> {
        Arc::new(PeerSlots { limit: limit.max(1), held: Mutex::default() })
    }

    pub(crate) fn limit(&self) -> usize {
        self.limit
    }

    /// A slot for `peer`, or `None` when it already holds its share.
    pub(crate) fn acquire(self: &Arc<Self>, peer: Peer) -> Option<PeerSlot> {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let n = held.entry(peer).or_insert(0);
        if *n >= self.limit {
            return None;
        }
        *n += 1;
        Some(PeerSlot { slots: Arc::clone(self), peer })
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut held = self.slots.held.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = held.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.peer);
            }
        }
    }
}

/// Peers whose handshake failures are remembered at once; past it the
/// oldest windows are forgotten first.
pub(crate) const MAX_TRACKED_PEERS: usize = 4096;

/// How long failures are counted together.
pub(crate) const FAILURE_WINDOW: Duration = Duration::from_secs(60);

/// Failed handshakes (wrong or missing token, malformed or silent HELLO,
/// unsupported version) per peer in a [`FAILURE_WINDOW`]. A peer over the
/// limit is refused at accept until its window ends: guessing a token then
/// costs a minute per `limit` guesses instead of one round trip each.
pub(crate) struct HandshakeThrottle {
    limit: u32,
    windows: Mutex<HashMap<Peer, Window>>,
}

#[derive(Clone, Copy)]
struct Window {
    started: Instant,
    failures: u32,
}

/// What [`HandshakeThrottle::failed`] decided, for the log.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum FailureSeen {
    /// The first in this peer's window: worth a warning.
    First,
    /// Counted, not logged again (the log is sampled per peer and window).
    Again,
    /// This failure reached the limit: the peer is refused from now on.
    Throttled { failures: u32 },
}

impl HandshakeThrottle {
    pub(crate) fn new(limit: u32) -> HandshakeThrottle {
        HandshakeThrottle { limit: limit.max(1), windows: Mutex::default() }
    }

    pub(crate) fn limit(&self) -> u32 {
        self.limit
    }

    /// `Some(wait)` when `peer` is over its limit: refuse it, and say when
    /// it may try again.
    pub(crate) fn refuses(&self, peer: Peer, now: Instant) -> Option<Duration> {
        let windows = self.windows.lock().unwrap_or_else(|e| e.into_inner());
        let w = windows.get(&peer)?;
        let ends = w.started + FAILURE_WINDOW;
        (w.failures >= self.limit && now < ends).then(|| ends - now)
    }

    /// Counts one failed handshake of `peer`.
    pub(crate) fn failed(&self, peer: Peer, now: Instant) -> FailureSeen {
        let mut windows = self.windows.lock().unwrap_or_else(|e| e.into_inner());
        if windows.len() >= MAX_TRACKED_PEERS && !windows.contains_key(&peer) {
            windows.retain(|_, w| now.saturating_duration_since(w.started) < FAILURE_WINDOW);
            if windows.len() >= MAX_TRACKED_PEERS {
                if let Some(oldest) = windows.iter().min_by_key(|(_, w)| w.started).map(|(p, _)| *p) {
                    windows.remove(&oldest);
                }
            }
        }
        let w = windows.entry(peer).or_insert(Window { started: now, failures: 0 });
        if now.saturating_duration_since(w.started) >= FAILURE_WINDOW {
            *w = Window { started: now, failures: 0 };
        }
        w.failures = w.failures.saturating_add(1);
        match w.failures {
            1 => FailureSeen::First,
            n if n == self.limit => FailureSeen::Throttled { failures: n },
            _ => FailureSeen::Again,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_holds_at_most_its_share_and_gets_it_back() {
        let slots = PeerSlots::new(2);
        let a = Peer::Ip("10.0.0.1".parse().unwrap());
        let b = Peer::Uid(1000);
        let first = slots.acquire(a).unwrap();
        let _second = slots.acquire(a).unwrap();
        assert!(slots.acquire(a).is_none(), "a third connection of one peer");
        assert!(slots.acquire(b).is_some(), "another peer is not affected");
        drop(first);
        assert!(slots.acquire(a).is_some(), "a slot given back is free again");
    }

    #[test]
    fn failed_handshakes_throttle_a_peer_until_its_window_ends() {
        let throttle = HandshakeThrottle::new(3);
        let peer = Peer::Ip("10.0.0.2".parse().unwrap());
        let t0 = Instant::now();
        assert_eq!(throttle.failed(peer, t0), FailureSeen::First);
        assert_eq!(throttle.failed(peer, t0), FailureSeen::Again);
        assert!(throttle.refuses(peer, t0).is_none());
        assert_eq!(throttle.failed(peer, t0), FailureSeen::Throttled { failures: 3 });
        let wait = throttle.refuses(peer, t0 + Duration::from_secs(10)).expect("throttled");
        assert_eq!(wait, FAILURE_WINDOW - Duration::from_secs(10));
        assert!(throttle.refuses(Peer::Uid(7), t0).is_none(), "only the failing peer");
        assert!(throttle.refuses(peer, t0 + FAILURE_WINDOW).is_none(), "the window ended");
        assert_eq!(throttle.failed(peer, t0 + FAILURE_WINDOW), FailureSeen::First, "a new window");
    }

    #[test]
    fn the_failure_table_stays_within_its_cap() {
        let throttle = HandshakeThrottle::new(3);
        let t0 = Instant::now();
        for i in 0..(MAX_TRACKED_PEERS as u32 + 100) {
            throttle.failed(Peer::Uid(i), t0 + Duration::from_millis(i as u64));
        }
        assert_eq!(throttle.windows.lock().unwrap().len(), MAX_TRACKED_PEERS);
    }
}
