//! Round-trip times of the calls a shard makes, per function, for the metrics
//! (`shardcx_rpc_call_seconds`): a fixed-bucket histogram each, kept on the calling shard.

use std::cell::RefCell;
use std::time::Duration;

/// Upper bounds of the buckets, in seconds (5 µs to 10 s; slower calls land in `+Inf`).
pub(crate) const BOUNDS: [f64; 20] = [
    5e-6, 10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// One function's histogram.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Latency {
    /// The function's id.
    pub(crate) id: u32,
    /// Its name where the caller knew it (a marker type or a signature), else empty.
    pub(crate) name: String,
    /// Calls per bucket (not cumulative); the last is `+Inf`.
    pub(crate) buckets: [u64; BOUNDS.len() + 1],
    /// Sum of the round trips, in seconds.
    pub(crate) sum: f64,
    /// Calls recorded.
    pub(crate) count: u64,
}

impl Latency {
    /// The buckets as `prometheus-client` takes them: `(upper bound, calls in that bucket)`,
    /// `+Inf` last (the encoder makes them cumulative).
    pub(crate) fn by_bound(&self) -> Vec<(f64, u64)> {
        BOUNDS
            .iter()
            .copied()
            .chain(std::iter::once(f64::INFINITY))
            .zip(self.buckets)
            .collect()
    }
}

/// A shard's histograms, by function (a handful: a linear scan).
#[derive(Debug, Default)]
pub(crate) struct Latencies(RefCell<Vec<Latency>>);

impl Latencies {
    /// Records a call of function `id` (`name`) that took `rtt`.
    pub(crate) fn record(&self, id: u32, name: &str, rtt: Duration) {
        let mut all = self.0.borrow_mut();
        let at = match all.iter().position(|l| l.id == id) {
            Some(at) => at,
            None => {
                all.push(Latency {
                    id,
                    name: name.to_owned(),
                    buckets: [0; BOUNDS.len() + 1],
                    sum: 0.0,
                    count: 0,
                });
                all.len() - 1
            }
        };
        let l = &mut all[at];
        if l.name.is_empty() && !name.is_empty() {
            name.clone_into(&mut l.name);
        }
        let secs = rtt.as_secs_f64();
        l.buckets[BOUNDS.partition_point(|b| *b < secs)] += 1;
        l.sum += secs;
        l.count += 1;
    }

    /// A copy of every histogram.
    pub(crate) fn snapshot(&self) -> Vec<Latency> {
        self.0.borrow().clone()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;

    #[test]
    fn calls_land_in_their_bucket() {
        let l = Latencies::default();
        l.record(7, "kv.get", Duration::from_micros(3));
        l.record(7, "kv.get", Duration::from_micros(5)); // On a bound: that bucket (le).
        l.record(7, "kv.get", Duration::from_millis(2));
        l.record(7, "kv.get", Duration::from_secs(60));
        l.record(9, "", Duration::from_micros(40));
        let s = l.snapshot();
        assert_eq!(s.len(), 2);
        let get = &s[0];
        assert_eq!((get.id, get.name.as_str(), get.count), (7, "kv.get", 4));
        assert!((get.sum - 60.002_008).abs() < 1e-9, "{}", get.sum);
        let c = get.by_bound();
        assert_eq!(c.len(), BOUNDS.len() + 1);
        assert_eq!(c[0], (5e-6, 2));
        assert_eq!(c.iter().find(|(b, _)| *b == 2.5e-3).unwrap().1, 1);
        assert_eq!(c.iter().map(|(_, n)| n).sum::<u64>(), 4);
        assert_eq!(c[BOUNDS.len()], (f64::INFINITY, 1));
        assert_eq!(s[1].name, "");
        // A later call that knows the name fills it in.
        l.record(9, "kv.scan", Duration::from_micros(40));
        assert_eq!(l.snapshot()[1].name, "kv.scan");
    }
}
