//! `builtin:resp`: a `backend` plugin for Redis and Valkey, speaking RESP2
//! through the host's `transport`.
//!
//! Values never enter the guest: a PUT sends the SET header from the guest
//! and the value straight from its host buffer, a GET reads the value into
//! the destination the host lent (a slice of it for a shorter value). Each batch is pipelined, one flush and one pass over
//! the replies. The protocol lives in [`resp`] (framing) and [`client`]
//! (connection and batches) so it can be tested natively; `plugin` exports
//! the client as the WIT `store` interface through backend-core's glue.
//!
//! Config: `endpoint` (required, host:port), `password` and `username`
//! (AUTH), `database` (SELECT), `prefix` (key namespace), `ttl-seconds`
//! (SET ... EX). A call's `ttl-ms` (SET ... PX) and `namespace` (keys under
//! `prefix + namespace + ":"`) override them per call.

pub mod client;
// The component glue only exists for wasm32: its export names are not valid
// symbols for a native shared library, and the imports have no native host.
#[cfg(target_arch = "wasm32")]
mod plugin;
pub mod resp;
