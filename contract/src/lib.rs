//! The contracts between Ringmaster's programs, each defined once and used by both sides.
//!
//! * [`trainer`] — how the operator invokes `ringmaster-trainer train` (the typed
//!   [`trainer::TrainArgs`] that is also the trainer's own command line), what the trainer of
//!   this release can do ([`trainer::Capabilities`]), the settings check both sides run
//!   ([`trainer::TrainArgs::check`]), the JSON summary it leaves in the launcher's
//!   termination message ([`trainer::Summary`]), or a failing rank's error in its place
//!   ([`trainer::Failure`]), and its exit codes ([`trainer::exit`]).
//!
//! The crate depends on neither kube nor k8s-openapi, so the trainer stays free of them.

pub mod trainer;
