// Weight-only quantized matrix products for float32 activations on x86 CPUs with AVX2 and FMA:
// out[m, n] = sum_k x[m, k] * w[n, k], with w stored as int8 per output channel or as 4-bit
// codes in groups of 32 (GGUF Q4_1's scheme: w = code * scale + min). Built for decode-sized
// batches (a few rows): each weight row is read from memory once, converted to float in
// registers and applied to up to four activation rows, so the product runs at the speed of
// reading the (4x or 8x smaller) weights. Parallel over output channels with torch's pool.
// This file only multiplies; quantizing and choosing the kernel is engine/models/quantization.

#include <immintrin.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <vector>

namespace {

constexpr int64_t kGroup = 32;  // int4 group size (engine.models.quantization.INT4_GROUP_SIZE)
// Activation rows sharing one pass over a weight row, each with kChains accumulators (one per
// 8 of 32 consecutive weights) so that FMAs do not wait on each other: 2 x 4 accumulators and
// the 4 converted weight vectors fit AVX2's 16 registers.
constexpr int kTile = 2;
constexpr int kChains = 4;

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Eight int8 weights widened to float.
inline __m256 int8_to_float(const int8_t* p) {
  __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

// Eight unsigned 4-bit codes, one per byte (the low 8 bytes of `bytes`), widened to float.
inline __m256 codes_to_float(__m128i bytes) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
}

// 32 consecutive weights of one row as floats, for k in [i, i + 32).
struct Int8Row {
  const int8_t* w;
  inline void load(int64_t i, __m256 (&wv)[kChains]) const {
    for (int j = 0; j < kChains; ++j) wv[j] = int8_to_float(w + i + 8 * j);
  }
};

struct Int4Row {
  const uint8_t* codes;  // this row's 4-bit codes, two to a byte
  const float* scale;    // this row's per-group scales and minimums
  const float* min;
  inline void load(int64_t i, __m256 (&wv)[kChains]) const {
    const int64_t g = i / kGroup;
    const __m256 sv = _mm256_set1_ps(scale[g]);
    const __m256 mv = _mm256_set1_ps(min[g]);
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i / 2));
    const __m128i low_mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(packed, low_mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low_mask);
    const __m128i first = _mm_unpacklo_epi8(lo, hi);  // codes 0-15 of the group, in order
    const __m128i second = _mm_unpackhi_epi8(lo, hi);  // codes 16-31
    wv[0] = _mm256_fmadd_ps(codes_to_float(first), sv, mv);
    wv[1] = _mm256_fmadd_ps(codes_to_float(_mm_srli_si128(first, 8)), sv, mv);
    wv[2] = _mm256_fmadd_ps(codes_to_float(second), sv, mv);
    wv[3] = _mm256_fmadd_ps(codes_to_float(_mm_srli_si128(second, 8)), sv, mv);
  }
};

// Dot products of one weight row with ROWS activation rows over k in [0, k32), k32 a multiple
// of 32.
template <int ROWS, typename Row>
inline void dot_rows(const Row& row, const float* x, int64_t k, int64_t k32, float* sums) {
  __m256 acc[ROWS][kChains];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < kChains; ++j) acc[r][j] = _mm256_setzero_ps();
  __m256 wv[kChains];
  for (int64_t i = 0; i < k32; i += 8 * kChains) {
    row.load(i, wv);
    for (int r = 0; r < ROWS; ++r)
      for (int j = 0; j < kChains; ++j)
        acc[r][j] = _mm256_fmadd_ps(wv[j], _mm256_loadu_ps(x + r * k + i + 8 * j), acc[r][j]);
  }
  for (int r = 0; r < ROWS; ++r) {
    sums[r] = horizontal_sum(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]),
                                           _mm256_add_ps(acc[r][2], acc[r][3])));
  }
}

// out[m, n] for every activation row m of one weight row n, tiles of kTile activation rows.
template <typename Row>
inline void one_weight_row(const Row& row, const float* x, int64_t m, int64_t k, int64_t k32,
                           float* sums) {
  int64_t m0 = 0;
  for (; m0 + kTile <= m; m0 += kTile) dot_rows<kTile>(row, x + m0 * k, k, k32, sums + m0);
  if (m0 < m) dot_rows<1>(row, x + m0 * k, k, k32, sums + m0);
}

void check_inputs(const at::Tensor& x, const at::Tensor& w, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 matrix");
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " columns, the weight ", k);
  TORCH_CHECK(w.is_contiguous(), "the weight must be contiguous");
}

// Runs `fill(row, sums)` for every output channel in parallel and writes out[:, row].
template <typename Fill>
at::Tensor for_each_output(const at::Tensor& x, int64_t n, const Fill& fill) {
  const int64_t m = x.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
  float* os = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(m);
    for (int64_t row = begin; row < end; ++row) {
      fill(row, sums.data());
      for (int64_t r = 0; r < m; ++r) os[r * n + row] = sums[r];
    }
  });
  return out;
}

}  // namespace

// x [M, K] float32, w [N, K] int8, scales [N] float32 -> [M, N] float32.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  const int64_t k = w.size(1), m = x.size(0);
  check_inputs(x, w, k);
  TORCH_CHECK(w.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat &&
                  scales.is_contiguous() && scales.numel() == w.size(0),
              "int8_linear takes int8 weights and float32 scales, one per output channel");
  const float* xs = x.data_ptr<float>();
  const int8_t* ws = w.data_ptr<int8_t>();
  const float* ss = scales.data_ptr<float>();
  const int64_t k32 = k - k % 32;
  return for_each_output(x, w.size(0), [&](int64_t row, float* sums) {
    const int8_t* wr = ws + row * k;
    one_weight_row(Int8Row{wr}, xs, m, k, k32, sums);
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t i = k32; i < k; ++i) sums[r] += xs[r * k + i] * wr[i];
      sums[r] *= ss[row];
    }
  });
}

// x [M, K] float32; codes [N, K/2] uint8 (code k in the low half of byte k/2 when k is even,
// the high half when odd); scale and min [N, K/32] float32 -> [M, N] float32.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                       const at::Tensor& min) {
  const int64_t k = codes.size(1) * 2, n = codes.size(0), m = x.size(0);
  check_inputs(x, codes, k);
  TORCH_CHECK(k % kGroup == 0, "int4 needs input features divisible by ", kGroup);
  TORCH_CHECK(codes.scalar_type() == at::kByte && scale.scalar_type() == at::kFloat &&
                  min.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  min.is_contiguous() && scale.numel() == n * (k / kGroup) &&
                  min.numel() == scale.numel(),
              "int4_linear takes uint8 codes and float32 scales and minimums per group");
  const float* xs = x.data_ptr<float>();
  const uint8_t* cs = codes.data_ptr<uint8_t>();
  const float* scales = scale.data_ptr<float>();
  const float* mins = min.data_ptr<float>();
  const int64_t groups = k / kGroup;
  return for_each_output(x, n, [&](int64_t row, float* sums) {
    Int4Row weights{cs + row * (k / 2), scales + row * groups, mins + row * groups};
    one_weight_row(weights, xs, m, k, k, sums);
  });
}

// Schemas here, kernels for the CPU key only, so torch.compile can trace the ops through the
// shape functions engine/kernels/cpu_quant.py registers.
TORCH_LIBRARY(folio_quant, library) {
  library.def("int8_linear(Tensor x, Tensor weight, Tensor scales) -> Tensor");
  library.def("int4_linear(Tensor x, Tensor codes, Tensor scale, Tensor min) -> Tensor");
}

TORCH_LIBRARY_IMPL(folio_quant, CPU, library) {
  library.impl("int8_linear", &int8_linear);
  library.impl("int4_linear", &int4_linear);
}
