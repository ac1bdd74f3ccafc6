// 16 values of float32 or bfloat16 as one AVX-512 register of float32, and back: the kernels' common loads and stores
// (and the masks of their first lanes).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <type_traits>

// The mask of the first min(count, 16) lanes.
inline __mmask16 lanes_before(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
}

template <typename T>
inline __m512 load_floats(const T* values) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>, "float32 or bfloat16 values");
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(values);
  } else {  // bfloat16: the upper half of a float32's bits
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
}

// The first values of 16 (the lanes set in ``mask``); the other lanes zero, and nothing read past the mask.
template <typename T>
inline __m512 load_floats(const T* values, __mmask16 mask) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>, "float32 or bfloat16 values");
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(mask, values);
  } else {
    const __m256i bits = _mm256_maskz_loadu_epi16(mask, values);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
}
// The lanes of ``values`` set in ``mask`` written to out as T: bfloat16 rounded half to even, as torch rounds it.
template <typename T>
inline void store_floats(__m512 values, __mmask16 mask, T* out) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>, "float32 or bfloat16 values");
  if constexpr (std::is_same_v<T, float>) {
    _mm512_mask_storeu_ps(out, mask, values);
  } else {
#if defined(__AVX512BF16__)
    _mm256_mask_storeu_epi16(out, mask, (__m256i)_mm512_cvtneps_pbh(values));
#else
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, values);
    for (int i = 0; i < 16; ++i)
      if (mask >> i & 1) out[i] = static_cast<T>(lanes[i]);
#endif
  }
}

// ``values`` rounded to T's precision as torch rounds a float32 into T (bfloat16: half to even, a NaN to 0x7FC0),
// kept as float32: what static_cast<float>(static_cast<T>(value)) gives, sixteen at a time.
template <typename T>
inline __m512 rounded_to(__m512 values) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>, "float32 or bfloat16 values");
  if constexpr (std::is_same_v<T, float>) {
    return values;
  } else {
    const __m512i bits = _mm512_castps_si512(values);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i biased = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    const __m512 kept = _mm512_castsi512_ps(_mm512_and_si512(biased, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
    const __mmask16 nan = _mm512_cmp_ps_mask(values, values, _CMP_UNORD_Q);
    return _mm512_mask_blend_ps(nan, kept, _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
  }
}
#endif
