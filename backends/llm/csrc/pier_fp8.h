// The FP8 KV cache's element formats, shared by the K/V write (layer_ops.cpp) and the decode
// attention (paged_attention.cpp): OCP E4M3FN (max 448, vLLM's `fp8` / `fp8_e4m3`) and E5M2 (max
// 57344, `fp8_e5m2`), stored as torch's float8_e4m3fn / float8_e5m2 tensors.
//
// A stored value is x / scale (the layer's per-tensor K or V scale, vLLM's k_scale / v_scale),
// clamped to the format's range: c10's conversion (the one torch's .to() uses, so the compiled
// and the torch paths store the same bits) would make NaN or inf of an overflow. Reading decodes a
// byte through a 256-entry table, and the scale is applied once outside (folded into the softmax
// scale for K, into the output for V).

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cmath>
#include <cstdint>

namespace pier {

inline bool is_fp8(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

inline float fp8_max(at::ScalarType t) { return t == at::kFloat8_e4m3fn ? 448.0f : 57344.0f; }

// Byte -> float for every byte of the format (scale not applied).
inline void fp8_table(at::ScalarType t, float* lut) {
  for (int i = 0; i < 256; ++i) {
    const auto b = static_cast<uint8_t>(i);
    lut[i] = t == at::kFloat8_e4m3fn ? static_cast<float>(c10::Float8_e4m3fn(b, c10::Float8_e4m3fn::from_bits()))
                                     : static_cast<float>(c10::Float8_e5m2(b, c10::Float8_e5m2::from_bits()));
  }
}

// x * inv_scale as a byte of the format, clamped to +-max (`clamped` counts the values that were).
inline uint8_t fp8_store(float x, float inv_scale, float max, bool e4m3, int64_t& clamped) {
  float y = x * inv_scale;
  if (!(std::fabs(y) <= max)) {  // also NaN: stored as the clamp, not as a NaN to spread
    ++clamped;
    y = std::isnan(y) ? 0.0f : (y > 0.0f ? max : -max);
  }
  return e4m3 ? c10::Float8_e4m3fn(y).x : c10::Float8_e5m2(y).x;
}

}  // namespace pier
