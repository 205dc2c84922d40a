//! All-reduce over a ring of TCP connections: reduce-scatter, then all-gather, each rank
//! sending to the next and receiving from the previous at the same time, in chunks, so the
//! adding of one chunk overlaps the transfer of the next. Each rank moves 2(n−1)/n of the
//! data, the bandwidth-optimal amount.
//!
//! Wiring: rank 0 serves a rendezvous (the operator sets `RINGMASTER_RENDEZVOUS` to worker
//! 0's name and port; default 127.0.0.1:29500). Every rank opens a listener on the address it
//! reached rank 0 from, tells rank 0 where it is, gets everyone's addresses back, connects to
//! the next rank and accepts the previous one. With the job's rendezvous key
//! (`RINGMASTER_RENDEZVOUS_KEY_FILE`), each of those connections is admitted only once its
//! peer has signed what it says, and a fresh nonce, with the key ([`super::auth`]); without
//! one, any peer that speaks the protocol is.
//!
//! The protocol: rank 0 sends each connection to its rendezvous a line `{"nonce": HEX}`, and
//! a rank answers with `{"rank", "world", "addr", "mac"}`, `mac` the HMAC of the nonce, rank,
//! world and address (none without a key); once every rank is in, rank 0 sends each the
//! table of addresses, `{"addrs": [...]}`. On a ring link the accepting rank sends 32 bytes
//! of nonce, and the connecting one its rank (8 bytes, little endian) and the HMAC of the
//! nonce, its rank and the world size (32 bytes, zeros without a key).

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::ops::Range;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::auth::{self, Gate, MAC_BYTES, NONCE_BYTES, Refused, RendezvousKey};
use super::{Collective, CollectiveError, ReduceOp, segments};
use crate::world::World;
use ringmaster_contract::trainer::RENDEZVOUS_ENV;

/// Messages up to this size are written before reading instead of from a second thread.
/// It is Linux's default initial TCP send buffer (`tcp_wmem`), and the peer's kernel takes
/// far more into its receive buffer without the peer reading, so every rank's write
/// completes before any rank reads: no rank can block another.
const SMALL_MESSAGE_BYTES: usize = 16 * 1024;

/// What a hello's signature is for (so that no other signed message passes for one).
const HELLO: &str = "ringmaster rendezvous hello v1";
/// What a ring link's signature is for.
const LINK: &str = "ringmaster ring link v1";
/// The longest hello rank 0 reads.
const MAX_HELLO_BYTES: u64 = 4096;

/// Settings of the ring.
#[derive(Clone, Debug)]
pub struct RingConfig {
    /// `host:port` of rank 0's rendezvous.
    pub rendezvous: String,
    /// How long a peer may stay silent (and how long wiring may take) before it is an error.
    pub timeout: Duration,
    /// Bytes per chunk of a transfer.
    pub chunk_bytes: usize,
    /// The job's rendezvous key: every peer must prove it holds it. `None`: any peer that
    /// speaks the protocol is admitted.
    pub key: Option<RendezvousKey>,
}

impl Default for RingConfig {
    fn default() -> Self {
        Self {
            rendezvous: "127.0.0.1:29500".into(),
            timeout: Duration::from_secs(60),
            chunk_bytes: 1 << 20,
            key: None,
        }
    }
}

impl RingConfig {
    /// `RINGMASTER_RENDEZVOUS`, `RINGMASTER_COLLECTIVE_TIMEOUT` (seconds) and the key of
    /// `RINGMASTER_RENDEZVOUS_KEY_FILE` over the defaults; an error when the key file cannot
    /// be read or holds too short a key.
    pub fn from_env() -> Result<Self, CollectiveError> {
        let mut config = Self::default();
        if let Ok(addr) = std::env::var(RENDEZVOUS_ENV) {
            config.rendezvous = addr;
        }
        if let Some(seconds) = std::env::var("RINGMASTER_COLLECTIVE_TIMEOUT")
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
        {
            config.timeout = Duration::from_secs_f64(seconds.max(0.1));
        }
        config.key = RendezvousKey::from_env()?;
        Ok(config)
    }

    /// How long a connection may take over its handshake.
    fn handshake_timeout(&self) -> Duration {
        auth::HANDSHAKE_TIMEOUT.min(self.timeout)
    }
}

/// Rank 0's first line to each connection to its rendezvous.
#[derive(Serialize, Deserialize)]
struct Challenge {
    nonce: String,
}

#[derive(Serialize, Deserialize)]
struct Hello {
    rank: usize,
    world: usize,
    addr: String,
    /// The HMAC, in hex, of rank 0's nonce, [`Hello::numbers`] and `addr`; none without a
    /// key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    mac: Option<String>,
}

impl Hello {
    /// The numbers a hello signs besides its nonce and address: its rank and world size,
    /// 8 bytes each, little endian.
    fn numbers(rank: usize, world: usize) -> [u8; 16] {
        let mut numbers = [0; 16];
        numbers[..8].copy_from_slice(&(rank as u64).to_le_bytes());
        numbers[8..].copy_from_slice(&(world as u64).to_le_bytes());
        numbers
    }
}

#[derive(Serialize, Deserialize)]
struct Table {
    addrs: Vec<String>,
}

/// A rank of a TCP ring.
pub struct TcpRing {
    rank: usize,
    size: usize,
    next: Option<TcpStream>,
    prev: Option<TcpStream>,
    config: RingConfig,
    receive_buffer: Vec<f32>,
    refused: Vec<Refused>,
}

impl std::fmt::Debug for TcpRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpRing")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

fn rendezvous_error(config: &RingConfig, message: impl std::fmt::Display) -> CollectiveError {
    CollectiveError::Rendezvous {
        addr: config.rendezvous.clone(),
        message: message.to_string(),
    }
}

fn resolve(addr: &str, config: &RingConfig) -> Result<SocketAddr, CollectiveError> {
    addr.to_socket_addrs()
        .map_err(|e| rendezvous_error(config, format!("resolving {addr}: {e}")))?
        .next()
        .ok_or_else(|| rendezvous_error(config, format!("{addr} resolves to no address")))
}

/// Connects to `addr`, retrying until `deadline` (the peer may not listen yet).
fn connect_until(addr: SocketAddr, deadline: Instant) -> std::io::Result<TcpStream> {
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            Ok(stream) => return Ok(stream),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

fn send_line<T: Serialize>(stream: &mut TcpStream, value: &T) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(value).map_err(std::io::Error::other)?;
    line.push(b'\n');
    stream.write_all(&line)
}

/// A JSON line of at most `limit` bytes.
fn read_line<T: for<'de> Deserialize<'de>>(stream: &TcpStream, limit: u64) -> std::io::Result<T> {
    let mut line = String::new();
    let read = BufReader::new(stream.take(limit)).read_line(&mut line)?;
    if read == 0 {
        return Err(std::io::Error::new(
            ErrorKind::UnexpectedEof,
            "the connection closed",
        ));
    }
    if !line.ends_with('\n') && read as u64 >= limit {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            format!("a line longer than {limit} bytes"),
        ));
    }
    serde_json::from_str(&line).map_err(|e| std::io::Error::new(ErrorKind::InvalidData, e))
}

/// Rank 0's side of a connection to its rendezvous: a nonce out, a hello signed over it in.
fn greet(stream: &mut TcpStream, key: Option<&RendezvousKey>) -> Result<Hello, String> {
    let nonce = auth::nonce();
    send_line(
        stream,
        &Challenge {
            nonce: auth::to_hex(&nonce),
        },
    )
    .map_err(|e| format!("sending it a nonce: {e}"))?;
    let hello: Hello = read_line(stream, MAX_HELLO_BYTES).map_err(|e| match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => "it sent no hello in time".to_string(),
        _ => format!("no hello: {e}"),
    })?;
    let signature = match &hello.mac {
        Some(mac) => Some(auth::from_hex(mac).ok_or("its signature is not hex")?),
        None => None,
    };
    if key.is_none() && signature.is_some() {
        return Err(
            "its hello is signed, and this rank has no rendezvous key (RINGMASTER_RENDEZVOUS_KEY_FILE) to check it"
                .into(),
        );
    }
    let numbers = Hello::numbers(hello.rank, hello.world);
    let parts: [&[u8]; 3] = [&nonce, &numbers, hello.addr.as_bytes()];
    auth::check(key, HELLO, &parts, signature.as_deref()).map(|()| hello)
}

/// The accepting side of a ring link: a nonce out, the previous rank's signed rank in.
fn admit_link(
    stream: &mut TcpStream,
    key: Option<&RendezvousKey>,
    prev_rank: usize,
    world: usize,
) -> Result<(), String> {
    let nonce = auth::nonce();
    stream
        .write_all(&nonce)
        .map_err(|e| format!("sending it a nonce: {e}"))?;
    let mut proof = [0u8; 8 + MAC_BYTES];
    stream.read_exact(&mut proof).map_err(|e| match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => "it sent no rank in time".to_string(),
        _ => format!("no rank: {e}"),
    })?;
    let (rank, signature) = proof.split_at(8);
    let claimed = u64::from_le_bytes(rank.try_into().expect("8 bytes"));
    if claimed != prev_rank as u64 {
        return Err(format!(
            "it says it is rank {claimed}, and rank {prev_rank} is the one before this rank"
        ));
    }
    auth::check(
        key,
        LINK,
        &[&nonce, rank, &(world as u64).to_le_bytes()],
        Some(signature),
    )
}

/// The connecting side of a ring link: this rank, signed over the next rank's nonce.
fn prove_link(
    addr: SocketAddr,
    deadline: Instant,
    config: &RingConfig,
    world: &World,
) -> std::io::Result<TcpStream> {
    let mut next = connect_until(addr, deadline)?;
    next.set_read_timeout(Some(config.timeout))?;
    let mut nonce = [0u8; NONCE_BYTES];
    next.read_exact(&mut nonce)?;
    let rank = (world.rank as u64).to_le_bytes();
    let signature = config.key.as_ref().map_or([0; MAC_BYTES], |key| {
        key.sign(LINK, &[&nonce, &rank, &(world.size as u64).to_le_bytes()])
    });
    next.write_all(&[rank.as_slice(), &signature].concat())?;
    Ok(next)
}

impl TcpRing {
    /// Wires this rank into the ring of `world`.
    pub fn connect(world: &World, config: RingConfig) -> Result<Self, CollectiveError> {
        let mut ring = Self {
            rank: world.rank,
            size: world.size,
            next: None,
            prev: None,
            receive_buffer: Vec::new(),
            config,
            refused: Vec::new(),
        };
        if world.size == 1 {
            return Ok(ring);
        }
        let deadline = Instant::now() + ring.config.timeout;
        let rendezvous = resolve(&ring.config.rendezvous, &ring.config)?;
        let config = &ring.config;
        let (listener, addrs) = if world.rank == 0 {
            // Rank 0 serves the rendezvous on the address its name resolves to.
            let server = TcpListener::bind(rendezvous)
                .map_err(|e| rendezvous_error(config, format!("binding: {e}")))?;
            let listener =
                TcpListener::bind((rendezvous.ip(), 0)).map_err(|e| rendezvous_error(config, e))?;
            let mut addrs = vec![String::new(); world.size];
            addrs[0] = listener
                .local_addr()
                .map_err(|e| rendezvous_error(config, e))?
                .to_string();
            let key = config.key.clone();
            let mut gate = Gate::new(0, "the rendezvous", config.handshake_timeout(), move |s| {
                greet(s, key.as_ref())
            });
            let mut peers = Vec::new();
            while peers.len() < world.size - 1 {
                let (stream, hello) = gate.next(&server, deadline).map_err(|e| {
                    rendezvous_error(
                        config,
                        format!("{} of {} ranks arrived: {e}", peers.len() + 1, world.size),
                    )
                })?;
                stream.set_write_timeout(Some(config.timeout)).ok();
                if hello.world != world.size
                    || hello.rank == 0
                    || hello.rank >= world.size
                    || !addrs[hello.rank].is_empty()
                {
                    return Err(rendezvous_error(
                        config,
                        format!(
                            "rank {} of a world of {} does not fit this world of {}",
                            hello.rank, hello.world, world.size
                        ),
                    ));
                }
                addrs[hello.rank] = hello.addr;
                peers.push(stream);
            }
            ring.refused.extend_from_slice(gate.refused());
            let table = Table {
                addrs: addrs.clone(),
            };
            for mut peer in peers {
                send_line(&mut peer, &table).map_err(|e| rendezvous_error(config, e))?;
            }
            (listener, addrs)
        } else {
            let mut stream =
                connect_until(rendezvous, deadline).map_err(|e| rendezvous_error(config, e))?;
            stream.set_read_timeout(Some(config.timeout)).ok();
            let challenge: Challenge = read_line(&stream, MAX_HELLO_BYTES)
                .map_err(|e| rendezvous_error(config, format!("waiting for a nonce: {e}")))?;
            let nonce = auth::from_hex(&challenge.nonce)
                .filter(|nonce| nonce.len() == NONCE_BYTES)
                .ok_or_else(|| rendezvous_error(config, "rank 0's nonce is not 32 bytes of hex"))?;
            // The address rank 0 was reached from is one the other ranks can reach too.
            let local_ip = stream
                .local_addr()
                .map_err(|e| rendezvous_error(config, e))?
                .ip();
            let listener =
                TcpListener::bind((local_ip, 0)).map_err(|e| rendezvous_error(config, e))?;
            let addr = listener
                .local_addr()
                .map_err(|e| rendezvous_error(config, e))?
                .to_string();
            let numbers = Hello::numbers(world.rank, world.size);
            let mac = config
                .key
                .as_ref()
                .map(|key| auth::to_hex(&key.sign(HELLO, &[&nonce, &numbers, addr.as_bytes()])));
            send_line(
                &mut stream,
                &Hello {
                    rank: world.rank,
                    world: world.size,
                    addr,
                    mac,
                },
            )
            .map_err(|e| rendezvous_error(config, e))?;
            let table: Table = read_line(&stream, u64::MAX).map_err(|e| {
                let why = if e.kind() == ErrorKind::UnexpectedEof {
                    "rank 0 closed the connection: it refused this rank's hello (is its rendezvous key another?)".to_string()
                } else {
                    e.to_string()
                };
                rendezvous_error(config, format!("waiting for the table: {why}"))
            })?;
            (listener, table.addrs)
        };

        // Connect to the next rank while admitting the previous one: each rank's nonce
        // comes from its gate, so every rank must be at its gate while it connects.
        let next_rank = (world.rank + 1) % world.size;
        let prev_rank = (world.rank + world.size - 1) % world.size;
        let next_addr = resolve(&addrs[next_rank], config)?;
        let key = config.key.clone();
        let size = world.size;
        let mut gate = Gate::new(
            world.rank,
            "its ring port",
            config.handshake_timeout(),
            move |s| admit_link(s, key.as_ref(), prev_rank, size),
        );
        let (next, prev) = std::thread::scope(|scope| {
            let next = scope.spawn(|| prove_link(next_addr, deadline, config, world));
            let prev = gate.next(&listener, deadline);
            (next.join().expect("the link to the next rank"), prev)
        });
        ring.refused.extend_from_slice(gate.refused());
        let next = next.map_err(|source| CollectiveError::PeerLost {
            peer: next_rank,
            direction: "next",
            source,
        })?;
        let (prev, ()) = prev.map_err(|source| CollectiveError::PeerLost {
            peer: prev_rank,
            direction: "previous",
            source,
        })?;
        for stream in [&next, &prev] {
            stream.set_nodelay(true).ok();
            stream.set_read_timeout(Some(config.timeout)).ok();
            stream.set_write_timeout(Some(config.timeout)).ok();
        }
        ring.next = Some(next);
        ring.prev = Some(prev);
        Ok(ring)
    }

    /// The connections this rank refused while the ring was wired (each logged on stderr
    /// when it was): strangers, or peers without the job's rendezvous key.
    pub fn refused(&self) -> &[Refused] {
        &self.refused
    }

    fn peer_error(&self, direction: &'static str, source: std::io::Error) -> CollectiveError {
        let peer = match direction {
            "next" => (self.rank + 1) % self.size,
            _ => (self.rank + self.size - 1) % self.size,
        };
        if matches!(source.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
            CollectiveError::PeerTimeout {
                peer,
                direction,
                seconds: self.config.timeout.as_secs(),
            }
        } else {
            CollectiveError::PeerLost {
                peer,
                direction,
                source,
            }
        }
    }

    /// Sends `data[send]` to the next rank while receiving the previous rank's values for
    /// `data[receive]`, adding them (`reduce`) or copying them.
    fn exchange(
        &mut self,
        data: &mut [f32],
        send: Range<usize>,
        receive: Range<usize>,
        reduce: bool,
    ) -> Result<(), CollectiveError> {
        let chunk = (self.config.chunk_bytes / 4).max(1);
        let (next, prev) = (
            self.next.as_mut().expect("wired"),
            self.prev.as_mut().expect("wired"),
        );
        // The ranges are disjoint segments: split the slice so one thread can read while the
        // other writes.
        let (send_slice, receive_slice): (&[f32], &mut [f32]) = if send.start < receive.start {
            let (a, b) = data.split_at_mut(receive.start);
            (&a[send.clone()], &mut b[..receive.len()])
        } else {
            let (a, b) = data.split_at_mut(send.start);
            (&b[..send.len()], &mut a[receive.clone()])
        };
        if self.receive_buffer.len() < chunk {
            self.receive_buffer.resize(chunk, 0.0);
        }
        let buffer = &mut self.receive_buffer[..chunk];
        let receive_all = |prev: &mut TcpStream, receive_slice: &mut [f32], buffer: &mut [f32]| {
            for part in receive_slice.chunks_mut(chunk) {
                let incoming = &mut buffer[..part.len()];
                prev.read_exact(bytemuck::cast_slice_mut(incoming))?;
                if reduce {
                    for (mine, theirs) in part.iter_mut().zip(incoming.iter()) {
                        *mine += *theirs;
                    }
                } else {
                    part.copy_from_slice(incoming);
                }
            }
            Ok::<(), std::io::Error>(())
        };
        let (sent, received) = if std::mem::size_of_val(send_slice) <= SMALL_MESSAGE_BYTES {
            // Small enough to sit in the kernel's socket buffers while the peer is busy: write
            // it all, then read, and spare the thread (most of a small all-reduce's time).
            let sent = next.write_all(bytemuck::cast_slice(send_slice));
            let received = if sent.is_ok() {
                receive_all(prev, receive_slice, buffer)
            } else {
                Ok(())
            };
            (sent, received)
        } else {
            std::thread::scope(|scope| {
                let sender = scope.spawn(move || {
                    for part in send_slice.chunks(chunk) {
                        next.write_all(bytemuck::cast_slice(part))?;
                    }
                    next.flush()
                });
                let received = receive_all(prev, receive_slice, buffer);
                (sender.join().expect("sender thread"), received)
            })
        };
        received.map_err(|e| self.peer_error("previous", e))?;
        sent.map_err(|e| self.peer_error("next", e))
    }
}

impl Collective for TcpRing {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.size
    }
    fn name(&self) -> &'static str {
        "tcp-ring"
    }

    fn all_reduce(&mut self, data: &mut [f32], op: ReduceOp) -> Result<(), CollectiveError> {
        let n = self.size;
        if n > 1 {
            let parts = segments(data.len(), n);
            let r = self.rank;
            // Reduce-scatter: after n−1 steps rank r holds the sum of segment r+1.
            for step in 0..n - 1 {
                let send = parts[(r + n - step) % n].clone();
                let receive = parts[(r + 2 * n - step - 1) % n].clone();
                self.exchange(data, send, receive, true)?;
            }
            // All-gather: pass the summed segments around.
            for step in 0..n - 1 {
                let send = parts[(r + 1 + n - step) % n].clone();
                let receive = parts[(r + n - step) % n].clone();
                self.exchange(data, send, receive, false)?;
            }
        }
        if op == ReduceOp::Average && n > 1 {
            let scale = 1.0 / n as f32;
            data.iter_mut().for_each(|v| *v *= scale);
        }
        Ok(())
    }

    fn time_from_previous(
        &mut self,
        count: usize,
        warmup: usize,
        iterations: usize,
    ) -> Result<f64, CollectiveError> {
        // The first half goes to the next rank while the previous rank's first half fills
        // the second: the all-reduce's own exchange over the ring's own sockets.
        let mut data = vec![1.0f32; 2 * count];
        let mut pass =
            |ring: &mut Self| ring.exchange(&mut data, 0..count, count..2 * count, false);
        for _ in 0..warmup {
            pass(self)?;
        }
        self.barrier()?;
        let start = Instant::now();
        for _ in 0..iterations {
            pass(self)?;
        }
        Ok(start.elapsed().as_secs_f64() / iterations.max(1) as f64)
    }

    fn broadcast(&mut self, data: &mut [f32], root: usize) -> Result<(), CollectiveError> {
        let n = self.size;
        if n == 1 {
            return Ok(());
        }
        // Along the ring from the root: receive from the previous (unless root), forward to
        // the next (unless it is the root).
        let chunk = (self.config.chunk_bytes / 4).max(1);
        if self.rank != root {
            let prev = self.prev.as_mut().expect("wired");
            let result = data
                .chunks_mut(chunk)
                .try_for_each(|part| prev.read_exact(bytemuck::cast_slice_mut(part)));
            result.map_err(|e| self.peer_error("previous", e))?;
        }
        if (self.rank + 1) % n != root {
            let next = self.next.as_mut().expect("wired");
            let result = data
                .chunks(chunk)
                .try_for_each(|part| next.write_all(bytemuck::cast_slice(part)));
            result.map_err(|e| self.peer_error("next", e))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank_of(rank: usize, size: usize) -> World {
        World {
            rank,
            size,
            local_rank: rank,
            source: "test",
            ..World::single()
        }
    }

    /// Strangers at a rank's ring port: the previous rank's number without a signature,
    /// another rank's number with the key's, the previous rank's with another key's. Each is
    /// refused (closed on, listed with why); then the previous rank with the key is admitted.
    #[test]
    fn a_ring_port_admits_only_the_previous_rank_signed_with_the_key() {
        let key = RendezvousKey::new(&[4; 32]).unwrap();
        let other = RendezvousKey::new(&[6; 32]).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let admitting = key.clone();
        let mut gate = Gate::new(2, "its ring port", Duration::from_secs(10), move |s| {
            admit_link(s, Some(&admitting), 1, 3)
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        let holding = |key: Option<&RendezvousKey>| RingConfig {
            key: key.cloned(),
            ..RingConfig::default()
        };
        let (mut admitted, mut prover) = std::thread::scope(|scope| {
            let peers = scope.spawn(|| {
                for (rank, key) in [(1, None), (0, Some(&key)), (1, Some(&other))] {
                    let mut stream =
                        prove_link(addr, deadline, &holding(key), &rank_of(rank, 3)).unwrap();
                    let mut rest = Vec::new();
                    match stream.read_to_end(&mut rest) {
                        Ok(_) => assert!(rest.is_empty()),
                        Err(e) => assert_eq!(e.kind(), ErrorKind::ConnectionReset),
                    }
                }
                prove_link(addr, deadline, &holding(Some(&key)), &rank_of(1, 3)).unwrap()
            });
            let (admitted, ()) = gate.next(&listener, deadline).unwrap();
            (admitted, peers.join().unwrap())
        });
        let reasons: Vec<&str> = gate.refused().iter().map(|r| r.reason.as_str()).collect();
        assert_eq!(reasons.len(), 3, "{reasons:?}");
        assert!(reasons[0].contains("not the job's key's"), "{reasons:?}");
        assert!(
            reasons[1].starts_with("it says it is rank 0, and rank 1 is the one before"),
            "{reasons:?}"
        );
        assert!(
            reasons[2].contains("another key, or a replay"),
            "{reasons:?}"
        );
        // The admitted link is the prover's.
        prover.write_all(b"gradients").unwrap();
        let mut got = [0u8; 9];
        admitted.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"gradients");
    }
}
