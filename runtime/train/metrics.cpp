#include "runtime/train/metrics.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>

#include "runtime/core/allocator.h"
#include "runtime/core/log.h"
#include "runtime/kernels/cpu/isa.h"
#include "runtime/kernels/ops.h"

namespace mt {

double unix_time_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  int64_t t = int64_t(s + 0.5);
  if (t >= 3600) return fmt::format("{}h{:02d}m", t / 3600, (t % 3600) / 60);
  if (t >= 60) return fmt::format("{}m{:02d}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

bool progress_bar_wanted(const std::string& mode) {
  if (mode == "on") return true;
  if (mode == "off") return false;
  return reaches_terminal(STDOUT_FILENO);
}

// Measured with the GEMM the training step uses (matmul_forward: the CPU kernels at the instruction-set
// level this process runs at, cpu_isa()), on this process's threads: the MFU's denominator is what this
// machine's GEMM reaches, not a datasheet figure.
double gemm_peak_flops(DType dt, int64_t n, int reps) {
  std::vector<double> va(size_t(n * n)), vb(size_t(n * n));
  for (int64_t i = 0; i < n * n; ++i) va[size_t(i)] = double(i % 7) * 0.1, vb[size_t(i)] = double(i % 5) * 0.1;
  Tensor a = from_values(va, {n, n}, dt), b = from_values(vb, {n, n}, dt), c = empty({n, n}, dt);
  double best = 0;
  for (int rep = 0; rep <= reps; ++rep) {  // rep 0 warms up
    auto t0 = std::chrono::steady_clock::now();
    matmul_forward(c, a, b);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rep > 0) best = std::max(best, 2.0 * double(n * n * n) / s);
  }
  return best;
}

double probe_cpu_peak_flops() {
  return gemm_peak_flops(DType::f32, 768, 7);  // the best of 7: shared machines are noisy
}

double cpu_peak_flops() {
  static double peak = [] {
    const double best = probe_cpu_peak_flops();
    MT_LOG_INFO("CPU kernels: {} (widest supported: {}); f32 GEMM peak {:.1f} GFLOP/s on {} threads (768^3)",
                cpu_isa_name(cpu_isa()), cpu_isa_name(cpu_isa_supported()), best / 1e9, cpu_threads());
    return best;
  }();
  return peak;
}

double peak_memory_bytes(Device d) {
  if (d.is_cuda()) return double(allocator_stats(d).peak_allocated_bytes);
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_maxrss) * 1024.0;
}

MetricsLogger::MetricsLogger(int rank, int world, const std::string& path, int64_t total, int64_t interval, double fpt,
                             double peak, Device device, const std::string& progress)
    : rank_(rank),
      world_(world),
      total_(total),
      interval_(interval),
      flops_per_token_(fpt),
      peak_flops_(peak),
      device_(device),
      tty_(rank == 0 && progress_bar_wanted(progress)) {
  if (rank_ == 0 && !path.empty()) {
    std::error_code ec;
    auto parent = std::filesystem::path(path).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent, ec);
    file_ = std::fopen(path.c_str(), "a");
    MT_CHECK(file_, "metrics", "cannot open log.metrics_file = {} for appending", path);
  }
}

MetricsLogger::~MetricsLogger() {
  clear_bar();
  if (file_) std::fclose(file_);
}

void MetricsLogger::clear_bar() {
  if (bar_shown_) {
    std::printf("\r\033[K");
    std::fflush(stdout);
    bar_shown_ = false;
  }
}

void MetricsLogger::record(nlohmann::json j) {
  if (!file_) return;
  // Every record carries its own time: a reader (the supervisor's goodput) that read it late must not date it late.
  if (j.is_object() && !j.contains("time")) j["time"] = unix_time_s();
  // Samples may hold bytes that are not UTF-8: replaced rather than refused.
  std::string s = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  std::fprintf(file_, "%s\n", s.c_str());
  std::fflush(file_);
}

void MetricsLogger::note(const std::string& line) {
  if (rank_ != 0) return;
  clear_bar();
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

namespace {
// An MoE model's routing: the balance loss, each sparse layer's most loaded expert against the mean (1: balanced),
// dropped rows, the selection bias's range, and the whole load (layers x experts: scripts/plot_metrics.py's heat map).
void add_router_stats(nlohmann::json& j, const RouterStepStats& r) {
  std::vector<double> max_over_mean;
  for (const auto& layer : r.expert_load) {
    double mx = 0, sum = 0;
    for (double v : layer) mx = std::max(mx, v), sum += v;
    max_over_mean.push_back(sum > 0 ? mx / (sum / double(layer.size())) : 0);
  }
  j["aux_loss"] = r.aux_loss;
  j["expert_load_max_over_mean"] = max_over_mean;
  j["expert_load"] = r.expert_load;
  j["dropped_tokens"] = r.dropped;
  j["moe_dispatch_ms"] = 1e3 * r.dispatch_s;
  if (r.has_bias) j["router_bias_range"] = {r.bias_min, r.bias_max};
  // Bounded dropless expert parallel: the bound the step ran with, and how often it was recomputed past it.
  if (r.dropless_bound > 0) {
    j["moe_dropless_bound"] = r.dropless_bound;
    j["moe_bound_recomputed"] = r.bound_recomputed;
  }
}
}  // namespace

void MetricsLogger::step(const StepMetrics& m) {
  if (rank_ != 0) return;
  // The first step pays for warm-up (allocations, page faults): keep it out of the average.
  ema_step_s_ = ema_step_s_ == 0 ? m.step_s : 0.9 * ema_step_s_ + 0.1 * m.step_s;
  tokens_window_ += double(m.tokens);
  time_window_ += m.step_s;
  double tps_now = double(m.tokens) / std::max(m.step_s, 1e-12);
  double eta = ema_step_s_ * double(total_ - m.step - 1);
  bool log_line = (m.step + 1) % interval_ == 0 || m.step == 0 || m.step + 1 == total_;
  const double mem = peak_memory_bytes(device_);
  if (log_line) {
    double tps = tokens_window_ / std::max(time_window_, 1e-12);
    double mfu = peak_flops_ > 0 ? flops_per_token_ * tps / (peak_flops_ * world_) : 0;
    clear_bar();
    std::printf(
        "step %*lld/%lld | loss %.4f | lr %.2e | grad_norm %.3f | %.0f tok/s | mfu %.1f%% | mem %.0f MiB | eta %s\n",
        int(std::to_string(total_).size()), (long long)(m.step + 1), (long long)total_, m.loss, m.lr, m.grad_norm, tps,
        100 * mfu, mem / (1 << 20), format_duration(eta).c_str());
    std::fflush(stdout);
    tokens_window_ = time_window_ = 0;
  }
  // Every step is a record (its own throughput; the console averages over log.interval): goodput and a resumed
  // run's redone steps are counted from them. "time": the step's end, Unix seconds.
  const double mfu_now = peak_flops_ > 0 ? flops_per_token_ * tps_now / (peak_flops_ * world_) : 0;
  nlohmann::json j = {{"step", m.step + 1},
          {"loss", m.loss},
          {"lr", m.lr},
          {"grad_norm", m.grad_norm},
          {"tokens_per_s", tps_now},
          {"mfu", mfu_now},
          {"step_ms", 1e3 * m.step_s},
          {"time", unix_time_s()},
          {"peak_mem_bytes", mem},
          {"alloc_peak_bytes", m.alloc_peak_bytes},
          {"alloc_peak_block_bytes", m.alloc_peak_block_bytes},
          {"skipped_steps", m.skipped}};
  if (m.trained_tokens >= 0) j["trained_tokens"] = m.trained_tokens;
  if (m.router && m.router->any) add_router_stats(j, *m.router);
  record(j);
  if (tty_) {
    int width = 30, filled = int(double(width) * double(m.step + 1) / double(std::max<int64_t>(total_, 1)));
    std::string bar(size_t(filled), '=');
    if (filled < width) bar += '>' + std::string(size_t(width - filled - 1), ' ');
    std::printf("\r[%s] %lld/%lld loss %.4f %.0f tok/s eta %s\033[K", bar.c_str(), (long long)(m.step + 1),
                (long long)total_, m.loss, tps_now, format_duration(eta).c_str());
    std::fflush(stdout);
    bar_shown_ = true;
  }
}

void MetricsLogger::eval(int64_t step, double val_loss, double seconds) {
  if (rank_ != 0) return;
  note(fmt::format("eval step {} | val_loss {:.4f}", step + 1, val_loss));
  nlohmann::json j = {{"step", step + 1}, {"val_loss", val_loss}};
  if (seconds >= 0) j["eval_s"] = seconds;
  record(j);
}

void MetricsLogger::sample(int64_t step, const std::string& text) {
  if (rank_ != 0) return;
  note(fmt::format("sample step {} | {}", step + 1, text));
  record({{"step", step + 1}, {"sample", text}});
}

}  // namespace mt
