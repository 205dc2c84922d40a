//! The CUDA backend's memory: buffers and views of device memory and what keeps them
//! (`Owner`), the arena step temporaries and library workspaces are placed in, and the
//! copies between host and GPU (staged uploads of images beside the compute stream).
//! The arena's bookkeeping itself is [`crate::engine::backend::arena`]'s.

use std::marker::PhantomData;
use std::ops::Range;
use std::rc::Rc;
use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, PinnedHostSlice, result,
};

use super::{CudaBackend, CudaError, driver};
use crate::engine::backend::Backend;
use crate::engine::backend::arena::{ArenaBook, Lease, Placement};
use crate::engine::backend::kernels::{self, Operand};
use crate::engine::image_folder::gpu::DeviceImages;
use crate::engine::tensor::DType;

/// Alignment of arena allocations (cuDNN and tensor cores want 128 bytes or more).
const ARENA_ALIGN: usize = 256;

/// The arena grows in steps of this (the driver's allocation granularity for large blocks).
const ARENA_GRANULE: usize = 2 << 20;

/// Upload lengths whose [`Staging`] is kept; a new one past this many drops the others
/// (a training run uploads batches of one or two shapes).
const STAGING_KEPT: usize = 4;

/// The arena to reserve at start, in MiB, from `RINGMASTER_CUDA_ARENA_MIB` (0 when unset:
/// the arena is sized from the first step's peak instead).
fn arena_mib_setting() -> Result<usize, CudaError> {
    const NAME: &str = "RINGMASTER_CUDA_ARENA_MIB";
    match std::env::var(NAME) {
        Err(_) => Ok(0),
        Ok(value) => value.trim().parse().map_err(|_| CudaError::Setting {
            name: NAME,
            value,
            expected: "a whole number of MiB to reserve for step temporaries at start",
        }),
    }
}

/// A temporary's hold on its place in the arena (spilled ones own their memory).
pub(super) type ArenaLease = Lease<CudaSlice<u8>>;

/// Where the step's temporaries are placed, and which are held.
pub(super) type Arena = Rc<std::cell::RefCell<ArenaBook<CudaSlice<u8>>>>;

/// What keeps a buffer's memory.
#[derive(Clone, Debug)]
enum Owner {
    /// An allocation of its own, freed with the last clone.
    Slice { _memory: Rc<CudaSlice<u8>> },
    /// A place in the arena, free again with the last clone (or at the next step).
    Arena { _lease: Rc<ArenaLease> },
}

/// Memory on the GPU: a place, a length and a type, kept by `owner`. Arena buffers are
/// valid until the last clone is dropped, at most until the next [`Backend::begin_step`].
#[derive(Clone)]
pub struct CudaBuf {
    pub(super) ptr: CUdeviceptr,
    pub(super) len: usize,
    pub(super) dtype: DType,
    owner: Owner,
}

impl std::fmt::Debug for CudaBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBuf")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("dtype", &self.dtype)
            .field("owned", &matches!(self.owner, Owner::Slice { .. }))
            .finish()
    }
}

/// A read-only view of device memory.
#[derive(Clone, Copy, Debug)]
pub struct DevView<'a> {
    pub(super) ptr: CUdeviceptr,
    pub(super) len: usize,
    pub(super) dtype: DType,
    _borrow: PhantomData<&'a ()>,
}

/// A writable view of device memory.
#[derive(Debug)]
pub struct DevViewMut<'a> {
    pub(super) ptr: CUdeviceptr,
    pub(super) len: usize,
    pub(super) dtype: DType,
    _borrow: PhantomData<&'a mut ()>,
}

/// A place in device memory that outlives the borrow it came from (saved state).
#[derive(Clone, Copy, Debug)]
pub struct DevPtr {
    pub(super) ptr: CUdeviceptr,
    pub(super) len: usize,
    pub(super) dtype: DType,
}

impl From<DevView<'_>> for DevPtr {
    fn from(v: DevView<'_>) -> Self {
        Self {
            ptr: v.ptr,
            len: v.len,
            dtype: v.dtype,
        }
    }
}

impl From<&DevViewMut<'_>> for DevPtr {
    fn from(v: &DevViewMut<'_>) -> Self {
        Self {
            ptr: v.ptr,
            len: v.len,
            dtype: v.dtype,
        }
    }
}

/// Memory the NVRTC kernels take ([`kernels::Operand`]): buffers, views and saved places.
macro_rules! operand {
    ($($t:ty),+) => {$(
        impl $t {
            pub(super) fn op(&self) -> Operand {
                // SAFETY: device memory of this context holding `len` elements of `dtype`
                // (owned, an arena temporary, or a view of either), 256-byte aligned at
                // its start and element-aligned within; work on it is ordered on our one
                // stream.
                unsafe { Operand::new(self.ptr, self.len, self.dtype) }
            }
        }
    )+};
}

operand!(CudaBuf, DevView<'_>, DevViewMut<'_>, DevPtr);

/// The way an upload of one length reaches the GPU beside the compute stream: page-locked
/// host memory, which the copy engine reads at full speed while kernels run (from pageable
/// memory the driver would stage the copy itself, and may wait for the stream first), and
/// an f32 device buffer the layout and type conversion then reads on the compute stream.
///
/// Each upload of this length reuses both, taking turns by events: the conversion starts
/// only once the copy has landed, and the host refills the page-locked memory only once
/// the last copy has read it (`copied`, both); the copy stream overwrites the device buffer
/// only once the last conversion has read it (`consumed`). Ours, not the slices' own
/// events, which cudarc records only while it tracks events (the backend turns that off).
pub(super) struct Staging {
    host: PinnedHostSlice<f32>,
    device: CudaSlice<f32>,
    /// Recorded on the copy stream when the copy has landed (blocking: the host sleeps
    /// while it waits, leaving the core to the loader).
    copied: CudaEvent,
    /// Recorded on the compute stream when the conversion has read `device` (and, first,
    /// when `device` was allocated on it).
    consumed: CudaEvent,
}

impl CudaBackend {
    /// The most arena memory one step has used so far, in bytes.
    pub fn arena_peak(&self) -> usize {
        self.inner.arena.borrow().peak()
    }

    /// The largest workspace a library call has asked for so far, in bytes (the
    /// algorithm search's own aside).
    pub fn workspace_bytes(&self) -> usize {
        self.inner.workspace_peak.get()
    }

    /// Device memory: (bytes in use on the GPU by every process, the arena's reservation).
    pub fn memory(&self) -> (usize, usize) {
        let (free, total) = self
            .inner
            .ctx
            .mem_get_info()
            .expect("querying the GPU's memory");
        (total - free, self.inner.arena.borrow().size())
    }

    /// An owned, zeroed allocation of `len` elements of `dtype`.
    pub(super) fn owned(&self, len: usize, dtype: DType) -> CudaBuf {
        self.not_while_capturing("an allocation outside the arena");
        let bytes = (len * dtype.size()).max(1);
        let memory = self
            .inner
            .stream
            .alloc_zeros::<u8>(bytes)
            .unwrap_or_else(|e| panic!("allocating {bytes} bytes on the GPU: {e}"));
        let (ptr, sync) = memory.device_ptr(&self.inner.stream);
        drop(sync);
        CudaBuf {
            ptr,
            len,
            dtype,
            owner: Owner::Slice {
                _memory: Rc::new(memory),
            },
        }
    }

    /// Queues `host` onto the GPU through the [`Staging`] of its length, then `convert`
    /// on the compute stream from the staged f32 values once they have landed. Returns once
    /// `host` is copied out (the caller may reuse it); the copy runs beside whatever the
    /// compute stream still has queued. The host waits only for the last copy of this
    /// length to have been read (itself queued behind the conversion before it), so it runs
    /// at most about two uploads ahead of the GPU.
    pub(super) fn staged_upload(&self, host: &[f32], convert: impl FnOnce(Operand)) {
        let len = host.len();
        let mut kept = self.inner.staging.borrow_mut();
        if !kept.contains_key(&len) {
            if kept.len() >= STAGING_KEPT {
                // The device buffers are freed in stream order, after the conversions that
                // read them; the page-locked memory only once no copy reads it.
                for staging in kept.values() {
                    uploading(len, staging.copied.synchronize());
                }
                kept.clear();
            }
            kept.insert(len, self.new_staging(len));
        }
        let staging = kept.get_mut(&len).expect("kept above");
        // Waits until the last copy has read the page-locked memory (at once the first time:
        // an event never recorded is complete).
        uploading(len, staging.copied.synchronize());
        // On this thread, not rayon's pool, which may be decoding the next batch: `train`
        // uploads while the GPU still computes the step before, so this copy (150 MB for
        // 256 images at 224 px) is not on the GPU's path.
        uploading(len, staging.host.as_mut_slice()).copy_from_slice(host);
        let (compute, copy) = (&self.inner.stream, &self.inner.copy_stream);
        uploading(len, copy.wait(&staging.consumed));
        uploading(len, copy.memcpy_htod(&staging.host, &mut staging.device));
        uploading(len, staging.copied.record(copy));
        uploading(len, compute.wait(&staging.copied));
        let (staged, _) = staging.device.device_ptr(compute);
        // SAFETY: `len` f32s of device memory, which the copy above filled before the
        // compute stream goes on, and which no copy overwrites before `consumed`.
        convert(unsafe { Operand::new(staged, len, DType::F32) });
        uploading(len, staging.consumed.record(compute));
    }

    /// The [`Staging`] for uploads of `len` values, made the first time one comes.
    fn new_staging(&self, len: usize) -> Staging {
        // SAFETY (both): written (by the host, then by the copy) before anything reads
        // them.
        let host = uploading(len, unsafe { self.inner.ctx.alloc_pinned::<f32>(len) });
        let device = uploading(len, unsafe { self.inner.stream.alloc::<f32>(len) });
        // The copy stream's first use of `device` waits for its allocation.
        let consumed = uploading(len, self.inner.stream.record_event(None));
        let blocking = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC);
        let copied = uploading(len, self.inner.ctx.new_event(blocking));
        Staging {
            host,
            device,
            copied,
            consumed,
        }
    }

    /// A step temporary: in the arena, or, past its end, in memory of its own until the
    /// arena grows at the next step's start.
    pub(super) fn arena_alloc(&self, len: usize, dtype: DType) -> CudaBuf {
        let bytes = len * dtype.size();
        let (offset, placement) = self.inner.arena.borrow_mut().place(bytes);
        let (ptr, spill) = match placement {
            Placement::Arena(ptr) => (ptr, None),
            Placement::Spill => {
                self.not_while_capturing("a temporary past the arena's end");
                let rounded = self.inner.arena.borrow().rounded(bytes);
                // SAFETY: like every temporary, written before it is read.
                let memory =
                    unsafe { self.inner.stream.alloc::<u8>(rounded) }.unwrap_or_else(|e| {
                        panic!("allocating a {rounded}-byte step temporary on the GPU: {e}")
                    });
                let (ptr, sync) = memory.device_ptr(&self.inner.stream);
                drop(sync);
                (ptr, Some(memory))
            }
        };
        let lease = ArenaBook::lease(&self.inner.arena, offset, bytes, ptr, spill);
        CudaBuf {
            ptr,
            len,
            dtype,
            owner: Owner::Arena { _lease: lease },
        }
    }

    /// The arena temporary that holds device address `ptr`, kept alive by the returned
    /// lease (none for memory outside the arena: its owner keeps it).
    pub(super) fn hold(&self, ptr: CUdeviceptr) -> Option<Rc<ArenaLease>> {
        self.inner.arena.borrow().holder_of(ptr)
    }

    /// Grows the arena to what the steps so far needed at most, unless a recorded step
    /// holds its address. Between steps only: no temporary is alive.
    pub(super) fn fit_arena(&self) {
        let grow_to = self.inner.arena.borrow_mut().begin_step(ARENA_GRANULE);
        // A recorded step holds the arena's address; a capture may not allocate.
        let fixed = self.inner.recorded.get() || self.inner.capturing.get();
        let Some(size) = grow_to.filter(|_| !fixed) else {
            return;
        };
        let mut memory = self.inner.arena_memory.borrow_mut();
        // The old arena is freed in stream order, after the work queued on it.
        *memory = None;
        // SAFETY: the arena is only read after kernels or copies wrote it.
        let grown = unsafe { self.inner.stream.alloc::<u8>(size) }
            .unwrap_or_else(|e| panic!("growing the CUDA arena to {size} bytes: {e}"));
        let (base, sync) = grown.device_ptr(&self.inner.stream);
        drop(sync);
        self.inner.arena.borrow_mut().set_memory(base, size);
        *memory = Some(grown);
    }

    /// A workspace of `bytes` for one library call, from the arena like any temporary: it is
    /// free again once the call is queued (the caller holds the returned buffer until then),
    /// so it costs the arena's peak only where the step's peak is.
    pub(super) fn workspace(&self, bytes: usize) -> (CUdeviceptr, usize, CudaBuf) {
        let bytes = bytes.max(1);
        let peak = &self.inner.workspace_peak;
        peak.set(peak.get().max(bytes));
        let held = self.arena_alloc(bytes.div_ceil(DType::F32.size()), DType::F32);
        (held.ptr, bytes, held)
    }

    /// [`Backend::upload_into`]: images through the
    /// [`Staging`] beside the compute stream, anything else copied and waited for.
    pub(super) fn copy_to_device(&self, host: &[f32], shape: &[usize], buf: &mut CudaBuf) {
        assert_eq!(
            host.len(),
            buf.len,
            "upload into a buffer of another length"
        );
        let copy_to = |ptr: CUdeviceptr| {
            // SAFETY: `ptr` holds `host.len()` f32s; the copy is ordered on our stream
            // before any use, and the host slice lives through the synchronize below.
            unsafe { result::memcpy_htod_async(ptr, host, self.stream()) }
                .unwrap_or_else(|e| panic!("copying {} values to the GPU: {e}", host.len()));
        };
        if host.is_empty() {
            return;
        }
        match (shape, buf.dtype) {
            // Images: a step may still be reading `buf`; the conversion queues behind it.
            ([n, c, h, w], _) => self.staged_upload(host, |staged| {
                kernels::nchw_to_nhwc(self, [*n, *c, *h, *w], staged, buf.op())
            }),
            (_, DType::F32) => {
                copy_to(buf.ptr);
                self.synchronize();
            }
            (_, DType::Bf16) => {
                let staged = self.owned(host.len(), DType::F32);
                copy_to(staged.ptr);
                kernels::convert(self, staged.op(), buf.op());
                self.synchronize();
            }
        }
    }

    /// [`Backend::upload_device_images_into`]: NCHW f32 images on this GPU into `buf`
    /// (NHWC, its type) on the compute stream, `images.consumed` recorded after.
    pub(super) fn convert_device_images(&self, images: &mut DeviceImages, buf: &mut CudaBuf) {
        let len = images.shape.iter().product::<usize>();
        assert_eq!(
            len, buf.len,
            "device images into a buffer of another length"
        );
        assert_eq!(
            images.values.len(),
            len,
            "device images of another length than their shape"
        );
        // SAFETY: `len` f32s of device memory, complete (the loader waited for them), and
        // not freed before `consumed`, recorded below, has passed (DeviceImages' drop).
        let source = unsafe { Operand::new(images.address(), len, DType::F32) };
        kernels::nchw_to_nhwc(self, images.shape, source, buf.op());
        let consumed = self
            .inner
            .stream
            .record_event(None)
            .unwrap_or_else(|e| panic!("recording a device batch's conversion: {e}"));
        images.consumed = Some(consumed);
    }

    /// [`Backend::download`]: `buf` as f32 on the host, 4-D
    /// tensors back in NCHW.
    pub(super) fn copy_to_host(&self, buf: &CudaBuf, shape: &[usize]) -> Vec<f32> {
        let len = shape.iter().product::<usize>();
        assert_eq!(len, buf.len, "download shape");
        let plain = match shape {
            [n, c, h, w] => {
                let out = self.owned(len, DType::F32);
                kernels::nhwc_to_nchw(self, [*n, *c, *h, *w], buf.op(), out.op());
                out
            }
            _ if buf.dtype == DType::F32 => buf.clone(),
            _ => {
                let out = self.owned(len, DType::F32);
                kernels::convert(self, buf.op(), out.op());
                out
            }
        };
        let mut host = vec![0.0f32; len];
        // SAFETY: `plain` holds `len` f32s; synchronize waits for the copy to land.
        unsafe { result::memcpy_dtoh_async(&mut host, plain.ptr, self.stream()) }
            .unwrap_or_else(|e| panic!("copying {len} values from the GPU: {e}"));
        self.synchronize();
        host
    }

    /// [`Backend::with_host`]: `f` on a host copy of the
    /// f32 buffer `buf`, copied back after.
    pub(super) fn on_host_copy<R>(&self, buf: &mut CudaBuf, f: impl FnOnce(&mut [f32]) -> R) -> R {
        assert_eq!(buf.dtype, DType::F32, "with_host needs an f32 buffer");
        let mut host = self.copy_to_host(buf, &[buf.len]);
        let r = f(&mut host);
        // SAFETY: `buf` holds `host.len()` f32s; synchronize keeps `host` alive until the
        // copy has landed.
        unsafe { result::memcpy_htod_async(buf.ptr, &host, self.stream()) }
            .unwrap_or_else(|e| panic!("copying {} values to the GPU: {e}", host.len()));
        self.synchronize();
        r
    }

    /// Zeroes the memory `x` views, in stream order.
    pub(super) fn zero(&self, x: DevViewMut<'_>) {
        // SAFETY: the view is live device memory of `len` elements.
        unsafe { result::memset_d8_async(x.ptr, 0, x.len * x.dtype.size(), self.stream()) }
            .unwrap_or_else(|e| panic!("zeroing {} bytes: {e}", x.len * x.dtype.size()));
    }
}

/// Panics with what was being uploaded when a driver call of a staged upload fails.
fn uploading<T>(len: usize, r: Result<T, cudarc::driver::DriverError>) -> T {
    r.unwrap_or_else(|e| panic!("uploading {len} values through page-locked memory: {e}"))
}

impl CudaBuf {
    /// Elements `range` of this buffer, to read.
    pub(super) fn view(&self, range: Range<usize>) -> DevView<'_> {
        assert!(
            range.end <= self.len,
            "view {range:?} of {} elements",
            self.len
        );
        DevView {
            ptr: self.ptr + (range.start * self.dtype.size()) as u64,
            len: range.len(),
            dtype: self.dtype,
            _borrow: PhantomData,
        }
    }

    /// Elements `range` of this buffer, to write.
    pub(super) fn view_mut(&mut self, range: Range<usize>) -> DevViewMut<'_> {
        assert!(
            range.end <= self.len,
            "view {range:?} of {} elements",
            self.len
        );
        self.unchecked_view_mut(range)
    }

    /// Two disjoint writable views, `a` before `b`.
    pub(super) fn view_mut_pair(
        &mut self,
        a: Range<usize>,
        b: Range<usize>,
    ) -> (DevViewMut<'_>, DevViewMut<'_>) {
        assert!(
            a.end <= b.start && b.end <= self.len,
            "view_mut_pair ranges"
        );
        (self.unchecked_view_mut(a), self.unchecked_view_mut(b))
    }

    /// A writable view of `range`, which the caller checked is inside the buffer (and, for
    /// two views, that they do not overlap).
    fn unchecked_view_mut(&self, range: Range<usize>) -> DevViewMut<'_> {
        DevViewMut {
            ptr: self.ptr + (range.start * self.dtype.size()) as u64,
            len: range.len(),
            dtype: self.dtype,
            _borrow: PhantomData,
        }
    }
}

/// The arena at start: its book, and `arena_bytes` of memory reserved for it (`None`:
/// `RINGMASTER_CUDA_ARENA_MIB`'s, else none, sized from the first step's peak instead).
pub(super) fn reserve_arena(
    ctx: &CudaContext,
    stream: &Arc<CudaStream>,
    arena_bytes: Option<usize>,
) -> Result<(Arena, Option<CudaSlice<u8>>), CudaError> {
    let (free, _) = driver(|| "free memory".into(), ctx.mem_get_info())?;
    let size = match arena_bytes {
        Some(bytes) => bytes,
        None => arena_mib_setting()? << 20,
    };
    if size > free {
        return Err(CudaError::ArenaTooLarge { wanted: size, free });
    }
    let arena = ArenaBook::new(ARENA_ALIGN);
    let memory = if size > 0 {
        // SAFETY: the arena is only read after kernels or copies wrote it.
        let memory = driver(|| format!("reserving the {size}-byte arena"), unsafe {
            stream.alloc::<u8>(size)
        })?;
        let (base, sync) = memory.device_ptr(stream);
        drop(sync);
        arena.borrow_mut().set_memory(base, size);
        Some(memory)
    } else {
        None
    };
    Ok((arena, memory))
}
