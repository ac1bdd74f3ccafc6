// The int8 product of rows in one operator: each row of x quantized to int8 with a scale of its own (its largest
// magnitude / 127, rounded half to even), multiplied by the int8 weight, the int32 sums scaled back as
// (sums * weight scale) * row scale in float32 and rounded to x's dtype: what plugins/cpu/int8_kernels.py computes
// with _int_mm or oneDNN, to the last bit, in one operator where those take about ten (quantization, product,
// conversions, scalings), each a pass and a dispatch.
//
// The weight is laid out once in panels of 16 outputs (int8_kernels.pack_int8_panels): [ceil(N / 16), ceil(K / 4),
// 16, 4] bytes, each the weight + 128, so that one 64-byte load holds four inputs of 16 outputs. The rows' values
// (signed) go in tiles of 16 rows, four bytes of each row side by side, each broadcast to the 16 outputs. A tile's
// rows share each load of a panel: several rows read the weight once (a decode step's bound is reading it from
// memory), and one row takes several panels at once so that its sums proceed side by side. A row of zeros (a decode
// step's finished row or empty slot: ModelForward's zero_unseen_rows) takes no place in a tile: its product is a row
// of zeros, written as such.
//
// Two builds of the four-byte products, the same int32 sums:
// - AVX-512 VNNI: one instruction adds four unsigned-by-signed byte products to each of 16 sums, the panel's bytes
//   (w + 128) the unsigned operand; since sum_k (w + 128) q = sum_k w q + 128 sum_k q, each row's 128 sum_k q comes
//   off its sums;
// - AVX2 (no VNNI: x86-64-v3, most CPUs): the panel's bytes back to signed w (the sign bit flipped), then the signed
//   products by sign: |q| (unsigned) times w with q's sign, pairs added into 16 bits (vpmaddubsw), pairs of those
//   into 32 (vpmaddwd). No sum of two products leaves 16 bits (127 * 127 * 2 < 32767: the weights and rows are
//   quantized to [-127, 127], int8_layer.quantize_rows and the rows here), so no product saturates: the exact sums.
//   (oneDNN's AVX2 product adds unsigned rows, 255 * 127 * 2, and saturates: int8_kernels refuses it.)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

#include "lanes.h"

#if (defined(ACCELGEN_LANES_AVX512) && defined(__AVX512VNNI__)) || defined(ACCELGEN_LANES_AVX2)
namespace {
using namespace ACCELGEN_KERNELS_NAMESPACE;

constexpr float kLimit = 127.0f;
constexpr float kSmallest = 0x1p-100f;  // the smallest largest magnitude a row takes (int8_kernels._TINY)

constexpr int64_t kOutputs = 16;   // outputs of a panel: 16 int32 sums per row (Sums)
constexpr int64_t kTileRows = 16;  // rows of a tile: their quantized values interleaved four bytes at a time

#if defined(ACCELGEN_LANES_AVX512)
// What comes off a row's sums per unit of the sum of its values: the panels' bytes are unsigned (w + 128)
constexpr int32_t kOffsetPerValue = 128;

struct Sums {  // 16 int32 sums: one register
  __m512i v;
};

// (sums - correction) * scale * row_scale, in float32, in that order
ACCELGEN_INLINE Lanes scaled(Sums sums, int32_t correction, Lanes scale, Lanes row_scale) {
  return Lanes{_mm512_cvtepi32_ps(_mm512_sub_epi32(sums.v, _mm512_set1_epi32(correction)))} * scale * row_scale;
}

// The panels a tile of ``rows`` rows takes at once: 16 registers of sums at most (of AVX-512's 32), 8 for one or two
// rows (the product's latency is hidden by sums that proceed side by side)
constexpr int panels_for(int rows) { return rows <= 2 ? 8 : rows <= 4 ? 4 : rows <= 8 ? 2 : 1; }

// The int32 sums of a tile's first Rows rows times Panels consecutive panels (panel_bytes apart), into
// out[Rows][Panels]: constants, so that every sum stays in a register of its own.
template <int Rows, int Panels>
void tile_sums(const int8_t* tile, const uint8_t* panel, int64_t panel_bytes, int64_t padded, Sums* out) {
  __m512i sums[Rows][Panels];
  for (int m = 0; m < Rows; ++m)
    for (int p = 0; p < Panels; ++p) sums[m][p] = _mm512_setzero_si512();
  for (int64_t k = 0; k < padded; k += 4) {
    __m512i w[Panels];
    for (int p = 0; p < Panels; ++p) w[p] = _mm512_loadu_si512(panel + p * panel_bytes + k * kOutputs);
    const int8_t* values = tile + k * kTileRows;
    for (int m = 0; m < Rows; ++m) {
      const __m512i x = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(values + m * 4));
      for (int p = 0; p < Panels; ++p) sums[m][p] = _mm512_dpbusd_epi32(sums[m][p], w[p], x);
    }
  }
  for (int m = 0; m < Rows; ++m)
    for (int p = 0; p < Panels; ++p) out[m * Panels + p] = Sums{sums[m][p]};
}

#else  // AVX2
constexpr int32_t kOffsetPerValue = 0;  // signed products: nothing comes off

struct Sums {  // 16 int32 sums: two registers
  __m256i low, high;
};

// sums * scale * row_scale, in float32, in that order: the signed products leave no correction (kOffsetPerValue 0)
ACCELGEN_INLINE Lanes scaled(Sums sums, int32_t, Lanes scale, Lanes row_scale) {
  return Lanes{_mm256_cvtepi32_ps(sums.low), _mm256_cvtepi32_ps(sums.high)} * scale * row_scale;
}

// Of AVX2's 16 registers, a block's sums take two a row and panel, each panel's weights two, a row's values and
// their magnitudes two, the ones of vpmaddwd one: one row takes two panels at once (12), more rows one panel, in
// blocks of at most four rows (14), which read the panel from the cache in turn.
constexpr int panels_for(int rows) { return rows == 1 ? 2 : 1; }
constexpr int kBlockRows = 4;

// out += the signed byte products of w and the broadcast row q (its magnitudes |q|), four by four, as int32
ACCELGEN_INLINE __m256i add_products(__m256i sums, __m256i w, __m256i q, __m256i magnitudes, __m256i ones) {
  const __m256i pairs = _mm256_maddubs_epi16(magnitudes, _mm256_sign_epi8(w, q));  // |q| * (w with q's sign)
  return _mm256_add_epi32(sums, _mm256_madd_epi16(pairs, ones));
}

// tile_sums' block of Rows rows (from row First of the tile) times Panels panels.
template <int Rows, int Panels>
ACCELGEN_INLINE void block_sums(const int8_t* tile, int first, const uint8_t* panel, int64_t panel_bytes,
                                int64_t padded, Sums* out) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  __m256i sums[Rows][Panels][2];
  for (int m = 0; m < Rows; ++m)
    for (int p = 0; p < Panels; ++p) sums[m][p][0] = sums[m][p][1] = _mm256_setzero_si256();
  for (int64_t k = 0; k < padded; k += 4) {
    __m256i w[Panels][2];
    for (int p = 0; p < Panels; ++p)
      for (int h = 0; h < 2; ++h)
        w[p][h] = _mm256_xor_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + p * panel_bytes + k * kOutputs + h * 32)),
            flip);
    const int8_t* values = tile + k * kTileRows + first * 4;
    for (int m = 0; m < Rows; ++m) {
      const __m256i q = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(values + m * 4));
      const __m256i magnitudes = _mm256_sign_epi8(q, q);
      for (int p = 0; p < Panels; ++p)
        for (int h = 0; h < 2; ++h) sums[m][p][h] = add_products(sums[m][p][h], w[p][h], q, magnitudes, ones);
    }
  }
  for (int m = 0; m < Rows; ++m)
    for (int p = 0; p < Panels; ++p) out[(first + m) * Panels + p] = Sums{sums[m][p][0], sums[m][p][1]};
}

// The int32 sums of a tile's first Rows rows times Panels consecutive panels (panel_bytes apart), into
// out[Rows][Panels]: blocks of kBlockRows rows, each sum in a register of its own.
template <int Rows, int Panels, int First = 0>
void tile_sums(const int8_t* tile, const uint8_t* panel, int64_t panel_bytes, int64_t padded, Sums* out) {
  constexpr int kRows = std::min(kBlockRows, Rows - First);
  block_sums<kRows, Panels>(tile, First, panel, panel_bytes, padded, out);
  if constexpr (First + kRows < Rows) tile_sums<Rows, Panels, First + kRows>(tile, panel, panel_bytes, padded, out);
}
#endif

// The most Sums a tile's product gives (rows x panels_for(rows))
constexpr int tile_sums_at_most() {
  int most = 0;
  for (int rows = 1; rows <= kTileRows; ++rows) most = std::max(most, rows * panels_for(rows));
  return most;
}
constexpr int kTileSums = tile_sums_at_most();

// A row's largest magnitude, at least kSmallest: its values are quantized by 127 over it, its scale is it over 127.
template <typename T>
float row_largest(const T* row, int64_t size) {
  Lanes largest_lanes = zeros();
  for (int64_t k = 0; k < size; k += kLanes)
    largest_lanes = maximum(largest_lanes, magnitude(load_floats(row + k, size - k)));
  return std::max(largest_of(largest_lanes), kSmallest);
}

// Sixteen values of a row from k on (zeros past its size), each times ``inverse`` (127 / largest) rounded half to
// even (as nearbyint): whole numbers in [-127, 127].
template <typename T>
ACCELGEN_INLINE Lanes whole_numbers(const T* row, int64_t size, int64_t k, Lanes inverse) {
  return nearest_integers(load_floats(row + k, size - k) * inverse);
}

// ``count`` rows of x (K values each; row m at x + rows[m] * K) quantized, signed, into a tile: [K4 / 4][kTileRows][4]
// bytes (K4: K rounded up to 4), the rows past count and the values past K zero; each row's scale and what comes off
// its sums (kOffsetPerValue times the sum of its values). Sixteen values at a time, written four by four, 64 bytes
// apart.
template <typename T>
void quantize_tile(const T* x, const int64_t* rows, int64_t size, int64_t padded, int64_t count, int8_t* tile,
                   float* row_scales, int32_t* corrections) {
  std::fill(tile, tile + padded * kTileRows, 0);
  const int64_t groups = padded / 4;
  for (int64_t m = 0; m < count; ++m) {
    const T* row = x + rows[m] * size;
    const float largest = row_largest(row, size);
    const Lanes inverse = broadcast(kLimit / largest);
    int32_t sum = 0;
    for (int64_t k = 0; k < size; k += kLanes) {
      alignas(64) float integers[kLanes];
      store(whole_numbers(row, size, k, inverse), integers);
      int8_t bytes[kLanes];
      for (int i = 0; i < kLanes; ++i) {
        bytes[i] = static_cast<int8_t>(integers[i]);
        sum += bytes[i];
      }
      for (int64_t q = 0; q < 4 && k / 4 + q < groups; ++q)
        std::memcpy(tile + (k / 4 + q) * kTileRows * 4 + m * 4, bytes + q * 4, 4);
    }
    row_scales[m] = largest / kLimit;
    corrections[m] = kOffsetPerValue * sum;
  }
}

// Lanes of whole numbers in [-127, 127] as bytes plus 128 (the sign bit flipped): the first ``count`` into out.
ACCELGEN_INLINE void store_unsigned_bytes(Lanes whole, uint8_t* out, int64_t count) {
#if defined(ACCELGEN_LANES_AVX512)
  const __m128i bytes = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(whole.v));
  _mm_mask_storeu_epi8(out, first_lanes(count), _mm_xor_si128(bytes, _mm_set1_epi8(static_cast<char>(0x80))));
#else
  alignas(64) float integers[kLanes];
  store(whole, integers);
  for (int64_t i = 0; i < std::min<int64_t>(kLanes, count); ++i)
    out[i] = static_cast<uint8_t>(static_cast<int8_t>(integers[i])) ^ 0x80;
#endif
}

// Each of ``rows`` rows of x (K values) quantized as quantize_tile quantizes it, as oneDNN's product takes rows: the
// values plus 128 (the sign bit flipped) into out [rows, K] uint8, each row's scale into scales [rows].
template <typename T>
void unsigned_rows(const T* x, int64_t rows, int64_t size, uint8_t* out, float* scales) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * size;
      const float largest = row_largest(row, size);
      const Lanes inverse = broadcast(kLimit / largest);
      for (int64_t k = 0; k < size; k += kLanes)
        store_unsigned_bytes(whole_numbers(row, size, k, inverse), out + r * size + k, size - k);
      scales[r] = largest / kLimit;
    }
  });
}

using TileSums = void (*)(const int8_t*, const uint8_t*, int64_t, int64_t, Sums*);

template <int... Counts>
constexpr std::array<TileSums, sizeof...(Counts)> wide_table(std::integer_sequence<int, Counts...>) {
  return {&tile_sums<Counts + 1, panels_for(Counts + 1)>...};
}
template <int... Counts>
constexpr std::array<TileSums, sizeof...(Counts)> narrow_table(std::integer_sequence<int, Counts...>) {
  return {&tile_sums<Counts + 1, 1>...};
}
// tile_sums of 1 to 16 rows (by count - 1), with panels_for(rows) panels and with one
constexpr auto kWide = wide_table(std::make_integer_sequence<int, kTileRows>{});
constexpr auto kNarrow = narrow_table(std::make_integer_sequence<int, kTileRows>{});

// Whether the ``size`` values of ``row`` are all zeros (a NaN is not).
template <typename T>
bool all_zeros(const T* row, int64_t size) {
  for (int64_t k = 0; k < size; ++k)
    if (!(static_cast<float>(row[k]) == 0.0f)) return false;
  return true;
}

template <typename T>
void panels_product(const T* x, int64_t all_rows, int64_t size, const uint8_t* panels, const float* scales,
                    int64_t outputs, T* out) {
  std::vector<int64_t> computed;  // the rows with a value other than zero; the others' products are zeros
  computed.reserve(all_rows);
  for (int64_t r = 0; r < all_rows; ++r) {
    if (all_zeros(x + r * size, size))
      std::fill_n(out + r * outputs, outputs, T(0));
    else
      computed.push_back(r);
  }
  const int64_t rows = static_cast<int64_t>(computed.size());
  if (rows == 0) return;
  const int64_t padded = (size + 3) / 4 * 4, panel_bytes = padded * kOutputs;
  const int64_t panel_count = (outputs + kOutputs - 1) / kOutputs, tiles = (rows + kTileRows - 1) / kTileRows;
  std::vector<int8_t> quantized(tiles * padded * kTileRows);
  std::vector<float> row_scales(tiles * kTileRows);
  std::vector<int32_t> corrections(tiles * kTileRows);
  for (int64_t t = 0; t < tiles; ++t)
    quantize_tile(x, &computed[t * kTileRows], size, padded, std::min(kTileRows, rows - t * kTileRows),
                  &quantized[t * padded * kTileRows], &row_scales[t * kTileRows], &corrections[t * kTileRows]);
  const int group = panels_for(static_cast<int>(std::min(kTileRows, rows)));  // the panels of a thread's unit
  const int64_t units = (panel_count + group - 1) / group;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    Sums sums[kTileSums];  // rows x panels_for(rows)
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t first_panel = unit * group, in_unit = std::min<int64_t>(group, panel_count - first_panel);
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t count = std::min(kTileRows, rows - t * kTileRows);
        const int wide = panels_for(static_cast<int>(count));
        const int8_t* tile = &quantized[t * padded * kTileRows];
        for (int64_t p = 0; p < in_unit;) {  // the unit's panels, as many at once as the tile's rows take
          const int take = wide <= in_unit - p ? wide : 1;
          (take == wide ? kWide : kNarrow)[count - 1](tile, panels + (first_panel + p) * panel_bytes, panel_bytes,
                                                       padded, sums);
          for (int64_t m = 0; m < count; ++m) {
            const int64_t index = t * kTileRows + m, row = computed[index];
            const Lanes row_scale = broadcast(row_scales[index]);
            for (int q = 0; q < take; ++q) {
              const int64_t n = (first_panel + p + q) * kOutputs;
              const Lanes value = scaled(sums[m * take + q], corrections[index], load_floats(scales + n, outputs - n),
                                         row_scale);
              store_floats(value, out + row * outputs + n, outputs - n);
            }
          }
          p += take;
        }
      }
    }
  });
}

// x [..., K] (float32 or bfloat16), panels [ceil(N / 16), ceil(K / 4), 64] uint8 (pack_int8_panels), scales [N]
// float32 -> [..., N], x's dtype.
at::Tensor int8_panels_linear(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scales) {
  const int64_t size = x.size(-1), outputs = scales.numel(), rows = x.numel() / size;
  TORCH_CHECK(panels.scalar_type() == at::kByte && panels.is_contiguous() && panels.dim() == 3 &&
                  panels.size(0) == (outputs + 15) / 16 && panels.size(1) == (size + 3) / 4 && panels.size(2) == 64,
              "int8_panels_linear: panels [ceil(N / 16), ceil(K / 4), 64] uint8 for x [..., K] and scales [N]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous(), "int8_panels_linear: scales [N] float32");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "int8_panels_linear: x float32 or bfloat16");
  at::Tensor flat = x.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = outputs;
  at::Tensor out = at::empty(shape, x.options());
  if (x.scalar_type() == at::kFloat) {
    panels_product<float>(flat.data_ptr<float>(), rows, size, panels.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                          outputs, out.data_ptr<float>());
  } else {
    panels_product<at::BFloat16>(flat.data_ptr<at::BFloat16>(), rows, size, panels.data_ptr<uint8_t>(),
                                 scales.data_ptr<float>(), outputs, out.data_ptr<at::BFloat16>());
  }
  return out;
}

// x [..., K] (float32 or bfloat16) -> (values [..., K] uint8: each row quantized to int8, plus 128; scales [..., 1]
// float32): int8_kernels.quantize_unsigned_rows's, in one pass.
std::tuple<at::Tensor, at::Tensor> quantize_rows_unsigned(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quantize_rows_unsigned: x [..., K] float32 or bfloat16");
  const int64_t size = x.size(-1), rows = size ? x.numel() / size : 0;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  at::Tensor flat = x.contiguous();
  at::Tensor values = at::empty(shape, x.options().dtype(at::kByte));
  shape.back() = 1;
  at::Tensor scales = at::empty(shape, x.options().dtype(at::kFloat));
  if (x.scalar_type() == at::kFloat)
    unsigned_rows<float>(flat.data_ptr<float>(), rows, size, values.data_ptr<uint8_t>(), scales.data_ptr<float>());
  else
    unsigned_rows<at::BFloat16>(flat.data_ptr<at::BFloat16>(), rows, size, values.data_ptr<uint8_t>(),
                                scales.data_ptr<float>());
  return {values, scales};
}

std::tuple<at::Tensor, at::Tensor> quantize_rows_unsigned_meta(const at::Tensor& x) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  at::Tensor values = at::empty(shape, x.options().dtype(at::kByte));
  shape.back() = 1;
  return {values, at::empty(shape, x.options().dtype(at::kFloat))};
}

at::Tensor int8_panels_linear_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor& scales) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = scales.numel();
  return at::empty(shape, x.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ACCELGEN_KERNELS_NAMESPACE, library) {
  library.def("int8_panels_linear(Tensor x, Tensor panels, Tensor scales) -> Tensor");
  library.def("quantize_rows_unsigned(Tensor x) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(ACCELGEN_KERNELS_NAMESPACE, CPU, library) {
  library.impl("int8_panels_linear", &int8_panels_linear);
  library.impl("quantize_rows_unsigned", &quantize_rows_unsigned);
}

TORCH_LIBRARY_IMPL(ACCELGEN_KERNELS_NAMESPACE, Meta, library) {
  library.impl("int8_panels_linear", &int8_panels_linear_meta);
  library.impl("quantize_rows_unsigned", &quantize_rows_unsigned_meta);
}

#endif  // AVX-512 VNNI or AVX2: where the compiler's target has neither, the operator is not defined
