//! Plugins declared by a KVCache: fetched from their source, pinned by
//! sha256, loaded into the host's plugin runtime, and — for placement rules —
//! asked where each role's pods may run.
//!
//! Fetching, the digest check and the declaration are the runtime's
//! ([`kvplane_runtime::source`]), shared with the node; only a ConfigMap
//! source, which needs the API server, is read here.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::{Api, Client};
use kvplane_runtime::scheduling::PodRequest;
use kvplane_runtime::source::{self, Fetched, SourceError, SourceFailure};
use kvplane_runtime::PluginRuntime;

use crate::conditions::Reason;
use crate::crd::{PluginKind, PluginSpec, ResolvedPlugin};
use crate::render::{pod_labels, Placements, RolePlacement, ROLE_CACHE, ROLE_ETCD};
use crate::resolve::{Metadata, Resolved};
use crate::scheduling::{merge, role_placement};

/// Why the plugins could not be resolved or a placement rule failed: the
/// reason goes to the `PluginsResolved` condition, the message to a person.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub(crate) struct PluginFailure {
    pub reason: Reason,
    pub message: String,
}

impl PluginFailure {
    fn new(reason: Reason, message: impl Into<String>) -> PluginFailure {
        PluginFailure { reason, message: message.into() }
    }
}

impl From<SourceError> for PluginFailure {
    fn from(e: SourceError) -> PluginFailure {
        let reason = match e.failure {
            SourceFailure::UnknownBuiltin => Reason::UnknownBuiltin,
            SourceFailure::Unavailable => Reason::SourceUnavailable,
            SourceFailure::NotFound => Reason::SourceNotFound,
            SourceFailure::InvalidSource => Reason::InvalidSource,
            SourceFailure::DigestMismatch => Reason::DigestMismatch,
            SourceFailure::InvalidLimits => Reason::InvalidLimits,
        };
        PluginFailure { reason, message: e.message }
    }
}

/// A plugin's bytes, fetched from where the spec says.
async fn fetch(client: &Client, namespace: &str, p: &PluginSpec) -> Result<Fetched, PluginFailure> {
    if let Some(fetched) = source::fetch(&p.name, &p.source).await? {
        return Ok(fetched);
    }
    let Some(cm) = &p.source.config_map else {
        return Err(PluginFailure::new(Reason::InvalidSource, format!("plugin {}: no source", p.name)));
    };
    let origin = format!("configmap:{namespace}/{}#{}", cm.name, cm.key);
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let map = api
        .get_opt(&cm.name)
        .await
        .map_err(|e| PluginFailure::new(Reason::SourceUnavailable, format!("plugin {}: reading ConfigMap {}: {e}", p.name, cm.name)))?
        .ok_or_else(|| {
            PluginFailure::new(Reason::SourceNotFound, format!("plugin {}: ConfigMap {}/{} does not exist", p.name, namespace, cm.name))
        })?;
    let bytes = map.binary_data.as_ref().and_then(|d| d.get(&cm.key)).map(|b| b.0.clone()).ok_or_else(|| {
        let has_text = map.data.as_ref().is_some_and(|d| d.contains_key(&cm.key));
        PluginFailure::new(
            Reason::SourceNotFound,
            if has_text {
                format!("plugin {}: ConfigMap {} has {:?} under data; a component must be under binaryData", p.name, cm.name, cm.key)
            } else {
                format!("plugin {}: ConfigMap {} has no binaryData key {:?}", p.name, cm.name, cm.key)
            },
        )
    })?;
    Ok(Fetched { origin, bytes: Arc::from(bytes) })
}

/// Every plugin fetched and verified (digest checked, component compiled and
/// of the declared world); the placement rules loaded and asked for every
/// role. Returns the placements and the digests for the status.
pub(crate) async fn resolve_and_place(
    client: &Client,
    runtime: &PluginRuntime,
    r: &Resolved,
    annotations: &BTreeMap<String, String>,
) -> Result<(Placements, Vec<ResolvedPlugin>), PluginFailure> {
    let mut digests = Vec::with_capacity(r.plugins.len());
    let mut rules = Vec::new();
    for p in &r.plugins {
        let fetched = fetch(client, &r.namespace, p).await?;
        let sha = source::verify_digest(p, &fetched)?;
        digests.push(ResolvedPlugin { name: p.name.clone(), source: fetched.origin.clone(), sha256: sha });
        let d = source::decl(p, fetched)?;
        // Loading compiles (or reuses the compiled cache) and checks the
        // world and the contract version, for every kind: a node would
        // refuse the same component later.
        let d_for_load = d.clone();
        let loaded = match p.kind {
            PluginKind::PlacementRule => Some(runtime.load_placement_rule(d_for_load)),
            PluginKind::KeyPlacement => runtime.load_key_placement(d_for_load).map(|_| ()).err().map(Err),
            PluginKind::Retry => runtime.load_retry_policy(d_for_load).map(|_| ()).err().map(Err),
            PluginKind::Backend => runtime.load_backend(d_for_load).map(|_| ()).err().map(Err),
        };
        match loaded {
            None => {}
            Some(Ok(rule)) => rules.push(rule),
            Some(Err(e)) => return Err(PluginFailure::new(Reason::LoadFailed, format!("plugin {}: {e}", p.name))),
        }
    }
    let annotations: Vec<(String, String)> = annotations.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    let mut placements = Placements::default();
    let etcd_replicas = match &r.metadata {
        Metadata::Etcd(plan) => Some(plan.workload.replicas),
        _ => None,
    };
    for (role, replicas) in [(ROLE_CACHE, Some(r.cache.replicas)), (ROLE_ETCD, etcd_replicas)] {
        let Some(replicas) = replicas else { continue };
        let request = PodRequest {
            role: role.into(),
            name: r.name.clone(),
            labels: pod_labels(r, role).into_iter().collect(),
            annotations: annotations.clone(),
            replicas: replicas.max(0) as u32,
        };
        let mut merged = RolePlacement::default();
        for rule in &rules {
            let placement = rule
                .place(request.clone())
                .await
                .map_err(|e| PluginFailure::new(Reason::PlacementRuleFailed, format!("placing the {role} pods: {e}")))?;
            merged = merge(merged, role_placement(&placement));
        }
        match role {
            ROLE_CACHE => placements.cache = merged,
            _ => placements.etcd = merged,
        }
    }
    Ok((placements, digests))
}
