//! kvplane's configuration vocabulary, shared by every part that reads or
//! writes it: [`size`] (one meaning of `1G` everywhere), [`plugin`] (a plugin
//! declaration) and [`node`] (a node's configuration file).
//!
//! The operator's CRD embeds these types, its renderer serializes a
//! [`node::NodeConfigFile`] into the KVCache's ConfigMap, and the node parses
//! the same struct back with [`from_json_strict`], so a field the node does
//! not know is an error naming it instead of a setting silently ignored.

pub mod node;
pub mod plugin;
pub mod size;
pub mod tenants;

pub use node::{
    AtBound, BackendType, ClusterConfig, EtcdAuthConfig, EtcdClientConfig, EtcdTlsConfig, IngestMode, InvalidField, MetadataEndpoints,
    NodeConfigFile, PeerTlsConfig, TieringConfig, TlsConfig, WriteMode,
};
pub use plugin::{DriverRef, FailurePolicy, PluginKind, PluginLimits, PluginSourceSpec, PluginSpec};
pub use size::{parse_bytes, ByteSize, SizeError};
pub use tenants::{TenantSpec, TenantsFile};

/// A configuration text that could not be read as the expected type.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Not valid JSON, or a field with the wrong type or value.
    #[error("{0}")]
    Syntax(#[from] serde_json::Error),
    /// Well-formed, but with fields the type does not have (a typo, or a
    /// setting from a newer version): every such path is named.
    #[error("unknown field {}", .0.join(", unknown field "))]
    UnknownFields(Vec<String>),
}

/// Parses JSON into `T`, refusing any field `T` does not declare (named by
/// its path, like `plugins.0.limits.memroy`).
///
/// `#[serde(deny_unknown_fields)]` would do the same for one struct, but it
/// also changes the JSON schema the CRD is generated from; collecting ignored
/// paths keeps the schema as Kubernetes wants it and names nested fields.
pub fn from_json_strict<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, ConfigError> {
    let mut unknown = Vec::new();
    let mut de = serde_json::Deserializer::from_str(text);
    let value: T = serde_ignored::deserialize(&mut de, |path| unknown.push(dotted(&path)))?;
    de.end()?;
    if unknown.is_empty() {
        Ok(value)
    } else {
        Err(ConfigError::UnknownFields(unknown))
    }
}

/// `plugins.0.limits.memroy`: map keys and sequence indices only (serde's
/// `Option` and newtype layers are not fields a person wrote).
fn dotted(path: &serde_ignored::Path<'_>) -> String {
    use serde_ignored::Path;
    match path {
        Path::Root => String::new(),
        Path::Seq { parent, index } => join(dotted(parent), &index.to_string()),
        Path::Map { parent, key } => join(dotted(parent), key),
        Path::Some { parent } | Path::NewtypeStruct { parent } | Path::NewtypeVariant { parent } => dotted(parent),
    }
}

fn join(parent: String, part: &str) -> String {
    if parent.is_empty() {
        part.to_owned()
    } else {
        format!("{parent}.{part}")
    }
}
