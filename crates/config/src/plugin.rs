//! A plugin declaration: which world, where its component comes from, the
//! digest it must have, its configuration, limits and failure policy, and
//! what it may reach.
//!
//! The same struct is a KVCache's `spec.plugins[]`, an entry of the node
//! configuration file the operator renders, and what the node and the plugin
//! runtime read back: there is nothing to keep in sync by hand.

use std::collections::BTreeMap;
use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::size::parse_bytes;

/// Which world a plugin implements.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum PluginKind {
    Backend,
    KeyPlacement,
    Retry,
    PlacementRule,
}

impl PluginKind {
    /// The name a declaration spells (`kind: keyPlacement`).
    pub fn name(self) -> &'static str {
        match self {
            PluginKind::Backend => "backend",
            PluginKind::KeyPlacement => "keyPlacement",
            PluginKind::Retry => "retry",
            PluginKind::PlacementRule => "placementRule",
        }
    }
}

/// Whether a failing plugin's error reaches the caller.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum FailurePolicy {
    /// The error reaches the caller (and, for placement rules, the status).
    #[default]
    FailClosed,
    /// The caller gets the documented default (a miss, no constraints).
    FailOpen,
}

/// One plugin.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PluginSpec {
    #[schemars(length(min = 1, max = 63), regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"))]
    pub name: String,
    pub kind: PluginKind,
    pub source: PluginSourceSpec,
    /// Hex sha256 of the component; checked before it is compiled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[0-9a-f]{64}$"))]
    pub sha256: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub config: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<PluginLimits>,
    #[serde(default)]
    pub failure_policy: FailurePolicy,
    /// What the plugin may connect to: `host:port`, `host:*` (any port),
    /// an address or CIDR with a port (`10.0.0.0/8:6379`, `[fd00::]/8:*`),
    /// or `unix:/path/to.sock`. Names are resolved by the host and every
    /// address is checked before connecting.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allowed_endpoints: Vec<String>,
    /// Native driver libraries (see include/kvplane_driver.h) the plugin may
    /// open through the contract's `driver` interface, by name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub drivers: Vec<DriverRef>,
}

/// A driver a backend plugin may open.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DriverRef {
    /// The name the plugin opens it by (`driver.session.open(name, ...)`).
    #[schemars(length(min = 1, max = 63))]
    pub name: String,
    /// Absolute path of the shared library on the node (in its image).
    #[schemars(regex(pattern = r"^/"))]
    pub path: String,
}

/// Exactly one of the four sources.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{"message": "source: set exactly one of builtin, configMap, oci, url", "rule": "[has(self.builtin), has(self.configMap), has(self.oci), has(self.url)].filter(x, x).size() == 1"}]))]
pub struct PluginSourceSpec {
    /// A plugin built into the host: ring, backoff, gpu-affinity, resp.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub builtin: Option<String>,
    /// A key of a ConfigMap's binaryData in the KVCache's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_map: Option<ConfigMapKeyRef>,
    /// An OCI artifact reference (Wasm OCI layout, layer media type application/wasm).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oci: Option<String>,
    /// An http(s) URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^https?://"))]
    pub url: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ConfigMapKeyRef {
    pub name: String,
    pub key: String,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PluginLimits {
    /// Memory cap per instance, a Kubernetes quantity (`64Mi`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<String>,
    /// Deadline per call (`200ms`, `2s`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[0-9]+(ms|s)$"))]
    pub timeout: Option<String>,
    /// Open connections per instance (default 16).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connections: Option<u32>,
    /// Bytes queued for sending per instance before `flush` (default 64Mi).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queued_bytes: Option<String>,
    /// Buffer handles an instance may hold at once (default 4096).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buffers: Option<u32>,
    /// Bytes of host buffers an instance may allocate (`read-buffer`) and hold
    /// at once (default 256Mi).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buffer_bytes: Option<String>,
    /// Handles of any kind (connections, buffers, driver sessions) in an
    /// instance's resource table (default 8192).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handles: Option<u32>,
    /// Distinct metric series the plugin may report (default 256).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metric_series: Option<u32>,
    /// Instances kept, and calls run at once, for this plugin (default 4);
    /// a further call waits for an instance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_instances: Option<u32>,
    /// Log records the plugin may write per second, over all its instances
    /// (default 100); more are dropped and counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_records_per_second: Option<u32>,
    /// Log records the plugin may write at once above its rate (default 1000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_burst: Option<u32>,
}

impl PluginLimits {
    /// The memory cap in bytes, if one is set.
    pub fn memory_bytes(&self) -> Result<Option<u64>, String> {
        self.memory.as_deref().map(|m| parse_bytes(m).map_err(|e| format!("limits.memory: {e}"))).transpose()
    }

    /// `queuedBytes`, if set.
    pub fn queued_bytes(&self) -> Result<Option<u64>, String> {
        self.queued_bytes.as_deref().map(|m| parse_bytes(m).map_err(|e| format!("limits.queuedBytes: {e}"))).transpose()
    }

    /// `bufferBytes`, if set.
    pub fn buffer_bytes(&self) -> Result<Option<u64>, String> {
        self.buffer_bytes.as_deref().map(|m| parse_bytes(m).map_err(|e| format!("limits.bufferBytes: {e}"))).transpose()
    }

    /// The per-call deadline, if one is set.
    pub fn timeout(&self) -> Result<Option<Duration>, String> {
        self.timeout
            .as_deref()
            .map(|t| parse_duration(t).ok_or_else(|| format!("limits.timeout {t:?} is not like 200ms or 2s")))
            .transpose()
    }
}

/// `200ms` or `2s`: the two spellings the CRD's pattern admits.
fn parse_duration(s: &str) -> Option<Duration> {
    if let Some(ms) = s.strip_suffix("ms") {
        return ms.parse().ok().map(Duration::from_millis);
    }
    s.strip_suffix('s')?.parse().ok().map(Duration::from_secs)
}

impl PluginSourceSpec {
    /// A builtin source, as `builtin:NAME` on the command line.
    pub fn builtin(name: impl Into<String>) -> PluginSourceSpec {
        PluginSourceSpec { builtin: Some(name.into()), ..Default::default() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_field_is_an_error_naming_it() {
        let e = crate::from_json_strict::<PluginSpec>(r#"{"name":"r","kind":"keyPlacement","source":{"builtin":"ring"},"replicas":3}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field replicas"), "{e}");
        let e = crate::from_json_strict::<PluginSpec>(r#"{"name":"r","kind":"keyPlacement","source":{"bultin":"ring"}}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field source.bultin"), "{e}");
    }

    #[test]
    fn limits_parse_with_the_shared_size_rules() {
        let l = PluginLimits { memory: Some("64Mi".into()), timeout: Some("200ms".into()), ..Default::default() };
        assert_eq!(l.memory_bytes(), Ok(Some(64 << 20)));
        assert_eq!(l.timeout(), Ok(Some(Duration::from_millis(200))));
        let bad = PluginLimits { memory: Some("64MB".into()), timeout: Some("2 minutes".into()), ..Default::default() };
        assert!(bad.memory_bytes().unwrap_err().contains("ambiguous"));
        assert!(bad.timeout().unwrap_err().contains("200ms"));
    }
}
