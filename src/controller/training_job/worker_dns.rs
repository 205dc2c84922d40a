//! The workers' DNS names, published by the operator. Each job's headless Service has no
//! selector: the operator writes its one EndpointSlice itself, with a record per worker
//! (`<pod>.<service>.<namespace>.svc` → the pod's IP), once every worker of the gang has its
//! IP, and again only when an address it published is no longer a worker's.
//!
//! Why not a selector: the cluster's endpoints and EndpointSlice controllers then rewrite a
//! job's Endpoints and EndpointSlice at each of its workers' changes (scheduled, given an IP,
//! ready): measured at 1,000 jobs × 8 workers, about 13 syncs of each per job, 780 s of the
//! controller manager's work, and two writes to the API server per sync. The launcher needs
//! every name at once, and a worker's readiness probe (ssh to its own name) needs its own
//! only: one write per gang gives both.
//!
//! Pure: the snapshot reads the slice, the plan decides with [`to_publish`], the build makes
//! the slice (`build::worker_endpoints`) and apply writes it.

use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::ResourceExt;

use super::names::SERVICE_NAME_LABEL;
use super::observe::Observed;

/// One worker's DNS record: `<hostname>.<service>.<namespace>.svc` resolves to `ip`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct WorkerAddress {
    /// The worker pod's name (its hostname).
    pub hostname: String,
    /// The worker pod's IP.
    pub ip: String,
}

/// The records the job's EndpointSlice holds, and the Service it is of (the gang's naming
/// decides the Service's name).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Published {
    /// The Service the slice is of (its `kubernetes.io/service-name` label).
    pub service: String,
    /// Its records.
    pub addresses: Vec<WorkerAddress>,
}

impl Published {
    /// Reads a slice this operator wrote for job `uid` (the cache holds only slices of its
    /// manager label); `None` for one another job controls (an earlier job's of the same
    /// name, until the garbage collector takes it).
    pub fn of(slice: &EndpointSlice, uid: &str) -> Option<Self> {
        let ours = slice
            .owner_references()
            .iter()
            .any(|o| o.controller == Some(true) && o.uid == uid);
        if !ours {
            return None;
        }
        let addresses = slice
            .endpoints
            .iter()
            .flatten()
            .flat_map(|e| {
                let hostname = e.hostname.clone().unwrap_or_default();
                e.addresses.iter().map(move |ip| WorkerAddress {
                    hostname: hostname.clone(),
                    ip: ip.clone(),
                })
            })
            .collect();
        Some(Self {
            service: slice
                .labels()
                .get(SERVICE_NAME_LABEL)
                .cloned()
                .unwrap_or_default(),
            addresses,
        })
    }
}

/// The records of the gang's workers that have an IP (not those being deleted or finished),
/// in worker order, and whether every worker of the gang has one.
pub fn wanted(observed: &Observed) -> (Vec<WorkerAddress>, bool) {
    let addresses: Vec<WorkerAddress> = observed
        .workers
        .iter()
        .flatten()
        .filter(|w| !w.is_deleting() && !w.is_finished())
        .filter_map(|w| {
            w.address.as_ref().map(|ip| WorkerAddress {
                hostname: w.name.clone(),
                ip: ip.clone(),
            })
        })
        .collect();
    let complete = addresses.len() == observed.workers.len();
    (addresses, complete)
}

/// What to write to the EndpointSlice of `service`, if anything: the `wanted` records once
/// they are `complete` (one write per gang, not one per worker), or at once when the slice
/// holds a record that is no longer a worker's (a gang replaced, a worker gone: its IP may be
/// another pod's soon). Nothing when the slice holds them already.
pub fn to_publish(
    service: &str,
    wanted: Vec<WorkerAddress>,
    complete: bool,
    published: Option<&Published>,
) -> Option<Vec<WorkerAddress>> {
    let current = published
        .filter(|p| p.service == service)
        .map_or(&[][..], |p| p.addresses.as_slice());
    if current == wanted.as_slice() {
        return None;
    }
    let stale = current.iter().any(|a| !wanted.contains(a));
    (complete || stale).then_some(wanted)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(hostname: &str, ip: &str) -> WorkerAddress {
        WorkerAddress {
            hostname: hostname.into(),
            ip: ip.into(),
        }
    }

    fn published(addresses: Vec<WorkerAddress>) -> Published {
        Published {
            service: "j-workers".into(),
            addresses,
        }
    }

    #[test]
    fn a_gang_is_published_once_every_worker_has_its_ip() {
        let some = vec![at("j-worker-0", "10.0.0.1")];
        assert_eq!(to_publish("j-workers", some.clone(), false, None), None);
        let all = vec![at("j-worker-0", "10.0.0.1"), at("j-worker-1", "10.0.0.2")];
        assert_eq!(
            to_publish("j-workers", all.clone(), true, None),
            Some(all.clone())
        );
        // Written: nothing more to do.
        assert_eq!(
            to_publish(
                "j-workers",
                all.clone(),
                true,
                Some(&published(all.clone()))
            ),
            None
        );
        // The same records under another Service's name (a gang that changed its naming)
        // are not this Service's.
        let other = Published {
            service: "j-workers-1a2b3".into(),
            addresses: all.clone(),
        };
        assert_eq!(
            to_publish("j-workers", all.clone(), true, Some(&other)),
            Some(all)
        );
    }

    #[test]
    fn a_record_that_is_no_longer_a_workers_goes_at_once() {
        let old = published(vec![
            at("j-worker-0", "10.0.0.1"),
            at("j-worker-1", "10.0.0.2"),
        ]);
        // The gang was replaced: its new workers have no IPs yet.
        assert_eq!(
            to_publish("j-workers", vec![], false, Some(&old)),
            Some(vec![])
        );
        // Worker 1 came back with another IP, worker 0 not yet.
        let partial = vec![at("j-worker-1", "10.0.0.9")];
        assert_eq!(
            to_publish("j-workers", partial.clone(), false, Some(&old)),
            Some(partial.clone())
        );
        // A slice that holds a subset of what is wanted waits for the rest.
        let some = published(partial.clone());
        let more = vec![at("j-worker-1", "10.0.0.9"), at("j-worker-2", "10.0.0.3")];
        assert_eq!(to_publish("j-workers", more, false, Some(&some)), None);
    }
}
