// Shared by Pier's CPU kernels: function multi-versioning, a 16-float vector type and exp.
//
// Vector width is chosen at load time (gcc target_clones: x86-64-v4 = AVX-512, x86-64-v3 = AVX2 +
// FMA, or baseline x86-64), so the library runs on any x86-64 CPU and uses the widest units it has.
// A v16 (GCC vector extension) maps to one zmm, two ymm or four xmm registers in those clones.

#pragma once

#include <cstdint>
#include <cstring>

namespace pier {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PIER_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PIER_CLONES
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

static inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

// e^f for |f| <= ln(2)/2: the degree-7 Taylor polynomial, for a float or a vector of floats.
template <typename T>
static inline T exp_poly(T f) {
  T p = f * 1.9841269841269841e-4f + 1.3888888888888889e-3f;
  p = p * f + 8.3333333333333333e-3f;
  p = p * f + 4.1666666666666667e-2f;
  p = p * f + 1.6666666666666667e-1f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  return p * f + 1.0f;
}

// exp(x) for x <= 0 (softmax after subtracting the max): 2^n * p(f), n = round(x log2 e),
// |f| <= 1/2, p a degree-7 Taylor polynomial (relative error ~1e-8, below float rounding).
// Written with plain arithmetic so the compiler vectorises the loop that calls it.
static inline float exp_nonpos(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float t = x * 1.4426950408889634f;
  const float n = static_cast<float>(static_cast<int>(t < 0.0f ? t - 0.5f : t + 0.5f));
  const float f = (t - n) * 0.6931471805599453f;
  const float p = exp_poly(f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// e^x on 16 lanes for x in [lo, 88] (lo >= -87; inputs outside are clamped): the same
// construction as exp_nonpos (the auto-vectoriser leaves the scalar one scalar in some clones).
static inline v16 exp16(v16 x, float lo = -87.0f) {
  x = x < lo ? v16{} + lo : x;
  x = x > 88.0f ? v16{} + 88.0f : x;
  const v16 t = x * 1.4426950408889634f;
  const v16i ni = __builtin_convertvector(t + (t < 0.0f ? v16{} - 0.5f : v16{} + 0.5f), v16i);  // round
  const v16 f = (t - __builtin_convertvector(ni, v16)) * 0.6931471805599453f;
  const v16 p = exp_poly(f);
  const v16i bits = (ni + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace pier
