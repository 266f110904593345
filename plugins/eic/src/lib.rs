//! `builtin:eic`: a `backend` plugin for Volcano Engine EIC (Elastic
//! Instant Cache), reaching EIC through the host's `driver` seam.
//!
//! EIC's client SDK is closed and its protocol unpublished, so the bytes
//! move through a driver: a shared library wrapping the SDK, built against
//! include/kvplane_driver.h and named in the plugin's declaration
//! (`drivers: [{name: eic, path: ...}]`). This plugin keeps the policy:
//! which EIC instance to join and how (the keys of an AIBrix EIC config,
//! [`config`]), the namespace of every operation (exists and delete
//! included) and the ttl of every set, each overridable per call, and what
//! the driver's answers mean ([`batch`]). Values never enter the guest: the
//! host buffers of a call go to the driver session as they are.
//!
//! Config: `remote_url` (required, eic://HOST:PORT), `eic_instance_id`
//! (required), `eic_thread_num`, `eic_log_dir`, `eic_log_level` (default 1),
//! `eic_trans_type` (default 3), `eic_kv_ttl` (seconds, default -1: no
//! expiry), `eic_kv_ns` (default ""), `eic_flag_file`; `driver` (the
//! declared driver to open, default "eic") and `driver.NAME=VALUE` (passed
//! to the driver as NAME=VALUE).

pub mod batch;
pub mod config;
// The component glue only exists for wasm32: its export names are not valid
// symbols for a native shared library, and the imports have no native host.
#[cfg(target_arch = "wasm32")]
mod plugin;
