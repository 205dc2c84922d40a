//! Whether the GPU's hardware JPEG decoder works here, asked of a child process: where it
//! does not (a sandbox without the decoder engine's driver calls, as the gVisor machines
//! the GPU tests ran on), nvJPEG's failure leaves the CUDA context broken ("an illegal
//! memory access") and its teardown can hang, so the process that trains must not be the
//! one that finds out. The child (`ringmaster-trainer probe-nvjpeg`, [`run`]) decodes two
//! small JPEGs on the hardware decoder and checks a pixel; the parent ([`hardware_works`])
//! waits at most [`PROBE_SECONDS`].

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;

use super::nvjpeg::{Image, NvJpeg};

/// How long the parent waits for the probe.
pub const PROBE_SECONDS: u64 = 30;

/// Set to `0` to leave the hardware decoder unused without probing it.
pub const HARDWARE_ENV: &str = "RINGMASTER_NVJPEG_HARDWARE";

/// Whether nvJPEG's hardware decoder decodes on GPU `ordinal`, by running `program
/// probe-nvjpeg --gpu ordinal` (`program`: a `ringmaster-trainer`); why not, when it
/// does not.
pub fn hardware_works(program: &Path, ordinal: usize) -> Result<(), String> {
    if std::env::var(HARDWARE_ENV).is_ok_and(|v| v == "0") {
        return Err(format!("{HARDWARE_ENV}=0"));
    }
    let mut child = Command::new(program)
        .args(["probe-nvjpeg", "--gpu", &ordinal.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("starting {} probe-nvjpeg: {e}", program.display()))?;
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if started.elapsed() < Duration::from_secs(PROBE_SECONDS) => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Ok(None) => {
                child.kill().ok();
                child.wait().ok();
                return Err(format!("the probe hung for {PROBE_SECONDS} s"));
            }
            Err(e) => return Err(format!("waiting for the probe: {e}")),
        }
    };
    let mut said = String::new();
    if let Some(mut stderr) = child.stderr.take() {
        std::io::Read::read_to_string(&mut stderr, &mut said).ok();
    }
    match status.success() {
        true => Ok(()),
        false => Err(said
            .lines()
            .last()
            .unwrap_or("the probe failed")
            .trim()
            .to_string()),
    }
}

/// The probe itself (`ringmaster-trainer probe-nvjpeg`): two JPEGs of one colour decoded
/// on the hardware decoder of GPU `ordinal`; their first pixel read back.
pub fn run(ordinal: usize) -> Result<(), String> {
    // SAFETY: a dlopen probe; cudarc panics on a library it cannot load.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("no NVIDIA driver here (libcuda.so.1)".into());
    }
    let ctx = CudaContext::new(ordinal).map_err(|e| format!("opening GPU {ordinal}: {e}"))?;
    let stream = ctx.new_stream().map_err(|e| e.to_string())?;
    let nvjpeg = NvJpeg::open(true, 1).map_err(|e| e.to_string())?;
    if !nvjpeg.hardware() {
        return Err("nvJPEG has no hardware decoder on this GPU".into());
    }
    let (w, h) = (64usize, 48usize);
    let pixels: Vec<u8> = std::iter::repeat_n([200u8, 40, 90], w * h)
        .flatten()
        .collect();
    let mut jpeg = Vec::new();
    jpeg_encoder::Encoder::new(&mut jpeg, 95)
        .encode(&pixels, w as u16, h as u16, jpeg_encoder::ColorType::Rgb)
        .map_err(|e| e.to_string())?;
    if !nvjpeg.hardware_takes(&jpeg) {
        return Err("the hardware decoder refuses a baseline JPEG".into());
    }
    let mut out = stream
        .alloc_zeros::<u8>(2 * w * h * 3)
        .map_err(|e| e.to_string())?;
    let base = {
        let (ptr, _sync) = cudarc::driver::DevicePtrMut::device_ptr_mut(&mut out, &stream);
        ptr
    };
    let image = |at: usize| Image {
        channel: [
            (base + at as u64) as *mut u8,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        ],
        pitch: [(w * 3) as u32, 0, 0, 0],
    };
    let mut images = [image(0), image(w * h * 3)];
    // SAFETY: `out` holds both images (`pitch × height` bytes each) and lives past the
    // synchronize below.
    unsafe { nvjpeg.decode_on_hardware(&[&jpeg, &jpeg], &mut images, stream.cu_stream()) }
        .map_err(|e| e.to_string())?;
    let decoded: Vec<u8> = stream
        .clone_dtoh(&out)
        .map_err(|e| format!("after decoding: {e}"))?;
    let second = &decoded[w * h * 3..][..3];
    let near = |a: u8, b: u8| a.abs_diff(b) <= 4;
    if !(near(second[0], 200) && near(second[1], 40) && near(second[2], 90)) {
        return Err(format!(
            "the hardware decoder gave {second:?} for [200, 40, 90]"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probes_exit_status_decides_and_a_missing_program_is_named() {
        assert_eq!(hardware_works(Path::new("true"), 0), Ok(()));
        assert_eq!(
            hardware_works(Path::new("false"), 0),
            Err("the probe failed".into())
        );
        let missing = hardware_works(Path::new("/nonexistent/ringmaster-trainer"), 0).unwrap_err();
        assert!(
            missing.starts_with("starting /nonexistent/ringmaster-trainer probe-nvjpeg"),
            "{missing}"
        );
    }
}
