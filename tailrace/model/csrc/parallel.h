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

}  // namespace tailrace
