//! The TLS 1.3 record layer after the handshake (RFC 8446 section 5), over
//! the traffic keys rustls hands over (`dangerous_into_kernel_connection`,
//! the interface kernel-TLS integrations use).
//!
//! **Why our own.** rustls 0.23 seals each record into a vector of its own
//! and hands each opened record over in one too, so every byte is copied
//! twice on each end besides the AEAD pass. Here a record is sealed
//! straight from the caller's plaintext into the send buffer, and opened
//! straight from the receive buffer into the caller's buffer whenever it
//! has room for the whole record: with aws-lc-rs one pass over each byte
//! per end (the AEAD's, out of place), with ring a copy and the AEAD's pass
//! in place (below), besides the kernel's copy.
//!
//! **Whose AES-GCM.** Both aws-lc-rs and ring are in the process (rustls's
//! provider is aws-lc-rs; the rest of the process's TLS uses ring), and
//! neither is the faster everywhere: on a CPU with AVX-512 and VAES,
//! aws-lc's AVX-512 AES-GCM was about three times ring's; on one with VAES
//! and AVX2 alone (AMD EPYC, the CI kind of 3 Dec 2026) ring's VAES/AVX2
//! code sealed 16 KiB records at 6.1-7.3 GB/s against aws-lc's 3.8 (aws-lc
//! falls back to its AES-NI code there; see docs/security.md, "Cost").
//! [`Backend::for_this_cpu`] picks by those features; on a CPU with
//! neither both run the same AES-NI code, and aws-lc-rs is kept (it saves
//! ring's copy, below). aws-lc-rs opens and seals out of
//! place (the AEAD's pass is the copy); ring works in place, so with it a
//! record's bytes are copied into place first. That copy takes over the
//! cache misses the AEAD met before (a GET answer's blocks are cold in the
//! pool), and ring still comes out 1.15-1.44x faster on such a CPU.
//!
//! **What stays with rustls.** The handshake, certificates, and the key
//! schedule: a key update (ours, before a key's confidentiality limit, or
//! the peer's) asks rustls's `KernelConnection` for the next traffic
//! secret, and session tickets a server sends after the handshake go to it
//! too. Only TLS 1.3 is spoken here (the configs of both ends allow no
//! other version), with the three AEADs TLS 1.3 defines.

use aws_lc_rs::aead as lc;
use ring::aead as rg;
use rustls::{AlertDescription, ConnectionTrafficSecrets, PeerMisbehaved};

/// TLS content types (RFC 8446 5.1).
pub(crate) const ALERT: u8 = 21;
pub(crate) const HANDSHAKE: u8 = 22;
pub(crate) const APPLICATION_DATA: u8 = 23;

/// Handshake message types a peer may send after the handshake (RFC 8446 4.6).
pub(crate) const NEW_SESSION_TICKET: u8 = 4;
pub(crate) const KEY_UPDATE: u8 = 24;

/// The record header: content type, legacy version, length (RFC 8446 5.1).
pub(crate) const HEADER_BYTES: usize = 5;
/// Most plaintext one record carries.
pub(crate) const MAX_FRAGMENT_BYTES: usize = 1 << 14;
/// The AEAD tag of every TLS 1.3 suite.
const TAG_BYTES: usize = 16;
/// Most protected bytes after a header: the fragment, its content type,
/// padding and the tag (RFC 8446 5.2: 2^14 + 256).
const MAX_PROTECTED_BYTES: usize = (1 << 14) + 256;
const LEGACY_VERSION: [u8; 2] = [0x03, 0x03];

/// Which library's AEAD a [`RecordKey`] runs on (see the module
/// documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Backend {
    AwsLc,
    Ring,
}

impl Backend {
    /// ring where its VAES/AVX2 AES-GCM runs and aws-lc's AVX-512 code does
    /// not (VAES, VPCLMULQDQ and AVX2 without AVX-512); aws-lc-rs
    /// everywhere else: with AVX-512, and on CPUs where both would run the
    /// same AES-NI code, which aws-lc-rs runs out of place, without ring's
    /// copy.
    pub(crate) fn for_this_cpu() -> Backend {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let vaes = has!("vaes") && has!("vpclmulqdq");
            let avx512 = has!("avx512f") && has!("avx512vl") && has!("avx512bw");
            if vaes && has!("avx2") && !avx512 {
                return Backend::Ring;
            }
        }
        Backend::AwsLc
    }
}

/// The AEADs of TLS 1.3's suites.
#[derive(Clone, Copy, Debug)]
enum Suite {
    Aes128Gcm,
    Aes256Gcm,
    Chacha20Poly1305,
}

enum Aead {
    AwsLc(lc::LessSafeKey),
    /// Boxed: ring's key schedule is held inline (over 500 bytes).
    Ring(Box<rg::LessSafeKey>),
}

/// One direction's traffic key and its record sequence number, which the
/// per-record nonce is made of (RFC 8446 5.3).
pub(crate) struct RecordKey {
    aead: Aead,
    iv: [u8; 12],
    seq: u64,
}

impl RecordKey {
    /// The key of `secrets` on this CPU's [`Backend`].
    pub(crate) fn new(secrets: ConnectionTrafficSecrets, seq: u64) -> Result<RecordKey, rustls::Error> {
        let (suite, key, iv) = match &secrets {
            ConnectionTrafficSecrets::Aes128Gcm { key, iv } => (Suite::Aes128Gcm, key.as_ref(), iv.as_ref()),
            ConnectionTrafficSecrets::Aes256Gcm { key, iv } => (Suite::Aes256Gcm, key.as_ref(), iv.as_ref()),
            ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => (Suite::Chacha20Poly1305, key.as_ref(), iv.as_ref()),
            _ => return Err(rustls::Error::General("the negotiated TLS suite has no record layer here".into())),
        };
        RecordKey::with_key(Backend::for_this_cpu(), suite, key, iv, seq)
    }

    fn with_key(backend: Backend, suite: Suite, key: &[u8], iv: &[u8], seq: u64) -> Result<RecordKey, rustls::Error> {
        let aead = match backend {
            Backend::AwsLc => {
                let algorithm = match suite {
                    Suite::Aes128Gcm => &lc::AES_128_GCM,
                    Suite::Aes256Gcm => &lc::AES_256_GCM,
                    Suite::Chacha20Poly1305 => &lc::CHACHA20_POLY1305,
                };
                lc::UnboundKey::new(algorithm, key).ok().map(|k| Aead::AwsLc(lc::LessSafeKey::new(k)))
            }
            Backend::Ring => {
                let algorithm = match suite {
                    Suite::Aes128Gcm => &rg::AES_128_GCM,
                    Suite::Aes256Gcm => &rg::AES_256_GCM,
                    Suite::Chacha20Poly1305 => &rg::CHACHA20_POLY1305,
                };
                rg::UnboundKey::new(algorithm, key).ok().map(|k| Aead::Ring(Box::new(rg::LessSafeKey::new(k))))
            }
        }
        .ok_or_else(|| rustls::Error::General("a TLS traffic key of the wrong length".into()))?;
        let iv: [u8; 12] = iv.try_into().map_err(|_| rustls::Error::General("a TLS traffic IV of the wrong length".into()))?;
        Ok(RecordKey { aead, iv, seq })
    }

    /// The next record's nonce: the IV with the sequence number XORed into
    /// its last 8 bytes. A sequence number is never used twice: at its
    /// last value the key refuses (`exhausted`).
    fn next_nonce(&mut self, exhausted: rustls::Error) -> Result<[u8; 12], rustls::Error> {
        if self.seq == u64::MAX {
            return Err(exhausted);
        }
        let mut nonce = self.iv;
        for (n, s) in nonce[4..].iter_mut().zip(self.seq.to_be_bytes()) {
            *n ^= s;
        }
        self.seq += 1;
        Ok(nonce)
    }

    /// Records protected with this key so far.
    pub(crate) fn seq(&self) -> u64 {
        self.seq
    }
}

fn header(content_len: usize) -> [u8; HEADER_BYTES] {
    let [hi, lo] = (content_len as u16).to_be_bytes();
    [APPLICATION_DATA, LEGACY_VERSION[0], LEGACY_VERSION[1], hi, lo]
}

/// Seals one record of `content_type` carrying `fragment` (at most
/// [`MAX_FRAGMENT_BYTES`] from the writer) into `out`, which must be exactly
/// [`sealed_len`]`(fragment.len())` bytes.
pub(crate) fn seal(key: &mut RecordKey, content_type: u8, fragment: &[u8], out: &mut [u8]) -> Result<(), rustls::Error> {
    debug_assert!(fragment.len() + 1 + TAG_BYTES <= MAX_PROTECTED_BYTES);
    debug_assert_eq!(out.len(), sealed_len(fragment.len()));
    let head = header(fragment.len() + 1 + TAG_BYTES);
    let nonce = key.next_nonce(rustls::Error::EncryptError)?;
    let (h, rest) = out.split_at_mut(HEADER_BYTES);
    h.copy_from_slice(&head);
    match &key.aead {
        Aead::AwsLc(k) => {
            let (body, extra_and_tag) = rest.split_at_mut(fragment.len());
            k.seal_out_of_place_scatter(
                lc::Nonce::assume_unique_for_key(nonce),
                lc::Aad::from(head),
                fragment,
                body,
                &[content_type],
                extra_and_tag,
            )
            .map_err(|_| rustls::Error::EncryptError)
        }
        Aead::Ring(k) => {
            let (inner, tag) = rest.split_at_mut(fragment.len() + 1);
            inner[..fragment.len()].copy_from_slice(fragment);
            inner[fragment.len()] = content_type;
            let sealed = k
                .seal_in_place_separate_tag(rg::Nonce::assume_unique_for_key(nonce), rg::Aad::from(head), inner)
                .map_err(|_| rustls::Error::EncryptError)?;
            tag.copy_from_slice(sealed.as_ref());
            Ok(())
        }
    }
}

/// Bytes on the wire of a record carrying `fragment_len` bytes.
pub(crate) const fn sealed_len(fragment_len: usize) -> usize {
    HEADER_BYTES + fragment_len + 1 + TAG_BYTES
}

/// The length of the first record of `received` (header included) when
/// all of it has arrived, `None` while it has not.
pub(crate) fn whole_record(received: &[u8]) -> Result<Option<usize>, rustls::Error> {
    let Some(head) = received.get(..HEADER_BYTES) else { return Ok(None) };
    let len = u16::from_be_bytes([head[3], head[4]]) as usize;
    if head[0] != APPLICATION_DATA {
        // After the handshake every TLS 1.3 record is protected and says
        // application data outside; a change_cipher_spec is allowed only
        // during the handshake.
        return Err(match head[0] {
            20 => rustls::Error::PeerMisbehaved(PeerMisbehaved::IllegalMiddleboxChangeCipherSpec),
            other => rustls::Error::General(format!("a TLS record of outer content type {other} after the handshake")),
        });
    }
    if len > MAX_PROTECTED_BYTES {
        return Err(rustls::Error::PeerSentOversizedRecord);
    }
    if len <= TAG_BYTES {
        // Not even a content type under the tag.
        return Err(rustls::Error::DecryptError);
    }
    Ok((received.len() >= HEADER_BYTES + len).then_some(HEADER_BYTES + len))
}

/// Room a record needs to be opened into: its protected bytes less the tag
/// (the content, its content type and any padding).
pub(crate) fn opened_len(record_len: usize) -> usize {
    record_len - HEADER_BYTES - TAG_BYTES
}

/// Opens `record` (one whole record, header included, as
/// [`whole_record`] measured it) into `out` of [`opened_len`] bytes. On
/// success: the content type and the content's length (the start of
/// `out`); on a failed tag `out` holds nothing meaningful and the caller
/// must not deliver any of it.
pub(crate) fn open_into(key: &mut RecordKey, record: &[u8], out: &mut [u8]) -> Result<(u8, usize), rustls::Error> {
    let (head, protected) = record.split_at(HEADER_BYTES);
    let (ciphertext, tag) = protected.split_at(protected.len() - TAG_BYTES);
    let nonce = key.next_nonce(rustls::Error::DecryptError)?;
    match &key.aead {
        Aead::AwsLc(k) => k
            .open_separate_gather(lc::Nonce::assume_unique_for_key(nonce), lc::Aad::from(head), ciphertext, tag, out)
            .map_err(|_| rustls::Error::DecryptError)?,
        Aead::Ring(k) => {
            out.copy_from_slice(ciphertext);
            let tag = rg::Tag::try_from(tag).map_err(|_| rustls::Error::DecryptError)?;
            k.open_in_place_separate_tag(rg::Nonce::assume_unique_for_key(nonce), rg::Aad::from(head), tag, out, 0..)
                .map_err(|_| rustls::Error::DecryptError)?;
        }
    }
    inner_type(out)
}

/// Opens `record` in place; its content type and where its content is in
/// `record`.
pub(crate) fn open_in_place(key: &mut RecordKey, record: &mut [u8]) -> Result<(u8, std::ops::Range<usize>), rustls::Error> {
    let (head, protected) = record.split_at_mut(HEADER_BYTES);
    let head: [u8; HEADER_BYTES] = (&*head).try_into().expect("a header is 5 bytes");
    let nonce = key.next_nonce(rustls::Error::DecryptError)?;
    let opened = match &key.aead {
        Aead::AwsLc(k) => k.open_in_place(lc::Nonce::assume_unique_for_key(nonce), lc::Aad::from(head), protected).ok(),
        Aead::Ring(k) => k.open_in_place(rg::Nonce::assume_unique_for_key(nonce), rg::Aad::from(head), protected).ok(),
    }
    .ok_or(rustls::Error::DecryptError)?;
    let (content_type, len) = inner_type(opened)?;
    Ok((content_type, HEADER_BYTES..HEADER_BYTES + len))
}

/// The inner plaintext's content type and content length: the last
/// non-zero byte is the type, the zeros after it padding (RFC 8446 5.4).
fn inner_type(opened: &[u8]) -> Result<(u8, usize), rustls::Error> {
    // The inner plaintext, padding included, is at most a fragment and its
    // content type (RFC 8446 5.4).
    if opened.len() > MAX_FRAGMENT_BYTES + 1 {
        return Err(rustls::Error::PeerSentOversizedRecord);
    }
    let Some(at) = opened.iter().rposition(|b| *b != 0) else {
        return Err(rustls::Error::PeerMisbehaved(PeerMisbehaved::IllegalTlsInnerPlaintext));
    };
    Ok((opened[at], at))
}

/// What an alert record says: `Ok(())` for close_notify, the alert as an
/// error otherwise.
pub(crate) fn alert(content: &[u8]) -> Result<(), rustls::Error> {
    match content {
        [_, 0] => Ok(()),
        [_, description] => Err(rustls::Error::AlertReceived(AlertDescription::from(*description))),
        _ => Err(rustls::Error::General(format!("a malformed TLS alert of {} bytes", content.len()))),
    }
}

/// The close_notify alert's content (RFC 8446 6.1: its level is ignored).
pub(crate) const CLOSE_NOTIFY: [u8; 2] = [1, 0];

/// A KeyUpdate handshake message that asks the peer for nothing in return
/// (RFC 8446 4.6.3: `update_not_requested`).
pub(crate) const KEY_UPDATE_NOT_REQUESTED: [u8; 5] = [KEY_UPDATE, 0, 0, 1, 0];

/// A post-handshake message from the peer.
pub(crate) enum PostHandshake<'a> {
    /// The peer's next records use its next key; `requested`: it asks for
    /// ours to change too.
    KeyUpdate { requested: bool },
    /// A session ticket (the body of the message) for the client.
    Ticket(&'a [u8]),
}

/// The handshake messages of one record, in order. A KeyUpdate must end
/// its record (RFC 8446 5.1: handshake messages never span a key change);
/// a message split over records is refused (none that may come after a
/// handshake is anywhere near a record's size).
pub(crate) fn post_handshake(mut content: &[u8]) -> Result<Vec<PostHandshake<'_>>, rustls::Error> {
    if content.is_empty() {
        // RFC 8446 5.1: never a zero-length handshake fragment.
        return Err(rustls::Error::General("an empty TLS handshake record".into()));
    }
    let mut messages = Vec::new();
    while !content.is_empty() {
        let &[kind, a, b, c, ref rest @ ..] = content else {
            return Err(rustls::Error::General("a post-handshake message split over TLS records".into()));
        };
        let len = u32::from_be_bytes([0, a, b, c]) as usize;
        if rest.len() < len {
            return Err(rustls::Error::General("a post-handshake message split over TLS records".into()));
        }
        let (body, after) = rest.split_at(len);
        content = after;
        match (kind, body) {
            (KEY_UPDATE, [requested @ (0 | 1)]) => {
                if !content.is_empty() {
                    return Err(rustls::Error::PeerMisbehaved(PeerMisbehaved::KeyEpochWithPendingFragment));
                }
                messages.push(PostHandshake::KeyUpdate { requested: *requested == 1 });
            }
            (KEY_UPDATE, _) => return Err(rustls::Error::General("a malformed TLS KeyUpdate".into())),
            (NEW_SESSION_TICKET, body) => messages.push(PostHandshake::Ticket(body)),
            (kind, _) => return Err(rustls::Error::General(format!("a TLS handshake message of type {kind} after the handshake"))),
        }
    }
    Ok(messages)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(seq: u64) -> RecordKey {
        let secrets = ConnectionTrafficSecrets::Aes256Gcm { key: [7u8; 32].into(), iv: [9u8; 12].into() };
        RecordKey::new(secrets, seq).unwrap()
    }

    /// Each suite with a key and an IV, the same bytes for either backend.
    const SUITES: [(Suite, &[u8], [u8; 12]); 3] =
        [(Suite::Aes128Gcm, &[3; 16], [4; 12]), (Suite::Aes256Gcm, &[7; 32], [9; 12]), (Suite::Chacha20Poly1305, &[5; 32], [6; 12])];

    /// The two backends make the same records: each opens what the other
    /// sealed (into a buffer and in place), whatever the suite and the
    /// fragment's length, and both refuse a record with a changed byte.
    #[test]
    fn records_sealed_by_either_backend_open_with_the_other_and_a_changed_byte_fails_both() {
        let backends = [Backend::AwsLc, Backend::Ring];
        for (suite, key, iv) in SUITES {
            let secrets = |b| RecordKey::with_key(b, suite, key, &iv, 41).unwrap();
            for len in [0, 1, 15, 16, 17, 1000, MAX_FRAGMENT_BYTES] {
                let fragment: Vec<u8> = (0..len).map(|i| (i * 7 + 1) as u8).collect();
                let sealed: Vec<Vec<u8>> = backends
                    .iter()
                    .map(|&b| {
                        let mut record = vec![0u8; sealed_len(len)];
                        seal(&mut secrets(b), APPLICATION_DATA, &fragment, &mut record).unwrap();
                        record
                    })
                    .collect();
                assert_eq!(sealed[0], sealed[1], "{suite:?}, {len} bytes: the backends sealed different records");
                for &b in &backends {
                    let mut out = vec![0u8; opened_len(sealed[0].len())];
                    let opened = open_into(&mut secrets(b), &sealed[0], &mut out);
                    assert_eq!(opened, Ok((APPLICATION_DATA, len)), "{suite:?}, {len} bytes, opened with {b:?}");
                    assert_eq!(&out[..len], &fragment[..]);
                    let mut in_place = sealed[0].clone();
                    let (kind, at) = open_in_place(&mut secrets(b), &mut in_place).unwrap();
                    assert_eq!((kind, &in_place[at]), (APPLICATION_DATA, &fragment[..]), "{suite:?}, {len} bytes, in place with {b:?}");
                    let mut bad = sealed[0].clone();
                    let last = bad.len() - 1;
                    bad[last] ^= 0x80;
                    let refused = open_into(&mut secrets(b), &bad, &mut out);
                    assert_eq!(refused, Err(rustls::Error::DecryptError), "{suite:?}, {len} bytes: {b:?} opened a changed tag");
                    let mut bad = sealed[0].clone();
                    bad[HEADER_BYTES] ^= 1;
                    assert_eq!(open_in_place(&mut secrets(b), &mut bad).map(|_| ()), Err(rustls::Error::DecryptError));
                }
            }
        }
    }

    #[test]
    fn a_sealed_record_opens_both_ways_and_a_changed_byte_or_sequence_number_fails_it() {
        let fragment: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
        let mut record = vec![0u8; sealed_len(fragment.len())];
        seal(&mut key(5), APPLICATION_DATA, &fragment, &mut record).unwrap();
        assert_eq!(whole_record(&record).unwrap(), Some(record.len()));
        assert_eq!(whole_record(&record[..record.len() - 1]).unwrap(), None);

        let mut out = vec![0u8; opened_len(record.len())];
        assert_eq!(open_into(&mut key(5), &record, &mut out).unwrap(), (APPLICATION_DATA, fragment.len()));
        assert_eq!(&out[..fragment.len()], &fragment[..]);
        let mut in_place = record.clone();
        let (kind, at) = open_in_place(&mut key(5), &mut in_place).unwrap();
        assert_eq!((kind, &in_place[at]), (APPLICATION_DATA, &fragment[..]));

        // Another sequence number is another nonce.
        assert_eq!(open_into(&mut key(6), &record, &mut out), Err(rustls::Error::DecryptError));
        for at in [0, 3, HEADER_BYTES, record.len() / 2, record.len() - 1] {
            let mut bad = record.clone();
            bad[at] ^= 1;
            let opened = whole_record(&bad).and_then(|_| open_into(&mut key(5), &bad, &mut out));
            assert!(opened.is_err(), "byte {at} changed and the record still opened");
        }
    }

    #[test]
    fn a_record_of_padding_alone_or_too_long_is_refused() {
        let mut record = vec![0u8; sealed_len(0)];
        // Content type 0: all of it padding.
        seal(&mut key(0), 0, &[], &mut record).unwrap();
        let mut out = vec![0u8; opened_len(record.len())];
        assert_eq!(open_into(&mut key(0), &record, &mut out), Err(rustls::Error::PeerMisbehaved(PeerMisbehaved::IllegalTlsInnerPlaintext)));
        // A whole fragment with padding past it.
        let mut padded = vec![1u8; MAX_FRAGMENT_BYTES];
        padded.extend_from_slice(&[APPLICATION_DATA, 0]);
        let mut record = vec![0u8; sealed_len(padded.len() - 1)];
        seal(&mut key(0), 0, &padded[..padded.len() - 1], &mut record).unwrap();
        let mut out = vec![0u8; opened_len(record.len())];
        assert_eq!(open_into(&mut key(0), &record, &mut out), Err(rustls::Error::PeerSentOversizedRecord));
        let mut long = header(MAX_PROTECTED_BYTES + 1).to_vec();
        long.resize(HEADER_BYTES + MAX_PROTECTED_BYTES + 1, 0);
        assert_eq!(whole_record(&long), Err(rustls::Error::PeerSentOversizedRecord));
    }

    #[test]
    fn post_handshake_messages_are_read_in_order_and_a_key_update_ends_its_record() {
        let mut content = vec![NEW_SESSION_TICKET, 0, 0, 2, 0xaa, 0xbb];
        content.extend_from_slice(&[KEY_UPDATE, 0, 0, 1, 1]);
        let read = post_handshake(&content).unwrap();
        assert!(matches!(read[..], [PostHandshake::Ticket([0xaa, 0xbb]), PostHandshake::KeyUpdate { requested: true }]));
        content.extend_from_slice(&[NEW_SESSION_TICKET, 0, 0, 0]);
        assert!(post_handshake(&content).is_err(), "a message after a KeyUpdate in its record");
        assert!(post_handshake(&[KEY_UPDATE, 0, 0, 1, 2]).is_err());
        assert!(post_handshake(&[NEW_SESSION_TICKET, 0, 0, 9, 1]).is_err(), "split over records");
        assert!(post_handshake(&[]).is_err(), "an empty handshake record");
    }
}
