// SPDX-License-Identifier: MIT
//
// pulley 0.1.0 - single-header edition.
//
// GENERATED FILE - DO NOT EDIT. It is include/pulley/pulley.hpp with every
// pulley header inlined, produced by scripts/amalgamate.py; edit the headers
// under include/ and rerun the script.
#pragma once

// ---- begin pulley/pulley.hpp ----

/// pulley: a header-only parameter-server framework. This header is the core — the policy
/// concepts, the stock policies, the hosts and the in-process transport — and needs nothing
/// but the standard library. Headers with heavier dependencies stand apart: models
/// (`models/`, xtensor) and the wire codec of byte-stream transports (`transport/wire.hpp`,
/// cereal).

// ---- begin pulley/chief.hpp ----

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

// ---- begin pulley/concepts/transport.hpp ----

#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <utility>
#include <vector>

// ---- begin pulley/messages.hpp ----

#include <cstdint>
#include <span>
#include <string>
#include <variant>
#include <vector>

// ---- begin pulley/error.hpp ----

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace pulley {

/// Why a request failed. The names follow gRPC's status codes, which TensorFlow's
/// distributed runtime reports too, so a TF user reads them without a glossary.
enum class ErrorCode : std::uint8_t {
  kInvalidArgument = 1,     ///< the request itself is wrong (shape mismatch, NaN gradient)
  kNotFound = 2,            ///< an unknown variable or part
  kAlreadyExists = 3,       ///< duplicate initialization
  kFailedPrecondition = 4,  ///< e.g. a push before the variables are initialized
  kUnavailable = 5,         ///< the peer is dead or unreachable
  kDeadlineExceeded = 6,    ///< no answer in time (a dropped message ends here)
  kCancelled = 7,           ///< the server shut down while the request waited
};

/// Stable lower-case name of a code, for logs and error messages.
constexpr std::string_view to_string(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::kInvalidArgument:
      return "invalid_argument";
    case ErrorCode::kNotFound:
      return "not_found";
    case ErrorCode::kAlreadyExists:
      return "already_exists";
    case ErrorCode::kFailedPrecondition:
      return "failed_precondition";
    case ErrorCode::kUnavailable:
      return "unavailable";
    case ErrorCode::kDeadlineExceeded:
      return "deadline_exceeded";
    case ErrorCode::kCancelled:
      return "cancelled";
  }
  return "unknown";
}

/// The exception every pulley call throws for a failed request; `code()` says which kind.
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message)
      : std::runtime_error(std::string(to_string(code)) + ": " + message), code_(code) {}

  [[nodiscard]] ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

}  // namespace pulley
// ---- end pulley/error.hpp ----
// ---- begin pulley/placement.hpp ----

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

// ---- begin pulley/variable.hpp ----

#include <cstddef>
#include <cstdint>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

namespace pulley {

/// How the chief fills a variable before training. Values are drawn from pulley's own
/// generator (see initializers.hpp), so a seed gives the same numbers on every platform.
struct Initializer {
  enum class Kind : std::uint8_t {
    kZeros,          ///< all 0
    kConstant,       ///< all `value`
    kUniform,        ///< U(-value, value)
    kNormal,         ///< N(0, value^2)
    kGlorotUniform,  ///< U(-l, l), l = sqrt(6 / (fan_in + fan_out)) — Keras' default for Dense
  };
  Kind kind = Kind::kZeros;  ///< which rule
  float value = 0.0F;        ///< the rule's parameter (constant, limit or stddev)

  /// All 0.
  static constexpr Initializer zeros() noexcept { return {}; }
  /// All `v`.
  static constexpr Initializer constant(float v) noexcept { return {Kind::kConstant, v}; }
  /// U(-limit, limit).
  static constexpr Initializer uniform(float limit) noexcept { return {Kind::kUniform, limit}; }
  /// N(0, stddev^2).
  static constexpr Initializer normal(float stddev) noexcept { return {Kind::kNormal, stddev}; }
  /// Glorot (Xavier) uniform.
  static constexpr Initializer glorot_uniform() noexcept { return {Kind::kGlorotUniform, 0.0F}; }

  friend bool operator==(const Initializer&, const Initializer&) = default;
};

/// A dense float32 variable as the model declares it: a name, a shape and an initializer.
/// Its first dimension is the row dimension that partitioners split along; a scalar
/// (empty shape) is one row of one element.
struct VariableSpec {
  std::string name;
  std::vector<std::size_t> shape;
  Initializer initializer;

  /// Number of elements.
  [[nodiscard]] std::size_t size() const noexcept {
    return std::accumulate(shape.begin(), shape.end(), std::size_t{1}, std::multiplies<>{});
  }
  /// Rows along the first dimension (1 for a scalar).
  [[nodiscard]] std::size_t rows() const noexcept { return shape.empty() ? 1 : shape.front(); }
  /// Elements in one row.
  [[nodiscard]] std::size_t row_size() const noexcept { return rows() == 0 ? 0 : size() / rows(); }

  friend bool operator==(const VariableSpec&, const VariableSpec&) = default;
};

/// A half-open range of rows `[begin, end)` of one variable.
struct RowRange {
  std::size_t begin = 0;
  std::size_t end = 0;

  [[nodiscard]] constexpr std::size_t size() const noexcept { return end - begin; }
  [[nodiscard]] constexpr bool empty() const noexcept { return end <= begin; }
  friend constexpr bool operator==(RowRange, RowRange) = default;
};

}  // namespace pulley
// ---- end pulley/variable.hpp ----

namespace pulley {

/// One contiguous slice of a variable (rows `rows` of variable `variable`) held by ps task
/// `ps`. A whole variable is a single part; a partitioned one has several, ordered by row.
struct Part {
  std::uint32_t variable = 0;  ///< index into the model's variable list
  std::uint32_t index = 0;     ///< position among the variable's parts
  std::uint32_t ps = 0;        ///< ps task that holds it
  RowRange rows;

  friend constexpr bool operator==(const Part&, const Part&) = default;
};

/// Where every part of every variable lives: the output of a Sharding policy. Parts are
/// grouped by variable in variable order, and by row inside a variable, so the parts of
/// variable `v` are `parts_of(v)` and cover its rows exactly once.
struct Placement {
  std::vector<Part> parts;
  std::vector<std::size_t> first_part;  ///< first_part[v] .. first_part[v+1] are v's parts

  /// The parts of variable `v`, ordered by row.
  [[nodiscard]] std::span<const Part> parts_of(std::size_t v) const {
    return std::span(parts).subspan(first_part[v], first_part[v + 1] - first_part[v]);
  }
  /// Number of variables placed.
  [[nodiscard]] std::size_t num_variables() const noexcept {
    return first_part.empty() ? 0 : first_part.size() - 1;
  }

  friend bool operator==(const Placement&, const Placement&) = default;
};

/// Builds a Placement by appending parts variable by variable.
class PlacementBuilder {
 public:
  /// Starts the next variable; its parts follow with `add`.
  void begin_variable() { placement_.first_part.push_back(placement_.parts.size()); }
  /// Appends the next part of the current variable: rows `rows` on ps task `ps`.
  void add(std::uint32_t ps, RowRange rows) {
    const auto variable = static_cast<std::uint32_t>(placement_.first_part.size() - 1);
    const auto index =
        static_cast<std::uint32_t>(placement_.parts.size() - placement_.first_part.back());
    placement_.parts.push_back({variable, index, ps, rows});
  }
  /// The finished placement.
  [[nodiscard]] Placement finish() && {
    placement_.first_part.push_back(placement_.parts.size());
    return std::move(placement_);
  }

 private:
  Placement placement_;
};

}  // namespace pulley
// ---- end pulley/placement.hpp ----

namespace pulley {

// The protocol between clients (workers, chief, evaluator) and ps tasks. Every transport
// carries exactly these structs: in-process they are moved through a mailbox, over TCP
// they are serialized. The server logic sees the same values either way.
//
// Tensor payloads are `std::span` views, never owned vectors, so that a push reads the
// worker's gradient buffers and a pull reply reads the server's storage in place. Lifetime
// rule: a view in a request stays valid until the reply arrives (the sender waits); a view
// in a reply stays valid only while the transport's reply callback runs, which copies it to
// the caller's destination (or onto the wire) before returning.

/// Values for one part, addressed by its global index in `Placement::parts`.
struct PartValues {
  std::uint32_t part = 0;
  std::span<const float> values;
};

/// Rows `rows` (relative to the variable, inside the part) of part `part`.
struct Slice {
  std::uint32_t part = 0;
  RowRange rows;
};

/// Chief → every ps: the model's variables. Each ps computes the placement with its Sharding
/// policy and answers with it, so the chief can check that all ps tasks agree. Repeating the
/// same registration is harmless; a different one is refused.
struct Register {
  std::vector<VariableSpec> variables;
};

/// Chief → ps: initial values of parts this ps holds. Each part is initialized once.
struct Initialize {
  std::vector<PartValues> parts;
};

/// Client → ps: answered with the placement once every part on this ps is initialized.
struct WaitReady {};

/// Worker → ps 0: take a sync token before a step (TF's `sync_token_queue.dequeue()`).
/// Waits while the sync policy has no token to give.
struct TakeToken {
  std::uint32_t worker = 0;
};

/// Client → ps: read slices. Waits until the ps has completed `min_step` global steps, so a
/// worker holding the token of step k reads parameters that include every update before k.
struct Pull {
  std::int64_t min_step = 0;
  std::vector<Slice> slices;
};

/// Worker → ps: gradients computed from parameters of `local_step`. Every worker pushes to
/// every ps once per step (possibly with no parts): the message is also its vote towards
/// the ps's global step.
struct Push {
  std::uint32_t worker = 0;
  std::int64_t local_step = 0;
  std::vector<PartValues> gradients;
  /// The gradients were checked finite by whoever hands this message to the ps: pulley's
  /// clients check before sending anything, so the ps need not read them twice. Not part of
  /// the wire format: a message from a socket arrives unchecked, unless the transport
  /// checked its bytes on receipt.
  bool finite_checked = false;
};

/// Any client → ps: counters for monitoring and tests.
struct GetStats {};

/// Chief → ps: stop serving; requests still waiting are answered `kCancelled`.
struct Shutdown {};

/// Everything a ps task is asked.
using Request =
    std::variant<Register, Initialize, WaitReady, TakeToken, Pull, Push, GetStats, Shutdown>;

/// Success with nothing to say.
struct Ack {};

/// A refused or failed request. The server keeps serving after sending one.
struct ErrorReply {
  ErrorCode code = ErrorCode::kInvalidArgument;
  std::string message;
};

/// Answer to Register and WaitReady: the registered variables and where they live, so a
/// client can check that its model is the one the chief registered.
struct PlacementReply {
  std::vector<VariableSpec> variables;
  Placement placement;
};

/// Answer to TakeToken: `local_step` tags the next push and gates the next pull;
/// `global_step` is the number of steps completed, for progress and stopping.
/// `one_token_per_step` says the worker gets no other token of `local_step` (R <= N, or no
/// pacing at all), so after pushing it may wait for the step to complete without holding
/// it up; with R > N the step may need its next push. `paced` is false when the sync policy
/// hands tokens without ever waiting (Async): the worker need not ask for them again.
struct TokenReply {
  std::int64_t local_step = 0;
  std::int64_t global_step = 0;
  bool one_token_per_step = true;
  bool paced = true;
};

/// Answer to Pull: one view per requested slice, in request order.
struct PullReply {
  std::int64_t global_step = 0;
  std::vector<std::span<const float>> values;
};

/// Answer to Push: how many of its part gradients were dropped as stale.
struct PushReply {
  std::uint32_t stale_parts = 0;
};

/// Counters of one ps task.
struct Stats {
  std::int64_t global_step = 0;              ///< steps completed (sync) or pushes applied (async)
  std::int64_t updates_applied = 0;          ///< optimizer applications over all parts
  std::int64_t gradients_accepted = 0;       ///< part gradients taken into an accumulator
  std::int64_t stale_gradients_dropped = 0;  ///< part gradients older than the step, dropped
  std::int64_t requests_rejected = 0;        ///< requests answered with an ErrorReply
  std::int64_t bytes_pushed = 0;             ///< gradient payload received
  std::int64_t bytes_pulled = 0;             ///< parameter payload sent
};

/// Answer to GetStats.
struct StatsReply {
  Stats stats;
};

/// Everything a ps task answers.
using Response =
    std::variant<Ack, ErrorReply, PlacementReply, TokenReply, PullReply, PushReply, StatsReply>;

/// Returns the reply of type `T` or throws the Error the server sent.
template <class T>
T expect(Response&& response) {
  if (auto* error = std::get_if<ErrorReply>(&response)) throw Error(error->code, error->message);
  if (auto* reply = std::get_if<T>(&response)) return std::move(*reply);
  throw Error(ErrorCode::kInvalidArgument, "unexpected reply kind from server");
}

}  // namespace pulley
// ---- end pulley/messages.hpp ----

namespace pulley {

/// Where a pull's values go: one destination per requested slice, in request order.
using PullTargets = std::vector<std::span<float>>;

class CallControl;

/// The part of a transport that needs the caller's thread. A transport with no thread of its
/// own (Tcp) moves its I/O forward while its caller waits, and cuts a transfer under way
/// when its caller gives up on it. A transport that answers on threads of its own
/// (InProcess) has no driver.
class CallDriver {
 public:
  /// Runs the transport's I/O until `call` is answered or `deadline` passes.
  virtual void run_until(CallControl& call, std::chrono::steady_clock::time_point deadline) = 0;
  /// `call`'s caller gives up while the transport uses its buffers (see `CallControl::cancel`):
  /// end that use now, e.g. by closing a connection that stalled mid-frame.
  virtual void abort(CallControl& call) = 0;

 protected:
  ~CallDriver() = default;
};

/// What a caller and a transport share about one call: its answer, and whether the caller
/// gave up. A transport derives its per-call state from it (one allocation per call).
///
/// Transport side: `answer` once; bracket every use of the request's views or the pull
/// targets with `begin_use`/`end_use` (or `unless_cancelled`), and begin none after the
/// caller gave up. Caller side: through `PendingCall`.
class CallControl {
 public:
  explicit CallControl(CallDriver* driver = nullptr) noexcept : driver_(driver) {}
  CallControl(const CallControl&) = delete;
  CallControl& operator=(const CallControl&) = delete;

  // ---- transport side ---------------------------------------------------------------------

  /// Starts using the call's buffers unless the caller gave up; pair with `end_use`. A use
  /// may span several asynchronous steps (a gather-write, a scatter-read).
  bool begin_use() {
    std::scoped_lock lock(mutex_);
    if (cancelled_) return false;
    ++users_;
    return true;
  }
  /// Ends a use begun with `begin_use`.
  void end_use() {
    std::scoped_lock lock(mutex_);
    if (--users_ == 0) changed_.notify_all();
  }
  /// Runs `f` inside one use unless the caller gave up; true if it ran. Re-entrant.
  template <class F>
  bool unless_cancelled(F&& f) {
    if (!begin_use()) return false;
    struct End {
      CallControl* c;
      ~End() { c->end_use(); }
    } end{this};
    std::forward<F>(f)();
    return true;
  }
  /// Sets the answer, unless the call has one or its caller gave up; true if this one is it.
  /// Wakes the caller.
  bool answer(Response&& response) {
    std::scoped_lock lock(mutex_);
    if (cancelled_ || answered_) return false;
    response_ = std::move(response);
    answered_ = true;
    changed_.notify_all();
    return true;
  }
  /// True once the call has its answer (and stays true after `take`).
  [[nodiscard]] bool answered() const {
    std::scoped_lock lock(mutex_);
    return answered_;
  }
  /// The transport is going away: it answered every call it held or ended their uses, and
  /// neither waiting nor cancelling may reach it any more.
  void detach_driver() {
    std::scoped_lock lock(mutex_);
    driver_ = nullptr;
  }

  // ---- caller side (use PendingCall) ------------------------------------------------------

  /// Waits until the call is answered or `deadline` passes; true if it is answered. With a
  /// driver, the waiting thread runs the transport's I/O meanwhile.
  bool wait_until(std::chrono::steady_clock::time_point deadline) {
    std::unique_lock lock(mutex_);
    if (answered_) return true;
    if (CallDriver* driver = driver_) {
      lock.unlock();
      driver->run_until(*this, deadline);
      lock.lock();
      return answered_;
    }
    return changed_.wait_until(lock, deadline, [&] { return answered_; });
  }
  /// The answer, once `wait_until` returned true; only once.
  Response take() {
    std::scoped_lock lock(mutex_);
    return std::move(*response_);
  }
  /// Gives the call up: ends a use under way (the driver's `abort`) and waits until no use is
  /// left; afterwards the transport begins none, so the caller may free the request's
  /// buffers and the pull targets. An answer that arrives later is dropped.
  void cancel() {
    CallDriver* driver = nullptr;
    {
      std::scoped_lock lock(mutex_);
      if (cancelled_) return;
      cancelled_ = true;
      if (users_ > 0) driver = driver_;
    }
    if (driver != nullptr) driver->abort(*this);
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return users_ == 0; });
  }

 protected:
  ~CallControl() = default;  // owned through the transport's derived per-call state

 private:
  mutable std::mutex mutex_;
  std::condition_variable changed_;  ///< an answer arrived, or the last use ended
  std::optional<Response> response_;
  CallDriver* driver_;  ///< for the call's whole life: a use may outlast the answer
  int users_ = 0;
  bool answered_ = false;
  bool cancelled_ = false;
};

/// A call in flight, as its caller holds it: the answer to come, and the way to give it up.
/// A call whose transport has a driver (Tcp) is waited on by the thread that uses the
/// transport, while the transport lives.
class PendingCall {
 public:
  using Clock = std::chrono::steady_clock;

  explicit PendingCall(std::shared_ptr<CallControl> control) : control_(std::move(control)) {}

  /// Waits until the answer is there or `deadline` passes; true if it is there.
  bool wait_until(Clock::time_point deadline) { return control_->wait_until(deadline); }
  /// Waits at most `timeout`; true if the answer is there.
  template <class Rep, class Period>
  bool wait_for(std::chrono::duration<Rep, Period> timeout) {
    return wait_until(Clock::now() + timeout);
  }
  /// True if the answer is there, without blocking (a driver handles what already arrived).
  bool ready() { return wait_until(Clock::time_point::min()); }
  /// Waits as long as it takes and returns the answer (only once).
  Response get() {
    while (!wait_until(Clock::now() + std::chrono::hours(1))) {
    }
    return control_->take();
  }
  /// The answer, once `wait_until` or `ready` returned true (only once).
  Response take() { return control_->take(); }
  /// Gives the call up (`CallControl::cancel`): when it returns, the transport no longer
  /// touches the request's buffers or the pull targets.
  void cancel() { control_->cancel(); }

 private:
  std::shared_ptr<CallControl> control_;
};

/// The client side of a transport: how a worker, the chief or an evaluator reaches the ps
/// tasks. The server side is the transport's own serving loop, which hands every request to
/// `ParameterServer::handle` and sends back what it answers.
///
/// Required:
///   - `t.num_ps()` → number of ps tasks
///   - `t.call(ps, request, targets)` → `PendingCall`
///
/// Semantic contract:
///   - `call` never waits for another task (a request that must wait for a token or a step
///     returns a PendingCall that is answered later), so calls to different ps tasks never
///     wait for each other;
///   - a transport may hold a request until its caller waits on any PendingCall, so that
///     requests made together leave together (a push and a pull in one write);
///   - requests from one client to one ps are handled in the order they were made;
///   - for a Pull, the transport copies the reply's values into `targets` (slice by slice)
///     before the call is answered, and the PullReply's views then point into `targets`;
///   - `targets` and every view inside `request` stay valid until the call is answered or
///     the caller has cancelled it; the transport touches neither afterwards;
///   - failures arrive as an ErrorReply answer: `kUnavailable` for a dead or unreachable
///     peer; a lost message leaves the call unanswered, and the caller's deadline turns that
///     into `kDeadlineExceeded` (and a cancel).
template <class T>
concept Transport = std::move_constructible<T> &&
    requires(T& transport, const T& ctransport, std::size_t ps, Request request,
             PullTargets targets) {
  { ctransport.num_ps() } -> std::convertible_to<std::size_t>;
  { transport.call(ps, std::move(request), std::move(targets)) } -> std::same_as<PendingCall>;
};

}  // namespace pulley
// ---- end pulley/concepts/transport.hpp ----
// ---- begin pulley/detail/client.hpp ----

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

// ---- begin pulley/client_options.hpp ----

#include <chrono>

namespace pulley {

/// Deadlines of a client's (worker's, chief's) requests. A request past its deadline fails
/// with `kDeadlineExceeded` and is cancelled: the transport no longer touches its buffers.
struct ClientOptions {
  /// For requests a ps answers at once (push, ungated pull, stats, initialize).
  std::chrono::milliseconds request_timeout{std::chrono::seconds(60)};
  /// For requests that wait on other tasks: readiness, sync tokens, step-gated pulls.
  std::chrono::milliseconds wait_timeout{std::chrono::minutes(30)};
};

}  // namespace pulley
// ---- end pulley/client_options.hpp ----
// ---- begin pulley/detail/finite.hpp ----

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

namespace pulley::detail {

/// True if no element is NaN or Inf: both have an all-ones exponent, so adding one to the
/// exponent field carries into the sign bit exactly for them. Integer ops in 16 independent
/// lanes keep the loop vectorizable (without -ffast-math) and free of a serial dependency:
/// it checks a gradient faster than memcpy copies it, which matters since every push is
/// checked on both sides.
inline bool all_finite(std::span<const float> values) noexcept {
  constexpr std::size_t kLanes = 16;
  constexpr std::uint32_t kExponent = 0x7F800000U;
  constexpr std::uint32_t kExponentOne = 0x00800000U;
  const float* p = values.data();
  const std::size_t n = values.size();
  std::uint32_t lanes[kLanes] = {};
  std::size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (std::size_t l = 0; l < kLanes; ++l) {
      std::uint32_t bits;
      std::memcpy(&bits, p + i + l, sizeof bits);
      lanes[l] |= (bits & kExponent) + kExponentOne;
    }
  }
  std::uint32_t carried = 0;
  for (; i < n; ++i) {
    std::uint32_t bits;
    std::memcpy(&bits, p + i, sizeof bits);
    carried |= (bits & kExponent) + kExponentOne;
  }
  for (std::uint32_t lane : lanes) carried |= lane;
  return (carried & 0x80000000U) == 0;
}

}  // namespace pulley::detail
// ---- end pulley/detail/finite.hpp ----

namespace pulley {

/// One destination of a pull: rows `rows` of variable `variable`, written to `into`.
struct PullRequest {
  std::size_t variable = 0;
  RowRange rows;
  std::span<float> into;
};

namespace detail {

/// What workers, the chief and the evaluator share: the placement, and turning
/// variable-level pulls and pushes into per-ps requests sent concurrently.
template <Transport T>
class Client {
 public:
  Client(T transport, ClientOptions options)
      : transport_(std::move(transport)), options_(options) {}

  [[nodiscard]] std::size_t num_ps() const { return transport_.num_ps(); }
  [[nodiscard]] const Placement& placement() const noexcept { return placement_; }
  [[nodiscard]] const std::vector<VariableSpec>& variables() const noexcept { return variables_; }
  [[nodiscard]] bool has_placement() const noexcept { return !placement_.first_part.empty(); }
  T& transport() noexcept { return transport_; }
  [[nodiscard]] const ClientOptions& options() const noexcept { return options_; }

  /// Index of the variable called `name`; throws kNotFound naming it.
  [[nodiscard]] std::size_t variable_index(std::string_view name) const {
    for (std::size_t i = 0; i < variables_.size(); ++i) {
      if (variables_[i].name == name) return i;
    }
    throw Error(ErrorCode::kNotFound, "unknown variable '" + std::string(name) + "'");
  }

  /// Sends `make_request(ps)` to every ps at once and returns the replies of type R.
  template <class R, class MakeRequest>
  std::vector<R> broadcast(MakeRequest make_request, std::chrono::milliseconds timeout,
                           std::string_view what) {
    std::vector<PendingCall> calls;
    for (std::size_t ps = 0; ps < num_ps(); ++ps) {
      calls.push_back(transport_.call(ps, Request{make_request(ps)}, {}));
    }
    return collect<R>(calls, timeout, what);
  }

  /// Registers the model on every ps and checks that their placements agree.
  void register_model(std::span<const VariableSpec> variables) {
    std::vector<VariableSpec> list(variables.begin(), variables.end());
    adopt(broadcast<PlacementReply>([&](std::size_t) { return Register{list}; },
                                    options_.request_timeout, "register"),
          list);
  }

  /// Waits until every ps is initialized and learns the placement.
  void wait_ready(std::span<const VariableSpec> variables) {
    std::vector<VariableSpec> list(variables.begin(), variables.end());
    adopt(broadcast<PlacementReply>([](std::size_t) { return WaitReady{}; }, options_.wait_timeout,
                                    "wait for initialization"),
          list);
  }

  /// Takes a sync token from ps 0, which keeps the global step.
  TokenReply take_token(std::uint32_t worker) {
    std::vector<PendingCall> calls;
    calls.push_back(transport_.call(0, TakeToken{worker}, {}));
    return collect<TokenReply>(calls, options_.wait_timeout, "take a sync token").front();
  }

  /// Pulls every request's rows into its destination, from all ps tasks at once; no ps
  /// answers before it completed `min_step` steps. Returns the lowest global step the ps
  /// tasks reported: every value pulled is at least that recent.
  std::int64_t pull(std::span<const PullRequest> requests, std::int64_t min_step) {
    std::vector<PendingCall> calls = send_pulls(requests, min_step);
    return lowest_step(collect<PullReply>(calls, pull_timeout(min_step), "pull"));
  }

  /// Pushes the gradients of whole variables (one span per variable, in variable order)
  /// tagged with `local_step`; every ps gets a message, which is its step vote. Returns the
  /// number of part gradients dropped as stale.
  std::uint32_t push(std::uint32_t worker, std::int64_t local_step,
                     std::span<const std::span<const float>> gradients) {
    std::vector<PendingCall> calls = send_pushes(worker, local_step, gradients);
    return stale_parts(collect<PushReply>(calls, options_.request_timeout, "push"));
  }

  /// What push_pull did.
  struct PushPullResult {
    std::uint32_t stale_parts = 0;  ///< part gradients dropped as stale
    std::int64_t pulled_step = 0;   ///< lowest global step of the pulled values
  };

  /// `push`, then `pull` once each ps has completed `min_step` steps, in one round trip:
  /// both requests go out together, and each ps handles the pull after the push (requests
  /// from one client to one ps keep their order).
  PushPullResult push_pull(std::uint32_t worker, std::int64_t local_step,
                           std::span<const std::span<const float>> gradients,
                           std::span<const PullRequest> requests, std::int64_t min_step) {
    std::vector<PendingCall> pushes = send_pushes(worker, local_step, gradients);
    std::vector<PendingCall> pulls;
    std::vector<std::optional<Response>> pushed(pushes.size());
    try {
      pulls = send_pulls(requests, min_step);
      std::vector<std::optional<Response>> pulled(pulls.size());
      // Each ps answers the pull after the push, so the pulls are awaited: one wake-up of
      // this thread, not two. Meanwhile every 50 ms the answers so far are looked at, since
      // a refused push (or a dead ps) leaves a pull waiting for a step that never comes.
      const auto timeout = pull_timeout(min_step);
      const auto deadline = std::chrono::steady_clock::now() + timeout;
      while (!take_answers<PullReply>(pulls, pulled)) {
        take_answers<PushReply>(pushes, pushed);
        const auto now = std::chrono::steady_clock::now();
        if (now >= deadline) {
          throw Error(ErrorCode::kDeadlineExceeded,
                      "pull: no answer within " + std::to_string(timeout.count()) + " ms");
        }
        const auto waiting =
            std::find_if(pulled.begin(), pulled.end(), [](const auto& answer) { return !answer; });
        pulls[static_cast<std::size_t>(waiting - pulled.begin())].wait_until(
            std::min(deadline, now + std::chrono::milliseconds(50)));
      }
      PushPullResult result;
      result.pulled_step = std::numeric_limits<std::int64_t>::max();
      for (auto& answer : pulled) {
        result.pulled_step = std::min(result.pulled_step, std::get<PullReply>(*answer).global_step);
      }
      if (pulled.empty()) result.pulled_step = 0;
      const auto push_deadline = std::chrono::steady_clock::now() + options_.request_timeout;
      for (std::size_t i = 0; i < pushes.size(); ++i) {
        if (!pushed[i]) pushes[i].wait_until(push_deadline);
      }
      if (!take_answers<PushReply>(pushes, pushed)) {
        throw Error(
            ErrorCode::kDeadlineExceeded,
            "push: no answer within " + std::to_string(options_.request_timeout.count()) + " ms");
      }
      for (auto& answer : pushed) result.stale_parts += std::get<PushReply>(*answer).stale_parts;
      return result;
    } catch (...) {  // no call may outlive the gradients or the pull targets
      for (PendingCall& c : pulls) c.cancel();
      for (PendingCall& c : pushes) c.cancel();
      throw;
    }
  }

  /// Current values of every variable, pulled from every ps at once.
  std::vector<std::vector<float>> read_variables() {
    std::vector<std::vector<float>> values;
    std::vector<PullRequest> requests;
    values.reserve(variables_.size());
    for (std::size_t v = 0; v < variables_.size(); ++v) {
      values.emplace_back(variables_[v].size());
      requests.push_back({v, {0, variables_[v].rows()}, values.back()});
    }
    pull(requests, 0);
    return values;
  }

  /// Blocks until ps 0 (which keeps the global step) has completed `step` steps; returns
  /// the global step it reports.
  std::int64_t wait_for_step(std::int64_t step) {
    std::vector<PendingCall> calls;
    calls.push_back(transport_.call(0, Pull{step, {}}, {}));
    return collect<PullReply>(calls, options_.wait_timeout, "wait for step").front().global_step;
  }

  /// Counters of every ps task, by task index.
  std::vector<Stats> stats() {
    std::vector<Stats> all;
    for (auto& r : broadcast<StatsReply>([](std::size_t) { return GetStats{}; },
                                         options_.request_timeout, "stats")) {
      all.push_back(r.stats);
    }
    return all;
  }

  /// Waits for every call (one shared deadline) and returns their replies as R, in order.
  /// Never returns or throws while a call may still touch the caller's buffers: at the
  /// deadline, or at the first error (a dead ps need not wait for the others' answers), the
  /// unfinished calls are cancelled first.
  template <class R>
  std::vector<R> collect(std::vector<PendingCall>& calls, std::chrono::milliseconds timeout,
                         std::string_view what) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::vector<R> replies;
    replies.reserve(calls.size());
    try {
      for (PendingCall& call : calls) {
        if (!call.wait_until(deadline)) {
          throw Error(ErrorCode::kDeadlineExceeded, std::string(what) + ": no answer within " +
                                                        std::to_string(timeout.count()) + " ms");
        }
        replies.push_back(expect<R>(call.take()));
      }
    } catch (...) {
      for (PendingCall& c : calls) c.cancel();
      throw;
    }
    return replies;
  }

 private:
  /// Takes the answers that have arrived into `answers`; true once all have. Throws the first
  /// error among them, or a reply of another kind than R.
  template <class R>
  static bool take_answers(std::vector<PendingCall>& calls,
                           std::vector<std::optional<Response>>& answers) {
    bool all = true;
    for (std::size_t i = 0; i < calls.size(); ++i) {
      if (!answers[i] && calls[i].ready()) {
        answers[i] = calls[i].take();
        if (const auto* e = std::get_if<ErrorReply>(&*answers[i])) throw Error(e->code, e->message);
        if (!std::holds_alternative<R>(*answers[i])) {
          throw Error(ErrorCode::kInvalidArgument, "unexpected reply kind from server");
        }
      }
      all = all && answers[i].has_value();
    }
    return all;
  }

  /// Sends each ps its share of `requests` (checked against the variables' shapes).
  std::vector<PendingCall> send_pulls(std::span<const PullRequest> requests,
                                      std::int64_t min_step) {
    std::vector<Pull> pulls(num_ps(), Pull{min_step, {}});
    std::vector<PullTargets> targets(num_ps());
    for (const PullRequest& r : requests) {
      const VariableSpec& spec = checked_variable(r.variable);
      if (r.rows.empty() || r.rows.end > spec.rows() ||
          r.into.size() != r.rows.size() * spec.row_size()) {
        throw Error(ErrorCode::kInvalidArgument,
                    "pull of '" + spec.name + "' rows [" + std::to_string(r.rows.begin) + ", " +
                        std::to_string(r.rows.end) + ") into " + std::to_string(r.into.size()) +
                        " floats does not fit its shape");
      }
      for (const Part& part : placement_.parts_of(r.variable)) {
        const std::size_t begin = std::max(part.rows.begin, r.rows.begin);
        const std::size_t end = std::min(part.rows.end, r.rows.end);
        if (begin >= end) continue;
        pulls[part.ps].slices.push_back({global_index(part), {begin, end}});
        targets[part.ps].push_back(r.into.subspan((begin - r.rows.begin) * spec.row_size(),
                                                  (end - begin) * spec.row_size()));
      }
    }
    std::vector<PendingCall> calls;
    for (std::size_t ps = 0; ps < num_ps(); ++ps) {
      if (pulls[ps].slices.empty()) continue;
      calls.push_back(transport_.call(ps, std::move(pulls[ps]), std::move(targets[ps])));
    }
    return calls;
  }

  /// Sends every ps the gradients of the parts it holds (checked: one finite gradient of the
  /// right size per variable, before anything is sent).
  std::vector<PendingCall> send_pushes(std::uint32_t worker, std::int64_t local_step,
                                       std::span<const std::span<const float>> gradients) {
    if (gradients.size() != variables_.size()) {
      throw Error(ErrorCode::kInvalidArgument, "push needs one gradient per variable");
    }
    std::vector<Push> pushes(num_ps(), Push{worker, local_step, {}, /*finite_checked=*/true});
    for (const Part& part : placement_.parts) {
      const std::size_t row_size = variables_[part.variable].row_size();
      const std::span<const float> g = gradients[part.variable];
      if (g.size() != variables_[part.variable].size()) {
        throw Error(ErrorCode::kInvalidArgument,
                    "gradient of '" + variables_[part.variable].name + "' has " +
                        std::to_string(g.size()) + " elements, expected " +
                        std::to_string(variables_[part.variable].size()));
      }
      pushes[part.ps].gradients.push_back(
          {global_index(part), g.subspan(part.rows.begin * row_size, part.rows.size() * row_size)});
    }
    // Checked here, before anything is sent: a push refused by one ps but applied by another
    // would leave the ps tasks on different steps.
    for (std::size_t v = 0; v < gradients.size(); ++v) {
      if (!detail::all_finite(gradients[v])) {
        throw Error(ErrorCode::kInvalidArgument, "non-finite (NaN or Inf) gradient for '" +
                                                     variables_[v].name + "'; nothing was pushed");
      }
    }
    std::vector<PendingCall> calls;
    for (std::size_t ps = 0; ps < num_ps(); ++ps) {
      calls.push_back(transport_.call(ps, std::move(pushes[ps]), {}));
    }
    return calls;
  }

  std::chrono::milliseconds pull_timeout(std::int64_t min_step) const {
    return min_step > 0 ? options_.wait_timeout : options_.request_timeout;
  }

  static std::int64_t lowest_step(const std::vector<PullReply>& replies) {
    std::int64_t step = std::numeric_limits<std::int64_t>::max();
    for (const PullReply& r : replies) step = std::min(step, r.global_step);
    return replies.empty() ? 0 : step;
  }

  static std::uint32_t stale_parts(const std::vector<PushReply>& replies) {
    std::uint32_t stale = 0;
    for (const PushReply& r : replies) stale += r.stale_parts;
    return stale;
  }

  const VariableSpec& checked_variable(std::size_t v) const {
    if (!has_placement()) {
      throw Error(ErrorCode::kFailedPrecondition, "no placement yet: call wait_ready() first");
    }
    if (v >= variables_.size()) {
      throw Error(ErrorCode::kNotFound, "unknown variable index " + std::to_string(v));
    }
    return variables_[v];
  }

  std::uint32_t global_index(const Part& part) const {
    return static_cast<std::uint32_t>(&part - placement_.parts.data());
  }

  void adopt(std::vector<PlacementReply> replies, std::vector<VariableSpec>& variables) {
    for (std::size_t ps = 1; ps < replies.size(); ++ps) {
      if (!(replies[ps].placement == replies[0].placement)) {
        throw Error(ErrorCode::kFailedPrecondition,
                    "ps 0 and ps " + std::to_string(ps) +
                        " place the variables differently: are they configured with the same "
                        "sharding policy and number of ps tasks?");
      }
    }
    if (replies.empty()) throw Error(ErrorCode::kInvalidArgument, "the cluster has no ps task");
    const auto& registered = replies[0].variables;
    if (registered.size() != variables.size()) {
      throw Error(ErrorCode::kFailedPrecondition,
                  "the ps tasks hold " + std::to_string(registered.size()) +
                      " variables but this model has " + std::to_string(variables.size()));
    }
    for (std::size_t v = 0; v < variables.size(); ++v) {
      if (!(registered[v] == variables[v])) {
        throw Error(ErrorCode::kFailedPrecondition,
                    "variable " + std::to_string(v) + " of this model ('" + variables[v].name +
                        "') differs from the one the chief registered ('" + registered[v].name +
                        "'): name, shape and initializer must match");
      }
    }
    placement_ = std::move(replies[0].placement);
    variables_ = std::move(variables);
  }

  T transport_;
  ClientOptions options_;
  Placement placement_;
  std::vector<VariableSpec> variables_;
};

}  // namespace detail
}  // namespace pulley
// ---- end pulley/detail/client.hpp ----
// ---- begin pulley/initializers.hpp ----

#include <cmath>
#include <cstdint>
#include <numbers>
#include <span>
#include <string_view>

namespace pulley {

/// A small, fast, portable generator (SplitMix64). Unlike the standard distributions,
/// whose output differs between standard libraries, the values below depend only on the
/// seed, so a seeded run initializes identically everywhere.
class SplitMix64 {
 public:
  explicit constexpr SplitMix64(std::uint64_t seed) noexcept : state_(seed) {}

  constexpr std::uint64_t next() noexcept {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30U)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27U)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31U);
  }
  /// Uniform in [0, 1), 53 random bits.
  constexpr double uniform() noexcept { return static_cast<double>(next() >> 11U) * 0x1.0p-53; }

 private:
  std::uint64_t state_;
};

/// FNV-1a hash of a variable name: mixes the name into the seed, so a variable's initial
/// values do not change when other variables are added or reordered.
constexpr std::uint64_t name_hash(std::string_view name) noexcept {
  std::uint64_t h = 0xCBF29CE484222325ULL;
  for (char c : name) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001B3ULL;
  }
  return h;
}

/// Fills `values` (which has `spec.size()` elements) as `spec.initializer` says, from
/// `seed` and the variable's name.
inline void initialize(const VariableSpec& spec, std::uint64_t seed, std::span<float> values) {
  SplitMix64 rng(seed ^ name_hash(spec.name));
  const Initializer& init = spec.initializer;
  auto uniform = [&](double limit) {
    for (float& v : values) v = static_cast<float>((2.0 * rng.uniform() - 1.0) * limit);
  };
  switch (init.kind) {
    case Initializer::Kind::kZeros:
      for (float& v : values) v = 0.0F;
      break;
    case Initializer::Kind::kConstant:
      for (float& v : values) v = init.value;
      break;
    case Initializer::Kind::kUniform:
      uniform(init.value);
      break;
    case Initializer::Kind::kNormal:
      for (float& v : values) {  // Box–Muller; 1 - u keeps the log finite
        const double r = std::sqrt(-2.0 * std::log(1.0 - rng.uniform()));
        v = static_cast<float>(init.value * r * std::cos(2.0 * std::numbers::pi * rng.uniform()));
      }
      break;
    case Initializer::Kind::kGlorotUniform: {
      // fan_in is the first dimension, fan_out the product of the rest (Keras' rule for a
      // Dense kernel [in, out]); a vector counts as fan_in = fan_out = its length.
      const double fan_in = static_cast<double>(spec.rows());
      const double fan_out = spec.shape.size() > 1 ? static_cast<double>(spec.row_size()) : fan_in;
      uniform(std::sqrt(6.0 / (fan_in + fan_out)));
      break;
    }
  }
}

}  // namespace pulley
// ---- end pulley/initializers.hpp ----

namespace pulley {

/// The chief task: registers the model with the ps tasks, initializes every variable from a
/// seed, releases the workers (the ps tasks turn ready), reads variables back for
/// evaluation and checkpoints, and shuts the cluster down at the end.
///
/// @tparam T the Transport that reaches the ps tasks
template <Transport T>
class Chief {
 public:
  /// @param seed initial values depend only on it and the variables' names
  Chief(T transport, std::uint64_t seed, ClientOptions options = {})
      : seed_(seed), client_(std::move(transport), options) {}

  /// Registers `variables`, fills them with their initializers and sends the values to the
  /// ps tasks that hold them. When it returns, every ps is ready and workers proceed.
  const Placement& initialize(std::span<const VariableSpec> variables) {
    std::vector<std::vector<float>> values;
    values.reserve(variables.size());
    for (const VariableSpec& spec : variables) {
      values.emplace_back(spec.size());
      pulley::initialize(spec, seed_, values.back());
    }
    return initialize(variables, values);
  }

  /// Same with explicit initial values, one vector per variable (e.g. a restored checkpoint).
  const Placement& initialize(std::span<const VariableSpec> variables,
                              std::span<const std::vector<float>> values) {
    if (values.size() != variables.size()) {
      throw Error(ErrorCode::kInvalidArgument, "initialize needs one value vector per variable");
    }
    for (std::size_t v = 0; v < variables.size(); ++v) {
      if (values[v].size() != variables[v].size()) {
        throw Error(ErrorCode::kInvalidArgument, "initial value of '" + variables[v].name +
                                                     "' has " + std::to_string(values[v].size()) +
                                                     " elements, expected " +
                                                     std::to_string(variables[v].size()));
      }
    }
    client_.register_model(variables);
    const Placement& placement = client_.placement();
    std::vector<Initialize> messages(client_.num_ps());
    for (const Part& part : placement.parts) {
      const std::size_t row_size = variables[part.variable].row_size();
      messages[part.ps].parts.push_back(
          {static_cast<std::uint32_t>(&part - placement.parts.data()),
           std::span<const float>(values[part.variable])
               .subspan(part.rows.begin * row_size, part.rows.size() * row_size)});
    }
    client_.template broadcast<Ack>([&](std::size_t ps) { return std::move(messages[ps]); },
                                    timeouts().request_timeout, "initialize");
    return placement;
  }

  /// Current values of every variable (a consistent snapshot in sync mode only if no step
  /// completes meanwhile; see `wait_for_step`).
  std::vector<std::vector<float>> read_variables() { return client_.read_variables(); }

  /// Blocks until ps 0 (which keeps the global step) has completed `step` steps; returns
  /// the global step it reports.
  std::int64_t wait_for_step(std::int64_t step) { return client_.wait_for_step(step); }

  /// Counters of every ps task, by task index.
  std::vector<Stats> stats() { return client_.stats(); }

  /// Stops every ps task; requests still waiting there are cancelled.
  void shutdown() {
    client_.template broadcast<Ack>([](std::size_t) { return Shutdown{}; },
                                    timeouts().request_timeout, "shutdown");
  }

  /// Where each variable lives, after `initialize`.
  [[nodiscard]] const Placement& placement() const noexcept { return client_.placement(); }
  /// The registered variables, after `initialize`.
  [[nodiscard]] const std::vector<VariableSpec>& variables() const noexcept {
    return client_.variables();
  }

 private:
  [[nodiscard]] const ClientOptions& timeouts() const { return client_.options(); }

  std::uint64_t seed_;
  detail::Client<T> client_;
};

}  // namespace pulley
// ---- end pulley/chief.hpp ----
// ---- begin pulley/cluster_spec.hpp ----

#include <cstdint>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

// ---- begin pulley/detail/json.hpp ----

#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace pulley::detail {

/// A JSON value: just enough JSON to read small configuration documents (TF_CONFIG).
struct Json {
  using Object = std::map<std::string, Json, std::less<>>;
  using Array = std::vector<Json>;
  std::variant<std::nullptr_t, bool, double, std::string, Array, Object> value;

  [[nodiscard]] const Object* object() const { return std::get_if<Object>(&value); }
  [[nodiscard]] const Array* array() const { return std::get_if<Array>(&value); }
  [[nodiscard]] const std::string* string() const { return std::get_if<std::string>(&value); }
  [[nodiscard]] const double* number() const { return std::get_if<double>(&value); }
};

/// Parses `text` as one JSON document; throws kInvalidArgument with the byte offset.
class JsonReader {
 public:
  explicit JsonReader(std::string_view text) : text_(text) {}

  Json document() {
    Json v = value(0);
    skip_space();
    if (pos_ != text_.size()) fail("trailing characters");
    return v;
  }

 private:
  static constexpr int kMaxDepth = 64;

  [[noreturn]] void fail(const std::string& what) const {
    throw Error(ErrorCode::kInvalidArgument,
                "invalid JSON at byte " + std::to_string(pos_) + ": " + what);
  }
  void skip_space() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\n' ||
                                   text_[pos_] == '\r' || text_[pos_] == '\t')) {
      ++pos_;
    }
  }
  bool eat(char c) {
    skip_space();
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!eat(c)) fail(std::string("expected '") + c + "'");
  }
  bool literal(std::string_view word) {
    if (text_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }

  Json value(int depth) {
    if (depth > kMaxDepth) fail("nested too deeply");
    skip_space();
    if (pos_ >= text_.size()) fail("unexpected end");
    const char c = text_[pos_];
    if (c == '{') return object(depth);
    if (c == '[') return array(depth);
    if (c == '"') return {string()};
    if (literal("true")) return {true};
    if (literal("false")) return {false};
    if (literal("null")) return {nullptr};
    if (c == '-' || (c >= '0' && c <= '9')) return {number()};
    fail(std::string("unexpected '") + c + "'");
  }

  Json object(int depth) {
    ++pos_;
    Json::Object members;
    if (eat('}')) return {std::move(members)};
    do {
      skip_space();
      if (pos_ >= text_.size() || text_[pos_] != '"') fail("expected a member name");
      std::string key = string();
      expect(':');
      members.insert_or_assign(std::move(key), value(depth + 1));
    } while (eat(','));
    expect('}');
    return {std::move(members)};
  }

  Json array(int depth) {
    ++pos_;
    Json::Array items;
    if (eat(']')) return {std::move(items)};
    do {
      items.push_back(value(depth + 1));
    } while (eat(','));
    expect(']');
    return {std::move(items)};
  }

  std::string string() {
    ++pos_;  // opening quote
    std::string out;
    while (pos_ < text_.size() && text_[pos_] != '"') {
      char c = text_[pos_++];
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string");
      if (c == '\\') {
        if (pos_ >= text_.size()) fail("unterminated escape");
        switch (c = text_[pos_++]) {
          case '"':
          case '\\':
          case '/':
            out += c;
            break;
          case 'b':
            out += '\b';
            break;
          case 'f':
            out += '\f';
            break;
          case 'n':
            out += '\n';
            break;
          case 'r':
            out += '\r';
            break;
          case 't':
            out += '\t';
            break;
          case 'u': {
            if (pos_ + 4 > text_.size()) fail("short \\u escape");
            unsigned code = 0;
            for (int k = 0; k < 4; ++k) {
              const char h = text_[pos_++];
              const int digit = h >= '0' && h <= '9'   ? h - '0'
                                : h >= 'a' && h <= 'f' ? h - 'a' + 10
                                : h >= 'A' && h <= 'F' ? h - 'A' + 10
                                                       : -1;
              if (digit < 0) fail("bad \\u escape");
              code = code * 16 + static_cast<unsigned>(digit);
            }
            if (code >= 0x80) fail("only ASCII \\u escapes are supported");
            out += static_cast<char>(code);
            break;
          }
          default:
            fail("unknown escape");
        }
      } else {
        out += c;
      }
    }
    if (pos_ >= text_.size()) fail("unterminated string");
    ++pos_;
    return out;
  }

  double number() {
    const std::size_t start = pos_;
    if (text_[pos_] == '-') ++pos_;
    while (pos_ < text_.size() &&
           std::string_view("0123456789.eE+-").find(text_[pos_]) != std::string_view::npos) {
      ++pos_;
    }
    try {
      std::size_t used = 0;
      const std::string digits(text_.substr(start, pos_ - start));
      const double v = std::stod(digits, &used);
      if (used != digits.size()) fail("malformed number");
      return v;
    } catch (const std::logic_error&) {
      fail("malformed number");
    }
  }

  std::string_view text_;
  std::size_t pos_ = 0;
};

}  // namespace pulley::detail
// ---- end pulley/detail/json.hpp ----

namespace pulley {

/// The jobs of a cluster and their tasks' addresses ("host:port"), as TensorFlow's
/// `ClusterSpec`: {"chief": [...], "worker": [...], "ps": [...], "evaluator": [...]}.
struct ClusterSpec {
  std::map<std::string, std::vector<std::string>, std::less<>> jobs;

  /// Addresses of `job`'s tasks (empty if the job is absent).
  [[nodiscard]] const std::vector<std::string>& tasks(std::string_view job) const {
    static const std::vector<std::string> kNone;
    auto it = jobs.find(job);
    return it == jobs.end() ? kNone : it->second;
  }
};

/// Which task this process is: a job name and an index into it.
struct TaskSpec {
  std::string type;
  std::uint32_t index = 0;
};

/// A parsed TF_CONFIG document.
struct TfConfig {
  ClusterSpec cluster;
  TaskSpec task;
};

/// The job names pulley knows; "master" is TensorFlow's old name for the chief.
inline constexpr std::string_view kJobNames[] = {"chief", "worker", "ps", "evaluator", "master"};

/// Parses a TF_CONFIG document in TensorFlow's exact format,
///   {"cluster": {"chief": ["host:port"], "worker": [...], "ps": [...]},
///    "task": {"type": "worker", "index": 1}}
/// and checks it: known job names, "host:port" addresses with a port in 1..65535, a task
/// whose type is a job of the cluster and whose index is in range. An evaluator need not be
/// listed in the cluster (TensorFlow does not list it). Throws kInvalidArgument naming the
/// problem.
inline TfConfig parse_tf_config(std::string_view text) {
  auto fail = [](const std::string& what) -> Error {
    return Error(ErrorCode::kInvalidArgument, "TF_CONFIG: " + what);
  };
  const detail::Json doc = detail::JsonReader(text).document();
  const auto* root = doc.object();
  if (root == nullptr) throw fail("not a JSON object");

  TfConfig config;
  auto cluster = root->find("cluster");
  if (cluster == root->end() || cluster->second.object() == nullptr) {
    throw fail("needs a \"cluster\" object");
  }
  for (const auto& [job, tasks] : *cluster->second.object()) {
    bool known = false;
    for (std::string_view name : kJobNames) known = known || job == name;
    if (!known) throw fail("unknown job type \"" + job + "\" (chief, worker, ps, evaluator)");
    if (tasks.array() == nullptr) throw fail("job \"" + job + "\" must list addresses");
    auto& addresses = config.cluster.jobs[job == "master" ? "chief" : job];
    for (const detail::Json& t : *tasks.array()) {
      const std::string* address = t.string();
      const auto colon = address ? address->rfind(':') : std::string::npos;
      const std::string port = colon == std::string::npos ? "" : address->substr(colon + 1);
      const bool digits = !port.empty() && port.size() <= 5 &&
                          port.find_first_not_of("0123456789") == std::string::npos;
      const long p = digits ? std::stol(port) : 0;
      if (address == nullptr || colon == 0 || !digits || p < 1 || p > 65535) {
        throw fail("job \"" + job + "\" has an address that is not \"host:port\"" +
                   (address ? ": \"" + *address + "\"" : std::string()));
      }
      addresses.push_back(*address);
    }
  }

  auto task = root->find("task");
  if (task == root->end() || task->second.object() == nullptr) {
    throw fail("needs a \"task\" object naming this process's type and index");
  }
  const auto& t = *task->second.object();
  auto type = t.find("type");
  auto index = t.find("index");
  if (type == t.end() || type->second.string() == nullptr) throw fail("task needs a \"type\"");
  config.task.type = *type->second.string() == "master" ? "chief" : *type->second.string();
  const double* i = index == t.end() ? nullptr : index->second.number();
  if (index != t.end() && (i == nullptr || *i < 0 || *i > 4294967295.0 ||
                           *i != static_cast<double>(static_cast<std::uint32_t>(*i)))) {
    throw fail("task \"index\" must be a non-negative integer");
  }
  config.task.index = i ? static_cast<std::uint32_t>(*i) : 0;
  const auto& tasks = config.cluster.tasks(config.task.type);
  const bool listed = config.cluster.jobs.contains(config.task.type);
  if (!listed && config.task.type != "evaluator") {
    throw fail("task type \"" + config.task.type + "\" is not a job of the cluster");
  }
  if (listed && config.task.index >= tasks.size()) {
    throw fail("task index " + std::to_string(config.task.index) + " is out of range: job \"" +
               config.task.type + "\" has " + std::to_string(tasks.size()) + " task(s)");
  }
  if (config.cluster.tasks("ps").empty()) throw fail("the cluster has no \"ps\" job");
  return config;
}

/// Reads and parses the TF_CONFIG environment variable; nullopt when it is unset or empty.
inline std::optional<TfConfig> tf_config_from_environment() {
  const char* text = std::getenv("TF_CONFIG");
  if (text == nullptr || *text == '\0') return std::nullopt;
  return parse_tf_config(text);
}

}  // namespace pulley
// ---- end pulley/cluster_spec.hpp ----
// ---- begin pulley/concepts/model.hpp ----

#include <concepts>
#include <cstddef>
#include <span>

namespace pulley {

/// A model a worker trains: it declares its variables, owns their local copies and computes
/// gradients on a batch.
///
/// Required:
///   - `typename M::Batch`
///   - `m.variables()` → the variable specs, in a fixed order (a range of VariableSpec)
///   - `m.parameter(i)` → `std::span<float>` over variable i's local copy (row-major); the
///     worker pulls into it
///   - `m.gradient(i)` → `std::span<const float>` over the gradient of variable i from the
///     last `compute_gradients`; the worker pushes from it
///   - `m.compute_gradients(batch)` → the batch's mean loss (convertible to float)
///
/// Semantic contract:
///   - `variables()` is the same on every worker and the chief for the same configuration;
///   - `parameter(i)` and `gradient(i)` have `variables()[i].size()` elements and stay at the
///     same address for the model's lifetime (pull and push use them in place);
///   - the gradient is of the batch's mean loss, so averaging R gradients is averaging losses.
template <class M>
concept Model = requires(M& model, const M& cmodel, std::size_t i, const typename M::Batch& batch) {
  typename M::Batch;
  { cmodel.variables() } -> std::convertible_to<std::span<const VariableSpec>>;
  { model.parameter(i) } -> std::same_as<std::span<float>>;
  { cmodel.gradient(i) } -> std::same_as<std::span<const float>>;
  { model.compute_gradients(batch) } -> std::convertible_to<float>;
};

}  // namespace pulley
// ---- end pulley/concepts/model.hpp ----
// ---- begin pulley/concepts/optimizer.hpp ----

#include <concepts>
#include <cstddef>
#include <span>

namespace pulley {

/// An optimizer: a small value type holding hyper-parameters, plus a per-part `State`
/// (slots such as momentum or Adam's moments) that the ps keeps beside the part it updates.
///
/// Required:
///   - `typename O::State`
///   - `o.make_state(n)` → `O::State` for a part of `n` elements
///   - `o.apply(state, weights, gradient)` updates `weights` in place
///
/// Semantic contract (the compiler cannot check it):
///   - `apply` is called once per global step (sync) or once per accepted push (async) for
///     each part, with `weights.size() == gradient.size() == n` of the `make_state(n)` call;
///   - it is deterministic: the same state, weights and gradient give the same result;
///   - it is element-wise or at least part-local: a variable split over several ps tasks is
///     updated part by part, so a rule that needs the whole variable (a global norm) does
///     not belong here;
///   - the optimizer object is shared by all parts and is never modified after construction
///     (`apply` is const); everything that changes lives in `State`.
template <class O>
concept Optimizer = std::copy_constructible<O> &&
    requires(const O& optimizer, typename O::State& state, std::span<float> weights,
             std::span<const float> gradient, std::size_t n) {
  typename O::State;
  { optimizer.make_state(n) } -> std::same_as<typename O::State>;
  { optimizer.apply(state, weights, gradient) } -> std::same_as<void>;
};

}  // namespace pulley
// ---- end pulley/concepts/optimizer.hpp ----
// ---- begin pulley/concepts/sharding.hpp ----

#include <concepts>
#include <cstddef>
#include <span>

namespace pulley {

/// A sharding policy decides which ps task holds which rows of which variable.
///
/// Required:
///   - `s.place(variables, num_ps)` → `Placement`
///
/// Semantic contract:
///   - `place` is pure and deterministic: every ps task computes the placement itself and
///     the chief checks that they all agree, so the same input must give the same output
///     on every process;
///   - for every variable, its parts are listed in row order and cover its rows exactly
///     once with non-empty ranges, and every part's `ps` is below `num_ps` (the server
///     checks this and refuses the model otherwise).
template <class S>
concept Sharding = std::copy_constructible<S> &&
    requires(const S& sharding, std::span<const VariableSpec> variables, std::size_t num_ps) {
  { sharding.place(variables, num_ps) } -> std::same_as<Placement>;
};

}  // namespace pulley
// ---- end pulley/concepts/sharding.hpp ----
// ---- begin pulley/concepts/sync_policy.hpp ----

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>

namespace pulley {

/// What an accumulator did with one contribution.
enum class Verdict : std::uint8_t {
  kStale,    ///< older than the accumulator's step: dropped, never applied
  kPending,  ///< kept; the step needs more contributions
  kReady,    ///< kept, and the step is complete: call `take`
};

/// How a sync policy paces workers with tokens (TF's `sync_token_queue`). A worker takes a
/// token before each step and tags its push with the token's step. When step 0 starts and
/// each time a global step completes, `per_step` tokens of the new step are released,
/// replacing any of the old step that nobody took (those could only buy stale gradients).
struct TokenRule {
  std::int64_t per_step = 0;    ///< tokens per step; 0: no tokens, TakeToken never waits
  std::int64_t per_worker = 0;  ///< most tokens of one step a worker may take; 0: no limit
};

/// An aggregation (sync) policy decides when gradients are applied and how workers are
/// paced. The ps keeps one `Accumulator` per part it holds plus one, of size 0, for the
/// global step: every push message is a vote on that one.
///
/// Required:
///   - `typename P::Accumulator`
///   - `p.make_accumulator(n)` → an accumulator for `n`-element gradients, at step 0
///   - `p.accumulate(acc, gradient, local_step)` → `Verdict`
///   - `p.take(acc)` → the aggregated gradient to apply; advances `acc` by one step
///   - `p.step(acc)` → the steps `acc` has completed
///   - `p.token_rule()` → `TokenRule`: how workers are paced with sync tokens
///
/// Semantic contract:
///   - a contribution with `local_step < step(acc)` is stale: `accumulate` returns kStale and
///     leaves `acc` unchanged;
///   - `take` is called exactly once after each kReady, before the next `accumulate`; the
///     span it returns stays valid until then and may alias the last gradient passed in;
///   - `accumulate` may keep a view of `gradient` only until the next `take`;
///   - the policy object is never modified after construction.
template <class P>
concept SyncPolicy = std::copy_constructible<P> &&
    requires(const P& policy, typename P::Accumulator& acc, const typename P::Accumulator& cacc,
             std::span<const float> gradient, std::int64_t local_step, std::size_t n) {
  typename P::Accumulator;
  { policy.make_accumulator(n) } -> std::same_as<typename P::Accumulator>;
  { policy.accumulate(acc, gradient, local_step) } -> std::same_as<Verdict>;
  { policy.take(acc) } -> std::same_as<std::span<const float>>;
  { policy.step(cacc) } -> std::same_as<std::int64_t>;
  { policy.token_rule() } -> std::same_as<TokenRule>;
};

}  // namespace pulley
// ---- end pulley/concepts/sync_policy.hpp ----
// ---- begin pulley/evaluator.hpp ----

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace pulley {

/// The evaluator task: follows training without taking part in it. It waits for the chief's
/// initialization, then for chosen global steps, and reads parameter snapshots to score on
/// held-out data. It takes no tokens and pushes nothing, so it never slows a sync step.
///
/// @tparam T the Transport that reaches the ps tasks
template <Transport T>
class Evaluator {
 public:
  explicit Evaluator(T transport, ClientOptions options = {})
      : client_(std::move(transport), options) {}

  /// Blocks until the chief has initialized every ps and checks that `variables` (the
  /// evaluator's model) are the registered ones.
  void wait_ready(std::span<const VariableSpec> variables) { client_.wait_ready(variables); }

  /// Blocks until `step` global steps are done; returns the global step ps 0 reports.
  std::int64_t wait_for_step(std::int64_t step) { return client_.wait_for_step(step); }

  /// Current values of every variable, one vector per variable.
  std::vector<std::vector<float>> read_variables() { return client_.read_variables(); }

  /// Counters of every ps task, by task index.
  std::vector<Stats> stats() { return client_.stats(); }

 private:
  detail::Client<T> client_;
};

}  // namespace pulley
// ---- end pulley/evaluator.hpp ----
// ---- begin pulley/node.hpp ----

#include <compare>
#include <cstdint>
#include <string>

namespace pulley {

/// A task of the cluster, named as in TF_CONFIG: a job ("ps", "worker", "chief",
/// "evaluator") and an index inside it.
struct Node {
  enum class Job : std::uint8_t { kPs, kWorker, kChief, kEvaluator };
  Job job = Job::kWorker;
  std::uint32_t index = 0;

  static constexpr Node ps(std::uint32_t i) noexcept { return {Job::kPs, i}; }
  static constexpr Node worker(std::uint32_t i) noexcept { return {Job::kWorker, i}; }
  static constexpr Node chief() noexcept { return {Job::kChief, 0}; }
  static constexpr Node evaluator() noexcept { return {Job::kEvaluator, 0}; }

  /// "ps:1", "worker:0", ...
  [[nodiscard]] std::string name() const {
    constexpr const char* jobs[] = {"ps", "worker", "chief", "evaluator"};
    return std::string(jobs[static_cast<int>(job)]) + ":" + std::to_string(index);
  }

  friend constexpr auto operator<=>(const Node&, const Node&) = default;
};

}  // namespace pulley
// ---- end pulley/node.hpp ----
// ---- begin pulley/optimizers/adagrad.hpp ----

#include <cmath>
#include <cstddef>
#include <span>
#include <vector>

namespace pulley {

/// Adagrad with Keras' defaults and rule:
///   accumulator += g^2
///   w -= learning_rate * g / (sqrt(accumulator) + epsilon)
struct Adagrad {
  float learning_rate = 0.001F;            ///< step size
  float initial_accumulator_value = 0.1F;  ///< starting sum of squares
  float epsilon = 1e-7F;                   ///< keeps the division finite

  /// The sum of squared gradients, one value per element.
  struct State {
    std::vector<float> accumulator;
  };

  /// Fresh slots for a part of n elements.
  [[nodiscard]] State make_state(std::size_t n) const {
    return {std::vector<float>(n, initial_accumulator_value)};
  }

  /// Updates `w` in place from gradient `g` (same size as the state).
  void apply(State& state, std::span<float> w, std::span<const float> g) const {
    const float lr = learning_rate;
    const float eps = epsilon;
    float* __restrict wp = w.data();
    const float* __restrict gp = g.data();
    float* __restrict ap = state.accumulator.data();
    for (std::size_t i = 0, n = w.size(); i < n; ++i) {
      ap[i] += gp[i] * gp[i];
      wp[i] -= lr * gp[i] / (std::sqrt(ap[i]) + eps);
    }
  }
};
static_assert(Optimizer<Adagrad>);

}  // namespace pulley
// ---- end pulley/optimizers/adagrad.hpp ----
// ---- begin pulley/optimizers/adam.hpp ----

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace pulley {

/// Adam (Kingma & Ba) in TensorFlow's form, which folds bias correction into the step size:
///   t += 1
///   lr_t = learning_rate * sqrt(1 - beta_2^t) / (1 - beta_1^t)
///   m = beta_1 * m + (1 - beta_1) * g
///   v = beta_2 * v + (1 - beta_2) * g^2
///   w -= lr_t * m / (sqrt(v) + epsilon)
/// Defaults are Keras'. `t` counts this part's updates, i.e. the global step in sync mode.
struct Adam {
  float learning_rate = 0.001F;  ///< step size
  float beta_1 = 0.9F;           ///< decay of the first moment
  float beta_2 = 0.999F;         ///< decay of the second moment
  float epsilon = 1e-7F;         ///< keeps the division finite

  /// First and second moment slots plus the update count.
  struct State {
    std::vector<float> m;
    std::vector<float> v;
    std::int64_t t = 0;
  };

  /// Fresh slots for a part of n elements.
  [[nodiscard]] State make_state(std::size_t n) const {
    return {std::vector<float>(n, 0.0F), std::vector<float>(n, 0.0F), 0};
  }

  /// Updates `w` in place from gradient `g` (same size as the state).
  void apply(State& state, std::span<float> w, std::span<const float> g) const {
    ++state.t;
    const auto t = static_cast<double>(state.t);
    const auto lr_t =
        static_cast<float>(learning_rate * std::sqrt(1.0 - std::pow(double{beta_2}, t)) /
                           (1.0 - std::pow(double{beta_1}, t)));
    const float b1 = beta_1;
    const float b2 = beta_2;
    const float eps = epsilon;
    float* __restrict wp = w.data();
    const float* __restrict gp = g.data();
    float* __restrict mp = state.m.data();
    float* __restrict vp = state.v.data();
    for (std::size_t i = 0, n = w.size(); i < n; ++i) {
      mp[i] = b1 * mp[i] + (1.0F - b1) * gp[i];
      vp[i] = b2 * vp[i] + (1.0F - b2) * gp[i] * gp[i];
      wp[i] -= lr_t * mp[i] / (std::sqrt(vp[i]) + eps);
    }
  }
};
static_assert(Optimizer<Adam>);

}  // namespace pulley
// ---- end pulley/optimizers/adam.hpp ----
// ---- begin pulley/optimizers/momentum.hpp ----

#include <cstddef>
#include <span>
#include <vector>

namespace pulley {

/// Momentum SGD with TensorFlow's update rule (MomentumOptimizer):
///   accumulation = momentum * accumulation + g
///   w -= learning_rate * accumulation                         (classic)
///   w -= learning_rate * (g + momentum * accumulation)        (use_nesterov)
struct Momentum {
  float learning_rate = 0.01F;  ///< step size
  float momentum = 0.9F;        ///< decay of the accumulation
  bool use_nesterov = false;    ///< look-ahead update

  /// The accumulation slot, one value per element.
  struct State {
    std::vector<float> accumulation;
  };

  /// Fresh slots for a part of n elements.
  [[nodiscard]] State make_state(std::size_t n) const { return {std::vector<float>(n, 0.0F)}; }

  /// Updates `w` in place from gradient `g` (same size as the state).
  void apply(State& state, std::span<float> w, std::span<const float> g) const {
    const float lr = learning_rate;
    const float mu = momentum;
    float* __restrict wp = w.data();
    const float* __restrict gp = g.data();
    float* __restrict ap = state.accumulation.data();
    const std::size_t n = w.size();
    if (use_nesterov) {
      for (std::size_t i = 0; i < n; ++i) {
        ap[i] = mu * ap[i] + gp[i];
        wp[i] -= lr * (gp[i] + mu * ap[i]);
      }
    } else {
      for (std::size_t i = 0; i < n; ++i) {
        ap[i] = mu * ap[i] + gp[i];
        wp[i] -= lr * ap[i];
      }
    }
  }
};
static_assert(Optimizer<Momentum>);

}  // namespace pulley
// ---- end pulley/optimizers/momentum.hpp ----
// ---- begin pulley/optimizers/sgd.hpp ----

#include <cstddef>
#include <span>

namespace pulley {

/// Plain stochastic gradient descent: `w -= learning_rate * g` (TF's GradientDescentOptimizer).
struct Sgd {
  float learning_rate = 0.01F;  ///< step size

  /// SGD keeps no slots.
  struct State {};

  /// Fresh slots for a part of n elements.
  [[nodiscard]] State make_state(std::size_t /*n*/) const { return {}; }

  /// Updates `w` in place from gradient `g` (same size as the state).
  void apply(State& /*state*/, std::span<float> w, std::span<const float> g) const {
    const float lr = learning_rate;
    float* __restrict wp = w.data();
    const float* __restrict gp = g.data();
    for (std::size_t i = 0, n = w.size(); i < n; ++i) wp[i] -= lr * gp[i];
  }
};
static_assert(Optimizer<Sgd>);

}  // namespace pulley
// ---- end pulley/optimizers/sgd.hpp ----
// ---- begin pulley/parameter_server.hpp ----

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace pulley {

/// How a transport hands a ps its way to answer one request. It may be called later (a
/// TakeToken waits for a token) but exactly once, and it must copy or send any views in the
/// Response before returning.
using Responder = std::function<void(Response&&)>;

/// One ps task: holds the parts of every variable placed on it, aggregates the gradients
/// pushed to them and applies the optimizer.
///
/// It is a message handler and does no I/O: a transport's serving loop calls `handle` for
/// every request from one thread, so the same logic runs in-process and over the network,
/// and nothing here needs a lock.
///
/// @tparam S Sharding policy: which ps holds which rows (every ps computes the same placement)
/// @tparam O Optimizer applied to each part, with its per-part slots kept beside the part
/// @tparam P SyncPolicy: async, SyncReplicas, ... decides when gradients are applied
///
/// Bad requests are answered with an ErrorReply and change nothing; the server keeps
/// serving. A push is all-or-nothing: it is checked whole (known parts, sizes, finite
/// values, the last unless `Push::finite_checked` says that was done) before any of it is
/// accumulated, so a NaN or Inf gradient is refused with `kInvalidArgument` instead of
/// poisoning the parameters.
template <Sharding S, Optimizer O, SyncPolicy P>
class ParameterServer {
 public:
  /// @param task    this ps task's index
  /// @param num_ps  the number of ps tasks in the cluster
  ParameterServer(std::uint32_t task, std::uint32_t num_ps, O optimizer, P sync, S sharding = {})
      : task_(task),
        num_ps_(num_ps),
        optimizer_(std::move(optimizer)),
        sync_(std::move(sync)),
        sharding_(std::move(sharding)),
        step_votes_(sync_.make_accumulator(0)) {
    if (num_ps == 0 || task >= num_ps) {
      throw Error(ErrorCode::kInvalidArgument, "ps task " + std::to_string(task) +
                                                   " is outside a cluster of " +
                                                   std::to_string(num_ps) + " ps tasks");
    }
  }

  /// Handles one request; `reply` is called exactly once, now or later.
  void handle(Request&& request, Responder reply) {
    if (stopped_) {
      reply(ErrorReply{ErrorCode::kCancelled, "ps " + std::to_string(task_) + " is shut down"});
      return;
    }
    std::visit([&](auto& r) { on(r, reply); }, request);
  }

  /// True once a Shutdown request was handled; the serving loop then ends.
  [[nodiscard]] bool stopped() const noexcept { return stopped_; }
  /// This ps task's index.
  [[nodiscard]] std::uint32_t task() const noexcept { return task_; }
  /// Counters, as GetStats answers them.
  [[nodiscard]] Stats stats() const noexcept {
    Stats s = stats_;
    s.global_step = global_step();
    return s;
  }

 private:
  /// A part held here, with the optimizer's slots and the sync policy's accumulator.
  struct Slot {
    Part part;
    std::size_t row_size = 0;
    std::vector<float> values;
    typename O::State optimizer_state;
    typename P::Accumulator accumulator;
    bool initialized = false;
  };

  struct WaitingPull {
    Pull request;
    Responder reply;
  };

  struct TokenWaiter {
    std::uint32_t worker;
    Responder reply;
  };

  void reject(Responder& reply, ErrorCode code, std::string message) {
    ++stats_.requests_rejected;
    reply(ErrorReply{code, "ps " + std::to_string(task_) + ": " + std::move(message)});
  }

  // ---- Register -------------------------------------------------------------------------

  void on(Register& r, Responder& reply) {
    if (registered_) {
      if (r.variables == variables_) {
        reply(PlacementReply{variables_, placement_});
      } else {
        reject(reply, ErrorCode::kAlreadyExists, "a different model is already registered");
      }
      return;
    }
    if (auto problem = check_variables(r.variables); !problem.empty()) {
      reject(reply, ErrorCode::kInvalidArgument, problem);
      return;
    }
    Placement placement = sharding_.place(r.variables, num_ps_);
    if (auto problem = check_placement(r.variables, placement); !problem.empty()) {
      reject(reply, ErrorCode::kInvalidArgument, "the sharding policy is broken: " + problem);
      return;
    }
    variables_ = std::move(r.variables);
    placement_ = std::move(placement);
    slot_of_part_.assign(placement_.parts.size(), kNotHere);
    for (const Part& part : placement_.parts) {
      if (part.ps != task_) continue;
      const std::size_t row_size = variables_[part.variable].row_size();
      const std::size_t n = part.rows.size() * row_size;
      slot_of_part_[&part - placement_.parts.data()] = slots_.size();
      slots_.push_back(Slot{part, row_size, std::vector<float>(n, 0.0F), optimizer_.make_state(n),
                            sync_.make_accumulator(n), false});
    }
    registered_ = true;
    reply(PlacementReply{variables_, placement_});
    if (slots_.empty()) become_ready();
  }

  static std::string check_variables(const std::vector<VariableSpec>& variables) {
    for (std::size_t i = 0; i < variables.size(); ++i) {
      const VariableSpec& v = variables[i];
      if (v.name.empty()) return "variable " + std::to_string(i) + " has no name";
      if (v.size() == 0) return "variable '" + v.name + "' has no elements";
      for (std::size_t j = 0; j < i; ++j) {
        if (variables[j].name == v.name) return "variable name '" + v.name + "' is used twice";
      }
    }
    return {};
  }

  std::string check_placement(const std::vector<VariableSpec>& variables,
                              const Placement& placement) const {
    if (placement.num_variables() != variables.size()) return "wrong number of variables";
    for (std::size_t v = 0; v < variables.size(); ++v) {
      std::size_t next_row = 0;
      std::uint32_t index = 0;
      for (const Part& part : placement.parts_of(v)) {
        if (part.variable != v || part.index != index++) return "parts are out of order";
        if (part.ps >= num_ps_) return "a part is placed on a ps task that does not exist";
        if (part.rows.begin != next_row || part.rows.empty()) {
          return "the parts of '" + variables[v].name + "' do not cover its rows exactly once";
        }
        next_row = part.rows.end;
      }
      if (next_row != variables[v].rows()) {
        return "the parts of '" + variables[v].name + "' do not cover its rows exactly once";
      }
    }
    return {};
  }

  // ---- Initialize / WaitReady -----------------------------------------------------------

  void on(Initialize& r, Responder& reply) {
    if (!registered_) {
      reject(reply, ErrorCode::kFailedPrecondition, "initialize before the model is registered");
      return;
    }
    if (!check_parts(r.parts, reply)) return;
    for (const PartValues& pv : r.parts) {
      const Slot* slot = &slots_[slot_of_part_[pv.part]];
      if (slot->initialized) {
        reject(reply, ErrorCode::kAlreadyExists, describe(slot->part) + " is already initialized");
        return;
      }
    }
    for (const PartValues& pv : r.parts) {
      Slot& slot = slots_[slot_of_part_[pv.part]];
      std::copy(pv.values.begin(), pv.values.end(), slot.values.begin());
      slot.initialized = true;
      ++initialized_slots_;
    }
    reply(Ack{});
    if (initialized_slots_ == slots_.size() && !ready_) become_ready();
  }

  void on(WaitReady& /*r*/, Responder& reply) {
    if (ready_) {
      reply(PlacementReply{variables_, placement_});
    } else {
      ready_waiters_.push_back(std::move(reply));
    }
  }

  void become_ready() {
    ready_ = true;
    release_tokens();
    for (Responder& waiter : std::exchange(ready_waiters_, {}))
      waiter(PlacementReply{variables_, placement_});
  }

  // ---- TakeToken ------------------------------------------------------------------------

  void on(TakeToken& r, Responder& reply) {
    if (!ready_) {
      reject(reply, ErrorCode::kFailedPrecondition, "token requested before initialization");
      return;
    }
    if (sync_.token_rule().per_step <= 0) {  // the policy does not pace workers
      reply(TokenReply{0, global_step(), true, false});
    } else if (!give_token(r.worker, reply)) {
      token_waiters_.push_back({r.worker, std::move(reply)});
    }
  }

  /// Hands `worker` a token of the current step if one is left and it may take one more.
  bool give_token(std::uint32_t worker, Responder& reply) {
    const std::int64_t cap = sync_.token_rule().per_worker;
    std::int64_t& taken = tokens_taken_[worker];
    if (tokens_left_ == 0 || (cap > 0 && taken >= cap)) return false;
    --tokens_left_;
    ++taken;
    reply(TokenReply{global_step(), global_step(), cap == 1});
    return true;
  }

  /// Replaces the tokens of the last step by the policy's tokens of the current one.
  void release_tokens() {
    tokens_left_ = std::max<std::int64_t>(sync_.token_rule().per_step, 0);
    tokens_taken_.clear();
    std::erase_if(token_waiters_, [&](TokenWaiter& w) { return give_token(w.worker, w.reply); });
  }

  // ---- Pull -----------------------------------------------------------------------------

  void on(Pull& r, Responder& reply) {
    if (!ready_) {
      reject(reply, ErrorCode::kFailedPrecondition, "pull before initialization");
      return;
    }
    for (const Slice& s : r.slices) {
      if (s.part >= slot_of_part_.size() || slot_of_part_[s.part] == kNotHere) {
        reject(reply, ErrorCode::kNotFound, unknown_part(s.part));
        return;
      }
      const Part& part = slots_[slot_of_part_[s.part]].part;
      if (s.rows.empty() || s.rows.begin < part.rows.begin || s.rows.end > part.rows.end) {
        reject(reply, ErrorCode::kInvalidArgument,
               "rows [" + std::to_string(s.rows.begin) + ", " + std::to_string(s.rows.end) +
                   ") are outside " + describe(part));
        return;
      }
    }
    if (global_step() < r.min_step) {
      waiting_pulls_.push_back({std::move(r), std::move(reply)});
    } else {
      answer_pull(r, reply);
    }
  }

  void answer_pull(const Pull& r, Responder& reply) {
    PullReply answer{global_step(), {}};
    answer.values.reserve(r.slices.size());
    for (const Slice& s : r.slices) {
      const Slot& slot = slots_[slot_of_part_[s.part]];
      const std::size_t offset = (s.rows.begin - slot.part.rows.begin) * slot.row_size;
      answer.values.push_back(
          std::span<const float>(slot.values).subspan(offset, s.rows.size() * slot.row_size));
      stats_.bytes_pulled += static_cast<std::int64_t>(answer.values.back().size_bytes());
    }
    reply(std::move(answer));
  }

  // ---- Push -----------------------------------------------------------------------------

  void on(Push& r, Responder& reply) {
    if (!ready_) {
      reject(reply, ErrorCode::kFailedPrecondition,
             "push before initialization: the chief has not initialized the variables");
      return;
    }
    if (!check_parts(r.gradients, reply)) return;
    if (r.gradients.size() != slots_.size()) {
      // Every part's accumulator must see every step's votes, or parts drift apart.
      reject(reply, ErrorCode::kInvalidArgument,
             "a push must carry a gradient for each of the " + std::to_string(slots_.size()) +
                 " parts held here, got " + std::to_string(r.gradients.size()));
      return;
    }
    for (const PartValues& pv : r.gradients) {
      const Slot* slot = &slots_[slot_of_part_[pv.part]];
      if (!r.finite_checked && !detail::all_finite(pv.values)) {
        reject(reply, ErrorCode::kInvalidArgument,
               "non-finite (NaN or Inf) gradient for " + describe(slot->part) + " from worker " +
                   std::to_string(r.worker) + "; nothing was applied");
        return;
      }
    }
    PushReply answer;
    for (const PartValues& pv : r.gradients) {
      Slot& slot = slots_[slot_of_part_[pv.part]];
      stats_.bytes_pushed += static_cast<std::int64_t>(pv.values.size_bytes());
      switch (sync_.accumulate(slot.accumulator, pv.values, r.local_step)) {
        case Verdict::kStale:
          ++stats_.stale_gradients_dropped;
          ++answer.stale_parts;
          break;
        case Verdict::kPending:
          ++stats_.gradients_accepted;
          break;
        case Verdict::kReady:
          ++stats_.gradients_accepted;
          optimizer_.apply(slot.optimizer_state, slot.values, sync_.take(slot.accumulator));
          ++stats_.updates_applied;
          break;
      }
    }
    const Verdict vote = sync_.accumulate(step_votes_, {}, r.local_step);
    reply(answer);
    if (vote == Verdict::kReady) {
      sync_.take(step_votes_);
      release_tokens();
      answer_waiting_pulls();
    }
  }

  void answer_waiting_pulls() {
    std::erase_if(waiting_pulls_, [&](WaitingPull& w) {
      if (global_step() < w.request.min_step) return false;
      answer_pull(w.request, w.reply);
      return true;
    });
  }

  // ---- GetStats / Shutdown --------------------------------------------------------------

  void on(GetStats& /*r*/, Responder& reply) { reply(StatsReply{stats()}); }

  void on(Shutdown& /*r*/, Responder& reply) {
    stopped_ = true;
    const ErrorReply cancelled{ErrorCode::kCancelled,
                               "ps " + std::to_string(task_) + " shut down while waiting"};
    for (Responder& w : std::exchange(ready_waiters_, {})) w(ErrorReply{cancelled});
    for (TokenWaiter& w : std::exchange(token_waiters_, {})) w.reply(ErrorReply{cancelled});
    for (WaitingPull& w : std::exchange(waiting_pulls_, {})) w.reply(ErrorReply{cancelled});
    reply(Ack{});
  }

  // ---- helpers --------------------------------------------------------------------------

  [[nodiscard]] std::int64_t global_step() const { return sync_.step(step_votes_); }

  /// Checks that every part is held here, appears once and has the right size; otherwise
  /// rejects the request and returns false.
  bool check_parts(const std::vector<PartValues>& parts, Responder& reply) {
    for (std::size_t i = 0; i < parts.size(); ++i) {
      const PartValues& pv = parts[i];
      if (pv.part >= slot_of_part_.size() || slot_of_part_[pv.part] == kNotHere) {
        reject(reply, ErrorCode::kNotFound, unknown_part(pv.part));
        return false;
      }
      const Slot& slot = slots_[slot_of_part_[pv.part]];
      if (pv.values.size() != slot.values.size()) {
        reject(reply, ErrorCode::kInvalidArgument,
               describe(slot.part) + " has " + std::to_string(slot.values.size()) +
                   " elements, got " + std::to_string(pv.values.size()));
        return false;
      }
      for (std::size_t j = 0; j < i; ++j) {
        if (parts[j].part == pv.part) {
          reject(reply, ErrorCode::kInvalidArgument, describe(slot.part) + " is sent twice");
          return false;
        }
      }
    }
    return true;
  }

  std::string unknown_part(std::uint32_t part) const {
    if (part >= placement_.parts.size()) {
      return "unknown part " + std::to_string(part) + " (the model has " +
             std::to_string(placement_.parts.size()) + " parts)";
    }
    return describe(placement_.parts[part]) + " is held by ps " +
           std::to_string(placement_.parts[part].ps) + ", not here";
  }

  std::string describe(const Part& part) const {
    return "variable '" + variables_[part.variable].name + "' part " + std::to_string(part.index);
  }

  static constexpr std::size_t kNotHere = static_cast<std::size_t>(-1);

  std::uint32_t task_;
  std::uint32_t num_ps_;
  [[no_unique_address]] O optimizer_;
  [[no_unique_address]] P sync_;
  [[no_unique_address]] S sharding_;

  bool registered_ = false;
  bool ready_ = false;
  bool stopped_ = false;
  std::vector<VariableSpec> variables_;
  Placement placement_;
  std::vector<Slot> slots_;
  std::vector<std::size_t> slot_of_part_;  ///< global part index → slot, or kNotHere
  std::size_t initialized_slots_ = 0;

  typename P::Accumulator step_votes_;  ///< the global step: one vote per push message
  std::int64_t tokens_left_ = 0;        ///< tokens of the current step
  std::map<std::uint32_t, std::int64_t> tokens_taken_;  ///< by worker, this step
  std::deque<TokenWaiter> token_waiters_;
  std::vector<Responder> ready_waiters_;
  std::vector<WaitingPull> waiting_pulls_;
  Stats stats_;
};

}  // namespace pulley
// ---- end pulley/parameter_server.hpp ----
// ---- begin pulley/sharding/partitioned.hpp ----

#include <cstddef>
#include <span>

// ---- begin pulley/detail/partition.hpp ----

#include <cstddef>
#include <cstdint>
#include <span>

namespace pulley::detail {

/// Splits every variable into `parts_for(spec)` row ranges as TensorFlow's partitioned
/// variables do (the first `rows % k` parts get one row more) and deals the parts to the ps
/// tasks round-robin in creation order, as `replica_device_setter` does with each part.
template <class PartsFor>
Placement place_round_robin(std::span<const VariableSpec> variables, std::size_t num_ps,
                            PartsFor parts_for) {
  if (num_ps == 0) throw Error(ErrorCode::kInvalidArgument, "sharding needs at least one ps task");
  PlacementBuilder builder;
  std::size_t next_ps = 0;
  for (const VariableSpec& spec : variables) {
    builder.begin_variable();
    const std::size_t rows = spec.rows();
    std::size_t k = parts_for(spec);
    k = k < 1 ? 1 : (k > rows && rows > 0 ? rows : k);
    const std::size_t base = rows / k;
    const std::size_t extra = rows % k;
    std::size_t begin = 0;
    for (std::size_t i = 0; i < k; ++i) {
      const std::size_t end = begin + base + (i < extra ? 1 : 0);
      builder.add(static_cast<std::uint32_t>(next_ps), {begin, end});
      next_ps = (next_ps + 1) % num_ps;
      begin = end;
    }
  }
  return std::move(builder).finish();
}

}  // namespace pulley::detail
// ---- end pulley/detail/partition.hpp ----

namespace pulley {

/// Splits every variable along its first dimension into `num_shards` parts (fewer when it
/// has fewer rows), like TF's `fixed_size_partitioner`; parts are dealt round-robin.
struct FixedShards {
  std::size_t num_shards = 1;  ///< parts per variable (fewer if it has fewer rows)

  /// The placement of `variables` over `num_ps` ps tasks.
  [[nodiscard]] Placement place(std::span<const VariableSpec> variables, std::size_t num_ps) const {
    return detail::place_round_robin(variables, num_ps,
                                     [this](const VariableSpec&) { return num_shards; });
  }
};
static_assert(Sharding<FixedShards>);

/// Splits a variable only as much as needed to keep each part at least `min_slice_bytes`,
/// with at most `max_shards` parts, like TF's `min_max_variable_partitioner`: rows per part
/// = max(1, floor(min_slice_bytes / row_bytes)), parts = min(max_shards, ceil(rows / that)).
/// Small variables stay whole; parts are dealt round-robin.
struct MinSize {
  std::size_t min_slice_bytes = std::size_t{256} << 10U;  ///< smallest part worth a split
  std::size_t max_shards = 1;                             ///< most parts per variable

  /// Number of parts for `spec` under this rule.
  [[nodiscard]] std::size_t parts_for(const VariableSpec& spec) const {
    const std::size_t row_bytes = spec.row_size() * sizeof(float);
    std::size_t rows_per_part = row_bytes == 0 ? 1 : min_slice_bytes / row_bytes;
    if (rows_per_part == 0) rows_per_part = 1;
    const std::size_t wanted = (spec.rows() + rows_per_part - 1) / rows_per_part;
    return wanted < max_shards ? wanted : max_shards;
  }

  /// The placement of `variables` over `num_ps` ps tasks.
  [[nodiscard]] Placement place(std::span<const VariableSpec> variables, std::size_t num_ps) const {
    return detail::place_round_robin(variables, num_ps,
                                     [this](const VariableSpec& s) { return parts_for(s); });
  }
};
static_assert(Sharding<MinSize>);

}  // namespace pulley
// ---- end pulley/sharding/partitioned.hpp ----
// ---- begin pulley/sharding/round_robin.hpp ----

#include <cstddef>
#include <span>

namespace pulley {

/// Whole variables dealt to the ps tasks in turn: variable i on ps `i % num_ps`.
/// TensorFlow's default (`replica_device_setter` with its round-robin strategy).
struct RoundRobin {
  /// The placement of `variables` over `num_ps` ps tasks.
  [[nodiscard]] Placement place(std::span<const VariableSpec> variables, std::size_t num_ps) const {
    return detail::place_round_robin(variables, num_ps, [](const VariableSpec&) { return 1; });
  }
};
static_assert(Sharding<RoundRobin>);

}  // namespace pulley
// ---- end pulley/sharding/round_robin.hpp ----
// ---- begin pulley/slurm.hpp ----

#include <algorithm>
#include <charconv>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace pulley {

// The same TfConfig, built from the variables Slurm gives each task of a step, by the rules of
// TensorFlow's `SlurmClusterResolver`: nodes in nodelist order, the i-th task on a node at
// `port_base + i`, ranks handed to the jobs in the order they are listed.

/// The jobs of a Slurm step and their task counts, in rank order: {{"ps", 1}, {"worker", 2}}
/// makes rank 0 ps 0 and ranks 1 and 2 workers 0 and 1. Names are those of kJobNames
/// ("master" is read as "chief"); the counts must add up to the step's number of tasks.
using SlurmJobs = std::vector<std::pair<std::string, std::uint32_t>>;

/// The port of the first task on each node, TensorFlow's default.
inline constexpr std::uint32_t kSlurmPortBase = 8888;

/// An environment for slurm_config: the value of a variable, nullopt when it is unset. The
/// exact return type is required so that a `getenv`-like `const char*` (null when unset)
/// cannot slip in through an implicit conversion.
template <class F>
concept SlurmEnvironment = std::invocable<F&, std::string_view> &&
    std::same_as<std::invoke_result_t<F&, std::string_view>, std::optional<std::string>>;

namespace detail {

inline Error slurm_error(const std::string& what) {
  return Error(ErrorCode::kInvalidArgument, "Slurm: " + what);
}

/// Bounds the nodes a list may expand to, so a typo like "n[0-999999999]" fails fast instead
/// of exhausting memory.
inline constexpr std::size_t kSlurmMaxNodes = std::size_t{1} << 20;

/// Comma-separated fields, empty ones kept (so that "a,,b" can be refused).
inline std::vector<std::string_view> slurm_fields(std::string_view text) {
  std::vector<std::string_view> fields;
  for (std::size_t start = 0;;) {
    const std::size_t comma = std::min(text.find(',', start), text.size());
    fields.push_back(text.substr(start, comma - start));
    if (comma == text.size()) return fields;
    start = comma + 1;
  }
}

/// A number written in decimal digits only (no sign, no space); nullopt otherwise.
inline std::optional<std::uint64_t> slurm_number(std::string_view text) {
  std::uint64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [stop, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ec != std::errc() || stop != end) return std::nullopt;
  return value;
}

inline Error slurm_bad_hostlist(std::string_view hostlist, const std::string& why) {
  return slurm_error("malformed hostlist \"" + std::string(hostlist) + "\": " + why);
}

/// The values of a bracket's body such as "01-03,7": each field a number or a range lo-hi,
/// zero-padded to the width of lo as Slurm writes them ("08-10" is 08, 09, 10).
inline std::vector<std::string> slurm_bracket_values(std::string_view body,
                                                     std::string_view hostlist) {
  std::vector<std::string> values;
  for (std::string_view field : slurm_fields(body)) {
    const std::size_t dash = field.find('-');
    const std::string_view lo_text = field.substr(0, dash);
    const std::string_view hi_text =
        dash == std::string_view::npos ? lo_text : field.substr(dash + 1);
    const auto lo = slurm_number(lo_text);
    const auto hi = slurm_number(hi_text);
    if (!lo || !hi) {
      throw slurm_bad_hostlist(hostlist, "\"" + std::string(field) + "\" in [" + std::string(body) +
                                             "] is not a number or a range lo-hi");
    }
    if (*lo > *hi) {
      throw slurm_bad_hostlist(hostlist, "range \"" + std::string(field) + "\" runs backwards");
    }
    if (*hi - *lo >= kSlurmMaxNodes - values.size()) {
      throw slurm_bad_hostlist(hostlist, "more than " + std::to_string(kSlurmMaxNodes) + " nodes");
    }
    for (std::uint64_t v = *lo; v <= *hi; ++v) {
      std::string digits = std::to_string(v);
      if (digits.size() < lo_text.size()) digits.insert(0, lo_text.size() - digits.size(), '0');
      values.push_back(std::move(digits));
    }
  }
  return values;
}

/// `jobs` with "master" renamed "chief", checked: known names, each once, each with a task,
/// and a "ps" job (a TfConfig always has one, as parse_tf_config demands).
inline SlurmJobs checked_slurm_jobs(const SlurmJobs& jobs) {
  SlurmJobs checked;
  for (const auto& [name, count] : jobs) {
    const std::string job = name == "master" ? "chief" : name;
    if (std::find(std::begin(kJobNames), std::end(kJobNames), job) == std::end(kJobNames)) {
      throw slurm_error("unknown job \"" + name + "\" (chief, worker, ps, evaluator)");
    }
    if (count == 0) throw slurm_error("job \"" + job + "\" has no tasks");
    for (const auto& seen : checked) {
      if (seen.first == job) throw slurm_error("job \"" + job + "\" is listed twice");
    }
    checked.emplace_back(job, count);
  }
  const bool has_ps = std::any_of(checked.begin(), checked.end(),
                                  [](const auto& job) { return job.first == "ps"; });
  if (!has_ps) throw slurm_error("the jobs have no \"ps\" job");
  return checked;
}

}  // namespace detail

/// Parses a jobs list such as "ps:1,worker:2,chief:1" (the form a command-line flag takes)
/// into SlurmJobs, keeping its order. Throws kInvalidArgument ("Slurm: ...") for a field that
/// is not job:count, an unknown or repeated job, a count of 0, or no "ps" job.
inline SlurmJobs parse_slurm_jobs(std::string_view text) {
  SlurmJobs jobs;
  for (std::string_view field : detail::slurm_fields(text)) {
    const std::size_t colon = field.find(':');
    const auto count = colon == std::string_view::npos
                           ? std::nullopt
                           : detail::slurm_number(field.substr(colon + 1));
    if (colon == 0 || !count || *count > std::numeric_limits<std::uint32_t>::max()) {
      throw detail::slurm_error("jobs \"" + std::string(text) + "\": \"" + std::string(field) +
                                "\" is not job:count (as in \"ps:1,worker:2,chief:1\")");
    }
    jobs.emplace_back(std::string(field.substr(0, colon)), static_cast<std::uint32_t>(*count));
  }
  return detail::checked_slurm_jobs(jobs);
}

/// Expands a Slurm hostlist such as "node[01-03,07],gpu5" into its host names, in order and
/// without removing duplicates: node01, node02, node03, node07, gpu5. A bracket holds numbers
/// and ranges lo-hi, zero-padded to the width of lo; several brackets in one name multiply,
/// the leftmost varying slowest ("r[1-2]n[1-2]" is r1n1, r1n2, r2n1, r2n2). Throws
/// kInvalidArgument ("Slurm: malformed hostlist ...") for anything else: empty names, nested
/// or unbalanced brackets, non-numbers or backward ranges in brackets, spaces.
inline std::vector<std::string> expand_slurm_hostlist(std::string_view hostlist) {
  std::vector<std::string> hosts;
  for (std::size_t start = 0;;) {
    // One name runs to the next comma outside brackets.
    std::size_t end = start;
    bool open = false;
    for (; end < hostlist.size() && (open || hostlist[end] != ','); ++end) {
      const char c = hostlist[end];
      if (c == '[' && open) throw detail::slurm_bad_hostlist(hostlist, "nested '['");
      if (c == ']' && !open) throw detail::slurm_bad_hostlist(hostlist, "']' without '['");
      if (c == ' ' || c == '\t' || c == '\n') {
        throw detail::slurm_bad_hostlist(hostlist, "a space in a host name");
      }
      if (c == '[' || c == ']') open = c == '[';
    }
    if (open) throw detail::slurm_bad_hostlist(hostlist, "'[' without ']'");
    const std::string_view name = hostlist.substr(start, end - start);
    if (name.empty()) throw detail::slurm_bad_hostlist(hostlist, "an empty host name");

    std::vector<std::string> names{""};
    for (std::size_t i = 0; i < name.size();) {
      if (name[i] != '[') {
        const std::size_t bracket = std::min(name.find('[', i), name.size());
        for (std::string& n : names) n.append(name.substr(i, bracket - i));
        i = bracket;
        continue;
      }
      const std::size_t close = name.find(']', i);
      const auto values = detail::slurm_bracket_values(name.substr(i + 1, close - i - 1), hostlist);
      if (names.size() * values.size() > detail::kSlurmMaxNodes - hosts.size()) {
        throw detail::slurm_bad_hostlist(
            hostlist, "more than " + std::to_string(detail::kSlurmMaxNodes) + " nodes");
      }
      std::vector<std::string> product;
      product.reserve(names.size() * values.size());
      for (const std::string& n : names) {
        for (const std::string& v : values) product.push_back(n + v);
      }
      names = std::move(product);
      i = close + 1;
    }
    hosts.insert(hosts.end(), std::make_move_iterator(names.begin()),
                 std::make_move_iterator(names.end()));
    if (end == hostlist.size()) return hosts;
    start = end + 1;
  }
}

/// Expands Slurm's tasks-per-node list, one count per node in nodelist order: "2(x3),1" is
/// 2, 2, 2, 1. Throws kInvalidArgument ("Slurm: malformed tasks per node ...") for a field
/// that is not N or N(xM) with N, M >= 1.
inline std::vector<std::uint32_t> expand_slurm_tasks_per_node(std::string_view text) {
  std::vector<std::uint32_t> tasks;
  for (std::string_view field : detail::slurm_fields(text)) {
    const std::size_t paren = field.find('(');
    const auto count = detail::slurm_number(field.substr(0, paren));
    std::optional<std::uint64_t> repeat = 1;
    if (paren != std::string_view::npos) {
      const bool shaped =
          field.size() > paren + 3 && field.substr(paren, 2) == "(x" && field.back() == ')';
      repeat = shaped ? detail::slurm_number(field.substr(paren + 2, field.size() - paren - 3))
                      : std::nullopt;
    }
    if (!count || !repeat || *count == 0 || *repeat == 0 ||
        *count > std::numeric_limits<std::uint32_t>::max()) {
      throw detail::slurm_error("malformed tasks per node \"" + std::string(text) + "\": \"" +
                                std::string(field) + "\" is not N or N(xM) with N, M >= 1");
    }
    if (*repeat > detail::kSlurmMaxNodes - tasks.size()) {
      throw detail::slurm_error("malformed tasks per node \"" + std::string(text) +
                                "\": more than " + std::to_string(detail::kSlurmMaxNodes) +
                                " nodes");
    }
    tasks.insert(tasks.end(), *repeat, static_cast<std::uint32_t>(*count));
  }
  return tasks;
}

/// Builds this task's TfConfig from Slurm's variables, read through `env`:
///   SLURM_PROCID                                             this task's rank in the step
///   SLURM_STEP_NUM_TASKS, else SLURM_NTASKS                  the step's number of tasks
///   SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST             its nodes (a hostlist)
///   SLURM_STEP_TASKS_PER_NODE, else SLURM_TASKS_PER_NODE     tasks on each node
/// (the step's own variables first, as the rank counts within the step). Ranks fill the nodes
/// in nodelist order, which is Slurm's default block distribution (`--distribution=cyclic`
/// would place them otherwise, and is not supported); the i-th task on a node gets
/// "host:port_base+i", and the ranks go to `jobs` in their order (TensorFlow's resolver sorts
/// them by name; an explicit order says which rank is which). The result is what
/// parse_tf_config would return for the equivalent TF_CONFIG. Throws kInvalidArgument
/// ("Slurm: ...") naming the problem: a missing or malformed variable, a node count that
/// differs from the tasks-per-node entries, a host listed twice, task counts that disagree,
/// a rank out of range, a port over 65535, or bad `jobs` (see parse_slurm_jobs).
template <SlurmEnvironment Env>
TfConfig slurm_config(const SlurmJobs& jobs, std::uint32_t port_base, Env&& env) {
  using detail::slurm_error;
  const SlurmJobs checked = detail::checked_slurm_jobs(jobs);

  struct Variable {
    std::string name;
    std::string value;
  };
  auto read = [&](std::string_view name, std::string_view fallback = {}) -> Variable {
    for (std::string_view n : {name, fallback}) {
      if (n.empty()) continue;
      std::optional<std::string> value = std::invoke(env, n);
      if (value && !value->empty()) return {std::string(n), std::move(*value)};
    }
    const std::string unset = fallback.empty() ? std::string(name) + " is not set"
                                               : "neither " + std::string(name) + " nor " +
                                                     std::string(fallback) + " is set";
    throw slurm_error(unset + " (not inside a Slurm step?)");
  };
  auto number = [](const Variable& v) {
    const auto n = detail::slurm_number(v.value);
    if (!n || *n > std::numeric_limits<std::uint32_t>::max()) {
      throw slurm_error(v.name + " is not a number: \"" + v.value + "\"");
    }
    return *n;
  };
  const Variable procid = read("SLURM_PROCID");
  const Variable ntasks_var = read("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS");
  const Variable nodelist = read("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST");
  const Variable per_node_var = read("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE");
  const std::uint64_t rank = number(procid);
  const std::uint64_t ntasks = number(ntasks_var);
  const std::vector<std::string> hosts = expand_slurm_hostlist(nodelist.value);
  const std::vector<std::uint32_t> per_node = expand_slurm_tasks_per_node(per_node_var.value);

  if (hosts.size() != per_node.size()) {
    throw slurm_error(nodelist.name + " names " + std::to_string(hosts.size()) + " node(s) but " +
                      per_node_var.name + " gives tasks for " + std::to_string(per_node.size()));
  }
  std::set<std::string_view> seen;
  for (const std::string& host : hosts) {
    if (!seen.insert(host).second) {
      throw slurm_error("node \"" + host + "\" is listed twice in " + nodelist.name);
    }
  }
  std::uint64_t placed = 0;
  for (std::uint32_t n : per_node) placed += n;
  if (placed != ntasks) {
    throw slurm_error(per_node_var.name + " places " + std::to_string(placed) + " task(s) but " +
                      ntasks_var.name + " is " + std::to_string(ntasks));
  }
  std::uint64_t asked = 0;
  std::string listed;
  for (const auto& [job, count] : checked) {
    asked += count;
    listed += (listed.empty() ? "" : ",") + job + ":" + std::to_string(count);
  }
  if (asked != ntasks) {
    throw slurm_error("the jobs " + listed + " have " + std::to_string(asked) +
                      " task(s) but the step has " + std::to_string(ntasks) + " (" +
                      ntasks_var.name + ")");
  }
  if (rank >= ntasks) {
    throw slurm_error("SLURM_PROCID " + std::to_string(rank) + " is out of range: the step has " +
                      std::to_string(ntasks) + " task(s)");
  }
  const std::uint64_t busiest = *std::max_element(per_node.begin(), per_node.end());
  if (port_base == 0 || port_base + busiest - 1 > 65535) {
    throw slurm_error("port base " + std::to_string(port_base) + " with " +
                      std::to_string(busiest) + " task(s) on a node needs ports " +
                      std::to_string(port_base) + ".." + std::to_string(port_base + busiest - 1) +
                      ", outside 1..65535");
  }

  std::vector<std::string> addresses;
  addresses.reserve(ntasks);
  for (std::size_t node = 0; node < hosts.size(); ++node) {
    for (std::uint32_t i = 0; i < per_node[node]; ++i) {
      addresses.push_back(hosts[node] + ":" + std::to_string(port_base + i));
    }
  }
  TfConfig config;
  std::uint64_t first = 0;
  for (const auto& [job, count] : checked) {
    const auto begin = addresses.begin() + static_cast<std::ptrdiff_t>(first);
    config.cluster.jobs[job].assign(begin, begin + count);
    if (rank >= first && rank < first + count) {
      config.task = {job, static_cast<std::uint32_t>(rank - first)};
    }
    first += count;
  }
  return config;
}

/// slurm_config over this process's environment; nullopt when SLURM_PROCID is unset or empty,
/// that is, outside a Slurm step. Throws as slurm_config does.
inline std::optional<TfConfig> slurm_config_from_environment(
    const SlurmJobs& jobs, std::uint32_t port_base = kSlurmPortBase) {
  const char* rank = std::getenv("SLURM_PROCID");
  if (rank == nullptr || *rank == '\0') return std::nullopt;
  return slurm_config(jobs, port_base, [](std::string_view name) -> std::optional<std::string> {
    const char* value = std::getenv(std::string(name).c_str());
    return value == nullptr ? std::nullopt : std::optional<std::string>(value);
  });
}

}  // namespace pulley
// ---- end pulley/slurm.hpp ----
// ---- begin pulley/sync/async.hpp ----

#include <cstddef>
#include <cstdint>
#include <span>

namespace pulley {

/// Asynchronous training: every push is applied as soon as it arrives and no worker ever
/// waits for another. Nothing is stale, no tokens are used, and the global step counts
/// push messages.
struct Async {
  /// Only remembers the gradient it was handed, so `take` returns it without a copy.
  struct Accumulator {
    std::span<const float> pending;
    std::int64_t step = 0;
  };

  /// An accumulator for n-element gradients, at step 0.
  [[nodiscard]] Accumulator make_accumulator(std::size_t /*n*/) const { return {}; }

  /// Takes one contribution tagged with the sender's local step.
  Verdict accumulate(Accumulator& acc, std::span<const float> gradient,
                     std::int64_t /*local_step*/) const {
    acc.pending = gradient;
    return Verdict::kReady;
  }

  /// The gradient to apply for the completed step; advances the step.
  std::span<const float> take(Accumulator& acc) const {
    ++acc.step;
    return acc.pending;
  }

  /// Steps this accumulator has completed.
  [[nodiscard]] std::int64_t step(const Accumulator& acc) const { return acc.step; }
  /// No tokens: nobody waits.
  [[nodiscard]] TokenRule token_rule() const { return {}; }
};
static_assert(SyncPolicy<Async>);

}  // namespace pulley
// ---- end pulley/sync/async.hpp ----
// ---- begin pulley/sync/sync_replicas.hpp ----

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace pulley {

/// Synchronous training with TensorFlow's `SyncReplicasOptimizer` semantics.
///
/// Each part has an accumulator at some step s. A gradient tagged with local step < s is
/// stale and dropped. When `replicas_to_aggregate` (R) fresh gradients are in, their mean
/// is applied once and the step advances. The global step advances the same way on push
/// messages; each time it does, `max(R, N)` tokens carrying the new step are released. A
/// worker takes a token before each step.
///
/// Three refinements over TF's plain token queue, each to keep its documented regimes
/// true: step 0 starts with max(R, N) tokens (TF lets every worker start its first step
/// without one and queues R more; with R < N a dead holder of one of only R tokens would
/// stall step 0 here); when R <= N a worker takes at most one token per step (TF lets a
/// fast worker take two and crowd a slow one out of the step even when R == N); and tokens
/// of a finished step that nobody took are withdrawn (TF lets them pile up behind a dead
/// backup worker and hands them out later, which only buys stale gradients).
///   - R == N: every worker contributes one batch to every step.
///   - R >  N: fast workers take several tokens and contribute several batches to a step.
///   - R <  N: N - R workers are backups; the slowest gradients of a step arrive stale and
///     are dropped, so one slow or dead worker does not stall training.
class SyncReplicas {
 public:
  /// @param replicas_to_aggregate R, gradients averaged into one update (≥ 1)
  /// @param total_num_replicas    N, the number of workers (≥ 1)
  SyncReplicas(int replicas_to_aggregate, int total_num_replicas)
      : replicas_to_aggregate_(replicas_to_aggregate), total_num_replicas_(total_num_replicas) {
    if (replicas_to_aggregate < 1 || total_num_replicas < 1) {
      throw Error(ErrorCode::kInvalidArgument,
                  "SyncReplicas needs replicas_to_aggregate >= 1 and total_num_replicas >= 1, "
                  "got " +
                      std::to_string(replicas_to_aggregate) + " and " +
                      std::to_string(total_num_replicas));
    }
  }

  /// R: gradients averaged into one update.
  [[nodiscard]] int replicas_to_aggregate() const noexcept { return replicas_to_aggregate_; }
  /// N: the number of workers.
  [[nodiscard]] int total_num_replicas() const noexcept { return total_num_replicas_; }

  /// Running sum of the current step's fresh gradients (TF's ConditionalAccumulator).
  struct Accumulator {
    std::vector<float> sum;
    int count = 0;
    std::int64_t step = 0;
  };

  /// An accumulator for n-element gradients, at step 0.
  [[nodiscard]] Accumulator make_accumulator(std::size_t n) const {
    return {std::vector<float>(n, 0.0F), 0, 0};
  }

  /// Takes one contribution tagged with the sender's local step.
  Verdict accumulate(Accumulator& acc, std::span<const float> gradient,
                     std::int64_t local_step) const {
    if (local_step < acc.step) return Verdict::kStale;
    if (acc.count == 0) {
      std::copy(gradient.begin(), gradient.end(), acc.sum.begin());
    } else {
      float* __restrict s = acc.sum.data();
      const float* __restrict g = gradient.data();
      for (std::size_t i = 0, n = acc.sum.size(); i < n; ++i) s[i] += g[i];
    }
    return ++acc.count == replicas_to_aggregate_ ? Verdict::kReady : Verdict::kPending;
  }

  /// The gradient to apply for the completed step; advances the step.
  std::span<const float> take(Accumulator& acc) const {
    const float scale = 1.0F / static_cast<float>(replicas_to_aggregate_);
    for (float& v : acc.sum) v *= scale;
    acc.count = 0;
    ++acc.step;
    return acc.sum;
  }

  /// Steps this accumulator has completed.
  [[nodiscard]] std::int64_t step(const Accumulator& acc) const { return acc.step; }
  /// max(R, N) tokens per step; one per worker when R <= N.
  [[nodiscard]] TokenRule token_rule() const {
    return {std::max(replicas_to_aggregate_, total_num_replicas_),
            replicas_to_aggregate_ <= total_num_replicas_ ? 1 : 0};
  }

 private:
  int replicas_to_aggregate_;
  int total_num_replicas_;
};
static_assert(SyncPolicy<SyncReplicas>);

}  // namespace pulley
// ---- end pulley/sync/sync_replicas.hpp ----
// ---- begin pulley/transport/in_process.hpp ----

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

// ---- begin pulley/detail/pull_reply.hpp ----

#include <algorithm>
#include <cstddef>
#include <span>

namespace pulley::detail {

/// Copies a pull reply's values into the caller's targets (one per slice, in order) and
/// points the reply's views at them; false, copying nothing, when the reply does not fit.
inline bool copy_into(PullReply& pull, std::span<const std::span<float>> targets) {
  if (pull.values.size() != targets.size()) return false;
  for (std::size_t i = 0; i < targets.size(); ++i) {
    if (pull.values[i].size() != targets[i].size()) return false;
  }
  for (std::size_t i = 0; i < targets.size(); ++i) {
    std::copy(pull.values[i].begin(), pull.values[i].end(), targets[i].begin());
    pull.values[i] = targets[i];
  }
  return true;
}

}  // namespace pulley::detail
// ---- end pulley/detail/pull_reply.hpp ----

namespace pulley {

/// The fabric of an in-process cluster: the ps tasks, their request queues, and the fault
/// injector. Workers, the chief and the evaluator reach it through `InProcess` endpoints
/// from threads of their own. Requests travel as the same structs the TCP transport
/// serializes, and each ps handles them one at a time, in arrival order, as it handles a
/// socket.
///
/// A request to an idle ps task is handled on the thread that sends it, under the task's
/// lock: no thread hand-off, so a push+pull costs about what its copies cost. A request to
/// a task that is busy (handling another sender's request), slowed down by `delay`, or has
/// requests queued goes to the task's own thread instead, so `call` never blocks on a busy
/// ps and requests from one sender keep their order. A request that must wait (a token, a
/// step-gated pull) is answered later by whichever thread completes what it waits for.
///
/// Faults, for tests: `drop_next` loses requests (the caller's deadline fires), `delay`
/// slows a node down, `kill` makes a node fail as a crashed process would: its queued and
/// waiting requests are answered `kUnavailable`, and so is everything sent to or by it
/// afterwards.
///
/// The network must outlive every endpoint and every served ParameterServer; its destructor
/// kills the ps tasks still running and joins their threads.
class InProcessNetwork {
 public:
  /// @param num_ps the number of ps tasks (served with `serve`)
  explicit InProcessNetwork(std::uint32_t num_ps) {
    for (std::uint32_t i = 0; i < num_ps; ++i) mailboxes_.push_back(std::make_unique<Mailbox>());
  }
  InProcessNetwork(const InProcessNetwork&) = delete;
  InProcessNetwork& operator=(const InProcessNetwork&) = delete;

  ~InProcessNetwork() {
    for (std::uint32_t i = 0; i < num_ps(); ++i) kill(Node::ps(i));
    join();
  }

  /// Number of ps tasks.
  [[nodiscard]] std::uint32_t num_ps() const noexcept {
    return static_cast<std::uint32_t>(mailboxes_.size());
  }

  /// Serves ps task `server.task()`. `Server` is any type with `handle(Request&&, Responder)`,
  /// `stopped()` and `task()`, i.e. a ParameterServer. Requests sent before are handled now.
  template <class Server>
  void serve(Server& server) {
    const std::uint32_t task = server.task();
    if (task >= num_ps()) {
      throw Error(ErrorCode::kInvalidArgument, "no ps task " + std::to_string(task) + " here");
    }
    Mailbox& box = *mailboxes_[task];
    if (box.host) {
      throw Error(ErrorCode::kAlreadyExists,
                  "ps task " + std::to_string(task) + " is served already");
    }
    {
      std::scoped_lock lock(box.serving, box.mutex);
      box.host = std::make_unique<HostOf<Server>>(server);
    }
    threads_.emplace_back([this, &box, task] { run(box, task); });
  }

  /// Waits until every served ps task has ended (after Shutdown, or killed).
  void join() {
    for (std::thread& t : threads_) {
      if (t.joinable()) t.join();
    }
  }

  /// Loses the next `count` requests sent to ps `ps` (from `from` only, if given).
  void drop_next(std::uint32_t ps, std::size_t count, std::optional<Node> from = {}) {
    std::scoped_lock lock(faults_mutex_);
    drops_.push_back({ps, count, from});
  }

  /// Makes `node` slow: a client waits `delay` before each request it sends, a ps before
  /// each request it handles. A zero delay ends the slowdown.
  void delay(Node node, std::chrono::microseconds delay) {
    std::scoped_lock lock(faults_mutex_);
    delays_[node] = delay;
  }

  /// Kills `node` as a crash would.
  void kill(Node node) {
    {
      std::scoped_lock lock(faults_mutex_);
      dead_[node] = true;
    }
    if (node.job == Node::Job::kPs && node.index < num_ps()) {
      Mailbox& box = *mailboxes_[node.index];
      {
        std::scoped_lock lock(box.mutex);
        box.killed = true;
      }
      box.wake.notify_all();
    }
  }

  /// True once `node` was killed.
  [[nodiscard]] bool is_dead(Node node) const {
    std::scoped_lock lock(faults_mutex_);
    auto it = dead_.find(node);
    return it != dead_.end() && it->second;
  }

 private:
  friend class InProcess;

  /// One call in flight: where its answer goes. Answered at most once, and not at all
  /// once the caller cancelled (then the targets may be gone).
  struct Call : CallControl {
    PullTargets targets;

    void complete(Response&& response) {
      unless_cancelled([&] {
        if (answered()) return;
        auto* pull = std::get_if<PullReply>(&response);
        if (pull && !detail::copy_into(*pull, targets)) {
          response = ErrorReply{ErrorCode::kInvalidArgument, "pull reply does not fit its targets"};
        }
        answer(std::move(response));
      });
    }
  };

  struct Envelope {
    Request request;
    std::shared_ptr<Call> call;
  };

  /// A served ps task, whatever its ParameterServer type.
  struct Host {
    virtual ~Host() = default;
    virtual void handle(Request&& request, Responder reply) = 0;
    [[nodiscard]] virtual bool stopped() const = 0;
  };
  template <class Server>
  struct HostOf final : Host {
    explicit HostOf(Server& s) : server(s) {}
    void handle(Request&& request, Responder reply) override {
      server.handle(std::move(request), std::move(reply));
    }
    [[nodiscard]] bool stopped() const override { return server.stopped(); }
    Server& server;
  };

  struct Mailbox {
    std::mutex serving;  ///< held while the ps handles a request, on whichever thread
    std::mutex mutex;    ///< guards the rest; taken after `serving`
    std::condition_variable wake;
    std::deque<Envelope> queue;  ///< for the ps's own thread; no sender skips it
    std::unique_ptr<Host> host;  ///< set by serve()
    bool killed = false;
    bool closed = false;            ///< shut down or killed: nothing more is handled
    std::atomic<bool> dead{false};  ///< killed and flushed: every answer is kUnavailable
  };

  struct DropRule {
    std::uint32_t ps;
    std::size_t remaining;
    std::optional<Node> from;
  };

  static Response unavailable(const std::string& who) {
    return ErrorReply{ErrorCode::kUnavailable, who + " is unavailable (killed)"};
  }

  PendingCall send(Node from, std::uint32_t ps, Request&& request, PullTargets&& targets) {
    auto call = std::make_shared<Call>();
    call->targets = std::move(targets);
    PendingCall pending(call);
    if (ps >= num_ps()) {
      call->complete(ErrorReply{ErrorCode::kInvalidArgument,
                                "no ps task " + std::to_string(ps) + " in this cluster"});
      return pending;
    }
    if (is_dead(from)) {
      call->complete(unavailable(from.name()));
      return pending;
    }
    if (auto d = delay_of(from); d.count() > 0) std::this_thread::sleep_for(d);
    if (take_drop(ps, from)) {
      std::scoped_lock lock(faults_mutex_);
      lost_.push_back(std::move(call));  // never answered; the caller's deadline fires
      return pending;
    }
    Mailbox& box = *mailboxes_[ps];
    std::unique_lock serving(box.serving, std::try_to_lock);
    {
      std::scoped_lock lock(box.mutex);
      if (box.killed || box.closed) {
        call->complete(box.killed
                           ? unavailable(Node::ps(ps).name())
                           : Response{ErrorReply{ErrorCode::kCancelled,
                                                 "ps " + std::to_string(ps) + " shut down"}});
        return pending;
      }
      const bool idle = serving.owns_lock() && box.host && box.queue.empty();
      if (!idle || delay_of(Node::ps(ps)).count() > 0) {
        box.queue.push_back({std::move(request), std::move(call)});
        box.wake.notify_one();
        return pending;
      }
    }
    handle(box, ps, std::move(request), call);  // here and now, holding `serving`
    return pending;
  }

  /// Hands one request to the ps; the caller holds `box.serving`.
  static void handle(Mailbox& box, std::uint32_t task, Request&& request,
                     const std::shared_ptr<Call>& call) {
    // One use while the ps reads the request's views: a caller that gives up waits for it.
    call->unless_cancelled([&] {
      try {
        box.host->handle(std::move(request), [&box, call, task](Response&& r) {
          call->complete(box.dead ? unavailable(Node::ps(task).name()) : std::move(r));
        });
      } catch (const std::exception& e) {  // a throwing policy must not take the ps down
        call->complete(ErrorReply{ErrorCode::kInvalidArgument,
                                  "ps " + std::to_string(task) + " failed: " + e.what()});
      }
    });
    if (box.host->stopped()) {
      {
        std::scoped_lock lock(box.mutex);
        box.closed = true;
      }
      box.wake.notify_all();
    }
  }

  /// The ps task's own thread: serves the queue, and ends the task when it is shut down or
  /// killed.
  void run(Mailbox& box, std::uint32_t task) {
    for (;;) {
      {
        std::unique_lock lock(box.mutex);
        box.wake.wait(lock, [&] { return box.killed || box.closed || !box.queue.empty(); });
        if (box.killed || box.closed) break;
      }
      if (auto d = delay_of(Node::ps(task)); d.count() > 0) std::this_thread::sleep_for(d);
      std::scoped_lock serving(box.serving);
      Envelope envelope;
      {
        std::scoped_lock lock(box.mutex);
        if (box.killed || box.closed || box.queue.empty()) continue;
        envelope = std::move(box.queue.front());
        box.queue.pop_front();
      }
      handle(box, task, std::move(envelope.request), envelope.call);
    }
    std::scoped_lock serving(box.serving);
    std::deque<Envelope> orphans;
    {
      std::scoped_lock lock(box.mutex);
      box.closed = true;
      orphans = std::move(box.queue);
      if (box.killed) box.dead = true;
    }
    if (box.dead) {
      // A crashed ps answers nothing; the clients' connections break. Flush the requests it
      // held (token and pull waiters) so that they fail now instead of at their deadline.
      box.host->handle(Shutdown{}, [](Response&&) {});
    }
    for (Envelope& e : orphans) {
      e.call->complete(box.dead ? unavailable(Node::ps(task).name())
                                : Response{ErrorReply{ErrorCode::kCancelled, "ps shut down"}});
    }
  }

  std::chrono::microseconds delay_of(Node node) const {
    std::scoped_lock lock(faults_mutex_);
    auto it = delays_.find(node);
    return it == delays_.end() ? std::chrono::microseconds{0} : it->second;
  }

  bool take_drop(std::uint32_t ps, Node from) {
    std::scoped_lock lock(faults_mutex_);
    for (DropRule& rule : drops_) {
      if (rule.ps == ps && rule.remaining > 0 && (!rule.from || *rule.from == from)) {
        --rule.remaining;
        std::erase_if(drops_, [](const DropRule& r) { return r.remaining == 0; });
        return true;
      }
    }
    return false;
  }

  std::vector<std::unique_ptr<Mailbox>> mailboxes_;
  std::vector<std::thread> threads_;
  mutable std::mutex faults_mutex_;
  std::vector<DropRule> drops_;
  std::map<Node, std::chrono::microseconds> delays_;
  std::map<Node, bool> dead_;
  std::vector<std::shared_ptr<Call>> lost_;
};

/// A client endpoint on an InProcessNetwork: the in-process `Transport`.
class InProcess {
 public:
  /// @param network the cluster's fabric (must outlive this endpoint)
  /// @param self    who is calling, for the fault injector
  InProcess(InProcessNetwork& network, Node self) : network_(&network), self_(self) {}

  /// Number of ps tasks in the network.
  [[nodiscard]] std::size_t num_ps() const noexcept { return network_->num_ps(); }
  /// Who this endpoint speaks for.
  [[nodiscard]] Node self() const noexcept { return self_; }

  /// Sends `request` to ps `ps`; see the Transport concept for the contract.
  PendingCall call(std::size_t ps, Request&& request, PullTargets targets = {}) {
    return network_->send(self_, static_cast<std::uint32_t>(ps), std::move(request),
                          std::move(targets));
  }

 private:
  InProcessNetwork* network_;
  Node self_;
};
static_assert(Transport<InProcess>);

}  // namespace pulley
// ---- end pulley/transport/in_process.hpp ----
// ---- begin pulley/worker.hpp ----

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace pulley {

/// What one training step did.
struct StepResult {
  float loss = 0.0F;              ///< the batch's mean loss
  std::int64_t local_step = 0;    ///< the step its gradient was computed for
  std::int64_t global_step = 0;   ///< steps completed when its token was taken
  std::uint32_t stale_parts = 0;  ///< part gradients the ps dropped as stale
};

/// A worker task: pulls parameters into its model, computes gradients on its own batches
/// and pushes them (seed 002's pull → feed → compute → push; the ps does the update).
///
/// @tparam M the Model it trains (owned: the worker pulls into its parameters in place)
/// @tparam T the Transport that reaches the ps tasks
template <Model M, Transport T>
class Worker {
 public:
  /// @param index this worker's task index (tags its pushes and token requests)
  Worker(std::uint32_t index, M model, T transport, ClientOptions options = {})
      : index_(index), model_(std::move(model)), client_(std::move(transport), options) {
    const auto variables = std::span<const VariableSpec>(model_.variables());
    all_.reserve(variables.size());
    for (std::size_t v = 0; v < variables.size(); ++v) {
      all_.push_back({v, {0, variables[v].rows()}, model_.parameter(v)});
      gradients_.push_back(model_.gradient(v));
    }
  }

  /// Not copyable or movable: it keeps views of its model's buffers.
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  /// Blocks until the chief has initialized every ps, and learns where variables live.
  void wait_ready() { client_.wait_ready(model_.variables()); }

  /// One synchronous-or-not training step on `batch`: take a sync token (under Async,
  /// whose tokens never wait, only once: the pulls report the global step), make sure the
  /// model holds the parameters of that step (pulling them unless the last step already
  /// did), compute the gradient, then push it and pull the next step's parameters in one
  /// round trip (`push_pull`). Under Async that prefetch is what the next step computes on
  /// (as MXNet's kvstore does): after a long pause, `pull()` first to start from the newest
  /// values. If the token shows that `last_step` global steps are done,
  /// nothing is computed and nullopt is returned: the caller stops (TF's StopAtStepHook).
  std::optional<StepResult> step(
      const typename M::Batch& batch,
      std::int64_t last_step = std::numeric_limits<std::int64_t>::max()) {
    // Unpaced (Async) tokens are never waited for: after the first, the step the last pull
    // reported serves as the token, and the round trip is saved.
    const TokenReply token = paced_ || pulled_step_ < 0 ? client_.take_token(index_)
                                                        : TokenReply{0, pulled_step_, true, false};
    paced_ = token.paced;
    global_step_ = token.global_step;
    if (token.global_step >= last_step) return std::nullopt;
    if (pulled_step_ < token.local_step) pull_all(token.local_step);
    StepResult result;
    result.loss = static_cast<float>(model_.compute_gradients(batch));
    result.local_step = token.local_step;
    result.global_step = token.global_step;
    // Pull the next step's parameters with the push: once this step completes if nothing
    // else of this worker is needed for it, else at once (the next token may be this step's).
    result.stale_parts = push_pull(
        token.local_step, token.one_token_per_step ? token.local_step + 1 : token.local_step);
    return result;
  }

  /// Pushes the model's current gradients tagged with `local_step`, then pulls every
  /// variable once the ps tasks have completed `pull_step` steps (0: at once, with this
  /// push applied), in one round trip: both requests go out together and each ps answers
  /// the pull after handling the push. Returns the number of part gradients dropped as
  /// stale.
  std::uint32_t push_pull(std::int64_t local_step, std::int64_t pull_step) {
    pulled_step_ = -1;  // a pull that fails part way leaves the model mixed: pull again
    const auto done = client_.push_pull(index_, local_step, gradients_, all_, pull_step);
    pulled_step_ = done.pulled_step;
    return done.stale_parts;
  }

  /// Pulls every variable.
  void pull() { pull_all(0); }
  /// Pulls one variable.
  void pull(std::string_view variable) {
    const std::size_t v = client_.variable_index(variable);
    const PullRequest request = all_[v];
    pulled_step_ = -1;  // the model now mixes steps: the next step pulls everything
    client_.pull(std::span(&request, 1), 0);
  }
  /// Pulls rows `rows` of one variable into the same rows of the model's copy.
  void pull(std::string_view variable, RowRange rows) {
    const std::size_t v = client_.variable_index(variable);
    const std::size_t row_size = client_.variables()[v].row_size();
    if (rows.end > client_.variables()[v].rows() || rows.empty()) {
      throw Error(ErrorCode::kInvalidArgument,
                  "rows out of range for '" + std::string(variable) + "'");
    }
    const PullRequest request{v, rows,
                              all_[v].into.subspan(rows.begin * row_size, rows.size() * row_size)};
    pulled_step_ = -1;  // the model now mixes steps: the next step pulls everything
    client_.pull(std::span(&request, 1), 0);
  }

  /// Pushes the model's current gradients tagged with `local_step`, pulling nothing;
  /// returns the number of part gradients dropped as stale.
  std::uint32_t push(std::int64_t local_step) {
    return client_.push(index_, local_step, gradients_);
  }

  /// The model it trains, with the parameters of the last pull.
  [[nodiscard]] M& model() noexcept { return model_; }
  /// The model it trains, with the parameters of the last pull.
  [[nodiscard]] const M& model() const noexcept { return model_; }
  /// This worker's task index.
  [[nodiscard]] std::uint32_t index() const noexcept { return index_; }
  /// The global step seen with the last token (Async: with the last pull).
  [[nodiscard]] std::int64_t global_step() const noexcept { return global_step_; }
  /// Where each variable lives, once `wait_ready` returned.
  [[nodiscard]] const Placement& placement() const noexcept { return client_.placement(); }

 private:
  void pull_all(std::int64_t min_step) {
    pulled_step_ = -1;  // a pull that fails part way leaves the model mixed: pull again
    pulled_step_ = client_.pull(all_, min_step);
  }

  std::uint32_t index_;
  M model_;
  detail::Client<T> client_;
  std::vector<PullRequest> all_;                   ///< every variable into the model
  std::vector<std::span<const float>> gradients_;  ///< the model's gradient buffers
  std::int64_t global_step_ = 0;
  std::int64_t pulled_step_ = -1;  ///< the model holds every variable as of this step or later
  bool paced_ = true;              ///< the sync policy makes workers wait for tokens
};

}  // namespace pulley
// ---- end pulley/worker.hpp ----
// ---- end pulley/pulley.hpp ----
