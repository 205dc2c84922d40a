//! A TrainingJob as the controller works with it: its spec with every rule checked and
//! every default filled in ([`ValidatedTrainingJob`], made by the validate step). Types only;
//! no imports of the job's other steps.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use ringmaster_contract::trainer::{Capabilities, Setting, TrainArgs};

use crate::api::{
    DataStageRef, GpuDriver, MpiSpec, OutputSpec, PodOverrides, Provisioner, RunPolicy,
};
use crate::validation::{FieldError, FieldErrors};

/// Default size of an InfiniBand worker's in-memory /dev/shm.
pub const DEFAULT_SHM_SIZE: &str = "64Gi";
/// Steps trained when neither steps nor epochs is set.
pub const DEFAULT_STEPS: i64 = 1000;

/// A TrainingJob whose spec passed every rule, with every default filled in.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidatedTrainingJob {
    /// The job's name.
    pub name: String,
    /// The job's namespace.
    pub namespace: String,
    /// The job's UID (owner references, derived names).
    pub uid: String,
    /// Worker pods.
    pub workers: u32,
    /// GPUs per worker; 0 for a CPU job.
    pub gpus_per_worker: u32,
    /// MPI ranks per worker.
    pub slots_per_worker: u32,
    /// Image of launcher and workers.
    pub image: String,
    /// What every rank runs.
    pub program: Program,
    /// The DataStage to wait for and mount.
    pub data: Option<DataStageRef>,
    /// Where results go.
    pub output: Option<OutputSpec>,
    /// InfiniBand settings, when enabled.
    pub infiniband: Option<InfinibandSettings>,
    /// The nodes to run on, when the spec names a pool.
    pub node_pool: Option<NodePoolPlan>,
    /// MPI settings.
    pub mpi: MpiSpec,
    /// Additions to the launcher.
    pub launcher: PodOverrides,
    /// Additions to the workers.
    pub worker: PodOverrides,
    /// Restarts, deadlines, clean-up, suspension.
    pub run_policy: RunPolicy,
}

impl ValidatedTrainingJob {
    /// Total MPI ranks.
    pub fn world_size(&self) -> u32 {
        self.workers * self.slots_per_worker
    }
}

/// What `mpirun` starts on every rank.
#[derive(Clone, Debug, PartialEq)]
pub enum Program {
    /// The Ringmaster trainer with these settings (boxed: they are most of the size).
    Trainer(Box<TrainerSettings>),
    /// The user's own command.
    Command(Vec<String>),
}

/// The trainer's invocation with defaults filled in: the typed command line of
/// `ringmaster-trainer train` (the contract both programs share) and the user's extra flags.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainerSettings {
    /// What the operator sets from the spec.
    pub args: TrainArgs,
    /// `spec.trainer.extraArgs`, passed through after the operator's flags.
    pub extra_args: Vec<String>,
}

impl TrainerSettings {
    /// The flags after `ringmaster-trainer train`.
    pub fn flags(&self) -> Vec<String> {
        let mut flags = self.args.to_args();
        flags.extend(self.extra_args.iter().cloned());
        flags
    }

    /// Runs the trainer's own settings check on the flags the launcher will pass (extra
    /// flags included), as a trainer with `capabilities` would; errors name the spec field
    /// a user changes to fix them.
    pub fn check(&self, capabilities: &Capabilities) -> Result<(), FieldErrors> {
        let flags = self.flags();
        let parsed = TrainArgs::parse_flags(&flags).map_err(|e| {
            let text = e.to_string();
            let first = text.lines().next().unwrap_or_default();
            FieldErrors::one(
                "spec.trainer.extraArgs",
                format!(
                    "ringmaster-trainer train refuses these flags: {}",
                    first.trim_start_matches("error: ")
                ),
            )
        })?;
        parsed.check(capabilities).map_err(|errors| {
            FieldErrors(
                errors
                    .into_iter()
                    .map(|e| FieldError {
                        field: self.field_of(e.setting).into(),
                        message: e.to_string(),
                    })
                    .collect(),
            )
        })
    }

    /// The spec field behind a setting: the extra flags when they set it, else the field
    /// the operator derives it from.
    fn field_of(&self, setting: Setting) -> &'static str {
        let in_extra = self.extra_args.iter().any(|arg| {
            setting
                .flags()
                .iter()
                .any(|flag| arg == flag || arg.starts_with(&format!("{flag}=")))
        });
        if in_extra {
            return "spec.trainer.extraArgs";
        }
        match setting {
            Setting::Device => "spec.gpusPerWorker",
            Setting::Precision => "spec.trainer.precision",
            Setting::Model => "spec.trainer.model",
            Setting::BatchSize => "spec.trainer.batchSize",
            Setting::ImageSize => "spec.trainer.imageSize",
            Setting::Length => "spec.trainer.steps",
            Setting::LearningRate => "spec.trainer.learningRate",
            Setting::Warmup => "spec.trainer.warmupEpochs",
            Setting::KeepCheckpoints => "spec.trainer.keepCheckpoints",
            Setting::Run => "spec.trainer.resumeFrom",
            Setting::Preflight => "spec.infiniband.preflight",
            _ => "spec.trainer.extraArgs",
        }
    }
}

/// InfiniBand settings with defaults filled in.
#[derive(Clone, Debug, PartialEq)]
pub struct InfinibandSettings {
    /// The RDMA extended resource.
    pub rdma_resource: String,
    /// How many per worker.
    pub rdma_resource_count: u32,
    /// Size of /dev/shm.
    pub shm_size: Quantity,
    /// Extra NCCL/UCX environment.
    pub env: BTreeMap<String, String>,
}

/// The nodes a job runs on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodePoolPlan {
    /// Who provides the nodes.
    pub provisioner: Provisioner,
    /// VM size, when given.
    pub vm_size: Option<String>,
    /// The AKS agent pool's name (given or derived); `None` for existing nodes.
    pub pool_name: Option<String>,
    /// Spot VMs.
    pub spot: bool,
    /// Delete the pool after the job.
    pub delete_after_completion: bool,
    /// Labels that pick the nodes.
    pub node_selector: BTreeMap<String, String>,
    /// AKS GPU driver setting.
    pub gpu_driver: GpuDriver,
}
