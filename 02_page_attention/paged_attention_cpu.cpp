// Paged decode attention for the CPU: one query token per sequence, reading K and V where they
// lie in the block-paged cache (no gather copy), one pass of float32 math per query head.
//
// Built on first use by paged_attention_cpu.py (torch.utils.cpp_extension). Layouts are the
// chapter's: q [B, Hq, D]; k_cache / v_cache [num_blocks, block_size, Hkv, D]; block_tables
// [B, max_blocks] int32; context_lens [B] int32; the result is [B, Hq, D] in q's dtype.
//
// Why it is faster than gather + scaled_dot_product_attention on a CPU: the torch path copies
// every sequence's blocks into a padded [B, L, Hkv, D] tensor, pads short sequences to the
// longest, and runs SDPA's flash kernel, whose tiles are built for many query rows, with the one
// or few query rows of a decode. Here each (sequence, query head) is a work item that streams its
// own keys once for the scores and its values once for the output, with no padding and no copy.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

// bfloat16 is the top half of a float32: a shift the compiler vectorizes (c10's conversion does
// not always inline into a vector loop).
template <>
inline float to_float<at::BFloat16>(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

struct Shape {
  int64_t num_seqs, num_q_heads, num_kv_heads, block_size, max_blocks, max_len;
};

template <typename T, int D>
void decode(const T* q, const T* k_cache, const T* v_cache, const int* block_tables, const int* context_lens,
            T* out, const Shape& s, float scale) {
  const int64_t group = s.num_q_heads / s.num_kv_heads;
  const int64_t token_stride = s.num_kv_heads * D;  // from one cached token to the next in a block
  const int64_t block_stride = s.block_size * token_stride;
  at::parallel_for(0, s.num_seqs * s.num_q_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(s.max_len);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / s.num_q_heads;
      const int64_t kv_head = item % s.num_q_heads / group;
      const int64_t len = context_lens[seq];
      const int* table = block_tables + seq * s.max_blocks;
      float query[D], acc[D];
      for (int d = 0; d < D; ++d) query[d] = to_float(q[item * D + d]) * scale;

      // Scores q . k for every cached token, block by block, and their maximum.
      float max_score = std::numeric_limits<float>::lowest();  // finite: -ffast-math assumes no infinities
      for (int64_t start = 0, b = 0; start < len; start += s.block_size, ++b) {
        const T* keys = k_cache + table[b] * block_stride + kv_head * D;
        const int64_t n = std::min(s.block_size, len - start);
        for (int64_t j = 0; j < n; ++j) {
          const T* key = keys + j * token_stride;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int d = 0; d < D; ++d) dot += query[d] * to_float(key[d]);
          scores[start + j] = dot;
          max_score = std::max(max_score, dot);
        }
      }
      // Softmax weights, unnormalized (divided once at the end).
      float total = 0.f;
#pragma omp simd reduction(+ : total)
      for (int64_t t = 0; t < len; ++t) {
        scores[t] = std::exp(scores[t] - max_score);
        total += scores[t];
      }
      // Weighted sum of the values.
      std::fill(acc, acc + D, 0.f);
      for (int64_t start = 0, b = 0; start < len; start += s.block_size, ++b) {
        const T* values = v_cache + table[b] * block_stride + kv_head * D;
        const int64_t n = std::min(s.block_size, len - start);
        for (int64_t j = 0; j < n; ++j) {
          const T* value = values + j * token_stride;
          const float p = scores[start + j];
#pragma omp simd
          for (int d = 0; d < D; ++d) acc[d] += p * to_float(value[d]);
        }
      }
      const float inv_total = 1.f / total;
      for (int d = 0; d < D; ++d) out[item * D + d] = static_cast<T>(acc[d] * inv_total);
    }
  });
}

template <typename T>
void dispatch_head_dim(int64_t head_dim, const T* q, const T* k, const T* v, const int* bt, const int* lens, T* out,
                       const Shape& s, float scale) {
  switch (head_dim) {
    case 16: return decode<T, 16>(q, k, v, bt, lens, out, s, scale);
    case 32: return decode<T, 32>(q, k, v, bt, lens, out, s, scale);
    case 64: return decode<T, 64>(q, k, v, bt, lens, out, s, scale);
    case 128: return decode<T, 128>(q, k, v, bt, lens, out, s, scale);
    case 256: return decode<T, 256>(q, k, v, bt, lens, out, s, scale);
    default: TORCH_CHECK_VALUE(false, "head_dim must be one of 16, 32, 64, 128, 256, got ", head_dim);
  }
}

}  // namespace

// Shapes and dtypes are checked by the Python wrapper; what could make this code read outside
// the cache (lengths, block ids) is checked here, where it is cheap.
torch::Tensor paged_attention_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  auto tables = block_tables.to(torch::kInt32).contiguous();
  auto lens = context_lens.to(torch::kInt32).contiguous();
  q = q.contiguous();
  TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous(), "k_cache and v_cache must be contiguous");
  Shape s{q.size(0), q.size(1), k_cache.size(2), k_cache.size(1), tables.size(1), 0};
  const int64_t num_blocks = k_cache.size(0);
  const int* table_data = tables.data_ptr<int>();
  const int* len_data = lens.data_ptr<int>();
  for (int64_t seq = 0; seq < s.num_seqs; ++seq) {
    const int64_t len = len_data[seq];
    TORCH_CHECK_VALUE(len >= 1 && len <= s.max_blocks * s.block_size, "context_lens[", seq, "] = ", len,
                      " must be in [1, ", s.max_blocks * s.block_size, "] (the blocks block_tables has room for)");
    for (int64_t b = 0; b * s.block_size < len; ++b) {
      const int block = table_data[seq * s.max_blocks + b];
      TORCH_CHECK_VALUE(block >= 0 && block < num_blocks, "block_tables[", seq, ", ", b, "] = ", block,
                        " is not a block of the cache (", num_blocks, " blocks)");
    }
    s.max_len = std::max(s.max_len, len);
  }
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention_decode", [&] {
    dispatch_head_dim<scalar_t>(q.size(2), q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                                v_cache.data_ptr<scalar_t>(), table_data, len_data, out.data_ptr<scalar_t>(), s,
                                static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_decode", &paged_attention_decode,
        "Paged decode attention on the CPU: q [B, Hq, D] over k/v_cache [blocks, block_size, Hkv, D]");
}
