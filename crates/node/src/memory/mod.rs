//! The memory tier: one preallocated arena carved into slab pages and blocks.
//!
//! # Layout
//!
//! The arena is split into equal *slab pages* of `max_block_bytes` each, so a
//! slab holds exactly one block of the largest class or `2^k` blocks of a
//! smaller one. Size classes are the powers of two from `min_block_bytes`
//! (4 KiB) to `max_block_bytes` (16 MiB); a request is served from the
//! smallest class that fits, so at most half of a block is slack — KV blocks
//! of one model are all the same size, so in practice one class is hot and
//! the slack is whatever rounding that size to a power of two costs.
//!
//! # Why this scheme
//!
//! * No per-block malloc: free blocks are indices on a per-slab stack whose
//!   capacity is reserved when the pool is built, and a block's reference
//!   count lives in a preallocated per-slot array instead of an `Arc` header.
//! * Memory moves between classes: a slab page whose last block is freed goes
//!   back to the arena at once and can be reassigned to any class. Assigning
//!   a slab is O(1) (a bump index, not a rebuilt free list), so returning
//!   pages eagerly costs nothing even when one block flips a page back and forth.
//! * One short mutex guards the free lists: allocation and release are a few
//!   pointer moves under it, far below the cost of the copy that follows.
//!
//! A block's memory returns to the pool only when the last [`Block`] clone
//! drops, which is what lets the cache evict or replace an entry while a
//! reader is still sending its bytes.

mod arena;
mod block;

use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

pub(crate) use block::with_streaming_stores;
pub use block::{Block, BlockMut};

use arena::Arena;

/// Default smallest block: one 4 KiB page.
pub const DEFAULT_MIN_BLOCK_BYTES: usize = 4 << 10;
/// Default largest block and slab page size.
pub const DEFAULT_MAX_BLOCK_BYTES: usize = 16 << 20;
/// Slab pages a default-configured pool has at least (see [`PoolConfig::new`]).
pub const MIN_SLAB_PAGES: usize = 64;
/// Default pool size when none is configured.
pub const DEFAULT_CAPACITY_BYTES: usize = 1 << 30;

/// Blocks [`MemoryPool::try_allocate_many`] takes per acquisition of the
/// lock: a PUT frame's worth of small blocks (the client batches 32), and
/// a bound on how long one caller holds the lock.
pub const ALLOCATE_MANY_CHUNK: usize = 64;

/// Marks the end of an intrusive list.
const NIL: u32 = u32::MAX;
/// Class id of a slab page that belongs to the arena (no class).
const UNASSIGNED: u8 = u8::MAX;

/// Asks the CPU to bring the cache line at `p` in, without waiting for it:
/// a hint, which never faults (any address will do) and changes nothing
/// a program can observe but time. A no-op off x86_64.
pub(crate) fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: a prefetch does not access memory in the language's sense:
        // it cannot fault, whatever the address, and reads or writes nothing.
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast::<i8>()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = p;
    }
}

/// How the pool is sized and backed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolConfig {
    /// Total bytes reserved for blocks; rounded down to whole slab pages.
    pub capacity_bytes: usize,
    /// Smallest size class (a power of two, at least 64).
    pub min_block_bytes: usize,
    /// Largest size class and slab page size (a power of two).
    pub max_block_bytes: usize,
    /// Ask for huge pages (explicit hugetlbfs first, then transparent).
    pub huge_pages: bool,
    /// Lock the arena in RAM so a cache hit never waits on swap.
    pub mlock: bool,
    /// Fault every page in at start, so the first writes do not pay for it
    /// and an overcommitted node fails at start rather than mid-traffic.
    pub prefault: bool,
}

impl PoolConfig {
    /// A pool of `capacity_bytes` with default classes. A small pool lowers
    /// its largest class until it has [`MIN_SLAB_PAGES`] slab pages, so a
    /// `--memory 16MiB` node is not one slab page that a single block size
    /// monopolises; `max_block_bytes` can be raised again explicitly.
    pub fn new(capacity_bytes: usize) -> Self {
        let mut max_block_bytes = DEFAULT_MAX_BLOCK_BYTES;
        while max_block_bytes > DEFAULT_MIN_BLOCK_BYTES && max_block_bytes.saturating_mul(MIN_SLAB_PAGES) > capacity_bytes {
            max_block_bytes /= 2;
        }
        PoolConfig {
            capacity_bytes,
            min_block_bytes: DEFAULT_MIN_BLOCK_BYTES,
            max_block_bytes,
            huge_pages: false,
            mlock: false,
            prefault: false,
        }
    }
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig::new(DEFAULT_CAPACITY_BYTES)
    }
}

/// What the arena actually got, as opposed to what was asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HugePageMode {
    /// Regular pages (not asked for, or refused).
    None,
    /// `madvise(MADV_HUGEPAGE)` accepted: the kernel backs the range with huge
    /// pages when it can.
    Transparent,
    /// `MAP_HUGETLB`: reserved hugetlbfs pages.
    Explicit,
}

/// Why a pool could not be built or a block not allocated.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("invalid memory pool configuration: {0}")]
    InvalidConfig(String),
    #[error("could not reserve {bytes} bytes for the memory pool: {source}")]
    Map {
        bytes: usize,
        #[source]
        source: std::io::Error,
    },
    #[error("a block of {requested} bytes exceeds the largest size class ({max} bytes)")]
    TooLarge { requested: usize, max: usize },
    #[error(
        "memory pool exhausted: cannot allocate {requested} bytes (size class {class_bytes} bytes); \
         {free_slab_bytes} bytes in free slab pages, {free_bytes} bytes free in total of {capacity_bytes} \
         (the rest of the free bytes sit in partly used slab pages of other size classes)"
    )]
    Capacity {
        requested: usize,
        class_bytes: usize,
        /// Bytes in whole free slab pages, usable by any class.
        free_slab_bytes: usize,
        /// Capacity minus bytes held by live blocks (by class size).
        free_bytes: usize,
        capacity_bytes: usize,
    },
}

impl From<MemoryError> for kvplane_protocol::KvError {
    fn from(err: MemoryError) -> Self {
        match err {
            MemoryError::TooLarge { .. } => kvplane_protocol::KvError::Invalid(err.to_string()),
            MemoryError::Capacity { .. } => kvplane_protocol::KvError::Capacity(err.to_string()),
            MemoryError::InvalidConfig(_) | MemoryError::Map { .. } => kvplane_protocol::KvError::Internal(err.to_string()),
        }
    }
}

/// Occupancy of one size class.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassStats {
    pub block_bytes: usize,
    /// Live blocks of this class.
    pub blocks: u64,
    /// Slab pages currently assigned to this class.
    pub slabs: u64,
}

/// A snapshot of the pool's accounting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolStats {
    /// Usable bytes (whole slab pages).
    pub capacity_bytes: usize,
    /// Bytes held by live blocks, counted by their class size.
    pub used_bytes: usize,
    /// Bytes live blocks were asked for (`used_bytes` minus rounding slack).
    pub requested_bytes: usize,
    /// Live blocks.
    pub blocks: u64,
    pub slab_bytes: usize,
    pub slabs_total: usize,
    pub slabs_free: usize,
    /// Allocations refused for lack of memory since start.
    pub failed_allocations: u64,
    pub huge_pages: HugePageMode,
    pub locked: bool,
    /// One entry per size class, smallest first.
    pub classes: Vec<ClassStats>,
}

/// A slab page's bookkeeping. Free blocks are kept as a stack of indices
/// plus a bump index (`fresh`) over never-used blocks, so assigning a page to
/// a class is O(1) whatever the number of blocks in it.
struct Slab {
    class: u8,
    used: u32,
    fresh: u32,
    free: Vec<u32>,
    prev: u32,
    next: u32,
}

struct PoolState {
    slabs: Vec<Slab>,
    free_slabs: Vec<u32>,
    /// Per class: head of the list of its slab pages that have a free block.
    partial: Vec<u32>,
    class_blocks: Vec<u64>,
    class_slabs: Vec<u64>,
    used_bytes: usize,
    requested_bytes: usize,
    blocks: u64,
    failed: u64,
}

/// What the pool keeps beside each block, in one 16-byte record so that a
/// GET, which takes a count and reads the checksum, and a PUT, which sets
/// both, miss the cache once per block for them, not once per field.
struct SlotMeta {
    /// The shared reference count of [`Block`] clones.
    refcount: AtomicU32,
    /// The CRC-32C of the block's bytes once known ([`Block::crc`]):
    /// `KNOWN_CRC | crc`, or 0 while not computed.
    crc: AtomicU64,
}

/// The preallocated block pool. See the module docs for the layout.
pub struct MemoryPool {
    arena: Arena,
    capacity_bytes: usize,
    min_shift: u32,
    slab_shift: u32,
    classes: usize,
    /// One per `min_block_bytes` slot, indexed by the slot a block starts
    /// at: its handles' reference count and its checksum.
    slots: Box<[SlotMeta]>,
    state: Mutex<PoolState>,
}

impl fmt::Debug for MemoryPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryPool")
            .field("capacity_bytes", &self.capacity_bytes)
            .field("min_block_bytes", &(1usize << self.min_shift))
            .field("max_block_bytes", &(1usize << self.slab_shift))
            .finish_non_exhaustive()
    }
}

impl MemoryPool {
    /// Reserves the arena. Huge pages and `mlock` degrade with a warning when
    /// refused; a bad configuration or a failed reservation is an error.
    pub fn new(config: PoolConfig) -> Result<Arc<MemoryPool>, MemoryError> {
        let PoolConfig { capacity_bytes, min_block_bytes: min, max_block_bytes: max, huge_pages, mlock, prefault } = config;
        if !min.is_power_of_two() || min < 64 {
            return Err(MemoryError::InvalidConfig(format!("min_block_bytes {min} must be a power of two of at least 64")));
        }
        if !max.is_power_of_two() || max < min {
            return Err(MemoryError::InvalidConfig(format!(
                "max_block_bytes {max} must be a power of two no smaller than min_block_bytes {min}"
            )));
        }
        let classes = (max.trailing_zeros() - min.trailing_zeros()) as usize + 1;
        if classes > 32 {
            return Err(MemoryError::InvalidConfig(format!(
                "max_block_bytes {max} / min_block_bytes {min} spans {classes} size classes; at most 32 are supported"
            )));
        }
        if capacity_bytes < max {
            return Err(MemoryError::InvalidConfig(format!(
                "capacity {capacity_bytes} bytes is smaller than one slab page (max_block_bytes {max}); \
                 raise the capacity or lower the largest block size"
            )));
        }
        let slab_count = capacity_bytes / max;
        let slots = capacity_bytes / min;
        if slab_count >= NIL as usize || slots >= NIL as usize {
            return Err(MemoryError::InvalidConfig(format!(
                "capacity {capacity_bytes} bytes holds {slots} blocks of {min} bytes; at most {} are supported",
                NIL - 1
            )));
        }
        let capacity = slab_count * max;
        if capacity != capacity_bytes {
            tracing::debug!(requested = capacity_bytes, usable = capacity, "pool capacity rounded down to whole slab pages");
        }
        let arena = Arena::map(capacity, huge_pages, mlock, prefault)?;
        let per_slab = max / min;
        let slabs = (0..slab_count)
            .map(|_| Slab { class: UNASSIGNED, used: 0, fresh: 0, free: Vec::with_capacity(per_slab), prev: NIL, next: NIL })
            .collect();
        // Low addresses first, so a lightly used pool stays compact.
        let free_slabs = (0..slab_count as u32).rev().collect();
        let slots = (0..capacity / min).map(|_| SlotMeta { refcount: AtomicU32::new(0), crc: AtomicU64::new(0) }).collect();
        tracing::info!(
            capacity_bytes = capacity,
            min_block_bytes = min,
            max_block_bytes = max,
            huge_pages = ?arena.huge_pages,
            locked = arena.locked,
            "memory pool reserved"
        );
        Ok(Arc::new(MemoryPool {
            arena,
            capacity_bytes: capacity,
            min_shift: min.trailing_zeros(),
            slab_shift: max.trailing_zeros(),
            classes,
            slots,
            state: Mutex::new(PoolState {
                slabs,
                free_slabs,
                partial: vec![NIL; classes],
                class_blocks: vec![0; classes],
                class_slabs: vec![0; classes],
                used_bytes: 0,
                requested_bytes: 0,
                blocks: 0,
                failed: 0,
            }),
        }))
    }

    pub fn capacity_bytes(&self) -> usize {
        self.capacity_bytes
    }

    /// Start of the arena and its usable length (every block lies inside):
    /// what the RDMA side registers as one memory region.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) fn arena_range(&self) -> (NonNull<u8>, usize) {
        (self.arena.base(), self.capacity_bytes)
    }

    pub fn max_block_bytes(&self) -> usize {
        1 << self.slab_shift
    }

    pub fn min_block_bytes(&self) -> usize {
        1 << self.min_shift
    }

    /// Class index and class size serving `len` bytes.
    fn class_of(&self, len: usize) -> Result<(usize, u32), MemoryError> {
        if len > self.max_block_bytes() {
            return Err(MemoryError::TooLarge { requested: len, max: self.max_block_bytes() });
        }
        let shift = len.max(1).next_power_of_two().trailing_zeros().max(self.min_shift);
        Ok(((shift - self.min_shift) as usize, shift))
    }

    /// A unique writable block of `len` bytes. Its contents are whatever the
    /// previous user left (the caller overwrites them; zeroing would double
    /// the memory traffic of a PUT).
    pub fn allocate(self: &Arc<Self>, len: usize) -> Result<BlockMut, MemoryError> {
        self.allocate_counted(len, true)
    }

    /// Like [`allocate`](Self::allocate), but a full pool is not counted as a
    /// refused allocation: for a caller that frees memory and retries (the
    /// cache's eviction loop), which reports a final refusal itself with
    /// [`record_refusal`](Self::record_refusal).
    pub fn try_allocate(self: &Arc<Self>, len: usize) -> Result<BlockMut, MemoryError> {
        self.allocate_counted(len, false)
    }

    /// Counts an allocation that could not be served even after freeing.
    pub fn record_refusal(&self) {
        self.lock().failed += 1;
    }

    fn allocate_counted(self: &Arc<Self>, len: usize, count_failure: bool) -> Result<BlockMut, MemoryError> {
        let (class, shift) = self.class_of(len)?;
        let offset = {
            let mut st = self.lock();
            match st.take_counted(class, shift, len, self.slab_shift) {
                Some(offset) => offset,
                None => {
                    if count_failure {
                        st.failed += 1;
                    }
                    return Err(self.capacity_error(&st, len, shift));
                }
            }
        };
        Ok(self.hand_out(offset, len, shift))
    }

    /// Blocks of `lens[0]`, `lens[1]`, ... bytes appended to `out` in order,
    /// taken [`ALLOCATE_MANY_CHUNK`] at a time under one acquisition of the
    /// pool's lock, up to the first that cannot be served: how many were
    /// appended. A PUT frame of 32 small blocks otherwise takes the lock 32
    /// times, a cache line that moves between cores each time. The caller
    /// serves the rest one at a time, with eviction and the exact error
    /// ([`try_allocate`](Self::try_allocate)); nothing here counts as a refusal.
    pub fn try_allocate_many(self: &Arc<Self>, lens: &[usize], out: &mut Vec<BlockMut>) -> usize {
        out.reserve(lens.len());
        let mut served = 0;
        for chunk in lens.chunks(ALLOCATE_MANY_CHUNK) {
            // Offsets and class shifts, made into handles once the lock is
            // released (each handle costs an atomic on the pool's count).
            let mut taken = [(0usize, 0u32); ALLOCATE_MANY_CHUNK];
            let mut n = 0;
            {
                let mut st = self.lock();
                for &len in chunk {
                    let Ok((class, shift)) = self.class_of(len) else { break };
                    let Some(offset) = st.take_counted(class, shift, len, self.slab_shift) else { break };
                    taken[n] = (offset, shift);
                    n += 1;
                }
            }
            out.extend(taken[..n].iter().zip(chunk).map(|(&(offset, shift), &len)| self.hand_out(offset, len, shift)));
            served += n;
            if n < chunk.len() {
                break;
            }
        }
        served
    }

    /// What a refused allocation of `len` bytes (class `1 << shift`) says.
    fn capacity_error(&self, st: &PoolState, len: usize, shift: u32) -> MemoryError {
        MemoryError::Capacity {
            requested: len,
            class_bytes: 1 << shift,
            free_slab_bytes: st.free_slabs.len() << self.slab_shift,
            free_bytes: self.capacity_bytes - st.used_bytes,
            capacity_bytes: self.capacity_bytes,
        }
    }

    /// The block at `offset`, just taken from the free lists, as its one
    /// writable handle.
    fn hand_out(self: &Arc<Self>, offset: usize, len: usize, shift: u32) -> BlockMut {
        // Ordering: the block is handed to this thread only; the mutex
        // already orders it after the release that freed the slot.
        self.refcount(offset).store(1, Ordering::Relaxed);
        // The slot's last occupant's checksum is not this block's.
        self.crc_slot(offset).store(0, Ordering::Relaxed);
        // SAFETY: `take` returned an offset of a block inside the arena
        // (slab index < slab_count, block index < blocks per slab), so the
        // pointer stays within the mapping and is non-null.
        let ptr = unsafe { NonNull::new_unchecked(self.arena.base().as_ptr().add(offset)) };
        BlockMut::new(Arc::clone(self), ptr, len, offset, 1 << shift)
    }

    /// Returns a block's memory; called by the last owner.
    fn release(&self, offset: usize, len: usize) {
        self.release_locked(&mut self.lock(), offset, len);
    }

    /// Returns the memory of blocks whose last owners are gone, (offset,
    /// len) each, under one acquisition of the lock.
    fn release_many(&self, freed: &[(usize, usize)]) {
        if freed.is_empty() {
            return;
        }
        let mut st = self.lock();
        for &(offset, len) in freed {
            self.release_locked(&mut st, offset, len);
        }
    }

    fn release_locked(&self, st: &mut PoolState, offset: usize, len: usize) {
        let slab_idx = offset >> self.slab_shift;
        let class = st.slabs[slab_idx].class as usize;
        debug_assert!(class < self.classes, "release of a block in an unassigned slab page");
        let shift = self.min_shift + class as u32;
        st.used_bytes -= 1 << shift;
        st.requested_bytes -= len;
        st.blocks -= 1;
        st.class_blocks[class] -= 1;
        st.give_back(slab_idx as u32, ((offset & ((1 << self.slab_shift) - 1)) >> shift) as u32, class, shift, self.slab_shift);
    }

    fn refcount(&self, offset: usize) -> &AtomicU32 {
        &self.slots[offset >> self.min_shift].refcount
    }

    /// The block at `offset`'s checksum: `KNOWN_CRC | crc`, or 0.
    fn crc_slot(&self, offset: usize) -> &AtomicU64 {
        &self.slots[offset >> self.min_shift].crc
    }

    /// A poisoned lock means a panic elsewhere while the lists were being
    /// edited; every edit is a handful of field writes with no panicking
    /// call in between, so the state is still consistent and serving on is
    /// better than failing every later request.
    fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn stats(&self) -> PoolStats {
        let st = self.lock();
        PoolStats {
            capacity_bytes: self.capacity_bytes,
            used_bytes: st.used_bytes,
            requested_bytes: st.requested_bytes,
            blocks: st.blocks,
            slab_bytes: 1 << self.slab_shift,
            slabs_total: st.slabs.len(),
            slabs_free: st.free_slabs.len(),
            failed_allocations: st.failed,
            huge_pages: self.arena.huge_pages,
            locked: self.arena.locked,
            classes: (0..self.classes)
                .map(|c| ClassStats { block_bytes: 1 << (self.min_shift + c as u32), blocks: st.class_blocks[c], slabs: st.class_slabs[c] })
                .collect(),
        }
    }
}

impl PoolState {
    /// [`take`](Self::take), counting the block as live (`len` bytes asked
    /// for, in a class of `1 << shift`).
    fn take_counted(&mut self, class: usize, shift: u32, len: usize, slab_shift: u32) -> Option<usize> {
        let offset = self.take(class, shift, slab_shift)?;
        self.used_bytes += 1 << shift;
        self.requested_bytes += len;
        self.blocks += 1;
        self.class_blocks[class] += 1;
        Some(offset)
    }

    /// Pops a free block of `class`, assigning a free slab page when no page
    /// of the class has room. Returns the block's byte offset in the arena.
    fn take(&mut self, class: usize, shift: u32, slab_shift: u32) -> Option<usize> {
        let per_slab = 1u32 << (slab_shift - shift);
        let mut idx = self.partial[class];
        if idx == NIL {
            idx = self.free_slabs.pop()?;
            let slab = &mut self.slabs[idx as usize];
            slab.class = class as u8;
            slab.used = 0;
            slab.fresh = 0;
            slab.free.clear();
            self.class_slabs[class] += 1;
            self.link(class, idx);
        }
        let slab = &mut self.slabs[idx as usize];
        let block = match slab.free.pop() {
            Some(b) => b,
            None => {
                let b = slab.fresh;
                slab.fresh += 1;
                b
            }
        };
        slab.used += 1;
        if slab.free.is_empty() && slab.fresh == per_slab {
            self.unlink(class, idx);
        }
        Some(((idx as usize) << slab_shift) + ((block as usize) << shift))
    }

    fn give_back(&mut self, idx: u32, block: u32, class: usize, shift: u32, slab_shift: u32) {
        let per_slab = 1u32 << (slab_shift - shift);
        let slab = &mut self.slabs[idx as usize];
        let was_full = slab.free.is_empty() && slab.fresh == per_slab;
        slab.used -= 1;
        if slab.used == 0 {
            slab.class = UNASSIGNED;
            slab.free.clear();
            slab.fresh = 0;
            if !was_full {
                self.unlink(class, idx);
            }
            self.class_slabs[class] -= 1;
            self.free_slabs.push(idx);
            return;
        }
        slab.free.push(block);
        if was_full {
            self.link(class, idx);
        }
    }

    fn link(&mut self, class: usize, idx: u32) {
        let head = self.partial[class];
        {
            let slab = &mut self.slabs[idx as usize];
            slab.prev = NIL;
            slab.next = head;
        }
        if head != NIL {
            self.slabs[head as usize].prev = idx;
        }
        self.partial[class] = idx;
    }

    fn unlink(&mut self, class: usize, idx: u32) {
        let (prev, next) = {
            let slab = &self.slabs[idx as usize];
            (slab.prev, slab.next)
        };
        if prev == NIL {
            self.partial[class] = next;
        } else {
            self.slabs[prev as usize].next = next;
        }
        if next != NIL {
            self.slabs[next as usize].prev = prev;
        }
        let slab = &mut self.slabs[idx as usize];
        slab.prev = NIL;
        slab.next = NIL;
    }
}

#[cfg(test)]
mod tests;
