//! `builtin:vineyard`: a `backend` plugin for vineyard (v6d), speaking
//! vineyardd's RPC protocol (8-byte little-endian length + compact JSON)
//! through the host's `transport`.
//!
//! Each value is a vineyard blob holding its bytes and an object of type
//! `kvplane::Value` naming the blob, persisted and given the key's name.
//! Values never enter the guest: a PUT sends the blob's bytes straight from
//! the host buffer, a GET reads them into the destination the host lent (a
//! slice of it for a shorter value, `skip` for one too long). The protocol
//! lives in [`proto`] (framing and message shapes) and [`client`] (the
//! steps of each batch) so it can be tested natively; `plugin` exports the
//! client as the WIT `store` interface through backend-core's glue.
//!
//! Config: `endpoint` (required, vineyardd's RPC `host:port`), `prefix`
//! (default `kvplane:`; names are shared by everything using the
//! vineyardd). A call's `namespace` puts names under
//! `prefix + namespace + ":"`; keys are written with every byte outside
//! `[A-Za-z0-9._-]` as `%XX`. vineyardd has no expiry: `ttl-ms` is
//! `unsupported`.

pub mod client;
// The component glue only exists for wasm32: its export names are not valid
// symbols for a native shared library, and the imports have no native host.
#[cfg(target_arch = "wasm32")]
mod plugin;
pub mod proto;
