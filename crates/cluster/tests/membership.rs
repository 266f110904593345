//! Membership against a real three-member etcd cluster: registration,
//! watching, draining, leaving, lapsed leases, a killed etcd member and a
//! member partitioned from etcd.

// A test binary exports nothing: its modules' `pub` items are for each
// other, so `unreachable_pub` (denied for the workspace) would flag them all.
#![allow(unreachable_pub)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use kvplane_cluster::{MemberView, Membership, MembershipWatch, Options, Registration, Router, Routing};
use kvplane_slots::{Member, MemberState, SlotTable};
use support::{EtcdCluster, Proxy};

/// Deadline for anything the tests wait for; generous for a loaded machine.
const PATIENCE: Duration = Duration::from_secs(30);
/// Long enough that a healthy member never lapses on a loaded machine.
const TTL: Duration = Duration::from_secs(5);
/// etcd's minimum lease TTL with its default election timeout.
const SHORT_TTL: Duration = Duration::from_secs(2);

fn member(i: usize) -> Member {
    Member {
        zone: format!("z{}", i % 2),
        labels: vec![("rack".into(), format!("r{i}"))],
        ..Member::up(format!("n{i}"), format!("10.0.0.{i}:9600"))
    }
}

fn ids(view: &MemberView) -> Vec<&str> {
    view.members.iter().map(|m| m.id.as_str()).collect()
}

/// Wait until `watch` shows a membership that satisfies `ok`.
async fn wait_view(watch: &mut MembershipWatch, what: &str, ok: impl Fn(&MemberView) -> bool) -> Arc<MemberView> {
    let result = tokio::time::timeout(PATIENCE, async {
        let mut view = watch.current();
        while !ok(&view) {
            view = watch.changed().await;
        }
        view
    })
    .await;
    result.unwrap_or_else(|_| panic!("{what}: not within {PATIENCE:?}; last seen {:?}", watch.current()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_see_each_other_join_and_drain_with_growing_versions() {
    support::log_to_test_output();
    let etcd = EtcdCluster::start();
    let endpoints = etcd.endpoints();
    // An observer that is no member, as a client would be: record every view.
    let observer = MembershipWatch::start(&endpoints, "joins").await.unwrap();
    assert!(observer.current().members.is_empty());
    let mut views = observer.subscribe();
    let recorder = tokio::spawn(async move {
        let mut seen = vec![views.borrow_and_update().clone()];
        while views.changed().await.is_ok() {
            seen.push(views.borrow_and_update().clone());
        }
        seen
    });

    let mut members = Vec::new();
    for i in 0..3 {
        members.push(Membership::register(&endpoints, "joins", member(i), TTL).await.unwrap());
    }
    let mut watches = Vec::new();
    for m in &members {
        watches.push(m.watch().await.unwrap());
    }
    watches.push(observer);
    let mut joined = Vec::new();
    for w in &mut watches {
        let view = wait_view(w, "all three members", |v| v.members.len() == 3).await;
        assert_eq!(ids(&view), ["n0", "n1", "n2"]);
        assert_eq!(view.members[1], member(1), "the record round-trips through etcd");
        joined.push(view.version);
    }

    members[1].set_state(MemberState::Draining).await.unwrap();
    for (w, joined) in watches.iter_mut().zip(&joined) {
        let view = wait_view(w, "n1 draining", |v| v.members.iter().any(|m| m.id == "n1" && m.state == MemberState::Draining)).await;
        assert!(view.version > *joined, "draining at version {} after joining at {joined}", view.version);
        assert_eq!(view.members.len(), 3);
    }
    assert_eq!(members[1].member().await.state, MemberState::Draining);

    drop(watches);
    let seen = recorder.await.unwrap();
    assert!(seen.windows(2).all(|w| w[0].version < w[1].version), "versions must grow: {seen:?}");
    let sizes: Vec<usize> = seen.iter().map(|v| v.members.len()).collect();
    assert_eq!((sizes.first(), sizes.last()), (Some(&0), Some(&3)), "{seen:?}");
    assert!(members.iter().all(|m| m.registration() == Registration::Registered));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_leaves_goes_at_once_and_one_that_stops_renewing_goes_when_its_lease_expires() {
    support::log_to_test_output();
    let etcd = EtcdCluster::start();
    let endpoints = etcd.endpoints();
    let stays = Membership::register(&endpoints, "leaves", member(0), TTL).await.unwrap();
    let leaves = Membership::register(&endpoints, "leaves", member(1), TTL).await.unwrap();
    let crashes = Membership::register(&endpoints, "leaves", member(2), SHORT_TTL).await.unwrap();
    let mut watch = stays.watch().await.unwrap();
    wait_view(&mut watch, "all three members", |v| v.members.len() == 3).await;

    leaves.leave().await.unwrap();
    let view = wait_view(&mut watch, "n1 gone after leaving", |v| !ids(v).contains(&"n1")).await;
    assert_eq!(ids(&view), ["n0", "n2"]);

    // A crash: the keep-alive stops, nothing is revoked.
    let lease_ttl = SHORT_TTL;
    drop(crashes);
    let stopped = tokio::time::Instant::now();
    let view = wait_view(&mut watch, "n2 gone when its lease expired", |v| !ids(v).contains(&"n2")).await;
    assert_eq!(ids(&view), ["n0"]);
    // Its last renewal was at most a third of the TTL before the drop.
    assert!(stopped.elapsed() >= lease_ttl / 2, "n2 went after {:?}, before its lease could expire", stopped.elapsed());
    assert_eq!(stays.registration(), Registration::Registered);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watch_and_keep_alives_survive_an_etcd_member_being_killed() {
    support::log_to_test_output();
    let mut etcd = EtcdCluster::start();
    let endpoints = etcd.endpoints();
    let mut members = Vec::new();
    for i in 0..2 {
        members.push(Membership::register(&endpoints, "kill", member(i), TTL).await.unwrap());
    }
    // The first endpoint answers first: that is where the watch streams from.
    let mut watch = MembershipWatch::start(&endpoints, "kill").await.unwrap();
    wait_view(&mut watch, "both members", |v| v.members.len() == 2).await;

    etcd.kill(0);
    let killed = tokio::time::Instant::now();
    // Right after the kill, etcd may hold requests for seconds while it
    // elects a leader: this registration must outlast that.
    let options = Options { request_timeout: PATIENCE, ..Options::default() };
    members.push(Membership::register_with(&endpoints, "kill", member(2), TTL, options).await.unwrap());
    members[0].set_state(MemberState::Draining).await.unwrap();
    let view = wait_view(&mut watch, "n2 joined and n0 draining after etcd0 died", |v| {
        v.members.len() == 3 && v.members[0].state == MemberState::Draining
    })
    .await;
    assert_eq!(ids(&view), ["n0", "n1", "n2"]);
    // The leases of n0 and n1 were renewed after the kill, through the
    // members left, and hold for a whole TTL from then.
    for m in &members[..2] {
        support::eventually("a renewal after etcd0 died", PATIENCE, || (m.registered_until() > killed + TTL).then_some(())).await;
    }
    assert_eq!(ids(&watch.current()), ["n0", "n1", "n2"], "a member lapsed after etcd0 died");
    assert!(members.iter().all(|m| m.registration() == Registration::Registered));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_partitioned_from_etcd_lapses_and_knows_it() {
    support::log_to_test_output();
    let etcd = EtcdCluster::start();
    let endpoints = etcd.endpoints();
    let proxy = Proxy::start(etcd.client_addr(0)).await;
    let victim = Membership::register(&[proxy.endpoint()], "partition", member(0), SHORT_TTL).await.unwrap();
    let other = Membership::register(&endpoints, "partition", member(1), TTL).await.unwrap();
    let mut watch = other.watch().await.unwrap();
    wait_view(&mut watch, "both members", |v| v.members.len() == 2).await;

    let mut status = victim.subscribe();
    let lost_at = tokio::spawn(async move {
        let _ = status.wait_for(|s| matches!(s, Registration::Lost { .. })).await;
        tokio::time::Instant::now()
    });
    proxy.cut();
    wait_view(&mut watch, "n0 gone after its partition", |v| ids(v) == ["n1"]).await;
    let gone_at = tokio::time::Instant::now();
    let reason = tokio::time::timeout(PATIENCE, victim.lost()).await.expect("the partitioned member did not report its registration lost");
    assert!(reason.contains(victim.key()) && reason.contains("lease"), "{reason}");
    assert!(matches!(victim.registration(), Registration::Lost { .. }));
    // It counts its lease lapsed from the last renewal it sent, so it knows
    // no later than the others see it go (give or take a timer's wake-up).
    let lost_at = lost_at.await.unwrap();
    assert!(lost_at <= gone_at + Duration::from_millis(500), "lost {:?} after the others saw it gone", lost_at - gone_at);
    let err = victim.set_state(MemberState::Draining).await.unwrap_err().to_string();
    assert!(err.contains(victim.key()), "{err}");
    assert_eq!(other.registration(), Registration::Registered);
}

/// A member started (`Membership::start`) while etcd's ports refuse: it is
/// `Pending` with the etcd error, refuses updates, and registers by itself
/// once etcd starts, within two leases; a member that never registered
/// leaves without error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_started_before_etcd_registers_once_etcd_answers() {
    support::log_to_test_output();
    let mut etcd = EtcdCluster::unstarted();
    let endpoints = etcd.endpoints();
    let options = Options { request_timeout: Duration::from_millis(500), ..Options::default() };
    let m = Membership::start(&endpoints, "late", member(0), SHORT_TTL, options.clone()).unwrap();
    let never = Membership::start(&endpoints, "late", member(1), SHORT_TTL, options).unwrap();
    let mut status = m.subscribe();
    let pending =
        tokio::time::timeout(PATIENCE, status.wait_for(|r| matches!(r, Registration::Pending { reason } if reason.contains("refused"))))
            .await
            .expect("Pending with the etcd error")
            .unwrap()
            .clone();
    assert!(matches!(&pending, Registration::Pending { reason } if reason.contains(m.key())), "{pending:?}");
    assert_eq!(m.lease_id(), 0);
    assert!(m.set_state(MemberState::Draining).await.is_err(), "an update before the registration");
    never.leave().await.expect("leaving before ever registering");

    etcd.restart();
    let answering = tokio::time::Instant::now();
    tokio::time::timeout(2 * SHORT_TTL, status.wait_for(|r| *r == Registration::Registered))
        .await
        .expect("registered within two leases of etcd answering")
        .unwrap();
    let took = answering.elapsed();
    let in_etcd = tokio::task::block_in_place(|| support::lease_of_key(&etcd, m.key()));
    assert_eq!(in_etcd, Ok(Some(m.lease_id())));
    assert!(m.counters().failed_attempts() > 0);
    assert_eq!((m.counters().lapses(), m.counters().reregistrations()), (0, 0));
    eprintln!("registered {took:?} after etcd answered, after {} failed attempts", m.counters().failed_attempts());
    let mut watch = m.watcher().start().await.unwrap();
    wait_view(&mut watch, "n0 in the membership", |v| ids(v) == ["n0"]).await;
    m.leave().await.unwrap();
}

/// An outage of all of etcd for three leases: the member knows it lapsed,
/// and once etcd answers again it registers again by itself, under a new
/// lease, within two leases, and its record can be changed again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_registers_again_once_etcd_answers_after_an_outage_longer_than_its_lease() {
    support::log_to_test_output();
    let mut etcd = EtcdCluster::start();
    let endpoints = etcd.endpoints();
    let m = Membership::register(&endpoints, "outage", member(0), SHORT_TTL).await.unwrap();
    let first = m.lease_id();
    assert_eq!(support::lease_of_key(&etcd, m.key()), Ok(Some(first)));
    // Every state the member reports, in order.
    let mut status = m.subscribe();
    let states = tokio::spawn(async move {
        let mut seen = vec![status.borrow_and_update().clone()];
        while status.changed().await.is_ok() {
            let now = status.borrow_and_update().clone();
            let done = now == Registration::Registered;
            seen.push(now);
            if done {
                break;
            }
        }
        seen
    });

    etcd.stop();
    let stopped = tokio::time::Instant::now();
    let reason = tokio::time::timeout(PATIENCE, m.lost()).await.expect("the member did not notice that its lease lapsed");
    assert!(reason.contains(m.key()), "{reason}");
    assert!(stopped.elapsed() <= SHORT_TTL + Duration::from_secs(1), "lost only {:?} after etcd stopped", stopped.elapsed());
    // The outage itself: etcd stays down for three leases.
    tokio::time::sleep_until(stopped + 3 * SHORT_TTL).await;
    etcd.restart();
    let answering = tokio::time::Instant::now();

    let deadline = answering + 2 * SHORT_TTL;
    let lease = loop {
        let lease = m.lease_id();
        let in_etcd = tokio::task::block_in_place(|| support::lease_of_key(&etcd, m.key()));
        if m.registration() == Registration::Registered && lease != first && in_etcd == Ok(Some(lease)) {
            break lease;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not registered again within two leases of etcd answering: {:?}, lease {lease:x} (first {first:x}), in etcd {in_etcd:?}",
            m.registration()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let took = answering.elapsed();
    eprintln!("registered again {took:?} after etcd answered, {:?} after it stopped", stopped.elapsed());
    let seen = tokio::time::timeout(PATIENCE, states).await.unwrap().unwrap();
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert!(
        matches!((&seen[0], &seen[1], &seen[2]), (Registration::Registered, Registration::Lost { .. }, Registration::Registered)),
        "{seen:?}"
    );

    let counters = m.counters();
    assert_eq!((counters.lapses(), counters.reregistrations()), (1, 1));
    // One attempt's calls keep trying every endpoint for `request_timeout`,
    // which may span the rest of the outage: no count is asserted.
    eprintln!("{} attempts to register again failed", counters.failed_attempts());

    // Others see it, and its record follows the new lease.
    let mut watch = MembershipWatch::start(&endpoints, "outage").await.unwrap();
    wait_view(&mut watch, "n0 back in the membership", |v| ids(v) == ["n0"]).await;
    m.set_state(MemberState::Draining).await.unwrap();
    wait_view(&mut watch, "n0 draining", |v| v.members.iter().any(|m| m.state == MemberState::Draining)).await;
    assert_eq!(support::lease_of_key(&etcd, m.key()), Ok(Some(lease)));
    m.leave().await.unwrap();
    wait_view(&mut watch, "n0 gone after leaving", |v| v.members.is_empty()).await;
}

/// A stand-in for a key-placement plugin: slot `s` is owned by the up or
/// joining members `s mod n` and `s + 1 mod n`.
fn round_robin(version: u64, members: Vec<Member>) -> Result<SlotTable, String> {
    const SLOTS: u32 = 64;
    let owners: Vec<u32> = (0..members.len() as u32).filter(|&i| members[i as usize].state.may_own()).collect();
    if owners.is_empty() {
        return Err("no member can own keys".into());
    }
    let r = owners.len().min(2);
    let table = (0..SLOTS as usize).flat_map(|s| (0..r).map(|j| owners[(s + j) % owners.len()]).collect::<Vec<_>>()).collect();
    SlotTable::new(version, members, SLOTS, 2, r as u32, table).map_err(|e| e.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_route_by_the_slot_table_of_the_current_membership() {
    support::log_to_test_output();
    let etcd = EtcdCluster::start();
    let endpoints = etcd.endpoints();
    let mut members = Vec::new();
    for i in 0..3 {
        members.push(Membership::register(&endpoints, "routing", member(i), TTL).await.unwrap());
    }
    let watch = MembershipWatch::start(&endpoints, "routing").await.unwrap();
    let routing = Routing::follow(watch, |version, members| async move { round_robin(version, members) }).await.unwrap();
    let mut routers = routing.subscribe();
    let keys: Vec<String> = (0..200).map(|i| format!("block-{i}")).collect();
    let wait = |what: &'static str, ok: fn(&Router) -> bool| {
        let mut routers = routers.clone();
        async move {
            let router = tokio::time::timeout(PATIENCE, routers.wait_for(|r| ok(r))).await;
            Arc::clone(&router.unwrap_or_else(|_| panic!("{what}: not within {PATIENCE:?}")).unwrap())
        }
    };
    let all = wait("a table of three members", |r| r.table().members().len() == 3).await;
    let groups = all.group_reads(&keys);
    assert_eq!(groups.len(), 3, "reads spread over every member");
    assert_eq!(groups.iter().map(|(_, i)| i.len()).sum::<usize>(), keys.len());

    members[0].set_state(MemberState::Draining).await.unwrap();
    let drained = wait("a table with n0 draining", |r| r.table().members()[0].state == MemberState::Draining).await;
    assert!(drained.version() > all.version());
    assert!(keys.iter().all(|k| drained.read_from(k.as_bytes()).is_some_and(|m| m.id != "n0")), "reads avoid the draining member");

    members.remove(0).leave().await.unwrap();
    let left = wait("a table without n0", |r| r.table().members().iter().all(|m| m.id != "n0")).await;
    assert!(left.version() > drained.version());
    assert_eq!(routing.current().version(), routers.borrow_and_update().version());
}

#[tokio::test]
async fn errors_name_the_endpoint_that_failed() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let options = Options { request_timeout: Duration::from_millis(300), ..Options::default() };
    let err = Membership::register_with(&[closed.as_str()], "errors", member(0), TTL, options.clone()).await.err().unwrap().to_string();
    assert!(err.contains(&closed) && err.contains("/v3/lease/grant") && err.contains("/kvplane/errors/members/n0"), "{err}");
    let err = MembershipWatch::start_with(&[closed.as_str()], "errors", options).await.err().unwrap().to_string();
    assert!(err.contains(&closed) && err.contains("/v3/kv/range") && err.contains("/kvplane/errors/members/"), "{err}");
    let err = Membership::register(&["https://etcd:2379"], "errors", member(0), TTL).await.err().unwrap().to_string();
    assert!(err.contains("https://etcd:2379"), "{err}");
    let err = MembershipWatch::start(&[closed.as_str()], "a/b").await.err().unwrap().to_string();
    assert!(err.contains("\"a/b\""), "{err}");
}
