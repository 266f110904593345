//! From a `KVCache` spec to the settings in effect: defaults applied, the two
//! AIBrix shapes folded into one, and every problem the schema cannot catch
//! reported with the field at fault.
//!
//! Precedence where AIBrix's two shapes overlap (newer wins):
//! * cache container: `cache` over `cacheSpec`, field by field;
//! * cache replicas: `cache.replicas`, then `cacheSpec.replicas`, then
//!   `replicas`, then 1;
//! * etcd members: `metadata.etcd.runtime.replicas`, then
//!   `metadata.etcd.replicas`, then `etcdReplicas`, then 1.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{EnvVar, ResourceRequirements, ServicePort};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::crd::{
    BackendType, ExternalConnection, FailurePolicy, KVCache, KVCacheSpec, PluginKind, PluginSourceSpec, PluginSpec, RuntimeSpec,
    StorageSpec, TieringConfig,
};

/// The client port of a kvplane node (and of the RPC Service by default).
pub(crate) const DEFAULT_PORT: i32 = 9600;
/// Port of a kvplane node's /metrics and /healthz.
pub(crate) const ADMIN_PORT: i32 = 9601;
/// Image of the kvplane node when the spec names none.
pub(crate) const DEFAULT_NODE_IMAGE: &str = "ghcr.io/kvplane/kvplane:0.1.0";
/// Image of etcd members when the spec names none.
pub(crate) const DEFAULT_ETCD_IMAGE: &str = "quay.io/coreos/etcd:v3.5.21";
/// The placement rule applied when the spec declares none.
pub(crate) const DEFAULT_PLACEMENT_RULE: &str = "gpu-affinity";

/// A spec problem, with the JSON path of the field at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("spec.{field}: {message}")]
pub(crate) struct SpecError {
    pub field: String,
    pub message: String,
}

fn err(field: impl Into<String>, message: impl Into<String>) -> SpecError {
    SpecError { field: field.into(), message: message.into() }
}

/// A container the operator runs.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Workload {
    pub replicas: i32,
    pub image: String,
    pub image_pull_policy: String,
    pub env: Vec<EnvVar>,
    pub resources: Option<ResourceRequirements>,
}

/// The etcd cluster the operator runs for the pool.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct EtcdPlan {
    pub workload: Workload,
    pub storage: Option<StorageSpec>,
    /// `metadata.etcd.tls`, checked.
    pub tls: Option<OperatedEtcdTls>,
}

/// TLS for the etcd the operator runs: the members' Secret, and the one
/// the cache pods present (the members' own unless another is named).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct OperatedEtcdTls {
    pub members_secret: String,
    pub client_secret: String,
}

/// Where the pool's metadata lives.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Metadata {
    /// An etcd cluster run by the operator.
    Etcd(EtcdPlan),
    /// An etcd outside this KVCache.
    ExternalEtcd(ExternalConnection),
    /// A Redis outside this KVCache (AIBrix's newer `metadata.redis`).
    ExternalRedis(ExternalConnection),
}

/// Everything the renderer needs, with defaults applied.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Resolved {
    pub name: String,
    pub namespace: String,
    pub backend: BackendType,
    /// True when `backend` was not given and was inferred from the image.
    pub backend_inferred: bool,
    pub backend_endpoints: Vec<String>,
    /// The store's credentials, handed to the cache pods as
    /// `KVPLANE_BACKEND_SECRET` (the node gives it to the backend plugin).
    pub backend_secret: Option<crate::crd::SecretKeyRef>,
    pub cache: Workload,
    /// vineyardd's `--size` (shared memory); unused for kvplane nodes.
    pub shared_memory_size: Option<String>,
    pub metadata: Metadata,
    pub service_type: String,
    pub service_ports: Vec<ServicePort>,
    /// Declared plugins plus the defaults (a placement rule).
    pub plugins: Vec<PluginSpec>,
    /// The Secret whose `token` key every client presents; `None` only for
    /// vineyardd, which has no authentication of its own.
    pub token: Option<TokenSecret>,
    /// `spec.auth.tenantsSecretRef`: the Secret whose `tenants.json` the
    /// nodes serve tenants from (the token is then the members' own).
    pub tenants: Option<String>,
    /// `spec.tiering`, checked by the node's own validation.
    pub tiering: Option<TieringConfig>,
    /// `spec.tls`: the cache pods' certificate and their clients' CA.
    pub tls: Option<ResolvedTls>,
}

/// `spec.tls`, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ResolvedTls {
    /// The `kubernetes.io/tls` Secret (keys `tls.crt`, `tls.key`).
    pub secret: String,
    pub client_ca: Option<ClientCa>,
}

/// Where the CA of client certificates is, and under which key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ClientCa {
    Secret { name: String, key: String },
    ConfigMap { name: String, key: String },
}

/// The Secret holding a pool's client token (key [`TOKEN_KEY`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TokenSecret {
    pub name: String,
    /// True when the operator creates it (no `spec.auth.tokenSecretRef`).
    pub generated: bool,
}

/// The key of the token in a pool's token Secret.
pub(crate) const TOKEN_KEY: &str = "token";

/// Applies defaults and checks what the schema cannot.
pub(crate) fn resolve(kv: &KVCache) -> Result<Resolved, SpecError> {
    let name = kv.metadata.name.clone().ok_or_else(|| err("metadata.name", "missing"))?;
    let namespace = kv.metadata.namespace.clone().unwrap_or_else(|| "default".into());
    // Child names append up to "-etcd-client" (12 characters) and pods a
    // "-NN" ordinal; Service names must stay DNS labels (63 characters).
    if name.len() > 40 {
        return Err(err("metadata.name", format!("{name:?} is {} characters; at most 40 leave room for child names", name.len())));
    }
    let spec = &kv.spec;
    let cache_runtime = merge_runtime(spec.cache_spec.as_ref(), spec.cache.as_ref());
    let (backend, backend_inferred) = match &spec.backend {
        Some(b) => (b.type_, false),
        None => {
            let image = cache_runtime.image.as_deref().unwrap_or("");
            if image.contains("vineyard") {
                (BackendType::Vineyard, true)
            } else {
                (BackendType::Kvplane, true)
            }
        }
    };
    let cache_field = if spec.cache.is_some() { "cache" } else { "cacheSpec" };
    let replicas = cache_runtime.replicas.or(spec.replicas).unwrap_or(1);
    if replicas < 0 {
        return Err(err(format!("{cache_field}.replicas"), "must not be negative"));
    }
    let image = match (&cache_runtime.image, backend) {
        (Some(i), _) if !i.trim().is_empty() => i.clone(),
        (_, BackendType::Vineyard) => {
            return Err(err(format!("{cache_field}.image"), "a vineyard backend needs the vineyardd image to run"));
        }
        _ => DEFAULT_NODE_IMAGE.to_string(),
    };
    let resources = merge_resources(cache_runtime.resources.clone(), cache_runtime.memory.as_deref(), cache_runtime.cpu.as_deref())
        .map_err(|m| err(format!("{cache_field}.memory"), m))?;
    if let Some(limit) = resources.as_ref().and_then(|r| r.limits.as_ref()).and_then(|l| l.get("memory")) {
        // The node's memory tier is sized from this limit.
        kvplane_config::parse_bytes(&limit.0).map_err(|e| err(format!("{cache_field}.resources.limits.memory"), e.to_string()))?;
    }
    let cache = Workload {
        replicas,
        image,
        image_pull_policy: cache_runtime.image_pull_policy.clone().unwrap_or_else(|| "IfNotPresent".into()),
        env: cache_runtime.env.clone(),
        resources,
    };
    let metadata = resolve_metadata(spec)?;
    if let Metadata::ExternalEtcd(c) = &metadata {
        if backend == BackendType::Vineyard && (c.tls.is_some() || c.username.is_some()) {
            let f = if c.tls.is_some() { "tls" } else { "username" };
            return Err(err(
                format!("metadata.etcd.externalConnection.{f}"),
                "vineyardd is given etcd's endpoint only: a vineyard pool cannot use it",
            ));
        }
    }
    if let Metadata::Etcd(EtcdPlan { tls: Some(_), .. }) = &metadata {
        if backend == BackendType::Vineyard {
            return Err(err("metadata.etcd.tls", "vineyardd is given etcd's endpoint only: a vineyard pool cannot use it"));
        }
    }
    let (service_type, service_ports) = resolve_service(spec)?;
    let backend_endpoints = spec.backend.as_ref().map(|b| b.endpoints.clone()).unwrap_or_default();
    for (i, e) in backend_endpoints.iter().enumerate() {
        if !is_host_port(e) {
            return Err(err(format!("backend.endpoints[{i}]"), format!("{e:?} is not host:port")));
        }
    }
    let plugins = resolve_plugins(spec, backend, &backend_endpoints)?;
    let token = resolve_token(spec, backend, &name)?;
    let tenants = resolve_tenants(spec, backend)?;
    let tiering = resolve_tiering(spec, backend, &backend_endpoints, &plugins)?;
    let tls = resolve_tls(spec, backend)?;
    Ok(Resolved {
        name,
        namespace,
        backend,
        backend_inferred,
        backend_endpoints,
        backend_secret: spec.backend.as_ref().and_then(|b| b.secret_ref.clone()),
        cache,
        shared_memory_size: shared_memory_size(cache_runtime.shared_memory_size.as_deref(), cache_field)?,
        metadata,
        service_type,
        service_ports,
        plugins,
        token,
        tenants,
        tiering,
        tls,
    })
}

/// `spec.auth.tenantsSecretRef`: a Secret that must be named, and not for a
/// vineyard pool (vineyardd checks no token).
fn resolve_tenants(spec: &KVCacheSpec, backend: BackendType) -> Result<Option<String>, SpecError> {
    match spec.auth.as_ref().and_then(|a| a.tenants_secret_ref.clone()) {
        None => Ok(None),
        Some(_) if backend == BackendType::Vineyard => {
            Err(err("auth.tenantsSecretRef", "vineyardd checks no token: a vineyard pool cannot serve tenants"))
        }
        Some(n) if n.trim().is_empty() => Err(err("auth.tenantsSecretRef", "names no Secret")),
        Some(n) => Ok(Some(n)),
    }
}

/// `spec.tls`: a Secret that must be named, and at most one client CA.
/// A vineyard pool is refused: vineyardd speaks no TLS.
fn resolve_tls(spec: &KVCacheSpec, backend: BackendType) -> Result<Option<ResolvedTls>, SpecError> {
    let Some(tls) = &spec.tls else { return Ok(None) };
    if backend == BackendType::Vineyard {
        return Err(err("tls", "vineyardd speaks no TLS: a vineyard pool cannot serve it"));
    }
    if tls.secret_name.trim().is_empty() {
        return Err(err("tls.secretName", "names no Secret (a kubernetes.io/tls Secret with tls.crt and tls.key)"));
    }
    let client_ca = match &tls.client_ca {
        None => None,
        Some(ca) => {
            if ca.key.trim().is_empty() {
                return Err(err("tls.clientCA.key", "names no key"));
            }
            let named = |n: &Option<String>| n.as_ref().filter(|n| !n.trim().is_empty()).cloned();
            let key = ca.key.clone();
            Some(match (named(&ca.secret_name), named(&ca.config_map_name)) {
                (Some(name), None) => ClientCa::Secret { name, key },
                (None, Some(name)) => ClientCa::ConfigMap { name, key },
                _ => return Err(err("tls.clientCA", "set exactly one of secretName and configMapName")),
            })
        }
    };
    Ok(Some(ResolvedTls { secret: tls.secret_name.clone(), client_ca }))
}

/// `spec.tiering`, checked as the node will check it: the node file's own
/// validation runs over the backend and plugins the pods get, so a setting
/// the node would refuse at start (through without mode all or without a
/// failClosed backend, a second tier without a backend plugin, a bound of
/// 0) is refused here, naming `spec.tiering.<field>`, instead of rendering
/// pods that crash-loop. One rule, in one place (`kvplane_config`).
fn resolve_tiering(
    spec: &KVCacheSpec,
    backend: BackendType,
    endpoints: &[String],
    plugins: &[PluginSpec],
) -> Result<Option<TieringConfig>, SpecError> {
    let Some(tiering) = &spec.tiering else { return Ok(None) };
    if backend == BackendType::Vineyard {
        return Err(err("tiering", "a vineyard pool runs vineyardd, which has no second tier to configure"));
    }
    let file = kvplane_config::NodeConfigFile {
        backend,
        backend_endpoints: endpoints.to_vec(),
        plugins: plugins.to_vec(),
        tiering: Some(tiering.clone()),
        ..Default::default()
    };
    file.validate().map_err(|e| err(e.field, e.message))?;
    Ok(Some(tiering.clone()))
}

/// The pool's token Secret: the one `spec.auth.tokenSecretRef` names, or
/// `NAME-token`, generated. A vineyard pool gets none (vineyardd checks no
/// token), and naming one for it is refused rather than silently ignored.
fn resolve_token(spec: &KVCacheSpec, backend: BackendType, name: &str) -> Result<Option<TokenSecret>, SpecError> {
    let named = spec.auth.as_ref().and_then(|a| a.token_secret_ref.clone());
    if backend == BackendType::Vineyard {
        return match named {
            Some(_) => Err(err("auth.tokenSecretRef", "vineyardd checks no token: a vineyard pool cannot require one")),
            None => Ok(None),
        };
    }
    Ok(Some(match named {
        Some(n) if n.trim().is_empty() => return Err(err("auth.tokenSecretRef", "names no Secret")),
        Some(n) => TokenSecret { name: n, generated: false },
        None => TokenSecret { name: crate::render::Names::token(name), generated: true },
    }))
}

/// vineyardd's `--size`, checked by the shared size rules and passed on as
/// a byte count (vineyardd's own suffixes need not agree with ours).
fn shared_memory_size(size: Option<&str>, cache_field: &str) -> Result<Option<String>, SpecError> {
    match size.map(str::trim).filter(|s| !s.is_empty()) {
        None => Ok(None),
        Some(s) => kvplane_config::parse_bytes(s)
            .map(|b| Some(b.to_string()))
            .map_err(|e| err(format!("{cache_field}.sharedMemorySize"), e.to_string())),
    }
}

/// `cache` over `cacheSpec`, field by field.
fn merge_runtime(old: Option<&RuntimeSpec>, new: Option<&RuntimeSpec>) -> RuntimeSpec {
    let old = old.cloned().unwrap_or_default();
    let Some(new) = new.cloned() else { return old };
    RuntimeSpec {
        replicas: new.replicas.or(old.replicas),
        image: new.image.or(old.image),
        image_pull_policy: new.image_pull_policy.or(old.image_pull_policy),
        env: if new.env.is_empty() { old.env } else { new.env },
        resources: new.resources.or(old.resources),
        memory: new.memory.or(old.memory),
        cpu: new.cpu.or(old.cpu),
        shared_memory_size: new.shared_memory_size.or(old.shared_memory_size),
    }
}

/// AIBrix's original `memory: "2"` means 2Gi; `cpu: "1"` one core. They fill
/// requests and limits only where `resources` says nothing.
fn merge_resources(
    resources: Option<ResourceRequirements>,
    memory: Option<&str>,
    cpu: Option<&str>,
) -> Result<Option<ResourceRequirements>, String> {
    if memory.is_none() && cpu.is_none() {
        return Ok(resources);
    }
    let mut r = resources.unwrap_or_default();
    let mut set = |name: &str, value: String| {
        for map in [&mut r.requests, &mut r.limits] {
            map.get_or_insert_with(BTreeMap::new).entry(name.to_string()).or_insert_with(|| Quantity(value.clone()));
        }
    };
    if let Some(m) = memory {
        let m = m.trim();
        if m.is_empty() {
            return Err("empty memory size".into());
        }
        // AIBrix's one exception to the shared size rules: a bare number is
        // GiB. Anything else is read as every kvplane size is, and written
        // back in the one spelling Kubernetes and kvplane agree on.
        let bytes = if m.chars().all(|c| c.is_ascii_digit()) {
            m.parse::<u64>().map_err(|e| format!("{m:?}: {e}"))?.checked_mul(1 << 30).ok_or_else(|| format!("{m:?} GiB is too large"))?
        } else {
            kvplane_config::parse_bytes(m).map_err(|e| e.to_string())?
        };
        set("memory", kvplane_config::ByteSize(bytes).to_string());
    }
    if let Some(c) = cpu {
        if !c.trim().is_empty() {
            set("cpu", c.trim().to_string());
        }
    }
    Ok(Some(r))
}

fn resolve_metadata(spec: &KVCacheSpec) -> Result<Metadata, SpecError> {
    let md = spec.metadata.clone().unwrap_or_default();
    if let Some(redis) = &md.redis {
        if let Some(c) = &redis.external_connection {
            if c.tls.is_some() || c.username.is_some() {
                let f = if c.tls.is_some() { "tls" } else { "username" };
                return Err(err(format!("metadata.redis.externalConnection.{f}"), "applies to an etcd metadata store only"));
            }
        }
        return match &redis.external_connection {
            Some(c) => Ok(Metadata::ExternalRedis(c.clone())),
            None => Err(err(
                "metadata.redis",
                "kvplane keeps pool metadata in etcd; a Redis metadata store must be external (set metadata.redis.externalConnection) or use metadata.etcd",
            )),
        };
    }
    let etcd = md.etcd.unwrap_or_default();
    if let Some(c) = etcd.external_connection {
        let field = "metadata.etcd.externalConnection";
        if etcd.tls.is_some() {
            return Err(err("metadata.etcd.tls", "is for the etcd the operator runs; an external etcd's TLS is externalConnection.tls"));
        }
        match (&c.username, &c.password_secret_ref) {
            (Some(u), _) if u.trim().is_empty() => return Err(err(format!("{field}.username"), "names no user")),
            (Some(_), None) => {
                return Err(err(format!("{field}.passwordSecretRef"), "the etcd user needs its password (a Secret, key password)"))
            }
            (None, Some(_)) => return Err(err(format!("{field}.username"), "passwordSecretRef needs the etcd user it is the password of")),
            _ => {}
        }
        if c.tls.as_ref().is_some_and(|t| t.secret_name.trim().is_empty()) {
            return Err(err(format!("{field}.tls.secretName"), "names no Secret (ca.crt, and tls.crt/tls.key for a client certificate)"));
        }
        if c.address.contains("://") {
            return Err(err(format!("{field}.address"), format!("{:?}: host:port, without a scheme (tls decides https)", c.address)));
        }
        return Ok(Metadata::ExternalEtcd(c));
    }
    let runtime = etcd.runtime.clone().unwrap_or_default();
    let replicas = runtime.replicas.or(etcd.replicas).or(spec.etcd_replicas).unwrap_or(1);
    if !(1..=9).contains(&replicas) {
        return Err(err("metadata.etcd.replicas", format!("{replicas} members: an etcd cluster has 1 to 9")));
    }
    if replicas % 2 == 0 {
        return Err(err(
            "metadata.etcd.replicas",
            format!("{replicas} members tolerate no more failures than {}; use an odd number", replicas - 1),
        ));
    }
    let image = runtime.image.or(etcd.image).filter(|i| !i.trim().is_empty()).unwrap_or_else(|| DEFAULT_ETCD_IMAGE.into());
    let tls = match etcd.tls {
        None => None,
        Some(t) if t.secret_name.trim().is_empty() => {
            return Err(err(
                "metadata.etcd.tls.secretName",
                "names no Secret (a kubernetes.io/tls Secret with tls.crt, tls.key and ca.crt)",
            ))
        }
        Some(t) if t.client_secret_name.as_ref().is_some_and(|c| c.trim().is_empty()) => {
            return Err(err("metadata.etcd.tls.clientSecretName", "names no Secret (leave it out to use secretName's certificate)"))
        }
        Some(t) => Some(OperatedEtcdTls {
            client_secret: t.client_secret_name.unwrap_or_else(|| t.secret_name.clone()),
            members_secret: t.secret_name,
        }),
    };
    Ok(Metadata::Etcd(EtcdPlan {
        workload: Workload {
            replicas,
            image,
            image_pull_policy: runtime.image_pull_policy.unwrap_or_else(|| "IfNotPresent".into()),
            env: runtime.env,
            resources: runtime.resources.or(etcd.resources),
        },
        storage: match etcd.storage.filter(|s| !s.size.trim().is_empty()) {
            Some(mut storage) => {
                let bytes = kvplane_config::parse_bytes(&storage.size).map_err(|e| err("metadata.etcd.storage.size", e.to_string()))?;
                storage.size = kvplane_config::ByteSize(bytes).to_string();
                Some(storage)
            }
            None => None,
        },
        tls,
    }))
}

fn resolve_service(spec: &KVCacheSpec) -> Result<(String, Vec<ServicePort>), SpecError> {
    let svc = spec.service.clone().unwrap_or_default();
    let type_ = svc.type_.unwrap_or_else(|| "ClusterIP".into());
    let ports = match svc.ports {
        Some(ports) => {
            for (i, p) in ports.iter().enumerate() {
                if ports.len() > 1 && p.name.as_deref().unwrap_or("").is_empty() {
                    return Err(err(format!("service.ports[{i}].name"), "every port needs a name when there are several"));
                }
            }
            ports
        }
        None => vec![ServicePort {
            name: Some("rpc".into()),
            port: svc.port.unwrap_or(DEFAULT_PORT),
            target_port: Some(IntOrString::Int(DEFAULT_PORT)),
            node_port: svc.node_port,
            protocol: Some("TCP".into()),
            ..Default::default()
        }],
    };
    if type_ == "ClusterIP" && ports.iter().any(|p| p.node_port.is_some()) {
        return Err(err("service.nodePort", "a nodePort needs service.type NodePort or LoadBalancer"));
    }
    Ok((type_, ports))
}

fn resolve_plugins(spec: &KVCacheSpec, backend: BackendType, endpoints: &[String]) -> Result<Vec<PluginSpec>, SpecError> {
    let mut plugins = spec.plugins.clone();
    for (i, p) in plugins.iter().enumerate() {
        let src = &p.source;
        let set = [src.builtin.is_some(), src.config_map.is_some(), src.oci.is_some(), src.url.is_some()];
        if set.iter().filter(|s| **s).count() != 1 {
            return Err(err(format!("plugins[{i}].source"), "set exactly one of builtin, configMap, oci, url"));
        }
        if let Some(b) = &src.builtin {
            if kvplane_runtime::builtin::bytes(b).is_none() {
                return Err(err(
                    format!("plugins[{i}].source.builtin"),
                    format!("no builtin plugin {b:?} (builtins: {})", kvplane_runtime::builtin::NAMES.join(", ")),
                ));
            }
        }
        for (j, e) in p.allowed_endpoints.iter().enumerate() {
            if !is_host_port(e) {
                return Err(err(format!("plugins[{i}].allowedEndpoints[{j}]"), format!("{e:?} is not host:port")));
            }
        }
        if plugins[..i].iter().any(|q| q.name == p.name) {
            return Err(err(format!("plugins[{i}].name"), format!("{:?} is declared twice", p.name)));
        }
    }
    if !plugins.iter().any(|p| p.kind == PluginKind::PlacementRule) {
        plugins.push(builtin_plugin(DEFAULT_PLACEMENT_RULE, PluginKind::PlacementRule, Vec::new()));
    }
    match backend {
        BackendType::Redis if !plugins.iter().any(|p| p.kind == PluginKind::Backend) => {
            plugins.push(builtin_plugin("resp", PluginKind::Backend, endpoints.to_vec()));
        }
        BackendType::Eic if !plugins.iter().any(|p| p.kind == PluginKind::Backend) => {
            return Err(err("plugins", "an eic backend needs a backend plugin (kind: backend) that speaks EIC"));
        }
        _ => {}
    }
    Ok(plugins)
}

fn builtin_plugin(name: &str, kind: PluginKind, allowed_endpoints: Vec<String>) -> PluginSpec {
    PluginSpec {
        name: name.into(),
        kind,
        source: PluginSourceSpec { builtin: Some(name.into()), ..Default::default() },
        sha256: None,
        config: BTreeMap::new(),
        limits: None,
        failure_policy: FailurePolicy::FailClosed,
        allowed_endpoints,
        drivers: Vec::new(),
    }
}

fn is_host_port(s: &str) -> bool {
    matches!(s.rsplit_once(':'), Some((h, p)) if !h.is_empty() && p.parse::<u16>().is_ok())
}
