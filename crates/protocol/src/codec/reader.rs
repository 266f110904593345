//! The bounds-checked cursor every per-operation decoder reads the meta
//! with, and what those decoders are handed.

use bytes::Bytes;

use super::Meta;
use crate::error::ProtocolError;
use crate::limits::Limits;
use crate::message::{Message, Request, Response};
use crate::rdma::{QueuePairEndpoint, ENDPOINT_LEN};

/// A frame's meta being decoded: the cursor over it, the limits it is held
/// to, how many payload bytes the header says follow it and the header's
/// flags byte (which CLUSTER_TABLE_RESULT uses for its write quorum).
pub(super) struct Body<'a> {
    pub(super) r: Reader,
    pub(super) limits: &'a Limits,
    pub(super) payload_len: u64,
    pub(super) flags: u8,
}

impl Body<'_> {
    /// Refuses payload bytes after a frame whose operation carries none
    /// (every one but PUT and GET_RESULT).
    pub(super) fn no_payload(&self, field: &'static str) -> Result<(), ProtocolError> {
        if self.payload_len != 0 {
            return Err(ProtocolError::malformed(field, format!("{} payload bytes after a frame that carries none", self.payload_len)));
        }
        Ok(())
    }
}

/// A request whose meta was its whole body.
pub(super) fn request(r: Request) -> Meta {
    Meta::Complete(Message::Request(r))
}

/// An answer whose meta was its whole body.
pub(super) fn response(r: Response) -> Meta {
    Meta::Complete(Message::Response(r))
}

/// Refuses a batch that names one key twice: a PUT would be ambiguous and
/// per-key answers could not be told apart.
/// The table is sized for the whole batch up front: grown from empty, its
/// rehashes cost more than the lookups on a batch of 32 keys. Its hasher is
/// foldhash, randomly seeded as the node's block table's is
/// (crates/node/src/cache), with a fresh per-table seed each frame:
/// SipHash, the standard library's, cost 300 instructions a key here, a
/// tenth of a 4 KiB PUT's work on the node outside the copy and the
/// checksum. foldhash claims only minimal resistance to chosen collisions;
/// here a peer who found some would cost the node at most a batch's keys
/// (`max_batch_keys`) compared with each other within one frame, and the
/// block table, which lives far longer, already accepts that risk.
pub(super) fn check_unique<'a>(keys: impl ExactSizeIterator<Item = &'a [u8]>) -> Result<(), ProtocolError> {
    let mut seen = std::collections::HashMap::with_capacity_and_hasher(keys.len(), foldhash::fast::RandomState::default());
    for (i, k) in keys.enumerate() {
        if let Some(first) = seen.insert(k, i) {
            return Err(ProtocolError::DuplicateKey { index: i, first });
        }
    }
    Ok(())
}

/// A bounds-checked cursor over the meta; every read names the field it was
/// reading, so a short frame is reported as "malformed put.crc: …".
pub(super) struct Reader {
    buf: Bytes,
    pos: usize,
}

impl Reader {
    pub(super) fn new(buf: Bytes) -> Reader {
        Reader { buf, pos: 0 }
    }

    // The readers below run a few times per key of every batch on both
    // sides: they are inlined into the decoders, and the refusal, which
    // formats a message, is kept out of line (`short`) so that it does not
    // stop them from being inlined. Before, `u32` alone was a call of about
    // 50 instructions, a hundred per PUT block on the node.
    #[inline]
    pub(super) fn take(&mut self, n: usize, field: &'static str) -> Result<&[u8], ProtocolError> {
        let Some(end) = self.pos.checked_add(n).filter(|&e| e <= self.buf.len()) else {
            return Err(self.short(n, field));
        };
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    #[cold]
    #[inline(never)]
    fn short(&self, n: usize, field: &'static str) -> ProtocolError {
        ProtocolError::malformed(field, format!("needs {n} bytes at offset {}, meta has {}", self.pos, self.buf.len()))
    }

    /// `N` bytes as an array: one bounds check, no slice to index again.
    #[inline]
    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], ProtocolError> {
        let b = self.take(N, field)?;
        Ok(b.try_into().expect("take returns exactly the bytes asked for"))
    }

    #[inline]
    pub(super) fn u16(&mut self, field: &'static str) -> Result<u16, ProtocolError> {
        self.array(field).map(u16::from_le_bytes)
    }

    #[inline]
    pub(super) fn u32(&mut self, field: &'static str) -> Result<u32, ProtocolError> {
        self.array(field).map(u32::from_le_bytes)
    }

    #[inline]
    pub(super) fn u64(&mut self, field: &'static str) -> Result<u64, ProtocolError> {
        self.array(field).map(u64::from_le_bytes)
    }

    /// A queue pair endpoint in its own wire form.
    pub(super) fn endpoint(&mut self, field: &'static str) -> Result<QueuePairEndpoint, ProtocolError> {
        let mut raw = [0u8; ENDPOINT_LEN];
        raw.copy_from_slice(self.take(ENDPOINT_LEN, field)?);
        QueuePairEndpoint::decode(&raw).map_err(|e| ProtocolError::malformed(field, e.to_string()))
    }

    #[inline]
    pub(super) fn bytes(&mut self, n: usize, field: &'static str) -> Result<Bytes, ProtocolError> {
        let start = self.pos;
        self.take(n, field)?;
        Ok(self.buf.slice(start..start + n))
    }

    /// A batch count, checked against the batch limit and against the bytes
    /// left in the meta (each entry takes at least `min_entry` bytes) before
    /// anything is reserved for it: a peer that declares four billion
    /// entries in a 28-byte frame gets an error, not an allocation.
    pub(super) fn count(&mut self, limits: &Limits, field: &'static str, min_entry: usize) -> Result<usize, ProtocolError> {
        let count = self.u32(field)?;
        if count > limits.max_batch_keys {
            return Err(ProtocolError::TooManyKeys { count: count as u64, limit: limits.max_batch_keys as u64 });
        }
        self.fits(count as usize, min_entry, field)?;
        Ok(count as usize)
    }

    pub(super) fn fits(&self, count: usize, min_entry: usize, field: &'static str) -> Result<(), ProtocolError> {
        let left = self.buf.len() - self.pos;
        if count.saturating_mul(min_entry) > left {
            return Err(ProtocolError::malformed(
                field,
                format!("{count} entries of at least {min_entry} bytes do not fit in the {left} bytes left"),
            ));
        }
        Ok(())
    }

    #[inline]
    pub(super) fn key(&mut self, index: usize, limits: &Limits) -> Result<Bytes, ProtocolError> {
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

    pub(super) fn keys(&mut self, limits: &Limits, field: &'static str) -> Result<Vec<Bytes>, ProtocolError> {
        let count = self.count(limits, field, 2)?;
        let mut keys = Vec::with_capacity(count);
        for i in 0..count {
            keys.push(self.key(i, limits)?);
        }
        Ok(keys)
    }

    pub(super) fn string(&mut self, max: usize, field: &'static str) -> Result<String, ProtocolError> {
        let len = self.u16(field)? as usize;
        if len > max {
            return Err(ProtocolError::malformed(field, format!("{len} bytes, over the limit of {max}")));
        }
        let raw = self.bytes(len, field)?;
        String::from_utf8(raw.to_vec()).map_err(|_| ProtocolError::malformed(field, "not UTF-8"))
    }

    pub(super) fn finish(&self) -> Result<(), ProtocolError> {
        if self.pos != self.buf.len() {
            return Err(ProtocolError::malformed("meta", format!("{} trailing bytes", self.buf.len() - self.pos)));
        }
        Ok(())
    }
}
