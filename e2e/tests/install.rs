//! Installing Ringmaster: the Helm chart (lint, schema, install, upgrade, uninstall), the
//! kustomize bases (the same objects), and the chart's RBAC proven sufficient by running
//! the operator as the chart's ServiceAccount (impersonation) through a TrainingJob and a
//! DataStage, and proven narrow by requests it is refused.

mod common;

#[path = "../../tests/support/operator_rbac.rs"]
mod operator_rbac;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use common::{TestNamespace, apply, client, ensure_crds, eventually, tool};
use k8s_openapi::api::core::v1::{Node, Secret};
use kube::Api;
use kube::api::{DeleteParams, ListParams};
use ringmaster::api::{DataStage, TrainingJob};
use ringmaster::controller::{self, Context, OperatorConfig, Scope};
use ringmaster::metrics::Metrics;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

fn chart() -> PathBuf {
    common::repo_root().join("charts/ringmaster")
}

async fn run(program: PathBuf, args: &[&str]) -> (bool, String) {
    let out = tokio::process::Command::new(&program)
        .args(args)
        .env("KUBECONFIG", ringmaster_e2e::cluster::kubeconfig_path())
        .output()
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", program.display()));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

async fn helm(args: &[&str]) -> (bool, String) {
    run(tool("helm"), args).await
}

/// `helm template` of the chart as `release` for Kubernetes 1.36, with `flags` and one `--set`.
async fn template(chart: &str, release: &str, flags: &[&str], set: &str) -> (bool, String) {
    let mut args = vec!["template", release, chart, "--kube-version", "1.36.0"];
    args.extend_from_slice(flags);
    args.extend(["--set", set]);
    helm(&args).await
}

/// `helm template` of the chart as release `x` with one `--set`.
async fn template_with(chart: &str, set: &str) -> (bool, String) {
    template(chart, "x", &[], set).await
}

/// `(kind, namespace, name)` of every object in a multi-document YAML stream.
fn objects(yaml: &str) -> BTreeSet<(String, String, String)> {
    whole_objects(yaml).into_keys().collect()
}

/// Each object of a YAML stream by kind, namespace and name.
fn whole_objects(yaml: &str) -> std::collections::BTreeMap<(String, String, String), Value> {
    serde_saphyr::from_multiple::<Value>(yaml)
        .unwrap()
        .into_iter()
        .filter(|o| o.is_object())
        .map(|o| {
            let key = (
                o["kind"].as_str().unwrap_or_default().to_string(),
                o["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                o["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            );
            (key, o)
        })
        .collect()
}

#[tokio::test]
async fn the_chart_lints_refuses_bad_values_and_matches_the_kustomize_bases() {
    let chart = chart();
    let chart = chart.to_str().unwrap();
    let (ok, out) = helm(&["lint", chart, "--strict"]).await;
    assert!(
        ok && !out.contains("[WARNING]") && !out.contains("[ERROR]"),
        "{out}"
    );

    for (set, words) in [
        ("replicaCount=0", "replicaCount"),
        ("logFormat=xml", "logFormat"),
        ("aks.subscription=not-a-guid", "subscription"),
        ("nonsense=1", "nonsense"),
        ("podDisruptionBudget.maxUnavailable=0", "maxUnavailable"),
        ("podDisruptionBudget.maxUnavailable=0%", "maxUnavailable"),
    ] {
        let (ok, out) = template_with(chart, set).await;
        assert!(!ok, "{set} was accepted");
        assert!(
            out.contains(words) && out.contains("schema"),
            "{set}: {out}"
        );
    }

    // The budget and the spread come with two replicas (the default), and each goes when
    // turned off.
    for (set, budget, spread) in [
        ("replicaCount=2", true, true),
        ("podDisruptionBudget.enabled=false", false, true),
        ("spreadReplicas=false", true, false),
    ] {
        let (ok, out) = template_with(chart, set).await;
        assert!(ok, "{set}: {out}");
        assert_eq!(
            (
                out.contains("kind: PodDisruptionBudget"),
                out.contains("topologySpreadConstraints:")
            ),
            (budget, spread),
            "{set}"
        );
    }

    // config/ is what `make manifests` writes today.
    let (ok, out) = helm(&[
        "template",
        "ringmaster",
        chart,
        "--namespace",
        "ringmaster-system",
        "--kube-version",
        "1.36.0",
        "--set",
        "kustomize=true",
    ])
    .await;
    assert!(ok, "{out}");
    let root = common::repo_root();
    let mut kustomize_objects = String::new();
    for file in ["config/rbac/rbac.yaml", "config/manager/manager.yaml"] {
        kustomize_objects.push_str(&std::fs::read_to_string(root.join(file)).unwrap());
        kustomize_objects.push_str("\n---\n");
    }
    // Whole objects, not only their names: a changed flag or rule must show.
    assert_eq!(
        whole_objects(&kustomize_objects),
        whole_objects(&out),
        "config/ is stale: run `make manifests`"
    );

    // `kubectl kustomize config/default` = the chart's objects + its CRDs + the namespace.
    let (ok, built) = run(
        tool("kubectl"),
        &["kustomize", root.join("config/default").to_str().unwrap()],
    )
    .await;
    assert!(ok, "{built}");
    let (ok, helm_default) = helm(&[
        "template",
        "ringmaster",
        chart,
        "--namespace",
        "ringmaster-system",
        "--kube-version",
        "1.36.0",
        "--include-crds",
    ])
    .await;
    assert!(ok, "{helm_default}");
    let mut expected = objects(&helm_default);
    expected.insert((
        "Namespace".into(),
        String::new(),
        "ringmaster-system".into(),
    ));
    assert_eq!(objects(&built), expected);
}

/// Each component in config/components and the chart switch it stands for (the aks-pools
/// component's placeholders as values).
const COMPONENTS: &[(&str, &str)] = &[
    ("kueue", "kueue.enabled=true"),
    (
        "gang-scheduling",
        "gangScheduler=scheduler-plugins-scheduler",
    ),
    ("gang-scheduling-volcano", "gangScheduler=volcano"),
    (
        "aks-pools",
        "aks.subscription=00000000-0000-0000-0000-000000000000,\
         aks.resourceGroup=my-resource-group,aks.cluster=my-cluster",
    ),
    ("monitoring", "metrics.serviceMonitor.enabled=true"),
];

/// `kubectl kustomize` of an overlay of config/default with `components`. kustomize takes
/// no absolute paths, so the overlay sits beside a link to config/.
async fn kustomize_with(components: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(
        common::repo_root().join("config"),
        dir.path().join("config"),
    )
    .unwrap();
    let overlay = dir.path().join("overlay");
    std::fs::create_dir(&overlay).unwrap();
    let components = components
        .iter()
        .map(|c| format!("../config/components/{c}"))
        .collect::<Vec<_>>();
    let kustomization = json!({
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": ["../config/default"],
        "components": components,
    });
    std::fs::write(
        overlay.join("kustomization.yaml"),
        kustomization.to_string(),
    )
    .unwrap();
    let (ok, built) = run(tool("kubectl"), &["kustomize", overlay.to_str().unwrap()]).await;
    assert!(ok, "{built}");
    built
}

/// `helm template` of the chart with its CRDs, as `make manifests` renders it, with `sets`.
async fn render_for_kustomize(chart: &str, sets: &str) -> String {
    let flags = [
        "--namespace",
        "ringmaster-system",
        "--include-crds",
        "--set",
        "kustomize=true",
    ];
    let (ok, rendered) = template(chart, "ringmaster", &flags, sets).await;
    assert!(ok, "{sets}: {rendered}");
    rendered
}

/// An overlay of config/default with components makes, object for object and field for
/// field, what the chart makes (as `make manifests` renders it) with their switches: each
/// component alone, and all of them together (each appends to the same lists).
#[tokio::test]
async fn each_kustomize_component_makes_what_its_chart_switch_makes() {
    let chart = chart();
    let chart = chart.to_str().unwrap();
    let everything = (
        COMPONENTS
            .iter()
            .filter(|(c, _)| *c != "gang-scheduling-volcano")
            .map(|(c, _)| *c)
            .collect::<Vec<_>>(),
        COMPONENTS
            .iter()
            .filter(|(c, _)| *c != "gang-scheduling-volcano")
            .map(|(_, set)| *set)
            .collect::<Vec<_>>()
            .join(","),
    );
    let cases = COMPONENTS
        .iter()
        .map(|(c, set)| (vec![*c], set.to_string()))
        .chain([everything]);
    for (components, sets) in cases {
        let mut built = whole_objects(&kustomize_with(&components).await);
        let namespace = (
            "Namespace".into(),
            String::new(),
            "ringmaster-system".into(),
        );
        assert!(built.remove(&namespace).is_some(), "{components:?}");
        let rendered = whole_objects(&render_for_kustomize(chart, &sets).await);
        assert_ne!(
            rendered,
            whole_objects(&render_for_kustomize(chart, "kustomize=true").await),
            "{sets} changes nothing: the comparison would prove nothing"
        );
        // The CRDs are copies of one file (tests/crds.rs) that no component changes, and
        // kustomize re-emits their long descriptions as folded double-quoted strings that
        // serde_saphyr does not read back to the same text: they are compared by name.
        let is_crd = |key: &&(String, String, String)| key.0 == "CustomResourceDefinition";
        let differing = built
            .keys()
            .chain(rendered.keys())
            .filter(|key| {
                let (have, want) = (built.get(*key), rendered.get(*key));
                if is_crd(key) {
                    have.is_none() || want.is_none()
                } else {
                    have != want
                }
            })
            .collect::<BTreeSet<_>>();
        let first = differing
            .first()
            .map(|key| (built.get(*key), rendered.get(*key)));
        assert!(
            differing.is_empty(),
            "{components:?} differs from the chart with {sets} in {differing:?}; \
             the first (kustomize, helm): {first:#?}"
        );
    }
}

/// The ClusterRole and leader-election Role the chart renders, with Kueue and with each gang
/// scheduler's API, grant exactly the calls the operator's code makes
/// (tests/support/operator_rbac.rs lists them, and where they are made); the users'
/// ClusterRoles are aggregated into the built-in ones unless `userRoles.aggregate=false`,
/// and never write status.
#[tokio::test]
async fn the_chart_grants_the_operator_exactly_its_calls_and_users_aggregated_roles() {
    let chart = chart();
    let chart = chart.to_str().unwrap();
    for (sets, kueue, gang) in [
        (&[][..], false, None),
        (&["kueue.enabled=true"][..], true, None),
        (
            &["gangScheduler=scheduler-plugins-scheduler"][..],
            false,
            Some("scheduling.x-k8s.io"),
        ),
        (
            &["gangScheduler=volcano", "kueue.enabled=true"][..],
            true,
            Some("scheduling.volcano.sh"),
        ),
    ] {
        let mut args = vec!["template", "x", chart, "--kube-version", "1.36.0"];
        for set in sets {
            args.extend(["--set", set]);
        }
        let (ok, out) = helm(&args).await;
        assert!(ok, "{out}");
        let objects = whole_objects(&out);
        let rules = |kind: &str, name: &str| {
            let key = (kind.to_string(), String::new(), name.to_string());
            let object = objects
                .iter()
                .find(|((k, _, n), _)| (k, n) == (&key.0, &key.2))
                .map(|(_, o)| o.clone())
                .unwrap_or_else(|| panic!("no {kind} {name} with {sets:?}"));
            operator_rbac::granted(&object["rules"])
        };
        let granted = rules("ClusterRole", "x-ringmaster");
        let expected = operator_rbac::expected(operator_rbac::CLUSTER_CALLS, kueue, gang);
        assert_eq!(
            (
                granted.difference(&expected).collect::<Vec<_>>(),
                expected.difference(&granted).collect::<Vec<_>>()
            ),
            (vec![], vec![]),
            "(granted but not called, called but not granted) with {sets:?}"
        );
        assert_eq!(
            rules("Role", "x-ringmaster-leader-election"),
            operator_rbac::expected(operator_rbac::LEADER_CALLS, false, None)
        );
        for name in ["x-ringmaster-edit", "x-ringmaster-view"] {
            assert!(
                rules("ClusterRole", name)
                    .iter()
                    .all(
                        |(group, resource, _)| group == "ringmaster.dev" && !resource.contains('/')
                    ),
                "{name}"
            );
        }
    }
    // Aggregation is the default, and can be turned off (the roles stay, to bind by hand).
    for (set, aggregated) in [
        ("userRoles.aggregate=true", true),
        ("userRoles.aggregate=false", false),
    ] {
        let (ok, out) = template_with(chart, set).await;
        assert!(ok, "{out}");
        let objects = whole_objects(&out);
        for (name, label) in [
            (
                "x-ringmaster-edit",
                "rbac.authorization.k8s.io/aggregate-to-edit",
            ),
            (
                "x-ringmaster-edit",
                "rbac.authorization.k8s.io/aggregate-to-admin",
            ),
            (
                "x-ringmaster-view",
                "rbac.authorization.k8s.io/aggregate-to-view",
            ),
        ] {
            let role = &objects[&("ClusterRole".to_string(), String::new(), name.to_string())];
            assert_eq!(
                role["metadata"]["labels"][label] == "true",
                aggregated,
                "{name} {label} with {set}"
            );
        }
    }
}

/// A namespace's editors may create TrainingJobs and DataStages and its viewers read them,
/// through the built-in `edit` and `view` ClusterRoles the chart's roles are aggregated into;
/// neither may write their status.
#[tokio::test]
async fn a_namespaces_editors_use_ringmaster_and_its_viewers_read_it_but_neither_writes_status() {
    use k8s_openapi::api::authorization::v1::{
        ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
    };
    use k8s_openapi::api::rbac::v1::RoleBinding;
    let admin = client().await;
    ensure_crds(&admin).await;
    let system = TestNamespace::new(&admin, "rm-roles").await;
    let work = TestNamespace::new(&admin, "rm-team").await;
    let release = format!("rm-{}", &system.name[system.name.len() - 6..]);
    let (ok, out) = helm(&[
        "install",
        &release,
        chart().to_str().unwrap(),
        "--namespace",
        &system.name,
        "--set",
        "replicaCount=1",
        "--set",
        "metrics.serviceMonitor.enabled=false",
    ])
    .await;
    assert!(ok, "{out}");
    // alice edits the team's namespace, bob views it: bound to the built-in roles only.
    let bindings: Api<RoleBinding> = Api::namespaced(admin.clone(), &work.name);
    for (user, role) in [("alice", "edit"), ("bob", "view")] {
        let binding = serde_json::from_value(json!({
            "metadata": {"name": user},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
        }))
        .unwrap();
        bindings
            .create(&Default::default(), &binding)
            .await
            .unwrap();
    }
    let may = |user: &'static str, verb: &'static str, resource: &'static str| {
        let admin = admin.clone();
        let namespace = work.name.clone();
        async move {
            let (resource, subresource) = resource.split_once('/').unwrap_or((resource, ""));
            let review = SubjectAccessReview {
                spec: SubjectAccessReviewSpec {
                    user: Some(user.into()),
                    resource_attributes: Some(ResourceAttributes {
                        group: Some("ringmaster.dev".into()),
                        resource: Some(resource.into()),
                        subresource: (!subresource.is_empty()).then(|| subresource.into()),
                        verb: Some(verb.into()),
                        namespace: Some(namespace),
                        ..ResourceAttributes::default()
                    }),
                    ..SubjectAccessReviewSpec::default()
                },
                ..SubjectAccessReview::default()
            };
            Api::<SubjectAccessReview>::all(admin)
                .create(&Default::default(), &review)
                .await
                .unwrap()
                .status
                .is_some_and(|s| s.allowed)
        }
    };
    // The aggregation controller fills the built-in roles within moments of the install.
    eventually(
        Duration::from_secs(30),
        "edit and view aggregate Ringmaster's roles",
        || async {
            may("alice", "create", "trainingjobs").await && may("bob", "list", "datastages").await
        },
    )
    .await;
    for resource in ["trainingjobs", "datastages"] {
        for verb in [
            "create", "update", "patch", "delete", "get", "list", "watch",
        ] {
            assert!(
                may("alice", verb, resource).await,
                "alice {verb} {resource}"
            );
        }
        for verb in ["get", "list", "watch"] {
            assert!(may("bob", verb, resource).await, "bob {verb} {resource}");
        }
        for verb in ["create", "update", "patch", "delete"] {
            assert!(!may("bob", verb, resource).await, "bob {verb} {resource}");
        }
    }
    for resource in ["trainingjobs/status", "datastages/status"] {
        for verb in ["update", "patch"] {
            for user in ["alice", "bob"] {
                assert!(!may(user, verb, resource).await, "{user} {verb} {resource}");
            }
        }
    }
    let (ok, out) = helm(&["uninstall", &release, "--namespace", &system.name, "--wait"]).await;
    assert!(ok, "{out}");
}

#[tokio::test]
async fn helm_install_gives_the_operator_exactly_enough_rights_and_uninstall_leaves_only_crds() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("ringmaster=warn,kube=warn")
        .with_test_writer()
        .try_init();
    let admin = client().await;
    ensure_crds(&admin).await;
    let system = TestNamespace::new(&admin, "rm-system").await;
    let work = TestNamespace::new(&admin, "rm-work").await;
    let release = format!("rm-{}", &system.name[system.name.len() - 6..]);
    let chart = chart();
    let (ok, out) = helm(&[
        "install",
        &release,
        chart.to_str().unwrap(),
        "--namespace",
        &system.name,
        "--set",
        "replicaCount=1",
        "--set",
        "metrics.serviceMonitor.enabled=false",
        "--set",
        "launcherPriorityClass.create=true",
    ])
    .await;
    assert!(ok, "{out}");
    assert!(out.contains("Next:"), "NOTES tell what to do next: {out}");

    // The operator, as the chart's ServiceAccount, with leader election in its namespace.
    // The chart names its objects `<release>-ringmaster`.
    let full_name = format!("{release}-ringmaster");
    // The launchers' PriorityClass: ahead in the scheduler's queue, never preempting.
    let class = Api::<k8s_openapi::api::scheduling::v1::PriorityClass>::all(admin.clone())
        .get(&format!("{full_name}-launcher"))
        .await
        .expect("the chart's launcher PriorityClass");
    assert_eq!(
        (
            class.value,
            class.preemption_policy.as_deref(),
            class.global_default.unwrap_or_default()
        ),
        (Some(1000), Some("Never"), false)
    );
    // One replica: no PodDisruptionBudget (maxUnavailable 1 would let a drain take the only one
    // anyway, and minAvailable 1 would block drains).
    let budgets = Api::<k8s_openapi::api::policy::v1::PodDisruptionBudget>::namespaced(
        admin.clone(),
        &system.name,
    );
    assert!(budgets.get_opt(&full_name).await.unwrap().is_none());
    let operator = common::impersonating(&system.name, &full_name).await;
    let ctx = Arc::new(Context::new(
        operator.clone(),
        Metrics::new(),
        Some("rbac".into()),
        OperatorConfig {
            restart_backoff: Duration::from_millis(500),
            // As the chart's Deployment passes it.
            launcher_priority_class: Some(format!("{full_name}-launcher")),
            data_stage_destinations: common::e2e_destinations(),
            ..OperatorConfig::default()
        },
    ));
    let election = ringmaster::leader::Election {
        namespace: system.name.clone(),
        lease: format!("{full_name}-leader"),
        identity: "rbac-test".into(),
        duration: Duration::from_secs(15),
    };
    let scope = Scope { namespace: None };
    let stop = CancellationToken::new();
    let task = tokio::spawn(ringmaster::leader::run(
        operator.clone(),
        election,
        stop.clone(),
        move |s| controller::run(ctx, scope, Arc::new(AtomicBool::new(false)), s),
    ));

    tokio::time::sleep(Duration::from_secs(2)).await;
    if task.is_finished() {
        panic!("the operator stopped at once: {:?}", task.await);
    }
    // A TrainingJob end to end (KWOK ends its launcher) and a DataStage up to its copy Job.
    let job = json!({
        "apiVersion": "ringmaster.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "rbac"},
        "spec": {"workers": 2, "image": "ringmaster-trainer:e2e", "trainer": {"model": "resnet18", "steps": 5},
                 "launcher": {"annotations": {"kwok.ringmaster.dev/exit-code": "0", "kwok.ringmaster.dev/exit-after": "1s",
                                              "kwok.ringmaster.dev/termination-message": common::trainer_summary(100.0, 5, 6.5)}}},
    });
    apply(&admin, &job, &work.name, false).await.unwrap();
    let secret: Secret = serde_json::from_value(
        json!({"metadata": {"name": "sas"}, "stringData": {"token": "sv=x&sig=y"}}),
    )
    .unwrap();
    Api::<Secret>::namespaced(admin.clone(), &work.name)
        .create(&Default::default(), &secret)
        .await
        .unwrap();
    let stage = json!({
        "apiVersion": "ringmaster.dev/v1alpha1", "kind": "DataStage", "metadata": {"name": "rbac"},
        "spec": {"source": {"azureBlob": {"account": "acct", "container": "data", "auth": {"sasTokenSecretRef": {"name": "sas", "key": "token"}}}},
                 "destination": {"nfs": {"server": "nfs.example.internal", "path": format!("/export/{}", work.name)}}, "capacity": "1Gi"},
    });
    apply(&admin, &stage, &work.name, false).await.unwrap();
    let jobs: Api<TrainingJob> = Api::namespaced(admin.clone(), &work.name);
    let stages: Api<DataStage> = Api::namespaced(admin.clone(), &work.name);
    eventually(
        Duration::from_secs(90),
        "the job Succeeded and the DataStage Copying",
        || async {
            let phase = |v: Option<Value>| v.map(|s| s["phase"].clone()).unwrap_or(Value::Null);
            let j = phase(
                jobs.get("rbac")
                    .await
                    .unwrap()
                    .status
                    .map(|s| serde_json::to_value(s).unwrap()),
            );
            let d = phase(
                stages
                    .get("rbac")
                    .await
                    .unwrap()
                    .status
                    .map(|s| serde_json::to_value(s).unwrap()),
            );
            j == "Succeeded" && d == "Copying"
        },
    )
    .await;
    assert!(!task.is_finished(), "the operator stopped: {:?}", task);
    // A copy Job made again (deleted by hand here) finds the stager's ServiceAccount, Role and
    // RoleBinding there and uses them as they are: the chart grants no patch on them.
    let copy_jobs: Api<k8s_openapi::api::batch::v1::Job> =
        Api::namespaced(admin.clone(), &work.name);
    let first = copy_jobs.get("rbac-stage").await.unwrap().metadata.uid;
    copy_jobs
        .delete("rbac-stage", &DeleteParams::background())
        .await
        .unwrap();
    eventually(
        Duration::from_secs(90),
        "the copy Job made again",
        || async {
            copy_jobs
                .get_opt("rbac-stage")
                .await
                .unwrap()
                .is_some_and(|job| job.metadata.uid != first)
        },
    )
    .await;
    let stage_status = serde_json::to_value(stages.get("rbac").await.unwrap().status).unwrap();
    assert_ne!(
        common::condition(&stage_status, "Stalled")["reason"],
        "ChildRejected",
        "{stage_status:#}"
    );
    // Its launcher was admitted with the chart's class, as the chart's ServiceAccount.
    let launcher = Api::<k8s_openapi::api::core::v1::Pod>::namespaced(admin.clone(), &work.name)
        .get("rbac-launcher")
        .await
        .unwrap()
        .spec
        .unwrap();
    assert_eq!(
        (launcher.priority_class_name, launcher.priority),
        (Some(format!("{full_name}-launcher")), Some(1000))
    );

    // What the chart does not grant is refused.
    let denied = |e: kube::Error| matches!(e, kube::Error::Api(ref s) if s.code == 403);
    assert!(denied(
        Api::<Secret>::namespaced(operator.clone(), &work.name)
            .list(&ListParams::default())
            .await
            .unwrap_err()
    ));
    // It may get a Secret by name (a job's SSH Secret's metadata, on a 409), never list or
    // watch them.
    assert!(denied(
        Api::<Secret>::all(operator.clone())
            .list(&ListParams::default())
            .await
            .unwrap_err()
    ));
    assert!(denied(
        Api::<Node>::all(operator.clone())
            .delete("anything", &DeleteParams::default())
            .await
            .unwrap_err()
    ));
    let role: k8s_openapi::api::rbac::v1::ClusterRole =
        serde_json::from_value(json!({"metadata": {"name": "ringmaster-escalation"}, "rules": []}))
            .unwrap();
    assert!(denied(
        Api::<k8s_openapi::api::rbac::v1::ClusterRole>::all(operator.clone())
            .create(&Default::default(), &role)
            .await
            .unwrap_err()
    ));
    stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(10), task).await;

    let (ok, out) = helm(&[
        "upgrade",
        &release,
        chart.to_str().unwrap(),
        "--namespace",
        &system.name,
        "--set",
        "replicaCount=2",
    ])
    .await;
    assert!(ok, "{out}");
    // Two replicas: a PodDisruptionBudget whose selector the disruption controller (the real
    // controller manager's) finds the Deployment's two pods with, and a Deployment that asks
    // for its pods on different nodes.
    eventually(
        Duration::from_secs(60),
        "the PodDisruptionBudget expecting the Deployment's 2 pods",
        || async {
            budgets
                .get_opt(&full_name)
                .await
                .unwrap()
                .and_then(|b| b.status)
                .is_some_and(|s| s.expected_pods == Some(2))
        },
    )
    .await;
    let deployment =
        Api::<k8s_openapi::api::apps::v1::Deployment>::namespaced(admin.clone(), &system.name)
            .get(&full_name)
            .await
            .unwrap();
    let spread: Vec<String> = deployment
        .spec
        .and_then(|s| s.template.spec)
        .and_then(|s| s.topology_spread_constraints)
        .unwrap_or_default()
        .into_iter()
        .map(|c| format!("{} {}", c.topology_key, c.when_unsatisfiable))
        .collect();
    assert_eq!(spread, ["kubernetes.io/hostname ScheduleAnyway"]);
    let (ok, out) = helm(&["uninstall", &release, "--namespace", &system.name, "--wait"]).await;
    assert!(ok, "{out}");
    // Nothing of the release is left but the CRDs (and the leader Lease, data of the cluster).
    let selector = format!("app.kubernetes.io/instance={release}");
    let (ok, out) = run(tool("kubectl"), &[
        "get", "deployments,serviceaccounts,services,roles,rolebindings,clusterroles,clusterrolebindings,priorityclasses,poddisruptionbudgets",
        "-A", "-l", &selector, "-o", "name",
    ])
    .await;
    assert!(ok && out.trim().is_empty(), "left behind: {out}");
    let (ok, out) = run(
        tool("kubectl"),
        &[
            "get",
            "crd",
            "trainingjobs.ringmaster.dev",
            "datastages.ringmaster.dev",
            "-o",
            "name",
        ],
    )
    .await;
    assert!(ok && out.lines().count() == 2, "{out}");
}
