//! What the launcher's reports add to the status ([`crate::report`]): the progress while
//! the job runs, its last word once it ended, and the fabric with a condition that warns when
//! InfiniBand was asked for and NCCL chose sockets. Pure.

use crate::api::{TrainingJobPhase, TrainingJobStatus, TrainingProgress};
use crate::controller::conditions::{self, DesiredCondition};
use crate::report::board::{Entry, fabric_status};

use super::condition_names::{condition_types, reasons};

/// `status` (just planned) with the reports in `entry`, for a job that asked for InfiniBand
/// when `infiniband`. `old` is the status before.
pub fn with_reports(
    mut status: TrainingJobStatus,
    old: &TrainingJobStatus,
    entry: Option<&Entry>,
    infiniband: bool,
    generation: Option<i64>,
    now: &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time,
) -> TrainingJobStatus {
    status.progress = match status.phase {
        TrainingJobPhase::Running => entry
            .and_then(Entry::progress)
            .or_else(|| old.progress.clone()),
        TrainingJobPhase::Succeeded => finished(old.progress.as_ref(), &status),
        _ => old.progress.clone(),
    };
    if let Some(fabric) = entry.and_then(|e| e.fabric.as_ref()) {
        status.fabric = Some(fabric_status(fabric));
    }
    if infiniband && let Some(desired) = status.fabric.as_ref().and_then(fabric_condition) {
        conditions::set(&mut status.conditions, desired, generation, now);
    }
    status
}

/// A finished job's progress: all steps done, the whole run's images per second (the
/// result's), no time left.
fn finished(
    last: Option<&TrainingProgress>,
    status: &TrainingJobStatus,
) -> Option<TrainingProgress> {
    let result = status.result.as_ref();
    let steps = result.and_then(|r| r.steps).or(last.map(|p| p.step))?;
    Some(TrainingProgress {
        step: steps,
        total_steps: Some(steps),
        percent_done: Some("100%".into()),
        loss: result
            .and_then(|r| r.final_loss)
            .or(last.and_then(|p| p.loss)),
        images_per_second: result
            .and_then(|r| r.images_per_second)
            .map(|r| r.round() as i64)
            .or(last.and_then(|p| p.images_per_second)),
        time_remaining: None,
        estimated_completion_time: None,
        report_time: last
            .map(|p| p.report_time.clone())
            .or_else(|| status.completion_time.clone())?,
    })
}

/// Whether NCCL carries the gradients over InfiniBand on every rank, as a condition.
fn fabric_condition(fabric: &crate::api::FabricStatus) -> Option<DesiredCondition> {
    if fabric.collective != "nccl" || fabric.world_size < 2 {
        return None;
    }
    if fabric.ranks_on_infiniband >= fabric.world_size {
        return Some(DesiredCondition::new(
            condition_types::INFINIBAND_USED,
            true,
            reasons::NCCL_USES_INFINIBAND,
            format!(
                "NCCL carries the gradients over InfiniBand on all {} ranks{}",
                fabric.world_size,
                if fabric.gpu_direct_rdma {
                    " (GPUDirect RDMA)"
                } else {
                    ""
                }
            ),
        ));
    }
    Some(DesiredCondition::new(
        condition_types::INFINIBAND_USED,
        false,
        reasons::NCCL_CHOSE_SOCKETS,
        format!(
            "infiniband.enabled is set but NCCL carries the gradients over InfiniBand on {} of {} ranks (rank 0: network {}, transports {}); training runs, slower. Check the nodes' RDMA device plugin and resource, the image's rdma-core and ibverbs-providers, and NCCL_IB_* settings (docs/troubleshooting.md, \"InfiniBand not used\")",
            fabric.ranks_on_infiniband,
            fabric.world_size,
            fabric.network.as_deref().unwrap_or("unknown"),
            if fabric.transports.is_empty() {
                "none".to_string()
            } else {
                fabric.transports.join(", ")
            },
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::TrainingResult;
    use crate::report::board::Board;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use k8s_openapi::jiff::Timestamp;
    use ringmaster_contract::progress::Report;
    use ringmaster_contract::trainer::{Fabric, Progress};

    fn t(seconds: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + seconds).unwrap()
    }

    fn entry(fabric: Option<Fabric>) -> Entry {
        let board = Board::default();
        for (step, at) in [(10, 0), (20, 10)] {
            let report = Report {
                step: Some(Progress {
                    step,
                    loss: Some(1.5),
                    accuracy: None,
                    learning_rate: 0.1,
                    images_per_second: Some(640.0),
                    recent_images_per_second: None,
                    total_steps: Some(100),
                }),
                fabric: fabric.clone(),
            };
            board.record("ns/j", "uid", report, t(at));
        }
        board.read("ns/j").unwrap()
    }

    fn sockets(ranks_on_infiniband: u64) -> Fabric {
        Fabric {
            collective: "nccl".into(),
            network: Some("Socket".into()),
            transports: vec!["NET/Socket".into()],
            gpu_direct_rdma: false,
            ranks_on_infiniband,
            world_size: 16,
        }
    }

    fn running() -> TrainingJobStatus {
        TrainingJobStatus {
            phase: TrainingJobPhase::Running,
            ..TrainingJobStatus::default()
        }
    }

    #[test]
    fn a_running_job_shows_its_reports_and_a_finished_one_its_whole_run() {
        let now = Time(t(20));
        let old = TrainingJobStatus::default();
        let live = with_reports(running(), &old, Some(&entry(None)), false, Some(1), &now);
        let progress = live.progress.clone().unwrap();
        assert_eq!(progress.percent_done.as_deref(), Some("20%"));
        assert_eq!(
            progress.time_remaining.as_deref(),
            Some("1m20s"),
            "80 steps at 1/s"
        );
        // No report yet after an operator restart: the written progress stays.
        let kept = with_reports(running(), &live, None, false, Some(1), &now);
        assert_eq!(kept.progress, live.progress);
        let done = TrainingJobStatus {
            phase: TrainingJobPhase::Succeeded,
            result: Some(TrainingResult {
                images_per_second: Some(655.44),
                steps: Some(100),
                final_loss: Some(0.25),
                ..TrainingResult::default()
            }),
            ..TrainingJobStatus::default()
        };
        let done = with_reports(done, &live, None, false, Some(1), &now)
            .progress
            .unwrap();
        assert_eq!(
            (
                done.step,
                done.percent_done.as_deref(),
                done.images_per_second,
                done.loss
            ),
            (100, Some("100%"), Some(655), Some(0.25))
        );
        assert_eq!(done.time_remaining, None);
    }

    #[test]
    fn infiniband_asked_for_and_sockets_chosen_is_a_false_condition_naming_what_nccl_said() {
        let now = Time(t(20));
        let old = TrainingJobStatus::default();
        let status = with_reports(
            running(),
            &old,
            Some(&entry(Some(sockets(0)))),
            true,
            Some(1),
            &now,
        );
        assert_eq!(
            status.fabric.as_ref().unwrap().network.as_deref(),
            Some("Socket")
        );
        let condition =
            conditions::find(&status.conditions, condition_types::INFINIBAND_USED).unwrap();
        assert_eq!(
            (condition.status.as_str(), condition.reason.as_str()),
            ("False", reasons::NCCL_CHOSE_SOCKETS)
        );
        assert!(
            condition
                .message
                .contains("on 0 of 16 ranks (rank 0: network Socket, transports NET/Socket)"),
            "{}",
            condition.message
        );
        let on_ib = Fabric {
            network: Some("IB".into()),
            transports: vec!["NET/IB".into()],
            gpu_direct_rdma: true,
            ..sockets(16)
        };
        let status = with_reports(
            running(),
            &old,
            Some(&entry(Some(on_ib))),
            true,
            Some(1),
            &now,
        );
        let condition =
            conditions::find(&status.conditions, condition_types::INFINIBAND_USED).unwrap();
        assert_eq!(condition.status, "True");
        assert!(condition.message.contains("GPUDirect RDMA"));
        // Not asked for, or the TCP ring: the fabric is shown and no condition is set.
        let status = with_reports(
            running(),
            &old,
            Some(&entry(Some(sockets(0)))),
            false,
            Some(1),
            &now,
        );
        assert!(status.fabric.is_some());
        assert!(conditions::find(&status.conditions, condition_types::INFINIBAND_USED).is_none());
        let ring = Fabric {
            collective: "tcp-ring".into(),
            ..sockets(0)
        };
        let status = with_reports(
            running(),
            &old,
            Some(&entry(Some(ring))),
            true,
            Some(1),
            &now,
        );
        assert!(conditions::find(&status.conditions, condition_types::INFINIBAND_USED).is_none());
    }
}
