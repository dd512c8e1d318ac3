//! Element types and reduction operators.
//!
//! An [`Element`] is a fixed-size value that travels as little-endian bytes: the built-in
//! numbers (`u8`, `i8`, `u16`, `i16`, `i32`, `i64`, `u32`, `u64`, `f32`, `f64`, and the 16-bit
//! floats `half::f16` and `half::bf16`), arrays of elements, or a type of the application's
//! (a 2×2 matrix, a pair of values) that says how it is written and read. A reduction
//! [`Operator`] combines two elements and says whether it commutes: a commutative operator may
//! be applied in any order (the ring algorithms use that), a non-commutative one is applied in
//! rank order, `x0 ∘ x1 ∘ … ∘ x(p-1)`, always with the lower ranks' value on the left.

use std::fmt::Debug;
use std::ops::Range;
use std::rc::Rc;

use crate::SharedElems;

/// A value collectives can move and reduce: `SIZE` bytes on the wire, little-endian.
///
/// Implement it for an application type to move it or reduce it with a [`UserOp`]; reading
/// must accept any `SIZE` bytes (the bytes come from another rank; a value that makes no sense
/// must still not panic).
pub trait Element: Copy + Debug + Send + 'static {
    /// Bytes of one element on the wire.
    const SIZE: usize;
    /// Writes the element into `out` (exactly `SIZE` bytes).
    fn write_le(&self, out: &mut [u8]);
    /// Reads an element from `bytes` (exactly `SIZE` bytes).
    fn read_le(bytes: &[u8]) -> Self;

    /// Appends the elements in `bytes` (a whole number of `SIZE`-byte elements; a shorter
    /// tail is ignored) to `out`. The default reads them one by one with
    /// [`Element::read_le`]; the built-in numbers read fixed-size chunks, which the compiler
    /// turns into plain vector loads (a collective decodes every byte it receives this way).
    fn extend_from_le(bytes: &[u8], out: &mut Vec<Self>) {
        if Self::SIZE > 0 {
            out.extend(bytes.chunks_exact(Self::SIZE).map(Self::read_le));
        }
    }

    /// Writes `xs` into `out` (`xs.len() * SIZE` bytes; extra bytes are left alone). The
    /// default writes them one by one with [`Element::write_le`]; the built-in numbers write
    /// fixed-size chunks.
    fn write_all_le(xs: &[Self], out: &mut [u8]) {
        if Self::SIZE > 0 {
            for (x, o) in xs.iter().zip(out.chunks_exact_mut(Self::SIZE)) {
                x.write_le(o);
            }
        }
    }

    /// `xs` as their bytes on the wire, in place, when the elements' memory already is that
    /// (the built-in numbers, and arrays of them, on a little-endian machine): a broadcast
    /// then sends and receives the caller's buffer itself, with no pass to encode it or to
    /// decode into it. The default, `None`, has them encoded and decoded. An implementation
    /// returns `Some` only with exactly `xs.len() * SIZE` bytes that are what
    /// [`Element::write_le`] writes and [`Element::read_le`] reads.
    fn as_wire_mut(xs: &mut [Self]) -> Option<&mut [u8]> {
        let _ = xs;
        None
    }

    /// Elements `elems` of the shared vector `xs` as a buffer a send reads from where they are
    /// ([`SharedElems`]: the send holds a clone of `xs` until UCX is done with the bytes),
    /// when the elements are plain numbers whose memory is their wire form (the built-in
    /// numbers on a little-endian machine); `None`, the default, has them encoded into a
    /// buffer of the send's own. The two-rank all-reduce sends its result vector this way and
    /// waits for it back ([`SharedElems::on_release`]) before it writes the vector again. An
    /// implementation returns `Some` only with the bytes [`Element::write_le`] writes, and
    /// `None` when `elems` is not within `xs`.
    fn share_wire(xs: &Rc<Vec<Self>>, elems: Range<usize>) -> Option<SharedElems> {
        let _ = (xs, elems);
        None
    }
}

/// Numbers the built-in operators ([`Sum`], [`Prod`], [`Min`], [`Max`]) work on. Integer sums
/// and products wrap on overflow (MPI leaves them undefined; a panic in a collective is not an
/// option); float minimum and maximum return the other operand when one is NaN.
pub trait Number: Element + PartialOrd {
    /// `a + b`.
    fn add(self, b: Self) -> Self;
    /// `a × b`.
    fn mul(self, b: Self) -> Self;
}

/// A reduction operator on elements of type `T`.
///
/// `combine(a, b)` is `a ∘ b`, where `a` always holds the lower ranks' contribution. An
/// operator that is not [commutative](Operator::is_commutative) is applied in rank order only;
/// every operator must be associative.
pub trait Operator<T> {
    /// `a ∘ b` (`a` from lower ranks than `b`).
    fn combine(&self, a: &T, b: &T) -> T;
    /// Whether `a ∘ b == b ∘ a` for all elements.
    fn is_commutative(&self) -> bool;
}

/// Sum of numbers (commutative; integers wrap).
#[derive(Debug, Clone, Copy, Default)]
pub struct Sum;
/// Product of numbers (commutative; integers wrap).
#[derive(Debug, Clone, Copy, Default)]
pub struct Prod;
/// Minimum (commutative).
#[derive(Debug, Clone, Copy, Default)]
pub struct Min;
/// Maximum (commutative).
#[derive(Debug, Clone, Copy, Default)]
pub struct Max;

/// An operator of the application's: a function and whether it commutes.
///
/// ```
/// use shardcx::collective::{Operator, UserOp};
/// // 2×2 integer matrices, row-major: the product does not commute.
/// let mul = UserOp::new(false, |a: &[i64; 4], b: &[i64; 4]| {
///     [a[0] * b[0] + a[1] * b[2], a[0] * b[1] + a[1] * b[3],
///      a[2] * b[0] + a[3] * b[2], a[2] * b[1] + a[3] * b[3]]
/// });
/// assert!(!mul.is_commutative());
/// assert_eq!(mul.combine(&[1, 1, 0, 1], &[1, 0, 1, 1]), [2, 1, 1, 1]);
/// ```
#[derive(Clone, Copy)]
pub struct UserOp<F> {
    f: F,
    commutative: bool,
}

impl<F> UserOp<F> {
    /// The operator `a ∘ b = f(a, b)`; `commutative` says whether `f(a, b) == f(b, a)` (when it
    /// is false, reductions are applied in rank order).
    pub fn new(commutative: bool, f: F) -> Self {
        Self { f, commutative }
    }
}

impl<F> Debug for UserOp<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UserOp")
            .field("commutative", &self.commutative)
            .finish_non_exhaustive()
    }
}

impl<T, F: Fn(&T, &T) -> T> Operator<T> for UserOp<F> {
    fn combine(&self, a: &T, b: &T) -> T {
        (self.f)(a, b)
    }

    fn is_commutative(&self) -> bool {
        self.commutative
    }
}

impl<T: Number> Operator<T> for Sum {
    fn combine(&self, a: &T, b: &T) -> T {
        a.add(*b)
    }

    fn is_commutative(&self) -> bool {
        true
    }
}

impl<T: Number> Operator<T> for Prod {
    fn combine(&self, a: &T, b: &T) -> T {
        a.mul(*b)
    }

    fn is_commutative(&self) -> bool {
        true
    }
}

impl<T: Number> Operator<T> for Min {
    fn combine(&self, a: &T, b: &T) -> T {
        // `b < a` is false when either is NaN: then `a`, unless `a` is the NaN.
        if b < a || a.partial_cmp(a).is_none() {
            *b
        } else {
            *a
        }
    }

    fn is_commutative(&self) -> bool {
        true
    }
}

impl<T: Number> Operator<T> for Max {
    fn combine(&self, a: &T, b: &T) -> T {
        if b > a || a.partial_cmp(a).is_none() {
            *b
        } else {
            *a
        }
    }

    fn is_commutative(&self) -> bool {
        true
    }
}

macro_rules! element {
    ($($t:ty),*) => {$(
        impl Element for $t {
            const SIZE: usize = std::mem::size_of::<$t>();
            fn write_le(&self, out: &mut [u8]) {
                out.copy_from_slice(&self.to_le_bytes());
            }
            fn read_le(bytes: &[u8]) -> Self {
                let mut b = [0u8; std::mem::size_of::<$t>()];
                b.copy_from_slice(bytes);
                <$t>::from_le_bytes(b)
            }
            fn extend_from_le(bytes: &[u8], out: &mut Vec<Self>) {
                const N: usize = std::mem::size_of::<$t>();
                out.extend(bytes.chunks_exact(N).map(|c| {
                    let mut b = [0u8; N];
                    b.copy_from_slice(c);
                    <$t>::from_le_bytes(b)
                }));
            }
            fn write_all_le(xs: &[Self], out: &mut [u8]) {
                const N: usize = std::mem::size_of::<$t>();
                for (x, c) in xs.iter().zip(out.chunks_exact_mut(N)) {
                    c.copy_from_slice(&x.to_le_bytes());
                }
            }
            fn as_wire_mut(xs: &mut [Self]) -> Option<&mut [u8]> {
                // Little-endian memory is the wire form (`to_le_bytes`), with no padding.
                cfg!(target_endian = "little").then(|| bytemuck::cast_slice_mut(xs))
            }
            fn share_wire(xs: &Rc<Vec<Self>>, elems: Range<usize>) -> Option<SharedElems> {
                // As `as_wire_mut`: the memory is the wire form.
                if cfg!(target_endian = "big") {
                    return None;
                }
                SharedElems::new(xs.clone(), elems)
            }
        }
    )*};
}

macro_rules! integer {
    ($($t:ty),*) => {$(
        impl Number for $t {
            fn add(self, b: Self) -> Self { self.wrapping_add(b) }
            fn mul(self, b: Self) -> Self { self.wrapping_mul(b) }
        }
    )*};
}

macro_rules! float {
    ($($t:ty),*) => {$(
        impl Number for $t {
            fn add(self, b: Self) -> Self { self + b }
            fn mul(self, b: Self) -> Self { self * b }
        }
    )*};
}

element!(u8, i8, u16, i16, i32, i64, u32, u64, f32, f64);
integer!(u8, i8, u16, i16, i32, i64, u32, u64);
float!(f32, f64);

// 16-bit floats from the `half` crate: sums and products computed in `f32` and rounded back,
// as `half` does.
element!(half::f16, half::bf16);
float!(half::f16, half::bf16);

/// Arrays of elements are elements (a 2×2 matrix as `[i64; 4]`, a vector of three floats).
impl<T: Element, const N: usize> Element for [T; N] {
    const SIZE: usize = T::SIZE * N;
    fn write_le(&self, out: &mut [u8]) {
        for (x, o) in self.iter().zip(out.chunks_exact_mut(T::SIZE)) {
            x.write_le(o);
        }
    }
    fn read_le(bytes: &[u8]) -> Self {
        std::array::from_fn(|i| T::read_le(&bytes[i * T::SIZE..(i + 1) * T::SIZE]))
    }
    fn as_wire_mut(xs: &mut [Self]) -> Option<&mut [u8]> {
        // An array's wire form is its elements' in turn, as its memory is.
        T::as_wire_mut(xs.as_flattened_mut())
    }
}

/// The bytes of `xs`, `T::SIZE` each.
pub(crate) fn encode<T: Element>(xs: &[T]) -> Vec<u8> {
    let mut out = vec![0u8; xs.len() * T::SIZE];
    T::write_all_le(xs, &mut out);
    out
}

/// The elements in `bytes`, or `None` when its length is not a multiple of `T::SIZE`.
pub(crate) fn decode<T: Element>(bytes: &[u8]) -> Option<Vec<T>> {
    if T::SIZE == 0 {
        return bytes.is_empty().then(Vec::new);
    }
    if bytes.len() % T::SIZE != 0 {
        return None;
    }
    let mut out = Vec::with_capacity(bytes.len() / T::SIZE);
    T::extend_from_le(bytes, &mut out);
    Some(out)
}

/// `acc[i] = left[i] ∘ acc[i]` (`left` from lower ranks) or `acc[i] = acc[i] ∘ right[i]`.
pub(crate) fn combine_into<T, O: Operator<T> + ?Sized>(
    op: &O,
    acc: &mut [T],
    other: &[T],
    other_is_lower: bool,
) {
    for (a, b) in acc.iter_mut().zip(other) {
        *a = if other_is_lower {
            op.combine(b, a)
        } else {
            op.combine(a, b)
        };
    }
}

/// Elements handled between two looks at whether the shard has other work (its progress
/// driver, heartbeats): a reduction of megabytes must not hold the shard for its whole length.
const TURN: usize = 16 << 10;

/// [`encode`], letting the shard's other tasks run every [`TURN`] elements.
pub(crate) async fn encode_in_turns<T: Element>(xs: &[T]) -> Vec<u8> {
    if xs.len() <= TURN || T::SIZE == 0 {
        return encode(xs);
    }
    let mut out = vec![0u8; xs.len() * T::SIZE];
    for (xs, out) in xs.chunks(TURN).zip(out.chunks_mut(TURN * T::SIZE)) {
        T::write_all_le(xs, out);
        glommio::yield_if_needed().await;
    }
    out
}

/// Writes the bytes of `xs` into `out` (at least `xs.len() * T::SIZE` bytes; the rest is left
/// alone), letting the shard's other tasks run every [`TURN`] elements.
pub(crate) async fn encode_into_in_turns<T: Element>(xs: &[T], out: &mut [u8]) {
    if T::SIZE == 0 {
        return;
    }
    for (xs, out) in xs.chunks(TURN).zip(out.chunks_mut(TURN * T::SIZE)) {
        T::write_all_le(xs, out);
        if xs.len() == TURN {
            glommio::yield_if_needed().await;
        }
    }
}

/// The elements in `bytes` written over `out`, or `false` (and `out` untouched) when `bytes`
/// is not exactly `out.len()` elements; the shard's other tasks run every [`TURN`] elements.
pub(crate) async fn decode_into_in_turns<T: Element>(bytes: &[u8], out: &mut [T]) -> bool {
    if bytes.len() != out.len() * T::SIZE {
        return false;
    }
    if T::SIZE == 0 {
        return true;
    }
    for (out, bytes) in out.chunks_mut(TURN).zip(bytes.chunks(TURN * T::SIZE)) {
        for (x, b) in out.iter_mut().zip(bytes.chunks_exact(T::SIZE)) {
            *x = T::read_le(b);
        }
        if out.len() == TURN {
            glommio::yield_if_needed().await;
        }
    }
    true
}

/// [`decode`], letting the shard's other tasks run every [`TURN`] elements.
pub(crate) async fn decode_in_turns<T: Element>(bytes: &[u8]) -> Option<Vec<T>> {
    if bytes.len() <= TURN * T::SIZE || T::SIZE == 0 {
        return decode(bytes);
    }
    if bytes.len() % T::SIZE != 0 {
        return None;
    }
    let mut out = Vec::with_capacity(bytes.len() / T::SIZE);
    extend_from_le_in_turns(bytes, &mut out).await;
    Some(out)
}

/// Appends the elements in `bytes` to `out` ([`Element::extend_from_le`]), letting the shard's
/// other tasks run every [`TURN`] elements.
pub(crate) async fn extend_from_le_in_turns<T: Element>(bytes: &[u8], out: &mut Vec<T>) {
    if T::SIZE == 0 {
        return;
    }
    for chunk in bytes.chunks(TURN * T::SIZE) {
        T::extend_from_le(chunk, out);
        if chunk.len() == TURN * T::SIZE {
            glommio::yield_if_needed().await;
        }
    }
}

/// [`combine_into`] with `other` still in its wire bytes (`acc.len()` elements of them): read
/// [`TURN`] elements at a time into one scratch vector that stays in cache, instead of decoding
/// the whole message into a vector of its own first (a copy and, for a large one, fresh pages
/// to fault in); the shard's other tasks run between turns.
pub(crate) async fn combine_le_in_turns<T: Element, O: Operator<T> + ?Sized>(
    op: &O,
    acc: &mut [T],
    other: &[u8],
    other_is_lower: bool,
) {
    if T::SIZE == 0 {
        return;
    }
    let mut scratch = Vec::with_capacity(acc.len().min(TURN));
    for (acc, other) in acc.chunks_mut(TURN).zip(other.chunks(TURN * T::SIZE)) {
        scratch.clear();
        T::extend_from_le(other, &mut scratch);
        combine_into(op, acc, &scratch, other_is_lower);
        if acc.len() == TURN {
            glommio::yield_if_needed().await;
        }
    }
}

/// Appends `mine ∘ other` (or `other ∘ mine` when `other_is_lower`) element by element to
/// `out`, `other` still in its wire bytes (`mine.len()` elements of them): one pass that reads
/// both and writes the result, instead of copying `mine` first and combining into the copy.
/// The shard's other tasks run between turns of [`TURN`] elements.
pub(crate) async fn combine_le_append_in_turns<T: Element, O: Operator<T> + ?Sized>(
    op: &O,
    mine: &[T],
    other: &[u8],
    other_is_lower: bool,
    out: &mut Vec<T>,
) {
    out.reserve(mine.len());
    if T::SIZE == 0 {
        out.extend_from_slice(mine);
        return;
    }
    for (mine, other) in mine.chunks(TURN).zip(other.chunks(TURN * T::SIZE)) {
        // Read straight from the bytes: no scratch vector to copy them into first.
        let other = other.chunks_exact(T::SIZE).map(T::read_le);
        if other_is_lower {
            out.extend(mine.iter().zip(other).map(|(a, b)| op.combine(&b, a)));
        } else {
            out.extend(mine.iter().zip(other).map(|(a, b)| op.combine(a, &b)));
        }
        if mine.len() == TURN {
            glommio::yield_if_needed().await;
        }
    }
}

/// [`combine_into`], letting the shard's other tasks run every [`TURN`] elements.
pub(crate) async fn combine_in_turns<T, O: Operator<T> + ?Sized>(
    op: &O,
    acc: &mut [T],
    other: &[T],
    other_is_lower: bool,
) {
    for (acc, other) in acc.chunks_mut(TURN).zip(other.chunks(TURN)) {
        combine_into(op, acc, other, other_is_lower);
        if acc.len() == TURN {
            glommio::yield_if_needed().await;
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;

    #[test]
    fn built_in_numbers_and_their_arrays_are_their_own_wire_form() {
        let mut xs = [0x0102_0304u32, 0xA0B0_C0D0];
        let want = encode(&xs);
        assert_eq!(u32::as_wire_mut(&mut xs).as_deref(), Some(&want[..]));
        // Written through the bytes, read back as elements.
        u32::as_wire_mut(&mut xs).unwrap()[0] = 0xFF;
        assert_eq!(xs[0], 0x0102_03FF);
        let mut m = [[1i64, -2, 3, -4], [5, 6, 7, 8]];
        let want = encode(&m);
        assert_eq!(<[i64; 4]>::as_wire_mut(&mut m).as_deref(), Some(&want[..]));
        let mut h = [half::f16::from_f32(1.5), half::f16::from_f32(-2.0)];
        let want = encode(&h);
        assert_eq!(half::f16::as_wire_mut(&mut h).as_deref(), Some(&want[..]));
    }

    #[test]
    fn elements_round_trip_through_their_bytes() {
        let xs = [1.5f64, -0.0, f64::MAX, f64::MIN_POSITIVE];
        assert_eq!(decode::<f64>(&encode(&xs)).unwrap(), xs);
        let ms = [[1i64, -2, 3, i64::MIN], [0, 0, 0, 7]];
        assert_eq!(decode::<[i64; 4]>(&encode(&ms)).unwrap(), ms);
        assert_eq!(encode(&[0x0102_0304u32]), vec![4, 3, 2, 1]);
        assert!(decode::<u32>(&[1, 2, 3]).is_none());
    }

    #[test]
    fn the_numbers_chunked_reads_and_writes_agree_with_one_by_one() {
        fn check<T: Element + PartialEq>(xs: &[T]) {
            let mut one_by_one = vec![0u8; xs.len() * T::SIZE];
            for (x, o) in xs.iter().zip(one_by_one.chunks_exact_mut(T::SIZE)) {
                x.write_le(o);
            }
            assert_eq!(encode(xs), one_by_one);
            let back: Vec<T> = one_by_one.chunks_exact(T::SIZE).map(T::read_le).collect();
            assert!(decode::<T>(&one_by_one).unwrap() == back);
            assert!(back == xs);
        }
        check(
            &(0..1000u32)
                .map(|i| i.wrapping_mul(2_654_435_761))
                .collect::<Vec<_>>(),
        );
        check(&(0..999).map(|i| i as f32 * -1.25).collect::<Vec<_>>());
        check(&(0..77).map(|i| i64::MIN + i).collect::<Vec<_>>());
        check(&[half::bf16::from_f32(3.5), half::bf16::from_f32(-0.25)]);
        check(&[[1u16, 2, 3], [4, 5, 6]]);
    }

    #[test]
    fn combining_from_wire_bytes_is_combining_the_decoded_elements() {
        // Over several turns, with a partial last one, both operand orders.
        let n = TURN * 2 + 123;
        let acc: Vec<i64> = (0..n as i64).collect();
        let other: Vec<i64> = (0..n as i64).map(|i| i * 3 - 7).collect();
        let op = |a: &i64, b: &i64| a * 2 + b; // not commutative
        struct F<G>(G);
        impl<G: Fn(&i64, &i64) -> i64> Operator<i64> for F<G> {
            fn combine(&self, a: &i64, b: &i64) -> i64 {
                (self.0)(a, b)
            }
            fn is_commutative(&self) -> bool {
                false
            }
        }
        for lower in [true, false] {
            let mut want = acc.clone();
            combine_into(&F(op), &mut want, &other, lower);
            let (acc, other) = (acc.clone(), encode(&other));
            // On an executor: the turns yield to glommio.
            let got = glommio::LocalExecutorBuilder::default()
                .io_memory(64 << 10)
                .spawn(move || async move {
                    let mut got = acc;
                    combine_le_in_turns(&F(op), &mut got, &other, lower).await;
                    got
                })
                .unwrap()
                .join()
                .unwrap();
            assert_eq!(got, want, "lower: {lower}");
        }
    }

    #[test]
    fn half_floats() {
        use half::{bf16, f16};
        let xs = [f16::from_f32(1.5), f16::from_f32(-2.0)];
        assert_eq!(decode::<f16>(&encode(&xs)).unwrap(), xs);
        assert_eq!(Sum.combine(&xs[0], &xs[1]), f16::from_f32(-0.5));
        assert_eq!(
            Max.combine(&bf16::from_f32(3.0), &bf16::from_f32(4.0)),
            bf16::from_f32(4.0)
        );
        assert_eq!(
            Prod.combine(&bf16::from_f32(3.0), &bf16::from_f32(4.0)),
            bf16::from_f32(12.0)
        );
    }

    #[test]
    fn built_in_operators() {
        assert_eq!(Sum.combine(&u8::MAX, &2), 1);
        assert_eq!(Prod.combine(&-3i32, &4), -12);
        assert_eq!(Min.combine(&2.0f32, &-1.0), -1.0);
        assert_eq!(Max.combine(&2u64, &9), 9);
        assert_eq!(Min.combine(&f64::NAN, &1.0), 1.0);
        assert_eq!(Max.combine(&1.0f64, &f64::NAN), 1.0);
        let mut acc = [1i64, 2];
        combine_into(
            &UserOp::new(false, |a: &i64, b: &i64| a * 10 + b),
            &mut acc,
            &[3, 4],
            true,
        );
        assert_eq!(acc, [31, 42]);
    }
}
