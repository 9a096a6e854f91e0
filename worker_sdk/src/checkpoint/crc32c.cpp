// CRC32C (Castagnoli, reflected polynomial 0x82F63B78), as used by iSCSI, ext4 and LevelDB.
// The SSE4.2 crc32 instruction computes exactly this polynomial; a table is the fallback.

#include <cstring>

#include "trun/checkpoint.h"

namespace trun::worker {

namespace {

struct Table {
  uint32_t t[256];
  Table() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
      t[i] = c;
    }
  }
};

uint32_t crc_table(uint32_t c, const unsigned char* p, size_t n) {
  static const Table table;
  for (size_t i = 0; i < n; ++i) c = table.t[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc_sse42(uint32_t c, const unsigned char* p, size_t n) {
  uint64_t c64 = c;
  // One dependent chain (8 bytes per ~3 cycles, several GB/s): well above what a disk writes,
  // so the 3-stream interleaving with CRC combination is not worth its complexity here.
  while (n >= 32) {
    uint64_t a, b, d, e;
    std::memcpy(&a, p, 8);
    std::memcpy(&b, p + 8, 8);
    std::memcpy(&d, p + 16, 8);
    std::memcpy(&e, p + 24, 8);
    c64 = __builtin_ia32_crc32di(c64, a);
    c64 = __builtin_ia32_crc32di(c64, b);
    c64 = __builtin_ia32_crc32di(c64, d);
    c64 = __builtin_ia32_crc32di(c64, e);
    p += 32;
    n -= 32;
  }
  while (n >= 8) {
    uint64_t a;
    std::memcpy(&a, p, 8);
    c64 = __builtin_ia32_crc32di(c64, a);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c64);
  while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
  return c32;
}

bool have_sse42() {
  static const bool yes = __builtin_cpu_supports("sse4.2");
  return yes;
}
#endif

}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
#if defined(__x86_64__)
  if (have_sse42()) return ~crc_sse42(c, p, n);
#endif
  return ~crc_table(c, p, n);
}

}  // namespace trun::worker
