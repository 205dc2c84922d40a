//! The TCP ring in one process: one thread per rank over loopback.

use std::time::{Duration, Instant};

use ringmaster_trainer::collective::{Collective, CollectiveError, ReduceOp, RingConfig, TcpRing};
use ringmaster_trainer::world::World;

mod common;
use common::free_port;

fn config(port: u16) -> RingConfig {
    RingConfig {
        rendezvous: format!("127.0.0.1:{port}"),
        timeout: Duration::from_secs(10),
        // Small chunks so even small tests cross chunk boundaries.
        chunk_bytes: 4096,
    }
}

/// Runs `body` on `n` ranks wired into one ring; returns each rank's result.
fn on_ranks<T: Send>(n: usize, body: impl Fn(&mut TcpRing) -> T + Sync) -> Vec<T> {
    let port = free_port();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let body = &body;
                scope.spawn(move || {
                    let world = World {
                        rank,
                        size: n,
                        local_rank: rank,
                        source: "test",
                        ..World::single()
                    };
                    let mut ring = TcpRing::connect(&world, config(port)).expect("ring wired");
                    body(&mut ring)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    })
}

fn value(rank: usize, i: usize) -> f32 {
    ((rank + 1) * (i % 11 + 1)) as f32
}

#[test]
fn all_reduce_sums_any_length_on_two_to_eight_ranks() {
    for n in 2..=8 {
        for len in [1, 2, 7, n - 1, n + 1, 1000, 12_345] {
            let results = on_ranks(n, |ring| {
                let mut data: Vec<f32> = (0..len).map(|i| value(ring.rank(), i)).collect();
                ring.all_reduce(&mut data, ReduceOp::Sum).unwrap();
                data
            });
            let ranks_sum = (n * (n + 1) / 2) as f32;
            for (rank, data) in results.iter().enumerate() {
                for (i, v) in data.iter().enumerate() {
                    assert_eq!(
                        *v,
                        ranks_sum * (i % 11 + 1) as f32,
                        "n={n} len={len} rank={rank} i={i}"
                    );
                }
            }
        }
    }
}

#[test]
fn average_broadcast_and_barrier() {
    let results = on_ranks(4, |ring| {
        let mut data = vec![ring.rank() as f32; 5];
        ring.all_reduce(&mut data, ReduceOp::Average).unwrap();
        let mut weights = if ring.rank() == 2 {
            vec![3.5f32; 9000]
        } else {
            vec![0.0; 9000]
        };
        ring.broadcast(&mut weights, 2).unwrap();
        ring.barrier().unwrap();
        (data, weights)
    });
    for (data, weights) in results {
        assert_eq!(data, vec![1.5; 5]);
        assert!(weights.iter().all(|w| *w == 3.5));
    }
}

#[test]
fn a_vanished_rank_is_an_error_not_a_hang() {
    let start = Instant::now();
    let results = on_ranks(3, |ring| {
        if ring.rank() == 2 {
            return None; // drops its connections without a word
        }
        let mut data = vec![1.0f32; 100_000];
        Some(ring.all_reduce(&mut data, ReduceOp::Sum))
    });
    for result in results.into_iter().flatten() {
        let error = result.expect_err("the ring lost a rank");
        assert!(
            matches!(
                error,
                CollectiveError::PeerLost { .. } | CollectiveError::PeerTimeout { .. }
            ),
            "{error}"
        );
        assert!(error.to_string().contains("rank"), "{error}");
    }
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "took {:?}",
        start.elapsed()
    );
}

#[test]
fn a_world_of_one_needs_no_network() {
    let world = World::single();
    let mut ring = TcpRing::connect(&world, RingConfig::default()).unwrap();
    let mut data = vec![2.0f32; 3];
    ring.all_reduce(&mut data, ReduceOp::Average).unwrap();
    assert_eq!(data, vec![2.0; 3]);
}
