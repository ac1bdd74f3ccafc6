// The int8 product of a few rows in one operator, with AVX-512 VNNI's unsigned-by-signed byte products: each row
// of x quantized to int8 with a scale of its own (its largest magnitude / 127, rounded half to even), multiplied by
// the int8 weight, the int32 sums scaled back as (sums * weight scale) * row scale in float32 and rounded to x's
// dtype: what plugins/cpu/int8_kernels.py computes with _int_mm or oneDNN, to the last bit, in one operator where
// those take about ten (quantization, product, conversions, scalings), each a pass and a dispatch.
//
// The weight is the int8 weight as stored ([N, K] row-major). VNNI multiplies unsigned bytes by signed ones: the rows
// go unsigned (q + 128), so sum_k (q + 128) w = sum_k q w + 128 sum_k w, and each output's 128 sum_k w (its
// weight_sums, computed once at load) comes off its sums. Each output reads its weight row once for up to 16 rows
// of x: at one row the product streams the weight from memory, the bound of a decode step at batch 1.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <utility>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace {

constexpr float kLimit = 127.0f;
constexpr int64_t kMaxRows = 16;

// A row of x (K values) quantized to int8 and stored unsigned (+ 128) in q: its scale.
template <typename T>
float quantize_row(const T* x, int64_t size, uint8_t* q) {
  float largest = 0;
  for (int64_t k = 0; k < size; ++k) largest = std::max(largest, std::fabs(static_cast<float>(x[k])));
  largest = std::max(largest, std::numeric_limits<float>::min());
  const float inverse = kLimit / largest;
  for (int64_t k = 0; k < size; ++k)
    q[k] = static_cast<uint8_t>(static_cast<int32_t>(std::nearbyint(static_cast<float>(x[k]) * inverse)) + 128);
  return largest / kLimit;
}

// The int32 sums of ``Rows`` unsigned rows (K values each, one after another in ``rows``) times one weight row w:
// Rows, a constant, lets the compiler keep every row's sums in a register of their own.
template <int Rows>
void row_sums(const uint8_t* rows, int64_t size, const int8_t* w, int32_t* sums_out) {
  const int64_t whole = size / 64 * 64;
  __m512i sums[Rows];
  for (int m = 0; m < Rows; ++m) sums[m] = _mm512_setzero_si512();
  for (int64_t k = 0; k < whole; k += 64) {
    const __m512i wv = _mm512_loadu_si512(w + k);
    for (int m = 0; m < Rows; ++m) sums[m] = _mm512_dpbusd_epi32(sums[m], _mm512_loadu_si512(rows + m * size + k), wv);
  }
  if (whole < size) {
    const __mmask64 tail = ~0ULL >> (64 - (size - whole));
    const __m512i wv = _mm512_maskz_loadu_epi8(tail, w + whole);
    for (int m = 0; m < Rows; ++m)
      sums[m] = _mm512_dpbusd_epi32(sums[m], _mm512_maskz_loadu_epi8(tail, rows + m * size + whole), wv);
  }
  for (int m = 0; m < Rows; ++m) sums_out[m] = _mm512_reduce_add_epi32(sums[m]);
}

using RowSums = void (*)(const uint8_t*, int64_t, const int8_t*, int32_t*);

template <int... Counts>
constexpr std::array<RowSums, sizeof...(Counts)> row_sums_table(std::integer_sequence<int, Counts...>) {
  return {&row_sums<Counts + 1>...};
}

// row_sums of 1 to 16 rows, by count - 1
constexpr auto kRowSums = row_sums_table(std::make_integer_sequence<int, kMaxRows>{});

template <typename T>
void int8_rows_product(const T* x, int64_t rows, int64_t size, const int8_t* weight, const int32_t* weight_sums,
                       const float* scales, int64_t outputs, T* out) {
  std::vector<uint8_t> q(rows * size);
  std::vector<float> row_scales(rows);
  for (int64_t m = 0; m < rows; ++m) row_scales[m] = quantize_row(x + m * size, size, &q[m * size]);
  for (int64_t first = 0; first < rows; first += kMaxRows) {  // up to 16 rows share each load of a weight row
    const int64_t count = std::min(kMaxRows, rows - first);
    const uint8_t* block = &q[first * size];
    const RowSums sums_of = kRowSums[count - 1];
    at::parallel_for(0, outputs, 32, [&](int64_t begin, int64_t end) {
      int32_t sums[kMaxRows];
      for (int64_t n = begin; n < end; ++n) {
        sums_of(block, size, weight + n * size, sums);
        for (int64_t m = 0; m < count; ++m) {
          const int64_t row = first + m;
          const int32_t total = sums[m] - 128 * weight_sums[n];
          out[row * outputs + n] = static_cast<T>(static_cast<float>(total) * scales[n] * row_scales[row]);
        }
      }
    });
  }
}

// x [..., K] (float32 or bfloat16), weight [N, K] int8 (contiguous), weight_sums [N] int32 (each row's sum),
// scales [N] float32 -> [..., N], x's dtype.
at::Tensor int8_rows_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_sums,
                            const at::Tensor& scales) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous(),
              "int8_rows_linear: weight [N, K] int8, contiguous");
  TORCH_CHECK(x.size(-1) == weight.size(1), "int8_rows_linear: x [..., K] for weight [N, K]");
  TORCH_CHECK(weight_sums.scalar_type() == at::kInt && weight_sums.numel() == weight.size(0) && weight_sums.is_contiguous(),
              "int8_rows_linear: weight_sums [N] int32");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == weight.size(0) && scales.is_contiguous(),
              "int8_rows_linear: scales [N] float32");
  const int64_t size = weight.size(1), outputs = weight.size(0), rows = x.numel() / size;
  at::Tensor flat = x.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = outputs;
  at::Tensor out = at::empty(shape, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "int8_rows_linear", [&] {
    int8_rows_product<scalar_t>(flat.data_ptr<scalar_t>(), rows, size, weight.data_ptr<int8_t>(),
                                weight_sums.data_ptr<int32_t>(), scales.data_ptr<float>(), outputs,
                                out.data_ptr<scalar_t>());
  });
  return out;
}

at::Tensor int8_rows_linear_meta(const at::Tensor& x, const at::Tensor& weight, const at::Tensor&, const at::Tensor&) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = weight.size(0);
  return at::empty(shape, x.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(accelgen_cpu_kernels, library) {
  library.def("int8_rows_linear(Tensor x, Tensor weight, Tensor weight_sums, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(accelgen_cpu_kernels, CPU, library) { library.impl("int8_rows_linear", &int8_rows_linear); }

TORCH_LIBRARY_IMPL(accelgen_cpu_kernels, Meta, library) { library.impl("int8_rows_linear", &int8_rows_linear_meta); }

#endif  // AVX-512 VNNI: where the compiler's target lacks it, the operator is not defined
