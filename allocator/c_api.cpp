// extern "C" surface of the pool (see hvmm.h): argument checks and status plumbing only.
#include <atomic>
#include <cstdio>
#include <new>

#include "backend.h"
#include "hvmm.h"
#include "pool.h"

struct hvmm_pool {
  hvmm::Pool pool;
  int device;
};

namespace {

int no_pool() { return hvmm::fail(HVMM_ERR_INVALID, "pool handle is NULL"); }

// The torch allocator pair has a fixed signature, so its target pool is process-wide state.
std::atomic<hvmm_pool*> g_torch_pool{nullptr};
std::atomic<int> g_torch_tenant{-1};

}  // namespace

extern "C" {

const char* hvmm_last_error(void) { return hvmm::last_error().c_str(); }

int hvmm_cuda_available(void) {
  std::string why;
  return hvmm::cuda_driver_available(&why) ? 1 : 0;
}

size_t hvmm_stats_size(void) { return sizeof(hvmm_stats_t); }
size_t hvmm_tenant_stats_size(void) { return sizeof(hvmm_tenant_stats_t); }

int hvmm_pool_create(int backend, int device, size_t budget_bytes, size_t host_page_bytes, int precreate,
                     hvmm_pool** out) {
  if (!out) return hvmm::fail(HVMM_ERR_INVALID, "out is NULL");
  *out = nullptr;
  std::string why;
  std::unique_ptr<hvmm::Backend> b;
  if (backend == HVMM_BACKEND_CUDA || backend == HVMM_BACKEND_AUTO) {
    b = hvmm::make_cuda_backend(device, &why);
    if (!b && backend == HVMM_BACKEND_CUDA)
      return hvmm::fail(HVMM_ERR_UNAVAILABLE, "CUDA backend unavailable: " + why);
  }
  if (!b) {
    if (backend != HVMM_BACKEND_HOST && backend != HVMM_BACKEND_AUTO)
      return hvmm::fail(HVMM_ERR_INVALID, "unknown backend " + std::to_string(backend));
    b = hvmm::make_host_backend(host_page_bytes, &why);
    if (!b) return hvmm::fail(HVMM_ERR_UNAVAILABLE, "host backend unavailable: " + why);
  }
  const size_t pages = budget_bytes / b->page_bytes();
  if (pages == 0)
    return hvmm::fail(HVMM_ERR_INVALID, "budget of " + std::to_string(budget_bytes) +
                                            " bytes is less than one page of " +
                                            std::to_string(b->page_bytes()));
  auto* p = new (std::nothrow) hvmm_pool{hvmm::Pool(std::move(b), pages), device};
  if (!p) return hvmm::fail(HVMM_ERR_BACKEND, "out of host memory");
  if (precreate) {
    if (int st = p->pool.precreate()) {
      const std::string msg = hvmm::last_error();
      delete p;
      return hvmm::fail(st, "creating the pool's pages: " + msg);
    }
  }
  *out = p;
  return HVMM_OK;
}

void hvmm_pool_destroy(hvmm_pool* pool) {
  if (!pool) return;
  hvmm_pool* expected = pool;
  if (g_torch_pool.compare_exchange_strong(expected, nullptr)) g_torch_tenant = -1;
  delete pool;
}

int hvmm_pool_backend(const hvmm_pool* pool) { return pool ? pool->pool.kind() : no_pool(); }
size_t hvmm_pool_page_bytes(const hvmm_pool* pool) { return pool ? pool->pool.page_bytes() : 0; }

int hvmm_tenant_add(hvmm_pool* pool, const char* name, size_t quota_pages, int* tenant) {
  if (!pool || !tenant) return no_pool();
  return pool->pool.add_tenant(name, quota_pages, tenant);
}

int hvmm_tenant_set_quota(hvmm_pool* pool, int tenant, size_t quota_pages) {
  return pool ? pool->pool.set_quota(tenant, quota_pages) : no_pool();
}

int hvmm_tenant_stats(const hvmm_pool* pool, int tenant, hvmm_tenant_stats_t* out) {
  if (!pool || !out) return no_pool();
  return pool->pool.tenant_stats(tenant, out);
}

int hvmm_region_reserve(hvmm_pool* pool, int tenant, size_t n_slots, int* region, uint64_t* va) {
  if (!pool || !region || !va) return no_pool();
  uintptr_t base = 0;
  const int st = pool->pool.reserve(tenant, n_slots, region, &base);
  *va = base;
  return st;
}

int hvmm_region_release(hvmm_pool* pool, int region) { return pool ? pool->pool.release(region) : no_pool(); }

int hvmm_region_map(hvmm_pool* pool, int region, const size_t* slots, size_t n) {
  if (!pool || (n && !slots)) return no_pool();
  return pool->pool.map(region, slots, n);
}

int hvmm_region_unmap(hvmm_pool* pool, int region, const size_t* slots, size_t n) {
  if (!pool || (n && !slots)) return no_pool();
  return pool->pool.unmap(region, slots, n);
}

int hvmm_region_mapped(const hvmm_pool* pool, int region, uint8_t* out, size_t n) {
  if (!pool || (n && !out)) return no_pool();
  return pool->pool.mapped(region, out, n);
}

int hvmm_pool_find(const hvmm_pool* pool, uint64_t addr, int* region) {
  if (!pool || !region) return no_pool();
  return pool->pool.find(addr, region);
}

int hvmm_pool_check(const hvmm_pool* pool) { return pool ? pool->pool.check() : no_pool(); }

int hvmm_pool_stats(const hvmm_pool* pool, hvmm_stats_t* out) {
  if (!pool || !out) return no_pool();
  pool->pool.stats(out);
  return HVMM_OK;
}

int hvmm_pool_synchronize(hvmm_pool* pool, void* stream) {
  return pool ? pool->pool.synchronize(stream) : no_pool();
}

int hvmm_torch_bind(hvmm_pool* pool, int tenant) {
  g_torch_tenant = pool ? tenant : -1;
  g_torch_pool = pool;
  return HVMM_OK;
}

void* hvmm_torch_alloc(size_t size, int device, void* /*stream*/) {
  hvmm_pool* pool = g_torch_pool.load();
  if (!pool) {
    hvmm::fail(HVMM_ERR_INVALID, "hvmm_torch_alloc: no pool is bound (hvmm_torch_bind)");
    return nullptr;
  }
  if (device != pool->device && pool->pool.kind() == HVMM_BACKEND_CUDA) {
    hvmm::fail(HVMM_ERR_INVALID, "hvmm_torch_alloc: device " + std::to_string(device) +
                                     " is not the pool's device " + std::to_string(pool->device));
    return nullptr;
  }
  uintptr_t va = 0;
  if (pool->pool.torch_alloc(g_torch_tenant.load(), size, &va) != HVMM_OK) return nullptr;
  return reinterpret_cast<void*>(va);
}

void hvmm_torch_free(void* ptr, size_t /*size*/, int /*device*/, void* stream) {
  hvmm_pool* pool = g_torch_pool.load();
  if (!ptr) return;
  // torch ignores errors here; say it on stderr, since a lost free is a leak of pool pages.
  if (!pool) {
    std::fprintf(stderr, "hvmm_torch_free: no pool is bound; %p leaks\n", ptr);
    return;
  }
  if (pool->pool.torch_free(reinterpret_cast<uintptr_t>(ptr), stream) != HVMM_OK)
    std::fprintf(stderr, "hvmm_torch_free(%p): %s\n", ptr, hvmm::last_error().c_str());
}

}  // extern "C"
