//! A node's configuration file: what serves blocks behind the memory tier,
//! where the pool's metadata lives, the memory tier's size and the plugins
//! the node loads.
//!
//! The operator renders this struct into the KVCache's ConfigMap
//! (`node.json`), a person may write one by hand, and `kvplane node --config`
//! reads it back through [`crate::from_json_strict`]: one struct, so the
//! writer and the reader cannot drift apart. Flags given on the command line
//! win over the file.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::plugin::PluginSpec;
use crate::size::ByteSize;

/// What serves the blocks.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum BackendType {
    /// kvplane nodes with their memory tier only.
    Kvplane,
    /// vineyardd pods (the AIBrix data plane).
    Vineyard,
    /// kvplane nodes backed by an external Redis / Valkey (`builtin:resp` unless a backend plugin is declared).
    Redis,
    /// kvplane nodes backed by Volcano Engine EIC (needs a backend plugin).
    Eic,
}

impl BackendType {
    pub fn name(self) -> &'static str {
        match self {
            BackendType::Kvplane => "kvplane",
            BackendType::Vineyard => "vineyard",
            BackendType::Redis => "redis",
            BackendType::Eic => "eic",
        }
    }
}

/// Where the pool keeps its metadata (membership, leases).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum MetadataEndpoints {
    /// etcd client URLs.
    Etcd(Vec<String>),
    /// A Redis `host:port`.
    Redis(String),
}

/// The configuration file of one node.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeConfigFile {
    /// What serves blocks behind the memory tier.
    pub backend: BackendType,
    /// `host:port` of the external store (redis, eic).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub backend_endpoints: Vec<String>,
    /// The pool's metadata store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<MetadataEndpoints>,
    /// Size of the memory tier (`--memory` wins when given).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<ByteSize>,
    /// Plugins the node fetches, verifies by digest and compiles before serving.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub plugins: Vec<PluginSpec>,
}

impl Default for NodeConfigFile {
    fn default() -> Self {
        NodeConfigFile { backend: BackendType::Kvplane, backend_endpoints: Vec::new(), metadata: None, memory: None, plugins: Vec::new() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugin::{PluginKind, PluginSourceSpec};

    #[test]
    fn a_rendered_file_reads_back_equal() {
        let file = NodeConfigFile {
            backend: BackendType::Redis,
            backend_endpoints: vec!["redis.cache:6379".into()],
            metadata: Some(MetadataEndpoints::Etcd(vec!["http://etcd:2379".into()])),
            memory: Some(ByteSize(4 << 30)),
            plugins: vec![PluginSpec {
                name: "ring".into(),
                kind: PluginKind::KeyPlacement,
                source: PluginSourceSpec::builtin("ring"),
                sha256: None,
                config: Default::default(),
                limits: None,
                failure_policy: Default::default(),
                allowed_endpoints: vec![],
                drivers: vec![],
            }],
        };
        let text = serde_json::to_string_pretty(&file).unwrap();
        assert!(text.contains("\"memory\": \"4Gi\""), "{text}");
        assert_eq!(crate::from_json_strict::<NodeConfigFile>(&text).unwrap(), file);
    }

    #[test]
    fn unknown_and_misspelt_fields_are_named() {
        let e = crate::from_json_strict::<NodeConfigFile>(
            r#"{"backend":"kvplane","port":9600,"plugins":[{"name":"r","kind":"retry","source":{"builtin":"backoff"},"limits":{"memroy":"1Mi"}}]}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("unknown field port"), "{e}");
        assert!(e.contains("plugins.0.limits.memroy"), "{e}");
        let e = crate::from_json_strict::<NodeConfigFile>(r#"{"backend":"kvplane","memory":"1GB"}"#).unwrap_err().to_string();
        assert!(e.contains("ambiguous"), "{e}");
    }
}
