// Weight-only quantized projections on CPU (float32 activations), reading the packed weight directly.
//
//   quant_linear(out, x, q, scales, zeros, bits, group, offset)    out[M, N] = x[M, K] @ W^T
//   quant_dequantize(out, q, scales, zeros, bits, group, offset)   out[N, K] = W
//
// W[n, k] = (q[n, k] - zeros[n, g]) * scales[n, g] with g = k / group, or with `offset`
// W[n, k] = q[n, k] * scales[n, g] + zeros[n, g] (a float min rather than an integer zero point:
// GGUF's Q4_1, Q5_1, Q4_K and Q5_K, whose reader computes d * q + m). Every format Pier loads
// (online int8, GPTQ, AWQ, compressed-tensors, GGUF's blocks; 5- and 6-bit codes in 8-bit
// containers) is brought to this one form at load (layers/quantized.py). Each weight is computed in
// float exactly as that formula reads (the offset form's product rounded before the add, never one
// fused multiply-add: an empty asm keeps the compiler from contracting them), so the products equal a
// float matmul on the de-quantized weights up to summation order.
//
// q is uint8 [N, K] for bits = 8, and for bits = 4 two values a byte in chunks of 32 along K:
// byte j of a chunk holds k = j in its low nibble and k = 16 + j in its high one, so that one
// 16-byte load gives two 16-lane vectors with a mask and a shift (no shuffles).
//
// Decode is bound by memory bandwidth: the weight is read once per step and de-quantized in
// registers, in tiles of up to 6 rows of x by 4 output rows (each de-quantized vector serves 6 rows,
// each x vector 4 outputs). quant_dequantize is the de-quantize-then-matmul anchor the benchmark
// compares with (bench/quant_kernels.py: slower at every row count measured). AVX-512 intrinsics
// where the CPU has them (checked at run time); elsewhere portable vector code, its width picked at
// load time (pier_vec.h: AVX2 or baseline x86-64, or any other target GCC compiles for).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "pier_vec.h"

namespace {

using namespace pier;

typedef uint8_t v16u8 __attribute__((vector_size(16)));

__attribute__((always_inline)) static inline v16u8 load16u8(const uint8_t* p) {
  v16u8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// bytes -> floats through int32 lanes (vpmovzxbd + vcvtdq2ps; a direct byte -> float conversion is
// scalarised by GCC)
__attribute__((always_inline)) static inline v16 to_float(v16u8 b) {
  return __builtin_convertvector(__builtin_convertvector(b, v16i), v16);
}

__attribute__((always_inline)) static inline float hsum(v16 v) {
  float s = 0.0f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// 16 weights from their codes as floats: (q - z) * s, or with `offset` q * s + z (rounded as two
// operations: the asm makes the product a value the compiler cannot fuse into the add).
__attribute__((always_inline)) static inline v16 dequant(v16 qf, float z, float s, bool offset) {
  if (offset) {
    v16 p = qf * s;
    asm("" : "+m"(p));
    return p + z;
  }
  return (qf - z) * s;
}

// 16 consecutive weights of one output row.
__attribute__((always_inline)) static inline v16 weights8(const uint8_t* q, float z, float s, bool offset) {
  return dequant(to_float(load16u8(q)), z, s, offset);
}

// One output row n against R rows of x: out[r][n] for r < R.
template <int R>
__attribute__((always_inline)) static inline void row_dot(const float* __restrict x, int64_t x_stride, const uint8_t* __restrict qrow,
                           const float* __restrict srow, const float* __restrict zrow, int64_t K, int64_t group,
                           int bits, bool offset, float* __restrict out, int64_t out_stride) {
  v16 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = v16{};
  const int64_t groups = K / group;
  for (int64_t g = 0; g < groups; ++g) {
    const float s = srow[g], z = zrow[g];
    const int64_t k0 = g * group;
    if (bits == 8) {
      for (int64_t k = k0; k < k0 + group; k += 16) {
        const v16 w = weights8(qrow + k, z, s, offset);
        for (int r = 0; r < R; ++r) acc[r] += w * load16(x + r * x_stride + k);
      }
    } else {
      for (int64_t k = k0; k < k0 + group; k += 32) {
        const v16u8 b = load16u8(qrow + k / 2);
        const v16 lo = dequant(to_float(b & 0xF), z, s, offset);
        const v16 hi = dequant(to_float(b >> 4), z, s, offset);
        for (int r = 0; r < R; ++r) {
          acc[r] += lo * load16(x + r * x_stride + k);
          acc[r] += hi * load16(x + r * x_stride + k + 16);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r * out_stride] = hsum(acc[r]);
}

PIER_CLONES void quant_rows(const float* x, int64_t M, int64_t x_stride, const uint8_t* q, const float* scales,
                            const float* zeros, int64_t K, int64_t group, int bits, bool offset, float* out,
                            int64_t n0, int64_t n1, int64_t N) {
  const int64_t row_bytes = K * bits / 8, groups = K / group;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qrow = q + n * row_bytes;
    const float* srow = scales + n * groups;
    const float* zrow = zeros + n * groups;
    int64_t m = 0;
    for (; m + 8 <= M; m += 8)
      row_dot<8>(x + m * x_stride, x_stride, qrow, srow, zrow, K, group, bits, offset, out + m * N + n, N);
    switch (M - m) {
      case 7: row_dot<7>(x + m * x_stride, x_stride, qrow, srow, zrow, K, group, bits, offset, out + m * N + n, N); break;
      case 6: row_dot<6>(x + m * x_stride, x_stride, qrow, srow, zrow, K, group, bits, offset, out + m * N + n, N); break;
      case 5: row_dot<5>(x + m * x_stride, x_stride, qrow, srow, zrow, K, group, bits, offset, out + m * N + n, N); break;
      case 4: row_dot<4>(x + m * x_stride, x_stride, qrow, srow, zrow, K, group, bits, offset, out + m * N + n, N); break;
      case 3: row_dot<3>(x + m * x_stride, x_stride, qrow, srow, zrow, K, group, bits, offset, out + m * N + n, N); break;
      case 2: row_dot<2>(x + m * x_stride, x_stride, qrow, srow, zrow, K, group, bits, offset, out + m * N + n, N); break;
      case 1: row_dot<1>(x + m * x_stride, x_stride, qrow, srow, zrow, K, group, bits, offset, out + m * N + n, N); break;
      default: break;
    }
  }
}

PIER_CLONES void dequant_rows(float* out, const uint8_t* q, const float* scales, const float* zeros, int64_t K,
                              int64_t group, int bits, bool offset, int64_t n0, int64_t n1) {
  const int64_t row_bytes = K * bits / 8, groups = K / group;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qrow = q + n * row_bytes;
    float* orow = out + n * K;
    for (int64_t g = 0; g < groups; ++g) {
      const float s = scales[n * groups + g], z = zeros[n * groups + g];
      for (int64_t k = g * group; k < (g + 1) * group; k += bits == 8 ? 16 : 32) {
        if (bits == 8) {
          store16(orow + k, weights8(qrow + k, z, s, offset));
        } else {
          const v16u8 b = load16u8(qrow + k / 2);
          store16(orow + k, dequant(to_float(b & 0xF), z, s, offset));
          store16(orow + k + 16, dequant(to_float(b >> 4), z, s, offset));
        }
      }
    }
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
// AVX-512 (chosen at run time where the CPU has it): the same arithmetic with explicit byte -> int32 ->
// float conversions (vpmovzxbd + vcvtdq2ps), which GCC's vector extensions leave partly scalar.
#define PIER_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
#include <immintrin.h>

// (q - z) * s, or with `offset` q * s + z, the product rounded before the add (see dequant above).
PIER_AVX512 __attribute__((always_inline)) static inline __m512 dequant_512(__m512 qf, __m512 z, __m512 s,
                                                                            bool offset) {
  if (offset) {
    __m512 p = _mm512_mul_ps(qf, s);
    asm("" : "+v"(p));
    return _mm512_add_ps(p, z);
  }
  return _mm512_mul_ps(_mm512_sub_ps(qf, z), s);
}

// W rows n .. n + NT - 1 against R rows of x: each weight vector is de-quantized once for R rows,
// each x vector loaded once for NT weight rows.
template <int R, int NT>
PIER_AVX512 __attribute__((always_inline)) static inline void tile_512(
    const float* __restrict x, int64_t x_stride, const uint8_t* __restrict q, int64_t row_bytes,
    const float* __restrict scales, const float* __restrict zeros, int64_t K, int64_t group, int bits, bool offset,
    float* __restrict out, int64_t out_stride) {
  __m512 acc[NT][R];
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const int64_t groups = K / group;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 s[NT], z[NT];
    for (int j = 0; j < NT; ++j) {
      s[j] = _mm512_set1_ps(scales[j * groups + g]);
      z[j] = _mm512_set1_ps(zeros[j * groups + g]);
    }
    const int64_t k0 = g * group;
    if (bits == 8) {
      for (int64_t k = k0; k < k0 + group; k += 16) {
        __m512 w[NT];
        for (int j = 0; j < NT; ++j) {
          const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * row_bytes + k));
          w[j] = dequant_512(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)), z[j], s[j], offset);
        }
        for (int r = 0; r < R; ++r) {
          const __m512 xv = _mm512_loadu_ps(x + r * x_stride + k);
          for (int j = 0; j < NT; ++j) acc[j][r] = _mm512_fmadd_ps(w[j], xv, acc[j][r]);
        }
      }
    } else {
      for (int64_t k = k0; k < k0 + group; k += 32) {
        __m512 lo[NT], hi[NT];
        for (int j = 0; j < NT; ++j) {
          const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * row_bytes + k / 2));
          lo[j] = dequant_512(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, nibble))), z[j], s[j], offset);
          hi[j] = dequant_512(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), nibble))),
                              z[j], s[j], offset);
        }
        for (int r = 0; r < R; ++r) {
          const __m512 x0 = _mm512_loadu_ps(x + r * x_stride + k), x1 = _mm512_loadu_ps(x + r * x_stride + k + 16);
          for (int j = 0; j < NT; ++j) {
            acc[j][r] = _mm512_fmadd_ps(lo[j], x0, acc[j][r]);
            acc[j][r] = _mm512_fmadd_ps(hi[j], x1, acc[j][r]);
          }
        }
      }
    }
  }
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < R; ++r) out[r * out_stride + j] = _mm512_reduce_add_ps(acc[j][r]);
}

template <int NT>
PIER_AVX512 __attribute__((always_inline)) static inline void rows_512(
    const float* x, int64_t M, int64_t x_stride, const uint8_t* q, int64_t row_bytes, const float* s, const float* z,
    int64_t K, int64_t group, int bits, bool offset, float* out, int64_t N) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) tile_512<6, NT>(x + m * x_stride, x_stride, q, row_bytes, s, z, K, group, bits, offset, out + m * N, N);
  switch (M - m) {
    case 5: tile_512<5, NT>(x + m * x_stride, x_stride, q, row_bytes, s, z, K, group, bits, offset, out + m * N, N); break;
    case 4: tile_512<4, NT>(x + m * x_stride, x_stride, q, row_bytes, s, z, K, group, bits, offset, out + m * N, N); break;
    case 3: tile_512<3, NT>(x + m * x_stride, x_stride, q, row_bytes, s, z, K, group, bits, offset, out + m * N, N); break;
    case 2: tile_512<2, NT>(x + m * x_stride, x_stride, q, row_bytes, s, z, K, group, bits, offset, out + m * N, N); break;
    case 1: tile_512<1, NT>(x + m * x_stride, x_stride, q, row_bytes, s, z, K, group, bits, offset, out + m * N, N); break;
    default: break;
  }
}

PIER_AVX512 void quant_rows_512(const float* x, int64_t M, int64_t x_stride, const uint8_t* q, const float* scales,
                                const float* zeros, int64_t K, int64_t group, int bits, bool offset, float* out,
                                int64_t n0, int64_t n1, int64_t N) {
  const int64_t row_bytes = K * bits / 8, groups = K / group;
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4)
    rows_512<4>(x, M, x_stride, q + n * row_bytes, row_bytes, scales + n * groups, zeros + n * groups, K, group, bits,
                offset, out + n, N);
  for (; n < n1; ++n)
    rows_512<1>(x, M, x_stride, q + n * row_bytes, row_bytes, scales + n * groups, zeros + n * groups, K, group, bits,
                offset, out + n, N);
}

PIER_AVX512 void dequant_rows_512(float* out, const uint8_t* q, const float* scales, const float* zeros, int64_t K,
                                  int64_t group, int bits, bool offset, int64_t n0, int64_t n1) {
  const int64_t row_bytes = K * bits / 8, groups = K / group;
  const __m128i nibble = _mm_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qrow = q + n * row_bytes;
    float* orow = out + n * K;
    for (int64_t g = 0; g < groups; ++g) {
      const __m512 s = _mm512_set1_ps(scales[n * groups + g]), z = _mm512_set1_ps(zeros[n * groups + g]);
      for (int64_t k = g * group; k < (g + 1) * group; k += bits == 8 ? 16 : 32) {
        if (bits == 8) {
          const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qrow + k));
          _mm512_storeu_ps(orow + k, dequant_512(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)), z, s, offset));
        } else {
          const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qrow + k / 2));
          const __m128i lo = _mm_and_si128(b, nibble), hi = _mm_and_si128(_mm_srli_epi16(b, 4), nibble);
          _mm512_storeu_ps(orow + k, dequant_512(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), z, s, offset));
          _mm512_storeu_ps(orow + k + 16, dequant_512(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), z, s, offset));
        }
      }
    }
  }
}

bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return yes;
}
#else
bool has_avx512() { return false; }
void quant_rows_512(const float*, int64_t, int64_t, const uint8_t*, const float*, const float*, int64_t, int64_t,
                    int, bool, float*, int64_t, int64_t, int64_t) {}
void dequant_rows_512(float*, const uint8_t*, const float*, const float*, int64_t, int64_t, int, bool, int64_t,
                      int64_t) {}
#endif

void check_packed(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& zeros, int64_t bits,
                  int64_t group, int64_t K) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant_linear: bits must be 4 or 8");
  TORCH_CHECK(group > 0 && K % group == 0 && group % (bits == 8 ? 16 : 32) == 0,
              "quant_linear: group must divide K and be a multiple of ", bits == 8 ? 16 : 32);
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kByte && q.is_contiguous() && q.dim() == 2 &&
                  q.size(1) == K * bits / 8,
              "quant_linear: q must be a contiguous uint8 [N, K * bits / 8] CPU tensor");
  const int64_t N = q.size(0);
  for (const at::Tensor* t : {&scales, &zeros})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->numel() == N * (K / group),
                "quant_linear: scales and zeros must be contiguous float32 [N, K / group]");
}

void quant_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                  const at::Tensor& zeros, int64_t bits, int64_t group, bool offset) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "quant_linear: x must be float32 [M, K] with rows contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  check_packed(q, scales, zeros, bits, group, K);
  const int64_t N = q.size(0);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == M &&
                  out.size(1) == N,
              "quant_linear: out must be contiguous float32 [M, N]");
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* zp = zeros.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t stride = x.stride(0);
  // about 64 KB of weights per task: enough to pay for a thread's wake-up
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(K * bits / 8, 1));
  const bool avx512 = has_avx512();
  at::parallel_for(0, N, grain, [&](int64_t b, int64_t e) {
    if (avx512)
      quant_rows_512(xp, M, stride, qp, sp, zp, K, group, static_cast<int>(bits), offset, op, b, e, N);
    else
      quant_rows(xp, M, stride, qp, sp, zp, K, group, static_cast<int>(bits), offset, op, b, e, N);
  });
}

void quant_dequantize(at::Tensor& out, const at::Tensor& q, const at::Tensor& scales, const at::Tensor& zeros,
                      int64_t bits, int64_t group, bool offset) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2,
              "quant_dequantize: out must be contiguous float32 [N, K]");
  const int64_t N = out.size(0), K = out.size(1);
  check_packed(q, scales, zeros, bits, group, K);
  TORCH_CHECK(q.size(0) == N, "quant_dequantize: out and q disagree on N");
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* zp = zeros.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(K, 1));
  const bool avx512 = has_avx512();
  at::parallel_for(0, N, grain, [&](int64_t b, int64_t e) {
    if (avx512)
      dequant_rows_512(op, qp, sp, zp, K, group, static_cast<int>(bits), offset, b, e);
    else
      dequant_rows(op, qp, sp, zp, K, group, static_cast<int>(bits), offset, b, e);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pier_llm, m) {
  m.def("quant_linear(Tensor(a!) out, Tensor x, Tensor q, Tensor scales, Tensor zeros, int bits, int group, "
        "bool offset) -> ()");
  m.def("quant_dequantize(Tensor(a!) out, Tensor q, Tensor scales, Tensor zeros, int bits, int group, bool offset) "
        "-> ()");
  m.impl("quant_linear", c10::DispatchKey::CPU, &quant_linear);
  m.impl("quant_dequantize", c10::DispatchKey::CPU, &quant_dequantize);
}
