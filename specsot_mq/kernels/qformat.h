// The packed weight formats, shared by the kernels (qgemm_body.h) and the binding (qlinear.cpp);
// specsot_mq/quant.py's FORMATS lays the bytes out and carries the same numbers.
#pragma once
#include <cstdint>
#include <type_traits>

// The fewest rows of a product for which its first row tile prefetches the next column group's
// weights (qgemm_body.h's gemm_format); quant.set_prefetch sets it for the loaded model.
inline int prefetch_min_rows = 4;

enum Code { kQ4_0 = 1, kQ4_1 = 2, kQ5_0 = 3, kQ5_1 = 4, kQ8_0 = 5, kQ4_K = 6, kQ5_K = 7, kQ6_K = 8 };

// A format's shape: weight bits, blocks of 32 inputs per record, bytes per group of 16 columns of
// its record header and of a block (the weights' bytes, then the block's scale fields), whether a
// block's two halves have scales of their own (Q6_K's 16-input sub-blocks), whether it has offsets.
template <int C>
struct Fmt {
    static constexpr int bits = C == kQ8_0 ? 8 : (C == kQ5_0 || C == kQ5_1 || C == kQ5_K) ? 5 : C == kQ6_K ? 6 : 4;
    static constexpr bool k_quant = C >= kQ4_K;
    static constexpr int blocks = k_quant ? 8 : 1;
    static constexpr int head = C == kQ6_K ? 32 : k_quant ? 64 : 0;
    static constexpr int weights = bits == 8 ? 512 : bits == 6 ? 384 : bits == 5 ? 320 : 256;
    static constexpr int scales = (C == kQ4_1 || C == kQ5_1) ? 64 : 32;  // two fp16 fields, else one (or two of bytes)
    static constexpr int block = weights + scales;
    static constexpr int record = head + blocks * block;
    static constexpr bool split = C == kQ6_K;
    static constexpr bool offset = C != kQ8_0;
};

// run(Fmt<C>{}, std::integral_constant<int, C>{}) for the format numbered `code`; false for an unknown one.
template <class Run>
bool by_format(int64_t code, Run run) {
    switch (code) {
        case kQ4_0: run(Fmt<kQ4_0>{}, std::integral_constant<int, kQ4_0>{}); return true;
        case kQ4_1: run(Fmt<kQ4_1>{}, std::integral_constant<int, kQ4_1>{}); return true;
        case kQ5_0: run(Fmt<kQ5_0>{}, std::integral_constant<int, kQ5_0>{}); return true;
        case kQ5_1: run(Fmt<kQ5_1>{}, std::integral_constant<int, kQ5_1>{}); return true;
        case kQ8_0: run(Fmt<kQ8_0>{}, std::integral_constant<int, kQ8_0>{}); return true;
        case kQ4_K: run(Fmt<kQ4_K>{}, std::integral_constant<int, kQ4_K>{}); return true;
        case kQ5_K: run(Fmt<kQ5_K>{}, std::integral_constant<int, kQ5_K>{}); return true;
        case kQ6_K: run(Fmt<kQ6_K>{}, std::integral_constant<int, kQ6_K>{}); return true;
        default: return false;
    }
}
