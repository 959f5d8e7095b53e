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
//   few rows needs (oneDNN's bfloat16 kernels read these small weights well below the
//   machine's bandwidth there: docs/quantization.md).
// - widened_bf16_linear: float32 activations times the same tiles on any CPU with AVX2 and FMA,
//   which have no bfloat16 arithmetic: a bfloat16 value is the upper half of a float32, so each
//   32-byte load of a tile's pair, shifted (the even inputs) or masked (the odd ones), gives 8
//   output rows' weights as float32, exactly, for plain float32 multiply-adds. The weight keeps
//   half float32's bytes and exactly a bfloat16 checkpoint's values; the products are float32's.
//
// Choosing between them, and packing, is engine/models/llama.py's job.

#include <immintrin.h>
#include "bf16_tiles.h"
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

using folio::kTileRows;

// A block of 2 tiles x 8 activation rows (16 sums in registers) measured best from 4 rows up
// (against 4 x 4, 3 x 8, 4 x 6, 1 x 16, 2 x 12 on the default model's shapes) and no worse at 1.
constexpr int kTilesPerBlock = 2;  // tiles a thread multiplies together
constexpr int kRowsPerBlock = 8;   // activation rows multiplied together

bool cpu_has_avx512_bf16() { return folio::cpu_has_avx512_bf16(); }

// weight [out, in] bfloat16, in even -> [ceil(out / 16), in / 2, 32] (bf16_tiles.h's tiles);
// rows past `out` are zero.
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

// Output rows m0 + m, tiles t0 + n: plus the bias, rounded to bfloat16, the tile's valid
// columns stored.
struct StoreOutputs {
  uint16_t* y;
  int64_t out;
  const uint16_t* bias;
  int64_t m0, t0;
  FOLIO_AVX512_BF16 void operator()(int m, int n, __m512 sums) const {
    const int64_t first = (t0 + n) * kTileRows;
    const int64_t valid = std::min<int64_t>(kTileRows, out - first);
    if (bias != nullptr) sums = _mm512_add_ps(sums, folio::load_bf16(bias + first, valid));
    folio::store_bf16(y + (m0 + m) * out + first, sums, valid);
  }
};

// What every product over pack_bf16_weight's tiles starts with, checked: the activations x
// [..., in] (of `dtype`) as rows [rows, in], each contiguous; the empty output [..., out] of the
// same dtype; the bias, contiguous (of `dtype`, one value per output; undefined without one).
struct TiledProduct {
  at::Tensor rows, y, bias;
  int64_t in;
};

TiledProduct start_tiled_product(const char* op, at::ScalarType dtype, const char* dtype_name,
                                 const at::Tensor& x, const at::Tensor& packed,
                                 const std::optional<at::Tensor>& bias, int64_t out) {
  TORCH_CHECK(x.scalar_type() == dtype && packed.scalar_type() == at::kBFloat16, op,
              " multiplies ", dtype_name, " activations by a bfloat16 weight");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 2 * kTileRows && packed.is_contiguous() &&
                  packed.size(0) * kTileRows >= out && packed.size(0) * kTileRows < out + kTileRows,
              op, "'s weight must come from pack_bf16_weight, with ", out, " outputs");
  const int64_t in = 2 * packed.size(1);
  TORCH_CHECK(x.size(-1) == in, op, ": activations have ", x.size(-1), " features, the weight ",
              in);
  at::Tensor rows = x.reshape({-1, in});
  TORCH_CHECK(rows.stride(1) == 1, op, ": each activation row must be contiguous");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out;
  at::Tensor bias_values;
  if (bias.has_value()) {
    bias_values = bias->contiguous();
    TORCH_CHECK(bias_values.scalar_type() == dtype && bias_values.numel() == out, op,
                ": the bias must be ", dtype_name, " with one value per output");
  }
  return {rows, at::empty(shape, x.options()), bias_values, in};
}

// x [..., in] bfloat16 @ weight.T (+ bias [out]) -> [..., out] bfloat16, for a weight packed by
// pack_bf16_weight with `out` real output rows.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed,
                       const std::optional<at::Tensor>& bias, int64_t out) {
  TORCH_CHECK(cpu_has_avx512_bf16(), "bf16_linear needs a CPU with AVX-512 BF16");
  const TiledProduct product =
      start_tiled_product("bf16_linear", at::kBFloat16, "bfloat16", x, packed, bias, out);
  const at::Tensor &flat = product.rows, &y = product.y, &bias_values = product.bias;
  const int64_t in = product.in, rows = flat.size(0);
  if (rows == 0) return y;
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(flat.data_ptr<at::BFloat16>());
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const uint16_t* bias_data =
      bias.has_value() ? reinterpret_cast<const uint16_t*>(bias_values.data_ptr<at::BFloat16>())
                       : nullptr;
  uint16_t* ys = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t pairs = in / 2, tile_values = pairs * 2 * kTileRows;
  const int64_t tiles = packed.size(0);
  const int64_t blocks = (tiles + kTilesPerBlock - 1) / kTilesPerBlock;
  // Each thread streams its share of the tiles once per block of activation rows: rows past
  // the first block reread them from L2, while the next tiles come in.
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t t0 = block * kTilesPerBlock;
      const int64_t count = std::min<int64_t>(kTilesPerBlock, tiles - t0);
      const uint16_t* tiles_here = w + t0 * tile_values;
      for (int64_t m0 = 0; m0 < rows; m0 += kRowsPerBlock) {
        const int64_t block_rows = std::min<int64_t>(kRowsPerBlock, rows - m0);
        const uint16_t* next = m0 + block_rows < rows ? tiles_here + count * tile_values : nullptr;
        folio::multiply_tiles_upto<kTilesPerBlock, kRowsPerBlock>(
            count, block_rows, xs + m0 * flat.stride(0), flat.stride(0), tiles_here, tile_values,
            pairs, next, StoreOutputs{ys, out, bias_data, m0, t0});
      }
    }
  });
  return y;
}

// Activation rows a widened block multiplies together, each with two 8-row halves of one tile:
// 4 rows are 8 sums, 4 widened weights and 2 broadcasts, 14 of AVX2's 16 registers.
constexpr int kWidenedRows = 4;

// Rows x[m] (m < ROWS, float32, `x_row` apart, `pairs` pairs each) times one tile:
// store(m, low, high) gets row m's float32 sums of output rows 0 .. 8 and 8 .. 16 (handed over,
// not kept in an array: GCC then stored the sums to memory at every step). With one or two rows
// the even and odd inputs' products go to separate sums, so that consecutive multiply-adds do
// not wait on each other. Meanwhile `prefetch` (or nullptr), the next tile a caller will read,
// comes into L2.
template <int ROWS, typename Store>
inline void widened_tile(const float* x, int64_t x_row, const uint16_t* tile, int64_t pairs,
                         const uint16_t* prefetch, const Store& store) {
  constexpr bool kTwoChains = ROWS <= 2;
  // The odd inputs' sums, where they are separate (else unused).
  __m256 acc[ROWS][2], odd_acc[ROWS][2];
  for (int m = 0; m < ROWS; ++m)
    for (int h = 0; h < 2; ++h) acc[m][h] = odd_acc[m][h] = _mm256_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* at = tile + p * 2 * kTileRows;
    if (prefetch != nullptr)
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + p * 2 * kTileRows), _MM_HINT_T1);
    __m256 even[2], odd[2];
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      // Lane j: the pair (w[8 h + j][2 p], w[8 h + j][2 p + 1]), the first in the low half.
      folio::widen_pairs(at + 16 * h, even[h], odd[h]);
    }
#pragma GCC unroll 8
    for (int m = 0; m < ROWS; ++m) {
      const __m256 x_even = _mm256_broadcast_ss(x + m * x_row + 2 * p);
      const __m256 x_odd = _mm256_broadcast_ss(x + m * x_row + 2 * p + 1);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        acc[m][h] = _mm256_fmadd_ps(even[h], x_even, acc[m][h]);
        if constexpr (kTwoChains)
          odd_acc[m][h] = _mm256_fmadd_ps(odd[h], x_odd, odd_acc[m][h]);
        else
          acc[m][h] = _mm256_fmadd_ps(odd[h], x_odd, acc[m][h]);
      }
    }
  }
  for (int m = 0; m < ROWS; ++m) {
    if constexpr (kTwoChains)
      store(m, _mm256_add_ps(acc[m][0], odd_acc[m][0]), _mm256_add_ps(acc[m][1], odd_acc[m][1]));
    else
      store(m, acc[m][0], acc[m][1]);
  }
}

// widened_tile for `rows` (1 to kWidenedRows) rows, each count its own unrolled code; the
// float32 sums of row m, output (tile) column j, plus the bias, go to y[m * out + j] for the
// `valid` columns of the tile.
template <int ROWS = kWidenedRows>
inline void widened_rows(int64_t rows, const float* x, int64_t x_row, const uint16_t* tile,
                         int64_t pairs, const uint16_t* prefetch, const float* bias,
                         int64_t valid, float* y, int64_t out) {
  if constexpr (ROWS > 1) {
    if (rows < ROWS)
      return widened_rows<ROWS - 1>(rows, x, x_row, tile, pairs, prefetch, bias, valid, y, out);
  }
  widened_tile<ROWS>(x, x_row, tile, pairs, prefetch, [&](int m, __m256 low, __m256 high) {
    float values[kTileRows];
    _mm256_storeu_ps(values, low);
    _mm256_storeu_ps(values + 8, high);
    for (int64_t j = 0; j < valid; ++j)
      y[m * out + j] = bias == nullptr ? values[j] : values[j] + bias[j];
  });
}

// x [..., in] float32 @ weight.T (+ bias [out] float32) -> [..., out] float32, for a bfloat16
// weight packed by pack_bf16_weight with `out` real output rows.
at::Tensor widened_bf16_linear(const at::Tensor& x, const at::Tensor& packed,
                               const std::optional<at::Tensor>& bias, int64_t out) {
  const TiledProduct product =
      start_tiled_product("widened_bf16_linear", at::kFloat, "float32", x, packed, bias, out);
  const at::Tensor &flat = product.rows, &y = product.y, &bias_values = product.bias;
  const int64_t in = product.in, rows = flat.size(0);
  if (rows == 0) return y;
  const float* xs = flat.data_ptr<float>();
  const int64_t x_row = flat.stride(0);
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const float* bias_data = bias.has_value() ? bias_values.data_ptr<float>() : nullptr;
  float* ys = y.data_ptr<float>();
  const int64_t pairs = in / 2, tile_values = pairs * 2 * kTileRows;
  const int64_t tiles = packed.size(0);
  // Each thread streams its share of the tiles once per block of activation rows: rows past the
  // first block reread a tile from L1 or L2, while the next one comes in.
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* tile = w + t * tile_values;
      const int64_t first = t * kTileRows;
      const int64_t valid = std::min<int64_t>(kTileRows, out - first);
      for (int64_t m0 = 0; m0 < rows; m0 += kWidenedRows) {
        const int64_t block_rows = std::min<int64_t>(kWidenedRows, rows - m0);
        const uint16_t* next = m0 == 0 && t + 1 < end ? tile + tile_values : nullptr;
        widened_rows(block_rows, xs + m0 * x_row, x_row, tile, pairs, next,
                     bias_data == nullptr ? nullptr : bias_data + first, valid,
                     ys + m0 * out + first, out);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(folio_linear, library) {
  library.def("packed_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  library.def("bf16_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  library.def(
      "widened_bf16_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  library.def("pack_bf16_weight(Tensor weight) -> Tensor");
  library.def("cpu_has_avx512_bf16() -> bool", &cpu_has_avx512_bf16);
}

// The packed weight is a oneDNN tensor, so calls dispatch on its key.
TORCH_LIBRARY_IMPL(folio_linear, MkldnnCPU, library) {
  library.impl("packed_linear", &packed_linear);
}

TORCH_LIBRARY_IMPL(folio_linear, CPU, library) {
  library.impl("bf16_linear", &bf16_linear);
  library.impl("widened_bf16_linear", &widened_bf16_linear);
  library.impl("pack_bf16_weight", &pack_bf16_weight);
}
