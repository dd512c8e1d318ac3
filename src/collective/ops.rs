//! The operations, as methods of [`Communicator`].
//!
//! Every operation is called on every rank of the communicator, in the same order, with its
//! own deadline (`timeout`): it returns the same kind of result on every rank, or a
//! [`CollectiveError`] naming the cause and the rank. Counts must agree where MPI requires it
//! (a rank that receives a message of the wrong length fails with
//! [`CollectiveError::Mismatch`] and aborts the operation on the others).

use std::borrow::Cow;
use std::time::Duration;

use super::algorithm;
use super::comm::{Communicator, Group, Op};
use super::element::{decode_into_in_turns, encode_in_turns, Element, Operator};
use super::error::CollectiveError;

impl Communicator {
    /// Returns once every rank has called it.
    pub async fn barrier(&mut self, timeout: Duration) -> Result<(), CollectiveError> {
        self.operation("barrier", timeout, async |op: &Op| {
            algorithm::barrier(&Group::all(op)).await
        })
        .await
    }

    /// Broadcast: `data` of rank `root` is copied into `data` of every rank (the same length
    /// on every rank). Built-in numbers are sent from and received into `data` itself
    /// ([`Element::as_wire_mut`]), so a broadcast that fails may leave a receiving rank's
    /// `data` partly overwritten.
    pub async fn broadcast<T: Element>(
        &mut self,
        root: usize,
        data: &mut [T],
        timeout: Duration,
    ) -> Result<(), CollectiveError> {
        self.operation("broadcast", timeout, async |op: &Op| {
            check_root(op, root)?;
            let len = data.len() * T::SIZE;
            if let Some(wire) = T::as_wire_mut(data).filter(|w| w.len() == len && T::SIZE > 0) {
                // The caller's buffer is its own wire form: sent from and received into it,
                // with no copy to encode it or to decode from.
                return algorithm::broadcast(&Group::all(op), root, wire).await;
            }
            let mut bytes = encode_in_turns(data).await;
            algorithm::broadcast(&Group::all(op), root, &mut bytes).await?;
            if op.rank() != root {
                // Straight over the caller's buffer: no vector of elements between.
                decode_result(op, &bytes, data, root, "element size").await?;
            }
            Ok(())
        })
        .await
    }

    /// Reduce: the element-wise reduction of every rank's `data` with `o` (in rank order when
    /// `o` does not commute), `Some` on rank `root`, `None` elsewhere.
    pub async fn reduce<T: Element, O: Operator<T> + ?Sized>(
        &mut self,
        root: usize,
        data: &[T],
        o: &O,
        timeout: Duration,
    ) -> Result<Option<Vec<T>>, CollectiveError> {
        self.operation("reduce", timeout, async |op: &Op| {
            check_root(op, root)?;
            algorithm::reduce(&Group::all(op), root, data.to_vec(), o).await
        })
        .await
    }

    /// All-reduce: the element-wise reduction of every rank's `data` with `o` (in rank order
    /// when `o` does not commute), on every rank.
    pub async fn all_reduce<T: Element, O: Operator<T> + ?Sized>(
        &mut self,
        data: &[T],
        o: &O,
        timeout: Duration,
    ) -> Result<Vec<T>, CollectiveError> {
        self.operation("all_reduce", timeout, async |op: &Op| {
            algorithm::all_reduce(&Group::all(op), Cow::Borrowed(data), o).await
        })
        .await
    }

    /// All-gather: every rank's `data` (the same length on every rank), concatenated in rank
    /// order, on every rank.
    pub async fn all_gather<T: Element>(
        &mut self,
        data: &[T],
        timeout: Duration,
    ) -> Result<Vec<T>, CollectiveError> {
        self.operation("all_gather", timeout, async |op: &Op| {
            let all = algorithm::all_gather(&Group::all(op), encode_in_turns(data).await).await?;
            op.decode(&all, op.rank(), "element size").await
        })
        .await
    }

    /// Reduce-scatter (MPI's `Reduce_scatter_block`): `data` is `size()` blocks of equal
    /// length; rank `i` gets the reduction of everyone's block `i`.
    pub async fn reduce_scatter<T: Element, O: Operator<T> + ?Sized>(
        &mut self,
        data: &[T],
        o: &O,
        timeout: Duration,
    ) -> Result<Vec<T>, CollectiveError> {
        self.operation("reduce_scatter", timeout, async |op: &Op| {
            check_blocks(op, data.len())?;
            algorithm::reduce_scatter(&Group::all(op), data.to_vec(), o).await
        })
        .await
    }

    /// Gather: every rank's `data` (the same length on every rank), concatenated in rank
    /// order, `Some` on rank `root`, `None` elsewhere.
    pub async fn gather<T: Element>(
        &mut self,
        root: usize,
        data: &[T],
        timeout: Duration,
    ) -> Result<Option<Vec<T>>, CollectiveError> {
        self.operation("gather", timeout, async |op: &Op| {
            check_root(op, root)?;
            let all = algorithm::gather(&Group::all(op), root, encode_in_turns(data).await).await?;
            match all {
                Some(b) => op.decode(&b, op.rank(), "element size").await.map(Some),
                None => Ok(None),
            }
        })
        .await
    }

    /// Scatter: `data` of rank `root` is `size()` blocks of equal length; rank `i` gets block
    /// `i`. Other ranks' `data` is not read (pass `&[]`).
    pub async fn scatter<T: Element>(
        &mut self,
        root: usize,
        data: &[T],
        timeout: Duration,
    ) -> Result<Vec<T>, CollectiveError> {
        self.operation("scatter", timeout, async |op: &Op| {
            check_root(op, root)?;
            let bytes = if op.rank() == root {
                check_blocks(op, data.len())?;
                Some(encode_in_turns(data).await)
            } else {
                None
            };
            let mine = algorithm::scatter(&Group::all(op), root, bytes.as_deref(), 0).await?;
            op.decode(
                &mine,
                root,
                "a block that is not a whole number of elements",
            )
            .await
        })
        .await
    }

    /// All-to-all: `data` is `size()` blocks of equal length (the same on every rank); block
    /// `j` goes to rank `j`, and block `i` of the result came from rank `i`.
    pub async fn all_to_all<T: Element>(
        &mut self,
        data: &[T],
        timeout: Duration,
    ) -> Result<Vec<T>, CollectiveError> {
        self.operation("all_to_all", timeout, async |op: &Op| {
            check_blocks(op, data.len())?;
            let all = algorithm::all_to_all(&Group::all(op), &encode_in_turns(data).await).await?;
            op.decode(&all, op.rank(), "element size").await
        })
        .await
    }

    /// Inclusive scan: on rank `r`, the reduction of the `data` of ranks `0..=r`, in rank
    /// order.
    pub async fn scan<T: Element, O: Operator<T> + ?Sized>(
        &mut self,
        data: &[T],
        o: &O,
        timeout: Duration,
    ) -> Result<Vec<T>, CollectiveError> {
        self.operation("scan", timeout, async |op: &Op| {
            let r = algorithm::scan(&Group::all(op), data.to_vec(), o, false).await?;
            r.ok_or_else(|| op.invalid("no result"))
        })
        .await
    }

    /// Exclusive scan: on rank `r > 0`, the reduction of the `data` of ranks `0..r`, in rank
    /// order; `None` on rank 0.
    pub async fn exclusive_scan<T: Element, O: Operator<T> + ?Sized>(
        &mut self,
        data: &[T],
        o: &O,
        timeout: Duration,
    ) -> Result<Option<Vec<T>>, CollectiveError> {
        self.operation("exclusive_scan", timeout, async |op: &Op| {
            algorithm::scan(&Group::all(op), data.to_vec(), o, true).await
        })
        .await
    }
}

/// Vector variants: every rank's block may have its own length.
impl Communicator {
    /// Gather of blocks of any length: every rank's `data`, in rank order, `Some` on rank
    /// `root`, `None` elsewhere.
    pub async fn gatherv<T: Element>(
        &mut self,
        root: usize,
        data: &[T],
        timeout: Duration,
    ) -> Result<Option<Vec<Vec<T>>>, CollectiveError> {
        self.operation("gatherv", timeout, async |op: &Op| {
            check_root(op, root)?;
            let mine = encode_in_turns(data).await;
            match algorithm::gatherv(&Group::all(op), root, mine).await? {
                Some(blocks) => Ok(Some(decode_blocks(op, blocks).await?)),
                None => Ok(None),
            }
        })
        .await
    }

    /// Scatter of blocks of any length: rank `root` passes one block per rank (`size()` of
    /// them), rank `i` gets block `i`. Other ranks' `blocks` are not read (pass `&[]`).
    pub async fn scatterv<T: Element>(
        &mut self,
        root: usize,
        blocks: &[Vec<T>],
        timeout: Duration,
    ) -> Result<Vec<T>, CollectiveError> {
        self.operation("scatterv", timeout, async |op: &Op| {
            check_root(op, root)?;
            let bytes = if op.rank() == root {
                check_count(op, blocks.len())?;
                let v = encode_blocks(blocks).await;
                Some(v)
            } else {
                None
            };
            let mine = algorithm::scatterv(&Group::all(op), root, bytes).await?;
            op.decode(
                &mine,
                root,
                "a block that is not a whole number of elements",
            )
            .await
        })
        .await
    }

    /// All-gather of blocks of any length: every rank's `data`, in rank order, on every rank.
    pub async fn all_gatherv<T: Element>(
        &mut self,
        data: &[T],
        timeout: Duration,
    ) -> Result<Vec<Vec<T>>, CollectiveError> {
        self.operation("all_gatherv", timeout, async |op: &Op| {
            let mine = encode_in_turns(data).await;
            let blocks = algorithm::all_gatherv(&Group::all(op), mine).await?;
            decode_blocks(op, blocks).await
        })
        .await
    }

    /// All-to-all of blocks of any length: `blocks[j]` (one per rank, `size()` of them) goes
    /// to rank `j`; block `i` of the result came from rank `i`.
    pub async fn all_to_allv<T: Element>(
        &mut self,
        blocks: &[Vec<T>],
        timeout: Duration,
    ) -> Result<Vec<Vec<T>>, CollectiveError> {
        self.operation("all_to_allv", timeout, async |op: &Op| {
            check_count(op, blocks.len())?;
            let bytes = encode_blocks(blocks).await;
            let got = algorithm::all_to_allv(&Group::all(op), bytes).await?;
            decode_blocks(op, got).await
        })
        .await
    }
}

/// In-place variants, as MPI's `MPI_IN_PLACE`: the input is read from `data` and the result
/// left there, for the operations (and, for gather and scatter, the ranks) where MPI has
/// them. The same algorithms run as for the variants that return a new vector; a rank whose
/// `data` has the wrong length fails with [`CollectiveError::InvalidArgument`] (or
/// [`CollectiveError::Mismatch`] when only the other ranks' lengths tell), and the others with
/// [`CollectiveError::Aborted`]. `data` is written only when the operation succeeds.
///
/// ```no_run
/// # use std::time::Duration;
/// # use shardcx::collective::{CollectiveError, Communicator, Sum};
/// # async fn demo(mut world: Communicator) -> Result<(), CollectiveError> {
/// let t = Duration::from_secs(5);
/// let (r, p) = (world.rank(), world.size());
/// let mut v = vec![r as u64, 1];
/// world.all_reduce_in_place(&mut v, &Sum, t).await?;
/// assert_eq!(v[1], p as u64);
/// // One block per rank, this rank's at `r`; afterwards every block is filled.
/// let mut all = vec![0u32; p];
/// all[r] = r as u32 * 10;
/// world.all_gather_in_place(&mut all, t).await?;
/// assert_eq!(all[p - 1], (p as u32 - 1) * 10);
/// # Ok(()) }
/// ```
impl Communicator {
    /// [`Communicator::all_reduce`] in place: `data` holds this rank's input, then the
    /// reduction of every rank's.
    pub async fn all_reduce_in_place<T: Element, O: Operator<T> + ?Sized>(
        &mut self,
        data: &mut [T],
        o: &O,
        timeout: Duration,
    ) -> Result<(), CollectiveError> {
        self.operation("all_reduce", timeout, async |op: &Op| {
            let r = algorithm::all_reduce(&Group::all(op), Cow::Borrowed(&*data), o).await?;
            copy_result(op, data, &r)
        })
        .await
    }

    /// [`Communicator::reduce`] in place: on rank `root`, `data` holds its input, then the
    /// reduction; other ranks' `data` is their input, left as it is.
    pub async fn reduce_in_place<T: Element, O: Operator<T> + ?Sized>(
        &mut self,
        root: usize,
        data: &mut [T],
        o: &O,
        timeout: Duration,
    ) -> Result<(), CollectiveError> {
        self.operation("reduce", timeout, async |op: &Op| {
            check_root(op, root)?;
            match algorithm::reduce(&Group::all(op), root, data.to_vec(), o).await? {
                Some(r) => copy_result(op, data, &r),
                None => Ok(()),
            }
        })
        .await
    }

    /// [`Communicator::all_gather`] in place: `data` is `size()` blocks of equal length, this
    /// rank's contribution in block `rank()` (the others are not read); afterwards block `i`
    /// holds rank `i`'s.
    pub async fn all_gather_in_place<T: Element>(
        &mut self,
        data: &mut [T],
        timeout: Duration,
    ) -> Result<(), CollectiveError> {
        self.operation("all_gather", timeout, async |op: &Op| {
            check_blocks(op, data.len())?;
            let b = data.len() / op.size();
            let mine = encode_in_turns(&data[op.rank() * b..(op.rank() + 1) * b]).await;
            let all = algorithm::all_gather(&Group::all(op), mine).await?;
            decode_result(op, &all, data, op.rank(), "element size").await
        })
        .await
    }

    /// [`Communicator::reduce_scatter`] in place (MPI's `Reduce_scatter_block` with
    /// `MPI_IN_PLACE`): `data` is `size()` blocks of equal length; afterwards its first block
    /// holds the reduction of everyone's block `rank()` (the other blocks are left as they
    /// were).
    pub async fn reduce_scatter_in_place<T: Element, O: Operator<T> + ?Sized>(
        &mut self,
        data: &mut [T],
        o: &O,
        timeout: Duration,
    ) -> Result<(), CollectiveError> {
        self.operation("reduce_scatter", timeout, async |op: &Op| {
            check_blocks(op, data.len())?;
            let r = algorithm::reduce_scatter(&Group::all(op), data.to_vec(), o).await?;
            let n = r.len().min(data.len());
            copy_result(op, &mut data[..n], &r)
        })
        .await
    }

    /// [`Communicator::gather`] in place at the root: on rank `root`, `data` is `size()` blocks
    /// of equal length with its own contribution in block `root` (the others are not read),
    /// and afterwards block `i` holds rank `i`'s; other ranks pass their block, left as it is.
    pub async fn gather_in_place<T: Element>(
        &mut self,
        root: usize,
        data: &mut [T],
        timeout: Duration,
    ) -> Result<(), CollectiveError> {
        self.operation("gather", timeout, async |op: &Op| {
            check_root(op, root)?;
            let mine = if op.rank() == root {
                check_blocks(op, data.len())?;
                let b = data.len() / op.size();
                encode_in_turns(&data[root * b..(root + 1) * b]).await
            } else {
                encode_in_turns(data).await
            };
            match algorithm::gather(&Group::all(op), root, mine).await? {
                Some(all) => decode_result(op, &all, data, op.rank(), "element size").await,
                None => Ok(()),
            }
        })
        .await
    }

    /// [`Communicator::scatter`] in place at the root: on rank `root`, `data` is `size()`
    /// blocks of equal length, left as it is (its own block stays where it is); on the other
    /// ranks `data` is one block's length and receives its block.
    pub async fn scatter_in_place<T: Element>(
        &mut self,
        root: usize,
        data: &mut [T],
        timeout: Duration,
    ) -> Result<(), CollectiveError> {
        self.operation("scatter", timeout, async |op: &Op| {
            check_root(op, root)?;
            if op.rank() == root {
                check_blocks(op, data.len())?;
                let bytes = encode_in_turns(data).await;
                algorithm::scatter(&Group::all(op), root, Some(&bytes), 0).await?;
                return Ok(());
            }
            let mine = algorithm::scatter(&Group::all(op), root, None, 0).await?;
            decode_result(op, &mine, data, root, "a block of another length").await
        })
        .await
    }

    /// [`Communicator::all_to_all`] in place: `data` is `size()` blocks of equal length (the
    /// same on every rank), block `j` for rank `j`; afterwards block `i` holds what rank `i`
    /// sent this rank.
    pub async fn all_to_all_in_place<T: Element>(
        &mut self,
        data: &mut [T],
        timeout: Duration,
    ) -> Result<(), CollectiveError> {
        self.operation("all_to_all", timeout, async |op: &Op| {
            check_blocks(op, data.len())?;
            let bytes = encode_in_turns(data).await;
            let all = algorithm::all_to_all(&Group::all(op), &bytes).await?;
            decode_result(op, &all, data, op.rank(), "element size").await
        })
        .await
    }

    /// [`Communicator::scan`] in place: on rank `r`, `data` holds its input, then the
    /// reduction of the inputs of ranks `0..=r`, in rank order.
    pub async fn scan_in_place<T: Element, O: Operator<T> + ?Sized>(
        &mut self,
        data: &mut [T],
        o: &O,
        timeout: Duration,
    ) -> Result<(), CollectiveError> {
        self.operation("scan", timeout, async |op: &Op| {
            match algorithm::scan(&Group::all(op), data.to_vec(), o, false).await? {
                Some(r) => copy_result(op, data, &r),
                None => Err(op.invalid("no result")),
            }
        })
        .await
    }

    /// [`Communicator::exclusive_scan`] in place: on rank `r > 0`, `data` holds its input,
    /// then the reduction of the inputs of ranks `0..r`, in rank order; rank 0's `data` is
    /// left as it is (MPI leaves it undefined).
    pub async fn exclusive_scan_in_place<T: Element, O: Operator<T> + ?Sized>(
        &mut self,
        data: &mut [T],
        o: &O,
        timeout: Duration,
    ) -> Result<(), CollectiveError> {
        self.operation(
            "exclusive_scan",
            timeout,
            async |op: &Op| match algorithm::scan(&Group::all(op), data.to_vec(), o, true).await? {
                Some(r) => copy_result(op, data, &r),
                None => Ok(()),
            },
        )
        .await
    }
}

impl Communicator {
    /// Runs `body` as this communicator's next operation, `name`, within `timeout` (see
    /// [`Op::run`]), and remembers the algorithm it chose.
    async fn operation<R>(
        &mut self,
        name: &'static str,
        timeout: Duration,
        body: impl AsyncFnOnce(&Op) -> Result<R, CollectiveError>,
    ) -> Result<R, CollectiveError> {
        let op = self.begin(name, timeout);
        let out = op.run(std::pin::pin!(body(&op))).await;
        self.finish(&op);
        out
    }
}

/// The bytes of each block.
async fn encode_blocks<T: Element>(blocks: &[Vec<T>]) -> Vec<Vec<u8>> {
    let mut out = Vec::with_capacity(blocks.len());
    for b in blocks {
        out.push(encode_in_turns(b).await);
    }
    out
}

/// The elements of each rank's block (block `i` from rank `i`).
async fn decode_blocks<T: Element>(
    op: &Op,
    blocks: Vec<Vec<u8>>,
) -> Result<Vec<Vec<T>>, CollectiveError> {
    let mut out = Vec::with_capacity(blocks.len());
    for (i, b) in blocks.iter().enumerate() {
        out.push(
            op.decode(b, i, "a block that is not a whole number of elements")
                .await?,
        );
    }
    Ok(out)
}

/// Writes `result` over `data` (the same length: every algorithm returns as many elements as
/// it was given).
fn copy_result<T: Element>(op: &Op, data: &mut [T], result: &[T]) -> Result<(), CollectiveError> {
    if result.len() != data.len() {
        return Err(op.invalid(format!(
            "{} result elements for a buffer of {}",
            result.len(),
            data.len()
        )));
    }
    data.copy_from_slice(result);
    Ok(())
}

/// Decodes `bytes` (from rank `from`) over `data`, or a mismatch with it (`what`) when they
/// are not exactly `data.len()` elements.
async fn decode_result<T: Element>(
    op: &Op,
    bytes: &[u8],
    data: &mut [T],
    from: usize,
    what: &str,
) -> Result<(), CollectiveError> {
    if decode_into_in_turns(bytes, data).await {
        Ok(())
    } else {
        Err(op.mismatch(from, what))
    }
}

fn check_count(op: &Op, count: usize) -> Result<(), CollectiveError> {
    if count != op.size() {
        return Err(op.invalid(format!("{count} blocks for {} ranks", op.size())));
    }
    Ok(())
}

fn check_root(op: &Op, root: usize) -> Result<(), CollectiveError> {
    if root >= op.size() {
        return Err(op.invalid(format!("root {root} of {} ranks", op.size())));
    }
    Ok(())
}

fn check_blocks(op: &Op, len: usize) -> Result<(), CollectiveError> {
    if len % op.size() != 0 {
        return Err(op.invalid(format!("{len} elements are not {} equal blocks", op.size())));
    }
    Ok(())
}
