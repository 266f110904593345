//! The error vocabulary shared by the wire protocol, the cache and plugins.
//!
//! It lives in the protocol crate so an error raised by a backend plugin, a
//! peer node or the host itself crosses the wire unchanged; the host re-exports
//! it under its historical path.

pub use kvplane_protocol::{ErrorKind, KvError};
