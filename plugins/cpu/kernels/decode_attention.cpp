// Attention of one query per row (a decode step) over a static cache, reading only the positions a row can see.
//
// A static cache holds every row at the same length L, but a row sees only the span from its first visible
// position (its prompt's first token, after the bucket's left padding) to its last (its own new token): in a
// continuous-batching job, a fraction of L. Batched matrix products read all L positions of every row, and at a
// decode step the cache is most of the memory read. Here each (row, key/value head) reads the keys and values of
// its row's span once, for all the query heads that share them.
//
// Values: what softmax(q k^T * scale + mask) v gives, in float32 arithmetic whatever the tensors' dtype, and rounded
// where SDPA's CPU kernel rounds: each weight exp(score - max) rounded to the dtype before it multiplies its value, the
// sum of the weights (unrounded) dividing the result. Positions
// outside the span carry the mask's "unseen" value (at most half float32's lowest), whose softmax weight is exactly
// zero in float32: skipping them changes nothing but the order of additions. A query that sees nothing is skipped,
// its output 0 (where softmax over a row of equal minima attends to all L positions evenly): a padding position
// before a prompt, or a decode step's finished row or empty slot, whose mask the core's decode step clears.
//
// prompt_attention is the same attention for a prompt's queries (several a row, each seeing the row's positions up
// to its own): each (row, key/value head) reads its keys and values for every query of the row.
//
// decode_self_attention does a decode step's whole attention between the products: the new token's keys and
// queries rotated (rotary position embedding, as transformers' apply_rotary_pos_emb computes it, rounding as it
// does in the tensors' dtype: built with -ffp-contract=off, so that no product is fused into a sum), its keys and
// values written into the cache at each row's own position, and the attention above.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "lanes.h"

namespace {
using namespace ACCELGEN_KERNELS_NAMESPACE;

template <typename T>
inline void to_float(const T* in, float* out, int64_t size) {
  for (int64_t i = 0; i < size; ++i) out[i] = static_cast<float>(in[i]);
}

// Ask for the cache lines of ``positions`` positions (``step`` values apart, the first ``size`` values of each) from
// ``start`` on, into the second-level cache. A row's span is read once per step, mostly from memory, and the
// hardware's own prefetching restarts at every span: a whole span asked for before the work that comes ahead of its
// use has its lines arrive side by side, where one at a time they cost a memory latency each.
template <typename T>
inline void prefetch_positions(const T* start, int64_t step, int64_t positions, int64_t size) {
  for (int64_t j = 0; j < positions; ++j) {
    const char* line = reinterpret_cast<const char*>(start + j * step);
    for (int64_t offset = 0; offset < size * static_cast<int64_t>(sizeof(T)); offset += 64)
      __builtin_prefetch(line + offset, 0, 2);
  }
}

// The dot products of ``query`` [D] with four consecutive key positions (``step`` apart), into ``scores``.
inline void four_dots(const float* query, const float* keys, int64_t step, int64_t size, float* scores) {
  const float *k0 = keys, *k1 = keys + step, *k2 = keys + 2 * step, *k3 = keys + 3 * step;
  float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t d = 0; d < size; ++d) {
    s0 += query[d] * k0[d];
    s1 += query[d] * k1[d];
    s2 += query[d] * k2[d];
    s3 += query[d] * k3[d];
  }
  scores[0] = s0, scores[1] = s1, scores[2] = s2, scores[3] = s3;
}

inline float dot(const float* a, const float* b, int64_t size) {
  float sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < size; ++d) sum += a[d] * b[d];
  return sum;
}

// e^x for x <= 0 (softmax's shifted scores) within 2 units in the last place of std::exp, in operations a loop
// vectorizes (std::exp is a call per value): x = n ln 2 + r, e^r by a degree-6 polynomial (Cephes' expf), 2^n by the exponent bits.
inline float exp_of_nonpositive(float value) {
  const float x = value < -87.0f ? -87.0f : value;  // e^-87: about float32's smallest normal number
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // ln 2 in two parts: r exact to float32
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float power;
  std::memcpy(&power, &bits, sizeof power);
  return value < -87.0f ? 0.0f : p * power;  // below it 0, as std::exp rounds masked positions' weights
}


// scores [span] -> their softmax's weights before the division, exp(score - the largest), in place, rounded to T
// (bfloat16: as SDPA's CPU kernel rounds the weights it multiplies the values by); returns the inverse of their sum,
// taken before rounding. Sixteen at a time for float32 and bfloat16 (the scalar loops do not vectorize).
template <typename T>
inline float exp_in_place(float* scores, int64_t span) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    constexpr float kLowest = -std::numeric_limits<float>::infinity();
    const Lanes top = broadcast(largest_value(scores, span));
    Lanes totals = zeros();
    for (int64_t j = 0; j < span; j += kLanes) {  // past the span: -inf, whose weight is 0
      const Lanes weights = exp_of_nonpositive_lanes(load_first(scores + j, span - j, kLowest) - top);
      totals = totals + weights;
      store_first(rounded_to<T>(weights), scores + j, span - j);
    }
    return 1.0f / sum_of(totals);
  }
  const float top = *std::max_element(scores, scores + span);
  float total = 0;
  for (int64_t j = 0; j < span; ++j) {
    const float weight = exp_of_nonpositive(scores[j] - top);
    total += weight;
    scores[j] = static_cast<float>(static_cast<T>(weight));
  }
  return 1.0f / total;
}

// The loops of span_kernels: scores of a span's positions, and the weighted sum of their values (added to the
// output's), for one query or (values_pair, where it pays: null elsewhere) two.
template <typename T>
struct SpanKernels {
  void (*scores)(const float*, const T*, int64_t, int64_t, float, const float*, float*);
  void (*values)(const float*, const T*, int64_t, int64_t, float*);
  void (*values_pair)(const float*, const float*, const T*, int64_t, int64_t, float*, float*);
};

// Heads of 32, 64 or 128 values (Chunks = D / 16 Lanes each) take these: a position's products in registers, and
// the weighted sum of the values held in registers over the whole span, where attend's own loops take any size (a
// sum over d per position, the weighted sum through memory; bfloat16 converted value by value).

// scores[j] = scores[j] * scale + mask[j] over a span (the mask null: nothing added).
inline void scaled_scores(float* scores, int64_t span, float scale, const float* mask) {
  if (mask == nullptr) {
    for (int64_t j = 0; j < span; ++j) scores[j] = scores[j] * scale;
  } else {
    for (int64_t j = 0; j < span; ++j) scores[j] = scores[j] * scale + mask[j];
  }
}

// The 16 products-and-sums of ``query`` (Chunks Lanes, in registers) and one key, which sum_of adds up.
template <int Chunks, typename T>
ACCELGEN_INLINE Lanes key_products(const Lanes* query, const T* key) {
  Lanes sum = query[0] * load_floats(key);
  for (int c = 1; c < Chunks; ++c) sum = multiply_add(query[c], load_floats(key + kLanes * c), sum);
  return sum;
}

// scores[j] = query . keys[j] for the span's positions (step apart), then scaled_scores. Eight positions at a time,
// their sums across lanes taken together (sums_of_eight: the same additions, a third of the instructions).
template <int Chunks, typename T>
void span_scores(const float* query, const T* keys, int64_t step, int64_t span, float scale, const float* mask,
                 float* scores) {
  Lanes q[Chunks];
  for (int c = 0; c < Chunks; ++c) q[c] = load(query + kLanes * c);
  int64_t j = 0;
  for (; j + 8 <= span; j += 8) {
    HalfSum halves[8];
    for (int p = 0; p < 8; ++p) halves[p] = halves_added(key_products<Chunks>(q, keys + (j + p) * step));
    sums_of_eight(halves, scores + j);
  }
  for (; j < span; ++j) scores[j] = sum_of(key_products<Chunks>(q, keys + j * step));
  scaled_scores(scores, span, scale, mask);
}

// out += sum_j weights[j] values[j] over the span's positions (step apart), j in order.
template <int Chunks, typename T>
void span_values(const float* weights, const T* values, int64_t step, int64_t span, float* out) {
  Lanes sum[Chunks];
  for (int c = 0; c < Chunks; ++c) sum[c] = load(out + kLanes * c);
  for (int64_t j = 0; j < span; ++j) {
    const T* value = values + j * step;
    const Lanes weight = broadcast(weights[j]);
    for (int c = 0; c < Chunks; ++c) sum[c] = multiply_add(weight, load_floats(value + kLanes * c), sum[c]);
  }
  for (int c = 0; c < Chunks; ++c) store(sum[c], out + kLanes * c);
}

// span_values for two queries over the same positions, each query's sums as span_values makes them: for heads so
// small that one query's sums (Chunks Lanes) are too few chains of multiply-adds to keep the multipliers busy (each
// waits for the last), the other query's proceed between.
template <int Chunks, typename T>
void span_values_pair(const float* weights, const float* other_weights, const T* values, int64_t step, int64_t span,
                      float* out, float* other_out) {
  Lanes sum[Chunks], other[Chunks];
  for (int c = 0; c < Chunks; ++c) sum[c] = load(out + kLanes * c), other[c] = load(other_out + kLanes * c);
  for (int64_t j = 0; j < span; ++j) {
    const T* value = values + j * step;
    const Lanes weight = broadcast(weights[j]), other_weight = broadcast(other_weights[j]);
    for (int c = 0; c < Chunks; ++c) {
      const Lanes v = load_floats(value + kLanes * c);
      sum[c] = multiply_add(weight, v, sum[c]);
      other[c] = multiply_add(other_weight, v, other[c]);
    }
  }
  for (int c = 0; c < Chunks; ++c) store(sum[c], out + kLanes * c), store(other[c], other_out + kLanes * c);
}

// span_values_pair where two queries' sums take at most half the registers (AVX2: heads of 32; AVX-512: up to 128),
// else null: a query's own sums are then chains enough, and twice as many would not stay in registers.
template <int Chunks, typename T>
constexpr auto values_pair() -> decltype(&span_values_pair<Chunks, T>) {
  return 2 * Chunks <= kLaneRegisters / 2 ? &span_values_pair<Chunks, T> : nullptr;
}

// The span kernels of heads of ``size`` values; none (the generic loops) for other sizes or dtypes.
template <typename T>
std::optional<SpanKernels<T>> span_kernels(int64_t size) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    switch (size) {
      case 32: return SpanKernels<T>{&span_scores<2, T>, &span_values<2, T>, values_pair<2, T>()};
      case 64: return SpanKernels<T>{&span_scores<4, T>, &span_values<4, T>, values_pair<4, T>()};
      case 128: return SpanKernels<T>{&span_scores<8, T>, &span_values<8, T>, values_pair<8, T>()};
      default: break;
    }
  }
  return std::nullopt;
}

// The positions a query sees: from the first to one past the last position of its mask [L] that it sees ([L, L) when
// it sees none), and whether the mask adds nothing over them (every value 0: a causal or packed prompt's, a decode
// step's), so that the scores need not read it again. A prompt's mask is [T, L] (a packed prefill's: tens of MB), read
// here once, a row at a time, where each query's scores would wait for its row from memory.
struct SeenSpan {
  int64_t first, end;
  bool adds_nothing;
};

// Whether the 16 values from ``mask`` are all at most ``unseen`` (a NaN is not): one test the compiler vectorizes.
inline bool all_unseen(const float* mask, float unseen) {
  bool all = true;
  for (int i = 0; i < kLanes; ++i) all &= mask[i] <= unseen;
  return all;
}

inline SeenSpan seen_span(const float* mask, int64_t length) {
  const float unseen = std::numeric_limits<float>::lowest() / 2;
  int64_t first = 0, end = length;
  // sixteen at a time past unseen positions (most of a packed prompt's row), then one at a time
  while (first + kLanes <= length && all_unseen(mask + first, unseen)) first += kLanes;
  while (first < length && mask[first] <= unseen) ++first;
  if (first == length) return {length, length, true};
  while (end - kLanes > first && all_unseen(mask + end - kLanes, unseen)) end -= kLanes;
  while (mask[end - 1] <= unseen) --end;
  bool adds = false;
  for (int64_t j = first; j < end; ++j) adds |= mask[j] != 0.0f;
  return {first, end, !adds};
}

// rotate() sixteen values at a time, for sizes whose halves are whole Lanes (a multiple of 32): the same products,
// sums and roundings.
template <typename T>
inline void rotate_lanes(const T* x, const T* cos, const T* sin, int64_t size, T* out) {
  const int64_t half = size / 2;
  for (int64_t i = 0; i < size; i += kLanes) {
    const Lanes other = i < half ? negated(load_floats(x + i + half)) : load_floats(x + i - half);
    const Lanes straight = rounded_to<T>(load_floats(x + i) * load_floats(cos + i));
    const Lanes turned = rounded_to<T>(other * load_floats(sin + i));
    store_floats(straight + turned, out + i);
  }
}

// x [D] rotated by its position's cos and sin [D] into out: x cos + rotate_half(x) sin, each product and the sum
// rounded to T, where rotate_half(x) is (-x[D/2:], x[:D/2]).
template <typename T>
inline void rotate(const T* x, const T* cos, const T* sin, int64_t size, T* out) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    if (size % 32 == 0) return rotate_lanes(x, cos, sin, size, out);
  }
  const int64_t half = size / 2;
  for (int64_t i = 0; i < size; ++i) {
    const float rotated = i < half ? -static_cast<float>(x[i + half]) : static_cast<float>(x[i - half]);
    const T straight = static_cast<T>(static_cast<float>(x[i]) * static_cast<float>(cos[i]));
    const T turned = static_cast<T>(rotated * static_cast<float>(sin[i]));
    out[i] = static_cast<T>(static_cast<float>(straight) + static_cast<float>(turned));
  }
}

// A decode step's new tokens, for decode_self_attention: row b's keys at key + b * key_row (K heads of D, one after
// another, as the key product gives them), its values likewise, cos and sin [D] at cos + b * cos_row,
// sin + b * sin_row, and the cache position it writes (its queries are attend's).
template <typename T>
struct NewTokens {
  const T *key, *value, *cos, *sin;
  int64_t key_row, value_row, cos_row, sin_row;
  const int64_t* write_positions;
};

// Queries of a prompt per work item of attend.
constexpr int64_t kQueryBlock = 64;

// Where the queries are: row b's query t of head h at start + b * row + t * position + h * head (T of them a row),
// and where their outputs go, likewise.
template <typename T>
struct QueryLayout {
  T* start;
  int64_t row, position, head;
};

// Attention of the queries of heads [B, H] (T a row) over the cache key, value [B, K, L, D] with mask [B, T, L]
// (additive, float32), written to ``output``; with ``tokens`` (T = 1), their keys and values written into the cache
// and the queries rotated first. A query that sees no position is skipped: its output 0.
template <typename T>
void attend(QueryLayout<const T> q, int64_t heads, int64_t queries, const NewTokens<T>* tokens, at::Tensor& key,
            at::Tensor& value, const at::Tensor& mask, double scale, QueryLayout<T> out) {
  const int64_t rows = key.size(0), size = key.size(3);
  const int64_t key_heads = key.size(1), length = key.size(2), groups = heads / key_heads;
  T* k = key.data_ptr<T>();
  T* v = value.data_ptr<T>();
  const float* m = mask.data_ptr<float>();
  const int64_t k_row = key.stride(0), k_head = key.stride(1), k_pos = key.stride(2);
  const int64_t v_row = value.stride(0), v_head = value.stride(1), v_pos = value.stride(2);

  std::vector<SeenSpan> spans(rows * queries);  // each query's, shared by its row's heads
  for (int64_t i = 0; i < rows * queries; ++i) spans[i] = seen_span(m + i * length, length);
  const bool prefetching = queries == 1;  // a decode step reads each row's span once, mostly from memory
  // the work items: (row, key/value head, block of a prompt's queries), the blocks so that a long prompt's heads
  // share out over more threads than there are heads
  const int64_t blocks = (queries + kQueryBlock - 1) / kQueryBlock, items = rows * key_heads * blocks;

  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    const std::optional<SpanKernels<T>> vectorized = span_kernels<T>(size);
    std::vector<float> row(size);
    std::vector<T> rotated(size);
    // a query's working values: its heads' queries as float32, their weights over its span, their sums and the
    // inverses of their weights' totals; two for a pair of queries
    struct Query {
      int64_t t, first, end;
      std::vector<float> values, scores, sums, inverses;
    };
    Query work[2];
    for (Query& w : work) w.values.resize(groups * size), w.sums.resize(groups * size), w.inverses.resize(groups);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (key_heads * blocks), kh = item / blocks % key_heads, block = item % blocks;
      if (tokens) {  // the row's new key (rotated) and value at its write position
        const int64_t position = tokens->write_positions[b];
        rotate(tokens->key + b * tokens->key_row + kh * size, tokens->cos + b * tokens->cos_row,
               tokens->sin + b * tokens->sin_row, size, k + b * k_row + kh * k_head + position * k_pos);
        std::copy_n(tokens->value + b * tokens->value_row + kh * size, size, v + b * v_row + kh * v_head + position * v_pos);
      }
      const T* values = v + b * v_row + kh * v_head;

      // query t's scores, weights (exp(score - largest), rounded to T) and their totals' inverses; its sums zeroed
      const auto weigh = [&](int64_t t, Query& w) {
        const SeenSpan& seen = spans[b * queries + t];
        w.t = t, w.first = seen.first, w.end = seen.end;
        for (int64_t g = 0; g < groups; ++g) {
          const T* query_g = q.start + b * q.row + t * q.position + (kh * groups + g) * q.head;
          if (tokens) {
            rotate(query_g, tokens->cos + b * tokens->cos_row, tokens->sin + b * tokens->sin_row, size, rotated.data());
            query_g = rotated.data();
          }
          to_float(query_g, &w.values[g * size], size);
        }
        const int64_t span = seen.end - seen.first;
        w.scores.resize(groups * span);
        const T* keys = k + b * k_row + kh * k_head + seen.first * k_pos;
        if (prefetching) prefetch_positions(values + seen.first * v_pos, v_pos, span, size);  // arriving with the scores
        // a mask of zeros over the span is not read (adding 0 changes no score but -0's sign, whose weight is the same)
        const float* mask_span = seen.adds_nothing ? nullptr : m + (b * queries + t) * length + seen.first;
        const float factor = static_cast<float>(scale);
        for (int64_t g = 0; g < groups; ++g) {
          const float* query_g = &w.values[g * size];
          float* s = &w.scores[g * span];
          if (vectorized) {
            vectorized->scores(query_g, keys, k_pos, span, factor, mask_span, s);
            continue;
          }
          int64_t j = 0;
          if constexpr (std::is_same_v<T, float>) {  // four positions at a time: their sums proceed side by side
            for (; j + 4 <= span; j += 4) four_dots(query_g, keys + j * k_pos, k_pos, size, s + j);
          }
          for (; j < span; ++j) {
            const float* key_j;
            if constexpr (std::is_same_v<T, float>) {
              key_j = keys + j * k_pos;
            } else {
              to_float(keys + j * k_pos, row.data(), size);
              key_j = row.data();
            }
            s[j] = dot(query_g, key_j, size);
          }
          scaled_scores(s, span, factor, mask_span);
        }
        for (int64_t g = 0; g < groups; ++g) w.inverses[g] = exp_in_place<T>(&w.scores[g * span], span);
        std::fill(w.sums.begin(), w.sums.end(), 0.0f);
      };

      // head g's weight of position ``from`` of w's span, the first of the weights from there on
      const auto weights_from = [&](Query& w, int64_t g, int64_t from) {
        return &w.scores[g * (w.end - w.first) + from - w.first];
      };

      // positions [from, to) of w's span weighed into its heads' sums (the generic loop converts each position's
      // values once for all the heads)
      const auto add_values = [&](Query& w, int64_t from, int64_t to) {
        if (vectorized) {
          for (int64_t g = 0; g < groups; ++g)
            vectorized->values(weights_from(w, g, from), values + from * v_pos, v_pos, to - from, &w.sums[g * size]);
          return;
        }
        for (int64_t j = from; j < to; ++j) {
          const T* value_j = values + j * v_pos;
          const float* vf;
          if constexpr (std::is_same_v<T, float>) {
            vf = value_j;
          } else {
            to_float(value_j, row.data(), size);
            vf = row.data();
          }
          for (int64_t g = 0; g < groups; ++g) {
            const float weight = *weights_from(w, g, j);
            float* sum = &w.sums[g * size];
            for (int64_t d = 0; d < size; ++d) sum[d] += weight * vf[d];
          }
        }
      };

      const auto write = [&](const Query& w) {
        for (int64_t g = 0; g < groups; ++g) {
          T* o = out.start + b * out.row + w.t * out.position + (kh * groups + g) * out.head;
          for (int64_t d = 0; d < size; ++d) o[d] = static_cast<T>(w.sums[g * size + d] * w.inverses[g]);
        }
      };

      const int64_t last_query = std::min(queries, (block + 1) * kQueryBlock);
      for (int64_t t = block * kQueryBlock; t < last_query;) {
        Query& w = work[0];
        if (spans[b * queries + t].first == length) {  // sees nothing
          for (int64_t g = 0; g < groups; ++g)
            std::fill_n(out.start + b * out.row + t * out.position + (kh * groups + g) * out.head, size, T(0));
          ++t;
          continue;
        }
        weigh(t, w);
        // the next query from the same first position weighs now, so that both sum their values in one pass over
        // the positions both see, each in order (each query's sums are what it alone makes)
        Query* other = nullptr;
        if (vectorized && vectorized->values_pair && t + 1 < last_query && spans[b * queries + t + 1].first == w.first) {
          other = &work[1];
          weigh(t + 1, *other);
        }
        if (prefetching && item + 1 < items) {  // the next item's keys, arriving while these values are summed
          const int64_t next_b = (item + 1) / key_heads, next_kh = (item + 1) % key_heads;  // one block a row
          const SeenSpan& next = spans[next_b];
          if (next.first < length)
            prefetch_positions(k + next_b * k_row + next_kh * k_head + next.first * k_pos, k_pos, next.end - next.first, size);
        }
        if (other == nullptr) {
          add_values(w, w.first, w.end);
        } else {  // the positions both see in one pass, then each one's own last positions, in order
          const int64_t both = std::min(w.end, other->end);
          for (int64_t g = 0; g < groups; ++g)
            vectorized->values_pair(weights_from(w, g, w.first), weights_from(*other, g, w.first),
                                    values + w.first * v_pos, v_pos, both - w.first, &w.sums[g * size],
                                    &other->sums[g * size]);
          add_values(w, both, w.end);
          add_values(*other, both, other->end);
        }
        write(w);
        if (other) write(*other);
        t += other ? 2 : 1;
      }
    }
  });
}

// A mask of ``queries`` rows of L per row ([B, 1, T, L], [B, T, L]; additive, or true where a key is seen) as
// additive float32 [B, T, L].
// A value at most half its dtype's lowest marks a position unseen (float16's lowest is float32's at most half):
// such positions become float32's lowest, which seen_span skips.
at::Tensor additive_mask(const at::Tensor& mask, int64_t rows, int64_t queries, int64_t length) {
  at::Tensor flat = mask.reshape({rows, queries, length});
  if (flat.scalar_type() == at::kBool)
    return at::zeros({rows, queries, length}, flat.options().dtype(at::kFloat))
        .masked_fill_(flat.logical_not(), std::numeric_limits<float>::lowest());
  at::Tensor additive = flat.to(at::kFloat).contiguous();
  if (flat.scalar_type() == at::kHalf)
    additive.masked_fill_(additive <= std::numeric_limits<at::Half>::lowest() / 2, std::numeric_limits<float>::lowest());
  return additive;
}

at::Tensor last_contiguous(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

// query [B, H, T, D]; key, value [B, K, L, D] (H a multiple of K); mask [B, 1, T, L] (T = 1: or [B, L]): additive,
// or true where a key is seen. -> [B, H, T, D], query's dtype and layout.
at::Tensor queries_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             const at::Tensor& mask, double scale, const char* name) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.sizes() == key.sizes() && query.size(0) == key.size(0)
                  && query.size(3) == key.size(3), name, ": query [B, H, T, D], key and value [B, K, L, D]");
  TORCH_CHECK(query.size(1) % key.size(1) == 0, name, ": query heads a multiple of key heads");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(),
              name, ": query, key and value of one dtype");
  const int64_t queries = query.size(2);
  at::Tensor additive = additive_mask(mask, query.size(0), queries, key.size(2));
  at::Tensor q = last_contiguous(query), k = last_contiguous(key), v = last_contiguous(value);
  at::Tensor output = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "queries_attention", [&] {
    attend<scalar_t>({q.data_ptr<scalar_t>(), q.stride(0), q.stride(2), q.stride(1)}, q.size(1), queries, nullptr, k, v,
                     additive, scale,
                     {output.data_ptr<scalar_t>(), output.stride(0), output.stride(2), output.stride(1)});
  });
  return output;
}

// query [B, H, 1, D]: one query a row (a decode step); a row that sees nothing (a finished row, or a slot that holds
// none: the core's decode step clears their masks) gets 0 and costs nothing.
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const at::Tensor& mask, double scale) {
  TORCH_CHECK(query.dim() == 4 && query.size(2) == 1, "decode_attention: query [B, H, 1, D]");
  return queries_attention(query, key, value, mask, scale, "decode_attention");
}

// query [B, H, T, D]: a prompt's queries, each seeing what mask [B, 1, T, L] says; a query that sees nothing gets 0.
at::Tensor prompt_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const at::Tensor& mask, double scale) {
  return queries_attention(query, key, value, mask, scale, "prompt_attention");
}

// The new token's query [B, 1, H * D], key and value [B, 1, K * D] (last dimension contiguous), its rotary cos
// and sin [B, 1, D]; the cache keys, values [B, K, L, D] (written: position write_positions[b] of row b), mask as
// decode_attention's. -> [B, 1, H * D], query's dtype.
at::Tensor decode_self_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                 const at::Tensor& cos, const at::Tensor& sin, at::Tensor& keys, at::Tensor& values,
                                 const at::Tensor& write_positions, const at::Tensor& mask, double scale) {
  TORCH_CHECK(keys.dim() == 4 && values.sizes() == keys.sizes() && keys.stride(-1) == 1 && values.stride(-1) == 1,
              "decode_self_attention: keys and values [B, K, L, D], last dimension contiguous");
  const int64_t rows = keys.size(0), key_heads = keys.size(1), size = keys.size(3);
  TORCH_CHECK(query.dim() == 3 && query.size(0) == rows && query.size(1) == 1 && query.size(2) % (key_heads * size) == 0,
              "decode_self_attention: query [B, 1, H * D], H a multiple of K");
  TORCH_CHECK(key.sizes() == value.sizes() && key.dim() == 3 && key.size(0) == rows && key.size(1) == 1
                  && key.size(2) == key_heads * size, "decode_self_attention: key and value [B, 1, K * D]");
  TORCH_CHECK(cos.numel() == rows * size && sin.numel() == rows * size && size % 2 == 0,
              "decode_self_attention: cos and sin [B, 1, D], D even");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&key, &value, &cos, &sin, &keys, &values})
    TORCH_CHECK(t->scalar_type() == query.scalar_type(), "decode_self_attention: every tensor of one dtype");
  TORCH_CHECK(write_positions.scalar_type() == at::kLong && write_positions.numel() == rows,
              "decode_self_attention: write_positions [B], int64");
  at::Tensor additive = additive_mask(mask, rows, 1, keys.size(2));
  at::Tensor q = last_contiguous(query), k = last_contiguous(key), v = last_contiguous(value);
  at::Tensor c = cos.reshape({rows, size}).contiguous(), s = sin.reshape({rows, size}).contiguous();
  at::Tensor positions = write_positions.contiguous();
  const int64_t length = keys.size(2);
  const int64_t* position = positions.data_ptr<int64_t>();
  for (int64_t b = 0; b < rows; ++b)  // a position past the cache would be written out of its bounds
    TORCH_CHECK(position[b] >= 0 && position[b] < length, "decode_self_attention: write_positions[", b, "] is ",
                position[b], ", outside the cache's ", length, " positions");
  const int64_t heads = query.size(2) / size;
  at::Tensor output = at::empty({rows, 1, heads * size}, query.options());
  at::Tensor output_heads = output.view({rows, heads, 1, size});
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "decode_self_attention", [&] {
    const NewTokens<scalar_t> tokens{k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), c.data_ptr<scalar_t>(),
                                     s.data_ptr<scalar_t>(), k.stride(0), v.stride(0), size, size,
                                     positions.data_ptr<int64_t>()};
    attend<scalar_t>({q.data_ptr<scalar_t>(), q.stride(0), 0, size}, heads, 1, &tokens, keys, values, additive, scale,
                     {output_heads.data_ptr<scalar_t>(), output_heads.stride(0), 0, output_heads.stride(1)});
  });
  return output;
}

at::Tensor queries_attention_meta(const at::Tensor& query, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  double) {
  return at::empty_like(query.stride(-1) == 1 ? query : query.contiguous());
}

at::Tensor decode_self_attention_meta(const at::Tensor& query, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      double) {
  return at::empty_like(query);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ACCELGEN_KERNELS_NAMESPACE, library) {
  library.def("decode_attention(Tensor query, Tensor key, Tensor value, Tensor mask, float scale) -> Tensor");
  library.def("prompt_attention(Tensor query, Tensor key, Tensor value, Tensor mask, float scale) -> Tensor");
  library.def(
      "decode_self_attention(Tensor query, Tensor key, Tensor value, Tensor cos, Tensor sin, Tensor(a!) keys, "
      "Tensor(b!) values, Tensor write_positions, Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(ACCELGEN_KERNELS_NAMESPACE, CPU, library) {
  library.impl("decode_attention", &decode_attention);
  library.impl("prompt_attention", &prompt_attention);
  library.impl("decode_self_attention", &decode_self_attention);
}

TORCH_LIBRARY_IMPL(ACCELGEN_KERNELS_NAMESPACE, Meta, library) {
  library.impl("decode_attention", &queries_attention_meta);
  library.impl("prompt_attention", &queries_attention_meta);
  library.impl("decode_self_attention", &decode_self_attention_meta);
}
