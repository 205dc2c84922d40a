//! The volumes Ringmaster gives a job's pods, and where it mounts them: one list, which the
//! pods are built from and the user's volumes are checked against.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    CSIVolumeSource, DownwardAPIVolumeFile, DownwardAPIVolumeSource, EmptyDirVolumeSource,
    ObjectFieldSelector, PersistentVolumeClaimVolumeSource, SecretVolumeSource, Volume,
    VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::{HOSTFILE, SSH_PROGRAM};
use crate::api::OutputSpec;
use crate::controller::training_job::names::{
    self, ChildNaming, LAUNCHER_ROLE, SSH_MOUNT, SSH_SECRET_MOUNT, WORKER_ROLE,
};
use crate::controller::training_job::spec::{InfinibandSettings, ValidatedTrainingJob};

/// A pod of a job: what it is given depends on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodRole {
    /// A worker: sshd, the ranks.
    Worker,
    /// The launcher: the MPI launcher over the workers.
    Launcher,
}

impl PodRole {
    /// Its [`names::ROLE_LABEL`] value, and the spec field of its overrides.
    pub fn name(self) -> &'static str {
        match self {
            Self::Worker => WORKER_ROLE,
            Self::Launcher => LAUNCHER_ROLE,
        }
    }
}

/// The volumes Ringmaster gives a `role` pod of `job`, each with its mount in the pod's
/// container, in the pod's order; the user's come after them and may repeat neither a volume
/// name nor a mount path (validate refuses those). Every pod: the SSH Secret and the memory
/// folder its keys are copied into; the launcher: its files (hostfile, ssh program); a
/// worker: an in-memory /dev/shm with InfiniBand, the DataStage's claim (`data_claim`, once
/// the DataStage is ready); both: the output.
pub fn reserved_volumes(
    job: &ValidatedTrainingJob,
    role: PodRole,
    naming: ChildNaming,
    data_claim: Option<&str>,
) -> Vec<(Volume, VolumeMount)> {
    let mut volumes = ssh_volumes(job, naming).to_vec();
    match role {
        PodRole::Launcher => volumes.push(launcher_files()),
        PodRole::Worker => {
            volumes.extend(job.infiniband.as_ref().map(shared_memory));
            volumes.extend(data_volume(job, data_claim));
        }
    }
    volumes.extend(job.output.as_ref().map(output_volume));
    volumes
}

/// A volume named `name` and its mount at `path`.
fn named(name: &str, path: &str, read_only: bool, volume: Volume) -> (Volume, VolumeMount) {
    (
        Volume {
            name: name.into(),
            ..volume
        },
        VolumeMount {
            name: name.into(),
            mount_path: path.into(),
            read_only: read_only.then_some(true),
            ..VolumeMount::default()
        },
    )
}

/// An in-memory emptyDir of at most `size`.
fn memory(size: Quantity) -> Volume {
    Volume {
        empty_dir: Some(EmptyDirVolumeSource {
            medium: Some("Memory".into()),
            size_limit: Some(size),
        }),
        ..Volume::default()
    }
}

/// The SSH Secret (read only) and the memory folder the container's user copies it into.
fn ssh_volumes(job: &ValidatedTrainingJob, naming: ChildNaming) -> [(Volume, VolumeMount); 2] {
    let secret = Volume {
        secret: Some(SecretVolumeSource {
            secret_name: Some(names::ssh_secret(job, naming)),
            default_mode: Some(0o600),
            ..SecretVolumeSource::default()
        }),
        ..Volume::default()
    };
    [
        named("ssh-secret", SSH_SECRET_MOUNT, true, secret),
        named("ssh", SSH_MOUNT, false, memory(Quantity("1Mi".into()))),
    ]
}

/// The launcher's files under [`names::HOSTFILE_MOUNT`] (the hostfile, and the ssh program
/// Hydra runs): annotations of the launcher pod, projected into files by a downward-API
/// volume. They depend on the spec alone, so they travel with the pod the launcher runs in:
/// no ConfigMap to write and keep per job.
fn launcher_files() -> (Volume, VolumeMount) {
    let items = [
        (HOSTFILE, names::HOSTFILE_ANNOTATION),
        (SSH_PROGRAM, names::SSH_PROGRAM_ANNOTATION),
    ]
    .map(|(path, annotation)| DownwardAPIVolumeFile {
        path: path.into(),
        field_ref: Some(ObjectFieldSelector {
            api_version: None,
            field_path: format!("metadata.annotations['{annotation}']"),
        }),
        ..DownwardAPIVolumeFile::default()
    });
    let files = Volume {
        downward_api: Some(DownwardAPIVolumeSource {
            default_mode: Some(0o755),
            items: Some(items.to_vec()),
        }),
        ..Volume::default()
    };
    named("hostfile", names::HOSTFILE_MOUNT, true, files)
}

/// A worker's /dev/shm with InfiniBand: in memory, of the spec's size.
fn shared_memory(ib: &InfinibandSettings) -> (Volume, VolumeMount) {
    named("dshm", "/dev/shm", false, memory(ib.shm_size.clone()))
}

/// The DataStage's claim, read only, where the spec says.
fn data_volume(job: &ValidatedTrainingJob, claim: Option<&str>) -> Option<(Volume, VolumeMount)> {
    let data = job.data.as_ref()?;
    let volume = Volume {
        persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
            claim_name: claim?.into(),
            read_only: Some(true),
        }),
        ..Volume::default()
    };
    Some(named("data", &data.mount_path, true, volume))
}

/// The output: the user's claim or Azure Files share.
fn output_volume(output: &OutputSpec) -> (Volume, VolumeMount) {
    let volume = match (&output.persistent_volume_claim, &output.azure_file) {
        (Some(claim), _) => Volume {
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: claim.claim_name.clone(),
                read_only: None,
            }),
            ..Volume::default()
        },
        (None, Some(files)) => Volume {
            csi: Some(CSIVolumeSource {
                driver: "file.csi.azure.com".into(),
                volume_attributes: Some(BTreeMap::from([
                    ("shareName".into(), files.share_name.clone()),
                    ("secretName".into(), files.secret_name.clone()),
                ])),
                ..CSIVolumeSource::default()
            }),
            ..Volume::default()
        },
        // The schema requires exactly one; an empty dir keeps the pod valid if it ever isn't.
        (None, None) => Volume {
            empty_dir: Some(EmptyDirVolumeSource::default()),
            ..Volume::default()
        },
    };
    named("output", &output.mount_path, false, volume)
}
