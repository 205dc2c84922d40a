//! The PodGroup of a gang-scheduled job, for scheduler-plugins or Volcano, and what puts a
//! pod in it.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::{BuildInputs, metadata};
use crate::controller::training_job::names;
use crate::controller::training_job::spec::ValidatedTrainingJob;
use crate::gang::{GangApi, POD_GROUP_LABEL, PodGroup, PodGroupSpec, volcano};

/// What a gang's workers need together, for its PodGroup: their GPUs and RDMA devices (whole
/// counts Ringmaster sets itself), the scarce part, and what a gang scheduler can check the
/// cluster for before holding any node.
fn gang_min_resources(job: &ValidatedTrainingJob) -> BTreeMap<String, Quantity> {
    let mut min_resources = BTreeMap::new();
    if job.gpus_per_worker > 0 {
        min_resources.insert(
            crate::api::GPU_RESOURCE.to_string(),
            Quantity((u64::from(job.gpus_per_worker) * u64::from(job.workers)).to_string()),
        );
    }
    if let Some(ib) = &job.infiniband {
        min_resources.insert(
            ib.rdma_resource.clone(),
            Quantity((u64::from(ib.rdma_resource_count) * u64::from(job.workers)).to_string()),
        );
    }
    min_resources
}

/// The workers, the gang's members. The launcher is in the group but not counted: it is made
/// only once every worker is ready, so counting it would hold the workers back for a pod
/// that cannot exist yet; it joins a group already placed and is scheduled at once.
fn gang_min_member(job: &ValidatedTrainingJob) -> i32 {
    // The schema bounds workers far below i32::MAX.
    i32::try_from(job.workers).unwrap_or(i32::MAX)
}

/// The metadata of a job's PodGroup, either scheduler's.
fn pod_group_metadata(job: &ValidatedTrainingJob) -> ObjectMeta {
    let mut labels = names::job_labels(&job.name);
    labels.insert(names::ROLE_LABEL.into(), "gang".into());
    metadata(job, names::pod_group(&job.name, &job.uid), labels)
}

/// The scheduler-plugins PodGroup of a gang-scheduled job: the scheduler places all its
/// workers (`gang_min_member`) at once or none of them.
pub fn pod_group(job: &ValidatedTrainingJob) -> PodGroup {
    PodGroup {
        metadata: pod_group_metadata(job),
        spec: PodGroupSpec {
            min_member: gang_min_member(job),
            min_resources: gang_min_resources(job),
            schedule_timeout_seconds: job
                .run_policy
                .scheduling_policy
                .as_ref()
                .and_then(|p| p.schedule_timeout_seconds),
        },
    }
}

/// The Volcano PodGroup of a gang-scheduled job: in the job's queue, with the workers'
/// priority class, so Volcano orders it among its queue's jobs as the workers' priority says.
pub fn volcano_pod_group(job: &ValidatedTrainingJob) -> volcano::PodGroup {
    volcano::PodGroup {
        metadata: pod_group_metadata(job),
        spec: volcano::PodGroupSpec {
            min_member: gang_min_member(job),
            min_resources: gang_min_resources(job),
            queue: job
                .run_policy
                .scheduling_policy
                .as_ref()
                .and_then(|p| p.queue.clone()),
            priority_class_name: job.worker.priority_class_name.clone(),
        },
    }
}

/// Hands a pod to the gang scheduler, in the job's PodGroup: a label for scheduler-plugins,
/// an annotation for Volcano. Last: it wins over the user's own and over what a Kueue
/// admission adds.
pub(super) fn join_gang(pod: &mut Pod, job: &ValidatedTrainingJob, inputs: &BuildInputs) {
    let Some(scheduler) = &inputs.gang_scheduler else {
        return;
    };
    pod.spec.get_or_insert_default().scheduler_name = Some(scheduler.name.clone());
    let (map, key) = match scheduler.api {
        GangApi::SchedulerPlugins => (&mut pod.metadata.labels, POD_GROUP_LABEL),
        GangApi::Volcano => (
            &mut pod.metadata.annotations,
            volcano::GROUP_NAME_ANNOTATION,
        ),
    };
    map.get_or_insert_default()
        .insert(key.into(), names::pod_group(&job.name, &job.uid));
}
