//! The node's integration tests, as one test binary (each module was once a
//! binary of its own, and each linked the node and its plugin runtime
//! again). Run one module with `cargo test -p kvplane-node --test all MODULE::`.

// A test binary exports nothing: its modules' `pub` items are for each
// other, so `unreachable_pub` (denied for the workspace) would flag them all.
#![allow(unreachable_pub)]

mod node;
mod rdma;
mod shared_memory;
