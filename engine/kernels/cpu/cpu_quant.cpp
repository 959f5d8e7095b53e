// Weight-only quantized matrix products for float32 activations on x86 CPUs with AVX2 and FMA:
// out[m, n] = sum_k x[m, k] * w[n, k], with w stored as int8 per output channel, as int8 with a
// scale per group of 32 or 16 input features (GGUF Q8_0's blocks, w = d * q with d float16, or
// Q6_K's sub-blocks, d * sc in float32), or as 4-bit codes in groups of 32 (GGUF Q4_1's scheme:
// w = code * scale + min, scale and min float16, or float32 where float16 would round them:
// Q4_K's d * sc needs up to 17 significant bits); and a fused layer whose parts keep different
// ones of these layouts (a GGUF Q4_K_M's q and k in Q4_K, v in Q6_K), its parts' products side by
// side in one output.
//
// Integer dot products for decode batches and prefills alike (int8: up to a few hundred rows,
// int4: up to a few thousand without native bfloat16; the caller dequantizes beyond): each call
// first quantizes the activations in blocks of 32 features (x ~ q*d,
// one float scale d per block), to int8 against int4 weights (llama.cpp's Q4_1 x Q8_1 scheme)
// and to int16 against int8 weights, per row or per group (int8 x int8 would add about 0.5% of
// error to the int8 layers' 0.8%; int16 keeps it at float's level and runs as fast). A block's 32 products are summed exactly
// in int32 (_mm256_maddubs_epi16 / _mm256_madd_epi16), converted to float once and scaled, so no
// weight is ever widened to float. Each weight row is read from memory once per chunk of activation
// rows that fits in L1 and applied to each of them, four at a time; parallel over output channels
// with torch's pool. Against one or two activation rows (a decode step's) the AVX2 code takes
// four weight rows a pass instead, sharing the activations' loads and the tree of horizontal
// adds and prefetching the next four rows, on every CPU (weight_rows); every product keeps its
// own accumulators and order, so its bits do not depend on what shares its pass. On CPUs with
// AVX-512 VNNI the products of more rows run on 512-bit registers (vpdpwssd; eight rows at a
// time) with the same integer sums in the same lanes and the same float steps: bit for bit the
// AVX2 code's outputs (Wide); FOLIO_CPU_ISA=avx2 keeps the AVX2 code (wide_rows).
//
// int4 weights are read in strips of 16 output channels (the weights permuted once, at load, by
// int4_strip_codes): a 32-bit lane to a channel, four codes of one group to a lane, against the
// activation row's four int8 codes at those positions broadcast to every lane. A group's 32
// products of a channel sum exactly in its lane (vpdpbusd on AVX-512; on AVX2 maddubs pairs
// added in int16, then one madd), and its float steps (conversion, the scales, the minimum's
// term) run once per group and channel, with no sums across lanes: an output's arithmetic is
// its lane's alone, the same for any number of rows and output channels beside it and the same
// bits on AVX2 and AVX-512. The products of several rows share each strip's unpacked codes.
// Grouped int8 and per-channel int8 weights may lie in strips of 16 output channels as well
// (where the CPU has AVX-512 VNNI: engine/layers/quantization chooses), their int16 products
// summed a group at a time in a channel's lane the same way (vpdpwssd; on AVX2 madd and add).
// This file only multiplies; quantizing weights and choosing the kernel is
// engine/layers/quantization's.

#include <immintrin.h>
#include "avx2.h"
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstring>
#include <cstdlib>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using folio::horizontal_sum;

// Activation block and int4 group size (engine.models.quantization.INT4_GROUP_SIZE).
constexpr int64_t kBlock = 32;
// Activation rows sharing one pass over a weight row, each with its own accumulators.
constexpr int kTile = 4;
// Weight rows (output channels) a call of for_each_output's `fill` takes, sharing one pass over
// the activations where there are one or two rows of them (weight_rows).
constexpr int kOutputs = 4;

inline float horizontal_max(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int32_t horizontal_sum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
  return _mm_cvtsi128_si32(s);
}

inline int64_t round_up(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// x[0 .. 32) ~ codes * d: int8 codes (|q| <= 127, so that negating q stays in range: against
// int4 weights) or int16 (|q| <= 32767: against int8 weights), features 0-15 to `first` and
// 16-31 to `second`, in order; q_sum = d * the codes' sum. Scale kLimit / max|x| (that
// quotient, then a product rounded to nearest even: the unit tests mirror these exact steps).
template <typename Code>
void quantize_block(const float* x, Code* first, Code* second, float* d, float* q_sum) {
  constexpr float kLimit = std::is_same_v<Code, int8_t> ? 127.0f : 32767.0f;
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_loadu_ps(x + 8 * j);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[j]));
  }
  const float max_abs = horizontal_max(amax);
  const __m256 inverse = _mm256_set1_ps(max_abs > 0.0f ? kLimit / max_abs : 0.0f);
  __m256i i[4];
  for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inverse));
  *d = max_abs / kLimit;
  *q_sum = *d * static_cast<float>(horizontal_sum(
                    _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]))));
  // Packing works within 128-bit lanes; the permutations put the features back in order.
  const __m256i words01 = _mm256_packs_epi32(i[0], i[1]);  // 0-3, 8-11 | 4-7, 12-15
  const __m256i words23 = _mm256_packs_epi32(i[2], i[3]);
  if constexpr (std::is_same_v<Code, int8_t>) {
    // 4-byte runs: features 0-3, 8-11, 16-19, 24-27 | 4-7, 12-15, 20-23, 28-31.
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(words01, words23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(first), _mm256_castsi256_si128(bytes));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(second), _mm256_extracti128_si256(bytes, 1));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(first),
                        _mm256_permute4x64_epi64(words01, 0xD8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(second),
                        _mm256_permute4x64_epi64(words23, 0xD8));
  }
}

// One call's activations against int8 weights, each row's first k32 features (a multiple of
// 32) in blocks of 32: x[r, 32 b + i] ~ q[r, 32 b + i] * d[r, b], |q| <= 32767 (int16 codes;
// quantize_block also makes StripActivations' int8 codes, |q| <= 127, so that negating q stays
// in range); d_lanes[r, 8 b .. 8 (b + 1)) holds eight copies of d[r, b], the lanes of a block's
// partial sums in the rows' vectors, so that the scales of a row's vector of partial sums are
// one load; q_sum[r, b] = d[r, b] * sum_i q[r, 32 b + i], its rows padded with zeros to a
// multiple of 8 blocks, and 7 rows of zeros more, so that it is read eight at a time. The codes
// are stored in units of two consecutive blocks (the last block of an odd count alone), a unit
// as its blocks' first halves (features 0-15) in order, then their second halves: what one
// 512-bit load of activations meets (the AVX-512 rows read a unit at once). Within a unit,
// block b's first half lies at (b - base) * 16 codes from the unit's start, its second half
// `unit * 16` codes after that; a single block is in order.
template <typename Code>
struct QuantizedActivations {
  static_assert(std::is_same_v<Code, int16_t>, "int4 weights take Int4Activations");
  static constexpr int64_t kUnit = 2;
  static constexpr int64_t kLanes = 8;
  std::vector<Code> q;
  std::vector<float> d_lanes, q_sum;
  int64_t k32, blocks, padded_blocks;

  QuantizedActivations(const float* x, int64_t m, int64_t k)
      : q(m * (k - k % kBlock)),
        d_lanes(m * (k / kBlock) * kLanes),
        q_sum((m + 7) * round_up(k / kBlock, 8), 0.0f),
        k32(k - k % kBlock),
        blocks(k / kBlock),
        padded_blocks(round_up(k / kBlock, 8)) {
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        int64_t unit = kUnit;
        while (b - b % unit + unit > blocks) unit /= 2;
        const int64_t base = b - b % unit;
        Code* first = &q[r * k32 + base * kBlock + (b - base) * (kBlock / 2)];
        Code* second = first + unit * (kBlock / 2);
        float scale;
        quantize_block(x + r * k + b * kBlock, first, second, &scale,
                       &q_sum[r * padded_blocks + b]);
        std::fill_n(&d_lanes[(r * blocks + b) * kLanes], kLanes, scale);
      }
    }
  }

};

inline __m256i load_256(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

inline __m128i load_128(const void* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

// One int8 weight row against int16 activations, a block at a time: the 32 weights of block b,
// sign-extended to int16, times the block's codes, as eight int32 partial sums (each at most
// 4 * 127 * 32767), scaled by the block's scale (the row's own scale is applied afterwards).
// `act_scale` is an activation row's d_lanes.
struct Int8Row {
  using Code = int16_t;
  static constexpr int kStep = 1;
  static constexpr int kGroupSize = 0;  // no group scales: the row's one scale comes after
  static constexpr int64_t kLanes = QuantizedActivations<Code>::kLanes;
  const int8_t* w;
  struct Weights {
    __m256i low, high;
  };
  const void* at(int64_t b) const { return w + b * kBlock; }
  inline Weights load(int64_t b) const {
    return {_mm256_cvtepi8_epi16(load_128(w + b * kBlock)),
            _mm256_cvtepi8_epi16(load_128(w + b * kBlock + 16))};
  }
  static inline __m256i dot(const Weights& wv, const int16_t* q, int64_t half) {
    return _mm256_add_epi32(_mm256_madd_epi16(wv.low, load_256(q)),
                            _mm256_madd_epi16(wv.high, load_256(q + half)));
  }
  static inline __m256 accumulate(__m256 acc, __m256 products, const Weights&,
                                  const float* act_scale, int64_t b) {
    return _mm256_fmadd_ps(products, _mm256_broadcast_ss(act_scale + kLanes * b), acc);
  }
};

// One int8 row with a scale per group of kGroup (32 or 16) input features against int16
// activations, a block of 32 at a time: as Int8Row, the weights sign-extended to int16 times
// the block's codes in eight int32 partial sums, each scaled by the activation block's d times
// its group's scale (`scale`: the row's group scales as float32). With groups of 32 the halves'
// sums are added; with groups of 16 they stay apart (hadd: lanes 0, 1, 4, 5 sum the first
// group's products, lanes 2, 3, 6, 7 the second's), each lane scaled by its own group's scale.
template <int kGroup>
struct GroupedInt8Row {
  static_assert(kGroup == kBlock || 2 * kGroup == kBlock, "groups of 32 or 16 features");
  using Code = int16_t;
  static constexpr int kStep = 1;
  static constexpr int kGroupSize = kGroup;
  static constexpr int64_t kLanes = QuantizedActivations<Code>::kLanes;
  const int8_t* w;
  const float* scale;
  struct Weights {
    __m256i low, high;
    __m256 scale;  // per lane, its group's scale
  };
  const void* at(int64_t b) const { return w + b * kBlock; }
  inline Weights load(int64_t b) const {
    __m256 s;
    if constexpr (kGroup == kBlock) {
      s = _mm256_broadcast_ss(scale + b);
    } else {  // groups 2b, 2b + 1 as s0 s0 s1 s1 in each lane
      const __m128 two = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(scale + 2 * b)));
      const __m128 four = _mm_unpacklo_ps(two, two);
      s = _mm256_set_m128(four, four);
    }
    return {_mm256_cvtepi8_epi16(load_128(w + b * kBlock)),
            _mm256_cvtepi8_epi16(load_128(w + b * kBlock + 16)), s};
  }
  static inline __m256i dot(const Weights& wv, const int16_t* q, int64_t half) {
    const __m256i low = _mm256_madd_epi16(wv.low, load_256(q));
    const __m256i high = _mm256_madd_epi16(wv.high, load_256(q + half));
    if constexpr (kGroup == kBlock) return _mm256_add_epi32(low, high);
    return _mm256_hadd_epi32(low, high);
  }
  static inline __m256 accumulate(__m256 acc, __m256 products, const Weights& wv,
                                  const float* act_scale, int64_t b) {
    return _mm256_fmadd_ps(
        _mm256_mul_ps(products, _mm256_broadcast_ss(act_scale + kLanes * b)), wv.scale, acc);
  }
};

// Lane sums of v[0 .. N), four vectors at a time in one tree of horizontal adds (a short
// group's missing vectors zeros), each added by add(i, sum of v[i]'s lanes): every vector's
// lanes are summed in one order whatever vectors share its tree, so that a product's bits do
// not depend on the activation rows or the output channels computed beside it.
template <int N, typename Add>
inline void add_lane_sums(const __m256 (&v)[N], const Add& add) {
#pragma GCC unroll 4
  for (int i0 = 0; i0 < N; i0 += 4) {
    __m256 quad[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) quad[i] = i0 + i < N ? v[i0 + i] : _mm256_setzero_ps();
    const __m256 pairs =
        _mm256_hadd_ps(_mm256_hadd_ps(quad[0], quad[1]), _mm256_hadd_ps(quad[2], quad[3]));
    float four[4];
    _mm_storeu_ps(four,
                  _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1)));
#pragma GCC unroll 4
    for (int i = 0; i < 4 && i0 + i < N; ++i) add(i0 + i, four[i]);
  }
}

// The accumulators of weight rows o < OUTS against activation rows r < ROWS: acc[c][o][r] on
// chain c (dot_rows').
template <int ROWS, int OUTS>
using Chains = __m256[2][OUTS][ROWS];

// dot_rows from block b on (b a multiple of a unit, fewer than a unit's blocks left, if any)
// and its sums: the last unit(s) on the first chain, then both chains' sums into
// sums[o * sums_stride + r].
template <int ROWS, int OUTS, typename Row>
inline void dot_rows_tail(const Row (&row)[OUTS], const typename Row::Code* q, int64_t k32,
                          const float* scale, int64_t scale_stride, int64_t blocks, int64_t b,
                          Chains<ROWS, OUTS>& acc, float* sums, int64_t sums_stride) {
  constexpr int64_t kStep = Row::kStep;
  for (; b + kStep <= blocks; b += kStep) {
#pragma GCC unroll 4
    for (int o = 0; o < OUTS; ++o) {
      const typename Row::Weights wv = row[o].load(b);
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        const __m256 products =
            _mm256_cvtepi32_ps(Row::dot(wv, q + r * k32 + b * kBlock, kStep * (kBlock / 2)));
        acc[0][o][r] = Row::accumulate(acc[0][o][r], products, wv, scale + r * scale_stride, b);
      }
    }
  }
  if constexpr (kStep == 2) {
    if (b < blocks) {
#pragma GCC unroll 4
      for (int o = 0; o < OUTS; ++o) {
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; ++r) {
          acc[0][o][r] = _mm256_add_ps(acc[0][o][r], row[o].dot_single(b, q + r * k32 + b * kBlock,
                                                                      scale + r * scale_stride));
        }
      }
    }
  }
  __m256 total[OUTS * ROWS];
#pragma GCC unroll 4
  for (int o = 0; o < OUTS; ++o) {
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) total[o * ROWS + r] = _mm256_add_ps(acc[0][o][r], acc[1][o][r]);
  }
  add_lane_sums(total, [&](int i, float sum) { sums[i / ROWS * sums_stride + i % ROWS] += sum; });
}

// sums[o * sums_stride + r] += sum over blocks b of the scales of block b (Row::accumulate's) *
// (block b of weight row o . block b of activation row r), for o < OUTS and r < ROWS; q holds
// the activation rows (k32 apart), scale[r] is row r's activation scales (`scale_stride`
// apart). Row::kStep blocks a step; each weight row's blocks are loaded once for the ROWS rows.
template <int ROWS, int OUTS, typename Row>
inline void dot_rows(const Row (&row)[OUTS], const typename Row::Code* q, int64_t k32,
                     const float* scale, int64_t scale_stride, int64_t blocks, float* sums,
                     int64_t sums_stride) {
  constexpr int64_t kStep = Row::kStep;
  // Two accumulators per product, so that consecutive FMAs do not wait on each other; for
  // every tile alike, so that a product's sum is added in one order whatever rows and output
  // channels share its tile (a request's tokens do not depend on the batch it runs in).
  constexpr int kChains = 2;
  Chains<ROWS, OUTS> acc;
#pragma GCC unroll 2
  for (int c = 0; c < kChains; ++c) {
#pragma GCC unroll 4
    for (int o = 0; o < OUTS; ++o) {
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) acc[c][o][r] = _mm256_setzero_ps();
    }
  }
  // Blocks b .. b + kStep, their codes `at` codes into an activation row, their second halves
  // `half` after their first (QuantizedActivations' units).
  auto step = [&](int c, int64_t b, int64_t at, int64_t half) {
#pragma GCC unroll 4
    for (int o = 0; o < OUTS; ++o) {
      const typename Row::Weights wv = row[o].load(b);
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        const __m256 products = _mm256_cvtepi32_ps(Row::dot(wv, q + r * k32 + at, half));
        acc[c][o][r] = Row::accumulate(acc[c][o][r], products, wv, scale + r * scale_stride, b);
      }
    }
  };
  // A whole unit (kChains steps) at a time, then the row's smaller last unit(s).
  constexpr int64_t kUnit = kChains * kStep;
  static_assert(kUnit == QuantizedActivations<typename Row::Code>::kUnit);
  // Several weight rows side by side are several streams in one page, which the hardware
  // prefetcher follows less well than one: each row's unit of the next OUTS rows (`ahead`
  // bytes on) is asked for while this one's is multiplied.
  int64_t ahead = 0;
  if constexpr (OUTS > 1) {
    ahead = OUTS * (static_cast<const char*>(row[1].at(0)) -
                    static_cast<const char*>(row[0].at(0)));
  }
  int64_t b = 0;
  for (; b + kUnit <= blocks; b += kUnit) {
    if constexpr (OUTS > 1) {
#pragma GCC unroll 4
      for (int o = 0; o < OUTS; ++o) {
        _mm_prefetch(static_cast<const char*>(row[o].at(b)) + ahead, _MM_HINT_T0);
      }
    }
#pragma GCC unroll 2
    for (int c = 0; c < kChains; ++c) {
      step(c, b + c * kStep, b * kBlock + c * kStep * (kBlock / 2), kUnit * (kBlock / 2));
    }
  }
  dot_rows_tail<ROWS, OUTS>(row, q, k32, scale, scale_stride, blocks, b, acc, sums, sums_stride);
}

// tile(std::integral_constant<int, left>{}, r0) where 0 < left <= ROWS (a last, short tile).
template <int ROWS, typename Tile>
inline void last_tile(int64_t left, int64_t r0, const Tile& tile) {
  if constexpr (ROWS > 0) {
    if (left == ROWS) {
      tile(std::integral_constant<int, ROWS>{}, r0);
    } else {
      last_tile<ROWS - 1>(left, r0, tile);
    }
  }
}

// Runs tile(std::integral_constant<int, rows>{}, r0) over activation rows [r0, r0 + rows) for
// r0 < m, ROWS rows at a time, the last tile shorter.
template <int ROWS, typename Tile>
inline void for_each_tile(int64_t m, const Tile& tile) {
  int64_t r0 = 0;
  for (; r0 + ROWS <= m; r0 += ROWS) tile(std::integral_constant<int, ROWS>{}, r0);
  last_tile<ROWS - 1>(m - r0, r0, tile);
}

// ---- int4 in strips of 16 output channels (int4_strip_codes' layout, [strips, groups, 256]):
// byte 64 u + 4 c + i of strip s, group g holds channel 16 s + c's code at position 8 u + i of
// the group in its low half and at 8 u + 4 + i in its high half, so that a 64-byte load splits
// into vector 2 u (low nibbles) and 2 u + 1 (high): vector j holds positions 4 j .. 4 j + 4 of
// the strip's 16 channels, a 32-bit lane to a channel (an AVX2 vector: half a strip, eight
// channels). Scales and minimums lie in the same order, [strips, groups, 16].
constexpr int64_t kStrip = 16;
constexpr int64_t kStripGroupBytes = kStrip * kBlock / 2;  // 256
// Activation rows sharing one pass over a strip's codes: on AVX2 four (their int16 sums for
// both halves beside four unpacked code vectors in 16 registers: int4_strip), on AVX-512
// eight.
constexpr int kInt4Rows = 4;
// A strip's first pass (its first rows) asks for the codes this many strips on: a
// decode step's one row leaves the loads nothing to hide their latency behind (one row, one
// thread, AVX2 EPYC under load: 7.8 -> 6.3-6.7 ms for the 120 linears with two strips ahead,
// between runs as noisy as that; with the register fix, quiet, two threads: 5.87 -> 5.29 ms).
constexpr int64_t kPrefetchStrips = 2;
constexpr int kInt4WideRows = 8;

// One call's activations against weights in strips: each row's groups of 32 quantized as
// quantize_block<Code> does (x ~ q * d per group), a group's 32 codes in order; d and q_sum (d
// times the codes' sum, int4's minimums' term) one float per group. int8 codes against int4
// weights (|q| <= 127, so that maddubs' int16 pairs cannot overflow), int16 against grouped int8
// ones (the codes QuantizedActivations holds, in order). Parallel over rows where there are many
// (a prefill's).
template <typename Code>
struct StripActivations {
  int64_t k, groups;
  std::vector<Code> q;
  std::vector<float> d, q_sum;

  StripActivations(const float* x, int64_t m, int64_t k)
      : k(k), groups(k / kBlock), q(m * k), d(m * (k / kBlock)), q_sum(m * (k / kBlock)) {
    at::parallel_for(0, m, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t g = 0; g < groups; ++g) {
          Code* codes = &q[r * k + g * kBlock];
          quantize_block<Code>(x + r * k + g * kBlock, codes, codes + kBlock / 2,
                               &d[r * groups + g], &q_sum[r * groups + g]);
        }
      }
    });
  }
  // Row r's 32-bit word j of group g: codes 4 j .. 4 j + 4 (int8) or 2 j .. 2 j + 2 (int16).
  int32_t word(int64_t r, int64_t g, int j) const {
    int32_t v;
    std::memcpy(&v, &q[r * k + g * kBlock] + j * (4 / sizeof(Code)), 4);
    return v;
  }
};
using Int4Activations = StripActivations<int8_t>;
using Int16Activations = StripActivations<int16_t>;

// N / 2 of half a strip's group's four 64-byte quarters (`block`: its 32 bytes in the first, the
// others 64 bytes apart) as N vectors of codes: vector j positions 4 j .. 4 j + 4 (from the first
// quarter's) of the eight channels, a 32-bit lane to a channel. N = 8: the whole half group.
template <int N>
inline void unpack_half_strip(const uint8_t* block, __m256i (&codes)[N]) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 4
  for (int u = 0; u < N / 2; ++u) {
    const __m256i packed = load_256(block + 64 * u);
    codes[2 * u] = _mm256_and_si256(packed, nibble);
    codes[2 * u + 1] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
  }
}

// An empty instruction that reads and writes v in a vector register: GCC then neither spills v
// around it nor reorders the exact integer sums before it into a tree of its own (which kept
// every product of int4_strip on the stack).
template <typename V>
inline void keep_in_register(V& v) {
  asm("" : "+x"(v));
}

inline __m256 eight_channels(const at::Half* h) { return _mm256_cvtph_ps(load_128(h)); }
inline __m256 eight_channels(const float* f) { return _mm256_loadu_ps(f); }

// Activation rows first .. first + ROWS of xq times a strip (`codes`: its groups' 256 bytes
// each; `scale`, `min`: its [groups, 16]), AVX2: per group, a quarter's code vectors for both
// halves of the strip (channels 0-7 and 8-15) unpacked at a time for the rows, so that each
// broadcast of a row's four activation codes serves both halves' maddubs (a broadcast from
// memory takes a vector pipe on Zen 3, as a maddubs does). A row's products of a group summed
// in int16 pairs per half (at most 8 * 2 * 15 * 127 = 30480, exact in any order) and one madd,
// exactly vpdpbusd's sums; then sum * (scale * d) and min * q_sum added in that order, the
// AVX-512 code's steps. The rows' int16 sums and the four code vectors fill AVX2's 16
// registers, so the float accumulators live in L1 (`acc`), read and written once per group.
// Row r's sixteen sums to out[r * ld]. `ahead`: bytes past each group's codes to prefetch (0:
// none).
template <int ROWS, typename S>
inline void int4_strip(const uint8_t* codes, const S* scale, const S* min,
                       const Int4Activations& xq, int64_t first, float* out, int64_t ld,
                       int64_t ahead) {
  alignas(32) float acc[ROWS][kStrip] = {};
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < xq.groups; ++g) {
    const uint8_t* group = codes + g * kStripGroupBytes;
    if (ahead != 0) {
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
        _mm_prefetch(reinterpret_cast<const char*>(group) + 64 * u + ahead, _MM_HINT_T0);
      }
    }
    __m256i pairs[ROWS][2];
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) pairs[r][0] = pairs[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      __m256i w[2][2];  // [half][low, high nibbles]: positions 8 u .. 8 u + 4, 8 u + 4 .. 8 u + 8
      unpack_half_strip(group + 64 * u, w[0]);
      unpack_half_strip(group + 64 * u + 32, w[1]);
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 2
        for (int j = 0; j < 2; ++j) {
          const __m256i four = _mm256_set1_epi32(xq.word(first + r, g, 2 * u + j));
          pairs[r][0] = _mm256_add_epi16(pairs[r][0], _mm256_maddubs_epi16(w[0][j], four));
          pairs[r][1] = _mm256_add_epi16(pairs[r][1], _mm256_maddubs_epi16(w[1][j], four));
        }
        keep_in_register(pairs[r][0]);
        keep_in_register(pairs[r][1]);
      }
    }
    const S* group_scale = scale + g * kStrip;
    const S* group_min = min + g * kStrip;
    const __m256 s[2] = {eight_channels(group_scale), eight_channels(group_scale + 8)};
    const __m256 m[2] = {eight_channels(group_min), eight_channels(group_min + 8)};
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const int64_t at = (first + r) * xq.groups + g;
      const __m256 d = _mm256_set1_ps(xq.d[at]), q_sum = _mm256_set1_ps(xq.q_sum[at]);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs[r][h], ones));
        __m256 a = _mm256_load_ps(acc[r] + 8 * h);
        a = _mm256_fmadd_ps(sums, _mm256_mul_ps(s[h], d), a);
        a = _mm256_fmadd_ps(m[h], q_sum, a);
        _mm256_store_ps(acc[r] + 8 * h, a);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
    _mm256_storeu_ps(out + r * ld, _mm256_load_ps(acc[r]));
    _mm256_storeu_ps(out + r * ld + 8, _mm256_load_ps(acc[r] + 8));
  }
}

// ---- grouped int8 in strips of 16 output channels (grouped_int8_strip_codes' layout,
// [strips, blocks, 512]): byte 32 p + 2 c + i of strip s, block b holds channel 16 s + c's code
// at feature 32 b + 2 p + i, so that 32 bytes widened to int16 are pair step p of the strip's
// 16 channels, a 32-bit lane to a channel (on AVX2 its first 16 bytes channels 0-7, the next
// 16 channels 8-15). Scales in int4's order, [strips, groups, 16]; int8 with a scale per output
// channel lies in the same strips, its scales [strips, 16] applied once at the end (kGroup 0
// below). As with int4, a channel's
// products of a group sum exactly in its lane (int16 activations times the codes: vpdpwssd
// on AVX-512 VNNI, madd and add on AVX2, each sum at most 32 * 128 * 32767, exact in int32 in
// any order) and its float steps (the conversion, the scale times d, the FMA) run once per
// group and channel: an output's arithmetic is its lane's alone, the same for any rows and
// strips beside it and the same bits on AVX2 and AVX-512, with no sums across lanes. Against a
// row-major weight (one weight row a pass, its sums across lanes each time) a strip shares
// each widened step of codes between the rows of a verification step or a batch.
constexpr int64_t kStripBlockBytes = kStrip * kBlock;  // 512
// Activation rows sharing one pass over a strip's codes: AVX2 four (two int32 sums each, the
// two halves' codes and a broadcast in 16 registers; the float sums in L1), AVX-512 eight.
constexpr int kInt8StripRows = 4;
constexpr int kInt8StripWideRows = 8;

// The block of codes `ahead` bytes past `block` (a later strip's) into L1, where `ahead` is not
// 0: a one-row pass leaves its loads nothing else to hide behind.
inline void prefetch_block(const int8_t* block, int64_t ahead) {
  if (ahead == 0) return;
  for (int line = 0; line < kStripBlockBytes / 64; ++line) {
    _mm_prefetch(reinterpret_cast<const char*>(block) + 64 * line + ahead, _MM_HINT_T0);
  }
}

// Activation rows first .. first + ROWS of xq times a grouped int8 strip (`codes`: its blocks'
// 512 bytes each; `scale`: its [groups, 16], kGroup features to a group), AVX2. Row r's sixteen
// sums to out[r * ld]. `ahead`: bytes past each block's codes to prefetch (0: none).
template <int ROWS, int kGroup, typename S>
inline void grouped_int8_strip(const int8_t* codes, const S* scale, const Int16Activations& xq,
                               int64_t first, float* out, int64_t ld, int64_t ahead) {
  constexpr int kGroups = kGroup == 0 ? 1 : kBlock / kGroup;  // per block
  constexpr int kSteps = kBlock / 2 / kGroups;                // pair steps per group
  alignas(32) float acc[ROWS][kStrip] = {};
  for (int64_t b = 0; b < xq.groups; ++b) {
    const int8_t* block = codes + b * kStripBlockBytes;
    prefetch_block(block, ahead);
#pragma GCC unroll 2
    for (int h = 0; h < kGroups; ++h) {
      __m256i sums[ROWS][2];
#pragma GCC unroll 4
      for (int r = 0; r < ROWS; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 16
      for (int p = 0; p < kSteps; ++p) {
        const int8_t* step = block + 2 * kStrip * (h * kSteps + p);
        const __m256i w0 = _mm256_cvtepi8_epi16(load_128(step));
        const __m256i w1 = _mm256_cvtepi8_epi16(load_128(step + kStrip));
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; ++r) {
          const __m256i pair = _mm256_set1_epi32(xq.word(first + r, b, h * kSteps + p));
          sums[r][0] = _mm256_add_epi32(sums[r][0], _mm256_madd_epi16(w0, pair));
          sums[r][1] = _mm256_add_epi32(sums[r][1], _mm256_madd_epi16(w1, pair));
        }
      }
      const S* group_scale = scale + (b * kGroups + h) * kStrip;
      __m256 s[2];
      if constexpr (kGroup != 0) {
        s[0] = eight_channels(group_scale);
        s[1] = eight_channels(group_scale + 8);
      }
#pragma GCC unroll 4
      for (int r = 0; r < ROWS; ++r) {
        const __m256 d = _mm256_set1_ps(xq.d[(first + r) * xq.groups + b]);
#pragma GCC unroll 2
        for (int half = 0; half < 2; ++half) {
          __m256 a = _mm256_load_ps(acc[r] + 8 * half);
          const __m256 sd = kGroup == 0 ? d : _mm256_mul_ps(s[half], d);
          a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][half]), sd, a);
          _mm256_store_ps(acc[r] + 8 * half, a);
        }
      }
    }
  }
  __m256 channel[2];  // per-channel scales (kGroup 0), applied once at the end
  if constexpr (kGroup == 0) {
    channel[0] = eight_channels(scale);
    channel[1] = eight_channels(scale + 8);
  }
#pragma GCC unroll 4
  for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      __m256 a = _mm256_load_ps(acc[r] + 8 * half);
      if constexpr (kGroup == 0) a = _mm256_mul_ps(a, channel[half]);
      _mm256_storeu_ps(out + r * ld + 8 * half, a);
    }
  }
}

// The same products with AVX-512 VNNI (512-bit loads; vpdpbusd: unsigned bytes times signed
// bytes, four to an int32 lane, for int4's strips; vpdpwssd: int16 pairs): for int8 weights a
// whole unit of the activations (two blocks) a step, each 512-bit vector holding what the AVX2 rows' two
// chains hold, the first chain's eight lanes in its lower half and the second's in its upper.
// Every lane gets the same exact integer sum as on AVX2 (the same products in the same lane),
// then the same float steps (conversion, product with the scales, FMA), and the last unit(s)
// and the sums across lanes go through the AVX2 code: the outputs are bit for bit the AVX2
// rows', for any number of rows (tests/unit/engine/test_quantization.py checks both).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")

// Activation rows sharing one pass over a weight row: AVX-512's 32 registers hold eight rows'
// sums, so the weights are unpacked half as often per row as with AVX2's tiles of four.
constexpr int kWideTile = 8;

inline __m512i load_512(const void* p) { return _mm512_loadu_si512(p); }

// Floats f[0 .. 4) spread over 16 lanes by `index` (lane i takes f[index[i]]).
inline __m512 spread(__m128 f, __m512i index) {
  return _mm512_permutexvar_ps(index, _mm512_castps128_ps512(f));
}

inline __m128 two_floats(const float* f) {
  return _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(f)));
}

template <typename Row>
struct Wide;

// An int8 row's (Int8Row's, GroupedInt8Row's) blocks b, b + 1: their 64 bytes as 16-byte
// quarters b[0:16], b[16:32], (b+1)[0:16], (b+1)[16:32], the first halves put together and the
// second halves, each widened to int16; lanes 0-7 block b's (the first chain), 8-15 block
// b + 1's. Groups of 16 keep GroupedInt8Row's hadd order within each 128-bit lane.
template <typename Row>
struct Wide {
  static_assert(std::is_same_v<typename Row::Code, int16_t>);
  static constexpr int kGroup = Row::kGroupSize;
  Row row;
  struct Weights {
    __m512i low, high;
    __m512 scale;  // per lane, its group's scale (none for Int8Row)
  };
  inline Weights load(int64_t b) const {
    const __m512i quarters = load_512(row.w + b * kBlock);
    const __m512i halves = _mm512_shuffle_i64x2(quarters, quarters, _MM_SHUFFLE(3, 1, 2, 0));
    Weights wv{_mm512_cvtepi8_epi16(_mm512_castsi512_si256(halves)),
               _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(halves, 1)), _mm512_setzero_ps()};
    if constexpr (kGroup == kBlock) {
      const __m512i eights = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
      wv.scale = spread(two_floats(row.scale + b), eights);
    } else if constexpr (kGroup == kBlock / 2) {  // groups 2b .. 2b + 4, as s0 s0 s1 s1 a lane
      const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3);
      wv.scale = spread(_mm_loadu_ps(row.scale + 2 * b), pairs);
    }
    return wv;
  }
  static inline __m512i dot(const Weights& wv, const int16_t* q) {
    const __m512i zero = _mm512_setzero_si512();
    if constexpr (kGroup != kBlock / 2) {
      return _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(zero, wv.low, load_512(q)), wv.high,
                                 load_512(q + kBlock));
    } else {  // _mm256_hadd_epi32's order in each 128-bit lane: low 0+1, 2+3, high 0+1, 2+3
      const __m512 low = _mm512_castsi512_ps(_mm512_dpwssd_epi32(zero, wv.low, load_512(q)));
      const __m512 high =
          _mm512_castsi512_ps(_mm512_dpwssd_epi32(zero, wv.high, load_512(q + kBlock)));
      return _mm512_add_epi32(
          _mm512_castps_si512(_mm512_shuffle_ps(low, high, _MM_SHUFFLE(2, 0, 2, 0))),
          _mm512_castps_si512(_mm512_shuffle_ps(low, high, _MM_SHUFFLE(3, 1, 3, 1))));
    }
  }
  static inline __m512 accumulate(__m512 acc, __m512 products, const Weights& wv,
                                  const float* act_scale, int64_t b) {
    const __m512 d = _mm512_loadu_ps(act_scale + 8 * b);  // d_lanes: blocks b, b + 1
    if constexpr (kGroup == 0) return _mm512_fmadd_ps(products, d, acc);
    return _mm512_fmadd_ps(_mm512_mul_ps(products, d), wv.scale, acc);
  }
};

// dot_rows with Wide<Row>: whole units a step, then dot_rows_tail on the two halves.
template <int ROWS, typename Row>
inline void dot_rows_wide(const Wide<Row>& wide, const typename Row::Code* q, int64_t k32,
                          const float* scale, int64_t scale_stride, int64_t blocks,
                          float* sums) {
  constexpr int64_t kUnit = QuantizedActivations<typename Row::Code>::kUnit;
  __m512 acc[ROWS];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + kUnit <= blocks; b += kUnit) {
    const typename Wide<Row>::Weights wv = wide.load(b);
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const __m512 products =
          _mm512_cvtepi32_ps(Wide<Row>::dot(wv, q + r * k32 + b * kBlock));
      acc[r] = Wide<Row>::accumulate(acc[r], products, wv, scale + r * scale_stride, b);
    }
  }
  Chains<ROWS, 1> chains;
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
    chains[0][0][r] = _mm512_castps512_ps256(acc[r]);
    chains[1][0][r] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1));
  }
  const Row one[1] = {wide.row};
  dot_rows_tail<ROWS, 1>(one, q, k32, scale, scale_stride, blocks, b, chains, sums, 0);
}

template <typename Row>
void one_weight_row_wide(const Row& row, const typename Row::Code* q, int64_t k32,
                         int64_t blocks, int64_t m, const float* scale, int64_t scale_stride,
                         float* sums) {
  const Wide<Row> wide{row};
  for_each_tile<kWideTile>(m, [&](auto rows, int64_t r0) {
    dot_rows_wide<decltype(rows)::value>(wide, q + r0 * k32, k32, scale + r0 * scale_stride,
                                         scale_stride, blocks, sums + r0);
  });
}

// int4_strip on 512-bit registers: the whole strip a step, vpdpbusd summing each
// channel's products of a group in its lane (exactly the AVX2 code's int16 and int32 sums),
// then the same float steps a lane: bit for bit the AVX2 code's outputs.
inline __m512 sixteen_channels(const at::Half* h) { return _mm512_cvtph_ps(load_256(h)); }
inline __m512 sixteen_channels(const float* f) { return _mm512_loadu_ps(f); }

template <int ROWS, typename S>
inline void int4_strip_wide(const uint8_t* codes, const S* scale, const S* min,
                            const Int4Activations& xq, int64_t first, float* out, int64_t ld) {
  __m512 acc[ROWS];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < xq.groups; ++g) {
    const uint8_t* block = codes + g * kStripGroupBytes;
    __m512i w[8];
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      const __m512i packed = load_512(block + 64 * u);
      w[2 * u] = _mm512_and_si512(packed, nibble);
      w[2 * u + 1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
    }
    const __m512 s = sixteen_channels(scale + g * kStrip);
    const __m512 m = sixteen_channels(min + g * kStrip);
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const int64_t row = first + r;
      // Two chains, so that the eight vpdpbusd do not wait on each other in one line.
      __m512i even = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0],
                                         _mm512_set1_epi32(xq.word(row, g, 0)));
      __m512i odd = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1],
                                        _mm512_set1_epi32(xq.word(row, g, 1)));
#pragma GCC unroll 3
      for (int j = 2; j < 8; j += 2) {
        even = _mm512_dpbusd_epi32(even, w[j], _mm512_set1_epi32(xq.word(row, g, j)));
        odd = _mm512_dpbusd_epi32(odd, w[j + 1], _mm512_set1_epi32(xq.word(row, g, j + 1)));
      }
      const __m512 sums = _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
      const int64_t at = row * xq.groups + g;
      acc[r] = _mm512_fmadd_ps(sums, _mm512_mul_ps(s, _mm512_set1_ps(xq.d[at])), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xq.q_sum[at]), acc[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) _mm512_storeu_ps(out + r * ld, acc[r]);
}

// grouped_int8_strip on 512-bit registers: the whole strip a pair step, vpdpwssd summing each
// channel's products of a group in its lane (the AVX2 code's exact int32 sums; in two chains
// for fewer than four rows, so that one row's dot products do not wait on each other), then
// the same float steps a lane: bit for bit the AVX2 code's outputs.
template <int ROWS, int kGroup, typename S>
inline void grouped_int8_strip_wide(const int8_t* codes, const S* scale,
                                    const Int16Activations& xq, int64_t first, float* out,
                                    int64_t ld, int64_t ahead) {
  constexpr int kGroups = kGroup == 0 ? 1 : kBlock / kGroup;
  constexpr int kSteps = kBlock / 2 / kGroups;
  constexpr int kChains = ROWS >= 4 ? 1 : 2;
  __m512 acc[ROWS];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < xq.groups; ++b) {
    const int8_t* block = codes + b * kStripBlockBytes;
    prefetch_block(block, ahead);
#pragma GCC unroll 2
    for (int h = 0; h < kGroups; ++h) {
      __m512i sums[kChains][ROWS];
#pragma GCC unroll 2
      for (int c = 0; c < kChains; ++c) {
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; ++r) sums[c][r] = _mm512_setzero_si512();
      }
#pragma GCC unroll 16
      for (int p = 0; p < kSteps; ++p) {
        const __m512i w = _mm512_cvtepi8_epi16(load_256(block + 2 * kStrip * (h * kSteps + p)));
        const int c = p % kChains;
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; ++r) {
          sums[c][r] = _mm512_dpwssd_epi32(
              sums[c][r], w, _mm512_set1_epi32(xq.word(first + r, b, h * kSteps + p)));
        }
      }
      __m512 s;
      if constexpr (kGroup != 0) s = sixteen_channels(scale + (b * kGroups + h) * kStrip);
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        __m512i total = sums[0][r];
        if constexpr (kChains == 2) total = _mm512_add_epi32(total, sums[1][r]);
        const __m512 d = _mm512_set1_ps(xq.d[(first + r) * xq.groups + b]);
        const __m512 sd = kGroup == 0 ? d : _mm512_mul_ps(s, d);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), sd, acc[r]);
      }
    }
  }
  __m512 channel;  // per-channel scales (kGroup 0), applied once at the end
  if constexpr (kGroup == 0) channel = sixteen_channels(scale);
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
    _mm512_storeu_ps(out + r * ld, kGroup == 0 ? _mm512_mul_ps(acc[r], channel) : acc[r]);
  }
}

#pragma GCC pop_options

// Whether the AVX-512 rows run (wide_rows): where the CPU has AVX-512 VNNI (and BW, VL) and
// FOLIO_CPU_ISA does not force AVX2 (folio::avx2_forced, read at every call).
bool cpu_has_avx512_vnni() {
  static const bool supported =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return supported;
}

bool wide_rows() { return cpu_has_avx512_vnni() && !folio::avx2_forced(); }

// sums[r] += the scaled dot products of one weight row with activation rows r < m of q (k32
// apart), kTile rows at a time; with the AVX-512 rows, kWideTile at a time, where `wide`.
template <typename Row>
inline void one_weight_row(bool wide, const Row& row, const typename Row::Code* q, int64_t k32,
                           int64_t blocks, int64_t m, const float* scale, int64_t scale_stride,
                           float* sums) {
  if (wide) {
    one_weight_row_wide(row, q, k32, blocks, m, scale, scale_stride, sums);
    return;
  }
  const Row one[1] = {row};
  for_each_tile<kTile>(m, [&](auto rows, int64_t r0) {
    dot_rows<decltype(rows)::value, 1>(one, q + r0 * k32, k32, scale + r0 * scale_stride,
                                       scale_stride, blocks, sums + r0, 0);
  });
}

// sums[o * sums_stride + r] += the scaled dot products of weight rows row[o], o < kCount,
// with activation rows r < m of q (one_weight_row's). With one or two activation rows (a
// decode step of one or two streams), kOutputs weight rows share a pass, four against one row
// or two at a time against two: the activations' loads and the tree of horizontal adds then
// serve four products, each still summed in its own accumulators and tree lane in the order it
// has alone (the same bits). This AVX2 code runs there on CPUs with AVX-512 VNNI too: it
// outpaces the AVX-512 rows' one weight row at a time (bench.quant_kernels: 1.2-1.7x the GB/s on
// the default model's shapes, one row, AVX-512 Xeon), whose 512-bit steps have no rows to share.
// `kCount`: kOutputs (one or two activation rows) or 1, a constant so that a call for one
// channel compiles to one_weight_row alone.
template <int kCount, typename Row>
inline void weight_rows(bool wide, const Row (&row)[kCount], const typename Row::Code* q,
                        int64_t k32, int64_t blocks, int64_t m, const float* scale,
                        int64_t scale_stride, float* sums, int64_t sums_stride) {
  if constexpr (kCount == 1) {
    one_weight_row(wide, row[0], q, k32, blocks, m, scale, scale_stride, sums);
  } else if (m == 1) {
    dot_rows<1, kOutputs>(row, q, k32, scale, scale_stride, blocks, sums, sums_stride);
  } else {
    for (int o = 0; o < kOutputs; o += 2) {
      const Row two[2] = {row[o], row[o + 1]};
      dot_rows<2, 2>(two, q, k32, scale, scale_stride, blocks, sums + o * sums_stride,
                     sums_stride);
    }
  }
}

// out[0 .. 8) = h[0 .. 8) (float16 or float32 group scales) as float32, where `readable` of them
// can be read; past `count` the values are zeros or whatever follows (finite scales, multiplied
// by zero-padded ones).
inline void eight_floats(const at::Half* h, int64_t count, int64_t readable, float* out) {
  if (readable >= 8) {
    _mm256_storeu_ps(out, _mm256_cvtph_ps(load_128(h)));
    return;
  }
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(h);
  for (int64_t i = 0; i < 8; ++i) out[i] = i < count ? _cvtsh_ss(bits[i]) : 0.0f;
}

inline void eight_floats(const float* f, int64_t count, int64_t readable, float* out) {
  if (readable >= 8) {
    _mm256_storeu_ps(out, _mm256_loadu_ps(f));
    return;
  }
  for (int64_t i = 0; i < 8; ++i) out[i] = i < count ? f[i] : 0.0f;
}

void check_inputs(const at::Tensor& x, const at::Tensor& w, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 matrix");
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " columns, the weight ", k);
  TORCH_CHECK(w.is_contiguous(), "the weight must be contiguous");
}

// Activation rows a chunk holds: as many whole tiles as fit in 16 KB (half of L1), at least one
// tile, at most m.
inline int64_t chunk_rows(int64_t m, int64_t row_bytes) {
  constexpr int64_t kChunkBytes = 16 * 1024;
  // (No whole block of 32 features, row_bytes 0: everything is multiplied in float, one chunk.)
  if (row_bytes == 0) return m;
  return std::min(m, std::max<int64_t>(kTile, kChunkBytes / row_bytes / kTile * kTile));
}

// Runs `fill(count, row, first, rows, sums, sums_stride, scratch)` for output channels [row,
// row + count) < n, count (a std::integral_constant) kOutputs where m <= 2 (weight_rows'
// passes over four; the last of a worker's range one at a time) and 1 otherwise, and every
// chunk of activation rows [first, first + rows), in parallel over output channels, sums
// zeroed first, and writes out[(first + r) * ld + row + o] = sums[o * sums_stride + r] (`ld`
// the output's row stride: n, or a fused layer's width where this product is one of its
// parts); scratch holds `scratch_floats` floats per output channel, the worker's own. A
// chunk's quantized rows (`row_bytes` each) fit in L1 together, so each weight row is read
// from memory once per chunk and the activations stay in L1 across weight rows.
template <typename Fill>
void for_each_output(int64_t m, int64_t n, int64_t row_bytes, int64_t scratch_floats, float* out,
                     int64_t ld, const Fill& fill) {
  const int64_t chunk = chunk_rows(m, row_bytes);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(kOutputs * chunk), scratch(kOutputs * scratch_floats);
    for (int64_t first = 0; first < m; first += chunk) {
      const int64_t rows = std::min(chunk, m - first);
      const auto channels = [&](auto count, int64_t row) {
        constexpr int kCount = decltype(count)::value;
        std::fill(sums.begin(), sums.begin() + kCount * chunk, 0.0f);
        fill(count, row, first, rows, sums.data(), chunk, scratch.data());
        for (int o = 0; o < kCount; ++o) {
          const float* const sum = sums.data() + o * chunk;
          float* const column = out + first * ld + row + o;
          for (int64_t r = 0; r < rows; ++r) column[r * ld] = sum[r];
        }
      };
      int64_t row = begin;
      if (m <= 2) {
        for (; row + kOutputs <= end; row += kOutputs) {
          channels(std::integral_constant<int, kOutputs>{}, row);
        }
      }
      for (; row < end; ++row) channels(std::integral_constant<int, 1>{}, row);
    }
  });
}

// A new [M, N] float32 output for x's rows.
at::Tensor new_output(const at::Tensor& x, int64_t n) {
  return at::empty({x.size(0), n}, x.options());
}

// x's rows [M, K] times grouped int8 weights w [N, K] with scales [N, K/G] float16 or float32
// (G = 32 or 16 features to a group, w = scale * code), written to out[m, row] at m * ld + row.
template <int kGroup, typename S>
void grouped_int8_rows(bool wide, const QuantizedActivations<int16_t>& xq, int64_t m,
                       const at::Tensor& w, const S* scales, float* out, int64_t ld) {
  const int64_t k = w.size(1), n = w.size(0);
  const int8_t* ws = w.data_ptr<int8_t>();
  const int64_t groups = k / kGroup;
  const int64_t row_bytes = xq.k32 * static_cast<int64_t>(sizeof(int16_t));
  constexpr bool kWide = std::is_same_v<S, float>;
  // scratch: a float16 row's scales in float32 (float32 ones are read where they lie).
  const int64_t scratch_floats = kWide ? 0 : round_up(groups, 8);
  for_each_output(m, n, row_bytes, scratch_floats, out, ld,
                  [&](auto count, int64_t row, int64_t first, int64_t rows, float* sums,
                      int64_t sums_stride, float* scratch) {
    constexpr int kCount = decltype(count)::value;
    GroupedInt8Row<kGroup> weight[kCount];
    for (int o = 0; o < kCount; ++o) {
      const int64_t channel = row + o;
      const float* row_scale;
      if constexpr (kWide) {
        row_scale = scales + channel * groups;
      } else {
        float* const converted = scratch + o * scratch_floats;
        for (int64_t g = 0; g < groups; g += 8) {
          const int64_t at = channel * groups + g;
          eight_floats(scales + at, groups - g, n * groups - at, converted + g);
        }
        row_scale = converted;
      }
      weight[o] = {ws + channel * k, row_scale};
    }
    weight_rows(wide, weight, xq.q.data() + first * xq.k32, xq.k32, xq.blocks, rows,
                xq.d_lanes.data() + first * xq.blocks * xq.kLanes, xq.blocks * xq.kLanes, sums,
                sums_stride);
  });
}

// A weight's output features: strips (int4's, grouped int8's) hold 16 each.
inline int64_t part_outputs(const at::Tensor& codes) {
  return codes.dim() == 3 ? codes.size(0) * kStrip : codes.size(0);
}

// A grouped int8 weight's input features: row-major [N, K], or strips [N / 16, K / 32, 512].
inline int64_t grouped_int8_inputs(const at::Tensor& w) {
  return w.dim() == 3 ? w.size(1) * kBlock : w.size(1);
}

void check_grouped_int8(const at::Tensor& w, const at::Tensor& scale) {
  const at::ScalarType type = scale.scalar_type();
  const bool strips = w.dim() == 3;
  TORCH_CHECK(w.scalar_type() == at::kChar && (type == at::kHalf || type == at::kFloat) &&
                  scale.is_contiguous(),
              "grouped_int8_linear takes int8 weights [N, K] and float16 or float32 scales "
              "[N, groups]");
  const int64_t k = grouped_int8_inputs(w);
  if (strips) {
    TORCH_CHECK(w.size(2) == kStripBlockBytes && w.is_contiguous() && scale.dim() == 3 &&
                    scale.size(0) == w.size(0) && scale.size(2) == kStrip,
                "grouped int8 strips are grouped_int8_strip_codes' contiguous int8 [N / 16, "
                "K / 32, 512] with scales [N / 16, groups, 16]");
  } else {
    TORCH_CHECK(w.dim() == 2 && scale.dim() == 2 && scale.size(0) == w.size(0),
                "grouped_int8_linear takes int8 weights [N, K] and float16 or float32 scales "
                "[N, groups]");
    TORCH_CHECK(k % kBlock == 0, "grouped int8 needs input features divisible by ", kBlock,
                ", got ", k);
  }
  const int64_t groups = scale.size(1);
  TORCH_CHECK(groups == k / kBlock || groups == 2 * (k / kBlock),
              "grouped int8 takes a scale per 32 or per 16 input features: ", groups,
              " groups for ", k, " features");
}

// x's rows [M, K] (quantized: xq) times grouped int8 strips (codes [N / 16, K / 32, 512], scales
// [N / 16, K / G, 16]; kGroup 0: int8 with a scale per output channel, [N / 16, 16]), written to
// out[m, n] at m * ld + n. Parallel over strips; each strip's
// widened codes serve kInt8StripRows (kInt8StripWideRows) activation rows a pass.
template <int kGroup, typename S>
void grouped_int8_strips(bool wide, const Int16Activations& xq, int64_t m,
                         const at::Tensor& codes, const S* scales, float* out, int64_t ld) {
  const int8_t* cs = codes.data_ptr<int8_t>();
  // Scales of a strip: per group (kGroup 32 or 16) or per channel (kGroup 0: one vector).
  const int64_t blocks = xq.groups, groups = kGroup == 0 ? 1 : blocks * (kBlock / kGroup);
  at::parallel_for(0, codes.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t strip = begin; strip < end; ++strip) {
      const int8_t* strip_codes = cs + strip * blocks * kStripBlockBytes;
      const S* scale = scales + strip * groups * kStrip;
      float* columns = out + strip * kStrip;
      const auto ahead = [&](int64_t r0) {
        return r0 == 0 ? kPrefetchStrips * blocks * kStripBlockBytes : 0;
      };
      if (wide) {
        for_each_tile<kInt8StripWideRows>(m, [&](auto tile, int64_t r0) {
          grouped_int8_strip_wide<decltype(tile)::value, kGroup>(
              strip_codes, scale, xq, r0, columns + r0 * ld, ld, ahead(r0));
        });
      } else {
        for_each_tile<kInt8StripRows>(m, [&](auto tile, int64_t r0) {
          grouped_int8_strip<decltype(tile)::value, kGroup>(strip_codes, scale, xq, r0,
                                                            columns + r0 * ld, ld, ahead(r0));
        });
      }
    }
  });
}

// A checked grouped int8 weight's product (check_grouped_int8) in either layout, its scales'
// type and group size chosen; each layout's activations made when first needed (`rows`,
// `strips`: one call's, shared by a fused layer's parts).
void grouped_int8_into(bool wide, const float* x, int64_t m,
                       std::optional<QuantizedActivations<int16_t>>& rows,
                       std::optional<Int16Activations>& strips, const at::Tensor& w,
                       const at::Tensor& scale, float* out, int64_t ld) {
  const int64_t k = grouped_int8_inputs(w);
  const bool halves = scale.size(1) == 2 * (k / kBlock);
  auto run = [&](const auto* s) {
    if (w.dim() == 3) {
      if (!strips) strips.emplace(x, m, k);
      halves ? grouped_int8_strips<kBlock / 2>(wide, *strips, m, w, s, out, ld)
             : grouped_int8_strips<kBlock>(wide, *strips, m, w, s, out, ld);
      return;
    }
    if (!rows) rows.emplace(x, m, k);
    halves ? grouped_int8_rows<kBlock / 2>(wide, *rows, m, w, s, out, ld)
           : grouped_int8_rows<kBlock>(wide, *rows, m, w, s, out, ld);
  };
  if (scale.scalar_type() == at::kFloat) {
    run(scale.data_ptr<float>());
  } else {
    run(scale.data_ptr<at::Half>());
  }
}

// x's rows [M, K] (quantized: xq) times int4 codes [N / 16, K / 32, 256] uint8
// (int4_strip_codes' layout) with scale and min [N / 16, K / 32, 16] float16, or both float32,
// written to out[m, n] at m * ld + n. Parallel over strips; each strip's codes are unpacked
// once per kInt4Rows (kInt4WideRows) activation rows.
template <typename S>
void int4_strips(bool wide, const Int4Activations& xq, int64_t m, const at::Tensor& codes,
                 const S* scales, const S* mins, float* out, int64_t ld) {
  const uint8_t* cs = codes.data_ptr<uint8_t>();
  const int64_t groups = xq.groups;
  at::parallel_for(0, codes.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t strip = begin; strip < end; ++strip) {
      const uint8_t* strip_codes = cs + strip * groups * kStripGroupBytes;
      const S* scale = scales + strip * groups * kStrip;
      const S* min = mins + strip * groups * kStrip;
      if (wide) {
        for_each_tile<kInt4WideRows>(m, [&](auto tile, int64_t r0) {
          int4_strip_wide<decltype(tile)::value>(strip_codes, scale, min, xq, r0,
                                                 out + r0 * ld + strip * kStrip, ld);
        });
        continue;
      }
      for_each_tile<kInt4Rows>(m, [&](auto tile, int64_t r0) {
        const int64_t ahead = r0 == 0 ? kPrefetchStrips * groups * kStripGroupBytes : 0;
        int4_strip<decltype(tile)::value>(strip_codes, scale, min, xq, r0,
                                          out + r0 * ld + strip * kStrip, ld, ahead);
      });
    }
  });
}

void check_int4(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& min) {
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.size(2) == kStripGroupBytes,
              "int4 codes are int4_strip_codes' contiguous uint8 [N / 16, K / 32, 256]");
  const at::ScalarType type = scale.scalar_type();
  TORCH_CHECK((type == at::kHalf || type == at::kFloat) && min.scalar_type() == type &&
                  scale.is_contiguous() && min.is_contiguous() &&
                  scale.numel() == codes.size(0) * codes.size(1) * kStrip &&
                  min.numel() == scale.numel(),
              "int4_linear takes scales and minimums per group and channel, [N / 16, K / 32, "
              "16], both float16 or both float32");
}

// A checked int4 weight's product (check_int4), its scales' type chosen.
void int4_into(bool wide, const Int4Activations& xq, int64_t m, const at::Tensor& codes,
               const at::Tensor& scale, const at::Tensor& min, float* out, int64_t ld) {
  if (scale.scalar_type() == at::kFloat) {
    int4_strips(wide, xq, m, codes, scale.data_ptr<float>(), min.data_ptr<float>(), out, ld);
  } else {
    int4_strips(wide, xq, m, codes, scale.data_ptr<at::Half>(), min.data_ptr<at::Half>(), out,
                ld);
  }
}

}  // namespace

// int8_linear over strips of 16 output channels (grouped_int8_strip_codes' [N / 16, K / 32, 512],
// float32 scales [N / 16, 16]): per channel, its blocks' exact int32 sums times the
// activations' scales added up, then times the channel's scale.
at::Tensor int8_strips_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  TORCH_CHECK(w.scalar_type() == at::kChar && w.size(2) == kStripBlockBytes &&
                  scales.scalar_type() == at::kFloat && scales.dim() == 2 &&
                  scales.size(0) == w.size(0) && scales.size(1) == kStrip &&
                  scales.is_contiguous(),
              "int8 strips are grouped_int8_strip_codes' contiguous int8 [N / 16, K / 32, 512] "
              "with float32 scales [N / 16, 16]");
  const int64_t k = grouped_int8_inputs(w), n = part_outputs(w);
  check_inputs(x, w, k);
  const Int16Activations xq(x.data_ptr<float>(), x.size(0), k);
  at::Tensor out = new_output(x, n);
  grouped_int8_strips<0>(wide_rows(), xq, x.size(0), w, scales.data_ptr<float>(),
                         out.data_ptr<float>(), n);
  return out;
}

// x [M, K] float32, w [N, K] int8, scales [N] float32 -> [M, N] float32. Input features past the
// last whole block of 32 are multiplied in float. Or w in strips (int8_strips_linear).
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  if (w.dim() == 3) return int8_strips_linear(x, w, scales);
  const int64_t k = w.size(1), m = x.size(0), n = w.size(0);
  check_inputs(x, w, k);
  TORCH_CHECK(w.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat &&
                  scales.is_contiguous() && scales.numel() == n,
              "int8_linear takes int8 weights and float32 scales, one per output channel");
  const float* xs = x.data_ptr<float>();
  const int8_t* ws = w.data_ptr<int8_t>();
  const float* ss = scales.data_ptr<float>();
  const QuantizedActivations<int16_t> xq(xs, m, k);
  const bool wide = wide_rows();
  const int64_t row_bytes = xq.k32 * static_cast<int64_t>(sizeof(int16_t));
  at::Tensor out = new_output(x, n);
  for_each_output(m, n, row_bytes, 0, out.data_ptr<float>(), n,
                  [&](auto count, int64_t row, int64_t first, int64_t rows, float* sums,
                      int64_t sums_stride, float*) {
    constexpr int kCount = decltype(count)::value;
    Int8Row weight[kCount];
    for (int o = 0; o < kCount; ++o) weight[o] = {ws + (row + o) * k};
    weight_rows(wide, weight, xq.q.data() + first * xq.k32, xq.k32, xq.blocks, rows,
                xq.d_lanes.data() + first * xq.blocks * xq.kLanes, xq.blocks * xq.kLanes, sums,
                sums_stride);
    for (int o = 0; o < kCount; ++o) {
      const int8_t* wr = weight[o].w;
      for (int64_t r = 0; r < rows; ++r) {
        const float* xr = xs + (first + r) * k;
        float& sum = sums[o * sums_stride + r];
        for (int64_t i = xq.k32; i < k; ++i) sum += xr[i] * wr[i];
        sum *= ss[row + o];
      }
    }
  });
  return out;
}

// x [M, K] float32, w [N, K] int8 with scale [N, K/G] float16 or float32 (G = 32 or 16 features
// to a group, w = scale * code), or the same weight in strips (grouped_int8_strip_codes' [N /
// 16, K / 32, 512], scales [N / 16, K / G, 16]) -> [M, N] float32.
at::Tensor grouped_int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  check_grouped_int8(w, scale);
  check_inputs(x, w, grouped_int8_inputs(w));
  std::optional<QuantizedActivations<int16_t>> rows;
  std::optional<Int16Activations> strips;
  const int64_t n = part_outputs(w);
  at::Tensor out = new_output(x, n);
  grouped_int8_into(wide_rows(), x.data_ptr<float>(), x.size(0), rows, strips, w, scale,
                    out.data_ptr<float>(), n);
  return out;
}

// Rows `ids` (int64, any shape) of a grouped int8 weight in either layout (row-major [N, K] or
// strips) as float32, code * scale exactly: [*ids.shape, K]. An embedding lookup as one opaque
// op, so that compiled decode programs read its rows from a buffer as they read a product's: a
// gather traced into the next RMSNorm's reduction was vectorized otherwise at one row than at
// several, and greedy tokens differed between decode and verification steps.
at::Tensor grouped_int8_lookup(const at::Tensor& ids, const at::Tensor& w,
                               const at::Tensor& scale) {
  check_grouped_int8(w, scale);
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong,
              "grouped_int8_lookup takes int64 ids on the CPU, got ", ids.scalar_type());
  const int64_t n = part_outputs(w), k = grouped_int8_inputs(w), groups = scale.size(1);
  const int64_t group = k / groups;
  const at::Tensor flat = ids.contiguous().view(-1);
  const int64_t* id = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < flat.numel(); ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < n, "grouped_int8_lookup: id ", id[i], " outside [0, ", n,
                ")");
  }
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(k);
  at::Tensor out = at::empty(shape, ids.options().dtype(at::kFloat));
  float* to = out.data_ptr<float>();
  const int8_t* codes = w.data_ptr<int8_t>();
  const bool strips = w.dim() == 3;
  auto run = [&](const auto* scales) {
    at::parallel_for(0, flat.numel(), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t row = id[i], strip = row / kStrip, channel = row % kStrip;
        float* target = to + i * k;
        for (int64_t f = 0; f < k; ++f) {
          // grouped_int8_strip_codes: feature f = 32 b + 2 p + j of channel c at byte 512 b +
          // 32 p + 2 c + j of its strip; its group's scale at [strip, group, channel].
          const int64_t b = f / kBlock, p = f % kBlock / 2;
          const int8_t code =
              strips ? codes[(strip * (k / kBlock) + b) * kStripBlockBytes + p * 2 * kStrip +
                             channel * 2 + f % 2]
                     : codes[row * k + f];
          const int64_t g = f / group;
          const float s = static_cast<float>(
              strips ? scales[(strip * groups + g) * kStrip + channel] : scales[row * groups + g]);
          target[f] = static_cast<float>(code) * s;
        }
      }
    });
  };
  if (scale.scalar_type() == at::kFloat) {
    run(scale.data_ptr<float>());
  } else {
    run(scale.data_ptr<at::Half>());
  }
  return out;
}

// x [M, K] float32; codes [N / 16, K / 32, 256] uint8 (int4_strip_codes' layout); scale and
// min [N / 16, K / 32, 16] float16, or both float32 -> [M, N] float32.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                       const at::Tensor& min) {
  check_int4(codes, scale, min);
  check_inputs(x, codes, codes.size(1) * kBlock);
  const Int4Activations xq(x.data_ptr<float>(), x.size(0), x.size(1));
  const int64_t n = codes.size(0) * kStrip;
  at::Tensor out = new_output(x, n);
  int4_into(wide_rows(), xq, x.size(0), codes, scale, min, out.data_ptr<float>(), n);
  return out;
}

// A fused layer whose parts (q, k and v; gate and up) keep different layouts: part i is int4
// (codes[i] uint8 [N_i / 16, K / 32, 256], scales[i] and mins[i] as int4_linear's) or grouped
// int8 (codes[i] and scales[i] as grouped_int8_linear's, either layout; mins[i] None). x [M,
// K] float32 -> [M, sum N_i] float32, part i's products in its columns, each exactly what its
// own op gives (the activations quantized once per kind, each part writing its columns in
// place: no per-part outputs to concatenate).
at::Tensor parts_linear(const at::Tensor& x, at::TensorList codes, at::TensorList scales,
                        const c10::List<std::optional<at::Tensor>>& mins) {
  TORCH_CHECK(!codes.empty() && scales.size() == codes.size() && mins.size() == codes.size(),
              "parts_linear takes as many scales and minimums as codes, at least one part; got ",
              codes.size(), " codes, ", scales.size(), " scales and ", mins.size(), " minimums");
  TORCH_CHECK(x.dim() == 2, "x must be a contiguous float32 matrix");
  const int64_t k = x.size(1);
  int64_t n = 0;
  for (size_t i = 0; i < codes.size(); ++i) {
    const std::optional<at::Tensor> min = mins[i];
    const bool is_int4 = min.has_value();
    TORCH_CHECK(codes[i].dim() == 3 || (!is_int4 && codes[i].dim() == 2), "part ", i,
                " of parts_linear: codes must be ",
                is_int4 ? "int4_strip_codes' [N / 16, K / 32, 256]"
                        : "a matrix or grouped_int8_strip_codes' strips");
    const int64_t width = codes[i].dim() == 3 ? codes[i].size(1) * kBlock : codes[i].size(1);
    TORCH_CHECK(width == k, "part ", i, " of parts_linear (", is_int4 ? "int4" : "grouped int8",
                ", codes of shape ", codes[i].sizes(), ") takes ", width,
                " input features; x has ", k);
    check_inputs(x, codes[i], k);
    if (is_int4) {
      check_int4(codes[i], scales[i], *min);
    } else {
      check_grouped_int8(codes[i], scales[i]);
    }
    n += part_outputs(codes[i]);
  }
  const int64_t m = x.size(0);
  const float* xs = x.data_ptr<float>();
  // Each kind's quantized activations made where its first part runs (still in cache for it).
  std::optional<Int4Activations> x8;
  std::optional<QuantizedActivations<int16_t>> x16;
  std::optional<Int16Activations> x16_strips;
  at::Tensor out = new_output(x, n);
  float* columns = out.data_ptr<float>();
  const bool wide = wide_rows();
  for (size_t i = 0; i < codes.size(); ++i) {
    const std::optional<at::Tensor> min = mins[i];
    if (min.has_value()) {
      if (!x8) x8.emplace(xs, m, k);
      int4_into(wide, *x8, m, codes[i], scales[i], *min, columns, n);
    } else {
      grouped_int8_into(wide, xs, m, x16, x16_strips, codes[i], scales[i], columns, n);
    }
    columns += part_outputs(codes[i]);
  }
  return out;
}

namespace {

// Eight 32-bit lanes of eight vectors transposed: lane i of v[j] to lane j of v[i].
inline void transpose_8x8(__m256i (&v)[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
    v[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
  }
}

// A group's 32 codes in order (positions 0-15 in the lower 128 bits) to `out` as code * scale
// + min, float32 or bfloat16.
template <typename Out>
inline void dequantize_group(__m256i codes, float scale, float min, Out* out) {
  const __m256 s = _mm256_set1_ps(scale), minimum = _mm256_set1_ps(min);
  for (int e = 0; e < 4; ++e) {
    const __m128i half = e < 2 ? _mm256_castsi256_si128(codes) : _mm256_extracti128_si256(codes, 1);
    const __m128i eight = e % 2 == 0 ? half : _mm_srli_si128(half, 8);
    const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight)), s, minimum);
    if constexpr (std::is_same_v<Out, float>) {
      _mm256_storeu_ps(out + 8 * e, w);
    } else {
      folio::store8_bf16(out + 8 * e, w);
    }
  }
}

// Strip `strip` of int4 codes (groups of 256 bytes) as float [16, groups * 32] rows of `out`
// (`k` apart): per group and half strip, the eight vectors of positions 4 j .. 4 j + 4 of eight
// channels (a lane to a channel), transposed to a vector per channel.
template <typename S, typename Out>
void int4_dequantize_strip(const uint8_t* codes, const S* scales, const S* mins, int64_t groups,
                           Out* out, int64_t k) {
  for (int64_t g = 0; g < groups; ++g) {
    for (int h = 0; h < 2; ++h) {
      __m256i v[8];
      unpack_half_strip(codes + g * kStripGroupBytes + 32 * h, v);
      transpose_8x8(v);
      for (int i = 0; i < 8; ++i) {
        const int64_t channel = 8 * h + i, at = g * kStrip + channel;
        dequantize_group(v[i], static_cast<float>(scales[at]), static_cast<float>(mins[at]),
                         out + channel * k + g * kBlock);
      }
    }
  }
}

}  // namespace

// The float weight [N, K] of int4 codes (int4_strip_codes' layout, [N / 16, K / 32, 256]) with
// float16 or float32 scales and minimums [N / 16, K / 32, 16], as float32 (w = code * scale +
// min) or bfloat16 (that value rounded to nearest even): long prefills' products multiply by it
// in one dense matmul. One pass, parallel over strips.
at::Tensor int4_dequantize(const at::Tensor& codes, const at::Tensor& scale,
                           const at::Tensor& min, at::ScalarType dtype) {
  check_int4(codes, scale, min);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "int4_dequantize writes float32 or bfloat16, not ", dtype);
  const int64_t strips = codes.size(0), groups = codes.size(1), k = groups * kBlock;
  at::Tensor out = at::empty({strips * kStrip, k}, codes.options().dtype(dtype));
  const uint8_t* cs = codes.data_ptr<uint8_t>();
  auto run = [&](auto* scales, auto* mins, auto* to) {
    at::parallel_for(0, strips, 1, [&](int64_t begin, int64_t end) {
      for (int64_t s = begin; s < end; ++s) {
        const int64_t first = s * groups;
        int4_dequantize_strip(cs + first * kStripGroupBytes, scales + first * kStrip,
                              mins + first * kStrip, groups, to + s * kStrip * k, k);
      }
    });
  };
  auto with_scales = [&](auto* scales, auto* mins) {
    if (dtype == at::kFloat) {
      run(scales, mins, out.data_ptr<float>());
    } else {
      run(scales, mins, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
    }
  };
  if (scale.scalar_type() == at::kFloat) {
    with_scales(scale.data_ptr<float>(), min.data_ptr<float>());
  } else {
    with_scales(scale.data_ptr<at::Half>(), min.data_ptr<at::Half>());
  }
  return out;
}

// Int4 codes in Q4_1's order (byte p of a group: position p in its low half, p + 16 in its
// high), given as [rows, groups, 16] uint8 with each group's bytes adjacent and rows and groups
// at any stride (a GGUF tensor's Q4_0/Q4_1 blocks, past their scales, read in place), rows a
// multiple of 16, in the order the products read them: [rows / 16, groups, 256], strips of 16
// rows as the comment above kStrip says. A lossless permutation, once per weight at load; one
// pass, parallel over strips.
at::Tensor int4_strip_codes(const at::Tensor& groups) {
  TORCH_CHECK(groups.dim() == 3 && groups.scalar_type() == at::kByte &&
                  groups.size(2) == kBlock / 2 && groups.stride(2) == 1,
              "int4_strip_codes takes uint8 codes as [rows, groups, 16], a group's bytes "
              "adjacent");
  const int64_t n = groups.size(0), count = groups.size(1);
  TORCH_CHECK(n % kStrip == 0, "int4_strip_codes takes rows in strips of ", kStrip, "; got ", n,
              " rows");
  const int64_t row_stride = groups.stride(0), group_stride = groups.stride(1);
  at::Tensor out = at::empty({n / kStrip, count, kStripGroupBytes}, groups.options());
  const uint8_t* in = groups.data_ptr<uint8_t>();
  uint8_t* strips = out.data_ptr<uint8_t>();
  at::parallel_for(0, n / kStrip, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      for (int64_t g = 0; g < count; ++g) {
        uint8_t* block = strips + (s * count + g) * kStripGroupBytes;
        for (int64_t c = 0; c < kStrip; ++c) {
          const uint8_t* q = in + (s * kStrip + c) * row_stride + g * group_stride;
          // Quarter j of the group (bytes 4 j .. 4 j + 4) holds positions 4 j + i and 16 + 4 j + i.
          for (int i = 0; i < 4; ++i) {
            const uint8_t a = q[i], b = q[4 + i], d = q[8 + i], e = q[12 + i];
            block[4 * c + i] = (a & 0xF) | (b << 4);
            block[64 + 4 * c + i] = (d & 0xF) | (e << 4);
            block[128 + 4 * c + i] = (a >> 4) | (b & 0xF0);
            block[192 + 4 * c + i] = (d >> 4) | (e & 0xF0);
          }
        }
      }
    }
  });
  return out;
}

// Schemas here, kernels for the CPU key only, so torch.compile can trace the ops through the
// shape functions engine/kernels/cpu/extension.py registers.
TORCH_LIBRARY(folio_quant, library) {
  library.def("int8_linear(Tensor x, Tensor weight, Tensor scales) -> Tensor");
  library.def("int4_linear(Tensor x, Tensor codes, Tensor scale, Tensor min) -> Tensor");
  library.def("grouped_int8_linear(Tensor x, Tensor weight, Tensor scale) -> Tensor");
  library.def("grouped_int8_lookup(Tensor ids, Tensor weight, Tensor scale) -> Tensor");
  library.def("cpu_has_avx512_vnni() -> bool", &cpu_has_avx512_vnni);
  library.def("parts_linear(Tensor x, Tensor[] codes, Tensor[] scales, Tensor?[] mins) -> Tensor");
  library.def("int4_dequantize(Tensor codes, Tensor scale, Tensor min, ScalarType dtype) -> Tensor");
  library.def("int4_strip_codes(Tensor groups) -> Tensor");
}

TORCH_LIBRARY_IMPL(folio_quant, CPU, library) {
  library.impl("int8_linear", &int8_linear);
  library.impl("int4_linear", &int4_linear);
  library.impl("grouped_int8_linear", &grouped_int8_linear);
  library.impl("grouped_int8_lookup", &grouped_int8_lookup);
  library.impl("parts_linear", &parts_linear);
  library.impl("int4_dequantize", &int4_dequantize);
  library.impl("int4_strip_codes", &int4_strip_codes);
}
