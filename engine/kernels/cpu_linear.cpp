// Dense linears over weights prepacked by oneDNN (torch.ops.mkldnn._reorder_linear_weight), as
// an op of Folio's own: torch.compile's inductor lowers oneDNN's linear op only for weights it
// froze into the program itself, while Folio's packed weights are the model's, made once at
// load. Inductor calls this op as it is, from its C++ wrapper. It only forwards to oneDNN's
// linear; choosing to pack is engine/models/llama.py's job.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>

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

}  // namespace

TORCH_LIBRARY(folio_linear, library) {
  library.def("packed_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

// The packed weight is a oneDNN tensor, so calls dispatch on its key.
TORCH_LIBRARY_IMPL(folio_linear, MkldnnCPU, library) {
  library.impl("packed_linear", &packed_linear);
}
