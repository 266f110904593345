//! The `kvplane` binary's tests, as one test binary: each runs the binary as
//! a user does (`CARGO_BIN_EXE_kvplane`) against real servers. Run one module
//! with `cargo test -p kvplane --test all MODULE::`.

// A test binary exports nothing: its modules' `pub` items are for each
// other, so `unreachable_pub` (denied for the workspace) would flag them all.
#![allow(unreachable_pub)]

/// The three-member etcd and the cuttable proxy of the cluster crate's
/// membership tests, shared as a file: `kvplane-cluster` keeps them out of
/// its library.
#[path = "../../../cluster/tests/support/mod.rs"]
mod etcd;
mod support;

mod bench_scripts;
mod cluster;
mod examples;
mod hostile;
mod js_scaffold;
mod node_cli;
mod operator;
mod plugin;
mod tenants;
mod tls;
