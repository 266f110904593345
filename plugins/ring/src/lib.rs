//! `builtin:ring`: consistent-hash key placement (`kvplane_slots::ring`),
//! answered as a slot table: each slot's owners are the members met walking
//! the ring clockwise from the slot's point. Members that are draining or
//! down own nothing; weight scales a member's virtual nodes.
//!
//! Config: `vnodes` (default 160) — virtual nodes per member of weight 100.

use std::cell::Cell;

use bindings::exports::kvplane::plugin::placement::{Error, Guest, Member, SlotTable};
use bindings::kvplane::plugin::types::MemberState;
use kvplane_slots::ring::{slot_table, SlotMember, DEFAULT_VNODES};

// The generated WIT bindings: the canonical ABI's unsafe glue and the
// component's exports, apart from the placement code (the workspace denies
// unsafe code and unreachable `pub` items everywhere else).
#[allow(unsafe_code, unreachable_pub)]
mod bindings {
    wit_bindgen::generate!({
        world: "key-placement",
        path: "../../wit",
    });
}

thread_local! {
    static VNODES: Cell<u32> = const { Cell::new(DEFAULT_VNODES) };
}

struct RingPlacement;

impl Guest for RingPlacement {
    fn configure(config: Vec<(String, String)>) -> Result<(), Error> {
        for (name, value) in config {
            match name.as_str() {
                "vnodes" => {
                    let v: u32 = value
                        .parse()
                        .ok()
                        .filter(|v| (1..=4096).contains(v))
                        .ok_or_else(|| Error::Invalid(format!("config vnodes={value:?}: expected an integer in 1..=4096")))?;
                    VNODES.with(|n| n.set(v));
                }
                other => return Err(Error::Invalid(format!("config {other:?}: unknown setting (known: vnodes)"))),
            }
        }
        Ok(())
    }

    fn compute(members: Vec<Member>, slots: u32, replicas: u32) -> Result<SlotTable, Error> {
        let view: Vec<SlotMember<'_>> = members
            .iter()
            .map(|m| SlotMember { id: &m.id, weight: m.weight, eligible: matches!(m.state, MemberState::Up | MemberState::Joining) })
            .collect();
        let (replicas, owners) = slot_table(&view, slots, replicas, VNODES.with(Cell::get)).map_err(|e| Error::Invalid(e.to_string()))?;
        Ok(SlotTable { replicas, owners })
    }
}

#[allow(unsafe_code)] // the exports' canonical-ABI glue, generated
mod export {
    use super::RingPlacement;
    crate::bindings::export!(RingPlacement with_types_in crate::bindings);
}
