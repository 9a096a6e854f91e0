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
// destinations must not overlap any source. nsrc >= 1. stream_copies: the destinations after
// the first are written with non-temporal stores (stream_bytes; for a destination another
// process reads next, in a copy of kStreamMinBytes or more).
void reduce_n(void* const* dsts, int ndst, const void* const* srcs, int nsrc, size_t n,
              DataType dtype, ReduceOp op, bool stream_copies = false);

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

// One element, in software. Round to nearest even; the bits are those of x86's F16C
// (VCVTPS2PH with imm 0, VCVTPH2PS) for every input: a NaN stays a NaN of the same sign, made
// quiet, its payload's top bits kept (float16: the top 10 of the float's 23 mantissa bits;
// bfloat16: the top 7). A float beyond the 16-bit range (after rounding) becomes infinity. The
// software never depends on the FPU's rounding mode or on FTZ/DAZ.
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
float bfloat16_to_float(uint16_t b);  // exact (a bfloat16 is a float's top half)
uint16_t float_to_bfloat16(float f);

// The instruction sets the bulk conversions and the float16/bfloat16 reductions can use. Every
// path gives the same bits as the scalar functions above (tests/worker_sdk/reduce_test.cpp
// checks them against each other). kAvx2 needs AVX2 and F16C, kAvx512 AVX-512F and F16C.
enum class Simd { kScalar, kAvx2, kAvx512 };
// The widest this CPU runs (cpuid, once).
Simd best_simd();

// dst[i] = (16-bit of src[i]) / divisor, rounded to the 16-bit type `wire` (kFloat16 or
// kBFloat16) twice, after the cast and after the division, as PyTorch's
// `tensor.to(torch.float16).div_(divisor)` does; divisor 1 rounds once. `simd`: the path to use
// (tests pick one; a path this CPU lacks falls back to the best it has).
void float_to_16bit(uint16_t* dst, const float* src, size_t n, DataType wire, int divisor = 1,
                    Simd simd = best_simd());
// dst[i] = float of src[i] (exact).
void float_from_16bit(float* dst, const uint16_t* src, size_t n, DataType wire,
                      Simd simd = best_simd());
// reduce3 for kFloat16/kBFloat16 on a given path (reduce3 uses best_simd()).
void reduce3_16bit(uint16_t* dst, const uint16_t* a, const uint16_t* b, size_t n, DataType dtype,
                   ReduceOp op, Simd simd);
// divide for kFloat16/kBFloat16 on a given path (divide uses best_simd()).
void divide_16bit(uint16_t* data, size_t n, DataType dtype, int divisor, Simd simd);

}  // namespace trun::worker::detail
