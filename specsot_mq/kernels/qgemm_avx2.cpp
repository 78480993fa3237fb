#pragma GCC target("avx2,fma,f16c")
#define SPECSOT_VNNI 0
#define SPECSOT_ISA avx2
#include "qgemm_body.h"
