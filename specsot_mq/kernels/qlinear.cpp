// Torch binding of the quantized linear kernels (qgemm_body.h): activations are quantized to int8
// per block of 32, then the instruction set picked at load time runs the packed weights, with the
// column groups split over torch's own OpenMP threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <memory>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <optional>
#include <string>
#include <vector>

#include "qformat.h"

#define SPECSOT_DECLARE(ISA)                                                                          \
    namespace ISA {                                                                                   \
    void gemm(int64_t, const uint8_t*, int64_t, int64_t, int64_t, const int8_t*, const float*, const float*, \
              const float*, int64_t, float*, int64_t);                                                \
    double int8_peak(int64_t);                                                                        \
    }
SPECSOT_DECLARE(avx2)
SPECSOT_DECLARE(vnni)
namespace avx2 {
void attend_group(const float*, const float*, const float*, int64_t, int64_t, const int32_t*, int64_t, int64_t, float*,
                  float*);
void attend_group(const float*, const uint16_t*, const uint16_t*, int64_t, int64_t, const int32_t*, int64_t, int64_t,
                  float*, float*);
void to_half(const float*, int64_t, uint16_t*);
void quantize_input(const float*, int64_t, const float*, float, bool, float*, int8_t*, float*, float*, float*);
void rms_norm(const float*, int64_t, const float*, float, float*);
int64_t first_max(const float*, int64_t);
}

namespace {

using GemmFn = void (*)(int64_t, const uint8_t*, int64_t, int64_t, int64_t, const int8_t*, const float*,
                        const float*, const float*, int64_t, float*, int64_t);

// SPECSOT_KERNEL_ISA=avx2 holds a VNNI machine to the AVX2 path (tests run both).
bool cpu_has_vnni() {
    const char* isa = std::getenv("SPECSOT_KERNEL_ISA");
    if (isa != nullptr && std::string(isa) == "avx2") return false;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

bool cpu_has_avx2() {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

}  // namespace

namespace {

// Rows [m0, m1) of x (row stride `stride`) as a linear reads them (see quantize_input), quantized
// into q [M, K], d and s [M, K / 32], h [M, K / 16]. buf holds K floats.
void quantize_rows(const float* x, int64_t stride, int64_t K, const float* norm, float eps, bool glu, int8_t* q,
                   float* d, float* s, float* h, int64_t m0, int64_t m1, float* buf) {
    const int64_t nb = K / 32;
    for (int64_t m = m0; m < m1; ++m)
        avx2::quantize_input(x + m * stride, K, norm, eps, glu, buf, q + m * K, d + m * nb, s + m * nb, h + m * 2 * nb);
}

// The activations of M rows, quantized as the kernels read them: int8 values, and per block of 32
// the scale, d * sum, and d * sum per half block.
struct Quantized {
    int8_t* q;
    float *d, *s, *h;
};

// One linear layer's quantized weights: one or more parts side by side in its output columns (a
// fused q/k/v projection whose parts a GGUF file quantized in different formats), each a packed
// weight [groups of 16 columns, records, record bytes] of one format, as quant.QWeight lays it out.
// Every part but the last has whole groups of columns, so the parts' columns follow each other.
struct Weights {
    struct Part {
        const uint8_t* w;
        int64_t code, groups, nrec, first;  // first: the part's first group among the layer's
    };
    std::vector<torch::Tensor> data;  // what the parts point into, kept alive
    std::vector<Part> parts;
    int64_t N = 0, K = 0;
    GemmFn fn;

    Weights(std::vector<torch::Tensor> tensors, std::vector<int64_t> codes, int64_t k) : data(std::move(tensors)), K(k) {
        TORCH_CHECK(!data.empty() && data.size() == codes.size(), "quantized weights: one format per part");
        TORCH_CHECK(K % 32 == 0, "quantized weights want K a multiple of 32");
        for (size_t i = 0; i < data.size(); ++i) {
            const torch::Tensor& t = data[i];
            TORCH_CHECK(t.scalar_type() == torch::kUInt8 && t.is_contiguous() && t.dim() == 3,
                        "quantized weights want packed uint8 [groups, records, bytes]");
            int64_t blocks = 0, record = 0;
            TORCH_CHECK(by_format(codes[i], [&](auto f, auto) { blocks = f.blocks; record = f.record; }),
                        "unknown quantized format ", codes[i]);
            TORCH_CHECK(K % (32 * blocks) == 0 && t.size(1) == K / (32 * blocks) && t.size(2) == record,
                        "quantized weights: the packed size does not match K and the format");
            parts.push_back({t.data_ptr<uint8_t>(), codes[i], t.size(0), t.size(1), N / 16});
            N += 16 * t.size(0);
        }
        fn = cpu_has_vnni() ? vnni::gemm : avx2::gemm;
    }

    // Column groups [g0, g1) of out [M, N] = rows x W^T (the rows quantized as x), plus residual
    // [M, N] where given. Every element is one thread's, over the blocks in order.
    void groups(int64_t g0, int64_t g1, const Quantized& x, int64_t M, float* out, const float* residual,
                const float* bias = nullptr) const {
        for (const Part& p : parts) {
            const int64_t a = std::max(g0, p.first), b = std::min(g1, p.first + p.groups);
            if (a < b) fn(p.code, p.w, p.nrec, a - p.first, b - p.first, x.q, x.d, x.s, x.h, M, out + 16 * p.first, N);
        }
        if (residual != nullptr && g0 < g1)
            for (int64_t m = 0; m < M; ++m)
                for (int64_t c = 16 * g0; c < 16 * g1; ++c) out[m * N + c] += residual[m * N + c];
        if (bias != nullptr && g0 < g1)
            for (int64_t m = 0; m < M; ++m)
                for (int64_t c = 16 * g0; c < 16 * g1; ++c) out[m * N + c] += bias[c];
    }
};

// This thread's share [first, last) of n items split evenly over the team (inside a parallel region).
std::pair<int64_t, int64_t> share(int64_t n) {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t per = n / threads, extra = n % threads;
    const int64_t first = t * per + std::min(t, extra);
    return {first, first + per + (t < extra ? 1 : 0)};
}

// This thread's share [first, last) of n items split over the team (inside a parallel region) so
// that each share's total cost (cost(i) of item i) is about even: attention items cost as many keys
// as their row sees, and in a prefill later rows see more.
template <class Cost>
std::pair<int64_t, int64_t> share_by_cost(int64_t n, Cost cost) {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    if (threads == 1) return {0, n};
    int64_t total = 0;
    for (int64_t i = 0; i < n; ++i) total += cost(i);
    // item i goes to the thread whose slice of the total holds the middle of its cost
    int64_t first = n, last = n, before = 0;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t owner = std::min(threads - 1, (2 * before + cost(i)) * threads / std::max<int64_t>(2 * total, 1));
        if (owner == t && first == n) first = i;
        if (owner > t) {
            last = i;
            break;
        }
        before += cost(i);
    }
    return {std::min(first, last), last};
}

}  // namespace

// y = f(x) W^T (+ residual): x float32 [M, K] (K a multiple of 32; [M, 2K] with glu), w the
// quantized weights with N output columns; f is the identity, an RMSNorm with `norm_weight` and
// `eps`, or (glu) silu(x[:, :K]) * x[:, K:]. Returns float32 [M, N].
torch::Tensor qlinear(torch::Tensor x, std::shared_ptr<Weights> w, std::optional<torch::Tensor> norm_weight, double eps,
                      bool glu, std::optional<torch::Tensor> residual) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "qlinear wants float32 [M, K] input");
    const Weights& lin = *w;
    x = x.contiguous();
    const int64_t M = x.size(0), stride = x.size(1), K = glu ? stride / 2 : stride, N = lin.N;
    TORCH_CHECK(K == lin.K, "qlinear: the input's size does not match the weights'");
    const int64_t nblocks = K / 32, groups = N / 16;
    torch::Tensor nw;
    if (norm_weight.has_value()) {
        nw = norm_weight->to(torch::kFloat32).contiguous();
        TORCH_CHECK(nw.numel() == K, "qlinear norm weight must have K elements");
    }
    torch::Tensor res;
    if (residual.has_value()) {
        TORCH_CHECK(residual->numel() == M * N, "qlinear residual must be [M, N]");
        res = residual->reshape({M, N}).to(torch::kFloat32).contiguous();
    }
    auto xq = torch::empty({M, K}, torch::kInt8);
    auto scales = torch::empty({4, M, nblocks}, torch::kFloat32);  // d, s, h (two per block)
    const Quantized xin{xq.data_ptr<int8_t>(), scales[0].data_ptr<float>(), scales[1].data_ptr<float>(),
                        scales[2].data_ptr<float>()};
    at::parallel_for(0, M, std::max<int64_t>(1, 64 / nblocks), [&](int64_t m0, int64_t m1) {
        std::vector<float> buf(K);
        quantize_rows(x.data_ptr<float>(), stride, K, norm_weight.has_value() ? nw.data_ptr<float>() : nullptr,
                      static_cast<float>(eps), glu, xin.q, xin.d, xin.s, xin.h, m0, m1, buf.data());
    });
    torch::Tensor out = torch::empty({M, N}, torch::kFloat32);
    // A chunk of column groups worth at least ~2k block dot products, so small matrices stay on
    // one thread instead of paying for a parallel region.
    const int64_t grain = std::max<int64_t>(1, 1024 / (nblocks * M));
    at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
        lin.groups(g0, g1, xin, M, out.data_ptr<float>(), residual.has_value() ? res.data_ptr<float>() : nullptr);
    });
    return out;
}

// norm * (x * r) with r = 1 / sqrt(mean(x^2) + eps) over the last dimension of float32 x (a multiple
// of 8): the RMSNorm the kernels run inside a layer, so that a norm outside one has the same bits.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor norm, double eps) {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() >= 1, "rms_norm wants float32 x");
    const int64_t K = x.size(-1), M = K ? x.numel() / K : 0;
    TORCH_CHECK(K % 8 == 0 && norm.numel() == K, "rms_norm wants a last dimension of a multiple of 8, the norm's size");
    x = x.contiguous();
    const auto w = norm.to(torch::kFloat32).contiguous();
    auto out = torch::empty_like(x);
    const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t m0, int64_t m1) {
        for (int64_t m = m0; m < m1; ++m) avx2::rms_norm(xp + m * K, K, wp, static_cast<float>(eps), op + m * K);
    });
    return out;
}

// The greedy token of every row of float32 logits [..., V]: the index of the row's largest value
// (the first where several are, the first NaN where there is one: torch.max's indices), as int64 [...].
torch::Tensor greedy(torch::Tensor logits) {
    TORCH_CHECK(logits.scalar_type() == torch::kFloat32 && logits.dim() >= 1 && logits.size(-1) > 0,
                "greedy wants float32 logits [..., V]");
    const auto x = logits.contiguous();
    const int64_t V = x.size(-1), M = x.numel() / V;
    auto sizes = x.sizes().vec();
    sizes.pop_back();
    auto out = torch::empty(sizes, torch::kInt64);
    const float* xp = x.data_ptr<float>();
    int64_t* op = out.data_ptr<int64_t>();
    at::parallel_for(0, M, std::max<int64_t>(1, (1 << 18) / V), [&](int64_t m0, int64_t m1) {
        for (int64_t m = m0; m < m1; ++m) op[m] = avx2::first_max(xp + m * V, V);
    });
    return out;
}

namespace {

float half_at(const uint8_t* p) {
    uint16_t bits;
    std::memcpy(&bits, p, 2);
    return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Column c (0..15) of a group of format F, dequantized into y [K]: the GGUF type's own formula
// (gguf's dequantize: d * (q - 8) for Q4_0, d * q + m for Q4_1, (d * sc) * q - dmin * m for Q4_K,
// ...), one rounding after each step, as quant.QWeight.dequantize computes it.
template <class F, int C>
void dequantize_column(const uint8_t* group, int64_t nrec, int c, float* y) {
    for (int64_t rec = 0; rec < nrec; ++rec, group += F::record) {
        const float d = F::k_quant ? half_at(group + 2 * c) : 0.f;
        const float dmin = F::k_quant && C != kQ6_K ? half_at(group + 32 + 2 * c) : 0.f;
        for (int j = 0; j < F::blocks; ++j, y += 32) {
            const uint8_t* blk = group + F::head + j * F::block;
            const uint8_t* sc = blk + F::weights;
            int q[32];
            for (int v = 0; v < (F::bits == 8 ? 8 : 4); ++v)
                for (int i = 0; i < 4; ++i) {
                    const uint8_t byte = blk[64 * v + 4 * c + i];
                    if (F::bits == 8) {
                        q[4 * v + i] = static_cast<int8_t>(byte);
                        continue;
                    }
                    int lo = byte & 0x0F, hi = byte >> 4;
                    if (F::bits == 5) {
                        const uint8_t p = blk[256 + 4 * c + i];
                        lo |= ((p >> v) & 1) << 4;
                        hi |= ((p >> (4 + v)) & 1) << 4;
                    } else if (F::bits == 6) {
                        lo |= ((blk[256 + 4 * c + i] >> (2 * v)) & 3) << 4;
                        hi |= ((blk[320 + 4 * c + i] >> (2 * v)) & 3) << 4;
                    }
                    q[4 * v + i] = lo;
                    q[16 + 4 * v + i] = hi;
                }
            for (int i = 0; i < 32; ++i) {
                const float x = static_cast<float>(q[i]);
                if constexpr (C == kQ4_0 || C == kQ5_0) {
                    y[i] = half_at(sc + 2 * c) * static_cast<float>(q[i] - (C == kQ4_0 ? 8 : 16));
                } else if constexpr (C == kQ4_1 || C == kQ5_1) {
                    y[i] = half_at(sc + 2 * c) * x + half_at(sc + 32 + 2 * c);
                } else if constexpr (C == kQ8_0) {
                    y[i] = half_at(sc + 2 * c) * x;
                } else if constexpr (C == kQ6_K) {
                    const float s = d * static_cast<float>(static_cast<int8_t>(sc[(i < 16 ? 0 : 16) + c]));
                    y[i] = s * static_cast<float>(q[i] - 32);
                } else {  // Q4_K, Q5_K
                    const float s = d * static_cast<float>(sc[c]), m = dmin * static_cast<float>(sc[16 + c]);
                    y[i] = s * x - m;
                }
            }
        }
    }
}

}  // namespace

// Rows `index` [T] of quantized weights (output columns of the layer), dequantized to float32
// [T, K] (an embedding lookup of a tied output layer, or of a quantized embedding).
torch::Tensor dequantize_rows(std::shared_ptr<Weights> w, torch::Tensor index) {
    const auto rows = index.to(torch::kInt64).contiguous();
    const int64_t T = rows.numel(), K = w->K;
    auto out = torch::empty({T, K}, torch::kFloat32);
    const int64_t* ids = rows.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) {
        const int64_t i = ids[t];
        TORCH_CHECK(i >= 0 && i < w->N, "dequantize_rows: row index out of range");
        for (const auto& p : w->parts) {
            if (i / 16 < p.first || i / 16 >= p.first + p.groups) continue;
            by_format(p.code, [&](auto f, auto c) {
                const uint8_t* group = p.w + (i / 16 - p.first) * p.nrec * f.record;
                dequantize_column<decltype(f), decltype(c)::value>(group, p.nrec, static_cast<int>(i % 16),
                                                                   out.data_ptr<float>() + t * K);
            });
        }
    }
    return out;
}

namespace {

// The keys each query row (b, t) may see, in cache order: from model.attention_bias's bias
// ([B, 1, G * T, L] of 0 / -inf; rows repeat per q head of a group) or, without one, keys
// 0 .. L - 1. Fills lists [B * T, L] and returns the counts.
std::vector<int64_t> visible_keys(const std::optional<torch::Tensor>& bias, int64_t B, int64_t T, int64_t L,
                                  int32_t* lists) {
    std::vector<int64_t> counts(B * T, L);
    if (!bias.has_value()) {
        for (int64_t r = 0; r < B * T; ++r)
            for (int64_t k = 0; k < L; ++k) lists[r * L + k] = static_cast<int32_t>(k);
        return counts;
    }
    const torch::Tensor bt = bias->to(torch::kFloat32);
    TORCH_CHECK(bt.dim() == 4 && bt.size(0) == B && bt.size(2) >= T && bt.size(3) == L,
                "attention bias must be [B, 1, G*T, L]");
    auto acc = bt.accessor<float, 4>();
    for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t) {
            int64_t n = 0;
            int32_t* row = lists + (b * T + t) * L;
            for (int64_t k = 0; k < L; ++k)
                if (acc[b][0][t][k] == 0.f) row[n++] = static_cast<int32_t>(k);
            counts[b * T + t] = n;
        }
    return counts;
}

// Attention items [i0, i1) of q [B, T, H, D] (contiguous) into out [B, T, H, D]: item i is query
// row r = i / (H / g) with its g consecutive q heads from j * g on (j = i % (H / g); g divides G =
// H / KV, so they share kv head j * g / G), batch row b's keys and values for kv head h at
// key_base(b) + h * kstride (rows of D elements of type E: float, or fp16 bits). scores has room
// for min(g, 4) * (L + 8) floats. A head's values do not depend on g (each head's sums are its own).
template <class E, class KeyBase, class ValueBase>
void attend_items(int64_t i0, int64_t i1, const float* q, int64_t T, int64_t H, int64_t KV, int64_t g, int64_t D,
                  int64_t L, const int32_t* lists, const int64_t* counts, KeyBase key_base, ValueBase value_base,
                  int64_t kstride, int64_t vstride, float* scores, float* out) {
    const int64_t per_row = H / g, G = H / KV;
    for (int64_t i = i0, j; i < i1; i = j) {
        const int64_t r = i / per_row, first = (i % per_row) * g, h = first / G, b = r / T;
        // this thread's consecutive items [i, j) of the same row and kv head run as one call, so
        // each key and value row is loaded and converted once for all their heads
        for (j = i + 1; j < i1 && j / per_row == r && (j % per_row) * g / G == h; ++j) {
        }
        avx2::attend_group(q + (r * H + first) * D, key_base(b) + h * kstride, value_base(b) + h * vstride, D, D,
                           lists + r * L, counts[r], (j - i) * g, scores, out + (r * H + first) * D);
    }
}

template <class E, class KeyBase, class ValueBase>
void attend_all(const float* q, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D, int64_t L,
                const int32_t* lists, const std::vector<int64_t>& counts, KeyBase key_base, ValueBase value_base,
                int64_t kstride, int64_t vstride, float* out) {
    const int64_t G = H / KV, items = B * T * KV;
    // one thread for a small job (a parallel region costs more than it saves)
    const int64_t threads = items * L * G * D < (1 << 16) ? 1 : at::get_num_threads();
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> scores(std::min<int64_t>(G, 4) * (L + 8));
        const auto [i0, i1] = share_by_cost(items, [&](int64_t i) { return counts[i / KV] + 1; });
        attend_items<E>(i0, i1, q, T, H, KV, G, D, L, lists, counts.data(), key_base, value_base, kstride, vstride,
                        scores.data(), out);
    }
}

// run(E{}) with E the element type of the cache tensor t: float for float32, uint16_t (its bits)
// for float16.
template <class Run>
void by_element(const torch::Tensor& t, Run run) {
    TORCH_CHECK(t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kHalf,
                "the native attention reads float32 or float16 keys and values");
    if (t.scalar_type() == torch::kHalf) run(uint16_t{});
    else run(float{});
}

template <class E>
E* elements(const torch::Tensor& t) {
    if constexpr (std::is_same_v<E, float>) return t.data_ptr<float>();
    else return reinterpret_cast<uint16_t*>(t.data_ptr<at::Half>());
}

// D floats into a cache row: copied, or rounded to fp16.
void store_row(const float* x, int64_t D, float* row) { std::memcpy(row, x, D * sizeof(float)); }
void store_row(const float* x, int64_t D, uint16_t* row) { avx2::to_half(x, D, row); }

}  // namespace

// Grouped-query attention: q [B, T, H, D] float32 (the scale folded in), keys and values
// [B, KV, L, D] (float32 or float16, rows of D elements; views of the cache are read in place), bias as
// model.attention_bias builds it, or None (every key visible). Returns [B, T, H * D].
torch::Tensor attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, std::optional<torch::Tensor> bias) {
    TORCH_CHECK(q.dim() == 4 && q.scalar_type() == torch::kFloat32, "attention wants float32 q [B, T, H, D]");
    q = q.contiguous();
    const int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3);
    const int64_t KV = keys.size(1), L = keys.size(2);
    TORCH_CHECK(D % 8 == 0 && H % KV == 0, "attention wants head_dim a multiple of 8 and H a multiple of KV");
    for (const auto& kv : {keys, values})
        TORCH_CHECK(kv.scalar_type() == keys.scalar_type() && kv.stride(3) == 1 && kv.stride(2) == D,
                    "attention wants keys and values of one dtype with rows of head_dim contiguous elements");
    auto lists = torch::empty({B * T, std::max<int64_t>(L, 1)}, torch::kInt32);
    const auto counts = visible_keys(bias, B, T, L, lists.data_ptr<int32_t>());
    auto out = torch::empty({B, T, H * D}, torch::kFloat32);
    by_element(keys, [&](auto element) {
        using E = decltype(element);
        const E *kp = elements<E>(keys), *vp = elements<E>(values);
        const int64_t ks0 = keys.stride(0), vs0 = values.stride(0);
        attend_all<E>(q.data_ptr<float>(), B, T, H, KV, D, L, lists.data_ptr<int32_t>(), counts,
                      [&](int64_t b) { return kp + b * ks0; }, [&](int64_t b) { return vp + b * vs0; },
                      keys.stride(1), values.stride(1), out.data_ptr<float>());
    });
    return out;
}

namespace {

// Where new cache entries go and what each query row sees: batch row b writes at slot slots[b] from
// position starts[b]; lists and counts as visible_keys gives them, over L = max(starts) + T keys.
struct Placement {
    std::vector<int64_t> slots, starts, counts;
    torch::Tensor lists;
    int64_t B, T, L = 0;

    // prefix_src / prefix_len (empty, or one per batch row): row b reads its first prefix_len[b]
    // cache entries from slot prefix_src[b], which holds the same ones (a prompt prefix copied into
    // several slots): rows that share a prefix read it from one place, which the caches then
    // hold for all of them. The keys and their order are the same, so are the bits.
    Placement(std::vector<int64_t> slots_, std::vector<int64_t> starts_, const std::optional<torch::Tensor>& bias,
              int64_t B_, int64_t T_, int64_t num_slots, int64_t capacity, int64_t KV = 0,
              const std::vector<int64_t>& prefix_src = {}, const std::vector<int64_t>& prefix_len = {})
        : slots(std::move(slots_)), starts(std::move(starts_)), B(B_), T(T_) {
        TORCH_CHECK(static_cast<int64_t>(slots.size()) == B && static_cast<int64_t>(starts.size()) == B,
                    "one cache slot and start per batch row");
        for (int64_t b = 0; b < B; ++b) {
            TORCH_CHECK(slots[b] >= 0 && slots[b] < num_slots && starts[b] >= 0 && starts[b] + T <= capacity,
                        "cache slot or position out of the cache");
            L = std::max(L, starts[b] + T);
        }
        lists = torch::empty({B * T, std::max<int64_t>(L, 1)}, torch::kInt32);
        if (bias.has_value()) {
            counts = visible_keys(bias, B, T, L, lists.data_ptr<int32_t>());
        } else {  // causal: row (b, t) sees its slot's first starts[b] + t + 1 entries
            counts.assign(B * T, 0);
            for (int64_t b = 0; b < B; ++b)
                for (int64_t t = 0; t < T; ++t) {
                    int32_t* row = lists.data_ptr<int32_t>() + (b * T + t) * L;
                    counts[b * T + t] = starts[b] + t + 1;
                    for (int64_t k = 0; k < counts[b * T + t]; ++k) row[k] = static_cast<int32_t>(k);
                }
        }
        if (prefix_src.empty()) return;
        TORCH_CHECK(static_cast<int64_t>(prefix_src.size()) == B && static_cast<int64_t>(prefix_len.size()) == B,
                    "one prefix source and length per batch row");
        for (int64_t b = 0; b < B; ++b) {
            TORCH_CHECK(prefix_src[b] >= 0 && prefix_src[b] < num_slots && prefix_len[b] >= 0 &&
                            prefix_len[b] <= starts[b], "a shared prefix must lie in the cache, before the new rows");
            // key index k of the source slot, counted from this row's slot (rows of D elements)
            const int64_t offset = (prefix_src[b] - slots[b]) * KV * capacity;
            for (int64_t t = 0; t < T; ++t) {
                int32_t* row = lists.data_ptr<int32_t>() + (b * T + t) * L;
                for (int64_t i = 0; i < counts[b * T + t] && row[i] < prefix_len[b]; ++i)
                    row[i] = static_cast<int32_t>(row[i] + offset);
            }
        }
    }
};

// Rows [r0, r1) of qkv [B * T, (H + 2 KV) * D] (a fused projection's output): q rotated into
// q [B * T, H, D]; k rotated and v stored in one cache layer kc / vc [slots, KV, capacity, D] at
// row b's slot and position. Rope is rotate-half: x * cos + [x2, x1] * sin, with cos and sin
// [B * T, D] (model.rope_tables' sign-folded sin at each position). k holds D floats.
template <class E>
void rope_and_store(int64_t r0, int64_t r1, const float* qkv, const float* cos, const float* sin, int64_t H,
                    int64_t KV, int64_t D, const Placement& at, E* kc, E* vc, int64_t capacity, float* q, float* k) {
    const int64_t half = D / 2, F = (H + 2 * KV) * D;
    auto rope = [&](const float* x, const float* c, const float* s, float* y) {
        for (int64_t i = 0; i < D; ++i) y[i] = x[i] * c[i] + x[i < half ? i + half : i - half] * s[i];
    };
    for (int64_t r = r0; r < r1; ++r) {
        const int64_t b = r / at.T, t = r % at.T;
        const float *x = qkv + r * F, *c = cos + r * D, *s = sin + r * D;
        for (int64_t h = 0; h < H; ++h) rope(x + h * D, c, s, q + (r * H + h) * D);
        for (int64_t h = 0; h < KV; ++h) {
            const int64_t row = ((at.slots[b] * KV + h) * capacity + at.starts[b] + t) * D;
            rope(x + (H + h) * D, c, s, k);
            store_row(k, D, kc + row);
            store_row(x + (H + KV + h) * D, D, vc + row);
        }
    }
}

// Attention items [i0, i1) (see attend_items, g q heads each) of rotated q over one cache layer kc / vc.
template <class E>
void attend_cache_items(int64_t i0, int64_t i1, const float* q, int64_t H, int64_t KV, int64_t g, int64_t D,
                        const Placement& at, const E* kc, const E* vc, int64_t capacity, float* scores, float* out) {
    const int64_t slot_stride = KV * capacity * D;
    attend_items<E>(i0, i1, q, at.T, H, KV, g, D, at.L, at.lists.data_ptr<int32_t>(), at.counts.data(),
                    [&](int64_t b) { return kc + at.slots[b] * slot_stride; },
                    [&](int64_t b) { return vc + at.slots[b] * slot_stride; }, capacity * D, capacity * D, scores, out);
}

void check_cache_layer(const torch::Tensor& kcache, const torch::Tensor& vcache, int64_t dims, int64_t KV, int64_t D) {
    for (const auto& c : {kcache, vcache})
        TORCH_CHECK(c.scalar_type() == kcache.scalar_type() && c.is_contiguous() && c.dim() == dims &&
                        c.size(dims - 3) == KV && c.size(dims - 1) == D && c.sizes() == kcache.sizes(),
                    "the native attention wants a contiguous cache of [..., slots, KV, capacity, head_dim]");
}

}  // namespace

// A decoder layer's whole attention on a layer of the KV cache: qkv [B, T, (H + 2 KV) * D] (the
// fused projection's output), cos and sin [B, T, D], kcache and vcache [slots, KV, capacity, D]
// (the layer's cache, float32 or float16, written in place: fp16 rounds to nearest even), batch
// row b at cache slot slots[b] from position starts[b]. Rotates q and k, stores k and v, attends as
// `attention` does (bias over the L = max(starts) + T first positions, or None: causal, row (b, t)
// seeing its slot's first starts[b] + t + 1 entries) and returns [B, T, H * D].
torch::Tensor attend_cached(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor kcache,
                            torch::Tensor vcache, std::vector<int64_t> slots, std::vector<int64_t> starts,
                            std::optional<torch::Tensor> bias, int64_t H, int64_t KV) {
    TORCH_CHECK(qkv.dim() == 3 && qkv.scalar_type() == torch::kFloat32, "attend_cached wants float32 qkv [B, T, F]");
    qkv = qkv.contiguous();
    cos = cos.to(torch::kFloat32).contiguous();
    sin = sin.to(torch::kFloat32).contiguous();
    const int64_t B = qkv.size(0), T = qkv.size(1), D = qkv.size(2) / (H + 2 * KV);
    TORCH_CHECK(qkv.size(2) == (H + 2 * KV) * D && D % 8 == 0 && H % KV == 0, "attend_cached: bad qkv width");
    TORCH_CHECK(cos.numel() == B * T * D && sin.numel() == B * T * D, "attend_cached: cos/sin must be [B, T, D]");
    check_cache_layer(kcache, vcache, 4, KV, D);
    const int64_t capacity = kcache.size(2);
    const Placement at(std::move(slots), std::move(starts), bias, B, T, kcache.size(0), capacity);
    auto q = torch::empty({B, T, H, D}, torch::kFloat32);
    auto out = torch::empty({B, T, H * D}, torch::kFloat32);
    by_element(kcache, [&](auto element) {
        using E = decltype(element);
        E *kc = elements<E>(kcache), *vc = elements<E>(vcache);
        at::parallel_for(0, B * T, 1, [&](int64_t r0, int64_t r1) {
            std::vector<float> k(D);
            rope_and_store(r0, r1, qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), H, KV, D, at,
                           kc, vc, capacity, q.data_ptr<float>(), k.data());
        });
        const int64_t slot_stride = KV * capacity * D;
        attend_all<E>(q.data_ptr<float>(), B, T, H, KV, D, at.L, at.lists.data_ptr<int32_t>(), at.counts,
                      [&](int64_t b) -> const E* { return kc + at.slots[b] * slot_stride; },
                      [&](int64_t b) -> const E* { return vc + at.slots[b] * slot_stride; }, capacity * D,
                      capacity * D, out.data_ptr<float>());
    });
    return out;
}

// One decoder layer on quantized weights, as the native stack runs it: RMSNorm (in_norm), the fused
// q/k/v projection (plus its bias, where the model has one: Qwen2), rope + cache write + attention,
// the output projection plus the input, RMSNorm (post_norm), gate/up, silu(gate) * up, down plus the
// residual. H q heads, KV kv heads.
struct Layer {
    torch::Tensor in_norm, post_norm, qkv_bias;
    float in_eps, post_eps;
    std::shared_ptr<Weights> linears[4];  // qkv, o, gate_up, down
    int64_t H, KV, hidden, D, inter;

    Layer(torch::Tensor in_norm_, double in_eps_, std::shared_ptr<Weights> qkv, std::shared_ptr<Weights> o,
          torch::Tensor post_norm_, double post_eps_, std::shared_ptr<Weights> gate_up, std::shared_ptr<Weights> down,
          int64_t H_, int64_t KV_, std::optional<torch::Tensor> bias)
        : in_norm(in_norm_.to(torch::kFloat32).contiguous()), post_norm(post_norm_.to(torch::kFloat32).contiguous()),
          in_eps(static_cast<float>(in_eps_)), post_eps(static_cast<float>(post_eps_)),
          linears{std::move(qkv), std::move(o), std::move(gate_up), std::move(down)}, H(H_), KV(KV_) {
        hidden = linears[0]->K;
        D = linears[0]->N / (H + 2 * KV);
        inter = linears[3]->K;
        TORCH_CHECK(H % KV == 0 && D % 8 == 0 && linears[0]->N == (H + 2 * KV) * D, "decoder layer: bad head counts");
        TORCH_CHECK(linears[1]->K == H * D && linears[1]->N == hidden && linears[2]->K == hidden &&
                        linears[2]->N == 2 * inter && linears[3]->N == hidden && in_norm.numel() == hidden &&
                        post_norm.numel() == hidden,
                    "decoder layer: the weights' shapes do not fit together");
        if (bias.has_value()) {
            qkv_bias = bias->to(torch::kFloat32).contiguous();
            TORCH_CHECK(qkv_bias.numel() == linears[0]->N, "decoder layer: the q/k/v bias differs in size");
        }
    }
};

// The model's final RMSNorm and its output layer, which decoder_layers can run after the last layer
// with the same team of threads.
struct Head {
    torch::Tensor norm;
    float eps;
    std::shared_ptr<Weights> lin;

    Head(torch::Tensor norm_, double eps_, std::shared_ptr<Weights> w)
        : norm(norm_.to(torch::kFloat32).contiguous()), eps(static_cast<float>(eps_)), lin(std::move(w)) {
        TORCH_CHECK(norm.numel() == lin->K, "head: the norm and the output layer differ in size");
    }
};

constexpr int64_t kOwnRows = 4;  // up to this many rows, each thread quantizes them for itself (decoder_layers)

// Decoder layers run one after another on x [B, T, hidden] float32, in one call with one team of
// threads: each step of a layer (quantizing rows, a linear's column groups, rope + cache writes,
// attention) is split over the team, with a barrier between steps, so no parallel region is
// started per step. Layer i reads and writes cache layer first + i of kcache / vcache
// [layers, slots, KV, capacity, D]; slots, starts and bias as attend_cached takes them, prefix_src
// and prefix_len as Placement (empty: every row reads its own slot). With a `head`, the final norm
// then runs on every row and the output layer on rows `logit_rows` (indices into the B * T rows).
// Returns [x after the last layer (through the head's norm, with a head), with a head the logits
// [logit_rows, N], then the input of layer i for each i in `save`]. Every value is what the
// modules compute one by one (each element has one owner thread and a fixed order of sums).
std::vector<torch::Tensor> decoder_layers(torch::Tensor x, std::vector<std::shared_ptr<Layer>> layers, int64_t first,
                                          torch::Tensor cos, torch::Tensor sin, torch::Tensor kcache,
                                          torch::Tensor vcache, std::vector<int64_t> slots, std::vector<int64_t> starts,
                                          std::optional<torch::Tensor> bias, std::vector<int64_t> save,
                                          std::shared_ptr<Head> head, std::vector<int64_t> logit_rows,
                                          std::vector<int64_t> prefix_src, std::vector<int64_t> prefix_len) {
    TORCH_CHECK(!layers.empty(), "decoder_layers wants at least one layer");
    const Layer& top = *layers[0];
    const int64_t H = top.H, KV = top.KV, D = top.D, hidden = top.hidden, G = H / KV, F = (H + 2 * KV) * D;
    int64_t inter = 0;
    for (const auto& l : layers) {
        TORCH_CHECK(l->H == H && l->KV == KV && l->D == D && l->hidden == hidden, "decoder_layers: layers differ in shape");
        inter = std::max(inter, l->inter);
    }
    TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat32 && x.size(2) == hidden,
                "decoder_layers wants float32 x [B, T, hidden]");
    const int64_t B = x.size(0), T = x.size(1), M = B * T;
    cos = cos.to(torch::kFloat32).contiguous();
    sin = sin.to(torch::kFloat32).contiguous();
    TORCH_CHECK(cos.numel() == M * D && sin.numel() == M * D, "decoder_layers: cos/sin must be [B, T, D]");
    check_cache_layer(kcache, vcache, 5, KV, D);
    TORCH_CHECK(first >= 0 && first + static_cast<int64_t>(layers.size()) <= kcache.size(0),
                "decoder_layers: more layers than the cache holds");
    const int64_t capacity = kcache.size(3), layer_stride = kcache.stride(0);
    const Placement at(std::move(slots), std::move(starts), bias, B, T, kcache.size(1), capacity, KV, prefix_src,
                       prefix_len);

    auto state = x.contiguous().clone();  // the running hidden state, [B, T, hidden]
    std::vector<torch::Tensor> kept;
    for (const int64_t i : save) {
        TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(layers.size()), "decoder_layers: save index out of range");
        kept.push_back(torch::empty({B, T, hidden}, torch::kFloat32));
    }
    const int64_t R = head ? static_cast<int64_t>(logit_rows.size()) : 0;
    TORCH_CHECK(!head || head->lin->K == hidden, "decoder_layers: the head's size differs from the layers'");
    TORCH_CHECK(R <= M, "decoder_layers: more logit rows than rows");
    for (const int64_t r : logit_rows) TORCH_CHECK(r >= 0 && r < M, "decoder_layers: logit row out of range");
    auto logits = torch::empty({R, head ? head->lin->N : 0}, torch::kFloat32);
    auto normed = head ? torch::empty({B, T, hidden}, torch::kFloat32) : state;
    const int64_t K = std::max({hidden, H * D, inter});
    auto f32 = [](int64_t n) { return torch::empty({std::max<int64_t>(n, 1)}, torch::kFloat32); };
    auto xq_t = torch::empty({M * K}, torch::kInt8);
    auto xd_t = f32(M * K / 32), xs_t = f32(M * K / 32), xh_t = f32(M * K / 16), qkv_t = f32(M * F), q_t = f32(M * H * D),
         att_t = f32(M * H * D), h_t = f32(M * hidden), gu_t = f32(M * 2 * inter);
    int8_t* xq = xq_t.data_ptr<int8_t>();
    float *xd = xd_t.data_ptr<float>(), *xs = xs_t.data_ptr<float>(), *xh = xh_t.data_ptr<float>(),
          *qkv = qkv_t.data_ptr<float>(),
          *q = q_t.data_ptr<float>(), *att = att_t.data_ptr<float>(), *h = h_t.data_ptr<float>(),
          *gu = gu_t.data_ptr<float>(), *hs = state.data_ptr<float>();  // hs: the running hidden state
    const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();

    by_element(kcache, [&](auto element) {
        using E = decltype(element);
        E *kbase = elements<E>(kcache), *vbase = elements<E>(vcache);
#pragma omp parallel num_threads(at::get_num_threads())
        {
            std::vector<float> buf(K), k(D), scores(std::min<int64_t>(G, 4) * (at.L + 8));
            // Attention work by (row, kv head), or by (row, q head) where that is too few items to
            // keep the team busy (a one-token step has as many items as kv heads).
            const int64_t heads_per_item = M * KV >= 4 * omp_get_num_threads() ? G : 1;
            // A few rows are quantized by every thread for itself (cheaper than waiting for each
            // other), more are split between the threads.
            const bool own = M <= kOwnRows;
            std::vector<int8_t> own_q(own ? M * K : 0);
            std::vector<float> own_d(own ? M * K / 32 : 0), own_s(own ? M * K / 32 : 0), own_h(own ? M * K / 16 : 0);
            const Quantized rows = own ? Quantized{own_q.data(), own_d.data(), own_s.data(), own_h.data()}
                                       : Quantized{xq, xd, xs, xh};
            // the rows of `in` quantized as a linear reads them, then this thread's column groups
            // of the linear, then a barrier (the next step reads every column)
            auto linear = [&](const Weights& lin, const float* in, int64_t stride, const float* norm, float eps, bool glu,
                              float* out, const float* residual, const float* bias = nullptr) {
                const auto [m0, m1] = own ? std::pair<int64_t, int64_t>{0, M} : share(M);
                quantize_rows(in, stride, lin.K, norm, eps, glu, rows.q, rows.d, rows.s, rows.h, m0, m1, buf.data());
                if (!own) {
#pragma omp barrier
                }
                const auto [g0, g1] = share(lin.N / 16);
                lin.groups(g0, g1, rows, M, out, residual, bias);
#pragma omp barrier
            };
            for (size_t i = 0; i < layers.size(); ++i) {
                const Layer& l = *layers[i];
                for (size_t j = 0; j < save.size(); ++j)
                    if (save[j] == static_cast<int64_t>(i) && omp_get_thread_num() == 0)
                        std::memcpy(kept[j].data_ptr<float>(), hs, M * hidden * sizeof(float));
                E *kc = kbase + (first + i) * layer_stride, *vc = vbase + (first + i) * layer_stride;
                linear(*l.linears[0], hs, hidden, l.in_norm.data_ptr<float>(), l.in_eps, false, qkv, nullptr,
                       l.qkv_bias.defined() ? l.qkv_bias.data_ptr<float>() : nullptr);
                {
                    const auto [r0, r1] = share(M);
                    rope_and_store(r0, r1, qkv, cp, sp, H, KV, D, at, kc, vc, capacity, q, k.data());
                }
#pragma omp barrier
                {
                    const int64_t per_row = H / heads_per_item;
                    const auto [i0, i1] = share_by_cost(M * per_row, [&](int64_t i) { return at.counts[i / per_row] + 1; });
                    attend_cache_items<E>(i0, i1, q, H, KV, heads_per_item, D, at, kc, vc, capacity, scores.data(), att);
                }
#pragma omp barrier
                linear(*l.linears[1], att, H * D, nullptr, 0.f, false, h, hs);
                linear(*l.linears[2], h, hidden, l.post_norm.data_ptr<float>(), l.post_eps, false, gu, nullptr);
                linear(*l.linears[3], gu, 2 * l.inter, nullptr, 0.f, true, hs, h);
            }
            if (head) {
                // the final norm of every row (the features a draft head reads), then the output
                // layer on the logit rows, quantized as a linear reads them
                float* xn = normed.data_ptr<float>();
                const auto [m0, m1] = share(M);
                for (int64_t m = m0; m < m1; ++m)
                    avx2::rms_norm(hs + m * hidden, hidden, head->norm.data_ptr<float>(), head->eps, xn + m * hidden);
#pragma omp barrier
                const auto [r0, r1] = own ? std::pair<int64_t, int64_t>{0, R} : share(R);
                const int64_t nb = hidden / 32;
                for (int64_t r = r0; r < r1; ++r)
                    avx2::quantize_input(xn + logit_rows[r] * hidden, hidden, nullptr, 0.f, false, buf.data(),
                                         rows.q + r * hidden, rows.d + r * nb, rows.s + r * nb, rows.h + r * 2 * nb);
                if (!own) {
#pragma omp barrier
                }
                const auto [g0, g1] = share(head->lin->N / 16);
                head->lin->groups(g0, g1, rows, R, logits.data_ptr<float>(), nullptr);
            }
        }
    });
    std::vector<torch::Tensor> out{normed};
    if (head) out.push_back(logits);
    out.insert(out.end(), kept.begin(), kept.end());
    return out;
}

std::string isa() { return cpu_has_vnni() ? "avx512-vnni" : (cpu_has_avx2() ? "avx2" : "none"); }

// The int8 multiply-adds per second one thread of the kernels' instruction set can issue (the
// best of a few short runs): what a compute-bound forward cannot beat.
double int8_peak() {
    double best = 0.0;
    for (int run = 0; run < 5; ++run)
        best = std::max(best, cpu_has_vnni() ? vnni::int8_peak(2000000) : avx2::int8_peak(2000000));
    return best;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    py::class_<Weights, std::shared_ptr<Weights>>(m, "Weights", "one linear layer's quantized weights, its parts side by side")
        .def(py::init<std::vector<torch::Tensor>, std::vector<int64_t>, int64_t>(), py::arg("parts"), py::arg("codes"),
             py::arg("k"))
        .def_readonly("n", &Weights::N)
        .def_readonly("k", &Weights::K);
    // The heavy calls let go of the GIL: a device stage's event loop (heartbeats, KV shipping) runs
    // on another thread beside them, and a long prefill must not silence it.
    m.def("qlinear", &qlinear, "quantized linear: float32 [M, K] x quantized weights -> float32 [M, N]",
          py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("w"), py::arg("norm_weight") = py::none(), py::arg("eps") = 0.0, py::arg("glu") = false,
          py::arg("residual") = py::none());
    m.def("set_prefetch_min_rows", [](int rows) { prefetch_min_rows = rows; },
          "the fewest rows of a product whose first row tile prefetches the next column group's weights");
    m.def("prefetch_min_rows", []() { return prefetch_min_rows; });
    m.def("greedy", &greedy, "each row's first largest value's index (torch.max over the last dimension)");
    m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension, as the kernels compute it inside a layer");
    m.def("dequantize_rows", &dequantize_rows, "rows of quantized weights, dequantized to float32",
          py::call_guard<py::gil_scoped_release>());
    m.def("attention", &attention, "grouped-query attention, each query row's sums in cache order",
          py::call_guard<py::gil_scoped_release>());
    m.def("attend_cached", &attend_cached, "rope, KV-cache write and attention of one decoder layer",
          py::call_guard<py::gil_scoped_release>());
    py::class_<Layer, std::shared_ptr<Layer>>(m, "Layer", "a decoder layer's quantized weights, as decoder_layers runs them")
        .def(py::init<torch::Tensor, double, std::shared_ptr<Weights>, std::shared_ptr<Weights>, torch::Tensor, double,
                      std::shared_ptr<Weights>, std::shared_ptr<Weights>, int64_t, int64_t, std::optional<torch::Tensor>>());
    py::class_<Head, std::shared_ptr<Head>>(m, "Head", "the final norm and output layer, as decoder_layers runs them")
        .def(py::init<torch::Tensor, double, std::shared_ptr<Weights>>());
    m.def("decoder_layers", &decoder_layers, "decoder layers on quantized weights in one call, one team of threads",
          py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("layers"), py::arg("first"), py::arg("cos"), py::arg("sin"), py::arg("kcache"),
          py::arg("vcache"), py::arg("slots"), py::arg("starts"), py::arg("bias"), py::arg("save"),
          py::arg("head") = py::none(), py::arg("logit_rows") = std::vector<int64_t>{},
          py::arg("prefix_src") = std::vector<int64_t>{}, py::arg("prefix_len") = std::vector<int64_t>{});
    m.def("int8_peak", &int8_peak, "int8 multiply-adds per second on one thread, as the kernels issue them");
    m.def("isa", &isa, "the instruction set the kernels run with on this CPU ('none': unsupported)");
}
