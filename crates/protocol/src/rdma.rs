//! The wire forms of what `RDMA_DESCRIBE` and `RDMA_CONNECT` carry: the
//! [`Descriptor`] of one pinned block a remote reader may READ, and the
//! queue pair [`QueuePairEndpoint`] two ends exchange to connect.
//!
//! They live here rather than in kvplane-rdma so that the protocol is the
//! floor: the codec and its fuzz targets build with no RDMA code at all,
//! and kvplane-rdma (leases, the path choice, and with its
//! `rdma` feature the ibverbs side) depends on this crate, not the reverse.
//! Both forms are fixed-size and big-endian, unlike the little-endian meta
//! around them, and each checks itself (magic, field widths; the
//! descriptor also its version and a CRC-32C); the codec reports a refusal
//! as a malformed field of the frame.

pub mod descriptor;
pub mod endpoint;

pub use descriptor::{DecodeError, Descriptor, Gid, UseError};
pub use endpoint::{QueuePairEndpoint, ENDPOINT_LEN};
