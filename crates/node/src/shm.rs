//! Memory a node shares with one local client (a Unix-socket connection):
//! a sealed memfd, mapped by both.
//!
//! Why a node-made memfd rather than the client's own memory: the node must
//! never fault on it. It creates the file, sizes it and seals it against
//! shrinking and growing before the client sees it, so no client can make
//! the node's mapping point past the end of the file (the `SIGBUS` a
//! truncated shared file raises); what the client does to its own mapping
//! (unmap it, scribble on it) cannot reach the node's.
//!
//! Why raw copies and no references: the client writes this memory whenever
//! it likes, so the node never forms a `&[u8]` over it (that would promise
//! Rust the bytes cannot change). It only copies ranges in and out with
//! `ptr::copy_nonoverlapping`, into and out of memory it owns, and checks a
//! copied block's checksum on its own copy.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;

/// Bytes copied before they are checksummed (see `copy_out_checksummed`).
const CHECKSUM_CHUNK: usize = 32 << 10;

/// One connection's shared memory.
pub(crate) struct SharedRegion {
    ptr: NonNull<u8>,
    len: usize,
    file: OwnedFd,
}

// SAFETY: the region is a plain shared mapping owned by this value; the node
// reads and writes it only through `copy_in` / `copy_out`, which take `&mut
// self` or `&self` and copy with raw pointers. Moving it to another thread,
// or copying out of it from several, cannot create a data race the Rust
// model would see: no references into the mapping ever exist.
unsafe impl Send for SharedRegion {}
// SAFETY: see `Send`; `copy_out` only reads through a raw pointer.
unsafe impl Sync for SharedRegion {}

/// A range of the region that is not inside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("bytes {offset}..{offset}+{len} are outside the {size}-byte shared memory")]
pub(crate) struct OutOfRange {
    pub offset: u64,
    pub len: u64,
    pub size: u64,
}

impl SharedRegion {
    /// A fresh memfd of `len` bytes (zeroed, pages allocated on first touch),
    /// sealed against resizing, mapped shared.
    pub(crate) fn create(len: usize) -> io::Result<SharedRegion> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "a shared memory of 0 bytes"));
        }
        // SAFETY: a NUL-terminated name and documented flags; the returned
        // descriptor is checked and then owned by `file`.
        let fd = unsafe { libc::memfd_create(c"kvplane-shm".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by memfd_create and nothing else owns it.
        let file = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate and fcntl on a descriptor this function owns.
        unsafe {
            if libc::ftruncate(file.as_raw_fd(), len as libc::off_t) != 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL) != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        // SAFETY: a fresh shared mapping of a file of exactly `len` bytes that
        // can no longer shrink; the result is checked before use and unmapped
        // in `Drop`.
        let ptr =
            unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, file.as_raw_fd(), 0) };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(SharedRegion { ptr, len, file })
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The memfd, to hand to the client.
    pub(crate) fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// Where `offset..offset + len` starts, if it lies inside the region.
    pub(crate) fn check(&self, offset: u64, len: usize) -> Result<usize, OutOfRange> {
        let out = OutOfRange { offset, len: len as u64, size: self.len as u64 };
        let start = usize::try_from(offset).map_err(|_| out)?;
        match start.checked_add(len) {
            Some(end) if end <= self.len => Ok(start),
            _ => Err(out),
        }
    }

    /// Copies `dst.len()` bytes at `offset` of the region into `dst`.
    pub(crate) fn copy_out(&self, offset: u64, dst: &mut [u8]) -> Result<(), OutOfRange> {
        let start = self.check(offset, dst.len())?;
        // SAFETY: `start..start + dst.len()` lies inside the mapping (checked
        // above; the file cannot shrink), `dst` is memory this process owns
        // exclusively, and the two cannot overlap (the mapping is never lent
        // out as a Rust slice).
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(start), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// As [`SharedRegion::copy_out`], answering the CRC-32C of what was
    /// copied: copied and checksummed a chunk at a time, so the checksum
    /// reads bytes still in the first-level cache instead of making a second
    /// pass over memory.
    pub(crate) fn copy_out_checksummed(&self, offset: u64, dst: &mut [u8]) -> Result<u32, OutOfRange> {
        self.check(offset, dst.len())?;
        let mut crc = 0;
        for (i, chunk) in dst.chunks_mut(CHECKSUM_CHUNK).enumerate() {
            self.copy_out(offset + (i * CHECKSUM_CHUNK) as u64, chunk)?;
            crc = crc32c::crc32c_append(crc, chunk);
        }
        Ok(crc)
    }

    /// Copies `src` to `offset` of the region.
    pub(crate) fn copy_in(&self, offset: u64, src: &[u8]) -> Result<(), OutOfRange> {
        let start = self.check(offset, src.len())?;
        // SAFETY: as in `copy_out`, with the roles of the ranges swapped.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(start), src.len()) };
        Ok(())
    }

    /// As [`SharedRegion::copy_in`], answering the CRC-32C of `src` (the
    /// node's own bytes, never the region the client can write): each chunk
    /// is checksummed right after its copy, while it is still in the
    /// first-level cache, instead of in a pass over memory of its own.
    pub(crate) fn copy_in_checksummed(&self, offset: u64, src: &[u8]) -> Result<u32, OutOfRange> {
        self.check(offset, src.len())?;
        let mut crc = 0;
        for (i, chunk) in src.chunks(CHECKSUM_CHUNK).enumerate() {
            self.copy_in(offset + (i * CHECKSUM_CHUNK) as u64, chunk)?;
            crc = crc32c::crc32c_append(crc, chunk);
        }
        Ok(crc)
    }
}

impl Drop for SharedRegion {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in `create`, unmapped once.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// Sends `frame` on the Unix socket `fd` with `pass` attached as one
/// `SCM_RIGHTS` descriptor, in a single `sendmsg`. `Ok(n)`: bytes of the
/// frame sent (the caller writes the rest normally).
pub(crate) fn send_with_fd(fd: RawFd, frame: &[u8], pass: RawFd) -> io::Result<usize> {
    let mut iov = libc::iovec { iov_base: frame.as_ptr() as *mut libc::c_void, iov_len: frame.len() };
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: a zeroed msghdr is a valid empty one; every pointer set below
    // points at live buffers of the stated lengths for the call's duration.
    let sent = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), pass);
        libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL)
    };
    if sent < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(sent as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_outside_the_region_are_refused() {
        let r = SharedRegion::create(4096).unwrap();
        r.copy_in(4000, &[1u8; 96]).unwrap();
        let mut back = [0u8; 96];
        r.copy_out(4000, &mut back).unwrap();
        assert_eq!(back, [1u8; 96]);
        assert!(r.copy_in(4001, &[1u8; 96]).is_err());
        assert!(r.copy_out(u64::MAX, &mut back).is_err());
        assert!(r.copy_out(u64::MAX - 10, &mut [0u8; 20]).is_err());
    }

    #[test]
    fn a_checksummed_copy_answers_the_crc_of_the_block() {
        let r = SharedRegion::create(1 << 20).unwrap();
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 253) as u8).collect();
        r.copy_in(12345, &data).unwrap();
        let mut back = vec![0u8; data.len()];
        assert_eq!(r.copy_out_checksummed(12345, &mut back).unwrap(), crc32c::crc32c(&data));
        assert_eq!(back, data);
        assert!(r.copy_out_checksummed((1 << 20) - 10, &mut back).is_err());

        // The other way: what was copied in, and its checksum (the same as
        // the protocol's, which GET answers carry).
        let r = SharedRegion::create(1 << 20).unwrap();
        assert_eq!(r.copy_in_checksummed(777, &data).unwrap(), kvplane_protocol::checksum(&data));
        let mut back = vec![0u8; data.len()];
        r.copy_out(777, &mut back).unwrap();
        assert_eq!(back, data);
        assert!(r.copy_in_checksummed((1 << 20) - 10, &data).is_err());
    }

    #[test]
    fn the_memfd_cannot_be_shrunk_or_grown() {
        let r = SharedRegion::create(1 << 20).unwrap();
        // SAFETY: ftruncate on a descriptor the region owns (what a hostile
        // client holding a copy of it would try).
        let shrink = unsafe { libc::ftruncate(r.fd(), 4096) };
        assert_ne!(shrink, 0, "a sealed memfd refused to shrink");
        // SAFETY: as above.
        let grow = unsafe { libc::ftruncate(r.fd(), 2 << 20) };
        assert_ne!(grow, 0);
        let mut tail = [0u8; 16];
        r.copy_out((1 << 20) - 16, &mut tail).unwrap();
    }
}
