//! Slots: which members of a cache pool own a key.
//!
//! Keys hash to one of [`SLOTS`] slots with `crc32c(key) mod slots`
//! ([`slot_of`]); a [`SlotTable`] lists each slot's owners, primary first,
//! for one membership of [`Member`]s. A key-placement plugin computes the
//! table once per membership change; the node and every client then look
//! owners up here, natively, with no Wasm call and no Wasm runtime: a hash,
//! a modulo and a slice index per key. Which owners a write goes to, and in
//! which order a read tries them, is defined here too
//! ([`SlotTable::writable_owners`], [`SlotTable::readable_owners`]), once
//! for the cluster client and kvplane-cluster's router.
//!
//! [`ring`] is the consistent-hash ring behind `builtin:ring`, the default
//! key placement: the Wasm plugin (plugins/ring, built from this crate for
//! wasm32-wasip2) and the host's native fallback when a placement plugin
//! fails ([`SlotTable::from_ring`]) run exactly the same code, and the
//! Python twin in examples/plugins/python-ring is checked against vectors
//! this crate's tests pin.
//!
//! Why a crate of its own: the table travels on the wire (kvplane-protocol
//! encodes it for `CLUSTER_TABLE_RESULT`), is followed in etcd
//! (kvplane-cluster), computed by the plugin runtime and routed by the
//! clients, and the ring must also build as a plugin; one small crate with
//! no dependency but the slot hash serves them all.

pub mod ring;
mod table;

pub use ring::{Ring, RingError, RingTableError, SlotMember, DEFAULT_VNODES};
pub use table::{slot_of, Member, MemberState, SlotTable, SlotTableError, SLOTS};
