// Grouped LoRA on x86 CPUs: one call adds every row's adapter product to a linear layer's
// output, whatever mix of adapters (slots) the rows use.
//
// folio_lora::lora_add(y, x, slots, a, b, shard_outputs, isa) returns y plus, for
// each row t with slots[t] = s >= 0, B[s] (A[s] x[t]); rows with slot -1 (the base model) get
// y's values. a [slots, shards * rank, in] holds each slot's A, its shards' rows one after
// the other. b [slots, tiles, rank, tile] holds each slot's B transposed and cut into tiles of
// `tile` output columns, each tile's rank x tile values contiguous: shard k (shard_outputs[k]
// columns, in order) takes the next ceil(shard_outputs[k] / tile) tiles, zero past its last
// column, and multiplies the shrunk values k * rank onwards (a fused q/k/v or gate/up layer's
// shards each have their own A and B, and no zeros between them are stored or read). Ranks
// below `rank` are zero rows of A and B. The rows are grouped by slot (a counting sort); with
// two groups or more per thread each thread takes whole groups (each group hinting the next
// one's A and B to the L2 cache while it computes), else each group's shrink is
// split into tasks of a few rows of A over all its rows and its expand into runs of tiles
// (cpu_lora_body.h's run): each used slot's A and B are read once per call, front to back,
// and a row does its own slot's arithmetic only. The work runs on at::parallel_for; the sums
// are float32, with bfloat16 and float16 values widened in registers, so no CPU feature
// beyond AVX2 and FMA is needed; AVX-512 where the CPU has it, and on CPUs with AVX-512 BF16
// the shrink of bfloat16 takes pairs of values as they are stored (vdpbf16ps, exact products,
// its own order of float32 sums). `isa` is the most a call may use: 0 AVX2, 1 AVX-512, 2
// AVX-512 BF16, and it runs the best the CPU has up to that (engine/layers/lora.py passes 2,
// or 0 under FOLIO_CPU_ISA=avx2; the tests and bench.lora_kernel take each). x, y, a and b
// share one dtype: float32, bfloat16 or float16.
//
// A row's result depends on its own inputs and slot only, never on the other rows of the
// call (cpu_lora_body.h). This file never chooses which rows use which slot (engine/layers/
// lora.py does) and never changes its inputs.

#include <immintrin.h>
#include "avx2.h"
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "bf16_tiles.h"

namespace {

constexpr int64_t kShrinkRows = 4;  // rows of A a shrink task multiplies together

struct Group {
  int64_t slot, begin, end;  // the rows order[begin .. end) use slot `slot`
};

struct Tile {
  int64_t o0, n, shard;  // output columns o0 .. o0 + n, all of shard `shard`
};

template <typename T>
struct Problem {
  const T *x, *y, *a, *b;
  T* out;
  int64_t x_stride, in, out_features, rank, width, tile_width;
  std::vector<Group> groups;
  std::vector<int32_t> order, base_rows;
  std::vector<Tile> tiles;
  float* shrunk;  // [rows, width]: each row's shrunk values, of its own slot
};

}  // namespace

namespace folio_lora_avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")

using Vec = __m512;
constexpr int kLanes = 16;
// 4 x 4 sums, 4 rows of A and 4 activation vectors: 24 of AVX-512's 32 registers.
constexpr int kRowBlock = 4;
// The expand's rows a pass over a tile of B: 8 x 2 sums, two vectors of B, a broadcast.
constexpr int kExpandRows = 8;

inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec broadcast(float v) { return _mm512_set1_ps(v); }
inline float sum(Vec v) {
  const __m256 low = _mm512_castps512_ps256(v);
  const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  __m256 both = _mm256_add_ps(low, high);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(both), _mm256_extractf128_ps(both, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec load(const c10::BFloat16* p) {
  const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}
inline Vec load(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline void store(c10::BFloat16* p, Vec v) {
  // Round to nearest even, as c10::BFloat16 does; NaN stays a quiet NaN.
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
}
inline void store(c10::Half* p, Vec v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// Two vectors of columns of B: float32 and float16 in order; bfloat16's 32 values from one
// load, the even columns (each pair's low half, shifted up) then the odd ones (the high half,
// masked), which in_order puts back in column order.
struct Columns {
  Vec v[2];
};
inline Columns load_columns(const float* p) { return {{load(p), load(p + kLanes)}}; }
inline Columns load_columns(const c10::Half* p) { return {{load(p), load(p + kLanes)}}; }
inline Columns load_columns(const c10::BFloat16* p) {
  Columns columns;
  folio::widen_pairs(p, columns.v[0], columns.v[1]);
  return columns;
}
template <typename T>
inline Columns in_order(const Vec (&sums)[2], const T*) {
  return {{sums[0], sums[1]}};
}
inline Columns in_order(const Vec (&sums)[2], const c10::BFloat16*) {
  const __m512i low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i high =
      _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  return {{_mm512_permutex2var_ps(sums[0], low, sums[1]),
           _mm512_permutex2var_ps(sums[0], high, sums[1])}};
}

#include "cpu_lora_body.h"

#pragma GCC pop_options
}  // namespace folio_lora_avx512

// The AVX-512 code again with the shrink of bfloat16 in vdpbf16ps (cpu_lora_body.h's
// Dot<c10::BFloat16>), for CPUs with AVX-512 BF16: AVX-512's own helpers, the loops compiled
// anew.
namespace folio_lora_avx512_bf16 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")

using namespace folio_lora_avx512;

#define FOLIO_LORA_BF16_DOT
#include "cpu_lora_body.h"
#undef FOLIO_LORA_BF16_DOT

#pragma GCC pop_options
}  // namespace folio_lora_avx512_bf16

namespace folio_lora_avx2 {

using Vec = __m256;
constexpr int kLanes = 8;
// 4 x 2 sums, 4 rows of A and 2 activation vectors: 14 of AVX2's 16 registers.
constexpr int kRowBlock = 2;
// The expand's rows a pass over a tile of B: 4 x 2 sums, two vectors of B, a broadcast.
constexpr int kExpandRows = 4;

inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec broadcast(float v) { return _mm256_set1_ps(v); }
inline float sum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec load(const c10::BFloat16* p) { return folio::load8_bf16(p); }
inline Vec load(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline void store(c10::BFloat16* p, Vec v) { folio::store8_bf16(p, v); }
inline void store(c10::Half* p, Vec v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// Two vectors of columns of B, as AVX-512's (above): bfloat16's even columns then its odd ones.
struct Columns {
  Vec v[2];
};
inline Columns load_columns(const float* p) { return {{load(p), load(p + kLanes)}}; }
inline Columns load_columns(const c10::Half* p) { return {{load(p), load(p + kLanes)}}; }
inline Columns load_columns(const c10::BFloat16* p) {
  Columns columns;
  folio::widen_pairs(p, columns.v[0], columns.v[1]);
  return columns;
}
template <typename T>
inline Columns in_order(const Vec (&sums)[2], const T*) {
  return {{sums[0], sums[1]}};
}
inline Columns in_order(const Vec (&sums)[2], const c10::BFloat16*) {
  // Within each 128-bit lane: even, odd, even, odd; then the lanes in column order.
  const Vec low = _mm256_unpacklo_ps(sums[0], sums[1]);
  const Vec high = _mm256_unpackhi_ps(sums[0], sums[1]);
  return {{_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31)}};
}

#include "cpu_lora_body.h"

}  // namespace folio_lora_avx2

namespace {

// The codes a call may run, each a level above the last (lora_add's `isa`).
enum Isa : int64_t { kAvx2 = 0, kAvx512 = 1, kAvx512Bf16 = 2 };

// The highest code up to `most` that this CPU runs.
Isa best_isa(int64_t most) {
  static const bool avx512 = __builtin_cpu_supports("avx512f") &&
                             __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl");
  if (most >= kAvx512Bf16 && folio::cpu_has_avx512_bf16()) return kAvx512Bf16;
  return most >= kAvx512 && avx512 ? kAvx512 : kAvx2;
}

template <typename T>
at::Tensor grouped(const at::Tensor& y, const at::Tensor& x, const at::Tensor& slots,
                   const at::Tensor& a, const at::Tensor& b, at::IntArrayRef shard_outputs,
                   Isa isa) {
  const int64_t rows = x.size(0), num_slots = a.size(0);
  at::Tensor out = at::empty(y.sizes(), y.options());
  Problem<T> p;
  p.x = x.data_ptr<T>();
  p.y = y.data_ptr<T>();
  p.a = a.data_ptr<T>();
  p.b = b.data_ptr<T>();
  p.out = out.data_ptr<T>();
  p.x_stride = x.stride(0);
  p.in = x.size(1);
  p.out_features = y.size(1);
  p.rank = b.size(2);
  p.width = a.size(1);
  p.tile_width = b.size(3);

  // The rows grouped by slot (slot order, then row order): a counting sort.
  const int32_t* slot_of = slots.data_ptr<int32_t>();
  std::vector<int64_t> starts(num_slots + 1, 0);
  for (int64_t t = 0; t < rows; ++t) {
    const int32_t s = slot_of[t];
    TORCH_CHECK(s >= -1 && s < num_slots, "lora_add: row ", t, " has slot ", s,
                ", outside -1 .. ", num_slots - 1);
    if (s >= 0) ++starts[s + 1];
  }
  for (int64_t s = 0; s < num_slots; ++s) {
    if (starts[s + 1] > 0) p.groups.push_back({s, starts[s], starts[s] + starts[s + 1]});
    starts[s + 1] += starts[s];
  }
  p.order.resize(starts[num_slots]);
  for (int64_t t = 0; t < rows; ++t) {
    const int32_t s = slot_of[t];
    if (s >= 0)
      p.order[starts[s]++] = static_cast<int32_t>(t);
    else
      p.base_rows.push_back(static_cast<int32_t>(t));
  }
  int64_t first = 0;
  for (int64_t shard = 0; shard < static_cast<int64_t>(shard_outputs.size()); ++shard) {
    const int64_t end = first + shard_outputs[shard];
    for (int64_t o0 = first; o0 < end; o0 += p.tile_width)
      p.tiles.push_back({o0, std::min(p.tile_width, end - o0), shard});
    first = end;
  }
  std::vector<float> shrunk(p.groups.empty() ? 0 : rows * p.width);
  p.shrunk = shrunk.data();
  if (isa == kAvx512Bf16 && std::is_same_v<T, c10::BFloat16>)
    folio_lora_avx512_bf16::run(p);
  else if (isa >= kAvx512)
    folio_lora_avx512::run(p);
  else
    folio_lora_avx2::run(p);
  return out;
}

at::Tensor lora_add(const at::Tensor& y, const at::Tensor& x, const at::Tensor& slots,
                    const at::Tensor& a, const at::Tensor& b, at::IntArrayRef shard_outputs,
                    int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0),
              "lora_add takes activations [rows, in] and outputs [rows, out], got ", x.sizes(),
              " and ", y.sizes());
  TORCH_CHECK(a.dim() == 3 && b.dim() == 4 && a.size(0) == b.size(0) && b.size(3) > 0,
              "lora_add takes A [slots, shards * rank, in] and B [slots, tiles, rank, tile], got ",
              a.sizes(), " and ", b.sizes());
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous(), "lora_add: A and B must be contiguous");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(y.scalar_type() == dtype && a.scalar_type() == dtype && b.scalar_type() == dtype,
              "lora_add: activations, outputs, A and B must share one dtype, got ",
              x.scalar_type(), ", ", y.scalar_type(), ", ", a.scalar_type(), " and ",
              b.scalar_type());
  TORCH_CHECK(x.size(1) == a.size(2), "lora_add: activations have ", x.size(1),
              " features, A takes ", a.size(2));
  const int64_t tile = b.size(3);
  int64_t outputs = 0, tiles = 0;
  for (const int64_t n : shard_outputs) {
    TORCH_CHECK(n > 0, "lora_add: a shard of ", n, " outputs");
    outputs += n;
    tiles += (n + tile - 1) / tile;
  }
  TORCH_CHECK(outputs == y.size(1), "lora_add: the shards' outputs add up to ", outputs,
              ", the outputs have ", y.size(1));
  TORCH_CHECK(b.size(1) == tiles, "lora_add: B has ", b.size(1), " tiles, the shards take ",
              tiles, " of ", tile, " outputs");
  TORCH_CHECK(a.size(1) == static_cast<int64_t>(shard_outputs.size()) * b.size(2),
              "lora_add: A has ", a.size(1), " rows for ", shard_outputs.size(),
              " shards of rank ", b.size(2));
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kInt && slots.size(0) == x.size(0),
              "lora_add: slots must be int32 with one per row (", x.size(0), "), got ",
              slots.scalar_type(), " ", slots.sizes());
  const at::Tensor xs = x.stride(1) == 1 ? x : x.contiguous();
  const at::Tensor ys = y.contiguous(), slot_of = slots.contiguous();
  TORCH_CHECK(isa >= kAvx2 && isa <= kAvx512Bf16, "lora_add: isa ", isa,
              " is none of 0 (AVX2), 1 (AVX-512), 2 (AVX-512 BF16)");
  const Isa code = best_isa(isa);
  switch (dtype) {
    case at::kFloat:
      return grouped<float>(ys, xs, slot_of, a, b, shard_outputs, code);
    case at::kBFloat16:
      return grouped<c10::BFloat16>(ys, xs, slot_of, a, b, shard_outputs, code);
    case at::kHalf:
      return grouped<c10::Half>(ys, xs, slot_of, a, b, shard_outputs, code);
    default:
      TORCH_CHECK(false, "lora_add takes float32, bfloat16 or float16, got ", dtype);
  }
}

}  // namespace

TORCH_LIBRARY(folio_lora, library) {
  library.def(
      "lora_add(Tensor y, Tensor x, Tensor slots, Tensor a, Tensor b, int[] shard_outputs, "
      "int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(folio_lora, CPU, library) { library.impl("lora_add", &lora_add); }
