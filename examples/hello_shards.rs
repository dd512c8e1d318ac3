//! Boot a set of shards on this machine and have each report where it runs: its CPU set, its
//! UCX worker address and the transports its worker selected.
//!
//! ```sh
//! cargo run --release --example hello_shards                  # one shard per core, pinned
//! cargo run --release --example hello_shards -- --shards 4 --unpinned --tls tcp
//! ```

use std::rc::Rc;

use shardcx::shards::{Placement, ShardCtx, ShardsBuilder};

#[path = "common/cli.rs"]
mod cli;

struct Report {
    shard: usize,
    cpus: Vec<usize>,
    address: Vec<u8>,
    transports: Vec<String>,
}

/// The resources of `ucp_context_print_info` ("#      resource 3  :  md 3  dev 2  flags --
/// tcp/lo"): the transports and devices the shard's context may use.
fn transports(info: &str) -> Vec<String> {
    info.lines()
        .filter(|l| {
            l.trim_start_matches('#')
                .trim_start()
                .starts_with("resource")
        })
        .filter_map(|l| l.split_whitespace().last().map(str::to_owned))
        .collect()
}

/// One shard per CPU: each prints its CPUs, its UCX worker address and transports.
#[derive(clap::Parser)]
#[command(name = "hello_shards")]
struct Args {
    /// Shards (default: one per CPU).
    #[arg(long, value_name = "N", value_parser = cli::positive)]
    shards: Option<usize>,
    /// Leave the shard threads unpinned.
    #[arg(long)]
    unpinned: bool,
    /// UCX transports, e.g. tcp or sm,tcp (default: UCX_TLS or UCX's choice).
    #[arg(long, value_name = "LIST")]
    tls: Option<String>,
}

fn main() {
    let a = <Args as clap::Parser>::parse();
    let mut builder = ShardsBuilder::new();
    if let Some(n) = a.shards {
        builder = builder.shard_count(n);
    }
    if a.unpinned {
        builder = builder.placement(Placement::Unpinned);
    }
    if let Some(tls) = &a.tls {
        builder = builder.transports(tls);
    }
    println!("{}", shardcx::ucx::version());
    let reports = builder.run(|ctx: Rc<ShardCtx>| async move {
        let worker = ctx.worker();
        Report {
            shard: ctx.id().index(),
            cpus: shardcx::ucx::thread_cpus(0).unwrap_or_default(),
            address: worker
                .address()
                .map(|a| a.as_bytes().to_vec())
                .unwrap_or_default(),
            transports: transports(&ctx.context().info()),
        }
    });
    let reports = match reports {
        Ok(r) => r,
        Err(e) => {
            eprintln!("hello_shards: {e}");
            std::process::exit(1);
        }
    };
    println!(
        "{:<6} {:<10} {:<28} transports",
        "shard", "cpus", "worker address"
    );
    for r in reports {
        let hex: String = r
            .address
            .iter()
            .take(8)
            .map(|b| format!("{b:02x}"))
            .collect();
        let cpus: Vec<String> = r.cpus.iter().map(usize::to_string).collect();
        println!(
            "{:<6} {:<10} {:<28} {}",
            r.shard,
            cpus.join(","),
            format!("{hex}.. ({} B)", r.address.len()),
            r.transports.join(" ")
        );
    }
}
