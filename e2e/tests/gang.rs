//! Gang scheduling with real gang schedulers beside the cluster's own kube-scheduler, each
//! built from its module: scheduler-plugins v0.34.7 with its Coscheduling plugin
//! (e2e/gang-scheduler.sh) and Volcano v1.14.1's scheduler with its queue and PodGroup
//! controllers (e2e/volcano.sh). KWOK plays the GPU nodes, and the operator runs with the
//! chart's rights for `gangScheduler`. With either, a job whose gang does not fit holds no
//! node (a bound pod would be seen by the watch, not only by a poll), and runs once room
//! appears.

mod common;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{
    Operator, TestNamespace, apply, client, condition, ensure_crds, eventually, job_status, pods,
    wait_phase,
};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams};
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use ringmaster::api::{TrainingJob, TrainingJobPhase};
use ringmaster::controller::OperatorConfig;
use ringmaster::gang::{GangScheduler, POD_GROUP_LABEL, PodGroup, volcano};
use ringmaster_e2e::nodes::{self, PoolMode, PoolShape};
use serde_json::{Value, json};

/// A gang scheduler under test: the script that runs it beside the cluster, what the chart
/// is given to gang-schedule with it, and a pool of ND96asr_v4 nodes (8 GPUs each) of its
/// own, tainted so only its jobs land there.
struct Gang {
    /// Its name: the pods' `schedulerName`.
    scheduler: &'static str,
    /// The e2e script that runs it.
    script: &'static str,
    /// The chart release whose RBAC the operator has.
    release: &'static str,
    /// What that RBAC must grant (the PodGroups' API group).
    grants: &'static str,
    /// Its pool.
    pool: &'static str,
}

/// scheduler-plugins' Coscheduling, as its chart names it.
const COSCHEDULING: Gang = Gang {
    scheduler: "scheduler-plugins-scheduler",
    script: "gang-scheduler.sh",
    release: "gang",
    grants: "scheduling.x-k8s.io",
    pool: "gangp",
};
/// Volcano, as its chart names it.
const VOLCANO: Gang = Gang {
    scheduler: "volcano",
    script: "volcano.sh",
    release: "volcano",
    grants: "scheduling.volcano.sh",
    pool: "volcp",
};
const POOL_TAINT: &str = "e2e.ringmaster.dev/gang-pool";
/// The namespace of the operator's ServiceAccount in these tests (kept for the cluster's life).
const OPERATOR_NAMESPACE: &str = "e2e-gang-operator";
/// Longer than the scheduler-plugins scheduler's Permit wait (10 s in e2e/gang-scheduler.sh).
/// The cluster's other GPU nodes leave enough GPUs free in all for the group's
/// `minResources`, so the scheduler gets past its up-front check and holds the worker that
/// fits the free node, until the other is turned away and it gives the node back.
const HOLD: Duration = Duration::from_secs(15);

impl Gang {
    /// Starts the scheduler (a no-op when it runs; cluster.sh down stops it). One script at
    /// a time: a script stops what it finds running but not yet healthy, which would be a
    /// start another test is waiting on.
    async fn up(&self) {
        static STARTING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
        let _one = STARTING.lock().await;
        common::script_up(self.script).await;
    }

    fn pool(&self) -> PoolShape {
        PoolShape::new(self.pool, "Standard_ND96asr_v4", PoolMode::User)
            .unwrap()
            .tainted(POOL_TAINT, self.pool)
    }

    /// The operator gang-scheduling with it, with the chart's rights for it (`gangScheduler`
    /// set; the API follows from the name), watching `ns`.
    async fn operator(&self, admin: &Client, ns: &str) -> Operator {
        let set = format!("gangScheduler={}", self.scheduler);
        common::apply_chart_rbac(admin, OPERATOR_NAMESPACE, self.release, &set, self.grants).await;
        let client =
            common::impersonating(OPERATOR_NAMESPACE, &format!("{}-ringmaster", self.release))
                .await;
        Operator::start_with(
            &client,
            ns,
            OperatorConfig {
                restart_backoff: Duration::from_millis(500),
                gang_scheduler: Some(GangScheduler::new(self.scheduler, None)),
                ..OperatorConfig::default()
            },
        )
        .await
    }

    /// A job of 2 workers × 8 GPUs on its pool: each worker takes a whole node.
    fn job(&self, name: &str) -> Value {
        json!({
            "apiVersion": "ringmaster.dev/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": name},
            "spec": {
                "workers": 2, "gpusPerWorker": 8,
                "image": "ringmaster-trainer:e2e",
                "command": common::own_gpu_program(),
                "nodePool": {"provisioner": "existing", "vmSize": "Standard_ND96asr_v4",
                             "nodeSelector": {"kubernetes.azure.com/agentpool": self.pool}},
                "worker": {"tolerations": [{"key": POOL_TAINT, "operator": "Exists", "effect": "NoSchedule"}]},
            },
        })
    }
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
    let gang = &COSCHEDULING;
    gang.up().await;
    let ns = TestNamespace::new(&client, "gang").await;
    // Three nodes: one job of two fills two, and leaves one free.
    nodes::add(&client, &gang.pool(), 3).await.unwrap();
    let watch = BindingWatch::start(&client, &ns.name).await;
    let _operator = gang.operator(&client, &ns.name).await;

    // The first job runs whole, on the pool, through the gang scheduler, in its PodGroup.
    let mut first = gang.job("first");
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
            Some(gang.scheduler),
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
        assert!(node.starts_with(&format!("aks-{}-", gang.pool)), "{node}");
    }

    // The second needs two nodes and one is free: the default scheduler would bind a worker
    // there and hold the node; the gang scheduler binds none.
    apply(&client, &gang.job("second"), &ns.name, false)
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
    nodes::remove(&client, gang.pool).await.unwrap();
}

/// Volcano's queues (cluster-scoped).
fn volcano_queues(client: &Client) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("scheduling.volcano.sh", "v1beta1", "Queue");
    Api::all_with(
        client.clone(),
        &ApiResource::from_gvk_with_plural(&gvk, "queues"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volcano_gang_that_does_not_fit_holds_no_node_and_runs_once_there_is_room() {
    let client = client().await;
    ensure_crds(&client).await;
    let gang = &VOLCANO;
    gang.up().await;
    let ns = TestNamespace::new(&client, "volcano").await;
    nodes::add(&client, &gang.pool(), 3).await.unwrap();
    let watch = BindingWatch::start(&client, &ns.name).await;
    let _operator = gang.operator(&client, &ns.name).await;
    // A queue of the test's own, which Volcano's queue controller opens.
    let queues = volcano_queues(&client);
    let queue = ns.name.clone();
    let object: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "scheduling.volcano.sh/v1beta1", "kind": "Queue",
        "metadata": {"name": queue},
        "spec": {"weight": 1, "reclaimable": true},
    }))
    .unwrap();
    queues.create(&Default::default(), &object).await.unwrap();
    eventually(Duration::from_secs(30), "the test's queue open", || async {
        queues.get(&queue).await.unwrap().data["status"]["state"] == "Open"
    })
    .await;

    // The first job runs whole, on the pool, in a Volcano PodGroup in its queue.
    let mut first = gang.job("first");
    first["spec"]["runPolicy"] = json!({"schedulingPolicy": {"queue": queue}});
    apply(&client, &first, &ns.name, false).await.unwrap();
    wait_phase(&client, &ns.name, "first", TrainingJobPhase::Running, 60).await;
    let groups: Api<volcano::PodGroup> = Api::namespaced(client.clone(), &ns.name);
    let listed = groups.list(&Default::default()).await.unwrap().items;
    assert_eq!(listed.len(), 1, "one PodGroup for the one job");
    let group = &listed[0];
    assert_eq!(group.spec.min_member, 2, "the workers are the gang");
    assert_eq!(group.spec.min_resources["nvidia.com/gpu"].0, "16");
    assert_eq!(group.spec.queue.as_deref(), Some(queue.as_str()));
    let owner = &group.owner_references()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str(), owner.controller),
        ("TrainingJob", "first", Some(true))
    );
    for pod in pods(&client, &ns.name, "first").await {
        let spec = pod.spec.as_ref().unwrap();
        assert_eq!(spec.scheduler_name.as_deref(), Some(gang.scheduler));
        assert_eq!(
            pod.annotations()[volcano::GROUP_NAME_ANNOTATION],
            group.name_any(),
            "{}",
            pod.name_any()
        );
        assert!(spec.node_name.is_some(), "{} bound", pod.name_any());
    }
    for worker in workers(&client, &ns.name, "first").await {
        let node = worker.spec.unwrap().node_name.unwrap();
        assert!(node.starts_with(&format!("aks-{}-", gang.pool)), "{node}");
    }

    // The second needs two nodes and one is free: Volcano binds none of it.
    apply(&client, &gang.job("second"), &ns.name, false)
        .await
        .unwrap();
    eventually(
        Duration::from_secs(30),
        "the second job's workers made",
        || async { workers(&client, &ns.name, "second").await.len() == 2 },
    )
    .await;
    // Several of Volcano's scheduling sessions (one a second).
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        watch.of("second"),
        Vec::<String>::new(),
        "no worker of a gang that does not fit is bound"
    );
    // It says why, with Volcano's words.
    eventually(
        Duration::from_secs(30),
        "the second job saying it cannot be scheduled",
        || async {
            let status = job_status(&client, &ns.name, "second").await;
            let c = condition(&status, "Ready");
            c["status"] == "False"
                && c["reason"] == "Unschedulable"
                && c["message"].as_str().is_some_and(|m| {
                    m.contains("second-worker-") && m.contains("cannot be scheduled")
                })
        },
    )
    .await;
    assert!(matches!(
        job_status(&client, &ns.name, "second").await["phase"].as_str(),
        Some("Starting")
    ));
    // Moved to the test's queue while it waits: its group follows.
    let second_group = groups
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .find(|g| g.owner_references()[0].name == "second")
        .expect("the second job's PodGroup");
    // Unset, the CRD's default: Volcano's default queue.
    assert_eq!(second_group.spec.queue.as_deref(), Some("default"));
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), &ns.name);
    let change = json!({"spec": {"runPolicy": {"schedulingPolicy": {"queue": queue}}}});
    jobs.patch("second", &PatchParams::default(), &Patch::Merge(&change))
        .await
        .unwrap();
    eventually(
        Duration::from_secs(30),
        "the second group in the test's queue",
        || async {
            groups
                .get(&second_group.name_any())
                .await
                .unwrap()
                .spec
                .queue
                .as_deref()
                == Some(queue.as_str())
        },
    )
    .await;

    // The first ends and gives its nodes back: the second runs, whole.
    common::end_launcher(&client, &ns.name, "first").await;
    wait_phase(&client, &ns.name, "first", TrainingJobPhase::Succeeded, 60).await;
    wait_phase(&client, &ns.name, "second", TrainingJobPhase::Running, 90).await;
    assert_eq!(watch.of("second").len(), 2);

    // A worker is OOM-killed: the restarted gang joins the same group and is placed whole
    // again.
    let oom = json!({"metadata": {"annotations": {"kwok.ringmaster.dev/exit-code": "137", "kwok.ringmaster.dev/reason": "OOMKilled"}}});
    Api::<Pod>::namespaced(client.clone(), &ns.name)
        .patch(
            "second-worker-1",
            &PatchParams::default(),
            &Patch::Merge(&oom),
        )
        .await
        .unwrap();
    eventually(
        Duration::from_secs(90),
        "the second job's gang restarted and running",
        || async {
            let status = job_status(&client, &ns.name, "second").await;
            status["restarts"] == 1 && status["phase"] == "Running"
        },
    )
    .await;
    for pod in pods(&client, &ns.name, "second").await {
        assert_eq!(
            pod.labels()["ringmaster.dev/attempt"],
            "1",
            "{}",
            pod.name_any()
        );
        assert!(
            pod.spec.as_ref().unwrap().node_name.is_some(),
            "{} bound",
            pod.name_any()
        );
    }

    jobs.delete("first", &Default::default()).await.unwrap();
    jobs.delete("second", &Default::default()).await.unwrap();
    eventually(
        Duration::from_secs(60),
        "the PodGroups collected",
        || async {
            groups
                .list(&Default::default())
                .await
                .unwrap()
                .items
                .is_empty()
        },
    )
    .await;
    nodes::remove(&client, gang.pool).await.unwrap();
    queues.delete(&queue, &Default::default()).await.unwrap();
}
