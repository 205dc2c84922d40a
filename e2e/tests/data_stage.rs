//! DataStage end to end on the local control plane: the real PV controller binds the
//! claim, the real Job controller runs the copy Job (its pod driven by KWOK), the stager
//! reports progress as the Job's ServiceAccount (run here against Azurite), and a
//! TrainingJob waiting on the data starts once it is Ready.

mod common;

#[path = "../../tests/support/azurite.rs"]
mod azurite;

use std::sync::Arc;
use std::time::Duration;

use common::{
    Operator, TestNamespace, apply, client, ensure_crds, eventually, sas_secret, stage_status,
    wait_stage_phase,
};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod, Secret};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use ringmaster::api::{DataStage, TrainingJob};
use ringmaster::stage::progress::Reporter;
use ringmaster::stage::{AuthMethod, ProgressMode, StageArgs, VerifyMode};
use serde_json::{Value, json};

const CONTAINER: &str = "datasets";

fn stage_object(name: &str, ns: &str, endpoint: &str, backoff_limit: u32) -> Value {
    json!({
        "apiVersion": "ringmaster.dev/v1alpha1",
        "kind": "DataStage",
        "metadata": {"name": name},
        "spec": {
            "source": {"azureBlob": {
                "account": azurite::ACCOUNT,
                "container": CONTAINER,
                "prefix": "tiny/",
                "endpoint": endpoint,
                "allowInsecureEndpoint": true,
                "auth": {"sasTokenSecretRef": {"name": "blob-sas", "key": "sasToken"}},
            }},
            // The allow list gives each namespace /export/<namespace> (common::e2e_destinations).
            "destination": {"nfs": {"server": "nfs.example.internal", "path": format!("/export/{ns}")}, "subPath": name},
            "capacity": "1Gi",
            "parallelism": 4,
            "backoffLimit": backoff_limit,
        }
    })
}

fn condition(status: &Value, type_: &str) -> Value {
    status["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == type_)
        .cloned()
        .unwrap_or(Value::Null)
}

/// The copy Job's pod, once the Job controller made it.
async fn stager_pod(client: &Client, ns: &str, job: &str) -> Pod {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let selector = format!("batch.kubernetes.io/job-name={job}");
    for _ in 0..150 {
        if let Some(pod) = pods
            .list(&ListParams::default().labels(&selector))
            .await
            .unwrap()
            .items
            .into_iter()
            .next()
        {
            return pod;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("no pod for Job {job}");
}

/// Makes KWOK end the pod with `code` and `message`.
async fn end_pod(client: &Client, ns: &str, pod: &str, code: i32, message: &str) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let patch = json!({"metadata": {"annotations": {
        "kwok.ringmaster.dev/exit-code": code.to_string(),
        "kwok.ringmaster.dev/termination-message": message,
    }}});
    pods.patch(pod, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
}

/// A client that authenticates as `namespace/service_account` with a fresh token.
async fn client_as(admin: &Client, ns: &str, service_account: &str) -> Client {
    let accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> =
        Api::namespaced(admin.clone(), ns);
    let request: k8s_openapi::api::authentication::v1::TokenRequest =
        serde_json::from_value(json!({"spec": {"expirationSeconds": 600}})).unwrap();
    let token = accounts
        .create_token_request(service_account, &PostParams::default(), &request)
        .await
        .unwrap()
        .status
        .unwrap()
        .token
        .expect("a token");
    let kubeconfig =
        kube::config::Kubeconfig::read_from(ringmaster_e2e::cluster::kubeconfig_path()).unwrap();
    let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    config.auth_info = kube::config::AuthInfo {
        token: Some(token.into()),
        ..Default::default()
    };
    Client::try_from(config).unwrap()
}

#[tokio::test]
async fn a_datastage_binds_copies_with_progress_and_feeds_a_waiting_training_job() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "ds-ok").await;
    let _operator = Operator::start(&client, &ns.name).await;
    let azurite = azurite::Azurite::start();
    azurite.create_container(CONTAINER);
    for i in 0..40 {
        let data = vec![i as u8; 1000 + i * 10];
        assert_eq!(
            azurite.put_blob(
                CONTAINER,
                &format!("tiny/train/c{}/img-{i}.bin", i % 4),
                &data
            ),
            201
        );
    }
    let sas = azurite::container_sas(azurite::KEY, CONTAINER, "rl");
    sas_secret(&client, &ns.name, &sas).await;

    let job = json!({
        "apiVersion": "ringmaster.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "fed"},
        "spec": {
            "workers": 1,
            "image": "ringmaster-trainer:e2e",
            "trainer": {"model": "resnet18", "steps": 10},
            "dataStageRef": {"name": "tiny"},
        }
    });
    apply(&client, &job, &ns.name, false).await.unwrap();
    apply(
        &client,
        &stage_object("tiny", &ns.name, &azurite.endpoint(), 2),
        &ns.name,
        false,
    )
    .await
    .unwrap();

    // The volume, pre-bound and retained; the real PV controller binds the claim.
    let stages: Api<DataStage> = Api::namespaced(client.clone(), &ns.name);
    let uid = stages.get("tiny").await.unwrap().uid().unwrap();
    let volumes: Api<PersistentVolume> = Api::all(client.clone());
    let volume_name = format!("ringmaster-{uid}");
    let status = wait_stage_phase(&client, &ns.name, "tiny", "Copying").await;
    assert_eq!(status["claimName"], "tiny-data");
    assert_eq!(condition(&status, "VolumeBound")["status"], "True");
    let volume = volumes.get(&volume_name).await.unwrap();
    let spec = volume.spec.unwrap();
    assert_eq!(
        spec.persistent_volume_reclaim_policy.as_deref(),
        Some("Retain")
    );
    assert_eq!(spec.nfs.unwrap().server, "nfs.example.internal");
    assert_eq!(
        spec.mount_options,
        Some(ringmaster::controller::data_stage::destinations::default_nfs_mount_options()),
        "the admin's mount options (the allow list gives none: its defaults)"
    );
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &ns.name);
    let claim = claims.get("tiny-data").await.unwrap();
    assert_eq!(claim.status.unwrap().phase.as_deref(), Some("Bound"));

    // The copy Job: the claim read-write at /data, the SAS from the Secret by reference.
    let jobs: Api<Job> = Api::namespaced(client.clone(), &ns.name);
    let copy_job = serde_json::to_value(jobs.get("tiny-stage").await.unwrap()).unwrap();
    let pod_spec = &copy_job["spec"]["template"]["spec"];
    let container = &pod_spec["containers"][0];
    assert_eq!(
        pod_spec["volumes"][0]["persistentVolumeClaim"]["claimName"],
        "tiny-data"
    );
    assert_eq!(container["volumeMounts"][0]["mountPath"], "/data");
    let env = container["env"].as_array().unwrap();
    let sas_env = env
        .iter()
        .find(|e| e["name"] == "AZURE_STORAGE_SAS_TOKEN")
        .unwrap();
    assert_eq!(
        sas_env["valueFrom"]["secretKeyRef"],
        json!({"name": "blob-sas", "key": "sasToken"})
    );
    assert!(
        !copy_job.to_string().contains(&sas),
        "the token is referenced, never copied"
    );

    // What the pod would do, as the pod's ServiceAccount: copy from Azurite, report progress.
    let stager_client = client_as(&client, &ns.name, "tiny-stager").await;
    let dest = tempfile::tempdir().unwrap();
    let args = StageArgs {
        account: azurite::ACCOUNT.into(),
        container: CONTAINER.into(),
        prefix: "tiny/".into(),
        endpoint: Some(azurite.endpoint()),
        destination: dest.path().to_path_buf(),
        parallelism: 4,
        verify: VerifyMode::Md5,
        auth: AuthMethod::SasToken,
        report_to: Some(format!("{}/tiny", ns.name)),
        progress: ProgressMode::Log,
        progress_interval: 0.2,
        attempts: 2,
        mirror: false,
        termination_message: None,
        print_settings: false,
    };
    ringmaster::tls::install_provider();
    let store = object_store::azure::MicrosoftAzureBuilder::new()
        .with_account(azurite::ACCOUNT)
        .with_container_name(CONTAINER)
        .with_endpoint(azurite.endpoint())
        .with_allow_http(true)
        .with_config(object_store::azure::AzureConfigKey::SasKey, &sas)
        .build()
        .unwrap();
    let reporter = Reporter::Status {
        api: Box::new(Api::namespaced(stager_client.clone(), &ns.name)),
        name: "tiny".into(),
    };
    let summary = ringmaster::stage::copy(Arc::new(store), &args, &reporter)
        .await
        .unwrap();
    assert_eq!(summary.files, 40);
    let status = stage_status(&client, &ns.name, "tiny").await;
    assert_eq!(status["progress"]["filesDone"], 40, "{status:#}");
    assert_eq!(status["progress"]["percent"], "100.0%");
    assert!(!status.to_string().contains(&sas));

    // The stager's token may patch this DataStage's status and nothing else.
    let other = stage_object("other", &ns.name, &azurite.endpoint(), 0);
    apply(&client, &other, &ns.name, false).await.unwrap();
    let as_stager: Api<DataStage> = Api::namespaced(stager_client.clone(), &ns.name);
    let patch = json!({"status": {"progress": {"filesDone": 1}}});
    let denied = as_stager
        .patch_status("other", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap_err();
    assert!(
        matches!(denied, kube::Error::Api(ref s) if s.code == 403),
        "{denied}"
    );
    let secrets: Api<Secret> = Api::namespaced(stager_client, &ns.name);
    let denied = secrets.get("blob-sas").await.unwrap_err();
    assert!(
        matches!(denied, kube::Error::Api(ref s) if s.code == 403),
        "{denied}"
    );

    // The TrainingJob waited; the Job's pod succeeds (KWOK) → Ready → the job starts.
    let trainings: Api<TrainingJob> = Api::namespaced(client.clone(), &ns.name);
    eventually(
        Duration::from_secs(30),
        "the training job waiting for data",
        || async {
            trainings
                .get("fed")
                .await
                .unwrap()
                .status
                .is_some_and(|s| serde_json::to_value(s.phase).unwrap() == "WaitingForData")
        },
    )
    .await;
    let pod = stager_pod(&client, &ns.name, "tiny-stage").await;
    end_pod(
        &client,
        &ns.name,
        &pod.name_any(),
        0,
        &serde_json::to_string(&summary).unwrap(),
    )
    .await;
    let status = wait_stage_phase(&client, &ns.name, "tiny", "Ready").await;
    assert_eq!(condition(&status, "Ready")["status"], "True");
    assert!(status["completionTime"].is_string());
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
    eventually(
        Duration::from_secs(60),
        "the training job's worker with the data",
        || async {
            pods.get_opt("fed-worker-0")
                .await
                .unwrap()
                .is_some_and(|p| {
                    serde_json::to_value(p.spec).unwrap()["volumes"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|v| {
                            v["persistentVolumeClaim"]
                                == json!({"claimName": "tiny-data", "readOnly": true})
                        })
                })
        },
    )
    .await;

    // Deleting the DataStage deletes the volume object (the data on the share stays) once
    // no pod uses the claim: the training job goes first.
    trainings
        .delete("fed", &DeleteParams::default())
        .await
        .unwrap();
    stages
        .delete("tiny", &DeleteParams::default())
        .await
        .unwrap();
    eventually(Duration::from_secs(30), "the DataStage gone", || async {
        stages.get_opt("tiny").await.unwrap().is_none()
    })
    .await;
    eventually(
        Duration::from_secs(60),
        "the claim and the PV gone",
        || async {
            claims.get_opt("tiny-data").await.unwrap().is_none()
                && volumes.get_opt(&volume_name).await.unwrap().is_none()
        },
    )
    .await;
}

#[tokio::test]
async fn a_failed_copy_makes_the_datastage_failed_with_the_stagers_reason() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "ds-fail").await;
    let _operator = Operator::start(&client, &ns.name).await;
    sas_secret(&client, &ns.name, "sv=2021-08-06&sig=wrong").await;
    apply(
        &client,
        &stage_object("broken", &ns.name, "http://127.0.0.1:9/devstoreaccount1", 0),
        &ns.name,
        false,
    )
    .await
    .unwrap();
    wait_stage_phase(&client, &ns.name, "broken", "Copying").await;
    let pod = stager_pod(&client, &ns.name, "broken-stage").await;
    let reason = "listing datasets/tiny/ in account devstoreaccount1: the credential was refused";
    end_pod(&client, &ns.name, &pod.name_any(), 1, reason).await;
    let status = wait_stage_phase(&client, &ns.name, "broken", "Failed").await;
    let ready = condition(&status, "Ready");
    assert_eq!(ready["reason"], "CopyFailed");
    assert!(
        ready["message"]
            .as_str()
            .unwrap()
            .contains("credential was refused"),
        "{status:#}"
    );
    assert_eq!(condition(&status, "Stalled")["status"], "True");
    assert!(!status.to_string().contains("sig=wrong"));
    // A failed copy waits for a person: a Warning says so (the Copied condition's).
    eventually(
        Duration::from_secs(10),
        "a CopyFailed Warning Event",
        || async {
            common::warnings_for(&client, &ns.name, "broken", "CopyFailed")
                .await
                .iter()
                .any(|e| {
                    e.note.as_deref().is_some_and(|n| {
                        n.starts_with("Copied=False") && n.contains("credential was refused")
                    })
                })
        },
    )
    .await;
}

/// A DataStage deleted and made again at once while the first one's claim and finished copy
/// Job are still being deleted: it neither passes the first copy off as its own nor fails on
/// the first claim; it says what it waits for, then copies again.
#[tokio::test]
async fn a_datastage_made_again_under_its_name_waits_for_the_first_ones_children_and_copies_again()
{
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "ds-again").await;
    let _operator = Operator::start(&client, &ns.name).await;
    sas_secret(&client, &ns.name, "sv=2021-08-06&sig=unused").await;
    let stage = stage_object("again", &ns.name, "http://127.0.0.1:9/devstoreaccount1", 0);
    apply(&client, &stage, &ns.name, false).await.unwrap();
    wait_stage_phase(&client, &ns.name, "again", "Copying").await;
    let first_pod = stager_pod(&client, &ns.name, "again-stage").await;
    end_pod(&client, &ns.name, &first_pod.name_any(), 0, "").await;
    wait_stage_phase(&client, &ns.name, "again", "Ready").await;

    let jobs: Api<Job> = Api::namespaced(client.clone(), &ns.name);
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &ns.name);
    common::hold(&jobs, "again-stage", true).await;
    common::hold(&claims, "again-data", true).await;
    let stages: Api<DataStage> = Api::namespaced(client.clone(), &ns.name);
    stages
        .delete("again", &DeleteParams::background())
        .await
        .unwrap();
    eventually(
        Duration::from_secs(30),
        "the first DataStage gone",
        || async { stages.get_opt("again").await.unwrap().is_none() },
    )
    .await;
    apply(&client, &stage, &ns.name, false).await.unwrap();

    // Waiting for the first claim, Reconciling, not Ready.
    let waits_for = |words: &'static str| {
        let client = client.clone();
        let ns = ns.name.clone();
        async move {
            let mut status = Value::Null;
            for _ in 0..150 {
                status = stage_status(&client, &ns, "again").await;
                let ready = condition(&status, "Ready");
                if ready["reason"] == "EarlierStageDeleting"
                    && ready["message"].as_str().is_some_and(|m| m.contains(words))
                {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            panic!("not waiting for \"{words}\": {status:#}");
        }
    };
    waits_for("PersistentVolumeClaim again-data belongs to an earlier DataStage").await;
    let status = stage_status(&client, &ns.name, "again").await;
    assert_eq!(status["phase"], "Pending", "{status:#}");
    assert_eq!(condition(&status, "Reconciling")["status"], "True");
    assert_eq!(condition(&status, "Stalled")["status"], "False");
    assert!(
        common::warnings_for(&client, &ns.name, "again", "EarlierStageDeleting")
            .await
            .is_empty()
    );

    // The first claim goes (its protection holds it while the first copy's pod exists); the
    // first Job (Complete) still stands and is not taken for this DataStage's copy.
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
    pods.delete(&first_pod.name_any(), &DeleteParams::background())
        .await
        .unwrap();
    common::hold(&claims, "again-data", false).await;
    waits_for("Job again-stage belongs to an earlier DataStage").await;
    // The new claim binds to the new volume meanwhile; the first Job still holds the copy back.
    eventually(Duration::from_secs(30), "the new claim bound", || async {
        condition(
            &stage_status(&client, &ns.name, "again").await,
            "VolumeBound",
        )["status"]
            == "True"
    })
    .await;
    let status = stage_status(&client, &ns.name, "again").await;
    assert_eq!(status["phase"], "Pending", "{status:#}");
    assert_eq!(
        condition(&status, "Ready")["reason"],
        "EarlierStageDeleting",
        "{status:#}"
    );
    let second = stages.get("again").await.unwrap().uid().unwrap();
    let claim = claims.get("again-data").await.unwrap();
    assert!(claim.owner_references().iter().any(|o| o.uid == second));

    // The first Job goes, but a pod of it still stops (here one the test made under its
    // label): two stagers must not write one folder.
    let stopping = serde_json::from_value(json!({
        "metadata": {"name": "again-stage-stopping", "labels": {"batch.kubernetes.io/job-name": "again-stage"}},
        "spec": {"containers": [{"name": "stager", "image": "ringmaster:e2e"}]},
    }))
    .unwrap();
    pods.create(&PostParams::default(), &stopping)
        .await
        .unwrap();
    common::hold(&jobs, "again-stage", false).await;
    waits_for("Pod again-stage-stopping of an earlier copy Job (Job again-stage) has not stopped")
        .await;
    assert!(jobs.get_opt("again-stage").await.unwrap().is_none());

    // Then a copy of its own.
    pods.delete("again-stage-stopping", &DeleteParams::background())
        .await
        .unwrap();
    wait_stage_phase(&client, &ns.name, "again", "Copying").await;
    let job = jobs.get("again-stage").await.unwrap();
    assert!(job.owner_references().iter().any(|o| o.uid == second));
    let pod = stager_pod(&client, &ns.name, "again-stage").await;
    assert_ne!(pod.uid(), first_pod.uid());
    end_pod(&client, &ns.name, &pod.name_any(), 0, "").await;
    wait_stage_phase(&client, &ns.name, "again", "Ready").await;
}

/// A ServiceAccount of the stager's name that is the user's own is neither used nor adopted
/// (adopted, the garbage collector would delete it with the DataStage): the DataStage
/// stalls naming it, with a Warning, and goes on once the name is free.
#[tokio::test]
async fn a_datastage_leaves_a_service_account_of_its_stagers_name_that_is_not_its_own_alone() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "ds-clash").await;
    let _operator = Operator::start(&client, &ns.name).await;
    sas_secret(&client, &ns.name, "sv=2021-08-06&sig=unused").await;
    let accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> =
        Api::namespaced(client.clone(), &ns.name);
    let theirs = serde_json::from_value(
        json!({"metadata": {"name": "clash-stager", "labels": {"team": "vision"}}}),
    )
    .unwrap();
    accounts
        .create(&PostParams::default(), &theirs)
        .await
        .unwrap();
    apply(
        &client,
        &stage_object("clash", &ns.name, "http://127.0.0.1:9/devstoreaccount1", 0),
        &ns.name,
        false,
    )
    .await
    .unwrap();

    let words = "ServiceAccount clash-stager exists and is not this DataStage's";
    eventually(
        Duration::from_secs(30),
        "NameInUse on the DataStage",
        || async {
            let ready = condition(&stage_status(&client, &ns.name, "clash").await, "Ready");
            ready["reason"] == "NameInUse"
                && ready["message"].as_str().is_some_and(|m| m.contains(words))
        },
    )
    .await;
    let status = stage_status(&client, &ns.name, "clash").await;
    assert_eq!(status["phase"], "Pending");
    assert_eq!(condition(&status, "Stalled")["status"], "True");
    eventually(Duration::from_secs(10), "a NameInUse Warning", || async {
        common::warnings_for(&client, &ns.name, "clash", "NameInUse")
            .await
            .iter()
            .any(|e| e.note.as_deref().is_some_and(|n| n.contains(words)))
    })
    .await;
    let account = accounts.get("clash-stager").await.unwrap();
    assert!(
        account.owner_references().is_empty(),
        "adopted: {account:?}"
    );
    assert_eq!(
        account.labels().clone(),
        std::collections::BTreeMap::from([("team".to_string(), "vision".to_string())])
    );
    let jobs: Api<Job> = Api::namespaced(client.clone(), &ns.name);
    assert!(jobs.get_opt("clash-stage").await.unwrap().is_none());

    // The name is freed: the copy starts (looked at again within 10 s).
    accounts
        .delete("clash-stager", &DeleteParams::background())
        .await
        .unwrap();
    wait_stage_phase(&client, &ns.name, "clash", "Copying").await;
    let account = accounts.get("clash-stager").await.unwrap();
    let uid = Api::<DataStage>::namespaced(client.clone(), &ns.name)
        .get("clash")
        .await
        .unwrap()
        .uid()
        .unwrap();
    assert!(account.owner_references().iter().any(|o| o.uid == uid));
}

#[tokio::test]
async fn a_destination_the_admin_does_not_allow_is_refused_and_gets_no_volume() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "ds-deny").await;
    let _operator = Operator::start(&client, &ns.name).await;
    let own_folder = format!("/export/{}", ns.name);
    // Another namespace's folder on the allowed server; a server the admin did not list;
    // mount options of the tenant's.
    let cases = [
        (
            "theirs",
            json!({"server": "nfs.example.internal", "path": "/export/team-b"}),
            "spec.destination.nfs.path",
        ),
        (
            "elsewhere",
            json!({"server": "files.other-team.internal", "path": own_folder}),
            "spec.destination.nfs.server",
        ),
        (
            "options",
            json!({"server": "nfs.example.internal", "path": own_folder, "mountOptions": ["nfsvers=3"]}),
            "spec.destination.nfs.mountOptions",
        ),
    ];
    for (name, nfs, field) in &cases {
        let mut stage = stage_object(name, &ns.name, "https://acct.blob.core.windows.net", 0);
        stage["spec"]["destination"]["nfs"] = nfs.clone();
        apply(&client, &stage, &ns.name, false).await.unwrap();
        eventually(Duration::from_secs(30), "SpecValid=False", || async {
            let status = stage_status(&client, &ns.name, name).await;
            let valid = condition(&status, "SpecValid");
            valid["status"] == "False"
                && valid["message"].as_str().is_some_and(|m| m.contains(field))
        })
        .await;
    }
    // No volume for any of them.
    let volumes: Api<PersistentVolume> = Api::all(client.clone());
    let ours = volumes
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|v| {
            v.spec
                .as_ref()
                .and_then(|s| s.claim_ref.as_ref())
                .and_then(|c| c.namespace.as_deref())
                == Some(ns.name.as_str())
        })
        .count();
    assert_eq!(ours, 0, "a refused destination gets no PersistentVolume");
    // A plain http endpoint without allowInsecureEndpoint: refused at apply.
    let mut plain = stage_object("plain", &ns.name, "http://acct.example:10000/acct", 0);
    plain["spec"]["source"]["azureBlob"]
        .as_object_mut()
        .unwrap()
        .remove("allowInsecureEndpoint");
    let refused = apply(&client, &plain, &ns.name, false).await.unwrap_err();
    assert!(
        refused.to_string().contains("allowInsecureEndpoint"),
        "{refused}"
    );
}
