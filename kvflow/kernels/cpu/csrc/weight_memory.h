/* Memory for packed weights (float_linear.cpp, block_linear.cpp): a decode step streams every weight
 * from DRAM once, so with 4 KB pages each page is a TLB miss whose page walk itself misses the
 * caches. Where the kernel's transparent huge pages are on request ("madvise", a common default)
 * buffers of 2 MB and more are fresh 2 MB-aligned mappings asked for huge pages before their first
 * write, saving those page walks (figures: docs/benchmarks/results/). */
#ifndef KVFLOW_WEIGHT_MEMORY_H
#define KVFLOW_WEIGHT_MEMORY_H

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

namespace kvflow {

constexpr size_t HUGE_PAGE = size_t(2) << 20;

/* Whole huge pages spanning `bytes`. */
inline size_t huge_span(size_t bytes) { return (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE; }

/* `bytes` of 64-byte-aligned memory; from 2 MB up a fresh mapping aligned to 2 MB with huge pages
 * requested before anything touches it (reused heap memory would already sit in 4 KB pages). Give it
 * back with free_weights(p, bytes). */
inline void* alloc_weights(size_t bytes) {
  if (bytes < HUGE_PAGE) return std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  const size_t span = huge_span(bytes);
  // One huge page more than needed, then the slack before and after the aligned span unmapped.
  char* map = static_cast<char*>(mmap(nullptr, span + HUGE_PAGE, PROT_READ | PROT_WRITE,
                                      MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (map == MAP_FAILED) return nullptr;
  const size_t head = (HUGE_PAGE - reinterpret_cast<uintptr_t>(map) % HUGE_PAGE) % HUGE_PAGE;
  if (head) munmap(map, head);
  munmap(map + head + span, HUGE_PAGE - head);
  // Only a request: without THP (or with it "never") the buffer keeps 4 KB pages.
  madvise(map + head, span, MADV_HUGEPAGE);
  return map + head;
}

inline void free_weights(void* p, size_t bytes) {
  if (!p) return;
  if (bytes < HUGE_PAGE) return std::free(p);
  munmap(p, huge_span(bytes));
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
