//! Who am I in the job: rank, world size and local rank, from the launcher's environment.
//!
//! Read in this order: Open MPI (`OMPI_COMM_WORLD_*`), PMIx (`PMIX_RANK` with
//! `OMPI_COMM_WORLD_SIZE` or `PMIX_SIZE`), MPICH / Intel MPI Hydra (`PMI_RANK`, `PMI_SIZE`),
//! then plain `RANK` / `WORLD_SIZE` (torchrun style); none of them means a single rank.
//!
//! Each rank computes on the GPU of its local rank. `RINGMASTER_GPUS_PER_NODE=K` makes the
//! ranks of a node share K GPUs round robin instead (local rank mod K): several ranks on one
//! GPU, for tests and benchmarks of the distributed path on a machine with fewer GPUs than
//! ranks. NCCL refuses two ranks on one GPU of one host ("Duplicate GPU"), so each rank that
//! shares its GPU is given a host id of its own ([`World::nccl_host_id`]): NCCL then takes
//! the ranks for separate hosts and carries their traffic over its network transport.

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
    /// Ranks on this node, where the launcher says.
    pub local_size: Option<usize>,
    /// GPUs the node's ranks share round robin (`RINGMASTER_GPUS_PER_NODE`); `None`: one GPU
    /// per rank.
    pub gpus_per_node: Option<usize>,
}

/// This machine's host name (a pod's name in Kubernetes); empty when it cannot be read.
pub fn host_name() -> String {
    let mut buffer = [0u8; 256];
    // SAFETY: gethostname writes at most `len` bytes into the buffer it is given.
    let ok = unsafe { libc::gethostname(buffer.as_mut_ptr().cast(), buffer.len()) } == 0;
    if !ok {
        return String::new();
    }
    let end = buffer.iter().position(|&b| b == 0).unwrap_or(buffer.len());
    String::from_utf8_lossy(&buffer[..end]).to_string()
}

/// The variable that makes a node's ranks share its GPUs ([`World::gpu_ordinal`]).
pub const GPUS_PER_NODE_ENV: &str = "RINGMASTER_GPUS_PER_NODE";

impl World {
    /// A single rank.
    pub fn single() -> Self {
        Self {
            rank: 0,
            size: 1,
            local_rank: 0,
            source: "none",
            local_size: None,
            gpus_per_node: None,
        }
    }

    /// The GPU this process computes and all-reduces on (the CUDA backend and NCCL both
    /// open this one): its local rank, or that modulo `RINGMASTER_GPUS_PER_NODE`.
    pub fn gpu_ordinal(&self) -> usize {
        match self.gpus_per_node {
            Some(gpus) if gpus > 0 => self.local_rank % gpus,
            _ => self.local_rank,
        }
    }

    /// Whether this rank shares its GPU with another rank of its node.
    pub fn shares_gpu(&self) -> bool {
        match (self.gpus_per_node, self.local_size) {
            (Some(gpus), Some(local)) => gpus < local,
            // The launcher does not say how many ranks the node runs: sharing was asked for.
            (Some(_), None) => self.size > 1,
            (None, _) => false,
        }
    }

    /// The `NCCL_HOSTID` a rank that shares its GPU needs (one per rank, so NCCL does not
    /// refuse two ranks on one GPU); `None` when it has a GPU of its own.
    pub fn nccl_host_id(&self) -> Option<String> {
        self.shares_gpu()
            .then(|| format!("ringmaster-rank-{}", self.rank))
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
        let first = |names: &[&str]| -> Result<Option<usize>, WorldError> {
            for name in names {
                if let Some(value) = number(name)? {
                    return Ok(Some(value));
                }
            }
            Ok(None)
        };
        let gpus_per_node = number(GPUS_PER_NODE_ENV)?;
        // (launcher, rank, sizes, local ranks, local sizes)
        type Candidate<'a> = (
            &'static str,
            &'a str,
            &'a [&'a str],
            &'a [&'a str],
            &'a [&'a str],
        );
        let candidates: [Candidate; 4] = [
            (
                "Open MPI",
                "OMPI_COMM_WORLD_RANK",
                &["OMPI_COMM_WORLD_SIZE"],
                &["OMPI_COMM_WORLD_LOCAL_RANK"],
                &["OMPI_COMM_WORLD_LOCAL_SIZE"],
            ),
            (
                "PMIx",
                "PMIX_RANK",
                &["OMPI_COMM_WORLD_SIZE", "PMIX_SIZE"],
                &["PMIX_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"],
                &["PMIX_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"],
            ),
            (
                "PMI (MPICH, Intel MPI)",
                "PMI_RANK",
                &["PMI_SIZE"],
                &["MPI_LOCALRANKID", "PMI_LOCAL_RANK"],
                &["MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"],
            ),
            (
                "RANK/WORLD_SIZE",
                "RANK",
                &["WORLD_SIZE"],
                &["LOCAL_RANK"],
                &["LOCAL_WORLD_SIZE"],
            ),
        ];
        for (source, rank_var, size_vars, local_vars, local_size_vars) in candidates {
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
            let local_rank = first(local_vars)?.unwrap_or(0);
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
                local_size: first(local_size_vars)?,
                gpus_per_node,
            });
        }
        Ok(Self {
            gpus_per_node,
            ..Self::single()
        })
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
                source: "Open MPI",
                local_size: None,
                gpus_per_node: None,
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
                source: "PMI (MPICH, Intel MPI)",
                local_size: None,
                gpus_per_node: None,
            }
        );
        let torch = vars(&[("RANK", "0"), ("WORLD_SIZE", "4")]);
        assert_eq!(World::from_vars(&torch).unwrap().size, 4);
        assert_eq!(World::from_vars(&vars(&[])).unwrap(), World::single());
    }

    #[test]
    fn ranks_share_gpus_round_robin_only_when_asked_and_then_get_host_ids_of_their_own() {
        let rank = |r: &str, gpus: Option<&str>| {
            let mut v = vars(&[
                ("OMPI_COMM_WORLD_RANK", r),
                ("OMPI_COMM_WORLD_SIZE", "4"),
                ("OMPI_COMM_WORLD_LOCAL_RANK", r),
                ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ]);
            if let Some(gpus) = gpus {
                v.insert(GPUS_PER_NODE_ENV.into(), gpus.into());
            }
            World::from_vars(&v).unwrap()
        };
        let own = rank("3", None);
        assert_eq!((own.gpu_ordinal(), own.nccl_host_id()), (3, None));
        let shared = rank("3", Some("1"));
        assert_eq!(shared.local_size, Some(4));
        assert_eq!(shared.gpu_ordinal(), 0);
        assert_eq!(shared.nccl_host_id().as_deref(), Some("ringmaster-rank-3"));
        assert_ne!(rank("2", Some("1")).nccl_host_id(), shared.nccl_host_id());
        assert_eq!(rank("3", Some("2")).gpu_ordinal(), 1);
        // As many GPUs as ranks: nothing is shared, NCCL keeps its fast paths.
        assert_eq!(rank("3", Some("4")).nccl_host_id(), None);
        let err = World::from_vars(&vars(&[(GPUS_PER_NODE_ENV, "one")])).unwrap_err();
        assert_eq!(
            err.to_string(),
            "RINGMASTER_GPUS_PER_NODE=one is not a non-negative integer"
        );
    }

    #[test]
    fn bad_values_are_reported() {
        let err = World::from_vars(&vars(&[("RANK", "x"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert_eq!(err.to_string(), "RANK=x is not a non-negative integer");
        let err = World::from_vars(&vars(&[("RANK", "4"), ("WORLD_SIZE", "4")])).unwrap_err();
        assert!(matches!(err, WorldError::RankOutOfRange { .. }));
    }
}
