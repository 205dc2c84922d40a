//! Queueing in Kueue, pure: a TrainingJob labelled `kueue.x-k8s.io/queue-name` has a
//! Workload of Ringmaster's making (one pod set for the workers, one for the launcher) and
//! runs only while Kueue admits it. This module builds that Workload, reads where the job
//! stands from it, and writes the few things the job's controller owes Kueue: the Workload's
//! `active` when `runPolicy.suspend` changes, its quota given back once an evicted job's pods
//! are gone, and Finished when the job ends.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Pod, PodTemplateSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::ResourceExt;
use serde_json::{Value, json};

use super::build::{self, BuildInputs};
use super::names;
use super::spec::ValidatedTrainingJob;
use super::state::{Placement, PodPlacement, QueueState};
use crate::api::TrainingJob;
use crate::controller::conditions::{self, DesiredCondition};
use crate::kueue::{
    PodSet, PriorityClassRef, QUEUE_NAME_LABEL, ResourceFlavorSpec, Workload, WorkloadSpec,
    conditions as wl,
};

/// The Workload's pod set of the workers.
pub const WORKERS_POD_SET: &str = "workers";
/// The Workload's pod set of the launcher.
pub const LAUNCHER_POD_SET: &str = "launcher";
/// On the Workload: the `runPolicy.suspend` last carried onto its `spec.active`. Only a
/// change of it is carried again, so Ringmaster never undoes a deactivation of Kueue's own.
pub const SUSPEND_ANNOTATION: &str = "ringmaster.dev/run-policy-suspend";

/// The LocalQueue a job asks for, when it asks for one.
pub fn queue_name(job: &TrainingJob) -> Option<&str> {
    job.labels()
        .get(QUEUE_NAME_LABEL)
        .map(String::as_str)
        .filter(|q| !q.is_empty())
}

/// A job's priority class, resolved: a Kueue WorkloadPriorityClass (label
/// `kueue.x-k8s.io/priority-class`), else the workers' PriorityClass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Priority {
    /// The class's name.
    pub class: String,
    /// Its value.
    pub value: i32,
    /// A WorkloadPriorityClass (`true`) or a PriorityClass of the pods.
    pub workload_class: bool,
}

/// The Workload of a queued job: the workers and the launcher as Kueue will count them
/// (each container's limits stand in for requests it does not set, as the API server does for
/// pods), owned by the job, active unless `runPolicy.suspend` says otherwise.
pub fn workload(
    job: &ValidatedTrainingJob,
    queue: &str,
    inputs: &BuildInputs,
    priority: Option<&Priority>,
) -> Workload {
    let unplaced = BuildInputs {
        placement: Placement::default(),
        ..inputs.clone()
    };
    let mut labels = names::job_labels(&job.name);
    labels.insert(QUEUE_NAME_LABEL.into(), queue.into());
    let mut annotations = BTreeMap::new();
    annotations.insert(
        SUSPEND_ANNOTATION.to_string(),
        job.run_policy.suspend.to_string(),
    );
    Workload {
        metadata: ObjectMeta {
            name: Some(names::workload(&job.name, &job.uid)),
            namespace: Some(job.namespace.clone()),
            labels: Some(labels),
            annotations: Some(annotations),
            owner_references: Some(vec![build::owner_reference(job)]),
            ..ObjectMeta::default()
        },
        spec: WorkloadSpec {
            pod_sets: vec![
                PodSet {
                    name: WORKERS_POD_SET.into(),
                    count: i32::try_from(job.workers).unwrap_or(i32::MAX),
                    template: template(build::worker_pod(job, 0, &unplaced)),
                },
                PodSet {
                    name: LAUNCHER_POD_SET.into(),
                    count: 1,
                    template: template(build::launcher_pod(job, &unplaced)),
                },
            ],
            queue_name: Some(queue.into()),
            active: Some(!job.run_policy.suspend),
            priority_class_ref: priority.map(|p| PriorityClassRef {
                group: if p.workload_class {
                    "kueue.x-k8s.io"
                } else {
                    "scheduling.k8s.io"
                }
                .into(),
                kind: if p.workload_class {
                    "WorkloadPriorityClass"
                } else {
                    "PriorityClass"
                }
                .into(),
                name: p.class.clone(),
            }),
            priority: priority.map(|p| p.value),
        },
        status: None,
    }
}

/// A pod as a pod set's template: its labels and spec, with requests defaulted from limits
/// (as the API server defaults a pod's, which Kueue counts), init containers' too: Kueue
/// counts a pod's requests with its init containers' and sidecars'.
fn template(pod: Pod) -> PodTemplateSpec {
    let mut spec = pod.spec.unwrap_or_default();
    let init = spec.init_containers.iter_mut().flatten();
    for container in init.chain(&mut spec.containers) {
        let resources = container.resources.get_or_insert_with(Default::default);
        if let Some(limits) = resources.limits.clone() {
            let requests: &mut BTreeMap<String, Quantity> =
                resources.requests.get_or_insert_with(Default::default);
            for (name, quantity) in limits {
                requests.entry(name).or_insert(quantity);
            }
        }
    }
    PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: pod.metadata.labels,
            ..ObjectMeta::default()
        }),
        spec: Some(spec),
    }
}

/// Where the job stands, from its Workload (`None`: not made yet) and the ResourceFlavors
/// (`flavor` looks one up by name).
pub fn state(
    queue: &str,
    workload: Option<&Workload>,
    flavor: impl Fn(&str) -> Option<ResourceFlavorSpec>,
) -> QueueState {
    let Some(workload) = workload else {
        return QueueState::Waiting {
            message: format!("queued in LocalQueue {queue}: its Workload is being made"),
        };
    };
    if let Some(evicted) = workload
        .condition(wl::EVICTED)
        .filter(|c| c.status == "True")
    {
        // Kueue keeps Evicted until the next admission. One deactivated and active again,
        // its quota given back, is simply queued again.
        let reactivated = matches!(
            eviction_reason(&evicted.reason),
            "Deactivated" | "InactiveWorkload"
        ) && workload.spec.active != Some(false)
            && !workload.has_quota_reservation();
        if reactivated {
            return QueueState::Waiting {
                message: format!("queued in LocalQueue {queue} again after it was deactivated"),
            };
        }
        return QueueState::Evicted {
            reason: eviction_reason(&evicted.reason),
            message: evicted.message.clone(),
        };
    }
    let status = workload.status.clone().unwrap_or_default();
    if workload.is(wl::ADMITTED)
        && let Some(admission) = &status.admission
    {
        let mut placement = Placement::default();
        for assignment in &admission.pod_set_assignments {
            let Some(target) = pod_set_placement(&mut placement, &assignment.name) else {
                continue;
            };
            let flavors: std::collections::BTreeSet<&String> =
                assignment.flavors.values().collect();
            for name in flavors {
                let Some(spec) = flavor(name) else {
                    return QueueState::Waiting {
                        message: format!(
                            "admitted by ClusterQueue {}, but ResourceFlavor {name} is not known yet",
                            admission.cluster_queue
                        ),
                    };
                };
                target.add(&spec.node_labels, &spec.tolerations);
            }
        }
        for check in &status.admission_checks {
            for update in &check.pod_set_updates {
                if let Some(target) = pod_set_placement(&mut placement, &update.name) {
                    target.add(&update.node_selector, &update.tolerations);
                    target.labels.extend(update.labels.clone());
                    target.annotations.extend(update.annotations.clone());
                }
            }
        }
        let flavors: std::collections::BTreeSet<&String> = admission
            .pod_set_assignments
            .iter()
            .flat_map(|a| a.flavors.values())
            .collect();
        let flavors: Vec<&str> = flavors.into_iter().map(String::as_str).collect();
        return QueueState::Admitted {
            placement,
            message: format!(
                "admitted by ClusterQueue {} (flavors: {})",
                admission.cluster_queue,
                if flavors.is_empty() {
                    "none".to_string()
                } else {
                    flavors.join(", ")
                }
            ),
        };
    }
    let said = workload
        .condition(wl::QUOTA_RESERVED)
        .map(|c| c.message.trim().to_string())
        .filter(|m| !m.is_empty());
    QueueState::Waiting {
        message: match said {
            Some(said) => format!("queued in LocalQueue {queue}: {said}"),
            None => format!("queued in LocalQueue {queue}: waiting for quota"),
        },
    }
}

fn pod_set_placement<'a>(placement: &'a mut Placement, name: &str) -> Option<&'a mut PodPlacement> {
    match name {
        WORKERS_POD_SET => Some(&mut placement.workers),
        LAUNCHER_POD_SET => Some(&mut placement.launcher),
        _ => None,
    }
}

/// Kueue's eviction reasons, as the job's condition reason (conditions take fixed reasons).
fn eviction_reason(reason: &str) -> &'static str {
    match reason {
        "Preempted" => "Preempted",
        "PodsReadyTimeout" => "PodsReadyTimeout",
        "AdmissionCheck" => "AdmissionCheck",
        "ClusterQueueStopped" => "ClusterQueueStopped",
        "LocalQueueStopped" => "LocalQueueStopped",
        "NodeFailures" => "NodeFailures",
        // Kueue's own deactivations say why: DeactivatedDueTo<cause>.
        r if r.starts_with("Deactivated") => "Deactivated",
        "InactiveWorkload" => "InactiveWorkload",
        "MaximumExecutionTimeExceeded" => "MaximumExecutionTimeExceeded",
        _ => "Evicted",
    }
}

/// The merge patch that carries a changed `runPolicy.suspend` onto the Workload's
/// `spec.active`; `None` when the Workload already carries this value of it. A Workload that
/// Kueue itself deactivated stays so until the user's suspend changes.
pub fn activation_patch(workload: &Workload, suspend: bool) -> Option<Value> {
    let carried = workload.annotations().get(SUSPEND_ANNOTATION);
    if carried.map(String::as_str) == Some(if suspend { "true" } else { "false" }) {
        return None;
    }
    Some(json!({
        "metadata": {"annotations": {SUSPEND_ANNOTATION: suspend.to_string()}},
        "spec": {"active": !suspend},
    }))
}

/// Once an evicted job's pods are all gone: the JSON Patch that gives its quota back (no
/// admission, QuotaReserved and Admitted False, Requeued as Kueue's own job controllers set
/// it), valid only against the Workload as read (`resourceVersion` is tested). `None` when
/// there is nothing to give back.
pub fn release_patch(workload: &Workload, now: &Time) -> Option<json_patch::Patch> {
    let evicted = workload
        .condition(wl::EVICTED)
        .filter(|c| c.status == "True")?;
    if !workload.has_quota_reservation() {
        return None;
    }
    let message = evicted.message.clone();
    let requeued = matches!(evicted.reason.as_str(), "Preempted" | "NodeFailures");
    let reason = eviction_reason(&evicted.reason);
    let desired = [
        DesiredCondition::new(wl::QUOTA_RESERVED, false, wl::PENDING, message.clone()),
        DesiredCondition::new(wl::ADMITTED, false, wl::PENDING, message.clone()),
        DesiredCondition::new(wl::REQUEUED, requeued, reason, message),
    ];
    let mut ops = vec![json!({"op": "test", "path": "/metadata/resourceVersion",
                              "value": workload.resource_version()})];
    if workload
        .status
        .as_ref()
        .is_some_and(|s| s.admission.is_some())
    {
        ops.push(json!({"op": "remove", "path": "/status/admission"}));
    }
    ops.push(conditions_op(workload, desired, now));
    Some(serde_json::from_value(Value::Array(ops)).expect("a JSON Patch"))
}

/// When the job ended: the JSON Patch that marks its Workload Finished, valid only against
/// the Workload as read. `None` when it is Finished already.
pub fn finish_patch(
    workload: &Workload,
    succeeded: bool,
    message: &str,
    now: &Time,
) -> Option<json_patch::Patch> {
    if workload.is(wl::FINISHED) {
        return None;
    }
    let reason = if succeeded { wl::SUCCEEDED } else { wl::FAILED };
    let desired = [DesiredCondition::new(wl::FINISHED, true, reason, message)];
    let ops = vec![
        json!({"op": "test", "path": "/metadata/resourceVersion", "value": workload.resource_version()}),
        conditions_op(workload, desired, now),
    ];
    Some(serde_json::from_value(Value::Array(ops)).expect("a JSON Patch"))
}

/// Whether `existing` no longer counts what the job's pods would be: `desired` (the Workload
/// built from the job now) differs in a pod set's count, requests (of every container, init
/// containers too), node selector, affinity (which Kueue matches flavors against),
/// tolerations or priority class (the launcher and worker overrides can change).
pub fn outdated(existing: &Workload, desired: &Workload) -> bool {
    fn shape(workload: &Workload) -> Vec<Value> {
        workload
            .spec
            .pod_sets
            .iter()
            .map(|set| {
                let spec = set.template.spec.clone().unwrap_or_default();
                let requests: Vec<Value> = spec
                    .init_containers
                    .iter()
                    .flatten()
                    .chain(&spec.containers)
                    .map(|c| json!(c.resources.as_ref().map(|r| r.requests.clone())))
                    .collect();
                json!([
                    set.name,
                    set.count,
                    requests,
                    spec.node_selector,
                    spec.affinity,
                    spec.tolerations,
                    spec.priority_class_name
                ])
            })
            .collect()
    }
    shape(existing) != shape(desired)
}

/// PodsReady as Kueue's own job controllers keep it (Kueue evicts a Workload admitted for
/// longer than its `waitForPodsReady` timeout, 30 minutes by default, without it): True once
/// the gang runs (`ready`), False while it starts or recovers. `None` when it says so already.
pub fn pods_ready_patch(workload: &Workload, ready: bool, now: &Time) -> Option<json_patch::Patch> {
    const NOT_READY: &str = "Not all pods are ready or succeeded";
    let current = workload.condition(wl::PODS_READY);
    let current_reason = current.map(|c| c.reason.as_str());
    let desired = if !workload.is(wl::ADMITTED) || workload.is(wl::EVICTED) {
        // Evicted or waiting: only a True left from the last admission is taken back.
        if current.is_some_and(|c| c.status == "True") {
            DesiredCondition::new(wl::PODS_READY, false, wl::WAIT_FOR_START, NOT_READY)
        } else {
            return None;
        }
    } else if ready {
        let reason = match current_reason {
            Some(wl::WAIT_FOR_RECOVERY | wl::RECOVERED) => wl::RECOVERED,
            _ => wl::STARTED,
        };
        DesiredCondition::new(
            wl::PODS_READY,
            true,
            reason,
            "All pods reached readiness and the workload is running",
        )
    } else {
        match current {
            None => DesiredCondition::new(wl::PODS_READY, false, wl::WAIT_FOR_START, NOT_READY),
            Some(c) if c.status == "True" => DesiredCondition::new(
                wl::PODS_READY,
                false,
                wl::WAIT_FOR_RECOVERY,
                "At least one pod has failed, waiting for recovery",
            ),
            Some(_) => return None,
        }
    };
    if current.is_some_and(|c| {
        c.status == if desired.status { "True" } else { "False" } && c.reason == desired.reason
    }) {
        return None;
    }
    let ops = vec![
        json!({"op": "test", "path": "/metadata/resourceVersion", "value": workload.resource_version()}),
        conditions_op(workload, [desired], now),
    ];
    Some(serde_json::from_value(Value::Array(ops)).expect("a JSON Patch"))
}

/// Condition messages are cut to what Kueue's CRD allows.
const MAX_MESSAGE: usize = 32_768;

fn conditions_op(
    workload: &Workload,
    desired: impl IntoIterator<Item = DesiredCondition>,
    now: &Time,
) -> Value {
    let mut list = workload
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    for mut condition in desired {
        if condition.message.len() > MAX_MESSAGE {
            let mut end = MAX_MESSAGE;
            while !condition.message.is_char_boundary(end) {
                end -= 1;
            }
            condition.message.truncate(end);
        }
        conditions::set(&mut list, condition, workload.metadata.generation, now);
    }
    if workload.status.is_none() {
        json!({"op": "add", "path": "/status", "value": {"conditions": list}})
    } else {
        json!({"op": "add", "path": "/status/conditions", "value": list})
    }
}
