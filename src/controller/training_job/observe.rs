//! What the job's pods say: each pod's state boiled down to what the plan needs. Pure.

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use super::names::{
    ATTEMPT_LABEL, ChildNaming, LAUNCHER_ROLE, ROLE_LABEL, WORKER_INDEX_LABEL, WORKER_ROLE,
};

/// How a pod's main container ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exit {
    /// Exit code.
    pub code: i32,
    /// The container's termination reason (OOMKilled, Error, Completed, ...), or the pod's
    /// (Evicted) when the kubelet set one.
    pub reason: String,
    /// The termination message (the trainer's JSON summary, or the log's tail).
    pub message: String,
    /// When the container ended, as the kubelet reports it.
    pub finished_at: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
}

/// The life of one pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PodLife {
    /// Not scheduled or not started; `unschedulable` carries the scheduler's message.
    Pending { unschedulable: Option<String> },
    /// Running; `ready` when its readiness probe passes.
    Running { ready: bool },
    /// Exited 0.
    Succeeded(Exit),
    /// Exited non-zero, was evicted or lost.
    Failed(Exit),
}

/// Why a pod's container cannot start, as the kubelet reports it while it keeps trying: a
/// wrong image, a Secret or ConfigMap key the container's environment names that does not
/// exist, a command the runtime cannot run. The job waits for the fix, which must show on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stuck {
    /// What kind of problem: [`StuckKind::ImagePull`] or [`StuckKind::Container`].
    pub kind: StuckKind,
    /// The kubelet's reason (ErrImagePull, ImagePullBackOff, CreateContainerConfigError, ...).
    pub reason: String,
    /// The kubelet's message (which image, which Secret, what the runtime said).
    pub message: String,
}

/// The kinds of [`Stuck`], each a condition reason: the kubelet alternates between reasons
/// of one kind (ErrImagePull and ImagePullBackOff) while it retries, and the condition must
/// not flap with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StuckKind {
    /// The image cannot be pulled (or its name is invalid).
    ImagePull,
    /// The container cannot be created or run.
    Container,
}

impl Stuck {
    /// The kubelet's waiting state of a container, when it says the container cannot start;
    /// `None` for the waits of a normal start (ContainerCreating, PodInitializing).
    pub fn of(reason: &str, message: &str) -> Option<Self> {
        let kind = match reason {
            "ErrImagePull"
            | "ImagePullBackOff"
            | "InvalidImageName"
            | "ErrImageNeverPull"
            | "RegistryUnavailable"
            | "SignatureValidationFailed" => StuckKind::ImagePull,
            "CreateContainerConfigError"
            | "CreateContainerError"
            | "RunContainerError"
            | "PreStartHookError"
            | "PostStartHookError"
            | "CrashLoopBackOff" => StuckKind::Container,
            _ => return None,
        };
        Some(Self {
            kind,
            reason: reason.to_string(),
            message: message.to_string(),
        })
    }
}

/// A pod in the job's namespace that the job's words (a restart's cause, what blocks its
/// start) are about: the related object of their Event, which keeps Events of one reason
/// about different pods apart (an Event recorder counts repeats of a reason about the same
/// objects as one series, under the first one's note).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodRef {
    /// Pod name.
    pub name: String,
    /// Pod UID, when known: a pod of the same name made again is another pod.
    pub uid: Option<String>,
}

impl PodRef {
    /// The pod of that name, its UID unknown.
    pub fn named(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            uid: None,
        }
    }
}

/// One pod of the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodState {
    /// Pod name.
    pub name: String,
    /// Pod UID.
    pub uid: Option<String>,
    /// Gang attempt it belongs to.
    pub attempt: Option<i32>,
    /// Its life.
    pub life: PodLife,
    /// Why its container cannot start, while the kubelet retries.
    pub stuck: Option<Stuck>,
    /// When it is being deleted: the end of its grace period (the deletion timestamp).
    pub deletion: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    /// The node it is bound to, when it is: named when the pod is stuck being deleted.
    pub node: Option<String>,
    /// When the API server made it.
    pub created: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    /// When the scheduler placed it on a node (its PodScheduled condition turned True).
    pub scheduled: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    /// Its IP, once it has one: a worker's DNS record (see `worker_dns`).
    pub address: Option<String>,
}

impl PodState {
    /// Reads a pod.
    pub fn of(pod: &Pod) -> Self {
        let attempt = pod.labels().get(ATTEMPT_LABEL).and_then(|a| a.parse().ok());
        let status = pod.status.clone().unwrap_or_default();
        let state = main_container(status.container_statuses.as_deref().unwrap_or_default())
            .and_then(|s| s.state.as_ref());
        let terminated = state.and_then(|s| s.terminated.clone());
        let stuck = state.and_then(|s| s.waiting.as_ref()).and_then(|w| {
            Stuck::of(
                w.reason.as_deref().unwrap_or_default(),
                w.message.as_deref().unwrap_or_default(),
            )
        });
        let exit = |default_reason: &str| {
            let t = terminated.clone().unwrap_or_default();
            Exit {
                code: t.exit_code,
                // The kubelet puts Evicted (and similar) on the pod, not the container.
                reason: status
                    .reason
                    .clone()
                    .or(t.reason.clone())
                    .unwrap_or_else(|| default_reason.to_string()),
                message: t.message.unwrap_or_default(),
                finished_at: t.finished_at,
            }
        };
        let condition = |type_: &str| {
            status
                .conditions
                .as_ref()
                .and_then(|cs| cs.iter().find(|c| c.type_ == type_).cloned())
        };
        let life = match status.phase.as_deref() {
            Some("Succeeded") => PodLife::Succeeded(exit("Completed")),
            Some("Failed") => PodLife::Failed(exit("Error")),
            Some("Running") => PodLife::Running {
                ready: condition("Ready").is_some_and(|c| c.status == "True"),
            },
            _ => PodLife::Pending {
                unschedulable: condition("PodScheduled")
                    .filter(|c| c.status == "False" && c.reason.as_deref() == Some("Unschedulable"))
                    .map(|c| c.message.unwrap_or_default()),
            },
        };
        let scheduled = condition("PodScheduled")
            .filter(|c| c.status == "True")
            .and_then(|c| c.last_transition_time);
        Self {
            name: pod.name_any(),
            uid: pod.metadata.uid.clone(),
            attempt,
            life,
            stuck,
            deletion: pod.metadata.deletion_timestamp.clone(),
            node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
            created: pod.metadata.creation_timestamp.clone(),
            scheduled,
            address: status.pod_ip.clone().filter(|ip| !ip.is_empty()),
        }
    }

    /// Being deleted.
    pub fn is_deleting(&self) -> bool {
        self.deletion.is_some()
    }

    /// This pod, as what the job's words are about.
    pub fn about(&self) -> PodRef {
        PodRef {
            name: self.name.clone(),
            uid: self.uid.clone(),
        }
    }

    /// Running and ready.
    pub fn is_ready(&self) -> bool {
        !self.is_deleting() && matches!(self.life, PodLife::Running { ready: true })
    }

    /// Exited (either way).
    pub fn is_finished(&self) -> bool {
        matches!(self.life, PodLife::Succeeded(_) | PodLife::Failed(_))
    }

    /// Whether it ended in failure.
    pub fn failed(&self) -> bool {
        matches!(self.life, PodLife::Failed(_))
    }
}

/// The status of a pod's own container (`worker` or `launcher`), else the first: the
/// kubelet lists containers by name, so an injected sidecar (`istio-proxy`) can come first.
fn main_container(
    statuses: &[k8s_openapi::api::core::v1::ContainerStatus],
) -> Option<&k8s_openapi::api::core::v1::ContainerStatus> {
    statuses
        .iter()
        .find(|s| s.name == WORKER_ROLE || s.name == LAUNCHER_ROLE)
        .or_else(|| statuses.first())
}

/// Drops from a pod what the controller never reads, before it reaches the shared cache: the
/// spec but its node, annotations, managed fields, and every part of the status but the phase, the
/// pod-level reason, the pod's IP, the Ready and PodScheduled conditions and the own container's
/// termination or why it waits. What is kept is what [`PodState::of`] and the job's pod lookup read
/// (namespace, name, labels, owners, UID, resourceVersion, timestamps); a cached pod gives
/// the same [`PodState`] as the whole pod. Thousands of pods are cached: most of a pod's
/// bytes are its spec and managed fields.
pub fn strip_for_cache(pod: &mut Pod) {
    pod.spec = pod.spec.take().and_then(|s| s.node_name).map(|node_name| {
        k8s_openapi::api::core::v1::PodSpec {
            node_name: Some(node_name),
            ..Default::default()
        }
    });
    let meta = &mut pod.metadata;
    meta.annotations = None;
    meta.managed_fields = None;
    meta.generate_name = None;
    meta.finalizers = None;
    if let Some(status) = pod.status.as_mut() {
        let phase = status.phase.take();
        let reason = status.reason.take();
        let pod_ip = status.pod_ip.take();
        let conditions = status.conditions.take().map(|cs| {
            cs.into_iter()
                .filter(|c| c.type_ == "Ready" || c.type_ == "PodScheduled")
                .map(|c| k8s_openapi::api::core::v1::PodCondition {
                    last_probe_time: None,
                    last_transition_time: None,
                    observed_generation: None,
                    ..c
                })
                .collect()
        });
        let statuses = status.container_statuses.take().unwrap_or_default();
        let main = main_container(&statuses).cloned().map(|c| {
            k8s_openapi::api::core::v1::ContainerStatus {
                name: c.name,
                state: c.state.map(|s| k8s_openapi::api::core::v1::ContainerState {
                    terminated: s.terminated,
                    waiting: s.waiting,
                    ..Default::default()
                }),
                ..Default::default()
            }
        });
        *status = k8s_openapi::api::core::v1::PodStatus {
            phase,
            reason,
            conditions,
            container_statuses: main.map(|c| vec![c]),
            pod_ip,
            ..Default::default()
        };
    }
}

/// Which pod changes wake the pod's job. A cached pod ([`strip_for_cache`]) whose state
/// changed only in words (a condition's message) or in its resourceVersion wakes its job at
/// most once per [`WORDS_WAKE_EVERY`]: the reconcile reads the words (a pod's Unschedulable
/// message becomes the job's), but a scheduler retrying a pod in a tight loop must not wake
/// it on every retry. Without this such a pod starved its job: the scheduler-plugins
/// Coscheduling plugin rewrites the PodScheduled message of a gang that cannot fit dozens of
/// times a second, every event pushed the controller's debounce further, and the job never
/// said it could not be scheduled. Deleted pods always wake their job (a gang restart waits
/// for them).
#[derive(Debug, Default)]
pub struct PodWakeFilter {
    /// What each pod said when last seen, by UID.
    seen: std::collections::HashMap<String, Seen>,
}

/// A pod's state and words when last seen, and when they last woke its job.
#[derive(Debug)]
struct Seen {
    state: u64,
    words: u64,
    woke: std::time::Instant,
}

/// How often new words alone (a condition's message) wake a pod's job.
pub const WORDS_WAKE_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

impl PodWakeFilter {
    /// Whether `event` may change what the job's reconcile makes of its pods.
    pub fn wakes(&mut self, event: &kube::runtime::watcher::Event<Pod>) -> bool {
        self.wakes_at(event, std::time::Instant::now())
    }

    /// [`PodWakeFilter::wakes`] at `now`.
    pub fn wakes_at(
        &mut self,
        event: &kube::runtime::watcher::Event<Pod>,
        now: std::time::Instant,
    ) -> bool {
        use kube::runtime::watcher::Event;
        match event {
            Event::Apply(pod) | Event::InitApply(pod) => {
                let uid = pod.metadata.uid.clone().unwrap_or_default();
                let (state, words) = gists(pod);
                let fresh = Seen {
                    state,
                    words,
                    woke: now,
                };
                match self.seen.get_mut(&uid) {
                    Some(seen)
                        if seen.state == state
                            && (seen.words == words
                                || now.duration_since(seen.woke) < WORDS_WAKE_EVERY) =>
                    {
                        seen.words = words;
                        false
                    }
                    _ => {
                        self.seen.insert(uid, fresh);
                        true
                    }
                }
            }
            Event::Delete(pod) => {
                self.seen
                    .remove(pod.metadata.uid.as_deref().unwrap_or_default());
                true
            }
            // A new list: pods deleted meanwhile are never told as deleted, so the gists
            // start again (and every listed pod wakes its job once, as without the filter).
            Event::Init => {
                self.seen.clear();
                true
            }
            Event::InitDone => true,
        }
    }
}

/// Hashes of what a cached pod says: its state (all but its resourceVersion and its
/// conditions' messages), and those messages.
fn gists(pod: &Pod) -> (u64, u64) {
    use std::hash::{Hash, Hasher};
    let mut pod = pod.clone();
    pod.metadata.resource_version = None;
    let mut words = std::collections::hash_map::DefaultHasher::new();
    if let Some(conditions) = pod.status.as_mut().and_then(|s| s.conditions.as_mut()) {
        for condition in conditions {
            condition.message.take().hash(&mut words);
        }
    }
    let mut state = std::collections::hash_map::DefaultHasher::new();
    serde_json::to_vec(&pod)
        .expect("a pod serializes")
        .hash(&mut state);
    (state.finish(), words.finish())
}

/// The job's pods, sorted into the current gang and everything else.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Observed {
    /// Worker `i` of the current attempt, if it exists.
    pub workers: Vec<Option<PodState>>,
    /// The launcher of the current attempt, if it exists.
    pub launcher: Option<PodState>,
    /// The launcher of the latest earlier attempt that failed: it stays, with its log, while
    /// later attempts run, and goes as the job's other finished pods do (`cleanPodPolicy`).
    pub kept_launcher: Option<PodState>,
    /// Pods of other attempts or indices no longer wanted; they are deleted.
    pub stale: Vec<PodState>,
    /// How the current gang's pods name the job's Secret and Service.
    pub naming: ChildNaming,
    /// The workers' DNS records as the job's EndpointSlice holds them (or as they were
    /// written moments ago); `None` without one. Set by the snapshot, not by [`Observed::sort`].
    pub published: Option<super::worker_dns::Published>,
}

impl Observed {
    /// Whether any pod of the current gang exists.
    pub fn gang_exists(&self) -> bool {
        self.workers.iter().any(Option::is_some) || self.launcher.is_some()
    }

    /// Sorts `pods` (all the job's pods) for gang `attempt` of `workers` workers.
    pub fn sort(pods: &[&Pod], workers: u32, attempt: i32) -> Self {
        let mut observed = Self {
            workers: vec![None; workers as usize],
            naming: ChildNaming::of_gang(pods.iter().copied(), attempt),
            ..Self::default()
        };
        for pod in pods {
            let state = PodState::of(pod);
            let labels = pod.labels();
            let current = state.attempt == Some(attempt);
            match labels.get(ROLE_LABEL).map(String::as_str) {
                Some(WORKER_ROLE) if current => {
                    match labels
                        .get(WORKER_INDEX_LABEL)
                        .and_then(|i| i.parse::<usize>().ok())
                    {
                        Some(i) if i < observed.workers.len() => observed.workers[i] = Some(state),
                        _ => observed.stale.push(state),
                    }
                }
                Some(LAUNCHER_ROLE) if current => observed.launcher = Some(state),
                Some(LAUNCHER_ROLE) if state.attempt < Some(attempt) && state.failed() => {
                    observed.keep_launcher(state)
                }
                _ => observed.stale.push(state),
            }
        }
        observed
    }

    /// Keeps the latest failed launcher of an earlier attempt; an older one is stale.
    fn keep_launcher(&mut self, launcher: PodState) {
        match self.kept_launcher.take() {
            Some(later) if later.attempt > launcher.attempt => {
                self.kept_launcher = Some(later);
                self.stale.push(launcher);
            }
            older => {
                self.kept_launcher = Some(launcher);
                self.stale.extend(older);
            }
        }
    }

    /// Every pod, current and stale.
    pub fn all(&self) -> impl Iterator<Item = &PodState> {
        self.workers
            .iter()
            .flatten()
            .chain(self.launcher.iter())
            .chain(self.kept_launcher.iter())
            .chain(self.stale.iter())
    }

    /// Workers of the current gang that are ready.
    pub fn ready_workers(&self) -> usize {
        self.workers
            .iter()
            .flatten()
            .filter(|w| w.is_ready())
            .count()
    }
}
