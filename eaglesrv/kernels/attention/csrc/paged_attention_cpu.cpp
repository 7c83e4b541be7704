// Paged attention for the CPU: each query row reads its sequence's keys and values straight
// out of the pages, so nothing is gathered into a padded copy first (that copy, written and
// read again every layer, is what a decode step spent most of its time on in pure torch).
//
// One work item is one query row and a run of kv heads: it scores the query heads of those
// kv heads (GQA) against every visible key, takes the softmax, then sums the values. An
// item reads each token's keys for all its heads in one contiguous piece, which is what
// keeps the memory traffic streaming; rows are split by head only when there are too few
// rows to keep every thread busy. Scores are kept whole rather than with an online
// softmax: rows here are decode or tree-verify rows, whose key count is at most the context.
//
// Where the build has AVX-512 and heads are 64 or 128 wide (every model served so far), an
// item runs attend_item_avx512 instead: the same steps, with the dot products' horizontal
// sums batched 16 keys at a time. It takes 25-45% less time than the portable item on a
// 2-core AMD EPYC (bf16, 1 to 64 sequences of 300 to 1,000 tokens).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// Built with -ffast-math (so that the softmax's exp vectorizes), which assumes no
// infinities: a masked score is this very negative finite value, and exp of it is 0.
constexpr float kMasked = -1e30f;

template <typename scalar_t>
inline float as_float(scalar_t x) { return static_cast<float>(x); }

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, page_size;
  float scale;
  int64_t group() const { return num_heads / num_kv_heads; }
};

// Hardware prefetchers stop at 4 KiB boundaries and pages sit anywhere in the pool, so
// each step over a token also asks for the same token of the next page, ahead of use.
template <typename scalar_t>
inline void prefetch_token(const scalar_t* token, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(token);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset);
}

// Scratch space of one thread, sized for the longest row. `block` holds the AVX-512 item's
// 16 widened tokens (kBlock) of every kv head.
struct Scratch {
  std::vector<float> scores, query, acc, best, total, block;
  Scratch(const Shape& s, int64_t longest)
      : scores(s.num_heads * std::max<int64_t>(longest, 1)), query(s.num_heads * s.head_dim),
        acc(s.num_heads * s.head_dim), best(s.num_heads), total(s.num_heads), block(16 * s.num_kv_heads * s.head_dim) {}
};

// Each head's scores [heads, num_keys] become exp(score - best[h]); total[h] gets their sum
// (0 when every key is masked, and then the weights are all 0).
inline void softmax_rows(float* scores, int64_t heads, int64_t num_keys, const float* best, float* total) {
  for (int64_t h = 0; h < heads; ++h) {
    float* sh = scores + h * num_keys;
    if (best[h] <= kMasked) {  // every key masked: no weights at all
      std::fill(sh, sh + num_keys, 0.f);
      total[h] = 0.f;
      continue;
    }
    const float top = best[h];
    float sum = 0.f;
    // exp(kMasked - top) is 0, so masked keys drop out without a branch.
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < num_keys; ++j) {
      sh[j] = std::exp(sh[j] - top);
      sum += sh[j];
    }
    total[h] = sum;
  }
}

// Query heads [h0, h1) of one row, h0/h1 on kv-head boundaries. Index h - h0 everywhere
// in the scratch arrays.
template <typename scalar_t>
void attend_item(const Shape& shape, const scalar_t* q_row, const scalar_t* k_cache, const scalar_t* v_cache,
                 const int64_t* page_table, int64_t num_keys, const bool* mask, int64_t h0, int64_t h1,
                 Scratch& scratch, scalar_t* out_row) {
  const int64_t dim = shape.head_dim, group = shape.group(), heads = h1 - h0;
  const int64_t slot_stride = shape.num_kv_heads * dim;
  // The kv heads this item reads: one contiguous piece of each token's slot.
  const int64_t kv0 = h0 / group, kv_bytes = (h1 - h0) / group * dim * static_cast<int64_t>(sizeof(scalar_t));
  float* scores = scratch.scores.data();
  float* query = scratch.query.data();
  float* acc = scratch.acc.data();
  float* best = scratch.best.data();
  float* total = scratch.total.data();
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t d = 0; d < dim; ++d) query[h * dim + d] = as_float(q_row[(h0 + h) * dim + d]) * shape.scale;
    best[h] = kMasked;
  }

  // Keys page by page: the slots of one page are consecutive, so no division per key.
  for (int64_t first = 0; first < num_keys; first += shape.page_size) {
    const int64_t count = std::min(shape.page_size, num_keys - first);
    const scalar_t* page = k_cache + page_table[first / shape.page_size] * shape.page_size * slot_stride;
    const scalar_t* next = first + shape.page_size < num_keys
        ? k_cache + page_table[first / shape.page_size + 1] * shape.page_size * slot_stride : nullptr;
    for (int64_t t = 0; t < count; ++t) {
      const int64_t j = first + t;
      if (next) prefetch_token(next + t * slot_stride + kv0 * dim, kv_bytes);
      if (mask && !mask[j]) {
        for (int64_t h = 0; h < heads; ++h) scores[h * num_keys + j] = kMasked;
        continue;
      }
      for (int64_t h = 0; h < heads; ++h) {
        const scalar_t* key = page + t * slot_stride + ((h0 + h) / group) * dim;
        const float* qh = query + h * dim;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < dim; ++d) dot += qh[d] * as_float(key[d]);
        scores[h * num_keys + j] = dot;
        best[h] = std::max(best[h], dot);
      }
    }
  }

  softmax_rows(scores, heads, num_keys, best, total);

  std::fill(acc, acc + heads * dim, 0.f);
  for (int64_t first = 0; first < num_keys; first += shape.page_size) {
    const int64_t count = std::min(shape.page_size, num_keys - first);
    const scalar_t* page = v_cache + page_table[first / shape.page_size] * shape.page_size * slot_stride;
    const scalar_t* next = first + shape.page_size < num_keys
        ? v_cache + page_table[first / shape.page_size + 1] * shape.page_size * slot_stride : nullptr;
    for (int64_t t = 0; t < count; ++t) {
      const int64_t j = first + t;
      if (next) prefetch_token(next + t * slot_stride + kv0 * dim, kv_bytes);
      if (mask && !mask[j]) continue;
      for (int64_t h = 0; h < heads; ++h) {
        const scalar_t* value = page + t * slot_stride + ((h0 + h) / group) * dim;
        const float weight = scores[h * num_keys + j];
        float* ah = acc + h * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) ah[d] += weight * as_float(value[d]);
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const float inv = total[h] > 0.f ? 1.f / total[h] : 0.f;  // a row that sees no key gets zeros
    for (int64_t d = 0; d < dim; ++d) out_row[(h0 + h) * dim + d] = static_cast<scalar_t>(acc[h * dim + d] * inv);
  }
}

#if defined(__AVX512F__)
// The same item with AVX-512, for head sizes of 64 and 128. The item's keys and values are
// widened to float 16 tokens at a time, once for all its query heads. A key's dot product
// is left as 16 partial sums; sixteen keys' partial sums are then folded together
// (sum_lanes), so the horizontal sums cost a few operations a key instead of a reduction
// each. The values are summed in registers, a block at a time.

constexpr int64_t kBlock = 16;  // tokens widened together: one score per lane

template <typename scalar_t> inline __m512 load16(const scalar_t* p) {  // double: element by element
  alignas(64) float wide[16];
  for (int i = 0; i < 16; ++i) wide[i] = as_float(p[i]);
  return _mm512_load_ps(wide);
}
template <> inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <> inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));  // bf16 is fp32's top half
}
template <> inline __m512 load16<c10::Half>(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Lane picks for folding two vectors of 2s-lane segments into one of s-lane segments: the
// first s lanes of every segment of a, then of b (low), and the last s lanes (high).
struct FoldIndex {
  __m512i low[4], high[4];  // for s = 8, 4, 2, 1
  FoldIndex() {
    for (int level = 0; level < 4; ++level) {
      const int s = 8 >> level, segments = 16 / (2 * s);
      alignas(64) int lo[16], hi[16];
      for (int lane = 0; lane < 16; ++lane) {
        const int k = lane / s, o = lane % s;
        const int from_b = k >= segments ? 16 : 0, segment = k % segments;
        lo[lane] = from_b + segment * 2 * s + o;
        hi[lane] = lo[lane] + s;
      }
      low[level] = _mm512_load_si512(lo);
      high[level] = _mm512_load_si512(hi);
    }
  }
};

// Lane t of the result is the sum of the 16 lanes of v[t]; v is overwritten.
inline __m512 sum_lanes(__m512 v[kBlock]) {
  static const FoldIndex index;
  for (int level = 0, count = 16; level < 4; ++level, count /= 2) {
    for (int i = 0; i < count / 2; ++i) {
      const __m512 a = v[2 * i], b = v[2 * i + 1];
      v[i] = _mm512_add_ps(_mm512_permutex2var_ps(a, index.low[level], b),
                           _mm512_permutex2var_ps(a, index.high[level], b));
    }
  }
  return v[0];
}

// Widen `count` tokens (count <= kBlock, within one page) of the item's kv heads, `width`
// values each from page_start on, into block[t * width ..]; rows past count are zero.
template <typename scalar_t>
inline void widen_block(const scalar_t* page_start, int64_t slot_stride, int64_t width, int64_t count,
                        const scalar_t* next_page, float* block) {
  const int64_t bytes = width * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t t = 0; t < kBlock; ++t) {
    for (int64_t c = 0; c < width; c += 16) {
      _mm512_storeu_ps(block + t * width + c, t < count ? load16(page_start + t * slot_stride + c) : _mm512_setzero_ps());
    }
    if (t < count && next_page) prefetch_token(next_page + t * slot_stride, bytes);
  }
}

// Calls visit(block, first key, tokens) for the item's keys (or values) kBlock tokens at a
// time, widened; blocks never straddle a page.
template <typename scalar_t, typename Visit>
inline void for_each_block(const Shape& shape, const scalar_t* cache, const int64_t* page_table, int64_t num_keys,
                           int64_t kv0, int64_t width, float* block, Visit visit) {
  const int64_t page = shape.page_size, slot_stride = shape.num_kv_heads * shape.head_dim;
  for (int64_t first = 0; first < num_keys; first += page) {
    const int64_t count = std::min(page, num_keys - first);
    const scalar_t* tokens = cache + (page_table[first / page] * page * slot_stride + kv0 * shape.head_dim);
    const scalar_t* next = first + page < num_keys
        ? cache + (page_table[first / page + 1] * page * slot_stride + kv0 * shape.head_dim) : nullptr;
    for (int64_t t0 = 0; t0 < count; t0 += kBlock) {
      const int64_t size = std::min(kBlock, count - t0);
      widen_block(tokens + t0 * slot_stride, slot_stride, width, size, next ? next + t0 * slot_stride : nullptr, block);
      visit(block, first + t0, size);
    }
  }
}

template <int kChunks, typename scalar_t>
void attend_item_avx512(const Shape& shape, const scalar_t* q_row, const scalar_t* k_cache, const scalar_t* v_cache,
                        const int64_t* page_table, int64_t num_keys, const bool* mask, int64_t h0, int64_t h1,
                        Scratch& scratch, scalar_t* out_row) {
  constexpr int64_t dim = kChunks * 16;
  const int64_t group = shape.group(), heads = h1 - h0, kv0 = h0 / group, width = heads / group * dim;
  float* scores = scratch.scores.data();  // [heads, num_keys]
  float* query = scratch.query.data();  // [heads, dim], scaled
  float* sums = scratch.acc.data();  // [heads, dim]: value sums between blocks
  float* best = scratch.best.data();  // [heads]
  float* total = scratch.total.data();  // [heads]
  float* block = scratch.block.data();  // [kBlock, width]
  for (int64_t i = 0; i < heads * dim; ++i) query[i] = as_float(q_row[h0 * dim + i]) * shape.scale;
  std::fill(best, best + heads, kMasked);

  for_each_block(shape, k_cache, page_table, num_keys, kv0, width, block, [&](const float* keys, int64_t j0, int64_t size) {
    const __mmask16 present = static_cast<__mmask16>((1u << size) - 1);  // lanes holding a token
    __mmask16 visible = present;
    if (mask) {
      for (int64_t t = 0; t < size; ++t) {
        if (!mask[j0 + t]) visible &= static_cast<__mmask16>(~(1u << t));
      }
    }
    for (int64_t h = 0; h < heads; ++h) {
      const float* kv_keys = keys + (h / group) * dim;
      __m512 q[kChunks];
#pragma GCC unroll 16
      for (int c = 0; c < kChunks; ++c) q[c] = _mm512_loadu_ps(query + h * dim + c * 16);
      __m512 partial[kBlock];
#pragma GCC unroll 16
      for (int t = 0; t < kBlock; ++t) {
        __m512 acc = _mm512_mul_ps(q[0], _mm512_loadu_ps(kv_keys + t * width));
#pragma GCC unroll 16
        for (int c = 1; c < kChunks; ++c) acc = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(kv_keys + t * width + c * 16), acc);
        partial[t] = acc;
      }
      const __m512 block_scores = _mm512_mask_blend_ps(visible, _mm512_set1_ps(kMasked), sum_lanes(partial));
      _mm512_mask_storeu_ps(scores + h * num_keys + j0, present, block_scores);
      best[h] = std::max(best[h], _mm512_mask_reduce_max_ps(present, block_scores));
    }
  });

  softmax_rows(scores, heads, num_keys, best, total);

  std::fill(sums, sums + heads * dim, 0.f);
  for_each_block(shape, v_cache, page_table, num_keys, kv0, width, block, [&](const float* values, int64_t j0, int64_t size) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* kv_values = values + (h / group) * dim;
      const float* weights = scores + h * num_keys + j0;
      __m512 acc[kChunks];
#pragma GCC unroll 16
      for (int c = 0; c < kChunks; ++c) acc[c] = _mm512_loadu_ps(sums + h * dim + c * 16);
      for (int64_t t = 0; t < size; ++t) {
        const __m512 weight = _mm512_set1_ps(weights[t]);
#pragma GCC unroll 16
        for (int c = 0; c < kChunks; ++c) acc[c] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(kv_values + t * width + c * 16), acc[c]);
      }
#pragma GCC unroll 16
      for (int c = 0; c < kChunks; ++c) _mm512_storeu_ps(sums + h * dim + c * 16, acc[c]);
    }
  });
  for (int64_t h = 0; h < heads; ++h) {
    const float inv = total[h] > 0.f ? 1.f / total[h] : 0.f;  // a row that sees no key gets zeros
    for (int64_t d = 0; d < dim; ++d) out_row[(h0 + h) * dim + d] = static_cast<scalar_t>(sums[h * dim + d] * inv);
  }
}
#endif

// The AVX-512 item where the build and the head size allow it (64 or 128), else the portable one.
template <typename scalar_t>
void attend(const Shape& shape, const scalar_t* q_row, const scalar_t* k_cache, const scalar_t* v_cache,
            const int64_t* page_table, int64_t num_keys, const bool* mask, int64_t h0, int64_t h1, Scratch& scratch,
            scalar_t* out_row) {
#if defined(__AVX512F__)
  switch (shape.head_dim) {  // the head sizes of the models served, unrolled at compile time
    case 64: return attend_item_avx512<4>(shape, q_row, k_cache, v_cache, page_table, num_keys, mask, h0, h1, scratch, out_row);
    case 128: return attend_item_avx512<8>(shape, q_row, k_cache, v_cache, page_table, num_keys, mask, h0, h1, scratch, out_row);
    default: break;
  }
#endif
  attend_item<scalar_t>(shape, q_row, k_cache, v_cache, page_table, num_keys, mask, h0, h1, scratch, out_row);
}

}  // namespace

// q, out:            [num_tokens, num_heads, head_dim]   (out rows not in `rows` are left as they are)
// k_cache, v_cache:  [num_slots, num_kv_heads, head_dim]
// rows:              [R] rows of q to compute
// row_pages:         [R, max_pages] the page table of each row's sequence
// row_num_keys:      [R] keys 0 .. n-1 of the sequence are candidates for the row
// row_mask_offset:   [R] start of the row's n mask entries in `masks`, or -1: all visible
void paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                     torch::Tensor& out, const torch::Tensor& rows, const torch::Tensor& row_pages,
                     const torch::Tensor& row_num_keys, const torch::Tensor& row_mask_offset,
                     const torch::Tensor& masks, int64_t page_size, double scale) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention: q, out and the caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
                  q.scalar_type() == out.scalar_type(), "paged_attention: q, out and the caches must share a dtype");
  TORCH_CHECK(rows.scalar_type() == torch::kLong && row_pages.scalar_type() == torch::kLong &&
                  row_num_keys.scalar_type() == torch::kLong && row_mask_offset.scalar_type() == torch::kLong &&
                  masks.scalar_type() == torch::kBool, "paged_attention: index tensors must be int64, masks bool");
  TORCH_CHECK(row_pages.is_contiguous() && masks.is_contiguous(), "paged_attention: row_pages and masks must be contiguous");
  const Shape shape{q.size(1), k_cache.size(1), q.size(2), page_size, static_cast<float>(scale)};
  TORCH_CHECK(shape.num_heads % shape.num_kv_heads == 0, "paged_attention: heads must be a multiple of kv heads");
  const int64_t num_rows = rows.size(0), max_pages = row_pages.size(1);
  const int64_t* rows_p = rows.data_ptr<int64_t>();
  const int64_t* keys_p = row_num_keys.data_ptr<int64_t>();
  const int64_t* mask_off_p = row_mask_offset.data_ptr<int64_t>();
  const int64_t* pages_p = row_pages.data_ptr<int64_t>();
  const bool* masks_p = masks.data_ptr<bool>();
  int64_t longest = 0;
  for (int64_t r = 0; r < num_rows; ++r) {
    TORCH_CHECK(keys_p[r] <= max_pages * page_size, "paged_attention: a row has more keys than its pages hold");
    TORCH_CHECK(mask_off_p[r] < 0 || mask_off_p[r] + keys_p[r] <= masks.numel(), "paged_attention: a mask runs past the end");
    longest = std::max(longest, keys_p[r]);
  }
  // Whole rows when there are enough of them to share out; otherwise one kv head per item.
  const int64_t splits = num_rows >= 4 * at::get_num_threads() ? 1 : shape.num_kv_heads;
  const int64_t kv_per_item = shape.num_kv_heads / splits;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    const scalar_t* q_p = q.data_ptr<scalar_t>();
    const scalar_t* k_p = k_cache.data_ptr<scalar_t>();
    const scalar_t* v_p = v_cache.data_ptr<scalar_t>();
    scalar_t* out_p = out.data_ptr<scalar_t>();
    const int64_t row_stride = shape.num_heads * shape.head_dim;
    at::parallel_for(0, num_rows * splits, 1, [&](int64_t begin, int64_t end) {
      Scratch scratch(shape, longest);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t r = item / splits, part = item % splits;
        const int64_t h0 = part * kv_per_item * shape.group(), h1 = h0 + kv_per_item * shape.group();
        const int64_t row = rows_p[r];
        const bool* mask = mask_off_p[r] < 0 ? nullptr : masks_p + mask_off_p[r];
        attend<scalar_t>(shape, q_p + row * row_stride, k_p, v_p, pages_p + r * max_pages, keys_p[r], mask,
                              h0, h1, scratch, out_p + row * row_stride);
      }
    });
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over selected query rows (CPU)");
}
