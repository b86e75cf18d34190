// Quantized matrix times few vectors for CPU decode: y[M, N] = x[M, K] @ W.T, W stored in groups of 32 along K.
// A torch operator, torch.ops.radixserve_qgemv.qgemv, built on first use by kernels/cpu_qgemv.py.
//
// Weights (layout: kernels/cpu_qgemv.py):
//   bits 4: qweight uint8 [N, K / 2], per group 16 bytes, byte j = q[j] | q[j + 16] << 4 (q in 0..15);
//           w = q * scales[n, g] + mins[n, g] (GGUF Q4_0, Q4_1 and a Q4_K sub-block all have this form).
//   bits 8: qweight int8 [N, K] (q in -127..127); w = q * scales[n, g] (GGUF Q8_0).
// Activations: each row of x is rounded to int16 per group of 32 on the fly, a = max |x| / 32767, xq = round(x / a):
// ggml's scheme for its Q8 activations (llama.cpp ggml-cpu quants.c, vec_dot_q4_1_q8_1) with 16 bits instead of 8,
// because int8 per group cost SmolLM2 top-1 agreement (an outlier channel takes its group's range: measured per
// layer, int8 rounding moved outputs 4x more than torch's bfloat16 activations; int16, 60x less). A group's dot
// product is an integer sum of q * xq, exact in int32 (|sum| <= 32 * 127 * 32767 < 2^31), scaled once by
// scales * a; the 4-bit min term is m * a * sum_j xq_j (the rounded x, as Q8_1's s), so the result is the
// dequantized weight times the rounded x, and its only error against x @ W.T is that rounding:
//   |y - x @ W.T| <= sum_g a_g / 2 * sum_j |w_j|, plus float32 rounding (of the terms, and of an int32 sum over 2^24).
//
// ISA: one function per instruction set, each compiled for its own target (GCC target attributes), the one run
// chosen by the caller from the CPU's flags (an AVX2-only CPU never executes an AVX-512 instruction):
//   ISA_AVX512: AVX-512 VNNI vpdpwssd (s16 x s16 pairs -> s32), a group's 32 products in one 512-bit vector;
//   ISA_AVX2: vpmaddwd, a group in two 256-bit vectors;
//   ISA_SCALAR: plain C++;
//   ISA_AVX512_BF16: ISA_AVX512's code, except bfloat16 x of 2 or more rows: bfloat16 dot products of the weights
//   dequantized once per call (kernels/cpu_qgemv_bf16.cpp, its header: why, and its error).
// Weights are widened to int16 once per group (vpmovzxbw / vpmovsxbw) and reused for every row of x.
//
// Threads: at::parallel_for over N (torch's intra-op pool; -fopenmp inlines its OpenMP backend, linked to the
// runtime libtorch_cpu loaded); on one torch thread with the helper on (set_helper), blocks of rows shared with the
// helper thread of kernels/cpu_share.h. Each output depends only on its inputs: the result is the same for any thread
// count, helper or not.
#include <ATen/Parallel.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include "cpu_qgemv.h"
#include "cpu_share.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using namespace radixserve_qgemv;

constexpr float ROUNDER = 12582912.f;  // 1.5 * 2^23
constexpr float XQ_MAX = 32767.f;  // x rounds to -32767..32767 times its group's a

// The rounding of x (its body is inlined into one copy per ISA below, so that the compiler vectorizes each for it).
template <typename T>
__attribute__((always_inline)) inline QuantizedX quantize_body(const T* x, Shape s, bool paired) {
    const int64_t pairs = s.g / 2;
    QuantizedX out{std::vector<int16_t>(s.m * s.k), std::vector<float>(s.m * s.g), std::vector<float>(s.m * s.g),
                   std::vector<float>(paired ? s.m * pairs * 16 : 0)};
    for (int64_t m = 0; m < s.m; ++m) {
        int16_t* row = out.q.data() + m * s.k;
        for (int64_t g = 0; g < s.g; ++g) {
            float v[GROUP];
            float amax = 0.f;
            for (int64_t j = 0; j < GROUP; ++j) {
                v[j] = static_cast<float>(x[m * s.k + g * GROUP + j]);
                amax = std::max(amax, std::fabs(v[j]));
            }
            const float a = amax / XQ_MAX;
            const float inv = a > 0.f ? 1.f / a : 0.f;
            int16_t xq[GROUP];
            int32_t sum = 0;
            for (int64_t j = 0; j < GROUP; ++j) {
                // round half to even, as torch.round: adding and subtracting 1.5 * 2^23 leaves no fraction bits
                // (|v * inv| <= 32767 < 2^22), without a libm call (nearbyintf is one below SSE4.1, the baseline)
                const float r = (v[j] * inv + ROUNDER) - ROUNDER;
                xq[j] = static_cast<int16_t>(std::min(XQ_MAX, std::max(-XQ_MAX, r)));
                sum += xq[j];
            }
            const int64_t half = GROUP / 2;
            std::copy_n(xq, half, row + (paired ? pair_order(g, 0, s.g) : g * GROUP));
            std::copy_n(xq + half, half, row + (paired ? pair_order(g, half, s.g) : g * GROUP + half));
            out.scale[m * s.g + g] = a;
            out.sum[m * s.g + g] = a * static_cast<float>(sum);  // |sum| <= 32 * 32767 < 2^24: exact as a float
            if (paired && g / 2 < pairs)
                std::fill_n(out.lanes.data() + (m * pairs + g / 2) * 16 + (g & 1) * 8, 8, a);
        }
    }
    return out;
}

template <typename T>
QuantizedX quantize_scalar(const T* x, Shape s, bool paired) {
    return quantize_body(x, s, paired);
}

template <typename T>
__attribute__((target("avx2,fma"))) QuantizedX quantize_avx2(const T* x, Shape s, bool paired) {
    return quantize_body(x, s, paired);
}

// x rounded (quantize_body) by the code of the given ISA: AVX2's for AVX-512 too (its loops are 32 values long).
template <typename T>
QuantizedX quantize_rows(const T* x, Shape s, bool paired, int64_t isa) {
    return isa == ISA_SCALAR ? quantize_scalar(x, s, paired) : quantize_avx2(x, s, paired);
}

// ---- scalar -------------------------------------------------------------------------------------------------------

void row_scalar(const Weights& w, int64_t n, const QuantizedX& x, Shape s, bool four_bit, float* y) {
    const uint8_t* q = w.q + n * w.row_bytes;
    const float* d = w.scales + n * s.g;
    for (int64_t m = 0; m < s.m; ++m) {
        const int16_t* xq = x.q.data() + m * s.k;
        float acc = 0.f;
        for (int64_t g = 0; g < s.g; ++g) {
            int32_t dot = 0;
            for (int64_t j = 0; j < GROUP; ++j) {
                const int32_t wq = four_bit ? (q[g * 16 + (j & 15)] >> (j >= 16 ? 4 : 0)) & 15
                                            : static_cast<int8_t>(q[g * GROUP + j]);
                dot += wq * xq[g * GROUP + j];
            }
            acc += static_cast<float>(dot) * (d[g] * x.scale[m * s.g + g]);
            if (four_bit)
                acc += w.mins[n * s.g + g] * x.sum[m * s.g + g];
        }
        y[m] = acc;
    }
}

// ---- AVX2 ---------------------------------------------------------------------------------------------------------

__attribute__((target("avx2,fma"))) inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// + sum_g mins[g] * (a * sum of xq over group g) to each row's accumulator, 8 groups a vector.
__attribute__((target("avx2,fma"))) inline void add_mins_avx2(const float* mins, const QuantizedX& x, Shape s,
                                                              __m256* acc) {
    for (int64_t m = 0; m < s.m; ++m) {
        const float* sums = x.sum.data() + m * s.g;
        int64_t g = 0;
        for (; g + 8 <= s.g; g += 8)
            acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(mins + g), _mm256_loadu_ps(sums + g), acc[m]);
        float rest = 0.f;
        for (; g < s.g; ++g)
            rest += mins[g] * sums[g];
        acc[m] = _mm256_add_ps(acc[m], _mm256_set_ps(0, 0, 0, 0, 0, 0, 0, rest));
    }
}

// acc[m] += the products of group g with row m's x: 4-bit nibbles or 8-bit bytes widened to int16, vpmaddwd.
template <int ROWS>
__attribute__((target("avx2,fma"))) inline void group_avx2(const uint8_t* q, const float* d, const QuantizedX& x,
                                                           Shape s, int64_t g, bool four_bit, __m256* acc) {
    __m256i w0, w1;  // q 0..15 and 16..31 of group g as int16
    if (four_bit) {
        const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + g * 16)));
        w0 = _mm256_and_si256(v, _mm256_set1_epi16(0x0F));
        w1 = _mm256_srli_epi16(v, 4);
    } else {
        const __m256i wb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * GROUP));
        w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(wb));
        w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(wb, 1));
    }
    for (int64_t m = 0; m < (ROWS ? ROWS : s.m); ++m) {
        const int16_t* xg = x.q.data() + m * s.k + g * GROUP;
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg + 16));
        const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
        const __m256 scale = _mm256_set1_ps(d[g] * x.scale[m * s.g + g]);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[m]);
    }
}

// ROWS: the row count when known at compile time (then the accumulators stay in registers: for_rows), 0 for s.m.
// Two accumulator sets (even and odd groups): one row's fma chain does not wait on the previous group's.
template <int ROWS>
__attribute__((target("avx2,fma"), always_inline)) inline void row_avx2(const Weights& w, int64_t n,
                                                                        const QuantizedX& x, Shape s, bool four_bit,
                                                                        float* y) {
    if (ROWS)
        s.m = ROWS;
    const uint8_t* q = w.q + n * w.row_bytes;
    const float* d = w.scales + n * s.g;
    __m256 acc0[MAX_ROWS];
    __m256 acc1[MAX_ROWS];
    for (int64_t m = 0; m < s.m; ++m) {
        acc0[m] = _mm256_setzero_ps();
        acc1[m] = _mm256_setzero_ps();
    }
    int64_t g = 0;
    for (; g + 2 <= s.g; g += 2) {
        group_avx2<ROWS>(q, d, x, s, g, four_bit, acc0);
        group_avx2<ROWS>(q, d, x, s, g + 1, four_bit, acc1);
    }
    if (g < s.g)
        group_avx2<ROWS>(q, d, x, s, g, four_bit, acc0);
    if (four_bit)
        add_mins_avx2(w.mins + n * s.g, x, s, acc0);
    for (int64_t m = 0; m < s.m; ++m)
        y[m] = hsum256(_mm256_add_ps(acc0[m], acc1[m]));
}

// ---- AVX-512 VNNI -------------------------------------------------------------------------------------------------

#define QGEMV_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))

// The 32 weights of a group as int16 in x's order: 4-bit 0..15 (nibbles split, then zero-extended), 8-bit -127..127.
QGEMV_AVX512 inline __m512i load_group_avx512(const uint8_t* q, bool four_bit) {
    if (four_bit) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
        const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
        return _mm512_cvtepu8_epi16(_mm256_and_si256(both, _mm256_set1_epi8(0x0F)));
    }
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
}

// Groups g and g + 1 of 4-bit weights (32 bytes) as two int16 vectors in pair_order: the low nibbles of both groups
// (q 0..15 of g, then of g + 1) and the high ones (q 16..31): one widening, one and, one shift for 64 weights.
QGEMV_AVX512 inline void load_pair_q4(const uint8_t* q, __m512i* low, __m512i* high) {
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
    *low = _mm512_and_si512(v, _mm512_set1_epi16(0x0F));
    *high = _mm512_srli_epi16(v, 4);
}

// 4-bit: pairs of groups (load_pair_q4), x in pair_order; two accumulator sets (even and odd pairs), so that one
// row's fma chain does not wait on the previous pair's. 8-bit: one group a 512-bit vector.
// acc[m] += the products of the pair of 4-bit groups at g (load_pair_q4) with row m's x (pair p = g / 2).
template <int ROWS>
QGEMV_AVX512 inline void pair_avx512(const uint8_t* q, const float* d, const QuantizedX& x, Shape s, int64_t g,
                                     __m512* acc) {
    __m512i low, high;
    load_pair_q4(q + g * 16, &low, &high);
    const __m512 dd = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d[g]), _mm512_set1_ps(d[g + 1]));
    const int64_t pairs = s.g / 2;
    for (int64_t m = 0; m < (ROWS ? ROWS : s.m); ++m) {
        const int16_t* xp = x.q.data() + m * s.k + g * GROUP;
        __m512i dot = _mm512_dpwssd_epi32(_mm512_setzero_si512(), low, _mm512_loadu_si512(xp));
        dot = _mm512_dpwssd_epi32(dot, high, _mm512_loadu_si512(xp + 32));
        const __m512 a = _mm512_loadu_ps(x.lanes.data() + (m * pairs + g / 2) * 16);
        acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), a), dd, acc[m]);
    }
}

// acc[m] += the products of group g (8-bit, or a 4-bit group in order) with row m's x.
template <int ROWS>
QGEMV_AVX512 inline void group_avx512(const uint8_t* q, const float* d, const QuantizedX& x, Shape s, int64_t g,
                                      bool four_bit, __m512* acc) {
    const __m512i wv = load_group_avx512(q + g * (four_bit ? 16 : GROUP), four_bit);
    for (int64_t m = 0; m < (ROWS ? ROWS : s.m); ++m) {
        const __m512i xv = _mm512_loadu_si512(x.q.data() + m * s.k + g * GROUP);
        const __m512i dot = _mm512_dpwssd_epi32(_mm512_setzero_si512(), wv, xv);
        const __m512 scale = _mm512_set1_ps(d[g] * x.scale[m * s.g + g]);
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[m]);
    }
}

// 4-bit: pairs of groups (pair_avx512), x in pair_order; 8-bit: one group a 512-bit vector. Two accumulator sets
// (even and odd steps), so that one row's fma chain does not wait on the previous step's.
template <int ROWS>
QGEMV_AVX512 __attribute__((always_inline)) inline void row_avx512(const Weights& w, int64_t n, const QuantizedX& x,
                                                                   Shape s, bool four_bit, float* y) {
    if (ROWS)
        s.m = ROWS;
    const uint8_t* q = w.q + n * w.row_bytes;
    const float* d = w.scales + n * s.g;
    __m512 acc0[MAX_ROWS];
    __m512 acc1[MAX_ROWS];
    for (int64_t m = 0; m < s.m; ++m) {
        acc0[m] = _mm512_setzero_ps();
        acc1[m] = _mm512_setzero_ps();
    }
    int64_t g = 0;
    if (four_bit) {
        for (; g + 4 <= s.g; g += 4) {
            pair_avx512<ROWS>(q, d, x, s, g, acc0);
            pair_avx512<ROWS>(q, d, x, s, g + 2, acc1);
        }
        if (g + 2 <= s.g) {
            pair_avx512<ROWS>(q, d, x, s, g, acc0);
            g += 2;
        }
        if (g < s.g)  // the last group of an odd count, in order
            group_avx512<ROWS>(q, d, x, s, g, true, acc1);
    } else {
        for (; g + 2 <= s.g; g += 2) {
            group_avx512<ROWS>(q, d, x, s, g, false, acc0);
            group_avx512<ROWS>(q, d, x, s, g + 1, false, acc1);
        }
        if (g < s.g)
            group_avx512<ROWS>(q, d, x, s, g, false, acc0);
    }
    if (four_bit)  // + sum_g mins[g] * (a * sum of xq over group g), 16 groups a vector, the rest masked
        for (int64_t m = 0; m < s.m; ++m) {
            const float* mins = w.mins + n * s.g;
            const float* sums = x.sum.data() + m * s.g;
            for (int64_t h = 0; h < s.g; h += 16) {
                const __mmask16 live = s.g - h >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (s.g - h)) - 1);
                const __m512 a = _mm512_maskz_loadu_ps(live, mins + h);
                acc0[m] = _mm512_fmadd_ps(a, _mm512_maskz_loadu_ps(live, sums + h), acc0[m]);
            }
        }
    for (int64_t m = 0; m < s.m; ++m)
        y[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[m], acc1[m]));
}

// ---- the operator -------------------------------------------------------------------------------------------------

void check_inputs(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins,
                  int64_t bits, int64_t isa) {
    TORCH_CHECK_VALUE(x.device().is_cpu() && qweight.device().is_cpu() && scales.device().is_cpu(),
                      "qgemv: tensors must be on the CPU");
    TORCH_CHECK_VALUE(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kFloat ||
                                                            x.scalar_type() == at::kBFloat16),
                      "qgemv: x must be a contiguous float32 or bfloat16 [M, K], got ", x.sizes(), " ",
                      x.scalar_type());
    const int64_t m = x.size(0), k = x.size(1);
    TORCH_CHECK_VALUE(m >= 1 && m <= MAX_ROWS, "qgemv: x has ", m, " rows; 1 to ", MAX_ROWS, " are supported");
    TORCH_CHECK_VALUE(k % GROUP == 0 && k > 0, "qgemv: K=", k, " is not a positive multiple of ", GROUP);
    TORCH_CHECK_VALUE(bits == 4 || bits == 8, "qgemv: bits must be 4 or 8, got ", bits);
    TORCH_CHECK_VALUE(isa >= ISA_SCALAR && isa <= ISA_AVX512_BF16, "qgemv: unknown isa ", isa);
    const auto qtype = bits == 4 ? at::kByte : at::kChar;
    const int64_t row_bytes = bits == 4 ? k / 2 : k;
    TORCH_CHECK_VALUE(qweight.dim() == 2 && qweight.is_contiguous() && qweight.scalar_type() == qtype &&
                          qweight.size(1) == row_bytes,
                      "qgemv: qweight must be contiguous ", qtype, " [N, ", row_bytes, "], got ", qweight.sizes(),
                      " ", qweight.scalar_type());
    const int64_t n = qweight.size(0);
    for (const at::Tensor* t : {&scales, &mins}) {
        if (t == &mins && bits == 8)
            continue;
        TORCH_CHECK_VALUE(t->dim() == 2 && t->is_contiguous() && t->scalar_type() == at::kFloat &&
                              t->size(0) == n && t->size(1) == k / GROUP,
                          "qgemv: scales and mins must be contiguous float32 [N, K / 32] = [", n, ", ", k / GROUP,
                          "], got ", t->sizes(), " ", t->scalar_type());
    }
}

// The rows function for m rows of x: compiled for m = 1..8 (its accumulators then stay in registers), generic above.
template <template <int> class Fn>
RowFn for_rows(int64_t m) {
    switch (m) {
        case 1: return Fn<1>::run;
        case 2: return Fn<2>::run;
        case 3: return Fn<3>::run;
        case 4: return Fn<4>::run;
        case 5: return Fn<5>::run;
        case 6: return Fn<6>::run;
        case 7: return Fn<7>::run;
        case 8: return Fn<8>::run;
        default: return Fn<0>::run;
    }
}

// A range of weight rows in one call of one function of the ISA, the row's code inlined: a call per row (its
// prologue, epilogue and vzeroupper) made hot SmolLM2 layer shapes 1.06-1.12x slower, a step's cold layers 1.07-1.13x.
template <int ROWS>
struct Avx512Rows {
    QGEMV_AVX512 static void run(const Weights& w, int64_t begin, int64_t end, const QuantizedX& x, Shape s,
                                 bool four_bit, float* y) {
        for (int64_t n = begin; n < end; ++n)
            row_avx512<ROWS>(w, n, x, s, four_bit, y + (n - begin) * s.m);
    }
};

template <int ROWS>
struct Avx2Rows {
    __attribute__((target("avx2,fma"))) static void run(const Weights& w, int64_t begin, int64_t end,
                                                         const QuantizedX& x, Shape s, bool four_bit, float* y) {
        for (int64_t n = begin; n < end; ++n)
            row_avx2<ROWS>(w, n, x, s, four_bit, y + (n - begin) * s.m);
    }
};

void rows_scalar(const Weights& w, int64_t begin, int64_t end, const QuantizedX& x, Shape s, bool four_bit,
                 float* y) {
    for (int64_t n = begin; n < end; ++n)
        row_scalar(w, n, x, s, four_bit, y + (n - begin) * s.m);
}

// The weight bytes of a block of rows shared with the helper thread (kernels/cpu_share.h): the unit a thread claims,
// a microsecond or so of work, so that claiming costs little next to it and the wait for the helper's last one is short.
constexpr int64_t SHARE_BLOCK_BYTES = 16384;

// Weight rows begin .. end - 1's results y [end - begin, m] float32 into out [m, n] in its dtype.
template <typename T>
void store_rows(const float* y, int64_t begin, int64_t end, int64_t m, int64_t n, T* out) {
    for (int64_t row = begin; row < end; ++row)
        for (int64_t i = 0; i < m; ++i)
            out[i * n + row] = static_cast<T>(y[(row - begin) * m + i]);
}

// The rows of one call: on torch's intra-op pool when it has threads, else shared with the helper thread when it is
// on and the weights span more than one block, else on the caller alone. out [M, N] gets the same bits either way.
template <typename T>
void run(const T* x, const Weights& w, const at::Tensor& keep_q, const at::Tensor& keep_s, const at::Tensor& keep_m,
         Shape s, int64_t n, bool four_bit, int64_t isa, T* out) {
    const bool avx512 = isa == ISA_AVX512 || isa == ISA_AVX512_BF16;
    std::shared_ptr<const QuantizedX> xq;
    RowFn kernel = rows_scalar;
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (isa == ISA_AVX512_BF16 && s.m >= 2) {
            xq = std::make_shared<const QuantizedX>(order_bf16(x, s, four_bit));
            kernel = bf16_rows(s.m);
        }
    }
    if (!xq) {
        xq = std::make_shared<const QuantizedX>(quantize_rows(x, s, four_bit && avx512, isa));
        kernel = avx512 ? for_rows<Avx512Rows>(s.m) : isa == ISA_AVX2 ? for_rows<Avx2Rows>(s.m) : rows_scalar;
    }
    const int64_t row_weight_bytes = w.row_bytes + s.g * static_cast<int64_t>(sizeof(float)) * (four_bit ? 2 : 1);
    const int64_t block_rows = std::max<int64_t>(1, SHARE_BLOCK_BYTES / row_weight_bytes);
    if (at::get_num_threads() == 1 && radixserve::helper_on() && n > block_rows) {
        // the closure keeps the weights and x alive: the helper may still hold it after this call returns
        radixserve::ShareWork work{n, block_rows, s.m, [=](int64_t begin, int64_t end, float* y) {
                                       (void)keep_q, (void)keep_s, (void)keep_m;
                                       kernel(w, begin, end, *xq, s, four_bit, y);
                                   }};
        radixserve::share_work(std::move(work), [&](int64_t begin, int64_t end, const float* y) {
            store_rows(y, begin, end, s.m, n, out);
        });
        return;
    }
    const int64_t grain = std::max<int64_t>(1, 16384 / (w.row_bytes * s.m));
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
        std::vector<float> y((end - begin) * s.m);
        kernel(w, begin, end, *xq, s, four_bit, y.data());
        store_rows(y.data(), begin, end, s.m, n, out);
    });
}

at::Tensor qgemv(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins,
                 int64_t bits, int64_t isa) {
    check_inputs(x, qweight, scales, mins, bits, isa);
    const Shape s{x.size(0), x.size(1), x.size(1) / GROUP};
    const int64_t n = qweight.size(0);
    const bool four_bit = bits == 4;
    const Weights w{static_cast<const uint8_t*>(qweight.data_ptr()), scales.data_ptr<float>(),
                    four_bit ? mins.data_ptr<float>() : nullptr, qweight.size(1)};
    at::Tensor out(at::detail::empty_cpu({s.m, n}, x.scalar_type(), false, std::nullopt));
    if (n == 0)
        return out;
    if (x.scalar_type() == at::kFloat)
        run(x.data_ptr<float>(), w, qweight, scales, mins, s, n, four_bit, isa, out.data_ptr<float>());
    else
        run(x.data_ptr<at::BFloat16>(), w, qweight, scales, mins, s, n, four_bit, isa,
            out.data_ptr<at::BFloat16>());
    return out;
}

}  // namespace

TORCH_LIBRARY(radixserve_qgemv, m) {
    m.def("qgemv(Tensor x, Tensor qweight, Tensor scales, Tensor mins, int bits, int isa) -> Tensor");
    m.def("set_helper(bool on) -> ()", [](bool on) { radixserve::set_helper(on); });
    m.def("helper_on() -> bool", [] { return radixserve::helper_on(); });
    // The addresses of share_work and helper_on, for another library of this process that shares its work with the
    // helper (kernels/cpu_decode.cpp's link_helper): each library is loaded on its own, the helper is this one's.
    m.def("helper_entry() -> int[]", [] {
        using ShareFn = void (*)(radixserve::ShareWork, const std::function<void(int64_t, int64_t, const float*)>&);
        const ShareFn share = &radixserve::share_work;
        const auto on = reinterpret_cast<int64_t>(&radixserve::helper_on);
        return std::vector<int64_t>{reinterpret_cast<int64_t>(share), on};
    });
}

TORCH_LIBRARY_IMPL(radixserve_qgemv, CPU, m) { m.impl("qgemv", &qgemv); }
