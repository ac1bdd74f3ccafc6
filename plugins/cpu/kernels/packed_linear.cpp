// oneDNN's product over a weight packed once in its blocked layout (packed_linear.py), as an operator that a compiled
// step's C++ wrapper calls directly.
//
// A packed weight is an opaque oneDNN tensor, which inductor takes neither as an input nor as a constant, so a
// compiled step names it by a number. Through a Python operator that finds it by that number, each product of a
// compiled step went back into Python and cost about 20 us more than the product itself. Here the weights are kept
// by number in C++: weakly, so that a packed weight lives as long as its layer holds it, not as long as the process.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <mutex>
#include <optional>
#include <vector>

namespace {

using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

std::mutex& kept_lock() {
  static std::mutex lock;
  return lock;
}

std::vector<WeakTensor>& kept() {
  static std::vector<WeakTensor> weights;
  return weights;
}

// Keep ``packed`` (weakly) under a new number, which packed_linear takes.
int64_t keep_packed(const at::Tensor& packed) {
  std::lock_guard<std::mutex> guard(kept_lock());
  kept().emplace_back(packed.getIntrusivePtr());
  return static_cast<int64_t>(kept().size()) - 1;
}

at::Tensor find_packed(int64_t number) {
  std::lock_guard<std::mutex> guard(kept_lock());
  TORCH_CHECK(number >= 0 && number < static_cast<int64_t>(kept().size()), "packed_linear: no packed weight ", number);
  auto strong = kept()[number].lock();
  TORCH_CHECK(strong, "packed_linear: packed weight ", number, " was freed with its layer");
  return at::Tensor(std::move(strong));
}

// x [..., in] times the packed weight ``number`` [out, in], plus ``bias``: [..., out], as
// mkldnn::_linear_pointwise(x, weight, bias, "none", [], None) gives it.
at::Tensor packed_linear(const at::Tensor& x, int64_t number, int64_t out_features, const std::optional<at::Tensor>& bias) {
  static const auto product =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "").typed<at::Tensor(
          const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
          c10::List<std::optional<c10::Scalar>>, std::optional<c10::string_view>)>();
  at::Tensor result = product.call(x, find_packed(number), bias, "none", c10::List<std::optional<c10::Scalar>>(),
                                   std::nullopt);
  TORCH_CHECK(result.size(-1) == out_features, "packed_linear: weight ", number, " gives ", result.size(-1),
              " outputs, not ", out_features);
  return result;
}

at::Tensor packed_linear_meta(const at::Tensor& x, int64_t, int64_t out_features, const std::optional<at::Tensor>&) {
  auto sizes = x.sizes().vec();
  sizes.back() = out_features;
  return at::empty(sizes, x.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ACCELGEN_KERNELS_NAMESPACE, library) {
  library.def("keep_packed(Tensor packed) -> int", &keep_packed);
  library.def("packed_linear(Tensor x, int number, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(ACCELGEN_KERNELS_NAMESPACE, CPU, library) { library.impl("packed_linear", &packed_linear); }

TORCH_LIBRARY_IMPL(ACCELGEN_KERNELS_NAMESPACE, Meta, library) { library.impl("packed_linear", &packed_linear_meta); }
