//! Who am I in the job: rank, world size and local rank, from the launcher's environment.
//!
//! Read in this order: Open MPI (`OMPI_COMM_WORLD_*`), PMIx (`PMIX_RANK` with
//! `OMPI_COMM_WORLD_SIZE` or `PMIX_SIZE`), MPICH / Intel MPI Hydra (`PMI_RANK`, `PMI_SIZE`),
//! then plain `RANK` / `WORLD_SIZE` (torchrun style); none of them means a single rank.

use std::collections::HashMap;

/// Errors reading the environment.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WorldError {
    /// A variable is set but is not a number.
    #[error("{name}={value} is not a non-negative integer")]
    NotANumber { name: String, value: String },
    /// The rank is not below the size.
    #[error("rank {rank} is not below the world size {size} (from {source_name})")]
    RankOutOfRange {
        rank: usize,
        size: usize,
        source_name: &'static str,
    },
}

/// This process's place in the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct World {
    /// 0-based rank.
    pub rank: usize,
    /// Number of ranks.
    pub size: usize,
    /// Rank among the processes on this node (picks the GPU).
    pub local_rank: usize,
    /// Which launcher's variables were used.
    pub source: &'static str,
}

impl World {
    /// A single rank.
    pub fn single() -> Self {
        Self {
            rank: 0,
            size: 1,
            local_rank: 0,
            source: "none",
        }
    }

    /// The GPU this process computes and all-reduces on: one process per GPU, GPU = local
    /// rank (the CUDA backend and NCCL both open this one).
    pub fn gpu_ordinal(&self) -> usize {
        self.local_rank
    }

    /// Reads the process environment.
    pub fn from_env() -> Result<Self, WorldError> {
        Self::from_vars(&std::env::vars().collect())
    }

    /// Reads the given variables (the testable core of [`World::from_env`]).
    pub fn from_vars(vars: &HashMap<String, String>) -> Result<Self, WorldError> {
        let number = |name: &str| -> Result<Option<usize>, WorldError> {
            match vars.get(name) {
                None => Ok(None),
                Some(value) => value
                    .trim()
                    .parse()
                    .map(Some)
                    .map_err(|_| WorldError::NotANumber {
                        name: name.to_string(),
                        value: value.clone(),
                    }),
            }
        };
        let candidates: [(&'static str, &str, &[&str], &[&str]); 4] = [
            (
                "Open MPI",
                "OMPI_COMM_WORLD_RANK",
                &["OMPI_COMM_WORLD_SIZE"],
                &["OMPI_COMM_WORLD_LOCAL_RANK"],
            ),
            (
                "PMIx",
                "PMIX_RANK",
                &["OMPI_COMM_WORLD_SIZE", "PMIX_SIZE"],
                &["PMIX_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"],
            ),
            (
                "PMI (MPICH, Intel MPI)",
                "PMI_RANK",
                &["PMI_SIZE"],
                &["MPI_LOCALRANKID", "PMI_LOCAL_RANK"],
            ),
            ("RANK/WORLD_SIZE", "RANK", &["WORLD_SIZE"], &["LOCAL_RANK"]),
        ];
        for (source, rank_var, size_vars, local_vars) in candidates {
            let Some(rank) = number(rank_var)? else {
                continue;
            };
            let mut size = None;
            for var in size_vars {
                if let Some(value) = number(var)? {
                    size = Some(value);
                    break;
                }
            }
            let Some(size) = size else { continue };
            let mut local_rank = 0;
            for var in local_vars {
                if let Some(value) = number(var)? {
                    local_rank = value;
                    break;
                }
            }
            if rank >= size {
                return Err(WorldError::RankOutOfRange {
                    rank,
                    size,
                    source_name: source,
                });
            }
            return Ok(Self {
                rank,
                size,
                local_rank,
                source,
            });
        }
        Ok(Self::single())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn each_launcher_is_understood() {
        let ompi = vars(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "16"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "3"),
        ]);
        assert_eq!(
            World::from_vars(&ompi).unwrap(),
            World {
                rank: 3,
                size: 16,
                local_rank: 3,
                source: "Open MPI"
            }
        );
        let pmix = vars(&[
            ("PMIX_RANK", "5"),
            ("PMIX_SIZE", "8"),
            ("PMIX_LOCAL_RANK", "1"),
        ]);
        assert_eq!(World::from_vars(&pmix).unwrap().rank, 5);
        let hydra = vars(&[
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "2"),
            ("MPI_LOCALRANKID", "1"),
        ]);
        assert_eq!(
            World::from_vars(&hydra).unwrap(),
            World {
                rank: 1,
                size: 2,
                local_rank: 1,
                source: "PMI (MPICH, Intel MPI)"
            }
        );
        let torch = vars(&[("RANK", "0"), ("WORLD_SIZE", "4")]);
        assert_eq!(World::from_vars(&torch).unwrap().size, 4);
        assert_eq!(World::from_vars(&vars(&[])).unwrap(), World::single());
    }

    #[test]
    fn bad_values_are_reported() {
        let err = World::from_vars(&vars(&[("RANK", "x"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert_eq!(err.to_string(), "RANK=x is not a non-negative integer");
        let err = World::from_vars(&vars(&[("RANK", "4"), ("WORLD_SIZE", "4")])).unwrap_err();
        assert!(matches!(err, WorldError::RankOutOfRange { .. }));
    }
}
