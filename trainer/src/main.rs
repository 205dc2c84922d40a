//! `ringmaster-trainer`: data-parallel training of ResNets across MPI ranks.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use ringmaster_contract::trainer::{Capabilities, Failure as FailureLine, exit};
use ringmaster_trainer::collective::{self, Collective, CollectiveKind, NcclProbe, RingConfig};
use ringmaster_trainer::engine::backend::cuda::BatchNormEngine;
use ringmaster_trainer::world::World;
use ringmaster_trainer::{bench, launch, train};

/// Ringmaster's trainer. Run one process per rank (`mpirun -np N ringmaster-trainer …`); rank
/// and world size come from the MPI launcher's environment (Open MPI, PMIx, MPICH/Intel MPI
/// PMI) or RANK/WORLD_SIZE. Rank 0 serves a rendezvous at $RINGMASTER_RENDEZVOUS
/// (default 127.0.0.1:29500) where the ranks find each other.
#[derive(Parser, Debug)]
#[command(name = "ringmaster-trainer", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Write a small learnable dataset as an ImageNet-style folder of JPEGs (for tests and
    /// demos; also a quick way to fill a Blob container for a DataStage).
    MakeDataset {
        /// Folder to write `train/class-NNN/img-NNNNN.jpg` into.
        #[arg(long)]
        out: PathBuf,
        /// Number of classes.
        #[arg(long, default_value_t = 4)]
        classes: usize,
        /// Images per class.
        #[arg(long, default_value_t = 64)]
        per_class: usize,
        /// Side of the square images.
        #[arg(long, default_value_t = 32)]
        image_size: usize,
        /// Seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Instead of learnable squares of --image-size: photos of ImageNet's mix of sizes
        /// (mostly 500 px on the long side, a tenth up to 1,600) and file sizes (about
        /// 110 kB, 4:2:0 at quality 90), for timing loaders; they teach nothing.
        #[arg(long)]
        imagenet_sizes: bool,
    },
    /// Print this rank's view: version, rank and world, CPU threads, what this trainer can
    /// run (devices, precisions, models, collectives) and whether NCCL is usable here.
    Info {
        /// One JSON object (the default; the flag is accepted for scripts that ask for it).
        #[arg(long)]
        json: bool,
    },
    /// Train a ResNet, data-parallel over the job's ranks; JSON lines on stdout, a summary
    /// line at the end, the checkpoints in --output-dir (`runs/<run id>/`).
    Train(Box<train::TrainArgs>),
    /// Time all-reduce over a range of sizes; prints size, time, algbw and busbw like
    /// nccl-tests (busbw = algbw × 2(n−1)/n).
    BenchAllreduce(BenchArgs),
    /// Time training steps of one model on one device, the batch already there (synthetic
    /// data): images/s and step time as one JSON line (`--device cuda`: with the device
    /// memory it took, and where it went).
    BenchEngine(EngineArgs),
    /// Time the ImageNet-folder loader alone (read, decode, crop, normalise), on this
    /// machine's CPUs or with JPEGs decoded on the GPU (`--decoder nvjpeg`): can it feed the
    /// GPU, and with how many cores? One JSON line.
    BenchLoader(ringmaster_trainer::loader_bench::LoaderBenchArgs),
    /// Whether nvJPEG's hardware decoder works on this GPU (the GPU loader runs this as a
    /// child process before it uses the decoder: where it fails, it breaks the CUDA context
    /// of the process that tried). Exit 0 when it decodes.
    #[command(hide = true)]
    ProbeNvjpeg {
        /// The GPU.
        #[arg(long, default_value_t = 0)]
        gpu: usize,
    },
    /// Run an MPI launcher command, passing its output through, and write rank 0's JSON
    /// summary to the termination-message file, or, when a rank failed, that rank's failure
    /// line (what the launcher pod runs).
    Launch {
        /// File the summary (or failure) line is written to.
        #[arg(long, default_value = "/dev/termination-log")]
        termination_message: PathBuf,
        /// The launcher command, after `--`.
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
}

#[derive(clap::Args, Debug)]
struct BenchArgs {
    /// Which all-reduce to time.
    #[arg(long, value_enum, default_value_t = CollectiveKind::Auto, env = "RINGMASTER_COLLECTIVE")]
    collective: CollectiveKind,
    /// Smallest size per rank (4K, 1M, ...).
    #[arg(long, default_value = "4K", value_parser = bench::parse_size)]
    min_bytes: usize,
    /// Largest size per rank.
    #[arg(long, default_value = "256M", value_parser = bench::parse_size)]
    max_bytes: usize,
    /// Each size is the previous one times this.
    #[arg(long, default_value_t = 2)]
    step_factor: usize,
    /// Timed runs per size.
    #[arg(long, default_value_t = 20)]
    iterations: usize,
    /// Untimed runs per size before timing.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Check the summed values after timing (reported in the #wrong column).
    #[arg(long)]
    check: bool,
    /// Print JSON lines instead of the table.
    #[arg(long)]
    json: bool,
    /// For tests: this rank exits (without a word to the others) before the timed runs.
    #[arg(long, hide = true)]
    vanish_rank: Option<usize>,
}

#[derive(clap::Args, Debug)]
struct EngineArgs {
    /// Where to compute (`cpu` or `cuda`; GPU 0).
    #[arg(long, value_enum, default_value_t = train::Device::Cpu)]
    device: train::Device,
    /// The network.
    #[arg(long, value_enum, default_value_t = train::ModelName::Resnet50)]
    model: train::ModelName,
    /// Activations' type (bf16 needs `--device cuda`).
    #[arg(long, value_enum, default_value_t = train::Precision::Fp32)]
    precision: train::Precision,
    /// Images per step.
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Side of the square images.
    #[arg(long, default_value_t = 224)]
    image_size: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Untimed steps first (algorithm search, first allocations).
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Record the step once warm and replay it (CUDA graphs); the CPU runs it as it comes.
    #[arg(long)]
    cuda_graph: bool,
    /// Upload the batch from host memory every step, behind the step before it, as `train`
    /// does (else it is uploaded once and stays on the device).
    #[arg(long)]
    from_host: bool,
    /// Bracket the timed steps with the CUDA profiler's start and stop (for
    /// `ncu --profile-from-start off`: a kernel table of those steps alone).
    #[arg(long)]
    profile: bool,
    /// Instead of timing: write one step's weights, batch, gradients and statistics to this
    /// folder, for `trainer/gpu/compare_step.py` to compare with PyTorch's step from the
    /// same weights, tensor by tensor.
    #[arg(long)]
    dump_step: Option<PathBuf>,
}

impl EngineArgs {
    fn bench(&self) -> ringmaster_trainer::bench::EngineBench {
        ringmaster_trainer::bench::EngineBench {
            image_size: self.image_size,
            batch_size: self.batch_size,
            steps: self.steps,
            warmup: self.warmup,
            record: self.cuda_graph,
            from_host: self.from_host,
            profile: self.profile,
        }
    }
}

/// A failure, the rank it happened on where that is known, and the exit code it leaves
/// with ([`exit`]).
struct Failure {
    code: u8,
    rank: Option<usize>,
    message: String,
}

impl From<String> for Failure {
    fn from(message: String) -> Self {
        Self {
            code: exit::FAILED,
            rank: None,
            message,
        }
    }
}

impl Failure {
    /// The failure as the contract's line (`launch` and the operator read it).
    fn line(self) -> FailureLine {
        FailureLine {
            rank: self.rank.map(|rank| rank as u64),
            error: self.message,
            exit_code: self.code,
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result: Result<(), Failure> = match cli.command {
        Command::Info { json: _ } => info().map_err(Failure::from),
        Command::Train(args) => {
            ringmaster_trainer::failure::report_panics();
            match run_training(&args) {
                Ok(()) => return ExitCode::SUCCESS,
                Err(failure) => ringmaster_trainer::failure::leave(&failure.line()),
            }
        }
        Command::BenchEngine(args) => bench_engine(&args).map_err(Failure::from),
        Command::BenchLoader(args) => ringmaster_trainer::loader_bench::run(&args)
            .map(|line| println!("{line}"))
            .map_err(Failure::from),
        Command::MakeDataset {
            out,
            classes,
            per_class,
            image_size,
            seed,
            imagenet_sizes,
        } => make_dataset(&out, classes, per_class, image_size, seed, imagenet_sizes),
        Command::BenchAllreduce(args) => bench_allreduce(args),
        Command::ProbeNvjpeg { gpu } => {
            ringmaster_trainer::engine::image_folder::hardware_probe::run(gpu)
                .map_err(Failure::from)
        }
        Command::Launch {
            termination_message,
            command,
        } => match launch::run(&command, &termination_message) {
            Ok(code) => return ExitCode::from(code),
            Err(e) => Err(Failure::from(e.to_string())),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            let line = failure.line();
            eprintln!("ringmaster-trainer: {line}");
            ExitCode::from(line.exit_code)
        }
    }
}

/// The collective for this process, with the rank in its error; a rendezvous that fails
/// (a peer is missing) exits as a lost peer, a rendezvous key that cannot be read as a
/// failure.
fn collective(world: &World, kind: CollectiveKind) -> Result<Box<dyn Collective>, Failure> {
    RingConfig::from_env()
        .and_then(|config| collective::connect(world, kind, config))
        .map_err(|e| Failure {
            code: if e.is_peer_lost() {
                exit::PEER_LOST
            } else {
                exit::FAILED
            },
            rank: Some(world.rank),
            message: e.to_string(),
        })
}

fn run_training(args: &train::TrainArgs) -> Result<(), Failure> {
    // Settings are checked before any rank waits for the others.
    args.check(&Capabilities::this_release())
        .map_err(|errors| {
            let error = train::TrainError::InvalidSettings(errors);
            Failure {
                code: error.exit_code(),
                rank: None,
                message: error.to_string(),
            }
        })?;
    let world = World::from_env().map_err(|e| Failure::from(e.to_string()))?;
    ringmaster_trainer::failure::set_rank(world.rank);
    prepare_nccl_environment(&world);
    let mut collective = collective(&world, args.collective)?;
    let summary = match train::run(args, collective.as_mut(), world.gpu_ordinal()) {
        Ok(summary) => summary,
        // Before the collective is dropped: the others lose this rank once it has exited.
        Err(e) => ringmaster_trainer::failure::leave(&FailureLine {
            rank: Some(world.rank as u64),
            error: e.to_string(),
            exit_code: e.exit_code(),
        }),
    };
    if world.rank == 0 {
        println!("{}", summary.to_line());
    }
    Ok(())
}

fn info() -> Result<(), String> {
    let world = World::from_env().map_err(|e| e.to_string())?;
    let info = serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "rank": world.rank,
        "worldSize": world.size,
        "localRank": world.local_rank,
        "rankSource": world.source,
        "cpuThreads": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "capabilities": Capabilities::this_release(),
        "nccl": NcclProbe::detect(),
        "gpu": ringmaster_trainer::gpu::GpuProbe::detect(),
    });
    println!("{info}");
    Ok(())
}

/// NCCL's environment for a rank of several: a host id of its own where it shares its GPU
/// ([`World::nccl_host_id`]), unless the environment sets one, and NCCL's account of its
/// fabric written to a file the trainer reads ([`collective::fabric`]), unless the user
/// set `NCCL_DEBUG`.
fn prepare_nccl_environment(world: &World) {
    let env: std::collections::HashMap<String, String> = std::env::vars().collect();
    let mut settings = Vec::new();
    if let Some(id) = world.nccl_host_id()
        && !env.contains_key("NCCL_HOSTID")
    {
        settings.push(("NCCL_HOSTID".to_string(), id));
    }
    if world.size > 1 {
        settings.extend(collective::fabric::debug_settings(
            &env,
            &std::env::temp_dir(),
        ));
    }
    for (name, value) in settings {
        // SAFETY: called before the trainer starts a thread (the collective, the loader and
        // rayon's pool come later), so nothing reads the environment meanwhile.
        unsafe { std::env::set_var(name, value) };
    }
}

fn bench_allreduce(args: BenchArgs) -> Result<(), Failure> {
    let world = World::from_env().map_err(|e| Failure::from(e.to_string()))?;
    prepare_nccl_environment(&world);
    let mut collective = collective(&world, args.collective)?;
    if args.vanish_rank == Some(world.rank) {
        std::process::exit(0);
    }
    let sizes = bench::sizes(args.min_bytes, args.max_bytes, args.step_factor);
    let rows = bench::run(
        collective.as_mut(),
        &sizes,
        args.warmup,
        args.iterations,
        args.check,
    )
    .map_err(|e| Failure {
        code: if e.is_peer_lost() {
            exit::PEER_LOST
        } else {
            exit::FAILED
        },
        rank: Some(world.rank),
        message: e.to_string(),
    })?;
    let wrong = rows.iter().filter(|r| r.correct == Some(false)).count();
    if world.rank == 0 {
        if args.json {
            for row in &rows {
                println!("{}", serde_json::to_string(row).expect("row serializes"));
            }
        } else {
            println!(
                "# ringmaster-trainer bench-allreduce: {} ranks, {}, sum, float32",
                world.size,
                collective.name()
            );
            println!(
                "#{:>12} {:>12} {:>12} {:>12} {:>12} {:>7}",
                "size(B)", "count", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong"
            );
            for row in &rows {
                let wrong = match row.correct {
                    Some(true) => "0",
                    Some(false) => "WRONG",
                    None => "n/a",
                };
                println!(
                    " {:>12} {:>12} {:>12.1} {:>12.3} {:>12.3} {:>7}",
                    row.bytes, row.count, row.time_us, row.algbw_gbs, row.busbw_gbs, wrong
                );
            }
        }
    }
    if wrong > 0 {
        return Err(Failure::from(format!(
            "rank {}: {wrong} sizes summed wrongly",
            world.rank
        )));
    }
    Ok(())
}

fn bench_engine(args: &EngineArgs) -> Result<(), String> {
    use ringmaster_trainer::bench::{EngineRow, engine};
    use ringmaster_trainer::engine::backend::{CpuBackend, CudaBackend};
    use ringmaster_trainer::engine::tensor::DType;
    use ringmaster_trainer::engine::{Backend, Model};
    let dtype = match args.precision {
        train::Precision::Fp32 => DType::F32,
        train::Precision::Bf16 => DType::Bf16,
    };
    let arch = ringmaster_trainer::engine::Arch::of(args.model, 16);
    if let Some(dir) = &args.dump_step {
        return dump_step(args, arch, dtype, dir);
    }
    fn measure<B: Backend>(
        be: B,
        args: &EngineArgs,
        arch: ringmaster_trainer::engine::Arch,
        dtype: DType,
    ) -> Result<(f64, f64, bool), String> {
        if !be.supports(dtype) {
            return Err(format!(
                "the {} engine does not compute in {dtype:?}",
                be.name()
            ));
        }
        let mut model = Model::with_backend(arch, 1000, 1, be).with_activations(dtype);
        Ok(engine(&mut model, &args.bench()))
    }
    let (engine_name, (images_per_second, step_ms, cuda_graph), memory, batch_norm) =
        match args.device {
            train::Device::Cuda => {
                let be = CudaBackend::new(0, None).map_err(|e| e.to_string())?;
                let figures = measure(be.clone(), args, arch, dtype)?;
                let (after, arena) = be.memory();
                let memory = ringmaster_trainer::bench::DeviceMemory {
                    beside_arena_bytes: after.saturating_sub(arena) as u64,
                    arena_peak_bytes: be.arena_peak() as u64,
                    cudnn_workspace_bytes: be.workspace_bytes() as u64,
                };
                let plans = be.batch_norm_plans();
                let fused = plans.iter().filter(|p| p.fused).count();
                let fused = format!("{fused}/{}", plans.len());
                let engine = be.batch_norm_engine();
                ("cuda", figures, Some(memory), Some((engine, fused)))
            }
            _ => ("cpu", measure(CpuBackend, args, arch, dtype)?, None, None),
        };
    let row = EngineRow {
        engine: engine_name.into(),
        model: ringmaster_contract::trainer::flag_value(args.model),
        batch_size: args.batch_size,
        image_size: args.image_size,
        precision: ringmaster_contract::trainer::flag_value(args.precision),
        steps: args.steps,
        cuda_graph,
        from_host: args.from_host,
        images_per_second,
        step_ms,
        peak_bytes: memory
            .as_ref()
            .map(|m| m.beside_arena_bytes + m.arena_peak_bytes),
        memory,
        fused_batch_norms: batch_norm
            .as_ref()
            .filter(|(engine, _)| *engine == BatchNormEngine::CudnnFused)
            .map(|(_, fused)| fused.clone()),
        batch_norm: batch_norm.map(|(engine, _)| engine.name().to_string()),
    };
    println!("{}", serde_json::to_string(&row).expect("a row serializes"));
    Ok(())
}

/// `bench-engine --dump-step DIR`: one step written out for the comparison with PyTorch.
fn dump_step(
    args: &EngineArgs,
    arch: ringmaster_trainer::engine::Arch,
    dtype: ringmaster_trainer::engine::tensor::DType,
    dir: &std::path::Path,
) -> Result<(), String> {
    use ringmaster_trainer::engine::backend::{CpuBackend, CudaBackend};
    use ringmaster_trainer::engine::{Backend, Model};
    fn on<B: Backend>(
        be: B,
        args: &EngineArgs,
        arch: ringmaster_trainer::engine::Arch,
        dtype: ringmaster_trainer::engine::tensor::DType,
        dir: &std::path::Path,
    ) -> Result<f32, String> {
        let mut model = Model::with_backend(arch, 1000, 1, be).with_activations(dtype);
        ringmaster_trainer::bench::dump_step(&mut model, args.batch_size, args.image_size, dir)
            .map_err(|e| e.to_string())
    }
    let loss = match args.device {
        train::Device::Cuda => on(
            CudaBackend::new(0, None).map_err(|e| e.to_string())?,
            args,
            arch,
            dtype,
            dir,
        )?,
        _ => on(CpuBackend, args, arch, dtype, dir)?,
    };
    println!(
        "{}",
        serde_json::json!({"dumped": dir.display().to_string(), "loss": loss})
    );
    Ok(())
}

/// `make-dataset`: the learnable squares, or ImageNet-sized photos.
fn make_dataset(
    out: &std::path::Path,
    classes: usize,
    per_class: usize,
    image_size: usize,
    seed: u64,
    imagenet_sizes: bool,
) -> Result<(), Failure> {
    use ringmaster_trainer::engine::image_folder::{imagenet_sized, write_learnable};
    let fail = |e: std::io::Error| Failure::from(format!("writing {}: {e}", out.display()));
    let under = out.join("train");
    if imagenet_sizes {
        let (n, bytes) = imagenet_sized::write(out, classes, per_class, seed).map_err(fail)?;
        eprintln!(
            "wrote {n} ImageNet-sized images ({} kB on average) of {classes} classes under {}",
            bytes / n.max(1) as u64 / 1000,
            under.display()
        );
    } else {
        let n = write_learnable(out, classes, per_class, image_size, seed).map_err(fail)?;
        eprintln!(
            "wrote {n} images of {classes} classes under {}",
            under.display()
        );
    }
    Ok(())
}
