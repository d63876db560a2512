/* Memory for packed weights (float_linear.cpp, block_linear.cpp): a decode step streams every weight
 * from DRAM once, so with 4 KB pages each page is a TLB miss whose page walk itself misses the
 * caches. Where the kernel's transparent huge pages are on request ("madvise", a common default)
 * buffers of 2 MB and more are fresh 2 MB-aligned mappings asked for huge pages before their first
 * write (README, CPU execution, for what it measured). */
#ifndef KVFLOW_WEIGHT_MEMORY_H
#define KVFLOW_WEIGHT_MEMORY_H

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

namespace kvflow {

constexpr size_t HUGE_PAGE = size_t(2) << 20;

/* `bytes` of 64-byte-aligned memory; from 2 MB up a fresh mapping aligned to 2 MB with huge pages
 * requested before anything touches it (reused heap memory would already sit in 4 KB pages). Give it
 * back with free_weights(p, bytes). */
inline void* alloc_weights(size_t bytes) {
  if (bytes < HUGE_PAGE) return std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  const size_t rounded = (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
  void* map = mmap(nullptr, rounded + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (map == MAP_FAILED) return nullptr;
  // Keep the 2 MB-aligned span, unmap the slack around it.
  const uintptr_t start = reinterpret_cast<uintptr_t>(map);
  const uintptr_t aligned = (start + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
  if (aligned > start) munmap(map, aligned - start);
  if (HUGE_PAGE - (aligned - start) > 0) munmap(reinterpret_cast<void*>(aligned + rounded), HUGE_PAGE - (aligned - start));
  void* p = reinterpret_cast<void*>(aligned);
  // Only a request: without THP (or with it "never") the buffer keeps 4 KB pages.
  madvise(p, rounded, MADV_HUGEPAGE);
  return p;
}

inline void free_weights(void* p, size_t bytes) {
  if (!p) return;
  if (bytes < HUGE_PAGE) return std::free(p);
  munmap(p, (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE);
}

/* std::vector's allocator over alloc_weights. */
template <class T>
struct WeightAllocator {
  using value_type = T;
  WeightAllocator() = default;
  template <class U>
  WeightAllocator(const WeightAllocator<U>&) {}
  T* allocate(size_t n) {
    void* p = alloc_weights(n * sizeof(T));
    if (!p) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t n) { free_weights(p, n * sizeof(T)); }
  template <class U>
  bool operator==(const WeightAllocator<U>&) const { return true; }
  template <class U>
  bool operator!=(const WeightAllocator<U>&) const { return false; }
};

}  // namespace kvflow

#endif
