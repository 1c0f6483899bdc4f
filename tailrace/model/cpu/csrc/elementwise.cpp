// The elementwise steps of a decoder layer as one call each, for bfloat16 and float32 rows on the
// CPU: RMSNorm, rotary embedding and SiLU(gate) * up. In eager PyTorch they take about 20 small
// ops a layer (dtype casts, reductions, a roll), and at one decode row each op's dispatch costs
// more than its arithmetic. Each keeps the reference implementation's rounding points (what is
// rounded to the model's dtype, and when), and every row is computed alone, in a fixed order.
// With AVX512-BF16 a bfloat16 result is rounded by one instruction instead of eight (vec.h): on
// SmolLM2's 138-row shapes SiLU took 0.90x its time, the norm 0.74x, rotary 0.83x (eighteenth
// session).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "kernels.h"
#include "vec.h"

namespace {

using tailrace::exp16;
using tailrace::kLanes;
using tailrace::lanes;
using tailrace::load16;
using tailrace::rounded;
using tailrace::store16;
using tailrace::with_native_bf16;

// Rows of this many elements or more go to the thread pool one at a time; fewer share a task.
constexpr int64_t kGrainElements = 1 << 14;

int64_t grain(int64_t width) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(width, 1)); }

}  // namespace

namespace tailrace {

// RMSNorm of each row of x into out; with `add`, of x + add (widened to float32, summed, rounded
// once, as eager adds), the sums written to `sums` ([rows][width]).
template <typename T>
void norm_rows(const T* x, const T* add, T* sums, const T* weight, T* out, int64_t rows, int64_t width,
               int64_t stride, float eps) {
    with_native_bf16<T>([&](auto native) {
        constexpr bool N = decltype(native)::value;
        at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
            for (int64_t r = begin; r < end; ++r) {
                const T* row = x + r * stride;
                __m512 squares = _mm512_setzero_ps();
                for (int64_t i = 0; i < width; i += kLanes) {
                    const __mmask16 m = lanes(width - i);
                    __m512 v = load16(row + i, m);
                    if (add != nullptr) {
                        v = rounded<N>(_mm512_add_ps(v, load16(add + r * width + i, m)), row);
                        store16<N>(sums + r * width + i, v, m);
                    }
                    squares = _mm512_fmadd_ps(v, v, squares);
                }
                if (add != nullptr)
                    row = sums + r * width;
                const float scale = 1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / width + eps);
                const __m512 s = _mm512_set1_ps(scale);
                for (int64_t i = 0; i < width; i += kLanes) {
                    const __mmask16 m = lanes(width - i);
                    // reference: weight * (x.float() * scale).to(dtype), the product rounded again
                    const __m512 normed = rounded<N>(_mm512_mul_ps(load16(row + i, m), s), row);
                    store16<N>(out + r * width + i, _mm512_mul_ps(load16(weight + i, m), normed), m);
                }
            }
        });
    });
}

template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t width, int64_t stride, float eps) {
    norm_rows<T>(x, nullptr, nullptr, weight, out, rows, width, stride, eps);
}

template <typename T>
void add_rms_norm_rows(T* h, const T* y, const T* weight, T* out, int64_t rows, int64_t width, float eps) {
    norm_rows<T>(h, y, h, weight, out, rows, width, width, eps);
}

// The "rotate_half" convention with the sign in the sin table: out = x * cos + roll(x, D/2) * sin,
// in float32, rounded once. x [T, H, D] (rows any stride, heads contiguous), cos/sin [T, 1, D].
template <typename T>
void rotary_rows(const T* x, int64_t row_stride, const float* cos, const float* sin, T* out, int64_t rows,
                 int64_t heads, int64_t dim) {
    const int64_t half = dim / 2;
    with_native_bf16<T>([&](auto native) {
        constexpr bool N = decltype(native)::value;
        at::parallel_for(0, rows, grain(heads * dim), [&](int64_t begin, int64_t end) {
            for (int64_t r = begin; r < end; ++r) {
                const float* c = cos + r * dim;
                const float* s = sin + r * dim;
                for (int64_t h = 0; h < heads; ++h) {
                    const T* in = x + r * row_stride + h * dim;
                    T* o = out + (r * heads + h) * dim;
                    for (int64_t i = 0; i < dim; i += kLanes) {
                        // the rolled partner of element i is i + D/2 (mod D); with D a multiple of 32 a
                        // 16-lane run never crosses D/2 and never runs past D
                        const int64_t j = i < half ? i + half : i - half;
                        const __m512 a = _mm512_mul_ps(load16(in + i), load16(c + i));
                        const __m512 b = _mm512_mul_ps(load16(in + j), load16(s + i));
                        store16<N>(o + i, _mm512_add_ps(a, b));
                    }
                }
            }
        });
    });
}

// f(gate, up, round) over x = [gate | up] per row, 16 lanes at a time (float32), stored rounded to
// the dtype; round(v) rounds to it where the reference's eager ops round between steps.
template <typename T, typename F>
void gate_rows(const T* x, T* out, int64_t rows, int64_t width, F f) {
    with_native_bf16<T>([&](auto native) {
        constexpr bool N = decltype(native)::value;
        const auto round = [](__m512 v) { return rounded<N>(v, static_cast<const T*>(nullptr)); };
        at::parallel_for(0, rows, grain(2 * width), [&](int64_t begin, int64_t end) {
            for (int64_t r = begin; r < end; ++r) {
                const T* gate = x + r * 2 * width;
                const T* up = gate + width;
                for (int64_t i = 0; i < width; i += kLanes) {
                    const __mmask16 m = lanes(width - i);
                    store16<N>(out + r * width + i, f(load16(gate + i, m), load16(up + i, m), round), m);
                }
            }
        });
    });
}

// act(gate) * up, the reference's rounding: the activation's result rounded to the dtype, then the
// product rounded. act: 16 gate values (float32) to theirs.
template <typename T, typename Act>
void act_mul_rows(const T* x, T* out, int64_t rows, int64_t width, Act act) {
    gate_rows(x, out, rows, width, [&](__m512 g, __m512 u, auto round) { return _mm512_mul_ps(round(act(g)), u); });
}

// g / (1 + e^-g)
template <typename T>
void silu_mul_rows(const T* x, T* out, int64_t rows, int64_t width) {
    act_mul_rows(x, out, rows, width, [](__m512 g) {
        return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    });
}

// 0.5 g (1 + tanh(u)) with u = sqrt(2 / pi) (g + 0.044715 g^3), computed as g / (1 + e^-2u)
template <typename T>
void gelu_tanh_mul_rows(const T* x, T* out, int64_t rows, int64_t width) {
    act_mul_rows(x, out, rows, width, [](__m512 g) {
        const __m512 inner = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), g), _mm512_mul_ps(g, g), g);
        const __m512 minus_2u = _mm512_mul_ps(_mm512_set1_ps(-1.5957691216057308f), inner);
        return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(minus_2u)));
    });
}

// The reference's ops in order, each rounded: a = alpha g, s = sigmoid(a) = 1 / (1 + e^-a), g s,
// u + 1, then the product. min(limit, g) keeps a NaN gate a NaN, as clamp does.
template <typename T>
void swiglu_oai_mul_rows(const T* x, T* out, int64_t rows, int64_t width, float alpha, float limit) {
    const __m512 a = _mm512_set1_ps(alpha), high = _mm512_set1_ps(limit), low = _mm512_set1_ps(-limit);
    const __m512 one = _mm512_set1_ps(1.0f);
    gate_rows(x, out, rows, width, [&](__m512 gate, __m512 up, auto round) {
        const __m512 g = _mm512_min_ps(high, gate), u = _mm512_max_ps(low, _mm512_min_ps(high, up));
        const __m512 scaled = round(_mm512_mul_ps(g, a));
        const __m512 sigmoid = round(_mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), scaled)))));
        return _mm512_mul_ps(round(_mm512_add_ps(u, one)), round(_mm512_mul_ps(g, sigmoid)));
    });
}

// out = x * sigmoid(gate), the sigmoid rounded to the dtype, then the product: x [rows][width] and
// gate rows `stride`s apart, a gate of one value per row (`broadcast`) taken for its whole row.
template <typename T>
void sigmoid_mul_rows(const T* x, int64_t x_stride, const T* gate, int64_t gate_stride, bool broadcast, T* out,
                      int64_t rows, int64_t width) {
    const __m512 one = _mm512_set1_ps(1.0f);
    with_native_bf16<T>([&](auto native) {
        constexpr bool N = decltype(native)::value;
        at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
            for (int64_t r = begin; r < end; ++r) {
                const T* g = gate + r * gate_stride;
                for (int64_t i = 0; i < width; i += kLanes) {
                    const __mmask16 m = lanes(width - i);
                    const __m512 a = broadcast ? _mm512_set1_ps(static_cast<float>(g[0])) : load16(g + i, m);
                    const __m512 sigmoid = rounded<N>(
                        _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), a)))), x);
                    store16<N>(out + r * width + i, _mm512_mul_ps(load16(x + r * x_stride + i, m), sigmoid), m);
                }
            }
        });
    });
}

// decoder.cpp calls them from its own translation unit, at either dtype.
#define TAILRACE_ELEMENTWISE(T)                                                                              \
    template void rms_norm_rows(const T*, const T*, T*, int64_t, int64_t, int64_t, float);                   \
    template void rotary_rows(const T*, int64_t, const float*, const float*, T*, int64_t, int64_t, int64_t); \
    template void silu_mul_rows(const T*, T*, int64_t, int64_t);                                            \
    template void gelu_tanh_mul_rows(const T*, T*, int64_t, int64_t);                                       \
    template void swiglu_oai_mul_rows(const T*, T*, int64_t, int64_t, float, float);                        \
    template void sigmoid_mul_rows(const T*, int64_t, const T*, int64_t, bool, T*, int64_t, int64_t);       \
    template void add_rms_norm_rows(T*, const T*, const T*, T*, int64_t, int64_t, float);
TAILRACE_ELEMENTWISE(c10::BFloat16)
TAILRACE_ELEMENTWISE(float)
#undef TAILRACE_ELEMENTWISE

}  // namespace tailrace

namespace {

// x [..., D] (rows may be strided), weight [D] -> [..., D] contiguous.
torch::Tensor rms_norm(const torch::Tensor& x_any, const torch::Tensor& weight, double eps) {
    const int64_t width = x_any.size(-1);
    TORCH_CHECK(weight.numel() == width && weight.scalar_type() == x_any.scalar_type() && weight.is_contiguous(),
                "weight must be [D] in x's dtype");
    const torch::Tensor x = x_any.stride(-1) == 1 && x_any.dim() == 2 ? x_any : x_any.reshape({-1, width}).contiguous();
    torch::Tensor out = torch::empty(x_any.sizes(), x_any.options());
    tailrace::with_element_type(x.scalar_type(), "rms_norm", [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        tailrace::rms_norm_rows(x.data_ptr<T>(), weight.data_ptr<T>(), out.data_ptr<T>(), x.size(0), width,
                                x.stride(0), static_cast<float>(eps));
    });
    return out;
}

torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
    TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "x must be [T, H, D] with each row's heads contiguous");
    const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2);
    TORCH_CHECK(dim % 32 == 0, "rotary needs head_dim a multiple of 32");
    TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.numel() == rows * dim &&
                sin.numel() == rows * dim, "cos and sin must be float32 [T, 1, D]");
    const torch::Tensor c = cos.contiguous(), s = sin.contiguous();
    torch::Tensor out = torch::empty({rows, heads, dim}, x.options());
    tailrace::with_element_type(x.scalar_type(), "rotary", [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        tailrace::rotary_rows(x.data_ptr<T>(), x.stride(0), c.data_ptr<float>(), s.data_ptr<float>(),
                              out.data_ptr<T>(), rows, heads, dim);
    });
    return out;
}

// x [T, W] * sigmoid(gate [T, W] or [T, 1]) -> [T, W], rows of either any stride
torch::Tensor sigmoid_mul(const torch::Tensor& x_any, const torch::Tensor& gate_any) {
    const torch::Tensor x = x_any.stride(-1) == 1 ? x_any : x_any.contiguous();
    const torch::Tensor gate = gate_any.stride(-1) == 1 ? gate_any : gate_any.contiguous();
    TORCH_CHECK(x.dim() == 2 && gate.dim() == 2 && gate.size(0) == x.size(0) &&
                (gate.size(1) == x.size(1) || gate.size(1) == 1) && gate.scalar_type() == x.scalar_type(),
                "x must be [T, W] and gate [T, W] or [T, 1], one dtype");
    torch::Tensor out = torch::empty(x.sizes(), x.options());
    tailrace::with_element_type(x.scalar_type(), "sigmoid_mul", [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        tailrace::sigmoid_mul_rows(x.data_ptr<T>(), x.stride(0), gate.data_ptr<T>(), gate.stride(0),
                                   gate.size(1) == 1 && x.size(1) != 1, out.data_ptr<T>(), x.size(0), x.size(1));
    });
    return out;
}

// act(gate) * up over x [..., gate | up] -> [..., I]; rows(x, out, rows, I) runs it at x's dtype
template <typename Rows>
torch::Tensor act_mul(const torch::Tensor& x_any, Rows&& run) {
    const int64_t width = x_any.size(-1) / 2;
    TORCH_CHECK(x_any.size(-1) % 2 == 0, "x must be [..., 2 * I]: gate then up");
    const torch::Tensor x = x_any.contiguous();
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = width;
    torch::Tensor out = torch::empty(shape, x.options());
    const int64_t rows = width ? x.numel() / (2 * width) : 0;
    tailrace::with_element_type(x.scalar_type(), "act_mul", [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        run(x.data_ptr<T>(), out.data_ptr<T>(), rows, width);
    });
    return out;
}

}  // namespace

void register_elementwise(pybind11::module& m) {
    m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension, the reference's rounding (bfloat16 or float32)");
    m.def("rotary", &rotary, "rotary embedding, rotate_half convention, sin table signed (bfloat16 or float32)");
    m.def("silu_mul", [](const torch::Tensor& x) {
        return act_mul(x, [](auto* in, auto* out, int64_t rows, int64_t width) { tailrace::silu_mul_rows(in, out, rows, width); });
    }, "silu(gate) * up over [gate | up] (bfloat16 or float32)");
    m.def("gelu_tanh_mul", [](const torch::Tensor& x) {
        return act_mul(x, [](auto* in, auto* out, int64_t rows, int64_t width) {
            tailrace::gelu_tanh_mul_rows(in, out, rows, width);
        });
    }, "gelu(gate, approximate='tanh') * up over [gate | up] (bfloat16 or float32)");
    m.def("sigmoid_mul", &sigmoid_mul, "x * sigmoid(gate), gate [T, W] or one per row [T, 1], the reference's rounding "
          "(bfloat16 or float32)");
    m.def("swiglu_oai_mul", [](const torch::Tensor& x, double alpha, double limit) {
        return act_mul(x, [&](auto* in, auto* out, int64_t rows, int64_t width) {
            tailrace::swiglu_oai_mul_rows(in, out, rows, width, static_cast<float>(alpha), static_cast<float>(limit));
        });
    }, "gpt-oss's (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit), over [gate | up]",
          pybind11::arg("x"), pybind11::arg("alpha"), pybind11::arg("limit"));
}
