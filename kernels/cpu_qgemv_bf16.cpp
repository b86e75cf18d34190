// bfloat16 dot products for the qgemv op's steps of 2 to 16 rows of bfloat16 x (ISA_AVX512_BF16: AVX-512 with
// AVX512_BF16's vdpbf16ps). Part of torch.ops.radixserve_qgemv.qgemv (kernels/cpu_qgemv.cpp runs these row functions).
//
// Why: the integer dot products (kernels/cpu_qgemv.cpp) pay, per row of x and per group of 32 weights, a conversion,
// a multiply and an fma to apply the group's two scales; with one row that hides under the weights' memory reads,
// with more it is most of the work (SmolLM2 shapes, hot weights: 24-35 us per row for every row). Here each group is
// dequantized once per call into bfloat16 (its scale and min inside the value) and each row of x costs one
// vdpbf16ps per 32 weights, with no per-group work.
//
// Weights: w = q * scale + min (4 bits, q 0..15) or q * scale (8 bits), computed in float32 (one fma: the file is
// compiled with -ffp-contract=off, the fma is explicit) and rounded to bfloat16 (round to nearest even,
// vcvtne2ps2bf16): the weight a bfloat16 model's dense path multiplies. A 4-bit pair of groups is dequantized through
// a 32-entry table, q * scale + min for q = 0..15 of each group, and one vpermw per 32 weights.
// x: bfloat16 as given, 4-bit weights' x in pair_order (kernels/cpu_qgemv.h), so that the low nibbles of a pair of
// groups meet their 32 values of x in one vector and the high nibbles theirs.
// Sums: vdpbf16ps adds exact products of two bfloat16 values to float32 accumulators (denormal inputs and outputs
// flushed to zero), 16 lanes, two accumulator sets up to 8 rows; the lanes are added at the end. So
//   y = x @ bf16(W).T, with float32 summation error only: |y - x @ bf16(W).T| <= K * 2^-23 * sum_k |x_k w_k| (a loose
//   form of the bound for a sum of K terms; the tests hold it).
#include "cpu_qgemv.h"

#include <immintrin.h>

#include <cstring>

namespace radixserve_qgemv {

namespace {

#define QGEMV_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))

// The table of a pair of 4-bit groups g and h: 32 bfloat16 as int16 lanes, q * scale + min for q = 0..15 of g in
// lanes 0-15, of h in lanes 16-31.
QGEMV_BF16 inline __m512i pair_table(const float* d, const float* mins, int64_t g, int64_t h) {
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 first = _mm512_fmadd_ps(q, _mm512_set1_ps(d[g]), _mm512_set1_ps(mins[g]));
    const __m512 second = _mm512_fmadd_ps(q, _mm512_set1_ps(d[h]), _mm512_set1_ps(mins[h]));
    return (__m512i)_mm512_cvtne2ps_pbh(second, first);
}

// Groups g and g + 1 of 4-bit weights (32 bytes at q) as bfloat16 in pair_order: low = q 0..15 of g then of g + 1
// (the low nibbles), high = q 16..31 of both (the high nibbles).
QGEMV_BF16 inline void pair_bf16(const uint8_t* q, const float* d, const float* mins, int64_t g, __m512i* low,
                                 __m512i* high) {
    const __m512i table = pair_table(d, mins, g, g + 1);
    const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
    const __m512i second = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(16), 1);  // g + 1's entries
    *low = _mm512_permutexvar_epi16(_mm512_or_si512(_mm512_and_si512(bytes, _mm512_set1_epi16(0x0F)), second), table);
    *high = _mm512_permutexvar_epi16(_mm512_or_si512(_mm512_srli_epi16(bytes, 4), second), table);
}

// The last 4-bit group g of an odd count (16 bytes at q) as bfloat16 in order (q 0..31).
QGEMV_BF16 inline __m512i last_group_bf16(const uint8_t* q, const float* d, const float* mins, int64_t g) {
    const __m512i table = pair_table(d, mins, g, g);
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m256i low = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0F));
    const __m512i codes = _mm512_inserti64x4(_mm512_castsi256_si512(low), _mm256_srli_epi16(bytes, 4), 1);
    return _mm512_permutexvar_epi16(codes, table);
}

// 8-bit group g (32 bytes at q) as bfloat16 in order: q * scale.
QGEMV_BF16 inline __m512i group_q8_bf16(const uint8_t* q, const float* d, int64_t g) {
    const __m512 scale = _mm512_set1_ps(d[g]);
    const __m128i* raw = reinterpret_cast<const __m128i*>(q);
    const __m512 first = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(raw))), scale);
    const __m512 second = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(raw + 1))), scale);
    return (__m512i)_mm512_cvtne2ps_pbh(second, first);
}

QGEMV_BF16 inline __m512 dot(__m512 acc, __m512i w, const uint16_t* x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_loadu_si512(x));
}

// Groups g and g + 1 as the two bfloat16 vectors that meet x at g * GROUP and g * GROUP + GROUP: a 4-bit pair's low
// and high halves (x in pair_order), or two 8-bit groups (x in order).
QGEMV_BF16 inline void two_groups(const Weights& w, const uint8_t* q, const float* d, int64_t n, Shape s, int64_t g,
                                  bool four_bit, __m512i* first, __m512i* second) {
    if (four_bit) {
        pair_bf16(q + g * 16, d, w.mins + n * s.g, g, first, second);
        return;
    }
    *first = group_q8_bf16(q + g * GROUP, d, g);
    *second = group_q8_bf16(q + (g + 1) * GROUP, d, g + 1);
}

// One weight row n against ROWS <= 8 rows of x (xb: the first, bfloat16 [ROWS, K]) into y[0 .. ROWS - 1]. Two
// accumulator sets (the two vectors of two_groups) in separate dependency chains; 16 accumulators and the weights
// stay in registers.
template <int ROWS>
QGEMV_BF16 __attribute__((always_inline)) inline void row_bf16(const Weights& w, int64_t n, const uint16_t* xb,
                                                               Shape s, bool four_bit, float* y) {
    const uint8_t* q = w.q + n * w.row_bytes;
    const float* d = w.scales + n * s.g;
    __m512 acc[2][ROWS];
    for (int m = 0; m < ROWS; ++m) {
        acc[0][m] = _mm512_setzero_ps();
        acc[1][m] = _mm512_setzero_ps();
    }
    int64_t g = 0;
    for (; g + 2 <= s.g; g += 2) {
        __m512i first, second;
        two_groups(w, q, d, n, s, g, four_bit, &first, &second);
        for (int m = 0; m < ROWS; ++m) {
            const uint16_t* xp = xb + m * s.k + g * GROUP;
            acc[0][m] = dot(acc[0][m], first, xp);
            acc[1][m] = dot(acc[1][m], second, xp + GROUP);
        }
    }
    if (g < s.g) {  // the last group of an odd count, in order
        const __m512i last = four_bit ? last_group_bf16(q + g * 16, d, w.mins + n * s.g, g)
                                      : group_q8_bf16(q + g * GROUP, d, g);
        for (int m = 0; m < ROWS; ++m)
            acc[0][m] = dot(acc[0][m], last, xb + m * s.k + g * GROUP);
    }
    for (int m = 0; m < ROWS; ++m)
        y[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][m], acc[1][m]));
}

template <int ROWS>
QGEMV_BF16 void rows_bf16(const Weights& w, int64_t begin, int64_t end, const QuantizedX& x, Shape s, bool four_bit,
                          float* y) {
    const uint16_t* xb = x.bf16.data();
    for (int64_t n = begin; n < end; ++n) {
        float* yn = y + (n - begin) * ROWS;
        if constexpr (ROWS <= 8) {
            row_bf16<ROWS>(w, n, xb, s, four_bit, yn);
        } else {  // rows 0-7, then the rest: dequantizing twice costs less than accumulators spilled to memory
            row_bf16<8>(w, n, xb, s, four_bit, yn);
            row_bf16<ROWS - 8>(w, n, xb + 8 * s.k, s, four_bit, yn + 8);
        }
    }
}

}  // namespace

QuantizedX order_bf16(const c10::BFloat16* x, Shape s, bool paired) {
    QuantizedX out;
    out.bf16.resize(s.m * s.k);
    for (int64_t m = 0; m < s.m; ++m) {
        const c10::BFloat16* row = x + m * s.k;
        uint16_t* dst = out.bf16.data() + m * s.k;
        if (!paired) {
            std::memcpy(dst, row, s.k * sizeof(uint16_t));
            continue;
        }
        for (int64_t g = 0; g < s.g; ++g)
            for (int64_t half = 0; half < GROUP; half += 16)
                std::memcpy(dst + pair_order(g, half, s.g), row + g * GROUP + half, 16 * sizeof(uint16_t));
    }
    return out;
}

RowFn bf16_rows(int64_t m) {
    switch (m) {
        case 2: return rows_bf16<2>;
        case 3: return rows_bf16<3>;
        case 4: return rows_bf16<4>;
        case 5: return rows_bf16<5>;
        case 6: return rows_bf16<6>;
        case 7: return rows_bf16<7>;
        case 8: return rows_bf16<8>;
        case 9: return rows_bf16<9>;
        case 10: return rows_bf16<10>;
        case 11: return rows_bf16<11>;
        case 12: return rows_bf16<12>;
        case 13: return rows_bf16<13>;
        case 14: return rows_bf16<14>;
        case 15: return rows_bf16<15>;
        default: return rows_bf16<16>;
    }
}

}  // namespace radixserve_qgemv
