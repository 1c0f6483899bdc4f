// How the kernels share a loop among the threads. On a shared machine the cores do not run at one
// speed: another process on one core made a static half each a wait for the slower thread (libgomp
// waiting was 9.6% of a 138-token prefill's samples under `perf record`). Here each
// thread takes the next chunk when it is done with its last, so a slowed thread takes fewer. Which
// thread runs a chunk never changes what it computes: every kernel computes each output alone.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace tailrace {

// fn(begin, end) over [0, n) in chunks of `chunk`, taken in order by whichever thread is free.
template <typename F>
void parallel_chunks(int64_t n, int64_t chunk, const F& fn) {
    std::atomic<int64_t> next{0};
    at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), (n + chunk - 1) / chunk), 1, [&](int64_t, int64_t) {
        for (int64_t begin = next.fetch_add(chunk); begin < n; begin = next.fetch_add(chunk))
            fn(begin, std::min(n, begin + chunk));
    });
}

// The projections' split of n output vectors and `rows` rows, fn(v_begin, v_end, m_begin, m_end).
// Below kTakenFrom rows, where a step is one streaming pass over the weights: one even share of the
// vectors a thread, every row. From kTakenFrom rows: groups of `group` vectors (a tile's width),
// every row, taken as above (a 138-token prefill 9-12% faster than static halves; `bench/decode_step.py
// --prefill 138` times it), but the last groups, one a thread, each split into one part of the rows a
// thread, so that the threads finish together: whole groups left SmolLM2's o_proj and down_proj (9
// groups of 4) at 5 groups and 4 on two threads. Only the last groups, because split groups are
// read by every thread (all groups split: 8-64 rows 1.05-1.25x slower), and only where each part
// has kPartTiles tiles of `row_tile` rows (the kernel's rows a tile, where parts begin): at 8 rows
// the split ran 2-3% slower, the step still bound by the weights' reads.
constexpr int64_t kTakenFrom = 8;
constexpr int64_t kPartTiles = 4;

template <typename F>
void parallel_vectors(int64_t n, int64_t group, int64_t rows, int64_t row_tile, const F& fn) {
    const int64_t threads = at::get_num_threads();
    if (rows < kTakenFrom) {
        parallel_chunks(n, (n + threads - 1) / threads, [&](int64_t v0, int64_t v1) { fn(v0, v1, 0, rows); });
        return;
    }
    const int64_t groups = (n + group - 1) / group, tiles = (rows + row_tile - 1) / row_tile;
    const int64_t parts = std::min(threads, tiles / kPartTiles);
    const int64_t split = parts > 1 ? std::min(groups, threads) : 0, whole = groups - split;
    parallel_chunks(whole + split * parts, 1, [&](int64_t unit, int64_t) {
        const int64_t g = unit < whole ? unit : whole + (unit - whole) / parts;
        const int64_t part = unit < whole ? 0 : (unit - whole) % parts, of = unit < whole ? 1 : parts;
        const int64_t v0 = g * group, m0 = tiles * part / of * row_tile;
        fn(v0, std::min(n, v0 + group), m0, std::min(rows, tiles * (part + 1) / of * row_tile));
    });
}

}  // namespace tailrace
