// The page pool: a budget of physical pages shared by tenants, each page free or mapped into exactly
// one slot of one region of one tenant. One mutex guards all of it; driver calls run under it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "backend.h"
#include "hvmm.h"

namespace hvmm {

class Pool {
 public:
  Pool(std::unique_ptr<Backend> backend, size_t budget_pages);
  ~Pool();

  int precreate();
  int kind() const { return backend_->kind(); }
  size_t page_bytes() const { return page_; }

  int add_tenant(const char* name, size_t quota_pages, int* tenant);
  int set_quota(int tenant, size_t quota_pages);
  int tenant_stats(int tenant, hvmm_tenant_stats_t* out) const;

  int reserve(int tenant, size_t n_slots, int* region, uintptr_t* va);
  int release(int region);
  int map(int region, const size_t* slots, size_t n);
  int unmap(int region, const size_t* slots, size_t n);
  int mapped(int region, uint8_t* out, size_t n) const;
  int find(uintptr_t addr, int* region) const;

  // A region of whole pages, fully mapped, for one torch allocation; freed by its address.
  int torch_alloc(int tenant, size_t bytes, uintptr_t* va);
  int torch_free(uintptr_t va, void* stream);

  int check() const;
  void stats(hvmm_stats_t* out) const;
  int synchronize(void* stream) { return backend_->synchronize(stream); }

 private:
  static constexpr int kNone = -1;
  struct Page {
    uint64_t handle;
    int tenant = kNone;
    int region = kNone;
    size_t slot = 0;
  };
  struct Tenant {
    std::string name;
    size_t quota;
    size_t used = 0, peak = 0, regions = 0, mapped_total = 0, unmapped_total = 0;
  };
  struct Region {
    int tenant;
    uintptr_t va;
    size_t n_slots;
    size_t n_mapped = 0;
    std::vector<int64_t> slot_page;  // page index per slot, or -1
  };

  int create_page_locked(size_t* index);
  int map_locked(int region_id, std::vector<size_t> slots);
  int unmap_locked(int region_id, std::vector<size_t> slots);
  int release_locked(int region_id);
  int lookup_region(int region_id, Region** out);
  std::string usage_locked() const;

  std::unique_ptr<Backend> backend_;
  const size_t page_;
  const size_t budget_;
  std::vector<Page> pages_;  // created pages
  std::vector<size_t> free_;  // indices into pages_
  std::vector<Tenant> tenants_;
  std::unordered_map<int, Region> regions_;
  std::map<uintptr_t, int> region_by_va_;  // start address -> region, for find()
  std::unordered_map<uintptr_t, int> torch_regions_;
  int next_region_ = 0;
  hvmm_stats_t st_{};
  mutable std::mutex mu_;
};

}  // namespace hvmm
