//! TrainingJobs end to end: the operator (in this process) against the real API server,
//! scheduler and garbage collector, with KWOK playing the pods. A pod's fate is chosen with
//! the kwok.ringmaster.dev/* annotations (e2e/README.md), set through the job's
//! launcher/worker overrides or patched onto a running pod.

mod common;

use std::time::Duration;

use common::{
    Operator, TestNamespace, apply, client, condition, ensure_crds, eventually, job_status,
    phase_is, pods, ready_since, wait_phase,
};
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::{Api, ResourceExt};
use ringmaster::api::{TrainingJob, TrainingJobPhase};
use serde_json::{Value, json};

/// A CPU job of `workers` workers; `edit` changes its spec.
fn cpu_job(name: &str, workers: u32, edit: impl FnOnce(&mut Value)) -> Value {
    let mut job = json!({
        "apiVersion": "ringmaster.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "workers": workers,
            "slotsPerWorker": 2,
            "image": "ringmaster-trainer:e2e",
            "trainer": {"model": "resnet18", "imageSize": 64, "batchSize": 16, "steps": 20},
            "runPolicy": {"backoffLimit": 2},
        }
    });
    edit(&mut job["spec"]);
    job
}

/// The 5 hex digits of a job's UID its Secret and Service names end with.
fn uid_tag(job: &TrainingJob) -> String {
    job.uid().unwrap().replace('-', "")[..5].to_string()
}

/// The annotations that make a KWOK launcher finish with `code` after `after`, with this
/// file's trainer summary.
fn launcher_exit_annotations(code: i32, after: &str) -> Value {
    common::launcher_exit_annotations(code, after, common::trainer_summary(2790.5, 100, 1.25))
}

/// The launcher finishes with `code` after `after`, with the trainer's summary.
fn launcher_exits(spec: &mut Value, code: i32, after: &str) {
    spec["launcher"] = json!({"annotations": launcher_exit_annotations(code, after)});
}

/// The running launcher of `job` finishes now, with exit code 0 and the trainer's summary: for
/// a test that must see the job Running first (a launcher that ends by itself after a few
/// seconds can end before a loaded machine's poll sees Running).
async fn end_launcher(client: &kube::Client, ns: &str, job: &str) {
    common::end_launcher_with(client, ns, job, launcher_exit_annotations(0, "0s")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_job_with_infiniband_runs_and_succeeds_with_its_result() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "tj-happy").await;
    let _operator = Operator::start(&client, &ns.name).await;
    let mut job = cpu_job("resnet50", 2, |spec| {
        spec["gpusPerWorker"] = json!(8);
        spec.as_object_mut().unwrap().remove("slotsPerWorker");
        // The built-in trainer, with the operator's GPU defaults (CUDA, bf16).
        spec["trainer"] = json!({"model": "resnet50", "steps": 100});
        spec["infiniband"] = json!({"enabled": true});
        spec["nodePool"] = json!({"provisioner": "existing", "vmSize": "Standard_ND96asr_v4",
                                  "nodeSelector": {"kubernetes.azure.com/agentpool": "gpu"}});
    });
    job["metadata"]["name"] = json!("resnet50");
    apply(&client, &job, &ns.name, false).await.unwrap();

    let status = wait_phase(&client, &ns.name, "resnet50", TrainingJobPhase::Running, 60).await;
    assert_eq!(condition(&status, "Ready")["status"], "True");
    assert_eq!(status["workers"]["ready"], 2);

    // The children, with the right contents.
    let all = pods(&client, &ns.name, "resnet50").await;
    let workers: Vec<&Pod> = all
        .iter()
        .filter(|p| p.labels()["ringmaster.dev/role"] == "worker")
        .collect();
    let launcher = all
        .iter()
        .find(|p| p.labels()["ringmaster.dev/role"] == "launcher")
        .expect("launcher");
    assert_eq!(workers.len(), 2);
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    for worker in &workers {
        let spec = worker.spec.as_ref().unwrap();
        let limits = spec.containers[0]
            .resources
            .as_ref()
            .unwrap()
            .limits
            .as_ref()
            .unwrap();
        assert_eq!(limits["nvidia.com/gpu"].0, "8");
        assert_eq!(limits["rdma/shared_ib"].0, "1");
        let node = nodes.get(spec.node_name.as_ref().unwrap()).await.unwrap();
        assert_eq!(node.labels()["kubernetes.azure.com/agentpool"], "gpu");
        // The launcher was made only once this worker was Ready.
        let ready = ready_since(worker).expect("worker ready");
        let created = launcher.metadata.creation_timestamp.as_ref().unwrap().0;
        assert!(
            created >= ready,
            "launcher created {created} before worker ready {ready}"
        );
    }
    // The hostfile travels as the launcher's annotation (projected into a file). The
    // Service and Secret carry 5 hex digits of the job's UID.
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), &ns.name);
    let tag = uid_tag(&jobs.get("resnet50").await.unwrap());
    assert_eq!(
        launcher.annotations()["ringmaster.dev/hostfile"],
        format!(
            "resnet50-worker-0.resnet50-workers-{tag}.{0}.svc slots=8\nresnet50-worker-1.resnet50-workers-{tag}.{0}.svc slots=8\n",
            ns.name
        )
    );
    let service: Api<Service> = Api::namespaced(client.clone(), &ns.name);
    assert_eq!(
        service
            .get(&format!("resnet50-workers-{tag}"))
            .await
            .unwrap()
            .spec
            .unwrap()
            .cluster_ip
            .as_deref(),
        Some("None")
    );
    let secret: Api<Secret> = Api::namespaced(client.clone(), &ns.name);
    let secret = secret.get(&format!("resnet50-ssh-{tag}")).await.unwrap();
    assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/ssh-auth"));
    // The ranks' rendezvous key: 32 bytes, drawn for the job, in the same Secret.
    let rendezvous_key = secret
        .data
        .as_ref()
        .and_then(|data| data.get(ringmaster_contract::trainer::RENDEZVOUS_KEY))
        .expect("the Secret holds the rendezvous key");
    assert_eq!(
        rendezvous_key.0.len(),
        ringmaster_contract::trainer::RENDEZVOUS_KEY_BYTES
    );
    let command = launcher.spec.as_ref().unwrap().containers[0]
        .command
        .clone()
        .unwrap()
        .join(" ");
    assert!(
        command.contains("mpirun --hostfile /etc/ringmaster/mpi/hostfile -np 16"),
        "{command}"
    );
    // ssh pins the job's host key, and the ranks are told where the rendezvous key is.
    assert!(
        command.contains(
            "-o StrictHostKeyChecking=yes -o UserKnownHostsFile=/etc/ringmaster/ssh/known_hosts"
        ) && !command.contains("StrictHostKeyChecking=no"),
        "{command}"
    );
    assert!(
        command.contains("-x RINGMASTER_RENDEZVOUS_KEY_FILE"),
        "{command}"
    );
    assert!(
        command.contains("ringmaster-trainer train")
            && command.contains("--device=cuda")
            && command.contains("--precision=bf16"),
        "{command}"
    );

    end_launcher(&client, &ns.name, "resnet50").await;
    let status = wait_phase(
        &client,
        &ns.name,
        "resnet50",
        TrainingJobPhase::Succeeded,
        60,
    )
    .await;
    assert_eq!(
        status["result"],
        json!({"imagesPerSecond": 2790.5, "steps": 100, "finalLoss": 1.25})
    );
    assert_eq!(condition(&status, "Succeeded")["status"], "True");
    assert!(status["completionTime"].is_string() && status["startTime"].is_string());
    // cleanPodPolicy Running: the workers go, the launcher stays for its logs.
    eventually(
        Duration::from_secs(30),
        "running workers cleaned up",
        || async {
            let left = pods(&client, &ns.name, "resnet50").await;
            left.len() == 1 && left[0].name_any() == "resnet50-launcher"
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oom_killed_worker_restarts_the_gang_which_then_succeeds() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "tj-oom").await;
    let _operator = Operator::start(&client, &ns.name).await;
    apply(&client, &cpu_job("oom", 2, |_| {}), &ns.name, false)
        .await
        .unwrap();
    wait_phase(&client, &ns.name, "oom", TrainingJobPhase::Running, 60).await;

    // Mid-run, worker 1 is OOM-killed.
    let pods_api: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
    let oom = json!({"metadata": {"annotations": {"kwok.ringmaster.dev/exit-code": "137", "kwok.ringmaster.dev/reason": "OOMKilled"}}});
    pods_api
        .patch("oom-worker-1", &PatchParams::default(), &Patch::Merge(&oom))
        .await
        .unwrap();
    // The new gang runs (attempt 1's launcher), and ends.
    eventually(
        Duration::from_secs(90),
        "the gang restarted once and Running again",
        || async {
            let status = common::job_status(&client, &ns.name, "oom").await;
            status["restarts"] == 1 && common::phase_is(&status, TrainingJobPhase::Running)
        },
    )
    .await;
    end_launcher(&client, &ns.name, "oom").await;
    let status = wait_phase(&client, &ns.name, "oom", TrainingJobPhase::Succeeded, 90).await;
    assert_eq!(status["restarts"], 1);
    // The restart was said, with its cause, in a Warning Event (the phase itself may pass
    // quicker than a poll).
    let note = common::restarting_event_note(&client, &ns.name, "oom").await;
    assert!(
        note.contains("oom-worker-1 exited with code 137 (OOMKilled)"),
        "{note}"
    );
    // The new gang's pods carry attempt 1, and its launcher its own name.
    let launcher = pods_api.get("oom-launcher-1").await.unwrap();
    assert_eq!(launcher.labels()["ringmaster.dev/attempt"], "1");
    let failure = &status["lastFailure"];
    assert_eq!(
        (&failure["attempt"], &failure["pod"], &failure["exitCode"]),
        (&json!(0), &json!("oom-worker-1"), &json!(137)),
        "{status:#}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exhausted_restarts_fail_the_job_naming_the_worker() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "tj-limit").await;
    let _operator = Operator::start(&client, &ns.name).await;
    let job = cpu_job("limit", 2, |s| {
        s["runPolicy"]["backoffLimit"] = json!(2);
        s["worker"] = json!({"annotations": {"kwok.ringmaster.dev/exit-code": "137",
            "kwok.ringmaster.dev/reason": "OOMKilled", "kwok.ringmaster.dev/exit-after": "1s"}});
    });
    apply(&client, &job, &ns.name, false).await.unwrap();
    let status = wait_phase(&client, &ns.name, "limit", TrainingJobPhase::Failed, 60).await;
    let failed = condition(&status, "Failed");
    assert_eq!(failed["reason"], "BackoffLimitExceeded");
    let message = failed["message"].as_str().unwrap();
    assert!(
        message.contains("limit-worker-")
            && message.contains("137")
            && message.contains("OOMKilled"),
        "{message}"
    );
    assert!(message.contains("restarted 2 times"), "{message}");
    assert_eq!(condition(&status, "Stalled")["status"], "True");
    assert_eq!(condition(&status, "Ready")["status"], "False");
    // Each restart is a Warning of its own, with its own words, about the worker that
    // failed: not the first one's note counted twice. (Which worker failed first is a race.)
    let notes: Vec<(String, String)> =
        common::warnings_for(&client, &ns.name, "limit", "Restarting")
            .await
            .into_iter()
            .map(|e| {
                let related = e.related.and_then(|r| r.name).unwrap_or_default();
                (e.note.unwrap_or_default(), related)
            })
            .collect();
    assert_eq!(notes.len(), 2, "{notes:#?}");
    for restart in 1..=2 {
        let (note, related) = notes
            .iter()
            .find(|(note, _)| note.contains(&format!("(restart {restart} of 2)")))
            .unwrap_or_else(|| panic!("no Event for restart {restart}: {notes:#?}"));
        assert!(
            related.starts_with("limit-worker-") && note.contains(&format!("worker {related} ")),
            "{notes:#?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permanent_launcher_failure_fails_without_retry() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "tj-perm").await;
    let _operator = Operator::start(&client, &ns.name).await;
    apply(
        &client,
        &cpu_job("perm", 1, |s| launcher_exits(s, 2, "1s")),
        &ns.name,
        false,
    )
    .await
    .unwrap();
    let status = wait_phase(&client, &ns.name, "perm", TrainingJobPhase::Failed, 60).await;
    assert_eq!(status["restarts"], 0);
    let failed = condition(&status, "Failed");
    assert_eq!(failed["reason"], "LauncherFailed");
    assert!(
        failed["message"]
            .as_str()
            .unwrap()
            .contains("perm-launcher exited with code 2"),
        "{failed}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suspend_removes_the_pods_and_resume_runs_again() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "tj-suspend").await;
    let _operator = Operator::start(&client, &ns.name).await;
    apply(&client, &cpu_job("pause", 2, |_| {}), &ns.name, false)
        .await
        .unwrap();
    wait_phase(&client, &ns.name, "pause", TrainingJobPhase::Running, 60).await;

    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), &ns.name);
    let suspend = |on: bool| json!({"spec": {"runPolicy": {"suspend": on}}});
    jobs.patch(
        "pause",
        &PatchParams::default(),
        &Patch::Merge(&suspend(true)),
    )
    .await
    .unwrap();
    let status = wait_phase(&client, &ns.name, "pause", TrainingJobPhase::Suspended, 30).await;
    assert_eq!(condition(&status, "Suspended")["status"], "True");
    eventually(Duration::from_secs(30), "every pod gone", || async {
        pods(&client, &ns.name, "pause").await.is_empty()
    })
    .await;

    jobs.patch(
        "pause",
        &PatchParams::default(),
        &Patch::Merge(&suspend(false)),
    )
    .await
    .unwrap();
    let status = wait_phase(&client, &ns.name, "pause", TrainingJobPhase::Running, 60).await;
    assert_eq!(condition(&status, "Suspended")["status"], "False");
    assert_eq!(status["restarts"], 0, "a resume is not a restart");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deadline_fails_the_job_and_the_ttl_deletes_a_finished_one() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "tj-time").await;
    let _operator = Operator::start(&client, &ns.name).await;
    apply(
        &client,
        &cpu_job("deadline", 1, |s| {
            s["runPolicy"]["activeDeadlineSeconds"] = json!(3)
        }),
        &ns.name,
        false,
    )
    .await
    .unwrap();
    apply(
        &client,
        &cpu_job("ttl", 1, |s| {
            launcher_exits(s, 0, "1s");
            s["runPolicy"]["ttlSecondsAfterFinished"] = json!(2);
        }),
        &ns.name,
        false,
    )
    .await
    .unwrap();

    let status = wait_phase(&client, &ns.name, "deadline", TrainingJobPhase::Failed, 60).await;
    assert_eq!(condition(&status, "Failed")["reason"], "DeadlineExceeded");
    eventually(
        Duration::from_secs(30),
        "the deadline job's running pods stopped",
        || async { pods(&client, &ns.name, "deadline").await.is_empty() },
    )
    .await;

    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), &ns.name);
    eventually(
        Duration::from_secs(60),
        "the finished job deleted by its TTL",
        || async { matches!(jobs.get_opt("ttl").await, Ok(None)) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_job_leaves_no_child() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "tj-delete").await;
    let _operator = Operator::start(&client, &ns.name).await;
    apply(&client, &cpu_job("gone", 2, |_| {}), &ns.name, false)
        .await
        .unwrap();
    wait_phase(&client, &ns.name, "gone", TrainingJobPhase::Running, 60).await;
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), &ns.name);
    jobs.delete("gone", &DeleteParams::background())
        .await
        .unwrap();
    let selector = ListParams::default().labels("ringmaster.dev/job-name=gone");
    eventually(Duration::from_secs(60), "every child gone", || async {
        let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
        let services: Api<Service> = Api::namespaced(client.clone(), &ns.name);
        let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns.name);
        let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), &ns.name);
        pods.list(&selector).await.unwrap().items.is_empty()
            && services.list(&selector).await.unwrap().items.is_empty()
            && secrets.list(&selector).await.unwrap().items.is_empty()
            && slices.list(&selector).await.unwrap().items.is_empty()
    })
    .await;
}

/// The workers' DNS records are the operator's own EndpointSlice of the job's Service (which
/// has no selector, so the controller manager writes neither Endpoints nor a slice for it):
/// one record per worker, with its pod name and IP, written once and left alone while the job
/// runs; deleted by someone, it is written again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workers_dns_records_are_the_operators_one_slice_written_again_when_deleted() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "tj-dns").await;
    let _operator = Operator::start(&client, &ns.name).await;
    apply(&client, &cpu_job("dns", 2, |_| {}), &ns.name, false)
        .await
        .unwrap();
    wait_phase(&client, &ns.name, "dns", TrainingJobPhase::Running, 60).await;
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), &ns.name);
    let service = format!("dns-workers-{}", uid_tag(&jobs.get("dns").await.unwrap()));
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), &ns.name);
    let of_service = ListParams::default().labels(&format!("kubernetes.io/service-name={service}"));
    let records = |slice: &EndpointSlice| -> Vec<(String, Vec<String>)> {
        let endpoints = slice.endpoints.clone().unwrap_or_default();
        endpoints
            .into_iter()
            .map(|e| (e.hostname.unwrap_or_default(), e.addresses))
            .collect()
    };
    let listed = slices.list(&of_service).await.unwrap().items;
    assert_eq!(listed.len(), 1, "one slice, the operator's: {listed:?}");
    let slice = &listed[0];
    assert_eq!(
        slice.labels()["endpointslice.kubernetes.io/managed-by"],
        "ringmaster.dev"
    );
    let worker_ips: Vec<(String, Vec<String>)> = pods(&client, &ns.name, "dns")
        .await
        .into_iter()
        .filter(|p| p.labels()["ringmaster.dev/role"] == "worker")
        .map(|p| {
            let ip = p
                .status
                .and_then(|s| s.pod_ip)
                .expect("a running worker has an IP");
            (p.metadata.name.unwrap(), vec![ip])
        })
        .collect();
    let mut expected = worker_ips;
    expected.sort();
    assert_eq!(records(slice), expected);
    // Written once: not again while the job runs.
    let version = slice.resource_version();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        slices.get(&service).await.unwrap().resource_version(),
        version
    );

    slices
        .delete(&service, &DeleteParams::default())
        .await
        .unwrap();
    eventually(
        Duration::from_secs(30),
        "the slice written again",
        || async {
            slices
                .get_opt(&service)
                .await
                .unwrap()
                .is_some_and(|again| records(&again) == expected)
        },
    )
    .await;
}

/// The names of the objects `selector` lists.
async fn names_of<K>(api: &Api<K>, selector: &ListParams) -> Vec<String>
where
    K: kube::Resource + Clone + k8s_openapi::serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.list(selector)
        .await
        .unwrap()
        .iter()
        .map(ResourceExt::name_any)
        .collect()
}

/// A job deleted and made again at once (`kubectl replace --force`, Flux's `force`) while
/// the first job's Secret and Service are still being deleted: the new job runs with a Secret
/// and Service of its own, which outlive the first job's. A finalizer of the test's holds the
/// first job's Secret and Service (as a backup tool's might) for as long as the test needs:
/// the garbage collector alone takes them within a moment, which a test cannot time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_made_again_under_its_name_runs_with_a_secret_and_service_of_its_own() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "tj-again").await;
    let _operator = Operator::start(&client, &ns.name).await;
    let job = cpu_job("again", 2, |_| {});
    apply(&client, &job, &ns.name, false).await.unwrap();
    wait_phase(&client, &ns.name, "again", TrainingJobPhase::Running, 60).await;

    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), &ns.name);
    let first = jobs.get("again").await.unwrap().uid().unwrap();
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns.name);
    let services: Api<Service> = Api::namespaced(client.clone(), &ns.name);
    let selector = ListParams::default().labels("ringmaster.dev/job-name=again");
    let held_secrets = names_of(&secrets, &selector).await;
    let held_services = names_of(&services, &selector).await;
    assert_eq!((held_secrets.len(), held_services.len()), (1, 1));
    common::hold(&secrets, &held_secrets[0], true).await;
    common::hold(&services, &held_services[0], true).await;

    jobs.delete("again", &DeleteParams::background())
        .await
        .unwrap();
    eventually(Duration::from_secs(30), "the first job gone", || async {
        jobs.get_opt("again").await.unwrap().is_none()
    })
    .await;
    apply(&client, &job, &ns.name, false).await.unwrap();
    let second = jobs.get("again").await.unwrap().uid().unwrap();
    assert_ne!(first, second);
    // The first job's pods are waited out; then the second job's gang runs.
    wait_phase(&client, &ns.name, "again", TrainingJobPhase::Running, 90).await;

    // What the second job's pods name is the second job's own, not the held objects.
    let used_by_pods = || async {
        let mut used = std::collections::BTreeSet::new();
        for pod in pods(&client, &ns.name, "again").await {
            let spec = pod.spec.unwrap();
            let secret = spec
                .volumes
                .unwrap()
                .into_iter()
                .find_map(|v| v.secret.and_then(|s| s.secret_name))
                .expect("the SSH Secret is mounted");
            used.insert(("Secret", secret));
            if let Some(subdomain) = spec.subdomain {
                used.insert(("Service", subdomain));
            }
        }
        used
    };
    let used = used_by_pods().await;
    assert_eq!(
        used.len(),
        2,
        "one Secret and one Service for the gang: {used:?}"
    );
    let owned_by_second =
        |owners: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference]| {
            owners
                .iter()
                .any(|o| o.uid == second && o.controller == Some(true))
        };
    for (kind, name) in &used {
        assert!(
            !held_secrets.contains(name) && !held_services.contains(name),
            "the second job's pods use the first job's {kind} {name}"
        );
        let owners = match *kind {
            "Secret" => secrets.get(name).await.unwrap().metadata.owner_references,
            _ => services.get(name).await.unwrap().metadata.owner_references,
        };
        assert!(
            owned_by_second(&owners.unwrap_or_default()),
            "{kind} {name}"
        );
    }

    // Once let go, the first job's Secret and Service are collected; the second's stay.
    common::hold(&secrets, &held_secrets[0], false).await;
    common::hold(&services, &held_services[0], false).await;
    eventually(
        Duration::from_secs(30),
        "the first job's Secret and Service gone",
        || async {
            secrets.get_opt(&held_secrets[0]).await.unwrap().is_none()
                && services.get_opt(&held_services[0]).await.unwrap().is_none()
        },
    )
    .await;
    for (kind, name) in &used {
        let there = match *kind {
            "Secret" => secrets.get_opt(name).await.unwrap().is_some(),
            _ => services.get_opt(name).await.unwrap().is_some(),
        };
        assert!(there, "the second job's {kind} {name} was deleted");
    }
    assert!(phase_is(
        &job_status(&client, &ns.name, "again").await,
        TrainingJobPhase::Running
    ));
}

/// The operator is killed (every task dropped) right after it starts creating a job's
/// children, and a new one takes over: one of each child, all owned, and the job runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_killed_mid_creation_converges_without_duplicates() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "tj-crash").await;
    for round in 0..3 {
        let operator = Operator::start(&client, &ns.name).await;
        if round == 0 {
            apply(&client, &cpu_job("crash", 4, |_| {}), &ns.name, false)
                .await
                .unwrap();
        }
        // Kill as soon as something of this round exists.
        let before = pods(&client, &ns.name, "crash").await.len();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while pods(&client, &ns.name, "crash").await.len() == before
            && std::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        operator.kill();
    }
    let _operator = Operator::start(&client, &ns.name).await;
    wait_phase(&client, &ns.name, "crash", TrainingJobPhase::Running, 60).await;

    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), &ns.name);
    let uid = jobs.get("crash").await.unwrap().uid().unwrap();
    let all = pods(&client, &ns.name, "crash").await;
    let mut names: Vec<String> = all.iter().map(ResourceExt::name_any).collect();
    names.sort();
    assert_eq!(
        names,
        [
            "crash-launcher",
            "crash-worker-0",
            "crash-worker-1",
            "crash-worker-2",
            "crash-worker-3"
        ]
    );
    for pod in &all {
        assert!(
            pod.owner_references().iter().any(|o| o.uid == uid),
            "{} not owned by the job",
            pod.name_any()
        );
    }
    let selector = ListParams::default().labels("ringmaster.dev/job-name=crash");
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns.name);
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    let services: Api<Service> = Api::namespaced(client.clone(), &ns.name);
    assert_eq!(secrets.list(&selector).await.unwrap().items.len(), 1);
    // No ConfigMap: the hostfile travels with the launcher.
    assert_eq!(maps.list(&selector).await.unwrap().items.len(), 0);
    assert_eq!(services.list(&selector).await.unwrap().items.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_wait_for_ready_agrees_with_the_phase_and_waiting_jobs_say_why() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "tj-wait").await;
    let _operator = Operator::start(&client, &ns.name).await;
    apply(&client, &cpu_job("waited", 1, |_| {}), &ns.name, false)
        .await
        .unwrap();
    // Workers that no node can take, and a job waiting for a DataStage that is not Ready.
    let stuck = cpu_job("stuck", 2, |s| {
        s["worker"] = json!({"nodeSelector": {"kubernetes.azure.com/agentpool": "nonexistent"}});
    });
    apply(&client, &stuck, &ns.name, false).await.unwrap();
    let data = cpu_job("data", 1, |s| {
        s["dataStageRef"] = json!({"name": "imagenet"})
    });
    apply(&client, &data, &ns.name, false).await.unwrap();

    let out = tokio::process::Command::new(common::tool("kubectl"))
        .arg("--kubeconfig")
        .arg(ringmaster_e2e::cluster::kubeconfig_path())
        .args([
            "wait",
            "--for=condition=Ready",
            "trainingjob/waited",
            "-n",
            &ns.name,
            "--timeout=60s",
        ])
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let status = job_status(&client, &ns.name, "waited").await;
    assert!(
        phase_is(&status, TrainingJobPhase::Running),
        "Ready=True means running: {status:#}"
    );
    assert_eq!(status["observedGeneration"], 1);

    eventually(
        Duration::from_secs(60),
        "the scheduler's reason on WorkersReady",
        || async {
            let status = job_status(&client, &ns.name, "stuck").await;
            let c = condition(&status, "WorkersReady").clone();
            c["reason"] == "Unschedulable"
                && c["message"].as_str().is_some_and(|m| m.contains("node"))
        },
    )
    .await;
    let status = job_status(&client, &ns.name, "stuck").await;
    assert!(phase_is(&status, TrainingJobPhase::Starting));
    assert_eq!(condition(&status, "Ready")["status"], "False");
    assert_eq!(condition(&status, "Reconciling")["status"], "True");

    let status = wait_phase(
        &client,
        &ns.name,
        "data",
        TrainingJobPhase::WaitingForData,
        30,
    )
    .await;
    let data_ready = condition(&status, "DataReady");
    assert_eq!(data_ready["status"], "False");
    assert!(
        data_ready["message"].as_str().unwrap().contains("imagenet"),
        "{data_ready}"
    );
    assert!(pods(&client, &ns.name, "data").await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn editing_an_immutable_field_of_a_running_job_is_refused() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "tj-immutable").await;
    apply(&client, &cpu_job("fixed", 2, |_| {}), &ns.name, false)
        .await
        .unwrap();
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), &ns.name);
    let patch = json!({"spec": {"workers": 3}});
    match jobs
        .patch("fixed", &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Err(kube::Error::Api(status)) => {
            assert_eq!(status.code, 422);
            assert!(
                status.message.contains("spec.workers is immutable"),
                "{}",
                status.message
            );
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// A worker the API server refuses (here: a PriorityClass that does not exist yet) shows on
/// the job at once: Stalled=True, reason ChildRejected, the API server's message with the
/// pod's name, and one Warning Event however often the operator retries; once the
/// PriorityClass exists the retry goes through and the job runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_the_api_server_refuses_stalls_the_job_with_its_message() {
    use k8s_openapi::api::scheduling::v1::PriorityClass;
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "tj-rejected").await;
    let _operator = Operator::start(&client, &ns.name).await;
    let class = format!("{}-gold", ns.name);
    let job = cpu_job("refused", 2, |spec| {
        spec["worker"] = json!({"priorityClassName": class});
    });
    apply(&client, &job, &ns.name, false).await.unwrap();

    eventually(
        Duration::from_secs(15),
        "Stalled=True, ChildRejected",
        || async {
            let status = job_status(&client, &ns.name, "refused").await;
            let stalled = condition(&status, "Stalled");
            stalled["status"] == "True" && stalled["reason"] == "ChildRejected"
        },
    )
    .await;
    let status = job_status(&client, &ns.name, "refused").await;
    let message = condition(&status, "Stalled")["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        message.starts_with("creating Pod refused-worker-0: ")
            && message.contains(&format!("no PriorityClass with name {class} was found")),
        "{message}"
    );
    assert_eq!(condition(&status, "Ready")["reason"], "ChildRejected");
    assert_eq!(status["observedGeneration"], 1);
    let warnings = || async {
        common::events_for(&client, &ns.name, "refused")
            .await
            .into_iter()
            .filter(|e| e.reason.as_deref() == Some("ChildRejected"))
            .collect::<Vec<_>>()
    };
    eventually(
        Duration::from_secs(10),
        "a ChildRejected Warning Event",
        || async {
            warnings().await.iter().any(|e| {
                e.type_.as_deref() == Some("Warning") && e.note.as_deref() == Some(message.as_str())
            })
        },
    )
    .await;
    // Retries (1 s, 2 s, 4 s apart) meet the same refusal: still one Event, published once
    // (kube's recorder would turn a second publication into a series with a count).
    tokio::time::sleep(Duration::from_secs(5)).await;
    let events = warnings().await;
    assert_eq!(events.len(), 1, "one Event per distinct message");
    assert!(
        events[0].series.is_none(),
        "published once: {:?}",
        events[0].series
    );

    let classes: Api<PriorityClass> = Api::all(client.clone());
    let priority: PriorityClass =
        serde_json::from_value(json!({"metadata": {"name": class}, "value": 1000})).unwrap();
    classes
        .create(&Default::default(), &priority)
        .await
        .unwrap();
    wait_phase(&client, &ns.name, "refused", TrainingJobPhase::Running, 60).await;
    let status = job_status(&client, &ns.name, "refused").await;
    assert_eq!(condition(&status, "Stalled")["status"], "False");
    classes.delete(&class, &Default::default()).await.unwrap();
}

/// A pod that will not be scheduled and is not the job's: it holds `name` until deleted.
fn foreign_pod(name: &str, labels: Value) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "nodeSelector": {"ringmaster.dev/no-such-node": "true"},
            "containers": [{"name": "main", "image": "busybox"}],
        },
    }))
    .unwrap()
}

/// Pods not of the job hold the names of its pods: one left with the job's labels and no
/// controller (what `kubectl delete --cascade=orphan` leaves of an earlier job, which the
/// operator sees in its cache), and one without them (which only the API server's 409
/// tells). Each blocks the job visibly (Ready says NameInUse, with a Warning), nothing of
/// them is taken over, and the job goes on once they are deleted. The operator runs with
/// the chart's rights.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_of_another_holding_the_jobs_pod_names_block_it_visibly_until_deleted() {
    let admin = client().await;
    ensure_crds(&admin).await;
    let ns = TestNamespace::new(&admin, "tj-names").await;
    common::apply_chart_rbac(
        &admin,
        "tj-names-system",
        "names",
        "logFormat=json",
        "resources: [pods]",
    )
    .await;
    let operator_client = common::impersonating("tj-names-system", "names-ringmaster").await;
    let _operator = Operator::start(&operator_client, &ns.name).await;
    let pod_api: Api<Pod> = Api::namespaced(admin.clone(), &ns.name);
    let orphan = foreign_pod(
        "taken-worker-1",
        json!({"ringmaster.dev/job-name": "taken"}),
    );
    let stranger = foreign_pod("taken-launcher", json!({"app": "someone-elses"}));
    for pod in [&orphan, &stranger] {
        pod_api.create(&Default::default(), pod).await.unwrap();
    }

    apply(&admin, &cpu_job("taken", 2, |_| {}), &ns.name, false)
        .await
        .unwrap();
    // The orphan's name: Ready says so with a Warning; worker 0 is made meanwhile.
    let said = "worker taken-worker-1 cannot be made: a pod of that name exists that this job \
        does not control (its controller: none); delete or rename that pod, and the job goes on";
    eventually(
        Duration::from_secs(30),
        "NameInUse for worker 1",
        || async {
            let status = job_status(&admin, &ns.name, "taken").await;
            condition(&status, "Ready")["reason"] == "NameInUse"
                && !common::warnings_for(&admin, &ns.name, "taken", "NameInUse")
                    .await
                    .is_empty()
        },
    )
    .await;
    let status = job_status(&admin, &ns.name, "taken").await;
    for type_ in ["Ready", "WorkersReady"] {
        assert_eq!(condition(&status, type_)["message"], said, "{type_}");
    }
    assert!(phase_is(&status, TrainingJobPhase::Starting), "{status:#}");
    let ours: Vec<String> = pods(&admin, &ns.name, "taken")
        .await
        .into_iter()
        .filter(|p| !p.owner_references().is_empty())
        .map(|p| p.name_any())
        .collect();
    assert_eq!(ours, ["taken-worker-0"]);

    // Deleted, the name is made the job's: worker 1. Then the launcher's name, which only the
    // create's 409 tells, is said the same way.
    pod_api
        .delete("taken-worker-1", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    let said = "launcher taken-launcher cannot be made: a pod of that name exists that this \
        job does not control (its controller: none); delete or rename that pod, and the job \
        goes on";
    eventually(
        Duration::from_secs(60),
        "NameInUse for the launcher",
        || async {
            let status = job_status(&admin, &ns.name, "taken").await;
            condition(&status, "Ready")["message"] == said
        },
    )
    .await;
    let status = job_status(&admin, &ns.name, "taken").await;
    assert_eq!(condition(&status, "Ready")["reason"], "NameInUse");
    assert_eq!(condition(&status, "WorkersReady")["status"], "True");
    assert_eq!(condition(&status, "Stalled")["status"], "False");
    // Not started: no start time, so no deadline runs.
    assert!(status.get("startTime").is_none(), "{status:#}");
    // A second NameInUse Warning, of its own (about the launcher's name, where the first is
    // about worker 1's), with its own words.
    let notes: Vec<String> = common::warnings_for(&admin, &ns.name, "taken", "NameInUse")
        .await
        .into_iter()
        .map(|e| e.note.unwrap_or_default())
        .collect();
    for name in ["taken-worker-1", "taken-launcher"] {
        assert!(
            notes
                .iter()
                .any(|n| n.contains(&format!(" {name} cannot be made: "))),
            "no NameInUse Warning names {name}: {notes:#?}"
        );
    }
    // Neither held pod was taken over.
    let launcher = pod_api.get("taken-launcher").await.unwrap();
    assert!(launcher.owner_references().is_empty());
    assert_eq!(launcher.labels(), stranger.labels());

    pod_api
        .delete("taken-launcher", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    // Looked at again within 10 s: the deletion of a pod not the job's wakes nothing.
    let status = wait_phase(&admin, &ns.name, "taken", TrainingJobPhase::Running, 30).await;
    assert_eq!(
        condition(&status, "Ready")["reason"],
        "Running",
        "{status:#}"
    );
    let mut ours: Vec<String> = pods(&admin, &ns.name, "taken")
        .await
        .into_iter()
        .map(|p| p.name_any())
        .collect();
    ours.sort();
    assert_eq!(ours, ["taken-launcher", "taken-worker-0", "taken-worker-1"]);
}

/// A worker of a running gang is deleted while its node no longer answers: the gang
/// restarts, and its old worker stays Terminating, holding the name the new gang's worker
/// needs. Within a minute past its grace period the job waits quietly; after that it says
/// so (PodStuckTerminating, with a Warning) with the command that ends it, and once that
/// command has run the new gang runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_stuck_terminating_on_a_lost_node_is_said_and_the_gang_runs_once_it_goes() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "tj-lost").await;
    let _operator = Operator::start(&client, &ns.name).await;
    apply(&client, &cpu_job("lost", 2, |_| {}), &ns.name, false)
        .await
        .unwrap();
    wait_phase(&client, &ns.name, "lost", TrainingJobPhase::Running, 60).await;

    let pods_api: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
    let node = pods_api
        .get("lost-worker-1")
        .await
        .unwrap()
        .spec
        .unwrap()
        .node_name
        .unwrap();
    let lost = json!({"metadata": {"annotations": {"kwok.ringmaster.dev/node-lost": "true"}}});
    pods_api
        .patch(
            "lost-worker-1",
            &PatchParams::default(),
            &Patch::Merge(&lost),
        )
        .await
        .unwrap();
    // A graceful deletion, as a person's or an eviction's (0 would be a forced one).
    // Taken before the request: the deletion timestamp the operator counts from is set while
    // it is answered.
    let deleted_at = std::time::Instant::now();
    pods_api
        .delete("lost-worker-1", &DeleteParams::default().grace_period(1))
        .await
        .unwrap();
    eventually(Duration::from_secs(30), "the restart", || async {
        job_status(&client, &ns.name, "lost").await["restarts"] == 1
    })
    .await;

    // The other pods of gang 0 go; the stuck worker holds back gang 1.
    eventually(
        Duration::from_secs(30),
        "only the stuck worker left",
        || async {
            let names: Vec<String> = pods(&client, &ns.name, "lost")
                .await
                .into_iter()
                .map(|p| p.name_any())
                .collect();
            names == ["lost-worker-1"]
        },
    )
    .await;
    let status = job_status(&client, &ns.name, "lost").await;
    if deleted_at.elapsed() < Duration::from_secs(55) {
        assert_ne!(
            condition(&status, "Ready")["reason"],
            "PodStuckTerminating",
            "said before a minute past its grace period: {status:#}"
        );
    }

    eventually(
        Duration::from_secs(90),
        "PodStuckTerminating with a Warning",
        || async {
            let status = job_status(&client, &ns.name, "lost").await;
            condition(&status, "Ready")["reason"] == "PodStuckTerminating"
                && !common::warnings_for(&client, &ns.name, "lost", "PodStuckTerminating")
                    .await
                    .is_empty()
        },
    )
    .await;
    // Not before a minute past its grace period (1 s).
    assert!(deleted_at.elapsed() >= Duration::from_secs(60));
    let status = job_status(&client, &ns.name, "lost").await;
    let message = condition(&status, "Ready")["message"]
        .as_str()
        .unwrap()
        .to_string();
    let command = format!(
        "kubectl delete pod lost-worker-1 -n {} --grace-period=0 --force",
        ns.name
    );
    for words in [
        "pod lost-worker-1 of gang attempt 0 is still being deleted, its grace period over since ",
        &format!("its node {node} may be lost ({command})"),
        "or a finalizer holds it",
    ] {
        assert!(message.contains(words), "{words:?} not in {message:?}");
    }
    assert_eq!(
        condition(&status, "WorkersReady")["reason"],
        "PodStuckTerminating"
    );
    assert!(phase_is(&status, TrainingJobPhase::Starting), "{status:#}");

    // What the message says to do (a forced deletion): the pod goes at once, and gang 1 runs.
    pods_api
        .delete("lost-worker-1", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    let status = wait_phase(&client, &ns.name, "lost", TrainingJobPhase::Running, 30).await;
    assert_eq!(
        condition(&status, "Ready")["reason"],
        "Running",
        "{status:#}"
    );
    for pod in pods(&client, &ns.name, "lost").await {
        assert_eq!(
            pod.labels()["ringmaster.dev/attempt"],
            "1",
            "{}",
            pod.name_any()
        );
    }
}

/// The pod-template fields (pull secrets, ServiceAccount, affinity, spreading, init and added
/// containers, ports) pass the API server's schema of the CRD and reach the pods the
/// operator makes, beside its own: the worker keeps its sshd container first and its ports,
/// the API token stays off, and the scheduler places pods whose affinity KWOK's nodes meet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_template_fields_reach_the_workers_and_the_launcher() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "tj-template").await;
    // The ServiceAccount admission refuses a pod whose ServiceAccount does not exist.
    let accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> =
        Api::namespaced(client.clone(), &ns.name);
    accounts
        .create(
            &Default::default(),
            &serde_json::from_value(json!({"metadata": {"name": "trainer"}})).unwrap(),
        )
        .await
        .unwrap();
    let _operator = Operator::start(&client, &ns.name).await;
    let affinity = json!({
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]}]}
        ]}},
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 10, "podAffinityTerm": {
            "topologyKey": "kubernetes.io/hostname",
            "labelSelector": {"matchLabels": {"ringmaster.dev/role": "worker"}}
        }}]},
    });
    let template = json!({
        "imagePullSecrets": [{"name": "registry-creds"}],
        "serviceAccountName": "trainer",
        "affinity": affinity,
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                       "whenUnsatisfiable": "ScheduleAnyway"}],
        "initContainers": [{"name": "fetch", "image": "busybox:1.36"}],
        "containers": [{"name": "exporter", "image": "busybox:1.36"}],
        "ports": [{"name": "metrics", "containerPort": 9400}],
    });
    let job = cpu_job("template", 2, |spec| {
        spec["worker"] = template.clone();
        spec["launcher"] = template.clone();
    });
    apply(&client, &job, &ns.name, false).await.unwrap();
    wait_phase(&client, &ns.name, "template", TrainingJobPhase::Running, 60).await;

    let all = pods(&client, &ns.name, "template").await;
    assert_eq!(all.len(), 3, "two workers and the launcher");
    for pod in &all {
        let role = pod.labels()["ringmaster.dev/role"].clone();
        let spec = pod.spec.as_ref().unwrap();
        let value = serde_json::to_value(spec).unwrap();
        assert_eq!(
            value["imagePullSecrets"],
            json!([{"name": "registry-creds"}]),
            "{role}"
        );
        assert_eq!(
            spec.service_account_name.as_deref(),
            Some("trainer"),
            "{role}"
        );
        assert_eq!(spec.automount_service_account_token, Some(false), "{role}");
        assert_eq!(value["affinity"], affinity, "{role}");
        assert_eq!(
            value["topologySpreadConstraints"][0]["topologyKey"], "kubernetes.io/hostname",
            "{role}"
        );
        let names = |containers: &[k8s_openapi::api::core::v1::Container]| -> Vec<String> {
            containers.iter().map(|c| c.name.clone()).collect()
        };
        assert_eq!(
            names(spec.init_containers.as_deref().unwrap()),
            ["fetch"],
            "{role}"
        );
        assert_eq!(
            names(&spec.containers),
            [role.as_str(), "exporter"],
            "{role}"
        );
        let ports: Vec<String> = spec.containers[0]
            .ports
            .iter()
            .flatten()
            .filter_map(|p| p.name.clone())
            .collect();
        let want: &[&str] = if role == "worker" {
            &["ssh", "rendezvous", "metrics"]
        } else {
            &["metrics"]
        };
        assert_eq!(ports, want, "{role}");
        // The added containers carry Ringmaster's container defaults.
        let exporter = &spec.containers[1];
        assert_eq!(
            exporter
                .security_context
                .as_ref()
                .and_then(|s| s.allow_privilege_escalation),
            Some(false),
            "{role}"
        );
    }

    // A sidecar named like Ringmaster's container is refused by the API server's CEL rule.
    let clash = cpu_job("template-clash", 2, |spec| {
        spec["worker"] = json!({"containers": [{"name": "worker", "image": "busybox:1.36"}]});
    });
    match apply(&client, &clash, &ns.name, true).await {
        Err(kube::Error::Api(status)) => {
            assert_eq!(status.code, 422, "{}", status.message);
            assert!(
                status.message.contains("spec.worker.containers")
                    && status.message.contains("names of Ringmaster's containers"),
                "{}",
                status.message
            );
        }
        other => panic!("a sidecar named worker was not refused: {other:?}"),
    }
}
