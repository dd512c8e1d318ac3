//! `Config` and `Context`: UCX's configuration and its library context.

use std::ffi::{c_char, CString};
use std::ptr;
use std::rc::Rc;

use ucx1_sys as sys;

use crate::ffi;
use crate::status::{check, Error, Result};

/// UCX configuration (`ucp_config_t`), read from the `UCX_*` environment and modified in code.
///
/// Setting a value here is the same as setting `UCX_<NAME>` in the environment, but applies to
/// one context only, which matters in test binaries that run many contexts on many threads.
pub struct Config {
    raw: *mut sys::ucp_config_t,
}

impl Config {
    /// Read the configuration from the `UCX_*` environment variables.
    pub fn from_env() -> Result<Self> {
        let mut raw = ptr::null_mut();
        // SAFETY: ucp.h (`ucp_config_read`): NULL prefix and NULL file name read the default
        // `UCX_` environment; on success `config_p` receives a configuration that must be
        // released with `ucp_config_release`.
        check(unsafe { ffi::ucp_config_read(ptr::null(), ptr::null(), &mut raw) })?;
        if raw.is_null() {
            return Err(Error::NoMemory);
        }
        Ok(Self { raw })
    }

    /// Set one option, named without the `UCX_` prefix: `set("TLS", "tcp")`.
    pub fn set(&mut self, name: &str, value: &str) -> Result<&mut Self> {
        let name = CString::new(name).map_err(|_| Error::NulByte)?;
        let value = CString::new(value).map_err(|_| Error::NulByte)?;
        // SAFETY: ucp.h (`ucp_config_modify`): `config` is a live configuration from
        // `ucp_config_read`; `name` and `value` are NUL-terminated strings that UCX copies.
        check(unsafe { ffi::ucp_config_modify(self.raw, name.as_ptr(), value.as_ptr()) })?;
        Ok(self)
    }
}

impl Drop for Config {
    fn drop(&mut self) {
        // SAFETY: ucp.h (`ucp_config_release`): releases a configuration returned by
        // `ucp_config_read`, exactly once.
        unsafe { sys::ucp_config_release(self.raw) }
    }
}

/// Which UCP features a context asks for. Ask only for what is used: each feature can select
/// extra transports and costs memory, and `rma` in particular lets any peer holding a remote key
/// write into registered memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Features {
    /// Active messages (`UCP_FEATURE_AM`).
    pub am: bool,
    /// Tag matching (`UCP_FEATURE_TAG`).
    pub tag: bool,
    /// Remote memory access (`UCP_FEATURE_RMA`).
    pub rma: bool,
    /// Sleeping on an event file descriptor (`UCP_FEATURE_WAKEUP`).
    pub wakeup: bool,
}

impl Features {
    /// Active messages, tag matching and wake-up; no remote memory access.
    pub fn messaging() -> Self {
        Self {
            am: true,
            tag: true,
            rma: false,
            wakeup: true,
        }
    }

    /// Everything this crate offers.
    pub fn all() -> Self {
        Self {
            am: true,
            tag: true,
            rma: true,
            wakeup: true,
        }
    }

    pub(crate) fn bits(&self) -> u64 {
        let mut bits = 0;
        if self.am {
            bits |= ffi::UCP_FEATURE_AM;
        }
        if self.tag {
            bits |= ffi::UCP_FEATURE_TAG;
        }
        if self.rma {
            bits |= ffi::UCP_FEATURE_RMA;
        }
        if self.wakeup {
            bits |= ffi::UCP_FEATURE_WAKEUP;
        }
        bits
    }
}

/// A set of UCX memory types (`ucs_memory_type_t` bits), as `ucp_context_query` reports them.
///
/// Kept as raw bits: UCX releases after 1.12 added types (and moved `UCS_MEMORY_TYPE_UNKNOWN`),
/// so only the first five, unchanged since 1.12, are named; the others print as `type N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct MemoryTypes(u64);

impl MemoryTypes {
    /// The names of bits 0..5, the same in every UCX since 1.12.
    const NAMES: [&'static str; 5] = ["host", "cuda", "cuda-managed", "rocm", "rocm-managed"];

    /// The set with these raw bits (bit `n` is `ucs_memory_type_t` value `n`).
    pub const fn from_bits(bits: u64) -> Self {
        Self(bits)
    }

    /// The raw bits.
    pub fn bits(self) -> u64 {
        self.0
    }

    /// Whether ordinary host memory is in the set (`UCS_MEMORY_TYPE_HOST`, 0).
    pub fn host(self) -> bool {
        self.0 & 1 != 0
    }

    /// Whether CUDA device memory is in the set (`UCS_MEMORY_TYPE_CUDA`, 1).
    pub fn cuda(self) -> bool {
        self.0 & (1 << 1) != 0
    }

    /// The names of the types in the set (`host`, `cuda`, ..., `type N` for later ones).
    pub fn names(self) -> Vec<String> {
        (0..64)
            .filter(|bit| self.0 & (1u64 << bit) != 0)
            .map(|bit| match Self::NAMES.get(bit) {
                Some(name) => (*name).to_string(),
                None => format!("type {bit}"),
            })
            .collect()
    }
}

impl std::fmt::Display for MemoryTypes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names = self.names();
        if names.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&names.join(", "))
        }
    }
}

pub(crate) struct ContextInner {
    pub(crate) handle: sys::ucp_context_h,
    pub(crate) features: Features,
}

/// A UCP library context (`ucp_context_h`): transports, memory registration, features.
///
/// `!Send` and `!Sync`: shardcx gives every shard its own context, built on the shard's thread
/// (a shared context serialises registration-cache locks across cores).
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Rc<ContextInner>,
}

impl Context {
    /// A context with the given configuration and features.
    pub fn new(config: &Config, features: Features) -> Result<Self> {
        if features.bits() == 0 {
            return Err(Error::InvalidArgument(
                "a context needs at least one feature",
            ));
        }
        let name = b"shardcx\0";
        // Every field written; only `features` and `name` are flagged as set.
        let params = sys::ucp_params_t {
            field_mask: ffi::UCP_PARAM_FIELD_FEATURES | ffi::UCP_PARAM_FIELD_NAME,
            features: features.bits(),
            request_size: 0,
            request_init: None,
            request_cleanup: None,
            tag_sender_mask: 0,
            mt_workers_shared: 0,
            estimated_num_eps: 0,
            estimated_num_ppn: 0,
            name: name.as_ptr().cast::<c_char>(),
        };
        let mut handle = ptr::null_mut();
        // SAFETY: ucp.h (`ucp_init_version`, which the inline `ucp_init` calls): `params` is a
        // fully initialised struct whose field mask names only fields we set, `config` is a
        // live configuration, and the API version is the one our bindings were generated from.
        // On success `context_p` holds a context to release with `ucp_cleanup`.
        check(unsafe {
            ffi::ucp_init_version(
                sys::UCP_API_MAJOR,
                sys::UCP_API_MINOR,
                &params,
                config.raw,
                &mut handle,
            )
        })?;
        if handle.is_null() {
            return Err(Error::NoMemory);
        }
        Ok(Self {
            inner: Rc::new(ContextInner { handle, features }),
        })
    }

    /// A context configured from the environment.
    pub fn from_env(features: Features) -> Result<Self> {
        Self::new(&Config::from_env()?, features)
    }

    /// The features this context was created with.
    pub fn features(&self) -> Features {
        self.inner.features
    }

    /// The memory types this context can move (`ucp_context_query`'s `memory_types`): whether
    /// the loaded UCX accepts CUDA device pointers ([`MemoryTypes::cuda`]).
    pub fn memory_types(&self) -> Result<MemoryTypes> {
        // Every field written with a declared value; only `memory_types` is asked for, so UCX
        // writes nothing else (the mask is how ucp.h keeps this struct ABI-compatible).
        let mut attr = sys::ucp_context_attr_t {
            field_mask: ffi::UCP_ATTR_FIELD_MEMORY_TYPES,
            request_size: 0,
            thread_mode: sys::ucs_thread_mode_t::UCS_THREAD_MODE_SINGLE,
            memory_types: 0,
            name: [0; 32],
        };
        // SAFETY: ucp.h (`ucp_context_query`): `context_p` is a live context and `attr` a valid
        // struct whose `field_mask` selects the fields UCX fills in, here `memory_types` only (a
        // plain `uint64_t`, so no enum value can come back).
        check(unsafe { ffi::ucp_context_query(self.inner.handle, &mut attr) })?;
        Ok(MemoryTypes::from_bits(attr.memory_types))
    }

    /// UCX's description of this context: transports and devices it found.
    pub fn info(&self) -> String {
        crate::version::capture(|file| {
            // SAFETY: ucp.h (`ucp_context_print_info`): prints to a valid `FILE*`; the handle
            // is a live context.
            unsafe { sys::ucp_context_print_info(self.inner.handle, file) }
        })
    }
}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: ucp.h (`ucp_cleanup`): releases the context. Workers and memory handles hold
        // an `Rc` to this inner value, so all of them are already destroyed.
        unsafe { sys::ucp_cleanup(self.handle) }
    }
}
