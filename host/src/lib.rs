//! kvplane: a KV-cache platform for LLM inference.
//!
//! The host keeps the native paths; policy (backend protocols, key
//! placement, retry, pod placement) runs as WebAssembly components written
//! against the `kvplane:plugin` WIT contract, loaded by [`plugin`].

pub mod bench;
pub mod cache;
pub mod conformance;
pub mod error;
pub mod memory;
pub mod operator;
pub mod plugin;
pub mod scaffold;
pub mod scheduling;
pub mod server;

pub use error::KvError;
