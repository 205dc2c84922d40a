//! `kwok-nodes`: add or remove simulated AKS nodes (KWOK) of a VM size on the local cluster.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use k8s_openapi::api::core::v1::Taint;
use ringmaster::api::vm_sizes::KNOWN_VM_SIZES;
use ringmaster_e2e::nodes::{self, PoolMode, PoolShape};

/// Adds and removes simulated AKS agent-pool nodes (KWOK: no kubelet, no GPU behind them)
/// on the cluster of $RINGMASTER_KUBECONFIG (default e2e/.state/kubeconfig).
#[derive(Parser, Debug)]
#[command(name = "kwok-nodes", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Create (or update) nodes 0..COUNT of a pool.
    Add {
        /// Agent pool name (the kubernetes.azure.com/agentpool label).
        #[arg(long)]
        pool: String,
        /// Azure VM size, e.g. Standard_ND96asr_v4 (`kwok-nodes sizes` lists them).
        #[arg(long)]
        vm_size: String,
        /// How many nodes.
        #[arg(long, default_value_t = 1)]
        count: u32,
        /// AKS pool mode.
        #[arg(long, value_enum, default_value_t = PoolMode::User)]
        mode: PoolMode,
        /// A taint KEY=VALUE:EFFECT on every node (repeatable).
        #[arg(long = "taint", value_parser = parse_taint)]
        taints: Vec<Taint>,
    },
    /// Delete every node of a pool.
    Remove {
        /// Agent pool name.
        #[arg(long)]
        pool: String,
    },
    /// List the VM sizes nodes can be shaped like.
    Sizes,
}

fn parse_taint(text: &str) -> Result<Taint, String> {
    let (key_value, effect) = text.rsplit_once(':').ok_or("expected KEY=VALUE:EFFECT")?;
    let (key, value) = key_value.split_once('=').unwrap_or((key_value, ""));
    if !["NoSchedule", "PreferNoSchedule", "NoExecute"].contains(&effect) {
        return Err(format!(
            "effect must be NoSchedule, PreferNoSchedule or NoExecute, not {effect}"
        ));
    }
    Ok(Taint {
        key: key.to_string(),
        value: (!value.is_empty()).then(|| value.to_string()),
        effect: effect.to_string(),
        time_added: None,
    })
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    match run(Cli::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("kwok-nodes: {message}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<(), String> {
    match cli.command {
        Command::Sizes => {
            for s in KNOWN_VM_SIZES {
                let ib = if s.infiniband { "InfiniBand" } else { "" };
                println!(
                    "{:<30} {:>2} GPUs {:>4} vCPUs {:>5} GiB  {ib}",
                    s.name, s.gpus, s.cpus, s.memory_gib
                );
            }
            Ok(())
        }
        Command::Add {
            pool,
            vm_size,
            count,
            mode,
            taints,
        } => {
            let mut shape = PoolShape::new(&pool, &vm_size, mode).map_err(|e| e.to_string())?;
            shape.taints = taints;
            let client = ringmaster_e2e::cluster::client()
                .await
                .map_err(|e| e.to_string())?;
            let names = nodes::add(&client, &shape, count)
                .await
                .map_err(|e| e.to_string())?;
            println!(
                "pool {pool}: {} × {vm_size}: {}",
                names.len(),
                names.join(" ")
            );
            Ok(())
        }
        Command::Remove { pool } => {
            let client = ringmaster_e2e::cluster::client()
                .await
                .map_err(|e| e.to_string())?;
            let names = nodes::remove(&client, &pool)
                .await
                .map_err(|e| e.to_string())?;
            println!("pool {pool}: removed {} nodes", names.len());
            Ok(())
        }
    }
}
