/* The vector width and the bfloat16 conversions shared by the float GEMM (float_linear.cpp) and the
 * attention kernels (attention.h), so both widen and round bf16 the same way. */
#ifndef KVFLOW_SIMD_H
#define KVFLOW_SIMD_H

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

namespace kvflow {

// Floats per vector register: 16 under AVX-512, else 8. The libraries are compiled for the CPU
// they run on (-march=native).
#ifdef __AVX512F__
constexpr int VEC = 16;
#else
constexpr int VEC = 8;
#endif

// VEC floats, loads and stores unaligned (gcc's vector extension; scalar code without SIMD).
typedef float vfloat __attribute__((vector_size(4 * VEC), aligned(4)));

/* VEC bf16 values widened to float32: the 16 bits are the float's upper half. */
inline vfloat widen_bf16(const uint16_t* p) {
#ifdef __AVX512F__
  // One vpmovzxwd: gcc splits the generic form below into 256-bit halves where it prefers 256-bit
  // vectors (-march=native on some Intel CPUs).
  return (vfloat)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
#else
  typedef uint16_t vh __attribute__((vector_size(2 * VEC), aligned(2)));
  typedef uint32_t vu __attribute__((vector_size(4 * VEC)));
  return (vfloat)(__builtin_convertvector(*(const vh*)p, vu) << 16);
#endif
}

/* acc + a * b with one rounding where the CPU has FMA. Spelled out rather than left to the compiler's
 * contraction, which may fuse a sum in one tile shape and not in another (float_linear.cpp is compiled
 * with -ffp-contract=off so that a row's sums do not depend on its batch). */
inline vfloat fmadd(vfloat a, vfloat b, vfloat acc) {
#if defined(__AVX512F__)
  return (vfloat)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc);
#elif defined(__FMA__)
  return (vfloat)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
  return acc + a * b;
#endif
}

inline float bf16_to_f32(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/* Round to nearest even, as torch's float32 -> bfloat16 (NaN kept a quiet NaN). */
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace kvflow

#endif
