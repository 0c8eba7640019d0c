/* The grid quants' products in lanes of outputs (a part of iquant.c, which includes it). */

/* ---------------------------------------------------------------- the products
 *
 * A group of IQ_W outputs (16 with 512-bit VNNI, else 8) is unpacked a super-block at a time
 * into lanes (iq_lanes): its values as signed bytes, 4 consecutive values of each output a
 * 32-bit lane, a vector a chunk of 4 values (s8's layout, quant.c), with each unit's scale (16
 * values for IQ2_XS and IQ2_S, else 32) and each unit's sum times -128 per output. Every row of
 * x then takes a unit's integer dot for all IQ_W outputs in one VPDPBUSD a chunk, against its 4
 * values as unsigned bytes (xu = xq + 128, broadcast) starting from the -128 sum (so the exact
 * sum of xq * w), and one conversion, multiply and FMA a unit:
 *   acc[o] = fma(float(sum of the unit's w * xq), s[o, unit] * xd[block], acc[o])
 * from the row's first unit to its last, in one lane per output. The AVX2 kernels take the same
 * integer sums with maddubs (|w| against x with w's sign: pairs at most 2 * 62 * 127) and round
 * the same float operations in the same order, so every variant and every row count (a decode
 * row, a prompt's tiles) gives the same bits.
 *
 * The unpacking (the grid lookups, the signs, a transposition into lanes) is paid once for all
 * the rows of a chunk of IQ_RC; each row then costs 8 VPDPBUSD and 3 float operations per 16
 * outputs and 32 values, where a row took 4 x 5 instructions per output and 64 values when
 * each output's values were dotted in place (x's sign flip, the dot, its conversion, its scale's
 * lanes, the FMA). Zen 4, one thread, alternated on a loaded machine (2x swings): Qwen3-30B-A3B
 * (6 layers, ~8 rows an expert) pp128 IQ3_XXS 1.15-1.66x the kernels before (1.2-1.56x
 * llama.cpp's -t 1), IQ2_XXS 1.44-1.85x (0.94-1.89x); decode about even (tg32 0.87-1.19x).
 *
 * With VBMI (iq_lanes_fill_t) the lanes are made from the 16 outputs'
 * grid indices and sign words transposed, not from their values: a quarter to an eighth of the
 * bytes through the transposition, each chunk's magnitudes cut straight into the lanes and its
 * sign bits picked from the outputs' (vpshufbitqmb). 2048 x 768, one thread, alternated against
 * the values' transposition (with iq_task's per-type functions): 3-16 rows IQ2_XXS 1.27-1.48x,
 * IQ2_XS 1.10-1.26x, IQ2_S 1.15-1.46x, IQ3_XXS 1.15-1.19x, IQ3_S (later) 7-16 rows 1.03-1.18x;
 * 64 rows 0.97-1.21x (the dots' VPDPBUSD bound; IQ3_S at 64 and 128 rows 0.88-1.06x, noisy). */

#if GL_VNNI512
#define IQ_W 16
#define IQ_MT 8
#else
#define IQ_W 8
#define IQ_MT 4
#endif
/* rows of x a group's super-block is unpacked for, at most: 128 ran 1.1-1.2x faster than 48 at
 * 96-128 rows (one thread, alternated), the unpacking repaid by more rows */
#define IQ_RC 128
#define IQ_UNITS(v) ((v) == IQ2_XS || (v) == IQ2_S ? 16 : 8) /* units of one scale a super-block */

typedef struct {
    int8_t w[64][4 * IQ_W]; /* chunk c (values 4 c .. 4 c + 3): lane o's 4 values, signed */
    int32_t nc[16][IQ_W];   /* per unit: -128 times the sum of its values (VNNI's xu dots) */
    float s[16][IQ_W];      /* per 16 values: the scale */
} iq_lanes;

/* The 256 values of super-block p as signed bytes (nat) and its scales per 16 values (s16). */
static inline __attribute__((always_inline)) void iq_nat(const uint8_t *p, const int v, int8_t *nat,
                                                         float *s16) {
    __m256 a, b;
    iq_scales(p, v, _cvtsh_ss(rd16(p)), &a, &b);
    _mm256_storeu_ps(s16, a);
    _mm256_storeu_ps(s16 + 8, b);
    for (int ib = 0; ib < 8; ib++) {
        uint32_t sg;
        const __m256i g = iq_sub(p, v, ib, &sg);
        _mm256_storeu_si256((__m256i *)(nat + 32 * ib), _mm256_sign_epi8(g, iq_signs(sg)));
    }
}

/* The lanes' transposition: 16 x 16 dwords by attn.c's transpose16 (the files are one unit), 8 x 8 here. */
#if IQ_W == 8
/* r[i] (8 rows of 8 dwords) -> r[j]: dword i of row j in, dword j of row i out. */
static inline __attribute__((always_inline)) void iq_transpose8(__m256i *r) {
    __m256i a[8], b[8];
    for (int i = 0; i < 4; i++) {
        a[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) { /* b[4 i + m], 128-bit lane L: rows 4 i .. 4 i + 3, column 4 L + m */
        b[4 * i] = _mm256_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm256_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm256_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm256_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int m = 0; m < 4; m++) {
        r[m] = _mm256_permute2x128_si256(b[m], b[4 + m], 0x20);
        r[4 + m] = _mm256_permute2x128_si256(b[m], b[4 + m], 0x31);
    }
}
#endif

/* A group reads its IQ_W rows (next: the IQ_W after them) a super-block of each at a time: 16
 * streams, which the hardware's prefetchers left waiting on memory at every group's start (one
 * decode row, IQ2_XXS experts from memory: 0.8x the one stream a row of the kernels before). At
 * its super-block sb it asks for the sb-th IQ_W super-blocks' worth of the next group's bytes,
 * so the next group is in cache when it starts. */
static inline __attribute__((always_inline)) void iq_prefetch_next(const uint8_t *next, int64_t sb, int64_t bytes) {
    for (int64_t o = 0; o < IQ_W * bytes; o += 64) _mm_prefetch((const char *)next + sb * IQ_W * bytes + o, _MM_HINT_T0);
}

/* Super-blocks p[0 .. IQ_W) (one of each output of a group) into lanes. */
static inline __attribute__((always_inline)) void iq_lanes_fill(const uint8_t *const *p, const int v,
                                                                iq_lanes *L) {
    int8_t nat[IQ_W][256] __attribute__((aligned(64)));
    float s16[IQ_W][16] __attribute__((aligned(64)));
    for (int o = 0; o < IQ_W; o++) iq_nat(p[o], v, nat[o], s16[o]);
#if IQ_W == 16
    __m512i r[16];
    for (int j = 0; j < 4; j++) {
        for (int o = 0; o < 16; o++) r[o] = _mm512_load_si512(nat[o] + 64 * j);
        transpose16((__m512 *)r);
        for (int c = 0; c < 16; c++) _mm512_store_si512(L->w[16 * j + c], r[c]);
    }
    for (int o = 0; o < 16; o++) r[o] = _mm512_load_si512(s16[o]);
    transpose16((__m512 *)r);
    for (int u = 0; u < 16; u++) _mm512_store_si512(L->s[u], r[u]);
#else
    __m256i r[8];
    for (int j = 0; j < 8; j++) {
        for (int o = 0; o < 8; o++) r[o] = _mm256_load_si256((const __m256i *)(nat[o] + 32 * j));
        iq_transpose8(r);
        for (int c = 0; c < 8; c++) _mm256_store_si256((__m256i *)L->w[8 * j + c], r[c]);
    }
    for (int h = 0; h < 2; h++) {
        for (int o = 0; o < 8; o++) r[o] = _mm256_load_si256((const __m256i *)(s16[o] + 8 * h));
        iq_transpose8(r);
        for (int u = 0; u < 8; u++) _mm256_store_si256((__m256i *)L->s[8 * h + u], r[u]);
    }
#endif
#if GL_VNNI
    const int units = IQ_UNITS(v), cpu = 64 / units;
    for (int u = 0; u < units; u++) {
#if IQ_W == 16
        const __m512i bias = _mm512_set1_epi8((char)0x80);
        __m512i s = _mm512_setzero_si512();
        for (int c = 0; c < cpu; c++) s = DPBUSD512(s, bias, _mm512_load_si512(L->w[u * cpu + c]));
        _mm512_store_si512(L->nc[u], _mm512_sub_epi32(_mm512_setzero_si512(), s));
#else
        const __m256i bias = _mm256_set1_epi8((char)0x80);
        __m256i s = _mm256_setzero_si256();
        for (int c = 0; c < cpu; c++) s = DPBUSD(s, bias, _mm256_load_si256((const __m256i *)L->w[u * cpu + c]));
        _mm256_store_si256((__m256i *)L->nc[u], _mm256_sub_epi32(_mm256_setzero_si256(), s));
#endif
    }
#endif
}

#if IQ_VBMI /* (with GL_VNNI512: IQ_W 16) */
/* The sign mask of a chunk (bit 4 o + i: output o's value i of the chunk negative) from S (dword o:
 * output o's 32 sign bits of the chunk's 32 values, the chunk's at bits [4 c, 4 c + 4)). */
static inline __mmask64 iq_chunk_neg(__m512i S, int c) {
    const long long lo = 0x03020100ll + 0x04040404ll * c, hi = lo + 0x20202020ll;
    return _mm512_bitshuffle_epi64_mask(S, _mm512_set1_epi64(lo | hi << 32));
}

/* The lanes' chunks 8 ib .. 8 ib + 7 of an IQ2 type: pl[h] (h = 0, 1) byte 4 o + e the low and
 * high code bytes of output o's entry e of sub-block ib, S dword o their 32 sign bits. */
static inline __attribute__((always_inline)) void iq2_chunks(const __m512i *pl, __m512i S, __m512i mag, int ib,
                                                             iq_lanes *L) {
    for (int e = 0; e < 4; e++) {
        const long long c0 = 0x06040200ll + 0x08080808ll * e; /* 2 bits a value: 8 e + 2 i */
        const __m512i cut = _mm512_set1_epi64(c0 | (c0 + 0x20202020ll) << 32);
        for (int h = 0; h < 2; h++) { /* chunk 8 ib + 2 e + h: entry e's values 4 h .. 4 h + 3 */
            const __m512i g = _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(cut, pl[h]), mag);
            _mm512_store_si512(L->w[8 * ib + 2 * e + h],
                               _mm512_mask_sub_epi8(g, iq_chunk_neg(S, 2 * e + h), _mm512_setzero_si512(), g));
        }
    }
}

/* The lanes' chunks 4 m .. 4 m + 3 of an IQ3 type: lo, hi byte 4 o + e the code bytes of output
 * o's entry 4 m + e, S dword o the 32 sign bits of its sub-block (m / 2). */
static inline __attribute__((always_inline)) void iq3_chunks(__m512i lo, __m512i hi, __m512i S, __m512i mag, int m,
                                                             iq_lanes *L) {
    const __m512i cut = _mm512_set1_epi64(0x2926232009060300ll); /* 3 bits a value: 0, 3, 6, 9 | 32 .. */
    const __m512i q8 = _mm512_mullo_epi64(_mm512_setr_epi64(0, 8, 16, 24, 32, 40, 48, 56),
                                          _mm512_set1_epi64(0x0101010101010101ll)); /* 8 q a byte */
    for (int e = 0; e < 4; e++) { /* qword q: output 2 q's code at bytes 0, 1, 2 q + 1's at 4, 5 */
        const long long c0 = e | (64 + e) << 8 | e << 16 | (64 + e) << 24, c1 = c0 + 0x04040404ll;
        const __m512i ctrl = _mm512_add_epi8(_mm512_set1_epi64(c0 | c1 << 32), q8);
        const __m512i g = _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(cut, _mm512_permutex2var_epi8(lo, ctrl, hi)), mag);
        const int c = 4 * m + e;
        _mm512_store_si512(L->w[c], _mm512_mask_sub_epi8(g, iq_chunk_neg(S, c % 8), _mm512_setzero_si512(), g));
    }
}

/* Two masks of 4 bits an output from 16 outputs' 64-bit words (q0: outputs 0 .. 7, q1: 8 .. 15):
 * bit 4 o + i of *a is bit ctrl[i] of output o's word, of *b bit ctrl[4 + i] (ctrl: one qword's bytes). */
static inline __attribute__((always_inline)) void iq_pick_bits(__m512i q0, __m512i q1, long long ctrl, __mmask64 *a,
                                                               __mmask64 *b) {
    const __m512i c = _mm512_set1_epi64(ctrl);
    const uint64_t m0 = _cvtmask64_u64(_mm512_bitshuffle_epi64_mask(q0, c));
    const uint64_t m1 = _cvtmask64_u64(_mm512_bitshuffle_epi64_mask(q1, c));
    const uint64_t lo = 0x0F0F0F0F0F0F0F0Full, hi = ~lo;
    *a = _cvtu64_mask64(_pext_u64(m0, lo) | _pext_u64(m1, lo) << 32);
    *b = _cvtu64_mask64(_pext_u64(m0, hi) | _pext_u64(m1, hi) << 32);
}

/* The 16 outputs' 8 bytes at offset off of their super-blocks, as qwords: *q0 outputs 0 .. 7, *q1 8 .. 15. */
static inline void iq_qwords(const uint8_t *const *p, int off, __m512i *q0, __m512i *q1) {
    uint64_t t[16] __attribute__((aligned(64)));
    for (int o = 0; o < 16; o++) memcpy(t + o, p[o] + off, 8);
    *q0 = _mm512_load_si512(t), *q1 = _mm512_load_si512(t + 8);
}

/* The 8 dwords at off of the 16 outputs' super-blocks p[o], transposed: U[j] dword o: output o's
 * dword j (iq_transpose8 in each 256-bit half: outputs 0 .. 7 in the low, 8 .. 15 in the high). */
static inline __attribute__((always_inline)) void iq_dwords8(const uint8_t *const *p, int off, __m512i *U) {
    __m512i a[8], b[8];
    for (int j = 0; j < 8; j++)
        b[j] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p[j] + off))),
                                  _mm256_loadu_si256((const __m256i *)(p[j + 8] + off)), 1);
    for (int i = 0; i < 4; i++) {
        a[2 * i] = _mm512_unpacklo_epi32(b[2 * i], b[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(b[2 * i], b[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for (int m = 0; m < 4; m++) {
        U[m] = _mm512_permutex2var_epi64(b[m], lo, b[4 + m]);
        U[4 + m] = _mm512_permutex2var_epi64(b[m], hi, b[4 + m]);
    }
}

/* The scales of the 16 outputs' super-blocks p[o] per 16 values (iq_scales' values, the same
 * float operations) in lanes: s[u] lane o, 16 outputs at a time. */
static inline __attribute__((always_inline)) void iq_lane_scales(const uint8_t *const *p, const int v, float (*s)[16]) {
    uint16_t dh[16];
    for (int o = 0; o < 16; o++) dh[o] = rd16(p[o]);
    const __m512 vd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)dh)), half = _mm512_set1_ps(0.5f);
    if (v == IQ2_XS || v == IQ2_S) { /* 16 4-bit ls, one per 16 values */
        __m512i s0, s1;
        iq_qwords(p, v == IQ2_XS ? 66 : 74, &s0, &s1);
        const __m512i o8 = _mm512_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120);
        for (int u = 0; u < 16; u++) {
            const __m512i b = _mm512_maskz_permutex2var_epi8(0x1111111111111111ull, s0, _mm512_add_epi32(o8, _mm512_set1_epi32(u / 2)), s1);
            const __m512 ls = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(b, 4 * (u & 1)), _mm512_set1_epi32(15)));
            _mm512_store_ps(s[u], _mm512_mul_ps(_mm512_mul_ps(vd, _mm512_add_ps(half, ls)), _mm512_set1_ps(0.25f)));
        }
        return;
    }
    __m512 db[8]; /* one per 32 values */
    if (v == IQ3_S) {
        uint32_t sc[16] __attribute__((aligned(64)));
        for (int o = 0; o < 16; o++) sc[o] = rd32(p[o] + 106);
        const __m512i all = _mm512_load_si512(sc);
        for (int ib = 0; ib < 8; ib++) {
            const __m512i ls = _mm512_and_si512(_mm512_srli_epi32(all, 4 * ib), _mm512_set1_epi32(15));
            db[ib] = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_set1_epi32(1), _mm512_add_epi32(ls, ls))));
        }
    } else { /* ls in the top 4 bits of each sub-block's sign word: IQ2_XXS's at 2 + 8 ib + 4, IQ3_XXS's at 66 + 4 ib */
        __m512i A[16];
        if (v == IQ2_XXS) {
            for (int o = 0; o < 16; o++) A[o] = _mm512_loadu_si512(p[o] + 2);
            transpose16((__m512 *)A);
            for (int ib = 0; ib < 8; ib++) A[ib] = A[2 * ib + 1];
        } else {
            iq_dwords8(p, 66, A);
        }
        for (int ib = 0; ib < 8; ib++) {
            const __m512 ls = _mm512_cvtepi32_ps(_mm512_srli_epi32(A[ib], 28));
            db[ib] = _mm512_mul_ps(_mm512_mul_ps(vd, _mm512_add_ps(half, ls)), _mm512_set1_ps(v == IQ2_XXS ? 0.25f : 0.5f));
        }
    }
    for (int ib = 0; ib < 8; ib++) {
        _mm512_store_ps(s[2 * ib], db[ib]);
        _mm512_store_ps(s[2 * ib + 1], db[ib]);
    }
}

/* iq_lanes_fill_t's IQ3 types: T[m] byte 4 o + e output o's index of entry 4 m + e (chunk 4 m + e),
 * A[ib] dword o output o's sub-block ib's sign word (IQ3_XXS: 4 7-bit sign indices and ls; IQ3_S:
 * its 32 sign bits), vd the 16 outputs' d; p the outputs' super-blocks (IQ3_S only: its qh, scales). */
static inline __attribute__((always_inline)) void iq3_lanes(const uint8_t *const *p, const int v, const __m512i *T,
                                                            const __m512i *A, __m512 vd, iq_lanes *L) {
    const __m512 half = _mm512_set1_ps(0.5f);
    __m512i q0, q1;
    if (v == IQ3_S) iq_qwords(p, 66, &q0, &q1); /* qh: bit 8 of entry e's index at its bit e */
    const __m512i mag = _mm512_load_si512(v == IQ3_XXS ? IQ3XXS_MAG64 : IQ3S_MAG64);
    for (int m = 0; m < 16; m += 2) {
        __mmask64 h8[2];
        if (v == IQ3_S)
            iq_pick_bits(q0, q1, 0x0706050403020100ll + 0x0404040404040404ll * m, &h8[0], &h8[1]);
        for (int e = 0; e < 2; e++) {
            const __m512i S = v == IQ3_XXS ? iq_ksigns512(A[(m + e) / 2]) : A[(m + e) / 2];
            if (v == IQ3_XXS)
                iq3_chunks(iq_look256(IQ3XXS_CODE[0], T[m + e]), iq_look256(IQ3XXS_CODE[1], T[m + e]), S, mag, m + e, L);
            else
                iq3_chunks(iq_look512(IQ3S_CODE[0], T[m + e], h8[e]), iq_look512(IQ3S_CODE[1], T[m + e], h8[e]), S,
                           mag, m + e, L);
        }
    }
    if (v == IQ3_S) {
        iq_lane_scales(p, v, L->s);
    } else {
        for (int ib = 0; ib < 8; ib++) {
            const __m512 ls = _mm512_cvtepi32_ps(_mm512_srli_epi32(A[ib], 28));
            const __m512 db = _mm512_mul_ps(_mm512_mul_ps(vd, _mm512_add_ps(half, ls)), _mm512_set1_ps(0.5f));
            _mm512_store_ps(L->s[2 * ib], db);
            _mm512_store_ps(L->s[2 * ib + 1], db);
        }
    }
}

/* iq_lanes_fill_t's IQ2_XXS: T[2 ib] dword o output o's 4 indices of sub-block ib, T[2 ib + 1] its
 * sign word (4 7-bit sign indices and ls), vd the 16 outputs' d. */
static inline __attribute__((always_inline)) void iq2xxs_lanes(const __m512i *T, __m512 vd, iq_lanes *L) {
    const __m512i mag = _mm512_load_si512(IQ2XXS_MAG64);
    for (int ib = 0; ib < 8; ib++) {
        const __m512i pl[2] = {iq_look256(IQ2XXS_CODE[0], T[2 * ib]), iq_look256(IQ2XXS_CODE[1], T[2 * ib])};
        iq2_chunks(pl, iq_ksigns512(T[2 * ib + 1]), mag, ib, L);
        const __m512 ls = _mm512_cvtepi32_ps(_mm512_srli_epi32(T[2 * ib + 1], 28));
        const __m512 db = _mm512_mul_ps(_mm512_mul_ps(vd, _mm512_add_ps(_mm512_set1_ps(0.5f), ls)), _mm512_set1_ps(0.25f));
        _mm512_store_ps(L->s[2 * ib], db);
        _mm512_store_ps(L->s[2 * ib + 1], db);
    }
}

/* the lanes' nc: -128 times each unit's sum of values (VNNI's xu dots) */
static inline __attribute__((always_inline)) void iq_lanes_nc(const int v, iq_lanes *L) {
    const int units = IQ_UNITS(v), cpu = 64 / units;
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    for (int u = 0; u < units; u++) {
        __m512i s = _mm512_setzero_si512();
        for (int c = 0; c < cpu; c++) s = DPBUSD512(s, bias, _mm512_load_si512(L->w[u * cpu + c]));
        _mm512_store_si512(L->nc[u], _mm512_sub_epi32(_mm512_setzero_si512(), s));
    }
}

/* iq_lanes_fill with VBMI: the 16 outputs' grid indices and sign words
 * transposed (16 x 16 dwords, 4 bytes of an output a lane), not their 256 values each, then
 * looked up and cut straight into the lanes, a chunk's sign bits picked from its outputs'
 * (vpshufbitqmb), the scales made in lanes: 4-8x fewer bytes through the transposition. The same
 * lanes (values, scales, nc) as iq_lanes_fill, so the same products. */
static inline __attribute__((always_inline)) void iq_lanes_fill_t(const uint8_t *const *p, const int v,
                                                                  iq_lanes *L) {
    uint16_t dh[16];
    for (int o = 0; o < 16; o++) dh[o] = rd16(p[o]);
    const __m512 vd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)dh));
    __m512i T[16];
    for (int o = 0; o < 16; o++) T[o] = _mm512_loadu_si512(p[o] + 2);
    transpose16((__m512 *)T); /* T[m] dword o: output o's dword m of bytes [2, 66) */
    if (v == IQ2_XXS) { /* T[2 ib]: sub-block ib's 4 indices, T[2 ib + 1]: its signs and ls */
        iq2xxs_lanes(T, vd, L);
    } else if (v == IQ2_XS || v == IQ2_S) {
        const __m512i mag = _mm512_load_si512(v == IQ2_XS ? IQ2XS_MAG64 : IQ2S_MAG64);
        __m512i q0, q1;
        if (v == IQ2_S) iq_qwords(p, 66, &q0, &q1); /* qh: bits 8, 9 of entry 4 ib + e at byte ib's 2 e, 2 e + 1 */
        for (int ib = 0; ib < 8; ib++) {
            __m512i pl[2], S;
            if (v == IQ2_XS) { /* T[2 ib + j] word 2 o + h: entry 4 ib + 2 j + h, 9 bits of index, 7 of signs */
                const __m512i o4 = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                      _mm512_set1_epi32(0x04040404));
                const __m512i ev = _mm512_add_epi8(_mm512_set1_epi32(0x42400200), o4); /* byte 4 o + e: entry e's low byte */
                const __m512i idx = _mm512_permutex2var_epi8(T[2 * ib], ev, T[2 * ib + 1]);
                const __m512i hb = _mm512_permutex2var_epi8(T[2 * ib], _mm512_add_epi8(ev, _mm512_set1_epi8(1)), T[2 * ib + 1]);
                const __mmask64 h8 = _mm512_test_epi8_mask(hb, _mm512_set1_epi8(1));
                pl[0] = iq_look512(IQ2XS_CODE[0], idx, h8), pl[1] = iq_look512(IQ2XS_CODE[1], idx, h8);
                const __m512i m7 = _mm512_set1_epi8(0x7f), s7 = _mm512_and_si512(_mm512_srli_epi16(hb, 1), m7);
                const __m512i pc = _mm512_popcnt_epi8(s7);
                S = _mm512_ternarylogic_epi32(s7, _mm512_slli_epi16(pc, 7), m7, 0xE4);
            } else { /* IQ2_S: T[ib] its 4 indices' low bytes, T[8 + ib] their sign bytes */
                __mmask64 h8, h9;
                iq_pick_bits(q0, q1, (0x06040200ll + 0x08080808ll * ib) * 0x0000000100000001ll + 0x0101010100000000ll, &h8, &h9);
                pl[0] = _mm512_mask_blend_epi8(h9, iq_look512(IQ2S_CODE[0], T[ib], h8), iq_look512(IQ2S_CODE[0] + 512, T[ib], h8));
                pl[1] = _mm512_mask_blend_epi8(h9, iq_look512(IQ2S_CODE[1], T[ib], h8), iq_look512(IQ2S_CODE[1] + 512, T[ib], h8));
                S = T[8 + ib];
            }
            iq2_chunks(pl, S, mag, ib, L);
        }
        iq_lane_scales(p, v, L->s);
    } else {
        __m512i A[8]; /* A[ib] dword o: output o's sub-block ib's signs (and ls) */
        iq_dwords8(p, v == IQ3_XXS ? 66 : 74, A);
        iq3_lanes(p, v, T, A, vd, L);
    }
    iq_lanes_nc(v, L);
}

/* iq_lanes_fill from a tile t of IQ2_XXS or IQ3_XXS (iquant.c's tiles: T and A as they are stored) */
static inline __attribute__((always_inline)) void iq_lanes_fill_tiles(const uint8_t *t, const int v, iq_lanes *L) {
    const int64_t ub = IQ_TILE_UNIT(v);
    const __m512 vd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t + 8 * ub)));
    __m512i T[16], A[8];
    for (int u = 0; u < 8; u++) { /* IQ2_XXS: unit u's indices, sign words; IQ3_XXS: indices (two), sign words */
        T[2 * u] = _mm512_loadu_si512(t + u * ub), T[2 * u + 1] = _mm512_loadu_si512(t + u * ub + 64);
        if (v == IQ3_XXS) A[u] = _mm512_loadu_si512(t + u * ub + 128);
    }
    if (v == IQ2_XXS)
        iq2xxs_lanes(T, vd, L);
    else
        iq3_lanes(NULL, v, T, A, vd, L);
    iq_lanes_nc(v, L);
}
#endif
