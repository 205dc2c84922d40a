//! `TrainingJob`: train a model on N GPU machines with MPI.

// The repeated `printcolumn(...)` arguments of the kube derive look like duplicated attributes to clippy.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, Container, ContainerPort, EnvVar, LocalObjectReference, PodSecurityContext,
    ResourceRequirements, SecurityContext, Toleration, TopologySpreadConstraint, Volume,
    VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::core::Rule;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::Conditions;
use super::kubernetes_rules;
use super::vm_sizes;

/// A CEL rule over the spec that refuses any change of one field after creation.
/// Written with `has()` on both sides so adding or removing an optional field counts too.
fn immutable(field: &str) -> Rule {
    Rule::new(format!(
        "has(self.{field}) == has(oldSelf.{field}) && (!has(self.{field}) || self.{field} == oldSelf.{field})"
    ))
    .message(kube::core::cel::Message::Message(format!(
        "spec.{field} is immutable: delete and re-create the TrainingJob to change it"
    )))
    .field_path(format!(".{field}"))
}

/// Runs a distributed data-parallel training job: MPI worker pods on GPU nodes (optionally a
/// node pool created for the job), a launcher pod running `mpirun`, and the Ringmaster trainer
/// (or your own command) in them. Status follows the pods.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "ringmaster.dev",
    version = "v1alpha1",
    kind = "TrainingJob",
    namespaced,
    cel,
    shortname = "tj",
    category = "ringmaster",
    status = "TrainingJobStatus",
    doc = "A distributed data-parallel training job: MPI workers on GPU nodes, a launcher running mpirun, and the trainer in them.",
    printcolumn(
        name = "Phase",
        type_ = "string",
        json_path = ".status.phase",
        description = "Where the job is in its life"
    ),
    printcolumn(
        name = "Workers",
        type_ = "integer",
        json_path = ".spec.workers",
        description = "Worker pods asked for"
    ),
    printcolumn(
        name = "Ready",
        type_ = "integer",
        json_path = ".status.workers.ready",
        description = "Worker pods ready (reachable over ssh)"
    ),
    printcolumn(
        name = "GPUs",
        type_ = "integer",
        json_path = ".spec.gpusPerWorker",
        description = "GPUs per worker",
        priority = 1
    ),
    printcolumn(
        name = "Restarts",
        type_ = "integer",
        json_path = ".status.restarts",
        description = "Times the worker gang was restarted"
    ),
    printcolumn(
        name = "Progress",
        type_ = "string",
        json_path = ".status.progress.percentDone",
        description = "Share of the training steps done, as the trainer reports it"
    ),
    printcolumn(
        name = "ETA",
        type_ = "string",
        json_path = ".status.progress.timeRemaining",
        description = "Time left to the last step at the recent rate"
    ),
    printcolumn(
        name = "Images/s",
        type_ = "integer",
        json_path = ".status.progress.imagesPerSecond",
        description = "Images per second over all ranks (the recent rate while training, the whole run's after)",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    validation = Rule::new("self.metadata.name.size() <= 48 && self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')")
        .message("metadata.name must be a DNS label of at most 48 characters starting with a letter: the workers' host names (<name>-worker-<i>) are built from it")
)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new(vm_sizes::gpus_fit_vm_size_rule())
        // A static message: the API server refuses a messageExpression over the size table
        // as too costly.
        .message("gpusPerWorker is more than the GPUs one VM of nodePool.vmSize has (8 on the ND96 sizes such as Standard_ND96asr_v4): ask for at most that many, or pick a larger size")
        .field_path(".gpusPerWorker"),
    validation = Rule::new(vm_sizes::infiniband_fits_vm_size_rule())
        .message("infiniband is enabled but nodePool.vmSize has no InfiniBand NIC (use an ND or NC*r size, or set infiniband.enabled: false)")
        .field_path(".infiniband.enabled"),
    validation = Rule::new("self.gpusPerWorker == 0 || !has(self.slotsPerWorker) || self.slotsPerWorker <= self.gpusPerWorker")
        .message("slotsPerWorker must not exceed gpusPerWorker: each rank drives one GPU")
        .field_path(".slotsPerWorker"),
    validation = Rule::new("!(has(self.command) && has(self.trainer))")
        .message("set either command (your own program) or trainer (the Ringmaster trainer's settings), not both")
        .field_path(".command"),
    validation = Rule::new("!has(self.trainer) || !has(self.trainer.data) || self.trainer.data != 'imageFolder' || has(self.dataStageRef)")
        .message("trainer.data imageFolder reads the dataset of a DataStage: set dataStageRef")
        .field_path(".trainer.data"),
    validation = Rule::new("!has(self.trainer) || !has(self.trainer.checkpointMinutes) || has(self.output)")
        .message("trainer.checkpointMinutes needs output: the checkpoints are written there")
        .field_path(".trainer.checkpointMinutes"),
    validation = Rule::new("!has(self.trainer) || !has(self.trainer.keepCheckpoints) || has(self.output)")
        .message("trainer.keepCheckpoints needs output: the checkpoints are kept there")
        .field_path(".trainer.keepCheckpoints"),
    validation = Rule::new("!has(self.trainer) || !has(self.trainer.resumeFrom) || has(self.output)")
        .message("trainer.resumeFrom needs output: the earlier run's checkpoints are read from there")
        .field_path(".trainer.resumeFrom"),
    validation = Rule::new("!has(self.trainer) || !has(self.trainer.precision) || self.trainer.precision != 'bf16' || self.gpusPerWorker > 0")
        .message("trainer.precision bf16 computes on GPUs only (the trainer's CUDA engine): set gpusPerWorker, or precision: fp32")
        .field_path(".trainer.precision"),
    validation = Rule::new("!has(self.infiniband) || !self.infiniband.enabled || self.gpusPerWorker > 0")
        .message("infiniband needs GPUs (NCCL over RDMA): set gpusPerWorker, or infiniband.enabled: false")
        .field_path(".infiniband.enabled"),
    validation = Rule::new("!has(self.infiniband) || !has(self.infiniband.preflight) || !has(self.command)")
        .message("infiniband.preflight runs in the Ringmaster trainer, and command replaces it with your own program: unset command (and use trainer), or check the fabric in your program")
        .field_path(".infiniband.preflight"),
    validation = Rule::new("!has(self.launcher) || !has(self.launcher.hostIPC) || !self.launcher.hostIPC")
        .message("hostIPC is for the ranks, which run on the workers: set worker.hostIPC (the launcher runs only mpirun)")
        .field_path(".launcher.hostIPC"),
    validation = immutable("workers"),
    validation = immutable("gpusPerWorker"),
    validation = immutable("slotsPerWorker"),
    validation = immutable("image"),
    validation = immutable("command"),
    validation = immutable("trainer"),
    validation = immutable("dataStageRef"),
    validation = immutable("nodePool"),
    validation = immutable("mpi"),
    validation = immutable("infiniband"),
)]
pub struct TrainingJobSpec {
    /// Number of worker pods. Each runs on a node of its own and hosts `slotsPerWorker` MPI
    /// ranks. With `nodePool.provisioner: aks` it is also the node count of the pool.
    #[schemars(range(min = 1, max = 1024))]
    pub workers: i32,

    /// NVIDIA GPUs per worker (the pods' `nvidia.com/gpu` limit). 0 runs a CPU job, whose
    /// ranks all-reduce over a TCP ring instead of NCCL.
    #[serde(default)]
    #[schemars(range(min = 0, max = 16))]
    pub gpus_per_worker: i32,

    /// MPI ranks per worker. Defaults to `gpusPerWorker` (one rank per GPU), or 1 for a CPU job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 256))]
    pub slots_per_worker: Option<i32>,

    /// Container image of the launcher and the workers. It needs sshd, the MPI named in `mpi`,
    /// and the trainer (or your command). The `trainer` target of Ringmaster's Dockerfile
    /// builds one.
    #[schemars(length(min = 1, max = 512), regex(pattern = r"^\S+$"))]
    pub image: String,

    /// Your own program, run by `mpirun` on every rank instead of the Ringmaster trainer.
    /// Leave unset to run `ringmaster-trainer train` with the `trainer` settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 256))]
    pub command: Option<Vec<String>>,

    /// Settings of the Ringmaster trainer, used when `command` is unset. Defaults train
    /// ResNet-50 on synthetic data, the benchmark mode of Azure's reference architecture.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trainer: Option<TrainerSpec>,

    /// A DataStage in this namespace whose dataset the job reads. The job waits until it is
    /// Ready, then mounts its claim read-only in every worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_stage_ref: Option<DataStageRef>,

    /// Where logs, checkpoints and the final model are written: a PersistentVolumeClaim or an
    /// Azure Files share, mounted read-write in the launcher and the workers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<OutputSpec>,

    /// InfiniBand (RDMA) for NCCL between nodes. Needs a VM size with an InfiniBand NIC and
    /// the RDMA device plugin on the nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub infiniband: Option<InfinibandSpec>,

    /// The nodes the workers run on: an AKS agent pool created for this job, or existing
    /// nodes picked by labels. Unset: any node the scheduler finds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_pool: Option<NodePoolSpec>,

    /// The MPI implementation in the image and how the launcher reaches the workers.
    #[serde(default)]
    pub mpi: MpiSpec,

    /// Additions to the launcher pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launcher: Option<PodOverrides>,

    /// Additions to every worker pod. Its `env` reaches every rank too: plain values and
    /// Secret or ConfigMap keys through the launcher (mpirun forwards them); `fieldRef`,
    /// `resourceFieldRef` and `fileKeyRef` entries, and values naming `$(VAR)`, with each
    /// worker's own values (its sshd sets them for the ranks it starts; line breaks are
    /// dropped, a value ending in a backslash stops the worker, and a name that is not a shell
    /// identifier keeps the launcher's value).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<PodOverrides>,

    /// Restarts, deadlines, clean-up and suspension.
    #[serde(default)]
    pub run_policy: RunPolicy,
}

/// Settings of `ringmaster-trainer train`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!(has(self.steps) && has(self.epochs))")
    .message("set either trainer.steps or trainer.epochs, not both")
    .field_path(".steps"))]
pub struct TrainerSpec {
    /// The network to train. Default: resnet50.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<Model>,
    /// Where images come from. Default: synthetic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<DataSource>,
    /// Folder inside the DataStage's mount that holds the ImageNet-style `train/` tree.
    /// Default: the mount's root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024), regex(pattern = r"^[^/].*$"))]
    pub data_path: Option<String>,
    /// Images per rank per step. Default: 64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 4096))]
    pub batch_size: Option<i32>,
    /// Side of the square input images in pixels. Default: 224.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 32, max = 1024))]
    pub image_size: Option<i32>,
    /// Steps to train. Exclusive with `epochs`; default 1000 steps when neither is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub steps: Option<i64>,
    /// Passes over the dataset. Exclusive with `steps`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100000))]
    pub epochs: Option<i32>,
    /// Peak learning rate of SGD with momentum, for the global batch. Default: 0.1 × global batch / 256.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 100.0))]
    pub learning_rate: Option<f64>,
    /// Passes over the dataset during which the learning rate rises linearly to its peak
    /// (Goyal et al.'s gradual warm-up, which goes with the linear scaling rule). Default:
    /// the trainer's, 5 epochs (at most a fifth of the run) when the global batch is larger
    /// than 256, else none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1000.0))]
    pub warmup_epochs: Option<f64>,
    /// Arithmetic: bf16 (mixed precision: bf16 activations, fp32 master weights and sums;
    /// GPUs only) or fp32. Default: bf16 on GPUs, fp32 on CPUs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<Precision>,
    /// Minutes of training between the checkpoints the trainer writes into `output`, which a
    /// restarted gang goes on from: at most this much training is done twice after a failure.
    /// Needs `output`. Default: the trainer's, 10; 0 writes none by the clock
    /// (`extraArgs: ["--checkpoint-every=N"]` writes one every N steps).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 10080.0))]
    pub checkpoint_minutes: Option<f64>,
    /// Checkpoints the trainer keeps of this job's run, in `<output>/<job name>/runs/<job
    /// UID>/checkpoint-<step>.safetensors`: an older one is deleted only once a newer one is
    /// wholly written, and a job made again under the same name (another UID) never writes
    /// over or deletes this one's. Needs `output`. Default: the trainer's, 3.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000))]
    pub keep_checkpoints: Option<i32>,
    /// The UID of an earlier TrainingJob of the same name (`kubectl get trainingjob NAME -o
    /// jsonpath='{.metadata.uid}'` before deleting it) whose newest checkpoint this job starts
    /// from: the way to go on after deleting and making a job again to change what cannot be
    /// changed. Read from `<output>/<job name>/runs/<UID>/`, or from the
    /// `checkpoint.safetensors` an older release left in `<output>/<job name>/` when it is
    /// that UID's. Taken only when this job has no checkpoint of its own: a restart of this
    /// job goes on from its own. The model, image size, global batch (batchSize × ranks),
    /// learning rate, momentum, weight decay and seed must be the earlier job's; `steps` or
    /// `epochs` may differ (to train on for longer), and so may the schedule. A checkpoint
    /// that is missing or does not fit fails the job, naming what differs. Needs `output`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(max = 36),
        regex(pattern = r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
    )]
    pub resume_from: Option<String>,
    /// Further flags passed to `ringmaster-trainer train` as they are, after the ones
    /// Ringmaster sets (model, device, precision, batch and image size, steps or epochs,
    /// learning rate and its warm-up, data and output folders), which they cannot repeat. Checked with the
    /// trainer's own parser and settings check when the job is validated.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub extra_args: Vec<String>,
}

/// A model the trainer knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Model {
    /// ResNet-18, 11.7 M parameters.
    Resnet18,
    /// ResNet-34, 21.8 M parameters.
    Resnet34,
    /// ResNet-50, 25.6 M parameters.
    Resnet50,
    /// ResNet-101, 44.5 M parameters.
    Resnet101,
    /// ResNet-152, 60.2 M parameters.
    Resnet152,
}

impl From<Model> for ringmaster_contract::trainer::Model {
    fn from(model: Model) -> Self {
        use ringmaster_contract::trainer::Model as Trainer;
        match model {
            Model::Resnet18 => Trainer::Resnet18,
            Model::Resnet34 => Trainer::Resnet34,
            Model::Resnet50 => Trainer::Resnet50,
            Model::Resnet101 => Trainer::Resnet101,
            Model::Resnet152 => Trainer::Resnet152,
        }
    }
}

/// Where the trainer's images come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum DataSource {
    /// Random images generated on the GPU: measures compute and all-reduce, not I/O.
    Synthetic,
    /// An ImageNet-style tree of JPEG folders, one folder a class, from `dataStageRef`.
    ImageFolder,
}

/// Arithmetic precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// 32-bit floats throughout.
    Fp32,
    /// bfloat16 activations and weights with fp32 accumulation and master weights.
    Bf16,
}

impl From<Precision> for ringmaster_contract::trainer::Precision {
    fn from(precision: Precision) -> Self {
        use ringmaster_contract::trainer::Precision as Trainer;
        match precision {
            Precision::Fp32 => Trainer::Fp32,
            Precision::Bf16 => Trainer::Bf16,
        }
    }
}

/// A DataStage to read the dataset from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DataStageRef {
    /// Name of a DataStage in the job's namespace.
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = kubernetes_rules::DNS_SUBDOMAIN_PATTERN)
    )]
    pub name: String,
    /// Where the dataset is mounted (read-only) in the workers. Default: /data.
    #[serde(default = "default_data_mount")]
    #[schemars(length(max = 1024), regex(pattern = r"^/.*$"))]
    pub mount_path: String,
}

fn default_data_mount() -> String {
    "/data".into()
}

/// Where results go: exactly one of `persistentVolumeClaim` and `azureFile`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.persistentVolumeClaim) != has(self.azureFile)")
    .message("output needs exactly one of persistentVolumeClaim and azureFile"))]
pub struct OutputSpec {
    /// An existing claim in the job's namespace (ReadWriteMany when workers write to it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_volume_claim: Option<ClaimRef>,
    /// An Azure Files share, mounted through the `file.csi.azure.com` driver.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub azure_file: Option<AzureFileOutput>,
    /// Where the output is mounted in the launcher and the workers. Default: /output.
    #[serde(default = "default_output_mount")]
    #[schemars(length(max = 1024), regex(pattern = r"^/.*$"))]
    pub mount_path: String,
}

fn default_output_mount() -> String {
    "/output".into()
}

/// A PersistentVolumeClaim by name.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClaimRef {
    /// Name of the claim, in the same namespace.
    #[schemars(length(min = 1, max = 253), regex(pattern = kubernetes_rules::DNS_SUBDOMAIN_PATTERN))]
    pub claim_name: String,
}

/// An Azure Files (SMB) share for logs, checkpoints and models.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AzureFileOutput {
    /// Name of the file share.
    #[schemars(length(min = 3, max = 63), regex(pattern = r"^[a-z0-9](-?[a-z0-9])*$"))]
    pub share_name: String,
    /// Secret with `azurestorageaccountname` and `azurestorageaccountkey`, as the Azure Files
    /// CSI driver expects.
    #[schemars(length(min = 1, max = 253), regex(pattern = kubernetes_rules::DNS_SUBDOMAIN_PATTERN))]
    pub secret_name: String,
}

/// InfiniBand settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct InfinibandSpec {
    /// Use InfiniBand: request the RDMA resource, add IPC_LOCK, mount /dev/shm in memory and
    /// point NCCL at the IB devices. Default: true. Adding IPC_LOCK is beyond the Pod Security
    /// levels `restricted` and `baseline`: the job's namespace must allow `privileged` (or
    /// exempt it), or its workers are refused.
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// The extended resource the RDMA device plugin advertises. Default: rdma/shared_ib (the
    /// RDMA shared device plugin AKS documents).
    #[serde(default = "default_rdma_resource")]
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[a-z0-9.-]+/[A-Za-z0-9_.-]+$")
    )]
    pub rdma_resource: String,
    /// How many of the RDMA resource each worker asks for. Default: 1.
    #[serde(default = "default_one")]
    #[schemars(range(min = 1, max = 64))]
    pub rdma_resource_count: i32,
    /// Size of the in-memory /dev/shm of each worker (NCCL's shared-memory transport and the
    /// data loader use it). Default: 64Gi.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shm_size: Option<Quantity>,
    /// Extra environment for NCCL and UCX (names starting with `NCCL_` or `UCX_`); they
    /// override Ringmaster's defaults.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(length(max = 64))]
    #[x_kube(validation = Rule::new("self.all(k, k.startsWith('NCCL_') || k.startsWith('UCX_'))")
        .message("infiniband.env takes only NCCL_* and UCX_* variables; put others in worker.env"))]
    pub env: BTreeMap<String, String>,
    /// Check the fabric before training instead of assuming it: the ranks time an
    /// all-reduce and each link of their ring, and the job fails at once (reason
    /// `PreflightFailed`), naming the slowest pair of ranks, when the bus bandwidth is
    /// below the minimum. It measures whatever fabric the job's collective uses (NCCL over
    /// InfiniBand, NCCL over sockets, or the TCP ring of a CPU job), so it also works with
    /// `enabled: false`. Needs the Ringmaster trainer (not `command`). Unset: no check.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preflight: Option<PreflightSpec>,
}

/// The fabric check before training (`ringmaster-trainer train --preflight-min-bus-gbps`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PreflightSpec {
    /// The least all-reduce bus bandwidth, in GB/s (10⁹ bytes per second), the job accepts:
    /// nccl-tests' busbw, algbw × 2(n−1)/n, comparable with a link's speed whatever the
    /// number of ranks. For scale: a 200 Gb/s (HDR) InfiniBand link carries at most 25 GB/s,
    /// a 10 Gb/s Ethernet link 1.25.
    #[schemars(range(min = 0.0, max = 100000.0), extend("exclusiveMinimum" = true))]
    pub min_bus_bandwidth_gbps: f64,
    /// Bytes per rank of the timed all-reduce and link transfers: a multiple of 4 from 1 MiB
    /// to 1 GiB. Default: 64 MiB (67108864), large enough that bandwidth, not latency,
    /// decides the time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1048576, max = 1073741824), extend("multipleOf" = 4))]
    pub message_bytes: Option<i64>,
}

fn default_true() -> bool {
    true
}

fn default_one() -> i32 {
    1
}

/// The extended resource of NVIDIA's device plugin: a worker's GPUs.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";

/// The extended resource AKS's RDMA shared device plugin advertises on InfiniBand nodes.
pub const DEFAULT_RDMA_RESOURCE: &str = "rdma/shared_ib";

fn default_rdma_resource() -> String {
    DEFAULT_RDMA_RESOURCE.into()
}

/// The nodes that run the workers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("self.provisioner != 'aks' || has(self.vmSize)")
        .message("nodePool.vmSize is required with provisioner aks")
        .field_path(".vmSize"),
    validation = Rule::new("self.provisioner != 'existing' || (has(self.nodeSelector) && size(self.nodeSelector) > 0)")
        .message("nodePool.nodeSelector is required with provisioner existing: it picks the nodes")
        .field_path(".nodeSelector"),
    validation = Rule::new("self.provisioner == 'aks' || !has(self.poolName)")
        .message("nodePool.poolName is only used with provisioner aks")
        .field_path(".poolName"),
)]
pub struct NodePoolSpec {
    /// `aks`: create an AKS agent pool for this job and delete it afterwards. `existing`: use
    /// nodes that are there, picked by `nodeSelector`.
    pub provisioner: Provisioner,
    /// Azure VM size of the pool's nodes, e.g. Standard_ND96asr_v4 (8 × A100, InfiniBand) or
    /// Standard_ND96isr_H100_v5 (8 × H100, InfiniBand).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64), regex(pattern = r"^Standard_[A-Za-z0-9_]+$"))]
    pub vm_size: Option<String>,
    /// Name of the AKS agent pool (lowercase letters and digits, starting with a letter, at
    /// most 12). Default: derived from the job's name and UID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[a-z][a-z0-9]{0,11}$"))]
    pub pool_name: Option<String>,
    /// Use Spot VMs (cheaper, can be evicted; the job restarts its workers when they are).
    #[serde(default)]
    pub spot: bool,
    /// Delete the agent pool when the job has finished or is deleted. Default: true.
    #[serde(default = "default_true")]
    pub delete_after_completion: bool,
    /// Node labels that pick the nodes with provisioner `existing`; added to the workers'
    /// node selector.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("maxProperties" = 32, "additionalProperties" = {"type": "string", "maxLength": 63, "pattern": kubernetes_rules::LABEL_VALUE_PATTERN}))]
    #[x_kube(validation = kubernetes_rules::label_keys("nodePool.nodeSelector"))]
    pub node_selector: Option<BTreeMap<String, String>>,
    /// Whether AKS installs the NVIDIA driver on the pool's nodes (`Install`), or the GPU
    /// Operator does (`None`). Default: Install.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_driver: Option<GpuDriver>,
}

/// How the job's nodes are found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Provisioner {
    /// An AKS agent pool created for the job.
    Aks,
    /// Nodes that already exist.
    Existing,
}

/// The AKS GPU driver setting of a pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum GpuDriver {
    /// AKS installs the NVIDIA driver.
    Install,
    /// No driver from AKS (the NVIDIA GPU Operator installs it).
    None,
}

/// MPI settings.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct MpiSpec {
    /// The MPI in the image; it decides the hostfile format and the launcher's command.
    /// Default: OpenMPI.
    #[serde(default)]
    pub implementation: MpiImplementation,
    /// Port the workers' sshd listens on. Default: 2222. A port below 1024 (22, as some MPI
    /// images expect) works for images that run as a user other than root too: the worker
    /// pods then set the namespaced sysctl `net.ipv4.ip_unprivileged_port_start` to it,
    /// which the kubelet allows by default and affects only the pod's own network (one of
    /// the "safe" sysctls every Pod Security level allows; a cluster policy that forbids all
    /// sysctls refuses such workers, and the job says so).
    #[serde(default = "default_ssh_port")]
    #[schemars(range(min = 1, max = 65535))]
    #[x_kube(validation = Rule::new("self != 29500")
        .message("29500 is the trainers' rendezvous port on every worker: pick another sshPort"))]
    pub ssh_port: i32,
    /// Further arguments for mpirun (or mpiexec), placed before the program. The process
    /// count, the hosts and the processes per host are Ringmaster's to set (from `workers`
    /// and `slotsPerWorker`, in the hostfile): flags that set them (`-np`, `-H`/`--host`,
    /// `--hostfile`, `-npernode`, `--map-by ppr:…`, Hydra's `-hosts`, `-f`, `-ppn`, …),
    /// with a value after them or after `=`, are refused. At most 64 arguments of at most
    /// 1024 characters each.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    // The bounds keep the API server's CEL cost estimate within its budget.
    #[schemars(length(max = 64), inner(length(max = 1024)))]
    #[x_kube(validation = Rule::new(
        "self.all(a, !a.matches('^--?(n|np|c|N|H|f|host|hosts|hostfile|default-hostfile|machine|machinefile|npernode|npersocket|ppn|perhost|rr|rf|rankfile)(=.*)?$') && !a.matches('^(--?map-by=)?ppr:'))"
    ).message("mpi.extraArgs must not set the process count, the hosts or the processes per host: Ringmaster sets them from workers and slotsPerWorker (the hostfile)"))]
    pub extra_args: Vec<String>,
}

impl Default for MpiSpec {
    fn default() -> Self {
        Self {
            implementation: MpiImplementation::default(),
            ssh_port: default_ssh_port(),
            extra_args: Vec::new(),
        }
    }
}

fn default_ssh_port() -> i32 {
    2222
}

/// An MPI implementation.
// Another one: a variant here, and its arms in `controller/training_job/build/mpi.rs` (all
// that differs between implementations is there).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum MpiImplementation {
    /// Open MPI: `mpirun`, hostfile lines `host slots=N`.
    #[default]
    OpenMPI,
    /// Intel MPI: `mpirun` (Hydra), hostfile lines `host:N`.
    IntelMPI,
    /// MPICH: `mpiexec.hydra` (Hydra by its own name), hostfile lines `host:N`.
    MPICH,
}

/// Additions to a pod that Ringmaster builds.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new(pod_security::RUNS_AS_ROOT_AND_NON_ROOT)
        .message("runAsNonRoot: true and runAsUser: 0 (in securityContext or containerSecurityContext; the container's win) contradict each other: the kubelet would refuse to start the container. To run as root, set runAsUser: 0 alone (Ringmaster then leaves runAsNonRoot unset)"),
    validation = Rule::new("!has(self.initContainers) || !has(self.containers) || self.containers.all(c, self.initContainers.all(i, i.name != c.name))")
        .message("a name is in both initContainers and containers: the containers of a pod need names of their own")
        .field_path(".containers"),
)]
pub struct PodOverrides {
    /// Environment variables added to the main container (after Ringmaster's own).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 256))]
    pub env: Vec<EnvVar>,
    /// Resource requests and limits of the main container; GPU and RDMA limits are set by
    /// Ringmaster from the spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Node labels the pod must match (merged with the node pool's).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 32, "additionalProperties" = {"type": "string", "maxLength": 63, "pattern": kubernetes_rules::LABEL_VALUE_PATTERN}))]
    #[x_kube(validation = kubernetes_rules::label_keys("nodeSelector"))]
    pub node_selector: BTreeMap<String, String>,
    /// Tolerations added to the pod.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    #[x_kube(
        validation = kubernetes_rules::tolerations()[0].clone(),
        validation = kubernetes_rules::tolerations()[1].clone(),
        validation = kubernetes_rules::tolerations()[2].clone(),
        validation = kubernetes_rules::tolerations()[3].clone(),
    )]
    pub tolerations: Vec<Toleration>,
    /// Labels added to the pod (not under `ringmaster.dev/`, which Ringmaster's own selectors use).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 64, "additionalProperties" = {"type": "string", "maxLength": 63, "pattern": kubernetes_rules::LABEL_VALUE_PATTERN}))]
    #[x_kube(
        validation = Rule::new("self.all(k, !k.startsWith('ringmaster.dev/'))")
            .message("labels under ringmaster.dev/ are Ringmaster's own and cannot be set"),
        validation = kubernetes_rules::label_keys("labels"),
    )]
    pub labels: BTreeMap<String, String>,
    /// Annotations added to the pod.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(length(max = 64))]
    pub annotations: BTreeMap<String, String>,
    /// Volumes added to the pod; their names must differ from the volumes Ringmaster adds
    /// to it (ssh, ssh-secret, and with the spec that needs them data, output, dshm,
    /// hostfile).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub volumes: Vec<Volume>,
    /// Mounts added to the main container, at paths Ringmaster does not mount at.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub volume_mounts: Vec<VolumeMount>,
    /// PriorityClass of the pod. Unset on the launcher: the operator's launcher class, when
    /// it has one (`--launcher-priority-class`; Helm `launcherPriorityClass`), which places
    /// it ahead of pods queued while its workers started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub priority_class_name: Option<String>,
    /// The pod's security context, over Ringmaster's (each field you set wins): `runAsNonRoot:
    /// true` (unless you set `runAsUser: 0`: for an image that must run as root), `seccompProfile:
    /// RuntimeDefault`, `fsGroup: 1000` (the group the SSH key is readable by), and on workers
    /// with an `mpi.sshPort` below 1024 the sysctl `net.ipv4.ip_unprivileged_port_start`
    /// (`sysctls` are added to it, yours winning by name). With these the pod meets the
    /// Pod Security Standard `restricted` (`baseline` with InfiniBand, whose IPC_LOCK neither
    /// allows).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = pod_security::localhost_profile())]
    pub security_context: Option<PodSecurityContext>,
    /// The main container's security context, over Ringmaster's (each field you set wins):
    /// `allowPrivilegeEscalation: false` (unless you set `privileged: true` or add SYS_ADMIN)
    /// and `capabilities.drop: [ALL]` (not for a container that runs as root: sshd needs the
    /// runtime's default capabilities for its privilege separation). `capabilities.add` is
    /// added to Ringmaster's (IPC_LOCK on InfiniBand workers); `capabilities.drop`, when set,
    /// replaces `[ALL]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(
        validation = pod_security::localhost_profile(),
        validation = Rule::new(pod_security::PRIVILEGED_WITHOUT_ESCALATION)
            .message("allowPrivilegeEscalation: false cannot go with privileged: true (a privileged container can always escalate): leave allowPrivilegeEscalation unset"),
    )]
    pub container_security_context: Option<SecurityContext>,
    /// Secrets in the job's namespace with the registry credentials that pull the pod's
    /// images, added to the pod's (Ringmaster sets none itself).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub image_pull_secrets: Vec<LocalObjectReference>,
    /// The ServiceAccount the pod runs as. Unset: the namespace's `default`. Its API token is
    /// mounted only when `automountServiceAccountToken` is true: the training pods never
    /// call the API server themselves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253), regex(pattern = kubernetes_rules::DNS_SUBDOMAIN_PATTERN))]
    pub service_account_name: Option<String>,
    /// Mount the ServiceAccount's API token in the pod (for a container of yours that calls
    /// the API server). Default: false, whatever the ServiceAccount says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub automount_service_account_token: Option<bool>,
    /// The pod's affinity, taken as you write it. Ringmaster places pods with `nodeSelector`
    /// (the node pool's labels, `nodeSelector` above, a Kueue flavor's), which the scheduler
    /// requires together with every term here (a node must match the selector and one of
    /// the `nodeSelectorTerms`), so both hold; it sets no affinity of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// Topology spread constraints of the pod, added to the pod's (Ringmaster sets none).
    /// Select the job's pods with the label `ringmaster.dev/job: <job name>` (and
    /// `ringmaster.dev/role: worker`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    pub topology_spread_constraints: Vec<TopologySpreadConstraint>,
    /// Containers run before the main one, in this order (Ringmaster has none of its own).
    /// A container with `restartPolicy: Always` is a native sidecar: it starts before the
    /// main container, runs beside it, and is stopped once the main container has ended.
    /// Each gets Ringmaster's container defaults under its own `securityContext` (as
    /// `containerSecurityContext` describes, without IPC_LOCK). Names must differ from each
    /// other, from `containers` and from Ringmaster's containers (`worker`, `launcher`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "added_containers_schema")]
    #[x_kube(validation = Rule::new("self.all(c, !(c.name in ['worker', 'launcher']))")
        .message("worker and launcher are the names of Ringmaster's containers (the job's status is read from them): name yours differently"))]
    pub init_containers: Vec<Container>,
    /// Containers added to the pod after the main one (which stays first), with Ringmaster's
    /// container defaults under their own `securityContext` as for `initContainers`. On the
    /// launcher they must end by themselves: the launcher pod ends (and with it the job)
    /// only once every container has; a helper that runs for as long as `mpirun` does
    /// belongs in `initContainers` with `restartPolicy: Always`. Names must differ from
    /// each other, from `initContainers` and from Ringmaster's containers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "added_containers_schema")]
    #[x_kube(validation = Rule::new("self.all(c, !(c.name in ['worker', 'launcher']))")
        .message("worker and launcher are the names of Ringmaster's containers (the job's status is read from them): name yours differently"))]
    pub containers: Vec<Container>,
    /// The RuntimeClass the pod runs with (a sandboxed runtime such as Kata, or one a GPU
    /// operator installs such as `nvidia`). Unset: the cluster's default runtime.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253), regex(pattern = kubernetes_rules::DNS_SUBDOMAIN_PATTERN))]
    pub runtime_class_name: Option<String>,
    /// Share the node's IPC namespace (workers only: the ranks run there), for InfiniBand
    /// setups whose RDMA or shared-memory transports need the host's System V IPC. Beyond
    /// the Pod Security levels `restricted` and `baseline`: the namespace must allow
    /// `privileged`. Default: false.
    #[serde(default, rename = "hostIPC", skip_serializing_if = "Option::is_none")]
    pub host_ipc: Option<bool>,
    /// Ports added to the main container's (for a metrics exporter or a debugger in the
    /// main container). Ringmaster's workers list `ssh` (`mpi.sshPort`) and `rendezvous`
    /// (29500): yours must differ from them in name and number. The job's NetworkPolicy
    /// (when the operator makes one) admits only the job's own pods: to reach a port from
    /// elsewhere (a Prometheus scraping it), add a NetworkPolicy of your own that allows it
    /// (NetworkPolicies add up).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    #[x_kube(validation = Rule::new("self.all(p, p.containerPort >= 1 && p.containerPort <= 65535 && (!has(p.hostPort) || (p.hostPort >= 1 && p.hostPort <= 65535)))")
        .message("a port's containerPort (and hostPort, when set) is between 1 and 65535"))]
    pub ports: Vec<ContainerPort>,
}

/// The schema of [`PodOverrides::init_containers`] and [`PodOverrides::containers`]:
/// Kubernetes' own Container schema, as a pod's (so `kubectl apply` refuses a malformed
/// container, and `kubectl explain` describes its fields), with what the API server checks
/// on a pod's containers added where the schema leaves it to the pod: at most 16, a name
/// that is a DNS label (which bounds the CEL rules over names), each name once.
///
/// The whole schema rather than one that keeps unknown fields (which `kubectl apply` would
/// take with any typo, for the pod to be refused later): it adds about 55 KB of JSON, what
/// the API server stores, per list (four lists: init and added containers, of launcher and
/// worker). The TrainingJob CRD is then about 585 KB, well below etcd's 1.5 MiB limit on an
/// object (`tests/crds.rs` keeps it under 1 MiB), as MPIJob's full pod templates are. Like
/// theirs, and like ours before, it is too large for client-side `kubectl apply` (its
/// last-applied annotation is limited to 256 KiB) and is applied server-side (`kubectl
/// apply --server-side`, Helm, Flux).
fn added_containers_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let mut schema = generator.subschema_for::<Vec<Container>>();
    schema.insert("maxItems".into(), 16.into());
    schema.insert("x-kubernetes-list-type".into(), "map".into());
    schema.insert(
        "x-kubernetes-list-map-keys".into(),
        serde_json::json!(["name"]),
    );
    if let Some(serde_json::Value::Object(name)) = schema.pointer_mut("/items/properties/name") {
        name.insert("maxLength".into(), 63.into());
        name.insert("pattern".into(), kubernetes_rules::DNS_LABEL_PATTERN.into());
    }
    schema
}

/// CEL rules over the security contexts of [`PodOverrides`]: combinations Kubernetes refuses
/// on the pod (or the kubelet when it starts it), refused on the spec instead. Scalars only:
/// a rule over an unbounded list (`capabilities.add`) would cost the API server too much
/// (the operator's validate step checks those).
mod pod_security {
    use kube::core::Rule;

    /// The container's `runAsNonRoot` (else the pod's) is true and its `runAsUser` (else the
    /// pod's) is 0.
    pub const RUNS_AS_ROOT_AND_NON_ROOT: &str = "!((has(self.containerSecurityContext) && has(self.containerSecurityContext.runAsNonRoot) ? self.containerSecurityContext.runAsNonRoot : (has(self.securityContext) && has(self.securityContext.runAsNonRoot) && self.securityContext.runAsNonRoot)) && (has(self.containerSecurityContext) && has(self.containerSecurityContext.runAsUser) ? self.containerSecurityContext.runAsUser == 0 : (has(self.securityContext) && has(self.securityContext.runAsUser) && self.securityContext.runAsUser == 0)))";

    /// `privileged: true` with `allowPrivilegeEscalation: false`, which the API server refuses.
    pub const PRIVILEGED_WITHOUT_ESCALATION: &str = "!(has(self.privileged) && self.privileged && has(self.allowPrivilegeEscalation) && !self.allowPrivilegeEscalation)";

    /// A seccomp profile names a file exactly when its type is Localhost.
    pub fn localhost_profile() -> Rule {
        Rule::new("!has(self.seccompProfile) || (self.seccompProfile.type == 'Localhost') == (has(self.seccompProfile.localhostProfile) && self.seccompProfile.localhostProfile != '')")
            .message("seccompProfile.localhostProfile is set exactly when seccompProfile.type is Localhost (the other types are RuntimeDefault and Unconfined)")
            .field_path(".seccompProfile")
    }
}

/// Restarts, deadlines, clean-up and suspension.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunPolicy {
    /// How many times the whole gang (launcher and workers) is restarted after a retryable
    /// failure (a worker failed, was evicted or deleted; the launcher failed with a
    /// retryable exit code) before the job is Failed. Default: 3.
    #[serde(default = "default_backoff_limit")]
    #[schemars(range(min = 0, max = 100))]
    pub backoff_limit: i32,
    /// Seconds the job may run, counted from status.startTime (when its first launcher was
    /// made, every worker ready; gang restarts do not reset it, a suspension or a Kueue
    /// eviction does), before it is Failed with reason DeadlineExceeded and its pods are
    /// stopped. As MPI Operator's, which puts it on its launcher Job. Waiting for data,
    /// nodes or a scheduler before that first start does not count; after a restart, the
    /// new gang's wait does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub active_deadline_seconds: Option<i64>,
    /// Seconds each gang (the first, and each restart's) may take to start, before the job
    /// is Failed with reason StartTimeout and what held it (a worker whose image cannot be
    /// pulled or whose container cannot start, a worker that fits no node of the job's own
    /// node pool, a worker whose sshd never gets ready), its pods stopped and its node pool
    /// given back. Counted from when the gang's first worker was placed on a node (for a job
    /// with a node pool of its own: from when its workers were made) until its launcher is
    /// made. Waiting in a queue (Kueue, a gang scheduler, for room on existing nodes), for
    /// data or for the node pool does not count. Default: 1800 (a large CUDA image pulled
    /// onto a new node takes minutes; half an hour of idle GPUs is the most to lose).
    #[serde(default = "default_start_timeout_seconds")]
    #[schemars(range(min = 30, max = 604800))]
    pub start_timeout_seconds: i64,
    /// Seconds after the job finished (Succeeded or Failed) until it is deleted with its
    /// children. Unset: kept until you delete it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub ttl_seconds_after_finished: Option<i32>,
    /// Which pods are deleted when the job finishes: `Running` (those still running),
    /// `All`, or `None`. Default: Running.
    #[serde(default)]
    pub clean_pod_policy: CleanPodPolicy,
    /// Stop the job's pods and keep the job; set back to false to start it again.
    #[serde(default)]
    pub suspend: bool,
    /// How the gang scheduler treats the job's workers, when the operator gang-schedules
    /// (Helm: `gangScheduler`); ignored otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduling_policy: Option<SchedulingPolicy>,
}

impl Default for RunPolicy {
    fn default() -> Self {
        Self {
            backoff_limit: default_backoff_limit(),
            active_deadline_seconds: None,
            start_timeout_seconds: default_start_timeout_seconds(),
            ttl_seconds_after_finished: None,
            clean_pod_policy: CleanPodPolicy::default(),
            suspend: false,
            scheduling_policy: None,
        }
    }
}

/// Gang-scheduling settings of a job (its PodGroup's), as MPI Operator's
/// `runPolicy.schedulingPolicy`. Each setting is read by one of the gang schedulers and
/// ignored by the other.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SchedulingPolicy {
    /// Seconds the gang scheduler holds the workers it has placed while it waits for room
    /// for the rest of the gang; then it lets them go and tries the whole gang again later.
    /// Unset: the scheduler's own setting (scheduler-plugins' `permitWaitingTimeSeconds`).
    /// Can be changed while the job runs: it applies to the next placement. scheduler-plugins
    /// only (Volcano has no such setting).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 86400))]
    pub schedule_timeout_seconds: Option<i32>,
    /// The Volcano queue the job's PodGroup waits in, whose share of the cluster it is
    /// counted against; it must exist and be open. Unset: the queue Volcano gives the group
    /// (its default queue, or the namespace's). Volcano only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253), regex(pattern = kubernetes_rules::DNS_SUBDOMAIN_PATTERN))]
    pub queue: Option<String>,
}

fn default_backoff_limit() -> i32 {
    3
}

fn default_start_timeout_seconds() -> i64 {
    1800
}

/// Which pods are deleted when a job finishes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum CleanPodPolicy {
    /// Pods still running are deleted; finished ones stay for their logs.
    #[default]
    Running,
    /// Every pod is deleted.
    All,
    /// No pod is deleted.
    None,
}

/// Where a TrainingJob is in its life.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum TrainingJobPhase {
    /// Accepted, nothing started yet (or the spec is invalid: see the conditions).
    #[default]
    Pending,
    /// Waiting for the DataStage in dataStageRef to be Ready.
    WaitingForData,
    /// Waiting in a Kueue queue (label kueue.x-k8s.io/queue-name) for its Workload to be
    /// admitted: no pods. The Admitted condition says what Kueue says.
    Queued,
    /// Waiting for the node pool and its nodes.
    ProvisioningNodes,
    /// Workers are starting; the launcher starts once all are ready.
    Starting,
    /// The launcher is running mpirun.
    Running,
    /// A retryable failure happened; the gang is being replaced.
    Restarting,
    /// Suspended by runPolicy.suspend, or evicted by Kueue (preempted, deactivated, its
    /// queue stopped) until it is admitted again: no pods. The Suspended condition says why.
    Suspended,
    /// The launcher exited 0.
    Succeeded,
    /// The job failed for good; the Failed condition says why.
    Failed,
}

/// Observed state of a TrainingJob.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TrainingJobStatus {
    /// Where the job is in its life.
    #[serde(default)]
    pub phase: TrainingJobPhase,
    /// The operator process that wrote this status last (`<pod>/<number drawn at its
    /// start>`). Each write is conditional on it: a replica that lost its leadership with a
    /// write still in flight cannot overwrite what the new leader wrote.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub written_by: Option<String>,
    /// The generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Ready, SpecValid, Reconciling, Stalled and the job's own conditions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Conditions,
    /// Counts of worker pods by state.
    #[serde(default)]
    pub workers: WorkerCounts,
    /// State of the launcher pod: absent until it exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launcher: Option<String>,
    /// How many times the gang was restarted.
    #[serde(default)]
    pub restarts: i32,
    /// When the launcher started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<Time>,
    /// When the job finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_time: Option<Time>,
    /// The job's node pool, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_pool: Option<NodePoolStatus>,
    /// What the trainer reported at the end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<TrainingResult>,
    /// The last gang attempt that failed, and why: kept after the restart deletes its pods
    /// (and their logs), until the job is deleted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failure: Option<LastFailure>,
    /// How far training got, as the launcher reports it while the job runs (at most one
    /// status write per job every 30 s or more; see `docs/progress.md`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<TrainingProgress>,
    /// The fabric the gradients cross between ranks, as NCCL itself reported it (the
    /// trainer reads NCCL's INIT/NET account after the first step).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fabric: Option<FabricStatus>,
}

/// How far training got.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TrainingProgress {
    /// Steps done.
    pub step: i64,
    /// Steps in all, when the program says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_steps: Option<i64>,
    /// `step` of `totalSteps` in percent, e.g. `42%`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub percent_done: Option<String>,
    /// Mean loss over the ranks at `step`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss: Option<f64>,
    /// Images per second over all ranks, rounded: the recent rate while training, the
    /// whole run's once it ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub images_per_second: Option<i64>,
    /// Time left to the last step at the recent rate, e.g. `1h12m`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_remaining: Option<String>,
    /// When the last step should be done at the recent rate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub estimated_completion_time: Option<Time>,
    /// When the launcher reported this.
    pub report_time: Time,
}

/// The fabric between ranks.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FabricStatus {
    /// The collective: `nccl` or `tcp-ring`.
    pub collective: String,
    /// The network NCCL uses between hosts on rank 0 (`IB`, `Socket`, a plugin's name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<String>,
    /// The transports of rank 0's channels (`NET/IB`, `NET/Socket`, `P2P`, `SHM`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub transports: Vec<String>,
    /// Whether rank 0's network channels use GPUDirect RDMA.
    #[serde(default)]
    pub gpu_direct_rdma: bool,
    /// Ranks whose traffic between hosts goes over InfiniBand.
    pub ranks_on_infiniband: i64,
    /// Ranks in all.
    pub world_size: i64,
}

/// A failed gang attempt, as the job saw it end.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LastFailure {
    /// The attempt that failed (0 for the first gang, then one more for each restart).
    pub attempt: i32,
    /// When the job saw it fail.
    pub time: Time,
    /// The pod whose end was the cause.
    pub pod: String,
    /// That pod's exit code, when it exited (not when it was deleted or lost).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// What ended it: the pod's exit code and reason, and the failing rank's error or the last
    /// lines of the launcher's output (at most 500 bytes; values of secret-looking settings,
    /// such as `sig=` or `AccountKey=`, and bearer tokens replaced by `<redacted>`).
    pub message: String,
    /// The attempt's launcher pod, when it failed: it is kept (with its log, for `kubectl
    /// logs`) while the next attempt runs, until a later launcher fails or the job ends, when
    /// `cleanPodPolicy` decides as for the job's other finished pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launcher: Option<String>,
    /// The last lines of that launcher's output (mpirun's and the ranks' last words), at most
    /// 1 KiB, redacted as `message` is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launcher_log: Option<String>,
}

/// Worker pods by state.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkerCounts {
    /// Worker pods that exist.
    #[serde(default)]
    pub active: i32,
    /// Worker pods ready (sshd reachable).
    #[serde(default)]
    pub ready: i32,
    /// Worker pods that failed.
    #[serde(default)]
    pub failed: i32,
}

/// State of a job's node pool.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodePoolStatus {
    /// Name of the agent pool (or of the node selector's pool for `existing`).
    pub name: String,
    /// The pool's provisioning state as Azure reports it (Creating, Succeeded, Failed, Deleting).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provisioning_state: Option<String>,
    /// Nodes of the pool that are Ready with their GPUs allocatable.
    #[serde(default)]
    pub ready_nodes: i32,
    /// URL of Azure's long-running operation for the pool's last create or delete (its
    /// failure message is read from there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operation: Option<String>,
}

/// The trainer's summary, read from the launcher's termination message.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TrainingResult {
    /// Training throughput over all ranks, images per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub images_per_second: Option<f64>,
    /// Steps completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<i64>,
    /// Loss at the last step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_loss: Option<f64>,
    /// Steps the last start of the trainer did not train again: it went on from the
    /// checkpoint in the output folder (after a gang restart, or a readmission).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_from_step: Option<i64>,
    /// The earlier job's UID (`trainer.resumeFrom`) whose checkpoint the last start went on
    /// from; absent when it went on from this job's own, or started from step 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_from_run: Option<String>,
}
