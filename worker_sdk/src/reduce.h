#pragma once
// Element-wise reduction kernels shared by the CPU backends (shared memory and Gloo).

#include <cstddef>
#include <cstdint>

#include "trun/process_group.h"

namespace trun::worker::detail {

// dst[i] = a[i] op b[i] for i < n. dst may alias a or b. `op` is kSum, kMin or kMax (kAvg is
// summed by the callers and scaled at the end). float16/bfloat16 go through float.
void reduce3(void* dst, const void* a, const void* b, size_t n, DataType dtype, ReduceOp op);

// data[i] /= divisor (integers: truncated toward zero). For kAvg.
void divide(void* data, size_t n, DataType dtype, int divisor);

float half_to_float(uint16_t h);
uint16_t float_to_half(float f);  // round to nearest even
float bfloat16_to_float(uint16_t b);
uint16_t float_to_bfloat16(float f);  // round to nearest even

}  // namespace trun::worker::detail
