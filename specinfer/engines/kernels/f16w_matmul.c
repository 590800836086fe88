/* MatMulF16W: C[..., N] = A[..., K] x W[K, N], A and C float32, W stored as float16 and widened
 * to float32 in registers (exactly: every float16 is a float32), so the product is the float32
 * MatMul of the same numbers while the weights take half the memory traffic.
 *
 * Why: on CPU the LLM's step is bound by reading its weights (ONNX Runtime's MLAS reads them as
 * float32), and a checkpoint saved in float16 holds nothing a float32 copy adds. ONNX Runtime's CPU
 * provider has no float16-weight float32 MatMul on x86, so this is a custom-op library
 * (specinfer/engines/native.py builds it with the system C compiler and loads it).
 *
 * W comes packed in panels of 64 columns, [N / 64][K][64]: a panel's row k is 128 contiguous
 * bytes, read once per block of 6 rows of A. Each output element is summed over k in order, the
 * same whatever M and whatever thread computes it, so a row's result never depends on the other
 * rows of the batch. The panels are shared out over ONNX Runtime's intra-op pool.
 *
 * MatMulBF16 and its three siblings (below) are the same products on bfloat16 weights and
 * activations, for a model asked to compute in bfloat16; MatMulI8 and its siblings on int8 weights
 * and activations, for a model asked to compute in int8.
 *
 * register.c registers it (ort_api.h: the ONNX Runtime C API as used here). */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "ort_api.h"
#include "tree_attention.h"   /* exp_ps, first_lanes */

#define PANEL 64
#define LANES 16

#define ROWS 6
#define AMX_BLOCK 16   /* rows of A a tile of the int8 products by AMX holds */
/* Fewer rows stay on VPDPBUSD. Measured through ONNX Runtime on 2 cores (384 x 2048 from the L2
 * cache; 384 x 32768 from memory): the tile unit 1.3x VNNI's time at 2 rows, even at 5-6, 1.3-1.6x
 * faster at 12-16. (Outside the AVX-512 part: product() reads it on every build.) */
#define AMX_MIN_ROWS 6
#if SIMD_AVX512
/* Rows [0, rows) of A (rows <= ROWS) times one panel: 4 x 16 floats of accumulators per row, so
 * 6 rows hold 24 of the 32 vector registers and each widened weight serves 6 FMAs. */
static inline void panel_rows(const float *A, size_t K, const uint16_t *P, float *C, size_t N, int rows) {
    __m512 acc[ROWS][4];
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    for (size_t k = 0; k < K; k++) {
        const uint16_t *p = P + k * PANEL;
        __m512 b0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        __m512 b1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 16)));
        __m512 b2 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32)));
        __m512 b3 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 48)));
        for (int r = 0; r < rows; r++) {
            __m512 a = _mm512_set1_ps(A[r * K + k]);
            acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(a, b2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(a, b3, acc[r][3]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(C + r * N + 16 * j, acc[r][j]);
}
#else
/* Rows [0, rows) of A times columns [c0, c0 + width) of one panel over k in [k0, k1) (width a
 * multiple of 8, rows x width / 8 accumulators of 8 floats), the sums so far read from C unless k0
 * is 0. AVX2 has 16 vector registers: one row takes the whole panel (8 accumulators), two rows half
 * of it and up to six a quarter (12), so a panel is swept in slices of KC k, each slice's weights
 * read from memory by the first part and from the L1 cache by the others (sweeping the whole panel
 * once a part read its weights from memory up to four times: two rows took twice one row's time).
 * The sums are the same whichever: each output is one chain of FMAs over k from 0 (a float put in C
 * and read back is the same float). */
#define KC 128
#define AHEAD 16   /* the first part of a slice asks for the weights this many k ahead (measured: 16 beat none, 64, 128) */
static inline __attribute__((always_inline)) void panel_part(const float *A, size_t K, const uint16_t *P, float *C,
                                                             size_t N, const int rows, const int width, size_t c0,
                                                             size_t k0, size_t k1) {
    __m256 acc[ROWS][8];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < width / 8; j++)
            acc[r][j] = k0 ? _mm256_loadu_ps(C + r * N + c0 + 8 * j) : _mm256_setzero_ps();
    for (size_t k = k0; k < k1; k++) {
        const uint16_t *p = P + k * PANEL + c0;
        if (c0 == 0) {   /* (a prefetch past the weights' end reads nothing) */
            _mm_prefetch((const char *)(P + (k + AHEAD) * PANEL), _MM_HINT_T0);
            _mm_prefetch((const char *)(P + (k + AHEAD) * PANEL + 32), _MM_HINT_T0);
        }
        __m256 b[8];
        for (int j = 0; j < width / 8; j++) b[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8 * j)));
        for (int r = 0; r < rows; r++) {
            __m256 a = _mm256_broadcast_ss(A + r * K + k);
            for (int j = 0; j < width / 8; j++) acc[r][j] = _mm256_fmadd_ps(a, b[j], acc[r][j]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < width / 8; j++) _mm256_storeu_ps(C + r * N + c0 + 8 * j, acc[r][j]);
}

static inline __attribute__((always_inline)) void panel_rows(const float *A, size_t K, const uint16_t *P, float *C,
                                                             size_t N, const int rows) {
    const int width = rows == 1 ? PANEL : rows == 2 ? PANEL / 2 : PANEL / 4;
    for (size_t k0 = 0; k0 < K || k0 == 0; k0 += KC) {
        size_t k1 = K - k0 < KC ? K : k0 + KC;
        for (int c0 = 0; c0 < PANEL; c0 += width) panel_part(A, K, P, C, N, rows, width, (size_t)c0, k0, k1);
    }
}
#endif

typedef struct {
    const float *A;
    const uint16_t *W;   /* int8 products: the int8 panels */
    float *C;
    size_t M, K, N;
    const uint32_t *pairs;   /* bf16 products: A rounded to bfloat16, two k a word ([M][K2]), else NULL */
    size_t K2;               /* (K + 1) / 2 */
    const uint32_t *quads;   /* int8 products: A quantized, four k a word ([M][K4]), else NULL */
    size_t K4;               /* (K + 3) / 4 */
    const float *row_scale;  /* int8: each row's scale [M] */
    const float *w_scale, *w_sum;   /* int8: each packed column's scale and sum of its int8 weights */
    int vnni;                /* int8: quads for VPDPBUSD ([M][K4], q + 128 a byte), else pairs ([M][K4][2]) */
    int amx;                 /* int8: the quads by the tile unit, their rows padded to a multiple of 16 */
} Product;

/* Rows [0, rows) of A (rows <= ROWS) times one panel, with the row count a constant (unrolled). */
#define BY_ROWS(kernel, rows, ...)                 \
    switch (rows) {                                \
        case 6: kernel(__VA_ARGS__, 6); break;     \
        case 5: kernel(__VA_ARGS__, 5); break;     \
        case 4: kernel(__VA_ARGS__, 4); break;     \
        case 3: kernel(__VA_ARGS__, 3); break;     \
        case 2: kernel(__VA_ARGS__, 2); break;     \
        default: kernel(__VA_ARGS__, 1); break;    \
    }
static void block_rows(const float *A, size_t K, const uint16_t *P, float *C, size_t N, int rows) {
    BY_ROWS(panel_rows, rows, A, K, P, C, N)
}

#if SIMD_AVX512
/* The bfloat16 products (MatMulBF16 and the three ops beside it): A rounded to bfloat16 (to
 * nearest even) and W stored in bfloat16, multiplied and summed in float32 by AVX512-BF16's
 * VDPBF16PS, which takes two k at once: twice the arithmetic rate of float32 FMAs (measured on
 * 2 Zen 4 cores, K 384 x N 2048, one thread: 211-227 GFLOP/s from 4 rows against 106-113 for the
 * float16 weights widened; 89 against 54 for one row). The rounding of the activations is the
 * precision a bfloat16 model has on a GPU; each output is still summed over k in order, the same
 * whatever M, so a row's result never depends on the batch. W comes packed in panels of 64 columns
 * by pairs of k, [N / 64][K2][64][2] (K2 = ceil(K / 2), an odd K's last pair padded with zero).
 * Compiled for AVX512-BF16 whatever the build machine: specinfer/engines/native.py chooses these
 * ops only on a CPU that has it. */
#define BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

BF16 static inline void bf16_panel_rows(const uint32_t *A, size_t K2, const uint16_t *P, float *C, size_t N,
                                        int rows) {
    __m512 acc[ROWS][4];
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    for (size_t k = 0; k < K2; k++) {
        const uint16_t *p = P + k * 2 * PANEL;
        __m512bh b0 = (__m512bh)_mm512_loadu_si512(p);
        __m512bh b1 = (__m512bh)_mm512_loadu_si512(p + 32);
        __m512bh b2 = (__m512bh)_mm512_loadu_si512(p + 64);
        __m512bh b3 = (__m512bh)_mm512_loadu_si512(p + 96);
        for (int r = 0; r < rows; r++) {
            __m512bh a = (__m512bh)_mm512_set1_epi32((int)A[r * K2 + k]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, b2);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], a, b3);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(C + r * N + 16 * j, acc[r][j]);
}

BF16 static void bf16_block_rows(const uint32_t *A, size_t K2, const uint16_t *P, float *C, size_t N, int rows) {
    BY_ROWS(bf16_panel_rows, rows, A, K2, P, C, N)
}

/* Rows of float32 as bfloat16 pairs (round to nearest even, as VCVTNEPS2BF16 rounds), an odd K's
 * last pair padded with zero. */
BF16 static void to_bf16_pairs(const float *A, size_t M, size_t K, uint32_t *out) {
    size_t K2 = (K + 1) / 2;
    for (size_t r = 0; r < M; r++) {
        const float *a = A + r * K;
        uint16_t *o = (uint16_t *)(out + r * K2);
        for (size_t k = 0; k < K; k += LANES) {
            __mmask16 m = first_lanes(K - k);
            __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, a + k));
            _mm256_mask_storeu_epi16(o + k, m, (__m256i)h);
        }
        if (K & 1) o[K] = 0;
    }
}

/* The int8 products (MatMulI8 and the three ops beside it): W quantized per column at packing
 * (native.quantize_columns: w = scale_n q, q in [-127, 127]) and each row of A when the op runs
 * (a = s q, s = max |a| / 127, q = round(a / s) to nearest even), multiplied and summed exactly in
 * int32 by AVX512-VNNI's VPDPBUSD, four k at once: twice the arithmetic rate of the bfloat16
 * products, and half their weight bytes. VPDPBUSD multiplies unsigned by signed bytes, so a row
 * goes in as q + 128 and each column's sum of its weights times 128 comes off after the loop. The
 * result, s scale_n (sum_k q q_w), depends on that row alone, as every product here. W comes
 * packed in panels of 64 columns by quads of k, [N / 64][K4][64][4] (K4 = ceil(K / 4), zero
 * padded); its scales and sums beside it as one float tensor [2, N / 64 x 64]. Compiled for
 * AVX512-VNNI whatever the build machine: specinfer/engines/native.py chooses these ops only on a
 * CPU that has it. */
#define I8 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
/* acc += a . b by VPDPBUSD. Why asm and 24 named accumulators: GCC 12 compiles
 * _mm512_dpbusd_epi32 as a copy of its accumulator and then, short of registers, spills an array
 * of them to the stack every step (the 6-row block ran slower than the bfloat16 one). */
#define DPBUSD(acc, a, b) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b))
#define I8_ZERO(r) __m512i c##r##0 = _mm512_setzero_si512(), c##r##1 = c##r##0, c##r##2 = c##r##0, c##r##3 = c##r##0
#define I8_ROW(r)                                                                     \
    if (r < rows) {                                                                   \
        __m512i a = _mm512_set1_epi32((int)A[r * K4 + k]);                            \
        DPBUSD(c##r##0, a, b0);                                                       \
        DPBUSD(c##r##1, a, b1);                                                       \
        DPBUSD(c##r##2, a, b2);                                                       \
        DPBUSD(c##r##3, a, b3);                                                       \
    }
/* The float epilogue of an int8 panel, one for every kernel that sums its quads (VPDPBUSD's, the
 * tile unit's), so that their outputs are the same operations on the same sums: the 64 columns'
 * scales and 128 times their sums, then a row's 64 outputs from its int32 sums, (acc - 128 sum) as
 * float, times the row's scale times the column's. (AVX-512F only: inlined into either kernel.) */
#define I8_EPILOGUE static inline __attribute__((target("avx512f"), always_inline))
I8_EPILOGUE void i8_columns(const float *scale, const float *sum, __m512 scale_of[4], __m512i offset[4]) {
    for (int j = 0; j < 4; j++) {
        scale_of[j] = _mm512_loadu_ps(scale + 16 * j);
        offset[j] = _mm512_slli_epi32(_mm512_cvtps_epi32(_mm512_loadu_ps(sum + 16 * j)), 7);
    }
}
I8_EPILOGUE void i8_store_row(float *C, const __m512i acc[4], float row_scale, const __m512 scale_of[4],
                              const __m512i offset[4]) {
    __m512 rs = _mm512_set1_ps(row_scale);
    for (int j = 0; j < 4; j++)
        _mm512_storeu_ps(C + 16 * j, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[j], offset[j])),
                                                   _mm512_mul_ps(rs, scale_of[j])));
}
#define I8_STORE(r)                                                                                \
    if (r < rows) {                                                                                \
        __m512i acc[4] = {c##r##0, c##r##1, c##r##2, c##r##3};                                     \
        i8_store_row(C + r * N, acc, row_scale[r], scale_of, offset);                              \
    }

I8 static inline __attribute__((always_inline)) void i8_panel_rows(const uint32_t *A, size_t K4, const int8_t *P, const float *scale,
                                    const float *sum, const float *row_scale, float *C, size_t N, int rows) {
    I8_ZERO(0); I8_ZERO(1); I8_ZERO(2); I8_ZERO(3); I8_ZERO(4); I8_ZERO(5);
    for (size_t k = 0; k < K4; k++) {
        const int8_t *p = P + k * 4 * PANEL;
        __m512i b0 = _mm512_loadu_si512(p), b1 = _mm512_loadu_si512(p + 64);
        __m512i b2 = _mm512_loadu_si512(p + 128), b3 = _mm512_loadu_si512(p + 192);
        I8_ROW(0) I8_ROW(1) I8_ROW(2) I8_ROW(3) I8_ROW(4) I8_ROW(5)
    }
    __m512 scale_of[4];
    __m512i offset[4];
    i8_columns(scale, sum, scale_of, offset);
    I8_STORE(0) I8_STORE(1) I8_STORE(2) I8_STORE(3) I8_STORE(4) I8_STORE(5)
}

I8 static void i8_block_rows(const uint32_t *A, size_t K4, const int8_t *P, const float *scale, const float *sum,
                             const float *row_scale, float *C, size_t N, int rows) {
    BY_ROWS(i8_panel_rows, rows, A, K4, P, scale, sum, row_scale, C, N)
}

/* Rows of float32 quantized as above, q + 128 a byte, four k a word; K padded to a multiple of 4
 * (the padding meets zero weights). A row of zeros (or one with no finite maximum) has scale 0. */
I8 static void to_u8_quads(const float *A, size_t M, size_t K, uint32_t *out, float *row_scale) {
    size_t K4 = (K + 3) / 4;
    for (size_t r = 0; r < M; r++) {
        const float *a = A + r * K;
        uint8_t *o = (uint8_t *)(out + r * K4);
        __m512 most = _mm512_setzero_ps();
        for (size_t k = 0; k < K; k += LANES)
            most = _mm512_max_ps(most, _mm512_abs_ps(_mm512_maskz_loadu_ps(first_lanes(K - k), a + k)));
        float amax = _mm512_reduce_max_ps(most);
        float inverse = amax > 0.0f && amax <= 3.0e38f ? 127.0f / amax : 0.0f;
        row_scale[r] = inverse > 0.0f ? amax / 127.0f : 0.0f;
        __m512 by = _mm512_set1_ps(inverse);
        __m512i half = _mm512_set1_epi32(128);
        for (size_t k = 0; k < K; k += LANES) {
            __mmask16 m = first_lanes(K - k);
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, a + k), by));
            _mm_mask_storeu_epi8(o + k, m, _mm512_cvtepi32_epi8(_mm512_add_epi32(q, half)));
        }
        for (size_t k = K; k < 4 * K4; k++) o[k] = 128;
    }
}

/* The int8 products by AMX (Intel's tile matrix unit, AMX-INT8, from Sapphire Rapids): TDPBUSD
 * multiplies a tile of 16 rows x 16 quads of A (the same q + 128 bytes VPDPBUSD takes) by a tile
 * of 16 quads x 16 columns of W (the same panels: a quad's 16 columns are 64 contiguous bytes, the
 * next quad 256 bytes on) and adds the exact int32 sums into a tile of 16 x 16, 16,384
 * multiply-adds an instruction (a panel of 16 rows from the L2 cache, one core: 385 ns against
 * ~1,080 for VPDPBUSD's; from memory both ~1.1 us, about one row's time). The sums are exact
 * integers, so each output is the one the VNNI kernel gives, bit for bit (the same scales, the
 * same float operations after), and a row's result still depends on that row alone whichever
 * kernel a product of M rows takes. A tile holds 16 rows, so A's quads come padded to a multiple
 * of 16 rows (the padding's outputs are never stored). Linux hands out the tile registers' state
 * only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM), asked once by amx_ready. Tiles:
 * 0-3 the panel's 64 columns of sums, 4 and 5 A and W over 16 quads, 6 and 7 the same over the
 * quads left past the last 16 (K4 % 16). */
#define AMX __attribute__((target("avx512f,avx512bw,avx512vl,amx-tile,amx-int8")))
#define AMX_QUADS 16

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileConfig;

/* Whether the tile unit may run here: the CPU has AMX-INT8 and Linux gave this process its state. */
static int amx_ready(void) {
    static int ready = -1;   /* a race only asks twice: the answer is the same */
    if (ready < 0) {
        long granted = -1;
        if (__builtin_cpu_supports("amx-int8")) granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */);
        const char *off = getenv("SPECINFER_AMX");   /* "0": VNNI only, to compare the two */
        ready = granted == 0 && !(off && strcmp(off, "0") == 0);
    }
    return ready;
}

/* The tile shapes for a product over K4 quads, loaded only if the thread's tiles are shaped otherwise
 * (LDTILECFG costs ~70 ns, a quarter of a small panel's time; reading the shapes back ~3). */
AMX static void amx_configure(size_t K4) {
    TileConfig config = {.palette = 1}, now;
    for (int t = 0; t < 6; t++) config.rows[t] = 16, config.colsb[t] = 64;
    size_t tail = K4 % AMX_QUADS;
    if (tail) {
        config.rows[6] = 16, config.colsb[6] = (uint16_t)(4 * tail);   /* A: 16 rows x tail quads */
        config.rows[7] = (uint8_t)tail, config.colsb[7] = 64;           /* W: tail quads x 16 columns */
    }
    _tile_storeconfig(&now);
    if (memcmp(&now, &config, sizeof config)) _tile_loadconfig(&config);
}

/* Rows [0, rows) of A (its quads padded to 16 rows) times one int8 panel, as i8_panel_rows. */
AMX static void i8_amx_panel_rows(const uint32_t *A, size_t K4, const int8_t *P, const float *scale, const float *sum,
                                  const float *row_scale, float *C, size_t N, int rows) {
    int32_t S[AMX_BLOCK * PANEL] __attribute__((aligned(64)));
    const size_t a_stride = 4 * K4, w_stride = 4 * PANEL, s_stride = 4 * PANEL;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    /* A's quads from q on into tile a, then each 16 columns' weights into tile w and onto their sums
     * (tile numbers are immediates: a macro, not a function) */
#define AMX_QUADS_TIMES_PANEL(a, w)                                          \
    do {                                                                     \
        const int8_t *p = P + q * 4 * PANEL;                                 \
        _tile_loadd(a, A + q, a_stride);                                     \
        _tile_loadd(w, p, w_stride); _tile_dpbusd(0, a, w);                  \
        _tile_loadd(w, p + 64, w_stride); _tile_dpbusd(1, a, w);             \
        _tile_loadd(w, p + 128, w_stride); _tile_dpbusd(2, a, w);            \
        _tile_loadd(w, p + 192, w_stride); _tile_dpbusd(3, a, w);            \
    } while (0)
    size_t q = 0;
    for (; q + AMX_QUADS <= K4; q += AMX_QUADS) AMX_QUADS_TIMES_PANEL(4, 5);
    if (q < K4) AMX_QUADS_TIMES_PANEL(6, 7);   /* the quads past the last 16 */
#undef AMX_QUADS_TIMES_PANEL
    _tile_stored(0, S, s_stride); _tile_stored(1, S + 16, s_stride);
    _tile_stored(2, S + 32, s_stride); _tile_stored(3, S + 48, s_stride);
    __m512 scale_of[4];
    __m512i offset[4];   /* as i8_panel_rows: the same epilogue on the same sums */
    i8_columns(scale, sum, scale_of, offset);
    for (int r = 0; r < rows; r++) {
        __m512i acc[4];
        for (int j = 0; j < 4; j++) acc[j] = _mm512_load_si512(S + r * PANEL + 16 * j);
        i8_store_row(C + r * N, acc, row_scale[r], scale_of, offset);
    }
}

#endif

/* The int8 products where the CPU has no AVX512-VNNI (AVX2, and AVX-512 without VNNI): the same
 * numbers, the same exact integer sums, so the same outputs bit for bit. VPMADDWD multiplies pairs
 * of int16 and adds each pair exactly into an int32: a weight quad (four k of a column, the panels
 * as VPDPBUSD reads them) is split into its even k and its odd k, sign-extended to int16, and each
 * row's quantized quad comes as the same two pairs ((q0, q2), (q1, q3): to_s16_pairs), no offset
 * to take off. One row takes a whole panel (8 accumulators of 8 columns), two rows half of it,
 * three to six 8 columns at a time, over slices of KC4 quads (their weights from memory once, from
 * L1 for the other parts), the partial sums in an int32 scratch between slices. */
#define KC4 32
#define AHEAD4 4   /* quads the first part asks for ahead */
static inline __attribute__((always_inline)) void i8x_part(const uint32_t *A, size_t K4, const int8_t *P, int32_t *S,
                                                           const int rows, const int width, size_t c0, size_t q0,
                                                           size_t q1) {
    __m256i acc[ROWS][8];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < width / 8; j++)
            acc[r][j] = q0 ? _mm256_loadu_si256((const __m256i *)(S + r * PANEL + c0 + 8 * j)) : _mm256_setzero_si256();
    for (size_t q = q0; q < q1; q++) {
        const int8_t *p = P + q * 4 * PANEL + 4 * c0;
        if (c0 == 0)
            for (int line = 0; line < 4; line++) _mm_prefetch((const char *)(P + (q + AHEAD4) * 4 * PANEL + 64 * line), _MM_HINT_T0);
        for (int j = 0; j < width / 8; j++) {
            __m256i w = _mm256_loadu_si256((const __m256i *)(p + 32 * j));
            __m256i even = _mm256_srai_epi16(_mm256_slli_epi16(w, 8), 8), odd = _mm256_srai_epi16(w, 8);
            for (int r = 0; r < rows; r++) {
                __m256i a_even = _mm256_set1_epi32((int)A[(r * K4 + q) * 2]), a_odd = _mm256_set1_epi32((int)A[(r * K4 + q) * 2 + 1]);
                acc[r][j] = _mm256_add_epi32(acc[r][j], _mm256_add_epi32(_mm256_madd_epi16(a_even, even),
                                                                         _mm256_madd_epi16(a_odd, odd)));
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < width / 8; j++) _mm256_storeu_si256((__m256i *)(S + r * PANEL + c0 + 8 * j), acc[r][j]);
}

/* Rows [0, rows) of the quantized A times one int8 panel: C = (exact sum) x (row scale x column
 * scale), in float32 as the VNNI kernel has it. */
static inline __attribute__((always_inline)) void i8x_panel_rows(const uint32_t *A, size_t K4, const int8_t *P,
                                                                 const float *scale, const float *row_scale, float *C,
                                                                 size_t N, const int rows) {
    int32_t S[ROWS * PANEL] __attribute__((aligned(32)));
    const int width = rows == 1 ? PANEL : rows == 2 ? PANEL / 2 : 8;
    for (size_t q0 = 0; q0 < K4 || q0 == 0; q0 += KC4) {
        size_t q1 = K4 - q0 < KC4 ? K4 : q0 + KC4;
        for (int c0 = 0; c0 < PANEL; c0 += width) i8x_part(A, K4, P, S, rows, width, (size_t)c0, q0, q1);
    }
    for (int r = 0; r < rows; r++) {
        __m256 rs = _mm256_set1_ps(row_scale[r]);
        for (int j = 0; j < PANEL; j += 8)
            _mm256_storeu_ps(C + r * N + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_load_si256((const __m256i *)(S + r * PANEL + j))),
                                                          _mm256_mul_ps(rs, _mm256_loadu_ps(scale + j))));
    }
}

static void i8x_block_rows(const uint32_t *A, size_t K4, const int8_t *P, const float *scale, const float *row_scale,
                           float *C, size_t N, int rows) {
    BY_ROWS(i8x_panel_rows, rows, A, K4, P, scale, row_scale, C, N)
}

/* Rows of float32 quantized as to_u8_quads quantizes them (the same scale, the same rounding), each
 * quad of k as two words of int16 pairs, (q0, q2) then (q1, q3); K padded with zeros. */
static void to_s16_pairs(const float *A, size_t M, size_t K, uint32_t *out, float *row_scale) {
    size_t K4 = (K + 3) / 4;
    for (size_t r = 0; r < M; r++) {
        const float *a = A + r * K;
        vf most = vf_zero();
        for (size_t k = 0; k < K; k += LANES) most = vf_max(most, vf_abs(vf_loadm(first_lanes(K - k), a + k)));
        float amax = vf_reduce_max(most);
        float inverse = amax > 0.0f && amax <= 3.0e38f ? 127.0f / amax : 0.0f;
        row_scale[r] = inverse > 0.0f ? amax / 127.0f : 0.0f;
        uint32_t *o = out + r * K4 * 2;
        for (size_t q = 0; q < K4; q++) {
            int32_t v[4];
            for (int i = 0; i < 4; i++) v[i] = 4 * q + i < K ? (int32_t)lrintf(a[4 * q + i] * inverse) : 0;
            o[2 * q] = (uint16_t)v[0] | (uint32_t)(uint16_t)v[2] << 16;
            o[2 * q + 1] = (uint16_t)v[1] | (uint32_t)(uint16_t)v[3] << 16;
        }
    }
}

/* Whether the int8 products of AMX_MIN_ROWS rows or more may take the tile unit here. */
static int has_amx(void) {
#if SIMD_AVX512
    return amx_ready();
#else
    return 0;
#endif
}

/* Whether the int8 products may take VPDPBUSD here. */
static int has_vnni(void) {
#if SIMD_AVX512
    return __builtin_cpu_supports("avx512vnni");
#else
    return 0;
#endif
}

/* For native.int8_by_tiles: whether int8 products of AMX_MIN_ROWS rows or more take the tile unit. */
__attribute__((visibility("default"))) int specinfer_int8_tiles(void) { return has_vnni() && has_amx(); }

/* Rows [m, m + rows) of the job's A times panel ``panel``, into C (``ldc`` floats a row). */
static void panel_block(const Product *job, size_t panel, size_t m, float *C, size_t ldc, int rows) {
    const int8_t *P8 = (const int8_t *)job->W + panel * job->K4 * 4 * PANEL;
#if SIMD_AVX512
    if (job->amx)
        i8_amx_panel_rows(job->quads + m * job->K4, job->K4, P8, job->w_scale + panel * PANEL, job->w_sum + panel * PANEL,
                          job->row_scale + m, C, ldc, rows);
    else if (job->quads && job->vnni)
        i8_block_rows(job->quads + m * job->K4, job->K4, P8, job->w_scale + panel * PANEL, job->w_sum + panel * PANEL,
                      job->row_scale + m, C, ldc, rows);
    else if (job->pairs)
        bf16_block_rows(job->pairs + m * job->K2, job->K2, job->W + panel * job->K2 * 2 * PANEL, C, ldc, rows);
    else
#endif
    if (job->quads)
        i8x_block_rows(job->quads + m * job->K4 * 2, job->K4, P8, job->w_scale + panel * PANEL, job->row_scale + m, C,
                       ldc, rows);
    else
        block_rows(job->A + m * job->K, job->K, job->W + panel * job->K * PANEL, C, ldc, rows);
}

/* Rows of A a block takes: the tile unit's 16, else the vector kernels' ROWS. */
static size_t block_of(const Product *job) { return job->amx ? AMX_BLOCK : ROWS; }

static int rows_from(const Product *job, size_t m) {
    size_t block = block_of(job);
    return job->M - m >= block ? (int)block : (int)(job->M - m);
}

/* Before a task's first block: the tile unit's shapes for this product (tile state is a thread's). */
static void begin_panel(const Product *job) {
#if SIMD_AVX512
    if (job->amx) amx_configure(job->K4);
#else
    (void)job;
#endif
}

static void run_panel(void *data, size_t panel) {
    const Product *job = (const Product *)data;
    begin_panel(job);
    for (size_t m = 0; m < job->M; m += block_of(job))
        panel_block(job, panel, m, job->C + m * job->N + panel * PANEL, job->N, rows_from(job, m));
}

/* out = (x / sqrt(mean(x^2) + eps)) * gamma for each row x of the sum input + skip, which goes to
 * sum: SkipSimplifiedLayerNormalization's two outputs, in ONNX Runtime's arithmetic (float, the
 * square sum then a division by the root) with the square sum in 16 lanes. A row's result depends
 * on that row alone. */
typedef struct {
    const float *input, *skip, *gamma;
    float *sum, *out;
    size_t K;
    float eps;
} Norm;

static void norm_row(void *data, size_t r) {
    const Norm *n = (const Norm *)data;
    size_t K = n->K;
    const float *a = n->input + r * K, *s = n->skip + r * K;
    float *x = n->sum + r * K, *y = n->out + r * K;
    vf squares = vf_zero();
    for (size_t k = 0; k < K; k += LANES) {
        vmask m = first_lanes(K - k);
        vf v = vf_add(vf_loadm(m, a + k), vf_loadm(m, s + k));
        vf_storem(x + k, m, v);
        squares = vf_fmadd(v, v, squares);
    }
    float mean = vf_reduce_add(squares) / (float)K + n->eps;
    vf root = vf_set1(_mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(mean))));
    for (size_t k = 0; k < K; k += LANES) {
        vmask m = first_lanes(K - k);
        vf v = vf_div(vf_loadm(m, x + k), root);
        vf_storem(y + k, m, vf_mul(v, vf_loadm(m, n->gamma + k)));
    }
}

/* Rows below this are normalized on the calling thread: the pool's hand-out costs more. */
#define NORM_POOL_ROWS 32

/* The weights' types the products take. */
enum { WEIGHTS_F16, WEIGHTS_BF16, WEIGHTS_I8 };

/* A x W on the pool, a task a panel (``task``), each panel giving ``columns`` of the output. A is
 * input 0, W input 1; or, ``normed``, A is the RMSNorm of input 0 + input 1 (skip) with gamma input
 * 2 and epsilon input 3, W input 4, and input 0 + input 1 goes to output 1. ``weights``: W is packed
 * in float16, or in bfloat16 pairs and A is rounded to them first, or in int8 quads with its scales
 * and sums the input after it and A is quantized first (the norm, if any, in float32 before). */
static OrtStatus *product(OrtKernelContext *ctx, void (*task)(void *, size_t), size_t columns, int normed,
                          int weights, const char *name) {
    const OrtValue *a = NULL, *w = NULL;
    size_t w_input = normed ? 4 : 1;
    CALL(KernelContext_GetInput, GetInputFn)(ctx, 0, &a);
    CALL(KernelContext_GetInput, GetInputFn)(ctx, w_input, &w);
    int64_t dims[8], wdims[3];
    size_t rank = shape_of(a, dims, 8);
    shape_of(w, wdims, 3);   /* [panels, K, 64], [panels, K2, 128] or [panels, K4, 256]: checked when the graph was written */
    size_t M = 1;
    for (size_t i = 0; i + 1 < rank; i++) M *= (size_t)dims[i];
    size_t K = rank ? (size_t)dims[rank - 1] : 0;
    Product job = {data_of(a), data_of(w), NULL, M, K, (size_t)wdims[0] * columns, NULL, (K + 1) / 2,
                   NULL, (K + 3) / 4, NULL, NULL, NULL, 0};
    size_t packed_k = weights == WEIGHTS_I8 ? job.K4 : weights == WEIGHTS_BF16 ? job.K2 : K;
    if (rank == 0 || packed_k != (size_t)wdims[1])
        return op_error(name, "the input's last axis is not the weight's K");
    if (weights == WEIGHTS_I8) {
        const OrtValue *scales = NULL;
        int64_t sdims[2];
        CALL(KernelContext_GetInput, GetInputFn)(ctx, w_input + 1, &scales);
        if (shape_of(scales, sdims, 2) != 2 || sdims[0] != 2 || sdims[1] != wdims[0] * PANEL)
            return op_error(name, "the weight's scales must be [2, its packed columns]");
        job.w_scale = data_of(scales);
        job.w_sum = job.w_scale + sdims[1];
    }
    float *scratch = NULL;
    uint32_t *rounded = NULL;
    if (normed) {
        const OrtValue *skip = NULL, *gamma = NULL, *eps = NULL;
        CALL(KernelContext_GetInput, GetInputFn)(ctx, 1, &skip);
        CALL(KernelContext_GetInput, GetInputFn)(ctx, 2, &gamma);
        CALL(KernelContext_GetInput, GetInputFn)(ctx, 3, &eps);
        int64_t sdims[8], gdims[2];
        if (shape_of(skip, sdims, 8) != rank || memcmp(sdims, dims, rank * sizeof dims[0]) ||
            shape_of(gamma, gdims, 2) != 1 || (size_t)gdims[0] != job.K)
            return op_error(name, "skip must have the input's shape and gamma [K]");
        OrtValue *sum = NULL;
        CALL(KernelContext_GetOutput, GetOutputFn)(ctx, 1, dims, rank, &sum);
        scratch = malloc(M * job.K * sizeof(float));
        if (scratch == NULL) return op_error(name, "out of memory for the normalized rows");
        Norm norm = {data_of(a), data_of(skip), data_of(gamma), data_of(sum), scratch, job.K,
                     *(const float *)data_of(eps)};
        if (M >= NORM_POOL_ROWS)
            CALL(KernelContext_ParallelFor, ParallelForFn)(ctx, norm_row, M, 0, &norm);
        else
            for (size_t r = 0; r < M; r++) norm_row(&norm, r);
        job.A = scratch;
    }
#if !SIMD_AVX512
    if (weights == WEIGHTS_BF16) {   /* native.py writes these ops only where the CPU has the instructions */
        free(scratch);
        return op_error(name, "bfloat16 products need a build for AVX-512");
    }
#endif
    if (weights != WEIGHTS_F16) {
        /* int8: the rows' quads (VNNI's, or its pairs: twice the words), then their scales */
        job.vnni = weights == WEIGHTS_I8 && has_vnni();
        job.amx = job.vnni && M >= AMX_MIN_ROWS && has_amx();
        size_t quad_rows = job.amx ? (M + AMX_BLOCK - 1) / AMX_BLOCK * AMX_BLOCK : M;
        size_t quad_words = job.vnni ? quad_rows * job.K4 : 2 * M * job.K4;
        size_t words = weights == WEIGHTS_I8 ? quad_words + M : M * job.K2;
        rounded = malloc(words * sizeof(uint32_t));
        if (rounded == NULL) {
            free(scratch);
            return op_error(name, "out of memory for the rows in bfloat16 or int8");
        }
        if (weights == WEIGHTS_I8) {
            float *row_scale = (float *)(rounded + quad_words);
#if SIMD_AVX512
            if (job.vnni) to_u8_quads(job.A, M, job.K, rounded, row_scale); else
#endif
            to_s16_pairs(job.A, M, job.K, rounded, row_scale);
            memset(rounded + M * job.K4, 0, (quad_rows - M) * job.K4 * sizeof(uint32_t));   /* a tile's rows past M */
            job.quads = rounded;
            job.row_scale = row_scale;
        }
#if SIMD_AVX512
        else {
            to_bf16_pairs(job.A, M, job.K, rounded);
            job.pairs = rounded;
        }
#endif
    }
    dims[rank - 1] = (int64_t)job.N;
    OrtValue *c = NULL;
    CALL(KernelContext_GetOutput, GetOutputFn)(ctx, 0, dims, rank, &c);
    job.C = data_of(c);
    if (M > 0) CALL(KernelContext_ParallelFor, ParallelForFn)(ctx, task, (size_t)wdims[0], 0, &job);
    free(rounded);
    free(scratch);
    return NULL;
}

/* MatMulF16WSwiGLU: the MLP's gate and up projections and its activation in one op,
 * C[..., I] = silu(A x Wg) * (A x Wu), for the lowering's Split of A x [Wg | Wu], Sigmoid, Mul and
 * Mul (3 kernels a layer fewer, and the [.., 2 I] product never written). W comes packed as for
 * MatMulF16W, its panel t holding Wg's columns 32 t .. 32 t + 31 then Wu's same columns
 * ([2 I / 64][K][64]): a panel's product gives 32 outputs, and the panels are shared out over the
 * pool as MatMulF16W's are (panels of two whole 64-column halves made half as many tasks, and the
 * one-token step 6% slower). Each product is MatMulF16W's, sum for sum; silu(g) = g sigmoid(g),
 * sigmoid(g) = 1 / (1 + e^-g) computed as e / (1 + e) with e = e^g where g < 0 (exp_ps takes
 * x <= 0 only): ~2 ulp. */
static inline vf silu_times(vf g, vf u) {
    vf e = exp_ps(vf_sub(vf_zero(), vf_abs(g)));   /* e^-|g| */
    vf one = vf_set1(1.0f);
    vmask negative = vf_lt(g, vf_zero());
    vf sigmoid = vf_div(vf_blend(negative, one, e), vf_add(one, e));
    return vf_mul(vf_mul(g, sigmoid), u);
}

static void run_swiglu_panel(void *data, size_t panel) {
    const Product *job = (const Product *)data;
    float both[AMX_BLOCK * PANEL] __attribute__((aligned(64)));   /* rows x (32 gate, 32 up) */
    begin_panel(job);
    for (size_t m = 0; m < job->M; m += block_of(job)) {
        int rows = rows_from(job, m);
        panel_block(job, panel, m, both, PANEL, rows);
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < PANEL / 2; j += LANES)
                vf_store(job->C + (m + r) * job->N + panel * (PANEL / 2) + j,
                         silu_times(vf_load(both + r * PANEL + j), vf_load(both + r * PANEL + PANEL / 2 + j)));
    }
}

/* The twelve ops: MatMulF16W and MatMulF16WSwiGLU, each with the RMSNorm before it
 * (SkipRMSNormMatMulF16W, SkipRMSNormMatMulF16WSwiGLU: inputs x, skip, gamma [K], epsilon [1], W;
 * outputs the product of RMSNorm(x + skip) * gamma and x + skip), and the same four on bfloat16
 * (MatMulBF16, ...) and on int8 (MatMulI8, ...: W's scales and sums an input after W). The norm
 * op they replace, SkipSimplifiedLayerNormalization, was 12 kernels a step of the embedded LLM:
 * without them the step is 1-5% faster (ONNX Runtime costs ~0.35 us a kernel, ~1 us more with a
 * pool hand-off). */
static void compute_v1(void *kernel, OrtKernelContext *ctx) { (void)kernel; (void)ctx; }   /* never called: V2 is set */
static int output_type(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return TYPE_FLOAT; }
static size_t outputs(const OrtCustomOp *op) { (void)op; return 1; }
static size_t normed_outputs(const OrtCustomOp *op) { (void)op; return 2; }
/* Inputs: A then W (int8: then W's scales and sums); normed: x, skip, gamma, epsilon, then W (and
 * its scales). Every input float32 but W. */
#define INPUTS(kind, w_type, n)                                                                             \
    static int kind##_input_type(const OrtCustomOp *op, size_t i) { (void)op; return i == 1 ? w_type : TYPE_FLOAT; } \
    static int kind##_normed_input_type(const OrtCustomOp *op, size_t i) { (void)op; return i == 4 ? w_type : TYPE_FLOAT; } \
    static size_t kind##_inputs(const OrtCustomOp *op) { (void)op; return n; }                             \
    static size_t kind##_normed_inputs(const OrtCustomOp *op) { (void)op; return n + 3; }

#define F16W_OP(name_fn, in_type, n_in, n_out, compute_fn)                                                         \
    {API_VERSION, stateless_kernel, name_fn, op_cpu, in_type, n_in, output_type, n_out, compute_v1, op_destroy,  \
     op_required, op_required, op_default_memory, op_arity, op_homogeneous, op_arity, op_homogeneous,            \
     stateless_kernel_v2, compute_fn, NULL, op_start_version, op_end_version, NULL, NULL, NULL, NULL}

/* One op: its compute function (``product`` with its task, columns, norm and weights' type), its
 * name and the OrtCustomOp ``var`` register.c adds. */
#define PRODUCT_OP(var, fn, name, task, columns, normed, weights, in_type, n_in, n_out)                        \
    static OrtStatus *fn(void *k, OrtKernelContext *ctx) {                                                  \
        (void)k;                                                                                           \
        return product(ctx, task, columns, normed, weights, name);                                         \
    }                                                                                                      \
    static const char *fn##_name(const OrtCustomOp *op) { (void)op; return name; }                          \
    OrtCustomOp var = F16W_OP(fn##_name, in_type, n_in, n_out, fn);

/* The four ops of one weights' type. */
#define PRODUCT_OPS(kind, op, weights, w_type, n_in)                                                              \
    INPUTS(kind, w_type, n_in)                                                                                    \
    PRODUCT_OP(matmul_##kind##_op, compute_##kind, op, run_panel, PANEL, 0, weights, kind##_input_type,           \
               kind##_inputs, outputs)                                                                            \
    PRODUCT_OP(matmul_##kind##_swiglu_op, compute_##kind##_swiglu, op "SwiGLU", run_swiglu_panel, PANEL / 2, 0,    \
               weights, kind##_input_type, kind##_inputs, outputs)                                                \
    PRODUCT_OP(normed_matmul_##kind##_op, compute_##kind##_normed, "SkipRMSNorm" op, run_panel, PANEL, 1, weights, \
               kind##_normed_input_type, kind##_normed_inputs, normed_outputs)                                    \
    PRODUCT_OP(normed_matmul_##kind##_swiglu_op, compute_##kind##_normed_swiglu, "SkipRMSNorm" op "SwiGLU",         \
               run_swiglu_panel, PANEL / 2, 1, weights, kind##_normed_input_type, kind##_normed_inputs, normed_outputs)

PRODUCT_OPS(f16w, "MatMulF16W", WEIGHTS_F16, TYPE_FLOAT16, 2)
PRODUCT_OPS(bf16, "MatMulBF16", WEIGHTS_BF16, TYPE_BFLOAT16, 2)
PRODUCT_OPS(i8, "MatMulI8", WEIGHTS_I8, TYPE_INT8, 3)
