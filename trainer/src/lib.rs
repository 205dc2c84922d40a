//! Ringmaster's data-parallel trainer.
//!
//! * `engine` — tensors, layers with explicit forward/backward, ResNets, SGD, data, checkpoints.
//! * `world` — rank and world size from the MPI launcher's environment.
//! * `collective` — all-reduce behind one trait: single rank, TCP ring.
//! * `gpu` — the GPUs and CUDA libraries this machine offers, and what `--device auto` picks.
//! * `bench` — `bench-allreduce`, with nccl-tests' bandwidth figures.
//! * `loader_bench` — `bench-loader`: the image-folder loader alone, on the CPUs or with nvJPEG.
//! * `preflight` — the opt-in check of the fabric's bandwidth before the first step.
//! * `train` — the training loop over the ranks.
//! * `resume` — the run's checkpoint: written while training goes on, gone on from at a restart.
//! * `launch` — the launcher wrapper that turns rank 0's summary, or the failing rank's
//!   failure line, into a termination message.
//! * `program_error` — a user's program's failure read from its ranks' stderr (Python's
//!   exception line), for a program that prints no failure line.
//! * `report` — the launcher's progress reports to the operator.
//! * `failure` — a failing rank's failure line, for its errors and its panics.

pub mod bench;
pub mod collective;
pub mod engine;
pub mod failure;
pub mod gpu;
pub mod launch;
pub mod loader_bench;
pub mod preflight;
pub mod program_error;
pub mod report;
pub mod resume;
pub mod train;
pub mod world;
