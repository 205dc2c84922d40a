//! Validate step of the TrainingJob controller: the raw object in, a [`ValidatedTrainingJob`]
//! out — schema and CEL rules checked, defaults merged, names derived. No client.

use k8s_openapi::api::core::v1::{ContainerPort, SecurityContext};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::ResourceExt;
use ringmaster_contract::trainer::{self as contract, Capabilities, TrainArgs};

use super::build::{self, PodRole};
use super::names::ChildNaming;
pub use super::spec::*;
use crate::api::{DataSource, GpuDriver, PodOverrides, Precision, Provisioner, TrainingJob};
use crate::validation::{self, FieldError, FieldErrors};

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
    let mut errors = overrides_that_clash(&job);
    errors.extend(security_that_cannot_run(&job));
    if !errors.is_empty() {
        return Err(FieldErrors(errors));
    }
    Ok(job)
}

/// Container security contexts the API server would refuse on the pod: the main container's
/// (`containerSecurityContext`) and those of the containers the user adds.
fn security_that_cannot_run(job: &ValidatedTrainingJob) -> Vec<FieldError> {
    let mut errors = Vec::new();
    for (role, overrides) in [
        (PodRole::Worker, &job.worker),
        (PodRole::Launcher, &job.launcher),
    ] {
        let role = role.name();
        let mut contexts = vec![(
            format!("spec.{role}.containerSecurityContext"),
            overrides.container_security_context.as_ref(),
        )];
        for (list, containers) in [
            ("initContainers", &overrides.init_containers),
            ("containers", &overrides.containers),
        ] {
            contexts.extend(containers.iter().enumerate().map(|(i, c)| {
                (
                    format!("spec.{role}.{list}[{i}].securityContext"),
                    c.security_context.as_ref(),
                )
            }));
        }
        for (field, context) in contexts {
            if let Some(context) = context {
                errors.extend(escalation_refused(&field, context));
            }
        }
    }
    errors
}

/// What the API server refuses with `allowPrivilegeEscalation: false` in the context at
/// `field`: `privileged: true` (a CEL rule on `containerSecurityContext`; the containers the
/// user adds have Kubernetes' schema, which carries none) and CAP_SYS_ADMIN added (a CEL
/// rule cannot read the unbounded list cheaply enough).
fn escalation_refused(field: &str, context: &SecurityContext) -> Vec<FieldError> {
    if context.allow_privilege_escalation != Some(false) {
        return Vec::new();
    }
    let mut errors = Vec::new();
    if context.privileged == Some(true) {
        errors.push(FieldError {
            field: format!("{field}.privileged"),
            message: "privileged: true cannot go with allowPrivilegeEscalation: false (a privileged container can always escalate; the API server refuses the pod): leave allowPrivilegeEscalation unset".into(),
        });
    }
    let added = context
        .capabilities
        .iter()
        .flat_map(|c| c.add.iter().flatten());
    for (i, capability) in added.enumerate() {
        if capability == "CAP_SYS_ADMIN" {
            errors.push(FieldError {
                field: format!("{field}.capabilities.add[{i}]"),
                message: "CAP_SYS_ADMIN cannot go with allowPrivilegeEscalation: false (the API server refuses the pod): leave allowPrivilegeEscalation unset".into(),
            });
        }
    }
    errors
}

/// What the user's overrides set that Ringmaster sets in the same pod, or that undoes what
/// it needs there: each refused here naming the spec's field, where the API server would
/// refuse the pod naming `spec.volumes[7]`, or the pod would start and fail.
fn overrides_that_clash(job: &ValidatedTrainingJob) -> Vec<FieldError> {
    let mut errors = Vec::new();
    for (role, overrides) in [
        (PodRole::Worker, &job.worker),
        (PodRole::Launcher, &job.launcher),
    ] {
        errors.extend(volumes_that_clash(job, role, overrides));
        errors.extend(ports_that_clash(job, role, overrides));
        errors.extend(capabilities_that_clash(job, role, overrides));
        errors.extend(container_names_repeated(role, overrides));
    }
    errors
}

/// The user's volumes and mounts that repeat a volume name or mount path Ringmaster gives the
/// same pod (which depends on the spec: `data` only with a DataStage, `dshm` only with
/// InfiniBand, ...: [`build::reserved_volumes`]).
fn volumes_that_clash(
    job: &ValidatedTrainingJob,
    role: PodRole,
    overrides: &PodOverrides,
) -> Vec<FieldError> {
    let mut errors = Vec::new();
    if overrides.volumes.is_empty() && overrides.volume_mounts.is_empty() {
        // Most jobs: nothing to check (every reconcile validates).
        return errors;
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
    errors
}

/// The user's `ports` that repeat the name, or the number and protocol, of a port Ringmaster
/// lists on the same container ([`build::reserved_ports`]: a worker's sshd and rendezvous).
fn ports_that_clash(
    job: &ValidatedTrainingJob,
    role: PodRole,
    overrides: &PodOverrides,
) -> Vec<FieldError> {
    let protocol = |p: &ContainerPort| p.protocol.clone().unwrap_or_else(|| "TCP".into());
    let ours = build::reserved_ports(job, role);
    let mut errors = Vec::new();
    for (i, port) in overrides.ports.iter().enumerate() {
        let Some(taken) = ours.iter().find(|o| {
            (port.name.is_some() && o.name == port.name)
                || (o.container_port == port.container_port && protocol(o) == protocol(port))
        }) else {
            continue;
        };
        let (field, what) = if port.name.is_some() && taken.name == port.name {
            (
                "name",
                format!("name {}", port.name.as_deref().unwrap_or_default()),
            )
        } else {
            ("containerPort", format!("port {}", port.container_port))
        };
        errors.push(FieldError {
            field: format!("spec.{}.ports[{i}].{field}", role.name()),
            message: format!(
                "{what} is Ringmaster's {} port ({}) on the {} container: pick another",
                taken.name.as_deref().unwrap_or_default(),
                taken.container_port,
                role.name()
            ),
        });
    }
    errors
}

/// A capability the user drops that Ringmaster adds to the same container: IPC_LOCK on an
/// InfiniBand worker, which RDMA needs to pin memory (the runtime drops after it adds, so the
/// worker would start and NCCL fail on its first InfiniBand transfer).
fn capabilities_that_clash(
    job: &ValidatedTrainingJob,
    role: PodRole,
    overrides: &PodOverrides,
) -> Vec<FieldError> {
    if role != PodRole::Worker || job.infiniband.is_none() {
        return Vec::new();
    }
    let dropped = overrides
        .container_security_context
        .iter()
        .flat_map(|c| c.capabilities.iter())
        .flat_map(|c| c.drop.iter().flatten());
    dropped
        .enumerate()
        .filter(|(_, c)| c.trim_start_matches("CAP_") == build::RDMA_CAPABILITY)
        .map(|(i, capability)| FieldError {
            field: format!("spec.worker.containerSecurityContext.capabilities.drop[{i}]"),
            message: format!(
                "{capability} is the capability Ringmaster adds to InfiniBand workers (RDMA pins memory with it; see infiniband.enabled): don't drop it, or set infiniband.enabled: false"
            ),
        })
        .collect()
}

/// A container name the user gives twice in one list of their containers (the schema makes
/// each list a map by name, which the API server checks and the operator's schema check
/// does not; a name in both lists is a CEL rule).
fn container_names_repeated(role: PodRole, overrides: &PodOverrides) -> Vec<FieldError> {
    let mut errors = Vec::new();
    for (list, containers) in [
        ("initContainers", &overrides.init_containers),
        ("containers", &overrides.containers),
    ] {
        for (i, container) in containers.iter().enumerate() {
            if containers[..i].iter().any(|c| c.name == container.name) {
                errors.push(FieldError {
                    field: format!("spec.{}.{list}[{i}]", role.name()),
                    message: format!(
                        "{} names another container of {list} too: the containers of a pod need names of their own",
                        container.name
                    ),
                });
            }
        }
    }
    errors
}

/// A count the schema keeps in range (so the conversion cannot fail).
fn as_u32(v: i32) -> u32 {
    u32::try_from(v).unwrap_or(0)
}

/// The defaults and derived values of an object that passed the schema.
fn with_defaults(job: &TrainingJob) -> Result<ValidatedTrainingJob, FieldErrors> {
    let spec = &job.spec;
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
        None => Program::Trainer(Box::new(trainer_settings(
            job,
            gpus_per_worker,
            as_u32(spec.workers) * slots_per_worker,
        ))),
    };
    let uid = job.uid().unwrap_or_default();
    Ok(ValidatedTrainingJob {
        name: job.name_any(),
        namespace: job.namespace().unwrap_or_default(),
        workers: as_u32(spec.workers),
        gpus_per_worker,
        slots_per_worker,
        image: spec.image.clone(),
        program,
        data: spec.data_stage_ref.clone(),
        output: spec.output.clone(),
        infiniband: infiniband(job),
        node_pool: node_pool(job),
        uid,
        mpi: spec.mpi.clone(),
        launcher: spec.launcher.clone().unwrap_or_default(),
        worker: spec.worker.clone().unwrap_or_default(),
        run_policy: spec.run_policy.clone(),
    })
}

/// The trainer's command line for `ranks` ranks: the spec's `trainer` section with the
/// contract's defaults, the device and precision from the GPUs, the learning rate scaled to
/// the global batch, and the data and output folders where the pods mount them.
fn trainer_settings(job: &TrainingJob, gpus_per_worker: u32, ranks: u32) -> TrainerSettings {
    let spec = &job.spec;
    let t = spec.trainer.clone().unwrap_or_default();
    let gpu = gpus_per_worker > 0;
    let batch_size = t
        .batch_size
        .map_or(contract::defaults::BATCH_SIZE, |b| as_u32(b) as usize);
    let global_batch = batch_size * ranks as usize;
    let data_dir = data_dir(job, &t);
    let (steps, epochs) = match (t.steps, t.epochs) {
        (_, Some(epochs)) => (None, Some(as_u32(epochs) as usize)),
        (Some(steps), None) => (Some(usize::try_from(steps).unwrap_or(usize::MAX)), None),
        (None, None) => (Some(DEFAULT_STEPS as usize), None),
    };
    let args = TrainArgs {
        model: t.model.map_or(contract::defaults::MODEL, Into::into),
        device: if gpu {
            contract::Device::Cuda
        } else {
            contract::Device::Cpu
        },
        precision: t
            .precision
            .unwrap_or(if gpu {
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
        // Its gradual warm-up is the trainer's default; a flag only when set, so a trainer
        // image older than the flag runs the same jobs as before.
        warmup_epochs: t.warmup_epochs.map(|epochs| epochs as f32),
        // A flag only when set, as for the warm-up.
        checkpoint_minutes: t
            .checkpoint_minutes
            .map_or(TrainArgs::default().checkpoint_minutes, |m| m as f32),
        // Flags only when set, as for the warm-up.
        keep_checkpoints: t
            .keep_checkpoints
            .map_or(contract::defaults::KEEP_CHECKPOINTS, |k| as_u32(k) as usize),
        resume_from: t.resume_from.clone(),
        // `infiniband.preflight` checks whatever fabric the collective uses, so it is taken
        // with `infiniband.enabled: false` too (a CPU job's TCP ring).
        preflight_min_bus_gbps: preflight(job).map(|p| p.min_bus_bandwidth_gbps),
        preflight_bytes: preflight(job)
            .and_then(|p| p.message_bytes)
            .map_or(contract::defaults::PREFLIGHT_BYTES, |b| {
                u64::try_from(b).unwrap_or(0)
            }),
        // Synthetic images have no size of their own: an epoch of at least one global batch,
        // so a world past the trainer's default of 4,096 images still has a step to take (a
        // flag only then).
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
    TrainerSettings {
        args,
        extra_args: t.extra_args,
    }
}

/// `spec.infiniband.preflight`, whether or not InfiniBand is enabled.
fn preflight(job: &TrainingJob) -> Option<&crate::api::PreflightSpec> {
    job.spec.infiniband.as_ref()?.preflight.as_ref()
}

/// Where the images are in the pods: the DataStage's mount (and `dataPath` under it) for an
/// image folder; none for synthetic data.
fn data_dir(job: &TrainingJob, trainer: &crate::api::TrainerSpec) -> Option<String> {
    match (
        trainer.data.unwrap_or(DataSource::Synthetic),
        &job.spec.data_stage_ref,
    ) {
        (DataSource::ImageFolder, Some(data)) => Some(match trainer.data_path.as_deref() {
            None | Some("") => data.mount_path.clone(),
            Some(path) => format!("{}/{path}", data.mount_path.trim_end_matches('/')),
        }),
        _ => None,
    }
}

/// InfiniBand's settings, when enabled, with the default /dev/shm size.
fn infiniband(job: &TrainingJob) -> Option<InfinibandSettings> {
    job.spec
        .infiniband
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
        })
}

/// The nodes to run on, with the AKS pool's name ([`aks_pool_name`]).
fn node_pool(job: &TrainingJob) -> Option<NodePoolPlan> {
    job.spec.node_pool.as_ref().map(|pool| NodePoolPlan {
        provisioner: pool.provisioner,
        vm_size: pool.vm_size.clone(),
        pool_name: aks_pool_name(job),
        spot: pool.spot,
        delete_after_completion: pool.delete_after_completion,
        node_selector: pool.node_selector.clone().unwrap_or_default(),
        gpu_driver: pool.gpu_driver.unwrap_or(GpuDriver::Install),
    })
}

/// The name of a job's AKS agent pool (`None` without `provisioner: aks`): the spec's
/// `poolName`; else the name its status records (`status.nodePool.name`), so a job whose pool
/// an earlier operator named by another rule keeps that pool (and gives it back) across an
/// upgrade; else one derived from its name and UID ([`super::names::derive_pool_name`]).
/// A recorded name is only taken when it is a valid pool name. Which pool a name leads to
/// is still checked by its tags: a job only uses and deletes a pool tagged with its UID.
pub fn aks_pool_name(job: &TrainingJob) -> Option<String> {
    let pool = job.spec.node_pool.as_ref()?;
    if pool.provisioner != Provisioner::Aks {
        return None;
    }
    let recorded = job
        .status
        .as_ref()
        .and_then(|s| s.node_pool.as_ref())
        .map(|p| p.name.as_str())
        .filter(|name| super::names::is_valid_pool_name(name));
    Some(
        pool.pool_name
            .clone()
            .or_else(|| recorded.map(str::to_string))
            .unwrap_or_else(|| {
                super::names::derive_pool_name(&job.name_any(), &job.uid().unwrap_or_default())
            }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schema_rules_compile() {
        assert_eq!(
            crate::validation::checker::<TrainingJob>().compile_errors(),
            Vec::<String>::new()
        );
    }
}
