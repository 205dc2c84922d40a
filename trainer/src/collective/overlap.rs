//! How much of a step's all-reduce time the backward pass hid: from the times at which each
//! bucket of gradients was ready (written by backward), its all-reduce started and ended,
//! on one clock (CUDA events on the compute and NCCL streams).

use ringmaster_contract::trainer::AllReduceTiming;

/// One bucket's times, in milliseconds on one clock.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BucketTimes {
    /// Its gradients were written (recorded on the compute stream).
    pub ready: f64,
    /// Its all-reduce began (on the collective's stream).
    pub start: f64,
    /// Its all-reduce ended.
    pub end: f64,
}

/// The step's figures, with the backward pass's end taken as the last bucket's `ready`
/// (the last bucket, the stem's gradients, is ready when backward has run): all-reduce
/// time before it was hidden behind backward, the rest was waited for.
pub fn timing(step: u64, buckets: &[BucketTimes]) -> Option<AllReduceTiming> {
    let backward_end = buckets.last()?.ready;
    let mut busy = 0.0;
    let mut hidden = 0.0;
    for b in buckets {
        let length = (b.end - b.start).max(0.0);
        busy += length;
        hidden += (backward_end.min(b.end) - b.start).clamp(0.0, length);
    }
    let in_flight = buckets
        .iter()
        .enumerate()
        .map(|(i, b)| {
            buckets[..=i]
                .iter()
                .filter(|earlier| earlier.end > b.ready)
                .count()
        })
        .max()
        .unwrap_or(0);
    let last_end = buckets.iter().map(|b| b.end).fold(f64::MIN, f64::max);
    Some(AllReduceTiming {
        step,
        buckets: buckets.len() as u64,
        max_in_flight: in_flight as u64,
        all_reduce_ms: round(busy),
        hidden_ms: round(hidden),
        hidden_percent: if busy > 0.0 {
            round(100.0 * hidden / busy)
        } else {
            100.0
        },
        waited_ms: round((last_end - backward_end).max(0.0)),
    })
}

/// To the hundredth: CUDA events resolve about half a microsecond.
fn round(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(ready: f64, start: f64, end: f64) -> BucketTimes {
        BucketTimes { ready, start, end }
    }

    #[test]
    fn all_reduces_before_the_end_of_backward_are_hidden_the_rest_waited_for() {
        // Backward ends at 10 (the last bucket's ready). Bucket 1 runs 2..5 (hidden), bucket
        // 2 runs 6..12 (4 of 6 hidden), the last 12..15 (waited).
        let t = timing(
            7,
            &[b(1.0, 2.0, 5.0), b(4.0, 6.0, 12.0), b(10.0, 12.0, 15.0)],
        )
        .unwrap();
        assert_eq!(t.step, 7);
        assert_eq!(t.buckets, 3);
        assert_eq!(t.all_reduce_ms, 12.0);
        assert_eq!(t.hidden_ms, 7.0);
        assert_eq!(t.hidden_percent, 58.33);
        assert_eq!(t.waited_ms, 5.0);
        // At 10, bucket 2 (ends 12) and the last are queued and unfinished.
        assert_eq!(t.max_in_flight, 2);
    }

    #[test]
    fn a_single_bucket_after_backward_hides_nothing() {
        let t = timing(1, &[b(10.0, 10.5, 20.5)]).unwrap();
        assert_eq!(
            (t.hidden_ms, t.hidden_percent, t.waited_ms),
            (0.0, 0.0, 10.5)
        );
        assert_eq!(t.max_in_flight, 1);
        assert!(timing(1, &[]).is_none());
    }
}
