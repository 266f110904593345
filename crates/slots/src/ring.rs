//! Consistent hashing with virtual nodes: the algorithm behind
//! `builtin:ring`.
//!
//! Here, beside the slot table it computes, so that the Wasm plugin
//! (plugins/ring, which builds this crate for wasm32-wasip2) and the host's
//! native baseline (benchmarks, the fail-open default placement,
//! [`SlotTable::from_ring`]) run exactly the same code, and so that the
//! Python twin in `examples/plugins/python-ring` can be checked against it
//! (its `ring_vectors.json` holds outputs of this module, which
//! `tests/ring_vectors.rs` checks again on every test run).
//!
//! Each member contributes `vnodes` points on a 64-bit ring at
//! `hash(id || '#' || i)`. A key's owners are the distinct members met walking
//! clockwise from `hash(key)`. Adding or removing one of N members moves only
//! the keys whose arc it takes or gives up: about 1/N of them.

use crate::table::{Member, SlotTable, SlotTableError};

/// Default number of virtual nodes per member: enough for a spread within a
/// few percent at small N, cheap enough to rebuild on every membership change.
pub const DEFAULT_VNODES: u32 = 160;

/// 64-bit FNV-1a followed by the SplitMix64 finaliser. FNV alone clusters
/// short, similar inputs (`node-1#0`, `node-1#1`); the finaliser spreads them.
/// Chosen because it is a dozen lines in any language, so plugins written in
/// other languages can reproduce the ring bit for bit.
pub fn hash64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    mix64(h)
}

/// SplitMix64 finaliser.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Why a ring cannot answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RingError {
    /// The membership is empty.
    NoMembers,
    /// Zero replicas were asked for.
    ZeroReplicas,
    /// The same member id appears twice.
    DuplicateMember(String),
}

impl std::fmt::Display for RingError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RingError::NoMembers => write!(f, "the membership is empty"),
            RingError::ZeroReplicas => write!(f, "replicas must be at least 1"),
            RingError::DuplicateMember(id) => write!(f, "member id {id:?} appears more than once"),
        }
    }
}

impl std::error::Error for RingError {}

/// A consistent-hash ring over member ids.
#[derive(Debug, Clone, Default)]
pub struct Ring {
    members: Vec<String>,
    /// (point, index into `members`), sorted by point.
    points: Vec<(u64, u32)>,
}

impl Ring {
    /// Build a ring of `members` with `vnodes` points each (at least 1).
    pub fn new<S: AsRef<str>>(members: &[S], vnodes: u32) -> Result<Ring, RingError> {
        let weighted: Vec<(&str, u32)> = members.iter().map(|m| (m.as_ref(), vnodes.max(1))).collect();
        Ring::weighted(&weighted)
    }

    /// Build a ring where each member has its own number of points (its
    /// weight); a member with 0 points owns nothing but is still a member.
    pub fn weighted<S: AsRef<str>>(members: &[(S, u32)]) -> Result<Ring, RingError> {
        let mut sorted: Vec<(String, u32)> = members.iter().map(|(m, v)| (m.as_ref().to_owned(), *v)).collect();
        sorted.sort();
        if let Some(w) = sorted.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(RingError::DuplicateMember(w[0].0.clone()));
        }
        let total: usize = sorted.iter().map(|(_, v)| *v as usize).sum();
        let mut points = Vec::with_capacity(total);
        let mut label = Vec::new();
        let ids: Vec<String> = sorted.iter().map(|(id, _)| id.clone()).collect();
        for (index, (id, vnodes)) in sorted.iter().enumerate() {
            for v in 0..*vnodes {
                label.clear();
                label.extend_from_slice(id.as_bytes());
                label.push(b'#');
                label.extend_from_slice(v.to_string().as_bytes());
                points.push((hash64(&label), index as u32));
            }
        }
        // Ties between two members' points are broken by member order so the
        // ring is the same whatever order the membership arrived in.
        points.sort_unstable();
        Ok(Ring { members: ids, points })
    }

    /// Member ids, sorted.
    pub fn members(&self) -> &[String] {
        &self.members
    }

    /// Up to `replicas` distinct owners of `key`, primary first.
    pub fn owners(&self, key: &[u8], replicas: u32) -> Result<Vec<&str>, RingError> {
        let mut owners = Vec::new();
        self.owners_at(hash64(key), replicas, &mut owners)?;
        Ok(owners.into_iter().map(|m| self.members[m as usize].as_str()).collect())
    }

    /// The distinct owners met walking clockwise from `point`, as indices
    /// into [`members`](Self::members), into `owners` (cleared first).
    pub fn owners_at(&self, point: u64, replicas: u32, owners: &mut Vec<u32>) -> Result<(), RingError> {
        owners.clear();
        if replicas == 0 {
            return Err(RingError::ZeroReplicas);
        }
        if self.points.is_empty() {
            return Err(RingError::NoMembers);
        }
        let wanted = (replicas as usize).min(self.members.len());
        let start = self.points.partition_point(|&(p, _)| p < point);
        for step in 0..self.points.len() {
            let (_, m) = self.points[(start + step) % self.points.len()];
            if !owners.contains(&m) {
                owners.push(m);
                if owners.len() == wanted {
                    break;
                }
            }
        }
        Ok(())
    }
}

/// A member as the slot table sees it.
#[derive(Debug, Clone, Copy)]
pub struct SlotMember<'a> {
    pub id: &'a str,
    /// Relative share of keys; 100 is the usual weight, 0 owns nothing.
    pub weight: u32,
    /// Whether the member may own keys (up or joining; not draining or down).
    pub eligible: bool,
}

/// The slot table of the `builtin:ring` placement: slot `s` sits at
/// `hash64(s as u32 LE)` on a ring of the eligible members, each with
/// `vnodes * weight / 100` points (at least 1 for a non-zero weight), and is
/// owned by the first `replicas` distinct members clockwise from there.
/// Returns (owners per slot, `slots * that` indices into `members`).
pub fn slot_table(members: &[SlotMember<'_>], slots: u32, replicas: u32, vnodes: u32) -> Result<(u32, Vec<u32>), RingError> {
    if replicas == 0 {
        return Err(RingError::ZeroReplicas);
    }
    let owning: Vec<(usize, &SlotMember<'_>)> = members.iter().enumerate().filter(|(_, m)| m.eligible && m.weight > 0).collect();
    let weighted: Vec<(&str, u32)> =
        owning.iter().map(|(_, m)| (m.id, ((u64::from(vnodes) * u64::from(m.weight)) / 100).clamp(1, 1 << 16) as u32)).collect();
    let ring = Ring::weighted(&weighted)?;
    if ring.points.is_empty() {
        return Err(RingError::NoMembers);
    }
    // Ring member index (sorted by id) -> index in `members`.
    let back: Vec<u32> = ring
        .members
        .iter()
        .map(|id| owning.iter().find(|(_, m)| m.id == id).map(|(i, _)| *i as u32).expect("every ring member came from `members`"))
        .collect();
    let r = (replicas as usize).min(ring.members.len()) as u32;
    let mut table = Vec::with_capacity(slots as usize * r as usize);
    let mut owners = Vec::with_capacity(r as usize);
    for slot in 0..slots {
        ring.owners_at(hash64(&slot.to_le_bytes()), r, &mut owners)?;
        table.extend(owners.iter().map(|&m| back[m as usize]));
    }
    Ok((r, table))
}

/// Why [`SlotTable::from_ring`] has no table: the ring cannot answer for
/// that membership, or (a bug) its answer breaks the table's contract.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RingTableError {
    Ring(RingError),
    Table(SlotTableError),
}

impl std::fmt::Display for RingTableError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RingTableError::Ring(e) => e.fmt(f),
            RingTableError::Table(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for RingTableError {}

impl SlotTable {
    /// `builtin:ring`'s table of `members` (sorted here by id, as the plugin
    /// runtime hands them to a plugin) with `slots` slots and up to
    /// `replicas` owners each, computed natively by [`slot_table`]: members
    /// that [may own](crate::MemberState::may_own) take part, with
    /// `vnodes * weight / 100` points each.
    pub fn from_ring(version: u64, mut members: Vec<Member>, slots: u32, replicas: u32, vnodes: u32) -> Result<SlotTable, RingTableError> {
        members.sort_by(|a, b| a.id.cmp(&b.id));
        let view: Vec<SlotMember<'_>> =
            members.iter().map(|m| SlotMember { id: &m.id, weight: m.weight, eligible: m.state.may_own() }).collect();
        let (r, owners) = slot_table(&view, slots, replicas, vnodes).map_err(RingTableError::Ring)?;
        drop(view);
        SlotTable::new(version, members, slots, replicas, r, owners).map_err(RingTableError::Table)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("node-{i}")).collect()
    }

    fn primaries(ring: &Ring, keys: u32) -> Vec<String> {
        (0..keys).map(|k| ring.owners(format!("key-{k}").as_bytes(), 1).unwrap()[0].to_owned()).collect()
    }

    #[test]
    fn owners_are_distinct_and_deterministic() {
        let a = Ring::new(&ids(5), DEFAULT_VNODES).unwrap();
        let mut shuffled = ids(5);
        shuffled.reverse();
        let b = Ring::new(&shuffled, DEFAULT_VNODES).unwrap();
        for k in 0..500u32 {
            let key = k.to_le_bytes();
            let o = a.owners(&key, 3).unwrap();
            assert_eq!(o, b.owners(&key, 3).unwrap(), "membership order changed the answer");
            let mut d = o.clone();
            d.sort();
            d.dedup();
            assert_eq!(d.len(), 3, "owners {o:?} are not distinct");
        }
    }

    #[test]
    fn replicas_are_capped_by_membership_and_errors_are_typed() {
        let ring = Ring::new(&ids(2), 8).unwrap();
        assert_eq!(ring.owners(b"k", 5).unwrap().len(), 2);
        assert_eq!(ring.owners(b"k", 0), Err(RingError::ZeroReplicas));
        let empty = Ring::new::<String>(&[], 8).unwrap();
        assert_eq!(empty.owners(b"k", 1), Err(RingError::NoMembers));
        assert_eq!(Ring::new(&["a", "a"], 8).unwrap_err(), RingError::DuplicateMember("a".into()));
    }

    /// One member of N joining or leaving moves about 1/N of the keys, and
    /// only keys that involve that member.
    #[test]
    fn one_member_change_moves_about_one_nth_of_keys() {
        let keys = 20_000;
        for n in [4usize, 8, 16] {
            let before = Ring::new(&ids(n), DEFAULT_VNODES).unwrap();
            let after = Ring::new(&ids(n + 1), DEFAULT_VNODES).unwrap();
            let (b, a) = (primaries(&before, keys), primaries(&after, keys));
            let moved: Vec<usize> = (0..keys as usize).filter(|&i| b[i] != a[i]).collect();
            let newcomer = format!("node-{n}");
            assert!(moved.iter().all(|&i| a[i] == newcomer), "a key moved between old members");
            let fraction = moved.len() as f64 / keys as f64;
            let ideal = 1.0 / (n + 1) as f64;
            assert!((fraction - ideal).abs() < ideal * 0.35, "join of 1 to {n}: {fraction:.3} of keys moved, ideal {ideal:.3}");
            // A member in the middle leaving: only its keys move, about 1/N.
            let mut fewer = ids(n);
            let leaver = fewer.remove(n / 2);
            let shrunk = primaries(&Ring::new(&fewer, DEFAULT_VNODES).unwrap(), keys);
            let moved: Vec<usize> = (0..keys as usize).filter(|&i| b[i] != shrunk[i]).collect();
            assert!(moved.iter().all(|&i| b[i] == leaver), "a key of a staying member moved");
            let fraction = moved.len() as f64 / keys as f64;
            let ideal = 1.0 / n as f64;
            assert!((fraction - ideal).abs() < ideal * 0.35, "leave of 1 from {n}: {fraction:.3} of keys moved, ideal {ideal:.3}");
        }
    }

    #[test]
    fn load_is_spread_evenly() {
        let n = 8;
        let ring = Ring::new(&ids(n), DEFAULT_VNODES).unwrap();
        let mut counts = std::collections::HashMap::new();
        for p in primaries(&ring, 40_000) {
            *counts.entry(p).or_insert(0u32) += 1;
        }
        let ideal = 40_000.0 / n as f64;
        for (node, c) in counts {
            assert!((c as f64 - ideal).abs() < ideal * 0.3, "{node} got {c}, ideal {ideal}");
        }
    }

    #[test]
    fn slot_tables_skip_members_that_may_not_own_and_follow_weight() {
        let ids: Vec<String> = (0..4).map(|i| format!("n{i}")).collect();
        let mut m: Vec<SlotMember<'_>> = ids.iter().map(|id| SlotMember { id, weight: 100, eligible: true }).collect();
        m[1].eligible = false;
        m[3].weight = 300;
        let (r, table) = slot_table(&m, 4096, 2, DEFAULT_VNODES).unwrap();
        assert_eq!(r, 2);
        assert_eq!(table.len(), 4096 * 2);
        assert!(!table.contains(&1), "an ineligible member owns a slot");
        let primaries = |i: u32| table.chunks(2).filter(|c| c[0] == i).count() as f64;
        assert!(primaries(3) > 2.0 * primaries(0), "weight 300 got {} slots vs {} for weight 100", primaries(3), primaries(0));
        for c in table.chunks(2) {
            assert_ne!(c[0], c[1]);
        }
        assert_eq!(slot_table(&m[1..2], 16, 1, 8), Err(RingError::NoMembers));
    }

    #[test]
    fn the_native_table_is_the_ring_s_over_members_sorted_by_id() {
        use crate::{MemberState, SLOTS};
        let mut members: Vec<Member> = (0..5).map(|i| Member::up(format!("n{i}"), format!("10.0.0.{i}:9600"))).collect();
        members[1].state = MemberState::Draining;
        members.reverse();
        let t = SlotTable::from_ring(3, members.clone(), SLOTS, 2, DEFAULT_VNODES).unwrap();
        assert_eq!((t.version, t.slots(), t.replicas()), (3, SLOTS, 2));
        let ids: Vec<&str> = t.members().iter().map(|m| m.id.as_str()).collect();
        assert_eq!(ids, ["n0", "n1", "n2", "n3", "n4"]);
        let view: Vec<SlotMember<'_>> =
            t.members().iter().map(|m| SlotMember { id: &m.id, weight: m.weight, eligible: m.state.may_own() }).collect();
        assert_eq!(slot_table(&view, SLOTS, 2, DEFAULT_VNODES).unwrap(), (2, t.owner_indices().to_vec()));
        assert!(!t.owner_indices().contains(&1), "the draining member owns nothing");
        let none = SlotTable::from_ring(1, vec![], SLOTS, 2, DEFAULT_VNODES).unwrap_err();
        assert_eq!(none, RingTableError::Ring(RingError::NoMembers));
        assert_eq!(none.to_string(), "the membership is empty");
    }

    /// Pinned outputs: the Python twin and any other port must reproduce these.
    #[test]
    fn hash_is_stable() {
        assert_eq!(hash64(b""), mix64(0xcbf2_9ce4_8422_2325));
        assert_eq!(hash64(b"a"), hash64(b"a"));
        assert_ne!(hash64(b"node-1#0"), hash64(b"node-1#1"));
    }
}
