//! Leader election through a `coordination.k8s.io/v1` Lease, so that two
//! operator replicas never reconcile at once.
//!
//! The holder renews the Lease every `renew_every`; another replica takes
//! it over only once `lease_duration` has passed without a renewal. Writes
//! carry the Lease's resourceVersion, so two replicas racing for an expired
//! Lease cannot both win. A leader that fails to renew in time stops
//! leading (the caller exits, and the Deployment restarts it as a follower).

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use kube::Client;

pub(crate) struct LeaderElection {
    api: Api<Lease>,
    name: String,
    identity: String,
    lease_duration: Duration,
    renew_every: Duration,
}

impl LeaderElection {
    pub(crate) fn new(client: Client, namespace: &str, name: &str, identity: &str) -> LeaderElection {
        LeaderElection {
            api: Api::namespaced(client, namespace),
            name: name.into(),
            identity: identity.into(),
            lease_duration: Duration::from_secs(15),
            renew_every: Duration::from_secs(5),
        }
    }

    /// Waits until this replica holds the Lease.
    pub(crate) async fn acquire(&self) -> Result<(), kube::Error> {
        let mut logged = false;
        loop {
            if self.try_acquire().await? {
                tracing::info!(lease = %self.name, identity = %self.identity, "became the leader");
                return Ok(());
            }
            if !logged {
                tracing::info!(lease = %self.name, identity = %self.identity, "another replica leads; waiting");
                logged = true;
            }
            tokio::time::sleep(self.renew_every).await;
        }
    }

    /// Renews the Lease until renewal fails; returns why leadership ended.
    pub(crate) async fn hold(&self) -> String {
        let mut last_renewal = tokio::time::Instant::now();
        loop {
            tokio::time::sleep(self.renew_every).await;
            match self.try_acquire().await {
                Ok(true) => last_renewal = tokio::time::Instant::now(),
                Ok(false) => return format!("lease {} was taken over by another replica", self.name),
                Err(e) => {
                    tracing::warn!(error = %e, "renewing the leader lease failed");
                    if last_renewal.elapsed() >= self.lease_duration {
                        return format!("could not renew lease {} for {:?}: {e}", self.name, self.lease_duration);
                    }
                }
            }
        }
    }

    /// Takes or renews the Lease if it is free, expired or ours.
    async fn try_acquire(&self) -> Result<bool, kube::Error> {
        let now = Timestamp::now();
        let seconds = self.lease_duration.as_secs() as i32;
        match self.api.get_opt(&self.name).await? {
            None => {
                let lease = Lease {
                    metadata: ObjectMeta { name: Some(self.name.clone()), ..Default::default() },
                    spec: Some(LeaseSpec {
                        holder_identity: Some(self.identity.clone()),
                        lease_duration_seconds: Some(seconds),
                        acquire_time: Some(MicroTime(now)),
                        renew_time: Some(MicroTime(now)),
                        lease_transitions: Some(0),
                        ..Default::default()
                    }),
                };
                match self.api.create(&PostParams::default(), &lease).await {
                    Ok(_) => Ok(true),
                    Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
                    Err(e) => Err(e),
                }
            }
            Some(mut lease) => {
                let spec = lease.spec.get_or_insert_with(Default::default);
                let ours = spec.holder_identity.as_deref() == Some(self.identity.as_str());
                let expired = match (&spec.renew_time, spec.lease_duration_seconds) {
                    (Some(MicroTime(t)), Some(d)) => now.as_second() > t.as_second() + d as i64,
                    _ => true,
                };
                if !ours && !expired {
                    return Ok(false);
                }
                if !ours {
                    spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
                    spec.acquire_time = Some(MicroTime(now));
                    spec.holder_identity = Some(self.identity.clone());
                }
                spec.renew_time = Some(MicroTime(now));
                spec.lease_duration_seconds = Some(seconds);
                // `replace` sends the resourceVersion we read: a concurrent
                // writer makes this fail with a conflict instead of both winning.
                match self.api.replace(&self.name, &PostParams::default(), &lease).await {
                    Ok(_) => Ok(true),
                    Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
                    Err(e) => Err(e),
                }
            }
        }
    }
}
