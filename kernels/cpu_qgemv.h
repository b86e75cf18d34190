// What the qgemv op's two sources share (kernels/cpu_qgemv.cpp, the operator and its integer dot products;
// kernels/cpu_qgemv_bf16.cpp, the bfloat16 dot products of few-row steps): the layouts of one call and the row
// functions' signature.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <vector>

namespace radixserve_qgemv {

constexpr int64_t GROUP = 32;
constexpr int64_t MAX_ROWS = 16;
constexpr int64_t ISA_SCALAR = 0;
constexpr int64_t ISA_AVX2 = 1;
constexpr int64_t ISA_AVX512 = 2;
constexpr int64_t ISA_AVX512_BF16 = 3;  // ISA_AVX512, and bfloat16 x of 2 or more rows in bfloat16 dot products

// x as a call's rows read it. Integer dot products: x rounded per row per group, q [M, K] int16, scale a [M, G],
// a * (sum of q over the group) [M, G] (float); for the paired order (4-bit AVX-512), lanes [M, G / 2, 16]: a of
// group 2p in lanes 0-7 and of group 2p + 1 in lanes 8-15. bfloat16 dot products: bf16 [M, K], x's bits unchanged,
// 4-bit weights' x in pair_order.
struct QuantizedX {
    std::vector<int16_t> q;
    std::vector<float> scale;
    std::vector<float> sum;
    std::vector<float> lanes;
    std::vector<uint16_t> bf16;
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

// Weight rows begin .. end - 1 of one call: y [end - begin, M] float32.
using RowFn = void (*)(const Weights&, int64_t, int64_t, const QuantizedX&, Shape, bool, float*);

// Index of x[j] (j < 32) of group g inside its row, in the order the 4-bit AVX-512 loops read a pair of groups:
// [g 0..15, g + 1 0..15, g 16..31, g + 1 16..31] (the last group of an odd count stays in order).
inline int64_t pair_order(int64_t g, int64_t j, int64_t groups) {
    if ((g | 1) >= groups)
        return g * GROUP + j;
    const int64_t base = (g & ~int64_t(1)) * GROUP;
    return base + (j >= 16 ? 32 : 0) + (g & 1) * 16 + (j & 15);
}

// x [M, K] bfloat16 as the bfloat16 row functions read it (QuantizedX.bf16; paired: 4-bit weights' pair_order).
QuantizedX order_bf16(const c10::BFloat16* x, Shape s, bool paired);

// The bfloat16 row function for m rows of x (2 <= m <= MAX_ROWS; ISA_AVX512_BF16 CPUs only).
RowFn bf16_rows(int64_t m);

}  // namespace radixserve_qgemv
