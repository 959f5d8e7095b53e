// Dense linears on x86 CPUs, as ops of Folio's own that compiled decode programs call as they
// are (inductor lowers oneDNN's linear op only for weights it froze into the program itself,
// while Folio's weights are the model's, prepared once at load):
//
// - packed_linear: over a weight prepacked by oneDNN (torch.ops.mkldnn._reorder_linear_weight);
//   it only forwards to oneDNN's linear.
// - bf16_linear: bfloat16 products on CPUs with AVX-512 BF16, over a weight in tiles of 16
//   output rows with each row's input features in pairs (pack_bf16_weight), the layout of the
//   vdpbf16ps instruction: one 64-byte load of a tile and one broadcast pair of activations give
//   16 outputs two multiply-adds each, summed in float32, with no horizontal sums. Each thread
//   streams its share of the tiles once per block of activation rows, which is what a step of a
//   few rows needs (oneDNN's bfloat16 kernels read these small weights at ~15-20 GB/s there).
//
// Choosing between them, and packing, is engine/models/llama.py's job.

#include <immintrin.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

// Only these functions use AVX-512: the rest of the extension must run on AVX2-only CPUs.
#define FOLIO_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

namespace {

// x [..., in] @ weight.T (+ bias) for a weight [out, in] in oneDNN's packed layout.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle linear =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias, std::string("none"),
                          c10::List<std::optional<at::Scalar>>(), std::string("")};
  linear.callBoxed(&stack);
  return stack.back().toTensor();
}

constexpr int64_t kTileRows = 16;  // output rows of a tile: one vector of float32 sums
// A block of 2 tiles x 8 activation rows (16 sums in registers) measured best from 4 rows up
// (against 4 x 4, 3 x 8, 4 x 6, 1 x 16, 2 x 12 on the default model's shapes) and no worse at 1.
constexpr int kTilesPerBlock = 2;  // tiles a thread multiplies together
constexpr int kRowsPerBlock = 8;   // activation rows multiplied together

bool cpu_has_avx512_bf16() {
  static const bool supported = __builtin_cpu_supports("avx512bf16") &&
                                __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vl");
  return supported;
}

// weight [out, in] bfloat16, in even -> [ceil(out / 16), in / 2, 32]: tile t, pair p holds
// (weight[16 t + j][2 p], weight[16 t + j][2 p + 1]) for j < 16; rows past `out` are zero.
at::Tensor pack_bf16_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "pack_bf16_weight takes a 2-d bfloat16 weight");
  const int64_t out = weight.size(0), in = weight.size(1);
  TORCH_CHECK(in % 2 == 0, "pack_bf16_weight needs an even number of input features, got ", in);
  const int64_t tiles = (out + kTileRows - 1) / kTileRows;
  at::Tensor packed = at::zeros({tiles, in / 2, 2 * kTileRows}, weight.options());
  const at::Tensor w = weight.contiguous();
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  for (int64_t o = 0; o < out; ++o) {
    const int64_t t = o / kTileRows, j = o % kTileRows;
    for (int64_t p = 0; p < in / 2; ++p) {
      uint16_t* pair = dst + (t * (in / 2) + p) * 2 * kTileRows + 2 * j;
      pair[0] = src[o * in + 2 * p];
      pair[1] = src[o * in + 2 * p + 1];
    }
  }
  return packed;
}

struct Bf16Product {
  const uint16_t* x;  // [rows, in] activations
  int64_t x_row;      // their row stride
  const uint16_t* w;  // packed tiles
  int64_t pairs;      // in / 2
  const uint16_t* bias;
  uint16_t* y;  // [rows, out]
  int64_t out;
  int64_t rows;
};

// Rows m0 .. m0 + ROWS of tiles t0 .. t0 + TILES.
template <int TILES, int ROWS>
FOLIO_AVX512_BF16 void multiply_block(const Bf16Product& a, int64_t t0, int64_t m0) {
  __m512 acc[ROWS][TILES];
  for (int m = 0; m < ROWS; ++m)
    for (int n = 0; n < TILES; ++n) acc[m][n] = _mm512_setzero_ps();
  const int64_t tile_values = a.pairs * 2 * kTileRows;
  const uint16_t* w = a.w + t0 * tile_values;
  const uint16_t* x = a.x + m0 * a.x_row;
  // Rows past the first block reread these tiles from L2; meanwhile the next tiles come in.
  const uint16_t* next = m0 + ROWS < a.rows ? w + TILES * tile_values : nullptr;
  for (int64_t p = 0; p < a.pairs; ++p) {
    if (next != nullptr)
      for (int n = 0; n < TILES; ++n)
        _mm_prefetch(reinterpret_cast<const char*>(next + n * tile_values + p * 2 * kTileRows),
                     _MM_HINT_T1);
    __m512bh tile[TILES];
    for (int n = 0; n < TILES; ++n)
      tile[n] = (__m512bh)_mm512_loadu_si512(w + n * tile_values + p * 2 * kTileRows);
    for (int m = 0; m < ROWS; ++m) {
      int32_t pair;
      __builtin_memcpy(&pair, x + m * a.x_row + 2 * p, sizeof(pair));
      const __m512bh activations = (__m512bh)_mm512_set1_epi32(pair);
      for (int n = 0; n < TILES; ++n)
        acc[m][n] = _mm512_dpbf16_ps(acc[m][n], tile[n], activations);
    }
  }
  for (int n = 0; n < TILES; ++n) {
    const int64_t first = (t0 + n) * kTileRows;
    const int64_t valid = std::min<int64_t>(kTileRows, a.out - first);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
    __m512 bias = _mm512_setzero_ps();
    if (a.bias != nullptr) {
      const __m256i halves = _mm256_maskz_loadu_epi16(mask, a.bias + first);
      bias = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
    }
    for (int m = 0; m < ROWS; ++m) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_add_ps(acc[m][n], bias));
      _mm256_mask_storeu_epi16(a.y + (m0 + m) * a.out + first, mask, (__m256i)rounded);
    }
  }
}

// multiply_block for `rows` (1 to ROWS) rows, each count its own unrolled code.
template <int TILES, int ROWS = kRowsPerBlock>
void multiply_rows(const Bf16Product& a, int64_t t0, int64_t m0, int64_t rows) {
  if constexpr (ROWS > 1) {
    if (rows < ROWS) return multiply_rows<TILES, ROWS - 1>(a, t0, m0, rows);
  }
  multiply_block<TILES, ROWS>(a, t0, m0);
}

template <int TILES = kTilesPerBlock>
void multiply_tiles(const Bf16Product& a, int64_t tiles, int64_t t0, int64_t m0, int64_t rows) {
  if constexpr (TILES > 1) {
    if (tiles < TILES) return multiply_tiles<TILES - 1>(a, tiles, t0, m0, rows);
  }
  multiply_rows<TILES>(a, t0, m0, rows);
}

// x [..., in] bfloat16 @ weight.T (+ bias [out]) -> [..., out] bfloat16, for a weight packed by
// pack_bf16_weight with `out` real output rows.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed,
                       const std::optional<at::Tensor>& bias, int64_t out) {
  TORCH_CHECK(cpu_has_avx512_bf16(), "bf16_linear needs a CPU with AVX-512 BF16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "bf16_linear multiplies bfloat16 activations by a bfloat16 weight");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 2 * kTileRows && packed.is_contiguous() &&
                  packed.size(0) * kTileRows >= out && packed.size(0) * kTileRows < out + kTileRows,
              "bf16_linear's weight must come from pack_bf16_weight, with ", out, " outputs");
  const int64_t in = 2 * packed.size(1);
  TORCH_CHECK(x.size(-1) == in, "bf16_linear: activations have ", x.size(-1),
              " features, the weight ", in);
  const at::Tensor flat = x.reshape({-1, in});
  TORCH_CHECK(flat.stride(1) == 1, "bf16_linear: each activation row must be contiguous");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out;
  at::Tensor y = at::empty(shape, x.options());
  const int64_t rows = flat.size(0);
  if (rows == 0) return y;
  at::Tensor bias_values;
  if (bias.has_value()) {
    bias_values = bias->contiguous();
    TORCH_CHECK(bias_values.scalar_type() == at::kBFloat16 && bias_values.numel() == out,
                "bf16_linear: the bias must be bfloat16 with one value per output");
  }
  const Bf16Product a{reinterpret_cast<const uint16_t*>(flat.data_ptr<at::BFloat16>()),
                      flat.stride(0),
                      reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()),
                      in / 2,
                      bias.has_value()
                          ? reinterpret_cast<const uint16_t*>(bias_values.data_ptr<at::BFloat16>())
                          : nullptr,
                      reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()),
                      out,
                      rows};
  const int64_t tiles = packed.size(0);
  const int64_t blocks = (tiles + kTilesPerBlock - 1) / kTilesPerBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t t0 = block * kTilesPerBlock;
      const int64_t count = std::min<int64_t>(kTilesPerBlock, tiles - t0);
      for (int64_t m0 = 0; m0 < rows; m0 += kRowsPerBlock)
        multiply_tiles(a, count, t0, m0, std::min<int64_t>(kRowsPerBlock, rows - m0));
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(folio_linear, library) {
  library.def("packed_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  library.def("bf16_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  library.def("pack_bf16_weight(Tensor weight) -> Tensor");
  library.def("cpu_has_avx512_bf16() -> bool", &cpu_has_avx512_bf16);
}

// The packed weight is a oneDNN tensor, so calls dispatch on its key.
TORCH_LIBRARY_IMPL(folio_linear, MkldnnCPU, library) {
  library.impl("packed_linear", &packed_linear);
}

TORCH_LIBRARY_IMPL(folio_linear, CPU, library) {
  library.impl("bf16_linear", &bf16_linear);
  library.impl("pack_bf16_weight", &pack_bf16_weight);
}
