//! What the node writes to the second tier besides a block, and how it
//! checks what comes back.
//!
//! A store is outside the node's trust: its bytes can change (a `SETRANGE`
//! by hand, a disk error), a backend plugin can answer "filled the whole
//! destination" without writing a byte, and a bug can hand back the value
//! of another key. So with every block the node writes a **trailer**, under
//! a key of its own ([`trailer_key`]: the block's key and a suffix no
//! engine uses), in the same backend call:
//!
//! ```text
//! trailer (32 bytes, little-endian), then the block's key:
//!   u64 len | u32 crc32c(block) | u16 key_len | u8 version (1) | u8 flags (0)
//!   | u32 crc32c(key) | u32 reserved (0) | u32 crc32c(bytes 0..24) | "KVT1"
//! ```
//!
//! A read-through asks for both in one call and verifies before the block
//! enters the memory tier or reaches a client: the trailer's magic, version
//! and own checksum, the key it names equal to the one asked for, the
//! block's length and CRC-32C. A damaged trailer, or one naming another
//! key, is [`Opened::Corrupt`]; a sound trailer of this key that disagrees
//! with the block is [`Opened::Mismatch`], which the reader reads once more
//! before it answers corrupt (see below). A block without a trailer is
//! [`Opened::Unsealed`]: written before this format (or by another writer),
//! read as a miss and counted.
//!
//! Why once more: block and trailer are two keys, and a store need not
//! write two keys atomically (the resp plugin pipelines two SETs). A read
//! that falls between an overwrite's block and its trailer sees the new
//! block with the old trailer; read again, it finds the pair the writer
//! finished a moment later. What a second read cannot mend is two writers
//! of different bytes under one key interleaving their pairs (A's block,
//! B's block, B's trailer, A's trailer): the store then keeps one's block
//! with the other's trailer, and that key reads as `corrupt` — never the
//! wrong bytes — until it is written again. Engines' keys name their
//! content (a prefix hash), so writers of one key write the same bytes and
//! their pairs agree whatever the order; docs/architecture.md states the
//! rule beside the guarantees table.
//!
//! Why a key of its own rather than bytes appended to the block: a block
//! read from the store lands in a pool block of its own size class, and
//! engines' blocks are often exact powers of two (16 tokens of a 32-layer,
//! 8-KV-head, 128-dim fp16 model are 2 MiB). Bytes appended would push every
//! such read into the next class, twice the memory, then a copy back; a
//! separate trailer leaves the block's bytes exactly as they were, written
//! from the pool block itself and read straight into one. The price is a
//! second, small key per block in the store.

use bytes::Bytes;
use kvplane_protocol::checksum;

/// Bytes of the fixed part of a trailer (the block's key follows it).
pub const TRAILER_LEN: usize = 32;
const MAGIC: [u8; 4] = *b"KVT1";
const VERSION: u8 = 1;
/// What a trailer's key adds to its block's key: a NUL (engines' keys are
/// hashes or paths) and a name.
const TRAILER_SUFFIX: &[u8] = b"\0kvplane-trailer";

/// The store key of `key`'s trailer.
pub fn trailer_key(key: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(key.len() + TRAILER_SUFFIX.len());
    k.extend_from_slice(key);
    k.extend_from_slice(TRAILER_SUFFIX);
    k
}

/// The block key a trailer key belongs to.
pub fn block_key(trailer_key: &[u8]) -> &[u8] {
    trailer_key.strip_suffix(TRAILER_SUFFIX).unwrap_or(trailer_key)
}

/// The length of `key`'s trailer value.
pub fn trailer_len(key: &[u8]) -> usize {
    TRAILER_LEN + key.len()
}

/// The trailer of a block of `len` bytes with CRC-32C `crc`, stored under
/// `key`. The caller passes the checksum it has (a PUT's block carries the
/// one it was checked with), so writing a block costs no second pass.
pub fn trailer(key: &[u8], len: usize, crc: u32) -> Bytes {
    let mut t = Vec::with_capacity(trailer_len(key));
    t.extend_from_slice(&(len as u64).to_le_bytes());
    t.extend_from_slice(&crc.to_le_bytes());
    t.extend_from_slice(&(key.len() as u16).to_le_bytes());
    t.push(VERSION);
    t.push(0);
    t.extend_from_slice(&checksum(key).to_le_bytes());
    t.extend_from_slice(&[0u8; 4]);
    let own = checksum(&t[0..24]);
    t.extend_from_slice(&own.to_le_bytes());
    t.extend_from_slice(&MAGIC);
    t.extend_from_slice(key);
    Bytes::from(t)
}

/// What a block read back from the store turned out to be.
#[derive(Debug, PartialEq, Eq)]
pub enum Opened {
    /// The block sealed under this key, with its CRC-32C.
    Block { crc: u32 },
    /// No trailer: a block written before this format, or by another
    /// writer. A miss.
    Unsealed,
    /// A trailer that does not check out (damaged, another key's, another
    /// version), and why.
    Corrupt(String),
    /// A sound trailer of this key that the block disagrees with (its
    /// length or CRC-32C), and how: a changed byte, a length the store
    /// claimed but did not write, or a read between an overwrite's block
    /// and its trailer. Corrupt if a second read says the same.
    Mismatch(String),
}

/// Checks `block` (what the store answered for `key`) against `trailer`
/// (what it answered for [`trailer_key`]; `None`: absent).
pub fn open(key: &[u8], block: &[u8], trailer: Option<&[u8]>) -> Opened {
    let Some(t) = trailer else {
        return Opened::Unsealed;
    };
    if t.len() < TRAILER_LEN || t[28..32] != MAGIC {
        return Opened::Corrupt(format!("its trailer ({} bytes) is not one", t.len()));
    }
    let u32_at = |i: usize| u32::from_le_bytes([t[i], t[i + 1], t[i + 2], t[i + 3]]);
    if u32_at(24) != checksum(&t[0..24]) {
        return Opened::Corrupt("its trailer fails its own checksum".into());
    }
    if t[14] != VERSION {
        return Opened::Corrupt(format!("trailer version {} (this node reads {VERSION})", t[14]));
    }
    let key_len = u16::from_le_bytes([t[12], t[13]]) as usize;
    let stored_key = &t[TRAILER_LEN..];
    if stored_key.len() != key_len || stored_key != key || u32_at(16) != checksum(key) {
        return Opened::Corrupt(format!("its trailer names another key ({:?})", String::from_utf8_lossy(stored_key)));
    }
    let len = u64::from_le_bytes(t[0..8].try_into().expect("8 bytes"));
    if len != block.len() as u64 {
        return Opened::Mismatch(format!("{} bytes read, sealed as {len}", block.len()));
    }
    let crc = checksum(block);
    if crc != u32_at(8) {
        return Opened::Mismatch(format!("its CRC-32C is {crc:#010x}, sealed as {:#010x}", u32_at(8)));
    }
    Opened::Block { crc }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_block_opens_to_itself() {
        let t = trailer(b"tenant-a/block0", b"hello world".len(), checksum(b"hello world"));
        assert_eq!(t.len(), trailer_len(b"tenant-a/block0"));
        assert_eq!(open(b"tenant-a/block0", b"hello world", Some(&t)), Opened::Block { crc: checksum(b"hello world") });
        assert_eq!(open(b"k", b"", Some(&trailer(b"k", b"".len(), checksum(b"")))), Opened::Block { crc: checksum(b"") });
        assert_eq!(trailer_key(b"k"), b"k\0kvplane-trailer");
    }

    #[test]
    fn every_changed_byte_of_block_or_trailer_is_caught() {
        let (key, block) = (b"k/1", [7u8; 100]);
        let t = trailer(key, block.len(), checksum(&block));
        for i in 0..block.len() {
            let mut bad = block;
            bad[i] ^= 0x40;
            assert!(matches!(open(key, &bad, Some(&t)), Opened::Mismatch(_)), "block byte {i}");
        }
        for i in 0..t.len() {
            let mut bad = t.to_vec();
            bad[i] ^= 0x40;
            assert!(matches!(open(key, &block, Some(&bad)), Opened::Corrupt(_)), "trailer byte {i}");
        }
    }

    #[test]
    fn another_keys_block_a_claimed_length_and_zeros_are_corrupt() {
        let t = trailer(b"tenant-a/block0", 64, checksum(&[1u8; 64]));
        assert!(matches!(open(b"tenant-b/never-written", &[1u8; 64], Some(&t)), Opened::Corrupt(m) if m.contains("another key")));
        assert!(matches!(open(b"tenant-a/block0", &[1u8; 65], Some(&t)), Opened::Mismatch(m) if m.contains("sealed as 64")));
        // A plugin that claims the whole destination and writes nothing.
        assert!(matches!(open(b"tenant-a/block0", &[0u8; 64], Some(&t)), Opened::Mismatch(m) if m.contains("CRC-32C")));
        assert!(matches!(open(b"k", b"x", Some(&[0u8; 40])), Opened::Corrupt(_)));
    }

    #[test]
    fn a_block_without_a_trailer_is_unsealed() {
        assert_eq!(open(b"k", b"plain bytes written by an older node", None), Opened::Unsealed);
    }
}
