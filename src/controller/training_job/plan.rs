//! The TrainingJob state machine: from the validated spec, the last status and the observed
//! pods, what to create, what to delete and what the status says. Pure: the clock comes in.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::condition_names::{condition_types, reasons};
use super::observe::{Exit, Observed, PodLife, PodRef, PodState, StuckKind};
use super::spec::ValidatedTrainingJob;
use super::state::{
    DataState, NameHolder, PoolState, QueueState, TERMINATING_PATIENCE, past_terminating_patience,
    seconds_between, still_being_deleted,
};
use crate::api::{CleanPodPolicy, TrainingJobPhase, TrainingJobStatus, TrainingResult};
use crate::controller::conditions::DesiredCondition;

/// Longest wait between gang restarts.
pub const MAX_RESTART_BACKOFF: Duration = Duration::from_secs(300);
/// How long after a launcher exits with the lost-peer code the plan waits for a worker's
/// failure to show before it restarts the gang naming the launcher.
pub const PEER_LOST_CAUSE_WAIT: Duration = Duration::from_secs(5);

/// Everything the plan reads.
pub struct PlanInputs<'a> {
    /// The spec.
    pub job: &'a ValidatedTrainingJob,
    /// The job's generation.
    pub generation: Option<i64>,
    /// The status written last.
    pub status: &'a TrainingJobStatus,
    /// The job's pods.
    pub observed: &'a Observed,
    /// The DataStage.
    pub data: &'a DataState,
    /// The node pool.
    pub pool: &'a PoolState,
    /// Where the job stands with Kueue.
    pub queue: &'a QueueState,
    /// Now.
    pub now: &'a Time,
    /// Wait before the first restart; doubles each restart.
    pub restart_backoff: Duration,
}

/// What to do and what to say.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// The phase after this reconcile.
    pub phase: TrainingJobPhase,
    /// Restarts so far (the current gang's attempt).
    pub restarts: i32,
    /// Worker indices to create.
    pub create_workers: Vec<u32>,
    /// Create the launcher.
    pub create_launcher: bool,
    /// Pods to delete.
    pub delete_pods: Vec<String>,
    /// When the job first started running.
    pub start_time: Option<Time>,
    /// When it finished.
    pub completion_time: Option<Time>,
    /// The trainer's summary.
    pub result: Option<TrainingResult>,
    /// Conditions to set.
    pub conditions: Vec<DesiredCondition>,
    /// Look again after this long even if nothing changes.
    pub requeue_after: Option<Duration>,
    /// Delete the TrainingJob itself (TTL after finishing).
    pub delete_job: bool,
    /// Short words on the phase, for its Event.
    pub message: String,
    /// The pod those words are about (a restart's or failure's cause, what blocks the
    /// start), for its Events.
    pub about: Option<PodRef>,
}

impl Plan {
    fn new(inputs: &PlanInputs<'_>, phase: TrainingJobPhase) -> Self {
        Self {
            phase,
            restarts: inputs.status.restarts,
            create_workers: Vec::new(),
            create_launcher: false,
            delete_pods: Vec::new(),
            // The launcher's start, when the status has not recorded it yet (its write can
            // wait behind others, and the operator can restart in between): the pod says
            // when it was made.
            start_time: inputs.status.start_time.clone().or_else(|| {
                inputs
                    .observed
                    .launcher
                    .as_ref()
                    .filter(|l| !l.is_deleting())
                    .map(|l| l.created.clone().unwrap_or_else(|| inputs.now.clone()))
            }),
            completion_time: inputs.status.completion_time.clone(),
            result: inputs.status.result.clone(),
            conditions: Vec::new(),
            requeue_after: None,
            delete_job: false,
            message: String::new(),
            about: None,
        }
    }

    /// Asks to look again after `after` at the latest.
    pub fn requeue(&mut self, after: Duration) {
        self.requeue_after = Some(self.requeue_after.map_or(after, |d| d.min(after)));
    }

    fn say(
        &mut self,
        type_: &'static str,
        status: bool,
        reason: &'static str,
        message: impl Into<String>,
    ) {
        self.conditions
            .push(DesiredCondition::new(type_, status, reason, message));
    }
}

/// The job's own pods still being deleted past [`TERMINATING_PATIENCE`], said as
/// [`reasons::POD_STUCK_TERMINATING`] with what to do, since nothing else ends the wait.
struct StuckPods {
    /// One holding back the workers: of an earlier gang (the new gang's pods reuse their
    /// names, and none is made until every one is gone), or a worker of this gang.
    workers: Option<Block>,
    /// This gang's launcher.
    launcher: Option<Block>,
    /// When the next pod being deleted passes the patience: its deletion wakes nothing
    /// before then (a pod on a lost node sends no further event).
    next_look: Option<Duration>,
}

fn stuck_terminating(observed: &Observed, namespace: &str, now: &Time) -> StuckPods {
    // The earliest stuck, then by name: the same one on every look, whatever the cache's
    // order, so the words do not change between reconciles.
    let first = |pods: &mut dyn Iterator<Item = &PodState>| {
        pods.filter_map(|pod| {
            let grace_over = pod.deletion.as_ref()?;
            past_terminating_patience(grace_over, now).then_some((grace_over, pod))
        })
        .min_by(|(a, p), (b, q)| a.0.cmp(&b.0).then_with(|| p.name.cmp(&q.name)))
        .map(|(grace_over, pod)| {
            let gang = pod
                .attempt
                .map_or_else(String::new, |a| format!(" of gang attempt {a}"));
            Block {
                reason: reasons::POD_STUCK_TERMINATING,
                message: format!(
                    "pod {}{gang} {}; the job's next pods reuse its name and are made once it \
                     is gone",
                    pod.name,
                    still_being_deleted(&pod.name, namespace, pod.node.as_deref(), grace_over)
                ),
                pod: pod.about(),
            }
        })
    };
    let patience = TERMINATING_PATIENCE.as_secs_f64();
    StuckPods {
        workers: first(
            &mut observed
                .stale
                .iter()
                .chain(observed.workers.iter().flatten()),
        ),
        launcher: first(&mut observed.launcher.iter()),
        next_look: observed
            .all()
            .filter_map(|pod| pod.deletion.as_ref())
            .map(|grace_over| patience - seconds_between(grace_over, now))
            .filter(|left| *left >= 0.0)
            .min_by(f64::total_cmp)
            .map(|left| Duration::from_secs_f64(left) + Duration::from_secs(1)),
    }
}

/// What holds the job's start back, for its conditions and Warning Event.
#[derive(Clone, Debug)]
struct Block {
    reason: &'static str,
    message: String,
    pod: PodRef,
}

/// How soon a job whose pod's name a staying pod holds looks again: that pod's deletion
/// does not wake the job (it is not the job's).
pub const NAME_IN_USE_RECHECK: Duration = Duration::from_secs(10);

/// Holds back the creation of pods whose names are taken by pods of another owner.
/// Creating over them would be refused by the API server (they are not ours). A pod on its
/// way out ([`NameHolder::Going`]) is waited out quietly: its deletion wakes the job again,
/// and a look after a second covers a missed event. A pod that stays blocks the job
/// visibly: Ready and Reconciling (and WorkersReady, for a worker) say `NameInUse`, with
/// the pod and what to do, and a Warning Event goes out.
pub fn hold_back_names_in_use(
    plan: &mut Plan,
    job: &str,
    in_use: &BTreeMap<String, NameHolder>,
    started: Option<&Time>,
) {
    use super::names::{LAUNCHER_ROLE, WORKER_ROLE};
    let mut held: Vec<(&str, String)> = Vec::new();
    plan.create_workers.retain(|i| {
        let name = super::names::worker_pod(job, *i);
        let taken = in_use.contains_key(&name);
        if taken {
            held.push((WORKER_ROLE, name));
        }
        !taken
    });
    let launcher = super::names::launcher_pod(job);
    if plan.create_launcher && in_use.contains_key(&launcher) {
        plan.create_launcher = false;
        // Not started: the launcher it would have been is not made.
        plan.start_time = started.cloned();
        held.push((LAUNCHER_ROLE, launcher));
    }
    if held
        .iter()
        .any(|(_, name)| in_use[name] == NameHolder::Going)
    {
        plan.requeue(Duration::from_secs(1));
    }
    let staying = held.iter().find_map(|(role, name)| match &in_use[name] {
        NameHolder::Going => None,
        NameHolder::Staying { why } => Some((*role, name, why)),
    });
    let Some((role, name, why)) = staying else {
        return;
    };
    plan.requeue(NAME_IN_USE_RECHECK);
    let message = format!("{role} {name} cannot be made: {why}");
    for condition in plan.conditions.iter_mut() {
        let this_one = match condition.type_ {
            condition_types::READY | condition_types::RECONCILING => true,
            condition_types::WORKERS_READY => role == WORKER_ROLE,
            _ => false,
        };
        if this_one {
            condition.reason = reasons::NAME_IN_USE;
            condition.message.clone_from(&message);
        }
    }
    plan.message = message;
    plan.about = Some(PodRef::named(name.as_str()));
}

/// The wait before starting gang `restarts` again: `base × 2^(restarts−1)`, at most 5 minutes.
pub fn restart_backoff(base: Duration, restarts: i32) -> Duration {
    let exponent = u32::try_from(restarts.saturating_sub(1).clamp(0, 16)).unwrap_or(0);
    base.saturating_mul(1 << exponent).min(MAX_RESTART_BACKOFF)
}

/// Whether a launcher exit is worth a restart: killed by a signal (128+N: SIGKILL, SIGTERM,
/// the OOM killer), evicted, or the trainer's lost-peer code (also what its launcher
/// wrapper leaves with when mpirun saw a rank killed). Other codes are the program's own
/// verdict and fail the job at once.
pub fn launcher_exit_is_retryable(exit: &Exit) -> bool {
    exit.code >= 128
        || exit.code == i32::from(ringmaster_contract::trainer::exit::PEER_LOST)
        || matches!(exit.reason.as_str(), "Evicted" | "OOMKilled" | "Preempting")
}

/// A pod's exit in words: the failing rank's own error (its first 500 bytes) when the
/// termination message holds the trainer's failure line (`ringmaster-trainer launch`
/// leaves it), else the message's last 300 characters (the log's tail, `mpirun`'s report as
/// often as not).
fn describe(pod: &PodState, exit: &Exit) -> String {
    let mut text = format!(
        "{} exited with code {} ({})",
        pod.name, exit.code, exit.reason
    );
    let tail = exit.message.trim();
    if let Some(failure) = ringmaster_contract::trainer::Failure::find_in(tail) {
        // Short enough that the Event's note (1 kB) keeps what follows it.
        let failure = ringmaster_contract::shorten(&failure.to_string(), 500);
        text.push_str(&format!(": {failure}"));
    } else if !tail.is_empty() {
        let tail: String = tail
            .chars()
            .rev()
            .take(300)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        text.push_str(&format!(": {tail}"));
    }
    text
}

/// Reads the trainer's summary ([`ringmaster_contract::trainer::Summary`], the contract the
/// trainer writes) from the last line of a termination message that parses as one.
pub fn parse_result(message: &str) -> Option<TrainingResult> {
    ringmaster_contract::trainer::Summary::find_in(message).map(|s| TrainingResult {
        // To a tenth, as the trainer prints it (an older trainer, or a program of the
        // user's writing the same line, may not): `kubectl get` shows it whole.
        images_per_second: Some((s.images_per_second * 10.0).round() / 10.0),
        steps: i64::try_from(s.steps).ok(),
        final_loss: s.final_loss,
        resumed_from_step: s
            .resumed_from_step
            .and_then(|step| i64::try_from(step).ok()),
    })
}

/// What keeps a pod that is not running from starting, as a condition reason and words: the
/// scheduler's reason it fits no node, or the kubelet's reason its container cannot start.
/// `None` for a pod on its normal way (or running, or gone).
fn blocked(role: &str, pod: &PodState) -> Option<Block> {
    if pod.is_deleting() {
        return None;
    }
    if let PodLife::Pending {
        unschedulable: Some(why),
    } = &pod.life
    {
        return Some(Block {
            reason: reasons::UNSCHEDULABLE,
            message: format!("{role} {} cannot be scheduled: {why}", pod.name),
            pod: pod.about(),
        });
    }
    let stuck = pod.stuck.as_ref()?;
    let reason = match stuck.kind {
        StuckKind::ImagePull => reasons::IMAGE_PULL_FAILED,
        StuckKind::Container => reasons::CONTAINER_CANNOT_START,
    };
    let mut message = format!("{role} {} cannot start ({})", pod.name, stuck.reason);
    if !stuck.message.is_empty() {
        message.push_str(": ");
        message.push_str(&ringmaster_contract::shorten(&stuck.message, 500));
    }
    Some(Block {
        reason,
        message,
        pod: pod.about(),
    })
}

/// Pods to delete when the job finishes, by cleanPodPolicy.
fn cleanup(observed: &Observed, policy: CleanPodPolicy) -> Vec<String> {
    observed
        .all()
        .filter(|p| !p.is_deleting())
        .filter(|p| match policy {
            CleanPodPolicy::All => true,
            CleanPodPolicy::Running => !p.is_finished(),
            CleanPodPolicy::None => false,
        })
        .map(|p| p.name.clone())
        .collect()
}

fn every_pod(observed: &Observed) -> Vec<String> {
    observed
        .all()
        .filter(|p| !p.is_deleting())
        .map(|p| p.name.clone())
        .collect()
}

/// Sets the kstatus conditions (Ready, Reconciling, Stalled) and the finish conditions for a
/// phase. `detail` is the phase's message.
fn phase_conditions(plan: &mut Plan, detail: &str) {
    use super::condition_names::condition_types::*;
    use TrainingJobPhase as P;
    let phase = plan.phase;
    let reason: &'static str = match phase {
        P::Pending => "Pending",
        P::WaitingForData => reasons::WAITING_FOR_DATA,
        P::Queued => reasons::QUEUED,
        P::ProvisioningNodes => reasons::PROVISIONING,
        P::Starting => reasons::STARTING,
        P::Running => reasons::RUNNING,
        P::Restarting => reasons::RESTARTING,
        P::Suspended => reasons::SUSPENDED,
        P::Succeeded => reasons::SUCCEEDED,
        P::Failed => "Failed",
    };
    let failed_reason = plan
        .conditions
        .iter()
        .find(|c| c.type_ == FAILED && c.status)
        .map(|c| c.reason);
    let ready = matches!(phase, P::Running | P::Succeeded);
    let reconciling = matches!(
        phase,
        P::Pending
            | P::WaitingForData
            | P::Queued
            | P::ProvisioningNodes
            | P::Starting
            | P::Restarting
    );
    let stalled = phase == P::Failed;
    plan.say(READY, ready, failed_reason.unwrap_or(reason), detail);
    plan.say(RECONCILING, reconciling, reason, detail);
    plan.say(STALLED, stalled, failed_reason.unwrap_or(reason), detail);
    // A Kueue eviction says Suspended itself, with Kueue's reason.
    if !plan.conditions.iter().any(|c| c.type_ == SUSPENDED) {
        plan.say(
            SUSPENDED,
            phase == P::Suspended,
            if phase == P::Suspended {
                reasons::SUSPENDED
            } else {
                reasons::NOT_SUSPENDED
            },
            if phase == P::Suspended {
                "runPolicy.suspend is true: no pods run"
            } else {
                ""
            },
        );
    }
    if !plan.conditions.iter().any(|c| c.type_ == FAILED) {
        plan.say(FAILED, false, reasons::NOT_FINISHED, "");
    }
    if !plan.conditions.iter().any(|c| c.type_ == SUCCEEDED) {
        plan.say(
            SUCCEEDED,
            phase == P::Succeeded,
            if phase == P::Succeeded {
                reasons::SUCCEEDED
            } else {
                reasons::NOT_FINISHED
            },
            if phase == P::Succeeded { detail } else { "" },
        );
    }
    plan.message = detail.to_string();
}

fn finish(
    mut plan: Plan,
    inputs: &PlanInputs<'_>,
    phase: TrainingJobPhase,
    reason: &'static str,
    detail: String,
) -> Plan {
    plan.phase = phase;
    plan.completion_time = plan.completion_time.or_else(|| Some(inputs.now.clone()));
    plan.delete_pods = cleanup(inputs.observed, inputs.job.run_policy.clean_pod_policy);
    if phase == TrainingJobPhase::Failed {
        plan.say(condition_types::FAILED, true, reason, detail.clone());
    }
    ttl(&mut plan, inputs);
    phase_conditions(&mut plan, &detail);
    plan
}

fn ttl(plan: &mut Plan, inputs: &PlanInputs<'_>) {
    if let (Some(ttl), Some(done)) = (
        inputs.job.run_policy.ttl_seconds_after_finished,
        &plan.completion_time,
    ) {
        let left = f64::from(ttl) - seconds_between(done, inputs.now);
        if left <= 0.0 {
            plan.delete_job = true;
        } else {
            plan.requeue(Duration::from_secs_f64(left));
        }
    }
}

/// Decides the next step of a job.
pub fn plan(inputs: &PlanInputs<'_>) -> Plan {
    use TrainingJobPhase as P;
    let job = inputs.job;
    let observed = inputs.observed;
    let status = inputs.status;
    let mut plan = Plan::new(inputs, status.phase);

    // Finished jobs stay finished; only their clean-up and TTL remain.
    if matches!(status.phase, P::Succeeded | P::Failed) {
        plan.delete_pods = cleanup(observed, job.run_policy.clean_pod_policy);
        let previous = status
            .conditions
            .iter()
            .find(|c| c.type_ == condition_types::READY)
            .map(|c| c.message.clone())
            .unwrap_or_default();
        if status.phase == P::Failed
            && let Some(failed) = status
                .conditions
                .iter()
                .find(|c| c.type_ == condition_types::FAILED)
        {
            let reason = match failed.reason.as_str() {
                reasons::DEADLINE_EXCEEDED => reasons::DEADLINE_EXCEEDED,
                reasons::LAUNCHER_FAILED => reasons::LAUNCHER_FAILED,
                reasons::NODE_POOL_FAILED => reasons::NODE_POOL_FAILED,
                _ => reasons::BACKOFF_LIMIT_EXCEEDED,
            };
            plan.say(
                condition_types::FAILED,
                true,
                reason,
                failed.message.clone(),
            );
        }
        ttl(&mut plan, inputs);
        phase_conditions(&mut plan, &previous);
        return plan;
    }

    if job.run_policy.suspend {
        plan.phase = P::Suspended;
        plan.delete_pods = every_pod(observed);
        plan.start_time = None;
        phase_conditions(
            &mut plan,
            "runPolicy.suspend is true: the job's pods are deleted; set it to false to run again",
        );
        return plan;
    }

    // The deadline counts while the job may run: not while Kueue holds it back.
    let held_by_kueue = matches!(
        inputs.queue,
        QueueState::Waiting { .. } | QueueState::Evicted { .. }
    );
    if let (Some(deadline), Some(start), false) = (
        job.run_policy.active_deadline_seconds,
        &status.start_time,
        held_by_kueue,
    ) {
        let left = deadline as f64 - seconds_between(start, inputs.now);
        if left <= 0.0 {
            let detail =
                format!("the job ran longer than runPolicy.activeDeadlineSeconds ({deadline} s)");
            return finish(plan, inputs, P::Failed, reasons::DEADLINE_EXCEEDED, detail);
        }
        plan.requeue(Duration::from_secs_f64(left));
    }

    // Pods of earlier gangs go first; new pods reuse their names.
    let stale: Vec<&PodState> = observed.stale.iter().collect();
    plan.delete_pods = stale
        .iter()
        .filter(|p| !p.is_deleting())
        .map(|p| p.name.clone())
        .collect();
    let gang_exists = observed.gang_exists();

    match inputs.data {
        DataState::Waiting { message, failed } if !gang_exists => {
            plan.phase = P::WaitingForData;
            let reason = if *failed {
                reasons::DATA_STAGE_FAILED
            } else {
                reasons::WAITING_FOR_DATA
            };
            plan.say(condition_types::DATA_READY, false, reason, message.clone());
            phase_conditions(&mut plan, &format!("waiting for data: {message}"));
            if *failed {
                // A block a person must lift: Ready says so, with a Warning.
                set_ready_reason(&mut plan, reason);
            }
            return plan;
        }
        DataState::Ready { .. } => plan.say(
            condition_types::DATA_READY,
            true,
            reasons::DATA_READY,
            "the DataStage is Ready",
        ),
        _ => {}
    }

    // A queued job runs only while Kueue admits it: no pod of it exists otherwise.
    match inputs.queue {
        QueueState::NotQueued => {}
        QueueState::Admitted { message, .. } => plan.say(
            condition_types::ADMITTED,
            true,
            reasons::ADMITTED,
            message.clone(),
        ),
        // Not started, so it cannot jump the queue; a gang that runs already (the operator
        // restarted without the integration) is not killed for it.
        QueueState::IntegrationOff { queue } => {
            let detail = format!(
                "labelled for Kueue queue {queue}, but this operator runs without its Kueue integration (--kueue, Helm kueue.enabled): {}",
                if gang_exists {
                    "its running gang is left alone"
                } else {
                    "not started, so it cannot jump the queue"
                }
            );
            plan.say(
                condition_types::ADMITTED,
                false,
                reasons::KUEUE_INTEGRATION_OFF,
                detail.clone(),
            );
            if !gang_exists {
                plan.phase = P::Pending;
                phase_conditions(&mut plan, &detail);
                return plan;
            }
        }
        QueueState::Waiting { message } => {
            plan.phase = P::Queued;
            plan.delete_pods = every_pod(observed);
            plan.say(
                condition_types::ADMITTED,
                false,
                reasons::QUEUED,
                message.clone(),
            );
            phase_conditions(&mut plan, message);
            return plan;
        }
        QueueState::Evicted { reason, message } => {
            plan.phase = P::Suspended;
            plan.delete_pods = every_pod(observed);
            // As for runPolicy.suspend: the deadline counts from the next start.
            plan.start_time = None;
            let detail = format!(
                "evicted by Kueue ({reason}): {message}; its pods are deleted and it starts again when admitted again"
            );
            plan.say(condition_types::ADMITTED, false, reason, detail.clone());
            plan.say(condition_types::SUSPENDED, true, reason, detail.clone());
            phase_conditions(&mut plan, &detail);
            return plan;
        }
    }

    match inputs.pool {
        PoolState::Provisioning { message } if !gang_exists => {
            plan.phase = P::ProvisioningNodes;
            plan.say(
                condition_types::NODES_READY,
                false,
                reasons::PROVISIONING,
                message.clone(),
            );
            phase_conditions(&mut plan, message);
            plan.requeue(Duration::from_secs(10));
            return plan;
        }
        PoolState::Failed { message } => {
            return finish(
                plan,
                inputs,
                P::Failed,
                reasons::NODE_POOL_FAILED,
                message.clone(),
            );
        }
        PoolState::Ready { message } => plan.say(
            condition_types::NODES_READY,
            true,
            reasons::NODES_READY,
            message.clone(),
        ),
        _ => {}
    }

    // Failures of the current gang.
    let started = observed.launcher.is_some();
    let worker_failure = observed
        .workers
        .iter()
        .enumerate()
        .find_map(|(i, w)| match w {
            Some(pod) => match &pod.life {
                PodLife::Failed(exit) => {
                    Some((format!("worker {}", describe(pod, exit)), pod.about()))
                }
                _ if pod.is_deleting() && started => {
                    Some((format!("worker {} was deleted", pod.name), pod.about()))
                }
                _ => None,
            },
            None if started => {
                let name = super::names::worker_pod(&job.name, i as u32);
                Some((format!("worker {name} was deleted"), PodRef::named(name)))
            }
            None => None,
        });
    let launcher_exit = observed.launcher.as_ref().and_then(|l| match &l.life {
        PodLife::Failed(exit) => Some((l, exit, false)),
        PodLife::Succeeded(exit) => Some((l, exit, true)),
        _ => None,
    });
    // A launcher that lost a peer (75) has most often lost it to a worker that died, and on a
    // real node it can notice that before the kubelet reports the worker: for a few seconds
    // after it ended, wait for the workers' state, so a restart names the cause (the worker
    // and its exit) rather than the symptom.
    let peer_lost_wait = match launcher_exit {
        Some((_, exit, false))
            if worker_failure.is_none()
                && exit.code == i32::from(ringmaster_contract::trainer::exit::PEER_LOST) =>
        {
            exit.finished_at
                .as_ref()
                .map(|finished| {
                    (PEER_LOST_CAUSE_WAIT.as_secs_f64() - seconds_between(finished, inputs.now))
                        .min(PEER_LOST_CAUSE_WAIT.as_secs_f64())
                })
                .filter(|left| *left > 0.0)
        }
        _ => None,
    };
    if let Some(left) = peer_lost_wait {
        plan.requeue(Duration::from_secs_f64(left));
    }
    let launcher_exit = launcher_exit.filter(|_| peer_lost_wait.is_none());
    let retryable_launcher_failure = launcher_exit
        .filter(|(_, exit, ok)| !ok && launcher_exit_is_retryable(exit))
        .map(|(pod, exit, _)| (format!("launcher {}", describe(pod, exit)), pod.about()));

    // A worker's failure is the cause even when the launcher failed because of it.
    if let Some((cause, pod)) = worker_failure.or(retryable_launcher_failure) {
        plan.about = Some(pod);
        let limit = job.run_policy.backoff_limit;
        if status.restarts >= limit {
            let detail = format!(
                "{cause}; restarted {} times (runPolicy.backoffLimit {limit})",
                status.restarts
            );
            return finish(
                plan,
                inputs,
                P::Failed,
                reasons::BACKOFF_LIMIT_EXCEEDED,
                detail,
            );
        }
        plan.phase = P::Restarting;
        plan.restarts = status.restarts + 1;
        plan.delete_pods = every_pod(observed);
        let wait = restart_backoff(inputs.restart_backoff, plan.restarts);
        let detail = format!(
            "{cause}; restarting the gang (restart {} of {limit}) in {} s",
            plan.restarts,
            wait.as_secs()
        );
        plan.say(
            condition_types::RESTARTING,
            true,
            reasons::RESTARTING,
            detail.clone(),
        );
        plan.say(
            condition_types::WORKERS_READY,
            false,
            reasons::RESTARTING,
            detail.clone(),
        );
        plan.requeue(wait);
        phase_conditions(&mut plan, &detail);
        return plan;
    }
    if let Some((pod, exit, ok)) = launcher_exit {
        if ok {
            plan.result = parse_result(&exit.message);
            let detail = match &plan.result {
                Some(r) => format!(
                    "the launcher exited 0: {} steps, {:.1} images/s, final loss {:.4}",
                    r.steps.unwrap_or_default(),
                    r.images_per_second.unwrap_or_default(),
                    r.final_loss.unwrap_or_default()
                ),
                None => "the launcher exited 0".to_string(),
            };
            return finish(plan, inputs, P::Succeeded, reasons::SUCCEEDED, detail);
        }
        let detail = format!(
            "launcher {} (not retried: the program's own failure)",
            describe(pod, exit)
        );
        plan.about = Some(pod.about());
        return finish(plan, inputs, P::Failed, reasons::LAUNCHER_FAILED, detail);
    }

    // Waiting out the backoff after a restart.
    if let Some(restarting) = status
        .conditions
        .iter()
        .find(|c| c.type_ == condition_types::RESTARTING && c.status == "True")
        && !gang_exists
    {
        let wait = restart_backoff(inputs.restart_backoff, status.restarts).as_secs_f64()
            - seconds_between(&restarting.last_transition_time, inputs.now);
        if wait > 0.0 {
            plan.phase = P::Restarting;
            plan.say(
                condition_types::RESTARTING,
                true,
                reasons::RESTARTING,
                restarting.message.clone(),
            );
            plan.requeue(Duration::from_secs_f64(wait));
            // An old pod stuck being deleted would hold the next gang back once the wait is
            // over: said now, not minutes later.
            let stuck = stuck_terminating(observed, &job.namespace, inputs.now);
            if let Some(after) = stuck.next_look {
                plan.requeue(after);
            }
            match stuck.workers.or(stuck.launcher) {
                Some(block) => {
                    phase_conditions(&mut plan, &block.message);
                    set_ready_reason(&mut plan, block.reason);
                    plan.about = Some(block.pod);
                }
                None => phase_conditions(&mut plan, &restarting.message.clone()),
            }
            return plan;
        }
    }

    // Normal progress: workers first, the launcher once every worker is ready.
    let stuck = stuck_terminating(observed, &job.namespace, inputs.now);
    if stuck.workers.is_some() || stuck.launcher.is_some() {
        // Its deletion wakes the job; the look covers a missed event.
        plan.requeue(NAME_IN_USE_RECHECK);
    }
    if let Some(after) = stuck.next_look {
        plan.requeue(after);
    }
    if stale.is_empty() {
        plan.create_workers = observed
            .workers
            .iter()
            .enumerate()
            .filter(|(_, w)| w.is_none())
            .map(|(i, _)| i as u32)
            .collect();
    } else if stuck.workers.is_none() {
        plan.requeue(Duration::from_secs(1));
    }
    let ready = observed.ready_workers();
    let all_ready = ready == job.workers as usize;
    if all_ready && observed.launcher.is_none() && stale.is_empty() {
        plan.create_launcher = true;
        plan.start_time = plan.start_time.or_else(|| Some(inputs.now.clone()));
        if let Some(deadline) = job.run_policy.active_deadline_seconds {
            plan.requeue(Duration::from_secs(u64::try_from(deadline).unwrap_or(1)));
        }
    }
    let launcher_running = observed
        .launcher
        .as_ref()
        .is_some_and(|l| matches!(l.life, PodLife::Running { .. }) && !l.is_deleting());
    plan.say(condition_types::RESTARTING, false, reasons::RUNNING, "");
    // A pod stuck being deleted holds back the pods that would take its name.
    let worker_blocked = stuck.workers.or_else(|| {
        observed
            .workers
            .iter()
            .flatten()
            .find_map(|w| blocked(super::names::WORKER_ROLE, w))
    });
    let launcher_blocked = stuck.launcher.or_else(|| {
        observed
            .launcher
            .as_ref()
            .and_then(|l| blocked(super::names::LAUNCHER_ROLE, l))
    });
    if all_ready {
        plan.say(
            condition_types::WORKERS_READY,
            true,
            reasons::RUNNING,
            format!("{ready}/{} workers ready", job.workers),
        );
    } else if let Some(block) = worker_blocked.clone() {
        plan.say(
            condition_types::WORKERS_READY,
            false,
            block.reason,
            block.message,
        );
    } else {
        plan.say(
            condition_types::WORKERS_READY,
            false,
            reasons::STARTING,
            format!("{ready}/{} workers ready", job.workers),
        );
    }
    let detail = if launcher_running {
        plan.phase = P::Running;
        format!(
            "{} ranks on {} workers are running",
            job.world_size(),
            job.workers
        )
    } else {
        plan.phase = P::Starting;
        plan.conditions
            .iter()
            .find(|c| c.type_ == condition_types::WORKERS_READY)
            .map(|c| {
                if all_ready {
                    "every worker is ready; starting the launcher".to_string()
                } else {
                    c.message.clone()
                }
            })
            .unwrap_or_default()
    };
    // What blocks the start is also why the job is not Ready.
    match worker_blocked.or(launcher_blocked) {
        Some(block) => {
            phase_conditions(&mut plan, &block.message);
            set_ready_reason(&mut plan, block.reason);
            plan.about = Some(block.pod);
        }
        None => phase_conditions(&mut plan, &detail),
    }
    plan
}

/// Puts what blocks the job as the reason of Ready (and Reconciling), for `kubectl get`,
/// `kubectl wait` and Flux alike.
fn set_ready_reason(plan: &mut Plan, reason: &'static str) {
    for condition in plan.conditions.iter_mut() {
        if condition.type_ == condition_types::READY
            || condition.type_ == condition_types::RECONCILING
        {
            condition.reason = reason;
        }
    }
}
