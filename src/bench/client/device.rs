//! The tests of `--memory cuda` ([`Memory::Cuda`](crate::bench::Memory::Cuda); see
//! [`crate::bench`], "Device memory"): the client's buffers are device buffers on its shard's
//! device. What is sent comes from a [`DeviceBuffer`] and what comes back is landed in one,
//! both staged through the shard's pinned bounce buffers (the device → host copy is part of
//! every measured send, the host → device copy part of every measured receive). The server
//! answers from host memory, as it does for `--memory host`: the frames on the wire are the
//! same either way.
//!
//! The staged copies of one shard run one at a time (`put-bw` and `get-bw` have a window of
//! tasks: they take turns on the copy, and their network operations overlap): a copy takes as
//! many of the shard's kept bounce buffers as it has chunks, and copies at once that need more
//! than the kept set would allocate pinned memory beyond it (slow on a GPU) and free it after;
//! with a window wider than the kept set, taking turns avoids that.
//!
//! Every test checks at its end that the device buffers hold the bytes they should.

use std::rc::Rc;

use glommio::sync::Semaphore;
use shardcx_shards::RemoteRegion;

use super::{
    echoed, for_this_shard, header, parse_header, pattern, BenchError, Budget, Figures, Progress,
    RmaOp, RpcEcho, Session, Test, Waits, CONTENT_CHECK_EVERY, DEADLINE, ECHO, FLAG_ACK, SINK,
};
use crate::{AmView, CudaError, DeviceBuffer, Node, Peer};

/// The state of one task of a windowed device test: its device buffer and the host bytes
/// staged from it (a put) or landed into it (a get).
struct Staged {
    device: DeviceBuffer,
    host: Vec<u8>,
}

impl Session {
    /// Runs `test` of `size` bytes with device buffers (`window`: the windowed tests' window,
    /// already capped to the bytes in flight).
    pub(super) async fn device_test(
        &self,
        test: Test,
        size: usize,
        window: usize,
        budget: Budget,
        warmup: u64,
        progress: &Rc<Progress>,
    ) -> Result<Figures, BenchError> {
        match test {
            Test::AmLat => self.device_am_lat(size, budget, warmup, progress).await,
            Test::AmBw => {
                self.device_am_bw(size, window, budget, warmup, progress)
                    .await
            }
            Test::RpcLat => self.device_rpc_lat(size, budget, warmup, progress).await,
            Test::PutBw => {
                self.device_rma(RmaOp::Put, size, window, budget, warmup, progress)
                    .await
            }
            Test::GetBw => {
                self.device_rma(RmaOp::Get, size, window, budget, warmup, progress)
                    .await
            }
            other => Err(BenchError::Config(format!(
                "--memory cuda: {other} does not move device memory"
            ))),
        }
    }

    /// A device buffer of `len` bytes on this shard's device (its contents undefined).
    fn device_buffer(&self, len: usize) -> Result<DeviceBuffer, BenchError> {
        self.node.shard_ctx().cuda().alloc(len).map_err(cuda_error)
    }

    /// A device buffer holding `bytes` (copied before the test's clock starts).
    fn device_source(&self, bytes: &[u8]) -> Result<DeviceBuffer, BenchError> {
        let mut buf = self.device_buffer(bytes.len())?;
        if !bytes.is_empty() {
            buf.copy_from_host(0, bytes).map_err(cuda_error)?;
        }
        Ok(buf)
    }

    /// `am-lat` from device memory: each ping is sent from a device buffer
    /// ([`Peer::am_send_device`]), and each echo is landed in another
    /// ([`Node::copy_to_device`]) before the round trip ends. Driven by the test task (the
    /// staged copies must be awaited), not by the echo handler as the host `am-lat` is.
    async fn device_am_lat(
        &self,
        size: usize,
        budget: Budget,
        warmup: u64,
        progress: &Progress,
    ) -> Result<Figures, BenchError> {
        let want = pattern(size, 0xA5);
        let mut src = self.device_source(&want)?;
        let mut dst = self.device_buffer(size)?;
        let waits = &self.waits;
        let round_trip = async || {
            let seq = self.next_seq();
            self.target
                .am_send_device(ECHO, &header(self.me, seq, 0), &mut src)
                .await?;
            waits
                .until("echo", |w| !w.echoes.borrow().is_empty())
                .await?;
            let echo = waits
                .echoes
                .borrow_mut()
                .pop_front()
                .ok_or_else(|| BenchError::Protocol("an echo went missing".into()))?;
            match parse_header(echo.header()) {
                Some((_, s, _)) if s == seq => {}
                other => {
                    return Err(BenchError::Protocol(format!(
                        "echo #{:?} when #{seq} was expected",
                        other.map(|h| h.1)
                    )))
                }
            }
            echoed("echo", size, echo.payload().len())?;
            if seq % CONTENT_CHECK_EVERY == 0 && echo.payload() != want.as_slice() {
                return Err(BenchError::Protocol(format!(
                    "echo #{seq} came back with other bytes"
                )));
            }
            self.node.copy_to_device(echo.payload(), &mut dst).await?;
            Ok(())
        };
        let r = self
            .measure(size, budget, warmup, 1, progress, round_trip)
            .await;
        waits.echoes.borrow_mut().clear();
        let figures = r?;
        holds(&mut dst, &want, "the last echo")?;
        Ok(figures)
    }

    /// `am-bw` from device memory: windows of active messages each sent from the device buffer
    /// ([`Peer::am_send_device`]: staged, then sent), the last one acknowledged.
    async fn device_am_bw(
        &self,
        size: usize,
        window: usize,
        budget: Budget,
        warmup: u64,
        progress: &Progress,
    ) -> Result<Figures, BenchError> {
        let mut src = self.device_source(&pattern(size, 0x5A))?;
        let window_trip = async || {
            let mut last = 0;
            for k in 0..window {
                last = self.next_seq();
                let flags = if k + 1 == window { FLAG_ACK } else { 0 };
                self.target
                    .am_send_device(SINK, &header(self.me, last, flags), &mut src)
                    .await?;
            }
            self.acknowledged(last).await
        };
        let w = window as u64;
        // `Iters` counts messages: each measured window is `w` of them.
        self.measure(size, budget, warmup.div_ceil(w), w, progress, window_trip)
            .await
    }

    /// `rpc-lat` from device memory: the argument staged from a device buffer
    /// ([`Node::copy_from_device`]), the reply read in place and landed in another
    /// ([`Node::copy_to_device`]).
    async fn device_rpc_lat(
        &self,
        size: usize,
        budget: Budget,
        warmup: u64,
        progress: &Progress,
    ) -> Result<Figures, BenchError> {
        let rpc = self.node.rpc();
        let want = pattern(size, 0xC3);
        let mut src = self.device_source(&want)?;
        let mut dst = self.device_buffer(size)?;
        let mut args = vec![0u8; size];
        let round_trip = async || {
            self.node.copy_from_device(&mut src, &mut args).await?;
            let r = rpc
                .call_archived_within::<RpcEcho>(self.target, &args, DEADLINE)
                .await?;
            echoed("rpc echo", size, r.get().len())?;
            self.node
                .copy_to_device(r.get().as_slice(), &mut dst)
                .await?;
            Ok(())
        };
        let figures = self
            .measure(size, budget, warmup, 1, progress, round_trip)
            .await?;
        holds(&mut dst, &want, "the last reply")?;
        Ok(figures)
    }

    /// `put-bw` and `get-bw` with device memory: `window` tasks, each with a device buffer of
    /// its own; a put stages its buffer to host memory and puts that, a get lands what it got
    /// in its buffer. The staged copies take turns (see the module docs).
    async fn device_rma(
        &self,
        kind: RmaOp,
        size: usize,
        window: usize,
        budget: Budget,
        warmup: u64,
        progress: &Rc<Progress>,
    ) -> Result<Figures, BenchError> {
        let desc = self
            .region
            .ok_or_else(|| BenchError::Protocol("no region for the remote-memory test".into()))?;
        let want = pattern(size, 0x77);
        let mut states = Vec::with_capacity(window);
        for _ in 0..window {
            states.push(Staged {
                device: self.device_source(&want)?,
                host: vec![0u8; size],
            });
        }
        let (node, peer) = (self.node.clone(), self.target);
        let turn = Semaphore::new(1);
        let op = async move |s: &mut Staged| rma_op(&node, peer, &desc, kind, &turn, s).await;
        let (figures, states) = self
            .windowed(size, budget, warmup, progress, states, op)
            .await?;
        for mut s in states {
            match kind {
                // What was put is what the device buffer holds.
                RmaOp::Put => {
                    if s.host != want {
                        return Err(BenchError::Protocol(
                            "a put staged other bytes than its device buffer holds".into(),
                        ));
                    }
                }
                // What the last get returned is in the device buffer.
                RmaOp::Get | RmaOp::PutTrusted => holds(&mut s.device, &s.host, "the last get")?,
            }
        }
        Ok(figures)
    }
}

/// One operation of [`Session::device_rma`] on task state `s`, its staged copy done in `turn`.
async fn rma_op(
    node: &Node,
    peer: Peer,
    desc: &RemoteRegion,
    kind: RmaOp,
    turn: &Semaphore,
    s: &mut Staged,
) -> Result<(), BenchError> {
    let closed = |e| BenchError::Protocol(format!("the staging turn: {e}"));
    match kind {
        RmaOp::Put => {
            {
                let _turn = turn.acquire_permit(1).await.map_err(closed)?;
                node.copy_from_device(&mut s.device, &mut s.host).await?;
            }
            peer.put_within(desc, 0, &s.host, DEADLINE).await?;
        }
        RmaOp::Get => {
            s.host = peer
                .get_within(desc, 0, s.host.len() as u64, DEADLINE)
                .await?;
            if s.host.len() != s.device.len() {
                return Err(BenchError::Protocol(format!(
                    "get of {} bytes returned {}",
                    s.device.len(),
                    s.host.len()
                )));
            }
            let _turn = turn.acquire_permit(1).await.map_err(closed)?;
            node.copy_to_device(&s.host, &mut s.device).await?;
        }
        RmaOp::PutTrusted => {
            return Err(BenchError::Config(
                "--memory cuda: put-trusted-bw does not move device memory".into(),
            ))
        }
    }
    Ok(())
}

/// Checks that device buffer `dev` holds `want` (read back with a blocking copy, after the
/// measured part).
fn holds(dev: &mut DeviceBuffer, want: &[u8], what: &str) -> Result<(), BenchError> {
    let got = dev.to_vec().map_err(cuda_error)?;
    if got == want {
        Ok(())
    } else {
        let at = got.iter().zip(want).position(|(a, b)| a != b);
        Err(BenchError::Protocol(format!(
            "the device buffer does not hold {what}: {} bytes for {}, first difference at {at:?}",
            got.len(),
            want.len()
        )))
    }
}

/// The client's handler of [`ECHO_REPLY`](crate::bench::ECHO_REPLY) with device memory: the echo is kept for the
/// `am-lat` task, which lands its payload ([`Session::device_am_lat`]).
pub(super) fn on_echo_reply(w: &Waits, node: &Node, msg: &AmView<'_>) {
    w.answered.set(w.answered.get() + 1);
    match for_this_shard(node, msg) {
        Ok(_) => {
            w.echoes.borrow_mut().push_back(msg.to_owned());
            w.wake();
        }
        Err(e) => w.fail(e),
    }
}

/// A driver's error as the benchmark's (the node's CUDA error).
fn cuda_error(e: CudaError) -> BenchError {
    BenchError::Node(crate::Error::Cuda(e.into()))
}
