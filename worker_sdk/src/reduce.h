#pragma once
// Element-wise reduction kernels shared by the CPU backends (shared memory and Gloo).

#include <cstddef>
#include <cstdint>

#include "trun/process_group.h"

namespace trun::worker::detail {

// dst[i] = a[i] op b[i] for i < n. dst may alias a or b. Any op but kAvg, which is treated as
// kSum (the callers scale at the end); std::invalid_argument for an op the dtype does not
// support (reduce_op_supports). float16/bfloat16 go through float; kBool reads nonzero as true.
void reduce3(void* dst, const void* a, const void* b, size_t n, DataType dtype, ReduceOp op);

// dst[i] = srcs[0][i] op srcs[1][i] op ... op srcs[nsrc-1][i], in that order, written to each
// of the `ndst` destinations. One pass over the sources in L1-sized blocks: reducing n inputs
// costs reading them once and writing each destination once (reduce3 in a loop would read and
// write the accumulator n-1 times). dsts[0] may be a source (the same address); the other
// destinations must not overlap any source. nsrc >= 1.
void reduce_n(void* const* dsts, int ndst, const void* const* srcs, int nsrc, size_t n,
              DataType dtype, ReduceOp op);

// memcpy for the collectives' bulk data (non-overlapping). glibc's memcpy copies mid-sized
// blocks (about 2 KiB to 512 KiB on x86) with `rep movsb`, which perf showed running about 3x
// slower than a vector loop when ranks copy slices in and out of shared memory (64 MiB
// allreduce, 4 ranks: 70% of all cycles). This one always uses the vector loop.
void copy_bytes(void* dst, const void* src, size_t n);

// copy_bytes with non-temporal stores (AVX2; else copy_bytes): the destination is written
// without first reading each of its cache lines, and is not left in the cache. Where a copy is
// limited by memory bandwidth that is a third less traffic: 1.3-1.9x the bandwidth of the
// plain vector copy here (two ranks copying 32 MiB each at once: about 1.8x). For data that is
// not read again soon, in copies that move at least kStreamMinBytes in all (all_to_all blocks,
// point-to-point messages; the pieces of a staged copy may be smaller). Pieces under 4 KiB go
// through copy_bytes.
constexpr size_t kStreamMinBytes = 1u << 20;
void stream_bytes(void* dst, const void* src, size_t n);

// stream_bytes where `stream` (the whole copy it is a piece of moves kStreamMinBytes or more),
// else copy_bytes.
inline void copy_or_stream(bool stream, void* dst, const void* src, size_t n) {
  if (stream)
    stream_bytes(dst, src, n);
  else
    copy_bytes(dst, src, n);
}

// data[i] /= divisor (integers: truncated toward zero). For kAvg; kBool is refused.
void divide(void* data, size_t n, DataType dtype, int divisor);

float half_to_float(uint16_t h);
uint16_t float_to_half(float f);  // round to nearest even
float bfloat16_to_float(uint16_t b);
uint16_t float_to_bfloat16(float f);  // round to nearest even

}  // namespace trun::worker::detail
