//! Leader election on a `coordination.k8s.io` Lease, so two or more replicas are safe: only
//! the holder of the Lease runs the controllers. The others wait; when the leader dies its
//! Lease expires after `duration` and one of them takes over. A leader that loses the Lease
//! (it could not renew it in time) stops its controllers and returns an error, so its
//! process exits and restarts as a follower, as controller-runtime operators do.

use std::future::Future;
use std::time::Duration;

use kube::Client;
use kube_lease_manager::{LeaseManagerBuilder, LeaseParams};
use tokio_util::sync::CancellationToken;

/// Settings of the election.
#[derive(Clone, Debug)]
pub struct Election {
    /// Namespace of the Lease (the operator's own).
    pub namespace: String,
    /// Name of the Lease.
    pub lease: String,
    /// This replica's name (the pod name).
    pub identity: String,
    /// How long a Lease lives without renewal: the longest a dead leader blocks the others.
    pub duration: Duration,
}

/// Why leading ended.
#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    /// The Lease could not be read or written.
    #[error("leader election on Lease {namespace}/{lease}: {message}")]
    Lease {
        namespace: String,
        lease: String,
        message: String,
    },
    /// Another replica holds the Lease now.
    #[error("lost the leadership (Lease {namespace}/{lease}); exiting so a follower can lead")]
    Lost { namespace: String, lease: String },
}

/// Waits to hold the Lease, then runs `lead` (given a token cancelled when leadership ends)
/// until it returns, `shutdown` is cancelled (`Ok`) or the Lease is lost (`Err`).
pub async fn run<F, Fut>(
    client: Client,
    election: Election,
    shutdown: CancellationToken,
    lead: F,
) -> Result<(), LeaderError>
where
    F: FnOnce(CancellationToken) -> Fut,
    Fut: Future<Output = ()>,
{
    let lease_error = |e: kube_lease_manager::LeaseManagerError| LeaderError::Lease {
        namespace: election.namespace.clone(),
        lease: election.lease.clone(),
        message: e.to_string(),
    };
    let seconds = election.duration.as_secs().max(2);
    let manager = LeaseManagerBuilder::new(client, &election.lease)
        .with_namespace(&election.namespace)
        .with_parameters(
            LeaseParams::new(&election.identity, seconds, (seconds / 3).max(1))
                .with_field_manager(format!("ringmaster-{}", election.identity)),
        )
        .build()
        .await
        .map_err(lease_error)?;
    let (mut leading, task) = manager.watch().await;
    tracing::info!(lease = %election.lease, identity = %election.identity, "waiting to lead");
    while !*leading.borrow_and_update() {
        tokio::select! {
            changed = leading.changed() => {
                if changed.is_err() {
                    return Err(finished(task, &election).await);
                }
            }
            () = shutdown.cancelled() => return Ok(()),
        }
    }
    tracing::info!(lease = %election.lease, identity = %election.identity, "leading");
    let stop = shutdown.child_token();
    let controllers = lead(stop.clone());
    tokio::pin!(controllers);
    let outcome = loop {
        tokio::select! {
            () = &mut controllers => break Ok(()),
            changed = leading.changed() => {
                if changed.is_err() || !*leading.borrow_and_update() {
                    // Stop acting at once, as controller-runtime's leaders do (they exit):
                    // dropping the controllers drops their reconciles where they stand, so
                    // none writes after another replica may lead. Waiting for them to finish
                    // could take as long as a write the API server does not answer.
                    stop.cancel();
                    break Err(LeaderError::Lost {
                        namespace: election.namespace.clone(),
                        lease: election.lease.clone(),
                    });
                }
            }
        }
    };
    // Releasing the Lease on a clean stop lets a follower lead at once.
    drop(leading);
    if let Ok(Ok(manager)) = task.await
        && outcome.is_ok()
        && let Err(error) = manager.release().await
    {
        tracing::warn!(%error, "could not release the Lease; it expires on its own");
    }
    outcome
}

async fn finished(
    task: tokio::task::JoinHandle<kube_lease_manager::Result<kube_lease_manager::LeaseManager>>,
    election: &Election,
) -> LeaderError {
    let message = match task.await {
        Ok(Err(e)) => e.to_string(),
        Ok(Ok(_)) => "the lease watcher stopped".to_string(),
        Err(e) => e.to_string(),
    };
    LeaderError::Lease {
        namespace: election.namespace.clone(),
        lease: election.lease.clone(),
        message,
    }
}
