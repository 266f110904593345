//! An async client for kvplane nodes.
//!
//! One [`Client`] holds a small pool of connections to one node; every call
//! picks a connection, and many calls may be in flight on one connection at
//! once (pipelining: requests carry ids, answers are matched by id). Batches
//! larger than the node's announced limits are split transparently.
//!
//! ```no_run
//! # async fn demo() -> Result<(), kvplane_client::KvError> {
//! use bytes::Bytes;
//! let client = kvplane_client::Client::connect(kvplane_client::ClientConfig::new("127.0.0.1:9600".parse()?)).await?;
//! client.put(vec![(Bytes::from("block-0"), Bytes::from(vec![0u8; 65536]))]).await?;
//! let blocks = client.get(vec![Bytes::from("block-0")]).await?;
//! # Ok(()) }
//! ```

mod answer_buffers;
mod client;
mod cluster;
mod connection;
mod endpoint;
#[allow(unsafe_code)] // the reader task writes into memory the caller lent; see the module docs.
mod into;
mod key_error;
// Without the feature no connection ever has a reader, so the READ path is
// unused outside its tests.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
mod rdma;
#[allow(unsafe_code)] // recvmsg and mmap of the node's memfd; see the module docs.
mod shm;
mod tls;
mod transport;

pub use answer_buffers::{AnswerBufferStats, DEFAULT_POOL_BYTES as DEFAULT_ANSWER_BUFFER_POOL_BYTES, MIN_POOLED_BYTES};
pub use client::{Client, ClientConfig, PrefixMatch};
pub use cluster::{BackgroundWrites, ClusterClient, ClusterClientConfig, DEFAULT_MAX_BACKGROUND_BYTES};
pub use connection::Connection;
pub use endpoint::Endpoint;
pub use kvplane_protocol::{ErrorKind, KvError, Limits};
pub use shm::SharedMemory;
pub use tls::ClientTls;
pub use transport::{BoxedFuture, Halves, Transport};
