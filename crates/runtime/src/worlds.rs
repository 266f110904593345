//! Typed handles for the four plugin worlds: the API the rest of the host
//! calls. Each validates the plugin's answer against the contract and
//! applies the declaration's failure policy.
//!
//! The handles take and answer the host's own types, not the generated
//! bindings: the retry-policy and backend worlds' types are defined here,
//! the placement-rule world's records in [`crate::scheduling`]; errors are
//! [`KvError`], members and slot tables `kvplane_slots` types. Each handle
//! converts them to and from the bindings inside its call (the `From` impls
//! below), so a caller never names generated code and a change of the
//! bindings stays in this crate.

use std::sync::Arc;

use bytes::Bytes;
use kvplane_protocol::KvError;
use kvplane_slots::{Member, RingTableError, SlotTable, DEFAULT_VNODES};

use super::bindings::{self, placement, retry, store, WitMember};
use super::buffer::{BlockBuffer, Region, WritableMemory};
use super::decl::FailurePolicy;
use super::error::{Fault, PluginError};
use super::pool::{Plugin, SchedulingGuest};
use super::scheduling::{Placement, PodRequest};

/// The store operation that failed, as a retry policy is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Put,
    Get,
    Exists,
    Delete,
}

/// Everything known about one failed attempt: what a retry policy decides
/// on ([`RetryPolicy::decide`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub operation: Operation,
    /// Whether repeating the operation is harmless (true for get, exists,
    /// delete, and for put of content-addressed keys).
    pub idempotent: bool,
    /// The node id or backend the attempt went to.
    pub target: String,
    /// Which owner of the key that was: 0 for the primary, 1 for the first
    /// replica, ...
    pub replica: u32,
    /// 1 for the first failure of this operation, 2 after one retry, ...
    pub attempt: u32,
    /// What went wrong this time.
    pub error: KvError,
    /// Milliseconds since the first attempt started.
    pub elapsed_ms: u64,
    /// Milliseconds left before the caller's deadline; a retry that cannot
    /// finish in it is wasted.
    pub deadline_left_ms: u64,
    /// A random number drawn by the caller for this decision, so that
    /// plugins need no randomness of their own and tests can replay it.
    pub jitter_seed: u64,
}

/// What a retry policy decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Try the same target again after this many milliseconds.
    RetryAfter(u64),
    /// Try the next replica / owner now.
    FailOver,
    /// Stop and report the error to the caller.
    GiveUp,
}

/// Options that travel with one [`Backend`] call. `None` in a field means
/// the backend's configured default, which is what [`Default`] gives.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BackendCallOptions {
    /// Time to live of written values in milliseconds; `None`: the
    /// backend's configured default (or forever).
    pub ttl_ms: Option<u64>,
    /// Namespace the keys live in, applied to every operation including
    /// `exists`; `None`: the backend's configured default.
    pub namespace: Option<String>,
}

/// What a backend plugin announces it can do ([`Backend::features`]).
/// The default announces nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BackendFeatures {
    /// `put` of many keys travels in one round trip (pipelined / MSET).
    pub batch_put: bool,
    /// `get` of many keys travels in one round trip (pipelined / MGET).
    pub batch_get: bool,
    /// `exists` is answered without transferring values.
    pub exists: bool,
    /// Keys can be deleted.
    pub delete: bool,
    /// Stored values expire after the configured time to live.
    pub ttl: bool,
    /// Keys are isolated under a configurable namespace (key prefix).
    pub namespaces: bool,
}

// The boundary of the retry-policy and backend worlds: what goes into a
// call is converted to the bindings, what comes out from them.

impl From<Operation> for retry::Operation {
    fn from(op: Operation) -> Self {
        match op {
            Operation::Put => retry::Operation::Put,
            Operation::Get => retry::Operation::Get,
            Operation::Exists => retry::Operation::Exists,
            Operation::Delete => retry::Operation::Delete,
        }
    }
}

impl From<Failure> for retry::Failure {
    fn from(f: Failure) -> Self {
        retry::Failure {
            operation: f.operation.into(),
            idempotent: f.idempotent,
            target: f.target,
            replica: f.replica,
            attempt: f.attempt,
            error: f.error.into(),
            elapsed_ms: f.elapsed_ms,
            deadline_left_ms: f.deadline_left_ms,
            jitter_seed: f.jitter_seed,
        }
    }
}

impl From<retry::Decision> for Decision {
    fn from(d: retry::Decision) -> Self {
        match d {
            retry::Decision::RetryAfter(ms) => Decision::RetryAfter(ms),
            retry::Decision::FailOver => Decision::FailOver,
            retry::Decision::GiveUp => Decision::GiveUp,
        }
    }
}

impl From<BackendCallOptions> for bindings::CallOptions {
    fn from(o: BackendCallOptions) -> Self {
        bindings::CallOptions { ttl_ms: o.ttl_ms, namespace: o.namespace }
    }
}

impl From<bindings::BackendFeatures> for BackendFeatures {
    fn from(f: bindings::BackendFeatures) -> Self {
        use bindings::BackendFeatures as F;
        BackendFeatures {
            batch_put: f.contains(F::BATCH_PUT),
            batch_get: f.contains(F::BATCH_GET),
            exists: f.contains(F::EXISTS),
            delete: f.contains(F::DELETE),
            ttl: f.contains(F::TTL),
            namespaces: f.contains(F::NAMESPACES),
        }
    }
}

/// Log and count a fail-open fallback; return whether to fall back.
fn falls_open<G: super::pool::GuestExports>(plugin: &Plugin<G>, error: &PluginError) -> bool {
    let open = plugin.decl().failure_policy == FailurePolicy::FailOpen && error.fault.is_breakage();
    if open {
        tracing::warn!("{error}; failing open with the default");
        plugin.metrics().record_fail_open(&plugin.decl().name);
    }
    open
}

/// A key-placement plugin: computes slot tables.
pub struct KeyPlacement {
    pub plugin: Plugin<placement::Guest>,
}

impl KeyPlacement {
    pub(crate) fn new(plugin: Plugin<placement::Guest>) -> Self {
        KeyPlacement { plugin }
    }

    /// The slot table of `members` (sorted here by id) with `slots` slots
    /// and up to `replicas` owners each, checked against the contract.
    ///
    /// Fail-open default: the native ring ([`SlotTable::from_ring`]) over the
    /// same membership, so a broken plugin never leaves keys unowned.
    pub async fn compute(&self, version: u64, mut members: Vec<Member>, slots: u32, replicas: u32) -> Result<SlotTable, PluginError> {
        members.sort_by(|a, b| a.id.cmp(&b.id));
        let wit: Arc<Vec<WitMember>> = Arc::new(members.iter().map(WitMember::from).collect());
        let checked_members = members.clone();
        let result = self
            .plugin
            .call("compute", move |inst| {
                Box::pin(async move {
                    Ok(match inst.guest.call_compute(&mut inst.store, &wit, slots, replicas).await? {
                        Err(e) => Err(Fault::Returned(e.into())),
                        Ok(t) => SlotTable::new(version, checked_members, slots, replicas, t.replicas, t.owners)
                            .map_err(|e| Fault::BadOutput(e.to_string())),
                    })
                })
            })
            .await;
        match result {
            Err(e) if falls_open(&self.plugin, &e) => native_slot_table(version, members, slots, replicas).map_err(|_| e),
            other => other,
        }
    }
}

/// The fail-open default placement: `builtin:ring`'s table with its default
/// virtual nodes, computed natively. A membership the ring cannot place is
/// `Invalid`; a table breaking the contract would be a bug (`Internal`).
pub fn native_slot_table(version: u64, members: Vec<Member>, slots: u32, replicas: u32) -> Result<SlotTable, KvError> {
    SlotTable::from_ring(version, members, slots, replicas, DEFAULT_VNODES).map_err(|e| match e {
        RingTableError::Ring(e) => KvError::Invalid(e.to_string()),
        RingTableError::Table(e) => KvError::Internal(e.to_string()),
    })
}

/// A retry-policy plugin.
pub struct RetryPolicy {
    pub plugin: Plugin<retry::Guest>,
}

impl RetryPolicy {
    /// What to do about `failure`. `jitter_seed` is drawn by the caller.
    /// Fail-open default: give up (the caller sees the original error).
    pub async fn decide(&self, failure: Failure) -> Result<Decision, PluginError> {
        let failure = retry::Failure::from(failure);
        let result = self
            .plugin
            .call("decide", move |inst| Box::pin(async move { Ok(Ok(inst.guest.call_decide(&mut inst.store, &failure).await?.into())) }))
            .await;
        match result {
            Err(e) if falls_open(&self.plugin, &e) => Ok(Decision::GiveUp),
            other => other,
        }
    }
}

/// A placement-rule plugin (0.2.0, or 0.1.0 whose world did not change).
pub struct PlacementRule {
    pub plugin: Plugin<SchedulingGuest>,
}

impl PlacementRule {
    /// Scheduling constraints for `request`'s pods, validated as Kubernetes
    /// would. Fail-open default: no constraints.
    pub async fn place(&self, request: PodRequest) -> Result<Placement, PluginError> {
        let request = bindings::scheduling::PodRequest::from(request);
        let result = self
            .plugin
            .call("place", move |inst| {
                Box::pin(async move {
                    Ok(match inst.guest.call_place(&mut inst.store, &request).await? {
                        Err(e) => Err(Fault::Returned(e.into())),
                        Ok(p) => {
                            let p = Placement::from(p);
                            crate::placement_rule::validate(&p).map(|()| p).map_err(Fault::BadOutput)
                        }
                    })
                })
            })
            .await;
        match result {
            Err(e) if falls_open(&self.plugin, &e) => Ok(Placement::default()),
            other => other,
        }
    }
}

/// A backend plugin: the second storage tier.
pub struct Backend {
    pub plugin: Plugin<store::Guest>,
}

fn check_count<T>(function: &str, keys: usize, results: Vec<T>) -> Result<Vec<T>, Fault> {
    if results.len() == keys {
        Ok(results)
    } else {
        Err(Fault::BadOutput(format!("{function} answered {} results for {keys} keys", results.len())))
    }
}

/// Lend `regions` to an instance as owned handles. On `capacity` (the
/// instance already holds too many buffers) the call is not made.
fn lend(
    state: &mut super::host::HostState,
    regions: &[Arc<Region>],
) -> wasmtime::Result<Result<Vec<wasmtime::component::Resource<BlockBuffer>>, Fault>> {
    let mut handles = Vec::with_capacity(regions.len());
    for r in regions {
        match state.push_buffer(BlockBuffer::whole(r.clone()))? {
            Ok(h) => handles.push(h),
            Err(e) => return Ok(Err(Fault::Returned(e.into()))),
        }
    }
    Ok(Ok(handles))
}

impl Backend {
    pub async fn features(&self) -> Result<BackendFeatures, PluginError> {
        self.plugin.call("features", |inst| Box::pin(async move { Ok(Ok(inst.guest.call_features(&mut inst.store).await?.into())) })).await
    }

    /// Store each (key, payload). The payloads are lent to the plugin as
    /// source buffers: shared, never copied, and taken back when the call
    /// returns. Fail-open default: the write is skipped (a later read misses).
    pub async fn put(&self, entries: Vec<(Vec<u8>, Bytes)>, options: BackendCallOptions) -> Result<Vec<Result<(), KvError>>, PluginError> {
        let n = entries.len();
        let options = bindings::CallOptions::from(options);
        let (keys, payloads): (Vec<Vec<u8>>, Vec<Bytes>) = entries.into_iter().unzip();
        let regions: Vec<Arc<Region>> = payloads.into_iter().map(Region::source).collect();
        let lent = regions.clone();
        let result = self
            .plugin
            .call("put", move |inst| {
                Box::pin(async move {
                    let handles = match lend(inst.store.data_mut(), &lent)? {
                        Ok(h) => h,
                        Err(f) => return Ok(Err(f)),
                    };
                    let entries: Vec<_> = keys.into_iter().zip(handles).collect();
                    let answer = inst.guest.call_put(&mut inst.store, &entries, &options).await?;
                    Ok(check_count("put", n, answer).map(|r| r.into_iter().map(|r| r.map_err(KvError::from)).collect()))
                })
            })
            .await;
        for r in &regions {
            r.release();
        }
        match result {
            Err(e) if falls_open(&self.plugin, &e) => Ok((0..n).map(|_| Ok(())).collect()),
            other => other,
        }
    }

    /// Fill each destination with its key's value: the plugin reads from the
    /// store straight into the caller's memory (`read-into`, a driver get).
    /// Answers the memories back, in order, with each key's result (the
    /// length written). Fail-open default: every key misses.
    pub async fn get<M: WritableMemory>(
        &self,
        entries: Vec<(Vec<u8>, M)>,
        options: BackendCallOptions,
    ) -> (Vec<M>, Result<Vec<Result<usize, KvError>>, PluginError>) {
        let n = entries.len();
        let options = bindings::CallOptions::from(options);
        let (keys, memories): (Vec<Vec<u8>>, Vec<M>) = entries.into_iter().unzip();
        let regions: Vec<Arc<Region>> = memories.into_iter().map(Region::destination).collect();
        let sizes: Vec<usize> = regions.iter().map(|r| r.len()).collect();
        let lent = regions.clone();
        let result = self
            .plugin
            .call("get", move |inst| {
                Box::pin(async move {
                    let handles = match lend(inst.store.data_mut(), &lent)? {
                        Ok(h) => h,
                        Err(f) => return Ok(Err(f)),
                    };
                    let entries: Vec<_> = keys.into_iter().zip(handles).collect();
                    let answer = inst.guest.call_get(&mut inst.store, &entries, &options).await?;
                    let answer = match check_count("get", n, answer) {
                        Ok(a) => a,
                        Err(f) => return Ok(Err(f)),
                    };
                    let mut out = Vec::with_capacity(n);
                    for (i, r) in answer.into_iter().enumerate() {
                        out.push(match r {
                            Ok(len) if len as usize <= sizes[i] => Ok(len as usize),
                            Ok(len) => {
                                return Ok(Err(Fault::BadOutput(format!(
                                    "get answered {len} bytes for key #{i} into a {}-byte destination",
                                    sizes[i]
                                ))))
                            }
                            Err(e) => Err(KvError::from(e)),
                        });
                    }
                    Ok(Ok(out))
                })
            })
            .await;
        let mut memories = Vec::with_capacity(n);
        for r in &regions {
            memories.push(r.reclaim::<M>().await);
        }
        let result = match result {
            Err(e) if falls_open(&self.plugin, &e) => Ok((0..n).map(|_| Err(KvError::NotFound)).collect()),
            other => other,
        };
        (memories, result)
    }

    /// Whether each key exists. Fail-open default: none does.
    pub async fn exists(&self, keys: Vec<Vec<u8>>, options: BackendCallOptions) -> Result<Vec<Result<bool, KvError>>, PluginError> {
        let n = keys.len();
        let options = bindings::CallOptions::from(options);
        let result = self
            .plugin
            .call("exists", move |inst| {
                Box::pin(async move {
                    let answer = inst.guest.call_exists(&mut inst.store, &keys, &options).await?;
                    Ok(check_count("exists", keys.len(), answer).map(|r| r.into_iter().map(|r| r.map_err(KvError::from)).collect()))
                })
            })
            .await;
        match result {
            Err(e) if falls_open(&self.plugin, &e) => Ok((0..n).map(|_| Ok(false)).collect()),
            other => other,
        }
    }

    /// Remove each key. Fail-open default: skipped.
    pub async fn delete(&self, keys: Vec<Vec<u8>>, options: BackendCallOptions) -> Result<Vec<Result<(), KvError>>, PluginError> {
        let n = keys.len();
        let options = bindings::CallOptions::from(options);
        let result = self
            .plugin
            .call("delete", move |inst| {
                Box::pin(async move {
                    let answer = inst.guest.call_delete(&mut inst.store, &keys, &options).await?;
                    Ok(check_count("delete", keys.len(), answer).map(|r| r.into_iter().map(|r| r.map_err(KvError::from)).collect()))
                })
            })
            .await;
        match result {
            Err(e) if falls_open(&self.plugin, &e) => Ok((0..n).map(|_| Ok(())).collect()),
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduling::tests::same_case;

    #[test]
    fn every_case_keeps_its_name_across_the_boundary() {
        for op in [Operation::Put, Operation::Get, Operation::Exists, Operation::Delete] {
            same_case::<_, retry::Operation>(op);
        }
        for d in [retry::Decision::RetryAfter(3), retry::Decision::FailOver, retry::Decision::GiveUp] {
            same_case::<_, Decision>(d);
        }
        assert_eq!(Decision::from(retry::Decision::RetryAfter(3)), Decision::RetryAfter(3));
    }

    #[test]
    fn every_backend_feature_is_read() {
        use bindings::BackendFeatures as F;
        let one = |f: F| BackendFeatures::from(f);
        assert_eq!(one(F::empty()), BackendFeatures::default());
        assert_eq!(one(F::BATCH_PUT), BackendFeatures { batch_put: true, ..Default::default() });
        assert_eq!(one(F::BATCH_GET), BackendFeatures { batch_get: true, ..Default::default() });
        assert_eq!(one(F::EXISTS), BackendFeatures { exists: true, ..Default::default() });
        assert_eq!(one(F::DELETE), BackendFeatures { delete: true, ..Default::default() });
        assert_eq!(one(F::TTL), BackendFeatures { ttl: true, ..Default::default() });
        assert_eq!(one(F::NAMESPACES), BackendFeatures { namespaces: true, ..Default::default() });
    }
}
