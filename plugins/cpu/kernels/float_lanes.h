// 16 values of float32 or bfloat16 as one AVX-512 register of float32: the kernels' common load.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <type_traits>

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
#endif
