//! Bounds a decoder enforces before it trusts anything a peer declares.
//!
//! A frame header states how many bytes follow; without a bound a single
//! header could make a node reserve gigabytes per connection. The server sends
//! its limits in `HelloAck` so a client can split batches before the server
//! has to refuse them.

/// Largest frame (header and body) accepted by default.
///
/// 128 MiB so that a batch of 32 blocks of 2 MiB (64 MiB of payload), the
/// largest shape the benchmarks drive, fits in one frame with room to spare.
pub const DEFAULT_MAX_FRAME_BYTES: u32 = 128 * 1024 * 1024;
/// Longest key accepted by default. Engines use hashes (32–64 bytes) or short
/// paths; anything near a kilobyte is a bug on the caller's side.
pub const DEFAULT_MAX_KEY_BYTES: u32 = 1024;
/// Most keys in one batch by default: large enough for a long prompt's chain
/// of block keys, small enough that per-key tables stay cheap.
pub const DEFAULT_MAX_BATCH_KEYS: u32 = 4096;
/// Longest pin lease a server grants by default. A pin only has to bridge the
/// gap between MATCH_PREFIX and the GET that follows it.
pub const DEFAULT_MAX_LEASE_MS: u32 = 10_000;

/// The wire can only express key lengths up to this (a `u16` field).
pub const WIRE_MAX_KEY_BYTES: u32 = u16::MAX as u32;
/// Longest bearer token carried in `Hello` (a `u16` length on the wire,
/// bounded further so a handshake cannot be used to push large allocations).
pub const MAX_TOKEN_BYTES: usize = 4096;
/// Longest message carried in an `Error` response; longer ones are cut at a
/// character boundary when encoded.
pub const MAX_ERROR_MESSAGE_BYTES: usize = 4096;
/// Most counters in one `StatsResult`.
pub const MAX_STATS_ENTRIES: usize = 1024;

/// What a decoder accepts from its peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest frame, header included.
    pub max_frame_bytes: u32,
    /// Longest key (at most [`WIRE_MAX_KEY_BYTES`]).
    pub max_key_bytes: u32,
    /// Most keys in one PUT / GET / EXISTS / DELETE / MATCH_PREFIX.
    pub max_batch_keys: u32,
    /// Longest pin lease the server grants; longer requests are clamped, not
    /// refused, so a client tuned for another server still works.
    pub max_lease_ms: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
            max_key_bytes: DEFAULT_MAX_KEY_BYTES,
            max_batch_keys: DEFAULT_MAX_BATCH_KEYS,
            max_lease_ms: DEFAULT_MAX_LEASE_MS,
        }
    }
}

impl Limits {
    /// The key bound actually enforced: a configured value above what the
    /// wire can carry would promise something the encoding cannot deliver.
    pub fn effective_max_key_bytes(&self) -> u32 {
        self.max_key_bytes.min(WIRE_MAX_KEY_BYTES)
    }

    /// The longest meta a legal request can have under these limits. A node
    /// reads a request's meta whole before decoding it, so this, not
    /// `max_frame_bytes`, bounds what one frame header can make it buffer
    /// (payload bytes go straight into blocks). The widest batch is a
    /// PUT_SHM of `max_batch_keys` keys of `max_key_bytes` each (u32 count;
    /// per entry a u16 key length, the key, u64 offset, u32 length, u32
    /// CRC); MATCH_PREFIX has four more leading bytes but narrower entries,
    /// and a HELLO with the longest token is the widest fixed-size request.
    pub fn max_request_meta_bytes(&self) -> u64 {
        let (keys, key) = (self.max_batch_keys as u64, self.effective_max_key_bytes() as u64);
        let put_shm = 4 + keys * (2 + key + 8 + 4 + 4);
        let match_prefix = 4 + 4 + keys * (2 + key);
        let hello = 2 + 8 + 2 + MAX_TOKEN_BYTES as u64;
        put_shm.max(match_prefix).max(hello)
    }

    /// Checks a request's header against these limits before any of its body
    /// is read: the frame within `max_frame_bytes` and its meta within
    /// [`Limits::max_request_meta_bytes`]. Either failure leaves the body
    /// unread, so the stream cannot be trusted after it (the connection is
    /// closed).
    pub fn check_request_header(&self, header: &crate::FrameHeader) -> Result<(), crate::ProtocolError> {
        if header.frame_len() > self.max_frame_bytes as u64 {
            return Err(crate::ProtocolError::FrameTooLarge { declared: header.frame_len(), limit: self.max_frame_bytes as u64 });
        }
        let meta_limit = self.max_request_meta_bytes();
        if header.meta_len as u64 > meta_limit {
            return Err(crate::ProtocolError::MetaTooLarge { declared: header.meta_len as u64, limit: meta_limit });
        }
        Ok(())
    }

    /// The tighter of two limit sets, for a client that must respect both its
    /// own bounds and those the server announced.
    pub fn min(&self, other: &Limits) -> Limits {
        Limits {
            max_frame_bytes: self.max_frame_bytes.min(other.max_frame_bytes),
            max_key_bytes: self.max_key_bytes.min(other.max_key_bytes),
            max_batch_keys: self.max_batch_keys.min(other.max_batch_keys),
            max_lease_ms: self.max_lease_ms.min(other.max_lease_ms),
        }
    }
}

/// Members a CLUSTER_TABLE_RESULT may list (owner indices travel as u16).
pub const MAX_CLUSTER_MEMBERS: usize = 4096;

/// Slots a CLUSTER_TABLE_RESULT may carry.
pub const MAX_CLUSTER_SLOTS: u32 = 65_536;

/// Owners per slot a CLUSTER_TABLE_RESULT may carry.
pub const MAX_CLUSTER_REPLICAS: u32 = 8;

/// Bytes of a member's id, endpoint or zone in a CLUSTER_TABLE_RESULT.
pub const MAX_CLUSTER_STRING_BYTES: usize = 255;

/// Longest wait a CLUSTER_TABLE request gets, whatever it asks for.
pub const MAX_CLUSTER_WAIT_MS: u32 = 60_000;
