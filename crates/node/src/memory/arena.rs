//! The one anonymous mapping every block lives in.
//!
//! Reserving the whole pool in one `mmap` up front means block allocation
//! never calls into the system allocator, the memory footprint of a node is
//! fixed at start (what an operator sizing a pod wants), and huge pages and
//! `mlock` can be requested once for the whole range.

use std::io;
use std::ptr::NonNull;

use super::{HugePageMode, MemoryError};

/// Size of an explicit (hugetlbfs) huge page on x86-64 and most aarch64
/// kernels; a `MAP_HUGETLB` mapping length must be a multiple of it.
const HUGE_PAGE_BYTES: usize = 2 << 20;

/// An owned anonymous mapping, unmapped on drop.
pub(crate) struct Arena {
    ptr: NonNull<u8>,
    /// Length of the mapping itself (may exceed the usable capacity when it
    /// was rounded up to whole huge pages).
    mapped_len: usize,
    pub(crate) huge_pages: HugePageMode,
    pub(crate) locked: bool,
}

// SAFETY: `Arena` is only an owned address range; it hands out no references
// itself. Concurrent access to the bytes is governed by the pool, which gives
// each block to exactly one owner at a time.
unsafe impl Send for Arena {}
// SAFETY: as above; `&Arena` exposes only the base pointer and metadata.
unsafe impl Sync for Arena {}

impl Arena {
    /// Maps `len` bytes, trying what was asked for and degrading with a
    /// warning (never an error) when the system refuses huge pages or
    /// `mlock`: a cache node that runs without them is slower, one that
    /// refuses to start is down.
    pub(crate) fn map(len: usize, huge_pages: bool, mlock: bool, prefault: bool) -> Result<Arena, MemoryError> {
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
        // mlock faults every page in anyway; populating first would do it
        // twice.
        let populate = prefault && !mlock;
        let mut arena = None;
        if huge_pages {
            let huge_len = len.div_ceil(HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES;
            let populated = if populate { libc::MAP_POPULATE } else { 0 };
            match mmap(huge_len, flags | libc::MAP_HUGETLB | populated) {
                Ok(ptr) => {
                    arena = Some(Arena { ptr, mapped_len: huge_len, huge_pages: HugePageMode::Explicit, locked: false });
                }
                Err(err) => {
                    tracing::warn!(
                        bytes = huge_len,
                        error = %err,
                        "explicit huge pages refused: mmap(MAP_HUGETLB) failed ({err}); reserve them with \
                         vm.nr_hugepages (or the pod's hugepages-2Mi resource). Falling back to transparent huge pages"
                    );
                }
            }
        }
        let mut arena = match arena {
            Some(arena) => arena,
            None => {
                // Populated only after the huge page advice below: pages
                // faulted in before it (MAP_POPULATE did) are 4 KiB pages,
                // which the kernel merges into huge ones slowly if ever, so
                // `--huge-pages --prefault` got no huge pages at all.
                let populated = if populate && !huge_pages { libc::MAP_POPULATE } else { 0 };
                let ptr = mmap(len, flags | populated).map_err(|source| MemoryError::Map { bytes: len, source })?;
                let mut arena = Arena { ptr, mapped_len: len, huge_pages: HugePageMode::None, locked: false };
                if huge_pages {
                    // SAFETY: the range is exactly the mapping created above,
                    // which this function owns; madvise does not touch contents.
                    let rc = unsafe { libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_HUGEPAGE) };
                    if rc == 0 {
                        arena.huge_pages = HugePageMode::Transparent;
                    } else {
                        let err = io::Error::last_os_error();
                        tracing::warn!(
                            bytes = len,
                            error = %err,
                            "transparent huge pages refused: madvise(MADV_HUGEPAGE) failed ({err}); the kernel may \
                             lack CONFIG_TRANSPARENT_HUGEPAGE or have it set to 'never'. Continuing with 4 KiB pages"
                        );
                    }
                }
                if populate && huge_pages {
                    arena.populate(len);
                }
                arena
            }
        };
        if mlock {
            // SAFETY: the range is the mapping owned by `arena`; mlock only
            // changes residency, not contents.
            let rc = unsafe { libc::mlock(arena.ptr.as_ptr().cast(), arena.mapped_len) };
            if rc == 0 {
                arena.locked = true;
            } else {
                let err = io::Error::last_os_error();
                tracing::warn!(
                    bytes = arena.mapped_len,
                    error = %err,
                    "mlock refused ({err}): the pool may be swapped out. Raise RLIMIT_MEMLOCK (ulimit -l, or the \
                     container's memlock limit) or grant CAP_IPC_LOCK. Continuing unlocked"
                );
            }
        }
        Ok(arena)
    }

    /// Faults in the first `len` bytes, writable, as `MAP_POPULATE` would
    /// have: `MADV_POPULATE_WRITE` (Linux 5.14), or where the kernel lacks
    /// it a write of a zero to each page (the mapping is fresh and
    /// anonymous, so every byte is zero already and nothing reads it yet).
    /// A refusal is logged and the pool starts anyway: its pages then fault
    /// in as blocks are first written, as without `--prefault`.
    fn populate(&self, len: usize) {
        loop {
            // SAFETY: the range is the start of the mapping `self` owns;
            // the advice faults pages in and changes no contents.
            let rc = unsafe { libc::madvise(self.ptr.as_ptr().cast(), len, libc::MADV_POPULATE_WRITE) };
            if rc == 0 {
                return;
            }
            let err = io::Error::last_os_error();
            match err.raw_os_error() {
                // A signal came first; what it populated stays populated.
                Some(libc::EINTR) => continue,
                // A kernel before 5.14.
                Some(libc::EINVAL) => break,
                _ => {
                    tracing::warn!(
                        bytes = len,
                        error = %err,
                        "prefaulting the pool failed: madvise(MADV_POPULATE_WRITE) refused ({err}); its pages fault \
                         in as blocks are first written"
                    );
                    return;
                }
            }
        }
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok().filter(|&p| p > 0).unwrap_or(4096);
        for offset in (0..len).step_by(page) {
            // SAFETY: `offset < len` is inside the mapping, which nothing
            // else refers to yet (the pool is being built); a volatile write
            // of the zero it holds only makes the kernel fault the page in.
            unsafe { self.ptr.as_ptr().add(offset).write_volatile(0) };
        }
    }

    pub(crate) fn base(&self) -> NonNull<u8> {
        self.ptr
    }
}

fn mmap(len: usize, flags: libc::c_int) -> io::Result<NonNull<u8>> {
    // SAFETY: an anonymous mapping at a kernel-chosen address cannot alias any
    // existing Rust object; the result is checked for MAP_FAILED before use.
    let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, flags, -1, 0) };
    if ptr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned a null address"))
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: the pool (the only owner of the arena) is dropped only once
        // every block has been released, since each block holds an
        // `Arc<MemoryPool>`; nothing refers into the range any more.
        let rc = unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.mapped_len) };
        if rc != 0 {
            tracing::warn!(error = %io::Error::last_os_error(), "munmap of the memory pool failed");
        }
    }
}
