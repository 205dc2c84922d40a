//! The TrainingJob state machine: from the validated spec, the last status, the observed
//! pods and what was found around them, what to create, what to delete and what the status
//! says. Pure: the clock comes in. [`plan`] takes [`steps`] in order until one settles the
//! phase, then holds back the pods it must not make yet and says which of the job's other
//! children to write.

mod blocks;
pub use blocks::{Block, blocked};
pub mod steps;

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::condition_names::{condition_types, reasons};
use super::names::ChildNaming;
use super::observe::{Exit, Observed, PodRef};
use super::recent::{FRESH_FOR, RecentJob};
use super::spec::ValidatedTrainingJob;
use super::state::{DataState, NameHolder, PoolState, QueueState, seconds_between};
use super::worker_dns::{self, Published};
use crate::api::{LastFailure, TrainingJobPhase, TrainingJobStatus, TrainingResult};
use crate::controller::conditions::DesiredCondition;
use blocks::cleanup;

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
    /// Who holds the names of pods the job would make, when not the job's own pods (from
    /// the cache, and from a create's 409).
    pub names_in_use: &'a BTreeMap<String, NameHolder>,
    /// What this operator wrote for the job moments ago that the caches do not show yet.
    pub recent: &'a RecentJob,
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
    /// The last gang attempt that failed, and why.
    pub last_failure: Option<LastFailure>,
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
    /// Which of the job's Secret, Service and PodGroup to write before its pods.
    pub children: Children,
    /// How the gang's pods name the Secret and Service.
    pub naming: ChildNaming,
    /// Pods of this gang made moments ago that the cache does not show yet.
    pub unseen_pods: bool,
    /// The workers' DNS records to write to the job's EndpointSlice ([`worker_dns`]).
    pub publish: Option<Published>,
}

/// Which of the job's Secret, Service and PodGroup to write before its pods.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Children {
    /// Neither: they were written moments ago, or no worker is being made.
    #[default]
    Keep,
    /// Make them if they do not exist (a gang's workers are being made).
    Ensure,
    /// The spec changed since they were made: make them, and apply the Service over the old
    /// one (its ports follow the spec).
    Update,
}

/// Whether a refusal said on the job (its `ChildRejected` message) was of the Secret,
/// Service or PodGroup: written again on the next look, since a change of spec they were to
/// follow would be lost otherwise.
pub fn refused_children(message: &str) -> bool {
    [
        "creating Secret ",
        "applying Service ",
        "creating PodGroup ",
        "updating PodGroup ",
    ]
    .iter()
    .any(|prefix| message.starts_with(prefix))
}

impl Plan {
    fn new(inputs: &PlanInputs<'_>) -> Self {
        Self {
            phase: inputs.status.phase,
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
            last_failure: inputs.status.last_failure.clone(),
            conditions: Vec::new(),
            requeue_after: None,
            delete_job: false,
            message: String::new(),
            about: None,
            children: Children::Keep,
            naming: ChildNaming::default(),
            unseen_pods: false,
            publish: None,
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

/// Decides the next step of a job: the [`steps`] in order until one settles the phase; then
/// the pods not to make yet (their names held, or made moments ago), and which of the job's
/// other children to write.
pub fn plan(inputs: &PlanInputs<'_>) -> Plan {
    use steps::*;
    let mut plan = Plan::new(inputs);
    let steps: [fn(&mut Plan, &PlanInputs<'_>) -> Step; 11] = [
        finished,
        suspend,
        deadline,
        stale,
        data,
        queue,
        pool,
        failure,
        backoff,
        start_timeout,
        progress,
    ];
    for step in steps {
        if let ControlFlow::Break(()) = step(&mut plan, inputs) {
            break;
        }
    }
    hold_back_names_in_use(
        &mut plan,
        &inputs.job.name,
        inputs.names_in_use,
        inputs.status.start_time.as_ref(),
    );
    hold_back_unseen(&mut plan, inputs);
    choose_children(&mut plan, inputs);
    choose_addresses(&mut plan, inputs);
    plan
}

/// The workers' DNS records to write, if any ([`worker_dns::to_publish`]); none for a
/// finished job (its workers go, and so does its slice, with the job).
fn choose_addresses(plan: &mut Plan, inputs: &PlanInputs<'_>) {
    if matches!(
        plan.phase,
        TrainingJobPhase::Succeeded | TrainingJobPhase::Failed
    ) {
        return;
    }
    let service = super::names::worker_service(inputs.job, plan.naming);
    let (wanted, complete) = worker_dns::wanted(inputs.observed);
    let published = inputs.observed.published.as_ref();
    plan.publish = worker_dns::to_publish(&service, wanted, complete, published)
        .map(|addresses| Published { service, addresses });
}

/// Pods of this gang made moments ago that the cache does not show yet are not made again;
/// the job looks again when the memory fades, should the cache never show them.
fn hold_back_unseen(plan: &mut Plan, inputs: &PlanInputs<'_>) {
    let unseen = inputs.recent.unseen(plan.restarts);
    plan.unseen_pods = !unseen.is_empty();
    let job = &inputs.job.name;
    let worker_held_back = |i: &u32| unseen.contains(&super::names::worker_pod(job, *i));
    let launcher_held_back =
        plan.create_launcher && unseen.contains(&super::names::launcher_pod(job, plan.restarts));
    if launcher_held_back || plan.create_workers.iter().any(worker_held_back) {
        plan.requeue(FRESH_FOR);
    }
    plan.create_workers.retain(|i| !worker_held_back(i));
    if launcher_held_back {
        plan.create_launcher = false;
    }
}

/// The gang's naming, and which of the Secret, Service and PodGroup go out before its pods:
/// with a gang's workers, and with a new spec (also after a refused write of one of them:
/// they may not have followed this spec), unless they were written moments ago for this
/// spec and gang.
fn choose_children(plan: &mut Plan, inputs: &PlanInputs<'_>) {
    let status = inputs.status;
    plan.naming = if plan.restarts == status.restarts {
        inputs.observed.naming
    } else {
        ChildNaming::UidTagged
    };
    let spec_changed = (status.observed_generation.is_some()
        && status.observed_generation != inputs.generation)
        || crate::controller::conditions::rejected_child(&status.conditions)
            .is_some_and(refused_children);
    plan.children = if inputs
        .recent
        .children_fresh(inputs.generation, plan.restarts, plan.naming)
    {
        Children::Keep
    } else if spec_changed {
        Children::Update
    } else if !plan.create_workers.is_empty() {
        Children::Ensure
    } else {
        Children::Keep
    };
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
    let launcher = super::names::launcher_pod(job, plan.restarts);
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
        resumed_from_run: s.resumed_from_run,
    })
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

/// Ends the job in `phase` (Failed with `reason`): its completion time, its pods by
/// cleanPodPolicy, its TTL, its conditions.
fn finish(
    plan: &mut Plan,
    inputs: &PlanInputs<'_>,
    phase: TrainingJobPhase,
    reason: &'static str,
    detail: String,
) {
    plan.phase = phase;
    plan.completion_time = plan
        .completion_time
        .clone()
        .or_else(|| Some(inputs.now.clone()));
    plan.delete_pods = cleanup(inputs.observed, inputs.job.run_policy.clean_pod_policy);
    if phase == TrainingJobPhase::Failed {
        plan.say(condition_types::FAILED, true, reason, detail.clone());
    }
    ttl(plan, inputs);
    phase_conditions(plan, &detail);
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
