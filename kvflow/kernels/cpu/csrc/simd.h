/* The vector width and the bfloat16 conversions shared by the float GEMM (float_linear.cpp) and the
 * attention kernels (attention.h), so both widen and round bf16 the same way. */
#ifndef KVFLOW_SIMD_H
#define KVFLOW_SIMD_H

#include <cstdint>
#include <cstring>
#include <initializer_list>

#if defined(__AVX512F__) || defined(__FMA__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <cmath>

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

/* VEC float8 e4m3 values (OCP FP8, torch.float8_e4m3fn) widened to float32 and multiplied by 2^-8.
 * The byte's exponent and mantissa shifted into a binary16's (bias 15 against e4m3's 7) are the same
 * number times 2^-8, subnormals included, so the CPU's half-to-float conversion widens them exactly;
 * the caller folds the 2^8 into its scale. (The NaN codes 0x7f / 0xff become 1.875 * 2^8: a
 * checkpoint's weights hold none.) */
inline float e4m3_to_f32_scaled(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const float v = e ? std::ldexp(1.f + m / 8.f, e - 7 - 8) : std::ldexp((float)m, -9 - 8);
  return b & 0x80 ? -v : v;
}

inline vfloat widen_e4m3(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
  const __m256i bits = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7f)), 7),
                                       _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x80)), 8));
  return (vfloat)_mm512_cvtph_ps(bits);
#elif defined(__F16C__) && defined(__AVX2__)
  const __m128i h = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)p));
  const __m128i bits = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7f)), 7),
                                    _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x80)), 8));
  return (vfloat)_mm256_cvtph_ps(bits);
#else
  vfloat v;
  for (int j = 0; j < VEC; j++) v[j] = e4m3_to_f32_scaled(p[j]);
  return v;
#endif
}

/* v rounded to the nearest float8 e4m3 value (ties to even), |v| <= 448 (the format's largest):
 * 3 mantissa bits from 2^-6 up, steps of 2^-9 below (subnormals). */
inline float round_e4m3(float v) {
  const float a = std::fabs(v);
  int e;
  std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1)
  const int step = e - 4 < -9 ? -9 : e - 4;  // 2^step apart
  const float r = std::fmin(448.f, std::ldexp(__builtin_rintf(std::ldexp(a, -step)), step));
  return v < 0 ? -r : r;
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

// VEC int32 lanes, as vfloat's.
typedef int32_t vint __attribute__((vector_size(4 * VEC), aligned(4)));

/* Each lane rounded to the nearest integer (ties to even, the CPU's default rounding). An intrinsic,
 * not the (t + 1.5 * 2^23) - 1.5 * 2^23 trick, which -ffast-math would fold away. */
inline vint round_to_int(vfloat t) {
#if defined(__AVX512F__)
  return (vint)_mm512_cvtps_epi32((__m512)t);
#elif defined(__AVX__)
  return (vint)_mm256_cvtps_epi32((__m256)t);
#else
  vint n;
  for (int j = 0; j < VEC; j++) n[j] = (int32_t)__builtin_lrintf(t[j]);
  return n;
#endif
}

/* The lanes' sum in one fixed order: halves added pairwise (lane l + lane l + w, w = VEC / 2, ..., 1),
 * so a sum does not depend on where its vector came from. (GCC's AVX-512 reduction adds in that
 * order too.) */
inline float lanes_sum(vfloat a) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps((__m512)a);
#else
  float b[VEC];
  __builtin_memcpy(b, &a, sizeof(b));
  for (int w = VEC / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; l++) b[l] = b[l] + b[l + w];
  return b[0];
#endif
}

/* The largest lane. */
inline float lanes_max(vfloat a) {
#ifdef __AVX512F__
  return _mm512_reduce_max_ps((__m512)a);
#else
  float m = a[0];
  for (int i = 1; i < VEC; i++) m = a[i] > m ? a[i] : m;
  return m;
#endif
}

/* exp of each lane, x clamped to [-86, 86]: Cephes' expf -- x = n ln2 + r with |r| <= ln2 / 2, a
 * degree-7 polynomial in r, 2^n added to the exponent bits -- in vector registers, where glibc's
 * expf ran one lane at a time in the loops it was called from (several times slower an element).
 * Within 1 ulp of exp over the range (checked against double precision). The
 * steps go through fmadd: -ffast-math may not merge the two parts of ln2 (Cody-Waite) back into one,
 * which cost 67 ulp at x = -72. Every lane takes the same path, so a value's result does not depend
 * on its neighbours. */
inline vfloat exp_clamped(vfloat x) {
  const vfloat lo = vfloat{} - 86.f, hi = vfloat{} + 86.f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vint n = round_to_int(x * 1.44269504088896341f);
  const vfloat nf = __builtin_convertvector(n, vfloat);
  vfloat r = fmadd(nf, vfloat{} - 0.693359375f, x);
#if !defined(__AVX512F__) && !defined(__FMA__)
  __asm__("" : "+m"(r));  // (fmadd is a plain a * b + c here: keep the two subtractions apart)
#endif
  r = fmadd(nf, vfloat{} + 2.12194440e-4f, r);
  vfloat y = vfloat{} + 1.9875691500E-4f;
  for (const float c : {1.3981999507E-3f, 8.3334519073E-3f, 4.1665795894E-2f, 1.6666665459E-1f, 5.0000001201E-1f})
    y = fmadd(y, r, vfloat{} + c);
  y = fmadd(y, r * r, r) + 1.f;
  return (vfloat)((vint)y + (n << 23));
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
