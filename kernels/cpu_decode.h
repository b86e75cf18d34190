// Vector primitives of kernels/cpu_decode.cpp: W-float vectors, bfloat16 rows read as float32, lane sums, exp.
//
// The compiler's generic vectors (GCC >= 12 or Clang), so one source builds for AVX-512 (W = 16) and for anything
// else (W = 8: AVX2) without intrinsics; -march=native picks. Plain loops do not do for the dot products: gcc reduces
// each one's lanes in order (W - 1 dependent adds), which made the kernel compute-bound; here the W dot products of
// a tile are reduced together by a shuffle tree (hsum_tile).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace radixserve_cpu {

#ifdef __AVX512F__
constexpr int64_t W = 16;  // floats per vector: one AVX-512 register
#else
constexpr int64_t W = 8;  // one AVX2 register: 16-float vectors built for AVX2 ran 7x slower (split and spilled)
#endif
constexpr int64_t TILE = W;         // tokens per score tile: one vector of scores
constexpr int64_t MAX_NC = 256 / W;  // vectors per row at most (head_dim <= 256)
using bf16_bits = uint16_t;  // at::BFloat16's storage; plain integers keep the conversions vectorizable
typedef float vec __attribute__((vector_size(4 * W)));
typedef uint16_t u16vec __attribute__((vector_size(2 * W)));
typedef uint32_t u32vec __attribute__((vector_size(4 * W)));

inline vec load_vec(const float* p) {
    vec v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline vec load_vec(const bf16_bits* p) {  // bfloat16 -> float32: the 16 bits become a float's upper half
    u16vec h;
    std::memcpy(&h, p, sizeof h);
    const u32vec w = __builtin_convertvector(h, u32vec) << 16;
    vec v;
    std::memcpy(&v, &w, sizeof v);
    return v;
}

inline void store_vec(float* p, vec v) { std::memcpy(p, &v, sizeof v); }

// A K/V row of nc * W elements as nc float32 vectors. bfloat16 rows are read 2W elements at a time and split into
// their even and odd elements, one shift or mask each (widening W elements took two operations and a load each):
// vectors 2j and 2j + 1 hold elements 2Wj + 2i and 2Wj + 2i + 1 (an odd nc ends with W elements in order). q and
// the accumulator are kept in the same order (slot()); dot products and sums do not depend on it. 1.47x faster on
// bfloat16 rows in L2 than widening (measured, AVX-512).
template <int64_t NC>
__attribute__((always_inline)) inline void load_row(const float* src, vec* out, int64_t nc_rt) {
    const int64_t nc = NC > 0 ? NC : nc_rt;
    for (int64_t c = 0; c < nc; c++) out[c] = load_vec(src + W * c);
}

template <int64_t NC>
__attribute__((always_inline)) inline void load_row(const bf16_bits* src, vec* out, int64_t nc_rt) {
    const int64_t nc = NC > 0 ? NC : nc_rt;
    int64_t c = 0;
    for (; c + 1 < nc; c += 2) {
        u32vec w;
        std::memcpy(&w, src + W * c, sizeof w);
        const u32vec even = w << 16, odd = w & 0xffff0000u;
        std::memcpy(&out[c], &even, sizeof even);
        std::memcpy(&out[c + 1], &odd, sizeof odd);
    }
    if (c < nc) out[c] = load_vec(src + W * c);
}

// Vectors c0 .. c0 + cn - 1 (cn <= CB; c0 and CB even) of a row as load_row gives them: out[j] = load_row's
// out[c0 + j]. A chunk starts on a bfloat16 pair, so it ends on one, or on the odd last vector of the row.
template <int64_t CB>
__attribute__((always_inline)) inline void load_chunk(const float* src, vec* out, int64_t c0, int64_t cn) {
    for (int64_t j = 0; j < CB; j++)
        if (j < cn) out[j] = load_vec(src + W * (c0 + j));
}

template <int64_t CB>
__attribute__((always_inline)) inline void load_chunk(const bf16_bits* src, vec* out, int64_t c0, int64_t cn) {
    static_assert(CB % 2 == 0, "a chunk holds whole bfloat16 pairs");
    for (int64_t j = 0; j < CB; j += 2) {
        if (j + 1 < cn) {
            u32vec w;
            std::memcpy(&w, src + W * (c0 + j), sizeof w);
            const u32vec even = w << 16, odd = w & 0xffff0000u;
            std::memcpy(&out[j], &even, sizeof even);
            std::memcpy(&out[j + 1], &odd, sizeof odd);
        } else if (j < cn) {
            out[j] = load_vec(src + W * (c0 + j));
        }
    }
}

// Where element i of a row of d elements sits in load_row's order.
inline int64_t slot(const float*, int64_t i, int64_t) { return i; }

inline int64_t slot(const bf16_bits*, int64_t i, int64_t d) {
    const int64_t base = i / (2 * W) * (2 * W), r = i % (2 * W);
    return base + 2 * W > d ? i : base + r % 2 * W + r / 2;
}

#ifdef __AVX512F__
// out[t] = the sum of p[t]'s W lanes, t < W: log2(W) levels of pairwise shuffles and adds (3 (W - 1) operations
// for all W, instead of W - 1 dependent adds for each).
__attribute__((always_inline)) inline vec hsum_tile(const vec* p) {
    vec a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) {
        const vec &x = p[2 * i], &y = p[2 * i + 1];
        a[i] = __builtin_shufflevector(x, y, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
               __builtin_shufflevector(x, y, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    }
    for (int i = 0; i < 4; i++) {
        const vec &x = a[2 * i], &y = a[2 * i + 1];
        b[i] = __builtin_shufflevector(x, y, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
               __builtin_shufflevector(x, y, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    }
    for (int i = 0; i < 2; i++) {
        const vec &x = b[2 * i], &y = b[2 * i + 1];
        c[i] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
               __builtin_shufflevector(x, y, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    }
    return __builtin_shufflevector(c[0], c[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(c[0], c[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}

inline float hsum(vec v) {  // the sum of v's lanes, by a tree (log2(W) dependent adds, not W - 1)
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v[0];
}
#else
__attribute__((always_inline)) inline vec hsum_tile(const vec* p) {
    vec a[4], b[2];
    for (int i = 0; i < 4; i++) {
        const vec &x = p[2 * i], &y = p[2 * i + 1];
        a[i] = __builtin_shufflevector(x, y, 0, 8, 2, 10, 4, 12, 6, 14) +
               __builtin_shufflevector(x, y, 1, 9, 3, 11, 5, 13, 7, 15);
    }
    for (int i = 0; i < 2; i++) {
        const vec &x = a[2 * i], &y = a[2 * i + 1];
        b[i] = __builtin_shufflevector(x, y, 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
    }
    return __builtin_shufflevector(b[0], b[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(b[0], b[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

inline float hsum(vec v) {
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
    return v[0];
}
#endif

inline float to_f32(float x) { return x; }
inline float to_f32(bf16_bits x) {
    const uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

inline void store(float* p, float x) { *p = x; }

inline void store(bf16_bits* p, float x) {  // round to nearest even, as c10::BFloat16 does; NaN stays NaN
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    *p = std::isnan(x) ? bf16_bits{0x7fc0} : static_cast<bf16_bits>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// x[r][i] = exp(x[r][i] - shift[r]) for x[r][i] <= shift[r], r < R, i < TILE, vectorizable: y = k ln2 + r with
// |r| <= ln2 / 2, exp(r) by Cephes expf's degree-6 polynomial (relative error about 2e-7), 2^k written into the
// exponent bits. y below -87 (and -inf) gives about 1e-38 instead of 0. Three simple loops, not one: gcc 12
// vectorizes each of them but not the fused loop (its clamp on a computed value becomes a branch). The R rows' chains
// are independent: one pass over all of them lets the core overlap their latencies.
template <int64_t R>
inline void exp_shifted(float (*__restrict__ x)[TILE], const float* shift) {
    int32_t bits[R][TILE];
    float two_k[R][TILE];
    for (int64_t row = 0; row < R; row++)
        for (int64_t i = 0; i < TILE; i++) {
            float y = x[row][i] - shift[row];
            x[row][i] = y < -87.0f ? -87.0f : y;
        }
    for (int64_t row = 0; row < R; row++)
        for (int64_t i = 0; i < TILE; i++) {
            float y = x[row][i];
            int32_t k = static_cast<int32_t>(y * 1.44269504088896341f + (y < 0.0f ? -0.5f : 0.5f));  // round(y / ln2)
            float kf = static_cast<float>(k);
            float r = y - kf * 0.693359375f + kf * 2.12194440e-4f;  // y - k ln2 in two parts (Cody-Waite)
            float p = 1.9875691500e-4f;
            p = p * r + 1.3981999507e-3f;
            p = p * r + 8.3334519073e-3f;
            p = p * r + 4.1665795894e-2f;
            p = p * r + 1.6666665459e-1f;
            p = p * r + 5.0000001201e-1f;
            x[row][i] = p * r * r + r + 1.0f;
            bits[row][i] = (k + 127) << 23;
        }
    std::memcpy(two_k, bits, sizeof two_k);
    for (int64_t row = 0; row < R; row++)
        for (int64_t i = 0; i < TILE; i++) x[row][i] *= two_k[row][i];
}

// The largest of m and the scores x[i] (i < W), NaN scores ignored, as a running `x[i] > m ? x[i] : m` over i in
// order gives it (up to the sign of a zero maximum), by a tree: log2(W) dependent steps, not W.
inline float max_with(vec x, float m) {
    const vec mv = vec{} + m;
    x = x > mv ? x : mv;  // lanes that are NaN take m: none is NaN after this
#ifdef __AVX512F__
    vec z = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    x = x > z ? x : z;
    z = __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    x = x > z ? x : z;
    z = __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    x = x > z ? x : z;
    z = __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
#else
    vec z = __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3);
    x = x > z ? x : z;
    z = __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5);
    x = x > z ? x : z;
    z = __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6);
#endif
    x = x > z ? x : z;
    return x[0];
}

}  // namespace radixserve_cpu
