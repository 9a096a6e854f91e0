#include "launcher/cli_resolve.h"

#include <cctype>
#include <cstdint>
#include <optional>

#include "launcher/cli_values.h"

namespace trun::launcher {
namespace {

const std::string* lookup(const Environment& env, const std::string& name) {
  auto it = env.find(name);
  return it == env.end() ? nullptr : &it->second;
}

// CLI11 2.1's detail::to_flag_value, which throws std::invalid_argument (std::stoll's too) for
// a text that is not a flag value and std::out_of_range for a number beyond 64 bits.
std::int64_t to_flag_value(std::string val) {
  if (val == "true") return 1;
  if (val == "false") return -1;
  for (auto& c : val) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (val.size() == 1) {
    if (val[0] >= '1' && val[0] <= '9') return static_cast<std::int64_t>(val[0]) - '0';
    switch (val[0]) {
      case '0':
      case 'f':
      case 'n':
      case '-':
        return -1;
      case 't':
      case 'y':
      case '+':
        return 1;
      default:
        throw std::invalid_argument("unrecognized character");
    }
  }
  if (val == "true" || val == "on" || val == "yes" || val == "enable") return 1;
  if (val == "false" || val == "off" || val == "no" || val == "disable") return -1;
  return std::stoll(val);
}

}  // namespace

bool ResolvedOptions::given(Opt id) const {
  const Source s = (*this)[id].source;
  return s == Source::kCommandLine || s == Source::kPet;
}

std::string ResolvedOptions::origin(Opt id) const {
  const OptionValue& v = (*this)[id];
  return v.source == Source::kTorchVariable ? v.variable : flag_name(id);
}

std::optional<bool> parse_flag_value(const std::string& text) {
  try {
    return to_flag_value(text) > 0;
  } catch (const std::invalid_argument&) {
    return std::nullopt;
  } catch (const std::out_of_range&) {
    // Still a number, as CLI11 sees it: only its sign counts.
    return text[0] != '-';
  }
}

ResolvedOptions merge_command_line_and_environment(const CommandLineOptions& command_line,
                                                   const Environment& env) {
  ResolvedOptions out;
  for (const OptionDecl& d : option_table()) {
    OptionValue& v = out[d.id];
    v.text = d.kind == OptKind::kFlag ? "false" : d.default_value;
    if (auto it = command_line.find(d.id); it != command_line.end()) {
      v = {it->second, Source::kCommandLine, ""};
      continue;
    }
    const std::string name = env_name(d.id);
    const std::string* value = lookup(env, name);
    if (value == nullptr || value->empty()) continue;  // as CLI11: an empty variable is unset
    v = {*value, Source::kPet, name};
    if (d.kind == OptKind::kFlag) {
      const std::optional<bool> on = parse_flag_value(*value);
      if (!on) {
        throw CliError("Could not convert: " + flag_name(d.id) + " = " + *value +
                       " (see trun --help)");
      }
      v.text = *on ? "true" : "false";
    }
  }
  return out;
}

void apply_fallbacks(ResolvedOptions& options, const Environment& env) {
  // As torchrun 2.x: without the option (or PET_SHUTDOWN_TIMEOUT), its own variable applies.
  const char* kShutdown = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT";
  if (const std::string* v = lookup(env, kShutdown); v && !options.given(Opt::kShutdownTimeout)) {
    options[Opt::kShutdownTimeout] = {trim(*v), Source::kTorchVariable, kShutdown};
  }
  // As torchrun's health-check server: its variable when the option is not given.
  const char* kHealth = "TORCHELASTIC_HEALTH_CHECK_PORT";
  if (const std::string* v = lookup(env, kHealth);
      v && !v->empty() && !options.given(Opt::kMetricsPort)) {
    options[Opt::kMetricsPort] = {trim(*v), Source::kTorchVariable, kHealth};
  }
  // Whenever the template is empty, given so or not.
  const char* kPrefix = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE";
  if (const std::string* v = lookup(env, kPrefix);
      v && options.text(Opt::kLogLinePrefixTemplate).empty()) {
    options[Opt::kLogLinePrefixTemplate] = {*v, Source::kTorchVariable, kPrefix};
  }

  // SLURM's environment fills what neither the command line nor PET_* gave.
  auto value_if = [&](Opt id) {
    return options.given(id) ? std::optional<std::string>(options.text(id)) : std::nullopt;
  };
  GivenOptions given;
  given.standalone = options.given(Opt::kStandalone) && options.flag(Opt::kStandalone);
  given.nnodes = value_if(Opt::kNnodes);
  given.rdzv_backend = value_if(Opt::kRdzvBackend);
  given.rdzv_endpoint = value_if(Opt::kRdzvEndpoint);
  given.rdzv_id = value_if(Opt::kRdzvId);
  given.node_rank = value_if(Opt::kNodeRank);
  given.master_addr = value_if(Opt::kMasterAddr);
  given.master_port = value_if(Opt::kMasterPort);
  given.signals_to_handle = value_if(Opt::kSignalsToHandle);
  try {
    options.slurm = derive_slurm_options(
        [&](const std::string& name) -> std::optional<std::string> {
          const std::string* v = lookup(env, name);
          return v ? std::optional<std::string>(*v) : std::nullopt;
        },
        given);
  } catch (const SlurmOptionError& e) {
    throw CliError(e.what(), e.exit_code());
  }
  for (const SlurmDerived& d : options.slurm.derived) {
    options[d.id] = {d.value, Source::kSlurm, ""};
  }
}

ResolvedOptions resolve_options(const CommandLineOptions& command_line, const Environment& env) {
  ResolvedOptions out = merge_command_line_and_environment(command_line, env);
  apply_fallbacks(out, env);
  return out;
}

std::map<std::string, std::string> environment_read(const Environment& env) {
  std::map<std::string, std::string> out;
  for (const char* name :
       {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE",
        "CUDA_VISIBLE_DEVICES", "PYTHON_EXEC", "TRUN_SLURM"}) {
    if (const std::string* v = lookup(env, name)) out[name] = *v;
  }
  for (const auto& [name, value] : env) {
    if (name.rfind("PET_", 0) == 0) out[name] = value;
  }
  return out;
}

}  // namespace trun::launcher
