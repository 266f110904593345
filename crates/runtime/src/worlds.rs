//! Typed handles for the four plugin worlds: the API the rest of the host
//! calls. Each validates the plugin's answer against the contract and
//! applies the declaration's failure policy.

use std::sync::{Arc, RwLock};

use bytes::Bytes;

use super::bindings::{placement, retry, scheduling, store, BackendFeatures, WitNode};
use super::decl::FailurePolicy;
use super::error::{Fault, PluginError};
use super::pool::Plugin;
use kvplane_protocol::KvError;

pub use retry::{Decision, Failure, Operation};
pub use scheduling::{Placement, PodRequest};
pub type Node = WitNode;

/// Log and count a fail-open fallback; return whether to fall back.
fn falls_open<G: super::pool::GuestExports>(plugin: &Plugin<G>, error: &PluginError) -> bool {
    let open = plugin.decl().failure_policy == FailurePolicy::FailOpen && error.fault.is_breakage();
    if open {
        tracing::warn!("{error}; failing open with the default");
        plugin.metrics().record_fail_open(&plugin.decl().name);
    }
    open
}

/// A key-placement plugin with the pool's current membership.
pub struct KeyPlacement {
    pub plugin: Plugin<placement::Guest>,
    /// (generation, members): instances that saw an older generation get
    /// `set-members` before their next `owners` call.
    members: RwLock<(u64, Arc<Vec<Node>>)>,
}

impl KeyPlacement {
    pub(crate) fn new(plugin: Plugin<placement::Guest>) -> Self {
        KeyPlacement { plugin, members: RwLock::new((0, Arc::new(Vec::new()))) }
    }

    /// Replace the membership. Checked on one instance right away, so a
    /// membership the plugin rejects is reported here, not on the next read.
    pub async fn set_members(&self, members: Vec<Node>) -> Result<(), PluginError> {
        let members = Arc::new(members);
        let generation = {
            let mut m = self.members.write().unwrap_or_else(|p| p.into_inner());
            m.0 += 1;
            m.1 = members.clone();
            m.0
        };
        self.plugin
            .call("set-members", move |inst| {
                Box::pin(async move {
                    let r = inst.guest.call_set_members(&mut inst.store, &members).await?;
                    Ok(r.map(|()| inst.synced = generation).map_err(|e| Fault::Returned(e.into())))
                })
            })
            .await
    }

    pub fn members(&self) -> Arc<Vec<Node>> {
        self.members.read().unwrap_or_else(|p| p.into_inner()).1.clone()
    }

    /// For each key, `replicas` distinct owner ids, primary first.
    ///
    /// Fail-open default: the native ring (`kvplane-ring-core`) over the
    /// same membership.
    pub async fn owners(&self, keys: Vec<Vec<u8>>, replicas: u32) -> Result<Vec<Vec<String>>, PluginError> {
        let (generation, members) = self.members.read().unwrap_or_else(|p| p.into_inner()).clone();
        let fallback_keys = keys.clone();
        let result = self
            .plugin
            .call("owners", {
                let members = members.clone();
                move |inst| {
                    Box::pin(async move {
                        if inst.synced != generation {
                            if let Err(e) = inst.guest.call_set_members(&mut inst.store, &members).await? {
                                return Ok(Err(Fault::Returned(e.into())));
                            }
                            inst.synced = generation;
                        }
                        let answer = inst.guest.call_owners(&mut inst.store, &keys, replicas).await?;
                        Ok(match answer {
                            Err(e) => Err(Fault::Returned(e.into())),
                            Ok(owners) => check_owners(&members, keys.len(), replicas, owners),
                        })
                    })
                }
            })
            .await;
        match result {
            Err(e) if falls_open(&self.plugin, &e) => native_owners(&members, &fallback_keys, replicas).map_err(|_| e),
            other => other,
        }
    }
}

/// The contract of `owners`: one answer per key, each min(replicas, N)
/// distinct ids of current members.
fn check_owners(members: &[Node], keys: usize, replicas: u32, owners: Vec<Vec<String>>) -> Result<Vec<Vec<String>>, Fault> {
    if owners.len() != keys {
        return Err(Fault::BadOutput(format!("{} owner lists for {keys} keys", owners.len())));
    }
    let want = (replicas as usize).min(members.len());
    for (i, set) in owners.iter().enumerate() {
        if set.len() != want {
            return Err(Fault::BadOutput(format!(
                "{} owners for key #{i}, expected {want} (replicas {replicas}, {} members)",
                set.len(),
                members.len()
            )));
        }
        for (j, id) in set.iter().enumerate() {
            if !members.iter().any(|m| &m.id == id) {
                return Err(Fault::BadOutput(format!("owner {id:?} of key #{i} is not a member")));
            }
            if set[..j].contains(id) {
                return Err(Fault::BadOutput(format!("owner {id:?} appears twice for key #{i}")));
            }
        }
    }
    Ok(owners)
}

/// The fail-open default placement: the same ring, computed natively.
pub fn native_owners(members: &[Node], keys: &[Vec<u8>], replicas: u32) -> Result<Vec<Vec<String>>, KvError> {
    let ids: Vec<&str> = members.iter().map(|m| m.id.as_str()).collect();
    let ring = kvplane_ring_core::Ring::new(&ids, kvplane_ring_core::DEFAULT_VNODES).map_err(|e| KvError::Invalid(e.to_string()))?;
    keys.iter()
        .map(|k| ring.owners(k, replicas).map(|o| o.into_iter().map(str::to_owned).collect()).map_err(|e| KvError::Invalid(e.to_string())))
        .collect()
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

/// A placement-rule plugin.
pub struct PlacementRule {
    pub plugin: Plugin<scheduling::Guest>,
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

impl Backend {
    pub async fn features(&self) -> Result<BackendFeatures, PluginError> {
        self.plugin.call("features", |inst| Box::pin(async move { Ok(Ok(inst.guest.call_features(&mut inst.store).await?)) })).await
    }

    /// Store each (key, payload). The payloads are lent to the plugin as host
    /// buffers; their bytes are never copied into the guest.
    /// Fail-open default: the write is skipped (a later read misses).
    pub async fn put(&self, entries: Vec<(Vec<u8>, Bytes)>) -> Result<Vec<Result<(), KvError>>, PluginError> {
        let n = entries.len();
        let result = self
            .plugin
            .call("put", move |inst| {
                Box::pin(async move {
                    // Ownership of each handle passes to the guest, which
                    // drops it when done; the bytes are shared, not copied.
                    let mut lent = Vec::with_capacity(entries.len());
                    for (key, data) in entries {
                        let handle = inst.store.data_mut().table.push(super::host::BlockBuffer { data })?;
                        lent.push((key, handle));
                    }
                    let answer = inst.guest.call_put(&mut inst.store, &lent).await?;
                    Ok(check_count("put", n, answer).map(|r| r.into_iter().map(|r| r.map_err(KvError::from)).collect()))
                })
            })
            .await;
        match result {
            Err(e) if falls_open(&self.plugin, &e) => Ok((0..n).map(|_| Ok(())).collect()),
            other => other,
        }
    }

    /// Fetch each key. Fail-open default: every key misses.
    pub async fn get(&self, keys: Vec<Vec<u8>>) -> Result<Vec<Result<Bytes, KvError>>, PluginError> {
        let n = keys.len();
        let result = self
            .plugin
            .call("get", move |inst| {
                Box::pin(async move {
                    let answer = inst.guest.call_get(&mut inst.store, &keys).await?;
                    let mut out = Vec::with_capacity(answer.len());
                    for r in answer {
                        out.push(match r {
                            Ok(handle) => Ok(inst.store.data_mut().table.delete(handle)?.data),
                            Err(e) => Err(KvError::from(e)),
                        });
                    }
                    Ok(check_count("get", keys.len(), out))
                })
            })
            .await;
        match result {
            Err(e) if falls_open(&self.plugin, &e) => Ok((0..n).map(|_| Err(KvError::NotFound)).collect()),
            other => other,
        }
    }

    /// Whether each key exists. Fail-open default: none does.
    pub async fn exists(&self, keys: Vec<Vec<u8>>) -> Result<Vec<Result<bool, KvError>>, PluginError> {
        let n = keys.len();
        let result = self
            .plugin
            .call("exists", move |inst| {
                Box::pin(async move {
                    let answer = inst.guest.call_exists(&mut inst.store, &keys).await?;
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
    pub async fn delete(&self, keys: Vec<Vec<u8>>) -> Result<Vec<Result<(), KvError>>, PluginError> {
        let n = keys.len();
        let result = self
            .plugin
            .call("delete", move |inst| {
                Box::pin(async move {
                    let answer = inst.guest.call_delete(&mut inst.store, &keys).await?;
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
