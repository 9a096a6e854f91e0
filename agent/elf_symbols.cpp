#include "agent/elf_symbols.h"

#include <elf.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

namespace trun::agent {
namespace {

constexpr uint64_t kMaxTableBytes = 64ull << 20;

// Reads exactly `n` bytes at `offset`; false on a short read or an error.
bool read_at(int fd, uint64_t offset, void* out, size_t n) {
  auto* p = static_cast<char*>(out);
  while (n > 0) {
    const ssize_t got = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (got <= 0) return false;
    p += got;
    offset += static_cast<uint64_t>(got);
    n -= static_cast<size_t>(got);
  }
  return true;
}

class Fd {
 public:
  explicit Fd(const std::string& path) : fd_(::open(path.c_str(), O_RDONLY | O_CLOEXEC)) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

}  // namespace

ElfSymbols::ElfSymbols(const std::string& path) : path_(path) {
  Fd fd(path);
  struct stat st {};
  if (fd.get() < 0 || ::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) return;
  file_size_ = static_cast<uint64_t>(st.st_size);
  Elf64_Ehdr eh;
  if (!read_at(fd.get(), 0, &eh, sizeof eh) || std::memcmp(eh.e_ident, ELFMAG, SELFMAG) != 0 ||
      eh.e_ident[EI_CLASS] != ELFCLASS64 || eh.e_ident[EI_DATA] != ELFDATA2LSB) {
    return;
  }
  elf_ = true;
  if (eh.e_shentsize == sizeof(Elf64_Shdr) && eh.e_shnum > 0 && eh.e_shnum < 65280) {
    shoff_ = eh.e_shoff;
    shnum_ = eh.e_shnum;
  }
  if (eh.e_phentsize != sizeof(Elf64_Phdr) || eh.e_phnum == 0 || eh.e_phnum >= 4096) return;
  std::vector<Elf64_Phdr> ph(eh.e_phnum);
  if (!read_at(fd.get(), eh.e_phoff, ph.data(), ph.size() * sizeof(Elf64_Phdr))) return;
  const Elf64_Phdr* eh_frame = nullptr;
  for (const Elf64_Phdr& p : ph) {
    if (p.p_type == PT_LOAD) segments_.push_back({p.p_offset, p.p_vaddr, p.p_filesz, p.p_memsz});
    if (p.p_type == PT_GNU_EH_FRAME) eh_frame = &p;
  }
  // version, eh_frame_ptr's encoding, fde_count's, the table's; eh_frame_ptr; fde_count.
  unsigned char hdr[12];
  if (eh_frame && eh_frame->p_filesz >= sizeof hdr &&
      read_at(fd.get(), eh_frame->p_offset, hdr, sizeof hdr) && hdr[0] == 1 &&
      (hdr[1] & 0x0f) == 0x0b /* sdata4 */ && hdr[2] == 0x03 /* udata4 */ &&
      hdr[3] == 0x3b /* datarel | sdata4 */) {
    uint32_t count = 0;
    std::memcpy(&count, hdr + 8, sizeof count);
    if (static_cast<uint64_t>(count) * 8 <= eh_frame->p_filesz - sizeof hdr)
      eh_frame_hdr_ = EhFrameHdr{eh_frame->p_vaddr, eh_frame->p_vaddr + sizeof hdr, count};
  }
}

void ElfSymbols::load_symbols() {
  symbols_loaded_ = true;
  if (!elf_ || shnum_ == 0) return;
  Fd fd(path_);
  if (fd.get() < 0) return;
  std::vector<Elf64_Shdr> sh(shnum_);
  if (!read_at(fd.get(), shoff_, sh.data(), sh.size() * sizeof(Elf64_Shdr))) return;
  const Elf64_Shdr* table = nullptr;
  for (uint32_t type : {SHT_SYMTAB, SHT_DYNSYM}) {
    for (const Elf64_Shdr& s : sh) {
      if (s.sh_type == type) {
        table = &s;
        break;
      }
    }
    if (table) break;
  }
  if (!table || table->sh_entsize != sizeof(Elf64_Sym) || table->sh_link >= sh.size()) return;
  const Elf64_Shdr& strings = sh[table->sh_link];
  if (table->sh_size > kMaxTableBytes || strings.sh_size > kMaxTableBytes ||
      table->sh_offset + table->sh_size > file_size_ ||
      strings.sh_offset + strings.sh_size > file_size_) {
    return;
  }
  std::vector<Elf64_Sym> syms(table->sh_size / sizeof(Elf64_Sym));
  std::string names(strings.sh_size, '\0');
  if (!read_at(fd.get(), table->sh_offset, syms.data(), syms.size() * sizeof(Elf64_Sym)) ||
      !read_at(fd.get(), strings.sh_offset, names.data(), names.size())) {
    return;
  }
  for (const Elf64_Sym& s : syms) {
    const unsigned type = ELF64_ST_TYPE(s.st_info);
    if ((type != STT_FUNC && type != STT_GNU_IFUNC) || s.st_shndx == SHN_UNDEF || s.st_value == 0 ||
        s.st_name >= names.size()) {
      continue;
    }
    const char* name = names.data() + s.st_name;
    symbols_.push_back(
        {s.st_value, s.st_size, std::string(name, strnlen(name, names.size() - s.st_name))});
  }
  std::sort(symbols_.begin(), symbols_.end(),
            [](const Symbol& a, const Symbol& b) { return a.start < b.start; });
}

const ElfSymbols::Segment* ElfSymbols::segment_of(uint64_t file_offset) const {
  for (const Segment& s : segments_) {
    if (file_offset >= s.offset && file_offset - s.offset < s.filesz) return &s;
  }
  return nullptr;
}

std::optional<uint64_t> ElfSymbols::address_of(uint64_t file_offset) const {
  const Segment* s = segment_of(file_offset);
  if (s == nullptr) return std::nullopt;
  return file_offset - s->offset + s->vaddr;
}

const ElfSymbols::Symbol* ElfSymbols::function_at(uint64_t address) {
  if (!symbols_loaded_) load_symbols();
  auto it = std::upper_bound(symbols_.begin(), symbols_.end(), address,
                             [](uint64_t a, const Symbol& s) { return a < s.start; });
  if (it == symbols_.begin()) return nullptr;
  // The symbols of the nearest start at or below `address` (aliases share a start).
  const uint64_t start = std::prev(it)->start;
  for (auto j = std::prev(it); j->start == start; --j) {
    if (address - start < std::max<uint64_t>(j->size, 1)) return &*j;
    if (j == symbols_.begin()) break;
  }
  return nullptr;
}

}  // namespace trun::agent
