// The decoder layer's small per-token operations, fused (CPU, float32).
//
// In plain torch each of these is several ATen calls over the step's tokens (RMSNorm alone is
// pow, mean, add, rsqrt, mul, mul), each one a pass over memory plus dispatch; together they
// were ~12 % of a decode step (bench/llm_bench.py profile). Here each is one pass:
//
//   rms_norm(out, x, weight, eps)        out = weight * (x * rsqrt(mean(x^2) + eps)), per row
//   silu_mul(out, gate_up)               out = silu(gate) * up, gate_up = [gate | up] per row
//   rope_write_kv(qkv, rope, positions, k_cache, v_cache, slots, heads, kv_heads)
//                                        rotates q and k in place inside the fused qkv rows
//                                        (channels stored as interleaved pairs, see llama.py),
//                                        then stores k and v at their cache slots (K
//                                        block-transposed, as paged_attention.cpp reads it);
//                                        with an FP8 cache (pier_fp8.h) k / k_scale and
//                                        v / v_scale are stored, and the values clamped to
//                                        the format's range are counted and returned
//
// Numerics follow Hugging Face's float32 code: RMSNorm scales by the reciprocal root before the
// weight; RoPE is (x0 c - x1 s, x0 s + x1 c). Rows are split over ATen's threads when a step has
// enough of them to pay for it. Vector helpers: pier_vec.h.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "pier_fp8.h"
#include "pier_vec.h"

namespace {

using namespace pier;

// Elements below which a loop runs on the calling thread: waking the pool costs more.
constexpr int64_t kGrainElems = 1 << 15;

int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(row_elems, 1)); }

void check_float_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
}

// -- RMSNorm ---------------------------------------------------------------------------------------

PIER_CLONES void rms_norm_rows(float* __restrict out, const float* __restrict x, const float* __restrict w,
                               int64_t rows, int64_t hidden, int64_t x_stride, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * x_stride;
    float* orow = out + r * hidden;
    float acc[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= hidden; i += 16)
      for (int j = 0; j < 16; ++j) acc[j] += xr[i + j] * xr[i + j];
    float sum = 0.0f;
    for (; i < hidden; ++i) sum += xr[i] * xr[i];
    for (int j = 0; j < 16; ++j) sum += acc[j];
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + eps);
    for (i = 0; i < hidden; ++i) orow[i] = w[i] * (xr[i] * inv);
  }
}

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_float_cpu(x, "x");
  check_float_cpu(weight, "weight");
  check_float_cpu(out, "out");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [N, hidden] with rows contiguous");
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == hidden, "rms_norm: weight must be [hidden]");
  TORCH_CHECK(out.is_contiguous() && out.numel() == rows * hidden, "rms_norm: out must be contiguous [N, hidden]");
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t stride = x.stride(0);
  at::parallel_for(0, rows, grain_rows(hidden), [&](int64_t b, int64_t e) {
    rms_norm_rows(op + b * hidden, xp + b * stride, wp, e - b, hidden, stride, static_cast<float>(eps));
  });
}

// -- SiLU(gate) * up -------------------------------------------------------------------------------

PIER_CLONES void silu_mul_rows(float* __restrict out, const float* __restrict gu, int64_t rows, int64_t inter,
                               int64_t gu_stride) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * gu_stride;
    const float* u = g + inter;
    float* o = out + r * inter;
    int64_t i = 0;
    for (; i + 16 <= inter; i += 16) {
      const v16 gv = load16(g + i);
      store16(o + i, gv / (1.0f + exp16(-gv)) * load16(u + i));
    }
    for (; i < inter; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  }
}

void silu_mul(at::Tensor& out, const at::Tensor& gate_up) {
  check_float_cpu(gate_up, "gate_up");
  check_float_cpu(out, "out");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be [N, 2 * intermediate] with rows contiguous");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  TORCH_CHECK(out.is_contiguous() && out.numel() == rows * inter, "silu_mul: out must be contiguous [N, intermediate]");
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t stride = gate_up.stride(0);
  at::parallel_for(0, rows, grain_rows(2 * inter), [&](int64_t b, int64_t e) {
    silu_mul_rows(op + b * inter, gp + b * stride, e - b, inter, stride);
  });
}

// -- RoPE + K/V cache write ------------------------------------------------------------------------

PIER_CLONES void rope_rows(float* __restrict qkv, const float* __restrict rope, const int64_t* __restrict pos,
                           int64_t begin, int64_t end, int64_t row_stride, int rot_heads, int hd) {
  const int half = hd / 2;
  for (int64_t r = begin; r < end; ++r) {
    float* x = qkv + r * row_stride;
    const float* cs = rope + pos[r] * hd;  // [half, 2]: (cos, sin) pairs
    for (int h = 0; h < rot_heads; ++h) {
      float* xh = x + static_cast<int64_t>(h) * hd;
      for (int i = 0; i < half; ++i) {
        const float x0 = xh[2 * i], x1 = xh[2 * i + 1];
        const float c = cs[2 * i], s = cs[2 * i + 1];
        xh[2 * i] = x0 * c - x1 * s;
        xh[2 * i + 1] = x0 * s + x1 * c;
      }
    }
  }
}

int64_t rope_write_kv(at::Tensor& qkv, const at::Tensor& rope, const at::Tensor& positions, at::Tensor& k_cache,
                      at::Tensor& v_cache, const at::Tensor& slots, int64_t heads, int64_t kv_heads, double k_scale,
                      double v_scale) {
  check_float_cpu(qkv, "qkv");
  check_float_cpu(rope, "rope");
  const at::ScalarType kind = k_cache.scalar_type();
  const bool fp8 = is_fp8(kind);
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu() && v_cache.scalar_type() == kind &&
                  (kind == at::kFloat || fp8),
              "rope_write_kv: k_cache and v_cache must be CPU tensors, both float32 or both of one FP8 format");
  TORCH_CHECK(k_scale > 0.0 && v_scale > 0.0, "rope_write_kv: k_scale and v_scale must be positive");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong && positions.is_contiguous() &&
                  slots.is_contiguous(),
              "rope_write_kv: positions and slots must be contiguous int64");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.size(0) == kv_heads && v_cache.size(0) == kv_heads && k_cache.size(1) == v_cache.size(1) &&
                  k_cache.size(2) == v_cache.size(3) && k_cache.size(3) == v_cache.size(2),
              "rope_write_kv: k_cache [kv_heads, num_blocks, head_dim, block_size] and v_cache [kv_heads, "
              "num_blocks, block_size, head_dim] must be contiguous");
  const int64_t n = qkv.size(0);
  const int hd = static_cast<int>(v_cache.size(3));
  const int64_t bs = v_cache.size(2), num_blocks = v_cache.size(1);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (heads + 2 * kv_heads) * hd,
              "rope_write_kv: qkv must be [N, (heads + 2 * kv_heads) * head_dim] with rows contiguous");
  TORCH_CHECK(hd % 2 == 0 && rope.is_contiguous() && rope.dim() == 3 && rope.size(1) == hd / 2 && rope.size(2) == 2,
              "rope_write_kv: rope must be [max_positions, head_dim / 2, 2]");
  TORCH_CHECK(positions.numel() == n && slots.numel() == n, "rope_write_kv: one position and one slot per token");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t max_pos = rope.size(0), num_slots = num_blocks * bs;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(pos[i] >= 0 && pos[i] < max_pos, "rope_write_kv: position out of range");
    TORCH_CHECK(slot[i] >= 0 && slot[i] < num_slots, "rope_write_kv: slot out of range");
  }
  float* x = qkv.data_ptr<float>();
  const float* cs = rope.data_ptr<float>();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const float kinv = static_cast<float>(1.0 / k_scale), vinv = static_cast<float>(1.0 / v_scale);
  const float fmax = fp8 ? fp8_max(kind) : 0.0f;
  const bool e4m3 = kind == at::kFloat8_e4m3fn;
  std::atomic<int64_t> clamped{0};
  const int64_t row_stride = qkv.stride(0);
  const int rot_heads = static_cast<int>(heads + kv_heads);
  const int64_t head_slice = num_blocks * bs * hd;
  at::parallel_for(0, n, grain_rows(row_stride), [&](int64_t b, int64_t e) {
    rope_rows(x, cs, pos, b, e, row_stride, rot_heads, hd);
    for (int64_t r = b; r < e; ++r) {
      const int64_t blk = slot[r] / bs, off = slot[r] % bs;
      const float* k = x + r * row_stride + heads * hd;
      const float* v = k + kv_heads * hd;
      const int64_t kpos = blk * hd * bs + off, vpos = (blk * bs + off) * hd;  // K: [head_dim, block_size] block
      if (!fp8) {
        for (int64_t h = 0; h < kv_heads; ++h) {
          float* kdst = reinterpret_cast<float*>(kc) + h * head_slice + kpos;
          for (int d = 0; d < hd; ++d) kdst[d * bs] = k[h * hd + d];
          std::memcpy(reinterpret_cast<float*>(vc) + h * head_slice + vpos, v + h * hd, sizeof(float) * hd);
        }
        continue;
      }
      int64_t n_clamped = 0;
      for (int64_t h = 0; h < kv_heads; ++h) {
        uint8_t* kdst = reinterpret_cast<uint8_t*>(kc) + h * head_slice + kpos;
        uint8_t* vdst = reinterpret_cast<uint8_t*>(vc) + h * head_slice + vpos;
        for (int d = 0; d < hd; ++d) kdst[d * bs] = fp8_store(k[h * hd + d], kinv, fmax, e4m3, n_clamped);
        for (int d = 0; d < hd; ++d) vdst[d] = fp8_store(v[h * hd + d], vinv, fmax, e4m3, n_clamped);
      }
      if (n_clamped) clamped += n_clamped;
    }
  });
  return clamped.load();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pier_llm, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("silu_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def(
      "rope_write_kv(Tensor(a!) qkv, Tensor rope, Tensor positions, Tensor(b!) k_cache, Tensor(c!) v_cache, "
      "Tensor slots, int heads, int kv_heads, float k_scale=1., float v_scale=1.) -> int");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("silu_mul", c10::DispatchKey::CPU, &silu_mul);
  m.impl("rope_write_kv", c10::DispatchKey::CPU, &rope_write_kv);
}
