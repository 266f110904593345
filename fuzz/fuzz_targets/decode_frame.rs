//! Arbitrary bytes through the frame decoder.
//!
//! For every input, under a small set of limits (so the limit checks are hit
//! by short inputs) and under the defaults:
//! * `decode` never panics;
//! * a decoded frame re-encodes, the re-encoding decodes to the same frame,
//!   and encoding is stable from then on (encode ∘ decode ∘ encode = encode);
//! * the incremental path a server uses (`FrameHeader::parse`, then
//!   `decode_body` on the meta alone) never panics and agrees with `decode`
//!   on every outcome: fatal header errors, "need more bytes", per-frame
//!   errors and the decoded message.

#![no_main]

use bytes::Bytes;
use kvplane_protocol::{
    decode, decode_body, encode, DecodeError, Frame, FrameHeader, Limits, Message, Meta, ProtocolError, Request, Response,
    HEADER_LEN,
};
use libfuzzer_sys::fuzz_target;

/// Limits small enough that inputs of a few hundred bytes cross each of them.
const SMALL: Limits = Limits { max_frame_bytes: 1024, max_key_bytes: 16, max_batch_keys: 8, max_lease_ms: 1_000 };

fuzz_target!(|data: &[u8]| {
    let buf = Bytes::copy_from_slice(data);
    check(&buf, &SMALL);
    check(&buf, &Limits::default());
});

fn check(buf: &Bytes, limits: &Limits) {
    let decoded = decode(buf, limits);
    if let Ok(Some((frame, used))) = &decoded {
        assert!(*used >= HEADER_LEN && *used <= buf.len(), "used {used} of {} bytes", buf.len());
        assert!(*used as u64 <= limits.max_frame_bytes as u64, "decoded a {used}-byte frame over the limit {limits:?}");
        roundtrip(frame, limits);
    }
    agree_with_incremental(buf, limits, &decoded);
}

/// decode(encode(frame)) == frame, and the encoding is a fixed point.
fn roundtrip(frame: &Frame, limits: &Limits) {
    let encoded = match encode(frame) {
        Ok(e) => e.to_vec(),
        Err(e) => panic!("a decoded frame does not encode: {e}\nframe: {}", short(frame)),
    };
    let wire = Bytes::from(encoded.clone());
    match decode(&wire, limits) {
        Ok(Some((again, used))) => {
            assert_eq!(used, wire.len(), "re-encoded frame not consumed whole");
            assert!(&again == frame, "re-encoded frame decodes differently\nfirst:  {}\nsecond: {}", short(frame), short(&again));
            let twice = encode(&again).expect("re-decoded frame encodes").to_vec();
            assert_eq!(twice, encoded, "encoding is not stable");
        }
        Ok(None) => panic!("re-encoded frame of {} bytes is incomplete\nframe: {}", wire.len(), short(frame)),
        Err(e) => panic!("re-encoded frame does not decode under {limits:?}: {e}\nframe: {}", short(frame)),
    }
}

/// A frame's `Debug` cut short: keys, payloads and messages run to kilobytes.
fn short(frame: &Frame) -> String {
    let s = format!("{frame:?}");
    match s.char_indices().nth(400) {
        Some((cut, _)) => format!("{}… ({} chars)", &s[..cut], s.chars().count()),
        None => s,
    }
}

/// `FrameHeader::parse` + `decode_body` + payload checks must reach the same
/// verdict as `decode` on the same bytes.
fn agree_with_incremental(buf: &Bytes, limits: &Limits, decoded: &Result<Option<(Frame, usize)>, DecodeError>) {
    if buf.len() < HEADER_LEN {
        assert_eq!(decoded, &Ok(None), "fewer bytes than a header must ask for more");
        return;
    }
    let fixed: [u8; HEADER_LEN] = buf[..HEADER_LEN].try_into().expect("24 bytes");
    let header = match FrameHeader::parse(&fixed) {
        Ok(h) => h,
        Err(error) => {
            assert_eq!(decoded, &Err(DecodeError { error, request_id: None, fatal: true }), "header error not fatal");
            return;
        }
    };
    // The header carries every field it parsed.
    let mut rewritten = [0u8; HEADER_LEN];
    header.write(&mut rewritten);
    assert_eq!(rewritten, fixed, "header does not rewrite to its own bytes");
    assert!(header.meta_len <= header.body_len);
    assert_eq!(header.payload_len() as u64 + header.meta_len as u64, header.body_len as u64);

    // What a server does once the header is in: read the meta and decode it,
    // whatever the frame size (it checks the size first, but decode_body
    // must be safe on its own).
    let meta_end = HEADER_LEN + header.meta_len as usize;
    let body = (buf.len() >= meta_end).then(|| decode_body(&header, buf.slice(HEADER_LEN..meta_end), limits));
    if let Some(Ok(meta)) = &body {
        let declared: u64 = match meta {
            Meta::Complete(_) => 0,
            Meta::Put(slots) => slots.iter().map(|s| s.len as u64).sum(),
            Meta::Get(slots) => slots.iter().flatten().map(|s| s.len as u64).sum(),
        };
        assert_eq!(declared, header.payload_len() as u64, "meta accepted with payload lengths that do not add up");
    }

    if header.frame_len() > limits.max_frame_bytes as u64 {
        let error = ProtocolError::FrameTooLarge { declared: header.frame_len(), limit: limits.max_frame_bytes as u64 };
        assert_eq!(decoded, &Err(DecodeError { error, request_id: Some(header.request_id), fatal: true }));
        return;
    }
    if (buf.len() as u64) < header.frame_len() {
        assert_eq!(decoded, &Ok(None), "a frame not yet buffered must ask for more");
        return;
    }
    let meta = match body.expect("the whole frame, so the whole meta, is buffered") {
        Ok(meta) => meta,
        Err(error) => {
            assert_eq!(decoded, &Err(DecodeError { error, request_id: Some(header.request_id), fatal: false }));
            return;
        }
    };
    match (meta, decoded) {
        (Meta::Complete(message), Ok(Some((frame, used)))) => {
            assert_eq!(frame.message, message);
            assert_eq!(frame.request_id, header.request_id);
            assert_eq!(*used as u64, header.frame_len());
        }
        (Meta::Put(slots), Ok(Some((frame, _)))) => match &frame.message {
            Message::Request(Request::Put { entries }) => {
                assert_eq!(entries.len(), slots.len());
                for (e, s) in entries.iter().zip(&slots) {
                    assert_eq!((&e.key, e.block.data.len() as u64, e.block.crc), (&s.key, s.len as u64, s.crc));
                    assert!(e.block.verify());
                }
            }
            other => panic!("PUT meta decoded as {other:?}"),
        },
        (Meta::Get(slots), Ok(Some((frame, _)))) => match &frame.message {
            Message::Response(Response::Get { results }) => {
                assert_eq!(results.len(), slots.len());
                for (r, s) in results.iter().zip(&slots) {
                    match (r, s) {
                        (Ok(b), Ok(s)) => {
                            assert_eq!((b.data.len() as u64, b.crc), (s.len as u64, s.crc));
                            assert!(b.verify());
                        }
                        (Err(a), Err(b)) => assert_eq!(a, b),
                        (r, s) => panic!("GET answer {r:?} for slot {s:?}"),
                    }
                }
            }
            other => panic!("GET_RESULT meta decoded as {other:?}"),
        },
        // Payload-carrying frames fail as a whole on a payload checksum.
        (Meta::Put(_) | Meta::Get(_), Err(DecodeError { error: ProtocolError::BadChecksum { .. }, request_id, fatal: false }))
            if *request_id == Some(header.request_id) => {}
        (meta, decoded) => panic!("decode_body gave {meta:?} but decode gave {decoded:?}"),
    }
}
