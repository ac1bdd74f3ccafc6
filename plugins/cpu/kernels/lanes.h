// Lanes: 16 float32 values that the kernels compute on together, written once for every instruction set the
// kernels are built for (native_build.py builds each source once per variant, with its own -march):
//
// - AVX-512 (ACCELGEN_LANES_AVX512): one __m512 register;
// - AVX2 with FMA (x86-64-v3): two __m256 registers;
// - anything else (baseline x86-64 SSE2, aarch64 NEON, ...): one GCC/Clang vector of 64 bytes, which the compiler
//   lowers to the target's registers (four SSE or NEON registers).
//
// The operations below are the kernels' whole vocabulary: loads and stores (of float32 or bfloat16 values, the first
// ``count`` lanes only where fewer than 16 are left, nothing read or written past them), arithmetic, sums and maxima
// across lanes, and the few bit-level steps of exp and of rounding to bfloat16. Each takes the same values in every
// variant up to the order of additions across lanes and the fusing of multiply-adds (fused where the target has an
// FMA instruction, a product then a sum on baseline x86-64).
//
// Everything here lives in the namespace ACCELGEN_KERNELS_NAMESPACE (one per variant, also the torch operators'
// namespace) and the library is built with hidden visibility: several variants loaded in one process (the tests)
// never take each other's inline functions.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#ifndef ACCELGEN_KERNELS_NAMESPACE
#error "build with -DACCELGEN_KERNELS_NAMESPACE=<the operators' namespace> (native_build.py does)"
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define ACCELGEN_LANES_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define ACCELGEN_LANES_AVX2 1
#include <immintrin.h>
#else
#define ACCELGEN_LANES_PORTABLE 1
#endif

namespace ACCELGEN_KERNELS_NAMESPACE {

constexpr int kLanes = 16;

#if defined(ACCELGEN_LANES_AVX512)
//: how many Lanes the target's registers hold at once (tiles of sums are sized by it)
constexpr int kLaneRegisters = 32;

struct Lanes {
  __m512 v;
};

// The mask of the first min(count, 16) lanes (count >= 0).
inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
}

inline Lanes zeros() { return {_mm512_setzero_ps()}; }
inline Lanes broadcast(float value) { return {_mm512_set1_ps(value)}; }
inline Lanes load(const float* values) { return {_mm512_loadu_ps(values)}; }
// The first ``count`` values, the other lanes ``fill``.
inline Lanes load_first(const float* values, int64_t count, float fill = 0.0f) {
  return {_mm512_mask_loadu_ps(_mm512_set1_ps(fill), first_lanes(count), values)};
}
inline void store(Lanes lanes, float* out) { _mm512_storeu_ps(out, lanes.v); }
inline void store_first(Lanes lanes, float* out, int64_t count) { _mm512_mask_storeu_ps(out, first_lanes(count), lanes.v); }
inline Lanes operator+(Lanes a, Lanes b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Lanes operator-(Lanes a, Lanes b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Lanes operator*(Lanes a, Lanes b) { return {_mm512_mul_ps(a.v, b.v)}; }
// a * b + c, fused (one rounding)
inline Lanes multiply_add(Lanes a, Lanes b, Lanes c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Lanes maximum(Lanes a, Lanes b) { return {_mm512_max_ps(a.v, b.v)}; }
inline Lanes magnitude(Lanes a) { return {_mm512_abs_ps(a.v)}; }
inline Lanes negated(Lanes a) {
  return {_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a.v), _mm512_set1_epi32(INT32_MIN)))};
}
inline float sum_of(Lanes a) { return _mm512_reduce_add_ps(a.v); }
inline float largest_of(Lanes a) { return _mm512_reduce_max_ps(a.v); }
// Each lane rounded to the nearest integer, ties to even.
inline Lanes nearest_integers(Lanes a) {
  return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
// 2^n of lanes holding integers n in float32's normal exponents, by the exponent bits.
inline Lanes power_of_two(Lanes n) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127)), 23))};
}
// Lane by lane: ``below`` where a < limit, else ``otherwise``.
inline Lanes where_below(Lanes a, float limit, Lanes below, Lanes otherwise) {
  return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, _mm512_set1_ps(limit), _CMP_LT_OQ), otherwise.v, below.v)};
}
// The bits of bfloat16 values (the upper half of float32's) widened to float32; and back, already rounded.
inline Lanes from_bfloat16(const uint16_t* bits, int64_t count) {
  const __m256i half = _mm256_maskz_loadu_epi16(first_lanes(count), bits);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16))};
}
inline void to_bfloat16(Lanes rounded, uint16_t* bits, int64_t count) {
  const __m256i half = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded.v), 16));
  _mm256_mask_storeu_epi16(bits, first_lanes(count), half);
}
// float32 rounded to bfloat16's precision as torch rounds it (half to even, a NaN to 0x7FC0), kept as float32.
inline Lanes bfloat16_rounded(Lanes a) {
  const __m512i bits = _mm512_castps_si512(a.v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i biased = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  const __m512 kept = _mm512_castsi512_ps(_mm512_and_si512(biased, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  const __mmask16 nan = _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q);
  return {_mm512_mask_blend_ps(nan, kept, _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)))};
}

#elif defined(ACCELGEN_LANES_AVX2)
constexpr int kLaneRegisters = 8;  // 16 ymm registers, two a Lanes

struct Lanes {
  __m256 low, high;
};

// The mask (all bits of a lane set) of the first min(count, 8) lanes of a half whose first lane is ``offset``.
inline __m256i half_mask(int64_t count, int offset) {
  const int64_t left = count - offset;
  const int clamped = left <= 0 ? 0 : left >= 8 ? 8 : static_cast<int>(left);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(clamped), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline Lanes zeros() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Lanes broadcast(float value) { return {_mm256_set1_ps(value), _mm256_set1_ps(value)}; }
inline Lanes load(const float* values) { return {_mm256_loadu_ps(values), _mm256_loadu_ps(values + 8)}; }
inline Lanes load_first(const float* values, int64_t count, float fill = 0.0f) {
  const __m256i low = half_mask(count, 0), high = half_mask(count, 8);
  const __m256 filler = _mm256_set1_ps(fill);
  return {_mm256_blendv_ps(filler, _mm256_maskload_ps(values, low), _mm256_castsi256_ps(low)),
          _mm256_blendv_ps(filler, _mm256_maskload_ps(values + 8, high), _mm256_castsi256_ps(high))};
}
inline void store(Lanes lanes, float* out) {
  _mm256_storeu_ps(out, lanes.low);
  _mm256_storeu_ps(out + 8, lanes.high);
}
inline void store_first(Lanes lanes, float* out, int64_t count) {
  _mm256_maskstore_ps(out, half_mask(count, 0), lanes.low);
  _mm256_maskstore_ps(out + 8, half_mask(count, 8), lanes.high);
}
inline Lanes operator+(Lanes a, Lanes b) { return {_mm256_add_ps(a.low, b.low), _mm256_add_ps(a.high, b.high)}; }
inline Lanes operator-(Lanes a, Lanes b) { return {_mm256_sub_ps(a.low, b.low), _mm256_sub_ps(a.high, b.high)}; }
inline Lanes operator*(Lanes a, Lanes b) { return {_mm256_mul_ps(a.low, b.low), _mm256_mul_ps(a.high, b.high)}; }
inline Lanes multiply_add(Lanes a, Lanes b, Lanes c) {
  return {_mm256_fmadd_ps(a.low, b.low, c.low), _mm256_fmadd_ps(a.high, b.high, c.high)};
}
inline Lanes maximum(Lanes a, Lanes b) { return {_mm256_max_ps(a.low, b.low), _mm256_max_ps(a.high, b.high)}; }
inline Lanes magnitude(Lanes a) {
  const __m256 bits = _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MAX));
  return {_mm256_and_ps(a.low, bits), _mm256_and_ps(a.high, bits)};
}
inline Lanes negated(Lanes a) {
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN));
  return {_mm256_xor_ps(a.low, sign), _mm256_xor_ps(a.high, sign)};
}
inline float sum_of(Lanes a) {
  const __m256 both = _mm256_add_ps(a.low, a.high);
  __m128 four = _mm_add_ps(_mm256_castps256_ps128(both), _mm256_extractf128_ps(both, 1));
  four = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(four, _mm_movehdup_ps(four)));
}
inline float largest_of(Lanes a) {
  const __m256 both = _mm256_max_ps(a.low, a.high);
  __m128 four = _mm_max_ps(_mm256_castps256_ps128(both), _mm256_extractf128_ps(both, 1));
  four = _mm_max_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_max_ss(four, _mm_movehdup_ps(four)));
}
inline Lanes nearest_integers(Lanes a) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.low, kNearest), _mm256_round_ps(a.high, kNearest)};
}
inline __m256 power_of_two_half(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline Lanes power_of_two(Lanes n) { return {power_of_two_half(n.low), power_of_two_half(n.high)}; }
inline Lanes where_below(Lanes a, float limit, Lanes below, Lanes otherwise) {
  const __m256 bound = _mm256_set1_ps(limit);
  return {_mm256_blendv_ps(otherwise.low, below.low, _mm256_cmp_ps(a.low, bound, _CMP_LT_OQ)),
          _mm256_blendv_ps(otherwise.high, below.high, _mm256_cmp_ps(a.high, bound, _CMP_LT_OQ))};
}
inline Lanes from_bfloat16(const uint16_t* bits, int64_t count) {
  alignas(32) uint16_t half[16] = {};
  std::memcpy(half, bits, (count >= 16 ? 16 : count) * sizeof(uint16_t));
  const __m256i wide = _mm256_load_si256(reinterpret_cast<const __m256i*>(half));
  const __m256i low = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(wide)), 16);
  const __m256i high = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(wide, 1)), 16);
  return {_mm256_castsi256_ps(low), _mm256_castsi256_ps(high)};
}
inline void to_bfloat16(Lanes rounded, uint16_t* bits, int64_t count) {
  const __m256i low = _mm256_srli_epi32(_mm256_castps_si256(rounded.low), 16);
  const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(rounded.high), 16);
  // packus interleaves 128-bit halves: put them back in order
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(low, high), 0xD8);
  alignas(32) uint16_t half[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(half), packed);
  std::memcpy(bits, half, (count >= 16 ? 16 : count) * sizeof(uint16_t));
}
inline __m256 bfloat16_rounded_half(__m256 a) {
  const __m256i bits = _mm256_castps_si256(a);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i biased = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  const __m256 kept = _mm256_castsi256_ps(_mm256_and_si256(biased, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  return _mm256_blendv_ps(kept, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
}
inline Lanes bfloat16_rounded(Lanes a) { return {bfloat16_rounded_half(a.low), bfloat16_rounded_half(a.high)}; }

#else  // portable: the compiler's own vectors
#if defined(__aarch64__) || defined(__ARM_NEON)
constexpr int kLaneRegisters = 8;  // 32 NEON registers, four a Lanes
#else
constexpr int kLaneRegisters = 4;  // 16 SSE registers, four a Lanes
#endif

typedef float Floats16 __attribute__((vector_size(64)));
typedef int32_t Ints16 __attribute__((vector_size(64)));
typedef uint32_t Bits16 __attribute__((vector_size(64)));

struct Lanes {
  Floats16 v;
};

inline int64_t clamped(int64_t count) { return count <= 0 ? 0 : count >= 16 ? 16 : count; }

inline Lanes zeros() { return {Floats16{}}; }
inline Lanes broadcast(float value) { return {Floats16{} + value}; }
inline Lanes load(const float* values) {
  Lanes lanes;
  std::memcpy(&lanes.v, values, sizeof lanes.v);
  return lanes;
}
inline Lanes load_first(const float* values, int64_t count, float fill = 0.0f) {
  Lanes lanes = broadcast(fill);
  std::memcpy(&lanes.v, values, clamped(count) * sizeof(float));
  return lanes;
}
inline void store(Lanes lanes, float* out) { std::memcpy(out, &lanes.v, sizeof lanes.v); }
inline void store_first(Lanes lanes, float* out, int64_t count) { std::memcpy(out, &lanes.v, clamped(count) * sizeof(float)); }
inline Lanes operator+(Lanes a, Lanes b) { return {a.v + b.v}; }
inline Lanes operator-(Lanes a, Lanes b) { return {a.v - b.v}; }
inline Lanes operator*(Lanes a, Lanes b) { return {a.v * b.v}; }
inline Lanes multiply_add(Lanes a, Lanes b, Lanes c) {
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
  Lanes out;
  for (int i = 0; i < kLanes; ++i) out.v[i] = __builtin_fmaf(a.v[i], b.v[i], c.v[i]);
  return out;
#else  // no fused instruction (baseline x86-64): a product, then a sum
  return {a.v * b.v + c.v};
#endif
}
inline Lanes maximum(Lanes a, Lanes b) {
  Lanes out;
  for (int i = 0; i < kLanes; ++i) out.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i];
  return out;
}
inline Lanes magnitude(Lanes a) { return {(Floats16)((Bits16)a.v & 0x7FFFFFFFu)}; }
inline Lanes negated(Lanes a) { return {(Floats16)((Bits16)a.v ^ 0x80000000u)}; }
inline float sum_of(Lanes a) {  // pairwise, as the registers' halves are added
  float sums[8];
  for (int i = 0; i < 8; ++i) sums[i] = a.v[i] + a.v[i + 8];
  for (int i = 0; i < 4; ++i) sums[i] += sums[i + 4];
  return (sums[0] + sums[2]) + (sums[1] + sums[3]);
}
inline float largest_of(Lanes a) {
  float top = a.v[0];
  for (int i = 1; i < kLanes; ++i) top = a.v[i] > top ? a.v[i] : top;
  return top;
}
// Ties to even, for |a| < 2^22 (softmax's exponents): adding and taking away 1.5 * 2^23 leaves no fraction.
inline Lanes nearest_integers(Lanes a) {
  const Floats16 shift = Floats16{} + 12582912.0f;
  return {(a.v + shift) - shift};
}
inline Lanes power_of_two(Lanes n) {
  const Ints16 exponents = __builtin_convertvector(n.v, Ints16);
  return {(Floats16)((exponents + 127) << 23)};
}
inline Lanes where_below(Lanes a, float limit, Lanes below, Lanes otherwise) {
  Lanes out;
  for (int i = 0; i < kLanes; ++i) out.v[i] = a.v[i] < limit ? below.v[i] : otherwise.v[i];
  return out;
}
inline Lanes from_bfloat16(const uint16_t* bits, int64_t count) {
  uint16_t half[16] = {};
  std::memcpy(half, bits, clamped(count) * sizeof(uint16_t));
  Bits16 wide;
  for (int i = 0; i < kLanes; ++i) wide[i] = static_cast<uint32_t>(half[i]) << 16;
  return {(Floats16)wide};
}
inline void to_bfloat16(Lanes rounded, uint16_t* bits, int64_t count) {
  const Bits16 wide = (Bits16)rounded.v >> 16;
  uint16_t half[16];
  for (int i = 0; i < kLanes; ++i) half[i] = static_cast<uint16_t>(wide[i]);
  std::memcpy(bits, half, clamped(count) * sizeof(uint16_t));
}
inline Lanes bfloat16_rounded(Lanes a) {
  const Bits16 bits = (Bits16)a.v;
  const Bits16 kept = (bits + (((bits >> 16) & 1u) + 0x7FFFu)) & 0xFFFF0000u;
  const Bits16 nan = (Bits16)(a.v != a.v);  // all bits set where a lane is NaN
  return {(Floats16)((kept & ~nan) | (nan & 0x7FC00000u))};
}
#endif

// The first min(count, 16) values of float32 or bfloat16 as float32; the other lanes ``fill``.
template <typename T>
inline Lanes load_floats(const T* values, int64_t count = kLanes, float fill = 0.0f) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>, "float32 or bfloat16 values");
  if constexpr (std::is_same_v<T, float>) {
    return count >= kLanes ? load(values) : load_first(values, count, fill);
  } else {
    const Lanes lanes = from_bfloat16(reinterpret_cast<const uint16_t*>(values), count);
    if (count >= kLanes || fill == 0.0f) return lanes;
    static constexpr float kIndices[kLanes] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    return where_below(load(kIndices), static_cast<float>(count), lanes, broadcast(fill));
  }
}

// ``values`` rounded to T's precision as torch rounds a float32 into T, kept as float32: what
// static_cast<float>(static_cast<T>(value)) gives, sixteen at a time.
template <typename T>
inline Lanes rounded_to(Lanes values) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>, "float32 or bfloat16 values");
  if constexpr (std::is_same_v<T, float>) {
    return values;
  } else {
    return bfloat16_rounded(values);
  }
}

// The first min(count, 16) lanes written to ``out`` as T (bfloat16: rounded half to even, as torch rounds).
template <typename T>
inline void store_floats(Lanes values, T* out, int64_t count = kLanes) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>, "float32 or bfloat16 values");
  if constexpr (std::is_same_v<T, float>) {
    if (count >= kLanes)
      store(values, out);
    else
      store_first(values, out, count);
  } else {
    to_bfloat16(bfloat16_rounded(values), reinterpret_cast<uint16_t*>(out), count);
  }
}

// e^x of 16 values x <= 0 (softmax's shifted scores) within 2 units in the last place of std::exp: x = n ln 2 + r,
// e^r by a degree-6 polynomial (Cephes' expf), 2^n by the exponent bits; below -87 (about float32's smallest normal
// number) 0, as std::exp rounds masked positions' weights. The same operations in the same order as the kernels'
// scalar exp_of_nonpositive, so the same bits in every lane.
inline Lanes exp_of_nonpositive_lanes(Lanes value) {
  const Lanes x = where_below(value, -87.0f, broadcast(-87.0f), value);
  const Lanes n = nearest_integers(x * broadcast(1.44269504088896341f));
  const Lanes r = (x - n * broadcast(0.693359375f)) + n * broadcast(2.12194440e-4f);  // ln 2 in two parts
  Lanes p = broadcast(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = p * r + broadcast(c);
  p = ((p * r) * r + r) + broadcast(1.0f);
  return where_below(value, -87.0f, zeros(), p * power_of_two(n));
}

}  // namespace ACCELGEN_KERNELS_NAMESPACE
