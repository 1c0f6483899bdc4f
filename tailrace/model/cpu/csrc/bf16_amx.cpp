// bf16_linear on Intel AMX tiles, where the CPU has them: the same packed weights, every row's bits
// still independent of its batch.
//
// The packed weights [NV][K/2][32] are already AMX's VNNI layout: 16 consecutive pairs of one
// vector are a 16 x 64-byte B tile. Each step multiplies A tiles of 16 rows x 32 inputs by B tiles
// into float32 C tiles (TDPBF16PS), 2 x 2 C tiles per step, the inputs in blocks of 32 from 0 to K:
// an output's accumulator always sees the same blocks in the same order, and a C tile row depends
// on its A row alone, so neither the batch nor the threads' split of the vectors changes a bit. The
// bits differ from the AVX512-BF16 kernel's (another instruction), so a process uses one or the
// other for every call (`bf16_linear_amx` decides once).
//
// Measured on a 2-core Xeon with AMX, the SmolLM2-135M shape's projections plus its head, 2 threads:
// 1.18 ms at 1 row (AVX512-BF16 1.15, oneDNN 1.43), 1.70 ms at 32 rows (10.85, 2.14), 2.05 ms at
// 128 rows (14.5, 2.40).

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "vec.h"

#ifdef __AMX_TILE__

namespace {

using tailrace::kLanes;
using tailrace::lanes;

constexpr int64_t kTileRows = 16;
constexpr int64_t kBlock = 32;  // inputs per tile step: 16 pairs

struct TileConfig {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
};

// Tiles 0-3: C (row tile a, vector b at 2a + b); 4, 5: A; 6, 7: B. All 16 rows of 64 bytes.
void configure_tiles() {
    TileConfig config;
    for (int t = 0; t < 8; ++t) {
        config.rows[t] = kTileRows;
        config.bytes_per_row[t] = 64;
    }
    _tile_loadconfig(&config);
}

bool cpu_has_amx_bf16() {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx))
        return false;
    return (edx & (1u << 24)) && (edx & (1u << 22));  // AMX-TILE, AMX-BF16
}

// Linux hands out the tile state only on request (ARCH_REQ_XCOMP_PERM for XTILEDATA).
bool amx_usable() {
    if (!tailrace::amx_allowed())
        return false;
    static const bool usable = cpu_has_amx_bf16() && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return usable;
}

struct Problem {
    const uint16_t* x;  // [MP][K], rows past M zero
    const uint16_t* w;  // [NV][K/2][32]
    const float* bias;  // [NV * 16] or nullptr
    uint16_t* y;        // [M][N]
    int64_t M, K, N, NV;
};

// C tiles for rows m0.. (MA tiles of 16) and vectors v0.. (NB), stored into out [MA * 16][NB * 16].
template <int MA, int NB>
void tile_step(const Problem& p, int64_t m0, int64_t v0, float* out) {
    _tile_zero(0);
    if constexpr (NB > 1) _tile_zero(1);
    if constexpr (MA > 1) _tile_zero(2);
    if constexpr (MA > 1 && NB > 1) _tile_zero(3);
    const int64_t row_bytes = p.K * 2;
    const uint16_t* a = p.x + m0 * p.K;
    const uint16_t* b0 = p.w + v0 * (p.K / 2) * 2 * kLanes;
    const uint16_t* b1 = b0 + (p.K / 2) * 2 * kLanes;
    for (int64_t k = 0; k < p.K; k += kBlock) {
        _tile_loadd(4, a + k, row_bytes);
        if constexpr (MA > 1) _tile_loadd(5, a + kTileRows * p.K + k, row_bytes);
        _tile_loadd(6, b0 + k * kLanes, 64);
        if constexpr (NB > 1) _tile_loadd(7, b1 + k * kLanes, 64);
        _tile_dpbf16ps(0, 4, 6);
        if constexpr (NB > 1) _tile_dpbf16ps(1, 4, 7);
        if constexpr (MA > 1) _tile_dpbf16ps(2, 5, 6);
        if constexpr (MA > 1 && NB > 1) _tile_dpbf16ps(3, 5, 7);
    }
    const int64_t stride = NB * kLanes * sizeof(float);
    _tile_stored(0, out, stride);
    if constexpr (NB > 1) _tile_stored(1, out + kLanes, stride);
    if constexpr (MA > 1) _tile_stored(2, out + kTileRows * NB * kLanes, stride);
    if constexpr (MA > 1 && NB > 1) _tile_stored(3, out + kTileRows * NB * kLanes + kLanes, stride);
}

// Bias, then round to bfloat16 (nearest even, as the AVX512 kernel) for the step's real rows.
void store_rows(const Problem& p, int64_t m0, int64_t rows, int64_t v0, int64_t nb, const float* out) {
    for (int64_t j = 0; j < nb; ++j) {
        const int64_t n0 = (v0 + j) * kLanes;
        const __mmask16 mask = lanes(p.N - n0);
        const __m512 bias = p.bias ? _mm512_loadu_ps(p.bias + n0) : _mm512_setzero_ps();
        for (int64_t i = 0; i < rows; ++i) {
            const __m512 acc = _mm512_loadu_ps(out + (i * nb + j) * kLanes);
            _mm256_mask_storeu_epi16(p.y + (m0 + i) * p.N + n0, mask,
                                     tailrace::to_bf16_bits<true>(_mm512_add_ps(acc, bias)));
        }
    }
}

void run_pairs(const Problem& p, int64_t g0, int64_t g1) {
    configure_tiles();
    alignas(64) float out[2 * kTileRows * 2 * kLanes];
    for (int64_t g = g0; g < g1; ++g) {
        const int64_t v0 = 2 * g, nb = std::min<int64_t>(2, p.NV - v0);
        for (int64_t m0 = 0; m0 < p.M; m0 += 2 * kTileRows) {
            const int64_t rows = std::min<int64_t>(2 * kTileRows, p.M - m0);
            if (rows > kTileRows)
                nb == 2 ? tile_step<2, 2>(p, m0, v0, out) : tile_step<2, 1>(p, m0, v0, out);
            else
                nb == 2 ? tile_step<1, 2>(p, m0, v0, out) : tile_step<1, 1>(p, m0, v0, out);
            store_rows(p, m0, rows, v0, nb, out);
        }
    }
    _tile_release();
}

}  // namespace

namespace tailrace {

bool bf16_linear_amx(const c10::BFloat16* x, const c10::BFloat16* packed, int64_t vectors, const float* bias,
                     c10::BFloat16* y, int64_t rows, int64_t k, int64_t n) {
    if (k % kBlock != 0 || !amx_usable())
        return false;
    // A tiles read 16 rows at a time: the rows padded with zeros to a whole tile.
    const int64_t padded_rows = (rows + kTileRows - 1) / kTileRows * kTileRows;
    std::vector<uint16_t> padded;
    const uint16_t* a = reinterpret_cast<const uint16_t*>(x);
    if (padded_rows != rows) {
        padded.assign(padded_rows * k, 0);
        std::memcpy(padded.data(), x, rows * k * sizeof(uint16_t));
        a = padded.data();
    }
    const Problem p{a, reinterpret_cast<const uint16_t*>(packed), bias, reinterpret_cast<uint16_t*>(y), rows, k, n,
                    vectors};
    at::parallel_for(0, (vectors + 1) / 2, 1, [&](int64_t g0, int64_t g1) { run_pairs(p, g0, g1); });
    return true;
}

bool amx_active() { return amx_usable(); }

}  // namespace tailrace

#else  // the x86-64-v3 build: no AMX CPU lacks AVX-512, so the AVX-512 build serves every one

namespace tailrace {

bool bf16_linear_amx(const c10::BFloat16*, const c10::BFloat16*, int64_t, const float*, c10::BFloat16*, int64_t,
                     int64_t, int64_t) {
    return false;
}

bool amx_active() { return false; }

}  // namespace tailrace

#endif
