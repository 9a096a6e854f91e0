#include "store/prefix_store.h"

namespace trun::store {

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> base)
    : prefix_(std::move(prefix)), base_(std::move(base)) {
  timeout_ = base_->timeout();
}

std::vector<std::string> PrefixStore::keys(const std::vector<std::string>& ks) const {
  std::vector<std::string> out;
  out.reserve(ks.size());
  for (auto& k : ks) out.push_back(key(k));
  return out;
}

void PrefixStore::set(const std::string& k, std::string_view value) { base_->set(key(k), value); }
std::string PrefixStore::get(const std::string& k, Duration timeout) {
  return base_->get(key(k), timeout);
}
int64_t PrefixStore::add(const std::string& k, int64_t delta) { return base_->add(key(k), delta); }
std::string PrefixStore::compare_set(const std::string& k, std::string_view expected,
                                     std::string_view desired) {
  return base_->compare_set(key(k), expected, desired);
}
bool PrefixStore::check(const std::vector<std::string>& ks) { return base_->check(keys(ks)); }
void PrefixStore::wait(const std::vector<std::string>& ks, Duration timeout) {
  base_->wait(keys(ks), timeout);
}
int64_t PrefixStore::num_keys() { return base_->num_keys(); }
bool PrefixStore::delete_key(const std::string& k) { return base_->delete_key(key(k)); }
std::vector<std::string> PrefixStore::multi_get(const std::vector<std::string>& ks,
                                                Duration timeout) {
  return base_->multi_get(keys(ks), timeout);
}
void PrefixStore::multi_set(const std::vector<std::string>& ks,
                            const std::vector<std::string>& values) {
  base_->multi_set(keys(ks), values);
}
void PrefixStore::append(const std::string& k, std::string_view value) {
  base_->append(key(k), value);
}
void PrefixStore::queue_push(const std::string& k, std::string_view value) {
  base_->queue_push(key(k), value);
}
std::optional<std::string> PrefixStore::queue_pop(const std::string& k, bool block,
                                                  Duration timeout) {
  return base_->queue_pop(key(k), block, timeout);
}
int64_t PrefixStore::queue_len(const std::string& k) { return base_->queue_len(key(k)); }
std::vector<std::string> PrefixStore::list_keys() {
  const std::string mine = prefix_ + "/";
  std::vector<std::string> out;
  for (auto& k : base_->list_keys())
    if (k.compare(0, mine.size(), mine) == 0) out.push_back(k.substr(mine.size()));
  return out;
}

}  // namespace trun::store
