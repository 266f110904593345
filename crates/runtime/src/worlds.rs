//! Typed handles for the four plugin worlds: the API the rest of the host
//! calls. Each validates the plugin's answer against the contract and
//! applies the declaration's failure policy.

use std::sync::Arc;

use bytes::Bytes;
use kvplane_protocol::KvError;
use kvplane_slots::{Member, RingTableError, SlotTable, DEFAULT_VNODES};

use super::bindings::{placement, retry, store, BackendFeatures, CallOptions, WitMember};
use super::buffer::{BlockBuffer, Region, WritableMemory};
use super::decl::FailurePolicy;
use super::error::{Fault, PluginError};
use super::pool::{Plugin, SchedulingGuest};

pub use super::bindings::scheduling::{Placement, PodRequest};
pub use retry::{Decision, Failure, Operation};

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
        let result = self
            .plugin
            .call("decide", move |inst| Box::pin(async move { Ok(Ok(inst.guest.call_decide(&mut inst.store, &failure).await?)) }))
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
        let result = self
            .plugin
            .call("place", move |inst| {
                Box::pin(async move {
                    Ok(match inst.guest.call_place(&mut inst.store, &request).await? {
                        Err(e) => Err(Fault::Returned(e.into())),
                        Ok(p) => crate::placement_rule::validate(&p).map(|()| p).map_err(Fault::BadOutput),
                    })
                })
            })
            .await;
        match result {
            Err(e) if falls_open(&self.plugin, &e) => Ok(Placement {
                node_affinity: None,
                pod_affinity: None,
                pod_anti_affinity: None,
                tolerations: Vec::new(),
                topology_spread: Vec::new(),
            }),
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
        self.plugin.call("features", |inst| Box::pin(async move { Ok(Ok(inst.guest.call_features(&mut inst.store).await?)) })).await
    }

    /// Store each (key, payload). The payloads are lent to the plugin as
    /// source buffers: shared, never copied, and taken back when the call
    /// returns. Fail-open default: the write is skipped (a later read misses).
    pub async fn put(&self, entries: Vec<(Vec<u8>, Bytes)>, options: CallOptions) -> Result<Vec<Result<(), KvError>>, PluginError> {
        let n = entries.len();
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
        options: CallOptions,
    ) -> (Vec<M>, Result<Vec<Result<usize, KvError>>, PluginError>) {
        let n = entries.len();
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
    pub async fn exists(&self, keys: Vec<Vec<u8>>, options: CallOptions) -> Result<Vec<Result<bool, KvError>>, PluginError> {
        let n = keys.len();
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
    pub async fn delete(&self, keys: Vec<Vec<u8>>, options: CallOptions) -> Result<Vec<Result<(), KvError>>, PluginError> {
        let n = keys.len();
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
