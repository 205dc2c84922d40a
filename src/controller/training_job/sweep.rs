//! The sweep for agent pools left behind: a pool Ringmaster made carries its job's name and
//! UID as tags; when that job no longer exists (it was force-removed without its finalizer,
//! or deleted while the operator ran without AKS settings), nothing else would ever delete
//! the pool, and its GPUs stay paid for. The leader sweeps at start and then periodically:
//! each such pool is deleted (or, dry run, only said), with the same tag check and `If-Match`
//! a finished job's release uses.

use std::future::Future;
use std::time::Duration;

use kube::{Api, Client};
use tokio_util::sync::CancellationToken;

use super::pool::{JOB_TAG, JOB_UID_TAG, Release, release_pool};
use crate::aks::{AgentPool, ArmClient, ArmError};
use crate::api::TrainingJob;

/// What the sweep does with a pool whose job is gone.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum SweepMode {
    /// Delete it.
    #[default]
    Delete,
    /// Only say it (a Warning in the log) and delete nothing.
    DryRun,
    /// Do not sweep.
    Off,
}

/// A pool Ringmaster made: its name and the job its tags name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaggedPool {
    pub pool: String,
    pub namespace: String,
    pub job: String,
    pub uid: String,
}

/// The job a pool's tags name, as the API server knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JobSeen {
    /// It exists, with this UID (another UID: a job made anew under the name).
    Exists { uid: String },
    /// There is no such job.
    Gone,
    /// It could not be told (the API server failed or refused): the pool is left alone.
    Unknown(String),
}

/// What one sweep found and did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Swept {
    /// Pools of jobs that are gone, whose deletion was asked for.
    pub deleted: Vec<String>,
    /// Pools of jobs that are gone, left as they are by a dry run.
    pub would_delete: Vec<String>,
    /// Pools of Ringmaster's whose job exists (or could not be told).
    pub kept: usize,
    /// Deletions Azure refused or could not be asked for; tried again at the next sweep.
    pub problems: Vec<String>,
}

/// The job `pool`'s tags name, when Ringmaster made it (both tags present and well-formed).
pub fn tagged(name: &str, pool: &AgentPool) -> Option<TaggedPool> {
    let (namespace, job) = pool.tags.get(JOB_TAG)?.split_once('.')?;
    let uid = pool.tags.get(JOB_UID_TAG)?;
    (!namespace.is_empty() && !job.is_empty() && !uid.is_empty()).then(|| TaggedPool {
        pool: name.to_string(),
        namespace: namespace.to_string(),
        job: job.to_string(),
        uid: uid.clone(),
    })
}

/// Whether a tagged pool's job is gone: none of that name, or one made anew under it (another
/// UID). A job that could not be looked up keeps its pool.
pub fn orphaned(pool: &TaggedPool, seen: &JobSeen) -> bool {
    match seen {
        JobSeen::Gone => true,
        JobSeen::Exists { uid } => *uid != pool.uid,
        JobSeen::Unknown(_) => false,
    }
}

/// One sweep of the cluster's agent pools: each of Ringmaster's whose job `look` says is
/// gone is deleted (or, in a dry run, named). Pools being deleted are skipped.
pub async fn sweep<F, Fut>(arm: &ArmClient, mode: SweepMode, look: F) -> Result<Swept, ArmError>
where
    F: Fn(String, String) -> Fut,
    Fut: Future<Output = JobSeen>,
{
    let mut swept = Swept::default();
    if mode == SweepMode::Off {
        return Ok(swept);
    }
    for (name, pool) in arm.list_pools().await? {
        let Some(tagged) = tagged(&name, &pool) else {
            continue;
        };
        if pool.provisioning_state == "Deleting" {
            continue;
        }
        let seen = look(tagged.namespace.clone(), tagged.job.clone()).await;
        if !orphaned(&tagged, &seen) {
            if let JobSeen::Unknown(why) = &seen {
                tracing::warn!(pool = %name, job = %format!("{}/{}", tagged.namespace, tagged.job), %why, "agent pool kept: its job could not be looked up");
            }
            swept.kept += 1;
            continue;
        }
        sweep_one(arm, mode, &tagged, &mut swept).await;
    }
    Ok(swept)
}

/// Deletes (or, dry run, names) the pool of a job that is gone.
async fn sweep_one(arm: &ArmClient, mode: SweepMode, tagged: &TaggedPool, swept: &mut Swept) {
    let job = format!("{}/{} (UID {})", tagged.namespace, tagged.job, tagged.uid);
    if mode == SweepMode::DryRun {
        tracing::warn!(pool = %tagged.pool, %job, "dry run: agent pool's TrainingJob is gone; it would be deleted");
        swept.would_delete.push(tagged.pool.clone());
        return;
    }
    let released = release_pool(
        arm,
        &tagged.namespace,
        &tagged.job,
        &tagged.uid,
        &tagged.pool,
    )
    .await;
    match released {
        Release::Gone | Release::Pending { problem: None, .. } => {
            tracing::warn!(pool = %tagged.pool, %job, "agent pool's TrainingJob is gone: the pool is deleted");
            swept.deleted.push(tagged.pool.clone());
        }
        Release::Pending {
            problem: Some(problem),
            ..
        } => swept
            .problems
            .push(format!("agent pool {}: {problem}", tagged.pool)),
        // Made anew by another job between the list and the read: not this sweep's.
        Release::NotOurs => swept.kept += 1,
    }
}

/// Looks a TrainingJob up by its metadata: whether it exists, and its UID.
pub async fn look_up(client: &Client, namespace: &str, name: &str) -> JobSeen {
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), namespace);
    match jobs.get_metadata_opt(name).await {
        Ok(Some(job)) => JobSeen::Exists {
            uid: job.metadata.uid.unwrap_or_default(),
        },
        Ok(None) => JobSeen::Gone,
        Err(e) => JobSeen::Unknown(e.to_string()),
    }
}

/// Sweeps at once and then every `every`, until `stop`. Errors are logged: the next sweep
/// tries again.
pub async fn run(
    client: Client,
    arm: ArmClient,
    mode: SweepMode,
    every: Duration,
    stop: CancellationToken,
) {
    if mode == SweepMode::Off {
        return;
    }
    loop {
        let look = |namespace: String, name: String| {
            let client = client.clone();
            async move { look_up(&client, &namespace, &name).await }
        };
        match sweep(&arm, mode, look).await {
            Ok(swept) => tracing::info!(
                deleted = swept.deleted.len(),
                would_delete = swept.would_delete.len(),
                kept = swept.kept,
                problems = ?swept.problems,
                "swept the agent pools for ones whose TrainingJob is gone"
            ),
            Err(error) => {
                tracing::warn!(%error, "could not sweep the agent pools; trying again later")
            }
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(tags: &[(&str, &str)]) -> AgentPool {
        AgentPool {
            provisioning_state: "Succeeded".into(),
            count: 2,
            vm_size: "Standard_ND96asr_v4".into(),
            tags: tags
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            etag: None,
        }
    }

    #[test]
    fn only_pools_with_both_of_ringmasters_tags_are_the_sweeps() {
        let ours = pool(&[(JOB_TAG, "team-a.resnet.v2"), (JOB_UID_TAG, "uid-1")]);
        assert_eq!(
            tagged("p", &ours),
            Some(TaggedPool {
                pool: "p".into(),
                namespace: "team-a".into(),
                job: "resnet.v2".into(),
                uid: "uid-1".into()
            }),
            "a job's name may hold dots; a namespace cannot"
        );
        for tags in [
            vec![(JOB_TAG, "team-a.resnet")],
            vec![(JOB_UID_TAG, "uid-1")],
            vec![(JOB_TAG, "no-dot"), (JOB_UID_TAG, "uid-1")],
            vec![(JOB_TAG, ".resnet"), (JOB_UID_TAG, "uid-1")],
            vec![],
        ] {
            assert_eq!(tagged("p", &pool(&tags)), None, "{tags:?}");
        }
    }

    #[test]
    fn a_pool_is_orphaned_when_its_job_is_gone_or_made_anew_never_when_unknown() {
        let tagged = tagged(
            "p",
            &pool(&[(JOB_TAG, "team-a.resnet"), (JOB_UID_TAG, "uid-1")]),
        )
        .unwrap();
        let exists = |uid: &str| JobSeen::Exists { uid: uid.into() };
        assert!(orphaned(&tagged, &JobSeen::Gone));
        assert!(orphaned(&tagged, &exists("uid-2")));
        assert!(!orphaned(&tagged, &exists("uid-1")));
        assert!(!orphaned(&tagged, &JobSeen::Unknown("403".into())));
    }
}
