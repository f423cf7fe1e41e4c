// y = x W^T (+ bias) for bfloat16 x [M, K] and W [N, K] on a CPU with AVX-512 BF16, any M; y in
// bfloat16, or in float32 unrounded (an LM head's logits, whose ties bfloat16 would make).
//
// Built on first use by bf16_gemm.py (07_engine/vllm_from_scratch/layers), only where the CPU has
// the vdpbf16ps instruction: one instruction multiplies 16 pairs of bfloat16 by 16 pairs and adds
// the pair sums into 16 float32 lanes. W is packed once, after loading, so that every load of it
// is one whole register: packed[b][p] holds, for the 16 output columns of block b, their elements
// 2p and 2p + 1 of K side by side ([N/16][K/2][16][2], zeros past N and K).
//
// A tile of NR column blocks is one work item: its packed weights are contiguous (NR x K x 32
// bytes), read once from memory by the first MR rows and from the L2 cache by the next. For each
// pair of K, a register of x's pair (the same two elements in every lane) meets the tile's NR
// weight registers: MR x NR independent float32 sums, so the FMA unit never waits on one. A few
// rows (a decode) stream the weights at memory speed with four blocks a tile; from eight rows the
// arithmetic counts, and eight rows by three blocks (24 sums, 3 weight loads and 8 broadcasts per
// pair) keeps the FMA unit busy. oneDNN's bfloat16 GEMM, whose tiles suit large M, reads a
// weight half as fast at one row and is slower at every M this was measured at (1-512;
// 07_engine/topics/performance.md).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <cstring>
#include <vector>

#if !defined(__AVX512BF16__)
#error "bf16_gemm.cpp needs a CPU with AVX-512 BF16 (bf16_gemm.py only builds it on one)"
#endif

namespace {

constexpr int64_t kBlock = 16;  // output columns per packed block: one register of float32 sums

// How far ahead, in pairs of K, a tile's weights are prefetched when the rows make it
// compute-bound: the hardware prefetcher alone left gaps between the tile's NR streams (8 rows
// over all the default model's weights: 11.9 ms without, 10.1 with; 16 and 32 pairs no better).
constexpr int64_t kPrefetchPairs = 8;

// A tile's first MR rows read its weights from memory, and the FMA unit waits on them; the rows
// after read them from L2 and leave the memory idle. So the last row tiles of a tile (at most
// kAheadTiles of them, each a share of the pairs) prefetch the next tile's weights into L2, and
// its first rows find them there: 16-32 rows over all the default model's weights 10-17% faster,
// 512-2048 rows unchanged (a few rows have one row tile, which streams the weights anyway).
constexpr int64_t kAheadTiles = 8;

struct Problem {
  const uint16_t* x;   // [M, K] bfloat16 bits
  const uint16_t* w;   // packed [N/16][K/2][16][2]
  const float* bias;   // [N] or nullptr
  void* y;             // [M, N] bfloat16 bits, or float32 where y_float32
  bool y_float32;
  int64_t m, n, k, pairs;
};

// Rows [row, row + MR) of x times column blocks [block, block + NR), stored to y; with kAhead,
// also the lines of pairs [ahead_from, ahead_to) of the NR blocks at `ahead` prefetched into L2.
template <int MR, int NR, bool kAhead = false>
inline void tile(const Problem& p, int64_t row, int64_t block, const uint16_t* ahead = nullptr,
                 int64_t ahead_from = 0, int64_t ahead_to = 0) {
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_setzero_ps();
  const uint16_t* w = p.w + block * p.pairs * 2 * kBlock;
  const int64_t block_stride = p.pairs * 2 * kBlock;  // from one packed block to the next
  const uint16_t* x = p.x + row * p.k;
  for (int64_t pair = 0; pair < p.pairs; ++pair) {
    __m512bh weights[NR];
    for (int j = 0; j < NR; ++j) {
      weights[j] = (__m512bh)_mm512_loadu_si512(w + j * block_stride + pair * 2 * kBlock);
      if constexpr (MR >= 8) _mm_prefetch(w + j * block_stride + (pair + kPrefetchPairs) * 2 * kBlock, _MM_HINT_T0);
    }
    if constexpr (kAhead)
      if (pair >= ahead_from && pair < ahead_to)
        for (int j = 0; j < NR; ++j) _mm_prefetch(ahead + j * block_stride + pair * 2 * kBlock, _MM_HINT_T1);
    for (int r = 0; r < MR; ++r) {
      int32_t both;  // elements 2 pair and 2 pair + 1 of row r, one 32-bit word (K is even here)
      std::memcpy(&both, x + r * p.k + 2 * pair, sizeof(both));
      const __m512bh xs = (__m512bh)_mm512_set1_epi32(both);
      for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xs, weights[j]);
    }
  }
  for (int j = 0; j < NR; ++j) {
    const int64_t first = (block + j) * kBlock;
    const int64_t valid = std::min<int64_t>(kBlock, p.n - first);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
    const __m512 bias = p.bias ? _mm512_maskz_loadu_ps(mask, p.bias + first) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r) {
      const __m512 sum = _mm512_add_ps(acc[r][j], bias);
      const int64_t at = (row + r) * p.n + first;
      if (p.y_float32) {
        _mm512_mask_storeu_ps(static_cast<float*>(p.y) + at, mask, sum);
      } else {
        // Rounded to nearest even, as torch rounds float32 to bfloat16.
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p.y) + at, mask, (__m256i)_mm512_cvtneps_pbh(sum));
      }
    }
  }
}

// Every row of x times blocks [block, block + NR): MR rows at a time, then the rest; the last
// row tiles prefetch the next NR blocks (kAheadTiles) where the same thread's share, which ends
// before block `end`, holds them.
template <int MR, int NR>
void rows(const Problem& p, int64_t block, int64_t end) {
  const int64_t row_tiles = (p.m + MR - 1) / MR;
  const int64_t span = std::min(row_tiles - 1, kAheadTiles);
  const bool more = block + 2 * NR <= end;  // a whole tile of NR blocks follows
  const uint16_t* next = span > 0 && more ? p.w + (block + NR) * p.pairs * 2 * kBlock : nullptr;
  // Row tile t's share of the next tile's pairs: none before the last span, then 1 / span each.
  auto run = [&]<int R>(int64_t row) {
    const int64_t share = row / MR - (row_tiles - span);
    if (next && share >= 0)
      tile<R, NR, true>(p, row, block, next, share * p.pairs / span, (share + 1) * p.pairs / span);
    else
      tile<R, NR>(p, row, block);
  };
  int64_t row = 0;
  for (; row + MR <= p.m; row += MR) run.template operator()<MR>(row);
  const int64_t rest = p.m - row;
  if constexpr (MR > 1) {
    if (rest > 0) {
      // One of MR - 1 smaller tiles, chosen at run time.
      [&]<int... R>(std::integer_sequence<int, R...>) {
        ((rest == R + 1 ? run.template operator()<R + 1>(row) : void()), ...);
      }(std::make_integer_sequence<int, MR - 1>{});
    }
  }
}

// Blocks [first, first + count) in tiles of NR, the last tile narrower when NR does not divide.
template <int MR, int NR>
void blocks(const Problem& p, int64_t first, int64_t count) {
  int64_t block = first;
  for (; block + NR <= first + count; block += NR) rows<MR, NR>(p, block, first + count);
  const int64_t rest = first + count - block;
  if constexpr (NR > 1) {
    if (rest > 0) {
      [&]<int... J>(std::integer_sequence<int, J...>) {
        ((rest == J + 1 ? rows<MR, J + 1>(p, block, first + count) : void()), ...);
      }(std::make_integer_sequence<int, NR - 1>{});
    }
  }
}

// Blocks split evenly across the threads, each share in tiles of NR (its last one narrower):
// shares of whole tiles left the 576 columns of the default model's attention output and MLP
// down projections 5 tiles to one thread and 4 to the other, and a one-row pass over all its
// weights took 4.36-4.46 ms against 4.12-4.20 split by blocks (Zen 5 VM).
template <int MR, int NR>
void gemm(const Problem& p) {
  const int64_t num_blocks = (p.n + kBlock - 1) / kBlock;
  at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) { blocks<MR, NR>(p, begin, end - begin); });
}

}  // namespace

// W [N, K] bfloat16 in the layout above.
torch::Tensor bf16_gemm_pack(torch::Tensor weight) {
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(),
                    "weight must be a 2-D bfloat16 CPU tensor");
  weight = weight.contiguous();
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t num_blocks = (n + kBlock - 1) / kBlock, pairs = (k + 1) / 2;
  auto packed = torch::zeros({num_blocks, pairs, kBlock, 2}, weight.options());
  const auto* src = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t col = 0; col < std::min(kBlock, n - b * kBlock); ++col)
        for (int64_t e = 0; e < k; ++e)
          dst[((b * pairs + e / 2) * kBlock + col) * 2 + e % 2] = src[(b * kBlock + col) * k + e];
  });
  return packed;
}

// x [..., K] bfloat16 times the packed weight of out_features rows, plus bias [N] if given; the
// result in dtype: bfloat16 (the default) or float32.
torch::Tensor bf16_gemm_linear(torch::Tensor x, torch::Tensor packed, std::optional<torch::Tensor> bias,
                               int64_t out_features, std::optional<at::ScalarType> dtype) {
  const at::ScalarType out_dtype = dtype.value_or(at::kBFloat16);
  TORCH_CHECK_VALUE(out_dtype == at::kBFloat16 || out_dtype == at::kFloat, "dtype must be bfloat16 or float32");
  TORCH_CHECK_VALUE(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
                    "x and the packed weight must be bfloat16 CPU tensors");
  TORCH_CHECK_VALUE(packed.dim() == 4 && packed.size(2) == kBlock && packed.size(3) == 2 && packed.is_contiguous(),
                    "packed must come from bf16_gemm_pack");
  const int64_t k = x.size(-1), pairs = packed.size(1);
  TORCH_CHECK_VALUE(x.dim() >= 1 && (k + 1) / 2 == pairs, "x's last dimension must be the weight's in_features");
  TORCH_CHECK_VALUE(out_features > (packed.size(0) - 1) * kBlock && out_features <= packed.size(0) * kBlock,
                    "out_features must be the packed weight's row count");
  auto rows_of_x = x.reshape({-1, k});
  if (k % 2) rows_of_x = torch::constant_pad_nd(rows_of_x, {0, 1});  // pairs whole: the packed tail is zero
  rows_of_x = rows_of_x.contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = out_features;
  auto y = torch::empty(sizes, x.options().dtype(out_dtype));
  torch::Tensor bias_f32;
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == out_features, "bias must have out_features entries");
    bias_f32 = bias->to(torch::kFloat32).contiguous();
  }
  const Problem p{reinterpret_cast<const uint16_t*>(rows_of_x.data_ptr()),
                  reinterpret_cast<const uint16_t*>(packed.data_ptr()),
                  bias.has_value() ? bias_f32.data_ptr<float>() : nullptr,
                  y.data_ptr(),
                  out_dtype == at::kFloat,
                  rows_of_x.size(0),
                  out_features,
                  rows_of_x.size(1),
                  pairs};
  if (p.m == 0) return y;
  if (p.m <= 4)
    gemm<4, 4>(p);
  else
    gemm<8, 3>(p);
  return y;
}

TORCH_LIBRARY(vllm_fs_gemm, m) {
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int out_features, ScalarType? dtype=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_fs_gemm, CPU, m) { m.impl("linear", &bf16_gemm_linear); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &bf16_gemm_pack, "W [N, K] bfloat16 packed for linear: [ceil(N/16), ceil(K/2), 16, 2]");
}
