/* The library's one translation unit: the files of each concern, compiled together as one (the
 * compiler inlines across them as it did when they were one file). graftlm/native/build.py builds
 * this file; every file of csrc/ is part of its cache key. */
#include "graftlm.h"

/* The structs' layout as this compiler laid them out, for the loader to compare with ctypes'. A
 * field missing here and in abi.py but present in the struct shows as the struct's size. */
#define GL_SIZE(S) {#S, (int64_t)sizeof(S)}
#define GL_AT(S, f) {#S "." #f, (int64_t)offsetof(S, f)}
static const struct {
    const char *name;
    int64_t value;
} layout[] = {
    GL_SIZE(gl_weight), GL_AT(gl_weight, kind), GL_AT(gl_weight, half), GL_AT(gl_weight, sblk),
    GL_AT(gl_weight, small), GL_AT(gl_weight, n), GL_AT(gl_weight, k), GL_AT(gl_weight, q),
    GL_AT(gl_weight, d), GL_AT(gl_weight, m),

    GL_SIZE(gl_lora_part), GL_AT(gl_lora_part, b), GL_AT(gl_lora_part, c0),
    GL_AT(gl_lora_part, r), GL_AT(gl_lora_part, lo), GL_AT(gl_lora_part, hi),

    GL_SIZE(gl_lora_slot), GL_AT(gl_lora_slot, a), GL_AT(gl_lora_slot, aq),
    GL_AT(gl_lora_slot, a_scales), GL_AT(gl_lora_slot, parts), GL_AT(gl_lora_slot, id),
    GL_AT(gl_lora_slot, r), GL_AT(gl_lora_slot, a_half), GL_AT(gl_lora_slot, n_parts),

    GL_SIZE(gl_lora_site), GL_AT(gl_lora_site, slot), GL_AT(gl_lora_site, scales),
    GL_AT(gl_lora_site, n), GL_AT(gl_lora_site, bf), GL_AT(gl_lora_site, ld),

    GL_SIZE(gl_layer), GL_AT(gl_layer, qkv), GL_AT(gl_layer, o), GL_AT(gl_layer, gate_up),
    GL_AT(gl_layer, down), GL_AT(gl_layer, l_qkv), GL_AT(gl_layer, l_o),
    GL_AT(gl_layer, l_gate_up), GL_AT(gl_layer, l_down), GL_AT(gl_layer, attn_norm),
    GL_AT(gl_layer, ffn_norm), GL_AT(gl_layer, q_norm), GL_AT(gl_layer, k_norm),
    GL_AT(gl_layer, post_attn_norm), GL_AT(gl_layer, post_ffw_norm), GL_AT(gl_layer, q_bias),
    GL_AT(gl_layer, k_bias), GL_AT(gl_layer, v_bias), GL_AT(gl_layer, o_bias), GL_AT(gl_layer, kv),
    GL_AT(gl_layer, cos_t), GL_AT(gl_layer, sin_t), GL_AT(gl_layer, n_qkv),
    GL_AT(gl_layer, n_embd), GL_AT(gl_layer, n_head), GL_AT(gl_layer, n_head_kv),
    GL_AT(gl_layer, head_dim), GL_AT(gl_layer, n_ff), GL_AT(gl_layer, n_ctx), GL_AT(gl_layer, rot),
    GL_AT(gl_layer, neox), GL_AT(gl_layer, window), GL_AT(gl_layer, act), GL_AT(gl_layer, eps),
    GL_AT(gl_layer, scale), GL_AT(gl_layer, softcap), GL_AT(gl_layer, router),
    GL_AT(gl_layer, l_router), GL_AT(gl_layer, exp_gate_up), GL_AT(gl_layer, exp_down),
    GL_AT(gl_layer, n_expert), GL_AT(gl_layer, n_expert_used), GL_AT(gl_layer, sinks),
    GL_AT(gl_layer, router_bias), GL_AT(gl_layer, exp_gate_up_bias), GL_AT(gl_layer, exp_down_bias),
    GL_AT(gl_layer, gating), GL_AT(gl_layer, l_exp_gate_up), GL_AT(gl_layer, l_exp_down),

    GL_SIZE(gl_kv), GL_AT(gl_kv, k), GL_AT(gl_kv, v), GL_AT(gl_kv, tables), GL_AT(gl_kv, n_blocks),
    GL_AT(gl_kv, n_slots), GL_AT(gl_kv, max_blocks), GL_AT(gl_kv, block), GL_AT(gl_kv, n_head_kv),
    GL_AT(gl_kv, type),

    GL_SIZE(gl_attn), GL_AT(gl_attn, kv), GL_AT(gl_attn, cos_t),
    GL_AT(gl_attn, sin_t), GL_AT(gl_attn, n_head), GL_AT(gl_attn, n_head_kv),
    GL_AT(gl_attn, head_dim), GL_AT(gl_attn, v_dim), GL_AT(gl_attn, n_ctx), GL_AT(gl_attn, rot),
    GL_AT(gl_attn, neox), GL_AT(gl_attn, window), GL_AT(gl_attn, scale), GL_AT(gl_attn, softcap),
    GL_AT(gl_attn, sinks),

    GL_SIZE(gl_scratch), GL_AT(gl_scratch, base), GL_AT(gl_scratch, cap), GL_AT(gl_scratch, used),
    GL_AT(gl_scratch, busy),
};

void gl_scratch_free(gl_scratch *s) {
    free(s->base);
    *s = (gl_scratch){0};
}

int64_t gl_features(void) {
    int64_t f = 0;
#ifdef __AVX512F__
    f |= 1;
#endif
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    f |= 2;
#endif
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
    f |= 4;
#endif
#ifdef __AVX512BF16__
    f |= 8;
#endif
#if GL_VNNI512
    f |= 16;
#endif
#if GL_AMX
    f |= 32;
#endif
#if ATTN_BF16
    f |= 64;
#endif
#if ATTN_I8
    f |= 128;
#endif
    if (gl_iq_tiles()) f |= 256; /* IQ2_XXS's and IQ3_XXS's tiles taken */
    return f;
}

int64_t gl_set_amx_rows(int64_t m) {
#if GL_AMX
    static int granted = 0;
    enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 }; /* <asm/prctl.h>, the kernel's */
    if (m > 0 && !granted) { /* the tiles' state, for the whole process */
        if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return -1;
        granted = 1;
    }
    const int64_t old = gl_amx_rows;
    gl_amx_rows = m < 0 ? 0 : m;
    return old;
#else
    (void)m;
    return -1;
#endif
}

/* The calling thread's OpenMP workers given back (libgomp frees its pool; a later parallel region
 * on this thread makes a new one). libgomp counts every pool's workers against the CPUs, and
 * while they outnumber the CPUs every team waits for work by sleeping instead of spinning: a
 * decode step on a second thread (the server's engine thread) then ran at half the speed while
 * the loading thread's idle pool stood. 0 when given back, -1 where the OpenMP runtime cannot. */
/* omp_pause_resource_all (OpenMP 5.0; libgomp since GCC 9), weakly: NULL where the runtime the
 * library binds to lacks it (an asm name, not omp.h's declaration: any compiler's header) */
extern int gl_omp_pause_all(int) __asm__("omp_pause_resource_all") __attribute__((weak));

int64_t gl_release_threads(void) {
    return gl_omp_pause_all != NULL && gl_omp_pause_all(1 /* omp_pause_soft */) == 0 ? 0 : -1;
}

int64_t gl_set_pair_rows(int64_t m) {
#if GL_VNNI512
    const int64_t old = gl_pair_rows;
    gl_pair_rows = m < 1 ? 1 : m;
    return old;
#else
    (void)m;
    return 0;
#endif
}

int64_t gl_alloc_count(void) {
#ifdef GL_COUNT_ALLOC
    return __atomic_load_n(&gl_allocs, __ATOMIC_RELAXED);
#else
    return -1;
#endif
}

int64_t gl_abi_layout(const char **names, int64_t *values, int64_t cap) {
    const int64_t n = (int64_t)(sizeof(layout) / sizeof(layout[0]));
    for (int64_t i = 0; i < n && i < cap; i++) {
        names[i] = layout[i].name;
        values[i] = layout[i].value;
    }
    return n;
}

#include "quant.c"
#include "quant_mm.c"
#include "kquant.c"
#include "kquant_k4.c"
#include "kquant_k16.c"
#include "mxfp4.c"
#include "amx.c"
#include "attn.c"
#include "attn_decode_tiles.c"
#include "attn_decode_q8.c"
#include "attn_decode_bf16.c"
#include "attn_decode.c"
#include "attn_prompt.c"
#include "lora.c"
#include "lora_xa.c"
#include "proj.c"
#include "float.c"
#include "iquant.c"
#include "layer.c"
