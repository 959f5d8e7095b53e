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
