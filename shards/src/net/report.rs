//! Warnings for what otherwise only reaches a counter (dropped frames, handler panics, declined
//! rendezvous data), rate-limited: a shard looks at its [`NetStats`] every [`REPORT_EVERY`]
//! and logs one `warn` event with what changed since its last look, so that a flood of bad
//! frames costs one line a second, and the hot path nothing (the counters are there anyway).
//! Only when a `tracing` subscriber is installed when the shard starts.

use std::rc::Rc;
use std::time::Duration;

use super::NetStats;
use crate::boot::ShardCtx;

/// How often a shard compares its counters with its last look.
pub(crate) const REPORT_EVERY: Duration = Duration::from_secs(1);

/// The counters reported, with their names in the log line.
fn problems(s: &NetStats) -> Vec<(&'static str, u64)> {
    let mut all = s.dropped_by_reason().to_vec();
    all.extend([
        ("declined", s.declined),
        ("handler_panics", s.handler_panics),
        ("dispatch_budget_hits", s.dispatch_budget_hits),
        ("dispatch_preempted", s.dispatch_preempted),
        ("bootstraps_refused", s.bootstraps_refused),
        ("bootstraps_timed_out", s.bootstraps_timed_out),
        ("bootstraps_over_cap", s.bootstraps_over_cap),
        ("openings_over_cap", s.openings_over_cap),
        ("pending_refused", s.pending_refused),
        ("pending_expired", s.pending_expired),
    ]);
    all
}

/// What grew from `before` to `now`, as `name=count` pairs; empty when nothing did.
pub(crate) fn grown(before: &NetStats, now: &NetStats) -> String {
    problems(before)
        .iter()
        .zip(problems(now).iter())
        .filter(|((_, a), (_, b))| b > a)
        .map(|((name, a), (_, b))| format!("{name}={}", b - a))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Starts shard `ctx`'s reporter (a task of its net, cancelled at shutdown), if a `tracing`
/// subscriber is installed.
pub(crate) fn spawn(ctx: &Rc<ShardCtx>) {
    if !tracing::dispatcher::has_been_set() {
        return;
    }
    let weak = Rc::downgrade(ctx);
    let task = glommio::spawn_local(async move {
        let mut last = NetStats::default();
        loop {
            glommio::timer::sleep(REPORT_EVERY).await;
            let Some(ctx) = weak.upgrade() else { return };
            let now = ctx.net_stats();
            let grown = grown(&last, &now);
            if !grown.is_empty() {
                tracing::warn!(
                    counts = %grown,
                    "frames dropped or refused in the last {REPORT_EVERY:?} (see the metrics \
                     for totals)"
                );
            }
            last = now;
        }
    });
    ctx.net().tasks.borrow_mut().push(task);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_what_grew_is_reported() {
        let before = NetStats {
            dropped_malformed: 3,
            ..NetStats::default()
        };
        let now = NetStats {
            dropped_malformed: 23,
            dropped_unauthenticated: 2,
            delivered: 1000,
            ..NetStats::default()
        };
        assert_eq!(grown(&before, &now), "unauthenticated=2 malformed=20");
        assert_eq!(grown(&now, &now), "");
    }
}
