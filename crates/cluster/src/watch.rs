//! Following the cluster's membership through an etcd watch.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kvplane_slots::Member;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::etcd::{Etcd, EventKind, Kv, WatchMessage};
use crate::record::{check_name, decode_member, members_prefix};
use crate::{Error, Options};

/// The members of the cluster as of one etcd revision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberView {
    /// The etcd revision of the last change seen: grows with every change,
    /// so it can serve as the slot table's version.
    pub version: u64,
    /// Sorted by id, so that every node computes placement from the same list.
    pub members: Vec<Member>,
}

/// The cluster's membership, kept current by a background task: one list,
/// then an etcd watch from the listed revision; after a watch breaks (its
/// etcd member stops, loses its leader, or compacted the revisions it
/// needed) it lists again and watches from there. Dropping it stops the task.
pub struct MembershipWatch {
    view: watch::Receiver<Arc<MemberView>>,
    task: JoinHandle<()>,
}

impl MembershipWatch {
    /// List `cluster`'s members and follow them. `Err` if no endpoint
    /// answers the first list.
    pub async fn start<S: AsRef<str>>(endpoints: &[S], cluster: &str) -> Result<MembershipWatch, Error> {
        MembershipWatch::start_with(endpoints, cluster, Options::default()).await
    }

    pub async fn start_with<S: AsRef<str>>(endpoints: &[S], cluster: &str, options: Options) -> Result<MembershipWatch, Error> {
        let etcd = Arc::new(Etcd::new(endpoints, &options)?);
        MembershipWatch::start_on(etcd, cluster, options).await
    }

    pub(crate) async fn start_on(etcd: Arc<Etcd>, cluster: &str, options: Options) -> Result<MembershipWatch, Error> {
        check_name("cluster name", cluster)?;
        let prefix = members_prefix(cluster);
        let (revision, kvs) =
            etcd.range_prefix(&prefix, options.request_timeout).await.map_err(Error::during(|| format!("listing {prefix}")))?;
        let members = decode_all(&kvs);
        let (tx, view) = watch::channel(Arc::new(MemberView { version: revision as u64, members: members.values().cloned().collect() }));
        let task = tokio::spawn(follow(etcd, prefix, revision, members, tx, options));
        Ok(MembershipWatch { view, task })
    }

    /// The membership now.
    pub fn current(&self) -> Arc<MemberView> {
        Arc::clone(&self.view.borrow())
    }

    /// Wait for a membership newer than the last one this handle returned
    /// (from `current` or `changed`); changes in between are merged.
    pub async fn changed(&mut self) -> Arc<MemberView> {
        if self.view.changed().await.is_err() {
            // The task runs until this handle drops; should it ever stop,
            // no change can come, and answering at once would make every
            // caller's loop spin.
            std::future::pending::<()>().await;
        }
        Arc::clone(&self.view.borrow_and_update())
    }

    /// Another receiver of the same views.
    pub fn subscribe(&self) -> watch::Receiver<Arc<MemberView>> {
        self.view.clone()
    }
}

impl Drop for MembershipWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn follow(
    etcd: Arc<Etcd>,
    prefix: String,
    mut revision: i64,
    mut members: BTreeMap<String, Member>,
    tx: watch::Sender<Arc<MemberView>>,
    options: Options,
) {
    let mut backoff = Backoff::new(options.retry_max);
    let mut listed = true;
    loop {
        if !listed {
            match etcd.range_prefix(&prefix, options.request_timeout).await {
                Ok((at, kvs)) => {
                    members = decode_all(&kvs);
                    revision = revision.max(at);
                    publish(&tx, revision, &members);
                }
                Err(e) => {
                    tracing::warn!(prefix, "listing members failed, trying again: {e}");
                    backoff.wait().await;
                    continue;
                }
            }
        }
        listed = false;
        let mut stream = match etcd.watch(&prefix, revision + 1, options.request_timeout).await {
            Ok(stream) => stream,
            Err(e) => {
                tracing::warn!(prefix, "watching members failed, listing again: {e}");
                backoff.wait().await;
                continue;
            }
        };
        loop {
            match stream.next().await {
                Ok(WatchMessage::Created) => backoff.reset(),
                Ok(WatchMessage::Events { events, .. }) => {
                    for event in events {
                        revision = revision.max(event.kv.mod_revision);
                        let id = event.kv.key.strip_prefix(&prefix).unwrap_or(&event.kv.key).to_owned();
                        match event.kind {
                            EventKind::Delete => {
                                members.remove(&id);
                            }
                            EventKind::Put => match decode_member(&event.kv.key, &event.kv.value) {
                                Ok(member) => {
                                    members.insert(id, member);
                                }
                                Err(e) => {
                                    tracing::warn!("ignoring a member record: {e}");
                                    members.remove(&id);
                                }
                            },
                        }
                    }
                    publish(&tx, revision, &members);
                }
                Ok(WatchMessage::Canceled { reason }) => {
                    tracing::warn!(prefix, endpoint = stream.endpoint(), "etcd ended the members watch ({reason}); listing again");
                    break;
                }
                Err(e) => {
                    tracing::warn!(prefix, "the members watch broke ({e}); listing again");
                    break;
                }
            }
        }
        backoff.wait().await;
    }
}

/// Members of the listed records; a record that does not decode is left
/// out (a member nobody can route to), with a warning naming its key.
fn decode_all(kvs: &[Kv]) -> BTreeMap<String, Member> {
    let mut members = BTreeMap::new();
    for kv in kvs {
        match decode_member(&kv.key, &kv.value) {
            Ok(member) => {
                members.insert(member.id.clone(), member);
            }
            Err(e) => tracing::warn!("ignoring a member record: {e}"),
        }
    }
    members
}

/// Send a new view if the members changed: a re-list that finds what the
/// watch already showed is no change.
fn publish(tx: &watch::Sender<Arc<MemberView>>, revision: i64, members: &BTreeMap<String, Member>) {
    tx.send_if_modified(|view| {
        if view.members.len() == members.len() && view.members.iter().zip(members.values()).all(|(a, b)| a == b) {
            return false;
        }
        *view = Arc::new(MemberView { version: (revision as u64).max(view.version + 1), members: members.values().cloned().collect() });
        true
    });
}

/// Waits between attempts: 100 ms, doubling up to a limit.
pub(crate) struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(100);

    pub(crate) fn new(max: Duration) -> Backoff {
        Backoff { next: Backoff::FIRST, max }
    }

    pub(crate) fn reset(&mut self) {
        self.next = Backoff::FIRST;
    }

    pub(crate) async fn wait(&mut self) {
        tokio::time::sleep(self.next).await;
        self.next = (self.next * 2).min(self.max);
    }
}
