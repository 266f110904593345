//! Host memory a plugin sees by handle: the `buffers.buffer` resource.
//!
//! A buffer is a view (offset, length) of a [`Region`]. Regions are either
//! *sources* — payloads to write, shared immutable [`Bytes`] — or
//! *destinations* — memory the host wants filled, which the caller passes
//! as any [`WritableMemory`] (a `Vec`, a pool block, pinned staging memory)
//! and gets back when the call ends. Slicing makes a new view of the same
//! region, so a ranged or layer-wise transfer needs no copy.
//!
//! Why regions are revocable: a plugin may keep a handle the host lent it
//! past the call that lent it (a bug, or a hostile plugin). When the call
//! ends the host takes the memory back out of the region; the stale handle
//! then answers `invalid`, and the plugin can neither read a block that has
//! since been reused nor write into memory the host handed on.
//!
//! Why a `tokio` mutex: `read-into` holds the destination across the socket
//! read (an `.await`); the mutex is never contended, since one instance runs
//! one call at a time, and it makes holding the memory across that wait
//! safe without `unsafe`.

use std::any::Any;
use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::{Mutex, OwnedMutexGuard};

use crate::bindings::WitError as Error;

/// Memory a caller lends to a plugin to be filled (a `get` destination).
pub trait WritableMemory: Send + 'static {
    fn bytes_mut(&mut self) -> &mut [u8];
}

impl WritableMemory for Vec<u8> {
    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}

impl WritableMemory for Box<[u8]> {
    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}

impl WritableMemory for bytes::BytesMut {
    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}

/// [`WritableMemory`] that can be handed back as the caller's own type.
trait Destination: Send {
    fn bytes_mut(&mut self) -> &mut [u8];
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send>;
}

impl<T: WritableMemory> Destination for T {
    fn bytes_mut(&mut self) -> &mut [u8] {
        WritableMemory::bytes_mut(self)
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send> {
        self
    }
}

enum Memory {
    Source(Bytes),
    Destination(Box<dyn Destination>),
    /// Taken back by the host when the call that lent it ended.
    Released,
}

/// The memory behind one or more buffer views.
pub struct Region {
    memory: Arc<Mutex<Memory>>,
    len: usize,
    /// Bytes of this region counted against the instance's `buffer-bytes`
    /// (regions the host allocated for the plugin, `read-buffer`); 0 for
    /// memory the caller lent.
    pub(crate) charged: usize,
}

impl Region {
    /// A source region over `data` (shared, never copied).
    pub(crate) fn source(data: Bytes) -> Arc<Region> {
        let len = data.len();
        Arc::new(Region { memory: Arc::new(Mutex::new(Memory::Source(data))), len, charged: 0 })
    }

    pub(crate) fn allocated(data: Bytes) -> Arc<Region> {
        let len = data.len();
        Arc::new(Region { memory: Arc::new(Mutex::new(Memory::Source(data))), len, charged: len })
    }

    /// A destination region over `memory`.
    pub(crate) fn destination<M: WritableMemory>(mut memory: M) -> Arc<Region> {
        let len = memory.bytes_mut().len();
        Arc::new(Region { memory: Arc::new(Mutex::new(Memory::Destination(Box::new(memory)))), len, charged: 0 })
    }

    /// Take a source's bytes back (ends every view of it).
    pub(crate) fn release(&self) {
        if let Ok(mut m) = self.memory.try_lock() {
            *m = Memory::Released;
        }
    }

    /// Length of the region in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Take a destination's memory back as the caller's type, ending every
    /// view of it. Waits while a driver call still writes into it (one that
    /// ran past its deadline): the memory is never handed back under a
    /// writer.
    pub(crate) async fn reclaim<M: WritableMemory>(&self) -> M {
        let mut m = self.memory.lock().await;
        match std::mem::replace(&mut *m, Memory::Released) {
            Memory::Destination(d) => {
                *d.into_any().downcast::<M>().unwrap_or_else(|_| unreachable!("a region is reclaimed as the type it was made from"))
            }
            _ => unreachable!("a destination region is reclaimed once, by the call that made it"),
        }
    }
}

/// One `buffers.buffer` handle: a view of a region.
pub struct BlockBuffer {
    region: Arc<Region>,
    offset: usize,
    len: usize,
}

impl std::fmt::Debug for BlockBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockBuffer").field("offset", &self.offset).field("len", &self.len).finish()
    }
}

fn released() -> Error {
    Error::Invalid("the buffer was released: the call that lent it has returned".into())
}

impl BlockBuffer {
    /// A view of the whole region.
    pub(crate) fn whole(region: Arc<Region>) -> BlockBuffer {
        let len = region.len;
        BlockBuffer { region, offset: 0, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(crate) fn region(&self) -> &Arc<Region> {
        &self.region
    }

    /// Where this view starts in its region.
    pub(crate) fn offset(&self) -> usize {
        self.offset
    }

    /// Whether the plugin may fill this view.
    pub fn writable(&self) -> bool {
        matches!(self.region.memory.try_lock().as_deref(), Ok(Memory::Destination(_)))
    }

    /// A sub-view; `invalid` when it does not fit in this one.
    pub(crate) fn slice(&self, offset: u64, len: u64) -> Result<BlockBuffer, Error> {
        let start = usize::try_from(offset).ok();
        let end = start.zip(usize::try_from(len).ok()).and_then(|(s, l)| s.checked_add(l));
        match (start, end) {
            (Some(start), Some(end)) if end <= self.len => {
                Ok(BlockBuffer { region: self.region.clone(), offset: self.offset + start, len: end - start })
            }
            _ => Err(Error::Invalid(format!("slice of {len} bytes at offset {offset} is outside a buffer of {} bytes", self.len))),
        }
    }

    /// Copy `len` bytes at `offset` of this view out (a header peek).
    pub(crate) fn peek(&self, offset: u64, len: usize) -> Result<Vec<u8>, Error> {
        let view = self.slice(offset, len as u64)?;
        let m = self.region.memory.try_lock().map_err(|_| Error::Internal("buffer is busy".into()))?;
        let range = view.offset..view.offset + view.len;
        match &*m {
            Memory::Source(b) => Ok(b[range].to_vec()),
            Memory::Destination(_) => Err(Error::Invalid("peek of a destination buffer: it holds no data yet".into())),
            Memory::Released => Err(released()),
        }
    }

    /// The bytes of a source view, shared (no copy), for queueing a write.
    pub(crate) fn source_bytes(&self) -> Result<Bytes, Error> {
        let m = self.region.memory.try_lock().map_err(|_| Error::Internal("buffer is busy".into()))?;
        match &*m {
            Memory::Source(b) => Ok(b.slice(self.offset..self.offset + self.len)),
            Memory::Destination(_) => Err(Error::Invalid("a destination buffer cannot be written out; it is for filling".into())),
            Memory::Released => Err(released()),
        }
    }

    /// Exclusive access to a destination view's memory, held across an
    /// `.await` (the socket read of `read-into`, a driver call).
    pub(crate) async fn lock_destination(&self) -> Result<DestinationGuard, Error> {
        let guard = self.region.memory.clone().lock_owned().await;
        match &*guard {
            Memory::Destination(_) => Ok(DestinationGuard { guard, offset: self.offset, len: self.len }),
            Memory::Source(_) => Err(Error::Invalid("the buffer is a source (a payload to send), not a destination to fill".into())),
            Memory::Released => Err(released()),
        }
    }
}

/// A locked destination view; derefs to its bytes.
pub struct DestinationGuard {
    guard: OwnedMutexGuard<Memory>,
    offset: usize,
    len: usize,
}

impl DestinationGuard {
    /// The whole region this guard locked (for cutting several views).
    pub(crate) fn whole_mut(&mut self) -> &mut [u8] {
        match &mut *self.guard {
            Memory::Destination(d) => d.bytes_mut(),
            _ => &mut [],
        }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        match &mut *self.guard {
            Memory::Destination(d) => &mut d.bytes_mut()[self.offset..self.offset + self.len],
            // `lock_destination` checked the variant and nothing changes it
            // while the guard is held.
            _ => &mut [],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn slices_fill_the_callers_memory_in_place() {
        let region = Region::destination(vec![0u8; 8]);
        let whole = BlockBuffer::whole(region.clone());
        let tail = whole.slice(4, 4).unwrap();
        tail.lock_destination().await.unwrap().bytes_mut().copy_from_slice(b"abcd");
        let inner = tail.slice(1, 2).unwrap();
        inner.lock_destination().await.unwrap().bytes_mut().copy_from_slice(b"XY");
        assert!(whole.slice(5, 4).is_err());
        assert!(whole.slice(u64::MAX, 2).is_err());
        assert_eq!(region.reclaim::<Vec<u8>>().await, b"\0\0\0\0aXYd");
        // The region is the host's again: stale views refuse.
        assert!(matches!(tail.lock_destination().await, Err(Error::Invalid(m)) if m.contains("released")));
    }

    #[tokio::test]
    async fn sources_are_shared_and_revocable() {
        let region = Region::source(Bytes::from_static(b"hello world"));
        let b = BlockBuffer::whole(region.clone()).slice(6, 5).unwrap();
        assert_eq!(&b.source_bytes().unwrap()[..], b"world");
        assert_eq!(b.peek(0, 3).unwrap(), b"wor");
        assert!(b.lock_destination().await.is_err());
        region.release();
        assert!(matches!(b.peek(0, 1), Err(Error::Invalid(_))));
    }
}
