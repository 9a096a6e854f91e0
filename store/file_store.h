#pragma once
// FileStore: a Store in one file that every rank can open (a local or shared file system), in
// PyTorch's c10d::FileStore format, so that a libtrun_worker program and a PyTorch program
// (torch.distributed.FileStore, init_method="file://...") can share one file at the same time.
//
// Format (PyTorch's): the file is a log of records, appended and never rewritten. A record is a
// key and a value, each a 32-bit length in the machine's byte order followed by that many bytes.
// A user key K is stored as "/K"; deleting K appends the record ("-/K", ""); add() appends the
// new decimal value. Readers replay the records they have not seen yet. Every write holds an
// exclusive flock(2) on the file, every read a shared one; each operation opens the file anew,
// as PyTorch does (so a file removed and created again is seen).
//
// Cleanup (PyTorch's): the destructor adds 1 to the counter "cleanup/" (outside the user's key
// space); the store whose add makes it reach `num_workers` removes the file. num_workers < 0:
// never removed.
//
// Blocking: get, wait and multi_get poll every 10 ms (no inotify: it does not work on network
// file systems), bounded by their timeout (StoreTimeoutError). Reads of a file that does not
// exist yet wait for it within the call's timeout (get) or report the keys missing (check); every
// other call creates it. Other errors (permissions, a corrupt record) raise StoreError naming the
// path and the operation. No queues (StoreError, as for a PyTorch 1.13 server).
//
// Thread safety: calls on one FileStore are serialized by a mutex; any number of FileStores, in
// any processes, may use one file.

#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "store/store.h"

namespace trun::store {

class FileStore : public Store {
 public:
  // Does not touch the file (PyTorch's constructor does not either).
  FileStore(std::string path, int num_workers);
  ~FileStore() override;  // cleanup, see above; errors are ignored
  FileStore(const FileStore&) = delete;
  FileStore& operator=(const FileStore&) = delete;

  void set(const std::string& key, std::string_view value) override;
  using Store::get;
  std::string get(const std::string& key, Duration timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  std::string compare_set(const std::string& key, std::string_view expected,
                          std::string_view desired) override;
  bool check(const std::vector<std::string>& keys) override;
  using Store::wait;
  void wait(const std::vector<std::string>& keys, Duration timeout) override;
  // Counts "cleanup/" too once a store has been destroyed, as c10d's FileStore does.
  int64_t num_keys() override;
  bool delete_key(const std::string& key) override;
  using Store::multi_get;
  std::vector<std::string> multi_get(const std::vector<std::string>& keys,
                                     Duration timeout) override;
  // One write under one lock: other readers see all of the keys or none.
  void multi_set(const std::vector<std::string>& keys,
                 const std::vector<std::string>& values) override;
  void append(const std::string& key, std::string_view value) override;
  std::vector<std::string> list_keys() override;

  const std::string& path() const { return path_; }

 private:
  class Open;  // an open descriptor with its flock (file_store.cpp)
  // Reads the records appended since the last call into cache_. Under mu_ and a file lock.
  void refresh_locked(int fd, const char* op);
  void append_records_locked(int fd, const std::vector<std::pair<std::string, std::string>>& recs,
                             const char* op);
  int64_t add_raw_locked(const std::string& raw_key, int64_t delta, const char* op);
  // True when every key is in the file now (false when there is no file yet).
  bool check_locked(const std::vector<std::string>& keys, const char* op);
  [[noreturn]] void fail(const char* op, const std::string& what) const;

  std::string path_;
  int num_workers_;
  std::mutex mu_;
  std::unordered_map<std::string, std::string> cache_;  // raw key ("/K") -> value; under mu_
  int64_t pos_ = 0;                                     // bytes of the file replayed; under mu_
};

}  // namespace trun::store
