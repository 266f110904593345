//! Reading a node configuration file ([`kvplane_config::NodeConfigFile`],
//! `node.json` in the pool's ConfigMap) and verifying its plugins.
//!
//! A node checks every declared plugin at start — the same fetch, digest pin
//! and world check the operator applied, through the same runtime functions —
//! and refuses to start with one it cannot verify.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context as _;
use kvplane_config::NodeConfigFile;
use kvplane_runtime::source::{self, Fetched, SourceError, SourceFailure};
use kvplane_runtime::{PluginRuntime, World};

/// A plugin that passed verification and started.
pub struct VerifiedPlugin {
    pub name: String,
    pub world: World,
    pub origin: String,
    pub sha256: String,
    /// Kept for as long as the node serves; the second tier and the cluster
    /// call into it.
    pub loaded: LoadedPlugin,
}

/// Directory, next to the config file, where the operator mounts plugins
/// whose source is a ConfigMap key (as `NAME.wasm`).
pub fn plugin_dir(config: &Path) -> PathBuf {
    config.parent().unwrap_or(Path::new(".")).join("plugins")
}

/// Reads and parses a configuration file; an unknown field is an error
/// naming the file and the field.
pub fn read(path: &Path) -> anyhow::Result<NodeConfigFile> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading the node config {}", path.display()))?;
    kvplane_config::from_json_strict(&text).with_context(|| format!("{}: not a node configuration", path.display()))
}

/// A plugin loaded for this node, one instance already configured.
pub enum LoadedPlugin {
    Backend(kvplane_runtime::Backend),
    KeyPlacement(kvplane_runtime::KeyPlacement),
    RetryPolicy(kvplane_runtime::RetryPolicy),
    PlacementRule(kvplane_runtime::PlacementRule),
}

impl LoadedPlugin {
    async fn warm_up(&self) -> Result<(), kvplane_runtime::PluginError> {
        match self {
            LoadedPlugin::Backend(p) => p.plugin.warm_up().await,
            LoadedPlugin::KeyPlacement(p) => p.plugin.warm_up().await,
            LoadedPlugin::RetryPolicy(p) => p.plugin.warm_up().await,
            LoadedPlugin::PlacementRule(p) => p.plugin.warm_up().await,
        }
    }
}

/// Fetches (builtin, mounted ConfigMap key, URL or OCI artifact), checks the
/// digest, compiles every plugin of `file`, and starts one instance of each
/// (running its `open` / `configure`).
pub async fn verify_plugins(file: &NodeConfigFile, config_path: &Path, runtime: &PluginRuntime) -> anyhow::Result<Vec<VerifiedPlugin>> {
    let mut verified = Vec::new();
    for p in &file.plugins {
        let fetched = match source::fetch(&p.name, &p.source).await? {
            Some(f) => f,
            // A ConfigMap key: the operator mounts it next to the config.
            None => {
                let path = plugin_dir(config_path).join(format!("{}.wasm", p.name));
                let bytes = std::fs::read(&path).map_err(|e| {
                    SourceError::new(
                        SourceFailure::NotFound,
                        format!("plugin {}: reading the mounted component {}: {e}", p.name, path.display()),
                    )
                })?;
                Fetched { origin: path.display().to_string(), bytes: Arc::from(bytes) }
            }
        };
        let sha256 = source::verify_digest(p, &fetched)?;
        let origin = fetched.origin.clone();
        let d = source::decl(p, fetched)?;
        let world = d.world;
        let loaded = match world {
            World::Backend => runtime.load_backend(d).map(LoadedPlugin::Backend),
            World::KeyPlacement => runtime.load_key_placement(d).map(LoadedPlugin::KeyPlacement),
            World::RetryPolicy => runtime.load_retry_policy(d).map(LoadedPlugin::RetryPolicy),
            World::PlacementRule => runtime.load_placement_rule(d).map(LoadedPlugin::PlacementRule),
        };
        let loaded = loaded.with_context(|| format!("plugin {}", p.name))?;
        // One instance now, with its `open` / `configure`: a config the
        // plugin refuses stops the start, naming the plugin and the key.
        loaded.warm_up().await.with_context(|| format!("starting plugin {} ({world})", p.name))?;
        verified.push(VerifiedPlugin { name: p.name.clone(), world, origin, sha256, loaded });
    }
    Ok(verified)
}
