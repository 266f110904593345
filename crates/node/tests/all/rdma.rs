//! RDMA on a node that cannot offer it (no `rdma` feature, or no RDMA device:
//! every machine these tests run on without hardware): the handshake never
//! grants `RDMA`, RDMA_CONNECT and RDMA_DESCRIBE are refused with a typed
//! `unsupported` that says why, the connection keeps serving, and the client
//! reads over the socket, bytes identical. The READ itself over Soft-RoCE
//! is `read_over_soft_roce`, which says SKIPPED where it cannot run.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use bytes::Bytes;
use kvplane_client::{Client, ClientConfig, Endpoint};
use kvplane_node::cache::CacheConfig;
use kvplane_node::memory::PoolConfig;
use kvplane_node::server::{Node, NodeConfig};
use kvplane_protocol::{
    decode, encode, Block, ErrorCode, Features, Frame, Hello, Limits, Message, PutEntry, Request, Response, HEADER_LEN,
};

const MIB: usize = 1 << 20;

fn config() -> NodeConfig {
    NodeConfig {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        admin: None,
        unix: None,
        pool: PoolConfig::new(64 * MIB),
        cache: CacheConfig::default(),
        ..NodeConfig::default()
    }
}

fn key(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

fn block(seed: u8, len: usize) -> Bytes {
    Bytes::from((0..len).map(|i| seed.wrapping_add((i % 251) as u8)).collect::<Vec<u8>>())
}

/// Whether this node could offer RDMA at all: built with the feature and a
/// device listed by the kernel. The tests below are about a node that cannot.
fn node_may_offer_rdma() -> bool {
    cfg!(feature = "rdma") && std::fs::read_dir("/sys/class/infiniband").map(|mut d| d.next().is_some()).unwrap_or(false)
}

/// A raw connection speaking frames by hand (the client crate never sends
/// the RDMA bit without a device).
struct Raw(TcpStream);

impl Raw {
    fn connect(addr: std::net::SocketAddr) -> Raw {
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Raw(s)
    }

    fn send(&mut self, frame: Frame) {
        self.0.write_all(&encode(&frame).unwrap().to_vec()).unwrap();
    }

    fn recv(&mut self) -> Frame {
        let mut header = [0u8; HEADER_LEN];
        self.0.read_exact(&mut header).unwrap();
        let body_len = u32::from_le_bytes(header[16..20].try_into().unwrap()) as usize;
        let mut wire = header.to_vec();
        wire.resize(HEADER_LEN + body_len, 0);
        self.0.read_exact(&mut wire[HEADER_LEN..]).unwrap();
        decode(&Bytes::from(wire), &Limits::default()).unwrap().unwrap().0
    }

    fn call(&mut self, id: u64, request: Request) -> Response {
        self.send(Frame::request(id, request));
        let frame = self.recv();
        assert_eq!(frame.request_id, id);
        match frame.message {
            Message::Response(r) => r,
            other => panic!("{other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_rdma_never_grants_it_refuses_its_requests_and_keeps_serving() {
    if node_may_offer_rdma() {
        eprintln!("SKIPPED (this machine has an RDMA device): the refusals are for nodes without one");
        return;
    }
    let node = Node::start(config()).await.unwrap();
    tokio::task::spawn_blocking({
        let addr = node.tcp_addr().unwrap();
        move || {
            let mut raw = Raw::connect(addr);
            // The HELLO asks for every feature bit this build knows.
            let asked = Features::ALL | Features::SHARED_MEMORY | Features::RDMA;
            match raw.call(0, Request::Hello(Hello { version: 1, features: asked, token: None })) {
                Response::HelloAck(ack) => {
                    assert!(!ack.features.contains(Features::RDMA), "granted RDMA: {:?}", ack.features);
                    assert!(ack.features.contains(Features::PIN_LEASE));
                }
                other => panic!("{other:?}"),
            }

            let put = Request::Put { entries: vec![PutEntry { key: key("k1"), block: Block::new(block(1, 4096)) }] };
            assert_eq!(raw.call(1, put), Response::Put { results: vec![Ok(())] });

            let refusals = [
                Request::RdmaDescribe { keys: vec![key("k1")], lease_ms: 1_000 },
                Request::RdmaConnect {
                    endpoint: kvplane_protocol::rdma::QueuePairEndpoint {
                        gid: kvplane_protocol::rdma::Gid([1; 16]),
                        lid: 0,
                        qp_num: 0x11,
                        psn: 0x22,
                    },
                },
                // A lease of 0 is refused for the same reason first: there is no RDMA.
                Request::RdmaDescribe { keys: vec![key("k1"), key("missing")], lease_ms: 0 },
            ];
            for (i, request) in refusals.into_iter().enumerate() {
                match raw.call(2 + i as u64, request) {
                    Response::Error { code: ErrorCode::Unsupported, message } => {
                        assert!(message.starts_with("this node offers no RDMA: "), "{message}");
                        if !cfg!(feature = "rdma") {
                            assert!(message.contains("built without the rdma feature"), "{message}");
                        } else {
                            assert!(message.contains("no RDMA device"), "{message}");
                        }
                    }
                    other => panic!("request {i}: {other:?}"),
                }
            }

            // Still serving, on the same connection.
            match raw.call(9, Request::Get { keys: vec![key("k1")] }) {
                Response::Get { results } => assert_eq!(results, vec![Ok(Block::new(block(1, 4096)))]),
                other => panic!("{other:?}"),
            }
            assert_eq!(raw.call(10, Request::Ping), Response::Pong);
        }
    })
    .await
    .unwrap();
    node.shutdown().await;
}

#[tokio::test]
async fn the_client_reads_over_the_socket_when_the_node_offers_no_rdma() {
    if node_may_offer_rdma() {
        eprintln!("SKIPPED (this machine has an RDMA device): this is the fallback without one");
        return;
    }
    let node = Node::start(config()).await.unwrap();
    let client = Client::connect(ClientConfig::new(Endpoint::Tcp(node.tcp_addr().unwrap().to_string()))).await.unwrap();
    let entries: Vec<(Bytes, Bytes)> = (0..8).map(|i| (key(&format!("b{i}")), block(i as u8, 64 * 1024 + i))).collect();
    let put = client.put(entries.clone()).await.unwrap();
    assert!(put.iter().all(Result::is_ok), "{put:?}");

    let mut keys: Vec<Bytes> = entries.iter().map(|(k, _)| k.clone()).collect();
    keys.push(key("absent"));
    let got = client.get(keys).await.unwrap();
    for ((k, want), got) in entries.iter().zip(&got) {
        assert_eq!(got.as_ref().unwrap_or_else(|e| panic!("{k:?}: {e}")), want, "{k:?}");
    }
    assert_eq!(got[8], Err(kvplane_client::KvError::NotFound));

    // Nothing was described: every block went over the socket.
    let stats = client.stats().await.unwrap();
    let hits = stats.iter().find(|(n, _)| n == "hits").map(|(_, v)| *v);
    assert_eq!(hits, Some(8));
    node.shutdown().await;
}

/// A one-sided READ of a described block from the node's registered pool.
/// Needs an RDMA device (a NIC, or a Soft-RoCE link that `rdma link add`
/// made) and both ends built with the feature; where that cannot be, it
/// says SKIPPED and passes nothing.
#[tokio::test]
async fn read_over_soft_roce() {
    if !node_may_offer_rdma() {
        eprintln!(
            "SKIPPED (no hardware): no RDMA device here (or the node was built without the rdma feature); the one-sided READ \
             of a described block needs one (Soft-RoCE: rdma link add rxe0 type rxe netdev lo)"
        );
        return;
    }
    let node = Node::start(config()).await.unwrap();
    let client = Client::connect(ClientConfig::new(Endpoint::Tcp(node.tcp_addr().unwrap().to_string()))).await.unwrap();
    let data = block(7, 256 * 1024);
    client.put(vec![(key("r"), data.clone())]).await.unwrap().remove(0).unwrap();
    let got = client.get(vec![key("r")]).await.unwrap().remove(0).unwrap();
    assert_eq!(got, data);
    // Read through a descriptor (its lease still lives), not over the socket.
    let stats = client.stats().await.unwrap();
    let leases = stats.iter().find(|(n, _)| n == "rdma_leases").map(|(_, v)| *v);
    assert!(leases >= Some(1), "no descriptor was handed out: {leases:?}");
    node.shutdown().await;
}
