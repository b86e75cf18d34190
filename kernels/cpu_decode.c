/* Fused paged decode attention for CPU float32: one query token per sequence, K/V read in place through the block
 * table (no gather), one pass over each K/V row with an online softmax.
 *
 * Layout (kernels/__init__.py): k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim], head_dim
 * contiguous; q and out [num_seqs, num_heads, head_dim], head_dim contiguous. The G = num_heads / num_kv_heads query
 * heads of a KV head are heads kvh * G .. kvh * G + G - 1, and they share every K/V row read.
 *
 * Online softmax: Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; the tile-wise rescaling of
 * the output accumulator is FlashAttention's (Dao et al. 2022, alg. 1; FlashAttention-2, Dao 2023, sec. 3.1). Scores
 * of one block (a tile of up to TILE tokens) are computed first, then the running max m, the normalizer l and the
 * accumulator acc are rescaled once per tile by exp(m_old - m_new).
 *
 * Memory, not arithmetic, bounds decode: each work item reads a sequence's blocks front to back (all of its kv heads
 * per block) and prefetches the next block of the table while it computes on the current one.
 *
 * C99 + OpenMP (plus the GCC/Clang builtins __attribute__ and __builtin_prefetch), no torch headers: compiled on
 * first use by kernels/cpu_decode.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define TILE 64 /* tokens per score tile, a multiple of VEC */
#define VEC 16  /* floats per vector (AVX-512); exp and max run over whole vectors */

static inline __attribute__((always_inline)) float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline __attribute__((always_inline)) void axpy(float *restrict y, float a, const float *restrict x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

/* x[i] = exp(x[i] - shift) for x[i] <= shift, vectorizable: y = k ln2 + r with |r| <= ln2 / 2, exp(r) by Cephes
 * expf's degree-6 polynomial (relative error about 2e-7), 2^k written into the exponent bits. y below -87 (and -inf)
 * gives about 1e-38 instead of 0. */
static __attribute__((noinline)) void exp_shifted(float *restrict x, float shift, int64_t n) {
    /* Three simple loops, not one: gcc 12 vectorizes each of them but not the fused loop (its clamp on a computed
     * value becomes a branch). noinline keeps x a plain pointer (not a row of the caller's variable-length array). */
    int32_t bits[TILE];
    float two_k[TILE];
    for (int64_t i = 0; i < n; i++) {
        float y = x[i] - shift;
        x[i] = y < -87.0f ? -87.0f : y;
    }
    for (int64_t i = 0; i < n; i++) {
        float y = x[i];
        int32_t k = (int32_t)(y * 1.44269504088896341f + (y < 0.0f ? -0.5f : 0.5f)); /* round(y / ln2) */
        float kf = (float)k;
        float r = y - kf * 0.693359375f + kf * 2.12194440e-4f; /* y - k ln2 in two parts (Cody-Waite) */
        float p = 1.9875691500e-4f;
        p = p * r + 1.3981999507e-3f;
        p = p * r + 8.3334519073e-3f;
        p = p * r + 4.1665795894e-2f;
        p = p * r + 1.6666665459e-1f;
        p = p * r + 5.0000001201e-1f;
        x[i] = p * r * r + r + 1.0f;
        bits[i] = (k + 127) << 23;
    }
    memcpy(two_k, bits, sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) x[i] *= two_k[i];
}

static inline __attribute__((always_inline)) void prefetch_row(const float *row, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(row + i);
}

static inline __attribute__((always_inline)) void scal(float *restrict y, float a, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] *= a;
}

/* One sequence, kv heads h0 .. h1 - 1 (rows = (h1 - h0) * group query rows, row r = (h - h0) * group + g, query
 * head h * group + g). Blocks are visited in table order and, inside a block, head after head, so a block's bytes
 * are read front to back while they are hot. Returns 1 if the block table names a block outside [0, num_blocks). */
static inline __attribute__((always_inline)) int attend_seq(
    const float *restrict q, int64_t q_sh, const float *restrict k_cache, const float *restrict v_cache, int64_t c_sb,
    int64_t c_st, int64_t c_sh, const int64_t *restrict table, int64_t seq_len, int64_t num_blocks,
    int64_t block_size, int64_t h0, int64_t h1, int64_t group, int64_t head_dim, float scale, float *restrict out,
    int64_t o_sh) {
    int64_t rows = (h1 - h0) * group;
    /* 1-D arrays indexed by hand: gcc 12 does not vectorize loops over rows of 2-D variable-length arrays. */
    float qs[rows * head_dim], acc[rows * head_dim], s[rows * TILE], m[rows], l[rows];
    for (int64_t r = 0; r < rows; r++) {
        const float *qr = q + (h0 * group + r) * q_sh;
        for (int64_t i = 0; i < head_dim; i++) qs[r * head_dim + i] = qr[i] * scale;
        memset(acc + r * head_dim, 0, sizeof(float) * head_dim);
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    for (int64_t start = 0; start < seq_len; start += block_size) {
        int64_t block = table[start / block_size];
        if (block < 0 || block >= num_blocks) return 1;
        int64_t in_block = seq_len - start < block_size ? seq_len - start : block_size;
        /* Block ids are scattered, so the hardware prefetcher cannot guess the next block: each row read below asks
         * for the same row of the next block. */
        const float *next_k = NULL, *next_v = NULL;
        int64_t next_len = 0;
        if (start + block_size < seq_len) {
            int64_t next = table[start / block_size + 1];
            if (next >= 0 && next < num_blocks) {
                next_k = k_cache + next * c_sb;
                next_v = v_cache + next * c_sb;
                next_len = seq_len - start - block_size < block_size ? seq_len - start - block_size : block_size;
            }
        }
        for (int64_t t0 = 0; t0 < in_block; t0 += TILE) {
            int64_t n = in_block - t0 < TILE ? in_block - t0 : TILE, n_pad = (n + VEC - 1) / VEC * VEC;
            for (int64_t h = h0; h < h1; h++) {
                const float *k = k_cache + block * c_sb + t0 * c_st + h * c_sh;
                const float *v = v_cache + block * c_sb + t0 * c_st + h * c_sh;
                int64_t r0 = (h - h0) * group;
                for (int64_t t = 0; t < n; t++) {
                    if (t0 + t < next_len) prefetch_row(next_k + (t0 + t) * c_st + h * c_sh, head_dim);
                    for (int64_t g = 0; g < group; g++) s[(r0 + g) * TILE + t] = dot(qs + (r0 + g) * head_dim, k + t * c_st, head_dim);
                }
                for (int64_t r = r0; r < r0 + group; r++) {
                    /* Whole vectors: scores past n are -inf, so the max ignores them and their exp (~1e-38) is
                     * never summed nor used. */
                    float *sr = s + r * TILE;
                    for (int64_t t = n; t < n_pad; t++) sr[t] = -INFINITY;
                    float m_new = m[r];
#pragma omp simd reduction(max : m_new)
                    for (int64_t t = 0; t < n_pad; t++) m_new = sr[t] > m_new ? sr[t] : m_new;
                    float corr = m[r] == -INFINITY ? 0.0f : expf(m[r] - m_new);
                    exp_shifted(sr, m_new, n_pad);
                    float sum = 0.0f;
                    for (int64_t t = 0; t < n; t++) sum += s[r * TILE + t];
                    l[r] = l[r] * corr + sum;
                    m[r] = m_new;
                    if (corr != 1.0f) scal(acc + r * head_dim, corr, head_dim);
                }
                for (int64_t t = 0; t < n; t++) {
                    if (t0 + t < next_len) prefetch_row(next_v + (t0 + t) * c_st + h * c_sh, head_dim);
                    for (int64_t g = 0; g < group; g++) axpy(acc + (r0 + g) * head_dim, s[(r0 + g) * TILE + t], v + t * c_st, head_dim);
                }
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        float *o = out + (h0 * group + r) * o_sh;
        for (int64_t i = 0; i < head_dim; i++) o[i] = acc[r * head_dim + i] * inv;
    }
    return 0;
}

/* Decode attention for num_seqs sequences. Strides are in elements: q's q_ss (sequence) and q_sh (head), out's o_ss
 * and o_sh; k_cache and v_cache share c_sb (block), c_st (token), c_sh (kv head). block_tables: int64, row stride
 * bt_s0; seq_lens: int64 [num_seqs] (tokens). A work item is one sequence with all its kv heads, or one (sequence,
 * kv head) when there are fewer sequences than threads. Returns 0, or 1 if some block table entry lies outside
 * [0, num_blocks) (out is then partly unwritten). */
int radixserve_paged_decode_f32(const float *q, int64_t q_ss, int64_t q_sh, const float *k_cache,
                                const float *v_cache, int64_t num_blocks, int64_t c_sb, int64_t c_st, int64_t c_sh,
                                const int64_t *block_tables, int64_t bt_s0, const int64_t *seq_lens, float *out,
                                int64_t o_ss, int64_t o_sh, int64_t num_seqs, int64_t num_kv_heads, int64_t group, int64_t head_dim,
                                int64_t block_size, float scale, int num_threads) {
    int bad = 0;
    int64_t heads_per_item = num_seqs >= num_threads ? num_kv_heads : 1;
    int64_t items_per_seq = num_kv_heads / heads_per_item, work = num_seqs * items_per_seq;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (num_threads > 1 && work > 1) \
    reduction(| : bad)
    for (int64_t w = 0; w < work; w++) {
        int64_t seq = w / items_per_seq, h0 = w % items_per_seq * heads_per_item, h1 = h0 + heads_per_item;
        const float *qs = q + seq * q_ss;
        const int64_t *table = block_tables + seq * bt_s0;
        float *os = out + seq * o_ss;
        /* Constant head_dim cases let the compiler unroll the row loops fully. */
        if (head_dim == 64)
            bad |= attend_seq(qs, q_sh, k_cache, v_cache, c_sb, c_st, c_sh, table, seq_lens[seq], num_blocks,
                              block_size, h0, h1, group, 64, scale, os, o_sh);
        else if (head_dim == 128)
            bad |= attend_seq(qs, q_sh, k_cache, v_cache, c_sb, c_st, c_sh, table, seq_lens[seq], num_blocks,
                              block_size, h0, h1, group, 128, scale, os, o_sh);
        else
            bad |= attend_seq(qs, q_sh, k_cache, v_cache, c_sb, c_st, c_sh, table, seq_lens[seq], num_blocks,
                              block_size, h0, h1, group, head_dim, scale, os, o_sh);
    }
    return bad;
}
