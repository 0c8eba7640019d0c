/* The grid quants' products of many rows against the lanes (iq_lanes.c's): the rows' dots and a
 * group of outputs' loop over its super-blocks (a part of iquant.c, which includes it). */

/* acc[o] of R rows (accm: R x IQ_W floats; first: start from 0) += super-block sb of the lanes L
 * against the rows r0 .. r0 + R - 1 of x (xb). */
static inline __attribute__((always_inline)) void iq_lanes_dots(const iq_lanes *L, const int v, int64_t sb,
                                                                const xbuf *xb, int64_t r0, int64_t k,
                                                                const int R, float *accm, int first) {
    const int units = IQ_UNITS(v), cpu = 64 / units;
    const int64_t kb = k / 32;
    const float *xd = xb->xd + r0 * kb + sb * 8;
#if GL_VNNI
    /* x's 256 values as unsigned bytes (every caller takes xu for kind 6 with VNNI: xbuf_take) */
    const uint8_t *xu = xb->xu + r0 * k + sb * 256;
#else
    const int8_t *xq = xb->xq + r0 * k + sb * 256;
    const __m256i ones = _mm256_set1_epi16(1);
#endif
#if IQ_W == 16
    __m512 acc[IQ_MT];
    for (int r = 0; r < R; r++) acc[r] = first ? _mm512_setzero_ps() : _mm512_load_ps(accm + r * 16);
    for (int u = 0; u < units; u++) {
        __m512i I[IQ_MT];
        const __m512i nc = _mm512_load_si512(L->nc[u]);
        for (int r = 0; r < R; r++) I[r] = nc;
        for (int c = u * cpu; c < u * cpu + cpu; c++) {
            const __m512i wv = _mm512_load_si512(L->w[c]);
            for (int r = 0; r < R; r++) I[r] = DPBUSD512(I[r], _mm512_set1_epi32((int)rd32(xu + r * k + 4 * c)), wv);
        }
        const __m512 s = _mm512_load_ps(L->s[u * (16 / units)]);
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I[r]), _mm512_mul_ps(s, _mm512_set1_ps(xd[r * kb + u * cpu / 8])), acc[r]);
    }
    for (int r = 0; r < R; r++) _mm512_store_ps(accm + r * 16, acc[r]);
#else
    __m256 acc[IQ_MT];
    for (int r = 0; r < R; r++) acc[r] = first ? _mm256_setzero_ps() : _mm256_load_ps(accm + r * 8);
    for (int u = 0; u < units; u++) {
        __m256i I[IQ_MT];
        for (int c = u * cpu; c < u * cpu + cpu; c++) {
            const __m256i wv = _mm256_load_si256((const __m256i *)L->w[c]);
#if GL_VNNI
            if (c == u * cpu)
                for (int r = 0; r < R; r++) I[r] = _mm256_load_si256((const __m256i *)L->nc[u]);
            for (int r = 0; r < R; r++) I[r] = DPBUSD(I[r], _mm256_set1_epi32((int)rd32(xu + r * k + 4 * c)), wv);
#else
            const __m256i aw = _mm256_sign_epi8(wv, wv);
            for (int r = 0; r < R; r++) {
                const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32((int)rd32((const uint8_t *)xq + r * k + 4 * c)), wv);
                const __m256i d = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs), ones);
                I[r] = c == u * cpu ? d : _mm256_add_epi32(I[r], d);
            }
#endif
        }
        const __m256 s = _mm256_load_ps(L->s[u * (16 / units)]);
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I[r]), _mm256_mul_ps(s, _mm256_set1_ps(xd[r * kb + u * cpu / 8])), acc[r]);
    }
    for (int r = 0; r < R; r++) _mm256_store_ps(accm + r * 8, acc[r]);
#endif
}

/* The outputs [og, og + nv) (nv <= IQ_W) of rows [ra, rb) of x: each super-block of the group
 * unpacked into lanes once for every IQ_RC rows (tiles: from the weight's tiles, iquant.c; the
 * group's tile of super-block sb where its first output's super-block is in place). */
static inline __attribute__((always_inline)) void iq_group(const gl_weight *w, const int v, const int tiles,
                                                           const xbuf *xb, int64_t ra, int64_t rb, int64_t og,
                                                           int nv, float *y) {
    const int64_t n = w->n, k = w->k, nsb = k / 256, bytes = IQ_BYTES(v), rowbytes = nsb * bytes;
    const uint8_t *row[IQ_W]; /* the outputs past nv repeat the last (their sums are dropped) */
    for (int o = 0; o < IQ_W; o++) row[o] = (const uint8_t *)w->q + (og + (o < nv ? o : nv - 1)) * rowbytes;
    iq_lanes L __attribute__((aligned(64)));
    float acc[IQ_RC * IQ_W] __attribute__((aligned(64)));
    for (int64_t r0 = ra; r0 < rb; r0 += IQ_RC) {
        const int64_t r1 = rb - r0 < IQ_RC ? rb : r0 + IQ_RC;
        for (int64_t sb = 0; sb < nsb; sb++) {
            const uint8_t *p[IQ_W];
            for (int o = 0; o < IQ_W; o++) p[o] = row[o] + sb * bytes;
            iq_prefetch_next(row[0] + IQ_W * rowbytes, sb, bytes);
#if IQ_VBMI /* (with GL_VNNI512: IQ_W 16) */
            if (tiles)
                iq_lanes_fill_tiles(row[0] + sb * IQ_W * bytes, v, &L);
            else
                iq_lanes_fill_t(p, v, &L);
#else
            (void)tiles;
            iq_lanes_fill(p, v, &L);
#endif
            for (int64_t t0 = r0; t0 < r1; t0 += IQ_MT) {
                const int R = r1 - t0 < IQ_MT ? (int)(r1 - t0) : IQ_MT;
                float *am = acc + (t0 - r0) * IQ_W;
#define IQD(RR) iq_lanes_dots(&L, v, sb, xb, t0, k, RR, am, sb == 0)
                switch (R) {
#if IQ_MT == 8
                case 8: IQD(8); break;
                case 7: IQD(7); break;
                case 6: IQD(6); break;
                case 5: IQD(5); break;
#endif
                case 4: IQD(4); break;
                case 3: IQD(3); break;
                case 2: IQD(2); break;
                default: IQD(1); break;
                }
#undef IQD
            }
        }
        for (int64_t r = r0; r < r1; r++)
            memcpy(y + r * n + og, acc + (r - r0) * IQ_W, sizeof(float) * (size_t)nv);
    }
}
