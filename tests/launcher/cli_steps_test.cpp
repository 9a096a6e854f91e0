// The command line's pure steps without CLI11 and without the process environment: the argparse
// pre-pass (launcher/argparse_compat.h), the option table (launcher/cli_options.h), resolution
// (launcher/cli_resolve.h) and the checks that build the LaunchConfig (launcher/cli_config.h)
// against a fake host. The black-box cases through the binary: cli_test.cpp.
#include <catch2/catch.hpp>
#include <cerrno>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "launcher/argparse_compat.h"
#include "launcher/cli_config.h"
#include "launcher/cli_options.h"
#include "launcher/cli_resolve.h"
#include "launcher/cli_values.h"
#include "tests/launcher/slurm_step_env.h"

using namespace trun::launcher;

namespace {

// The shapes trun's CLI11 declaration hands the pre-pass: --help and --version, then the table.
std::vector<ArgOption> trun_shapes() {
  std::vector<ArgOption> out{{{"help"}, 'h', false}, {{"version"}, '\0', false}};
  for (const OptionDecl& d : option_table()) {
    out.push_back({long_names(d.id), d.short_name, d.kind == OptKind::kValue});
  }
  return out;
}

struct Normalized {
  std::optional<std::string> error;
  std::vector<std::string> args;
};

Normalized normalize(std::vector<std::string> args) {
  auto error = normalize_arguments(trun_shapes(), args);
  return {error, args};
}

using Args = std::vector<std::string>;

// A host with `gpus` CUDA devices, 8 CPUs, no XPU and the files in `files`.
class FakeHost : public HostProbe {
 public:
  int cpus() const override { return 8; }
  int cuda_devices(const std::optional<std::string>& cvd) const override {
    cuda_visible_devices_seen = cvd;
    return gpus;
  }
  int xpu_devices(const std::optional<std::string>&) const override { return 0; }
  trun::agent::CpuTopology cpu_topology(const std::optional<std::string>&) const override {
    throw std::runtime_error("no topology in this test");
  }
  FileFacts file(const std::string& path) const override {
    auto it = files.find(path);
    if (it == files.end()) return FileFacts{ENOENT, false, false, false};
    return it->second;
  }

  int gpus = 0;
  std::map<std::string, FileFacts> files;
  mutable std::optional<std::string> cuda_visible_devices_seen;
};

const FileFacts kScript{0, false, true, false};
const FileFacts kProgram{0, false, true, true};

// The LaunchConfig of `command_line` and `rest` under `env` on `host`.
BuiltConfig build(const CommandLineOptions& command_line, const Args& rest,
                  const Environment& env = {}, const FakeHost& host = FakeHost()) {
  return build_launch_config(resolve_options(command_line, env), rest, env, host);
}

// The CliError message that building leads to.
std::string build_error(const CommandLineOptions& command_line, const Args& rest,
                        const Environment& env = {}, const FakeHost& host = FakeHost()) {
  try {
    build(command_line, rest, env, host);
  } catch (const CliError& e) {
    CHECK(e.exit_code() == 2);
    return e.what();
  }
  FAIL("no error");
  return "";
}

FakeHost host_with_train_py() {
  FakeHost host;
  host.files["train.py"] = kScript;
  return host;
}

}  // namespace

TEST_CASE("the pre-pass expands a unique prefix and picks the spelling the prefix uses",
          "[cli_steps]") {
  CHECK(normalize({"--nproc_per=2", "x.py"}).args == Args{"--nproc_per_node", "2", "x.py"});
  CHECK(normalize({"--nproc-per", "2", "x.py"}).args == Args{"--nproc-per-node", "2", "x.py"});
  CHECK(normalize({"--nnode=1", "--stand", "x.py"}).args ==
        Args{"--nnodes", "1", "--standalone", "x.py"});
}

TEST_CASE("the pre-pass names every candidate of an ambiguous prefix", "[cli_steps]") {
  CHECK(normalize({"--no", "x.py"}).error ==
        "ambiguous option: --no could match --no-python, --no_python, --node-rank, --node_rank");
}

TEST_CASE("the pre-pass keeps empty values and refuses an empty value of a flag", "[cli_steps]") {
  CHECK(normalize({"--log-dir=", "--nproc-per-node=2", "x"}).args ==
        Args{"--log-dir", "", "--nproc-per-node", "2", "x"});
  CHECK(normalize({"-r=", "x"}).args == Args{"-r", "", "x"});
  CHECK(normalize({"-r=3", "-t1", "x"}).args == Args{"-r", "3", "-t", "1", "x"});
  CHECK(normalize({"--standalone=", "x"}).error ==
        "--standalone=: an empty value; --standalone is a flag (give it alone)");
}

TEST_CASE("the pre-pass wants a value argparse would take after an option", "[cli_steps]") {
  CHECK(normalize({"--log-dir", "--tee", "3", "x"}).error ==
        "--log-dir: expected a value, got the option '--tee' (write --log-dir=--tee for a value "
        "that starts with '-')");
  CHECK(normalize({"--log-dir"}).error == "--log-dir: expected a value");
  CHECK(normalize({"--max-restarts", "-1", "x"}).args == Args{"--max-restarts", "-1", "x"});
  CHECK(argparse_value("-1.5"));
  CHECK(argparse_value("-.5"));
  CHECK(argparse_value("-"));
  CHECK(argparse_value("-a b"));
  CHECK_FALSE(argparse_value("-x"));
  CHECK_FALSE(argparse_value("-1."));
}

TEST_CASE("the pre-pass leaves the script, its arguments and unknown options alone",
          "[cli_steps]") {
  CHECK(normalize({"--stand", "x.py", "--nnode=3", "-r"}).args ==
        Args{"--standalone", "x.py", "--nnode=3", "-r"});
  CHECK(normalize({"--bogus=1", "--stand"}).args == Args{"--bogus=1", "--stand"});
  CHECK(normalize({"-mx", "y"}).args == Args{"-mx", "y"});
  CHECK(normalize({"--", "--stand"}).args == Args{"--", "--stand"});
}

TEST_CASE("the option table is in Opt order with both spellings and PET names", "[cli_steps]") {
  REQUIRE(option_table().size() == kOptCount);
  for (size_t i = 0; i < kOptCount; ++i) CHECK(option_table()[i].id == static_cast<Opt>(i));
  CHECK(long_names(Opt::kNprocPerNode) == Args{"nproc-per-node", "nproc_per_node"});
  CHECK(long_names(Opt::kNnodes) == Args{"nnodes"});
  CHECK(env_name(Opt::kNprocPerNode) == "PET_NPROC_PER_NODE");
  CHECK(env_name(Opt::kLegacyLaunch) == "PET_LEGACY_LAUNCH");
  CHECK(flag_name(Opt::kRdzvEndpoint) == "--rdzv-endpoint");
}

TEST_CASE("the command line wins over PET_*, which wins over the default", "[cli_steps]") {
  const Environment env{{"PET_NPROC_PER_NODE", "3"}, {"PET_ROLE", "trainer"}, {"PET_TEE", ""}};
  const ResolvedOptions o = resolve_options({{Opt::kNprocPerNode, "2"}}, env);
  CHECK(o.text(Opt::kNprocPerNode) == "2");
  CHECK(o[Opt::kNprocPerNode].source == Source::kCommandLine);
  CHECK(o.text(Opt::kRole) == "trainer");
  CHECK(o[Opt::kRole].source == Source::kPet);
  CHECK(o[Opt::kRole].variable == "PET_ROLE");
  CHECK(o.given(Opt::kRole));
  // An empty variable counts as unset, as it did when CLI11 read them.
  CHECK(o.text(Opt::kTee) == "0");
  CHECK_FALSE(o.given(Opt::kTee));
  CHECK(o.text(Opt::kRdzvBackend) == "static");
  CHECK(o[Opt::kRdzvBackend].source == Source::kDefault);
}

TEST_CASE("a flag from PET_* reads as CLI11 reads flag values", "[cli_steps]") {
  auto standalone = [](const std::string& value) {
    return resolve_options({}, {{"PET_STANDALONE", value}}).flag(Opt::kStandalone);
  };
  CHECK(standalone("1"));
  CHECK(standalone("yes"));
  CHECK(standalone("12abc"));  // std::stoll's prefix, as CLI11
  CHECK(standalone("99999999999999999999999"));
  CHECK_FALSE(standalone("off"));
  CHECK_FALSE(standalone("-"));
  CHECK_FALSE(standalone("-99999999999999999999999"));
  CHECK_FALSE(resolve_options({}, {}).flag(Opt::kStandalone));
  try {
    resolve_options({}, {{"PET_MODULE", "maybe"}});
    FAIL("no error");
  } catch (const CliError& e) {
    CHECK(std::string(e.what()) == "Could not convert: --module = maybe (see trun --help)");
    CHECK(e.exit_code() == 2);
  }
  // Given on the command line, the variable is not read at all.
  CHECK(resolve_options({{Opt::kModule, "false"}}, {{"PET_MODULE", "maybe"}}).given(Opt::kModule));
}

TEST_CASE("torchrun's own variables fill in after the option and PET_*", "[cli_steps]") {
  const Environment env{{"TORCH_ELASTIC_SHUTDOWN_TIMEOUT", " 7 "},
                        {"TORCHELASTIC_HEALTH_CHECK_PORT", ""},
                        {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[${rank}]"}};
  const ResolvedOptions o = resolve_options({}, env);
  CHECK(o.text(Opt::kShutdownTimeout) == "7");
  CHECK(o.origin(Opt::kShutdownTimeout) == "TORCH_ELASTIC_SHUTDOWN_TIMEOUT");
  CHECK(o.text(Opt::kMetricsPort).empty());  // an empty variable: none
  CHECK(o.text(Opt::kLogLinePrefixTemplate) == "[${rank}]");

  Environment pet = env;
  pet["PET_SHUTDOWN_TIMEOUT"] = "5";
  const ResolvedOptions p = resolve_options({{Opt::kLogLinePrefixTemplate, "x"}}, pet);
  CHECK(p.text(Opt::kShutdownTimeout) == "5");
  CHECK(p.origin(Opt::kShutdownTimeout) == "--shutdown-timeout");
  CHECK(p.text(Opt::kLogLinePrefixTemplate) == "x");
  // The template's variable applies whenever the template is empty, given or not.
  CHECK(
      resolve_options({{Opt::kLogLinePrefixTemplate, ""}}, env).text(Opt::kLogLinePrefixTemplate) ==
      "[${rank}]");
}

TEST_CASE("an srun step fills what neither the command line nor PET_* gave", "[cli_steps]") {
  Environment env;
  for (const auto& [k, v] : trun::testing::slurm_step_env(1)) env[k] = v;
  env["PET_RDZV_ID"] = "abc";
  const ResolvedOptions o = resolve_options({{Opt::kSignalsToHandle, "SIGTERM"}}, env);
  CHECK(o.text(Opt::kRdzvBackend) == "c10d");
  CHECK(o[Opt::kRdzvBackend].source == Source::kSlurm);
  CHECK(o.text(Opt::kNnodes) == "2");
  CHECK(o.text(Opt::kRdzvEndpoint).rfind("n1:", 0) == 0);
  CHECK(o.text(Opt::kRdzvId) == "abc");
  CHECK(o.text(Opt::kSignalsToHandle) == "SIGTERM");
  // Each derived option by identity, named as the table names it.
  std::set<Opt> derived;
  for (const SlurmDerived& d : o.slurm.derived) {
    derived.insert(d.id);
    CHECK(d.option == flag_name(d.id));
    CHECK(o.text(d.id) == d.value);
  }
  CHECK(derived == std::set<Opt>{Opt::kRdzvBackend, Opt::kNnodes, Opt::kRdzvEndpoint});
}

TEST_CASE("what SLURM's environment makes invalid is a CliError with its exit code",
          "[cli_steps]") {
  Environment env;
  for (const auto& [k, v] : trun::testing::slurm_step_env(1)) env[k] = v;
  try {
    resolve_options({{Opt::kNnodes, "3"}}, env);
    FAIL("no error");
  } catch (const CliError& e) {
    CHECK(std::string(e.what()).rfind("--nnodes=3 contradicts SLURM_STEP_NUM_NODES=2", 0) == 0);
    CHECK(e.exit_code() == 2);
  }
}

TEST_CASE("the environment read is every PET_* and the variables the configuration reads",
          "[cli_steps]") {
  const Environment env{{"PET_X", "1"},        {"PYTHON_EXEC", "py"}, {"HOME", "/root"},
                        {"SLURM_JOB_ID", "3"}, {"TRUN_SLURM", "0"},   {"PETX", "2"}};
  CHECK(environment_read(env) == std::map<std::string, std::string>{
                                     {"PET_X", "1"}, {"PYTHON_EXEC", "py"}, {"TRUN_SLURM", "0"}});
}

TEST_CASE("a .py script runs under python3, or PYTHON_EXEC, with its arguments", "[cli_steps]") {
  const FakeHost host = host_with_train_py();
  BuiltConfig b = build({}, {"--", "train.py", "--lr", "1"}, {}, host);
  CHECK(b.config.entrypoint == Args{"python3", "-u", "train.py", "--lr", "1"});
  CHECK(b.config.entrypoint_name == "train.py");
  b = build({{Opt::kLegacyLaunch, "dash"}}, {"train.py", "a"}, {{"PYTHON_EXEC", "/py"}}, host);
  CHECK(b.config.entrypoint == Args{"/py", "-u", "train.py", "--local-rank=${local_rank}", "a"});
  CHECK(b.notes.empty());
}

TEST_CASE("a program is looked up in PATH as execvp would", "[cli_steps]") {
  FakeHost host;
  host.files["/b/prog"] = kProgram;
  host.files["/a/prog"] = kScript;  // not executable: skipped
  CHECK(build({}, {"prog"}, {{"PATH", "/a:/b"}}, host).config.entrypoint == Args{"prog"});
  CHECK(build_error({}, {"prog"}, {{"PATH", "/a"}}, host) ==
        "training program prog not found in PATH");
  host.files["./dir"] = FileFacts{0, true, false, true};
  CHECK(build_error({}, {"./dir"}, {}, host) == "training script ./dir is a directory");
  CHECK(build_error({}, {"x.py"}, {}, host) ==
        "training script x.py not found: No such file or directory");
}

TEST_CASE("the device counts come from the host, narrowed by CUDA_VISIBLE_DEVICES", "[cli_steps]") {
  FakeHost host = host_with_train_py();
  host.gpus = 2;
  const BuiltConfig b =
      build({{Opt::kNprocPerNode, "gpu"}}, {"train.py"}, {{"CUDA_VISIBLE_DEVICES", "1,3"}}, host);
  CHECK(b.config.nproc_per_node == 2);
  CHECK(host.cuda_visible_devices_seen == "1,3");
  CHECK(build({{Opt::kNprocPerNode, "cpu"}}, {"train.py"}, {}, host).config.nproc_per_node == 8);
  host.gpus = 0;
  CHECK(build({{Opt::kNprocPerNode, "auto"}}, {"train.py"}, {}, host).config.nproc_per_node == 8);
  CHECK(build_error({{Opt::kNprocPerNode, "xpu"}}, {"train.py"}, {}, host)
            .rfind("--nproc-per-node=xpu: no Intel XPU device is visible", 0) == 0);
  CHECK(build_error({{Opt::kNprocPerNode, "2"}, {Opt::kVirtualLocalRank, "true"}}, {"train.py"},
                    {{"CUDA_VISIBLE_DEVICES", "5"}}, host) ==
        "--virtual-local-rank: 2 workers per node, but CUDA_VISIBLE_DEVICES=5 lists 1 device(s), "
        "one per worker is needed");
}

TEST_CASE("the first invalid group is the one reported", "[cli_steps]") {
  const FakeHost host = host_with_train_py();
  CHECK(build_error({{Opt::kTee, "9"}, {Opt::kNnodes, "0"}}, {"train.py"}, {}, host) ==
        "--nnodes=0: expected a node count N or a range MIN:MAX with 1 <= MIN <= MAX");
  CHECK(build_error({{Opt::kTee, "9"}, {Opt::kNnodes, "0"}}, {}, {}, host) ==
        "missing TRAINING_SCRIPT: usage: trun [options] TRAINING_SCRIPT [args...]");
  CHECK(build_error({{Opt::kTee, "9"}}, {"-x"}, {}, host) == "unknown option -x (see trun --help)");
  CHECK(build_error({{Opt::kTee, "9"}, {Opt::kShutdownTimeout, "-1"}}, {"train.py"}, {}, host) ==
        "--shutdown-timeout=-1: expected a non-negative number of seconds");
}

TEST_CASE("a value from torchrun's variable is named by the variable in errors", "[cli_steps]") {
  const FakeHost host = host_with_train_py();
  CHECK(build_error({}, {"train.py"}, {{"TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "x"}}, host) ==
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=x: expected a non-negative number of seconds");
  CHECK(build_error({}, {"train.py"}, {{"TORCHELASTIC_HEALTH_CHECK_PORT", " 70000"}}, host) ==
        "TORCHELASTIC_HEALTH_CHECK_PORT=70000: expected a port number 0..65535 (0: a free port)");
  CHECK(build({}, {"train.py"}, {{"TORCHELASTIC_HEALTH_CHECK_PORT", "+90"}}, host)
            .config.metrics_port == 90);
}

TEST_CASE("the rendezvous checks follow the backend", "[cli_steps]") {
  const FakeHost host = host_with_train_py();
  const BuiltConfig b = build({{Opt::kRdzvEndpoint, "[::1]:5"}}, {"train.py"}, {}, host);
  CHECK(b.config.rdzv.master_addr == "::1");
  CHECK(b.config.rdzv.master_port == 5);
  CHECK(build_error({{Opt::kRdzvBackend, "c10d"}, {Opt::kRdzvEndpoint, "h:1"}, {Opt::kNnodes, "2"}},
                    {"train.py"}, {}, host)
            .rfind("--rdzv-id is required for a multi-node c10d job (--nnodes=2)", 0) == 0);
  const BuiltConfig s =
      build({{Opt::kStandalone, "true"}, {Opt::kRdzvId, "x"}}, {"train.py"}, {}, host);
  CHECK(s.config.rdzv.backend == trun::rendezvous::BackendKind::kStatic);
  CHECK(s.config.run_id.empty());
  const BuiltConfig e = build(
      {{Opt::kRdzvBackend, "etcd-v2"}, {Opt::kRdzvEndpoint, "h:2379"}, {Opt::kRdzvConf, "bogus=1"}},
      {"train.py"}, {}, host);
  CHECK(e.config.rdzv.backend == trun::rendezvous::BackendKind::kEtcd);
  CHECK(e.config.rdzv.conf_entries.empty());  // the unknown key is dropped
  // The store token comes from the environment, read here and nowhere in the agent.
  CHECK(build({}, {"train.py"}, {{"TRUN_STORE_TOKEN", "s3"}}, host).config.rdzv.store_token ==
        "s3");
  REQUIRE(e.notes.size() == 1);
  CHECK(e.notes[0].rfind("--rdzv-conf: ignoring unknown key(s) 'bogus'", 0) == 0);
}

TEST_CASE("the value parsers read integers as strtoll and filters as torchrun", "[cli_steps]") {
  long long v = 0;
  CHECK((parse_int(" +5", v) && v == 5));
  CHECK_FALSE(parse_int("5 ", v));
  CHECK_FALSE(parse_int("0x10", v));
  CHECK_FALSE(parse_int("99999999999999999999", v));
  CHECK(parse_filters("a,,b,c") == Args{"a,b", "c"});
  CHECK(parse_filters("").empty());
  CHECK(parse_signals("term,SIGUSR1,TERM").size() == 2);
  const trun::agent::StdSpec spec = parse_std("--tee", "0:1,3:3");
  CHECK(spec.is_map);
  CHECK(spec.per_rank.at(3) == 3);
  CHECK(parse_seconds("--x", "2.5", false) == std::chrono::milliseconds(2500));
}
