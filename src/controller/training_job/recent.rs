//! What this operator wrote for each job moments ago, until its caches show it. Under load
//! the watch that feeds a cache lags behind the writes, and a reconcile that reads a stale
//! cache would make the same pods, Secret and Service again and write the same status (or DNS
//! records) again:
//! requests that change nothing but cost the API server as much as the first. Remembering
//! the recent writes (the "expectations" of Kubernetes' own controllers) skips them.
//!
//! In memory only, and each memory fades after [`FRESH_FOR`]: after a restart of the
//! operator, or when the cache never shows a write (someone undid it), the next reconcile
//! writes again, as it would without this.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use super::names::{ATTEMPT_LABEL, ChildNaming};
use super::worker_dns::Published;
use crate::api::TrainingJobStatus;

/// The (generation, gang attempt, naming) a job's Secret and Service were applied for.
pub type ChildrenFor = (Option<i64>, i32, ChildNaming);

/// How long a write is trusted to be on its way to the cache.
pub const FRESH_FOR: Duration = Duration::from_secs(60);

/// Jobs to prune faded memories of once this many are remembered.
const PRUNE_AT: usize = 4096;

#[derive(Debug, Default)]
struct JobWrites {
    /// The status last written, and when.
    status: Option<(TrainingJobStatus, Instant)>,
    /// What the Secret and Service were last applied for, and when.
    children: Option<(ChildrenFor, Instant)>,
    /// Pods made and not yet seen in the cache: name → (gang attempt, when).
    pods: HashMap<String, (i32, Instant)>,
    /// The workers' DNS records last written, and when.
    published: Option<(Published, Instant)>,
}

impl JobWrites {
    fn fresh(&self, now: Instant) -> bool {
        let young = |at: &Instant| now.duration_since(*at) < FRESH_FOR;
        self.status.as_ref().is_some_and(|(_, at)| young(at))
            || self.children.as_ref().is_some_and(|(_, at)| young(at))
            || self.pods.values().any(|(_, at)| young(at))
            || self.published.as_ref().is_some_and(|(_, at)| young(at))
    }
}

/// What was written for one job moments ago and is not in the caches yet, as the plan reads
/// it ([`RecentWrites::recall`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecentJob {
    /// Pods made and not yet in the cache: name → gang attempt.
    pub unseen_pods: std::collections::BTreeMap<String, i32>,
    /// What the Secret and Service were last applied for, while that is fresh.
    pub children_for: Option<ChildrenFor>,
}

impl RecentJob {
    /// The pods of gang `attempt` made and not yet seen.
    pub fn unseen(&self, attempt: i32) -> Vec<String> {
        self.unseen_pods
            .iter()
            .filter(|(_, made_for)| **made_for == attempt)
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// Whether the Secret and Service were applied for this generation, gang attempt and
    /// naming moments ago.
    pub fn children_fresh(
        &self,
        generation: Option<i64>,
        attempt: i32,
        naming: ChildNaming,
    ) -> bool {
        self.children_for == Some((generation, attempt, naming))
    }
}

/// Recent writes per job (keyed by the job's UID).
#[derive(Debug, Default)]
pub struct RecentWrites {
    jobs: Mutex<HashMap<String, JobWrites>>,
}

impl RecentWrites {
    fn with<T>(&self, uid: &str, now: Instant, f: impl FnOnce(&mut JobWrites) -> T) -> T {
        let mut jobs = self.jobs.lock().expect("recent writes poisoned");
        if jobs.len() >= PRUNE_AT && !jobs.contains_key(uid) {
            jobs.retain(|_, job| job.fresh(now));
        }
        f(jobs.entry(uid.to_string()).or_default())
    }

    /// What was written for job `uid` in the last [`FRESH_FOR`] that `cached` (the job's pods
    /// in the cache) does not show yet; pods it shows are forgotten.
    pub fn recall(&self, uid: &str, cached: &[&Pod], now: Instant) -> RecentJob {
        self.with(uid, now, |job| {
            forget_seen_pods(job, cached, now);
            RecentJob {
                unseen_pods: job
                    .pods
                    .iter()
                    .map(|(name, (attempt, _))| (name.clone(), *attempt))
                    .collect(),
                children_for: job
                    .children
                    .as_ref()
                    .filter(|(_, at)| now.duration_since(*at) < FRESH_FOR)
                    .map(|(for_, _)| *for_),
            }
        })
    }

    /// The pods of gang `attempt` of job `uid` made in the last [`FRESH_FOR`] that `cached`
    /// (the job's pods in the cache) does not show yet; those it shows are forgotten.
    pub fn pods_not_yet_seen(
        &self,
        uid: &str,
        attempt: i32,
        cached: &[&Pod],
        now: Instant,
    ) -> Vec<String> {
        self.with(uid, now, |job| {
            forget_seen_pods(job, cached, now);
            job.pods
                .iter()
                .filter(|(_, (made_for, _))| *made_for == attempt)
                .map(|(name, _)| name.clone())
                .collect()
        })
    }

    /// Pods `names` of gang `attempt` of job `uid` were made.
    pub fn pods_made(&self, uid: &str, attempt: i32, names: Vec<String>, now: Instant) {
        self.with(uid, now, |job| {
            for name in names {
                job.pods.insert(name, (attempt, now));
            }
        });
    }

    /// Whether the Secret and Service of job `uid` were applied for this generation and gang
    /// attempt in the last [`FRESH_FOR`].
    pub fn children_fresh(
        &self,
        uid: &str,
        generation: Option<i64>,
        attempt: i32,
        naming: ChildNaming,
        now: Instant,
    ) -> bool {
        self.with(uid, now, |job| {
            job.children.as_ref().is_some_and(|(for_, at)| {
                *for_ == (generation, attempt, naming) && now.duration_since(*at) < FRESH_FOR
            })
        })
    }

    /// The Secret and Service of job `uid` were applied for this generation and attempt.
    pub fn children_applied(
        &self,
        uid: &str,
        generation: Option<i64>,
        attempt: i32,
        naming: ChildNaming,
        now: Instant,
    ) {
        self.with(uid, now, |job| {
            job.children = Some(((generation, attempt, naming), now));
        });
    }

    /// The workers' DNS records of job `uid` were written.
    pub fn published(&self, uid: &str, published: Published, now: Instant) {
        self.with(uid, now, |job| job.published = Some((published, now)));
    }

    /// The workers' DNS records to plan job `uid` from: those written in the last
    /// [`FRESH_FOR`] when the cache does not show them yet (planning from the older slice
    /// would write them again), else `cached`.
    pub fn latest_published(
        &self,
        uid: &str,
        cached: Option<Published>,
        now: Instant,
    ) -> Option<Published> {
        self.with(uid, now, |job| match &job.published {
            Some((written, at))
                if Some(written) != cached.as_ref() && now.duration_since(*at) < FRESH_FOR =>
            {
                Some(written.clone())
            }
            _ => {
                job.published = None;
                cached
            }
        })
    }

    /// The status to reconcile job `uid` from: the one written in the last [`FRESH_FOR`]
    /// when the cache does not show it yet (the cache is behind: planning from its older
    /// status would write the same change again), else `cached`.
    pub fn latest_status(
        &self,
        uid: &str,
        cached: &TrainingJobStatus,
        now: Instant,
    ) -> TrainingJobStatus {
        self.with(uid, now, |job| match &job.status {
            Some((written, at)) if written != cached && now.duration_since(*at) < FRESH_FOR => {
                written.clone()
            }
            _ => {
                // The cache shows it, or the memory faded.
                job.status = None;
                cached.clone()
            }
        })
    }

    /// Whether a status of job `uid` was written in the last [`FRESH_FOR`] that the cache has
    /// not shown yet ([`RecentWrites::latest_status`] forgets one it has).
    pub fn status_unseen(&self, uid: &str, now: Instant) -> bool {
        self.with(uid, now, |job| {
            job.status
                .as_ref()
                .is_some_and(|(_, at)| now.duration_since(*at) < FRESH_FOR)
        })
    }

    /// `status` was written for job `uid`.
    pub fn status_written(&self, uid: &str, status: &TrainingJobStatus, now: Instant) {
        self.with(uid, now, |job| job.status = Some((status.clone(), now)));
    }

    /// How many jobs are remembered.
    pub fn remembered(&self) -> usize {
        self.jobs.lock().expect("recent writes poisoned").len()
    }
}

/// Forgets the pods `cached` shows (the same name and gang attempt) and those whose memory
/// faded.
fn forget_seen_pods(job: &mut JobWrites, cached: &[&Pod], now: Instant) {
    job.pods.retain(|name, (attempt, at)| {
        let seen = cached.iter().any(|pod| {
            pod.name_any() == *name && pod.labels().get(ATTEMPT_LABEL) == Some(&attempt.to_string())
        });
        !seen && now.duration_since(*at) < FRESH_FOR
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::TrainingJobPhase;

    fn pod(name: &str, attempt: i32) -> Pod {
        serde_json::from_value(serde_json::json!({"metadata": {"name": name,
            "labels": {"ringmaster.dev/attempt": attempt.to_string()}}}))
        .unwrap()
    }

    #[test]
    fn pods_made_are_not_made_again_until_the_cache_shows_them_or_the_memory_fades() {
        let recent = RecentWrites::default();
        let t0 = Instant::now();
        recent.pods_made("uid", 0, vec!["w-0".into(), "w-1".into()], t0);
        let w0 = pod("w-0", 0);
        let mut unseen = recent.pods_not_yet_seen("uid", 0, &[&w0], t0);
        unseen.sort();
        assert_eq!(unseen, ["w-1"]);
        let old_gang = pod("w-1", 3);
        assert_eq!(
            recent.pods_not_yet_seen("uid", 0, &[&old_gang], t0),
            ["w-1"],
            "a pod of another gang under the same name is not the one made"
        );
        assert!(
            recent.pods_not_yet_seen("uid", 1, &[], t0).is_empty(),
            "another gang's pods are not held back"
        );
        assert!(
            recent
                .pods_not_yet_seen("uid", 0, &[], t0 + FRESH_FOR)
                .is_empty()
        );
        assert!(recent.pods_not_yet_seen("other", 0, &[], t0).is_empty());
    }

    #[test]
    fn children_are_fresh_for_one_generation_and_gang() {
        let recent = RecentWrites::default();
        let t0 = Instant::now();
        let tagged = ChildNaming::UidTagged;
        assert!(!recent.children_fresh("uid", Some(1), 0, tagged, t0));
        recent.children_applied("uid", Some(1), 0, tagged, t0);
        assert!(recent.children_fresh("uid", Some(1), 0, tagged, t0));
        assert!(
            !recent.children_fresh("uid", Some(2), 0, tagged, t0),
            "a new spec"
        );
        assert!(
            !recent.children_fresh("uid", Some(1), 1, tagged, t0),
            "a restart"
        );
        assert!(
            !recent.children_fresh("uid", Some(1), 0, ChildNaming::Untagged, t0),
            "other names"
        );
        assert!(!recent.children_fresh("uid", Some(1), 0, tagged, t0 + FRESH_FOR));
    }

    #[test]
    fn recalled_writes_are_those_the_cache_does_not_show_yet() {
        let recent = RecentWrites::default();
        let t0 = Instant::now();
        recent.pods_made("uid", 1, vec!["w-0".into(), "w-1".into()], t0);
        recent.children_applied("uid", Some(2), 1, ChildNaming::UidTagged, t0);
        let w0 = pod("w-0", 1);
        let recalled = recent.recall("uid", &[&w0], t0);
        assert_eq!(recalled.unseen(1), ["w-1"]);
        assert!(recalled.unseen(0).is_empty());
        assert!(recalled.children_fresh(Some(2), 1, ChildNaming::UidTagged));
        assert!(!recalled.children_fresh(Some(3), 1, ChildNaming::UidTagged));
        assert_eq!(
            recent.recall("uid", &[], t0 + FRESH_FOR),
            RecentJob::default()
        );
    }

    #[test]
    fn a_status_written_moments_ago_stands_in_for_a_cache_that_is_behind() {
        let recent = RecentWrites::default();
        let t0 = Instant::now();
        let pending = TrainingJobStatus::default();
        let starting = TrainingJobStatus {
            phase: TrainingJobPhase::Starting,
            ..TrainingJobStatus::default()
        };
        assert_eq!(recent.latest_status("uid", &pending, t0), pending);
        recent.status_written("uid", &starting, t0);
        assert_eq!(recent.latest_status("uid", &pending, t0), starting);
        assert_eq!(
            recent.latest_status("uid", &pending, t0 + FRESH_FOR),
            pending,
            "a write the cache never shows is not trusted for ever"
        );
        recent.status_written("uid", &starting, t0);
        assert_eq!(recent.latest_status("uid", &starting, t0), starting);
        assert_eq!(
            recent.latest_status("uid", &pending, t0),
            pending,
            "once the cache showed it, the cache is the record again"
        );
    }

    #[test]
    fn memories_of_gone_jobs_fade_away() {
        let recent = RecentWrites::default();
        let t0 = Instant::now();
        for i in 0..PRUNE_AT {
            recent.children_applied(&i.to_string(), Some(1), 0, ChildNaming::UidTagged, t0);
        }
        recent.children_applied("new", Some(1), 0, ChildNaming::UidTagged, t0 + FRESH_FOR);
        assert_eq!(recent.remembered(), 1);
    }
}
