//! The TCP ring in one process: one thread per rank over loopback.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use ringmaster_trainer::collective::{
    Collective, CollectiveError, ReduceOp, Refused, RendezvousKey, RingConfig, TcpRing,
};
use ringmaster_trainer::world::World;

mod common;
use common::free_port;

fn config(port: u16) -> RingConfig {
    RingConfig {
        rendezvous: format!("127.0.0.1:{port}"),
        timeout: Duration::from_secs(10),
        // Small chunks so even small tests cross chunk boundaries.
        chunk_bytes: 4096,
        key: None,
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

/// The settings of a job's rank: its rendezvous key, and a collective timeout longer than a
/// handshake's (10 s), so that a rank 0 held up by a silent stranger would show.
fn keyed(port: u16, key: &[u8]) -> RingConfig {
    RingConfig {
        timeout: Duration::from_secs(30),
        key: Some(RendezvousKey::new(key).unwrap()),
        ..config(port)
    }
}

fn rank_of(rank: usize, size: usize) -> World {
    World {
        rank,
        size,
        local_rank: rank,
        source: "test",
        ..World::single()
    }
}

/// A rank's sum, and the connections it refused while the ring was wired.
type Outcome = (Vec<f32>, Vec<Refused>);

/// Sums `[rank + 1; 1000]` over the ring.
fn sum_ranks(ring: &mut TcpRing) -> Outcome {
    let mut data = vec![(ring.rank() + 1) as f32; 1000];
    ring.all_reduce(&mut data, ReduceOp::Sum)
        .expect("all-reduce");
    (data, ring.refused().to_vec())
}

/// Starts rank 0 of `n` with `config`, runs `meanwhile` (the strangers' turn) once its
/// rendezvous serves, then starts the other ranks with `config`. Each rank's sum and
/// refusals, and how long the strangers and the ranks after rank 0 took.
fn ring_after(n: usize, config: RingConfig, meanwhile: impl FnOnce()) -> (Vec<Outcome>, Duration) {
    std::thread::scope(|scope| {
        let rank_0 = {
            let config = config.clone();
            scope.spawn(move || sum_ranks(&mut TcpRing::connect(&rank_of(0, n), config).unwrap()))
        };
        let started = Instant::now();
        meanwhile();
        let others: Vec<_> = (1..n)
            .map(|rank| {
                let config = config.clone();
                scope.spawn(move || {
                    sum_ranks(&mut TcpRing::connect(&rank_of(rank, n), config).unwrap())
                })
            })
            .collect();
        let mut results = vec![rank_0.join().expect("rank 0")];
        results.extend(others.into_iter().map(|h| h.join().expect("a rank")));
        (results, started.elapsed())
    })
}

/// A connection to `port` on loopback, once something listens there.
fn connect(port: u16) -> TcpStream {
    let started = Instant::now();
    loop {
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(stream) => {
                stream
                    .set_read_timeout(Some(Duration::from_secs(20)))
                    .unwrap();
                return stream;
            }
            Err(e) => assert!(started.elapsed() < Duration::from_secs(10), "{e}"),
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The first line `stream` reads.
fn line(stream: &TcpStream) -> String {
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).unwrap();
    line
}

/// Waits for the other end to close `stream`; fails when it sends anything instead.
fn closed(mut stream: &TcpStream) {
    let mut rest = Vec::new();
    match stream.read_to_end(&mut rest) {
        Ok(_) => assert!(rest.is_empty(), "{}", String::from_utf8_lossy(&rest)),
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
    }
}

/// A stranger at the rendezvous: it takes rank 0's nonce, says `hello`, and is closed on.
fn stranger_saying(port: u16, hello: &str) -> std::net::SocketAddr {
    let mut stream = connect(port);
    let challenge = line(&stream);
    assert!(challenge.starts_with(r#"{"nonce":""#), "{challenge}");
    stream.write_all(hello.as_bytes()).unwrap();
    closed(&stream);
    stream.local_addr().unwrap()
}

fn assert_sums(results: &[Outcome]) {
    let n = results.len();
    let sum = (n * (n + 1) / 2) as f32;
    for (rank, (data, _)) in results.iter().enumerate() {
        assert!(
            data.iter().all(|v| *v == sum),
            "rank {rank}: {:?}",
            &data[..3]
        );
    }
}

/// Strangers at rank 0's rendezvous while a keyed ring is wired: one that says nothing
/// (and stays), one that sends no JSON, one an unsigned hello for a free rank, one a hello
/// whose signature is not the key's. Each that spoke is refused (closed on, listed with its
/// address and why), none takes a rank, the silent one holds nobody up, and the real ranks
/// sum correctly.
#[test]
fn strangers_at_the_rendezvous_are_refused_and_the_ranks_go_on() {
    let port = free_port();
    let mut strangers = Vec::new();
    let mut silent = None;
    let (results, took) = ring_after(3, keyed(port, &[9; 32]), || {
        silent = Some(connect(port));
        for hello in [
            "GET / HTTP/1.1\r\n\r\n".to_string(),
            r#"{"rank":1,"world":3,"addr":"127.0.0.1:9"}"#.to_string() + "\n",
            format!(
                r#"{{"rank":2,"world":3,"addr":"127.0.0.1:9","mac":"{}"}}"#,
                "ab".repeat(32)
            ) + "\n",
        ] {
            strangers.push(stranger_saying(port, &hello));
        }
    });
    assert_sums(&results);
    // The silent stranger, still connected, held neither the other strangers nor the ranks
    // up for a handshake's timeout (10 s).
    assert!(took < Duration::from_secs(5), "took {took:?}");
    let refused = &results[0].1;
    let peers: Vec<_> = refused.iter().map(|r| r.peer).collect();
    assert_eq!(peers, strangers, "{refused:?}");
    assert!(refused[0].reason.starts_with("no hello: "), "{refused:?}");
    assert!(refused[1].reason.contains("unsigned"), "{refused:?}");
    assert!(
        refused[2].reason.contains("not the job's key's"),
        "{refused:?}"
    );
    assert!(
        results[1..].iter().all(|(_, refused)| refused.is_empty()),
        "no stranger came to the ring ports: {results:?}"
    );
    drop(silent);
}

/// A hello captured off the wire (here by a stand-in for rank 0 that a real rank 1 greets)
/// and said again to the real rank 0 of a later gang with the same key is refused: it is
/// signed over another nonce. The real rank 1 then takes its place.
#[test]
fn a_replayed_hello_is_refused() {
    let key = [5u8; 32];
    // A rank 1 greets a listener that sends a nonce and keeps what it hears.
    let fake_rank_0 = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let fake_port = fake_rank_0.local_addr().unwrap().port();
    let captured = std::thread::scope(|scope| {
        let rank_1 =
            scope.spawn(|| TcpRing::connect(&rank_of(1, 2), keyed(fake_port, &key)).map(|_| ()));
        let (mut stream, _) = fake_rank_0.accept().unwrap();
        stream
            .write_all(format!("{{\"nonce\":\"{}\"}}\n", "17".repeat(32)).as_bytes())
            .unwrap();
        let hello = line(&stream);
        drop(stream);
        let refused = rank_1.join().unwrap().expect_err("no table came");
        assert!(
            refused.to_string().contains("rank 0 closed the connection"),
            "{refused}"
        );
        hello
    });
    assert!(
        captured.starts_with(r#"{"rank":1,"world":2,"#) && captured.contains(r#""mac":""#),
        "{captured}"
    );

    let port = free_port();
    let mut replayer = None;
    let (results, _) = ring_after(2, keyed(port, &key), || {
        replayer = Some(stranger_saying(port, &captured));
    });
    assert_sums(&results);
    let refused = &results[0].1;
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(Some(refused[0].peer), replayer);
    assert!(refused[0].reason.contains("a replay"), "{refused:?}");
}

/// A rank with another key (another job's, say) is refused at the rendezvous and says why;
/// the rank with the job's key takes the place.
#[test]
fn a_rank_with_another_key_is_refused_and_says_so() {
    let port = free_port();
    let mut error = None;
    let (results, _) = ring_after(2, keyed(port, &[1; 32]), || {
        let refused = TcpRing::connect(&rank_of(1, 2), keyed(port, &[2; 32]))
            .expect_err("another key is refused");
        error = Some(refused.to_string());
    });
    assert_sums(&results);
    let error = error.unwrap();
    assert!(
        error.contains("it refused this rank's hello (is its rendezvous key another?)"),
        "{error}"
    );
    assert_eq!(results[0].1.len(), 1, "{:?}", results[0].1);
    // Nor does a rank without a key pass.
    let port = free_port();
    let (results, _) = ring_after(2, keyed(port, &[1; 32]), || {
        TcpRing::connect(&rank_of(1, 2), config(port)).expect_err("no key is refused");
    });
    assert_sums(&results);
    assert!(results[0].1[0].reason.contains("unsigned"), "{results:?}");
}

/// Without a key the ring admits any rank that speaks its protocol, as before keys; what
/// does not speak it is refused, not the end of the rendezvous.
#[test]
fn without_a_key_a_stranger_that_speaks_no_hello_is_refused_too() {
    let port = free_port();
    let mut stranger = None;
    let (results, _) = ring_after(3, config(port), || {
        stranger = Some(stranger_saying(port, "hello?\n"));
    });
    assert_sums(&results);
    assert_eq!(
        results[0].1.iter().map(|r| r.peer).collect::<Vec<_>>(),
        vec![stranger.unwrap()]
    );
}
