//! Which fabric NCCL chose, read from NCCL's own account of it: with `NCCL_DEBUG=INFO` and
//! `NCCL_DEBUG_SUBSYS=INIT,NET` it writes the network it uses ("Using network IB" or
//! "Socket") and, for each channel it connects, the transport ("via NET/IB/0/GDRDMA",
//! "via NET/Socket/1", "via P2P/CUMEM", "via SHM/direct/direct") to `NCCL_DEBUG_FILE`. A job
//! that asked for InfiniBand and got sockets trains ten times slower without a word, so the
//! trainer says which it got ([`ringmaster_contract::trainer::Fabric`]).

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// The variables that make NCCL write its account to a file the trainer reads, unless the
/// user set `NCCL_DEBUG` (then NCCL's output is theirs, and a file of theirs is read when
/// they named one with `NCCL_DEBUG_FILE`). `folder` is where the file goes.
pub fn debug_settings(env: &HashMap<String, String>, folder: &Path) -> Vec<(String, String)> {
    if env.contains_key("NCCL_DEBUG") {
        return Vec::new();
    }
    let file = folder.join("ringmaster-nccl.%h.%p.log");
    vec![
        ("NCCL_DEBUG".into(), "INFO".into()),
        ("NCCL_DEBUG_SUBSYS".into(), "INIT,NET".into()),
        ("NCCL_DEBUG_FILE".into(), file.display().to_string()),
    ]
}

/// The file NCCL writes its account to in this process: `NCCL_DEBUG_FILE` with `%h` (the
/// host name) and `%p` (the process id) filled in as NCCL fills them.
pub fn debug_file(env: &HashMap<String, String>, host: &str, pid: u32) -> Option<PathBuf> {
    let pattern = env.get("NCCL_DEBUG_FILE")?;
    Some(PathBuf::from(
        pattern.replace("%h", host).replace("%p", &pid.to_string()),
    ))
}

/// What one rank's NCCL said of its fabric.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FabricSeen {
    /// The network NCCL uses between hosts (`IB`, `Socket`, a plugin's name).
    pub network: Option<String>,
    /// The transports of the channels connected so far (`NET/IB`, `NET/Socket`, `P2P`,
    /// `SHM`, …), without channel numbers.
    pub transports: BTreeSet<String>,
    /// Whether a network channel reads and writes GPU memory directly (GPUDirect RDMA).
    pub gpu_direct_rdma: bool,
}

impl FabricSeen {
    /// Whether this rank's traffic between hosts goes over InfiniBand: its network is
    /// `IB` and no network channel uses sockets.
    pub fn on_infiniband(&self) -> bool {
        self.network.as_deref() == Some("IB") && !self.transports.contains("NET/Socket")
    }
}

/// Reads NCCL's INFO lines.
pub fn parse(log: &str) -> FabricSeen {
    let mut seen = FabricSeen::default();
    for line in log.lines() {
        if let Some(rest) = line.split("Using network ").nth(1) {
            seen.network = rest.split_whitespace().next().map(str::to_string);
        }
        if let Some(via) = line.split(" via ").nth(1) {
            let via = via.trim();
            seen.gpu_direct_rdma |= via.contains("GDRDMA");
            seen.transports.insert(transport(via));
        }
    }
    seen
}

/// `NET/IB/0/GDRDMA` → `NET/IB`; `P2P/CUMEM/read` → `P2P`; `SHM/direct/direct` → `SHM`.
fn transport(via: &str) -> String {
    let mut parts = via.split('/');
    match parts.next() {
        Some("NET") => format!("NET/{}", parts.next().unwrap_or("?")),
        Some(kind) => kind.split_whitespace().next().unwrap_or(kind).to_string(),
        None => via.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Lines as NCCL 2.28 writes them (INIT,NET), trimmed of their host/pid prefix.
    const SOCKETS: &str = "\
gpu-1:123:123 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so.
gpu-1:123:123 [0] NCCL INFO NET/IB : No device found.
gpu-1:123:123 [0] NCCL INFO NET/Socket : Using [0]lo:127.0.0.1<0>
gpu-1:123:123 [0] NCCL INFO Using network Socket
gpu-1:123:140 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Socket/0
gpu-1:123:140 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[0] [send] via NET/Socket/0
";
    const INFINIBAND: &str = "\
nd96-0:77:77 [3] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB eth0:10.0.0.4<0>
nd96-0:77:77 [3] NCCL INFO Using network IB
nd96-0:77:90 [3] NCCL INFO Channel 00/0 : 3[3] -> 11[3] [send] via NET/IB/3/GDRDMA
nd96-0:77:90 [3] NCCL INFO Channel 00/0 : 3[3] -> 4[4] via P2P/CUMEM/read
nd96-0:77:90 [3] NCCL INFO Channel 01/0 : 2[2] -> 3[3] via SHM/direct/direct
";

    #[test]
    fn sockets_and_infiniband_are_told_apart_from_ncclss_own_lines() {
        let sockets = parse(SOCKETS);
        assert_eq!(sockets.network.as_deref(), Some("Socket"));
        assert_eq!(
            sockets.transports,
            BTreeSet::from(["NET/Socket".to_string()])
        );
        assert!(!sockets.on_infiniband() && !sockets.gpu_direct_rdma);
        let ib = parse(INFINIBAND);
        assert_eq!(ib.network.as_deref(), Some("IB"));
        assert_eq!(
            ib.transports,
            BTreeSet::from(["NET/IB".into(), "P2P".into(), "SHM".into()])
        );
        assert!(ib.on_infiniband() && ib.gpu_direct_rdma);
        assert_eq!(parse(""), FabricSeen::default());
    }

    #[test]
    fn nccl_writes_its_account_to_a_file_unless_the_user_took_its_output() {
        let folder = Path::new("/tmp/x");
        let settings = debug_settings(&HashMap::new(), folder);
        let env: HashMap<String, String> = settings.into_iter().collect();
        assert_eq!(env["NCCL_DEBUG_SUBSYS"], "INIT,NET");
        assert_eq!(
            debug_file(&env, "gpu-1", 42),
            Some(PathBuf::from("/tmp/x/ringmaster-nccl.gpu-1.42.log"))
        );
        let theirs = HashMap::from([("NCCL_DEBUG".to_string(), "WARN".to_string())]);
        assert!(debug_settings(&theirs, folder).is_empty());
        assert_eq!(debug_file(&theirs, "h", 1), None);
    }
}
