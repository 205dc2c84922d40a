//! The TrainingJob build step from the samples: the children's contents.

#[path = "common/mod.rs"]
mod fixtures;
#[path = "support/pod_security.rs"]
mod pod_security;

use k8s_openapi::api::core::v1::Pod;
use pod_security::{Level, violations};
use ringmaster::controller::training_job::build::{self, BuildInputs, RendezvousKey, SshKeys};
use ringmaster::controller::training_job::names::ChildNaming;
use ringmaster::controller::training_job::validate::{
    Program, ValidatedTrainingJob, validate_value,
};
use ringmaster::controller::training_job::worker_dns::{Published, WorkerAddress};
use ringmaster::gang::{GangApi, GangScheduler};
use ringmaster_contract::trainer::{Capabilities, TrainArgs};
use serde_json::{Value, json};

fn sample(file: &str, edit: impl FnOnce(&mut Value)) -> ValidatedTrainingJob {
    let path = fixtures::root().join("config/samples").join(file);
    let mut object = fixtures::ringmaster_objects(&path).remove(0);
    object["metadata"]["namespace"] = json!("ml");
    object["metadata"]["uid"] = json!("6f1c2d3e-0000-4000-8000-00000000abcd");
    edit(&mut object);
    validate_value(&object, None).unwrap_or_else(|e| panic!("{file}: {e}"))
}

fn gpu_job() -> ValidatedTrainingJob {
    sample("trainingjob-resnet50-nd96asr-v4.yaml", |o| {
        o["spec"]["nodePool"] = json!({"provisioner": "existing", "nodeSelector": {"kubernetes.azure.com/agentpool": "gpu"}});
    })
}

fn inputs() -> BuildInputs {
    BuildInputs {
        attempt: 2,
        data_claim: Some("imagenet-data".into()),
        ..BuildInputs::default()
    }
}

fn value<T: serde::Serialize>(v: &T) -> Value {
    serde_json::to_value(v).unwrap()
}

#[test]
fn gpu_worker_pods_get_gpus_rdma_shared_memory_data_and_ssh() {
    let job = gpu_job();
    let pod = value(&build::worker_pod(&job, 1, &inputs()));
    assert_eq!(pod["metadata"]["name"], "resnet50-imagenet-worker-1");
    assert_eq!(pod["metadata"]["namespace"], "ml");
    assert_eq!(pod["metadata"]["labels"]["ringmaster.dev/attempt"], "2");
    assert_eq!(
        pod["metadata"]["labels"]["ringmaster.dev/worker-index"],
        "1"
    );
    let owner = &pod["metadata"]["ownerReferences"][0];
    assert_eq!(
        (owner["kind"].as_str(), owner["controller"].as_bool()),
        (Some("TrainingJob"), Some(true))
    );
    assert_eq!(owner["uid"], "6f1c2d3e-0000-4000-8000-00000000abcd");

    let spec = &pod["spec"];
    assert_eq!(spec["hostname"], "resnet50-imagenet-worker-1");
    assert_eq!(spec["subdomain"], "resnet50-imagenet-workers-6f1c2");
    assert_eq!(spec["restartPolicy"], "Never");
    assert_eq!(
        spec["nodeSelector"]["kubernetes.azure.com/agentpool"],
        "gpu"
    );
    let c = &spec["containers"][0];
    assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"], "8");
    assert_eq!(c["resources"]["limits"]["rdma/shared_ib"], "1");
    assert_eq!(
        c["securityContext"]["capabilities"]["add"],
        json!(["IPC_LOCK"])
    );
    assert!(
        c["command"].as_array().unwrap().iter().any(|a| a == "2222"),
        "{}",
        c["command"]
    );

    let volumes = spec["volumes"].as_array().unwrap();
    let volume = |name: &str| {
        volumes
            .iter()
            .find(|v| v["name"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("no volume {name}"))
    };
    assert_eq!(
        volume("ssh-secret")["secret"],
        json!({"secretName": "resnet50-imagenet-ssh-6f1c2", "defaultMode": 0o600})
    );
    // The container's own user copies the key out of the Secret (root-owned, made
    // group-readable by fsGroup) into memory, mode 0600, before sshd starts.
    assert_eq!(
        volume("ssh")["emptyDir"],
        json!({"medium": "Memory", "sizeLimit": "1Mi"})
    );
    let command: Vec<&str> = c["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(&command[..2], ["sh", "-c"]);
    assert_eq!(
        command[2],
        "umask 077 && cp /etc/ringmaster/ssh-secret/ssh-privatekey /etc/ringmaster/ssh-secret/authorized_keys /etc/ringmaster/ssh/ && { printf '* ' && cat /etc/ringmaster/ssh-secret/ssh-publickey && echo; } > /etc/ringmaster/ssh/known_hosts && exec \"$@\""
    );
    assert_eq!(&command[3..5], ["sh", "sh"]);
    assert_eq!(&command[7..9], ["ringmaster-sshd", "-D"]);
    assert!(command.contains(&"StrictModes=no"), "{command:?}");
    assert!(
        command.contains(&"AuthorizedKeysFile=/etc/ringmaster/ssh/authorized_keys"),
        "{command:?}"
    );
    assert_eq!(
        volume("dshm")["emptyDir"],
        json!({"medium": "Memory", "sizeLimit": "64Gi"})
    );
    assert_eq!(
        volume("data")["persistentVolumeClaim"],
        json!({"claimName": "imagenet-data", "readOnly": true})
    );
    assert_eq!(
        volume("output")["persistentVolumeClaim"]["claimName"],
        "training-output"
    );
    let mounts = c["volumeMounts"].as_array().unwrap();
    let mount = |name: &str| mounts.iter().find(|m| m["name"] == name).cloned().unwrap();
    assert_eq!(mount("data")["mountPath"], "/data");
    assert_eq!(mount("data")["readOnly"], true);
    assert_eq!(mount("dshm")["mountPath"], "/dev/shm");
    assert_eq!(
        mount("ssh-secret")["mountPath"],
        "/etc/ringmaster/ssh-secret"
    );
    assert_eq!(mount("ssh-secret")["readOnly"], true);
    assert_eq!(mount("ssh")["mountPath"], "/etc/ringmaster/ssh");

    // Ready means: ssh with the job's key to the worker's DNS name works.
    let probe = c["readinessProbe"]["exec"]["command"][2].as_str().unwrap();
    assert!(
        probe.starts_with("ssh -p 2222 -i /etc/ringmaster/ssh/ssh-privatekey"),
        "{probe}"
    );
    assert!(
        probe.ends_with("resnet50-imagenet-worker-1.resnet50-imagenet-workers-6f1c2.ml.svc true"),
        "{probe}"
    );
    assert_eq!(spec["securityContext"]["fsGroup"], build::POD_FS_GROUP);
}

/// A job made again under its name gets a Secret and Service of its own (the UID in their
/// names); a gang whose workers an older operator made (no job-uid label) keeps the names its
/// workers use, for its launcher and any worker still to be made.
#[test]
fn a_gang_names_its_secret_and_service_by_the_job_uid_unless_older_workers_use_plain_names() {
    use ringmaster::controller::training_job::names::JOB_UID_LABEL;
    let job = gpu_job();
    let made_now = build::worker_pod(&job, 0, &inputs());
    assert_eq!(
        made_now.metadata.labels.as_ref().unwrap()[JOB_UID_LABEL],
        "6f1c2d3e-0000-4000-8000-00000000abcd"
    );
    let mut made_before = made_now.clone();
    made_before
        .metadata
        .labels
        .as_mut()
        .unwrap()
        .remove(JOB_UID_LABEL);
    // Attempt 2 (inputs()) is the gang's; a pod of attempt 1 without the label is another gang's.
    let mut earlier_gang = made_before.clone();
    earlier_gang
        .metadata
        .labels
        .as_mut()
        .unwrap()
        .insert("ringmaster.dev/attempt".into(), "1".into());
    assert_eq!(ChildNaming::of_gang([], 2), ChildNaming::UidTagged);
    assert_eq!(
        ChildNaming::of_gang([&made_now, &earlier_gang], 2),
        ChildNaming::UidTagged
    );
    assert_eq!(
        ChildNaming::of_gang([&made_now, &made_before], 2),
        ChildNaming::Untagged
    );

    let untagged = BuildInputs {
        naming: ChildNaming::Untagged,
        ..inputs()
    };
    let launcher = value(&build::launcher_pod(&job, &untagged));
    assert_eq!(
        launcher["metadata"]["annotations"]["ringmaster.dev/hostfile"],
        "resnet50-imagenet-worker-0.resnet50-imagenet-workers.ml.svc slots=8\n\
         resnet50-imagenet-worker-1.resnet50-imagenet-workers.ml.svc slots=8\n"
    );
    let secret_of = |pod: &Value| {
        pod["spec"]["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == "ssh-secret")
            .unwrap()["secret"]["secretName"]
            .clone()
    };
    assert_eq!(secret_of(&launcher), "resnet50-imagenet-ssh");
    let env = &launcher["spec"]["containers"][0]["env"];
    assert!(
        env.as_array().unwrap().contains(&json!({"name": "RINGMASTER_RENDEZVOUS", "value": "resnet50-imagenet-worker-0.resnet50-imagenet-workers.ml.svc:29500"})),
        "{env}"
    );
    let worker = value(&build::worker_pod(&job, 1, &untagged));
    assert_eq!(worker["spec"]["subdomain"], "resnet50-imagenet-workers");
    assert_eq!(secret_of(&worker), "resnet50-imagenet-ssh");
    // Without the label too: the gang stays untagged, whichever of its pods are made again.
    assert!(
        worker["metadata"]["labels"].get(JOB_UID_LABEL).is_none(),
        "{}",
        worker["metadata"]["labels"]
    );
    let worker_made_again = build::worker_pod(&job, 1, &untagged);
    assert_eq!(
        ChildNaming::of_gang([&worker_made_again], 2),
        ChildNaming::Untagged
    );
    let service = value(&build::worker_service(&job, ChildNaming::Untagged));
    assert_eq!(service["metadata"]["name"], "resnet50-imagenet-workers");
    let slice = value(&build::worker_endpoints(&job, ChildNaming::Untagged, &[]));
    assert_eq!(slice["metadata"]["name"], "resnet50-imagenet-workers");
    assert_eq!(
        slice["metadata"]["labels"]["kubernetes.io/service-name"],
        "resnet50-imagenet-workers"
    );
    let keys = SshKeys::from_seed(&[7u8; 32], "x");
    assert_eq!(
        value(&build::ssh_secret(
            &job,
            ChildNaming::Untagged,
            &keys,
            &RendezvousKey([1; 32])
        ))["metadata"]["name"],
        "resnet50-imagenet-ssh"
    );
}

#[test]
fn cpu_workers_ask_for_no_gpus() {
    let job = sample("trainingjob-cpu-small.yaml", |_| {});
    let pod = value(&build::worker_pod(&job, 0, &BuildInputs::default()));
    let c = &pod["spec"]["containers"][0];
    assert!(
        c["resources"]["limits"].get("nvidia.com/gpu").is_none(),
        "{}",
        c["resources"]
    );
    assert_eq!(
        c["resources"]["requests"]["cpu"], "1",
        "the user's resources are kept"
    );
    assert_eq!(
        c["securityContext"]["capabilities"],
        json!({"drop": ["ALL"]}),
        "no capability added, every one dropped"
    );
    assert!(
        pod["spec"]["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .all(|v| v["name"] != "dshm")
    );
}

#[test]
fn hostfiles_follow_the_mpi_implementation() {
    let job = gpu_job();
    assert_eq!(
        build::hostfile(&job, ChildNaming::UidTagged),
        "resnet50-imagenet-worker-0.resnet50-imagenet-workers-6f1c2.ml.svc slots=8\n\
         resnet50-imagenet-worker-1.resnet50-imagenet-workers-6f1c2.ml.svc slots=8\n"
    );
    for implementation in ["IntelMPI", "MPICH"] {
        let job = sample("trainingjob-cpu-small.yaml", |o| {
            o["spec"]["mpi"] = json!({"implementation": implementation})
        });
        assert_eq!(
            build::hostfile(&job, ChildNaming::UidTagged),
            "resnet18-cpu-worker-0.resnet18-cpu-workers-6f1c2.ml.svc:2\nresnet18-cpu-worker-1.resnet18-cpu-workers-6f1c2.ml.svc:2\n"
        );
    }
}

#[test]
fn the_launcher_runs_mpirun_over_every_rank_with_the_trainer() {
    let job = gpu_job();
    let command = build::launcher_command(&job);
    let text = command.join(" ");
    assert_eq!(
        &command[..5],
        [
            "ringmaster-trainer",
            "launch",
            "--termination-message",
            "/dev/termination-log",
            "--"
        ]
    );
    assert!(
        text.contains("mpirun --hostfile /etc/ringmaster/mpi/hostfile -np 16 "),
        "{text}"
    );
    assert!(
        text.contains("-p 2222 -i /etc/ringmaster/ssh/ssh-privatekey"),
        "{text}"
    );
    assert!(
        text.contains("-x NCCL_IB_DISABLE") && text.contains("-x RINGMASTER_RENDEZVOUS"),
        "{text}"
    );
    // Every rank knows the job's UID: the trainer resumes only from this job's checkpoints.
    assert!(text.contains("-x RINGMASTER_JOB_UID"), "{text}");
    let env = &value(&build::launcher_pod(&job, &inputs()))["spec"]["containers"][0]["env"];
    assert!(
        env.as_array()
            .unwrap()
            .contains(&json!({"name": ringmaster_contract::trainer::RUN_ID_ENV, "value": job.uid})),
        "{env}"
    );
    // Hostfile names are pod.service.namespace.svc; Open MPI would cut them to the pod name.
    assert!(text.contains("--mca orte_keep_fqdn_hostnames 1"), "{text}");
    let train = command
        .iter()
        .position(|a| a == "train")
        .expect("trainer subcommand");
    assert_eq!(command[train - 1], "ringmaster-trainer");
    let args = &command[train..];
    for expected in [
        "--model=resnet50",
        "--device=cuda",
        "--batch-size=256",
        "--epochs=90",
        "--precision=bf16",
        "--data-dir=/data/imagenet",
        "--output-dir=/output/resnet50-imagenet",
    ] {
        assert!(
            args.iter().any(|a| a == expected),
            "{expected} missing from {args:?}"
        );
    }

    let pod = value(&build::launcher_pod(&job, &inputs()));
    // The pod runs that command once its user has its own copy of the key.
    let pod_command = pod["spec"]["containers"][0]["command"].as_array().unwrap();
    assert!(
        pod_command[2]
            .as_str()
            .unwrap()
            .starts_with("umask 077 && cp /etc/ringmaster/ssh-secret/ssh-privatekey"),
        "{pod_command:?}"
    );
    assert_eq!(
        &pod_command[4..],
        &command.iter().map(|a| json!(a)).collect::<Vec<_>>()[..]
    );
    let env = pod["spec"]["containers"][0]["env"]
        .as_array()
        .unwrap()
        .clone();
    let var = |name: &str| {
        env.iter()
            .find(|e| e["name"] == name)
            .map(|e| e["value"].clone())
    };
    assert_eq!(
        var("RINGMASTER_RENDEZVOUS"),
        Some(json!(
            "resnet50-imagenet-worker-0.resnet50-imagenet-workers-6f1c2.ml.svc:29500"
        ))
    );
    assert_eq!(var("NCCL_SOCKET_IFNAME"), Some(json!("eth0")));
    assert_eq!(pod["metadata"]["labels"]["ringmaster.dev/role"], "launcher");
    assert!(
        pod["spec"]["containers"][0]["resources"]
            .get("limits")
            .is_none_or(|l| l.get("nvidia.com/gpu").is_none())
    );
}

/// The variables PyTorch DDP and Horovod read, as each rank of the user's program gets them:
/// the launcher's command is run by `sh` with each MPI's own variables, as mpirun gives them.
#[test]
fn a_users_program_gets_the_ranks_framework_environment_from_any_mpi() {
    let job = sample("trainingjob-cpu-small.yaml", |o| {
        o["spec"].as_object_mut().unwrap().remove("trainer");
        o["spec"]["command"] = json!(["python", "train.py"]);
    });
    let command = build::launcher_command(&job);
    let at = command
        .iter()
        .position(|a| a == "ringmaster-rank")
        .expect("the ranks' wrapper")
        - 3;
    assert_eq!(
        &command[at + 3..],
        ["ringmaster-rank", "python", "train.py"]
    );
    let launcher = value(&build::launcher_pod(&job, &BuildInputs::default()));
    let env = launcher["spec"]["containers"][0]["env"].as_array().unwrap();
    let master = env
        .iter()
        .find(|e| e["name"] == "MASTER_ADDR")
        .expect("MASTER_ADDR");
    assert!(
        master["value"]
            .as_str()
            .unwrap()
            .starts_with("resnet18-cpu-worker-0."),
        "{master}"
    );
    assert!(
        env.iter()
            .any(|e| e["name"] == "MASTER_PORT" && e["value"] == "29500")
    );
    let open_mpi = [
        ("OMPI_COMM_WORLD_RANK", "3"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
    ];
    let hydra = [
        ("PMI_RANK", "2"),
        ("PMI_SIZE", "4"),
        ("MPI_LOCALRANKID", "0"),
        ("MPI_LOCALNRANKS", "2"),
    ];
    let users_own = [("OMPI_COMM_WORLD_RANK", "3"), ("RANK", "7")];
    let cases: [(&[(&str, &str)], &str); 3] = [
        (&open_mpi, "3 4 1 2"),
        (&hydra, "2 4 0 2"),
        (&users_own, "7 1 0 1"),
    ];
    for (mpi_env, want) in cases {
        let out = std::process::Command::new("/bin/sh")
            .args(&command[at + 1..at + 4])
            .args([
                "sh",
                "-c",
                "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE",
            ])
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .envs(mpi_env.iter().copied())
            .output()
            .expect("sh runs");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            want,
            "{mpi_env:?}"
        );
    }
    // The built-in trainer finds its ranks itself: no wrapper, no MASTER_ADDR.
    let trainer = sample("trainingjob-cpu-small.yaml", |_| {});
    assert!(!build::launcher_command(&trainer).contains(&"ringmaster-rank".to_string()));
}

#[test]
fn mpich_and_a_users_command() {
    let job = sample("trainingjob-cpu-small.yaml", |o| {
        o["spec"]["mpi"] = json!({"implementation": "MPICH", "sshPort": 3022});
        o["spec"].as_object_mut().unwrap().remove("trainer");
        o["spec"]["command"] = json!(["python", "train.py", "--epochs", "1"]);
    });
    let command = build::launcher_command(&job);
    // `ringmaster-trainer launch` when the image has it, Hydra either way.
    assert_eq!(command[3], "ringmaster-launcher");
    let command = &command[4..];
    assert_eq!(
        &command[..5],
        [
            "mpiexec.hydra",
            "-f",
            "/etc/ringmaster/mpi/hostfile",
            "-n",
            "4"
        ]
    );
    assert_eq!(
        &command[command.len() - 4..],
        ["python", "train.py", "--epochs", "1"]
    );
    // Hydra runs a program, not a command line: the ConfigMap's ssh program has the options.
    // Hydra's proxies call back to the launcher at its pod IP (its host name resolves nowhere).
    assert_eq!(&command[5..7], ["-localhost", "$(RINGMASTER_LAUNCHER_IP)"]);
    let launcher = value(&build::launcher_pod(&job, &BuildInputs::default()));
    let env = launcher["spec"]["containers"][0]["env"].as_array().unwrap();
    assert!(
        env.contains(&json!({"name": "RINGMASTER_LAUNCHER_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})),
        "{env:?}"
    );
    let exec = command.iter().position(|a| a == "-launcher-exec").unwrap();
    assert_eq!(command[exec + 1], "/etc/ringmaster/mpi/ssh");
    let program = launcher["metadata"]["annotations"]["ringmaster.dev/ssh-program"]
        .as_str()
        .unwrap();
    assert!(program.starts_with("#!/bin/sh\n"), "{program}");
    assert!(
        program.contains("exec ssh -p 3022 -i /etc/ringmaster/ssh/ssh-privatekey ")
            && program.ends_with(" \"$@\"\n"),
        "{program}"
    );
}

#[test]
fn a_privileged_ssh_port_is_opened_to_the_image_user_in_the_pods_own_network() {
    let worker_security = |port: Option<i32>| {
        let job = sample("trainingjob-cpu-small.yaml", |o| {
            if let Some(port) = port {
                o["spec"]["mpi"] = json!({"sshPort": port});
            }
        });
        let pod = value(&build::worker_pod(&job, 0, &inputs()));
        let command = pod["spec"]["containers"][0]["command"].to_string();
        let port = job.mpi.ssh_port.to_string();
        assert!(command.contains(&format!(r#""-p","{port}""#)), "{command}");
        pod["spec"]["securityContext"].clone()
    };
    let defaults = json!({"fsGroup": 1000, "runAsNonRoot": true, "seccompProfile": {"type": "RuntimeDefault"}});
    let sysctl = |port: &str| {
        let mut security = defaults.clone();
        security["sysctls"] =
            json!([{"name": "net.ipv4.ip_unprivileged_port_start", "value": port}]);
        security
    };
    assert_eq!(worker_security(Some(22)), sysctl("22"));
    assert_eq!(worker_security(Some(1023)), sysctl("1023"));
    // Ports that need no root are left as they are, the default among them.
    assert_eq!(worker_security(Some(1024)), defaults);
    assert_eq!(worker_security(None), defaults);
}

/// The pods as typed objects, for the Pod Security checks.
fn pods(job: &ValidatedTrainingJob) -> [(&'static str, Pod); 2] {
    [
        ("worker", build::worker_pod(job, 0, &inputs())),
        ("launcher", build::launcher_pod(job, &inputs())),
    ]
}

/// The Pod Security Standards as the API server's PodSecurity admission applies them: a CPU
/// or GPU job's pods meet `restricted` (a privileged SSH port included: its sysctl is a safe
/// one), so they run in a namespace labelled `pod-security.kubernetes.io/enforce=restricted`.
/// InfiniBand workers add IPC_LOCK, which neither `restricted` nor `baseline` allows: that
/// capability is all they break, so they need the `privileged` level (or an exemption);
/// their launcher still meets `restricted`.
#[test]
fn training_pods_meet_restricted_but_infiniband_workers_whose_ipc_lock_needs_privileged() {
    let cpu = sample("trainingjob-cpu-small.yaml", |_| {});
    let cpu_port_22 = sample("trainingjob-cpu-small.yaml", |o| {
        o["spec"]["mpi"] = json!({"sshPort": 22, "implementation": "MPICH"});
    });
    let gpu_without_infiniband = sample("trainingjob-resnet50-nd96asr-v4.yaml", |o| {
        o["spec"]["infiniband"]["enabled"] = json!(false);
    });
    for job in [&cpu, &cpu_port_22, &gpu_without_infiniband] {
        for (role, pod) in pods(job) {
            let spec = pod.spec.unwrap();
            assert_eq!(
                violations(&spec, Level::Restricted),
                Vec::<String>::new(),
                "{} {role}",
                job.name
            );
        }
    }

    let infiniband = gpu_job();
    let [(_, worker), (_, launcher)] = pods(&infiniband);
    let worker = worker.spec.unwrap();
    let ipc_lock = "non-default capabilities (container \"worker\" must not include \"IPC_LOCK\" in securityContext.capabilities.add)";
    assert_eq!(violations(&worker, Level::Baseline), [ipc_lock]);
    let restricted = violations(&worker, Level::Restricted);
    assert!(
        restricted.iter().all(|v| v.contains("IPC_LOCK")),
        "the rest of the worker is restricted: {restricted:?}"
    );
    assert_eq!(
        violations(&launcher.spec.unwrap(), Level::Restricted),
        Vec::<String>::new()
    );
    // Without InfiniBand nothing is added; with it, IPC_LOCK alone, every other dropped.
    let capabilities = |job: &ValidatedTrainingJob| {
        value(&build::worker_pod(job, 0, &inputs()))["spec"]["containers"][0]["securityContext"]
            .clone()
    };
    assert_eq!(
        capabilities(&infiniband),
        json!({"allowPrivilegeEscalation": false, "capabilities": {"add": ["IPC_LOCK"], "drop": ["ALL"]}})
    );
    assert_eq!(
        capabilities(&gpu_without_infiniband),
        json!({"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}})
    );
}

/// The user's `securityContext` and `containerSecurityContext` go over Ringmaster's, field by
/// field: their settings win, the ones they leave alone stay Ringmaster's; their sysctls and
/// added capabilities are added to Ringmaster's.
#[test]
fn security_overrides_win_field_by_field_over_the_defaults() {
    let job = sample("trainingjob-resnet50-nd96asr-v4.yaml", |o| {
        o["spec"]["mpi"] = json!({"sshPort": 22});
        o["spec"]["worker"] = json!({
            "securityContext": {
                "runAsUser": 2000,
                "runAsGroup": 2000,
                "fsGroup": 3000,
                "seccompProfile": {"type": "Localhost", "localhostProfile": "profiles/mpi.json"},
                "sysctls": [{"name": "net.ipv4.tcp_keepalive_time", "value": "600"}],
            },
            "containerSecurityContext": {
                "readOnlyRootFilesystem": true,
                "capabilities": {"add": ["NET_BIND_SERVICE", "IPC_LOCK"]},
            },
        });
        o["spec"]["launcher"] = json!({
            "containerSecurityContext": {"capabilities": {"drop": ["NET_RAW"]}},
        });
    });
    let worker = value(&build::worker_pod(&job, 0, &inputs()));
    assert_eq!(
        worker["spec"]["securityContext"],
        json!({
            "runAsNonRoot": true,
            "runAsUser": 2000,
            "runAsGroup": 2000,
            "fsGroup": 3000,
            "seccompProfile": {"type": "Localhost", "localhostProfile": "profiles/mpi.json"},
            "sysctls": [
                {"name": "net.ipv4.ip_unprivileged_port_start", "value": "22"},
                {"name": "net.ipv4.tcp_keepalive_time", "value": "600"},
            ],
        })
    );
    assert_eq!(
        worker["spec"]["containers"][0]["securityContext"],
        json!({
            "allowPrivilegeEscalation": false,
            "readOnlyRootFilesystem": true,
            "capabilities": {"add": ["IPC_LOCK", "NET_BIND_SERVICE"], "drop": ["ALL"]},
        })
    );
    // A drop list of the user's replaces [ALL]; the launcher's pod keeps the defaults.
    let launcher = value(&build::launcher_pod(&job, &inputs()));
    assert_eq!(
        launcher["spec"]["containers"][0]["securityContext"],
        json!({"allowPrivilegeEscalation": false, "capabilities": {"drop": ["NET_RAW"]}})
    );
    assert_eq!(launcher["spec"]["securityContext"]["runAsNonRoot"], true);
    // A sysctl of Ringmaster's name is the user's.
    let job = sample("trainingjob-cpu-small.yaml", |o| {
        o["spec"]["mpi"] = json!({"sshPort": 22});
        o["spec"]["worker"]["securityContext"] =
            json!({"sysctls": [{"name": "net.ipv4.ip_unprivileged_port_start", "value": "0"}]});
    });
    assert_eq!(
        value(&build::worker_pod(&job, 0, &inputs()))["spec"]["securityContext"]["sysctls"],
        json!([{"name": "net.ipv4.ip_unprivileged_port_start", "value": "0"}])
    );
}

/// An image that runs as root (as many MPI images do) asks for it with `runAsUser: 0`:
/// runAsNonRoot is then left unset, its container keeps the runtime's default capabilities
/// (a root sshd's privilege separation needs SETUID, SETGID and SYS_CHROOT), and Open MPI's
/// `mpirun` gets its consent to run as root, which a non-root launcher never gets. Such pods
/// meet `baseline`, not `restricted`.
#[test]
fn a_root_image_asks_for_uid_0_and_only_then_gets_open_mpis_consent() {
    let omp_root_env = |pod: &Value| -> Vec<String> {
        pod["spec"]["containers"][0]["env"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|e| e["name"].as_str())
            .filter(|n| n.starts_with("OMPI_ALLOW_RUN_AS_ROOT"))
            .map(String::from)
            .collect()
    };
    let job = sample("trainingjob-cpu-small.yaml", |_| {});
    assert_eq!(
        omp_root_env(&value(&build::launcher_pod(&job, &inputs()))),
        Vec::<String>::new(),
        "a non-root launcher"
    );
    for (as_root, where_) in [
        (json!({"securityContext": {"runAsUser": 0}}), "the pod"),
        (
            json!({"containerSecurityContext": {"runAsUser": 0}}),
            "the container",
        ),
        (
            json!({"securityContext": {"runAsNonRoot": false}}),
            "the image's user",
        ),
    ] {
        let job = sample("trainingjob-cpu-small.yaml", |o| {
            for role in ["worker", "launcher"] {
                let overrides = o["spec"][role]
                    .as_object_mut()
                    .map(|o| o.clone())
                    .unwrap_or_default();
                let mut merged = Value::Object(overrides);
                for (k, v) in as_root.as_object().unwrap() {
                    merged[k] = v.clone();
                }
                o["spec"][role] = merged;
            }
        });
        let launcher = value(&build::launcher_pod(&job, &inputs()));
        assert_eq!(
            omp_root_env(&launcher),
            ["OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"],
            "root in {where_}"
        );
        for (role, pod) in pods(&job) {
            let json = value(&pod);
            assert_ne!(
                json["spec"]["securityContext"]["runAsNonRoot"], true,
                "{role}, root in {where_}"
            );
            let container = &json["spec"]["containers"][0]["securityContext"];
            assert_eq!(
                (
                    &container["allowPrivilegeEscalation"],
                    container.get("capabilities")
                ),
                (&json!(false), None),
                "{role}: the runtime's capabilities, root in {where_}"
            );
            let spec = pod.spec.unwrap();
            assert_eq!(
                violations(&spec, Level::Baseline),
                Vec::<String>::new(),
                "{role}"
            );
            assert!(!violations(&spec, Level::Restricted).is_empty(), "{role}");
        }
    }
}

/// A privileged container (the user's choice) is never told not to escalate, which the API
/// server would refuse; the namespace's Pod Security level decides whether it runs.
#[test]
fn a_privileged_override_drops_the_escalation_default_and_breaks_baseline() {
    for container in [
        json!({"privileged": true}),
        json!({"capabilities": {"add": ["SYS_ADMIN"]}}),
    ] {
        let job = sample("trainingjob-cpu-small.yaml", |o| {
            o["spec"]["worker"]["containerSecurityContext"] = container.clone();
        });
        let worker = build::worker_pod(&job, 0, &inputs());
        let json = value(&worker);
        let security = &json["spec"]["containers"][0]["securityContext"];
        assert!(
            security.get("allowPrivilegeEscalation").is_none(),
            "{security}"
        );
        assert!(
            !violations(&worker.spec.unwrap(), Level::Baseline).is_empty(),
            "{container}"
        );
    }
}

#[test]
fn user_overrides_are_merged_without_losing_ringmasters_settings() {
    let job = sample("trainingjob-resnet50-nd96asr-v4.yaml", |o| {
        o["spec"]["worker"] = json!({
            "env": [{"name": "WANDB_PROJECT", "value": "resnet"}],
            "labels": {"team": "vision"},
            "tolerations": [{"key": "sku", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}],
            "resources": {"limits": {"memory": "800Gi"}},
        });
    });
    let pod = value(&build::worker_pod(&job, 0, &inputs()));
    assert_eq!(pod["metadata"]["labels"]["team"], "vision");
    assert_eq!(
        pod["metadata"]["labels"]["ringmaster.dev/job-name"],
        "resnet50-imagenet"
    );
    let c = &pod["spec"]["containers"][0];
    assert_eq!(c["resources"]["limits"]["memory"], "800Gi");
    assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"], "8");
    assert!(
        c["env"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["name"] == "WANDB_PROJECT")
    );
    assert!(
        pod["spec"]["tolerations"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["key"] == "sku")
    );
    // The worker's environment reaches every rank through mpirun.
    assert!(
        build::launcher_command(&job)
            .join(" ")
            .contains("-x WANDB_PROJECT")
    );
}

/// The pod-template fields MPIJob users bring (pull secrets, ServiceAccount, affinity,
/// spreading, runtime class, init and added containers, ports, host IPC) reach each pod
/// beside what Ringmaster sets there: its container stays first and keeps its ports, the
/// node pool's selector stays beside the user's affinity (the scheduler requires both), and
/// the API token stays off under a ServiceAccount of the user's unless they turn it on.
#[test]
fn pod_template_fields_reach_each_pod_beside_ringmasters_own() {
    let affinity = json!({
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["eastus-1"]}]}
        ]}},
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 10, "podAffinityTerm": {
            "topologyKey": "kubernetes.io/hostname",
            "labelSelector": {"matchLabels": {"ringmaster.dev/role": "worker"}}
        }}]},
    });
    let spread = json!([{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"}]);
    let job = sample("trainingjob-resnet50-nd96asr-v4.yaml", |o| {
        o["spec"]["nodePool"] = json!({"provisioner": "existing", "nodeSelector": {"kubernetes.azure.com/agentpool": "gpu"}});
        let template = json!({
            "imagePullSecrets": [{"name": "acr-pull"}],
            "serviceAccountName": "trainer",
            "affinity": affinity,
            "topologySpreadConstraints": spread,
            "runtimeClassName": "nvidia",
            "initContainers": [{"name": "fetch-tokenizer", "image": "busybox:1.36"}],
            // Probe ports are int-or-string in Kubernetes' schema: both pass the schema check.
            "containers": [{"name": "dcgm-exporter", "image": "nvcr.io/nvidia/k8s/dcgm-exporter:4.2.3",
                            "livenessProbe": {"httpGet": {"path": "/health", "port": 9400}},
                            "readinessProbe": {"httpGet": {"path": "/health", "port": "metrics"}},
                            "resources": {"limits": {"cpu": "500m", "memory": "512Mi"}}}],
            "ports": [{"name": "metrics", "containerPort": 9400}],
        });
        o["spec"]["worker"] = template.clone();
        o["spec"]["worker"]["hostIPC"] = json!(true);
        o["spec"]["launcher"] = template;
        o["spec"]["launcher"]["automountServiceAccountToken"] = json!(true);
    });
    let worker = value(&build::worker_pod(&job, 0, &inputs()));
    let launcher = value(&build::launcher_pod(&job, &inputs()));
    for (role, pod) in [("worker", &worker), ("launcher", &launcher)] {
        let spec = &pod["spec"];
        assert_eq!(
            spec["imagePullSecrets"],
            json!([{"name": "acr-pull"}]),
            "{role}"
        );
        assert_eq!(spec["serviceAccountName"], "trainer", "{role}");
        assert_eq!(spec["affinity"], affinity, "{role}");
        assert_eq!(spec["topologySpreadConstraints"], spread, "{role}");
        assert_eq!(spec["runtimeClassName"], "nvidia", "{role}");
        let names = |list: &str| -> Vec<String> {
            spec[list]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c["name"].as_str().unwrap().to_string())
                .collect()
        };
        assert_eq!(names("initContainers"), ["fetch-tokenizer"], "{role}");
        assert_eq!(names("containers"), [role, "dcgm-exporter"], "{role}");
        assert_eq!(spec["enableServiceLinks"], false, "{role}");
    }
    // Both hold: the pool's selector and the user's node affinity.
    assert_eq!(
        worker["spec"]["nodeSelector"]["kubernetes.azure.com/agentpool"],
        "gpu"
    );
    // The worker's own ports stay, the user's follow; the launcher lists only the user's.
    let port_names = |pod: &Value| -> Vec<String> {
        pod["spec"]["containers"][0]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["name"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(port_names(&worker), ["ssh", "rendezvous", "metrics"]);
    assert_eq!(port_names(&launcher), ["metrics"]);
    // Host IPC on the worker alone (the schema refuses it on the launcher).
    assert_eq!(worker["spec"]["hostIPC"], true);
    assert!(launcher["spec"].get("hostIPC").is_none(), "{launcher}");
    // The token only where the user turned it on.
    assert_eq!(worker["spec"]["automountServiceAccountToken"], false);
    assert_eq!(launcher["spec"]["automountServiceAccountToken"], true);
}

/// The containers a user adds get Ringmaster's container defaults under their own
/// `securityContext`, so a CPU job's pods with them still meet `restricted`; what the user
/// sets wins, and a container that asks for root gets `runAsNonRoot: false`, without which
/// the pod's `runAsNonRoot: true` would stop the kubelet from starting it.
#[test]
fn added_containers_get_ringmasters_security_defaults_under_their_own() {
    let job = sample("trainingjob-cpu-small.yaml", |o| {
        o["spec"]["worker"] = json!({
            "initContainers": [
                {"name": "warm-cache", "image": "busybox:1.36"},
                {"name": "log-shipper", "image": "fluent-bit:3", "restartPolicy": "Always",
                 "securityContext": {"readOnlyRootFilesystem": true}},
            ],
            "containers": [{"name": "exporter", "image": "busybox:1.36"}],
        });
        o["spec"]["launcher"] = json!({
            "initContainers": [{"name": "chown-output", "image": "busybox:1.36",
                                "securityContext": {"runAsUser": 0}}],
        });
    });
    let [(_, worker), (_, launcher)] = pods(&job);
    let worker = worker.spec.unwrap();
    assert_eq!(violations(&worker, Level::Restricted), Vec::<String>::new());
    let security = |spec: &k8s_openapi::api::core::v1::PodSpec, name: &str| {
        let mut all = spec
            .init_containers
            .iter()
            .flatten()
            .chain(&spec.containers);
        value(&all.find(|c| c.name == name).unwrap().security_context)
    };
    let defaults = json!({"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}});
    assert_eq!(security(&worker, "warm-cache"), defaults);
    assert_eq!(security(&worker, "exporter"), defaults);
    assert_eq!(
        security(&worker, "log-shipper"),
        json!({"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": true})
    );
    // Root: the runtime's default capabilities stay (no drop), and it breaks restricted,
    // as asked.
    let launcher = launcher.spec.unwrap();
    assert_eq!(
        security(&launcher, "chown-output"),
        json!({"allowPrivilegeEscalation": false, "runAsNonRoot": false, "runAsUser": 0})
    );
    assert_ne!(
        violations(&launcher, Level::Restricted),
        Vec::<String>::new()
    );
    assert_eq!(violations(&launcher, Level::Baseline), Vec::<String>::new());
}

/// Host IPC is a host namespace: a worker with it needs the `privileged` level.
#[test]
fn a_worker_sharing_the_hosts_ipc_breaks_baseline() {
    let job = sample("trainingjob-cpu-small.yaml", |o| {
        o["spec"]["worker"] = json!({"hostIPC": true});
    });
    let [(_, worker), (_, launcher)] = pods(&job);
    assert_eq!(
        violations(&worker.spec.unwrap(), Level::Baseline),
        ["host namespaces (hostIPC=true)"]
    );
    assert_eq!(
        violations(&launcher.spec.unwrap(), Level::Restricted),
        Vec::<String>::new()
    );
}

/// Worker environment entries each worker resolves for itself (its pod's name, its limits, a
/// value built from them) reach each rank with its own worker's value: the worker writes them
/// into its `authorized_keys` copy as `environment=` options, which its sshd honours, and
/// mpirun does not forward the launcher's; the launcher does not even resolve them (a
/// resourceFieldRef naming the worker container would make the launcher pod invalid). Plain
/// values and Secret keys still go through the launcher, for Open MPI and Hydra. The
/// worker's script is run here, with such values, to check what sshd will read.
#[test]
fn per_pod_worker_env_goes_through_each_workers_sshd_and_the_rest_through_mpirun() {
    for implementation in ["OpenMPI", "MPICH"] {
        let job = sample("trainingjob-cpu-small.yaml", |o| {
            o["spec"]["mpi"] = json!({"implementation": implementation});
            o["spec"]["worker"]["env"] = json!([
                {"name": "TEAM", "value": "vision"},
                {"name": "HUB_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hub", "key": "token"}}},
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "CPUS", "valueFrom": {"resourceFieldRef": {"containerName": "worker", "resource": "limits.cpu"}}},
                {"name": "GREETING", "value": "say \"hi\" to $(POD_NAME)"},
                {"name": "NCCL_SOCKET_IFNAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['nic']"}}},
            ]);
        });
        assert_eq!(
            build::per_pod_env_names(&job),
            ["POD_NAME", "CPUS", "GREETING", "NCCL_SOCKET_IFNAME"]
        );
        let worker = value(&build::worker_pod(&job, 0, &inputs()));
        let command: Vec<String> =
            serde_json::from_value(worker["spec"]["containers"][0]["command"].clone()).unwrap();
        assert!(
            command
                .windows(2)
                .any(|w| w == ["-o", "PermitUserEnvironment=yes"]),
            "{command:?}"
        );
        // The kubelet rewrites `$(NAME)` and `$$` in a command: the script has neither.
        assert!(
            !command[2].contains("$(") && !command[2].contains("$$"),
            "{}",
            command[2]
        );
        let launcher_command = build::launcher_command(&job).join(" ");
        for forwarded in ["TEAM", "HUB_TOKEN", "RINGMASTER_RENDEZVOUS"] {
            assert!(launcher_command.contains(forwarded), "{launcher_command}");
        }
        for own in ["POD_NAME", "CPUS", "GREETING", "NCCL_SOCKET_IFNAME"] {
            assert!(!launcher_command.contains(own), "{launcher_command}");
        }
        let launcher = value(&build::launcher_pod(&job, &inputs()));
        let launcher_env = launcher["spec"]["containers"][0]["env"].to_string();
        assert!(launcher_env.contains("HUB_TOKEN"), "{launcher_env}");
        for own in ["POD_NAME", "CPUS", "GREETING"] {
            assert!(!launcher_env.contains(own), "{launcher_env}");
        }

        // The worker's own script, on folders of this test, with values the kubelet would give.
        let dir =
            std::env::temp_dir().join(format!("rm-env-{implementation}-{}", std::process::id()));
        let (secret, own) = (dir.join("secret"), dir.join("own"));
        std::fs::create_dir_all(&secret).unwrap();
        std::fs::create_dir_all(&own).unwrap();
        std::fs::write(secret.join("ssh-privatekey"), "key").unwrap();
        std::fs::write(
            secret.join("authorized_keys"),
            "ssh-ed25519 AAAA ringmaster\n",
        )
        .unwrap();
        std::fs::write(secret.join("ssh-publickey"), "ssh-ed25519 AAAA ringmaster").unwrap();
        let script = command[2]
            .replace("/etc/ringmaster/ssh-secret", secret.to_str().unwrap())
            .replace("/etc/ringmaster/ssh", own.to_str().unwrap());
        let out = std::process::Command::new("sh")
            .args(["-c", &script, "sh", "true"])
            .env("POD_NAME", "sample-worker-0")
            .env("CPUS", "2")
            .env("GREETING", "say \"hi\" to sample-worker-0")
            .env("NCCL_SOCKET_IFNAME", "eth0\nib0")
            .env_remove("CPUS")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            std::fs::read_to_string(own.join("authorized_keys")).unwrap(),
            "environment=\"POD_NAME=sample-worker-0\",\
             environment=\"GREETING=say \\\"hi\\\" to sample-worker-0\",\
             environment=\"NCCL_SOCKET_IFNAME=eth0ib0\" ssh-ed25519 AAAA ringmaster\n",
            "CPUS is unset: left out, not set empty"
        );
        assert_eq!(
            std::fs::read_to_string(own.join("known_hosts")).unwrap(),
            "* ssh-ed25519 AAAA ringmaster\n"
        );
        // A value ending in a backslash would read as an escaped quote (also before a line
        // break, which is dropped): the worker says so.
        let out = std::process::Command::new("sh")
            .args(["-c", &script, "sh", "true"])
            .env("POD_NAME", "ends-with\\\n")
            .output()
            .unwrap();
        assert!(!out.status.success());
        assert!(
            String::from_utf8_lossy(&out.stderr)
                .contains("the value of POD_NAME ends with a backslash"),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
    // Set per pod, one of Ringmaster's own rank variables (InfiniBand's NCCL_SOCKET_IFNAME)
    // is the worker's too: mpirun does not send the launcher's over it.
    let job = sample("trainingjob-resnet50-nd96asr-v4.yaml", |o| {
        o["spec"]["worker"]["env"] = json!([
            {"name": "NCCL_SOCKET_IFNAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['nic']"}}},
        ]);
    });
    let launcher_command = build::launcher_command(&job).join(" ");
    assert!(
        !launcher_command.contains("NCCL_SOCKET_IFNAME"),
        "{launcher_command}"
    );
    assert!(
        launcher_command.contains("-x NCCL_IB_DISABLE"),
        "{launcher_command}"
    );
    // Without such entries: no option, and the Secret's authorized_keys copied as it is.
    let plain = sample("trainingjob-cpu-small.yaml", |_| {});
    let worker = value(&build::worker_pod(&plain, 0, &inputs()));
    let command = worker["spec"]["containers"][0]["command"].to_string();
    assert!(!command.contains("PermitUserEnvironment"), "{command}");
    assert!(!command.contains("environment="), "{command}");
}

#[test]
fn the_ssh_secret_holds_a_working_key_pair_that_is_never_printed() {
    let job = gpu_job();
    let keys = SshKeys::from_seed(&[7u8; 32], "ringmaster/ml/resnet50-imagenet");
    assert!(
        keys.private_key
            .starts_with("-----BEGIN OPENSSH PRIVATE KEY-----")
    );
    assert!(keys.public_key.starts_with("ssh-ed25519 "));
    let parsed = ssh_key::PrivateKey::from_openssh(&keys.private_key).unwrap();
    assert_eq!(parsed.public_key().to_openssh().unwrap(), keys.public_key);
    assert_ne!(
        SshKeys::from_seed(&[8u8; 32], "x").public_key,
        keys.public_key
    );
    assert!(!format!("{keys:?}").contains("PRIVATE"));

    let rendezvous = RendezvousKey(std::array::from_fn(|i| i as u8 * 7));
    assert_eq!(format!("{rendezvous:?}"), "RendezvousKey(..)");
    let secret = value(&build::ssh_secret(
        &job,
        ChildNaming::UidTagged,
        &keys,
        &rendezvous,
    ));
    assert_eq!(secret["metadata"]["name"], "resnet50-imagenet-ssh-6f1c2");
    assert_eq!(secret["type"], "kubernetes.io/ssh-auth");
    assert_eq!(secret["stringData"]["authorized_keys"], keys.public_key);
    assert_eq!(secret["stringData"]["ssh-privatekey"], keys.private_key);
    assert_eq!(secret["stringData"]["ssh-publickey"], keys.public_key);
    // The rendezvous key: its 32 bytes as they are, under the name the trainer's file has.
    use base64::Engine;
    let key = secret["data"][ringmaster_contract::trainer::RENDEZVOUS_KEY]
        .as_str()
        .expect("a rendezvous key");
    let key = base64::engine::general_purpose::STANDARD
        .decode(key)
        .unwrap();
    assert_eq!(
        key.len(),
        ringmaster_contract::trainer::RENDEZVOUS_KEY_BYTES
    );
    assert_eq!(key, rendezvous.0);
}

/// The Service has no selector: the operator writes its EndpointSlice (`worker_dns`), so the
/// cluster's endpoints controllers leave it alone.
#[test]
fn the_worker_service_is_headless_without_a_selector() {
    let service = value(&build::worker_service(&gpu_job(), ChildNaming::UidTagged));
    assert_eq!(
        service["metadata"]["name"],
        "resnet50-imagenet-workers-6f1c2"
    );
    assert_eq!(service["spec"]["clusterIP"], "None");
    assert!(
        service["spec"].get("selector").is_none(),
        "{}",
        service["spec"]
    );
    assert_eq!(service["spec"]["ports"][0]["port"], 2222);
}

/// What CoreDNS serves `<pod>.<service>.<namespace>.svc` from: a slice tied to the Service by
/// its label, of a manager of its own (the cluster's EndpointSlice controllers leave it
/// alone), with each worker's pod name as hostname, every record ready (its name resolves
/// while its readiness probe is checked), owned by the job.
#[test]
fn the_workers_dns_records_are_an_endpoint_slice_of_the_service() {
    let address = |hostname: &str, ip: &str| WorkerAddress {
        hostname: hostname.into(),
        ip: ip.into(),
    };
    let addresses = [
        address("resnet50-imagenet-worker-0", "10.244.1.7"),
        address("resnet50-imagenet-worker-1", "10.244.2.9"),
    ];
    let slice = value(&build::worker_endpoints(
        &gpu_job(),
        ChildNaming::UidTagged,
        &addresses,
    ));
    let metadata = &slice["metadata"];
    assert_eq!(metadata["name"], "resnet50-imagenet-workers-6f1c2");
    assert_eq!(
        metadata["labels"]["kubernetes.io/service-name"],
        "resnet50-imagenet-workers-6f1c2"
    );
    assert_eq!(
        metadata["labels"]["endpointslice.kubernetes.io/managed-by"],
        "ringmaster.dev"
    );
    assert_eq!(
        metadata["ownerReferences"][0]["uid"],
        "6f1c2d3e-0000-4000-8000-00000000abcd"
    );
    assert_eq!(slice["addressType"], "IPv4");
    assert_eq!(
        slice["endpoints"][1],
        json!({
            "addresses": ["10.244.2.9"],
            "hostname": "resnet50-imagenet-worker-1",
            "conditions": {"ready": true, "serving": true, "terminating": false},
            "targetRef": {"kind": "Pod", "namespace": "ml", "name": "resnet50-imagenet-worker-1"},
        })
    );
    assert_eq!(
        slice["ports"],
        json!([
            {"name": "ssh", "port": 2222, "protocol": "TCP"},
            {"name": "rendezvous", "port": 29500, "protocol": "TCP"},
        ])
    );
    let v6 = [address("resnet50-imagenet-worker-0", "fd00::7")];
    let slice = value(&build::worker_endpoints(
        &gpu_job(),
        ChildNaming::UidTagged,
        &v6,
    ));
    assert_eq!(slice["addressType"], "IPv6");
    // Whatever the records, the job's Published reads back what was written.
    let typed = build::worker_endpoints(&gpu_job(), ChildNaming::UidTagged, &addresses);
    let read = Published::of(&typed, "6f1c2d3e-0000-4000-8000-00000000abcd").unwrap();
    assert_eq!(read.service, "resnet50-imagenet-workers-6f1c2");
    assert_eq!(read.addresses, addresses);
    assert_eq!(Published::of(&typed, "another-job's-uid"), None);
}

/// sshd, the rendezvous and the ranks' MPI and NCCL ports are open to the job's own pods only
/// (same namespace, same job and UID), whichever port they use.
#[test]
fn the_network_policy_admits_only_the_jobs_own_pods() {
    let policy = value(&build::network_policy(&gpu_job(), ChildNaming::UidTagged));
    assert_eq!(policy["metadata"]["name"], "resnet50-imagenet-gang-6f1c2");
    assert_eq!(
        policy["metadata"]["ownerReferences"][0]["uid"],
        "6f1c2d3e-0000-4000-8000-00000000abcd"
    );
    let gang = json!({
        "ringmaster.dev/job-name": "resnet50-imagenet",
        "ringmaster.dev/job-uid": "6f1c2d3e-0000-4000-8000-00000000abcd",
        "app.kubernetes.io/managed-by": "ringmaster",
    });
    let spec = &policy["spec"];
    assert_eq!(spec["podSelector"]["matchLabels"], gang);
    assert_eq!(spec["policyTypes"], json!(["Ingress"]));
    // One rule: from pods of this job in this namespace (no namespaceSelector), any port.
    assert_eq!(
        spec["ingress"],
        json!([{"from": [{"podSelector": {"matchLabels": gang}}]}])
    );
    // Every pod of the job is selected by it, the launcher too.
    for pod in [
        value(&build::worker_pod(&gpu_job(), 0, &inputs())),
        value(&build::launcher_pod(&gpu_job(), &inputs())),
    ] {
        for (key, wanted) in gang.as_object().unwrap() {
            assert_eq!(&pod["metadata"]["labels"][key], wanted, "{key}");
        }
    }
    // A gang an older operator made has no UID label: the policy must still select it.
    let untagged = value(&build::network_policy(&gpu_job(), ChildNaming::Untagged));
    assert_eq!(untagged["metadata"]["name"], "resnet50-imagenet-gang");
    assert!(untagged["spec"]["podSelector"]["matchLabels"]["ringmaster.dev/job-uid"].is_null());
}

/// The flags after `ringmaster-trainer train` in a launcher command.
fn train_flags(command: &[String]) -> &[String] {
    let train = command
        .iter()
        .position(|a| a == "train")
        .expect("a train command");
    &command[train + 1..]
}

/// The trainer's own parser and settings check accept the command the operator builds for
/// every sample, the GPU one too; the parsed settings are the ones validate derived (no
/// drift).
#[test]
fn the_trainer_accepts_the_command_the_operator_builds() {
    let mut checked = 0;
    for path in fixtures::yaml_files(&fixtures::root().join("config/samples")) {
        for object in fixtures::ringmaster_objects(&path) {
            if object["kind"] != "TrainingJob" {
                continue;
            }
            let job =
                validate_value(&object, None).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let command = build::launcher_command(&job);
            let parsed = TrainArgs::parse_flags(train_flags(&command))
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert_eq!(
                parsed.check(&Capabilities::this_release()),
                Ok(()),
                "{}",
                path.display()
            );
            match &job.program {
                Program::Trainer(t) => assert_eq!(parsed, t.args),
                Program::Command(_) => unreachable!("the samples run the trainer"),
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 2, "the CPU sample and the GPU sample");
    // The user's extra flags come last, so they win, and the trainer sees them.
    let job = sample("trainingjob-cpu-small.yaml", |o| {
        o["spec"]["trainer"]["extraArgs"] = json!(["--seed=7", "--log-every=1"]);
    });
    let command = build::launcher_command(&job);
    let parsed = TrainArgs::parse_flags(train_flags(&command)).unwrap();
    assert_eq!((parsed.seed, parsed.log_every), (7, 1));
}

/// The checkpoints to keep and the earlier run to go on from reach the trainer, as flags its
/// own parser reads back; unset, neither is a flag, so a trainer image older than them runs
/// the same jobs (issue 38, item 5).
#[test]
fn checkpoints_kept_and_the_run_to_resume_from_reach_the_trainers_command() {
    let earlier = "5d1c7a2e-8b4f-4e0a-9c3d-2f6e1b7a9c40";
    let job = sample("trainingjob-cpu-small.yaml", |o| {
        o["spec"]["output"] = json!({"persistentVolumeClaim": {"claimName": "results"}});
        o["spec"]["trainer"]["keepCheckpoints"] = json!(5);
        o["spec"]["trainer"]["resumeFrom"] = json!(earlier);
    });
    let command = build::launcher_command(&job);
    let flags = train_flags(&command);
    for flag in [
        "--keep-checkpoints=5".to_string(),
        format!("--resume-from={earlier}"),
        "--output-dir=/output/resnet18-cpu".to_string(),
    ] {
        assert!(flags.contains(&flag), "{flag} in {flags:?}");
    }
    let parsed = TrainArgs::parse_flags(flags).unwrap();
    assert_eq!(parsed.check(&Capabilities::this_release()), Ok(()));
    assert_eq!(
        (parsed.keep_checkpoints, parsed.resume_from.as_deref()),
        (5, Some(earlier))
    );

    let plain = build::launcher_command(&sample("trainingjob-cpu-small.yaml", |o| {
        o["spec"]["output"] = json!({"persistentVolumeClaim": {"claimName": "results"}});
    }));
    assert!(
        !train_flags(&plain)
            .iter()
            .any(|f| f.starts_with("--keep-checkpoints") || f.starts_with("--resume-from")),
        "{plain:?}"
    );
}

#[test]
fn a_job_with_its_own_aks_pool_puts_workers_and_launcher_there() {
    let job = sample("trainingjob-resnet50-nd96asr-v4.yaml", |_| {});
    let pool = job.node_pool.as_ref().unwrap().pool_name.clone().unwrap();
    for pod in [
        value(&build::worker_pod(&job, 0, &inputs())),
        value(&build::launcher_pod(&job, &inputs())),
    ] {
        assert_eq!(
            pod["spec"]["nodeSelector"]["kubernetes.azure.com/agentpool"],
            pool
        );
        assert!(
            pod["spec"]["tolerations"]
                .as_array()
                .unwrap()
                .contains(&json!({"key": "ringmaster.dev/pool", "operator": "Equal", "value": pool, "effect": "NoSchedule"})),
            "{pod:#}"
        );
    }
    let request = ringmaster::controller::training_job::pool::request(
        &job,
        job.node_pool.as_ref().unwrap(),
        &pool,
    );
    assert_eq!(
        (request.count, request.vm_size.as_str()),
        (2, "Standard_ND96asr_v4")
    );
    assert_eq!(
        request.node_taints,
        vec![format!("ringmaster.dev/pool={pool}:NoSchedule")]
    );
    assert_eq!(request.node_labels["ringmaster.dev/pool"], pool);
    assert!(request.gpu_driver_install && !request.spot);
}

/// Pool readiness counts the RDMA resource the job asks for, by its name.
/// `infiniband.preflight` reaches the trainer as the contract's typed flags, which the
/// trainer's own parser reads back; with InfiniBand off too (a CPU job's TCP ring is what it
/// measures), and on the GPU sample with InfiniBand; unset, no flag, so an older trainer
/// image runs the same jobs (issue 39 E).
#[test]
fn the_preflight_reaches_the_trainers_command_with_or_without_infiniband() {
    let cpu = sample("trainingjob-cpu-small.yaml", |o| {
        o["spec"]["infiniband"] =
            json!({"enabled": false, "preflight": {"minBusBandwidthGbps": 0.75}});
    });
    assert_eq!(cpu.infiniband, None, "no RDMA, IPC_LOCK or /dev/shm for it");
    let command = build::launcher_command(&cpu);
    let flags = train_flags(&command);
    assert!(
        flags.contains(&"--preflight-min-bus-gbps=0.75".to_string())
            && !flags.iter().any(|f| f.starts_with("--preflight-bytes")),
        "the default message size is the trainer's: {flags:?}"
    );
    let parsed = TrainArgs::parse_flags(flags).unwrap();
    assert_eq!(parsed.check(&Capabilities::this_release()), Ok(()));
    assert_eq!(
        (parsed.preflight_min_bus_gbps, parsed.preflight_bytes),
        (
            Some(0.75),
            ringmaster_contract::trainer::defaults::PREFLIGHT_BYTES
        )
    );

    let gpu = sample("trainingjob-resnet50-nd96asr-v4.yaml", |o| {
        o["spec"]["nodePool"] = json!({"provisioner": "existing", "nodeSelector": {"kubernetes.azure.com/agentpool": "gpu"}});
        o["spec"]["infiniband"]["preflight"] =
            json!({"minBusBandwidthGbps": 40, "messageBytes": 268435456});
    });
    assert!(gpu.infiniband.is_some());
    let command = build::launcher_command(&gpu);
    let parsed = TrainArgs::parse_flags(train_flags(&command)).unwrap();
    assert_eq!(
        (parsed.preflight_min_bus_gbps, parsed.preflight_bytes),
        (Some(40.0), 256 << 20)
    );

    let plain = build::launcher_command(&gpu_job());
    assert!(
        !train_flags(&plain)
            .iter()
            .any(|f| f.starts_with("--preflight")),
        "{plain:?}"
    );
}

#[test]
fn a_node_hosts_a_worker_only_with_the_jobs_rdma_resource() {
    use ringmaster::controller::training_job::pool::can_host_worker;
    let job = sample("trainingjob-resnet50-nd96asr-v4.yaml", |o| {
        o["spec"]["infiniband"]["rdmaResource"] = json!("rdma/hca_shared_devices_a");
        o["spec"]["infiniband"]["rdmaResourceCount"] = json!(2);
    });
    let node = |allocatable: Value, ready: &str| -> k8s_openapi::api::core::v1::Node {
        serde_json::from_value(json!({
            "metadata": {"name": "n"},
            "status": {
                "allocatable": allocatable,
                "conditions": [{"type": "Ready", "status": ready}],
            },
        }))
        .unwrap()
    };
    let default_name = json!({"nvidia.com/gpu": "8", "rdma/shared_ib": "1k"});
    let jobs_name = json!({"nvidia.com/gpu": "8", "rdma/hca_shared_devices_a": "2"});
    assert!(can_host_worker(&node(jobs_name.clone(), "True"), &job));
    assert!(
        !can_host_worker(&node(jobs_name, "False"), &job),
        "not Ready"
    );
    assert!(
        !can_host_worker(&node(default_name, "True"), &job),
        "the default resource is not the one this job asks for"
    );
    assert!(
        !can_host_worker(
            &node(
                json!({"nvidia.com/gpu": "8", "rdma/hca_shared_devices_a": "1"}),
                "True"
            ),
            &job
        ),
        "one device short"
    );
    assert!(
        !can_host_worker(
            &node(
                json!({"nvidia.com/gpu": "4", "rdma/hca_shared_devices_a": "2"}),
                "True"
            ),
            &job
        ),
        "GPUs short"
    );
}

/// The trainer flags the operator gives the flagship GPU sample are the ones the trainer's
/// GPU tests train with (`trainer/tests/fixtures/flagship-train-flags.txt`, one per line), so
/// the GPU run proves what the operator will launch. `RINGMASTER_BLESS=1` rewrites the file.
#[test]
fn the_flagship_samples_trainer_flags_are_the_ones_the_gpu_tests_run() {
    let job = sample("trainingjob-resnet50-nd96asr-v4.yaml", |_| {});
    let command = build::launcher_command(&job);
    let flags = train_flags(&command).join("\n") + "\n";
    let path = fixtures::root().join("trainer/tests/fixtures/flagship-train-flags.txt");
    if std::env::var_os("RINGMASTER_BLESS").is_some() {
        std::fs::write(&path, &flags).unwrap();
    }
    let fixture = std::fs::read_to_string(&path).unwrap_or_default();
    assert_eq!(
        fixture,
        flags,
        "{} is stale: run `RINGMASTER_BLESS=1 cargo test --test training_job_build flagship`",
        path.display()
    );
}

/// A volume of the user's may take any name Ringmaster does not give the same pod: `dshm` is
/// free on a job without InfiniBand and taken on one with it, named by its spec field.
#[test]
fn a_users_volume_clashes_only_with_what_ringmaster_gives_the_same_pod() {
    let with_dshm = |file: &str| {
        let path = fixtures::root().join("config/samples").join(file);
        let mut object = fixtures::ringmaster_objects(&path).remove(0);
        object["metadata"]["namespace"] = json!("ml");
        object["spec"]["worker"]["volumes"] =
            json!([{"name": "dshm", "emptyDir": {"medium": "Memory"}}]);
        validate_value(&object, None)
    };
    assert!(with_dshm("trainingjob-cpu-small.yaml").is_ok());
    let errors = with_dshm("trainingjob-resnet50-nd96asr-v4.yaml").unwrap_err();
    assert_eq!(errors.0.len(), 1, "{errors}");
    assert_eq!(errors.0[0].field, "spec.worker.volumes[0].name");
    assert!(
        errors.0[0]
            .message
            .starts_with("dshm is the name of a volume Ringmaster gives the worker pod"),
        "{errors}"
    );
}

/// The trainer flags starting with `prefix` that the flagship sample, changed by `edit`, gets.
fn flagship_train_flags_starting(prefix: &str, edit: fn(&mut Value)) -> Vec<String> {
    let job = sample("trainingjob-resnet50-nd96asr-v4.yaml", edit);
    train_flags(&build::launcher_command(&job))
        .iter()
        .filter(|f| f.starts_with(prefix))
        .cloned()
        .collect()
}

/// The warm-up is the trainer's default unless the spec sets one: no flag the spec did not
/// ask for, so a trainer image older than `--warmup-epochs` runs the same jobs as before.
#[test]
fn the_warm_up_flag_goes_only_with_the_specs_own_setting() {
    let warmup = |edit| flagship_train_flags_starting("--warmup-", edit);
    assert!(warmup(|_| {}).is_empty());
    assert_eq!(
        warmup(|o| o["spec"]["trainer"]["warmupEpochs"] = json!(0.5)),
        ["--warmup-epochs=0.5"]
    );
    assert_eq!(
        warmup(|o| o["spec"]["trainer"]["extraArgs"] = json!(["--warmup-steps=500"])),
        ["--warmup-steps=500"]
    );
}

/// The checkpoint clock is the trainer's default unless the spec sets one.
#[test]
fn the_checkpoint_flag_goes_only_with_the_specs_own_setting() {
    let checkpoint = |edit| flagship_train_flags_starting("--checkpoint-", edit);
    assert!(checkpoint(|_| {}).is_empty());
    assert_eq!(
        checkpoint(|o| o["spec"]["trainer"]["checkpointMinutes"] = json!(30)),
        ["--checkpoint-minutes=30"]
    );
    assert_eq!(
        checkpoint(|o| o["spec"]["trainer"]["checkpointMinutes"] = json!(0)),
        ["--checkpoint-minutes=0"]
    );
}

#[test]
fn the_launchers_hostfile_and_ssh_program_are_its_own_annotations_projected_into_files() {
    let job = gpu_job();
    let launcher = value(&build::launcher_pod(&job, &inputs()));
    let annotations = &launcher["metadata"]["annotations"];
    assert_eq!(
        annotations["ringmaster.dev/hostfile"],
        build::hostfile(&job, ChildNaming::UidTagged)
    );
    assert!(
        annotations["ringmaster.dev/ssh-program"]
            .as_str()
            .unwrap()
            .starts_with("#!/bin/sh\n")
    );
    let volumes = launcher["spec"]["volumes"].as_array().unwrap();
    let files = volumes.iter().find(|v| v["name"] == "hostfile").unwrap();
    assert_eq!(
        files["downwardAPI"],
        json!({"defaultMode": 0o755, "items": [
            {"path": "hostfile", "fieldRef": {"fieldPath": "metadata.annotations['ringmaster.dev/hostfile']"}},
            {"path": "ssh", "fieldRef": {"fieldPath": "metadata.annotations['ringmaster.dev/ssh-program']"}},
        ]})
    );
    let mounts = launcher["spec"]["containers"][0]["volumeMounts"]
        .as_array()
        .unwrap();
    assert!(mounts.contains(
        &json!({"name": "hostfile", "mountPath": "/etc/ringmaster/mpi", "readOnly": true})
    ));
}

#[test]
fn training_pods_carry_no_api_token_and_no_service_links() {
    let job = gpu_job();
    for pod in [
        value(&build::worker_pod(&job, 0, &inputs())),
        value(&build::launcher_pod(&job, &inputs())),
    ] {
        assert_eq!(pod["spec"]["automountServiceAccountToken"], false);
        assert_eq!(pod["spec"]["enableServiceLinks"], false);
    }
}

#[test]
fn a_gang_scheduled_jobs_pods_name_the_gang_scheduler_and_its_pod_group() {
    let job = gpu_job();
    let group = value(&build::pod_group(&job));
    assert_eq!(
        group,
        json!({
            "apiVersion": "scheduling.x-k8s.io/v1alpha1",
            "kind": "PodGroup",
            "metadata": {
                "name": "resnet50-imagenet-6f1c2",
                "namespace": "ml",
                "labels": {
                    "app.kubernetes.io/managed-by": "ringmaster",
                    "ringmaster.dev/job-name": "resnet50-imagenet",
                    "ringmaster.dev/role": "gang",
                },
                "ownerReferences": [{
                    "apiVersion": "ringmaster.dev/v1alpha1", "kind": "TrainingJob",
                    "name": "resnet50-imagenet", "uid": "6f1c2d3e-0000-4000-8000-00000000abcd",
                    "controller": true, "blockOwnerDeletion": true,
                }],
            },
            // 2 workers × 8 GPUs and 1 InfiniBand device: the launcher (made once they are
            // ready) is not counted.
            "spec": {"minMember": 2, "minResources": {"nvidia.com/gpu": "16", "rdma/shared_ib": "2"}},
        })
    );

    let gang = BuildInputs {
        gang_scheduler: Some(GangScheduler::new("scheduler-plugins-scheduler", None)),
        ..inputs()
    };
    for pod in [
        value(&build::worker_pod(&job, 3, &gang)),
        value(&build::launcher_pod(&job, &gang)),
    ] {
        assert_eq!(pod["spec"]["schedulerName"], "scheduler-plugins-scheduler");
        assert_eq!(
            pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"],
            group["metadata"]["name"]
        );
    }
    // Without a gang scheduler: the cluster's default scheduler, no group.
    for pod in [
        value(&build::worker_pod(&job, 0, &inputs())),
        value(&build::launcher_pod(&job, &inputs())),
    ] {
        assert!(pod["spec"].get("schedulerName").is_none());
        assert!(
            pod["metadata"]["labels"]
                .get("scheduling.x-k8s.io/pod-group")
                .is_none()
        );
    }
    // A user's own label of that name does not take a pod out of its gang.
    let mut job = job;
    job.worker
        .labels
        .insert("scheduling.x-k8s.io/pod-group".into(), "elsewhere".into());
    let worker = value(&build::worker_pod(&job, 0, &gang));
    assert_eq!(
        worker["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"],
        group["metadata"]["name"]
    );
}

#[test]
fn a_cpu_jobs_pod_group_asks_for_no_devices() {
    let job = sample("trainingjob-cpu-small.yaml", |_| {});
    let group = build::pod_group(&job);
    assert_eq!(group.spec.min_member, i32::try_from(job.workers).unwrap());
    assert!(group.spec.min_resources.is_empty());
}

#[test]
fn a_jobs_schedule_timeout_goes_to_its_pod_group() {
    let job = sample("trainingjob-cpu-small.yaml", |o| {
        o["spec"]["runPolicy"]["schedulingPolicy"] = json!({"scheduleTimeoutSeconds": 300});
    });
    let group = value(&build::pod_group(&job));
    assert_eq!(group["spec"]["scheduleTimeoutSeconds"], 300);
    let job = sample("trainingjob-cpu-small.yaml", |_| {});
    let group = value(&build::pod_group(&job));
    assert!(
        group["spec"].get("scheduleTimeoutSeconds").is_none(),
        "{group}"
    );
}

#[test]
fn a_volcano_gang_gets_a_volcano_pod_group_in_its_queue_and_annotated_pods() {
    let mut job = gpu_job();
    job.run_policy.scheduling_policy = Some(ringmaster::api::SchedulingPolicy {
        queue: Some("vision".into()),
        schedule_timeout_seconds: Some(300),
    });
    job.worker.priority_class_name = Some("training-high".into());
    let group = value(&build::volcano_pod_group(&job));
    let plugins_group = value(&build::pod_group(&job));
    assert_eq!(group["apiVersion"], "scheduling.volcano.sh/v1beta1");
    assert_eq!(group["kind"], "PodGroup");
    // The same name, labels and owner as scheduler-plugins' group.
    assert_eq!(group["metadata"], plugins_group["metadata"]);
    assert_eq!(
        group["spec"],
        json!({
            "minMember": 2,
            "minResources": {"nvidia.com/gpu": "16", "rdma/shared_ib": "2"},
            "queue": "vision",
            "priorityClassName": "training-high",
        })
    );

    let volcano = BuildInputs {
        gang_scheduler: Some(GangScheduler::new("volcano", None)),
        ..inputs()
    };
    for pod in [
        value(&build::worker_pod(&job, 1, &volcano)),
        value(&build::launcher_pod(&job, &volcano)),
    ] {
        assert_eq!(pod["spec"]["schedulerName"], "volcano");
        assert_eq!(
            pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"],
            group["metadata"]["name"]
        );
        assert!(
            pod["metadata"]["labels"]
                .get("scheduling.x-k8s.io/pod-group")
                .is_none()
        );
    }
    // Unset, the queue is Volcano's default one.
    job.run_policy.scheduling_policy = None;
    let group = value(&build::volcano_pod_group(&job));
    assert!(group["spec"].get("queue").is_none(), "{group}");
}

#[test]
fn the_gang_api_follows_the_scheduler_name_unless_set() {
    assert_eq!(GangScheduler::new("volcano", None).api, GangApi::Volcano);
    assert_eq!(
        GangScheduler::new("scheduler-plugins-scheduler", None).api,
        GangApi::SchedulerPlugins
    );
    assert_eq!(
        GangScheduler::new("my-volcano", Some(GangApi::Volcano)).api,
        GangApi::Volcano
    );
    assert_eq!(
        GangScheduler::new("volcano", Some(GangApi::SchedulerPlugins)).api,
        GangApi::SchedulerPlugins
    );
}

#[test]
fn the_launcher_gets_the_operators_priority_class_unless_its_job_sets_one_or_a_gang_scheduler_places_it()
 {
    let with_class = BuildInputs {
        launcher_priority_class: Some("ringmaster-launcher".into()),
        ..inputs()
    };
    let job = gpu_job();
    let launcher = value(&build::launcher_pod(&job, &with_class));
    assert_eq!(launcher["spec"]["priorityClassName"], "ringmaster-launcher");
    let worker = value(&build::worker_pod(&job, 0, &with_class));
    assert!(
        worker["spec"].get("priorityClassName").is_none(),
        "workers keep the job's priority: {}",
        worker["spec"]
    );
    // Not set: none.
    let launcher = value(&build::launcher_pod(&job, &inputs()));
    assert!(launcher["spec"].get("priorityClassName").is_none());

    // The job's own launcher class wins.
    let own = sample("trainingjob-resnet50-nd96asr-v4.yaml", |o| {
        o["spec"]["nodePool"] = json!({"provisioner": "existing", "nodeSelector": {"kubernetes.azure.com/agentpool": "gpu"}});
        o["spec"]["launcher"] = json!({"priorityClassName": "team-critical"});
    });
    let launcher = value(&build::launcher_pod(&own, &with_class));
    assert_eq!(launcher["spec"]["priorityClassName"], "team-critical");

    // A gang scheduler orders its groups itself: the launcher joins its placed group as is.
    let gang = BuildInputs {
        gang_scheduler: Some(GangScheduler::new("volcano", None)),
        ..with_class
    };
    let launcher = value(&build::launcher_pod(&job, &gang));
    assert!(launcher["spec"].get("priorityClassName").is_none());
}

/// The MPI implementations a job may name, each with a sample of it.
fn each_mpi() -> Vec<(&'static str, ValidatedTrainingJob)> {
    ["OpenMPI", "IntelMPI", "MPICH"]
        .into_iter()
        .map(|mpi| {
            let job = sample("trainingjob-cpu-small.yaml", |o| {
                o["spec"]["mpi"] = json!({"implementation": mpi});
            });
            (mpi, job)
        })
        .collect()
}

/// The first container of a pod.
fn container(pod: &Value) -> &Value {
    &pod["spec"]["containers"][0]
}

/// Every rank reads the job's rendezvous key from the mounted Secret: the launcher and the
/// workers name the file (the key itself is in no pod's spec), and each MPI forwards the
/// name to the ranks as it forwards the other variables.
#[test]
fn every_rank_is_given_the_rendezvous_key_file_in_the_mounted_secret() {
    use ringmaster_contract::trainer::{RENDEZVOUS_KEY, RENDEZVOUS_KEY_FILE_ENV};
    let key_file = format!("/etc/ringmaster/ssh-secret/{RENDEZVOUS_KEY}");
    for (mpi, job) in each_mpi() {
        let command = build::launcher_command(&job).join(" ");
        let forwarded = match mpi {
            "OpenMPI" => format!("-x {RENDEZVOUS_KEY_FILE_ENV} "),
            _ => format!("-genv {RENDEZVOUS_KEY_FILE_ENV} $({RENDEZVOUS_KEY_FILE_ENV}) "),
        };
        assert!(command.contains(&forwarded), "{mpi}: {command}");
        for pod in [
            build::launcher_pod(&job, &inputs()),
            build::worker_pod(&job, 1, &inputs()),
        ] {
            let pod = value(&pod);
            let c = container(&pod);
            assert!(
                c["env"]
                    .as_array()
                    .unwrap()
                    .contains(&json!({"name": RENDEZVOUS_KEY_FILE_ENV, "value": key_file})),
                "{mpi}: {}",
                c["env"]
            );
            // In the Secret's own mount.
            let mount = c["volumeMounts"]
                .as_array()
                .unwrap()
                .iter()
                .find(|m| m["name"] == "ssh-secret")
                .unwrap();
            assert_eq!(
                format!("{}/{RENDEZVOUS_KEY}", mount["mountPath"].as_str().unwrap()),
                key_file
            );
        }
    }
}

/// Every ssh of a job (Open MPI's `plm_rsh_args`, Hydra's ssh program for Intel MPI and
/// MPICH, the workers' readiness probe) pins the job's host key: strict checking against
/// the job's own `known_hosts` only, never the prompt-less "accept anything".
#[test]
fn every_ssh_pins_the_jobs_host_key_whatever_the_mpi() {
    let pinned = "-o StrictHostKeyChecking=yes -o UserKnownHostsFile=/etc/ringmaster/ssh/known_hosts -o GlobalKnownHostsFile=/dev/null";
    for (mpi, job) in each_mpi() {
        let launcher = value(&build::launcher_pod(&job, &inputs()));
        let worker = value(&build::worker_pod(&job, 0, &inputs()));
        let command = build::launcher_command(&job);
        let ssh = match mpi {
            "OpenMPI" => {
                let rsh = command.iter().position(|a| a == "plm_rsh_args").unwrap();
                command[rsh + 1].clone()
            }
            _ => launcher["metadata"]["annotations"]["ringmaster.dev/ssh-program"]
                .as_str()
                .unwrap()
                .to_string(),
        };
        let probe = container(&worker)["readinessProbe"]["exec"]["command"][2]
            .as_str()
            .unwrap()
            .to_string();
        for options in [&ssh, &probe] {
            assert!(options.contains(pinned), "{mpi}: {options}");
            assert!(
                !options.contains("StrictHostKeyChecking=no"),
                "{mpi}: {options}"
            );
            assert!(
                !options.contains("UserKnownHostsFile=/dev/null"),
                "{mpi}: {options}"
            );
        }
        // The workers' sshd serves the job's key as its host key: the one known_hosts holds.
        let sshd = container(&worker)["command"].to_string();
        assert!(
            sshd.contains(r#""-h","/etc/ringmaster/ssh/ssh-privatekey""#),
            "{sshd}"
        );
    }
}

/// What each container writes before it starts, run here with the Secret's files of a job
/// and its memory folder in a temporary directory: `known_hosts` holds one line, any host
/// with the job's public key, which is the host key of the workers' sshd.
#[test]
fn the_known_hosts_each_container_writes_holds_the_jobs_public_key_for_any_host() {
    let keys = SshKeys::from_seed(&[7u8; 32], "ringmaster/ml/resnet18-cpu");
    let plain = sample("trainingjob-cpu-small.yaml", |_| {});
    let per_pod = sample("trainingjob-cpu-small.yaml", |o| {
        o["spec"]["worker"]["env"] =
            json!([{"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]);
    });
    let pods = [
        build::launcher_pod(&plain, &inputs()),
        build::worker_pod(&plain, 0, &inputs()),
        build::worker_pod(&per_pod, 0, &inputs()),
    ];
    for (i, pod) in pods.iter().enumerate() {
        let dir = tempfile::tempdir().unwrap();
        let (secret, own) = (dir.path().join("secret"), dir.path().join("own"));
        std::fs::create_dir_all(&secret).unwrap();
        std::fs::create_dir_all(&own).unwrap();
        std::fs::write(secret.join("ssh-privatekey"), &keys.private_key).unwrap();
        std::fs::write(secret.join("ssh-publickey"), &keys.public_key).unwrap();
        std::fs::write(secret.join("authorized_keys"), &keys.public_key).unwrap();
        let command = pod.spec.as_ref().unwrap().containers[0]
            .command
            .clone()
            .unwrap();
        let script = command[2]
            .replace("/etc/ringmaster/ssh-secret", secret.to_str().unwrap())
            .replace("/etc/ringmaster/ssh", own.to_str().unwrap());
        let status = std::process::Command::new("sh")
            .args(["-c", &script, "sh", "true"])
            .status()
            .unwrap();
        assert!(status.success(), "pod {i}: {script}");
        let known_hosts = std::fs::read_to_string(own.join("known_hosts")).unwrap();
        assert_eq!(known_hosts, format!("* {}\n", keys.public_key), "pod {i}");
        let host_key = ssh_key::PublicKey::from_openssh(known_hosts[2..].trim()).unwrap();
        let private = ssh_key::PrivateKey::from_openssh(&keys.private_key).unwrap();
        assert_eq!(&host_key, private.public_key(), "pod {i}");
    }
}

/// A folder of fake programs (`name`: a shell script that prints its name and arguments).
fn fake_programs(dir: &std::path::Path, names: &[&str]) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir).unwrap();
    for name in names {
        let path = dir.join(name);
        std::fs::write(&path, format!("#!/bin/sh\necho {name} \"$@\"\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
}

/// `command` run with only `path` on the PATH and `env`: its exit code, stdout and stderr.
fn run_with(
    command: &[String],
    path: &std::path::Path,
    env: &[(&str, &str)],
) -> (i32, String, String) {
    let out = std::process::Command::new(&command[0])
        .args(&command[1..])
        .env_clear()
        .env("PATH", format!("{}:/usr/bin:/bin", path.display()))
        .envs(env.iter().copied())
        .output()
        .expect("sh runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The worker finds sshd in the image, or runs the one `RINGMASTER_SSHD` names, and says so
/// plainly when there is none.
#[test]
fn a_worker_runs_the_sshd_it_is_told_of_and_says_when_there_is_none() {
    let job = sample("trainingjob-cpu-small.yaml", |_| {});
    let worker = value(&build::worker_pod(&job, 0, &BuildInputs::default()));
    let command: Vec<String> =
        serde_json::from_value(worker["spec"]["containers"][0]["command"].clone()).unwrap();
    // What the key-copying script execs: the sshd finder and sshd's flags.
    let sshd = &command[4..];
    assert_eq!(&sshd[..2], ["sh", "-c"]);
    let dir = std::env::temp_dir().join(format!("sshd-finder-{}", std::process::id()));
    fake_programs(&dir, &["my-sshd"]);
    let mine = dir.join("my-sshd");
    let (code, out, _) = run_with(sshd, &dir, &[("RINGMASTER_SSHD", mine.to_str().unwrap())]);
    assert_eq!(code, 0);
    assert!(out.starts_with("my-sshd -D -e -p 2222 "), "{out}");
    let (code, _, err) = run_with(sshd, &dir, &[("RINGMASTER_SSHD", "/opt/none/sshd")]);
    assert_eq!(code, 127);
    assert!(
        err.contains("no sshd at /opt/none/sshd (RINGMASTER_SSHD)"),
        "{err}"
    );
    std::fs::remove_dir_all(dir).ok();
}

/// A user's program is launched by `ringmaster-trainer launch` (progress, result, the
/// exception's line) when the image has it, else by the MPI launcher alone, with a word.
#[test]
fn a_users_launcher_uses_the_trainers_wrapper_when_the_image_has_it() {
    let job = sample("trainingjob-cpu-small.yaml", |o| {
        o["spec"].as_object_mut().unwrap().remove("trainer");
        o["spec"]["command"] = json!(["python3", "train.py"]);
    });
    let command = build::launcher_command(&job);
    let with = std::env::temp_dir().join(format!("launch-with-{}", std::process::id()));
    fake_programs(&with, &["ringmaster-trainer", "mpirun"]);
    let (code, out, _) = run_with(&command, &with, &[]);
    assert_eq!(code, 0);
    assert!(
        out.starts_with("ringmaster-trainer launch --termination-message /dev/termination-log -- mpirun --hostfile "),
        "{out}"
    );
    assert!(
        out.trim_end().ends_with("ringmaster-rank python3 train.py"),
        "{out}"
    );
    let without = std::env::temp_dir().join(format!("launch-without-{}", std::process::id()));
    fake_programs(&without, &["mpirun"]);
    let (code, out, err) = run_with(&command, &without, &[]);
    assert_eq!(code, 0);
    assert!(out.starts_with("mpirun --hostfile "), "{out}");
    assert!(err.contains("no ringmaster-trainer on its PATH"), "{err}");
    // Its launcher has what a report needs: the endpoint and the pod-bound token.
    let inputs = BuildInputs {
        progress: Some(ringmaster::report::ProgressEndpoint {
            url: "https://ringmaster-progress.ringmaster-system.svc:8443".into(),
            ca_pem: "-----BEGIN CERTIFICATE-----".into(),
        }),
        ..BuildInputs::default()
    };
    let launcher = value(&build::launcher_pod(&job, &inputs));
    let env = launcher["spec"]["containers"][0]["env"].as_array().unwrap();
    assert!(
        env.iter()
            .any(|e| e["name"] == ringmaster_contract::progress::URL_ENV),
        "{env:?}"
    );
    let volumes = launcher["spec"]["volumes"].as_array().unwrap();
    assert!(volumes.iter().any(
        |v| v["projected"]["sources"][0]["serviceAccountToken"]["audience"]
            == ringmaster_contract::progress::AUDIENCE
    ));
    std::fs::remove_dir_all(with).ok();
    std::fs::remove_dir_all(without).ok();
}
