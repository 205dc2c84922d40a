//! The DataStage build and status steps from the samples: the children's contents and the
//! phase each observed state gives.

#[path = "common/mod.rs"]
mod fixtures;
#[path = "support/pod_security.rs"]
mod pod_security;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use ringmaster::api::{DataStagePhase, DataStageStatus};
use ringmaster::controller::data_stage::build::{self, BuildInputs, Names};
use ringmaster::controller::data_stage::destinations::AllowedDestinations;
use ringmaster::controller::data_stage::status::{self, ClaimState, CopyState};
use ringmaster::controller::data_stage::validate::{ValidatedDataStage, validate_value};
use serde_json::{Value, json};

fn sample(file: &str, edit: impl FnOnce(&mut Value)) -> ValidatedDataStage {
    let path = fixtures::root().join("config/samples").join(file);
    let mut object = fixtures::ringmaster_objects(&path).remove(0);
    object["metadata"]["namespace"] = json!("ml");
    object["metadata"]["uid"] = json!("0b5e7c1a-0000-4000-8000-0000000000ds");
    edit(&mut object);
    let mut stage = validate_value(&object, None).unwrap_or_else(|e| panic!("{file}: {e}"));
    // As the operator admits it: the export the admin allows, with the admin's mount options.
    let allowed = AllowedDestinations::parse(
        r#"{"nfs": [{"server": "10.0.0.4", "path": "/export/datasets"}],
            "azureFileNfs": [{"storageAccount": "premiumfiles", "shareName": "datasets", "namespaces": ["ml"]}]}"#,
    )
    .unwrap();
    let raw: ringmaster::api::DataStage = serde_json::from_value(object).unwrap();
    stage.destination = allowed
        .admit(&raw, &stage.destination)
        .unwrap_or_else(|e| panic!("{file}: {e}"));
    stage
}

fn imagenet() -> ValidatedDataStage {
    sample("datastage-imagenet-azure-sas.yaml", |_| {})
}

fn value<T: serde::Serialize>(v: &T) -> Value {
    serde_json::to_value(v).unwrap()
}

fn inputs() -> BuildInputs {
    BuildInputs {
        stager_image: "example.azurecr.io/ringmaster:test".into(),
    }
}

fn env(container: &Value, name: &str) -> Value {
    container["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == name)
        .cloned()
        .unwrap_or(Value::Null)
}

#[test]
fn nfs_volume_is_retained_pre_bound_and_mounted_read_write_by_the_copy_job() {
    let stage = imagenet();
    let names = Names::of(&stage);
    let pv = value(&build::volume(&stage).unwrap());
    assert_eq!(pv["metadata"]["name"], names.volume);
    assert_eq!(
        pv["spec"]["nfs"],
        json!({"server": "10.0.0.4", "path": "/export/datasets/ml"})
    );
    assert_eq!(pv["spec"]["persistentVolumeReclaimPolicy"], "Retain");
    assert_eq!(pv["spec"]["capacity"]["storage"], "200Gi");
    assert_eq!(pv["spec"]["accessModes"], json!(["ReadWriteMany"]));
    assert_eq!(pv["spec"]["mountOptions"][1], "nconnect=8");
    assert_eq!(
        pv["spec"]["claimRef"],
        json!({"namespace": "ml", "name": names.claim})
    );
    assert!(
        pv["metadata"]["ownerReferences"].is_null(),
        "a PV cannot be owned by a namespaced object"
    );

    let pvc = value(&build::claim(&stage).unwrap());
    assert_eq!(pvc["metadata"]["name"], "imagenet-data");
    assert_eq!(pvc["spec"]["volumeName"], names.volume);
    assert_eq!(pvc["spec"]["storageClassName"], "");
    assert_eq!(pvc["metadata"]["ownerReferences"][0]["kind"], "DataStage");

    let job = value(&build::job(&stage, &inputs()));
    let pod = &job["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    assert_eq!(c["image"], "example.azurecr.io/ringmaster:test");
    assert_eq!(c["args"][0], "stage");
    assert_eq!(
        c["volumeMounts"],
        json!([{"name": "data", "mountPath": "/data"}])
    );
    assert!(c["volumeMounts"][0]["readOnly"].is_null());
    assert_eq!(
        pod["volumes"][0]["persistentVolumeClaim"]["claimName"],
        "imagenet-data"
    );
    assert_eq!(
        env(c, "RINGMASTER_STAGE_DESTINATION")["value"],
        "/data/imagenet"
    );
    assert_eq!(env(c, "RINGMASTER_STAGE_PREFIX")["value"], "ILSVRC2012/");
    assert_eq!(
        env(c, "RINGMASTER_STAGE_ENDPOINT")["value"],
        "https://mydatasets.blob.core.windows.net"
    );
    assert_eq!(env(c, "RINGMASTER_STAGE_PARALLELISM")["value"], "32");
    assert_eq!(env(c, "RINGMASTER_DATASTAGE")["value"], "ml/imagenet");
    assert_eq!(
        env(c, "AZURE_STORAGE_SAS_TOKEN")["valueFrom"]["secretKeyRef"],
        json!({"name": "imagenet-sas", "key": "sasToken"})
    );
    assert!(env(c, "AZURE_STORAGE_ACCOUNT_KEY").is_null());
    assert_eq!(pod["serviceAccountName"], names.stager);
    assert_eq!(pod["restartPolicy"], "Never");
    assert_eq!(job["spec"]["backoffLimit"], 3);
    // Never two stagers of one Job at once: a replacement only once the last pod stopped.
    assert_eq!(job["spec"]["podReplacementPolicy"], "Failed");
    // A copy that hangs ends, two days on by default.
    assert_eq!(job["spec"]["activeDeadlineSeconds"], 172800);
    assert_eq!(env(c, "RINGMASTER_STAGE_MIRROR")["value"], "false");
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
}

#[test]
fn the_stager_may_patch_only_its_own_datastage_status() {
    let stage = imagenet();
    let role = value(&build::role(&stage));
    assert_eq!(
        role["rules"],
        json!([{
            "apiGroups": ["ringmaster.dev"],
            "resources": ["datastages/status"],
            "resourceNames": ["imagenet"],
            "verbs": ["get", "patch"],
        }])
    );
    let binding = value(&build::role_binding(&stage));
    assert_eq!(binding["subjects"][0]["name"], Names::of(&stage).stager);
    assert_eq!(binding["roleRef"]["name"], Names::of(&stage).stager);
    assert!(build::service_account(&stage).is_some());
}

#[test]
fn azure_files_nfs_uses_the_csi_driver() {
    let stage = sample("datastage-imagenet-azure-sas.yaml", |o| {
        o["spec"]["destination"] = json!({"azureFileNfs": {"storageAccount": "premiumfiles", "shareName": "datasets", "resourceGroup": "rg-ml"}});
    });
    let pv = value(&build::volume(&stage).unwrap());
    let csi = &pv["spec"]["csi"];
    assert_eq!(csi["driver"], "file.csi.azure.com");
    assert_eq!(csi["volumeAttributes"]["protocol"], "nfs");
    assert_eq!(csi["volumeAttributes"]["shareName"], "datasets");
    assert_eq!(csi["volumeAttributes"]["resourceGroup"], "rg-ml");
    assert!(
        csi["volumeHandle"]
            .as_str()
            .unwrap()
            .starts_with("rg-ml#premiumfiles#datasets#")
    );
    assert!(pv["spec"]["nfs"].is_null());
}

#[test]
fn an_existing_claim_gets_no_volume_and_is_mounted_as_is() {
    let stage = sample("datastage-azurite.yaml", |_| {});
    assert!(build::volume(&stage).is_none() && build::claim(&stage).is_none());
    let job = value(&build::job(&stage, &inputs()));
    let c = &job["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(
        job["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"],
        "tiny-images"
    );
    assert_eq!(
        env(c, "AZURE_STORAGE_ACCOUNT_KEY")["valueFrom"]["secretKeyRef"]["name"],
        "azurite-account-key"
    );
    assert_eq!(env(c, "RINGMASTER_STAGE_AUTH")["value"], "account-key");
}

#[test]
fn workload_identity_runs_as_the_users_service_account() {
    let stage = sample("datastage-imagenet-azure-sas.yaml", |o| {
        o["spec"]["source"]["azureBlob"]["auth"] =
            json!({"workloadIdentity": {"serviceAccountName": "blob-reader"}});
    });
    assert!(build::service_account(&stage).is_none());
    let job = value(&build::job(&stage, &inputs()));
    let template = &job["spec"]["template"];
    assert_eq!(template["spec"]["serviceAccountName"], "blob-reader");
    assert_eq!(
        template["metadata"]["labels"]["azure.workload.identity/use"],
        "true"
    );
    assert_eq!(
        value(&build::role_binding(&stage))["subjects"][0]["name"],
        "blob-reader"
    );
}

/// The stager runs as the operator image's non-root user with no capability, no privilege
/// escalation and the runtime's seccomp profile, a claim its only volume: its pod meets the
/// Pod Security Standard `restricted`, whatever the destination or the credentials, so a
/// DataStage runs in a namespace that enforces it.
#[test]
fn the_stager_pod_meets_the_restricted_pod_security_standard() {
    let stages = [
        imagenet(),
        sample("datastage-azurite.yaml", |_| {}),
        sample("datastage-imagenet-azure-sas.yaml", |o| {
            o["spec"]["destination"] = json!({"azureFileNfs": {"storageAccount": "premiumfiles", "shareName": "datasets"}});
            o["spec"]["source"]["azureBlob"]["auth"] =
                json!({"workloadIdentity": {"serviceAccountName": "blob-reader"}});
        }),
    ];
    for stage in stages {
        let job = build::job(&stage, &inputs());
        let pod = job.spec.unwrap().template.spec.unwrap();
        assert_eq!(
            pod_security::violations(&pod, pod_security::Level::Restricted),
            Vec::<String>::new(),
            "{}",
            stage.name
        );
        let security = value(&pod.security_context);
        assert_eq!(
            (&security["runAsNonRoot"], &security["runAsUser"]),
            (&json!(true), &json!(65532))
        );
        assert_eq!(
            value(&pod.containers[0].security_context),
            json!({"allowPrivilegeEscalation": false, "readOnlyRootFilesystem": true, "capabilities": {"drop": ["ALL"]}})
        );
    }
}

fn condition<'a>(status: &'a Value, type_: &str) -> &'a Value {
    status["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == type_)
        .unwrap_or_else(|| panic!("no {type_} in {status:#}"))
}

#[test]
fn phases_follow_the_claim_and_the_job_and_keep_the_stagers_progress() {
    let now = Time(Timestamp::from_second(1_800_000_000).unwrap());
    let old = DataStageStatus {
        progress: Some(ringmaster::api::Progress {
            files_done: 7,
            ..Default::default()
        }),
        ..Default::default()
    };
    let step = |old: &DataStageStatus, claim: ClaimState, copy: CopyState| {
        status::observed(old, Some(1), "imagenet-data", &claim, &copy, &now)
    };
    let binding = step(
        &old,
        ClaimState::Unbound("Pending".into()),
        CopyState::NotStarted,
    );
    assert_eq!(binding.phase, DataStagePhase::Binding);
    assert_eq!(binding.progress.as_ref().unwrap().files_done, 7);
    let v = value(&binding);
    assert_eq!(condition(&v, "VolumeBound")["status"], "False");
    assert_eq!(condition(&v, "Reconciling")["status"], "True");

    let missing = step(&old, ClaimState::Missing, CopyState::NotStarted);
    assert_eq!(missing.phase, DataStagePhase::Pending);
    assert_eq!(
        condition(&value(&missing), "VolumeBound")["reason"],
        "ClaimNotFound"
    );

    let copying = step(
        &binding,
        ClaimState::Bound,
        CopyState::Running {
            start: Some(now.clone()),
            recheck: None,
        },
    );
    assert_eq!(copying.phase, DataStagePhase::Copying);
    assert_eq!(copying.start_time, Some(now.clone()));

    let ready = step(
        &copying,
        ClaimState::Bound,
        CopyState::Succeeded {
            start: None,
            completion: Some(now.clone()),
        },
    );
    assert_eq!(ready.phase, DataStagePhase::Ready);
    assert_eq!(ready.claim_name.as_deref(), Some("imagenet-data"));
    assert_eq!(ready.start_time, Some(now.clone()), "kept from Copying");
    let v = value(&ready);
    assert_eq!(condition(&v, "Ready")["status"], "True");
    assert_eq!(condition(&v, "Stalled")["status"], "False");

    let failed = step(
        &copying,
        ClaimState::Bound,
        CopyState::Failed {
            reason: status::reasons::COPY_FAILED,
            message: "pod x: listing … credential was refused".into(),
        },
    );
    assert_eq!(failed.phase, DataStagePhase::Failed);
    let v = value(&failed);
    assert_eq!(condition(&v, "Ready")["reason"], "CopyFailed");
    assert!(
        condition(&v, "Ready")["message"]
            .as_str()
            .unwrap()
            .contains("credential was refused")
    );
    assert_eq!(condition(&v, "Stalled")["status"], "True");
}

/// The stager's own parser reads the copy Job's command and environment back into the
/// settings the controller meant (the `ringmaster` binary, run as the Job would run it, with
/// `--print-settings`; secrets replaced by placeholders, since they come from Secrets).
#[test]
fn the_stager_reads_the_copy_jobs_environment_as_the_controller_meant_it() {
    for (file, auth) in [
        ("datastage-imagenet-azure-sas.yaml", "sas-token"),
        ("datastage-azurite.yaml", "account-key"),
    ] {
        let stage = sample(file, |_| {});
        let job = value(&build::job(&stage, &inputs()));
        let container = &job["spec"]["template"]["spec"]["containers"][0];
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_ringmaster"));
        command.env_clear();
        for var in container["env"].as_array().unwrap() {
            let value = var["value"].as_str().unwrap_or("placeholder-from-a-secret");
            command.env(var["name"].as_str().unwrap(), value);
        }
        let args: Vec<&str> = container["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        let out = command
            .args(&args)
            .arg("--print-settings")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{file}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let read: Value = serde_json::from_slice(&out.stdout).unwrap();
        let destination = match &stage.sub_path {
            Some(sub) => format!("/data/{sub}"),
            None => "/data".to_string(),
        };
        assert_eq!(
            read,
            json!({
                "account": stage.account,
                "container": stage.container,
                "prefix": stage.prefix,
                "endpoint": stage.endpoint,
                "destination": destination,
                "parallelism": stage.parallelism,
                "verify": if stage.verify == ringmaster::api::Verification::Size { "size" } else { "md5" },
                "auth": auth,
                "reportTo": format!("ml/{}", stage.name),
                "progress": "log",
                "progressInterval": 2.0,
                "terminationMessage": "/dev/termination-log",
                "attempts": 4,
                "mirror": stage.mirror,
            }),
            "{file}"
        );
    }
}

#[test]
fn the_copy_pod_goes_where_the_spec_places_it() {
    let stage = sample("datastage-azurite.yaml", |o| {
        o["spec"]["nodeSelector"] = json!({"kubernetes.azure.com/mode": "system"});
        o["spec"]["tolerations"] =
            json!([{"key": "CriticalAddonsOnly", "operator": "Exists", "effect": "NoSchedule"}]);
    });
    let job = value(&build::job(&stage, &inputs()));
    let pod = &job["spec"]["template"]["spec"];
    assert_eq!(
        pod["nodeSelector"],
        json!({"kubernetes.azure.com/mode": "system"})
    );
    assert_eq!(
        pod["tolerations"],
        json!([{"key": "CriticalAddonsOnly", "operator": "Exists", "effect": "NoSchedule"}])
    );
    // Without them the pod goes anywhere the scheduler likes.
    let anywhere = value(&build::job(
        &sample("datastage-azurite.yaml", |_| {}),
        &inputs(),
    ));
    assert_eq!(
        anywhere["spec"]["template"]["spec"]["nodeSelector"],
        json!({})
    );
    assert_eq!(
        anywhere["spec"]["template"]["spec"]["tolerations"],
        json!([])
    );
}

/// The spec's resources replace Ringmaster's resource by resource (a memory limit of its
/// own keeps the CPU request), and its pull secrets reach the copy pod; without them the
/// pod has Ringmaster's requests and no pull secret.
#[test]
fn the_copy_pod_takes_the_specs_resources_and_pull_secrets() {
    let stage = sample("datastage-azurite.yaml", |o| {
        o["spec"]["resources"] =
            json!({"requests": {"memory": "2Gi"}, "limits": {"memory": "4Gi", "cpu": "2"}});
        o["spec"]["imagePullSecrets"] = json!([{"name": "registry-creds"}]);
    });
    let job = value(&build::job(&stage, &inputs()));
    let pod = &job["spec"]["template"]["spec"];
    assert_eq!(pod["imagePullSecrets"], json!([{"name": "registry-creds"}]));
    assert_eq!(
        pod["containers"][0]["resources"],
        json!({
            "requests": {"cpu": "500m", "memory": "2Gi"},
            "limits": {"cpu": "2", "memory": "4Gi"},
        })
    );

    let plain = value(&build::job(
        &sample("datastage-azurite.yaml", |_| {}),
        &inputs(),
    ));
    let pod = &plain["spec"]["template"]["spec"];
    assert!(pod.get("imagePullSecrets").is_none(), "{pod}");
    assert_eq!(
        pod["containers"][0]["resources"],
        json!({"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}})
    );
}

/// An object holding one of the DataStage's child names that the DataStage does not control
/// is told apart (its own, an earlier DataStage's of the same name, anybody's), and the
/// status says what holds it: waiting while an earlier DataStage's child is being deleted,
/// stalled with a Warning when the name is someone else's.
#[test]
fn a_child_name_held_by_another_object_is_left_alone_and_said() {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
    use ringmaster::controller::data_stage::apply::not_ours;
    let stage = imagenet();
    let owned_by = |kind: &str, name: &str, uid: &str, controller: bool| ObjectMeta {
        name: Some("imagenet-data".into()),
        owner_references: Some(vec![OwnerReference {
            api_version: "ringmaster.dev/v1alpha1".into(),
            kind: kind.into(),
            name: name.into(),
            uid: uid.into(),
            controller: Some(controller),
            block_owner_deletion: Some(true),
        }]),
        ..ObjectMeta::default()
    };
    let claim = "PersistentVolumeClaim";
    assert_eq!(
        not_ours(
            claim,
            &owned_by("DataStage", "imagenet", &stage.uid, true),
            &stage
        ),
        None
    );
    let earlier = not_ours(
        claim,
        &owned_by("DataStage", "imagenet", "1111", true),
        &stage,
    )
    .expect("an earlier DataStage's claim");
    assert!(earlier.earlier_stage);
    let another = not_ours(
        claim,
        &owned_by("DataStage", "imagenet-2", "2222", true),
        &stage,
    )
    .expect("another DataStage's claim");
    assert!(!another.earlier_stage);
    assert_eq!(another.owner, "DataStage imagenet-2");
    // An owner that is not the controller (a user's object we once added ourselves to does
    // not count either), and no owner at all.
    let user = not_ours(
        claim,
        &owned_by("DataStage", "imagenet", &stage.uid, false),
        &stage,
    )
    .expect("not controlled by the stage");
    assert_eq!(user.owner, "none");
    assert!(!user.earlier_stage);
    assert!(not_ours(claim, &ObjectMeta::default(), &stage).is_some());

    let now = Time(Timestamp::from_second(1_800_000_000).unwrap());
    let step = |claim: ClaimState, copy: CopyState| {
        value(&status::observed(
            &DataStageStatus::default(),
            Some(1),
            "imagenet-data",
            &claim,
            &copy,
            &now,
        ))
    };
    let waiting = step(ClaimState::NotOurs(earlier.clone()), CopyState::NotStarted);
    assert_eq!(waiting["phase"], "Pending");
    for type_ in ["VolumeBound", "Ready"] {
        assert_eq!(condition(&waiting, type_)["reason"], "EarlierStageDeleting");
    }
    assert!(
        condition(&waiting, "Ready")["message"]
            .as_str()
            .unwrap()
            .contains("PersistentVolumeClaim imagenet-data belongs to an earlier DataStage"),
        "{waiting:#}"
    );
    assert_eq!(condition(&waiting, "Reconciling")["status"], "True");
    assert_eq!(condition(&waiting, "Stalled")["status"], "False");

    let job = ringmaster::controller::data_stage::status::NotOurs {
        kind: "Job",
        name: "imagenet-stage".into(),
        ..another
    };
    let clash = step(ClaimState::Bound, CopyState::NotOurs(job.clone()));
    // Both held: the claim is said first (the copy needs it).
    let both = step(
        ClaimState::NotOurs(earlier.clone()),
        CopyState::NotOurs(job),
    );
    assert!(
        condition(&both, "Ready")["message"]
            .as_str()
            .unwrap()
            .starts_with("PersistentVolumeClaim imagenet-data"),
        "{both:#}"
    );
    assert_eq!(clash["phase"], "Pending");
    let ready = condition(&clash, "Ready");
    assert_eq!(ready["reason"], "NameInUse");
    let message = ready["message"].as_str().unwrap();
    assert!(
        message.contains("Job imagenet-stage exists and is not this DataStage's (its controller: DataStage imagenet-2)"),
        "{message}"
    );
    assert_eq!(condition(&clash, "Stalled")["status"], "True");
    let copied: k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition =
        serde_json::from_value(condition(&clash, "Copied").clone()).unwrap();
    assert!(ringmaster::controller::data_stage::is_stage_warning(
        &copied
    ));
    let waits: k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition =
        serde_json::from_value(condition(&waiting, "VolumeBound").clone()).unwrap();
    assert!(!ringmaster::controller::data_stage::is_stage_warning(
        &waits
    ));
    // Someone else's claim: one Warning (VolumeBound's); Copied just waits for the claim.
    let taken = step(ClaimState::NotOurs(user), CopyState::NotStarted);
    let warnings: Vec<&str> = ["VolumeBound", "Copied", "Ready", "Stalled"]
        .into_iter()
        .filter(|type_| {
            let c: k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition =
                serde_json::from_value(condition(&taken, type_).clone()).unwrap();
            ringmaster::controller::data_stage::is_stage_warning(&c)
        })
        .collect();
    assert_eq!(warnings, ["VolumeBound"], "{taken:#}");
    assert_eq!(condition(&taken, "Copied")["reason"], "Binding");
    assert_eq!(condition(&taken, "Ready")["reason"], "NameInUse");
}

/// Every child's `ringmaster.dev/datastage` label is a valid label value, also for a
/// namespace and name longer than one (the API server refused every child before).
#[test]
fn the_stage_label_fits_a_label_value_for_long_names() {
    let short = imagenet();
    assert_eq!(build::stage_label(&short), "ml.imagenet");
    let long = sample("datastage-imagenet-azure-sas.yaml", |o| {
        o["metadata"]["name"] = json!(format!("imagenet-{}", "x".repeat(60)));
        o["metadata"]["uid"] = json!("9c0ffee1-0000-4000-8000-000000000001");
    });
    let label = build::stage_label(&long);
    assert!(label.len() <= 63, "{label}");
    assert!(label.starts_with("ml.imagenet-xxx"), "{label}");
    assert!(label.ends_with("-9c0ff"), "{label}");
    // A label value: letters, digits, '-', '_', '.', beginning and ending with a letter or digit.
    let edges = [label.chars().next().unwrap(), label.chars().last().unwrap()];
    assert!(edges.iter().all(char::is_ascii_alphanumeric), "{label}");
    assert!(
        label
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)),
        "{label}"
    );
    let job = value(&build::job(&long, &inputs()));
    assert_eq!(job["metadata"]["labels"]["ringmaster.dev/datastage"], label);
}

/// A copy Job's pod that cannot start (its volume cannot be mounted, its image cannot be
/// pulled, no node takes it) fails the DataStage once `spec.startTimeoutSeconds` (600 s by
/// default) have passed since it was made, with the cause: the kubelet's reason from the
/// pod, a failed mount from the pod's Events (the pod's status shows only
/// ContainerCreating). Before that, the controller looks again when the timeout is due.
#[test]
fn a_copy_pod_that_cannot_start_fails_the_stage_after_its_start_timeout_with_the_cause() {
    use k8s_openapi::api::core::v1::{Event, Pod};
    use ringmaster::controller::data_stage::start::{self, CopyPod, StartCheck};
    let stage = imagenet();
    assert_eq!(stage.start_timeout_seconds, 600);
    let made = 1_800_000_000;
    let at = |s: i64| Time(Timestamp::from_second(made + s).unwrap());
    let pod = |phase: &str, waiting: Value, conditions: Value| -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "imagenet-stage-x7k2p", "namespace": "ml", "uid": "pod-1",
                         "creationTimestamp": at(0)},
            "status": {"phase": phase, "conditions": conditions, "containerStatuses": [{
                "name": "stage", "image": "ringmaster", "imageID": "", "ready": false,
                "restartCount": 0, "state": {"waiting": waiting}}]}
        }))
        .unwrap()
    };
    let creating = json!({"reason": "ContainerCreating"});
    let mount_event = |uid: &str| -> Event {
        serde_json::from_value(json!({
            "metadata": {"name": "imagenet-stage-x7k2p.1", "namespace": "ml"},
            "involvedObject": {"kind": "Pod", "name": "imagenet-stage-x7k2p", "uid": uid},
            "reason": "FailedMount", "type": "Warning", "lastTimestamp": at(300),
            "message": "MountVolume.SetUp failed for volume \"data\" : hostPath type check failed: /srv/missing is not a directory"
        }))
        .unwrap()
    };
    let check = |pod: &Pod, events: &[Event], seconds: i64| {
        start::check(
            &[CopyPod::of(pod, events)],
            &at(seconds),
            stage.start_timeout_seconds,
        )
    };

    // FailedMount: waiting until the timeout, then the mount's own words.
    let mounting = pod("Pending", creating.clone(), json!([]));
    assert_eq!(
        check(&mounting, &[mount_event("pod-1")], 540),
        StartCheck::Waiting(std::time::Duration::from_secs(60))
    );
    let StartCheck::TimedOut(message) = check(&mounting, &[mount_event("pod-1")], 601) else {
        panic!("a pod stuck mounting past the timeout fails the stage");
    };
    assert!(
        message.contains("spec.startTimeoutSeconds (600 s)")
            && message.contains("FailedMount")
            && message.contains("/srv/missing is not a directory"),
        "{message}"
    );
    // An Event about another pod of that name (an earlier one) is not this pod's cause.
    let StartCheck::TimedOut(message) = check(&mounting, &[mount_event("pod-0")], 601) else {
        panic!("still timed out");
    };
    assert!(
        !message.contains("FailedMount") && message.contains("never got running"),
        "{message}"
    );

    // The kubelet's and the scheduler's reasons, read as the TrainingJob's start timeout reads them.
    let pulling = pod(
        "Pending",
        json!({"reason": "ImagePullBackOff", "message": "Back-off pulling image \"ringmaster:typo\""}),
        json!([]),
    );
    let StartCheck::TimedOut(message) = check(&pulling, &[], 601) else {
        panic!("a pod that cannot pull its image fails the stage");
    };
    assert!(
        message.contains("ImagePullBackOff") && message.contains("ringmaster:typo"),
        "{message}"
    );
    let unschedulable = pod(
        "Pending",
        Value::Null,
        json!([{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                "message": "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector."}]),
    );
    let StartCheck::TimedOut(message) = check(&unschedulable, &[], 601) else {
        panic!("a pod no node takes fails the stage");
    };
    assert!(
        message.contains("cannot be scheduled") && message.contains("0/3 nodes"),
        "{message}"
    );

    // A pod that runs is the copy going on: the activeDeadlineSeconds times it from there.
    let running = pod("Running", Value::Null, json!([]));
    assert_eq!(check(&running, &[], 100_000), StartCheck::NotWaiting);

    // What the DataStage says: Failed, StartTimeout with the cause, Stalled, a Warning.
    let now = at(601);
    let failed = status::observed(
        &DataStageStatus::default(),
        Some(1),
        "imagenet-data",
        &ClaimState::Bound,
        &CopyState::Failed {
            reason: status::reasons::START_TIMEOUT,
            message: message.clone(),
        },
        &now,
    );
    assert_eq!(failed.phase, DataStagePhase::Failed);
    let v = value(&failed);
    assert_eq!(condition(&v, "Ready")["reason"], "StartTimeout");
    assert_eq!(condition(&v, "Ready")["message"], message.as_str());
    assert_eq!(condition(&v, "Stalled")["status"], "True");
    let copied = failed
        .conditions
        .iter()
        .find(|c| c.type_ == "Copied")
        .unwrap();
    assert!(ringmaster::controller::data_stage::is_stage_warning(copied));
}
