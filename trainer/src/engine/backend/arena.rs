//! Where a device backend puts a step's temporaries: one allocation, handed out again and
//! again, so a step allocates nothing from the driver and lands on the same addresses every
//! time (what a recorded CUDA graph replays).
//!
//! Each temporary is freed as soon as nothing holds it any more, as PyTorch's caching
//! allocator frees a tensor: the backward pass's gradients of activations die layer by
//! layer, and each forward activation dies once its layer's backward has run. So the
//! arena's peak is what one moment of the step holds, not the sum of everything the step
//! made. [`Layout`] decides the offsets (best fit over the holes, deterministic, so the
//! same sequence of requests gets the same offsets every step); [`ArenaBook`] tracks which
//! leases are alive; the backend owns the device memory.
//!
//! The arena is sized from what a step needed, not guessed up front: a request past its end
//! is served by a memory allocation of its own (a spill), the layout still records where it
//! would have gone, and at the next step's start the backend grows the arena to the peak
//! (see [`ArenaBook::begin_step`]). The first step, which finds the convolution algorithms
//! anyway, spills everything; the second runs inside an arena of exactly its size.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::{Rc, Weak};

/// Offsets of live blocks in an address space that grows at its top: freed blocks become
/// holes (merged with their neighbours), and a request takes the smallest hole it fits in,
/// the lowest such, else the top.
#[derive(Debug, Default, Clone)]
pub struct Layout {
    /// Holes below `top`: offset → length.
    holes: BTreeMap<usize, usize>,
    /// The end of the highest block.
    top: usize,
    /// The highest `top` since the last [`Layout::reset`].
    high: usize,
}

impl Layout {
    /// Where a block of `bytes` goes.
    pub fn alloc(&mut self, bytes: usize) -> usize {
        let best = self
            .holes
            .iter()
            .filter(|&(_, &len)| len >= bytes)
            .min_by_key(|&(&offset, &len)| (len, offset))
            .map(|(&offset, &len)| (offset, len));
        let offset = match best {
            Some((offset, len)) => {
                self.holes.remove(&offset);
                if len > bytes {
                    self.holes.insert(offset + bytes, len - bytes);
                }
                offset
            }
            None => {
                // A hole at the top grows into the request instead of leaving a gap.
                let start = match self.holes.last_key_value() {
                    Some((&offset, &len)) if offset + len == self.top => {
                        self.holes.remove(&offset);
                        offset
                    }
                    _ => self.top,
                };
                self.top = start + bytes;
                start
            }
        };
        self.high = self.high.max(self.top);
        offset
    }

    /// Returns the block at `offset` of `bytes` (as [`Layout::alloc`] gave it).
    pub fn free(&mut self, offset: usize, bytes: usize) {
        debug_assert!(offset + bytes <= self.top, "a block past the top");
        let (mut start, mut end) = (offset, offset + bytes);
        if let Some((&before, &len)) = self.holes.range(..offset).next_back()
            && before + len == start
        {
            self.holes.remove(&before);
            start = before;
        }
        if let Some(len) = self.holes.remove(&end) {
            end += len;
        }
        if end == self.top {
            self.top = start;
        } else {
            self.holes.insert(start, end - start);
        }
    }

    /// Forgets every block: the next request starts at offset 0 again.
    pub fn reset(&mut self) {
        self.holes.clear();
        self.top = 0;
        self.high = 0;
    }

    /// The highest the blocks reached since the last reset.
    pub fn high(&self) -> usize {
        self.high
    }

    /// The end of the highest live block.
    pub fn top(&self) -> usize {
        self.top
    }
}

/// One temporary's hold on its place: while any clone of its `Rc` lives the place is not
/// handed out again; the last drop frees it (only within the step it was made in: a new
/// step has already forgotten every place). A spilled temporary also owns its memory.
pub struct Lease<M> {
    book: Rc<RefCell<ArenaBook<M>>>,
    offset: usize,
    bytes: usize,
    step: u64,
    address: u64,
    /// The memory of a request that did not fit in the arena (freed with the lease).
    spill: Option<M>,
}

impl<M> std::fmt::Debug for Lease<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("offset", &self.offset)
            .field("bytes", &self.bytes)
            .field("step", &self.step)
            .field("spilled", &self.spill.is_some())
            .finish()
    }
}

impl<M> Lease<M> {
    /// The device address the temporary starts at.
    pub fn address(&self) -> u64 {
        self.address
    }

    /// Whether it lies outside the arena, in memory of its own.
    pub fn spilled(&self) -> bool {
        self.spill.is_some()
    }
}

impl<M> Drop for Lease<M> {
    fn drop(&mut self) {
        self.book.borrow_mut().release(self);
    }
}

/// The arena's book: its memory's place and size, the layout of this step's temporaries,
/// and which of them are held.
pub struct ArenaBook<M> {
    layout: Layout,
    /// Counts steps; a lease of an earlier one frees nothing.
    step: u64,
    /// The arena's device memory: `[base, base + size)`; `size` 0 before the first growth.
    base: u64,
    size: usize,
    /// Live temporaries by device address: length and lease, so a saved view into one can
    /// be held too ([`ArenaBook::holder_of`]).
    live: BTreeMap<u64, (usize, Weak<Lease<M>>)>,
    /// The highest the layout reached in any step so far.
    peak: usize,
    /// Bytes spilled in the current step.
    spilled: usize,
    alignment: usize,
}

impl<M> std::fmt::Debug for ArenaBook<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArenaBook")
            .field("size", &self.size)
            .field("peak", &self.peak())
            .field("live", &self.live.len())
            .finish()
    }
}

/// Where a request was placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Inside the arena, at this device address.
    Arena(u64),
    /// Past the arena's end: the caller gives it memory of its own ([`ArenaBook::lease`]).
    Spill,
}

impl<M> ArenaBook<M> {
    /// An empty book whose blocks start at multiples of `alignment` bytes.
    pub fn new(alignment: usize) -> Rc<RefCell<Self>> {
        Rc::new(RefCell::new(Self {
            layout: Layout::default(),
            step: 0,
            base: 0,
            size: 0,
            live: BTreeMap::new(),
            peak: 0,
            spilled: 0,
            alignment: alignment.max(1),
        }))
    }

    /// Gives the arena its memory: `size` bytes at device address `base`. Only between
    /// steps (no lease of this step may be alive).
    pub fn set_memory(&mut self, base: u64, size: usize) {
        self.base = base;
        self.size = size;
    }

    /// The arena's size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The most the temporaries of one step have taken so far (in any step, this one too).
    pub fn peak(&self) -> usize {
        self.peak.max(self.layout.high())
    }

    /// Bytes this step placed outside the arena.
    pub fn spilled(&self) -> usize {
        self.spilled
    }

    /// `bytes` rounded up to the alignment.
    pub fn rounded(&self, bytes: usize) -> usize {
        bytes.max(1).div_ceil(self.alignment) * self.alignment
    }

    /// Places a request of `bytes` (rounded up to the alignment): its offset and where it
    /// lies. Pair it with [`ArenaBook::lease`].
    pub fn place(&mut self, bytes: usize) -> (usize, Placement) {
        let bytes = self.rounded(bytes);
        let offset = self.layout.alloc(bytes);
        let placement = if offset + bytes <= self.size {
            Placement::Arena(self.base + offset as u64)
        } else {
            self.spilled += bytes;
            Placement::Spill
        };
        (offset, placement)
    }

    /// The lease of a placed request: at `address` (the arena's, or the spill's own memory
    /// `spill`).
    pub fn lease(
        book: &Rc<RefCell<Self>>,
        offset: usize,
        bytes: usize,
        address: u64,
        spill: Option<M>,
    ) -> Rc<Lease<M>> {
        let mut this = book.borrow_mut();
        let bytes = this.rounded(bytes);
        let lease = Rc::new(Lease {
            book: book.clone(),
            offset,
            bytes,
            step: this.step,
            address,
            spill,
        });
        this.live.insert(address, (bytes, Rc::downgrade(&lease)));
        lease
    }

    /// The live lease whose temporary holds device address `address`, if one does (a view
    /// into a temporary that must outlive the call that saw it, e.g. a batch norm's input).
    pub fn holder_of(&self, address: u64) -> Option<Rc<Lease<M>>> {
        let (&start, (len, lease)) = self.live.range(..=address).next_back()?;
        (address < start + *len as u64)
            .then(|| lease.upgrade())
            .flatten()
    }

    fn release(&mut self, lease: &Lease<M>) {
        if lease.step != self.step {
            return;
        }
        self.live.remove(&lease.address);
        self.layout.free(lease.offset, lease.bytes);
    }

    /// Starts a step: every temporary of the last one is dead from here on. Returns the
    /// size the arena should grow to when the last steps needed more than it has (rounded
    /// up to `granule`), `None` when it is big enough.
    pub fn begin_step(&mut self, granule: usize) -> Option<usize> {
        self.peak = self.peak();
        self.layout.reset();
        self.live.clear();
        self.spilled = 0;
        self.step += 1;
        (self.peak > self.size).then(|| self.peak.div_ceil(granule.max(1)) * granule.max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_blocks_are_reused_best_fit_and_merge_with_their_neighbours() {
        let mut l = Layout::default();
        let a = l.alloc(100);
        let b = l.alloc(50);
        let c = l.alloc(200);
        let d = l.alloc(30);
        assert_eq!((a, b, c, d), (0, 100, 150, 350));
        l.free(a, 100);
        l.free(c, 200);
        // 40 fits both holes: the smaller one (100 at 0) takes it.
        assert_eq!(l.alloc(40), 0);
        // 150 fits only the 200-byte hole.
        assert_eq!(l.alloc(150), 150);
        assert_eq!(l.top(), 380);
        // Freeing b joins the 60 bytes left at 40 with b's 50.
        l.free(b, 50);
        assert_eq!(l.alloc(110), 40, "merged hole 40..150 takes 110");
        assert_eq!(l.high(), 380);
    }

    #[test]
    fn a_block_freed_at_the_top_lowers_it_and_a_top_hole_grows() {
        let mut l = Layout::default();
        let a = l.alloc(100);
        let b = l.alloc(100);
        l.free(b, 100);
        assert_eq!(l.top(), 100, "the top falls back");
        let c = l.alloc(10);
        assert_eq!(c, 100);
        l.free(a, 100);
        // The hole 0..100 is below c; a request of 150 goes to the top.
        assert_eq!(l.alloc(150), 110);
        l.free(c, 10);
        l.free(110, 150);
        assert_eq!(l.top(), 0, "everything freed: the top is back at 0");
        assert_eq!(l.high(), 260);
        l.reset();
        assert_eq!(l.high(), 0);
    }

    /// A step in the shape of forward then backward: activations kept until their
    /// backward, each gradient freed once the next one is made.
    fn forward_backward(book: &Rc<RefCell<ArenaBook<()>>>, layers: usize, bytes: usize) {
        let take = |book: &Rc<RefCell<ArenaBook<()>>>| {
            let (offset, placement) = book.borrow_mut().place(bytes);
            let address = match placement {
                Placement::Arena(address) => address,
                Placement::Spill => 1 << 40 | offset as u64,
            };
            let spill = (placement == Placement::Spill).then_some(());
            ArenaBook::lease(book, offset, bytes, address, spill)
        };
        let mut saved: Vec<_> = (0..layers).map(|_| take(book)).collect();
        let mut grad = take(book);
        while let Some(activation) = saved.pop() {
            let next = take(book);
            drop(activation);
            grad = next;
        }
        drop(grad);
    }

    #[test]
    fn a_step_frees_as_it_goes_and_the_arena_grows_to_its_peak_once() {
        let book = ArenaBook::<()>::new(256);
        forward_backward(&book, 10, 1000);
        {
            let b = book.borrow();
            // 10 activations and two gradients at once, each rounded to 1,024 bytes; a
            // bump allocator would have used 21 blocks.
            assert_eq!(b.peak(), 12 * 1024);
            assert_eq!(b.spilled(), 21 * 1024, "no arena yet: everything spilled");
        }
        let grow = book.borrow_mut().begin_step(4096);
        assert_eq!(grow, Some(12 * 1024));
        book.borrow_mut().set_memory(0x1000_0000, 12 * 1024);
        forward_backward(&book, 10, 1000);
        let mut b = book.borrow_mut();
        assert_eq!(b.spilled(), 0, "the second step fits");
        assert_eq!(b.begin_step(4096), None);
    }

    #[test]
    fn the_same_requests_land_on_the_same_addresses_every_step() {
        let book = ArenaBook::<()>::new(256);
        book.borrow_mut().set_memory(0x2000_0000, 1 << 20);
        let addresses = |book: &Rc<RefCell<ArenaBook<()>>>| {
            book.borrow_mut().begin_step(1);
            let mut seen = Vec::new();
            let mut held = Vec::new();
            for (i, bytes) in [300usize, 5000, 70, 4096, 999, 12].iter().enumerate() {
                let (offset, placement) = book.borrow_mut().place(*bytes);
                let Placement::Arena(address) = placement else {
                    panic!("fits")
                };
                seen.push(address);
                let lease = ArenaBook::lease(book, offset, *bytes, address, None);
                if i % 2 == 0 {
                    held.push(lease);
                }
            }
            seen
        };
        assert_eq!(addresses(&book), addresses(&book));
    }

    #[test]
    fn a_view_into_a_temporary_finds_its_lease_and_old_leases_free_nothing() {
        let book = ArenaBook::<()>::new(256);
        book.borrow_mut().set_memory(0x3000_0000, 1 << 20);
        let (offset, Placement::Arena(address)) = book.borrow_mut().place(1024) else {
            panic!("fits")
        };
        let lease = ArenaBook::lease(&book, offset, 1024, address, None);
        let held = book.borrow().holder_of(address + 512).expect("inside");
        assert!(Rc::ptr_eq(&held, &lease));
        assert!(
            book.borrow().holder_of(address + 1024).is_none(),
            "past its end"
        );
        drop(lease);
        // Still held through the view's lease: the place is not handed out again.
        let (second, _) = book.borrow_mut().place(1024);
        assert_ne!(second, offset);
        // A new step forgets it; its late drop must not free the new step's blocks.
        book.borrow_mut().begin_step(1);
        let (fresh, _) = book.borrow_mut().place(1024);
        assert_eq!(fresh, 0);
        drop(held);
        let (next, _) = book.borrow_mut().place(1024);
        assert_eq!(next, 1024, "block 0 is still taken");
    }
}
