//! R12: remote memory under attack across processes. The server (`serve --rma DIR`) holds a
//! set of regions on each shard and writes their descriptors and checksums to `DIR`; the
//! attacker (`rma-attack`) reads them and tries every access that must be refused, out of
//! bounds, overflowing, with the wrong permission, after a revoke or a deregistration, with
//! forged or random descriptors and raw requests past its own checks, and trusted (native)
//! RMA from a node that is not in trusted mode; then the accesses that must work. At the end
//! the server writes each region's checksum again and its counters (`DIR/final-SHARD.json`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::json;
use shardcx::proto::region::{GetRequest, PutRequest, RmaReply};
use shardcx::proto::{FrameKind, Limits};
use shardcx::rma::{Permissions, Region, RemoteRegion, RmaOpError, TrustedDescriptor};
use shardcx::shards::net::Dest;
use shardcx::{Error, Node, NodeId, Peer};

use super::hostile::Rng;
use super::{cli, node_with};

/// Every region's length.
pub(crate) const REGION_LEN: usize = 4096;

/// A node the `other` region is granted to: neither the attacker nor the server.
const STRANGER: NodeId = NodeId::new(0x5742_4E47);

/// Each operation's deadline: an answer (or a refusal) comes long before it.
const OP_DEADLINE: Duration = Duration::from_secs(2);

#[derive(clap::Args, Debug)]
pub(crate) struct RmaAttackArgs {
    /// The server.
    #[arg(long, value_name = "ADDR")]
    connect: SocketAddrArg,
    /// The server's region files (`serve --rma DIR`).
    #[arg(long, value_name = "DIR")]
    regions: PathBuf,
    /// The server's shards (a region file each).
    #[arg(long, value_name = "N", default_value = "2", value_parser = cli::positive)]
    server_shards: usize,
    /// The seed of the random descriptors and payloads.
    #[arg(long, value_name = "N", default_value_t = 1)]
    seed: u64,
    /// Random descriptors and random raw payloads per server shard.
    #[arg(long, value_name = "N", default_value_t = 50)]
    rounds: u64,
}

type SocketAddrArg = std::net::SocketAddr;

/// The byte pattern of region `name` on shard `shard`.
pub(crate) fn pattern(shard: usize, name: &str) -> Vec<u8> {
    let salt = name.bytes().fold(shard as u32 * 131, |h, b| {
        h.wrapping_mul(31).wrapping_add(u32::from(b))
    });
    (0..REGION_LEN)
        .map(|i| (i as u32).wrapping_mul(7).wrapping_add(salt) as u8)
        .collect()
}

/// The regions a serving shard holds (dropped, and so deregistered, when it stops).
pub(crate) struct Held {
    regions: Vec<(&'static str, Region)>,
    shard: usize,
}

/// Writes `value` to `path` at once (a temporary file renamed), for a reader that polls.
fn write_json(path: &Path, value: &serde_json::Value) -> Result<(), String> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, value.to_string()).map_err(|e| format!("{}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| format!("{}: {e}", path.display()))
}

/// On a serving shard: registers its regions, revokes `rev` once, deregisters `gone`, and
/// writes `DIR/regions-SHARD.json` with every descriptor (`rev` and `gone` as they were
/// before, `rev-new` after the revoke), each live region's CRC-32 and whether this node has
/// trusted mode.
pub(crate) fn serve_regions(node: &Node, dir: &Path) -> Result<Held, String> {
    let shard = node.shard().index();
    let reg = |name: &str, perms, grantee: Option<Peer>| {
        node.register_region(pattern(shard, name), perms, grantee)
            .map_err(|e| format!("register {name}: {e}"))
    };
    // Registered and deregistered first: a later region may take its slot (a new generation).
    let gone = reg("gone", Permissions::READ_WRITE, None)?;
    let gone_desc = gone.descriptor();
    gone.deregister().map_err(|e| format!("deregister: {e}"))?;
    let rev = reg("rev", Permissions::READ_WRITE, None)?;
    let rev_old = rev.descriptor();
    let rev_new = rev.revoke().map_err(|e| format!("revoke: {e}"))?;
    let regions = vec![
        ("rw", reg("rw", Permissions::READ_WRITE, None)?),
        ("ro", reg("ro", Permissions::READ, None)?),
        ("wo", reg("wo", Permissions::WRITE, None)?),
        (
            "other",
            reg("other", Permissions::READ_WRITE, Some(Peer::new(STRANGER)))?,
        ),
        ("scratch", reg("scratch", Permissions::READ_WRITE, None)?),
        ("rev", rev),
    ];
    let mut descs: BTreeMap<String, Vec<u8>> = regions
        .iter()
        .map(|(n, r)| ((*n).to_owned(), r.descriptor().to_bytes().to_vec()))
        .collect();
    descs.insert("rev".into(), rev_old.to_bytes().to_vec());
    descs.insert("rev-new".into(), rev_new.to_bytes().to_vec());
    descs.insert("gone".into(), gone_desc.to_bytes().to_vec());
    let held = Held { regions, shard };
    write_json(
        &dir.join(format!("regions-{shard}.json")),
        &json!({
            "shard": shard,
            "node": node.id().get(),
            "trusted_rma": node.trusted_rma_enabled(),
            "rma_feature": node.shard_ctx().context().features().rma,
            "descriptors": descs,
            "crc": held.crcs()?,
        }),
    )?;
    Ok(held)
}

impl Held {
    fn crcs(&self) -> Result<BTreeMap<&'static str, u32>, String> {
        self.regions
            .iter()
            .map(|(n, r)| {
                r.read(crc32fast::hash)
                    .map(|c| (*n, c))
                    .map_err(|e| format!("read {n}: {e}"))
            })
            .collect()
    }

    /// Writes `DIR/final-SHARD.json`: each region's CRC-32 now and this shard's counters.
    pub(crate) fn finish(&self, node: &Node, dir: &Path) -> Result<(), String> {
        let s = node.rma_stats();
        write_json(
            &dir.join(format!("final-{}.json", self.shard)),
            &json!({
                "crc": self.crcs()?,
                "stats": {
                    "puts": s.puts, "gets": s.gets, "refused": s.refused,
                    "malformed": s.malformed, "expired": s.expired,
                    "forwarded": s.forwarded, "unanswered": s.unanswered,
                },
            }),
        )
    }
}

/// An operation's outcome, as the suite sorts it: `Ok`, `Invalid.CODE` (the initiator's own
/// check), `Refused.CODE` (the holder), `TooLarge`, `WrongNode`, `TrustedOff`, `TimedOut`,
/// `Net.VARIANT` or the error's text.
fn outcome<T>(r: &Result<T, Error>) -> String {
    match r {
        Ok(_) => "Ok".into(),
        Err(Error::Rma(e)) => match e {
            RmaOpError::Invalid { source } => format!("Invalid.{:?}", source.code()),
            RmaOpError::Refused { code, .. } => format!("Refused.{code:?}"),
            RmaOpError::TooLarge { .. } => "TooLarge".into(),
            RmaOpError::WrongNode { .. } => "WrongNode".into(),
            RmaOpError::TrustedOff { .. } => "TrustedOff".into(),
            other => format!("Rma.{other}"),
        },
        Err(Error::TimedOut { .. }) => "TimedOut".into(),
        Err(Error::Net(n)) => format!(
            "Net.{}",
            format!("{n:?}")
                .split([' ', '{', '('])
                .next()
                .unwrap_or("?")
        ),
        Err(e) => format!(
            "Other.{}",
            format!("{e:?}")
                .split([' ', '{', '('])
                .next()
                .unwrap_or("?")
        ),
    }
}

/// Outcomes per class, and the longest any operation took.
#[derive(Default)]
struct Tally {
    classes: BTreeMap<&'static str, BTreeMap<String, u64>>,
    max: Duration,
    ops: u64,
}

impl Tally {
    fn add(&mut self, class: &'static str, outcome: String, took: Duration) {
        *self
            .classes
            .entry(class)
            .or_default()
            .entry(outcome)
            .or_default() += 1;
        self.max = self.max.max(took);
        self.ops += 1;
    }

    /// Runs `op`, timed, and records its outcome under `class`.
    async fn run<T>(
        &mut self,
        class: &'static str,
        op: impl std::future::Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        let t0 = Instant::now();
        let r = op.await;
        self.add(class, outcome(&r), t0.elapsed());
        r
    }
}

/// A copy of `d` with its bytes changed, as a forger would make it (an error when the result
/// does not decode).
fn forge(
    d: &RemoteRegion,
    f: impl FnOnce(&mut [u8; RemoteRegion::ENCODED_LEN]),
) -> Result<RemoteRegion, String> {
    let mut b = d.to_bytes();
    f(&mut b);
    RemoteRegion::from_bytes(&b).map_err(|e| e.to_string())
}

/// Sends a raw RMA request for region `id` of server shard `shard`, past the initiator's
/// checks: the reply's status (`Ok`, `Refused.CODE`, `BadReply`) or the net error.
async fn raw(
    node: &Node,
    (server, shard, id): (NodeId, shardcx::ShardId, u32),
    kind: FrameKind,
    payload: Vec<u8>,
) -> String {
    let r = node
        .shard_ctx()
        .request(Dest::shard(server, shard), kind, id, payload, OP_DEADLINE)
        .await;
    match r {
        Ok((h, reply)) if h.kind == FrameKind::RmaReply => {
            match RmaReply::decode(&reply, &Limits::default()) {
                Ok(r) => match r.status {
                    Ok(()) => "Ok".into(),
                    Err(code) => format!("Refused.{code:?}"),
                },
                Err(_) => "BadReply".into(),
            }
        }
        Ok((h, _)) => format!("Reply.{:?}", h.kind),
        Err(e) => outcome::<()>(&Err(Error::Net(e))),
    }
}

/// One server shard's descriptors, from its region file.
struct ShardRegions {
    descs: BTreeMap<String, RemoteRegion>,
}

impl ShardRegions {
    fn get(&self, name: &str) -> RemoteRegion {
        // The server writes every name the attack uses.
        self.descs[name]
    }
}

fn read_regions(
    dir: &Path,
    shards: usize,
) -> Result<(Vec<ShardRegions>, serde_json::Value), String> {
    let mut out = Vec::new();
    let mut modes = Vec::new();
    for s in 0..shards {
        let path = dir.join(format!("regions-{s}.json"));
        let text =
            std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut descs = BTreeMap::new();
        for (name, bytes) in v["descriptors"].as_object().ok_or("no descriptors")? {
            let b: Vec<u8> = serde_json::from_value(bytes.clone()).map_err(|e| e.to_string())?;
            let d = RemoteRegion::from_bytes(&b).map_err(|e| format!("{name}: {e}"))?;
            descs.insert(name.clone(), d);
        }
        modes.push(json!({"trusted_rma": v["trusted_rma"], "rma_feature": v["rma_feature"]}));
        out.push(ShardRegions { descs });
    }
    Ok((out, json!(modes)))
}

/// A trusted descriptor for `node` (forged: a made-up address, key and worker address), the
/// kind a node that is not in trusted mode must refuse to use before UCX sees it.
fn forged_trusted(node: NodeId, rng: &mut Rng) -> TrustedDescriptor {
    let mut b = Vec::new();
    b.extend_from_slice(b"SCXT");
    b.push(1);
    b.push(Permissions::READ_WRITE.bits());
    b.extend_from_slice(&0u16.to_le_bytes());
    b.extend_from_slice(&node.get().to_le_bytes());
    b.extend_from_slice(&1u64.to_le_bytes());
    b.extend_from_slice(&1u32.to_le_bytes());
    b.extend_from_slice(&16u32.to_le_bytes());
    b.extend_from_slice(&0x7f00_0000_0000u64.to_le_bytes());
    b.extend_from_slice(&(REGION_LEN as u64).to_le_bytes());
    b.extend_from_slice(&16u32.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    b.extend_from_slice(&rng.next().to_le_bytes());
    b.extend(rng.bytes(32));
    // The layout above is the documented one: it decodes.
    TrustedDescriptor::from_bytes(&b).expect("a well-formed forged trusted descriptor")
}

/// R12's attacker: one shard, not in trusted mode. Prints one JSON line: the outcomes per
/// class, the longest operation, what the valid accesses read, the CRC-32 each shard's
/// `scratch` region must have now, and the server's modes from its region files.
pub(crate) fn rma_attack(a: &RmaAttackArgs) -> Result<(), String> {
    let (regions, modes) = read_regions(&a.regions, a.server_shards)?;
    let (connect, seed, rounds) = (a.connect, a.seed, a.rounds);
    let regions = std::sync::Arc::new(
        regions
            .into_iter()
            .map(|r| r.descs.into_iter().collect::<Vec<_>>())
            .collect::<Vec<_>>(),
    );
    let out = node_with(None)
        .shards(1)
        .run(move |node: Node| {
            let (regions, modes) = (regions.clone(), modes.clone());
            async move {
                let peer = node
                    .connect_within(connect, Duration::from_secs(10))
                    .await
                    .map_err(|e| format!("cannot connect to {connect}: {e}"))?;
                let mut rng = Rng::new(seed);
                let mut t = Tally::default();
                let mut scratch_crc = Vec::new();
                let mut valid_reads = 0u64;
                let x = [0xEEu8; 16];
                for descs in regions.iter() {
                    let r = ShardRegions {
                        descs: descs.iter().cloned().collect(),
                    };
                    let rw = r.get("rw");
                    let id = |d: &RemoteRegion| (d.node(), d.shard(), d.id().get());
                    let len = REGION_LEN as u64;
                    // Out of bounds: caught by the initiator's check.
                    for (off, n) in [(len - 8, 16), (len, 1), (u64::MAX, 16), (len + 1, 0)] {
                        let data = vec![0xEE; n];
                        t.run("oob", peer.put_within(&rw, off, &data, OP_DEADLINE))
                            .await
                            .ok();
                        t.run("oob", peer.get_within(&rw, off, n as u64, OP_DEADLINE))
                            .await
                            .ok();
                    }
                    t.run("oob", peer.get_within(&rw, 1, u64::MAX, OP_DEADLINE))
                        .await
                        .ok();
                    // ... and by the holder, for a descriptor that lies about the length.
                    let long = forge(&rw, |b| b[24..32].copy_from_slice(&u64::MAX.to_le_bytes()))?;
                    for _ in 0..4 {
                        let off = len + rng.below(1 << 40);
                        t.run(
                            "oob-forged-length",
                            peer.put_within(&long, off, &x, OP_DEADLINE),
                        )
                        .await
                        .ok();
                        t.run(
                            "oob-forged-length",
                            peer.get_within(&long, off, 8, OP_DEADLINE),
                        )
                        .await
                        .ok();
                    }
                    t.run(
                        "oob-forged-length",
                        peer.put_within(&long, len - 4, &x, OP_DEADLINE),
                    )
                    .await
                    .ok();
                    // A get whose reply would exceed the message limit: refused before sending.
                    t.run("too-large", peer.get_within(&long, 0, 1 << 40, OP_DEADLINE))
                        .await
                        .ok();
                    // offset + length overflowing u64, sent raw past the initiator's check.
                    for off in [u64::MAX, u64::MAX - 3, u64::MAX - rng.below(1 << 20)] {
                        let mut p = Vec::new();
                        PutRequest {
                            generation: rw.generation(),
                            offset: off,
                            data: &x,
                        }
                        .encode_to_vec(&mut p, &Limits::default())
                        .map_err(|e| e.to_string())?;
                        let t0 = Instant::now();
                        let o = raw(&node, id(&rw), FrameKind::RmaPut, p).await;
                        t.add("overflow-raw", o, t0.elapsed());
                        let get = GetRequest {
                            generation: rw.generation(),
                            offset: off,
                            len: 8,
                        };
                        let p = get
                            .to_bytes(&Limits::default())
                            .map_err(|e| e.to_string())?;
                        let t0 = Instant::now();
                        let o = raw(&node, id(&rw), FrameKind::RmaGet, p.to_vec()).await;
                        t.add("overflow-raw", o, t0.elapsed());
                    }
                    // The wrong permission: a read-only region written, a write-only one read,
                    // at the initiator, by the holder with a descriptor that claims more, and
                    // raw.
                    let (ro, wo) = (r.get("ro"), r.get("wo"));
                    t.run("wrong-permission", peer.put_within(&ro, 0, &x, OP_DEADLINE))
                        .await
                        .ok();
                    t.run("wrong-permission", peer.get_within(&wo, 0, 8, OP_DEADLINE))
                        .await
                        .ok();
                    let ro_rw = forge(&ro, |b| b[14] = Permissions::READ_WRITE.bits())?;
                    t.run(
                        "wrong-permission",
                        peer.put_within(&ro_rw, 0, &x, OP_DEADLINE),
                    )
                    .await
                    .ok();
                    let wo_rw = forge(&wo, |b| b[14] = Permissions::READ_WRITE.bits())?;
                    t.run(
                        "wrong-permission",
                        peer.get_within(&wo_rw, 0, 8, OP_DEADLINE),
                    )
                    .await
                    .ok();
                    let mut p = Vec::new();
                    PutRequest {
                        generation: ro.generation(),
                        offset: 0,
                        data: &x,
                    }
                    .encode_to_vec(&mut p, &Limits::default())
                    .map_err(|e| e.to_string())?;
                    let t0 = Instant::now();
                    let o = raw(&node, id(&ro), FrameKind::RmaPut, p).await;
                    t.add("wrong-permission", o, t0.elapsed());
                    // Granted to another node.
                    let other = r.get("other");
                    t.run("not-grantee", peer.put_within(&other, 0, &x, OP_DEADLINE))
                        .await
                        .ok();
                    t.run("not-grantee", peer.get_within(&other, 0, 8, OP_DEADLINE))
                        .await
                        .ok();
                    // After the revoke (the old descriptor) and after the deregistration.
                    let (rev, gone) = (r.get("rev"), r.get("gone"));
                    for d in [rev, gone] {
                        let class = if d == rev {
                            "after-revoke"
                        } else {
                            "after-deregister"
                        };
                        t.run(class, peer.put_within(&d, 0, &x, OP_DEADLINE))
                            .await
                            .ok();
                        t.run(class, peer.get_within(&d, 0, 8, OP_DEADLINE))
                            .await
                            .ok();
                    }
                    // Forged descriptors: guessed generations, another slot, a shard the server
                    // does not have, another node.
                    for g in [
                        rw.generation().get() + 1,
                        0,
                        rng.next(),
                        rev.generation().get(),
                    ] {
                        let d = forge(&rw, |b| b[16..24].copy_from_slice(&g.to_le_bytes()))?;
                        t.run("forged-generation", peer.put_within(&d, 0, &x, OP_DEADLINE))
                            .await
                            .ok();
                        t.run("forged-generation", peer.get_within(&d, 0, 8, OP_DEADLINE))
                            .await
                            .ok();
                    }
                    let unused = forge(&rw, |b| {
                        b[8..12].copy_from_slice(&(rw.id().get() + 500).to_le_bytes());
                    })?;
                    let nowhere = forge(&rw, |b| {
                        b[8..12].copy_from_slice(&((77u32 << 20) | 1).to_le_bytes());
                        b[12..14].copy_from_slice(&77u16.to_le_bytes());
                    })?;
                    for d in [unused, nowhere] {
                        t.run("forged-id", peer.put_within(&d, 0, &x, OP_DEADLINE))
                            .await
                            .ok();
                        t.run("forged-id", peer.get_within(&d, 0, 8, OP_DEADLINE))
                            .await
                            .ok();
                    }
                    let elsewhere = forge(&rw, |b| b[0..8].copy_from_slice(&7u64.to_le_bytes()))?;
                    t.run(
                        "forged-node",
                        peer.put_within(&elsewhere, 0, &x, OP_DEADLINE),
                    )
                    .await
                    .ok();
                    // Random descriptor bytes: refused when they do not decode, else by one of
                    // the checks (the node id kept, so that they go to the server).
                    for _ in 0..rounds {
                        let mut b = rng.bytes(RemoteRegion::ENCODED_LEN);
                        b[0..8].copy_from_slice(&rw.node().get().to_le_bytes());
                        if rng.below(2) == 0 {
                            // Often decodable: a consistent shard, no reserved bits.
                            let shard = rng.below(4) as u16;
                            let slot = 1 + rng.below(16) as u32;
                            b[8..12]
                                .copy_from_slice(&((u32::from(shard) << 20) | slot).to_le_bytes());
                            b[12..14].copy_from_slice(&shard.to_le_bytes());
                            b[14] &= 3;
                            b[15] = 0;
                        }
                        match RemoteRegion::from_bytes(&b) {
                            Err(_) => {
                                t.add("random-descriptor", "Descriptor".into(), Duration::ZERO)
                            }
                            Ok(d) => {
                                let off = rng.below(2 * len);
                                if rng.below(2) == 0 {
                                    t.run(
                                        "random-descriptor",
                                        peer.put_within(&d, off, &x, OP_DEADLINE),
                                    )
                                    .await
                                    .ok();
                                } else {
                                    t.run(
                                        "random-descriptor",
                                        peer.get_within(&d, off, 8, OP_DEADLINE),
                                    )
                                    .await
                                    .ok();
                                }
                            }
                        }
                    }
                    // Random raw request payloads for real regions.
                    for _ in 0..rounds {
                        let target = [rw, ro, wo, r.get("scratch")][rng.below(4) as usize];
                        let kind = if rng.below(2) == 0 {
                            FrameKind::RmaPut
                        } else {
                            FrameKind::RmaGet
                        };
                        let n = rng.below(64) as usize;
                        let mut p = rng.bytes(n);
                        // Half of them with the right generation up front.
                        if rng.below(2) == 0 && p.len() >= 8 {
                            p[..8].copy_from_slice(&target.generation().get().to_le_bytes());
                        }
                        let t0 = Instant::now();
                        let o = raw(&node, id(&target), kind, p).await;
                        t.add("malformed-raw", o, t0.elapsed());
                    }
                    // The accesses that must work: reads of the untouched regions, the revoked
                    // region through its new descriptor, a write to scratch read back.
                    let want = |name: &str| pattern(rw.shard().index(), name);
                    let got = t
                        .run("valid", peer.get_within(&rw, 0, len, OP_DEADLINE))
                        .await;
                    valid_reads += u64::from(got.as_deref().ok() == Some(&want("rw")[..]));
                    let got = t
                        .run(
                            "valid",
                            peer.get_within(&r.get("rev-new"), 0, len, OP_DEADLINE),
                        )
                        .await;
                    valid_reads += u64::from(got.as_deref().ok() == Some(&want("rev")[..]));
                    let scratch = r.get("scratch");
                    let mut mine = want("scratch");
                    let data = rng.bytes(100);
                    let off = rng.below(len - 100) as usize;
                    mine[off..off + 100].copy_from_slice(&data);
                    t.run(
                        "valid",
                        peer.put_within(&scratch, off as u64, &data, OP_DEADLINE),
                    )
                    .await
                    .ok();
                    let got = t
                        .run("valid", peer.get_within(&scratch, 0, len, OP_DEADLINE))
                        .await;
                    valid_reads += u64::from(got.as_deref().ok() == Some(&mine[..]));
                    scratch_crc.push(crc32fast::hash(&mine));
                }
                // Trusted (native) RMA: this node is not in trusted mode, so it refuses every
                // trusted call before UCX sees it, even one the descriptor forbids.
                let server = peer.node_id();
                let feature = node.shard_ctx().context().features().rma;
                let r = node
                    .register_trusted_region(REGION_LEN, Permissions::READ_WRITE)
                    .map(drop);
                t.add("trusted-off", outcome(&r), Duration::ZERO);
                for _ in 0..4 {
                    let d = forged_trusted(server, &mut rng);
                    t.run(
                        "trusted-off",
                        peer.put_trusted_within(&d, 0, &x, OP_DEADLINE),
                    )
                    .await
                    .ok();
                    t.run(
                        "trusted-off",
                        peer.get_trusted_within(&d, 0, 8, OP_DEADLINE),
                    )
                    .await
                    .ok();
                    t.run(
                        "trusted-off",
                        peer.put_trusted_within(&d, u64::MAX, &x, OP_DEADLINE),
                    )
                    .await
                    .ok();
                }
                let ts = node.trusted_rma_stats();
                Ok::<_, String>(json!({
                    "classes": t.classes,
                    "ops": t.ops,
                    "max_ms": t.max.as_millis() as u64,
                    "valid_reads": valid_reads,
                    "scratch_crc": scratch_crc,
                    "trusted_enabled": node.trusted_rma_enabled(),
                    "rma_feature": feature,
                    "trusted_ops": ts.puts + ts.gets + ts.endpoints,
                    "server_modes": modes,
                }))
            }
        })
        .map_err(|e| e.to_string())?;
    for r in out {
        println!("{}", r?);
    }
    Ok(())
}

#[derive(clap::Args, Debug)]
pub(crate) struct RmaLoadArgs {
    /// The server.
    #[arg(long, value_name = "ADDR")]
    connect: SocketAddrArg,
    /// The server's region files (`serve --rma DIR`).
    #[arg(long, value_name = "DIR")]
    regions: PathBuf,
    /// The server's shards (a region file each).
    #[arg(long, value_name = "N", default_value = "2", value_parser = cli::positive)]
    server_shards: usize,
    /// Operations in flight per server shard.
    #[arg(long, value_name = "N", default_value = "8", value_parser = cli::positive)]
    window: usize,
    /// Seconds of load.
    #[arg(long = "for", value_name = "SECS", default_value = "5", value_parser = cli::seconds)]
    load_for: Duration,
    /// Each operation's deadline, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 2000)]
    deadline_ms: u64,
}

/// What an RMA load saw.
#[derive(Default)]
struct LoadTally {
    sent: u64,
    ok: u64,
    late: u64,
    max_over: Duration,
    first_error: Option<Duration>,
    failed: BTreeMap<String, u64>,
}

/// R10's remote-memory load: one shard, `window` operations in flight per server shard, puts
/// of 64 bytes to its `scratch` region alternating with gets of 64 bytes of `rw`, each with
/// the deadline `--deadline-ms`, for `--for` seconds or until SIGTERM. A get that reads other
/// bytes than the server wrote counts as `BadData`. Prints one JSON line: `{"start_unix_ms",
/// "sent", "ok", "late", "max_over_ms", "first_error_ms", "failed": {kind: n}}` (`late`: ended
/// more than 250 ms after its deadline; `first_error_ms` from the start).
pub(crate) fn rma_load(a: &RmaLoadArgs) -> Result<(), String> {
    let (regions, _) = read_regions(&a.regions, a.server_shards)?;
    let regions = std::sync::Arc::new(
        regions
            .into_iter()
            .map(|r| (r.get("rw"), r.get("scratch")))
            .collect::<Vec<_>>(),
    );
    let (connect, window, load_for) = (a.connect, a.window, a.load_for);
    let deadline = Duration::from_millis(a.deadline_ms);
    let stop = super::stop_flag()?;
    let start = Instant::now();
    let start_unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let out = node_with(None)
        .shards(1)
        .run(move |node: Node| {
            let (regions, stop) = (regions.clone(), stop.clone());
            async move {
                let peer = node
                    .connect_within(connect, Duration::from_secs(10))
                    .await
                    .map_err(|e| format!("cannot connect to {connect}: {e}"))?;
                node.add_peer_addr(peer.node_id(), connect);
                let tally = std::rc::Rc::new(std::cell::RefCell::new(LoadTally::default()));
                let mut tasks = Vec::new();
                for &(rw, scratch) in regions.iter() {
                    let want = pattern(rw.shard().index(), "rw");
                    for w in 0..window {
                        let (tally, stop, want) = (tally.clone(), stop.clone(), want.clone());
                        tasks.push(glommio::spawn_local(async move {
                            let mut i = w as u64;
                            while start.elapsed() < load_for
                                && !stop.load(std::sync::atomic::Ordering::Acquire)
                            {
                                let off = (i * 64) % REGION_LEN as u64;
                                let t0 = Instant::now();
                                tally.borrow_mut().sent += 1;
                                let r = if i % 2 == 0 {
                                    peer.put_within(&scratch, off, &[i as u8; 64], deadline)
                                        .await
                                        .map(|()| "Ok".to_owned())
                                } else {
                                    let at = off as usize;
                                    peer.get_within(&rw, off, 64, deadline).await.map(|d| {
                                        if d[..] == want[at..at + 64] {
                                            "Ok".to_owned()
                                        } else {
                                            "BadData".to_owned()
                                        }
                                    })
                                };
                                let took = t0.elapsed();
                                let kind = match &r {
                                    Ok(k) => k.clone(),
                                    Err(_) => outcome(&r),
                                };
                                let failed = kind != "Ok";
                                {
                                    let mut t = tally.borrow_mut();
                                    let over = took.saturating_sub(deadline);
                                    t.max_over = t.max_over.max(over);
                                    t.late += u64::from(over > super::LATE_SLACK);
                                    if failed {
                                        t.first_error.get_or_insert(start.elapsed());
                                        *t.failed.entry(kind).or_default() += 1;
                                    } else {
                                        t.ok += 1;
                                    }
                                }
                                if failed {
                                    glommio::timer::sleep(Duration::from_millis(20)).await;
                                }
                                i += window as u64;
                            }
                        }));
                    }
                }
                for t in tasks {
                    t.await;
                }
                let t = tally.borrow();
                Ok::<_, String>(json!({
                    "start_unix_ms": start_unix_ms,
                    "sent": t.sent,
                    "ok": t.ok,
                    "late": t.late,
                    "max_over_ms": t.max_over.as_millis() as u64,
                    "first_error_ms": t.first_error.map(|d| d.as_millis() as u64),
                    "failed": t.failed,
                }))
            }
        })
        .map_err(|e| e.to_string())?;
    for r in out {
        println!("{}", r?);
    }
    Ok(())
}
