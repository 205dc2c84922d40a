//! NVIDIA's nvJPEG, loaded at run time (like every CUDA library here, so the trainer builds
//! and runs without it): the few calls the GPU loader ([`super::gpu`]) makes. Two decoders:
//! the GPU's hardware JPEG engines (A100, H100, H200: `NVJPEG_BACKEND_HARDWARE`, batched,
//! baseline JPEGs only), and nvJPEG's default one (Huffman on the CPU, the rest in CUDA)
//! for what the hardware refuses. Both write interleaved RGB into device memory.
//!
//! The default decoder's Huffman stage runs on the calling thread, so one thread decodes
//! one image at a time. nvJPEG's handle may be shared between threads, its decoding states
//! may not: [`NvJpeg::lanes`] hands out one state per thread ([`Lane`]), so several threads
//! decode at once.

use std::ffi::c_void;

use cudarc::driver::sys::CUstream;
use libloading::Library;

/// The library's file names, newest first (CUDA 13's wheel, then 12's, then a toolkit's).
const LIBRARY_NAMES: [&str; 3] = ["libnvjpeg.so.13", "libnvjpeg.so.12", "libnvjpeg.so"];

/// Why nvJPEG could not be used.
#[derive(Debug, thiserror::Error)]
pub enum NvJpegError {
    /// No nvJPEG on the library path.
    #[error(
        "nvJPEG does not load ({tried}): install the nvidia-nvjpeg wheel or CUDA's toolkit and add its lib folder to LD_LIBRARY_PATH"
    )]
    Missing {
        /// What was tried, and the last loader error.
        tried: String,
    },
    /// The library lacks a function this code calls.
    #[error("nvJPEG has no {0} (too old a version?)")]
    Symbol(&'static str),
    /// A call returned an error status.
    #[error("{call} returned {status}")]
    Call {
        /// The call.
        call: &'static str,
        /// nvJPEG's status, by name.
        status: &'static str,
    },
}

/// `nvjpegImage_t`: up to four planes and their row pitches; interleaved output uses the
/// first alone.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Image {
    /// Device pointers to each plane.
    pub channel: [*mut u8; 4],
    /// Bytes per row of each plane.
    pub pitch: [u32; 4],
}

// SAFETY: device addresses and sizes, plain data that no host code reads through; the
// unsafe decode calls say what must hold of them.
unsafe impl Send for Image {}

/// What a JPEG's header says, read by nvJPEG.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageInfo {
    /// Colour components (1 grey, 3 YCbCr, 4 CMYK/YCCK).
    pub components: i32,
    /// Full-size width.
    pub width: usize,
    /// Full-size height.
    pub height: usize,
}

type Handle = *mut c_void;
type State = *mut c_void;
type Stream = *mut c_void;
type Status = i32;

const BACKEND_DEFAULT: i32 = 0;
const BACKEND_HARDWARE: i32 = 3;
/// `NVJPEG_OUTPUT_RGBI`: interleaved RGB.
const OUTPUT_RGBI: i32 = 5;

/// nvJPEG's status codes by name (`nvjpegStatus_t`).
fn status_name(status: Status) -> &'static str {
    match status {
        1 => "NVJPEG_STATUS_NOT_INITIALIZED",
        2 => "NVJPEG_STATUS_INVALID_PARAMETER",
        3 => "NVJPEG_STATUS_BAD_JPEG",
        4 => "NVJPEG_STATUS_JPEG_NOT_SUPPORTED",
        5 => "NVJPEG_STATUS_ALLOCATOR_FAILURE",
        6 => "NVJPEG_STATUS_EXECUTION_FAILED",
        7 => "NVJPEG_STATUS_ARCH_MISMATCH",
        8 => "NVJPEG_STATUS_INTERNAL_ERROR",
        9 => "NVJPEG_STATUS_IMPLEMENTATION_NOT_SUPPORTED",
        10 => "NVJPEG_STATUS_INCOMPLETE_BITSTREAM",
        _ => "an unknown nvJPEG status",
    }
}

fn check(call: &'static str, status: Status) -> Result<(), NvJpegError> {
    match status {
        0 => Ok(()),
        s => Err(NvJpegError::Call {
            call,
            status: status_name(s),
        }),
    }
}

/// The entry points used, resolved once.
struct Api {
    create_ex: unsafe extern "C" fn(i32, *mut c_void, *mut c_void, u32, *mut Handle) -> Status,
    destroy: unsafe extern "C" fn(Handle) -> Status,
    state_create: unsafe extern "C" fn(Handle, *mut State) -> Status,
    state_destroy: unsafe extern "C" fn(State) -> Status,
    get_image_info: unsafe extern "C" fn(
        Handle,
        *const u8,
        usize,
        *mut i32,
        *mut i32,
        *mut i32,
        *mut i32,
    ) -> Status,
    stream_create: unsafe extern "C" fn(Handle, *mut Stream) -> Status,
    stream_destroy: unsafe extern "C" fn(Stream) -> Status,
    stream_parse_header: unsafe extern "C" fn(Handle, *const u8, usize, Stream) -> Status,
    batched_supported: unsafe extern "C" fn(Handle, Stream, *mut i32) -> Status,
    batched_initialize: unsafe extern "C" fn(Handle, State, i32, i32, i32) -> Status,
    decode_batched: unsafe extern "C" fn(
        Handle,
        State,
        *const *const u8,
        *const usize,
        *mut Image,
        CUstream,
    ) -> Status,
    decode:
        unsafe extern "C" fn(Handle, State, *const u8, usize, i32, *mut Image, CUstream) -> Status,
    get_property: unsafe extern "C" fn(i32, *mut i32) -> Status,
}

impl Api {
    fn resolve(library: &Library) -> Result<Self, NvJpegError> {
        macro_rules! symbol {
            ($name:literal) => {
                // SAFETY: the type written at the field is the C declaration in nvjpeg.h.
                *unsafe { library.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|_| NvJpegError::Symbol($name))?
            };
        }
        Ok(Self {
            create_ex: symbol!("nvjpegCreateEx"),
            destroy: symbol!("nvjpegDestroy"),
            state_create: symbol!("nvjpegJpegStateCreate"),
            state_destroy: symbol!("nvjpegJpegStateDestroy"),
            get_image_info: symbol!("nvjpegGetImageInfo"),
            stream_create: symbol!("nvjpegJpegStreamCreate"),
            stream_destroy: symbol!("nvjpegJpegStreamDestroy"),
            stream_parse_header: symbol!("nvjpegJpegStreamParseHeader"),
            batched_supported: symbol!("nvjpegDecodeBatchedSupported"),
            batched_initialize: symbol!("nvjpegDecodeBatchedInitialize"),
            decode_batched: symbol!("nvjpegDecodeBatched"),
            decode: symbol!("nvjpegDecode"),
            get_property: symbol!("nvjpegGetProperty"),
        })
    }
}

/// The hardware engines' handle, decoding state and header parser.
struct Hardware {
    handle: Handle,
    state: State,
    stream: Stream,
}

/// nvJPEG, open, with the hardware decoder when the GPU has one.
pub struct NvJpeg {
    api: Api,
    hardware: Option<Hardware>,
    /// The default backend, for JPEGs the hardware refuses.
    handle: Handle,
    /// One decoding state of the default backend per lane (at least one).
    states: Vec<State>,
    // Last: the functions above point into it.
    _library: Library,
}

// SAFETY: nvJPEG's handles and states may be used from any thread, one thread at a time,
// which `&mut`/`&` on the loader that owns this ensures (it is not Sync); `lanes` lends
// each state to one thread alone.
unsafe impl Send for NvJpeg {}

/// One thread's share of nvJPEG's default decoder: the shared handle and a decoding state
/// of its own, lent by [`NvJpeg::lanes`].
pub struct Lane<'a> {
    api: &'a Api,
    handle: Handle,
    state: State,
}

// SAFETY: nvJPEG's library handle may be used by several threads at once (its guide's
// "Thread Safety"); the state is this lane's alone while the `&mut NvJpeg` it came from is
// borrowed.
unsafe impl Send for Lane<'_> {}

impl Lane<'_> {
    /// Decodes one JPEG with the default backend into `out`, queued on `stream`; the
    /// Huffman stage runs on this thread.
    ///
    /// # Safety
    /// As [`NvJpeg::decode_on_hardware`], for one image; the CUDA context of `stream` must
    /// be current on this thread.
    pub unsafe fn decode(
        &mut self,
        jpeg: &[u8],
        out: &mut Image,
        stream: CUstream,
    ) -> Result<(), NvJpegError> {
        // SAFETY: the caller vouches for `out` and the context; `jpeg` outlives the call.
        check("nvjpegDecode", unsafe {
            (self.api.decode)(
                self.handle,
                self.state,
                jpeg.as_ptr(),
                jpeg.len(),
                OUTPUT_RGBI,
                out,
                stream,
            )
        })
    }
}

impl NvJpeg {
    /// Loads nvJPEG and opens its CUDA decoder with `lanes` decoding states (at least one),
    /// and the hardware one when `hardware` and the GPU has it ([`NvJpeg::hardware`] says).
    /// Needs the CUDA runtime's primary context, which cudarc's `CudaContext` is.
    pub fn open(hardware: bool, lanes: usize) -> Result<Self, NvJpegError> {
        let mut tried = Vec::new();
        let library = LIBRARY_NAMES
            .iter()
            // SAFETY: loading nvJPEG runs its initialisers, which only set up the library.
            .find_map(|name| match unsafe { Library::new(*name) } {
                Ok(library) => Some(library),
                Err(e) => {
                    tried.push(format!("{name}: {e}"));
                    None
                }
            })
            .ok_or_else(|| NvJpegError::Missing {
                tried: tried.join("; "),
            })?;
        let api = Api::resolve(&library)?;
        let (handle, state) = open_backend(&api, BACKEND_DEFAULT)?;
        let mut states = vec![state];
        while states.len() < lanes {
            match new_state(&api, handle) {
                Ok(state) => states.push(state),
                Err(e) => {
                    // SAFETY: each created above, destroyed once, states before the handle.
                    unsafe { destroy(&api, handle, &states) };
                    return Err(e);
                }
            }
        }
        let hardware = hardware
            .then(|| open_backend(&api, BACKEND_HARDWARE).ok())
            .flatten()
            .and_then(|(handle, state)| {
                let mut stream = std::ptr::null_mut();
                // SAFETY: `handle` is live; the out-pointer is a local.
                match check("nvjpegJpegStreamCreate", unsafe {
                    (api.stream_create)(handle, &mut stream)
                }) {
                    Ok(()) => Some(Hardware {
                        handle,
                        state,
                        stream,
                    }),
                    Err(_) => {
                        // SAFETY: created above, destroyed once.
                        unsafe { destroy(&api, handle, &[state]) };
                        None
                    }
                }
            });
        Ok(Self {
            api,
            hardware,
            handle,
            states,
            _library: library,
        })
    }

    /// Each decoding state of the default backend as a lane, for a thread of its own.
    pub fn lanes(&mut self) -> Vec<Lane<'_>> {
        self.states
            .iter()
            .map(|&state| Lane {
                api: &self.api,
                handle: self.handle,
                state,
            })
            .collect()
    }

    /// Whether the GPU's hardware JPEG decoder is in use.
    pub fn hardware(&self) -> bool {
        self.hardware.is_some()
    }

    /// nvJPEG's version, `major.minor.patch`.
    pub fn version(&self) -> String {
        let part = |kind: i32| {
            let mut value = -1;
            // SAFETY: the out-pointer is a local.
            unsafe { (self.api.get_property)(kind, &mut value) };
            value
        };
        format!("{}.{}.{}", part(0), part(1), part(2))
    }

    /// The header of the JPEG in `bytes`.
    pub fn info(&self, bytes: &[u8]) -> Result<ImageInfo, NvJpegError> {
        let (mut components, mut subsampling) = (0, 0);
        let (mut widths, mut heights) = ([0i32; 4], [0i32; 4]);
        // SAFETY: `bytes` is live for the call; the arrays hold the 4 components nvJPEG
        // writes at most.
        check("nvjpegGetImageInfo", unsafe {
            (self.api.get_image_info)(
                self.handle,
                bytes.as_ptr(),
                bytes.len(),
                &mut components,
                &mut subsampling,
                widths.as_mut_ptr(),
                heights.as_mut_ptr(),
            )
        })?;
        Ok(ImageInfo {
            components,
            width: widths[0].max(0) as usize,
            height: heights[0].max(0) as usize,
        })
    }

    /// Whether the hardware decoder takes the JPEG in `bytes` (baseline, a layout it has).
    pub fn hardware_takes(&self, bytes: &[u8]) -> bool {
        let Some(hw) = &self.hardware else {
            return false;
        };
        let mut refused = 1;
        // SAFETY: the handle and parser are live; `bytes` outlives the call. nvJPEG says 0
        // for "supported".
        unsafe {
            (self.api.stream_parse_header)(hw.handle, bytes.as_ptr(), bytes.len(), hw.stream) == 0
                && (self.api.batched_supported)(hw.handle, hw.stream, &mut refused) == 0
                && refused == 0
        }
    }

    /// Decodes `jpegs` on the hardware engines into `out` (one interleaved-RGB image each,
    /// in device memory), queued on `stream`.
    ///
    /// # Safety
    /// Each `out` image must point to device memory of `pitch × height` bytes, live until
    /// `stream` has run the decode.
    pub unsafe fn decode_on_hardware(
        &self,
        jpegs: &[&[u8]],
        out: &mut [Image],
        stream: CUstream,
    ) -> Result<(), NvJpegError> {
        assert_eq!(jpegs.len(), out.len(), "one output per JPEG");
        if jpegs.is_empty() {
            return Ok(());
        }
        let hw = self
            .hardware
            .as_ref()
            .expect("decode_on_hardware without the hardware decoder");
        let data: Vec<*const u8> = jpegs.iter().map(|j| j.as_ptr()).collect();
        let lengths: Vec<usize> = jpegs.iter().map(|j| j.len()).collect();
        // SAFETY: the arrays have `jpegs.len()` entries and outlive the calls; the caller
        // vouches for `out`.
        unsafe {
            check(
                "nvjpegDecodeBatchedInitialize",
                (self.api.batched_initialize)(
                    hw.handle,
                    hw.state,
                    jpegs.len() as i32,
                    1,
                    OUTPUT_RGBI,
                ),
            )?;
            check(
                "nvjpegDecodeBatched (hardware)",
                (self.api.decode_batched)(
                    hw.handle,
                    hw.state,
                    data.as_ptr(),
                    lengths.as_ptr(),
                    out.as_mut_ptr(),
                    stream,
                ),
            )
        }
    }
}

/// A handle and a decoding state of `backend`.
fn open_backend(api: &Api, backend: i32) -> Result<(Handle, State), NvJpegError> {
    let mut handle = std::ptr::null_mut();
    // SAFETY: null allocators ask for nvJPEG's own; the out-pointer is a local.
    check("nvjpegCreateEx", unsafe {
        (api.create_ex)(
            backend,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0,
            &mut handle,
        )
    })?;
    match new_state(api, handle) {
        Ok(state) => Ok((handle, state)),
        Err(e) => {
            // SAFETY: created above, destroyed once.
            unsafe { (api.destroy)(handle) };
            Err(e)
        }
    }
}

/// A new decoding state of `handle`'s backend.
fn new_state(api: &Api, handle: Handle) -> Result<State, NvJpegError> {
    let mut state = std::ptr::null_mut();
    // SAFETY: `handle` is live; the out-pointer is a local.
    check("nvjpegJpegStateCreate", unsafe {
        (api.state_create)(handle, &mut state)
    })?;
    Ok(state)
}

/// Destroys `states`, then `handle`.
///
/// # Safety
/// Each was created once and is not used again.
unsafe fn destroy(api: &Api, handle: Handle, states: &[State]) {
    // SAFETY: the caller's promise.
    unsafe {
        for &state in states {
            (api.state_destroy)(state);
        }
        (api.destroy)(handle);
    }
}

impl Drop for NvJpeg {
    fn drop(&mut self) {
        // SAFETY: each was created once by `open` and is destroyed once, states before
        // their handles.
        unsafe {
            if let Some(hw) = self.hardware.take() {
                (self.api.stream_destroy)(hw.stream);
                destroy(&self.api, hw.handle, &[hw.state]);
            }
            destroy(&self.api, self.handle, &self.states);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_are_named_and_success_is_not_an_error() {
        assert!(check("x", 0).is_ok());
        let e = check("nvjpegDecode", 4).unwrap_err();
        assert_eq!(
            e.to_string(),
            "nvjpegDecode returned NVJPEG_STATUS_JPEG_NOT_SUPPORTED"
        );
    }

    /// Where nvJPEG is not installed (as on CI), opening it says so and how to fix it,
    /// instead of crashing; where it is but no GPU is, the failing call is named.
    #[test]
    fn opening_says_what_is_missing_or_opens() {
        match NvJpeg::open(false, 2) {
            Err(NvJpegError::Missing { tried }) => {
                assert!(tried.contains("libnvjpeg.so.13"), "{tried}")
            }
            Err(NvJpegError::Call { call, .. }) => assert_eq!(call, "nvjpegCreateEx"),
            Err(e) => panic!("{e}"),
            Ok(mut n) => {
                assert!(!n.version().starts_with('-'));
                assert_eq!(n.lanes().len(), 2);
            }
        }
    }
}
