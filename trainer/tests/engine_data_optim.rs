//! Data sources, sharding, SGD and learning-rate schedules.

use std::collections::HashSet;

use ringmaster_trainer::engine::data::{LearnableData, SyntheticData, shard};
use ringmaster_trainer::engine::{LrKind, LrSchedule, ParamStore, Sgd};

#[test]
fn shards_are_disjoint_equal_and_reshuffled_per_epoch() {
    let (len, world) = (103, 4);
    let shards: Vec<Vec<usize>> = (0..world).map(|r| shard(len, r, world, 0, 5)).collect();
    let all: HashSet<usize> = shards.iter().flatten().copied().collect();
    assert!(shards.iter().all(|s| s.len() == len / world));
    assert_eq!(all.len(), world * (len / world), "disjoint");
    assert!(all.iter().all(|&i| i < len));
    assert_eq!(shard(len, 1, world, 0, 5), shards[1], "deterministic");
    assert_ne!(
        shard(len, 1, world, 1, 5),
        shards[1],
        "new order each epoch"
    );
    assert_ne!(shard(len, 1, world, 0, 6), shards[1], "seeded");
}

#[test]
fn data_is_a_pure_function_of_seed_and_index() {
    let d = LearnableData::new(5, 8, 3);
    let (a, la) = d.batch(&[4, 9]);
    let (b, lb) = d.batch(&[9, 4]);
    assert_eq!(a.shape, [2, 3, 8, 8]);
    assert_eq!(la, [lb[1], lb[0]]);
    assert_eq!(a.data[..192], b.data[192..]);
    assert!(la.iter().all(|&l| l < 5));

    let s = SyntheticData::new(10, 4, 100, 1);
    let (x, y) = s.batch(&[0, 1, 2]);
    assert_eq!(x.shape, [3, 3, 4, 4]);
    assert_eq!(s.batch(&[2]).0.data, x.data[96..]);
    assert!(y.iter().all(|&l| l < 10));
    let mean = x.data.iter().sum::<f32>() / x.len() as f32;
    assert!(mean.abs() < 0.5);
}

#[test]
fn sgd_momentum_and_decay_skip_vectors() {
    let mut store = ParamStore::new();
    store.add("w", &[1, 1], vec![1.0]);
    store.add("b", &[1], vec![1.0]);
    let mut sgd = Sgd::new(&store, 0.9, 0.1);
    store.grads.copy_from_slice(&[1.0, 1.0]);
    sgd.step(&mut store, 0.5);
    // w: v = 1 + 0.1 * 1 = 1.1; b is not decayed: v = 1.
    assert!((store.values[0] - (1.0 - 0.55)).abs() < 1e-6);
    assert!((store.values[1] - 0.5).abs() < 1e-6);
    sgd.step(&mut store, 0.5);
    // b: v = 0.9 * 1 + 1 = 1.9.
    assert!((store.values[1] - (0.5 - 0.95)).abs() < 1e-6);
    assert_eq!(sgd.velocity().len(), 2);
}

#[test]
fn schedules() {
    let cosine = LrSchedule {
        base_lr: 1.0,
        warmup_steps: 4,
        total_steps: 104,
        kind: LrKind::Cosine,
    };
    assert_eq!(cosine.lr(0), 0.25);
    assert_eq!(cosine.lr(3), 1.0);
    assert_eq!(cosine.lr(4), 1.0);
    assert!((cosine.lr(54) - 0.5).abs() < 1e-6);
    assert!(cosine.lr(104).abs() < 1e-6);
    assert!(cosine.lr(500).abs() < 1e-6);
    let step = LrSchedule {
        base_lr: 1.0,
        warmup_steps: 0,
        total_steps: 100,
        kind: LrKind::Step {
            every: 30,
            gamma: 0.1,
        },
    };
    assert_eq!(step.lr(29), 1.0);
    assert!((step.lr(30) - 0.1).abs() < 1e-7);
    assert!((step.lr(65) - 0.01).abs() < 1e-8);
    let constant = LrSchedule {
        kind: LrKind::Constant,
        ..step
    };
    assert_eq!(constant.lr(99), 1.0);
}
