/* Memory for packed weights (float_linear.cpp, block_linear.cpp): a decode step streams every weight
 * from DRAM once, so with 4 KB pages each page is a TLB miss whose page walk itself misses the
 * caches. Where the kernel's transparent huge pages are on request ("madvise", a common default)
 * buffers of 2 MB and more are fresh 2 MB-aligned mappings asked for huge pages before their first
 * write, and smaller ones share slabs of such pages (a small model's projections are all under 2
 * MB), saving those page walks (figures: docs/benchmarks/results/). */
#ifndef KVFLOW_WEIGHT_MEMORY_H
#define KVFLOW_WEIGHT_MEMORY_H

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <new>
#include <vector>

namespace kvflow {

constexpr size_t HUGE_PAGE = size_t(2) << 20;

/* Whole huge pages spanning `bytes`. */
inline size_t huge_span(size_t bytes) { return (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE; }

/* A fresh mapping of `span` bytes (whole huge pages) aligned to 2 MB, huge pages requested before
 * anything touches it (reused heap memory would already sit in 4 KB pages); null if mmap fails. */
inline char* map_huge(size_t span) {
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

/* Buffers under 2 MB -- a small model's projections, ~100 of them streamed by every decode step --
 * are carved from shared slabs of huge pages rather than each taking 4 KB heap pages of its own. A
 * slab is unmapped when the last buffer in it is freed. */
struct WeightSlabs {
  static constexpr size_t SLAB = size_t(16) << 20;
  struct Slab {
    char* base;
    size_t used, live;
  };
  std::mutex lock;
  std::vector<Slab> slabs;  // the last one is where new buffers go

  void* take(size_t bytes) {
    const size_t need = (bytes + 63) / 64 * 64;
    std::lock_guard<std::mutex> g(lock);
    if (slabs.empty() || slabs.back().used + need > SLAB) {
      char* base = map_huge(SLAB);
      if (!base) return nullptr;
      slabs.push_back({base, 0, 0});
    }
    Slab& s = slabs.back();
    void* p = s.base + s.used;
    s.used += need;
    s.live++;
    return p;
  }

  void give(void* p) {
    std::lock_guard<std::mutex> g(lock);
    for (size_t i = 0; i < slabs.size(); i++) {
      Slab& s = slabs[i];
      if (static_cast<char*>(p) < s.base || static_cast<char*>(p) >= s.base + SLAB) continue;
      if (--s.live == 0) {
        munmap(s.base, SLAB);
        slabs.erase(slabs.begin() + i);
      }
      return;
    }
  }
};

inline WeightSlabs& weight_slabs() {
  static WeightSlabs* slabs = new WeightSlabs;  // (never destroyed: buffers may outlive static teardown)
  return *slabs;
}

/* `bytes` of 64-byte-aligned memory in huge pages where the kernel grants them: under 2 MB from
 * the shared slabs, from 2 MB up a mapping of its own. Give it back with free_weights(p, bytes). */
inline void* alloc_weights(size_t bytes) {
  if (bytes < HUGE_PAGE) return weight_slabs().take(bytes);
  return map_huge(huge_span(bytes));
}

inline void free_weights(void* p, size_t bytes) {
  if (!p) return;
  if (bytes < HUGE_PAGE) return weight_slabs().give(p);
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
