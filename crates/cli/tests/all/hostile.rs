//! Hostile clients against a real `kvplane node` process: each cheap move
//! that once took a node down for everyone, with the bound that now holds it
//! (issue 18). The node's RSS is read from /proc; every stored block must
//! read back intact, and another client must be served throughout.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvplane_client::{Client, ClientConfig, Endpoint};
use kvplane_protocol::{
    checksum, decode_body, encode, ErrorCode, Features, Frame, FrameHeader, Hello, Limits, Message, Meta, Opcode, Request, Response,
    HEADER_LEN, VERSION,
};

use crate::support::{kvplane, NodeProcess};

const MIB: usize = 1 << 20;
const PATIENCE: Duration = Duration::from_secs(60);

/// The node process's resident memory, from /proc.
fn rss_bytes(node: &NodeProcess) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{}/status", node.child.id())).expect("reading the node's /proc status");
    let kib: usize = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc status");
    kib << 10
}

/// A raw connection from `from` (a loopback address of its own: another
/// peer) that has completed its HELLO.
fn hello_from(endpoint: &str, from: &str, token: Option<&str>) -> std::io::Result<(TcpStream, Response)> {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    socket.bind(&format!("{from}:0").parse::<std::net::SocketAddr>().unwrap().into())?;
    socket.connect(&endpoint.parse::<std::net::SocketAddr>().unwrap().into())?;
    let mut stream: TcpStream = socket.into();
    stream.set_read_timeout(Some(PATIENCE))?;
    let hello = Request::Hello(Hello { version: VERSION, features: Features::default(), token: token.map(str::to_string) });
    stream.write_all(&encode(&Frame::request(1, hello)).unwrap().to_vec())?;
    let answer = read_answer(&mut stream)?;
    Ok((stream, answer))
}

fn hello(endpoint: &str) -> TcpStream {
    let (stream, answer) = hello_from(endpoint, "127.0.0.1", None).expect("connecting");
    assert!(matches!(answer, Response::HelloAck(_)), "{answer:?}");
    stream
}

/// One answer frame, payloads included.
fn read_answer(stream: &mut TcpStream) -> std::io::Result<Response> {
    let mut header = [0u8; HEADER_LEN];
    stream.read_exact(&mut header)?;
    let header = FrameHeader::parse(&header).expect("a kvplane header");
    let mut body = vec![0u8; header.body_len as usize];
    stream.read_exact(&mut body)?;
    let body = Bytes::from(body);
    let limits = Limits { max_frame_bytes: u32::MAX, max_batch_keys: u32::MAX, ..Limits::default() };
    match decode_body(&header, body.slice(..header.meta_len as usize), &limits).expect("a decodable answer") {
        Meta::Complete(Message::Response(r)) => Ok(r),
        Meta::Get(slots) => {
            let mut at = header.meta_len as usize;
            let results = slots
                .into_iter()
                .map(|s| {
                    s.map(|s| {
                        let data = body.slice(at..at + s.len as usize);
                        at += s.len as usize;
                        kvplane_protocol::Block::new(data)
                    })
                })
                .collect();
            Ok(Response::Get { results })
        }
        other => panic!("unexpected answer {other:?}"),
    }
}

/// Whether the node closed `stream` (end of stream or reset) within the
/// read timeout.
fn closed(stream: &mut TcpStream) -> bool {
    let mut rest = Vec::new();
    match stream.read_to_end(&mut rest) {
        Ok(_) => true,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    }
}

fn stat(stats: &[(String, u64)], name: &str) -> u64 {
    stats.iter().find(|(n, _)| n == name).map(|(_, v)| *v).unwrap_or_else(|| panic!("no stat {name}"))
}

async fn client(node: &NodeProcess) -> Client {
    Client::connect(ClientConfig::new(Endpoint::Tcp(node.endpoint.clone()))).await.expect("a client connects")
}

fn block(i: usize, len: usize) -> Bytes {
    Bytes::from((0..len).map(|j| (i * 131 + j * 7 % 251) as u8).collect::<Vec<u8>>())
}

/// A PUT of one `len`-byte block whose header and meta arrive with one
/// payload byte, and then nothing.
fn stalled_put(endpoint: &str, key: &str, len: usize) -> TcpStream {
    let mut stream = hello(endpoint);
    let mut meta = Vec::new();
    meta.extend_from_slice(&1u32.to_le_bytes());
    meta.extend_from_slice(&(key.len() as u16).to_le_bytes());
    meta.extend_from_slice(key.as_bytes());
    meta.extend_from_slice(&(len as u32).to_le_bytes());
    meta.extend_from_slice(&checksum(&vec![0u8; len]).to_le_bytes());
    let header = FrameHeader {
        version: VERSION,
        opcode: Opcode::Put as u8,
        flags: 0,
        request_id: 7,
        body_len: (meta.len() + len) as u32,
        meta_len: meta.len() as u32,
    };
    let mut wire = [0u8; HEADER_LEN];
    header.write(&mut wire);
    stream.write_all(&wire).unwrap();
    stream.write_all(&meta).unwrap();
    stream.write_all(&[0u8]).unwrap();
    stream
}

/// 70 stalled PUTs of 4 MiB blocks against a 256 MiB pool holding 40 of
/// them once evicted every stored block; the receive budget now holds the
/// stalled ones to a quarter of the pool, the frame clock cuts them, and
/// nothing stored is evicted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seventy_stalled_puts_leave_every_stored_block_readable() {
    let node = NodeProcess::start(&["--memory", "256MiB", "--max-block", "4MiB", "--frame-grace", "2s", "--eviction", "lru"]);
    let c = client(&node).await;
    let stored: Vec<(Bytes, Bytes)> = (0..40).map(|i| (Bytes::from(format!("stored/{i}")), block(i, 4 * MIB))).collect();
    for r in c.put(stored.clone()).await.unwrap() {
        r.expect("stored");
    }
    let endpoint = node.endpoint.clone();
    let stalled =
        tokio::task::spawn_blocking(move || (0..70).map(|i| stalled_put(&endpoint, &format!("stall/{i}"), 4 * MIB)).collect::<Vec<_>>())
            .await
            .unwrap();
    // The budget fills and the rest wait on it.
    let started = Instant::now();
    loop {
        let s = c.stats().await.unwrap();
        if stat(&s, "receive_budget_waits") > 0 {
            assert!(stat(&s, "receive_budget_used_bytes") <= stat(&s, "receive_budget_bytes"));
            break;
        }
        assert!(started.elapsed() < PATIENCE, "the stalled PUTs never filled the receive budget: {s:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let rss = rss_bytes(&node);
    assert!(rss < 256 * MIB + 64 * MIB, "node RSS {} MiB with 70 stalled PUTs", rss >> 20);
    // Another client's PUT succeeds (once the stalled frames ahead of it in
    // the budget are cut by their clock).
    let fresh = (Bytes::from_static(b"fresh"), block(99, 4 * MIB));
    c.put(vec![fresh.clone()]).await.unwrap().remove(0).expect("another client's PUT");
    // Every stalled frame is cut and answered `timeout`.
    let answers = tokio::task::spawn_blocking(move || {
        stalled
            .into_iter()
            .map(|mut s| matches!(read_answer(&mut s), Ok(Response::Error { code: ErrorCode::Timeout, .. })))
            .filter(|t| *t)
            .count()
    })
    .await
    .unwrap();
    assert_eq!(answers, 70, "every stalled PUT was answered timeout");
    let s = c.stats().await.unwrap();
    assert_eq!(stat(&s, "frames_stalled"), 70);
    assert_eq!(stat(&s, "evictions"), 0, "stalled PUTs evicted stored blocks");
    let keys: Vec<Bytes> = stored.iter().map(|(k, _)| k.clone()).chain([fresh.0.clone()]).collect();
    let got = c.get(keys).await.unwrap();
    for ((key, want), got) in stored.iter().chain([&fresh]).zip(got) {
        assert_eq!(&got.unwrap_or_else(|e| panic!("{key:?}: {e}")), want, "{key:?} changed");
    }
    println!("stalled PUTs: node RSS {} MiB, 41/41 blocks intact, {} budget waits", rss >> 20, stat(&s, "receive_budget_waits"));
}

/// A meta declared at 100 MiB was buffered whole (eight took a node to
/// 841 MB); now it is refused from its header, before any of it is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_meta_longer_than_any_legal_request_is_refused_unread() {
    let node = NodeProcess::start(&["--memory", "64MiB"]);
    let before = rss_bytes(&node);
    let endpoint = node.endpoint.clone();
    let refusals = tokio::task::spawn_blocking(move || {
        (0..8)
            .map(|i| {
                let mut s = hello(&endpoint);
                let header = FrameHeader {
                    version: VERSION,
                    opcode: Opcode::Get as u8,
                    flags: 0,
                    request_id: 100 + i,
                    body_len: 100 * MIB as u32,
                    meta_len: 100 * MIB as u32,
                };
                let mut wire = [0u8; HEADER_LEN];
                header.write(&mut wire);
                s.write_all(&wire).unwrap();
                s.write_all(&[0u8; 4096]).unwrap();
                let answer = read_answer(&mut s).unwrap();
                (answer, closed(&mut s))
            })
            .collect::<Vec<_>>()
    })
    .await
    .unwrap();
    for (answer, closed) in refusals {
        match answer {
            Response::Error { code: ErrorCode::FrameTooLarge, message } => {
                assert!(message.contains("longest legal request"), "{message}")
            }
            other => panic!("expected frame-too-large, got {other:?}"),
        }
        assert!(closed, "the connection is closed after an unread meta");
    }
    let grown = rss_bytes(&node).saturating_sub(before);
    assert!(grown < 64 * MIB, "eight 100 MiB metas grew the node by {} MiB", grown >> 20);
    println!("eight 100 MiB metas: node RSS {} MiB before, grew {} KiB", before >> 20, grown >> 10);
    let c = client(&node).await;
    c.ping().await.expect("served afterwards");
}

/// Connections that finished HELLO once stayed forever; now an idle one is
/// told, still answered within the grace, and closed. A GET sent right
/// after the notice (as a client would that had not read it yet) returns
/// its block, and the pooled client moves to a new connection by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_is_told_then_closed_and_a_request_racing_the_close_is_answered() {
    let node = NodeProcess::start(&["--idle-timeout", "1s"]);
    let c = client(&node).await;
    c.put(vec![(Bytes::from_static(b"k"), block(1, 4096))]).await.unwrap().remove(0).unwrap();
    let endpoint = node.endpoint.clone();
    let (notice, answer, closed_after) = tokio::task::spawn_blocking(move || {
        let mut s = hello(&endpoint);
        let notice = read_answer(&mut s).unwrap();
        s.write_all(&encode(&Frame::request(5, Request::Get { keys: vec![Bytes::from_static(b"k")] })).unwrap().to_vec()).unwrap();
        let answer = read_answer(&mut s).unwrap();
        (notice, answer, closed(&mut s))
    })
    .await
    .unwrap();
    match notice {
        Response::Error { code: ErrorCode::Timeout, message } => assert!(message.contains("--idle-timeout"), "{message}"),
        other => panic!("expected the idle notice, got {other:?}"),
    }
    match answer {
        Response::Get { results } => assert_eq!(results[0].as_ref().unwrap().data, block(1, 4096)),
        other => panic!("the GET racing the close was not answered: {other:?}"),
    }
    assert!(closed_after, "the idle connection was closed after the grace");
    // The pooled client's connection got the same notice by now.
    let started = Instant::now();
    while stat(&c.stats().await.unwrap(), "idle_closed") < 2 {
        assert!(started.elapsed() < PATIENCE, "the client's connection was never told it is idle");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let got = c.get(vec![Bytes::from_static(b"k")]).await.expect("the client is served after its connection went idle");
    assert_eq!(got[0].as_ref().unwrap(), &block(1, 4096));
}

/// Twenty idle connections from one peer once locked every client out;
/// now one peer holds at most its share and another peer gets in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_peer_cannot_hold_more_than_its_share_of_the_connections() {
    let node = NodeProcess::start(&["--max-connections", "8", "--max-connections-per-peer", "4"]);
    let endpoint = node.endpoint.clone();
    tokio::task::spawn_blocking(move || {
        let held: Vec<TcpStream> = (0..4).map(|_| hello(&endpoint)).collect();
        let (_, refused) = hello_from(&endpoint, "127.0.0.1", None).unwrap();
        match refused {
            Response::Error { code: ErrorCode::Unavailable, message } => {
                assert!(message.contains("127.0.0.1") && message.contains("--max-connections-per-peer"), "{message}")
            }
            other => panic!("a fifth connection of one peer was not refused: {other:?}"),
        }
        let (mut other, ack) = hello_from(&endpoint, "127.0.0.2", None).expect("another peer connects");
        assert!(matches!(ack, Response::HelloAck(_)), "another peer was refused: {ack:?}");
        other.write_all(&encode(&Frame::request(2, Request::Ping)).unwrap().to_vec()).unwrap();
        assert!(matches!(read_answer(&mut other).unwrap(), Response::Pong));
        drop(held);
    })
    .await
    .unwrap();
}

/// Wrong tokens were refused at 2,591 a second without a trace; now a
/// peer that fails too many handshakes is refused for the rest of its
/// minute, the failures are counted in /metrics and logged (sampled) with
/// the peer's address, and another peer with the token is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_handshakes_are_throttled_per_peer_counted_and_logged() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "right\n").unwrap();
    let mut cmd = kvplane();
    cmd.args(["node", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--memory", "64MiB", "--max-handshake-failures", "5"])
        .arg("--token-file")
        .arg(&token);
    let node = NodeProcess::spawn(cmd);
    let endpoint = node.endpoint.clone();
    tokio::task::spawn_blocking(move || {
        for _ in 0..5 {
            let (_, answer) = hello_from(&endpoint, "127.0.0.1", Some("wrong")).unwrap();
            assert!(matches!(answer, Response::Error { code: ErrorCode::Unauthorized, .. }), "{answer:?}");
        }
        // Even the right token is refused from this peer now.
        let (_, answer) = hello_from(&endpoint, "127.0.0.1", Some("right")).unwrap();
        match answer {
            Response::Error { code: ErrorCode::Unavailable, message } => {
                assert!(message.contains("failed 5 handshakes") && message.contains("retry in"), "{message}")
            }
            other => panic!("the failing peer was not throttled: {other:?}"),
        }
        let (_, ack) = hello_from(&endpoint, "127.0.0.2", Some("right")).unwrap();
        assert!(matches!(ack, Response::HelloAck(_)), "another peer with the token was refused: {ack:?}");
    })
    .await
    .unwrap();
    let admin =
        node.log.lock().unwrap().iter().find_map(|l| l.split("admin http://").nth(1).map(|r| r.split('/').next().unwrap().to_string()));
    let admin = admin.expect("the admin address in the node's serving line");
    let metrics = tokio::task::spawn_blocking(move || {
        ureq::get(&format!("http://{admin}/metrics")).call().unwrap().body_mut().read_to_string().unwrap()
    })
    .await
    .unwrap();
    assert!(metrics.contains("kvplane_handshake_failures_total 5"), "{metrics}");
    assert!(metrics.contains("kvplane_handshakes_throttled_total 1"), "{metrics}");
    let log = node.said_eventually("handshake failed", PATIENCE);
    let logged = log.lines().filter(|l| l.contains("handshake failed") && l.contains("127.0.0.1")).count();
    assert!((1..=2).contains(&logged), "the failures are logged sampled, with the peer: {logged} lines in\n{log}");
}

/// Thousands of idle admin connections once used up the node's descriptors
/// and locked out the data port; now the admin port closes what is past its
/// cap, the data port serves throughout, and a scrape works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_admin_connections_cannot_lock_out_the_data_port() {
    let mut cmd = kvplane();
    cmd.args(["node", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--memory", "64MiB", "--admin-max-connections", "8"]);
    let node = NodeProcess::spawn(cmd);
    let admin =
        node.log.lock().unwrap().iter().find_map(|l| l.split("admin http://").nth(1).map(|r| r.split('/').next().unwrap().to_string()));
    let admin = admin.expect("the admin address");
    let a = admin.clone();
    let idle = tokio::task::spawn_blocking(move || (0..300).filter_map(|_| TcpStream::connect(&a).ok()).collect::<Vec<_>>()).await.unwrap();
    let c = client(&node).await;
    c.ping().await.expect("the data port serves while the admin port is flooded");
    // The idle ones within the cap are cut at the header timeout; a scrape
    // then gets in.
    let started = Instant::now();
    let body = loop {
        let a = admin.clone();
        let scraped = tokio::task::spawn_blocking(move || {
            let agent: ureq::Agent = ureq::Agent::config_builder().timeout_global(Some(Duration::from_secs(2))).build().into();
            agent.get(&format!("http://{a}/metrics")).call().ok().map(|mut r| r.body_mut().read_to_string().unwrap())
        })
        .await
        .unwrap();
        if let Some(body) = scraped {
            break body;
        }
        assert!(started.elapsed() < PATIENCE, "no scrape got in after the flood");
    };
    let refused: u64 = body
        .lines()
        .find_map(|l| l.strip_prefix("kvplane_admin_connections_refused_total "))
        .and_then(|v| v.trim().parse().ok())
        .expect("the refusal counter");
    assert!(refused >= 292, "{refused} of 300 idle admin connections refused at the cap");
    drop(idle);
}

/// A node whose bounds need more descriptors than the hard limit allows
/// refuses to start and says which bounds add up to what.
#[test]
fn a_node_whose_bounds_exceed_the_descriptor_limit_refuses_to_start() {
    let out = kvplane()
        .args(["node", "--listen", "127.0.0.1:0", "--admin", "none", "--memory", "64MiB", "--max-connections", "100000000"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("hard limit (ulimit -Hn)") && text.contains("100000000 for --max-connections"), "{text}");
}

/// Stalled PUTs from one peer fill only that peer's share of the receive
/// budget: another peer's PUT is received and answered at once, before any
/// stalled frame is cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_puts_of_one_peer_leave_room_for_another() {
    let node = NodeProcess::start(&["--memory", "256MiB", "--max-block", "4MiB", "--frame-grace", "60s"]);
    let c = client(&node).await;
    let endpoint = node.endpoint.clone();
    let stalled =
        tokio::task::spawn_blocking(move || (0..30).map(|i| stalled_put(&endpoint, &format!("stall/{i}"), 4 * MIB)).collect::<Vec<_>>())
            .await
            .unwrap();
    let started = Instant::now();
    while stat(&c.stats().await.unwrap(), "receive_budget_waits") == 0 {
        assert!(started.elapsed() < PATIENCE, "the stalled PUTs never filled their peer's share");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let endpoint = node.endpoint.clone();
    let answer = tokio::task::spawn_blocking(move || {
        let (mut other, ack) = hello_from(&endpoint, "127.0.0.2", None).expect("another peer connects");
        assert!(matches!(ack, Response::HelloAck(_)), "{ack:?}");
        let value = block(7, 4 * MIB);
        let put = Request::Put {
            entries: vec![kvplane_protocol::PutEntry { key: Bytes::from_static(b"other/0"), block: kvplane_protocol::Block::new(value) }],
        };
        other.write_all(&encode(&Frame::request(3, put)).unwrap().to_vec()).unwrap();
        read_answer(&mut other).unwrap()
    })
    .await
    .unwrap();
    assert!(matches!(&answer, Response::Put { results } if results.iter().all(Result::is_ok)), "{answer:?}");
    let s = c.stats().await.unwrap();
    assert_eq!(stat(&s, "frames_stalled"), 0, "the other peer's PUT waited for the stalled frames to be cut");
    assert!(stat(&s, "receive_budget_used_bytes") <= stat(&s, "receive_budget_per_peer_bytes"), "{s:?}");
    drop(stalled);
}

/// A frozen node (SIGSTOP by PID) stops reading: a PUT larger than both
/// sockets' buffers could once never finish writing its frame, and hung past
/// the client's timeout with its bytes held. The write now has the client's
/// timeout too: a typed Timeout naming the node and "writing the request",
/// and the half-written connection is never used again (the pool opens a
/// new one, which serves once the node runs again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_to_a_frozen_node_times_out_while_writing_and_the_pool_reconnects() {
    let node = NodeProcess::start(&["--memory", "64MiB", "--max-block", "2MiB"]);
    let timeout = Duration::from_secs(2);
    // One connection, opened now: the PUT must go to a connection already
    // open (a new one would time out in its handshake, which tests nothing).
    let mut config = ClientConfig::new(Endpoint::Tcp(node.endpoint.clone()));
    config.connections = 1;
    config.timeout = timeout;
    let c = Client::connect(config).await.expect("a client connects");
    let signal = |name: &str| {
        let status = std::process::Command::new("kill").arg(format!("-{name}")).arg(node.child.id().to_string()).status().unwrap();
        assert!(status.success(), "kill -{name} {}", node.child.id());
    };
    signal("STOP");
    // 16 MiB: more than a fresh loopback connection's send and receive
    // buffers together hold while nobody reads.
    let entries: Vec<(Bytes, Bytes)> = (0..8).map(|i| (Bytes::from(format!("frozen/{i}")), block(i, 2 * MIB))).collect();
    let started = Instant::now();
    let bound = Duration::from_secs(15);
    let answer = tokio::time::timeout(bound, c.put(entries)).await;
    let took = started.elapsed();
    signal("CONT");
    let error = match answer {
        Err(_) => panic!("a PUT to a frozen node still hung after {bound:?} (client timeout {timeout:?})"),
        Ok(Ok(results)) => panic!("a PUT to a frozen node was answered: {results:?}"),
        Ok(Err(e)) => e,
    };
    let text = error.to_string();
    assert!(
        matches!(error, kvplane_protocol::KvError::Timeout(_)) && text.contains(&node.endpoint) && text.contains("writing the request"),
        "a typed Timeout naming {} and the write: {error:?}",
        node.endpoint
    );
    // The same client, once the node runs again: a new connection serves.
    let key = Bytes::from_static(b"thawed/0");
    let value = block(9, 64 << 10);
    c.put(vec![(key.clone(), value.clone())]).await.expect("the PUT after SIGCONT is sent").remove(0).expect("stored after SIGCONT");
    let got = c.get(vec![key]).await.expect("the GET after SIGCONT").remove(0).expect("read after SIGCONT");
    assert_eq!(got, value);
    println!(
        "PUT of 16 MiB to a frozen node: {error} after {took:?} (client timeout {timeout:?}); after SIGCONT served on a new connection"
    );
}

/// A request that is all meta and already all in the receive buffer takes
/// nothing from the receive budget (most requests: see `serve_frame`); one
/// whose meta stops half-way still holds its whole meta there while it
/// waits, and gives it back when its connection ends. Other clients are
/// served meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_whose_meta_stalls_holds_it_in_the_receive_budget_until_its_connection_ends() {
    let node = NodeProcess::start(&["--memory", "64MiB", "--frame-grace", "60s"]);
    let c = client(&node).await;
    let keys: Vec<Bytes> = (0..100).map(|i| Bytes::from(format!("stalled/{i:04}"))).collect();
    let wire = encode(&Frame::request(5, Request::Get { keys })).unwrap().to_vec();
    let meta_len = (wire.len() - HEADER_LEN) as u64;
    let endpoint = node.endpoint.clone();
    let stalled = tokio::task::spawn_blocking(move || {
        let mut stream = hello(&endpoint);
        stream.write_all(&wire[..HEADER_LEN + 10]).unwrap();
        stream
    })
    .await
    .unwrap();
    let started = Instant::now();
    while stat(&c.stats().await.unwrap(), "receive_budget_used_bytes") != meta_len {
        assert!(started.elapsed() < PATIENCE, "the stalled GET never reserved its {meta_len}-byte meta: {:?}", c.stats().await.unwrap());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let got = c.get(vec![Bytes::from_static(b"absent")]).await.expect("another client is served");
    assert!(matches!(got[..], [Err(kvplane_client::KvError::NotFound)]), "{got:?}");
    assert_eq!(stat(&c.stats().await.unwrap(), "receive_budget_used_bytes"), meta_len, "the stalled meta alone is held");
    drop(stalled);
    while stat(&c.stats().await.unwrap(), "receive_budget_used_bytes") != 0 {
        assert!(started.elapsed() < 2 * PATIENCE, "the closed connection's reservation was never given back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
