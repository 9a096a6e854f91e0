// The value types of the rendezvous contract (handler.h): RoundEvent's names and description,
// the root cause among failure reports, and ParticipantList.
#include "rendezvous/handler.h"

#include <memory>
#include <stdexcept>
#include <string>

namespace trun::rendezvous {

const char* to_string(RoundEvent::Kind kind) {
  switch (kind) {
    case RoundEvent::Kind::kWorkerFailed:
      return "worker failure";
    case RoundEvent::Kind::kNodeJoined:
      return "node joined";
    case RoundEvent::Kind::kNodeLeft:
      return "node left";
    case RoundEvent::Kind::kRestart:
      return "restart requested";
    case RoundEvent::Kind::kClosed:
      return "rendezvous closed";
    case RoundEvent::Kind::kMembershipLost:
      return "this node was declared dead";
    case RoundEvent::Kind::kStoreLost:
      return "store lost";
    case RoundEvent::Kind::kShutdown:
      return "shut down";
  }
  return "?";
}

std::string RoundEvent::describe() const {
  std::string s = "round " + std::to_string(round) + " over: " + to_string(kind);
  if (!node_id.empty()) s += " (node " + node_id + ")";
  if (!detail.empty()) s += ": " + detail;
  return s;
}

std::optional<FailureReport> root_cause(const std::vector<FailureReport>& reports) {
  const FailureReport* best = nullptr;
  for (const auto& r : reports) {
    if (!best) {
      best = &r;
    } else if (r.failed_at_ms >= 0 &&
               (best->failed_at_ms < 0 || r.failed_at_ms < best->failed_at_ms)) {
      best = &r;
    }
  }
  if (!best) return std::nullopt;
  return *best;
}

ParticipantList::ParticipantList(const std::vector<Participant>& list) {
  auto text = std::make_shared<std::string>();
  for (auto& p : list) {
    starts_.push_back(static_cast<uint32_t>(text->size()));
    *text += p.node_id + " " + p.addr + "\n";
  }
  text_ = std::move(text);
}

ParticipantList::ParticipantList(std::shared_ptr<const std::string> text, size_t begin,
                                 size_t count)
    : text_(std::move(text)) {
  starts_.reserve(count);
  size_t pos = begin;
  const std::string& t = *text_;
  while (pos < t.size() && starts_.size() < count) {
    starts_.push_back(static_cast<uint32_t>(pos));
    size_t nl = t.find('\n', pos);
    if (nl == std::string::npos) {
      pos = t.size();
      break;
    }
    pos = nl + 1;
  }
  if (starts_.size() != count || pos < t.size()) {
    throw RendezvousError("rendezvous: participant list holds " + std::to_string(starts_.size()) +
                          " entries (or more text), expected " + std::to_string(count));
  }
}

std::string_view ParticipantList::line(size_t rank) const {
  if (rank >= starts_.size()) {
    throw std::out_of_range("participant " + std::to_string(rank) + " of " +
                            std::to_string(starts_.size()));
  }
  std::string_view t(*text_);
  size_t b = starts_[rank];
  size_t e = t.find('\n', b);
  return t.substr(b, e == std::string_view::npos ? std::string_view::npos : e - b);
}

std::string_view ParticipantList::field(size_t rank, int f) const {
  std::string_view l = line(rank);
  for (int i = 0; i < f; ++i) {
    size_t sp = l.find(' ');
    if (sp == std::string_view::npos) return {};
    l.remove_prefix(sp + 1);
  }
  return l.substr(0, l.find(' '));
}

Participant ParticipantList::at(size_t rank) const {
  return {std::string(field(rank, 0)), std::string(field(rank, 1))};
}

int ParticipantList::find(std::string_view node_id) const {
  for (size_t i = 0; i < starts_.size(); ++i) {
    if (field(i, 0) == node_id) return static_cast<int>(i);
  }
  return -1;
}

std::vector<Participant> ParticipantList::to_vector() const {
  std::vector<Participant> out;
  for (size_t i = 0; i < size(); ++i) out.push_back(at(i));
  return out;
}

}  // namespace trun::rendezvous
