//! The workspace's integration tests, as one test binary (as wasmtime's
//! `tests/all`): each module was once a binary of its own, and each of those
//! linked the plugin runtime (wasmtime and cranelift) again. One binary is
//! linked once, and its tests share one run of the test harness, two at a
//! time on a 2-core machine as before. Run one module with
//! `cargo test -p kvplane-tests --test all MODULE::`.

// A test binary exports nothing: its modules' `pub` items are for each
// other, so `unreachable_pub` (denied for the workspace) would flag them all.
#![allow(unreachable_pub)]

mod architecture;
mod builtins;
mod containment;
mod contract;
mod control_plane;
mod eic_driver;
mod js_plugin;
mod limits;
mod oci_registry;
mod plugin_config;
mod python_plugin;
mod resp_redis;
mod tiering;
mod vineyard;
