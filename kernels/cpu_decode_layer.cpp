// One decoder layer of a decode step in one call, for CPU: norm, qkv, q/k norms, rotary, store KV, paged attention,
// o, residual, norm, gate_up, activation, down, residual. A torch operator, torch.ops.radixserve_layer.decode_layer,
// built on first use by kernels/cpu_decode_layer.py.
//
// Why: at one token per step a layer's arithmetic is a few hundred thousand multiply-adds on weights the qgemv op
// reads; what Python added around it (about 170 torch ops per layer, each a dispatch, an allocation and a Python
// frame) cost as much as the weights. Here each projection is the kernel Python would run for these rows (the qgemv
// op, torch.ops.radixserve_qgemv.qgemv, through the dispatcher; torch's int4 / int8 weight-only kernels; at::linear)
// and the attention the paged decode op (torch.ops.radixserve.paged_decode); the rest is loops over a few thousand
// values per row.
//
// Numerics: the result is the Python layer's (runtime/model/models/decoder.py) with the same rounding points. In
// bfloat16 every value Python holds as a bfloat16 tensor is rounded to bfloat16 here at the same place (the norm's
// output, each of the rotary's x * cos, roll(x) * sin and their sum, the activation, its product with up, each
// residual sum), arithmetic in float32 in between; in float32 the operations and their order are Python's, so
// results differ from the Python layer only by the order of the norms' sums of squares and by exp / tanh's last
// bit. -ffp-contract=off keeps a * b + c from fusing into one rounding.
//
// Layout: x [T, hidden], T rows of one token each (a decode step: row i is sequence i's token at positions[i],
// written to slot_mapping[i], -1: not written); k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim];
// cos, sin_signed [max_positions, head_dim] (RotaryEmbedding's tables, the whole head rotated); qkv's rows are q
// heads, then k heads, then v heads.
#include <ATen/EmptyTensor.h>
#include <ATen/Functions.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// norms: six tensors in this order; an absent norm (the family has none there) is an empty tensor.
enum NormSlot : int64_t { IN_NORM, POST_ATTENTION_NORM, PRE_MLP_NORM, POST_MLP_NORM, Q_NORM, K_NORM, NUM_NORMS };
// linears: three tensors per projection in this order, read as its kind says (kernels/cpu_decode_layer.py's KINDS):
//   QGEMV4, QGEMV8: (qweight, scales, mins) of the qgemv op (8 bits: scales again as mins);
//   TORCH_INT4: (qweight, scales_and_zeros, unused) of aten._weight_int4pack_mm_for_cpu, with its group size;
//   TORCH_INT8: (qweight, scales, unused) of aten._weight_int8pack_mm;
//   DENSE: (weight, unused, unused) for at::linear.
// The torch kernels run in bfloat16 (x converted, the output back), as runtime/model/quant*.py run them.
enum LinearSlot : int64_t { QKV, O_PROJ, GATE_UP, DOWN, NUM_LINEARS };
enum LinearKind : int64_t { QGEMV4, QGEMV8, TORCH_INT4, TORCH_INT8, DENSE };
constexpr int64_t LLAMA_NORM = 0;  // weight * round(norm(x)), weight in the model dtype
constexpr int64_t GEMMA_NORM = 1;  // round(norm(x) * scale), scale = 1 + weight in float32
constexpr int64_t SILU = 0;
constexpr int64_t GELU_TANH = 1;

using QgemvFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                           int64_t);
using PagedDecodeFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, double, int64_t);

// x rounded to the model dtype T and back (the identity for float).
template <typename T>
inline float round_to(float x) {
    return static_cast<float>(static_cast<T>(x));
}

struct Linear {
    const at::Tensor* qweight;
    const at::Tensor* scales;
    const at::Tensor* mins;
    int64_t kind;
    int64_t group_size;
};

struct Layer {
    std::vector<at::Tensor> norms;
    std::vector<Linear> linears;
    int64_t num_heads, num_kv_heads, head_dim, norm_kind, act, isa;
    float eps;
};

at::Tensor qgemv(const at::Tensor& x, const Linear& w, int64_t isa) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("radixserve_qgemv::qgemv", "")
                               .typed<QgemvFn>();
    return op.call(x, *w.qweight, *w.scales, *w.mins, w.kind == QGEMV4 ? 4 : 8, isa);
}

// x [T, K] @ W.T -> [T, N] in x's dtype by the projection's kind (+ bias for DENSE: F.linear adds it inside; the
// other kinds' callers add it after, as Python does). int8: x copied when its data is not 64-byte aligned (the
// kernel's aligned loads: runtime/model/quant.py).
at::Tensor project(const at::Tensor& x, const Linear& w, int64_t isa, const std::optional<at::Tensor>& bias) {
    if (w.kind == QGEMV4 || w.kind == QGEMV8)
        return qgemv(x, w, isa);
    if (w.kind == DENSE)
        return at::linear(x, *w.qweight, bias);
    at::Tensor inner = x.to(at::kBFloat16).contiguous();
    at::Tensor out;
    if (w.kind == TORCH_INT4) {
        out = at::_weight_int4pack_mm_for_cpu(inner, *w.qweight, w.group_size, *w.scales);
    } else {
        if (reinterpret_cast<uintptr_t>(inner.data_ptr()) % 64)
            inner = inner.clone();
        out = at::_weight_int8pack_mm(inner, *w.qweight, *w.scales);
    }
    return out.scalar_type() == x.scalar_type() ? out : out.to(x.scalar_type());
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("radixserve::paged_decode", "")
                               .typed<PagedDecodeFn>();
    return op.call(q, k_cache, v_cache, block_tables, seq_lens, scale, window);
}

// RMSNorm (Zhang & Sennrich 2019) of one vector of n values in the family's form (runtime/model/models/norms.py).
template <typename T>
void rms_norm(const T* x, int64_t n, const at::Tensor& weight, int64_t kind, float eps, T* out) {
    float squares = 0.f;
    for (int64_t j = 0; j < n; ++j) {
        const float v = static_cast<float>(x[j]);
        squares += v * v;
    }
    const float rstd = 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
    if (kind == GEMMA_NORM) {
        const float* scale = weight.data_ptr<float>();
        for (int64_t j = 0; j < n; ++j)
            out[j] = static_cast<T>(static_cast<float>(x[j]) * rstd * scale[j]);
        return;
    }
    const T* w = weight.data_ptr<T>();
    for (int64_t j = 0; j < n; ++j)
        out[j] = static_cast<T>(round_to<T>(static_cast<float>(x[j]) * rstd) * static_cast<float>(w[j]));
}

// Rotary (RoFormer, Su et al. 2021, sec. 3.4), rotate-half form: x * cos + roll(x, d / 2) * sin_signed, each product
// and the sum rounded as Python's three bfloat16 ops are.
template <typename T>
void rotate(const T* x, const T* cos, const T* sin_signed, int64_t d, T* out) {
    const int64_t half = d / 2;
    for (int64_t j = 0; j < d; ++j) {
        const int64_t rolled = j < half ? j + half : j - half;
        const float a = round_to<T>(static_cast<float>(x[j]) * static_cast<float>(cos[j]));
        const float b = round_to<T>(static_cast<float>(x[rolled]) * static_cast<float>(sin_signed[j]));
        out[j] = static_cast<T>(a + b);
    }
}

// One q or k head: its norm (when the family has one) then the rotation, into out.
template <typename T>
void norm_and_rotate(const T* head, const at::Tensor& norm, const Layer& l, const T* cos, const T* sin_signed,
                     T* scratch, T* out) {
    const T* src = head;
    if (norm.numel() > 0) {
        rms_norm(head, l.head_dim, norm, l.norm_kind, l.eps, scratch);
        src = scratch;
    }
    rotate(src, cos, sin_signed, l.head_dim, out);
}

inline float activation(float v, int64_t act) {
    if (act == GELU_TANH) {
        const float k_beta = 0.7978845608028654f;  // sqrt(2 / pi)
        return 0.5f * v * (1.f + std::tanh(k_beta * (v + 0.044715f * v * v * v)));
    }
    return v / (1.f + std::exp(-v));
}

// Each row's q heads (normed, rotated) into q [T, num_heads, head_dim]; its k heads (normed, rotated) and v heads
// into the caches at its slot.
template <typename T>
void rotate_and_store(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& slot_mapping,
                      const at::Tensor& cos, const at::Tensor& sin_signed, at::Tensor& k_cache, at::Tensor& v_cache,
                      const Layer& l, at::Tensor& q) {
    const int64_t rows = qkv.size(0), d = l.head_dim, width = qkv.size(1);
    const int64_t slot_stride = l.num_kv_heads * d;  // a slot's K (or V) values in the cache
    std::vector<T> scratch(d);
    for (int64_t i = 0; i < rows; ++i) {
        const T* row = qkv.data_ptr<T>() + i * width;
        const int64_t pos = positions.data_ptr<int64_t>()[i];
        const T* cos_row = cos.data_ptr<T>() + pos * d;
        const T* sin_row = sin_signed.data_ptr<T>() + pos * d;
        T* q_row = q.data_ptr<T>() + i * l.num_heads * d;
        for (int64_t h = 0; h < l.num_heads; ++h)
            norm_and_rotate(row + h * d, l.norms[Q_NORM], l, cos_row, sin_row, scratch.data(), q_row + h * d);
        const int64_t slot = slot_mapping.data_ptr<int64_t>()[i];
        if (slot < 0)
            continue;
        T* k_slot = k_cache.data_ptr<T>() + slot * slot_stride;
        T* v_slot = v_cache.data_ptr<T>() + slot * slot_stride;
        const T* k_heads = row + l.num_heads * d;
        const T* v_heads = k_heads + l.num_kv_heads * d;
        for (int64_t h = 0; h < l.num_kv_heads; ++h)
            norm_and_rotate(k_heads + h * d, l.norms[K_NORM], l, cos_row, sin_row, scratch.data(), k_slot + h * d);
        std::copy(v_heads, v_heads + l.num_kv_heads * d, v_slot);
    }
}

// Each row of x through a norm (the identity when the slot is empty) into a new [T, n] tensor.
template <typename T>
at::Tensor norm_rows(const at::Tensor& x, const Layer& l, int64_t slot) {
    const at::Tensor& norm = l.norms[slot];
    if (norm.numel() == 0)
        return x;
    const int64_t rows = x.size(0), n = x.size(1);
    at::Tensor out = at::detail::empty_cpu({rows, n}, x.scalar_type(), false, std::nullopt);
    for (int64_t i = 0; i < rows; ++i)
        rms_norm(x.data_ptr<T>() + i * n, n, norm, l.norm_kind, l.eps, out.data_ptr<T>() + i * n);
    return out;
}

// residual += y, rounded to T (Python's bfloat16 add).
template <typename T>
void add_into(at::Tensor& residual, const at::Tensor& y) {
    T* r = residual.data_ptr<T>();
    const T* v = y.data_ptr<T>();
    for (int64_t j = 0; j < residual.numel(); ++j)
        r[j] = static_cast<T>(static_cast<float>(r[j]) + static_cast<float>(v[j]));
}

// act(gate) * up of gate_up [T, 2 * inter] (gate columns first) into a new [T, inter] tensor.
template <typename T>
at::Tensor gated(const at::Tensor& gate_up, int64_t act) {
    const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
    at::Tensor out = at::detail::empty_cpu({rows, inter}, gate_up.scalar_type(), false, std::nullopt);
    for (int64_t i = 0; i < rows; ++i) {
        const T* gate = gate_up.data_ptr<T>() + i * 2 * inter;
        const T* up = gate + inter;
        T* o = out.data_ptr<T>() + i * inter;
        for (int64_t j = 0; j < inter; ++j) {
            const float a = round_to<T>(activation(static_cast<float>(gate[j]), act));
            o[j] = static_cast<T>(a * static_cast<float>(up[j]));
        }
    }
    return out;
}

// qkv + bias, rounded to T (Python's out + bias).
template <typename T>
void add_bias(at::Tensor& qkv, const at::Tensor& bias) {
    const int64_t rows = qkv.size(0), width = qkv.size(1);
    const T* b = bias.data_ptr<T>();
    for (int64_t i = 0; i < rows; ++i) {
        T* row = qkv.data_ptr<T>() + i * width;
        for (int64_t j = 0; j < width; ++j)
            row[j] = static_cast<T>(static_cast<float>(row[j]) + static_cast<float>(b[j]));
    }
}

template <typename T>
at::Tensor run(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& slot_mapping,
               const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& k_cache, at::Tensor& v_cache,
               const at::Tensor& cos, const at::Tensor& sin_signed, const std::optional<at::Tensor>& qkv_bias,
               const Layer& l, int64_t window, double scale) {
    const int64_t rows = x.size(0);
    const bool dense_qkv = l.linears[QKV].kind == DENSE;
    at::Tensor qkv = project(norm_rows<T>(x, l, IN_NORM), l.linears[QKV], l.isa, dense_qkv ? qkv_bias : std::nullopt);
    TORCH_CHECK_VALUE(qkv.size(1) == (l.num_heads + 2 * l.num_kv_heads) * l.head_dim,
                      "decode_layer: qkv has ", qkv.size(1), " columns, the heads need ",
                      (l.num_heads + 2 * l.num_kv_heads) * l.head_dim);
    if (qkv_bias.has_value() && !dense_qkv)
        add_bias<T>(qkv, *qkv_bias);
    at::Tensor q = at::detail::empty_cpu({rows, l.num_heads, l.head_dim}, x.scalar_type(), false, std::nullopt);
    rotate_and_store<T>(qkv, positions, slot_mapping, cos, sin_signed, k_cache, v_cache, l, q);
    at::Tensor attn = paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, window);
    at::Tensor o = project(attn.view({rows, l.num_heads * l.head_dim}), l.linears[O_PROJ], l.isa, std::nullopt);
    at::Tensor hidden = x.clone();
    add_into<T>(hidden, norm_rows<T>(o, l, POST_ATTENTION_NORM));
    at::Tensor gate_up = project(norm_rows<T>(hidden, l, PRE_MLP_NORM), l.linears[GATE_UP], l.isa, std::nullopt);
    at::Tensor down = project(gated<T>(gate_up, l.act), l.linears[DOWN], l.isa, std::nullopt);
    add_into<T>(hidden, norm_rows<T>(down, l, POST_MLP_NORM));
    return hidden;
}

void check_norm(const at::Tensor& norm, int64_t n, int64_t kind, at::ScalarType dtype, const char* what) {
    if (norm.numel() == 0)
        return;
    const auto want = kind == GEMMA_NORM ? at::kFloat : dtype;
    TORCH_CHECK_VALUE(norm.dim() == 1 && norm.size(0) == n && norm.is_contiguous() && norm.scalar_type() == want,
                      "decode_layer: ", what, " norm must be contiguous ", want, " [", n, "], got ", norm.sizes(),
                      " ", norm.scalar_type());
}

void check_index(const at::Tensor& t, int64_t rows, const char* what) {
    TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == rows && t.is_contiguous() && t.scalar_type() == at::kLong,
                      "decode_layer: ", what, " must be contiguous int64 [", rows, "], got ", t.sizes(), " ",
                      t.scalar_type());
}

void check_inputs(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& slot_mapping,
                  const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cos,
                  const at::Tensor& sin_signed, const std::optional<at::Tensor>& qkv_bias, const Layer& l) {
    const auto dtype = x.scalar_type();
    TORCH_CHECK_VALUE(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && x.size(0) >= 1 &&
                          (dtype == at::kFloat || dtype == at::kBFloat16),
                      "decode_layer: x must be a contiguous float32 or bfloat16 CPU [T >= 1, hidden], got ",
                      x.sizes(), " ", dtype);
    const int64_t rows = x.size(0), d = l.head_dim;
    check_index(positions, rows, "positions");
    check_index(slot_mapping, rows, "slot_mapping");
    TORCH_CHECK_VALUE(l.num_heads >= 1 && l.num_kv_heads >= 1 && d % 2 == 0, "decode_layer: bad heads ",
                      l.num_heads, " / ", l.num_kv_heads, " of ", d);
    for (const at::Tensor* cache : {&k_cache, &v_cache})
        TORCH_CHECK_VALUE(cache->dim() == 4 && cache->is_contiguous() && cache->scalar_type() == dtype &&
                              cache->size(2) == l.num_kv_heads && cache->sizes() == k_cache.sizes(),
                          "decode_layer: the caches must be contiguous ", dtype, " [blocks, block_size, ",
                          l.num_kv_heads, ", head_dim], got ", cache->sizes(), " ", cache->scalar_type());
    for (const at::Tensor* table : {&cos, &sin_signed})
        TORCH_CHECK_VALUE(table->dim() == 2 && table->is_contiguous() && table->scalar_type() == dtype &&
                              table->size(1) == d && table->sizes() == cos.sizes(),
                          "decode_layer: cos and sin_signed must be contiguous ", dtype, " [positions, ", d,
                          "], got ", table->sizes(), " ", table->scalar_type());
    const int64_t* pos = positions.data_ptr<int64_t>();
    for (int64_t i = 0; i < rows; ++i)
        TORCH_CHECK_VALUE(pos[i] >= 0 && pos[i] < cos.size(0), "decode_layer: position ", pos[i],
                          " is outside the rotary tables' ", cos.size(0));
    const int64_t* slot = slot_mapping.data_ptr<int64_t>();
    const int64_t slots = k_cache.size(0) * k_cache.size(1);
    for (int64_t i = 0; i < rows; ++i)
        TORCH_CHECK_VALUE(slot[i] < slots, "decode_layer: slot ", slot[i], " is outside the cache's ", slots,
                          " slots");
    const int64_t hidden = x.size(1);
    check_norm(l.norms[IN_NORM], hidden, l.norm_kind, dtype, "input");
    check_norm(l.norms[POST_ATTENTION_NORM], hidden, l.norm_kind, dtype, "post-attention");
    check_norm(l.norms[PRE_MLP_NORM], hidden, l.norm_kind, dtype, "pre-MLP");
    check_norm(l.norms[POST_MLP_NORM], hidden, l.norm_kind, dtype, "post-MLP");
    check_norm(l.norms[Q_NORM], d, l.norm_kind, dtype, "q");
    check_norm(l.norms[K_NORM], d, l.norm_kind, dtype, "k");
    TORCH_CHECK_VALUE(l.norms[IN_NORM].numel() > 0 && l.norms[PRE_MLP_NORM].numel() > 0,
                      "decode_layer: the input and pre-MLP norms are required");
    TORCH_CHECK_VALUE((l.norms[Q_NORM].numel() > 0) == (l.norms[K_NORM].numel() > 0),
                      "decode_layer: q and k norms come together");
    const int64_t width = (l.num_heads + 2 * l.num_kv_heads) * d;
    if (qkv_bias.has_value())
        TORCH_CHECK_VALUE(qkv_bias->dim() == 1 && qkv_bias->size(0) == width && qkv_bias->is_contiguous() &&
                              qkv_bias->scalar_type() == dtype,
                          "decode_layer: qkv_bias must be contiguous ", dtype, " [", width, "]");
    TORCH_CHECK_VALUE(l.norm_kind == LLAMA_NORM || l.norm_kind == GEMMA_NORM, "decode_layer: unknown norm kind ",
                      l.norm_kind);
    TORCH_CHECK_VALUE(l.act == SILU || l.act == GELU_TANH, "decode_layer: unknown activation ", l.act);
}

at::Tensor decode_layer(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& slot_mapping,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& k_cache,
                        at::Tensor& v_cache, const at::Tensor& cos, const at::Tensor& sin_signed,
                        at::TensorList norms, at::TensorList linears, at::IntArrayRef kinds,
                        at::IntArrayRef group_sizes,
                        const std::optional<at::Tensor>& qkv_bias, int64_t num_heads, int64_t num_kv_heads,
                        int64_t window, int64_t isa, int64_t norm_kind, int64_t act, double eps, double scale) {
    TORCH_CHECK_VALUE(static_cast<int64_t>(norms.size()) == NUM_NORMS, "decode_layer: ", NUM_NORMS,
                      " norms expected, got ", norms.size());
    TORCH_CHECK_VALUE(static_cast<int64_t>(linears.size()) == 3 * NUM_LINEARS &&
                          static_cast<int64_t>(kinds.size()) == NUM_LINEARS &&
                          static_cast<int64_t>(group_sizes.size()) == NUM_LINEARS,
                      "decode_layer: ", 3 * NUM_LINEARS, " linear tensors, ", NUM_LINEARS, " kinds and group sizes "
                      "expected");
    for (const int64_t kind : kinds)
        TORCH_CHECK_VALUE(kind >= QGEMV4 && kind <= DENSE, "decode_layer: unknown projection kind ", kind);
    TORCH_CHECK_VALUE(k_cache.dim() == 4, "decode_layer: k_cache must be 4-D, got ", k_cache.sizes());
    Layer l{std::vector<at::Tensor>(norms.begin(), norms.end()), {}, num_heads, num_kv_heads, k_cache.size(3),
            norm_kind, act, isa, static_cast<float>(eps)};
    for (int64_t i = 0; i < NUM_LINEARS; ++i)
        l.linears.push_back({&linears[3 * i], &linears[3 * i + 1], &linears[3 * i + 2], kinds[i], group_sizes[i]});
    check_inputs(x, positions, slot_mapping, k_cache, v_cache, cos, sin_signed, qkv_bias, l);
    if (x.scalar_type() == at::kFloat)
        return run<float>(x, positions, slot_mapping, block_tables, seq_lens, k_cache, v_cache, cos, sin_signed,
                          qkv_bias, l, window, scale);
    return run<at::BFloat16>(x, positions, slot_mapping, block_tables, seq_lens, k_cache, v_cache, cos, sin_signed,
                             qkv_bias, l, window, scale);
}

}  // namespace

TORCH_LIBRARY(radixserve_layer, m) {
    m.def("decode_layer(Tensor x, Tensor positions, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
          "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cos, Tensor sin_signed, Tensor[] norms, Tensor[] linears, "
          "int[] kinds, int[] group_sizes, Tensor? qkv_bias, int num_heads, int num_kv_heads, int window, int isa, int norm_kind, "
          "int act, float eps, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve_layer, CPU, m) { m.impl("decode_layer", &decode_layer); }
