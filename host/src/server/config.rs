//! The node configuration file the operator writes (`node.json` in the
//! pool's ConfigMap): the backend, the metadata store and the plugin
//! declarations. A node checks every declared plugin at start — the same
//! digest pin and world check the operator applied — and refuses to start
//! with one it cannot verify.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context as _};
use serde::Deserialize;

use crate::operator::crd::PluginSpec;
use crate::operator::plugins::{decl, world_of};
use crate::plugin::load::sha256_hex;
use crate::plugin::{PluginRuntime, World};

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeFile {
    pub backend: String,
    #[serde(default)]
    pub backend_endpoints: Vec<String>,
    #[serde(default)]
    pub plugins: Vec<PluginSpec>,
}

/// A plugin that passed verification.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifiedPlugin {
    pub name: String,
    pub world: World,
    pub origin: String,
    pub sha256: String,
}

/// Directory, next to the config file, where the operator mounts plugins
/// whose source is a ConfigMap key (as `NAME.wasm`).
pub fn plugin_dir(config: &Path) -> PathBuf {
    config.parent().unwrap_or(Path::new(".")).join("plugins")
}

pub fn read(path: &Path) -> anyhow::Result<NodeFile> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading the node config {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{}: not a node configuration", path.display()))
}

/// Fetches (builtin, mounted ConfigMap key, URL or OCI artifact), checks the
/// digest and compiles every plugin of `file`.
pub async fn verify_plugins(file: &NodeFile, config_path: &Path, runtime: &PluginRuntime) -> anyhow::Result<Vec<VerifiedPlugin>> {
    let mut verified = Vec::new();
    for p in &file.plugins {
        let (origin, bytes): (String, Arc<[u8]>) = if let Some(name) = &p.source.builtin {
            let bytes = crate::plugin::builtin::bytes(name).with_context(|| format!("plugin {}: no builtin plugin {name:?}", p.name))?;
            (format!("builtin:{name}"), Arc::from(bytes))
        } else if p.source.config_map.is_some() {
            let path = plugin_dir(config_path).join(format!("{}.wasm", p.name));
            let bytes = std::fs::read(&path).with_context(|| format!("plugin {}: reading the mounted component {}", p.name, path.display()))?;
            (path.display().to_string(), Arc::from(bytes))
        } else if let Some(url) = &p.source.url {
            let url = url.clone();
            let bytes = tokio::task::spawn_blocking(move || crate::operator::plugins::fetch_url(&url))
                .await?
                .map_err(|e| anyhow::anyhow!("plugin {}: {e}", p.name))?;
            (p.source.url.clone().unwrap_or_default(), Arc::from(bytes))
        } else if let Some(reference) = &p.source.oci {
            let bytes = crate::operator::oci::pull_wasm(reference).await.with_context(|| format!("plugin {}", p.name))?;
            (format!("oci:{reference}"), Arc::from(bytes))
        } else {
            bail!("plugin {}: no source", p.name);
        };
        let sha256 = sha256_hex(&bytes);
        if let Some(want) = &p.sha256 {
            if !want.eq_ignore_ascii_case(&sha256) {
                bail!("plugin {}: {origin} has sha256 {sha256}, the configuration pins {want}", p.name);
            }
        }
        let d = decl(p, origin.clone(), bytes).map_err(|e| anyhow::anyhow!("{e}"))?;
        let world = world_of(p.kind);
        let loaded = match world {
            World::Backend => runtime.load_backend(d).map(|_| ()),
            World::KeyPlacement => runtime.load_key_placement(d).map(|_| ()),
            World::RetryPolicy => runtime.load_retry_policy(d).map(|_| ()),
            World::PlacementRule => runtime.load_placement_rule(d).map(|_| ()),
        };
        loaded.with_context(|| format!("plugin {}", p.name))?;
        verified.push(VerifiedPlugin { name: p.name.clone(), world, origin, sha256 });
    }
    Ok(verified)
}
