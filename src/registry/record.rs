//! The stored form of a [`NodeRecord`]: a short, versioned text, readable with `redis-cli GET`.
//!
//! The format is specified in the [`redis`](super::redis#data-model) module's docs (the public
//! description); this module is its only writer and reader. Decoding is strict: anything that
//! [`encode`] would not have written is a [`RecordError`], so a reader never guesses, and a
//! later format takes a new version number.

use std::net::SocketAddr;

use shardcx_shards::proto::NodeId;

use super::{NodeRecord, Signature};

/// The first line's tag.
const MAGIC: &str = "shardcx-node";
/// The format version this module writes and reads.
pub(crate) const VERSION: u32 = 1;
/// Largest record decoded, in bytes.
pub(crate) const MAX_RECORD: usize = 1 << 20;
/// Most functions one record may list.
pub(crate) const MAX_FUNCTIONS: usize = 4096;

/// Why stored bytes are not a valid record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum RecordError {
    /// Longer than [`MAX_RECORD`].
    #[error("record of {0} bytes is larger than the limit")]
    TooLarge(usize),
    /// Not this format, or another version of it.
    #[error("not a version-{VERSION} shardcx node record")]
    Version,
    /// A line is missing, out of order, or does not parse.
    #[error("bad record line {line}: {what}")]
    Line {
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        what: &'static str,
    },
    /// A line before the functions is missing.
    #[error("record ends early")]
    Truncated,
    /// More than [`MAX_FUNCTIONS`] functions.
    #[error("record lists more functions than the limit")]
    TooManyFunctions,
}

/// The stored form of `record`.
pub(crate) fn encode(record: &NodeRecord) -> Vec<u8> {
    let mut out = format!(
        "{MAGIC} {VERSION}\nservice {}\nnode {}\naddr {}\nshards {}\n",
        escape(&record.service),
        record.node.get(),
        record.addr,
        record.shards
    );
    for f in &record.functions {
        out.push_str(&format!(
            "fn {} {:016x} {} {}\n",
            f.id,
            f.schema,
            f.version,
            escape(&f.name)
        ));
    }
    out.into_bytes()
}

/// The record stored as `bytes`.
pub(crate) fn decode(bytes: &[u8]) -> Result<NodeRecord, RecordError> {
    if bytes.len() > MAX_RECORD {
        return Err(RecordError::TooLarge(bytes.len()));
    }
    let text = std::str::from_utf8(bytes).map_err(|_| RecordError::Version)?;
    let body = text.strip_suffix('\n').ok_or(RecordError::Line {
        line: text.lines().count().max(1),
        what: "missing final newline",
    })?;
    let mut lines = body.split('\n').enumerate().map(|(i, l)| (i + 1, l));
    let (_, header) = lines.next().ok_or(RecordError::Version)?;
    if header != format!("{MAGIC} {VERSION}") {
        return Err(RecordError::Version);
    }
    let mut field = |key: &'static str| -> Result<(usize, &str), RecordError> {
        let (line, l) = lines.next().ok_or(RecordError::Truncated)?;
        match l.split_once(' ') {
            Some((k, v)) if k == key => Ok((line, v)),
            _ => Err(RecordError::Line {
                line,
                what: "unexpected line",
            }),
        }
    };
    let (line, service) = field("service")?;
    let service = unescape(service).ok_or(RecordError::Line {
        line,
        what: "bad service name",
    })?;
    let (line, node) = field("node")?;
    let node = NodeId::new(number(node).ok_or(RecordError::Line {
        line,
        what: "bad node id",
    })?);
    let (line, addr) = field("addr")?;
    let addr: SocketAddr = addr.parse().map_err(|_| RecordError::Line {
        line,
        what: "bad address",
    })?;
    let (line, shards) = field("shards")?;
    let shards = number(shards).ok_or(RecordError::Line {
        line,
        what: "bad shard count",
    })?;
    let mut functions = Vec::new();
    for (line, l) in lines {
        if functions.len() == MAX_FUNCTIONS {
            return Err(RecordError::TooManyFunctions);
        }
        functions.push(function(l).ok_or(RecordError::Line {
            line,
            what: "bad function line",
        })?);
    }
    Ok(NodeRecord {
        service,
        node,
        addr,
        shards,
        functions,
    })
}

/// `fn <id> <schema> <version> <name>`.
fn function(line: &str) -> Option<Signature> {
    let mut parts = line.split(' ');
    let (Some("fn"), Some(id), Some(schema), Some(version), Some(name), None) = (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) else {
        return None;
    };
    let hex_ok = schema.len() == 16
        && schema
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    Some(Signature {
        id: number(id)?,
        schema: if hex_ok {
            u64::from_str_radix(schema, 16).ok()?
        } else {
            return None;
        },
        version: number(version)?,
        name: unescape(name)?,
    })
}

/// A decimal number: digits only (no sign), in range.
fn number<T: std::str::FromStr>(s: &str) -> Option<T> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_graphic() && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn unescape(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            if !hex
                .bytes()
                .all(|h| h.is_ascii_digit() || (b'A'..=b'F').contains(&h))
            {
                return None;
            }
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else if b.is_ascii_graphic() {
            out.push(b);
            i += 1;
        } else {
            return None;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // A test may panic: a panic is a failure it reports.

    use super::*;

    fn sample() -> NodeRecord {
        NodeRecord {
            service: "kv store/ä%".into(),
            node: NodeId::new(u64::MAX),
            addr: "[::1]:4100".parse().unwrap(),
            shards: 4,
            functions: vec![
                Signature {
                    id: 1,
                    name: "kv.get".into(),
                    schema: 0x00c0_ffee_00c0_ffee,
                    version: 1,
                },
                Signature {
                    id: u32::MAX,
                    name: "with space\nand newline".into(),
                    schema: u64::MAX,
                    version: 0,
                },
            ],
        }
    }

    #[test]
    fn round_trips_and_reads_as_documented() {
        let r = sample();
        let bytes = encode(&r);
        assert_eq!(decode(&bytes).unwrap(), r);
        let text = String::from_utf8(bytes).unwrap();
        assert!(text.starts_with("shardcx-node 1\nservice kv%20store/%C3%A4%25\n"));
        assert!(text.contains("\nfn 1 00c0ffee00c0ffee 1 kv.get\n"));
        assert!(text.ends_with("fn 4294967295 ffffffffffffffff 0 with%20space%0Aand%20newline\n"));
        let empty = NodeRecord {
            service: String::new(),
            node: NodeId::new(0),
            addr: "127.0.0.1:1".parse().unwrap(),
            shards: 0,
            functions: Vec::new(),
        };
        assert_eq!(decode(&encode(&empty)).unwrap(), empty);
    }

    #[test]
    fn rejects_anything_else_without_panicking() {
        let good = String::from_utf8(encode(&sample())).unwrap();
        let bad: Vec<String> = vec![
            String::new(),
            "\n".into(),
            "garbage".into(),
            good.replace("shardcx-node 1", "shardcx-node 2"),
            good.trim_end().to_string(),
            good.replace("node 18446744073709551615", "node 18446744073709551616"),
            good.replace("node 18446744073709551615", "node +1"),
            good.replace("shards 4", "shards 65536"),
            good.replace("addr [::1]:4100", "addr localhost:4100"),
            good.replace("service kv", "servic kv"),
            good.replace("00c0ffee00c0ffee", "00C0FFEE00C0FFEE"),
            good.replace("00c0ffee00c0ffee", "c0ffee"),
            good.replace("%C3", "%c3"),
            good.replace("%C3", "%C"),
            good.replace("%C3%A4", "%FF"),
            good.replace("kv.get", "kv.get extra"),
            format!("{good}\n"),
            format!("{good}junk\n"),
            "shardcx-node 1\nservice a\n".into(),
        ];
        for b in &bad {
            assert!(decode(b.as_bytes()).is_err(), "accepted {b:?}");
        }
        assert_eq!(decode(&[0xFF, 0xFE]), Err(RecordError::Version));
        let huge = vec![b'x'; MAX_RECORD + 1];
        assert_eq!(decode(&huge), Err(RecordError::TooLarge(MAX_RECORD + 1)));
        // A truncated record is an error, never a panic, unless the cut falls between two
        // function lines (then it is the record with fewer functions).
        for cut in 0..good.len() {
            if let Ok(r) = decode(&good.as_bytes()[..cut]) {
                assert!(
                    good[..cut].ends_with('\n') && r.functions.len() < 2,
                    "cut at {cut}"
                );
            }
        }
    }

    #[test]
    fn function_count_is_capped() {
        let mut text = String::from_utf8(encode(&sample())).unwrap();
        for i in 0..MAX_FUNCTIONS {
            text.push_str(&format!("fn {i} 0000000000000000 1 f{i}\n"));
        }
        assert_eq!(decode(text.as_bytes()), Err(RecordError::TooManyFunctions));
    }
}
