"""Checks that ring_core.py answers exactly as the Rust ring, `kvplane_slots::ring`.

A pool may run `builtin:ring` on some hosts and this plugin on others; any
disagreement would send a key to two different owners. The slot table
(`slot_table`, what the plugin's `compute` answers) is checked entry for entry
on small tables and by digest on full 16384-slot tables. The expected values in
ring_vectors.json were printed by a program linked against the Rust crate, so
these tests pin the Python twin to the Rust code, not to itself.

Run: python3 -m pytest examples/plugins/python-ring
"""

import json
import pathlib

import pytest

import ring_core
from ring_core import Ring, RingError, SlotMember, hash64, mix64, slot_table

VECTORS = json.loads((pathlib.Path(__file__).parent / "ring_vectors.json").read_text(encoding="utf-8"))


def fnv1a64(data: bytes, h: int = 0xCBF29CE484222325) -> int:
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & ((1 << 64) - 1)
    return h


@pytest.mark.parametrize("key_hex,expected", VECTORS["hash64"])
def test_hash64_matches_rust(key_hex, expected):
    assert hash64(bytes.fromhex(key_hex)) == int(expected)


@pytest.mark.parametrize("z,expected", VECTORS["mix64"])
def test_mix64_matches_rust(z, expected):
    assert mix64(int(z)) == int(expected)


@pytest.mark.parametrize(
    "case", VECTORS["cases"], ids=lambda c: f"{len(c['members'])}members-vnodes{c['vnodes']}"
)
def test_owners_match_rust(case):
    ring = Ring(case["members"], case["vnodes"])
    for key_hex, replicas, expected in case["owners"]:
        assert ring.owners(bytes.fromhex(key_hex), replicas) == expected, (key_hex, replicas)


@pytest.mark.parametrize(
    "digest", VECTORS["digests"], ids=lambda d: f"{len(d['members'])}members-vnodes{d['vnodes']}"
)
def test_bulk_owners_match_rust(digest):
    """Thousands of keys per ring, folded into one hash so the vectors stay small."""
    ring = Ring(digest["members"], digest["vnodes"])
    h = 0xCBF29CE484222325
    for k in range(digest["keys"]):
        for key in (f"blk/{k}".encode(), ((k << 32) | k).to_bytes(8, "little")):
            for replicas in range(1, 5):
                h = fnv1a64((",".join(ring.owners(key, replicas)) + "\n").encode(), h)
    assert h == int(digest["fnv1a64"])


def test_membership_order_does_not_matter():
    members = [f"node-{i}" for i in range(7)]
    a, b = Ring(members, 32), Ring(list(reversed(members)), 32)
    for k in range(300):
        key = k.to_bytes(4, "little")
        assert a.owners(key, 3) == b.owners(key, 3)


def test_errors_match_rust():
    kinds = {e[2] for e in VECTORS["errors"]}
    assert kinds == {"no-members", "zero-replicas", "duplicate"}
    with pytest.raises(RingError, match="the membership is empty"):
        Ring([], 160).owners(b"k", 1)
    with pytest.raises(RingError, match="replicas must be at least 1"):
        Ring(["a"], 160).owners(b"k", 0)
    with pytest.raises(RingError, match='member id "b" appears more than once'):
        Ring(["b", "a", "b"], 160)


def test_replicas_are_capped_at_membership():
    assert sorted(Ring(["x", "y"], 8).owners(b"k", 5)) == ["x", "y"]


@pytest.mark.parametrize("value,expected", [("1", 1), ("160", 160), ("4096", 4096), ("+8", 8)])
def test_vnodes_config_accepts_what_rust_accepts(value, expected):
    assert ring_core.parse_vnodes(value) == expected


@pytest.mark.parametrize("value", ["0", "4097", "-1", "", " 8", "8.0", "abc", "١٢", "99999999999"])
def test_vnodes_config_rejects_what_rust_rejects(value):
    with pytest.raises(RingError, match=r"expected an integer in 1\.\.=4096"):
        ring_core.parse_vnodes(value)


def slot_members(members):
    return [SlotMember(i, w, e) for i, w, e in members]


@pytest.mark.parametrize(
    "case",
    VECTORS["slot_tables"],
    ids=lambda c: f"{len(c['members'])}members-{c['slots']}slots-r{c['replicas']}-vnodes{c['vnodes']}",
)
def test_slot_table_matches_rust(case):
    r, owners = slot_table(slot_members(case["members"]), case["slots"], case["replicas"], case["vnodes"])
    assert r == case["table_replicas"]
    assert owners == case["owners"]


@pytest.mark.parametrize(
    "digest",
    VECTORS["slot_table_digests"],
    ids=lambda d: f"{len(d['members'])}members-{d['slots']}slots-r{d['replicas']}-vnodes{d['vnodes']}",
)
def test_full_slot_tables_match_rust(digest):
    r, owners = slot_table(slot_members(digest["members"]), digest["slots"], digest["replicas"], digest["vnodes"])
    assert r == digest["table_replicas"]
    assert len(owners) == digest["slots"] * r
    h = 0xCBF29CE484222325
    for s in range(digest["slots"]):
        h = fnv1a64((",".join(str(i) for i in owners[s * r : (s + 1) * r]) + "\n").encode(), h)
    assert h == int(digest["fnv1a64"])


@pytest.mark.parametrize("members,replicas,message", VECTORS["slot_table_errors"])
def test_slot_table_errors_match_rust(members, replicas, message):
    with pytest.raises(RingError) as e:
        slot_table(slot_members(members), 16, replicas)
    assert str(e.value) == message


def test_slot_tables_follow_member_state_and_weight():
    members = [SlotMember(f"n{i}", 100, True) for i in range(6)]
    members[1] = SlotMember("n1", 100, False)  # draining or down
    members[2] = SlotMember("n2", 0, True)
    members[5] = SlotMember("n5", 400, True)
    r, owners = slot_table(members, 4096, 2)
    assert r == 2
    assert 1 not in owners and 2 not in owners
    primaries = owners[::2]
    assert primaries.count(5) > 2 * primaries.count(0)
    for s in range(4096):
        assert owners[2 * s] != owners[2 * s + 1]


def test_slot_tables_answer_indices_into_the_list_as_passed():
    members = [SlotMember(f"node-{i}", 100, True) for i in range(7)]
    r, owners = slot_table(members, 512, 3)
    shuffled = list(reversed(members))
    r2, owners2 = slot_table(shuffled, 512, 3)
    assert r == r2 == 3
    assert [members[i].id for i in owners] == [shuffled[i].id for i in owners2]
