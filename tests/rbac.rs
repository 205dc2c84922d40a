//! Who may do what, as the chart's defaults grant it (`config/rbac`, which `make manifests`
//! renders from the chart; the end-to-end tests check it is current and render the chart with
//! Kueue and gang scheduling too): the operator exactly the calls its code makes, Ringmaster's
//! users the aggregated edit and view ClusterRoles, which never write status.

#[path = "common/mod.rs"]
mod fixtures;
#[path = "support/operator_rbac.rs"]
mod operator_rbac;

use std::collections::BTreeSet;

use serde_json::Value;

/// The objects of `config/rbac/rbac.yaml` by kind and name.
fn object(kind: &str, name: &str) -> Value {
    fixtures::documents(&fixtures::root().join("config/rbac/rbac.yaml"))
        .into_iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in config/rbac/rbac.yaml"))
}

#[test]
fn the_operators_roles_grant_exactly_the_calls_its_code_makes() {
    let granted = operator_rbac::granted(&object("ClusterRole", "ringmaster")["rules"]);
    let expected = operator_rbac::expected(operator_rbac::CLUSTER_CALLS, false, None);
    let more: Vec<_> = granted.difference(&expected).collect();
    let missing: Vec<_> = expected.difference(&granted).collect();
    assert!(
        more.is_empty() && missing.is_empty(),
        "the ClusterRole grants more than the code calls: {more:?}\nand lacks: {missing:?}"
    );
    let leader = operator_rbac::granted(&object("Role", "ringmaster-leader-election")["rules"]);
    assert_eq!(
        leader,
        operator_rbac::expected(operator_rbac::LEADER_CALLS, false, None)
    );
    // Nothing patches, updates or deletes what a namespace's RBAC is made of: the stager's
    // ServiceAccount, Role and RoleBinding are only read and created.
    for resource in ["serviceaccounts", "roles", "rolebindings"] {
        let verbs: BTreeSet<&str> = granted
            .iter()
            .filter(|(_, r, _)| r == resource)
            .map(|(_, _, v)| v.as_str())
            .collect();
        assert_eq!(verbs, BTreeSet::from(["create", "get"]), "{resource}");
    }
    assert!(
        !granted
            .iter()
            .any(|(_, _, v)| matches!(v.as_str(), "escalate" | "bind" | "impersonate")),
        "{granted:?}"
    );
}

/// The table of calls names every kind the code makes an API handle for, and nothing the
/// code never reaches.
#[test]
fn the_table_of_calls_covers_every_kind_the_code_calls() {
    let in_code = operator_rbac::kinds_in_code(&fixtures::root());
    let known: BTreeSet<String> = operator_rbac::KINDS
        .iter()
        .map(|(kind, _)| kind.to_string())
        .collect();
    let unknown: Vec<_> = in_code.difference(&known).collect();
    assert!(
        unknown.is_empty(),
        "the code calls kinds tests/support/operator_rbac.rs does not list: {unknown:?}"
    );
    let unused: Vec<_> = known.difference(&in_code).collect();
    assert!(unused.is_empty(), "listed but never called: {unused:?}");
    let tabled: BTreeSet<&str> = operator_rbac::CLUSTER_CALLS
        .iter()
        .map(|c| c.resource)
        .filter(|r| !r.contains('/'))
        .collect();
    let reached: BTreeSet<&str> = operator_rbac::KINDS
        .iter()
        .map(|(_, resource)| *resource)
        .chain(operator_rbac::REACHED_OTHERWISE.iter().copied())
        .collect();
    assert_eq!(tabled, &reached - &BTreeSet::from(["leases"]));
}

/// `ringmaster-edit` lets a namespace's editors (and admins) write TrainingJobs and
/// DataStages, `ringmaster-view` its viewers read them: aggregated into the built-in roles by
/// their labels. Neither touches a status or finalizers subresource, nor another group.
#[test]
fn users_get_aggregated_edit_and_view_roles_that_never_write_status() {
    let resources = BTreeSet::from(["datastages", "trainingjobs"]);
    for (name, labels, verbs) in [
        (
            "ringmaster-edit",
            &["aggregate-to-admin", "aggregate-to-edit"][..],
            &[
                "create", "delete", "get", "list", "patch", "update", "watch",
            ][..],
        ),
        (
            "ringmaster-view",
            &["aggregate-to-view"][..],
            &["get", "list", "watch"][..],
        ),
    ] {
        let role = object("ClusterRole", name);
        for label in labels {
            assert_eq!(
                role["metadata"]["labels"][format!("rbac.authorization.k8s.io/{label}")],
                "true",
                "{name}"
            );
        }
        let granted = operator_rbac::granted(&role["rules"]);
        let expected: BTreeSet<(String, String, String)> = resources
            .iter()
            .flat_map(|r| {
                verbs
                    .iter()
                    .map(|v| ("ringmaster.dev".to_string(), r.to_string(), v.to_string()))
            })
            .collect();
        assert_eq!(granted, expected, "{name}");
        assert!(granted.iter().all(|(_, r, _)| !r.contains('/')), "{name}");
    }
    // No other ClusterRole of the chart but the operator's names a status subresource.
    for document in fixtures::documents(&fixtures::root().join("config/rbac/rbac.yaml")) {
        if document["kind"] != "ClusterRole" || document["metadata"]["name"] == "ringmaster" {
            continue;
        }
        assert!(
            !document["rules"].to_string().contains("/status"),
            "{document}"
        );
    }
}
