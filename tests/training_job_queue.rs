//! Queueing in Kueue, pure: the Workload a queued TrainingJob gets, where the job stands
//! after what Kueue wrote on it (Workloads as Kueue v0.19 writes them), and the writes the
//! job's controller owes Kueue.

#[path = "common/mod.rs"]
mod fixtures;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use ringmaster::controller::training_job::build::BuildInputs;
use ringmaster::controller::training_job::queue::{self, Priority};
use ringmaster::controller::training_job::state::QueueState;
use ringmaster::controller::training_job::validate::{ValidatedTrainingJob, validate_value};
use ringmaster::kueue::{ResourceFlavorSpec, Workload};
use serde_json::{Value, json};

fn sample() -> Value {
    let path = fixtures::root().join("config/samples/kueue/trainingjob-queued.yaml");
    let mut object = fixtures::ringmaster_objects(&path).remove(0);
    object["metadata"]["namespace"] = json!("ml");
    object["metadata"]["uid"] = json!("7c1e9a40-0000-4000-8000-000000000001");
    object
}

fn validated(object: &Value) -> ValidatedTrainingJob {
    validate_value(object, None).unwrap()
}

fn now() -> Time {
    Time(Timestamp::from_second(1_800_000_000).unwrap())
}

/// The sample's Workload as Kueue has it after `status` (YAML of its status).
fn workload_with(status: &str) -> Workload {
    let job = validated(&sample());
    let mut workload =
        serde_json::to_value(queue::workload(&job, "gpus", &BuildInputs::default(), None)).unwrap();
    workload["metadata"]["resourceVersion"] = json!("4711");
    workload["metadata"]["generation"] = json!(1);
    workload["status"] = serde_saphyr::from_str(status).unwrap();
    serde_json::from_value(workload).unwrap()
}

const ADMITTED: &str = r#"
admission:
  clusterQueue: training
  podSetAssignments:
  - name: workers
    flavors: {nvidia.com/gpu: nd96asr-v4}
    count: 2
  - name: launcher
    count: 1
conditions:
- {type: QuotaReserved, status: "True", reason: QuotaReserved, message: Quota reserved in ClusterQueue training, lastTransitionTime: "2027-01-15T08:00:00Z"}
- {type: Admitted, status: "True", reason: Admitted, message: The workload is admitted, lastTransitionTime: "2027-01-15T08:00:00Z"}
"#;

const PREEMPTED: &str = r#"
admission:
  clusterQueue: training
  podSetAssignments:
  - name: workers
    flavors: {nvidia.com/gpu: nd96asr-v4}
    count: 2
conditions:
- {type: QuotaReserved, status: "True", reason: QuotaReserved, message: Quota reserved, lastTransitionTime: "2027-01-15T08:00:00Z"}
- {type: Admitted, status: "True", reason: Admitted, message: admitted, lastTransitionTime: "2027-01-15T08:00:00Z"}
- {type: Evicted, status: "True", reason: Preempted, message: "Preempted to accommodate a workload (UID: 9) due to prioritization in the ClusterQueue", lastTransitionTime: "2027-01-15T09:00:00Z"}
- {type: Preempted, status: "True", reason: InClusterQueue, message: preempted, lastTransitionTime: "2027-01-15T09:00:00Z"}
"#;

fn flavors(name: &str) -> Option<ResourceFlavorSpec> {
    (name == "nd96asr-v4").then(|| {
        serde_saphyr::from_str(
            "nodeLabels: {kubernetes.azure.com/agentpool: gpu}\ntolerations: [{key: sku, operator: Equal, value: gpu, effect: NoSchedule}]",
        )
        .unwrap()
    })
}

#[test]
fn the_workload_counts_the_workers_and_the_launcher_and_belongs_to_the_job() {
    let job = validated(&sample());
    let priority = Priority {
        class: "urgent".into(),
        value: 1000,
        workload_class: true,
    };
    let workload = queue::workload(&job, "gpus", &BuildInputs::default(), Some(&priority));
    let value = serde_json::to_value(&workload).unwrap();
    assert_eq!(
        value["metadata"]["name"],
        "trainingjob-resnet50-queued-7c1e9"
    );
    assert_eq!(value["metadata"]["namespace"], "ml");
    let owner = &value["metadata"]["ownerReferences"][0];
    assert_eq!(
        (&owner["kind"], &owner["name"], &owner["controller"]),
        (
            &json!("TrainingJob"),
            &json!("resnet50-queued"),
            &json!(true)
        )
    );
    assert_eq!(
        value["metadata"]["labels"]["ringmaster.dev/job-name"],
        "resnet50-queued"
    );
    assert_eq!(value["spec"]["queueName"], "gpus");
    assert_eq!(value["spec"]["active"], true);
    assert_eq!(
        value["spec"]["priorityClassRef"],
        json!({"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": "urgent"})
    );
    assert_eq!(value["spec"]["priority"], 1000);
    let sets = value["spec"]["podSets"].as_array().unwrap();
    assert_eq!(
        sets.iter()
            .map(|s| (s["name"].as_str().unwrap(), s["count"].as_i64().unwrap()))
            .collect::<Vec<_>>(),
        vec![("workers", 2), ("launcher", 1)]
    );
    // Kueue counts requests: the GPU limit stands in for the request the pod leaves out.
    let worker = &sets[0]["template"]["spec"]["containers"][0]["resources"];
    assert_eq!(worker["requests"]["nvidia.com/gpu"], "8");
    assert_eq!(worker["limits"]["nvidia.com/gpu"], "8");
    assert!(sets[1]["template"]["spec"]["containers"][0]["resources"]["requests"].is_null());
}

#[test]
fn a_suspended_job_queues_an_inactive_workload() {
    let mut object = sample();
    object["spec"]["runPolicy"]["suspend"] = json!(true);
    let workload = queue::workload(&validated(&object), "gpus", &BuildInputs::default(), None);
    assert_eq!(workload.spec.active, Some(false));
    assert_eq!(
        workload.metadata.annotations.unwrap()[queue::SUSPEND_ANNOTATION],
        "true"
    );
}

#[test]
fn an_admission_places_the_workers_on_the_flavors_nodes() {
    let state = queue::state("gpus", Some(&workload_with(ADMITTED)), flavors);
    let QueueState::Admitted { placement, message } = state else {
        panic!("{state:?}")
    };
    assert_eq!(
        placement.workers.node_selector["kubernetes.azure.com/agentpool"],
        "gpu"
    );
    assert_eq!(placement.workers.tolerations[0].key.as_deref(), Some("sku"));
    // The launcher asked for no GPU: no flavor, no placement.
    assert!(placement.launcher.node_selector.is_empty());
    assert!(
        message.contains("training") && message.contains("nd96asr-v4"),
        "{message}"
    );

    // The placement reaches the pods.
    let job = validated(&sample());
    let inputs = BuildInputs {
        placement,
        ..BuildInputs::default()
    };
    let pod = ringmaster::controller::training_job::build::worker_pod(&job, 1, &inputs);
    let spec = pod.spec.unwrap();
    assert_eq!(
        spec.node_selector.unwrap()["kubernetes.azure.com/agentpool"],
        "gpu"
    );
    assert!(
        spec.tolerations
            .unwrap()
            .iter()
            .any(|t| t.key.as_deref() == Some("sku"))
    );
}

#[test]
fn an_admission_with_an_unknown_flavor_waits() {
    let state = queue::state("gpus", Some(&workload_with(ADMITTED)), |_| None);
    assert!(
        matches!(&state, QueueState::Waiting { message } if message.contains("ResourceFlavor nd96asr-v4")),
        "{state:?}"
    );
}

#[test]
fn a_pending_workload_says_what_kueue_says_and_a_missing_one_says_it_is_being_made() {
    let pending = workload_with(
        r#"
conditions:
- {type: QuotaReserved, status: "False", reason: Pending, message: "couldn't assign flavors to pod set workers: insufficient unused quota for nvidia.com/gpu in flavor nd96asr-v4, 16 more needed", lastTransitionTime: "2027-01-15T08:00:00Z"}
"#,
    );
    let state = queue::state("gpus", Some(&pending), flavors);
    assert!(
        matches!(&state, QueueState::Waiting { message } if message.contains("16 more needed") && message.contains("gpus")),
        "{state:?}"
    );
    let state = queue::state("gpus", None, flavors);
    assert!(
        matches!(&state, QueueState::Waiting { message } if message.contains("being made")),
        "{state:?}"
    );
}

#[test]
fn an_eviction_is_read_with_kueues_reason() {
    let state = queue::state("gpus", Some(&workload_with(PREEMPTED)), flavors);
    assert_eq!(
        state,
        QueueState::Evicted {
            reason: "Preempted",
            message: "Preempted to accommodate a workload (UID: 9) due to prioritization in the ClusterQueue".into()
        }
    );
}

#[test]
fn the_quota_of_an_evicted_job_is_given_back_against_the_workload_as_read() {
    let workload = workload_with(PREEMPTED);
    let patch = serde_json::to_value(queue::release_patch(&workload, &now()).unwrap()).unwrap();
    let ops = patch.as_array().unwrap();
    assert_eq!(
        ops[0],
        json!({"op": "test", "path": "/metadata/resourceVersion", "value": "4711"})
    );
    assert_eq!(ops[1], json!({"op": "remove", "path": "/status/admission"}));
    let conditions = ops[2]["value"].as_array().unwrap();
    let find = |t: &str| conditions.iter().find(|c| c["type"] == t).unwrap();
    assert_eq!(
        (
            &find("QuotaReserved")["status"],
            &find("QuotaReserved")["reason"]
        ),
        (&json!("False"), &json!("Pending"))
    );
    assert_eq!(find("Admitted")["status"], "False");
    assert_eq!(
        (&find("Requeued")["status"], &find("Requeued")["reason"]),
        (&json!("True"), &json!("Preempted"))
    );
    // Kueue's own conditions are kept.
    assert_eq!(find("Evicted")["status"], "True");
    assert_eq!(find("Preempted")["reason"], "InClusterQueue");

    // Nothing to give back: not evicted, or given back already.
    assert!(queue::release_patch(&workload_with(ADMITTED), &now()).is_none());
    let given_back = workload_with(
        r#"
conditions:
- {type: QuotaReserved, status: "False", reason: Pending, message: x, lastTransitionTime: "2027-01-15T09:00:00Z"}
- {type: Evicted, status: "True", reason: Preempted, message: x, lastTransitionTime: "2027-01-15T09:00:00Z"}
"#,
    );
    assert!(queue::release_patch(&given_back, &now()).is_none());
}

#[test]
fn a_finished_job_marks_its_workload_finished_once() {
    let workload = workload_with(ADMITTED);
    let patch = serde_json::to_value(
        queue::finish_patch(&workload, true, "the launcher exited 0", &now()).unwrap(),
    )
    .unwrap();
    let conditions = patch[1]["value"].as_array().unwrap();
    let finished = conditions.iter().find(|c| c["type"] == "Finished").unwrap();
    assert_eq!(
        (
            &finished["status"],
            &finished["reason"],
            &finished["message"]
        ),
        (
            &json!("True"),
            &json!("Succeeded"),
            &json!("the launcher exited 0")
        )
    );
    let mut done = serde_json::to_value(&workload).unwrap();
    done["status"]["conditions"]
        .as_array_mut()
        .unwrap()
        .push(finished.clone());
    let done: Workload = serde_json::from_value(done).unwrap();
    assert!(queue::finish_patch(&done, false, "x", &now()).is_none());
}

#[test]
fn only_a_change_of_run_policy_suspend_is_carried_onto_the_workload() {
    let workload = workload_with(ADMITTED); // made with suspend false
    assert_eq!(queue::activation_patch(&workload, false), None);
    assert_eq!(
        queue::activation_patch(&workload, true),
        Some(json!({
            "metadata": {"annotations": {queue::SUSPEND_ANNOTATION: "true"}},
            "spec": {"active": false},
        }))
    );
    // Kueue deactivated it on its own (its annotation still says suspend false): left so.
    let mut deactivated = workload.clone();
    deactivated.spec.active = Some(false);
    assert_eq!(queue::activation_patch(&deactivated, false), None);
}

#[test]
fn a_deactivated_workload_active_again_is_queued_and_a_preempted_one_says_preempted_until_readmitted()
 {
    let released = |reason: &str, active: bool| {
        let mut workload = workload_with(&format!(
            r#"
conditions:
- {{type: QuotaReserved, status: "False", reason: Pending, message: x, lastTransitionTime: "2027-01-15T09:00:00Z"}}
- {{type: Evicted, status: "True", reason: {reason}, message: "The workload is deactivated", lastTransitionTime: "2027-01-15T09:00:00Z"}}
"#
        ));
        workload.spec.active = Some(active);
        workload
    };
    assert!(matches!(
        queue::state("gpus", Some(&released("Deactivated", true)), flavors),
        QueueState::Waiting { .. }
    ));
    assert!(matches!(
        queue::state("gpus", Some(&released("Deactivated", false)), flavors),
        QueueState::Evicted {
            reason: "Deactivated",
            ..
        }
    ));
    assert!(matches!(
        queue::state("gpus", Some(&released("Preempted", true)), flavors),
        QueueState::Evicted {
            reason: "Preempted",
            ..
        }
    ));
}

#[test]
fn pods_ready_is_kept_as_kueues_job_controllers_keep_it() {
    let reason = |patch: Option<json_patch::Patch>| {
        let patch = serde_json::to_value(patch?).unwrap();
        let conditions = patch[1]["value"].as_array().unwrap().clone();
        let c = conditions
            .iter()
            .find(|c| c["type"] == "PodsReady")
            .unwrap();
        Some((
            c["status"].as_str().unwrap().to_string(),
            c["reason"].as_str().unwrap().to_string(),
        ))
    };
    let admitted = workload_with(ADMITTED);
    assert_eq!(
        reason(queue::pods_ready_patch(&admitted, false, &now())),
        Some(("False".into(), "WaitForStart".into()))
    );
    assert_eq!(
        reason(queue::pods_ready_patch(&admitted, true, &now())),
        Some(("True".into(), "Started".into()))
    );
    let with = |status: &str, why: &str| {
        let mut w = serde_json::to_value(workload_with(ADMITTED)).unwrap();
        w["status"]["conditions"].as_array_mut().unwrap().push(json!(
            {"type": "PodsReady", "status": status, "reason": why, "message": "m", "lastTransitionTime": "2027-01-15T08:00:00Z"}));
        serde_json::from_value::<Workload>(w).unwrap()
    };
    // Said already: nothing to write.
    assert_eq!(
        reason(queue::pods_ready_patch(
            &with("True", "Started"),
            true,
            &now()
        )),
        None
    );
    assert_eq!(
        reason(queue::pods_ready_patch(
            &with("False", "WaitForStart"),
            false,
            &now()
        )),
        None
    );
    // A gang that ran and lost a pod recovers.
    assert_eq!(
        reason(queue::pods_ready_patch(
            &with("True", "Started"),
            false,
            &now()
        )),
        Some(("False".into(), "WaitForRecovery".into()))
    );
    assert_eq!(
        reason(queue::pods_ready_patch(
            &with("False", "WaitForRecovery"),
            true,
            &now()
        )),
        Some(("True".into(), "Recovered".into()))
    );
    // Not admitted: nothing, unless a True is left over.
    assert_eq!(
        reason(queue::pods_ready_patch(
            &workload_with(PREEMPTED),
            false,
            &now()
        )),
        None
    );
}

#[test]
fn a_workload_is_outdated_when_the_pods_would_ask_for_something_else() {
    let job = validated(&sample());
    let existing = queue::workload(&job, "gpus", &BuildInputs::default(), None);
    assert!(!queue::outdated(&existing, &existing.clone()));
    let mut bigger = sample();
    bigger["spec"]["worker"] = json!({"resources": {"requests": {"cpu": "90"}}});
    let desired = queue::workload(&validated(&bigger), "gpus", &BuildInputs::default(), None);
    assert!(queue::outdated(&existing, &desired));
}

/// Kueue counts a pod's init containers and sidecars too: their requests (defaulted from
/// their limits, as the API server defaults a pod's) are in the pod set's template, and a
/// change of them makes the Workload outdated.
#[test]
fn a_workloads_pod_sets_count_the_users_init_containers_and_sidecars() {
    let with_sidecar = |memory: &str| {
        let mut job = sample();
        job["spec"]["worker"] = json!({
            "initContainers": [{"name": "log-shipper", "image": "fluent-bit:3", "restartPolicy": "Always",
                                "resources": {"limits": {"memory": memory}}}],
            "containers": [{"name": "exporter", "image": "busybox:1.36",
                            "resources": {"requests": {"cpu": "100m"}}}],
        });
        queue::workload(&validated(&job), "gpus", &BuildInputs::default(), None)
    };
    let existing = with_sidecar("1Gi");
    let value = serde_json::to_value(&existing).unwrap();
    let worker = &value["spec"]["podSets"][0]["template"]["spec"];
    assert_eq!(
        worker["initContainers"][0]["resources"]["requests"]["memory"],
        "1Gi"
    );
    assert_eq!(
        worker["containers"][1]["resources"]["requests"]["cpu"],
        "100m"
    );
    assert!(!queue::outdated(&existing, &with_sidecar("1Gi")));
    assert!(queue::outdated(&existing, &with_sidecar("2Gi")));
}

/// Kueue matches a pod set's required node affinity against its flavors' node labels: a
/// change of the workers' affinity makes the Workload outdated.
#[test]
fn a_workload_is_outdated_when_the_workers_affinity_changes() {
    let in_zone = |zone: &str| {
        let mut job = sample();
        job["spec"]["worker"] = json!({"affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": [zone]}]}
        ]}}}});
        queue::workload(&validated(&job), "gpus", &BuildInputs::default(), None)
    };
    let existing = in_zone("eastus-1");
    assert!(!queue::outdated(&existing, &in_zone("eastus-1")));
    assert!(queue::outdated(&existing, &in_zone("eastus-2")));
}

mod kueue_step {
    //! The Kueue sub-reconciler's decision (read → decide → write): what it writes, pure.
    use super::*;
    use ringmaster::controller::training_job::admission::{
        Facts, KueueDecision, KueueSeen, WorkloadWrite, decide,
    };
    use std::sync::Arc;

    fn seen(queue: Option<&str>, workload: Option<Workload>) -> KueueSeen {
        KueueSeen {
            queue: queue.map(str::to_string),
            integration: true,
            workload: workload.map(Arc::new),
        }
    }

    fn owned(mut workload: Workload, uid: &str) -> Workload {
        workload.metadata.owner_references = Some(vec![
            k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
                api_version: "ringmaster.dev/v1alpha1".into(),
                kind: "TrainingJob".into(),
                name: "resnet50-queued".into(),
                uid: uid.into(),
                controller: Some(true),
                ..Default::default()
            },
        ]);
        workload
    }

    #[test]
    fn a_queued_job_gets_its_workload_once_its_data_is_there() {
        let job = validated(&sample());
        let inputs = BuildInputs::default();
        let make = decide(&seen(Some("gpus"), None), &job, &inputs, Facts::default());
        assert_eq!(
            make,
            KueueDecision::Queued {
                queue: "gpus".into(),
                write: Some(WorkloadWrite::Make {
                    queue: "gpus".into()
                }),
            }
        );
        let waiting = Facts {
            data_waiting: true,
            ..Facts::default()
        };
        let held = decide(&seen(Some("gpus"), None), &job, &inputs, waiting);
        assert_eq!(
            held,
            KueueDecision::Queued {
                queue: "gpus".into(),
                write: None
            },
            "no quota held while the data is not there"
        );
    }

    #[test]
    fn a_workload_of_an_earlier_job_or_without_the_label_or_the_integration_is_not_used() {
        let job = validated(&sample());
        let inputs = BuildInputs::default();
        let earlier = owned(workload_with(ADMITTED), "an-earlier-uid");
        assert!(matches!(
            decide(
                &seen(Some("gpus"), Some(earlier)),
                &job,
                &inputs,
                Facts::default()
            ),
            KueueDecision::EarlierJobs { .. }
        ));
        let ours = owned(workload_with(ADMITTED), &job.uid);
        assert_eq!(
            decide(
                &seen(None, Some(ours.clone())),
                &job,
                &inputs,
                Facts::default()
            ),
            KueueDecision::NotQueued {
                write: Some(WorkloadWrite::Delete)
            },
            "the label taken off: the quota goes with the Workload"
        );
        let mut off = seen(Some("gpus"), Some(ours));
        off.integration = false;
        assert_eq!(
            decide(&off, &job, &inputs, Facts::default()),
            KueueDecision::IntegrationOff {
                queue: "gpus".into()
            }
        );
    }

    #[test]
    fn a_suspended_job_deactivates_its_workload_and_a_new_queue_moves_it() {
        let mut object = sample();
        object["spec"]["runPolicy"]["suspend"] = json!(true);
        let job = validated(&object);
        let ours = owned(workload_with("conditions: []"), &job.uid);
        let decision = decide(
            &seen(Some("other-queue"), Some(ours)),
            &job,
            &BuildInputs::default(),
            Facts::default(),
        );
        let KueueDecision::Queued {
            write: Some(WorkloadWrite::Patch(patch)),
            ..
        } = decision
        else {
            panic!("a patch: {decision:?}")
        };
        assert_eq!(patch["spec"]["active"], false);
        assert_eq!(patch["spec"]["queueName"], "other-queue");
    }
}
