//! What a KVCache declares about one plugin: where it comes from, what it may
//! touch, how long it may run, and what happens when it fails.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
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

/// Resource limits of one plugin instance: everything a plugin can make the
/// host spend is bounded here, and past a bound the plugin gets `capacity`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InstanceLimits {
    /// Cap on the linear memory of each instance, in bytes.
    pub memory_bytes: u64,
    /// Deadline of every call into the plugin, including host I/O it waits on.
    pub timeout: Duration,
    /// Most instances kept (and run concurrently) for this plugin.
    pub max_instances: usize,
    /// Open connections per instance.
    pub connections: u32,
    /// Bytes queued for sending (not yet flushed) per instance, over all its
    /// connections. Queued buffers count by their length although they are
    /// referenced, not copied: they pin host memory just the same.
    pub queued_bytes: u64,
    /// Buffer handles held per instance.
    pub buffers: u32,
    /// Bytes of host buffers an instance allocated (`read-buffer`) and holds.
    pub buffer_bytes: u64,
    /// Entries of any kind in an instance's resource table.
    pub handles: u32,
    /// Distinct metric series the plugin may report (over all instances).
    pub metric_series: u32,
    /// Log records per second the plugin may write (over all instances);
    /// past it, and past [`log_burst`](Self::log_burst), records are dropped
    /// and counted. Why: any client request can make a backend log, and a
    /// node log nobody bounded fills its disk (790 MB in 8 s was measured).
    pub log_records_per_second: u32,
    /// Records the plugin may write at once above its rate, after quiet.
    pub log_burst: u32,
}

impl Default for InstanceLimits {
    fn default() -> Self {
        InstanceLimits {
            memory_bytes: 64 << 20,
            timeout: Duration::from_secs(2),
            max_instances: 4,
            connections: 16,
            queued_bytes: 64 << 20,
            buffers: 4096,
            buffer_bytes: 256 << 20,
            handles: 8192,
            metric_series: 256,
            log_records_per_second: 100,
            log_burst: 1000,
        }
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
    pub limits: InstanceLimits,
    pub failure_policy: FailurePolicy,
    /// What the plugin may connect to (see [`EndpointRule`]). Nothing else
    /// is reachable.
    pub allowed_endpoints: Vec<String>,
    /// Driver libraries the plugin may open, by name.
    pub drivers: BTreeMap<String, PathBuf>,
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
            limits: InstanceLimits::default(),
            failure_policy: FailurePolicy::default(),
            allowed_endpoints: Vec::new(),
            drivers: BTreeMap::new(),
            granted_dir: None,
        }
    }

    /// Whether the plugin may connect to `addr`, reached by asking for
    /// `requested` ("host:port" as the plugin wrote it).
    pub fn allows_address(&self, requested: &str, addr: SocketAddr) -> bool {
        self.allowed_endpoints.iter().any(|a| EndpointRule::parse(a).is_some_and(|r| r.allows(requested, addr)))
    }

    /// Whether the plugin may connect to the Unix socket at `path`.
    pub fn allows_unix(&self, path: &str) -> bool {
        self.allowed_endpoints.iter().any(|a| a.strip_prefix("unix:") == Some(path))
    }
}

/// One `allowedEndpoints` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndpointRule {
    /// `host:port` or `host:*`: the name as the plugin asks for it; every
    /// address it resolves to is then allowed.
    Name { host: String, port: Option<u16> },
    /// `ADDR/BITS:port`, `ADDR:port` (a /32 or /128), `[v6]/BITS:*`: an
    /// address range, checked against each resolved address.
    Cidr { net: IpAddr, bits: u8, port: Option<u16> },
    /// `unix:/path`: a Unix-domain socket.
    Unix(String),
}

impl EndpointRule {
    pub fn parse(entry: &str) -> Option<EndpointRule> {
        if let Some(path) = entry.strip_prefix("unix:") {
            return path.starts_with('/').then(|| EndpointRule::Unix(path.to_owned()));
        }
        let (host, port) = entry.rsplit_once(':')?;
        let port = match port {
            "*" => None,
            p => Some(p.parse::<u16>().ok()?),
        };
        let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
        let (addr, bits) = match host.split_once('/') {
            Some((a, b)) => (a.trim_start_matches('[').trim_end_matches(']'), Some(b.trim_end_matches(']'))),
            None => (host, None),
        };
        if let Ok(net) = addr.parse::<IpAddr>() {
            let max = if net.is_ipv4() { 32 } else { 128 };
            let bits = match bits {
                Some(b) => b.parse::<u8>().ok().filter(|b| *b <= max)?,
                None => max,
            };
            return Some(EndpointRule::Cidr { net, bits, port });
        }
        if host.is_empty() || bits.is_some() {
            return None;
        }
        Some(EndpointRule::Name { host: host.to_ascii_lowercase(), port })
    }

    /// Whether this rule lets a plugin that asked for `requested` connect to
    /// `addr` (one of the addresses `requested` resolved to).
    pub fn allows(&self, requested: &str, addr: SocketAddr) -> bool {
        let port_ok = |port: &Option<u16>| port.is_none_or(|p| p == addr.port());
        match self {
            EndpointRule::Unix(_) => false,
            EndpointRule::Name { host, port } => {
                let asked = requested.rsplit_once(':').map(|(h, _)| h.trim_start_matches('[').trim_end_matches(']'));
                asked.is_some_and(|h| h.eq_ignore_ascii_case(host)) && port_ok(port)
            }
            EndpointRule::Cidr { net, bits, port } => port_ok(port) && in_network(*net, *bits, addr.ip()),
        }
    }
}

fn in_network(net: IpAddr, bits: u8, ip: IpAddr) -> bool {
    let ip = match (net, ip) {
        // An IPv4 rule also covers the IPv4-mapped IPv6 form of its addresses.
        (IpAddr::V4(_), IpAddr::V6(v6)) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
        _ => ip,
    };
    match (net, ip) {
        (IpAddr::V4(n), IpAddr::V4(a)) => {
            let mask = if bits == 0 { 0 } else { u32::MAX << (32 - u32::from(bits)) };
            u32::from(n) & mask == u32::from(a) & mask
        }
        (IpAddr::V6(n), IpAddr::V6(a)) => {
            let mask = if bits == 0 { 0 } else { u128::MAX << (128 - u32::from(bits)) };
            u128::from(n) & mask == u128::from(a) & mask
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allows(entries: &[&str], requested: &str, addr: &str) -> bool {
        let mut d = PluginDecl::new("p", World::Backend, PluginSource::Builtin("resp".into()));
        d.allowed_endpoints = entries.iter().map(|e| e.to_string()).collect();
        d.allows_address(requested, addr.parse().unwrap())
    }

    #[test]
    fn names_match_as_asked_and_any_address_they_resolve_to() {
        let rules = ["127.0.0.1:6379", "redis.cache:*"];
        assert!(allows(&rules, "127.0.0.1:6379", "127.0.0.1:6379"));
        assert!(!allows(&rules, "127.0.0.1:6380", "127.0.0.1:6380"));
        assert!(allows(&rules, "redis.cache:7000", "10.1.2.3:7000"));
        assert!(allows(&rules, "REDIS.cache:7000", "10.1.2.3:7000"));
        // A name that resolves to an allowed address is allowed by the address.
        assert!(allows(&rules, "localhost:6379", "127.0.0.1:6379"));
        assert!(!allows(&rules, "evil.example:6379", "10.9.9.9:6379"));
        assert!(!allows(&[], "127.0.0.1:6379", "127.0.0.1:6379"));
    }

    #[test]
    fn cidr_entries_match_resolved_addresses() {
        let rules = ["10.0.0.0/8:6379", "[fd00::]/8:*"];
        assert!(allows(&rules, "a.b:6379", "10.200.0.1:6379"));
        assert!(!allows(&rules, "a.b:6380", "10.200.0.1:6380"));
        assert!(!allows(&rules, "a.b:6379", "11.0.0.1:6379"));
        assert!(allows(&rules, "x:1", "[fd12::1]:1"));
        assert!(!allows(&rules, "x:1", "[fe80::1]:1"));
        assert!(allows(&["127.0.0.0/8:*"], "x:5", "[::ffff:127.0.0.1]:5"));
        assert_eq!(EndpointRule::parse("10.0.0.0/33:1"), None);
        assert_eq!(EndpointRule::parse("host:notaport"), None);
        assert_eq!(EndpointRule::parse("unix:relative.sock"), None);
    }

    #[test]
    fn unix_sockets_are_allowed_by_exact_path() {
        let mut d = PluginDecl::new("p", World::Backend, PluginSource::Builtin("resp".into()));
        d.allowed_endpoints = vec!["unix:/run/redis.sock".into()];
        assert!(d.allows_unix("/run/redis.sock"));
        assert!(!d.allows_unix("/run/redis.sock2"));
        assert!(!d.allows_unix("/run/other.sock"));
    }

    #[test]
    fn sources_parse() {
        assert_eq!(PluginSource::parse("builtin:ring"), PluginSource::Builtin("ring".into()));
        assert_eq!(PluginSource::parse("x.wasm"), PluginSource::File("x.wasm".into()));
    }
}
