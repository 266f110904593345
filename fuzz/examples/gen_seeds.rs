//! Writes the seed corpus of the `decode_frame` target: one small, valid
//! frame per opcode, encoded by the crate itself.
//!
//!     cargo run --manifest-path fuzz/Cargo.toml --example gen_seeds [DIR]
//!
//! DIR defaults to `fuzz/seeds/decode_frame`. The files are committed; run
//! this again after a change to the wire format.

use bytes::Bytes;
use kvplane_protocol::rdma::{Descriptor, QueuePairEndpoint, Gid};
use kvplane_protocol::{
    decode, encode, Block, ErrorCode, Features, Frame, Hello, HelloAck, Limits, PutEntry, Request, Response, StatEntry,
};

fn key(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

fn block(s: &str) -> Block {
    Block::new(key(s))
}

fn seeds() -> Vec<(&'static str, Frame)> {
    vec![
        ("hello", Frame::request(0, Request::Hello(Hello { version: 1, features: Features::ALL, token: None }))),
        (
            "hello_token",
            Frame::request(0, Request::Hello(Hello { version: 1, features: Features::PIN_LEASE, token: Some("s3cret".into()) })),
        ),
        (
            "put",
            Frame::request(
                1,
                Request::Put {
                    entries: vec![PutEntry { key: key("a"), block: block("alpha") }, PutEntry { key: key("b"), block: block("") }],
                },
            ),
        ),
        ("get", Frame::request(2, Request::Get { keys: vec![key("a"), key("b")] })),
        ("exists", Frame::request(3, Request::Exists { keys: vec![key("a")] })),
        ("delete", Frame::request(4, Request::Delete { keys: vec![key("z")] })),
        ("match_prefix", Frame::request(5, Request::MatchPrefix { keys: vec![key("p0"), key("p1")], lease_ms: 250 })),
        ("stats", Frame::request(6, Request::Stats)),
        ("ping", Frame::request(7, Request::Ping)),
        ("hello_ack", Frame::response(0, Response::HelloAck(HelloAck { version: 1, features: Features::ALL, limits: Limits::default() }))),
        ("put_result", Frame::response(1, Response::Put { results: vec![Ok(()), Err(ErrorCode::BadChecksum)] })),
        ("get_result", Frame::response(2, Response::Get { results: vec![Ok(block("alpha")), Err(ErrorCode::NotFound)] })),
        ("exists_result", Frame::response(3, Response::Exists { results: vec![Err(ErrorCode::NotFound)] })),
        ("delete_result", Frame::response(4, Response::Delete { results: vec![Ok(())] })),
        ("match_prefix_result", Frame::response(5, Response::MatchPrefix { matched: 2, lease_ms: 250 })),
        ("stats_result", Frame::response(6, Response::Stats { entries: vec![StatEntry { name: "hits".into(), value: 42 }] })),
        ("pong", Frame::response(7, Response::Pong)),
        ("error", Frame::response(8, Response::Error { code: ErrorCode::Malformed, message: "malformed key.len".into() })),
        ("rdma_connect", Frame::request(3, Request::RdmaConnect { endpoint: endpoint([0xff, 0xff, 10, 0, 0, 2], 0x456, 0x1234) })),
        ("rdma_describe", Frame::request(4, Request::RdmaDescribe { keys: vec![key("k1")], lease_ms: 2_000 })),
        ("rdma_describe_result", Frame::response(4, Response::RdmaDescribe { results: vec![Ok(hello_descriptor())] })),
    ]
}

/// A RoCE endpoint whose GID ends in `tail` (an IPv4-mapped address).
fn endpoint(tail: [u8; 6], qp_num: u32, psn: u32) -> QueuePairEndpoint {
    let mut gid = [0u8; 16];
    gid[10..].copy_from_slice(&tail);
    QueuePairEndpoint { gid: Gid(gid), lid: 0, qp_num, psn }
}

/// The descriptor of docs/protocol.md's worked example (the block `hello`).
fn hello_descriptor() -> Descriptor {
    let node = endpoint([0xff, 0xff, 10, 0, 0, 1], 0x123, 0);
    Descriptor {
        gid: node.gid,
        lid: 0,
        qp_num: node.qp_num,
        addr: 0x7f3a_0020_0000,
        rkey: 0x1a2b,
        len: 5,
        crc32c: kvplane_protocol::checksum(b"hello"),
        lease: 1,
        expires_at_ms: 1_767_225_600_000,
    }
}

fn main() {
    let dir = std::env::args().nth(1).unwrap_or_else(|| "fuzz/seeds/decode_frame".into());
    std::fs::create_dir_all(&dir).expect("creating the seed directory");
    for (name, frame) in seeds() {
        let wire = encode(&frame).expect("seed encodes").to_vec();
        let (back, used) = decode(&Bytes::from(wire.clone()), &Limits::default()).expect("seed decodes").expect("seed complete");
        assert_eq!((back, used), (frame, wire.len()), "seed {name} does not round-trip");
        let path = format!("{dir}/{name}.bin");
        std::fs::write(&path, &wire).expect("writing a seed");
        println!("{path}: {} bytes", wire.len());
    }
}
