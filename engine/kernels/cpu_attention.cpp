// Paged attention of decode rows on x86 CPUs with AVX2 and FMA: row b is one new token, which
// attends to its first seq_lens[b] context positions in the paged KV cache (a decode's whole
// context; the attention backend also passes each token of a prefill as a row, the context
// ending at that token). q, k, v and the
// cache are float32 or bfloat16 (all the same); the arithmetic is float32 either way, bfloat16
// values widened as they are loaded and the output rounded to nearest even once at the end.
//
// One call does a layer's work for every decode row: it writes each row's new K and V into its
// cache slot, then, for each (row, KV head) pair, scores the pair's query heads against the
// cached keys, read in place through the block table, takes the softmax and mixes the values.
// Keys are scored eight positions at a time (one tree of horizontal adds for eight dot
// products), and each value is loaded once for up to three query heads of its KV head. Work is
// split over torch's thread pool by (row, KV head) pairs only when there is enough of it to pay
// for the pool's wake-up. A compiled decode program calls decode_step_attention instead, which
// reads the caches and tables of the step bound to its thread (bind_decode_step). This file
// computes attention only; choosing it over the backend's plain torch path is
// engine/attention/torch_backend.py's job.

#include <immintrin.h>
#include "avx2.h"
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using folio::horizontal_sum;

using bf16 = c10::BFloat16;

// Eight consecutive values as floats.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  // A bfloat16 is the high half of the float it stands for.
  const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}

// Below this many (context position x query head) scores a call stays on the calling thread.
constexpr int64_t kParallelScores = 16384;

template <typename T>
inline float dot(const float* a, const T* b, int64_t d) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
#pragma GCC unroll 4
  for (; i + 16 <= d; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load8(b + i + 8), acc1);
  }
  for (; i < d; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc0);
  return horizontal_sum(_mm256_add_ps(acc0, acc1));
}

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

// s[0 .. length) becomes softmax(s).
inline void softmax(float* s, int64_t length) {
  const float top = *std::max_element(s, s + length);
  const __m256 shift = _mm256_set1_ps(top);
  __m256 total8 = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= length; t += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t), shift));
    _mm256_storeu_ps(s + t, e);
    total8 = _mm256_add_ps(total8, e);
  }
  float total = horizontal_sum(total8);
  for (; t < length; ++t) total += (s[t] = std::exp(s[t] - top));
  const __m256 inverse = _mm256_set1_ps(1.0f / total);
  for (t = 0; t + 8 <= length; t += 8)
    _mm256_storeu_ps(s + t, _mm256_mul_ps(_mm256_loadu_ps(s + t), inverse));
  for (; t < length; ++t) s[t] *= 1.0f / total;
}

struct Layout {
  int64_t heads, kv_heads, group, head_dim, block_size;
  int64_t q_row, k_row, v_row;  // row strides of q, k, v
  int64_t block_values;         // one cache block: block_size * kv_heads * head_dim
  int64_t value_offset;         // from a key to its value: num_blocks * block_values
  int64_t max_blocks;           // columns of the block table
  int64_t table_row;            // row stride of the block table
};

// Writes K and V of `rows` decode rows into their slots.
template <typename T>
void write_new_tokens(const Layout& l, const T* k, const T* v, const int64_t* slots, int64_t rows,
                      T* cache) {
  const int64_t token_values = l.kv_heads * l.head_dim;
  for (int64_t b = 0; b < rows; ++b) {
    T* key = cache + slots[b] * token_values;
    std::memcpy(key, k + b * l.k_row, token_values * sizeof(T));
    std::memcpy(key + l.value_offset, v + b * l.v_row, token_values * sizeof(T));
  }
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

// For query heads g < HEADS of one KV head: out[g * head_dim + 8 c ..] = sum over t < length of
// p[g * p_stride + t] * values[t][8 c ..], c < CHUNKS, values read like for_each_position's
// rows. Each value vector is loaded once for all the heads, and the sums stay in registers
// across the whole context (HEADS x CHUNKS accumulators, at most 12 of AVX2's 16 registers).
template <typename T, int HEADS, int CHUNKS>
inline void mix_values(const Layout& l, const T* values, const int32_t* table, int64_t length,
                       int64_t kv, const float* p, int64_t p_stride, float* out) {
  __m256 acc[HEADS][CHUNKS];
  for (int g = 0; g < HEADS; ++g)
    for (int c = 0; c < CHUNKS; ++c) acc[g][c] = _mm256_setzero_ps();
  for_each_position(l, values, table, length, kv, [&](int64_t t, const T* value) {
    __m256 w[HEADS];
    for (int g = 0; g < HEADS; ++g) w[g] = _mm256_set1_ps(p[g * p_stride + t]);
    for (int c = 0; c < CHUNKS; ++c) {
      const __m256 v = load8(value + 8 * c);
      for (int g = 0; g < HEADS; ++g) acc[g][c] = _mm256_fmadd_ps(w[g], v, acc[g][c]);
    }
  });
  for (int g = 0; g < HEADS; ++g)
    for (int c = 0; c < CHUNKS; ++c) _mm256_storeu_ps(out + g * l.head_dim + 8 * c, acc[g][c]);
}

// mix_values for HEADS heads over a slab of `chunks` (1 to 4) vectors of 8 features.
template <typename T, int HEADS>
inline void mix_slab(int64_t chunks, const Layout& l, const T* values, const int32_t* table,
                     int64_t length, int64_t kv, const float* p, int64_t p_stride, float* out) {
  switch (chunks) {
    case 4: mix_values<T, HEADS, 4>(l, values, table, length, kv, p, p_stride, out); break;
    case 3: mix_values<T, HEADS, 3>(l, values, table, length, kv, p, p_stride, out); break;
    case 2: mix_values<T, HEADS, 2>(l, values, table, length, kv, p, p_stride, out); break;
    default: mix_values<T, HEADS, 1>(l, values, table, length, kv, p, p_stride, out); break;
  }
}

// The eight dot products q . key[j] (j < 8, keys `stride` values apart, d features), as one
// vector.
template <typename T>
inline __m256 dot_8_keys(const float* q, const T* key, int64_t stride, int64_t d) {
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) {
    const __m256 query = _mm256_loadu_ps(q + i);
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(query, load8(key + j * stride + i), acc[j]);
  }
  return folio::sum_each(acc);
}

// Per-thread scratch of attend: the scores of a KV head's query heads over the longest context,
// and those heads' queries and outputs as floats.
struct Scratch {
  std::vector<float> scores, q, out;
  Scratch(const Layout& l, int64_t longest)
      : scores(l.group * longest), q(l.group * l.head_dim), out(l.group * l.head_dim) {}
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
inline void from_floats(const float* from, int64_t n, bf16* to) {
  for (int64_t i = 0; i < n; ++i) to[i] = bf16(from[i]);  // round to nearest even
}

// Attention of one row's query heads of KV head `kv` (q, out: the row's heads) over its
// `length` cached positions.
template <typename T>
void attend(const Layout& l, const T* q, const T* cache, const int32_t* table, int64_t length,
            int64_t kv, float scale, Scratch& scratch, T* out) {
  const int64_t d = l.head_dim, group = l.group;
  const int64_t token_values = l.kv_heads * d;
  float* scores = scratch.scores.data();
  const float* q0 = scratch.q.data();
  to_floats(q + kv * group * d, group * d, scratch.q.data());
  const __m256 scale8 = _mm256_set1_ps(scale);
  // Scores eight positions of a block at a time, the rest one by one.
  for (int64_t first = 0, i = 0; first < length; first += l.block_size, ++i) {
    const T* key = cache + table[i] * l.block_values + kv * d;
    const int64_t end = std::min(l.block_size, length - first);
    int64_t o = 0;
    for (; o + 8 <= end; o += 8, key += 8 * token_values)
      for (int64_t g = 0; g < group; ++g)
        _mm256_storeu_ps(scores + g * length + first + o,
                         _mm256_mul_ps(dot_8_keys(q0 + g * d, key, token_values, d), scale8));
    for (; o < end; ++o, key += token_values)
      for (int64_t g = 0; g < group; ++g)
        scores[g * length + first + o] = dot(q0 + g * d, key, d) * scale;
  }
  for (int64_t g = 0; g < group; ++g) softmax(scores + g * length, length);
  // out = probabilities . V, up to three heads and 32 features at a time.
  for (int64_t g0 = 0; g0 < group; g0 += 3) {
    const int64_t heads = std::min<int64_t>(3, group - g0);
    const float* p = scores + g0 * length;
    float* o = scratch.out.data() + g0 * d;
    for (int64_t d0 = 0; d0 < d; d0 += 32) {
      const T* values = cache + l.value_offset + d0;
      const int64_t chunks = std::min<int64_t>(4, (d - d0) / 8);
      switch (heads) {
        case 3: mix_slab<T, 3>(chunks, l, values, table, length, kv, p, length, o + d0); break;
        case 2: mix_slab<T, 2>(chunks, l, values, table, length, kv, p, length, o + d0); break;
        default: mix_slab<T, 1>(chunks, l, values, table, length, kv, p, length, o + d0); break;
      }
    }
  }
  from_floats(scratch.out.data(), group * d, out + kv * group * d);
}

// Writes the rows' new K/V, then attends every (row, KV head) pair.
template <typename T>
void decode_rows(const Layout& l, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                 const at::Tensor& block_tables, const int32_t* lengths, int64_t longest,
                 int64_t total, float scale, at::Tensor& out) {
  const int64_t rows = q.size(0);
  T* cache = kv_cache.data_ptr<T>();
  write_new_tokens(l, k.data_ptr<T>(), v.data_ptr<T>(), slot_mapping.data_ptr<int64_t>(), rows,
                   cache);
  const T* qs = q.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  T* os = out.data_ptr<T>();
  const int64_t pairs = rows * l.kv_heads;
  const int64_t grain = total * l.heads < kParallelScores ? pairs : 1;
  at::parallel_for(0, pairs, grain, [&](int64_t begin, int64_t end) {
    Scratch scratch(l, longest);
    for (int64_t i = begin; i < end; ++i) {
      // Pairs from both ends in turn: a prefill's rows get longer one position at a time, and
      // the threads' contiguous shares of i then hold as many long rows as short ones.
      const int64_t pair = i % 2 == 0 ? i / 2 : pairs - 1 - i / 2;
      const int64_t b = pair / l.kv_heads, kv = pair % l.kv_heads;
      attend(l, qs + b * l.q_row, cache, tables + b * l.table_row, lengths[b], kv, scale,
             scratch, os + b * l.heads * l.head_dim);
    }
  });
}

}  // namespace

// q [B, H, D], k and v [B, KVH, D] (rows may be strided, each row contiguous); kv_cache
// [2, num_blocks, block_size, KVH, D]; all float32 or all bfloat16; slot_mapping [B] int64; block_tables
// [B, max_blocks] int32; seq_lens [B] int32, each counting the new token -> [B, H, D].
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  at::Tensor kv_cache, const at::Tensor& slot_mapping,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  double scale) {
  const at::ScalarType dtype = q.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && k.scalar_type() == dtype &&
                  v.scalar_type() == dtype && kv_cache.scalar_type() == dtype,
              "paged_decode_attention runs on float32 or bfloat16, the same for q, k, v and the "
              "cache");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && kv_cache.dim() == 5,
              "q, k, v must be [rows, heads, head_dim], the cache 5-dimensional");
  const int64_t rows = q.size(0), d = q.size(2);
  TORCH_CHECK(d % 8 == 0, "head_dim must be a multiple of 8, got ", d);
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == d, "q, k and v rows must be contiguous");
  TORCH_CHECK(kv_cache.is_contiguous() && block_tables.stride(1) == 1 &&
                  slot_mapping.is_contiguous() && seq_lens.is_contiguous(),
              "the cache, slot_mapping, seq_lens and each block table row must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && block_tables.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt,
              "slot_mapping is int64, block_tables and seq_lens int32");
  TORCH_CHECK(k.size(0) == rows && v.size(0) == rows && slot_mapping.size(0) >= rows &&
                  block_tables.size(0) >= rows && seq_lens.size(0) >= rows,
              "one K, V, slot, block table and length per decode row");
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

  const int32_t* lengths = seq_lens.data_ptr<int32_t>();
  int64_t longest = 0, total = 0;
  for (int64_t b = 0; b < rows; ++b) {
    TORCH_CHECK(lengths[b] >= 1 && lengths[b] <= l.max_blocks * l.block_size,
                "decode row ", b, " has context length ", lengths[b], ", outside its block table");
    longest = std::max<int64_t>(longest, lengths[b]);
    total += lengths[b];
  }
  at::Tensor out = at::empty({rows, l.heads, d}, q.options());
  const float scale_f = static_cast<float>(scale);
  if (dtype == at::kFloat)
    decode_rows<float>(l, q, k, v, kv_cache, slot_mapping, block_tables, lengths, longest, total,
                       scale_f, out);
  else
    decode_rows<bf16>(l, q, k, v, kv_cache, slot_mapping, block_tables, lengths, longest, total,
                      scale_f, out);
  return out;
}

namespace {

// The decode-only step this thread is running, bound by the attention backend around a compiled
// decode program, so that the program's calls name a layer's cache by index and reach the step's
// tables without a trip through Python (each such trip cost ~25 us, 30 a step).
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
                                 int64_t layer, double scale) {
  const DecodeStep& step = bound_step;
  TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(step.kv_caches.size()),
              "decode_step_attention: no decode step bound with a cache for layer ", layer);
  return paged_decode_attention(q, k, v, step.kv_caches[layer], step.slot_mapping,
                                step.block_tables, step.seq_lens, scale);
}

TORCH_LIBRARY(folio_cpu_attention, library) {
  library.def(
      "paged_decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, "
      "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, float scale) -> Tensor");
  library.def(
      "decode_step_attention(Tensor q, Tensor k, Tensor v, int layer, float scale) -> Tensor");
  library.def(
      "bind_decode_step(Tensor[] kv_caches, Tensor slot_mapping, Tensor block_tables, "
      "Tensor seq_lens) -> ()");
  library.def("unbind_decode_step() -> ()", &unbind_decode_step);
}

TORCH_LIBRARY_IMPL(folio_cpu_attention, CPU, library) {
  library.impl("paged_decode_attention", &paged_decode_attention);
  library.impl("decode_step_attention", &decode_step_attention);
  library.impl("bind_decode_step", &bind_decode_step);
}
