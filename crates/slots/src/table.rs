//! The slot table: the hash from a key to its slot, the members of a pool,
//! and the owners of every slot.
//!
//! The table travels with a version so that a client holding an older one
//! can tell it is behind (the cluster protocol of the second-tier issue).

use std::fmt;

/// Number of hash slots: as many as Redis Cluster's, so that moving one
/// slot moves 1/16384 of the keys, yet a table of 16384 × R `u32` owners
/// stays well under a megabyte.
pub const SLOTS: u32 = 16384;

/// The slot `key` hashes to among `slots` slots.
#[inline]
pub fn slot_of(key: &[u8], slots: u32) -> u32 {
    crc32c::crc32c(key) % slots.max(1)
}

/// Where a member is in its life in the pool (the contract's `member-state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemberState {
    /// Registered, still filling; may receive new keys, serves no reads yet.
    Joining,
    /// Serving reads and writes.
    Up,
    /// Leaving: hands its keys on.
    Draining,
    /// Gone; owns nothing.
    Down,
}

impl MemberState {
    /// Whether a newly computed table may give this member keys: up or
    /// joining. A draining member hands its keys on and a down one owns
    /// nothing (a plugin may still keep a draining owner while keys move).
    pub fn may_own(self) -> bool {
        matches!(self, MemberState::Up | MemberState::Joining)
    }

    /// The state's name as the contract and etcd's member records spell
    /// it: `joining`, `up`, `draining` or `down`.
    pub fn name(self) -> &'static str {
        match self {
            MemberState::Joining => "joining",
            MemberState::Up => "up",
            MemberState::Draining => "draining",
            MemberState::Down => "down",
        }
    }
}

/// A member of the cache pool (the contract's `member`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Member {
    pub id: String,
    /// `host:port` of its wire protocol.
    pub endpoint: String,
    /// Failure domain; empty when unknown.
    pub zone: String,
    /// Relative share of keys.
    pub weight: u32,
    pub state: MemberState,
    /// Sorted by name.
    pub labels: Vec<(String, String)>,
}

impl Member {
    /// An `up` member of weight 100 with no zone or labels.
    pub fn up(id: impl Into<String>, endpoint: impl Into<String>) -> Member {
        Member { id: id.into(), endpoint: endpoint.into(), zone: String::new(), weight: 100, state: MemberState::Up, labels: Vec::new() }
    }
}

/// Why a slot table is not acceptable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlotTableError {
    /// `owners.len()` is not `slots * replicas`.
    WrongLength { expected: usize, found: usize },
    /// `replicas` is zero, more than were asked for or than members not down,
    /// or fewer than the up / joining members with a weight could give.
    WrongReplicas { replicas: u32, requested: u32, eligible: usize },
    /// An owner index past the end of the membership.
    UnknownMember { slot: u32, index: u32, members: usize },
    /// The same member twice in one slot.
    Duplicate { slot: u32, member: String },
    /// A `down` member owns a slot.
    DownOwner { slot: u32, member: String },
    /// Member ids are not unique.
    DuplicateMemberId(String),
}

impl fmt::Display for SlotTableError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SlotTableError::WrongLength { expected, found } => {
                write!(f, "the table has {found} owner entries, expected slots × replicas = {expected}")
            }
            SlotTableError::WrongReplicas { replicas, requested, eligible } => write!(
                f,
                "{replicas} owners per slot, expected at most min(requested {requested}, {eligible} members not down) and at least the up or joining members with a weight"
            ),
            SlotTableError::UnknownMember { slot, index, members } => {
                write!(f, "slot {slot} names member #{index}, but there are {members} members")
            }
            SlotTableError::Duplicate { slot, member } => write!(f, "slot {slot} lists member {member:?} twice"),
            SlotTableError::DownOwner { slot, member } => write!(f, "slot {slot} is owned by member {member:?}, which is down"),
            SlotTableError::DuplicateMemberId(id) => write!(f, "member id {id:?} appears more than once"),
        }
    }
}

impl std::error::Error for SlotTableError {}

/// Owners of every slot for one membership.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotTable {
    /// Increases with every membership change.
    pub version: u64,
    members: Vec<Member>,
    slots: u32,
    replicas: u32,
    /// `slots * replicas` member indices, slot-major.
    owners: Vec<u32>,
    /// Owners that must store a PUT before a client acknowledges it, as the
    /// cluster's nodes were configured (`cluster.writeQuorum`); `None` when
    /// the cluster does not say, and a client then waits for every owner.
    /// It travels with the table so that a client configured with nothing
    /// but a seed address writes as the operator of the cluster decided.
    write_quorum: Option<u32>,
}

impl SlotTable {
    /// Check `owners` against `members` and the contract, then build the
    /// table. `requested` is the replica count the plugin was asked for.
    pub fn new(
        version: u64,
        members: Vec<Member>,
        slots: u32,
        requested: u32,
        replicas: u32,
        owners: Vec<u32>,
    ) -> Result<SlotTable, SlotTableError> {
        let mut ids: Vec<&str> = members.iter().map(|m| m.id.as_str()).collect();
        ids.sort_unstable();
        if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
            return Err(SlotTableError::DuplicateMemberId(w[0].to_owned()));
        }
        // Owners per slot: at most min(requested, members not down); at
        // least min(requested, members that should own — up or joining with
        // a weight). Between the two a plugin may keep draining or
        // zero-weight members as extra owners while keys move.
        let eligible = members.iter().filter(|m| m.state != MemberState::Down).count();
        let preferred = members.iter().filter(|m| m.state.may_own() && m.weight > 0).count();
        let most = (requested as usize).min(eligible);
        let least = (requested as usize).min(preferred).max(usize::from(most > 0));
        if !(least..=most).contains(&(replicas as usize)) || (replicas == 0 && slots > 0) {
            return Err(SlotTableError::WrongReplicas { replicas, requested, eligible });
        }
        let expected = slots as usize * replicas as usize;
        if owners.len() != expected {
            return Err(SlotTableError::WrongLength { expected, found: owners.len() });
        }
        // With no owners at all (no slots, or nobody eligible) `owners` is
        // empty; `chunks_exact` only needs a non-zero width.
        for (slot, set) in owners.chunks_exact(replicas.max(1) as usize).enumerate() {
            let slot = slot as u32;
            for (j, &index) in set.iter().enumerate() {
                let Some(member) = members.get(index as usize) else {
                    return Err(SlotTableError::UnknownMember { slot, index, members: members.len() });
                };
                if member.state == MemberState::Down {
                    return Err(SlotTableError::DownOwner { slot, member: member.id.clone() });
                }
                if set[..j].contains(&index) {
                    return Err(SlotTableError::Duplicate { slot, member: member.id.clone() });
                }
            }
        }
        Ok(SlotTable { version, members, slots, replicas, owners, write_quorum: None })
    }

    pub fn members(&self) -> &[Member] {
        &self.members
    }

    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// Owners per slot.
    pub fn replicas(&self) -> u32 {
        self.replicas
    }

    /// The cluster's write quorum, if it states one. It is the configured
    /// number and is not capped at [`replicas`](Self::replicas): a table
    /// computed while fewer members than `W` can own keys has fewer owners
    /// per slot than `W`, and a PUT then fails rather than being
    /// acknowledged with fewer copies than the operator asked for.
    pub fn write_quorum(&self) -> Option<u32> {
        self.write_quorum
    }

    /// The same table stating `write_quorum` (`None`: not stated).
    pub fn with_write_quorum(mut self, write_quorum: Option<u32>) -> SlotTable {
        self.write_quorum = write_quorum;
        self
    }

    /// The raw owner indices, slot-major (for encoding the table).
    pub fn owner_indices(&self) -> &[u32] {
        &self.owners
    }

    /// Owner indices of `slot`, primary first; none for a slot the table
    /// does not have (a table of no slots, as a membership of no eligible
    /// member gives, owns nothing).
    #[inline]
    pub fn slot_owners(&self, slot: u32) -> &[u32] {
        let r = self.replicas as usize;
        let start = slot as usize * r;
        self.owners.get(start..start + r).unwrap_or(&[])
    }

    /// Owner indices of `key`, primary first: one hash and a slice index.
    #[inline]
    pub fn owners_of(&self, key: &[u8]) -> &[u32] {
        self.slot_owners(slot_of(key, self.slots))
    }

    /// The owning members of `key`, primary first.
    pub fn owner_members(&self, key: &[u8]) -> impl Iterator<Item = &Member> + '_ {
        self.owners_of(key).iter().map(|&i| &self.members[i as usize])
    }

    /// Owners a PUT or DELETE of `key` goes to, primary first: every owner
    /// not down. (An iterator over the table's slice: no allocation per key.)
    pub fn writable_owners<'a>(&'a self, key: &[u8]) -> impl Iterator<Item = u32> + 'a {
        self.owners_of(key).iter().copied().filter(|&o| self.members[o as usize].state != MemberState::Down)
    }

    /// Owners to read `key` from, in the order to try them: up ones first
    /// (primary first), then draining or joining ones, in table order (a
    /// draining owner holds its keys until it has handed them on; a joining
    /// one has had every write since it joined, writes going to every owner
    /// not down); never a down one.
    pub fn readable_owners<'a>(&'a self, key: &[u8]) -> impl Iterator<Item = u32> + 'a {
        let owners = self.owners_of(key);
        let state = |o: &u32| self.members[*o as usize].state;
        let up = owners.iter().copied().filter(move |o| state(o) == MemberState::Up);
        let rest = owners.iter().copied().filter(move |o| matches!(state(o), MemberState::Draining | MemberState::Joining));
        up.chain(rest)
    }

    /// Fraction of slots whose primary differs between `self` and `other`,
    /// compared by member id (how much a membership change moved).
    pub fn moved_fraction(&self, other: &SlotTable) -> f64 {
        if self.slots != other.slots || self.slots == 0 {
            return 1.0;
        }
        let moved = (0..self.slots)
            .filter(|&s| {
                let a = &self.members[self.slot_owners(s)[0] as usize].id;
                let b = &other.members[other.slot_owners(s)[0] as usize].id;
                a != b
            })
            .count();
        moved as f64 / self.slots as f64
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_table_of_no_slots_or_no_owners_owns_nothing_and_does_not_panic() {
        use super::*;
        // What a wire decoder may be handed: found by fuzzing CLUSTER_TABLE_RESULT.
        let t = SlotTable::new(1, vec![], 0, 0, 0, vec![]).unwrap();
        assert!(t.owners_of(b"k").is_empty());
        let down = Member { state: MemberState::Down, ..Member::up("a", "10.0.0.1:1") };
        let t = SlotTable::new(1, vec![down], 0, 2, 0, vec![]).unwrap();
        assert!(t.owners_of(b"k").is_empty() && t.slot_owners(99).is_empty());
        assert!(SlotTable::new(1, vec![], 4, 0, 0, vec![]).is_err(), "slots without owners");
    }

    use super::*;

    fn members(n: usize) -> Vec<Member> {
        (0..n).map(|i| Member::up(format!("n{i}"), format!("10.0.0.{i}:9600"))).collect()
    }

    fn round_robin(n: u32, slots: u32, r: u32) -> Vec<u32> {
        (0..slots).flat_map(|s| (0..r).map(move |j| (s + j) % n)).collect()
    }

    #[test]
    fn keys_map_to_their_slot_owners() {
        let t = SlotTable::new(1, members(3), 8, 2, 2, round_robin(3, 8, 2)).unwrap();
        let key = b"some-key";
        let slot = slot_of(key, 8);
        assert_eq!(t.owners_of(key), &[slot % 3, (slot + 1) % 3]);
        let ids: Vec<&str> = t.owner_members(key).map(|m| m.id.as_str()).collect();
        assert_eq!(ids.len(), 2);
        assert_ne!(ids[0], ids[1]);
    }

    #[test]
    fn reads_try_up_owners_first_then_the_others_in_table_order() {
        use MemberState::*;
        let states = [Joining, Draining, Up, Down];
        let mut m = members(4);
        for (m, state) in m.iter_mut().zip(states) {
            m.state = state;
        }
        // Every slot: n0 (joining), n1 (draining), n2 (up); n3 is down and
        // may own none (the table refuses it: see below).
        let t = SlotTable::new(1, m, 4, 3, 3, [0, 1, 2].repeat(4)).unwrap();
        assert_eq!(t.writable_owners(b"k").collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(t.readable_owners(b"k").collect::<Vec<_>>(), [2, 0, 1]);
        assert_eq!(states.map(MemberState::may_own), [true, false, true, false]);
        assert_eq!(states.map(MemberState::name), ["joining", "draining", "up", "down"]);
    }

    #[test]
    fn tables_breaking_the_contract_are_refused_with_the_slot_named() {
        let ok = round_robin(3, 4, 2);
        assert!(matches!(
            SlotTable::new(1, members(3), 4, 2, 2, ok[..7].to_vec()),
            Err(SlotTableError::WrongLength { expected: 8, found: 7 })
        ));
        let mut bad = ok.clone();
        bad[3] = 9;
        assert_eq!(SlotTable::new(1, members(3), 4, 2, 2, bad).unwrap_err().to_string(), "slot 1 names member #9, but there are 3 members");
        let mut dup = ok.clone();
        dup[5] = dup[4];
        assert!(matches!(SlotTable::new(1, members(3), 4, 2, 2, dup), Err(SlotTableError::Duplicate { slot: 2, .. })));
        let mut m = members(3);
        m[0].state = MemberState::Down;
        assert!(matches!(SlotTable::new(1, m, 4, 2, 2, ok.clone()), Err(SlotTableError::DownOwner { .. })));
        // A draining member may still own, so 2 or 3 owners of 3 requested
        // are both fine; a down one may not.
        let mut m = members(3);
        m[2].state = MemberState::Draining;
        assert!(SlotTable::new(1, m.clone(), 4, 3, 2, round_robin(2, 4, 2)).is_ok());
        assert!(SlotTable::new(1, m, 4, 3, 3, round_robin(3, 4, 3)).is_ok());
        // Two members can own, so three replicas cannot be.
        assert!(matches!(SlotTable::new(1, members(2), 4, 3, 3, round_robin(2, 4, 3)), Err(SlotTableError::WrongReplicas { .. })));
        let mut same = members(2);
        same[1].id = "n0".into();
        assert!(matches!(SlotTable::new(1, same, 4, 1, 1, round_robin(2, 4, 1)), Err(SlotTableError::DuplicateMemberId(_))));
    }

    #[test]
    fn a_table_states_no_write_quorum_until_given_one() {
        let t = SlotTable::new(1, members(3), 4, 2, 2, round_robin(3, 4, 2)).unwrap();
        assert_eq!(t.write_quorum(), None);
        let t = t.with_write_quorum(Some(1));
        assert_eq!(t.write_quorum(), Some(1));
        assert_eq!(t.clone().with_write_quorum(None).write_quorum(), None);
    }

    #[test]
    fn slot_hash_is_crc32c() {
        // Clients in other languages must agree: crc32c("123456789") = 0xe3069283.
        assert_eq!(slot_of(b"123456789", 1 << 31), 0xe306_9283 % (1 << 31));
        assert_eq!(slot_of(b"123456789", SLOTS), 0xe306_9283 % SLOTS);
    }
}
