//! A member's own registration: its record under a lease, kept alive.

use std::sync::Arc;
use std::time::Duration;

use kvplane_slots::{Member, MemberState};
use tokio::sync::{watch, Mutex};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::etcd::Etcd;
use crate::lease::LeaseClock;
use crate::record::{check_name, encode_member, member_key};
use crate::watch::MembershipWatch;
use crate::{Error, Options};

/// gRPC status `NOT_FOUND`, as etcd answers for a lease it does not have.
const GRPC_NOT_FOUND: i64 = 5;

/// Whether this member is (still) in the cluster, as far as it can tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Registration {
    /// Its lease is surely alive (see the crate docs for "surely").
    Registered,
    /// Its lease lapsed or was revoked: the others no longer see it, and its
    /// keys have moved. Final: register again to come back.
    Lost { reason: String },
}

/// A member registered in etcd. Dropping it stops the keep-alive without
/// revoking the lease (as a crash would: the record goes when the lease
/// expires); [`Membership::leave`] removes it at once.
pub struct Membership {
    etcd: Arc<Etcd>,
    cluster: String,
    key: String,
    lease: i64,
    record: Mutex<Member>,
    status: watch::Receiver<Registration>,
    /// Until when the lease is surely alive, as the keeper last learned.
    until: Arc<std::sync::Mutex<Instant>>,
    keeper: JoinHandle<()>,
    options: Options,
}

impl Membership {
    /// Put `member` under `/kvplane/<cluster>/members/<id>`, attached to a
    /// new lease of `lease_ttl` that a background task keeps alive. A record
    /// already there (this node's before a restart) is replaced; it is the
    /// deployment's job to give each node its own id. `lease_ttl` is rounded
    /// to whole seconds, and etcd may raise it to its minimum (about 2 s with
    /// etcd's default election timeout).
    pub async fn register<S: AsRef<str>>(endpoints: &[S], cluster: &str, member: Member, lease_ttl: Duration) -> Result<Membership, Error> {
        Membership::register_with(endpoints, cluster, member, lease_ttl, Options::default()).await
    }

    pub async fn register_with<S: AsRef<str>>(
        endpoints: &[S],
        cluster: &str,
        member: Member,
        lease_ttl: Duration,
        options: Options,
    ) -> Result<Membership, Error> {
        check_name("cluster name", cluster)?;
        check_name("member id", &member.id)?;
        let etcd = Arc::new(Etcd::new(endpoints, options.connect_timeout)?);
        let key = member_key(cluster, &member.id);
        let during = || format!("registering {key}");
        let (lease, ttl, sent) = etcd.grant(lease_ttl, options.request_timeout).await.map_err(Error::during(during))?;
        let mut clock = LeaseClock::granted(sent, ttl);
        // Renew once right after the put: when etcd was slow to take the put
        // (an election), the lease may be near the end its grant gave it.
        let registered = async {
            etcd.put(&key, &encode_member(&member), lease, options.request_timeout).await?;
            match etcd.keep_alive(lease, options.request_timeout).await? {
                (ttl, _) if ttl.is_zero() => {
                    Err(Error::Lost { key: key.clone(), reason: format!("lease {lease:x} expired while registering") })
                }
                (ttl, sent) => {
                    clock.renewed(sent, ttl);
                    Ok(())
                }
            }
        };
        if let Err(e) = registered.await {
            // Best effort: an unused lease would only expire later.
            let _ = etcd.revoke(lease, options.request_timeout).await;
            return Err(Error::during(during)(e));
        }
        tracing::info!(key, lease = format!("{lease:x}"), ?ttl, "registered in etcd");
        let (tx, status) = watch::channel(Registration::Registered);
        let until = Arc::new(std::sync::Mutex::new(clock.expires()));
        let keeper = tokio::spawn(keep_alive(Arc::clone(&etcd), key.clone(), lease, clock, tx, Arc::clone(&until), options.clone()));
        Ok(Membership { etcd, cluster: cluster.to_owned(), key, lease, record: Mutex::new(member), status, until, keeper, options })
    }

    /// The etcd key of this member's record.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The etcd lease the record is attached to.
    pub fn lease_id(&self) -> i64 {
        self.lease
    }

    /// The record as last written.
    pub async fn member(&self) -> Member {
        self.record.lock().await.clone()
    }

    /// Where the registration stands now.
    pub fn registration(&self) -> Registration {
        self.status.borrow().clone()
    }

    /// Until when the lease is surely alive: the send time of the last
    /// confirmed renewal plus the TTL. Past it, the registration is lost.
    pub fn registered_until(&self) -> Instant {
        *self.until.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Changes of [`Membership::registration`].
    pub fn subscribe(&self) -> watch::Receiver<Registration> {
        self.status.clone()
    }

    /// Wait until the registration is lost; why.
    pub async fn lost(&self) -> String {
        let mut status = self.status.clone();
        let lost = status.wait_for(|s| matches!(s, Registration::Lost { .. })).await;
        match lost.as_deref() {
            Ok(Registration::Lost { reason }) => reason.clone(),
            // The keeper never drops its sender without saying why.
            _ => format!("the keep-alive of {} stopped", self.key),
        }
    }

    /// Announce a new state (e.g. draining before leaving) to the others.
    pub async fn set_state(&self, state: MemberState) -> Result<(), Error> {
        self.update(|m| m.state = state).await
    }

    /// Change this member's record (its id cannot change).
    pub async fn update(&self, change: impl FnOnce(&mut Member)) -> Result<(), Error> {
        let mut record = self.record.lock().await;
        if let Registration::Lost { reason } = self.registration() {
            return Err(Error::Lost { key: self.key.clone(), reason });
        }
        let mut next = record.clone();
        change(&mut next);
        next.id.clone_from(&record.id);
        self.etcd
            .put(&self.key, &encode_member(&next), self.lease, self.options.request_timeout)
            .await
            .map_err(Error::during(|| format!("updating {}", self.key)))?;
        *record = next;
        Ok(())
    }

    /// Follow the cluster's membership through this member's etcd client.
    pub async fn watch(&self) -> Result<MembershipWatch, Error> {
        MembershipWatch::start_on(Arc::clone(&self.etcd), &self.cluster, self.options.clone()).await
    }

    /// Leave the cluster now: revoke the lease, which deletes the record.
    /// A lease etcd no longer has (it lapsed) counts as revoked.
    pub async fn leave(self) -> Result<(), Error> {
        self.keeper.abort();
        match self.etcd.revoke(self.lease, self.options.request_timeout).await {
            Ok(()) => {}
            Err(Error::Etcd { code: GRPC_NOT_FOUND, .. }) => {}
            Err(e) => return Err(Error::during(|| format!("revoking lease {:x} of {}", self.lease, self.key))(e)),
        }
        tracing::info!(key = self.key, "left the cluster");
        Ok(())
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        self.keeper.abort();
    }
}

/// Renew `lease` every third of its TTL until it can no longer be sure it
/// is alive; then say so on `status` and stop.
async fn keep_alive(
    etcd: Arc<Etcd>,
    key: String,
    lease: i64,
    mut clock: LeaseClock,
    status: watch::Sender<Registration>,
    until: Arc<std::sync::Mutex<Instant>>,
    options: Options,
) {
    let mut last_error: Option<Error> = None;
    let reason = loop {
        tokio::time::sleep_until(clock.next_wakeup()).await;
        let now = Instant::now();
        if clock.expired(now) {
            let why = last_error.as_ref().map(|e| format!("; last error: {e}")).unwrap_or_default();
            break format!("no keep-alive of lease {lease:x} was confirmed within its TTL of {:?}{why}", clock.ttl());
        }
        let budget = clock.expires().saturating_duration_since(now).min(options.request_timeout);
        match etcd.keep_alive(lease, budget).await {
            Ok((ttl, _)) if ttl.is_zero() => break format!("etcd no longer has lease {lease:x} (it expired or was revoked)"),
            Ok((ttl, sent)) => {
                if let Some(e) = last_error.take() {
                    tracing::info!(key, "keep-alive works again after: {e}");
                }
                clock.renewed(sent, ttl);
                *until.lock().unwrap_or_else(|e| e.into_inner()) = clock.expires();
            }
            Err(e) => {
                tracing::warn!(key, "keep-alive of lease {lease:x} failed: {e}");
                last_error = Some(e);
                clock.failed(Instant::now());
            }
        }
    };
    tracing::error!(key, "lost the registration: {reason}");
    status.send_replace(Registration::Lost { reason: format!("{key}: {reason}") });
    // Should etcd answer again before it expires the lease itself, the
    // record must not outlive the member's belief that it is gone.
    let _ = etcd.revoke(lease, options.request_timeout).await;
}
