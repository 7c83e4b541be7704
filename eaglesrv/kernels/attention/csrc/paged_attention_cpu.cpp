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

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

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

// Scratch space of one thread, sized for the longest row.
struct Scratch {
  std::vector<float> scores, query, acc, best, total;
  Scratch(const Shape& s, int64_t longest)
      : scores(s.num_heads * std::max<int64_t>(longest, 1)), query(s.num_heads * s.head_dim),
        acc(s.num_heads * s.head_dim), best(s.num_heads), total(s.num_heads) {}
};

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
        attend_item<scalar_t>(shape, q_p + row * row_stride, k_p, v_p, pages_p + r * max_pages, keys_p[r], mask,
                              h0, h1, scratch, out_p + row * row_stride);
      }
    });
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over selected query rows (CPU)");
}
