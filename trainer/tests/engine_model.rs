//! ResNet construction, shapes, gradient accumulation and a short training run.

use std::time::Instant;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use ringmaster_trainer::engine::data::{LearnableData, shard};
use ringmaster_trainer::engine::{Arch, LrKind, LrSchedule, Model, Sgd, Tensor};

#[test]
fn resnet18_and_resnet50_match_torchvision_parameter_counts() {
    assert_eq!(
        Model::new(Arch::ResNet18, 1000, 0).num_parameters(),
        11_689_512
    );
    assert_eq!(
        Model::new(Arch::ResNet50, 1000, 0).num_parameters(),
        25_557_032
    );
}

#[test]
fn parameter_names_follow_torchvision() {
    let model = Model::new(Arch::ResNet18, 10, 0);
    let p = model.params();
    let names: Vec<&str> = p.entries.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names[..3], ["conv1.weight", "bn1.weight", "bn1.bias"]);
    assert_eq!(names.last(), Some(&"fc.bias"));
    assert_eq!(
        p.entry("layer2.0.downsample.0.weight").unwrap().shape,
        [128, 64, 1, 1]
    );
    assert_eq!(p.entry("fc.weight").unwrap().shape, [10, 512]);
    assert!(p.entry("layer1.0.downsample.0.weight").is_none());
    assert!(
        p.buffer_entries
            .iter()
            .any(|e| e.name == "layer4.1.bn2.running_var")
    );
    // Entries tile the flat buffer with no gaps, so all-reduce can use it whole.
    let mut end = 0;
    for e in &p.entries {
        assert_eq!(e.offset, end);
        end += e.len();
    }
    assert_eq!(end, p.values.len());
    assert_eq!(p.grads.len(), p.values.len());
}

#[test]
fn initialisation_is_deterministic_per_seed() {
    let arch = Arch::CifarResNet { depth: 8, width: 4 };
    let a = Model::new(arch, 4, 3);
    let b = Model::new(arch, 4, 3);
    let c = Model::new(arch, 4, 4);
    assert_eq!(a.params().values, b.params().values);
    assert_ne!(a.params().values, c.params().values);
}

#[test]
fn resnet18_forward_at_64x64() {
    let mut model = Model::new(Arch::ResNet18, 1000, 1);
    let images = Tensor::randn(&[1, 3, 64, 64], 1.0, &mut ChaCha8Rng::seed_from_u64(0));
    let logits = model.forward(&images, false);
    assert_eq!(logits.shape, [1, 1000]);
    assert!(logits.all_finite());
}

#[test]
fn bottleneck_resnet_forward_backward_shapes() {
    // ResNet-50's topology at a tiny input: exercises bottlenecks and the max-pool stem.
    let mut model = Model::new(Arch::ResNet50, 7, 2);
    let data = LearnableData::new(7, 16, 0);
    let (images, labels) = data.batch(&[0, 1]);
    let stats = model.train_step(&images, &labels, 0.1);
    assert!(stats.loss.is_finite());
    let g = &model.params().grads;
    assert!(g.iter().all(|x| x.is_finite()));
    assert!(g.iter().any(|&x| x != 0.0));
}

#[test]
fn forward_backward_accumulates_and_zero_grads_clears() {
    let arch = Arch::CifarResNet { depth: 8, width: 2 };
    let data = LearnableData::new(3, 8, 1);
    let (images, labels) = data.batch(&[0, 1, 2, 3]);

    let mut once = Model::new(arch, 3, 9);
    once.zero_grads();
    let s1 = once.forward_backward(&images, &labels, 0.1, 0.5);

    let mut twice = Model::new(arch, 3, 9);
    twice.zero_grads();
    twice.forward_backward(&images, &labels, 0.1, 0.25);
    let s2 = twice.forward_backward(&images, &labels, 0.1, 0.25);
    assert_eq!(s1.batch, 4);
    assert!((s1.loss - s2.loss).abs() < 1e-6, "same batch, same loss");
    for (a, b) in once.params().grads.iter().zip(&twice.params().grads) {
        assert!((a - b).abs() <= 1e-5 + 1e-4 * a.abs(), "{a} vs {b}");
    }

    // train_step = zero + forward_backward(1.0): twice the 0.5-scaled gradient.
    let mut step = Model::new(arch, 3, 9);
    step.params_mut().grads.fill(123.0);
    step.train_step(&images, &labels, 0.1);
    for (a, b) in once.params().grads.iter().zip(&step.params().grads) {
        assert!((2.0 * a - b).abs() <= 1e-5 + 1e-4 * b.abs(), "{a} vs {b}");
    }

    twice.zero_grads();
    assert!(twice.params().grads.iter().all(|&g| g == 0.0));
}

#[test]
fn evaluate_leaves_gradients_and_running_stats_alone() {
    let mut model = Model::new(Arch::CifarResNet { depth: 8, width: 2 }, 3, 0);
    let (images, labels) = LearnableData::new(3, 8, 0).batch(&[0, 1, 2]);
    model.train_step(&images, &labels, 0.0);
    let before = model.params().clone();
    let stats = model.evaluate(&images, &labels);
    assert_eq!(stats.batch, 3);
    assert!(stats.correct <= 3 && stats.loss.is_finite());
    assert_eq!(model.params().grads, before.grads);
    assert_eq!(model.params().buffers, before.buffers);
}

/// A depth-8 CIFAR ResNet learns the 4-class synthetic task: loss falls well below its
/// start and held-out accuracy is far above chance (0.25).
#[test]
fn tiny_cifar_resnet_learns() {
    let started = Instant::now();
    let classes = 4;
    let data = LearnableData::new(classes, 16, 42).with_len(256);
    let mut model = Model::new(Arch::CifarResNet { depth: 8, width: 4 }, classes, 0);
    let mut sgd = Sgd::new(model.params(), 0.9, 5e-4);
    let epochs = 4;
    let batch = 16;
    let steps_per_epoch = data.len / batch;
    let schedule = LrSchedule {
        base_lr: 0.1,
        warmup_steps: 5,
        total_steps: epochs * steps_per_epoch,
        kind: LrKind::Cosine,
    };
    let mut losses = Vec::new();
    let mut step = 0;
    for epoch in 0..epochs {
        let order = shard(data.len, 0, 1, epoch, 7);
        for indices in order.chunks_exact(batch) {
            let (images, labels) = data.batch(indices);
            let stats = model.train_step(&images, &labels, 0.0);
            losses.push(stats.loss);
            let lr = schedule.lr(step);
            sgd.step(model.params_mut(), lr);
            step += 1;
        }
    }
    let first: f32 = losses[..4].iter().sum::<f32>() / 4.0;
    let last: f32 = losses[losses.len() - 4..].iter().sum::<f32>() / 4.0;
    // Held-out samples: indices the training never visited.
    let held_out: Vec<usize> = (10_000..10_128).collect();
    let (images, labels) = data.batch(&held_out);
    let eval = model.evaluate(&images, &labels);
    let accuracy = eval.correct as f32 / eval.batch as f32;
    eprintln!(
        "loss {first:.3} -> {last:.3}, held-out accuracy {accuracy:.3}, eval loss {:.3}, {:?}",
        eval.loss,
        started.elapsed()
    );
    assert!(last < 0.7 * first, "loss {first} -> {last}");
    assert!(accuracy > 0.6, "held-out accuracy {accuracy}");
}
