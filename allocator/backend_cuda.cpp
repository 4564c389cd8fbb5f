// CUDA backend over the driver's virtual memory API. libcuda.so.1 is opened at run time and the few
// types below are declared here (ABI of cuda.h, CUDA 11-13), so the library builds and loads on
// machines without CUDA; there the backend reports itself unavailable.
#include <dlfcn.h>

#include <mutex>

#include "backend.h"
#include "hvmm.h"

namespace hvmm {
namespace {

typedef int CUresult;
constexpr CUresult kContextIsDestroyed = 709;  // CUDA_ERROR_CONTEXT_IS_DESTROYED
typedef int CUdevice;
typedef struct CUctx_st* CUcontext;
typedef struct CUstream_st* CUstream;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

struct CUmemLocation {
  int type;  // CU_MEM_LOCATION_TYPE_DEVICE = 1
  int id;
};
struct CUmemAllocationProp {
  int type;                  // CU_MEM_ALLOCATION_TYPE_PINNED = 1
  int requestedHandleTypes;  // CU_MEM_HANDLE_TYPE_NONE = 0
  CUmemLocation location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
};
struct CUmemAccessDesc {
  CUmemLocation location;
  int flags;  // CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
};
static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp layout");
static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc layout");

struct Driver {
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDeviceGetCount)(int*);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice);
  CUresult (*cuCtxGetCurrent)(CUcontext*);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuCtxSynchronize)();
  CUresult (*cuStreamSynchronize)(CUstream);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  CUresult (*cuMemGetAllocationGranularity)(size_t*, const CUmemAllocationProp*, int);
  CUresult (*cuMemCreate)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                          unsigned long long);
  CUresult (*cuMemRelease)(CUmemGenericAllocationHandle);
  CUresult (*cuMemAddressReserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*cuMemAddressFree)(CUdeviceptr, size_t);
  CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
  CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
  CUresult (*cuMemUnmap)(CUdeviceptr, size_t);
  bool ok = false;
  std::string why;
};

template <typename F>
bool bind(void* lib, F* fn, const char* name, const char* fallback, std::string* why) {
  void* sym = dlsym(lib, name);
  if (!sym && fallback) sym = dlsym(lib, fallback);
  if (!sym) *why = std::string("libcuda.so.1 has no symbol ") + name;
  *fn = reinterpret_cast<F>(sym);
  return sym != nullptr;
}

// Loaded once per process and never closed: torch may hold the same library.
const Driver& driver() {
  static Driver d;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* err = dlerror();
      d.why = std::string("dlopen(libcuda.so.1) failed: ") + (err ? err : "unknown error");
      return;
    }
    std::string* w = &d.why;
    bool all = bind(lib, &d.cuInit, "cuInit", nullptr, w) &&
               bind(lib, &d.cuDeviceGetCount, "cuDeviceGetCount", nullptr, w) &&
               bind(lib, &d.cuDeviceGet, "cuDeviceGet", nullptr, w) &&
               bind(lib, &d.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", nullptr, w) &&
               bind(lib, &d.cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2",
                    "cuDevicePrimaryCtxRelease", w) &&
               bind(lib, &d.cuCtxGetCurrent, "cuCtxGetCurrent", nullptr, w) &&
               bind(lib, &d.cuCtxSetCurrent, "cuCtxSetCurrent", nullptr, w) &&
               bind(lib, &d.cuCtxSynchronize, "cuCtxSynchronize", nullptr, w) &&
               bind(lib, &d.cuStreamSynchronize, "cuStreamSynchronize", nullptr, w) &&
               bind(lib, &d.cuGetErrorString, "cuGetErrorString", nullptr, w) &&
               bind(lib, &d.cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity", nullptr, w) &&
               bind(lib, &d.cuMemCreate, "cuMemCreate", nullptr, w) &&
               bind(lib, &d.cuMemRelease, "cuMemRelease", nullptr, w) &&
               bind(lib, &d.cuMemAddressReserve, "cuMemAddressReserve", nullptr, w) &&
               bind(lib, &d.cuMemAddressFree, "cuMemAddressFree", nullptr, w) &&
               bind(lib, &d.cuMemMap, "cuMemMap", nullptr, w) &&
               bind(lib, &d.cuMemSetAccess, "cuMemSetAccess", nullptr, w) &&
               bind(lib, &d.cuMemUnmap, "cuMemUnmap", nullptr, w);
    if (!all) return;
    const CUresult rc = d.cuInit(0);
    if (rc != 0) {
      d.why = "cuInit failed with CUresult " + std::to_string(rc);
      return;
    }
    d.ok = true;
  });
  return d;
}

int cu_fail(const char* call, CUresult rc) {
  const char* msg = nullptr;
  driver().cuGetErrorString(rc, &msg);
  return fail(HVMM_ERR_BACKEND, std::string(call) + " failed: " + (msg ? msg : "unknown CUresult") +
                                    " (" + std::to_string(rc) + ")");
}

#define CU_TRY(call)                                  \
  do {                                                \
    const CUresult rc_ = (call);                      \
    if (rc_ != 0) return cu_fail(#call, rc_);         \
  } while (0)

class CudaBackend final : public Backend {
 public:
  CudaBackend(CUdevice dev, CUcontext ctx, size_t granularity) : dev_(dev), ctx_(ctx), gran_(granularity) {
    prop_ = make_prop(dev);
    access_.location = prop_.location;
    access_.flags = 3;
  }
  ~CudaBackend() override { driver().cuDevicePrimaryCtxRelease(dev_); }

  static CUmemAllocationProp make_prop(CUdevice dev) {
    CUmemAllocationProp prop{};
    prop.type = 1;
    prop.location.type = 1;
    prop.location.id = dev;
    return prop;
  }

  int kind() const override { return HVMM_BACKEND_CUDA; }
  size_t page_bytes() const override { return gran_; }

  int create_page(uint64_t* handle) override {
    if (int st = ensure_context()) return st;
    CUmemGenericAllocationHandle h = 0;
    CU_TRY(driver().cuMemCreate(&h, gran_, &prop_, 0));
    *handle = h;
    return HVMM_OK;
  }
  int release_page(uint64_t handle) override {
    CU_TRY(driver().cuMemRelease(handle));
    return HVMM_OK;
  }
  int reserve(size_t bytes, uintptr_t* va) override {
    if (int st = ensure_context()) return st;
    CUdeviceptr p = 0;
    CU_TRY(driver().cuMemAddressReserve(&p, bytes, gran_, 0, 0));
    *va = static_cast<uintptr_t>(p);
    return HVMM_OK;
  }
  int free_va(uintptr_t va, size_t bytes) override {
    CU_TRY(driver().cuMemAddressFree(va, bytes));
    return HVMM_OK;
  }
  int map_page(uintptr_t va, uint64_t handle) override {
    if (int st = ensure_context()) return st;
    CU_TRY(driver().cuMemMap(va, gran_, 0, handle, 0));
    return HVMM_OK;
  }
  int set_access(uintptr_t va, size_t bytes) override {
    CU_TRY(driver().cuMemSetAccess(va, bytes, &access_, 1));
    return HVMM_OK;
  }
  int unmap_page(uintptr_t va) override {
    if (int st = ensure_context()) return st;
    // A range must be unmapped exactly as it was mapped: one page at a time.
    CU_TRY(driver().cuMemUnmap(va, gran_));
    return HVMM_OK;
  }
  int synchronize(void* stream) override {
    if (int st = ensure_context()) return st;
    if (stream) {
      const CUresult rc = driver().cuStreamSynchronize(static_cast<CUstream>(stream));
      // A stream of a (green) context already destroyed has nothing left to run: destroying the context
      // ended its work. Torch frees such blocks at exit, after the SM partitions are gone.
      if (rc != 0 && rc != kContextIsDestroyed) return cu_fail("cuStreamSynchronize", rc);
    }
    CU_TRY(driver().cuCtxSynchronize());
    return HVMM_OK;
  }

 private:
  // Threads that never touched CUDA have no current context; torch uses the primary one.
  int ensure_context() {
    CUcontext cur = nullptr;
    CU_TRY(driver().cuCtxGetCurrent(&cur));
    if (!cur) CU_TRY(driver().cuCtxSetCurrent(ctx_));
    return HVMM_OK;
  }

  CUdevice dev_;
  CUcontext ctx_;
  size_t gran_;
  CUmemAllocationProp prop_;
  CUmemAccessDesc access_;
};

}  // namespace

bool cuda_driver_available(std::string* why) {
  const Driver& d = driver();
  if (!d.ok) {
    *why = d.why;
    return false;
  }
  int count = 0;
  if (d.cuDeviceGetCount(&count) != 0 || count == 0) {
    *why = "the CUDA driver reports no device";
    return false;
  }
  return true;
}

std::unique_ptr<Backend> make_cuda_backend(int device, std::string* why) {
  if (!cuda_driver_available(why)) return nullptr;
  const Driver& d = driver();
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  if (d.cuDeviceGet(&dev, device) != 0 || d.cuDevicePrimaryCtxRetain(&ctx, dev) != 0) {
    *why = "CUDA device " + std::to_string(device) + " cannot be opened";
    return nullptr;
  }
  CUcontext cur = nullptr;
  if (d.cuCtxGetCurrent(&cur) == 0 && cur == nullptr) d.cuCtxSetCurrent(ctx);
  const CUmemAllocationProp prop = CudaBackend::make_prop(dev);
  size_t gran = 0;
  const CUresult rc = d.cuMemGetAllocationGranularity(&gran, &prop, 0 /* MINIMUM */);
  if (rc != 0 || gran == 0) {
    d.cuDevicePrimaryCtxRelease(dev);
    *why = "cuMemGetAllocationGranularity failed with CUresult " + std::to_string(rc);
    return nullptr;
  }
  return std::make_unique<CudaBackend>(dev, ctx, gran);
}

}  // namespace hvmm
