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
//! | CLUSTER_TABLE | `u64 after_version, u32 wait_ms` |
//! | SHM_ATTACH | empty |
//! | PUT_SHM | `u32 count, count × (key, u64 offset, u32 len, u32 crc32c)` |
//! | GET_SHM | `u32 count, count × (key, u64 offset, u32 capacity)` |
//! | *_RESULT (put, exists, delete, put_shm) | `u32 count, count × u16 status` |
//! | GET_RESULT | `u32 count, count × (u16 status, u32 len, u32 crc32c)` — payloads of the status-0 entries follow |
//! | MATCH_PREFIX_RESULT | `u32 matched, u32 lease_ms` |
//! | STATS_RESULT | `u32 count, count × (u16 name_len, name, u64 value)` |
//! | CLUSTER_TABLE_RESULT | `u64 version, u32 slots, u16 replicas, u16 member_count`, members × (`id, endpoint, zone` as `u16 len` + UTF-8, `u32 weight, u8 state`), `slots × replicas × u16 owner`; the write quorum is in the header's flags |
//! | SHM_ATTACH_RESULT | `u64 size` |
//! | GET_SHM_RESULT | `u32 count, count × (u16 status, u32 len, u32 crc32c)` |
//! | RDMA_DESCRIBE_RESULT | `u32 count, count × (u16 status, and for status 0 the 68-byte descriptor)` |
//! | RDMA_CONNECT, RDMA_CONNECT_RESULT | the 30-byte queue pair endpoint |
//! | ERROR | `u16 code, u16 message_len, message (UTF-8)` |
//!
//! Requests are written and read in `request`, answers (and ERROR) in
//! `response`: one decoder per operation, each naming the fields it reads,
//! so that what a frame of one opcode may hold is in one short function.
//! [`decode_body`] only picks the decoder and checks that the meta was
//! consumed exactly; `reader` holds the bounds-checked cursor they share.

use bytes::{BufMut, Bytes};

use crate::error::{DecodeError, ErrorCode, ProtocolError};
use crate::frame::{FrameHeader, Opcode, HEADER_LEN, VERSION};
use crate::limits::Limits;
use crate::message::{Block, Frame, Message, PutEntry, Request, Response};

mod reader;
mod request;
mod response;

use reader::{Body, Reader};

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

/// What [`encode`] makes room for after the header before any meta is
/// written.
const SMALL_META_BYTES: usize = 232;

/// Encodes a frame. Fails only when a value cannot be represented on the
/// wire (a key longer than 65535 bytes, more than 2^32 entries, a frame over
/// 4 GiB); limits the peer announced are the caller's to respect.
pub fn encode(frame: &Frame) -> Result<EncodedFrame, ProtocolError> {
    // Room for the header and a small meta (a PUT's answer for 32 keys is
    // 68 bytes), so that most frames are written without growing the
    // buffer; the batch encoders reserve for larger metas.
    let mut head = Vec::with_capacity(HEADER_LEN + SMALL_META_BYTES);
    head.resize(HEADER_LEN, 0);
    let mut payloads = Vec::new();
    match &frame.message {
        Message::Request(req) => request::encode(req, &mut head, &mut payloads)?,
        Message::Response(resp) => response::encode(resp, &mut head, &mut payloads)?,
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
        flags: header_flags(&frame.message)?,
        request_id: frame.request_id,
        body_len,
        meta_len: meta_len as u32,
    };
    let mut fixed = [0u8; HEADER_LEN];
    header.write(&mut fixed);
    head[..HEADER_LEN].copy_from_slice(&fixed);
    Ok(EncodedFrame { head, payloads })
}

/// The header's flags byte for `message`: 0, except on CLUSTER_TABLE_RESULT,
/// whose low four bits carry the table's write quorum (see
/// `response::cluster_table_result` for why it lives in the header).
fn header_flags(message: &Message) -> Result<u8, ProtocolError> {
    match message {
        Message::Response(Response::ClusterTable(t)) => response::write_quorum_flags(t),
        _ => Ok(0),
    }
}

pub(super) fn put_count(out: &mut Vec<u8>, n: usize, field: &'static str) -> Result<(), ProtocolError> {
    let n = u32::try_from(n).map_err(|_| ProtocolError::malformed(field, format!("{n} entries do not fit in a u32")))?;
    out.put_u32_le(n);
    Ok(())
}

pub(super) fn put_key(out: &mut Vec<u8>, key: &[u8], index: usize) -> Result<(), ProtocolError> {
    let len = u16::try_from(key.len()).map_err(|_| ProtocolError::KeyTooLong { index, len: key.len(), limit: u16::MAX as usize })?;
    out.put_u16_le(len);
    out.extend_from_slice(key);
    Ok(())
}

pub(super) fn put_keys(out: &mut Vec<u8>, keys: &[Bytes]) -> Result<(), ProtocolError> {
    reserve_meta(out, 4 + keys.iter().map(|k| 2 + k.len()).sum::<usize>());
    put_count(out, keys.len(), "count")?;
    for (i, k) in keys.iter().enumerate() {
        put_key(out, k, i)?;
    }
    Ok(())
}

/// Makes room for `bytes` of a batch's meta before it is written, up to
/// [`MAX_META_RESERVE_BYTES`]: ordinary batches are then written without
/// growing the buffer, and a caller's batch that will be refused as it is
/// written (a key over 64 KiB, repeated as often as it likes) cannot make
/// the reservation ask the allocator for more than that.
pub(super) fn reserve_meta(out: &mut Vec<u8>, bytes: usize) {
    out.reserve(bytes.min(MAX_META_RESERVE_BYTES));
}

/// See [`reserve_meta`].
const MAX_META_RESERVE_BYTES: usize = 1 << 20;

pub(super) fn payload_len(len: usize, index: usize) -> Result<u32, ProtocolError> {
    u32::try_from(len).map_err(|_| ProtocolError::malformed("payload", format!("block #{index} of {len} bytes exceeds 4 GiB")))
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
    let decode_meta: fn(&mut Body) -> Result<Meta, ProtocolError> = match opcode {
        Opcode::Hello => request::hello,
        Opcode::Put => request::put,
        Opcode::Get => request::get,
        Opcode::Exists => request::exists,
        Opcode::Delete => request::delete,
        Opcode::MatchPrefix => request::match_prefix,
        Opcode::Stats => request::stats,
        Opcode::Ping => request::ping,
        Opcode::ClusterTable => request::cluster_table,
        Opcode::ShmAttach => request::shm_attach,
        Opcode::PutShm => request::put_shm,
        Opcode::GetShm => request::get_shm,
        Opcode::RdmaDescribe => request::rdma_describe,
        Opcode::RdmaConnect => request::rdma_connect,
        Opcode::HelloAck => response::hello_ack,
        Opcode::PutResult => response::put_result,
        Opcode::GetResult => response::get_result,
        Opcode::ExistsResult => response::exists_result,
        Opcode::DeleteResult => response::delete_result,
        Opcode::MatchPrefixResult => response::match_prefix_result,
        Opcode::StatsResult => response::stats_result,
        Opcode::Pong => response::pong,
        Opcode::ClusterTableResult => response::cluster_table_result,
        Opcode::ShmAttachResult => response::shm_attach_result,
        Opcode::PutShmResult => response::put_shm_result,
        Opcode::GetShmResult => response::get_shm_result,
        Opcode::RdmaDescribeResult => response::rdma_describe_result,
        Opcode::RdmaConnectResult => response::rdma_connect_result,
        Opcode::Error => response::error,
    };
    let mut body = Body { r: Reader::new(meta), limits, payload_len: header.payload_len() as u64, flags: header.flags };
    let meta = decode_meta(&mut body)?;
    body.r.finish()?;
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

#[cfg(test)]
mod tests;
