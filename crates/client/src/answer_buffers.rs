//! The buffers GET answers are read into, kept for reuse.
//!
//! An owned GET ([`Client::get`](crate::Client::get)) reads its whole answer
//! into one buffer and hands out each key's block as a slice of it. A fresh
//! multi-megabyte buffer comes from `mmap` or from a heap the allocator
//! trimmed after the last one was freed, so every 4 KiB page of it faults,
//! and is zeroed by the kernel, the first time answer bytes land in it: at
//! 4 × 2 MiB batched GETs over loopback that was up to ~100,000 page faults
//! a second, and several percent of the throughput (`scripts/bench-node`).
//!
//! So a buffer whose blocks were all dropped comes back here (the last
//! slice's drop returns it, from whichever thread that is), and the next
//! answer that fits is read into it: its pages are already mapped. The
//! bytes a reader sees are only ever the ones this answer wrote: a buffer
//! is emptied before it is lent again and filled by appending, never
//! exposed past what was read into it.
//!
//! Bounds: idle buffers of one client hold at most
//! [`ClientConfig::answer_buffer_pool_bytes`](crate::ClientConfig) bytes
//! (default [`DEFAULT_POOL_BYTES`]); a buffer that would push the pool over
//! it makes room by dropping the smallest idle ones, and one larger than the
//! whole bound is freed. Answers under [`MIN_POOLED_BYTES`] are left to the
//! allocator, whose free lists serve small buffers without faults. Counters:
//! [`Client::answer_buffer_stats`](crate::Client::answer_buffer_stats).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use bytes::Bytes;
use kvplane_protocol::io::PayloadBuffers;

/// Idle answer buffers a client keeps by default: room for a few answers
/// of 4 × 2 MiB in flight on each of the default 4 connections.
pub const DEFAULT_POOL_BYTES: usize = 64 << 20;

/// Answers shorter than this are read into a new allocation and never
/// pooled.
pub const MIN_POOLED_BYTES: usize = 256 << 10;

/// What a client's answer buffers did since it connected.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AnswerBufferStats {
    /// Answers read into a buffer an earlier answer had used.
    pub reused: u64,
    /// Answers of at least [`MIN_POOLED_BYTES`] that found no idle buffer
    /// large enough and were read into a new one.
    pub allocated: u64,
    /// Idle buffers freed to keep the pool within its bound.
    pub evicted: u64,
    /// Bytes (capacity) of the buffers idle now.
    pub idle_bytes: usize,
}

/// One client's idle answer buffers (shared by its connections).
#[derive(Debug)]
pub(crate) struct AnswerBuffers {
    bound: usize,
    idle: Mutex<Idle>,
    reused: AtomicU64,
    allocated: AtomicU64,
    evicted: AtomicU64,
}

#[derive(Debug, Default)]
struct Idle {
    buffers: Vec<Vec<u8>>,
    /// The sum of `buffers`' capacities.
    bytes: usize,
}

impl AnswerBuffers {
    pub(crate) fn new(bound: usize) -> Arc<AnswerBuffers> {
        Arc::new(AnswerBuffers {
            bound,
            idle: Mutex::new(Idle::default()),
            reused: AtomicU64::new(0),
            allocated: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
        })
    }

    pub(crate) fn stats(&self) -> AnswerBufferStats {
        AnswerBufferStats {
            reused: self.reused.load(Ordering::Relaxed),
            allocated: self.allocated.load(Ordering::Relaxed),
            evicted: self.evicted.load(Ordering::Relaxed),
            idle_bytes: self.lock().bytes,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Idle> {
        // The lock guards plain bookkeeping that no panic leaves half-done.
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes back a buffer whose last block was dropped.
    fn give_back(&self, mut buf: Vec<u8>) {
        let size = buf.capacity();
        if size > self.bound {
            return;
        }
        buf.clear();
        let mut idle = self.lock();
        // Make room by the smallest first: the larger a buffer, the more
        // faults its reuse saves.
        while idle.bytes + size > self.bound {
            let (smallest, _) = idle.buffers.iter().enumerate().min_by_key(|(_, b)| b.capacity()).expect("over the bound, so not empty");
            let dropped = idle.buffers.swap_remove(smallest);
            idle.bytes -= dropped.capacity();
            self.evicted.fetch_add(1, Ordering::Relaxed);
        }
        idle.bytes += size;
        idle.buffers.push(buf);
    }
}

/// The reader's side: [`kvplane_protocol::io::read_payloads`] takes and
/// freezes its buffers here.
#[derive(Debug, Clone)]
pub(crate) struct PooledBuffers(pub(crate) Arc<AnswerBuffers>);

impl PayloadBuffers for PooledBuffers {
    fn take(&self, len: usize) -> Vec<u8> {
        if len < MIN_POOLED_BYTES {
            return Vec::with_capacity(len);
        }
        let pool = &self.0;
        let mut idle = pool.lock();
        // The smallest idle buffer that holds the answer.
        let fit = idle.buffers.iter().enumerate().filter(|(_, b)| b.capacity() >= len).min_by_key(|(_, b)| b.capacity()).map(|(i, _)| i);
        match fit {
            Some(i) => {
                let buf = idle.buffers.swap_remove(i);
                idle.bytes -= buf.capacity();
                pool.reused.fetch_add(1, Ordering::Relaxed);
                buf
            }
            None => {
                drop(idle);
                pool.allocated.fetch_add(1, Ordering::Relaxed);
                Vec::with_capacity(len)
            }
        }
    }

    fn freeze(&self, buf: Vec<u8>) -> Bytes {
        if buf.capacity() < MIN_POOLED_BYTES {
            return Bytes::from(buf);
        }
        Bytes::from_owner(Lent { buf, pool: Arc::downgrade(&self.0) })
    }
}

/// A pooled buffer while slices of it are out: its drop (the last slice's)
/// hands it back, unless the client is gone.
struct Lent {
    buf: Vec<u8>,
    pool: Weak<AnswerBuffers>,
}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.upgrade() {
            pool.give_back(std::mem::take(&mut self.buf));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filled(buffers: &PooledBuffers, len: usize, byte: u8) -> Bytes {
        let mut buf = buffers.take(len);
        assert!(buf.is_empty(), "a lent buffer starts empty");
        buf.resize(len, byte);
        buffers.freeze(buf)
    }

    #[test]
    fn a_buffer_comes_back_once_its_last_slice_is_dropped_and_is_read_into_again() {
        let buffers = PooledBuffers(AnswerBuffers::new(DEFAULT_POOL_BYTES));
        let mut answer = filled(&buffers, 1 << 20, 7);
        let first = answer.split_to(512 << 10);
        let address = first.as_ptr();
        drop(first);
        assert_eq!(buffers.0.stats().idle_bytes, 0, "a slice is still out");
        drop(answer);
        assert_eq!(buffers.0.stats().idle_bytes, 1 << 20);
        let again = buffers.take(1 << 20);
        assert_eq!(again.as_ptr(), address, "the same memory, not a new allocation");
        assert_eq!(buffers.0.stats(), AnswerBufferStats { reused: 1, allocated: 1, evicted: 0, idle_bytes: 0 });
    }

    #[test]
    fn small_answers_are_not_pooled() {
        let buffers = PooledBuffers(AnswerBuffers::new(DEFAULT_POOL_BYTES));
        drop(filled(&buffers, MIN_POOLED_BYTES - 1, 1));
        assert_eq!(buffers.0.stats(), AnswerBufferStats::default());
    }

    #[test]
    fn the_smallest_buffer_that_fits_is_lent() {
        let buffers = PooledBuffers(AnswerBuffers::new(DEFAULT_POOL_BYTES));
        let (big, small) = (filled(&buffers, 4 << 20, 1), filled(&buffers, 1 << 20, 2));
        let small_address = small.as_ptr();
        drop((big, small));
        let lent = buffers.take(600 << 10);
        assert_eq!(lent.as_ptr(), small_address);
    }

    #[test]
    fn the_pool_stays_within_its_bound_dropping_the_smallest_idle_buffers_first() {
        let buffers = PooledBuffers(AnswerBuffers::new(3 << 20));
        let (a, b) = (filled(&buffers, 1 << 20, 1), filled(&buffers, 2 << 20, 2));
        drop((a, b));
        assert_eq!(buffers.0.stats().idle_bytes, 3 << 20);
        drop(filled(&buffers, 3 << 20, 3));
        // The 3 MiB buffer was new (nothing idle held it), and coming back it
        // evicted both.
        let stats = buffers.0.stats();
        assert_eq!((stats.allocated, stats.evicted, stats.idle_bytes), (3, 2, 3 << 20));
        drop(filled(&buffers, 4 << 20, 4));
        assert_eq!(buffers.0.stats().idle_bytes, 3 << 20, "a buffer over the whole bound is freed");
    }
}
