//! The WebAssembly plugin runtime.
//!
//! It knows nothing of the node or of Kubernetes: it loads components
//! ([`source`] fetches them, `load` checks and compiles them), runs them
//! under their declared limits, and reports typed faults.
//!
//! `PluginRuntime` owns the one `Engine` of the process and a cache of
//! compiled components; `load_*` turns a [`PluginDecl`] into a typed handle
//! ([`KeyPlacement`], [`RetryPolicy`], [`PlacementRule`], [`Backend`]) whose
//! calls run under the declaration's deadline, memory cap and failure policy.
//!
//! The handles take and answer the host's own types, defined in [`worlds`]
//! (retry-policy and backend) and [`scheduling`] (placement-rule), with
//! [`KvError`] for the contract's errors and `kvplane_slots` for members and
//! slot tables. The wasmtime-generated bindings are private to this crate
//! and converted at that boundary, so that no other crate changes with the
//! bindings generator (tests/tests/all/architecture.rs checks that none
//! names them).

mod bindings;
pub mod buffer;
pub mod builtin;
mod compat;
mod decl;
mod driver;
mod engine;
pub mod error;
pub mod host;
mod inspect;
mod load;
pub mod metrics;
mod oci;
mod placement_rule;
mod pool;
pub mod scheduling;
pub mod source;
mod transport;
pub mod worlds;

use std::path::PathBuf;
use std::sync::Arc;

pub use buffer::WritableMemory;
pub use decl::{EndpointRule, FailurePolicy, InstanceLimits, PluginDecl, PluginSource, World};
pub use engine::PluginEngine;
pub use error::{Fault, LoadError, PluginError};
pub use inspect::{ComponentInfo, HOST_WIT_VERSION};
/// The error vocabulary plugins answer with (shared with the wire protocol).
pub use kvplane_protocol::KvError;
pub use load::sha256_hex;
pub use metrics::RuntimeMetrics;
pub use pool::Plugin;
pub use worlds::{Backend, KeyPlacement, PlacementRule, RetryPolicy};

use pool::GuestExports;

/// Loads plugins onto the process's single engine.
#[derive(Clone)]
pub struct PluginRuntime {
    engine: Arc<PluginEngine>,
}

impl PluginRuntime {
    /// A runtime caching compiled components in `cache_dir` (`None`: no
    /// on-disk cache).
    pub fn new(cache_dir: Option<PathBuf>) -> anyhow::Result<PluginRuntime> {
        Ok(PluginRuntime { engine: PluginEngine::new(cache_dir)? })
    }

    /// A runtime using [`PluginEngine::default_cache_dir`].
    pub fn with_default_cache() -> anyhow::Result<PluginRuntime> {
        Self::new(PluginEngine::default_cache_dir())
    }

    pub fn engine(&self) -> &Arc<PluginEngine> {
        &self.engine
    }

    /// The host's per-plugin series; register them with
    /// [`metrics::RuntimeMetrics::register`].
    pub fn metrics(&self) -> &Arc<metrics::RuntimeMetrics> {
        &self.engine.metrics
    }

    /// Compile (or fetch from cache) and describe a component, without
    /// instantiating it.
    pub fn inspect(&self, source: &PluginSource) -> Result<ComponentInfo, LoadError> {
        let name = source.to_string();
        let bytes = load::read_source(&name, source)?;
        load::compile_and_inspect(&self.engine, &name, &name, &bytes).map(|(_, info, _)| info)
    }

    fn load<G: GuestExports>(&self, decl: PluginDecl, world: World) -> Result<Plugin<G>, LoadError> {
        if decl.world != world {
            return Err(LoadError::WrongWorld {
                plugin: decl.name.clone(),
                declared: decl.world.to_string(),
                found: format!("was loaded as {world}"),
            });
        }
        let loaded = load::load(&self.engine, &decl)?;
        Plugin::new(self.engine.clone(), decl, loaded)
    }

    pub fn load_key_placement(&self, decl: PluginDecl) -> Result<KeyPlacement, LoadError> {
        Ok(KeyPlacement::new(self.load(decl, World::KeyPlacement)?))
    }

    pub fn load_retry_policy(&self, decl: PluginDecl) -> Result<RetryPolicy, LoadError> {
        Ok(RetryPolicy { plugin: self.load(decl, World::RetryPolicy)? })
    }

    pub fn load_placement_rule(&self, decl: PluginDecl) -> Result<PlacementRule, LoadError> {
        Ok(PlacementRule { plugin: self.load(decl, World::PlacementRule)? })
    }

    pub fn load_backend(&self, decl: PluginDecl) -> Result<Backend, LoadError> {
        Ok(Backend { plugin: self.load(decl, World::Backend)? })
    }
}
