//! A shard's extension slot on running shards: values inserted from `on_start` are found by
//! the user future of their own shard only, types are told apart, and every value is dropped
//! at the shard's end, newest first, on the shard's own thread (also a value that holds the
//! shard's context, which a thread-local would have leaked until the thread ended).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // A test may panic: a panic is a failure it reports.

use std::rc::Rc;
use std::sync::{Arc, Mutex};

use shardcx_shards::{Placement, ShardCtx, ShardsBuilder};

/// What was dropped, where: (shard, value, thread name).
type Log = Arc<Mutex<Vec<(usize, &'static str, String)>>>;

/// Records its drop in the log.
struct Noted {
    shard: usize,
    what: &'static str,
    log: Log,
}

/// A first subsystem's state.
struct Counters(Noted);
/// A second subsystem's state, holding the shard's context (a cycle through the slot).
struct HoldsCtx {
    ctx: Rc<ShardCtx>,
    noted: Noted,
}

impl Drop for Noted {
    fn drop(&mut self) {
        let thread = std::thread::current().name().unwrap_or("").to_owned();
        self.log
            .lock()
            .unwrap()
            .push((self.shard, self.what, thread));
    }
}

impl Drop for HoldsCtx {
    fn drop(&mut self) {
        // Torn down: the slot keeps nothing any more, the worker is still there.
        assert!(self.ctx.ext::<Counters>().is_none());
        let _ = self.ctx.worker();
        self.noted.what = if self.ctx.ext::<HoldsCtx>().is_none() {
            "holds-ctx"
        } else {
            "holds-ctx (slot still open)"
        };
    }
}

#[test]
fn extension_slot_per_shard_and_dropped_at_shard_end() {
    let log: Log = Arc::default();
    let hook_log = log.clone();
    let out = ShardsBuilder::new()
        .shard_count(2)
        .placement(Placement::Unpinned)
        .transports("sm,self")
        .io_memory(1 << 20)
        .on_start(move |ctx| {
            let shard = ctx.id().index();
            let noted = |what| Noted {
                shard,
                what,
                log: hook_log.clone(),
            };
            ctx.ext_or_insert_with(|| Counters(noted("counters")));
            ctx.ext_or_insert_with(|| HoldsCtx {
                ctx: ctx.clone(),
                noted: noted("holds-ctx"),
            });
        })
        .run(|ctx: Rc<ShardCtx>| async move {
            let shard = ctx.id().index();
            let counters = ctx.ext::<Counters>().expect("inserted by on_start");
            assert_eq!(counters.0.shard, shard, "each shard finds its own value");
            let holds = ctx.ext::<HoldsCtx>().expect("inserted by on_start");
            assert!(Rc::ptr_eq(&holds.ctx, &ctx));
            // One value per type: a second insert returns the first.
            let again = ctx.ext_or_insert_with(|| -> Counters { panic!("made twice") });
            assert!(Rc::ptr_eq(&again, &counters));
            // A type nobody inserted.
            assert!(ctx.ext::<String>().is_none());
            shard
        })
        .unwrap();
    assert_eq!(out, [0, 1]);
    let log = log.lock().unwrap();
    for shard in 0..2 {
        let dropped: Vec<_> = log.iter().filter(|(s, ..)| *s == shard).collect();
        let order: Vec<&str> = dropped.iter().map(|(_, what, _)| *what).collect();
        assert_eq!(
            order,
            ["holds-ctx", "counters"],
            "shard {shard}: newest first"
        );
        for (_, what, thread) in dropped {
            // Each shard's executor runs on the thread `shardcx-{shard}`.
            assert_eq!(
                thread,
                &format!("shardcx-{shard}"),
                "{what} dropped on thread {thread:?}, not shard {shard}'s"
            );
        }
    }
}
