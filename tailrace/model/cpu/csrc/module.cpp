// tailrace's CPU kernels as one extension module (one compile), built by tailrace/model/cpu_kernels.py.

#include <torch/extension.h>

void register_bf16_linear(pybind11::module& m);
void register_paged_attention(pybind11::module& m);
void register_elementwise(pybind11::module& m);
void register_decoder(pybind11::module& m);
void register_int_linear(pybind11::module& m);
void register_token_mask(pybind11::module& m);
void register_greedy(pybind11::module& m);
void register_experts(pybind11::module& m);
void register_gguf_blocks(pybind11::module& m);
void register_gated_delta(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    register_bf16_linear(m);
    register_paged_attention(m);
    register_elementwise(m);
    register_decoder(m);
    register_int_linear(m);
    register_token_mask(m);
    register_greedy(m);
    register_experts(m);
    register_gguf_blocks(m);
    register_gated_delta(m);
}
