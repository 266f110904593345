//! The node's side of a descriptor: the lease that keeps a block pinned
//! while a remote reader may READ it.
//!
//! Why leases: a one-sided READ runs without the node's knowledge, so the
//! node must not evict, move or overwrite a block from the moment it hands
//! out a descriptor until the reader can no longer use it. A lease pins the
//! block by holding a clone of the caller's handle (an `Arc` to the block,
//! whatever keeps it alive in the pool) and drops it when the lease ends.
//! The reader, for its part, refuses a descriptor past its expiry
//! ([`Descriptor::usable_at`](kvplane_protocol::rdma::Descriptor::usable_at)), so the two
//! sides agree without another round trip.
//!
//! Why bounded: every lease pins memory that eviction cannot reclaim; a
//! client that asks for descriptors and never reads could otherwise pin the
//! whole pool. A full table first lets go of what has expired, then refuses.
//!
//! Why `now` is a parameter: the table reads no clock, so the node decides
//! when to sweep (on every grant, on a timer) and tests inject time.

use std::collections::HashMap;

/// Identifies one lease within one [`Leases`] table. Ids increase and are
/// never reused by a table, so an old id cannot name a newer lease.
pub type LeaseId = u64;

/// A granted lease: the id to put in the descriptor and its end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lease {
    pub id: LeaseId,
    pub expires_at_ms: u64,
}

/// Why a lease could not be granted or looked up.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    /// The table holds `capacity` live leases.
    #[error("all {capacity} leases are in use")]
    Full { capacity: usize },
    /// A lease of no time at all would expire before anyone could use it.
    #[error("a lease needs a positive duration")]
    ZeroTtl,
    /// The lease was granted here but has ended (expired, or handed back):
    /// the block may no longer be where the descriptor says.
    #[error("lease {id} has expired")]
    Expired { id: LeaseId },
    /// No lease with this id was ever granted by this table.
    #[error("lease {id} is unknown")]
    Unknown { id: LeaseId },
}

struct Entry<H> {
    handle: H,
    expires_at_ms: u64,
}

/// The node's table of live leases; `H` is what pins a block (typically an
/// `Arc` of it). Not internally synchronised: the node keeps it under its
/// own lock.
pub struct Leases<H> {
    live: HashMap<LeaseId, Entry<H>>,
    capacity: usize,
    first_id: LeaseId,
    next_id: LeaseId,
}

impl<H: Clone> Leases<H> {
    /// A table of at most `capacity` live leases, ids starting at 1.
    pub fn new(capacity: usize) -> Leases<H> {
        Leases::starting_at(capacity, 1)
    }

    /// A table whose first id is `first_id`. A node that restarts can start
    /// past every id it may have handed out before (its start time, say), so
    /// that a descriptor from before the restart is [`LeaseError::Unknown`]
    /// rather than taken for a lease of the new run.
    pub fn starting_at(capacity: usize, first_id: LeaseId) -> Leases<H> {
        Leases { live: HashMap::new(), capacity, first_id, next_id: first_id }
    }

    /// Pins `handle` (holds a clone of it) for `ttl_ms` from `now_ms`. When
    /// the table is full, expired leases are released first; if none has
    /// expired, [`LeaseError::Full`].
    pub fn grant(&mut self, handle: &H, now_ms: u64, ttl_ms: u64) -> Result<Lease, LeaseError> {
        if ttl_ms == 0 {
            return Err(LeaseError::ZeroTtl);
        }
        if self.live.len() >= self.capacity {
            self.release_expired(now_ms);
            if self.live.len() >= self.capacity {
                return Err(LeaseError::Full { capacity: self.capacity });
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        let expires_at_ms = now_ms.saturating_add(ttl_ms);
        self.live.insert(id, Entry { handle: handle.clone(), expires_at_ms });
        Ok(Lease { id, expires_at_ms })
    }

    /// The pinned handle of a lease that holds at `now_ms`; for a read after
    /// expiry, [`LeaseError::Expired`] (whether or not it was released yet),
    /// for an id never granted here, [`LeaseError::Unknown`].
    pub fn check(&self, id: LeaseId, now_ms: u64) -> Result<&H, LeaseError> {
        match self.live.get(&id) {
            Some(e) if now_ms < e.expires_at_ms => Ok(&e.handle),
            Some(_) => Err(LeaseError::Expired { id }),
            None if (self.first_id..self.next_id).contains(&id) => Err(LeaseError::Expired { id }),
            None => Err(LeaseError::Unknown { id }),
        }
    }

    /// Hands a lease back before its expiry (the reader is done): unpins its
    /// block now. Whether it was live.
    pub fn release(&mut self, id: LeaseId) -> bool {
        self.live.remove(&id).is_some()
    }

    /// Releases every lease that has expired at `now_ms` (drops its clone
    /// of the handle); how many.
    pub fn release_expired(&mut self, now_ms: u64) -> usize {
        let before = self.live.len();
        self.live.retain(|_, e| now_ms < e.expires_at_ms);
        before - self.live.len()
    }

    /// Leases held, expired or not, until the next release.
    pub fn len(&self) -> usize {
        self.live.len()
    }

    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The earliest expiry among the leases held: when a sweep next has work.
    pub fn next_expiry(&self) -> Option<u64> {
        self.live.values().map(|e| e.expires_at_ms).min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_lease_pins_until_released_after_expiry() {
        let block = Arc::new([1u8; 16]);
        let mut leases = Leases::new(4);
        let l = leases.grant(&block, 1_000, 50).unwrap();
        assert_eq!(l, Lease { id: 1, expires_at_ms: 1_050 });
        assert_eq!(Arc::strong_count(&block), 2, "the table holds a clone");

        assert!(Arc::ptr_eq(leases.check(l.id, 1_049).unwrap(), &block));
        assert_eq!(leases.release_expired(1_049), 0);
        assert_eq!(Arc::strong_count(&block), 2);

        // Expired but not yet swept: already refused, still pinned.
        assert_eq!(leases.check(l.id, 1_050), Err(LeaseError::Expired { id: 1 }));
        assert_eq!(Arc::strong_count(&block), 2);

        assert_eq!(leases.release_expired(1_050), 1);
        assert_eq!(Arc::strong_count(&block), 1, "released: the pin is gone");
        assert!(leases.is_empty());
        // After the sweep it is still known to have expired.
        assert_eq!(leases.check(l.id, 1_050), Err(LeaseError::Expired { id: 1 }));
    }

    #[test]
    fn unknown_ids() {
        let mut leases: Leases<Arc<u8>> = Leases::new(2);
        assert_eq!(leases.check(1, 0), Err(LeaseError::Unknown { id: 1 }));
        let l = leases.grant(&Arc::new(0), 0, 10).unwrap();
        assert_eq!(leases.check(l.id + 1, 0), Err(LeaseError::Unknown { id: l.id + 1 }));
        assert_eq!(leases.check(0, 0), Err(LeaseError::Unknown { id: 0 }));

        // A restarted node starting past its old ids does not mistake an old
        // descriptor for a lease of its own.
        let mut later: Leases<Arc<u8>> = Leases::starting_at(2, 1_000);
        assert_eq!(later.grant(&Arc::new(0), 0, 10).unwrap().id, 1_000);
        assert_eq!(later.check(l.id, 0), Err(LeaseError::Unknown { id: l.id }));
    }

    #[test]
    fn bounded_full_table_sweeps_then_refuses() {
        let block = Arc::new(0u32);
        let mut leases = Leases::new(2);
        let a = leases.grant(&block, 0, 10).unwrap();
        let b = leases.grant(&block, 0, 20).unwrap();
        assert_eq!(leases.grant(&block, 5, 10), Err(LeaseError::Full { capacity: 2 }));
        assert_eq!(Arc::strong_count(&block), 3);
        // At 10, `a` has expired: the grant releases it and takes its place.
        let c = leases.grant(&block, 10, 10).unwrap();
        assert_eq!(leases.len(), 2);
        assert_eq!(leases.check(a.id, 10), Err(LeaseError::Expired { id: a.id }));
        assert!(leases.check(b.id, 10).is_ok());
        assert!(leases.check(c.id, 10).is_ok());
        assert_eq!(Arc::strong_count(&block), 3);
        assert_eq!(leases.capacity(), 2);
    }

    #[test]
    fn early_release_and_ids_not_reused() {
        let block = Arc::new(());
        let mut leases = Leases::new(1);
        let a = leases.grant(&block, 0, 100).unwrap();
        assert!(leases.release(a.id));
        assert!(!leases.release(a.id));
        assert_eq!(Arc::strong_count(&block), 1);
        assert_eq!(leases.check(a.id, 1), Err(LeaseError::Expired { id: a.id }));
        let b = leases.grant(&block, 1, 100).unwrap();
        assert_ne!(a.id, b.id);
    }

    #[test]
    fn zero_ttl_and_saturation() {
        let mut leases = Leases::new(1);
        assert_eq!(leases.grant(&Arc::new(1), 0, 0), Err(LeaseError::ZeroTtl));
        let l = leases.grant(&Arc::new(1), u64::MAX - 1, 10).unwrap();
        assert_eq!(l.expires_at_ms, u64::MAX);
        assert_eq!(leases.next_expiry(), Some(u64::MAX));
    }

    #[test]
    fn next_expiry_is_the_earliest() {
        let mut leases = Leases::new(3);
        assert_eq!(leases.next_expiry(), None);
        leases.grant(&Arc::new(1), 0, 30).unwrap();
        leases.grant(&Arc::new(2), 0, 10).unwrap();
        assert_eq!(leases.next_expiry(), Some(10));
    }
}
