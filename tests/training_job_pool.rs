//! The node-pool decisions of the TrainingJob controller, without Azure: what `decide` does
//! with each answer ARM can give, and how a creation's outcome is reported.

#[path = "common/mod.rs"]
mod fixtures;

use std::time::Duration;

use ringmaster::aks::{Accepted, AgentPool, ArmError, Operation};
use ringmaster::api::NodePoolStatus;
use ringmaster::controller::training_job::pool::{PoolSeen, after_create, decide};
use ringmaster::controller::training_job::state::PoolState;
use ringmaster::controller::training_job::validate::{ValidatedTrainingJob, validate_value};
use serde_json::json;

/// The flagship sample (2 × Standard_ND96asr_v4 in its own pool).
fn job() -> ValidatedTrainingJob {
    let path = fixtures::root().join("config/samples/trainingjob-resnet50-nd96asr-v4.yaml");
    let mut object = fixtures::ringmaster_objects(&path).remove(0);
    object["metadata"]["namespace"] = json!("ml");
    object["metadata"]["uid"] = json!("6f1c2d3e-0000-4000-8000-00000000abcd");
    validate_value(&object, None).unwrap()
}

fn seen(pool: Result<Option<AgentPool>, ArmError>) -> PoolSeen {
    PoolSeen {
        pool,
        ready_nodes: None,
        operation: None,
        ignored_operation: None,
    }
}

/// The job's own pool (tagged with its UID, as the request tags it), in `state`.
fn pool(state: &str) -> Option<AgentPool> {
    let job = job();
    let plan = job.node_pool.clone().unwrap();
    let request = ringmaster::controller::training_job::pool::request(
        &job,
        &plan,
        plan.pool_name.as_deref().unwrap(),
    );
    Some(AgentPool {
        provisioning_state: state.into(),
        count: 2,
        vm_size: "Standard_ND96asr_v4".into(),
        tags: request.tags,
        etag: Some("etag-1".into()),
    })
}

fn tagged(tags: &[(&str, &str)]) -> AgentPool {
    AgentPool {
        tags: tags
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..pool("Succeeded").unwrap()
    }
}

#[test]
fn a_pool_of_that_name_that_is_not_the_jobs_is_neither_used_nor_deleted() {
    use ringmaster::controller::training_job::pool::is_jobs_pool;
    let job = job();
    let plan = job.node_pool.clone().unwrap();
    let name = plan.pool_name.clone().unwrap();
    let ours = |p: &AgentPool| is_jobs_pool(p, &job.namespace, &job.name, &job.uid);
    assert!(
        ours(&pool("Succeeded").unwrap()),
        "the job's own request tags it"
    );
    // Made by an operator before the UID tag: its namespace and name say.
    assert!(ours(&tagged(&[(
        "ringmaster.dev-job",
        "ml.resnet50-imagenet"
    )])));
    for foreign in [
        tagged(&[]),
        tagged(&[("team", "vision")]),
        tagged(&[("ringmaster.dev-job", "other.resnet50-imagenet")]),
        // A job of the same namespace and name, deleted and made again: another UID.
        tagged(&[
            ("ringmaster.dev-job", "ml.resnet50-imagenet"),
            (
                "ringmaster.dev-job-uid",
                "0b0e0000-0000-4000-8000-000000000001",
            ),
        ]),
    ] {
        assert!(!ours(&foreign), "{:?}", foreign.tags);
        // Being deleted (an earlier job's of the same name, done): wait, then make our own.
        let leaving = AgentPool {
            provisioning_state: "Deleting".into(),
            ..foreign.clone()
        };
        let decision = decide(
            &job,
            &plan,
            &name,
            &NodePoolStatus::default(),
            seen(Ok(Some(leaving))),
        );
        assert!(decision.create.is_none());
        assert!(
            matches!(&decision.look.state, PoolState::Provisioning { message } if message.contains("is being deleted")),
            "{:?}",
            decision.look.state
        );
        assert_eq!(decision.look.requeue, Some(Duration::from_secs(10)));
        let with_nodes = PoolSeen {
            ready_nodes: Some(2),
            ..seen(Ok(Some(foreign.clone())))
        };
        let decision = decide(&job, &plan, &name, &NodePoolStatus::default(), with_nodes);
        assert!(decision.create.is_none());
        match decision.look.state {
            PoolState::Failed { message } => assert!(
                message.contains(&format!("agent pool {name} exists and is not this job's"))
                    && message.contains("nodePool.poolName"),
                "{message}"
            ),
            other => panic!("{:?}: {other:?}", foreign.tags),
        }
    }
}

#[test]
fn a_missing_pool_is_created_and_followed() {
    let job = job();
    let plan = job.node_pool.clone().unwrap();
    let name = plan.pool_name.clone().unwrap();
    let old = NodePoolStatus::default();
    let decision = decide(&job, &plan, &name, &old, seen(Ok(None)));
    let request = decision.create.expect("a PUT");
    assert_eq!(
        (request.count, request.vm_size.as_str()),
        (2, "Standard_ND96asr_v4")
    );

    let accepted = Accepted {
        operation: Some("https://management.azure.com/op/1".into()),
        ignored_operation: None,
    };
    let look = after_create(&job, &plan, &name, decision.look, Ok(accepted));
    assert!(
        matches!(look.state, PoolState::Provisioning { .. }),
        "{look:?}"
    );
    let status = look.status.unwrap();
    assert_eq!(status.provisioning_state.as_deref(), Some("Creating"));
    assert_eq!(
        status.operation.as_deref(),
        Some("https://management.azure.com/op/1")
    );
    assert_eq!(look.requeue, Some(Duration::from_secs(5)));
}

#[test]
fn azure_refusing_the_pool_fails_with_its_reason_and_throttling_waits() {
    let job = job();
    let plan = job.node_pool.clone().unwrap();
    let name = plan.pool_name.clone().unwrap();
    let old = NodePoolStatus::default();
    let refused = ArmError::Refused {
        status: 400,
        code: "InsufficientVCPUQuota".into(),
        message: "quota of 0 vCPUs".into(),
    };
    let before = decide(&job, &plan, &name, &old, seen(Ok(None))).look;
    match after_create(&job, &plan, &name, before, Err(refused)).state {
        PoolState::Failed { message } => {
            assert!(message.contains("InsufficientVCPUQuota"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    let throttled = ArmError::Throttled {
        retry_after: Duration::from_secs(7),
    };
    let look = decide(&job, &plan, &name, &old, seen(Err(throttled))).look;
    assert!(matches!(look.state, PoolState::Provisioning { .. }));
    assert_eq!(look.requeue, Some(Duration::from_secs(7)));
}

#[test]
fn a_succeeded_pool_is_ready_once_every_worker_has_a_node() {
    let job = job();
    let plan = job.node_pool.clone().unwrap();
    let name = plan.pool_name.clone().unwrap();
    let old = NodePoolStatus::default();
    let with_nodes = |ready| PoolSeen {
        ready_nodes: Some(ready),
        ..seen(Ok(pool("Succeeded")))
    };
    let waiting = decide(&job, &plan, &name, &old, with_nodes(1));
    assert!(waiting.create.is_none());
    assert!(matches!(waiting.look.state, PoolState::Provisioning { .. }));
    assert_eq!(waiting.look.status.unwrap().ready_nodes, 1);
    let ready = decide(&job, &plan, &name, &old, with_nodes(2)).look;
    assert!(matches!(ready.state, PoolState::Ready { .. }), "{ready:?}");
    assert_eq!(ready.requeue, None);
    let creating = decide(&job, &plan, &name, &old, seen(Ok(pool("Creating")))).look;
    assert!(matches!(creating.state, PoolState::Provisioning { .. }));
}

#[test]
fn a_failed_pool_reports_the_operations_reason_with_a_hint() {
    let job = job();
    let plan = job.node_pool.clone().unwrap();
    let name = plan.pool_name.clone().unwrap();
    let old = NodePoolStatus {
        operation: Some("https://management.azure.com/op/1".into()),
        ..NodePoolStatus::default()
    };
    let failed = PoolSeen {
        operation: Some(Ok(Operation::Failed {
            code: "QuotaExceeded".into(),
            message: "Operation could not be completed as it results in exceeding approved quota"
                .into(),
        })),
        ..seen(Ok(pool("Failed")))
    };
    match decide(&job, &plan, &name, &old, failed).look.state {
        PoolState::Failed { message } => {
            assert!(
                message.contains("QuotaExceeded: Operation could not"),
                "{message}"
            );
            assert!(
                message.contains("(the subscription's vCPU quota"),
                "a hint: {message}"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_pool_made_meanwhile_answers_412_and_is_looked_at_not_put_again() {
    let job = job();
    let plan = job.node_pool.clone().unwrap();
    let name = plan.pool_name.clone().unwrap();
    let old = NodePoolStatus::default();
    let before = decide(&job, &plan, &name, &old, seen(Ok(None))).look;
    let exists = ArmError::PreconditionFailed {
        message: "The agent pool exists.".into(),
    };
    let look = after_create(&job, &plan, &name, before, Err(exists));
    match &look.state {
        PoolState::Provisioning { message } => assert!(
            message.contains(&format!("agent pool {name} exists already"))
                && message.contains("neither used nor deleted"),
            "{message}"
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(look.requeue, Some(Duration::from_secs(2)));
    let status = look.status.unwrap();
    assert_eq!(status.provisioning_state, None, "nothing was made");
    assert_eq!(status.operation, None);

    // The next look finds another job's pool there: the job fails; nothing is put or deleted.
    let other = AgentPool {
        provisioning_state: "Creating".into(),
        ..tagged(&[
            ("ringmaster.dev-job", "team-b.other"),
            (
                "ringmaster.dev-job-uid",
                "0b0e0000-0000-4000-8000-000000000002",
            ),
        ])
    };
    let decision = decide(&job, &plan, &name, &status, seen(Ok(Some(other))));
    assert!(decision.create.is_none());
    match decision.look.state {
        PoolState::Failed { message } => assert!(
            message.contains("is not this job's (TrainingJob team-b.other made it)"),
            "{message}"
        ),
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_operation_url_in_the_status_that_is_not_arms_is_dropped_with_a_warning() {
    let job = job();
    let plan = job.node_pool.clone().unwrap();
    let name = plan.pool_name.clone().unwrap();
    let old = NodePoolStatus {
        name: name.clone(),
        provisioning_state: Some("Failed".into()),
        operation: Some("https://listener.example/steal".into()),
        ..NodePoolStatus::default()
    };
    let tampered = PoolSeen {
        ignored_operation: old.operation.clone(),
        ..seen(Ok(pool("Failed")))
    };
    let look = decide(&job, &plan, &name, &old, tampered).look;
    let warning = look.warning.expect("a Warning");
    assert!(
        warning.contains("https://listener.example/steal") && warning.contains("not requested"),
        "{warning}"
    );
    assert_eq!(
        look.status.unwrap().operation,
        None,
        "dropped from the status"
    );
    match look.state {
        PoolState::Failed { message } => {
            assert!(message.contains("was not read"), "{message}")
        }
        other => panic!("{other:?}"),
    }

    // Azure's own answer naming another origin: not recorded, said too.
    let before = decide(
        &job,
        &plan,
        &name,
        &NodePoolStatus::default(),
        seen(Ok(None)),
    )
    .look;
    let accepted = Accepted {
        operation: None,
        ignored_operation: Some("https://elsewhere.example/op".into()),
    };
    let look = after_create(&job, &plan, &name, before, Ok(accepted));
    assert_eq!(look.status.unwrap().operation, None);
    assert!(
        look.warning
            .unwrap()
            .contains("https://elsewhere.example/op")
    );
}

#[test]
fn a_job_keeps_the_pool_name_its_status_records() {
    use ringmaster::controller::training_job::names::derive_pool_name;
    let path = fixtures::root().join("config/samples/trainingjob-resnet50-nd96asr-v4.yaml");
    let mut object = fixtures::ringmaster_objects(&path).remove(0);
    object["metadata"]["namespace"] = json!("ml");
    object["metadata"]["uid"] = json!("6f1c2d3e-0000-4000-8000-00000000abcd");
    object["spec"]["nodePool"]
        .as_object_mut()
        .unwrap()
        .remove("poolName");
    let name_of = |object: &serde_json::Value| {
        validate_value(object, None)
            .unwrap()
            .node_pool
            .unwrap()
            .pool_name
            .unwrap()
    };
    // A new job: the name derived from its name and UID.
    let derived = derive_pool_name("resnet50-imagenet", "6f1c2d3e-0000-4000-8000-00000000abcd");
    assert_eq!(name_of(&object), derived);
    // A job an earlier operator named its pool for (8 letters and 4 hex digits of its UID):
    // that pool is still its pool, used and given back under that name.
    object["status"] = json!({"phase": "Running", "nodePool": {"name": "resnet506f1c", "provisioningState": "Succeeded", "readyNodes": 2}});
    assert_eq!(name_of(&object), "resnet506f1c");
    let typed: ringmaster::api::TrainingJob = serde_json::from_value(object.clone()).unwrap();
    assert_eq!(
        ringmaster::controller::training_job::validate::aks_pool_name(&typed).as_deref(),
        Some("resnet506f1c"),
        "the finalizer deletes the pool under the same name"
    );
    // A recorded name that is not a pool name is not taken.
    object["status"]["nodePool"]["name"] = json!("Not-A-Pool");
    assert_eq!(name_of(&object), derived);
    // The spec's own poolName always wins.
    object["spec"]["nodePool"]["poolName"] = json!("mine");
    assert_eq!(name_of(&object), "mine");
}
