//! The client's side of the shared-memory path: receiving the memfd a node
//! hands over (`SCM_RIGHTS`), mapping it, and carving it into ranges.
//!
//! Why copies through methods rather than slices: the node writes this
//! memory while serving a GET_SHM, so a long-lived `&[u8]` over it would be
//! a promise Rust cannot keep. [`SharedMemory::write_at`] and
//! [`SharedMemory::read_at`] copy with raw pointers; callers that hand the
//! memory to a device (a GPU copy engine) take [`SharedMemory::as_ptr`] and
//! keep to ranges no request in flight uses.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::Mutex;

use kvplane_protocol::KvError;

/// The memory a node shares with one connection.
pub struct SharedMemory {
    ptr: NonNull<u8>,
    len: usize,
    _file: OwnedFd,
    free: Mutex<Vec<(usize, usize)>>,
}

// SAFETY: a shared mapping owned by this value, accessed only by raw-pointer
// copies (`write_at`, `read_at`); no references into it exist, so moving or
// sharing the handle across threads cannot make a data race visible to Rust.
unsafe impl Send for SharedMemory {}
// SAFETY: see `Send`.
unsafe impl Sync for SharedMemory {}

/// Alignment of carved ranges: a cache line, so two requests' ranges never
/// share one.
const ALIGN: usize = 64;

impl SharedMemory {
    /// Maps `file` (`len` bytes) shared, read-write.
    pub(crate) fn map(file: OwnedFd, len: usize) -> io::Result<SharedMemory> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "the node offered 0 bytes of shared memory"));
        }
        // The node sealed the file against shrinking; check that it really
        // is that long, so no access can run past its end.
        // SAFETY: fstat on a descriptor this function owns, into a zeroed struct.
        let size = unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(file.as_raw_fd(), &mut st) != 0 {
                return Err(io::Error::last_os_error());
            }
            st.st_size as u64
        };
        if size < len as u64 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("the shared file has {size} bytes, {len} were announced")));
        }
        // SAFETY: a fresh shared mapping of `len` bytes of a file at least
        // that long; checked before use and unmapped in `Drop`.
        let ptr =
            unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, file.as_raw_fd(), 0) };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(SharedMemory { ptr, len, _file: file, free: Mutex::new(vec![(0, len)]) })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The start of the mapping, for device copies (see the module docs).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// `Ok` when `offset..offset + len` lies inside the memory.
    pub fn check(&self, offset: usize, len: usize) -> Result<(), KvError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(KvError::Invalid(format!("bytes {offset}..{offset}+{len} are outside the {}-byte shared memory", self.len))),
        }
    }

    /// Copies `src` to `offset`.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<(), KvError> {
        self.check(offset, src.len())?;
        // SAFETY: the range is inside the mapping (checked); `src` is the
        // caller's own memory, never part of the mapping's Rust view (there
        // is none), so the ranges do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(offset), src.len()) };
        Ok(())
    }

    /// Copies `dst.len()` bytes at `offset` into `dst`.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<(), KvError> {
        self.check(offset, dst.len())?;
        // SAFETY: as in `write_at`, the other way round.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// CRC-32C of `len` bytes at `offset`, read through a small private
    /// buffer (the shared bytes are never borrowed as a slice).
    pub fn checksum(&self, offset: usize, len: usize) -> Result<u32, KvError> {
        self.check(offset, len)?;
        let mut buf = [0u8; 16 << 10];
        let mut crc = 0u32;
        let mut at = 0;
        while at < len {
            let n = (len - at).min(buf.len());
            self.read_at(offset + at, &mut buf[..n])?;
            crc = crc32c::crc32c_append(crc, &buf[..n]);
            at += n;
        }
        Ok(crc)
    }

    /// Reserves `len` bytes (first fit); `None` when no gap is that large.
    pub(crate) fn reserve(&self, len: usize) -> Option<Range<'_>> {
        let want = len.max(1).div_ceil(ALIGN) * ALIGN;
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let i = free.iter().position(|&(start, end)| end - start >= want)?;
        let (start, end) = free[i];
        if end - start == want {
            free.remove(i);
        } else {
            free[i].0 = start + want;
        }
        Some(Range { memory: self, offset: start, len: want })
    }

    fn release(&self, offset: usize, len: usize) {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let i = free.partition_point(|&(start, _)| start < offset);
        free.insert(i, (offset, offset + len));
        // Merge with the neighbours.
        if i + 1 < free.len() && free[i].1 == free[i + 1].0 {
            free[i].1 = free[i + 1].1;
            free.remove(i + 1);
        }
        if i > 0 && free[i - 1].1 == free[i].0 {
            free[i - 1].1 = free[i].1;
            free.remove(i);
        }
    }
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in `map`, unmapped once.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// A reserved range of the shared memory, given back when dropped.
pub(crate) struct Range<'a> {
    memory: &'a SharedMemory,
    pub(crate) offset: usize,
    pub(crate) len: usize,
}

impl Drop for Range<'_> {
    fn drop(&mut self) {
        self.memory.release(self.offset, self.len);
    }
}

/// Receives up to `buf.len()` bytes from the Unix socket `fd`, and the one
/// descriptor sent with them if any.
pub(crate) fn recv_with_fd(fd: RawFd, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: a zeroed msghdr is a valid empty one; its pointers point at live
    // buffers of the stated lengths for the call. A descriptor in the answer
    // is taken into an OwnedFd exactly once (MSG_CMSG_CLOEXEC: not inherited).
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        let n = libc::recvmsg(fd, &mut msg, libc::MSG_CMSG_CLOEXEC);
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut passed = None;
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let fd = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>());
                passed = Some(OwnedFd::from_raw_fd(fd));
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
        Ok((n as usize, passed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memory(len: usize) -> SharedMemory {
        // SAFETY: memfd_create with a NUL-terminated name; the descriptor is
        // checked and owned at once; ftruncate sizes it.
        let file = unsafe {
            let fd = libc::memfd_create(c"test".as_ptr(), libc::MFD_CLOEXEC);
            assert!(fd >= 0);
            assert_eq!(libc::ftruncate(fd, len as libc::off_t), 0);
            OwnedFd::from_raw_fd(fd)
        };
        SharedMemory::map(file, len).unwrap()
    }

    #[test]
    fn ranges_are_carved_and_given_back() {
        let m = memory(4096);
        let a = m.reserve(1000).unwrap();
        let b = m.reserve(1000).unwrap();
        assert_eq!((a.offset, a.len, b.offset), (0, 1024, 1024));
        assert!(m.reserve(3000).is_none(), "only 2048 bytes are left");
        drop(a);
        drop(b);
        assert_eq!(m.reserve(4096).map(|r| r.len), Some(4096), "freed ranges merge back into one");
    }

    #[test]
    fn copies_outside_the_memory_are_refused() {
        let m = memory(4096);
        m.write_at(4090, &[7; 6]).unwrap();
        let mut back = [0u8; 6];
        m.read_at(4090, &mut back).unwrap();
        assert_eq!(back, [7; 6]);
        assert!(m.write_at(4091, &[7; 6]).is_err());
        assert!(m.read_at(usize::MAX, &mut back).is_err());
    }
}
