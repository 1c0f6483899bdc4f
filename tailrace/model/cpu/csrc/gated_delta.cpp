// Gated DeltaNet's sequence operations over a step's flat batch (attention/gated_delta.py holds
// the reference and the arithmetic): the causal depthwise convolution with SiLU, and the gated
// delta rule in its recurrent form, each sequence continuing the state its slot holds. Every
// sequence is computed alone, token after token, in a fixed order of operations, so a token's
// result does not depend on its batch, how its prompt was split into steps, or the threads.

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "vec.h"

namespace {

using tailrace::exp16;
using tailrace::kLanes;
using tailrace::lanes;
using tailrace::load16;
using tailrace::rounded;
using tailrace::store16;

// Channels a thread's unit of the convolution covers, and the widest convolution taken.
constexpr int64_t kConvChannels = 256;
constexpr int64_t kMaxKernel = 8;

// x [T][C] -> out [T][C]: out[t] = SiLU(round(sum_j w[:, j] * window[t + j])), the window being the
// slot's kernel - 1 stored inputs then the sequence's rows; the products summed in float32 from the
// oldest input, each product and sum rounded apart (the reference's eager ops). The slot's state
// becomes the window's last kernel - 1 rows; where captures[b] > 0, rows captures[b].. (the inputs
// before that boundary) are copied to state row capture_slots[b].
template <typename T>
void causal_conv_silu(const T* x, const T* weight, T* states, const int64_t* starts, const int64_t* slots,
                      const int64_t* captures, const int64_t* capture_slots, int64_t seqs, int64_t channels,
                      int64_t kernel, T* out) {
    const int64_t kept = kernel - 1, blocks = (channels + kConvChannels - 1) / kConvChannels;
    // the taps kernel-major in float32, so that 16 channels' tap j are one load
    std::vector<float> taps(kernel * channels);
    for (int64_t c = 0; c < channels; ++c)
        for (int64_t j = 0; j < kernel; ++j)
            taps[j * channels + c] = static_cast<float>(weight[c * kernel + j]);
    tailrace::parallel_chunks(seqs * blocks, 1, [&](int64_t unit, int64_t) {
        const int64_t b = unit / blocks, c0 = unit % blocks * kConvChannels;
        const int64_t c1 = std::min(channels, c0 + kConvChannels);
        const int64_t first = starts[b], n = starts[b + 1] - first;
        T* state = states + slots[b] * kept * channels;
        // window row r: a stored input for r < kept, else the sequence's row r - kept
        const auto row = [&](int64_t r) { return r < kept ? state + r * channels : x + (first + r - kept) * channels; };
        for (int64_t c = c0; c < c1; c += kLanes) {
            const __mmask16 m = lanes(c1 - c);
            __m512 w[kMaxKernel];
            for (int64_t j = 0; j < kernel; ++j)
                w[j] = load16(taps.data() + j * channels + c, m);
            for (int64_t t = 0; t < n; ++t) {
                __m512 acc = _mm512_mul_ps(load16(row(t) + c, m), w[0]);
                for (int64_t j = 1; j < kernel; ++j)
                    acc = _mm512_add_ps(acc, _mm512_mul_ps(load16(row(t + j) + c, m), w[j]));
                acc = rounded(acc, x);
                const __m512 silu = _mm512_div_ps(acc, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                                     exp16(_mm512_sub_ps(_mm512_setzero_ps(), acc))));
                store16(out + (first + t) * channels + c, silu, m);
            }
            if (captures[b] > 0) {
                T* snapshot = states + capture_slots[b] * kept * channels;
                for (int64_t r = 0; r < kept; ++r)
                    store16(snapshot + r * channels + c, load16(row(captures[b] + r) + c, m), m);
            }
            // the new state: the window's last `kept` rows, read before any is overwritten
            __m512 last[kMaxKernel];
            for (int64_t r = 0; r < kept; ++r)
                last[r] = load16(row(n + r) + c, m);
            for (int64_t r = 0; r < kept; ++r)
                store16(state + r * channels + c, last[r], m);
        }
    });
}

// The value head's decay and write strength for one token, in float32 scalars (the same for a
// value wherever it sits in a batch): exp(g), g = A * softplus(a + dt_bias) with the head's decay
// rate A = -exp(A_log), softplus as torch's (x past 20 kept as it is); beta = sigmoid(b), rounded
// to the dtype as the reference's is.
template <typename T>
void gates(T a, T b, float rate, T dt_bias, float& decay, float& beta) {
    const float x = static_cast<float>(a) + static_cast<float>(dt_bias);
    const float softplus = x > 20.0f ? x : std::log1p(std::exp(x));
    decay = std::exp(rate * softplus);
    beta = static_cast<float>(static_cast<T>(1.0f / (1.0f + std::exp(-static_cast<float>(b)))));
}

// One value head's state s [key][value] over one sequence's rows (see gated_delta.py), in two
// passes over s a token: the first reads s^T k and s^T q, the second writes s = decay s + k delta^T,
// with delta = (v - decay s^T k) beta and out = decay s^T q + delta (k . q), which is
// (decay s + k delta^T)^T q. q and k are l2-normed in float32 (q also by key ** -0.5); q, k rows
// are the head's group's, qk_stride apart, a and b the head's, ab_stride apart. After `captured`
// tokens (0: none) s is copied to `snapshot`. V: vectors of 16 a value row (value <= 16 V), so
// that the sums stay in registers; Whole: value == 16 V, no lanes masked.
template <typename T, int V, bool Whole>
void delta_head(const T* q, const T* k, const T* v, int64_t qk_stride, int64_t v_stride, const T* a, const T* b,
                int64_t ab_stride, float rate, T dt_bias, int64_t n, int64_t key, int64_t value, float* s, float* out,
                int64_t out_stride, int64_t captured, float* snapshot) {
    std::vector<float> qn(key), kn(key);
    __mmask16 mask[V];
    for (int j = 0; j < V; ++j)
        mask[j] = lanes(value - j * kLanes);
    const auto load = [&](const auto* p, int j) {
        return Whole ? load16(p + j * kLanes) : load16(p + j * kLanes, mask[j]);
    };
    const auto store = [&](float* p, int j, __m512 x) {
        if constexpr (Whole)
            tailrace::store16(p + j * kLanes, x);
        else
            tailrace::store16(p + j * kLanes, x, mask[j]);
    };
    const float scale = 1.0f / std::sqrt(static_cast<float>(key));
    for (int64_t t = 0; t < n; ++t) {
        const T* qt = q + t * qk_stride;
        const T* kt = k + t * qk_stride;
        float qq = 0.0f, kk = 0.0f;
        for (int64_t i = 0; i < key; ++i) {
            qn[i] = static_cast<float>(qt[i]);
            kn[i] = static_cast<float>(kt[i]);
            qq += qn[i] * qn[i];
            kk += kn[i] * kn[i];
        }
        const float q_inv = 1.0f / std::sqrt(qq + 1e-6f), k_inv = 1.0f / std::sqrt(kk + 1e-6f);
        float kq = 0.0f;
        for (int64_t i = 0; i < key; ++i) {
            qn[i] = qn[i] * q_inv * scale;
            kn[i] = kn[i] * k_inv;
            kq += kn[i] * qn[i];
        }
        float decay_t, beta_t;
        gates(a[t * ab_stride], b[t * ab_stride], rate, dt_bias, decay_t, beta_t);
        const __m512 decay = _mm512_set1_ps(decay_t), beta = _mm512_set1_ps(beta_t);
        __m512 sk[V], sq[V];
        for (int j = 0; j < V; ++j)
            sk[j] = sq[j] = _mm512_setzero_ps();
        for (int64_t i = 0; i < key; ++i) {
            const float* row = s + i * value;
            const __m512 ki = _mm512_set1_ps(kn[i]), qi = _mm512_set1_ps(qn[i]);
            for (int j = 0; j < V; ++j) {
                const __m512 x = load(row, j);
                sk[j] = _mm512_fmadd_ps(x, ki, sk[j]);
                sq[j] = _mm512_fmadd_ps(x, qi, sq[j]);
            }
        }
        const T* vt = v + t * v_stride;
        float* o = out + t * out_stride;
        __m512 delta[V];
        for (int j = 0; j < V; ++j) {
            delta[j] = _mm512_mul_ps(_mm512_sub_ps(load(vt, j), _mm512_mul_ps(sk[j], decay)), beta);
            store(o, j, _mm512_fmadd_ps(delta[j], _mm512_set1_ps(kq), _mm512_mul_ps(sq[j], decay)));
        }
        for (int64_t i = 0; i < key; ++i) {
            float* row = s + i * value;
            const __m512 ki = _mm512_set1_ps(kn[i]);
            for (int j = 0; j < V; ++j)
                store(row, j, _mm512_fmadd_ps(ki, delta[j], _mm512_mul_ps(load(row, j), decay)));
        }
        if (t + 1 == captured)
            std::copy(s, s + key * value, snapshot);
    }
}

// Each row [width] of x (float32, rounded to the dtype first) RMS-normed, times weight, times
// SiLU(z) in float32, rounded once: llama.GatedRMSNorm's rounding points. z rows z_stride apart.
// One thread's: the caller shares the rows out.
template <typename T>
void gated_norm_rows(const float* x, const T* z, int64_t z_stride, const T* weight, float eps, T* out, int64_t rows,
                     int64_t width) {
    for (int64_t r = 0; r < rows; ++r) {
        const float* row = x + r * width;
        __m512 squares = _mm512_setzero_ps();
        for (int64_t i = 0; i < width; i += kLanes) {
            const __mmask16 m = lanes(width - i);
            const __m512 v = rounded(load16(row + i, m), out);
            squares = _mm512_fmadd_ps(v, v, squares);
        }
        const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / width + eps));
        for (int64_t i = 0; i < width; i += kLanes) {
            const __mmask16 m = lanes(width - i);
            const __m512 normed = rounded(_mm512_mul_ps(rounded(load16(row + i, m), out), scale), out);
            const __m512 weighted = rounded(_mm512_mul_ps(load16(weight + i, m), normed), out);
            const __m512 g = load16(z + r * z_stride + i, m);
            const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                               exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
            store16(out + r * width + i, _mm512_mul_ps(weighted, silu), m);
        }
    }
}

// delta_head with V the fewest vectors that hold `value` (at most 16: 256 values a row).
template <typename T, typename... Args>
void run_delta_head(int64_t value, Args... args) {
    TORCH_CHECK(value <= 16 * kLanes, "delta_rule takes value heads of at most 256");
    tailrace::up_to<16>((value + kLanes - 1) / kLanes, [&](auto vectors) {
        if (value % kLanes == 0)
            delta_head<T, vectors(), true>(args...);
        else
            delta_head<T, vectors(), false>(args...);
    });
}

void check_step(const torch::Tensor& starts, const torch::Tensor& slots, const torch::Tensor& captures,
                const torch::Tensor& capture_slots) {
    for (const torch::Tensor* t : {&starts, &slots, &captures, &capture_slots})
        TORCH_CHECK(t->scalar_type() == torch::kInt64 && t->is_contiguous(), "the step's tensors must be int64");
    TORCH_CHECK(starts.numel() == slots.numel() + 1 && captures.numel() == slots.numel() &&
                capture_slots.numel() == slots.numel(), "starts [B + 1], slots, captures and capture_slots [B]");
}

// x [T, C] (rows contiguous), weight [C, kernel], states [slots, kernel - 1, C], all one dtype.
torch::Tensor causal_conv(const torch::Tensor& x_any, const torch::Tensor& weight, const torch::Tensor& states,
                          const torch::Tensor& starts, const torch::Tensor& slots, const torch::Tensor& captures,
                          const torch::Tensor& capture_slots) {
    check_step(starts, slots, captures, capture_slots);
    const torch::Tensor x = x_any.contiguous();
    const int64_t channels = x.size(1), kernel = weight.size(1);
    TORCH_CHECK(kernel >= 2 && kernel <= kMaxKernel, "causal_conv takes kernels of 2 to ", kMaxKernel, " taps");
    TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.size(0) == channels && weight.is_contiguous() &&
                weight.scalar_type() == x.scalar_type(), "weight must be [C, kernel] in x's dtype");
    TORCH_CHECK(states.dim() == 3 && states.size(1) == kernel - 1 && states.size(2) == channels &&
                states.is_contiguous() && states.scalar_type() == x.scalar_type(),
                "states must be [slots, kernel - 1, C] in x's dtype");
    torch::Tensor out = torch::empty_like(x);
    tailrace::with_element_type(x.scalar_type(), "causal_conv", [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        causal_conv_silu<T>(x.data_ptr<T>(), weight.data_ptr<T>(), states.data_ptr<T>(), starts.data_ptr<int64_t>(),
                            slots.data_ptr<int64_t>(), captures.data_ptr<int64_t>(), capture_slots.data_ptr<int64_t>(),
                            slots.numel(), channels, kernel, out.data_ptr<T>());
    });
    return out;
}

// q, k [T, key_heads, key] and v [T, value_heads, value] (views with contiguous heads), a and b
// [T, value_heads] (rows any stride), the decay rates A [value_heads] float32, dt_bias
// [value_heads]; value head h reads q/k head h % key_heads where `tiled`, else h / (value_heads /
// key_heads); states [slots, value_heads, key, value] float32 -> out [T, value_heads, value] float32.
torch::Tensor delta_rule(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& a,
                         const torch::Tensor& b, const torch::Tensor& rate_any, const torch::Tensor& dt_bias_any,
                         bool tiled, const torch::Tensor& states, const torch::Tensor& starts,
                         const torch::Tensor& slots, const torch::Tensor& captures,
                         const torch::Tensor& capture_slots) {
    check_step(starts, slots, captures, capture_slots);
    const int64_t rows = q.size(0), key_heads = q.size(1), key = q.size(2), value_heads = v.size(1), value = v.size(2);
    TORCH_CHECK(q.sizes() == k.sizes() && q.strides() == k.strides() && q.stride(2) == 1 && q.stride(1) == key &&
                v.stride(2) == 1 && v.stride(1) == value && v.size(0) == rows && value_heads % key_heads == 0 &&
                q.scalar_type() == v.scalar_type() && k.scalar_type() == v.scalar_type(),
                "q, k [T, key_heads, key] and v [T, value_heads, value] with contiguous heads, one dtype");
    TORCH_CHECK(a.dim() == 2 && a.sizes() == b.sizes() && a.size(0) == rows && a.size(1) == value_heads &&
                a.stride(1) == 1 && b.stride(1) == 1 && a.stride(0) == b.stride(0) &&
                a.scalar_type() == v.scalar_type() && b.scalar_type() == v.scalar_type(),
                "a and b must be [T, value_heads] in v's dtype, one layout");
    const torch::Tensor rate = rate_any.to(torch::kFloat32).contiguous();
    const torch::Tensor dt_bias = dt_bias_any.to(v.scalar_type()).contiguous();
    TORCH_CHECK(rate.numel() == value_heads && dt_bias.numel() == value_heads, "A and dt_bias must be [value_heads]");
    TORCH_CHECK(states.scalar_type() == torch::kFloat32 && states.is_contiguous() && states.dim() == 4 &&
                states.size(1) == value_heads && states.size(2) == key && states.size(3) == value,
                "states must be float32 [slots, value_heads, key, value]");
    torch::Tensor out = torch::empty({rows, value_heads, value}, v.options().dtype(torch::kFloat32));
    const int64_t* start = starts.data_ptr<int64_t>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    const int64_t* captured = captures.data_ptr<int64_t>();
    const int64_t* capture_slot = capture_slots.data_ptr<int64_t>();
    const int64_t seqs = slots.numel(), groups = value_heads / key_heads;
    tailrace::with_element_type(v.scalar_type(), "delta_rule", [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        tailrace::parallel_chunks(seqs * value_heads, 1, [&](int64_t unit, int64_t) {
            const int64_t b_ = unit / value_heads, h = unit % value_heads, first = start[b_];
            const int64_t qk_head = tiled ? h % key_heads : h / groups;
            const int64_t qk_offset = first * q.stride(0) + qk_head * key, ab_offset = first * a.stride(0) + h;
            run_delta_head<T>(value, q.data_ptr<T>() + qk_offset, k.data_ptr<T>() + qk_offset,
                          v.data_ptr<T>() + first * v.stride(0) + h * value, q.stride(0), v.stride(0),
                          a.data_ptr<T>() + ab_offset, b.data_ptr<T>() + ab_offset, a.stride(0),
                          rate.data_ptr<float>()[h], dt_bias.data_ptr<T>()[h], start[b_ + 1] - first, key, value,
                          states.data_ptr<float>() + (slot[b_] * value_heads + h) * key * value,
                          out.data_ptr<float>() + (first * value_heads + h) * value, value_heads * value, captured[b_],
                          states.data_ptr<float>() + (capture_slot[b_] * value_heads + h) * key * value);
        });
    });
    return out;
}

// x [T, H, D] float32, z [T, H, D] (rows any stride, heads contiguous), weight [D] -> [T, H * D]
// in z's dtype.
torch::Tensor gated_norm(const torch::Tensor& x_any, const torch::Tensor& z, const torch::Tensor& weight, double eps) {
    const torch::Tensor x = x_any.contiguous();
    const int64_t rows = x.size(0), heads = x.size(1), width = x.size(2);
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 3 && z.sizes() == x.sizes() && z.stride(2) == 1 &&
                z.stride(1) == width && weight.numel() == width && weight.is_contiguous() &&
                weight.scalar_type() == z.scalar_type(),
                "x float32 [T, H, D], z [T, H, D] with contiguous heads, weight [D]");
    torch::Tensor out = torch::empty({rows, heads * width}, z.options());
    tailrace::with_element_type(z.scalar_type(), "gated_norm", [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        // a row of x per (token, head); z's heads of a token are contiguous, its tokens z.stride(0) apart
        tailrace::parallel_chunks(rows, 1, [&](int64_t t, int64_t) {
            gated_norm_rows<T>(x.data_ptr<float>() + t * heads * width, z.data_ptr<T>() + t * z.stride(0), width,
                               weight.data_ptr<T>(), static_cast<float>(eps), out.data_ptr<T>() + t * heads * width,
                               heads, width);
        });
    });
    return out;
}

}  // namespace

void register_gated_delta(pybind11::module& m) {
    m.def("causal_conv", &causal_conv, "Gated DeltaNet's causal depthwise convolution and SiLU, per sequence, "
          "advancing each slot's stored inputs (bfloat16 or float32)");
    m.def("delta_rule", &delta_rule, "the gated delta rule, recurrent form, per sequence and value head, its "
          "gates from a, b, A and dt_bias, advancing each slot's float32 state");
    m.def("gated_norm", &gated_norm, "Gated DeltaNet's output norm: RMSNorm of each head's row times SiLU(z)");
}
