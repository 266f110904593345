//! The kvplane wire protocol, sans IO.
//!
//! Everything here turns bytes into typed frames and back; nothing reads a
//! socket. The node's server and the client crate drive it from tokio, the
//! fuzz target drives it from arbitrary bytes, and both ends share one
//! definition of every limit and error code. `docs/protocol.md` is the prose
//! version of this crate.
//!
//! A frame is a fixed [`FrameHeader`], then *meta* (counts, keys, lengths,
//! checksums), then the block *payloads* back to back. Keeping payloads out
//! of the meta is what lets a reader learn every block's size from one small
//! read and then move the bytes straight into block memory (server, PUT) or
//! one receive buffer (client, GET), and lets a writer send header, meta and
//! payloads in one vectored write without copying a block.

mod codec;
mod error;
mod frame;
mod kv_error;
mod limits;
mod message;
pub mod rdma;

#[cfg(feature = "io")]
pub mod io;

pub use codec::{decode, decode_body, encode, EncodedFrame, Meta, PayloadSlot};
pub use error::{DecodeError, ErrorCode, ProtocolError};
pub use frame::{Features, FrameHeader, Opcode, HEADER_LEN, MAGIC, MIN_VERSION, VERSION};
pub use kv_error::{ErrorKind, KvError};
pub use limits::*;
pub use message::{
    checksum, Block, Checksum, Frame, Hello, HelloAck, Message, PutEntry, Request, Response, ShmBlock, ShmGet, ShmPut, StatEntry,
};
