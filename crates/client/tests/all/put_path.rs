//! `Client::put` against a real node (in this process, on loopback): a
//! batch's per-key results come back in the batch's order whichever way its
//! blocks go — all sent in one frame (the common case, answered as they
//! come), split over several frames by the node's key limit, some refused
//! by the client for being over the node's largest block — and each key
//! holds its own block after. (The node answers every sent block here
//! with success, so the order of sent blocks' results shows only through
//! the refusals' places and the blocks read back.)

use bytes::Bytes;
use kvplane_client::{Client, ClientConfig, Endpoint, KvError};
use kvplane_node::memory::PoolConfig;
use kvplane_node::server::{Node, NodeConfig};
use kvplane_protocol::Limits;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
/// The node's largest block in these tests.
const MAX_BLOCK: usize = 64 * KIB;
/// The node's most keys a batch, so that 20 keys take three frames.
const MAX_KEYS: u32 = 8;

async fn client() -> (Node, Client) {
    let node = Node::start(NodeConfig {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        admin: None,
        pool: PoolConfig { max_block_bytes: MAX_BLOCK, ..PoolConfig::new(64 * MIB) },
        limits: Limits { max_batch_keys: MAX_KEYS, ..Limits::default() },
        ..NodeConfig::default()
    })
    .await
    .expect("node starts");
    let endpoint = Endpoint::Tcp(node.tcp_addr().expect("tcp").to_string());
    let client = Client::connect(ClientConfig { shared_memory: false, ..ClientConfig::new(endpoint) }).await.expect("connects");
    (node, client)
}

fn key(i: usize) -> Bytes {
    Bytes::from(format!("put-path/{i}"))
}

/// Block `i`: its length is `len`, its bytes say which block it is.
fn block(i: usize, len: usize) -> Bytes {
    Bytes::from((0..len).map(|j| (i * 7 + j) as u8).collect::<Vec<u8>>())
}

#[tokio::test]
async fn a_batch_is_answered_in_its_order_whichever_way_its_blocks_go() {
    let (_node, client) = client().await;
    assert!(client.put(Vec::new()).await.expect("an empty batch").is_empty(), "an empty batch has no results");

    // One frame, every block sent.
    let entries: Vec<(Bytes, Bytes)> = (0..MAX_KEYS as usize).map(|i| (key(i), block(i, 4 * KIB))).collect();
    let results = client.put(entries).await.expect("PUT");
    assert_eq!(results.len(), MAX_KEYS as usize);
    assert!(results.iter().all(Result::is_ok), "{results:?}");

    // Twenty keys over three frames, every block sent.
    let entries: Vec<(Bytes, Bytes)> = (0..20).map(|i| (key(50 + i), block(50 + i, 2 * KIB + i))).collect();
    let results = client.put(entries).await.expect("PUT");
    assert_eq!(results.len(), 20);
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let keys: Vec<Bytes> = (0..20).map(|i| key(50 + i)).collect();
    for (i, got) in client.get(keys).await.expect("GET").into_iter().enumerate() {
        assert_eq!(got.expect("stored"), block(50 + i, 2 * KIB + i), "block {i}");
    }

    // Twenty keys over three frames, with blocks 5 and 13 over the node's
    // largest: refused by the client, by name, in their places.
    let too_large = [5, 13];
    let lens: Vec<usize> = (0..20).map(|i| if too_large.contains(&i) { MAX_BLOCK + 1 } else { KIB + i }).collect();
    let entries: Vec<(Bytes, Bytes)> = (0..20).map(|i| (key(100 + i), block(100 + i, lens[i]))).collect();
    let results = client.put(entries).await.expect("PUT");
    assert_eq!(results.len(), 20);
    for (i, r) in results.iter().enumerate() {
        if too_large.contains(&i) {
            match r {
                Err(KvError::Invalid(message)) => assert!(
                    message.contains(&format!("put-path/{}", 100 + i)) && message.contains(&format!("{} bytes", MAX_BLOCK + 1)),
                    "block {i}: {message}"
                ),
                other => panic!("block {i}, over the node's largest, answered {other:?}"),
            }
        } else {
            assert!(r.is_ok(), "block {i}: {r:?}");
        }
    }

    // Each stored key holds its own block.
    let keys: Vec<Bytes> = (0..20).map(|i| key(100 + i)).collect();
    for (i, got) in client.get(keys).await.expect("GET").into_iter().enumerate() {
        if too_large.contains(&i) {
            assert!(matches!(got, Err(KvError::NotFound)), "block {i} was refused, yet: {got:?}");
        } else {
            assert_eq!(got.expect("stored"), block(100 + i, lens[i]), "block {i}");
        }
    }
}
