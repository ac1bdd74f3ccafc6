// Root-mean-square normalization of each row in one pass, as transformers' Llama-family RMSNorm modules compute it:
// weight * (x / sqrt(mean(x^2) + eps)) with the mean and the scaling in float32, the scaled row rounded to the
// input's dtype before the weight multiplies it (products not fused into sums: built with -ffp-contract=off).
// Eager, those modules are seven operations (a conversion, a power, a mean, an addition, a reciprocal square root
// and two products), each a pass over the rows.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

namespace {

template <typename T>
void normalize(const T* x, const T* weight, int64_t rows, int64_t size, double epsilon, T* out) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * size;
      float squares = 0;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < size; ++i) squares += static_cast<float>(row[i]) * static_cast<float>(row[i]);
      const float scale = 1.0f / std::sqrt(squares / static_cast<float>(size) + static_cast<float>(epsilon));
      T* o = out + r * size;
      for (int64_t i = 0; i < size; ++i) {
        const T scaled = static_cast<T>(static_cast<float>(row[i]) * scale);
        o[i] = static_cast<T>(static_cast<float>(weight[i]) * static_cast<float>(scaled));
      }
    }
  });
}

// x [..., D], weight [D] of x's dtype -> [..., D].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double epsilon) {
  TORCH_CHECK(weight.dim() == 1 && x.size(-1) == weight.size(0), "rms_norm: weight [D] for x [..., D]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: x and weight of one dtype");
  at::Tensor rows = x.contiguous(), w = weight.contiguous();
  at::Tensor out = at::empty_like(rows);
  const int64_t size = x.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    normalize<scalar_t>(rows.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), rows.numel() / size, size, epsilon,
                        out.data_ptr<scalar_t>());
  });
  return out;
}

at::Tensor rms_norm_meta(const at::Tensor& x, const at::Tensor&, double) { return at::empty_like(x); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(ACCELGEN_KERNELS_NAMESPACE, library) {
  library.def("rms_norm(Tensor x, Tensor weight, float epsilon) -> Tensor");
}

TORCH_LIBRARY_IMPL(ACCELGEN_KERNELS_NAMESPACE, CPU, library) { library.impl("rms_norm", &rms_norm); }

TORCH_LIBRARY_IMPL(ACCELGEN_KERNELS_NAMESPACE, Meta, library) { library.impl("rms_norm", &rms_norm_meta); }
