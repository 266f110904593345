//! A connection's read path against a real node (in this process, on
//! loopback). A call whose request is the only one in flight reads its own
//! answer from the socket; otherwise a background task reads and hands each
//! answer over. These tests cut calls off half-way through their answers,
//! pipeline many calls on one connection, and park a call's future without
//! dropping it, and check that every call gets its own answer and none waits
//! on another.

use std::future::Future;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvplane_client::{Connection, Endpoint};
use kvplane_node::memory::PoolConfig;
use kvplane_node::server::{Node, NodeConfig};
use kvplane_protocol::{Block, PutEntry, Request, Response};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
/// Each connection's timeout. A call left asleep by a lost wake-up does not
/// fail when it passes: its timer wakes it, tokio's `Timeout` polls the
/// call before it fails it, and the call finds its answer. So a lost
/// wake-up shows as a call that took about this long, and the tests assert
/// that none came near it.
const PATIENCE: Duration = Duration::from_secs(10);

async fn node() -> Node {
    Node::start(NodeConfig {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        admin: None,
        pool: PoolConfig::new(256 * MIB),
        ..NodeConfig::default()
    })
    .await
    .expect("node starts")
}

async fn connect(node: &Node) -> Connection {
    let endpoint = Endpoint::Tcp(node.tcp_addr().expect("tcp").to_string());
    Connection::open(&endpoint, None, PATIENCE).await.expect("connects")
}

/// A value no other key has: its name, then bytes that depend on it.
fn value(name: &str, len: usize) -> Bytes {
    let seed = name.bytes().fold(17u32, |h, b| h.wrapping_mul(31).wrapping_add(b as u32));
    let mut v: Vec<u8> = name.bytes().chain(std::iter::repeat(0)).take(len).collect();
    for (i, b) in v.iter_mut().enumerate().skip(name.len()) {
        *b = (seed.wrapping_add(i as u32).wrapping_mul(2_654_435_761) >> 24) as u8;
    }
    Bytes::from(v)
}

async fn put(conn: &Connection, names: &[String], len: usize) {
    let entries = names.iter().map(|n| PutEntry { key: Bytes::from(n.clone()), block: Block::new(value(n, len)) }).collect();
    match conn.call(Request::Put { entries }).await.expect("PUT") {
        Response::Put { results } => assert!(results.iter().all(Result::is_ok), "stored: {results:?}"),
        other => panic!("PUT answered {other:?}"),
    }
}

fn keys(names: &[String]) -> Vec<Bytes> {
    names.iter().map(|n| Bytes::from(n.clone())).collect()
}

/// GET of `names`, each checked against its own value.
async fn get_checked(conn: &Connection, names: &[String], len: usize) {
    match conn.call(Request::Get { keys: keys(names) }).await.expect("GET") {
        Response::Get { results } => {
            assert_eq!(results.len(), names.len(), "one result per key");
            for (name, r) in names.iter().zip(results) {
                let got = r.unwrap_or_else(|e| panic!("GET {name}: {e:?}")).data;
                assert!(got == value(name, len), "GET {name} answered {} bytes starting {:?}", got.len(), &got[..got.len().min(24)]);
            }
        }
        other => panic!("GET answered {other:?}"),
    }
}

fn names(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}/{i}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_cut_off_half_way_through_its_answer_leaves_nothing_for_the_next_call() {
    let node = node().await;
    let conn = connect(&node).await;
    // 40 MiB per answer, more than a loopback socket's receive buffer can
    // grow to (32 MiB here): it takes at least two reads.
    let big = names("big", 40);
    let small = names("small", 64);
    put(&conn, &big, MIB).await;
    put(&conn, &small, 4 * KIB).await;
    get_checked(&conn, &big, MIB).await;

    // A loaded machine sometimes delivers a whole answer within two polls,
    // so the calls go on until 32 were cut off (each followed by a small
    // GET that must get its own answer), up to a limit.
    const CUTS: usize = 32;
    const TRIES: usize = 1024;
    let (mut cut, mut tried) = (0, 0);
    for name in small.iter().cycle() {
        if cut == CUTS || tried == TRIES {
            break;
        }
        tried += 1;
        // The call is alone on the connection, so it reads its own answer.
        // Its first poll sends the request and the second follows a wake-up
        // (bytes arrived): dropped then, it is cut off half-way.
        let polls = 2;
        let mut call = Box::pin(conn.call(Request::Get { keys: keys(&big) }));
        let mut polled = 0;
        let answered = std::future::poll_fn(|cx| match call.as_mut().poll(cx) {
            Poll::Ready(r) => Poll::Ready(Some(r)),
            Poll::Pending => {
                polled += 1;
                if polled == polls {
                    Poll::Ready(None)
                } else {
                    Poll::Pending
                }
            }
        })
        .await;
        drop(call);
        match answered {
            None => cut += 1,
            Some(r) => drop(r.expect("GET")),
        }
        get_checked(&conn, std::slice::from_ref(name), 4 * KIB).await;
    }
    assert!(cut == CUTS, "only {cut} of {tried} big GETs were cut off: the test proved little");
    assert!(conn.is_open(), "cutting calls off does not cost the connection");
    get_checked(&conn, &big, MIB).await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_calls_on_one_connection_each_get_their_own_answer() {
    let node = node().await;
    let conn = Arc::new(connect(&node).await);
    let small = names("small", 256);
    let big = names("big", 4);
    put(&conn, &small, 4 * KIB).await;
    put(&conn, &big, MIB).await;
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..8 {
        let (conn, small, big) = (Arc::clone(&conn), small.clone(), big.clone());
        tasks.spawn(async move {
            let mut slowest = Duration::ZERO;
            for i in 0..64 {
                let name = &small[(t * 64 + i * 7) % small.len()];
                let started = Instant::now();
                match i % 8 {
                    // Now and then a call cut off at once, or a large
                    // answer between the small ones.
                    3 => {
                        let _ = tokio::time::timeout(Duration::from_micros(50), get_checked(&conn, &big, MIB)).await;
                    }
                    5 => get_checked(&conn, &big[t % 4..t % 4 + 1], MIB).await,
                    _ => get_checked(&conn, std::slice::from_ref(name), 4 * KIB).await,
                }
                slowest = slowest.max(started.elapsed());
            }
            slowest
        });
    }
    while let Some(r) = tasks.join_next().await {
        let slowest = r.expect("every pipelined call got its own answer");
        assert!(slowest < PATIENCE / 2, "a call took {slowest:?}: it slept until its timeout's timer woke it (a lost wake-up)");
    }
    assert!(conn.is_open());
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_whose_future_is_parked_holds_up_no_other_call() {
    let node = node().await;
    let conn = connect(&node).await;
    let small = names("small", 2);
    put(&conn, &small, 4 * KIB).await;
    // Polled once, alone on the connection (so it drives the read loop),
    // then neither polled nor dropped while another call runs.
    // A loaded machine can answer within the first poll: then try again.
    let mut parked = Box::pin(get_checked(&conn, &small[..1], 4 * KIB));
    let mut tries = 0;
    while !std::future::poll_fn(|cx| Poll::Ready(parked.as_mut().poll(cx).is_pending())).await {
        tries += 1;
        assert!(tries < 100, "100 GETs were answered within their first poll");
        parked = Box::pin(get_checked(&conn, &small[..1], 4 * KIB));
    }
    let started = Instant::now();
    get_checked(&conn, &small[1..], 4 * KIB).await;
    assert!(started.elapsed() < PATIENCE, "the second call waited for the parked one");
    // The parked call still gets its own answer, handed over.
    parked.await;
    node.shutdown().await;
}

/// Owned GET answers are read into buffers earlier answers gave back (their
/// pages already mapped), and a buffer is lent again only once every block
/// cut from it was dropped: an answer still held keeps its own bytes while
/// later answers arrive, and each key is answered with its own value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owned_answers_reuse_buffers_only_once_their_blocks_are_dropped() {
    use kvplane_client::{Client, ClientConfig};
    let n = node().await;
    let endpoint = Endpoint::Tcp(n.tcp_addr().expect("tcp").to_string());
    let client =
        Client::connect(ClientConfig { connections: 1, timeout: PATIENCE, ..ClientConfig::new(endpoint) }).await.expect("connects");
    let conn = connect(&n).await;
    let len = 512 * KIB;
    let (a, b) = (names("pool-a", 4), names("pool-b", 4));
    put(&conn, &a, len).await;
    put(&conn, &b, len).await;
    let check = |names: &[String], answer: &[Result<Bytes, kvplane_client::KvError>]| {
        for (name, got) in names.iter().zip(answer) {
            let got = got.as_ref().unwrap_or_else(|e| panic!("GET {name}: {e}"));
            assert!(*got == value(name, len), "GET {name} answered bytes that are not its value");
        }
    };
    let held = client.get(keys(&a)).await.expect("GET a");
    for round in 0..8 {
        let names = if round % 2 == 0 { &b } else { &a };
        let answer = client.get(keys(names)).await.expect("GET");
        check(names, &answer);
        check(&a, &held);
    }
    let stats = client.answer_buffer_stats();
    assert_eq!(stats.allocated, 2, "the held answer's buffer and one more: {stats:?}");
    assert_eq!(stats.reused, 7, "every later answer in the one given back: {stats:?}");
    drop(held);
    assert_eq!(client.answer_buffer_stats().idle_bytes, 2 * 4 * len, "both buffers idle once nothing is held");
}
