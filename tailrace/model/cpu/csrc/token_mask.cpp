// Grammar masks on the logits: the rows a grammar constrains get -inf wherever their bitmask
// (llguidance's layout: bit i of 32-bit word w allows token 32 * w + i) has a 0. Sixteen bits are
// one lane mask, so a row of 8k tokens is 512 masked stores, with no unpacking and no bias tensor:
// numpy's unpackbits and a float bias added row by row took 60-90 us for 4 rows of 8k, this 5 us
// with the call. A handful of rows is too little work to share out: no parallel region, whose start
// waits for every thread's core on a busy CPU.
//
// The sampler's exp then meets those rows' -inf, which torch's exp takes on a slow path: 4 masked
// rows of 8k added about 280 us to a 35 us exp of 16 rows. `exp_skipping_neg_inf_` sets those
// -inf to 0 for torch's exp and writes their 0 afterwards, so every other value gets the bits
// exp_ itself gives it (its lanes are independent), in one call over all the rows.

#include <torch/extension.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace tailrace {

void mask_token_rows(float* logits, int64_t row_stride, int64_t vocab, const uint16_t* bits, int64_t bits_stride,
                     const int64_t* rows, int64_t count) {
    const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t k = 0; k < count; ++k) {
        float* row = logits + rows[k] * row_stride;
        const uint16_t* allowed = bits + k * bits_stride;
        for (int64_t i = 0; i < vocab; i += kLanes)
            store16(row + i, neg_inf, static_cast<__mmask16>(~allowed[i / kLanes]) & lanes(vocab - i));
    }
}

}  // namespace tailrace

namespace {

// logits [R, V] (rows any stride), bitmask int32 [len(rows), ceil(V / 32)]: row rows[k] takes mask k.
void mask_tokens(torch::Tensor& logits, const torch::Tensor& bitmask, const std::vector<int64_t>& rows) {
    TORCH_CHECK(logits.scalar_type() == torch::kFloat32 && logits.dim() == 2 && logits.stride(1) == 1,
                "logits must be float32 [R, V] with each row contiguous");
    const int64_t vocab = logits.size(1), count = static_cast<int64_t>(rows.size());
    TORCH_CHECK(bitmask.scalar_type() == torch::kInt32 && bitmask.dim() == 2 && bitmask.is_contiguous() &&
                bitmask.size(0) == count && bitmask.size(1) == (vocab + 31) / 32,
                "bitmask must be contiguous int32 [len(rows), ceil(V / 32)]");
    for (const int64_t row : rows)
        TORCH_CHECK(row >= 0 && row < logits.size(0), "row ", row, " is outside the logits");
    const auto* bits = reinterpret_cast<const uint16_t*>(bitmask.data_ptr<int32_t>());
    tailrace::mask_token_rows(logits.data_ptr<float>(), logits.stride(0), vocab, bits, 2 * bitmask.size(1), rows.data(),
                              count);
}

// x.exp_() for x float32 [R, V] (rows contiguous), with the lanes of `rows` that hold -inf set to
// 0 without passing through exp: they hold 0 during it (exp's fast path) and get 0 after. Every
// other value (NaN included) stays in place for the one exp_ over the whole tensor. Packing the
// kept values into a buffer for a second exp instead cost 40 us more a step (16 rows of 8k,
// 4 masked): compress and expand stores are slow on Intel cores.
void exp_skipping_neg_inf_(torch::Tensor& x, const std::vector<int64_t>& rows) {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x must be contiguous float32 [R, V]");
    const int64_t vocab = x.size(1), blocks = (vocab + tailrace::kLanes - 1) / tailrace::kLanes;
    for (const int64_t row : rows)
        TORCH_CHECK(row >= 0 && row < x.size(0), "row ", row, " is outside x");
    const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    std::vector<__mmask16> skipped(rows.size() * blocks);
    for (size_t k = 0; k < rows.size(); ++k) {
        float* row = x.data_ptr<float>() + rows[k] * vocab;
        for (int64_t b = 0; b < blocks; ++b) {
            const __mmask16 m = tailrace::lanes(vocab - b * tailrace::kLanes);
            const __m512 v = _mm512_maskz_loadu_ps(m, row + b * tailrace::kLanes);
            skipped[k * blocks + b] = _mm512_mask_cmp_ps_mask(m, v, neg_inf, _CMP_EQ_OQ);
            _mm512_mask_storeu_ps(row + b * tailrace::kLanes, skipped[k * blocks + b], _mm512_setzero_ps());
        }
    }
    x.exp_();
    for (size_t k = 0; k < rows.size(); ++k) {
        float* row = x.data_ptr<float>() + rows[k] * vocab;
        for (int64_t b = 0; b < blocks; ++b)
            _mm512_mask_storeu_ps(row + b * tailrace::kLanes, skipped[k * blocks + b], _mm512_setzero_ps());
    }
}

}  // namespace

void register_token_mask(pybind11::module& m) {
    m.def("mask_tokens", &mask_tokens, "set logits[rows[k]] to -inf where bitmask[k] has a 0 (float32)");
    m.def("exp_skipping_neg_inf_", &exp_skipping_neg_inf_,
          "x.exp_() with the listed rows' -inf lanes set to 0 without torch's slow path for them (float32)");
}
