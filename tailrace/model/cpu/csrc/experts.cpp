// A mixture of experts' routing: each row of router logits to its top_k experts and their weights
// (kernels.h route_rows), for the per-module MoE (llama.MoE.route, through `route_experts`) and the
// whole-forward loop (decoder.cpp) alike, so both take the same experts with the same weights.
// PyTorch's softmax and topk would give the per-module path other bits than the C++ loop could
// reproduce, and a weight's last bit, or a tie, decides a token's experts. Each row is computed
// alone, in a fixed order: the choice never depends on the batch.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace {

// values [n] -> their softmax in float32, in place: max, e^(v - max) summed in order, each divided by the sum.
void softmax(float* values, int64_t n) {
    const float top = *std::max_element(values, values + n);
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
        values[i] = std::exp(values[i] - top);
        sum += values[i];
    }
    for (int64_t i = 0; i < n; ++i)
        values[i] /= sum;
}

template <typename T>
float as_stored(float v) { return static_cast<float>(static_cast<T>(v)); }

}  // namespace

template <typename T>
void tailrace::route_rows(const T* logits, int64_t rows, const Routing& r, float* weights, int64_t* chosen) {
    TORCH_CHECK(0 < r.top_k && r.top_k <= r.experts, "top_k must be between 1 and the number of experts");
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
        std::vector<float> score(r.experts);
        std::vector<int64_t> order(r.experts);
        for (int64_t row = begin; row < end; ++row) {
            const T* logit = logits + row * r.experts;
            for (int64_t e = 0; e < r.experts; ++e)
                score[e] = static_cast<float>(logit[e]);
            if (!r.topk_first)
                softmax(score.data(), r.experts);
            std::iota(order.begin(), order.end(), 0);
            std::partial_sort(order.begin(), order.begin() + r.top_k, order.end(), [&](int64_t a, int64_t b) {
                return score[a] > score[b] || (score[a] == score[b] && a < b);
            });
            float* w = weights + row * r.top_k;
            int64_t* c = chosen + row * r.top_k;
            for (int64_t k = 0; k < r.top_k; ++k) {
                c[k] = order[k];
                w[k] = score[order[k]];
            }
            if (r.topk_first) {
                softmax(w, r.top_k);
            } else if (r.normalize) {
                float sum = 0.0f;
                for (int64_t k = 0; k < r.top_k; ++k)
                    sum += w[k];
                for (int64_t k = 0; k < r.top_k; ++k)
                    w[k] /= sum;
            }
            if (r.topk_first || !r.float32_weights)
                for (int64_t k = 0; k < r.top_k; ++k)
                    w[k] = as_stored<T>(w[k]);
        }
    });
}

template void tailrace::route_rows(const float*, int64_t, const Routing&, float*, int64_t*);
template void tailrace::route_rows(const c10::BFloat16*, int64_t, const Routing&, float*, int64_t*);

namespace {

// logits [T, E] -> (weights [T, k], float32 where the routing keeps them so, else logits' dtype;
// chosen [T, k] int64)
std::tuple<torch::Tensor, torch::Tensor> route_experts(const torch::Tensor& logits_any, int64_t top_k, bool topk_first,
                                                       bool normalize, bool float32_weights) {
    TORCH_CHECK(logits_any.dim() == 2, "logits must be [T, experts]");
    const torch::Tensor logits = logits_any.contiguous();
    const int64_t rows = logits.size(0);
    const tailrace::Routing routing{logits.size(1), top_k, topk_first, normalize, float32_weights};
    torch::Tensor weights = torch::empty({rows, top_k}, logits.options().dtype(torch::kFloat32));
    torch::Tensor chosen = torch::empty({rows, top_k}, logits.options().dtype(torch::kInt64));
    tailrace::with_element_type(logits.scalar_type(), "route_experts", [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        tailrace::route_rows(logits.data_ptr<T>(), rows, routing, weights.data_ptr<float>(), chosen.data_ptr<int64_t>());
    });
    const bool in_float32 = float32_weights && !topk_first;
    return {in_float32 ? weights : weights.to(logits.scalar_type()), chosen};
}

}  // namespace

void register_experts(pybind11::module& m) {
    namespace py = pybind11;
    m.def("route_experts", &route_experts,
          "router logits [T, E] (bfloat16 or float32) -> each row's top_k experts' weights and ids [T, top_k], as "
          "llama.MoE.route computes them",
          py::arg("logits"), py::arg("top_k"), py::arg("topk_first"), py::arg("normalize"), py::arg("float32_weights"));
}
