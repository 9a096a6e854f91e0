#pragma once
// PrefixStore: a view of another Store in which every key is "<prefix>/<key>", as c10d's
// PrefixStore. Rendezvous rounds, worker groups and process groups each get their own view of
// the one store. num_keys() counts the whole underlying store, as in c10d.
// Thread safety: as the underlying store.

#include <memory>
#include <string>

#include "store/store.h"

namespace trun::store {

class PrefixStore : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> base);

  void set(const std::string& key, std::string_view value) override;
  using Store::get;
  std::string get(const std::string& key, Duration timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  std::string compare_set(const std::string& key, std::string_view expected,
                          std::string_view desired) override;
  bool check(const std::vector<std::string>& keys) override;
  using Store::wait;
  void wait(const std::vector<std::string>& keys, Duration timeout) override;
  int64_t num_keys() override;
  bool delete_key(const std::string& key) override;
  using Store::multi_get;
  std::vector<std::string> multi_get(const std::vector<std::string>& keys,
                                     Duration timeout) override;
  void multi_set(const std::vector<std::string>& keys,
                 const std::vector<std::string>& values) override;
  void append(const std::string& key, std::string_view value) override;
  void queue_push(const std::string& key, std::string_view value) override;
  using Store::queue_pop;
  std::optional<std::string> queue_pop(const std::string& key, bool block,
                                       Duration timeout) override;
  int64_t queue_len(const std::string& key) override;
  std::vector<std::string> list_keys() override;

  const std::string& prefix() const { return prefix_; }
  const std::shared_ptr<Store>& base() const { return base_; }

 private:
  std::string key(const std::string& k) const { return prefix_ + "/" + k; }
  std::vector<std::string> keys(const std::vector<std::string>& ks) const;

  std::string prefix_;
  std::shared_ptr<Store> base_;
};

}  // namespace trun::store
