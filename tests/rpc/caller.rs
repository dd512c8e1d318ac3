//! Calls answered into a handler ([`shardcx::rpc::Caller`]): replies, errors, deadlines,
//! cancellation and a panicking handler, on both client shards (each on its own rail).

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use shardcx::rpc::RpcError;
use shardcx::{Node, Peer};

use super::{
    pair, serial, server, wait_for, AwaitCancel, Echo, Nap, Nobody, Refuse, Sum, CANCELS_SEEN,
};

/// Calls in all per shard, and how many are in flight at once.
const CALLS: u64 = 1000;
const IN_FLIGHT: u64 = 8;

#[test]
fn calls_answered_into_a_handler_slide_a_window_and_report_typed_errors() {
    let _g = serial();
    let (out, stats) = pair(server(), false, |node: Node, peer: Peer| async move {
        let rpc = node.rpc();
        // A sliding window driven from the handler: each reply makes the next call.
        let got: Rc<RefCell<Vec<(u64, u64)>>> = Rc::default();
        let g = got.clone();
        let sums = rpc
            .caller::<Sum>(peer, move |caller, token, reply| {
                let sum = reply.expect("a sum").get().to_native();
                g.borrow_mut().push((token, sum));
                let next = token + IN_FLIGHT;
                if next < CALLS {
                    caller.call(&vec![next, 1, 2], next).expect("next call");
                }
            })
            .await
            .expect("caller");
        for t in 0..IN_FLIGHT {
            sums.call(&vec![t, 1, 2], t).expect("call");
        }
        wait_for("every reply", Duration::from_secs(20), || {
            got.borrow().len() as u64 == CALLS
        })
        .await;
        let mut seen = got.borrow().clone();
        seen.sort_unstable();
        for (i, (token, sum)) in seen.iter().enumerate() {
            assert_eq!((*token, *sum), (i as u64, i as u64 + 3));
        }

        // Errors come typed to the handler.
        let errors: Rc<RefCell<Vec<String>>> = Rc::default();
        let e = errors.clone();
        let refuse = rpc
            .caller::<Refuse>(peer, move |_, _, r| {
                e.borrow_mut().push(format!("{:?}", r.unwrap_err()))
            })
            .await
            .unwrap();
        refuse.call(&(), 0).unwrap();
        let e = errors.clone();
        let nobody = rpc
            .caller::<Nobody>(peer, move |_, _, r| {
                assert!(matches!(r, Err(RpcError::UnknownFunction { .. })), "{r:?}");
                e.borrow_mut().push("unknown".into());
            })
            .await
            .unwrap();
        nobody.call(&(), 0).unwrap();
        wait_for("both errors", Duration::from_secs(10), || {
            errors.borrow().len() == 2
        })
        .await;
        assert!(
            errors.borrow().iter().any(|e| e.contains("no thanks")),
            "{:?}",
            errors.borrow()
        );

        // A deadline: the server's expiry or the caller's own, within bounds.
        let late: Rc<RefCell<Option<(RpcError, Duration)>>> = Rc::default();
        let (l, t0) = (late.clone(), Instant::now());
        let nap = rpc
            .caller_within::<Nap>(peer, Duration::from_millis(150), move |_, _, r| {
                *l.borrow_mut() = Some((r.unwrap_err(), t0.elapsed()));
            })
            .await
            .unwrap();
        nap.call(&3_000, 0).unwrap();
        wait_for("the deadline", Duration::from_secs(5), || {
            late.borrow().is_some()
        })
        .await;
        let (e, took) = late.borrow_mut().take().unwrap();
        assert!(
            matches!(e, RpcError::DeadlineExpired | RpcError::TimedOut { .. }),
            "{e:?}"
        );
        assert!(took < Duration::from_millis(1_000), "{took:?}");

        // A cancelled call: its handler is never called, the server sees the cancel.
        let called: Rc<RefCell<u32>> = Rc::default();
        let c = called.clone();
        let waits = rpc
            .caller::<AwaitCancel>(peer, move |_, _, _| *c.borrow_mut() += 1)
            .await
            .unwrap();
        let h = waits.call(&(), 7).unwrap();
        glommio::timer::sleep(Duration::from_millis(50)).await;
        assert!(waits.cancel(h), "pending until cancelled");
        assert!(!waits.cancel(h), "cancelled once");
        wait_for("the server's cancel", Duration::from_secs(5), || {
            CANCELS_SEEN.load(Ordering::SeqCst) >= 2
        })
        .await;
        glommio::timer::sleep(Duration::from_millis(50)).await;
        assert_eq!(*called.borrow(), 0);

        // A handler that panics loses that answer only, counted; the next call is answered.
        let echoed: Rc<RefCell<Vec<String>>> = Rc::default();
        let e = echoed.clone();
        let echo = rpc
            .caller::<Echo>(peer, move |_, token, r| {
                assert!(token != 0, "the handler panics on token 0");
                e.borrow_mut().push(r.unwrap().get().as_str().to_owned());
            })
            .await
            .unwrap();
        let panics = node.shard_ctx().net_stats().handler_panics;
        echo.call(&"lost".to_owned(), 0).unwrap();
        echo.call(&"kept".to_owned(), 1).unwrap();
        wait_for("the second echo", Duration::from_secs(5), || {
            !echoed.borrow().is_empty()
        })
        .await;
        assert_eq!(*echoed.borrow(), ["kept"]);
        assert_eq!(node.shard_ctx().net_stats().handler_panics, panics + 1);
        seen.len() as u64
    });
    assert_eq!(out, [CALLS, CALLS]);
    // Per shard: the sums, one refused, one nap, one cancelled wait, two echoes.
    assert!(stats.served >= 2 * CALLS, "{stats:?}");
}
