//! Gang scheduling with the real scheduler-plugins scheduler (v0.34.7 with its Coscheduling
//! plugin, built from its module and run by e2e/gang-scheduler.sh beside the cluster's own
//! kube-scheduler), KWOK playing the GPU nodes, and the operator run with the chart's rights
//! for `gangScheduler`: a job whose gang does not fit holds no node (a bound pod would be
//! seen by the watch, not only by a poll), and runs once room appears.

mod common;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{
    Operator, TestNamespace, apply, client, condition, ensure_crds, eventually, job_status, pods,
    wait_phase,
};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Pod, Taint};
use kube::api::{Patch, PatchParams};
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use ringmaster::api::{TrainingJob, TrainingJobPhase};
use ringmaster::controller::OperatorConfig;
use ringmaster::gang::{POD_GROUP_LABEL, PodGroup};
use ringmaster_e2e::nodes::{self, PoolMode, PoolShape};
use serde_json::{Value, json};
use tokio::sync::OnceCell;

/// The name e2e/gang-scheduler.sh (and the scheduler-plugins chart) gives the scheduler.
const SCHEDULER: &str = "scheduler-plugins-scheduler";
/// This file's pool of ND96asr_v4 nodes (8 GPUs each), tainted so only its jobs land there.
const POOL: &str = "gangp";
const POOL_TAINT: &str = "e2e.ringmaster.dev/gang-pool";
/// The namespace of the operator's ServiceAccount in these tests (kept for the cluster's life).
const OPERATOR_NAMESPACE: &str = "e2e-gang-operator";
/// Longer than the scheduler's Permit wait (10 s in e2e/gang-scheduler.sh). The cluster's
/// other GPU nodes leave enough GPUs free in all for the group's `minResources`, so the
/// scheduler gets past its up-front check and holds the worker that fits the free node,
/// until the other is turned away and it gives the node back.
const HOLD: Duration = Duration::from_secs(15);

/// The gang scheduler, once per test binary (a no-op when it runs; cluster.sh down stops it).
async fn gang_scheduler() {
    static UP: OnceCell<()> = OnceCell::const_new();
    UP.get_or_init(|| common::script_up("gang-scheduler.sh"))
        .await;
}

fn pool() -> PoolShape {
    let mut shape = PoolShape::new(POOL, "Standard_ND96asr_v4", PoolMode::User).unwrap();
    shape.taints.push(
        serde_json::from_value::<Taint>(
            json!({"key": POOL_TAINT, "value": POOL, "effect": "NoSchedule"}),
        )
        .unwrap(),
    );
    shape
}

/// The operator gang-scheduling with the chart's rights (`gangScheduler` set), watching `ns`.
async fn operator(admin: &Client, ns: &str) -> Operator {
    static RBAC: OnceCell<()> = OnceCell::const_new();
    RBAC.get_or_init(|| async {
        let set = format!("gangScheduler={SCHEDULER}");
        common::apply_chart_rbac(
            admin,
            OPERATOR_NAMESPACE,
            "gang",
            &set,
            "scheduling.x-k8s.io",
        )
        .await
    })
    .await;
    let client = common::impersonating(OPERATOR_NAMESPACE, "gang-ringmaster").await;
    Operator::start_with(
        &client,
        ns,
        OperatorConfig {
            restart_backoff: Duration::from_millis(500),
            gang_scheduler: Some(SCHEDULER.into()),
            ..OperatorConfig::default()
        },
    )
    .await
}

/// A job of 2 workers × 8 GPUs on this file's pool: each worker takes a whole node.
fn gang_job(name: &str) -> Value {
    json!({
        "apiVersion": "ringmaster.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "workers": 2, "gpusPerWorker": 8,
            "image": "ringmaster-trainer:e2e",
            "command": common::own_gpu_program(),
            "nodePool": {"provisioner": "existing", "vmSize": "Standard_ND96asr_v4",
                         "nodeSelector": {"kubernetes.azure.com/agentpool": POOL}},
            "worker": {"tolerations": [{"key": POOL_TAINT, "operator": "Exists", "effect": "NoSchedule"}]},
        },
    })
}

/// Every worker pod of the namespace the API server ever reported bound to a node, by name.
struct BindingWatch {
    bound: Arc<Mutex<BTreeSet<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl BindingWatch {
    async fn start(client: &Client, ns: &str) -> Self {
        let bound = Arc::new(Mutex::new(BTreeSet::new()));
        let record = bound.clone();
        let api: Api<Pod> = Api::namespaced(client.clone(), ns);
        let task = tokio::spawn(async move {
            let config = watcher::Config::default().labels("ringmaster.dev/role=worker");
            let mut events = watcher(api, config).boxed();
            while let Some(event) = events.next().await {
                let pods = match event {
                    Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) => vec![pod],
                    _ => continue,
                };
                for pod in pods {
                    if pod.spec.as_ref().is_some_and(|s| s.node_name.is_some()) {
                        record.lock().unwrap().insert(pod.name_any());
                    }
                }
            }
        });
        // The watch has started before the test makes anything.
        tokio::time::sleep(Duration::from_millis(500)).await;
        Self { bound, task }
    }

    /// The workers of `job` ever bound.
    fn of(&self, job: &str) -> Vec<String> {
        let prefix = format!("{job}-worker-");
        self.bound
            .lock()
            .unwrap()
            .iter()
            .filter(|p| p.starts_with(&prefix))
            .cloned()
            .collect()
    }
}

impl Drop for BindingWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn workers(client: &Client, ns: &str, job: &str) -> Vec<Pod> {
    pods(client, ns, job)
        .await
        .into_iter()
        .filter(|p| p.labels()["ringmaster.dev/role"] == "worker")
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gang_that_does_not_fit_holds_no_node_and_runs_once_there_is_room() {
    let client = client().await;
    ensure_crds(&client).await;
    gang_scheduler().await;
    let ns = TestNamespace::new(&client, "gang").await;
    // Three nodes: one job of two fills two, and leaves one free.
    nodes::add(&client, &pool(), 3).await.unwrap();
    let watch = BindingWatch::start(&client, &ns.name).await;
    let _operator = operator(&client, &ns.name).await;

    // The first job runs whole, on the pool, through the gang scheduler, in its PodGroup.
    let mut first = gang_job("first");
    first["spec"]["runPolicy"] = json!({"schedulingPolicy": {"scheduleTimeoutSeconds": 120}});
    apply(&client, &first, &ns.name, false).await.unwrap();
    wait_phase(&client, &ns.name, "first", TrainingJobPhase::Running, 60).await;
    let groups: Api<PodGroup> = Api::namespaced(client.clone(), &ns.name);
    let listed = groups.list(&Default::default()).await.unwrap().items;
    assert_eq!(listed.len(), 1, "one PodGroup for the one job");
    let group = &listed[0];
    assert_eq!(group.spec.min_member, 2, "the workers are the gang");
    assert_eq!(group.spec.min_resources["nvidia.com/gpu"].0, "16");
    assert_eq!(group.spec.schedule_timeout_seconds, Some(120));
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), &ns.name);
    let owner = &group.owner_references()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str()),
        ("TrainingJob", "first")
    );
    assert_eq!(
        Some(&owner.uid),
        jobs.get("first").await.unwrap().metadata.uid.as_ref()
    );
    assert_eq!(owner.controller, Some(true));
    // The job's timeout changed is the group's timeout changed; taken out, taken out.
    for (timeout, expected) in [(json!(45), Some(45)), (Value::Null, None)] {
        let change = json!({"spec": {"runPolicy": {"schedulingPolicy": {"scheduleTimeoutSeconds": timeout}}}});
        jobs.patch("first", &PatchParams::default(), &Patch::Merge(&change))
            .await
            .unwrap();
        eventually(
            Duration::from_secs(30),
            &format!("the PodGroup's scheduleTimeoutSeconds {expected:?}"),
            || async {
                groups
                    .get(&group.name_any())
                    .await
                    .unwrap()
                    .spec
                    .schedule_timeout_seconds
                    == expected
            },
        )
        .await;
    }
    for pod in pods(&client, &ns.name, "first").await {
        let spec = pod.spec.as_ref().unwrap();
        assert_eq!(
            spec.scheduler_name.as_deref(),
            Some(SCHEDULER),
            "{}",
            pod.name_any()
        );
        assert_eq!(
            pod.labels()[POD_GROUP_LABEL],
            group.name_any(),
            "{}",
            pod.name_any()
        );
        assert!(spec.node_name.is_some(), "{} bound", pod.name_any());
    }
    for worker in workers(&client, &ns.name, "first").await {
        let node = worker.spec.unwrap().node_name.unwrap();
        assert!(node.starts_with(&format!("aks-{POOL}-")), "{node}");
    }

    // The second needs two nodes and one is free: the default scheduler would bind a worker
    // there and hold the node; the gang scheduler binds none.
    apply(&client, &gang_job("second"), &ns.name, false)
        .await
        .unwrap();
    eventually(
        Duration::from_secs(30),
        "the second job's workers made",
        || async { workers(&client, &ns.name, "second").await.len() == 2 },
    )
    .await;
    tokio::time::sleep(HOLD).await;
    assert_eq!(
        watch.of("second"),
        Vec::<String>::new(),
        "no worker of a gang that does not fit is bound"
    );
    // It says why, with the scheduler's words.
    eventually(
        Duration::from_secs(30),
        "the second job saying it cannot be scheduled",
        || async {
            let status = job_status(&client, &ns.name, "second").await;
            ["Ready", "WorkersReady"].iter().all(|type_| {
                let c = condition(&status, type_);
                c["status"] == "False"
                    && c["reason"] == "Unschedulable"
                    && c["message"].as_str().is_some_and(|m| {
                        m.contains("second-worker-") && m.contains("cannot be scheduled")
                    })
            })
        },
    )
    .await;
    assert!(matches!(
        job_status(&client, &ns.name, "second").await["phase"].as_str(),
        Some("Starting")
    ));

    // The first ends and gives its nodes back: the second runs, whole.
    common::end_launcher(&client, &ns.name, "first").await;
    wait_phase(&client, &ns.name, "first", TrainingJobPhase::Succeeded, 60).await;
    wait_phase(&client, &ns.name, "second", TrainingJobPhase::Running, 90).await;
    assert_eq!(watch.of("second").len(), 2);

    // The PodGroups go with their jobs.
    jobs.delete("first", &Default::default()).await.unwrap();
    eventually(
        Duration::from_secs(60),
        "the first job's PodGroup collected",
        || async {
            let left = groups.list(&Default::default()).await.unwrap().items;
            left.len() == 1 && left[0].owner_references()[0].name == "second"
        },
    )
    .await;
    nodes::remove(&client, POOL).await.unwrap();
}
