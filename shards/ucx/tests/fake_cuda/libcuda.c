/*
 * A fake CUDA driver for tests on machines without a GPU: the entry points shardcx calls, with
 * "device" memory in host memory and every copy done at once. It lets the GPU branches of the
 * tests (and the examples) run where there is no GPU; it proves the bookkeeping, not CUDA.
 *
 * Built by shards/ucx/tests/cuda.rs with the system C compiler, as libcuda.so in a temporary
 * directory found first through LD_LIBRARY_PATH. FAKE_CUDA_DEVICES sets the device count
 * (default 1); FAKE_CUDA_INIT_ERROR makes cuInit fail with that code; FAKE_CUDA_FAIL_COPY_LEN
 * makes every asynchronous copy of exactly that many bytes fail with 999 (CUDA_ERROR_UNKNOWN)
 * and copy nothing (a chunk of a staged transfer, say, for a copy failing mid-transfer).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef uint64_t CUdeviceptr;
typedef struct ctx { int device; } *CUcontext;
typedef struct stream { int unused; } *CUstream;
typedef struct event { int unused; } *CUevent;

static struct ctx contexts[16];
static __thread CUcontext current;
static int initialised;

static int devices(void) {
    const char *n = getenv("FAKE_CUDA_DEVICES");
    return n ? atoi(n) : 1;
}

CUresult cuInit(unsigned flags) {
    const char *e = getenv("FAKE_CUDA_INIT_ERROR");
    if (flags != 0) return 1; /* CUDA_ERROR_INVALID_VALUE */
    if (e) return atoi(e);
    initialised = 1;
    return 0;
}
CUresult cuDriverGetVersion(int *v) { *v = 12060; return 0; }
CUresult cuDeviceGetCount(int *n) { if (!initialised) return 3; *n = devices(); return 0; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    if (ordinal < 0 || ordinal >= devices() || ordinal >= 16) return 101; /* INVALID_DEVICE */
    *d = ordinal;
    return 0;
}
CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
    char buf[64];
    strcpy(buf, "Fake GPU 0");
    buf[9] = (char)('0' + d % 10);
    strncpy(name, buf, (size_t)len);
    return 0;
}
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) { (void)d; *bytes = (size_t)8 << 30; return 0; }
CUresult cuGetErrorString(CUresult code, const char **s) {
    if (code == 100) { *s = "no CUDA-capable device is detected"; return 0; }
    if (code == 999) { *s = "unknown error"; return 0; }
    return 1;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) { contexts[d].device = d; *c = &contexts[d]; return 0; }
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { (void)d; return 0; }
CUresult cuCtxSetCurrent(CUcontext c) { current = c; return 0; }
static CUresult need_ctx(void) { return current ? 0 : 201; /* INVALID_CONTEXT */ }
CUresult cuStreamCreate(CUstream *s, unsigned flags) { (void)flags; if (need_ctx()) return 201; *s = calloc(1, sizeof(**s)); return 0; }
CUresult cuStreamDestroy_v2(CUstream s) { free(s); return 0; }
CUresult cuStreamSynchronize(CUstream s) { (void)s; return 0; }
CUresult cuEventCreate(CUevent *e, unsigned flags) { (void)flags; if (need_ctx()) return 201; *e = calloc(1, sizeof(**e)); return 0; }
CUresult cuEventDestroy_v2(CUevent e) { free(e); return 0; }
CUresult cuEventRecord(CUevent e, CUstream s) { (void)e; (void)s; return 0; }
CUresult cuEventQuery(CUevent e) { (void)e; return 0; }
CUresult cuEventSynchronize(CUevent e) { (void)e; return 0; }
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
    void *m;
    if (need_ctx()) return 201;
    m = malloc(n);
    if (!m) return 2; /* OUT_OF_MEMORY */
    memset(m, 0xD5, n); /* device memory is not zeroed */
    *p = (CUdeviceptr)(uintptr_t)m;
    return 0;
}
CUresult cuMemFree_v2(CUdeviceptr p) { free((void *)(uintptr_t)p); return 0; }
CUresult cuMemHostAlloc(void **p, size_t n, unsigned flags) { (void)flags; *p = malloc(n); return *p ? 0 : 2; }
CUresult cuMemFreeHost(void *p) { free(p); return 0; }
static int copy_fails(size_t n) {
    const char *f = getenv("FAKE_CUDA_FAIL_COPY_LEN");
    return f && strtoull(f, NULL, 10) == (unsigned long long)n;
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *h, size_t n, CUstream s) {
    (void)s; if (copy_fails(n)) return 999; memcpy((void *)(uintptr_t)d, h, n); return 0;
}
CUresult cuMemcpyDtoHAsync_v2(void *h, CUdeviceptr d, size_t n, CUstream s) {
    (void)s; if (copy_fails(n)) return 999; memcpy(h, (const void *)(uintptr_t)d, n); return 0;
}
