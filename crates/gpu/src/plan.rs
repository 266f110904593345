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

/// Rounds for a pipelined batch, and whether consecutive rounds use
/// disjoint memory (so one round's device copies may run while the node
/// copies the other's).
#[derive(Debug)]
pub(crate) struct Staging {
    pub rounds: Vec<Vec<Slot>>,
    pub alternating: bool,
}

/// As [`rounds`], but a batch that needs several rounds alternates between
/// the two halves of the memory when every block fits a half: round `k`
/// and round `k + 1` then never share a byte.
pub(crate) fn staging(blocks: &[(u64, usize)], capacity: usize) -> Result<Staging, GpuError> {
    let whole = rounds(blocks, capacity)?;
    if whole.len() <= 1 {
        return Ok(Staging { rounds: whole, alternating: false });
    }
    let half = capacity / 2 / ALIGN * ALIGN;
    match rounds(blocks, half) {
        Ok(mut halves) if half > 0 => {
            for round in halves.iter_mut().skip(1).step_by(2) {
                for slot in round.iter_mut() {
                    slot.offset += half;
                }
            }
            Ok(Staging { rounds: halves, alternating: true })
        }
        _ => Ok(Staging { rounds: whole, alternating: false }),
    }
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

    #[test]
    fn several_rounds_alternate_between_the_halves() {
        let blocks: Vec<(u64, usize)> = (0..10).map(|i| (0x10000 + i * 0x1000, 1000)).collect();
        let s = staging(&blocks, 4096).unwrap();
        assert!(s.alternating);
        assert_eq!(s.rounds.iter().map(Vec::len).collect::<Vec<_>>(), [2, 2, 2, 2, 2]);
        for (k, round) in s.rounds.iter().enumerate() {
            for slot in round {
                let (lo, hi) = if k % 2 == 0 { (0, 2048) } else { (2048, 4096) };
                assert!(slot.offset >= lo && slot.offset + slot.len <= hi, "round {k}: {slot:?}");
            }
        }
        let order: Vec<usize> = s.rounds.iter().flatten().map(|s| s.index).collect();
        assert_eq!(order, (0..10).collect::<Vec<_>>());
    }

    #[test]
    fn one_round_uses_the_whole_memory_and_blocks_over_a_half_do_not_alternate() {
        let s = staging(&[(0x1000, 3000)], 4096).unwrap();
        assert_eq!((s.rounds.len(), s.alternating), (1, false));
        let s = staging(&[(0x1000, 3000), (0x9000, 3000)], 4096).unwrap();
        assert_eq!((s.rounds.len(), s.alternating), (2, false));
        assert!(s.rounds.iter().all(|r| r[0].offset == 0));
    }
}
