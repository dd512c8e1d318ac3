//! Boot a set of shards on this machine and have each report where it runs: its CPU set, its
//! UCX worker address and the transports its worker selected.
//!
//! ```sh
//! cargo run --release --example hello_shards                  # one shard per core, pinned
//! cargo run --release --example hello_shards -- --shards 4 --unpinned --tls tcp
//! ```

use std::rc::Rc;

use shardcx::shards::{Placement, ShardCtx, ShardsBuilder};

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

fn usage() -> ! {
    eprintln!("usage: hello_shards [--shards N] [--unpinned] [--tls LIST]");
    std::process::exit(2)
}

fn main() {
    let mut builder = ShardsBuilder::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--shards" => {
                let n = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| usage());
                builder = builder.shard_count(n);
            }
            "--unpinned" => builder = builder.placement(Placement::Unpinned),
            "--tls" => builder = builder.transports(&args.next().unwrap_or_else(|| usage())),
            _ => usage(),
        }
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
