#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#define SPECSOT_VNNI 1
#define SPECSOT_ISA vnni
#include "qgemm_body.h"
