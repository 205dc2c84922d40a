//! Validate step of the TrainingJob controller: the raw object in, a [`ValidatedTrainingJob`]
//! out — schema and CEL rules checked, defaults merged, names derived. No client.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::ResourceExt;
use ringmaster_contract::trainer::{self as contract, Capabilities, Setting, TrainArgs};

use super::build::{self, PodRole};
use super::names::ChildNaming;
use crate::api::{
    DataSource, DataStageRef, GpuDriver, MpiSpec, OutputSpec, PodOverrides, Precision, Provisioner,
    RunPolicy, TrainingJob,
};
use crate::validation::{self, FieldError, FieldErrors};

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

/// Checks `job` against every rule and fills in defaults; the trainer's settings must run on
/// the trainer of this release.
pub fn validate(job: &TrainingJob) -> Result<ValidatedTrainingJob, FieldErrors> {
    validation::check_object(job)?;
    checked(with_defaults(job)?)
}

/// Checks a raw object as a user wrote it (and, for an update, against the `old` one), then
/// validates it like [`validate`]. Used by the fixture tests and by tools that lint YAML.
pub fn validate_value(
    value: &serde_json::Value,
    old: Option<&serde_json::Value>,
) -> Result<ValidatedTrainingJob, FieldErrors> {
    let job: TrainingJob = validation::parse_object(value, old)?;
    checked(with_defaults(&job)?)
}

/// Refuses a trainer invocation the trainer of this release would refuse.
fn checked(job: ValidatedTrainingJob) -> Result<ValidatedTrainingJob, FieldErrors> {
    if let Program::Trainer(settings) = &job.program {
        settings.check(&Capabilities::this_release())?;
    }
    let clashes = overrides_that_clash(&job);
    if !clashes.is_empty() {
        return Err(FieldErrors(clashes));
    }
    Ok(job)
}

/// The user's volumes and mounts that repeat a volume name or mount path Ringmaster gives the
/// same pod (which depends on the spec: `data` only with a DataStage, `dshm` only with
/// InfiniBand, ...: [`build::reserved_volumes`]). Refused here, naming the spec's field: the
/// API server would refuse the pod naming `spec.volumes[7]`.
fn overrides_that_clash(job: &ValidatedTrainingJob) -> Vec<FieldError> {
    let mut errors = Vec::new();
    for (role, overrides) in [
        (PodRole::Worker, &job.worker),
        (PodRole::Launcher, &job.launcher),
    ] {
        if overrides.volumes.is_empty() && overrides.volume_mounts.is_empty() {
            // Most jobs: nothing to check (every reconcile validates).
            continue;
        }
        // Any claim name: what matters is that the DataStage's volume is there when it
        // would be.
        let claim = job.data.as_ref().map(|_| "claim");
        let ours = build::reserved_volumes(job, role, ChildNaming::default(), claim);
        let role = role.name();
        for (i, volume) in overrides.volumes.iter().enumerate() {
            if ours.iter().any(|(v, _)| v.name == volume.name) {
                errors.push(FieldError {
                    field: format!("spec.{role}.volumes[{i}].name"),
                    message: format!(
                        "{} is the name of a volume Ringmaster gives the {role} pod of this spec: name yours differently",
                        volume.name
                    ),
                });
            }
        }
        for (i, mount) in overrides.volume_mounts.iter().enumerate() {
            if let Some((_, taken)) = ours.iter().find(|(_, m)| m.mount_path == mount.mount_path) {
                errors.push(FieldError {
                    field: format!("spec.{role}.volumeMounts[{i}].mountPath"),
                    message: format!(
                        "Ringmaster mounts its {} volume at {} in the {role}: mount yours elsewhere",
                        taken.name, mount.mount_path
                    ),
                });
            }
        }
    }
    errors
}

/// The defaults and derived values of an object that passed the schema.
fn with_defaults(job: &TrainingJob) -> Result<ValidatedTrainingJob, FieldErrors> {
    let spec = &job.spec;
    // The schema guarantees the ranges below, so the conversions cannot fail.
    let as_u32 = |v: i32| u32::try_from(v).unwrap_or(0);
    let gpus_per_worker = as_u32(spec.gpus_per_worker);
    let slots_per_worker = spec
        .slots_per_worker
        .map(as_u32)
        .unwrap_or(if gpus_per_worker > 0 {
            gpus_per_worker
        } else {
            1
        });

    let program = match &spec.command {
        Some(command) => Program::Command(command.clone()),
        None => {
            let t = spec.trainer.clone().unwrap_or_default();
            let batch_size = t
                .batch_size
                .map_or(contract::defaults::BATCH_SIZE, |b| as_u32(b) as usize);
            let global_batch = batch_size * (as_u32(spec.workers) * slots_per_worker) as usize;
            let data_dir = match (
                t.data.unwrap_or(DataSource::Synthetic),
                &spec.data_stage_ref,
            ) {
                (DataSource::ImageFolder, Some(data)) => Some(match t.data_path.as_deref() {
                    None | Some("") => data.mount_path.clone(),
                    Some(path) => format!("{}/{path}", data.mount_path.trim_end_matches('/')),
                }),
                _ => None,
            };
            let (steps, epochs) = match (t.steps, t.epochs) {
                (_, Some(epochs)) => (None, Some(as_u32(epochs) as usize)),
                (Some(steps), None) => (Some(usize::try_from(steps).unwrap_or(usize::MAX)), None),
                (None, None) => (Some(DEFAULT_STEPS as usize), None),
            };
            let args = TrainArgs {
                model: t.model.map_or(contract::defaults::MODEL, Into::into),
                device: if gpus_per_worker > 0 {
                    contract::Device::Cuda
                } else {
                    contract::Device::Cpu
                },
                precision: t
                    .precision
                    .unwrap_or(if gpus_per_worker > 0 {
                        Precision::Bf16
                    } else {
                        Precision::Fp32
                    })
                    .into(),
                batch_size,
                image_size: t
                    .image_size
                    .map_or(contract::defaults::IMAGE_SIZE, |s| as_u32(s) as usize),
                steps,
                epochs,
                learning_rate: Some(t.learning_rate.map_or_else(
                    || contract::scaled_learning_rate(global_batch),
                    |lr| lr as f32,
                )),
                // Its gradual warm-up is the trainer's default; a flag only when set, so a
                // trainer image older than the flag runs the same jobs as before.
                warmup_epochs: t.warmup_epochs.map(|epochs| epochs as f32),
                // A flag only when set, as for the warm-up.
                checkpoint_minutes: t
                    .checkpoint_minutes
                    .map_or(TrainArgs::default().checkpoint_minutes, |m| m as f32),
                // Synthetic images have no size of their own: an epoch of at least one
                // global batch, so a world past the trainer's default of 4,096 images still
                // has a step to take (a flag only then).
                dataset_size: if data_dir.is_none() {
                    global_batch.max(contract::defaults::DATASET_SIZE)
                } else {
                    contract::defaults::DATASET_SIZE
                },
                synthetic: data_dir.is_none(),
                data_dir: data_dir.map(Into::into),
                output_dir: spec.output.as_ref().map(|output| {
                    format!(
                        "{}/{}",
                        output.mount_path.trim_end_matches('/'),
                        job.name_any()
                    )
                    .into()
                }),
                ..TrainArgs::default()
            };
            Program::Trainer(Box::new(TrainerSettings {
                args,
                extra_args: t.extra_args,
            }))
        }
    };

    let infiniband =
        spec.infiniband
            .as_ref()
            .filter(|ib| ib.enabled)
            .map(|ib| InfinibandSettings {
                rdma_resource: ib.rdma_resource.clone(),
                rdma_resource_count: as_u32(ib.rdma_resource_count),
                shm_size: ib
                    .shm_size
                    .clone()
                    .unwrap_or_else(|| Quantity(DEFAULT_SHM_SIZE.into())),
                env: ib.env.clone(),
            });

    let uid = job.uid().unwrap_or_default();
    let node_pool = spec.node_pool.as_ref().map(|pool| NodePoolPlan {
        provisioner: pool.provisioner,
        vm_size: pool.vm_size.clone(),
        pool_name: match pool.provisioner {
            Provisioner::Aks => Some(
                pool.pool_name
                    .clone()
                    .unwrap_or_else(|| derive_pool_name(&job.name_any(), &uid)),
            ),
            Provisioner::Existing => None,
        },
        spot: pool.spot,
        delete_after_completion: pool.delete_after_completion,
        node_selector: pool.node_selector.clone().unwrap_or_default(),
        gpu_driver: pool.gpu_driver.unwrap_or(GpuDriver::Install),
    });

    Ok(ValidatedTrainingJob {
        name: job.name_any(),
        namespace: job.namespace().unwrap_or_default(),
        uid,
        workers: as_u32(spec.workers),
        gpus_per_worker,
        slots_per_worker,
        image: spec.image.clone(),
        program,
        data: spec.data_stage_ref.clone(),
        output: spec.output.clone(),
        infiniband,
        node_pool,
        mpi: spec.mpi.clone(),
        launcher: spec.launcher.clone().unwrap_or_default(),
        worker: spec.worker.clone().unwrap_or_default(),
        run_policy: spec.run_policy.clone(),
    })
}

/// An AKS agent pool name for a job: up to 8 letters and digits of its name, then 4 of its
/// UID, so two jobs of the same name get different pools and a restarted operator derives
/// the same name again. AKS allows `^[a-z][a-z0-9]{0,11}$`.
pub fn derive_pool_name(job_name: &str, uid: &str) -> String {
    let mut name: String = job_name
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .map(|c| c.to_ascii_lowercase())
        .skip_while(|c| c.is_ascii_digit())
        .take(8)
        .collect();
    if name.is_empty() {
        name.push_str("tj");
    }
    name.extend(
        uid.chars()
            .filter(char::is_ascii_hexdigit)
            .map(|c| c.to_ascii_lowercase())
            .take(4),
    );
    name
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_pool_names_are_valid_for_aks() {
        let valid = |s: &str| {
            s.len() <= 12
                && s.chars().next().is_some_and(|c| c.is_ascii_lowercase())
                && s.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        };
        for (name, uid) in [
            ("resnet50-ib", "3f2a9c4e-0000-4000-8000-000000000000"),
            ("123-numbers-first", "ABCDEF12-3456"),
            ("---", ""),
            ("a", "0"),
            ("a-very-long-training-job-name", "deadbeef"),
        ] {
            let pool = derive_pool_name(name, uid);
            assert!(valid(&pool), "{name} → {pool}");
        }
        assert_eq!(derive_pool_name("resnet50-ib", "3f2a9c4e"), "resnet503f2a");
        assert_ne!(
            derive_pool_name("job", "aaaa1111"),
            derive_pool_name("job", "bbbb1111")
        );
    }

    #[test]
    fn the_schema_rules_compile() {
        assert_eq!(
            crate::validation::checker::<TrainingJob>().compile_errors(),
            Vec::<String>::new()
        );
    }
}
