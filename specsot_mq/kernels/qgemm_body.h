// Quantized matrix-vector / small-GEMM kernel body, compiled once per instruction set: the file
// that includes it sets `#pragma GCC target(...)`, `SPECSOT_VNNI` and the namespace.
//
// Weights are packed by groups of 16 output columns (see specsot_mq/quant.py, `Format`): a group
// holds its records (a block of 32 inputs, or a K-quant super-block of 8 such blocks) one after
// another, so a tile of 16 columns reads one sequential stream. Within a record every field holds
// 16 columns side by side: a K-quant's super-block header (fp16 d, dmin), then per block of 32
// inputs the weights' low nibbles as 4 vectors of 64 bytes (column c's byte j of vector v: input
// 4v + j in the low nibble, input 16 + 4v + j in the high one), the high bits of 5- and 6-bit
// weights as one or two more vectors of such bytes, then the block's scales: fp16 d (and m), or a
// K-quant's 6-bit sub-block scales and mins as bytes (Q6_K: signed scales of each half). So one
// 32-bit lane holds 4 consecutive inputs of one column and a u8 x s8 dot product of 4 bytes
// (dpbusd, or maddubs + madd on AVX2) yields each column's partial sum in its own lane: no
// horizontal sums. 8-bit weights (Q8_0) hold 8 vectors of signed bytes, then d. The values are the
// GGUF file's own integers: unsigned weights q with w = s * q + o per column and block of 32 (of 16
// for Q6_K), s and o from the block's and super-block's scales. Activations arrive quantized to int8
// per block of 32 with a float scale, with d * sum(q) per block and per half block for the offsets.
//
// Every output element is computed by one thread, over the blocks in order, with exact integer
// partial sums: its value does not depend on how many rows or threads ran, so a k-row verify
// computes bit for bit what k one-row steps compute.
#include <immintrin.h>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "qformat.h"

namespace SPECSOT_ISA {

// Keeps the compiler from reassociating a chain of integer sums (which it may: they are exact) into
// a tree whose partial sums spill out of the registers: each sum stays where the code puts it.
#ifndef SPECSOT_PIN
#define SPECSOT_PIN(v) asm("" : "+v"(v))
#endif

static inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Shift each byte's bits by s (left for s > 0; a constant once the callers' loops unroll), on 16-bit
// lanes: the callers mask the bits they take, which never come from the neighbouring byte (s from -4
// to 4; bits 4-5 taken, or the low nibble after -4).
#if SPECSOT_VNNI
using VI = __m512i;
using VF = __m512;
static inline VI shift_bits(VI x, int s) { return s >= 0 ? _mm512_slli_epi16(x, s) : _mm512_srli_epi16(x, -s); }
static inline VI vand(VI a, VI b) { return _mm512_and_si512(a, b); }
static inline VI vor(VI a, VI b) { return _mm512_or_si512(a, b); }
static inline VI bytes_set(int v) { return _mm512_set1_epi8(static_cast<char>(v)); }
static inline VI load_w(const uint8_t* p) { return _mm512_loadu_si512(p); }
// 16 columns' scales as floats: fp16, unsigned or signed bytes
static inline VF f16s(const uint8_t* p) { return _mm512_cvtph_ps(load32(p)); }
static inline VF u8s(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
static inline VF i8s(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
static inline VF fmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
static inline VF fset(float v) { return _mm512_set1_ps(v); }
#else
using VI = __m256i;
using VF = __m256;
static inline VI shift_bits(VI x, int s) { return s >= 0 ? _mm256_slli_epi16(x, s) : _mm256_srli_epi16(x, -s); }
static inline VI vand(VI a, VI b) { return _mm256_and_si256(a, b); }
static inline VI vor(VI a, VI b) { return _mm256_or_si256(a, b); }
static inline VI bytes_set(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
static inline VI load_w(const uint8_t* p) { return load32(p); }
// 8 columns' scales as floats (one half of a group: the caller offsets p)
static inline VF f16s(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
static inline VF u8s(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
static inline VF i8s(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
static inline VF fmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
static inline VF fset(float v) { return _mm256_set1_ps(v); }
#endif

// Columns per vector, and the byte step from one half group's scales to the next (AVX2 runs a group
// as two halves of 8 columns; VNNI's 512-bit vectors hold all 16).
#if SPECSOT_VNNI
constexpr int kHalves = 1;
#else
constexpr int kHalves = 2;
#endif

// The record header's vectors (K-quants): the super-block scale d and minus its dmin.
struct Head {
    VF d, neg_min;
};
template <int C>
static inline Head read_head(const uint8_t* rec, int g) {
    Head h{};
    if constexpr (Fmt<C>::k_quant) {
        h.d = f16s(rec + 16 * g);
        if constexpr (C != kQ6_K) h.neg_min = fmul(f16s(rec + 32 + 16 * g), fset(-1.f));
    }
    return h;
}

// A block's scales s and offsets o (w = s * q + o) for half g of the group, from its scale fields at
// `sc`: lo for inputs 0-15 of the block, hi for 16-31 (the same unless the format splits them).
template <int C>
static inline void read_scales(const uint8_t* sc, const Head& h, int g, VF& s_lo, VF& s_hi, VF& o_lo, VF& o_hi) {
    constexpr int step = 16 / kHalves;  // fp16 bytes per half = 2 * (8 columns); bytes: 8 columns
    if constexpr (C == kQ4_0 || C == kQ5_0 || C == kQ8_0) {
        s_lo = f16s(sc + 2 * step * g);
        o_lo = fmul(s_lo, fset(C == kQ4_0 ? -8.f : -16.f));
    } else if constexpr (C == kQ4_1 || C == kQ5_1) {
        s_lo = f16s(sc + 2 * step * g);
        o_lo = f16s(sc + 32 + 2 * step * g);
    } else if constexpr (C == kQ6_K) {
        s_lo = fmul(h.d, i8s(sc + step * g));
        s_hi = fmul(h.d, i8s(sc + 16 + step * g));
        o_lo = fmul(s_lo, fset(-32.f));
        o_hi = fmul(s_hi, fset(-32.f));
        return;
    } else {  // Q4_K, Q5_K: 6-bit scale and min per block, as bytes
        s_lo = fmul(h.d, u8s(sc + step * g));
        o_lo = fmul(h.neg_min, u8s(sc + 16 + step * g));
    }
    s_hi = s_lo;
    o_hi = o_lo;
}

// Vector v of a block's weights at `blk` (half g on AVX2) as unsigned bytes: lo for inputs 4v..4v+3
// of each column, hi for 16+4v..16+4v+3, the high bits of 5- and 6-bit weights put back.
template <int C>
static inline void read_weights(const uint8_t* blk, int v, int g, VI& lo, VI& hi) {
    const VI nib = load_w(blk + 64 * v + 32 * g);
    const VI low = bytes_set(0x0F);
    lo = vand(nib, low);
    hi = vand(shift_bits(nib, -4), low);
    if constexpr (Fmt<C>::bits == 5) {
        // one byte of high bits per column and 4 inputs: bit v for input 4v + j, bit 4 + v for 16 + 4v + j
        const VI p = load_w(blk + 256 + 32 * g), bit = bytes_set(0x10);
        lo = vor(lo, vand(shift_bits(p, 4 - v), bit));
        hi = vor(hi, vand(shift_bits(p, -v), bit));
    } else if constexpr (Fmt<C>::bits == 6) {
        // two vectors of 2-bit pairs: bits 2v, 2v + 1 for input 4v + j (then 16 + 4v + j)
        const VI two = bytes_set(0x30);
        lo = vor(lo, vand(shift_bits(load_w(blk + 256 + 32 * g), 4 - 2 * v), two));
        hi = vor(hi, vand(shift_bits(load_w(blk + 320 + 32 * g), 4 - 2 * v), two));
    }
}

// Rows in one tile: its accumulators and integer sums stay in the registers. VNNI: 2 R (3 R for
// Q6_K's split halves) of AVX-512's 32; 12 rather than 6 made a whole forward of 8 / 12 / 16 / 32
// rows 1.08x / 1.05x / 1.05x / 1.03x as fast (`python benchmarks/kernels.py --base 21f7383`, AVX-512
// Zen 4). AVX2: 2 halves x 2 R of its 16, fewer for the wider weights.
template <int C>
constexpr int max_rows() {
#if SPECSOT_VNNI
    return C == kQ6_K ? 8 : 12;
#else
    return Fmt<C>::bits == 6 ? 2 : Fmt<C>::bits == 5 ? 3 : 4;
#endif
}

#if SPECSOT_VNNI
static inline __m512i bcast4(const int8_t* p) {
    int32_t v;
    __builtin_memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// acc + dpbusd(w, x's 4 bytes at p broadcast to every lane), the broadcast folded into the
// instruction's memory operand ({1to16}): the compiler emitted a separate vpbroadcastd for each,
// one more vector instruction for every dpbusd of the tile. (The operand names the 4 bytes as a
// char array, which may alias the int8 activations.)
static inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t* p) {
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const char(*)[4]>(p)));
    return acc;
}

// A tile: R rows by one group of 16 columns (one 512-bit vector), over every record of the inputs.
// Unsigned weights: dpbusd adds each lane's 4 weight x int8 products into its int32 sum. 8-bit
// weights: dpbusd takes x + 128 (x's sign bit flipped) as its unsigned side, and 128 * sum(q) per
// column (one more dpbusd per weight vector, shared by the rows) comes off at the end of the block.
template <int C, int R>
static inline void tile(const uint8_t* w, int nrec, const int8_t* const* xq, const float* const* xd,
                        const float* const* xs, const float* const* xh, float* const* out, const uint8_t* next) {
    using F = Fmt<C>;
    const uint8_t* const start = w;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int rec = 0; rec < nrec; ++rec) {
        const Head h = read_head<C>(w, 0);
        w += F::head;
        for (int j = 0; j < F::blocks; ++j, w += F::block) {
            const int b = rec * F::blocks + j;
            // the same block of the next group brought into L1 while this one computes (see gemm_format)
            if (next != nullptr)
                for (int c = 0; c < F::block; c += 64) _mm_prefetch(reinterpret_cast<const char*>(next + (w - start)) + c, _MM_HINT_T0);
            __m512i isum[R], isum_hi[F::split ? R : 1];
            for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
            if constexpr (F::split)
                for (int r = 0; r < R; ++r) isum_hi[r] = _mm512_setzero_si512();
            if constexpr (C == kQ8_0) {
                const __m512i flip = bytes_set(0x80);
                __m512i offset = _mm512_setzero_si512();
                for (int v = 0; v < 8; ++v) {
                    const __m512i q = load_w(w + 64 * v);
                    offset = _mm512_dpbusd_epi32(offset, flip, q);
                    for (int r = 0; r < R; ++r) {
                        isum[r] = _mm512_dpbusd_epi32(isum[r], _mm512_xor_si512(bcast4(xq[r] + 32 * b + 4 * v), flip), q);
                        SPECSOT_PIN(isum[r]);
                    }
                }
                for (int r = 0; r < R; ++r) isum[r] = _mm512_sub_epi32(isum[r], offset);
            } else {
#pragma GCC unroll 4
                for (int v = 0; v < 4; ++v) {
                    __m512i lo, hi;
                    read_weights<C>(w, v, 0, lo, hi);
                    for (int r = 0; r < R; ++r) {
                        const int8_t* x = xq[r] + 32 * b + 4 * v;
                        // (each dpbusd_bcast is an asm statement: the chains stay as written, no PIN)
                        if constexpr (F::split) {
                            isum[r] = dpbusd_bcast(isum[r], lo, x);
                            isum_hi[r] = dpbusd_bcast(isum_hi[r], hi, x + 16);
                        } else {
                            isum[r] = dpbusd_bcast(dpbusd_bcast(isum[r], lo, x), hi, x + 16);
                        }
                    }
                }
            }
            __m512 s_lo, s_hi, o_lo, o_hi;
            read_scales<C>(w + F::weights, h, 0, s_lo, s_hi, o_lo, o_hi);
            for (int r = 0; r < R; ++r) {
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(s_lo, _mm512_set1_ps(xd[r][b])), acc[r]);
                if constexpr (F::split) {
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum_hi[r]), _mm512_mul_ps(s_hi, _mm512_set1_ps(xd[r][b])), acc[r]);
                    acc[r] = _mm512_fmadd_ps(o_lo, _mm512_set1_ps(xh[r][2 * b]), acc[r]);
                    acc[r] = _mm512_fmadd_ps(o_hi, _mm512_set1_ps(xh[r][2 * b + 1]), acc[r]);
                } else if constexpr (F::offset) {
                    acc[r] = _mm512_fmadd_ps(o_lo, _mm512_set1_ps(xs[r][b]), acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out[r], acc[r]);
}
#else
static inline __m256i bcast4(const int8_t* p) {
    int32_t v;
    __builtin_memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

// A tile: R rows by one group, as its two halves of 8 columns (G), over every record of the inputs.
// Each activation broadcast serves both halves and each unpacked weight vector the R rows. maddubs'
// u8 x s8 pair sums add up in int16 lanes for as many vectors as cannot overflow (4-bit weights: a
// whole block, 15 x 127 x 2 x 8 = 30480; 5-bit: two vectors; 6-bit, per half block: two), then madd
// widens them. 8-bit weights: maddubs takes |q| and x with q's sign (llama.cpp's trick), which keeps
// its int16 pairs from saturating. The sums are exact integers.
template <int C, int R>
static inline void tile(const uint8_t* w, int nrec, const int8_t* const* xq, const float* const* xd,
                        const float* const* xs, const float* const* xh, float* const* out, const uint8_t* next) {
    using F = Fmt<C>;
    constexpr int G = kHalves, widen = F::bits == 4 ? 4 : 2;
    constexpr int S = F::split ? 2 : 1;  // integer sums per row and half: the block's, or each half block's
    const uint8_t* const start = w;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[R][G];
    for (int r = 0; r < R; ++r)
        for (int g = 0; g < G; ++g) acc[r][g] = _mm256_setzero_ps();
    for (int rec = 0; rec < nrec; ++rec) {
        Head h[G];
        for (int g = 0; g < G; ++g) h[g] = read_head<C>(w, g);
        w += F::head;
        for (int j = 0; j < F::blocks; ++j, w += F::block) {
            const int b = rec * F::blocks + j;
            // the same block of the next group brought into L1 while this one computes (see gemm_format)
            if (next != nullptr)
                for (int c = 0; c < F::block; c += 64) _mm_prefetch(reinterpret_cast<const char*>(next + (w - start)) + c, _MM_HINT_T0);
            __m256i isum[R][G][S];
            if constexpr (C == kQ8_0) {
                for (int r = 0; r < R; ++r)
                    for (int g = 0; g < G; ++g) isum[r][g][0] = _mm256_setzero_si256();
                for (int v = 0; v < 8; ++v) {
                    __m256i q[G];
                    for (int g = 0; g < G; ++g) q[g] = load_w(w + 64 * v + 32 * g);
                    for (int r = 0; r < R; ++r) {
                        const __m256i x = bcast4(xq[r] + 32 * b + 4 * v);
                        for (int g = 0; g < G; ++g) {
                            const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(q[g]), _mm256_sign_epi8(x, q[g]));
                            isum[r][g][0] = _mm256_add_epi32(isum[r][g][0], _mm256_madd_epi16(pairs, ones));
                            SPECSOT_PIN(isum[r][g][0]);
                        }
                    }
                }
            } else {
                __m256i part[R][G][S];
                for (int r = 0; r < R; ++r)
                    for (int g = 0; g < G; ++g)
                        for (int s = 0; s < S; ++s) part[r][g][s] = _mm256_setzero_si256();
#pragma GCC unroll 4
                for (int v = 0; v < 4; ++v) {
                    __m256i lo[G], hi[G];
                    for (int g = 0; g < G; ++g) read_weights<C>(w, v, g, lo[g], hi[g]);
                    for (int r = 0; r < R; ++r) {
                        const int8_t* x = xq[r] + 32 * b + 4 * v;
                        const __m256i x_lo = bcast4(x), x_hi = bcast4(x + 16);
                        for (int g = 0; g < G; ++g) {
                            part[r][g][0] = _mm256_add_epi16(part[r][g][0], _mm256_maddubs_epi16(lo[g], x_lo));
                            part[r][g][S - 1] = _mm256_add_epi16(part[r][g][S - 1], _mm256_maddubs_epi16(hi[g], x_hi));
                            SPECSOT_PIN(part[r][g][0]);
                            if constexpr (S == 2) SPECSOT_PIN(part[r][g][1]);
                        }
                    }
                    if ((v + 1) % widen == 0) {
                        for (int r = 0; r < R; ++r)
                            for (int g = 0; g < G; ++g)
                                for (int s = 0; s < S; ++s) {
                                    const __m256i wide = _mm256_madd_epi16(part[r][g][s], ones);
                                    isum[r][g][s] = v + 1 == widen ? wide : _mm256_add_epi32(isum[r][g][s], wide);
                                    part[r][g][s] = _mm256_setzero_si256();
                                }
                    }
                }
            }
            for (int g = 0; g < G; ++g) {
                __m256 s_lo, s_hi, o_lo, o_hi;
                read_scales<C>(w + F::weights, h[g], g, s_lo, s_hi, o_lo, o_hi);
                for (int r = 0; r < R; ++r) {
                    acc[r][g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][g][0]), _mm256_mul_ps(s_lo, _mm256_set1_ps(xd[r][b])), acc[r][g]);
                    if constexpr (F::split) {
                        acc[r][g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][g][1]), _mm256_mul_ps(s_hi, _mm256_set1_ps(xd[r][b])), acc[r][g]);
                        acc[r][g] = _mm256_fmadd_ps(o_lo, _mm256_set1_ps(xh[r][2 * b]), acc[r][g]);
                        acc[r][g] = _mm256_fmadd_ps(o_hi, _mm256_set1_ps(xh[r][2 * b + 1]), acc[r][g]);
                    } else if constexpr (F::offset) {
                        acc[r][g] = _mm256_fmadd_ps(o_lo, _mm256_set1_ps(xs[r][b]), acc[r][g]);
                    }
                }
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int g = 0; g < G; ++g) _mm256_storeu_ps(out[r] + 8 * g, acc[r][g]);
}
#endif

// A row tile of `rows` rows (1 .. R) of format C: the tile compiled for exactly that many.
template <int C, int R>
static inline void run_tile(int rows, const uint8_t* w, int nrec, const int8_t* const* xq, const float* const* xd,
                            const float* const* xs, const float* const* xh, float* const* out, const uint8_t* next) {
    if constexpr (R > 1) {
        if (rows < R) return run_tile<C, R - 1>(rows, w, nrec, xq, xd, xs, xh, out, next);
    }
    tile<C, R>(w, nrec, xq, xd, xs, xh, out, next);
}

// out[m, 16g .. 16g+16] (row stride N) for column groups g in [g0, g1) of a weight of format C with
// nrec records per group, and every row m < M, in tiles of at most max_rows rows (a group's weights
// stay in L1 across its row tiles). xq [M, K] int8, xd and xs [M, K / 32], xh [M, K / 16].
template <int C>
static void gemm_format(const uint8_t* w, int64_t nrec, int64_t g0, int64_t g1, const int8_t* xq, const float* xd,
                        const float* xs, const float* xh, int64_t M, float* out, int64_t N) {
    constexpr int kMax = max_rows<C>();
    const int64_t nb = nrec * Fmt<C>::blocks, K = 32 * nb, tiles = (M + kMax - 1) / kMax;
    const int64_t group_bytes = nrec * (Fmt<C>::head + Fmt<C>::blocks * Fmt<C>::block);
    for (int64_t g = g0; g < g1; ++g) {
        const uint8_t* wg = w + g * group_bytes;
        for (int64_t t = 0, m0 = 0; t < tiles; ++t) {
            // rows split evenly between the tiles (5 rows on AVX2: 3 + 2, not 4 + 1, whose one-row
            // tile unpacks the weights for a single row)
            const int rows = static_cast<int>(M / tiles + (t < M % tiles ? 1 : 0));
            const int8_t* xr[kMax];
            const float *dr[kMax], *sr[kMax], *hr[kMax];
            float* orow[kMax];
            for (int r = 0; r < rows; ++r) {
                xr[r] = xq + (m0 + r) * K;
                dr[r] = xd + (m0 + r) * nb;
                sr[r] = xs + (m0 + r) * nb;
                hr[r] = xh + (m0 + r) * 2 * nb;
                orow[r] = out + (m0 + r) * N + 16 * g;
            }
            // With several rows, the first row tile brings the next group in while it computes
            // (weights come from memory: without this, the rows' compute and the next load took
            // turns). With one to three rows it depends on where the weights are: a model in the
            // last-level cache ran faster with it, one read from memory slower (docs/kernels.md):
            // quant.set_prefetch sets prefetch_min_rows by the weights' size.
            const uint8_t* next = M >= prefetch_min_rows && m0 == 0 && g + 1 < g1 ? wg + group_bytes : nullptr;
            run_tile<C, kMax>(rows, wg, static_cast<int>(nrec), xr, dr, sr, hr, orow, next);
            m0 += rows;
        }
    }
}

// gemm_format for the format numbered `code` (quant.py's Format.code).
void gemm(int64_t code, const uint8_t* w, int64_t nrec, int64_t g0, int64_t g1, const int8_t* xq, const float* xd,
          const float* xs, const float* xh, int64_t M, float* out, int64_t N) {
    by_format(code, [&](auto, auto c) { gemm_format<decltype(c)::value>(w, nrec, g0, g1, xq, xd, xs, xh, M, out, N); });
}

// `iters` rounds of 8 independent chains of what the 4-bit tile's inner loop issues per 32
// multiply-adds (VNNI: one dpbusd; AVX2: maddubs and a 16-bit add), written out in assembly so
// the compiler can neither merge nor drop them; returns a lane of the sums.
__attribute__((noinline)) static int int8_chains(int64_t iters) {
    __m256i c0 = _mm256_set1_epi32(0), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
    const __m256i a = _mm256_set1_epi8(1), b = _mm256_set1_epi8(2);
    for (int64_t i = 0; i < iters; ++i) {
#if SPECSOT_VNNI
        asm volatile(
            "vpdpbusd %[b], %[a], %[c0]\n\tvpdpbusd %[b], %[a], %[c1]\n\tvpdpbusd %[b], %[a], %[c2]\n\t"
            "vpdpbusd %[b], %[a], %[c3]\n\tvpdpbusd %[b], %[a], %[c4]\n\tvpdpbusd %[b], %[a], %[c5]\n\t"
            "vpdpbusd %[b], %[a], %[c6]\n\tvpdpbusd %[b], %[a], %[c7]"
            : [c0] "+v"(c0), [c1] "+v"(c1), [c2] "+v"(c2), [c3] "+v"(c3), [c4] "+v"(c4), [c5] "+v"(c5),
              [c6] "+v"(c6), [c7] "+v"(c7)
            : [a] "v"(a), [b] "v"(b));
#else
        __m256i t0, t1;
        asm volatile(
            "vpmaddubsw %[b], %[a], %[t0]\n\tvpaddw %[t0], %[c0], %[c0]\n\t"
            "vpmaddubsw %[b], %[a], %[t1]\n\tvpaddw %[t1], %[c1], %[c1]\n\t"
            "vpmaddubsw %[b], %[a], %[t0]\n\tvpaddw %[t0], %[c2], %[c2]\n\t"
            "vpmaddubsw %[b], %[a], %[t1]\n\tvpaddw %[t1], %[c3], %[c3]\n\t"
            "vpmaddubsw %[b], %[a], %[t0]\n\tvpaddw %[t0], %[c4], %[c4]\n\t"
            "vpmaddubsw %[b], %[a], %[t1]\n\tvpaddw %[t1], %[c5], %[c5]\n\t"
            "vpmaddubsw %[b], %[a], %[t0]\n\tvpaddw %[t0], %[c6], %[c6]\n\t"
            "vpmaddubsw %[b], %[a], %[t1]\n\tvpaddw %[t1], %[c7], %[c7]"
            : [c0] "+x"(c0), [c1] "+x"(c1), [c2] "+x"(c2), [c3] "+x"(c3), [c4] "+x"(c4), [c5] "+x"(c5),
              [c6] "+x"(c6), [c7] "+x"(c7), [t0] "=&x"(t0), [t1] "=&x"(t1)
            : [a] "x"(a), [b] "x"(b));
#endif
    }
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3)),
                                         _mm256_add_epi32(_mm256_add_epi32(c4, c5), _mm256_add_epi32(c6, c7)));
    return _mm256_extract_epi32(sum, 0);
}

// This instruction set's int8 multiply-add rate on one thread, in multiply-adds per second (the
// kernels' compute ceiling).
double int8_peak(int64_t iters) {
    const auto start = std::chrono::steady_clock::now();
    volatile int sink = int8_chains(iters);
    (void)sink;
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return 8.0 * 32.0 * static_cast<double>(iters) / seconds;
}

// exp(x) for 8 floats (Cephes' range reduction and polynomial; max relative error ~2e-7,
// 0 for x below -87). Deterministic: the same lanes give the same bits on any call.
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
    const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3365478515625f), _CMP_LT_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365478515625f));
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// The sum of a vector's 8 lanes, in one fixed tree.
static inline float hsum(__m256 v) {
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

// The largest of a vector's 8 lanes.
static inline float hmax(__m256 v) {
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    float top = lanes[0];
    for (int j = 1; j < 8; ++j) top = lanes[j] > top ? lanes[j] : top;
    return top;
}

// The index of the largest of x[0, n): the first one where several are, the first NaN where there
// is one (as torch.max over a dimension). Each lane keeps its first maximum; the lanes' are then
// compared by value, then index.
int64_t first_max(const float* x, int64_t n) {
    int64_t found = 0, i = 0;
    if (n >= 8) {
        const int64_t n8 = n - n % 8;
        __m256 best = _mm256_loadu_ps(x), nan = _mm256_cmp_ps(best, best, _CMP_UNORD_Q);
        __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), idx = at;
        const __m256i step = _mm256_set1_epi32(8);
        for (i = 8; i < n8; i += 8) {
            idx = _mm256_add_epi32(idx, step);
            const __m256 v = _mm256_loadu_ps(x + i);
            const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            best = _mm256_blendv_ps(best, v, gt);
            at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(idx), gt));
        }
        if (_mm256_movemask_ps(nan) != 0)
            for (int64_t k = 0; k < n8; ++k)
                if (x[k] != x[k]) return k;
        float vals[8];
        int32_t where[8];
        _mm256_storeu_ps(vals, best);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(where), at);
        found = where[0];
        for (int j = 1; j < 8; ++j)
            if (vals[j] > x[found] || (vals[j] == x[found] && where[j] < found)) found = where[j];
    } else if (x[0] != x[0]) {
        return 0;
    }
    for (i = std::max<int64_t>(i, 1); i < n; ++i) {
        if (x[i] != x[i]) return i;
        if (x[i] > x[found]) found = i;
    }
    return found;
}

// out[0, K) = norm * (x * r), r = 1 / sqrt(mean(x^2) + eps): an RMSNorm of one row (K a multiple of 8).
void rms_norm(const float* x, int64_t K, const float* norm, float eps, float* out) {
    __m256 ss = _mm256_setzero_ps();
    for (int64_t i = 0; i < K; i += 8) ss = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(x + i), ss);
    const __m256 r = _mm256_set1_ps(1.f / std::sqrt(hsum(ss) / static_cast<float>(K) + eps));
    for (int64_t i = 0; i < K; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(norm + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), r)));
}

// Row x of a layer's input, as the layer reads it, quantized: x itself, RMS-normalised and
// weighted (norm != nullptr), or silu(x[:K]) * x[K:] (glu, x holding 2K floats); then int8 values
// q, the scale d (x ~ d * q) and d * sum(q) per block of 32 (s) and per half block (h: the offsets of
// Q6_K's 16-input sub-blocks) (K a multiple of 32). buf holds K
// floats. Vector code throughout, each sum in a fixed order: a row's bits do not depend on the
// other rows of its call.
void quantize_input(const float* x, int64_t K, const float* norm, float eps, bool glu, float* buf, int8_t* q,
                    float* d, float* s, float* h) {
    const float* row = x;
    if (norm != nullptr) {
        rms_norm(x, K, norm, eps, buf);
        row = buf;
    } else if (glu) {
        const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
        for (int64_t i = 0; i < K; i += 8) {
            const __m256 g = _mm256_loadu_ps(x + i);
            const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g))));
            _mm256_storeu_ps(buf + i, _mm256_mul_ps(silu, _mm256_loadu_ps(x + K + i)));
        }
        row = buf;
    }
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t b = 0; b < K / 32; ++b, row += 32, q += 32) {
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps();
        for (int j = 0; j < 4; ++j) {
            v[j] = _mm256_loadu_ps(row + 8 * j);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
        }
        const float top = hmax(amax);
        const __m256 inv = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
        __m256i n[4];
        for (int j = 0; j < 4; ++j) n[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));  // nearest, ties to even
        const __m256i halves[2] = {_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3])};
        // int32 lanes -> int8, back in input order (packs interleave 128-bit halves)
        const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(n[0], n[1]), 0xD8);
        const __m256i x16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(n[2], n[3]), 0xD8);
        const __m256i b8 = _mm256_permute4x64_epi64(_mm256_packs_epi16(w16, x16), 0xD8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), b8);
        int half_sum[2];
        for (int i = 0; i < 2; ++i) {
            int32_t sums[8];
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums), halves[i]);
            half_sum[i] = ((sums[0] + sums[1]) + (sums[2] + sums[3])) + ((sums[4] + sums[5]) + (sums[6] + sums[7]));
        }
        d[b] = top / 127.f;
        s[b] = d[b] * static_cast<float>(half_sum[0] + half_sum[1]);
        h[2 * b] = d[b] * static_cast<float>(half_sum[0]);
        h[2 * b + 1] = d[b] * static_cast<float>(half_sum[1]);
    }
}

// 8 floats from a row of the KV cache: float32, or fp16 (the cache's default with the native
// kernels: half the bytes to read, converted exactly to float32 on load).
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The sums of 4 vectors' 8 lanes each: [sum a0, sum a1, sum a2, sum a3], every one in the same tree.
static inline __m128 hsum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 w = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(w), _mm256_extractf128_ps(w, 1));
}

// softmax in place over scores[0, n) (room for n + 8); returns 1 / the sum of the exponentials.
static inline float softmax_unnormalised(float* scores, int64_t n) {
    __m256 top8 = _mm256_set1_ps(-INFINITY);
    for (int64_t i = 0; i < n; i += 8) {
        const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - i)),
                                                 _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        top8 = _mm256_max_ps(top8, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(scores + i),
                                                     _mm256_castsi256_ps(valid)));
    }
    const float top = hmax(top8);
    __m256 total = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
        const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - i)),
                                                 _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + i), _mm256_set1_ps(top))),
                                       _mm256_castsi256_ps(valid));
        _mm256_storeu_ps(scores + i, p);
        total = _mm256_add_ps(total, p);
    }
    return 1.f / hsum(total);
}

// Ask for a cache row of D elements ahead of its use (rows are gathered through an index list).
template <class E>
static inline void prefetch_row(const E* row, int64_t D) {
    for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(E)); b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(row) + b, _MM_HINT_T0);
}

// out[g * D + 8c ..] for c < C (8C columns of each of the G heads): sum over the n listed keys of
// their softmax weight (scores[g * room + j]) times their value row, scaled by inv[g].
template <class E, int G, int C>
static inline void weigh_values(const E* values, int64_t stride, const int32_t* keys_at, int64_t n,
                                const float* scores, int64_t room, const float* inv, int64_t D, float* out) {
    __m256 acc[G][C];
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) acc[g][c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
        const E* v = values + keys_at[j] * stride;
        if (j + 32 < n) prefetch_row(values + keys_at[j + 32] * stride, 8 * C);
        __m256 p[G];
        for (int g = 0; g < G; ++g) p[g] = _mm256_set1_ps(scores[g * room + j]);
        for (int c = 0; c < C; ++c) {
            const __m256 vv = load8(v + 8 * c);
            for (int g = 0; g < G; ++g) acc[g][c] = _mm256_fmadd_ps(p[g], vv, acc[g][c]);
        }
    }
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + g * D + 8 * c, _mm256_mul_ps(acc[g][c], _mm256_set1_ps(inv[g])));
}

// G query heads that share one kv head, over one query row's visible keys: out[g * D ..] =
// softmax(q_g . keys[i]) . values[i] over the n keys listed in `keys_at` (indices into
// keys/values rows of D elements at a stride; D a multiple of 8). Each key row is loaded once for
// all G heads. scores has room for G * (n + 8) floats. Every sum runs over the listed keys in order,
// each score in one fixed tree, so a query gets the same bits whatever other queries, masked keys or
// cache length share its call: what keeps tree verification lossless.
template <class E, int G>
static inline void attend_heads(const float* q, const E* keys, const E* values, int64_t stride, int64_t D,
                                const int32_t* keys_at, int64_t n, float* scores, float* out) {
    const int64_t room = n + 8;
    if (n == 0) {
        for (int64_t d = 0; d < G * D; ++d) out[d] = 0.f;
        return;
    }
    for (int64_t i = 0; i < n; i += 4) {
        const E* k[4];
        for (int j = 0; j < 4; ++j) k[j] = keys + keys_at[i + j < n ? i + j : i] * stride;
        for (int j = 32; j < 36 && i + j < n; ++j) prefetch_row(keys + keys_at[i + j] * stride, D);
        __m256 acc[G][4];
        for (int g = 0; g < G; ++g)
            for (int j = 0; j < 4; ++j) acc[g][j] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            for (int j = 0; j < 4; ++j) {
                const __m256 kd = load8(k[j] + d);
                for (int g = 0; g < G; ++g) acc[g][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d), kd, acc[g][j]);
            }
        }
        for (int g = 0; g < G; ++g)
            _mm_storeu_ps(scores + g * room + i, hsum4x8(acc[g][0], acc[g][1], acc[g][2], acc[g][3]));
    }
    float inv[G];
    for (int g = 0; g < G; ++g) inv[g] = softmax_unnormalised(scores + g * room, n);
    int64_t d0 = 0;
    for (; d0 + 32 <= D; d0 += 32) weigh_values<E, G, 4>(values + d0, stride, keys_at, n, scores, room, inv, D, out + d0);
    for (; d0 < D; d0 += 8) weigh_values<E, G, 1>(values + d0, stride, keys_at, n, scores, room, inv, D, out + d0);
}

// attend_heads for any number of heads per kv head, up to 4 at a time.
template <class E>
static inline void attend_group_t(const float* q, const E* keys, const E* values, int64_t stride, int64_t D,
                                  const int32_t* keys_at, int64_t n, int64_t heads, float* scores, float* out) {
    for (int64_t g0 = 0; g0 < heads; g0 += 4) {
        const float* qg = q + g0 * D;
        float* og = out + g0 * D;
        switch (heads - g0 < 4 ? heads - g0 : 4) {
            case 4: attend_heads<E, 4>(qg, keys, values, stride, D, keys_at, n, scores, og); break;
            case 3: attend_heads<E, 3>(qg, keys, values, stride, D, keys_at, n, scores, og); break;
            case 2: attend_heads<E, 2>(qg, keys, values, stride, D, keys_at, n, scores, og); break;
            default: attend_heads<E, 1>(qg, keys, values, stride, D, keys_at, n, scores, og); break;
        }
    }
}

void attend_group(const float* q, const float* keys, const float* values, int64_t stride, int64_t D,
                  const int32_t* keys_at, int64_t n, int64_t heads, float* scores, float* out) {
    attend_group_t(q, keys, values, stride, D, keys_at, n, heads, scores, out);
}

void attend_group(const float* q, const uint16_t* keys, const uint16_t* values, int64_t stride, int64_t D,
                  const int32_t* keys_at, int64_t n, int64_t heads, float* scores, float* out) {
    attend_group_t(q, keys, values, stride, D, keys_at, n, heads, scores, out);
}

// n floats (n a multiple of 8) to fp16, rounded to nearest even: how keys and values enter an
// fp16 cache.
void to_half(const float* x, int64_t n, uint16_t* y) {
    for (int64_t i = 0; i < n; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
}

}  // namespace SPECSOT_ISA
