//! Whether the copy Job's pod started in time (`spec.startTimeoutSeconds`). Pure: the pods,
//! the mount failures the kubelet reported for them and the clock are passed in.
//!
//! A pod that cannot start does not fail its Job: it waits (image pull back-off, a volume
//! that cannot be mounted, no node that fits) until the Job's activeDeadlineSeconds, two
//! days by default. So the controller stops it sooner, with the cause: the kubelet's
//! reasons are read as the TrainingJob's start timeout reads them ([`blocked`]), and a
//! failed mount, which a pod's status does not show (its container just waits in
//! ContainerCreating), from the pod's Events.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::controller::training_job::observe::{PodLife, PodState};
use crate::controller::training_job::plan::blocked;
use crate::controller::training_job::state::seconds_between;

/// Event reasons of the kubelet and the attach/detach controller for a volume a pod cannot
/// get.
pub const MOUNT_FAILURE_REASONS: [&str; 2] = ["FailedMount", "FailedAttachVolume"];

/// One pod of the copy Job, as the start check needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CopyPod {
    /// Its state (as a TrainingJob's pods are read).
    pub state: PodState,
    /// The latest mount failure reported for it: "FailedMount: <the kubelet's message>".
    pub mount_failure: Option<String>,
}

impl CopyPod {
    /// Reads a pod and the Events about it.
    pub fn of(pod: &Pod, events: &[Event]) -> Self {
        let mount_failure = events
            .iter()
            .filter(|e| {
                MOUNT_FAILURE_REASONS.contains(&e.reason.as_deref().unwrap_or_default())
                    && e.involved_object.uid == pod.metadata.uid
            })
            .max_by_key(|e| e.last_timestamp.as_ref().map(|t| t.0))
            .map(|e| {
                format!(
                    "{}: {}",
                    e.reason.as_deref().unwrap_or_default(),
                    e.message.as_deref().unwrap_or_default().trim()
                )
            });
        Self {
            state: PodState::of(pod),
            mount_failure,
        }
    }
}

/// What the start check found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StartCheck {
    /// A pod runs or ran, or none waits: nothing to time.
    NotWaiting,
    /// A pod waits to start; look again after this long.
    Waiting(Duration),
    /// The waiting pod passed the start timeout: why it did not start.
    TimedOut(String),
}

/// The copy Job's newest pod that has neither started nor is being deleted, timed against
/// `limit` seconds from when it was made.
pub fn check(pods: &[CopyPod], now: &Time, limit: i64) -> StartCheck {
    let started = pods
        .iter()
        .any(|p| !matches!(p.state.life, PodLife::Pending { .. }));
    let waiting = pods
        .iter()
        .filter(|p| !p.state.is_deleting() && matches!(p.state.life, PodLife::Pending { .. }))
        .filter_map(|p| Some((p, p.state.created.as_ref()?)))
        .max_by_key(|(_, created)| created.0);
    let Some((pod, created)) = waiting.filter(|_| !started) else {
        return StartCheck::NotWaiting;
    };
    let left = limit as f64 - seconds_between(created, now);
    if left > 0.0 {
        return StartCheck::Waiting(Duration::from_secs_f64(left));
    }
    StartCheck::TimedOut(format!(
        "the copy Job's pod did not start within spec.startTimeoutSeconds ({limit} s): {}",
        cause(pod)
    ))
}

/// Why a pod waits, in words: the scheduler's or kubelet's reason, a failed mount, or that
/// it simply never ran.
fn cause(pod: &CopyPod) -> String {
    let name = &pod.state.name;
    if let Some(block) = blocked("pod", &pod.state) {
        return block.message;
    }
    match &pod.mount_failure {
        Some(failure) => format!(
            "pod {name} cannot mount its volumes ({}); check the destination (the NFS server \
             and path, the share, or the claim's volume) from a node",
            ringmaster_contract::shorten(failure, 500)
        ),
        None => format!(
            "pod {name} never got running (kubectl describe pod {name} shows what it waits for)"
        ),
    }
}
