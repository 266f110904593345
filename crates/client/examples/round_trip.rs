//! A single GET's round trip against a running node, split into the
//! client's share and the node's.
//!
//! Two ways of asking the same node for the same 4 KiB blocks, one at a
//! time, alternating in rounds so that a drift of the machine's load falls
//! on both alike:
//!
//! - `bare`: one task writes the GET frame and reads its answer from the
//!   socket itself, with the protocol crate's frame I/O and nothing else
//!   (no pool, no request table, no timeout): what the node costs on top of
//!   a raw socket round trip (`kvplane bench --target raw`).
//! - `client`: [`Client::get`] of one key (pool of one connection), as
//!   `kvplane bench --batch 1 --clients 1` calls it: `client` less `bare`
//!   is what the client's request path adds.
//!
//! ```text
//! cargo run --release -p kvplane-client --example round_trip -- 127.0.0.1:PORT [ROUNDS] [SECONDS]
//! ```
//!
//! Prints each round's p50 per way and the median over the rounds.

use std::time::{Duration, Instant};

use bytes::Bytes;
use kvplane_client::{Client, ClientConfig, Endpoint};
use kvplane_protocol::io::{read_frame, write_frame};
use kvplane_protocol::{encode, Features, Frame, Hello, Limits, Message, Request, Response, VERSION};
use tokio::io::BufReader;

/// Distinct keys asked in turn (as scripts/bench-node's single-GET cell).
const BLOCKS: usize = 1024;
const BLOCK_BYTES: usize = 4096;

fn key(i: usize) -> Bytes {
    Bytes::from(format!("round-trip/{i:08}"))
}

/// One connection, driven by the calling task alone.
struct Bare {
    reader: BufReader<tokio::net::tcp::OwnedReadHalf>,
    writer: tokio::net::tcp::OwnedWriteHalf,
    next_id: u64,
}

/// The node's limits do not bind what a client accepts.
fn answer_limits() -> Limits {
    Limits { max_frame_bytes: u32::MAX, max_key_bytes: u16::MAX as u32, max_batch_keys: u32::MAX, max_lease_ms: u32::MAX }
}

impl Bare {
    async fn connect(addr: &str) -> Bare {
        let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        let (r, writer) = stream.into_split();
        let mut bare = Bare { reader: BufReader::with_capacity(256 << 10, r), writer, next_id: 0 };
        let hello = Request::Hello(Hello { version: VERSION, features: Features::ALL, token: None });
        match bare.exchange(hello).await {
            Response::HelloAck(_) => bare,
            other => panic!("handshake answered {other:?}"),
        }
    }

    async fn exchange(&mut self, request: Request) -> Response {
        let id = self.next_id;
        self.next_id += 1;
        let frame = encode(&Frame::request(id, request)).expect("encode");
        write_frame(&mut self.writer, &frame).await.expect("write");
        match read_frame(&mut self.reader, &answer_limits()).await.expect("read") {
            Some(Frame { request_id, message: Message::Response(r) }) if request_id == id => r,
            other => panic!("request {id} answered {other:?}"),
        }
    }

    async fn get(&mut self, key: Bytes) {
        match self.exchange(Request::Get { keys: vec![key] }).await {
            Response::Get { results } if matches!(&results[..], [Ok(b)] if b.data.len() == BLOCK_BYTES) => {}
            other => panic!("GET answered {other:?}"),
        }
    }
}

fn p50(mut samples: Vec<Duration>) -> Duration {
    samples.sort_unstable();
    samples[samples.len() / 2]
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

#[tokio::main]
async fn main() {
    // On a worker, as `kvplane bench` runs its clients: `main`'s own thread
    // is not one, and a call there is woken across threads at each answer.
    let mut args = std::env::args().skip(1);
    let addr = args.next().expect("usage: round_trip HOST:PORT [ROUNDS] [SECONDS]");
    let rounds: usize = args.next().map_or(5, |r| r.parse().expect("ROUNDS"));
    let seconds: f64 = args.next().map_or(2.0, |s| s.parse().expect("SECONDS"));
    tokio::spawn(measure(addr, rounds, Duration::from_secs_f64(seconds))).await.expect("the measurement ran");
}

async fn measure(addr: String, rounds: usize, run_for: Duration) {
    let mut config = ClientConfig::new(Endpoint::Tcp(addr.clone()));
    config.connections = 1;
    let client = Client::connect(config).await.expect("client connects");
    let block = Bytes::from(vec![0x5a; BLOCK_BYTES]);
    for i in 0..BLOCKS {
        client.put(vec![(key(i), block.clone())]).await.expect("seed").into_iter().for_each(|r| r.expect("seeded"));
    }
    let mut bare = Bare::connect(&addr).await;

    let (mut bare_p50, mut client_p50) = (Vec::new(), Vec::new());
    for round in 1..=rounds {
        let mut samples = Vec::new();
        let start = Instant::now();
        while start.elapsed() < run_for {
            let t = Instant::now();
            bare.get(key(samples.len() % BLOCKS)).await;
            samples.push(t.elapsed());
        }
        let b = p50(samples).as_secs_f64() * 1e6;
        let mut samples = Vec::new();
        let start = Instant::now();
        while start.elapsed() < run_for {
            let t = Instant::now();
            let got = client.get(vec![key(samples.len() % BLOCKS)]).await.expect("GET");
            assert!(matches!(&got[..], [Ok(b)] if b.len() == BLOCK_BYTES), "GET answered {got:?}");
            samples.push(t.elapsed());
        }
        let c = p50(samples).as_secs_f64() * 1e6;
        println!("round {round}: bare p50 {b:.1} us, client p50 {c:.1} us, client/bare {:.3}", c / b);
        bare_p50.push(b);
        client_p50.push(c);
    }
    let (b, c) = (median(bare_p50), median(client_p50));
    println!("median of {rounds} rounds: bare {b:.1} us, client {c:.1} us, client/bare {:.3}", c / b);
}
