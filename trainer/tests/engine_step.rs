//! The recorded step computes what the step as it comes computes: the same losses and the
//! same weights, step after step (on the CPU nothing is recorded, so this checks its inputs,
//! totals and gradient zeroing; `tests/gpu.rs` checks the CUDA graph against it).

use ringmaster_trainer::engine::data::SyntheticData;
use ringmaster_trainer::engine::step::{RecordedStep, WARMUP_STEPS};
use ringmaster_trainer::engine::{Arch, Model, Sgd};

#[test]
fn a_recorded_step_trains_as_the_plain_step_does() {
    let arch = Arch::CifarResNet { depth: 8, width: 8 };
    let data = SyntheticData::new(10, 16, 32, 5);
    let mut plain = Model::new(arch, 10, 11);
    let mut recorded_model = Model::new(arch, 10, 11);
    let mut sgd = Sgd::new(plain.params(), 0.9, 1e-4);
    let mut recorded_sgd = Sgd::new(recorded_model.params(), 0.9, 1e-4);
    let mut recorded = RecordedStep::new(&recorded_model, 8, 16, true);
    for step in 0..WARMUP_STEPS + 3 {
        let indices: Vec<usize> = (step * 8..step * 8 + 8).map(|i| i % 32).collect();
        let (images, labels) = data.batch(&indices);

        plain.zero_grads();
        let want = plain.forward_backward(&images, &labels, 0.1, 1.0);
        sgd.step(plain.params_mut(), 0.05);

        recorded.load(&recorded_model, &images, &labels);
        recorded.run(&mut recorded_model, 0.1);
        let got = recorded.stats(&recorded_model);
        recorded_sgd.step(recorded_model.params_mut(), 0.05);

        assert_eq!(got, want, "step {step}");
        assert_eq!(
            recorded_model.params().values,
            plain.params().values,
            "weights after step {step}"
        );
        assert_eq!(recorded_model.params().buffers, plain.params().buffers);
    }
    // The CPU runs every step as it comes.
    assert!(!recorded.recorded());
}

#[test]
#[should_panic(expected = "a batch of another shape")]
fn a_batch_of_another_shape_is_refused() {
    let model = Model::new(Arch::CifarResNet { depth: 8, width: 8 }, 10, 1);
    let mut recorded = RecordedStep::new(&model, 8, 16, false);
    let (images, labels) = SyntheticData::new(10, 32, 8, 1).batch(&[0, 1, 2, 3, 4, 5, 6, 7]);
    recorded.load(&model, &images, &labels);
}

/// `bench-engine --from-host` uploads its batch again behind every step, as `train` feeds
/// its steps: the same batch, so the same training as the batch kept on the device.
#[test]
fn the_engine_benchmark_from_host_memory_trains_as_from_the_device() {
    use ringmaster_trainer::bench::{EngineBench, engine};
    let arch = Arch::CifarResNet { depth: 8, width: 8 };
    let run = |from_host| {
        let mut model = Model::new(arch, 10, 3);
        let bench = EngineBench {
            image_size: 16,
            batch_size: 4,
            steps: 2,
            warmup: 1,
            record: false,
            from_host,
            profile: false,
        };
        let (images_per_second, step_ms, recorded) = engine(&mut model, &bench);
        assert!(images_per_second > 0.0 && step_ms > 0.0 && !recorded);
        model.params().values.clone()
    };
    let (kept, uploaded) = (run(false), run(true));
    assert_ne!(kept, Model::new(arch, 10, 3).params().values, "it trained");
    assert_eq!(uploaded, kept);
}
