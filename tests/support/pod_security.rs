#![allow(dead_code)] // each test crate uses a part of it
//! The Pod Security Standards' `baseline` and `restricted` levels (Kubernetes 1.36, "latest"),
//! checked on a pod spec the way the API server's PodSecurity admission does
//! (k8s.io/pod-security-admission/policy): every check of the level, over the pod and all its
//! containers (init and ephemeral ones too). What each check refuses is said in the
//! admission's words where it has them, so a failure reads like the API server's refusal.

use k8s_openapi::api::core::v1::{Container, PodSpec, SecurityContext};

/// A Pod Security level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    /// Prevents known privilege escalations: no host namespaces, privileged containers,
    /// hostPath, host ports, unsafe sysctls or capabilities beyond the runtime's defaults.
    Baseline,
    /// Baseline, plus: non-root, no privilege escalation, a seccomp profile, every
    /// capability dropped but NET_BIND_SERVICE, and only volume types without host access.
    Restricted,
}

/// Capabilities `baseline` lets a container add: the container runtimes' default set.
const BASELINE_CAPABILITIES: &[&str] = &[
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
];

/// Sysctls `baseline` allows: namespaced ones that touch no other pod (1.27 and 1.29 added
/// the last five).
const SAFE_SYSCTLS: &[&str] = &[
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
];

/// SELinux types `baseline` allows.
const SELINUX_TYPES: &[&str] = &[
    "",
    "container_t",
    "container_init_t",
    "container_kvm_t",
    "container_engine_t",
];

/// Every container of the pod: init, regular and ephemeral ones, as `(name, security
/// context)`.
fn containers(spec: &PodSpec) -> Vec<(String, Option<SecurityContext>)> {
    let of = |c: &Container| (c.name.clone(), c.security_context.clone());
    let mut all: Vec<_> = spec.init_containers.iter().flatten().map(of).collect();
    all.extend(spec.containers.iter().map(of));
    all.extend(
        spec.ephemeral_containers
            .iter()
            .flatten()
            .map(|c| (c.name.clone(), c.security_context.clone())),
    );
    all
}

/// What `level` refuses in `spec`; empty when the pod meets it.
pub fn violations(spec: &PodSpec, level: Level) -> Vec<String> {
    let mut found = baseline(spec);
    if level == Level::Restricted {
        found.extend(restricted(spec));
    }
    found
}

fn baseline(spec: &PodSpec) -> Vec<String> {
    let mut found = Vec::new();
    let pod = spec.security_context.clone().unwrap_or_default();
    let containers = containers(spec);
    // Host namespaces.
    for (field, on) in [
        ("hostNetwork", spec.host_network),
        ("hostPID", spec.host_pid),
        ("hostIPC", spec.host_ipc),
    ] {
        if on == Some(true) {
            found.push(format!("host namespaces ({field}=true)"));
        }
    }
    // HostProcess (Windows).
    let host_process = |c: &Option<SecurityContext>| {
        c.as_ref()
            .and_then(|c| c.windows_options.as_ref())
            .and_then(|w| w.host_process)
            == Some(true)
    };
    if pod.windows_options.as_ref().and_then(|w| w.host_process) == Some(true)
        || containers.iter().any(|(_, c)| host_process(c))
    {
        found.push("hostProcess".into());
    }
    // Privileged containers.
    for (name, c) in &containers {
        if c.as_ref().and_then(|c| c.privileged) == Some(true) {
            found.push(format!(
                "privileged (container {name:?} must not set securityContext.privileged=true)"
            ));
        }
    }
    // Capabilities beyond the runtime's defaults.
    for (name, c) in &containers {
        let added = c
            .as_ref()
            .and_then(|c| c.capabilities.as_ref())
            .and_then(|c| c.add.clone())
            .unwrap_or_default();
        for capability in added {
            if !BASELINE_CAPABILITIES.contains(&capability.as_str()) {
                found.push(format!(
                    "non-default capabilities (container {name:?} must not include {capability:?} in securityContext.capabilities.add)"
                ));
            }
        }
    }
    // hostPath volumes.
    for volume in spec.volumes.iter().flatten() {
        if volume.host_path.is_some() {
            found.push(format!("hostPath volumes (volume {:?})", volume.name));
        }
    }
    // Host ports, and probe or lifecycle handlers aimed at another host.
    for container in spec
        .init_containers
        .iter()
        .flatten()
        .chain(&spec.containers)
    {
        for port in container.ports.iter().flatten() {
            if port.host_port.unwrap_or(0) != 0 {
                found.push(format!(
                    "hostPort (container {:?} uses hostPort {})",
                    container.name,
                    port.host_port.unwrap_or(0)
                ));
            }
        }
        let probes = [
            &container.liveness_probe,
            &container.readiness_probe,
            &container.startup_probe,
        ];
        for probe in probes.into_iter().flatten() {
            let hosts = [
                probe.http_get.as_ref().and_then(|h| h.host.clone()),
                probe.tcp_socket.as_ref().and_then(|t| t.host.clone()),
            ];
            if hosts.iter().flatten().any(|h| !h.is_empty()) {
                found.push(format!("probe host (container {:?})", container.name));
            }
        }
    }
    // AppArmor: unset, RuntimeDefault or Localhost.
    let apparmor_ok = |t: &str| matches!(t, "RuntimeDefault" | "Localhost");
    if let Some(profile) = &pod.app_armor_profile
        && !apparmor_ok(&profile.type_)
    {
        found.push(format!("forbidden AppArmor profile ({})", profile.type_));
    }
    for (name, c) in &containers {
        if let Some(profile) = c.as_ref().and_then(|c| c.app_armor_profile.as_ref())
            && !apparmor_ok(&profile.type_)
        {
            found.push(format!(
                "forbidden AppArmor profile (container {name:?}: {})",
                profile.type_
            ));
        }
    }
    // SELinux: an allowed type, no user or role.
    let selinux = std::iter::once(pod.se_linux_options.clone()).chain(
        containers
            .iter()
            .map(|(_, c)| c.as_ref().and_then(|c| c.se_linux_options.clone())),
    );
    for options in selinux.flatten() {
        if !SELINUX_TYPES.contains(&options.type_.as_deref().unwrap_or(""))
            || options.user.as_deref().is_some_and(|u| !u.is_empty())
            || options.role.as_deref().is_some_and(|r| !r.is_empty())
        {
            found.push(format!("seLinuxOptions ({options:?})"));
        }
    }
    // /proc mount type.
    for (name, c) in &containers {
        if let Some(mount) = c.as_ref().and_then(|c| c.proc_mount.as_deref())
            && mount != "Default"
        {
            found.push(format!("procMount (container {name:?}: {mount})"));
        }
    }
    // Seccomp: not Unconfined.
    if pod
        .seccomp_profile
        .as_ref()
        .is_some_and(|p| p.type_ == "Unconfined")
    {
        found.push("seccompProfile (pod must not set securityContext.seccompProfile.type to \"Unconfined\")".into());
    }
    for (name, c) in &containers {
        if c.as_ref()
            .and_then(|c| c.seccomp_profile.as_ref())
            .is_some_and(|p| p.type_ == "Unconfined")
        {
            found.push(format!("seccompProfile (container {name:?} must not set securityContext.seccompProfile.type to \"Unconfined\")"));
        }
    }
    // Sysctls.
    for sysctl in pod.sysctls.iter().flatten() {
        if !SAFE_SYSCTLS.contains(&sysctl.name.as_str()) {
            found.push(format!("forbidden sysctls ({})", sysctl.name));
        }
    }
    found
}

fn restricted(spec: &PodSpec) -> Vec<String> {
    let mut found = Vec::new();
    let pod = spec.security_context.clone().unwrap_or_default();
    let containers = containers(spec);
    // Volume types: none with host access.
    for volume in spec.volumes.iter().flatten() {
        let allowed = volume.config_map.is_some()
            || volume.csi.is_some()
            || volume.downward_api.is_some()
            || volume.empty_dir.is_some()
            || volume.ephemeral.is_some()
            || volume.persistent_volume_claim.is_some()
            || volume.projected.is_some()
            || volume.secret.is_some();
        if !allowed {
            found.push(format!(
                "restricted volume types (volume {:?})",
                volume.name
            ));
        }
    }
    // Privilege escalation: every container sets allowPrivilegeEscalation=false.
    for (name, c) in &containers {
        if c.as_ref().and_then(|c| c.allow_privilege_escalation) != Some(false) {
            found.push(format!(
                "allowPrivilegeEscalation != false (container {name:?} must set securityContext.allowPrivilegeEscalation=false)"
            ));
        }
    }
    // Running as non-root: the pod says so and no container says otherwise, or every
    // container says so.
    let pod_non_root = pod.run_as_non_root == Some(true);
    for (name, c) in &containers {
        match c.as_ref().and_then(|c| c.run_as_non_root) {
            Some(false) => found.push(format!(
                "runAsNonRoot != true (container {name:?} must not set securityContext.runAsNonRoot=false)"
            )),
            None if !pod_non_root => found.push(format!(
                "runAsNonRoot != true (pod or container {name:?} must set securityContext.runAsNonRoot=true)"
            )),
            _ => {}
        }
    }
    // Running as a non-root user.
    if pod.run_as_user == Some(0) {
        found.push("runAsUser=0 (pod must not set runAsUser=0)".into());
    }
    for (name, c) in &containers {
        if c.as_ref().and_then(|c| c.run_as_user) == Some(0) {
            found.push(format!(
                "runAsUser=0 (container {name:?} must not set runAsUser=0)"
            ));
        }
    }
    // Seccomp: RuntimeDefault or Localhost, on the pod or on every container.
    let confined = |t: &str| matches!(t, "RuntimeDefault" | "Localhost");
    let pod_confined = pod
        .seccomp_profile
        .as_ref()
        .is_some_and(|p| confined(&p.type_));
    for (name, c) in &containers {
        match c.as_ref().and_then(|c| c.seccomp_profile.as_ref()) {
            Some(p) if !confined(&p.type_) => found.push(format!(
                "seccompProfile (container {name:?} must not set securityContext.seccompProfile.type to {:?})",
                p.type_
            )),
            None if !pod_confined => found.push(format!(
                "seccompProfile (pod or container {name:?} must set securityContext.seccompProfile.type to \"RuntimeDefault\" or \"Localhost\")"
            )),
            _ => {}
        }
    }
    // Capabilities: ALL dropped, only NET_BIND_SERVICE added.
    for (name, c) in &containers {
        let capabilities = c
            .as_ref()
            .and_then(|c| c.capabilities.clone())
            .unwrap_or_default();
        if !capabilities.drop.iter().flatten().any(|d| d == "ALL") {
            found.push(format!(
                "unrestricted capabilities (container {name:?} must set securityContext.capabilities.drop=[\"ALL\"])"
            ));
        }
        for capability in capabilities.add.iter().flatten() {
            if capability != "NET_BIND_SERVICE" {
                found.push(format!(
                    "unrestricted capabilities (container {name:?} must not include {capability:?} in securityContext.capabilities.add)"
                ));
            }
        }
    }
    found
}
