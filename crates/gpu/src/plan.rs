//! Where each block of a batch goes in the staging memory, and in which
//! round: pure arithmetic, kept apart from the driver calls so it is
//! checked (and tested) on machines without a GPU.
//!
//! A batch may be larger than the memory the node shares: it is then cut
//! into rounds, each filling the memory at most once. Blocks are placed at
//! 64-byte boundaries (a cache line, as the client carves its own ranges),
//! in the caller's order.

use crate::GpuError;

/// Alignment of a block's place in the staging memory.
pub(crate) const ALIGN: usize = 64;

/// One block's place: its index in the caller's batch and its offset in
/// the staging memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Slot {
    pub index: usize,
    pub offset: usize,
    pub len: usize,
}

/// Checks a batch of (device pointer, length) pairs and cuts it into
/// rounds that each fit `capacity` bytes of staging memory.
pub(crate) fn rounds(blocks: &[(u64, usize)], capacity: usize) -> Result<Vec<Vec<Slot>>, GpuError> {
    let mut rounds: Vec<Vec<Slot>> = Vec::new();
    let mut used = 0;
    for (index, &(ptr, len)) in blocks.iter().enumerate() {
        if ptr == 0 {
            return Err(GpuError::Invalid(format!("block {index}: a null device pointer")));
        }
        if len > u32::MAX as usize {
            return Err(GpuError::Invalid(format!("block {index}: {len} bytes, more than one block can hold (4 GiB)")));
        }
        if ptr.checked_add(len as u64).is_none() {
            return Err(GpuError::Invalid(format!("block {index}: {len} bytes at {ptr:#x} run past the end of the address space")));
        }
        if len > capacity {
            return Err(GpuError::Invalid(format!(
                "block {index}: {len} bytes do not fit the {capacity}-byte shared memory (raise the node's --shm-region)"
            )));
        }
        let want = len.max(1).div_ceil(ALIGN) * ALIGN;
        if rounds.is_empty() || capacity.saturating_sub(used) < len {
            rounds.push(Vec::new());
            used = 0;
        }
        if let Some(round) = rounds.last_mut() {
            round.push(Slot { index, offset: used, len });
        }
        used = used.saturating_add(want);
    }
    Ok(rounds)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_that_fits_is_one_round_at_aligned_offsets() {
        let r = rounds(&[(0x1000, 100), (0x2000, 64), (0x3000, 1)], 4096).unwrap();
        assert_eq!(r.len(), 1);
        let offsets: Vec<usize> = r[0].iter().map(|s| s.offset).collect();
        assert_eq!(offsets, [0, 128, 192]);
        assert_eq!(r[0].iter().map(|s| s.index).collect::<Vec<_>>(), [0, 1, 2]);
    }

    #[test]
    fn a_larger_batch_is_cut_into_rounds_that_each_fit() {
        let blocks: Vec<(u64, usize)> = (0..10).map(|i| (0x10000 + i * 0x1000, 1000)).collect();
        let r = rounds(&blocks, 4096).unwrap();
        assert_eq!(r.iter().map(Vec::len).collect::<Vec<_>>(), [4, 4, 2]);
        for round in &r {
            for s in round {
                assert!(s.offset + s.len <= 4096);
                assert_eq!(s.offset % ALIGN, 0);
            }
        }
        let order: Vec<usize> = r.iter().flatten().map(|s| s.index).collect();
        assert_eq!(order, (0..10).collect::<Vec<_>>(), "the caller's order is kept");
    }

    #[test]
    fn a_block_that_exactly_fills_the_memory_is_accepted() {
        let r = rounds(&[(0x1000, 4096), (0x9000, 4096)], 4096).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r[1][0].offset, 0);
    }

    #[test]
    fn bad_arguments_are_refused_with_the_block_named() {
        let err = |blocks: &[(u64, usize)]| rounds(blocks, 4096).unwrap_err().to_string();
        assert!(err(&[(0x1000, 1), (0, 1)]).contains("block 1: a null device pointer"));
        assert!(err(&[(0x1000, 4097)]).contains("--shm-region"));
        assert!(err(&[(u64::MAX - 10, 100)]).contains("past the end"));
        assert!(rounds(&[(0x1000, 1usize << 33)], usize::MAX).unwrap_err().to_string().contains("4 GiB"));
    }

    #[test]
    fn an_empty_batch_has_no_rounds() {
        assert!(rounds(&[], 4096).unwrap().is_empty());
    }
}
