// Paged attention on x86 CPUs with AVX2 and FMA, over the paged KV cache in place: one call does
// a layer's work for a step. It writes each new token's K and V into its cache slot, then
// attends each token to its context up to itself. q, k, v and the cache are float32 or bfloat16
// (all the same), or the cache bfloat16 under float32 q, k and v (--kv-cache-dtype bfloat16: new
// K and V rounded to nearest even as they are written, half float32's bytes read), or an 8-bit
// float cache (fp8 e4m3 or e5m2, --kv-cache-dtype fp8*) under either (new K and V rounded to
// nearest even, saturating at the format's largest finite value, a quarter of float32's bytes
// read); the arithmetic is float32, narrower values widened exactly as they are loaded (an fp8
// value through float16's converter: e5m2 is float16's upper byte, e4m3 one after a shift and a
// power of two) and a bfloat16 output rounded to nearest even once at the end.
//
// - paged_decode_attention: one query token a request (a decode-only step). A row's query heads
//   are scored against the cached keys, read through the block table a block at a time with
//   all the row's KV heads together, eight positions at a time (one tree of horizontal adds for
//   eight dot products); then the softmax, and the values mixed, each loaded once for up to
//   three query heads of its KV head (few rows split their KV heads over the threads). Those
//   loops (cpu_attention_body.h) run in 16-float AVX-512 vectors where the CPU has AVX-512F
//   and head_dim is a multiple of 16 (FOLIO_CPU_ISA=avx2 keeps AVX2's 8-float ones). A
//   compiled decode program calls decode_step_attention instead, which reads the caches and
//   tables of the step bound to its thread (bind_decode_step).
// - paged_attention: any step. Decodes as above; a prefill's or extend's tokens in bfloat16 on
//   CPUs with AVX-512 BF16 in blocks (see "Prefill blocks" below), otherwise each token as a
//   decode whose context ends at itself.
// - A token seeing more than kChunkPositions positions attends them a chunk at a time, each
//   chunk an item of its own (its largest score, its exponentials' sum and the values they mix),
//   merged in order after all items: one long row keeps both threads busy. The chunks follow
//   from the token's own context, never from its step, so its output's bits do not either.
// - A request's consecutive rows (a verification step's drafts, rows whose tables match and
//   whose contexts grow by one; an extend's tokens) attend in groups of up to kGroupRows that
//   read each block once for all of them, each row's arithmetic what it is alone.
// - A sliding window (`window` > 0, Mistral's and Gemma 3's local layers): a token sees only its
//   last `window` positions, itself included, and only those are read; a windowed prefill takes
//   the per-token path.
// - Attention sinks (`sinks`, gpt-oss): one more logit per query head in every softmax's
//   denominator, adding nothing to the values mixed; with a window too, the sink joins the
//   softmax over the window's positions.
//
// Work is split over torch's thread pool only when there is enough of it to pay for the pool's
// wake-up. This file computes attention only; choosing it over the backend's plain torch path
// is engine/attention/torch_backend.py's job.

#include <immintrin.h>
#include "avx2.h"
#include "bf16_tiles.h"
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using folio::horizontal_sum;

using bf16 = c10::BFloat16;
using e4m3 = c10::Float8_e4m3fn;
using e5m2 = c10::Float8_e5m2;

// The 8-bit float caches' sixteen (eight) codes, their bytes, as float16 bits: e5m2 is float16's
// upper byte; e4m3's exponent and mantissa go under float16's (bias 15 for 7: the value times
// 2^-8, subnormals included, undone by fp8_scale after widening): the code sign-extended and
// shifted by 7 puts its sign at bit 15 and its other bits at 13 .. 7, and a copy of the sign at
// bit 14, which the mask clears.
inline __m256i half_bits(__m128i codes, e5m2) {
  return _mm256_slli_epi16(_mm256_cvtepu8_epi16(codes), 8);
}
inline __m256i half_bits(__m128i codes, e4m3) {
  const __m256i shifted = _mm256_slli_epi16(_mm256_cvtepi8_epi16(codes), 7);
  return _mm256_and_si256(shifted, _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
}
inline __m128i half_bits8(__m128i codes, e5m2) {
  return _mm_slli_epi16(_mm_cvtepu8_epi16(codes), 8);
}
inline __m128i half_bits8(__m128i codes, e4m3) {
  const __m128i shifted = _mm_slli_epi16(_mm_cvtepi8_epi16(codes), 7);
  return _mm_and_si128(shifted, _mm_set1_epi16(static_cast<int16_t>(0xBF80)));
}
// What a widened code is multiplied by: 1 for e5m2, 2^8 for e4m3.
constexpr float fp8_scale(e5m2) { return 1.0f; }
constexpr float fp8_scale(e4m3) { return 256.0f; }
template <typename C>
constexpr bool kFp8 = std::is_same_v<C, e4m3> || std::is_same_v<C, e5m2>;

// Below this many (context position x query head) scores a call stays on the calling thread.
constexpr int64_t kParallelScores = 4096;
// Chunked tokens' merges a thread takes at least (each a few hundred floats' work).
constexpr int64_t kParallelMerges = 64;

// e^x for x <= 0, eight at a time: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6
// Taylor polynomial (relative error ~2e-7, float32's own rounding), 2^n through the exponent
// bits. Inputs below -87 give 0's neighbourhood (e^-87 ~ 1.6e-38), never a denormal.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln2, with ln2 split in two so that n * ln2_high is exact.
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i exponent = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), exponent));
}

// s[0 .. length) becomes exp(s - top) (top at least their largest); returns their sum, the
// vectors' lanes added to `start` first, then the last few values in order.
inline float exponentiate(float* s, int64_t length, float top, float start) {
  const __m256 shift = _mm256_set1_ps(top);
  __m256 total8 = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= length; t += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t), shift));
    _mm256_storeu_ps(s + t, e);
    total8 = _mm256_add_ps(total8, e);
  }
  float total = horizontal_sum(total8) + start;
  for (; t < length; ++t) total += (s[t] = std::exp(s[t] - top));
  return total;
}

// The largest of s[0 .. length) (length >= 1), exactly: std::max_element's scalar loop waits on
// each comparison before the next and took a tenth of a decode step's attention.
inline float largest(const float* s, int64_t length) {
  __m256 top[4];
  for (__m256& t : top) t = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 32 <= length; t += 32)
    for (int j = 0; j < 4; ++j) top[j] = _mm256_max_ps(top[j], _mm256_loadu_ps(s + t + 8 * j));
  for (; t + 8 <= length; t += 8) top[0] = _mm256_max_ps(top[0], _mm256_loadu_ps(s + t));
  const __m256 all = _mm256_max_ps(_mm256_max_ps(top[0], top[1]), _mm256_max_ps(top[2], top[3]));
  __m128 four = _mm_max_ps(_mm256_castps256_ps128(all), _mm256_extractf128_ps(all, 1));
  four = _mm_max_ps(four, _mm_movehl_ps(four, four));
  float result = _mm_cvtss_f32(_mm_max_ss(four, _mm_movehdup_ps(four)));
  for (; t < length; ++t) result = std::max(result, s[t]);
  return result;
}

// s[0 .. length) becomes softmax(s), over one more logit `sink` that takes its share of the
// denominator and is dropped (an attention sink; -infinity: none, its exponential 0).
inline void softmax(float* s, int64_t length, float sink) {
  const float top = std::max(largest(s, length), sink);
  const float total = exponentiate(s, length, top, std::exp(sink - top));
  int64_t t = 0;
  const __m256 inverse = _mm256_set1_ps(1.0f / total);
  for (t = 0; t + 8 <= length; t += 8)
    _mm256_storeu_ps(s + t, _mm256_mul_ps(_mm256_loadu_ps(s + t), inverse));
  for (; t < length; ++t) s[t] *= 1.0f / total;
}

inline bool cpu_has_avx512f() {
  static const bool supported = __builtin_cpu_supports("avx512f");
  return supported;
}

struct Layout {
  int64_t heads, kv_heads, group, head_dim, block_size;
  int64_t window;               // a token sees this many positions, itself included (0: all)
  int64_t q_row, k_row, v_row;  // row strides of q, k, v
  int64_t block_values;         // one cache block: block_size * kv_heads * head_dim
  int64_t value_offset;         // from a key to its value: num_blocks * block_values
  int64_t max_blocks;           // columns of the block table
  int64_t table_row;            // row stride of the block table
  const float* sinks;           // [heads] each query head's attention-sink logit, or nullptr
  bool wide;                    // decodes in AVX-512 vectors (avx512::attend), not AVX2 ones
};

// Query head h's sink logit: -infinity where the layer has none.
inline float sink_of(const Layout& l, int64_t h) {
  return l.sinks == nullptr ? -std::numeric_limits<float>::infinity() : l.sinks[h];
}

// Calls visit(t, row) for t < length, row pointing at position t's K (or V, from
// cache + value_offset) of KV head kv, a block of the table at a time.
template <typename T, typename Visit>
inline void for_each_position(const Layout& l, const T* cache, const int32_t* table,
                              int64_t length, int64_t kv, const Visit& visit) {
  const int64_t token_values = l.kv_heads * l.head_dim;
  for (int64_t first = 0, i = 0; first < length; first += l.block_size, ++i) {
    const T* row = cache + table[i] * l.block_values + kv * l.head_dim;
    const int64_t end = std::min(l.block_size, length - first);
    for (int64_t o = 0; o < end; ++o, row += token_values) visit(first + o, row);
  }
}

// Per-thread scratch of attend: the scores of a group's rows' query heads over the longest span
// an item sees, and those heads' queries and outputs as floats (for groups of up to `rows`).
struct Scratch {
  // block: one block's K or V of all KV heads, widened to float32 (a narrower cache's).
  std::vector<float> scores, q, out, block;
  Scratch(const Layout& l, int64_t longest, int64_t rows)
      : scores(rows * l.heads * longest), q(rows * l.heads * l.head_dim),
        out(rows * l.heads * l.head_dim), block(l.block_size * l.kv_heads * l.head_dim) {}
};

// The most rows of one request that attend as a group (attend): their scores stay in L2 beside
// the block of K or V they share.
constexpr int64_t kGroupRows = 8;

// One item's rows for attend: `count` consecutive query rows of one request (a lone decode, a
// verification step's drafts, an extend's tokens), row r seeing positions begin .. end(r) of
// the request's context, end(r) = min(chunk_end, first_length + r): each row one position
// more than the one before, cut at the end of the item's chunk.
struct Rows {
  int64_t count, begin, first_length, chunk_end;
  int64_t end(int64_t r) const { return std::min(chunk_end, first_length + r); }
};

inline void to_floats(const float* from, int64_t n, float* to) {
  std::memcpy(to, from, n * sizeof(float));
}
inline void to_floats(const bf16* from, int64_t n, float* to) {
  for (int64_t i = 0; i < n; ++i) to[i] = static_cast<float>(from[i]);
}
inline void from_floats(const float* from, int64_t n, float* to) {
  std::memcpy(to, from, n * sizeof(float));
}
// n a multiple of 8 (head_dim is), each rounded to nearest even as c10::BFloat16 rounds.
inline void from_floats(const float* from, int64_t n, bf16* to) {
  for (int64_t i = 0; i < n; i += 8) folio::store8_bf16(to + i, _mm256_loadu_ps(from + i));
}
// Into an 8-bit float cache: c10's rounding (to nearest even), values past the format's largest
// finite one saturating to it (c10 gives e5m2 infinity there; e4m3 saturates by itself).
template <typename T, typename C, std::enable_if_t<kFp8<C>, int> = 0>
inline void from_floats(const T* from, int64_t n, C* to) {
  const float largest = static_cast<float>(std::numeric_limits<C>::max());
  for (int64_t i = 0; i < n; ++i)
    to[i] = C(std::clamp(static_cast<float>(from[i]), -largest, largest));
}

// Writes K and V of `rows` tokens into their slots.
template <typename T, typename C>
void write_new_tokens(const Layout& l, const T* k, const T* v, const int64_t* slots, int64_t rows,
                      C* cache) {
  const int64_t token_values = l.kv_heads * l.head_dim;
  for (int64_t b = 0; b < rows; ++b) {
    C* key = cache + slots[b] * token_values;
    if constexpr (std::is_same_v<T, C>) {
      std::memcpy(key, k + b * l.k_row, token_values * sizeof(T));
      std::memcpy(key + l.value_offset, v + b * l.v_row, token_values * sizeof(T));
    } else {  // float32 rows into a bfloat16 cache, or any rows into an fp8 one
      from_floats(k + b * l.k_row, token_values, key);
      from_floats(v + b * l.v_row, token_values, key + l.value_offset);
    }
  }
}

// Asks for `bytes` bytes at each of `count` rows `stride` values apart to be loaded into the
// cache level HINT names.
template <_mm_hint HINT, typename T>
inline void prefetch_rows(const T* row, int64_t count, int64_t stride, int64_t bytes) {
  for (int64_t o = 0; o < count; ++o, row += stride)
    for (int64_t byte = 0; byte < bytes; byte += 64)
      _mm_prefetch(reinterpret_cast<const char*>(row) + byte, HINT);
}

// A chunk's share of a row's attention (attend with `partial`), per query head: the largest
// score m, the sum l of exp(score - m) over the chunk's positions, and the D values mixed by
// those exponentials (not yet divided by l).
inline int64_t partial_floats(const Layout& l) { return l.head_dim + 2; }

// The decode attention's loops (cpu_attention_body.h) in AVX-512 and in AVX2 vectors: attend
// below runs the AVX-512 ones where the layout says so (Layout::wide).
namespace avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f")

using Vec = __m512;
constexpr int64_t kLanes = 16;
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec broadcast(float v) { return _mm512_set1_ps(v); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec load(const bf16* p) {  // sixteen bfloat16 values: the upper halves of float32s
  const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}
template <typename C, std::enable_if_t<kFp8<C>, int> = 0>
inline Vec load(const C* p) {  // sixteen 8-bit floats
  const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const Vec v = _mm512_cvtph_ps(half_bits(codes, C{}));
  return fp8_scale(C{}) == 1.0f ? v : _mm512_mul_ps(v, _mm512_set1_ps(fp8_scale(C{})));
}
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
// v's upper eight lanes added to its lower eight.
inline __m256 fold(Vec v) {
  const __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return _mm256_add_ps(_mm512_castps512_ps256(v), upper);
}
inline float sum(Vec v) { return horizontal_sum(fold(v)); }
inline __m256 sum_8(const Vec v[8]) {
  __m256 folded[8];
  for (int j = 0; j < 8; ++j) folded[j] = fold(v[j]);
  return folio::sum_each(folded);
}

#include "cpu_attention_body.h"

#pragma GCC pop_options
}  // namespace avx512

namespace avx2 {

using Vec = __m256;
constexpr int64_t kLanes = 8;
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec broadcast(float v) { return _mm256_set1_ps(v); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec load(const bf16* p) { return folio::load8_bf16(p); }
template <typename C, std::enable_if_t<kFp8<C>, int> = 0>
inline Vec load(const C* p) {  // eight 8-bit floats
  const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const Vec v = _mm256_cvtph_ps(half_bits8(codes, C{}));
  return fp8_scale(C{}) == 1.0f ? v : _mm256_mul_ps(v, _mm256_set1_ps(fp8_scale(C{})));
}
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline float sum(Vec v) { return horizontal_sum(v); }
inline __m256 sum_8(const Vec v[8]) { return folio::sum_each(v); }

#include "cpu_attention_body.h"

}  // namespace avx2

// A group's attention (cpu_attention_body.h's attend) in the layout's instruction set.
template <typename T, typename C>
inline void attend(const Layout& l, const T* q, const Rows& rows, const C* cache,
                   const int32_t* table, int64_t kv_begin, int64_t kv_end, float scale,
                   Scratch& scratch, T* out, float* partial, int64_t partial_row) {
  if (l.wide)
    avx512::attend(l, q, rows, cache, table, kv_begin, kv_end, scale, scratch, out, partial,
                   partial_row);
  else
    avx2::attend(l, q, rows, cache, table, kv_begin, kv_end, scale, scratch, out, partial,
                 partial_row);
}

// ---- Prefill blocks: bfloat16 on CPUs with AVX-512 BF16 ----
// A prefill's tokens attend a block of kQueryBlock tokens at a time per KV head: the block's
// query heads (tokens x group rows) times the context's keys, and the probabilities times its
// values, as two products over bf16_tiles.h's tiles, into which each (request, KV head)'s
// context is packed once per call: keys as tiles of 16 positions (pairs of features), values
// as tiles of 16 features (pairs of positions). Scores and the softmax stay float32; the
// probabilities are rounded to bfloat16 for the second product, as bfloat16 attention on GPUs
// does.

constexpr int64_t kQueryBlock = 8;  // tokens of a query block

// One (request, KV head)'s context, packed.
struct PackedContext {
  uint16_t* keys;        // ceil(length / 16) tiles of 16 positions x head_dim / 2 pairs
  uint16_t* values;      // head_dim / 16 tiles of 16 features x value_pairs pairs of positions
  int64_t value_pairs;   // ceil(length / 2)
};

inline int64_t packed_keys_size(int64_t length, int64_t d) {
  return (length + folio::kTileRows - 1) / folio::kTileRows * folio::kTileRows * d;
}
inline int64_t packed_values_size(int64_t length, int64_t d) { return (length + 1) / 2 * 2 * d; }

void pack_context(const Layout& l, const bf16* cache, const int32_t* table, int64_t length,
                  int64_t kv, const PackedContext& to) {
  const int64_t d = l.head_dim, half = d / 2, tile = folio::kTileRows;
  uint32_t* keys = reinterpret_cast<uint32_t*>(to.keys);  // pairs of features as one word
  for_each_position(l, cache, table, length, kv, [&](int64_t t, const bf16* key) {
    const uint32_t* pairs = reinterpret_cast<const uint32_t*>(key);
    uint32_t* column = keys + (t / tile) * half * tile + t % tile;
    for (int64_t p = 0; p < half; ++p) column[p * tile] = pairs[p];
  });
  for (int64_t t = length; t % tile != 0; ++t)  // the last tile's missing positions
    for (int64_t p = 0; p < half; ++p) keys[(t / tile) * half * tile + p * tile + t % tile] = 0;
  uint16_t* values = to.values;
  const int64_t tile_values = to.value_pairs * 2 * tile;
  const auto put = [&](int64_t t, const uint16_t* value) {
    for (int64_t f = 0; f < d; ++f)
      values[(f / tile) * tile_values + (t / 2) * 2 * tile + 2 * (f % tile) + t % 2] =
          value == nullptr ? 0 : value[f];
  };
  for_each_position(l, cache + l.value_offset, table, length, kv, [&](int64_t t, const bf16* v) {
    put(t, reinterpret_cast<const uint16_t*>(v));
  });
  if (length % 2 != 0) put(length, nullptr);
}

// Scores of rows m0 + m against positions of tiles t0 + n, scaled.
struct StoreScores {
  float* scores;
  int64_t stride;
  float scale;
  int64_t m0, t0;
  FOLIO_AVX512_BF16 void operator()(int m, int n, __m512 sums) const {
    _mm512_storeu_ps(scores + (m0 + m) * stride + (t0 + n) * folio::kTileRows,
                     _mm512_mul_ps(sums, _mm512_set1_ps(scale)));
  }
};

// Output features of tiles t0 + n of rows m0 + m, each row where `row_out` says.
struct StoreRows {
  uint16_t* out;
  const int64_t* row_out;
  int64_t m0, t0;
  FOLIO_AVX512_BF16 void operator()(int m, int n, __m512 sums) const {
    folio::store_bf16(out + row_out[m0 + m] + (t0 + n) * folio::kTileRows, sums,
                      folio::kTileRows);
  }
};

// to[0 .. padded) = from[0 .. valid) as bfloat16, then zeros.
FOLIO_AVX512_BF16 void probabilities_bf16(const float* from, int64_t valid, int64_t padded,
                                          uint16_t* to) {
  for (int64_t t = 0; t < padded; t += 16) {
    const int64_t n = std::min<int64_t>(16, padded - t);
    const int64_t live = std::clamp<int64_t>(valid - t, 0, 16);
    const __m512 p = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << live) - 1), from + t);
    folio::store_bf16(to + t, p, n);
  }
}

struct BlockScratch {
  std::vector<uint16_t> q, probabilities;
  std::vector<float> scores;
  std::vector<int64_t> row_out;
  BlockScratch(const Layout& l, int64_t longest)
      : q(kQueryBlock * l.group * l.head_dim),
        probabilities(kQueryBlock * l.group * (longest + 2)),
        scores(kQueryBlock * l.group * (longest + folio::kTileRows)),
        row_out(kQueryBlock * l.group) {}
};

// Attention of `tokens` consecutive tokens of one request (the first at flat index token0, its
// context first_length positions long, each next one a position longer) for KV head kv's
// query heads.
void attend_block(const Layout& l, const bf16* q, int64_t token0, int64_t tokens,
                  int64_t first_length, const PackedContext& context, int64_t kv, float scale,
                  BlockScratch& s, bf16* out) {
  const int64_t d = l.head_dim, group = l.group, rows = tokens * group;
  const int64_t length = first_length + tokens - 1, tile = folio::kTileRows;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = token0 + r / group, head = kv * group + r % group;
    std::memcpy(s.q.data() + r * d, q + token * l.q_row + head * d, d * sizeof(bf16));
    s.row_out[r] = (token * l.heads + head) * d;
  }
  const int64_t key_tiles = (length + tile - 1) / tile, stride = key_tiles * tile;
  for (int64_t t0 = 0; t0 < key_tiles; t0 += 2)
    for (int64_t m0 = 0; m0 < rows; m0 += 8)
      folio::multiply_tiles_upto<2, 8>(std::min<int64_t>(2, key_tiles - t0),
                                       std::min<int64_t>(8, rows - m0), s.q.data() + m0 * d, d,
                                       context.keys + t0 * tile * d, tile * d, d / 2, nullptr,
                                       StoreScores{s.scores.data(), stride, scale, m0, t0});
  const int64_t pairs = (length + 1) / 2;
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s.scores.data() + r * stride;
    const int64_t valid = first_length + r / group;
    softmax(row, valid, sink_of(l, kv * group + r % group));
    probabilities_bf16(row, valid, 2 * pairs, s.probabilities.data() + r * 2 * pairs);
  }
  const int64_t value_tiles = d / tile, tile_values = context.value_pairs * 2 * tile;
  for (int64_t t0 = 0; t0 < value_tiles; t0 += 4)
    for (int64_t m0 = 0; m0 < rows; m0 += 4)
      folio::multiply_tiles_upto<4, 4>(
          std::min<int64_t>(4, value_tiles - t0), std::min<int64_t>(4, rows - m0),
          s.probabilities.data() + m0 * 2 * pairs, 2 * pairs, context.values + t0 * tile_values,
          tile_values, pairs, nullptr,
          StoreRows{reinterpret_cast<uint16_t*>(out), s.row_out.data(), m0, t0});
}

// ---- One call's work ----

// A piece of a call's work: query tokens first_token .. first_token + tokens of one request
// (flat indices) for KV heads kv_begin .. kv_end, the first token seeing first_length
// positions and each next one a position more. A group of tokens each attending alone's way
// (context nullptr) goes through attend, seeing positions begin .. up to chunk_end; a prefill
// block (one KV head) through attend_block over `context`.
struct Item {
  int64_t request, kv_begin, kv_end, first_token, tokens, first_length;
  const PackedContext* context;
  // The tokens' first position seen (a sliding window's start, or their chunk's) and the end
  // of their chunk (past their contexts: whole); where the first token's chunk's partial result
  // goes in the call's partials (-1: whole contexts, outputs written), and the next token's
  // partial_row floats after it.
  int64_t begin = 0, chunk_end = std::numeric_limits<int64_t>::max(), partial = -1,
          partial_row = 0;
};

// A token's chunks of KV heads kv_begin .. kv_end: their partial results lie one after
// another from `partial` on, merged into the token's output in order.
struct Merge {
  int64_t token, kv_begin, kv_end, partial, chunks;
};

// A call's work: its items, the merges of the chunked tokens' partial results, and the floats
// of those results.
struct Work {
  std::vector<Item> items;
  std::vector<Merge> merges;
  int64_t partial_size = 0;
  int64_t group_rows = 1;  // the most tokens of an item through attend
};

// Below this many rows a call splits each row's KV heads into items of their own, so that the
// threads share few rows.
constexpr int64_t kRowsForWholeItems = 4;

// A token seeing more positions than this attends them in chunks of this many, items of their
// own, so that one long row keeps both threads busy. A function of the token's context alone
// (never of the batch), so that its output's bits are the same in any step.
constexpr int64_t kChunkPositions = 256;

// The first position a token seeing `length` positions attends: its sliding window's start.
inline int64_t first_seen(const Layout& l, int64_t length) {
  return l.window > 0 ? std::max<int64_t>(0, length - l.window) : 0;
}

// The chunks of a token seeing `length` positions.
inline int64_t chunks_of(const Layout& l, int64_t length) {
  return (length - first_seen(l, length) + kChunkPositions - 1) / kChunkPositions;
}

// A group of `count` consecutive tokens of one request (the first at flat index `token`,
// seeing `length` positions, each next one a position more; all with as many chunks, and one
// alone under a sliding window, whose start moves with each token): all their KV heads in one
// item, or one each; a long context's in chunks, each chunk an item of the whole group.
void add_rows(Work& work, const Layout& l, bool split_heads, int64_t request, int64_t token,
              int64_t count, int64_t length) {
  const int64_t begin = first_seen(l, length);
  const int64_t chunks = chunks_of(l, length);
  const int64_t step = split_heads ? 1 : l.kv_heads;
  work.group_rows = std::max(work.group_rows, count);
  for (int64_t kv = 0; kv < l.kv_heads; kv += step) {
    if (chunks == 1) {
      work.items.push_back({request, kv, kv + step, token, count, length, nullptr, begin});
      continue;
    }
    // Each token's chunks one after another, the tokens one after another.
    const int64_t stride = step * l.group * partial_floats(l), row = chunks * stride;
    for (int64_t r = 0; r < count; ++r)
      work.merges.push_back({token + r, kv, kv + step, work.partial_size + r * row, chunks});
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t first = begin + c * kChunkPositions;
      work.items.push_back({request, kv, kv + step, token, count, length, nullptr, first,
                            first + kChunkPositions, work.partial_size + c * stride, row});
    }
    work.partial_size += count * row;
  }
}

// Consecutive query rows of one request, `count` of them, the first seeing `length` positions
// and each next one a position more, in groups that each read the context once (attend): at
// most kGroupRows, of as many chunks each (chunks_of), each alone under a sliding window. A
// group of g rows is one item a chunk (or one a KV head), so rows stay apart (groups of one)
// until there are chunks enough to keep `threads` threads busy twice over.
void add_request_rows(Work& work, const Layout& l, bool split_heads, int64_t request,
                      int64_t token, int64_t count, int64_t length, int64_t threads) {
  for (int64_t r = 0; r < count;) {
    const int64_t chunks = chunks_of(l, length + r);
    int64_t run = 1;  // rows from r on with as many chunks
    while (r + run < count && chunks_of(l, length + r + run) == chunks) ++run;
    const int64_t most =
        l.window > 0 ? 1 : std::clamp<int64_t>(run * chunks / (2 * threads), 1, kGroupRows);
    for (int64_t done = 0; done < run;) {
      const int64_t size = std::min(most, run - done);
      add_rows(work, l, split_heads, request, token + r + done, size, length + r + done);
      done += size;
    }
    r += run;
  }
}

// A chunked token's output for the merge's heads: each chunk's mixed values weighted by
// exp(m_c - M) (M: the largest chunk score, or the sink logit), over the sum of its l_c so
// weighted (and the sink's exponential), the chunks in order.
template <typename T>
void merge_chunks(const Layout& l, const Merge& merge, const float* partials, T* out,
                  float* mixed) {
  const int64_t d = l.head_dim, size = partial_floats(l);
  const int64_t heads = (merge.kv_end - merge.kv_begin) * l.group;
  const int64_t first_head = merge.kv_begin * l.group, stride = heads * size;
  for (int64_t h = 0; h < heads; ++h) {
    const float* head = partials + merge.partial + h * size;
    const float sink = sink_of(l, first_head + h);
    float top = sink;
    for (int64_t c = 0; c < merge.chunks; ++c) top = std::max(top, head[c * stride]);
    float total = std::exp(sink - top);
    float* values = mixed + h * d;
    std::fill(values, values + d, 0.0f);
    for (int64_t c = 0; c < merge.chunks; ++c) {
      const float* chunk = head + c * stride;
      const float weight = std::exp(chunk[0] - top);
      total += weight * chunk[1];
      const __m256 w = _mm256_set1_ps(weight);
      for (int64_t i = 0; i < d; i += 8) {
        const __m256 sum = _mm256_loadu_ps(values + i);
        _mm256_storeu_ps(values + i, _mm256_fmadd_ps(w, _mm256_loadu_ps(chunk + 2 + i), sum));
      }
    }
    const __m256 inverse = _mm256_set1_ps(1.0f / total);
    for (int64_t i = 0; i < d; i += 8)
      _mm256_storeu_ps(values + i, _mm256_mul_ps(_mm256_loadu_ps(values + i), inverse));
  }
  from_floats(mixed, heads * d, out + (merge.token * l.heads + first_head) * d);
}

// Does every item, the tokens' new K/V already in the cache (of type C).
template <typename T, typename C>
void attend_items(const Layout& l, const at::Tensor& q, const at::Tensor& kv_cache,
                  const int32_t* tables, const Work& work, int64_t longest, int64_t total,
                  float scale, at::Tensor& out) {
  const C* cache = kv_cache.data_ptr<C>();
  const T* qs = q.data_ptr<T>();
  T* os = out.data_ptr<T>();
  const std::vector<Item>& items = work.items;
  std::vector<float> partials(work.partial_size);
  const int64_t count = items.size();
  const int64_t grain = total * l.heads < kParallelScores ? count : 1;
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    // A whole context is at most a chunk long, as is a chunk.
    Scratch scratch(l, std::min(longest, kChunkPositions), work.group_rows);
    std::optional<BlockScratch> blocks;
    for (int64_t i = begin; i < end; ++i) {
      // Items from both ends in turn: a prefill's tokens see one position more each, and the
      // threads' contiguous shares of i then hold as many long items as short ones.
      const Item& item = items[i % 2 == 0 ? i / 2 : count - 1 - i / 2];
      const int32_t* table = tables + item.request * l.table_row;
      if (item.context == nullptr) {
        const int64_t b = item.first_token;
        attend(l, qs + b * l.q_row,
               Rows{item.tokens, item.begin, item.first_length, item.chunk_end}, cache, table,
               item.kv_begin, item.kv_end, scale, scratch, os + b * l.heads * l.head_dim,
               item.partial < 0 ? nullptr : partials.data() + item.partial, item.partial_row);
      } else if constexpr (std::is_same_v<T, bf16> && std::is_same_v<C, bf16>) {
        if (!blocks) blocks.emplace(l, longest);
        attend_block(l, qs, item.first_token, item.tokens, item.first_length, *item.context,
                     item.kv_begin, scale, *blocks, os);
      }
    }
  });
  const int64_t merges = work.merges.size();
  at::parallel_for(0, merges, kParallelMerges, [&](int64_t begin, int64_t end) {
    std::vector<float> mixed(l.heads * l.head_dim);
    for (int64_t i = begin; i < end; ++i)
      merge_chunks(l, work.merges[i], partials.data(), os, mixed.data());
  });
}

}  // namespace

namespace {

// The layout of a call's tensors, checked: q [N, H, D], k and v [N, KVH, D] (rows may be
// strided, each row contiguous); kv_cache [2, num_blocks, block_size, KVH, D]; all float32 or
// all bfloat16, or the cache bfloat16 under float32 q, k and v, or float8 (e4m3fn, e5m2) under
// either; slot_mapping [N] int64; block_tables [requests, max_blocks] int32.
Layout check_layout(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                    const at::Tensor& block_tables, int64_t window) {
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: no sliding window), got ", window);
  const at::ScalarType dtype = q.scalar_type();
  const at::ScalarType cache = kv_cache.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && k.scalar_type() == dtype &&
                  v.scalar_type() == dtype &&
                  (cache == dtype || cache == at::kBFloat16 || cache == at::kFloat8_e4m3fn ||
                   cache == at::kFloat8_e5m2),
              "paged attention runs on float32 or bfloat16, the same for q, k and v, the cache in "
              "their dtype, in bfloat16 or in float8 (e4m3fn, e5m2); got q ", dtype, ", k ",
              k.scalar_type(), ", v ", v.scalar_type(), ", the cache ", cache);
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && kv_cache.dim() == 5,
              "q, k, v must be [rows, heads, head_dim], the cache 5-dimensional");
  const int64_t rows = q.size(0), d = q.size(2);
  TORCH_CHECK(d % 8 == 0, "head_dim must be a multiple of 8, got ", d);
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == d, "q, k and v rows must be contiguous");
  TORCH_CHECK(kv_cache.is_contiguous() && block_tables.stride(1) == 1 &&
                  slot_mapping.is_contiguous(),
              "the cache, slot_mapping and each block table row must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && block_tables.scalar_type() == at::kInt,
              "slot_mapping is int64, block_tables int32");
  TORCH_CHECK(k.size(0) == rows && v.size(0) == rows && slot_mapping.size(0) >= rows,
              "one K, V and slot per query token");
  Layout l;
  l.heads = q.size(1);
  l.kv_heads = kv_cache.size(3);
  TORCH_CHECK(k.size(1) == l.kv_heads && kv_cache.size(4) == d && l.heads % l.kv_heads == 0,
              "head counts of q, k and the cache disagree");
  l.group = l.heads / l.kv_heads;
  l.head_dim = d;
  l.block_size = kv_cache.size(2);
  l.q_row = q.stride(0);
  l.k_row = k.stride(0);
  l.v_row = v.stride(0);
  l.block_values = l.block_size * l.kv_heads * d;
  l.value_offset = kv_cache.size(1) * l.block_values;
  l.max_blocks = block_tables.size(1);
  l.table_row = block_tables.stride(0);
  l.window = window;
  l.sinks = nullptr;
  l.wide = d % avx512::kLanes == 0 && cpu_has_avx512f() && !folio::avx2_forced();
  return l;
}

// Checks a call's attention sinks (one per query head, float32 or q's dtype) and points the
// layout at them as float32: the tensor returned holds them for the call (undefined: none).
at::Tensor attach_sinks(Layout& l, const at::Tensor& q, const std::optional<at::Tensor>& sinks) {
  if (!sinks.has_value()) return at::Tensor();
  TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == l.heads,
              "sinks must hold one logit per query head: [", l.heads, "], got ", sinks->sizes());
  TORCH_CHECK(sinks->scalar_type() == at::kFloat || sinks->scalar_type() == q.scalar_type(),
              "sinks must be float32 or q's dtype, got ", sinks->scalar_type());
  TORCH_CHECK(sinks->device().is_cpu(), "sinks must be on the CPU");
  at::Tensor floats = sinks->to(at::kFloat).contiguous();
  l.sinks = floats.data_ptr<float>();
  return floats;
}

// f(T{}, C{}) with T the rows' type (float or bf16) and C the cache's, as check_layout allows.
template <typename F>
void with_types(const at::Tensor& rows, const at::Tensor& kv_cache, const F& f) {
  const auto with_rows = [&](auto cached) {
    if (rows.scalar_type() == at::kBFloat16)
      f(bf16{}, cached);
    else
      f(float{}, cached);
  };
  if (kv_cache.scalar_type() == at::kFloat8_e4m3fn)
    with_rows(e4m3{});
  else if (kv_cache.scalar_type() == at::kFloat8_e5m2)
    with_rows(e5m2{});
  else if (rows.scalar_type() == at::kBFloat16)
    f(bf16{}, bf16{});
  else if (kv_cache.scalar_type() == at::kBFloat16)
    f(float{}, bf16{});
  else
    f(float{}, float{});
}

void write_tokens(const Layout& l, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& slot_mapping, at::Tensor& kv_cache) {
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  with_types(k, kv_cache, [&](auto row, auto cached) {
    using T = decltype(row);
    using C = decltype(cached);
    write_new_tokens(l, k.data_ptr<T>(), v.data_ptr<T>(), slots, k.size(0),
                     kv_cache.data_ptr<C>());
  });
}

at::Tensor run_items(const Layout& l, const at::Tensor& q, const at::Tensor& kv_cache,
                     const at::Tensor& block_tables, const Work& work, int64_t longest,
                     int64_t total, double scale) {
  at::Tensor out = at::empty({q.size(0), l.heads, l.head_dim}, q.options());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const float scale_f = static_cast<float>(scale);
  with_types(q, kv_cache, [&](auto row, auto cached) {
    attend_items<decltype(row), decltype(cached)>(l, q, kv_cache, tables, work, longest, total,
                                                  scale_f, out);
  });
  return out;
}

void check_length(const Layout& l, int64_t request, int64_t length) {
  TORCH_CHECK(length >= 1 && length <= l.max_blocks * l.block_size, "request ", request,
              " has context length ", length, ", outside its block table");
}

}  // namespace

// Decode rows: row b of q is request b's one new token; seq_lens [B] int32, each counting the
// new token; a token sees its last `window` positions (0: all); `sinks` [H], each query head's
// attention-sink logit (none: no sinks) -> [B, H, D].
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  at::Tensor kv_cache, const at::Tensor& slot_mapping,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  double scale, int64_t window,
                                  const std::optional<at::Tensor>& sinks) {
  Layout l = check_layout(q, k, v, kv_cache, slot_mapping, block_tables, window);
  const at::Tensor sink_logits = attach_sinks(l, q, sinks);
  const int64_t rows = q.size(0);
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  block_tables.size(0) >= rows && seq_lens.size(0) >= rows,
              "one block table and int32 length per decode row");
  const int32_t* lengths = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  int64_t longest = 0, total = 0;
  for (int64_t b = 0; b < rows; ++b) {
    check_length(l, b, lengths[b]);
    longest = std::max<int64_t>(longest, lengths[b]);
    total += lengths[b];
  }
  // Row b + 1 continues row b's request (a verification step's next draft) where it sees one
  // position more through the same blocks.
  const auto continues = [&](int64_t b) {
    const int64_t blocks = (lengths[b + 1] + l.block_size - 1) / l.block_size;
    return lengths[b + 1] == lengths[b] + 1 &&
           std::memcmp(tables + b * l.table_row, tables + (b + 1) * l.table_row,
                       blocks * sizeof(int32_t)) == 0;
  };
  Work work;
  work.items.reserve(rows * l.kv_heads);
  const int64_t threads = at::get_num_threads();
  for (int64_t b = 0; b < rows;) {
    int64_t count = 1;
    while (b + count < rows && continues(b + count - 1)) ++count;
    add_request_rows(work, l, rows < kRowsForWholeItems, b, b, count, lengths[b], threads);
    b += count;
  }
  write_tokens(l, k, v, slot_mapping, kv_cache);
  return run_items(l, q, kv_cache, block_tables, work, longest, total, scale);
}

// Any step: request i's tokens are rows query_start_loc[i] .. query_start_loc[i + 1] of q
// ([R + 1] int32), its context seq_lens[i] positions after them ([R] int32), the new tokens
// last; each token sees the context up to itself, its last `window` positions of it with a
// window (0: all), each query head's sink logit in its softmax with `sinks` [H] -> [N, H, D].
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           at::Tensor kv_cache, const at::Tensor& slot_mapping,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, double scale, int64_t window,
                           const std::optional<at::Tensor>& sinks) {
  Layout l = check_layout(q, k, v, kv_cache, slot_mapping, block_tables, window);
  const at::Tensor sink_logits = attach_sinks(l, q, sinks);
  const int64_t requests = seq_lens.size(0);
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt &&
                  seq_lens.is_contiguous() && query_start_loc.is_contiguous() &&
                  query_start_loc.size(0) == requests + 1 && block_tables.size(0) >= requests,
              "int32 query_start_loc [R + 1] and seq_lens [R], and a block table per request");
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lengths = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK(starts[0] == 0 && starts[requests] == q.size(0),
              "query_start_loc must run from 0 to the number of query tokens");
  // Prefill blocks pack a request's whole context: with a window, each token reads only its
  // own part of it instead.
  const bool blocks = q.scalar_type() == at::kBFloat16 && kv_cache.scalar_type() == at::kBFloat16 &&
                      folio::cpu_has_avx512_bf16() &&
                      l.head_dim % folio::kTileRows == 0 && window == 0;
  // Where each prefill request's packed contexts go.
  std::vector<int64_t> packed_at(requests, -1);
  int64_t packed_size = 0;
  for (int64_t i = 0; i < requests; ++i) {
    const int64_t query = starts[i + 1] - starts[i];
    TORCH_CHECK(query >= 1 && lengths[i] >= query, "request ", i, " has ", query,
                " query tokens and a context of ", lengths[i]);
    check_length(l, i, lengths[i]);
    if (blocks && query > 1) {
      packed_at[i] = packed_size;
      packed_size += l.kv_heads * (packed_keys_size(lengths[i], l.head_dim) +
                                   packed_values_size(lengths[i], l.head_dim));
    }
  }
  at::Tensor packed = at::empty({packed_size}, q.options());
  uint16_t* packed_data = reinterpret_cast<uint16_t*>(packed.data_ptr());
  std::vector<PackedContext> contexts;
  std::vector<std::pair<int64_t, int64_t>> to_pack;  // (request, kv head) of each context
  contexts.reserve(requests * l.kv_heads);  // never reallocated: items point into it
  Work work;
  int64_t longest = 0, total = 0;
  const bool split_heads = q.size(0) < kRowsForWholeItems;
  const int64_t threads = at::get_num_threads();
  for (int64_t i = 0; i < requests; ++i) {
    const int64_t first = starts[i], query = starts[i + 1] - first;
    const int64_t cached = lengths[i] - query;
    longest = std::max<int64_t>(longest, lengths[i]);
    total += query * cached + query * (query + 1) / 2;
    if (packed_at[i] < 0) {
      add_request_rows(work, l, split_heads, i, first, query, cached + 1, threads);
      continue;
    }
    for (int64_t kv = 0; kv < l.kv_heads; ++kv) {
      const int64_t keys = packed_keys_size(lengths[i], l.head_dim);
      const int64_t values = packed_values_size(lengths[i], l.head_dim);
      uint16_t* at = packed_data + packed_at[i] + kv * (keys + values);
      contexts.push_back({at, at + keys, (lengths[i] + 1) / 2});
      to_pack.emplace_back(i, kv);
      for (int64_t j = 0; j < query; j += kQueryBlock)
        work.items.push_back({i, kv, kv + 1, first + j,
                              std::min<int64_t>(kQueryBlock, query - j), cached + j + 1,
                              &contexts.back()});
    }
  }
  write_tokens(l, k, v, slot_mapping, kv_cache);  // before any context is packed
  if (!to_pack.empty()) {
    const bf16* cache = kv_cache.data_ptr<bf16>();
    const int32_t* tables = block_tables.data_ptr<int32_t>();
    at::parallel_for(0, to_pack.size(), 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        const auto [i, kv] = to_pack[c];
        pack_context(l, cache, tables + i * l.table_row, lengths[i], kv, contexts[c]);
      }
    });
  }
  return run_items(l, q, kv_cache, block_tables, work, longest, total, scale);
}

namespace {

// The decode-only step this thread is running, bound by the attention backend around a compiled
// decode program, so that the program's calls name a layer's cache by index and reach the step's
// tables without a trip through Python (one per layer, every step).
struct DecodeStep {
  std::vector<at::Tensor> kv_caches;
  at::Tensor slot_mapping, block_tables, seq_lens;
};

thread_local DecodeStep bound_step;

void bind_decode_step(at::TensorList kv_caches, const at::Tensor& slot_mapping,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens) {
  bound_step = {kv_caches.vec(), slot_mapping, block_tables, seq_lens};
}

// Drops the step's references, so that no cache outlives its engine.
void unbind_decode_step() { bound_step = DecodeStep{}; }

}  // namespace

// paged_decode_attention over layer `layer`'s cache and the bound step's tables.
at::Tensor decode_step_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 int64_t layer, double scale, int64_t window,
                                 const std::optional<at::Tensor>& sinks) {
  const DecodeStep& step = bound_step;
  TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(step.kv_caches.size()),
              "decode_step_attention: no decode step bound with a cache for layer ", layer);
  return paged_decode_attention(q, k, v, step.kv_caches[layer], step.slot_mapping,
                                step.block_tables, step.seq_lens, scale, window, sinks);
}

TORCH_LIBRARY(folio_cpu_attention, library) {
  library.def(
      "paged_decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, "
      "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, float scale, int window=0, "
      "Tensor? sinks=None) -> Tensor");
  library.def(
      "paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping, "
      "Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, float scale, "
      "int window=0, Tensor? sinks=None) -> Tensor");
  library.def(
      "decode_step_attention(Tensor q, Tensor k, Tensor v, int layer, float scale, int window=0, "
      "Tensor? sinks=None) -> Tensor");
  library.def(
      "bind_decode_step(Tensor[] kv_caches, Tensor slot_mapping, Tensor block_tables, "
      "Tensor seq_lens) -> ()");
  library.def("unbind_decode_step() -> ()", &unbind_decode_step);
}

TORCH_LIBRARY_IMPL(folio_cpu_attention, CPU, library) {
  library.impl("paged_decode_attention", &paged_decode_attention);
  library.impl("paged_attention", &paged_attention);
  library.impl("decode_step_attention", &decode_step_attention);
  library.impl("bind_decode_step", &bind_decode_step);
}
