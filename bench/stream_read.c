/* A plain streaming read of a buffer, for bench/decode_parts.py: the read probe's loop
 * (bench/read_bandwidth.c: 64-bit words in eight lanes, vectorised at -O3 -march=native) over
 * n bytes (a multiple of 64) at p, split over nth OpenMP threads, each its contiguous share.
 * Returns the sum (so that the compiler keeps the reads). A measuring tool, not part of graftlm:
 *
 *     cc -O3 -march=native -fopenmp -shared -fPIC bench/stream_read.c -o stream_read.so */
#include <omp.h>
#include <stddef.h>
#include <stdint.h>

static uint64_t lanes(const uint64_t *p, size_t words) {
    uint64_t acc[8] = {0};
    for (size_t i = 0; i + 8 <= words; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += p[i + j];
    return acc[0] + acc[1] + acc[2] + acc[3] + acc[4] + acc[5] + acc[6] + acc[7];
}

uint64_t stream_read(const uint64_t *p, size_t n, int nth) {
    const size_t words = n / 8;
    uint64_t total = 0;
#pragma omp parallel num_threads(nth) reduction(+ : total)
    {
        const size_t me = (size_t)omp_get_thread_num(), nt = (size_t)omp_get_num_threads();
        const size_t a = words * me / nt / 8 * 8, b = words * (me + 1) / nt / 8 * 8;
        total += lanes(p + a, b - a);
    }
    return total;
}
