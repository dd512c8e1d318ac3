//! Memory that UCX may read or write while an operation is in flight.
//!
//! Operations take their buffers by value and hand them back with the result, so a buffer can
//! never be freed, moved out of or touched by Rust code while UCX uses it. Dropping an
//! operation's future parks the buffer with the worker until UCX reports completion.
//!
//! The traits are `unsafe` to implement: UCX is handed a raw pointer at the start of an
//! operation and uses it until the operation completes, while the Rust value holding the
//! buffer may be moved around (into a future, into the worker's parking lot). Only types whose
//! bytes live on the heap, at an address that does not change when the value moves, qualify.
//! Other crates of shardcx forbid unsafe code, so every buffer type lives here.

use std::alloc::Layout;
use std::ptr::NonNull;

use crate::rma::MemHandle;

/// Where a buffer's bytes live, as UCX's `ucs_memory_type_t` sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MemoryType {
    /// Ordinary host memory.
    Host,
    /// CUDA device memory.
    Cuda,
}

/// A buffer UCX may read from for the whole life of an operation.
///
/// # Safety
///
/// Implementors promise that:
/// - `stable_ptr()` points to `bytes_init()` readable bytes (it may dangle only when
///   `bytes_init()` is 0), of the memory type `memory_type()`;
/// - the pointer and length stay valid and unchanged while the value is moved, until the value
///   is dropped or mutably borrowed (the bytes live on the heap or in static memory);
/// - nothing else writes those bytes while the value is owned by an operation.
pub unsafe trait IoBuf: Unpin + 'static {
    /// Address of the first byte.
    fn stable_ptr(&self) -> *const u8;
    /// Number of bytes UCX may read.
    fn bytes_init(&self) -> usize;
    /// Where the bytes live.
    fn memory_type(&self) -> MemoryType {
        MemoryType::Host
    }
    /// The UCX memory registration covering these bytes, when there is one.
    fn mem_handle(&self) -> Option<&MemHandle> {
        None
    }
}

/// A buffer UCX may write into for the whole life of an operation.
///
/// # Safety
///
/// As for [`IoBuf`], and in addition `stable_mut_ptr()` points to `bytes_total()` writable bytes
/// that no Rust reference aliases while an operation owns the value.
pub unsafe trait IoBufMut: IoBuf {
    /// Address of the first writable byte.
    fn stable_mut_ptr(&mut self) -> *mut u8;
    /// Number of bytes UCX may write.
    fn bytes_total(&self) -> usize;
}

// SAFETY: a Vec's bytes live on the heap (or dangle when the length is zero); moving the Vec
// moves only its (ptr, len, capacity) triple, so the pointer stays valid until the Vec is
// dropped or mutated, which the owning operation prevents.
unsafe impl IoBuf for Vec<u8> {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len()
    }
}

// SAFETY: as for `IoBuf`; the writable region is `[0, len)`, which is initialised memory
// owned by the Vec. To receive into a Vec, size it first (`vec![0; n]`).
unsafe impl IoBufMut for Vec<u8> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    fn bytes_total(&self) -> usize {
        self.len()
    }
}

// SAFETY: a boxed slice's bytes live on the heap; moving the box does not move them.
unsafe impl IoBuf for Box<[u8]> {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len()
    }
}

// SAFETY: as above; the whole slice is initialised and writable.
unsafe impl IoBufMut for Box<[u8]> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    fn bytes_total(&self) -> usize {
        self.len()
    }
}

// SAFETY: static bytes never move and are never freed; they are immutable, so nothing writes
// them.
unsafe impl IoBuf for &'static [u8] {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len()
    }
}

// SAFETY: an `Rc<[u8]>`'s bytes live in its heap allocation, which does not move when the Rc
// (a pointer) moves and is freed only when the last clone goes; the operation holds a clone,
// so the bytes stay valid until it is dropped. `[u8]` behind an Rc is immutable: no safe code
// can write it while a second clone (the operation's) exists (`Rc::get_mut` then returns
// `None`), so nothing writes the bytes UCX reads.
unsafe impl IoBuf for std::rc::Rc<[u8]> {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len()
    }
}

/// A buffer to send, of any kind a send takes by value: a vector (moved), shared immutable
/// bytes (an `Rc<[u8]>`: the same bytes sent many times without a copy, e.g. a bandwidth
/// loop's payload), or a slice of a registered region (a memory pool's block, whose
/// registration UCX finds in its cache instead of registering the buffer).
#[derive(Debug)]
pub enum SendBuf {
    /// A vector.
    Vec(Vec<u8>),
    /// Shared immutable bytes.
    Shared(std::rc::Rc<[u8]>),
    /// A slice of a registered region.
    Slice(crate::rma::MemSlice),
    /// Elements of a shared vector of plain numbers, sent as their bytes.
    Elems(SharedElems),
}

impl SendBuf {
    /// The bytes, when they can be read in place (not for a slice of a region a remote key
    /// was packed for: see [`crate::MemSlice::as_slice`]).
    #[inline]
    pub fn as_slice(&self) -> Option<&[u8]> {
        match self {
            SendBuf::Vec(v) => Some(v),
            SendBuf::Shared(b) => Some(b),
            SendBuf::Slice(s) => s.as_slice(),
            SendBuf::Elems(e) => Some(e.as_slice()),
        }
    }

    /// Length in bytes.
    #[inline]
    pub fn len(&self) -> usize {
        match self {
            SendBuf::Vec(v) => v.len(),
            SendBuf::Shared(b) => b.len(),
            SendBuf::Slice(s) => s.len(),
            SendBuf::Elems(e) => e.len,
        }
    }

    /// Whether there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl From<Vec<u8>> for SendBuf {
    fn from(v: Vec<u8>) -> SendBuf {
        SendBuf::Vec(v)
    }
}

impl From<std::rc::Rc<[u8]>> for SendBuf {
    fn from(b: std::rc::Rc<[u8]>) -> SendBuf {
        SendBuf::Shared(b)
    }
}

impl From<crate::rma::MemSlice> for SendBuf {
    fn from(s: crate::rma::MemSlice) -> SendBuf {
        SendBuf::Slice(s)
    }
}

impl From<SharedElems> for SendBuf {
    fn from(e: SharedElems) -> SendBuf {
        SendBuf::Elems(e)
    }
}

/// A vector of plain numbers (`bytemuck::Pod`: no padding, no pointers, no interior
/// mutability) seen as its bytes. Implemented here only, for `Vec<T>`.
trait PodVec {
    fn bytes(&self) -> &[u8];
}

impl<T: bytemuck::Pod> PodVec for Vec<T> {
    fn bytes(&self) -> &[u8] {
        bytemuck::cast_slice(self)
    }
}

/// A range of elements of a shared vector of plain numbers (`bytemuck::Pod`: the built-in
/// integers and floats, arrays of them), sent as their bytes in memory, from where they are:
/// no copy into a buffer of the send's own. The send holds a clone of the `Rc` until UCX is
/// done with the bytes, so the vector cannot be changed meanwhile (`Rc::get_mut` and
/// `Rc::try_unwrap` fail until then); a caller that wants it back waits for the `Rc` to be
/// its alone again, and can be told when with [`SharedElems::on_release`]. The bytes are the
/// elements' in the machine's byte order.
pub struct SharedElems {
    // Dropped first (fields drop in declaration order): the guard below is dropped once the
    // vector is no longer held here.
    vec: std::rc::Rc<dyn PodVec>,
    start: usize,
    len: usize,
    guard: Option<Box<dyn std::any::Any>>,
}

impl SharedElems {
    /// Elements `elems` of `vec`, or `None` when the range is not within it.
    pub fn new<T: bytemuck::Pod>(
        vec: std::rc::Rc<Vec<T>>,
        elems: std::ops::Range<usize>,
    ) -> Option<SharedElems> {
        if elems.start > elems.end || elems.end > vec.len() {
            return None;
        }
        let size = std::mem::size_of::<T>();
        Some(SharedElems {
            start: elems.start * size,
            len: (elems.end - elems.start) * size,
            vec,
            guard: None,
        })
    }

    /// Has `guard` dropped right after the send let go of the vector (its `Rc` clone
    /// dropped): a value whose `Drop` wakes the task that waits for the vector back.
    pub fn on_release(mut self, guard: impl std::any::Any) -> SharedElems {
        self.guard = Some(Box::new(guard));
        self
    }

    /// The bytes sent.
    pub fn as_slice(&self) -> &[u8] {
        &self.vec.bytes()[self.start..self.start + self.len]
    }
}

impl std::fmt::Debug for SharedElems {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedElems")
            .field("start", &self.start)
            .field("len", &self.len)
            .field("guard", &self.guard.is_some())
            .finish()
    }
}

// SAFETY: each variant is an `IoBuf` (above, and `MemSlice` in `rma`); the enum only forwards
// to the one it holds, which it owns and never swaps while an operation owns the enum.
unsafe impl IoBuf for SendBuf {
    fn stable_ptr(&self) -> *const u8 {
        match self {
            SendBuf::Vec(v) => v.stable_ptr(),
            SendBuf::Shared(b) => b.stable_ptr(),
            SendBuf::Slice(s) => s.stable_ptr(),
            SendBuf::Elems(e) => e.stable_ptr(),
        }
    }
    fn bytes_init(&self) -> usize {
        match self {
            SendBuf::Vec(v) => v.bytes_init(),
            SendBuf::Shared(b) => b.bytes_init(),
            SendBuf::Slice(s) => s.bytes_init(),
            SendBuf::Elems(e) => e.bytes_init(),
        }
    }
    fn memory_type(&self) -> MemoryType {
        match self {
            SendBuf::Vec(v) => v.memory_type(),
            SendBuf::Shared(b) => b.memory_type(),
            SendBuf::Slice(s) => s.memory_type(),
            SendBuf::Elems(e) => e.memory_type(),
        }
    }
    fn mem_handle(&self) -> Option<&MemHandle> {
        match self {
            SendBuf::Slice(s) => s.mem_handle(),
            _ => None,
        }
    }
}

// SAFETY: the bytes are those of a `Vec<T: Pod>` behind an `Rc`: they live in the vector's heap
// allocation, which does not move when the `Rc` moves and is freed only when the last clone
// goes (this value holds one). No safe code can write them while this clone exists: a shared
// `Vec` is reached only through `&Vec` (`Rc::get_mut` and `Rc::try_unwrap` fail while another
// clone lives), and `bytemuck::Pod` types have no interior mutability (its contract). The
// range was checked against the vector's length in `SharedElems::new`.
unsafe impl IoBuf for SharedElems {
    fn stable_ptr(&self) -> *const u8 {
        self.as_slice().as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len
    }
}

/// A zeroed heap buffer with a chosen alignment (cache line, page), for transfers that want
/// aligned memory.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes aligned to `align` (a power of two).
    pub fn zeroed(len: usize, align: usize) -> crate::Result<Self> {
        let layout = Layout::from_size_align(len.max(1), align)
            .map_err(|_| crate::Error::InvalidArgument("alignment must be a power of two"))?;
        // SAFETY: `layout` has a non-zero size (`len.max(1)`), as `alloc_zeroed` requires.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(crate::Error::NoMemory)?;
        Ok(Self { ptr, len, layout })
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised (zeroed, then written) bytes we own.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The alignment the buffer was allocated with.
    pub fn align(&self) -> usize {
        self.layout.align()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `alloc_zeroed` with exactly this layout and is freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .field("align", &self.layout.align())
            .finish()
    }
}

// SAFETY: `AlignedBuf` owns a heap allocation that it frees only on drop; no other handle to it
// exists, so sending it to another thread moves sole ownership.
unsafe impl Send for AlignedBuf {}

// SAFETY: the heap bytes do not move when the `AlignedBuf` value moves.
unsafe impl IoBuf for AlignedBuf {
    fn stable_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len
    }
}

// SAFETY: as above; all `len` bytes are initialised and exclusively owned.
unsafe impl IoBufMut for AlignedBuf {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    fn bytes_total(&self) -> usize {
        self.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_buffers_are_aligned_and_zeroed() {
        let mut b = AlignedBuf::zeroed(1000, 4096).expect("alloc");
        assert_eq!(b.stable_ptr() as usize % 4096, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice()[999] = 7;
        assert_eq!(b.as_slice()[999], 7);
        assert!(AlignedBuf::zeroed(10, 3).is_err());
        let empty = AlignedBuf::zeroed(0, 64).expect("alloc");
        assert!(empty.is_empty());
    }

    #[test]
    fn shared_elements_are_sent_from_the_vector_and_release_it() {
        use std::cell::Cell;
        use std::rc::Rc;
        struct Flag(Rc<Cell<bool>>);
        impl Drop for Flag {
            fn drop(&mut self) {
                self.0.set(true);
            }
        }
        let v = Rc::new(vec![1.0f32, 2.0, 3.0, 4.0]);
        assert!(SharedElems::new(v.clone(), 3..5).is_none());
        let released = Rc::new(Cell::new(false));
        let e = SharedElems::new(v.clone(), 1..3)
            .expect("in range")
            .on_release(Flag(released.clone()));
        let buf = SendBuf::from(e);
        assert_eq!(buf.len(), 8);
        let mut want = 2.0f32.to_ne_bytes().to_vec();
        want.extend_from_slice(&3.0f32.to_ne_bytes());
        assert_eq!(buf.as_slice(), Some(&want[..]));
        // Read where the vector holds them: no copy.
        assert_eq!(buf.stable_ptr(), v.as_ptr().wrapping_add(1).cast::<u8>());
        assert_eq!(Rc::strong_count(&v), 2);
        drop(buf);
        assert!(released.get());
        assert_eq!(
            Rc::try_unwrap(v).expect("ours again"),
            vec![1.0, 2.0, 3.0, 4.0]
        );
    }

    #[test]
    fn vec_pointer_survives_moves() {
        let v = vec![1u8; 100];
        let p = v.stable_ptr();
        let boxed: Box<dyn std::any::Any> = Box::new(v);
        let v = boxed.downcast::<Vec<u8>>().expect("vec");
        assert_eq!(v.stable_ptr(), p);
    }
}
