// Decode attention read straight from the paged KV cache (CPU, float32).
//
// One query token per sequence. The cache layout is Pier's kernel layout: per layer, V is
// [num_kv_heads, num_blocks, block_size, head_dim] and K is block-transposed, [num_kv_heads,
// num_blocks, head_dim, block_size], so that scoring a block is plain vector FMAs across its
// tokens (no horizontal sums). Both contiguous. Each (sequence, KV head) task
// scores the sequence's context block by block through its block table, takes the softmax and
// sums V, for the `group` query heads that share the KV head. Nothing is gathered or padded: a
// task reads exactly its own blocks once for K and once for V.
//
// Two options of the attention itself: `softcap` > 0 caps each scaled score, cap * tanh(s / cap)
// (Gemma 2), and `window` > 0 attends only to the last `window` tokens (sliding-window layers):
// a task then starts at the block holding the window's first token, so blocks before it (which a
// sliding-window layer may already have given back) are never read, and the window's first
// block's earlier tokens are left out of the softmax.
//
// An FP8 cache (float8_e4m3fn or float8_e5m2, pier_fp8.h) is read in place too: each task decodes
// its own blocks through a 256-entry table into a per-thread float buffer laid out as the float
// cache is, then runs the same float code over it; `k_scale` is folded into the softmax scale and
// `v_scale` applied once to the output, as vLLM's CPU FP8 attention does.
//
// Vector width is chosen at load time (target_clones, see pier_vec.h).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "pier_fp8.h"
#include "pier_vec.h"

namespace {

using namespace pier;

struct Task {
  const float* q;       // first of the `group` query heads, head_dim contiguous
  int64_t q_head_stride;
  const float* k;       // this KV head's K: [num_blocks, head_dim, block_size] (block-transposed)
  const float* v;       // this KV head's V: [num_blocks, block_size, head_dim]
  const int32_t* table; // the sequence's block ids
  int ctx;              // tokens to attend over, from the table's first block
  float* out;           // first of the `group` output heads, head_dim apart
  int masked;           // the first `masked` of those tokens are outside the window (< block_size)
  float softcap;        // > 0: scores capped at +-softcap (tanh)
};

// With a window or a cap: cap the scores, push the tokens before the window far below the rest
// (exp then clamps them to ~1e-38, and `unmask` zeroes them), and return the max of the others.
inline float cap_and_mask(float* s, int ctx, const Task& task) {
  float m = -3.0e38f;
  for (int t = 0; t < ctx; ++t) {
    if (t < task.masked) {
      s[t] = -3.0e38f;
      continue;
    }
    if (task.softcap > 0.0f) s[t] = task.softcap * std::tanh(s[t] / task.softcap);
    m = s[t] > m ? s[t] : m;
  }
  return m;
}

inline void unmask(float* s, const Task& task) {
  for (int t = 0; t < task.masked; ++t) s[t] = 0.0f;
}

constexpr int kMaxBlock = 64;
constexpr int kMaxHead = 256;

// HD / BS: head_dim and block_size when known at compile time (0: read them at run time).
// P: independent partial sums in the scoring loop (head_dim must be a multiple of it).
template <int HD, int BS, int P>
__attribute__((always_inline)) inline void attend_impl(const Task& task, int group, int hd_rt, int bs_rt,
                                                       float scale, float* scores) {
  const int hd = HD ? HD : hd_rt;
  const int bs = BS ? BS : bs_rt;
  const int ctx = task.ctx;
  const int64_t block_elems = static_cast<int64_t>(bs) * hd;
  // Scores, one block at a time: K is stored [head_dim][block_size] inside a block, so q . k_t
  // for the block's tokens is `head_dim` vector FMAs across the tokens; P partial sums keep P
  // FMA chains in flight instead of one.
  for (int t0 = 0, blk = 0; t0 < ctx; t0 += bs, ++blk) {
    const float* kb = task.k + static_cast<int64_t>(task.table[blk]) * block_elems;
    const int n = std::min(bs, ctx - t0);
    for (int g = 0; g < group; ++g) {
      const float* qg = task.q + g * task.q_head_stride;
      float part[P][kMaxBlock];
      for (int u = 0; u < P; ++u) {
#pragma omp simd
        for (int j = 0; j < bs; ++j) part[u][j] = 0.0f;
      }
      for (int d = 0; d < hd; d += P) {
        const float* r = kb + static_cast<int64_t>(d) * bs;
        for (int u = 0; u < P; ++u) {
          const float qd = qg[d + u];
#pragma omp simd
          for (int j = 0; j < bs; ++j) part[u][j] += qd * r[u * bs + j];
        }
      }
      for (int u = 1; u < P; ++u) {
#pragma omp simd
        for (int j = 0; j < bs; ++j) part[0][j] += part[u][j];
      }
      float* s = scores + g * ctx + t0;
      for (int j = 0; j < n; ++j) s[j] = part[0][j] * scale;
    }
  }
  for (int g = 0; g < group; ++g) {
    // Softmax; the 1/sum is applied to the output at the end.
    float* s = scores + g * ctx;
    float m = s[0];
    if (task.masked || task.softcap > 0.0f) {
      m = cap_and_mask(s, ctx, task);
    } else {
      for (int t = 1; t < ctx; ++t) m = s[t] > m ? s[t] : m;
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < ctx; ++t) {
      const float e = exp_nonpos(s[t] - m);
      s[t] = e;
      sum += e;
    }
    unmask(s, task);
    // Weighted sum of V into local accumulators (two, for even and odd tokens: two FMA chains).
    float a0[HD ? HD : kMaxHead], a1[HD ? HD : kMaxHead];
#pragma omp simd
    for (int d = 0; d < hd; ++d) a0[d] = a1[d] = 0.0f;
    for (int t0 = 0, blk = 0; t0 < ctx; t0 += bs, ++blk) {
      const float* vb = task.v + static_cast<int64_t>(task.table[blk]) * block_elems;
      const float* p = s + t0;
      const int n = std::min(bs, ctx - t0);
      int j = 0;
      for (; j + 1 < n; j += 2) {
        const float p0 = p[j], p1 = p[j + 1];
        const float* v0 = vb + static_cast<int64_t>(j) * hd;
        const float* v1 = v0 + hd;
#pragma omp simd
        for (int d = 0; d < hd; ++d) {
          a0[d] += p0 * v0[d];
          a1[d] += p1 * v1[d];
        }
      }
      if (j < n) {
        const float p0 = p[j];
        const float* v0 = vb + static_cast<int64_t>(j) * hd;
#pragma omp simd
        for (int d = 0; d < hd; ++d) a0[d] += p0 * v0[d];
      }
    }
    float* o = task.out + static_cast<int64_t>(g) * hd;
    const float r = 1.0f / sum;
#pragma omp simd
    for (int d = 0; d < hd; ++d) o[d] = (a0[d] + a1[d]) * r;
  }
}

// The block_size 16 and 32 path, written with GCC vector extensions: a v16 is 16 tokens of a K
// block row or 16 channels of a V row. HD: head_dim if known at compile time.
template <int HD, int BS>
__attribute__((always_inline)) inline void attend16_impl(const Task& task, int group, int hd_rt, float scale,
                                                         float* scores) {
  constexpr int bs = BS;
  constexpr int W = 16;  // tokens per v16 chunk; a block holds bs / W chunks
  const int hd = HD ? HD : hd_rt;
  const int ctx = task.ctx;
  const int64_t block_elems = static_cast<int64_t>(bs) * hd;
  const int nblocks = (ctx + bs - 1) / bs;
  const int nchunks = (ctx + W - 1) / W;
  for (int g = 0; g < group; ++g) {
    const float* qg = task.q + g * task.q_head_stride;
    float* s = scores + g * ctx;
    // Scores: 8 partial sums over the channels, 8 FMA chains in flight.
    v16 mx = v16{} - 3.0e38f;
    for (int c = 0; c < nchunks; ++c) {
      const float* kb = task.k + static_cast<int64_t>(task.table[c / (bs / W)]) * block_elems + (c % (bs / W)) * W;
      v16 p0 = {}, p1 = {}, p2 = {}, p3 = {}, p4 = {}, p5 = {}, p6 = {}, p7 = {};
      for (int d = 0; d < hd; d += 8) {
        const float* r = kb + d * bs;
        p0 += qg[d] * load16(r);
        p1 += qg[d + 1] * load16(r + bs);
        p2 += qg[d + 2] * load16(r + 2 * bs);
        p3 += qg[d + 3] * load16(r + 3 * bs);
        p4 += qg[d + 4] * load16(r + 4 * bs);
        p5 += qg[d + 5] * load16(r + 5 * bs);
        p6 += qg[d + 6] * load16(r + 6 * bs);
        p7 += qg[d + 7] * load16(r + 7 * bs);
      }
      const v16 sc = (((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))) * scale;
      const int n = std::min(W, ctx - c * W);
      if (n == W) {
        std::memcpy(s + c * W, &sc, sizeof(sc));
        mx = mx > sc ? mx : sc;
      } else {
        for (int j = 0; j < n; ++j) s[c * W + j] = sc[j];
      }
    }
    float m = mx[0];
    if (task.masked || task.softcap > 0.0f) {
      m = cap_and_mask(s, ctx, task);
    } else {
      for (int j = 1; j < W; ++j) m = mx[j] > m ? mx[j] : m;
      for (int t = (ctx / W) * W; t < ctx; ++t) m = s[t] > m ? s[t] : m;
    }
    // Softmax numerators; 1/sum is applied to the output.
    v16 sums = {};
    int t = 0;
    for (; t + W <= ctx; t += W) {
      const v16 e = exp16(load16(s + t) - m);
      std::memcpy(s + t, &e, sizeof(e));
      sums += e;
    }
    float sum = 0.0f;
    for (int j = 0; j < W; ++j) sum += sums[j];
    for (; t < ctx; ++t) {
      s[t] = exp_nonpos(s[t] - m);
      sum += s[t];
    }
    unmask(s, task);
    // Weighted sum of V: head_dim / 16 accumulators, two sets (even and odd tokens).
    constexpr int kChunks = HD ? HD / 16 : kMaxHead / 16;
    const int chunks = hd / 16;
    v16 a0[kChunks], a1[kChunks];
    for (int c = 0; c < chunks; ++c) a0[c] = a1[c] = v16{};
    for (int blk = 0; blk < nblocks; ++blk) {
      const float* vb = task.v + static_cast<int64_t>(task.table[blk]) * block_elems;
      const float* p = s + blk * bs;
      const int n = std::min(bs, ctx - blk * bs);
      int j = 0;
      for (; j + 1 < n; j += 2) {
        const float w0 = p[j], w1 = p[j + 1];
        const float* v0 = vb + j * hd;
        for (int c = 0; c < chunks; ++c) {
          a0[c] += w0 * load16(v0 + 16 * c);
          a1[c] += w1 * load16(v0 + hd + 16 * c);
        }
      }
      if (j < n) {
        const float w0 = p[j];
        const float* v0 = vb + j * hd;
        for (int c = 0; c < chunks; ++c) a0[c] += w0 * load16(v0 + 16 * c);
      }
    }
    float* o = task.out + static_cast<int64_t>(g) * hd;
    const float r = 1.0f / sum;
    for (int c = 0; c < chunks; ++c) {
      const v16 res = (a0[c] + a1[c]) * r;
      std::memcpy(o + 16 * c, &res, sizeof(res));
    }
  }
}

PIER_CLONES void attend_64_16(const Task& t, int group, int hd, int, float scale, float* s) {
  attend16_impl<64, 16>(t, group, hd, scale, s);
}
PIER_CLONES void attend_128_16(const Task& t, int group, int hd, int, float scale, float* s) {
  attend16_impl<128, 16>(t, group, hd, scale, s);
}
PIER_CLONES void attend_x_16(const Task& t, int group, int hd, int, float scale, float* s) {
  attend16_impl<0, 16>(t, group, hd, scale, s);
}
PIER_CLONES void attend_x_32(const Task& t, int group, int hd, int, float scale, float* s) {
  attend16_impl<0, 32>(t, group, hd, scale, s);
}
PIER_CLONES void attend_any(const Task& t, int group, int hd, int bs, float scale, float* s) {
  attend_impl<0, 0, 4>(t, group, hd, bs, scale, s);
}

// The first block a context of `ctx` tokens reads under `window` (0: none).
int64_t first_block(int64_t ctx, int64_t window, int64_t bs) {
  return window > 0 && ctx > window ? (ctx - window) / bs : 0;
}

// out [B, heads * head_dim] (written); q [B, heads, head_dim] (head_dim contiguous, any row and
// head strides); k_cache [kv_heads, num_blocks, head_dim, block_size] and v_cache [kv_heads,
// num_blocks, block_size, head_dim], contiguous, float32 or both of one FP8 format (k_scale, v_scale);
// block_tables [B, max_blocks] int32; context_lens [B] int32 (each >= 1); softcap > 0 caps the
// scores; window > 0 attends to the last `window` tokens only (entries of a table before the
// window's first block are never read).
// Byte codes of `n` cache elements -> floats.
PIER_CLONES void decode_fp8(float* __restrict dst, const uint8_t* __restrict src, int64_t n,
                            const float* __restrict lut) {
  for (int64_t i = 0; i < n; ++i) dst[i] = lut[src[i]];
}

void paged_decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale, double softcap, int64_t window,
                            double k_scale, double v_scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_decode_attention: CPU tensors only");
  const at::ScalarType kind = k_cache.scalar_type();
  const bool fp8 = is_fp8(kind);
  TORCH_CHECK(q.scalar_type() == at::kFloat && (kind == at::kFloat || fp8) && v_cache.scalar_type() == kind &&
                  out.scalar_type() == at::kFloat,
              "paged_decode_attention: float32 only (q, out and the cache), or both caches of one FP8 format");
  TORCH_CHECK(k_scale > 0.0 && v_scale > 0.0, "paged_decode_attention: k_scale and v_scale must be positive");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "paged_decode_attention: block_tables and context_lens must be int32");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [B, heads, head_dim] with head_dim contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.size(0) == v_cache.size(0) && k_cache.size(1) == v_cache.size(1) &&
                  k_cache.size(2) == v_cache.size(3) && k_cache.size(3) == v_cache.size(2),
              "k_cache [kv_heads, num_blocks, head_dim, block_size] and v_cache [kv_heads, num_blocks, "
              "block_size, head_dim] must be contiguous");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.is_contiguous() && context_lens.is_contiguous(),
              "block_tables must be a contiguous [B, max_blocks] tensor");
  const int64_t batch = q.size(0);
  const int heads = static_cast<int>(q.size(1));
  const int hd = static_cast<int>(q.size(2));
  const int kvh = static_cast<int>(v_cache.size(0));
  const int bs = static_cast<int>(v_cache.size(2));
  TORCH_CHECK(v_cache.size(3) == hd, "head_dim differs between q and the cache");
  TORCH_CHECK(hd % 4 == 0 && hd <= kMaxHead && bs <= kMaxBlock,
              "head_dim must be a multiple of 4 up to 256, and block_size at most 64");
  TORCH_CHECK(heads % kvh == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.size(0) == batch && context_lens.size(0) == batch, "one block table per sequence");
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "window and softcap must not be negative");
  TORCH_CHECK(out.is_contiguous() && out.numel() == batch * heads * hd, "out must be contiguous [B, heads*head_dim]");
  const int group = heads / kvh;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t num_blocks = k_cache.size(1);
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  int max_ctx = 1;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * bs, "context length out of range for its block table");
    max_ctx = std::max(max_ctx, static_cast<int>(lens[b]));
    for (int64_t i = first_block(lens[b], window, bs); i < (lens[b] + bs - 1) / bs; ++i) {
      const int32_t id = tables[b * max_blocks + i];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block id out of range");
    }
  }
  const float* qp = q.data_ptr<float>();
  const char* kp = static_cast<const char*>(k_cache.data_ptr());
  const char* vp = static_cast<const char*>(v_cache.data_ptr());
  const int64_t elem = fp8 ? 1 : static_cast<int64_t>(sizeof(float));
  float lut[256];
  if (fp8) fp8_table(kind, lut);
  const float fv_scale = static_cast<float>(v_scale);
  float* op = out.data_ptr<float>();
  const int64_t head_slice = num_blocks * bs * hd;
  const int64_t num_tasks = batch * kvh;
  const float fscale = static_cast<float>(scale * (fp8 ? k_scale : 1.0));
  const float fsoftcap = static_cast<float>(softcap);
  // Tasks are dealt round-robin, so threads share long and short sequences alike.
  const int64_t nthreads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_tasks));
  auto attend = hd % 16                    ? attend_any
                : bs == 32                   ? attend_x_32
                : bs != 16                   ? attend_any
                : hd == 64                   ? attend_64_16
                : hd == 128                  ? attend_128_16
                                             : attend_x_16;
  at::parallel_for(0, nthreads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(group) * max_ctx);
    // FP8: the task's blocks decoded, [blocks][block] as in the cache, read through an identity table.
    const int64_t block_elems = static_cast<int64_t>(bs) * hd;
    std::vector<float> kbuf(fp8 ? max_blocks * block_elems : 0), vbuf(fp8 ? max_blocks * block_elems : 0);
    std::vector<int32_t> iota(fp8 ? max_blocks : 0);
    for (size_t i = 0; i < iota.size(); ++i) iota[i] = static_cast<int32_t>(i);
    for (int64_t tid = begin; tid < end; ++tid) {
      for (int64_t i = tid; i < num_tasks; i += nthreads) {
        const int64_t b = i / kvh;
        const int h = static_cast<int>(i % kvh);
        const int ctx = static_cast<int>(lens[b]);
        const int skip = static_cast<int>(first_block(ctx, window, bs));  // blocks wholly before the window
        const int first = window > 0 && ctx > window ? ctx - static_cast<int>(window) : 0;
        const char* kh = kp + h * head_slice * elem;
        const char* vh = vp + h * head_slice * elem;
        Task task{qp + b * q.stride(0) + static_cast<int64_t>(h) * group * q.stride(1), q.stride(1),
                  reinterpret_cast<const float*>(kh), reinterpret_cast<const float*>(vh),
                  tables + b * max_blocks + skip, ctx - skip * bs,
                  op + (b * heads + static_cast<int64_t>(h) * group) * hd, first - skip * bs, fsoftcap};
        if (!fp8) {
          attend(task, group, hd, bs, fscale, scores.data());
          continue;
        }
        const int nb = (task.ctx + bs - 1) / bs;
        for (int j = 0; j < nb; ++j) {
          const int64_t at = static_cast<int64_t>(task.table[j]) * block_elems;
          decode_fp8(kbuf.data() + j * block_elems, reinterpret_cast<const uint8_t*>(kh) + at, block_elems, lut);
          decode_fp8(vbuf.data() + j * block_elems, reinterpret_cast<const uint8_t*>(vh) + at, block_elems, lut);
        }
        task.k = kbuf.data();
        task.v = vbuf.data();
        task.table = iota.data();
        attend(task, group, hd, bs, fscale, scores.data());
        for (int64_t e = 0; e < static_cast<int64_t>(group) * hd; ++e) task.out[e] *= fv_scale;
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(pier_llm, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor context_lens, float scale, float softcap=0., int window=0, float k_scale=1., float v_scale=1.) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
}
