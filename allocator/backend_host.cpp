// Host-memory backend with the semantics of the CUDA one, for tests on machines without a GPU.
// A physical page is a page-sized slice of one memfd; a reserved range is a PROT_NONE anonymous
// mapping; mapping a page replaces part of it with the memfd slice (MAP_FIXED), still PROT_NONE
// until set_access, and unmapping puts a PROT_NONE anonymous mapping back so the range stays
// reserved. Touching an unmapped address faults, like an illegal address on the GPU.
#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "backend.h"
#include "hvmm.h"

namespace hvmm {
namespace {

int os_fail(const char* what) {
  return fail(HVMM_ERR_BACKEND, std::string(what) + " failed: " + std::strerror(errno));
}

class HostBackend final : public Backend {
 public:
  HostBackend(int fd, size_t page_bytes) : fd_(fd), page_(page_bytes) {}
  ~HostBackend() override { close(fd_); }

  int kind() const override { return HVMM_BACKEND_HOST; }
  size_t page_bytes() const override { return page_; }

  int create_page(uint64_t* handle) override {
    if (!free_slices_.empty()) {
      *handle = free_slices_.back();
      free_slices_.pop_back();
      return HVMM_OK;
    }
    if (ftruncate(fd_, static_cast<off_t>((n_slices_ + 1) * page_)) != 0) return os_fail("ftruncate");
    *handle = n_slices_++;
    return HVMM_OK;
  }

  int release_page(uint64_t handle) override {
    // Give the memory back to the OS but keep the file size, so other slices keep their offsets.
    if (fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(handle * page_),
                  static_cast<off_t>(page_)) != 0)
      return os_fail("fallocate(PUNCH_HOLE)");
    free_slices_.push_back(handle);
    return HVMM_OK;
  }

  int reserve(size_t bytes, uintptr_t* va) override {
    // Over-reserve by one page and trim, so the range is page-aligned as cuMemAddressReserve's is.
    const size_t span = bytes + page_;
    void* p = mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return os_fail("mmap(reserve)");
    const uintptr_t base = reinterpret_cast<uintptr_t>(p);
    const uintptr_t aligned = (base + page_ - 1) / page_ * page_;
    if (aligned > base) munmap(p, aligned - base);
    const uintptr_t end = aligned + bytes;
    if (base + span > end) munmap(reinterpret_cast<void*>(end), base + span - end);
    *va = aligned;
    return HVMM_OK;
  }

  int free_va(uintptr_t va, size_t bytes) override {
    if (munmap(reinterpret_cast<void*>(va), bytes) != 0) return os_fail("munmap");
    return HVMM_OK;
  }

  int map_page(uintptr_t va, uint64_t handle) override {
    void* p = mmap(reinterpret_cast<void*>(va), page_, PROT_NONE, MAP_SHARED | MAP_FIXED, fd_,
                   static_cast<off_t>(handle * page_));
    if (p == MAP_FAILED) return os_fail("mmap(map page)");
    return HVMM_OK;
  }

  int set_access(uintptr_t va, size_t bytes) override {
    if (mprotect(reinterpret_cast<void*>(va), bytes, PROT_READ | PROT_WRITE) != 0)
      return os_fail("mprotect");
    return HVMM_OK;
  }

  int unmap_page(uintptr_t va) override {
    void* p = mmap(reinterpret_cast<void*>(va), page_, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return os_fail("mmap(unmap page)");
    return HVMM_OK;
  }

  int synchronize(void*) override { return HVMM_OK; }

 private:
  int fd_;
  size_t page_;
  uint64_t n_slices_ = 0;
  std::vector<uint64_t> free_slices_;
};

}  // namespace

std::unique_ptr<Backend> make_host_backend(size_t page_bytes, std::string* why) {
  const size_t os_page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  if (page_bytes == 0 || page_bytes % os_page != 0) {
    *why = "host page size " + std::to_string(page_bytes) + " is not a positive multiple of the OS page (" +
           std::to_string(os_page) + " bytes)";
    return nullptr;
  }
  const int fd = memfd_create("harli-vmm-pool", MFD_CLOEXEC);
  if (fd < 0) {
    *why = std::string("memfd_create failed: ") + std::strerror(errno);
    return nullptr;
  }
  return std::make_unique<HostBackend>(fd, page_bytes);
}

}  // namespace hvmm
