//! The TrainingJob state machine (plan + status), from a sample job and made-up pods.

#[path = "common/mod.rs"]
mod fixtures;

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use ringmaster::api::{TrainingJobPhase as Phase, TrainingJobStatus};
use ringmaster::controller::training_job::condition_names::{condition_types, reasons};
use ringmaster::controller::training_job::names;
use ringmaster::controller::training_job::observe::{Observed, PodRef};
use ringmaster::controller::training_job::plan::{self, Plan, PlanInputs};
use ringmaster::controller::training_job::recent::RecentJob;
use ringmaster::controller::training_job::state::{
    self, DataState, Placement, PoolState, QueueState,
};
use ringmaster::controller::training_job::status;
use ringmaster::controller::training_job::validate::{ValidatedTrainingJob, validate_value};
use ringmaster::controller::training_job::worker_dns::{Published, WorkerAddress};
use serde_json::{Value, json};

fn job(edit: impl FnOnce(&mut Value)) -> ValidatedTrainingJob {
    let path = fixtures::root().join("config/samples/trainingjob-cpu-small.yaml");
    let mut object = fixtures::ringmaster_objects(&path).remove(0);
    object["metadata"]["namespace"] = json!("ml");
    object["metadata"]["uid"] = json!("uid-1");
    edit(&mut object);
    validate_value(&object, None).unwrap()
}

fn at(seconds: i64) -> Time {
    Time(Timestamp::from_second(1_800_000_000 + seconds).unwrap())
}

/// A pod of role `role` in `attempt`, in `state`: "pending", "unschedulable", "running",
/// "ready", "deleting", "succeeded:<json>", "failed:<code>:<reason>[:<finished at>]",
/// "evicted" or "waiting:<kubelet's reason>:<message>" (pending, its container waiting).
fn pod(role: &str, index: u32, attempt: i32, state: &str) -> Pod {
    let name = match role {
        "launcher" => names::launcher_pod("resnet18-cpu", attempt),
        _ => format!("resnet18-cpu-worker-{index}"),
    };
    let mut labels = json!({"ringmaster.dev/job-name": "resnet18-cpu", "ringmaster.dev/role": role, "ringmaster.dev/attempt": attempt.to_string()});
    if role == "worker" {
        labels["ringmaster.dev/worker-index"] = json!(index.to_string());
    }
    let terminated = |code: i64, reason: &str, message: &str| {
        json!([{"name": "c", "image": "i", "ready": false, "restartCount": 0,
                "state": {"terminated": {"exitCode": code, "reason": reason, "message": message}}}])
    };
    let status = match state.split(':').collect::<Vec<_>>().as_slice() {
        ["pending"] => json!({"phase": "Pending"}),
        ["unschedulable"] => {
            json!({"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/6 nodes are available: 6 Insufficient cpu."}]})
        }
        ["running"] | ["deleting"] => {
            json!({"phase": "Running", "conditions": [{"type": "Ready", "status": "False"}]})
        }
        ["ready"] => {
            json!({"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]})
        }
        ["succeeded", ..] => {
            json!({"phase": "Succeeded", "containerStatuses": terminated(0, "Completed", &state["succeeded:".len()..])})
        }
        ["failed", code, reason] => {
            json!({"phase": "Failed", "containerStatuses": terminated(code.parse().unwrap(), reason, "")})
        }
        // Also when it ended, in seconds on the scenario's clock.
        ["failed", code, reason, finished] => {
            let mut statuses = terminated(code.parse().unwrap(), reason, "");
            statuses[0]["state"]["terminated"]["finishedAt"] =
                json!(at(finished.parse().unwrap()).0.to_string());
            json!({"phase": "Failed", "containerStatuses": statuses})
        }
        ["waiting", reason, message @ ..] => {
            json!({"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}],
                   "containerStatuses": [{"name": "c", "image": "i", "ready": false, "restartCount": 0,
                       "state": {"waiting": {"reason": reason, "message": message.join(":")}}}]})
        }
        ["evicted"] => {
            json!({"phase": "Failed", "reason": "Evicted", "containerStatuses": terminated(137, "ContainerStatusUnknown", "")})
        }
        other => panic!("unknown state {other:?}"),
    };
    let mut pod =
        json!({"metadata": {"name": name, "namespace": "ml", "labels": labels}, "status": status});
    if state == "deleting" {
        pod["metadata"]["deletionTimestamp"] = json!("2027-01-15T08:00:00Z");
    }
    serde_json::from_value(pod).unwrap()
}

struct Scenario {
    job: ValidatedTrainingJob,
    status: TrainingJobStatus,
    pods: Vec<Pod>,
    data: DataState,
    pool: PoolState,
    queue: QueueState,
    now: Time,
    names_in_use: BTreeMap<String, state::NameHolder>,
    recent: RecentJob,
    /// What the job's EndpointSlice holds.
    published: Option<Published>,
}

impl Scenario {
    fn new(job: ValidatedTrainingJob) -> Self {
        Self {
            job,
            status: TrainingJobStatus::default(),
            pods: Vec::new(),
            data: DataState::NotNeeded,
            pool: PoolState::NotNeeded,
            queue: QueueState::NotQueued,
            now: at(0),
            names_in_use: BTreeMap::new(),
            recent: RecentJob::default(),
            published: None,
        }
    }

    fn pods(mut self, pods: Vec<Pod>) -> Self {
        self.pods = pods;
        self
    }

    fn plan(&self) -> Plan {
        let refs: Vec<&Pod> = self.pods.iter().collect();
        let mut observed = Observed::sort(&refs, self.job.workers, self.status.restarts);
        observed.published = self.published.clone();
        plan::plan(&PlanInputs {
            job: &self.job,
            generation: Some(1),
            status: &self.status,
            observed: &observed,
            data: &self.data,
            pool: &self.pool,
            queue: &self.queue,
            now: &self.now,
            restart_backoff: Duration::from_secs(10),
            names_in_use: &self.names_in_use,
            recent: &self.recent,
        })
    }

    /// Plans, then takes the resulting status as the next one (as the controller does).
    fn step(&mut self) -> Plan {
        let plan = self.plan();
        let refs: Vec<&Pod> = self.pods.iter().collect();
        let observed = Observed::sort(&refs, self.job.workers, self.status.restarts);
        self.status = status::from_plan(&self.status, Some(1), &plan, &observed, &self.now);
        plan
    }

    fn condition(&self, type_: &str) -> (String, String, String) {
        let c = self
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == type_)
            .unwrap_or_else(|| panic!("no {type_}"));
        (c.status.clone(), c.reason.clone(), c.message.clone())
    }
}

/// Worker pod `pod` with IP `ip`.
fn with_ip(mut pod: Pod, ip: &str) -> Pod {
    pod.status.as_mut().unwrap().pod_ip = Some(ip.into());
    pod
}

/// The workers' DNS records are written once per gang: when every worker has its IP (before
/// they are ready: readiness is ssh to the worker's own name), not at each worker's change;
/// again only when a record is no longer a worker's; never for a finished job.
#[test]
fn the_workers_names_are_published_once_every_worker_has_its_ip() {
    let mut s = Scenario::new(job(|_| {}));
    s.pods = vec![
        with_ip(pod("worker", 0, 0, "running"), "10.0.0.1"),
        pod("worker", 1, 0, "pending"),
    ];
    assert_eq!(s.plan().publish, None, "worker 1 has no IP yet");
    s.pods[1] = with_ip(pod("worker", 1, 0, "running"), "10.0.0.2");
    let records = vec![
        WorkerAddress {
            hostname: "resnet18-cpu-worker-0".into(),
            ip: "10.0.0.1".into(),
        },
        WorkerAddress {
            hostname: "resnet18-cpu-worker-1".into(),
            ip: "10.0.0.2".into(),
        },
    ];
    let p = s.plan();
    let service = names::worker_service(&s.job, p.naming);
    assert_eq!(
        p.publish,
        Some(Published {
            service: service.clone(),
            addresses: records.clone()
        })
    );
    assert!(!p.create_launcher, "not ready yet: the launcher waits");

    s.published = Some(Published {
        service,
        addresses: records.clone(),
    });
    s.pods = vec![
        with_ip(pod("worker", 0, 0, "ready"), "10.0.0.1"),
        with_ip(pod("worker", 1, 0, "ready"), "10.0.0.2"),
    ];
    let p = s.plan();
    assert_eq!((p.publish, p.create_launcher), (None, true));

    // Worker 1 deleted: its record goes at once (its IP may soon be another pod's).
    s.pods[1] = with_ip(pod("worker", 1, 0, "deleting"), "10.0.0.2");
    assert_eq!(
        s.plan().publish.map(|p| p.addresses),
        Some(records[..1].to_vec())
    );

    // A finished job writes nothing, whatever its slice holds.
    s.pods = vec![pod("launcher", 0, 0, "succeeded:{}")];
    s.status.phase = Phase::Succeeded;
    assert_eq!(s.plan().publish, None);
}

#[test]
fn a_job_starts_workers_then_the_launcher_then_runs() {
    let mut s = Scenario::new(job(|_| {}));
    let p = s.step();
    assert_eq!(
        (p.phase, p.create_workers.clone(), p.create_launcher),
        (Phase::Starting, vec![0, 1], false)
    );
    assert_eq!(s.condition(condition_types::RECONCILING).0, "True");

    s.pods = vec![pod("worker", 0, 0, "ready"), pod("worker", 1, 0, "running")];
    let p = s.step();
    assert!(
        p.create_workers.is_empty() && !p.create_launcher,
        "launcher waits for every worker"
    );
    assert_eq!(
        s.condition(condition_types::WORKERS_READY),
        (
            "False".into(),
            reasons::STARTING.into(),
            "1/2 workers ready".into()
        )
    );

    s.pods = vec![pod("worker", 0, 0, "ready"), pod("worker", 1, 0, "ready")];
    s.now = at(5);
    let p = s.step();
    assert!(p.create_launcher);
    assert_eq!(s.status.start_time, Some(at(5)));

    s.pods.push(pod("launcher", 0, 0, "running"));
    let p = s.step();
    assert_eq!(p.phase, Phase::Running);
    assert_eq!(s.condition(condition_types::READY).0, "True");
    assert_eq!(s.condition(condition_types::RECONCILING).0, "False");
    assert_eq!(
        (s.status.workers.ready, s.status.launcher.as_deref()),
        (2, Some("Running"))
    );
}

#[test]
fn success_reads_the_trainers_summary_and_cleans_running_pods() {
    let mut s = Scenario::new(job(|_| {})).pods(vec![
        pod("worker", 0, 0, "ready"),
        pod("worker", 1, 0, "ready"),
        pod(
            "launcher",
            0,
            0,
            // What the trainer's launcher wrapper writes: the contract's summary line.
            &format!(
                "succeeded:{}",
                ringmaster_contract::trainer::Summary {
                    images_per_second: 812.5,
                    steps: 20,
                    final_loss: Some(2.125),
                    final_accuracy: Some(0.5),
                    world_size: 4,
                    global_batch: 64,
                    parameters: 11_689_512,
                    seconds: 12.0,
                    resumed_from_step: None,
                    resumed_from_run: None,
                }
                .to_line()
            ),
        ),
    ]);
    let p = s.step();
    assert_eq!(p.phase, Phase::Succeeded);
    let result = s.status.result.clone().unwrap();
    assert_eq!(
        (result.images_per_second, result.steps, result.final_loss),
        (Some(812.5), Some(20), Some(2.125))
    );
    assert_eq!(
        p.delete_pods,
        vec!["resnet18-cpu-worker-0", "resnet18-cpu-worker-1"],
        "running workers go, the launcher stays for its logs"
    );
    assert_eq!(s.condition(condition_types::SUCCEEDED).0, "True");
    assert_eq!(s.condition(condition_types::READY).0, "True");
    assert!(s.status.completion_time.is_some());
    // Finished stays finished.
    s.pods.clear();
    let p = s.step();
    assert_eq!((p.phase, p.create_workers.len()), (Phase::Succeeded, 0));
}

#[test]
fn an_oom_killed_worker_restarts_the_gang_then_exhausts_the_backoff_limit() {
    let mut s =
        Scenario::new(job(|o| o["spec"]["runPolicy"]["backoffLimit"] = json!(1))).pods(vec![
            pod("worker", 0, 0, "ready"),
            pod("worker", 1, 0, "failed:137:OOMKilled"),
            // The launcher fails because its peer died; the worker is the cause.
            pod("launcher", 0, 0, "failed:1:Error"),
        ]);
    s.pods[1].metadata.uid = Some("uid-of-worker-1".into());
    let p = s.step();
    assert_eq!((p.phase, p.restarts), (Phase::Restarting, 1));
    assert_eq!(
        p.delete_pods,
        ["resnet18-cpu-worker-0", "resnet18-cpu-worker-1"],
        "the failed launcher stays, with its log"
    );
    // The restart's Event is about the failed worker (its related object).
    assert_eq!(
        p.about,
        Some(PodRef {
            name: "resnet18-cpu-worker-1".into(),
            uid: Some("uid-of-worker-1".into())
        })
    );
    let (_, reason, message) = s.condition(condition_types::RESTARTING);
    assert_eq!(reason, reasons::RESTARTING);
    assert!(
        message.contains("worker resnet18-cpu-worker-1 exited with code 137 (OOMKilled)"),
        "{message}"
    );

    // Old pods terminating: nothing new until they are gone, and the backoff is waited out.
    s.pods = vec![pod("worker", 0, 0, "deleting")];
    let p = s.step();
    assert!(p.create_workers.is_empty());
    s.pods.clear();
    s.now = at(5);
    let p = s.step();
    assert_eq!((p.phase, p.create_workers.len()), (Phase::Restarting, 0));
    assert!(p.requeue_after.unwrap() <= Duration::from_secs(5));
    s.now = at(11);
    let p = s.step();
    assert_eq!(
        (p.phase, p.create_workers.clone()),
        (Phase::Starting, vec![0, 1])
    );

    // The new gang (attempt 1) fails too: the limit of 1 restart is used up.
    s.pods = vec![pod("worker", 0, 1, "evicted"), pod("worker", 1, 1, "ready")];
    let p = s.step();
    assert_eq!(p.phase, Phase::Failed);
    assert_eq!(p.about, Some(PodRef::named("resnet18-cpu-worker-0")));
    let (status, reason, message) = s.condition(condition_types::FAILED);
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("True", reasons::BACKOFF_LIMIT_EXCEEDED)
    );
    assert!(
        message.contains("resnet18-cpu-worker-0") && message.contains("Evicted"),
        "{message}"
    );
    assert_eq!(s.condition(condition_types::STALLED).0, "True");
    assert_eq!(s.condition(condition_types::READY).0, "False");
}

#[test]
fn a_permanent_launcher_failure_fails_at_once_and_a_killed_launcher_is_retried() {
    let ready = || vec![pod("worker", 0, 0, "ready"), pod("worker", 1, 0, "ready")];
    let mut s = Scenario::new(job(|_| {}))
        .pods([ready(), vec![pod("launcher", 0, 0, "failed:2:Error")]].concat());
    let p = s.step();
    assert_eq!((p.phase, p.restarts), (Phase::Failed, 0));
    assert_eq!(
        s.condition(condition_types::FAILED).1,
        reasons::LAUNCHER_FAILED
    );

    let mut s = Scenario::new(job(|_| {}))
        .pods([ready(), vec![pod("launcher", 0, 0, "failed:143:Error")]].concat());
    assert_eq!(s.step().phase, Phase::Restarting);
}

/// The launcher failed with `message` as its termination message.
fn failed_launcher(code: i64, message: &str) -> Pod {
    let mut launcher = pod("launcher", 0, 0, &format!("failed:{code}:Error"));
    let statuses = launcher
        .status
        .as_mut()
        .unwrap()
        .container_statuses
        .as_mut();
    statuses.unwrap()[0]
        .state
        .as_mut()
        .unwrap()
        .terminated
        .as_mut()
        .unwrap()
        .message = Some(message.into());
    launcher
}

#[test]
fn a_failed_job_says_the_failing_ranks_error_not_mpiruns_report() {
    use ringmaster_contract::trainer::Failure;
    let ready = || vec![pod("worker", 0, 0, "ready"), pod("worker", 1, 0, "ready")];
    let broken = Failure {
        rank: Some(2),
        error: "decoding /data/train/n01440764/x.jpg: invalid JPEG format".into(),
        exit_code: 1,
    };
    let lost = Failure {
        rank: Some(3),
        error: "rank 2 (previous) is gone".into(),
        exit_code: 75,
    };
    let banner = "--------------------------------------------------------------------------\nmpirun detected that one or more processes exited with non-zero status, thus causing\nthe job to be terminated. The first process to do so was:\n\n  Process name: [[18831,1],2]\n  Exit code:    1\n--------------------------------------------------------------------------";
    // What `launch` writes (the failure line alone), and the log's tail the kubelet keeps
    // when nothing was written (the ranks' lines, then mpirun's report).
    for message in [
        broken.to_line(),
        format!("{}\n{}\n{banner}", lost.to_line(), broken.to_line()),
    ] {
        let mut s =
            Scenario::new(job(|_| {})).pods([ready(), vec![failed_launcher(1, &message)]].concat());
        assert_eq!(s.step().phase, Phase::Failed);
        let (_, reason, text) = s.condition(condition_types::FAILED);
        assert_eq!(reason, reasons::LAUNCHER_FAILED);
        assert_eq!(
            text,
            "launcher resnet18-cpu-launcher exited with code 1 (Error): rank 2: decoding /data/train/n01440764/x.jpg: invalid JPEG format (not retried: the program's own failure)"
        );
    }
    // No failure line (mpirun could not reach a worker): the log's tail, as before.
    let mut s = Scenario::new(job(|_| {})).pods(
        [
            ready(),
            vec![failed_launcher(
                1,
                &format!("ssh: connect to host w-1 port 22: Connection refused\n{banner}"),
            )],
        ]
        .concat(),
    );
    assert_eq!(s.step().phase, Phase::Failed);
    let text = s.condition(condition_types::FAILED).2;
    assert!(text.contains("Exit code:    1"), "{text}");
}

/// The preflight's verdict (exit 69 from every rank): the job fails at once with its own
/// reason and the trainer's words (the threshold, the slowest pair), and stays failed on the
/// next look; any other program failure keeps `LauncherFailed`.
#[test]
fn a_fabric_below_the_preflights_minimum_fails_the_job_with_its_own_reason_not_a_restart() {
    use ringmaster_contract::trainer::{Failure, exit};
    let ready = || vec![pod("worker", 0, 0, "ready"), pod("worker", 1, 0, "ready")];
    let slow = Failure {
        rank: Some(0),
        error: "the fabric is too slow: the preflight's all-reduce of 67108864 bytes per rank over 2 ranks (tcp-ring) reached a bus bandwidth of 0.500 GB/s, below the minimum of 10000 GB/s (infiniband.preflight.minBusBandwidthGbps, --preflight-min-bus-gbps); the slowest link is rank 1 → rank 0 (resnet18-cpu-worker-1 → resnet18-cpu-worker-0) at 0.480 GB/s".into(),
        exit_code: exit::FABRIC_TOO_SLOW,
    };
    let mut s = Scenario::new(job(|o| {
        o["spec"]["infiniband"] =
            json!({"enabled": false, "preflight": {"minBusBandwidthGbps": 10000}});
    }))
    .pods(
        [
            ready(),
            vec![failed_launcher(
                i64::from(exit::FABRIC_TOO_SLOW),
                &slow.to_line(),
            )],
        ]
        .concat(),
    );
    let p = s.step();
    assert_eq!((p.phase, p.restarts), (Phase::Failed, 0));
    let (status, reason, text) = s.condition(condition_types::FAILED);
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("True", reasons::PREFLIGHT_FAILED)
    );
    assert!(
        text.contains("exited with code 69")
            && text.contains("below the minimum of 10000 GB/s")
            && text.contains(
                "slowest link is rank 1 → rank 0 (resnet18-cpu-worker-1 → resnet18-cpu-worker-0)"
            )
            && text.contains("not retried: the fabric is below infiniband.preflight's minimum"),
        "{text}"
    );
    // The next look at the finished job keeps the reason.
    s.step();
    assert_eq!(
        s.condition(condition_types::FAILED).1,
        reasons::PREFLIGHT_FAILED
    );
}

#[test]
fn a_deleted_worker_of_a_running_gang_restarts_it() {
    let mut s = Scenario::new(job(|_| {})).pods(vec![
        pod("worker", 0, 0, "ready"),
        pod("launcher", 0, 0, "running"),
    ]);
    let p = s.step();
    assert_eq!(p.phase, Phase::Restarting);
    assert!(
        s.condition(condition_types::RESTARTING)
            .2
            .contains("resnet18-cpu-worker-1 was deleted")
    );
}

#[test]
fn suspend_deletes_every_pod_and_resume_starts_again() {
    let mut s = Scenario::new(job(|o| o["spec"]["runPolicy"]["suspend"] = json!(true))).pods(vec![
        pod("worker", 0, 0, "ready"),
        pod("worker", 1, 0, "ready"),
        pod("launcher", 0, 0, "running"),
    ]);
    let p = s.step();
    assert_eq!((p.phase, p.delete_pods.len()), (Phase::Suspended, 3));
    assert_eq!(s.condition(condition_types::SUSPENDED).0, "True");
    assert_eq!(s.condition(condition_types::READY).0, "False");
    assert_eq!(s.condition(condition_types::STALLED).0, "False");

    s.job = job(|_| {});
    s.pods.clear();
    let p = s.step();
    assert_eq!(
        (p.phase, p.create_workers.len(), p.restarts),
        (Phase::Starting, 2, 0)
    );
    assert_eq!(s.condition(condition_types::SUSPENDED).0, "False");
}

#[test]
fn the_deadline_fails_a_running_job_and_the_ttl_deletes_it() {
    let mut s = Scenario::new(job(|o| {
        o["spec"]["runPolicy"]["activeDeadlineSeconds"] = json!(60);
        o["spec"]["runPolicy"]["ttlSecondsAfterFinished"] = json!(30);
    }))
    .pods(vec![
        pod("worker", 0, 0, "ready"),
        pod("worker", 1, 0, "ready"),
        pod("launcher", 0, 0, "running"),
    ]);
    s.status.start_time = Some(at(0));
    s.now = at(30);
    let p = s.step();
    assert_eq!(p.phase, Phase::Running);
    assert_eq!(p.requeue_after, Some(Duration::from_secs(30)));
    s.now = at(61);
    let p = s.step();
    assert_eq!(p.phase, Phase::Failed);
    assert_eq!(
        s.condition(condition_types::FAILED).1,
        reasons::DEADLINE_EXCEEDED
    );
    assert_eq!(p.delete_pods.len(), 3, "running pods are stopped");
    assert!(!p.delete_job);
    s.now = at(95);
    assert!(s.step().delete_job);
}

#[test]
fn the_result_keeps_images_per_second_to_a_tenth_as_kubectl_shows_it() {
    let line = ringmaster_contract::trainer::Summary {
        images_per_second: 23.382011933831738,
        steps: 20,
        final_loss: Some(2.125),
        final_accuracy: None,
        world_size: 4,
        global_batch: 64,
        parameters: 11_689_512,
        seconds: 12.0,
        resumed_from_step: None,
        resumed_from_run: None,
    }
    .to_line();
    let result = plan::parse_result(&line).unwrap();
    assert_eq!(result.images_per_second, Some(23.4));
    assert_eq!(result.final_loss, Some(2.125), "the loss is left as it is");
    assert_eq!(result.resumed_from_step, None);
}

#[test]
fn the_result_says_where_a_trainer_that_started_again_went_on_from() {
    // As rank 0 writes it when it resumed from the job's checkpoint.
    let line = r#"{"event":"summary","imagesPerSecond":812.5,"steps":20,"finalLoss":2.125,"finalAccuracy":0.5,"worldSize":4,"globalBatch":64,"parameters":11689512,"seconds":12.0,"resumedFromStep":12}"#;
    let result = plan::parse_result(line).unwrap();
    assert_eq!(result.resumed_from_step, Some(12));
    assert_eq!(result.steps, Some(20));
    assert_eq!(result.resumed_from_run, None, "its own checkpoint");
    // As rank 0 writes it when it went on from an earlier job's (trainer.resumeFrom).
    let line = r#"{"event":"summary","imagesPerSecond":812.5,"steps":20,"finalLoss":2.125,"finalAccuracy":0.5,"worldSize":4,"globalBatch":64,"parameters":11689512,"seconds":12.0,"resumedFromStep":12,"resumedFromRun":"5d1c7a2e-8b4f-4e0a-9c3d-2f6e1b7a9c40"}"#;
    let result = plan::parse_result(line).unwrap();
    assert_eq!(result.resumed_from_step, Some(12));
    assert_eq!(
        result.resumed_from_run.as_deref(),
        Some("5d1c7a2e-8b4f-4e0a-9c3d-2f6e1b7a9c40")
    );
}

#[test]
fn unschedulable_workers_say_why() {
    let mut s = Scenario::new(job(|_| {})).pods(vec![
        pod("worker", 0, 0, "ready"),
        pod("worker", 1, 0, "unschedulable"),
    ]);
    let p = s.step();
    assert_eq!(p.phase, Phase::Starting);
    assert_eq!(p.about, Some(PodRef::named("resnet18-cpu-worker-1")));
    let (status, reason, message) = s.condition(condition_types::WORKERS_READY);
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", reasons::UNSCHEDULABLE)
    );
    assert!(
        message.contains("resnet18-cpu-worker-1") && message.contains("Insufficient cpu"),
        "{message}"
    );
}

/// The kubelet's words for an image it cannot pull, first and on retry.
const PULL_FAILED: &str = "waiting:ErrImagePull:failed to pull and unpack image \"ringmaster.local/trainer:typo\": not found";
const PULL_BACKOFF: &str =
    "waiting:ImagePullBackOff:Back-off pulling image \"ringmaster.local/trainer:typo\"";

#[test]
fn a_worker_whose_image_cannot_be_pulled_blocks_the_job_and_says_which_image() {
    let mut s = Scenario::new(job(|_| {})).pods(vec![
        pod("worker", 0, 0, "ready"),
        pod("worker", 1, 0, PULL_FAILED),
    ]);
    let p = s.step();
    assert_eq!((p.phase, p.create_launcher), (Phase::Starting, false));
    let (status, reason, message) = s.condition(condition_types::WORKERS_READY);
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", reasons::IMAGE_PULL_FAILED)
    );
    assert!(
        message.starts_with("worker resnet18-cpu-worker-1 cannot start (ErrImagePull): ")
            && message.contains("ringmaster.local/trainer:typo"),
        "{message}"
    );
    // Ready says the same, so `kubectl get`, `kubectl wait` and Flux show the block.
    let (ready, ready_reason, ready_message) = s.condition(condition_types::READY);
    assert_eq!(
        (
            ready.as_str(),
            ready_reason.as_str(),
            ready_message.as_str()
        ),
        ("False", reasons::IMAGE_PULL_FAILED, message.as_str())
    );
    assert_eq!(
        s.condition(condition_types::STALLED).0,
        "False",
        "the kubelet keeps trying"
    );

    // The kubelet's retries alternate its reason; the condition's reason holds still, so
    // only the words move (progress, written with the next write).
    let blocked = s.status.clone();
    s.pods[1] = pod("worker", 1, 0, PULL_BACKOFF);
    s.step();
    assert_eq!(
        s.condition(condition_types::WORKERS_READY).1,
        reasons::IMAGE_PULL_FAILED
    );
    assert!(status::is_progress_only(&blocked, &s.status));

    // Fixed (the image pushed): the worker runs and the block is gone.
    s.pods[1] = pod("worker", 1, 0, "ready");
    let p = s.step();
    assert!(p.create_launcher);
    assert_eq!(s.condition(condition_types::READY).1, reasons::STARTING);
}

#[test]
fn a_container_that_cannot_start_blocks_the_job_the_normal_waits_do_not() {
    let missing = "waiting:CreateContainerConfigError:secret \"wandb\" not found";
    let mut s = Scenario::new(job(|_| {})).pods(vec![
        pod("worker", 0, 0, "waiting:ContainerCreating:"),
        pod("worker", 1, 0, "waiting:ContainerCreating:"),
    ]);
    s.step();
    let before = s.status.clone();
    s.pods[0] = pod("worker", 0, 0, missing);
    s.step();
    let (_, reason, message) = s.condition(condition_types::WORKERS_READY);
    assert_eq!(reason, reasons::CONTAINER_CANNOT_START);
    assert!(
        message.contains("resnet18-cpu-worker-0")
            && message.contains("CreateContainerConfigError")
            && message.contains(r#"secret "wandb" not found"#),
        "{message}"
    );
    assert!(
        !status::is_progress_only(&before, &s.status),
        "a block is written at once"
    );

    // Creating containers is the normal way to Running: no block.
    let mut normal = Scenario::new(job(|_| {})).pods(vec![
        pod("worker", 0, 0, "waiting:ContainerCreating:"),
        pod("worker", 1, 0, "waiting:PodInitializing:"),
    ]);
    normal.step();
    assert_eq!(
        normal.condition(condition_types::WORKERS_READY).1,
        reasons::STARTING
    );
    assert_eq!(
        normal.condition(condition_types::READY).1,
        reasons::STARTING
    );
}

#[test]
fn the_pods_own_container_is_read_not_a_sidecar_listed_before_it() {
    // The kubelet lists container statuses by name: an injected istio-proxy comes first.
    let mut worker = serde_json::to_value(pod("worker", 1, 0, PULL_FAILED)).unwrap();
    let statuses = worker["status"]["containerStatuses"]
        .as_array_mut()
        .unwrap();
    statuses[0]["name"] = json!("worker");
    statuses.insert(
        0,
        json!({"name": "istio-proxy", "image": "i", "ready": true, "restartCount": 0,
               "state": {"running": {}}}),
    );
    let mut s = Scenario::new(job(|_| {})).pods(vec![
        pod("worker", 0, 0, "ready"),
        serde_json::from_value(worker).unwrap(),
    ]);
    s.step();
    assert_eq!(
        s.condition(condition_types::WORKERS_READY).1,
        reasons::IMAGE_PULL_FAILED
    );
}

#[test]
fn a_launcher_that_cannot_start_blocks_the_job_with_its_name() {
    let mut s = Scenario::new(job(|_| {})).pods(vec![
        pod("worker", 0, 0, "ready"),
        pod("worker", 1, 0, "ready"),
        pod(
            "launcher",
            0,
            0,
            "waiting:CreateContainerConfigError:couldn't find key token in Secret ml/hub",
        ),
    ]);
    let p = s.step();
    assert_eq!(p.phase, Phase::Starting);
    assert_eq!(s.condition(condition_types::WORKERS_READY).0, "True");
    let (ready, reason, message) = s.condition(condition_types::READY);
    assert_eq!(
        (ready.as_str(), reason.as_str()),
        ("False", reasons::CONTAINER_CANNOT_START)
    );
    assert!(
        message.starts_with("launcher resnet18-cpu-launcher cannot start (CreateContainerConfigError): couldn't find key token"),
        "{message}"
    );
    // An unschedulable launcher says so too.
    s.pods[2] = pod("launcher", 0, 0, "unschedulable");
    s.step();
    let (_, reason, message) = s.condition(condition_types::READY);
    assert_eq!(reason, reasons::UNSCHEDULABLE);
    assert!(
        message.starts_with("launcher resnet18-cpu-launcher cannot be scheduled: 0/6 nodes"),
        "{message}"
    );
}

#[test]
fn a_job_waits_for_its_data() {
    let mut s = Scenario::new(job(|_| {}));
    s.data = DataState::Waiting {
        message: "DataStage imagenet is Copying".into(),
        failed: false,
    };
    let p = s.step();
    assert_eq!(
        (p.phase, p.create_workers.len()),
        (Phase::WaitingForData, 0)
    );
    assert_eq!(
        s.condition(condition_types::DATA_READY).2,
        "DataStage imagenet is Copying"
    );
    assert_eq!(
        s.condition(condition_types::READY).1,
        reasons::WAITING_FOR_DATA
    );
    // A failed DataStage blocks the job until a person makes it again: Ready says so.
    let copying = s.status.clone();
    s.data = DataState::Waiting {
        message: "DataStage imagenet failed (the copy failed: the credential was refused)".into(),
        failed: true,
    };
    let p = s.step();
    assert_eq!(p.phase, Phase::WaitingForData);
    let (_, reason, message) = s.condition(condition_types::READY);
    assert_eq!(reason, reasons::DATA_STAGE_FAILED);
    assert!(message.contains("credential was refused"), "{message}");
    assert_eq!(
        s.condition(condition_types::DATA_READY).1,
        reasons::DATA_STAGE_FAILED
    );
    assert!(!status::is_progress_only(&copying, &s.status));
    s.data = DataState::Ready {
        claim: "imagenet".into(),
    };
    let p = s.step();
    assert_eq!((p.phase, p.create_workers.len()), (Phase::Starting, 2));
    assert_eq!(s.condition(condition_types::DATA_READY).0, "True");
}

#[test]
fn a_job_waits_for_its_node_pool_and_fails_with_azures_reason() {
    let mut s = Scenario::new(job(|_| {}));
    s.pool = PoolState::Provisioning {
        message: "agent pool resnet18a1b2 is Creating".into(),
    };
    let p = s.step();
    assert_eq!(
        (p.phase, p.create_workers.len()),
        (Phase::ProvisioningNodes, 0)
    );
    assert!(p.requeue_after.is_some(), "ARM is polled, not watched");
    let (status, reason, message) = s.condition(condition_types::NODES_READY);
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "ProvisioningNodes")
    );
    assert_eq!(message, "agent pool resnet18a1b2 is Creating");

    s.pool = PoolState::Ready {
        message: "agent pool resnet18a1b2: 2 nodes Ready".into(),
    };
    let p = s.step();
    assert_eq!((p.phase, p.create_workers.len()), (Phase::Starting, 2));
    assert_eq!(s.condition(condition_types::NODES_READY).0, "True");

    let mut failing = Scenario::new(job(|_| {}));
    failing.pool = PoolState::Failed {
        message: "Azure refused agent pool x: InsufficientVCPUQuota: no quota".into(),
    };
    let p = failing.step();
    assert_eq!(p.phase, Phase::Failed);
    let (_, reason, message) = failing.condition(condition_types::FAILED);
    assert_eq!(reason, "NodePoolFailed");
    assert!(message.contains("InsufficientVCPUQuota"));
    // Failed stays Failed with its reason on the next look.
    failing.step();
    assert_eq!(
        failing.condition(condition_types::FAILED).1,
        "NodePoolFailed"
    );
}

#[test]
fn pods_of_an_older_gang_are_deleted_before_new_ones_are_made() {
    let mut s = Scenario::new(job(|_| {})).pods(vec![
        pod("worker", 0, 0, "ready"),
        pod("worker", 1, 0, "ready"),
    ]);
    s.status.restarts = 1;
    let p = s.step();
    assert_eq!(
        p.delete_pods,
        vec!["resnet18-cpu-worker-0", "resnet18-cpu-worker-1"]
    );
    assert!(
        p.create_workers.is_empty(),
        "names are reused, so the old pods must be gone first"
    );
}

#[test]
fn the_same_observations_give_the_same_status() {
    let mut s = Scenario::new(job(|_| {})).pods(vec![
        pod("worker", 0, 0, "ready"),
        pod("worker", 1, 0, "ready"),
        pod("launcher", 0, 0, "running"),
    ]);
    s.step();
    let first = s.status.clone();
    s.now = at(100);
    s.step();
    assert_eq!(
        s.status, first,
        "no clock-only changes: a resync writes nothing"
    );
}

#[test]
fn a_launcher_that_lost_a_peer_waits_a_moment_for_the_worker_that_caused_it() {
    let ready = || vec![pod("worker", 0, 0, "ready"), pod("worker", 1, 0, "ready")];
    // The launcher ended 2 s ago with the lost-peer code; no worker has failed yet: no restart,
    // a look again when the 5 s are up.
    let mut s = Scenario::new(job(|_| {}))
        .pods([ready(), vec![pod("launcher", 0, 0, "failed:75:Error:0")]].concat());
    s.now = at(2);
    let p = s.plan();
    assert_eq!(p.restarts, 0);
    assert!(p.delete_pods.is_empty(), "{:?}", p.delete_pods);
    assert_eq!(p.requeue_after, Some(Duration::from_secs(3)));

    // The kubelet then reports worker 1 killed: the restart names it.
    let mut s = Scenario::new(job(|_| {})).pods(vec![
        pod("worker", 0, 0, "ready"),
        pod("worker", 1, 0, "failed:137:Error"),
        pod("launcher", 0, 0, "failed:75:Error:0"),
    ]);
    s.now = at(2);
    let p = s.step();
    assert_eq!((p.phase, p.restarts), (Phase::Restarting, 1));
    let (_, _, message) = s.condition(condition_types::RESTARTING);
    assert!(
        message.starts_with("worker resnet18-cpu-worker-1 exited with code 137 (Error)"),
        "{message}"
    );

    // No worker failed within the 5 s: the launcher is named.
    let mut s = Scenario::new(job(|_| {}))
        .pods([ready(), vec![pod("launcher", 0, 0, "failed:75:Error:0")]].concat());
    s.now = at(5);
    let p = s.step();
    assert_eq!((p.phase, p.restarts), (Phase::Restarting, 1));
    let (_, _, message) = s.condition(condition_types::RESTARTING);
    assert!(
        message.starts_with("launcher resnet18-cpu-launcher exited with code 75"),
        "{message}"
    );
}

#[test]
fn pods_of_an_earlier_job_of_the_same_name_are_waited_out_not_overwritten() {
    use state::NameHolder;
    let going = |name: &str| BTreeMap::from([(name.to_string(), NameHolder::Going)]);
    let mut p = Scenario::new(job(|_| {})).plan();
    assert_eq!(p.create_workers, vec![0, 1]);
    let before = p.clone();
    // The deleted job's worker 1 is still terminating: only worker 0 is made now, and the
    // job says nothing of it (it goes by itself).
    plan::hold_back_names_in_use(
        &mut p,
        "resnet18-cpu",
        &going("resnet18-cpu-worker-1"),
        None,
    );
    assert_eq!(p.create_workers, vec![0]);
    assert_eq!(p.requeue_after, Some(Duration::from_secs(1)));
    assert_eq!(
        (&p.conditions, &p.message),
        (&before.conditions, &before.message)
    );

    let ready = vec![pod("worker", 0, 0, "ready"), pod("worker", 1, 0, "ready")];
    let mut p = Scenario::new(job(|_| {})).pods(ready).plan();
    assert!(p.create_launcher);
    plan::hold_back_names_in_use(
        &mut p,
        "resnet18-cpu",
        &going("resnet18-cpu-launcher"),
        None,
    );
    assert!(!p.create_launcher);

    // Nothing held: the plan is unchanged.
    let mut p = Scenario::new(job(|_| {})).plan();
    let before = p.clone();
    plan::hold_back_names_in_use(&mut p, "resnet18-cpu", &Default::default(), None);
    assert_eq!(p, before);
}

#[test]
fn a_pod_name_held_by_a_pod_that_stays_blocks_the_job_visibly() {
    use state::NameHolder;
    let staying = |name: &str, controller: &str| {
        (
            name.to_string(),
            NameHolder::Staying {
                why: format!(
                    "a pod of that name exists that this job does not control (its \
                     controller: {controller}); delete or rename that pod, and the job goes on"
                ),
            },
        )
    };
    let mut p = Scenario::new(job(|_| {})).plan();
    let in_use = BTreeMap::from([
        staying("resnet18-cpu-worker-1", "none"),
        ("resnet18-cpu-worker-0".to_string(), NameHolder::Going),
    ]);
    plan::hold_back_names_in_use(&mut p, "resnet18-cpu", &in_use, None);
    assert!(p.create_workers.is_empty());
    // Worker 0's name is free again in a moment: looked at again then.
    assert_eq!(p.requeue_after, Some(Duration::from_secs(1)));
    assert_eq!(p.phase, Phase::Starting);
    let said = "worker resnet18-cpu-worker-1 cannot be made: a pod of that name exists that \
        this job does not control (its controller: none); delete or rename that pod, and the \
        job goes on";
    for type_ in [
        condition_types::READY,
        condition_types::RECONCILING,
        condition_types::WORKERS_READY,
    ] {
        let c = p.conditions.iter().find(|c| c.type_ == type_).unwrap();
        assert_eq!(
            (c.status, c.reason, c.message.as_str()),
            (
                type_ == condition_types::RECONCILING,
                reasons::NAME_IN_USE,
                said
            ),
            "{type_}"
        );
    }
    assert_eq!(p.message, said);
    assert_eq!(p.about, Some(PodRef::named("resnet18-cpu-worker-1")));
    assert!(reasons::BLOCKING.contains(&reasons::NAME_IN_USE));
    // Held by the staying pod alone, the job looks again after a while: that pod's deletion
    // does not wake it.
    let mut p = Scenario::new(job(|_| {})).plan();
    let in_use = BTreeMap::from([staying("resnet18-cpu-worker-1", "none")]);
    plan::hold_back_names_in_use(&mut p, "resnet18-cpu", &in_use, None);
    assert_eq!(p.create_workers, vec![0]);
    assert_eq!(p.requeue_after, Some(plan::NAME_IN_USE_RECHECK));

    // The launcher's name: the workers are ready, and stay so.
    let ready = vec![pod("worker", 0, 0, "ready"), pod("worker", 1, 0, "ready")];
    let mut p = Scenario::new(job(|_| {})).pods(ready).plan();
    let in_use = BTreeMap::from([staying("resnet18-cpu-launcher", "Deployment web")]);
    assert!(p.create_launcher && p.start_time.is_some());
    plan::hold_back_names_in_use(&mut p, "resnet18-cpu", &in_use, None);
    assert!(!p.create_launcher);
    // The job has not started: its deadline does not run.
    assert_eq!(p.start_time, None);
    let workers = p
        .conditions
        .iter()
        .find(|c| c.type_ == condition_types::WORKERS_READY)
        .unwrap();
    assert_eq!((workers.status, workers.reason), (true, reasons::RUNNING));
    let ready = p
        .conditions
        .iter()
        .find(|c| c.type_ == condition_types::READY)
        .unwrap();
    assert_eq!(ready.reason, reasons::NAME_IN_USE);
    assert!(
        ready
            .message
            .starts_with("launcher resnet18-cpu-launcher cannot be made: ")
            && ready.message.contains("(its controller: Deployment web)"),
        "{}",
        ready.message
    );
}

#[test]
fn a_pod_of_the_job_stuck_being_deleted_blocks_it_visibly_after_a_minute() {
    // Gang 1 starts after a restart; worker 1 of gang 0 is being deleted on a node that
    // stopped answering: its grace period ended at 0 s (the "deleting" pods' timestamp).
    let mut old = pod("worker", 1, 0, "deleting");
    old.spec = Some(k8s_openapi::api::core::v1::PodSpec {
        node_name: Some("aks-nd96-3".into()),
        ..Default::default()
    });
    let mut s = Scenario::new(job(|_| {})).pods(vec![old.clone()]);
    s.status.restarts = 1;
    // Within a minute of its grace period: waited for quietly, looked at every second.
    s.now = at(60);
    let p = s.step();
    assert!(p.create_workers.is_empty(), "its name is needed");
    assert_eq!(p.requeue_after, Some(Duration::from_secs(1)));
    assert_eq!(p.phase, Phase::Starting);
    assert_eq!(s.condition(condition_types::READY).1, reasons::STARTING);

    // Past that, the job says so, on Ready, Reconciling and WorkersReady, with what to do.
    s.now = at(61);
    let p = s.step();
    assert!(p.create_workers.is_empty() && p.delete_pods.is_empty());
    assert_eq!(p.requeue_after, Some(plan::NAME_IN_USE_RECHECK));
    assert_eq!(p.phase, Phase::Starting);
    let said = format!(
        "pod resnet18-cpu-worker-1 of gang attempt 0 is still being deleted, its grace period \
         over since {}: its node aks-nd96-3 may be lost (kubectl delete pod \
         resnet18-cpu-worker-1 -n ml --grace-period=0 --force), or a finalizer holds it \
         (whoever put it there takes it off); the job's next pods reuse its name and are made \
         once it is gone",
        at(0).0
    );
    for type_ in [
        condition_types::READY,
        condition_types::RECONCILING,
        condition_types::WORKERS_READY,
    ] {
        let (status, reason, message) = s.condition(type_);
        assert_eq!(
            (status.as_str(), reason.as_str(), message.as_str()),
            (
                if type_ == condition_types::RECONCILING {
                    "True"
                } else {
                    "False"
                },
                reasons::POD_STUCK_TERMINATING,
                said.as_str()
            ),
            "{type_}"
        );
    }
    assert!(reasons::BLOCKING.contains(&reasons::POD_STUCK_TERMINATING));
    assert_eq!(p.about, Some(PodRef::named("resnet18-cpu-worker-1")));
    // A look later says the same.
    let status = s.status.clone();
    s.now = at(600);
    s.step();
    assert_eq!(s.status, status);

    // Once it is gone, the new gang is made and the words go.
    s.pods.clear();
    let p = s.step();
    assert_eq!(p.create_workers, vec![0, 1]);
    assert_eq!(s.condition(condition_types::READY).1, reasons::STARTING);

    // The current gang's launcher stuck the same way (its node lost after a person deleted
    // it): the ready workers wait with it, and the job says why. Nothing wakes the job
    // after the deletion itself: it looks again when the minute is over.
    let mut s = Scenario::new(job(|_| {})).pods(vec![
        pod("worker", 0, 0, "ready"),
        pod("worker", 1, 0, "ready"),
        pod("launcher", 0, 0, "deleting"),
    ]);
    s.now = at(30);
    let p = s.step();
    assert_eq!(p.requeue_after, Some(Duration::from_secs(31)));
    assert_eq!(s.condition(condition_types::READY).1, reasons::STARTING);
    s.now = at(61);
    s.step();
    let (_, reason, message) = s.condition(condition_types::READY);
    assert_eq!(reason, reasons::POD_STUCK_TERMINATING);
    assert!(
        message.starts_with("pod resnet18-cpu-launcher of gang attempt 0 is still being deleted")
            && message.contains("its node may be lost"),
        "{message}"
    );
    assert_eq!(
        s.condition(condition_types::WORKERS_READY).1,
        reasons::RUNNING
    );

    // A worker of a gang still starting, stuck: said on WorkersReady; of two stuck, the one
    // whose grace period ended first, whatever order the cache gives them in.
    let mut second = pod("worker", 0, 0, "deleting");
    second.metadata.deletion_timestamp = Some(at(5));
    for pods in [
        vec![pod("worker", 1, 0, "deleting"), second.clone()],
        vec![second.clone(), pod("worker", 1, 0, "deleting")],
    ] {
        let mut s = Scenario::new(job(|_| {})).pods(pods);
        s.now = at(59);
        assert_eq!(s.step().requeue_after, Some(Duration::from_secs(2)));
        s.now = at(70);
        s.step();
        let (_, reason, message) = s.condition(condition_types::WORKERS_READY);
        assert_eq!(reason, reasons::POD_STUCK_TERMINATING);
        assert!(
            message.starts_with("pod resnet18-cpu-worker-1 of gang attempt 0 "),
            "{message}"
        );
    }
}

#[test]
fn a_pod_stuck_being_deleted_is_said_during_the_restart_backoff_not_after_it() {
    // The fifth restart waits 160 s; worker 0 of the failed gang stays on a lost node.
    let mut s =
        Scenario::new(job(|o| o["spec"]["runPolicy"]["backoffLimit"] = json!(10))).pods(vec![
            pod("worker", 0, 4, "ready"),
            pod("worker", 1, 4, "failed:137:OOMKilled"),
            pod("launcher", 0, 4, "failed:1:Error"),
        ]);
    s.status.restarts = 4;
    let p = s.step();
    assert_eq!((p.phase, p.restarts), (Phase::Restarting, 5));
    s.pods = vec![pod("worker", 0, 4, "deleting")];

    // Within its minute: waited for quietly, looked at again when the minute is over.
    s.now = at(30);
    let p = s.step();
    assert_eq!(p.phase, Phase::Restarting);
    assert_eq!(p.requeue_after, Some(Duration::from_secs(31)));
    assert_eq!(s.condition(condition_types::READY).1, reasons::RESTARTING);

    // Past it, still in the backoff: said on Ready and Reconciling (a Warning Event goes
    // with the reason), while Restarting keeps the restart's cause.
    s.now = at(61);
    let p = s.step();
    assert_eq!(p.phase, Phase::Restarting);
    assert!(p.create_workers.is_empty());
    assert_eq!(
        p.requeue_after,
        Some(Duration::from_secs(99)),
        "the backoff's end"
    );
    for type_ in [condition_types::READY, condition_types::RECONCILING] {
        let (_, reason, message) = s.condition(type_);
        assert_eq!(reason, reasons::POD_STUCK_TERMINATING, "{type_}");
        assert!(
            message
                .starts_with("pod resnet18-cpu-worker-0 of gang attempt 4 is still being deleted"),
            "{message}"
        );
    }
    let (status, reason, message) = s.condition(condition_types::RESTARTING);
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("True", reasons::RESTARTING)
    );
    assert!(message.contains("OOMKilled"), "{message}");
    assert_eq!(p.about, Some(PodRef::named("resnet18-cpu-worker-0")));

    // The backoff over, the pod still there: the same words, now while Starting.
    s.now = at(161);
    let p = s.step();
    assert_eq!(p.phase, Phase::Starting);
    assert!(p.create_workers.is_empty());
    assert_eq!(
        s.condition(condition_types::READY).1,
        reasons::POD_STUCK_TERMINATING
    );
}

#[test]
fn a_pod_not_the_jobs_goes_by_itself_when_deleted_or_an_earlier_jobs() {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
    use state::NameHolder;
    let pod_of = |metadata: ObjectMeta| Pod {
        metadata,
        ..Pod::default()
    };
    let owned_by = |kind: &str, name: &str, api_version: &str| ObjectMeta {
        name: Some("resnet18-cpu-worker-1".into()),
        owner_references: Some(vec![OwnerReference {
            api_version: api_version.into(),
            kind: kind.into(),
            name: name.into(),
            uid: "earlier".into(),
            controller: Some(true),
            ..Default::default()
        }]),
        ..Default::default()
    };
    let not_controlled = |controller: &str| NameHolder::Staying {
        why: format!(
            "a pod of that name exists that this job does not control (its controller: \
             {controller}); delete or rename that pod, and the job goes on"
        ),
    };
    let job = "resnet18-cpu";
    let api = "ringmaster.dev/v1alpha1";
    let now = at(1000);
    assert_eq!(
        NameHolder::of(&pod_of(owned_by("TrainingJob", job, api)), job, &now),
        NameHolder::Going
    );
    // Left by a job deleted with --cascade=orphan: no controller, and nobody deletes it.
    assert_eq!(
        NameHolder::of(&Pod::default(), job, &now),
        not_controlled("none")
    );
    for (kind, name, api_version) in [
        ("TrainingJob", "another", api),
        ("TrainingJob", job, "kubeflow.org/v1"),
        ("TrainingJob", job, "ringmaster.dev.example.com/v1"),
        ("MPIJob", job, "kubeflow.org/v2beta1"),
    ] {
        assert_eq!(
            NameHolder::of(&pod_of(owned_by(kind, name, api_version)), job, &now),
            not_controlled(&format!("{kind} {name}")),
            "{kind} {name} {api_version}"
        );
    }
    // An owner that is not the controller does not count.
    let mut not_controller = owned_by("TrainingJob", job, api);
    not_controller.owner_references.as_mut().unwrap()[0].controller = None;
    assert_eq!(
        NameHolder::of(&pod_of(not_controller), job, &now),
        not_controlled("none")
    );

    // Being deleted: waited for until a minute past its grace period (the deletion
    // timestamp), whoever's it is; then it is said, with what to do.
    for owner in [owned_by("TrainingJob", job, api), ObjectMeta::default()] {
        let deleting = |grace_over: i64| {
            pod_of(ObjectMeta {
                name: Some("resnet18-cpu-worker-1".into()),
                namespace: Some("ml".into()),
                deletion_timestamp: Some(at(grace_over)),
                ..owner.clone()
            })
        };
        assert_eq!(
            NameHolder::of(&deleting(1000), job, &now),
            NameHolder::Going
        );
        assert_eq!(NameHolder::of(&deleting(940), job, &now), NameHolder::Going);
        let NameHolder::Staying { why } = NameHolder::of(&deleting(939), job, &now) else {
            panic!("a pod a minute past its grace period is stuck");
        };
        let since = at(939).0.to_string();
        assert!(
            why.starts_with("a pod of that name (its controller: ")
                && why.contains(&format!(
                    " is still being deleted, its grace period over since {since}: "
                ))
                && why.contains(
                    "kubectl delete pod resnet18-cpu-worker-1 -n ml --grace-period=0 --force"
                )
                && why.contains("or a finalizer holds it")
                && why.contains("its node may be lost"),
            "{why}"
        );
        // The node it is bound to is named.
        let mut on_node = deleting(939);
        on_node.spec = Some(k8s_openapi::api::core::v1::PodSpec {
            node_name: Some("aks-nd96-0".into()),
            ..Default::default()
        });
        let NameHolder::Staying { why } = NameHolder::of(&on_node, job, &now) else {
            panic!("stuck");
        };
        assert!(why.contains("its node aks-nd96-0 may be lost"), "{why}");
    }
}

#[test]
fn a_cached_pod_stripped_of_what_the_controller_never_reads_reads_the_same() {
    use ringmaster::controller::training_job::observe::{PodState, strip_for_cache};
    let states = [
        "pending",
        "unschedulable",
        "running",
        "ready",
        "deleting",
        "succeeded:{\"done\": true}",
        "failed:137:OOMKilled:30",
        "evicted",
        PULL_FAILED,
        "waiting:ContainerCreating:",
    ];
    for state in states {
        let mut full = serde_json::to_value(pod("worker", 1, 2, state)).unwrap();
        // What a real pod carries besides: a spec, managed fields, annotations, more status.
        full["metadata"]["annotations"] = json!({"a": "b"});
        full["metadata"]["creationTimestamp"] = json!("2027-01-15T07:00:00Z");
        full["metadata"]["managedFields"] = json!([{"manager": "ringmaster", "operation": "Apply", "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {}}}]);
        full["spec"] = json!({"containers": [{"name": "worker", "image": "i", "command": ["sshd"]}], "nodeName": "aks-nd96-1"});
        full["status"]["hostIP"] = json!("10.0.0.4");
        full["status"]["podIPs"] = json!([{"ip": "10.244.1.7"}]);
        if let Some(conditions) = full["status"]["conditions"].as_array_mut() {
            conditions.push(json!({"type": "Initialized", "status": "True"}));
        }
        let full: Pod = serde_json::from_value(full).unwrap();
        let mut cached = full.clone();
        strip_for_cache(&mut cached);
        assert_eq!(PodState::of(&cached), PodState::of(&full), "{state}");
        assert_eq!(cached.metadata.labels, full.metadata.labels);
        assert_eq!(
            serde_json::to_value(&cached.spec).unwrap(),
            json!({"containers": [], "nodeName": "aks-nd96-1"}),
            "only the node is kept of the spec"
        );
        assert!(cached.metadata.managed_fields.is_none());
        assert!(
            serde_json::to_vec(&cached).unwrap().len() < serde_json::to_vec(&full).unwrap().len()
        );
    }
}

#[test]
fn the_pods_a_reconcile_made_are_in_the_status_it_writes_so_their_appearance_is_no_write() {
    let mut s = Scenario::new(job(|_| {}));
    let p = s.step();
    assert_eq!(p.create_workers, vec![0, 1]);
    status::count_made(&mut s.status, p.create_workers.len(), false);
    assert_eq!(s.status.workers.active, 2);
    let written = s.status.clone();
    // The next look sees them, pending: the status it computes is the one written.
    s.pods = vec![
        pod("worker", 0, 0, "pending"),
        pod("worker", 1, 0, "pending"),
    ];
    s.step();
    assert_eq!(s.status, written);

    // The launcher likewise.
    s.pods = vec![pod("worker", 0, 0, "ready"), pod("worker", 1, 0, "ready")];
    let p = s.step();
    assert!(p.create_launcher);
    status::count_made(&mut s.status, 0, true);
    assert_eq!(s.status.launcher.as_deref(), Some("Pending"));
    let written = s.status.clone();
    s.pods.push(pod("launcher", 0, 0, "pending"));
    s.step();
    assert_eq!(s.status, written);
}

#[test]
fn worker_counts_and_messages_are_progress_a_new_phase_or_a_stuck_worker_is_not() {
    let mut s = Scenario::new(job(|_| {}));
    s.step();
    s.pods = vec![
        pod("worker", 0, 0, "running"),
        pod("worker", 1, 0, "running"),
    ];
    s.step();
    let starting = s.status.clone();
    s.pods[0] = pod("worker", 0, 0, "ready");
    s.step();
    assert!(
        status::is_progress_only(&starting, &s.status),
        "one more worker ready"
    );
    let one_ready = s.status.clone();
    s.pods[1] = pod("worker", 1, 0, "ready");
    s.step();
    assert!(
        status::is_progress_only(&one_ready, &s.status),
        "every worker ready: the launcher is made, the phase stays Starting"
    );
    let all_ready = s.status.clone();
    s.pods.push(pod("launcher", 0, 0, "running"));
    s.step();
    assert!(
        !status::is_progress_only(&all_ready, &s.status),
        "Running is written at once"
    );
    assert!(!status::is_progress_only(&s.status, &s.status), "no change");

    let mut stuck = Scenario::new(job(|_| {}));
    stuck.step();
    let before = stuck.status.clone();
    stuck.pods = vec![
        pod("worker", 0, 0, "unschedulable"),
        pod("worker", 1, 0, "pending"),
    ];
    stuck.step();
    assert!(
        !status::is_progress_only(&before, &stuck.status),
        "an unschedulable worker is written at once"
    );
}

#[test]
fn the_start_time_comes_from_the_launcher_pod_when_the_status_has_none() {
    let mut s = Scenario::new(job(|_| {}));
    let mut launcher = serde_json::to_value(pod("launcher", 0, 0, "running")).unwrap();
    launcher["metadata"]["creationTimestamp"] = json!(at(3).0.to_string());
    s.pods = vec![
        pod("worker", 0, 0, "ready"),
        pod("worker", 1, 0, "ready"),
        serde_json::from_value(launcher).unwrap(),
    ];
    s.now = at(9);
    let p = s.step();
    assert_eq!(
        (p.phase, s.status.start_time.clone()),
        (Phase::Running, Some(at(3)))
    );
}

#[test]
fn a_queued_job_makes_no_pod_until_admitted_and_says_what_kueue_says() {
    let mut s = Scenario::new(job(|_| {}));
    s.queue = QueueState::Waiting {
        message: "queued in LocalQueue gpus: couldn't assign flavors to pod set workers".into(),
    };
    let p = s.step();
    assert_eq!(p.phase, Phase::Queued);
    assert!(p.create_workers.is_empty() && !p.create_launcher);
    let (status, reason, message) = s.condition(condition_types::ADMITTED);
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", reasons::QUEUED)
    );
    assert!(message.contains("couldn't assign flavors"), "{message}");
    assert_eq!(s.condition(condition_types::RECONCILING).0, "True");

    s.queue = QueueState::Admitted {
        placement: Placement::default(),
        message: "admitted by ClusterQueue team (flavors: nd96)".into(),
    };
    let p = s.step();
    assert_eq!(
        (p.phase, p.create_workers.clone()),
        (Phase::Starting, vec![0, 1])
    );
    assert_eq!(s.condition(condition_types::ADMITTED).0, "True");
}

#[test]
fn pods_of_a_job_that_is_not_admitted_are_deleted() {
    // Kueue took the admission back without an eviction the operator saw (or the job was
    // labelled late): its pods go, whatever state they are in.
    let mut s = Scenario::new(job(|_| {})).pods(vec![
        pod("worker", 0, 0, "ready"),
        pod("worker", 1, 0, "deleting"),
        pod("launcher", 0, 0, "running"),
    ]);
    s.queue = QueueState::Waiting {
        message: "queued".into(),
    };
    let mut p = s.step();
    p.delete_pods.sort();
    assert_eq!(
        p.delete_pods,
        vec!["resnet18-cpu-launcher", "resnet18-cpu-worker-0"]
    );
    assert_eq!(p.phase, Phase::Queued);
}

#[test]
fn an_evicted_job_is_suspended_with_kueues_reason_then_starts_again_when_readmitted() {
    let mut s = Scenario::new(job(|_| {})).pods(vec![
        pod("worker", 0, 0, "ready"),
        pod("worker", 1, 0, "ready"),
        pod("launcher", 0, 0, "running"),
    ]);
    s.queue = QueueState::Admitted {
        placement: Placement::default(),
        message: "admitted".into(),
    };
    assert_eq!(s.step().phase, Phase::Running);
    s.queue = QueueState::Evicted {
        reason: "Preempted",
        message:
            "Preempted to accommodate a workload (UID: u) due to prioritization in the ClusterQueue"
                .into(),
    };
    let p = s.step();
    assert_eq!(p.phase, Phase::Suspended);
    assert_eq!(p.delete_pods.len(), 3);
    let (status, reason, message) = s.condition(condition_types::SUSPENDED);
    assert_eq!((status.as_str(), reason.as_str()), ("True", "Preempted"));
    assert!(message.contains("prioritization"), "{message}");
    assert_eq!(s.condition(condition_types::ADMITTED).1, "Preempted");
    // Not a failure: no restart is counted, and nothing is Stalled.
    assert_eq!(s.status.restarts, 0);
    assert_eq!(s.condition(condition_types::STALLED).0, "False");

    // Readmitted once the pods are gone: the same gang attempt starts afresh.
    s.pods.clear();
    s.queue = QueueState::Admitted {
        placement: Placement::default(),
        message: "admitted".into(),
    };
    let p = s.step();
    assert_eq!(
        (p.phase, p.create_workers.clone()),
        (Phase::Starting, vec![0, 1])
    );
    assert_eq!(p.restarts, 0);
    assert_eq!(s.condition(condition_types::SUSPENDED).0, "False");
}

#[test]
fn a_queued_job_without_the_kueue_integration_is_held_and_says_why() {
    let mut s = Scenario::new(job(|_| {}));
    s.queue = QueueState::IntegrationOff {
        queue: "gpus".into(),
    };
    let p = s.step();
    assert_eq!(p.phase, Phase::Pending);
    assert!(p.create_workers.is_empty());
    let (status, reason, message) = s.condition(condition_types::ADMITTED);
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", reasons::KUEUE_INTEGRATION_OFF)
    );
    assert!(message.contains("--kueue"), "{message}");

    // A gang that runs already (the operator restarted without the integration) is left alone.
    let mut s = Scenario::new(job(|_| {})).pods(vec![
        pod("worker", 0, 0, "ready"),
        pod("worker", 1, 0, "ready"),
        pod("launcher", 0, 0, "running"),
    ]);
    s.queue = QueueState::IntegrationOff {
        queue: "gpus".into(),
    };
    let p = s.step();
    assert_eq!(p.phase, Phase::Running);
    assert!(p.delete_pods.is_empty());
    assert!(
        s.condition(condition_types::ADMITTED)
            .2
            .contains("left alone")
    );
}

#[test]
fn run_policy_suspend_wins_over_an_admission() {
    let mut s = Scenario::new(job(|j| j["spec"]["runPolicy"]["suspend"] = json!(true)))
        .pods(vec![pod("worker", 0, 0, "ready")]);
    s.queue = QueueState::Admitted {
        placement: Placement::default(),
        message: "admitted".into(),
    };
    let p = s.step();
    assert_eq!(p.phase, Phase::Suspended);
    assert_eq!(p.delete_pods, vec!["resnet18-cpu-worker-0"]);
    assert_eq!(
        s.condition(condition_types::SUSPENDED).1,
        reasons::SUSPENDED
    );
}

#[test]
fn the_deadline_does_not_count_while_kueue_holds_the_job_back() {
    let mut s = Scenario::new(job(|j| {
        j["spec"]["runPolicy"]["activeDeadlineSeconds"] = json!(60)
    }));
    s.status.start_time = Some(at(0));
    s.now = at(3600);
    s.queue = QueueState::Evicted {
        reason: "Preempted",
        message: "preempted".into(),
    };
    let p = s.step();
    assert_eq!(p.phase, Phase::Suspended);
    assert_eq!(
        s.status.start_time, None,
        "counted again from the next start"
    );
    s.queue = QueueState::Waiting {
        message: "queued".into(),
    };
    assert_eq!(s.step().phase, Phase::Queued);
}

#[test]
fn a_pod_wakes_its_job_when_its_state_changes_and_its_words_alone_seldom() {
    use kube::runtime::watcher::Event;
    use ringmaster::controller::training_job::observe::{
        PodWakeFilter, WORDS_WAKE_EVERY, strip_for_cache,
    };
    use std::time::{Duration, Instant};
    let cached = |state: &str, message: &str, version: &str| {
        let mut pod = pod("worker", 0, 0, state);
        pod.metadata.uid = Some("u-0".into());
        pod.metadata.resource_version = Some(version.into());
        for c in pod.status.as_mut().unwrap().conditions.iter_mut().flatten() {
            c.message = Some(message.into());
        }
        strip_for_cache(&mut pod);
        pod
    };
    let start = Instant::now();
    let at = |ms: u64| start + Duration::from_millis(ms);
    let mut filter = PodWakeFilter::default();
    let mut apply = |pod: Pod, ms: u64| filter.wakes_at(&Event::Apply(pod), at(ms));
    assert!(apply(cached("pending", "", "1"), 0), "first seen");
    assert!(
        apply(cached("unschedulable", "0/3 nodes are available", "2"), 10),
        "the scheduler turned it away"
    );
    // What the Coscheduling plugin does dozens of times a second to a gang that cannot fit.
    let words = [
        "optimistic rejection in PostFilter",
        "0/3 nodes are available",
    ];
    let mut woke = Vec::new();
    for i in 0..250u64 {
        let ms = 20 + i * 300; // 75 s of retries
        if apply(
            cached(
                "unschedulable",
                words[(i % 2) as usize],
                &(3 + i).to_string(),
            ),
            ms,
        ) {
            woke.push(ms);
        }
    }
    // New words alone wake the job once per WORDS_WAKE_EVERY, never sooner.
    let every = u64::try_from(WORDS_WAKE_EVERY.as_millis()).unwrap();
    assert_eq!(woke.len(), 2, "{woke:?}");
    assert!(
        woke[0] >= 10 + every && woke[1] - woke[0] >= every,
        "{woke:?}"
    );
    assert!(
        !apply(cached("unschedulable", words[1], "300"), 100_000),
        "nothing new"
    );
    assert!(
        apply(cached("running", "", "301"), 100_001),
        "bound and started"
    );
    assert!(apply(cached("ready", "", "302"), 100_002), "ready");
    assert!(!apply(cached("ready", "", "303"), 100_003), "nothing new");
    assert!(
        filter.wakes_at(&Event::Delete(cached("ready", "", "304")), at(100_004)),
        "a deleted pod always wakes its job"
    );
    let mut apply = |pod: Pod, ms: u64| filter.wakes_at(&Event::Apply(pod), at(ms));
    assert!(
        apply(cached("ready", "", "305"), 100_005),
        "seen afresh after its deletion"
    );
    // A new list forgets the gists: pods deleted meanwhile were never told as deleted.
    assert!(filter.wakes_at(&Event::Init, at(100_006)));
    assert!(filter.wakes_at(&Event::InitApply(cached("ready", "", "306")), at(100_007)));
}

#[test]
fn names_held_reach_the_plan_as_an_input_and_hold_back_those_pods() {
    use state::NameHolder;
    let mut s = Scenario::new(job(|_| {}));
    s.names_in_use = BTreeMap::from([(
        "resnet18-cpu-worker-0".to_string(),
        NameHolder::Staying {
            why: "a pod of that name exists that this job does not control".into(),
        },
    )]);
    let p = s.step();
    assert_eq!(p.create_workers, vec![1]);
    let ready = s.condition(condition_types::READY);
    assert_eq!(ready.1, reasons::NAME_IN_USE);
    assert!(
        ready
            .2
            .contains("worker resnet18-cpu-worker-0 cannot be made")
    );
}

#[test]
fn pods_made_moments_ago_and_not_cached_are_not_made_again_until_the_memory_fades() {
    let mut s = Scenario::new(job(|_| {}));
    s.recent.unseen_pods = BTreeMap::from([("resnet18-cpu-worker-0".to_string(), 0)]);
    let p = s.plan();
    assert_eq!(
        p.create_workers,
        vec![1],
        "worker 0 is on its way to the cache"
    );
    assert!(p.unseen_pods);
    assert_eq!(
        p.requeue_after,
        Some(ringmaster::controller::training_job::recent::FRESH_FOR)
    );
    // Made for another gang: not this one's.
    s.recent.unseen_pods = BTreeMap::from([("resnet18-cpu-worker-0".to_string(), 3)]);
    let p = s.plan();
    assert_eq!(p.create_workers, vec![0, 1]);
    assert!(!p.unseen_pods);
}

#[test]
fn the_secret_and_service_go_out_with_a_gangs_workers_and_a_new_spec_once() {
    use plan::Children;
    use ringmaster::controller::training_job::names::ChildNaming;
    let mut s = Scenario::new(job(|_| {}));
    let p = s.plan();
    assert_eq!(
        (p.children, p.naming),
        (Children::Ensure, ChildNaming::UidTagged)
    );
    // Written moments ago for this spec and gang: not again.
    s.recent.children_for = Some((Some(1), 0, ChildNaming::UidTagged));
    assert_eq!(s.plan().children, Children::Keep);
    s.recent.children_for = None;
    // No worker to make: nothing to write.
    s.pods = vec![pod("worker", 0, 0, "ready"), pod("worker", 1, 0, "running")];
    assert_eq!(s.plan().children, Children::Keep);
    // A new spec since they were made: the Service is applied over the old one.
    s.status.observed_generation = Some(0);
    assert_eq!(s.plan().children, Children::Update);
    // A refusal of the Service on the job: written again too.
    s.status.observed_generation = Some(1);
    s.status
        .conditions
        .push(k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
            type_: condition_types::STALLED.into(),
            status: "True".into(),
            reason: "ChildRejected".into(),
            message: "applying Service resnet18-cpu-workers-uid-1: denied".into(),
            last_transition_time: at(0),
            observed_generation: Some(1),
        });
    assert_eq!(s.plan().children, Children::Update);
}

/// `pod`, made at `made` and placed on a node at `placed` (seconds on the scenario's clock).
fn timed(pod: Pod, made: i64, placed: Option<i64>) -> Pod {
    let mut pod = serde_json::to_value(pod).unwrap();
    pod["metadata"]["creationTimestamp"] = json!(at(made).0.to_string());
    let conditions = pod["status"]["conditions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let mut conditions: Vec<Value> = conditions
        .into_iter()
        .filter(|c| c["type"] != "PodScheduled" || c["status"] != "True")
        .collect();
    if let Some(placed) = placed {
        conditions.push(json!({"type": "PodScheduled", "status": "True",
                               "lastTransitionTime": at(placed).0.to_string()}));
    }
    pod["status"]["conditions"] = json!(conditions);
    serde_json::from_value(pod).unwrap()
}

fn failed_condition(s: &Scenario) -> (String, String) {
    let (status, reason, message) = s.condition(condition_types::FAILED);
    assert_eq!(status, "True");
    (reason, message)
}

#[test]
fn a_gang_whose_image_cannot_be_pulled_fails_at_the_start_timeout_naming_the_cause() {
    let mut s = Scenario::new(job(|_| {}));
    let pulling = "waiting:ImagePullBackOff:Back-off pulling image \"registry.example/nope\"";
    s.pods = vec![
        timed(pod("worker", 0, 0, pulling), 0, Some(2)),
        timed(pod("worker", 1, 0, "ready"), 0, Some(2)),
    ];
    s.now = at(1801);
    let p = s.step();
    assert_eq!(
        p.phase,
        Phase::Starting,
        "30 minutes from the first placement"
    );
    assert!(
        p.requeue_after.is_some_and(|d| d <= Duration::from_secs(1)),
        "and it looks again when they are up: {:?}",
        p.requeue_after
    );
    s.now = at(1802);
    let p = s.step();
    assert_eq!(p.phase, Phase::Failed);
    let (reason, message) = failed_condition(&s);
    assert_eq!(reason, reasons::START_TIMEOUT);
    assert!(
        message.starts_with(
            "the gang did not start within runPolicy.startTimeoutSeconds (1800 s): worker \
             resnet18-cpu-worker-0 cannot start (ImagePullBackOff): Back-off pulling image"
        ),
        "{message}"
    );
    let mut deleted = p.delete_pods.clone();
    deleted.sort();
    assert_eq!(
        deleted,
        ["resnet18-cpu-worker-0", "resnet18-cpu-worker-1"],
        "the held GPUs are let go"
    );
    // Finished stays finished, with its reason.
    s.now = at(5000);
    let p = s.step();
    assert_eq!(p.phase, Phase::Failed);
    assert_eq!(failed_condition(&s).0, reasons::START_TIMEOUT);
}

#[test]
fn waiting_for_room_on_existing_nodes_does_not_count_toward_the_start_timeout() {
    let mut s = Scenario::new(job(|_| {}));
    s.pods = vec![
        timed(pod("worker", 0, 0, "unschedulable"), 0, None),
        timed(pod("worker", 1, 0, "unschedulable"), 0, None),
    ];
    s.now = at(100_000);
    let p = s.step();
    assert_eq!(p.phase, Phase::Starting);
    assert_eq!(
        s.condition(condition_types::WORKERS_READY).1,
        reasons::UNSCHEDULABLE
    );
}

#[test]
fn on_its_own_node_pool_an_unschedulable_gang_times_out_from_when_it_was_made() {
    let mut s = Scenario::new(job(|o| {
        o["spec"]["nodePool"] = json!({"provisioner": "aks", "vmSize": "Standard_ND96asr_v4"});
        o["spec"]["runPolicy"]["startTimeoutSeconds"] = json!(600);
    }));
    s.pool = PoolState::Ready {
        message: "agent pool resn0a1b2c3d: 2 nodes Ready".into(),
    };
    s.pods = vec![
        timed(pod("worker", 0, 0, "unschedulable"), 10, None),
        timed(pod("worker", 1, 0, "ready"), 10, Some(11)),
    ];
    s.now = at(609);
    assert_eq!(s.step().phase, Phase::Starting);
    s.now = at(610);
    assert_eq!(s.step().phase, Phase::Failed);
    let (reason, message) = failed_condition(&s);
    assert_eq!(reason, reasons::START_TIMEOUT);
    assert!(
        message.contains(
            "(600 s): worker resnet18-cpu-worker-0 cannot be scheduled: 0/6 nodes are available"
        ),
        "{message}"
    );
}

#[test]
fn a_worker_whose_sshd_never_gets_ready_fails_the_job_at_the_start_timeout() {
    let mut s = Scenario::new(job(|o| {
        o["spec"]["runPolicy"]["startTimeoutSeconds"] = json!(60);
    }));
    s.pods = vec![
        timed(pod("worker", 0, 0, "ready"), 0, Some(0)),
        timed(pod("worker", 1, 0, "running"), 0, Some(0)),
    ];
    s.now = at(60);
    s.step();
    let (reason, message) = failed_condition(&s);
    assert_eq!(reason, reasons::START_TIMEOUT);
    assert!(
        message.ends_with(
            "worker resnet18-cpu-worker-1 runs but never got ready (its readiness probe: ssh \
             with the job's key to its own name, served by its sshd)"
        ),
        "{message}"
    );
}

#[test]
fn each_gang_has_its_own_start_timeout_and_a_started_gang_has_none() {
    let mut s = Scenario::new(job(|o| {
        o["spec"]["runPolicy"]["startTimeoutSeconds"] = json!(60);
    }));
    // The first gang started long ago and runs: no start to time.
    s.status.start_time = Some(at(0));
    s.pods = vec![
        timed(pod("worker", 0, 0, "ready"), 0, Some(0)),
        timed(pod("worker", 1, 0, "ready"), 0, Some(0)),
        timed(pod("launcher", 0, 0, "running"), 5, Some(5)),
    ];
    s.now = at(10_000);
    assert_eq!(s.step().phase, Phase::Running);
    // A restart's gang, placed at 10,000: timed from then, not from the first start.
    s.status.restarts = 1;
    s.pods = vec![
        timed(pod("worker", 0, 1, "ready"), 10_000, Some(10_000)),
        timed(pod("worker", 1, 1, "running"), 10_000, Some(10_000)),
    ];
    s.now = at(10_059);
    assert_eq!(s.step().phase, Phase::Starting);
    s.now = at(10_060);
    assert_eq!(s.step().phase, Phase::Failed);
    assert_eq!(failed_condition(&s).0, reasons::START_TIMEOUT);
}

#[test]
fn a_failed_attempt_stays_in_last_failure_after_its_pods_are_gone() {
    let mut s = Scenario::new(job(|_| {})).pods(vec![
        pod("worker", 0, 0, "ready"),
        pod("worker", 1, 0, "failed:137:OOMKilled"),
    ]);
    s.now = at(7);
    s.step();
    let failure = s.status.last_failure.clone().expect("status.lastFailure");
    assert_eq!(
        (failure.attempt, failure.time.clone(), failure.pod.as_str()),
        (0, at(7), "resnet18-cpu-worker-1")
    );
    assert!(
        failure
            .message
            .starts_with("worker resnet18-cpu-worker-1 exited with code 137 (OOMKilled)"),
        "{}",
        failure.message
    );
    // Seen again before the pods go: the same failure, its time kept.
    s.now = at(8);
    s.step();
    assert_eq!(s.status.last_failure.as_ref().unwrap().time, at(8 - 1));
    // The restart deleted the pods; the next gang runs; the failure is still told.
    s.pods.clear();
    s.now = at(30);
    s.step();
    s.pods = vec![
        pod("worker", 0, 1, "ready"),
        pod("worker", 1, 1, "ready"),
        pod("launcher", 0, 1, "running"),
    ];
    s.step();
    assert_eq!(s.status.phase, Phase::Running);
    assert_eq!(s.status.last_failure, Some(failure));
}

#[test]
fn secrets_in_a_failed_launchers_output_are_redacted_everywhere_the_job_tells_it() {
    let output = "copying https://acct.blob.core.windows.net/data/x?sv=2022-11-02&sig=AbC%2Bdef123%3D&se=2027 failed\n\
                  DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=c2VjcmV0a2V5MTIzNDU2Nzg5MA==;\n\
                  Authorization: Bearer eyJ0eXAiOiJKV1QiLCJhbGciOi.payload.sig";
    let mut s = Scenario::new(job(|_| {})).pods(vec![
        pod("worker", 0, 0, "ready"),
        pod("worker", 1, 0, "ready"),
        failed_launcher(1, output),
    ]);
    assert_eq!(s.step().phase, Phase::Failed);
    let (_, _, condition) = s.condition(condition_types::FAILED);
    let failure = s.status.last_failure.clone().expect("status.lastFailure");
    for told in [&condition, &failure.message] {
        for secret in [
            "AbC%2Bdef123%3D",
            "c2VjcmV0a2V5MTIzNDU2Nzg5MA==",
            "eyJ0eXAiOiJKV1QiLCJhbGciOi",
        ] {
            assert!(!told.contains(secret), "{secret} in {told}");
        }
        assert!(told.contains("sig=<redacted>"), "{told}");
        assert!(told.contains("AccountKey=<redacted>"), "{told}");
        assert!(told.contains("Bearer <redacted>"), "{told}");
        assert!(
            told.contains("sv=2022-11-02"),
            "what is not secret stays: {told}"
        );
    }
    assert_eq!(failure.pod, "resnet18-cpu-launcher");
}

/// Azure's word on the pool does not kill a gang that runs (a failed AKS upgrade leaves the
/// pool `Failed` while its nodes train on): NodesReady says it, the job stays Running and
/// nothing is deleted. Should the nodes go, the pods' failure restarts the job as any node
/// loss does. Without a gang, a failed pool still fails the job.
#[test]
fn a_failed_pool_under_a_running_gang_is_said_not_acted_on() {
    let mut s = Scenario::new(job(|_| {})).pods(vec![
        pod("worker", 0, 0, "ready"),
        pod("worker", 1, 0, "ready"),
        pod("launcher", 0, 0, "running"),
    ]);
    s.status.start_time = Some(at(0));
    s.pool = PoolState::Failed {
        message: "agent pool resn0a1b2c3d is Failed: UpgradeFailed".into(),
    };
    let p = s.step();
    assert_eq!(p.phase, Phase::Running);
    assert!(p.delete_pods.is_empty(), "{:?}", p.delete_pods);
    let (status, reason, message) = s.condition(condition_types::NODES_READY);
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "NodePoolFailed")
    );
    assert!(
        message.starts_with("agent pool resn0a1b2c3d is Failed: UpgradeFailed"),
        "{message}"
    );
    // Its nodes go: a worker is evicted; the gang restarts, and with no gang left the failed
    // pool fails the job.
    s.pods = vec![
        pod("worker", 0, 0, "evicted"),
        pod("worker", 1, 0, "ready"),
        pod("launcher", 0, 0, "running"),
    ];
    let p = s.step();
    assert_eq!(p.phase, Phase::Restarting);
    s.pods.clear();
    let p = s.step();
    assert_eq!(p.phase, Phase::Failed);
    assert_eq!(s.condition(condition_types::FAILED).1, "NodePoolFailed");
}

/// A gang restart keeps the failed attempt's launcher (its own name per attempt, so the next
/// launcher does not wait for it) and its last words in `status.lastFailure`, until a later
/// launcher fails too (then that one is kept instead) or the job ends, when `cleanPodPolicy`
/// decides as for the other finished pods.
#[test]
fn a_failed_launcher_stays_with_its_log_until_a_later_one_fails_or_the_job_ends() {
    let log = "rank 1: lost peer 10.244.0.7\nmpirun noticed that process rank 1 with PID 0 on node worker-1 exited on signal 9 (Killed).";
    let mut s =
        Scenario::new(job(|o| o["spec"]["runPolicy"]["backoffLimit"] = json!(3))).pods(vec![
            pod("worker", 0, 0, "ready"),
            pod("worker", 1, 0, "failed:137:OOMKilled"),
            failed_launcher(75, log),
        ]);
    let p = s.step();
    assert_eq!((p.phase, p.restarts), (Phase::Restarting, 1));
    assert_eq!(
        p.delete_pods,
        ["resnet18-cpu-worker-0", "resnet18-cpu-worker-1"]
    );
    let failure = s.status.last_failure.clone().expect("status.lastFailure");
    assert_eq!(
        (
            failure.pod.as_str(),
            failure.exit_code,
            failure.launcher.as_deref()
        ),
        (
            "resnet18-cpu-worker-1",
            Some(137),
            Some("resnet18-cpu-launcher")
        )
    );
    assert!(
        failure
            .launcher_log
            .as_deref()
            .is_some_and(|l| l.ends_with("exited on signal 9 (Killed).")
                && l.starts_with("rank 1: lost peer")),
        "{:?}",
        failure.launcher_log
    );

    // The workers are gone, the launcher stays; after the backoff the next gang is made
    // beside it, and nothing deletes it.
    let kept = || failed_launcher(75, log);
    s.pods = vec![kept()];
    s.now = at(11);
    let p = s.step();
    assert_eq!(
        (p.phase, p.create_workers.clone()),
        (Phase::Starting, vec![0, 1])
    );
    assert!(p.delete_pods.is_empty(), "{:?}", p.delete_pods);
    s.pods = vec![
        kept(),
        pod("worker", 0, 1, "ready"),
        pod("worker", 1, 1, "ready"),
    ];
    let p = s.step();
    assert!(p.create_launcher && p.delete_pods.is_empty(), "{p:?}");
    assert_eq!(
        names::launcher_pod("resnet18-cpu", 1),
        "resnet18-cpu-launcher-1"
    );
    s.pods.push(pod("launcher", 0, 1, "running"));
    let p = s.step();
    assert_eq!(p.phase, Phase::Running);
    assert!(p.delete_pods.is_empty(), "{:?}", p.delete_pods);

    // Attempt 1's launcher is killed (retried): it is kept now, and attempt 0's goes.
    s.pods[3] = pod("launcher", 0, 1, "failed:143:Error");
    let p = s.step();
    assert_eq!((p.phase, p.restarts), (Phase::Restarting, 2));
    assert_eq!(
        p.delete_pods,
        [
            "resnet18-cpu-worker-0",
            "resnet18-cpu-worker-1",
            "resnet18-cpu-launcher"
        ]
    );
    let failure = s.status.last_failure.clone().unwrap();
    assert_eq!(
        (
            failure.attempt,
            failure.exit_code,
            failure.launcher.as_deref()
        ),
        (1, Some(143), Some("resnet18-cpu-launcher-1"))
    );

    // Attempt 2 succeeds: cleanPodPolicy Running keeps finished pods, the kept one too.
    let ready_gang = |attempt| {
        vec![
            pod("launcher", 0, 1, "failed:143:Error"),
            pod("worker", 0, attempt, "ready"),
            pod("worker", 1, attempt, "ready"),
            pod("launcher", 0, attempt, "succeeded:"),
        ]
    };
    s.pods = ready_gang(2);
    let p = s.step();
    assert_eq!(p.phase, Phase::Succeeded);
    assert_eq!(
        p.delete_pods,
        ["resnet18-cpu-worker-0", "resnet18-cpu-worker-1"]
    );
    // With cleanPodPolicy All, the kept launcher goes with the rest.
    let mut s = Scenario::new(job(|o| {
        o["spec"]["runPolicy"]["cleanPodPolicy"] = json!("All")
    }));
    s.status.restarts = 2;
    s.pods = ready_gang(2);
    let p = s.step();
    assert_eq!(p.phase, Phase::Succeeded);
    assert!(
        p.delete_pods
            .contains(&"resnet18-cpu-launcher-1".to_string()),
        "{:?}",
        p.delete_pods
    );
}
