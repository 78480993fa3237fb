// Torch binding of the quantized linear kernels (qgemm_body.h): activations are quantized to int8
// per block of 32, then the instruction set picked at load time runs the packed weights, with the
// column groups split over torch's own OpenMP threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <optional>
#include <string>
#include <vector>

#define SPECSOT_DECLARE(ISA)                                                                          \
    namespace ISA {                                                                                   \
    void gemm_q4(const uint8_t*, int64_t, int64_t, int64_t, int64_t, const int8_t*, const float*,     \
                 const float*, int64_t, float*, int64_t);                                             \
    void gemm_q8(const uint8_t*, int64_t, int64_t, int64_t, int64_t, const int8_t*, const float*,     \
                 const float*, int64_t, float*, int64_t);                                             \
    }
SPECSOT_DECLARE(avx2)
SPECSOT_DECLARE(vnni)
namespace avx2 {
void attend_group(const float*, const float*, const float*, int64_t, int64_t, const int32_t*, int64_t, int64_t, float*,
                  float*);
void attend_group(const float*, const uint16_t*, const uint16_t*, int64_t, int64_t, const int32_t*, int64_t, int64_t,
                  float*, float*);
void to_half(const float*, int64_t, uint16_t*);
void quantize_input(const float*, int64_t, const float*, float, bool, float*, int8_t*, float*, float*);
}

namespace {

using GemmFn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, int64_t, const int8_t*, const float*,
                        const float*, int64_t, float*, int64_t);

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

// y = f(x) W^T (+ residual): x float32 [M, K] (K a multiple of 32; [M, 2K] with glu), w the packed
// uint8 weight of format 4 or 8 with N output columns; f is the identity, an RMSNorm with
// `norm_weight` and `eps`, or (glu) silu(x[:, :K]) * x[:, K:]. Returns float32 [M, N].
torch::Tensor qlinear(torch::Tensor x, torch::Tensor w, int64_t fmt, int64_t N,
                      std::optional<torch::Tensor> norm_weight, double eps, bool glu,
                      std::optional<torch::Tensor> residual) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "qlinear wants float32 [M, K] input");
    TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "qlinear wants a packed uint8 weight");
    TORCH_CHECK(fmt == 4 || fmt == 8, "qlinear format must be 4 or 8");
    TORCH_CHECK(N % 8 == 0, "qlinear wants N a multiple of 8");
    x = x.contiguous();
    const int64_t M = x.size(0), stride = x.size(1), K = glu ? stride / 2 : stride;
    TORCH_CHECK(K % 32 == 0, "qlinear wants K a multiple of 32");
    const int64_t nblocks = K / 32, groups = N / 8;
    const int64_t block_bytes = fmt == 4 ? 160 : 272;
    TORCH_CHECK(w.numel() == groups * nblocks * block_bytes, "qlinear weight size does not match N and K");
    torch::Tensor nw;
    if (norm_weight.has_value()) {
        nw = norm_weight->to(torch::kFloat32).contiguous();
        TORCH_CHECK(nw.numel() == K, "qlinear norm weight must have K elements");
    }
    const float* np = norm_weight.has_value() ? nw.data_ptr<float>() : nullptr;

    auto xq = torch::empty({M, K}, torch::kInt8);
    auto xd = torch::empty({M, nblocks}, torch::kFloat32);
    auto xs = torch::empty({M, nblocks}, torch::kFloat32);
    const float* xp = x.data_ptr<float>();
    int8_t* qp = xq.data_ptr<int8_t>();
    float *dp = xd.data_ptr<float>(), *sp = xs.data_ptr<float>();
    at::parallel_for(0, M, std::max<int64_t>(1, 64 / nblocks), [&](int64_t m0, int64_t m1) {
        std::vector<float> buf(K);
        for (int64_t m = m0; m < m1; ++m) {
            avx2::quantize_input(xp + m * stride, K, np, static_cast<float>(eps), glu, buf.data(), qp + m * K,
                                 dp + m * nblocks, sp + m * nblocks);
        }
    });

    torch::Tensor out = torch::empty({M, N}, torch::kFloat32);
    const bool vnni = cpu_has_vnni();
    GemmFn fn = fmt == 4 ? (vnni ? vnni::gemm_q4 : avx2::gemm_q4) : (vnni ? vnni::gemm_q8 : avx2::gemm_q8);
    const uint8_t* wp = w.data_ptr<uint8_t>();
    float* op = out.data_ptr<float>();
    // A chunk of column groups worth at least ~2k block dot products, so small matrices stay on
    // one thread instead of paying for a parallel region.
    const int64_t grain = std::max<int64_t>(1, 2048 / (nblocks * M));
    at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
        fn(wp, block_bytes, nblocks, g0, g1, qp, dp, sp, M, op, N);
    });
    if (residual.has_value()) {
        TORCH_CHECK(residual->numel() == M * N, "qlinear residual must be [M, N]");
        out.add_(residual->reshape({M, N}).to(torch::kFloat32));
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

// out [B, T, H, D] from q [B, T, H, D] (contiguous), with batch row b's keys and values for kv
// head h at key_base(b) + h * kstride (rows of D elements of type E: float, or fp16 bits).
template <class E, class KeyBase, class ValueBase>
void attend_all(const float* q, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D, int64_t L,
                const int32_t* lists, const std::vector<int64_t>& counts, KeyBase key_base, ValueBase value_base,
                int64_t kstride, int64_t vstride, float* out) {
    const int64_t G = H / KV;
    const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(G * L * D / 8, 1));
    at::parallel_for(0, B * T * KV, grain, [&](int64_t i0, int64_t i1) {
        std::vector<float> scores(std::min<int64_t>(G, 4) * (L + 8));
        for (int64_t i = i0; i < i1; ++i) {
            const int64_t r = i / KV, h = i % KV, b = r / T;
            const E* keys = key_base(b) + h * kstride;
            const E* values = value_base(b) + h * vstride;
            avx2::attend_group(q + i * G * D, keys, values, D, D, lists + r * L, counts[r], G, scores.data(),
                               out + i * G * D);
        }
    });
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

// A decoder layer's whole attention on a layer of the KV cache: qkv [B, T, (H + 2 KV) * D] (the
// fused projection's output), cos and sin [B, T, D] (model.rope_tables' sign-folded sin at each
// position), kcache and vcache [slots, KV, capacity, D] (the layer's cache, float32 or float16,
// written in place: fp16 rounds to nearest even),
// batch row b at cache slot slots[b] from position starts[b]. Rotates q and k, stores k and v,
// attends as `attention` does (bias over the L = max(starts) + T first positions, or None) and
// returns [B, T, H * D].
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
    TORCH_CHECK(static_cast<int64_t>(slots.size()) == B && static_cast<int64_t>(starts.size()) == B,
                "attend_cached: one slot and start per batch row");
    for (const auto& c : {kcache, vcache})
        TORCH_CHECK(c.scalar_type() == kcache.scalar_type() && c.is_contiguous() && c.dim() == 4 && c.size(1) == KV &&
                        c.size(3) == D, "attend_cached wants a contiguous cache layer [slots, KV, capacity, D]");
    const int64_t capacity = kcache.size(2);
    int64_t L = 0;
    for (int64_t b = 0; b < B; ++b) {
        TORCH_CHECK(slots[b] >= 0 && slots[b] < kcache.size(0) && starts[b] >= 0 && starts[b] + T <= capacity,
                    "attend_cached: slot or position out of the cache");
        L = std::max(L, starts[b] + T);
    }
    const int64_t half = D / 2, F = (H + 2 * KV) * D, slot_stride = KV * capacity * D, head_stride = capacity * D;
    const float *xp = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
    auto q = torch::empty({B, T, H, D}, torch::kFloat32);
    float* qp = q.data_ptr<float>();
    // rotate-half rope: x * cos + [x2, x1] * sin, sin's first half negated
    auto rope = [&](const float* x, const float* c, const float* s, float* y) {
        for (int64_t i = 0; i < D; ++i) y[i] = x[i] * c[i] + x[i < half ? i + half : i - half] * s[i];
    };
    auto lists = torch::empty({B * T, std::max<int64_t>(L, 1)}, torch::kInt32);
    const auto counts = visible_keys(bias, B, T, L, lists.data_ptr<int32_t>());
    auto out = torch::empty({B, T, H * D}, torch::kFloat32);
    by_element(kcache, [&](auto element) {
        using E = decltype(element);
        E *kc = elements<E>(kcache), *vc = elements<E>(vcache);
        at::parallel_for(0, B * T, 1, [&](int64_t r0, int64_t r1) {
            std::vector<float> k(D);
            for (int64_t r = r0; r < r1; ++r) {
                const int64_t b = r / T, t = r % T;
                const float *x = xp + r * F, *c = cp + r * D, *s = sp + r * D;
                for (int64_t h = 0; h < H; ++h) rope(x + h * D, c, s, qp + (r * H + h) * D);
                for (int64_t h = 0; h < KV; ++h) {
                    const int64_t at = slots[b] * slot_stride + h * head_stride + (starts[b] + t) * D;
                    rope(x + (H + h) * D, c, s, k.data());
                    store_row(k.data(), D, kc + at);
                    store_row(x + (H + KV + h) * D, D, vc + at);
                }
            }
        });
        attend_all<E>(qp, B, T, H, KV, D, L, lists.data_ptr<int32_t>(), counts,
                      [&](int64_t b) -> const E* { return kc + slots[b] * slot_stride; },
                      [&](int64_t b) -> const E* { return vc + slots[b] * slot_stride; }, head_stride, head_stride,
                      out.data_ptr<float>());
    });
    return out;
}

// One whole decoder layer on quantized weights, in one call (what model.DecoderLayer runs through
// its modules, with no Python between the steps): x [B, T, hidden] float32; RMSNorm (in_norm),
// the fused q/k/v projection, rope + cache write + attention (attend_cached), the output
// projection plus x, RMSNorm (post_norm), gate/up, silu(gate) * up, down plus the residual.
// Each linear is (packed weight, format, output columns), as qlinear takes them.
torch::Tensor decoder_layer(torch::Tensor x, torch::Tensor in_norm, double in_eps, torch::Tensor qkv, int64_t qkv_fmt,
                            int64_t qkv_n, torch::Tensor o, int64_t o_fmt, int64_t o_n, torch::Tensor post_norm,
                            double post_eps, torch::Tensor gate_up, int64_t gate_up_fmt, int64_t gate_up_n,
                            torch::Tensor down, int64_t down_fmt, int64_t down_n, torch::Tensor cos, torch::Tensor sin,
                            torch::Tensor kcache, torch::Tensor vcache, std::vector<int64_t> slots,
                            std::vector<int64_t> starts, std::optional<torch::Tensor> bias, int64_t H, int64_t KV) {
    TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat32, "decoder_layer wants float32 x [B, T, hidden]");
    const int64_t B = x.size(0), T = x.size(1), hidden = x.size(2);
    const auto rows = x.reshape({B * T, hidden});
    const auto q = qlinear(rows, qkv, qkv_fmt, qkv_n, in_norm, in_eps, false, std::nullopt);
    const auto attended = attend_cached(q.view({B, T, qkv_n}), cos, sin, kcache, vcache, slots, starts, bias, H, KV);
    const auto h = qlinear(attended.view({B * T, -1}), o, o_fmt, o_n, std::nullopt, 0.0, false, rows);
    const auto gu = qlinear(h, gate_up, gate_up_fmt, gate_up_n, post_norm, post_eps, false, std::nullopt);
    return qlinear(gu, down, down_fmt, down_n, std::nullopt, 0.0, true, h).view({B, T, down_n});
}

std::string isa() { return cpu_has_vnni() ? "avx512-vnni" : (cpu_has_avx2() ? "avx2" : "none"); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("qlinear", &qlinear, "quantized linear: float32 [M, K] x packed weight -> float32 [M, N]",
          py::arg("x"), py::arg("w"), py::arg("fmt"), py::arg("n"), py::arg("norm_weight") = py::none(),
          py::arg("eps") = 0.0, py::arg("glu") = false, py::arg("residual") = py::none());
    m.def("attention", &attention, "grouped-query attention, each query row's sums in cache order");
    m.def("attend_cached", &attend_cached, "rope, KV-cache write and attention of one decoder layer");
    m.def("decoder_layer", &decoder_layer, "a whole decoder layer on quantized weights (norms, attention, MLP)");
    m.def("isa", &isa, "the instruction set the kernels run with on this CPU ('none': unsupported)");
}
