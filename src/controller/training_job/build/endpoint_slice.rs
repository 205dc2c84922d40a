//! The EndpointSlice that gives the job's workers their DNS names (see `worker_dns`).

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};

use super::metadata;
use crate::controller::training_job::names::{
    self, ChildNaming, RENDEZVOUS_PORT, SERVICE_NAME_LABEL, SLICE_MANAGED_BY_LABEL, SLICE_MANAGER,
};
use crate::controller::training_job::spec::ValidatedTrainingJob;
use crate::controller::training_job::worker_dns::WorkerAddress;

/// The slice of the job's headless Service (same name) with one endpoint per worker record:
/// its IP, its pod name as hostname (CoreDNS serves `<hostname>.<service>.<namespace>.svc`
/// from it) and the pod it is. Every record is ready: as with the Service's
/// `publishNotReadyAddresses`, a worker's name resolves while its readiness probe (ssh to that
/// name) is checked. The address type follows the first IP (a cluster's pod IPs are of one
/// family); records of the other family are left out.
pub fn worker_endpoints(
    job: &ValidatedTrainingJob,
    naming: ChildNaming,
    addresses: &[WorkerAddress],
) -> EndpointSlice {
    let service = names::worker_service(job, naming);
    let mut labels = names::job_labels(&job.name);
    labels.insert(names::ROLE_LABEL.into(), "workers".into());
    labels.insert(SERVICE_NAME_LABEL.into(), service.clone());
    labels.insert(SLICE_MANAGED_BY_LABEL.into(), SLICE_MANAGER.into());
    let ipv6 = |ip: &str| ip.contains(':');
    let family_v6 = addresses.first().is_some_and(|a| ipv6(&a.ip));
    let endpoints: Vec<Endpoint> = addresses
        .iter()
        .filter(|a| ipv6(&a.ip) == family_v6)
        .map(|a| endpoint(job, a))
        .collect();
    let port = |name: &str, port: i32| EndpointPort {
        name: Some(name.into()),
        port: Some(port),
        protocol: Some("TCP".into()),
        app_protocol: None,
    };
    EndpointSlice {
        metadata: metadata(job, service, labels),
        address_type: if family_v6 { "IPv6" } else { "IPv4" }.into(),
        endpoints: Some(endpoints),
        ports: Some(vec![
            port("ssh", job.mpi.ssh_port),
            port("rendezvous", RENDEZVOUS_PORT.into()),
        ]),
    }
}

fn endpoint(job: &ValidatedTrainingJob, address: &WorkerAddress) -> Endpoint {
    Endpoint {
        addresses: vec![address.ip.clone()],
        hostname: Some(address.hostname.clone()),
        conditions: Some(EndpointConditions {
            ready: Some(true),
            serving: Some(true),
            terminating: Some(false),
        }),
        target_ref: Some(ObjectReference {
            kind: Some("Pod".into()),
            namespace: Some(job.namespace.clone()),
            name: Some(address.hostname.clone()),
            ..ObjectReference::default()
        }),
        ..Endpoint::default()
    }
}
