//! Raw declarations this crate makes itself, on top of ucx1-sys.
//!
//! ucx1-sys declares every function that returns `ucs_status_t` with the Rust enum
//! `ucs_status_t` as its return type, and every callback with an enum `status` argument. A
//! value outside that enum's variants is undefined behaviour, and a libucp newer than the 1.12
//! headers may produce one. The C type is `enum { ... } UCS_S_PACKED ucs_status_t`: a packed
//! enum, one signed byte, the same ABI as `i8`. So the functions below are re-declared with a
//! raw `i8` status, and callbacks are written with an `i8` argument and stored into UCX's
//! parameter structs through [`send_cb`], [`tag_recv_cb`] and friends, which only change the
//! nominal type of the status argument.
//!
//! The flag and field values are copied from UCX 1.12's `ucp.h` (the enums ucx1-sys turns into
//! plain Rust enums cannot be OR-ed together), and later UCX releases keep them unchanged
//! because they are part of the ABI.

use std::ffi::{c_char, c_int, c_uint, c_void};

use ucx1_sys as sys;

use crate::status::RawStatus;

// `ucs_status_string` lives in libucs, which ucx1-sys does not name on the link line.
#[link(name = "ucs")]
extern "C" {
    pub(crate) fn ucs_status_string(status: RawStatus) -> *const c_char;
}

extern "C" {
    pub(crate) fn ucp_config_read(
        env_prefix: *const c_char,
        filename: *const c_char,
        config_p: *mut *mut sys::ucp_config_t,
    ) -> RawStatus;
    pub(crate) fn ucp_config_modify(
        config: *mut sys::ucp_config_t,
        name: *const c_char,
        value: *const c_char,
    ) -> RawStatus;
    pub(crate) fn ucp_init_version(
        api_major_version: c_uint,
        api_minor_version: c_uint,
        params: *const sys::ucp_params_t,
        config: *const sys::ucp_config_t,
        context_p: *mut sys::ucp_context_h,
    ) -> RawStatus;
    pub(crate) fn ucp_worker_create(
        context: sys::ucp_context_h,
        params: *const sys::ucp_worker_params_t,
        worker_p: *mut sys::ucp_worker_h,
    ) -> RawStatus;
    pub(crate) fn ucp_worker_get_address(
        worker: sys::ucp_worker_h,
        address_p: *mut *mut sys::ucp_address_t,
        address_length_p: *mut sys::size_t,
    ) -> RawStatus;
    pub(crate) fn ucp_worker_get_efd(worker: sys::ucp_worker_h, fd: *mut c_int) -> RawStatus;
    pub(crate) fn ucp_worker_arm(worker: sys::ucp_worker_h) -> RawStatus;
    pub(crate) fn ucp_worker_signal(worker: sys::ucp_worker_h) -> RawStatus;
    pub(crate) fn ucp_worker_set_am_recv_handler(
        worker: sys::ucp_worker_h,
        param: *const sys::ucp_am_handler_param_t,
    ) -> RawStatus;
    pub(crate) fn ucp_ep_create(
        worker: sys::ucp_worker_h,
        params: *const sys::ucp_ep_params_t,
        ep_p: *mut sys::ucp_ep_h,
    ) -> RawStatus;
    pub(crate) fn ucp_listener_create(
        worker: sys::ucp_worker_h,
        params: *const sys::ucp_listener_params_t,
        listener_p: *mut sys::ucp_listener_h,
    ) -> RawStatus;
    pub(crate) fn ucp_listener_query(
        listener: sys::ucp_listener_h,
        attr: *mut sys::ucp_listener_attr_t,
    ) -> RawStatus;
    pub(crate) fn ucp_listener_reject(
        listener: sys::ucp_listener_h,
        conn_request: sys::ucp_conn_request_h,
    ) -> RawStatus;
    pub(crate) fn ucp_conn_request_query(
        conn_request: sys::ucp_conn_request_h,
        attr: *mut sys::ucp_conn_request_attr_t,
    ) -> RawStatus;
    pub(crate) fn ucp_mem_map(
        context: sys::ucp_context_h,
        params: *const sys::ucp_mem_map_params_t,
        memh_p: *mut sys::ucp_mem_h,
    ) -> RawStatus;
    pub(crate) fn ucp_mem_unmap(context: sys::ucp_context_h, memh: sys::ucp_mem_h) -> RawStatus;
    pub(crate) fn ucp_mem_query(memh: sys::ucp_mem_h, attr: *mut sys::ucp_mem_attr_t) -> RawStatus;
    pub(crate) fn ucp_rkey_pack(
        context: sys::ucp_context_h,
        memh: sys::ucp_mem_h,
        rkey_buffer_p: *mut *mut c_void,
        size_p: *mut sys::size_t,
    ) -> RawStatus;
    pub(crate) fn ucp_context_query(
        context: sys::ucp_context_h,
        attr: *mut sys::ucp_context_attr_t,
    ) -> RawStatus;
    pub(crate) fn ucp_worker_query(
        worker: sys::ucp_worker_h,
        attr: *mut sys::ucp_worker_attr_t,
    ) -> RawStatus;
    pub(crate) fn ucp_request_check_status(request: *mut c_void) -> RawStatus;
    pub(crate) fn ucp_ep_rkey_unpack(
        ep: sys::ucp_ep_h,
        rkey_buffer: *const c_void,
        rkey_p: *mut sys::ucp_rkey_h,
    ) -> RawStatus;
}

/// Completion callback of sends, flushes and closes, with a raw status.
pub(crate) type SendCb =
    unsafe extern "C" fn(request: *mut c_void, status: RawStatus, user: *mut c_void);
/// Completion callback of tag receives, with a raw status.
pub(crate) type TagRecvCb = unsafe extern "C" fn(
    request: *mut c_void,
    status: RawStatus,
    info: *const sys::ucp_tag_recv_info_t,
    user: *mut c_void,
);
/// Completion callback of `ucp_am_recv_data_nbx`, with a raw status.
pub(crate) type AmRecvDataCb = unsafe extern "C" fn(
    request: *mut c_void,
    status: RawStatus,
    length: sys::size_t,
    user: *mut c_void,
);
/// Active-message handler, returning a raw status.
pub(crate) type AmRecvCb = unsafe extern "C" fn(
    arg: *mut c_void,
    header: *const c_void,
    header_length: sys::size_t,
    data: *mut c_void,
    length: sys::size_t,
    param: *const sys::ucp_am_recv_param_t,
) -> RawStatus;
/// Endpoint error handler, with a raw status.
pub(crate) type ErrCb =
    unsafe extern "C" fn(arg: *mut c_void, ep: sys::ucp_ep_h, status: RawStatus);

/// `f` with its status argument typed as ucx1-sys expects.
pub(crate) fn send_cb(f: SendCb) -> sys::ucp_send_nbx_callback_t {
    // SAFETY: the two function pointer types differ only in the nominal type of the status
    // argument, `i8` versus `#[repr(i8)] enum ucs_status_t`, which have the same size,
    // alignment and calling convention. UCX calls the pointer with a one-byte status, which
    // our function reads as a plain integer.
    Some(unsafe {
        std::mem::transmute::<
            SendCb,
            unsafe extern "C" fn(*mut c_void, sys::ucs_status_t, *mut c_void),
        >(f)
    })
}

/// `f` with its status argument typed as ucx1-sys expects.
pub(crate) fn tag_recv_cb(f: TagRecvCb) -> sys::ucp_tag_recv_nbx_callback_t {
    // SAFETY: as in `send_cb`: only the status argument's nominal type changes (`i8` versus
    // the one-byte `ucs_status_t`); the ABI is identical.
    Some(unsafe {
        std::mem::transmute::<
            TagRecvCb,
            unsafe extern "C" fn(
                *mut c_void,
                sys::ucs_status_t,
                *const sys::ucp_tag_recv_info_t,
                *mut c_void,
            ),
        >(f)
    })
}

/// `f` with its status argument typed as ucx1-sys expects.
pub(crate) fn am_recv_data_cb(f: AmRecvDataCb) -> sys::ucp_am_recv_data_nbx_callback_t {
    // SAFETY: as in `send_cb`: only the status argument's nominal type changes.
    Some(unsafe {
        std::mem::transmute::<
            AmRecvDataCb,
            unsafe extern "C" fn(*mut c_void, sys::ucs_status_t, sys::size_t, *mut c_void),
        >(f)
    })
}

/// `f` with its return type as ucx1-sys expects.
pub(crate) fn am_recv_cb(f: AmRecvCb) -> sys::ucp_am_recv_callback_t {
    // SAFETY: only the return type's nominal type changes: UCX reads a one-byte
    // `ucs_status_t` return value, and we return one of the statuses it documents for AM
    // handlers (`UCS_OK` or `UCS_INPROGRESS`) as an `i8` with the same ABI.
    Some(unsafe {
        std::mem::transmute::<
            AmRecvCb,
            unsafe extern "C" fn(
                *mut c_void,
                *const c_void,
                sys::size_t,
                *mut c_void,
                sys::size_t,
                *const sys::ucp_am_recv_param_t,
            ) -> sys::ucs_status_t,
        >(f)
    })
}

/// `f` with its status argument typed as ucx1-sys expects.
pub(crate) fn err_cb(f: ErrCb) -> sys::ucp_err_handler_cb_t {
    // SAFETY: as in `send_cb`: only the status argument's nominal type changes.
    Some(unsafe {
        std::mem::transmute::<
            ErrCb,
            unsafe extern "C" fn(*mut c_void, sys::ucp_ep_h, sys::ucs_status_t),
        >(f)
    })
}

// `ucp_params_field` (ucp.h).
pub(crate) const UCP_PARAM_FIELD_FEATURES: u64 = 1 << 0;
pub(crate) const UCP_PARAM_FIELD_NAME: u64 = 1 << 8;
// `ucp_context_attr_field`.
pub(crate) const UCP_ATTR_FIELD_MEMORY_TYPES: u64 = 1 << 2;
// `ucp_feature`.
pub(crate) const UCP_FEATURE_TAG: u64 = 1 << 0;
pub(crate) const UCP_FEATURE_RMA: u64 = 1 << 1;
pub(crate) const UCP_FEATURE_WAKEUP: u64 = 1 << 4;
pub(crate) const UCP_FEATURE_AM: u64 = 1 << 6;
// `ucp_worker_params_field`.
pub(crate) const UCP_WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;
pub(crate) const UCP_WORKER_PARAM_FIELD_NAME: u64 = 1 << 6;
pub(crate) const UCP_WORKER_PARAM_FIELD_AM_ALIGNMENT: u64 = 1 << 7;
// `ucp_worker_attr_field`.
pub(crate) const UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER: u64 = 1 << 3;
// `ucp_listener_params_field`.
pub(crate) const UCP_LISTENER_PARAM_FIELD_SOCK_ADDR: u64 = 1 << 0;
pub(crate) const UCP_LISTENER_PARAM_FIELD_CONN_HANDLER: u64 = 1 << 2;
// `ucp_listener_attr_field`.
pub(crate) const UCP_LISTENER_ATTR_FIELD_SOCKADDR: u64 = 1 << 0;
// `ucp_conn_request_attr_field`.
pub(crate) const UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR: u64 = 1 << 0;
// `ucp_ep_params_field`.
pub(crate) const UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
pub(crate) const UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 1 << 1;
pub(crate) const UCP_EP_PARAM_FIELD_ERR_HANDLER: u64 = 1 << 2;
pub(crate) const UCP_EP_PARAM_FIELD_SOCK_ADDR: u64 = 1 << 4;
pub(crate) const UCP_EP_PARAM_FIELD_FLAGS: u64 = 1 << 5;
pub(crate) const UCP_EP_PARAM_FIELD_CONN_REQUEST: u64 = 1 << 6;
// `ucp_ep_params_flags_field`.
pub(crate) const UCP_EP_PARAMS_FLAGS_CLIENT_SERVER: c_uint = 1 << 0;
// `ucp_ep_close_flags_t`.
pub(crate) const UCP_EP_CLOSE_FLAG_FORCE: u32 = 1 << 0;
// `ucp_mem_map_params_field`.
pub(crate) const UCP_MEM_MAP_PARAM_FIELD_ADDRESS: u64 = 1 << 0;
pub(crate) const UCP_MEM_MAP_PARAM_FIELD_LENGTH: u64 = 1 << 1;
pub(crate) const UCP_MEM_MAP_PARAM_FIELD_FLAGS: u64 = 1 << 2;
pub(crate) const UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE: u64 = 1 << 4;
// `ucp_mem_map_flags`.
pub(crate) const UCP_MEM_MAP_ALLOCATE: c_uint = 1 << 1;
// `ucp_mem_attr_field`.
pub(crate) const UCP_MEM_ATTR_FIELD_ADDRESS: u64 = 1 << 0;
pub(crate) const UCP_MEM_ATTR_FIELD_LENGTH: u64 = 1 << 1;
// `ucp_am_cb_flags`.
pub(crate) const UCP_AM_FLAG_WHOLE_MSG: u32 = 1 << 0;
pub(crate) const UCP_AM_FLAG_PERSISTENT_DATA: u32 = 1 << 1;
// `ucp_send_am_flags`.
pub(crate) const UCP_AM_SEND_FLAG_EAGER: u32 = 1 << 1;
pub(crate) const UCP_AM_SEND_FLAG_RNDV: u32 = 1 << 2;
// `ucp_op_attr_t`.
pub(crate) const UCP_OP_ATTR_FIELD_CALLBACK: u32 = 1 << 1;
pub(crate) const UCP_OP_ATTR_FIELD_USER_DATA: u32 = 1 << 2;
pub(crate) const UCP_OP_ATTR_FIELD_DATATYPE: u32 = 1 << 3;
pub(crate) const UCP_OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;
pub(crate) const UCP_OP_ATTR_FIELD_MEMORY_TYPE: u32 = 1 << 6;
pub(crate) const UCP_OP_ATTR_FIELD_RECV_INFO: u32 = 1 << 7;
pub(crate) const UCP_OP_ATTR_FLAG_NO_IMM_CMPL: u32 = 1 << 16;
pub(crate) const UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL: u32 = 1 << 18;
// `ucp_am_recv_attr_t`.
pub(crate) const UCP_AM_RECV_ATTR_FLAG_DATA: u64 = 1 << 16;
pub(crate) const UCP_AM_RECV_ATTR_FLAG_RNDV: u64 = 1 << 17;
// `ucp_am_handler_param_field`.
pub(crate) const UCP_AM_HANDLER_PARAM_FIELD_ID: u64 = 1 << 0;
pub(crate) const UCP_AM_HANDLER_PARAM_FIELD_FLAGS: u64 = 1 << 1;
pub(crate) const UCP_AM_HANDLER_PARAM_FIELD_CB: u64 = 1 << 2;
pub(crate) const UCP_AM_HANDLER_PARAM_FIELD_ARG: u64 = 1 << 3;
// `ucp_dt_type`: a contiguous buffer of bytes is `ucp_dt_make_contig(1)`; an iovec is
// `UCP_DATATYPE_IOV` (2).
pub(crate) const UCP_DATATYPE_CONTIG_BYTES: sys::ucp_datatype_t = sys::ucp_dt_make_contig(1);
pub(crate) const UCP_DATATYPE_IOV: sys::ucp_datatype_t = 2;
