#include "pool.h"

#include <algorithm>
#include <chrono>
#include <limits>

namespace hvmm {
namespace {

thread_local std::string t_last_error;

// Adds the wall time of one backend call to a stats counter.
class CallTimer {
 public:
  explicit CallTimer(uint64_t* acc) : acc_(acc), t0_(std::chrono::steady_clock::now()) {}
  ~CallTimer() {
    *acc_ += static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                       std::chrono::steady_clock::now() - t0_)
                                       .count());
  }

 private:
  uint64_t* acc_;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace

int fail(int code, const std::string& msg) {
  t_last_error = msg;
  return code;
}

const std::string& last_error() { return t_last_error; }

Pool::Pool(std::unique_ptr<Backend> backend, size_t budget_pages)
    : backend_(std::move(backend)), page_(backend_->page_bytes()), budget_(budget_pages) {
  pages_.reserve(budget_);
  free_.reserve(budget_);
}

Pool::~Pool() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int> ids;
  for (const auto& kv : regions_) ids.push_back(kv.first);
  for (int id : ids) release_locked(id);
  for (const Page& p : pages_) backend_->release_page(p.handle);
}

int Pool::create_page_locked(size_t* index) {
  uint64_t handle = 0;
  int st;
  {
    CallTimer t(&st_.create_ns);
    st = backend_->create_page(&handle);
  }
  st_.create_calls++;
  if (st != HVMM_OK) return st;
  pages_.push_back(Page{handle});
  *index = pages_.size() - 1;
  return HVMM_OK;
}

int Pool::precreate() {
  std::lock_guard<std::mutex> lock(mu_);
  while (pages_.size() < budget_) {
    size_t index = 0;
    if (int st = create_page_locked(&index)) return st;
    free_.push_back(index);
  }
  return HVMM_OK;
}

int Pool::add_tenant(const char* name, size_t quota_pages, int* tenant) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string n = name ? name : "";
  for (const Tenant& t : tenants_)
    if (t.name == n) return fail(HVMM_ERR_INVALID, "tenant '" + n + "' already exists");
  tenants_.push_back(Tenant{n, quota_pages ? quota_pages : std::numeric_limits<size_t>::max()});
  *tenant = static_cast<int>(tenants_.size() - 1);
  return HVMM_OK;
}

int Pool::set_quota(int tenant, size_t quota_pages) {
  std::lock_guard<std::mutex> lock(mu_);
  if (tenant < 0 || tenant >= static_cast<int>(tenants_.size()))
    return fail(HVMM_ERR_INVALID, "unknown tenant " + std::to_string(tenant));
  tenants_[tenant].quota = quota_pages ? quota_pages : std::numeric_limits<size_t>::max();
  return HVMM_OK;
}

int Pool::tenant_stats(int tenant, hvmm_tenant_stats_t* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (tenant < 0 || tenant >= static_cast<int>(tenants_.size()))
    return fail(HVMM_ERR_INVALID, "unknown tenant " + std::to_string(tenant));
  const Tenant& t = tenants_[tenant];
  *out = hvmm_tenant_stats_t{t.quota == std::numeric_limits<size_t>::max() ? 0 : t.quota,
                           t.used,
                           t.peak,
                           t.regions,
                           t.mapped_total,
                           t.unmapped_total};
  return HVMM_OK;
}

int Pool::lookup_region(int region_id, Region** out) {
  auto it = regions_.find(region_id);
  if (it == regions_.end()) return fail(HVMM_ERR_INVALID, "unknown region " + std::to_string(region_id));
  *out = &it->second;
  return HVMM_OK;
}

int Pool::reserve(int tenant, size_t n_slots, int* region, uintptr_t* va) {
  std::lock_guard<std::mutex> lock(mu_);
  if (tenant < 0 || tenant >= static_cast<int>(tenants_.size()))
    return fail(HVMM_ERR_INVALID, "unknown tenant " + std::to_string(tenant));
  if (n_slots == 0) return fail(HVMM_ERR_INVALID, "a region needs at least one page");
  uintptr_t base = 0;
  if (int st = backend_->reserve(n_slots * page_, &base)) return st;
  const int id = next_region_++;
  regions_.emplace(id, Region{tenant, base, n_slots, 0, std::vector<int64_t>(n_slots, -1)});
  region_by_va_[base] = id;
  tenants_[tenant].regions++;
  *region = id;
  *va = base;
  return HVMM_OK;
}

int Pool::release(int region) {
  std::lock_guard<std::mutex> lock(mu_);
  return release_locked(region);
}

int Pool::release_locked(int region_id) {
  Region* r = nullptr;
  if (int st = lookup_region(region_id, &r)) return st;
  std::vector<size_t> slots;
  for (size_t s = 0; s < r->n_slots; ++s)
    if (r->slot_page[s] >= 0) slots.push_back(s);
  if (int st = unmap_locked(region_id, slots)) return st;
  if (int st = backend_->free_va(r->va, r->n_slots * page_)) return st;
  tenants_[r->tenant].regions--;
  region_by_va_.erase(r->va);
  regions_.erase(region_id);
  return HVMM_OK;
}

int Pool::map(int region, const size_t* slots, size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  return map_locked(region, std::vector<size_t>(slots, slots + n));
}

std::string Pool::usage_locked() const {
  std::string s;
  for (const Tenant& t : tenants_) s += (s.empty() ? "" : ", ") + t.name + "=" + std::to_string(t.used);
  return s.empty() ? "no tenants" : s;
}

int Pool::map_locked(int region_id, std::vector<size_t> slots) {
  Region* r = nullptr;
  if (int st = lookup_region(region_id, &r)) return st;
  std::sort(slots.begin(), slots.end());
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i] >= r->n_slots)
      return fail(HVMM_ERR_INVALID, "slot " + std::to_string(slots[i]) + " is outside region " +
                                        std::to_string(region_id) + " of " + std::to_string(r->n_slots) +
                                        " pages");
    if ((i > 0 && slots[i] == slots[i - 1]) || r->slot_page[slots[i]] >= 0)
      return fail(HVMM_ERR_INVALID, "slot " + std::to_string(slots[i]) + " of region " +
                                        std::to_string(region_id) + " is already mapped");
  }
  const size_t n = slots.size();
  if (n == 0) return HVMM_OK;
  Tenant& t = tenants_[r->tenant];
  if (t.used + n > t.quota) {
    st_.quota_errors++;
    return fail(HVMM_ERR_QUOTA, "tenant '" + t.name + "' is at its quota: owns " + std::to_string(t.used) +
                                    " of " + std::to_string(t.quota) + " pages and asked for " +
                                    std::to_string(n) + " more");
  }
  const size_t available = free_.size() + (budget_ - pages_.size());
  if (n > available) {
    st_.exhausted_errors++;
    return fail(HVMM_ERR_EXHAUSTED, "page pool exhausted: tenant '" + t.name + "' asked for " +
                                        std::to_string(n) + " pages, " + std::to_string(available) +
                                        " of " + std::to_string(budget_) + " are free (pages owned: " +
                                        usage_locked() + ")");
  }

  std::vector<size_t> taken;
  taken.reserve(n);
  auto give_back = [&](size_t n_mapped) {
    for (size_t k = 0; k < n_mapped; ++k) backend_->unmap_page(r->va + slots[k] * page_);
    free_.insert(free_.end(), taken.begin(), taken.end());
  };
  while (taken.size() < n) {
    if (!free_.empty()) {
      taken.push_back(free_.back());
      free_.pop_back();
      continue;
    }
    size_t index = 0;
    if (int st = create_page_locked(&index)) {
      give_back(0);
      return st;
    }
    taken.push_back(index);
  }
  // Map runs of consecutive slots, one set-access call per run (it dominates the cost per page).
  for (size_t i = 0; i < n;) {
    size_t j = i;
    while (j + 1 < n && slots[j + 1] == slots[j] + 1) ++j;
    for (size_t k = i; k <= j; ++k) {
      int st;
      {
        CallTimer tm(&st_.map_ns);
        st = backend_->map_page(r->va + slots[k] * page_, pages_[taken[k]].handle);
      }
      st_.map_calls++;
      if (st != HVMM_OK) {
        give_back(k);
        return st;
      }
    }
    int st;
    {
      CallTimer tm(&st_.set_access_ns);
      st = backend_->set_access(r->va + slots[i] * page_, (j - i + 1) * page_);
    }
    st_.set_access_calls++;
    if (st != HVMM_OK) {
      give_back(j + 1);
      return st;
    }
    i = j + 1;
  }
  for (size_t k = 0; k < n; ++k) {
    Page& p = pages_[taken[k]];
    p.tenant = r->tenant;
    p.region = region_id;
    p.slot = slots[k];
    r->slot_page[slots[k]] = static_cast<int64_t>(taken[k]);
  }
  r->n_mapped += n;
  t.used += n;
  t.peak = std::max(t.peak, t.used);
  t.mapped_total += n;
  return HVMM_OK;
}

int Pool::unmap(int region, const size_t* slots, size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  return unmap_locked(region, std::vector<size_t>(slots, slots + n));
}

int Pool::unmap_locked(int region_id, std::vector<size_t> slots) {
  Region* r = nullptr;
  if (int st = lookup_region(region_id, &r)) return st;
  std::sort(slots.begin(), slots.end());
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i] >= r->n_slots || r->slot_page[slots[i]] < 0 || (i > 0 && slots[i] == slots[i - 1]))
      return fail(HVMM_ERR_INVALID, "slot " + std::to_string(slots[i]) + " of region " +
                                        std::to_string(region_id) + " is not mapped");
  }
  Tenant& t = tenants_[r->tenant];
  for (size_t s : slots) {
    int st;
    {
      CallTimer tm(&st_.unmap_ns);
      st = backend_->unmap_page(r->va + s * page_);
    }
    st_.unmap_calls++;
    // A failed unmap leaves that page (and those after it) mapped and owned: the books stay exact.
    if (st != HVMM_OK) return st;
    const size_t index = static_cast<size_t>(r->slot_page[s]);
    pages_[index] = Page{pages_[index].handle};
    free_.push_back(index);
    r->slot_page[s] = -1;
    r->n_mapped--;
    t.used--;
    t.unmapped_total++;
  }
  return HVMM_OK;
}

int Pool::mapped(int region, uint8_t* out, size_t n) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.find(region);
  if (it == regions_.end()) return fail(HVMM_ERR_INVALID, "unknown region " + std::to_string(region));
  const Region& r = it->second;
  for (size_t s = 0; s < std::min(n, r.n_slots); ++s) out[s] = r.slot_page[s] >= 0 ? 1 : 0;
  return HVMM_OK;
}

int Pool::find(uintptr_t addr, int* region) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = region_by_va_.upper_bound(addr);
  if (it != region_by_va_.begin()) {
    --it;
    const Region& r = regions_.at(it->second);
    if (addr < r.va + r.n_slots * page_) {
      *region = it->second;
      return HVMM_OK;
    }
  }
  return fail(HVMM_ERR_INVALID, "address is not inside any region of this pool");
}

int Pool::torch_alloc(int tenant, size_t bytes, uintptr_t* va) {
  std::lock_guard<std::mutex> lock(mu_);
  if (tenant < 0 || tenant >= static_cast<int>(tenants_.size()))
    return fail(HVMM_ERR_INVALID, "unknown tenant " + std::to_string(tenant));
  const size_t n = std::max<size_t>(1, (bytes + page_ - 1) / page_);
  uintptr_t base = 0;
  if (int st = backend_->reserve(n * page_, &base)) return st;
  const int id = next_region_++;
  regions_.emplace(id, Region{tenant, base, n, 0, std::vector<int64_t>(n, -1)});
  region_by_va_[base] = id;
  tenants_[tenant].regions++;
  std::vector<size_t> slots(n);
  for (size_t s = 0; s < n; ++s) slots[s] = s;
  if (int st = map_locked(id, slots)) {
    const std::string why = last_error();
    release_locked(id);
    return fail(st, why);
  }
  torch_regions_[base] = id;
  st_.torch_allocs++;
  *va = base;
  return HVMM_OK;
}

int Pool::torch_free(uintptr_t va, void* stream) {
  // Wait outside the lock: other tenants keep mapping while this allocation's work drains.
  if (int st = backend_->synchronize(stream)) return st;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = torch_regions_.find(va);
  if (it == torch_regions_.end()) return fail(HVMM_ERR_INVALID, "free of an address this pool did not allocate");
  const int id = it->second;
  torch_regions_.erase(it);
  st_.torch_frees++;
  return release_locked(id);
}

int Pool::check() const {
  std::lock_guard<std::mutex> lock(mu_);
  auto drift = [](const std::string& what) { return fail(HVMM_ERR_INVALID, "accounting drift: " + what); };
  if (pages_.size() > budget_) return drift("more pages created than the budget");
  std::vector<char> in_free(pages_.size(), 0);
  for (size_t index : free_) {
    if (index >= pages_.size() || in_free[index]) return drift("free list holds a bad or repeated page");
    in_free[index] = 1;
  }
  std::vector<size_t> owned(tenants_.size(), 0);
  for (size_t i = 0; i < pages_.size(); ++i) {
    const Page& p = pages_[i];
    const std::string name = "page " + std::to_string(i);
    if (p.tenant == kNone) {
      if (!in_free[i] || p.region != kNone) return drift(name + " has no owner but is not free");
      continue;
    }
    if (in_free[i]) return drift(name + " is owned and on the free list");
    if (p.tenant < 0 || p.tenant >= static_cast<int>(tenants_.size())) return drift(name + " has a bad owner");
    auto it = regions_.find(p.region);
    if (it == regions_.end() || it->second.tenant != p.tenant || p.slot >= it->second.n_slots ||
        it->second.slot_page[p.slot] != static_cast<int64_t>(i))
      return drift(name + " is not mapped where its owner says");
    owned[p.tenant]++;
  }
  for (const auto& kv : regions_) {
    size_t n = 0;
    for (int64_t index : kv.second.slot_page) {
      if (index < 0) continue;
      if (index >= static_cast<int64_t>(pages_.size()) || pages_[index].region != kv.first)
        return drift("region " + std::to_string(kv.first) + " maps a page it does not own");
      n++;
    }
    if (n != kv.second.n_mapped) return drift("region " + std::to_string(kv.first) + " miscounts its pages");
  }
  size_t total = 0;
  for (size_t t = 0; t < tenants_.size(); ++t) {
    if (owned[t] != tenants_[t].used)
      return drift("tenant '" + tenants_[t].name + "' counts " + std::to_string(tenants_[t].used) +
                   " pages but owns " + std::to_string(owned[t]));
    if (tenants_[t].used > tenants_[t].quota) return drift("tenant '" + tenants_[t].name + "' is over quota");
    total += owned[t];
  }
  if (total + free_.size() != pages_.size()) return drift("owned + free != created");
  return HVMM_OK;
}

void Pool::stats(hvmm_stats_t* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  *out = st_;
  out->page_bytes = page_;
  out->budget_pages = budget_;
  out->created_pages = pages_.size();
  out->owned_pages = pages_.size() - free_.size();
  out->free_pages = budget_ - out->owned_pages;
  out->tenants = tenants_.size();
  out->regions = regions_.size();
}

}  // namespace hvmm
