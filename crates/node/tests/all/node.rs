//! The node end to end: a real server on loopback (TCP and a Unix socket),
//! driven by the real client and by hand-made hostile frames.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvplane_client::{Client, ClientConfig, Endpoint, KvError};
use kvplane_node::cache::{CacheConfig, Clock, ManualClock};
use kvplane_node::memory::PoolConfig;
use kvplane_node::server::{Node, NodeConfig};
use kvplane_protocol::{
    encode, Block, ErrorCode, Features, Frame, FrameHeader, Hello, Message, Opcode, PutEntry, Request, Response, HEADER_LEN,
};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
/// How long a test waits for a state it polls for before it fails: far
/// longer than any of them should take, so a slow machine is not a failure.
const PATIENCE: Duration = Duration::from_secs(10);

fn config(memory: usize) -> NodeConfig {
    NodeConfig {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        admin: Some("127.0.0.1:0".parse().unwrap()),
        unix: None,
        pool: PoolConfig::new(memory),
        cache: CacheConfig::default(),
        ..NodeConfig::default()
    }
}

async fn client(node: &Node) -> Client {
    let endpoint = Endpoint::Tcp(node.tcp_addr().expect("tcp").to_string());
    Client::connect(ClientConfig::new(endpoint)).await.expect("client connects")
}

fn block(seed: u8, len: usize) -> Bytes {
    Bytes::from((0..len).map(|i| seed.wrapping_add((i % 251) as u8)).collect::<Vec<u8>>())
}

fn key(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

fn stat(stats: &[(String, u64)], name: &str) -> u64 {
    stats.iter().find(|(n, _)| n == name).map(|(_, v)| *v).unwrap_or_else(|| panic!("no stat {name}"))
}

#[tokio::test]
async fn batched_put_get_exists_delete_over_tcp_and_unix() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("node.sock");
    let node = Node::start(NodeConfig { unix: Some(sock.clone()), ..config(64 * MIB) }).await.expect("node starts");
    let tcp = client(&node).await;
    let unix = Client::connect(ClientConfig::new(Endpoint::Unix(sock))).await.expect("unix client");

    let entries: Vec<(Bytes, Bytes)> = (0..32).map(|i| (key(&format!("k{i}")), block(i as u8, 64 * KIB + i))).collect();
    let put = tcp.put(entries.clone()).await.expect("put answered");
    assert!(put.iter().all(Result::is_ok), "{put:?}");

    // Written over TCP, read over the Unix socket: bytes intact, missing key reported.
    let mut keys: Vec<Bytes> = entries.iter().map(|(k, _)| k.clone()).collect();
    keys.push(key("missing"));
    let got = unix.get(keys.clone()).await.expect("get answered");
    for ((_, want), got) in entries.iter().zip(&got) {
        assert_eq!(got.as_ref().expect("present"), want);
    }
    assert_eq!(got[32], Err(KvError::NotFound));

    assert_eq!(tcp.exists(vec![key("k0"), key("nope")]).await.unwrap(), vec![true, false]);
    assert_eq!(unix.delete(vec![key("k0"), key("nope")]).await.unwrap(), vec![true, false]);
    assert_eq!(tcp.exists(vec![key("k0")]).await.unwrap(), vec![false]);

    let stats = tcp.stats().await.unwrap();
    assert_eq!(stat(&stats, "hits"), 32);
    assert_eq!(stat(&stats, "misses"), 1);
    assert_eq!(stat(&stats, "entries"), 31);
    // The 2 MiB batch went out striped over the pool's four connections.
    assert_eq!(stat(&stats, "requests_put"), 4);
    assert!(node.shutdown().await);
}

#[tokio::test]
async fn one_connection_pipelines_many_requests() {
    let node = Node::start(config(64 * MIB)).await.unwrap();
    let endpoint = Endpoint::Tcp(node.tcp_addr().unwrap().to_string());
    let client = std::sync::Arc::new(Client::connect(ClientConfig { connections: 1, ..ClientConfig::new(endpoint) }).await.unwrap());
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..64u8 {
        let c = std::sync::Arc::clone(&client);
        tasks.spawn(async move {
            let k = key(&format!("p{i}"));
            c.put(vec![(k.clone(), block(i, 4 * KIB))]).await.unwrap()[0].clone().unwrap();
            let got = c.get(vec![k]).await.unwrap();
            assert_eq!(got[0].as_ref().unwrap(), &block(i, 4 * KIB));
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.expect("pipelined request");
    }
    let stats = client.stats().await.unwrap();
    assert_eq!(stat(&stats, "connections_total"), 1, "all 64 requests shared one connection");
    node.shutdown().await;
}

#[tokio::test]
async fn eviction_keeps_serving_and_a_pinned_prefix_survives_until_its_lease_expires() {
    // 4 MiB of 64 KiB blocks: 64 fit. The leases run on a clock the test
    // moves, so the pressure phase may take as long as the machine needs.
    let clock = Arc::new(ManualClock::new());
    let mut cfg = config(4 * MIB);
    cfg.cache.clock = Arc::clone(&clock) as Arc<dyn Clock>;
    let node = Node::start(cfg).await.unwrap();
    let c = client(&node).await;
    let chain: Vec<Bytes> = (0..8).map(|i| key(&format!("prompt/{i}"))).collect();
    c.put(chain.iter().map(|k| (k.clone(), block(1, 64 * KIB))).collect()).await.unwrap();
    let m = c.match_prefix(chain.clone(), Duration::from_millis(800)).await.unwrap();
    assert_eq!(m.matched, 8);
    assert_eq!(m.lease, Duration::from_millis(800));

    // Pressure: 4x the pool in other blocks.
    for round in 0..4 {
        let batch = (0..64).map(|i| (key(&format!("filler/{round}/{i}")), block(2, 64 * KIB))).collect();
        let results = c.put(batch).await.unwrap();
        assert!(results.iter().filter(|r| r.is_ok()).count() >= 50, "puts keep succeeding under pressure");
    }
    let got = c.get(chain.clone()).await.unwrap();
    assert!(got.iter().all(|r| r.as_ref().map(|b| b == &block(1, 64 * KIB)).unwrap_or(false)), "pinned prefix was evicted");
    let stats = c.stats().await.unwrap();
    assert!(stat(&stats, "evictions") >= 100);
    assert_eq!(stat(&stats, "pinned"), 8);

    // Once the lease is over the prefix is ordinary memory again.
    clock.advance(Duration::from_millis(800));
    assert_eq!(stat(&c.stats().await.unwrap(), "pinned"), 0, "the lease ended");
    for round in 0..4 {
        let batch = (0..64).map(|i| (key(&format!("filler2/{round}/{i}")), block(3, 64 * KIB))).collect();
        c.put(batch).await.unwrap();
    }
    let still = c.exists(chain).await.unwrap();
    assert!(still.iter().any(|p| !p), "an expired pin still holds memory");
    node.shutdown().await;
}

#[tokio::test]
async fn a_lease_longer_than_the_limit_is_clamped() {
    let mut cfg = config(8 * MIB);
    cfg.limits.max_lease_ms = 50;
    let node = Node::start(cfg).await.unwrap();
    let c = client(&node).await;
    c.put(vec![(key("a"), block(0, 4 * KIB))]).await.unwrap();
    let m = c.match_prefix(vec![key("a"), key("b")], Duration::from_secs(3600)).await.unwrap();
    assert_eq!((m.matched, m.lease), (1, Duration::from_millis(50)));
    let none = c.match_prefix(vec![key("b")], Duration::from_secs(1)).await.unwrap();
    assert_eq!((none.matched, none.lease), (0, Duration::ZERO));
    node.shutdown().await;
}

// ---- hostile peers, spoken to with a plain blocking socket ----

struct Raw(TcpStream);

impl Raw {
    fn connect(node: &Node) -> Raw {
        let s = TcpStream::connect(node.tcp_addr().unwrap()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        Raw(s)
    }

    fn hello(node: &Node, token: Option<&str>) -> Raw {
        let mut r = Raw::connect(node);
        r.send(&Frame::request(1, Request::Hello(Hello { version: 1, features: Features::ALL, token: token.map(Into::into) })));
        r
    }

    fn send(&mut self, f: &Frame) {
        self.0.write_all(&encode(f).unwrap().to_vec()).unwrap();
    }

    fn send_bytes(&mut self, b: &[u8]) {
        self.0.write_all(b).unwrap();
    }

    /// The next frame, or None when the node closed the connection.
    fn recv(&mut self) -> Option<Frame> {
        let mut header = [0u8; HEADER_LEN];
        if self.0.read_exact(&mut header).is_err() {
            return None;
        }
        let h = FrameHeader::parse(&header).expect("node sends valid headers");
        let mut body = vec![0u8; h.body_len as usize];
        self.0.read_exact(&mut body).expect("body");
        let mut wire = header.to_vec();
        wire.extend_from_slice(&body);
        let (frame, _) = kvplane_protocol::decode(&Bytes::from(wire), &Default::default()).expect("decodes").expect("complete");
        Some(frame)
    }

    fn expect_error(&mut self, code: ErrorCode) -> String {
        match self.recv() {
            Some(Frame { message: Message::Response(Response::Error { code: got, message }), .. }) => {
                assert_eq!(got, code, "{message}");
                message
            }
            other => panic!("expected a {code} error, got {other:?}"),
        }
    }

    fn expect_closed(&mut self) {
        assert!(self.recv().is_none(), "the node should have closed the connection");
    }
}

fn expect_ack(r: &mut Raw) {
    match r.recv() {
        Some(Frame { message: Message::Response(Response::HelloAck(_)), .. }) => {}
        other => panic!("expected HELLO_ACK, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_input_gets_a_typed_answer_and_the_node_keeps_serving() {
    let node = Node::start(config(16 * MIB)).await.unwrap();
    let good = client(&node).await;
    good.put(vec![(key("kept"), block(9, 4 * KIB))]).await.unwrap();
    let node = std::sync::Arc::new(node);
    let n = std::sync::Arc::clone(&node);
    tokio::task::spawn_blocking(move || {
        let node = &*n;
        // No handshake: refused, closed.
        let mut r = Raw::connect(node);
        r.send(&Frame::request(5, Request::Ping));
        r.expect_error(ErrorCode::HandshakeRequired);
        r.expect_closed();

        // Not our protocol at all.
        let mut r = Raw::connect(node);
        r.send_bytes(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(r.expect_error(ErrorCode::BadMagic).contains("not a kvplane frame"));
        r.expect_closed();

        // Unknown opcode: answered, the connection stays usable.
        let mut r = Raw::hello(node, None);
        expect_ack(&mut r);
        let mut wire = encode(&Frame::request(7, Request::Ping)).unwrap().to_vec();
        wire[6] = 0x6e;
        r.send_bytes(&wire);
        assert!(r.expect_error(ErrorCode::UnknownOpcode).contains("0x6e"));
        r.send(&Frame::request(8, Request::Ping));
        assert!(matches!(r.recv(), Some(Frame { request_id: 8, message: Message::Response(Response::Pong) })));

        // An answer frame (with a payload) sent as a request: refused, and its
        // payload skipped so it is not taken for the next frame.
        let answer = encode(&Frame::response(14, Response::Get { results: vec![Ok(Block::new(block(5, 100)))] })).unwrap().to_vec();
        r.send_bytes(&answer);
        r.expect_error(ErrorCode::Invalid);
        r.send(&Frame::request(15, Request::Ping));
        assert!(matches!(r.recv(), Some(Frame { request_id: 15, message: Message::Response(Response::Pong) })));

        // Duplicate keys and an overlong key: typed errors, connection kept.
        r.send(&Frame::request(9, Request::Get { keys: vec![key("a"), key("a")] }));
        r.expect_error(ErrorCode::DuplicateKey);
        r.send(&Frame::request(10, Request::Get { keys: vec![Bytes::from(vec![b'x'; 2000])] }));
        r.expect_error(ErrorCode::KeyTooLong);

        // A PUT whose payload was corrupted in flight: that block is refused,
        // the block already stored under the key is untouched.
        let good_block = Block::new(block(1, 4 * KIB));
        let bad_block = Block::with_crc(block(2, 4 * KIB), good_block.crc);
        r.send(&Frame::request(
            11,
            Request::Put {
                entries: vec![PutEntry { key: key("kept"), block: bad_block }, PutEntry { key: key("fresh"), block: good_block }],
            },
        ));
        match r.recv() {
            Some(Frame { message: Message::Response(Response::Put { results }), .. }) => {
                assert_eq!(results, vec![Err(ErrorCode::BadChecksum), Ok(())]);
            }
            other => panic!("expected per-key PUT results, got {other:?}"),
        }

        // An oversized declared length: refused before anything is buffered, closed.
        let mut header = [0u8; HEADER_LEN];
        FrameHeader { version: 1, opcode: Opcode::Put as u8, flags: 0, request_id: 12, body_len: u32::MAX, meta_len: 4 }.write(&mut header);
        r.send_bytes(&header);
        assert!(r.expect_error(ErrorCode::FrameTooLarge).contains("exceeds the limit"));
        r.expect_closed();

        // A truncated frame: half a header, then the client goes away.
        let mut r = Raw::hello(node, None);
        expect_ack(&mut r);
        r.send_bytes(&wire[..10]);
        drop(r);
        // A truncated body: a PUT that promises more than it sends.
        let mut r = Raw::hello(node, None);
        expect_ack(&mut r);
        let put = encode(&Frame::request(
            13,
            Request::Put { entries: vec![PutEntry { key: key("half"), block: Block::new(block(3, 64 * KIB)) }] },
        ))
        .unwrap()
        .to_vec();
        r.send_bytes(&put[..put.len() / 2]);
        drop(r);
    })
    .await
    .expect("hostile peers");

    let got = good.get(vec![key("kept"), key("fresh"), key("half")]).await.expect("the node still serves");
    assert_eq!(got[0].as_ref().unwrap(), &block(9, 4 * KIB), "a corrupted PUT replaced a stored block");
    assert_eq!(got[1].as_ref().unwrap(), &block(1, 4 * KIB));
    assert_eq!(got[2], Err(KvError::NotFound), "a truncated PUT stored a block");
    let stats = good.stats().await.unwrap();
    assert_eq!(stat(&stats, "checksum_failures"), 1);
    assert!(stat(&stats, "protocol_errors") >= 4);
    std::sync::Arc::try_unwrap(node).ok().expect("sole owner").shutdown().await;
}

#[tokio::test]
async fn a_token_protected_node_refuses_clients_without_the_token() {
    let node = Node::start(NodeConfig { token: Some("s3cret".into()), ..config(8 * MIB) }).await.unwrap();
    let endpoint = Endpoint::Tcp(node.tcp_addr().unwrap().to_string());
    let err = Client::connect(ClientConfig::new(endpoint.clone())).await.err().expect("no token: refused");
    assert!(err.to_string().contains("requires a bearer token"), "{err}");
    let wrong = ClientConfig { token: Some("guess".into()), ..ClientConfig::new(endpoint.clone()) };
    let err = Client::connect(wrong).await.err().expect("wrong token: refused");
    assert!(err.to_string().contains("wrong bearer token"), "{err}");
    let right =
        Client::connect(ClientConfig { token: Some("s3cret".into()), ..ClientConfig::new(endpoint) }).await.expect("token accepted");
    right.ping().await.unwrap();
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_is_cut_off_without_stalling_others() {
    let mut cfg = NodeConfig { write_timeout: Duration::from_millis(500), ..config(64 * MIB) };
    cfg.pool.max_block_bytes = 8 * MIB;
    let node = Arc::new(Node::start(cfg).await.unwrap());
    // One connection, so that `connections_open` is this client's plus the hog's.
    let endpoint = Endpoint::Tcp(node.tcp_addr().unwrap().to_string());
    let good = Client::connect(ClientConfig { connections: 1, ..ClientConfig::new(endpoint) }).await.unwrap();
    good.put(vec![(key("big"), block(4, 8 * MIB))]).await.unwrap();
    let n = Arc::clone(&node);
    // Asks for 8 MiB answers again and again without ever reading one.
    let hog = std::thread::spawn(move || {
        // The handshake answer is read, so the node has counted this
        // connection before the hog watches for it to go.
        let mut r = Raw::hello(&n, None);
        expect_ack(&mut r);
        let get = encode(&Frame::request(2, Request::Get { keys: vec![key("big")] })).unwrap().to_vec();
        for _ in 0..16 {
            if r.0.write_all(&get).is_err() {
                break;
            }
        }
        // Not reading is the behaviour under test, so the hog waits without
        // reading until the node has dropped it (its write timeout at work):
        // the node's count of open connections is back to the good client's.
        let started = Instant::now();
        while stat(&n.stats(), "connections_open") > 1 {
            if started.elapsed() > PATIENCE {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        // What the kernel buffered, then the end of the stream.
        let mut sink = vec![0u8; 1 << 20];
        let mut total = 0usize;
        r.0.set_read_timeout(Some(PATIENCE)).unwrap();
        loop {
            match r.0.read(&mut sink) {
                Ok(0) => break true,
                Ok(n) => total += n,
                Err(e) => break e.kind() == ErrorKind::ConnectionReset,
            }
            if total > 200 * MIB {
                break false;
            }
        }
    });
    let start = Instant::now();
    for _ in 0..20 {
        let got = good.get(vec![key("big")]).await.unwrap();
        assert_eq!(got[0].as_ref().unwrap().len(), 8 * MIB);
    }
    assert!(start.elapsed() < Duration::from_secs(20), "the hog stalled other clients");
    let closed = tokio::task::spawn_blocking(move || hog.join().unwrap()).await.unwrap();
    assert!(closed, "the node kept a connection whose client never reads");
    Arc::try_unwrap(node).ok().expect("sole owner").shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_flood_is_refused_politely_and_silent_connections_time_out() {
    // One peer (this test) may hold every slot: the per-peer share has a
    // test of its own in the CLI's hostile-client tests.
    let node = Node::start(NodeConfig {
        max_connections: 8,
        max_connections_per_peer: Some(8),
        handshake_timeout: Duration::from_millis(300),
        ..config(8 * MIB)
    })
    .await
    .unwrap();
    let addr = node.tcp_addr().unwrap();
    let (refused, silent_closed) = tokio::task::spawn_blocking(move || {
        let mut conns: Vec<TcpStream> = (0..64).map(|_| TcpStream::connect(addr).unwrap()).collect();
        for c in &conns {
            c.set_read_timeout(Some(PATIENCE)).unwrap();
        }
        // The first 8 took the 8 slots; they stay open and never say hello.
        let excess = conns.split_off(8);
        let mut refused = 0;
        for mut c in excess {
            let mut header = [0u8; HEADER_LEN];
            if c.read_exact(&mut header).is_ok() && header[6] == Opcode::Error as u8 {
                refused += 1;
            }
        }
        // The node closes each silent one once its handshake timeout passes:
        // the end of the stream, with nothing sent.
        let silent_closed = conns.iter_mut().map(|c| c.read(&mut [0u8; 1])).filter(|r| matches!(r, Ok(0))).count();
        (refused, silent_closed)
    })
    .await
    .unwrap();
    assert!(refused >= 50, "only {refused} of 56 excess connections were told they were refused");
    assert_eq!(silent_closed, 8, "silent connections were not closed by the handshake timeout");
    // Their slots come free as they go: a real client gets in.
    let endpoint = Endpoint::Tcp(addr.to_string());
    let started = Instant::now();
    let c = loop {
        match Client::connect(ClientConfig::new(endpoint.clone())).await {
            Ok(c) => break c,
            // Refused while a slot is still being released: try again.
            Err(_) if started.elapsed() < PATIENCE => tokio::time::sleep(Duration::from_millis(10)).await,
            Err(e) => panic!("no client got in after the flood: {e}"),
        }
    };
    c.ping().await.expect("served after the flood");
    // Every flood connection was refused at the door or for its silence.
    assert!(stat(&c.stats().await.unwrap(), "connections_refused") >= 64);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_a_request_in_flight() {
    let node = Node::start(config(256 * MIB)).await.unwrap();
    let endpoint = Endpoint::Tcp(node.tcp_addr().unwrap().to_string());
    // One connection, open before the shutdown begins.
    let c = std::sync::Arc::new(Client::connect(ClientConfig { connections: 1, ..ClientConfig::new(endpoint) }).await.unwrap());
    let c2 = std::sync::Arc::clone(&c);
    // What the client sent at connect (its STATS) is not the PUT.
    let at_connect = stat(&node.stats(), "bytes_received");
    let big: Vec<(Bytes, Bytes)> = (0..32).map(|i| (key(&format!("d{i}")), block(i, 2 * MIB))).collect();
    let inflight = tokio::spawn(async move { c2.put(big).await });
    // Shut down once the node has read the PUT's header and meta, while its
    // 64 MiB of payload are still arriving.
    let started = Instant::now();
    while stat(&node.stats(), "bytes_received") == at_connect {
        assert!(started.elapsed() < PATIENCE, "the PUT never reached the node");
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    let drained = node.shutdown().await;
    assert!(drained);
    let results = inflight.await.unwrap().expect("the in-flight PUT was answered");
    assert!(results.iter().all(Result::is_ok));
    assert!(c.ping().await.is_err(), "the node stopped serving after the drain");
}

#[tokio::test]
async fn metrics_and_healthz_on_the_admin_port() {
    let node = Node::start(config(8 * MIB)).await.unwrap();
    let c = client(&node).await;
    c.put(vec![(key("m"), block(0, 4 * KIB))]).await.unwrap();
    c.get(vec![key("m"), key("x")]).await.unwrap();
    let admin = node.admin_addr().unwrap();
    let get = |path: &'static str| {
        tokio::task::spawn_blocking(move || {
            let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
            let mut resp = agent.get(&format!("http://{admin}{path}")).call().expect("the admin port answers");
            (resp.status().as_u16(), resp.body_mut().read_to_string().unwrap())
        })
    };
    let (status, metrics) = get("/metrics").await.unwrap();
    assert_eq!(status, 200, "{metrics}");
    for needle in [
        "kvplane_cache_hits_total 1",
        "kvplane_cache_misses_total 1",
        "kvplane_cache_evictions_total 0",
        "kvplane_cache_bytes_stored 4096",
        "kvplane_op_duration_seconds_count{op=\"get\"} 1",
        "kvplane_op_duration_seconds_bucket{le=\"+Inf\",op=\"put\"} 1",
    ] {
        assert!(metrics.contains(needle), "missing {needle:?} in\n{metrics}");
    }
    assert_eq!(get("/healthz").await.unwrap(), (200, "ok\n".to_string()));
    assert_eq!(get("/nope").await.unwrap().0, 404);
    node.shutdown().await;
}

/// A block over the node's largest was refused with `invalid: ` and
/// nothing else (LMCache's 36 MiB chunks against the 16 MiB default); now
/// the client knows the largest block from STATS, refuses the block itself
/// without sending it, and says both sizes and the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_over_the_largest_is_refused_by_name_without_being_sent() {
    let mut config = config(64 * MIB);
    config.pool.max_block_bytes = 4 * MIB;
    let node = Node::start(config).await.unwrap();
    let c = client(&node).await;
    assert_eq!(c.max_block_bytes(), Some(4 * MIB));
    let received = stat(&node.stats(), "bytes_received");
    let results = c.put(vec![(key("chunk-0"), block(1, 4 * MIB)), (key("chunk-1"), block(2, 9 * MIB))]).await.unwrap();
    results[0].as_ref().expect("a block of the largest size is stored");
    let e = results[1].as_ref().expect_err("a block over the largest is refused");
    let text = e.to_string();
    assert!(matches!(e, KvError::Invalid(_)), "{e:?}");
    assert!(text.contains("PUT of key \"chunk-1\"") && text.contains("9437184 bytes") && text.contains("4194304 bytes"), "{text}");
    let sent = stat(&node.stats(), "bytes_received") - received;
    assert!(sent < 5 * MIB as u64, "{sent} bytes reached the node: the refused block was sent");
    node.shutdown().await;
}

/// A prompt's chain longer than the node's batch limit was refused outright
/// (prompts over 65,536 tokens became misses); the client now matches it in
/// parts, each from where the last one matched in full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_match_over_the_batch_limit_is_split_and_summed() {
    let mut config = config(64 * MIB);
    config.limits.max_batch_keys = 100;
    let node = Node::start(config).await.unwrap();
    let c = client(&node).await;
    let chain: Vec<Bytes> = (0..250).map(|i| key(&format!("chain/{i}"))).collect();
    let stored: Vec<(Bytes, Bytes)> = chain[..230].iter().map(|k| (k.clone(), block(3, 64))).collect();
    for r in c.put(stored).await.unwrap() {
        r.unwrap();
    }
    let m = c.match_prefix(chain.clone(), Duration::from_secs(1)).await.expect("a chain of 250 keys over a limit of 100");
    assert_eq!(m.matched, 230);
    assert!(m.lease > Duration::ZERO, "the matched blocks are pinned");
    let m = c.match_prefix(chain[..200].to_vec(), Duration::ZERO).await.unwrap();
    assert_eq!(m.matched, 200, "exactly two full parts");
    node.shutdown().await;
}
