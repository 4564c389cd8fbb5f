// C ABI of the harli VMM page pool (libharli _vmm). Loaded from Python through ctypes; the torch
// pluggable-allocator pair (hvmm_torch_alloc / hvmm_torch_free) is loaded by torch itself.
//
// Every function that can fail returns an hvmm status; on failure hvmm_last_error() holds a message
// for the calling thread. Sizes are in bytes unless the name says pages; a "slot" is a page-sized
// position inside a reserved virtual range (a region).
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define HVMM_API __attribute__((visibility("default")))

enum hvmm_status {
  HVMM_OK = 0,
  HVMM_ERR_EXHAUSTED = 1,    // the pool has fewer free pages than asked for
  HVMM_ERR_QUOTA = 2,        // the tenant would exceed its quota
  HVMM_ERR_INVALID = 3,      // bad argument or state (slot already mapped, unknown region, ...)
  HVMM_ERR_BACKEND = 4,      // the driver / the OS refused a call
  HVMM_ERR_UNAVAILABLE = 5,  // the requested backend cannot run here (no libcuda.so.1, no device)
};

enum hvmm_backend { HVMM_BACKEND_AUTO = 0, HVMM_BACKEND_CUDA = 1, HVMM_BACKEND_HOST = 2 };

typedef struct hvmm_pool hvmm_pool;

typedef struct hvmm_stats {
  uint64_t page_bytes, budget_pages, created_pages, free_pages, owned_pages, tenants, regions;
  uint64_t create_calls, create_ns, map_calls, map_ns, set_access_calls, set_access_ns;
  uint64_t unmap_calls, unmap_ns;
  uint64_t exhausted_errors, quota_errors, torch_allocs, torch_frees;
} hvmm_stats_t;

typedef struct hvmm_tenant_stats {
  uint64_t quota_pages, used_pages, peak_pages, regions, pages_mapped_total, pages_unmapped_total;
} hvmm_tenant_stats_t;

HVMM_API const char* hvmm_last_error(void);
// 1 when libcuda.so.1 loads, cuInit succeeds and at least one device exists.
HVMM_API int hvmm_cuda_available(void);
HVMM_API size_t hvmm_stats_size(void);
HVMM_API size_t hvmm_tenant_stats_size(void);

// budget_bytes is rounded down to whole pages. The page is the driver's granularity on CUDA and
// host_page_bytes (a multiple of the OS page) on the host backend. precreate=1 creates every physical
// page up front (creating costs ~4x mapping on the H200); otherwise pages are created on first use.
// Created pages are kept until the pool is destroyed.
HVMM_API int hvmm_pool_create(int backend, int device, size_t budget_bytes, size_t host_page_bytes,
                              int precreate, hvmm_pool** out);
// Unmaps and releases everything. The caller must make sure no queued device work uses the pool.
HVMM_API void hvmm_pool_destroy(hvmm_pool* pool);
HVMM_API int hvmm_pool_backend(const hvmm_pool* pool);
HVMM_API size_t hvmm_pool_page_bytes(const hvmm_pool* pool);

// quota_pages = 0 means "no quota beyond the budget".
HVMM_API int hvmm_tenant_add(hvmm_pool* pool, const char* name, size_t quota_pages, int* tenant);
HVMM_API int hvmm_tenant_set_quota(hvmm_pool* pool, int tenant, size_t quota_pages);
HVMM_API int hvmm_tenant_stats(const hvmm_pool* pool, int tenant, hvmm_tenant_stats_t* out);

// Reserves n_slots pages of virtual addresses for a tenant; nothing is mapped yet.
HVMM_API int hvmm_region_reserve(hvmm_pool* pool, int tenant, size_t n_slots, int* region,
                                 uint64_t* va);
// Unmaps whatever is mapped and frees the virtual range. Same synchronisation rule as unmap.
HVMM_API int hvmm_region_release(hvmm_pool* pool, int region);
// Maps one free page into each listed slot, all or nothing; consecutive slots share one set-access
// call. The pages' previous contents are undefined.
HVMM_API int hvmm_region_map(hvmm_pool* pool, int region, const size_t* slots, size_t n);
// Unmaps the listed slots, all or nothing, and returns their pages to the pool. The driver does not
// wait for queued GPU work: synchronise every stream that may touch these slots first.
HVMM_API int hvmm_region_unmap(hvmm_pool* pool, int region, const size_t* slots, size_t n);
// out[i] = 1 when slot i is mapped, for i < min(n, region slots).
HVMM_API int hvmm_region_mapped(const hvmm_pool* pool, int region, uint8_t* out, size_t n);
// The region whose reserved range holds addr.
HVMM_API int hvmm_pool_find(const hvmm_pool* pool, uint64_t addr, int* region);

// Accounting invariant: every created page is free or owned by exactly one tenant through exactly one
// mapped slot; tenant usage equals the pages it owns and stays within its quota.
HVMM_API int hvmm_pool_check(const hvmm_pool* pool);
HVMM_API int hvmm_pool_stats(const hvmm_pool* pool, hvmm_stats_t* out);
// Waits for the stream (a CUstream, may be NULL) and the current context (no-op on host).
HVMM_API int hvmm_pool_synchronize(hvmm_pool* pool, void* stream);

// torch.cuda.memory.CUDAPluggableAllocator pair. hvmm_torch_bind routes it to one tenant of one
// pool (pool = NULL unbinds). Each allocation is its own region of whole pages; free waits for the
// allocation's stream and the context before unmapping.
HVMM_API int hvmm_torch_bind(hvmm_pool* pool, int tenant);
HVMM_API void* hvmm_torch_alloc(size_t size, int device, void* stream);
HVMM_API void hvmm_torch_free(void* ptr, size_t size, int device, void* stream);

#ifdef __cplusplus
}
#endif
