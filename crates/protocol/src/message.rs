//! The typed messages a frame carries.
//!
//! Keys and payloads are `Bytes`: on decode they are slices of the receive
//! buffer (no copy), on encode they go to the writer as separate segments (no
//! copy either). A payload slice keeps its whole receive buffer alive, so
//! anything stored for long must be copied into block memory first.

use bytes::Bytes;
use kvplane_slots::SlotTable;

use super::error::ErrorCode;
use super::frame::{Features, Opcode};
use super::limits::Limits;
use super::rdma::{Descriptor, QueuePairEndpoint};

/// A block payload with its CRC-32C (Castagnoli).
///
/// The checksum travels with the payload so a server can verify a PUT once,
/// store the checksum beside the block and send it back on GET without
/// hashing the block again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    pub data: Bytes,
    pub crc: u32,
}

impl Block {
    /// A block whose checksum is computed now.
    pub fn new(data: Bytes) -> Block {
        let crc = checksum(&data);
        Block { data, crc }
    }

    /// A block whose checksum is already known (stored next to the block).
    /// The caller vouches for it; the receiving end will check it anyway.
    pub fn with_crc(data: Bytes, crc: u32) -> Block {
        Block { data, crc }
    }

    /// Whether the payload still hashes to its checksum.
    pub fn verify(&self) -> bool {
        checksum(&self.data) == self.crc
    }
}

/// CRC-32C of a payload, on whichever of two crates is faster on this CPU
/// ([`Crc::for_this_cpu`]), so it costs a small fraction of copying the
/// same bytes. Every block crosses it twice on a PUT (the client computes,
/// the node verifies), once on a GET.
pub fn checksum(data: &[u8]) -> u32 {
    Crc::for_this_cpu().checksum(data)
}

/// The two CRC-32C implementations (the same function: a test holds them
/// to each other at every size and split).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Crc {
    /// crc-fast's carry-less-multiply folding: 26-58 GB/s on one core of a
    /// VAES/AVX-512 machine from 4 KiB to 256 KiB, against the `crc32c`
    /// crate's 11-25 GB/s. Without AVX-512 it falls back to SSE code.
    Folding,
    /// The `crc32c` crate's SSE 4.2 loop: on an AMD EPYC with AVX2 and no
    /// AVX-512, 12-20 GB/s from 4 KiB to 1 MiB against crc-fast's 9-15.
    Sse42,
}

impl Crc {
    /// [`Crc::Folding`] where crc-fast's AVX-512 code runs (AVX-512 VL and
    /// VPCLMULQDQ), and off x86-64; [`Crc::Sse42`] elsewhere.
    pub(crate) fn for_this_cpu() -> Crc {
        #[cfg(target_arch = "x86_64")]
        if !(std::arch::is_x86_feature_detected!("avx512vl") && std::arch::is_x86_feature_detected!("vpclmulqdq")) {
            return Crc::Sse42;
        }
        Crc::Folding
    }

    pub(crate) fn checksum(self, data: &[u8]) -> u32 {
        match self {
            Crc::Folding => crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, data) as u32,
            Crc::Sse42 => crc32c::crc32c(data),
        }
    }
}

/// [`checksum`] of a block that arrives piece by piece: `update` each piece
/// as it lands (while it is still in cache), then `finish`.
#[derive(Clone)]
pub struct Checksum(Digest);

// The folding digest is the larger by far; it stays inline, as it was
// before there were two: a box would be an allocation per block read.
#[allow(clippy::large_enum_variant)]
#[derive(Clone)]
enum Digest {
    Folding(crc_fast::Digest),
    /// The CRC of the pieces so far.
    Sse42(u32),
}

impl Checksum {
    pub fn new() -> Checksum {
        Checksum::on(Crc::for_this_cpu())
    }

    pub(crate) fn on(crc: Crc) -> Checksum {
        Checksum(match crc {
            Crc::Folding => Digest::Folding(crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi)),
            Crc::Sse42 => Digest::Sse42(0),
        })
    }

    pub fn update(&mut self, piece: &[u8]) {
        match &mut self.0 {
            Digest::Folding(d) => d.update(piece),
            Digest::Sse42(crc) => *crc = crc32c::crc32c_append(*crc, piece),
        }
    }

    pub fn finish(&self) -> u32 {
        match &self.0 {
            Digest::Folding(d) => d.finalize() as u32,
            Digest::Sse42(crc) => *crc,
        }
    }
}

impl Default for Checksum {
    fn default() -> Self {
        Checksum::new()
    }
}

/// One key and its payload in a PUT.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutEntry {
    pub key: Bytes,
    pub block: Block,
}

/// The first frame a client sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// Highest protocol version the client speaks.
    pub version: u16,
    /// Features the client can use.
    pub features: Features,
    /// Bearer token, if the client has one; a node started with a token file
    /// refuses the connection without it.
    pub token: Option<String>,
}

/// The server's answer to a [`Hello`] it accepts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HelloAck {
    /// Version both sides will speak: the lower of the two highest versions.
    pub version: u16,
    /// Intersection of the client's and the server's features.
    pub features: Features,
    /// What the server accepts, so the client can split batches up front.
    pub limits: Limits,
}

/// One named counter in a STATS answer. Named rather than positional so a
/// newer node can add counters without a version bump.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatEntry {
    pub name: String,
    pub value: u64,
}

/// One block of a PUT_SHM: its bytes are at `offset..offset + len` of the
/// connection's shared memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmPut {
    pub key: Bytes,
    pub offset: u64,
    pub len: u32,
    pub crc: u32,
}

/// One key of a GET_SHM: its block is to be written at `offset` of the
/// connection's shared memory, if it fits in `capacity` bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmGet {
    pub key: Bytes,
    pub offset: u64,
    pub capacity: u32,
}

/// Where a GET_SHM put one block: `len` bytes at the requested offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShmBlock {
    pub len: u32,
    pub crc: u32,
}

/// What a client asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Hello(Hello),
    /// Store blocks; answered per key.
    Put {
        entries: Vec<PutEntry>,
    },
    /// Fetch blocks; answered per key with a payload or a status.
    Get {
        keys: Vec<Bytes>,
    },
    /// Ask which keys are present; answered per key (ok / not-found).
    Exists {
        keys: Vec<Bytes>,
    },
    /// Remove keys; answered per key (ok / not-found).
    Delete {
        keys: Vec<Bytes>,
    },
    /// Given a prompt's chain of block keys in order, how many leading blocks
    /// are present. `lease_ms > 0` asks the server to pin the matched blocks
    /// that long, so the GET that follows is not beaten by eviction.
    MatchPrefix {
        keys: Vec<Bytes>,
        lease_ms: u32,
    },
    Stats,
    Ping,
    /// The cluster's membership and slot table. Answered at once when the
    /// node's table is newer than `after_version`, else when it changes or
    /// `wait_ms` (capped by the node) passes, with whatever is current then:
    /// a client keeps one of these outstanding on a connection of its own
    /// and so hears of every change without polling.
    ClusterTable {
        after_version: u64,
        wait_ms: u32,
    },
    /// Asks for the connection's shared memory (Unix sockets, feature
    /// `SHARED_MEMORY`): answered with its size and, as ancillary data on
    /// the same message, its file descriptor.
    ShmAttach,
    /// Stores blocks whose bytes are in the shared memory; answered per key.
    PutShm {
        entries: Vec<ShmPut>,
    },
    /// Writes blocks into the shared memory; answered per key with length
    /// and checksum, or a status.
    GetShm {
        entries: Vec<ShmGet>,
    },
    /// Asks for what a one-sided RDMA READ of each key's block needs (feature
    /// `RDMA`, after RDMA_CONNECT): answered per key with a descriptor whose
    /// lease pins the block for `lease_ms` (clamped by the node), or a status.
    RdmaDescribe {
        keys: Vec<Bytes>,
        lease_ms: u32,
    },
    /// Connects the client's queue pair (`endpoint`) to one the node makes
    /// for this connection; answered with the node's endpoint.
    RdmaConnect {
        endpoint: QueuePairEndpoint,
    },
}

/// What a server answers. Per-key results are in request order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Response {
    HelloAck(HelloAck),
    Put {
        results: Vec<Result<(), ErrorCode>>,
    },
    Get {
        results: Vec<Result<Block, ErrorCode>>,
    },
    Exists {
        results: Vec<Result<(), ErrorCode>>,
    },
    Delete {
        results: Vec<Result<(), ErrorCode>>,
    },
    /// `matched` leading keys are present; `lease_ms` is the pin actually
    /// granted (0 when none was asked for or the feature is off; clamped to
    /// the server's `max_lease_ms`).
    MatchPrefix {
        matched: u32,
        lease_ms: u32,
    },
    Stats {
        entries: Vec<StatEntry>,
    },
    Pong,
    /// The membership and the owners of every slot, with their version.
    ClusterTable(Box<SlotTable>),
    /// The shared memory's size in bytes (its descriptor travels beside).
    ShmAttach {
        size: u64,
    },
    PutShm {
        results: Vec<Result<(), ErrorCode>>,
    },
    GetShm {
        results: Vec<Result<ShmBlock, ErrorCode>>,
    },
    RdmaDescribe {
        results: Vec<Result<Descriptor, ErrorCode>>,
    },
    /// The node's queue pair for this connection, now connected to the
    /// client's.
    RdmaConnect {
        endpoint: QueuePairEndpoint,
    },
    /// The request as a whole failed (or, with request id 0 and no request to
    /// blame, the connection is about to close).
    Error {
        code: ErrorCode,
        message: String,
    },
}

impl Response {
    /// An error answer for a local [`crate::KvError`].
    pub fn from_kv_error(e: &crate::KvError) -> Response {
        let message = match e {
            crate::KvError::NotFound => String::new(),
            crate::KvError::Timeout(m)
            | crate::KvError::Unavailable(m)
            | crate::KvError::Invalid(m)
            | crate::KvError::Capacity(m)
            | crate::KvError::Internal(m)
            | crate::KvError::Unsupported(m)
            | crate::KvError::Denied(m)
            | crate::KvError::Corrupt(m) => m.clone(),
            // The back-off travels at the front of the message (see
            // `ErrorCode::into_kv_error`).
            crate::KvError::Busy { retry_after_ms, message } => format!("retry-after-ms={retry_after_ms} {message}"),
        };
        Response::Error { code: ErrorCode::from(e), message }
    }
}

/// Either side of the conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Request(Request),
    Response(Response),
}

impl Message {
    pub fn opcode(&self) -> Opcode {
        match self {
            Message::Request(r) => match r {
                Request::Hello(_) => Opcode::Hello,
                Request::Put { .. } => Opcode::Put,
                Request::Get { .. } => Opcode::Get,
                Request::Exists { .. } => Opcode::Exists,
                Request::Delete { .. } => Opcode::Delete,
                Request::MatchPrefix { .. } => Opcode::MatchPrefix,
                Request::Stats => Opcode::Stats,
                Request::Ping => Opcode::Ping,
                Request::ClusterTable { .. } => Opcode::ClusterTable,
                Request::ShmAttach => Opcode::ShmAttach,
                Request::PutShm { .. } => Opcode::PutShm,
                Request::GetShm { .. } => Opcode::GetShm,
                Request::RdmaDescribe { .. } => Opcode::RdmaDescribe,
                Request::RdmaConnect { .. } => Opcode::RdmaConnect,
            },
            Message::Response(r) => match r {
                Response::HelloAck(_) => Opcode::HelloAck,
                Response::Put { .. } => Opcode::PutResult,
                Response::Get { .. } => Opcode::GetResult,
                Response::Exists { .. } => Opcode::ExistsResult,
                Response::Delete { .. } => Opcode::DeleteResult,
                Response::MatchPrefix { .. } => Opcode::MatchPrefixResult,
                Response::Stats { .. } => Opcode::StatsResult,
                Response::Pong => Opcode::Pong,
                Response::ClusterTable(_) => Opcode::ClusterTableResult,
                Response::ShmAttach { .. } => Opcode::ShmAttachResult,
                Response::PutShm { .. } => Opcode::PutShmResult,
                Response::GetShm { .. } => Opcode::GetShmResult,
                Response::RdmaDescribe { .. } => Opcode::RdmaDescribeResult,
                Response::RdmaConnect { .. } => Opcode::RdmaConnectResult,
                Response::Error { .. } => Opcode::Error,
            },
        }
    }
}

/// A message and the request id that ties a response to its request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub request_id: u64,
    pub message: Message,
}

impl Frame {
    pub fn request(request_id: u64, request: Request) -> Frame {
        Frame { request_id, message: Message::Request(request) }
    }

    pub fn response(request_id: u64, response: Response) -> Frame {
        Frame { request_id, message: Message::Response(response) }
    }
}
