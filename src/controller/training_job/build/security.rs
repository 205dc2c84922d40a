//! The security contexts of a job's pods: Ringmaster's defaults, which meet the Pod Security
//! Standard `restricted` (`baseline` but for IPC_LOCK with InfiniBand), with the user's
//! `securityContext` and `containerSecurityContext` over them, field by field.

use k8s_openapi::api::core::v1::{
    Capabilities, PodSecurityContext, SeccompProfile, SecurityContext, Sysctl,
};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::volumes::PodRole;
use crate::api::PodOverrides;
use crate::controller::training_job::spec::ValidatedTrainingJob;

/// Group the pods' volumes are given to, so a non-root user (the trainer image's uid/gid
/// 1000) can read the SSH key, which is mounted owned by root (0600 becomes 0640 with the
/// group); every container copies it into a file of its own before use.
pub const POD_FS_GROUP: i64 = 1000;

/// Ports below this one need root (or CAP_NET_BIND_SERVICE) to listen on, unless the
/// network namespace's `ip_unprivileged_port_start` says otherwise.
const PRIVILEGED_PORTS_END: i32 = 1024;

/// The sysctl that opens the ports from its value up to every user of the pod's network.
const UNPRIVILEGED_PORT_START: &str = "net.ipv4.ip_unprivileged_port_start";

/// The capability RDMA needs to pin memory, which InfiniBand workers are given. Neither
/// Pod Security level below `privileged` allows adding it.
pub const RDMA_CAPABILITY: &str = "IPC_LOCK";

/// The security contexts of a pod and of its main container.
#[derive(Clone, Debug, PartialEq)]
pub struct PodSecurity {
    /// The pod's.
    pub pod: PodSecurityContext,
    /// The main container's.
    pub container: SecurityContext,
}

impl PodSecurity {
    /// Whether the container may run as root: its user (or the pod's) is 0, or none is set
    /// and nothing says it must not be root (the image's user decides).
    pub fn may_run_as_root(&self) -> bool {
        let user = self.container.run_as_user.or(self.pod.run_as_user);
        let non_root = self.container.run_as_non_root.or(self.pod.run_as_non_root);
        user == Some(0) || (user.is_none() && non_root != Some(true))
    }
}

/// The security contexts of `job`'s `role` pod with `overrides`:
///
/// - the pod: `runAsNonRoot: true` (left unset when the user asks for `runAsUser: 0`, for
///   an image that runs as root), `seccompProfile: RuntimeDefault`, `fsGroup`
///   [`POD_FS_GROUP`], and on a worker whose sshd listens below port 1024 the namespaced
///   sysctl `net.ipv4.ip_unprivileged_port_start` (a "safe" sysctl, which even `restricted`
///   allows) so a non-root sshd can bind it;
/// - the container: `allowPrivilegeEscalation: false` (unless the user makes it privileged
///   or adds SYS_ADMIN, with which Kubernetes refuses it), every capability dropped (unless
///   it may run as root: a root sshd needs the runtime's default set for its privilege
///   separation, chroot and setuid), and IPC_LOCK added on InfiniBand workers.
///
/// Every field the user sets wins, but for the lists: their sysctls are added (theirs win by
/// name), their `capabilities.add` is added to Ringmaster's, and their `capabilities.drop`
/// replaces the default `[ALL]`.
pub fn pod_security(
    job: &ValidatedTrainingJob,
    role: PodRole,
    overrides: &PodOverrides,
) -> PodSecurity {
    let theirs_pod = overrides.security_context.clone().unwrap_or_default();
    let theirs = overrides
        .container_security_context
        .clone()
        .unwrap_or_default();
    let root_asked = theirs.run_as_user.or(theirs_pod.run_as_user) == Some(0);
    let ssh_sysctl =
        (role == PodRole::Worker && job.mpi.ssh_port < PRIVILEGED_PORTS_END).then(|| Sysctl {
            name: UNPRIVILEGED_PORT_START.into(),
            value: job.mpi.ssh_port.to_string(),
        });
    let ours_pod = PodSecurityContext {
        fs_group: Some(POD_FS_GROUP),
        run_as_non_root: (!root_asked).then_some(true),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".into(),
            localhost_profile: None,
        }),
        ..PodSecurityContext::default()
    };
    let mut pod = overlay(ours_pod, &theirs_pod);
    pod.sysctls = sysctls(ssh_sysctl, theirs_pod.sysctls.unwrap_or_default());

    let required: Vec<String> = (role == PodRole::Worker && job.infiniband.is_some())
        .then(|| RDMA_CAPABILITY.to_string())
        .into_iter()
        .collect();
    let container = container_security(&pod, &theirs, required);
    PodSecurity { pod, container }
}

/// The security context of a container the user adds to a pod (`initContainers`,
/// `containers`) whose context is `pod`: Ringmaster's container defaults under `theirs`, as
/// for the main container ([`pod_security`]) but with no capability of Ringmaster's, so the
/// pod still meets the Pod Security level its own containers do. A container that asks for
/// `runAsUser: 0` and says nothing of `runAsNonRoot` gets `runAsNonRoot: false`, as the
/// main container loses Ringmaster's `true` then: the pod's `true` would stop the kubelet
/// from starting it.
pub fn added_container_security(
    pod: &PodSecurityContext,
    theirs: Option<&SecurityContext>,
) -> SecurityContext {
    let mut theirs = theirs.cloned().unwrap_or_default();
    if theirs.run_as_user == Some(0) && theirs.run_as_non_root.is_none() {
        theirs.run_as_non_root = Some(false);
    }
    container_security(pod, &theirs, Vec::new())
}

/// A container's security context in a pod whose context is `pod`: `allowPrivilegeEscalation:
/// false` (unless `theirs` makes it privileged or adds SYS_ADMIN), every capability dropped
/// unless it may run as root (or `theirs` says what to drop), `required` capabilities added
/// before theirs; every other field `theirs` sets wins.
fn container_security(
    pod: &PodSecurityContext,
    theirs: &SecurityContext,
    required: Vec<String>,
) -> SecurityContext {
    let their_capabilities = theirs.capabilities.clone().unwrap_or_default();
    let escalates = theirs.privileged == Some(true)
        || their_capabilities
            .add
            .iter()
            .flatten()
            .any(|c| c.trim_start_matches("CAP_") == "SYS_ADMIN");
    let ours = SecurityContext {
        allow_privilege_escalation: (!escalates).then_some(false),
        ..SecurityContext::default()
    };
    let mut container = overlay(ours, theirs);
    let mut add = required;
    for capability in their_capabilities.add.into_iter().flatten() {
        if !add.contains(&capability) {
            add.push(capability);
        }
    }
    let may_run_as_root = PodSecurity {
        pod: pod.clone(),
        container: container.clone(),
    }
    .may_run_as_root();
    let drop = their_capabilities
        .drop
        .or_else(|| (!may_run_as_root).then(|| vec!["ALL".to_string()]));
    let add = (!add.is_empty()).then_some(add);
    container.capabilities =
        (add.is_some() || drop.is_some()).then_some(Capabilities { add, drop });
    container
}

/// Ringmaster's sysctl (if any) and the user's; theirs win by name.
fn sysctls(ours: Option<Sysctl>, theirs: Vec<Sysctl>) -> Option<Vec<Sysctl>> {
    let mut all: Vec<Sysctl> = ours
        .into_iter()
        .filter(|o| theirs.iter().all(|t| t.name != o.name))
        .collect();
    all.extend(theirs);
    (!all.is_empty()).then_some(all)
}

/// `ours` with every field `theirs` sets replaced by theirs (a whole field: a seccomp profile
/// or SELinux options are taken as the user wrote them).
fn overlay<T: Serialize + DeserializeOwned>(ours: T, theirs: &T) -> T {
    let mut merged = serde_json::to_value(ours).expect("a security context serializes");
    if let (serde_json::Value::Object(merged), serde_json::Value::Object(theirs)) = (
        &mut merged,
        serde_json::to_value(theirs).expect("a security context serializes"),
    ) {
        merged.extend(theirs);
    }
    serde_json::from_value(merged).expect("two security contexts merge into one")
}
