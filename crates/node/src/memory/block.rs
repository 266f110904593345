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
use std::marker::PhantomData;
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

    /// Brings the block's first cache line in, and with it the page's
    /// translation, ahead of a copy into it: the streaming stores of a
    /// frame's blocks, in a pool far larger than the caches, each start
    /// with a page walk that, asked for all the frame's blocks at once,
    /// overlaps the others'. A stand-alone loop of 32 random 4 KiB blocks
    /// written with streaming stores: 9.9 -> 6.2 us in a 2 GiB pool (no
    /// change, 4.8 against 5.0 us, in a 32 MiB one). See
    /// [`Block::prefetch_bytes`] for reads.
    pub(crate) fn prefetch_bytes(&self) {
        super::prefetch(self.as_slice().as_ptr());
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

    /// Fills the block with `src` (as long as the block) without first
    /// reading the block's lines into the cache: stored blocks are read
    /// again much later if at all, so a plain copy into a block that is
    /// not in cache pays a read of each of its lines before writing it
    /// (about 1 us per 4 KiB block on this kind of host, against 0.4 us
    /// like this), and pushes the receive buffer and the cache's tables out
    /// of cache on the way. On other targets it is a plain copy.
    ///
    /// The streaming stores are not fenced here but when `stores`' scope
    /// ends (see [`with_streaming_stores`]): a fence waits until every
    /// streaming store the thread made has drained to memory, so one fence
    /// per 4 KiB block made the copy wait for each block's 64 lines in
    /// turn, where one fence per batch lets them drain while the next
    /// block is checksummed (0.23 against 0.15 us per 4 KiB block copied
    /// into cold pool memory on this kind of host).
    ///
    /// # Panics
    ///
    /// When `src` is not as long as the block.
    pub(crate) fn stream_from(&mut self, src: &[u8], _stores: &StreamingStores) {
        let dst = self.as_mut_slice();
        assert_eq!(src.len(), dst.len(), "stream_from: {} bytes into a block of {}", src.len(), dst.len());
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
            const LINE: usize = 64;
            let whole = dst.len() / LINE * LINE;
            let (d, s) = (dst.as_mut_ptr(), src.as_ptr());
            let mut i = 0;
            while i < whole {
                // SAFETY: SSE2 is part of x86_64. `i + LINE <= whole <=
                // len` keeps every 16-byte load inside `src` and every store
                // inside `dst` (of equal length, checked above); the
                // stores are 16-byte aligned because a block starts at a
                // multiple of its class size (at least 64 bytes) in a
                // page-aligned arena and `i` is a multiple of 64. `dst` is
                // this handle's own memory (`&mut self`), so nothing else
                // reads it meanwhile, and `_stores` proves that a fence on
                // this thread orders the streaming stores before anything
                // that can publish the block (see `with_streaming_stores`).
                unsafe {
                    let parts = [0, 16, 32, 48].map(|o| _mm_loadu_si128(s.add(i + o).cast::<__m128i>()));
                    for (o, part) in [0, 16, 32, 48].into_iter().zip(parts) {
                        _mm_stream_si128(d.add(i + o).cast::<__m128i>(), part);
                    }
                }
                i += LINE;
            }
            dst[whole..].copy_from_slice(&src[whole..]);
        }
        #[cfg(not(target_arch = "x86_64"))]
        dst.copy_from_slice(src);
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
        // A block dropped unfrozen inside a streaming scope (a panic, or a
        // caller that gives a block back there) may hold this thread's
        // streaming stores not yet fenced: its memory goes back to the pool,
        // and another thread may take and write it, so its streaming stores
        // are fenced first. Nothing pending, a fence costs a few cycles.
        fence_streaming_stores();
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

/// Leave to write blocks with streaming stores ([`BlockMut::stream_from`])
/// inside [`with_streaming_stores`]. It cannot leave the thread nor outlive
/// the call that lent it, which is what makes that call's one fence order
/// every streaming store made under it.
///
/// The types do not stop a block streamed into from being frozen, shared,
/// or sent to another thread inside the scope, before the fence; so the
/// scope is the crate's own (`pub(crate)`), and its one user
/// (`Conn::put_buffered`) only streams and checks inside it, and freezes
/// and stores after it.
pub(crate) struct StreamingStores {
    /// Neither `Send` nor `Sync`: the fence orders its own thread's stores.
    _this_thread: PhantomData<*const ()>,
}

/// Runs `write`, which may fill blocks with [`BlockMut::stream_from`], and
/// then fences its streaming stores: they are ordered before anything after
/// this call, such as publishing the blocks. `write` is synchronous and
/// runs on this thread, so the fence is on the thread that made the stores
/// (an `await` between the stores and a fence could resume on another
/// thread, whose fence would not order them). A block dropped unfrozen,
/// inside `write` or after, fences before its memory goes back to the pool.
pub(crate) fn with_streaming_stores<T>(write: impl FnOnce(&StreamingStores) -> T) -> T {
    /// Fences when dropped: also when `write` panics, so a block kept
    /// outside the scope is never used unfenced after a caught unwind.
    struct FenceOnExit;
    impl Drop for FenceOnExit {
        fn drop(&mut self) {
            fence_streaming_stores();
        }
    }
    let _fence = FenceOnExit;
    write(&StreamingStores { _this_thread: PhantomData })
}

/// Orders this thread's streaming stores before everything after it.
fn fence_streaming_stores() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE2 is part of x86_64; a fence has no operands.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
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

    /// Brings the block's count and checksum (the pool's record of it) into
    /// the cache ahead of a clone and a [`Block::crc`] (see
    /// [`prefetch`](super::prefetch)).
    pub(crate) fn prefetch_count(&self) {
        super::prefetch(self.pool.refcount(self.offset));
    }

    /// Brings the block's first cache line in, and with it the page's
    /// translation, ahead of a copy of its bytes that the CPU cannot see
    /// coming: the kernel's, when a GET answer is written to its socket,
    /// reads one block after another, and each block, in a pool far larger
    /// than the caches, starts with a miss (often a page walk too) before
    /// the hardware prefetcher follows the rest of it. Asked for all the
    /// answer's blocks at once, the first misses overlap instead of coming
    /// one after another. A stand-alone loop of 32 random 4 KiB blocks
    /// copied with `rep movsb`: 8.5 -> 6.6 us in a 32 MiB pool, 19.3 ->
    /// 12.1 us in a 2 GiB one; every line asked for instead was slower than
    /// none, the first of each block as good as any other choice.
    pub(crate) fn prefetch_bytes(&self) {
        super::prefetch(self.as_ptr());
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

impl Block {
    /// Gives up this handle's count; true when it was the last, and the
    /// memory is the caller's to give back to the pool.
    fn uncount(&self) -> bool {
        // Release/Acquire like `Arc::drop`: every read through other handles
        // happens before the memory is handed to the next writer.
        if self.pool.refcount(self.offset).fetch_sub(1, Ordering::Release) != 1 {
            return false;
        }
        fence(Ordering::Acquire);
        true
    }

    /// Drops every block, giving the memory of those whose last handle it
    /// was back to the pool under one acquisition of its lock: a PUT that
    /// replaces a batch of stored blocks frees them together, not taking the
    /// lock once per block. A block of another pool than the first one's is
    /// dropped on its own.
    pub fn release_all(blocks: Vec<Block>) {
        let Some(pool) = blocks.first().map(|b| Arc::clone(&b.pool)) else { return };
        let mut freed = Vec::with_capacity(blocks.len());
        for block in blocks {
            if !Arc::ptr_eq(&block.pool, &pool) {
                drop(block);
                continue;
            }
            if block.uncount() {
                freed.push((block.offset, block.len));
            }
            let block = std::mem::ManuallyDrop::new(block);
            // SAFETY: `block` is never used or dropped again, so its pool
            // reference is moved out (and dropped here) exactly once; its
            // count was given up above, and `pool` keeps the pool alive
            // until the memory is released below.
            drop(unsafe { std::ptr::read(&block.pool) });
        }
        pool.release_many(&freed);
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        if self.uncount() {
            self.pool.release(self.offset, self.len);
        }
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
