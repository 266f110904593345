//! The `KVCache` custom resource (`kvplane.io/v1alpha1`).
//!
//! The spec accepts AIBrix's KVCache fields under their AIBrix names — the
//! original `replicas` / `etcdReplicas` / `cacheSpec` / `service {type, port}`
//! shape and the newer `mode` / `metadata {etcd | redis}` / `cache` /
//! `watcher` / `service {type, ports}` shape — so an AIBrix manifest works
//! after changing only its `apiVersion`. kvplane's own fields are `backend`
//! and `plugins`. Where both shapes say the same thing (`cache` and
//! `cacheSpec`), [`crate::resolve`] documents which one wins.
//!
//! The YAML in `crds/` is generated from these types (`kvplane crd`), and a
//! test fails when the two disagree.

use k8s_openapi::api::core::v1::{EnvVar, ResourceRequirements, ServicePort};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
// The plugin declaration and the backend type are the configuration crate's,
// shared with the node that reads them back.
pub use kvplane_config::plugin::{ConfigMapKeyRef, FailurePolicy, PluginKind, PluginLimits, PluginSourceSpec, PluginSpec};
pub use kvplane_config::BackendType;
// The second tier's settings are the node file's own section: the operator
// writes them into the node's config as given, and checks them with the
// node's own validation (see `crate::resolve`), so the two cannot disagree.
pub use kvplane_config::{AtBound, IngestMode, TieringConfig, WriteMode};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A cache pool: its nodes, its metadata store (etcd), its services, its
/// second-tier backend and the plugins that decide policy.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[kube(
    group = "kvplane.io",
    version = "v1alpha1",
    kind = "KVCache",
    plural = "kvcaches",
    shortname = "kvc",
    namespaced,
    status = "KVCacheStatus",
    printcolumn = r#"{"name":"Backend","type":"string","jsonPath":".status.backend"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Replicas","type":"integer","jsonPath":".status.readyReplicas"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    validation = "!has(self.spec.cache) || !has(self.spec.cacheSpec) || !has(self.spec.cache.image) || !has(self.spec.cacheSpec.image) || self.spec.cache.image == self.spec.cacheSpec.image"
)]
#[serde(rename_all = "camelCase")]
pub struct KVCacheSpec {
    /// AIBrix: `centralized` or `distributed`. Accepted for compatibility;
    /// a kvplane pool is always distributed over its replicas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("enum" = ["centralized", "distributed"]))]
    pub mode: Option<String>,

    /// Cache pods (AIBrix's original field). `cache.replicas` wins when both are set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 1000))]
    pub replicas: Option<i32>,

    /// etcd members (AIBrix's original field). `metadata.etcd.replicas` wins when both are set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 9))]
    pub etcd_replicas: Option<i32>,

    /// The pool's metadata store: an etcd the operator runs (the default) or
    /// an external etcd / Redis.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<MetadataSpec>,

    /// The cache pods' container (AIBrix's original name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_spec: Option<RuntimeSpec>,

    /// The cache pods' container (AIBrix's newer name; wins over `cacheSpec`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<RuntimeSpec>,

    /// AIBrix's member-registration watcher. Accepted for compatibility;
    /// kvplane nodes register themselves, so no watcher pod is run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub watcher: Option<RuntimeSpec>,

    /// The RPC Service in front of the pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<ServiceSpec>,

    /// What serves the blocks. Default: `kvplane`, or `vineyard` when the
    /// cache image is a vineyardd image (an AIBrix manifest).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<BackendSpec>,

    /// Policy plugins (WebAssembly components). Without a placementRule
    /// plugin, `builtin:gpu-affinity` places the pods.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    #[x_kube(validation = Rule::new("self.all(p, self.exists_one(q, q.name == p.name))").message("plugins: every plugin name must be unique"))]
    pub plugins: Vec<PluginSpec>,

    /// How the cache pods use the second tier (a redis or eic store, or a
    /// declared backend plugin): which PUTs are copied (`mode`), when such a
    /// PUT is answered (`write: behind` from memory, or `through` once the
    /// store holds it too, which needs mode `all` and a failClosed backend),
    /// the in-flight bound and what a PUT does at it, the deadline and the
    /// writers. Written into the node's config as given; absent: the node's
    /// defaults whenever there is a second tier. Refused for a vineyard pool
    /// (vineyardd is not a kvplane node) and without a backend.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tiering: Option<TieringConfig>,

    /// The credentials clients present to the cache pods. Without it the
    /// operator generates a token Secret, `NAME-token`: a pool is never
    /// deployed open.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<AuthSpec>,

    /// TLS on the cache pods' client port, from a `kubernetes.io/tls`
    /// Secret (what a cert-manager Certificate writes). The token of
    /// `auth` is still required: TLS keeps the wire private, the token (or
    /// a client certificate, `clientCA`) says who may use the cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsSpec>,
}

/// The cache pods' certificate, and optionally the CA of their clients'.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TlsSpec {
    /// A Secret of type `kubernetes.io/tls` in the KVCache's namespace:
    /// `tls.crt` (the chain, leaf first) and `tls.key`. cert-manager's
    /// `Certificate.spec.secretName`. Its names must include the ones
    /// clients connect by (`NAME-rpc.NAMESPACE.svc`); a renewed
    /// certificate reaches new connections without a restart.
    pub secret_name: String,
    /// Mutual TLS: clients must present a certificate signed by this CA.
    #[serde(default, rename = "clientCA", skip_serializing_if = "Option::is_none")]
    pub client_ca: Option<ClientCaSpec>,
}

/// Where the CA of client certificates is: a Secret key (cert-manager's
/// `ca.crt`, beside `tls.crt`, when one issuer signs servers and clients)
/// or a ConfigMap key (a trust-manager Bundle's target). Exactly one.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClientCaSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_map_name: Option<String>,
    /// The key holding the PEM CA certificates.
    #[serde(default = "default_ca_key")]
    pub key: String,
}

fn default_ca_key() -> String {
    "ca.crt".into()
}

/// How clients authenticate to a kvplane pool.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AuthSpec {
    /// Name of an existing Secret in the KVCache's namespace holding the
    /// bearer token under the key `token`. Unset: the operator creates
    /// `NAME-token` once, with a random token, and never rotates it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub token_secret_ref: Option<String>,
    /// Name of a Secret in the KVCache's namespace holding a tenants file
    /// (docs/security.md, "Tenants") under the key `tenants.json`. Given,
    /// every client authenticates as one of its tenants, sees that
    /// tenant's keys only and is held to its quotas; the pool's token
    /// (`tokenSecretRef`, or the one generated) is then the members'
    /// cluster token, for the cache pods only, never for engines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub tenants_secret_ref: Option<String>,
}

/// Where the pool keeps its metadata.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!(has(self.etcd) && has(self.redis))").message("metadata: set etcd or redis, not both"))]
pub struct MetadataSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd: Option<MetadataStoreSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redis: Option<MetadataStoreSpec>,
}

/// One metadata store: run by the operator, or external. Both AIBrix shapes
/// are accepted: `{image, replicas, resources, storage}` and
/// `{runtime: {...}, externalConnection: {...}}`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.externalConnection) || (!has(self.runtime) && !has(self.image))").message("an external metadata store is not also run by the operator: drop runtime/image or externalConnection"))]
#[x_kube(validation = Rule::new("!has(self.externalConnection) || !has(self.tls)").message("tls is for the etcd the operator runs; an external etcd's TLS is externalConnection.tls"))]
pub struct MetadataStoreSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 9))]
    pub replicas: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Persistent storage per member; without it members use an emptyDir.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage: Option<StorageSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<RuntimeSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_connection: Option<ExternalConnection>,
    /// etcd run by the operator only: TLS on its client and peer ports,
    /// with client certificates required. Without it the members speak
    /// plain HTTP, and only the pool's own pods may reach them (the
    /// operator renders a NetworkPolicy either way).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<OperatedEtcdTlsSpec>,
}

/// TLS for the etcd the operator runs (`metadata.etcd.tls`). Whoever can
/// write the pool's etcd decides where its clients send their blocks, so
/// the members require a client certificate from everyone: each other, and
/// the cache pods.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct OperatedEtcdTlsSpec {
    /// A `kubernetes.io/tls` Secret (`tls.crt`, `tls.key`, `ca.crt`: what a
    /// cert-manager Certificate writes): the members' certificate, for DNS
    /// names `*.NAME-etcd.NAMESPACE.svc` and `NAME-etcd-client.NAMESPACE.svc`,
    /// with both the server auth and the client auth usage (members dial
    /// each other with it, and etcd's gateway dials its own gRPC port with
    /// it). Its `ca.crt` is the CA every client certificate must chain to.
    #[schemars(length(min = 1, max = 253))]
    pub secret_name: String,
    /// The certificate the cache pods present to the members (client auth,
    /// from the same CA); unset: `secretName`'s own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub client_secret_name: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StorageSpec {
    /// A Kubernetes quantity, e.g. `10Gi`.
    pub size: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_class_name: Option<String>,
}

/// A store that lives outside the cluster (or outside this KVCache).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExternalConnection {
    /// `host:port`.
    #[schemars(length(min = 1))]
    pub address: String,
    /// Name of a Secret in the KVCache's namespace holding the password
    /// under the key `password`. For an etcd, the password of `username`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_secret_ref: Option<String>,
    /// etcd only: the etcd user (`etcdctl user add`) the cache pods
    /// authenticate as; its role must read and write
    /// `/kvplane/NAMESPACE.NAME/`. Needs `passwordSecretRef`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    /// etcd only: TLS to the external etcd.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<EtcdTlsSpec>,
}

/// TLS to an external etcd, from one Secret: `ca.crt` (the CA of etcd's
/// certificate) and, for an etcd with `--client-cert-auth`, `tls.crt` and
/// `tls.key` (a client certificate; with etcd's authentication enabled it
/// must have no Common Name, which etcd's JSON gateway refuses).
/// cert-manager's Certificate Secret has exactly these keys.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EtcdTlsSpec {
    pub secret_name: String,
    /// Present `tls.crt`/`tls.key` as a client certificate (default true);
    /// false: the Secret needs only `ca.crt`.
    #[serde(default = "default_true")]
    pub client_certificate: bool,
}

fn default_true() -> bool {
    true
}

/// A container the operator runs (AIBrix's `RuntimeSpec` / `CacheSpec`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RuntimeSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 1000))]
    pub replicas: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("enum" = ["Always", "IfNotPresent", "Never"]))]
    pub image_pull_policy: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVar>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// AIBrix's original shorthand for the memory request and limit (`"4Gi"`, or `"2"` meaning 2Gi).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<String>,
    /// AIBrix's original shorthand for the CPU request and limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<String>,
    /// AIBrix's original shared-memory size for vineyardd (`--size`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_memory_size: Option<String>,
}

/// The RPC Service. `port` (AIBrix's original) or `ports` (its newer form).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!(has(self.port) && has(self.ports))").message("service: set port or ports, not both"))]
pub struct ServiceSpec {
    /// `ClusterIP` (default), `NodePort` or `LoadBalancer`.
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    #[schemars(extend("enum" = ["ClusterIP", "NodePort", "LoadBalancer"]))]
    pub type_: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 30000, max = 32767))]
    pub node_port: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub ports: Option<Vec<ServicePort>>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.type in ['kvplane', 'vineyard'] || size(self.endpoints) > 0").message("backend.endpoints: a redis or eic backend needs the store's endpoints (host:port)"))]
pub struct BackendSpec {
    #[serde(rename = "type")]
    pub type_: BackendType,
    /// `host:port` of an external store.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub endpoints: Vec<String>,
    /// Secret holding the store's credentials.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<SecretKeyRef>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyRef {
    pub name: String,
    #[serde(default = "default_password_key")]
    pub key: String,
}

fn default_password_key() -> String {
    "password".into()
}

/// What the operator observed.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KVCacheStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The backend in effect (after defaulting).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// Cache pods asked for.
    #[serde(default)]
    pub replicas: i32,
    /// Cache pods ready.
    #[serde(default)]
    pub ready_replicas: i32,
    /// Where clients connect: the RPC Service's in-cluster addresses.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub endpoints: Vec<String>,
    /// Every declared plugin with the digest it resolved to.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub plugins: Vec<ResolvedPlugin>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResolvedPlugin {
    pub name: String,
    pub source: String,
    pub sha256: String,
}
