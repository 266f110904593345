//! The kvplane cache node: the memory tier ([`memory`], a slab pool of
//! preallocated blocks), the block cache over it ([`cache`], sharded index,
//! S3-FIFO or LRU eviction, pin leases) and the server that speaks the wire
//! protocol to clients ([`server`]), the second tier behind the memory tier
//! ([`tier`], a backend plugin), cluster membership ([`cluster`]) and the
//! memory shared with local clients (`shm`) and the RDMA side (`rdma`:
//! leases on described blocks, and with the `rdma` feature the registered
//! pool and each connection's queue pair).
//!
//! Data flows one way: a request enters [`server`], which asks the `store`
//! (the memory tier and the second tier behind it, as one set of
//! operations), which asks [`cache`] and [`tier`]; the cache takes blocks
//! from [`memory`]. What the parts report in `/metrics` they encode
//! themselves, with the helpers in `telemetry`. Unsafe code is denied everywhere but
//! in [`memory`], `shm` and the `rdma` feature's verbs side, whose module
//! docs justify each use.

pub mod cache;
pub mod cluster;
#[allow(unsafe_code)] // The pool maps and hands out raw memory; see the module docs.
pub mod memory;
mod rdma;
pub mod server;
#[allow(unsafe_code)] // memfd, mmap and SCM_RIGHTS; see the module docs.
mod shm;
mod store;
mod telemetry;
pub mod tenants;
pub mod tier;

pub use server::{Node, NodeConfig};
