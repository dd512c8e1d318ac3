//! Connection set-up and teardown, errors, versions and auto traits.

mod common;

use std::cell::RefCell;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use common::{bounded, context, pair, pattern};
use shardcx_ucx::{
    AmPayload, AmProto, CloseMode, Endpoint, EpOptions, Error, Features, Listener, MemHandle,
    RemoteKey, Worker,
};

#[test]
fn loaded_ucx_is_the_one_built() {
    let v = shardcx_ucx::version();
    assert!(v.matches(), "{v}");
    assert!(v.compatible());
    let path = v
        .library_path
        .clone()
        .expect("loader knows the library path");
    assert!(path.contains("libucp"), "{path}");
    // Under cargo the bundled build (inside the target directory) is found first.
    assert!(
        path.contains("/build/ucx1-sys-"),
        "loaded {path}, not the bundled build"
    );
    assert!(v.to_string().contains("1.12"));
}

#[test]
fn listener_accepts_and_rejects_connections() {
    let ctx = context("tcp", Features::messaging());
    let server = Worker::new(&ctx).expect("server");
    let client = Worker::new(&context("tcp", Features::messaging())).expect("client");
    let listener = Listener::bind(&server, "127.0.0.1:0".parse().expect("addr")).expect("bind");
    let addr: SocketAddr = listener.local_addr().expect("local addr");
    assert_ne!(addr.port(), 0);

    let got = Rc::new(RefCell::new(Vec::new()));
    let g2 = got.clone();
    server
        .set_am_handler(1, move |h, p| {
            if let AmPayload::Data(d) = p {
                g2.borrow_mut().push((h.to_vec(), d.into_vec()));
            }
        })
        .expect("handler");

    let ep = Endpoint::connect(&client, addr, EpOptions::default()).expect("connect");
    let server_ep = bounded(&[&server, &client], async {
        let req = listener.accept().await;
        assert!(req.client_addr().is_some());
        Endpoint::accept(&server, req, EpOptions::default()).expect("accept")
    });
    bounded(&[&server, &client], async {
        let (res, _) = ep.am_send(1, b"hi", pattern(100, 1), AmProto::Auto).await;
        res.expect("send");
        ep.flush().await.expect("flush");
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while got.borrow().is_empty() && Instant::now() < deadline {
        server.progress();
        client.progress();
    }
    assert_eq!(got.borrow()[0], (b"hi".to_vec(), pattern(100, 1)));

    // A second client is rejected: its endpoint reports an error.
    let ep2 = Endpoint::connect(&client, addr, EpOptions::default()).expect("connect 2");
    let err = bounded(&[&server, &client], async {
        listener.accept().await.reject().expect("reject");
        ep2.failed().await
    });
    assert!(err.is_connection_failure(), "{err:?}");

    bounded(&[&server, &client], async {
        ep.close(CloseMode::Flush).await.expect("close client");
        server_ep
            .close(CloseMode::Force)
            .await
            .expect("close server");
    });
}

#[test]
fn connecting_to_nothing_fails_with_a_typed_error() {
    let client = Worker::new(&context("tcp", Features::messaging())).expect("client");
    // A port nobody listens on (bound, then released).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port();
    let ep = Endpoint::connect(
        &client,
        SocketAddr::from(([127, 0, 0, 1], port)),
        EpOptions::default(),
    )
    .expect("create");
    let err = bounded(&[&client], ep.failed());
    assert!(err.is_connection_failure(), "{err:?}");
    // Operations on a failed endpoint fail at once and hand the buffer back.
    let (res, buf) = bounded(&[&client], ep.tag_send(1, vec![1, 2, 3]));
    assert!(res.is_err());
    assert_eq!(buf, vec![1, 2, 3]);
}

#[test]
fn endpoint_error_is_delivered_when_the_peer_worker_goes_away() {
    let p = pair("tcp");
    let common::Pair {
        a_context,
        b_context,
        a,
        b,
        ab,
        ba,
    } = p;
    // Make sure the connection is up both ways.
    bounded(&[&a, &b], async {
        ab.tag_send(1, vec![1]).await.0.expect("a->b");
        b.tag_recv(1, u64::MAX, vec![0u8; 1]).await.0.expect("recv");
        ba.flush().await.expect("flush");
    });
    drop(ba);
    drop(b);
    drop(b_context);
    let started = Instant::now();
    let err = bounded(&[&a], ab.failed());
    assert!(err.is_connection_failure(), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(30));
    assert_eq!(ab.error(), Some(err));
    // In-flight and new operations fail rather than hang.
    let (res, _) = bounded(&[&a], ab.am_send(1, b"", vec![0u8; 10], AmProto::Auto));
    assert!(res.is_err());
    drop(ab);
    drop(a);
    drop(a_context);
}

#[test]
fn polling_failed_again_and_again_keeps_one_waker_per_future() {
    use std::future::Future;
    use std::sync::Arc;
    use std::task::{Context, Wake, Waker};
    struct Count;
    impl Wake for Count {
        fn wake(self: Arc<Self>) {}
    }
    let p = pair("tcp");
    let counter = Arc::new(Count);
    let waker = Waker::from(counter.clone());
    let mut cx = Context::from_waker(&waker);
    // One future polled many times (a task woken for other reasons), then many short-lived
    // futures (a loop racing `failed()` against other events): neither may pile up wakers.
    let mut kept = Box::pin(p.ab.failed());
    for _ in 0..1000 {
        assert!(kept.as_mut().poll(&mut cx).is_pending());
    }
    for _ in 0..1000 {
        let mut f = Box::pin(p.ab.failed());
        assert!(f.as_mut().poll(&mut cx).is_pending());
    }
    // The test's own `waker`, plus the one kept by `kept`.
    assert_eq!(Arc::strong_count(&counter), 3);
    drop(kept);
    assert_eq!(Arc::strong_count(&counter), 2);
}

#[test]
fn invalid_arguments_are_refused_without_reaching_ucx() {
    let ctx = context("tcp", Features::all());
    assert!(matches!(
        MemHandle::allocate(&ctx, 0),
        Err(Error::InvalidArgument(_))
    ));
    let region = MemHandle::allocate(&ctx, 4096).expect("alloc");
    assert!(region.write_at(4090, &[0; 7]).is_err());
    assert!(region.write_at(usize::MAX, &[0; 2]).is_err());
    let mut out = [0u8; 8];
    assert!(region.read_at(4089, &mut out).is_err());
    let mut cfg = shardcx_ucx::Config::from_env().expect("config");
    assert!(cfg.set("RNDV_THRESH", "not-a-size").is_err());
    assert!(matches!(cfg.set("TLS\0", "tcp"), Err(Error::NulByte)));
    assert!(shardcx_ucx::Context::new(&cfg, Features::default()).is_err());
    // A corrupt remote key is rejected by UCX with an error, not a crash.
    let p = pair("tcp");
    for junk in [vec![], vec![0xFF; 3], vec![0xFF; 40], {
        // A valid key, truncated by one byte.
        let region = MemHandle::allocate(&p.b_context, 4096).expect("alloc");
        let mut k = region.pack_rkey().expect("pack").as_bytes().to_vec();
        assert!(RemoteKey::unpack(&p.ab, &shardcx_ucx::PackedRkey::from_bytes(k.clone())).is_ok());
        k.pop();
        k
    }] {
        let junk = shardcx_ucx::PackedRkey::from_bytes(junk);
        assert!(matches!(
            RemoteKey::unpack(&p.ab, &junk),
            Err(Error::InvalidArgument(_))
        ));
    }
}

#[test]
fn worker_sleeps_on_its_event_fd_when_idle() {
    let w = Worker::new(&context("tcp", Features::messaging())).expect("worker");
    assert!(w.event_fd().expect("efd") >= 0);
    let started = Instant::now();
    let woke = w.wait(Duration::from_millis(100)).expect("wait");
    // Idle: nothing woke it, and it slept rather than returning at once.
    assert!(!woke || started.elapsed() >= Duration::from_millis(1));
    w.signal().expect("signal");
    assert!(w.wait(Duration::from_secs(5)).expect("wait"));

    // Another thread can sleep on a duplicate of the fd and is woken by the worker's events.
    let fd = w.wakeup_fd().expect("wakeup fd");
    while w.arm().expect("arm") == shardcx_ucx::Armed::Busy {
        w.progress();
    }
    let waiter = std::thread::spawn(move || fd.wait(Some(Duration::from_secs(10))));
    std::thread::sleep(Duration::from_millis(20));
    w.signal().expect("signal");
    assert!(
        waiter.join().expect("waiter"),
        "the waiter thread was woken"
    );
}

/// Compile-time checks that the UCX handles cannot leave their thread.
#[test]
fn auto_traits() {
    trait AmbiguousIfSend<A> {
        fn some_item() {}
    }
    impl<T: ?Sized> AmbiguousIfSend<()> for T {}
    impl<T: ?Sized + Send> AmbiguousIfSend<u8> for T {}
    trait AmbiguousIfSync<A> {
        fn some_item() {}
    }
    impl<T: ?Sized> AmbiguousIfSync<()> for T {}
    impl<T: ?Sized + Sync> AmbiguousIfSync<u8> for T {}
    // Each line compiles only if the type is NOT Send (resp. Sync).
    let _ = <Worker as AmbiguousIfSend<_>>::some_item;
    let _ = <Worker as AmbiguousIfSync<_>>::some_item;
    let _ = <Endpoint as AmbiguousIfSend<_>>::some_item;
    let _ = <Endpoint as AmbiguousIfSync<_>>::some_item;
    let _ = <MemHandle as AmbiguousIfSend<_>>::some_item;
    let _ = <MemHandle as AmbiguousIfSync<_>>::some_item;
    let _ = <shardcx_ucx::Context as AmbiguousIfSend<_>>::some_item;
    let _ = <Listener as AmbiguousIfSend<_>>::some_item;
    let _ = <RemoteKey as AmbiguousIfSend<_>>::some_item;
    fn send_sync<T: Send + Sync>() {}
    send_sync::<shardcx_ucx::WorkerAddress>();
    send_sync::<shardcx_ucx::PackedRkey>();
    send_sync::<Error>();
    send_sync::<shardcx_ucx::WakeupFd>();
}
