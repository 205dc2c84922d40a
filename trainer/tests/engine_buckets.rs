//! Gradient buckets: all-reduced while backward runs, each launched only once all of its
//! gradients are final, together covering the buffer exactly once.

use std::ops::Range;

use ringmaster_trainer::engine::buckets::{BUCKET_ELEMENTS, GradientBuckets};
use ringmaster_trainer::engine::data::SyntheticData;
use ringmaster_trainer::engine::{Arch, CpuBackend, Model, Tensor};

/// Feeds `offsets` (as backward reports them) and collects the launched ranges.
fn launches(len: usize, bucket: usize, offsets: &[usize]) -> Vec<Range<usize>> {
    let mut buckets = GradientBuckets::new(len, bucket);
    let launched = offsets.iter().filter_map(|&o| buckets.ready(o)).collect();
    assert!(
        buckets.done(),
        "backward ended at 0, so everything was launched"
    );
    launched
}

#[test]
fn buckets_fill_before_they_launch_and_the_last_one_takes_the_rest() {
    // Layers finishing at these offsets of a 100-element buffer, buckets of 30.
    let got = launches(100, 30, &[90, 75, 60, 40, 20, 5, 0]);
    assert_eq!(got, vec![60..100, 20..60, 0..20]);
}

#[test]
fn a_model_smaller_than_one_bucket_is_reduced_once_at_the_end() {
    assert_eq!(launches(1000, 5000, &[900, 500, 100, 0]), vec![0..1000]);
}

#[test]
#[should_panic(expected = "out of order")]
fn gradients_reported_final_out_of_order_are_a_bug() {
    let mut buckets = GradientBuckets::new(100, 10);
    buckets.ready(50);
    buckets.ready(60);
}

/// The offsets ResNet-50's backward reports, and what each says: at that moment, every
/// gradient from the offset on already has its final value.
#[test]
fn resnet_backward_reports_gradients_final_only_once_they_are() {
    let mut model = Model::new(Arch::ResNet18, 10, 3);
    let data = SyntheticData::new(10, 32, 4, 1);
    let (images, labels) = data.batch(&[0, 1, 2, 3]);
    let images = Tensor::upload(&CpuBackend, &images, model.activations());
    let mut reports: Vec<(usize, Vec<f32>)> = Vec::new();
    model.zero_grads();
    model.forward_backward_on_device_with(&images, &labels, 0.0, 1.0, &mut |_, grads, from| {
        reports.push((from, grads[from..].to_vec()))
    });
    let final_grads = model.params().grads.clone();
    let offsets: Vec<usize> = reports.iter().map(|r| r.0).collect();
    // fc, 8 blocks, the stem: descending to 0.
    assert_eq!(offsets.len(), 10, "{offsets:?}");
    assert!(offsets.windows(2).all(|w| w[0] > w[1]), "{offsets:?}");
    assert_eq!(offsets.last(), Some(&0));
    for (from, snapshot) in &reports {
        assert_eq!(
            snapshot,
            &final_grads[*from..],
            "gradients from {from} changed after backward called them final"
        );
    }
    // ResNet-18's 11.2 M parameters in DDP's 25 MiB buckets: launched in two.
    let launched = launches(final_grads.len(), BUCKET_ELEMENTS, &offsets);
    assert_eq!(launched.len(), 2, "{launched:?}");
    assert_eq!(launched[0].end, final_grads.len());
    assert_eq!(launched[1], 0..launched[0].start);
}
