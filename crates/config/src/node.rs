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

use crate::plugin::{PluginKind, PluginSpec};
use crate::size::ByteSize;

/// Environment variable holding the second tier's secret (the operator sets
/// it from `spec.backend.secretRef`); the node gives it to the backend
/// plugin as config `password` unless the declaration sets one.
pub const BACKEND_SECRET_ENV: &str = "KVPLANE_BACKEND_SECRET";

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
    /// How the memory tier uses the backend plugin (the second tier). Absent:
    /// the defaults of [`TieringConfig`] whenever a backend plugin is declared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tiering: Option<TieringConfig>,
    /// Cluster mode: register in the metadata store's etcd and own the keys
    /// the placement decides. Absent: a single node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<ClusterConfig>,
}

impl Default for NodeConfigFile {
    fn default() -> Self {
        NodeConfigFile {
            backend: BackendType::Kvplane,
            backend_endpoints: Vec::new(),
            metadata: None,
            memory: None,
            plugins: Vec::new(),
            tiering: None,
            cluster: None,
        }
    }
}

/// Which blocks a PUT copies into the second tier.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum IngestMode {
    /// Every PUT, written behind the reply (the second tier holds everything).
    #[default]
    All,
    /// Only blocks the memory tier is about to drop (a victim cache).
    OnEvict,
    /// Blocks read from the memory tier at least `hotReads` times.
    Hot,
}

/// When a PUT copied to the second tier (mode `all`) is answered.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum WriteMode {
    /// From memory at once; the copy is written behind the reply and
    /// retried across store outages and restarts until the store takes it
    /// (holding its bytes within `maxInFlight`). A node killed meanwhile
    /// loses what was queued.
    #[default]
    Behind,
    /// Once both tiers hold the block, or with the store's typed error (the
    /// block is then not stored in memory either). Needs mode `all` and a
    /// fail-closed backend.
    Through,
}

/// What a PUT does when the bytes waiting for the second tier reach the bound.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum AtBound {
    /// Wait for room: the client's PUT is slowed down to the backend's pace.
    #[default]
    Block,
    /// Do not copy the block to the second tier (counted as skipped).
    Skip,
}

/// The second tier's settings. A field left out takes its value from
/// [`TieringConfig::default`].
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct TieringConfig {
    /// Which PUTs are copied into the second tier.
    pub mode: IngestMode,
    /// When a copied PUT is answered: `behind` (from memory) or `through`
    /// (once the store holds it too).
    pub write: WriteMode,
    /// `hot` mode: reads from the memory tier before a block is copied.
    pub hot_reads: u32,
    /// Bytes on their way to the second tier at most (and at most an eighth
    /// of the memory tier: queued blocks keep their memory until written).
    pub max_in_flight: ByteSize,
    /// What a PUT does at that bound.
    pub at_bound: AtBound,
    /// Time one request may spend on the second tier, retries included.
    pub deadline_ms: u64,
    /// Concurrent batches written to the second tier.
    pub writers: u32,
    /// The backend plugin to use (by name); default: the one declared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// The retry-policy plugin (by name); default: the one declared, else
    /// the node's own (retry unavailable/timeout/busy twice with backoff).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<String>,
}

impl Default for TieringConfig {
    fn default() -> Self {
        TieringConfig {
            mode: IngestMode::All,
            write: WriteMode::Behind,
            hot_reads: 2,
            max_in_flight: ByteSize(64 << 20),
            at_bound: AtBound::Block,
            deadline_ms: 2000,
            writers: 2,
            backend: None,
            retry: None,
        }
    }
}

/// Cluster mode. A field left out takes its value from
/// [`ClusterConfig::default`].
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct ClusterConfig {
    /// Nodes with the same name (and etcd) form one cluster.
    pub name: String,
    /// This node's id; default: the `POD_NAME` environment variable, else the host name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
    /// `host:port` clients reach this node at; default: the listen address
    /// (with `POD_IP` for an unspecified host).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub advertise: Option<String>,
    /// Failure domain, for placements that spread replicas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
    /// Relative share of keys.
    pub weight: u32,
    /// Owners per key.
    pub replicas: u32,
    /// Owners that must store a PUT before the client is answered; default: `replicas`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub write_quorum: Option<u32>,
    /// A node whose lease is not renewed for this long leaves the cluster.
    pub lease_ttl_seconds: u64,
    /// The key-placement plugin (by name); default: the one declared, else
    /// the native ring.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<String>,
    /// Bytes per second this node sends to other members when it copies
    /// keys to their new owners after a membership change (repair), so
    /// that healing a cluster does not starve the clients it serves.
    pub repair_bytes_per_second: ByteSize,
    /// How the node reaches `metadata.etcd`: TLS and an etcd user. Absent:
    /// plain HTTP, no user (an etcd on a network only the pool reaches).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd: Option<EtcdClientConfig>,
    /// TLS to the other members, for a node that serves TLS (`--tls-cert`):
    /// members copy blocks to each other (hand-off at drain, repair after a
    /// membership change) and a member's TLS port refuses a plain client.
    /// Required in cluster mode with `--tls-cert`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer_tls: Option<PeerTlsConfig>,
}

/// `cluster.peerTls`: how a member speaks TLS to the others. PEM files,
/// read when the node starts and again for each hand-off or repair pass
/// (so that a renewed client certificate is used without a restart).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PeerTlsConfig {
    /// CA certificates the other members' certificates must chain to.
    pub ca_file: std::path::PathBuf,
    /// The client certificate presented to members that ask for one
    /// (`--tls-client-ca`: required then), with `keyFile`. Usually the
    /// node's own certificate, which then needs the client-auth usage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_file: Option<std::path::PathBuf>,
    /// The private key of `certFile`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_file: Option<std::path::PathBuf>,
    /// The name every member's certificate is checked against; default: the
    /// host of the member's advertised address (an IP address then, which
    /// changes with every pod restart: give a name all members' certificates
    /// carry instead).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_name: Option<String>,
}

/// The node's etcd client: `cluster.etcd`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EtcdClientConfig {
    /// TLS to etcd's client port (`metadata.etcd` endpoints are then
    /// `https://` or `host:port`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<EtcdTlsConfig>,
    /// An etcd user, for an etcd with authentication enabled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<EtcdAuthConfig>,
}

/// `cluster.etcd.tls`: PEM files, read when the node starts.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EtcdTlsConfig {
    /// CA certificates etcd's certificate must chain to.
    pub ca_file: std::path::PathBuf,
    /// The client certificate an etcd with `--client-cert-auth` checks
    /// (with `keyFile`). With etcd's authentication enabled it must carry
    /// no Common Name: etcd's JSON gateway, which kvplane speaks, refuses
    /// one rather than ignore the identity it names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_file: Option<std::path::PathBuf>,
    /// The private key of `certFile`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_file: Option<std::path::PathBuf>,
}

/// `cluster.etcd.auth`: an etcd user whose role reads and writes
/// `/kvplane/<cluster.name>/`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EtcdAuthConfig {
    pub username: String,
    /// A file holding the password (one line; a trailing newline is not
    /// part of it), so that the password is never in the configuration.
    pub password_file: std::path::PathBuf,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            name: "kvplane".into(),
            node_id: None,
            advertise: None,
            zone: None,
            weight: 100,
            replicas: 2,
            write_quorum: None,
            lease_ttl_seconds: 10,
            placement: None,
            repair_bytes_per_second: ByteSize(256 << 20),
            etcd: None,
            peer_tls: None,
        }
    }
}

/// TLS on a node's client port: the certificate it presents and, for
/// mutual TLS, the CA its clients' certificates must chain to. Paths of PEM
/// files, read again every `reloadIntervalSeconds` so that a certificate
/// rotated in place (cert-manager, a Kubernetes `kubernetes.io/tls` Secret)
/// is served without a restart. The node's `--tls-cert`, `--tls-key`,
/// `--tls-client-ca` and `--tls-reload-interval` flags fill it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TlsConfig {
    /// The certificate chain the node presents, leaf first (`tls.crt`).
    pub cert_file: std::path::PathBuf,
    /// The certificate's private key: PKCS#8, PKCS#1 or SEC1 (`tls.key`).
    pub key_file: std::path::PathBuf,
    /// CA certificates a client's certificate must chain to. Given, every
    /// client must present one (mutual TLS); absent, none is asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_ca_file: Option<std::path::PathBuf>,
    /// How often the files are read again for a rotated certificate.
    #[serde(default = "TlsConfig::default_reload_interval_seconds")]
    pub reload_interval_seconds: u64,
}

impl TlsConfig {
    /// Seconds between two reads of the files: a rotation reaches new
    /// handshakes within this, and three small reads a period cost nothing.
    pub const DEFAULT_RELOAD_INTERVAL_SECONDS: u64 = 10;

    fn default_reload_interval_seconds() -> u64 {
        Self::DEFAULT_RELOAD_INTERVAL_SECONDS
    }

    /// Checks what the types cannot, naming the field.
    pub fn validate(&self) -> Result<(), InvalidField> {
        if self.reload_interval_seconds == 0 {
            return Err(invalid("tls.reloadIntervalSeconds", "must be at least 1"));
        }
        Ok(())
    }
}

/// A setting that parses but cannot work, named by its path in the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct InvalidField {
    pub field: String,
    pub message: String,
}

fn invalid(field: &str, message: impl Into<String>) -> InvalidField {
    InvalidField { field: field.into(), message: message.into() }
}

impl NodeConfigFile {
    /// Checks what the types cannot: references between fields, ranges.
    pub fn validate(&self) -> Result<(), InvalidField> {
        let declared = |kind: PluginKind| self.plugins.iter().filter(move |p| p.kind == kind);
        let named = |field: &str, name: &Option<String>, kind: PluginKind| -> Result<(), InvalidField> {
            match name {
                Some(n) if !declared(kind).any(|p| &p.name == n) => {
                    let have: Vec<&str> = declared(kind).map(|p| p.name.as_str()).collect();
                    Err(invalid(field, format!("no plugin of kind {} named {n:?} is declared (declared: {have:?})", kind.name())))
                }
                None if declared(kind).count() > 1 => Err(invalid(
                    field,
                    format!("{} plugins of kind {} are declared; name the one to use", declared(kind).count(), kind.name()),
                )),
                _ => Ok(()),
            }
        };
        if let Some(t) = &self.tiering {
            if declared(PluginKind::Backend).next().is_none() {
                return Err(invalid("tiering", "no backend plugin (kind: backend) is declared to serve the second tier"));
            }
            named("tiering.backend", &t.backend, PluginKind::Backend)?;
            named("tiering.retry", &t.retry, PluginKind::Retry)?;
            if t.hot_reads == 0 {
                return Err(invalid("tiering.hotReads", "must be at least 1"));
            }
            if t.max_in_flight.bytes() == 0 {
                return Err(invalid("tiering.maxInFlight", "must be above 0"));
            }
            if t.deadline_ms == 0 {
                return Err(invalid("tiering.deadlineMs", "must be above 0"));
            }
            if t.writers == 0 || t.writers > 64 {
                return Err(invalid("tiering.writers", format!("{} is outside 1..=64", t.writers)));
            }
            if t.write == WriteMode::Through {
                if t.mode != IngestMode::All {
                    return Err(invalid(
                        "tiering.write",
                        "through applies to mode all (a PUT waits for the store); on-evict and hot copy blocks after the PUT was answered",
                    ));
                }
                let backend = declared(PluginKind::Backend).find(|p| t.backend.as_ref().is_none_or(|n| &p.name == n));
                if let Some(b) = backend.filter(|b| b.failure_policy == crate::FailurePolicy::FailOpen) {
                    return Err(invalid(
                        "tiering.write",
                        format!(
                            "through needs the backend's failurePolicy failClosed (plugin {:?} is failOpen: a failed write would be skipped and the PUT acknowledged)",
                            b.name
                        ),
                    ));
                }
            }
        } else {
            named("plugins", &None, PluginKind::Backend)?;
        }
        if let Some(c) = &self.cluster {
            if !matches!(&self.metadata, Some(MetadataEndpoints::Etcd(e)) if !e.is_empty()) {
                return Err(invalid("metadata", "cluster mode needs etcd endpoints (metadata: {etcd: [...]})"));
            }
            if c.name.is_empty() || c.name.contains('/') {
                return Err(invalid("cluster.name", format!("{:?} must be non-empty and contain no '/'", c.name)));
            }
            if c.replicas == 0 {
                return Err(invalid("cluster.replicas", "must be at least 1"));
            }
            if let Some(w) = c.write_quorum {
                if w == 0 || w > c.replicas {
                    return Err(invalid("cluster.writeQuorum", format!("{w} is outside 1..={} (cluster.replicas)", c.replicas)));
                }
            }
            if c.lease_ttl_seconds == 0 {
                return Err(invalid("cluster.leaseTtlSeconds", "must be at least 1"));
            }
            if c.weight == 0 {
                return Err(invalid("cluster.weight", "must be above 0"));
            }
            if c.repair_bytes_per_second.0 == 0 {
                return Err(invalid("cluster.repairBytesPerSecond", "must be above 0 (a repair that may send nothing never ends)"));
            }
            named("cluster.placement", &c.placement, PluginKind::KeyPlacement)?;
            self.validate_etcd_client(c.etcd.as_ref())?;
            if let Some(t) = &c.peer_tls {
                if t.ca_file.as_os_str().is_empty() {
                    return Err(invalid("cluster.peerTls.caFile", "names no file"));
                }
                match (&t.cert_file, &t.key_file) {
                    (Some(_), None) => return Err(invalid("cluster.peerTls.keyFile", "certFile needs the key that goes with it")),
                    (None, Some(_)) => return Err(invalid("cluster.peerTls.certFile", "keyFile needs the certificate that goes with it")),
                    _ => {}
                }
                if t.server_name.as_ref().is_some_and(|n| n.trim().is_empty()) {
                    return Err(invalid("cluster.peerTls.serverName", "is empty (leave it out to check the advertised host)"));
                }
            }
        }
        Ok(())
    }

    /// `cluster.etcd` against itself and the endpoints' schemes: `https://`
    /// exactly with TLS, so neither setting is silently ignored.
    fn validate_etcd_client(&self, etcd: Option<&EtcdClientConfig>) -> Result<(), InvalidField> {
        let tls = etcd.and_then(|e| e.tls.as_ref());
        if let Some(t) = tls {
            if t.ca_file.as_os_str().is_empty() {
                return Err(invalid("cluster.etcd.tls.caFile", "names no file"));
            }
            match (&t.cert_file, &t.key_file) {
                (Some(_), None) => return Err(invalid("cluster.etcd.tls.keyFile", "certFile needs the key that goes with it")),
                (None, Some(_)) => return Err(invalid("cluster.etcd.tls.certFile", "keyFile needs the certificate that goes with it")),
                _ => {}
            }
        }
        if let Some(a) = etcd.and_then(|e| e.auth.as_ref()) {
            if a.username.trim().is_empty() {
                return Err(invalid("cluster.etcd.auth.username", "names no user"));
            }
            if a.password_file.as_os_str().is_empty() {
                return Err(invalid("cluster.etcd.auth.passwordFile", "names no file"));
            }
        }
        if let Some(MetadataEndpoints::Etcd(endpoints)) = &self.metadata {
            for (i, e) in endpoints.iter().enumerate() {
                if tls.is_some() && e.starts_with("http://") {
                    return Err(invalid(
                        &format!("metadata.etcd[{i}]"),
                        format!("{e:?} is plain HTTP, and cluster.etcd.tls is set: use https://"),
                    ));
                }
                if tls.is_none() && e.starts_with("https://") {
                    return Err(invalid(
                        "cluster.etcd.tls.caFile",
                        format!("metadata.etcd[{i}] {e:?} is https://: give the CA that signed etcd's certificate"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The tiering settings in effect: the file's, or the defaults when a
    /// backend plugin is declared without them; `None` without a backend.
    pub fn tiering_in_effect(&self) -> Option<TieringConfig> {
        match &self.tiering {
            Some(t) => Some(t.clone()),
            None => self.plugins.iter().any(|p| p.kind == PluginKind::Backend).then(TieringConfig::default),
        }
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
            tiering: Some(TieringConfig { mode: IngestMode::OnEvict, ..TieringConfig::default() }),
            cluster: None,
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
        let e = crate::from_json_strict::<NodeConfigFile>(r#"{"backend":"redis","tiering":{"mode":"sometimes"}}"#).unwrap_err().to_string();
        assert!(e.contains("sometimes") && e.contains("on-evict"), "{e}");
    }

    fn backend(name: &str) -> PluginSpec {
        PluginSpec {
            name: name.into(),
            kind: PluginKind::Backend,
            source: PluginSourceSpec::builtin("resp"),
            sha256: None,
            config: Default::default(),
            limits: None,
            failure_policy: Default::default(),
            allowed_endpoints: vec![],
            drivers: vec![],
        }
    }

    fn invalid_field(text: &str) -> String {
        let file = crate::from_json_strict::<NodeConfigFile>(text).unwrap();
        file.validate().unwrap_err().to_string()
    }

    #[test]
    fn settings_that_cannot_work_are_named_by_field() {
        let e = invalid_field(r#"{"backend":"redis","tiering":{}}"#);
        assert!(e.starts_with("tiering: no backend plugin"), "{e}");
        let plugins = r#""plugins":[{"name":"a","kind":"backend","source":{"builtin":"resp"}},{"name":"b","kind":"backend","source":{"builtin":"resp"}}]"#;
        let e = invalid_field(&format!(r#"{{"backend":"redis",{plugins}}}"#));
        assert!(e.starts_with("plugins: 2 plugins of kind backend"), "{e}");
        let e = invalid_field(&format!(r#"{{"backend":"redis",{plugins},"tiering":{{"backend":"c"}}}}"#));
        assert!(e.starts_with("tiering.backend: no plugin of kind backend named \"c\""), "{e}");
        let e = invalid_field(&format!(r#"{{"backend":"redis",{plugins},"tiering":{{"backend":"a","hotReads":0}}}}"#));
        assert!(e.starts_with("tiering.hotReads"), "{e}");
        let e = invalid_field(r#"{"backend":"kvplane","cluster":{}}"#);
        assert!(e.starts_with("metadata: cluster mode needs etcd"), "{e}");
        let e = invalid_field(
            r#"{"backend":"kvplane","metadata":{"etcd":["http://127.0.0.1:2379"]},"cluster":{"replicas":2,"writeQuorum":3}}"#,
        );
        assert!(e.starts_with("cluster.writeQuorum: 3 is outside 1..=2"), "{e}");
        let e =
            invalid_field(r#"{"backend":"kvplane","metadata":{"etcd":["http://127.0.0.1:2379"]},"cluster":{"repairBytesPerSecond":0}}"#);
        assert!(e.starts_with("cluster.repairBytesPerSecond: must be above 0"), "{e}");
        let etcd = |endpoint: &str, section: &str| {
            format!(r#"{{"backend":"kvplane","metadata":{{"etcd":["{endpoint}"]}},"cluster":{{"etcd":{section}}}}}"#)
        };
        let tls =
            r#"{"tls":{"caFile":"/ca.pem","certFile":"/c.crt","keyFile":"/c.key"},"auth":{"username":"kvplane","passwordFile":"/pw"}}"#;
        let file = crate::from_json_strict::<NodeConfigFile>(&etcd("https://etcd:2379", tls)).unwrap();
        file.validate().unwrap();
        let etcd_client = file.cluster.as_ref().and_then(|c| c.etcd.clone()).unwrap();
        assert_eq!(etcd_client.tls.unwrap().cert_file.as_deref(), Some(std::path::Path::new("/c.crt")));
        assert_eq!(etcd_client.auth.unwrap().username, "kvplane");
        for (endpoint, section, field) in [
            ("http://etcd:2379", tls, "metadata.etcd[0]: \"http://etcd:2379\" is plain HTTP"),
            ("https://etcd:2379", "{}", "cluster.etcd.tls.caFile: metadata.etcd[0]"),
            ("etcd:2379", r#"{"tls":{"caFile":"/ca.pem","certFile":"/c.crt"}}"#, "cluster.etcd.tls.keyFile: certFile needs"),
            ("etcd:2379", r#"{"auth":{"username":" ","passwordFile":"/pw"}}"#, "cluster.etcd.auth.username: names no user"),
        ] {
            let e = invalid_field(&etcd(endpoint, section));
            assert!(e.starts_with(field), "{e}");
        }
        let e = crate::from_json_strict::<NodeConfigFile>(&etcd("etcd:2379", r#"{"tls":{"caFile":"/c","keyfile":"/k"}}"#)).unwrap_err();
        assert!(e.to_string().contains("cluster.etcd.tls.keyfile"), "{e}");
        let peer =
            |section: &str| format!(r#"{{"backend":"kvplane","metadata":{{"etcd":["etcd:2379"]}},"cluster":{{"peerTls":{section}}}}}"#);
        let file = crate::from_json_strict::<NodeConfigFile>(&peer(
            r#"{"caFile":"/ca.crt","certFile":"/tls.crt","keyFile":"/tls.key","serverName":"pool-cache.ns.svc"}"#,
        ))
        .unwrap();
        file.validate().unwrap();
        let t = file.cluster.as_ref().and_then(|c| c.peer_tls.clone()).unwrap();
        assert_eq!(t.server_name.as_deref(), Some("pool-cache.ns.svc"));
        for (section, field) in [
            (r#"{"caFile":""}"#, "cluster.peerTls.caFile: names no file"),
            (r#"{"caFile":"/ca.crt","certFile":"/tls.crt"}"#, "cluster.peerTls.keyFile: certFile needs"),
            (r#"{"caFile":"/ca.crt","keyFile":"/tls.key"}"#, "cluster.peerTls.certFile: keyFile needs"),
            (r#"{"caFile":"/ca.crt","serverName":" "}"#, "cluster.peerTls.serverName: is empty"),
        ] {
            let e = invalid_field(&peer(section));
            assert!(e.starts_with(field), "{e}");
        }
        let ok = r#"{"backend":"kvplane","metadata":{"etcd":["http://127.0.0.1:2379"]},"cluster":{"repairBytesPerSecond":"64Mi"}}"#;
        let file = crate::from_json_strict::<NodeConfigFile>(ok).unwrap();
        assert_eq!(file.cluster.as_ref().map(|c| c.repair_bytes_per_second), Some(ByteSize(64 << 20)));
        let one = r#""plugins":[{"name":"a","kind":"backend","source":{"builtin":"resp"},"failurePolicy":"failOpen"}]"#;
        let e = invalid_field(&format!(r#"{{"backend":"redis",{one},"tiering":{{"write":"through","mode":"hot"}}}}"#));
        assert!(e.starts_with("tiering.write: through applies to mode all"), "{e}");
        let e = invalid_field(&format!(r#"{{"backend":"redis",{one},"tiering":{{"write":"through"}}}}"#));
        assert!(e.starts_with("tiering.write: through needs the backend's failurePolicy failClosed"), "{e}");
    }

    #[test]
    fn a_declared_backend_turns_tiering_on_with_defaults() {
        let mut file = NodeConfigFile::default();
        assert_eq!(file.tiering_in_effect(), None);
        file.plugins.push(backend("resp"));
        file.validate().unwrap();
        assert_eq!(file.tiering_in_effect(), Some(TieringConfig::default()));
    }
}
