#pragma once
// The function symbols of an ELF file, for stack dumps (agent/stack_dump.h) of frames that
// libunwind cannot name. libunwind 1.6 (Debian 12) finds no procedure name in executables whose
// code segment's file offset differs from its virtual address, which is how lld, gold and mold
// lay them out (bfd keeps them equal): every frame of such a program read "??". This reads the
// program headers (to turn an offset in the mapped file into a virtual address) and .symtab, or
// .dynsym when the file is stripped (read on the first function_at()). libunwind's search for a
// frame's unwind table goes wrong in those files the same way (the stack ends after their first
// frame): eh_frame_hdr() gives what stack_dump.cpp needs to point libunwind at the right table.
//
// 64-bit little-endian ELF only; anything else, or a file that cannot be read, gives an empty
// table (never throws). A symbol table over 64 MiB is not read (a dump has a time budget).

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace trun::agent {

class ElfSymbols {
 public:
  explicit ElfSymbols(const std::string& path);

  struct Segment {
    uint64_t offset, vaddr, filesz, memsz;
  };
  const std::vector<Segment>& segments() const { return segments_; }  // PT_LOAD, in file order
  // The loadable segment that holds file offset `file_offset`, nullptr when none.
  const Segment* segment_of(uint64_t file_offset) const;

  // .eh_frame_hdr (PT_GNU_EH_FRAME) with its binary search table in the one layout that
  // libunwind reads (version 1, a 4-byte FDE count, datarel sdata4 entries); nullopt otherwise.
  struct EhFrameHdr {
    uint64_t vaddr = 0;        // of the header
    uint64_t table_vaddr = 0;  // of the table
    uint32_t fde_count = 0;
  };
  const std::optional<EhFrameHdr>& eh_frame_hdr() const { return eh_frame_hdr_; }

  // The virtual address (as the symbols count) of offset `file_offset` in the file; nullopt when
  // no loadable segment holds it.
  std::optional<uint64_t> address_of(uint64_t file_offset) const;

  struct Symbol {
    uint64_t start = 0;
    uint64_t size = 0;
    std::string name;  // as in the file (mangled)
  };
  // The function whose range holds `address` (a symbol of size 0 holds only its start); nullptr
  // when none does.
  const Symbol* function_at(uint64_t address);

 private:
  void load_symbols();

  std::string path_;
  bool elf_ = false;
  uint64_t file_size_ = 0;
  uint64_t shoff_ = 0;
  uint16_t shnum_ = 0;
  std::vector<Segment> segments_;
  std::optional<EhFrameHdr> eh_frame_hdr_;
  bool symbols_loaded_ = false;
  std::vector<Symbol> symbols_;  // by start
};

}  // namespace trun::agent
