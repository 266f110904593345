//! The kvplane cache node: the memory tier ([`memory`], a slab pool of
//! preallocated blocks), the block cache over it ([`cache`], sharded index,
//! S3-FIFO or LRU eviction, pin leases) and the server that speaks the wire
//! protocol to clients ([`server`]), the second tier behind the memory tier
//! ([`tier`], a backend plugin), cluster membership ([`cluster`]) and the
//! memory shared with local clients (`shm`) and the RDMA side (`rdma`:
//! leases on described blocks, and with the `rdma` feature the registered
//! pool and each connection's queue pair).
//!
//! Data flows one way: a request enters [`server`], which asks [`cache`],
//! which takes blocks from [`memory`]. Unsafe code is denied everywhere but
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
pub mod tier;

pub use server::{Node, NodeConfig};
