/* Read bandwidth of this machine: T threads each stream through their share of a buffer of
 * MiB mebibytes (default 1024), summing it as 64-bit words in eight independent lanes (the
 * compiler vectorises the loop at -O3 -march=native), best of R passes (default 5). Prints
 * bytes per second on one line. Built and run by bench/vs_llama_cpp.py --bandwidth:
 *
 *     cc -O3 -march=native -pthread bench/read_bandwidth.c -o /tmp/rb && /tmp/rb 2 1024 5
 *
 * A measuring tool for the benchmarks, not part of graftlm. */
#define _POSIX_C_SOURCE 200112L
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct {
  const uint64_t *p;
  size_t n;
  uint64_t sum;
  pthread_barrier_t *start;
} Share;

static void *reader(void *arg) {
  Share *s = arg;
  uint64_t acc[8] = {0};
  pthread_barrier_wait(s->start);
  for (size_t i = 0; i + 8 <= s->n; i += 8)
    for (int j = 0; j < 8; j++) acc[j] += s->p[i + j];
  s->sum = acc[0] + acc[1] + acc[2] + acc[3] + acc[4] + acc[5] + acc[6] + acc[7];
  return NULL;
}

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int main(int argc, char **argv) {
  int threads = argc > 1 ? atoi(argv[1]) : 2;
  size_t mib = argc > 2 ? (size_t)atol(argv[2]) : 1024;
  int rounds = argc > 3 ? atoi(argv[3]) : 5;
  if (threads < 1 || threads > 256 || mib < 1 || rounds < 1) {
    fprintf(stderr, "usage: %s [threads 1-256] [MiB] [rounds]\n", argv[0]);
    return 2;
  }
  size_t bytes = mib << 20, words = bytes / 8;
  uint64_t *buf = aligned_alloc(64, bytes);
  if (buf == NULL) {
    fprintf(stderr, "cannot allocate %zu MiB\n", mib);
    return 1;
  }
  for (size_t i = 0; i < words; i++) buf[i] = i; /* touched: every page is real */
  double best = 1e30;
  uint64_t check = 0;
  for (int r = 0; r < rounds; r++) {
    pthread_t tid[256];
    Share share[256];
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, (unsigned)threads + 1);
    size_t per = (words / (size_t)threads) & ~(size_t)7;
    for (int t = 0; t < threads; t++) {
      share[t] = (Share){buf + (size_t)t * per, per, 0, &start};
      pthread_create(&tid[t], NULL, reader, &share[t]);
    }
    pthread_barrier_wait(&start);
    double t0 = now();
    for (int t = 0; t < threads; t++) pthread_join(tid[t], NULL);
    double dt = now() - t0;
    for (int t = 0; t < threads; t++) check += share[t].sum;
    pthread_barrier_destroy(&start);
    if (dt < best) best = dt;
  }
  size_t read = ((words / (size_t)threads) & ~(size_t)7) * (size_t)threads * 8;
  printf("%.0f\n", (double)read / best);
  fprintf(stderr, "checksum %llu\n", (unsigned long long)check); /* keeps the sums alive */
  free(buf);
  return 0;
}
