// A bfloat16 or float32 decoder forward in one call from Python: token ids to the final norm's
// rows, for every architecture llama.py runs. Each layer runs the steps layer_plan.py makes for
// it, the ones llama.DecoderLayer runs (where the norms go, the residual's multiplier), so the
// order of a layer is written there once; the blocks read the same features (per-layer rotary
// tables or none, sliding windows, GeGLU and gpt-oss's gate, q/k norms per head or over all heads,
// the embedding's multiplier, the scores' soft cap, attention sinks, biases, and mixtures of
// experts).
//
// The per-module path makes about ten calls a layer (norm, projections, rotary, two K/V stores,
// attention, activation, residual adds), each through a Python module and PyTorch's dispatcher.
// Here the same kernel functions (kernels.h) run on the same inputs in the same order with the
// same rounding points, so every output has the bits the per-module path gives it, in any batch;
// only the calls are gone, and each residual add runs in the pass of the norm after it. A batch-1
// decode step of SmolLM2-135M's 30 layers took 14.7 ms module by module and 11.6 ms this way on
// an Intel Xeon with AMX (`bench/decode_step.py --ab-fused` runs both in one process). The embedding
// lookup, the rotary tables' rows and the final norm run here too: after the weights have streamed
// through the caches, each op's dispatch from Python runs cold, 50-70 us apiece.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace {

using BF16 = c10::BFloat16;
using tailrace::kLanes;

// A projection as its kernel holds it: weights packed for bf16_linear / f32_linear, or integer codes
// for int_linear (Bf16Linear's, Float32Linear's or IntLinear's buffers; IntLinearParts' parts,
// each giving its outputs side by side).
struct Projection {
    torch::Tensor packed;  // the model's dtype, [vectors, K / 2, 32], or undefined
    std::vector<tailrace::IntWeights> parts;
    std::vector<torch::Tensor> keep;  // the IntLinears' buffers `parts` point into
    torch::Tensor bias;    // float32, padded to whole vectors, or undefined
};

// layer_plan.OPS, in its order
enum class Op { kRead, kAttention, kFeedForward, kNormOutput, kScale, kAdd };

struct LayerStep {
    Op op;
    torch::Tensor norm;  // [hidden], read's (or undefined: x is h) and norm_output's
    float factor;        // scale's
};

struct Layer {
    std::vector<LayerStep> steps;
    torch::Tensor q_norm, k_norm;  // [head_dim] a head, or [heads * head_dim] over all of q's (k's) heads
                                   // (OLMo 2), or undefined
    torch::Tensor sinks;  // [heads] in the dtype (gpt-oss), or undefined
    Projection qkv, o, gate_up, down;  // gate_up, down: a dense layer's MLP
    Projection router;                 // a mixture of experts' (undefined `packed` in a dense layer)
    std::vector<Projection> expert_gate_up, expert_down;
    int64_t rope;    // the rotary table rotating q/k (0: global, 1: local), -1 for none
    int64_t window;  // the positions a query sees back from itself, 0 for all
};

enum class Act { kSilu, kGeluTanh, kSwigluOai };

Act act_named(const std::string& name) {
    if (name == "silu")
        return Act::kSilu;
    if (name == "gelu_tanh")
        return Act::kGeluTanh;
    TORCH_CHECK(name == "swiglu_oai", "act is silu, gelu_tanh or swiglu_oai, not ", name);
    return Act::kSwigluOai;
}

Op op_named(const std::string& name) {
    static const char* const kNames[] = {"read", "attention", "feed_forward", "norm_output", "scale", "add"};
    for (int i = 0; i < 6; ++i)
        if (name == kNames[i])
            return static_cast<Op>(i);
    TORCH_CHECK(false, "a layer's step is read, attention, feed_forward, norm_output, scale or add, not ", name);
}

using Buffers = std::vector<c10::optional<torch::Tensor>>;
// layer_plan.Step as add_layer takes it: op, norm weight (or None), factor
using StepArgs = std::tuple<std::string, c10::optional<torch::Tensor>, double>;

template <typename Scalar>
Scalar* data(const torch::Tensor& t) { return t.data_ptr<Scalar>(); }

// A forward's model-wide numbers: layer_plan.ForwardPlan's, field for field (FusedForward sets each
// by name, so a field on one side only fails there). act: the MLPs' and experts' gate, "silu",
// "gelu_tanh" (GeGLU) or "swiglu_oai" (gpt-oss's, with swiglu_alpha and swiglu_limit);
// embedding_multiplier: the embedding rows times it, rounded to the dtype first (1: none); scale,
// softcap: the attention's (softcap 0: none); moe_intermediate, experts_per_token and the
// routing's switches (kernels.h Routing): the mixture of experts' layers (0 experts a token: a
// dense model).
struct ForwardSpec {
    int64_t hidden = 0, heads = 0, kv_heads = 0, head_dim = 0, intermediate = 0, vocab = 0;
    double eps = 0, embedding_multiplier = 1, scale = 0, softcap = 0, swiglu_alpha = 0, swiglu_limit = 0;
    std::string act = "silu";
    int64_t moe_intermediate = 0, experts_per_token = 0;
    bool topk_first = false, normalize_topk = false, router_float32 = false;
};

// Scalar: c10::BFloat16 or float, the model's dtype (activations, norms, pages, packed weights).
template <typename Scalar>
class DecoderForward {
    static constexpr c10::ScalarType kType = c10::CppTypeToScalarType<Scalar>::value;
    static constexpr const char* kName = std::is_same_v<Scalar, float> ? "float32" : "bfloat16";

public:
    explicit DecoderForward(const ForwardSpec& s)
        : hidden_(s.hidden), heads_(s.heads), kv_heads_(s.kv_heads), dim_(s.head_dim), intermediate_(s.intermediate),
          moe_intermediate_(s.moe_intermediate), eps_(static_cast<float>(s.eps)), act_(act_named(s.act)),
          embedding_multiplier_(static_cast<float>(static_cast<Scalar>(static_cast<float>(s.embedding_multiplier)))),
          scale_(static_cast<float>(s.scale)), softcap_(static_cast<float>(s.softcap)),
          swiglu_alpha_(static_cast<float>(s.swiglu_alpha)),
          swiglu_limit_(static_cast<float>(s.swiglu_limit)),
          routing_{0, s.experts_per_token, s.topk_first, s.normalize_topk, s.router_float32}, vocab_(s.vocab) {
        TORCH_CHECK(s.hidden > 0 && s.heads > 0 && s.kv_heads > 0, "the spec's hidden, heads and kv_heads must be set");
        TORCH_CHECK(s.head_dim % 32 == 0 && s.head_dim <= 256, "head_dim must be a multiple of 32, at most 256");
        TORCH_CHECK(s.heads % s.kv_heads == 0, "query heads must be a multiple of KV heads");
    }

    // steps: the layer's (layer_plan.layer_steps), each (op, its norm's weight or None, factor). Each
    // projection is [packed, bias] (Bf16Linear) or [codes, scales, zeros, bias] (IntLinear), and
    // q/k norms None where the layer has none. A dense layer has gate_up and down (router and the
    // experts' lists empty); a mixture of experts has its router ([packed, bias]) and each expert's
    // gate_up and down instead (gate_up and down empty).
    void add_layer(const std::vector<StepArgs>& steps, const Buffers& qkv, const c10::optional<torch::Tensor>& q_norm,
                   const c10::optional<torch::Tensor>& k_norm, const Buffers& o, const Buffers& gate_up,
                   const Buffers& down, int64_t rope, int64_t window, const c10::optional<torch::Tensor>& sinks,
                   const Buffers& router, const std::vector<Buffers>& expert_gate_up,
                   const std::vector<Buffers>& expert_down) {
        std::vector<LayerStep> layer_steps;
        int64_t attentions = 0;
        bool read = false;
        for (const auto& [name, norm, factor] : steps) {
            const Op op = op_named(name);
            attentions += op == Op::kAttention;
            read = read || op == Op::kRead;
            TORCH_CHECK(read || (op != Op::kAttention && op != Op::kFeedForward),
                        "a block reads x: a layer's first block comes after a read");
            TORCH_CHECK(op != Op::kNormOutput || norm, "norm_output needs its norm");
            TORCH_CHECK(op == Op::kRead || op == Op::kNormOutput || !norm, "only read and norm_output take a norm");
            if (norm)
                check_norm(*norm, hidden_);
            layer_steps.push_back({op, defined(norm), static_cast<float>(factor)});
        }
        TORCH_CHECK(attentions == 1, "a layer's steps attend once (its K/V are stored there)");
        TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q and k norms come together");
        if (q_norm) {
            const bool over_heads = q_norm->numel() != dim_;
            check_norm(*q_norm, over_heads ? heads_ * dim_ : dim_);
            check_norm(*k_norm, over_heads ? kv_heads_ * dim_ : dim_);
        }
        TORCH_CHECK(!sinks || (sinks->scalar_type() == kType && sinks->is_contiguous() && sinks->numel() == heads_),
                    "sinks must be ", kName, " [", heads_, "]");
        TORCH_CHECK(-1 <= rope && rope <= 1 && window >= 0, "rope is -1, 0 or 1; window at least 0");
        Layer layer{std::move(layer_steps), defined(q_norm), defined(k_norm), defined(sinks),
                    projection(qkv, hidden_, qkv_width()),
                    projection(o, heads_ * dim_, hidden_), {}, {}, {}, {}, {}, rope, window};
        const int64_t experts = static_cast<int64_t>(expert_gate_up.size());
        if (router.empty()) {
            TORCH_CHECK(experts == 0 && expert_down.empty(), "experts come with their router");
            layer.gate_up = projection(gate_up, hidden_, 2 * intermediate_);
            layer.down = projection(down, intermediate_, hidden_);
        } else {
            TORCH_CHECK(gate_up.empty() && down.empty(), "a mixture of experts' layer has no dense MLP");
            TORCH_CHECK(router.size() == 2 && experts == static_cast<int64_t>(expert_down.size()) &&
                        0 < routing_.top_k && routing_.top_k <= experts,
                        "a mixture of experts is a router [packed, bias] and as many gate_up as down, at least "
                        "experts_per_token of them");
            layer.router = projection(router, hidden_, experts);
            for (int64_t e = 0; e < experts; ++e) {
                layer.expert_gate_up.push_back(projection(expert_gate_up[e], hidden_, 2 * moe_intermediate_));
                layer.expert_down.push_back(projection(expert_down[e], moe_intermediate_, hidden_));
            }
        }
        layers_.push_back(std::move(layer));
    }

    // The model's parts around the layers: the token embedding, a [vocab, hidden] table or, packed
    // (a tied head as bf16_linear packs it), [vocab / 16, hidden / 2, 32] with row n at lane n % 16
    // of vector n / 16 in pairs (bfloat16: a pair's values side by side; float32: 16 lanes apart);
    // the rotary tables [positions, head_dim] (float32, as llama.Rotary builds them), the global
    // one's then the local one's (as cos, sin, cos, sin; the same positions); the final norm's weight.
    // With `embedding_codes` (int_linear.IntEmbedding's: [codes, high, scales, zeros, sub, mins] as
    // an IntLinear holds them) the table is integer codes and `embedding` is unused.
    void set_outer(const torch::Tensor& embedding, bool packed, const std::vector<torch::Tensor>& rotary,
                   const torch::Tensor& final_norm, const Buffers& embedding_codes) {
        if (!embedding_codes.empty()) {
            TORCH_CHECK(embedding_codes.size() == 6 && embedding_codes[0] && embedding_codes[2],
                        "embedding codes are [codes, high, scales, zeros, sub, mins]");
            std::vector<torch::Tensor> keep;
            for (const auto& buffer : embedding_codes)
                keep.push_back(defined(buffer));
            embedding_codes_ = tailrace::int_weights(keep[0], keep[1], keep[2], keep[3], keep[4], keep[5],
                                                     torch::Tensor(), hidden_, vocab_);
            embedding_keep_ = keep;
        } else {
            TORCH_CHECK(embedding.scalar_type() == kType && embedding.is_contiguous(),
                        "the embedding must be contiguous ", kName);
            if (packed)
                check_packed(embedding, hidden_, vocab_);
            else
                TORCH_CHECK(embedding.dim() == 2 && embedding.size(0) == vocab_ && embedding.size(1) == hidden_,
                            "the embedding table must be [", vocab_, ", ", hidden_, "]");
        }
        TORCH_CHECK(!rotary.empty() && rotary.size() <= 4 && rotary.size() % 2 == 0, "rotary is cos, sin[, cos, sin]");
        for (const torch::Tensor& table : rotary)
            TORCH_CHECK(table.scalar_type() == torch::kFloat32 && table.is_contiguous() && table.dim() == 2 &&
                        table.size(1) == dim_ && table.size(0) == rotary[0].size(0),
                        "the rotary tables must be contiguous float32 [positions, ", dim_, "]");
        for (const Layer& layer : layers_)
            TORCH_CHECK(2 * layer.rope < static_cast<int64_t>(rotary.size()), "a layer's rotary table is missing");
        check_norm(final_norm, hidden_);
        embedding_ = embedding;
        packed_embedding_ = packed;
        rotary_ = rotary;
        final_norm_ = final_norm;
    }

    // ids, positions [T] int64 -> the final norm's rows [T, hidden], or only those of `wanted` (int64
    // [R], ascending) [R, hidden]: every row's K/V is stored, but the last layer computes the rest
    // (attention, o_proj, the MLP) for the wanted rows alone, as llama.cpp does. k/v pages [layers,
    // slots, kv heads, head_dim], any strides but head_dim's (the CPU cache holds each KV head's rows
    // together: attention.new_pages); slot_mapping [T] int64; the rest as paged_attention takes it.
    torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& positions, const torch::Tensor& k_pages,
                          const torch::Tensor& v_pages, const torch::Tensor& slot_mapping,
                          const torch::Tensor& query_start_loc, const torch::Tensor& seq_lens,
                          const torch::Tensor& block_tables, int64_t block_size, int64_t num_seqs,
                          const c10::optional<torch::Tensor>& wanted) const {
        TORCH_CHECK(embedding_.defined() || !embedding_keep_.empty(), "set_outer must come before forward");
        check_step(ids, positions, k_pages, v_pages, slot_mapping, query_start_loc, seq_lens, block_tables);
        if (wanted)
            check_wanted(*wanted, ids.size(0));
        const int64_t T = ids.size(0), slots = k_pages.size(1);
        const int64_t* slot = slot_mapping.data_ptr<int64_t>();
        for (int64_t t = 0; t < T; ++t)
            TORCH_CHECK(0 <= slot[t] && slot[t] < slots, "slot_mapping holds a slot outside the pages");
        const torch::TensorOptions row_options = k_pages.options();
        auto rows = [&](int64_t width) { return torch::empty({T, width}, row_options); };
        std::vector<torch::Tensor> rotations;  // the rotary tables' rows at the step's positions
        for (size_t i = 0; i < rotary_.size(); ++i)
            rotations.push_back(torch::empty({T, dim_}, rotary_[i].options()));
        torch::Tensor h = rows(hidden_);
        gather(ids, positions, h, rotations);
        const int64_t qk_width = (heads_ + kv_heads_) * dim_;
        Step step{T, rotations, data<Scalar>(k_pages), data<Scalar>(v_pages),
                  k_pages.stride(0), k_pages.stride(1), k_pages.stride(2), slot, block_tables.data_ptr<int32_t>(),
                  block_tables.stride(0), block_tables.stride(1), block_size,
                  tailrace::query_rows(query_start_loc.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), num_seqs, T),
                  h, rows(hidden_), rows(qkv_width()), rows(qk_width), rows(qk_width), rows(heads_ * dim_),
                  rows(hidden_), rows(2 * intermediate_), rows(intermediate_)};
        for (size_t l = 0; l < layers_.size(); ++l) {
            const torch::Tensor* kept = wanted && l + 1 == layers_.size() ? &*wanted : nullptr;
            for (const LayerStep& layer_step : layers_[l].steps)
                run(layer_step, layers_[l], static_cast<int64_t>(l), kept, step);
        }
        torch::Tensor out = torch::empty({step.T, hidden_}, row_options);
        norm(final_norm_, step, data<Scalar>(out));
        return out;
    }

private:
    // One forward's inputs, and its rows between kernels (shared by every layer).
    struct Step {
        int64_t T;
        std::vector<torch::Tensor> rotations;  // cos, sin [T, head_dim] of each rotary table
        Scalar *k_pages, *v_pages;
        int64_t layer_stride, slot_stride, head_stride;  // the pages' (k and v alike)
        const int64_t* slot;  // [T]
        const int32_t* tables;
        int64_t table_seq_stride, table_block_stride, block_size;
        tailrace::QueryRows rows;
        torch::Tensor h, x, qkv, qk, rotated, attended, y, gate_up, act;
        const torch::Tensor* input = nullptr;  // the last read's rows: x, or h itself
        Scalar *k_layer = nullptr, *v_layer = nullptr;  // the pages of the layer project() last stored into
        bool y_pending = false;  // y holds rows an add step has not yet added into h
    };

    // One of layer l's steps (layer_plan.OPS). An add is deferred into the next read's norm (or
    // the final norm), its residual add in the same pass; any step that changes h or y first
    // makes it. wanted: the rows to keep where l is the last layer with wanted rows.
    void run(const LayerStep& step, const Layer& w, int64_t l, const torch::Tensor* wanted, Step& s) const {
        switch (step.op) {
            case Op::kRead:
                if (step.norm.defined()) {
                    norm(step.norm, s, data<Scalar>(s.x));
                    s.input = &s.x;
                } else {
                    add_pending(s);
                    s.input = &s.h;
                }
                return;
            case Op::kAttention:
                add_pending(s);
                project(w, l, *s.input, s);
                if (wanted)
                    keep_rows(s, *wanted);
                return attend(w, s);
            case Op::kFeedForward:
                add_pending(s);
                return feed_forward(w, *s.input, s);
            case Op::kNormOutput: {
                add_pending(s);
                Scalar* y = data<Scalar>(s.y);
                return tailrace::rms_norm_rows(y, data<Scalar>(step.norm), y, s.T, hidden_, hidden_, eps_);
            }
            case Op::kScale: {
                add_pending(s);
                Scalar* y = data<Scalar>(s.y);
                for (int64_t i = 0; i < s.T * hidden_; ++i)  // rounded, as the reference's product
                    y[i] = static_cast<Scalar>(static_cast<float>(y[i]) * step.factor);
                return;
            }
            case Op::kAdd:
                s.y_pending = true;
                return;
        }
    }

    // h += y where an add is pending (rounded once, as eager adds)
    void add_pending(Step& s) const {
        if (!s.y_pending)
            return;
        Scalar* h = data<Scalar>(s.h);
        const Scalar* y = data<Scalar>(s.y);
        for (int64_t i = 0; i < s.T * hidden_; ++i)
            h[i] = static_cast<Scalar>(static_cast<float>(h[i]) + static_cast<float>(y[i]));
        s.y_pending = false;
    }

    // out = the RMSNorm of h's rows, h first taking a pending y (its residual add, in the same pass)
    void norm(const torch::Tensor& weight, Step& s, Scalar* out) const {
        Scalar* h = data<Scalar>(s.h);
        if (s.y_pending)
            tailrace::add_rms_norm_rows(h, data<Scalar>(s.y), data<Scalar>(weight), out, s.T, hidden_, eps_);
        else
            tailrace::rms_norm_rows(h, data<Scalar>(weight), out, s.T, hidden_, hidden_, eps_);
        s.y_pending = false;
    }

    int64_t qkv_width() const { return (heads_ + 2 * kv_heads_) * dim_; }

    // Row t of h: token ids[t]'s embedding (times the multiplier); of each rotation: its table's
    // row at positions[t].
    void gather(const torch::Tensor& ids, const torch::Tensor& positions, torch::Tensor& h,
                std::vector<torch::Tensor>& rotations) const {
        const int64_t* id = ids.data_ptr<int64_t>();
        const int64_t* position = positions.data_ptr<int64_t>();
        const int64_t table_rows = rotary_[0].size(0), pairs = hidden_ / 2;
        for (int64_t t = 0; t < ids.size(0); ++t) {
            TORCH_CHECK(0 <= id[t] && id[t] < vocab_, "token id ", id[t], " is outside the vocabulary of ", vocab_);
            TORCH_CHECK(0 <= position[t] && position[t] < table_rows, "position ", position[t],
                        " is past the rotary tables' ", table_rows);
            Scalar* row = data<Scalar>(h) + t * hidden_;
            const int64_t lane = id[t] % kLanes;
            if (!embedding_keep_.empty()) {
                // the row's weights in float32, rounded once, as dequantizing the table at load rounds them
                std::vector<float> weights(hidden_);
                tailrace::int_weight_row(embedding_codes_, id[t], hidden_, weights.data());
                for (int64_t i = 0; i < hidden_; ++i)
                    row[i] = static_cast<Scalar>(weights[i]);
            } else if (packed_embedding_) {
                if constexpr (std::is_same_v<Scalar, float>) {
                    // lane id % 16 of vector id / 16: pair kp's two values 16 lanes apart
                    const float* vector = data<float>(embedding_) + id[t] / kLanes * pairs * 2 * kLanes;
                    for (int64_t kp = 0; kp < pairs; ++kp) {
                        row[2 * kp] = vector[kp * 2 * kLanes + lane];
                        row[2 * kp + 1] = vector[kp * 2 * kLanes + kLanes + lane];
                    }
                } else {
                    // a pair of bfloat16 at a time: lane id % 16's pair kp of vector id / 16
                    const auto* vector = reinterpret_cast<const uint32_t*>(data<Scalar>(embedding_)) +
                                         id[t] / kLanes * pairs * kLanes;
                    auto* out = reinterpret_cast<uint32_t*>(row);
                    for (int64_t kp = 0; kp < pairs; ++kp)
                        out[kp] = vector[kp * kLanes + lane];
                }
            } else {
                std::memcpy(row, data<Scalar>(embedding_) + id[t] * hidden_, hidden_ * sizeof(Scalar));
            }
            if (embedding_multiplier_ != 1.0f)  // in float32, rounded once, as the reference's product in the dtype
                for (int64_t i = 0; i < hidden_; ++i)
                    row[i] = static_cast<Scalar>(static_cast<float>(row[i]) * embedding_multiplier_);
            for (size_t i = 0; i < rotary_.size(); ++i)
                std::memcpy(data<float>(rotations[i]) + t * dim_, data<float>(rotary_[i]) + position[t] * dim_,
                            dim_ * sizeof(float));
        }
    }

    // rotary(q/k norms(qkv_proj(x))) into s.rotated (without rotary for a layer without one); the
    // step's K/V stored into layer l's pages, head by head
    void project(const Layer& w, int64_t l, const torch::Tensor& x, Step& s) const {
        const int64_t T = s.T, qk_heads = heads_ + kv_heads_;
        linear(w.qkv, x, s.qkv);
        // q and k heads: [T, H + kvH, D] rows qkv_width() apart, or normed into contiguous rows
        const Scalar* qk = data<Scalar>(s.qkv);
        int64_t qk_stride = qkv_width();
        if (w.q_norm.defined()) {
            // per head, or over all of q's and all of k's heads as one row each
            const bool over_heads = w.q_norm.numel() != dim_;
            const int64_t q_rows = over_heads ? 1 : heads_, k_rows = over_heads ? 1 : kv_heads_;
            for (int64_t t = 0; t < T; ++t) {
                Scalar* normed = data<Scalar>(s.qk) + t * qk_heads * dim_;
                const Scalar* row = data<Scalar>(s.qkv) + t * qkv_width();
                tailrace::rms_norm_rows(row, data<Scalar>(w.q_norm), normed, q_rows, heads_ * dim_ / q_rows, dim_, eps_);
                tailrace::rms_norm_rows(row + heads_ * dim_, data<Scalar>(w.k_norm), normed + heads_ * dim_, k_rows,
                                        kv_heads_ * dim_ / k_rows, dim_, eps_);
            }
            qk = data<Scalar>(s.qk);
            qk_stride = qk_heads * dim_;
        }
        if (w.rope >= 0)
            tailrace::rotary_rows(qk, qk_stride, data<float>(s.rotations[2 * w.rope]),
                                  data<float>(s.rotations[2 * w.rope + 1]), data<Scalar>(s.rotated), T, qk_heads, dim_);
        else
            for (int64_t t = 0; t < T; ++t)
                std::memcpy(data<Scalar>(s.rotated) + t * qk_heads * dim_, qk + t * qk_stride,
                            qk_heads * dim_ * sizeof(Scalar));
        Scalar* k_layer = s.k_pages + l * s.layer_stride;
        Scalar* v_layer = s.v_pages + l * s.layer_stride;
        for (int64_t t = 0; t < T; ++t)
            for (int64_t head = 0; head < kv_heads_; ++head) {
                const int64_t at = s.slot[t] * s.slot_stride + head * s.head_stride;
                const Scalar* k = data<Scalar>(s.rotated) + (t * qk_heads + heads_ + head) * dim_;
                const Scalar* v = data<Scalar>(s.qkv) + t * qkv_width() + (qk_heads + head) * dim_;
                std::memcpy(k_layer + at, k, dim_ * sizeof(Scalar));
                std::memcpy(v_layer + at, v, dim_ * sizeof(Scalar));
            }
        s.k_layer = k_layer;
        s.v_layer = v_layer;
    }

    // y = o_proj(attention of s.rotated's queries over the layer's pages), project's layer
    void attend(const Layer& w, Step& s) const {
        const tailrace::PagedAttention<Scalar> problem{
            data<Scalar>(s.rotated), (heads_ + kv_heads_) * dim_, s.k_layer, s.v_layer, data<Scalar>(s.attended), s.tables,
            s.table_seq_stride, s.table_block_stride, s.block_size, heads_, kv_heads_, dim_, scale_, s.slot_stride,
            s.head_stride, w.window, softcap_, w.sinks.defined() ? data<Scalar>(w.sinks) : nullptr};
        tailrace::paged_attention(problem, s.rows);
        linear(w.o, s.attended, s.y);
    }

    // The step narrowed to the `wanted` rows: their residual rows, rotated queries and query rows,
    // and the row buffers' first rows.
    static void keep_rows(Step& s, const torch::Tensor& wanted) {
        const int64_t* row = wanted.data_ptr<int64_t>();
        const int64_t R = wanted.size(0);
        s.h = s.h.index_select(0, wanted);
        s.rotated = s.rotated.index_select(0, wanted);
        tailrace::QueryRows kept{std::vector<int64_t>(R), std::vector<int64_t>(R)};
        for (int64_t r = 0; r < R; ++r) {
            kept.seq[r] = s.rows.seq[row[r]];
            kept.last[r] = s.rows.last[row[r]];
        }
        s.rows = std::move(kept);
        for (torch::Tensor* buffer : {&s.x, &s.attended, &s.y, &s.gate_up, &s.act})
            *buffer = buffer->narrow(0, 0, R);
        s.T = R;
    }

    // y = down_proj(act(gate) * up of gate_up_proj(x)), or the experts' sum
    void feed_forward(const Layer& w, const torch::Tensor& x, Step& s) const {
        if (w.router.packed.defined()) {
            experts(w, x, s);
        } else {
            linear(w.gate_up, x, s.gate_up);
            act_mul(data<Scalar>(s.gate_up), data<Scalar>(s.act), s.T, intermediate_);
            linear(w.down, s.act, s.y);
        }
    }

    // y = the mixture of experts over x's rows, llama.MoE.forward's ops and rounding points: each
    // row's experts and weights by route_rows; each expert run once, on the rows that chose it
    // (ascending), reading only its own weights; its output rows times their weights, each product
    // rounded to the dtype, added into y in expert order, each sum rounded.
    void experts(const Layer& w, const torch::Tensor& x, Step& s) const {
        const int64_t T = s.T, E = static_cast<int64_t>(w.expert_gate_up.size()), k = routing_.top_k;
        const torch::TensorOptions options = x.options();
        torch::Tensor logits = torch::empty({T, E}, options);
        linear(w.router, x, logits);
        std::vector<float> weights(T * k);
        std::vector<int64_t> chosen(T * k);
        tailrace::Routing routing = routing_;
        routing.experts = E;
        tailrace::route_rows(data<Scalar>(logits), T, routing, weights.data(), chosen.data());
        std::vector<std::vector<int64_t>> picks(E);  // row * k + slot, by expert
        for (int64_t i = 0; i < T * k; ++i)
            picks[chosen[i]].push_back(i);
        torch::Tensor in = torch::empty({T, hidden_}, options), gate_up = torch::empty({T, 2 * moe_intermediate_}, options);
        torch::Tensor act = torch::empty({T, moe_intermediate_}, options), out = torch::empty({T, hidden_}, options);
        Scalar* y = data<Scalar>(s.y);
        std::fill_n(y, T * hidden_, Scalar(0));
        for (int64_t e = 0; e < E; ++e) {
            const int64_t n = static_cast<int64_t>(picks[e].size());
            if (n == 0)
                continue;
            for (int64_t j = 0; j < n; ++j)
                std::memcpy(data<Scalar>(in) + j * hidden_, data<Scalar>(x) + picks[e][j] / k * hidden_,
                            hidden_ * sizeof(Scalar));
            torch::Tensor rows = in.narrow(0, 0, n), expert_out = out.narrow(0, 0, n), expert_act = act.narrow(0, 0, n);
            linear(w.expert_gate_up[e], rows, gate_up);
            act_mul(data<Scalar>(gate_up), data<Scalar>(expert_act), n, moe_intermediate_);
            linear(w.expert_down[e], expert_act, expert_out);
            for (int64_t j = 0; j < n; ++j) {
                Scalar* row = y + picks[e][j] / k * hidden_;
                const Scalar* from = data<Scalar>(expert_out) + j * hidden_;
                const float weight = weights[picks[e][j]];
                for (int64_t i = 0; i < hidden_; ++i) {
                    const Scalar weighted = static_cast<Scalar>(static_cast<float>(from[i]) * weight);
                    row[i] = static_cast<Scalar>(static_cast<float>(row[i]) + static_cast<float>(weighted));
                }
            }
        }
    }

    // the model's act(gate) * up of gate_up [rows][gate | up] into out [rows][width]
    void act_mul(const Scalar* gate_up, Scalar* out, int64_t rows, int64_t width) const {
        switch (act_) {
            case Act::kSilu:
                return tailrace::silu_mul_rows(gate_up, out, rows, width);
            case Act::kGeluTanh:
                return tailrace::gelu_tanh_mul_rows(gate_up, out, rows, width);
            case Act::kSwigluOai:
                return tailrace::swiglu_oai_mul_rows(gate_up, out, rows, width, swiglu_alpha_, swiglu_limit_);
        }
    }

    // y [T, n] = x [T, K] through the projection's kernel
    static void linear(const Projection& p, const torch::Tensor& x, torch::Tensor& y) {
        const float* bias = p.bias.defined() ? p.bias.data_ptr<float>() : nullptr;
        if constexpr (std::is_same_v<Scalar, float>)
            tailrace::f32_linear(data<float>(x), data<float>(p.packed), p.packed.size(0), bias, data<float>(y),
                                 x.size(0), x.size(1), y.size(1));
        else if (p.packed.defined())
            tailrace::bf16_linear(data<Scalar>(x), data<Scalar>(p.packed), p.packed.size(0), bias, data<Scalar>(y),
                                  x.size(0), x.size(1), y.size(1));
        else
            for (int64_t i = 0, first = 0; i < static_cast<int64_t>(p.parts.size()); first += p.parts[i++].n)
                tailrace::int_linear(data<Scalar>(x), x.size(0), x.size(1), p.parts[i], data<Scalar>(y) + first,
                                     y.size(1));
    }

    static torch::Tensor defined(const c10::optional<torch::Tensor>& t) { return t.value_or(torch::Tensor()); }

    static Projection projection(const Buffers& buffers, int64_t in, int64_t out) {
        if (buffers.size() == 2) {
            const torch::Tensor packed = defined(buffers[0]), bias = defined(buffers[1]);
            check_packed(packed, in, out);
            TORCH_CHECK(!bias.defined() || (bias.scalar_type() == torch::kFloat32 && bias.is_contiguous() &&
                                            bias.numel() == packed.size(0) * kLanes),
                        "a bias must be float32, padded to whole vectors");
            return {packed, {}, {}, bias};
        }
        TORCH_CHECK((!std::is_same_v<Scalar, float>), "a float32 projection is [packed, bias]");
        TORCH_CHECK(!buffers.empty() && buffers.size() % 7 == 0,
                    "a projection is [packed, bias] or [codes, high, scales, zeros, sub, mins, bias] for each part");
        Projection projection;
        int64_t outputs = 0;
        for (size_t first = 0; first < buffers.size(); first += 7) {
            std::vector<torch::Tensor> part;
            for (size_t i = first; i < first + 7; ++i)
                part.push_back(defined(buffers[i]));
            TORCH_CHECK(part[0].defined() && part[2].defined(), "a part has codes and scales");
            // every part but the last holds whole tiles of rows (IntLinearParts), so its codes say its outputs
            const int64_t n = first + 7 == buffers.size() ? out - outputs : part[0].size(0) * kLanes;
            // int_weights checks the codes against the input width and the part's outputs
            projection.parts.push_back(tailrace::int_weights(part[0], part[1], part[2], part[3], part[4], part[5],
                                                             part[6], in, n));
            outputs += projection.parts.back().n;
            projection.keep.insert(projection.keep.end(), part.begin(), part.end());
        }
        TORCH_CHECK(outputs == out, "the parts give ", outputs, " outputs, not ", out);
        return projection;
    }

    static void check_norm(const torch::Tensor& weight, int64_t width) {
        TORCH_CHECK(weight.scalar_type() == kType && weight.is_contiguous() && weight.numel() == width,
                    "a norm weight must be ", kName, " [", width, "]");
    }

    static void check_packed(const torch::Tensor& packed, int64_t in, int64_t out) {
        TORCH_CHECK(packed.scalar_type() == kType && packed.is_contiguous() && packed.dim() == 3 &&
                    packed.size(0) == (out + kLanes - 1) / kLanes && packed.size(1) == in / 2 &&
                    packed.size(2) == 2 * kLanes, "packed weights must be ", kName, " [", (out + kLanes - 1) / kLanes,
                    ", ", in / 2, ", 32]");
    }

    static void check_wanted(const torch::Tensor& wanted, int64_t T) {
        TORCH_CHECK(wanted.scalar_type() == torch::kInt64 && wanted.dim() == 1 && wanted.is_contiguous(),
                    "wanted must be contiguous int64 [R]");
        const int64_t* row = wanted.data_ptr<int64_t>();
        for (int64_t r = 0; r < wanted.size(0); ++r)
            TORCH_CHECK(0 <= row[r] && row[r] < T && (r == 0 || row[r - 1] < row[r]),
                        "wanted must be ascending rows of the step");
    }

    void check_step(const torch::Tensor& ids, const torch::Tensor& positions, const torch::Tensor& k_pages,
                    const torch::Tensor& v_pages, const torch::Tensor& slot_mapping,
                    const torch::Tensor& query_start_loc, const torch::Tensor& seq_lens,
                    const torch::Tensor& block_tables) const {
        TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.dim() == 1 && ids.is_contiguous(),
                    "ids must be contiguous int64 [T]");
        const int64_t T = ids.size(0);
        TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous() && positions.numel() == T,
                    "positions must be contiguous int64 [T]");
        for (const torch::Tensor* pages : {&k_pages, &v_pages})
            TORCH_CHECK(pages->scalar_type() == kType && pages->dim() == 4 && pages->stride(3) == 1 &&
                        pages->size(0) >= static_cast<int64_t>(layers_.size()) && pages->size(2) == kv_heads_ &&
                        pages->size(3) == dim_ && pages->sizes() == k_pages.sizes() &&
                        pages->strides() == k_pages.strides(),
                        "pages must be ", kName, " [layers, slots, kv heads, head_dim], head_dim contiguous, K and "
                        "V alike");
        TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous() &&
                    slot_mapping.numel() == T, "slot_mapping must be int64 [T]");
        TORCH_CHECK(query_start_loc.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32 &&
                    block_tables.scalar_type() == torch::kInt32, "metadata must be int32");
    }

    int64_t hidden_, heads_, kv_heads_, dim_, intermediate_, moe_intermediate_;
    float eps_;
    Act act_;
    float embedding_multiplier_, scale_, softcap_, swiglu_alpha_, swiglu_limit_;
    tailrace::Routing routing_;  // its `experts` set by each layer
    std::vector<Layer> layers_;
    torch::Tensor embedding_, final_norm_;  // set_outer's
    tailrace::IntWeights embedding_codes_{};
    std::vector<torch::Tensor> embedding_keep_;  // the tensors embedding_codes_ points into, or none
    std::vector<torch::Tensor> rotary_;
    int64_t vocab_ = 0;
    bool packed_embedding_ = false;
};

template <typename Scalar>
void register_forward(pybind11::module& m, const char* name, const char* doc) {
    namespace py = pybind11;
    using Forward = DecoderForward<Scalar>;
    py::class_<Forward>(m, name, doc)
        .def(py::init<const ForwardSpec&>(), py::arg("spec"))
        .def("add_layer", &Forward::add_layer, py::arg("steps"), py::arg("qkv"), py::arg("q_norm"), py::arg("k_norm"),
             py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("rope"), py::arg("window"), py::arg("sinks"),
             py::arg("router"), py::arg("expert_gate_up"), py::arg("expert_down"))
        .def("set_outer", &Forward::set_outer, py::arg("embedding"), py::arg("packed"),
             py::arg("rotary"), py::arg("final_norm"), py::arg("embedding_codes") = Buffers())
        .def("forward", &Forward::forward, py::call_guard<py::gil_scoped_release>(),
             "ids, positions [T] -> the final norm's rows [T, hidden] (or the wanted rows'), the step's K/V stored "
             "into the pages");
}

}  // namespace

void register_decoder(pybind11::module& m) {
    namespace py = pybind11;
    py::class_<ForwardSpec>(m, "ForwardSpec", "a forward's model-wide numbers (layer_plan.ForwardPlan's)")
        .def(py::init<>())
        .def_readwrite("hidden", &ForwardSpec::hidden)
        .def_readwrite("heads", &ForwardSpec::heads)
        .def_readwrite("kv_heads", &ForwardSpec::kv_heads)
        .def_readwrite("head_dim", &ForwardSpec::head_dim)
        .def_readwrite("intermediate", &ForwardSpec::intermediate)
        .def_readwrite("vocab", &ForwardSpec::vocab)
        .def_readwrite("eps", &ForwardSpec::eps)
        .def_readwrite("act", &ForwardSpec::act)
        .def_readwrite("embedding_multiplier", &ForwardSpec::embedding_multiplier)
        .def_readwrite("scale", &ForwardSpec::scale)
        .def_readwrite("softcap", &ForwardSpec::softcap)
        .def_readwrite("swiglu_alpha", &ForwardSpec::swiglu_alpha)
        .def_readwrite("swiglu_limit", &ForwardSpec::swiglu_limit)
        .def_readwrite("moe_intermediate", &ForwardSpec::moe_intermediate)
        .def_readwrite("experts_per_token", &ForwardSpec::experts_per_token)
        .def_readwrite("topk_first", &ForwardSpec::topk_first)
        .def_readwrite("normalize_topk", &ForwardSpec::normalize_topk)
        .def_readwrite("router_float32", &ForwardSpec::router_float32);
    register_forward<c10::BFloat16>(m, "DecoderForward",
                                    "a bfloat16 decoder forward, token ids to the final norm, in one call");
    register_forward<float>(m, "DecoderForwardFloat32",
                            "a float32 decoder forward, token ids to the final norm, in one call");
}
