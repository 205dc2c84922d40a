//! A job's own AKS agent pool: made before the workers, deleted when the job finishes or is
//! deleted (a finalizer: the pool is the one thing outside Kubernetes Ringmaster owns).
//!
//! Each reconcile reads the pool from ARM and takes at most one step: create it when it is
//! missing, follow it while it is being made, report Azure's reason when it failed, count
//! its Ready nodes when it has Succeeded, delete it when the job is done. Throttling and
//! "another operation in progress" only delay the next look. A live job's [`reconcile`] is
//! three steps: [`observe`] reads, [`decide`] (pure, unit-tested) chooses, and the one write
//! it may choose (the PUT) is carried out and reported by [`after_create`] (pure too).
//!
//! Pools are created, never overwritten or adopted: the PUT carries `If-None-Match: *` (a
//! pool of that name made meanwhile, by another job or a person, answers 412 and is looked
//! at again), and a pool is used or deleted only when its tags name this job
//! ([`is_jobs_pool`]); a delete carries the eTag read with those tags (`If-Match`). The ARM
//! token goes only to ARM's own origin: an operation URL in the status that is not there
//! ([`ArmClient::own_url`]) is dropped, never followed, and said in a Warning.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{ApiResource, DynamicObject, ListParams};
use kube::{Api, Client, ResourceExt};

use super::names::{AGENT_POOL_LABEL, POOL_KEY};
use super::spec::{NodePoolPlan, ValidatedTrainingJob};
use super::state::PoolState;
use crate::aks::{Accepted, AgentPool, AgentPoolRequest, ArmClient, ArmError, Operation};
use crate::api::{
    GpuDriver, NodePoolStatus, Provisioner, TrainingJob, TrainingJobPhase, condition_reasons,
};
use crate::controller::{remove_finalizer_from_metadata, set_finalizer};

/// The finalizer that deletes a job's agent pool.
pub const FINALIZER: &str = "ringmaster.dev/agent-pool";
/// `status.nodePool.provisioningState` once the pool is gone.
const DELETED: &str = "Deleted";
/// `status.nodePool.provisioningState` of a finished job whose pool name was another's:
/// nothing of it to give back.
const NOT_THIS_JOBS: &str = "NotThisJobs";
/// Tag on a pool Ringmaster made: `<namespace>.<name>` of the job.
pub const JOB_TAG: &str = "ringmaster.dev-job";
/// Tag on a pool Ringmaster made: the job's UID (names come back; UIDs do not).
pub const JOB_UID_TAG: &str = "ringmaster.dev-job-uid";

/// Whether `pool` is the one this job made: tagged with its UID (or, made before the UID
/// tag, with its namespace and name). A pool of another job, or one made by hand, is never
/// adopted and never deleted: a `poolName` that names it is a mistake to report.
pub fn is_jobs_pool(pool: &AgentPool, namespace: &str, name: &str, uid: &str) -> bool {
    match pool.tags.get(JOB_UID_TAG) {
        Some(tagged) => tagged == uid,
        None => pool.tags.get(JOB_TAG) == Some(&format!("{namespace}.{name}")),
    }
}

/// Who a pool belongs to, in words, for a job that found it in its way.
fn owner_of(pool: &AgentPool) -> String {
    match pool.tags.get(JOB_TAG) {
        Some(job) => format!("TrainingJob {job} made it"),
        None => "Ringmaster did not make it".to_string(),
    }
}

/// What a look at the pool found.
#[derive(Debug)]
pub struct PoolLook {
    /// For the plan.
    pub state: PoolState,
    /// For `status.nodePool`.
    pub status: Option<NodePoolStatus>,
    /// Look again after this long.
    pub requeue: Option<Duration>,
    /// Words for a Warning Event (`NodePoolOperationIgnored`): an operation URL that is not
    /// ARM's was dropped, not followed.
    pub warning: Option<String>,
}

impl PoolLook {
    fn not_needed() -> Self {
        Self {
            state: PoolState::NotNeeded,
            status: None,
            requeue: None,
            warning: None,
        }
    }
}

/// Errors that stop the reconcile (the API server, not Azure: Azure's errors are states).
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// Reading nodes or writing the finalizer failed.
    #[error("{action}: {source}")]
    Kube {
        action: String,
        #[source]
        source: kube::Error,
    },
}

/// The pool's name when the job brings its own.
fn own_pool(job: &ValidatedTrainingJob) -> Option<(&NodePoolPlan, &str)> {
    let pool = job.node_pool.as_ref()?;
    if pool.provisioner != Provisioner::Aks {
        return None;
    }
    Some((pool, pool.pool_name.as_deref()?))
}

/// The ARM request for a job's pool: one node per worker, labelled and tainted so only
/// this job's workers land there.
pub fn request(job: &ValidatedTrainingJob, pool: &NodePoolPlan, name: &str) -> AgentPoolRequest {
    AgentPoolRequest {
        vm_size: pool.vm_size.clone().unwrap_or_default(),
        count: job.workers,
        node_labels: BTreeMap::from([(POOL_KEY.to_string(), name.to_string())]),
        node_taints: vec![format!("{POOL_KEY}={name}:NoSchedule")],
        spot: pool.spot,
        gpu_driver_install: pool.gpu_driver != GpuDriver::None,
        tags: BTreeMap::from([
            (
                JOB_TAG.to_string(),
                format!("{}.{}", job.namespace, job.name),
            ),
            (JOB_UID_TAG.to_string(), job.uid.clone()),
        ]),
    }
}

/// The job's own node pool, as a sub-reconciler: for a live job, the finalizer first, then
/// read ARM ([`observe`]) → decide ([`decide`], pure) → write (the one PUT it may choose);
/// for a finished job, the pool given back unless it is kept.
pub async fn reconcile(
    ctx: &crate::controller::Context,
    object: &TrainingJob,
    job: &ValidatedTrainingJob,
    gang_exists: bool,
) -> Result<PoolLook, PoolError> {
    let Some((pool, name)) = own_pool(job) else {
        return Ok(PoolLook::not_needed());
    };
    let old = object
        .status
        .as_ref()
        .and_then(|s| s.node_pool.clone())
        .unwrap_or_default();
    let Some(arm) = ctx.config.arm.as_ref() else {
        return Ok(PoolLook {
            state: PoolState::Failed {
                message: "nodePool.provisioner is aks, but this operator has no AKS settings: start it with --aks-subscription, --aks-resource-group and --aks-cluster (Helm: aks.*)".into(),
            },
            status: Some(NodePoolStatus {
                name: name.to_string(),
                ..old
            }),
            requeue: None,
            warning: None,
        });
    };
    let phase = object.status.as_ref().map(|s| s.phase).unwrap_or_default();
    if matches!(
        phase,
        TrainingJobPhase::Succeeded | TrainingJobPhase::Failed
    ) {
        return give_back(&ctx.client, arm, object, pool, name, old).await;
    }
    // The finalizer goes on before the pool exists, so a deleted job cannot leak it.
    set_pool_finalizer(&ctx.client, object, true).await?;
    let look = step(&ctx.client, arm, job, &old, gang_exists).await?;
    if let Some(warning) = &look.warning {
        ctx.warn(
            object,
            condition_reasons::NODE_POOL_OPERATION_IGNORED,
            warning,
        )
        .await;
    }
    Ok(look)
}

/// One step of a live job's pool, its finalizer aside: read ARM ([`observe`]) → decide
/// ([`decide`], pure) → the one create it may choose → its outcome ([`after_create`]).
/// `old` is the job's `status.nodePool`. The client only lists the pool's nodes, once it
/// has Succeeded and the gang does not exist yet.
pub async fn step(
    client: &Client,
    arm: &ArmClient,
    job: &ValidatedTrainingJob,
    old: &NodePoolStatus,
    gang_exists: bool,
) -> Result<PoolLook, PoolError> {
    let Some((pool, name)) = own_pool(job) else {
        return Ok(PoolLook::not_needed());
    };
    let seen = observe(client, arm, job, name, old, gang_exists).await?;
    let decision = decide(job, pool, name, old, seen);
    Ok(match decision.create {
        None => decision.look,
        Some(request) => {
            let result = arm.create_pool(name, &request).await;
            if result.is_ok() {
                tracing::info!(job = %job.name, pool = name, "agent pool creation accepted");
            }
            after_create(job, pool, name, decision.look, result)
        }
    })
}

/// A finished job's pool: given back unless the job keeps it; once given back (and the
/// finalizer released) there is nothing left to ask Azure.
async fn give_back(
    client: &Client,
    arm: &ArmClient,
    object: &TrainingJob,
    pool: &NodePoolPlan,
    name: &str,
    old: NodePoolStatus,
) -> Result<PoolLook, PoolError> {
    let released = matches!(
        old.provisioning_state.as_deref(),
        Some(DELETED | NOT_THIS_JOBS)
    ) && !object.finalizers().iter().any(|f| f == FINALIZER);
    if !pool.delete_after_completion || released {
        return Ok(PoolLook {
            state: PoolState::NotNeeded,
            status: Some(old),
            requeue: None,
            warning: None,
        });
    }
    let mut status = NodePoolStatus {
        name: name.to_string(),
        ..old
    };
    let requeue = match release(client, arm, object, name).await? {
        Release::Pending { state, .. } => {
            status.provisioning_state = Some(state);
            Some(Duration::from_secs(10))
        }
        Release::Gone => {
            status.provisioning_state = Some(DELETED.into());
            status.ready_nodes = 0;
            None
        }
        Release::NotOurs => {
            status.provisioning_state = Some(NOT_THIS_JOBS.into());
            status.ready_nodes = 0;
            None
        }
    };
    Ok(PoolLook {
        state: PoolState::NotNeeded,
        status: Some(status),
        requeue,
        warning: None,
    })
}

/// What a look at a live job's pool read: ARM's answer for the pool, and what that answer
/// makes worth reading next (the pool's Ready nodes once it has Succeeded and the gang is
/// not there yet; the failed operation's reason).
#[derive(Debug)]
pub struct PoolSeen {
    /// The pool, `None` when ARM has none of that name.
    pub pool: Result<Option<AgentPool>, ArmError>,
    /// Nodes Ready for a worker; `None` when not read.
    pub ready_nodes: Option<u32>,
    /// The outcome of the operation that made the pool, when it failed and one is known.
    pub operation: Option<Result<Operation, ArmError>>,
    /// `status.nodePool.operation` when it is not on ARM's origin: not requested, to be
    /// dropped from the status and said in a Warning.
    pub ignored_operation: Option<String>,
}

/// Reads what [`decide`] needs; changes nothing.
async fn observe(
    client: &Client,
    arm: &ArmClient,
    job: &ValidatedTrainingJob,
    name: &str,
    old: &NodePoolStatus,
    gang_exists: bool,
) -> Result<PoolSeen, PoolError> {
    let pool = arm.get_pool(name).await;
    let state = pool
        .as_ref()
        .ok()
        .and_then(Option::as_ref)
        .map(|p| p.provisioning_state.as_str());
    let ready_nodes = match state {
        // Once the gang exists its pods hold the nodes: no need to list them again.
        Some("Succeeded") if gang_exists => Some(job.workers),
        Some("Succeeded") => Some(ready_nodes(client, job, name).await?),
        _ => None,
    };
    // The status is the job's, writable by more than this operator: only a URL on ARM's
    // origin gets the token.
    let (own_operation, ignored_operation) = match old.operation.as_deref() {
        None => (None, None),
        Some(url) => match arm.own_url(url) {
            Some(own) => (Some(own), None),
            None => {
                tracing::warn!(job = %job.name, pool = name, operation = %url, "status.nodePool.operation is not on the ARM endpoint: not followed");
                (None, Some(url.to_string()))
            }
        },
    };
    let operation = match (state, own_operation) {
        (Some("Failed" | "Canceled"), Some(url)) => Some(arm.operation(&url).await),
        _ => None,
    };
    Ok(PoolSeen {
        pool,
        ready_nodes,
        operation,
        ignored_operation,
    })
}

/// The words of the Warning for an operation URL that is not ARM's (cut to 200 characters).
fn ignored_operation_warning(name: &str, url: &str, source: &str) -> String {
    let mut shown: String = url.chars().take(200).collect();
    if shown.len() < url.len() {
        shown.push('…');
    }
    format!(
        "the operation URL of agent pool {name} {source} ({shown}) is not on this operator's Azure Resource Manager endpoint: it was not requested (the ARM token goes only there) and is dropped from status.nodePool.operation"
    )
}

/// What to do about a live job's pool.
#[derive(Debug)]
pub struct PoolDecision {
    /// The state and status to report (before any creation is carried out).
    pub look: PoolLook,
    /// Create the pool with this request.
    pub create: Option<AgentPoolRequest>,
}

/// Decides from what was seen: create a missing pool, follow one being made, report
/// Azure's reason for one that failed, count the nodes of one that succeeded. Pure.
pub fn decide(
    job: &ValidatedTrainingJob,
    pool: &NodePoolPlan,
    name: &str,
    old: &NodePoolStatus,
    seen: PoolSeen,
) -> PoolDecision {
    let mut status = NodePoolStatus {
        name: name.to_string(),
        ..old.clone()
    };
    let warning = seen
        .ignored_operation
        .as_deref()
        .map(|url| ignored_operation_warning(name, url, "in the job's status"));
    if warning.is_some() {
        status.operation = None;
    }
    let look = |state: PoolState, status: NodePoolStatus, requeue: Option<Duration>| PoolDecision {
        look: PoolLook {
            state,
            status: Some(status),
            requeue,
            warning: warning.clone(),
        },
        create: None,
    };
    let current = match seen.pool {
        Ok(Some(current)) => current,
        Ok(None) => {
            return PoolDecision {
                create: Some(request(job, pool, name)),
                ..look(PoolState::NotNeeded, status, None)
            };
        }
        Err(e) if e.is_transient() => {
            let mut decision = transient(name, &e, status);
            decision.look.warning = warning.clone();
            return decision;
        }
        Err(e) => {
            return look(
                PoolState::Failed {
                    message: format!("reading agent pool {name}: {e}"),
                },
                status,
                None,
            );
        }
    };
    if !is_jobs_pool(&current, &job.namespace, &job.name, &job.uid) {
        if current.provisioning_state == "Deleting" {
            // Most likely an earlier job's of the same pool name, finished or deleted: this
            // job makes its own once that one is gone.
            return look(
                PoolState::Provisioning {
                    message: format!(
                        "agent pool {name} ({}) is being deleted; this job's is made once it is gone",
                        owner_of(&current)
                    ),
                },
                status,
                Some(Duration::from_secs(10)),
            );
        }
        return look(
            PoolState::Failed {
                message: format!(
                    "agent pool {name} exists and is not this job's ({}): it is neither used nor deleted; name another nodePool.poolName, or leave it out for a pool of the job's own",
                    owner_of(&current)
                ),
            },
            status,
            None,
        );
    }
    status.provisioning_state = Some(current.provisioning_state.clone());
    match current.provisioning_state.as_str() {
        "Succeeded" => {
            let ready = seen.ready_nodes.unwrap_or(0);
            status.ready_nodes = ready as i32;
            let state = if ready >= job.workers {
                PoolState::Ready {
                    message: format!("agent pool {name}: {ready} nodes Ready"),
                }
            } else {
                PoolState::Provisioning {
                    message: format!(
                        "agent pool {name} succeeded; {ready} of {} nodes Ready with their GPUs",
                        job.workers
                    ),
                }
            };
            let requeue = (ready < job.workers).then_some(Duration::from_secs(5));
            look(state, status, requeue)
        }
        "Failed" | "Canceled" => {
            let reason = match seen.operation {
                Some(Ok(Operation::Failed { code, message })) => {
                    let hint = crate::aks::arm::hint(&code)
                        .map(|h| format!(" ({h})"))
                        .unwrap_or_default();
                    format!("{code}: {message}{hint}")
                }
                _ if seen.ignored_operation.is_some() => format!(
                    "{} (its operation, which would say why, was not read: the URL in the status is not Azure Resource Manager's)",
                    current.provisioning_state
                ),
                _ => current.provisioning_state.clone(),
            };
            look(
                PoolState::Failed {
                    message: format!("agent pool {name} failed: {reason}"),
                },
                status,
                None,
            )
        }
        other => look(
            PoolState::Provisioning {
                message: format!("agent pool {name} is {other}"),
            },
            status,
            Some(Duration::from_secs(5)),
        ),
    }
}

/// A transient ARM error (throttled, busy, unreachable): still provisioning, look again
/// when ARM said.
fn transient(name: &str, e: &ArmError, status: NodePoolStatus) -> PoolDecision {
    PoolDecision {
        look: PoolLook {
            state: PoolState::Provisioning {
                message: format!("agent pool {name}: {e}"),
            },
            status: Some(status),
            requeue: Some(e.retry_after()),
            warning: None,
        },
        create: None,
    }
}

/// The state after asking ARM to create the pool. Pure.
pub fn after_create(
    job: &ValidatedTrainingJob,
    pool: &NodePoolPlan,
    name: &str,
    before: PoolLook,
    result: Result<Accepted, ArmError>,
) -> PoolLook {
    let mut status = before.status.unwrap_or_default();
    match result {
        Ok(accepted) => {
            status.provisioning_state = Some("Creating".into());
            status.operation = accepted.operation;
            status.ready_nodes = 0;
            PoolLook {
                state: PoolState::Provisioning {
                    message: format!(
                        "creating agent pool {name}: {} × {}",
                        job.workers,
                        pool.vm_size.as_deref().unwrap_or_default()
                    ),
                },
                status: Some(status),
                requeue: Some(Duration::from_secs(5)),
                warning: accepted
                    .ignored_operation
                    .as_deref()
                    .map(|url| ignored_operation_warning(name, url, "Azure answered")),
            }
        }
        // The create is never repeated blindly: the next look reads the pool, and one that
        // is not this job's fails the job (or, being deleted, is waited out) as any other.
        Err(ArmError::PreconditionFailed { .. }) => PoolLook {
            state: PoolState::Provisioning {
                message: format!(
                    "agent pool {name} exists already: another job or a person made it, or is making it, since this job looked; whose it is is read next, and a pool that is not this job's is neither used nor deleted"
                ),
            },
            status: Some(status),
            requeue: Some(Duration::from_secs(2)),
            warning: None,
        },
        Err(e) if e.is_transient() => transient(name, &e, status).look,
        Err(e) => PoolLook {
            state: PoolState::Failed {
                message: format!("Azure refused agent pool {name}: {e}"),
            },
            status: Some(status),
            requeue: None,
            warning: None,
        },
    }
}

/// Nodes of the pool that are Ready with the GPUs (and RDMA devices) a worker asks for.
async fn ready_nodes(
    client: &Client,
    job: &ValidatedTrainingJob,
    pool: &str,
) -> Result<u32, PoolError> {
    let nodes: Api<Node> = Api::all(client.clone());
    let list = nodes
        .list(&ListParams::default().labels(&format!("{AGENT_POOL_LABEL}={pool}")))
        .await
        .map_err(|source| PoolError::Kube {
            action: format!("listing the nodes of agent pool {pool}"),
            source,
        })?;
    Ok(list
        .items
        .iter()
        .filter(|node| can_host_worker(node, job))
        .count() as u32)
}

/// Whether `node` is Ready and has allocatable what one of `job`'s workers asks for: its
/// GPUs and, with InfiniBand, its count of the job's RDMA resource (by the job's name for
/// it, not the default's).
pub fn can_host_worker(node: &Node, job: &ValidatedTrainingJob) -> bool {
    let status = node.status.as_ref();
    let has = |resource: &str, amount: u32| {
        amount == 0
            || status
                .and_then(|s| s.allocatable.as_ref())
                .and_then(|a| a.get(resource))
                .and_then(|q| count(&q.0))
                .is_some_and(|n| n >= u64::from(amount))
    };
    let ready = status
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    ready
        && has(crate::api::GPU_RESOURCE, job.gpus_per_worker)
        && job
            .infiniband
            .as_ref()
            .is_none_or(|ib| has(&ib.rdma_resource, ib.rdma_resource_count))
}

/// A countable resource quantity (`8`, `1k`, `2Ki`) as a number.
fn count(quantity: &str) -> Option<u64> {
    let split = quantity
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(quantity.len());
    let (digits, suffix) = quantity.split_at(split);
    let multiplier: u64 = match suffix {
        "" => 1,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        _ => return None,
    };
    digits.parse::<u64>().ok()?.checked_mul(multiplier)
}

/// Puts the finalizer on (`present`) or takes it off.
async fn set_pool_finalizer(
    client: &Client,
    object: &TrainingJob,
    present: bool,
) -> Result<(), PoolError> {
    set_finalizer(client, object, FINALIZER, present)
        .await
        .map_err(|source| PoolError::Kube {
            action: format!(
                "updating the finalizers of TrainingJob {}",
                object.name_any()
            ),
            source,
        })
}

/// Where giving a job's pool back stands.
#[derive(Debug, PartialEq, Eq)]
pub enum Release {
    /// Still there (being deleted, or the delete is to be retried): the state in words, and
    /// what went wrong when Azure refused or could not be asked.
    Pending {
        state: String,
        problem: Option<String>,
    },
    /// Gone (and, from [`finalize`] or a finished job, the finalizer released).
    Gone,
    /// The pool of that name is not this job's: left alone (and the finalizer released).
    NotOurs,
}

/// Deletes the job's pool, and releases the finalizer once it is gone. A pool of that name
/// that another job (or a person) made is left alone.
async fn release(
    client: &Client,
    arm: &ArmClient,
    object: &TrainingJob,
    name: &str,
) -> Result<Release, PoolError> {
    let namespace = object.namespace().unwrap_or_default();
    let uid = object.uid().unwrap_or_default();
    let released = release_pool(arm, &namespace, &object.name_any(), &uid, name).await;
    if matches!(released, Release::Gone | Release::NotOurs) {
        set_pool_finalizer(client, object, false).await?;
    }
    Ok(released)
}

/// Deletes pool `name` when it is the job's (`namespace`/`job`, `uid`): read, its tags
/// checked ([`is_jobs_pool`]), then deleted with `If-Match` on the eTag read with them, so
/// a pool that another job made meanwhile under the name is not deleted. One step; ARM
/// only (the finalizer is the caller's).
pub async fn release_pool(
    arm: &ArmClient,
    namespace: &str,
    job: &str,
    uid: &str,
    name: &str,
) -> Release {
    match arm.get_pool(name).await {
        Ok(None) => Release::Gone,
        Ok(Some(pool)) if !is_jobs_pool(&pool, namespace, job, uid) => {
            tracing::warn!(job, pool = name, owner = %owner_of(&pool), "agent pool is not this job's: left alone");
            Release::NotOurs
        }
        Ok(Some(pool)) if pool.provisioning_state == "Deleting" => Release::Pending {
            state: "Deleting".into(),
            problem: None,
        },
        Ok(Some(pool)) => match arm.delete_pool(name, pool.etag.as_deref()).await {
            Ok(_) => {
                tracing::info!(job, pool = name, "agent pool deletion accepted");
                Release::Pending {
                    state: "Deleting".into(),
                    problem: None,
                }
            }
            Err(e) => {
                tracing::warn!(job, pool = name, error = %e, "deleting the agent pool; will retry");
                Release::Pending {
                    state: format!("delete pending: {e}"),
                    // Throttling, a pool busy with another operation, or one that changed
                    // since it was read (looked at again), passes by itself.
                    problem: (!e.is_transient())
                        .then(|| format!("deleting agent pool {name}: {e}; retried every 10 s")),
                }
            }
        },
        Err(e) => {
            tracing::warn!(job, pool = name, error = %e, "reading the agent pool; will retry");
            Release::Pending {
                state: format!("unknown: {e}"),
                problem: (!e.is_transient())
                    .then(|| format!("reading agent pool {name}: {e}; retried every 10 s")),
            }
        }
    }
}

/// Where the deletion of a job with a pool stands.
#[derive(Debug, PartialEq, Eq)]
pub enum Finalized {
    /// Nothing (more) to delete: the finalizer is off.
    Done,
    /// The pool is being deleted; look again.
    Waiting,
    /// Azure refused the deletion or could not be asked; retried. The words, for a Warning.
    Stuck(String),
    /// The finalizer was released without deleting the pool (this operator has no AKS
    /// settings): the pool may be left in Azure. The words, for a Warning.
    LeftBehind(String),
}

/// For a job being deleted: deletes its pool (even when it asked to keep it after
/// completion: a deleted job's pool has no owner left) and releases the finalizer once it
/// is gone.
pub async fn finalize(
    client: &Client,
    arm: Option<&ArmClient>,
    object: &TrainingJob,
) -> Result<Finalized, PoolError> {
    if !object.finalizers().iter().any(|f| f == FINALIZER) {
        return Ok(Finalized::Done);
    }
    // The name the live job used: its status's, for a pool an earlier operator named.
    let Some(name) = super::validate::aks_pool_name(object) else {
        // The spec names no pool of its own (any more): nothing to delete.
        set_pool_finalizer(client, object, false).await?;
        return Ok(Finalized::Done);
    };
    let Some(arm) = arm else {
        // Nothing Ringmaster can delete with: let the job go, and say what may be left.
        set_pool_finalizer(client, object, false).await?;
        return Ok(Finalized::LeftBehind(format!(
            "agent pool {name} was not deleted: this operator runs without AKS settings (--aks-subscription, --aks-resource-group, --aks-cluster; Helm aks.*); delete the pool in Azure if it is still there"
        )));
    };
    Ok(match release(client, arm, object, &name).await? {
        Release::Pending { problem: None, .. } => Finalized::Waiting,
        Release::Pending {
            problem: Some(problem),
            ..
        } => Finalized::Stuck(problem),
        Release::Gone | Release::NotOurs => Finalized::Done,
    })
}

/// [`finalize`] for a job being deleted whose stored form no longer parses (fields of another
/// operator's version, a hand edit): its pool is given back all the same, named from what
/// can be read of the stored object ([`unreadable_pool_name`]), and the finalizer is removed
/// from its metadata.
pub async fn finalize_unreadable(
    client: &Client,
    arm: Option<&ArmClient>,
    meta: &ObjectMeta,
) -> Result<Finalized, PoolError> {
    if !meta.finalizers.iter().flatten().any(|f| f == FINALIZER) {
        return Ok(Finalized::Done);
    }
    let (namespace, job) = (
        meta.namespace.clone().unwrap_or_default(),
        meta.name.clone().unwrap_or_default(),
    );
    let uid = meta.uid.clone().unwrap_or_default();
    let resource = ApiResource::erase::<TrainingJob>(&());
    let raw = Api::<DynamicObject>::namespaced_with(client.clone(), &namespace, &resource)
        .get_opt(&job)
        .await
        .map_err(|source| PoolError::Kube {
            action: format!("reading TrainingJob {job} as it is stored"),
            source,
        })?;
    let Some(raw) = raw else {
        return Ok(Finalized::Done);
    };
    let release_finalizer = || async {
        remove_finalizer_from_metadata::<TrainingJob>(client, meta, FINALIZER)
            .await
            .map_err(|source| PoolError::Kube {
                action: format!("updating the finalizers of TrainingJob {job}"),
                source,
            })
    };
    let Some(name) = unreadable_pool_name(&raw.data, &job, &uid) else {
        release_finalizer().await?;
        return Ok(Finalized::Done);
    };
    let Some(arm) = arm else {
        release_finalizer().await?;
        return Ok(Finalized::LeftBehind(format!(
            "agent pool {name} was not deleted: this operator runs without AKS settings; delete the pool in Azure if it is still there"
        )));
    };
    Ok(
        match release_pool(arm, &namespace, &job, &uid, &name).await {
            Release::Pending { problem: None, .. } => Finalized::Waiting,
            Release::Pending {
                problem: Some(problem),
                ..
            } => Finalized::Stuck(problem),
            Release::Gone | Release::NotOurs => {
                release_finalizer().await?;
                Finalized::Done
            }
        },
    )
}

/// The agent pool of a stored TrainingJob read as plain JSON, as [`super::validate::aks_pool_name`]
/// names it for a job that parses: `spec.nodePool.poolName`, else the valid name its status
/// records, else the name derived from its name and UID; `None` without an AKS node pool.
/// Whether the pool is the job's is still decided by its tags.
pub fn unreadable_pool_name(raw: &serde_json::Value, job: &str, uid: &str) -> Option<String> {
    let pool = raw["spec"]["nodePool"].as_object()?;
    if pool.get("provisioner").and_then(|p| p.as_str()) != Some("aks") {
        return None;
    }
    let valid = |v: &serde_json::Value| {
        v.as_str()
            .filter(|name| super::names::is_valid_pool_name(name))
            .map(str::to_string)
    };
    pool.get("poolName")
        .and_then(valid)
        .or_else(|| valid(&raw["status"]["nodePool"]["name"]))
        .or_else(|| Some(super::names::derive_pool_name(job, uid)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unreadable_jobs_pool_is_named_as_a_readable_ones() {
        let raw = |pool: serde_json::Value, status: serde_json::Value| serde_json::json!({"spec": {"nodePool": pool, "workers": "two"}, "status": status});
        let aks = serde_json::json!({"provisioner": "aks", "vmSize": 7});
        let derived = super::super::names::derive_pool_name("resnet", "uid-1");
        assert_eq!(
            unreadable_pool_name(&raw(aks.clone(), serde_json::json!({})), "resnet", "uid-1"),
            Some(derived)
        );
        assert_eq!(
            unreadable_pool_name(
                &raw(
                    aks.clone(),
                    serde_json::json!({"nodePool": {"name": "resnet506f1c"}})
                ),
                "resnet",
                "uid-1"
            ),
            Some("resnet506f1c".into()),
            "the name an earlier operator recorded"
        );
        let named = serde_json::json!({"provisioner": "aks", "poolName": "mypool"});
        assert_eq!(
            unreadable_pool_name(&raw(named, serde_json::json!({})), "resnet", "uid-1"),
            Some("mypool".into())
        );
        let existing = serde_json::json!({"provisioner": "existing"});
        assert_eq!(
            unreadable_pool_name(&raw(existing, serde_json::json!({})), "resnet", "uid-1"),
            None
        );
        assert_eq!(
            unreadable_pool_name(&serde_json::json!({"spec": {}}), "resnet", "uid-1"),
            None
        );
    }

    #[test]
    fn device_counts_read_quantities() {
        assert_eq!(count("8"), Some(8));
        assert_eq!(count("1k"), Some(1000));
        assert_eq!(count("2Ki"), Some(2048));
        assert_eq!(count("100m"), None);
    }
}
