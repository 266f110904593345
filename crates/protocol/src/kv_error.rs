//! The error vocabulary shared by the wire protocol, the cache and plugins.
//!
//! It mirrors the WIT `types.error` variant one to one, so an error raised by
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
        })
    }
}
