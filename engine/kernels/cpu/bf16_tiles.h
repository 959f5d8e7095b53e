// bfloat16 products on x86 CPUs with AVX-512 BF16, shared by Folio's kernels (cpu_linear.cpp's
// bf16_linear, cpu_attention.cpp's prefill attention, cpu_moe.cpp's bfloat16 experts without
// AMX), and bfloat16 pairs widened to float32
// (widen_pairs: cpu_linear.cpp's widened tiles, cpu_lora.cpp's expand, cpu_moe.cpp's AMX pairs).
//
// The right-hand matrix [out, in] lies in tiles of 16 output rows, each row's inputs in pairs:
// tile t, pair p holds (w[16 t + j][2 p], w[16 t + j][2 p + 1]) for j < 16, 32 values, the
// operand layout of vdpbf16ps. One 64-byte load of a tile and one broadcast pair of a left-hand
// row give that row 16 sums, two multiply-adds each, in float32 and without horizontal adds.
// Only the functions marked FOLIO_AVX512_BF16, and widen_pairs' AVX-512 form, use AVX-512: the
// rest of Folio's kernels must run on AVX2-only CPUs, so no file is compiled for AVX-512 as a
// whole.
#pragma once

#include <immintrin.h>

#include <cstdint>

#define FOLIO_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

namespace folio {

constexpr int64_t kTileRows = 16;  // output rows of a tile: one vector of float32 sums

// Pairs of bfloat16 values (a 32-bit lane each, the first value in its low half) as two vectors
// of float32, exactly: each pair's first value (the low half, shifted up) and its second (the
// high half, masked). A bfloat16 value is the upper half of a float32, so this is all the
// widening a pair needs: 8 pairs (32 bytes at `at`) on AVX2, 16 (64 bytes) on AVX-512.
inline void widen_pairs(const void* at, __m256& first, __m256& second) {
  const __m256i pairs = _mm256_loadu_si256(static_cast<const __m256i*>(at));
  first = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
  second = _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(-65536)));
}

__attribute__((target("avx512f"))) inline void widen_pairs(const void* at, __m512& first,
                                                            __m512& second) {
  const __m512i pairs = _mm512_loadu_si512(at);
  first = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
  second = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(-65536)));
}

inline bool cpu_has_avx512_bf16() {
  static const bool supported = __builtin_cpu_supports("avx512bf16") &&
                                __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vl");
  return supported;
}

// Left-hand rows x[m] (m < ROWS, `x_row` values apart, `pairs` pairs each) times tiles
// w + n * tile_values (n < TILES): store(m, n, sums) gets the 16 float32 sums of row m and tile
// n, in that order (n fastest). A tile's pair p lies STEP values after its pair p - 1: 32 where
// its pairs are its own, more where tiles interleave (cpu_moe.cpp's gate and up tiles, STEP 64,
// tile_values 32). Meanwhile `prefetch` (or nullptr), the next tiles a caller will read, laid
// out alike, comes into L2.
template <int TILES, int ROWS, int STEP = 2 * kTileRows, typename Store>
FOLIO_AVX512_BF16 inline void multiply_tiles(const uint16_t* x, int64_t x_row, const uint16_t* w,
                                             int64_t tile_values, int64_t pairs,
                                             const uint16_t* prefetch, const Store& store) {
  __m512 acc[ROWS][TILES];
  for (int m = 0; m < ROWS; ++m)
    for (int n = 0; n < TILES; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    if (prefetch != nullptr)
      for (int n = 0; n < TILES; ++n)
        _mm_prefetch(reinterpret_cast<const char*>(prefetch + n * tile_values + p * STEP),
                     _MM_HINT_T1);
    __m512bh tile[TILES];
    for (int n = 0; n < TILES; ++n)
      tile[n] = (__m512bh)_mm512_loadu_si512(w + n * tile_values + p * STEP);
    for (int m = 0; m < ROWS; ++m) {
      int32_t pair;
      __builtin_memcpy(&pair, x + m * x_row + 2 * p, sizeof(pair));
      const __m512bh left = (__m512bh)_mm512_set1_epi32(pair);
      for (int n = 0; n < TILES; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], tile[n], left);
    }
  }
  for (int m = 0; m < ROWS; ++m)
    for (int n = 0; n < TILES; ++n) store(m, n, acc[m][n]);
}

// multiply_tiles for `rows` (1 to ROWS) rows and `tiles` (1 to TILES) tiles, each count its own
// unrolled code.
template <int TILES, int ROWS, int STEP = 2 * kTileRows, typename Store>
inline void multiply_tiles_upto(int64_t tiles, int64_t rows, const uint16_t* x, int64_t x_row,
                                const uint16_t* w, int64_t tile_values, int64_t pairs,
                                const uint16_t* prefetch, const Store& store) {
  if constexpr (TILES > 1) {
    if (tiles < TILES)
      return multiply_tiles_upto<TILES - 1, ROWS, STEP>(tiles, rows, x, x_row, w, tile_values,
                                                        pairs, prefetch, store);
  }
  if constexpr (ROWS > 1) {
    if (rows < ROWS)
      return multiply_tiles_upto<TILES, ROWS - 1, STEP>(tiles, rows, x, x_row, w, tile_values,
                                                        pairs, prefetch, store);
  }
  multiply_tiles<TILES, ROWS, STEP>(x, x_row, w, tile_values, pairs, prefetch, store);
}

// Sixteen float32 sums as bfloat16 (round to nearest even), the first `count` stored.
FOLIO_AVX512_BF16 inline void store_bf16(uint16_t* to, __m512 sums, int64_t count) {
  const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
  _mm256_mask_storeu_epi16(to, mask, (__m256i)_mm512_cvtneps_pbh(sums));
}

// Sixteen bfloat16 values (the first `count`, the rest 0) as float32.
FOLIO_AVX512_BF16 inline __m512 load_bf16(const uint16_t* from, int64_t count) {
  const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
  const __m256i halves = _mm256_maskz_loadu_epi16(mask, from);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

}  // namespace folio
