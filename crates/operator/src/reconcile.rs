//! The reconciler: one pass takes a KVCache to its desired children and
//! writes what it saw into the status.
//!
//! Each pass is idempotent: it resolves the spec, runs the placement rules,
//! renders the children and server-side-applies each of them under one field
//! manager. A deleted child is simply applied again (the owner watches bring
//! the KVCache back into the queue the moment a child disappears); drift in
//! a field the operator owns is overwritten by the same apply. Children carry
//! owner references, so deleting the KVCache deletes them: no finalizer is
//! needed, and none is added.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::ByteString;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType};
use kube::{Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::conditions::{self, ConditionType, Reason};
use crate::crd::{KVCache, KVCacheStatus};
use crate::plugins::{resolve_and_place, PluginFailure};
use crate::render::{render, Child, Names};
use crate::resolve::{resolve, Metadata, Resolved, TOKEN_KEY};
use crate::Context;

/// The field manager of every apply.
pub(crate) const FIELD_MANAGER: &str = "kvplane-operator";

/// Requeue while something is not ready yet (status changes of owned
/// StatefulSets also wake the reconciler; this is the safety net).
const REQUEUE_NOT_READY: Duration = Duration::from_secs(10);
/// Periodic resync of a healthy KVCache.
const REQUEUE_READY: Duration = Duration::from_secs(300);
/// Retry of a failing placement rule or plugin source.
const REQUEUE_PLUGIN_FAILURE: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub(crate) enum ReconcileError {
    #[error("applying {kind} {name}: {source}")]
    Apply {
        kind: &'static str,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("writing the status: {0}")]
    Status(#[source] kube::Error),
    #[error("the KVCache has no namespace")]
    NoNamespace,
}

/// What applying one child did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Applied {
    /// It did not exist and this KVCache had never been reconciled.
    Created,
    /// It did not exist although an earlier pass had created it: repaired.
    Recreated,
    /// It existed and the apply changed it (a spec edit or drift).
    Updated,
    Unchanged,
}

fn owner_reference(kv: &KVCache) -> OwnerReference {
    OwnerReference {
        api_version: "kvplane.io/v1alpha1".into(),
        kind: "KVCache".into(),
        name: kv.name_any(),
        uid: kv.uid().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

async fn apply<K>(api: &Api<K>, obj: &K, seen_before: bool) -> Result<(Applied, K), kube::Error>
where
    K: Resource<DynamicType = ()> + Clone + Debug + Serialize + DeserializeOwned,
{
    let name = obj.meta().name.clone().unwrap_or_default();
    if !seen_before {
        // First pass for this KVCache: its children are being created, so
        // the read that tells "recreated" and "updated" apart is skipped
        // (half the requests when many KVCaches arrive at once). A child
        // that already existed (an operator restarted mid-pass) is told
        // apart by its creation time.
        let started = k8s_openapi::jiff::Timestamp::now();
        let after = api.patch(&name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(obj)).await?;
        let fresh = after.meta().creation_timestamp.as_ref().is_some_and(|t| t.0.as_second() >= started.as_second() - 5);
        return Ok((if fresh { Applied::Created } else { Applied::Unchanged }, after));
    }
    let before = api.get_metadata_opt(&name).await?;
    let after = api.patch(&name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(obj)).await?;
    let applied = match before {
        // Not the first pass (handled above), so a missing child was deleted.
        None => Applied::Recreated,
        Some(b) if b.metadata.resource_version != after.meta().resource_version => Applied::Updated,
        Some(_) => Applied::Unchanged,
    };
    Ok((applied, after))
}

/// Applies one child of any kind; the one apply path of a pass.
async fn apply_child(client: &kube::Client, ns: &str, child: &Child, seen_before: bool) -> Result<(Applied, Child), kube::Error> {
    Ok(match child {
        Child::ConfigMap(o) => {
            let (a, after) = apply(&Api::namespaced(client.clone(), ns), o, seen_before).await?;
            (a, Child::ConfigMap(after))
        }
        Child::Service(o) => {
            let (a, after) = apply(&Api::namespaced(client.clone(), ns), o, seen_before).await?;
            (a, Child::Service(after))
        }
        Child::StatefulSet(o) => {
            let (a, after) = apply(&Api::namespaced(client.clone(), ns), o, seen_before).await?;
            (a, Child::StatefulSet(after))
        }
        Child::NetworkPolicy(o) => {
            let (a, after) = apply(&Api::namespaced(client.clone(), ns), o, seen_before).await?;
            (a, Child::NetworkPolicy(after))
        }
    })
}

/// Creates the generated token Secret when it does not exist, and leaves
/// an existing one alone: its token is made once, from the kernel's
/// random source, so passes (and operator restarts) never rotate it under
/// running pods and their clients. A plain create answered 409 is "already
/// there", so the operator needs only `create` on Secrets, never `get`.
async fn ensure_token(client: &kube::Client, ns: &str, secret: &Secret, seen_before: bool) -> Result<Applied, kube::Error> {
    let mut secret = secret.clone();
    secret.data = Some(BTreeMap::from([(TOKEN_KEY.to_string(), ByteString(random_token().into_bytes()))]));
    match Api::<Secret>::namespaced(client.clone(), ns).create(&PostParams::default(), &secret).await {
        // Recreated after a deletion, it holds a new token: pods started
        // with the old one keep it until they restart.
        Ok(_) => Ok(if seen_before { Applied::Recreated } else { Applied::Created }),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(Applied::Unchanged),
        Err(e) => Err(e),
    }
}

/// 32 bytes from /dev/urandom, hex-encoded (64 characters: printable, so
/// the same text works in a file, an environment variable and a URL).
fn random_token() -> String {
    use std::io::Read as _;
    let mut bytes = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .expect("the kernel's random source (/dev/urandom) is readable");
    hex::encode(bytes)
}

/// One reconcile pass.
pub(crate) async fn reconcile(kv: Arc<KVCache>, ctx: Arc<Context>) -> Result<Action, ReconcileError> {
    let started = Instant::now();
    let result = reconcile_inner(&kv, &ctx).await;
    ctx.metrics.observe(started.elapsed(), result.is_ok());
    result
}

async fn reconcile_inner(kv: &KVCache, ctx: &Context) -> Result<Action, ReconcileError> {
    let ns = kv.namespace().ok_or(ReconcileError::NoNamespace)?;
    let name = kv.name_any();
    let kvs: Api<KVCache> = Api::namespaced(ctx.client.clone(), &ns);
    let old_status = kv.status.clone().unwrap_or_default();
    // A KVCache with an observedGeneration was reconciled before: a child
    // missing now was deleted, not never created.
    let seen_before = old_status.observed_generation.is_some();
    let mut status = old_status.clone();
    status.observed_generation = kv.metadata.generation;
    let oref = kv.object_ref(&());

    let resolved = match resolve(kv) {
        Ok(r) => r,
        Err(e) => {
            let message = e.to_string();
            conditions::set(&mut status, kv, ConditionType::Ready, false, Reason::InvalidSpec, &message);
            conditions::set(&mut status, kv, ConditionType::Degraded, true, Reason::InvalidSpec, &message);
            publish(ctx, &oref, EventType::Warning, Reason::InvalidSpec, "Reconcile", message).await;
            write_status(&kvs, &name, &old_status, &status).await?;
            return Ok(Action::await_change());
        }
    };
    status.backend = Some(resolved.backend.name().to_string());

    let annotations: BTreeMap<String, String> = kv.annotations().clone();
    let placements = match resolve_and_place(&ctx.client, &ctx.runtime, &resolved, &annotations).await {
        Ok((placements, digests)) => {
            let n = digests.len();
            status.plugins = digests;
            conditions::set(
                &mut status,
                kv,
                ConditionType::PluginsResolved,
                true,
                Reason::Resolved,
                &format!("{n} plugins fetched, verified and loaded"),
            );
            placements
        }
        Err(PluginFailure { reason, message }) => {
            // Running pods stay as they are: nothing is applied until the
            // plugins resolve again.
            conditions::set(&mut status, kv, ConditionType::PluginsResolved, false, reason, &message);
            conditions::set(&mut status, kv, ConditionType::Degraded, true, reason, &message);
            conditions::set(&mut status, kv, ConditionType::Ready, false, Reason::PluginsNotResolved, &message);
            if status != old_status {
                publish(ctx, &oref, EventType::Warning, reason, "ResolvePlugins", message).await;
            }
            write_status(&kvs, &name, &old_status, &status).await?;
            return Ok(Action::requeue(REQUEUE_PLUGIN_FAILURE));
        }
    };

    let children = render(&resolved, &placements, &owner_reference(kv));
    let etcd_name = Names::etcd(&name);
    let cache_name = Names::cache(&name);
    let mut outcomes: Vec<(&'static str, String, Applied)> = Vec::new();
    let mut etcd_ready = None;
    let mut cache_ready = 0;
    // The token before the pods that mount it.
    if let Some(secret) = &children.token {
        let secret_name = secret.metadata.name.clone().unwrap_or_default();
        match ensure_token(&ctx.client, &ns, secret, seen_before).await {
            Ok(applied) => outcomes.push(("Secret", secret_name, applied)),
            Err(source) => {
                let error = ReconcileError::Apply { kind: "Secret", name: secret_name, source };
                return Err(apply_failed(ctx, &kvs, kv, &oref, &old_status, status, error).await);
            }
        }
    }
    for child in children.into_list() {
        match apply_child(&ctx.client, &ns, &child, seen_before).await {
            Ok((applied, after)) => {
                outcomes.push((child.kind(), child.name().to_owned(), applied));
                if let Child::StatefulSet(sts) = &after {
                    let ready = ready_replicas(sts);
                    match sts.metadata.name.as_deref() {
                        Some(n) if n == etcd_name => etcd_ready = Some(ready),
                        Some(n) if n == cache_name => cache_ready = ready,
                        _ => {}
                    }
                }
            }
            Err(source) => {
                // A child the API server refuses (quota, a full service IP
                // range, an admission webhook) is reported in the status
                // before the pass fails.
                let error = ReconcileError::Apply { kind: child.kind(), name: child.name().to_owned(), source };
                return Err(apply_failed(ctx, &kvs, kv, &oref, &old_status, status, error).await);
            }
        }
    }

    // One Event per kind of outcome and pass (not one per child): creating
    // a pool is one story, and at 500 KVCaches the Events would otherwise
    // be a third of the operator's API traffic.
    for (outcome, reason, verb) in [
        (Applied::Created, Reason::Created, "created"),
        (Applied::Recreated, Reason::Repaired, "recreated missing"),
        (Applied::Updated, Reason::Updated, "applied the spec to drifted or edited"),
    ] {
        let names: Vec<String> = outcomes.iter().filter(|(_, _, a)| *a == outcome).map(|(k, n, _)| format!("{k} {n}")).collect();
        if !names.is_empty() {
            publish(ctx, &oref, EventType::Normal, reason, "Apply", format!("{verb} {}", names.join(", "))).await;
        }
    }
    let repaired: Vec<String> = outcomes.iter().filter(|(_, _, a)| *a == Applied::Recreated).map(|(k, n, _)| format!("{k} {n}")).collect();

    fill_status(&mut status, kv, &resolved, cache_ready, etcd_ready, &repaired);
    let ready = conditions::is_true(&status, ConditionType::Ready);
    write_status(&kvs, &name, &old_status, &status).await?;
    Ok(Action::requeue(if ready { REQUEUE_READY } else { REQUEUE_NOT_READY }))
}

fn ready_replicas(sts: &StatefulSet) -> i32 {
    sts.status.as_ref().and_then(|s| s.ready_replicas).unwrap_or(0)
}

fn fill_status(status: &mut KVCacheStatus, kv: &KVCache, r: &Resolved, cache_ready: i32, etcd_ready: Option<i32>, repaired: &[String]) {
    status.replicas = r.cache.replicas;
    status.ready_replicas = cache_ready;
    status.endpoints = r.service_ports.iter().map(|p| format!("{}.{}.svc:{}", Names::rpc(&r.name), r.namespace, p.port)).collect();
    let etcd_ok = match (&r.metadata, etcd_ready) {
        (Metadata::Etcd(plan), Some(ready)) => {
            let want = plan.workload.replicas;
            let msg = format!("{ready}/{want} etcd members ready");
            let ok = ready >= want;
            conditions::set(
                status,
                kv,
                ConditionType::EtcdReady,
                ok,
                if ok { Reason::MembersReady } else { Reason::MembersNotReady },
                &msg,
            );
            ok
        }
        (Metadata::ExternalEtcd(c), _) => {
            conditions::set(status, kv, ConditionType::EtcdReady, true, Reason::External, &format!("external etcd at {}", c.address));
            true
        }
        (Metadata::ExternalRedis(c), _) => {
            conditions::set(
                status,
                kv,
                ConditionType::EtcdReady,
                true,
                Reason::External,
                &format!("metadata in the external Redis at {}", c.address),
            );
            true
        }
        (Metadata::Etcd(_), None) => false,
    };
    let want = r.cache.replicas;
    let cache_ok = cache_ready >= want;
    let msg = format!("{cache_ready}/{want} cache pods ready");
    conditions::set(status, kv, ConditionType::CacheReady, cache_ok, if cache_ok { Reason::PodsReady } else { Reason::PodsNotReady }, &msg);
    if etcd_ok && cache_ok {
        conditions::set(status, kv, ConditionType::Ready, true, Reason::AllReady, "the etcd cluster and every cache pod are ready");
    } else {
        let mut waiting = Vec::new();
        if !etcd_ok {
            waiting.push("etcd members");
        }
        if !cache_ok {
            waiting.push("cache pods");
        }
        conditions::set(status, kv, ConditionType::Ready, false, Reason::Waiting, &format!("waiting for {}", waiting.join(" and ")));
    }
    if !repaired.is_empty() {
        conditions::set(status, kv, ConditionType::Degraded, true, Reason::ChildRepaired, &format!("recreated {}", repaired.join(", ")));
    } else if etcd_ok && cache_ok {
        conditions::set(status, kv, ConditionType::Degraded, false, Reason::AsExpected, "nothing is missing");
    } else if conditions::is_true(status, ConditionType::Ready) {
        conditions::set(status, kv, ConditionType::Degraded, true, Reason::NotReady, "was ready before; some pods are not ready now");
    } else {
        conditions::set(status, kv, ConditionType::Degraded, false, Reason::Starting, "pods are starting");
    }
}

/// Writes the status when it changed: an unchanged status is not written,
/// so the write does not wake the reconciler again.
async fn write_status(api: &Api<KVCache>, name: &str, old: &KVCacheStatus, new: &KVCacheStatus) -> Result<(), ReconcileError> {
    if comparable(old) == comparable(new) {
        return Ok(());
    }
    let patch = serde_json::json!({ "status": new });
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch)).await.map_err(ReconcileError::Status)?;
    Ok(())
}

/// A status without transition times, for change detection.
fn comparable(s: &KVCacheStatus) -> KVCacheStatus {
    let mut s = s.clone();
    for c in &mut s.conditions {
        c.last_transition_time = Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
    }
    s
}

/// A child (or the token Secret) the API server refused: said in the status
/// (not Ready, Degraded) and, when that changed, as an event; answers the
/// error the pass fails with (or the status write's, if that failed too).
async fn apply_failed(
    ctx: &Context,
    kvs: &Api<KVCache>,
    kv: &KVCache,
    oref: &k8s_openapi::api::core::v1::ObjectReference,
    old_status: &KVCacheStatus,
    mut status: KVCacheStatus,
    error: ReconcileError,
) -> ReconcileError {
    let message = error.to_string();
    conditions::set(&mut status, kv, ConditionType::Ready, false, Reason::ApplyFailed, &message);
    conditions::set(&mut status, kv, ConditionType::Degraded, true, Reason::ApplyFailed, &message);
    if status != *old_status {
        publish(ctx, oref, EventType::Warning, Reason::ApplyFailed, "Apply", message).await;
    }
    match write_status(kvs, &kv.name_any(), old_status, &status).await {
        Ok(()) => error,
        Err(e) => e,
    }
}

async fn publish(
    ctx: &Context,
    oref: &k8s_openapi::api::core::v1::ObjectReference,
    type_: EventType,
    reason: Reason,
    action: &str,
    note: String,
) {
    let event = Event { type_, reason: reason.as_str().into(), note: Some(note), action: action.into(), secondary: None };
    if let Err(e) = ctx.recorder.publish(&event, oref).await {
        tracing::warn!(error = %e, %reason, "could not publish an event");
    }
}

/// What the controller does after a failed pass: log it and retry soon.
pub(crate) fn error_policy(kv: Arc<KVCache>, error: &ReconcileError, _ctx: Arc<Context>) -> Action {
    tracing::warn!(kvcache = %kv.name_any(), namespace = ?kv.namespace(), %error, "reconcile failed; retrying");
    Action::requeue(Duration::from_secs(5))
}
