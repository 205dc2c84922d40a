//! Ringmaster's local control plane, for `make run` and the end-to-end tests: helpers to
//! reach it and to shape its simulated (KWOK) nodes like AKS agent pools.

pub mod bench;
pub mod cluster;
pub mod nodes;
pub mod simulated_aks;

#[cfg(test)]
mod pool_step_tests;
