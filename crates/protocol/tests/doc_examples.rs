//! Keeps docs/protocol.md honest: its hex dumps are the bytes this crate
//! encodes and decodes, and its tables of opcodes, error codes and default
//! limits carry the values the crate defines.
//!
//! A dump is a fenced block whose info string is `hex NAME`; on each line,
//! everything after `#` is a comment and the rest is bytes as two-digit hex.

use bytes::Bytes;
use kvplane_protocol::rdma::{Descriptor, Gid, QueuePairEndpoint};
use kvplane_protocol::{
    decode, encode, Block, ErrorCode, Features, Frame, Hello, HelloAck, Limits, Opcode, Request, Response, DEFAULT_MAX_BATCH_KEYS,
    DEFAULT_MAX_FRAME_BYTES, DEFAULT_MAX_KEY_BYTES, DEFAULT_MAX_LEASE_MS, HEADER_LEN, MAX_ERROR_MESSAGE_BYTES, MAX_STATS_ENTRIES,
    MAX_TOKEN_BYTES,
};
use kvplane_slots::{Member, SlotTable};

fn doc() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/protocol.md");
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"))
}

/// Every `hex NAME` block of the document, in order.
fn dumps(doc: &str) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut current: Option<(String, Vec<u8>)> = None;
    for (n, line) in doc.lines().enumerate() {
        let trimmed = line.trim();
        match &mut current {
            None => {
                if let Some(name) = trimmed.strip_prefix("```hex ") {
                    current = Some((name.trim().to_string(), Vec::new()));
                }
            }
            Some((_, bytes)) => {
                if trimmed == "```" {
                    out.push(current.take().expect("inside a block"));
                    continue;
                }
                let data = trimmed.split('#').next().unwrap_or("");
                for tok in data.split_whitespace() {
                    assert!(tok.len() == 2, "line {}: {tok:?} is not one byte in hex", n + 1);
                    bytes.push(u8::from_str_radix(tok, 16).unwrap_or_else(|_| panic!("line {}: {tok:?} is not hex", n + 1)));
                }
            }
        }
    }
    assert!(current.is_none(), "unterminated hex block");
    out
}

fn examples() -> Vec<(&'static str, Frame)> {
    let key = |s: &str| Bytes::copy_from_slice(s.as_bytes());
    vec![
        ("hello", Frame::request(0, Request::Hello(Hello { version: 1, features: Features::ALL, token: Some("s3cret".into()) }))),
        ("hello_ack", Frame::response(0, Response::HelloAck(HelloAck { version: 1, features: Features::ALL, limits: Limits::default() }))),
        ("get", Frame::request(1, Request::Get { keys: vec![key("k1")] })),
        ("get_result", Frame::response(1, Response::Get { results: vec![Ok(Block::new(key("hello")))] })),
        ("get_result_miss", Frame::response(1, Response::Get { results: vec![Err(ErrorCode::NotFound)] })),
        ("cluster_table", Frame::request(2, Request::ClusterTable { after_version: 7, wait_ms: 30_000 })),
        ("cluster_table_result", Frame::response(2, Response::ClusterTable(Box::new(two_member_table())))),
        ("rdma_connect", Frame::request(3, Request::RdmaConnect { endpoint: client_endpoint() })),
        ("rdma_describe", Frame::request(4, Request::RdmaDescribe { keys: vec![key("k1")], lease_ms: 2_000 })),
        ("rdma_describe_result", Frame::response(4, Response::RdmaDescribe { results: vec![Ok(hello_descriptor())] })),
    ]
}

/// A RoCE client's queue pair: GID ::ffff:10.0.0.2, queue pair 0x000456.
fn client_endpoint() -> QueuePairEndpoint {
    let mut gid = [0u8; 16];
    gid[10..].copy_from_slice(&[0xff, 0xff, 10, 0, 0, 2]);
    QueuePairEndpoint { gid: Gid(gid), lid: 0, qp_num: 0x456, psn: 0x1234 }
}

/// The block `hello` at 0x7f3a00200000 of a node at ::ffff:10.0.0.1, queue
/// pair 0x000123, lease 1 until 1767225600000 ms.
fn hello_descriptor() -> Descriptor {
    let mut gid = [0u8; 16];
    gid[10..].copy_from_slice(&[0xff, 0xff, 10, 0, 0, 1]);
    Descriptor {
        gid: Gid(gid),
        lid: 0,
        qp_num: 0x123,
        addr: 0x7f3a_0020_0000,
        rkey: 0x1a2b,
        len: 5,
        crc32c: kvplane_protocol::checksum(b"hello"),
        lease: 1,
        expires_at_ms: 1_767_225_600_000,
    }
}

/// Two up members, two slots, one owner each, version 8.
fn two_member_table() -> SlotTable {
    let members = vec![Member::up("a", "10.0.0.1:9600"), Member::up("b", "10.0.0.2:9600")];
    SlotTable::new(8, members, 2, 1, 1, vec![0, 1]).unwrap().with_write_quorum(Some(1))
}

#[test]
fn hex_dumps_are_what_the_crate_encodes_and_decodes() {
    let doc = doc();
    let dumps = dumps(&doc);
    let names: Vec<&str> = dumps.iter().map(|(n, _)| n.as_str()).collect();
    for (name, frame) in examples() {
        let Some((_, bytes)) = dumps.iter().find(|(n, _)| n == name) else {
            panic!("docs/protocol.md has no ```hex {name} block (found {names:?})");
        };
        let encoded = encode(&frame).expect("example encodes").to_vec();
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<Vec<_>>().join(" ");
        assert_eq!(hex(bytes), hex(&encoded), "dump `{name}` differs from the encoding of {frame:?}");
        let wire = Bytes::from(bytes.clone());
        let (decoded, used) = decode(&wire, &Limits::default()).expect("dump decodes").expect("dump is a whole frame");
        assert_eq!(used, bytes.len(), "dump `{name}` has bytes after its frame");
        assert_eq!(decoded, frame, "dump `{name}`");
    }
    assert_eq!(dumps.len(), examples().len(), "a hex block in docs/protocol.md is not checked: {names:?}");
}

/// `HelloAck` → `HELLO_ACK`.
fn wire_name(op: Opcode) -> String {
    let mut out = String::new();
    for (i, c) in format!("{op:?}").chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

#[test]
fn every_opcode_is_in_the_opcode_table() {
    let doc = doc();
    for v in 0..=255u8 {
        let row = format!("| `0x{v:02x}` |");
        match Opcode::from_u8(v) {
            Some(op) => {
                let full = format!("| `0x{v:02x}` | {} |", wire_name(op));
                assert!(doc.contains(&full), "docs/protocol.md lacks the opcode row {full:?}");
            }
            None => {
                assert!(!doc.contains(&row), "docs/protocol.md lists opcode 0x{v:02x}, which the crate does not know")
            }
        }
    }
}

#[test]
fn every_error_code_is_in_the_error_table() {
    let doc = doc();
    for v in 1..=u8::MAX as u16 {
        let code = ErrorCode::from_u16(v).expect("non-zero");
        let row = format!("| {v} | `");
        if let ErrorCode::Other(_) = code {
            assert!(!doc.contains(&row), "docs/protocol.md lists error code {v}, which the crate does not know");
        } else {
            let full = format!("| {v} | `{}` |", code.name());
            assert!(doc.contains(&full), "docs/protocol.md lacks the error row {full:?}");
        }
    }
}

#[test]
fn limits_and_sizes_match_the_crate() {
    let doc = doc();
    for (name, value) in [
        ("`max_frame_bytes`", DEFAULT_MAX_FRAME_BYTES as usize),
        ("`max_key_bytes`", DEFAULT_MAX_KEY_BYTES as usize),
        ("`max_batch_keys`", DEFAULT_MAX_BATCH_KEYS as usize),
        ("`max_lease_ms`", DEFAULT_MAX_LEASE_MS as usize),
        ("token", MAX_TOKEN_BYTES),
        ("error message", MAX_ERROR_MESSAGE_BYTES),
        ("stats entries", MAX_STATS_ENTRIES),
    ] {
        let row = format!("| {name} | {value} ");
        assert!(doc.contains(&row), "docs/protocol.md lacks the limits row starting {row:?}");
    }
    assert!(doc.contains(&format!("{HEADER_LEN}-byte header")));
}
