//! Plugins declared by a KVCache: fetched from their source, pinned by
//! sha256, loaded into the host's plugin runtime, and — for placement rules —
//! asked where each role's pods may run.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::{Api, Client};

use super::crd::{FailurePolicy, PluginKind, PluginSpec, ResolvedPlugin};
use super::quantity::parse_bytes;
use super::render::{pod_labels, Placements, RolePlacement, ROLE_CACHE, ROLE_ETCD};
use super::resolve::{Metadata, Resolved};
use crate::plugin::load::sha256_hex;
use crate::plugin::worlds::PodRequest;
use crate::plugin::{self, PluginDecl, PluginRuntime, PluginSource, World};

/// Why the plugins could not be resolved or a placement rule failed: the
/// reason goes to the `PluginsResolved` condition, the message to a person.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct PluginFailure {
    /// CamelCase condition reason.
    pub reason: &'static str,
    pub message: String,
}

fn fail(reason: &'static str, message: impl Into<String>) -> PluginFailure {
    PluginFailure { reason, message: message.into() }
}

pub fn world_of(kind: PluginKind) -> World {
    match kind {
        PluginKind::Backend => World::Backend,
        PluginKind::KeyPlacement => World::KeyPlacement,
        PluginKind::Retry => World::RetryPolicy,
        PluginKind::PlacementRule => World::PlacementRule,
    }
}

/// A plugin's bytes, fetched from where the spec says.
pub async fn fetch(client: &Client, namespace: &str, p: &PluginSpec) -> Result<(String, Arc<[u8]>), PluginFailure> {
    let src = &p.source;
    if let Some(name) = &src.builtin {
        let bytes = plugin::builtin::bytes(name)
            .ok_or_else(|| fail("UnknownBuiltin", format!("plugin {}: no builtin plugin {name:?}", p.name)))?;
        return Ok((format!("builtin:{name}"), Arc::from(bytes)));
    }
    if let Some(cm) = &src.config_map {
        let origin = format!("configmap:{namespace}/{}#{}", cm.name, cm.key);
        let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
        let map = api
            .get_opt(&cm.name)
            .await
            .map_err(|e| fail("SourceUnavailable", format!("plugin {}: reading ConfigMap {}: {e}", p.name, cm.name)))?
            .ok_or_else(|| fail("SourceNotFound", format!("plugin {}: ConfigMap {}/{} does not exist", p.name, namespace, cm.name)))?;
        let bytes = map.binary_data.as_ref().and_then(|d| d.get(&cm.key)).map(|b| b.0.clone()).ok_or_else(|| {
            let has_text = map.data.as_ref().is_some_and(|d| d.contains_key(&cm.key));
            fail(
                "SourceNotFound",
                if has_text {
                    format!("plugin {}: ConfigMap {} has {:?} under data; a component must be under binaryData", p.name, cm.name, cm.key)
                } else {
                    format!("plugin {}: ConfigMap {} has no binaryData key {:?}", p.name, cm.name, cm.key)
                },
            )
        })?;
        return Ok((origin, Arc::from(bytes)));
    }
    if let Some(url) = &src.url {
        let url = url.clone();
        let name = p.name.clone();
        let bytes = tokio::task::spawn_blocking(move || fetch_url(&url))
            .await
            .map_err(|e| fail("SourceUnavailable", format!("plugin {name}: fetch task failed: {e}")))?
            .map_err(|e| fail("SourceUnavailable", format!("plugin {}: {e}", p.name)))?;
        return Ok((src.url.clone().unwrap_or_default(), Arc::from(bytes)));
    }
    if let Some(reference) = &src.oci {
        let bytes = super::oci::pull_wasm(reference)
            .await
            .map_err(|e| fail("SourceUnavailable", format!("plugin {}: pulling {reference}: {e:#}", p.name)))?;
        return Ok((format!("oci:{reference}"), Arc::from(bytes)));
    }
    Err(fail("InvalidSource", format!("plugin {}: no source", p.name)))
}

/// Largest component fetched over HTTP: a Python component is ~18 MB.
const MAX_COMPONENT_BYTES: u64 = 256 << 20;

/// Fetches a component over http(s), bounded in size; shared with the node,
/// which fetches the same declarations itself.
pub(crate) fn fetch_url(url: &str) -> Result<Vec<u8>, String> {
    let mut resp = ureq::get(url).call().map_err(|e| format!("GET {url}: {e}"))?;
    let body = resp.body_mut().with_config().limit(MAX_COMPONENT_BYTES).read_to_vec().map_err(|e| format!("GET {url}: reading the body: {e}"))?;
    Ok(body)
}

/// Turns a spec entry and fetched bytes into a runtime declaration.
pub fn decl(p: &PluginSpec, origin: String, bytes: Arc<[u8]>) -> Result<PluginDecl, PluginFailure> {
    let mut d = PluginDecl::new(p.name.clone(), world_of(p.kind), PluginSource::Bytes { origin, bytes });
    d.sha256 = p.sha256.clone();
    d.config = p.config.clone();
    d.failure_policy = match p.failure_policy {
        FailurePolicy::FailClosed => plugin::FailurePolicy::FailClosed,
        FailurePolicy::FailOpen => plugin::FailurePolicy::FailOpen,
    };
    d.allowed_endpoints = p.allowed_endpoints.clone();
    if let Some(limits) = &p.limits {
        if let Some(m) = &limits.memory {
            d.limits.memory_bytes = parse_bytes(m)
                .ok_or_else(|| fail("InvalidLimits", format!("plugin {}: limits.memory {m:?} is not a quantity", p.name)))?;
        }
        if let Some(t) = &limits.timeout {
            d.limits.timeout = parse_duration(t)
                .ok_or_else(|| fail("InvalidLimits", format!("plugin {}: limits.timeout {t:?} is not like 200ms or 2s", p.name)))?;
        }
    }
    Ok(d)
}

fn parse_duration(s: &str) -> Option<Duration> {
    if let Some(ms) = s.strip_suffix("ms") {
        return ms.parse().ok().map(Duration::from_millis);
    }
    s.strip_suffix('s')?.parse().ok().map(Duration::from_secs)
}

/// Every plugin fetched and verified (digest checked, component compiled and
/// of the declared world); the placement rules loaded and asked for every
/// role. Returns the placements and the digests for the status.
pub async fn resolve_and_place(
    client: &Client,
    runtime: &PluginRuntime,
    r: &Resolved,
    annotations: &BTreeMap<String, String>,
) -> Result<(Placements, Vec<ResolvedPlugin>), PluginFailure> {
    let mut digests = Vec::with_capacity(r.plugins.len());
    let mut rules = Vec::new();
    for p in &r.plugins {
        let (origin, bytes) = fetch(client, &r.namespace, p).await?;
        let sha = sha256_hex(&bytes);
        if let Some(want) = &p.sha256 {
            if !want.eq_ignore_ascii_case(&sha) {
                return Err(fail("DigestMismatch", format!("plugin {}: {origin} has sha256 {sha}, the spec pins {want}", p.name)));
            }
        }
        digests.push(ResolvedPlugin { name: p.name.clone(), source: origin.clone(), sha256: sha });
        let d = decl(p, origin, bytes)?;
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
            Some(Err(e)) => return Err(fail("LoadFailed", format!("plugin {}: {e}", p.name))),
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
                .map_err(|e| fail("PlacementRuleFailed", format!("placing the {role} pods: {e}")))?;
            let json = crate::scheduling::to_pod_spec_json(&placement);
            let part = RolePlacement::from_pod_spec_json(&json)
                .map_err(|e| fail("PlacementRuleFailed", format!("placing the {role} pods: unreadable placement: {e}")))?;
            merged = merge(merged, part);
        }
        match role {
            ROLE_CACHE => placements.cache = merged,
            _ => placements.etcd = merged,
        }
    }
    Ok((placements, digests))
}

/// Combines the output of several placement rules: every constraint of
/// every rule holds. Required node terms are ANDed (each term of one rule
/// combined with each term of the other), everything else is concatenated.
fn merge(a: RolePlacement, b: RolePlacement) -> RolePlacement {
    use k8s_openapi::api::core::v1::{Affinity, NodeAffinity, NodeSelector, NodeSelectorTerm};
    let affinity = match (a.affinity, b.affinity) {
        (None, x) | (x, None) => x,
        (Some(x), Some(y)) => {
            let node = match (x.node_affinity, y.node_affinity) {
                (None, n) | (n, None) => n,
                (Some(n1), Some(n2)) => {
                    let required = match (n1.required_during_scheduling_ignored_during_execution, n2.required_during_scheduling_ignored_during_execution) {
                        (None, r) | (r, None) => r,
                        (Some(s1), Some(s2)) => {
                            let mut terms = Vec::new();
                            for t1 in &s1.node_selector_terms {
                                for t2 in &s2.node_selector_terms {
                                    let mut exprs = t1.match_expressions.clone().unwrap_or_default();
                                    exprs.extend(t2.match_expressions.clone().unwrap_or_default());
                                    terms.push(NodeSelectorTerm { match_expressions: Some(exprs), ..Default::default() });
                                }
                            }
                            Some(NodeSelector { node_selector_terms: terms })
                        }
                    };
                    let mut preferred = n1.preferred_during_scheduling_ignored_during_execution.unwrap_or_default();
                    preferred.extend(n2.preferred_during_scheduling_ignored_during_execution.unwrap_or_default());
                    Some(NodeAffinity {
                        required_during_scheduling_ignored_during_execution: required,
                        preferred_during_scheduling_ignored_during_execution: (!preferred.is_empty()).then_some(preferred),
                    })
                }
            };
            let pod = concat_pod_affinity(x.pod_affinity, y.pod_affinity);
            let anti = concat_pod_anti_affinity(x.pod_anti_affinity, y.pod_anti_affinity);
            Some(Affinity { node_affinity: node, pod_affinity: pod, pod_anti_affinity: anti })
        }
    };
    let mut tolerations = a.tolerations;
    tolerations.extend(b.tolerations);
    let mut topology_spread = a.topology_spread;
    topology_spread.extend(b.topology_spread);
    RolePlacement { affinity, tolerations, topology_spread }
}

fn concat<T>(a: Option<Vec<T>>, b: Option<Vec<T>>) -> Option<Vec<T>> {
    match (a, b) {
        (None, x) | (x, None) => x,
        (Some(mut x), Some(y)) => {
            x.extend(y);
            Some(x)
        }
    }
}

fn concat_pod_affinity(
    a: Option<k8s_openapi::api::core::v1::PodAffinity>,
    b: Option<k8s_openapi::api::core::v1::PodAffinity>,
) -> Option<k8s_openapi::api::core::v1::PodAffinity> {
    match (a, b) {
        (None, x) | (x, None) => x,
        (Some(x), Some(y)) => Some(k8s_openapi::api::core::v1::PodAffinity {
            required_during_scheduling_ignored_during_execution: concat(
                x.required_during_scheduling_ignored_during_execution,
                y.required_during_scheduling_ignored_during_execution,
            ),
            preferred_during_scheduling_ignored_during_execution: concat(
                x.preferred_during_scheduling_ignored_during_execution,
                y.preferred_during_scheduling_ignored_during_execution,
            ),
        }),
    }
}

fn concat_pod_anti_affinity(
    a: Option<k8s_openapi::api::core::v1::PodAntiAffinity>,
    b: Option<k8s_openapi::api::core::v1::PodAntiAffinity>,
) -> Option<k8s_openapi::api::core::v1::PodAntiAffinity> {
    match (a, b) {
        (None, x) | (x, None) => x,
        (Some(x), Some(y)) => Some(k8s_openapi::api::core::v1::PodAntiAffinity {
            required_during_scheduling_ignored_during_execution: concat(
                x.required_during_scheduling_ignored_during_execution,
                y.required_during_scheduling_ignored_during_execution,
            ),
            preferred_during_scheduling_ignored_during_execution: concat(
                x.preferred_during_scheduling_ignored_during_execution,
                y.preferred_during_scheduling_ignored_during_execution,
            ),
        }),
    }
}
