//! A member's own registration: its record under a lease, kept alive, and
//! put again under a new lease whenever the old one lapsed.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvplane_slots::{Member, MemberState};
use tokio::sync::{watch, Mutex};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::etcd::Etcd;
use crate::lease::LeaseClock;
use crate::record::{check_name, encode_member, member_key};
use crate::watch::{Backoff, MembershipWatch};
use crate::{Error, Options};

/// gRPC status `NOT_FOUND`, as etcd answers for a lease it does not have.
const GRPC_NOT_FOUND: i64 = 5;

/// Whether this member is (still) in the cluster, as far as it can tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Registration {
    /// Its lease is surely alive (see the crate docs for "surely").
    Registered,
    /// Its lease lapsed or was revoked: the others no longer see it, and its
    /// keys have moved. The member asks etcd for a new lease until one is
    /// granted, then puts its record again and is `Registered` once more.
    Lost { reason: String },
    /// Not registered yet: started by [`Membership::start`] while etcd did
    /// not take the first registration (unreachable, no leader). The member
    /// keeps asking, with the same backoff as after a lapse, and is
    /// `Registered` once etcd takes it; `reason` is the last attempt's error.
    Pending { reason: String },
}

/// How often a member's registration lapsed and came back; shared with the
/// keeper, read by whoever reports them (STATS, `/metrics`).
#[derive(Debug, Default)]
pub struct RegistrationCounters {
    lapses: AtomicU64,
    reregistrations: AtomicU64,
    failed_attempts: AtomicU64,
}

impl RegistrationCounters {
    /// Times the lease lapsed (no confirmed renewal within its TTL, or etcd
    /// no longer had it).
    pub fn lapses(&self) -> u64 {
        self.lapses.load(Ordering::Relaxed)
    }

    /// Times the member registered again after a lapse.
    pub fn reregistrations(&self) -> u64 {
        self.reregistrations.load(Ordering::Relaxed)
    }

    /// Attempts to register (the first registration of a member started by
    /// [`Membership::start`], or again after a lapse) that etcd did not
    /// answer or refused.
    pub fn failed_attempts(&self) -> u64 {
        self.failed_attempts.load(Ordering::Relaxed)
    }
}

/// What the member and its keeper share.
struct Shared {
    /// The lease the record is (to be) attached to; replaced on every
    /// registration after a lapse.
    lease: AtomicI64,
    record: Mutex<Member>,
    /// Until when the lease is surely alive, as the keeper last learned.
    until: std::sync::Mutex<Instant>,
    counters: Arc<RegistrationCounters>,
}

impl Shared {
    fn set_until(&self, until: Instant) {
        *self.until.lock().unwrap_or_else(|e| e.into_inner()) = until;
    }
}

/// A member registered in etcd. Dropping it stops the keep-alive without
/// revoking the lease (as a crash would: the record goes when the lease
/// expires); [`Membership::leave`] removes it at once.
pub struct Membership {
    etcd: Arc<Etcd>,
    cluster: String,
    key: String,
    shared: Arc<Shared>,
    status: watch::Receiver<Registration>,
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
        let etcd = Arc::new(Etcd::new(endpoints, &options)?);
        let key = member_key(cluster, &member.id);
        let (lease, clock) = register_once(&etcd, &key, &member, lease_ttl, &options).await?;
        tracing::info!(key, member = member.id, lease = format!("{lease:x}"), ttl = ?clock.ttl(), "registered in etcd");
        Ok(Membership::spawn(etcd, cluster, key, member, lease_ttl, options, Some((lease, clock))))
    }

    /// As [`Membership::register_with`], without waiting for etcd: the
    /// member starts [`Registration::Pending`] and a background task
    /// registers it (100 ms doubling up to `options.retry_max` between
    /// failed attempts, each counted in
    /// [`RegistrationCounters::failed_attempts`]) and keeps it registered
    /// from then on. For a node that must come up while etcd is down (a
    /// pod restarted during an etcd outage would otherwise crash-loop), and
    /// register by itself once etcd answers. `Err` only for what no attempt
    /// could fix: a bad name or endpoint. Needs a Tokio runtime.
    pub fn start<S: AsRef<str>>(
        endpoints: &[S],
        cluster: &str,
        member: Member,
        lease_ttl: Duration,
        options: Options,
    ) -> Result<Membership, Error> {
        check_name("cluster name", cluster)?;
        check_name("member id", &member.id)?;
        let etcd = Arc::new(Etcd::new(endpoints, &options)?);
        let key = member_key(cluster, &member.id);
        Ok(Membership::spawn(etcd, cluster, key, member, lease_ttl, options, None))
    }

    /// The member and its keeper, registered under `first` or, without it,
    /// [`Registration::Pending`] until the keeper registers it.
    fn spawn(
        etcd: Arc<Etcd>,
        cluster: &str,
        key: String,
        member: Member,
        lease_ttl: Duration,
        options: Options,
        first: Option<(i64, LeaseClock)>,
    ) -> Membership {
        let status = match first {
            Some(_) => Registration::Registered,
            None => Registration::Pending { reason: format!("{key}: registering in etcd") },
        };
        let (tx, status) = watch::channel(status);
        let id = member.id.clone();
        let shared = Arc::new(Shared {
            lease: AtomicI64::new(first.as_ref().map_or(0, |(lease, _)| *lease)),
            record: Mutex::new(member),
            until: std::sync::Mutex::new(first.as_ref().map_or_else(Instant::now, |(_, clock)| clock.expires())),
            counters: Arc::default(),
        });
        let keeper = Keeper {
            etcd: Arc::clone(&etcd),
            key: key.clone(),
            member: id,
            ttl: lease_ttl,
            shared: Arc::clone(&shared),
            status: tx,
            options: options.clone(),
        };
        let keeper = tokio::spawn(keeper.run(first));
        Membership { etcd, cluster: cluster.to_owned(), key, shared, status, keeper, options }
    }

    /// The etcd key of this member's record.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The etcd lease the record is attached to: a new one after every
    /// registration that followed a lapse; 0 before the first registration
    /// of a member started by [`Membership::start`].
    pub fn lease_id(&self) -> i64 {
        self.shared.lease.load(Ordering::Acquire)
    }

    /// The record as last written.
    pub async fn member(&self) -> Member {
        self.shared.record.lock().await.clone()
    }

    /// How often the registration lapsed and came back.
    pub fn counters(&self) -> Arc<RegistrationCounters> {
        Arc::clone(&self.shared.counters)
    }

    /// Where the registration stands now.
    pub fn registration(&self) -> Registration {
        self.status.borrow().clone()
    }

    /// Until when the lease is surely alive: the send time of the last
    /// confirmed renewal plus the TTL. Past it, the registration is lost.
    pub fn registered_until(&self) -> Instant {
        *self.shared.until.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Changes of [`Membership::registration`].
    pub fn subscribe(&self) -> watch::Receiver<Registration> {
        self.status.clone()
    }

    /// Wait until the registration is lost (now or later); why.
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
        // Held across the put: the keeper reads the record to register
        // again only between updates, so it never puts an older one.
        let mut record = self.shared.record.lock().await;
        if let Registration::Lost { reason } | Registration::Pending { reason } = self.registration() {
            return Err(Error::Lost { key: self.key.clone(), reason });
        }
        let mut next = record.clone();
        change(&mut next);
        next.id.clone_from(&record.id);
        // Should the lease lapse meanwhile, etcd refuses a put under it (the
        // keeper revokes a lapsed lease before it asks for a new one).
        self.etcd
            .put(&self.key, &encode_member(&next), self.lease_id(), self.options.request_timeout)
            .await
            .map_err(Error::during(|| format!("updating {}", self.key)))?;
        *record = next;
        Ok(())
    }

    /// Follow the cluster's membership through this member's etcd client.
    pub async fn watch(&self) -> Result<MembershipWatch, Error> {
        MembershipWatch::start_on(Arc::clone(&self.etcd), &self.cluster, self.options.clone()).await
    }

    /// What starts [`Membership::watch`] through the same etcd client, and
    /// borrows nothing of the member: for a task that starts following the
    /// membership once the member registered, and again if etcd did not
    /// answer the first list.
    pub fn watcher(&self) -> MembershipWatcher {
        MembershipWatcher { etcd: Arc::clone(&self.etcd), cluster: self.cluster.clone(), options: self.options.clone() }
    }

    /// The timing of its calls to etcd (the backoff bound of registering).
    pub fn options(&self) -> &Options {
        &self.options
    }

    /// Leave the cluster now: revoke the lease, which deletes the record.
    /// A lease etcd no longer has (it lapsed) counts as revoked.
    pub async fn leave(self) -> Result<(), Error> {
        self.keeper.abort();
        let lease = self.lease_id();
        if lease == 0 {
            // Never registered (started while etcd was unreachable): no
            // record to remove.
            tracing::info!(key = self.key, "left the cluster before it ever registered");
            return Ok(());
        }
        match self.etcd.revoke(lease, self.options.request_timeout).await {
            Ok(()) => {}
            Err(Error::Etcd { code: GRPC_NOT_FOUND, .. }) => {}
            Err(e) => return Err(Error::during(|| format!("revoking lease {lease:x} of {}", self.key))(e)),
        }
        tracing::info!(key = self.key, "left the cluster");
        Ok(())
    }
}

/// Starts watches of a member's cluster (see [`Membership::watcher`]).
#[derive(Clone)]
pub struct MembershipWatcher {
    etcd: Arc<Etcd>,
    cluster: String,
    options: Options,
}

impl MembershipWatcher {
    /// List the cluster's members and follow them; `Err` if no endpoint
    /// answers the first list.
    pub async fn start(&self) -> Result<MembershipWatch, Error> {
        MembershipWatch::start_on(Arc::clone(&self.etcd), &self.cluster, self.options.clone()).await
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        self.keeper.abort();
    }
}

/// Grant a lease of `ttl`, put `member` under `key` attached to it, and
/// renew it once; the lease and its clock. A lease granted for a put that
/// failed is revoked (best effort: unused, it would only expire later).
async fn register_once(etcd: &Etcd, key: &str, member: &Member, ttl: Duration, options: &Options) -> Result<(i64, LeaseClock), Error> {
    let during = || format!("registering {key}");
    let (lease, granted, sent) = etcd.grant(ttl, options.request_timeout).await.map_err(Error::during(during))?;
    let mut clock = LeaseClock::granted(sent, granted);
    // Renew once right after the put: when etcd was slow to take the put
    // (an election), the lease may be near the end its grant gave it.
    let registered = async {
        etcd.put(key, &encode_member(member), lease, options.request_timeout).await?;
        match etcd.keep_alive(lease, options.request_timeout).await? {
            (ttl, _) if ttl.is_zero() => {
                Err(Error::Lost { key: key.to_owned(), reason: format!("lease {lease:x} expired while registering") })
            }
            (ttl, sent) => {
                clock.renewed(sent, ttl);
                Ok(())
            }
        }
    };
    if let Err(e) = registered.await {
        let _ = etcd.revoke(lease, options.request_timeout).await;
        return Err(Error::during(during)(e));
    }
    Ok((lease, clock))
}

/// The background task of a [`Membership`]: keeps the lease alive while it
/// can, and after a lapse registers again until etcd takes it.
struct Keeper {
    etcd: Arc<Etcd>,
    key: String,
    /// The member's id, for the log.
    member: String,
    /// The TTL asked for at every registration.
    ttl: Duration,
    shared: Arc<Shared>,
    status: watch::Sender<Registration>,
    options: Options,
}

impl Keeper {
    async fn run(self, first: Option<(i64, LeaseClock)>) {
        let (mut lease, mut clock) = match first {
            Some(registered) => registered,
            None => {
                let (lease, clock) = self.register_until_taken(None).await;
                self.shared.lease.store(lease, Ordering::Release);
                self.shared.set_until(clock.expires());
                let member = &self.member;
                tracing::info!(key = self.key, member, lease = format!("{lease:x}"), ttl = ?clock.ttl(), "registered in etcd");
                self.status.send_replace(Registration::Registered);
                (lease, clock)
            }
        };
        loop {
            let reason = self.keep_alive(lease, clock).await;
            self.shared.counters.lapses.fetch_add(1, Ordering::Relaxed);
            let member = &self.member;
            tracing::error!(key = self.key, member, "lost the registration, registering again once etcd answers: {reason}");
            self.status.send_replace(Registration::Lost { reason: format!("{}: {reason}", self.key) });
            (lease, clock) = self.register_until_taken(Some(lease)).await;
            self.shared.lease.store(lease, Ordering::Release);
            self.shared.set_until(clock.expires());
            self.shared.counters.reregistrations.fetch_add(1, Ordering::Relaxed);
            tracing::info!(key = self.key, member, lease = format!("{lease:x}"), ttl = ?clock.ttl(), "registered in etcd again");
            self.status.send_replace(Registration::Registered);
        }
    }

    /// Renew `lease` every third of its TTL until it can no longer be sure
    /// it is alive; why not.
    async fn keep_alive(&self, lease: i64, mut clock: LeaseClock) -> String {
        let (etcd, key) = (&self.etcd, &self.key);
        let mut last_error: Option<Error> = None;
        loop {
            tokio::time::sleep_until(clock.next_wakeup()).await;
            let now = Instant::now();
            if clock.expired(now) {
                let why = last_error.as_ref().map(|e| format!("; last error: {e}")).unwrap_or_default();
                return format!("no keep-alive of lease {lease:x} was confirmed within its TTL of {:?}{why}", clock.ttl());
            }
            let budget = clock.expires().saturating_duration_since(now).min(self.options.request_timeout);
            match etcd.keep_alive(lease, budget).await {
                Ok((ttl, _)) if ttl.is_zero() => return format!("etcd no longer has lease {lease:x} (it expired or was revoked)"),
                Ok((ttl, sent)) => {
                    if let Some(e) = last_error.take() {
                        tracing::info!(key, "keep-alive works again after: {e}");
                    }
                    clock.renewed(sent, ttl);
                    self.shared.set_until(clock.expires());
                }
                Err(e) => {
                    tracing::warn!(key, "keep-alive of lease {lease:x} failed: {e}");
                    last_error = Some(e);
                    clock.failed(Instant::now());
                }
            }
        }
    }

    /// Revoke the lapsed lease (if any: none before the first
    /// registration), then register the current record under a new lease,
    /// pausing between failed attempts (100 ms doubling up to `retry_max`)
    /// until etcd takes it. The revoke comes first: should etcd still hold
    /// the old lease (a restarted etcd grants every lease a fresh TTL), the
    /// record must not outlive the member's belief that it is gone, nor a
    /// put of [`Membership::update`] under it succeed.
    async fn register_until_taken(&self, lapsed: Option<i64>) -> (i64, LeaseClock) {
        let mut backoff = Backoff::new(self.options.retry_max);
        let mut revoked = lapsed.is_none();
        let lapsed = lapsed.unwrap_or_default();
        for attempt in 1u64.. {
            let result = async {
                if !revoked {
                    match self.etcd.revoke(lapsed, self.options.request_timeout).await {
                        Ok(()) | Err(Error::Etcd { code: GRPC_NOT_FOUND, .. }) => revoked = true,
                        Err(e) => return Err(Error::during(|| format!("revoking the lapsed lease {lapsed:x} of {}", self.key))(e)),
                    }
                }
                // Not held across the calls: an update waiting for it
                // would wait out an outage. While the registration is lost
                // no update changes it, so this is the record to put.
                let record = self.shared.record.lock().await.clone();
                register_once(&self.etcd, &self.key, &record, self.ttl, &self.options).await
            }
            .await;
            match result {
                Ok(registered) => return registered,
                Err(e) => {
                    self.shared.counters.failed_attempts.fetch_add(1, Ordering::Relaxed);
                    if matches!(*self.status.borrow(), Registration::Pending { .. }) {
                        // The first registration: the reason readiness
                        // and STATS give is the latest error.
                        tracing::warn!(key = self.key, attempt, "registering failed, trying again: {e}");
                        self.status.send_replace(Registration::Pending { reason: format!("{}: {e}", self.key) });
                    } else {
                        tracing::warn!(key = self.key, attempt, "registering again failed, trying again: {e}");
                    }
                    backoff.wait().await;
                }
            }
        }
        unreachable!("the attempts above never end")
    }
}
