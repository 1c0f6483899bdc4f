// How the kernels share a loop among the threads. On a shared machine the cores do not run at one
// speed: another process on one core made a static half each a wait for the slower thread (libgomp
// waiting was 9.6% of a 138-token prefill's samples, bench/RESULTS.md, eleventh session). Here each
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

// The projections' split of n output vectors for a product of `rows` rows: from kTakenFrom rows,
// groups of `group` vectors (a tile's width) taken as above, a 138-token prefill 9-12% faster
// (bench/RESULTS.md, twelfth session); below, where a step is one streaming pass over the weights,
// one even share a thread, not whole groups: 36 vectors in groups of 4 are 18 and 18 on two threads,
// not 5 groups and 4.
constexpr int64_t kTakenFrom = 8;

template <typename F>
void parallel_vectors(int64_t n, int64_t group, int64_t rows, const F& fn) {
    const int64_t threads = at::get_num_threads();
    parallel_chunks(n, rows >= kTakenFrom ? group : (n + threads - 1) / threads, fn);
}

}  // namespace tailrace
