// SPDX-License-Identifier: MIT
// The reference of benchmarks/pslite.sh: ps-lite's (github.com/dmlc/ps-lite) zero-copy
// push+pull (KVWorker::ZPushPull: the push is sent from the caller's buffer; the pulled
// values are copied into `pulled`, as pulley's are into the model) of one key holding n
// bytes of floats, against one server that does what pulley's push_pull benchmark's ps
// does: w -= lr * g with lr = 0 (Sgd under Async), then answers w. Built against a ps-lite
// checkout by pslite.sh, never by pulley's CMake. Every process runs this program; ps-lite's environment (DMLC_ROLE, ...) says which
// role it plays. The worker prints one line per size:
//   pslite BYTES SECONDS_PER_CALL CALLS
//
//   pslite_push_pull SECONDS_PER_SIZE BYTES...
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <unordered_map>
#include <vector>

#include "ps/ps.h"

namespace {

/// The server's variables, one per key, created by their first push; answered without a
/// copy (the reply's SArray shares the stored one's memory, as pulley's reply views its
/// part).
class Store {
 public:
  void operator()(const ps::KVMeta& meta, const ps::KVPairs<float>& data, ps::KVServer<float>* server) {
    ps::KVPairs<float> reply;
    if (data.keys.size() != 1) {
      std::fprintf(stderr, "pslite_push_pull: one key per request, got %zu\n", data.keys.size());
      std::abort();
    }
    const ps::Key key = data.keys[0];
    ps::SArray<float>& w = weights_[key];
    if (meta.push) {
      if (w.size() != data.vals.size()) {
        w.resize(data.vals.size());
        std::fill(w.begin(), w.end(), 0.0F);
      }
      const float* g = data.vals.data();
      float* out = w.data();
      const std::size_t n = w.size();
      const float lr = learning_rate_;  // read once: the loop vectorizes, as pulley's Sgd does
      for (std::size_t i = 0; i < n; ++i) out[i] -= lr * g[i];
    }
    if (meta.pull) {
      reply.keys = data.keys;
      reply.vals = w;
      reply.lens.resize(1);
      reply.lens[0] = static_cast<int>(w.size());
    }
    server->Response(meta, reply);
  }

 private:
  std::unordered_map<ps::Key, ps::SArray<float>> weights_;
  volatile float learning_rate_ = 0.0F;  // not known at compile time: the loop is not elided
};

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void run_worker(double seconds, const std::vector<std::size_t>& sizes) {
  ps::KVWorker<float> kv(0, 0);
  for (std::size_t s = 0; s < sizes.size(); ++s) {
    const std::size_t n = sizes[s] / sizeof(float);
    ps::SArray<ps::Key> keys(1, static_cast<ps::Key>(s));
    ps::SArray<float> gradient(n, 1e-3F);
    ps::SArray<float> pulled(n);
    ps::SArray<int> lens(1, static_cast<int>(n));
    const auto once = [&] { kv.Wait(kv.ZPushPull(keys, gradient, &pulled, &lens)); };
    once();  // creates the variable; warms up
    long calls = 0;
    const auto start = std::chrono::steady_clock::now();
    double elapsed = 0.0;
    do {
      once();
      ++calls;
      elapsed = seconds_since(start);
    } while (elapsed < seconds);
    std::printf("pslite %zu %.9f %ld\n", sizes[s], elapsed / static_cast<double>(calls), calls);
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s SECONDS_PER_SIZE BYTES... (in ps-lite's environment)\n", argv[0]);
    return 2;
  }
  const double seconds = std::strtod(argv[1], nullptr);
  std::vector<std::size_t> sizes;
  for (int i = 2; i < argc; ++i) sizes.push_back(std::strtoull(argv[i], nullptr, 10));
  ps::Start(0);
  ps::KVServer<float>* server = nullptr;
  Store store;
  if (ps::IsServer()) {
    server = new ps::KVServer<float>(0);
    server->set_request_handle([&store](const ps::KVMeta& meta, const ps::KVPairs<float>& data,
                                        ps::KVServer<float>* s) { store(meta, data, s); });
  }
  if (ps::IsWorker()) run_worker(seconds, sizes);
  ps::Finalize(0, true);
  delete server;
  return 0;
}
