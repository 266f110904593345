//! The fixed 24-byte frame header.
//!
//! Fixed size and little-endian so a reader needs exactly one small read to
//! learn how much follows, and so the header plus per-key metadata of a frame
//! can be written together with its payloads in one vectored write.

use super::error::ProtocolError;

/// First four bytes of every frame. A peer speaking something else (HTTP, a
/// port scanner, RESP) is recognised on its first bytes.
pub const MAGIC: [u8; 4] = *b"KVPL";
/// The protocol version this build speaks. `Hello`/`HelloAck` always travel
/// with version 1 in their header, so peers of any versions can negotiate.
pub const VERSION: u16 = 1;
/// Oldest version this build still accepts.
pub const MIN_VERSION: u16 = 1;
/// Size of the header in bytes.
pub const HEADER_LEN: usize = 24;

/// What a frame carries. Requests are `0x01..=0x7f`; a response opcode is its
/// request's opcode with the high bit set, and `0xff` is an error answer to
/// any request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    Hello = 0x01,
    Put = 0x02,
    Get = 0x03,
    Exists = 0x04,
    Delete = 0x05,
    MatchPrefix = 0x06,
    Stats = 0x07,
    Ping = 0x08,
    ClusterTable = 0x09,
    ShmAttach = 0x0a,
    PutShm = 0x0b,
    GetShm = 0x0c,
    RdmaDescribe = 0x0d,
    RdmaConnect = 0x0e,
    HelloAck = 0x81,
    PutResult = 0x82,
    GetResult = 0x83,
    ExistsResult = 0x84,
    DeleteResult = 0x85,
    MatchPrefixResult = 0x86,
    StatsResult = 0x87,
    Pong = 0x88,
    ClusterTableResult = 0x89,
    ShmAttachResult = 0x8a,
    PutShmResult = 0x8b,
    GetShmResult = 0x8c,
    RdmaDescribeResult = 0x8d,
    RdmaConnectResult = 0x8e,
    Error = 0xff,
}

impl Opcode {
    pub fn from_u8(v: u8) -> Option<Opcode> {
        Some(match v {
            0x01 => Opcode::Hello,
            0x02 => Opcode::Put,
            0x03 => Opcode::Get,
            0x04 => Opcode::Exists,
            0x05 => Opcode::Delete,
            0x06 => Opcode::MatchPrefix,
            0x07 => Opcode::Stats,
            0x08 => Opcode::Ping,
            0x09 => Opcode::ClusterTable,
            0x0a => Opcode::ShmAttach,
            0x0b => Opcode::PutShm,
            0x0c => Opcode::GetShm,
            0x0d => Opcode::RdmaDescribe,
            0x0e => Opcode::RdmaConnect,
            0x81 => Opcode::HelloAck,
            0x82 => Opcode::PutResult,
            0x83 => Opcode::GetResult,
            0x84 => Opcode::ExistsResult,
            0x85 => Opcode::DeleteResult,
            0x86 => Opcode::MatchPrefixResult,
            0x87 => Opcode::StatsResult,
            0x88 => Opcode::Pong,
            0x89 => Opcode::ClusterTableResult,
            0x8a => Opcode::ShmAttachResult,
            0x8b => Opcode::PutShmResult,
            0x8c => Opcode::GetShmResult,
            0x8d => Opcode::RdmaDescribeResult,
            0x8e => Opcode::RdmaConnectResult,
            0xff => Opcode::Error,
            _ => return None,
        })
    }

    pub fn is_request(self) -> bool {
        (self as u8) & 0x80 == 0
    }
}

/// Feature bits exchanged in the handshake. The agreed set is the
/// intersection of what both sides offer; bits a side does not know are
/// ignored, which is what lets a newer client talk to an older node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Features(pub u64);

impl Features {
    /// MATCH_PREFIX may pin the matched blocks for a short lease.
    pub const PIN_LEASE: Features = Features(1 << 0);
    /// The client accepts responses in a different order than its requests
    /// (matched by request id). Without it a server answers in order.
    pub const OUT_OF_ORDER: Features = Features(1 << 1);
    /// Everything this build implements on any connection.
    pub const ALL: Features = Features(Self::PIN_LEASE.0 | Self::OUT_OF_ORDER.0);
    /// Block bytes may move through memory the node shares with the client
    /// (`SHM_ATTACH`, `PUT_SHM`, `GET_SHM`): Unix-socket connections only,
    /// since the memory is handed over as a file descriptor.
    pub const SHARED_MEMORY: Features = Features(1 << 2);
    /// Block bytes may be read with one-sided RDMA READs of the node's pool
    /// (`RDMA_CONNECT`, `RDMA_DESCRIBE`): offered by a client with an RDMA
    /// device and by a node that registered its pool with one (both built
    /// with the `rdma` feature); never part of [`Features::ALL`].
    pub const RDMA: Features = Features(1 << 3);

    pub fn contains(self, other: Features) -> bool {
        self.0 & other.0 == other.0
    }

    pub fn intersect(self, other: Features) -> Features {
        Features(self.0 & other.0)
    }
}

impl std::ops::BitOr for Features {
    type Output = Features;
    fn bitor(self, rhs: Features) -> Features {
        Features(self.0 | rhs.0)
    }
}

/// The parsed header.
///
/// | offset | size | field |
/// |---|---|---|
/// | 0 | 4 | magic `KVPL` |
/// | 4 | 2 | version (u16) |
/// | 6 | 1 | opcode |
/// | 7 | 1 | flags (0, except the write quorum of a CLUSTER_TABLE_RESULT) |
/// | 8 | 8 | request id (u64) |
/// | 16 | 4 | body length (u32): bytes after the header |
/// | 20 | 4 | meta length (u32): leading bytes of the body before the payloads |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub version: u16,
    /// Raw opcode byte; checked against [`Opcode`] only once the whole frame
    /// is buffered, so an unknown opcode costs the frame, not the connection.
    pub opcode: u8,
    pub flags: u8,
    pub request_id: u64,
    pub body_len: u32,
    pub meta_len: u32,
}

impl FrameHeader {
    /// Size of the whole frame.
    pub fn frame_len(&self) -> u64 {
        HEADER_LEN as u64 + self.body_len as u64
    }

    /// Bytes of payload after the metadata: what a server could read straight
    /// into block memory instead of a receive buffer.
    pub fn payload_len(&self) -> u32 {
        self.body_len.saturating_sub(self.meta_len)
    }

    pub fn write(&self, out: &mut [u8; HEADER_LEN]) {
        out[0..4].copy_from_slice(&MAGIC);
        out[4..6].copy_from_slice(&self.version.to_le_bytes());
        out[6] = self.opcode;
        out[7] = self.flags;
        out[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        out[16..20].copy_from_slice(&self.body_len.to_le_bytes());
        out[20..24].copy_from_slice(&self.meta_len.to_le_bytes());
    }

    /// Parses and checks the fields that do not need the body: magic, version
    /// and the meta length against the body length. Limits are the codec's
    /// business, not the header's.
    pub fn parse(b: &[u8; HEADER_LEN]) -> Result<FrameHeader, ProtocolError> {
        let magic = [b[0], b[1], b[2], b[3]];
        if magic != MAGIC {
            return Err(ProtocolError::BadMagic { found: magic });
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if !(MIN_VERSION..=VERSION).contains(&version) {
            return Err(ProtocolError::BadVersion { found: version, min: MIN_VERSION, max: VERSION });
        }
        let h = FrameHeader {
            version,
            opcode: b[6],
            flags: b[7],
            request_id: u64::from_le_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]]),
            body_len: u32::from_le_bytes([b[16], b[17], b[18], b[19]]),
            meta_len: u32::from_le_bytes([b[20], b[21], b[22], b[23]]),
        };
        if h.meta_len > h.body_len {
            return Err(ProtocolError::malformed("header.meta_len", format!("{} exceeds body length {}", h.meta_len, h.body_len)));
        }
        Ok(h)
    }
}
