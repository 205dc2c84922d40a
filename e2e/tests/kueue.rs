//! Queued TrainingJobs with the real Kueue (v0.19.2, built from its module and run by
//! e2e/kueue.sh with its own webhooks and certificates) on the local control plane, KWOK
//! playing the GPU nodes: quota admits all of a gang or none of it, pods land on the admitted
//! flavor's nodes, a higher priority preempts and the victim resumes, an operator killed
//! in the middle of admission or preemption converges to the same result, and with
//! scheduler-plugins' gang scheduler (e2e/gang-scheduler.sh) as well, an admitted gang that
//! does not fit the nodes holds none of them.
//!
//! "No pod exists while its job is not admitted" is checked on every change the API server
//! made, not by polling: pods and Workloads are watched for the whole test, and the changes
//! are replayed in the order of their resourceVersions (etcd's revision, one sequence for
//! every kind of one etcd), so each moment a pod of a job existed is checked against its
//! Workload's admission at that same moment.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{
    Operator, TestNamespace, apply, client, condition, ensure_crds, eventually, job_status,
    phase_is, pods, wait_phase,
};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ListParams, Patch, PatchParams};
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use ringmaster::api::TrainingJobPhase;
use ringmaster::controller::OperatorConfig;
use ringmaster::gang::{GangScheduler, POD_GROUP_LABEL, PodGroup};
use ringmaster::kueue::Workload;
use ringmaster_e2e::nodes::{self, PoolMode, PoolShape};
use serde_json::{Value, json};
use tokio::sync::OnceCell;

/// The taint of the node pools these tests make: only pods an admission tolerates land there.
const POOL_TAINT: &str = "e2e.ringmaster.dev/kueue-pool";

/// A test's client and namespace, with the CRDs and Kueue up.
async fn with_kueue(namespace: &str) -> (Client, TestNamespace) {
    let client = client().await;
    ensure_crds(&client).await;
    kueue(&client).await;
    let ns = TestNamespace::new(&client, namespace).await;
    (client, ns)
}

/// Kueue, once per test binary (e2e/kueue.sh is a no-op when it runs; cluster.sh down stops
/// it), and two tainted KWOK pools of ND96asr_v4 nodes, `kqa` and `kqb`.
async fn kueue(client: &Client) {
    static UP: OnceCell<()> = OnceCell::const_new();
    UP.get_or_init(|| async {
        common::script_up("kueue.sh").await;
        for pool in ["kqa", "kqb"] {
            nodes::add(client, &tainted_pool(pool), 2).await.unwrap();
        }
    })
    .await;
}

/// A pool of ND96asr_v4 nodes that only pods tolerating `POOL_TAINT=<pool>` land on.
fn tainted_pool(pool: &str) -> PoolShape {
    PoolShape::new(pool, "Standard_ND96asr_v4", PoolMode::User)
        .unwrap()
        .tainted(POOL_TAINT, pool)
}

fn kueue_api(
    client: &Client,
    kind: &str,
    plural: &str,
    namespace: Option<&str>,
) -> Api<DynamicObject> {
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kueue.x-k8s.io", "v1beta2", kind),
        plural,
    );
    match namespace {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &resource),
        None => Api::all_with(client.clone(), &resource),
    }
}

/// The plural of a Kueue kind, and whether it is namespaced.
fn kueue_resource(kind: &str) -> (&'static str, bool) {
    match kind {
        "ResourceFlavor" => ("resourceflavors", false),
        "ClusterQueue" => ("clusterqueues", false),
        "LocalQueue" => ("localqueues", true),
        "WorkloadPriorityClass" => ("workloadpriorityclasses", false),
        other => panic!("no plural for {other}"),
    }
}

/// Server-side applies a Kueue object (through Kueue's webhooks), namespaced ones into
/// `namespace`; `dry_run` stores nothing.
async fn kueue_apply_as(
    client: &Client,
    object: &Value,
    namespace: &str,
    dry_run: bool,
) -> Result<(), kube::Error> {
    let kind = object["kind"].as_str().unwrap();
    let (plural, namespaced) = kueue_resource(kind);
    let mut params = PatchParams::apply("e2e").force();
    params.dry_run = dry_run;
    kueue_api(client, kind, plural, namespaced.then_some(namespace))
        .patch(
            object["metadata"]["name"].as_str().unwrap(),
            &params,
            &Patch::Apply(object),
        )
        .await
        .map(|_| ())
}

async fn kueue_apply(client: &Client, object: Value, namespace: &str) {
    kueue_apply_as(client, &object, namespace, false)
        .await
        .unwrap_or_else(|e| panic!("{} {}: {e}", object["kind"], object["metadata"]["name"]));
}

/// The flavors (name, KWOK pool, GPUs of quota) and a ClusterQueue over them for namespace
/// `ns`, with its LocalQueue `team`; returns the ClusterQueue's name (see
/// [`remove_cluster_queue`]).
async fn team_queue(
    client: &Client,
    ns: &TestNamespace,
    name: &str,
    flavors: &[(&str, &str, u32)],
) -> String {
    let t = tag(ns);
    let mut quotas = Vec::new();
    for (flavor_name, pool, gpus) in flavors {
        let flavor_name = format!("{flavor_name}-{t}");
        kueue_apply(client, flavor(&flavor_name, pool), &ns.name).await;
        quotas.push((flavor_name, *gpus));
    }
    let cq = format!("{name}-{t}");
    let quotas: Vec<(&str, u32)> = quotas.iter().map(|(f, g)| (f.as_str(), *g)).collect();
    kueue_apply(client, cluster_queue(&cq, &ns.name, &quotas), &ns.name).await;
    kueue_apply(client, local_queue("team", &cq), &ns.name).await;
    cq
}

/// ClusterQueues are cluster-wide: each test removes its own.
async fn remove_cluster_queue(client: &Client, cq: &str) {
    kueue_api(client, "ClusterQueue", "clusterqueues", None)
        .delete(cq, &Default::default())
        .await
        .ok();
}

/// A flavor for KWOK pool `pool`: its agent-pool label and a toleration of its taint.
fn flavor(name: &str, pool: &str) -> Value {
    json!({
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
        "metadata": {"name": name},
        "spec": {
            "nodeLabels": {"kubernetes.azure.com/agentpool": pool},
            "tolerations": [{"key": POOL_TAINT, "operator": "Equal", "value": pool, "effect": "NoSchedule"}],
        },
    })
}

/// A ClusterQueue for namespace `ns` with GPU quota per flavor, preempting lower priorities.
fn cluster_queue(name: &str, ns: &str, flavors: &[(&str, u32)]) -> Value {
    let flavors: Vec<Value> = flavors
        .iter()
        .map(|(f, gpus)| json!({"name": f, "resources": [{"name": "nvidia.com/gpu", "nominalQuota": gpus}]}))
        .collect();
    json!({
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue",
        "metadata": {"name": name},
        "spec": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
            "queueingStrategy": "StrictFIFO",
            "preemption": {"withinClusterQueue": "LowerPriority"},
            "resourceGroups": [{"coveredResources": ["nvidia.com/gpu"], "flavors": flavors}],
        },
    })
}

fn local_queue(name: &str, cluster_queue: &str) -> Value {
    json!({
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
        "metadata": {"name": name},
        "spec": {"clusterQueue": cluster_queue},
    })
}

/// A job of 2 workers × 1 GPU in queue `queue`. Its launcher exits 0 `after` its start, or
/// runs until [`end`] says.
fn queued_job(name: &str, queue: &str, after: Option<&str>, priority: Option<&str>) -> Value {
    let mut labels = json!({"kueue.x-k8s.io/queue-name": queue});
    if let Some(class) = priority {
        labels["kueue.x-k8s.io/priority-class"] = json!(class);
    }
    let mut job = json!({
        "apiVersion": "ringmaster.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "workers": 2, "gpusPerWorker": 1,
            "image": "ringmaster-trainer:e2e",
            "command": common::own_gpu_program(),
        },
    });
    if let Some(after) = after {
        job["spec"]["launcher"] = json!({"annotations": common::launcher_exits(after)});
    }
    job
}

/// The namespace of the operator's ServiceAccount in these tests (kept for the cluster's life).
const OPERATOR_NAMESPACE: &str = "e2e-kueue-operator";

/// A client acting as the chart's ServiceAccount, bound to the ClusterRole the chart renders
/// with `kueue.enabled=true`: the Kueue integration runs with exactly the chart's rights.
async fn chart_rbac(admin: &Client) -> Client {
    static RBAC: OnceCell<()> = OnceCell::const_new();
    RBAC.get_or_init(|| {
        common::apply_chart_rbac(
            admin,
            OPERATOR_NAMESPACE,
            "kq",
            "kueue.enabled=true",
            "kueue.x-k8s.io",
        )
    })
    .await;
    // A client per test: each test has a runtime of its own, which a client's connections
    // live in.
    common::impersonating(OPERATOR_NAMESPACE, "kq-ringmaster").await
}

/// The operator with its Kueue integration and the chart's rights, watching `ns`.
async fn operator(admin: &Client, ns: &str) -> Operator {
    Operator::start_with(
        &chart_rbac(admin).await,
        ns,
        OperatorConfig {
            restart_backoff: Duration::from_millis(500),
            kueue: true,
            ..OperatorConfig::default()
        },
    )
    .await
}

/// A short suffix for the cluster-scoped objects of a test (from its namespace's).
fn tag(ns: &TestNamespace) -> String {
    ns.name.rsplit('-').next().unwrap().to_string()
}

async fn workloads(client: &Client, ns: &str) -> Vec<Workload> {
    Api::<Workload>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
}

async fn workload_of(client: &Client, ns: &str, job: &str) -> Option<Workload> {
    workloads(client, ns).await.into_iter().find(|w| {
        w.owner_references()
            .iter()
            .any(|o| o.kind == "TrainingJob" && o.name == job)
    })
}

/// One change the API server made, as a watch told it.
#[derive(Clone, Debug)]
enum Change {
    /// A pod of `job` exists after this change (`false`: it was deleted), bound to a node
    /// or not.
    Pod {
        job: String,
        pod: String,
        exists: bool,
        bound: bool,
    },
    /// The Workload of `job` has quota reserved (an admission) after this change.
    Workload { job: String, reserved: bool },
}

fn as_values<K: k8s_openapi::serde::Serialize>(event: watcher::Event<K>) -> watcher::Event<Value> {
    use watcher::Event as E;
    let value = |k: K| serde_json::to_value(k).expect("objects serialize");
    match event {
        E::Apply(k) => E::Apply(value(k)),
        E::Delete(k) => E::Delete(value(k)),
        E::InitApply(k) => E::InitApply(value(k)),
        E::Init => E::Init,
        E::InitDone => E::InitDone,
    }
}

/// Watches pods and Workloads of a namespace for the whole test, recording every change with
/// its resourceVersion.
struct AdmissionWatch {
    changes: Arc<Mutex<Vec<(u64, Change)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl AdmissionWatch {
    async fn start(client: &Client, ns: &str) -> Self {
        let changes = Arc::new(Mutex::new(Vec::new()));
        let pods = watcher(
            Api::<Pod>::namespaced(client.clone(), ns),
            watcher::Config::default().labels("ringmaster.dev/job-name"),
        )
        .map(|event| event.map(|e| ("pod", as_values(e))));
        let workloads = watcher(
            Api::<Workload>::namespaced(client.clone(), ns),
            watcher::Config::default(),
        )
        .map(|event| event.map(|e| ("workload", as_values(e))));
        let record = changes.clone();
        let (started, both_started) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let mut both = futures::stream::select(pods.boxed(), workloads.boxed());
            // Each watch has listed what exists and watches from there once it says InitDone.
            let (mut started, mut listed) = (Some(started), BTreeSet::new());
            while let Some(event) = both.next().await {
                let Ok((kind, event)) = event else { continue };
                let (object, gone) = match event {
                    watcher::Event::Apply(o) | watcher::Event::InitApply(o) => (o, false),
                    watcher::Event::Delete(o) => (o, true),
                    watcher::Event::InitDone => {
                        listed.insert(kind);
                        if listed.len() == 2
                            && let Some(started) = started.take()
                        {
                            let _ = started.send(());
                        }
                        continue;
                    }
                    watcher::Event::Init => continue,
                };
                let rv: u64 = object["metadata"]["resourceVersion"]
                    .as_str()
                    .and_then(|v| v.parse().ok())
                    .expect("a resourceVersion etcd gave");
                let change = if kind == "pod" {
                    Change::Pod {
                        job: object["metadata"]["labels"]["ringmaster.dev/job-name"]
                            .as_str()
                            .unwrap()
                            .to_string(),
                        pod: object["metadata"]["name"].as_str().unwrap().to_string(),
                        exists: !gone,
                        bound: object["spec"]["nodeName"].is_string(),
                    }
                } else {
                    Change::Workload {
                        job: object["metadata"]["ownerReferences"][0]["name"]
                            .as_str()
                            .unwrap_or_default()
                            .to_string(),
                        reserved: !gone && !object["status"]["admission"].is_null(),
                    }
                };
                record.lock().unwrap().push((rv, change));
            }
        });
        // Both watches have started before the test makes anything.
        tokio::time::timeout(Duration::from_secs(30), both_started)
            .await
            .expect("the watches of pods and Workloads started within 30 s")
            .expect("the watch task runs");
        Self { changes, task }
    }

    /// Replays the changes in etcd's order; returns every moment a pod existed while its
    /// job's Workload had no admission, and how many pod changes were checked.
    fn violations(&self) -> (Vec<String>, usize) {
        let mut changes = self.changes.lock().unwrap().clone();
        changes.sort_by_key(|(rv, _)| *rv);
        let mut reserved: BTreeMap<String, bool> = BTreeMap::new();
        let mut live: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        let mut found = Vec::new();
        let mut checked = 0;
        for (rv, change) in changes {
            match change {
                Change::Workload { job, reserved: r } => {
                    reserved.insert(job.clone(), r);
                    if !r && live.get(&job).is_some_and(|p| !p.is_empty()) {
                        found.push(format!(
                            "rv {rv}: {job}'s admission went while its pods {:?} existed",
                            live[&job]
                        ));
                    }
                }
                Change::Pod {
                    job, pod, exists, ..
                } => {
                    checked += 1;
                    if exists {
                        live.entry(job.clone()).or_default().insert(pod.clone());
                        if !reserved.get(&job).copied().unwrap_or(false) {
                            found.push(format!(
                                "rv {rv}: pod {pod} existed while {job} was not admitted"
                            ));
                        }
                    } else if let Some(p) = live.get_mut(&job) {
                        p.remove(&pod);
                    }
                }
            }
        }
        (found, checked)
    }
}

impl AdmissionWatch {
    /// The pods of `job` the watch ever saw bound to a node.
    fn ever_bound(&self, job: &str) -> BTreeSet<String> {
        self.changes
            .lock()
            .unwrap()
            .iter()
            .filter_map(|(_, change)| match change {
                Change::Pod {
                    job: j,
                    pod,
                    bound: true,
                    ..
                } if j == job => Some(pod.clone()),
                _ => None,
            })
            .collect()
    }

    /// Whether `job`'s Workload ever had quota reserved.
    fn ever_admitted(&self, job: &str) -> bool {
        self.changes.lock().unwrap().iter().any(
            |(_, change)| matches!(change, Change::Workload { job: j, reserved: true } if j == job),
        )
    }
}

impl Drop for AdmissionWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn assert_no_pod_ran_unadmitted(watch: &AdmissionWatch) {
    let (violations, checked) = watch.violations();
    assert!(checked > 0, "the watch saw no pod");
    assert!(violations.is_empty(), "{violations:#?}");
}

/// One Workload per job, each owned by its job; no pod without its job.
async fn assert_one_workload_per_job_and_no_orphans(client: &Client, ns: &str, jobs: &[&str]) {
    let all = workloads(client, ns).await;
    let mut owners: Vec<String> = all
        .iter()
        .map(|w| {
            let owners = w.owner_references();
            assert_eq!(owners.len(), 1, "{}", w.name_any());
            owners[0].name.clone()
        })
        .collect();
    owners.sort();
    let mut expected: Vec<String> = jobs.iter().map(|j| j.to_string()).collect();
    expected.sort();
    assert_eq!(owners, expected, "one Workload per job");
    let pods = Api::<Pod>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await
        .unwrap();
    for pod in pods {
        let job = &pod.labels()["ringmaster.dev/job-name"];
        assert!(
            jobs.contains(&job.as_str()),
            "pod {} of no job",
            pod.name_any()
        );
    }
}

async fn job_has_no_pod(client: &Client, ns: &str, job: &str) -> bool {
    pods(client, ns, job).await.is_empty()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_for_two_jobs_admits_two_gangs_whole_and_the_third_runs_when_one_ends() {
    let (client, ns) = with_kueue("kq-quota").await;
    // Two jobs of 2 workers × 1 GPU.
    let cq = team_queue(&client, &ns, "kq-quota", &[("kq-quota", "kqa", 4)]).await;
    let watch = AdmissionWatch::start(&client, &ns.name).await;
    let mut first = Some(operator(&client, &ns.name).await);

    // In order (Kueue's StrictFIFO goes by creation time, which counts whole seconds).
    for name in ["one", "two", "three"] {
        apply(
            &client,
            &queued_job(name, "team", None, None),
            &ns.name,
            false,
        )
        .await
        .unwrap();
        if name == "one" {
            // Killed in the middle of admission: its first Workload made, nothing admitted
            // yet; a new operator takes over.
            eventually(Duration::from_secs(30), "the first Workload", || async {
                !workloads(&client, &ns.name).await.is_empty()
            })
            .await;
            first.take().unwrap().kill();
        }
        tokio::time::sleep(Duration::from_millis(1100)).await;
    }
    let _operator = operator(&client, &ns.name).await;

    // Exactly two run, whole; which two is Kueue's choice (it orders by its Workloads, and
    // those of the jobs made while no operator ran were made together on its restart).
    let jobs = ["one", "two", "three"];
    let mut running = Vec::new();
    eventually(
        Duration::from_secs(60),
        "two jobs Running and one Queued",
        || async {
            let mut phases = Vec::new();
            for job in jobs {
                phases.push(job_status(&client, &ns.name, job).await["phase"].clone());
            }
            phases.iter().filter(|p| **p == "Running").count() == 2
                && phases.iter().filter(|p| **p == "Queued").count() == 1
        },
    )
    .await;
    let mut queued = "";
    for job in jobs {
        let status = job_status(&client, &ns.name, job).await;
        if phase_is(&status, TrainingJobPhase::Running) {
            assert_eq!(
                pods(&client, &ns.name, job).await.len(),
                3,
                "{job}: 2 workers and the launcher"
            );
            running.push(job);
        } else {
            queued = job;
        }
    }
    // The third has no pod and says it is queued, with what Kueue says (a new message alone
    // is progress, written within 30 s).
    eventually(
        Duration::from_secs(45),
        "the queued job saying what Kueue says",
        || async {
            let status = job_status(&client, &ns.name, queued).await;
            let admitted = condition(&status, "Admitted");
            let message = admitted["message"].as_str().unwrap_or_default();
            admitted["status"] == "False"
                && admitted["reason"] == "Queued"
                && message.contains("LocalQueue team")
                && message.contains("insufficient unused quota")
        },
    )
    .await;
    assert!(job_has_no_pod(&client, &ns.name, queued).await);

    // One ends: its Workload is Finished, its quota goes to the third.
    common::end_launcher(&client, &ns.name, running[0]).await;
    wait_phase(
        &client,
        &ns.name,
        running[0],
        TrainingJobPhase::Succeeded,
        60,
    )
    .await;
    eventually(
        Duration::from_secs(30),
        "the ended job's Workload Finished",
        || async {
            workload_of(&client, &ns.name, running[0])
                .await
                .is_some_and(|w| w.is("Finished"))
        },
    )
    .await;
    let status = wait_phase(&client, &ns.name, queued, TrainingJobPhase::Running, 90).await;
    assert_eq!(condition(&status, "Admitted")["status"], "True");
    common::end_launcher(&client, &ns.name, queued).await;
    wait_phase(&client, &ns.name, queued, TrainingJobPhase::Succeeded, 60).await;
    assert!(phase_is(
        &job_status(&client, &ns.name, running[1]).await,
        TrainingJobPhase::Running
    ));

    assert_one_workload_per_job_and_no_orphans(&client, &ns.name, &["one", "two", "three"]).await;
    assert_no_pod_ran_unadmitted(&watch);
    remove_cluster_queue(&client, &cq).await;
}

/// scheduler-plugins' Coscheduling scheduler, as its chart names it (e2e/gang-scheduler.sh).
const COSCHEDULING: &str = "scheduler-plugins-scheduler";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kueue_admits_against_quota_and_the_gang_scheduler_places_admitted_gangs_whole() {
    let (client, ns) = with_kueue("kq-gang").await;
    common::script_up("gang-scheduler.sh").await;
    // Three nodes of 8 GPUs: a job of 2 × 8 GPUs fills two and leaves one. The quota has room
    // for both jobs, so Kueue admits the second while the first runs: its gang does not fit
    // the nodes, and only the gang scheduler keeps it off the one that is free.
    nodes::add(&client, &tainted_pool("kqg"), 3).await.unwrap();
    let cq = team_queue(&client, &ns, "kq-gang", &[("kq-gang", "kqg", 32)]).await;
    let watch = AdmissionWatch::start(&client, &ns.name).await;
    // The chart's rights with both settings on.
    common::apply_chart_rbac(
        &client,
        OPERATOR_NAMESPACE,
        "kqg",
        &format!("kueue.enabled=true,gangScheduler={COSCHEDULING}"),
        "scheduling.x-k8s.io",
    )
    .await;
    let rights = common::impersonating(OPERATOR_NAMESPACE, "kqg-ringmaster").await;
    let _operator = Operator::start_with(
        &rights,
        &ns.name,
        OperatorConfig {
            restart_backoff: Duration::from_millis(500),
            kueue: true,
            gang_scheduler: Some(GangScheduler::new(COSCHEDULING, None)),
            ..OperatorConfig::default()
        },
    )
    .await;
    let job = |name: &str| {
        let mut job = queued_job(name, "team", None, None);
        job["spec"]["gpusPerWorker"] = json!(8);
        job
    };

    // The first: admitted, its gang in a PodGroup, placed by the gang scheduler on the nodes
    // of the flavor Kueue admitted it to.
    apply(&client, &job("first"), &ns.name, false)
        .await
        .unwrap();
    wait_phase(&client, &ns.name, "first", TrainingJobPhase::Running, 90).await;
    let groups: Api<PodGroup> = Api::namespaced(client.clone(), &ns.name);
    let listed = groups.list(&Default::default()).await.unwrap().items;
    assert_eq!(listed.len(), 1, "one PodGroup, of the admitted job");
    assert_eq!(listed[0].owner_references()[0].name, "first");
    assert_eq!(listed[0].spec.min_member, 2);
    for pod in pods(&client, &ns.name, "first").await {
        let name = pod.name_any();
        assert_eq!(
            pod.labels()[POD_GROUP_LABEL],
            listed[0].name_any(),
            "{name}"
        );
        let worker = pod.labels()["ringmaster.dev/role"] == "worker";
        let spec = pod.spec.unwrap();
        assert_eq!(spec.scheduler_name.as_deref(), Some(COSCHEDULING), "{name}");
        assert!(spec.node_name.is_some(), "{name} bound");
        // The workers hold the GPUs Kueue admitted to the flavor (the launcher asks for none).
        if worker {
            assert_eq!(
                spec.node_selector.unwrap()["kubernetes.azure.com/agentpool"],
                "kqg",
                "{name}: the flavor's placement"
            );
            let node = spec.node_name.unwrap_or_default();
            assert!(node.starts_with("aks-kqg-"), "{name} on {node:?}");
        }
    }

    // The second: admitted against the quota, but the gang scheduler binds none of its
    // workers while only one node is free (Kueue may evict and requeue it meanwhile: its
    // pods are not ready within waitForPodsReady).
    apply(&client, &job("second"), &ns.name, false)
        .await
        .unwrap();
    // Within Kueue's requeue backoff (60 s) if an eviction came first.
    eventually(
        Duration::from_secs(120),
        "the second job admitted and its workers made",
        || async {
            watch.ever_admitted("second")
                && pods(&client, &ns.name, "second")
                    .await
                    .iter()
                    .filter(|p| p.labels()["ringmaster.dev/role"] == "worker")
                    .count()
                    == 2
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(15)).await;
    assert_eq!(
        watch.ever_bound("second"),
        BTreeSet::new(),
        "no worker of an admitted gang that does not fit is bound"
    );
    assert!(phase_is(
        &job_status(&client, &ns.name, "first").await,
        TrainingJobPhase::Running
    ));

    // The first ends: its Workload Finished, its nodes free; the second runs, whole.
    common::end_launcher(&client, &ns.name, "first").await;
    wait_phase(&client, &ns.name, "first", TrainingJobPhase::Succeeded, 60).await;
    // Evicted after waitForPodsReady (20 s), it is readmitted after Kueue's requeue backoff
    // (60 s, doubling): up to two rounds of it.
    let status = wait_phase(&client, &ns.name, "second", TrainingJobPhase::Running, 330).await;
    assert_eq!(condition(&status, "Admitted")["status"], "True");
    let bound = watch.ever_bound("second");
    assert_eq!(
        bound,
        BTreeSet::from([
            "second-launcher".to_string(),
            "second-worker-0".to_string(),
            "second-worker-1".to_string()
        ])
    );
    assert!(
        workload_of(&client, &ns.name, "first")
            .await
            .is_some_and(|w| w.is("Finished"))
    );
    assert_one_workload_per_job_and_no_orphans(&client, &ns.name, &["first", "second"]).await;
    assert_no_pod_ran_unadmitted(&watch);
    remove_cluster_queue(&client, &cq).await;
    nodes::remove(&client, "kqg").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_land_on_the_nodes_of_the_flavor_they_were_admitted_to() {
    let (client, ns) = with_kueue("kq-flavors").await;
    // Room for one job in each flavor: the first fills kqa, the second goes to kqb.
    let cq = team_queue(
        &client,
        &ns,
        "kq-flavors",
        &[("kq-a", "kqa", 2), ("kq-b", "kqb", 2)],
    )
    .await;
    let (fa, fb) = (format!("kq-a-{}", tag(&ns)), format!("kq-b-{}", tag(&ns)));
    let watch = AdmissionWatch::start(&client, &ns.name).await;
    let _operator = operator(&client, &ns.name).await;

    // The second is made once the first runs: Kueue admits in Workload order, and a retry of
    // the first's Workload could otherwise put it behind the second's.
    for name in ["first", "second"] {
        apply(
            &client,
            &queued_job(name, "team", None, None),
            &ns.name,
            false,
        )
        .await
        .unwrap();
        if name == "first" {
            wait_phase(&client, &ns.name, name, TrainingJobPhase::Running, 60).await;
        }
    }
    for (job, pool, flavor) in [("first", "kqa", &fa), ("second", "kqb", &fb)] {
        let status = wait_phase(&client, &ns.name, job, TrainingJobPhase::Running, 60).await;
        let message = condition(&status, "Admitted")["message"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(message.contains(flavor.as_str()), "{job}: {message}");
        let workers: Vec<Pod> = pods(&client, &ns.name, job)
            .await
            .into_iter()
            .filter(|p| p.labels()["ringmaster.dev/role"] == "worker")
            .collect();
        assert_eq!(workers.len(), 2);
        for worker in workers {
            let node = worker.spec.as_ref().unwrap().node_name.clone().unwrap();
            assert!(
                node.starts_with(&format!("aks-{pool}-")),
                "{job}: {} on {node}",
                worker.name_any()
            );
            let selector = worker.spec.unwrap().node_selector.unwrap();
            assert_eq!(selector["kubernetes.azure.com/agentpool"], pool);
        }
        // Kueue is told the gang runs (it evicts what stays unready past its timeout).
        eventually(
            Duration::from_secs(30),
            "PodsReady on the Workload",
            || async {
                workload_of(&client, &ns.name, job)
                    .await
                    .is_some_and(|w| w.is("PodsReady"))
            },
        )
        .await;
    }
    assert_no_pod_ran_unadmitted(&watch);
    remove_cluster_queue(&client, &cq).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_higher_priority_job_preempts_and_the_victim_resumes_and_succeeds() {
    let (client, ns) = with_kueue("kq-preempt").await;
    let t = tag(&ns);
    let (low, high) = (format!("kq-low-{t}"), format!("kq-high-{t}"));
    for (class, value) in [(&low, 100), (&high, 1000)] {
        kueue_apply(
            &client,
            json!({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "WorkloadPriorityClass",
                   "metadata": {"name": class}, "value": value}),
            &ns.name,
        )
        .await;
    }
    // Room for one job.
    let cq = team_queue(&client, &ns, "kq-preempt", &[("kq-preempt", "kqa", 2)]).await;
    let watch = AdmissionWatch::start(&client, &ns.name).await;
    let first = operator(&client, &ns.name).await;

    apply(
        &client,
        &queued_job("victim", "team", None, Some(&low)),
        &ns.name,
        false,
    )
    .await
    .unwrap();
    wait_phase(&client, &ns.name, "victim", TrainingJobPhase::Running, 60).await;
    apply(
        &client,
        &queued_job("urgent", "team", Some("3s"), Some(&high)),
        &ns.name,
        false,
    )
    .await
    .unwrap();

    // Killed in the middle of the preemption: the victim's Workload evicted, its pods (and
    // its quota) not yet given up; a new operator takes over.
    eventually(
        Duration::from_secs(30),
        "the victim's Workload Evicted",
        || async {
            workload_of(&client, &ns.name, "victim")
                .await
                .is_some_and(|w| w.is("Evicted"))
        },
    )
    .await;
    first.kill();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let _operator = operator(&client, &ns.name).await;

    // The victim's pods go and it says why; the urgent job runs and succeeds.
    eventually(
        Duration::from_secs(60),
        "the victim Suspended by preemption, without pods",
        || async {
            let status = job_status(&client, &ns.name, "victim").await;
            phase_is(&status, TrainingJobPhase::Suspended)
                && condition(&status, "Suspended")["reason"] == "Preempted"
                && job_has_no_pod(&client, &ns.name, "victim").await
        },
    )
    .await;
    let status = job_status(&client, &ns.name, "victim").await;
    assert_eq!(
        status["restarts"], 0,
        "a preemption is not a failure: {status}"
    );
    wait_phase(&client, &ns.name, "urgent", TrainingJobPhase::Succeeded, 90).await;
    // Readmitted, the victim starts afresh and succeeds.
    wait_phase(&client, &ns.name, "victim", TrainingJobPhase::Running, 90).await;
    common::end_launcher(&client, &ns.name, "victim").await;
    let status = wait_phase(&client, &ns.name, "victim", TrainingJobPhase::Succeeded, 60).await;
    assert_eq!(condition(&status, "Suspended")["status"], "False");
    eventually(
        Duration::from_secs(30),
        "the victim's Workload Finished",
        || async {
            workload_of(&client, &ns.name, "victim")
                .await
                .is_some_and(|w| w.is("Finished"))
        },
    )
    .await;

    assert_one_workload_per_job_and_no_orphans(&client, &ns.name, &["victim", "urgent"]).await;
    assert_no_pod_ran_unadmitted(&watch);
    // The victim ran twice: its pods were made, deleted and made again.
    let victim_pod_changes = watch
        .changes
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, c)| matches!(c, Change::Pod { job, exists: false, .. } if job == "victim"))
        .count();
    assert!(
        victim_pod_changes >= 3,
        "the victim's pods were deleted once at least"
    );
    remove_cluster_queue(&client, &cq).await;
}

/// The Kueue samples (config/samples/kueue) pass Kueue's own webhooks and Ringmaster's schema.
#[tokio::test]
async fn the_kueue_samples_are_accepted() {
    let (client, ns) = with_kueue("kq-samples").await;
    let mut applied = 0;
    for path in common::yaml_files("config/samples/kueue") {
        for object in common::documents(&path) {
            let result = if object["apiVersion"] == "kueue.x-k8s.io/v1beta2" {
                kueue_apply_as(&client, &object, &ns.name, true).await
            } else {
                apply(&client, &object, &ns.name, true).await.map(|_| ())
            };
            result
                .unwrap_or_else(|e| panic!("{} ({}) refused: {e}", path.display(), object["kind"]));
            applied += 1;
        }
    }
    assert_eq!(applied, 6);
}

/// `runPolicy.suspend` on a queued job takes its Workload out of admission (its quota goes
/// to the next job) and back in when it is cleared; Kueue is never fought.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_policy_suspend_gives_the_quota_back_and_queues_again() {
    let (client, ns) = with_kueue("kq-suspend").await;
    let cq = team_queue(&client, &ns, "kq-suspend", &[("kq-suspend", "kqb", 2)]).await;
    let watch = AdmissionWatch::start(&client, &ns.name).await;
    let _operator = operator(&client, &ns.name).await;

    apply(
        &client,
        &queued_job("first", "team", None, None),
        &ns.name,
        false,
    )
    .await
    .unwrap();
    wait_phase(&client, &ns.name, "first", TrainingJobPhase::Running, 60).await;
    apply(
        &client,
        &queued_job("next", "team", None, None),
        &ns.name,
        false,
    )
    .await
    .unwrap();
    wait_phase(&client, &ns.name, "next", TrainingJobPhase::Queued, 30).await;

    let suspend = |on: bool| {
        let mut job = queued_job("first", "team", None, None);
        job["spec"]["runPolicy"] = json!({"suspend": on});
        job
    };
    apply(&client, &suspend(true), &ns.name, false)
        .await
        .unwrap();
    let status = wait_phase(&client, &ns.name, "first", TrainingJobPhase::Suspended, 30).await;
    assert_eq!(condition(&status, "Suspended")["reason"], "Suspended");
    // Its quota went to the next job.
    wait_phase(&client, &ns.name, "next", TrainingJobPhase::Running, 60).await;
    assert!(job_has_no_pod(&client, &ns.name, "first").await);
    let workload = workload_of(&client, &ns.name, "first").await.unwrap();
    assert_eq!(workload.spec.active, Some(false));

    // Cleared: queued again behind the running job, and run when it ends.
    apply(&client, &suspend(false), &ns.name, false)
        .await
        .unwrap();
    wait_phase(&client, &ns.name, "first", TrainingJobPhase::Queued, 30).await;
    common::end_launcher(&client, &ns.name, "next").await;
    wait_phase(&client, &ns.name, "first", TrainingJobPhase::Running, 60).await;

    assert_one_workload_per_job_and_no_orphans(&client, &ns.name, &["first", "next"]).await;
    assert_no_pod_ran_unadmitted(&watch);
    remove_cluster_queue(&client, &cq).await;
}

/// Without its Kueue integration the operator starts no job labelled for a queue (it would
/// jump the queue) and says why on the job; unlabelled jobs run as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_integration_a_queued_job_is_held_and_says_why() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "kq-off").await;
    let _operator = Operator::start(&client, &ns.name).await;
    apply(
        &client,
        &queued_job("held", "team", None, None),
        &ns.name,
        false,
    )
    .await
    .unwrap();
    let mut free = queued_job("free", "team", None, None);
    free["metadata"]["labels"] = json!({});
    apply(&client, &free, &ns.name, false).await.unwrap();
    wait_phase(&client, &ns.name, "free", TrainingJobPhase::Running, 60).await;
    let status = job_status(&client, &ns.name, "held").await;
    assert!(phase_is(&status, TrainingJobPhase::Pending), "{status}");
    let admitted = condition(&status, "Admitted");
    assert_eq!(admitted["reason"], "KueueIntegrationOff");
    assert!(admitted["message"].as_str().unwrap().contains("--kueue"));
    assert!(job_has_no_pod(&client, &ns.name, "held").await);
}
