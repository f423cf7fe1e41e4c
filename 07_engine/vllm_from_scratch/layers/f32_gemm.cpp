// y = x W^T (+ bias) for float32 x [M, K] and W [N, K] on a CPU with AVX2 and FMA, for any M:
// faster than oneDNN's packed GEMM for the few rows of a decode step, as fast for a prompt's.
//
// Built on first use by f32_gemm.py, where the CPU has AVX2 and FMA. W is packed once, after
// loading, so that every load of it is one whole register: packed[b][e] holds element e of K of
// the 8 output columns of block b ([N/8][K][8], zeros past N).
//
// A tile of NR column blocks is one work item: its packed weights are contiguous (NR x K x 32
// bytes), read once from memory by the first MR rows and from the L2 cache by the next. For each
// element of K, x's element broadcast to every lane meets the tile's NR weight registers: MR x NR
// independent float32 sums, 12 of AVX2's 16 registers, so the two FMA units never wait on one.
// The sums must stay in registers: every loop over them is unrolled, or the compiler keeps them
// on the stack and a store per FMA halves the speed. oneDNN's float32 GEMM, whose tiles suit
// large M, reads a weight half as fast at a few rows (07_engine/topics/other_cpus.md).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <utility>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "f32_gemm.cpp needs a CPU with AVX2 and FMA (f32_gemm.py only builds it on one)"
#endif

namespace {

constexpr int64_t kBlock = 8;  // output columns per packed block: one register of float32 sums
constexpr int MR = 4;          // rows of a tile
constexpr int NR = 3;          // column blocks of a tile

// The last row tiles of a tile (at most kAheadTiles of them, each a share of K) prefetch the
// next tile's weights into L2, so that its first rows find them there rather than in memory.
constexpr int64_t kAheadTiles = 8;

// The bytes of x's rows one pass over the tiles reads: half of a Zen 3 core's 512 KB L2. Without
// the bands, a matmul of 512 rows streamed all of x (1-3 MB) from L3 for every tile, 20-25 %
// slower than oneDNN there; with them, as fast.
constexpr int64_t kBandBytes = 256 * 1024;

struct Problem {
  const float* x;     // [M, K]
  const float* w;     // packed [N/8][K][8]
  const float* bias;  // [N] or nullptr
  float* y;           // [M, N]
  int64_t m, n, k;
};

// Rows [row, row + R) of x times column blocks [block, block + C), stored to y; with kAhead,
// also elements [ahead_from, ahead_to) of K of the C blocks at `ahead` prefetched into L2.
template <int R, int C, bool kAhead = false>
inline void tile(const Problem& p, int64_t row, int64_t block, const float* ahead = nullptr, int64_t ahead_from = 0,
                 int64_t ahead_to = 0) {
  const int64_t k = p.k;
  const int64_t block_stride = k * kBlock;  // from one packed block to the next
  const float* __restrict w = p.w + block * block_stride;
  const float* __restrict x = p.x + row * k;
  __m256 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < C; ++j) acc[r][j] = _mm256_setzero_ps();
  // Four elements of K a pass: the loop's own count and compare would otherwise take issue slots
  // the 12 FMAs need (25-30 % more GFLOP/s from 64 rows).
#pragma GCC unroll 4
  for (int64_t e = 0; e < k; ++e) {
    __m256 weights[C];
#pragma GCC unroll 4
    for (int j = 0; j < C; ++j) weights[j] = _mm256_loadu_ps(w + j * block_stride + e * kBlock);
    // One prefetch per 64-byte line: two elements of K of a block.
    if constexpr (kAhead)
      if (e >= ahead_from && e < ahead_to && e % 2 == 0)
#pragma GCC unroll 4
        for (int j = 0; j < C; ++j) _mm_prefetch(reinterpret_cast<const char*>(ahead + j * block_stride + e * kBlock), _MM_HINT_T1);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xs = _mm256_broadcast_ss(x + r * k + e);
#pragma GCC unroll 4
      for (int j = 0; j < C; ++j) acc[r][j] = _mm256_fmadd_ps(xs, weights[j], acc[r][j]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < C; ++j) {
    const int64_t first = (block + j) * kBlock;
    const int64_t valid = std::min<int64_t>(kBlock, p.n - first);
    const __m256 bias = p.bias && valid == kBlock ? _mm256_loadu_ps(p.bias + first) : _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      float* out = p.y + (row + r) * p.n + first;
      if (valid == kBlock) {
        _mm256_storeu_ps(out, _mm256_add_ps(acc[r][j], bias));
      } else {  // the last block: only the columns before N
        alignas(32) float lanes[kBlock];
        _mm256_store_ps(lanes, acc[r][j]);
        for (int64_t c = 0; c < valid; ++c) out[c] = lanes[c] + (p.bias ? p.bias[first + c] : 0.f);
      }
    }
  }
}

// Rows [first_row, end_row) of x times blocks [block, block + C): MR rows at a time, then the
// rest; the last row tiles prefetch the next C blocks.
template <int C>
void rows(const Problem& p, int64_t block, int64_t first_row, int64_t end_row) {
  const int64_t row_tiles = (end_row - first_row + MR - 1) / MR;
  const int64_t span = std::min(row_tiles - 1, kAheadTiles);
  const bool more = block + 2 * C <= (p.n + kBlock - 1) / kBlock;  // a whole tile of C blocks follows
  const float* next = span > 0 && more ? p.w + (block + C) * p.k * kBlock : nullptr;
  auto run = [&]<int R>(int64_t row) {
    const int64_t share = (row - first_row) / MR - (row_tiles - span);  // none before the last span, then 1 / span each
    if (next && share >= 0)
      tile<R, C, true>(p, row, block, next, share * p.k / span, (share + 1) * p.k / span);
    else
      tile<R, C>(p, row, block);
  };
  int64_t row = first_row;
  for (; row + MR <= end_row; row += MR) run.template operator()<MR>(row);
  const int64_t rest = end_row - row;
  [&]<int... R>(std::integer_sequence<int, R...>) {
    ((rest == R + 1 ? run.template operator()<R + 1>(row) : void()), ...);
  }(std::make_integer_sequence<int, MR - 1>{});
}

// Blocks [first, first + count) in tiles of NR, the last tile narrower when NR does not divide,
// for one band of x's rows after another: a band is as many rows as fit kBandBytes, so that it
// stays in the L2 cache while every tile passes over it, and the tiles' weights (a few MB a
// layer) come back from L3 for the next band.
void blocks(const Problem& p, int64_t first, int64_t count) {
  const int64_t band = std::max<int64_t>(MR, kBandBytes / (p.k * int64_t{sizeof(float)}) / MR * MR);
  for (int64_t first_row = 0; first_row < p.m; first_row += band) {
    const int64_t end_row = std::min(p.m, first_row + band);
    int64_t block = first;
    for (; block + NR <= first + count; block += NR) rows<NR>(p, block, first_row, end_row);
    const int64_t rest = first + count - block;
    [&]<int... J>(std::integer_sequence<int, J...>) {
      ((rest == J + 1 ? rows<J + 1>(p, block, first_row, end_row) : void()), ...);
    }(std::make_integer_sequence<int, NR - 1>{});
  }
}

}  // namespace

// W [N, K] float32 in the layout above.
torch::Tensor f32_gemm_pack(torch::Tensor weight) {
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
                    "weight must be a 2-D float32 CPU tensor");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t num_blocks = (n + kBlock - 1) / kBlock;
  auto padded = torch::zeros({num_blocks * kBlock, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({num_blocks, kBlock, k}).transpose(1, 2).contiguous();
}

// x [..., K] float32 times the packed weight of out_features rows, plus bias [N] if given.
torch::Tensor f32_gemm_linear(torch::Tensor x, torch::Tensor packed, std::optional<torch::Tensor> bias,
                              int64_t out_features) {
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat && x.device().is_cpu(),
                    "x and the packed weight must be float32 CPU tensors");
  TORCH_CHECK_VALUE(packed.dim() == 3 && packed.size(2) == kBlock && packed.is_contiguous(),
                    "packed must come from f32_gemm_pack");
  const int64_t k = x.size(-1);
  TORCH_CHECK_VALUE(x.dim() >= 1 && k == packed.size(1), "x's last dimension must be the weight's in_features");
  TORCH_CHECK_VALUE(out_features > (packed.size(0) - 1) * kBlock && out_features <= packed.size(0) * kBlock,
                    "out_features must be the packed weight's row count");
  const auto rows_of_x = x.reshape({-1, k}).contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = out_features;
  auto y = torch::empty(sizes, x.options());
  torch::Tensor bias_f32;
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == out_features, "bias must have out_features entries");
    bias_f32 = bias->to(torch::kFloat32).contiguous();
  }
  const Problem p{rows_of_x.data_ptr<float>(), packed.data_ptr<float>(),
                  bias.has_value() ? bias_f32.data_ptr<float>() : nullptr, y.data_ptr<float>(), rows_of_x.size(0),
                  out_features, k};
  if (p.m == 0) return y;
  const int64_t num_blocks = (p.n + kBlock - 1) / kBlock;
  const int64_t num_tiles = (num_blocks + NR - 1) / NR;
  // Tiles split across the threads; a thread's share is whole tiles of consecutive blocks.
  at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    blocks(p, begin * NR, std::min(end * NR, num_blocks) - begin * NR);
  });
  return y;
}

TORCH_LIBRARY(vllm_fs_f32_gemm, m) {
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_fs_f32_gemm, CPU, m) { m.impl("linear", &f32_gemm_linear); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &f32_gemm_pack, "W [N, K] float32 packed for linear: [ceil(N/8), K, 8]");
}
