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
// Where the CPU has AVX512-BF16, bfloat16 heads take decode_bf16 and varlen_bf16, which multiply
// bfloat16 pairs in hardware (the section at the end); decode_bf16's work item is a sequence's KV
// head with its whole group of query heads, and a batch too small for the threads has its keys
// split into runs.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

// One vector register of floats (16 with AVX-512, 8 with AVX2, 4 with SSE or NEON), in GCC's and
// Clang's vector extension, which spells whole-register arithmetic and lane shuffles without
// intrinsics. Wider than the machine's registers it would be split through memory: 16 floats
// compiled for AVX2 ran 3-5.5x slower than plain loops.
#if defined(__AVX512F__)
constexpr int kVectorBytes = 64;
#elif defined(__AVX__)
constexpr int kVectorBytes = 32;
#else
constexpr int kVectorBytes = 16;
#endif
using Vec = float __attribute__((vector_size(kVectorBytes)));
using Words = uint32_t __attribute__((vector_size(kVectorBytes)));
constexpr int kLanes = kVectorBytes / sizeof(float);

// Lanes I... of x's and y's together (y's are kLanes and up). GCC 11 lacks
// __builtin_shufflevector and has __builtin_shuffle, which takes the lanes as a vector.
template <int... I>
inline Vec shuffle(Vec x, Vec y) {
#if defined(__clang__) || __GNUC__ >= 12
  return __builtin_shufflevector(x, y, I...);
#else
  return __builtin_shuffle(x, y, Words{I...});
#endif
}

// std::bit_cast's meaning in C++17, which torch's extension builder compiles on some versions
// (2.11); a memcpy of a register's bytes compiles to no copy at all.
template <typename To, typename From>
inline To bit_cast(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast needs types of one size");
  static_assert(std::is_trivially_copyable_v<To> && std::is_trivially_copyable_v<From>);
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }

// bfloat16 is the top half of a float32, so both conversions are integer operations the compiler
// vectorizes (c10's do not always: its rounding stayed scalar in store_row's loop). Rounding is to
// nearest even, as c10's.
template <>
inline float to_float<at::BFloat16>(at::BFloat16 x) { return bit_cast<float>(uint32_t{x.x} << 16); }

template <>
inline at::BFloat16 from_float<at::BFloat16>(float x) {
  const uint32_t bits = bit_cast<uint32_t>(x);
  return at::BFloat16(static_cast<uint16_t>((bits + 0x7fff + (bits >> 16 & 1)) >> 16), at::BFloat16::from_bits());
}

template <typename T>
inline Vec load_vec(const T* p) {
  float f[kLanes];
  for (int l = 0; l < kLanes; ++l) f[l] = to_float(p[l]);
  return bit_cast<Vec>(f);
}

// A head vector in D / kLanes registers, its elements in any fixed order: q . k and p v only need
// q, k and v in the same one, and store_row puts the output back in place. bfloat16 reads two
// registers' worth of elements as words and splits them into the even and the odd ones (a word's
// low half is its even element, little-endian): two operations where widening each 16-bit value
// takes four.
template <typename T, int D>
constexpr bool kEvenOdd = std::is_same_v<T, at::BFloat16> && D % (2 * kLanes) == 0;

template <int D, typename T>
inline void load_row(const T* p, Vec (&row)[D / kLanes]) {
#pragma GCC unroll 16
  for (int c = 0; c < D / kLanes; ++c) {
    if constexpr (kEvenOdd<T, D>) {
      if (c % 2) continue;
      Words w;
      std::memcpy(&w, p + c * kLanes, sizeof(w));
      row[c] = bit_cast<Vec>(w << 16);
      row[c + 1] = bit_cast<Vec>(w & 0xffff0000u);
    } else {
      row[c] = load_vec(p + c * kLanes);
    }
  }
}

// Lane i of the result is lane from + i / 2 of `even` (i even) or of `odd` (i odd).
template <int from, int... I>
inline Vec interleave(Vec even, Vec odd, std::integer_sequence<int, I...>) {
  return shuffle<(I % 2) * kLanes + from + I / 2 ...>(even, odd);
}

template <int D, typename T>
inline void store_row(Vec (&row)[D / kLanes], float scale, T* p) {
  if constexpr (kEvenOdd<T, D>) {
    for (int c = 0; c < D / kLanes; c += 2) {
      const Vec even = row[c], odd = row[c + 1];
      row[c] = interleave<0>(even, odd, std::make_integer_sequence<int, kLanes>{});
      row[c + 1] = interleave<kLanes / 2>(even, odd, std::make_integer_sequence<int, kLanes>{});
    }
  }
  const auto x = bit_cast<std::array<float, D>>(row);
#pragma omp simd
  for (int i = 0; i < D; ++i) p[i] = from_float<T>(x[i] * scale);
}

// One step of sum_lanes. x and y each hold kLanes / W keys, W partial sums per key in consecutive
// lanes; the result holds the 2 kLanes / W keys of both, in order, W / 2 partial sums each: two
// shuffles pick the first and the second half of every key's lanes, and one add sums them. With 16
// lanes and W = 16, lanes 0-7 of the result are x[0..7] + x[8..15], lanes 8-15 y[0..7] + y[8..15].
template <int W, int... I>
inline Vec fold(Vec x, Vec y, std::integer_sequence<int, I...>) {
  constexpr int half = W / 2, keys_per_input = kLanes / W;
  constexpr auto lane = [](int i, int offset) {  // where lane i of the result takes its first or second term
    const int key = i / half;
    return key / keys_per_input * kLanes + key % keys_per_input * W + i % half + offset;
  };
  return shuffle<lane(I, 0)...>(x, y) + shuffle<lane(I, half)...>(x, y);
}

// Lane j of the result is the sum of v[j]'s lanes, v[0 .. W) holding W partial sums per key: a
// transpose that adds as it goes, kLanes - 1 folds for kLanes sums where summing one register on
// its own takes log2(kLanes) shuffles and adds.
template <int W = kLanes>
inline Vec sum_lanes(Vec* v) {
  if constexpr (W == 1) {
    return v[0];
  } else {
    for (int i = 0; i < W / 2; ++i) v[i] = fold<W>(v[2 * i], v[2 * i + 1], std::make_integer_sequence<int, kLanes>{});
    return sum_lanes<W / 2>(v);
  }
}

// q . k for n <= kLanes keys, `stride` apart, as one register of scores (lanes past n hold 0).
// Each key's products stay spread over the lanes; sum_lanes adds them up for all the keys at once.
template <int D, typename T>
inline Vec score_keys(const Vec (&query)[D / kLanes], const T* keys, int64_t stride, int64_t n) {
  auto products = [&](int64_t j) {
    Vec k[D / kLanes];
    load_row<D>(keys + j * stride, k);
    Vec sum = query[0] * k[0];
#pragma GCC unroll 16
    for (int c = 1; c < D / kLanes; ++c) sum += query[c] * k[c];
    return sum;
  };
  Vec part[kLanes];
  for (int j = 0; j < kLanes; ++j) part[j] = j < n ? products(j) : Vec{};
  return sum_lanes(part);
}

// A block table scatters a sequence's blocks, which the hardware prefetcher cannot follow: the
// next block's rows are requested while this one is computed. Always inlined, for the reason
// prefetch_run below gives.
template <int D, typename T>
[[gnu::always_inline]] inline void prefetch_rows(const T* rows, int64_t count, int64_t stride) {
  for (int64_t j = 0; j < count; ++j)
    for (int i = 0; i < D; i += 64 / sizeof(T)) __builtin_prefetch(rows + j * stride + i);  // 64-byte lines
}

// scores[0 .. len) replaced by e^(score - their maximum), whose sum it returns (and the maximum
// through `maximum`, where given: the lowest float for len 0). The maximum is written as a
// comparison because GCC leaves a loop of std::max scalar; it starts finite because -ffast-math
// assumes no infinities.
inline float softmax_in_place(float* scores, int64_t len, float* maximum = nullptr) {
  float max_score = std::numeric_limits<float>::lowest();
#pragma omp simd reduction(max : max_score)
  for (int64_t t = 0; t < len; ++t) max_score = scores[t] > max_score ? scores[t] : max_score;
  if (maximum) *maximum = max_score;
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t t = 0; t < len; ++t) {
    scores[t] = std::exp(scores[t] - max_score);
    total += scores[t];
  }
  return total;
}

struct Shape {
  int64_t num_seqs, num_q_heads, num_kv_heads, block_size, max_blocks, max_len;
  int64_t varlen_min_tokens = 1;  // the varlen kernels leave out sequences with fewer new tokens
};

// A decode work item is one query head; the group of query heads that share a KV head are
// consecutive items, and only the group's first reads that head's keys and values from memory,
// the others finding them in L2 and leaving the memory idle. So each item of a group prefetches a
// share of the *next* group's keys and values into L2 (the next KV head this thread attends), a
// few tokens with each run of its own keys, and the next group's first item finds them there: 32
// sequences of 256 tokens 0.49 -> 0.36 ms a layer in bfloat16, 1.04 -> 0.70 in float32.
struct NextHead {
  const int* table = nullptr;  // the next group's sequence's block table; nullptr: no next group
  int64_t kv_head = 0;
  int64_t token = 0, end = 0;  // the item's share still to prefetch: tokens [token, end)
  int64_t per_run = 0;         // tokens prefetched with each run of the item's own keys
};

// The item's share of the next group, if the thread's items [.., end) reach that group; the item
// has len keys and goes through them run_keys at a time.
inline NextHead next_head(int64_t item, int64_t end, int64_t group, int64_t len, int64_t run_keys,
                          const int* block_tables, const int* context_lens, const Shape& s) {
  const int64_t next = (item / group + 1) * group;  // the next group's first item
  if (next >= end) return {};
  const int64_t seq = next / s.num_q_heads, next_len = context_lens[seq], share = item % group;
  const int64_t from = share * next_len / group, to = (share + 1) * next_len / group;
  const int64_t runs = (len + run_keys - 1) / run_keys;
  return {block_tables + seq * s.max_blocks, next % s.num_q_heads / group, from, to, (to - from + runs - 1) / runs};
}

// The next per_run tokens of the share, keys and values, into L2. Always inlined: GCC finds a
// function of nothing but prefetches free of effects, and drops its calls.
template <int D, typename T>
[[gnu::always_inline]] inline void prefetch_run(NextHead& next, const T* k_cache, const T* v_cache, const Shape& s) {
  const int64_t token_stride = s.num_kv_heads * D;
  const int64_t last = std::min(next.end, next.token + next.per_run);
  while (next.token < last) {
    const int64_t b = next.token / s.block_size, in_block = next.token - b * s.block_size;
    const int64_t count = std::min(last - next.token, s.block_size - in_block);
    const int64_t row = (next.table[b] * s.block_size + in_block) * token_stride + next.kv_head * D;
    for (int64_t j = 0; j < count; ++j)
      for (int64_t i = 0; i < D; i += 64 / sizeof(T)) {  // 64-byte lines, into L2 (locality 2)
        __builtin_prefetch(k_cache + row + j * token_stride + i, 0, 2);
        __builtin_prefetch(v_cache + row + j * token_stride + i, 0, 2);
      }
    next.token += count;
  }
}

template <typename T, int D>
void decode(const T* q, const T* k_cache, const T* v_cache, const int* block_tables, const int* context_lens,
            T* out, const Shape& s, float scale) {
  constexpr int C = D / kLanes;
  const int64_t group = s.num_q_heads / s.num_kv_heads;
  const int64_t token_stride = s.num_kv_heads * D;  // from one cached token to the next in a block
  const int64_t block_stride = s.block_size * token_stride;
  at::parallel_for(0, s.num_seqs * s.num_q_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(s.max_len + kLanes);  // score_keys writes whole registers
    float* scores = buffer.data();
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / s.num_q_heads;
      const int64_t kv_head = item % s.num_q_heads / group;
      const int64_t len = context_lens[seq];
      const int* table = block_tables + seq * s.max_blocks;
      NextHead next = next_head(item, end, group, len, s.block_size, block_tables, context_lens, s);
      Vec query[C], acc[C] = {};
      load_row<D>(q + item * D, query);
      for (int c = 0; c < C; ++c) query[c] *= scale;

      // Scores q . k for every cached token, block by block, a register's worth of keys at a time.
      for (int64_t start = 0, b = 0; start < len; start += s.block_size, ++b) {
        const T* keys = k_cache + table[b] * block_stride + kv_head * D;
        const int64_t n = std::min(s.block_size, len - start);
        if (start + s.block_size < len)
          prefetch_rows<D>(k_cache + table[b + 1] * block_stride + kv_head * D, s.block_size, token_stride);
        if (next.table) prefetch_run<D>(next, k_cache, v_cache, s);
        for (int64_t j = 0; j < n; j += kLanes) {
          const Vec dots =
              score_keys<D>(query, keys + j * token_stride, token_stride, std::min<int64_t>(kLanes, n - j));
          std::memcpy(scores + start + j, &dots, sizeof(dots));
        }
      }
      // Softmax weights, unnormalized (divided once at the end).
      const float total = softmax_in_place(scores, len);
      // Weighted sum of the values.
      for (int64_t start = 0, b = 0; start < len; start += s.block_size, ++b) {
        const T* values = v_cache + table[b] * block_stride + kv_head * D;
        const int64_t n = std::min(s.block_size, len - start);
        // Two values an iteration measured 5-9% faster than one.
#pragma GCC unroll 2
        for (int64_t j = 0; j < n; ++j) {
          Vec v[C];
          load_row<D>(values + j * token_stride, v);
#pragma GCC unroll 16
          for (int c = 0; c < C; ++c) acc[c] += scores[start + j] * v[c];
        }
      }
      store_row<D>(acc, 1.f / total, out + item * D);
    }
  });
}

// Causal attention of packed new tokens over their paged context (whole prompts, prompt chunks,
// speculative verification), in one pass over the keys with an online softmax. A work item is a
// tile of queries of one sequence that share a KV head (the group's heads of consecutive rows),
// one query per lane of one or two registers: each run of keys is widened to float32 once for the
// whole tile, a key's scores for all of it are one register per kLanes queries (D FMAs, no
// horizontal sums), and the softmax's max, exp and mask are whole-register operations. SDPA per
// sequence gathers, pads and masks; the decode kernel run row by row widens every key once per
// query.
struct Tile {
  int64_t seq, kv_head, first_query, count;  // queries first_query .. + count of the sequence, in (row, head) order
  int64_t group_cost;  // keys x queries of the costliest tile of the sequence and KV head
};

// The tiles of up to `width` queries of each sequence and KV head together, the latest queries
// first, and those groups costliest first. Together: a group's tiles read the same keys and
// values, which the first leaves in L2 for the next (ordered by cost alone, four prompt chunks'
// tiles alternated between the chunks and KV heads, each reading its keys back from L3).
// Costliest first: tiles late in a long prompt see many more keys than early ones, and handing
// out the costliest first, to whichever thread is free, keeps the threads finishing together.
inline std::vector<Tile> sorted_tiles(const int* cu_seqlens_q, const int* seq_lens_k, const Shape& s, int64_t width) {
  const int64_t group = s.num_q_heads / s.num_kv_heads;
  std::vector<Tile> tiles;
  for (int64_t seq = 0; seq < s.num_seqs; ++seq) {
    const int64_t queries = (cu_seqlens_q[seq + 1] - cu_seqlens_q[seq]) * group;
    if (queries < s.varlen_min_tokens * group) continue;
    const int64_t context = seq_lens_k[seq] - queries / group;
    const int64_t last_first = (queries - 1) / width * width;
    auto count_of = [&](int64_t first) { return std::min<int64_t>(width, queries - first); };
    int64_t group_cost = 0;
    for (int64_t first = last_first; first >= 0; first -= width)
      group_cost = std::max(group_cost, count_of(first) * (context + (first + count_of(first) - 1) / group + 1));
    for (int64_t kv_head = 0; kv_head < s.num_kv_heads; ++kv_head)
      for (int64_t first = last_first; first >= 0; first -= width)
        tiles.push_back({seq, kv_head, first, count_of(first), group_cost});
  }
  std::stable_sort(tiles.begin(), tiles.end(),
                   [](const Tile& a, const Tile& b) { return a.group_cost > b.group_cost; });
  return tiles;
}

// Work item `item` of the varlen kernels: its tile, the KV head it attends with, the sequence's
// tokens before its new ones, and the sequence's block table.
struct TileItem {
  const Tile& tile;
  int64_t kv_head, context;
  const int* table;
};

inline TileItem tile_item(int64_t item, const std::vector<Tile>& tiles, const int* cu_seqlens_q,
                          const int* seq_lens_k, const int* block_tables, const Shape& s) {
  const Tile& tile = tiles[item];
  const int64_t q_len = cu_seqlens_q[tile.seq + 1] - cu_seqlens_q[tile.seq];
  return {tile, tile.kv_head, seq_lens_k[tile.seq] - q_len, block_tables + tile.seq * s.max_blocks};
}

// e^x lane by lane, in a loop the compiler turns into one call of the vector math library.
inline Vec exp_lanes(Vec x) {
  auto lanes = bit_cast<std::array<float, kLanes>>(x);
#pragma omp simd
  for (int l = 0; l < kLanes; ++l) lanes[l] = std::exp(lanes[l]);
  return bit_cast<Vec>(lanes);
}

inline Vec max_lanes(Vec a, Vec b) { return a > b ? a : b; }

// Where lane's query (and its output) lies in q: the tile's queries run over the group's heads
// of consecutive rows of its sequence.
inline int64_t query_offset(const Tile& tile, int64_t lane, int64_t kv_head, const int* cu_seqlens_q,
                            const Shape& s, int64_t head_dim) {
  const int64_t group = s.num_q_heads / s.num_kv_heads;
  const int64_t query = tile.first_query + lane;
  const int64_t token = cu_seqlens_q[tile.seq] + query / group;
  return (token * s.num_q_heads + kv_head * group + query % group) * head_dim;
}

// One run of keys start .. start + n of the online softmax: each lane's scores of keys past its
// last_key masked, its running maximum raised to theirs; returns the factor by which the lane's
// earlier weights (total and sums) shrink under the new maximum.
inline Vec mask_and_raise_max(Vec* scores, int64_t n, int64_t start, Vec last_key, Vec& max_score, float masked) {
  Vec new_max = max_score;
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = static_cast<float>(start + j) <= last_key ? scores[j] : Vec{} + masked;
    new_max = max_lanes(new_max, scores[j]);
  }
  const Vec rescale = exp_lanes(max_score - new_max);
  max_score = new_max;
  return rescale;
}

// A register made opaque to the optimizer: -ffast-math would otherwise reassociate an FMA chain
// into a tree of multiplies and adds, and fold a loaded register back into every FMA that uses it
// (a load each, where the load ports, not the FMA units, then bound the loop).
inline void in_register(Vec& x) {
#if defined(__x86_64__)
  asm("" : "+x"(x));
#elif defined(__aarch64__)
  asm("" : "+w"(x));
#endif
}

// varlen's scratch, one per thread: the tile's queries transposed (element d of every query), a
// run's keys and values widened to float32 (dtypes other than float32), the run's softmax weights
// (key j, query lane i) and the tile's output sums.
template <int D, int kRun, int kWidth>
struct TileScratch {
  alignas(64) float queries[D][kWidth];
  alignas(64) float keys[kRun][D], values[kRun][D];
  alignas(64) float weights[kRun][kWidth];
  Vec acc[kWidth][D / kLanes];
};

// One tile of V * kLanes queries (V registers a query element) against its keys, kRun keys a step
// of the online softmax. Scores: a key element broadcast once serves V FMAs, 8 / V keys at a time
// (eight independent sums to cover the FMA latency). Weighted values: a value register loaded
// once serves two query lanes.
template <int V, typename T, int D, int kRun, int kWidth>
void attend_tile(const TileItem& item, const T* q, const T* k_cache, const T* v_cache, const int* cu_seqlens_q,
                 T* out, const Shape& s, float scale, TileScratch<D, kRun, kWidth>& scratch) {
  constexpr int C = D / kLanes;
  constexpr int kKeys = 8 / V;  // keys scored together
  static_assert(kRun % kKeys == 0 && V * kLanes <= kWidth);
  constexpr float kMasked = std::numeric_limits<float>::lowest();  // finite: -ffast-math assumes no infinities
  const auto& [tile, kv_head, context, table] = item;
  const int64_t group = s.num_q_heads / s.num_kv_heads;
  const int64_t token_stride = s.num_kv_heads * D;
  const int64_t block_stride = s.block_size * token_stride;
  auto& [queries, keys, values, weights, acc] = scratch;
  // Lane i of register v sees the keys at positions <= last_key[v][i]; unused lanes see none.
  Vec last_key[V];
  for (int v = 0; v < V; ++v) {
    float last_key_of[kLanes];
    for (int i = 0; i < kLanes; ++i) {
      const int64_t l = v * kLanes + i;
      Vec row[C] = {};
      if (l < tile.count) load_row<D>(q + query_offset(tile, l, kv_head, cu_seqlens_q, s, D), row);
      const auto elements = bit_cast<std::array<float, D>>(row);  // load_row's order, as the keys'
      for (int d = 0; d < D; ++d) queries[d][l] = elements[d] * scale;
      last_key_of[i] = l < tile.count ? static_cast<float>(context + (tile.first_query + l) / group) : -1.f;
      for (int c = 0; c < C; ++c) acc[l][c] = Vec{};
    }
    last_key[v] = bit_cast<Vec>(last_key_of);
  }
  Vec max_score[V], total[V];
  for (int v = 0; v < V; ++v) max_score[v] = Vec{} + kMasked, total[v] = Vec{};
  const int64_t keys_seen = context + (tile.first_query + tile.count - 1) / group + 1;  // by the last lane
  int64_t block = 0, in_block = 0;  // where the run's first key lies in the sequence's blocks
  for (int64_t start = 0; start < keys_seen; start += kRun) {
    const int64_t n = std::min<int64_t>(kRun, keys_seen - start);
    // float32 rows are read where they lie in the cache, not copied to the stack first: the copy
    // was a store and a load more for every element (the chapter's README has the figures).
    const float* key_rows[kRun];
    const float* value_rows[kRun];
    for (int64_t j = 0, b = block, i = in_block; j < kRun; ++j) {
      const int64_t offset = table[b] * block_stride + i * token_stride + kv_head * D;
      if constexpr (std::is_same_v<T, float>) {
        key_rows[j] = k_cache + offset;
        value_rows[j] = v_cache + offset;
      } else {
        load_row<D>(k_cache + offset, *reinterpret_cast<Vec(*)[C]>(keys[j]));
        load_row<D>(v_cache + offset, *reinterpret_cast<Vec(*)[C]>(values[j]));
        key_rows[j] = keys[j];
        value_rows[j] = values[j];
      }
      if (j + 1 < n && ++i == s.block_size) i = 0, ++b;  // rows past n repeat the last; masked
    }
    for (in_block += kRun; in_block >= s.block_size; in_block -= s.block_size) ++block;

    Vec scores[V][kRun];
    for (int j = 0; j < kRun; j += kKeys) {
      Vec sums[kKeys][V] = {};
#pragma GCC unroll 64
      for (int d = 0; d < D; ++d) {
        Vec query[V];
        for (int v = 0; v < V; ++v) {
          query[v] = *reinterpret_cast<const Vec*>(queries[d] + v * kLanes);
          in_register(query[v]);
        }
#pragma GCC unroll 8
        for (int k = 0; k < kKeys; ++k)
          for (int v = 0; v < V; ++v) {
            sums[k][v] += key_rows[j + k][d] * query[v];
            in_register(sums[k][v]);
          }
      }
      for (int k = 0; k < kKeys; ++k)
        for (int v = 0; v < V; ++v) scores[v][j + k] = sums[k][v];
    }
    float rescale_of[V * kLanes];
    for (int v = 0; v < V; ++v) {
      const Vec rescale = mask_and_raise_max(scores[v], n, start, last_key[v], max_score[v], kMasked);
      total[v] *= rescale;
      std::memcpy(rescale_of + v * kLanes, &rescale, sizeof(rescale));
      for (int64_t j = 0; j < n; ++j) {
        const Vec p = exp_lanes(scores[v][j] - max_score[v]);
        total[v] += p;
        std::memcpy(weights[j] + v * kLanes, &p, sizeof(p));
      }
    }
    // Two lanes at a time, a few registers of each lane's sums at a time: every sum stays in a
    // register (all C of two lanes would not fit AVX2's 16).
    constexpr int kPart = C < 4 ? C : 4;
    for (int64_t l = 0; l < tile.count; l += 2) {
      for (int part = 0; part < C; part += kPart) {
        Vec a[kPart], b[kPart];
#pragma GCC unroll 16
        for (int c = 0; c < kPart; ++c) {
          a[c] = acc[l][part + c] * rescale_of[l];
          b[c] = acc[l + 1][part + c] * rescale_of[l + 1];
        }
        for (int64_t j = 0; j < n; ++j) {
          const float wa = weights[j][l], wb = weights[j][l + 1];
#pragma GCC unroll 16
          for (int c = 0; c < kPart; ++c) {
            Vec value = load_vec(value_rows[j] + (part + c) * kLanes);
            in_register(value);
            a[c] += wa * value;
            b[c] += wb * value;
            in_register(a[c]);
            in_register(b[c]);
          }
        }
#pragma GCC unroll 16
        for (int c = 0; c < kPart; ++c) {
          acc[l][part + c] = a[c];
          acc[l + 1][part + c] = b[c];
        }
      }
    }
  }
  float total_of[V * kLanes];
  std::memcpy(total_of, total, sizeof(total));
  for (int64_t l = 0; l < tile.count; ++l)
    store_row<D>(acc[l], 1.f / total_of[l], out + query_offset(tile, l, kv_head, cu_seqlens_q, s, D));
}

template <typename T, int D>
void varlen(const T* q, const T* k_cache, const T* v_cache, const int* block_tables, const int* cu_seqlens_q,
            const int* seq_lens_k, T* out, const Shape& s, float scale) {
  constexpr int kRun = 16, kWidth = 2 * kLanes;
  const std::vector<Tile> tiles = sorted_tiles(cu_seqlens_q, seq_lens_k, s, kWidth);
  const int64_t num_items = static_cast<int64_t>(tiles.size());
  std::atomic<int64_t> next_item{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    TileScratch<D, kRun, kWidth> scratch;
    for (int64_t i; (i = next_item.fetch_add(1)) < num_items;) {
      const TileItem item = tile_item(i, tiles, cu_seqlens_q, seq_lens_k, block_tables, s);
      if (item.tile.count > kLanes)
        attend_tile<2>(item, q, k_cache, v_cache, cu_seqlens_q, out, s, scale, scratch);
      else
        attend_tile<1>(item, q, k_cache, v_cache, cu_seqlens_q, out, s, scale, scratch);
    }
  });
}

#if defined(__AVX512BF16__)
// The same two kernels for bfloat16 on a CPU with AVX512-BF16. vdpbf16ps multiplies 16 pairs of
// bfloat16 by 16 pairs and adds each lane's two products to a float32 sum; a product of two
// bfloat16 is exact in float32, so q . k is the float32 kernels' sum in another order, at half
// their instructions, and the keys are read as they lie instead of widened. p . v needs the
// softmax weights in bfloat16: each is rounded once, to nearest even, as torch's CPU flash
// attention rounds them before its p . V product, and their total stays a float32 sum. The
// result is scaled by 1 / total and rounded once, as before.

template <int D>
constexpr bool kDotBf16 = D % 32 == 0;  // a row is whole registers of 32 bfloat16

// One 32-bit word, two bfloat16, in every lane.
inline __m512bh broadcast_pair(const void* p) {
  uint32_t word;
  std::memcpy(&word, p, sizeof(word));
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(word));
}

// Rows a and b of D bfloat16 as D / 16 registers of (a[d], b[d]) pairs, the operand p . v
// multiplies by a broadcast pair of weights. unpacklo / unpackhi interleave inside each 128-bit
// lane, so the dimensions come out in the order pair_dim gives; the float32 sums keep that order
// and store_pair_order puts it back.
template <int D>
inline void interleave_rows(const at::BFloat16* a, const at::BFloat16* b, __m512i (&pairs)[D / 16]) {
#pragma GCC unroll 8
  for (int w = 0; w < D / 32; ++w) {
    const __m512i x = _mm512_loadu_si512(a + 32 * w), y = _mm512_loadu_si512(b + 32 * w);
    pairs[2 * w] = _mm512_unpacklo_epi16(x, y);
    pairs[2 * w + 1] = _mm512_unpackhi_epi16(x, y);
  }
}

// The dimension lane i of sum register c holds in interleave_rows' order.
constexpr int pair_dim(int c, int i) { return 32 * (c / 2) + 8 * (i / 4) + 4 * (c % 2) + i % 4; }

template <int D>
inline void store_pair_order(const __m512 (&sums)[D / 16], float scale, at::BFloat16* p) {
  alignas(64) float x[D / 16][16];
  for (int c = 0; c < D / 16; ++c) _mm512_store_ps(x[c], sums[c]);
  for (int c = 0; c < D / 16; ++c)
    for (int i = 0; i < 16; ++i) p[pair_dim(c, i)] = from_float<at::BFloat16>(x[c][i] * scale);
}

// Lane l of the result is the pair (bfloat16(first[l]), bfloat16(second[l])).
inline __m512i weight_pairs(__m512 first, __m512 second) {
  // cvtne2ps puts the second operand's 16 values first; the permutation interleaves the halves.
  static const __m512i order = [] {
    alignas(64) uint16_t lanes[32];
    for (int i = 0; i < 32; ++i) lanes[i] = static_cast<uint16_t>(i % 2 * 16 + i / 2);
    return _mm512_load_si512(lanes);
  }();
  return _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(second, first));
}

// Where tokens first .. first + count of a sequence lie in its layer's cache (keys and values
// alike), one KV head's rows; block and row counted forward, never divided out per token.
inline void run_offsets(const int* table, int64_t first, int64_t count, int64_t kv_head, int64_t head_dim,
                        const Shape& s, int64_t* offsets) {
  const int64_t token_stride = s.num_kv_heads * head_dim;
  int64_t block = first / s.block_size, row = first % s.block_size;
  for (int64_t i = 0; i < count; ++i) {
    offsets[i] = (table[block] * s.block_size + row) * token_stride + kv_head * head_dim;
    if (++row == s.block_size) row = 0, ++block;
  }
}

// A decode work item here is one sequence's KV head with every query head of its group, over a
// run of its keys. The group's heads share those keys and values, so the item reads them from
// memory once: the first head's scores take each register's worth of keys from memory, the
// others' from L1, and each register's worth of values is interleaved into pairs once for all the
// heads. Where a batch has too few (sequence, KV head) pairs to give every thread kItemsPerThread
// items (one or two long chats), each pair's keys are split into runs, each run's softmax kept
// relative to its own maximum, and the runs merged at the end with the rescaling of the online
// softmax. Memory is kept busy by prefetching: keys two registers ahead; during the scores, the
// same register's values into L2; during the values, a share of the next item's keys.
constexpr int64_t kItemsPerThread = 2;

template <int D>
void decode_bf16(const at::BFloat16* q, const at::BFloat16* k_cache, const at::BFloat16* v_cache,
                 const int* block_tables, const int* context_lens, at::BFloat16* out, const Shape& s, float scale) {
  constexpr int W = D / 32, C = D / 16;
  static const at::BFloat16 zero_row[D] = {};  // the partner of a run's odd last value
  const int64_t group = s.num_q_heads / s.num_kv_heads;
  const int64_t num_pairs = s.num_seqs * s.num_kv_heads;
  const int64_t wanted = kItemsPerThread * at::get_num_threads();
  const int64_t runs = std::min((wanted + num_pairs - 1) / num_pairs, (s.max_len + kLanes - 1) / kLanes);
  const int64_t num_items = num_pairs * runs;
  const auto round_up = [](int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; };
  const int64_t most_keys = round_up((s.max_len + runs - 1) / runs);
  // Where runs > 1, every (item, head)'s maximum, total and sums in pair order, for the merge.
  const int64_t record = 2 + D;
  std::vector<float> partial(runs > 1 ? num_items * group * record : 0);
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * most_keys);
    std::vector<uint32_t> weights(group * most_keys / 2);  // keys 2i and 2i + 1's weights, bfloat16 in a word
    std::vector<int64_t> offsets(most_keys), next_offsets(most_keys);
    std::vector<__m512> acc(group * C);
    std::vector<float> maxima(group), totals(group);
    alignas(64) __m512i pairs[kLanes / 2][C];
    // Fills `into` with the item's key offsets and returns how many keys it has.
    auto item_offsets = [&](int64_t item, std::vector<int64_t>& into) {
      const int64_t seq = item / runs / s.num_kv_heads, kv_head = item / runs % s.num_kv_heads;
      const int64_t len = context_lens[seq], per_run = round_up((len + runs - 1) / runs);
      const int64_t first = std::min(len, item % runs * per_run), count = std::min(len - first, per_run);
      run_offsets(block_tables + seq * s.max_blocks, first, count, kv_head, D, s, into.data());
      return count;
    };
    int64_t next_count = begin < end ? item_offsets(begin, next_offsets) : 0;
    for (int64_t item = begin; item < end; ++item) {
      std::swap(offsets, next_offsets);
      const int64_t count = next_count;
      next_count = item + 1 < end ? item_offsets(item + 1, next_offsets) : 0;
      const int64_t seq = item / runs / s.num_kv_heads, kv_head = item / runs % s.num_kv_heads;
      const int64_t first_head = seq * s.num_q_heads + kv_head * group;
      const int64_t padded = round_up(count);
      for (int64_t t = count; t < padded; ++t) offsets[t] = offsets[count - 1];  // whole registers of real keys
      const int64_t next_per_register = padded ? (next_count + padded / kLanes - 1) / (padded / kLanes) : 0;
      int64_t next_key = 0;  // the next item's keys prefetched so far

      for (int64_t t = 0; t < count; t += kLanes) {
        for (int64_t j = t + 2 * kLanes; j < std::min(count, t + 3 * kLanes); ++j)
          prefetch_rows<D>(k_cache + offsets[j], 1, 0);
        for (int64_t j = t; j < std::min(count, t + kLanes); ++j)
          for (int i = 0; i < D; i += 32) __builtin_prefetch(v_cache + offsets[j] + i, 0, 2);
        for (int64_t h = 0; h < group; ++h) {
          __m512bh query[W];
          for (int w = 0; w < W; ++w) query[w] = (__m512bh)_mm512_loadu_si512(q + (first_head + h) * D + 32 * w);
          Vec part[kLanes];
          for (int j = 0; j < kLanes; ++j) {
            const at::BFloat16* key = k_cache + offsets[t + j];
            __m512 sum = _mm512_dpbf16_ps(_mm512_setzero_ps(), query[0], (__m512bh)_mm512_loadu_si512(key));
#pragma GCC unroll 8
            for (int w = 1; w < W; ++w)
              sum = _mm512_dpbf16_ps(sum, query[w], (__m512bh)_mm512_loadu_si512(key + 32 * w));
            part[j] = bit_cast<Vec>(sum);
          }
          const Vec dots = sum_lanes(part) * scale;
          std::memcpy(scores.data() + h * most_keys + t, &dots, sizeof(dots));
        }
      }
      // Each head's weights, unnormalized, rounded to bfloat16 (to nearest even) and kept in pairs.
      for (int64_t h = 0; h < group; ++h) {
        float* row = scores.data() + h * most_keys;
        totals[h] = softmax_in_place(row, count, &maxima[h]);
        for (int64_t t = count; t < padded; ++t) row[t] = 0.f;
        for (int64_t t = 0; t < padded; t += kLanes)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights.data() + (h * most_keys + t) / 2),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + t)));
        for (int c = 0; c < C; ++c) acc[h * C + c] = _mm512_setzero_ps();
      }
      for (int64_t t = 0; t < count; t += kLanes) {
        for (int64_t j = t + kLanes; j < std::min(count, t + 2 * kLanes); ++j)
          prefetch_rows<D>(v_cache + offsets[j], 1, 0);
        for (const int64_t last = std::min(next_count, next_key + next_per_register); next_key < last; ++next_key)
          for (int i = 0; i < D; i += 32) __builtin_prefetch(k_cache + next_offsets[next_key] + i, 0, 2);
        const int64_t n = std::min<int64_t>(kLanes, count - t);
        for (int64_t i = 0; 2 * i < n; ++i)
          interleave_rows<D>(v_cache + offsets[t + 2 * i], 2 * i + 1 < n ? v_cache + offsets[t + 2 * i + 1] : zero_row,
                             pairs[i]);
        for (int64_t h = 0; h < group; ++h) {
          const uint32_t* w = weights.data() + (h * most_keys + t) / 2;
          __m512 sums[C];
          for (int c = 0; c < C; ++c) sums[c] = acc[h * C + c];
          for (int64_t i = 0; 2 * i < n; ++i) {
            const __m512bh weight = (__m512bh)_mm512_set1_epi32(static_cast<int>(w[i]));
#pragma GCC unroll 16
            for (int c = 0; c < C; ++c) sums[c] = _mm512_dpbf16_ps(sums[c], (__m512bh)pairs[i][c], weight);
          }
          for (int c = 0; c < C; ++c) acc[h * C + c] = sums[c];
        }
      }
      for (int64_t h = 0; h < group; ++h) {
        const auto& sums = *reinterpret_cast<const __m512(*)[C]>(&acc[h * C]);
        if (runs == 1) {
          store_pair_order<D>(sums, 1.f / totals[h], out + (first_head + h) * D);
          continue;
        }
        float* p = partial.data() + (item * group + h) * record;
        p[0] = maxima[h];  // the lowest float for an empty run, whose total is 0
        p[1] = totals[h];
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(p + 2 + 16 * c, sums[c]);
      }
    }
  });
  if (runs == 1) return;
  // Each head's runs rescaled from their own maximum to the largest and added: a few hundred
  // floats a head, cheaper on this thread than another parallel region.
  for (int64_t head = 0; head < s.num_seqs * s.num_q_heads; ++head) {
    const float* first = partial.data() + (head / group * runs * group + head % group) * record;
    float largest = std::numeric_limits<float>::lowest();
    for (int64_t r = 0; r < runs; ++r) largest = std::max(largest, first[r * group * record]);
    float total = 0.f;
    __m512 sums[C];
    for (int c = 0; c < C; ++c) sums[c] = _mm512_setzero_ps();
    for (int64_t r = 0; r < runs; ++r) {
      const float* p = first + r * group * record;
      if (p[1] == 0.f) continue;
      const float factor = std::exp(p[0] - largest);
      total += p[1] * factor;
      for (int c = 0; c < C; ++c)
        sums[c] = _mm512_fmadd_ps(_mm512_loadu_ps(p + 2 + 16 * c), _mm512_set1_ps(factor), sums[c]);
    }
    store_pair_order<D>(sums, 1.f / total, out + head * D);
  }
}

template <int D>
void varlen_bf16(const at::BFloat16* q, const at::BFloat16* k_cache, const at::BFloat16* v_cache,
                 const int* block_tables, const int* cu_seqlens_q, const int* seq_lens_k, at::BFloat16* out,
                 const Shape& s, float scale) {
  constexpr int C = D / 16;
  constexpr int kTogether = C >= 16 ? 1 : 16 / C;  // lanes whose p . v run at once: 16 sums in registers
  constexpr float kMasked = std::numeric_limits<float>::lowest();
  static const at::BFloat16 zero_row[D] = {};
  const int64_t group = s.num_q_heads / s.num_kv_heads;
  const std::vector<Tile> tiles = sorted_tiles(cu_seqlens_q, seq_lens_k, s, kLanes);
  const int64_t num_items = static_cast<int64_t>(tiles.size());
  std::atomic<int64_t> next_item{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    alignas(64) uint32_t queries[D / 2][kLanes];      // elements 2p and 2p + 1 of every lane's query
    alignas(64) uint32_t weights[kLanes / 2][kLanes];  // lane l's softmax weights of keys 2i and 2i + 1
    __m512i values[kLanes / 2][C];                     // values 2i and 2i + 1, interleaved
    __m512 acc[kLanes][C];
    int64_t offsets[kLanes];
    for (int64_t item; (item = next_item.fetch_add(1)) < num_items;) {
      const auto [tile, kv_head, context, table] = tile_item(item, tiles, cu_seqlens_q, seq_lens_k, block_tables, s);
      float last_key_of[kLanes];
      for (int l = 0; l < kLanes; ++l) {
        uint32_t words[D / 2] = {};
        if (l < tile.count) std::memcpy(words, q + query_offset(tile, l, kv_head, cu_seqlens_q, s, D), sizeof(words));
        for (int p = 0; p < D / 2; ++p) queries[p][l] = words[p];
        last_key_of[l] = l < tile.count ? static_cast<float>(context + (tile.first_query + l) / group) : -1.f;
        for (int c = 0; c < C; ++c) acc[l][c] = _mm512_setzero_ps();
      }
      const Vec last_key = bit_cast<Vec>(last_key_of);
      Vec max_score = Vec{} + kMasked, total = Vec{};
      const int64_t keys_seen = context + (tile.first_query + tile.count - 1) / group + 1;
      for (int64_t start = 0; start < keys_seen; start += kLanes) {
        const int64_t n = std::min<int64_t>(kLanes, keys_seen - start);
        for (int64_t j = 0; j < kLanes; ++j) {
          const int64_t pos = start + std::min(j, n - 1);  // keys past n repeat the last; they are not used
          offsets[j] = table[pos / s.block_size] * s.block_size * s.num_kv_heads * D +
                       pos % s.block_size * s.num_kv_heads * D + kv_head * D;
        }
        // Four keys at a time, two chains each, eight sums against the FMA latency; a broadcast
        // pair of a key's elements against the tile's pairs of query elements.
        Vec scores[kLanes];
        for (int64_t j = 0; j < n; j += 4) {
          __m512 even[4], odd[4];
          for (int k = 0; k < 4; ++k) even[k] = odd[k] = _mm512_setzero_ps();
#pragma GCC unroll 32
          for (int p = 0; p < D / 2; p += 2) {
            const __m512bh q_even = (__m512bh)_mm512_load_si512(queries[p]);
            const __m512bh q_odd = (__m512bh)_mm512_load_si512(queries[p + 1]);
#pragma GCC unroll 4
            for (int k = 0; k < 4; ++k) {
              const at::BFloat16* key = k_cache + offsets[j + k];
              even[k] = _mm512_dpbf16_ps(even[k], q_even, broadcast_pair(key + 2 * p));
              odd[k] = _mm512_dpbf16_ps(odd[k], q_odd, broadcast_pair(key + 2 * p + 2));
            }
          }
          for (int k = 0; k < 4; ++k) scores[j + k] = bit_cast<Vec>(_mm512_add_ps(even[k], odd[k])) * scale;
        }
        const Vec rescale = mask_and_raise_max(scores, n, start, last_key, max_score, kMasked);
        total *= rescale;
        Vec p[kLanes];
        for (int64_t j = 0; j < kLanes; ++j) {
          p[j] = j < n ? exp_lanes(scores[j] - max_score) : Vec{};
          total += p[j];
        }
        const int64_t pairs = (n + 1) / 2;
        for (int64_t i = 0; i < pairs; ++i) {
          _mm512_store_si512(weights[i], weight_pairs(bit_cast<__m512>(p[2 * i]), bit_cast<__m512>(p[2 * i + 1])));
          interleave_rows<D>(v_cache + offsets[2 * i], 2 * i + 1 < n ? v_cache + offsets[2 * i + 1] : zero_row,
                             values[i]);
        }
        const auto rescale_of = bit_cast<std::array<float, kLanes>>(rescale);
        for (int64_t l = 0; l < tile.count; l += kTogether) {
          __m512 sums[kTogether][C];
          for (int g = 0; g < kTogether; ++g)
            for (int c = 0; c < C; ++c) sums[g][c] = _mm512_mul_ps(acc[l + g][c], _mm512_set1_ps(rescale_of[l + g]));
          for (int64_t i = 0; i < pairs; ++i)
#pragma GCC unroll 16
            for (int g = 0; g < kTogether; ++g) {
              const __m512bh w = broadcast_pair(&weights[i][l + g]);
#pragma GCC unroll 16
              for (int c = 0; c < C; ++c) sums[g][c] = _mm512_dpbf16_ps(sums[g][c], (__m512bh)values[i][c], w);
            }
          for (int g = 0; g < kTogether; ++g)
            for (int c = 0; c < C; ++c) acc[l + g][c] = sums[g][c];
        }
      }
      const auto total_of = bit_cast<std::array<float, kLanes>>(total);
      for (int64_t l = 0; l < tile.count; ++l) store_pair_order<D>(acc[l], 1.f / total_of[l], out + query_offset(tile, l, kv_head, cu_seqlens_q, s, D));
    }
  });
}
#endif

// Calls kernel<D>() for the head size D the tensors have, one of those compiled.
template <typename Kernel>
void dispatch_head_dim(int64_t head_dim, Kernel&& kernel) {
  switch (head_dim) {
    case 16: return kernel.template operator()<16>();
    case 32: return kernel.template operator()<32>();
    case 64: return kernel.template operator()<64>();
    case 128: return kernel.template operator()<128>();
    case 256: return kernel.template operator()<256>();
    default: TORCH_CHECK_VALUE(false, "head_dim must be one of 16, 32, 64, 128, 256, got ", head_dim);
  }
}

// What could make a kernel read outside the cache: a length past the table's room, a block id
// outside the cache. Returns the longest length.
int64_t check_lengths(const int* table_data, const int* len_data, const char* lens_name, const Shape& s,
                      int64_t num_blocks) {
  int64_t max_len = 0;
  for (int64_t seq = 0; seq < s.num_seqs; ++seq) {
    const int64_t len = len_data[seq];
    TORCH_CHECK_VALUE(len >= 1 && len <= s.max_blocks * s.block_size, lens_name, "[", seq, "] = ", len,
                      " must be in [1, ", s.max_blocks * s.block_size, "] (the blocks block_tables has room for)");
    for (int64_t b = 0; b * s.block_size < len; ++b) {
      const int block = table_data[seq * s.max_blocks + b];
      TORCH_CHECK_VALUE(block >= 0 && block < num_blocks, "block_tables[", seq, ", ", b, "] = ", block,
                        " is not a block of the cache (", num_blocks, " blocks)");
    }
    max_len = std::max(max_len, len);
  }
  return max_len;
}

}  // namespace

// Shapes and dtypes are checked by the Python wrapper; what could make this code read outside
// the cache (lengths, block ids, query offsets) is checked here, where it is cheap.
// The decode kernel on checked arguments: q contiguous, tables and lens int32 and contiguous, and
// s.max_len their longest length (check_lengths'). Both entry points below check once, then call it.
torch::Tensor attend_decode(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                            const torch::Tensor& tables, const torch::Tensor& lens, const Shape& s, double scale) {
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention_decode", [&] {
    dispatch_head_dim(q.size(2), [&]<int D>() {
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<scalar_t, at::BFloat16> && kDotBf16<D>) {
        return decode_bf16<D>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                              tables.data_ptr<int>(), lens.data_ptr<int>(), out.data_ptr<scalar_t>(), s,
                              static_cast<float>(scale));
      }
#endif
      decode<scalar_t, D>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                          tables.data_ptr<int>(), lens.data_ptr<int>(), out.data_ptr<scalar_t>(), s,
                          static_cast<float>(scale));
    });
  });
  return out;
}

torch::Tensor paged_attention_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  auto tables = block_tables.to(torch::kInt32).contiguous();
  auto lens = context_lens.to(torch::kInt32).contiguous();
  q = q.contiguous();
  TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous(), "k_cache and v_cache must be contiguous");
  Shape s{q.size(0), q.size(1), k_cache.size(2), k_cache.size(1), tables.size(1), 0};
  s.max_len = check_lengths(tables.data_ptr<int>(), lens.data_ptr<int>(), "context_lens", s, k_cache.size(0));
  return attend_decode(q, k_cache, v_cache, tables, lens, s, scale);
}

torch::Tensor paged_attention_varlen(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor cu_seqlens_q, torch::Tensor seq_lens_k, torch::Tensor block_tables,
                                     double scale) {
  auto tables = block_tables.to(torch::kInt32).contiguous();
  auto lens = seq_lens_k.to(torch::kInt32).contiguous();
  auto cu = cu_seqlens_q.to(torch::kInt32).contiguous();
  q = q.contiguous();
  TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous(), "k_cache and v_cache must be contiguous");
  Shape s{tables.size(0), q.size(1), k_cache.size(2), k_cache.size(1), tables.size(1), 0};
  TORCH_CHECK_VALUE(cu.dim() == 1 && cu.size(0) == s.num_seqs + 1, "cu_seqlens_q must have ", s.num_seqs + 1,
                    " entries (one more than block_tables has rows)");
  const int* cu_data = cu.data_ptr<int>();
  const int* len_data = lens.data_ptr<int>();
  TORCH_CHECK_VALUE(cu_data[0] == 0 && cu_data[s.num_seqs] == q.size(0), "cu_seqlens_q must rise from 0 to the ",
                    q.size(0), " query tokens");
  for (int64_t seq = 0; seq < s.num_seqs; ++seq) {
    const int64_t q_len = cu_data[seq + 1] - cu_data[seq];
    TORCH_CHECK_VALUE(q_len >= 0, "cu_seqlens_q must not fall (entry ", seq + 1, ")");
    TORCH_CHECK_VALUE(len_data[seq] >= q_len, "seq_lens_k[", seq, "] = ", len_data[seq],
                      " must be >= the sequence's new tokens (", q_len, ")");
  }
  s.max_len = check_lengths(tables.data_ptr<int>(), len_data, "seq_lens_k", s, k_cache.size(0));
  // A sequence that brings one token (a decode beside prompt chunks) would be a tile of one row,
  // its group's query heads: 3 of 16 lanes with the default model, at a whole tile's cost for
  // every key. Such sequences go through the decode kernel, the others through varlen: 16 decodes
  // of 256-320 tokens beside three 128-token chunks, 30 layers, 27.1 -> 19.3 ms in bfloat16.
  std::vector<int64_t> singles;
  Shape single_shape = s;  // the decode kernel's: those sequences only
  single_shape.max_len = 0;
  for (int64_t seq = 0; seq < s.num_seqs; ++seq)
    if (cu_data[seq + 1] - cu_data[seq] == 1) {
      singles.push_back(seq);
      single_shape.max_len = std::max<int64_t>(single_shape.max_len, len_data[seq]);
    }
  single_shape.num_seqs = static_cast<int64_t>(singles.size());
  if (single_shape.num_seqs == s.num_seqs)  // a decode batch: one row per sequence, in order
    return attend_decode(q, k_cache, v_cache, tables, lens, single_shape, scale);
  if (!singles.empty()) s.varlen_min_tokens = 2;
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention_varlen", [&] {
    dispatch_head_dim(q.size(2), [&]<int D>() {
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<scalar_t, at::BFloat16> && kDotBf16<D>) {
        return varlen_bf16<D>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                              tables.data_ptr<int>(), cu_data, len_data, out.data_ptr<scalar_t>(), s,
                              static_cast<float>(scale));
      }
#endif
      varlen<scalar_t, D>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                          tables.data_ptr<int>(), cu_data, len_data, out.data_ptr<scalar_t>(), s,
                          static_cast<float>(scale));
    });
  });
  if (!singles.empty()) {
    auto seqs = torch::tensor(singles, torch::kInt64);
    auto rows = cu.index_select(0, seqs).to(torch::kInt64);
    out.index_copy_(0, rows,
                    attend_decode(q.index_select(0, rows), k_cache, v_cache, tables.index_select(0, seqs),
                                  lens.index_select(0, seqs), single_shape, scale));
  }
  return out;
}

// One layer's attention step as a compiled forward calls it (chapter 07's unified_attention on a
// CPU): write the batch's new K/V ([T, Hkv, D]) to their slots of kv_cache[0 / 1, layer] (chapter
// 01's store_kvcache; slot -1 stores nothing), then attend (paged_attention_varlen, which hands
// sequences of one new token to the decode kernel). Registered as a torch operator, so
// the compiled graph calls it through the dispatcher with no Python between the layers.
torch::Tensor store_and_attend(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor kv_cache,
                               int64_t layer, torch::Tensor slot_mapping, torch::Tensor cu_seqlens_q,
                               torch::Tensor seq_lens_k, torch::Tensor block_tables, double scale) {
  TORCH_CHECK_VALUE(kv_cache.dim() == 6 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
                    "kv_cache must be a contiguous [2, layers, blocks, block_size, kv_heads, head_dim] tensor");
  TORCH_CHECK_VALUE(layer >= 0 && layer < kv_cache.size(1), "layer must be in [0, ", kv_cache.size(1), ")");
  auto k_cache = kv_cache[0][layer], v_cache = kv_cache[1][layer];
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t row_bytes = k_cache.stride(1) * k_cache.element_size();
  TORCH_CHECK_VALUE(k.sizes() == v.sizes() && k.dim() == 3 && k.size(1) == k_cache.size(2) &&
                        k.size(2) == k_cache.size(3) && k.scalar_type() == kv_cache.scalar_type() &&
                        v.scalar_type() == kv_cache.scalar_type(),
                    "k and v must be [tokens, kv_heads, head_dim] in kv_cache's dtype and head layout");
  k = k.stride(2) == 1 && k.stride(1) == k.size(2) ? k : k.contiguous();  // rows may be strided (a fused QKV)
  v = v.stride(2) == 1 && v.stride(1) == v.size(2) ? v : v.contiguous();
  auto slots = slot_mapping.to(torch::kInt64).contiguous();
  TORCH_CHECK_VALUE(slots.dim() == 1 && slots.size(0) == k.size(0), "slot_mapping must have one slot per token");
  const int64_t* slot = slots.data_ptr<int64_t>();
  auto* k_dst = static_cast<char*>(k_cache.data_ptr());
  auto* v_dst = static_cast<char*>(v_cache.data_ptr());
  const auto* k_src = static_cast<const char*>(k.data_ptr());
  const auto* v_src = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < k.size(0); ++t) {
    if (slot[t] < 0) continue;
    TORCH_CHECK_VALUE(slot[t] < num_slots, "slot_mapping holds slot ", slot[t], " but the cache has ", num_slots,
                      " slots");
    std::memcpy(k_dst + slot[t] * row_bytes, k_src + t * k.stride(0) * k.element_size(), row_bytes);
    std::memcpy(v_dst + slot[t] * row_bytes, v_src + t * v.stride(0) * v.element_size(), row_bytes);
  }
  return paged_attention_varlen(q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables, scale);
}

TORCH_LIBRARY(vllm_fs_cpu, m) {
  m.def(
      "store_and_attend(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, int layer, Tensor slot_mapping, "
      "Tensor cu_seqlens_q, Tensor seq_lens_k, Tensor block_tables, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_fs_cpu, CPU, m) { m.impl("store_and_attend", &store_and_attend); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_decode", &paged_attention_decode,
        "Paged decode attention on the CPU: q [B, Hq, D] over k/v_cache [blocks, block_size, Hkv, D]");
  m.def("paged_attention_varlen", &paged_attention_varlen,
        "Causal paged attention of packed new tokens on the CPU: q [T, Hq, D], cu_seqlens_q [B+1]");
}
