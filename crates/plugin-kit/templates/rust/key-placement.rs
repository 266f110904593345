//! A key-placement plugin: weighted rendezvous (highest random weight)
//! hashing, slot by slot. A slot is owned by the members with the highest
//! score(member, slot) = weight / -ln(hash(member, slot)), so a member's
//! share of slots follows its weight, and one member joining or leaving
//! moves only the slots it wins or held.

use exports::kvplane::plugin::placement::{Error, Guest, Member, SlotTable};
use kvplane::plugin::types::MemberState;

wit_bindgen::generate!({ world: "key-placement", path: "wit" });

/// SplitMix64 finaliser: spreads the bits of `z` over the whole word.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// FNV-1a over `bytes`, finalised by [`mix`].
fn hash(bytes: &[u8]) -> u64 {
    mix(bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)))
}

/// A member's score for `slot`: `weight / -ln(u)` with `u` drawn uniformly
/// from (0, 1) by hashing the member's seed with the slot.
fn score(seed: u64, weight: u32, slot: u32) -> f64 {
    let h = mix(seed ^ u64::from(slot).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let u = ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    f64::from(weight) / -u.ln()
}

struct Plugin;

impl Guest for Plugin {
    fn configure(config: Vec<(String, String)>) -> Result<(), Error> {
        match config.first() {
            Some((name, _)) => Err(Error::Invalid(format!("config {name:?}: unknown setting"))),
            None => Ok(()),
        }
    }

    fn compute(members: Vec<Member>, slots: u32, replicas: u32) -> Result<SlotTable, Error> {
        if replicas == 0 {
            return Err(Error::Invalid("replicas must be at least 1".into()));
        }
        let mut ids: Vec<&str> = members.iter().map(|m| m.id.as_str()).collect();
        ids.sort_unstable();
        if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::Invalid(format!("member {:?} appears twice", w[0])));
        }
        // Down and draining members own nothing, nor does a weight of 0.
        // (index into `members`, hash of the id, weight)
        let owning: Vec<(u32, u64, u32)> = members
            .iter()
            .enumerate()
            .filter(|(_, m)| matches!(m.state, MemberState::Up | MemberState::Joining) && m.weight > 0)
            .map(|(i, m)| (i as u32, hash(m.id.as_bytes()), m.weight))
            .collect();
        if owning.is_empty() {
            return Err(Error::Invalid("no member may own keys: every one is down, draining or of weight 0".into()));
        }
        let r = (replicas as usize).min(owning.len());
        let mut owners = Vec::with_capacity(slots as usize * r);
        let mut ranked: Vec<(f64, u32)> = Vec::with_capacity(owning.len());
        // Highest score first; a tie (practically never) goes to the member
        // whose id sorts first, so the table does not depend on list order.
        let order =
            |a: &(f64, u32), b: &(f64, u32)| b.0.total_cmp(&a.0).then_with(|| members[a.1 as usize].id.cmp(&members[b.1 as usize].id));
        for slot in 0..slots {
            ranked.clear();
            ranked.extend(owning.iter().map(|&(i, seed, weight)| (score(seed, weight, slot), i)));
            if r < ranked.len() {
                ranked.select_nth_unstable_by(r, order);
            }
            ranked[..r].sort_unstable_by(order);
            owners.extend(ranked[..r].iter().map(|&(_, i)| i));
        }
        Ok(SlotTable { replicas: r as u32, owners })
    }
}

export!(Plugin);
