//! What a KVCache declares about one plugin: where it comes from, what it may
//! touch, how long it may run, and what happens when it fails.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

/// The four plugin worlds of the `kvplane:plugin` contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum World {
    /// Speaks a second-tier store's protocol (exports `store`).
    Backend,
    /// Maps keys to owner nodes (exports `placement`).
    KeyPlacement,
    /// Decides retry / fail-over / give-up (exports `retry`).
    RetryPolicy,
    /// Scheduling constraints for pool pods (exports `scheduling`).
    PlacementRule,
}

impl World {
    pub const ALL: [World; 4] = [World::Backend, World::KeyPlacement, World::RetryPolicy, World::PlacementRule];

    /// The WIT world name, as in `wit/worlds.wit`.
    pub fn name(self) -> &'static str {
        match self {
            World::Backend => "backend",
            World::KeyPlacement => "key-placement",
            World::RetryPolicy => "retry-policy",
            World::PlacementRule => "placement-rule",
        }
    }

    /// The interface the world exports.
    pub fn export_interface(self) -> &'static str {
        match self {
            World::Backend => "store",
            World::KeyPlacement => "placement",
            World::RetryPolicy => "retry",
            World::PlacementRule => "scheduling",
        }
    }

    pub fn from_name(name: &str) -> Option<World> {
        World::ALL.into_iter().find(|w| w.name() == name)
    }
}

impl fmt::Display for World {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where the component's bytes come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PluginSource {
    /// A first-party plugin embedded in the host binary (`builtin:NAME`).
    Builtin(String),
    /// A file on the host's file system.
    File(PathBuf),
    /// Bytes already fetched (from a ConfigMap, an OCI registry, ...).
    Bytes { origin: String, bytes: std::sync::Arc<[u8]> },
}

impl PluginSource {
    /// Parse the CLI / config spelling: `builtin:NAME` or a path.
    pub fn parse(spec: &str) -> PluginSource {
        match spec.strip_prefix("builtin:") {
            Some(name) => PluginSource::Builtin(name.to_owned()),
            None => PluginSource::File(PathBuf::from(spec)),
        }
    }
}

impl fmt::Display for PluginSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PluginSource::Builtin(name) => write!(f, "builtin:{name}"),
            PluginSource::File(path) => write!(f, "{}", path.display()),
            PluginSource::Bytes { origin, .. } => f.write_str(origin),
        }
    }
}

/// What the caller gets when the plugin itself breaks (trap, deadline,
/// memory cap, malformed output): the declaration's own type. Errors the
/// plugin *returns* through the contract (`not-found`, `unavailable`, ...)
/// always reach the caller.
pub use kvplane_config::FailurePolicy;

/// Resource limits of one plugin instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Cap on the linear memory of each instance, in bytes.
    pub memory_bytes: u64,
    /// Deadline of every call into the plugin, including host I/O it waits on.
    pub timeout: Duration,
    /// Most instances kept (and run concurrently) for this plugin.
    pub max_instances: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { memory_bytes: 64 << 20, timeout: Duration::from_secs(2), max_instances: 4 }
    }
}

/// One plugin as declared in a KVCache (or on the command line).
#[derive(Debug, Clone)]
pub struct PluginDecl {
    /// Name used in errors, logs and metrics.
    pub name: String,
    /// The world the declaration expects the component to implement.
    pub world: World,
    pub source: PluginSource,
    /// Expected sha256 of the component bytes (hex); checked before compiling.
    pub sha256: Option<String>,
    /// Passed to the plugin's `open` / `configure`.
    pub config: BTreeMap<String, String>,
    pub limits: Limits,
    pub failure_policy: FailurePolicy,
    /// Endpoints the plugin may connect to: `host:port`, or `host:*` for any
    /// port. Nothing else is reachable.
    pub allowed_endpoints: Vec<String>,
    /// A host directory the plugin may read (preopened at `/data`); none by
    /// default.
    pub granted_dir: Option<PathBuf>,
}

impl PluginDecl {
    /// A declaration with default limits, fail-closed, nothing granted.
    pub fn new(name: impl Into<String>, world: World, source: PluginSource) -> PluginDecl {
        PluginDecl {
            name: name.into(),
            world,
            source,
            sha256: None,
            config: BTreeMap::new(),
            limits: Limits::default(),
            failure_policy: FailurePolicy::default(),
            allowed_endpoints: Vec::new(),
            granted_dir: None,
        }
    }

    /// Whether `endpoint` matches one of `allowed_endpoints`.
    pub fn allows_endpoint(&self, endpoint: &str) -> bool {
        endpoint_allowed(&self.allowed_endpoints, endpoint)
    }
}

/// `host:port` entries match exactly; `host:*` matches any port of `host`.
pub(crate) fn endpoint_allowed(allowed: &[String], endpoint: &str) -> bool {
    let Some((host, port)) = endpoint.rsplit_once(':') else {
        return false;
    };
    if host.is_empty() || port.parse::<u16>().is_err() {
        return false;
    }
    allowed.iter().any(|a| match a.rsplit_once(':') {
        Some((ah, "*")) => ah.eq_ignore_ascii_case(host),
        Some((ah, ap)) => ah.eq_ignore_ascii_case(host) && ap == port,
        None => false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_match_exactly_or_by_port_wildcard() {
        let allowed = vec!["127.0.0.1:6379".to_owned(), "redis.cache:*".to_owned()];
        assert!(endpoint_allowed(&allowed, "127.0.0.1:6379"));
        assert!(!endpoint_allowed(&allowed, "127.0.0.1:6380"));
        assert!(endpoint_allowed(&allowed, "redis.cache:7000"));
        assert!(!endpoint_allowed(&allowed, "redis.cache"));
        assert!(!endpoint_allowed(&allowed, "redis.cache:notaport"));
        assert!(!endpoint_allowed(&allowed, "10.0.0.1:6379"));
        assert!(!endpoint_allowed(&[], "127.0.0.1:6379"));
    }

    #[test]
    fn sources_parse() {
        assert_eq!(PluginSource::parse("builtin:ring"), PluginSource::Builtin("ring".into()));
        assert_eq!(PluginSource::parse("x.wasm"), PluginSource::File("x.wasm".into()));
    }
}
