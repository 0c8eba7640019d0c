/* The issue-slot probes behind docs/design-notes.md's account of x per 256 (bench/xq256.c), on a
 * Zen 4 core: loops of VPDPBUSD with nothing else, beside 2 of another instruction a 16, and the
 * two epilogues' whole mix a super-block and row of x (64 VPDPBUSD each). The registers do not
 * depend on each other across a loop except the accumulators, so each loop is bound by issue.
 * A measuring tool, not part of graftlm (one thread, this thread's CPU time, GMAC/s of VPDPBUSD):
 *
 *     cc -O2 -march=native bench/epilogue_probe.c -o /tmp/epilogue_probe && /tmp/epilogue_probe */
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

#define N 5000000L
#define D8(r) "vpdpbusd %%zmm30,%%zmm31,%%zmm" #r "\n"
#define DP8 D8(0) D8(1) D8(2) D8(3) D8(4) D8(5) D8(6) D8(7)
#define DP16 DP8 D8(8) D8(9) D8(10) D8(11) D8(12) D8(13) D8(14) D8(15)
#define DP64 DP8 DP8 DP8 DP8 DP8 DP8 DP8 DP8
#define CLOB                                                                                       \
    "memory", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",      \
        "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19",  \
        "xmm20", "xmm21", "xmm22", "xmm23", "xmm24", "xmm25"
#define LOOP(name, BODY)                                                                           \
    __attribute__((noinline)) static void name(void) {                                            \
        long n = N;                                                                                \
        __asm__ volatile("1:\n" BODY "dec %0\n jnz 1b\n" : "+r"(n)::CLOB);                         \
    }

/* 16 VPDPBUSD beside 2 of another */
LOOP(dp16, DP16)
LOOP(mulld, DP16 "vpmulld %%zmm29,%%zmm0,%%zmm16\n vpmulld %%zmm29,%%zmm1,%%zmm17\n")
LOOP(addd, DP16 "vpaddd %%zmm0,%%zmm20,%%zmm20\n vpaddd %%zmm1,%%zmm21,%%zmm21\n")
LOOP(dpwssd, DP16 "vpdpwssd %%zmm29,%%zmm31,%%zmm20\n vpdpwssd %%zmm29,%%zmm31,%%zmm21\n")
LOOP(maddwd, DP16 "vpmaddwd %%zmm29,%%zmm0,%%zmm16\n vpmaddwd %%zmm29,%%zmm1,%%zmm17\n")
LOOP(mulps, DP16 "vmulps %%zmm29,%%zmm28,%%zmm16\n vmulps %%zmm29,%%zmm28,%%zmm17\n")
LOOP(addps, DP16 "vaddps %%zmm29,%%zmm20,%%zmm20\n vaddps %%zmm29,%%zmm21,%%zmm21\n")
LOOP(movzx, DP16 "vpmovzxbd %%xmm29,%%zmm16\n vpmovzxbd %%xmm28,%%zmm17\n")

/* x per 32, 8 blocks of a row: each 8 VPDPBUSD, a VCVTDQ2PS, a VMULPS (s xd), an FMA and an FNMA */
#define E32(r)                                                                                     \
    "vcvtdq2ps %%zmm" #r ",%%zmm8\n vmulps %%zmm28,%%zmm27,%%zmm9\n vfmadd231ps %%zmm8,%%zmm9,%%zmm" #r \
    "\n vfnmadd231ps %%zmm26,%%zmm27,%%zmm1" #r "\n"
LOOP(per32, DP64 E32(0) E32(1) E32(2) E32(3) E32(4) E32(5) E32(6) E32(7))

/* x per 256, a super-block of a row: 8 sub-blocks each 8 VPDPBUSD, a VPMULLD and a VPADDD; then
 * 4 VPDPWSSD (the mins), 2 VCVTDQ2PS, 3 VMULPS, a VSUBPS and a VADDPS */
#define M1(a, t, s) "vpmulld %%zmm29,%%zmm" #a ",%%zmm" #t "\n vpaddd %%zmm" #t ",%%zmm" #s ",%%zmm" #s "\n"
#define MUL8 M1(0, 16, 20) M1(1, 17, 21) M1(2, 18, 22) M1(3, 19, 23) M1(4, 16, 20) M1(5, 17, 21) M1(6, 18, 22) M1(7, 19, 23)
#define TAIL256                                                                                    \
    "vpdpwssd %%zmm29,%%zmm31,%%zmm24\n vpdpwssd %%zmm29,%%zmm31,%%zmm25\n"                       \
    "vpdpwssd %%zmm29,%%zmm31,%%zmm24\n vpdpwssd %%zmm29,%%zmm31,%%zmm25\n"                       \
    "vcvtdq2ps %%zmm20,%%zmm8\n vcvtdq2ps %%zmm24,%%zmm9\n vmulps %%zmm8,%%zmm28,%%zmm8\n"        \
    "vmulps %%zmm9,%%zmm27,%%zmm9\n vsubps %%zmm9,%%zmm8,%%zmm8\n vmulps %%zmm8,%%zmm26,%%zmm8\n" \
    "vaddps %%zmm8,%%zmm15,%%zmm15\n"
LOOP(per256, DP64 MUL8 TAIL256)
LOOP(dp64, DP64)

static void report(const char *what, void (*fn)(void), double dots) {
    const double t0 = now();
    fn();
    printf("%-34s %6.1f GMAC/s\n", what, N * dots * 64.0 / (now() - t0) / 1e9);
}

int main(void) {
    for (int round = 0; round < 2; round++) {
        report("16 VPDPBUSD", dp16, 16);
        report("  + 2 VPMULLD", mulld, 16);
        report("  + 2 VPADDD", addd, 16);
        report("  + 2 VPDPWSSD", dpwssd, 16);
        report("  + 2 VPMADDWD", maddwd, 16);
        report("  + 2 VMULPS", mulps, 16);
        report("  + 2 VADDPS", addps, 16);
        report("  + 2 VPMOVZXBD", movzx, 16);
        report("64 VPDPBUSD", dp64, 64);
        report("  with x per 32's epilogue", per32, 64);
        report("  with x per 256's epilogue", per256, 64);
    }
    return 0;
}
