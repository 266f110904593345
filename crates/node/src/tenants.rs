//! Tenants: who a connection is, which keys it sees, and what it may hold.
//!
//! With a tenants file (`--tenants-file`, [`kvplane_config::TenantsFile`])
//! a connection authenticates into one tenant at HELLO: the token it
//! presents is hashed (SHA-256) and compared, in constant time, with every
//! tenant's digest. The connection keeps that tenant (an `Arc`, resolved
//! once) for its life; nothing on the request path looks a tenant up.
//!
//! # Namespaces, and why a client cannot forge another tenant's key
//!
//! Every key a tenant's connection sends is rewritten, right after its
//! request is decoded, to `tag ++ key` with `tag = [len(name)] ++ name`
//! (one length byte, 1..=63, then the tenant's name). Everything behind
//! the connection — the memory tier, pins, the second tier (which stores
//! the key it is given), shared memory, RDMA descriptors, the cluster's
//! hand-off and repair — sees only such scoped keys, so isolation holds in
//! all of them by construction, not by a check in each.
//!
//! The map `(tenant, key) -> tag(tenant) ++ key` is injective: the first
//! byte of a scoped key fixes the name's length, the next that many bytes
//! fix the name, the rest is the key. So a stored key has exactly one
//! tenant, and a connection of tenant B, whose every key is prefixed with
//! `tag(B)`, can only ever address keys whose tenant is B, whatever bytes
//! it sends (a key that itself starts with `tag(A)` becomes
//! `tag(B) ++ tag(A) ++ ...`, still B's). That holds for every tenant
//! because every tenant is tagged once a tenants file is in use, the
//! `--token-file` tenant included (as [`DEFAULT_TENANT`], a name the file
//! may not take): there is no untagged namespace a client could reach.
//! Without a tenants file there is one namespace and no tag (keys are
//! stored as sent, as before tenants existed).
//!
//! Keys are longer by the tag, so a tenant's connection is told a key limit
//! [`TAG_RESERVE`] bytes below the node's at HELLO, and a longer key is
//! refused: a scoped key then always fits the node's own limit, which the
//! other members check when repair copies it.
//!
//! # Cluster members
//!
//! Members copy stored blocks to each other (hand-off, repair) under the
//! key they hold — already scoped. They authenticate with the cluster token
//! (`--cluster-token-file`, the same file on every member), which puts the
//! connection in the cluster role: its keys are taken as they come,
//! neither scoped again nor refused for a quota (a copy brings back what a
//! tenant stored; eviction corrects an over-quota tenant, see
//! `cache/tenants.rs`). A client of the pool hashes the key it was given, unscoped, to pick
//! owners; a member computing owners from a stored key strips the tag
//! first ([`placement_key`]), so both pick the same owners. The cluster
//! token sees every tenant's keys: give it to members only.
//!
//! # Reloads
//!
//! The file is read again every reload interval and compared with what was
//! loaded. A file that does not read or validate keeps the table loaded
//! before (logged, counted in `kvplane_tenants_reload_failures`). One that
//! does replaces it: new tenants may connect at once; a tenant whose token
//! changed or who was removed is revoked, and its open connections are
//! refused at their next request (`unauthorized`, then closed); a tenant
//! whose quotas changed keeps its connections and gets the new quotas at
//! once. A tenant's account (bytes, counters) is kept by name across
//! reloads, and after a removal for as long as its blocks remain, with
//! quotas of 0 (its blocks are evicted first). A tenant added again under
//! a removed one's name has its namespace, and so its blocks.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use anyhow::Context as _;
use bytes::{BufMut, Bytes, BytesMut};
use kvplane_config::tenants::{DEFAULT_TENANT, MAX_TENANT_NAME};
use kvplane_config::TenantsFile;
use kvplane_protocol::{ErrorCode, Message, Meta, Request};
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet};
use sha2::{Digest as _, Sha256};
use tokio::sync::watch;

use crate::cache::tenants::UNLIMITED;
use crate::cache::{BlockCache, TenantAccount, TenantAccounts};

/// Bytes of the node's key limit kept for a tenant's tag: a tenant's keys
/// may be this much shorter than the node's `max_key_bytes`.
pub const TAG_RESERVE: u32 = MAX_TENANT_NAME as u32 + 1;

/// How a node takes its tenants.
#[derive(Debug, Clone)]
pub struct TenantsConfig {
    /// The tenants file.
    pub file: PathBuf,
    /// How often the file is read again.
    pub reload_interval: Duration,
    /// `--token-file`'s token: the tenant [`DEFAULT_TENANT`], no quota.
    pub default_token: Option<String>,
    /// `--cluster-token-file`'s token: the cluster role (see the module doc).
    pub cluster_token: Option<String>,
}

/// The tag a tenant's keys start with: its name's length, then its name.
fn tag(name: &str) -> Box<[u8]> {
    let mut t = Vec::with_capacity(1 + name.len());
    t.push(name.len() as u8);
    t.extend_from_slice(name.as_bytes());
    t.into_boxed_slice()
}

/// The tag a stored key starts with and the tenant's name in it; `None`
/// for a key that starts with no valid tag.
pub fn tag_of(key: &[u8]) -> Option<(&[u8], &str)> {
    let n = *key.first()? as usize;
    if n == 0 || n > MAX_TENANT_NAME || key.len() < 1 + n {
        return None;
    }
    let name = std::str::from_utf8(&key[1..1 + n]).ok()?;
    Some((&key[..1 + n], name))
}

/// The key a client of the pool hashed to place a stored key: `key`
/// without its tag when the node scopes keys (`scoped`), else `key`.
pub fn placement_key(key: &[u8], scoped: bool) -> &[u8] {
    match tag_of(key).filter(|_| scoped) {
        Some((tag, _)) => &key[tag.len()..],
        None => key,
    }
}

fn sha256(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// Compares secrets without an early exit, so timing does not reveal how
/// much of a guess was right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// One tenant as loaded.
#[derive(Debug)]
pub struct Tenant {
    name: String,
    tag: Box<[u8]>,
    digest: [u8; 32],
    account: Arc<TenantAccount>,
    /// `maxConnections` ([`UNLIMITED`]: none); changed in place by a reload.
    max_connections: AtomicU64,
    connections: AtomicU64,
    /// Set when a reload removed the tenant or changed its token.
    revoked: AtomicBool,
}

impl Tenant {
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn account(&self) -> &Arc<TenantAccount> {
        &self.account
    }

    pub fn revoked(&self) -> bool {
        self.revoked.load(Ordering::Relaxed)
    }
}

/// What a connection authenticated as.
#[derive(Debug, Default)]
pub enum Scope {
    /// No tenants file: one namespace, keys as sent.
    #[default]
    Open,
    /// The cluster role: keys as sent (already scoped), no quota.
    Cluster,
    /// A tenant: keys scoped, quotas enforced.
    Tenant(Admitted),
}

/// A tenant's connection, counted against its `maxConnections` until
/// dropped.
#[derive(Debug)]
pub struct Admitted {
    tenant: Arc<Tenant>,
    /// What the PUT being served reserved of the tenant's memory quota
    /// (a connection serves one request at a time), given back when it is
    /// answered ([`Scope::count_answer`]) or the connection ends.
    reserved: AtomicU64,
}

impl Admitted {
    fn new(tenant: Arc<Tenant>) -> Admitted {
        Admitted { tenant, reserved: AtomicU64::new(0) }
    }

    fn hold(&self, reserved: u64) {
        self.reserved.store(reserved, Ordering::Relaxed);
    }

    fn release(&self) {
        self.tenant.account.release(self.reserved.swap(0, Ordering::Relaxed));
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.release();
        self.tenant.connections.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Why a request (or a HELLO) was refused, as answered.
#[derive(Debug)]
pub struct Refusal {
    pub code: ErrorCode,
    pub message: String,
    /// The connection is closed after the answer (a revoked tenant).
    pub close: bool,
}

impl Refusal {
    /// Whether a HELLO refused so is a failed handshake of its peer (a
    /// missing or wrong token), counted towards throttling it; a tenant at
    /// its `maxConnections` presented a good token and is not.
    pub fn counts_against_peer(&self) -> bool {
        self.code == ErrorCode::Unauthorized
    }
}

fn refuse(code: ErrorCode, message: String) -> Refusal {
    Refusal { code, message, close: false }
}

#[derive(Default)]
struct Seen {
    contents: Vec<u8>,
    /// The last reload failure, so a file that stays bad (the same bytes,
    /// or the same error reading it) is logged and counted once, not every
    /// period.
    failure: Option<String>,
    failed_contents: Option<Vec<u8>>,
}

/// The node's tenants: the table as last loaded, the fixed default and
/// cluster credentials, the accounts, and the reloader's counters.
pub struct Tenants {
    config: TenantsConfig,
    table: RwLock<Arc<Vec<Arc<Tenant>>>>,
    default: Option<Arc<Tenant>>,
    cluster: Option<[u8; 32]>,
    accounts: Arc<TenantAccounts>,
    seen: Mutex<Seen>,
    reloads: AtomicU64,
    reload_failures: AtomicU64,
}

impl std::fmt::Debug for Tenants {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tenants").field("file", &self.config.file).field("tenants", &self.table().len()).finish_non_exhaustive()
    }
}

impl Tenants {
    /// Reads and validates the tenants file; errors name the file, and the
    /// tenant and field at fault.
    pub fn load(config: TenantsConfig) -> anyhow::Result<Tenants> {
        let accounts = Arc::new(TenantAccounts::default());
        let default = config.default_token.as_deref().map(|token| {
            let account = accounts.account(&tag(DEFAULT_TENANT), DEFAULT_TENANT);
            Arc::new(Tenant {
                name: DEFAULT_TENANT.into(),
                tag: tag(DEFAULT_TENANT),
                digest: sha256(token),
                account,
                max_connections: AtomicU64::new(UNLIMITED),
                connections: AtomicU64::new(0),
                revoked: AtomicBool::new(false),
            })
        });
        let cluster = config.cluster_token.as_deref().map(sha256);
        if let (Some(d), Some(c)) = (&default, &cluster) {
            if constant_time_eq(&d.digest, c) {
                anyhow::bail!("--cluster-token-file holds the same token as --token-file: the cluster's token sees every tenant's keys, give it a token of its own");
            }
        }
        let tenants = Tenants {
            config,
            table: RwLock::new(Arc::new(Vec::new())),
            default,
            cluster,
            accounts,
            seen: Mutex::new(Seen::default()),
            reloads: AtomicU64::new(0),
            reload_failures: AtomicU64::new(0),
        };
        let (contents, file) = tenants.read()?;
        tenants.install(&file);
        tenants.seen.lock().unwrap_or_else(|e| e.into_inner()).contents = contents;
        Ok(tenants)
    }

    /// The accounts the cache charges.
    pub fn accounts(&self) -> &Arc<TenantAccounts> {
        &self.accounts
    }

    pub fn file(&self) -> &std::path::Path {
        &self.config.file
    }

    fn table(&self) -> Arc<Vec<Arc<Tenant>>> {
        Arc::clone(&self.table.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// The file's names, for the start's log line.
    pub fn names(&self) -> Vec<String> {
        self.default.iter().chain(self.table().iter()).map(|t| t.name.clone()).collect()
    }

    fn read(&self) -> anyhow::Result<(Vec<u8>, TenantsFile)> {
        let path = &self.config.file;
        let contents = std::fs::read(path).with_context(|| format!("reading the tenants file {} (--tenants-file)", path.display()))?;
        let text = std::str::from_utf8(&contents).with_context(|| format!("the tenants file {} is not UTF-8", path.display()))?;
        let file: TenantsFile =
            kvplane_config::from_json_strict(text).with_context(|| format!("{}: not a tenants file", path.display()))?;
        file.validate(self.default.is_some()).with_context(|| format!("{}: invalid tenants file", path.display()))?;
        if let Some(c) = &self.cluster {
            if let Some(t) = file.tenants.iter().find(|t| t.digest().is_some_and(|d| constant_time_eq(&d, c))) {
                anyhow::bail!(
                    "{}: tenant {:?} has the digest of --cluster-token-file's token, which sees every tenant's keys: give the tenant another token",
                    path.display(),
                    t.name
                );
            }
        }
        if let Some(d) = &self.default {
            if let Some(t) = file.tenants.iter().find(|t| t.digest().is_some_and(|x| constant_time_eq(&x, &d.digest))) {
                anyhow::bail!("{}: tenant {:?} has the digest of --token-file's token (tenant {DEFAULT_TENANT:?})", path.display(), t.name);
            }
        }
        Ok((contents, file))
    }

    /// Makes `file` the table: tenants whose name and digest are unchanged
    /// stay the same `Arc` (their connections go on), with the new quotas;
    /// the others loaded before are revoked.
    fn install(&self, file: &TenantsFile) {
        let old = self.table();
        let mut next = Vec::with_capacity(file.tenants.len());
        for spec in &file.tenants {
            let digest = spec.digest().expect("validated");
            let max_connections = spec.max_connections.map_or(UNLIMITED, u64::from);
            let kept = old.iter().find(|t| t.name == spec.name && t.digest == digest);
            let tenant = match kept {
                Some(t) => Arc::clone(t),
                None => {
                    let tag = tag(&spec.name);
                    Arc::new(Tenant {
                        account: self.accounts.account(&tag, &spec.name),
                        name: spec.name.clone(),
                        tag,
                        digest,
                        max_connections: AtomicU64::new(UNLIMITED),
                        connections: AtomicU64::new(0),
                        revoked: AtomicBool::new(false),
                    })
                }
            };
            tenant.max_connections.store(max_connections, Ordering::Relaxed);
            tenant.account.set_quotas(spec.memory_bytes.bytes(), spec.pinned_bytes.bytes());
            next.push(tenant);
        }
        for t in old.iter() {
            if !next.iter().any(|n| Arc::ptr_eq(n, t)) {
                t.revoked.store(true, Ordering::Relaxed);
                // Removed (not only a new token): its blocks stay counted,
                // with quotas of 0, so that they are what eviction takes
                // first; no connection can read them any more, and they
                // should not outlive the blocks of tenants still served.
                if !next.iter().any(|n| n.name == t.name) {
                    t.account.set_quotas(0, 0);
                }
            }
        }
        *self.table.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(next);
    }

    /// Reads the file again; replaces the table if it changed and is valid.
    pub fn reload(&self) {
        let contents = match std::fs::read(&self.config.file) {
            Ok(c) => c,
            Err(e) => return self.reload_failed(format!("reading the tenants file {}: {e}", self.config.file.display())),
        };
        {
            let seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            if contents == seen.contents || seen.failed_contents.as_ref() == Some(&contents) {
                return;
            }
        }
        match self.read() {
            Ok((contents, file)) => {
                self.install(&file);
                let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
                seen.contents = contents;
                seen.failure = None;
                seen.failed_contents = None;
                self.reloads.fetch_add(1, Ordering::Relaxed);
                tracing::info!(file = %self.config.file.display(), tenants = file.tenants.len(), "tenants file reloaded");
                eprintln!("kvplane node: tenants file {} reloaded: {} tenants", self.config.file.display(), file.tenants.len());
            }
            Err(e) => {
                self.reload_failed(format!("{e:#}"));
                self.seen.lock().unwrap_or_else(|e| e.into_inner()).failed_contents = Some(contents);
            }
        }
    }

    fn reload_failed(&self, why: String) {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if seen.failure.as_deref() != Some(why.as_str()) {
            self.reload_failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(error = %why, "tenants reload failed; the tenants loaded before stay in force");
            eprintln!("kvplane node: tenants reload failed, the tenants loaded before stay in force: {why}");
            seen.failure = Some(why);
        }
    }

    /// Reloads every interval until shutdown.
    pub(crate) async fn watch(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        let every = self.config.reload_interval.max(Duration::from_millis(100));
        loop {
            tokio::select! {
                _ = tokio::time::sleep(every) => self.reload(),
                _ = shutdown.changed() => return,
            }
        }
    }

    /// The scope `token` authenticates into, or why none: every digest is
    /// compared (no early exit), so timing says nothing of which matched.
    pub fn authenticate(&self, token: Option<&str>) -> Result<Scope, Refusal> {
        let Some(token) = token else {
            return Err(refuse(ErrorCode::Unauthorized, "this node requires a bearer token".into()));
        };
        let digest = sha256(token);
        let table = self.table();
        let mut found: Option<&Arc<Tenant>> = None;
        for t in self.default.iter().chain(table.iter()) {
            if constant_time_eq(&t.digest, &digest) {
                found = Some(t);
            }
        }
        let cluster = self.cluster.as_ref().is_some_and(|c| constant_time_eq(c, &digest));
        if cluster {
            return Ok(Scope::Cluster);
        }
        let Some(tenant) = found else {
            return Err(refuse(ErrorCode::Unauthorized, "wrong bearer token".into()));
        };
        let held = tenant.connections.fetch_add(1, Ordering::Relaxed);
        let admitted = Admitted::new(Arc::clone(tenant));
        let max = tenant.max_connections.load(Ordering::Relaxed);
        if held >= max {
            tenant.account.refused_connections.fetch_add(1, Ordering::Relaxed);
            return Err(refuse(
                ErrorCode::Unavailable,
                format!("tenant '{}' already holds {max} connections, its maxConnections in the tenants file; retry later", tenant.name),
            ));
        }
        Ok(Scope::Tenant(admitted))
    }

    /// Encodes the tenants' series for `/metrics`.
    pub(crate) fn encode_metrics(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
        use crate::telemetry::{counter, counters};
        let all = self.accounts.all();
        let each = |f: &dyn Fn(&TenantAccount) -> u64| -> Vec<(TenantLabel, u64)> {
            all.iter().map(|a| (TenantLabel { tenant: a.name().to_string() }, f(a))).collect()
        };
        gauges(
            e,
            "kvplane_tenant_bytes",
            "Bytes of the memory tier the tenant's blocks hold (each by its size class)",
            &each(&|a| a.bytes()),
        )?;
        gauges(
            e,
            "kvplane_tenant_pinned_bytes",
            "Bytes of the tenant's blocks under an unexpired pin lease",
            &each(&|a| a.pinned_bytes()),
        )?;
        gauges(
            e,
            "kvplane_tenant_memory_quota_bytes",
            "The tenant's memoryBytes (absent: none)",
            &each(&|a| a.memory_quota()).into_iter().filter(|(_, v)| *v != UNLIMITED).collect::<Vec<_>>(),
        )?;
        gauges(
            e,
            "kvplane_tenant_pinned_quota_bytes",
            "The tenant's pinnedBytes (absent: none)",
            &each(&|a| a.pinned_quota()).into_iter().filter(|(_, v)| *v != UNLIMITED).collect::<Vec<_>>(),
        )?;
        counters(e, "kvplane_tenant_hits", "GET keys of the tenant found", &each(&|a| a.hits.load(Ordering::Relaxed)))?;
        counters(e, "kvplane_tenant_misses", "GET keys of the tenant not found", &each(&|a| a.misses.load(Ordering::Relaxed)))?;
        counters(
            e,
            "kvplane_tenant_evictions",
            "The tenant's blocks evicted to make room",
            &each(&|a| a.evictions.load(Ordering::Relaxed)),
        )?;
        let refusals: Vec<(RefusalLabel, u64)> = all
            .iter()
            .flat_map(|a| {
                [
                    ("memoryBytes", a.refused_memory.load(Ordering::Relaxed)),
                    ("pinnedBytes", a.refused_pinned.load(Ordering::Relaxed)),
                    ("maxConnections", a.refused_connections.load(Ordering::Relaxed)),
                ]
                .map(|(quota, v)| (RefusalLabel { tenant: a.name().to_string(), quota }, v))
            })
            .collect();
        counters(e, "kvplane_tenant_refusals", "Requests of the tenant refused for a quota, by quota", &refusals)?;
        let connections: Vec<(TenantLabel, u64)> = self
            .default
            .iter()
            .chain(self.table().iter())
            .map(|t| (TenantLabel { tenant: t.name.clone() }, t.connections.load(Ordering::Relaxed)))
            .collect();
        gauges(e, "kvplane_tenant_connections", "Connections open as the tenant", &connections)?;
        counter(e, "kvplane_tenants_reloads", "Tenants files loaded again after they changed", self.reloads.load(Ordering::Relaxed))?;
        counter(
            e,
            "kvplane_tenants_fruitless_eviction_passes",
            "Evictions that looked for a block of a tenant over its quota and found none evictable (pinned or being read); \
             such a look is not repeated within 50 ms",
            self.accounts.fruitless_passes.load(Ordering::Relaxed),
        )?;
        counter(
            e,
            "kvplane_tenants_reload_failures",
            "Tenants file reloads that failed (the tenants loaded before stayed in force)",
            self.reload_failures.load(Ordering::Relaxed),
        )
    }

    /// The reloader's counters, for STATS.
    pub(crate) fn stats(&self) -> Vec<(String, u64)> {
        vec![
            ("tenants".into(), self.table().len() as u64 + u64::from(self.default.is_some())),
            ("tenants_reloads".into(), self.reloads.load(Ordering::Relaxed)),
            ("tenants_reload_failures".into(), self.reload_failures.load(Ordering::Relaxed)),
        ]
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantLabel {
    tenant: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefusalLabel {
    tenant: String,
    quota: &'static str,
}

/// A gauge family with one series per `(labels, value)`.
fn gauges<L: EncodeLabelSet + std::fmt::Debug>(e: &mut DescriptorEncoder, name: &str, help: &str, series: &[(L, u64)]) -> std::fmt::Result {
    use prometheus_client::encoding::EncodeMetric as _;
    use prometheus_client::metrics::gauge::ConstGauge;
    let mut family = e.encode_descriptor(name, help, None, prometheus_client::metrics::MetricType::Gauge)?;
    for (labels, value) in series {
        ConstGauge::<i64>::new(i64::try_from(*value).unwrap_or(i64::MAX)).encode(family.encode_family(labels)?)?;
    }
    Ok(())
}

impl Scope {
    /// The tenant's account, for a tenant's connection.
    pub fn account(&self) -> Option<&Arc<TenantAccount>> {
        match self {
            Scope::Tenant(a) => Some(&a.tenant.account),
            _ => None,
        }
    }

    /// The key limit this connection is told at HELLO: the node's, less
    /// [`TAG_RESERVE`] for a tenant.
    pub fn max_key_bytes(&self, node: u32) -> u32 {
        match self {
            Scope::Tenant(_) => node.saturating_sub(TAG_RESERVE),
            _ => node,
        }
    }

    /// Rewrites the keys of a decoded request into the tenant's namespace
    /// and checks its quotas; a connection without a tenant gets `meta`
    /// back as it came. Called once per request, right after decoding.
    ///
    /// Refused, with the reason: any request of a revoked tenant (and the
    /// connection closed); a key longer than the tenant's limit; a PUT or
    /// PUT_SHM whose blocks would take the tenant past its `memoryBytes`
    /// (nothing of it is stored: the whole frame is checked before any
    /// block is read); a MATCH_PREFIX with a lease while the tenant's
    /// pinned bytes are at its `pinnedBytes`.
    pub fn admit(&self, meta: Meta, cache: &BlockCache, tenants: Option<&Tenants>, node_max_key: u32) -> Result<Meta, Refusal> {
        let Scope::Tenant(admitted) = self else { return Ok(meta) };
        // Whatever an earlier request left reserved (each is released when
        // answered; this is only the backstop).
        admitted.release();
        let tenant = &admitted.tenant;
        if tenant.revoked() {
            let file = tenants.map_or_else(String::new, |t| format!(" {}", t.file().display()));
            return Err(Refusal {
                code: ErrorCode::Unauthorized,
                message: format!(
                    "tenant '{}' was removed from the tenants file{file}, or its token changed: connect again with a current token",
                    tenant.name
                ),
                close: true,
            });
        }
        let max_key = self.max_key_bytes(node_max_key) as usize;
        let scope = |key: &Bytes| -> Result<Bytes, Refusal> {
            if key.len() > max_key {
                return Err(refuse(
                    ErrorCode::Invalid,
                    format!(
                        "key of {} bytes: a tenant's keys are at most {max_key} bytes (the node's key limit less {TAG_RESERVE} for the tenant's tag)",
                        key.len()
                    ),
                ));
            }
            let mut scoped = BytesMut::with_capacity(tenant.tag.len() + key.len());
            scoped.put_slice(&tenant.tag);
            scoped.put_slice(key);
            Ok(scoped.freeze())
        };
        let scope_all = |keys: &mut Vec<Bytes>| -> Result<(), Refusal> {
            for k in keys.iter_mut() {
                *k = scope(k)?;
            }
            Ok(())
        };
        Ok(match meta {
            Meta::Put(mut slots) => {
                for s in slots.iter_mut() {
                    s.key = scope(&s.key)?;
                }
                admitted.hold(tenant.fits(cache, slots.iter().map(|s| (&s.key, s.len)))?);
                Meta::Put(slots)
            }
            Meta::Complete(Message::Request(mut request)) => {
                match &mut request {
                    Request::Get { keys } | Request::Exists { keys } | Request::Delete { keys } | Request::RdmaDescribe { keys, .. } => {
                        scope_all(keys)?
                    }
                    Request::MatchPrefix { keys, lease_ms } => {
                        scope_all(keys)?;
                        if *lease_ms > 0 {
                            tenant.may_pin(cache, keys)?;
                        }
                    }
                    Request::PutShm { entries } => {
                        for e in entries.iter_mut() {
                            e.key = scope(&e.key)?;
                        }
                        admitted.hold(tenant.fits(cache, entries.iter().map(|e| (&e.key, e.len)))?);
                    }
                    Request::GetShm { entries } => {
                        for e in entries.iter_mut() {
                            e.key = scope(&e.key)?;
                        }
                    }
                    Request::Put { entries } => {
                        for e in entries.iter_mut() {
                            e.key = scope(&e.key)?;
                        }
                    }
                    Request::Hello(_)
                    | Request::Stats
                    | Request::Ping
                    | Request::ClusterTable { .. }
                    | Request::ShmAttach
                    | Request::RdmaConnect { .. } => {}
                }
                Meta::Complete(Message::Request(request))
            }
            other => other,
        })
    }

    /// Called with every answer to a request [`Scope::admit`] let in,
    /// before it is sent: gives back what a PUT reserved of the tenant's
    /// quota (its blocks are stored, and counted, by now), and counts a
    /// GET's (or GET_SHM's) hits and misses on the tenant's account:
    /// atomics of an `Arc` the connection holds, no lookup.
    pub fn count_answer(&self, response: &kvplane_protocol::Response) {
        use kvplane_protocol::Response;
        let Scope::Tenant(admitted) = self else { return };
        admitted.release();
        let account = &admitted.tenant.account;
        let (mut hits, mut misses) = (0u64, 0u64);
        let mut tally = |found: bool, not_found: bool| {
            hits += u64::from(found);
            misses += u64::from(not_found);
        };
        match response {
            Response::Get { results } => results.iter().for_each(|r| tally(r.is_ok(), matches!(r, Err(ErrorCode::NotFound)))),
            Response::GetShm { results } => results.iter().for_each(|r| tally(r.is_ok(), matches!(r, Err(ErrorCode::NotFound)))),
            _ => return,
        }
        account.hits.fetch_add(hits, Ordering::Relaxed);
        account.misses.fetch_add(misses, Ordering::Relaxed);
    }
}

impl Tenant {
    /// Whether blocks of `lens` under `keys` (scoped) fit in the tenant's
    /// memory quota, each counted by the pool memory it will take, beside
    /// what its other PUTs in flight reserved; if so, reserves them and
    /// returns what it reserved. A PUT replacing blocks of the tenant's
    /// own is let in on the difference (looked up only when the quick sum
    /// does not fit), with all it brings reserved.
    fn fits<'k>(&self, cache: &BlockCache, blocks: impl Iterator<Item = (&'k Bytes, u32)> + Clone) -> Result<u64, Refusal> {
        let account = &self.account;
        let quota = account.memory_quota();
        if quota == UNLIMITED {
            return Ok(0);
        }
        // Charged as the cache charges them: the pool memory each takes
        // (its size class), not the bytes sent (see `cache/tenants.rs`).
        let incoming: u64 = blocks.clone().map(|(_, len)| account.held_by(u64::from(len))).sum();
        // Reserved until the PUT is answered, so that the tenant's PUTs in
        // flight on other connections count (see `TenantAccount::reserve`).
        if account.reserve(incoming, quota) {
            return Ok(incoming);
        }
        // The blocks it replaces are freed: a credit. All it brings stays
        // reserved, the credit only lets it in: the replaced block is
        // freed as the PUT lands, before the rest of its blocks have, and a
        // reservation of the difference alone let the next PUT in on that
        // moment (16 connections replacing one block stored 1 MiB + 4 KiB
        // against 1 MiB). What is left: a PUT that reads a replaced
        // block's size before another PUT of the tenant replaces it, and
        // the tenant's bytes after, may pass the quota by that block.
        let replaced: u64 = blocks.clone().filter_map(|(k, _)| cache.stored_len(k)).map(|len| account.held_by(len)).sum();
        if account.reserve(incoming, quota.saturating_add(replaced)) {
            return Ok(incoming);
        }
        account.refused_memory.fetch_add(1, Ordering::Relaxed);
        let n = blocks.count();
        let held = account.bytes();
        let pending = match account.reserved() {
            0 => String::new(),
            r => format!(" (and its PUTs in flight {r} more)"),
        };
        Err(refuse(
            ErrorCode::Capacity,
            format!(
                "tenant '{}' holds {held} of its memoryBytes quota {quota}{pending}; this PUT of {n} blocks ({incoming} bytes of pool memory) \
                 would pass it, so none of them was stored: delete some of the tenant's blocks, or raise its memoryBytes in the tenants file",
                self.name
            ),
        ))
    }

    /// Whether the tenant may pin more, and how far: not while its pinned
    /// bytes are at its `pinnedBytes` (counted once the pins that ran out
    /// are cleared; a lease on blocks all pinned already still is), and a
    /// lease's chain only as far as the quota has room for: `keys` is cut
    /// before the first block in memory that would pass it (an answer that
    /// matches fewer, counted as a refusal). Before, a lease asked for
    /// below the quota pinned the whole chain: a tenant of `pinnedBytes:
    /// 64Ki` pinned 4 MiB, 64 blocks of its own, in one MATCH_PREFIX.
    /// Cut here, not only where the cache pins (`TenantAccount::try_pin`),
    /// because a chain the cache ends early is read through from the
    /// second tier from there on. A key not in memory ends what can be
    /// known here; the cache holds the rest to the quota.
    fn may_pin(&self, cache: &BlockCache, keys: &mut Vec<Bytes>) -> Result<(), Refusal> {
        let account = &self.account;
        let quota = account.pinned_quota();
        if quota == UNLIMITED {
            return Ok(());
        }
        if account.pinned_bytes() >= quota {
            cache.expire_pins();
        }
        let pinned = account.pinned_bytes();
        let room = quota.saturating_sub(pinned);
        let mut used = 0u64;
        let mut fit = keys.len();
        for (i, k) in keys.iter().enumerate() {
            let Some((len, pinned_already)) = cache.pin_state(k) else { break };
            used = used.saturating_add(if pinned_already { 0 } else { account.held_by(len) });
            if used > room {
                fit = i;
                break;
            }
        }
        if fit == keys.len() {
            return Ok(());
        }
        account.refused_pinned.fetch_add(1, Ordering::Relaxed);
        if fit > 0 {
            keys.truncate(fit);
            return Ok(());
        }
        Err(refuse(
            ErrorCode::Capacity,
            format!(
                "tenant '{}' holds {pinned} of its pinnedBytes quota {quota} under prefix leases; this MATCH_PREFIX asks for a lease \
                 of more than the rest: ask without one (lease 0), wait for the leases to end, or raise its pinnedBytes in the tenants file",
                self.name
            ),
        ))
    }
}

/// The tenants' series in `/metrics`, read at scrape time.
pub(crate) struct Collector(pub(crate) std::sync::Weak<Tenants>);

impl std::fmt::Debug for Collector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TenantsCollector")
    }
}

impl prometheus_client::collector::Collector for Collector {
    fn encode(&self, mut e: DescriptorEncoder) -> std::fmt::Result {
        match self.0.upgrade() {
            Some(t) => t.encode_metrics(&mut e),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(d: [u8; 32]) -> String {
        d.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn config(dir: &std::path::Path, tenants: &[(&str, &str)], default: Option<&str>, cluster: Option<&str>) -> TenantsConfig {
        let list: Vec<String> = tenants
            .iter()
            .map(|(n, t)| format!(r#"{{"name": "{n}", "tokenSha256": "{}", "memoryBytes": "1Mi", "pinnedBytes": 0}}"#, hex(sha256(t))))
            .collect();
        let file = dir.join("tenants.json");
        std::fs::write(&file, format!(r#"{{"tenants": [{}]}}"#, list.join(","))).unwrap();
        TenantsConfig {
            file,
            reload_interval: Duration::from_secs(1),
            default_token: default.map(str::to_string),
            cluster_token: cluster.map(str::to_string),
        }
    }

    fn tenant_of(scope: Result<Scope, Refusal>) -> Result<String, String> {
        match scope {
            Ok(Scope::Tenant(a)) => Ok(a.tenant.name.clone()),
            Ok(Scope::Cluster) => Ok("<cluster>".into()),
            Ok(Scope::Open) => Ok("<open>".into()),
            Err(r) => Err(r.message),
        }
    }

    #[test]
    fn a_token_authenticates_into_its_tenant_the_default_or_the_cluster_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let t = Tenants::load(config(dir.path(), &[("a", "ta"), ("b", "tb")], Some("td"), Some("tc"))).unwrap();
        assert_eq!(tenant_of(t.authenticate(Some("ta"))), Ok("a".into()));
        assert_eq!(tenant_of(t.authenticate(Some("tb"))), Ok("b".into()));
        assert_eq!(tenant_of(t.authenticate(Some("td"))), Ok(DEFAULT_TENANT.into()));
        assert_eq!(tenant_of(t.authenticate(Some("tc"))), Ok("<cluster>".into()));
        assert_eq!(tenant_of(t.authenticate(Some("tx"))), Err("wrong bearer token".into()));
        assert_eq!(tenant_of(t.authenticate(None)), Err("this node requires a bearer token".into()));
        // A reload: b's token changes, c arrives; a's Arc (and connections) stay.
        let a_before = match t.authenticate(Some("ta")) {
            Ok(Scope::Tenant(a)) => Arc::clone(&a.tenant),
            _ => unreachable!(),
        };
        config(dir.path(), &[("a", "ta"), ("b", "tb2"), ("c", "tc3")], None, None);
        t.reload();
        assert!(!a_before.revoked() && t.table().iter().any(|x| Arc::ptr_eq(x, &a_before)));
        assert_eq!(tenant_of(t.authenticate(Some("tb"))), Err("wrong bearer token".into()));
        assert_eq!(tenant_of(t.authenticate(Some("tb2"))), Ok("b".into()));
        assert_eq!(tenant_of(t.authenticate(Some("tc3"))), Ok("c".into()));
        assert_eq!(t.reloads.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_cluster_token_shared_with_a_tenant_or_the_default_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let e = Tenants::load(config(dir.path(), &[("a", "same")], None, Some("same"))).unwrap_err().to_string();
        assert!(e.contains("tenant \"a\" has the digest of --cluster-token-file's token"), "{e}");
        let e = Tenants::load(config(dir.path(), &[], Some("same"), Some("same"))).unwrap_err().to_string();
        assert!(e.contains("--cluster-token-file holds the same token as --token-file"), "{e}");
        let e = Tenants::load(config(dir.path(), &[("a", "same")], Some("same"), None)).unwrap_err().to_string();
        assert!(e.contains("has the digest of --token-file's token"), "{e}");
    }

    #[test]
    fn scoped_keys_of_two_tenants_never_meet() {
        // Whatever B sends, its scoped key starts with B's tag, and the tag
        // of a scoped key gives back its tenant.
        let (a, b) = (tag("a"), tag("b"));
        let forged: Vec<u8> = [&a[..], b"k"].concat();
        let b_scoped: Vec<u8> = [&b[..], &forged[..]].concat();
        assert_ne!(b_scoped, forged);
        assert_eq!(tag_of(&b_scoped).map(|(_, n)| n), Some("b"));
        assert_eq!(tag_of(&forged).map(|(_, n)| n), Some("a"));
        assert_eq!(placement_key(&b_scoped, true), &forged[..]);
        assert_eq!(placement_key(b"\x05ab", true), b"\x05ab", "no valid tag: as stored");
        assert_eq!(placement_key(&forged, false), &forged[..]);
        assert!(tag_of(b"").is_none() && tag_of(b"\x00k").is_none() && tag_of(&[64u8; 80]).is_none());
    }
}
