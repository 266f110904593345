//! What a remote reader needs for one one-sided RDMA READ of one block, and
//! its wire form.
//!
//! Why a descriptor at all: a one-sided READ involves no code on the node
//! while it runs, so everything the reader's NIC needs (where the node's
//! queue pair is, which address, which key, how many bytes) has to be handed
//! over beforehand, over the ordinary connection. And because nothing on
//! the node sees the READ, the node cannot say "that block is gone" at read
//! time: the descriptor carries the end of the lease under which the node
//! keeps the block pinned, and a reader must not use it after that, and the
//! CRC-32C of the bytes so that the reader can tell a torn or stale read
//! from the block it asked for.
//!
//! Why a hand-written binary form: it is 68 bytes at fixed offsets, so it
//! is cheap to produce for every GET and easy to check field by field; a
//! version byte lets a later layout be refused clearly by an older reader,
//! and a CRC-32C over the descriptor itself catches corruption in transit
//! that would otherwise send a READ to a wrong address or key.
//!
//! Why in the protocol crate: `RDMA_DESCRIBE_RESULT` carries descriptors, so
//! the codec and its fuzz targets need this form and nothing of RDMA itself;
//! kvplane-rdma (the lease table, the choice of path, the verbs side) builds
//! on it.
//!
//! Times are milliseconds on a clock the caller chooses (the node's and the
//! client's clocks must agree for this to mean anything, which is why a
//! lease is short and the reader keeps a margin); nothing here reads a clock,
//! so tests inject time.

use std::fmt;

/// The first four bytes of every encoded descriptor.
pub const MAGIC: [u8; 4] = *b"KVRD";
/// The layout [`Descriptor::encode`] writes and [`Descriptor::decode`] reads.
pub const VERSION: u8 = 1;
/// Length of an encoded descriptor of [`VERSION`] 1, in bytes.
pub const ENCODED_LEN: usize = 68;
/// The largest block one descriptor may describe: one RDMA message is at
/// most 2^31 bytes.
pub const MAX_LEN: u32 = 1 << 31;
/// Queue pair numbers are 24 bits wide.
pub const MAX_QP_NUM: u32 = (1 << 24) - 1;

/// A 128-bit RDMA global identifier (GID), as the port's GID table holds it
/// (network byte order). For RoCE it carries the IP address; on InfiniBand
/// the subnet prefix and the port GUID.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, pair) in self.0.chunks(2).enumerate() {
            if i > 0 {
                f.write_str(":")?;
            }
            write!(f, "{:02x}{:02x}", pair[0], pair[1])?;
        }
        Ok(())
    }
}

/// Everything a remote reader needs to READ one pinned block of the node's
/// pool, and until when it may.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Descriptor {
    /// GID of the node's port (RoCE, or routed InfiniBand).
    pub gid: Gid,
    /// LID of the node's port (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// The node's queue pair the reader's queue pair is connected to (24 bits).
    pub qp_num: u32,
    /// Virtual address of the block in the node's registered region.
    pub addr: u64,
    /// Remote key of the memory region that holds the block.
    pub rkey: u32,
    /// Length of the block in bytes (1 ..= [`MAX_LEN`]).
    pub len: u32,
    /// CRC-32C (Castagnoli) of the block's bytes.
    pub crc32c: u32,
    /// The node's lease on the block; the reader may hand it back early.
    pub lease: u64,
    /// End of the lease, in milliseconds on the caller's clock: the block
    /// stays pinned while `now < expires_at_ms`, and not a moment longer.
    pub expires_at_ms: u64,
}

/// Why bytes are not a descriptor. Every variant names the field at fault.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The input ended inside `field`.
    #[error("descriptor truncated in field `{field}`: {have} bytes, need {need}")]
    Truncated { field: &'static str, have: usize, need: usize },
    /// The first four bytes are not [`MAGIC`].
    #[error("field `magic`: {found:02x?} is not a kvplane RDMA descriptor")]
    BadMagic { found: [u8; 4] },
    /// A layout this build does not know.
    #[error("field `version`: descriptor version {found} is not supported (this build reads version {VERSION})")]
    UnsupportedVersion { found: u8 },
    /// A field holds a value no valid descriptor has.
    #[error("field `{field}`: {reason}")]
    Invalid { field: &'static str, reason: String },
    /// The descriptor's own checksum does not match its bytes.
    #[error("field `check`: descriptor checksum {found:#010x}, its bytes give {computed:#010x} (corrupted in transit)")]
    Checksum { found: u32, computed: u32 },
    /// Bytes after a complete descriptor.
    #[error("{extra} trailing bytes after the descriptor's last field `check`")]
    Trailing { extra: usize },
}

/// Why a descriptor may not be used, or what it fetched is not the block.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum UseError {
    /// The lease ended: the node may have reused the memory.
    #[error("lease {lease} expired at {expires_at_ms} ms (now {now_ms} ms)")]
    Expired { lease: u64, expires_at_ms: u64, now_ms: u64 },
    /// The destination is not the block's length.
    #[error("destination holds {have} bytes, the block is {want}")]
    Length { have: usize, want: u32 },
    /// The bytes read are not the block the descriptor describes.
    #[error("block CRC-32C mismatch: descriptor says {want:#010x}, bytes read give {got:#010x}")]
    Checksum { want: u32, got: u32 },
}

/// Sequential reader over the input that names the field it is reading.
struct Fields<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Fields<'a> {
    fn take<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], DecodeError> {
        let rest = &self.bytes[self.at..];
        match rest.get(..N) {
            Some(b) => {
                self.at += N;
                let mut out = [0u8; N];
                out.copy_from_slice(b);
                Ok(out)
            }
            None => Err(DecodeError::Truncated { field, have: rest.len(), need: N }),
        }
    }
    fn u8(&mut self, field: &'static str) -> Result<u8, DecodeError> {
        Ok(self.take::<1>(field)?[0])
    }
    fn u16(&mut self, field: &'static str) -> Result<u16, DecodeError> {
        Ok(u16::from_be_bytes(self.take(field)?))
    }
    fn u32(&mut self, field: &'static str) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.take(field)?))
    }
    fn u64(&mut self, field: &'static str) -> Result<u64, DecodeError> {
        Ok(u64::from_be_bytes(self.take(field)?))
    }
}

fn invalid(field: &'static str, reason: impl Into<String>) -> DecodeError {
    DecodeError::Invalid { field, reason: reason.into() }
}

impl Descriptor {
    /// Checks the fields against what any valid descriptor satisfies; the
    /// error names the first field at fault. [`Descriptor::encode`] and
    /// [`Descriptor::decode`] both apply it.
    pub fn validate(&self) -> Result<(), DecodeError> {
        if self.qp_num > MAX_QP_NUM {
            return Err(invalid("qp_num", format!("{:#x} is wider than 24 bits", self.qp_num)));
        }
        if self.addr == 0 {
            return Err(invalid("addr", "address 0 is never a registered block"));
        }
        if self.len == 0 {
            return Err(invalid("len", "a block of 0 bytes is not worth a READ"));
        }
        if self.len > MAX_LEN {
            return Err(invalid("len", format!("{} bytes is more than one RDMA message ({MAX_LEN})", self.len)));
        }
        if self.addr.checked_add(u64::from(self.len)).is_none() {
            return Err(invalid("len", format!("{:#x} + {} runs past the end of the address space", self.addr, self.len)));
        }
        if self.expires_at_ms == 0 {
            return Err(invalid("expires_at_ms", "a lease that ended at time 0"));
        }
        Ok(())
    }

    /// The wire form: [`ENCODED_LEN`] bytes, big-endian, in this order:
    /// magic (4), version (1), flags (1, zero), lid (2), gid (16), qp_num (4),
    /// addr (8), rkey (4), len (4), crc32c (4), lease (8), expires_at_ms (8),
    /// check (4: CRC-32C of everything before it).
    ///
    /// Refuses a descriptor that [`Descriptor::validate`] refuses, so that
    /// nothing is sent that no reader would accept.
    pub fn encode(&self) -> Result<[u8; ENCODED_LEN], DecodeError> {
        self.validate()?;
        Ok(self.encode_unchecked())
    }

    /// The wire form of whatever the fields hold (tests use it to play a
    /// peer that does not validate).
    fn encode_unchecked(&self) -> [u8; ENCODED_LEN] {
        let mut out = [0u8; ENCODED_LEN];
        let mut at = 0;
        let mut put = |b: &[u8]| {
            out[at..at + b.len()].copy_from_slice(b);
            at += b.len();
        };
        put(&MAGIC);
        put(&[VERSION, 0]);
        put(&self.lid.to_be_bytes());
        put(&self.gid.0);
        put(&self.qp_num.to_be_bytes());
        put(&self.addr.to_be_bytes());
        put(&self.rkey.to_be_bytes());
        put(&self.len.to_be_bytes());
        put(&self.crc32c.to_be_bytes());
        put(&self.lease.to_be_bytes());
        put(&self.expires_at_ms.to_be_bytes());
        let check = crc32c::crc32c(&out[..ENCODED_LEN - 4]);
        out[ENCODED_LEN - 4..].copy_from_slice(&check.to_be_bytes());
        out
    }

    /// Parses exactly one descriptor. Never panics, whatever the input;
    /// refuses truncated input, another magic or version, nonzero flags, a
    /// checksum that does not match, invalid fields and trailing bytes, each
    /// with an error that names the field.
    pub fn decode(bytes: &[u8]) -> Result<Descriptor, DecodeError> {
        let mut f = Fields { bytes, at: 0 };
        let magic = f.take::<4>("magic")?;
        if magic != MAGIC {
            return Err(DecodeError::BadMagic { found: magic });
        }
        let version = f.u8("version")?;
        if version != VERSION {
            return Err(DecodeError::UnsupportedVersion { found: version });
        }
        let flags = f.u8("flags")?;
        if flags != 0 {
            return Err(invalid("flags", format!("{flags:#04x}: version {VERSION} defines no flags")));
        }
        let lid = f.u16("lid")?;
        let gid = Gid(f.take::<16>("gid")?);
        let qp_num = f.u32("qp_num")?;
        let addr = f.u64("addr")?;
        let rkey = f.u32("rkey")?;
        let len = f.u32("len")?;
        let crc32c = f.u32("crc32c")?;
        let lease = f.u64("lease")?;
        let expires_at_ms = f.u64("expires_at_ms")?;
        let body = f.at;
        let check = f.u32("check")?;
        let computed = crc32c::crc32c(&bytes[..body]);
        if check != computed {
            return Err(DecodeError::Checksum { found: check, computed });
        }
        if f.at != bytes.len() {
            return Err(DecodeError::Trailing { extra: bytes.len() - f.at });
        }
        let d = Descriptor { gid, lid, qp_num, addr, rkey, len, crc32c, lease, expires_at_ms };
        d.validate()?;
        Ok(d)
    }

    /// Whether the lease still holds at `now_ms`: usable strictly before
    /// its expiry.
    pub fn usable_at(&self, now_ms: u64) -> bool {
        now_ms < self.expires_at_ms
    }

    /// [`Descriptor::usable_at`] as an error a caller can report.
    pub fn check_usable(&self, now_ms: u64) -> Result<(), UseError> {
        if self.usable_at(now_ms) {
            Ok(())
        } else {
            Err(UseError::Expired { lease: self.lease, expires_at_ms: self.expires_at_ms, now_ms })
        }
    }

    /// Checks bytes fetched with this descriptor: the block's length and
    /// CRC-32C.
    pub fn verify(&self, bytes: &[u8]) -> Result<(), UseError> {
        if bytes.len() != self.len as usize {
            return Err(UseError::Length { have: bytes.len(), want: self.len });
        }
        let got = crc32c::crc32c(bytes);
        if got != self.crc32c {
            return Err(UseError::Checksum { want: self.crc32c, got });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Descriptor {
        Descriptor {
            gid: Gid([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 7]),
            lid: 0x1234,
            qp_num: 0x00ab_cdef,
            addr: 0x7f00_dead_b000,
            rkey: 0x0102_0304,
            len: 4096,
            crc32c: crc32c::crc32c(&[7u8; 4096]),
            lease: 42,
            expires_at_ms: 1_000_500,
        }
    }

    #[test]
    fn round_trip() {
        let d = sample();
        let bytes = d.encode().unwrap();
        assert_eq!(bytes.len(), ENCODED_LEN);
        assert_eq!(&bytes[..4], b"KVRD");
        assert_eq!(bytes[4], VERSION);
        assert_eq!(Descriptor::decode(&bytes), Ok(d));
    }

    #[test]
    fn layout_is_fixed() {
        let bytes = sample().encode().unwrap();
        // lid at 6, gid at 8, qp_num at 24, addr at 28, rkey 36, len 40,
        // crc32c 44, lease 48, expires_at_ms 56, check 64.
        assert_eq!(&bytes[6..8], &[0x12, 0x34]);
        assert_eq!(&bytes[20..24], &[10, 0, 0, 7]);
        assert_eq!(&bytes[24..28], &[0x00, 0xab, 0xcd, 0xef]);
        assert_eq!(&bytes[28..36], &0x7f00_dead_b000u64.to_be_bytes());
        assert_eq!(&bytes[36..40], &[1, 2, 3, 4]);
        assert_eq!(&bytes[40..44], &4096u32.to_be_bytes());
        assert_eq!(&bytes[48..56], &42u64.to_be_bytes());
        assert_eq!(&bytes[56..64], &1_000_500u64.to_be_bytes());
        assert_eq!(&bytes[64..], &crc32c::crc32c(&bytes[..64]).to_be_bytes());
    }

    /// Rewrites the trailing checksum so that a test reaches the field it
    /// tampered with rather than the checksum.
    fn reseal(bytes: &mut [u8]) {
        let n = bytes.len();
        let check = crc32c::crc32c(&bytes[..n - 4]);
        bytes[n - 4..].copy_from_slice(&check.to_be_bytes());
    }

    #[test]
    fn truncation_names_the_field() {
        let bytes = sample().encode().unwrap();
        let cases = [
            (0, "magic"),
            (3, "magic"),
            (4, "version"),
            (5, "flags"),
            (7, "lid"),
            (8, "gid"),
            (23, "gid"),
            (24, "qp_num"),
            (30, "addr"),
            (36, "rkey"),
            (40, "len"),
            (44, "crc32c"),
            (50, "lease"),
            (56, "expires_at_ms"),
            (64, "check"),
            (67, "check"),
        ];
        for (n, field) in cases {
            match Descriptor::decode(&bytes[..n]) {
                Err(DecodeError::Truncated { field: f, have, need }) => {
                    assert_eq!(f, field, "cut at {n}");
                    assert!(have < need);
                    let msg = DecodeError::Truncated { field: f, have, need }.to_string();
                    assert!(msg.contains(&format!("`{field}`")), "{msg}");
                }
                other => panic!("cut at {n}: {other:?}"),
            }
        }
    }

    #[test]
    fn wrong_magic_version_flags() {
        let good = sample().encode().unwrap();
        let mut b = good;
        b[0] = b'X';
        assert!(matches!(Descriptor::decode(&b), Err(DecodeError::BadMagic { .. })));
        assert!(Descriptor::decode(&b).unwrap_err().to_string().contains("`magic`"));

        let mut b = good;
        b[4] = 2;
        reseal(&mut b);
        assert_eq!(Descriptor::decode(&b), Err(DecodeError::UnsupportedVersion { found: 2 }));
        assert!(Descriptor::decode(&b).unwrap_err().to_string().contains("`version`"));

        let mut b = good;
        b[5] = 1;
        reseal(&mut b);
        let e = Descriptor::decode(&b).unwrap_err();
        assert!(matches!(e, DecodeError::Invalid { field: "flags", .. }), "{e:?}");
    }

    #[test]
    fn corruption_is_caught_by_the_check() {
        let good = sample().encode().unwrap();
        for i in 6..ENCODED_LEN {
            let mut b = good;
            b[i] ^= 0x01;
            let e = Descriptor::decode(&b).unwrap_err();
            assert!(matches!(e, DecodeError::Checksum { .. }), "byte {i}: {e:?}");
            assert!(e.to_string().contains("`check`"));
        }
    }

    #[test]
    fn trailing_bytes_are_refused() {
        let mut v = sample().encode().unwrap().to_vec();
        v.push(0);
        assert_eq!(Descriptor::decode(&v), Err(DecodeError::Trailing { extra: 1 }));
    }

    #[test]
    fn invalid_fields_name_themselves() {
        type Tamper = fn(&mut Descriptor);
        let cases: [(Tamper, &str); 6] = [
            (|d| d.qp_num = 1 << 24, "qp_num"),
            (|d| d.addr = 0, "addr"),
            (|d| d.len = 0, "len"),
            (|d| d.len = MAX_LEN + 1, "len"),
            (|d| d.addr = u64::MAX - 10, "len"),
            (|d| d.expires_at_ms = 0, "expires_at_ms"),
        ];
        for (tamper, field) in cases {
            let mut d = sample();
            tamper(&mut d);
            let e = d.encode().unwrap_err();
            assert!(matches!(e, DecodeError::Invalid { field: f, .. } if f == field), "{field}: {e:?}");
            assert!(e.to_string().starts_with(&format!("field `{field}`")), "{e}");

            // The same values arriving on the wire (a peer that does not
            // validate) are refused by decode, with the same field.
            let raw = d.encode_unchecked();
            let e = Descriptor::decode(&raw).unwrap_err();
            assert!(matches!(e, DecodeError::Invalid { field: f, .. } if f == field), "{field}: {e:?}");
        }
    }

    #[test]
    fn decode_never_panics() {
        // Every length, and many random inputs, some starting like a real
        // descriptor so that decoding gets past the magic and version.
        let good = sample().encode().unwrap();
        let mut rng = fastrand::Rng::with_seed(7);
        for n in 0..=ENCODED_LEN + 8 {
            let v: Vec<u8> = (0..n).map(|_| rng.u8(..)).collect();
            let _ = Descriptor::decode(&v);
        }
        for _ in 0..20_000 {
            let n = rng.usize(0..=ENCODED_LEN + 2);
            let mut v: Vec<u8> = (0..n).map(|_| rng.u8(..)).collect();
            let keep = rng.usize(0..=n.min(ENCODED_LEN));
            v[..keep].copy_from_slice(&good[..keep]);
            if n >= ENCODED_LEN && rng.bool() {
                reseal(&mut v[..ENCODED_LEN]);
            }
            if let Ok(d) = Descriptor::decode(&v) {
                assert!(d.validate().is_ok());
                assert_eq!(d.encode().unwrap().as_slice(), v.as_slice());
            }
        }
    }

    #[test]
    fn usable_strictly_before_expiry() {
        let d = sample();
        assert!(d.usable_at(0));
        assert!(d.usable_at(d.expires_at_ms - 1));
        assert!(!d.usable_at(d.expires_at_ms));
        assert!(!d.usable_at(u64::MAX));
        assert_eq!(d.check_usable(d.expires_at_ms - 1), Ok(()));
        assert_eq!(
            d.check_usable(d.expires_at_ms + 3),
            Err(UseError::Expired { lease: 42, expires_at_ms: d.expires_at_ms, now_ms: d.expires_at_ms + 3 })
        );
    }

    #[test]
    fn verify_checks_length_and_crc() {
        let d = sample();
        assert_eq!(d.verify(&[7u8; 4096]), Ok(()));
        assert_eq!(d.verify(&[7u8; 4095]), Err(UseError::Length { have: 4095, want: 4096 }));
        let mut torn = [7u8; 4096];
        torn[100] = 8;
        assert!(matches!(d.verify(&torn), Err(UseError::Checksum { .. })));
    }

    /// The fuzz target's seed (fuzz/seeds/decode_descriptor) is a valid
    /// descriptor, so that fuzzing starts past the checksum.
    #[test]
    fn fuzz_seed_decodes() {
        let seed = include_bytes!("../../../../fuzz/seeds/decode_descriptor/valid-v1");
        let d = Descriptor::decode(seed).unwrap();
        assert_eq!((d.qp_num, d.len, d.lease, d.crc32c), (0xab_cdef, 4096, 42, 0xdead_beef));
        assert_eq!(d.encode().unwrap().as_slice(), seed.as_slice());
    }

    #[test]
    fn gid_displays_as_eight_groups() {
        assert_eq!(sample().gid.to_string(), "0000:0000:0000:0000:0000:ffff:0a00:0007");
    }
}
