// Physical-page backends of the pool: the CUDA driver's virtual memory API, and host memory
// (memfd + mmap MAP_FIXED) with the same semantics for machines without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace hvmm {

// Records msg as the calling thread's last error and returns code.
int fail(int code, const std::string& msg);
const std::string& last_error();

// One physical page is one handle of page_bytes(). All calls return an hvmm_status.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual int kind() const = 0;  // HVMM_BACKEND_CUDA / HVMM_BACKEND_HOST
  virtual size_t page_bytes() const = 0;
  virtual int create_page(uint64_t* handle) = 0;
  virtual int release_page(uint64_t handle) = 0;
  virtual int reserve(size_t bytes, uintptr_t* va) = 0;
  virtual int free_va(uintptr_t va, size_t bytes) = 0;
  // Maps a page without access rights; set_access grants read/write over a run of mapped pages.
  virtual int map_page(uintptr_t va, uint64_t handle) = 0;
  virtual int set_access(uintptr_t va, size_t bytes) = 0;
  virtual int unmap_page(uintptr_t va) = 0;
  // Waits for queued device work on stream (may be null) and on the current context.
  virtual int synchronize(void* stream) = 0;
};

// nullptr (and *why) when libcuda.so.1, cuInit or the device is missing.
std::unique_ptr<Backend> make_cuda_backend(int device, std::string* why);
std::unique_ptr<Backend> make_host_backend(size_t page_bytes, std::string* why);
bool cuda_driver_available(std::string* why);

}  // namespace hvmm
