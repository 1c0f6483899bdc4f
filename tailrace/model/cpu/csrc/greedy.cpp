// The greedy pick of each logit row: the index torch.max(dim=1).indices gives (the first largest
// value, or the first NaN where a row has one), in two passes of 16 lanes over the row. torch's
// reduction took 51 us for one row of SmolLM2's 49k logits warm, and 180 us right after a step had
// streamed its weights through the caches; this takes a few.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <limits>

#include "vec.h"

namespace {

using tailrace::kLanes;
using tailrace::lanes;

constexpr int64_t kRowsPerTask = 4;

int64_t first_where(const float* x, int64_t n, __mmask16 (*hit)(__m512, __m512), __m512 target) {
    for (int64_t i = 0; i < n; i += kLanes) {
        const __mmask16 m = lanes(n - i);
        const __mmask16 found = hit(_mm512_maskz_loadu_ps(m, x + i), target) & m;
        if (found)
            return i + __builtin_ctz(found);
    }
    return -1;
}

__mmask16 equal(__m512 v, __m512 target) { return _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ); }
__mmask16 is_nan(__m512 v, __m512) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }

int64_t row_argmax(const float* x, int64_t n) {
    const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512 best = neg_inf;
    __mmask16 nan = 0;
    for (int64_t i = 0; i < n; i += kLanes) {
        const __m512 v = _mm512_mask_loadu_ps(neg_inf, lanes(n - i), x + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        best = _mm512_max_ps(best, v);
    }
    if (nan)
        return first_where(x, n, is_nan, best);
    return first_where(x, n, equal, _mm512_set1_ps(_mm512_reduce_max_ps(best)));
}

// logits float32 [R, V], each row contiguous -> int64 [R]
torch::Tensor greedy_tokens(const torch::Tensor& logits) {
    TORCH_CHECK(logits.scalar_type() == torch::kFloat32 && logits.dim() == 2 && logits.stride(1) == 1 &&
                logits.size(1) > 0, "logits must be float32 [R, V] with each row contiguous and V > 0");
    const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
    torch::Tensor out = torch::empty({rows}, logits.options().dtype(torch::kInt64));
    const float* x = logits.data_ptr<float>();
    int64_t* picked = out.data_ptr<int64_t>();
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
            picked[r] = row_argmax(x + r * stride, vocab);
    });
    return out;
}

}  // namespace

void register_greedy(pybind11::module& m) {
    m.def("greedy_tokens", &greedy_tokens,
          "each row's torch.max(dim=1).indices: the first largest logit, or the first NaN (float32 [R, V])");
}
