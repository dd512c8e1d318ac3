//! Registered memory, remote keys, and put/get.
//!
//! A warning that shapes shardcx's design: over TCP and shared memory, UCX does not enforce
//! remote keys. A peer holding any rkey of this process can write anywhere in it, and unmapping
//! revokes nothing. shardcx therefore carries put/get as checked messages by default and uses
//! native RMA only in an explicit "trusted cluster" mode; this module is the native layer.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::ffi::c_void;
use std::future::Future;
use std::pin::Pin;
use std::ptr;
use std::rc::Rc;
use std::task::{Context as TaskContext, Poll};

use ucx1_sys as sys;

use crate::buf::{IoBuf, IoBufMut};
use crate::context::{Context, ContextInner};
use crate::endpoint::{Endpoint, EpInner};
use crate::ffi;
use crate::request::{self, CbKind, InFlight, ParamExtra, Posted};
use crate::status::{check, Error, Result};
use crate::tag::{finish, park};

/// Memory registered with UCX (`ucp_mem_h`): owned memory that was mapped, or memory UCX
/// allocated. `!Send`, `!Sync`; unmapped on drop.
///
/// Remote peers may write this memory at any time through a remote key, so it is never exposed
/// as a Rust slice: copy in and out with [`MemHandle::write_at`] and [`MemHandle::read_at`].
pub struct MemHandle {
    memh: sys::ucp_mem_h,
    addr: *mut u8,
    len: usize,
    /// The mapped buffer when the memory is ours; dropped after unmapping.
    owned: Option<Box<dyn Any>>,
    /// Ranges handed out as [`MemSlice`]s: start → end. Slices never overlap.
    leases: RefCell<BTreeMap<usize, usize>>,
    /// Set once a remote key was packed: peers may then write the memory at any time, so no
    /// Rust reference to it is handed out any more.
    exported: Cell<bool>,
    context: Rc<ContextInner>,
}

/// An exclusive lease on `[offset, offset + len)` (non-empty) of a registered region: a buffer operations
/// can own (it implements [`IoBufMut`] and carries the region's registration). Leases of one
/// region never overlap; dropping the slice ends the lease.
pub struct MemSlice {
    region: Rc<MemHandle>,
    offset: usize,
    len: usize,
    /// Run when the lease ends (a memory pool returns the range to its allocator).
    release: Option<Box<dyn FnOnce()>>,
}

/// A packed remote key: bytes to send to a peer, who unpacks them on an endpoint to this
/// process. Plain bytes: `Send`, `Sync`.
#[derive(Clone, PartialEq, Eq)]
pub struct PackedRkey {
    bytes: Vec<u8>,
}

struct RkeyInner {
    rkey: sys::ucp_rkey_h,
    // Declared last: the endpoint outlives the key (ucp.h requires it).
    _ep: Rc<EpInner>,
}

/// An unpacked remote key (`ucp_rkey_h`), bound to the endpoint it was unpacked on.
pub struct RemoteKey {
    inner: Rc<RkeyInner>,
}

impl MemHandle {
    /// Register `buf` with UCX. The handle owns the buffer until it is dropped.
    pub fn map<B: IoBufMut>(context: &Context, mut buf: B) -> Result<Self> {
        let addr = buf.stable_mut_ptr();
        let len = buf.bytes_total();
        if len == 0 {
            return Err(Error::InvalidArgument("cannot register an empty buffer"));
        }
        let memh = mem_map(&context.inner, addr.cast(), len, 0)?;
        Ok(Self {
            memh,
            addr,
            len,
            owned: Some(Box::new(buf)),
            leases: RefCell::new(BTreeMap::new()),
            exported: Cell::new(false),
            context: context.inner.clone(),
        })
    }

    /// Let UCX allocate and register `len` bytes.
    pub fn allocate(context: &Context, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument("cannot allocate an empty region"));
        }
        let memh = mem_map(
            &context.inner,
            ptr::null_mut(),
            len,
            ffi::UCP_MEM_MAP_ALLOCATE,
        )?;
        // SAFETY: plain data with an enum field (`mem_type`) that UCX writes only when asked;
        // we do not ask, and zero is the declared `UCS_MEMORY_TYPE_HOST` anyway.
        let mut attr: sys::ucp_mem_attr_t = unsafe { std::mem::zeroed() };
        attr.field_mask = ffi::UCP_MEM_ATTR_FIELD_ADDRESS | ffi::UCP_MEM_ATTR_FIELD_LENGTH;
        // SAFETY: ucp.h (`ucp_mem_query`): live memory handle, attributes with their mask.
        if let Err(e) = check(unsafe { ffi::ucp_mem_query(memh, &mut attr) }) {
            // SAFETY: unmap the handle we just created, once.
            unsafe { ffi::ucp_mem_unmap(context.inner.handle, memh) };
            return Err(e);
        }
        Ok(Self {
            memh,
            addr: attr.address.cast(),
            len: (attr.length as usize).min(len),
            owned: None,
            leases: RefCell::new(BTreeMap::new()),
            exported: Cell::new(false),
            context: context.inner.clone(),
        })
    }

    /// Address of the region, as a remote peer uses it with the remote key.
    pub fn address(&self) -> u64 {
        self.addr as u64
    }

    /// Length of the region in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty (never: empty regions are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Lease `[offset, offset + len)` of the region as an owned buffer. Fails if the range
    /// is empty, outside the region or overlaps a live lease. While leased, the range is
    /// reached only through the slice: the region's `read_at`/`write_at` refuse it.
    pub fn slice(self: &Rc<Self>, offset: usize, len: usize) -> Result<MemSlice> {
        let end = offset
            .checked_add(len)
            .ok_or(Error::InvalidArgument("offset overflows"))?;
        if end > self.len {
            return Err(Error::InvalidArgument("slice past the end of the region"));
        }
        if len == 0 {
            return Err(Error::InvalidArgument("empty slice"));
        }
        if self.overlaps_lease(offset, end) {
            return Err(Error::InvalidArgument("slice overlaps a live slice"));
        }
        let mut leases = self.leases.borrow_mut();
        leases.insert(offset, end);
        drop(leases);
        Ok(MemSlice {
            region: self.clone(),
            offset,
            len,
            release: None,
        })
    }

    /// Whether `[start, end)` (non-empty) overlaps a live lease.
    fn overlaps_lease(&self, start: usize, end: usize) -> bool {
        let leases = self.leases.borrow();
        let before = leases
            .range(..=start)
            .next_back()
            .is_some_and(|(_, &e)| e > start);
        let after = leases.range(start..).next().is_some_and(|(&s, _)| s < end);
        before || after
    }

    /// Number of live [`MemSlice`] leases.
    pub fn leased(&self) -> usize {
        self.leases.borrow().len()
    }

    /// Whether a remote key was packed for this region (see [`MemSlice::as_slice`]).
    pub fn is_exported(&self) -> bool {
        self.exported.get()
    }

    /// Copy `data` into the region at `offset`.
    pub fn write_at(&self, offset: usize, data: &[u8]) -> Result<()> {
        let end = offset
            .checked_add(data.len())
            .ok_or(Error::InvalidArgument("offset overflows"))?;
        if end > self.len {
            return Err(Error::InvalidArgument("write past the end of the region"));
        }
        if !data.is_empty() && self.overlaps_lease(offset, end) {
            return Err(Error::InvalidArgument("range is leased to a slice"));
        }
        // SAFETY: `[offset, end)` lies inside the registered region, which stays mapped and
        // allocated while `self` lives; raw copies are used because remote peers may write the
        // region concurrently, so no Rust reference to it is ever formed.
        unsafe { ptr::copy(data.as_ptr(), self.addr.add(offset), data.len()) };
        Ok(())
    }

    /// Copy bytes of the region at `offset` into `out`.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        let end = offset
            .checked_add(out.len())
            .ok_or(Error::InvalidArgument("offset overflows"))?;
        if end > self.len {
            return Err(Error::InvalidArgument("read past the end of the region"));
        }
        if !out.is_empty() && self.overlaps_lease(offset, end) {
            return Err(Error::InvalidArgument("range is leased to a slice"));
        }
        // SAFETY: as in `write_at`.
        unsafe { ptr::copy(self.addr.add(offset), out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// Pack a remote key for this region, to send to a peer.
    pub fn pack_rkey(&self) -> Result<PackedRkey> {
        self.exported.set(true);
        let mut buf: *mut c_void = ptr::null_mut();
        let mut size: sys::size_t = 0;
        // SAFETY: ucp.h (`ucp_rkey_pack`): live context and memory handle; on success `buf`
        // holds `size` bytes to release with `ucp_rkey_buffer_release`, done after copying.
        check(unsafe { ffi::ucp_rkey_pack(self.context.handle, self.memh, &mut buf, &mut size) })?;
        if buf.is_null() {
            return Err(Error::NoMemory);
        }
        // SAFETY: `buf` holds `size` readable bytes (see above).
        let bytes = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), size as usize) }.to_vec();
        // SAFETY: releases the packed buffer once.
        unsafe { sys::ucp_rkey_buffer_release(buf) };
        Ok(PackedRkey { bytes })
    }
}

fn mem_map(
    ctx: &ContextInner,
    addr: *mut c_void,
    len: usize,
    flags: u32,
) -> Result<sys::ucp_mem_h> {
    let mut mask = ffi::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
        | ffi::UCP_MEM_MAP_PARAM_FIELD_LENGTH
        | ffi::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
    if flags != 0 {
        mask |= ffi::UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    }
    let params = sys::ucp_mem_map_params_t {
        field_mask: mask,
        address: addr,
        length: len as sys::size_t,
        flags,
        prot: 0,
        memory_type: sys::ucs_memory_type::UCS_MEMORY_TYPE_HOST,
    };
    let mut memh = ptr::null_mut();
    // SAFETY: ucp.h (`ucp_mem_map`): live context; `addr` is either NULL with
    // UCP_MEM_MAP_ALLOCATE or `len` bytes of host memory owned by the caller for the life of
    // the handle; on success a handle to release with `ucp_mem_unmap`.
    check(unsafe { ffi::ucp_mem_map(ctx.handle, &params, &mut memh) })?;
    if memh.is_null() {
        return Err(Error::NoMemory);
    }
    Ok(memh)
}

impl MemSlice {
    /// Offset of the slice in its region.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the slice is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Run `release` when the lease ends: when the slice is dropped, or, if an operation that
    /// owned it was cancelled, once UCX has completed that operation (then from inside
    /// [`crate::Worker::progress`]: `release` must not call into the worker). A memory pool uses
    /// this to take the range back only when UCX is done with it. A panic in `release` is
    /// caught and ignored. Replaces any earlier hook.
    pub fn on_release(mut self, release: impl FnOnce() + 'static) -> Self {
        self.release = Some(Box::new(release));
        self
    }

    /// The region this slice leases from.
    pub fn region(&self) -> &Rc<MemHandle> {
        &self.region
    }

    /// The bytes, when no remote key was ever packed for the region (otherwise a peer could
    /// write them while the reference lives; use [`MemSlice::read_at`]).
    pub fn as_slice(&self) -> Option<&[u8]> {
        if self.region.exported.get() {
            return None;
        }
        // SAFETY: the lease makes `[offset, offset + len)` exclusively ours (no other slice
        // overlaps, the region's own `write_at`/`read_at` are raw copies that form no
        // reference); the region stays mapped while `self.region` lives; no remote key exists,
        // so no peer can write it; `&self` prevents a concurrent `&mut` through this slice.
        Some(unsafe { std::slice::from_raw_parts(self.region.addr.add(self.offset), self.len) })
    }

    /// The bytes, writable, under the same condition as [`MemSlice::as_slice`].
    pub fn as_mut_slice(&mut self) -> Option<&mut [u8]> {
        if self.region.exported.get() {
            return None;
        }
        // SAFETY: as in `as_slice`, and `&mut self` makes the access exclusive.
        Some(unsafe { std::slice::from_raw_parts_mut(self.region.addr.add(self.offset), self.len) })
    }

    /// Copy bytes of the slice at `offset` into `out`.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        let end = offset
            .checked_add(out.len())
            .ok_or(Error::InvalidArgument("offset overflows"))?;
        if end > self.len {
            return Err(Error::InvalidArgument("read past the end of the slice"));
        }
        // SAFETY: `[offset, end)` lies in this slice, which lies in the mapped region; the
        // lease makes the range ours and no reference to it exists while `&self` is borrowed
        // here (a `&mut` from `as_mut_slice` would need `&mut self`).
        unsafe {
            std::ptr::copy(self.stable_ptr().add(offset), out.as_mut_ptr(), out.len());
        }
        Ok(())
    }

    /// Copy `data` into the slice at `offset`.
    pub fn write_at(&mut self, offset: usize, data: &[u8]) -> Result<()> {
        let end = offset
            .checked_add(data.len())
            .ok_or(Error::InvalidArgument("offset overflows"))?;
        if end > self.len {
            return Err(Error::InvalidArgument("write past the end of the slice"));
        }
        let dst = self.stable_mut_ptr();
        // SAFETY: as in `read_at`, with `&mut self` making the access exclusive.
        unsafe { std::ptr::copy(data.as_ptr(), dst.add(offset), data.len()) };
        Ok(())
    }
}

impl Drop for MemSlice {
    fn drop(&mut self) {
        self.region.leases.borrow_mut().remove(&self.offset);
        if let Some(release) = self.release.take() {
            // May run inside `progress` (a cancelled operation's buffer is dropped when UCX
            // completes it): a panic must not unwind into UCX.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(release));
        }
    }
}

impl std::fmt::Debug for MemSlice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemSlice")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

// SAFETY: the bytes live in the registered region, which the slice keeps mapped (it holds an
// `Rc` to it) and which never moves; the lease guarantees no other slice covers them.
unsafe impl IoBuf for MemSlice {
    fn stable_ptr(&self) -> *const u8 {
        // SAFETY: `offset + len <= region.len` (checked when leased), so the pointer stays in
        // the region's allocation.
        unsafe { self.region.addr.add(self.offset) }
    }
    fn bytes_init(&self) -> usize {
        self.len
    }
    fn mem_handle(&self) -> Option<&MemHandle> {
        Some(&self.region)
    }
}

// SAFETY: as for `IoBuf`; while an operation owns the slice no reference to its bytes exists
// (`as_slice`/`as_mut_slice` need the slice itself).
unsafe impl IoBufMut for MemSlice {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        // SAFETY: as in `stable_ptr`.
        unsafe { self.region.addr.add(self.offset) }
    }
    fn bytes_total(&self) -> usize {
        self.len
    }
}

impl Drop for MemHandle {
    fn drop(&mut self) {
        // SAFETY: ucp.h (`ucp_mem_unmap`): unmaps a live handle of this context once. Memory
        // UCX allocated is freed by this call; memory we own (`owned`) is dropped afterwards.
        unsafe { ffi::ucp_mem_unmap(self.context.handle, self.memh) };
        self.owned.take();
    }
}

impl std::fmt::Debug for MemHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemHandle")
            .field("address", &self.addr)
            .field("len", &self.len)
            .finish()
    }
}

impl PackedRkey {
    /// The key bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// A key from bytes a peer sent. UCX checks them when unpacking.
    pub fn from_bytes(bytes: Vec<u8>) -> Self {
        Self { bytes }
    }
}

impl std::fmt::Debug for PackedRkey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PackedRkey({} bytes)", self.bytes.len())
    }
}

impl RemoteKey {
    /// Unpack a peer's packed key on the endpoint to that peer.
    pub fn unpack(ep: &Endpoint, packed: &PackedRkey) -> Result<Self> {
        ep.inner.usable()?;
        check_packed_rkey(&packed.bytes)?;
        // `ucp_ep_rkey_unpack` takes no length: it trusts the sizes inside the key. The layout
        // was checked above; the copy adds zeroed slack so that even a newer UCX reading
        // trailing fields stays inside our allocation.
        let mut padded = Vec::with_capacity(packed.bytes.len() + RKEY_SLACK);
        padded.extend_from_slice(&packed.bytes);
        padded.resize(packed.bytes.len() + RKEY_SLACK, 0);
        let mut rkey = ptr::null_mut();
        // SAFETY: ucp.h (`ucp_ep_rkey_unpack`): live endpoint; the buffer holds a key packed by
        // `ucp_rkey_pack` (UCX validates its content); on success a key to destroy with
        // `ucp_rkey_destroy` before the endpoint, which `RkeyInner`'s field order guarantees.
        check(unsafe {
            ffi::ucp_ep_rkey_unpack(
                ep.inner.handle.get(),
                packed.bytes.as_ptr().cast(),
                &mut rkey,
            )
        })?;
        if rkey.is_null() {
            return Err(Error::NoMemory);
        }
        Ok(Self {
            inner: Rc::new(RkeyInner {
                rkey,
                _ep: ep.inner.clone(),
            }),
        })
    }
}

/// Zeroed bytes appended to a packed key before UCX parses it.
const RKEY_SLACK: usize = 256;

/// Check the layout of a packed key as UCX (1.12 and later) writes it (`ucp_rkey_pack_uct`,
/// `ucp_rkey_dump_packed` in ucp_rkey.c): a 64-bit little-endian map of memory domains, a
/// memory-type byte, then for each bit of the map a size byte and that many bytes; newer
/// releases may append device information. UCX itself checks none of this, so a short or
/// corrupt key from the network would make it read past the buffer.
fn check_packed_rkey(bytes: &[u8]) -> Result<()> {
    const BAD: Error = Error::InvalidArgument("malformed remote key");
    let map: [u8; 8] = bytes.get(..8).and_then(|b| b.try_into().ok()).ok_or(BAD)?;
    let md_map = u64::from_le_bytes(map);
    let mem_type = *bytes.get(8).ok_or(BAD)?;
    // `UCS_MEMORY_TYPE_LAST` is 5 in UCX 1.12; UCX indexes tables with this byte.
    if mem_type >= 5 {
        return Err(BAD);
    }
    let mut at = 9usize;
    for _ in 0..md_map.count_ones() {
        let size = *bytes.get(at).ok_or(BAD)? as usize;
        at = at.checked_add(1 + size).ok_or(BAD)?;
        if at > bytes.len() {
            return Err(BAD);
        }
    }
    Ok(())
}

impl Drop for RkeyInner {
    fn drop(&mut self) {
        // SAFETY: ucp.h (`ucp_rkey_destroy`): destroys a key from `ucp_ep_rkey_unpack` once,
        // before its endpoint (held by `_ep`, dropped after this). Operations using the key
        // hold an `Rc` to it, so none is outstanding.
        unsafe { sys::ucp_rkey_destroy(self.rkey) }
    }
}

impl Endpoint {
    /// Write `buf` to `remote_addr` in the peer's memory covered by `rkey`. Resolves when the
    /// buffer may be reused (locally complete); use [`Endpoint::flush`] for remote completion.
    pub fn put<B: IoBuf>(&self, buf: B, remote_addr: u64, rkey: &RemoteKey) -> Put<B> {
        Put {
            ep: self.inner.clone(),
            rkey: rkey.inner.clone(),
            remote_addr,
            buf: Some(buf),
            flight: None,
        }
    }

    /// Read `buf.bytes_total()` bytes from `remote_addr` in the peer's memory into `buf`.
    pub fn get<B: IoBufMut>(&self, buf: B, remote_addr: u64, rkey: &RemoteKey) -> Get<B> {
        Get {
            ep: self.inner.clone(),
            rkey: rkey.inner.clone(),
            remote_addr,
            buf: Some(buf),
            flight: None,
        }
    }
}

/// Future of [`Endpoint::put`].
pub struct Put<B: IoBuf> {
    ep: Rc<EpInner>,
    rkey: Rc<RkeyInner>,
    remote_addr: u64,
    buf: Option<B>,
    flight: Option<InFlight>,
}

/// Future of [`Endpoint::get`].
pub struct Get<B: IoBufMut> {
    ep: Rc<EpInner>,
    rkey: Rc<RkeyInner>,
    remote_addr: u64,
    buf: Option<B>,
    flight: Option<InFlight>,
}

impl<B: IoBuf> Future for Put<B> {
    type Output = (Result<()>, B);

    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        if this.flight.is_none() {
            let Some(buf) = this.buf.as_ref() else {
                return Poll::Pending;
            };
            if let Err(e) = this.ep.usable() {
                let b = this
                    .buf
                    .take()
                    .expect("buffer present until the future resolves");
                return Poll::Ready((Err(e), b));
            }
            let (ptr, len) = (buf.stable_ptr(), buf.bytes_init());
            let extra = ParamExtra {
                memory_type: Some(buf.memory_type()),
                ..ParamExtra::default()
            };
            let (ep, raddr, rkey) = (this.ep.handle.get(), this.remote_addr, this.rkey.rkey);
            let posted = request::post(
                &this.ep.worker,
                CbKind::Send,
                extra,
                &[],
                &[],
                |param, _| {
                    // SAFETY: ucp.h (`ucp_put_nbx`): live endpoint and remote key (both held by this
                    // future); `ptr` is `len` readable bytes owned by this future until completion
                    // or parked with the worker if it is dropped.
                    unsafe {
                        sys::ucp_put_nbx(ep, ptr.cast(), len as sys::size_t, raddr, rkey, param)
                    }
                },
            );
            match posted {
                Posted::Now(c) => {
                    let b = this
                        .buf
                        .take()
                        .expect("buffer present until the future resolves");
                    return Poll::Ready((c.result(), b));
                }
                Posted::Later(f) => this.flight = Some(f),
            }
        }
        finish(&mut this.flight, &mut this.buf, cx, |c| c.result())
    }
}

impl<B: IoBuf> Drop for Put<B> {
    fn drop(&mut self) {
        // The remote key must outlive the operation (ucp.h, `ucp_rkey_destroy`): park it too.
        let mut parked = self.buf.take().map(|b| (b, self.rkey.clone()));
        park(&mut self.flight, &mut parked);
    }
}

impl<B: IoBufMut> Future for Get<B> {
    type Output = (Result<()>, B);

    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        if this.flight.is_none() {
            let Some(buf) = this.buf.as_mut() else {
                return Poll::Pending;
            };
            if let Err(e) = this.ep.usable() {
                let b = this
                    .buf
                    .take()
                    .expect("buffer present until the future resolves");
                return Poll::Ready((Err(e), b));
            }
            let (ptr, len) = (buf.stable_mut_ptr(), buf.bytes_total());
            let extra = ParamExtra {
                memory_type: Some(buf.memory_type()),
                ..ParamExtra::default()
            };
            let (ep, raddr, rkey) = (this.ep.handle.get(), this.remote_addr, this.rkey.rkey);
            let posted = request::post(
                &this.ep.worker,
                CbKind::Send,
                extra,
                &[],
                &[],
                |param, _| {
                    // SAFETY: ucp.h (`ucp_get_nbx`): live endpoint and remote key; `ptr` is `len`
                    // writable bytes owned by this future until completion, or parked with the
                    // worker if the future is dropped.
                    unsafe {
                        sys::ucp_get_nbx(ep, ptr.cast(), len as sys::size_t, raddr, rkey, param)
                    }
                },
            );
            match posted {
                Posted::Now(c) => {
                    let b = this
                        .buf
                        .take()
                        .expect("buffer present until the future resolves");
                    return Poll::Ready((c.result(), b));
                }
                Posted::Later(f) => this.flight = Some(f),
            }
        }
        finish(&mut this.flight, &mut this.buf, cx, |c| c.result())
    }
}

impl<B: IoBufMut> Drop for Get<B> {
    fn drop(&mut self) {
        // The remote key must outlive the operation (ucp.h, `ucp_rkey_destroy`): park it too.
        let mut parked = self.buf.take().map(|b| (b, self.rkey.clone()));
        park(&mut self.flight, &mut parked);
    }
}
