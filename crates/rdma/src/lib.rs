//! One-sided RDMA READ of blocks that a kvplane node keeps pinned.
//!
//! Why: a GET over TCP costs the node a copy and a system call per block
//! and the client another; with RDMA the client's NIC reads the block
//! straight out of the node's pool while the node's CPU does nothing. The
//! price is that the node must announce, beforehand and over the ordinary
//! connection, everything the reader's NIC needs, and must keep the block
//! in place while the reader may still use that announcement.
//!
//! What is here:
//! - [`Leases`]: the node's table of leases that keep blocks pinned until
//!   they expire, bounded.
//! - [`choose`] and [`get`]: the client's choice between RDMA and TCP, and
//!   the fallback to TCP whenever RDMA cannot serve a GET.
//! - With the `rdma` feature, [`verbs`]: the ibverbs side (open a device,
//!   register the pool as a memory region, describe a sub-range, READ it
//!   from another queue pair), and a TCP side channel that connects two
//!   queue pairs.
//!
//! What is not: the two wire forms every peer shares, [`Descriptor`] (what
//! a remote reader needs for one block: GID/LID and queue pair of the node,
//! address, rkey, length, CRC-32C, lease and its expiry) and [`QueuePairEndpoint`]
//! (what a queue pair needs to connect to its peer's). `RDMA_DESCRIBE` and
//! `RDMA_CONNECT` carry them, so they live in kvplane-protocol
//! ([`kvplane_protocol::rdma`]), which builds without any of this; this
//! crate depends on it and re-exports them.
//!
//! All of it but [`verbs`] builds and is tested everywhere; nothing here
//! reads a clock: times are milliseconds on a clock the caller passes.

pub mod lease;
pub mod transport;
// Unsafe code only here (FFI to libibverbs), and only with the feature.
#[cfg(feature = "rdma")]
#[allow(unsafe_code)]
pub mod verbs;

pub use kvplane_protocol::rdma::{DecodeError, Descriptor, Gid, QueuePairEndpoint, UseError, ENDPOINT_LEN};
pub use lease::{Lease, LeaseError, LeaseId, Leases};
pub use transport::{choose, get, Fallback, Fetched, Path};
