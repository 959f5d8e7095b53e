// The CPU mixture of experts' work around its experts' products (engine/layers/moe.py's
// run_experts), a few small torch ops each done in one call:
//
// folio_moe::route(x, ids, first_expert, num_local) -> (counts, pairs, rows): ids [T, k] are
// the router's experts of each token; the pairs (token, slot) whose expert lies in
// [first_expert, first_expert + num_local) (this rank's), as flat indices t * k + slot sorted
// by expert, stably (a counting sort: a token's pairs stay in slot order, and the tokens of an
// expert in token order, as a stable argsort leaves them); counts [num_local] how many each
// local expert got; rows [P, hidden] x's row of each pair, in that order.
//
// folio_moe::combine(outputs, pairs, weights, tokens) -> [tokens, hidden]: outputs are the
// experts' results over `rows`, in order (their rows line up with pairs); each pair's row
// times its routing weight (weights [T, k] float32), rounded to the activations' dtype, added
// to its token's row of a zero output in the pairs' order, exactly as torch's
// `out.index_add_(0, tokens, (h * w).to(dtype))` rounds and adds (so a token's experts are
// summed in expert order, as transformers sums them). Columns are split over threads, never
// the pairs, so the order of the additions is the same at any thread count.
//
// Both take float32, bfloat16 or float16 activations. This file never routes (the router
// chooses the experts) and never changes its inputs.
//
// folio_moe::experts(x, weights, ids, gate_up, down, first_expert, allow_avx512) -> [T, hidden]:
// the whole step of gated-SiLU experts without biases, in one call: route, then every expert
// that got rows, gate_up and down, then combine. The products are float32's: x float32 (or
// bfloat16, its rows widened, each expert's output rounded to bfloat16 before combine, as a
// bfloat16 linear rounds it), weights float32 or bfloat16 (widened exactly as they are loaded:
// half the bytes of float32 for a bfloat16 checkpoint's values). Its weights are packed once, at
// load, by folio_moe::pack_experts(gate_ups, downs, pairs) -> (gate_up, down), in their own
// dtype, into the order the products read them: gate_up [E, I/16, hidden, 32], panel j holding,
// for each input k, the 16 gate columns 16 j .. 16 j + 16 then the 16 up columns; down [E,
// hidden/16, I', 16] (I' = I rounded up to 16), panel t holding, for each intermediate feature
// k, outputs 16 t .. 16 t + 16; zeros where a size is not a multiple of 16. With `pairs`
// (bfloat16 weights, both sizes multiples of 32, for CPUs with AMX: amx_usable, or for bfloat16
// activations on CPUs with AVX-512 BF16) each step holds two inputs of every column side by
// side: gate_up [E, I/16, hidden/2, 64], down [E, hidden/16, I/2, 32], the right-hand operands
// of AMX's tdpbf16ps and of vdpbf16ps, which folio_moe_amx below multiplies by x's rows
// (bfloat16 as they are; float32 split exactly into three bfloat16 parts; float32 blocks of at
// most 8 rows with AVX-512 FMAs instead), and folio_moe_bf16_pairs without AMX (bfloat16 rows
// only). One pass over x per gate_up panel gives
// gate and up together, and silu(gate) * up leaves registers only once, as the intermediate
// rows down reads; the tasks of all experts share one parallel loop per product (instead of a
// oneDNN call per expert and projection). The float32 code's sums are fused multiply-adds in
// input order, so the results are F.linear's within float32 rounding, not bit for bit. AVX-512
// where the CPU has it and allow_avx512 (engine/layers/moe.py passes FOLIO_CPU_ISA's choice),
// AVX2 otherwise.
//
// folio_moe::amx_usable() -> bool: whether this process may run experts packed in pairs on AMX
// (float32 activations too).

// A float32 product and sum rounded one after the other, as torch rounds them: a fused
// multiply-add would round once and change the result's last bits.
#pragma GCC optimize("fp-contract=off")

#include <immintrin.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "avx2.h"
#include "bf16_tiles.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

namespace {

// Columns per task of combine: whole cache lines of float32, enough work per task.
constexpr int64_t kColumnGrain = 128;

void check_activations(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), "folio_moe: ", name, " must be on the CPU");
  TORCH_CHECK(x.dim() == 2, "folio_moe: ", name, " must be [rows, hidden], got ", x.sizes());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "folio_moe: ", name, " must be float32, bfloat16 or float16, got ", dtype);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> route(const at::Tensor& x, const at::Tensor& ids,
                                                     int64_t first_expert, int64_t num_local) {
  check_activations(x, "x");
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 2,
              "folio_moe::route: ids must be the router's [tokens, k] int64 on the CPU");
  TORCH_CHECK(ids.size(0) == x.size(0), "folio_moe::route: ids has ", ids.size(0),
              " rows, x ", x.size(0));
  TORCH_CHECK(first_expert >= 0 && num_local >= 0,
              "folio_moe::route: first_expert and num_local must not be negative");
  const at::Tensor flat = ids.contiguous().view(-1);
  const int64_t* expert = flat.data_ptr<int64_t>();
  const int64_t total = flat.numel();
  const int64_t k = ids.size(1);
  at::Tensor counts = at::zeros({num_local}, ids.options());
  int64_t* count = counts.data_ptr<int64_t>();
  for (int64_t i = 0; i < total; ++i) {
    const int64_t local = expert[i] - first_expert;
    if (local >= 0 && local < num_local) ++count[local];
  }
  std::vector<int64_t> next(num_local);
  int64_t pair_count = 0;
  for (int64_t e = 0; e < num_local; ++e) {
    next[e] = pair_count;
    pair_count += count[e];
  }
  at::Tensor pairs = at::empty({pair_count}, ids.options());
  int64_t* pair = pairs.data_ptr<int64_t>();
  for (int64_t i = 0; i < total; ++i) {
    const int64_t local = expert[i] - first_expert;
    if (local >= 0 && local < num_local) pair[next[local]++] = i;
  }
  const at::Tensor source = x.contiguous();
  const int64_t hidden = x.size(1);
  at::Tensor rows = at::empty({pair_count, hidden}, x.options());
  const auto* from = static_cast<const char*>(source.data_ptr());
  auto* to = static_cast<char*>(rows.data_ptr());
  const int64_t row_bytes = hidden * static_cast<int64_t>(x.element_size());
  for (int64_t p = 0; p < pair_count; ++p) {
    std::memcpy(to + p * row_bytes, from + (pair[p] / k) * row_bytes, row_bytes);
  }
  return {counts, pairs, rows};
}

template <typename T>
void combine_columns(const std::vector<const T*>& outputs, const std::vector<int64_t>& lengths,
                     const int64_t* pair, const float* weight, int64_t k, int64_t hidden,
                     T* out, int64_t begin, int64_t end) {
  int64_t p = 0;
  for (size_t o = 0; o < outputs.size(); ++o) {
    const T* h = outputs[o];
    for (int64_t r = 0; r < lengths[o]; ++r, ++p) {
      const float w = weight[pair[p]];
      const T* row = h + r * hidden;
      T* target = out + (pair[p] / k) * hidden;
      for (int64_t c = begin; c < end; ++c) {
        // Rounded to T, then added in T: torch's (h * w).to(dtype) and index_add_.
        const T term = static_cast<T>(static_cast<float>(row[c]) * w);
        target[c] = static_cast<T>(static_cast<float>(target[c]) + static_cast<float>(term));
      }
    }
  }
}

at::Tensor combine(const std::vector<at::Tensor>& outputs, const at::Tensor& pairs,
                   const at::Tensor& weights, int64_t tokens) {
  TORCH_CHECK(!outputs.empty(), "folio_moe::combine: no expert outputs");
  check_activations(outputs[0], "outputs");
  const auto dtype = outputs[0].scalar_type();
  const int64_t hidden = outputs[0].size(1);
  TORCH_CHECK(pairs.device().is_cpu() && pairs.scalar_type() == at::kLong && pairs.dim() == 1,
              "folio_moe::combine: pairs must be route's [pairs] int64");
  TORCH_CHECK(weights.device().is_cpu() && weights.scalar_type() == at::kFloat &&
                  weights.dim() == 2,
              "folio_moe::combine: weights must be the router's [tokens, k] float32");
  TORCH_CHECK(weights.size(0) == tokens, "folio_moe::combine: weights has ", weights.size(0),
              " rows for ", tokens, " tokens");
  std::vector<at::Tensor> held;  // contiguous copies where an output is not
  std::vector<int64_t> lengths;
  int64_t rows = 0;
  for (const at::Tensor& output : outputs) {
    check_activations(output, "outputs");
    TORCH_CHECK(output.scalar_type() == dtype && output.size(1) == hidden,
                "folio_moe::combine: every output must be [rows, ", hidden, "] of ", dtype);
    held.push_back(output.contiguous());
    lengths.push_back(output.size(0));
    rows += output.size(0);
  }
  TORCH_CHECK(rows == pairs.numel(), "folio_moe::combine: ", rows, " output rows for ",
              pairs.numel(), " pairs");
  const at::Tensor pair_tensor = pairs.contiguous();
  const at::Tensor weight_tensor = weights.contiguous();
  const int64_t* pair = pair_tensor.data_ptr<int64_t>();
  const int64_t k = weights.size(1);
  const int64_t limit = tokens * k;
  for (int64_t p = 0; p < rows; ++p) {
    TORCH_CHECK(pair[p] >= 0 && pair[p] < limit, "folio_moe::combine: pair ", pair[p],
                " outside [0, ", limit, ")");
  }
  at::Tensor out = at::zeros({tokens, hidden}, outputs[0].options());
  const float* weight = weight_tensor.data_ptr<float>();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    std::vector<const T*> data;
    for (const at::Tensor& h : held) data.push_back(static_cast<const T*>(h.data_ptr()));
    T* target = static_cast<T*>(out.data_ptr());
    at::parallel_for(0, hidden, kColumnGrain, [&](int64_t begin, int64_t end) {
      combine_columns<T>(data, lengths, pair, weight, k, hidden, target, begin, end);
    });
  };
  if (dtype == at::kFloat) {
    run(float{});
  } else if (dtype == at::kBFloat16) {
    run(c10::BFloat16{});
  } else {
    run(c10::Half{});
  }
  return out;
}

constexpr int64_t kPanel = 16;  // columns of a packed panel (experts' float32 layout)

// One call of folio_moe::experts, routed: the rows of every local expert that got some.
struct ExpertProblem {
  const float* x;  // the routed rows [pairs, hidden], expert by expert
  float* h;        // silu(gate) * up of each row [pairs, I']
  float* y;        // each row's expert output [pairs, hidden]
  int64_t hidden;
  at::Tensor gate_up, down;    // pack_experts' panels
  std::vector<int64_t> used;   // the local experts that got rows, in order
  std::vector<int64_t> start;  // used expert u's rows: start[u] .. start[u + 1]
};

// A task's cost besides its rows' products, in rows: reading its panel, about what multiplying
// 8 rows by it takes (a bfloat16 pairs panel of a 512-wide expert: ~1.4 us from memory on one
// core, a row's dot products ~0.14 us; float32 panels twice both). In calls taking turns, 8 was
// as fast as 16 and up to 10% faster than 0 (rows alone) at 16 tokens.
constexpr int64_t kPanelCost = 8;

// One product of every used expert as tasks (used expert u, first panel j), `per_task` of its
// `panels` panels (`panel_values` weights each, from `weights`) a task, all experts' tasks in one
// parallel loop: f(u, j, the task's weights, the next task's of this thread or nullptr, for
// prefetching). Each thread takes a run of tasks of about equal cost (reading a panel, and its
// rows' products), not of equal count: the experts' rows differ, and a bfloat16 step of 64
// tokens routed [21, 27, 28, 11 | 11, 4, 16, 10] took 0.69 ms split by count, 0.60 by cost.
template <typename W, typename F>
inline void for_panel_tasks(const ExpertProblem& p, const W* weights, int64_t panels,
                            int64_t per_task, int64_t panel_values, const F& f) {
  std::vector<std::pair<int64_t, int64_t>> tasks;
  std::vector<int64_t> cost_before{0};  // the tasks' costs, summed up to each
  for (size_t u = 0; u < p.used.size(); ++u) {
    const int64_t cost = kPanelCost + p.start[u + 1] - p.start[u];
    for (int64_t j = 0; j < panels; j += per_task) {
      tasks.emplace_back(u, j);
      cost_before.push_back(cost_before.back() + cost);
    }
  }
  const auto weights_of = [&](int64_t task) {
    const auto [u, j] = tasks[task];
    return weights + (p.used[u] * panels + j) * panel_values;
  };
  const int64_t count = static_cast<int64_t>(tasks.size());
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), count);
  // Thread t's first task: the first whose costs before it reach t / threads of the total.
  const auto first_of = [&](int64_t t) {
    const int64_t share = cost_before.back() * t / threads;
    return static_cast<int64_t>(
        std::lower_bound(cost_before.begin(), cost_before.end() - 1, share) -
        cost_before.begin());
  };
  at::parallel_for(0, threads, 1, [&](int64_t first_thread, int64_t last_thread) {
    for (int64_t t = first_thread; t < last_thread; ++t) {
      const int64_t begin = first_of(t), end = t + 1 == threads ? count : first_of(t + 1);
      for (int64_t task = begin; task < end; ++task)
        f(tasks[task].first, tasks[task].second, weights_of(task),
          task + 1 < end ? weights_of(task + 1) : nullptr);
    }
  });
}

bool cpu_has_avx512() {
  static const bool supported = __builtin_cpu_supports("avx512f") &&
                                __builtin_cpu_supports("avx512dq");
  return supported;
}

// Whether this process may use AMX's bfloat16 tiles: the CPU has them and Linux granted their
// state (asked once: ARCH_REQ_XCOMP_PERM for XTILEDATA; oneDNN asks the same).
bool amx_usable() {
  static const bool usable = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;
    return cpu_has_avx512() && folio::cpu_has_avx512_bf16() &&
           __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
           syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return usable;
}

}  // namespace

namespace folio_moe_avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq")

using Vec = __m512;
constexpr int kLanes = 16;
// 12 rows x (gate, up): 24 sums, 2 weight vectors and a broadcast, 27 of 32 registers (fastest
// calls 5-10% below 8 rows' in alternating runs at 64 tokens: an expert of 9 to 12 rows reads
// its panels once).
constexpr int kGateUpRows = 12;
// 8 rows x 2 panels: 16 sums, 2 weight vectors and a broadcast.
constexpr int kDownRows = 8;
constexpr int kDownPanels = 2;

inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec broadcast(float v) { return _mm512_set1_ps(v); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec load(const uint16_t* p) {  // 16 bfloat16 values: the upper halves of float32s
  const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }

// silu(g) * u = g * u / (1 + exp(-g)); exp by 2^n exp(r), |r| <= ln 2 / 2, exp(r) to degree 7
// (relative error below 1e-8: float32's rounding dominates).
inline Vec silu_mul(Vec g, Vec u) {
  const Vec x = _mm512_max_ps(_mm512_min_ps(_mm512_sub_ps(zero(), g), broadcast(88.3762626f)),
                              broadcast(-87.3365447f));
  const Vec n = _mm512_roundscale_ps(_mm512_mul_ps(x, broadcast(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  Vec r = _mm512_fnmadd_ps(n, broadcast(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, broadcast(-2.12194440e-4f), r);
  Vec e = broadcast(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    e = fma(e, r, broadcast(c));
  e = _mm512_scalef_ps(e, n);
  return _mm512_div_ps(_mm512_mul_ps(g, u), _mm512_add_ps(broadcast(1.0f), e));
}

#include "cpu_moe_body.h"

#pragma GCC pop_options
}  // namespace folio_moe_avx512

// Both products on AMX tiles, for bfloat16 weights packed in pairs (pack_experts' `pairs`, the
// right-hand operand's layout of tdpbf16ps: a panel's 16 steps of one 32-input chunk are a tile,
// its gate and up halves 128 bytes apart). The activations are `parts` bfloat16 copies of each
// row whose sum is the row: one (bfloat16 x, and silu(gate) * up rounded to bfloat16 once) or
// three (float32 x: hi, mid and lo, exact but for lo's rounding, 2^-27 of the value; the
// products of bfloat16 weights by them are exact, so the sums are float32's, in another order
// than F.linear's). Each expert's rows lie in blocks of 16 (a tile's rows), the last one
// padded with rows whose sums are never read; float32 blocks of at most kFewRows rows go
// through AVX-512 FMAs over the same pairs instead (the float32 code's sums, bit for bit).
namespace folio_moe_amx {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")

constexpr int64_t kTile = 16;   // rows of a tile, and columns of its float32 sums
constexpr int64_t kDepth = 32;  // inputs of a tile product (16 pairs)
// The tiles (GCC's tile intrinsics take their numbers as literals): 0 and 1 the sums, 2 the
// activations, 3 and 4 the weights.
constexpr int kTiles = 5;

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes[16] = {};  // of a row, per tile
  uint8_t rows[16] = {};
};

// This thread's tiles: each 16 rows of 64 bytes. Only when a block needs them: a step with no
// tile product (a decode step's float32 rows) then runs no AMX instruction at all (at one token
// it took 0.48 ms against 0.42 when every parallel chunk configured and released its tiles).
inline void configure(bool& configured) {
  TileConfig config;
  for (int t = 0; t < kTiles; ++t) {
    config.bytes[t] = 64;
    config.rows[t] = kTile;
  }
  _tile_loadconfig(&config);
  configured = true;
}

// 16 float32 as `parts` bfloat16 vectors (`stride` values apart) whose sum is v.
inline void store_parts(__m512 v, int64_t parts, uint16_t* to, int64_t stride) {
  for (int64_t q = 0; q < parts; ++q) {
    const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(v);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + q * stride), rounded);
    // v minus its rounding: exact in float32 (their leading bits cancel).
    const __m512i widened = _mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16);
    v = _mm512_sub_ps(v, _mm512_castsi512_ps(widened));
  }
}

// A block of at most this many rows of float32 activations is multiplied with AVX-512 FMAs over
// the same pairs instead (a decode step's experts get a row or two): on tiles, its three parts'
// products over 16-row tiles, each load of the weights waiting on the products that read the
// last (tiles are not renamed), took 1.2x the FMAs' time at one token; at 16 tokens (blocks of
// about 4 rows) the benchmark's fastest calls went from 0.79-0.84x the AVX-512 code's speed with
// 4 here to 0.98x with 8.
constexpr int kFewRows = 8;

// The pairs of a step as two vectors of float32 weights: the step's first inputs (the low
// halves) and its second (the high halves), exactly.
using folio::widen_pairs;

// `lines` cache lines from `at` into L2: the share of the next task's panel that one step of a
// few-row block reads of its own, so the next panel is in by the time it is multiplied (these
// blocks are bound by the weights' bytes, as the float32 code's, which prefetches the same way).
inline void prefetch_step(const uint16_t* at, int lines) {
  for (int line = 0; line < lines; ++line)
    _mm_prefetch(reinterpret_cast<const char*>(at) + 64 * line, _MM_HINT_T1);
}

// M float32 rows x (`hidden` apart) times gate_up panel `panel` (pairs): h[m * inter + c] =
// silu(gate) * up for its 16 columns c. One FMA an input in input order, as the float32 code's
// (so the same results as its widened bfloat16 panels).
template <int M>
struct FewGateUp {
  static void run(const float* x, int64_t hidden, const uint16_t* panel, const uint16_t* next,
                  float* h, int64_t inter) {
    __m512 gate[M], up[M];
    for (int m = 0; m < M; ++m) gate[m] = up[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < hidden; k += 2) {
      if (next != nullptr) prefetch_step(next + k * 2 * kTile, 2);
      __m512 g0, g1, u0, u1;
      widen_pairs(panel + k * 2 * kTile, g0, g1);
      widen_pairs(panel + k * 2 * kTile + 2 * kTile, u0, u1);
      for (int m = 0; m < M; ++m) {
        const __m512 x0 = _mm512_set1_ps(x[m * hidden + k]);
        const __m512 x1 = _mm512_set1_ps(x[m * hidden + k + 1]);
        gate[m] = _mm512_fmadd_ps(g1, x1, _mm512_fmadd_ps(g0, x0, gate[m]));
        up[m] = _mm512_fmadd_ps(u1, x1, _mm512_fmadd_ps(u0, x0, up[m]));
      }
    }
    for (int m = 0; m < M; ++m)
      _mm512_storeu_ps(h + m * inter, folio_moe_avx512::silu_mul(gate[m], up[m]));
  }
};

// M float32 rows h (`inter` apart) times two down panels (pairs, `panel_values` apart): y[m *
// hidden + c] for their 32 columns c.
template <int M>
struct FewDown {
  static void run(const float* h, int64_t inter, const uint16_t* w, const uint16_t* next,
                  int64_t panel_values, float* y, int64_t hidden) {
    __m512 sums[M][2];
    for (int m = 0; m < M; ++m) sums[m][0] = sums[m][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < inter; k += 2) {
      if (next != nullptr)
        for (int t = 0; t < 2; ++t) prefetch_step(next + t * panel_values + k * kTile, 1);
      __m512 first[2], second[2];
      for (int t = 0; t < 2; ++t)
        widen_pairs(w + t * panel_values + k * kTile, first[t], second[t]);
      for (int m = 0; m < M; ++m) {
        const __m512 h0 = _mm512_set1_ps(h[m * inter + k]);
        const __m512 h1 = _mm512_set1_ps(h[m * inter + k + 1]);
        for (int t = 0; t < 2; ++t)
          sums[m][t] = _mm512_fmadd_ps(second[t], h1, _mm512_fmadd_ps(first[t], h0, sums[m][t]));
      }
    }
    for (int m = 0; m < M; ++m)
      for (int t = 0; t < 2; ++t) _mm512_storeu_ps(y + m * hidden + t * kTile, sums[m][t]);
  }
};

// F<M>::run(args...) for M = rows (1 to kFewRows: each row count its own unrolled code).
template <template <int> class F, typename... Args>
inline void with_rows(int64_t rows, Args... args) {
  static_assert(kFewRows == 8, "one case per row count");
  switch (rows) {
    case 1: return F<1>::run(args...);
    case 2: return F<2>::run(args...);
    case 3: return F<3>::run(args...);
    case 4: return F<4>::run(args...);
    case 5: return F<5>::run(args...);
    case 6: return F<6>::run(args...);
    case 7: return F<7>::run(args...);
    default: return F<8>::run(args...);
  }
}

// The routed rows (float32 or bfloat16 [pairs, hidden], expert by expert) -> the experts'
// outputs y [pairs, hidden] float32, as the float32 code's run_experts.
inline void run_experts(const ExpertProblem& p, const at::Tensor& rows) {
  const int64_t hidden = p.hidden, up_panels = p.gate_up.size(1), inter = up_panels * kTile;
  const int64_t parts = rows.scalar_type() == at::kFloat ? 3 : 1;
  const int64_t experts_used = static_cast<int64_t>(p.used.size());
  // Expert u's rows from padded row first[u] on, in blocks of 16.
  std::vector<int64_t> first{0};
  for (int64_t u = 0; u < experts_used; ++u) {
    const int64_t count = p.start[u + 1] - p.start[u];
    first.push_back(first.back() + (count + kTile - 1) / kTile * kTile);
  }
  const auto is_few = [&](int64_t valid) { return parts == 3 && valid <= kFewRows; };
  // An expert of more than kFewRows rows has a block of more (or a whole tile); without one,
  // no tile product, and no bfloat16 copies of the rows (a decode step's float32 rows).
  int64_t most = 0;
  for (int64_t u = 0; u < experts_used; ++u) most = std::max(most, p.start[u + 1] - p.start[u]);
  const int64_t padded = is_few(most) ? 0 : first.back();
  const auto bf16 = rows.options().dtype(at::kBFloat16);
  at::Tensor left = at::empty({parts, padded, hidden}, bf16);
  at::Tensor middle = at::empty({parts, padded, inter}, bf16);  // silu(gate) * up
  uint16_t* x = static_cast<uint16_t*>(left.data_ptr());
  uint16_t* h = static_cast<uint16_t*>(middle.data_ptr());
  const int64_t x_part = padded * hidden, h_part = padded * inter;
  // The few-row blocks' silu(gate) * up, in float32 (float32 activations only).
  const int64_t pair_count = p.start.back();
  at::Tensor few = at::empty({parts == 3 ? pair_count : 0, inter}, rows.options());
  float* wide_h = parts == 3 ? few.data_ptr<float>() : nullptr;
  for (int64_t u = 0; u < experts_used && padded > 0; ++u) {
    for (int64_t r = p.start[u]; r < p.start[u + 1]; ++r) {
      uint16_t* to = x + (first[u] + r - p.start[u]) * hidden;
      if (parts == 1) {
        std::memcpy(to, static_cast<const uint16_t*>(rows.data_ptr()) + r * hidden, hidden * 2);
      } else {
        const float* from = rows.data_ptr<float>() + r * hidden;
        for (int64_t c = 0; c < hidden; c += kTile)
          store_parts(_mm512_loadu_ps(from + c), parts, to + c, x_part);
      }
    }
  }
  // Per task (expert, panel): its blocks of rows, then the sums of each block's valid rows. No
  // software prefetch in the tile blocks: the weights stream in order, and prefetching the next
  // task's panel (as the float32 code does), or 8 KB ahead, or the whole next panel at once
  // measured the same as none at one thread (load 5). The few-row blocks do prefetch the next
  // task's panel (prefetch_step): without it, 16 tokens (blocks of about 4 rows) ran at 0.78-0.82x
  // the AVX-512 code over widened panels, with it 0.98-1.01x (bench.moe_kernels, two threads).
  const auto blocks_of = [&](int64_t u) { return (first[u + 1] - first[u]) / kTile; };
  const auto valid_rows = [&](int64_t u, int64_t b) {
    return std::min<int64_t>(kTile, p.start[u + 1] - p.start[u] - b * kTile);
  };
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (used expert, its first panel)
  for (int64_t u = 0; u < experts_used; ++u)
    for (int64_t j = 0; j < up_panels; ++j) tasks.emplace_back(u, j);
  const int64_t gate_up_values = hidden * 2 * kTile;  // a panel's
  const uint16_t* gate_up = static_cast<const uint16_t*>(p.gate_up.data_ptr());
  const auto panel_of = [&](int64_t task) {
    const auto [u, j] = tasks[task];
    return gate_up + (p.used[u] * up_panels + j) * gate_up_values;
  };
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    bool tiles = false;  // configured: only where a block needs them
    alignas(64) float gate[kTile * kTile], up[kTile * kTile];
    for (int64_t task = begin; task < end; ++task) {
      const auto [u, j] = tasks[task];
      const uint16_t* panel = panel_of(task);
      const uint16_t* next = task + 1 < end ? panel_of(task + 1) : nullptr;
      for (int64_t b = 0; b < blocks_of(u); ++b) {
        const int64_t row = first[u] + b * kTile, pair = p.start[u] + b * kTile;
        if (is_few(valid_rows(u, b))) {
          with_rows<FewGateUp>(valid_rows(u, b), rows.data_ptr<float>() + pair * hidden, hidden,
                               panel, next, wide_h + pair * inter + j * kTile, inter);
          continue;
        }
        if (!tiles) configure(tiles);
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t k = 0; k < hidden; k += kDepth) {
          const uint16_t* w = panel + k * 2 * kTile;  // 16 steps of 64 values
          _tile_loadd(3, w, 128);
          _tile_loadd(4, w + 2 * kTile, 128);
          for (int64_t q = 0; q < parts; ++q) {
            _tile_loadd(2, x + q * x_part + row * hidden + k, hidden * 2);
            _tile_dpbf16ps(0, 2, 3);
            _tile_dpbf16ps(1, 2, 4);
          }
        }
        _tile_stored(0, gate, kTile * 4);
        _tile_stored(1, up, kTile * 4);
        for (int64_t r = 0; r < valid_rows(u, b); ++r) {
          const __m512 value = folio_moe_avx512::silu_mul(_mm512_load_ps(gate + r * kTile),
                                                          _mm512_load_ps(up + r * kTile));
          store_parts(value, parts, h + (row + r) * inter + j * kTile, h_part);
        }
      }
    }
    if (tiles) _tile_release();
  });
  // Down: tasks of two panels (hidden is a multiple of 32).
  const int64_t down_panels = p.down.size(1), panel_values = inter * kTile;
  const uint16_t* down = static_cast<const uint16_t*>(p.down.data_ptr());
  tasks.clear();
  for (int64_t u = 0; u < experts_used; ++u)
    for (int64_t t = 0; t < down_panels; t += 2) tasks.emplace_back(u, t);
  const auto down_of = [&](int64_t task) {
    const auto [u, t] = tasks[task];
    return down + (p.used[u] * down_panels + t) * panel_values;
  };
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    bool tiles = false;
    alignas(64) float sums[2][kTile * kTile];
    for (int64_t task = begin; task < end; ++task) {
      const auto [u, t] = tasks[task];
      const uint16_t* w = down_of(task);
      const uint16_t* next = task + 1 < end ? down_of(task + 1) : nullptr;
      for (int64_t b = 0; b < blocks_of(u); ++b) {
        const int64_t row = first[u] + b * kTile, pair = p.start[u] + b * kTile;
        if (is_few(valid_rows(u, b))) {
          with_rows<FewDown>(valid_rows(u, b), wide_h + pair * inter, inter, w, next, panel_values,
                             p.y + pair * hidden + t * kTile, hidden);
          continue;
        }
        if (!tiles) configure(tiles);
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t k = 0; k < inter; k += kDepth) {
          _tile_loadd(3, w + k * kTile, 64);
          _tile_loadd(4, w + panel_values + k * kTile, 64);
          for (int64_t q = 0; q < parts; ++q) {
            _tile_loadd(2, h + q * h_part + row * inter + k, inter * 2);
            _tile_dpbf16ps(0, 2, 3);
            _tile_dpbf16ps(1, 2, 4);
          }
        }
        _tile_stored(0, sums[0], kTile * 4);
        _tile_stored(1, sums[1], kTile * 4);
        for (int64_t r = 0; r < valid_rows(u, b); ++r) {
          float* to = p.y + (p.start[u] + b * kTile + r) * hidden + t * kTile;
          for (int half = 0; half < 2; ++half)
            _mm512_storeu_ps(to + half * kTile, _mm512_load_ps(sums[half] + r * kTile));
        }
      }
    }
    if (tiles) _tile_release();
  });
}

#pragma GCC pop_options
}  // namespace folio_moe_amx

// Both products with AVX-512 BF16 dot products, for bfloat16 activations over weights packed in
// pairs on CPUs without AMX: the same panels as the tiles', each step of a panel one vector of
// 16 columns' pairs that vdpbf16ps multiplies by a row's broadcast pair (bf16_tiles.h's
// multiply_tiles), twice the multiply-adds of an instruction that FMAs over widened panels do
// (on a 2-core Zen 5 VM 7.4 G vdpbf16ps/s against 8.4 G FMAs/s on one core). The sums are float32
// (each instruction adds a pair's two products to them), silu(gate) * up rounded to bfloat16 once
// as the rows down reads, as the AMX code does.
namespace folio_moe_bf16_pairs {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16")

// 12 rows x (gate, up): 24 sums, the two weight vectors and a broadcast.
constexpr int kGateUpRows = 12;
// 12 rows x 2 down panels.
constexpr int kDownRows = 12;
constexpr int kDownPanels = 2;

// Row m's sums of a gate_up panel: its gate's (n = 0) then its up's (n = 1), whose product
// silu(gate) * up goes to h as bfloat16.
struct StoreGateUp {
  uint16_t* h;
  int64_t inter;
  mutable __m512 gate;
  void operator()(int m, int n, __m512 sums) const {
    if (n == 0) {
      gate = sums;
    } else {
      folio::store_bf16(h + m * inter, folio_moe_avx512::silu_mul(gate, sums), kPanel);
    }
  }
};

// Row m's sums of down panel n: 16 float32 outputs.
struct StoreDown {
  float* y;
  int64_t hidden;
  void operator()(int m, int n, __m512 sums) const {
    _mm512_storeu_ps(y + m * hidden + n * kPanel, sums);
  }
};

// Rows begin .. end in as few blocks of at most `most` rows as can hold them, of sizes that
// differ by one at most: f(first row, rows) each. A block's sums are that many independent
// chains of vdpbf16ps, each waiting on its last: 16 rows as 12 and 4 left the 4-row block bound
// by that latency (8 chains); as 8 and 8 every block has 16 (a 64-token step 8-10% faster).
template <typename F>
inline void for_blocks(int64_t begin, int64_t end, int64_t most, const F& f) {
  const int64_t count = end - begin, blocks = (count + most - 1) / most;
  for (int64_t b = 0, r = begin; b < blocks; ++b) {
    const int64_t rows = count / blocks + (b < count % blocks ? 1 : 0);
    f(r, rows);
    r += rows;
  }
}

// The routed bfloat16 rows [pairs, hidden], expert by expert -> the experts' outputs y [pairs,
// hidden] float32. Tasks as the float32 code's: (expert, gate_up panel), then (expert, two down
// panels), all experts' in one parallel loop each; every block of rows reads its panel (from
// cache after the first) while the next task's panel comes into L2.
inline void run_experts(const ExpertProblem& p, const at::Tensor& rows) {
  const int64_t hidden = p.hidden, up_panels = p.gate_up.size(1), inter = up_panels * kPanel;
  const auto* x = static_cast<const uint16_t*>(rows.data_ptr());
  at::Tensor middle = at::empty({rows.size(0), inter}, rows.options());  // silu(gate) * up
  auto* h = static_cast<uint16_t*>(middle.data_ptr());
  for_panel_tasks(p, static_cast<const uint16_t*>(p.gate_up.data_ptr()), up_panels, 1,
                  hidden * 2 * kPanel, [&](int64_t u, int64_t j, const uint16_t* panel,
                                           const uint16_t* next) {
    for_blocks(p.start[u], p.start[u + 1], kGateUpRows, [&](int64_t r, int64_t rows) {
      folio::multiply_tiles_upto<2, kGateUpRows, 4 * kPanel>(
          2, rows, x + r * hidden, hidden, panel, 2 * kPanel, hidden / 2, next,
          StoreGateUp{h + r * inter + j * kPanel, inter, {}});
    });
  });
  const int64_t panel_values = inter * kPanel;
  for_panel_tasks(p, static_cast<const uint16_t*>(p.down.data_ptr()), p.down.size(1),
                  kDownPanels, panel_values, [&](int64_t u, int64_t t, const uint16_t* panels,
                                                 const uint16_t* next) {
    for_blocks(p.start[u], p.start[u + 1], kDownRows, [&](int64_t r, int64_t rows) {
      folio::multiply_tiles_upto<kDownPanels, kDownRows>(
          kDownPanels, rows, h + r * inter, inter, panels, panel_values, inter / 2, next,
          StoreDown{p.y + r * hidden + t * kPanel, hidden});
    });
  });
}

#pragma GCC pop_options
}  // namespace folio_moe_bf16_pairs

namespace folio_moe_avx2 {

using Vec = __m256;
constexpr int kLanes = 8;
// 2 rows x (gate, up) x 2 halves: 8 sums, 4 weight vectors and a broadcast of 16 registers.
constexpr int kGateUpRows = 2;
// 4 rows x 1 panel (2 halves): 8 sums, 2 weight vectors and a broadcast.
constexpr int kDownRows = 4;
constexpr int kDownPanels = 1;

inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec broadcast(float v) { return _mm256_set1_ps(v); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec load(const uint16_t* p) { return folio::load8_bf16(p); }  // 8 bfloat16 values
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }

// As the AVX-512 one, 2^n built in the exponent's bits (n is within [-126, 127] after the
// clamp).
inline Vec silu_mul(Vec g, Vec u) {
  const Vec x = _mm256_max_ps(_mm256_min_ps(_mm256_sub_ps(zero(), g), broadcast(88.3762626f)),
                              broadcast(-87.3365447f));
  const Vec n = _mm256_round_ps(_mm256_mul_ps(x, broadcast(1.44269504f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  Vec r = _mm256_fnmadd_ps(n, broadcast(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, broadcast(-2.12194440e-4f), r);
  Vec e = broadcast(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    e = fma(e, r, broadcast(c));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  e = _mm256_mul_ps(e, _mm256_castsi256_ps(bits));
  return _mm256_div_ps(_mm256_mul_ps(g, u), _mm256_add_ps(broadcast(1.0f), e));
}

#include "cpu_moe_body.h"

}  // namespace folio_moe_avx2

namespace {

// gate_ups [2I, hidden] (gate rows, then up rows) and downs [hidden, I], one of each per
// expert, all float32 or all bfloat16 -> the panels folio_moe::experts reads, of that dtype (the
// header says their layout); with `pairs` (bfloat16, an even hidden size), each step of a panel
// two inputs of each column, interleaved, as vdpbf16ps reads them.
std::tuple<at::Tensor, at::Tensor> pack_experts(const std::vector<at::Tensor>& gate_ups,
                                                const std::vector<at::Tensor>& downs,
                                                bool pairs) {
  TORCH_CHECK(!gate_ups.empty() && gate_ups.size() == downs.size(),
              "folio_moe::pack_experts: one gate_up and one down per expert, at least one");
  const int64_t experts = static_cast<int64_t>(gate_ups.size());
  const int64_t inter = gate_ups[0].size(0) / 2, hidden = gate_ups[0].size(1);
  const auto dtype = gate_ups[0].scalar_type();
  for (int64_t e = 0; e < experts; ++e) {
    const at::Tensor &a = gate_ups[e], &b = downs[e];
    TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu() && a.scalar_type() == dtype &&
                    b.scalar_type() == dtype &&
                    (dtype == at::kFloat || dtype == at::kBFloat16),
                "folio_moe::pack_experts: the experts' weights must be all float32 or all "
                "bfloat16, on the CPU");
    TORCH_CHECK(a.dim() == 2 && a.size(0) == 2 * inter && a.size(1) == hidden && b.dim() == 2 &&
                    b.size(0) == hidden && b.size(1) == inter,
                "folio_moe::pack_experts: expert ", e, " has gate_up ", a.sizes(), " and down ",
                b.sizes(), ", expected [", 2 * inter, ", ", hidden, "] and [", hidden, ", ",
                inter, "]");
  }
  TORCH_CHECK(inter > 0 && hidden > 0, "folio_moe::pack_experts: empty experts");
  TORCH_CHECK(!pairs || (dtype == at::kBFloat16 && hidden % 32 == 0 && inter % 32 == 0),
              "folio_moe::pack_experts: pairs need bfloat16 weights and sizes that are "
              "multiples of 32");
  const int64_t step = pairs ? 2 : 1;  // inputs of a column per step
  const int64_t up_panels = (inter + kPanel - 1) / kPanel, padded = up_panels * kPanel;
  const int64_t down_panels = (hidden + kPanel - 1) / kPanel;
  const auto options = gate_ups[0].options();
  at::Tensor gate_up =
      at::zeros({experts, up_panels, hidden / step, 2 * kPanel * step}, options);
  at::Tensor down = at::zeros({experts, down_panels, padded / step, kPanel * step}, options);
  // Values moved as they are (float32 or bfloat16's 16 bits).
  auto pack = [&](auto tag) {
    using T = decltype(tag);
    at::parallel_for(0, experts, 1, [&](int64_t begin, int64_t end) {
      for (int64_t e = begin; e < end; ++e) {
        const at::Tensor a = gate_ups[e].contiguous(), b = downs[e].contiguous();
        const T* w13 = static_cast<const T*>(a.data_ptr());
        const T* w2 = static_cast<const T*>(b.data_ptr());
        T* to = static_cast<T*>(gate_up.data_ptr()) + e * up_panels * hidden * 2 * kPanel;
        // Input k of column c lies at step k / step, place c * step + k % step of the panel
        // (the up columns kPanel * step further).
        for (int64_t i = 0; i < inter; ++i) {
          const int64_t j = i / kPanel, c = i % kPanel;
          for (int64_t k = 0; k < hidden; ++k) {
            T* at = to + (j * hidden + k - k % step) * 2 * kPanel + c * step + k % step;
            at[0] = w13[i * hidden + k];
            at[kPanel * step] = w13[(inter + i) * hidden + k];
          }
        }
        to = static_cast<T*>(down.data_ptr()) + e * down_panels * padded * kPanel;
        for (int64_t o = 0; o < hidden; ++o) {
          const int64_t t = o / kPanel, c = o % kPanel;
          for (int64_t k = 0; k < inter; ++k)
            to[(t * padded + k - k % step) * kPanel + c * step + k % step] = w2[o * inter + k];
        }
      }
    });
  };
  if (dtype == at::kFloat) {
    pack(float{});
  } else {
    pack(uint16_t{});
  }
  return {gate_up, down};
}

at::Tensor experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids,
                   const at::Tensor& gate_up, const at::Tensor& down, int64_t first_expert,
                   bool allow_avx512) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "folio_moe::experts: x must be float32 or bfloat16, got ", x.scalar_type());
  const auto weight_type = gate_up.scalar_type();
  TORCH_CHECK(gate_up.device().is_cpu() && down.device().is_cpu() &&
                  (weight_type == at::kFloat || weight_type == at::kBFloat16) &&
                  down.scalar_type() == weight_type && gate_up.is_contiguous() &&
                  down.is_contiguous() && gate_up.dim() == 4 && down.dim() == 4,
              "folio_moe::experts: gate_up and down must come from folio_moe::pack_experts");
  const int64_t hidden = x.size(1), local = gate_up.size(0);
  const int64_t inter = gate_up.size(1) * kPanel;
  // pack_experts' pairs: two inputs of a column per step.
  const int64_t step = gate_up.size(3) / (2 * kPanel);
  TORCH_CHECK((step == 1 || step == 2) && gate_up.size(2) * step == hidden &&
                  gate_up.size(3) == 2 * kPanel * step && down.size(0) == local &&
                  down.size(1) == (hidden + kPanel - 1) / kPanel &&
                  down.size(2) * step == inter && down.size(3) == kPanel * step,
              "folio_moe::experts: packed weights gate_up ", gate_up.sizes(), " and down ",
              down.sizes(), " do not fit ", hidden, " features");
  const bool pair_steps = step == 2;
  const bool amx = pair_steps && allow_avx512 && amx_usable();
  TORCH_CHECK(!pair_steps || amx ||
                  (allow_avx512 && folio::cpu_has_avx512_bf16() &&
                   x.scalar_type() == at::kBFloat16),
              "folio_moe::experts: weights packed in pairs need AMX, or bfloat16 activations "
              "on a CPU with AVX-512 BF16 (allowed: allow_avx512)");
  auto [counts, pairs, rows] = route(x, ids, first_expert, local);
  const int64_t pair_count = rows.size(0);
  if (pair_count == 0) return at::zeros({x.size(0), hidden}, x.options());
  // The codes over pairs read the rows as they are (and keep silu(gate) * up their own way).
  const at::Tensor wide_rows = pair_steps ? rows : rows.to(at::kFloat);
  const auto float32 = x.options().dtype(at::kFloat);
  at::Tensor h = at::empty({pair_steps ? 0 : pair_count, inter}, float32);
  at::Tensor y = at::empty({pair_count, hidden}, float32);
  ExpertProblem problem{pair_steps ? nullptr : wide_rows.data_ptr<float>(), h.data_ptr<float>(),
                        y.data_ptr<float>(), hidden, gate_up, down, {}, {0}};
  const int64_t* count = counts.data_ptr<int64_t>();
  for (int64_t e = 0; e < local; ++e) {
    if (count[e] == 0) continue;
    problem.used.push_back(e);
    problem.start.push_back(problem.start.back() + count[e]);
  }
  const bool avx512 = allow_avx512 && cpu_has_avx512();
  if (amx) {
    folio_moe_amx::run_experts(problem, wide_rows);
  } else if (pair_steps) {
    folio_moe_bf16_pairs::run_experts(problem, wide_rows);
  } else if (weight_type == at::kFloat) {
    avx512 ? folio_moe_avx512::run_experts<float>(problem)
           : folio_moe_avx2::run_experts<float>(problem);
  } else {
    avx512 ? folio_moe_avx512::run_experts<uint16_t>(problem)
           : folio_moe_avx2::run_experts<uint16_t>(problem);
  }
  return combine({y.to(x.scalar_type())}, pairs, weights, x.size(0));
}

}  // namespace

TORCH_LIBRARY(folio_moe, library) {
  library.def(
      "route(Tensor x, Tensor ids, int first_expert, int num_local) -> (Tensor, Tensor, Tensor)");
  library.def("combine(Tensor[] outputs, Tensor pairs, Tensor weights, int tokens) -> Tensor");
  library.def(
      "pack_experts(Tensor[] gate_ups, Tensor[] downs, bool pairs=False) -> (Tensor, Tensor)");
  library.def("amx_usable() -> bool", &amx_usable);  // asked at load, before packing
  library.def(
      "experts(Tensor x, Tensor weights, Tensor ids, Tensor gate_up, Tensor down, "
      "int first_expert, bool allow_avx512) -> Tensor");
}

TORCH_LIBRARY_IMPL(folio_moe, CPU, library) {
  library.impl("route", &route);
  library.impl("combine", &combine);
  library.impl("pack_experts", &pack_experts);
  library.impl("experts", &experts);
}
