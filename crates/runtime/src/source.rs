//! Where a declared plugin's bytes come from, and the checks between
//! fetching them and compiling them.
//!
//! The operator and the node run the same steps on the same declaration
//! ([`kvplane_config::PluginSpec`]): fetch (builtin, URL, OCI artifact, or a
//! ConfigMap key that the caller supplies, since only Kubernetes or a mounted
//! volume has it), check the pinned sha256, then turn the declaration into a
//! [`PluginDecl`] for the runtime. Either refuses a plugin with the same
//! [`SourceError`].

use std::fmt;
use std::sync::Arc;

use kvplane_config::{PluginKind, PluginSourceSpec, PluginSpec};

use crate::load::sha256_hex;
use crate::{PluginDecl, PluginSource, World};

/// Largest component fetched over HTTP: a Python component is ~18 MB.
const MAX_COMPONENT_BYTES: u64 = 256 << 20;

/// Why a plugin could not be fetched or accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceFailure {
    /// `builtin: NAME` names no builtin plugin.
    UnknownBuiltin,
    /// The source could not be reached (network, registry, API server).
    Unavailable,
    /// The source was reached and the component is not there.
    NotFound,
    /// The declaration names no source, or several.
    InvalidSource,
    /// The bytes do not have the pinned sha256 (the declaration's, or, for
    /// an OCI artifact, the digest its manifest or reference names).
    DigestMismatch,
    /// `limits` could not be read.
    InvalidLimits,
}

/// A refused plugin: what went wrong, and a message naming the plugin.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct SourceError {
    pub failure: SourceFailure,
    pub message: String,
}

impl SourceError {
    pub fn new(failure: SourceFailure, message: impl Into<String>) -> SourceError {
        SourceError { failure, message: message.into() }
    }
}

/// A component's bytes and where they came from (for messages and status).
#[derive(Clone)]
pub struct Fetched {
    pub origin: String,
    pub bytes: Arc<[u8]>,
}

impl fmt::Debug for Fetched {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fetched").field("origin", &self.origin).field("len", &self.bytes.len()).finish()
    }
}

/// The world a declared kind loads as.
pub fn world_of(kind: PluginKind) -> World {
    match kind {
        PluginKind::Backend => World::Backend,
        PluginKind::KeyPlacement => World::KeyPlacement,
        PluginKind::Retry => World::RetryPolicy,
        PluginKind::PlacementRule => World::PlacementRule,
    }
}

/// How [`fetch_with`] reaches remote sources.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FetchOptions {
    /// OCI registries (`host:port`) pulled from over plain HTTP; every other
    /// registry over HTTPS.
    pub insecure_registries: Vec<String>,
}

impl FetchOptions {
    /// What [`fetch`] uses: the insecure registries listed in
    /// `KVPLANE_INSECURE_REGISTRIES` (comma-separated `host:port`).
    pub fn from_env() -> FetchOptions {
        FetchOptions { insecure_registries: crate::oci::insecure_registries_from_env() }
    }
}

/// Fetches a builtin, URL or OCI source, with [`FetchOptions::from_env`].
/// A ConfigMap source is not fetched here (`Ok(None)`): the caller reads it
/// from the API server or from the volume it is mounted on.
pub async fn fetch(plugin: &str, src: &PluginSourceSpec) -> Result<Option<Fetched>, SourceError> {
    fetch_with(plugin, src, &FetchOptions::from_env()).await
}

/// [`fetch`] with explicit options, for a caller that must not depend on the
/// process environment (e.g. tests running in parallel threads).
pub async fn fetch_with(plugin: &str, src: &PluginSourceSpec, options: &FetchOptions) -> Result<Option<Fetched>, SourceError> {
    let set = [src.builtin.is_some(), src.config_map.is_some(), src.url.is_some(), src.oci.is_some()].iter().filter(|s| **s).count();
    if set != 1 {
        return Err(SourceError::new(
            SourceFailure::InvalidSource,
            format!("plugin {plugin}: source must set exactly one of builtin, configMap, oci, url ({set} set)"),
        ));
    }
    if let Some(name) = &src.builtin {
        let bytes = crate::builtin::bytes(name).ok_or_else(|| {
            SourceError::new(
                SourceFailure::UnknownBuiltin,
                format!("plugin {plugin}: no builtin plugin {name:?} (builtins: {})", crate::builtin::NAMES.join(", ")),
            )
        })?;
        return Ok(Some(Fetched { origin: format!("builtin:{name}"), bytes: Arc::from(bytes) }));
    }
    if let Some(url) = &src.url {
        let owned = url.clone();
        let bytes = tokio::task::spawn_blocking(move || fetch_url(&owned))
            .await
            .map_err(|e| SourceError::new(SourceFailure::Unavailable, format!("plugin {plugin}: fetch task failed: {e}")))?
            .map_err(|e| SourceError::new(SourceFailure::Unavailable, format!("plugin {plugin}: {e}")))?;
        return Ok(Some(Fetched { origin: url.clone(), bytes: Arc::from(bytes) }));
    }
    if let Some(reference) = &src.oci {
        // The error names the reference; what it means decides the failure
        // (a missing tag is NotFound, a layer that is not what its digest
        // says is DigestMismatch).
        let bytes = crate::oci::pull_wasm(reference, &options.insecure_registries)
            .await
            .map_err(|e| SourceError::new(crate::oci::failure_of(&e), format!("plugin {plugin}: {e:#}")))?;
        return Ok(Some(Fetched { origin: format!("oci:{reference}"), bytes: Arc::from(bytes) }));
    }
    Ok(None)
}

/// Fetches a component over http(s), bounded in size.
fn fetch_url(url: &str) -> Result<Vec<u8>, String> {
    let mut resp = ureq::get(url).call().map_err(|e| format!("GET {url}: {e}"))?;
    resp.body_mut().with_config().limit(MAX_COMPONENT_BYTES).read_to_vec().map_err(|e| format!("GET {url}: reading the body: {e}"))
}

/// Checks the pinned digest (if any) and returns the bytes' sha256.
pub fn verify_digest(spec: &PluginSpec, fetched: &Fetched) -> Result<String, SourceError> {
    let sha256 = sha256_hex(&fetched.bytes);
    if let Some(want) = &spec.sha256 {
        if !want.eq_ignore_ascii_case(&sha256) {
            return Err(SourceError::new(
                SourceFailure::DigestMismatch,
                format!("plugin {}: {} has sha256 {sha256}, the declaration pins {want}", spec.name, fetched.origin),
            ));
        }
    }
    Ok(sha256)
}

/// Turns a declaration and its fetched bytes into what the runtime loads.
pub fn decl(spec: &PluginSpec, fetched: Fetched) -> Result<PluginDecl, SourceError> {
    let mut d =
        PluginDecl::new(spec.name.clone(), world_of(spec.kind), PluginSource::Bytes { origin: fetched.origin, bytes: fetched.bytes });
    d.sha256 = spec.sha256.clone();
    d.config = spec.config.clone();
    d.failure_policy = spec.failure_policy;
    d.allowed_endpoints = spec.allowed_endpoints.clone();
    if let Some(limits) = &spec.limits {
        let invalid = |e: String| SourceError::new(SourceFailure::InvalidLimits, format!("plugin {}: {e}", spec.name));
        if let Some(memory) = limits.memory_bytes().map_err(invalid)? {
            d.limits.memory_bytes = memory;
        }
        if let Some(timeout) = limits.timeout().map_err(invalid)? {
            d.limits.timeout = timeout;
        }
        if let Some(n) = limits.connections {
            d.limits.connections = n;
        }
        if let Some(bytes) = limits.queued_bytes().map_err(invalid)? {
            d.limits.queued_bytes = bytes;
        }
        if let Some(n) = limits.buffers {
            d.limits.buffers = n;
        }
        if let Some(bytes) = limits.buffer_bytes().map_err(invalid)? {
            d.limits.buffer_bytes = bytes;
        }
        if let Some(n) = limits.handles {
            d.limits.handles = n;
        }
        if let Some(n) = limits.metric_series {
            d.limits.metric_series = n;
        }
        if let Some(n) = limits.max_instances {
            if n == 0 {
                return Err(invalid("limits.maxInstances must be 1 or more".into()));
            }
            d.limits.max_instances = n as usize;
        }
        if let Some(n) = limits.log_records_per_second {
            d.limits.log_records_per_second = n;
        }
        if let Some(n) = limits.log_burst {
            d.limits.log_burst = n;
        }
    }
    d.drivers = spec.drivers.iter().map(|r| (r.name.clone(), std::path::PathBuf::from(&r.path))).collect();
    Ok(d)
}
