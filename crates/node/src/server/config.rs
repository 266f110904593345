//! Reading a node configuration file ([`kvplane_config::NodeConfigFile`],
//! `node.json` in the pool's ConfigMap) and verifying its plugins.
//!
//! A node checks every declared plugin at start — the same fetch, digest pin
//! and world check the operator applied, through the same runtime functions —
//! and refuses to start with one it cannot verify.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context as _;
use kvplane_config::{NodeConfigFile, PluginKind};
use kvplane_runtime::source::{self, Fetched, SourceError, SourceFailure};
use kvplane_runtime::{PluginRuntime, World};

use crate::cluster::ClusterSetup;
use crate::tier::TierSetup;

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

/// Reads, parses and validates a configuration file; an unknown field or a
/// setting that cannot work is an error naming the file and the field.
///
/// A backend plugin whose config names no `endpoint` gets the first of
/// `backendEndpoints` (the store the KVCache declares), so a declaration
/// need not repeat it; nor a `password`, the secret in
/// `KVPLANE_BACKEND_SECRET` (from the KVCache's `backend.secretRef`).
pub fn read(path: &Path) -> anyhow::Result<NodeConfigFile> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading the node config {}", path.display()))?;
    let mut file: NodeConfigFile =
        kvplane_config::from_json_strict(&text).with_context(|| format!("{}: not a node configuration", path.display()))?;
    file.validate().with_context(|| format!("{}: invalid node configuration", path.display()))?;
    let secret = std::env::var(kvplane_config::node::BACKEND_SECRET_ENV).ok().filter(|s| !s.is_empty());
    for p in file.plugins.iter_mut().filter(|p| p.kind == PluginKind::Backend) {
        if let Some(endpoint) = file.backend_endpoints.first() {
            p.config.entry("endpoint".into()).or_insert_with(|| endpoint.clone());
        }
        if let Some(secret) = &secret {
            p.config.entry("password".into()).or_insert_with(|| secret.clone());
        }
    }
    Ok(file)
}

/// Cluster mode as the file asks for it, with the key-placement plugin it
/// names (or the one declared). `None` without a `cluster` section.
pub fn cluster_setup(file: &NodeConfigFile, plugins: &[VerifiedPlugin], token: Option<String>) -> anyhow::Result<Option<ClusterSetup>> {
    let Some(c) = &file.cluster else { return Ok(None) };
    let etcd = match &file.metadata {
        Some(kvplane_config::MetadataEndpoints::Etcd(e)) if !e.is_empty() => e.clone(),
        _ => anyhow::bail!("cluster: needs metadata.etcd endpoints"),
    };
    let id = match &c.node_id {
        Some(id) => id.clone(),
        None => std::env::var("POD_NAME")
            .ok()
            .filter(|s| !s.is_empty())
            .or_else(|| std::fs::read_to_string("/etc/hostname").ok().map(|h| h.trim().to_string()).filter(|h| !h.is_empty()))
            .context("cluster.nodeId: not set, and neither POD_NAME nor the host name gives one")?,
    };
    let placement = plugins
        .iter()
        .filter(|p| p.world == World::KeyPlacement && c.placement.as_ref().is_none_or(|n| &p.name == n))
        .find_map(|p| match &p.loaded {
            LoadedPlugin::KeyPlacement(k) => Some(Arc::clone(k)),
            _ => None,
        });
    let member = kvplane_slots::Member {
        id,
        endpoint: c.advertise.clone().unwrap_or_default(),
        zone: c.zone.clone().unwrap_or_default(),
        weight: c.weight,
        state: kvplane_slots::MemberState::Up,
        labels: Vec::new(),
    };
    Ok(Some(ClusterSetup {
        etcd,
        name: c.name.clone(),
        member,
        lease_ttl: std::time::Duration::from_secs(c.lease_ttl_seconds),
        replicas: c.replicas,
        // Checked against replicas when the file was read (1..=replicas).
        write_quorum: c.write_quorum,
        placement,
        token,
        // The node sets it from its tenants (`Node::start`).
        scoped_keys: false,
        repair_bytes_per_second: c.repair_bytes_per_second.bytes(),
        etcd_security: crate::cluster::etcd_security(c.etcd.as_ref())?,
        peer_tls: c.peer_tls.clone(),
    }))
}

/// The second tier the file asks for, from the plugins it declared (already
/// verified and started). `None` when no backend plugin is declared.
pub fn tier_setup(file: &NodeConfigFile, plugins: &[VerifiedPlugin]) -> Option<TierSetup> {
    let settings = file.tiering_in_effect()?;
    let pick =
        |world: World, name: &Option<String>| plugins.iter().find(|p| p.world == world && name.as_ref().is_none_or(|n| &p.name == n));
    let backend = pick(World::Backend, &settings.backend)?;
    let LoadedPlugin::Backend(b) = &backend.loaded else { return None };
    let retry = match pick(World::RetryPolicy, &settings.retry).map(|p| &p.loaded) {
        Some(LoadedPlugin::RetryPolicy(r)) => Some(Arc::clone(r)),
        _ => None,
    };
    Some(TierSetup { name: backend.name.clone(), backend: Arc::clone(b), retry, settings })
}

/// A plugin loaded for this node, one instance already configured. Shared:
/// the second tier and the cluster hold the ones they call.
pub enum LoadedPlugin {
    Backend(Arc<kvplane_runtime::Backend>),
    KeyPlacement(Arc<kvplane_runtime::KeyPlacement>),
    RetryPolicy(Arc<kvplane_runtime::RetryPolicy>),
    PlacementRule(Arc<kvplane_runtime::PlacementRule>),
}

impl LoadedPlugin {
    /// Sockets this plugin may hold open at once: its connections per
    /// instance times its instances.
    pub fn sockets(&self) -> usize {
        let limits = match self {
            LoadedPlugin::Backend(p) => p.plugin.decl().limits,
            LoadedPlugin::KeyPlacement(p) => p.plugin.decl().limits,
            LoadedPlugin::RetryPolicy(p) => p.plugin.decl().limits,
            LoadedPlugin::PlacementRule(p) => p.plugin.decl().limits,
        };
        limits.connections as usize * limits.max_instances.max(1)
    }

    async fn warm_up(&self) -> Result<(), kvplane_runtime::PluginError> {
        match self {
            LoadedPlugin::Backend(p) => p.plugin.warm_up().await,
            LoadedPlugin::KeyPlacement(p) => p.plugin.warm_up().await,
            LoadedPlugin::RetryPolicy(p) => p.plugin.warm_up().await,
            LoadedPlugin::PlacementRule(p) => p.plugin.warm_up().await,
        }
    }
}

/// Whether a plugin's start failed because its store did not answer (as
/// opposed to a config it refuses, which must stop the start).
fn store_unreachable(e: &kvplane_runtime::PluginError) -> bool {
    use kvplane_protocol::KvError;
    match &e.fault {
        kvplane_runtime::Fault::Configure(KvError::Unavailable(_) | KvError::Timeout(_)) | kvplane_runtime::Fault::Deadline { .. } => true,
        kvplane_runtime::Fault::Broken { cause, .. } => {
            matches!(
                **cause,
                kvplane_runtime::Fault::Configure(KvError::Unavailable(_) | KvError::Timeout(_)) | kvplane_runtime::Fault::Deadline { .. }
            )
        }
        _ => false,
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
            World::Backend => runtime.load_backend(d).map(|p| LoadedPlugin::Backend(Arc::new(p))),
            World::KeyPlacement => runtime.load_key_placement(d).map(|p| LoadedPlugin::KeyPlacement(Arc::new(p))),
            World::RetryPolicy => runtime.load_retry_policy(d).map(|p| LoadedPlugin::RetryPolicy(Arc::new(p))),
            World::PlacementRule => runtime.load_placement_rule(d).map(|p| LoadedPlugin::PlacementRule(Arc::new(p))),
        };
        let loaded = loaded.with_context(|| format!("plugin {}", p.name))?;
        // One instance now, with its `open` / `configure`: a config the
        // plugin refuses stops the start, naming the plugin and the key. A
        // backend whose store cannot be reached does not: the node serves
        // its memory tier and the second tier probes the store until it
        // answers (a pod restarted during a store outage must not
        // crash-loop).
        match loaded.warm_up().await {
            Err(e) if world == World::Backend && store_unreachable(&e) => {
                tracing::warn!(plugin = %p.name, error = %e, "the backend's store is unreachable; starting with the memory tier alone");
                eprintln!("plugin {}: its store is unreachable ({e}); serving the memory tier, reconnecting in the background", p.name);
            }
            other => other.with_context(|| format!("starting plugin {} ({world})", p.name))?,
        }
        verified.push(VerifiedPlugin { name: p.name.clone(), world, origin, sha256, loaded });
    }
    Ok(verified)
}
