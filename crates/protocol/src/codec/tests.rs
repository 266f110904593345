use super::*;
use crate::frame::Features;
use crate::limits::{Limits, MAX_ERROR_MESSAGE_BYTES};
use crate::message::{Hello, HelloAck, ShmBlock, ShmGet, ShmPut, StatEntry};
use kvplane_slots::{Member, MemberState, SlotTable};

fn key(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

fn roundtrip(frame: Frame) {
    let encoded = encode(&frame).expect("encodes");
    let wire = Bytes::from(encoded.to_vec());
    let (decoded, used) = decode(&wire, &Limits::default()).expect("decodes").expect("complete");
    assert_eq!(used, wire.len());
    assert_eq!(decoded, frame);
}

fn all_frames() -> Vec<Frame> {
    let block = |s: &str| Block::new(Bytes::copy_from_slice(s.as_bytes()));
    vec![
        Frame::request(1, Request::Hello(Hello { version: 1, features: Features::ALL, token: Some("s3cret".into()) })),
        Frame::request(2, Request::Hello(Hello { version: 1, features: Features::default(), token: None })),
        Frame::request(
            3,
            Request::Put { entries: vec![PutEntry { key: key("a"), block: block("alpha") }, PutEntry { key: key("b"), block: block("") }] },
        ),
        Frame::request(4, Request::Get { keys: vec![key("a"), key("b")] }),
        Frame::request(5, Request::Exists { keys: vec![key("a")] }),
        Frame::request(6, Request::Delete { keys: vec![key("z")] }),
        Frame::request(7, Request::MatchPrefix { keys: vec![key("p0"), key("p1"), key("p0")], lease_ms: 250 }),
        Frame::request(8, Request::Stats),
        Frame::request(9, Request::Ping),
        Frame::response(1, Response::HelloAck(HelloAck { version: 1, features: Features::PIN_LEASE, limits: Limits::default() })),
        Frame::response(3, Response::Put { results: vec![Ok(()), Err(ErrorCode::Capacity)] }),
        Frame::response(4, Response::Get { results: vec![Ok(block("alpha")), Err(ErrorCode::NotFound), Ok(block("beta"))] }),
        Frame::response(5, Response::Exists { results: vec![Err(ErrorCode::NotFound)] }),
        Frame::response(6, Response::Delete { results: vec![Ok(())] }),
        Frame::response(7, Response::MatchPrefix { matched: 2, lease_ms: 250 }),
        Frame::response(8, Response::Stats { entries: vec![StatEntry { name: "hits".into(), value: 42 }] }),
        Frame::response(9, Response::Pong),
        Frame::response(10, Response::Error { code: ErrorCode::Other(999), message: "from a newer node".into() }),
        Frame::request(11, Request::ClusterTable { after_version: 7, wait_ms: 30_000 }),
        Frame::response(11, Response::ClusterTable(Box::new(small_table()))),
        Frame::response(11, Response::ClusterTable(Box::new(small_table().with_write_quorum(Some(1))))),
        Frame::request(12, Request::ShmAttach),
        Frame::response(12, Response::ShmAttach { size: 64 << 20 }),
        Frame::request(13, Request::PutShm { entries: vec![ShmPut { key: key("a"), offset: 4096, len: 5, crc: 7 }] }),
        Frame::response(13, Response::PutShm { results: vec![Ok(()), Err(ErrorCode::BadChecksum)] }),
        Frame::request(14, Request::GetShm { entries: vec![ShmGet { key: key("a"), offset: 0, capacity: 65536 }] }),
        Frame::response(14, Response::GetShm { results: vec![Ok(ShmBlock { len: 5, crc: 9 }), Err(ErrorCode::NotFound)] }),
        Frame::request(15, Request::RdmaDescribe { keys: vec![key("a"), key("b")], lease_ms: 500 }),
        Frame::response(15, Response::RdmaDescribe { results: vec![Ok(descriptor()), Err(ErrorCode::NotFound)] }),
        Frame::response(15, Response::RdmaDescribe { results: vec![] }),
        Frame::request(16, Request::RdmaConnect { endpoint: endpoint() }),
        Frame::response(16, Response::RdmaConnect { endpoint: endpoint() }),
    ]
}

fn descriptor() -> crate::rdma::Descriptor {
    crate::rdma::Descriptor {
        gid: crate::rdma::Gid([0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]),
        lid: 0,
        qp_num: 0x11,
        addr: 0x7f00_0000_1000,
        rkey: 0x1234,
        len: 5,
        crc32c: crate::message::checksum(b"hello"),
        lease: 7,
        expires_at_ms: 1_000_500,
    }
}

fn endpoint() -> crate::rdma::QueuePairEndpoint {
    crate::rdma::QueuePairEndpoint { gid: crate::rdma::Gid([7; 16]), lid: 2, qp_num: 0x11, psn: 0x42 }
}

#[test]
fn a_corrupted_rdma_descriptor_is_malformed_naming_the_field() {
    let frame = Frame::response(1, Response::RdmaDescribe { results: vec![Ok(descriptor())] });
    let mut wire = encode(&frame).unwrap().to_vec();
    // The descriptor's `len` (at offset 40 of its 68 bytes, after the
    // header, the count and the status): changed without resealing it.
    let at = HEADER_LEN + 4 + 2 + 40;
    wire[at] ^= 0x01;
    match decode(&Bytes::from(wire), &Limits::default()) {
        Err(DecodeError { error: ProtocolError::Malformed { field, reason }, fatal: false, .. }) => {
            assert_eq!(field, "rdma_describe_result.descriptor");
            assert!(reason.contains("`check`"), "{reason}");
        }
        other => panic!("{other:?}"),
    }

    // A status 0 with no descriptor after it.
    let mut wire = encode(&Frame::response(1, Response::RdmaDescribe { results: vec![Err(ErrorCode::NotFound)] })).unwrap().to_vec();
    let status = HEADER_LEN + 4;
    wire[status] = 0;
    match decode(&Bytes::from(wire), &Limits::default()) {
        Err(DecodeError { error: ProtocolError::Malformed { field, .. }, .. }) => assert_eq!(field, "rdma_describe_result.descriptor"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_rdma_endpoint_wider_than_24_bits_is_malformed_naming_the_field() {
    let frame = Frame::request(1, Request::RdmaConnect { endpoint: endpoint() });
    let mut wire = encode(&frame).unwrap().to_vec();
    // qp_num is at 22..26 of the endpoint, big-endian: set its top byte.
    wire[HEADER_LEN + 22] = 1;
    match decode(&Bytes::from(wire), &Limits::default()) {
        Err(DecodeError { error: ProtocolError::Malformed { field, reason }, fatal: false, .. }) => {
            assert_eq!(field, "rdma_connect.endpoint");
            assert!(reason.contains("`qp_num`"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn rdma_describe_refuses_duplicate_keys_and_counts_against_the_batch_limit() {
    let wire = encode(&Frame::request(1, Request::RdmaDescribe { keys: vec![key("a"), key("a")], lease_ms: 1 })).unwrap().to_vec();
    let e = decode(&Bytes::from(wire), &Limits::default()).unwrap_err();
    assert_eq!(e.error, ProtocolError::DuplicateKey { index: 1, first: 0 });
    let small = Limits { max_batch_keys: 1, ..Limits::default() };
    let wire = encode(&Frame::request(1, Request::RdmaDescribe { keys: vec![key("a"), key("b")], lease_ms: 1 })).unwrap().to_vec();
    assert_eq!(decode(&Bytes::from(wire), &small).unwrap_err().error, ProtocolError::TooManyKeys { count: 2, limit: 1 });
}

/// Three members (one draining), four slots, two owners each.
fn small_table() -> SlotTable {
    let mut members = vec![Member::up("a", "10.0.0.1:9600"), Member::up("b", "10.0.0.2:9600"), Member::up("c", "10.0.0.3:9600")];
    members[1].zone = "zone-1".into();
    members[2].state = MemberState::Draining;
    members[2].weight = 0;
    SlotTable::new(9, members, 4, 2, 2, vec![0, 1, 1, 0, 0, 2, 1, 0]).unwrap()
}

#[test]
fn a_cluster_table_naming_a_member_that_is_not_listed_is_malformed() {
    let encoded = encode(&Frame::response(1, Response::ClusterTable(Box::new(small_table())))).unwrap();
    let mut wire = encoded.to_vec();
    // The last owner index (u16 at the very end) → member #9 of 3.
    let n = wire.len();
    wire[n - 2] = 9;
    match decode(&Bytes::from(wire), &Limits::default()) {
        Err(DecodeError { error: ProtocolError::Malformed { field, reason }, .. }) => {
            assert_eq!(field, "cluster_table.owners");
            assert!(reason.contains("member #9"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_cluster_tables_write_quorum_rides_in_the_header_flags_an_older_decoder_ignores() {
    let plain = encode(&Frame::response(1, Response::ClusterTable(Box::new(small_table())))).unwrap().to_vec();
    let stated = encode(&Frame::response(1, Response::ClusterTable(Box::new(small_table().with_write_quorum(Some(2)))))).unwrap().to_vec();
    // Only the flags byte differs: a version-1 decoder, which ignores it,
    // reads the same table from both.
    assert_eq!(plain[7], 0);
    assert_eq!(stated[7], 2);
    assert_eq!(plain[..7], stated[..7]);
    assert_eq!(plain[8..], stated[8..]);
    let table = |wire: Vec<u8>| match decode(&Bytes::from(wire), &Limits::default()) {
        Ok(Some((Frame { message: Message::Response(Response::ClusterTable(t)), .. }, _))) => Ok(*t),
        Err(DecodeError { error: ProtocolError::Malformed { field, reason }, .. }) => Err(format!("{field}: {reason}")),
        other => panic!("{other:?}"),
    };
    assert_eq!(table(stated.clone()).unwrap().write_quorum(), Some(2));
    assert_eq!(table(plain).unwrap().write_quorum(), None);
    // The high four bits are left for later: ignored.
    let mut later = stated.clone();
    later[7] |= 0xa0;
    assert_eq!(table(later).unwrap().write_quorum(), Some(2));
    // Above the most replicas a table may have: malformed, named.
    let mut over = stated;
    over[7] = 9;
    let e = table(over).unwrap_err();
    assert!(e.starts_with("cluster_table.write_quorum: 9"), "{e}");
    // And the encoder refuses what the decoder would.
    let e = encode(&Frame::response(1, Response::ClusterTable(Box::new(small_table().with_write_quorum(Some(9)))))).unwrap_err();
    assert!(e.to_string().contains("cluster_table.write_quorum"), "{e}");
    // The flags byte means nothing on other answers and stays 0.
    assert_eq!(encode(&Frame::response(1, Response::Pong)).unwrap().to_vec()[7], 0);
}

#[test]
fn every_message_survives_a_roundtrip() {
    for frame in all_frames() {
        roundtrip(frame);
    }
}

#[test]
fn every_strict_prefix_of_a_frame_asks_for_more_bytes() {
    for frame in all_frames() {
        let wire = encode(&frame).expect("encodes").to_vec();
        for cut in 0..wire.len() {
            let partial = Bytes::copy_from_slice(&wire[..cut]);
            assert_eq!(decode(&partial, &Limits::default()), Ok(None), "prefix of {cut} bytes of {frame:?}");
        }
    }
}

#[test]
fn payloads_are_slices_of_the_receive_buffer() {
    let frame =
        Frame::request(1, Request::Put { entries: vec![PutEntry { key: key("k"), block: Block::new(Bytes::from(vec![7u8; 4096])) }] });
    let wire = Bytes::from(encode(&frame).expect("encodes").to_vec());
    let (decoded, _) = decode(&wire, &Limits::default()).expect("ok").expect("complete");
    let Message::Request(Request::Put { entries }) = decoded.message else { panic!("not a put") };
    let range = wire.as_ptr() as usize..wire.as_ptr() as usize + wire.len();
    assert!(range.contains(&(entries[0].block.data.as_ptr() as usize)), "payload was copied");
}

fn decode_err(wire: Vec<u8>, limits: &Limits) -> DecodeError {
    decode(&Bytes::from(wire), limits).expect_err("must be refused")
}

#[test]
fn a_bad_magic_is_fatal_and_named() {
    let mut wire = encode(&Frame::request(1, Request::Ping)).expect("encodes").to_vec();
    wire[..4].copy_from_slice(b"GET ");
    let e = decode_err(wire, &Limits::default());
    assert_eq!(e.code(), ErrorCode::BadMagic);
    assert!(e.fatal);
    assert!(e.to_string().contains("not a kvplane frame"), "{e}");
}

#[test]
fn an_unsupported_version_names_both_versions() {
    let mut wire = encode(&Frame::request(1, Request::Ping)).expect("encodes").to_vec();
    wire[4..6].copy_from_slice(&9u16.to_le_bytes());
    let e = decode_err(wire, &Limits::default());
    assert_eq!(e.code(), ErrorCode::BadVersion);
    assert!(e.to_string().contains("version 9") && e.to_string().contains("1..=1"), "{e}");
}

#[test]
fn an_oversized_length_is_refused_before_it_is_buffered() {
    let mut header = [0u8; HEADER_LEN];
    FrameHeader { version: 1, opcode: Opcode::Put as u8, flags: 0, request_id: 77, body_len: u32::MAX, meta_len: 4 }.write(&mut header);
    let limits = Limits { max_frame_bytes: 1 << 20, ..Limits::default() };
    let e = decode_err(header.to_vec(), &limits);
    assert_eq!(e.code(), ErrorCode::FrameTooLarge);
    assert_eq!(e.request_id, Some(77));
    assert!(e.fatal, "a frame too large to buffer cannot be skipped safely");
}

#[test]
fn an_unknown_opcode_costs_the_frame_not_the_connection() {
    let mut wire = encode(&Frame::request(5, Request::Ping)).expect("encodes").to_vec();
    wire[6] = 0x42;
    let e = decode_err(wire, &Limits::default());
    assert_eq!(e.code(), ErrorCode::UnknownOpcode);
    assert_eq!(e.request_id, Some(5));
    assert!(!e.fatal);
    assert!(e.to_string().contains("0x42"), "{e}");
}

#[test]
fn a_corrupted_payload_fails_its_checksum_by_block_index() {
    let entries = vec![
        PutEntry { key: key("a"), block: Block::new(Bytes::from_static(b"first")) },
        PutEntry { key: key("b"), block: Block::new(Bytes::from_static(b"second")) },
    ];
    let mut wire = encode(&Frame::request(1, Request::Put { entries })).expect("encodes").to_vec();
    let last = wire.len() - 1;
    wire[last] ^= 0xff;
    let e = decode_err(wire, &Limits::default());
    assert_eq!(e.code(), ErrorCode::BadChecksum);
    assert!(e.to_string().contains("block #1"), "{e}");
    assert!(!e.fatal);
}

#[test]
fn duplicate_keys_in_one_batch_are_refused_with_both_positions() {
    for req in [
        Request::Get { keys: vec![key("x"), key("y"), key("x")] },
        Request::Delete { keys: vec![key("x"), key("x")] },
        Request::Put {
            entries: vec![
                PutEntry { key: key("x"), block: Block::new(Bytes::from_static(b"1")) },
                PutEntry { key: key("x"), block: Block::new(Bytes::from_static(b"2")) },
            ],
        },
    ] {
        let wire = encode(&Frame::request(1, req)).expect("encodes").to_vec();
        let e = decode_err(wire, &Limits::default());
        assert_eq!(e.code(), ErrorCode::DuplicateKey);
        assert!(e.to_string().contains("repeats key #0"), "{e}");
    }
}

#[test]
fn a_batch_of_keys_the_wire_cannot_carry_is_refused_before_anything_large_is_reserved() {
    // A hundred thousand clones of one 1 MiB key: a meta reserved for its
    // whole length would ask the allocator for a hundred gigabytes (and
    // abort the process) before the first key was refused.
    let huge = Bytes::from(vec![b'k'; 1 << 20]);
    let keys = vec![huge.clone(); 100_000];
    for req in [
        Request::Get { keys: keys.clone() },
        Request::Put { entries: keys.iter().map(|k| PutEntry { key: k.clone(), block: Block::new(Bytes::from_static(b"v")) }).collect() },
    ] {
        match encode(&Frame::request(1, req)) {
            Err(ProtocolError::KeyTooLong { index: 0, len, .. }) => assert_eq!(len, 1 << 20),
            other => panic!("encoded a key of 1 MiB: {other:?}"),
        }
    }
}

#[test]
fn key_and_batch_limits_are_typed_errors() {
    let limits = Limits { max_key_bytes: 8, max_batch_keys: 2, ..Limits::default() };
    let long = encode(&Frame::request(1, Request::Get { keys: vec![key("short"), key("much-too-long")] })).expect("encodes").to_vec();
    let e = decode_err(long, &limits);
    assert_eq!(e.code(), ErrorCode::KeyTooLong);
    assert!(e.to_string().contains("key #1 is 13 bytes"), "{e}");
    let many = encode(&Frame::request(1, Request::Exists { keys: vec![key("a"), key("b"), key("c")] })).expect("encodes").to_vec();
    assert_eq!(decode_err(many, &limits).code(), ErrorCode::TooManyKeys);
    let empty = encode(&Frame::request(1, Request::Delete { keys: vec![Bytes::new()] })).expect("encodes").to_vec();
    assert_eq!(decode_err(empty, &limits).code(), ErrorCode::Invalid);
}

#[test]
fn a_truncated_meta_names_the_field() {
    // A GET whose meta claims two keys but carries one and half a length.
    let mut body = Vec::new();
    body.extend_from_slice(&2u32.to_le_bytes());
    body.extend_from_slice(&1u16.to_le_bytes());
    body.push(b'a');
    body.push(1);
    let mut header = [0u8; HEADER_LEN];
    FrameHeader {
        version: 1,
        opcode: Opcode::Get as u8,
        flags: 0,
        request_id: 3,
        body_len: body.len() as u32,
        meta_len: body.len() as u32,
    }
    .write(&mut header);
    let mut wire = header.to_vec();
    wire.extend_from_slice(&body);
    let e = decode_err(wire, &Limits::default());
    assert_eq!(e.code(), ErrorCode::Malformed);
    assert!(e.to_string().contains("malformed key.len"), "{e}");
    assert!(!e.fatal, "the frame boundary is known, the next frame can follow");
}

#[test]
fn payload_lengths_must_add_up_to_the_frame() {
    let frame =
        Frame::request(1, Request::Put { entries: vec![PutEntry { key: key("a"), block: Block::new(Bytes::from_static(b"abcd")) }] });
    let mut wire = encode(&frame).expect("encodes").to_vec();
    // Declare one payload byte more than the entry says (and supply it).
    let body_len = u32::from_le_bytes(wire[16..20].try_into().unwrap()) + 1;
    wire[16..20].copy_from_slice(&body_len.to_le_bytes());
    wire.push(0);
    let e = decode_err(wire, &Limits::default());
    assert_eq!(e.code(), ErrorCode::Malformed);
    assert!(e.to_string().contains("add up to 4 bytes but the frame carries 5"), "{e}");
}

#[test]
fn meta_longer_than_body_is_refused_in_the_header() {
    let mut header = [0u8; HEADER_LEN];
    FrameHeader { version: 1, opcode: Opcode::Ping as u8, flags: 0, request_id: 1, body_len: 2, meta_len: 3 }.write(&mut header);
    let e = decode_err(header.to_vec(), &Limits::default());
    assert_eq!(e.code(), ErrorCode::Malformed);
    assert!(e.fatal);
}

#[test]
fn long_error_messages_are_cut_on_a_character_boundary() {
    let message = "é".repeat(MAX_ERROR_MESSAGE_BYTES);
    let wire = Bytes::from(encode(&Frame::response(1, Response::Error { code: ErrorCode::Internal, message })).expect("encodes").to_vec());
    let (frame, _) = decode(&wire, &Limits::default()).expect("ok").expect("complete");
    let Message::Response(Response::Error { message, .. }) = frame.message else { panic!("not an error") };
    assert!(message.len() <= MAX_ERROR_MESSAGE_BYTES && message.chars().all(|c| c == 'é'));
}

#[test]
fn a_huge_declared_count_in_a_tiny_frame_is_refused_before_allocating() {
    // A GET_RESULT claiming u32::MAX entries in 4 bytes of meta, read with the
    // client's unbounded batch limit.
    let mut header = [0u8; HEADER_LEN];
    FrameHeader { version: 1, opcode: Opcode::GetResult as u8, flags: 0, request_id: 1, body_len: 4, meta_len: 4 }.write(&mut header);
    let mut wire = header.to_vec();
    wire.extend_from_slice(&u32::MAX.to_le_bytes());
    let limits = Limits { max_batch_keys: u32::MAX, ..Limits::default() };
    let e = decode_err(wire, &limits);
    assert_eq!(e.code(), ErrorCode::Malformed);
    assert!(e.to_string().contains("do not fit"), "{e}");
}

#[test]
fn an_error_message_over_the_limit_or_not_utf8_is_refused() {
    for (len, byte) in [(MAX_ERROR_MESSAGE_BYTES + 1, b'a'), (10, 0xff)] {
        let mut body = Vec::new();
        body.extend_from_slice(&25u16.to_le_bytes());
        body.extend_from_slice(&(len as u16).to_le_bytes());
        body.extend(std::iter::repeat_n(byte, len));
        let mut header = [0u8; HEADER_LEN];
        FrameHeader {
            version: 1,
            opcode: Opcode::Error as u8,
            flags: 0,
            request_id: 1,
            body_len: body.len() as u32,
            meta_len: body.len() as u32,
        }
        .write(&mut header);
        let mut wire = header.to_vec();
        wire.extend_from_slice(&body);
        assert_eq!(decode_err(wire, &Limits::default()).code(), ErrorCode::Malformed);
    }
}

/// The widest request a client may send under the limits: the meta bound
/// must hold it exactly, so a node that refuses metas above the bound
/// refuses nothing legal.
#[test]
fn the_request_meta_bound_is_the_widest_legal_request() {
    let limits = Limits { max_batch_keys: 64, max_key_bytes: 300, ..Limits::default() };
    let long_key = |i: usize| {
        let mut k = format!("{i:04}").into_bytes();
        k.resize(300, b'k');
        Bytes::from(k)
    };
    let keys: Vec<Bytes> = (0..64).map(long_key).collect();
    let widest = [
        Request::PutShm { entries: keys.iter().map(|k| ShmPut { key: k.clone(), offset: 1, len: 2, crc: 3 }).collect() },
        Request::GetShm { entries: keys.iter().map(|k| ShmGet { key: k.clone(), offset: 1, capacity: 2 }).collect() },
        Request::MatchPrefix { keys: keys.clone(), lease_ms: 5 },
        Request::RdmaDescribe { keys: keys.clone(), lease_ms: 5 },
        Request::Get { keys: keys.clone() },
        Request::Put { entries: keys.iter().map(|k| PutEntry { key: k.clone(), block: Block::new(Bytes::new()) }).collect() },
    ];
    let mut longest = 0;
    for request in widest {
        let encoded = encode(&Frame::request(1, request)).expect("encodes");
        let header = FrameHeader::parse(encoded.to_vec()[..HEADER_LEN].try_into().unwrap()).unwrap();
        limits.check_request_header(&header).expect("a legal request passes the header check");
        longest = longest.max(header.meta_len as u64);
    }
    assert_eq!(longest, limits.max_request_meta_bytes(), "the bound is the PUT_SHM of the widest keys");
    // One byte more is refused before the body is read.
    let header = FrameHeader {
        version: VERSION,
        opcode: Opcode::Get as u8,
        flags: 0,
        request_id: 9,
        body_len: longest as u32 + 1,
        meta_len: longest as u32 + 1,
    };
    let e = limits.check_request_header(&header).unwrap_err();
    assert!(matches!(e, ProtocolError::MetaTooLarge { declared, limit } if declared == longest + 1 && limit == longest), "{e}");
    assert_eq!(e.code(), ErrorCode::FrameTooLarge);
}
