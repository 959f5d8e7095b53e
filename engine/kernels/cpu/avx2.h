// Small AVX2 helpers shared by Folio's C++ CPU kernels (cpu_quant.cpp, cpu_attention.cpp,
// cpu_lora.cpp, cpu_moe.cpp), and whether FOLIO_CPU_ISA holds them to AVX2.
#pragma once

#include <immintrin.h>

#include <cctype>
#include <cstdlib>
#include <string>

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

// Eight bfloat16 values (their bits, 16 bytes at p) as floats, exactly: a bfloat16 is the high
// half of the float it stands for.
inline __m256 load8_bf16(const void* p) {
  const __m128i halves = _mm_loadu_si128(static_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}

// Eight floats stored at p (16 bytes) as bfloat16, rounded as c10::BFloat16 rounds them, bit for
// bit: to nearest even, NaN as the quiet NaN 0x7FC0.
inline void store8_bf16(void* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
  // Values below 0x10000: packing with unsigned saturation keeps them, in order.
  _mm_storeu_si128(static_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(rounded),
                                    _mm256_extracti128_si256(rounded, 1)));
}

// Whether FOLIO_CPU_ISA=avx2 keeps the AVX2 code on a CPU that has more (engine.kernels.cpu.
// capabilities reads the same variable, and refuses values other than "native" and "avx2"). Read
// at every call, so that one process can run (and its tests compare) both paths.
inline bool avx2_forced() {
  const char* isa = std::getenv("FOLIO_CPU_ISA");
  if (isa == nullptr) return false;
  std::string value;
  for (const char* c = isa; *c != '\0'; ++c)
    if (!std::isspace(static_cast<unsigned char>(*c)))
      value += static_cast<char>(std::tolower(static_cast<unsigned char>(*c)));
  return value == "avx2";
}

}  // namespace folio
