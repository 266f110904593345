//! Client-side routing: which member to send a key to, from a slot table
//! recomputed on every membership change.
//!
//! Clients route by themselves rather than through a proxy node so that a
//! request costs one hop; the table is a hash and an index per key (see
//! [`kvplane_slots`]).

use std::fmt::Display;
use std::future::Future;
use std::sync::Arc;

use kvplane_slots::{Member, MemberState, SlotTable};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::watch::{MemberView, MembershipWatch};

/// A slot table and the questions a client asks of it.
#[derive(Debug, Clone)]
pub struct Router {
    table: SlotTable,
}

impl Router {
    pub fn new(table: SlotTable) -> Router {
        Router { table }
    }

    pub fn table(&self) -> &SlotTable {
        &self.table
    }

    /// The membership version the table was computed for.
    pub fn version(&self) -> u64 {
        self.table.version
    }

    /// The owners of `key`, primary first.
    pub fn owners<'a>(&'a self, key: &[u8]) -> impl Iterator<Item = &'a Member> + 'a {
        self.table.owner_members(key)
    }

    /// Where to read `key`: its first owner that serves reads — up, or else
    /// draining (it still holds its keys while it hands them on). A joining
    /// owner is still filling and serves none: the first of the table's
    /// [readable owners](SlotTable::readable_owners) that is not joining.
    pub fn read_from(&self, key: &[u8]) -> Option<&Member> {
        let members = self.table.members();
        self.table.readable_owners(key).map(|o| &members[o as usize]).find(|m| m.state != MemberState::Joining)
    }

    /// Indices of `keys` grouped by the member to read each from, in the
    /// order the members first appear, so that a batch becomes one request
    /// per member. Keys nobody can serve come last, under `None`.
    pub fn group_reads<K: AsRef<[u8]>>(&self, keys: &[K]) -> Vec<(Option<&Member>, Vec<usize>)> {
        let mut groups: Vec<(Option<&Member>, Vec<usize>)> = Vec::new();
        let mut unserved = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            match self.read_from(key.as_ref()) {
                None => unserved.push(i),
                Some(member) => match groups.iter_mut().find(|(m, _)| m.is_some_and(|m| m.id == member.id)) {
                    Some((_, indices)) => indices.push(i),
                    None => groups.push((Some(member), vec![i])),
                },
            }
        }
        if !unserved.is_empty() {
            groups.push((None, unserved));
        }
        groups
    }
}

/// A [`Router`] kept current: recomputed by `compute` (a key-placement
/// plugin, or the native ring) each time the followed membership changes.
/// Dropping it stops following.
pub struct Routing {
    router: watch::Receiver<Arc<Router>>,
    task: JoinHandle<()>,
}

impl Routing {
    /// Compute the first table from `members`' current view and follow it.
    /// `Err` with the reason if that first table cannot be computed; a later
    /// failure keeps the last good table and is logged with its version.
    pub async fn follow<F, Fut, E>(mut members: MembershipWatch, mut compute: F) -> Result<Routing, String>
    where
        F: FnMut(u64, Vec<Member>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<SlotTable, E>> + Send,
        E: Display,
    {
        let first = members.current();
        let table = compute(first.version, first.members.clone())
            .await
            .map_err(|e| format!("computing the slot table of membership version {}: {e}", first.version))?;
        let (tx, router) = watch::channel(Arc::new(Router::new(table)));
        let task = tokio::spawn(async move {
            loop {
                let view: Arc<MemberView> = members.changed().await;
                match compute(view.version, view.members.clone()).await {
                    Ok(table) => {
                        tx.send_replace(Arc::new(Router::new(table)));
                    }
                    Err(e) => tracing::warn!(
                        version = view.version,
                        "keeping the slot table of version {}: computing the next failed: {e}",
                        tx.borrow().version()
                    ),
                }
            }
        });
        Ok(Routing { router, task })
    }

    /// The router now.
    pub fn current(&self) -> Arc<Router> {
        Arc::clone(&self.router.borrow())
    }

    /// Another receiver of the same routers.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Router>> {
        self.router.clone()
    }
}

impl Drop for Routing {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(states: &[MemberState]) -> SlotTable {
        let members: Vec<Member> = states
            .iter()
            .enumerate()
            .map(|(i, &state)| Member { state, ..Member::up(format!("n{i}"), format!("10.0.0.{i}:9600")) })
            .collect();
        let n = members.len() as u32;
        // Slot s: members s % n, then (s + 1) % n.
        let owners = (0..8).flat_map(|s| [s % n, (s + 1) % n]).collect();
        SlotTable::new(4, members, 8, 2, 2, owners).unwrap()
    }

    fn key_of_slot(slot: u32) -> Vec<u8> {
        (0u32..).map(|i| i.to_string().into_bytes()).find(|k| kvplane_slots::slot_of(k, 8) == slot).unwrap()
    }

    #[test]
    fn reads_go_to_the_first_up_owner_else_a_draining_one() {
        use MemberState::*;
        let router = Router::new(table(&[Joining, Up, Draining]));
        assert_eq!(router.version(), 4);
        // Slot 0: n0 (joining), n1 (up).
        assert_eq!(router.read_from(&key_of_slot(0)).unwrap().id, "n1");
        // Slot 2: n2 (draining), n0 (joining): only the draining one serves.
        assert_eq!(router.read_from(&key_of_slot(2)).unwrap().id, "n2");
        let ids: Vec<&str> = router.owners(&key_of_slot(2)).map(|m| m.id.as_str()).collect();
        assert_eq!(ids, ["n2", "n0"]);
        let router = Router::new(table(&[Joining, Joining]));
        assert!(router.read_from(&key_of_slot(0)).is_none());
    }

    #[test]
    fn batches_split_into_one_group_per_member() {
        use MemberState::*;
        let router = Router::new(table(&[Up, Up, Joining]));
        // Slots 0, 1, 2, 3 read from n0, n1, n0 (n2 joins), n0.
        let keys: Vec<Vec<u8>> = [0, 1, 2, 3, 1].map(key_of_slot).to_vec();
        let groups: Vec<(Option<&str>, Vec<usize>)> =
            router.group_reads(&keys).into_iter().map(|(m, i)| (m.map(|m| m.id.as_str()), i)).collect();
        assert_eq!(groups, vec![(Some("n0"), vec![0, 2, 3]), (Some("n1"), vec![1, 4])]);
        let router = Router::new(table(&[Joining, Joining, Up]));
        let groups = router.group_reads(&[key_of_slot(0)]);
        assert!(groups.len() == 1 && groups[0].0.is_none());
    }
}
