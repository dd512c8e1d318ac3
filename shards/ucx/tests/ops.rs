//! Tier 2: two workers in one process, over shared memory and over TCP on loopback.

mod common;

use std::cell::RefCell;
use std::collections::VecDeque;
use std::future::poll_fn;
use std::rc::Rc;
use std::task::Poll;

use common::{pair, pattern, transports, Pair};
use shardcx_ucx::{
    AlignedBuf, AmIncoming, AmPayload, AmProto, Error, MemHandle, RemoteKey, Worker,
};

type Inbox = Rc<RefCell<VecDeque<(Vec<u8>, AmPayload)>>>;

fn inbox(worker: &Worker, id: u16) -> Inbox {
    let q: Inbox = Rc::default();
    let q2 = q.clone();
    worker
        .set_am_handler(id, move |hdr, payload| {
            q2.borrow_mut().push_back((hdr.to_vec(), payload))
        })
        .expect("handler");
    q
}

/// Wait for the next message in `q`, pulling rendezvous data into a fresh buffer.
async fn next_message(worker: &Worker, q: &Inbox) -> (Vec<u8>, Vec<u8>, bool) {
    let (hdr, payload) = poll_fn(|cx| match q.borrow_mut().pop_front() {
        Some(m) => Poll::Ready(m),
        None => {
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    })
    .await;
    match payload {
        AmPayload::Data(d) => (hdr, d.into_vec(), false),
        AmPayload::Rendezvous(r) => {
            let len = r.len();
            let (res, buf) = worker.am_recv_data(r, vec![0u8; len]).await;
            assert_eq!(res.expect("rndv receive"), len);
            (hdr, buf, true)
        }
    }
}

fn am_round_trip(p: &Pair, size: usize, proto: AmProto) -> bool {
    let qa = inbox(&p.a, 7);
    let qb = inbox(&p.b, 7);
    let payload = pattern(size, 3);
    let header = (size as u64).to_le_bytes();
    p.run(async {
        // A rendezvous send completes only once the receiver has pulled the data: run both.
        let send = p.ab.am_send(7, &header, payload.clone(), proto);
        let ((res, sent), (hdr, data, rndv_b)) = join(send, next_message(&p.b, &qb)).await;
        res.expect("send a->b");
        assert_eq!(sent, payload, "buffer handed back intact");
        assert_eq!(hdr, header);
        assert_eq!(data.len(), size);
        assert!(data == payload, "content a->b, {size} bytes");
        let send = p.ba.am_send(7, &hdr, data, proto);
        let ((res, _), (hdr, data, _)) = join(send, next_message(&p.a, &qa)).await;
        res.expect("send b->a");
        assert_eq!(hdr, header);
        assert!(data == payload, "content b->a, {size} bytes");
        rndv_b
    })
}

const SIZES: &[usize] = &[0, 1, 8, 4096, 64 << 10, 1 << 20, 16 << 20];

#[test]
fn am_round_trips_all_sizes() {
    for tls in transports() {
        let p = pair(tls);
        for &size in SIZES {
            am_round_trip(&p, size, AmProto::Auto);
        }
    }
}

#[test]
fn am_forced_rendezvous_lands_in_handler_chosen_buffer() {
    for tls in transports() {
        let p = pair(tls);
        for &size in &[1usize, 4096, 1 << 20] {
            let rndv = am_round_trip(&p, size, AmProto::Rendezvous);
            assert!(
                rndv,
                "{tls}: {size} B with forced rendezvous must arrive as rendezvous"
            );
        }
        // Forced eager arrives as data, never rendezvous.
        assert!(!am_round_trip(&p, 4096, AmProto::Eager));
    }
}

#[test]
fn am_rendezvous_into_aligned_buffer_and_iov_send() {
    for tls in transports() {
        let p = pair(tls);
        let q = inbox(&p.b, 9);
        let parts = vec![pattern(1000, 1), pattern(5000, 2), pattern(70_000, 3)];
        let whole: Vec<u8> = parts.concat();
        p.run(async {
            let send =
                p.ab.am_send_iov(9, b"iov", parts.clone(), AmProto::Rendezvous);
            let recv = async {
                let (hdr, payload) = poll_fn(|cx| match q.borrow_mut().pop_front() {
                    Some(m) => Poll::Ready(m),
                    None => {
                        cx.waker().wake_by_ref();
                        Poll::Pending
                    }
                })
                .await;
                assert_eq!(hdr, b"iov");
                let AmPayload::Rendezvous(r) = payload else {
                    panic!("expected rendezvous")
                };
                let buf = AlignedBuf::zeroed(r.len(), 4096).expect("aligned");
                let (res, buf) = p.b.am_recv_data(r, buf).await;
                assert_eq!(res.expect("pull"), whole.len());
                assert!(buf.as_slice() == &whole[..]);
            };
            let ((res, back), ()) = join(send, recv).await;
            res.expect("iov send");
            assert_eq!(back, parts);
        });
    }
}

#[test]
fn am_rendezvous_into_too_small_buffer_is_refused_and_sender_completes() {
    let p = pair("tcp");
    let q = inbox(&p.b, 3);
    p.run(async {
        let send =
            p.ab.am_send(3, b"", pattern(100_000, 1), AmProto::Rendezvous);
        let recv = async {
            let (_, payload) = poll_fn(|cx| match q.borrow_mut().pop_front() {
                Some(m) => Poll::Ready(m),
                None => {
                    cx.waker().wake_by_ref();
                    Poll::Pending
                }
            })
            .await;
            let AmPayload::Rendezvous(r) = payload else {
                panic!("expected rendezvous")
            };
            let (res, _) = p.b.am_recv_data(r, vec![0u8; 10]).await;
            assert_eq!(res, Err(Error::MessageTruncated));
        };
        let ((res, _), ()) = join(send, recv).await;
        // Declining the data completes the sender's operation.
        res.expect("sender completes after the receiver declines");
    });
}

#[test]
fn handler_dropping_data_inside_the_callback_is_fine() {
    for tls in transports() {
        let p = pair(tls);
        let seen = Rc::new(RefCell::new(Vec::new()));
        let s2 = seen.clone();
        p.b.set_am_handler(5, move |_h, payload| {
            let n = match &payload {
                AmPayload::Data(d) => d.len(),
                AmPayload::Rendezvous(r) => r.len(),
            };
            s2.borrow_mut().push(n);
            drop(payload);
        })
        .expect("handler");
        p.run(async {
            // Dropping rendezvous data in the handler declines it, which completes the send.
            for &size in &[8usize, 64 << 10, 1 << 20] {
                let (res, _) = p.ab.am_send(5, b"x", pattern(size, 0), AmProto::Auto).await;
                res.expect("send");
            }
            poll_fn(|cx| {
                if seen.borrow().len() == 3 {
                    Poll::Ready(())
                } else {
                    cx.waker().wake_by_ref();
                    Poll::Pending
                }
            })
            .await;
        });
        assert_eq!(*seen.borrow(), vec![8, 64 << 10, 1 << 20]);
    }
}

#[test]
fn tag_matching_with_masks_and_early_arrivals() {
    for tls in transports() {
        let p = pair(tls);
        p.run(async {
            // Sent before any receive is posted: matched from the unexpected queue.
            for i in 0..4u64 {
                let (res, _) =
                    p.ab.tag_send(0xAB00 | i, pattern(100 + i as usize, i as u8))
                        .await;
                res.expect("early send");
            }
            p.b.flush().await.expect("flush");
            // Exact match picks the right one regardless of order.
            let (res, buf) = p.b.tag_recv(0xAB02, u64::MAX, vec![0u8; 4096]).await;
            let info = res.expect("exact");
            assert_eq!(info.sender_tag, 0xAB02);
            assert_eq!(&buf[..info.len], &pattern(102, 2)[..]);
            // Masked match: any tag 0xAB??, in send order.
            let mut got = Vec::new();
            for _ in 0..3 {
                let (res, buf) = p.b.tag_recv(0xAB00, 0xFF00, vec![0u8; 4096]).await;
                let info = res.expect("masked");
                let i = info.sender_tag & 0xFF;
                assert_eq!(&buf[..info.len], &pattern(100 + i as usize, i as u8)[..]);
                got.push(i);
            }
            assert_eq!(got, vec![0, 1, 3]);
            // Posted before the send: completes when it arrives, large enough for rendezvous.
            let recv = p.b.tag_recv(0x5000_0000, 0xF000_0000, vec![0u8; 1 << 20]);
            let send = p.ab.tag_send(0x5123_4567, pattern(1 << 20, 9));
            let ((rres, rbuf), (sres, _)) = join(recv, send).await;
            sres.expect("send");
            let info = rres.expect("recv");
            assert_eq!(info.sender_tag, 0x5123_4567);
            assert!(rbuf == pattern(1 << 20, 9));
            // A message larger than the buffer is truncated: a typed error.
            let recv = p.b.tag_recv(77, u64::MAX, vec![0u8; 16]);
            let send = p.ab.tag_send(77, pattern(64, 1));
            let ((rres, _), (sres, _)) = join(recv, send).await;
            let _ = sres;
            assert_eq!(rres, Err(Error::MessageTruncated));
        });
    }
}

#[test]
fn put_get_and_flush_including_zero_length() {
    for tls in transports() {
        let p = pair(tls);
        // The region is mapped on b's context; a writes and reads it through the rkey.
        let region = MemHandle::allocate(&p.b_context, 1 << 20).expect("alloc");
        region.write_at(0, &vec![0xEE; 1 << 20]).expect("fill");
        let rkey = RemoteKey::unpack(&p.ab, &region.pack_rkey().expect("pack")).expect("unpack");
        let base = region.address();
        p.run(async {
            let data = pattern(300_000, 4);
            let (res, back) = p.ab.put(data.clone(), base + 1000, &rkey).await;
            res.expect("put");
            assert_eq!(back, data);
            p.ab.flush().await.expect("flush");
            let mut check = vec![0u8; 300_000];
            region.read_at(1000, &mut check).expect("read");
            assert!(check == data, "put landed");
            let mut before = [0u8; 1];
            region.read_at(999, &mut before).expect("read");
            assert_eq!(before, [0xEE], "nothing written before the target range");

            let (res, got) = p.ab.get(vec![0u8; 300_000], base + 1000, &rkey).await;
            res.expect("get");
            assert!(got == data, "get read back");

            // Zero-length operations complete and change nothing.
            let (res, _) = p.ab.put(Vec::new(), base, &rkey).await;
            res.expect("zero put");
            let (res, got) = p.ab.get(Vec::new(), base, &rkey).await;
            res.expect("zero get");
            assert!(got.is_empty());
            p.ab.flush().await.expect("flush");
            p.a.flush().await.expect("worker flush");
        });
    }
}

/// Poll two futures to completion concurrently.
async fn join<A: std::future::Future, B: std::future::Future>(
    a: A,
    b: B,
) -> (A::Output, B::Output) {
    let mut a = std::pin::pin!(a);
    let mut b = std::pin::pin!(b);
    let mut ra = None;
    let mut rb = None;
    poll_fn(|cx| {
        if ra.is_none() {
            if let Poll::Ready(v) = a.as_mut().poll(cx) {
                ra = Some(v);
            }
        }
        if rb.is_none() {
            if let Poll::Ready(v) = b.as_mut().poll(cx) {
                rb = Some(v);
            }
        }
        if ra.is_some() && rb.is_some() {
            Poll::Ready((ra.take().expect("a"), rb.take().expect("b")))
        } else {
            Poll::Pending
        }
    })
    .await
}

#[test]
fn registered_slices_are_exclusive_buffers() {
    let p = pair("tcp");
    let region = Rc::new(MemHandle::allocate(&p.b_context, 1 << 20).expect("alloc"));
    let a = region.slice(0, 4096).expect("lease a");
    assert!(region.slice(4095, 10).is_err(), "overlap with the start");
    assert!(region.slice(0, 1).is_err(), "same start");
    assert!(region.slice(100, 10).is_err(), "inside");
    assert!(region.slice(1 << 20, 1).is_err(), "past the end");
    assert!(region.slice(usize::MAX, 2).is_err(), "overflow");
    assert!(region.slice(10, 0).is_err(), "empty");
    let mut b = region.slice(4096, 1 << 16).expect("lease b, adjacent");
    assert_eq!(region.leased(), 2);
    // The region refuses leased ranges; free ranges stay usable.
    assert!(region.write_at(4000, &[1; 200]).is_err());
    region
        .write_at((1 << 16) + 4096, &[9; 16])
        .expect("free range");
    // A slice is a buffer: receive into it, read it in place.
    b.as_mut_slice().expect("not exported").fill(0);
    let (res, b) = p.run(async {
        let recv = p.b.tag_recv(5, u64::MAX, b);
        let send = p.ab.tag_send(5, pattern(50_000, 8));
        let ((r, b), (s, _)) = join(recv, send).await;
        s.expect("send");
        (r, b)
    });
    assert_eq!(res.expect("recv").len, 50_000);
    assert!(b.as_slice().expect("readable")[..50_000] == pattern(50_000, 8)[..]);
    let mut head = [0u8; 4];
    b.read_at(0, &mut head).expect("read_at");
    assert_eq!(&head, &pattern(4, 8)[..]);
    drop(a);
    assert_eq!(region.leased(), 1);
    let again = region.slice(0, 4096).expect("lease again after release");
    // Once a remote key exists, peers may write the memory: no more references.
    let _key = region.pack_rkey().expect("pack");
    assert!(region.is_exported());
    assert!(again.as_slice().is_none());
    assert!(b.as_slice().is_none());
    b.read_at(0, &mut head).expect("copies still work");
}

#[test]
fn mapped_owned_memory_is_reachable_by_put_and_get() {
    for tls in transports() {
        let p = pair(tls);
        let region = MemHandle::map(
            &p.b_context,
            AlignedBuf::zeroed(64 << 10, 4096).expect("buf"),
        )
        .expect("map owned memory");
        assert_eq!(region.len(), 64 << 10);
        assert_eq!(
            region.address() % 4096,
            0,
            "the mapped buffer's own address"
        );
        let rkey = RemoteKey::unpack(&p.ab, &region.pack_rkey().expect("pack")).expect("unpack");
        p.run(async {
            let (res, _) =
                p.ab.put(pattern(10_000, 3), region.address() + 5, &rkey)
                    .await;
            res.expect("put");
            p.ab.flush().await.expect("flush");
        });
        let mut back = vec![0u8; 10_000];
        region.read_at(5, &mut back).expect("read");
        assert!(back == pattern(10_000, 3));
        let (res, got) = p.run(p.ab.get(vec![0u8; 10_000], region.address() + 5, &rkey));
        res.expect("get");
        assert!(got == pattern(10_000, 3));
        assert!(
            MemHandle::map(&p.b_context, Vec::new()).is_err(),
            "empty buffers are refused"
        );
    }
}

/// The hot path's receive side: a persistent handler records messages during `progress`; each
/// eager payload is a UCX descriptor, readable after the callback has returned, aligned to
/// `AM_ALIGNMENT`, and released when dropped.
#[test]
fn persistent_handler_keeps_eager_data_past_the_callback() {
    for tls in transports() {
        let p = pair(tls);
        let q: Inbox = Rc::default();
        let q2 = q.clone();
        p.b.set_am_handler_persistent(9, move |hdr, payload| {
            q2.borrow_mut().push_back((hdr.to_vec(), payload))
        })
        .expect("handler");
        let sizes = [0usize, 1, 8, 100, 4000];
        for (k, &size) in sizes.iter().enumerate() {
            let payload = pattern(size, k as u8);
            // In place when UCX can (after wire-up, within the short limit), else owned.
            if let Err(Error::NoResource) = p.ab.am_send_now(9, &[k as u8; 24], &payload) {
                let (res, _) = p.run(p.ab.am_send(9, &[k as u8; 24], payload, AmProto::Eager));
                res.expect("owned send");
            }
        }
        // Progress until every message is recorded; none is read before that, so each must
        // have outlived its callback.
        p.spin_until(|| q.borrow().len() == sizes.len());
        let got: Vec<_> = q.borrow_mut().drain(..).collect();
        assert_eq!(got.len(), sizes.len(), "{tls}: every message recorded");
        for (k, ((hdr, payload), &size)) in got.into_iter().zip(&sizes).enumerate() {
            assert_eq!(hdr, vec![k as u8; 24], "{tls}: header {k}");
            let AmPayload::Data(d) = payload else {
                panic!("{tls}: {size} bytes arrived eager")
            };
            assert_eq!(
                d.as_slice(),
                &pattern(size, k as u8)[..],
                "{tls}: bytes {k}"
            );
            if size > 0 {
                assert_eq!(
                    d.as_slice().as_ptr() as usize % shardcx_ucx::AM_ALIGNMENT,
                    0,
                    "{tls}: data aligned"
                );
            }
        }
        p.spin(1000);
    }
}

/// `am_send_now` either hands the message to UCX at once (borrowed bytes, nothing kept) or
/// refuses with `NoResource` and sends nothing: a message longer than the short path's limit
/// is refused, and the receiver sees only the messages that were accepted.
#[test]
fn send_now_is_all_or_nothing() {
    for tls in transports() {
        let p = pair(tls);
        let q = inbox(&p.b, 11);
        // Wire the endpoint up first (over tcp its lanes connect on the first messages, and
        // until then UCX has no short path).
        let (res, _) = p.run(p.ab.am_send(11, &[0xFF], vec![0u8; 16], AmProto::Eager));
        res.expect("wire-up send");
        p.spin_until(|| !q.borrow().is_empty());
        assert_eq!(
            q.borrow_mut().drain(..).count(),
            1,
            "{tls}: wire-up message"
        );
        let big = pattern(1 << 20, 5);
        assert!(
            matches!(p.ab.am_send_now(11, b"", &big), Err(Error::NoResource)),
            "{tls}: 1 MiB is never sent in place"
        );
        let mut sent = 0usize;
        for i in 0..64u8 {
            // A stack buffer, overwritten right after the call: UCX must have copied it.
            let mut bytes = [i; 16];
            match p.ab.am_send_now(11, &[i], &bytes) {
                Ok(()) => sent += 1,
                Err(Error::NoResource) => {}
                Err(e) => panic!("{tls}: {e}"),
            }
            bytes.fill(0xEE);
            std::hint::black_box(&bytes);
        }
        assert!(sent > 0, "{tls}: small messages go in place");
        p.spin_until(|| q.borrow().len() == sent);
        let got: Vec<_> = q.borrow_mut().drain(..).collect();
        assert_eq!(got.len(), sent, "{tls}: nothing refused arrived");
        for (hdr, payload) in got {
            let AmPayload::Data(d) = payload else {
                panic!("{tls}: eager")
            };
            assert_eq!(d.as_slice(), &[hdr[0]; 16], "{tls}: the bytes at the call");
        }
        assert!(p.b.max_am_header() >= 64, "{tls}: room for a frame header");
    }
}

/// An inline handler reads short messages where the transport put them (`Bytes`, no UCX
/// descriptor), gets larger eager ones as kept descriptors and large ones by rendezvous, and
/// may answer from inside the callback with `am_send_now`: every echo comes back with the
/// bytes of its message, which the receiving side had already overwritten by then (a canary:
/// nothing read them after the callback).
#[test]
fn inline_handler_reads_in_place_and_answers_from_the_callback() {
    for tls in transports() {
        let p = pair(tls);
        // b echoes what it reads inline from inside its handler; anything else is kept.
        let kept: Inbox = Rc::default();
        let inline_seen = Rc::new(std::cell::Cell::new(0usize));
        let echo = std::rc::Rc::new(
            shardcx_ucx::Endpoint::connect_to_worker(
                &p.b,
                &p.a.address().expect("address"),
                common::ep_options(tls),
            )
            .expect("endpoint b->a"),
        );
        let (k2, seen, answer) = (kept.clone(), inline_seen.clone(), echo.clone());
        p.b.set_am_handler_inline(21, move |hdr, incoming| match incoming {
            AmIncoming::Bytes(b) => {
                seen.set(seen.get() + 1);
                // The answer's bytes are copied before UCX sees them (inside a callback).
                match answer.am_send_now(22, hdr, b) {
                    Ok(()) | Err(Error::NoResource) => {}
                    Err(e) => panic!("send from the callback: {e}"),
                }
            }
            other => k2.borrow_mut().push_back((hdr.to_vec(), other.keep())),
        })
        .expect("inline handler");
        let echoes = inbox(&p.a, 22);
        // Wire-up first, by owned sends both ways (tcp has no short path before it).
        let (res, _) = p.run(p.ab.am_send(21, &[0], vec![0u8; 8], AmProto::Eager));
        res.expect("wire-up");
        let (res, _) = p.run(echo.am_send(22, &[0], vec![0u8; 8], AmProto::Eager));
        res.expect("wire-up of the echo");
        p.spin(10_000);
        echoes.borrow_mut().clear();
        kept.borrow_mut().clear();
        let before = inline_seen.get();
        let mut sent = 0usize;
        for i in 1..=50u8 {
            let mut bytes = [i; 24];
            if p.ab.am_send_now(21, &[i], &bytes).is_ok() {
                sent += 1;
            }
            bytes.fill(0xEE);
            std::hint::black_box(&bytes);
        }
        assert!(sent > 0, "{tls}: short messages go in place");
        p.spin_until(|| echoes.borrow().len() == sent);
        assert_eq!(inline_seen.get() - before, sent, "{tls}: each read inline");
        let got: Vec<_> = echoes.borrow_mut().drain(..).collect();
        assert_eq!(
            got.len(),
            sent,
            "{tls}: every echo answered from the callback"
        );
        for (hdr, payload) in got {
            let AmPayload::Data(d) = payload else {
                panic!("{tls}: eager echo")
            };
            assert_eq!(d.as_slice(), &[hdr[0]; 24], "{tls}: the echoed bytes");
        }
        // A large message comes by rendezvous, kept and pulled after the callback.
        let big = pattern(1 << 20, 9);
        let (res, _) = p.run(async {
            let send = p.ab.am_send(21, b"big", big.clone(), AmProto::Auto);
            let received = async {
                let r = loop {
                    if let Some((_, AmPayload::Rendezvous(r))) = kept.borrow_mut().pop_front() {
                        break r;
                    }
                    futures_yield().await;
                };
                let (got, buf) = p.b.am_recv_data(r, vec![0u8; 1 << 20]).await;
                assert_eq!(got.expect("pull"), 1 << 20);
                buf
            };
            let (sent, buf) = join(send, received).await;
            assert_eq!(buf, big, "{tls}: rendezvous data");
            sent
        });
        res.expect("large send");
    }
}

/// A handler that sends to its own worker may be called again from inside itself (UCX delivers
/// some sends at once): an inline handler is `Fn` and takes it; nothing panics.
#[test]
fn inline_handler_sending_to_its_own_worker() {
    for tls in transports() {
        let p = pair(tls);
        let own = std::rc::Rc::new(
            shardcx_ucx::Endpoint::connect_to_worker(
                &p.b,
                &p.b.address().expect("address"),
                common::ep_options(tls),
            )
            .expect("endpoint to itself"),
        );
        let depth = Rc::new(std::cell::Cell::new(0u32));
        let total = Rc::new(std::cell::Cell::new(0u32));
        let (ep, d, t) = (own.clone(), depth.clone(), total.clone());
        p.b.set_am_handler_inline(23, move |_, incoming| {
            let AmIncoming::Bytes(b) = incoming else {
                return;
            };
            t.set(t.get() + 1);
            d.set(d.get() + 1);
            // Count down: each message but the last sends the next to this same worker.
            if let Some(&n) = b.first() {
                if n > 0 {
                    let _ = ep.am_send_now(23, b"", &[n - 1]);
                }
            }
            d.set(d.get() - 1);
        })
        .expect("inline handler");
        let (res, _) = p.run(own.am_send(23, b"", vec![0u8], AmProto::Eager));
        res.expect("wire-up to itself");
        p.spin(10_000);
        let start = total.get();
        let mut ok = false;
        for _ in 0..100 {
            if own.am_send_now(23, b"", &[5]).is_ok() {
                ok = true;
                break;
            }
            p.spin(100);
        }
        assert!(ok, "{tls}: a short send to itself");
        p.spin_until(|| total.get() - start == 6);
        assert_eq!(
            total.get() - start,
            6,
            "{tls}: the whole count-down arrived"
        );
        assert_eq!(depth.get(), 0, "{tls}: every call returned");
    }
}

async fn futures_yield() {
    let mut once = false;
    poll_fn(|cx| {
        if once {
            Poll::Ready(())
        } else {
            once = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    })
    .await
}
