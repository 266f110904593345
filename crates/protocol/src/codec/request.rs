//! Requests: the meta of each request opcode, written and read.
//!
//! One decoder per operation, each given the meta's cursor, the limits and
//! the payload length the header declared, and each naming its fields so a
//! refusal says which one was at fault. Only PUT carries payloads.

use bytes::{BufMut, Bytes};

use super::reader::{check_unique, request, Body};
use super::{payload_len, put_count, put_key, put_keys, reserve_meta, Meta, PayloadSlot};
use crate::error::ProtocolError;
use crate::frame::Features;
use crate::limits::MAX_TOKEN_BYTES;
use crate::message::{Hello, Request, ShmGet, ShmPut};

pub(super) fn encode(req: &Request, out: &mut Vec<u8>, payloads: &mut Vec<Bytes>) -> Result<(), ProtocolError> {
    match req {
        Request::Hello(h) => {
            out.put_u16_le(h.version);
            out.put_u64_le(h.features.0);
            let token = h.token.as_deref().unwrap_or("");
            if token.len() > MAX_TOKEN_BYTES {
                return Err(ProtocolError::malformed("hello.token", format!("{} bytes, over the limit of {MAX_TOKEN_BYTES}", token.len())));
            }
            out.put_u16_le(token.len() as u16);
            out.extend_from_slice(token.as_bytes());
        }
        Request::Put { entries } => {
            // Sized up front: grown from the header, the meta of 32 keys
            // was reallocated five times.
            reserve_meta(out, 4 + entries.iter().map(|e| 10 + e.key.len()).sum::<usize>());
            payloads.reserve(entries.len());
            put_count(out, entries.len(), "count")?;
            for (i, e) in entries.iter().enumerate() {
                put_key(out, &e.key, i)?;
                out.put_u32_le(payload_len(e.block.data.len(), i)?);
                out.put_u32_le(e.block.crc);
                payloads.push(e.block.data.clone());
            }
        }
        Request::Get { keys } | Request::Exists { keys } | Request::Delete { keys } => put_keys(out, keys)?,
        Request::MatchPrefix { keys, lease_ms } | Request::RdmaDescribe { keys, lease_ms } => {
            out.put_u32_le(*lease_ms);
            put_keys(out, keys)?;
        }
        Request::RdmaConnect { endpoint } => out.extend_from_slice(&endpoint.encode()),
        Request::Stats | Request::Ping => {}
        Request::ClusterTable { after_version, wait_ms } => {
            out.put_u64_le(*after_version);
            out.put_u32_le(*wait_ms);
        }
        Request::ShmAttach => {}
        Request::PutShm { entries } => {
            put_count(out, entries.len(), "count")?;
            for (i, e) in entries.iter().enumerate() {
                put_key(out, &e.key, i)?;
                out.put_u64_le(e.offset);
                out.put_u32_le(e.len);
                out.put_u32_le(e.crc);
            }
        }
        Request::GetShm { entries } => {
            put_count(out, entries.len(), "count")?;
            for (i, e) in entries.iter().enumerate() {
                put_key(out, &e.key, i)?;
                out.put_u64_le(e.offset);
                out.put_u32_le(e.capacity);
            }
        }
    }
    Ok(())
}

/// HELLO: `u16 version, u64 features, u16 token_len, token`.
pub(super) fn hello(b: &mut Body) -> Result<Meta, ProtocolError> {
    b.no_payload("hello")?;
    let r = &mut b.r;
    let version = r.u16("hello.version")?;
    let features = Features(r.u64("hello.features")?);
    let token_len = r.u16("hello.token_len")? as usize;
    if token_len > MAX_TOKEN_BYTES {
        return Err(ProtocolError::malformed("hello.token", format!("{token_len} bytes, over the limit of {MAX_TOKEN_BYTES}")));
    }
    let token = r.bytes(token_len, "hello.token")?;
    let token = if token.is_empty() {
        None
    } else {
        Some(String::from_utf8(token.to_vec()).map_err(|_| ProtocolError::malformed("hello.token", "not UTF-8"))?)
    };
    Ok(request(Request::Hello(Hello { version, features, token })))
}

/// PUT: `u32 count, count × (key, u32 len, u32 crc32c)`; the payloads,
/// which must add up to the frame's, are left to read.
pub(super) fn put(b: &mut Body) -> Result<Meta, ProtocolError> {
    let r = &mut b.r;
    let count = r.count(b.limits, "put.count", 10)?;
    let mut slots = Vec::with_capacity(count);
    let mut total = 0u64;
    for i in 0..count {
        let key = r.key(i, b.limits)?;
        let len = r.u32("put.len")?;
        let crc = r.u32("put.crc")?;
        total += len as u64;
        slots.push(PayloadSlot { key, len, crc });
    }
    check_unique(slots.iter().map(|s| &s.key[..]))?;
    if total != b.payload_len {
        return Err(ProtocolError::malformed(
            "put.len",
            format!("block lengths add up to {total} bytes but the frame carries {}", b.payload_len),
        ));
    }
    Ok(Meta::Put(slots))
}

/// The meta GET, EXISTS and DELETE share: `u32 count, count × key`, no key
/// twice.
fn unique_keys(b: &mut Body) -> Result<Vec<Bytes>, ProtocolError> {
    b.no_payload("keys")?;
    let keys = b.r.keys(b.limits, "count")?;
    check_unique(keys.iter().map(|k| &k[..]))?;
    Ok(keys)
}

pub(super) fn get(b: &mut Body) -> Result<Meta, ProtocolError> {
    Ok(request(Request::Get { keys: unique_keys(b)? }))
}

pub(super) fn exists(b: &mut Body) -> Result<Meta, ProtocolError> {
    Ok(request(Request::Exists { keys: unique_keys(b)? }))
}

pub(super) fn delete(b: &mut Body) -> Result<Meta, ProtocolError> {
    Ok(request(Request::Delete { keys: unique_keys(b)? }))
}

/// MATCH_PREFIX: `u32 lease_ms, u32 count, count × key`; unlike the other
/// batches it may name a key twice (docs/protocol.md, "Unique keys").
pub(super) fn match_prefix(b: &mut Body) -> Result<Meta, ProtocolError> {
    b.no_payload("match_prefix")?;
    let lease_ms = b.r.u32("match_prefix.lease_ms")?;
    let keys = b.r.keys(b.limits, "match_prefix.count")?;
    Ok(request(Request::MatchPrefix { keys, lease_ms }))
}

pub(super) fn stats(b: &mut Body) -> Result<Meta, ProtocolError> {
    b.no_payload("stats")?;
    Ok(request(Request::Stats))
}

pub(super) fn ping(b: &mut Body) -> Result<Meta, ProtocolError> {
    b.no_payload("ping")?;
    Ok(request(Request::Ping))
}

/// CLUSTER_TABLE: `u64 after_version, u32 wait_ms`.
pub(super) fn cluster_table(b: &mut Body) -> Result<Meta, ProtocolError> {
    b.no_payload("cluster_table")?;
    let after_version = b.r.u64("cluster_table.after_version")?;
    let wait_ms = b.r.u32("cluster_table.wait_ms")?;
    Ok(request(Request::ClusterTable { after_version, wait_ms }))
}

/// RDMA_DESCRIBE: `u32 lease_ms, u32 count, count × key`, no key twice.
pub(super) fn rdma_describe(b: &mut Body) -> Result<Meta, ProtocolError> {
    b.no_payload("rdma_describe")?;
    let lease_ms = b.r.u32("rdma_describe.lease_ms")?;
    let keys = b.r.keys(b.limits, "rdma_describe.count")?;
    check_unique(keys.iter().map(|k| &k[..]))?;
    Ok(request(Request::RdmaDescribe { keys, lease_ms }))
}

/// RDMA_CONNECT: the client's queue pair endpoint.
pub(super) fn rdma_connect(b: &mut Body) -> Result<Meta, ProtocolError> {
    b.no_payload("rdma_connect")?;
    let endpoint = b.r.endpoint("rdma_connect.endpoint")?;
    Ok(request(Request::RdmaConnect { endpoint }))
}

pub(super) fn shm_attach(b: &mut Body) -> Result<Meta, ProtocolError> {
    b.no_payload("shm_attach")?;
    Ok(request(Request::ShmAttach))
}

/// PUT_SHM: `u32 count, count × (key, u64 offset, u32 len, u32 crc32c)`.
pub(super) fn put_shm(b: &mut Body) -> Result<Meta, ProtocolError> {
    b.no_payload("put_shm")?;
    let r = &mut b.r;
    let count = r.count(b.limits, "put_shm.count", 19)?;
    let mut entries = Vec::with_capacity(count);
    for i in 0..count {
        let key = r.key(i, b.limits)?;
        let offset = r.u64("put_shm.offset")?;
        let len = r.u32("put_shm.len")?;
        let crc = r.u32("put_shm.crc")?;
        entries.push(ShmPut { key, offset, len, crc });
    }
    check_unique(entries.iter().map(|e| &e.key[..]))?;
    Ok(request(Request::PutShm { entries }))
}

/// GET_SHM: `u32 count, count × (key, u64 offset, u32 capacity)`.
pub(super) fn get_shm(b: &mut Body) -> Result<Meta, ProtocolError> {
    b.no_payload("get_shm")?;
    let r = &mut b.r;
    let count = r.count(b.limits, "get_shm.count", 15)?;
    let mut entries = Vec::with_capacity(count);
    for i in 0..count {
        let key = r.key(i, b.limits)?;
        let offset = r.u64("get_shm.offset")?;
        let capacity = r.u32("get_shm.capacity")?;
        entries.push(ShmGet { key, offset, capacity });
    }
    check_unique(entries.iter().map(|e| &e.key[..]))?;
    Ok(request(Request::GetShm { entries }))
}
