//! Ringmaster's data-parallel trainer.
//!
//! * `engine` — tensors, layers with explicit forward/backward, ResNets, SGD, data, checkpoints.
//! * `world` — rank and world size from the MPI launcher's environment.
//! * `collective` — all-reduce behind one trait: single rank, TCP ring.
//! * `gpu` — the GPUs and CUDA libraries this machine offers, and what `--device auto` picks.
//! * `bench` — `bench-allreduce`, with nccl-tests' bandwidth figures.
//! * `train` — the training loop over the ranks.
//! * `launch` — the launcher wrapper that turns rank 0's summary into a termination message.

pub mod bench;
pub mod collective;
pub mod engine;
pub mod gpu;
pub mod launch;
pub mod train;
pub mod world;
