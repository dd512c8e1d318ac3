//! The cost model that chooses between the small- and the large-message algorithms when a
//! [`Tuning`](super::Tuning) has measured [`Costs`].
//!
//! One message of `n` bytes between two ranks costs `α + β·n` (Hockney's model): `α` the
//! per-message cost (latency, the runtime's per-message work), `β` the cost of a byte (moving
//! it, copying it, reducing it). `shardcx bench --test allreduce` measures both on the machine
//! (an all-reduce of two ranks is one exchange of `n` bytes) and writes them with
//! `--save-costs FILE`; [`Costs::load`] reads that file. With `p` ranks, `L = ⌈log2 p⌉` and `n`
//! bytes per rank:
//!
//! | operation | small-message algorithm | large-message algorithm |
//! | --- | --- | --- |
//! | all-reduce | recursive doubling: `(⌊log2 p⌋ + f)(α + nβ)`, `f` = 2 when `p` is not a power of two (the fold in and out), else 0 | ring: `2(p−1)(α + nβ/p)` |
//! | broadcast | binomial tree: `L(α + nβ)` | scatter + ring all-gather: `(L + p − 1)α + 2nβ(p−1)/p` |
//! | reduce | binomial tree: `L(α + nβ)` | ring reduce-scatter + gather: `(p − 1 + L)α + 2nβ(p−1)/p` |
//! | reduce-scatter (`n`: the whole input) | reduce + scatter: `L(α + nβ) + Lα + nβ(p−1)/p` | ring: `(p−1)(α + nβ/p)` |
//! | all-reduce over `m` nodes of `k` ranks | through the leaders: `2⌈log2 k⌉(α + nβ) + A(m, n)`; or flat, `A(mk, n)`, when every node has the same power of two of ranks in rank order | by slices: `2(k−1)(α + nβ/k) + A(m, n/k)` |
//!
//! (`A(m, n)`: the cheaper flat all-reduce of `m` ranks.) The large-message algorithm is taken
//! when it costs less. The model has no term for local copies, so it never prefers the ring
//! to Bruck's all-gather (the same bytes in more messages): all-gather keeps
//! [`Tuning::large_from`](super::Tuning::large_from) for that choice. Every rank of a
//! communicator must use the same costs (the same file), as with any [`Tuning`](super::Tuning).

use std::path::Path;
use std::time::Duration;

/// Measured per-message and per-byte costs (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Costs {
    /// `α`, picoseconds.
    alpha_ps: u64,
    /// `β`, femtoseconds per byte.
    beta_fs: u64,
}

/// Why [`Costs::new`], [`Costs::parse`] or [`Costs::load`] refused.
#[derive(Debug, thiserror::Error)]
pub enum CostsError {
    /// `α` or `β` negative, not finite, or too large.
    #[error(
        "{what} = {value}: a cost must be finite, at least 0, and at most 1 s (alpha_us) or 1 ms \
         (beta_ns_per_byte)"
    )]
    OutOfRange {
        /// `alpha_us` or `beta_ns_per_byte`.
        what: &'static str,
        /// The value given.
        value: f64,
    },
    /// The text is not a costs file.
    #[error("not a costs file: {0}")]
    Format(String),
    /// The file could not be read.
    #[error("{path}: {err}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        err: std::io::Error,
    },
}

/// The operations whose algorithm the cost model chooses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shape {
    AllReduce,
    Broadcast,
    Reduce,
    ReduceScatter,
    /// All-reduce over `nodes` nodes of `k` ranks each: by slices (large) or else through the
    /// leaders, or flat over all of them when `otherwise_flat` (recursive doubling pairs a
    /// node's ranks first when every node has the same power of two of them, in rank order).
    AllReduceOverNodes {
        k: usize,
        otherwise_flat: bool,
    },
}

impl Costs {
    /// `α` in microseconds per message, `β` in nanoseconds per byte; each finite and at least
    /// 0, `α` at most a second and `β` at most a millisecond a byte.
    pub fn new(alpha_us: f64, beta_ns_per_byte: f64) -> Result<Costs, CostsError> {
        let check = |what, value: f64, scale: f64| {
            if value.is_finite() && (0.0..=1e12).contains(&(value * scale)) {
                Ok((value * scale).round() as u64)
            } else {
                Err(CostsError::OutOfRange { what, value })
            }
        };
        Ok(Costs {
            alpha_ps: check("alpha_us", alpha_us, 1e6)?,
            beta_fs: check("beta_ns_per_byte", beta_ns_per_byte, 1e6)?,
        })
    }

    /// `α`, the cost of one message.
    pub fn alpha(self) -> Duration {
        Duration::from_nanos(self.alpha_ps / 1000)
    }

    /// `α` in microseconds.
    pub fn alpha_us(self) -> f64 {
        self.alpha_ps as f64 / 1e6
    }

    /// `β` in nanoseconds per byte.
    pub fn beta_ns_per_byte(self) -> f64 {
        self.beta_fs as f64 / 1e6
    }

    /// The text [`Costs::parse`] reads: a JSON object with `alpha_us` and `beta_ns_per_byte`,
    /// and `note` (what measured them; ignored when read).
    pub fn to_json(self, note: &str) -> String {
        serde_json::json!({
            "alpha_us": self.alpha_us(),
            "beta_ns_per_byte": self.beta_ns_per_byte(),
            "note": note,
        })
        .to_string()
    }

    /// Costs from the text [`Costs::to_json`] writes.
    pub fn parse(text: &str) -> Result<Costs, CostsError> {
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| CostsError::Format(e.to_string()))?;
        let num = |key: &str| {
            v.get(key)
                .and_then(serde_json::Value::as_f64)
                .ok_or_else(|| CostsError::Format(format!("no number \"{key}\"")))
        };
        Costs::new(num("alpha_us")?, num("beta_ns_per_byte")?)
    }

    /// Costs from a file [`Costs::to_json`] wrote (`shardcx bench --test allreduce
    /// --save-costs FILE`).
    pub fn load(path: impl AsRef<Path>) -> Result<Costs, CostsError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|err| CostsError::Io {
            path: path.display().to_string(),
            err,
        })?;
        Costs::parse(&text)
    }

    /// One message of `bytes`, nanoseconds.
    fn msg(self, bytes: f64) -> f64 {
        self.alpha_ps as f64 / 1e3 + self.beta_fs as f64 / 1e6 * bytes
    }

    /// The model's cost of `shape` on `p` ranks and `bytes` (see the module docs), ns:
    /// (small-message algorithm, large-message algorithm).
    pub(crate) fn estimate(self, shape: Shape, p: usize, bytes: usize) -> (f64, f64) {
        let (pf, n) = (p.max(1) as f64, bytes as f64);
        let (a, b) = (self.msg(0.0), self.msg(1.0) - self.msg(0.0));
        let l = f64::from(p.max(1).next_power_of_two().trailing_zeros());
        match shape {
            Shape::AllReduce => {
                let rounds =
                    f64::from(p.max(1).ilog2()) + if p.is_power_of_two() { 0.0 } else { 2.0 };
                (rounds * self.msg(n), 2.0 * (pf - 1.0) * self.msg(n / pf))
            }
            Shape::Broadcast => (
                l * self.msg(n),
                (l + pf - 1.0) * a + 2.0 * n * b * (pf - 1.0) / pf,
            ),
            Shape::Reduce => (
                l * self.msg(n),
                (pf - 1.0 + l) * a + 2.0 * n * b * (pf - 1.0) / pf,
            ),
            Shape::ReduceScatter => (
                l * self.msg(n) + l * a + n * b * (pf - 1.0) / pf,
                (pf - 1.0) * self.msg(n / pf),
            ),
            Shape::AllReduceOverNodes { k, otherwise_flat } => {
                let k = k.max(1);
                let (kf, m) = (k as f64, p.max(1));
                let lk = f64::from(k.next_power_of_two().trailing_zeros());
                let flat = |ranks: usize, bytes: f64| {
                    let (s, l) = self.estimate(Shape::AllReduce, ranks, bytes as usize);
                    s.min(l)
                };
                let otherwise = if otherwise_flat {
                    flat(m * k, n)
                } else {
                    2.0 * lk * self.msg(n) + flat(m, n)
                };
                (
                    otherwise,
                    2.0 * (kf - 1.0) * self.msg(n / kf) + flat(m, n / kf),
                )
            }
        }
    }

    /// Whether the large-message algorithm of `shape` costs less on `p` ranks (for
    /// [`Shape::AllReduceOverNodes`], `p` is the number of nodes) and `bytes`.
    pub(crate) fn prefers_large(self, shape: Shape, p: usize, bytes: usize) -> bool {
        let (small, large) = self.estimate(shape, p, bytes);
        large < small
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;

    /// The smallest size in `0..limit` at which `shape` takes the large algorithm.
    fn crossover(c: Costs, shape: Shape, p: usize, limit: usize) -> Option<usize> {
        let (mut lo, mut hi) = (0, limit);
        if !c.prefers_large(shape, p, hi) {
            return None;
        }
        while lo < hi {
            let mid = (lo + hi) / 2;
            if c.prefers_large(shape, p, mid) {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        Some(lo)
    }

    #[test]
    fn the_all_reduce_crossover_is_where_the_closed_form_puts_it() {
        // α = 2 µs, β = 0.25 ns/B: at p = 4 the ring wins once 2n·β·(2 − 3/2) > 4α, n > 8α/β.
        let c = Costs::new(2.0, 0.25).unwrap();
        let at = crossover(c, Shape::AllReduce, 4, 1 << 30).unwrap();
        let want = 8.0 * 2000.0 / 0.25;
        assert!((at as f64 - want).abs() <= 1.0, "{at} vs {want}");
        // Two ranks: recursive doubling is one exchange, never worse than the ring's two.
        assert_eq!(crossover(c, Shape::AllReduce, 2, 1 << 30), None);
        // No per-message cost: the ring's fewer bytes win from the first byte on 8 ranks.
        let free = Costs::new(0.0, 1.0).unwrap();
        assert_eq!(crossover(free, Shape::AllReduce, 8, 1 << 30), Some(1));
        // No per-byte cost: fewer messages always win.
        let latency = Costs::new(5.0, 0.0).unwrap();
        for shape in [
            Shape::AllReduce,
            Shape::Broadcast,
            Shape::Reduce,
            Shape::ReduceScatter,
        ] {
            assert_eq!(crossover(latency, shape, 8, 1 << 30), None, "{shape:?}");
        }
    }

    #[test]
    fn larger_per_message_costs_move_every_crossover_up() {
        let (cheap, dear) = (Costs::new(1.0, 0.5).unwrap(), Costs::new(4.0, 0.5).unwrap());
        for shape in [
            Shape::AllReduce,
            Shape::Broadcast,
            Shape::Reduce,
            Shape::ReduceScatter,
        ] {
            for p in [3, 4, 7, 16] {
                if shape == Shape::ReduceScatter && p < 16 {
                    // The ring takes no more rounds than reduce + scatter (p − 1 ≤ 2⌈log2 p⌉)
                    // and moves fewer bytes: it wins from the first byte.
                    for c in [cheap, dear] {
                        let at = crossover(c, shape, p, 1 << 34);
                        assert!(matches!(at, Some(0 | 1)), "p {p}: {at:?}");
                    }
                    continue;
                }
                let a = crossover(cheap, shape, p, 1 << 34).unwrap();
                let b = crossover(dear, shape, p, 1 << 34).unwrap();
                assert!(b > a, "{shape:?} p {p}: {a} then {b}");
            }
        }
    }

    #[test]
    fn slices_pay_off_for_large_vectors_over_nodes() {
        let c = Costs::new(2.0, 0.5).unwrap();
        for otherwise_flat in [false, true] {
            let shape = Shape::AllReduceOverNodes {
                k: 4,
                otherwise_flat,
            };
            assert!(!c.prefers_large(shape, 2, 8));
            assert!(c.prefers_large(shape, 2, 16 << 20));
            // One rank per node: nothing to slice, never cheaper.
            let one = Shape::AllReduceOverNodes {
                k: 1,
                otherwise_flat,
            };
            assert!(!c.prefers_large(one, 4, 16 << 20));
        }
        // Two nodes of two: flat recursive doubling, 2(α + nβ), against slices, 3α + 1.5nβ:
        // slices from n > 2α/β on, not from the first bytes as against the leaders.
        let two = Shape::AllReduceOverNodes {
            k: 2,
            otherwise_flat: true,
        };
        let at = crossover(c, two, 2, 1 << 30).unwrap();
        assert!((at as f64 - 2.0 * 2000.0 / 0.5).abs() <= 1.0, "{at}");
    }

    #[test]
    fn costs_go_through_their_text_and_refuse_nonsense() {
        let c = Costs::new(2.75, 0.92).unwrap();
        let back = Costs::parse(&c.to_json("2 ranks, shm")).unwrap();
        assert_eq!(back, c);
        assert_eq!(c.alpha(), Duration::from_nanos(2750));
        assert!((c.beta_ns_per_byte() - 0.92).abs() < 1e-9);
        for (a, b) in [
            (-1.0, 1.0),
            (1.0, f64::NAN),
            (f64::INFINITY, 0.0),
            (2e6, 0.0),
        ] {
            assert!(
                matches!(Costs::new(a, b), Err(CostsError::OutOfRange { .. })),
                "{a} {b}"
            );
        }
        for text in [
            "",
            "{}",
            "{\"alpha_us\": 1}",
            "[1, 2]",
            "{\"alpha_us\": \"1\", \"beta_ns_per_byte\": 1}",
        ] {
            assert!(
                matches!(Costs::parse(text), Err(CostsError::Format(_))),
                "{text}"
            );
        }
        let missing = Costs::load("/nonexistent/costs.json").unwrap_err();
        assert!(matches!(missing, CostsError::Io { .. }), "{missing}");
        assert!(missing.to_string().contains("/nonexistent/costs.json"));
    }
}
