#include "worker_sdk/src/checkpoint/format.h"

#include "worker_sdk/src/reduce.h"

namespace trun::worker {

using namespace ckpt;

size_t LoadedTensor::numel() const {
  size_t n = 1;
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

const LoadedTensor* Checkpoint::find(const std::string& section, const std::string& name) const {
  const auto* list = section == "model" ? &model : section == "optimizer" ? &optimizer : nullptr;
  if (!list) return nullptr;
  for (const auto& t : *list)
    if (t.name == name) return &t;
  return nullptr;
}

void Checkpoint::copy_to(const std::string& section, const std::string& name, void* dst,
                         size_t numel, DataType dtype) const {
  const LoadedTensor* t = find(section, name);
  if (!t)
    throw CheckpointError("checkpoint " + path + " has no " + section + " tensor '" + name + "'");
  if (t->dtype != dtype || t->numel() != numel)
    throw CheckpointError("checkpoint " + path + ": " + section + " tensor '" + name + "' is " +
                          dtype_name(t->dtype) + " x " + std::to_string(t->numel()) +
                          ", the caller expects " + dtype_name(dtype) + " x " +
                          std::to_string(numel));
  if (!t->bytes.empty()) detail::copy_bytes(dst, t->bytes.data(), t->bytes.size());
}

namespace ckpt {

json read_manifest(const std::string& step_dir) {
  const std::string where = "checkpoint " + step_dir;
  auto bad = [&](const std::string& why, int err = 0) {
    return CheckpointError(where + ": " + why, err);
  };

  const std::string mpath = step_dir + "/manifest.json";
  std::string text;
  {
    Fd f(::open(mpath.c_str(), O_RDONLY | O_CLOEXEC));
    if (f.fd < 0) throw bad("cannot open manifest.json: " + errno_text(errno), errno);
    struct stat st {};
    if (::fstat(f.fd, &st) != 0)
      throw bad("cannot stat manifest.json: " + errno_text(errno), errno);
    if (static_cast<size_t>(st.st_size) > kMaxManifestBytes)
      throw bad("manifest.json is implausibly large");
    text.resize(static_cast<size_t>(st.st_size));
    read_all(f.fd, text.data(), text.size(), 0, mpath);
  }
  json body;
  try {
    json m = json::parse(text);
    body = m.at("manifest");
    const uint32_t want = m.at("crc32c").get<uint32_t>();
    const std::string canon = json_text(body);
    const uint32_t got = crc32c(canon.data(), canon.size());
    if (want != got)
      throw bad("manifest CRC32C mismatch (stored " + std::to_string(want) + ", computed " +
                std::to_string(got) + ")");
    if (body.at("format").get<std::string>() != kFormat)
      throw bad("not a trun checkpoint (format '" + body.at("format").get<std::string>() + "')");
    if (body.at("version").get<int>() < 1 || body.at("version").get<int>() > kVersion)
      throw bad("unsupported version " + std::to_string(body.at("version").get<int>()));
  } catch (const json::exception& e) {
    throw bad(std::string("manifest.json is malformed: ") + e.what());
  }
  return body;
}

}  // namespace ckpt

Checkpoint Checkpointer::load(const std::string& step_dir) {
  const std::string where = "checkpoint " + step_dir;
  auto bad = [&](const std::string& why, int err = 0) {
    return CheckpointError(where + ": " + why, err);
  };
  const json body = read_manifest(step_dir);
  Checkpoint ck;
  ck.path = step_dir;
  uint64_t data_size = 0;
  std::string data_file;
  try {
    ck.step = body.at("step").get<uint64_t>();
    ck.world_size = body.at("world_size").get<int>();
    data_size = body.at("data_size").get<uint64_t>();
    data_file = body.at("data_file").get<std::string>();
    ck.metadata = body.at("metadata").dump();
    ck.job_id = body.value("job", "");
    if (!body.at("sampler").is_null())
      ck.sampler = sampler_state_from_json(body.at("sampler").dump());
  } catch (const json::exception& e) {
    throw bad(std::string("manifest.json has a bad field: ") + e.what());
  } catch (const std::invalid_argument& e) {
    throw bad(e.what());
  }
  if (data_file.empty() || data_file.find('/') != std::string::npos || data_file[0] == '.')
    throw bad("bad data file name '" + data_file + "'");
  const std::string dpath = step_dir + "/" + data_file;
  Fd f(::open(dpath.c_str(), O_RDONLY | O_CLOEXEC));
  if (f.fd < 0) throw bad("cannot open " + data_file + ": " + errno_text(errno), errno);
  struct stat st {};
  if (::fstat(f.fd, &st) != 0)
    throw bad("cannot stat " + data_file + ": " + errno_text(errno), errno);
  if (static_cast<uint64_t>(st.st_size) != data_size)
    throw bad(data_file + " has " + std::to_string(st.st_size) + " bytes, the manifest says " +
              std::to_string(data_size));
  try {
    for (const auto& t : body.at("tensors")) {
      LoadedTensor lt;
      const std::string section = t.at("section").get<std::string>();
      lt.name = t.at("name").get<std::string>();
      lt.dtype = parse_dtype(t.at("dtype").get<std::string>());
      lt.shape = t.at("shape").get<std::vector<int64_t>>();
      const uint64_t off = t.at("offset").get<uint64_t>();
      const uint64_t nbytes = t.at("nbytes").get<uint64_t>();
      const uint32_t want = t.at("crc32c").get<uint32_t>();
      const std::string label = section + " tensor '" + lt.name + "'";
      for (int64_t d : lt.shape)
        if (d < 0) throw bad(label + " has a negative dimension");
      if (lt.numel() * dtype_size(lt.dtype) != nbytes)
        throw bad(label + ": shape and dtype do not match its byte count");
      if (off > data_size || nbytes > data_size - off)
        throw bad(label + " lies outside the data file");
      lt.bytes.resize(nbytes);
      if (nbytes > 0) read_all(f.fd, lt.bytes.data(), nbytes, off, dpath);
      const uint32_t got = crc32c(lt.bytes.data(), nbytes);
      if (got != want)
        throw bad(label + ": CRC32C mismatch (manifest " + std::to_string(want) + ", data " +
                  std::to_string(got) + ")");
      if (section == "model")
        ck.model.push_back(std::move(lt));
      else if (section == "optimizer")
        ck.optimizer.push_back(std::move(lt));
      else
        throw bad("unknown section '" + section + "'");
    }
  } catch (const json::exception& e) {
    throw bad(std::string("manifest.json has a bad tensor entry: ") + e.what());
  }
  return ck;
}

}  // namespace trun::worker
