//! The Python twin of the ring (examples/plugins/python-ring) is tested
//! against `ring_vectors.json`, outputs of this crate's ring. This checks
//! the same vectors against the Rust ring on every run, so that the file
//! cannot drift from the code it pins the twin to: a change to the ring that
//! moves any key fails here first. (The file's `_about` says what each
//! entry holds; when the ring changes on purpose, its outputs are
//! regenerated from the same inputs and both tests must pass again.)

use kvplane_slots::ring::{hash64, mix64, slot_table};
use kvplane_slots::{Ring, RingError, SlotMember};
use serde_json::Value;

fn vectors() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/plugins/python-ring/ring_vectors.json");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
    serde_json::from_str(&text).expect("ring_vectors.json is JSON")
}

fn list<'a>(v: &'a Value, name: &str) -> &'a [Value] {
    v[name].as_array().unwrap_or_else(|| panic!("{name} is a list")).as_slice()
}

fn str_of(v: &Value) -> &str {
    v.as_str().unwrap_or_else(|| panic!("{v} is a string"))
}

fn u64_of(v: &Value) -> u64 {
    match v {
        Value::String(s) => s.parse().unwrap_or_else(|e| panic!("{s}: {e}")),
        other => other.as_u64().unwrap_or_else(|| panic!("{other} is an integer")),
    }
}

fn u32_of(v: &Value) -> u32 {
    u32::try_from(u64_of(v)).expect("fits in a u32")
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect()
}

fn ids(v: &Value) -> Vec<String> {
    v.as_array().expect("a list of ids").iter().map(|id| str_of(id).to_owned()).collect()
}

/// `[id, weight, eligible]` triples.
fn slot_members(v: &Value) -> Vec<(String, u32, bool)> {
    v.as_array()
        .expect("a list of members")
        .iter()
        .map(|m| (str_of(&m[0]).to_owned(), u32_of(&m[1]), m[2].as_bool().expect("eligible is a bool")))
        .collect()
}

fn view(members: &[(String, u32, bool)]) -> Vec<SlotMember<'_>> {
    members.iter().map(|(id, weight, eligible)| SlotMember { id, weight: *weight, eligible: *eligible }).collect()
}

/// FNV-1a 64 without the finaliser, continued from `h`: how the digests fold
/// many answers into one number.
fn fnv1a64(data: &[u8], mut h: u64) -> u64 {
    for &b in data {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

#[test]
fn hashes_match() {
    let v = vectors();
    for case in list(&v, "hash64") {
        assert_eq!(hash64(&unhex(str_of(&case[0]))), u64_of(&case[1]), "hash64 of {}", case[0]);
    }
    for case in list(&v, "mix64") {
        assert_eq!(mix64(u64_of(&case[0])), u64_of(&case[1]), "mix64 of {}", case[0]);
    }
}

#[test]
fn owners_of_explicit_keys_match() {
    let v = vectors();
    for case in list(&v, "cases") {
        let ring = Ring::new(&ids(&case["members"]), u32_of(&case["vnodes"])).unwrap();
        for o in case["owners"].as_array().unwrap() {
            let (key, replicas) = (unhex(str_of(&o[0])), u32_of(&o[1]));
            assert_eq!(ring.owners(&key, replicas).unwrap(), ids(&o[2]), "{} × {replicas} on {}", o[0], case["members"]);
        }
    }
}

#[test]
fn bulk_owners_match() {
    let v = vectors();
    for d in list(&v, "digests") {
        let ring = Ring::new(&ids(&d["members"]), u32_of(&d["vnodes"])).unwrap();
        let mut h = FNV_OFFSET;
        for k in 0..u64_of(&d["keys"]) {
            for key in [format!("blk/{k}").into_bytes(), ((k << 32) | k).to_le_bytes().to_vec()] {
                for replicas in 1..=4 {
                    h = fnv1a64(format!("{}\n", ring.owners(&key, replicas).unwrap().join(",")).as_bytes(), h);
                }
            }
        }
        assert_eq!(h, u64_of(&d["fnv1a64"]), "digest of {}", d["members"]);
    }
}

#[test]
fn ring_errors_match() {
    let v = vectors();
    for e in list(&v, "errors") {
        let got = Ring::new(&ids(&e[0]), 160).and_then(|r| r.owners(b"k", u32_of(&e[1])).map(drop)).unwrap_err();
        let kind = match got {
            RingError::NoMembers => "no-members",
            RingError::ZeroReplicas => "zero-replicas",
            RingError::DuplicateMember(_) => "duplicate",
        };
        assert_eq!(kind, str_of(&e[2]), "{}", e[0]);
    }
}

#[test]
fn slot_tables_match() {
    let v = vectors();
    for t in list(&v, "slot_tables") {
        let members = slot_members(&t["members"]);
        let (r, owners) = slot_table(&view(&members), u32_of(&t["slots"]), u32_of(&t["replicas"]), u32_of(&t["vnodes"])).unwrap();
        assert_eq!(r, u32_of(&t["table_replicas"]));
        let want: Vec<u32> = t["owners"].as_array().unwrap().iter().map(u32_of).collect();
        assert_eq!(owners, want, "{}", t["members"]);
    }
    for d in list(&v, "slot_table_digests") {
        let members = slot_members(&d["members"]);
        let slots = u32_of(&d["slots"]);
        let (r, owners) = slot_table(&view(&members), slots, u32_of(&d["replicas"]), u32_of(&d["vnodes"])).unwrap();
        assert_eq!(r, u32_of(&d["table_replicas"]));
        assert_eq!(owners.len(), slots as usize * r as usize);
        let mut h = FNV_OFFSET;
        for slot in owners.chunks(r as usize) {
            let line: Vec<String> = slot.iter().map(u32::to_string).collect();
            h = fnv1a64(format!("{}\n", line.join(",")).as_bytes(), h);
        }
        assert_eq!(h, u64_of(&d["fnv1a64"]), "digest of {}", d["members"]);
    }
    for e in list(&v, "slot_table_errors") {
        let members = slot_members(&e[0]);
        let err = slot_table(&view(&members), 16, u32_of(&e[1]), 160).unwrap_err();
        assert_eq!(err.to_string(), str_of(&e[2]), "{}", e[0]);
    }
}
