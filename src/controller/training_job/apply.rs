//! Apply step of the TrainingJob controller: carries a plan out against the API server, in a
//! fixed order — deletions, the SSH Secret (created once, never rewritten), the hostfile and
//! the Service, workers, then the launcher. Everything is owned by the job.

use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service};
use kube::api::{DeleteParams, PostParams};
use kube::{Api, Client, ResourceExt};

use super::build::{self, BuildInputs, SshKeys};
use super::names;
use super::plan::Plan;
use super::validate::ValidatedTrainingJob;
use crate::controller::{is_conflict, is_not_found, server_side_apply};

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
    /// No randomness for the SSH key.
    #[error("drawing a seed for the SSH key: {0}")]
    Random(#[source] getrandom::Error),
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
            ApplyError::Random(_) => None,
        }
    }
}

fn kube_error(
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

/// Creates the per-job SSH Secret unless it exists. The key is drawn once: re-applying a new
/// key would lock running workers out. Existence is learnt from the create's 409, not a
/// read, so the operator needs no right to read Secrets.
async fn ensure_ssh_secret(client: &Client, job: &ValidatedTrainingJob) -> Result<(), ApplyError> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &job.namespace);
    let name = names::ssh_secret(&job.name);
    let mut seed = [0u8; 32];
    getrandom::fill(&mut seed).map_err(ApplyError::Random)?;
    let keys = SshKeys::from_seed(&seed, &format!("ringmaster/{}/{}", job.namespace, job.name));
    match secrets
        .create(&PostParams::default(), &build::ssh_secret(job, &keys))
        .await
    {
        Ok(_) => Ok(()),
        // Made by an earlier reconcile: keep that one.
        Err(e) if is_conflict(&e) => Ok(()),
        Err(e) => Err(kube_error("creating", "Secret", &name)(e)),
    }
}

/// Carries out `plan`. `refresh` applies the Secret, hostfile and Service even when no pod
/// is created (a new spec generation).
pub async fn execute(
    client: &Client,
    job: &ValidatedTrainingJob,
    plan: &Plan,
    inputs: &BuildInputs,
    refresh: bool,
) -> Result<(), ApplyError> {
    delete_pods(client, &job.namespace, &plan.delete_pods).await?;
    let creating = !plan.create_workers.is_empty() || plan.create_launcher;
    if creating || refresh {
        ensure_ssh_secret(client, job).await?;
        let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), &job.namespace);
        let hostfile = build::hostfile_config_map(job);
        server_side_apply(&config_maps, &hostfile)
            .await
            .map_err(kube_error("applying", "ConfigMap", &hostfile.name_any()))?;
        let services: Api<Service> = Api::namespaced(client.clone(), &job.namespace);
        let service = build::worker_service(job);
        server_side_apply(&services, &service)
            .await
            .map_err(kube_error("applying", "Service", &service.name_any()))?;
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), &job.namespace);
    // Workers are independent of each other: create them concurrently.
    let workers = plan.create_workers.iter().map(|index| {
        let pod = build::worker_pod(job, *index, inputs);
        let pods = pods.clone();
        async move {
            server_side_apply(&pods, &pod).await.map_err(kube_error(
                "creating",
                "Pod",
                &pod.name_any(),
            ))
        }
    });
    // Every creation is tried; the first failure in worker order is reported, so a refusal
    // that hits every worker reads the same on each retry (one Event per distinct message).
    futures::future::join_all(workers)
        .await
        .into_iter()
        .collect::<Result<Vec<()>, _>>()?;
    if plan.create_launcher {
        let pod = build::launcher_pod(job, inputs);
        server_side_apply(&pods, &pod).await.map_err(kube_error(
            "creating",
            "Pod",
            &pod.name_any(),
        ))?;
    }
    Ok(())
}
