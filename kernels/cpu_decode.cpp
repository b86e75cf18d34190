// Fused paged decode attention for CPU, float32 and bfloat16: one query token per sequence, K/V read in place
// through the block table (no gather), one pass over each K/V row with an online softmax. A torch operator,
// torch.ops.radixserve.paged_decode, built on first use by kernels/cpu_decode.py.
//
// Layout (kernels/__init__.py): k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim], contiguous;
// q [num_seqs, num_heads, head_dim], head_dim contiguous; out [num_seqs, num_heads, head_dim], contiguous, dtype of
// q. The G = num_heads / num_kv_heads query heads of a KV head are heads kvh * G .. kvh * G + G - 1, and they share
// every K/V row read: up to MAX_GROUP of them go through a tile together (each K/V row loaded and converted once,
// their softmax steps interleaved), each with the arithmetic of a lone head, so the output does not depend on G.
// Scores, softmax and the accumulator are float32 whatever the cache dtype.
//
// Online softmax: Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; the tile-wise rescaling of
// the output accumulator is FlashAttention's (Dao et al. 2022, alg. 1; FlashAttention-2, Dao 2023, sec. 3.1). Scores
// of one tile (up to TILE tokens of a block) are computed first, then the running max m, the normalizer l and the
// accumulator acc are rescaled once per tile by exp(m_old - m_new).
//
// Memory bounds float32 decode: each work item reads a sequence's blocks front to back and prefetches the next
// block of the table into L2 while it computes on the current one (block ids are scattered, so the hardware
// prefetcher cannot guess it). bfloat16 halves the bytes; its conversion to float32 is a shift or a mask (a
// float32's upper half). Vectors are the compiler's generic vectors (GCC >= 12 or Clang) of 16 floats (AVX-512) or 8
// (otherwise), so one source builds for AVX-512 and for AVX2 (-march=native picks).
//
// Sliding window (kernels.paged_attention's rule): the query at position L - 1 sees keys L - W .. L - 1 only. A work
// item starts at the block holding key L - W and, inside it, at that key: blocks before the window are never read.
//
// Threads: at::parallel_for, i.e. torch's intra-op pool. Its OpenMP backend is inline in ATen's headers, hence
// -fopenmp; the library links no OpenMP runtime of its own (no -lgomp): the GOMP_* calls resolve to the runtime
// libtorch_cpu loaded, so there is one pool, not two. Inside it the work items are handed out one at a time (an
// atomic counter: ragged lengths balance), and each item's result depends only on its inputs, so the output is the
// same for any thread count. On one torch thread with the qgemv op's helper thread on (kernels/cpu_share.h: a decode
// step's second core, taken only while idle), the work items are shared with it instead: the qgemv library hands this
// one its share_work and helper_on (link_helper, from kernels/cpu_decode.py's share_helper; each library is loaded
// on its own, so the helper, a singleton of the qgemv library, is reached through these two pointers).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/EmptyTensor.h>
#include <torch/library.h>

#include "cpu_decode.h"
#include "cpu_share.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

namespace {

using namespace radixserve_cpu;

// Below this many K rows (tokens x kv heads) in the batch the kernel runs on the calling thread: waking the pool
// costs more than it saves.
constexpr int64_t MIN_PARALLEL_ROWS = 1024;

template <typename T>
inline void prefetch_row(const T* row, int64_t n) {
    // Into L2, not L1 (locality 2: prefetcht1): a block's K and V (24 KB in float32 for SmolLM2) pulled into L1
    // evict the tile being read, and measured no faster than no prefetch at all; into L2 it was 1.5x faster.
    for (int64_t i = 0; i < n; i += 64 / static_cast<int64_t>(sizeof(T))) __builtin_prefetch(row + i, 0, 2);
}

// Shapes and element strides shared by all work items.
struct Problem {
    int64_t block_size, num_kv_heads, group, head_dim;
    int64_t q_ss, q_sh;        // q: sequence, head
    int64_t c_sb, c_st, c_sh;  // k_cache and v_cache: block, token, kv head
    int64_t o_ss, o_sh;        // out: sequence, head
    float scale;
};

// One thread's working memory, sized for a work item of all kv heads: q rows (scaled), accumulators, m, l.
struct Scratch {
    std::vector<float> qs, acc, m, l;
    Scratch(int64_t rows, int64_t d) : qs(rows * d), acc(rows * d), m(rows), l(rows) {}
};

// Up to this many query heads of a KV head are computed together (attend's G); a larger group goes head by head.
constexpr int64_t MAX_GROUP = 8;

// Vectors of a V row updated per pass of attend_tile's value loop: G * value_chunk(G) accumulators stay in registers
// (16 of the 32 AVX-512 registers, 8 of AVX2's 16; at least 2). Even, so a chunk holds whole bfloat16 pairs of
// load_row.
constexpr int64_t value_chunk(int64_t g) {
    const int64_t fit = (W == 16 ? 16 : 8) / g / 2 * 2;
    return fit > 2 ? fit : 2;
}

// The softmax of G heads over a tile, given each head's W-lane partial dot products part[g][t] (t < TILE, tokens
// past n are 0): s[g] = exp(score - m_new) (0 past n), m[g] and l[g] updated, corr[g] = exp(m_old - m_new), the
// rescale of head g's accumulator. Each step runs for all G heads before the next, so their latencies overlap.
template <int64_t G>
__attribute__((always_inline)) inline void softmax_tile(const vec (*part)[TILE], int64_t n, float (*s)[TILE],
                                                        float* m, float* l, float* corr) {
    float m_new[G];
    for (int64_t g = 0; g < G; g++) {
        store_vec(s[g], hsum_tile(part[g]));
        for (int64_t t = n; t < TILE; t++) s[g][t] = -INFINITY;  // the max ignores them
    }
    for (int64_t g = 0; g < G; g++) {
        m_new[g] = max_with(load_vec(s[g]), m[g]);
        corr[g] = m_new[g] == m[g] ? 1.0f : m[g] == -INFINITY ? 0.0f : std::exp(m[g] - m_new[g]);  // exp(0) = 1
    }
    exp_shifted<G>(s, m_new);
    for (int64_t g = 0; g < G; g++) {
        for (int64_t t = n; t < TILE; t++) s[g][t] = 0.0f;  // exp_shifted gave them ~1e-38
        l[g] = l[g] * corr[g] + hsum(load_vec(s[g]));
        m[g] = m_new[g];
    }
}

// The G query rows of one kv head against one tile of n <= TILE tokens (k, v: the tile's first rows, token stride
// st): scores, online-softmax update of m[g], l[g] and the accumulators acc (G rows of d = nc * W floats, row g at
// acc + g * d; qs likewise). Each K and V row is loaded (and converted from bfloat16) once for all G rows; each row's
// own arithmetic (its dot products, softmax, accumulation order) is that of G = 1, so the output does not depend on G.
template <typename T, int64_t NC, int64_t G>
inline void attend_tile(const float* qs, const T* k, const T* v, int64_t st, int64_t n, int64_t nc_rt, float* acc,
                        float* m, float* l) {
    constexpr int64_t NV = NC > 0 ? NC : MAX_NC, CB = value_chunk(G);
    const int64_t nc = NC > 0 ? NC : nc_rt, d = nc * W;
    vec qv[G][NV], row[NV], part[G][TILE];
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < nc; c++) qv[g][c] = load_vec(qs + g * d + W * c);
    for (int64_t t = 0; t < TILE; t++) {
        vec a[G] = {};
        if (t < n) {
            load_row<NC>(k + t * st, row, nc);
            for (int64_t g = 0; g < G; g++)
                for (int64_t c = 0; c < nc; c++) a[g] += qv[g][c] * row[c];
        }
        for (int64_t g = 0; g < G; g++) part[g][t] = a[g];
    }
    float s[G][TILE], corr[G];
    softmax_tile<G>(part, n, s, m, l, corr);
    for (int64_t c0 = 0; c0 < nc; c0 += CB) {  // CB vectors of every row's accumulator at a time, in registers
        const int64_t cn = std::min(CB, nc - c0);
        vec o[G][CB];
        for (int64_t g = 0; g < G; g++)
            for (int64_t j = 0; j < CB; j++)
                if (j < cn) o[g][j] = load_vec(acc + g * d + W * (c0 + j)) * corr[g];
        for (int64_t t = 0; t < n; t++) {
            load_chunk<CB>(v + t * st, row, c0, cn);
            for (int64_t g = 0; g < G; g++)
                for (int64_t j = 0; j < CB; j++)
                    if (j < cn) o[g][j] += s[g][t] * row[j];
        }
        for (int64_t g = 0; g < G; g++)
            for (int64_t j = 0; j < CB; j++)
                if (j < cn) store_vec(acc + g * d + W * (c0 + j), o[g][j]);
    }
}

// One sequence, kv heads h0 .. h1 - 1 (rows = (h1 - h0) * group, row r = (h - h0) * group + g is query head
// h0 * group + r), over the keys at positions first .. seq_len - 1. Blocks are visited in table order and, inside a
// block, head after head, so a block's bytes are read front to back while they are hot. table[j] is the block of
// positions (first / block_size + j) * block_size onwards: the blocks from the one holding `first` to the last.
// G = group (1 .. MAX_GROUP): a kv head's rows go through attend_tile together; G = 0: one by one.
template <typename T, int64_t NC, int64_t G>
void attend(const Problem& p, const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t first,
            int64_t seq_len, int64_t h0, int64_t h1, Scratch& w, T* out) {
    const int64_t d = NC > 0 ? NC * W : p.head_dim;  // a constant where it can be: the loops over d unroll
    const int64_t group = p.group, rows = (h1 - h0) * group, bs = p.block_size, st = p.c_st;
    float *qs = w.qs.data(), *acc = w.acc.data(), *m = w.m.data(), *l = w.l.data();
    for (int64_t r = 0; r < rows; r++) {
        const T* qr = q + (h0 * group + r) * p.q_sh;
        for (int64_t i = 0; i < d; i++) qs[r * d + slot(out, i, d)] = to_f32(qr[i]) * p.scale;
        std::fill(acc + r * d, acc + (r + 1) * d, 0.0f);
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    const int64_t first_block = first / bs;
    for (int64_t start = first_block * bs; start < seq_len; start += bs) {
        const int64_t j = start / bs - first_block, block = table[j], in_block = std::min(seq_len - start, bs);
        const int64_t skip = std::max<int64_t>(first - start, 0);  // keys of the first block before the window
        const T *next_k = nullptr, *next_v = nullptr;
        int64_t next_len = 0;
        if (start + bs < seq_len) {  // block ids are scattered: prefetch the next block's rows of each tile read
            const int64_t next = table[j + 1];
            next_k = k_cache + next * p.c_sb;
            next_v = v_cache + next * p.c_sb;
            next_len = std::min(seq_len - start - bs, bs);
        }
        for (int64_t t0 = skip; t0 < in_block; t0 += TILE) {
            const int64_t n = std::min(in_block - t0, TILE);
            for (int64_t h = h0; h < h1; h++) {
                const int64_t off = t0 * st + h * p.c_sh, r0 = (h - h0) * group;
                for (int64_t t = t0 - skip; t < std::min(t0 - skip + TILE, next_len); t++) {
                    prefetch_row(next_k + t * st + h * p.c_sh, d);
                    prefetch_row(next_v + t * st + h * p.c_sh, d);
                }
                const T *k = k_cache + block * p.c_sb + off, *v = v_cache + block * p.c_sb + off;
                if constexpr (G > 0)
                    attend_tile<T, NC, G>(qs + r0 * d, k, v, st, n, d / W, acc + r0 * d, m + r0, l + r0);
                else
                    for (int64_t r = r0; r < r0 + group; r++)
                        attend_tile<T, NC, 1>(qs + r * d, k, v, st, n, d / W, acc + r * d, m + r, l + r);
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        T* o = out + (h0 * group + r) * p.o_sh;
        for (int64_t i = 0; i < d; i++) store(o + i, acc[r * d + slot(out, i, d)] * inv);
    }
}

template <typename T>
using AttendFn = void (*)(const Problem&, const T*, const T*, const T*, const int64_t*, int64_t, int64_t, int64_t,
                          int64_t, Scratch&, T*);

// attend for this group size (G = group up to MAX_GROUP, else row by row), chosen once per call.
template <typename T, int64_t NC>
AttendFn<T> attend_for_group(int64_t group) {
    switch (group) {
        case 1: return attend<T, NC, 1>;
        case 2: return attend<T, NC, 2>;
        case 3: return attend<T, NC, 3>;
        case 4: return attend<T, NC, 4>;
        case 5: return attend<T, NC, 5>;
        case 6: return attend<T, NC, 6>;
        case 7: return attend<T, NC, 7>;
        case 8: return attend<T, NC, 8>;
        default: return attend<T, NC, 0>;
    }
}

// Constant head_dim cases keep q and the accumulator in registers (loops fully unrolled).
template <typename T>
AttendFn<T> attend_for(int64_t head_dim, int64_t group) {
    static_assert(MAX_GROUP == 8, "attend_for_group lists the group sizes 1 .. MAX_GROUP");
    if (head_dim == 64) return attend_for_group<T, 64 / W>(group);
    if (head_dim == 128) return attend_for_group<T, 128 / W>(group);
    if (head_dim == 256) return attend_for_group<T, 256 / W>(group);
    return attend_for_group<T, 0>(group);
}

// Element `offset` (in elements) of an int32 or int64 tensor, as int64.
int64_t index_at(const at::Tensor& t, int64_t offset) {
    return t.scalar_type() == at::kInt ? t.data_ptr<int32_t>()[offset] : t.data_ptr<int64_t>()[offset];
}

void check_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
                  const at::Tensor& seq_lens) {
    for (const at::Tensor* t : {&q, &k_cache, &v_cache, &tables, &seq_lens})
        TORCH_CHECK_VALUE(t->device().is_cpu(), "paged_decode: every input must be a CPU tensor");
    TORCH_CHECK_VALUE(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
                      "paged_decode: q must be [seqs, heads, head_dim], k_cache and v_cache equal 4-D tensors");
    TORCH_CHECK_VALUE(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
                          (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
                      "paged_decode: q and the caches must share one dtype, float32 or bfloat16");
    TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous() && q.stride(2) == 1,
                      "paged_decode: the caches must be contiguous and q's head_dim contiguous");
    TORCH_CHECK_VALUE(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
                      "paged_decode: q's heads and head_dim must match the caches' (GQA: heads % kv_heads == 0)");
    TORCH_CHECK_VALUE(q.size(2) % 16 == 0 && q.size(2) <= W * MAX_NC,
                      "paged_decode: head_dim must be a multiple of 16, at most ", W * MAX_NC);
    TORCH_CHECK_VALUE(tables.dim() == 2 && tables.size(0) == q.size(0) && seq_lens.dim() == 1 &&
                          seq_lens.size(0) == q.size(0),
                      "paged_decode: block_tables must be [seqs, blocks] and seq_lens [seqs]");
    for (const at::Tensor* t : {&tables, &seq_lens})
        TORCH_CHECK_VALUE(t->scalar_type() == at::kInt || t->scalar_type() == at::kLong,
                          "paged_decode: block_tables and seq_lens must be int32 or int64");
}

// The qgemv library's radixserve::share_work and radixserve::helper_on (link_helper), or null.
using ShareFn = void (*)(radixserve::ShareWork, const std::function<void(int64_t, int64_t, const float*)>&);
using HelperOnFn = bool (*)();
std::atomic<ShareFn> g_share{nullptr};
std::atomic<HelperOnFn> g_helper_on{nullptr};

// A call's inputs, held by the closure shared with the helper thread, which may still run it after the call returned.
struct Inputs {
    at::Tensor q, k_cache, v_cache;
    std::vector<int64_t> tables, offsets, firsts, lens;
};

// The kv heads of a work item for `threads` threads (torch's, or the caller and the helper): with fewer sequences than
// threads one (sequence, kv head); otherwise one sequence with all its kv heads, so that each block (all kv heads of
// a token are adjacent) is read front to back once.
int64_t heads_per_item(int64_t num_seqs, int64_t threads, int64_t num_kv_heads) {
    return num_seqs < threads ? 1 : num_kv_heads;
}

// Whether this call's work items go to share_work: one torch thread, the helper on, more than one item, and enough
// K rows (tokens x kv heads) to pay for the hand-off.
bool shares(int64_t rows, int64_t num_seqs, int64_t num_kv_heads) {
    const HelperOnFn on = g_helper_on.load(std::memory_order_acquire);
    const int64_t items = num_seqs * (num_kv_heads / heads_per_item(num_seqs, 2, num_kv_heads));
    return on != nullptr && on() && at::get_num_threads() == 1 && !at::in_parallel_region() && items > 1 &&
           rows >= MIN_PARALLEL_ROWS;
}

// The work items shared with the helper (kernels/cpu_share.h), split for two threads (heads_per_item). An item's
// output rows are contiguous in out (contiguous [num_seqs, num_heads, head_dim]); a block's values travel as bytes in
// share_work's float buffer.
template <typename T>
void run_shared(const Problem& p, std::shared_ptr<const Inputs> in, T* out) {
    const int64_t num_seqs = static_cast<int64_t>(in->lens.size());
    const int64_t heads = heads_per_item(num_seqs, 2, p.num_kv_heads);
    const int64_t items_per_seq = p.num_kv_heads / heads;
    const int64_t item_elems = heads * p.group * p.head_dim;
    const int64_t item_bytes = item_elems * static_cast<int64_t>(sizeof(T));
    const int64_t unit_floats = (item_bytes + static_cast<int64_t>(sizeof(float)) - 1) / sizeof(float);
    const AttendFn<T> attend_fn = attend_for<T>(p.head_dim, p.group);
    auto compute = [=](int64_t begin, int64_t end, float* dst) {
        const T* q = static_cast<const T*>(in->q.data_ptr());
        const T* k_cache = static_cast<const T*>(in->k_cache.data_ptr());
        const T* v_cache = static_cast<const T*>(in->v_cache.data_ptr());
        Scratch scratch(heads * p.group, p.head_dim);
        std::vector<T> seq_out(p.num_kv_heads * p.group * p.head_dim);  // attend writes at its heads' rows
        for (int64_t item = begin; item < end; ++item) {
            const int64_t seq = item / items_per_seq, h0 = item % items_per_seq * heads;
            const int64_t* table = in->tables.data() + in->offsets[seq];
            attend_fn(p, q + seq * p.q_ss, k_cache, v_cache, table, in->firsts[seq], in->lens[seq], h0,
                      h0 + heads, scratch, seq_out.data());
            std::memcpy(reinterpret_cast<char*>(dst + (item - begin) * unit_floats),
                        seq_out.data() + h0 * p.group * p.head_dim, item_bytes);
        }
    };
    auto store = [&](int64_t begin, int64_t end, const float* values) {
        for (int64_t item = begin; item < end; ++item) {
            const int64_t seq = item / items_per_seq, h0 = item % items_per_seq * heads;
            std::memcpy(out + seq * p.o_ss + h0 * p.group * p.o_sh,
                        reinterpret_cast<const char*>(values + (item - begin) * unit_floats), item_bytes);
        }
    };
    g_share.load(std::memory_order_acquire)({num_seqs * items_per_seq, 1, unit_floats, compute}, store);
}

template <typename T>
void run(const Problem& p, const T* q, const T* k_cache, const T* v_cache, const std::vector<int64_t>& tables,
         const std::vector<int64_t>& offsets, const std::vector<int64_t>& firsts, const std::vector<int64_t>& lens,
         int64_t rows, T* out) {
    const int64_t num_seqs = static_cast<int64_t>(lens.size()), threads = at::get_num_threads();
    const bool parallel = threads > 1 && rows >= MIN_PARALLEL_ROWS && !at::in_parallel_region();
    const int64_t heads = heads_per_item(num_seqs, parallel ? threads : 1, p.num_kv_heads);
    const int64_t items_per_seq = p.num_kv_heads / heads, work = num_seqs * items_per_seq;
    const AttendFn<T> attend_fn = attend_for<T>(p.head_dim, p.group);
    std::atomic<int64_t> next{0};
    auto worker = [&](int64_t, int64_t) {
        Scratch scratch(heads * p.group, p.head_dim);
        for (int64_t item; (item = next.fetch_add(1, std::memory_order_relaxed)) < work;) {
            const int64_t seq = item / items_per_seq, h0 = item % items_per_seq * heads;
            const T* qs = q + seq * p.q_ss;
            T* os = out + seq * p.o_ss;
            const int64_t *table = tables.data() + offsets[seq], first = firsts[seq], len = lens[seq];
            const int64_t h1 = h0 + heads;
            attend_fn(p, qs, k_cache, v_cache, table, first, len, h0, h1, scratch, os);
        }
    };
    if (parallel && work > 1)
        at::parallel_for(0, std::min(threads, work), 1, worker);  // one chunk per thread; items come from `next`
    else
        worker(0, 1);
}

// The operator: see kernels/cpu_decode.py's paged_decode for the contract. Raises c10::ValueError (Python
// ValueError) for bad inputs, before any work: a table too short for its sequence, a block id outside the cache
// (of the blocks the window reads), a negative window. sliding_window 0 means full attention.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                        int64_t sliding_window) {
    check_inputs(q, k_cache, v_cache, block_tables, seq_lens);
    TORCH_CHECK_VALUE(sliding_window >= 0, "paged_decode: sliding_window must be >= 0, got ", sliding_window);
    const int64_t num_seqs = q.size(0), num_blocks = k_cache.size(0), block_size = k_cache.size(1);
    const int64_t width = block_tables.size(1);
    std::vector<int64_t> lens(num_seqs), firsts(num_seqs), offsets(num_seqs), tables;
    for (int64_t i = 0; i < num_seqs; i++) {
        const int64_t len = lens[i] = index_at(seq_lens, i * seq_lens.stride(0));
        const int64_t need = (len + block_size - 1) / block_size;
        TORCH_CHECK_VALUE(len >= 0, "paged_decode: seq_lens must be >= 0, got ", len);
        TORCH_CHECK_VALUE(need <= width, "paged_decode: block table of ", width, " blocks is too short for ", len,
                          " tokens");
        firsts[i] = sliding_window > 0 ? std::max<int64_t>(len - sliding_window, 0) : 0;
        offsets[i] = static_cast<int64_t>(tables.size());
        for (int64_t j = firsts[i] / block_size; j < need; j++) {
            const int64_t block = index_at(block_tables, i * block_tables.stride(0) + j * block_tables.stride(1));
            TORCH_CHECK_VALUE(block >= 0 && block < num_blocks, "paged_decode: block ", block,
                              " is outside the cache's ", num_blocks, " blocks");
            tables.push_back(block);
        }
    }
    at::Tensor out(at::detail::empty_cpu(q.sizes(), q.scalar_type(), false, std::nullopt));
    const Problem p{block_size, k_cache.size(2), q.size(1) / k_cache.size(2), q.size(2), q.stride(0), q.stride(1),
                    k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1),
                    static_cast<float>(scale)};
    int64_t rows = 0;  // K rows read: tokens x kv heads
    for (int64_t i = 0; i < num_seqs; i++) rows += (lens[i] - firsts[i]) * p.num_kv_heads;
    if (shares(rows, num_seqs, p.num_kv_heads)) {
        auto in = std::make_shared<const Inputs>(
            Inputs{q, k_cache, v_cache, std::move(tables), std::move(offsets), std::move(firsts), std::move(lens)});
        if (q.scalar_type() == at::kFloat)
            run_shared<float>(p, std::move(in), out.data_ptr<float>());
        else
            run_shared<bf16_bits>(p, std::move(in), reinterpret_cast<bf16_bits*>(out.data_ptr<at::BFloat16>()));
        return out;
    }
    if (q.scalar_type() == at::kFloat) {
        run<float>(p, q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tables, offsets,
                   firsts, lens, rows, out.data_ptr<float>());
    } else {
        auto bits = [](const at::Tensor& t) { return reinterpret_cast<bf16_bits*>(t.data_ptr<at::BFloat16>()); };
        run<bf16_bits>(p, bits(q), bits(k_cache), bits(v_cache), tables, offsets, firsts, lens, rows, bits(out));
    }
    return out;
}

}  // namespace

TORCH_LIBRARY(radixserve, m) {
    m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, float scale, "
          "int sliding_window=0) -> Tensor");
    // The qgemv library's share_work and helper_on, as its helper_entry op gives their addresses (0, 0: unlink).
    m.def("link_helper(int share_work, int helper_on) -> ()", [](int64_t share, int64_t on) {
        g_helper_on.store(nullptr, std::memory_order_release);
        g_share.store(reinterpret_cast<ShareFn>(share), std::memory_order_release);
        g_helper_on.store(reinterpret_cast<HelperOnFn>(on), std::memory_order_release);
    });
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) { m.impl("paged_decode", &paged_decode); }
