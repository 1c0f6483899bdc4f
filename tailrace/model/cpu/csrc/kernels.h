// The kernels' entry points on raw pointers: what both the Python-facing functions and the
// whole-forward loop (decoder.cpp) call, so the two paths run the same arithmetic and round at the
// same points. Each parallelises itself with at::parallel_for and computes every row alone.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>
#include <vector>

namespace tailrace {

// bf16_linear.cpp: y [rows][n] = x [rows][k] @ W.T (+ bias), W packed as [vectors][k / 2][32],
// bias float32 [vectors * 16] or nullptr.
void bf16_linear(const c10::BFloat16* x, const c10::BFloat16* packed, int64_t vectors, const float* bias,
                 c10::BFloat16* y, int64_t rows, int64_t k, int64_t n);
// bf16_linear.cpp: the same for float32 x and W, W packed as [vectors][k / 2][2][16] (a pair's two
// values 16 lanes apart).
void f32_linear(const float* x, const float* packed, int64_t vectors, const float* bias, float* y, int64_t rows,
                int64_t k, int64_t n);
// bf16_linear.cpp: the process-wide switches, set once from Python (cpu_kernels.build) before any
// kernel runs: whether AMX tiles may serve bfloat16 projections, and whether AVX512-BF16's dot
// product may (false: two FMAs a pair, the same sums, as CPUs without it compute them).
void configure(bool amx, bool bf16_dot);
bool amx_allowed();
// bf16_linear.cpp: whether bfloat16 pairs are summed by AVX512-BF16's vdpbf16ps (else by two FMAs
// a pair, the same sums): the CPU has it, and configure() allowed it.
bool native_bf16_dot();
// f(std::true_type{}) where T is bfloat16 and native_bf16_dot() (AVX512-BF16's vdpbf16ps and
// vcvtneps2bf16 for its dot products and rounding), else f(std::false_type{}): the Native argument
// of vec.h's rounding and of the kernels' bfloat16 paths, chosen once a call.
template <typename T, typename F>
void with_native_bf16(F&& f) {
    if (std::is_same_v<T, c10::BFloat16> && native_bf16_dot())
        f(std::true_type{});
    else
        f(std::false_type{});
}
// f(std::integral_constant<int, n>{}) for a run-time 1 <= n <= Most: a tile's rows or vectors as
// the template argument its registers are sized by (bf16_linear's and int_linear's edge tiles).
template <int Most, typename F>
void up_to(int64_t n, const F& f) {
    if constexpr (Most > 1)
        if (n < Most)
            return up_to<Most - 1>(n, f);
    f(std::integral_constant<int, Most>{});
}
// bf16_amx.cpp: the same product on AMX tiles; false (and nothing written) where they cannot run:
// no AMX, the OS refused the tile state, configure() disallowed it, or k not a multiple of 32.
bool bf16_linear_amx(const c10::BFloat16* x, const c10::BFloat16* packed, int64_t vectors, const float* bias,
                     c10::BFloat16* y, int64_t rows, int64_t k, int64_t n);
// bf16_amx.cpp: whether AMX tiles serve bfloat16 projections in this process.
bool amx_active();

// int_linear.cpp: integer codes with float16 scales (see there for the layouts).
struct IntWeights {
    const uint8_t* codes;   // int8 [vectors][k / 2][32], or 4-bit pairs [vectors][k / 8][64]
    int bits;               // 8 or 4
    const uint64_t* high;   // 4-bit codes' bits 4 and 5: [vectors][k / 8][high_bits][2] byte masks, or nullptr
    int high_bits;          // 0, 1 (5-bit codes) or 2 (6-bit)
    const at::Half* d;      // [vectors / 4][groups][4][16]
    const at::Half* z;      // like d, or nullptr
    const int8_t* sub;      // GGUF's K-quant blocks: integer scales [vectors / 4][k / 32 * halves][4][16], or nullptr
    const int8_t* mins;     // like sub, or nullptr
    int halves;             // sub's entries per 32 inputs: 1 or 2
    const float* bias;      // [n] or nullptr
    int64_t vectors, groups, super, n;  // super: blocks of 32 per d (and z) entry where sub is given, else 1
    bool e2m1;              // 4-bit codes of E2M1 values (MXFP4), not counts from zero
};
// The weights of a packed IntLinear's tensors (undefined where it has none), checked against k and n.
IntWeights int_weights(const at::Tensor& codes, const at::Tensor& high, const at::Tensor& d, const at::Tensor& z,
                       const at::Tensor& sub, const at::Tensor& mins, const at::Tensor& bias, int64_t k, int64_t n);
// Row n of the weights [k] in float32, as quant.IntWeight.dequantize gives it.
void int_weight_row(const IntWeights& w, int64_t n, int64_t k, float* row);
// y [rows][n] (rows y_stride apart) = x [rows][k] @ W.T (+ bias).
void int_linear(const c10::BFloat16* x, int64_t rows, int64_t k, const IntWeights& w, c10::BFloat16* y,
                int64_t y_stride);

// elementwise.cpp, instantiated for float and c10::BFloat16.
// RMSNorm of `rows` rows of x (`stride` apart) into contiguous out.
template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t width, int64_t stride, float eps);
// h [rows][width] += y (rounded once, as eager adds), then its RMSNorm into out: one pass where the
// residual add and the next norm each took one.
template <typename T>
void add_rms_norm_rows(T* h, const T* y, const T* weight, T* out, int64_t rows, int64_t width, float eps);
// Rotary embedding of x [rows][heads][dim] (rows `row_stride` apart) into contiguous out, cos/sin [rows][dim].
template <typename T>
void rotary_rows(const T* x, int64_t row_stride, const float* cos, const float* sin, T* out, int64_t rows,
                 int64_t heads, int64_t dim);
// silu(gate) * up of x [rows][gate | up] into out [rows][width].
template <typename T>
void silu_mul_rows(const T* x, T* out, int64_t rows, int64_t width);
// gelu(gate) * up, GELU's tanh approximation (Gemma's GeGLU), likewise.
template <typename T>
void gelu_tanh_mul_rows(const T* x, T* out, int64_t rows, int64_t width);

// gpt-oss's gate: (clamp(up, -limit, limit) + 1) * (g * sigmoid(alpha g)) with g = min(gate, limit),
// each step rounded to the dtype as the reference's eager ops round it.
template <typename T>
void swiglu_oai_mul_rows(const T* x, T* out, int64_t rows, int64_t width, float alpha, float limit);

// experts.cpp: a mixture of experts' choice for each row of router logits [rows][experts]: the
// top_k experts (largest first, a tie to the lower expert) into chosen [rows][top_k], their
// weights into weights [rows][top_k] as llama.MoE.route computes them: the softmax over every
// expert in float32, then its top k (renormalised to sum 1 with `normalize`), rounded to T unless
// `float32_weights`; or (`topk_first`, gpt-oss) the softmax of the top k logits alone, rounded to T.
struct Routing {
    int64_t experts, top_k;
    bool topk_first, normalize, float32_weights;
};
template <typename T>
void route_rows(const T* logits, int64_t rows, const Routing& routing, float* weights, int64_t* chosen);

// token_mask.cpp: logits[rows[k]] (rows `row_stride` apart, `vocab` wide) set to -inf where bit i of
// mask k is 0; mask k is `bits_stride` 16-bit words from bits + k * bits_stride, little-endian.
void mask_token_rows(float* logits, int64_t row_stride, int64_t vocab, const uint16_t* bits, int64_t bits_stride,
                     const int64_t* rows, int64_t count);

// paged_attention.cpp
template <typename T>
struct PagedAttention {
    const T* q;  // [rows][heads][dim], rows q_stride apart
    int64_t q_stride;
    const T* k;  // [page rows][kv heads][dim], rows slot_stride apart and heads head_stride apart
    const T* v;  // the same strides
    T* out;      // [rows][heads][dim]
    const int32_t* tables;  // block b of sequence s at tables[s * table_seq_stride + b * table_block_stride]
    int64_t table_seq_stride, table_block_stride, block_size;
    int64_t heads, kv_heads, dim;
    float scale;
    int64_t slot_stride, head_stride;
    int64_t window = 0;    // a row sees only its last `window` positions (sliding-window layers); 0: all
    float softcap = 0.0f;  // scores pass through softcap * tanh(score / softcap) (Gemma 2); 0: as they are
    const T* sinks = nullptr;  // [heads]: a logit each head's softmax takes in, with no value (gpt-oss)
};

// Per query row: its sequence (-1: in none) and the last position it sees.
struct QueryRows {
    std::vector<int64_t> seq, last;
};

// From query_start_loc [num_seqs + 1] and seq_lens [num_seqs]; fails on inconsistent metadata.
QueryRows query_rows(const int32_t* query_start_loc, const int32_t* seq_lens, int64_t num_seqs, int64_t rows);

// Causal attention of every query row (over its last p.window positions where set); rows in no
// sequence are written as zeros.
template <typename T>
void paged_attention(const PagedAttention<T>& p, const QueryRows& rows);

}  // namespace tailrace
