// Quantized matrix times few vectors for CPU decode: y[M, N] = x[M, K] @ W.T, W stored in groups of 32 along K.
// A torch operator, torch.ops.radixserve_qgemv.qgemv, built on first use by kernels/cpu_qgemv.py.
//
// Weights (layout: kernels/cpu_qgemv.py):
//   bits 4: qweight uint8 [N, K / 2], per group 16 bytes, byte j = q[j] | q[j + 16] << 4 (q in 0..15);
//           w = q * scales[n, g] + mins[n, g] (GGUF Q4_0, Q4_1 and a Q4_K sub-block all have this form).
//   bits 8: qweight int8 [N, K] (q in -127..127); w = q * scales[n, g] (GGUF Q8_0).
// Activations: each row of x is quantized per group of 32 to int8 on the fly, a = max |x| / 127, xq = round(x / a)
// (ggml's Q8 activations, llama.cpp ggml-cpu quants.c, vec_dot_q4_1_q8_1 / vec_dot_q8_0_q8_0), so a group's dot
// product is an integer sum of q * xq, exact in int32, scaled once by scales * a. The 4-bit min term uses the float
// sum of x over the group (sum_j m * x_j = m * sum_j x_j exactly, up to float rounding), not the quantized x, so the
// only error against the float product of the dequantized weight is x's int8 rounding:
//   |y - x @ W.T| <= sum_g |scale_g| * a_g / 2 * sum_j |q_j|, plus float32 rounding.
//
// ISA: one function per instruction set, each compiled for its own target (GCC target attributes), the one run
// chosen by the caller from the CPU's flags (an AVX2-only CPU never executes an AVX-512 instruction):
//   ISA_AVX512: AVX-512 VNNI vpdpbusd (u8 x s8 -> s32), two groups of 32 per 512-bit vector;
//   ISA_AVX2: vpmaddubsw + vpmaddwd, one group per 256-bit vector;
//   ISA_SCALAR: plain C++.
// vpdpbusd and vpmaddubsw take an unsigned and a signed byte: 4-bit q is unsigned already; 8-bit q is signed, so its
// magnitude is the unsigned side and its sign moves onto x (|q| * (x * sign q) = q * x; neither side is ever -128).
// For 4 bits on AVX-512, a 32-byte load holds groups g and g + 1 as [g low nibbles, g + 1 low, g high, g + 1 high]
// once split, so the quantized x of a pair of groups is stored in that order (quantize_rows, pair_order).
//
// Threads: at::parallel_for over N (torch's intra-op pool; -fopenmp inlines its OpenMP backend, linked to the
// runtime libtorch_cpu loaded). Each output depends only on its inputs: the result is the same for any thread count.
#include <ATen/Parallel.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t GROUP = 32;
constexpr int64_t MAX_ROWS = 16;
constexpr int64_t ISA_SCALAR = 0;
constexpr int64_t ISA_AVX2 = 1;
constexpr int64_t ISA_AVX512 = 2;
constexpr float ROUNDER = 12582912.f;  // 1.5 * 2^23

// x quantized per row per group: q [M, K] int8, scale a [M, G], sum of x [M, G] (float).
struct QuantizedX {
    std::vector<int8_t> q;
    std::vector<float> scale;
    std::vector<float> sum;
};

// Weights of one call: row n's groups start at q + n * row_bytes; scales and mins [N, G] (mins null for 8 bits).
struct Weights {
    const uint8_t* q;
    const float* scales;
    const float* mins;
    int64_t row_bytes;
};

struct Shape {
    int64_t m;
    int64_t k;
    int64_t g;
};

// Byte offset of x[j] (j < 32) of group g inside the quantized row, in the order the 4-bit AVX-512 loop reads.
inline int64_t pair_order(int64_t g, int64_t j, int64_t groups) {
    if ((g | 1) >= groups)  // the last group of an odd count stays in order
        return g * GROUP + j;
    const int64_t base = (g & ~int64_t(1)) * GROUP;
    return base + (j >= 16 ? 32 : 0) + (g & 1) * 16 + (j & 15);
}

template <typename T>
QuantizedX quantize_rows(const T* x, Shape s, bool paired) {
    QuantizedX out{std::vector<int8_t>(s.m * s.k), std::vector<float>(s.m * s.g), std::vector<float>(s.m * s.g)};
    for (int64_t m = 0; m < s.m; ++m) {
        for (int64_t g = 0; g < s.g; ++g) {
            float v[GROUP];
            float amax = 0.f;
            float sum = 0.f;
            for (int64_t j = 0; j < GROUP; ++j) {
                v[j] = static_cast<float>(x[m * s.k + g * GROUP + j]);
                amax = std::max(amax, std::fabs(v[j]));
                sum += v[j];
            }
            const float a = amax / 127.f;
            const float inv = a > 0.f ? 1.f / a : 0.f;
            int8_t* row = out.q.data() + m * s.k;
            for (int64_t j = 0; j < GROUP; ++j) {
                // round half to even, as torch.round: adding and subtracting 1.5 * 2^23 leaves no fraction bits
                // (|v * inv| <= 127), without a libm call (nearbyintf is one below SSE4.1, the build's baseline)
                const float r = (v[j] * inv + ROUNDER) - ROUNDER;
                const int64_t at = paired ? pair_order(g, j, s.g) : g * GROUP + j;
                row[at] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, r)));
            }
            out.scale[m * s.g + g] = a;
            out.sum[m * s.g + g] = sum;
        }
    }
    return out;
}

// ---- scalar -------------------------------------------------------------------------------------------------------

void row_scalar(const Weights& w, int64_t n, const QuantizedX& x, Shape s, bool four_bit, float* y) {
    const uint8_t* q = w.q + n * w.row_bytes;
    const float* d = w.scales + n * s.g;
    for (int64_t m = 0; m < s.m; ++m) {
        const int8_t* xq = x.q.data() + m * s.k;
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

// The 32 weights of a group as bytes in x's order: 4-bit nibbles split (unsigned 0..15), or 8-bit |q| (unsigned).
__attribute__((target("avx2,fma"))) inline __m256i load_group_avx2(const uint8_t* q, bool four_bit) {
    if (four_bit) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
        return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
    }
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
}

// ROWS: the row count when known at compile time (then the accumulators stay in registers: for_rows), 0 for s.m.
template <int ROWS>
__attribute__((target("avx2,fma"))) void row_avx2(const Weights& w, int64_t n, const QuantizedX& x, Shape s,
                                                  bool four_bit, float* y) {
    if (ROWS)
        s.m = ROWS;
    const uint8_t* q = w.q + n * w.row_bytes;
    const float* d = w.scales + n * s.g;
    const int64_t group_bytes = four_bit ? 16 : GROUP;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MAX_ROWS];
    for (int64_t m = 0; m < s.m; ++m)
        acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < s.g; ++g) {
        const __m256i wv = load_group_avx2(q + g * group_bytes, four_bit);
        const __m256i wu = four_bit ? wv : _mm256_sign_epi8(wv, wv);
        for (int64_t m = 0; m < s.m; ++m) {
            __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + m * s.k + g * GROUP));
            if (!four_bit)
                xv = _mm256_sign_epi8(xv, wv);
            const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wu, xv), ones);
            const __m256 scale = _mm256_set1_ps(d[g] * x.scale[m * s.g + g]);
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[m]);
        }
    }
    if (four_bit)  // + sum_g mins[g] * (sum of x over group g), 8 groups a vector
        for (int64_t m = 0; m < s.m; ++m) {
            const float* mins = w.mins + n * s.g;
            const float* sums = x.sum.data() + m * s.g;
            int64_t g = 0;
            for (; g + 8 <= s.g; g += 8)
                acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(mins + g), _mm256_loadu_ps(sums + g), acc[m]);
            float rest = 0.f;
            for (; g < s.g; ++g)
                rest += mins[g] * sums[g];
            acc[m] = _mm256_add_ps(acc[m], _mm256_set_ps(0, 0, 0, 0, 0, 0, 0, rest));
        }
    for (int64_t m = 0; m < s.m; ++m)
        y[m] = hsum256(acc[m]);
}

// ---- AVX-512 VNNI -------------------------------------------------------------------------------------------------

#define QGEMV_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))

// Groups g and g + 1 as 64 unsigned bytes (4-bit: in pair_order; 8-bit: |q|) and, for 8 bits, the signs of q.
QGEMV_AVX512 inline __m512i load_pair_avx512(const uint8_t* q, bool four_bit, __mmask64* negative) {
    if (four_bit) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1);
        return _mm512_and_si512(both, _mm512_set1_epi8(0x0F));
    }
    const __m512i wv = _mm512_loadu_si512(q);
    *negative = _mm512_movepi8_mask(wv);
    return _mm512_abs_epi8(wv);
}

template <int ROWS>
QGEMV_AVX512 void row_avx512(const Weights& w, int64_t n, const QuantizedX& x, Shape s, bool four_bit, float* y) {
    if (ROWS)
        s.m = ROWS;
    const uint8_t* q = w.q + n * w.row_bytes;
    const float* d = w.scales + n * s.g;
    const int64_t group_bytes = four_bit ? 16 : GROUP;
    // 4-bit lanes (4 int32 each) alternate groups g, g + 1, g, g + 1; 8-bit lanes hold g then g + 1
    const __mmask16 second = four_bit ? 0xF0F0 : 0xFF00;
    const __m512i zero = _mm512_setzero_si512();
    __m512 acc[MAX_ROWS];
    for (int64_t m = 0; m < s.m; ++m)
        acc[m] = _mm512_setzero_ps();
    int64_t g = 0;
    for (; g + 2 <= s.g; g += 2) {
        __mmask64 negative = 0;
        const __m512i wu = load_pair_avx512(q + g * group_bytes, four_bit, &negative);
        for (int64_t m = 0; m < s.m; ++m) {
            __m512i xv = _mm512_loadu_si512(x.q.data() + m * s.k + g * GROUP);
            if (!four_bit)
                xv = _mm512_mask_sub_epi8(xv, negative, zero, xv);
            const __m512i dot = _mm512_dpbusd_epi32(zero, wu, xv);
            const float* a = x.scale.data() + m * s.g + g;
            const __m512 scale = _mm512_mask_blend_ps(second, _mm512_set1_ps(d[g] * a[0]), _mm512_set1_ps(d[g + 1] * a[1]));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[m]);
        }
    }
    __m256 tail[MAX_ROWS];
    for (int64_t m = 0; m < s.m; ++m)
        tail[m] = _mm256_setzero_ps();
    if (g < s.g) {  // an odd group count: the last group, in order, 256 bits wide
        const __m256i wv = load_group_avx2(q + g * group_bytes, four_bit);
        const __m256i wu = four_bit ? wv : _mm256_sign_epi8(wv, wv);
        for (int64_t m = 0; m < s.m; ++m) {
            __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + m * s.k + g * GROUP));
            if (!four_bit)
                xv = _mm256_sign_epi8(xv, wv);
            const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wu, xv);
            tail[m] = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d[g] * x.scale[m * s.g + g]));
        }
    }
    if (four_bit)  // + sum_g mins[g] * (sum of x over group g), 16 groups a vector, the rest masked
        for (int64_t m = 0; m < s.m; ++m) {
            const float* mins = w.mins + n * s.g;
            const float* sums = x.sum.data() + m * s.g;
            for (int64_t h = 0; h < s.g; h += 16) {
                const __mmask16 live = s.g - h >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (s.g - h)) - 1);
                const __m512 a = _mm512_maskz_loadu_ps(live, mins + h);
                acc[m] = _mm512_fmadd_ps(a, _mm512_maskz_loadu_ps(live, sums + h), acc[m]);
            }
        }
    for (int64_t m = 0; m < s.m; ++m)
        y[m] = _mm512_reduce_add_ps(acc[m]) + hsum256(tail[m]);
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
    TORCH_CHECK_VALUE(isa >= ISA_SCALAR && isa <= ISA_AVX512, "qgemv: unknown isa ", isa);
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

using RowFn = void (*)(const Weights&, int64_t, const QuantizedX&, Shape, bool, float*);

// The row function for m rows: compiled for m = 1..8 (its accumulators then stay in registers), generic above.
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

template <int ROWS>
struct Avx512Rows {
    static void run(const Weights& w, int64_t n, const QuantizedX& x, Shape s, bool four_bit, float* y) {
        row_avx512<ROWS>(w, n, x, s, four_bit, y);
    }
};

template <int ROWS>
struct Avx2Rows {
    static void run(const Weights& w, int64_t n, const QuantizedX& x, Shape s, bool four_bit, float* y) {
        row_avx2<ROWS>(w, n, x, s, four_bit, y);
    }
};

template <typename T>
void run(const T* x, const Weights& w, Shape s, int64_t n, bool four_bit, int64_t isa, T* out) {
    const QuantizedX xq = quantize_rows(x, s, four_bit && isa == ISA_AVX512);
    const int64_t grain = std::max<int64_t>(1, 16384 / (w.row_bytes * s.m));
    const RowFn kernel_avx512 = for_rows<Avx512Rows>(s.m);
    const RowFn kernel_avx2 = for_rows<Avx2Rows>(s.m);
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
        float y[MAX_ROWS];
        for (int64_t row = begin; row < end; ++row) {
            if (isa == ISA_AVX512)
                kernel_avx512(w, row, xq, s, four_bit, y);
            else if (isa == ISA_AVX2)
                kernel_avx2(w, row, xq, s, four_bit, y);
            else
                row_scalar(w, row, xq, s, four_bit, y);
            for (int64_t m = 0; m < s.m; ++m)
                out[m * n + row] = static_cast<T>(y[m]);
        }
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
        run(x.data_ptr<float>(), w, s, n, four_bit, isa, out.data_ptr<float>());
    else
        run(x.data_ptr<at::BFloat16>(), w, s, n, four_bit, isa, out.data_ptr<at::BFloat16>());
    return out;
}

}  // namespace

TORCH_LIBRARY(radixserve_qgemv, m) {
    m.def("qgemv(Tensor x, Tensor qweight, Tensor scales, Tensor mins, int bits, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve_qgemv, CPU, m) { m.impl("qgemv", &qgemv); }
