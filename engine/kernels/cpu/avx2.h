// Small AVX2 helpers shared by Folio's C++ CPU kernels (cpu_quant.cpp, cpu_attention.cpp).
#pragma once

#include <immintrin.h>

namespace folio {

// The sum of v's eight floats.
inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Lane j: the sum of v[j]'s eight floats, for j < 8, in one tree of horizontal adds (about a
// ninth of eight separate horizontal sums).
inline __m256 sum_each(const __m256 v[8]) {
  const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20),
                       _mm256_permute2f128_ps(low, high, 0x31));
}

}  // namespace folio
