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
#include <limits>
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

// Every operation inlined: a Lanes passed to a call goes through memory (the ABI's rule for a 64-byte struct)
#define ACCELGEN_INLINE inline __attribute__((always_inline))

namespace ACCELGEN_KERNELS_NAMESPACE {

constexpr int kLanes = 16;

#if defined(ACCELGEN_LANES_AVX512)
//: how many Lanes the target's registers hold at once (tiles of sums are sized by it)
constexpr int kLaneRegisters = 32;

struct Lanes {
  __m512 v;
};

// The mask of the first min(count, 16) lanes (count >= 0).
ACCELGEN_INLINE __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
}

ACCELGEN_INLINE Lanes zeros() { return {_mm512_setzero_ps()}; }
ACCELGEN_INLINE Lanes broadcast(float value) { return {_mm512_set1_ps(value)}; }
ACCELGEN_INLINE Lanes load(const float* values) { return {_mm512_loadu_ps(values)}; }
// The first ``count`` values, the other lanes ``fill``.
ACCELGEN_INLINE Lanes load_first(const float* values, int64_t count, float fill = 0.0f) {
  return {_mm512_mask_loadu_ps(_mm512_set1_ps(fill), first_lanes(count), values)};
}
ACCELGEN_INLINE void store(Lanes lanes, float* out) { _mm512_storeu_ps(out, lanes.v); }
ACCELGEN_INLINE void store_first(Lanes lanes, float* out, int64_t count) { _mm512_mask_storeu_ps(out, first_lanes(count), lanes.v); }
ACCELGEN_INLINE Lanes operator+(Lanes a, Lanes b) { return {_mm512_add_ps(a.v, b.v)}; }
ACCELGEN_INLINE Lanes operator-(Lanes a, Lanes b) { return {_mm512_sub_ps(a.v, b.v)}; }
ACCELGEN_INLINE Lanes operator*(Lanes a, Lanes b) { return {_mm512_mul_ps(a.v, b.v)}; }
// a * b + c, fused (one rounding)
ACCELGEN_INLINE Lanes multiply_add(Lanes a, Lanes b, Lanes c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
ACCELGEN_INLINE Lanes maximum(Lanes a, Lanes b) { return {_mm512_max_ps(a.v, b.v)}; }
ACCELGEN_INLINE Lanes magnitude(Lanes a) { return {_mm512_abs_ps(a.v)}; }
ACCELGEN_INLINE Lanes negated(Lanes a) {
  return {_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a.v), _mm512_set1_epi32(INT32_MIN)))};
}
ACCELGEN_INLINE float sum_of(Lanes a) { return _mm512_reduce_add_ps(a.v); }
// What sum_of adds first: lane i + lane i + 8 (as _mm512_reduce_add_ps does), eight sums in one register
struct HalfSum {
  __m256 v;
};
ACCELGEN_INLINE HalfSum halves_added(Lanes a) {
  return {_mm256_add_ps(_mm512_castps512_ps256(a.v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)))};
}
ACCELGEN_INLINE float largest_of(Lanes a) { return _mm512_reduce_max_ps(a.v); }
// Each lane rounded to the nearest integer, ties to even.
ACCELGEN_INLINE Lanes nearest_integers(Lanes a) {
  return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
// 2^n of lanes holding integers n in float32's normal exponents, by the exponent bits.
ACCELGEN_INLINE Lanes power_of_two(Lanes n) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127)), 23))};
}
// Lane by lane: ``below`` where a < limit, else ``otherwise``.
ACCELGEN_INLINE Lanes where_below(Lanes a, float limit, Lanes below, Lanes otherwise) {
  return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, _mm512_set1_ps(limit), _CMP_LT_OQ), otherwise.v, below.v)};
}
// The bits of bfloat16 values (the upper half of float32's) widened to float32; and back, already rounded.
ACCELGEN_INLINE Lanes from_bfloat16(const uint16_t* bits, int64_t count) {
  const __m256i half = _mm256_maskz_loadu_epi16(first_lanes(count), bits);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16))};
}
ACCELGEN_INLINE void to_bfloat16(Lanes rounded, uint16_t* bits, int64_t count) {
  const __m256i half = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded.v), 16));
  _mm256_mask_storeu_epi16(bits, first_lanes(count), half);
}
// float32 rounded to bfloat16's precision as torch rounds it (half to even, a NaN to 0x7FC0), kept as float32.
ACCELGEN_INLINE Lanes bfloat16_rounded(Lanes a) {
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
ACCELGEN_INLINE __m256i half_mask(int64_t count, int offset) {
  const int64_t left = count - offset;
  const int clamped = left <= 0 ? 0 : left >= 8 ? 8 : static_cast<int>(left);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(clamped), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

ACCELGEN_INLINE Lanes zeros() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
ACCELGEN_INLINE Lanes broadcast(float value) { return {_mm256_set1_ps(value), _mm256_set1_ps(value)}; }
ACCELGEN_INLINE Lanes load(const float* values) { return {_mm256_loadu_ps(values), _mm256_loadu_ps(values + 8)}; }
ACCELGEN_INLINE Lanes load_first(const float* values, int64_t count, float fill = 0.0f) {
  const __m256i low = half_mask(count, 0), high = half_mask(count, 8);
  const __m256 filler = _mm256_set1_ps(fill);
  return {_mm256_blendv_ps(filler, _mm256_maskload_ps(values, low), _mm256_castsi256_ps(low)),
          _mm256_blendv_ps(filler, _mm256_maskload_ps(values + 8, high), _mm256_castsi256_ps(high))};
}
ACCELGEN_INLINE void store(Lanes lanes, float* out) {
  _mm256_storeu_ps(out, lanes.low);
  _mm256_storeu_ps(out + 8, lanes.high);
}
ACCELGEN_INLINE void store_first(Lanes lanes, float* out, int64_t count) {
  _mm256_maskstore_ps(out, half_mask(count, 0), lanes.low);
  _mm256_maskstore_ps(out + 8, half_mask(count, 8), lanes.high);
}
ACCELGEN_INLINE Lanes operator+(Lanes a, Lanes b) { return {_mm256_add_ps(a.low, b.low), _mm256_add_ps(a.high, b.high)}; }
ACCELGEN_INLINE Lanes operator-(Lanes a, Lanes b) { return {_mm256_sub_ps(a.low, b.low), _mm256_sub_ps(a.high, b.high)}; }
ACCELGEN_INLINE Lanes operator*(Lanes a, Lanes b) { return {_mm256_mul_ps(a.low, b.low), _mm256_mul_ps(a.high, b.high)}; }
ACCELGEN_INLINE Lanes multiply_add(Lanes a, Lanes b, Lanes c) {
  return {_mm256_fmadd_ps(a.low, b.low, c.low), _mm256_fmadd_ps(a.high, b.high, c.high)};
}
ACCELGEN_INLINE Lanes maximum(Lanes a, Lanes b) { return {_mm256_max_ps(a.low, b.low), _mm256_max_ps(a.high, b.high)}; }
ACCELGEN_INLINE Lanes magnitude(Lanes a) {
  const __m256 bits = _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MAX));
  return {_mm256_and_ps(a.low, bits), _mm256_and_ps(a.high, bits)};
}
ACCELGEN_INLINE Lanes negated(Lanes a) {
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN));
  return {_mm256_xor_ps(a.low, sign), _mm256_xor_ps(a.high, sign)};
}
// What sum_of adds first: lane i + lane i + 8, eight sums in one register
struct HalfSum {
  __m256 v;
};
ACCELGEN_INLINE HalfSum halves_added(Lanes a) { return {_mm256_add_ps(a.low, a.high)}; }
ACCELGEN_INLINE float sum_of(Lanes a) {
  const __m256 both = _mm256_add_ps(a.low, a.high);
  __m128 four = _mm_add_ps(_mm256_castps256_ps128(both), _mm256_extractf128_ps(both, 1));
  four = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(four, _mm_movehdup_ps(four)));
}
ACCELGEN_INLINE float largest_of(Lanes a) {
  const __m256 both = _mm256_max_ps(a.low, a.high);
  __m128 four = _mm_max_ps(_mm256_castps256_ps128(both), _mm256_extractf128_ps(both, 1));
  four = _mm_max_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_max_ss(four, _mm_movehdup_ps(four)));
}
ACCELGEN_INLINE Lanes nearest_integers(Lanes a) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.low, kNearest), _mm256_round_ps(a.high, kNearest)};
}
ACCELGEN_INLINE __m256 power_of_two_half(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
ACCELGEN_INLINE Lanes power_of_two(Lanes n) { return {power_of_two_half(n.low), power_of_two_half(n.high)}; }
ACCELGEN_INLINE Lanes where_below(Lanes a, float limit, Lanes below, Lanes otherwise) {
  const __m256 bound = _mm256_set1_ps(limit);
  return {_mm256_blendv_ps(otherwise.low, below.low, _mm256_cmp_ps(a.low, bound, _CMP_LT_OQ)),
          _mm256_blendv_ps(otherwise.high, below.high, _mm256_cmp_ps(a.high, bound, _CMP_LT_OQ))};
}
ACCELGEN_INLINE Lanes from_bfloat16(const uint16_t* bits, int64_t count) {
  __m256i wide;
  if (count >= 16) {
    wide = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits));
  } else {
    alignas(32) uint16_t half[16] = {};
    for (int64_t i = 0; i < count; ++i) half[i] = bits[i];
    wide = _mm256_load_si256(reinterpret_cast<const __m256i*>(half));
  }
  const __m256i low = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(wide)), 16);
  const __m256i high = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(wide, 1)), 16);
  return {_mm256_castsi256_ps(low), _mm256_castsi256_ps(high)};
}
ACCELGEN_INLINE void to_bfloat16(Lanes rounded, uint16_t* bits, int64_t count) {
  const __m256i low = _mm256_srli_epi32(_mm256_castps_si256(rounded.low), 16);
  const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(rounded.high), 16);
  // packus interleaves 128-bit halves: put them back in order
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(low, high), 0xD8);
  if (count >= 16) return _mm256_storeu_si256(reinterpret_cast<__m256i*>(bits), packed);
  alignas(32) uint16_t half[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(half), packed);
  for (int64_t i = 0; i < count; ++i) bits[i] = half[i];
}
ACCELGEN_INLINE __m256 bfloat16_rounded_half(__m256 a) {
  const __m256i bits = _mm256_castps_si256(a);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i biased = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  const __m256 kept = _mm256_castsi256_ps(_mm256_and_si256(biased, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  return _mm256_blendv_ps(kept, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
}
ACCELGEN_INLINE Lanes bfloat16_rounded(Lanes a) { return {bfloat16_rounded_half(a.low), bfloat16_rounded_half(a.high)}; }

#endif

#if defined(ACCELGEN_LANES_AVX512) || defined(ACCELGEN_LANES_AVX2)
// out[p] = sum_of of the Lanes whose halves_added is halves[p], for eight of them at once: the same additions in the
// same order as sum_of's (each half's four lanes i + i + 4, then i + i + 2, then the two left), eight sums side by
// side in three steps where sum_of takes three a sum.
ACCELGEN_INLINE void sums_of_eight(const HalfSum* halves, float* out) {
  __m256 four[4];  // [f(2i) | f(2i + 1)]: each sum's 128-bit halves added, two sums a register
  for (int i = 0; i < 4; ++i) {
    const __m256 a = halves[2 * i].v, b = halves[2 * i + 1].v;
    four[i] = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }
  // lanes 0 + 2 and 1 + 3 of each: [g0 g2 | g1 g3] and [g4 g6 | g5 g7], two values a sum
  const __m256 low = _mm256_add_ps(_mm256_shuffle_ps(four[0], four[1], 0x44), _mm256_shuffle_ps(four[0], four[1], 0xEE));
  const __m256 high = _mm256_add_ps(_mm256_shuffle_ps(four[2], four[3], 0x44), _mm256_shuffle_ps(four[2], four[3], 0xEE));
  // their two values added: [s0 s2 s4 s6 | s1 s3 s5 s7], then in order
  const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(low, high, 0x88), _mm256_shuffle_ps(low, high, 0xDD));
  _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
#endif

#if defined(ACCELGEN_LANES_PORTABLE)  // the compiler's own vectors
#if defined(__aarch64__) || defined(__ARM_NEON)
constexpr int kLaneRegisters = 8;  // 32 NEON registers, four a Lanes
#else
constexpr int kLaneRegisters = 4;  // 16 SSE registers, four a Lanes
#endif

// Four vectors of 16 bytes: the width every target's registers take natively (a vector of 64 bytes the compiler
// lowers through memory)
typedef float Floats4 __attribute__((vector_size(16)));
typedef int32_t Ints4 __attribute__((vector_size(16)));
typedef uint32_t Bits4 __attribute__((vector_size(16)));

struct Lanes {
  Floats4 part[4];
};

// Lanes made by ``each`` applied to the four parts
template <typename F>
ACCELGEN_INLINE Lanes each_part(F each) {
  Lanes out;
  for (int i = 0; i < 4; ++i) out.part[i] = each(i);
  return out;
}
ACCELGEN_INLINE Floats4 chosen(Ints4 mask, Floats4 yes, Floats4 no) {
  return (Floats4)(((Ints4)yes & mask) | ((Ints4)no & ~mask));
}
ACCELGEN_INLINE int64_t clamped(int64_t count) { return count <= 0 ? 0 : count >= 16 ? 16 : count; }

ACCELGEN_INLINE Lanes broadcast(float value) {
  const Floats4 four = {value, value, value, value};
  return {{four, four, four, four}};
}
ACCELGEN_INLINE Lanes zeros() { return broadcast(0.0f); }
ACCELGEN_INLINE Lanes load(const float* values) {
  Lanes lanes;
  std::memcpy(&lanes.part, values, sizeof lanes.part);
  return lanes;
}
ACCELGEN_INLINE Lanes load_first(const float* values, int64_t count, float fill = 0.0f) {
  float copy[16];
  for (int i = 0; i < 16; ++i) copy[i] = i < count ? values[i] : fill;
  return load(copy);
}
ACCELGEN_INLINE void store(Lanes lanes, float* out) { std::memcpy(out, &lanes.part, sizeof lanes.part); }
ACCELGEN_INLINE void store_first(Lanes lanes, float* out, int64_t count) {
  float copy[16];
  store(lanes, copy);
  for (int64_t i = 0; i < clamped(count); ++i) out[i] = copy[i];
}
ACCELGEN_INLINE Lanes operator+(Lanes a, Lanes b) { return each_part([&](int i) { return a.part[i] + b.part[i]; }); }
ACCELGEN_INLINE Lanes operator-(Lanes a, Lanes b) { return each_part([&](int i) { return a.part[i] - b.part[i]; }); }
ACCELGEN_INLINE Lanes operator*(Lanes a, Lanes b) { return each_part([&](int i) { return a.part[i] * b.part[i]; }); }
ACCELGEN_INLINE Lanes multiply_add(Lanes a, Lanes b, Lanes c) {
#if defined(__ARM_FEATURE_FMA) || defined(__FMA__)
  return each_part([&](int i) {
    Floats4 out;
    for (int j = 0; j < 4; ++j) out[j] = __builtin_fmaf(a.part[i][j], b.part[i][j], c.part[i][j]);
    return out;
  });
#else  // no fused instruction (baseline x86-64): a product, then a sum
  return each_part([&](int i) { return a.part[i] * b.part[i] + c.part[i]; });
#endif
}
ACCELGEN_INLINE Lanes maximum(Lanes a, Lanes b) {
  return each_part([&](int i) { return chosen((Ints4)(a.part[i] > b.part[i]), a.part[i], b.part[i]); });
}
ACCELGEN_INLINE Lanes magnitude(Lanes a) {
  return each_part([&](int i) { return (Floats4)((Bits4)a.part[i] & 0x7FFFFFFFu); });
}
ACCELGEN_INLINE Lanes negated(Lanes a) {
  return each_part([&](int i) { return (Floats4)((Bits4)a.part[i] ^ 0x80000000u); });
}
ACCELGEN_INLINE float sum_of(Lanes a) {  // pairwise, as the registers' halves are added
  const Floats4 four = (a.part[0] + a.part[2]) + (a.part[1] + a.part[3]);
  return (four[0] + four[2]) + (four[1] + four[3]);
}
// What sum_of adds first: lane i + lane i + 8, for i < 4 and i >= 4
struct HalfSum {
  Floats4 first, second;
};
ACCELGEN_INLINE HalfSum halves_added(Lanes a) { return {a.part[0] + a.part[2], a.part[1] + a.part[3]}; }
// out[p] = sum_of of the Lanes whose halves_added is halves[p], for eight of them: the same sums in the same order
ACCELGEN_INLINE void sums_of_eight(const HalfSum* halves, float* out) {
  for (int p = 0; p < 8; ++p) {
    const Floats4 four = halves[p].first + halves[p].second;
    out[p] = (four[0] + four[2]) + (four[1] + four[3]);
  }
}
ACCELGEN_INLINE float largest_of(Lanes a) {
  const Lanes halves = maximum(a, Lanes{{a.part[2], a.part[3], a.part[0], a.part[1]}});
  const Floats4 four = chosen((Ints4)(halves.part[0] > halves.part[1]), halves.part[0], halves.part[1]);
  const float low = four[0] > four[2] ? four[0] : four[2], high = four[1] > four[3] ? four[1] : four[3];
  return low > high ? low : high;
}
// Ties to even, for |a| < 2^22 (softmax's exponents): adding and taking away 1.5 * 2^23 leaves no fraction.
ACCELGEN_INLINE Lanes nearest_integers(Lanes a) {
  const Floats4 shift = {12582912.0f, 12582912.0f, 12582912.0f, 12582912.0f};
  return each_part([&](int i) { return (a.part[i] + shift) - shift; });
}
ACCELGEN_INLINE Lanes power_of_two(Lanes n) {
  return each_part([&](int i) { return (Floats4)((__builtin_convertvector(n.part[i], Ints4) + 127) << 23); });
}
ACCELGEN_INLINE Lanes where_below(Lanes a, float limit, Lanes below, Lanes otherwise) {
  const Floats4 bound = {limit, limit, limit, limit};
  return each_part([&](int i) { return chosen((Ints4)(a.part[i] < bound), below.part[i], otherwise.part[i]); });
}
ACCELGEN_INLINE Lanes from_bfloat16(const uint16_t* bits, int64_t count) {
  uint16_t half[16] = {};
  if (count >= 16)
    std::memcpy(half, bits, sizeof half);
  else
    for (int64_t i = 0; i < count; ++i) half[i] = bits[i];
  return each_part([&](int i) {
    const Bits4 wide = {half[4 * i], half[4 * i + 1], half[4 * i + 2], half[4 * i + 3]};
    return (Floats4)(wide << 16);
  });
}
ACCELGEN_INLINE void to_bfloat16(Lanes rounded, uint16_t* bits, int64_t count) {
  uint16_t half[16];
  for (int i = 0; i < 4; ++i) {
    const Bits4 wide = (Bits4)rounded.part[i] >> 16;
    for (int j = 0; j < 4; ++j) half[4 * i + j] = static_cast<uint16_t>(wide[j]);
  }
  if (count >= 16)
    std::memcpy(bits, half, sizeof half);
  else
    for (int64_t i = 0; i < count; ++i) bits[i] = half[i];
}
ACCELGEN_INLINE Lanes bfloat16_rounded(Lanes a) {
  return each_part([&](int i) {
    const Bits4 bits = (Bits4)a.part[i];
    const Bits4 kept = (bits + (((bits >> 16) & 1u) + 0x7FFFu)) & 0xFFFF0000u;
    const Bits4 nan = (Bits4)(a.part[i] != a.part[i]);  // all bits set where a lane is NaN
    return (Floats4)((kept & ~nan) | (nan & 0x7FC00000u));
  });
}
#endif

// The first min(count, 16) values of float32 or bfloat16 as float32; the other lanes ``fill``.
template <typename T>
ACCELGEN_INLINE Lanes load_floats(const T* values, int64_t count = kLanes, float fill = 0.0f) {
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

// The largest of the first ``count`` values of float32 or bfloat16 (-inf where there are none), sixteen at a time.
template <typename T>
ACCELGEN_INLINE float largest_value(const T* values, int64_t count) {
  constexpr float kLowest = -std::numeric_limits<float>::infinity();
  Lanes tops = broadcast(kLowest);
  for (int64_t k = 0; k < count; k += kLanes) tops = maximum(tops, load_floats(values + k, count - k, kLowest));
  return largest_of(tops);
}

// ``values`` rounded to T's precision as torch rounds a float32 into T, kept as float32: what
// static_cast<float>(static_cast<T>(value)) gives, sixteen at a time.
template <typename T>
ACCELGEN_INLINE Lanes rounded_to(Lanes values) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>, "float32 or bfloat16 values");
  if constexpr (std::is_same_v<T, float>) {
    return values;
  } else {
    return bfloat16_rounded(values);
  }
}

// The first min(count, 16) lanes written to ``out`` as T (bfloat16: rounded half to even, as torch rounds).
template <typename T>
ACCELGEN_INLINE void store_floats(Lanes values, T* out, int64_t count = kLanes) {
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
ACCELGEN_INLINE Lanes exp_of_nonpositive_lanes(Lanes value) {
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
