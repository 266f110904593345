//! The desired children of a KVCache: a pure function of the resolved spec
//! and the placement the rules produced, so it is unit-tested without a
//! cluster and the reconciler only has to apply what it returns.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{StatefulSet, StatefulSetSpec};
use k8s_openapi::api::core::v1::{
    Affinity, ConfigMap, ConfigMapProjection, ConfigMapVolumeSource, Container, ContainerPort, EmptyDirVolumeSource, EnvVar, EnvVarSource,
    HTTPGetAction, KeyToPath, ObjectFieldSelector, PersistentVolumeClaim, PersistentVolumeClaimSpec, PodSecurityContext, PodSpec,
    PodTemplateSpec, Probe, ProjectedVolumeSource, Secret, SecretKeySelector, SecretVolumeSource, Service, ServicePort, ServiceSpec,
    TCPSocketAction, Toleration, TopologySpreadConstraint, Volume, VolumeMount, VolumeProjection, VolumeResourceRequirements,
};
use k8s_openapi::api::networking::v1::{NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort, NetworkPolicySpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use sha2::{Digest, Sha256};

use super::resolve::{ClientCa, EtcdPlan, Metadata, OperatedEtcdTls, Resolved, TokenSecret, ADMIN_PORT, DEFAULT_PORT, TOKEN_KEY};
use kvplane_config::ClusterConfig;
use kvplane_config::{BackendType, ByteSize, MetadataEndpoints, NodeConfigFile};

/// Pod roles, as the placement-rule world names them.
pub(crate) const ROLE_CACHE: &str = "cache";
pub(crate) const ROLE_ETCD: &str = "etcd";

/// Label every child carries, naming its KVCache.
pub(crate) const LABEL_KVCACHE: &str = "kvplane.io/kvcache";
pub(crate) const LABEL_ROLE: &str = "kvplane.io/role";
/// Pod-template annotation that rolls the pool when its configuration changes.
pub(crate) const ANNOTATION_CONFIG_HASH: &str = "kvplane.io/config-hash";

/// Scheduling constraints for one role's pods: the pod-template fields
/// [`crate::scheduling::role_placement`] builds from a placement rule's answer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RolePlacement {
    pub affinity: Option<Affinity>,
    pub tolerations: Vec<Toleration>,
    pub topology_spread: Vec<TopologySpreadConstraint>,
}

/// Placement for every role of the pool.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Placements {
    pub cache: RolePlacement,
    pub etcd: RolePlacement,
}

/// Everything the operator creates for one KVCache.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Children {
    pub config: ConfigMap,
    pub etcd: Option<EtcdChildren>,
    pub cache: StatefulSet,
    pub cache_headless: Service,
    pub rpc: Service,
    /// The token Secret to create when absent (no `spec.auth.tokenSecretRef`),
    /// without its data: the reconciler generates the token once, and never
    /// applies it again, so a pass never rotates it.
    pub token: Option<Secret>,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct EtcdChildren {
    pub peers: Service,
    pub client: Service,
    pub members: StatefulSet,
    /// Who may reach the members: the pool's cache pods and each other.
    pub policy: NetworkPolicy,
}

/// One child object, whatever its kind: what the reconciler's single apply
/// path takes. A handful per KVCache, so the variants' sizes do not matter.
#[derive(Debug, Clone, PartialEq)]
#[allow(clippy::large_enum_variant)]
pub(crate) enum Child {
    ConfigMap(ConfigMap),
    Service(Service),
    StatefulSet(StatefulSet),
    NetworkPolicy(NetworkPolicy),
}

impl Child {
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Child::ConfigMap(_) => "ConfigMap",
            Child::Service(_) => "Service",
            Child::StatefulSet(_) => "StatefulSet",
            Child::NetworkPolicy(_) => "NetworkPolicy",
        }
    }

    pub(crate) fn name(&self) -> &str {
        let meta = match self {
            Child::ConfigMap(o) => &o.metadata,
            Child::Service(o) => &o.metadata,
            Child::StatefulSet(o) => &o.metadata,
            Child::NetworkPolicy(o) => &o.metadata,
        };
        meta.name.as_deref().unwrap_or_default()
    }
}

impl Children {
    /// Every child, in the order they are applied: the configuration first
    /// (pods mount it), etcd (its policy before its members) before the
    /// cache pods that use it.
    pub(crate) fn into_list(self) -> Vec<Child> {
        let mut list = vec![Child::ConfigMap(self.config)];
        if let Some(etcd) = self.etcd {
            list.extend([
                Child::Service(etcd.peers),
                Child::Service(etcd.client),
                Child::NetworkPolicy(etcd.policy),
                Child::StatefulSet(etcd.members),
            ]);
        }
        list.extend([Child::Service(self.cache_headless), Child::Service(self.rpc), Child::StatefulSet(self.cache)]);
        list
    }
}

/// Child names, in one place so the reconciler, status and tests agree.
pub(crate) struct Names;

impl Names {
    pub(crate) fn config(kv: &str) -> String {
        format!("{kv}-config")
    }
    pub(crate) fn cache(kv: &str) -> String {
        format!("{kv}-cache")
    }
    pub(crate) fn cache_headless(kv: &str) -> String {
        format!("{kv}-cache-headless")
    }
    pub(crate) fn rpc(kv: &str) -> String {
        kv.to_string()
    }
    pub(crate) fn etcd(kv: &str) -> String {
        format!("{kv}-etcd")
    }
    pub(crate) fn etcd_client(kv: &str) -> String {
        format!("{kv}-etcd-client")
    }
    pub(crate) fn token(kv: &str) -> String {
        format!("{kv}-token")
    }
}

/// Where cache pods find the token Secret's files.
pub(crate) const TOKEN_DIR: &str = "/var/run/secrets/kvplane.io/auth";
/// Where cache pods find `spec.auth.tenantsSecretRef`'s tenants file.
pub(crate) const TENANTS_DIR: &str = "/var/run/secrets/kvplane.io/tenants";
/// The key (and file name) of the tenants file in its Secret.
pub(crate) const TENANTS_KEY: &str = "tenants.json";
/// Where cache pods find `spec.tls`'s Secret (`tls.crt`, `tls.key`).
pub(crate) const TLS_DIR: &str = "/var/run/secrets/kvplane.io/tls";
/// Where cache pods find the CA of client certificates (`spec.tls.clientCA`).
pub(crate) const CLIENT_CA_DIR: &str = "/var/run/secrets/kvplane.io/tls-client-ca";
/// Where cache pods find the etcd TLS Secret: an external etcd's, or the
/// client certificate for the etcd the operator runs.
pub(crate) const ETCD_TLS_DIR: &str = "/var/run/secrets/kvplane.io/etcd-tls";
/// Where the members of the etcd the operator runs find their certificate.
pub(crate) const ETCD_MEMBER_TLS_DIR: &str = "/var/run/secrets/kvplane.io/etcd-member-tls";
/// Where cache pods find the external etcd user's password.
pub(crate) const ETCD_AUTH_DIR: &str = "/var/run/secrets/kvplane.io/etcd-auth";
/// The file name of a client-CA bundle in [`CLIENT_CA_DIR`], whatever its key.
const CA_FILE: &str = "ca.crt";

/// The group the node image runs as (deploy/Dockerfile's `nonroot`): the
/// pods' fsGroup, so a non-root node can read its 0440 token file.
const NODE_GROUP: i64 = 65532;

fn labels(r: &Resolved, role: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".into(), "kvplane".into()),
        ("app.kubernetes.io/instance".into(), r.name.clone()),
        ("app.kubernetes.io/component".into(), role.into()),
        ("app.kubernetes.io/managed-by".into(), "kvplane-operator".into()),
        (LABEL_KVCACHE.into(), r.name.clone()),
        (LABEL_ROLE.into(), role.into()),
    ])
}

/// The labels that select one role's pods (a subset of [`labels`] that never
/// changes, since a StatefulSet's selector is immutable).
pub(crate) fn selector(name: &str, role: &str) -> BTreeMap<String, String> {
    BTreeMap::from([(LABEL_KVCACHE.into(), name.into()), (LABEL_ROLE.into(), role.into())])
}

/// The labels a rendered pod of `role` carries (what placement rules see).
pub(crate) fn pod_labels(r: &Resolved, role: &str) -> BTreeMap<String, String> {
    labels(r, role)
}

fn meta(r: &Resolved, name: String, role: &str, owner: &OwnerReference) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: Some(r.namespace.clone()),
        labels: Some(labels(r, role)),
        owner_references: Some(vec![owner.clone()]),
        ..Default::default()
    }
}

/// The node configuration the cache pods mount: backend, endpoints, the
/// memory tier's size, the plugin declarations (what the node loads and
/// verifies) and the second tier's settings (`spec.tiering`). The node
/// parses the same struct back.
pub(crate) fn node_config(r: &Resolved, etcd_endpoints: &[String]) -> NodeConfigFile {
    NodeConfigFile {
        backend: r.backend,
        backend_endpoints: r.backend_endpoints.clone(),
        metadata: Some(match &r.metadata {
            Metadata::Etcd(_) => MetadataEndpoints::Etcd(etcd_endpoints.to_vec()),
            // https:// spelled out with TLS (the node would take the bare
            // host:port so too); the plain form as it always was, so that
            // existing pools keep their config hash.
            Metadata::ExternalEtcd(c) if c.tls.is_some() => MetadataEndpoints::Etcd(vec![format!("https://{}", c.address)]),
            Metadata::ExternalEtcd(c) => MetadataEndpoints::Etcd(vec![c.address.clone()]),
            Metadata::ExternalRedis(c) => MetadataEndpoints::Redis(c.address.clone()),
        }),
        memory: node_memory(r),
        plugins: r.plugins.clone(),
        tiering: r.tiering.clone(),
        cluster: node_cluster(r),
    }
}

/// kvplane pods of one KVCache form one cluster in its etcd (each pod
/// registers under its name, at its pod IP); vineyardd pods, and a pool
/// whose metadata is a Redis, have no kvplane cluster.
fn node_cluster(r: &Resolved) -> Option<ClusterConfig> {
    if r.backend == BackendType::Vineyard || matches!(r.metadata, Metadata::ExternalRedis(_)) {
        return None;
    }
    Some(ClusterConfig {
        name: format!("{}.{}", r.namespace, r.name),
        etcd: etcd_client(r),
        peer_tls: peer_tls(r),
        ..ClusterConfig::default()
    })
}

/// `cluster.peerTls` of a pool with `spec.tls`: members hand blocks off
/// and repair through TLS clients of each other. The CA is the TLS Secret's
/// `ca.crt` (cert-manager writes it beside `tls.crt`: the issuer's CA), the
/// name checked is `NAME-cache.NAMESPACE.svc`, which docs/security.md has
/// every pod's certificate carry (members reach each other by pod IP, which
/// changes with every restart). With `clientCA` the members present their
/// own certificate to each other, so it needs the client-auth usage too.
fn peer_tls(r: &Resolved) -> Option<kvplane_config::PeerTlsConfig> {
    let tls = r.tls.as_ref()?;
    let mutual = tls.client_ca.is_some();
    Some(kvplane_config::PeerTlsConfig {
        ca_file: format!("{TLS_DIR}/{CA_FILE}").into(),
        cert_file: mutual.then(|| format!("{TLS_DIR}/tls.crt").into()),
        key_file: mutual.then(|| format!("{TLS_DIR}/tls.key").into()),
        server_name: Some(format!("{}.{}.svc", Names::cache(&r.name), r.namespace)),
    })
}

/// `cluster.etcd` for an external etcd declaring TLS or a user, or for the
/// etcd the operator runs with `metadata.etcd.tls`: the files where
/// [`render_cache`] mounts their Secrets. The etcd the operator runs has no
/// users (its NetworkPolicy and, declared, its client certificates decide
/// who may reach it; docs/security.md).
fn etcd_client(r: &Resolved) -> Option<kvplane_config::EtcdClientConfig> {
    if let Metadata::Etcd(EtcdPlan { tls: Some(_), .. }) = &r.metadata {
        let tls = kvplane_config::EtcdTlsConfig {
            ca_file: format!("{ETCD_TLS_DIR}/ca.crt").into(),
            cert_file: Some(format!("{ETCD_TLS_DIR}/tls.crt").into()),
            key_file: Some(format!("{ETCD_TLS_DIR}/tls.key").into()),
        };
        return Some(kvplane_config::EtcdClientConfig { tls: Some(tls), auth: None });
    }
    let Metadata::ExternalEtcd(c) = &r.metadata else { return None };
    if c.tls.is_none() && c.username.is_none() {
        return None;
    }
    let tls = c.tls.as_ref().map(|t| kvplane_config::EtcdTlsConfig {
        ca_file: format!("{ETCD_TLS_DIR}/ca.crt").into(),
        cert_file: t.client_certificate.then(|| format!("{ETCD_TLS_DIR}/tls.crt").into()),
        key_file: t.client_certificate.then(|| format!("{ETCD_TLS_DIR}/tls.key").into()),
    });
    let auth = c
        .username
        .as_ref()
        .map(|u| kvplane_config::EtcdAuthConfig { username: u.clone(), password_file: format!("{ETCD_AUTH_DIR}/password").into() });
    Some(kvplane_config::EtcdClientConfig { tls, auth })
}

/// The etcd client URLs of the cluster the operator runs.
pub(crate) fn etcd_client_urls(r: &Resolved) -> Vec<String> {
    match &r.metadata {
        Metadata::Etcd(plan) => vec![format!("{}://{}.{}.svc:2379", scheme(plan), Names::etcd_client(&r.name), r.namespace)],
        Metadata::ExternalEtcd(c) => vec![format!("{}://{}", if c.tls.is_some() { "https" } else { "http" }, c.address)],
        Metadata::ExternalRedis(_) => vec![],
    }
}

/// The URL scheme of the etcd the operator runs, on both of its ports.
fn scheme(plan: &EtcdPlan) -> &'static str {
    if plan.tls.is_some() {
        "https"
    } else {
        "http"
    }
}

/// The `--initial-cluster` of an etcd StatefulSet: every member by its stable
/// DNS name, so all members form ONE cluster.
pub(crate) fn initial_cluster(r: &Resolved, plan: &EtcdPlan) -> String {
    let sts = Names::etcd(&r.name);
    let scheme = scheme(plan);
    (0..plan.workload.replicas)
        .map(|i| format!("{sts}-{i}={scheme}://{sts}-{i}.{sts}.{}.svc:2380", r.namespace))
        .collect::<Vec<_>>()
        .join(",")
}

/// Renders every child.
pub(crate) fn render(r: &Resolved, placements: &Placements, owner: &OwnerReference) -> Children {
    let etcd_urls = etcd_client_urls(r);
    let config_json = serde_json::to_string_pretty(&node_config(r, &etcd_urls)).expect("a NodeConfigFile always serializes");
    let config_hash = hex::encode(&Sha256::digest(config_json.as_bytes())[..8]);
    let config = ConfigMap {
        metadata: meta(r, Names::config(&r.name), ROLE_CACHE, owner),
        data: Some(BTreeMap::from([("node.json".to_string(), config_json)])),
        ..Default::default()
    };
    let etcd = match &r.metadata {
        Metadata::Etcd(plan) => Some(render_etcd(r, plan, &placements.etcd, owner)),
        _ => None,
    };
    let cache = render_cache(r, &placements.cache, owner, &config_hash, &etcd_urls);
    let token = r.token.as_ref().filter(|t| t.generated).map(|t| Secret {
        metadata: meta(r, t.name.clone(), ROLE_CACHE, owner),
        type_: Some("Opaque".into()),
        ..Default::default()
    });
    let headless = Service {
        metadata: meta(r, Names::cache_headless(&r.name), ROLE_CACHE, owner),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            publish_not_ready_addresses: Some(true),
            selector: Some(selector(&r.name, ROLE_CACHE)),
            ports: Some(vec![port("rpc", DEFAULT_PORT)]),
            ..Default::default()
        }),
        ..Default::default()
    };
    let rpc = Service {
        metadata: meta(r, Names::rpc(&r.name), ROLE_CACHE, owner),
        spec: Some(ServiceSpec {
            type_: Some(r.service_type.clone()),
            selector: Some(selector(&r.name, ROLE_CACHE)),
            ports: Some(r.service_ports.clone()),
            ..Default::default()
        }),
        ..Default::default()
    };
    Children { config, etcd, cache, cache_headless: headless, rpc, token }
}

fn port(name: &str, port: i32) -> ServicePort {
    ServicePort {
        name: Some(name.into()),
        port,
        target_port: Some(IntOrString::Int(port)),
        protocol: Some("TCP".into()),
        ..Default::default()
    }
}

/// The variable that carries `spec.backend.secretRef` into cache pods; the
/// node passes it to the backend plugin as its `password`.
pub(crate) const BACKEND_SECRET_ENV: &str = kvplane_config::node::BACKEND_SECRET_ENV;

fn field_env(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector { field_path: path.into(), ..Default::default() }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn apply_placement(spec: &mut PodSpec, p: &RolePlacement) {
    spec.affinity = p.affinity.clone();
    spec.tolerations = (!p.tolerations.is_empty()).then(|| p.tolerations.clone());
    spec.topology_spread_constraints = (!p.topology_spread.is_empty()).then(|| p.topology_spread.clone());
}

fn render_etcd(r: &Resolved, plan: &EtcdPlan, placement: &RolePlacement, owner: &OwnerReference) -> EtcdChildren {
    let sts_name = Names::etcd(&r.name);
    let w = &plan.workload;
    let peers = Service {
        metadata: meta(r, sts_name.clone(), ROLE_ETCD, owner),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            // Members must find each other before they are ready: readiness
            // needs a quorum, and a quorum needs the peers' DNS names.
            publish_not_ready_addresses: Some(true),
            selector: Some(selector(&r.name, ROLE_ETCD)),
            ports: Some(vec![port("client", 2379), port("peer", 2380)]),
            ..Default::default()
        }),
        ..Default::default()
    };
    let client = Service {
        metadata: meta(r, Names::etcd_client(&r.name), ROLE_ETCD, owner),
        spec: Some(ServiceSpec {
            selector: Some(selector(&r.name, ROLE_ETCD)),
            ports: Some(vec![port("client", 2379)]),
            ..Default::default()
        }),
        ..Default::default()
    };
    let scheme = scheme(plan);
    let peer_url = format!("{scheme}://$(POD_NAME).{sts_name}.{}.svc:2380", r.namespace);
    let client_url = format!("{scheme}://$(POD_NAME).{sts_name}.{}.svc:2379", r.namespace);
    let mut args = vec![
        "--name=$(POD_NAME)".into(),
        "--data-dir=/var/lib/etcd".into(),
        format!("--listen-peer-urls={scheme}://0.0.0.0:2380"),
        format!("--listen-client-urls={scheme}://0.0.0.0:2379"),
        format!("--initial-advertise-peer-urls={peer_url}"),
        format!("--advertise-client-urls={client_url}"),
        format!("--initial-cluster={}", initial_cluster(r, plan)),
        format!("--initial-cluster-token={}-{}", r.namespace, r.name),
        "--initial-cluster-state=new".into(),
    ];
    let mut mounts = vec![VolumeMount { name: "data".into(), mount_path: "/var/lib/etcd".into(), ..Default::default() }];
    let mut volumes = Vec::new();
    if let Some(tls) = &plan.tls {
        args.extend(member_tls_args());
        volumes.push(secret_volume("tls", &tls.members_secret, &[("tls.crt", "tls.crt"), ("tls.key", "tls.key"), (CA_FILE, CA_FILE)]));
        mounts.push(read_only_mount("tls", ETCD_MEMBER_TLS_DIR));
    }
    let mut env = vec![field_env("POD_NAME", "metadata.name")];
    env.extend(w.env.iter().cloned());
    let container = Container {
        name: "etcd".into(),
        image: Some(w.image.clone()),
        image_pull_policy: Some(w.image_pull_policy.clone()),
        command: Some(vec!["etcd".into()]),
        args: Some(args),
        env: Some(env),
        ports: Some(vec![container_port("client", 2379), container_port("peer", 2380)]),
        readiness_probe: Some(Probe {
            tcp_socket: Some(TCPSocketAction { port: IntOrString::Int(2379), ..Default::default() }),
            period_seconds: Some(5),
            ..Default::default()
        }),
        resources: w.resources.clone(),
        volume_mounts: Some(mounts),
        ..Default::default()
    };
    let mut pod = PodSpec { containers: vec![container], ..Default::default() };
    apply_placement(&mut pod, placement);
    let claim_templates = plan.storage.as_ref().map(|s| {
        vec![PersistentVolumeClaim {
            metadata: ObjectMeta { name: Some("data".into()), ..Default::default() },
            spec: Some(PersistentVolumeClaimSpec {
                access_modes: Some(vec!["ReadWriteOnce".into()]),
                storage_class_name: s.storage_class_name.clone(),
                resources: Some(VolumeResourceRequirements {
                    requests: Some(BTreeMap::from([("storage".to_string(), Quantity(s.size.clone()))])),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }]
    });
    if claim_templates.is_none() {
        volumes.push(Volume { name: "data".into(), empty_dir: Some(EmptyDirVolumeSource::default()), ..Default::default() });
    }
    pod.volumes = (!volumes.is_empty()).then_some(volumes);
    let members = StatefulSet {
        metadata: meta(r, sts_name.clone(), ROLE_ETCD, owner),
        spec: Some(StatefulSetSpec {
            replicas: Some(w.replicas),
            service_name: Some(sts_name),
            // All members start together: a member waits for its peers, so
            // ordered start-up would deadlock a cluster of three.
            pod_management_policy: Some("Parallel".into()),
            selector: LabelSelector { match_labels: Some(selector(&r.name, ROLE_ETCD)), ..Default::default() },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta { labels: Some(labels(r, ROLE_ETCD)), ..Default::default() }),
                spec: Some(pod),
            },
            volume_claim_templates: claim_templates,
            ..Default::default()
        }),
        ..Default::default()
    };
    EtcdChildren { peers, client, members, policy: etcd_policy(r, owner) }
}

/// The TLS flags of a member of the etcd the operator runs: its
/// certificate on both ports, and a client certificate from the Secret's
/// CA required on both (`--client-cert-auth`): the members have no users,
/// so the certificate is what keeps others from rewriting membership.
pub(crate) fn member_tls_args() -> Vec<String> {
    let dir = ETCD_MEMBER_TLS_DIR;
    vec![
        format!("--cert-file={dir}/tls.crt"),
        format!("--key-file={dir}/tls.key"),
        format!("--trusted-ca-file={dir}/{CA_FILE}"),
        "--client-cert-auth".into(),
        format!("--peer-cert-file={dir}/tls.crt"),
        format!("--peer-key-file={dir}/tls.key"),
        format!("--peer-trusted-ca-file={dir}/{CA_FILE}"),
        "--peer-client-cert-auth".into(),
    ]
}

/// Ingress to the etcd members from the pool's own pods only: its cache
/// pods on the client port, the members themselves on both ports. Whoever
/// writes the pool's etcd decides where its clients send their blocks, and
/// without `metadata.etcd.tls` the members speak plain HTTP with no users;
/// the policy is enforced where the cluster's network plugin enforces
/// NetworkPolicies (docs/security.md).
fn etcd_policy(r: &Resolved, owner: &OwnerReference) -> NetworkPolicy {
    let from = |role: &str| NetworkPolicyPeer {
        pod_selector: Some(LabelSelector { match_labels: Some(selector(&r.name, role)), ..Default::default() }),
        ..Default::default()
    };
    let tcp = |port: i32| NetworkPolicyPort { port: Some(IntOrString::Int(port)), protocol: Some("TCP".into()), ..Default::default() };
    NetworkPolicy {
        metadata: meta(r, Names::etcd(&r.name), ROLE_ETCD, owner),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector { match_labels: Some(selector(&r.name, ROLE_ETCD)), ..Default::default() }),
            policy_types: Some(vec!["Ingress".into()]),
            ingress: Some(vec![
                NetworkPolicyIngressRule { from: Some(vec![from(ROLE_CACHE)]), ports: Some(vec![tcp(2379)]) },
                NetworkPolicyIngressRule { from: Some(vec![from(ROLE_ETCD)]), ports: Some(vec![tcp(2379), tcp(2380)]) },
            ]),
            ..Default::default()
        }),
    }
}

fn container_port(name: &str, port: i32) -> ContainerPort {
    ContainerPort { name: Some(name.into()), container_port: port, protocol: Some("TCP".into()), ..Default::default() }
}

/// The pool memory a kvplane node reserves: 80% of its memory limit (the
/// rest is the process itself), or the node's default without a limit.
/// [`crate::resolve::resolve`] has already refused a limit that does not parse.
fn node_memory(r: &Resolved) -> Option<ByteSize> {
    let limit = r.cache.resources.as_ref()?.limits.as_ref()?.get("memory")?;
    let bytes = kvplane_config::parse_bytes(&limit.0).ok()?;
    Some(ByteSize(bytes / 10 * 8))
}

/// The node's configuration and, under `plugins/NAME.wasm`, every plugin
/// whose source is a ConfigMap key: one projected volume at /etc/kvplane,
/// so the node verifies exactly the bytes the operator verified.
fn config_volume(r: &Resolved) -> Volume {
    let mut sources = vec![VolumeProjection {
        config_map: Some(ConfigMapProjection {
            name: Names::config(&r.name),
            items: Some(vec![KeyToPath { key: "node.json".into(), path: "node.json".into(), ..Default::default() }]),
            ..Default::default()
        }),
        ..Default::default()
    }];
    for p in &r.plugins {
        if let Some(cm) = &p.source.config_map {
            sources.push(VolumeProjection {
                config_map: Some(ConfigMapProjection {
                    name: cm.name.clone(),
                    items: Some(vec![KeyToPath { key: cm.key.clone(), path: format!("plugins/{}.wasm", p.name), ..Default::default() }]),
                    ..Default::default()
                }),
                ..Default::default()
            });
        }
    }
    Volume {
        name: "config".into(),
        projected: Some(ProjectedVolumeSource { sources: Some(sources), ..Default::default() }),
        ..Default::default()
    }
}

/// The token Secret's `token` key, as a file only its owner (and the pod's
/// fsGroup, which the kubelet adds) can read. Not optional: a pod whose
/// Secret is missing does not start (the kubelet's event names the Secret)
/// rather than start open.
fn token_volume(t: &TokenSecret) -> Volume {
    Volume {
        name: "token".into(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(t.name.clone()),
            items: Some(vec![KeyToPath { key: TOKEN_KEY.into(), path: TOKEN_KEY.into(), ..Default::default() }]),
            default_mode: Some(0o400),
            optional: Some(false),
        }),
        ..Default::default()
    }
}

/// A Secret's keys as files (`(key, file name)`), read-only for the owner
/// (and the pod's fsGroup). Not optional: a pod whose Secret is missing
/// does not start, and the kubelet's event names the Secret.
///
/// Mounted as a directory, never with `subPath`: the kubelet updates a
/// Secret volume in place when the Secret changes (cert-manager's renewal),
/// and the node's reload (`--tls-reload-interval`) reads the new files; a
/// `subPath` mount is a copy that the kubelet never updates.
fn secret_volume(volume: &str, secret: &str, items: &[(&str, &str)]) -> Volume {
    Volume {
        name: volume.into(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(secret.into()),
            items: Some(items.iter().map(|(k, p)| KeyToPath { key: (*k).into(), path: (*p).into(), ..Default::default() }).collect()),
            default_mode: Some(0o400),
            optional: Some(false),
        }),
        ..Default::default()
    }
}

fn read_only_mount(volume: &str, dir: &str) -> VolumeMount {
    VolumeMount { name: volume.into(), mount_path: dir.into(), read_only: Some(true), ..Default::default() }
}

/// The TLS and etcd-credential volumes of a kvplane cache pod, their
/// mounts, and the node flags that name their files.
fn tls_volumes(r: &Resolved, volumes: &mut Vec<Volume>, mounts: &mut Vec<VolumeMount>, args: &mut Vec<String>) {
    if let Some(tls) = &r.tls {
        // ca.crt too: the CA the members check each other's certificates
        // against (cluster.peerTls.caFile, see `peer_tls`).
        volumes.push(secret_volume("tls", &tls.secret, &[("tls.crt", "tls.crt"), ("tls.key", "tls.key"), (CA_FILE, CA_FILE)]));
        mounts.push(read_only_mount("tls", TLS_DIR));
        args.push(format!("--tls-cert={TLS_DIR}/tls.crt"));
        args.push(format!("--tls-key={TLS_DIR}/tls.key"));
        match &tls.client_ca {
            None => {}
            Some(ClientCa::Secret { name, key }) => volumes.push(secret_volume("tls-client-ca", name, &[(key, CA_FILE)])),
            // A CA is public: a ConfigMap (trust-manager's Bundle target)
            // updates in place as a Secret volume does.
            Some(ClientCa::ConfigMap { name, key }) => volumes.push(Volume {
                name: "tls-client-ca".into(),
                config_map: Some(ConfigMapVolumeSource {
                    name: name.clone(),
                    items: Some(vec![KeyToPath { key: key.clone(), path: CA_FILE.into(), ..Default::default() }]),
                    optional: Some(false),
                    ..Default::default()
                }),
                ..Default::default()
            }),
        }
        if tls.client_ca.is_some() {
            mounts.push(read_only_mount("tls-client-ca", CLIENT_CA_DIR));
            args.push(format!("--tls-client-ca={CLIENT_CA_DIR}/{CA_FILE}"));
        }
    }
    if let Metadata::ExternalEtcd(c) = &r.metadata {
        if let Some(t) = &c.tls {
            let mut items = vec![("ca.crt", "ca.crt")];
            if t.client_certificate {
                items.extend([("tls.crt", "tls.crt"), ("tls.key", "tls.key")]);
            }
            volumes.push(secret_volume("etcd-tls", &t.secret_name, &items));
            mounts.push(read_only_mount("etcd-tls", ETCD_TLS_DIR));
        }
        if let (Some(_), Some(secret)) = (&c.username, &c.password_secret_ref) {
            volumes.push(secret_volume("etcd-auth", secret, &[("password", "password")]));
            mounts.push(read_only_mount("etcd-auth", ETCD_AUTH_DIR));
        }
    }
    if let Metadata::Etcd(EtcdPlan { tls: Some(OperatedEtcdTls { client_secret, .. }), .. }) = &r.metadata {
        volumes.push(secret_volume("etcd-tls", client_secret, &[(CA_FILE, CA_FILE), ("tls.crt", "tls.crt"), ("tls.key", "tls.key")]));
        mounts.push(read_only_mount("etcd-tls", ETCD_TLS_DIR));
    }
}

fn render_cache(r: &Resolved, placement: &RolePlacement, owner: &OwnerReference, config_hash: &str, etcd_urls: &[String]) -> StatefulSet {
    let sts_name = Names::cache(&r.name);
    let w = &r.cache;
    let mut env = vec![field_env("POD_NAME", "metadata.name"), field_env("POD_IP", "status.podIP")];
    if let Some(secret) = &r.backend_secret {
        env.push(EnvVar {
            name: BACKEND_SECRET_ENV.into(),
            value_from: Some(EnvVarSource {
                secret_key_ref: Some(SecretKeySelector { name: secret.name.clone(), key: secret.key.clone(), optional: None }),
                ..Default::default()
            }),
            ..Default::default()
        });
    }
    env.extend(w.env.iter().cloned());
    // The node's own probes (see kvplane-admin): not ready while draining or
    // out of its cluster, restarted only when its admin handler stops
    // answering. Vineyard answers neither route: its readiness is its port,
    // and it gets no liveness probe.
    let (args, probe, liveness, ports) = match r.backend {
        BackendType::Vineyard => {
            let mut args = vec!["--socket=/var/run/vineyard.sock".to_string(), format!("--rpc_socket_port={DEFAULT_PORT}")];
            if let Some(url) = etcd_urls.first() {
                args.push(format!("--etcd_endpoint={url}"));
                args.push(format!("--etcd_prefix=/vineyard/{}/{}", r.namespace, r.name));
            }
            if let Some(size) = &r.shared_memory_size {
                args.push(format!("--size={size}"));
            }
            let probe = Probe {
                tcp_socket: Some(TCPSocketAction { port: IntOrString::Int(DEFAULT_PORT), ..Default::default() }),
                period_seconds: Some(5),
                ..Default::default()
            };
            (args, probe, None, vec![container_port("rpc", DEFAULT_PORT)])
        }
        BackendType::Kvplane | BackendType::Redis | BackendType::Eic => {
            let mut args = vec![
                "node".to_string(),
                format!("--listen=0.0.0.0:{DEFAULT_PORT}"),
                format!("--admin=0.0.0.0:{ADMIN_PORT}"),
                "--config=/etc/kvplane/node.json".to_string(),
            ];
            // Other pods reach the client port, so the node requires the
            // token (and refuses to start without one).
            // With tenants, clients present their tenant's token and the
            // pool's token is the members' (hand-off, repair), which sees
            // every tenant's keys: no client gets it.
            match (&r.token, &r.tenants) {
                (Some(_), Some(_)) => {
                    args.push(format!("--tenants-file={TENANTS_DIR}/{TENANTS_KEY}"));
                    args.push(format!("--cluster-token-file={TOKEN_DIR}/{TOKEN_KEY}"));
                }
                (Some(_), None) => args.push(format!("--token-file={TOKEN_DIR}/{TOKEN_KEY}")),
                (None, _) => {}
            }
            let get = |path: &str| HTTPGetAction { path: Some(path.into()), port: IntOrString::Int(ADMIN_PORT), ..Default::default() };
            let probe = Probe { http_get: Some(get("/readyz")), period_seconds: Some(5), ..Default::default() };
            // Three misses 10 s apart: a node loaded enough to miss one
            // scrape is not restarted for it. The admin port only opens once
            // the node has started (plugins compiled, cluster joined), which
            // the startup probe waits for, up to 60 × 2 s, before liveness
            // counts.
            let liveness =
                Probe { http_get: Some(get("/livez")), period_seconds: Some(10), failure_threshold: Some(3), ..Default::default() };
            let startup =
                Probe { http_get: Some(get("/livez")), period_seconds: Some(2), failure_threshold: Some(60), ..Default::default() };
            (args, probe, Some((liveness, startup)), vec![container_port("rpc", DEFAULT_PORT), container_port("admin", ADMIN_PORT)])
        }
    };
    let (command, args) = match r.backend {
        BackendType::Vineyard => (Some(vec!["vineyardd".to_string()]), args),
        _ => (None, args),
    };
    let mut mounts =
        vec![VolumeMount { name: "config".into(), mount_path: "/etc/kvplane".into(), read_only: Some(true), ..Default::default() }];
    let mut volumes = vec![config_volume(r)];
    if let Some(t) = &r.token {
        mounts.push(VolumeMount { name: "token".into(), mount_path: TOKEN_DIR.into(), read_only: Some(true), ..Default::default() });
        volumes.push(token_volume(t));
    }
    if let Some(tenants) = &r.tenants {
        volumes.push(secret_volume("tenants", tenants, &[(TENANTS_KEY, TENANTS_KEY)]));
        mounts.push(read_only_mount("tenants", TENANTS_DIR));
    }
    let mut args = args;
    if r.backend != BackendType::Vineyard {
        // The certificate is the node's client port's alone: the admin
        // port (probes, /metrics) and the Services are unchanged.
        tls_volumes(r, &mut volumes, &mut mounts, &mut args);
    }
    let container = Container {
        name: "cache".into(),
        image: Some(w.image.clone()),
        image_pull_policy: Some(w.image_pull_policy.clone()),
        command,
        args: Some(args),
        env: Some(env),
        ports: Some(ports),
        readiness_probe: Some(probe),
        liveness_probe: liveness.as_ref().map(|(l, _)| l.clone()),
        startup_probe: liveness.map(|(_, s)| s),
        resources: w.resources.clone(),
        volume_mounts: Some(mounts),
        ..Default::default()
    };
    let mut pod = PodSpec {
        containers: vec![container],
        volumes: Some(volumes),
        security_context: r.token.as_ref().map(|_| PodSecurityContext { fs_group: Some(NODE_GROUP), ..Default::default() }),
        // Draining a node finishes in-flight requests (its default drain deadline is 10 s).
        termination_grace_period_seconds: Some(30),
        ..Default::default()
    };
    apply_placement(&mut pod, placement);
    StatefulSet {
        metadata: meta(r, sts_name, ROLE_CACHE, owner),
        spec: Some(StatefulSetSpec {
            replicas: Some(w.replicas),
            service_name: Some(Names::cache_headless(&r.name)),
            pod_management_policy: Some("Parallel".into()),
            selector: LabelSelector { match_labels: Some(selector(&r.name, ROLE_CACHE)), ..Default::default() },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels(r, ROLE_CACHE)),
                    annotations: Some(BTreeMap::from([(ANNOTATION_CONFIG_HASH.to_string(), config_hash.to_string())])),
                    ..Default::default()
                }),
                spec: Some(pod),
            },
            ..Default::default()
        }),
        ..Default::default()
    }
}
