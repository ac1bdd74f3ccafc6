// The float32 product of rows and a weight laid out once in panels of 16 outputs (packed_linear.pack_float_panels):
// N x K values, each panel holding its 16 outputs' weights input by input ([K][16]), the last one the N % 16 outputs
// left ([K][N % 16]: no padding), so that one 64-byte load holds one input's weights for 16 outputs and one fused
// multiply-add adds a row's product to 16 sums. Each panel's stream asks for its weights a page ahead. The rows go in
// tiles of up to 8 (AVX2: 6); each of a tile's rows is broadcast, input by input, to the panels the tile takes at
// once. A panel is read once for a tile's rows, and the one or two rows of a decode step take eight panels at once, so
// that eight streams of weights are read side by side: one layout serves the single row of a batch-1 decode, whose
// bound is reading the weight from memory, and the 16 rows of a prompt or of a batch, whose bound is the
// multiply-adds, where oneDNN's layouts are each good at one of the two (RESULTS-log.md, "float32 products in panels").
//
// Each output is its inputs' products summed in input order, one fused multiply-add at a time, plus the bias: a
// row's result depends on that row alone, whatever rows share the product.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "lanes.h"

namespace {
using namespace ACCELGEN_KERNELS_NAMESPACE;

constexpr int64_t kOutputs = kLanes;  // outputs of a panel: one Lanes of sums per row
constexpr int kSumRegisters = kLaneRegisters * 3 / 4;  // Lanes of sums a tile's product holds at most
#if defined(ACCELGEN_LANES_AVX512)
constexpr int64_t kTileRows = 8;  // rows of a tile
#else
// as many rows as sums fit (AVX2: 6 rows of one panel, 12 of the 16 ymm registers): a prompt's product keeps 12
// fused multiply-adds in flight for each input's 2 weight loads and 6 broadcasts
constexpr int64_t kTileRows = kSumRegisters;
#endif
// How far ahead of its loads each panel's stream asks for its weights (into L2): the hardware's prefetching stops at
// each 4 KB page, a whole page ahead here (a line per input of a whole panel)
constexpr int64_t kPrefetchInputs = 64;
// The rows go through the panels in chunks: a prompt's thousands of rows are megabytes, read again for every panel, and
// a chunk of kChunkBytes (at least kChunkRows rows, whole tiles) stays in the second-level cache meanwhile; the
// panels are read again for each chunk instead (from the third level: at least kChunkRows rows' products per read)
constexpr int64_t kChunkBytes = 192 * 1024;
constexpr int64_t kChunkRows = 128;

// The sums of Rows rows of x (``size`` values each, consecutive) times Panels consecutive whole panels
// (panel_floats apart), into out[Rows][Panels]: constants, so that every sum stays in a register of its own.
// Partial: one panel of its first ``filled`` outputs, its inputs that many values apart.
template <int Rows, int Panels, bool Partial = false>
void tile_sums(const float* x, int64_t size, const float* panel, int64_t panel_floats, Lanes* out,
               int64_t filled = kOutputs) {
  static_assert(!Partial || Panels == 1, "one partial panel");
  const int64_t step = Partial ? filled : kOutputs;
  Lanes sums[Rows][Panels];
  for (int m = 0; m < Rows; ++m)
    for (int p = 0; p < Panels; ++p) sums[m][p] = zeros();
  for (int64_t k = 0; k < size; ++k) {
    Lanes w[Panels];
    for (int p = 0; p < Panels; ++p) {
      const float* weights = panel + p * panel_floats + k * step;
      w[p] = Partial ? load_first(weights, filled) : load(weights);
      __builtin_prefetch(weights + kPrefetchInputs * step, 0, 2);
    }
    for (int m = 0; m < Rows; ++m) {
      const Lanes value = broadcast(x[m * size + k]);
      for (int p = 0; p < Panels; ++p) sums[m][p] = multiply_add(value, w[p], sums[m][p]);
    }
  }
  for (int m = 0; m < Rows; ++m)
    for (int p = 0; p < Panels; ++p) out[m * Panels + p] = sums[m][p];
}

// The panels a tile of ``rows`` rows takes at once: eight for one or two rows (eight streams of weights read side
// by side), else as many as kSumRegisters holds.
#if defined(ACCELGEN_LANES_AVX512)
constexpr int panels_for(int rows) { return rows <= 2 ? 8 : rows <= 4 ? 6 : 3; }
#else
constexpr int panels_for(int rows) { return kSumRegisters / rows > 8 ? 8 : kSumRegisters / rows > 1 ? kSumRegisters / rows : 1; }
#endif
constexpr bool sums_fit_registers() {
  for (int rows = 1; rows <= kTileRows; ++rows)
    if (rows * panels_for(rows) > kSumRegisters) return false;
  return true;
}
static_assert(sums_fit_registers(), "a tile's sums (rows x panels_for(rows)) must fit kSumRegisters");

using TileSums = void (*)(const float*, int64_t, const float*, int64_t, Lanes*, int64_t);

template <int... Counts>
constexpr std::array<TileSums, sizeof...(Counts)> wide_table(std::integer_sequence<int, Counts...>) {
  return {&tile_sums<Counts + 1, panels_for(Counts + 1)>...};
}
template <int... Counts>
constexpr std::array<TileSums, sizeof...(Counts)> narrow_table(std::integer_sequence<int, Counts...>) {
  return {&tile_sums<Counts + 1, 1>...};
}
template <int... Counts>
constexpr std::array<TileSums, sizeof...(Counts)> partial_table(std::integer_sequence<int, Counts...>) {
  return {&tile_sums<Counts + 1, 1, true>...};
}
// tile_sums of 1 to kTileRows rows (by count - 1), with panels_for(rows) panels, with one, and with the partial one
constexpr auto kWide = wide_table(std::make_integer_sequence<int, kTileRows>{});
constexpr auto kNarrow = narrow_table(std::make_integer_sequence<int, kTileRows>{});
constexpr auto kPartial = partial_table(std::make_integer_sequence<int, kTileRows>{});

void panels_product(const float* x, int64_t rows, int64_t size, const float* panels, const float* bias,
                    int64_t outputs, float* out) {
  const int64_t panel_floats = size * kOutputs;
  const int64_t panel_count = (outputs + kOutputs - 1) / kOutputs, tiles = (rows + kTileRows - 1) / kTileRows;
  const int group = panels_for(static_cast<int>(std::min(kTileRows, rows)));  // the panels of a thread's unit
  const int64_t units = (panel_count + group - 1) / group;
  const int64_t chunk_tiles = std::max(kChunkRows, kChunkBytes / (size * int64_t{sizeof(float)})) / kTileRows;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    Lanes sums[kSumRegisters];  // rows x panels_for(rows)
    for (int64_t first_tile = 0; first_tile < tiles; first_tile += chunk_tiles) {  // the chunk stays in cache
      const int64_t last_tile = std::min(tiles, first_tile + chunk_tiles);
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t first_panel = unit * group, in_unit = std::min<int64_t>(group, panel_count - first_panel);
        const int64_t whole_in_unit = std::min<int64_t>(in_unit, outputs / kOutputs - first_panel);
        for (int64_t t = first_tile; t < last_tile; ++t) {  // the unit's panels stay in cache from one tile to the next
          const int64_t count = std::min(kTileRows, rows - t * kTileRows);
          const int wide = panels_for(static_cast<int>(count));
          const float* tile = x + t * kTileRows * size;
          for (int64_t p = 0; p < in_unit;) {  // the unit's panels, as many at once as the tile's rows take
            const int take = wide <= whole_in_unit - p ? wide : 1;
            const int64_t first_output = (first_panel + p) * kOutputs;
            const auto& sums_of = p >= whole_in_unit ? kPartial : take == wide ? kWide : kNarrow;
            sums_of[count - 1](tile, size, panels + first_output * size, panel_floats, sums,
                               std::min(kOutputs, outputs - first_output));
            for (int64_t m = 0; m < count; ++m) {
              const int64_t row = t * kTileRows + m;
              for (int q = 0; q < take; ++q) {
                const int64_t n = (first_panel + p + q) * kOutputs, filled = std::min(kOutputs, outputs - n);
                Lanes value = sums[m * take + q];
                if (bias != nullptr) value = value + load_first(bias + n, filled);
                store_floats(value, out + row * outputs + n, filled);
              }
            }
            p += take;
          }
        }
      }
    }
  });
}

// x [..., K] float32, panels [N * K] float32 (pack_float_panels), bias [N] float32 or none -> [..., N].
at::Tensor float_panels_linear(const at::Tensor& x, const at::Tensor& panels, int64_t outputs,
                               const std::optional<at::Tensor>& bias) {
  const int64_t size = x.size(-1);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "float_panels_linear: x float32");
  TORCH_CHECK(panels.scalar_type() == at::kFloat && panels.is_contiguous() && panels.dim() == 1 &&
                  panels.numel() == outputs * size,
              "float_panels_linear: panels [N * K] float32 for x [..., K] and N outputs");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == outputs),
              "float_panels_linear: bias [N] float32");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = outputs;
  at::Tensor out = at::empty(shape, x.options());
  if (size == 0) return bias ? out.copy_(bias->expand_as(out)) : out.zero_();  // sums of no products
  const int64_t rows = x.numel() / size;
  if (rows == 0 || outputs == 0) return out;
  at::Tensor flat = x.contiguous();
  panels_product(flat.data_ptr<float>(), rows, size, panels.data_ptr<float>(),
                 bias ? bias->data_ptr<float>() : nullptr, outputs, out.data_ptr<float>());
  return out;
}

at::Tensor float_panels_linear_meta(const at::Tensor& x, const at::Tensor&, int64_t outputs,
                                    const std::optional<at::Tensor>&) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = outputs;
  return at::empty(shape, x.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ACCELGEN_KERNELS_NAMESPACE, library) {
  library.def("float_panels_linear(Tensor x, Tensor panels, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(ACCELGEN_KERNELS_NAMESPACE, CPU, library) { library.impl("float_panels_linear", &float_panels_linear); }

TORCH_LIBRARY_IMPL(ACCELGEN_KERNELS_NAMESPACE, Meta, library) {
  library.impl("float_panels_linear", &float_panels_linear_meta);
}
