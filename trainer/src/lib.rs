//! Ringmaster's data-parallel trainer.
//!
//! * `engine` — tensors, layers with explicit forward/backward, ResNets, SGD, data, checkpoints.
//! * `world` — rank and world size from the MPI launcher's environment.
//! * `collective` — all-reduce behind one trait: single rank, TCP ring (NCCL later).

pub mod engine;
