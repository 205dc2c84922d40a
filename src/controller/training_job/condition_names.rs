//! The names a TrainingJob's conditions use: their types and reasons (no imports, so any
//! step can say them).

/// Condition types of a TrainingJob beyond the shared ones.
pub mod condition_types {
    pub use crate::api::condition_types::*;
    /// The referenced DataStage is Ready.
    pub const DATA_READY: &str = "DataReady";
    /// The nodes for the job are there.
    pub const NODES_READY: &str = "NodesReady";
    /// Every worker of the current gang is ready.
    pub const WORKERS_READY: &str = "WorkersReady";
    /// The gang is being replaced after a failure.
    pub const RESTARTING: &str = "Restarting";
    /// The job is suspended.
    pub const SUSPENDED: &str = "Suspended";
    /// Kueue admitted the job's Workload (queued jobs only).
    pub const ADMITTED: &str = "Admitted";
    /// The launcher exited 0.
    pub const SUCCEEDED: &str = "Succeeded";
    /// The job failed for good.
    pub const FAILED: &str = "Failed";
    /// NCCL carries the gradients over InfiniBand (set only on jobs that ask for it, once
    /// the trainer reported its fabric).
    pub const INFINIBAND_USED: &str = "InfinibandUsed";
}

/// Condition reasons of a TrainingJob.
pub mod reasons {
    /// The job's gang is running.
    pub const RUNNING: &str = "Running";
    /// Workers are starting.
    pub const STARTING: &str = "Starting";
    /// A worker (or the launcher) cannot be scheduled.
    pub const UNSCHEDULABLE: &str = "Unschedulable";
    /// A pod's image cannot be pulled (the kubelet keeps trying).
    pub const IMAGE_PULL_FAILED: &str = "ImagePullFailed";
    /// A pod's container cannot be created or run: a missing Secret or ConfigMap key in its
    /// environment, a command the runtime refuses (the kubelet keeps trying).
    pub const CONTAINER_CANNOT_START: &str = "ContainerCannotStart";
    /// A pod the job would make has a name another pod, not the job's, holds.
    pub const NAME_IN_USE: &str = "NameInUse";
    /// A pod of the job is still being deleted well past its grace period (its node lost, or
    /// a finalizer that stays), and the gang cannot start again without its name.
    pub const POD_STUCK_TERMINATING: &str = "PodStuckTerminating";

    /// The reasons that say the job waits on something a person must fix: each is written at
    /// once and comes with a Warning Event.
    pub const BLOCKING: [&str; 6] = [
        UNSCHEDULABLE,
        IMAGE_PULL_FAILED,
        CONTAINER_CANNOT_START,
        DATA_STAGE_FAILED,
        NAME_IN_USE,
        POD_STUCK_TERMINATING,
    ];
    /// Waiting for the DataStage.
    pub const WAITING_FOR_DATA: &str = "WaitingForData";
    /// The DataStage failed: the job waits until it is made again and copies.
    pub const DATA_STAGE_FAILED: &str = "DataStageFailed";
    /// The DataStage is Ready.
    pub const DATA_READY: &str = "DataReady";
    /// Waiting for nodes.
    pub const PROVISIONING: &str = "ProvisioningNodes";
    /// The job's nodes are Ready.
    pub const NODES_READY: &str = "NodesReady";
    /// The AKS agent pool could not be made (ARM's message says why).
    pub const NODE_POOL_FAILED: &str = "NodePoolFailed";
    /// The gang failed and is being replaced.
    pub const RESTARTING: &str = "Restarting";
    /// Suspended by runPolicy.suspend.
    pub const SUSPENDED: &str = "Suspended";
    /// Not suspended.
    pub const NOT_SUSPENDED: &str = "NotSuspended";
    /// Waiting in a Kueue queue.
    pub const QUEUED: &str = "Queued";
    /// Kueue admitted the job's Workload.
    pub const ADMITTED: &str = "Admitted";
    /// Labelled for a Kueue queue, but the operator runs without `--kueue`.
    pub const KUEUE_INTEGRATION_OFF: &str = "KueueIntegrationOff";
    /// The launcher exited 0.
    pub const SUCCEEDED: &str = "Succeeded";
    /// Restarts were used up.
    pub const BACKOFF_LIMIT_EXCEEDED: &str = "BackoffLimitExceeded";
    /// The launcher failed with a code that a restart would not fix.
    pub const LAUNCHER_FAILED: &str = "LauncherFailed";
    /// The trainer's preflight (`infiniband.preflight`) measured the fabric below the
    /// minimum bus bandwidth: a verdict on the nodes, not retried.
    pub const PREFLIGHT_FAILED: &str = "PreflightFailed";
    /// activeDeadlineSeconds passed.
    pub const DEADLINE_EXCEEDED: &str = "DeadlineExceeded";
    /// A gang did not start within startTimeoutSeconds.
    pub const START_TIMEOUT: &str = "StartTimeout";
    /// The job is not finished.
    pub const NOT_FINISHED: &str = "NotFinished";
    /// NCCL uses InfiniBand on every rank.
    pub const NCCL_USES_INFINIBAND: &str = "NcclUsesInfiniband";
    /// InfiniBand was asked for and NCCL chose sockets on some rank (with a Warning Event).
    pub const NCCL_CHOSE_SOCKETS: &str = "NcclChoseSockets";
}
