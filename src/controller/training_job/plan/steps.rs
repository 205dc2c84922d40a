//! The plan's steps, in the order [`super::plan`] takes them. Each either settles the plan
//! ([`ControlFlow::Break`]: what it found decides the phase) or adds what it found and lets
//! the next step go on.

use std::ops::ControlFlow;
use std::time::Duration;

use super::blocks::{self, Block, blocked, describe, every_pod, stuck_terminating};
use super::{
    NAME_IN_USE_RECHECK, PEER_LOST_CAUSE_WAIT, Plan, PlanInputs, finish,
    launcher_exit_is_retryable, parse_result, phase_conditions, restart_backoff, set_ready_reason,
};
use crate::api::TrainingJobPhase as P;
use crate::controller::training_job::condition_names::{condition_types, reasons};
use crate::controller::training_job::names;
use crate::controller::training_job::observe::{PodLife, PodRef, PodState};
use crate::controller::training_job::state::{DataState, PoolState, QueueState, seconds_between};

/// What a step says: settled, or go on.
pub type Step = ControlFlow<()>;

/// Finished jobs stay finished; only their clean-up and TTL remain.
pub fn finished(plan: &mut Plan, inputs: &PlanInputs<'_>) -> Step {
    let status = inputs.status;
    if !matches!(status.phase, P::Succeeded | P::Failed) {
        return ControlFlow::Continue(());
    }
    plan.delete_pods = blocks::cleanup(inputs.observed, inputs.job.run_policy.clean_pod_policy);
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
            reasons::START_TIMEOUT => reasons::START_TIMEOUT,
            reasons::LAUNCHER_FAILED => reasons::LAUNCHER_FAILED,
            reasons::PREFLIGHT_FAILED => reasons::PREFLIGHT_FAILED,
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
    super::ttl(plan, inputs);
    phase_conditions(plan, &previous);
    ControlFlow::Break(())
}

/// `runPolicy.suspend`: every pod goes, and the deadline counts from the next start.
pub fn suspend(plan: &mut Plan, inputs: &PlanInputs<'_>) -> Step {
    if !inputs.job.run_policy.suspend {
        return ControlFlow::Continue(());
    }
    plan.phase = P::Suspended;
    plan.delete_pods = every_pod(inputs.observed);
    plan.start_time = None;
    phase_conditions(
        plan,
        "runPolicy.suspend is true: the job's pods are deleted; set it to false to run again",
    );
    ControlFlow::Break(())
}

/// `runPolicy.activeDeadlineSeconds`, counted while the job may run: not while Kueue holds
/// it back.
pub fn deadline(plan: &mut Plan, inputs: &PlanInputs<'_>) -> Step {
    let held_by_kueue = matches!(
        inputs.queue,
        QueueState::Waiting { .. } | QueueState::Evicted { .. }
    );
    let (Some(deadline), Some(start), false) = (
        inputs.job.run_policy.active_deadline_seconds,
        &inputs.status.start_time,
        held_by_kueue,
    ) else {
        return ControlFlow::Continue(());
    };
    let left = deadline as f64 - seconds_between(start, inputs.now);
    if left <= 0.0 {
        let detail =
            format!("the job ran longer than runPolicy.activeDeadlineSeconds ({deadline} s)");
        finish(plan, inputs, P::Failed, reasons::DEADLINE_EXCEEDED, detail);
        return ControlFlow::Break(());
    }
    plan.requeue(Duration::from_secs_f64(left));
    ControlFlow::Continue(())
}

/// `runPolicy.startTimeoutSeconds`: a gang that has not started in time fails the job, with
/// what held it. The clock runs from the gang's first worker placed on a node (made, for a
/// job with a node pool of its own, whose pods have nowhere else to wait) until its launcher
/// is made: waiting for room in the cluster or a queue does not count.
pub fn start_timeout(plan: &mut Plan, inputs: &PlanInputs<'_>) -> Step {
    let observed = inputs.observed;
    if observed.launcher.is_some() || !observed.stale.is_empty() {
        return ControlFlow::Continue(());
    }
    let own_pool = inputs.job.node_pool.is_some();
    let workers = || {
        observed
            .workers
            .iter()
            .flatten()
            .filter(|w| !w.is_deleting())
    };
    let since = workers()
        .filter_map(|w| {
            if own_pool {
                w.created.as_ref()
            } else {
                w.scheduled.as_ref()
            }
        })
        .min_by_key(|t| t.0);
    let Some(since) = since else {
        return ControlFlow::Continue(());
    };
    let limit = inputs.job.run_policy.start_timeout_seconds;
    let left = limit as f64 - seconds_between(since, inputs.now);
    if left > 0.0 {
        plan.requeue(Duration::from_secs_f64(left));
        return ControlFlow::Continue(());
    }
    let cause = workers()
        .find_map(|w| blocked(names::WORKER_ROLE, w).map(|b| b.message))
        .or_else(|| {
            (observed.workers.iter().any(Option::is_none))
                .then(|| "not every worker was made".into())
        })
        .or_else(|| workers().find(|w| !w.is_ready()).map(not_ready))
        .unwrap_or_else(|| "the launcher was not made".into());
    let detail =
        format!("the gang did not start within runPolicy.startTimeoutSeconds ({limit} s): {cause}");
    finish(plan, inputs, P::Failed, reasons::START_TIMEOUT, detail);
    ControlFlow::Break(())
}

/// Why a worker that is not blocked is not ready, in words.
fn not_ready(worker: &PodState) -> String {
    match worker.life {
        PodLife::Running { .. } => format!(
            "worker {} runs but never got ready (its readiness probe: ssh with the job's key \
             to its own name, served by its sshd)",
            worker.name
        ),
        _ => format!("worker {} never got running", worker.name),
    }
}

/// Pods of earlier gangs go first: new pods reuse their names.
pub fn stale(plan: &mut Plan, inputs: &PlanInputs<'_>) -> Step {
    plan.delete_pods = inputs
        .observed
        .stale
        .iter()
        .filter(|p| !p.is_deleting())
        .map(|p| p.name.clone())
        .collect();
    ControlFlow::Continue(())
}

/// The DataStage: a job without a gang waits for its data.
pub fn data(plan: &mut Plan, inputs: &PlanInputs<'_>) -> Step {
    match inputs.data {
        DataState::Waiting { message, failed } if !inputs.observed.gang_exists() => {
            plan.phase = P::WaitingForData;
            let reason = if *failed {
                reasons::DATA_STAGE_FAILED
            } else {
                reasons::WAITING_FOR_DATA
            };
            plan.say(condition_types::DATA_READY, false, reason, message.clone());
            phase_conditions(plan, &format!("waiting for data: {message}"));
            if *failed {
                // A block a person must lift: Ready says so, with a Warning.
                set_ready_reason(plan, reason);
            }
            ControlFlow::Break(())
        }
        DataState::Ready { .. } => {
            plan.say(
                condition_types::DATA_READY,
                true,
                reasons::DATA_READY,
                "the DataStage is Ready",
            );
            ControlFlow::Continue(())
        }
        _ => ControlFlow::Continue(()),
    }
}

/// Kueue: a queued job runs only while Kueue admits it; no pod of it exists otherwise.
pub fn queue(plan: &mut Plan, inputs: &PlanInputs<'_>) -> Step {
    let gang_exists = inputs.observed.gang_exists();
    match inputs.queue {
        QueueState::NotQueued => ControlFlow::Continue(()),
        QueueState::Admitted { message, .. } => {
            plan.say(
                condition_types::ADMITTED,
                true,
                reasons::ADMITTED,
                message.clone(),
            );
            ControlFlow::Continue(())
        }
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
            if gang_exists {
                return ControlFlow::Continue(());
            }
            plan.phase = P::Pending;
            phase_conditions(plan, &detail);
            ControlFlow::Break(())
        }
        QueueState::Waiting { message } => {
            plan.phase = P::Queued;
            plan.delete_pods = every_pod(inputs.observed);
            plan.say(
                condition_types::ADMITTED,
                false,
                reasons::QUEUED,
                message.clone(),
            );
            phase_conditions(plan, message);
            ControlFlow::Break(())
        }
        QueueState::Evicted { reason, message } => {
            plan.phase = P::Suspended;
            plan.delete_pods = every_pod(inputs.observed);
            // As for runPolicy.suspend: the deadline counts from the next start.
            plan.start_time = None;
            let detail = format!(
                "evicted by Kueue ({reason}): {message}; its pods are deleted and it starts again when admitted again"
            );
            plan.say(condition_types::ADMITTED, false, reason, detail.clone());
            plan.say(condition_types::SUSPENDED, true, reason, detail.clone());
            phase_conditions(plan, &detail);
            ControlFlow::Break(())
        }
    }
}

/// The job's own node pool: a job without a gang waits for its nodes.
pub fn pool(plan: &mut Plan, inputs: &PlanInputs<'_>) -> Step {
    match inputs.pool {
        PoolState::Provisioning { message } if !inputs.observed.gang_exists() => {
            plan.phase = P::ProvisioningNodes;
            plan.say(
                condition_types::NODES_READY,
                false,
                reasons::PROVISIONING,
                message.clone(),
            );
            phase_conditions(plan, message);
            plan.requeue(Duration::from_secs(10));
            ControlFlow::Break(())
        }
        // A gang that runs follows its pods and nodes, not Azure's word on the pool (a failed
        // AKS upgrade, a refused read): the pool's state is said on NodesReady, and should its
        // nodes go, the pods' failure restarts or fails the job as any node loss does.
        PoolState::Failed { message } if inputs.observed.gang_exists() => {
            plan.say(
                condition_types::NODES_READY,
                false,
                reasons::NODE_POOL_FAILED,
                format!("{message} (the job's pods run on: it follows them, not the pool's state)"),
            );
            ControlFlow::Continue(())
        }
        PoolState::Failed { message } => {
            finish(
                plan,
                inputs,
                P::Failed,
                reasons::NODE_POOL_FAILED,
                message.clone(),
            );
            ControlFlow::Break(())
        }
        PoolState::Ready { message } => {
            plan.say(
                condition_types::NODES_READY,
                true,
                reasons::NODES_READY,
                message.clone(),
            );
            ControlFlow::Continue(())
        }
        _ => ControlFlow::Continue(()),
    }
}

/// What ended a gang attempt: words for the job's conditions, the pod, and its exit code
/// when it exited.
struct Cause {
    words: String,
    pod: PodRef,
    exit_code: Option<i32>,
}

impl Cause {
    fn exited(
        role: &str,
        pod: &PodState,
        exit: &crate::controller::training_job::observe::Exit,
    ) -> Self {
        Self {
            words: format!("{role} {}", describe(pod, exit)),
            pod: pod.about(),
            exit_code: Some(exit.code),
        }
    }

    fn gone(words: String, pod: PodRef) -> Self {
        Self {
            words,
            pod,
            exit_code: None,
        }
    }
}

/// The first worker of the current gang that failed or was deleted after the start, as the
/// cause of a restart.
fn worker_failure(inputs: &PlanInputs<'_>) -> Option<Cause> {
    let started = inputs.observed.launcher.is_some();
    inputs
        .observed
        .workers
        .iter()
        .enumerate()
        .find_map(|(i, w)| match w {
            Some(pod) => match &pod.life {
                PodLife::Failed(exit) => Some(Cause::exited("worker", pod, exit)),
                _ if pod.is_deleting() && started => Some(Cause::gone(
                    format!("worker {} was deleted", pod.name),
                    pod.about(),
                )),
                _ => None,
            },
            None if started => {
                let name = names::worker_pod(&inputs.job.name, i as u32);
                Some(Cause::gone(
                    format!("worker {name} was deleted"),
                    PodRef::named(name),
                ))
            }
            None => None,
        })
}

/// How much longer to wait for a worker's failure to show after the launcher lost a peer
/// (75): on a real node the launcher can notice a worker die before the kubelet reports it,
/// and a restart should name the cause (the worker and its exit), not the symptom.
fn peer_lost_wait(inputs: &PlanInputs<'_>, launcher: Option<(&PodState, bool)>) -> Option<f64> {
    let Some((pod, false)) = launcher else {
        return None;
    };
    let exit = match &pod.life {
        PodLife::Failed(exit) => exit,
        _ => return None,
    };
    if exit.code != i32::from(ringmaster_contract::trainer::exit::PEER_LOST) {
        return None;
    }
    exit.finished_at
        .as_ref()
        .map(|finished| {
            (PEER_LOST_CAUSE_WAIT.as_secs_f64() - seconds_between(finished, inputs.now))
                .min(PEER_LOST_CAUSE_WAIT.as_secs_f64())
        })
        .filter(|left| *left > 0.0)
}

/// How the current gang ended or failed: a worker's failure restarts the gang (or fails the
/// job past `backoffLimit`), as does the launcher's retryable exit; its other exits end the
/// job, succeeded or failed.
pub fn failure(plan: &mut Plan, inputs: &PlanInputs<'_>) -> Step {
    let observed = inputs.observed;
    let worker_failure = worker_failure(inputs);
    let launcher = observed.launcher.as_ref().and_then(|l| match &l.life {
        PodLife::Failed(_) => Some((l, false)),
        PodLife::Succeeded(_) => Some((l, true)),
        _ => None,
    });
    let wait = worker_failure
        .is_none()
        .then(|| peer_lost_wait(inputs, launcher))
        .flatten();
    if let Some(left) = wait {
        plan.requeue(Duration::from_secs_f64(left));
    }
    let launcher = launcher.filter(|_| wait.is_none());
    let retryable_launcher_failure = launcher.and_then(|(pod, ok)| match &pod.life {
        PodLife::Failed(exit) if !ok && launcher_exit_is_retryable(exit) => {
            Some(Cause::exited("launcher", pod, exit))
        }
        _ => None,
    });
    // A worker's failure is the cause even when the launcher failed because of it.
    if let Some(cause) = worker_failure.or(retryable_launcher_failure) {
        record_failure(plan, inputs, &cause);
        plan.about = Some(cause.pod);
        restart(plan, inputs, &cause.words);
        return ControlFlow::Break(());
    }
    let Some((pod, ok)) = launcher else {
        return ControlFlow::Continue(());
    };
    let exit = match &pod.life {
        PodLife::Succeeded(exit) | PodLife::Failed(exit) => exit,
        _ => return ControlFlow::Continue(()),
    };
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
        finish(plan, inputs, P::Succeeded, reasons::SUCCEEDED, detail);
        return ControlFlow::Break(());
    }
    let cause = Cause::exited("launcher", pod, exit);
    let (reason, verdict) = launcher_failure_reason(exit);
    let detail = format!("{} (not retried: {verdict})", cause.words);
    record_failure(
        plan,
        inputs,
        &Cause {
            words: detail.clone(),
            ..cause
        },
    );
    plan.about = Some(pod.about());
    finish(plan, inputs, P::Failed, reason, detail);
    ControlFlow::Break(())
}

/// The Failed condition's reason for a launcher exit that is not retried, and why it is
/// not: the trainer's preflight found the fabric too slow (a restart on the same nodes
/// measures the same), or the program failed on its own.
fn launcher_failure_reason(
    exit: &crate::controller::training_job::observe::Exit,
) -> (&'static str, &'static str) {
    if exit.code == i32::from(ringmaster_contract::trainer::exit::FABRIC_TOO_SLOW) {
        (
            reasons::PREFLIGHT_FAILED,
            "the fabric is below infiniband.preflight's minimum on these nodes",
        )
    } else {
        (reasons::LAUNCHER_FAILED, "the program's own failure")
    }
}

/// `status.lastFailure`: this gang attempt failed, because of `cause`. The restart that
/// follows deletes the workers and their logs; this stays, with the launcher's last words
/// when it ended, and the launcher itself stays too ([`blocks::restart_deletions`]).
fn record_failure(plan: &mut Plan, inputs: &PlanInputs<'_>, cause: &Cause) {
    let attempt = inputs.status.restarts;
    // The same failure seen again (the status write raced the next look) keeps its time.
    if plan
        .last_failure
        .as_ref()
        .is_some_and(|f| f.attempt == attempt && f.pod == cause.pod.name)
    {
        return;
    }
    let launcher = inputs.observed.launcher.as_ref();
    let launcher_exit = launcher.and_then(|l| match &l.life {
        PodLife::Failed(exit) => Some((l, exit)),
        _ => None,
    });
    plan.last_failure = Some(crate::api::LastFailure {
        attempt,
        time: inputs.now.clone(),
        pod: cause.pod.name.clone(),
        exit_code: cause.exit_code,
        message: ringmaster_contract::shorten(&cause.words, 500),
        launcher: launcher_exit.map(|(l, _)| l.name.clone()),
        launcher_log: launcher_exit
            .map(|(_, exit)| blocks::log_tail(&exit.message, LAUNCHER_LOG_BYTES))
            .filter(|tail| !tail.is_empty()),
    });
}

/// The most of a failed launcher's log kept in `status.lastFailure`: the status stays small
/// (it is read by every watcher of the job), and mpirun's last lines fit.
const LAUNCHER_LOG_BYTES: usize = 1024;

/// A restart of the gang because of `cause`, or the job's failure once `backoffLimit`
/// restarts are used up.
fn restart(plan: &mut Plan, inputs: &PlanInputs<'_>, cause: &str) {
    let status = inputs.status;
    let limit = inputs.job.run_policy.backoff_limit;
    if status.restarts >= limit {
        let detail = format!(
            "{cause}; restarted {} times (runPolicy.backoffLimit {limit})",
            status.restarts
        );
        finish(
            plan,
            inputs,
            P::Failed,
            reasons::BACKOFF_LIMIT_EXCEEDED,
            detail,
        );
        return;
    }
    plan.phase = P::Restarting;
    plan.restarts = status.restarts + 1;
    plan.delete_pods = blocks::restart_deletions(inputs.observed);
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
    phase_conditions(plan, &detail);
}

/// Waiting out the backoff after a restart.
pub fn backoff(plan: &mut Plan, inputs: &PlanInputs<'_>) -> Step {
    let status = inputs.status;
    let Some(restarting) = status
        .conditions
        .iter()
        .find(|c| c.type_ == condition_types::RESTARTING && c.status == "True")
        .filter(|_| !inputs.observed.gang_exists())
    else {
        return ControlFlow::Continue(());
    };
    let wait = restart_backoff(inputs.restart_backoff, status.restarts).as_secs_f64()
        - seconds_between(&restarting.last_transition_time, inputs.now);
    if wait <= 0.0 {
        return ControlFlow::Continue(());
    }
    plan.phase = P::Restarting;
    plan.say(
        condition_types::RESTARTING,
        true,
        reasons::RESTARTING,
        restarting.message.clone(),
    );
    plan.requeue(Duration::from_secs_f64(wait));
    // An old pod stuck being deleted would hold the next gang back once the wait is over:
    // said now, not minutes later.
    let stuck = stuck_terminating(inputs.observed, &inputs.job.namespace, inputs.now);
    if let Some(after) = stuck.next_look {
        plan.requeue(after);
    }
    match stuck.workers.or(stuck.launcher) {
        Some(block) => say_blocked(plan, block),
        None => phase_conditions(plan, &restarting.message.clone()),
    }
    ControlFlow::Break(())
}

/// Normal progress: workers first, the launcher once every worker is ready; what blocks the
/// start said on the job.
pub fn progress(plan: &mut Plan, inputs: &PlanInputs<'_>) -> Step {
    let (job, observed) = (inputs.job, inputs.observed);
    let stuck = stuck_terminating(observed, &job.namespace, inputs.now);
    if stuck.workers.is_some() || stuck.launcher.is_some() {
        // Its deletion wakes the job; the look covers a missed event.
        plan.requeue(NAME_IN_USE_RECHECK);
    }
    if let Some(after) = stuck.next_look {
        plan.requeue(after);
    }
    let stale = !observed.stale.is_empty();
    if !stale {
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
    if all_ready && observed.launcher.is_none() && !stale {
        plan.create_launcher = true;
        plan.start_time = plan.start_time.clone().or_else(|| Some(inputs.now.clone()));
        if let Some(deadline) = job.run_policy.active_deadline_seconds {
            plan.requeue(Duration::from_secs(u64::try_from(deadline).unwrap_or(1)));
        }
    }
    plan.say(condition_types::RESTARTING, false, reasons::RUNNING, "");
    // A pod stuck being deleted holds back the pods that would take its name.
    let worker_blocked = stuck.workers.or_else(|| {
        observed
            .workers
            .iter()
            .flatten()
            .find_map(|w| blocked(names::WORKER_ROLE, w))
    });
    let launcher_blocked = stuck.launcher.or_else(|| {
        observed
            .launcher
            .as_ref()
            .and_then(|l| blocked(names::LAUNCHER_ROLE, l))
    });
    say_workers(plan, inputs, ready, worker_blocked.clone());
    let detail = running_or_starting(plan, inputs, all_ready);
    // What blocks the start is also why the job is not Ready.
    match worker_blocked.or(launcher_blocked) {
        Some(block) => say_blocked(plan, block),
        None => phase_conditions(plan, &detail),
    }
    ControlFlow::Break(())
}

/// WorkersReady: all ready, what blocks a worker, or how many are ready.
fn say_workers(plan: &mut Plan, inputs: &PlanInputs<'_>, ready: usize, blocked: Option<Block>) {
    let workers = inputs.job.workers;
    if ready == workers as usize {
        plan.say(
            condition_types::WORKERS_READY,
            true,
            reasons::RUNNING,
            format!("{ready}/{workers} workers ready"),
        );
    } else if let Some(block) = blocked {
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
            format!("{ready}/{workers} workers ready"),
        );
    }
}

/// Running once the launcher runs, else Starting; the words of the phase.
fn running_or_starting(plan: &mut Plan, inputs: &PlanInputs<'_>, all_ready: bool) -> String {
    let launcher_running = inputs
        .observed
        .launcher
        .as_ref()
        .is_some_and(|l| matches!(l.life, PodLife::Running { .. }) && !l.is_deleting());
    if launcher_running {
        plan.phase = P::Running;
        return format!(
            "{} ranks on {} workers are running",
            inputs.job.world_size(),
            inputs.job.workers
        );
    }
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
}

/// The phase's words are what blocks the job, and so is Ready's reason.
fn say_blocked(plan: &mut Plan, block: Block) {
    phase_conditions(plan, &block.message);
    set_ready_reason(plan, block.reason);
    plan.about = Some(block.pod);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::training_job::observe::Exit;
    use ringmaster_contract::trainer::exit;

    fn exit_with(code: u8) -> Exit {
        Exit {
            code: i32::from(code),
            reason: "Error".into(),
            message: String::new(),
            finished_at: None,
        }
    }

    /// The preflight's code is a verdict with a reason of its own; a lost peer is retried;
    /// the program's other codes stay `LauncherFailed`.
    #[test]
    fn a_fabric_too_slow_is_a_verdict_with_its_own_reason() {
        let slow = exit_with(exit::FABRIC_TOO_SLOW);
        assert!(!launcher_exit_is_retryable(&slow));
        assert_eq!(launcher_failure_reason(&slow).0, reasons::PREFLIGHT_FAILED);
        assert!(launcher_exit_is_retryable(&exit_with(exit::PEER_LOST)));
        for code in [exit::FAILED, exit::INVALID_SETTINGS, exit::PANICKED] {
            assert!(!launcher_exit_is_retryable(&exit_with(code)), "{code}");
            assert_eq!(
                launcher_failure_reason(&exit_with(code)).0,
                reasons::LAUNCHER_FAILED,
                "{code}"
            );
        }
    }
}
