//! Key-placement conformance: the slot table the host accepts, R distinct
//! owners per slot, determinism, who may own keys, typed errors, balance and
//! minimal movement on membership change.
//!
//! Every table goes through [`KeyPlacement::compute`], which checks it
//! against the contract (`SlotTable::new`) and reports a violation as
//! `Fault::BadOutput`: the kit adds what a single table cannot show.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use super::{ensure, Report};
use kvplane_runtime::error::Fault;
use kvplane_runtime::{KeyPlacement, PluginError};
use kvplane_slots::{Member, MemberState, SlotTable, SLOTS};

fn member(i: usize) -> Member {
    Member {
        id: format!("node-{i}"),
        endpoint: format!("10.0.{}.{}:9600", i / 250, i % 250),
        zone: format!("zone-{}", i % 3),
        weight: 100,
        state: MemberState::Up,
        labels: vec![("kvplane.io/gpu".into(), "NVIDIA-L20".into())],
    }
}

fn members(n: usize) -> Vec<Member> {
    (0..n).map(member).collect()
}

/// `compute` with the error as text.
async fn compute(p: &KeyPlacement, version: u64, members: Vec<Member>, slots: u32, replicas: u32) -> Result<SlotTable, String> {
    p.compute(version, members, slots, replicas).await.map_err(|e| e.to_string())
}

/// The owner ids of every slot, slot-major: comparable across tables whose
/// member lists differ in order.
fn owner_ids(t: &SlotTable) -> Vec<&str> {
    t.owner_indices().iter().map(|&i| t.members()[i as usize].id.as_str()).collect()
}

/// Slots whose primary is each member, by id.
fn primaries(t: &SlotTable) -> HashMap<&str, usize> {
    let mut count = HashMap::new();
    for s in 0..t.slots() {
        *count.entry(t.members()[t.slot_owners(s)[0] as usize].id.as_str()).or_insert(0) += 1;
    }
    count
}

/// A call that must be refused by contract (`Fault::Returned`), not trap.
fn refused(what: &str, result: Result<SlotTable, PluginError>) -> Result<String, String> {
    match result {
        Err(e) if matches!(e.fault, Fault::Returned(_)) => Ok(format!("{what}: {}", e.fault)),
        Err(e) => Err(format!("{what} broke the plugin instead of answering an error: {e}")),
        Ok(t) => Err(format!("{what} answered a table of {} owners per slot", t.replicas())),
    }
}

pub async fn run(p: &KeyPlacement) -> Report {
    let mut r = Report::default();
    let five = members(5);

    let accepted = async {
        let t = compute(p, 1, five.clone(), SLOTS, 3).await?;
        ensure(t.slots() == SLOTS && t.replicas() == 3, || format!("{} slots x {} owners, asked {SLOTS} x 3", t.slots(), t.replicas()))?;
        for s in 0..t.slots() {
            let o = t.slot_owners(s);
            ensure(o[0] != o[1] && o[0] != o[2] && o[1] != o[2], || format!("slot {s}: owners {o:?} are not 3 distinct members"))?;
        }
        let owners: HashSet<&str> = owner_ids(&t).into_iter().collect();
        ensure(owners.len() == five.len(), || format!("only {} of 5 members own any slot", owners.len()))?;
        Ok(format!("{SLOTS} slots"))
    }
    .await;
    r.record("compute over 5 up members gives a valid table with 3 distinct owners per slot", accepted);

    let deterministic = async {
        let a = compute(p, 1, five.clone(), SLOTS, 3).await?;
        let b = compute(p, 1, five.clone(), SLOTS, 3).await?;
        ensure(a.owner_indices() == b.owner_indices(), || "two identical calls gave different tables".into())?;
        let mut shuffled = five.clone();
        shuffled.reverse();
        shuffled.swap(0, 2);
        let c = compute(p, 1, shuffled, SLOTS, 3).await?;
        ensure(owner_ids(&a) == owner_ids(&c), || "the order of the membership list changed the owners".into())?;
        Ok(String::new())
    }
    .await;
    r.record("compute is deterministic (repeated, and with the membership shuffled)", deterministic);

    let who_owns = async {
        let mut m = members(8);
        m[1].state = MemberState::Down;
        m[3].state = MemberState::Draining;
        m[5].weight = 0;
        m[6].state = MemberState::Joining;
        let t = compute(p, 1, m.clone(), SLOTS, 2).await?;
        let owners: HashSet<&str> = owner_ids(&t).into_iter().collect();
        for (i, why) in [(1, "down"), (3, "draining"), (5, "of weight 0")] {
            ensure(!owners.contains(m[i].id.as_str()), || format!("{} ({why}) owns slots", m[i].id))?;
        }
        Ok(format!("{} members own slots", owners.len()))
    }
    .await;
    r.record("down and draining members and members of weight 0 own nothing", who_owns);

    let capped = async {
        let t = compute(p, 1, five.clone(), 1024, 9).await?;
        ensure(t.replicas() == 5, || format!("replicas 9 over 5 members gave {} owners per slot", t.replicas()))?;
        Ok(String::new())
    }
    .await;
    r.record("replicas above the membership give every member", capped);

    let capped_eligible = async {
        let mut m = members(6);
        m[0].state = MemberState::Down;
        m[2].state = MemberState::Draining;
        m[4].weight = 0;
        let t = compute(p, 1, m, 1024, 9).await?;
        ensure(t.replicas() == 3, || format!("replicas 9 over 3 members that may own gave {} owners per slot", t.replicas()))?;
        Ok(String::new())
    }
    .await;
    r.record("replicas above the members that may own give each of them", capped_eligible);

    let typed = async {
        let mut notes = Vec::new();
        notes.push(refused("an empty membership", p.compute(1, vec![], SLOTS, 3).await)?);
        notes.push(refused("zero replicas", p.compute(1, five.clone(), SLOTS, 0).await)?);
        let mut down = five.clone();
        for m in &mut down {
            m.state = MemberState::Down;
        }
        notes.push(refused("an all-down membership", p.compute(1, down, SLOTS, 3).await)?);
        // The instance must still serve after refusing.
        compute(p, 1, five.clone(), 64, 3).await.map_err(|e| format!("after the refusals: {e}"))?;
        Ok(notes.join("; "))
    }
    .await;
    r.record("an empty membership, zero replicas and an all-down membership are typed errors", typed);

    let n = 8;
    let balance = async {
        let t = compute(p, 1, members(n), SLOTS, 1).await?;
        let owned = primaries(&t);
        let ideal = f64::from(SLOTS) / n as f64;
        let mut worst = 0.0f64;
        for m in members(n) {
            let c = owned.get(m.id.as_str()).copied().unwrap_or(0) as f64;
            worst = worst.max((c - ideal).abs() / ideal);
        }
        ensure(worst <= 0.5, || format!("a member's share of slots is {:.0}% off the ideal", worst * 100.0))?;
        Ok(format!("worst share {:.0}% off ideal over {n} members", worst * 100.0))
    }
    .await;
    r.record("slots spread evenly over members (each within 50% of 1/N)", balance);

    let movement = async {
        let before = compute(p, 1, members(n), SLOTS, 1).await?;
        let after = compute(p, 2, members(n + 1), SLOTS, 1).await?;
        let moved = before.moved_fraction(&after);
        let ideal = 1.0 / (n + 1) as f64;
        ensure(moved <= 2.0 * ideal, || format!("one join moved {:.1}% of slots; about {:.1}% expected", moved * 100.0, ideal * 100.0))?;
        Ok(format!("join of 1 to {n} moved {:.1}% (ideal {:.1}%)", moved * 100.0, ideal * 100.0))
    }
    .await;
    r.record("one member joining moves about 1/N of slots", movement);

    // Informational: how long a large pool's table takes (the node computes
    // it on every membership change, under the plugin's call deadline).
    let large = async {
        let started = Instant::now();
        match p.compute(1, members(64), SLOTS, 2).await {
            Ok(_) => Ok(format!("{:.1} ms", started.elapsed().as_secs_f64() * 1000.0)),
            Err(e) if matches!(e.fault, Fault::Deadline { .. }) => Ok(format!(
                "did not finish within the call deadline ({:.0} ms): raise the plugin's timeout or speed up compute",
                started.elapsed().as_secs_f64() * 1000.0
            )),
            Err(e) => Err(e.to_string()),
        }
    }
    .await;
    r.record(format!("time to compute 64 members, R=2, {SLOTS} slots (informational)"), large);
    r
}
