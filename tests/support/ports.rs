//! Ports for the servers tests start (shared by the operator's, the end-to-end and the
//! trainer's tests through `#[path]`).

use std::sync::atomic::{AtomicU32, Ordering};

/// Ports handed out start here.
const LOWEST: u32 = 10_000;
/// And end below this.
const HIGHEST: u32 = 26_000;
/// The ports the local cluster's processes listen on: `RINGMASTER_PORT_BASE` (26400 by
/// default, above `HIGHEST`) and the 100 after it (`e2e/tools/ports.sh`).
const CLUSTER_PORTS: u32 = 100;

/// A port on `host` that was free a moment ago, and that the tests of this binary hand out
/// to no one else.
///
/// It lies below the kernel's ephemeral range: a port taken from that range (by binding
/// port 0) is closed again before the server binds it, and meanwhile the tests running
/// beside it, and the programs they start (Open MPI's daemons, HTTP clients), bind port 0 or
/// connect and can be given the same one (CI once failed with "rendezvous … Address already
/// in use"). Below the range a port is taken only by a program that names it, and a counter
/// keeps the tests of one binary off each other's; the local cluster's ports are left out.
/// Where the ephemeral range starts lower than that (no port is safe then), port 0's answer
/// it is.
pub fn free_port(host: &str) -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let ephemeral_low: u32 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768);
    let highest = HIGHEST.min(ephemeral_low);
    if highest <= LOWEST {
        return bound_port(host, 0).expect("a free port");
    }
    let cluster = std::env::var("RINGMASTER_PORT_BASE")
        .ok()
        .and_then(|base| base.parse::<u32>().ok())
        .map(|base| base..base + CLUSTER_PORTS);
    let span = highest - LOWEST;
    // Test binaries run one after another, but start each from its own place anyway.
    let start = std::process::id().wrapping_mul(7919) % span;
    for _ in 0..span {
        let port = LOWEST + (start + NEXT.fetch_add(1, Ordering::Relaxed)) % span;
        if cluster.as_ref().is_some_and(|c| c.contains(&port)) {
            continue;
        }
        if let Some(port) = bound_port(host, port as u16) {
            return port;
        }
    }
    panic!("no free port on {host} between {LOWEST} and {highest}")
}

/// The port a listener on `host:port` got, if it could bind; the listener is closed again.
fn bound_port(host: &str, port: u16) -> Option<u16> {
    Some(
        std::net::TcpListener::bind((host, port))
            .ok()?
            .local_addr()
            .ok()?
            .port(),
    )
}
