//! `bench-allreduce`: times all-reduce over a range of sizes and reports algorithm and bus
//! bandwidth the way nccl-tests does (busbw = algbw × 2(n−1)/n for all-reduce).

use std::time::Instant;

use crate::collective::{Collective, CollectiveError, ReduceOp};

/// One size's result.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BenchRow {
    /// Bytes per rank.
    pub bytes: usize,
    /// f32 elements per rank.
    pub count: usize,
    /// Mean time of one all-reduce, microseconds (slowest rank's view is not gathered).
    pub time_us: f64,
    /// Algorithm bandwidth, GB/s: bytes / time.
    pub algbw_gbs: f64,
    /// Bus bandwidth, GB/s: algbw × 2(n−1)/n.
    pub busbw_gbs: f64,
    /// Whether the values were checked and right.
    pub correct: Option<bool>,
}

/// Parses sizes like `4K`, `1M`, `256M`, `1024` (bytes).
pub fn parse_size(text: &str) -> Result<usize, String> {
    let text = text.trim();
    let (digits, unit) = text.split_at(
        text.find(|c: char| !c.is_ascii_digit())
            .unwrap_or(text.len()),
    );
    let value: usize = digits
        .parse()
        .map_err(|_| format!("{text}: not a size like 4K, 1M or 256M"))?;
    let factor = match unit.to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "K" | "KB" | "KIB" => 1 << 10,
        "M" | "MB" | "MIB" => 1 << 20,
        "G" | "GB" | "GIB" => 1 << 30,
        other => return Err(format!("{text}: unknown unit {other}")),
    };
    Ok(value * factor)
}

/// Sizes from `min` to `max` bytes, multiplying by `factor`.
pub fn sizes(min: usize, max: usize, factor: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut size = min.max(4);
    while size <= max {
        out.push(size);
        size *= factor.max(2);
    }
    out
}

/// The value rank `rank` puts at index `i` when checking: small integers, so float sums are exact.
fn check_value(rank: usize, i: usize) -> f32 {
    ((rank + 1) * (i % 7 + 1)) as f32
}

/// nccl-tests' bus bandwidth of an all-reduce over `ranks` ranks at algorithm bandwidth
/// `algbw`: algbw × 2(n−1)/n, what each rank's link carries, comparable with the link's own
/// speed whatever the number of ranks.
pub fn bus_bandwidth(algbw: f64, ranks: usize) -> f64 {
    algbw * 2.0 * (ranks as f64 - 1.0) / ranks as f64
}

/// Runs the benchmark on `collective` for each size: `warmup` untimed runs, then `iterations`
/// timed ones. With `check`, the values are verified after the timed runs.
pub fn run(
    collective: &mut dyn Collective,
    sizes: &[usize],
    warmup: usize,
    iterations: usize,
    check: bool,
) -> Result<Vec<BenchRow>, CollectiveError> {
    let n = collective.world_size();
    let rank = collective.rank();
    let mut rows = Vec::new();
    for &bytes in sizes {
        let count = bytes / 4;
        let mut data = vec![1.0f32; count];
        let seconds = collective.time_all_reduce(&mut data, warmup, iterations)?;
        let correct = if check {
            data.iter_mut()
                .enumerate()
                .for_each(|(i, v)| *v = check_value(rank, i));
            collective.all_reduce(&mut data, ReduceOp::Sum)?;
            let ranks_sum = (n * (n + 1) / 2) as f32;
            Some(
                data.iter()
                    .enumerate()
                    .all(|(i, v)| *v == ranks_sum * (i % 7 + 1) as f32),
            )
        } else {
            None
        };
        let algbw = bytes as f64 / seconds / 1e9;
        rows.push(BenchRow {
            bytes,
            count,
            time_us: seconds * 1e6,
            algbw_gbs: algbw,
            busbw_gbs: bus_bandwidth(algbw, n),
            correct,
        });
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_and_step() {
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("256M"), Ok(256 << 20));
        assert_eq!(parse_size("1024"), Ok(1024));
        assert!(parse_size("4X").is_err());
        assert_eq!(sizes(4096, 65536, 4), vec![4096, 16384, 65536]);
    }
}

/// One `bench-engine` measurement: training steps on one synthetic batch.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EngineRow {
    /// The backend (`cpu`, `cuda`).
    pub engine: String,
    /// The network.
    pub model: String,
    /// Images per step.
    pub batch_size: usize,
    /// Side of the square images.
    pub image_size: usize,
    /// Activations' type.
    pub precision: String,
    /// Timed steps.
    pub steps: usize,
    /// Whether the timed steps replayed a recording (CUDA graphs; asked for with
    /// `--cuda-graph`, and never on the CPU).
    pub cuda_graph: bool,
    /// Whether each step's batch came from host memory (`--from-host`), else it stayed on
    /// the device.
    pub from_host: bool,
    /// Training throughput (forward, backward, SGD step).
    pub images_per_second: f64,
    /// Mean time of one step, milliseconds.
    pub step_ms: f64,
    /// Device memory the run used at its peak, where the backend can tell (CUDA: memory in
    /// use beside the arena's reservation, plus the arena's peak).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_bytes: Option<u64>,
    /// What `peak_bytes` is made of, where the backend can tell.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory: Option<DeviceMemory>,
    /// What computed training batch norm (CUDA: `fused`, `plain` or `own`, as
    /// `RINGMASTER_CUDA_BATCH_NORM` chose).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch_norm: Option<String>,
    /// How many of the step's training batch-norm plans cuDNN's fused calls run, of all
    /// (CUDA with the `fused` engine).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fused_batch_norms: Option<String>,
}

/// A CUDA run's device memory, by where it went.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceMemory {
    /// In use on the GPU beside the arena, by every process on it (on a GPU of its own:
    /// the CUDA context and the libraries' kernels, weights, gradients, momentum, the cuDNN
    /// and cuBLAS workspaces).
    pub beside_arena_bytes: u64,
    /// The most of the arena one step used: activations kept for the backward pass and
    /// the step's temporaries.
    pub arena_peak_bytes: u64,
    /// The cuDNN workspace (part of `beside_arena_bytes`): the largest the chosen
    /// algorithms need.
    pub cudnn_workspace_bytes: u64,
}

/// What [`engine`] times.
#[derive(Clone, Copy, Debug)]
pub struct EngineBench {
    /// Side of the square images.
    pub image_size: usize,
    /// Images per step.
    pub batch_size: usize,
    /// Timed steps.
    pub steps: usize,
    /// Untimed steps first (algorithm search, first allocations; at least the recorded
    /// step's own warm-up when `record`).
    pub warmup: usize,
    /// Record the step once warm and replay it.
    pub record: bool,
    /// Upload the batch from host memory every step, behind the step before it, as `train`
    /// does; else it is uploaded once and stays on the device.
    pub from_host: bool,
    /// Bracket the timed steps with the CUDA profiler's start and stop, so a profiler told
    /// to wait for them (`ncu --profile-from-start off`) sees those steps alone.
    pub profile: bool,
}

/// Starts (`true`) or stops the CUDA profiler's collection; nothing where no driver is.
pub fn cuda_profiler(start: bool) {
    // SAFETY: a dlopen probe first; the calls take no arguments and only tell an attached
    // profiler where to collect.
    unsafe {
        if !cudarc::driver::sys::is_culib_present() {
            return;
        }
        if start {
            cudarc::driver::sys::cuProfilerStart();
        } else {
            cudarc::driver::sys::cuProfilerStop();
        }
    }
}

/// Times `bench.steps` SGD steps of `model` on one synthetic batch after `bench.warmup`
/// untimed steps. Like a PyTorch loop that never calls `loss.item()`, a step reads nothing
/// back. Returns images/s, milliseconds per step, and whether the timed steps replayed a
/// recording.
pub fn engine<B: crate::engine::Backend>(
    model: &mut crate::engine::Model<B>,
    bench: &EngineBench,
) -> (f64, f64, bool) {
    use crate::engine::data::SyntheticData;
    use crate::engine::step::{RecordedStep, WARMUP_STEPS};
    let be = model.backend().clone();
    let EngineBench {
        image_size,
        batch_size,
        steps,
        ..
    } = *bench;
    let data = SyntheticData::new(model.num_classes(), image_size, batch_size, 1);
    let (images, labels) = data.batch(&(0..batch_size).collect::<Vec<_>>());
    let mut recorded = RecordedStep::new(model, batch_size, image_size, bench.record);
    recorded.load(model, &images, &labels);
    let mut sgd = crate::engine::Sgd::on(&be, model.params(), 0.9, 5e-5);
    let mut step = |model: &mut crate::engine::Model<B>| {
        recorded.run(model, 0.0);
        if bench.from_host {
            recorded.load(model, &images, &labels);
        }
        sgd.step(model.params_mut(), 0.01);
    };
    let warmup = if bench.record {
        bench.warmup.max(WARMUP_STEPS + 1)
    } else {
        bench.warmup
    };
    for _ in 0..warmup {
        step(model);
    }
    be.synchronize();
    if bench.profile {
        cuda_profiler(true);
    }
    let started = Instant::now();
    for _ in 0..steps {
        step(model);
    }
    be.synchronize();
    let seconds = started.elapsed().as_secs_f64();
    if bench.profile {
        cuda_profiler(false);
    }
    (
        (steps * batch_size) as f64 / seconds,
        seconds * 1000.0 / steps.max(1) as f64,
        recorded.recorded(),
    )
}

/// One training step (forward, loss, backward; no update) of `model` on a synthetic batch of
/// `batch_size` images of `image_size`², written to `dir` for `trainer/gpu/compare_step.py`
/// to run the same step in PyTorch from the same weights and compare tensor by tensor:
/// `before.safetensors` (the weights and batch-norm statistics by torchvision's names, and
/// the batch: `images` NCHW f32 flattened, `labels` as f32) and `after.safetensors` (each
/// parameter's gradient under the parameter's name, the statistics after the step; the
/// loss in the metadata). Returns the loss.
pub fn dump_step<B: crate::engine::Backend>(
    model: &mut crate::engine::Model<B>,
    batch_size: usize,
    image_size: usize,
    dir: &std::path::Path,
) -> Result<f32, crate::engine::checkpoint::CheckpointError> {
    use crate::engine::checkpoint;
    use crate::engine::data::SyntheticData;
    let be = model.backend().clone();
    let data = SyntheticData::new(model.num_classes(), image_size, batch_size, 1);
    let (images, labels) = data.batch(&(0..batch_size).collect::<Vec<_>>());
    let labels_f32: Vec<f32> = labels.iter().map(|&l| l as f32).collect();
    let classes = model.num_classes();
    let precision = match model.activations() {
        crate::engine::tensor::DType::F32 => "fp32",
        crate::engine::tensor::DType::Bf16 => "bf16",
    };
    let metadata = |loss: Option<f32>| {
        let mut m = std::collections::BTreeMap::from([
            ("batchSize".to_string(), batch_size.to_string()),
            ("imageSize".to_string(), image_size.to_string()),
            ("classes".to_string(), classes.to_string()),
            ("precision".to_string(), precision.to_string()),
        ]);
        if let Some(loss) = loss {
            m.insert("loss".to_string(), loss.to_string());
        }
        m
    };
    std::fs::create_dir_all(dir).map_err(|source| checkpoint::CheckpointError::Write {
        path: dir.display().to_string(),
        source,
    })?;
    let before = model.params().weights_to_host(&be);
    checkpoint::save_with(
        &dir.join("before.safetensors"),
        &before,
        &[("images", &images.data), ("labels", &labels_f32)],
        &metadata(None),
    )?;
    model.zero_grads();
    let loss = model.forward_backward(&images, &labels, 0.0, 1.0).loss;
    let mut after = model.params().to_host(&be);
    after.values = std::mem::take(&mut after.grads);
    checkpoint::save(
        &dir.join("after.safetensors"),
        &after,
        &metadata(Some(loss)),
    )?;
    Ok(loss)
}
