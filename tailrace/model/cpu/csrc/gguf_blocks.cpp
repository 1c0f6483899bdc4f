// GGUF's 4- to 6-bit blocks decoded straight into int_linear's layout (int_linear.cpp's "Layouts"),
// one pass over the file's bytes: what model/loading/gguf_quant.py's decoders and IntLinear's
// packing give, without their dozen passes over every weight in numpy and torch (12 of the 15 s a
// Llama-3.2-1B Q4_K_M took to load). Each output row's blocks go to its lane of its vector, so the
// vectors are independent and split over the threads.
//
// Per block the fields are those of gguf_quant.IntWeight's form: codes (unsigned, 4 + planes bits),
// a float16 scale d and zero z per 32 inputs (legacy blocks) or per super-block of 256 (K-quants,
// z the negated dmin), and a K-quant's integer scales and mins per 32 or 16 inputs.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kVectors = 4;  // int_linear's tile of vectors: tables and vectors in whole tiles

// ggml's type numbers (gguf.GGMLQuantizationType).
enum Type : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

struct Format {
    int64_t inputs, bytes, planes, subs;  // inputs and bytes a block; high bit planes; integer scales a block (0: none)
    bool zeros, mins;
};

Format format(int64_t type) {
    switch (type) {
        case Q4_0: return {32, 18, 0, 0, true, false};
        case Q4_1: return {32, 20, 0, 0, true, false};
        case Q5_0: return {32, 22, 1, 0, true, false};
        case Q5_1: return {32, 24, 1, 0, true, false};
        case Q2_K: return {256, 84, 0, 16, true, true};
        case Q3_K: return {256, 110, 0, 16, false, false};
        case Q4_K: return {256, 144, 0, 8, true, true};
        case Q5_K: return {256, 176, 1, 8, true, true};
        case Q6_K: return {256, 210, 2, 16, false, false};
        default: TORCH_CHECK(false, "no packing of GGUF type ", type, " here");
    }
}

// One block as IntWeight's fields: q (codes), d and z (float16 bits), sub and mins.
struct Block {
    uint8_t q[256];
    uint16_t d, z;
    int8_t sub[16], mins[16];
};

inline uint16_t half_bits(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return h;
}
inline uint16_t half_of(float value) { return c10::Half(value).x; }
inline float float_of(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

// Q4_0's and Q4_1's nibbles: code j < 16 in byte j's low nibble, j + 16 in its high one.
inline void low_nibbles_of_16(const uint8_t* qs, uint8_t* q) {
    for (int j = 0; j < 16; ++j) {
        q[j] = qs[j] & 0x0F;
        q[j + 16] = qs[j] >> 4;
    }
}

// Q4_K's and Q5_K's 6-bit scales and mins of 8 sub-blocks (ggml's get_scale_min_k4).
inline void k4_scales(const uint8_t* s, int8_t* sc, int8_t* mn) {
    for (int j = 0; j < 4; ++j) {
        sc[j] = static_cast<int8_t>(s[j] & 0x3F);
        mn[j] = static_cast<int8_t>(s[j + 4] & 0x3F);
        sc[j + 4] = static_cast<int8_t>((s[j + 8] & 0x0F) | ((s[j] >> 6) << 4));
        mn[j + 4] = static_cast<int8_t>((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

// Q4_K's and Q5_K's nibbles: each run of 32 bytes holds sub-blocks 2c (low nibbles) and 2c + 1.
inline void k4_nibbles(const uint8_t* qs, uint8_t* q) {
    for (int c = 0; c < 4; ++c)
        for (int j = 0; j < 32; ++j) {
            q[64 * c + j] = qs[32 * c + j] & 0x0F;
            q[64 * c + 32 + j] = qs[32 * c + j] >> 4;
        }
}

void decode(int64_t type, const uint8_t* b, Block& out) {
    switch (type) {
        case Q4_0:
            out.d = half_bits(b);
            out.z = half_of(-8 * float_of(out.d));
            low_nibbles_of_16(b + 2, out.q);
            break;
        case Q4_1:
            out.d = half_bits(b);
            out.z = half_bits(b + 2);
            low_nibbles_of_16(b + 4, out.q);
            break;
        case Q5_0:
        case Q5_1: {
            const bool q5_1 = type == Q5_1;
            out.d = half_bits(b);
            out.z = q5_1 ? half_bits(b + 2) : half_of(-16 * float_of(out.d));
            uint32_t high;
            std::memcpy(&high, b + (q5_1 ? 4 : 2), 4);
            low_nibbles_of_16(b + (q5_1 ? 8 : 6), out.q);
            for (int j = 0; j < 32; ++j)
                out.q[j] |= ((high >> j) & 1) << 4;
            break;
        }
        case Q2_K:  // scales (low nibble) and mins (high) of 16 sub-blocks, 64 bytes of 2-bit codes, d, dmin
            for (int j = 0; j < 16; ++j) {
                out.sub[j] = static_cast<int8_t>(b[j] & 0x0F);
                out.mins[j] = static_cast<int8_t>(b[j] >> 4);
            }
            for (int n = 0; n < 2; ++n)
                for (int s = 0; s < 4; ++s)
                    for (int j = 0; j < 32; ++j)
                        out.q[128 * n + 32 * s + j] = (b[16 + 32 * n + j] >> (2 * s)) & 3;
            out.d = half_bits(b + 80);
            out.z = half_bits(b + 82) ^ 0x8000;
            break;
        case Q3_K:  // high bits, 2-bit codes, 12 bytes of 6-bit scales less 32, d; codes kept as q + 8
            for (int n = 0; n < 2; ++n)
                for (int s = 0; s < 4; ++s)
                    for (int j = 0; j < 32; ++j) {
                        const int at = 128 * n + 32 * s + j;
                        const int high = (b[j] >> (at / 32)) & 1;
                        out.q[at] = static_cast<uint8_t>(((b[32 + 32 * n + j] >> (2 * s)) & 3) + 4 * high + 4);
                    }
            for (int j = 0; j < 16; ++j) {
                const int low = (b[96 + j % 8] >> (4 * (j / 8))) & 0x0F;
                const int high = (b[104 + j % 4] >> (2 * (j / 4))) & 3;
                out.sub[j] = static_cast<int8_t>((low | (high << 4)) - 32);
            }
            out.d = half_bits(b + 108);
            break;
        case Q4_K:
        case Q5_K:
            out.d = half_bits(b);
            out.z = half_bits(b + 2) ^ 0x8000;
            k4_scales(b + 4, out.sub, out.mins);
            k4_nibbles(b + (type == Q4_K ? 16 : 48), out.q);
            if (type == Q5_K)
                for (int i = 0; i < 8; ++i)
                    for (int j = 0; j < 32; ++j)
                        out.q[32 * i + j] |= ((b[16 + j] >> i) & 1) << 4;
            break;
        case Q6_K:  // 128 bytes of low nibbles, 64 of 2-bit high pairs, 16 int8 scales, d
            for (int n = 0; n < 2; ++n) {
                for (int h = 0; h < 2; ++h)
                    for (int j = 0; j < 64; ++j)
                        out.q[128 * n + 64 * h + j] = (b[64 * n + j] >> (4 * h)) & 0x0F;
                for (int s = 0; s < 4; ++s)
                    for (int j = 0; j < 32; ++j)
                        out.q[128 * n + 32 * s + j] |= ((b[128 + 32 * n + j] >> (2 * s)) & 3) << 4;
            }
            std::memcpy(out.sub, b + 192, 16);
            out.d = half_bits(b + 208);
            break;
    }
}

// Index of output n's entry g of a [NV / 4][G][4][16] table (pack_scales' layout).
inline int64_t table_at(int64_t groups, int64_t n, int64_t g) {
    const int64_t v = n / kLanes;
    return (((v / kVectors) * groups + g) * kVectors + v % kVectors) * kLanes + n % kLanes;
}

// raw [N, row bytes] uint8 -> [codes, high, scales, zeros, sub, mins] as IntLinear holds them
// (undefined where the type has none): int_linear's packed layout, vectors in whole tiles.
std::vector<torch::Tensor> pack_gguf(const torch::Tensor& raw, int64_t type, int64_t K) {
    const Format f = format(type);
    TORCH_CHECK(raw.scalar_type() == torch::kByte && raw.dim() == 2 && raw.is_contiguous(), "raw must be uint8 [N, bytes]");
    TORCH_CHECK(K % f.inputs == 0 && raw.size(1) == K / f.inputs * f.bytes, "rows of ", raw.size(1),
                " bytes are not ", K, " inputs of GGUF type ", type);
    const int64_t N = raw.size(0), NV = (N + kLanes * kVectors - 1) / (kLanes * kVectors) * kVectors;
    const int64_t blocks = K / f.inputs, runs = K / 8, groups = f.subs ? blocks : K / 32;
    const int64_t subs = f.subs ? K / (f.inputs / f.subs) : 0;
    auto u8 = torch::TensorOptions().dtype(torch::kByte), half = torch::TensorOptions().dtype(torch::kHalf);
    torch::Tensor codes = torch::zeros({NV, runs, 4 * kLanes}, u8);
    torch::Tensor high = f.planes ? torch::zeros({NV, runs, f.planes, 2}, torch::kInt64) : torch::Tensor();
    torch::Tensor scales = torch::zeros({NV / kVectors, groups, kVectors, kLanes}, half);
    torch::Tensor zeros = f.zeros ? torch::zeros_like(scales) : torch::Tensor();
    torch::Tensor sub = f.subs ? torch::zeros({NV / kVectors, subs, kVectors, kLanes}, torch::kChar) : torch::Tensor();
    torch::Tensor mins = f.mins ? torch::zeros_like(sub) : torch::Tensor();
    uint8_t* c = codes.data_ptr<uint8_t>();
    auto* h = f.planes ? reinterpret_cast<uint64_t*>(high.data_ptr<int64_t>()) : nullptr;
    auto* d = reinterpret_cast<uint16_t*>(scales.data_ptr<at::Half>());
    auto* z = f.zeros ? reinterpret_cast<uint16_t*>(zeros.data_ptr<at::Half>()) : nullptr;
    int8_t* a = f.subs ? sub.data_ptr<int8_t>() : nullptr;
    int8_t* m = f.mins ? mins.data_ptr<int8_t>() : nullptr;
    const uint8_t* in = raw.data_ptr<uint8_t>();
    // A vector's 16 rows a block at a time: each run of 8 inputs' 64 code bytes (and high-bit words)
    // written once, whole.
    at::parallel_for(0, (N + kLanes - 1) / kLanes, 1, [&](int64_t v0, int64_t v1) {
        std::vector<Block> lanes(kLanes);
        for (int64_t v = v0; v < v1; ++v) {
            const int64_t used = std::min(kLanes, N - v * kLanes);
            for (int64_t b = 0; b < blocks; ++b) {
                for (int64_t l = 0; l < kLanes; ++l) {
                    Block& block = lanes[l];
                    if (l >= used) {  // a padding row: codes 0, its tables left 0
                        std::memset(block.q, 0, sizeof(block.q));
                        continue;
                    }
                    const int64_t n = v * kLanes + l;
                    decode(type, in + n * raw.size(1) + b * f.bytes, block);
                    d[table_at(groups, n, b)] = block.d;
                    if (z)
                        z[table_at(groups, n, b)] = block.z;
                    for (int64_t s = 0; s < f.subs; ++s) {
                        a[table_at(subs, n, b * f.subs + s)] = block.sub[s];
                        if (m)
                            m[table_at(subs, n, b * f.subs + s)] = block.mins[s];
                    }
                }
                for (int64_t i = 0; i < f.inputs; i += 8) {
                    const int64_t r = (b * f.inputs + i) / 8;
                    uint8_t* run = c + (v * runs + r) * 4 * kLanes;
                    for (int64_t l = 0; l < kLanes; ++l)
                        for (int64_t j = 0; j < 4; ++j)
                            run[4 * l + j] = (lanes[l].q[i + j] & 0x0F) | ((lanes[l].q[i + 4 + j] & 0x0F) << 4);
                    for (int64_t q = 0; q < f.planes; ++q)
                        for (int64_t half = 0; half < 2; ++half) {
                            uint64_t word = 0;
                            for (int64_t l = 0; l < kLanes; ++l)
                                for (int64_t j = 0; j < 4; ++j)
                                    word |= static_cast<uint64_t>((lanes[l].q[i + 4 * half + j] >> (4 + q)) & 1)
                                            << (4 * l + j);
                            h[((v * runs + r) * f.planes + q) * 2 + half] = word;
                        }
                }
            }
        }
    });
    return {codes, high, scales, zeros, sub, mins};
}

}  // namespace

void register_gguf_blocks(pybind11::module& m) {
    m.def("pack_gguf", &pack_gguf, "GGUF blocks of a 4- to 6-bit type, rows [N, bytes] -> int_linear's packed "
                                   "[codes, high, scales, zeros, sub, mins]");
}
