#![allow(dead_code)] // each test crate uses a part of it
//! Every Kubernetes API call the operator makes, as `(API group, resource, verb)`, with the
//! code that makes it: the chart's ClusterRole (and the leader-election Role) must grant
//! exactly these. `tests/rbac.rs` checks the chart's defaults as `make manifests` rendered
//! them into `config/rbac`, `e2e/tests/install.rs` the chart rendered with Kueue and each
//! gang scheduler. [`kinds_in_code`] reads `src/` for the kinds it makes API handles for, so
//! a new kind the code calls cannot go unnoticed here.

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::Value;

/// When the operator makes a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum When {
    /// Always.
    Always,
    /// With `--kueue` (Helm `kueue.enabled`).
    Kueue,
    /// With `--gang-scheduler` whose PodGroups are of this API group (scheduler-plugins'
    /// `scheduling.x-k8s.io`, Volcano's `scheduling.volcano.sh`).
    Gang(&'static str),
}

/// One resource's calls.
pub struct Calls {
    pub group: &'static str,
    pub resource: &'static str,
    pub verbs: &'static [&'static str],
    pub when: When,
    /// Where the code makes them, and why.
    pub why: &'static str,
}

const fn calls(
    group: &'static str,
    resource: &'static str,
    verbs: &'static [&'static str],
    when: When,
    why: &'static str,
) -> Calls {
    Calls {
        group,
        resource,
        verbs,
        when,
        why,
    }
}

/// The operator's calls, through its ClusterRole.
pub const CLUSTER_CALLS: &[Calls] = &[
    calls(
        "ringmaster.dev",
        "trainingjobs",
        &["list", "watch"],
        When::Always,
        "controller::run: the TrainingJob controller",
    ),
    calls(
        "ringmaster.dev",
        "trainingjobs",
        &["get"],
        When::Always,
        "training_job::pool::finalize_unreadable: a deleted job that no longer parses, read as stored",
    ),
    calls(
        "ringmaster.dev",
        "trainingjobs",
        &["patch"],
        When::Always,
        "training_job::pool: the node-pool finalizer (controller::set_finalizer)",
    ),
    calls(
        "ringmaster.dev",
        "trainingjobs",
        &["delete"],
        When::Always,
        "training_job: a finished job's ttlSecondsAfterFinished",
    ),
    calls(
        "ringmaster.dev",
        "trainingjobs/status",
        &["patch"],
        When::Always,
        "Context::write_status",
    ),
    calls(
        "ringmaster.dev",
        "trainingjobs/finalizers",
        &["update"],
        When::Always,
        "every child's ownerReference with blockOwnerDeletion (OwnerReferencesPermissionEnforcement)",
    ),
    calls(
        "ringmaster.dev",
        "datastages",
        &["list", "watch"],
        When::Always,
        "controller::run: the DataStage controller and the jobs' DataStage cache",
    ),
    calls(
        "ringmaster.dev",
        "datastages",
        &["patch"],
        When::Always,
        "data_stage::apply: the volume finalizer",
    ),
    calls(
        "ringmaster.dev",
        "datastages/status",
        &["patch"],
        When::Always,
        "Context::write_status",
    ),
    calls(
        "ringmaster.dev",
        "datastages/status",
        &["get"],
        When::Always,
        "never called: the stager's Role grants it (data_stage::build::role), and RBAC lets the operator grant only what it holds",
    ),
    calls(
        "ringmaster.dev",
        "datastages/finalizers",
        &["update"],
        When::Always,
        "every child's ownerReference with blockOwnerDeletion",
    ),
    calls(
        "",
        "pods",
        &["list", "watch"],
        When::Always,
        "controller::run: the pod cache",
    ),
    calls(
        "",
        "pods",
        &["create", "get", "delete"],
        When::Always,
        "training_job::apply: workers and launcher made, a name held read, gangs deleted",
    ),
    calls(
        "",
        "secrets",
        &["create", "get"],
        When::Always,
        "training_job::apply: the job's SSH key made; on a 409, its metadata read (its controller)",
    ),
    calls(
        "",
        "services",
        &["create", "patch"],
        When::Always,
        "training_job::apply: the workers' Service, applied server-side",
    ),
    calls(
        "discovery.k8s.io",
        "endpointslices",
        &["list", "watch"],
        When::Always,
        "controller::run: the cache of the slices it writes (label endpointslice.kubernetes.io/managed-by=ringmaster.dev)",
    ),
    calls(
        "discovery.k8s.io",
        "endpointslices",
        &["create", "patch"],
        When::Always,
        "training_job::apply: the workers' DNS records (the Service's EndpointSlice), applied server-side",
    ),
    calls(
        "networking.k8s.io",
        "networkpolicies",
        &["create", "patch"],
        When::Always,
        "training_job::apply: the job's NetworkPolicy (--job-network-policies), applied server-side",
    ),
    calls(
        "",
        "nodes",
        &["list"],
        When::Always,
        "training_job::pool: a job's AKS pool's nodes",
    ),
    calls(
        "",
        "persistentvolumeclaims",
        &["list", "watch"],
        When::Always,
        "controller::run: the DataStage controller owns its claim",
    ),
    calls(
        "",
        "persistentvolumeclaims",
        &["get", "create", "patch"],
        When::Always,
        "data_stage::apply::storage: read, created, applied server-side",
    ),
    calls(
        "",
        "persistentvolumes",
        &["create", "patch"],
        When::Always,
        "data_stage::apply::storage: applied server-side",
    ),
    calls(
        "",
        "persistentvolumes",
        &["delete"],
        When::Always,
        "data_stage::apply::finalize",
    ),
    calls(
        "batch",
        "jobs",
        &["list", "watch"],
        When::Always,
        "controller::run: the DataStage controller owns its copy Job",
    ),
    calls(
        "batch",
        "jobs",
        &["get", "create"],
        When::Always,
        "data_stage::apply::copy_state",
    ),
    calls(
        "batch",
        "jobs",
        &["patch"],
        When::Always,
        "data_stage::apply::stop: a copy Job whose pod did not start in time is suspended",
    ),
    calls(
        "",
        "events",
        &["list"],
        When::Always,
        "data_stage::apply::mount_failures: why a copy Job's pod cannot start",
    ),
    calls(
        "",
        "serviceaccounts",
        &["get", "create"],
        When::Always,
        "data_stage::apply::stager_rbac: read, created, never changed",
    ),
    calls(
        "rbac.authorization.k8s.io",
        "roles",
        &["get", "create"],
        When::Always,
        "data_stage::apply::stager_rbac",
    ),
    calls(
        "rbac.authorization.k8s.io",
        "rolebindings",
        &["get", "create"],
        When::Always,
        "data_stage::apply::stager_rbac",
    ),
    calls(
        "events.k8s.io",
        "events",
        &["create", "patch"],
        When::Always,
        "kube's Recorder: Events and their series",
    ),
    calls(
        "kueue.x-k8s.io",
        "workloads",
        &["list", "watch", "create", "patch", "delete"],
        When::Kueue,
        "training_job::admission and the Workload cache",
    ),
    calls(
        "kueue.x-k8s.io",
        "workloads/status",
        &["patch"],
        When::Kueue,
        "training_job::admission: PodsReady, finished, quota given back",
    ),
    calls(
        "kueue.x-k8s.io",
        "resourceflavors",
        &["list", "watch"],
        When::Kueue,
        "controller::run: the flavor cache",
    ),
    calls(
        "kueue.x-k8s.io",
        "workloadpriorityclasses",
        &["get"],
        When::Kueue,
        "training_job::admission: the job's priority",
    ),
    calls(
        "scheduling.k8s.io",
        "priorityclasses",
        &["get"],
        When::Kueue,
        "training_job::admission: the job's priority",
    ),
    calls(
        "authentication.k8s.io",
        "tokenreviews",
        &["create"],
        When::Always,
        "report::auth: a launcher's progress token, checked once per token",
    ),
    calls(
        "scheduling.x-k8s.io",
        "podgroups",
        &["create", "patch"],
        When::Gang("scheduling.x-k8s.io"),
        "training_job::apply: the gang's PodGroup",
    ),
    calls(
        "scheduling.volcano.sh",
        "podgroups",
        &["create", "patch"],
        When::Gang("scheduling.volcano.sh"),
        "training_job::apply: the gang's Volcano PodGroup",
    ),
];

/// The operator's calls in its own namespace, through the leader-election Role.
pub const LEADER_CALLS: &[Calls] = &[
    calls(
        "coordination.k8s.io",
        "leases",
        &["get", "create", "patch"],
        When::Always,
        "leader::run (kube-lease-manager): the leader Lease",
    ),
    calls(
        "",
        "secrets",
        &["update"],
        When::Always,
        "report::tls::serving_cert: the progress endpoint's certificate, for a new host",
    ),
];

/// `(group, resource, verb)` of every call in `table` made with `kueue` and the gang
/// scheduler's API group `gang`.
pub fn expected(
    table: &[Calls],
    kueue: bool,
    gang: Option<&str>,
) -> BTreeSet<(String, String, String)> {
    table
        .iter()
        .filter(|c| match c.when {
            When::Always => true,
            When::Kueue => kueue,
            When::Gang(group) => gang == Some(group),
        })
        .flat_map(|c| {
            c.verbs
                .iter()
                .map(|v| (c.group.to_string(), c.resource.to_string(), v.to_string()))
        })
        .collect()
}

/// `(group, resource, verb)` of every right `rules` (a Role's or ClusterRole's) grant.
/// Wildcards, resource names and non-resource URLs are refused: the operator's rights are
/// listed one by one.
pub fn granted(rules: &Value) -> BTreeSet<(String, String, String)> {
    let mut all = BTreeSet::new();
    for rule in rules.as_array().expect("rules") {
        assert!(
            rule.get("resourceNames").is_none() && rule.get("nonResourceURLs").is_none(),
            "{rule}"
        );
        let list = |key: &str| -> Vec<String> {
            rule[key]
                .as_array()
                .unwrap_or_else(|| panic!("{key} in {rule}"))
                .iter()
                .map(|v| v.as_str().unwrap().to_string())
                .collect()
        };
        for group in list("apiGroups") {
            for resource in list("resources") {
                for verb in list("verbs") {
                    assert!(
                        ![&group, &resource, &verb].iter().any(|s| s.contains('*')),
                        "a wildcard: {rule}"
                    );
                    all.insert((group.clone(), resource.clone(), verb));
                }
            }
        }
    }
    all
}

/// The resource of each kind the operator makes API handles for (`Api<Kind>`,
/// `Api::<Kind>`, `scope.api::<Kind>`), and the kinds it reaches otherwise.
pub const KINDS: &[(&str, &str)] = &[
    ("TrainingJob", "trainingjobs"),
    ("DataStage", "datastages"),
    ("Pod", "pods"),
    ("Secret", "secrets"),
    // A launcher's progress token (report::auth).
    ("TokenReview", "tokenreviews"),
    ("Service", "services"),
    ("EndpointSlice", "endpointslices"),
    ("NetworkPolicy", "networkpolicies"),
    ("Node", "nodes"),
    ("PersistentVolumeClaim", "persistentvolumeclaims"),
    ("PersistentVolume", "persistentvolumes"),
    ("Job", "jobs"),
    // A copy pod's FailedMount Events (data_stage::apply::mount_failures).
    ("Event", "events"),
    ("ServiceAccount", "serviceaccounts"),
    ("Role", "roles"),
    ("RoleBinding", "rolebindings"),
    ("Workload", "workloads"),
    ("ResourceFlavor", "resourceflavors"),
    ("PriorityClass", "priorityclasses"),
    // Kueue's WorkloadPriorityClass, read as a dynamic object (training_job::admission).
    ("DynamicObject", "workloadpriorityclasses"),
];

/// Resources reached without an `Api<Kind>` of their own: Events (kube's Recorder),
/// PodGroups (a generic `Api<K>`), the Lease (kube-lease-manager), and subresources.
pub const REACHED_OTHERWISE: &[&str] = &["events", "podgroups", "leases"];

/// The kinds the operator's code (`src/`, but for the stager in `src/stage`, which runs as
/// its own ServiceAccount) makes API handles for.
pub fn kinds_in_code(root: &Path) -> BTreeSet<String> {
    let mut kinds = BTreeSet::new();
    let mut pending = vec![root.join("src")];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                if path.file_name().is_some_and(|n| n != "stage") {
                    pending.push(path);
                }
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            for opening in ["Api<", "Api::<", "api::<"] {
                for (at, _) in text.match_indices(opening) {
                    let rest = &text[at + opening.len()..];
                    let rest = rest.strip_prefix("DeserializeGuard<").unwrap_or(rest);
                    let end = rest
                        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                        .unwrap_or(rest.len());
                    let kind = rest[..end].rsplit("::").next().unwrap_or_default();
                    // `Api<K>`: a generic kind, named where it is called.
                    if kind.len() > 1 && kind.starts_with(|c: char| c.is_ascii_uppercase()) {
                        kinds.insert(kind.to_string());
                    }
                }
            }
        }
    }
    kinds
}
