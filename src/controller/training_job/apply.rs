//! Apply step of the TrainingJob controller: carries a plan out against the API server, in a
//! fixed order — deletions, the SSH Secret (created once, never rewritten), the Service, the
//! PodGroup of a gang-scheduled job, the workers' DNS records (the Service's EndpointSlice),
//! workers, then the launcher (which carries its
//! hostfile). Everything is owned by the job.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Pod, Secret, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;

use super::build::{self, BuildInputs, RendezvousKey, SshKeys};
use super::names::{self, ChildNaming};
use super::plan::{Children, Plan};
use super::spec::ValidatedTrainingJob;
use super::state::NameHolder;
use super::worker_dns::WorkerAddress;
use crate::controller::{is_conflict, is_not_found, server_side_apply};
use crate::gang::GangApi;

/// Errors carrying out a plan.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// The API server refused a write.
    #[error("{action} {kind} {name}: {source}")]
    Kube {
        action: &'static str,
        kind: &'static str,
        name: String,
        #[source]
        source: kube::Error,
    },
    /// No randomness for the job's keys.
    #[error("drawing the job's SSH and rendezvous keys: {0}")]
    Random(#[source] getrandom::Error),
    /// A Secret of the job's SSH Secret name exists that the job does not control: someone
    /// made it first, and its keys would let them into the job's workers and ring.
    #[error(
        "Secret {name} exists and this job does not control it (its controller: {controller}): \
         the job does not use another's keys; delete that Secret, or make the job under \
         another name"
    )]
    ForeignSshSecret { name: String, controller: String },
    /// The operator gang-schedules, and the cluster has no PodGroup API of its scheduler.
    #[error("creating PodGroup {name}: {}", no_pod_group_api(*api))]
    NoPodGroupApi {
        name: String,
        api: GangApi,
        #[source]
        source: kube::Error,
    },
}

/// What a job that cannot get its PodGroup says: the fix is the cluster's or the operator's.
fn no_pod_group_api(api: GangApi) -> String {
    let (served, needs) = match api {
        GangApi::SchedulerPlugins => (
            "PodGroup (scheduling.x-k8s.io/v1alpha1)",
            "the scheduler-plugins scheduler and its PodGroup CRD installed",
        ),
        GangApi::Volcano => (
            "Volcano PodGroup (scheduling.volcano.sh/v1beta1)",
            "Volcano installed (its scheduler, controllers and CRDs)",
        ),
    };
    format!(
        "the cluster serves no {served}: the operator runs with --gang-scheduler (Helm: \
         gangScheduler), which needs {needs}"
    )
}

impl ApplyError {
    /// "creating Pod x: <the API server's message>" when the API server refused a child
    /// (see [`crate::controller::rejection`]); `None` for errors that pass by themselves.
    pub fn rejection(&self) -> Option<String> {
        match self {
            ApplyError::Kube {
                action,
                kind,
                name,
                source,
            } => crate::controller::rejection(source)
                .map(|message| format!("{action} {kind} {name}: {message}")),
            ApplyError::NoPodGroupApi { .. } | ApplyError::ForeignSshSecret { .. } => {
                Some(self.to_string())
            }
            ApplyError::Random(_) => None,
        }
    }
}

/// Wraps a refused write with what was written, for the job's status.
pub(crate) fn kube_error(
    action: &'static str,
    kind: &'static str,
    name: &str,
) -> impl FnOnce(kube::Error) -> ApplyError {
    let name = name.to_string();
    move |source| ApplyError::Kube {
        action,
        kind,
        name,
        source,
    }
}

/// Deletes pods; a pod already gone is fine.
pub async fn delete_pods(
    client: &Client,
    namespace: &str,
    names: &[String],
) -> Result<(), ApplyError> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    for name in names {
        match pods.delete(name, &DeleteParams::background()).await {
            Ok(_) => {}
            Err(e) if is_not_found(&e) => {}
            Err(e) => return Err(kube_error("deleting", "Pod", name)(e)),
        }
    }
    Ok(())
}

/// Creates the per-job SSH Secret unless it exists, with the job's SSH key and rendezvous
/// key. Both are drawn once: re-applying new ones would lock running workers out and split
/// a gang's ranks. Existence is learnt from the create's 409; only then is the Secret there
/// read, and its metadata alone ([`check_ssh_secret_owner`]).
async fn ensure_ssh_secret(
    client: &Client,
    job: &ValidatedTrainingJob,
    naming: ChildNaming,
) -> Result<(), ApplyError> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &job.namespace);
    let name = names::ssh_secret(job, naming);
    let mut seed = [0u8; 32];
    getrandom::fill(&mut seed).map_err(ApplyError::Random)?;
    let keys = SshKeys::from_seed(&seed, &format!("ringmaster/{}/{}", job.namespace, job.name));
    let mut rendezvous = RendezvousKey([0; ringmaster_contract::trainer::RENDEZVOUS_KEY_BYTES]);
    getrandom::fill(&mut rendezvous.0).map_err(ApplyError::Random)?;
    match secrets
        .create(
            &PostParams::default(),
            &build::ssh_secret(job, naming, &keys, &rendezvous),
        )
        .await
    {
        Ok(_) => Ok(()),
        // Made by an earlier reconcile: keep that one, if it is this job's. (Not an earlier
        // job's of the same name, whose Secret has another name: ChildNaming.)
        Err(e) if is_conflict(&e) => check_ssh_secret_owner(&secrets, job, &name).await,
        Err(e) => Err(kube_error("creating", "Secret", &name)(e)),
    }
}

/// The Secret of the job's SSH Secret name, which exists, is used only when the job controls
/// it: one a namespace user made first (the name is known once the job exists) holds keys
/// they chose, which would let them into the workers' sshd and the trainers' ring. Its
/// metadata is read, never its data.
async fn check_ssh_secret_owner(
    secrets: &Api<Secret>,
    job: &ValidatedTrainingJob,
    name: &str,
) -> Result<(), ApplyError> {
    let meta = secrets
        .get_metadata(name)
        .await
        .map_err(kube_error("reading", "Secret", name))?
        .metadata;
    let controller = meta
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true));
    match controller {
        Some(owner) if owner.uid == job.uid => Ok(()),
        other => Err(ApplyError::ForeignSshSecret {
            name: name.to_string(),
            controller: other.map_or("none".into(), |o| format!("{} {}", o.kind, o.name)),
        }),
    }
}

/// Makes the job's PodGroup, of the gang scheduler's API, unless it exists. When the spec
/// changed (`update`), the one there gets what of it can change: its schedule timeout
/// (scheduler-plugins), or the queue and priority class the job sets (Volcano). What it
/// holds (workers, their GPUs and InfiniBand devices) is immutable in the spec.
async fn ensure_pod_group(
    client: &Client,
    job: &ValidatedTrainingJob,
    api: GangApi,
    update: bool,
) -> Result<(), ApplyError> {
    match api {
        GangApi::SchedulerPlugins => {
            let group = build::pod_group(job);
            let mutable =
                json!({"spec": {"scheduleTimeoutSeconds": group.spec.schedule_timeout_seconds}});
            write_pod_group(client, job, &group, mutable, api, update).await
        }
        GangApi::Volcano => {
            let group = build::volcano_pod_group(job);
            // Only what the job sets: unset, the group keeps the queue (and priority) Volcano
            // gave it when it was made, which its admission webhook may have taken from the
            // namespace.
            let mut mutable = serde_json::Map::new();
            if let Some(queue) = &group.spec.queue {
                mutable.insert("queue".into(), json!(queue));
            }
            if let Some(priority) = &group.spec.priority_class_name {
                mutable.insert("priorityClassName".into(), json!(priority));
            }
            let mutable = json!({"spec": mutable});
            write_pod_group(client, job, &group, mutable, api, update).await
        }
    }
}

/// Creates `group` unless it exists; with `update`, merge-patches `mutable` onto the one
/// there (a `null` in it takes the setting out of the group).
async fn write_pod_group<K>(
    client: &Client,
    job: &ValidatedTrainingJob,
    group: &K,
    mutable: serde_json::Value,
    api: GangApi,
    update: bool,
) -> Result<(), ApplyError>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + serde::Serialize
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let groups: Api<K> = Api::namespaced(client.clone(), &job.namespace);
    let name = group.name_any();
    let refused = |source: kube::Error| {
        if is_not_found(&source) {
            ApplyError::NoPodGroupApi {
                name: name.clone(),
                api,
                source,
            }
        } else {
            kube_error("creating", "PodGroup", &name)(source)
        }
    };
    let made = create_unless_exists(&groups, group)
        .await
        .map_err(refused)?;
    if update && !made {
        groups
            .patch(&name, &PatchParams::default(), &Patch::Merge(&mutable))
            .await
            .map_err(kube_error("updating", "PodGroup", &name))?;
    }
    Ok(())
}

/// What [`execute`] wrote, also when it then failed: the caller remembers it, so a retry
/// after a failure does not write it again.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Written {
    /// The Secret and Service were applied.
    pub children: bool,
    /// The workers' DNS records were written to the job's EndpointSlice.
    pub published: bool,
    /// The pods this call made (not those that existed already), by name.
    pub pods: Vec<String>,
    /// Pods it could not make, their names held by pods the job does not control (pods
    /// without the job's labels: the API server's 409 told), by name.
    pub held: BTreeMap<String, NameHolder>,
}

impl Written {
    fn record(&mut self, name: String, outcome: PodCreate) {
        match outcome {
            PodCreate::Made => self.pods.push(name),
            PodCreate::Exists => {}
            PodCreate::Held(holder) => {
                self.held.insert(name, holder);
            }
        }
    }
}

/// Creates `object`, keeping one that exists already (409); true when this call made it.
/// Pods are never changed once made, and a create costs the API server far less than a
/// server-side apply of the same object (measured at 1,000 jobs × 8 workers: applies of
/// pods took most of its time).
async fn create_unless_exists<K>(api: &Api<K>, object: &K) -> Result<bool, kube::Error>
where
    K: kube::Resource + serde::Serialize + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.create(&PostParams::default(), object).await {
        Ok(_) => Ok(true),
        Err(e) if is_conflict(&e) => Ok(false),
        Err(e) => Err(e),
    }
}

/// What became of a pod the plan asked for.
enum PodCreate {
    /// Made by this call.
    Made,
    /// The job's own, made by a reconcile the cache does not show yet.
    Exists,
    /// Its name is held by a pod the job does not control, or was until just now.
    Held(NameHolder),
}

/// Creates one of the job's pods. When a pod of that name exists already, it is read back
/// to tell the job's own from another's: pods without the job's labels are not in the
/// cache, which [`super::plan::hold_back_names_in_use`] reads for the others.
async fn create_pod(
    pods: &Api<Pod>,
    job: &ValidatedTrainingJob,
    pod: &Pod,
) -> Result<PodCreate, ApplyError> {
    let name = pod.name_any();
    if create_unless_exists(pods, pod)
        .await
        .map_err(kube_error("creating", "Pod", &name))?
    {
        return Ok(PodCreate::Made);
    }
    let existing = pods
        .get_opt(&name)
        .await
        .map_err(kube_error("reading", "Pod", &name))?;
    let Some(existing) = existing else {
        // Gone since: made on the next look, which comes soon (its deletion may wake
        // nothing: it was not the job's).
        return Ok(PodCreate::Held(NameHolder::Going));
    };
    let ours = existing
        .owner_references()
        .iter()
        .any(|o| o.controller == Some(true) && o.uid == job.uid);
    Ok(if ours {
        PodCreate::Exists
    } else {
        PodCreate::Held(NameHolder::of(
            &existing,
            &job.name,
            &crate::controller::now(),
        ))
    })
}

/// Before the pods, so that none of them is open to other pods for a moment.
async fn ensure_network_policy(
    client: &Client,
    job: &ValidatedTrainingJob,
    naming: ChildNaming,
    children: Children,
) -> Result<(), ApplyError> {
    let policies: Api<NetworkPolicy> = Api::namespaced(client.clone(), &job.namespace);
    let policy = build::network_policy(job, naming);
    let result = if children == Children::Update {
        server_side_apply(&policies, &policy).await.map(|_| ())
    } else {
        create_unless_exists(&policies, &policy).await.map(|_| ())
    };
    result.map_err(kube_error("applying", "NetworkPolicy", &policy.name_any()))
}

/// Writes the workers' DNS records: the job's EndpointSlice, applied whole (its endpoints
/// are replaced, not merged).
async fn publish_addresses(
    client: &Client,
    job: &ValidatedTrainingJob,
    naming: ChildNaming,
    addresses: &[WorkerAddress],
) -> Result<(), ApplyError> {
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), &job.namespace);
    let slice = build::worker_endpoints(job, naming, addresses);
    server_side_apply(&slices, &slice)
        .await
        .map(|_| ())
        .map_err(kube_error("applying", "EndpointSlice", &slice.name_any()))
}

/// Carries out `plan`, writing the Secret, Service and PodGroup first as `plan.children`
/// says. `written` collects what succeeded.
pub async fn execute(
    client: &Client,
    job: &ValidatedTrainingJob,
    plan: &Plan,
    inputs: &BuildInputs,
    written: &mut Written,
) -> Result<(), ApplyError> {
    let children = plan.children;
    delete_pods(client, &job.namespace, &plan.delete_pods).await?;
    if children != Children::Keep {
        ensure_ssh_secret(client, job, inputs.naming).await?;
        let services: Api<Service> = Api::namespaced(client.clone(), &job.namespace);
        let service = build::worker_service(job, inputs.naming);
        let result = if children == Children::Update {
            server_side_apply(&services, &service).await.map(|_| ())
        } else {
            create_unless_exists(&services, &service).await.map(|_| ())
        };
        result.map_err(kube_error("applying", "Service", &service.name_any()))?;
        if inputs.network_policy {
            ensure_network_policy(client, job, inputs.naming, children).await?;
        }
        if let Some(scheduler) = &inputs.gang_scheduler {
            // Before the pods: the scheduler turns away a pod whose group it cannot find.
            ensure_pod_group(client, job, scheduler.api, children == Children::Update).await?;
        }
        written.children = true;
    }
    if let Some(published) = &plan.publish {
        publish_addresses(client, job, inputs.naming, &published.addresses).await?;
        written.published = true;
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), &job.namespace);
    // Workers are independent of each other: create them concurrently.
    let workers = plan.create_workers.iter().map(|index| {
        let pod = build::worker_pod(job, *index, inputs);
        let pods = pods.clone();
        async move { (pod.name_any(), create_pod(&pods, job, &pod).await) }
    });
    // Every creation is tried; the first failure in worker order is reported, so a refusal
    // that hits every worker reads the same on each retry (one Event per distinct message).
    let mut first_error = None;
    for (name, result) in futures::future::join_all(workers).await {
        match result {
            Ok(outcome) => written.record(name, outcome),
            Err(error) => {
                first_error.get_or_insert(error);
            }
        }
    }
    if let Some(error) = first_error {
        return Err(error);
    }
    if plan.create_launcher {
        if let Some(scheduler) = inputs
            .gang_scheduler
            .as_ref()
            .filter(|_| children == Children::Keep)
        {
            // A gang made before the operator gang-scheduled has no group: the launcher
            // would wait for one for ever. One create (409 when it exists) per launcher.
            ensure_pod_group(client, job, scheduler.api, false).await?;
        }
        let pod = build::launcher_pod(job, inputs);
        let outcome = create_pod(&pods, job, &pod).await?;
        written.record(pod.name_any(), outcome);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_refusals_of_the_secret_service_or_pod_group_are_written_again() {
        let refusal = |action, kind| {
            ApplyError::Kube {
                action,
                kind,
                name: "x".into(),
                source: kube::Error::Api(
                    kube::core::Status::failure("denied", "Forbidden")
                        .with_code(403)
                        .boxed(),
                ),
            }
            .rejection()
            .expect("a refusal is said")
        };
        for (action, kind) in [
            ("creating", "Secret"),
            ("applying", "Service"),
            ("creating", "PodGroup"),
            ("updating", "PodGroup"),
        ] {
            assert!(
                super::super::plan::refused_children(&refusal(action, kind)),
                "{action} {kind}"
            );
        }
        assert!(!super::super::plan::refused_children(&refusal(
            "creating", "Pod"
        )));
        let missing_api = ApplyError::NoPodGroupApi {
            name: "x".into(),
            api: GangApi::Volcano,
            source: kube::Error::Api(
                kube::core::Status::failure("not found", "NotFound")
                    .with_code(404)
                    .boxed(),
            ),
        };
        assert!(super::super::plan::refused_children(
            &missing_api.rejection().unwrap()
        ));
    }

    #[test]
    fn a_missing_pod_group_api_says_what_to_install() {
        let not_found = || {
            kube::Error::Api(
                kube::core::Status::failure(
                    "the server could not find the requested resource",
                    "NotFound",
                )
                .with_code(404)
                .boxed(),
            )
        };
        for (api, words) in [
            (
                GangApi::SchedulerPlugins,
                ["scheduling.x-k8s.io/v1alpha1", "scheduler-plugins"],
            ),
            (
                GangApi::Volcano,
                ["scheduling.volcano.sh/v1beta1", "Volcano installed"],
            ),
        ] {
            let error = ApplyError::NoPodGroupApi {
                name: "resnet-1a2b3".into(),
                api,
                source: not_found(),
            };
            let said = error.rejection().expect("it is put on the job");
            assert!(
                said.starts_with("creating PodGroup resnet-1a2b3: "),
                "{said}"
            );
            for words in ["--gang-scheduler", "gangScheduler"].iter().chain(&words) {
                assert!(said.contains(words), "{api:?}: {said}");
            }
            assert_eq!(said, error.to_string());
        }
    }
}
