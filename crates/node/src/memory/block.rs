//! Handles to pool memory: [`BlockMut`] while it is being filled, [`Block`]
//! once it is shared.
//!
//! The split is what makes sharing safe without locks: only a `BlockMut`
//! can write, and there is exactly one per block; `freeze` turns it into a
//! read-only, clonable `Block`. The reference count of the clones lives in
//! the pool's per-slot array (no heap header per block), and the memory goes
//! back to the pool only when the last clone is dropped — so a block being
//! read (sent to a socket, copied to a GPU) is never reused under the reader,
//! whatever the cache does with its entry meanwhile.

use std::fmt;
use std::ops::Deref;
use std::ptr::NonNull;
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

use super::MemoryPool;

/// Marks a block's checksum slot as holding a checksum (a CRC may be 0).
const KNOWN_CRC: u64 = 1 << 32;

/// Clones beyond this are a leak, not a workload; aborting like `Arc` does
/// beats wrapping the count and freeing memory that is still in use.
const MAX_REFCOUNT: u32 = i32::MAX as u32;

/// A unique, writable block fresh from the pool.
pub struct BlockMut {
    pool: Arc<MemoryPool>,
    ptr: NonNull<u8>,
    len: usize,
    offset: usize,
    class_bytes: usize,
}

// SAFETY: a `BlockMut` is the only handle to its bytes (the pool hands each
// block to one owner), so moving it to another thread moves exclusive access.
unsafe impl Send for BlockMut {}
// SAFETY: `&BlockMut` only allows reads (`as_slice`); writing needs `&mut`.
unsafe impl Sync for BlockMut {}

impl BlockMut {
    pub(super) fn new(pool: Arc<MemoryPool>, ptr: NonNull<u8>, len: usize, offset: usize, class_bytes: usize) -> Self {
        BlockMut { pool, ptr, len, offset, class_bytes }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size of the class the block was carved from: how far it may grow.
    pub fn capacity(&self) -> usize {
        self.class_bytes
    }

    /// Shrinks the visible length, e.g. after reading a frame shorter than
    /// the block allocated for it.
    pub fn truncate(&mut self, len: usize) {
        if len < self.len {
            self.pool.lock().requested_bytes -= self.len - len;
            self.len = len;
        }
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr..ptr+len` lies inside this block of the arena (len is
        // at most the class size); the memory is initialized (anonymous
        // mappings start zeroed and every later write stores plain bytes), and
        // no `&mut` to it can exist while `&self` is borrowed.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` proves this is the only
        // access: the pool gave the block to this handle alone.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Ends writing: the block becomes shareable and read-only.
    pub fn freeze(self) -> Block {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped, so the pool reference is moved out
        // exactly once; the refcount slot (set to 1 by `allocate`) now
        // belongs to the returned `Block`.
        let pool = unsafe { std::ptr::read(&this.pool) };
        Block { pool, ptr: this.ptr, len: this.len, offset: this.offset }
    }
}

impl Drop for BlockMut {
    fn drop(&mut self) {
        self.pool.refcount(self.offset).store(0, Ordering::Relaxed);
        self.pool.release(self.offset, self.len);
    }
}

impl Deref for BlockMut {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl AsRef<[u8]> for BlockMut {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl fmt::Debug for BlockMut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockMut").field("offset", &self.offset).field("len", &self.len).finish()
    }
}

/// A shared, read-only block; cloning is two atomic increments.
pub struct Block {
    pool: Arc<MemoryPool>,
    ptr: NonNull<u8>,
    len: usize,
    offset: usize,
}

// SAFETY: a `Block`'s bytes are never written while any `Block` exists (only
// the unique `BlockMut` writes, and it is consumed by `freeze`), and the
// refcount is atomic, so sharing and sending handles across threads is sound.
unsafe impl Send for Block {}
// SAFETY: see `Send`.
unsafe impl Sync for Block {}

impl Block {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr..ptr+len` lies inside this block of the arena, which
        // stays allocated while this handle (one of the counted references)
        // lives; nobody writes it while shared (see the `Send` impl).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// How many handles share the block right now. Only a hint (it can
    /// change the moment it is read); the cache uses it to skip evicting
    /// entries whose memory a reader would keep alive anyway.
    pub fn ref_count(&self) -> u32 {
        self.pool.refcount(self.offset).load(Ordering::Relaxed)
    }

    /// Where the block starts in the pool's arena
    /// ([`MemoryPool::arena_range`](super::MemoryPool::arena_range)).
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) fn arena_offset(&self) -> usize {
        self.offset
    }

    /// The CRC-32C of the block's bytes: computed on first use and kept
    /// beside the block (in the pool's per-block metadata) for every later
    /// one, or the checksum [`Block::set_crc`] recorded. A block's bytes
    /// never change once it is shared, so computing it late gives what
    /// computing it when the block was written would have; a PUT that no
    /// one needs the checksum of never pays for it.
    pub fn crc(&self) -> u32 {
        match self.known_crc() {
            Some(crc) => crc,
            None => {
                let crc = kvplane_protocol::checksum(self.as_slice());
                self.set_crc(crc);
                crc
            }
        }
    }

    /// The checksum if it was computed or recorded already.
    pub fn known_crc(&self) -> Option<u32> {
        // Relaxed: the value is a function of bytes that no longer change;
        // a reader that misses a concurrent store computes the same value.
        let v = self.pool.crc_slot(self.offset).load(Ordering::Relaxed);
        (v & KNOWN_CRC != 0).then_some(v as u32)
    }

    /// Records the block's checksum, known already (verified against the
    /// bytes by the caller), so that [`Block::crc`] does not compute it.
    pub fn set_crc(&self, crc: u32) {
        self.pool.crc_slot(self.offset).store(KNOWN_CRC | u64::from(crc), Ordering::Relaxed);
    }

    /// Whether two handles share the same memory.
    pub fn ptr_eq(&self, other: &Block) -> bool {
        self.ptr == other.ptr
    }

    /// A `Bytes` view that keeps the block alive, so the server can write it
    /// to a socket without copying.
    pub fn into_bytes(self) -> bytes::Bytes {
        bytes::Bytes::from_owner(self)
    }
}

impl Clone for Block {
    fn clone(&self) -> Self {
        // Relaxed like `Arc::clone`: a new handle can only be made from an
        // existing one, which already keeps the memory alive.
        let old = self.pool.refcount(self.offset).fetch_add(1, Ordering::Relaxed);
        if old >= MAX_REFCOUNT {
            std::process::abort();
        }
        Block { pool: Arc::clone(&self.pool), ptr: self.ptr, len: self.len, offset: self.offset }
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        // Release/Acquire like `Arc::drop`: every read through other handles
        // happens before the memory is handed to the next writer.
        if self.pool.refcount(self.offset).fetch_sub(1, Ordering::Release) != 1 {
            return;
        }
        fence(Ordering::Acquire);
        self.pool.release(self.offset, self.len);
    }
}

impl Deref for Block {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl AsRef<[u8]> for Block {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl fmt::Debug for Block {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Block").field("offset", &self.offset).field("len", &self.len).finish()
    }
}
