// train_mlp: elastic data-parallel training of an MLP with libtrun_worker, the C++ counterpart of
// PyTorch's elastic DDP tutorial (ToyModel 10 -> 10 -> 5, SGD, MSE on synthetic data).
//
//   trun --standalone --nproc-per-node=4 --max-restarts=3 build/examples/train_mlp/train_mlp
//
// Every K steps rank 0 saves a checkpoint (parameters, momentum, sampler position); on start
// every rank resumes from the newest valid one, whatever the world size was when it was saved.
// A stop signal (trun/stop.h: TORCHELASTIC_SIGNALS_TO_HANDLE, e.g. SIGTERM or SLURM's SIGUSR1)
// makes every rank stop at one agreed step, save it and exit 75 (EX_TEMPFAIL: resume me).
// See examples/train_mlp/README.md.

#include <unistd.h>

#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <trun/checkpoint.h>
#include <trun/ddp.h>
#include <trun/error_file.h>
#include <trun/resilient.h>
#include <trun/sampler.h>
#include <trun/stop.h>
#include <trun/worker.h>

#include "examples/train_mlp/args.h"
#include "examples/train_mlp/mlp.h"

using namespace trun::worker;
using trun::examples::Args;
using trun::examples::Mlp;
using trun::examples::Sgd;

namespace {

// Stopped on request (a stop signal) after saving a checkpoint of the agreed step: run the job
// again, with the same checkpoint directory, to resume from it. sysexits.h's EX_TEMPFAIL.
constexpr int kExitStoppedOnRequest = 75;

// The checkpoint directory when --ckpt-dir is not given: $TMPDIR/train_mlp-ckpt under a launcher
// (any run id), so that running the job again resumes it (a new trun --standalone has a new run
// id; the Checkpointer continues the earlier job's checkpoints once that job is gone, and refuses
// while it runs); else (run by hand, no run id) a directory of this run's own (rank 0's host and
// pid, told to the other ranks through the store), removed when training completes. *own is set
// in that case.
std::string default_ckpt_dir(Worker& worker, ProcessGroup& pg, bool* own) {
  const char* tmp = std::getenv("TMPDIR");
  const std::string base = std::string(tmp && *tmp ? tmp : "/tmp") + "/train_mlp-";
  *own = worker.env().run_id == "none";
  if (!*own) return base + "ckpt";
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "localhost");
  std::string dir = base + host + "-" + std::to_string(::getpid());
  if (worker.world_size() > 1 && worker.store()) {
    const std::string key = "train_mlp/default_ckpt_dir";
    if (worker.rank() == 0) worker.store()->set(key, dir);
    pg.barrier();  // rank 0's value is in the store (replacing any older one)
    if (worker.rank() != 0) dir = worker.store()->get(key, std::chrono::minutes(1));
  }
  return dir;
}

// The sample log's group id: every process of one training group (one worker-group attempt of
// one rendezvous round) logs the same id. Rank 0 picks "<pid>-<unix ms>" and tells the others
// through the store (set before the barrier, read after it: never a previous group's value).
std::string sample_log_group(Worker& worker, ProcessGroup& pg) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                      std::chrono::system_clock::now().time_since_epoch())
                      .count();
  std::string id = std::to_string(::getpid()) + "-" + std::to_string(ms);
  if (worker.world_size() > 1 && worker.store()) {
    const std::string key = "train_mlp/sample_log_group";
    if (worker.rank() == 0) worker.store()->set(key, id);
    pg.barrier();
    if (worker.rank() != 0) id = worker.store()->get(key, std::chrono::minutes(1));
  }
  return id;
}

// The value of "group" in a checkpoint's metadata (written by save() below with --sample-log),
// "?" when there is none.
std::string metadata_group(const std::string& json) {
  const std::string key = "\"group\"";
  size_t p = json.find(key);
  if (p == std::string::npos) return "?";
  p = json.find('"', json.find(':', p + key.size()));
  if (p == std::string::npos) return "?";
  const size_t e = json.find('"', p + 1);
  return e == std::string::npos ? "?" : json.substr(p + 1, e - p - 1);
}

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// What the steps of run() share: the objects run() sets up, and where training is.
struct Training {
  const Args& args;
  Mlp& model;
  Sgd& opt;
  // Built over each formation's groups (one formation without the resilient loop).
  DistributedSampler* sampler = nullptr;
  DistributedDataParallel* ddp = nullptr;
  StopAgreement* stop = nullptr;
  const WorkerEnv* env = nullptr;  // the current formation's (restart_count: its generation)
  int rank = 0;
  int world = 1;
  std::string group{};             // the sample log's group id ("" without --sample-log)
  std::string resumed_from = "-";  // the group that saved the checkpoint resumed from
  std::unique_ptr<Checkpointer> ckpt{};
  uint64_t step = 0;
  uint64_t saved_step = UINT64_MAX;  // the step of the last checkpoint saved (or resumed from)
  bool own_dir = false;              // the default directory of a run without a run id
  std::string dir{};                 // the checkpoint directory
  std::FILE* sample_log = nullptr;
  ProcessGroup* pg = nullptr;  // the training group (--hang-kind mismatch issues on it)
  // For the sample log's start line (bench/goodput.py splits a restart into its parts): when
  // run() began, how long init() and the group id took, and how long the checkpoint load took.
  double proc_start = 0.0;
  double init_seconds = 0.0;
  double load_seconds = 0.0;
  uint64_t steps_this_run = 0;  // for --stop-after-steps
  double loss_sum = 0.0;        // of this epoch's steps on this rank, for its epoch line
  uint64_t loss_n = 0;
  std::optional<int> exit_code{};    // training ended early: the process's exit code
  std::vector<float> x{}, target{};  // a step's batch
};

// What one formation's groups carry: built by build_group_objects, dropped before the next.
struct GroupObjects {
  std::unique_ptr<ProcessGroup> cpu_group;  // the stop agreement's, when the training group is NCCL
  std::unique_ptr<DistributedDataParallel> ddp;
  std::unique_ptr<StopAgreement> stop;
};

// --hang-at-step: the fault injected after step t.step on the first attempt. Every rank takes
// part in a mismatch (the others allreduce 1024 floats, rank hang_rank broadcasts 10: the
// collective sequences differ in op and count at the same seq); only hang_rank spins.
void inject_hang(const Training& t) {
  const Args& args = t.args;
  if (args.hang_at_step < 0 || t.step != static_cast<uint64_t>(args.hang_at_step) ||
      t.env->restart_count != 0)
    return;
  const bool culprit = t.rank == args.hang_rank;
  if (culprit) {
    std::printf("hangbench fault kind=%s rank=%d step=%" PRIu64 " attempt=%d pid=%d t=%.3f\n",
                args.hang_kind.c_str(), t.rank, t.step, t.env->restart_count,
                static_cast<int>(::getpid()), unix_seconds());
    std::fflush(stdout);
  }
  if (args.hang_kind == "spin") {
    if (!culprit) return;
    volatile uint64_t spins = 0;  // user code that never returns and calls nothing
    for (;;) spins = spins + 1;
  }
  std::vector<float> buf(1024, 1.0f);
  if (culprit)
    t.pg->broadcast(buf.data(), 10, DataType::kFloat32, 0);
  else
    t.pg->allreduce(buf.data(), buf.size(), DataType::kFloat32);
}

// Opens the checkpoint directory (the default one unless --ckpt-dir) with `pg` as the load's group.
void open_checkpointer(Training& t, Worker& worker, ProcessGroup& pg, ProcessGroup& host_pg) {
  const Args& args = t.args;
  t.dir = args.ckpt_dir;
  if (t.dir.empty()) {
    t.dir = default_ckpt_dir(worker, host_pg, &t.own_dir);
    if (t.own_dir && t.rank == 0 && !t.ckpt)
      std::printf(
          "[%d] checkpoints in %s (no run id from a launcher: this run's own directory; "
          "pass --ckpt-dir to be able to resume)\n",
          static_cast<int>(::getpid()), t.dir.c_str());
  }
  CheckpointerOptions co;
  co.group = &pg;
  co.keep_last = args.keep;
  co.async = args.async_ckpt;
  co.start_fresh_if_damaged = args.fresh_start;
  co.set_aside_other_jobs = args.fresh_start;
  t.ckpt.reset();  // the previous formation's: releases the directory's lock first
  t.ckpt = std::make_unique<Checkpointer>(t.dir, co);
}

// Resumes from the newest valid checkpoint, if any (collective over the checkpointer's group).
void load_checkpoint(Training& t) {
  Mlp& model = t.model;
  if (auto c = t.ckpt->load_latest()) {
    for (size_t i = 0; i < model.num_params(); ++i) {
      c->copy_to("model", model.param_name(i), model.param(i), model.param_numel(i),
                 DataType::kFloat32);
      c->copy_to("optimizer", model.param_name(i) + ".momentum", t.opt.momentum_buffers()[i].data(),
                 model.param_numel(i), DataType::kFloat32);
    }
    if (c->sampler) t.sampler->load_state(*c->sampler);
    t.step = c->step;
    t.saved_step = t.step;
    t.resumed_from = metadata_group(c->metadata);
    if (t.rank == 0)
      std::printf("[%d] resumed from %s (step %" PRIu64 ", epoch %" PRIu64
                  ", sample offset %" PRIu64 ", saved at world size %d, now %d)\n",
                  static_cast<int>(::getpid()), c->path.c_str(), t.step, t.sampler->epoch(),
                  t.sampler->offset(), c->world_size, t.world);
  } else if (t.rank == 0) {
    std::printf("[%d] no checkpoint in %s: starting from scratch\n", static_cast<int>(::getpid()),
                t.dir.c_str());
  }
  std::fflush(stdout);
}

// Opens PREFIX.<pid> for --sample-log and writes its "start" line. False (said on stderr) if it
// cannot be opened.
bool open_sample_log(Training& t) {
  const std::string path = t.args.sample_log + "." + std::to_string(::getpid());
  // A resilient loop's later formation writes another start line into the same file.
  if (!t.sample_log) t.sample_log = std::fopen(path.c_str(), "a");
  if (!t.sample_log) {
    std::fprintf(stderr, "train_mlp: cannot open %s: %s\n", path.c_str(), std::strerror(errno));
    return false;
  }
  std::fprintf(t.sample_log,
               "start group %s world %d rank %d restart %d step %" PRIu64
               " resumed_from %s time %.6f proc_start %.6f init_seconds %.6f load_seconds %.6f\n",
               t.group.c_str(), t.world, t.rank, t.env->restart_count, t.step,
               t.resumed_from.c_str(), unix_seconds(), t.proc_start, t.init_seconds,
               t.load_seconds);
  std::fflush(t.sample_log);
  return true;
}

// Saves a checkpoint of the current step. A periodic save that fails (a full or read-only disk)
// does not stop training: the error is reported and the next period tries again. The final save
// must succeed.
void save(Training& t, bool final_save) {
  if (!t.ckpt) return;
  Mlp& model = t.model;
  SaveRequest req;
  req.step = t.step;
  for (size_t i = 0; i < model.num_params(); ++i) {
    req.model.push_back(
        {model.param_name(i), DataType::kFloat32, model.param_shape(i), model.param(i)});
    req.optimizer.push_back({model.param_name(i) + ".momentum", DataType::kFloat32,
                             model.param_shape(i), t.opt.momentum_buffers()[i].data()});
  }
  req.sampler = t.sampler->state();
  req.metadata = "{\"sizes\": \"" + t.args.sizes +
                 "\", \"world_size\": " + std::to_string(t.world) +
                 (t.group.empty() ? "" : ", \"group\": \"" + t.group + "\"") + "}";
  try {
    t.ckpt->save(req);
    t.saved_step = t.step;
    if (final_save) t.ckpt->wait();
  } catch (const CheckpointOwnerError&) {
    throw;
  } catch (const CheckpointError& e) {
    if (final_save) throw;
    std::fprintf(stderr,
                 "[%d] checkpoint of step %" PRIu64
                 " failed, training goes on and tries again at step %" PRIu64 ": %s\n",
                 static_cast<int>(::getpid()), t.step, t.step + t.args.ckpt_every, e.what());
  }
}

// Appends the sample indices of the next step to the sample log.
void log_samples(const Training& t, const std::vector<uint64_t>& idx) {
  std::fprintf(t.sample_log,
               "epoch %" PRIu64 " step %" PRIu64 " world %d rank %d group %s time %.6f idx",
               t.sampler->epoch(), t.step + 1, t.world, t.rank, t.group.c_str(), unix_seconds());
  for (uint64_t v : idx) std::fprintf(t.sample_log, " %" PRIu64, v);
  std::fprintf(t.sample_log, "\n");
  std::fflush(t.sample_log);
}

// Every rank agreed to stop at this step: makes sure it is saved, says so and returns the exit
// code. A rank of a resilient loop that was not asked to stop itself (another node leaves) goes
// on instead: rejoin() throws, and the loop re-forms without the ranks that stop.
int stop_on_request(Training& t) {
  if (t.ckpt) {
    if (t.saved_step == t.step)
      t.ckpt->wait();  // the periodic save of this step; it must succeed
    else
      save(t, true);
  }
  if (!t.stop->stops_here()) {
    std::printf("[%d] rank %d: a node leaves (its ranks stop on request at step %" PRIu64
                "); this rank goes on without it\n",
                static_cast<int>(::getpid()), t.rank, t.step);
    std::fflush(stdout);
    t.stop->rejoin();
  }
  if (t.sample_log) std::fclose(t.sample_log);
  if (t.rank == 0) {
    const std::string what = t.ckpt ? "checkpoint step_" + std::to_string(t.step) + " saved"
                                    : "no checkpoint (--no-ckpt)";
    std::printf("[%d] stopped on request (%s) at step %" PRIu64 ": %s\n",
                static_cast<int>(::getpid()), stop_signal_name(t.stop->agreed_signal()).c_str(),
                t.step, what.c_str());
    if (t.ckpt && t.own_dir)
      std::printf("[%d] resume with --ckpt-dir %s\n", static_cast<int>(::getpid()), t.dir.c_str());
  }
  std::fflush(stdout);
  return kExitStoppedOnRequest;
}

// The end of an epoch: its loss line, and the next epoch.
void end_epoch(Training& t) {
  if (t.loss_n) {
    std::printf("[%d] epoch %" PRIu64 " (rank %d, local_rank %d) loss %.6f\n",
                static_cast<int>(::getpid()), t.sampler->epoch(), t.rank, t.env->local_rank,
                t.loss_sum / static_cast<double>(t.loss_n));
    std::fflush(stdout);
  }
  t.loss_sum = 0.0;
  t.loss_n = 0;
  t.sampler->set_epoch(t.sampler->epoch() + 1);
}

// One training step. False when training ends instead: complete (t.exit_code unset), or early (a
// stop request, --stop-after-steps: t.exit_code). Stop checks come before the step's work, so a
// step that throws (a peer failed) has changed nothing but the sampler and the loss sums, and
// the parameters and momentum change only after its last collective (trun/resilient.h).
bool train_step(Training& t) {
  const Args& args = t.args;
  Mlp& model = t.model;
  if (t.sampler->epoch_done()) end_epoch(t);
  if (t.sampler->epoch() >= args.epochs) return false;
  if (t.stop->should_stop(t.step)) {  // the same step on every rank
    t.exit_code = stop_on_request(t);
    return false;
  }
  if (args.stop_after_steps && t.steps_this_run >= args.stop_after_steps) {
    if (t.ckpt) t.ckpt->wait();
    std::printf("[%d] stopping after %" PRIu64 " steps (--stop-after-steps), at step %" PRIu64 "\n",
                static_cast<int>(::getpid()), t.steps_this_run, t.step);
    t.exit_code = 0;
    return false;
  }
  std::vector<float>& x = t.x;
  std::vector<float>& target = t.target;
  std::vector<float*> grads(model.num_params());
  std::vector<const float*> cgrads(model.num_params());
  for (size_t i = 0; i < model.num_params(); ++i) {
    grads[i] = t.ddp->grad_as<float>(i);
    cgrads[i] = grads[i];
  }
  const std::vector<uint64_t> idx = t.sampler->next_batch(args.batch_size);
  if (t.sample_log) log_samples(t, idx);
  model.make_batch(idx, x, target);
  t.ddp->zero_grad();
  t.loss_sum += model.forward(x.data(), target.data(), idx.size());
  ++t.loss_n;
  model.backward(grads, [&](size_t i) { t.ddp->mark_ready(i); });
  t.ddp->finalize();
  t.opt.step(model, cgrads);
  ++t.step;
  ++t.steps_this_run;
  if (args.crash_at_step >= 0 && t.step == static_cast<uint64_t>(args.crash_at_step) &&
      t.rank == args.crash_rank && t.env->restart_count == 0) {
    std::fprintf(stderr, "[%d] rank %d crashing at step %" PRIu64 " (--crash-at-step)\n",
                 static_cast<int>(::getpid()), t.rank, t.step);
    std::exit(1);
  }
  if (args.print_steps && t.rank == 0) {
    std::printf("hangbench step=%" PRIu64 " rank=0 attempt=%d t=%.3f\n", t.step,
                t.env->restart_count, unix_seconds());
    std::fflush(stdout);
  }
  inject_hang(t);
  if (t.step % args.ckpt_every == 0) save(t, false);
  if (args.step_sleep_ms > 0)
    std::this_thread::sleep_for(std::chrono::milliseconds(args.step_sleep_ms));
  return true;
}

// Training is complete: saves the last step, writes --final-params, removes a run's own
// directory. Returns the exit code.
int finish(Training& t) {
  const Args& args = t.args;
  Mlp& model = t.model;
  if (t.ckpt && t.saved_step != t.step) save(t, true);
  if (t.ckpt) t.ckpt->wait();
  if (t.sample_log) std::fclose(t.sample_log);
  if (!args.final_params.empty() && t.rank == 0) {
    std::ofstream out(args.final_params, std::ios::binary | std::ios::trunc);
    for (size_t i = 0; i < model.num_params(); ++i)
      out.write(reinterpret_cast<const char*>(model.param(i)),
                static_cast<std::streamsize>(model.param_numel(i) * sizeof(float)));
    for (size_t i = 0; i < model.num_params(); ++i)
      out.write(reinterpret_cast<const char*>(t.opt.momentum_buffers()[i].data()),
                static_cast<std::streamsize>(model.param_numel(i) * sizeof(float)));
    if (!out.flush()) {
      std::fprintf(stderr, "train_mlp: cannot write %s\n", args.final_params.c_str());
      return 1;
    }
  }
  // A run's own directory (no run id) cannot be resumed by a later run: do not leave it behind
  // once training is complete.
  if (t.own_dir && t.rank == 0) {
    t.ckpt.reset();  // releases the directory's lock
    std::error_code ec;
    std::filesystem::remove_all(t.dir, ec);
  }
  if (t.rank == 0)
    std::printf("[%d] done: %" PRIu64 " steps, world size %d\n", static_cast<int>(::getpid()),
                t.step, t.world);
  return 0;
}

// The DDP reducer and the stop agreement over a formation's groups (dropping the previous ones).
// The resilient loop moves the state itself: its DDP does not broadcast rank 0's parameters.
void build_group_objects(Training& t, GroupObjects& g, Worker& worker, bool broadcast) {
  g = GroupObjects{};
  Mlp& model = t.model;
  ProcessGroup& pg = worker.process_group();
  std::vector<Parameter> params;
  for (size_t i = 0; i < model.num_params(); ++i)
    params.push_back({model.param_name(i), model.param(i), model.param_numel(i), DataType::kFloat32,
                      Device::kCpu});
  DdpOptions dopt;
  dopt.bucket_cap_mb = t.args.bucket_cap_mb;
  dopt.broadcast_on_construction = broadcast;
  g.ddp = std::make_unique<DistributedDataParallel>(pg, params, dopt);
  // The stop agreement's flag is host memory: with NCCL it runs on a CPU group of its own.
  if (pg.backend() == Backend::kNccl) g.cpu_group = worker.new_group(Backend::kCpu);
  g.stop =
      std::make_unique<StopAgreement>(g.cpu_group ? *g.cpu_group : pg, t.args.stop_check_every);
  t.ddp = g.ddp.get();
  t.stop = g.stop.get();
  t.pg = &pg;
  t.env = &worker.env();
  t.rank = worker.rank();
  t.world = worker.world_size();
}

// The sampler for this rank and world size, at the position of the one it replaces (if any).
void place_sampler(Training& t, std::unique_ptr<DistributedSampler>& sampler) {
  if (sampler && sampler->rank() == t.rank && sampler->world_size() == t.world) return;
  SamplerOptions so;
  so.seed = t.args.seed;
  auto next = std::make_unique<DistributedSampler>(t.args.dataset_size, t.rank, t.world, so);
  if (sampler) next->load_state(sampler->state());  // a global offset: any world size
  sampler = std::move(next);
  t.sampler = sampler.get();
}

// --print-steps: the "hangbench start" line of a formation (its generation as the attempt).
void print_start(const Training& t) {
  if (!t.args.print_steps) return;
  std::printf("hangbench start rank=%d local_rank=%d attempt=%d pid=%d t=%.3f\n", t.rank,
              t.env->local_rank, t.env->restart_count, static_cast<int>(::getpid()),
              unix_seconds());
  std::fflush(stdout);
}

// What every formation does first: the group's objects, the sampler for this rank and world
// size, the start line. Returns the group for host memory (the stop agreement's).
ProcessGroup& form_training(Training& t, GroupObjects& g,
                            std::unique_ptr<DistributedSampler>& sampler, Worker& worker,
                            bool broadcast) {
  build_group_objects(t, g, worker, broadcast);
  place_sampler(t, sampler);
  print_start(t);
  return g.cpu_group ? *g.cpu_group : worker.process_group();
}

// Without the resilient loop (--classic): one formation; a peer's failure ends this process and
// the agent restarts the whole group, which resumes from the newest checkpoint.
int run_classic(Training& t, const InitOptions& io) {
  Worker worker = init(io);
  // Each rank starts from its own random weights; DDP broadcasts rank 0's.
  t.model.init(t.args.seed + static_cast<uint64_t>(worker.rank()));
  GroupObjects g;
  std::unique_ptr<DistributedSampler> sampler;
  ProcessGroup& host_pg = form_training(t, g, sampler, worker, true);
  if (!t.args.sample_log.empty()) t.group = sample_log_group(worker, host_pg);
  const double load_begin = unix_seconds();
  t.init_seconds = load_begin - t.proc_start;
  if (!t.args.no_ckpt) {
    open_checkpointer(t, worker, worker.process_group(), host_pg);
    load_checkpoint(t);
  }
  t.load_seconds = unix_seconds() - load_begin;
  std::fflush(stdout);
  if (!t.args.sample_log.empty() && !open_sample_log(t)) return 1;
  while (train_step(t)) {
  }
  if (t.exit_code) return *t.exit_code;
  return finish(t);
}

// With the resilient loop (trun/resilient.h): a peer's failure makes this process build new
// groups with the peer's replacement and continue from the most advanced step any rank holds.
int run_resilient(Training& t, const InitOptions& io) {
  Mlp& model = t.model;
  ResilientState state;
  state.set_step(&t.step);
  for (size_t i = 0; i < model.num_params(); ++i) {
    state.add(model.param_name(i), model.param(i), model.param_numel(i) * sizeof(float));
    state.add(model.param_name(i) + ".momentum", t.opt.momentum_buffers()[i].data(),
              model.param_numel(i) * sizeof(float));
  }
  // The sample log's chain: the group whose steps this state continues moves with the state, so
  // that a replacement's start line names the same one as the survivors' (the formation it
  // re-formed from), and a restore names the checkpoint's.
  if (!t.args.sample_log.empty()) {
    state.add_serialized(
        "sample_log.resumed_from", [&t] { return t.resumed_from; },
        [&t](const std::string& group) { t.resumed_from = group; });
  }
  ResilientOptions ro;
  ro.init = io;
  ResilientLoop loop(state, ro);
  // A rank's own start: rank 0's weights (or the checkpoint's) are moved to every rank.
  model.init(t.args.seed + static_cast<uint64_t>(loop.worker().rank()));
  GroupObjects g;
  std::unique_ptr<DistributedSampler> sampler;
  bool sample_log_ok = true;
  bool start_line_due = false;
  bool group_logged = false;  // the current formation wrote its start line (it took a step)
  ResilientProgram program;
  program.on_group = [&](Worker& worker, const Formation& f) {
    ProcessGroup& host_pg = form_training(t, g, sampler, worker, false);
    state.set_sampler(t.sampler);
    if (f.number == 0) t.init_seconds = unix_seconds() - t.proc_start;
    if (!t.args.no_ckpt) open_checkpointer(t, worker, worker.process_group(), host_pg);
    if (!t.args.sample_log.empty()) {
      // A group id per formation; its start line once the state is in place (the first step).
      // A survivor's state continues its previous formation; a replacement receives that name
      // with the state, and a restore sets the checkpoint's.
      const std::string previous = t.group;
      t.group = sample_log_group(worker, host_pg);
      // A formation that broke before its first step logged nothing: the chain skips it.
      if (f.number > 0 && group_logged) t.resumed_from = previous;
      group_logged = false;
      start_line_due = true;
    }
  };
  program.release = [&] {
    t.ckpt.reset();  // waits for its background write
    g = GroupObjects{};
  };
  // Stopped while the group re-formed (the job stops, or its restarts are spent): rank 0 saves
  // the step it holds alone, unless that step is saved already.
  program.save_alone = [&](Worker&) {
    if (t.args.no_ckpt || t.dir.empty() || t.saved_step == t.step) return;
    if (!t.ckpt) {
      // The last formation's checkpointer is gone (a formation broke): one without a group. The
      // group's next rank 0 may hold the directory (this node leaves, the others go on): not
      // worth the shutdown timeout.
      CheckpointerOptions co;
      co.keep_last = t.args.keep;
      co.lock_wait = std::chrono::seconds(2);
      t.ckpt = std::make_unique<Checkpointer>(t.dir, co);
    }
    save(t, true);  // the writer's save is local: it needs no live group
  };
  program.restore = [&](Worker&) {
    const double load_begin = unix_seconds();
    t.resumed_from = "-";  // the checkpoint's group, when one loads
    if (t.ckpt) load_checkpoint(t);
    t.load_seconds = unix_seconds() - load_begin;
  };
  program.step = [&](Worker&) {
    if (start_line_due) {
      start_line_due = false;
      sample_log_ok = open_sample_log(t);
      group_logged = true;
    }
    return sample_log_ok && train_step(t);
  };
  loop.run(program);
  if (!sample_log_ok) return 1;
  if (t.exit_code) return *t.exit_code;
  return finish(t);
}

int run(int argc, char** argv) {
  const double proc_start = unix_seconds();
  const Args args = trun::examples::parse_args(argc, argv);
  // Before init(): a stop signal that arrives while the group forms or the checkpoint loads is
  // acted on at the first step instead of killing the process.
  watch_stop_signals();
  Mlp model(trun::examples::parse_sizes(args.sizes));
  InitOptions io;
  io.backend = parse_backend(args.backend);
  Sgd opt(args.lr, args.momentum);
  opt.ensure_buffers(model);
  Training t{args, model, opt};
  t.proc_start = proc_start;
  return args.classic ? run_classic(t, io) : run_resilient(t, io);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return record([&] {
      try {
        return run(argc, argv);
      } catch (const CollectiveError&) {
        // Asked to stop, but the group broke first (a peer was stopped before the agreement):
        // end by the signal as a program without handlers would, not as a failure.
        if (stop_requested()) exit_by_stop_signal();
        throw;
      }
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_mlp: %s\n", e.what());
    return 1;
  }
}
