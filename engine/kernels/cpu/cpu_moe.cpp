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

// A float32 product and sum rounded one after the other, as torch rounds them: a fused
// multiply-add would round once and change the result's last bits.
#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <tuple>
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

}  // namespace

TORCH_LIBRARY(folio_moe, library) {
  library.def(
      "route(Tensor x, Tensor ids, int first_expert, int num_local) -> (Tensor, Tensor, Tensor)");
  library.def("combine(Tensor[] outputs, Tensor pairs, Tensor weights, int tokens) -> Tensor");
}

TORCH_LIBRARY_IMPL(folio_moe, CPU, library) {
  library.impl("route", &route);
  library.impl("combine", &combine);
}
