//! Answers: the meta of each response opcode and of ERROR, written and read.
//!
//! One decoder per operation, as for requests. Per-key answers are
//! positional (the *i*-th status answers the *i*-th key), so none carries a
//! key; only GET_RESULT carries payloads, one per status-0 entry.

use bytes::{BufMut, Bytes};
use kvplane_slots::{Member, MemberState, SlotTable};

use super::reader::{response, Body, Reader};
use super::{payload_len, put_count, reserve_meta, Meta, PayloadSlot};
use crate::error::{ErrorCode, ProtocolError};
use crate::frame::Features;
use crate::limits::{
    Limits, MAX_CLUSTER_MEMBERS, MAX_CLUSTER_REPLICAS, MAX_CLUSTER_SLOTS, MAX_CLUSTER_STRING_BYTES, MAX_ERROR_MESSAGE_BYTES,
    MAX_STATS_ENTRIES,
};
use crate::message::{HelloAck, Response, ShmBlock, StatEntry};
use crate::rdma::descriptor::ENCODED_LEN as DESCRIPTOR_LEN;
use crate::rdma::Descriptor;

pub(super) fn encode(resp: &Response, out: &mut Vec<u8>, payloads: &mut Vec<Bytes>) -> Result<(), ProtocolError> {
    match resp {
        Response::HelloAck(a) => {
            out.put_u16_le(a.version);
            out.put_u64_le(a.features.0);
            out.put_u32_le(a.limits.max_frame_bytes);
            out.put_u32_le(a.limits.max_key_bytes);
            out.put_u32_le(a.limits.max_batch_keys);
            out.put_u32_le(a.limits.max_lease_ms);
        }
        Response::Put { results } | Response::Exists { results } | Response::Delete { results } | Response::PutShm { results } => {
            put_statuses(out, results)?
        }
        Response::ShmAttach { size } => out.put_u64_le(*size),
        Response::RdmaDescribe { results } => {
            put_count(out, results.len(), "rdma_describe_result.count")?;
            for r in results {
                out.put_u16_le(status_of(r));
                if let Ok(d) = r {
                    let bytes = d.encode().map_err(|e| ProtocolError::malformed("rdma_describe_result.descriptor", e.to_string()))?;
                    out.extend_from_slice(&bytes);
                }
            }
        }
        Response::RdmaConnect { endpoint } => out.extend_from_slice(&endpoint.encode()),
        Response::GetShm { results } => {
            put_count(out, results.len(), "count")?;
            for r in results {
                out.put_u16_le(status_of(r));
                let (len, crc) = match r {
                    Ok(b) => (b.len, b.crc),
                    Err(_) => (0, 0),
                };
                out.put_u32_le(len);
                out.put_u32_le(crc);
            }
        }
        Response::Get { results } => {
            // Sized up front, as a PUT's meta is (10 bytes a key).
            reserve_meta(out, 4 + 10 * results.len());
            payloads.reserve(results.len());
            put_count(out, results.len(), "count")?;
            for (i, r) in results.iter().enumerate() {
                out.put_u16_le(status_of(r));
                match r {
                    Ok(block) => {
                        out.put_u32_le(payload_len(block.data.len(), i)?);
                        out.put_u32_le(block.crc);
                        payloads.push(block.data.clone());
                    }
                    Err(_) => {
                        out.put_u32_le(0);
                        out.put_u32_le(0);
                    }
                }
            }
        }
        Response::MatchPrefix { matched, lease_ms } => {
            out.put_u32_le(*matched);
            out.put_u32_le(*lease_ms);
        }
        Response::Stats { entries } => {
            if entries.len() > MAX_STATS_ENTRIES {
                return Err(ProtocolError::malformed(
                    "stats.count",
                    format!("{} entries, over the limit of {MAX_STATS_ENTRIES}", entries.len()),
                ));
            }
            put_count(out, entries.len(), "stats.count")?;
            for e in entries {
                let name = e.name.as_bytes();
                let len = u16::try_from(name.len())
                    .map_err(|_| ProtocolError::malformed("stats.name", format!("{} bytes do not fit in a u16", name.len())))?;
                out.put_u16_le(len);
                out.extend_from_slice(name);
                out.put_u64_le(e.value);
            }
        }
        Response::Pong => {}
        Response::ClusterTable(t) => encode_cluster_table(t, out)?,
        Response::Error { code, message } => {
            out.put_u16_le(code.to_u16());
            let message = truncate_utf8(message, MAX_ERROR_MESSAGE_BYTES);
            out.put_u16_le(message.len() as u16);
            out.extend_from_slice(message.as_bytes());
        }
    }
    Ok(())
}

fn put_statuses(out: &mut Vec<u8>, results: &[Result<(), ErrorCode>]) -> Result<(), ProtocolError> {
    put_count(out, results.len(), "count")?;
    for r in results {
        out.put_u16_le(status_of(r));
    }
    Ok(())
}

fn status_of<T>(r: &Result<T, ErrorCode>) -> u16 {
    match r {
        Ok(_) => 0,
        Err(code) => code.to_u16(),
    }
}

/// A string field with a u16 length, at most `max` bytes.
fn put_str(out: &mut Vec<u8>, s: &str, max: usize, field: &'static str) -> Result<(), ProtocolError> {
    if s.len() > max {
        return Err(ProtocolError::malformed(field, format!("{} bytes, over the limit of {max}", s.len())));
    }
    out.put_u16_le(s.len() as u16);
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

fn member_state_code(state: MemberState) -> u8 {
    match state {
        MemberState::Joining => 0,
        MemberState::Up => 1,
        MemberState::Draining => 2,
        MemberState::Down => 3,
    }
}

fn encode_cluster_table(t: &SlotTable, out: &mut Vec<u8>) -> Result<(), ProtocolError> {
    let members = t.members();
    if members.len() > MAX_CLUSTER_MEMBERS {
        return Err(ProtocolError::malformed(
            "cluster_table.members",
            format!("{} members, over the limit of {MAX_CLUSTER_MEMBERS}", members.len()),
        ));
    }
    if t.slots() > MAX_CLUSTER_SLOTS || t.replicas() > MAX_CLUSTER_REPLICAS {
        return Err(ProtocolError::malformed(
            "cluster_table.slots",
            format!("{} slots × {} replicas, over the limits of {MAX_CLUSTER_SLOTS} × {MAX_CLUSTER_REPLICAS}", t.slots(), t.replicas()),
        ));
    }
    out.put_u64_le(t.version);
    out.put_u32_le(t.slots());
    out.put_u16_le(t.replicas() as u16);
    out.put_u16_le(members.len() as u16);
    for m in members {
        put_str(out, &m.id, MAX_CLUSTER_STRING_BYTES, "cluster_table.member.id")?;
        put_str(out, &m.endpoint, MAX_CLUSTER_STRING_BYTES, "cluster_table.member.endpoint")?;
        put_str(out, &m.zone, MAX_CLUSTER_STRING_BYTES, "cluster_table.member.zone")?;
        out.put_u32_le(m.weight);
        out.push(member_state_code(m.state));
    }
    for &owner in t.owner_indices() {
        // Indices are below the member count, itself at most 4096.
        out.put_u16_le(owner as u16);
    }
    Ok(())
}

/// The longest prefix of `s` of at most `max` bytes that ends on a character
/// boundary.
fn truncate_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// HELLO_ACK: `u16 version, u64 features`, then the four limits the node
/// holds this connection to.
pub(super) fn hello_ack(b: &mut Body) -> Result<Meta, ProtocolError> {
    b.no_payload("hello_ack")?;
    let r = &mut b.r;
    let version = r.u16("hello_ack.version")?;
    let features = Features(r.u64("hello_ack.features")?);
    let limits = Limits {
        max_frame_bytes: r.u32("hello_ack.max_frame")?,
        max_key_bytes: r.u32("hello_ack.max_key")?,
        max_batch_keys: r.u32("hello_ack.max_batch")?,
        max_lease_ms: r.u32("hello_ack.max_lease_ms")?,
    };
    Ok(response(Response::HelloAck(HelloAck { version, features, limits })))
}

/// The meta of PUT_RESULT, EXISTS_RESULT and DELETE_RESULT:
/// `u32 count, count × u16 status`.
fn statuses(b: &mut Body) -> Result<Vec<Result<(), ErrorCode>>, ProtocolError> {
    b.no_payload("results")?;
    let count = b.r.count(b.limits, "results.count", 2)?;
    let mut results = Vec::with_capacity(count);
    for _ in 0..count {
        results.push(match ErrorCode::from_u16(b.r.u16("results.status")?) {
            None => Ok(()),
            Some(code) => Err(code),
        });
    }
    Ok(results)
}

pub(super) fn put_result(b: &mut Body) -> Result<Meta, ProtocolError> {
    Ok(response(Response::Put { results: statuses(b)? }))
}

pub(super) fn exists_result(b: &mut Body) -> Result<Meta, ProtocolError> {
    Ok(response(Response::Exists { results: statuses(b)? }))
}

pub(super) fn delete_result(b: &mut Body) -> Result<Meta, ProtocolError> {
    Ok(response(Response::Delete { results: statuses(b)? }))
}

/// GET_RESULT: `u32 count, count × (u16 status, u32 len, u32 crc32c)`; the
/// payloads of the status-0 entries, which must add up to the frame's, are
/// left to read. An entry answered with an error declares no bytes.
pub(super) fn get_result(b: &mut Body) -> Result<Meta, ProtocolError> {
    let r = &mut b.r;
    let count = r.count(b.limits, "get_result.count", 10)?;
    let mut slots = Vec::with_capacity(count);
    let mut total = 0u64;
    for _ in 0..count {
        let status = r.u16("get_result.status")?;
        let len = r.u32("get_result.len")?;
        let crc = r.u32("get_result.crc")?;
        slots.push(match ErrorCode::from_u16(status) {
            None => {
                total += len as u64;
                Ok(PayloadSlot { key: Bytes::new(), len, crc })
            }
            Some(code) => {
                if len != 0 {
                    return Err(ProtocolError::malformed("get_result.len", format!("{len} bytes declared for a key answered {code}")));
                }
                Err(code)
            }
        });
    }
    if total != b.payload_len {
        return Err(ProtocolError::malformed(
            "get_result.len",
            format!("block lengths add up to {total} bytes but the frame carries {}", b.payload_len),
        ));
    }
    Ok(Meta::Get(slots))
}

/// MATCH_PREFIX_RESULT: `u32 matched, u32 lease_ms`.
pub(super) fn match_prefix_result(b: &mut Body) -> Result<Meta, ProtocolError> {
    b.no_payload("match_prefix_result")?;
    let matched = b.r.u32("match_prefix_result.matched")?;
    let lease_ms = b.r.u32("match_prefix_result.lease_ms")?;
    Ok(response(Response::MatchPrefix { matched, lease_ms }))
}

/// STATS_RESULT: `u32 count, count × (u16 name_len, name, u64 value)`, held
/// to [`MAX_STATS_ENTRIES`] rather than the batch limit.
pub(super) fn stats_result(b: &mut Body) -> Result<Meta, ProtocolError> {
    b.no_payload("stats_result")?;
    let r = &mut b.r;
    let count = r.u32("stats_result.count")? as usize;
    if count > MAX_STATS_ENTRIES {
        return Err(ProtocolError::malformed("stats_result.count", format!("{count} entries, over the limit of {MAX_STATS_ENTRIES}")));
    }
    r.fits(count, 11, "stats_result.count")?;
    let mut entries = Vec::with_capacity(count);
    for _ in 0..count {
        let len = r.u16("stats_result.name_len")? as usize;
        let name = r.bytes(len, "stats_result.name")?;
        let name = String::from_utf8(name.to_vec()).map_err(|_| ProtocolError::malformed("stats_result.name", "not UTF-8"))?;
        let value = r.u64("stats_result.value")?;
        entries.push(StatEntry { name, value });
    }
    Ok(response(Response::Stats { entries }))
}

pub(super) fn pong(b: &mut Body) -> Result<Meta, ProtocolError> {
    b.no_payload("pong")?;
    Ok(response(Response::Pong))
}

/// CLUSTER_TABLE_RESULT: the slot table, checked as a table.
/// CLUSTER_TABLE_RESULT: the table in the meta, its write quorum in the low
/// four bits of the header's flags (0: the cluster states none).
///
/// Why the header and not a field of the meta: every decoder of protocol
/// version 1 consumes a meta exactly and refuses bytes left over, so a field
/// added to the meta would break every client older than it, and a feature
/// bit would make the node's answer depend on each connection's handshake.
/// Version-1 receivers ignore the flags byte (docs/protocol.md), so an older
/// client reads this table as before and a newer client reading an older
/// node's table (flags 0) falls back to every owner. The high four bits are
/// left for later and ignored.
pub(super) fn cluster_table_result(b: &mut Body) -> Result<Meta, ProtocolError> {
    b.no_payload("cluster_table_result")?;
    let write_quorum = match u32::from(b.flags & WRITE_QUORUM_BITS) {
        0 => None,
        w if w <= MAX_CLUSTER_REPLICAS => Some(w),
        w => {
            return Err(ProtocolError::malformed(
                "cluster_table.write_quorum",
                format!("{w} (header flags {:#04x}) is over the limit of {MAX_CLUSTER_REPLICAS} replicas", b.flags),
            ))
        }
    };
    let table = cluster_table(&mut b.r)?.with_write_quorum(write_quorum);
    Ok(response(Response::ClusterTable(Box::new(table))))
}

/// The bits of a CLUSTER_TABLE_RESULT header's flags that carry the write
/// quorum: 4 bits hold 1..=8 ([`MAX_CLUSTER_REPLICAS`]).
const WRITE_QUORUM_BITS: u8 = 0x0f;

/// The header flags of a CLUSTER_TABLE_RESULT carrying `t`: its write
/// quorum, or 0 when it states none.
pub(super) fn write_quorum_flags(t: &SlotTable) -> Result<u8, ProtocolError> {
    match t.write_quorum() {
        None => Ok(0),
        Some(w) if (1..=MAX_CLUSTER_REPLICAS).contains(&w) => Ok(w as u8),
        Some(w) => Err(ProtocolError::malformed(
            "cluster_table.write_quorum",
            format!("{w} is outside 1..={MAX_CLUSTER_REPLICAS} (the most replicas a table may have)"),
        )),
    }
}

/// A CLUSTER_TABLE_RESULT's meta, checked as a table (owners name
/// existing members, no member twice in a slot, no down owner).
fn cluster_table(r: &mut Reader) -> Result<SlotTable, ProtocolError> {
    let version = r.u64("cluster_table.version")?;
    let slots = r.u32("cluster_table.slots")?;
    let replicas = r.u16("cluster_table.replicas")? as u32;
    let count = r.u16("cluster_table.member_count")? as usize;
    if slots > MAX_CLUSTER_SLOTS || replicas > MAX_CLUSTER_REPLICAS {
        return Err(ProtocolError::malformed(
            "cluster_table.slots",
            format!("{slots} slots × {replicas} replicas, over the limits of {MAX_CLUSTER_SLOTS} × {MAX_CLUSTER_REPLICAS}"),
        ));
    }
    if count > MAX_CLUSTER_MEMBERS {
        return Err(ProtocolError::malformed(
            "cluster_table.member_count",
            format!("{count} members, over the limit of {MAX_CLUSTER_MEMBERS}"),
        ));
    }
    // Each member is at least 11 bytes (three empty strings, weight, state).
    r.fits(count, 11, "cluster_table.member_count")?;
    let mut members = Vec::with_capacity(count);
    for _ in 0..count {
        let id = r.string(MAX_CLUSTER_STRING_BYTES, "cluster_table.member.id")?;
        let endpoint = r.string(MAX_CLUSTER_STRING_BYTES, "cluster_table.member.endpoint")?;
        let zone = r.string(MAX_CLUSTER_STRING_BYTES, "cluster_table.member.zone")?;
        let weight = r.u32("cluster_table.member.weight")?;
        let state = match r.take(1, "cluster_table.member.state")?[0] {
            0 => MemberState::Joining,
            1 => MemberState::Up,
            2 => MemberState::Draining,
            3 => MemberState::Down,
            other => return Err(ProtocolError::malformed("cluster_table.member.state", format!("{other} is not a member state (0..=3)"))),
        };
        members.push(Member { id, endpoint, zone, weight, state, labels: Vec::new() });
    }
    let entries = slots as usize * replicas as usize;
    r.fits(entries, 2, "cluster_table.owners")?;
    let mut owners = Vec::with_capacity(entries);
    for _ in 0..entries {
        owners.push(r.u16("cluster_table.owner")? as u32);
    }
    SlotTable::new(version, members, slots, replicas, replicas, owners)
        .map_err(|e| ProtocolError::malformed("cluster_table.owners", e.to_string()))
}

/// SHM_ATTACH_RESULT: `u64 size` of the shared memory the node hands over
/// with the answer.
pub(super) fn shm_attach_result(b: &mut Body) -> Result<Meta, ProtocolError> {
    b.no_payload("shm_attach_result")?;
    let size = b.r.u64("shm_attach_result.size")?;
    Ok(response(Response::ShmAttach { size }))
}

/// PUT_SHM_RESULT: `u32 count, count × u16 status`.
pub(super) fn put_shm_result(b: &mut Body) -> Result<Meta, ProtocolError> {
    b.no_payload("put_shm_result")?;
    let count = b.r.count(b.limits, "put_shm_result.count", 2)?;
    let mut results = Vec::with_capacity(count);
    for _ in 0..count {
        results.push(match ErrorCode::from_u16(b.r.u16("put_shm_result.status")?) {
            None => Ok(()),
            Some(code) => Err(code),
        });
    }
    Ok(response(Response::PutShm { results }))
}

/// GET_SHM_RESULT: `u32 count, count × (u16 status, u32 len, u32 crc32c)`;
/// an entry answered with an error declares neither.
pub(super) fn get_shm_result(b: &mut Body) -> Result<Meta, ProtocolError> {
    b.no_payload("get_shm_result")?;
    let r = &mut b.r;
    let count = r.count(b.limits, "get_shm_result.count", 10)?;
    let mut results = Vec::with_capacity(count);
    for _ in 0..count {
        let status = r.u16("get_shm_result.status")?;
        let len = r.u32("get_shm_result.len")?;
        let crc = r.u32("get_shm_result.crc")?;
        results.push(match ErrorCode::from_u16(status) {
            None => Ok(ShmBlock { len, crc }),
            Some(code) => {
                if len != 0 || crc != 0 {
                    return Err(ProtocolError::malformed("get_shm_result.len", format!("a length or checksum for a key answered {code}")));
                }
                Err(code)
            }
        });
    }
    Ok(response(Response::GetShm { results }))
}

/// RDMA_DESCRIBE_RESULT: `u32 count, count × (u16 status, and for status 0
/// the descriptor)`.
pub(super) fn rdma_describe_result(b: &mut Body) -> Result<Meta, ProtocolError> {
    b.no_payload("rdma_describe_result")?;
    let r = &mut b.r;
    let count = r.count(b.limits, "rdma_describe_result.count", 2)?;
    let mut results = Vec::with_capacity(count);
    for _ in 0..count {
        results.push(match ErrorCode::from_u16(r.u16("rdma_describe_result.status")?) {
            None => {
                let bytes = r.take(DESCRIPTOR_LEN, "rdma_describe_result.descriptor")?;
                Ok(Descriptor::decode(bytes).map_err(|e| ProtocolError::malformed("rdma_describe_result.descriptor", e.to_string()))?)
            }
            Some(code) => Err(code),
        });
    }
    Ok(response(Response::RdmaDescribe { results }))
}

/// RDMA_CONNECT_RESULT: the node's queue pair endpoint.
pub(super) fn rdma_connect_result(b: &mut Body) -> Result<Meta, ProtocolError> {
    b.no_payload("rdma_connect_result")?;
    let endpoint = b.r.endpoint("rdma_connect_result.endpoint")?;
    Ok(response(Response::RdmaConnect { endpoint }))
}

/// ERROR: `u16 code, u16 message_len, message (UTF-8)`; code 0 is success,
/// never an error.
pub(super) fn error(b: &mut Body) -> Result<Meta, ProtocolError> {
    b.no_payload("error")?;
    let r = &mut b.r;
    let raw = r.u16("error.code")?;
    let code = ErrorCode::from_u16(raw).ok_or_else(|| ProtocolError::malformed("error.code", "0 is success, not an error"))?;
    let len = r.u16("error.message_len")? as usize;
    if len > MAX_ERROR_MESSAGE_BYTES {
        return Err(ProtocolError::malformed("error.message", format!("{len} bytes, over the limit of {MAX_ERROR_MESSAGE_BYTES}")));
    }
    let message = r.bytes(len, "error.message")?;
    let message = String::from_utf8(message.to_vec()).map_err(|_| ProtocolError::malformed("error.message", "not UTF-8"))?;
    Ok(response(Response::Error { code, message }))
}
