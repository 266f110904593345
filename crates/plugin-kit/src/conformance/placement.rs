//! Key-placement conformance: determinism, R distinct members, typed errors,
//! balance and minimal movement on membership change.

use super::{ensure, Report};
use kvplane_runtime::error::Fault;
use kvplane_runtime::{KeyPlacement, Node};

fn nodes(n: usize) -> Vec<Node> {
    (0..n)
        .map(|i| Node {
            id: format!("node-{i}"),
            endpoint: format!("10.0.0.{i}:9600"),
            labels: vec![("zone".into(), format!("z{}", i % 3))],
        })
        .collect()
}

fn keys(n: usize, salt: &str) -> Vec<Vec<u8>> {
    (0..n).map(|i| format!("{salt}-block-{i}").into_bytes()).collect()
}

/// Primary owner of each key, asked in batches of the size a node would
/// send, so a slow interpreter-based plugin stays within its call deadline.
async fn primaries(p: &KeyPlacement, keys: &[Vec<u8>]) -> Result<Vec<String>, String> {
    let mut out = Vec::with_capacity(keys.len());
    for batch in keys.chunks(500) {
        let owners = p.owners(batch.to_vec(), 1).await.map_err(|e| e.to_string())?;
        out.extend(owners.into_iter().map(|mut o| o.remove(0)));
    }
    Ok(out)
}

pub async fn run(p: &KeyPlacement) -> Report {
    let mut r = Report::default();

    // An empty membership must be answered with a contract error, not a trap.
    let empty = async {
        match p.set_members(vec![]).await {
            Err(e) if matches!(e.fault, Fault::Returned(_)) => return Ok(format!("set-members refused: {}", e.fault)),
            Err(e) => return Err(format!("set-members([]) broke the plugin: {e}")),
            Ok(()) => {}
        }
        match p.owners(vec![b"k".to_vec()], 1).await {
            Err(e) if matches!(e.fault, Fault::Returned(_)) => Ok(format!("owners refused: {}", e.fault)),
            Err(e) => Err(format!("owners with no members broke the plugin: {e}")),
            Ok(o) => Err(format!("owners with no members answered {o:?}")),
        }
    }
    .await;
    r.record("an empty membership is answered with a typed error", empty);

    let members = nodes(5);
    let sample = keys(300, "conformance");
    let setup = p.set_members(members.clone()).await.map_err(|e| e.to_string());
    r.record("set-members accepts 5 members", setup.map(|()| String::new()));

    let distinct = async {
        let owners = p.owners(sample.clone(), 3).await.map_err(|e| e.to_string())?;
        ensure(owners.len() == sample.len(), || format!("{} answers for {} keys", owners.len(), sample.len()))?;
        for (i, o) in owners.iter().enumerate() {
            let mut d = o.clone();
            d.sort();
            d.dedup();
            ensure(o.len() == 3 && d.len() == 3, || format!("key #{i}: owners {o:?} are not 3 distinct members"))?;
            ensure(o.iter().all(|id| members.iter().any(|m| &m.id == id)), || format!("key #{i}: {o:?} names a non-member"))?;
        }
        Ok(format!("{} keys", sample.len()))
    }
    .await;
    r.record("owners returns R=3 distinct members per key", distinct);

    let deterministic = async {
        let a = p.owners(sample.clone(), 3).await.map_err(|e| e.to_string())?;
        let b = p.owners(sample.clone(), 3).await.map_err(|e| e.to_string())?;
        ensure(a == b, || "two identical calls gave different owners".into())?;
        let mut shuffled = members.clone();
        shuffled.reverse();
        p.set_members(shuffled).await.map_err(|e| e.to_string())?;
        let c = p.owners(sample.clone(), 3).await.map_err(|e| e.to_string())?;
        p.set_members(members.clone()).await.map_err(|e| e.to_string())?;
        ensure(a == c, || "the order of the membership list changed the owners".into())?;
        let singles = async {
            let mut v = Vec::new();
            for k in sample.iter().take(20) {
                v.push(p.owners(vec![k.clone()], 3).await.map_err(|e| e.to_string())?.remove(0));
            }
            Ok::<_, String>(v)
        }
        .await?;
        ensure(singles[..] == a[..20], || "a batch answered differently from single-key calls".into())?;
        Ok(String::new())
    }
    .await;
    r.record("placement is deterministic (repeat, membership order, batch vs single)", deterministic);

    let capped = async {
        let o = p.owners(vec![b"k".to_vec()], 9).await.map_err(|e| e.to_string())?;
        ensure(o[0].len() == 5, || format!("replicas 9 over 5 members gave {} owners", o[0].len()))?;
        match p.owners(vec![b"k".to_vec()], 0).await {
            Err(e) if matches!(e.fault, Fault::Returned(_)) => Ok("replicas 0 refused".into()),
            Err(e) => Err(format!("replicas 0 broke the plugin: {e}")),
            Ok(o) => Err(format!("replicas 0 answered {o:?}")),
        }
    }
    .await;
    r.record("replicas above membership returns every member; zero replicas is a typed error", capped);

    let n = 8;
    let many = keys(8000, "balance");
    let balance = async {
        p.set_members(nodes(n)).await.map_err(|e| e.to_string())?;
        let prim = primaries(p, &many).await?;
        let ideal = many.len() as f64 / n as f64;
        let mut worst = 0.0f64;
        for m in nodes(n) {
            let c = prim.iter().filter(|id| **id == m.id).count() as f64;
            worst = worst.max((c - ideal).abs() / ideal);
        }
        ensure(worst <= 0.5, || format!("a member's share is {:.0}% off the ideal", worst * 100.0))?;
        Ok(format!("worst share {:.0}% off ideal over {n} members", worst * 100.0))
    }
    .await;
    r.record("keys spread evenly over members", balance);

    let movement = async {
        p.set_members(nodes(n)).await.map_err(|e| e.to_string())?;
        let before = primaries(p, &many).await?;
        p.set_members(nodes(n + 1)).await.map_err(|e| e.to_string())?;
        let after = primaries(p, &many).await?;
        let moved = before.iter().zip(&after).filter(|(b, a)| b != a).count() as f64 / many.len() as f64;
        let ideal = 1.0 / (n + 1) as f64;
        ensure(moved <= 2.0 * ideal, || format!("one join moved {:.1}% of keys; about {:.1}% expected", moved * 100.0, ideal * 100.0))?;
        Ok(format!("join of 1 to {n} moved {:.1}% (ideal {:.1}%)", moved * 100.0, ideal * 100.0))
    }
    .await;
    r.record("one member joining moves about 1/N of keys", movement);
    r
}
