//! The owner's slice allocator: best fit over a free list with immediate coalescing.
//!
//! Free blocks are kept twice: by offset (to find neighbours when a block is freed, so
//! adjacent free blocks always merge) and by `(size, offset)` (to find the smallest block
//! that fits, lowest offset first among equals). Both are `BTreeMap`/`BTreeSet`, so
//! alloc and free are O(log n) in the number of free blocks. Because free blocks are
//! always maximal (never adjacent to each other), an allocation fails only when no gap
//! between live slices is large enough; after everything is freed there is exactly one
//! block spanning the whole capacity.

use std::collections::{BTreeMap, BTreeSet};

use super::ALIGN;

#[derive(Debug)]
pub(crate) struct FreeList {
    capacity: u64,
    by_off: BTreeMap<u64, u64>,
    by_size: BTreeSet<(u64, u64)>,
    free: u64,
}

impl FreeList {
    /// `capacity` must be a multiple of [`ALIGN`].
    pub(crate) fn new(capacity: u64) -> Self {
        debug_assert_eq!(capacity % ALIGN, 0);
        let mut fl = FreeList {
            capacity,
            by_off: BTreeMap::new(),
            by_size: BTreeSet::new(),
            free: 0,
        };
        if capacity > 0 {
            fl.insert(0, capacity);
        }
        fl
    }

    /// The block size a request of `len` bytes occupies: at least one [`ALIGN`] unit
    /// (so zero-length slices still get a distinct offset), rounded up to [`ALIGN`].
    pub(crate) fn block_size(len: u64) -> Option<u64> {
        len.max(1).checked_next_multiple_of(ALIGN)
    }

    /// Allocate `len` bytes; returns the offset, or None when no free block is big enough.
    pub(crate) fn alloc(&mut self, len: u64) -> Option<u64> {
        let size = Self::block_size(len)?;
        let &(bsize, boff) = self.by_size.range((size, 0)..).next()?;
        self.remove(boff, bsize);
        if bsize > size {
            self.insert(boff + size, bsize - size);
        }
        Some(boff)
    }

    /// Return the block at `off` of a `len`-byte allocation. Errors (and changes nothing)
    /// if the block is out of bounds or overlaps a free block, i.e. on a double free.
    pub(crate) fn free(&mut self, off: u64, len: u64) -> Result<(), String> {
        let size = Self::block_size(len).ok_or("length overflows")?;
        let end = off.checked_add(size).ok_or("offset overflows")?;
        if off % ALIGN != 0 || end > self.capacity {
            return Err(format!(
                "block [{off}, {end}) is misaligned or outside capacity {}",
                self.capacity
            ));
        }
        let prev = self.by_off.range(..=off).next_back().map(|(&o, &s)| (o, s));
        let next = self.by_off.range(off..).next().map(|(&o, &s)| (o, s));
        if let Some((po, ps)) = prev {
            if po + ps > off {
                return Err(format!("block [{off}, {end}) overlaps free block at {po}"));
            }
        }
        if let Some((no, _)) = next {
            if no < end {
                return Err(format!("block [{off}, {end}) overlaps free block at {no}"));
            }
        }
        let (mut start, mut stop) = (off, end);
        if let Some((po, ps)) = prev.filter(|&(po, ps)| po + ps == off) {
            self.remove(po, ps);
            start = po;
        }
        if let Some((no, ns)) = next.filter(|&(no, _)| no == end) {
            self.remove(no, ns);
            stop = no + ns;
        }
        self.insert(start, stop - start);
        Ok(())
    }

    pub(crate) fn capacity(&self) -> u64 {
        self.capacity
    }
    pub(crate) fn free_bytes(&self) -> u64 {
        self.free
    }
    pub(crate) fn largest_free(&self) -> u64 {
        self.by_size.iter().next_back().map_or(0, |&(s, _)| s)
    }
    #[cfg(test)]
    pub(crate) fn blocks(&self) -> Vec<(u64, u64)> {
        self.by_off.iter().map(|(&o, &s)| (o, s)).collect()
    }

    fn insert(&mut self, off: u64, size: u64) {
        self.by_off.insert(off, size);
        self.by_size.insert((size, off));
        self.free += size;
    }
    fn remove(&mut self, off: u64, size: u64) {
        self.by_off.remove(&off);
        self.by_size.remove(&(size, off));
        self.free -= size;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn simple_alloc_free_coalesce() {
        let mut fl = FreeList::new(64 * 10);
        let a = fl.alloc(1).unwrap();
        let b = fl.alloc(100).unwrap();
        let c = fl.alloc(64).unwrap();
        assert_eq!((a, b, c), (0, 64, 192));
        assert_eq!(fl.free_bytes(), 64 * 6);
        fl.free(b, 100).unwrap();
        assert!(fl.free(b, 100).is_err(), "double free must be rejected");
        fl.free(a, 1).unwrap();
        assert_eq!(fl.blocks(), vec![(0, 192), (256, 384)]);
        fl.free(c, 64).unwrap();
        assert_eq!(fl.blocks(), vec![(0, 640)]);
        assert_eq!(fl.alloc(640), Some(0));
        assert_eq!(fl.alloc(1), None);
    }

    #[test]
    fn best_fit_prefers_smallest_hole() {
        let mut fl = FreeList::new(64 * 8);
        let xs: Vec<u64> = (0..8).map(|_| fl.alloc(64).unwrap()).collect();
        // holes: [0,128) (2 units) and [256,320) (1 unit)
        fl.free(xs[0], 64).unwrap();
        fl.free(xs[1], 64).unwrap();
        fl.free(xs[4], 64).unwrap();
        assert_eq!(fl.alloc(10), Some(256));
        assert_eq!(fl.alloc(128), Some(0));
    }

    #[test]
    fn rejects_bad_frees() {
        let mut fl = FreeList::new(640);
        assert!(fl.free(0, 64).is_err(), "freeing free space");
        let a = fl.alloc(64).unwrap();
        assert!(fl.free(a + 1, 63).is_err(), "misaligned");
        assert!(fl.free(640, 64).is_err(), "out of bounds");
        assert!(fl.free(u64::MAX - 63, 64).is_err(), "overflow");
        fl.free(a, 64).unwrap();
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u64),
        Free(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0u64..2000).prop_map(Op::Alloc),
            1 => (0u64..600).prop_map(Op::Alloc),
            3 => any::<usize>().prop_map(Op::Free),
        ]
    }

    /// Largest gap between live blocks (brute force over the model).
    fn largest_gap(live: &[(u64, u64)], capacity: u64) -> u64 {
        let mut v = live.to_vec();
        v.sort();
        let mut cur = 0;
        let mut best = 0;
        for (o, s) in v {
            best = best.max(o - cur);
            cur = o + s;
        }
        best.max(capacity - cur)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn matches_brute_force_model(units in 1u64..160, ops in prop::collection::vec(op(), 1..200)) {
            let capacity = units * ALIGN;
            let mut fl = FreeList::new(capacity);
            let mut live: Vec<(u64, u64)> = Vec::new(); // (offset, block size)
            for op in ops {
                match op {
                    Op::Alloc(len) => {
                        let size = FreeList::block_size(len).unwrap();
                        match fl.alloc(len) {
                            Some(off) => {
                                prop_assert_eq!(off % ALIGN, 0);
                                prop_assert!(off + size <= capacity, "out of bounds");
                                for &(o, s) in &live {
                                    prop_assert!(off + size <= o || o + s <= off,
                                        "[{}, {}) overlaps [{}, {})", off, off + size, o, o + s);
                                }
                                live.push((off, size));
                            }
                            None => {
                                let gap = largest_gap(&live, capacity);
                                prop_assert!(gap < size,
                                    "alloc of {} failed but a gap of {} exists", size, gap);
                            }
                        }
                    }
                    Op::Free(i) => {
                        if !live.is_empty() {
                            let (o, s) = live.swap_remove(i % live.len());
                            prop_assert!(fl.free(o, s).is_ok());
                            prop_assert!(fl.free(o, s).is_err(), "double free accepted");
                        }
                    }
                }
                let used: u64 = live.iter().map(|&(_, s)| s).sum();
                prop_assert_eq!(fl.free_bytes(), capacity - used);
                prop_assert_eq!(fl.largest_free(), largest_gap(&live, capacity));
                // free blocks are maximal: never adjacent
                let blocks = fl.blocks();
                for w in blocks.windows(2) {
                    prop_assert!(w[0].0 + w[0].1 < w[1].0, "uncoalesced {:?}", w);
                }
            }
            for (o, s) in live.drain(..) {
                prop_assert!(fl.free(o, s).is_ok());
            }
            prop_assert_eq!(fl.blocks(), vec![(0, capacity)]);
            prop_assert_eq!(fl.alloc(capacity), Some(0));
        }
    }
}
