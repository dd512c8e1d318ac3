//! The staging pipeline's scheduler: device memory moved through host bounce buffers, chunk by
//! chunk, with several chunks in flight.
//!
//! A UCX without CUDA transports (the bundled 1.12) must never see a device pointer. A shard in
//! staging mode therefore moves a device buffer in chunks of 1–4 MiB through a few pinned host
//! *bounce buffers*, overlapping the device copies of some chunks with the network transfers of
//! others:
//!
//! - **send** ([`Direction::Send`]): device → bounce buffer (an asynchronous device-to-host
//!   copy on the shard's stream) → network, in chunk order;
//! - **receive** ([`Direction::Recv`]): network → bounce buffer → device (host-to-device copy).
//!
//! [`Staging`] decides what happens next and nothing else: which chunk goes into which bounce
//! buffer, when a copy may start, which chunk the network may take. It owns no memory (bounce
//! buffers are named by [`BufferId`], device ranges by offset), performs no I/O and reads no
//! clock. Copies go through a [`CopyEngine`] (the shard's CUDA stream, or a fake in host memory
//! in tests); network transfers are the caller's, reported back with `handle_*`.
//!
//! ## Calling order
//!
//! 1. [`Staging::new`] with the transfer's length and a [`StagingConfig`].
//! 2. Loop until [`Staging::state`] is final ([`State::is_final`]):
//!    - [`Staging::pump`] with the copy engine: takes the copies it finished, starts the
//!      copies that can start;
//!    - send: [`Staging::poll_send`] gives the next chunk to put on the wire, in order, with the
//!      bounce buffer holding it; report the end of each with [`Staging::handle_sent`];
//!    - receive: [`Staging::poll_recv`] gives the next chunk to receive and the bounce buffer
//!      to land it in; report its arrival with [`Staging::handle_received`];
//!    - wait for the engine or the network (a shard polls its CUDA events in its progress loop).
//! 3. [`Staging::cancel`] at any time stops it: nothing new starts, and the state becomes
//!    [`State::Cancelled`] once every copy and network operation in flight has reported back.
//!
//! ## Invariants (checked by the property tests below)
//!
//! - At most [`StagingConfig::bounce_buffers`] buffers are in use; a buffer is handed to one
//!   copy or one network operation at a time, and comes back only when that one has reported.
//! - Send: chunks reach the network in order of offset, each once, each after its device copy
//!   finished. Receive: each chunk is copied to its own device range once, after it arrived.
//! - After [`Staging::cancel`] or a failure, no copy, send or receive starts; the final state is
//!   reached only once no buffer is in use, so no bounce buffer is written after it is given
//!   back.
//! - Unexpected reports (a chunk reported twice, or in a state where it cannot be) are a typed
//!   error ([`StagingError::Unexpected`]), never a panic.

use std::collections::VecDeque;

use thiserror::Error;

/// The smallest chunk: below this, per-chunk costs (a copy launch, an event, a network
/// operation) dominate.
pub const MIN_CHUNK: usize = 1 << 20;
/// The largest chunk: above this, too little overlap between copies and the network.
pub const MAX_CHUNK: usize = 4 << 20;

/// Which way data moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// From device memory to the network (device → bounce buffer → wire).
    Send,
    /// From the network to device memory (wire → bounce buffer → device).
    Recv,
}

/// A copy between device memory and a bounce buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CopyDirection {
    /// Device range → bounce buffer (for a send).
    DeviceToHost,
    /// Bounce buffer → device range (for a receive).
    HostToDevice,
}

/// A bounce buffer, by index: `0..StagingConfig::bounce_buffers`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufferId(pub usize);

/// One chunk of the transfer and the bounce buffer it is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Chunk {
    /// The chunk's index, from 0, in order of offset.
    pub index: u32,
    /// The chunk's offset in the device buffer (and on the wire).
    pub offset: u64,
    /// The chunk's length in bytes (the last chunk may be shorter than the others).
    pub len: usize,
    /// The bounce buffer holding (or receiving) the chunk, from its first `len` bytes.
    pub buffer: BufferId,
}

/// A copy for a [`CopyEngine`] to queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CopyOp {
    /// The chunk: device range `[offset, offset + len)` and bounce buffer `buffer[..len]`.
    pub chunk: Chunk,
    /// Which way.
    pub direction: CopyDirection,
}

/// Asynchronous copies between device memory and bounce buffers: a CUDA stream with an event per
/// copy on a GPU, plain memory copies in tests.
pub trait CopyEngine {
    /// Why a copy failed.
    type Error;

    /// Queues `op`. It must not complete inside this call: its completion is reported by a
    /// later [`CopyEngine::poll_complete`]. `Err` means it was not queued at all.
    fn start(&mut self, op: CopyOp) -> Result<(), Self::Error>;

    /// One copy that has finished since the last call (the chunk index and its result), in any
    /// order; `None` when no more have finished yet. Never blocks.
    fn poll_complete(&mut self) -> Option<(u32, Result<(), Self::Error>)>;
}

/// The pipeline's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagingConfig {
    /// Chunk length, [`MIN_CHUNK`]..=[`MAX_CHUNK`]; also the size every bounce buffer must have.
    pub chunk: usize,
    /// Bounce buffers, hence chunks in flight (copying or on the network), at least 1.
    pub bounce_buffers: usize,
}

/// Where a transfer stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Chunks are moving.
    Running,
    /// Every chunk has been copied and sent (or received and copied).
    Done,
    /// Cancelled; waiting for operations in flight to report back.
    Cancelling,
    /// Cancelled, and nothing is in flight any more.
    Cancelled,
    /// A copy or network operation failed; waiting for the others in flight to report back.
    Failing(Failure),
    /// Failed, and nothing is in flight any more.
    Failed(Failure),
}

/// What failed a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The copy of this chunk failed (or could not be queued).
    Copy {
        /// The chunk's index.
        chunk: u32,
    },
    /// The network transfer of this chunk failed.
    Network {
        /// The chunk's index.
        chunk: u32,
    },
}

/// An error of the scheduler itself.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum StagingError {
    /// The configuration or length was refused.
    #[error("staging: {0}")]
    Config(&'static str),
    /// A chunk was reported in a state where it cannot be (twice, say, or never started).
    #[error("staging: chunk {chunk}: unexpected report: {what}")]
    Unexpected {
        /// The chunk's index.
        chunk: u32,
        /// What was reported.
        what: &'static str,
    },
}

/// A copy failed: what [`Staging::pump`] returns the first time it sees the failure.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PumpError<E> {
    /// The copy engine refused or failed the copy of `chunk`; the transfer is failing.
    #[error("staging: the copy of chunk {chunk} failed")]
    Copy {
        /// The chunk's index.
        chunk: u32,
        /// The engine's error.
        source: E,
    },
    /// The engine reported a chunk the scheduler was not copying.
    #[error(transparent)]
    Staging(#[from] StagingError),
}

/// One chunk's progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    /// Nothing done yet.
    Waiting,
    /// Being copied (either way) with this buffer.
    Copying(BufferId),
    /// Send: copied to the buffer, waiting for its turn on the network.
    Copied(BufferId),
    /// On the network (either way) with this buffer.
    Network(BufferId),
    /// Receive: arrived in the buffer, waiting for its copy to the device.
    Arrived(BufferId),
    /// Finished (or dropped by a cancel or failure); its buffer is free.
    Done,
}

/// The scheduler of one staged transfer (see the module docs for the calling order).
#[derive(Debug, Clone)]
pub struct Staging {
    direction: Direction,
    len: u64,
    chunk: usize,
    slots: Vec<Slot>,
    free: Vec<BufferId>,
    bounce_buffers: usize,
    /// Send: next chunk to copy. Receive: next chunk to post.
    next_start: u32,
    /// Send: next chunk to put on the network.
    next_send: u32,
    /// Receive: arrived chunks waiting for a copy, in arrival order.
    arrived: VecDeque<u32>,
    done: u32,
    state: State,
}

impl StagingConfig {
    /// Checks the shape.
    pub fn validate(&self) -> Result<(), StagingError> {
        if !(MIN_CHUNK..=MAX_CHUNK).contains(&self.chunk) {
            return Err(StagingError::Config("chunk must be 1 to 4 MiB"));
        }
        if self.bounce_buffers == 0 {
            return Err(StagingError::Config("at least one bounce buffer"));
        }
        Ok(())
    }
}

impl Default for StagingConfig {
    /// 2 MiB chunks, 4 bounce buffers: 8 MiB of pinned memory per transfer in flight.
    fn default() -> Self {
        Self {
            chunk: 2 << 20,
            bounce_buffers: 4,
        }
    }
}

impl State {
    /// Whether nothing will happen any more ([`State::Done`], [`State::Cancelled`],
    /// [`State::Failed`]).
    pub fn is_final(&self) -> bool {
        matches!(self, State::Done | State::Cancelled | State::Failed(_))
    }
}

impl Staging {
    /// A transfer of `len` bytes in direction `direction`.
    pub fn new(
        direction: Direction,
        len: u64,
        config: StagingConfig,
    ) -> Result<Self, StagingError> {
        config.validate()?;
        let chunks = len.div_ceil(config.chunk as u64);
        let chunks = u32::try_from(chunks).map_err(|_| StagingError::Config("too many chunks"))?;
        let mut me = Self {
            direction,
            len,
            chunk: config.chunk,
            slots: vec![Slot::Waiting; chunks as usize],
            // Popped from the end: buffer 0 first.
            free: (0..config.bounce_buffers).rev().map(BufferId).collect(),
            bounce_buffers: config.bounce_buffers,
            next_start: 0,
            next_send: 0,
            arrived: VecDeque::new(),
            done: 0,
            state: State::Running,
        };
        me.settle();
        Ok(me)
    }

    /// Which way this transfer moves data.
    pub fn direction(&self) -> Direction {
        self.direction
    }

    /// Where the transfer stands.
    pub fn state(&self) -> State {
        self.state
    }

    /// Number of chunks.
    pub fn chunk_count(&self) -> u32 {
        // `new` checked that the count fits a u32.
        self.slots.len() as u32
    }

    /// Chunks finished so far.
    pub fn chunks_done(&self) -> u32 {
        self.done
    }

    /// Bounce buffers in use (by a copy, the network, or holding a chunk between the two).
    pub fn buffers_in_use(&self) -> usize {
        self.bounce_buffers - self.free.len()
    }

    /// Takes the copies `engine` finished, then starts every copy that can start. Returns the
    /// first copy failure it sees (the transfer is then failing; keep calling until the state
    /// is final, so that the other copies in flight report back).
    pub fn pump<E: CopyEngine>(&mut self, engine: &mut E) -> Result<(), PumpError<E::Error>> {
        let mut first: Option<PumpError<E::Error>> = None;
        while let Some((index, result)) = engine.poll_complete() {
            let buffer = match self.slot(index) {
                Some(Slot::Copying(b)) => b,
                _ => {
                    first.get_or_insert(PumpError::Staging(StagingError::Unexpected {
                        chunk: index,
                        what: "a copy finished that was not started",
                    }));
                    continue;
                }
            };
            match result {
                Ok(()) if self.state == State::Running => match self.direction {
                    Direction::Send => self.slots[index as usize] = Slot::Copied(buffer),
                    Direction::Recv => self.finish(index, buffer),
                },
                Ok(()) => self.drop_chunk(index, buffer),
                Err(source) => {
                    self.drop_chunk(index, buffer);
                    self.fail(Failure::Copy { chunk: index });
                    first.get_or_insert(PumpError::Copy {
                        chunk: index,
                        source,
                    });
                }
            }
        }
        if self.state == State::Running {
            if let Err(e) = self.start_copies(engine) {
                first.get_or_insert(e);
            }
        }
        self.settle();
        match first {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Send: the next chunk to put on the network, in order of offset, once its device copy has
    /// finished; `None` when it is not ready (or the transfer is not running). Its buffer is
    /// the network's until [`Staging::handle_sent`].
    pub fn poll_send(&mut self) -> Option<Chunk> {
        if self.direction != Direction::Send || self.state != State::Running {
            return None;
        }
        let index = self.next_send;
        let Some(Slot::Copied(buffer)) = self.slot(index) else {
            return None;
        };
        self.slots[index as usize] = Slot::Network(buffer);
        self.next_send += 1;
        Some(self.chunk_at(index, buffer))
    }

    /// Send: the network finished sending chunk `index` (`ok`) or failed to.
    pub fn handle_sent(&mut self, index: u32, ok: bool) -> Result<(), StagingError> {
        if self.direction != Direction::Send {
            return Err(StagingError::Unexpected {
                chunk: index,
                what: "a send reported on a receive",
            });
        }
        self.handle_network(index, ok, "a send finished that was not started")
    }

    /// Receive: the next chunk to receive, in order, and the free bounce buffer to receive it
    /// into; `None` when every buffer is in use, every chunk is posted, or the transfer is not
    /// running. Its buffer is the network's until [`Staging::handle_received`].
    pub fn poll_recv(&mut self) -> Option<Chunk> {
        if self.direction != Direction::Recv || self.state != State::Running {
            return None;
        }
        let index = self.next_start;
        if index as usize >= self.slots.len() {
            return None;
        }
        let buffer = self.free.pop()?;
        self.slots[index as usize] = Slot::Network(buffer);
        self.next_start += 1;
        Some(self.chunk_at(index, buffer))
    }

    /// Receive: chunk `index` has arrived in its bounce buffer (`ok`), or its receive failed.
    /// The copy to the device starts at the next [`Staging::pump`].
    pub fn handle_received(&mut self, index: u32, ok: bool) -> Result<(), StagingError> {
        if self.direction != Direction::Recv {
            return Err(StagingError::Unexpected {
                chunk: index,
                what: "a receive reported on a send",
            });
        }
        self.handle_network(index, ok, "a receive finished that was not posted")
    }

    /// Stops the transfer: nothing new starts; buffers holding chunks between a copy and the
    /// network are given back now, the others when their operation reports back. No effect on
    /// a transfer that is already final or failing.
    pub fn cancel(&mut self) {
        if self.state != State::Running {
            return;
        }
        self.state = State::Cancelling;
        self.release_idle();
        self.settle();
    }

    fn handle_network(
        &mut self,
        index: u32,
        ok: bool,
        what: &'static str,
    ) -> Result<(), StagingError> {
        let Some(Slot::Network(buffer)) = self.slot(index) else {
            return Err(StagingError::Unexpected { chunk: index, what });
        };
        if !ok {
            self.drop_chunk(index, buffer);
            self.fail(Failure::Network { chunk: index });
        } else if self.state != State::Running {
            self.drop_chunk(index, buffer);
        } else {
            match self.direction {
                Direction::Send => self.finish(index, buffer),
                Direction::Recv => {
                    self.slots[index as usize] = Slot::Arrived(buffer);
                    self.arrived.push_back(index);
                }
            }
        }
        self.settle();
        Ok(())
    }

    fn start_copies<E: CopyEngine>(&mut self, engine: &mut E) -> Result<(), PumpError<E::Error>> {
        loop {
            let (index, buffer, direction) = match self.direction {
                Direction::Send => {
                    if self.next_start as usize >= self.slots.len() {
                        return Ok(());
                    }
                    let Some(buffer) = self.free.pop() else {
                        return Ok(());
                    };
                    let index = self.next_start;
                    self.next_start += 1;
                    (index, buffer, CopyDirection::DeviceToHost)
                }
                Direction::Recv => {
                    let Some(index) = self.arrived.pop_front() else {
                        return Ok(());
                    };
                    let Some(Slot::Arrived(buffer)) = self.slot(index) else {
                        return Err(PumpError::Staging(StagingError::Unexpected {
                            chunk: index,
                            what: "an arrived chunk lost its buffer",
                        }));
                    };
                    (index, buffer, CopyDirection::HostToDevice)
                }
            };
            let chunk = self.chunk_at(index, buffer);
            self.slots[index as usize] = Slot::Copying(buffer);
            if let Err(source) = engine.start(CopyOp { chunk, direction }) {
                // Never queued: the buffer is free again at once.
                self.drop_chunk(index, buffer);
                self.fail(Failure::Copy { chunk: index });
                return Err(PumpError::Copy {
                    chunk: index,
                    source,
                });
            }
        }
    }

    fn slot(&self, index: u32) -> Option<Slot> {
        self.slots.get(index as usize).copied()
    }

    fn chunk_at(&self, index: u32, buffer: BufferId) -> Chunk {
        let offset = u64::from(index) * self.chunk as u64;
        // The last chunk is what is left; every other is `chunk` long.
        let len = (self.len - offset).min(self.chunk as u64) as usize;
        Chunk {
            index,
            offset,
            len,
            buffer,
        }
    }

    /// Chunk `index` is complete; its buffer is free.
    fn finish(&mut self, index: u32, buffer: BufferId) {
        self.drop_chunk(index, buffer);
        self.done += 1;
    }

    /// Chunk `index` will not complete (cancel or failure); its buffer is free.
    fn drop_chunk(&mut self, index: u32, buffer: BufferId) {
        self.slots[index as usize] = Slot::Done;
        self.free.push(buffer);
    }

    fn fail(&mut self, failure: Failure) {
        if matches!(self.state, State::Running | State::Cancelling) {
            self.state = State::Failing(failure);
            self.release_idle();
        }
    }

    /// Gives back the buffers of chunks that no operation holds (copied but not sent, arrived
    /// but not copied).
    fn release_idle(&mut self) {
        for index in 0..self.slots.len() {
            if let Slot::Copied(b) | Slot::Arrived(b) = self.slots[index] {
                self.slots[index] = Slot::Done;
                self.free.push(b);
            }
        }
        self.arrived.clear();
    }

    /// Moves to a final state when nothing is left in flight.
    fn settle(&mut self) {
        let idle = self.free.len() == self.bounce_buffers;
        self.state = match self.state {
            State::Running if self.done as usize == self.slots.len() => State::Done,
            State::Cancelling if idle => State::Cancelled,
            State::Failing(f) if idle => State::Failed(f),
            s => s,
        };
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    //! The scheduler against a fake copy engine in host memory: the "device" is a vector, the
    //! bounce buffers are vectors, and the "network" copies between a bounce buffer and a wire
    //! vector. Copies and network operations complete in an order drawn from a seed.

    use super::*;
    use crate::rng::Rng;
    use proptest::prelude::*;

    const MIB: usize = 1 << 20;

    /// Bytes that say where they are.
    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 16) as u8)
            .collect()
    }

    /// Who holds a bounce buffer, as the fake engine and network see it.
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Holder {
        Copy(u32),
        Net(u32),
    }

    struct Fake {
        device: Vec<u8>,
        wire: Vec<u8>,
        bounce: Vec<Vec<u8>>,
        holders: Vec<Option<Holder>>,
        copies: Vec<CopyOp>,
        net: Vec<Chunk>,
        rng: Rng,
        /// Copies of these chunks fail when they complete.
        fail_copy: Option<u32>,
        /// Refuse to queue the copy of this chunk.
        refuse_copy: Option<u32>,
        copies_started: usize,
        max_copies: usize,
        sent_order: Vec<u32>,
        copied_in: Vec<u32>,
    }

    impl Fake {
        fn new(device: Vec<u8>, wire: Vec<u8>, cfg: StagingConfig, seed: u64) -> Self {
            Self {
                device,
                wire,
                bounce: vec![vec![0xEE; cfg.chunk]; cfg.bounce_buffers],
                holders: vec![None; cfg.bounce_buffers],
                copies: Vec::new(),
                net: Vec::new(),
                rng: Rng::new(seed),
                fail_copy: None,
                refuse_copy: None,
                copies_started: 0,
                max_copies: 0,
                sent_order: Vec::new(),
                copied_in: Vec::new(),
            }
        }

        fn take(&mut self, buffer: BufferId, who: Holder) {
            assert_eq!(
                self.holders[buffer.0], None,
                "{buffer:?} given to {who:?} while held"
            );
            self.holders[buffer.0] = Some(who);
        }

        fn give(&mut self, buffer: BufferId, who: Holder) {
            assert_eq!(self.holders[buffer.0], Some(who));
            self.holders[buffer.0] = None;
        }

        /// Completes one network operation at random, moving its bytes; `false` when none.
        fn complete_net(&mut self, s: &mut Staging) -> bool {
            if self.net.is_empty() {
                return false;
            }
            let c = self
                .net
                .swap_remove(self.rng.below(self.net.len() as u64) as usize);
            let range = c.offset as usize..c.offset as usize + c.len;
            self.give(c.buffer, Holder::Net(c.index));
            match s.direction() {
                Direction::Send => {
                    self.wire[range].copy_from_slice(&self.bounce[c.buffer.0][..c.len]);
                    s.handle_sent(c.index, true).unwrap();
                }
                Direction::Recv => {
                    self.bounce[c.buffer.0][..c.len].copy_from_slice(&self.wire[range]);
                    s.handle_received(c.index, true).unwrap();
                }
            }
            true
        }
    }

    impl CopyEngine for Fake {
        type Error = &'static str;

        fn start(&mut self, op: CopyOp) -> Result<(), &'static str> {
            if self.refuse_copy == Some(op.chunk.index) {
                return Err("refused");
            }
            self.take(op.chunk.buffer, Holder::Copy(op.chunk.index));
            self.copies.push(op);
            self.copies_started += 1;
            self.max_copies = self.max_copies.max(self.copies.len());
            Ok(())
        }

        fn poll_complete(&mut self) -> Option<(u32, Result<(), &'static str>)> {
            // Sometimes nothing has finished yet; otherwise any copy in flight.
            if self.copies.is_empty() || self.rng.below(4) == 0 {
                return None;
            }
            let op = self
                .copies
                .swap_remove(self.rng.below(self.copies.len() as u64) as usize);
            let c = op.chunk;
            self.give(c.buffer, Holder::Copy(c.index));
            if self.fail_copy == Some(c.index) {
                return Some((c.index, Err("copy failed")));
            }
            let range = c.offset as usize..c.offset as usize + c.len;
            match op.direction {
                CopyDirection::DeviceToHost => {
                    self.bounce[c.buffer.0][..c.len].copy_from_slice(&self.device[range])
                }
                CopyDirection::HostToDevice => {
                    self.copied_in.push(c.index);
                    self.device[range].copy_from_slice(&self.bounce[c.buffer.0][..c.len])
                }
            }
            Some((c.index, Ok(())))
        }
    }

    /// What happens to a run.
    #[derive(Debug, Clone, Copy)]
    enum Script {
        Clean,
        CancelAfter(u32),
        FailCopy(u32),
        RefuseCopy(u32),
        FailNet(u32),
    }

    struct Outcome {
        state: State,
        fake: Fake,
        pump_errors: Vec<PumpError<&'static str>>,
        /// Whether `cancel` was called while the transfer was running.
        cancelled: bool,
    }

    /// Runs a transfer to its final state (bounded: a stuck scheduler fails the test).
    fn run(
        direction: Direction,
        len: usize,
        cfg: StagingConfig,
        seed: u64,
        script: Script,
    ) -> Outcome {
        let src = pattern(len, seed as u8);
        let (device, wire) = match direction {
            Direction::Send => (src, vec![0; len]),
            Direction::Recv => (vec![0; len], src),
        };
        let mut fake = Fake::new(device, wire, cfg, seed);
        match script {
            Script::FailCopy(k) => fake.fail_copy = Some(k),
            Script::RefuseCopy(k) => fake.refuse_copy = Some(k),
            _ => {}
        }
        let mut s = Staging::new(direction, len as u64, cfg).unwrap();
        let mut pump_errors = Vec::new();
        let mut steps = 0u64;
        let mut posted_after_stop = false;
        let mut cancelled = false;
        while !s.state().is_final() {
            steps += 1;
            assert!(steps < 1_000_000, "stuck: {:?}", s.state());
            if let Err(e) = s.pump(&mut fake) {
                pump_errors.push(e);
            }
            assert!(s.buffers_in_use() <= cfg.bounce_buffers);
            let stopped = s.state() != State::Running;
            while let Some(c) = s.poll_send().or_else(|| s.poll_recv()) {
                posted_after_stop |= stopped;
                fake.take(c.buffer, Holder::Net(c.index));
                if direction == Direction::Send {
                    fake.sent_order.push(c.index);
                }
                if let Script::FailNet(k) = script {
                    if k == c.index {
                        fake.give(c.buffer, Holder::Net(c.index));
                        match direction {
                            Direction::Send => s.handle_sent(c.index, false).unwrap(),
                            Direction::Recv => s.handle_received(c.index, false).unwrap(),
                        }
                        continue;
                    }
                }
                fake.net.push(c);
            }
            if let Script::CancelAfter(k) = script {
                if s.chunks_done() >= k && s.state() == State::Running {
                    s.cancel();
                    cancelled = true;
                }
            }
            if fake.rng.below(2) == 0 {
                fake.complete_net(&mut s);
            }
        }
        assert!(
            !posted_after_stop,
            "a chunk was posted after a cancel or failure"
        );
        assert_eq!(s.buffers_in_use(), 0);
        assert!(
            fake.holders.iter().all(Option::is_none),
            "{:?}",
            fake.holders
        );
        assert!(fake.copies.is_empty() && fake.net.is_empty());
        assert!(fake.max_copies <= cfg.bounce_buffers);
        Outcome {
            state: s.state(),
            fake,
            pump_errors,
            cancelled,
        }
    }

    fn configs() -> impl Strategy<Value = StagingConfig> {
        (MIN_CHUNK..=MAX_CHUNK, 1usize..=6).prop_map(|(chunk, bounce_buffers)| StagingConfig {
            chunk,
            bounce_buffers,
        })
    }

    fn directions() -> impl Strategy<Value = Direction> {
        prop_oneof![Just(Direction::Send), Just(Direction::Recv)]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]

        /// Every byte arrives, in order on the wire, with at most N buffers in flight.
        #[test]
        fn moves_every_byte(dir in directions(), len in 0usize..16 * MIB, cfg in configs(), seed: u64) {
            let out = run(dir, len, cfg, seed, Script::Clean);
            prop_assert_eq!(out.state, State::Done);
            prop_assert!(out.pump_errors.is_empty());
            let want = pattern(len, seed as u8);
            match dir {
                Direction::Send => {
                    prop_assert!(out.fake.wire == want, "wire differs");
                    let order: Vec<u32> = (0..len.div_ceil(cfg.chunk) as u32).collect();
                    prop_assert_eq!(&out.fake.sent_order, &order);
                }
                Direction::Recv => {
                    prop_assert!(out.fake.device == want, "device differs");
                    let mut copied = out.fake.copied_in.clone();
                    copied.sort_unstable();
                    let once: Vec<u32> = (0..len.div_ceil(cfg.chunk) as u32).collect();
                    prop_assert_eq!(copied, once, "each chunk copied once");
                }
            }
        }

        /// A cancel at any point ends in Cancelled with every buffer back, and what was
        /// delivered is a correct prefix-or-subset of the data.
        #[test]
        fn cancels_mid_transfer(dir in directions(), len in MIB..12 * MIB, cfg in configs(), seed: u64, at in 0u32..8) {
            let out = run(dir, len, cfg, seed, Script::CancelAfter(at));
            let chunks = len.div_ceil(cfg.chunk) as u32;
            // The cancel lands unless every chunk finished first (possible only when `at` is
            // near the end: one pump may finish several chunks).
            if out.cancelled {
                prop_assert_eq!(out.state, State::Cancelled);
            } else {
                prop_assert_eq!(out.state, State::Done);
            }
            if at == 0 {
                prop_assert!(out.cancelled, "a cancel before anything finished always lands");
            }
            let want = pattern(len, seed as u8);
            if dir == Direction::Send {
                // Chunks sent are a prefix, in order, each with its own bytes.
                for (i, &k) in out.fake.sent_order.iter().enumerate() {
                    prop_assert_eq!(k, i as u32);
                }
            }
            let got = match dir { Direction::Send => &out.fake.wire, Direction::Recv => &out.fake.device };
            for k in 0..chunks as usize {
                let r = k * cfg.chunk..((k + 1) * cfg.chunk).min(len);
                prop_assert!(got[r.clone()] == want[r.clone()] || got[r].iter().all(|&b| b == 0),
                    "chunk {} is neither complete nor untouched", k);
            }
        }

        /// A failed copy (completed with an error, or refused) or a failed network operation
        /// fails the transfer, once everything in flight has come back.
        #[test]
        fn a_failure_fails_the_transfer(dir in directions(), len in MIB..12 * MIB, cfg in configs(), seed: u64, k in 0u32..16, kind in 0u8..3) {
            let chunks = len.div_ceil(cfg.chunk) as u32;
            let k = k % chunks;
            let script = match kind { 0 => Script::FailCopy(k), 1 => Script::RefuseCopy(k), _ => Script::FailNet(k) };
            let out = run(dir, len, cfg, seed, script);
            match script {
                Script::FailCopy(k) | Script::RefuseCopy(k) => {
                    prop_assert_eq!(out.state, State::Failed(Failure::Copy { chunk: k }));
                    prop_assert_eq!(out.pump_errors.len(), 1);
                    let is_copy_k = matches!(out.pump_errors[0], PumpError::Copy { chunk, .. } if chunk == k);
                    prop_assert!(is_copy_k, "{:?}", out.pump_errors);
                }
                _ => {
                    prop_assert_eq!(out.state, State::Failed(Failure::Network { chunk: k }));
                    prop_assert!(out.pump_errors.is_empty());
                }
            }
        }
    }

    #[test]
    fn pipelines_copies_with_the_network() {
        // Send, 4 chunks, 2 buffers: two copies start at once; a third only when a chunk has
        // been sent and its buffer came back.
        let cfg = StagingConfig {
            chunk: MIB,
            bounce_buffers: 2,
        };
        let mut s = Staging::new(Direction::Send, 4 * MIB as u64, cfg).unwrap();
        let mut fake = Fake::new(pattern(4 * MIB, 1), vec![0; 4 * MIB], cfg, 7);
        struct Manual<'a>(&'a mut Fake, Vec<u32>);
        impl CopyEngine for Manual<'_> {
            type Error = &'static str;
            fn start(&mut self, op: CopyOp) -> Result<(), &'static str> {
                self.0.start(op)
            }
            fn poll_complete(&mut self) -> Option<(u32, Result<(), &'static str>)> {
                let k = self.1.pop()?;
                let i = self.0.copies.iter().position(|c| c.chunk.index == k)?;
                let op = self.0.copies.remove(i);
                self.0.give(op.chunk.buffer, Holder::Copy(k));
                Some((k, Ok(())))
            }
        }
        s.pump(&mut Manual(&mut fake, vec![])).unwrap();
        assert_eq!(fake.copies_started, 2);
        assert_eq!(s.buffers_in_use(), 2);
        assert_eq!(s.poll_send(), None, "chunk 0 not copied yet");
        // Chunk 1's copy finishes first: it must wait for chunk 0.
        s.pump(&mut Manual(&mut fake, vec![1])).unwrap();
        assert_eq!(s.poll_send(), None);
        s.pump(&mut Manual(&mut fake, vec![0])).unwrap();
        let c0 = s.poll_send().unwrap();
        let c1 = s.poll_send().unwrap();
        assert_eq!((c0.index, c0.offset, c0.len), (0, 0, MIB));
        assert_eq!((c1.index, c1.offset), (1, MIB as u64));
        assert_ne!(c0.buffer, c1.buffer);
        assert_eq!(fake.copies_started, 2, "no buffer free yet");
        s.handle_sent(1, true).unwrap();
        s.pump(&mut Manual(&mut fake, vec![])).unwrap();
        assert_eq!(fake.copies_started, 3);
        assert_eq!(
            fake.copies[0].chunk.buffer, c1.buffer,
            "chunk 2 reuses chunk 1's buffer"
        );
        // Reporting the same chunk twice is a typed error, not a panic.
        assert_eq!(
            s.handle_sent(1, true),
            Err(StagingError::Unexpected {
                chunk: 1,
                what: "a send finished that was not started"
            })
        );
        assert!(s.handle_received(0, true).is_err());
    }

    #[test]
    fn refuses_bad_shapes_and_handles_empty_transfers() {
        for (chunk, bounce_buffers) in [(MIB - 1, 2), (MAX_CHUNK + 1, 2), (MIB, 0)] {
            let cfg = StagingConfig {
                chunk,
                bounce_buffers,
            };
            assert!(matches!(
                Staging::new(Direction::Send, 10, cfg),
                Err(StagingError::Config(_))
            ));
        }
        let s = Staging::new(Direction::Recv, 0, StagingConfig::default()).unwrap();
        assert_eq!(s.state(), State::Done);
        assert_eq!(s.chunk_count(), 0);
        let s = Staging::new(
            Direction::Send,
            5 * MIB as u64 + 1,
            StagingConfig::default(),
        )
        .unwrap();
        assert_eq!(s.chunk_count(), 3);
    }
}
