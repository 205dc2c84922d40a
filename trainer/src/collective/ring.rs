//! All-reduce over a ring of TCP connections: reduce-scatter, then all-gather, each rank
//! sending to the next and receiving from the previous at the same time, in chunks, so the
//! adding of one chunk overlaps the transfer of the next. Each rank moves 2(n−1)/n of the
//! data, the bandwidth-optimal amount.
//!
//! Wiring: rank 0 serves a rendezvous (the operator sets `RINGMASTER_RENDEZVOUS` to worker
//! 0's name and port; default 127.0.0.1:29500). Every rank opens a listener on the address it
//! reached rank 0 from, tells rank 0 where it is, gets everyone's addresses back, connects to
//! the next rank and accepts the previous one.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::ops::Range;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::{Collective, CollectiveError, ReduceOp, segments};
use crate::world::World;

/// Messages up to this size are written before reading instead of from a second thread.
/// It is Linux's default initial TCP send buffer (`tcp_wmem`), and the peer's kernel takes
/// far more into its receive buffer without the peer reading, so every rank's write
/// completes before any rank reads: no rank can block another.
const SMALL_MESSAGE_BYTES: usize = 16 * 1024;

/// Settings of the ring.
#[derive(Clone, Debug)]
pub struct RingConfig {
    /// `host:port` of rank 0's rendezvous.
    pub rendezvous: String,
    /// How long a peer may stay silent (and how long wiring may take) before it is an error.
    pub timeout: Duration,
    /// Bytes per chunk of a transfer.
    pub chunk_bytes: usize,
}

impl Default for RingConfig {
    fn default() -> Self {
        Self {
            rendezvous: "127.0.0.1:29500".into(),
            timeout: Duration::from_secs(60),
            chunk_bytes: 1 << 20,
        }
    }
}

impl RingConfig {
    /// `RINGMASTER_RENDEZVOUS` and `RINGMASTER_COLLECTIVE_TIMEOUT` (seconds) over the defaults.
    pub fn from_env() -> Self {
        let mut config = Self::default();
        if let Ok(addr) = std::env::var("RINGMASTER_RENDEZVOUS") {
            config.rendezvous = addr;
        }
        if let Some(seconds) = std::env::var("RINGMASTER_COLLECTIVE_TIMEOUT")
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
        {
            config.timeout = Duration::from_secs_f64(seconds.max(0.1));
        }
        config
    }
}

#[derive(Serialize, Deserialize)]
struct Hello {
    rank: usize,
    world: usize,
    addr: String,
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

fn accept_until(listener: &TcpListener, deadline: Instant) -> std::io::Result<TcpStream> {
    listener.set_nonblocking(true)?;
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(false)?;
                return Ok(stream);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                return Err(std::io::Error::new(
                    ErrorKind::TimedOut,
                    "no peer connected in time",
                ));
            }
            Err(e) => return Err(e),
        }
    }
}

fn send_line<T: Serialize>(stream: &mut TcpStream, value: &T) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(value).map_err(std::io::Error::other)?;
    line.push(b'\n');
    stream.write_all(&line)
}

fn read_line<T: for<'de> Deserialize<'de>>(stream: &TcpStream) -> std::io::Result<T> {
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line)?;
    serde_json::from_str(&line).map_err(|e| std::io::Error::new(ErrorKind::InvalidData, e))
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
            let mut peers = Vec::new();
            while peers.len() < world.size - 1 {
                let stream = accept_until(&server, deadline).map_err(|e| {
                    rendezvous_error(
                        config,
                        format!("{} of {} ranks arrived: {e}", peers.len() + 1, world.size),
                    )
                })?;
                stream.set_read_timeout(Some(config.timeout)).ok();
                let hello: Hello = read_line(&stream).map_err(|e| rendezvous_error(config, e))?;
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
            send_line(
                &mut stream,
                &Hello {
                    rank: world.rank,
                    world: world.size,
                    addr,
                },
            )
            .map_err(|e| rendezvous_error(config, e))?;
            let table: Table = read_line(&stream)
                .map_err(|e| rendezvous_error(config, format!("waiting for the table: {e}")))?;
            (listener, table.addrs)
        };

        let next_rank = (world.rank + 1) % world.size;
        let next_addr = resolve(&addrs[next_rank], config)?;
        let mut next =
            connect_until(next_addr, deadline).map_err(|source| CollectiveError::PeerLost {
                peer: next_rank,
                direction: "next",
                source,
            })?;
        next.write_all(&(world.rank as u64).to_le_bytes())
            .map_err(|source| CollectiveError::PeerLost {
                peer: next_rank,
                direction: "next",
                source,
            })?;
        let prev_rank = (world.rank + world.size - 1) % world.size;
        let mut prev =
            accept_until(&listener, deadline).map_err(|source| CollectiveError::PeerLost {
                peer: prev_rank,
                direction: "previous",
                source,
            })?;
        let mut who = [0u8; 8];
        prev.read_exact(&mut who)
            .map_err(|source| CollectiveError::PeerLost {
                peer: prev_rank,
                direction: "previous",
                source,
            })?;
        if u64::from_le_bytes(who) != prev_rank as u64 {
            return Err(rendezvous_error(
                config,
                format!(
                    "expected rank {prev_rank} before me, got {}",
                    u64::from_le_bytes(who)
                ),
            ));
        }
        for stream in [&next, &prev] {
            stream.set_nodelay(true).ok();
            stream.set_read_timeout(Some(config.timeout)).ok();
            stream.set_write_timeout(Some(config.timeout)).ok();
        }
        ring.next = Some(next);
        ring.prev = Some(prev);
        Ok(ring)
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
