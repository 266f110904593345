//! Wire error codes and the typed errors of encoding and decoding.
//!
//! Codes 1–6 mirror [`KvError`] one to one so an error that crossed the wire
//! means the same to a retry policy as one raised locally; codes from 16 on
//! are about the protocol itself and always mean the sender is at fault.

use crate::kv_error::KvError;

/// A status or error on the wire (`u16`). `0` is success and has no variant:
/// per-key results use `Result<_, ErrorCode>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    NotFound,
    Timeout,
    Unavailable,
    Invalid,
    Capacity,
    Internal,
    Unsupported,
    Busy,
    Denied,
    Corrupt,
    BadMagic,
    BadVersion,
    FrameTooLarge,
    KeyTooLong,
    BadChecksum,
    UnknownOpcode,
    DuplicateKey,
    Unauthorized,
    TooManyKeys,
    Malformed,
    HandshakeRequired,
    /// A code this build does not know, kept verbatim so a newer peer's
    /// errors survive being relayed by an older node.
    Other(u16),
}

impl ErrorCode {
    /// The wire value.
    pub fn to_u16(self) -> u16 {
        match self {
            ErrorCode::NotFound => 1,
            ErrorCode::Timeout => 2,
            ErrorCode::Unavailable => 3,
            ErrorCode::Invalid => 4,
            ErrorCode::Capacity => 5,
            ErrorCode::Internal => 6,
            ErrorCode::Unsupported => 7,
            ErrorCode::Busy => 8,
            ErrorCode::Denied => 9,
            ErrorCode::Corrupt => 10,
            ErrorCode::BadMagic => 16,
            ErrorCode::BadVersion => 17,
            ErrorCode::FrameTooLarge => 18,
            ErrorCode::KeyTooLong => 19,
            ErrorCode::BadChecksum => 20,
            ErrorCode::UnknownOpcode => 21,
            ErrorCode::DuplicateKey => 22,
            ErrorCode::Unauthorized => 23,
            ErrorCode::TooManyKeys => 24,
            ErrorCode::Malformed => 25,
            ErrorCode::HandshakeRequired => 26,
            ErrorCode::Other(v) => v,
        }
    }

    /// Reads a non-zero wire value; `None` for `0`, which means success.
    pub fn from_u16(v: u16) -> Option<ErrorCode> {
        Some(match v {
            0 => return None,
            1 => ErrorCode::NotFound,
            2 => ErrorCode::Timeout,
            3 => ErrorCode::Unavailable,
            4 => ErrorCode::Invalid,
            5 => ErrorCode::Capacity,
            6 => ErrorCode::Internal,
            7 => ErrorCode::Unsupported,
            8 => ErrorCode::Busy,
            9 => ErrorCode::Denied,
            10 => ErrorCode::Corrupt,
            16 => ErrorCode::BadMagic,
            17 => ErrorCode::BadVersion,
            18 => ErrorCode::FrameTooLarge,
            19 => ErrorCode::KeyTooLong,
            20 => ErrorCode::BadChecksum,
            21 => ErrorCode::UnknownOpcode,
            22 => ErrorCode::DuplicateKey,
            23 => ErrorCode::Unauthorized,
            24 => ErrorCode::TooManyKeys,
            25 => ErrorCode::Malformed,
            26 => ErrorCode::HandshakeRequired,
            other => ErrorCode::Other(other),
        })
    }

    /// Stable lowercase name, as used in docs/protocol.md and log lines.
    pub fn name(self) -> &'static str {
        match self {
            ErrorCode::NotFound => "not-found",
            ErrorCode::Timeout => "timeout",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::Invalid => "invalid",
            ErrorCode::Capacity => "capacity",
            ErrorCode::Internal => "internal",
            ErrorCode::Unsupported => "unsupported",
            ErrorCode::Busy => "busy",
            ErrorCode::Denied => "denied",
            ErrorCode::Corrupt => "corrupt",
            ErrorCode::BadMagic => "bad-magic",
            ErrorCode::BadVersion => "bad-version",
            ErrorCode::FrameTooLarge => "frame-too-large",
            ErrorCode::KeyTooLong => "key-too-long",
            ErrorCode::BadChecksum => "bad-checksum",
            ErrorCode::UnknownOpcode => "unknown-opcode",
            ErrorCode::DuplicateKey => "duplicate-key",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::TooManyKeys => "too-many-keys",
            ErrorCode::Malformed => "malformed",
            ErrorCode::HandshakeRequired => "handshake-required",
            ErrorCode::Other(_) => "other",
        }
    }

    /// The local error a client raises for this code. Protocol codes fold
    /// into the [`KvError`] variant a retry policy should see: a frame or key
    /// over a limit is `capacity`-like only for frames; everything the sender
    /// got wrong is `invalid` (never worth a retry).
    pub fn into_kv_error(self, message: impl Into<String>) -> KvError {
        let message = message.into();
        let detail = if message.is_empty() { self.to_string() } else { format!("{self}: {message}") };
        match self {
            ErrorCode::NotFound => KvError::NotFound,
            ErrorCode::Timeout => KvError::Timeout(message),
            ErrorCode::Unavailable => KvError::Unavailable(message),
            ErrorCode::Invalid => KvError::Invalid(message),
            ErrorCode::Capacity => KvError::Capacity(message),
            ErrorCode::Internal => KvError::Internal(message),
            ErrorCode::Unsupported => KvError::Unsupported(message),
            ErrorCode::Busy => {
                // `retry-after-ms=N rest`: the form `Response::from_kv_error` writes.
                let parsed = message.strip_prefix("retry-after-ms=").and_then(|rest| {
                    let (n, rest) = rest.split_once(' ').unwrap_or((rest, ""));
                    Some((n.parse().ok()?, rest.to_owned()))
                });
                match parsed {
                    Some((retry_after_ms, message)) => KvError::Busy { retry_after_ms, message },
                    None => KvError::Busy { retry_after_ms: 0, message },
                }
            }
            ErrorCode::Denied => KvError::Denied(message),
            ErrorCode::Corrupt => KvError::Corrupt(message),
            ErrorCode::FrameTooLarge | ErrorCode::TooManyKeys => KvError::Capacity(detail),
            // A checksum mismatch is corruption in flight: another attempt
            // may well succeed, so it must not look like a caller bug.
            ErrorCode::BadChecksum => KvError::Unavailable(detail),
            ErrorCode::Other(_) => KvError::Internal(detail),
            _ => KvError::Invalid(detail),
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ErrorCode::Other(v) => write!(f, "error code {v}"),
            other => f.write_str(other.name()),
        }
    }
}

impl From<&KvError> for ErrorCode {
    fn from(e: &KvError) -> Self {
        match e {
            KvError::NotFound => ErrorCode::NotFound,
            KvError::Timeout(_) => ErrorCode::Timeout,
            KvError::Unavailable(_) => ErrorCode::Unavailable,
            KvError::Invalid(_) => ErrorCode::Invalid,
            KvError::Capacity(_) => ErrorCode::Capacity,
            KvError::Internal(_) => ErrorCode::Internal,
            KvError::Unsupported(_) => ErrorCode::Unsupported,
            KvError::Busy { .. } => ErrorCode::Busy,
            KvError::Denied(_) => ErrorCode::Denied,
            KvError::Corrupt(_) => ErrorCode::Corrupt,
        }
    }
}

/// Why bytes could not be read as (or a value could not be written as) a
/// frame. Each variant names the field at fault so the message sent back in
/// an `Error` frame tells the peer exactly what to fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error("bad magic {found:02x?}: not a kvplane frame (expected \"KVPL\")")]
    BadMagic { found: [u8; 4] },
    #[error("unsupported protocol version {found} (this build speaks {min}..={max})")]
    BadVersion { found: u16, min: u16, max: u16 },
    #[error("frame of {declared} bytes exceeds the limit of {limit} bytes")]
    FrameTooLarge { declared: u64, limit: u64 },
    #[error("meta of {declared} bytes exceeds the {limit} bytes the longest legal request needs under this node's limits")]
    MetaTooLarge { declared: u64, limit: u64 },
    #[error("key #{index} is {len} bytes, over the limit of {limit}")]
    KeyTooLong { index: usize, len: usize, limit: usize },
    #[error("key #{index} is empty")]
    EmptyKey { index: usize },
    #[error("batch of {count} keys exceeds the limit of {limit}")]
    TooManyKeys { count: u64, limit: u64 },
    #[error("checksum mismatch on block #{index}: header says {expected:#010x}, payload hashes to {actual:#010x}")]
    BadChecksum { index: usize, expected: u32, actual: u32 },
    #[error("unknown opcode {opcode:#04x}")]
    UnknownOpcode { opcode: u8 },
    #[error("key #{index} repeats key #{first} in the same batch")]
    DuplicateKey { index: usize, first: usize },
    #[error("malformed {field}: {reason}")]
    Malformed { field: &'static str, reason: String },
}

impl ProtocolError {
    /// The code sent back in an `Error` frame.
    pub fn code(&self) -> ErrorCode {
        match self {
            ProtocolError::BadMagic { .. } => ErrorCode::BadMagic,
            ProtocolError::BadVersion { .. } => ErrorCode::BadVersion,
            ProtocolError::FrameTooLarge { .. } | ProtocolError::MetaTooLarge { .. } => ErrorCode::FrameTooLarge,
            ProtocolError::KeyTooLong { .. } => ErrorCode::KeyTooLong,
            ProtocolError::EmptyKey { .. } => ErrorCode::Invalid,
            ProtocolError::TooManyKeys { .. } => ErrorCode::TooManyKeys,
            ProtocolError::BadChecksum { .. } => ErrorCode::BadChecksum,
            ProtocolError::UnknownOpcode { .. } => ErrorCode::UnknownOpcode,
            ProtocolError::DuplicateKey { .. } => ErrorCode::DuplicateKey,
            ProtocolError::Malformed { .. } => ErrorCode::Malformed,
        }
    }

    pub(crate) fn malformed(field: &'static str, reason: impl Into<String>) -> Self {
        ProtocolError::Malformed { field, reason: reason.into() }
    }
}

/// A decoding failure together with what is known about the frame it hit.
///
/// The request id lets a server answer the offending request with an `Error`
/// frame instead of dropping the connection; `fatal` says whether the byte
/// stream can still be trusted afterwards.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{error}")]
pub struct DecodeError {
    pub error: ProtocolError,
    /// Set once the header was read; the id the answer should carry.
    pub request_id: Option<u64>,
    /// True when the header itself was bad (magic, version, declared length):
    /// the frame boundary is unknown or the frame was not buffered, so the
    /// only safe continuation is to send an error and close. False when the
    /// whole frame was consumed from the buffer and the next one can follow.
    pub fatal: bool,
}

impl DecodeError {
    pub fn code(&self) -> ErrorCode {
        self.error.code()
    }
}
