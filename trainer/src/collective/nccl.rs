//! NCCL all-reduce through `cudarc`, with the CUDA driver and NCCL loaded at run time.
//!
//! The trainer is built without a CUDA toolkit and runs on machines without GPUs; this module
//! only touches CUDA when [`NcclCollective::connect`] is called, and first checks that
//! `libcuda` and `libnccl` can be loaded, so a missing library is an error that says what to
//! install instead of a panic inside `cudarc`.
//!
//! Wiring: NCCL needs every rank to hold the same 128-byte unique id, made by rank 0. The ids
//! travel over the TCP ring's rendezvous (`RINGMASTER_RENDEZVOUS`), which stays open as the
//! bootstrap channel for broadcasts of host data and for barriers. Each rank drives the GPU
//! of its local rank ([`World::gpu_ordinal`], as the CUDA backend): a rank without a GPU of
//! its own is an error, unless `RINGMASTER_GPUS_PER_NODE` shares GPUs among ranks (each then
//! has an `NCCL_HOSTID` of its own: NCCL refuses two ranks on one GPU of one host).
//!
//! A peer that dies mid-collective makes NCCL wait for ever; this collective waits on a CUDA
//! event with the ring's timeout instead, returns [`CollectiveError::PeerTimeout`], and the
//! communicator is aborted when dropped.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream};
use cudarc::nccl::{Comm, Id};

use super::overlap::BucketTimes;
use super::{Collective, CollectiveError, DeviceAllReduce, ReduceOp, RingConfig, TcpRing};
use crate::world::World;

/// What the machine offers for NCCL, found without initialising anything that could panic.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NcclProbe {
    /// `libcuda` (the driver) could be loaded.
    pub driver_loaded: bool,
    /// `libnccl` could be loaded.
    pub nccl_loaded: bool,
    /// GPUs the driver sees (0 when it is not loaded or has none).
    pub devices: usize,
    /// Why NCCL cannot be used here, when it cannot.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unavailable: Option<String>,
}

impl NcclProbe {
    /// Looks for the libraries and GPUs.
    pub fn detect() -> Self {
        // SAFETY: these only try `dlopen` on cudarc's candidate names and drop the handle.
        let driver_loaded = unsafe { cudarc::driver::sys::is_culib_present() };
        let nccl_loaded = unsafe { cudarc::nccl::sys::is_culib_present() };
        let devices = if driver_loaded {
            CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
        } else {
            0
        };
        let unavailable = if !driver_loaded {
            Some(
                "the CUDA driver library (libcuda.so) is not loadable: no NVIDIA driver on this \
                 machine, or the container was started without the GPU runtime"
                    .to_string(),
            )
        } else if devices == 0 {
            Some("the CUDA driver sees no GPU".to_string())
        } else if !nccl_loaded {
            Some(nccl_missing_hint())
        } else {
            None
        };
        Self {
            driver_loaded,
            nccl_loaded,
            devices,
            unavailable,
        }
    }

    /// Whether NCCL can be used.
    pub fn available(&self) -> bool {
        self.unavailable.is_none()
    }
}

/// cudarc looks for `libnccl.so` (and `.so.<cuda major>`), not `libnccl.so.2`, the only name
/// the NVIDIA pip wheel and some distribution packages install.
fn nccl_missing_hint() -> String {
    // SAFETY: dlopen of a plain shared library name; the handle is dropped at once.
    let versioned = unsafe { libloading::Library::new("libnccl.so.2") }.is_ok();
    if versioned {
        "NCCL is installed as libnccl.so.2 only; link it as libnccl.so in a directory on \
         LD_LIBRARY_PATH (ln -s libnccl.so.2 libnccl.so)"
            .to_string()
    } else {
        "NCCL (libnccl.so) is not on the library path: install libnccl2 or the nvidia-nccl \
         wheel and add its lib directory to LD_LIBRARY_PATH"
            .to_string()
    }
}

/// An NCCL communicator that may move between threads.
struct SendComm(Comm);

// SAFETY: an NCCL communicator may be used from any thread as long as no two threads use it
// at once (NCCL's thread-safety rule); `NcclCollective` owns it and needs `&mut self` for
// every call, so one thread at a time is guaranteed.
unsafe impl Send for SendComm {}

/// A rank of an NCCL communicator; host data is staged through one device buffer.
pub struct NcclCollective {
    bootstrap: TcpRing,
    stream: Arc<CudaStream>,
    comm: SendComm,
    staging: Option<CudaSlice<f32>>,
    timeout: Duration,
    /// The queued buckets' events: ready (compute stream), started and ended (ours).
    queued: Vec<[CudaEvent; 3]>,
    /// Their times once joined, for [`DeviceAllReduce::last_buckets`].
    joined: Vec<BucketTimes>,
    /// Where NCCL writes its account of the fabric in this process, when it does.
    debug_file: Option<std::path::PathBuf>,
}

impl Drop for NcclCollective {
    fn drop(&mut self) {
        // Our copy of NCCL's account: read when asked for, of no use afterwards.
        if let Some(file) = &self.debug_file
            && std::env::var_os("RINGMASTER_KEEP_NCCL_LOG").is_none()
        {
            std::fs::remove_file(file).ok();
        }
    }
}

/// The host name as NCCL writes it in `%h` (up to the first dot).
fn short_host_name() -> String {
    crate::world::host_name()
        .split('.')
        .next()
        .unwrap_or_default()
        .to_string()
}

/// An event that keeps its time (cudarc's default events do not).
fn timed_event(stream: &CudaStream) -> Result<CudaEvent, CollectiveError> {
    stream
        .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(|e| CollectiveError::Device {
            message: format!("record a CUDA event: {e:?}"),
        })
}

impl NcclCollective {
    /// Joins the job's NCCL communicator; fails with the reason when NCCL is unavailable.
    pub fn connect(world: &World, config: RingConfig) -> Result<Self, CollectiveError> {
        let probe = NcclProbe::detect();
        if let Some(reason) = probe.unavailable {
            return Err(CollectiveError::Unavailable {
                backend: "nccl",
                reason,
            });
        }
        let timeout = config.timeout;
        let mut bootstrap = TcpRing::connect(world, config)?;
        let cuda = |what: &str, e: &dyn std::fmt::Debug| CollectiveError::Device {
            message: format!("{what}: {e:?}"),
        };
        let ordinal = world.gpu_ordinal();
        if ordinal >= probe.devices {
            return Err(CollectiveError::Device {
                message: format!(
                    "local rank {ordinal} has no GPU of its own: this process sees {} (one process per GPU, or RINGMASTER_GPUS_PER_NODE to share them)",
                    probe.devices
                ),
            });
        }
        let context = CudaContext::new(ordinal).map_err(|e| cuda("open GPU", &e))?;
        let stream = context
            .new_stream()
            .map_err(|e| cuda("create a CUDA stream", &e))?;

        // Rank 0's unique id, sent bit for bit through the ring's broadcast of f32 words.
        let mut words = [0f32; 32];
        if world.rank == 0 {
            let id = Id::new().map_err(|e| cuda("make an NCCL unique id", &e))?;
            let bytes: Vec<u8> = id.internal().iter().map(|&c| c as u8).collect();
            bytemuck::cast_slice_mut::<f32, u8>(&mut words).copy_from_slice(&bytes);
        }
        bootstrap.broadcast(&mut words, 0)?;
        let mut internal = [0 as std::ffi::c_char; 128];
        for (dst, src) in internal
            .iter_mut()
            .zip(bytemuck::cast_slice::<f32, u8>(&words))
        {
            *dst = *src as std::ffi::c_char;
        }
        let comm = Comm::from_rank(stream.clone(), world.rank, world.size, Id::uninit(internal))
            .map_err(|e| cuda("join the NCCL communicator", &e))?;
        Ok(Self {
            bootstrap,
            stream,
            comm: SendComm(comm),
            staging: None,
            timeout,
            queued: Vec::new(),
            joined: Vec::new(),
            debug_file: super::fabric::debug_file(
                &std::env::vars().collect(),
                &short_host_name(),
                std::process::id(),
            ),
        })
    }

    /// The queued buckets' times in milliseconds after the first one was ready (all their
    /// events have completed).
    fn bucket_times(&self) -> Result<Vec<BucketTimes>, CollectiveError> {
        let Some([origin, ..]) = self.queued.first() else {
            return Ok(Vec::new());
        };
        let since = |event: &CudaEvent| {
            origin
                .elapsed_ms(event)
                .map(f64::from)
                .map_err(|e| CollectiveError::Device {
                    message: format!("time an all-reduce: {e:?}"),
                })
        };
        self.queued
            .iter()
            .map(|[ready, start, end]| {
                Ok(BucketTimes {
                    ready: since(ready)?,
                    start: since(start)?,
                    end: since(end)?,
                })
            })
            .collect()
    }

    /// Waits for the stream's work with the timeout; a dead peer leaves NCCL spinning.
    fn wait(&self) -> Result<(), CollectiveError> {
        let event = self
            .stream
            .record_event(None)
            .map_err(|e| CollectiveError::Device {
                message: format!("record a CUDA event: {e:?}"),
            })?;
        let start = Instant::now();
        while !event
            .try_is_complete()
            .map_err(|e| CollectiveError::Device {
                message: format!("NCCL's work failed: {e:?}"),
            })?
        {
            if start.elapsed() > self.timeout {
                return Err(CollectiveError::Stalled {
                    operation: "ncclAllReduce",
                    seconds: self.timeout.as_secs(),
                });
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        Ok(())
    }
}

impl Collective for NcclCollective {
    fn rank(&self) -> usize {
        self.comm.0.rank()
    }
    fn world_size(&self) -> usize {
        self.comm.0.world_size()
    }
    fn name(&self) -> &'static str {
        "nccl"
    }
    fn all_reduce(&mut self, data: &mut [f32], op: ReduceOp) -> Result<(), CollectiveError> {
        let device = |what: &str, e: &dyn std::fmt::Debug| CollectiveError::Device {
            message: format!("{what}: {e:?}"),
        };
        if self.staging.as_ref().is_none_or(|s| s.len() != data.len()) {
            self.staging = Some(
                self.stream
                    .alloc_zeros::<f32>(data.len())
                    .map_err(|e| device("allocate the staging buffer", &e))?,
            );
        }
        let staging = self.staging.as_mut().expect("allocated above");
        self.stream
            .memcpy_htod(data, staging)
            .map_err(|e| device("copy to the GPU", &e))?;
        self.comm
            .0
            .all_reduce_in_place(staging, &nccl_op(op))
            .map_err(|e| device("ncclAllReduce", &e))?;
        self.wait()?;
        let staging = self.staging.as_ref().expect("allocated above");
        self.stream
            .memcpy_dtoh(staging, data)
            .map_err(|e| device("copy from the GPU", &e))?;
        self.stream
            .synchronize()
            .map_err(|e| device("synchronize", &e))
    }
    fn time_all_reduce(
        &mut self,
        data: &mut [f32],
        warmup: usize,
        iterations: usize,
    ) -> Result<f64, CollectiveError> {
        let mut staging = self
            .stream
            .alloc_zeros::<f32>(data.len())
            .map_err(|e| device_error("allocate the timed buffer", &e))?;
        self.stream
            .memcpy_htod(data, &mut staging)
            .map_err(|e| device_error("copy to the GPU", &e))?;
        let mut reduce = |comm: &Comm| {
            comm.all_reduce_in_place(&mut staging, &nccl_op(ReduceOp::Sum))
                .map(drop)
                .map_err(|e| device_error("ncclAllReduce", &e))
        };
        for _ in 0..warmup {
            reduce(&self.comm.0)?;
        }
        self.wait()?;
        // The bootstrap's barrier: our own all-reduce would stage through host memory.
        self.bootstrap.barrier()?;
        let start = Instant::now();
        for _ in 0..iterations {
            reduce(&self.comm.0)?;
        }
        self.wait()?;
        let seconds = start.elapsed().as_secs_f64() / iterations.max(1) as f64;
        self.stream
            .memcpy_dtoh(&staging, data)
            .map_err(|e| device_error("copy from the GPU", &e))?;
        self.stream
            .synchronize()
            .map_err(|e| device_error("synchronize", &e))?;
        Ok(seconds)
    }
    fn time_from_previous(
        &mut self,
        count: usize,
        warmup: usize,
        iterations: usize,
    ) -> Result<f64, CollectiveError> {
        let (rank, n) = (self.rank(), self.world_size());
        let (next, previous) = ((rank + 1) % n, (rank + n - 1) % n);
        let alloc = |stream: &Arc<CudaStream>| {
            stream
                .alloc_zeros::<f32>(count)
                .map_err(|e| device_error("allocate a link's buffer", &e))
        };
        let (outgoing, mut incoming) = (alloc(&self.stream)?, alloc(&self.stream)?);
        // One group: NCCL runs the send and the receive together, so no rank waits for its
        // previous rank before it sends (a ring of blocking sends would deadlock).
        let mut pass = |comm: &Comm| -> Result<(), CollectiveError> {
            let nccl = |what: &str, e: &dyn std::fmt::Debug| device_error(what, e);
            cudarc::nccl::result::group_start().map_err(|e| nccl("ncclGroupStart", &e))?;
            let sent = comm.send(&outgoing, next as i32);
            let received = comm.recv(&mut incoming, previous as i32);
            cudarc::nccl::result::group_end().map_err(|e| nccl("ncclGroupEnd", &e))?;
            sent.map_err(|e| nccl("ncclSend", &e))?;
            received.map(drop).map_err(|e| nccl("ncclRecv", &e))
        };
        for _ in 0..warmup {
            pass(&self.comm.0)?;
        }
        self.wait()?;
        self.bootstrap.barrier()?;
        let start = Instant::now();
        for _ in 0..iterations {
            pass(&self.comm.0)?;
        }
        self.wait()?;
        Ok(start.elapsed().as_secs_f64() / iterations.max(1) as f64)
    }
    fn broadcast(&mut self, data: &mut [f32], root: usize) -> Result<(), CollectiveError> {
        // Broadcasts happen once per run (initial weights); the bootstrap ring is enough.
        self.bootstrap.broadcast(data, root)
    }
    fn on_device(&mut self) -> Option<&mut dyn DeviceAllReduce> {
        Some(self)
    }
    fn fabric(&self) -> Option<super::fabric::FabricSeen> {
        let log = std::fs::read_to_string(self.debug_file.as_ref()?).ok()?;
        Some(super::fabric::parse(&log))
    }
}

/// A CUDA or NCCL call's failure, saying which.
fn device_error(what: &str, e: &dyn std::fmt::Debug) -> CollectiveError {
    CollectiveError::Device {
        message: format!("{what}: {e:?}"),
    }
}

fn nccl_op(op: ReduceOp) -> cudarc::nccl::ReduceOp {
    match op {
        ReduceOp::Sum => cudarc::nccl::ReduceOp::Sum,
        ReduceOp::Average => cudarc::nccl::ReduceOp::Avg,
    }
}

impl DeviceAllReduce for NcclCollective {
    fn queue_all_reduce(
        &mut self,
        ptr: u64,
        len: usize,
        op: ReduceOp,
        after: &CudaStream,
    ) -> Result<(), CollectiveError> {
        let device = |what: &str, e: &dyn std::fmt::Debug| CollectiveError::Device {
            message: format!("{what}: {e:?}"),
        };
        // NCCL's stream waits for what the compute stream has queued so far: the
        // gradients of this bucket are written by then. (Both streams belong to this GPU's
        // primary context.) Timed, as the start and end, to tell how much backward hid.
        let written = timed_event(after)?;
        self.stream
            .wait(&written)
            .map_err(|e| device("order NCCL after the backward pass", &e))?;
        let started = timed_event(&self.stream)?;
        let mut bucket = DeviceGradients {
            ptr,
            len,
            stream: self.stream.clone(),
        };
        self.comm
            .0
            .all_reduce_in_place(&mut bucket, &nccl_op(op))
            .map_err(|e| device("ncclAllReduce", &e))?;
        let ended = timed_event(&self.stream)?;
        self.queued.push([written, started, ended]);
        Ok(())
    }

    fn join(&mut self) -> Result<(), CollectiveError> {
        self.wait()?;
        self.joined = self.bucket_times()?;
        self.queued.clear();
        Ok(())
    }

    fn last_buckets(&self) -> Vec<BucketTimes> {
        self.joined.clone()
    }
}

/// Gradients in memory the CUDA backend owns, as cudarc's NCCL calls take them: the backend
/// orders every access itself, so there is nothing for cudarc to record or wait for.
struct DeviceGradients {
    ptr: u64,
    len: usize,
    stream: Arc<CudaStream>,
}

impl cudarc::driver::DeviceSlice<f32> for DeviceGradients {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl cudarc::driver::DevicePtrMut<f32> for DeviceGradients {
    fn device_ptr_mut<'a>(
        &'a mut self,
        _stream: &'a CudaStream,
    ) -> (u64, cudarc::driver::SyncOnDrop<'a>) {
        (self.ptr, cudarc::driver::SyncOnDrop::Sync(None))
    }
}
