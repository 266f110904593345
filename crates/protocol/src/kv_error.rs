//! The error vocabulary shared by the wire protocol, the cache and plugins.
//!
//! It mirrors the WIT `types.error` variant (kvplane:plugin@0.2.0) one to one, so an error raised by
//! a backend plugin, a peer node or the host itself means the same thing to a
//! retry policy.

use std::fmt;

/// Why a key-value operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    /// The key does not exist. Never worth a retry.
    #[error("not found")]
    NotFound,
    /// The operation ran out of time.
    #[error("timeout: {0}")]
    Timeout(String),
    /// A peer or backend could not be reached.
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// The request was malformed or not permitted. Never worth a retry.
    #[error("invalid: {0}")]
    Invalid(String),
    /// A size or memory limit was hit.
    #[error("capacity: {0}")]
    Capacity(String),
    /// A bug or unexpected state.
    #[error("internal: {0}")]
    Internal(String),
    /// The store cannot do this at all. Never worth a retry.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// Overloaded: try again after `retry_after_ms` (0: unknown).
    #[error("busy (retry after {retry_after_ms} ms): {message}")]
    Busy { retry_after_ms: u64, message: String },
    /// Not permitted by a declaration or the store. Never worth a retry.
    #[error("denied: {0}")]
    Denied(String),
    /// What a store answered failed its check: bytes changed in the store,
    /// a length the store claimed but did not write, or a value stored
    /// under another key. Never served, never cached.
    #[error("corrupt: {0}")]
    Corrupt(String),
}

impl KvError {
    /// Short stable name, used in metrics labels and conformance output.
    pub fn kind(&self) -> ErrorKind {
        match self {
            KvError::NotFound => ErrorKind::NotFound,
            KvError::Timeout(_) => ErrorKind::Timeout,
            KvError::Unavailable(_) => ErrorKind::Unavailable,
            KvError::Invalid(_) => ErrorKind::Invalid,
            KvError::Capacity(_) => ErrorKind::Capacity,
            KvError::Internal(_) => ErrorKind::Internal,
            KvError::Unsupported(_) => ErrorKind::Unsupported,
            KvError::Busy { .. } => ErrorKind::Busy,
            KvError::Denied(_) => ErrorKind::Denied,
            KvError::Corrupt(_) => ErrorKind::Corrupt,
        }
    }
}

/// The variant of a [`KvError`] without its message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
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
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ErrorKind::NotFound => "not-found",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Invalid => "invalid",
            ErrorKind::Capacity => "capacity",
            ErrorKind::Internal => "internal",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::Busy => "busy",
            ErrorKind::Denied => "denied",
            ErrorKind::Corrupt => "corrupt",
        })
    }
}
