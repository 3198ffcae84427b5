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
// Vector width is chosen at load time (gcc target_clones: AVX-512, AVX2, or baseline x86-64),
// so the library runs on any x86-64 CPU and uses the widest units it has.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PIER_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define PIER_CLONES
#endif

// exp(x) for x <= 0 (softmax after subtracting the max): 2^n * p(f), n = round(x log2 e),
// |f| <= 1/2, p a degree-7 Taylor polynomial (relative error ~1e-8, below float rounding).
// Written with plain arithmetic so the compiler vectorises the loop that calls it.
static inline float exp_nonpos(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float t = x * 1.4426950408889634f;
  const float n = static_cast<float>(static_cast<int>(t < 0.0f ? t - 0.5f : t + 0.5f));
  const float f = (t - n) * 0.6931471805599453f;
  float p = 1.9841269841269841e-4f;
  p = p * f + 1.3888888888888889e-3f;
  p = p * f + 8.3333333333333333e-3f;
  p = p * f + 4.1666666666666667e-2f;
  p = p * f + 1.6666666666666667e-1f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

struct Task {
  const float* q;       // first of the `group` query heads, head_dim contiguous
  int64_t q_head_stride;
  const float* k;       // this KV head's K: [num_blocks, head_dim, block_size] (block-transposed)
  const float* v;       // this KV head's V: [num_blocks, block_size, head_dim]
  const int32_t* table; // the sequence's block ids
  int ctx;              // tokens to attend over
  float* out;           // first of the `group` output heads, head_dim apart
};

constexpr int kMaxBlock = 64;

// HD / BS: head_dim and block_size when known at compile time (0: read them at run time).
template <int HD, int BS>
__attribute__((always_inline)) inline void attend_impl(const Task& task, int group, int hd_rt, int bs_rt,
                                                       float scale, float* scores, float* acc) {
  const int hd = HD ? HD : hd_rt;
  const int bs = BS ? BS : bs_rt;
  const int ctx = task.ctx;
  const int64_t block_elems = static_cast<int64_t>(bs) * hd;
  // Scores, one block at a time: K is stored [head_dim][block_size] inside a block, so q . k_t
  // for the block's tokens is `head_dim` vector FMAs across the tokens; four partial sums break
  // the dependency chain.
  for (int t0 = 0, blk = 0; t0 < ctx; t0 += bs, ++blk) {
    const float* kb = task.k + static_cast<int64_t>(task.table[blk]) * block_elems;
    const int n = std::min(bs, ctx - t0);
    for (int g = 0; g < group; ++g) {
      const float* qg = task.q + g * task.q_head_stride;
      float s0[kMaxBlock], s1[kMaxBlock], s2[kMaxBlock], s3[kMaxBlock];
#pragma omp simd
      for (int j = 0; j < bs; ++j) s0[j] = s1[j] = s2[j] = s3[j] = 0.0f;
      for (int d = 0; d < hd; d += 4) {
        const float q0 = qg[d], q1 = qg[d + 1], q2 = qg[d + 2], q3 = qg[d + 3];
        const float* r = kb + static_cast<int64_t>(d) * bs;
#pragma omp simd
        for (int j = 0; j < bs; ++j) {
          s0[j] += q0 * r[j];
          s1[j] += q1 * r[bs + j];
          s2[j] += q2 * r[2 * bs + j];
          s3[j] += q3 * r[3 * bs + j];
        }
      }
      float* s = scores + g * ctx + t0;
      for (int j = 0; j < n; ++j) s[j] = ((s0[j] + s1[j]) + (s2[j] + s3[j])) * scale;
    }
  }
  // Softmax per query head; the 1/sum is applied to the output at the end.
  float inv[64];
  for (int g = 0; g < group; ++g) {
    float* s = scores + g * ctx;
    float m = s[0];
    for (int t = 1; t < ctx; ++t) m = s[t] > m ? s[t] : m;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < ctx; ++t) {
      const float e = exp_nonpos(s[t] - m);
      s[t] = e;
      sum += e;
    }
    inv[g] = 1.0f / sum;
  }
  // Weighted sum of V.
  std::fill(acc, acc + group * hd, 0.0f);
  for (int t0 = 0, blk = 0; t0 < ctx; t0 += bs, ++blk) {
    const float* vb = task.v + static_cast<int64_t>(task.table[blk]) * block_elems;
    const int n = std::min(bs, ctx - t0);
    for (int g = 0; g < group; ++g) {
      const float* p = scores + g * ctx + t0;
      float* a = acc + g * hd;
      for (int j = 0; j < n; ++j) {
        const float pj = p[j];
        const float* vt = vb + static_cast<int64_t>(j) * hd;
#pragma omp simd
        for (int d = 0; d < hd; ++d) a[d] += pj * vt[d];
      }
    }
  }
  for (int g = 0; g < group; ++g) {
    float* o = task.out + static_cast<int64_t>(g) * hd;
    const float* a = acc + g * hd;
    const float r = inv[g];
#pragma omp simd
    for (int d = 0; d < hd; ++d) o[d] = a[d] * r;
  }
}

PIER_CLONES void attend_64_16(const Task& t, int group, int hd, int bs, float scale, float* s, float* a) {
  attend_impl<64, 16>(t, group, hd, bs, scale, s, a);
}
PIER_CLONES void attend_128_16(const Task& t, int group, int hd, int bs, float scale, float* s, float* a) {
  attend_impl<128, 16>(t, group, hd, bs, scale, s, a);
}
PIER_CLONES void attend_any(const Task& t, int group, int hd, int bs, float scale, float* s, float* a) {
  attend_impl<0, 0>(t, group, hd, bs, scale, s, a);
}

// out [B, heads * head_dim] (written); q [B, heads, head_dim] (head_dim contiguous, any row and
// head strides); k_cache [kv_heads, num_blocks, head_dim, block_size] and v_cache [kv_heads,
// num_blocks, block_size, head_dim], contiguous;
// block_tables [B, max_blocks] int32; context_lens [B] int32 (each >= 1).
void paged_decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "paged_decode_attention: float32 only");
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
  TORCH_CHECK(hd % 4 == 0 && bs <= kMaxBlock, "head_dim must be a multiple of 4 and block_size at most 64");
  TORCH_CHECK(heads % kvh == 0 && heads / kvh <= 64, "query heads must be a multiple (<= 64) of KV heads");
  TORCH_CHECK(block_tables.size(0) == batch && context_lens.size(0) == batch, "one block table per sequence");
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
    for (int64_t i = 0; i < (lens[b] + bs - 1) / bs; ++i) {
      const int32_t id = tables[b * max_blocks + i];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block id out of range");
    }
  }
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t head_slice = num_blocks * bs * hd;
  const int64_t num_tasks = batch * kvh;
  const float fscale = static_cast<float>(scale);
  // Tasks are dealt round-robin, so threads share long and short sequences alike.
  const int64_t nthreads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_tasks));
  auto attend = hd == 64 && bs == 16 ? attend_64_16 : hd == 128 && bs == 16 ? attend_128_16 : attend_any;
  at::parallel_for(0, nthreads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(group) * max_ctx);
    std::vector<float> acc(static_cast<size_t>(group) * hd);
    for (int64_t tid = begin; tid < end; ++tid) {
      for (int64_t i = tid; i < num_tasks; i += nthreads) {
        const int64_t b = i / kvh;
        const int h = static_cast<int>(i % kvh);
        Task task{qp + b * q.stride(0) + static_cast<int64_t>(h) * group * q.stride(1), q.stride(1),
                  kp + h * head_slice, vp + h * head_slice, tables + b * max_blocks, static_cast<int>(lens[b]),
                  op + (b * heads + static_cast<int64_t>(h) * group) * hd};
        attend(task, group, hd, bs, fscale, scores.data(), acc.data());
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(pier_llm, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor context_lens, float scale) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
}
