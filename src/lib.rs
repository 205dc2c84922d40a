//! Ringmaster: a Kubernetes operator for distributed deep-learning training on AKS.
//!
//! `api` holds the custom resources; `controller` the reconcilers (one module per kind,
//! split into validate → build → apply → status steps); `validation` the schema and CEL
//! checks the validate steps share; `kueue` the part of Kueue's API a queued TrainingJob
//! uses; `gang` the scheduler-plugins or Volcano PodGroup a gang-scheduled job
//! gets; `crdgen` prints the CRDs and `apidocs` their reference; `report` takes running jobs' progress reports; `metrics`, `server` and
//! `telemetry` are the operator's plumbing.

pub mod aks;
pub mod api;
pub mod apidocs;
pub mod controller;
pub mod crdgen;
pub mod gang;
pub mod kube_client;
pub mod kueue;
pub mod leader;
pub mod metrics;
pub mod report;
pub mod server;
pub mod stage;
pub mod telemetry;
pub mod tls;
pub mod validation;
