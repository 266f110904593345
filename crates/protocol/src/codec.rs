//! Encoding and decoding of whole frames, and of a frame's meta on its own.
//!
//! Two ways in, one set of rules:
//! * [`decode`] takes a buffer that may hold a whole frame (the fuzz target,
//!   small control frames, tests);
//! * [`decode_body`] takes a parsed header and the frame's meta only, and for
//!   PUT requests and GET answers returns the list of payloads still to read,
//!   so an IO loop can read them straight into their destination.
//!
//! Meta layouts (all integers little-endian; `key` is `u16 len` + bytes):
//!
//! | opcode | meta |
//! |---|---|
//! | HELLO | `u16 version, u64 features, u16 token_len, token` |
//! | HELLO_ACK | `u16 version, u64 features, u32 max_frame, u32 max_key, u32 max_batch, u32 max_lease_ms` |
//! | PUT | `u32 count, count × (key, u32 len, u32 crc32c)` — payloads follow |
//! | GET / EXISTS / DELETE | `u32 count, count × key` |
//! | MATCH_PREFIX, RDMA_DESCRIBE | `u32 lease_ms, u32 count, count × key` |
//! | STATS, PING, PONG | empty |
//! | *_RESULT (put, exists, delete) | `u32 count, count × u16 status` |
//! | GET_RESULT | `u32 count, count × (u16 status, u32 len, u32 crc32c)` — payloads of the status-0 entries follow |
//! | MATCH_PREFIX_RESULT | `u32 matched, u32 lease_ms` |
//! | STATS_RESULT | `u32 count, count × (u16 name_len, name, u64 value)` |
//! | RDMA_DESCRIBE_RESULT | `u32 count, count × (u16 status, and for status 0 the 68-byte descriptor)` |
//! | RDMA_CONNECT, RDMA_CONNECT_RESULT | the 30-byte queue pair endpoint |
//! | ERROR | `u16 code, u16 message_len, message (UTF-8)` |

use bytes::{BufMut, Bytes};

use crate::error::{DecodeError, ErrorCode, ProtocolError};
use crate::frame::{Features, FrameHeader, Opcode, HEADER_LEN, VERSION};
use crate::limits::{
    Limits, MAX_CLUSTER_MEMBERS, MAX_CLUSTER_REPLICAS, MAX_CLUSTER_SLOTS, MAX_CLUSTER_STRING_BYTES, MAX_ERROR_MESSAGE_BYTES,
    MAX_STATS_ENTRIES, MAX_TOKEN_BYTES,
};
use crate::message::{Block, Frame, Hello, HelloAck, Message, PutEntry, Request, Response, StatEntry};
use crate::message::{ShmBlock, ShmGet, ShmPut};
use crate::placement::{Member, MemberState, SlotTable};
use kvplane_rdma::descriptor::ENCODED_LEN as DESCRIPTOR_LEN;
use kvplane_rdma::{Descriptor, Endpoint, ENDPOINT_LEN};

/// A frame ready to write: header and meta in one buffer, payloads as the
/// shared buffers they already live in.
#[derive(Debug, Clone)]
pub struct EncodedFrame {
    pub head: Vec<u8>,
    pub payloads: Vec<Bytes>,
}

impl EncodedFrame {
    /// Total bytes on the wire.
    pub fn len(&self) -> usize {
        self.head.len() + self.payloads.iter().map(Bytes::len).sum::<usize>()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The frame as one contiguous buffer (tests, fuzzing, small frames).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.len());
        out.extend_from_slice(&self.head);
        for p in &self.payloads {
            out.extend_from_slice(p);
        }
        out
    }
}

/// Encodes a frame. Fails only when a value cannot be represented on the
/// wire (a key longer than 65535 bytes, more than 2^32 entries, a frame over
/// 4 GiB); limits the peer announced are the caller's to respect.
pub fn encode(frame: &Frame) -> Result<EncodedFrame, ProtocolError> {
    let mut head = vec![0u8; HEADER_LEN];
    let mut payloads = Vec::new();
    match &frame.message {
        Message::Request(req) => encode_request(req, &mut head, &mut payloads)?,
        Message::Response(resp) => encode_response(resp, &mut head, &mut payloads)?,
    }
    let meta_len = head.len() - HEADER_LEN;
    let payload_len: usize = payloads.iter().map(Bytes::len).sum();
    let body_len = meta_len
        .checked_add(payload_len)
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| ProtocolError::FrameTooLarge { declared: (meta_len + payload_len) as u64, limit: u32::MAX as u64 })?;
    let header = FrameHeader {
        version: VERSION,
        opcode: frame.message.opcode() as u8,
        flags: 0,
        request_id: frame.request_id,
        body_len,
        meta_len: meta_len as u32,
    };
    let mut fixed = [0u8; HEADER_LEN];
    header.write(&mut fixed);
    head[..HEADER_LEN].copy_from_slice(&fixed);
    Ok(EncodedFrame { head, payloads })
}

fn put_count(out: &mut Vec<u8>, n: usize, field: &'static str) -> Result<(), ProtocolError> {
    let n = u32::try_from(n).map_err(|_| ProtocolError::malformed(field, format!("{n} entries do not fit in a u32")))?;
    out.put_u32_le(n);
    Ok(())
}

fn put_key(out: &mut Vec<u8>, key: &[u8], index: usize) -> Result<(), ProtocolError> {
    let len = u16::try_from(key.len()).map_err(|_| ProtocolError::KeyTooLong { index, len: key.len(), limit: u16::MAX as usize })?;
    out.put_u16_le(len);
    out.extend_from_slice(key);
    Ok(())
}

fn put_keys(out: &mut Vec<u8>, keys: &[Bytes]) -> Result<(), ProtocolError> {
    put_count(out, keys.len(), "count")?;
    for (i, k) in keys.iter().enumerate() {
        put_key(out, k, i)?;
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

fn payload_len(len: usize, index: usize) -> Result<u32, ProtocolError> {
    u32::try_from(len).map_err(|_| ProtocolError::malformed("payload", format!("block #{index} of {len} bytes exceeds 4 GiB")))
}

fn encode_request(req: &Request, out: &mut Vec<u8>, payloads: &mut Vec<Bytes>) -> Result<(), ProtocolError> {
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

fn encode_response(resp: &Response, out: &mut Vec<u8>, payloads: &mut Vec<Bytes>) -> Result<(), ProtocolError> {
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

/// One payload still to be read after the meta: its key (PUT), length and
/// the checksum it must hash to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PayloadSlot {
    pub key: Bytes,
    pub len: u32,
    pub crc: u32,
}

/// What a frame's meta says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Meta {
    /// The meta was the whole body: the message is complete.
    Complete(Message),
    /// A PUT whose payloads follow, one per slot, in order.
    Put(Vec<PayloadSlot>),
    /// A GET answer whose payloads follow for the `Ok` entries, in order
    /// (the slot's key is empty: answers are matched to keys by position).
    Get(Vec<Result<PayloadSlot, ErrorCode>>),
}

/// Decodes the meta of a frame whose header is `header`. `meta` must be
/// exactly `header.meta_len` bytes. Checks every limit and that the payload
/// lengths add up to what the header declares, so the caller may read
/// `header.payload_len()` bytes with confidence.
pub fn decode_body(header: &FrameHeader, meta: Bytes, limits: &Limits) -> Result<Meta, ProtocolError> {
    let opcode = Opcode::from_u8(header.opcode).ok_or(ProtocolError::UnknownOpcode { opcode: header.opcode })?;
    let mut r = Reader { buf: meta, pos: 0 };
    let payload_len = header.payload_len() as u64;
    let no_payload = |field: &'static str| -> Result<(), ProtocolError> {
        if payload_len != 0 {
            return Err(ProtocolError::malformed(field, format!("{payload_len} payload bytes after a frame that carries none")));
        }
        Ok(())
    };
    let meta = match opcode {
        Opcode::Hello => {
            no_payload("hello")?;
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
            Meta::Complete(Message::Request(Request::Hello(Hello { version, features, token })))
        }
        Opcode::HelloAck => {
            no_payload("hello_ack")?;
            let version = r.u16("hello_ack.version")?;
            let features = Features(r.u64("hello_ack.features")?);
            let limits = Limits {
                max_frame_bytes: r.u32("hello_ack.max_frame")?,
                max_key_bytes: r.u32("hello_ack.max_key")?,
                max_batch_keys: r.u32("hello_ack.max_batch")?,
                max_lease_ms: r.u32("hello_ack.max_lease_ms")?,
            };
            Meta::Complete(Message::Response(Response::HelloAck(HelloAck { version, features, limits })))
        }
        Opcode::Put => {
            let count = r.count(limits, "put.count", 10)?;
            let mut slots = Vec::with_capacity(count);
            let mut total = 0u64;
            for i in 0..count {
                let key = r.key(i, limits)?;
                let len = r.u32("put.len")?;
                let crc = r.u32("put.crc")?;
                total += len as u64;
                slots.push(PayloadSlot { key, len, crc });
            }
            check_unique(slots.iter().map(|s| &s.key[..]))?;
            if total != payload_len {
                return Err(ProtocolError::malformed(
                    "put.len",
                    format!("block lengths add up to {total} bytes but the frame carries {payload_len}"),
                ));
            }
            Meta::Put(slots)
        }
        Opcode::Get | Opcode::Exists | Opcode::Delete => {
            no_payload("keys")?;
            let keys = r.keys(limits, "count")?;
            check_unique(keys.iter().map(|k| &k[..]))?;
            Meta::Complete(Message::Request(match opcode {
                Opcode::Get => Request::Get { keys },
                Opcode::Exists => Request::Exists { keys },
                _ => Request::Delete { keys },
            }))
        }
        Opcode::MatchPrefix => {
            no_payload("match_prefix")?;
            let lease_ms = r.u32("match_prefix.lease_ms")?;
            let keys = r.keys(limits, "match_prefix.count")?;
            Meta::Complete(Message::Request(Request::MatchPrefix { keys, lease_ms }))
        }
        Opcode::Stats => {
            no_payload("stats")?;
            Meta::Complete(Message::Request(Request::Stats))
        }
        Opcode::Ping => {
            no_payload("ping")?;
            Meta::Complete(Message::Request(Request::Ping))
        }
        Opcode::Pong => {
            no_payload("pong")?;
            Meta::Complete(Message::Response(Response::Pong))
        }
        Opcode::ClusterTable => {
            no_payload("cluster_table")?;
            let after_version = r.u64("cluster_table.after_version")?;
            let wait_ms = r.u32("cluster_table.wait_ms")?;
            Meta::Complete(Message::Request(Request::ClusterTable { after_version, wait_ms }))
        }
        Opcode::RdmaDescribe => {
            no_payload("rdma_describe")?;
            let lease_ms = r.u32("rdma_describe.lease_ms")?;
            let keys = r.keys(limits, "rdma_describe.count")?;
            check_unique(keys.iter().map(|k| &k[..]))?;
            Meta::Complete(Message::Request(Request::RdmaDescribe { keys, lease_ms }))
        }
        Opcode::RdmaDescribeResult => {
            no_payload("rdma_describe_result")?;
            let count = r.count(limits, "rdma_describe_result.count", 2)?;
            let mut results = Vec::with_capacity(count);
            for _ in 0..count {
                results.push(match ErrorCode::from_u16(r.u16("rdma_describe_result.status")?) {
                    None => {
                        let bytes = r.take(DESCRIPTOR_LEN, "rdma_describe_result.descriptor")?;
                        Ok(Descriptor::decode(bytes)
                            .map_err(|e| ProtocolError::malformed("rdma_describe_result.descriptor", e.to_string()))?)
                    }
                    Some(code) => Err(code),
                });
            }
            Meta::Complete(Message::Response(Response::RdmaDescribe { results }))
        }
        Opcode::RdmaConnect => {
            no_payload("rdma_connect")?;
            let endpoint = r.endpoint("rdma_connect.endpoint")?;
            Meta::Complete(Message::Request(Request::RdmaConnect { endpoint }))
        }
        Opcode::RdmaConnectResult => {
            no_payload("rdma_connect_result")?;
            let endpoint = r.endpoint("rdma_connect_result.endpoint")?;
            Meta::Complete(Message::Response(Response::RdmaConnect { endpoint }))
        }
        Opcode::ShmAttach => {
            no_payload("shm_attach")?;
            Meta::Complete(Message::Request(Request::ShmAttach))
        }
        Opcode::ShmAttachResult => {
            no_payload("shm_attach_result")?;
            let size = r.u64("shm_attach_result.size")?;
            Meta::Complete(Message::Response(Response::ShmAttach { size }))
        }
        Opcode::PutShm => {
            no_payload("put_shm")?;
            let count = r.count(limits, "put_shm.count", 19)?;
            let mut entries = Vec::with_capacity(count);
            for i in 0..count {
                let key = r.key(i, limits)?;
                let offset = r.u64("put_shm.offset")?;
                let len = r.u32("put_shm.len")?;
                let crc = r.u32("put_shm.crc")?;
                entries.push(ShmPut { key, offset, len, crc });
            }
            check_unique(entries.iter().map(|e| &e.key[..]))?;
            Meta::Complete(Message::Request(Request::PutShm { entries }))
        }
        Opcode::GetShm => {
            no_payload("get_shm")?;
            let count = r.count(limits, "get_shm.count", 15)?;
            let mut entries = Vec::with_capacity(count);
            for i in 0..count {
                let key = r.key(i, limits)?;
                let offset = r.u64("get_shm.offset")?;
                let capacity = r.u32("get_shm.capacity")?;
                entries.push(ShmGet { key, offset, capacity });
            }
            check_unique(entries.iter().map(|e| &e.key[..]))?;
            Meta::Complete(Message::Request(Request::GetShm { entries }))
        }
        Opcode::PutShmResult => {
            no_payload("put_shm_result")?;
            let count = r.count(limits, "put_shm_result.count", 2)?;
            let mut results = Vec::with_capacity(count);
            for _ in 0..count {
                results.push(match ErrorCode::from_u16(r.u16("put_shm_result.status")?) {
                    None => Ok(()),
                    Some(code) => Err(code),
                });
            }
            Meta::Complete(Message::Response(Response::PutShm { results }))
        }
        Opcode::GetShmResult => {
            no_payload("get_shm_result")?;
            let count = r.count(limits, "get_shm_result.count", 10)?;
            let mut results = Vec::with_capacity(count);
            for _ in 0..count {
                let status = r.u16("get_shm_result.status")?;
                let len = r.u32("get_shm_result.len")?;
                let crc = r.u32("get_shm_result.crc")?;
                results.push(match ErrorCode::from_u16(status) {
                    None => Ok(ShmBlock { len, crc }),
                    Some(code) => {
                        if len != 0 || crc != 0 {
                            return Err(ProtocolError::malformed(
                                "get_shm_result.len",
                                format!("a length or checksum for a key answered {code}"),
                            ));
                        }
                        Err(code)
                    }
                });
            }
            Meta::Complete(Message::Response(Response::GetShm { results }))
        }
        Opcode::ClusterTableResult => {
            no_payload("cluster_table_result")?;
            Meta::Complete(Message::Response(Response::ClusterTable(Box::new(r.cluster_table()?))))
        }
        Opcode::PutResult | Opcode::ExistsResult | Opcode::DeleteResult => {
            no_payload("results")?;
            let count = r.count(limits, "results.count", 2)?;
            let mut results = Vec::with_capacity(count);
            for _ in 0..count {
                results.push(match ErrorCode::from_u16(r.u16("results.status")?) {
                    None => Ok(()),
                    Some(code) => Err(code),
                });
            }
            Meta::Complete(Message::Response(match opcode {
                Opcode::PutResult => Response::Put { results },
                Opcode::ExistsResult => Response::Exists { results },
                _ => Response::Delete { results },
            }))
        }
        Opcode::GetResult => {
            let count = r.count(limits, "get_result.count", 10)?;
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
                            return Err(ProtocolError::malformed(
                                "get_result.len",
                                format!("{len} bytes declared for a key answered {code}"),
                            ));
                        }
                        Err(code)
                    }
                });
            }
            if total != payload_len {
                return Err(ProtocolError::malformed(
                    "get_result.len",
                    format!("block lengths add up to {total} bytes but the frame carries {payload_len}"),
                ));
            }
            Meta::Get(slots)
        }
        Opcode::MatchPrefixResult => {
            no_payload("match_prefix_result")?;
            let matched = r.u32("match_prefix_result.matched")?;
            let lease_ms = r.u32("match_prefix_result.lease_ms")?;
            Meta::Complete(Message::Response(Response::MatchPrefix { matched, lease_ms }))
        }
        Opcode::StatsResult => {
            no_payload("stats_result")?;
            let count = r.u32("stats_result.count")? as usize;
            if count > MAX_STATS_ENTRIES {
                return Err(ProtocolError::malformed(
                    "stats_result.count",
                    format!("{count} entries, over the limit of {MAX_STATS_ENTRIES}"),
                ));
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
            Meta::Complete(Message::Response(Response::Stats { entries }))
        }
        Opcode::Error => {
            no_payload("error")?;
            let raw = r.u16("error.code")?;
            let code = ErrorCode::from_u16(raw).ok_or_else(|| ProtocolError::malformed("error.code", "0 is success, not an error"))?;
            let len = r.u16("error.message_len")? as usize;
            if len > MAX_ERROR_MESSAGE_BYTES {
                return Err(ProtocolError::malformed("error.message", format!("{len} bytes, over the limit of {MAX_ERROR_MESSAGE_BYTES}")));
            }
            let message = r.bytes(len, "error.message")?;
            let message = String::from_utf8(message.to_vec()).map_err(|_| ProtocolError::malformed("error.message", "not UTF-8"))?;
            Meta::Complete(Message::Response(Response::Error { code, message }))
        }
    };
    r.finish()?;
    Ok(meta)
}

/// Decodes one frame from the front of `buf`. `Ok(None)` means more bytes are
/// needed; `Ok(Some((frame, used)))` consumed `used` bytes. Payloads are
/// slices of `buf` and their checksums are verified.
pub fn decode(buf: &Bytes, limits: &Limits) -> Result<Option<(Frame, usize)>, DecodeError> {
    if buf.len() < HEADER_LEN {
        return Ok(None);
    }
    let mut fixed = [0u8; HEADER_LEN];
    fixed.copy_from_slice(&buf[..HEADER_LEN]);
    let header = FrameHeader::parse(&fixed).map_err(|error| DecodeError { error, request_id: None, fatal: true })?;
    let frame_len = header.frame_len();
    if frame_len > limits.max_frame_bytes as u64 {
        return Err(DecodeError {
            error: ProtocolError::FrameTooLarge { declared: frame_len, limit: limits.max_frame_bytes as u64 },
            request_id: Some(header.request_id),
            fatal: true,
        });
    }
    if (buf.len() as u64) < frame_len {
        return Ok(None);
    }
    let frame_len = frame_len as usize;
    let meta_end = HEADER_LEN + header.meta_len as usize;
    let fail = |error| DecodeError { error, request_id: Some(header.request_id), fatal: false };
    let meta = decode_body(&header, buf.slice(HEADER_LEN..meta_end), limits).map_err(fail)?;
    let mut pos = meta_end;
    let mut take = |slot: &PayloadSlot, index: usize| -> Result<Block, ProtocolError> {
        let data = buf.slice(pos..pos + slot.len as usize);
        pos += slot.len as usize;
        let actual = crate::message::checksum(&data);
        if actual != slot.crc {
            return Err(ProtocolError::BadChecksum { index, expected: slot.crc, actual });
        }
        Ok(Block::with_crc(data, slot.crc))
    };
    let message = match meta {
        Meta::Complete(m) => m,
        Meta::Put(slots) => {
            let mut entries = Vec::with_capacity(slots.len());
            for (i, s) in slots.iter().enumerate() {
                entries.push(PutEntry { key: s.key.clone(), block: take(s, i).map_err(fail)? });
            }
            Message::Request(Request::Put { entries })
        }
        Meta::Get(slots) => {
            let mut results = Vec::with_capacity(slots.len());
            for (i, s) in slots.iter().enumerate() {
                results.push(match s {
                    Ok(s) => Ok(take(s, i).map_err(fail)?),
                    Err(code) => Err(*code),
                });
            }
            Message::Response(Response::Get { results })
        }
    };
    debug_assert_eq!(pos, frame_len);
    Ok(Some((Frame { request_id: header.request_id, message }, frame_len)))
}

/// Refuses a batch that names one key twice: a PUT would be ambiguous and
/// per-key answers could not be told apart.
fn check_unique<'a>(keys: impl Iterator<Item = &'a [u8]>) -> Result<(), ProtocolError> {
    let mut seen = std::collections::HashMap::new();
    for (i, k) in keys.enumerate() {
        if let Some(first) = seen.insert(k, i) {
            return Err(ProtocolError::DuplicateKey { index: i, first });
        }
    }
    Ok(())
}

/// A bounds-checked cursor over the meta; every read names the field it was
/// reading, so a short frame is reported as "malformed put.crc: …".
struct Reader {
    buf: Bytes,
    pos: usize,
}

impl Reader {
    fn take(&mut self, n: usize, field: &'static str) -> Result<&[u8], ProtocolError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len()).ok_or_else(|| {
            ProtocolError::malformed(field, format!("needs {n} bytes at offset {}, meta has {}", self.pos, self.buf.len()))
        })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn u16(&mut self, field: &'static str) -> Result<u16, ProtocolError> {
        let b = self.take(2, field)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self, field: &'static str) -> Result<u32, ProtocolError> {
        let b = self.take(4, field)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, field: &'static str) -> Result<u64, ProtocolError> {
        let b = self.take(8, field)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    /// A queue pair endpoint in its own wire form.
    fn endpoint(&mut self, field: &'static str) -> Result<Endpoint, ProtocolError> {
        let mut raw = [0u8; ENDPOINT_LEN];
        raw.copy_from_slice(self.take(ENDPOINT_LEN, field)?);
        Endpoint::decode(&raw).map_err(|e| ProtocolError::malformed(field, e.to_string()))
    }

    fn bytes(&mut self, n: usize, field: &'static str) -> Result<Bytes, ProtocolError> {
        let start = self.pos;
        self.take(n, field)?;
        Ok(self.buf.slice(start..start + n))
    }

    /// A batch count, checked against the batch limit and against the bytes
    /// left in the meta (each entry takes at least `min_entry` bytes) before
    /// anything is reserved for it: a peer that declares four billion
    /// entries in a 28-byte frame gets an error, not an allocation.
    fn count(&mut self, limits: &Limits, field: &'static str, min_entry: usize) -> Result<usize, ProtocolError> {
        let count = self.u32(field)?;
        if count > limits.max_batch_keys {
            return Err(ProtocolError::TooManyKeys { count: count as u64, limit: limits.max_batch_keys as u64 });
        }
        self.fits(count as usize, min_entry, field)?;
        Ok(count as usize)
    }

    fn fits(&self, count: usize, min_entry: usize, field: &'static str) -> Result<(), ProtocolError> {
        let left = self.buf.len() - self.pos;
        if count.saturating_mul(min_entry) > left {
            return Err(ProtocolError::malformed(
                field,
                format!("{count} entries of at least {min_entry} bytes do not fit in the {left} bytes left"),
            ));
        }
        Ok(())
    }

    fn key(&mut self, index: usize, limits: &Limits) -> Result<Bytes, ProtocolError> {
        let len = self.u16("key.len")? as usize;
        let limit = limits.effective_max_key_bytes() as usize;
        if len > limit {
            return Err(ProtocolError::KeyTooLong { index, len, limit });
        }
        if len == 0 {
            return Err(ProtocolError::EmptyKey { index });
        }
        self.bytes(len, "key")
    }

    fn keys(&mut self, limits: &Limits, field: &'static str) -> Result<Vec<Bytes>, ProtocolError> {
        let count = self.count(limits, field, 2)?;
        let mut keys = Vec::with_capacity(count);
        for i in 0..count {
            keys.push(self.key(i, limits)?);
        }
        Ok(keys)
    }

    fn string(&mut self, max: usize, field: &'static str) -> Result<String, ProtocolError> {
        let len = self.u16(field)? as usize;
        if len > max {
            return Err(ProtocolError::malformed(field, format!("{len} bytes, over the limit of {max}")));
        }
        let raw = self.bytes(len, field)?;
        String::from_utf8(raw.to_vec()).map_err(|_| ProtocolError::malformed(field, "not UTF-8"))
    }

    /// A CLUSTER_TABLE_RESULT's meta, checked as a table (owners name
    /// existing members, no member twice in a slot, no down owner).
    fn cluster_table(&mut self) -> Result<SlotTable, ProtocolError> {
        let version = self.u64("cluster_table.version")?;
        let slots = self.u32("cluster_table.slots")?;
        let replicas = self.u16("cluster_table.replicas")? as u32;
        let count = self.u16("cluster_table.member_count")? as usize;
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
        self.fits(count, 11, "cluster_table.member_count")?;
        let mut members = Vec::with_capacity(count);
        for _ in 0..count {
            let id = self.string(MAX_CLUSTER_STRING_BYTES, "cluster_table.member.id")?;
            let endpoint = self.string(MAX_CLUSTER_STRING_BYTES, "cluster_table.member.endpoint")?;
            let zone = self.string(MAX_CLUSTER_STRING_BYTES, "cluster_table.member.zone")?;
            let weight = self.u32("cluster_table.member.weight")?;
            let state = match self.take(1, "cluster_table.member.state")?[0] {
                0 => MemberState::Joining,
                1 => MemberState::Up,
                2 => MemberState::Draining,
                3 => MemberState::Down,
                other => {
                    return Err(ProtocolError::malformed("cluster_table.member.state", format!("{other} is not a member state (0..=3)")))
                }
            };
            members.push(Member { id, endpoint, zone, weight, state, labels: Vec::new() });
        }
        let entries = slots as usize * replicas as usize;
        self.fits(entries, 2, "cluster_table.owners")?;
        let mut owners = Vec::with_capacity(entries);
        for _ in 0..entries {
            owners.push(self.u16("cluster_table.owner")? as u32);
        }
        SlotTable::new(version, members, slots, replicas, replicas, owners)
            .map_err(|e| ProtocolError::malformed("cluster_table.owners", e.to_string()))
    }

    fn finish(&self) -> Result<(), ProtocolError> {
        if self.pos != self.buf.len() {
            return Err(ProtocolError::malformed("meta", format!("{} trailing bytes", self.buf.len() - self.pos)));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
