// SPDX-License-Identifier: MIT
//
// pulley 0.3.0 - single-header edition: the core: standard library only.
//
// GENERATED FILE - DO NOT EDIT. It is include/pulley/pulley.hpp with every
// pulley header inlined, produced by scripts/amalgamate.py; edit the headers
// under include/ and rerun the script.
#pragma once

// ---- begin pulley/pulley.hpp ----

/// pulley: a header-only parameter-server framework. This header is the core — the policy
/// concepts, the stock policies, the hosts and the in-process transport — and needs nothing
/// but the standard library. What needs more stands apart, each with its CMake target:
/// models (`models/`, pulley::models: xtensor), the TCP transport (`transport/tcp.hpp`,
/// pulley::tcp: Asio and cereal), cluster discovery (`cluster/`, pulley::cluster:
/// nlohmann-json) and the role runner (`runner/`, pulley::runner: all of them).
///
/// The layers, each a folder, each using only those before it (docs/ARCHITECTURE.md):
///   contracts   core/, protocol/, concepts/
///   policies    optimizers/, sharding/, sync/, tables/, (models/)
///   storage     checkpoint/
///   hosts       ps/ (ParameterServer), client/ (Worker, Chief, Evaluator)
///   transports  transport/
///   cluster and runner

// ---- begin pulley/checkpoint/directory.hpp ----

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <set>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

// ---- begin pulley/checkpoint/delta.hpp ----

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

// ---- begin pulley/checkpoint/model_state.hpp ----

#include <cstdint>
#include <string>
#include <vector>

// ---- begin pulley/core/variable.hpp ----

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

  /// Its fields on the wire (see messages.hpp).
  template <class Archive>
  void serialize(Archive& archive) {
    archive(kind, value);
  }

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

  /// Its fields on the wire (see messages.hpp).
  template <class Archive>
  void serialize(Archive& archive) {
    archive(name, shape, initializer);
  }

  friend bool operator==(const VariableSpec&, const VariableSpec&) = default;
};

/// An embedding table as the model declares it: rows of `dim` floats keyed by 64-bit ids,
/// with no fixed vocabulary. A row exists on the ps that holds its id from the first time it
/// is admitted (see below), with a value that depends only on the initializer, the table's
/// name, the id and the job's seed, so that it is the same whichever ps holds it and
/// whatever order ids arrive in. A worker pulls and pushes only the rows its batch touches.
struct TableSpec {
  std::string name;
  std::size_t dim = 0;      ///< floats per row
  Initializer initializer;  ///< of each new row: zeros, constant, uniform or normal
  /// Admission: a row is created only once its id was pulled this many times (1: at once).
  /// Until then it reads as its initial value, and pushes to it are dropped and counted.
  std::uint32_t admit_after = 1;
  /// Eviction: a row neither pulled nor pushed for this many global steps is removed (and
  /// starts again from its initial value if it comes back); 0 keeps rows for ever.
  std::int64_t evict_after_steps = 0;
  /// Cap: the most rows of this table one ps holds (0: no cap). A pull that would create a
  /// row past it first evicts the least recently touched eighth of the ps's rows (rows
  /// touched at the current step stay; if none can go, the row is not created: it reads as
  /// its initial value and pushes to it are dropped, both counted). The ids admission
  /// counts are held to as many.
  std::uint64_t max_rows = 0;

  /// Its fields on the wire (see messages.hpp).
  template <class Archive>
  void serialize(Archive& archive) {
    archive(name, dim, initializer, admit_after, evict_after_steps, max_rows);
  }

  friend bool operator==(const TableSpec&, const TableSpec&) = default;
};

/// A half-open range of rows `[begin, end)` of one variable.
struct RowRange {
  std::size_t begin = 0;
  std::size_t end = 0;

  [[nodiscard]] constexpr std::size_t size() const noexcept { return end - begin; }
  [[nodiscard]] constexpr bool empty() const noexcept { return end <= begin; }
  /// Its fields on the wire (see messages.hpp).
  template <class Archive>
  void serialize(Archive& archive) {
    archive(begin, end);
  }
  friend constexpr bool operator==(RowRange, RowRange) = default;
};

}  // namespace pulley
// ---- end pulley/core/variable.hpp ----

namespace pulley {

/// An optimizer slot of one variable (Adam's "m", Momentum's "accumulation"): one value per
/// element of the variable, row-major as the variable.
struct SlotState {
  std::string name;
  std::vector<float> values;

  friend bool operator==(const SlotState&, const SlotState&) = default;
};

/// The optimizer's counters of one part of a variable (Adam's "t"), with the rows that part
/// held: counters belong to a part, since each part is updated on its own.
struct PartCounters {
  RowRange rows;
  std::vector<std::int64_t> values;  ///< one per counter name, in order

  friend bool operator==(const PartCounters&, const PartCounters&) = default;
};

/// One variable as a checkpoint holds it: its values, its optimizer slots and counters.
struct VariableState {
  VariableSpec spec;
  std::vector<float> values;                ///< spec.size() floats, row-major
  std::vector<SlotState> slots;             ///< each spec.size() floats
  std::vector<std::string> counter_names;   ///< e.g. {"t"}
  std::vector<PartCounters> counters;       ///< by part, in row order

  friend bool operator==(const VariableState&, const VariableState&) = default;
};

/// One embedding table as a checkpoint holds it: every row the ps tasks held at the cut
/// (an incremental checkpoint's: those touched since its base, and the ids evicted since),
/// with its optimizer slots and the step it was last touched, and the ids admission was
/// counting (pulled, not admitted yet). Rows are in no particular order.
struct TableState {
  TableSpec spec;
  std::vector<std::string> slot_names;  ///< the row-wise optimizer's, in row order
  std::vector<std::uint64_t> ids;       ///< one per row, distinct
  /// Per row, its `spec.dim` values then each slot's `spec.dim` floats: `stride()` floats.
  std::vector<float> rows;
  std::vector<std::uint32_t> touched;   ///< per row: the global step it was last pulled or pushed
  std::vector<std::uint64_t> candidate_ids;     ///< ids pulled, not admitted yet
  std::vector<std::uint32_t> candidate_counts;  ///< per candidate: pulls counted
  std::vector<std::uint32_t> candidate_steps;   ///< per candidate: the step last pulled
  /// The table's update count (lazy Adam's `t`) on each ps that wrote the checkpoint, by
  /// task (all the largest when a ps task had left the job): restored as it was onto as
  /// many ps tasks, else every ps takes the largest.
  std::vector<std::int64_t> updates;
  /// An incremental checkpoint's: the ids of rows evicted since its base (a row evicted and
  /// created again is among `ids` too: remove these first, then take the rows).
  std::vector<std::uint64_t> evicted;

  /// Floats per row: its values and slots.
  [[nodiscard]] std::size_t stride() const noexcept { return (1 + slot_names.size()) * spec.dim; }

  friend bool operator==(const TableState&, const TableState&) = default;
};

/// What a job needs to go on from a global step: every variable with its optimizer state,
/// its embedding tables' rows, and the sync policy's state, as one consistent cut across
/// all ps tasks (Chief::save_state).
struct ModelState {
  /// Global steps completed at the cut.
  std::int64_t global_step = 0;
  /// The sync policy's state at the cut (`SyncPolicy::save`), the same on every ps.
  std::vector<std::int64_t> pacer;
  std::vector<VariableState> variables;
  std::vector<TableState> tables;
  /// The seed the tables' rows start from (a row not held reads as its initial value).
  std::uint64_t table_seed = 0;
  /// -1 for a full checkpoint. An incremental one's tables hold only the rows changed since
  /// the checkpoint of this global step (its base), and the rows evicted since: it is whole
  /// applied over its base (`apply_delta`, checkpoint/delta.hpp). Its dense parts, counts
  /// and sync state are whole.
  std::int64_t base_step = -1;

  /// True for an incremental checkpoint (base_step ≥ 0).
  [[nodiscard]] bool incremental() const noexcept { return base_step >= 0; }

  /// The variables' specs, in order.
  [[nodiscard]] std::vector<VariableSpec> specs() const {
    std::vector<VariableSpec> out;
    for (const VariableState& v : variables) out.push_back(v.spec);
    return out;
  }
  /// The tables' specs, in order.
  [[nodiscard]] std::vector<TableSpec> table_specs() const {
    std::vector<TableSpec> out;
    for (const TableState& t : tables) out.push_back(t.spec);
    return out;
  }

  friend bool operator==(const ModelState&, const ModelState&) = default;
};

}  // namespace pulley
// ---- end pulley/checkpoint/model_state.hpp ----
// ---- begin pulley/core/error.hpp ----

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
  kCancelled = 7,           ///< the caller gave the request up
  kOutOfRange = 8,          ///< training is over: the chief ended it (TF's OutOfRangeError)
  kAborted = 9,             ///< the chief aborted training
  kInternal = 10,           ///< a ps failed while handling a request (a policy threw)
  kPermissionDenied = 11,   ///< the sender's role may not make this request
  kUnauthenticated = 12,    ///< a peer of another job, or without the job's secret
  kDataLoss = 13,           ///< stored data that is corrupt or truncated (a checkpoint)
  kResourceExhausted = 14,  ///< a limit is reached (rows of a table on one ps)
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
    case ErrorCode::kOutOfRange:
      return "out_of_range";
    case ErrorCode::kAborted:
      return "aborted";
    case ErrorCode::kInternal:
      return "internal";
    case ErrorCode::kPermissionDenied:
      return "permission_denied";
    case ErrorCode::kUnauthenticated:
      return "unauthenticated";
    case ErrorCode::kResourceExhausted:
      return "resource_exhausted";
    case ErrorCode::kDataLoss:
      return "data_loss";
  }
  return "unknown";
}

/// The exception every pulley call throws for a failed request; `code()` says which kind.
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message)
      : std::runtime_error(std::string(to_string(code)) + ": " + message), code_(code) {}

  /// Which kind of failure.
  [[nodiscard]] ErrorCode code() const noexcept { return code_; }
  /// The message without the code's name in front.
  [[nodiscard]] const char* message() const noexcept {
    return what() + to_string(code_).size() + 2;
  }

 private:
  ErrorCode code_;
};

}  // namespace pulley
// ---- end pulley/core/error.hpp ----

namespace pulley {

/// Applies the incremental checkpoint `delta` over `base`, the whole state at `delta`'s base
/// step (a full checkpoint, or deltas already applied over one): `base` becomes the whole
/// state at `delta`'s step. Per table, the rows `delta` says were evicted go, then its rows
/// replace those of the same id or join them; admission counts and update counts are
/// `delta`'s (they are whole in every checkpoint), as are the dense parts and the sync
/// state. A full `delta` simply replaces `base`. Throws kInvalidArgument, leaving `base` as
/// it was, when `delta` is not over `base` (another step, other tables or slots).
///
/// Costs O(rows of `base` × log rows of `delta`) time and memory for `delta`'s ids only.
inline void apply_delta(ModelState& base, ModelState delta) {
  if (!delta.incremental()) {
    base = std::move(delta);
    return;
  }
  if (base.incremental() || base.global_step != delta.base_step) {
    throw Error(ErrorCode::kInvalidArgument,
                "an incremental checkpoint over global step " + std::to_string(delta.base_step) +
                    " applied over " + (base.incremental() ? "another incremental one" : "the state of step " +
                                                                     std::to_string(base.global_step)));
  }
  if (base.tables.size() != delta.tables.size()) {
    throw Error(ErrorCode::kInvalidArgument, "an incremental checkpoint of " + std::to_string(delta.tables.size()) +
                                                 " tables over one of " + std::to_string(base.tables.size()));
  }
  for (std::size_t t = 0; t < base.tables.size(); ++t) {
    const TableState& a = base.tables[t];
    const TableState& b = delta.tables[t];
    if (a.spec.name != b.spec.name || a.spec.dim != b.spec.dim || a.slot_names != b.slot_names) {
      throw Error(ErrorCode::kInvalidArgument, "an incremental checkpoint's table '" + b.spec.name +
                                                   "' is not its base's '" + a.spec.name + "' (name, dim, slots)");
    }
  }
  for (std::size_t t = 0; t < base.tables.size(); ++t) {
    TableState& into = base.tables[t];
    TableState& d = delta.tables[t];
    const std::size_t stride = into.stride();
    std::vector<std::uint64_t> gone = std::move(d.evicted);
    std::sort(gone.begin(), gone.end());
    // The delta's rows by id.
    std::vector<std::pair<std::uint64_t, std::size_t>> changed(d.ids.size());
    for (std::size_t i = 0; i < d.ids.size(); ++i) changed[i] = {d.ids[i], i};
    std::sort(changed.begin(), changed.end());
    std::vector<bool> placed(d.ids.size(), false);
    // One pass over the base's rows: evicted ones go (the rest close up), changed ones take
    // the delta's values.
    std::size_t kept = 0;
    for (std::size_t r = 0; r < into.ids.size(); ++r) {
      const std::uint64_t id = into.ids[r];
      const auto c = std::lower_bound(changed.begin(), changed.end(), std::pair{id, std::size_t{0}});
      const bool is_changed = c != changed.end() && c->first == id;
      if (!is_changed && std::binary_search(gone.begin(), gone.end(), id)) continue;
      const float* from = into.rows.data() + r * stride;
      std::uint32_t touched = into.touched[r];
      if (is_changed) {
        from = d.rows.data() + c->second * stride;
        touched = d.touched[c->second];
        placed[c->second] = true;
      }
      into.ids[kept] = id;
      into.touched[kept] = touched;
      std::copy(from, from + stride, into.rows.begin() + static_cast<std::ptrdiff_t>(kept * stride));
      ++kept;
    }
    into.ids.resize(kept);
    into.touched.resize(kept);
    into.rows.resize(kept * stride);
    // Rows the base did not hold join it.
    for (std::size_t i = 0; i < d.ids.size(); ++i) {
      if (placed[i]) continue;
      into.ids.push_back(d.ids[i]);
      into.touched.push_back(d.touched[i]);
      into.rows.insert(into.rows.end(), d.rows.begin() + static_cast<std::ptrdiff_t>(i * stride),
                       d.rows.begin() + static_cast<std::ptrdiff_t>((i + 1) * stride));
    }
    into.spec = std::move(d.spec);
    into.candidate_ids = std::move(d.candidate_ids);
    into.candidate_counts = std::move(d.candidate_counts);
    into.candidate_steps = std::move(d.candidate_steps);
    into.updates = std::move(d.updates);
  }
  base.global_step = delta.global_step;
  base.pacer = std::move(delta.pacer);
  base.variables = std::move(delta.variables);
  base.table_seed = delta.table_seed;
  base.base_step = -1;
}

}  // namespace pulley
// ---- end pulley/checkpoint/delta.hpp ----
// ---- begin pulley/checkpoint/format.hpp ----

/// One checkpoint on disk: a directory holding two files.
///
///   data   every tensor (each variable's values, then its slots), float32 little-endian,
///          each starting at a multiple of 64 bytes; then each embedding table's arrays
///          (ids, rows, last-touched steps, admission counts), each in chunks of at most
///          64 MiB, each chunk starting at a multiple of 64 bytes
///   index  what the tensors are: "PULLEYCK", the format version, the global step, the sync
///          policy's state, and per variable its name, shape, initializer, where each of its
///          tensors lies in `data` with its CRC-32C, its slot names and its counters by part;
///          then (version 2) the tables' seed, per table its spec, slot names, update
///          counts, and where each chunk of its arrays lies with its CRC-32C; (version 3)
///          the base step of an incremental checkpoint (-1: a full one) and per table the
///          ids evicted since it; last, the CRC-32C of everything before it
///
/// Versions 1 (pulley 0.2, no tables) and 2 (tables, no incremental checkpoints) still read.
///
/// `write_checkpoint` writes both files and flushes them to the disk (fsync) before it
/// returns; `read_checkpoint` checks every length against what is left and every CRC, and
/// throws `kDataLoss` naming what is wrong, so a checkpoint cut short by a crash or damaged
/// on disk is never taken for a good one. Integers are little-endian.
///
/// The format's constants are in checkpoint/format_constants.hpp, write_checkpoint in
/// checkpoint/write.hpp, the reading side in checkpoint/read.hpp; this header includes them
/// all.

// ---- begin pulley/checkpoint/format_constants.hpp ----

/// The checkpoint format's constants (the format is described in checkpoint/format.hpp):
/// the index's magic and format versions, and how the data file lays out its tensors and
/// the tables' arrays. The format is little-endian, so big-endian hosts are refused here.

#include <bit>
#include <cstddef>
#include <cstdint>

static_assert(std::endian::native == std::endian::little,
              "pulley's checkpoint format is little-endian; big-endian hosts are not supported");

namespace pulley::checkpoint {

inline constexpr char kMagic[8] = {'P', 'U', 'L', 'L', 'E', 'Y', 'C', 'K'};
inline constexpr std::uint32_t kFormatVersion = 3;  ///< bumped on any incompatible change
inline constexpr std::uint32_t kOldestVersion = 1;  ///< the oldest version read
inline constexpr std::size_t kChunkBytes = std::size_t{64} << 20U;  ///< of a table's arrays
inline constexpr std::size_t kAlignment = 64;  ///< of each tensor in the data file

}  // namespace pulley::checkpoint
// ---- end pulley/checkpoint/format_constants.hpp ----
// ---- begin pulley/checkpoint/read.hpp ----

/// The reading side of a checkpoint (checkpoint/format.hpp describes the format):
/// read_checkpoint, the whole state or only its index, and read_checkpoint_into, which reads
/// into the memory of the tensors a state already holds; every length and CRC is checked.

#include <fcntl.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

// ---- begin pulley/checkpoint/crc32c.hpp ----

/// CRC-32C (Castagnoli), the checksum of every tensor in a checkpoint: what TensorFlow's
/// checkpoints and most storage formats use. x86-64 computes it with the SSE 4.2 `crc32`
/// instruction when the processor has it (checked at run time, no compiler flag needed),
/// elsewhere with a table, eight bytes at a time.

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

namespace pulley::checkpoint {

namespace detail {

/// Eight tables of 256 entries: table[k][b] is the CRC of byte b followed by k zero bytes.
constexpr std::array<std::array<std::uint32_t, 256>, 8> make_crc_tables() noexcept {
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  for (std::uint32_t b = 0; b < 256; ++b) {
    std::uint32_t c = b;
    for (int i = 0; i < 8; ++i) c = (c & 1U) != 0 ? (c >> 1U) ^ 0x82F63B78U : c >> 1U;
    t[0][b] = c;
  }
  for (std::size_t k = 1; k < 8; ++k) {
    for (std::uint32_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8U) ^ t[0][t[k - 1][b] & 0xFFU];
  }
  return t;
}

inline constexpr auto kCrcTables = make_crc_tables();

/// The table version, on the running CRC's inverted state.
inline std::uint32_t crc32c_table(std::uint32_t state, const unsigned char* p, std::size_t n) noexcept {
  const auto& t = kCrcTables;
  while (n >= 8) {
    std::uint64_t word = 0;
    std::memcpy(&word, p, 8);
    word ^= state;
    state = t[7][word & 0xFFU] ^ t[6][(word >> 8U) & 0xFFU] ^ t[5][(word >> 16U) & 0xFFU] ^
            t[4][(word >> 24U) & 0xFFU] ^ t[3][(word >> 32U) & 0xFFU] ^
            t[2][(word >> 40U) & 0xFFU] ^ t[1][(word >> 48U) & 0xFFU] ^ t[0][word >> 56U];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) state = (state >> 8U) ^ t[0][(state ^ *p++) & 0xFFU];
  return state;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/// One stream of the SSE 4.2 instruction, on the raw (not inverted) state.
__attribute__((target("sse4.2"))) inline std::uint64_t crc32c_sse42_stream(
    std::uint64_t state, const unsigned char* p, std::size_t n) noexcept {
  for (; n >= 8; p += 8, n -= 8) {
    std::uint64_t word = 0;
    std::memcpy(&word, p, 8);
    state = __builtin_ia32_crc32di(state, word);
  }
  return state;
}

/// The bytes of each of the three streams crc32c_sse42 runs side by side.
inline constexpr std::size_t kCrcStreamBytes = 8192;

/// The raw CRC state after kCrcStreamBytes zero bytes, as a function of the state before:
/// linear over GF(2), so four tables of 256 entries (one per byte of the state) hold it.
struct CrcShift {
  std::array<std::array<std::uint32_t, 256>, 4> table{};

  CrcShift() noexcept {
    std::array<std::uint32_t, 32> basis{};
    static constexpr unsigned char kZeros[kCrcStreamBytes] = {};
    for (std::size_t i = 0; i < 32; ++i) {
      basis[i] = static_cast<std::uint32_t>(
          crc32c_sse42_stream(std::uint64_t{1} << i, kZeros, kCrcStreamBytes));
    }
    for (std::size_t k = 0; k < 4; ++k) {
      for (std::uint32_t b = 0; b < 256; ++b) {
        std::uint32_t shifted = 0;
        for (std::size_t i = 0; i < 8; ++i) {
          if ((b >> i & 1U) != 0) shifted ^= basis[8 * k + i];
        }
        table[k][b] = shifted;
      }
    }
  }
  [[nodiscard]] std::uint32_t operator()(std::uint32_t state) const noexcept {
    return table[0][state & 0xFFU] ^ table[1][(state >> 8U) & 0xFFU] ^
           table[2][(state >> 16U) & 0xFFU] ^ table[3][state >> 24U];
  }
};

/// The SSE 4.2 version. The instruction takes three cycles and issues one a cycle, so three
/// independent streams over consecutive blocks run about three times as fast as one (what
/// a checkpoint read needs to keep up with the page cache); the CRC is linear, so the
/// streams' states are joined by shifting each past the blocks after it.
__attribute__((target("sse4.2"))) inline std::uint32_t crc32c_sse42(std::uint32_t state,
                                                                   const unsigned char* p,
                                                                   std::size_t n) noexcept {
  static const CrcShift shift;
  constexpr std::size_t kBlock = kCrcStreamBytes;
  std::uint64_t s0 = state;
  for (; n >= 3 * kBlock; p += 3 * kBlock, n -= 3 * kBlock) {
    std::uint64_t s1 = 0;
    std::uint64_t s2 = 0;
    for (std::size_t i = 0; i < kBlock; i += 8) {
      std::uint64_t w0 = 0;
      std::uint64_t w1 = 0;
      std::uint64_t w2 = 0;
      std::memcpy(&w0, p + i, 8);
      std::memcpy(&w1, p + kBlock + i, 8);
      std::memcpy(&w2, p + 2 * kBlock + i, 8);
      s0 = __builtin_ia32_crc32di(s0, w0);
      s1 = __builtin_ia32_crc32di(s1, w1);
      s2 = __builtin_ia32_crc32di(s2, w2);
    }
    const std::uint32_t joined = shift(static_cast<std::uint32_t>(s0)) ^ static_cast<std::uint32_t>(s1);
    s0 = shift(joined) ^ static_cast<std::uint32_t>(s2);
  }
  auto s32 = static_cast<std::uint32_t>(crc32c_sse42_stream(s0, p, n));
  for (p += n & ~std::size_t{7}, n &= 7U; n > 0; --n) s32 = __builtin_ia32_crc32qi(s32, *p++);
  return s32;
}

inline bool have_sse42() noexcept {
  static const bool have = __builtin_cpu_supports("sse4.2");
  return have;
}
#endif

}  // namespace detail

/// Extends the CRC-32C `crc` of earlier bytes with `bytes` (start with 0).
inline std::uint32_t crc32c(std::span<const std::byte> bytes, std::uint32_t crc = 0) noexcept {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  std::uint32_t state = ~crc;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (detail::have_sse42()) return ~detail::crc32c_sse42(state, p, bytes.size());
#endif
  return ~detail::crc32c_table(state, p, bytes.size());
}

/// The CRC-32C of a tensor's bytes.
inline std::uint32_t crc32c(std::span<const float> values, std::uint32_t crc = 0) noexcept {
  return crc32c(std::as_bytes(values), crc);
}

}  // namespace pulley::checkpoint
// ---- end pulley/checkpoint/crc32c.hpp ----
// ---- begin pulley/checkpoint/detail/file.hpp ----

/// detail::File, a file descriptor whose writes, reads and flushes are checked (throwing
/// kUnavailable when the system refuses, kDataLoss when a read finds the file cut short),
/// and detail::sync_directory: the disk access shared by the checkpoint writer and reader.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>

namespace pulley::checkpoint::detail {

/// A file descriptor, closed when it goes.
class File {
 public:
  File(const std::filesystem::path& path, int flags, mode_t mode = 0644)
      : fd_(::open(path.c_str(), flags | O_CLOEXEC, mode)), path_(path) {
    if (fd_ < 0) fail("cannot open");
  }
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File() {
    if (fd_ >= 0) ::close(fd_);
  }

  /// Writes all of `bytes`.
  void write(std::span<const std::byte> bytes) {
    while (!bytes.empty()) {
      const ssize_t n = ::write(fd_, bytes.data(), bytes.size());
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) fail("cannot write");
      bytes = bytes.subspan(static_cast<std::size_t>(n));
    }
  }
  /// Reads exactly `out.size()` bytes at `offset`; throws kDataLoss if the file ends first.
  void read_at(std::span<std::byte> out, std::uint64_t offset) const {
    while (!out.empty()) {
      const ssize_t n = ::pread(fd_, out.data(), out.size(), static_cast<off_t>(offset));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail("cannot read");
      if (n == 0) throw Error(ErrorCode::kDataLoss, path_.string() + " is truncated");
      out = out.subspan(static_cast<std::size_t>(n));
      offset += static_cast<std::uint64_t>(n);
    }
  }
  /// The file's size in bytes.
  [[nodiscard]] std::uint64_t size() const {
    struct stat info {};
    if (::fstat(fd_, &info) != 0) fail("cannot stat");
    return static_cast<std::uint64_t>(info.st_size);
  }
  /// Flushes what was written to the disk.
  void sync() {
    if (::fsync(fd_) != 0) fail("cannot flush");
  }

 private:
  [[noreturn]] void fail(const char* what) const {
    throw Error(ErrorCode::kUnavailable,
                std::string(what) + " " + path_.string() + ": " + std::strerror(errno));
  }

  int fd_;
  std::filesystem::path path_;
};

/// Flushes a directory's entries (a file created or renamed in it) to the disk.
inline void sync_directory(const std::filesystem::path& dir) {
  File d(dir, O_RDONLY | O_DIRECTORY);
  d.sync();
}

}  // namespace pulley::checkpoint::detail
// ---- end pulley/checkpoint/detail/file.hpp ----
// ---- begin pulley/checkpoint/detail/index_fields.hpp ----

/// The fields of a checkpoint's index: detail::IndexWriter appends little-endian fields to
/// a byte string, detail::IndexReader reads them back, each checked against the bytes left,
/// and detail::TensorRef (where a tensor lies in the data file) is written and read with
/// put_ref and get_ref.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace pulley::checkpoint::detail {

/// Appends little-endian fields to a byte string.
class IndexWriter {
 public:
  template <class T>
  void put(T value) {
    static_assert(std::is_arithmetic_v<T>);
    bytes_.append(reinterpret_cast<const char*>(&value), sizeof value);
  }
  void put(std::string_view text) {
    put(static_cast<std::uint32_t>(text.size()));
    bytes_.append(text);
  }
  [[nodiscard]] const std::string& bytes() const noexcept { return bytes_; }
  std::string& bytes() noexcept { return bytes_; }

 private:
  std::string bytes_;
};

/// Reads fields back, each checked against the bytes left; a count is checked to fit.
class IndexReader {
 public:
  IndexReader(std::span<const char> bytes, std::string where)
      : bytes_(bytes), where_(std::move(where)) {}

  template <class T>
  T get() {
    static_assert(std::is_arithmetic_v<T>);
    T value{};
    take(&value, sizeof value);
    return value;
  }
  std::string get_string() {
    const auto n = get<std::uint32_t>();
    if (n > bytes_.size()) bad("a string longer than the index");
    std::string out(bytes_.data(), n);
    bytes_ = bytes_.subspan(n);
    return out;
  }
  /// A count of items of at least `bytes_each` bytes each: no more than can follow.
  std::uint32_t get_count(std::size_t bytes_each) {
    const auto n = get<std::uint32_t>();
    if (static_cast<std::uint64_t>(n) * bytes_each > bytes_.size())
      bad("a count larger than the index");
    return n;
  }
  [[nodiscard]] std::size_t left() const noexcept { return bytes_.size(); }
  [[noreturn]] void bad(const std::string& what) const {
    throw Error(ErrorCode::kDataLoss, where_ + ": " + what);
  }

 private:
  void take(void* out, std::size_t n) {
    if (n > bytes_.size()) bad("the index ends in the middle of a field");
    std::memcpy(out, bytes_.data(), n);
    bytes_ = bytes_.subspan(n);
  }

  std::span<const char> bytes_;
  std::string where_;
};

/// Where a tensor lies in the data file.
struct TensorRef {
  std::uint64_t offset = 0;
  std::uint64_t floats = 0;
  std::uint32_t crc = 0;
};

inline void put_ref(IndexWriter& w, const TensorRef& r) {
  w.put(r.offset);
  w.put(r.floats);
  w.put(r.crc);
}
inline TensorRef get_ref(IndexReader& r) {
  TensorRef ref;
  ref.offset = r.get<std::uint64_t>();
  ref.floats = r.get<std::uint64_t>();
  ref.crc = r.get<std::uint32_t>();
  return ref;
}

}  // namespace pulley::checkpoint::detail
// ---- end pulley/checkpoint/detail/index_fields.hpp ----

namespace pulley::checkpoint {

namespace detail {

/// Reads `count` bytes at `offset` into `out` and returns their CRC-32C, a chunk at a time so
/// that each is summed while it is still in the processor's cache.
inline std::uint32_t read_summed(const File& file, std::span<std::byte> out, std::uint64_t offset) {
  constexpr std::size_t kChunk = std::size_t{256} << 10U;
  std::uint32_t crc = 0;
  while (!out.empty()) {
    const std::span<std::byte> chunk = out.first(std::min(kChunk, out.size()));
    file.read_at(chunk, offset);
    crc = crc32c(std::span<const std::byte>(chunk), crc);
    offset += chunk.size();
    out = out.subspan(chunk.size());
  }
  return crc;
}

/// Makes `tensor` hold `n` floats. New memory of 4 MiB or more is first asked to be backed by
/// huge pages (madvise; where transparent huge pages are on "madvise", as Debian's default):
/// a read into memory not touched yet is bound by its page faults, 512 times fewer so.
inline void size_for_read(std::vector<float>& tensor, std::size_t n) {
#if defined(MADV_HUGEPAGE)
  constexpr std::uintptr_t kHuge = std::uintptr_t{2} << 20U;
  if (tensor.capacity() < n && n * sizeof(float) >= 2 * kHuge) {
    std::vector<float> fresh;
    fresh.reserve(n);
    const auto begin = reinterpret_cast<std::uintptr_t>(fresh.data());
    const std::uintptr_t from = (begin + kHuge - 1) & ~(kHuge - 1);
    const std::uintptr_t to = (begin + n * sizeof(float)) & ~(kHuge - 1);
    if (to > from) ::madvise(reinterpret_cast<void*>(from), to - from, MADV_HUGEPAGE);  // a hint
    tensor = std::move(fresh);
  }
#endif
  tensor.resize(n);
}

/// Takes the tensors of `old`, by variable name and slot name, to read into again.
class TensorPool {
 public:
  explicit TensorPool(ModelState& old) {
    for (VariableState& v : old.variables) {
      tensors_.push_back({v.spec.name, {}, &v.values});
      for (SlotState& s : v.slots) tensors_.push_back({v.spec.name, s.name, &s.values});
    }
  }
  /// Moves the pooled tensor of `variable` (its slot `slot`, or its values when empty) into
  /// `into`, if there is one.
  void take(const std::string& variable, const std::string& slot, std::vector<float>& into) {
    for (Entry& e : tensors_) {
      if (e.from != nullptr && e.variable == variable && e.slot == slot) {
        into = std::move(*e.from);
        e.from = nullptr;
        return;
      }
    }
  }

 private:
  struct Entry {
    std::string variable, slot;
    std::vector<float>* from;
  };
  std::vector<Entry> tensors_;
};

/// `table_rows`, if given, gets each table's row count and then its count of evicted ids
/// from the index (read with or without the values): two numbers per table.
inline ModelState read_checkpoint(const std::filesystem::path& dir, bool values, ModelState* reuse,
                                  std::vector<std::uint64_t>* table_rows = nullptr);

}  // namespace detail

/// Reads the checkpoint in `dir`. With `values` false only the index is read (every field
/// checked, the tensors left empty): what the checkpoint holds, without its weight. Throws
/// kDataLoss naming the problem for anything incomplete or damaged (a missing index, a
/// wrong magic or version, a bad CRC, a data file shorter than the index says).
inline ModelState read_checkpoint(const std::filesystem::path& dir, bool values = true) {
  return detail::read_checkpoint(dir, values, nullptr);
}

/// Reads the checkpoint in `dir` into `into`, reading each tensor into the memory of the
/// tensor of the same variable and slot that `into` holds, if any: an evaluator that scores
/// checkpoint after checkpoint, or a ps restored again, touches no new memory (on a machine
/// where first touching memory costs more than reading it, several times as fast). `into`
/// is replaced whole, and on an error (as read_checkpoint) left valid but unspecified.
inline void read_checkpoint_into(const std::filesystem::path& dir, ModelState& into) {
  into = detail::read_checkpoint(dir, true, &into);
}

inline ModelState detail::read_checkpoint(const std::filesystem::path& dir, bool values,
                                          ModelState* reuse,
                                          std::vector<std::uint64_t>* table_rows) {
  const std::string where = "checkpoint " + dir.string();
  std::string bytes;
  {
    std::error_code ec;
    if (!std::filesystem::exists(dir / "index", ec)) {
      throw Error(ErrorCode::kDataLoss, where + " has no index (it was never finished)");
    }
    detail::File file(dir / "index", O_RDONLY);
    const std::uint64_t size = file.size();
    if (size > (std::uint64_t{1} << 32U))
      throw Error(ErrorCode::kDataLoss, where + ": an index of 4 GiB or more");
    bytes.resize(static_cast<std::size_t>(size));
    file.read_at(std::as_writable_bytes(std::span(bytes.data(), bytes.size())), 0);
  }
  if (bytes.size() < sizeof kMagic + 8 || std::memcmp(bytes.data(), kMagic, sizeof kMagic) != 0) {
    throw Error(ErrorCode::kDataLoss, where + ": not a pulley checkpoint index");
  }
  std::uint32_t stored_crc = 0;
  std::memcpy(&stored_crc, bytes.data() + bytes.size() - 4, 4);
  const auto body = std::span(bytes.data(), bytes.size() - 4);
  if (crc32c(std::as_bytes(body)) != stored_crc) {
    throw Error(ErrorCode::kDataLoss,
                where + ": the index is damaged (its CRC-32C does not match)");
  }
  detail::IndexReader in(body.subspan(sizeof kMagic), where);
  const auto version = in.get<std::uint32_t>();
  if (version < kOldestVersion || version > kFormatVersion) {
    in.bad("format version " + std::to_string(version) + ", this pulley reads versions " +
           std::to_string(kOldestVersion) + " to " + std::to_string(kFormatVersion));
  }
  ModelState state;
  state.global_step = in.get<std::int64_t>();
  for (std::uint32_t i = 0, n = in.get_count(8); i < n; ++i)
    state.pacer.push_back(in.get<std::int64_t>());
  struct Pending {
    std::vector<float>* into;
    detail::TensorRef ref;
    std::string what;
  };
  std::vector<Pending> tensors;
  const std::uint32_t num_variables = in.get_count(20);
  state.variables.resize(num_variables);
  for (VariableState& v : state.variables) {
    v.spec.name = in.get_string();
    for (std::uint32_t d = 0, rank = in.get_count(8); d < rank; ++d) {
      v.spec.shape.push_back(static_cast<std::size_t>(in.get<std::uint64_t>()));
    }
    v.spec.initializer.kind = static_cast<Initializer::Kind>(in.get<std::uint8_t>());
    v.spec.initializer.value = in.get<float>();
    tensors.push_back({&v.values, detail::get_ref(in), "'" + v.spec.name + "'"});
    for (std::uint32_t s = 0, n = in.get_count(24); s < n; ++s) {
      v.slots.push_back({in.get_string(), {}});
      tensors.push_back({nullptr, detail::get_ref(in),
                         "slot '" + v.slots.back().name + "' of '" + v.spec.name + "'"});
    }
    for (std::uint32_t c = 0, n = in.get_count(4); c < n; ++c)
      v.counter_names.push_back(in.get_string());
    for (std::uint32_t p = 0, n = in.get_count(16); p < n; ++p) {
      PartCounters part;
      part.rows.begin = static_cast<std::size_t>(in.get<std::uint64_t>());
      part.rows.end = static_cast<std::size_t>(in.get<std::uint64_t>());
      for (std::size_t c = 0; c < v.counter_names.size(); ++c)
        part.values.push_back(in.get<std::int64_t>());
      v.counters.push_back(std::move(part));
    }
  }
  // Tables (version 2): their specs and where their arrays' chunks lie.
  struct PendingArray {
    std::vector<detail::TensorRef> chunks;
    std::string what;
  };
  std::vector<PendingArray> arrays;
  struct Counts {
    std::uint64_t rows, candidates, evicted;
  };
  std::vector<Counts> counts;     // per table
  std::uint64_t array_bytes = 0;  // of every table, in all
  if (version >= 2) {
    const std::uint32_t num_tables = in.get_count(40);
    state.table_seed = in.get<std::uint64_t>();
    if (version >= 3) state.base_step = in.get<std::int64_t>();
    if (state.base_step < -1 || (state.base_step >= 0 && state.base_step >= state.global_step)) {
      in.bad("an incremental checkpoint over global step " + std::to_string(state.base_step) +
             ", not before its own " + std::to_string(state.global_step));
    }
    state.tables.resize(num_tables);
    for (TableState& t : state.tables) {
      t.spec.name = in.get_string();
      t.spec.dim = static_cast<std::size_t>(in.get<std::uint64_t>());
      t.spec.initializer.kind = static_cast<Initializer::Kind>(in.get<std::uint8_t>());
      t.spec.initializer.value = in.get<float>();
      t.spec.admit_after = in.get<std::uint32_t>();
      t.spec.evict_after_steps = in.get<std::int64_t>();
      t.spec.max_rows = in.get<std::uint64_t>();
      for (std::uint32_t k = 0, n = in.get_count(4); k < n; ++k)
        t.slot_names.push_back(in.get_string());
      for (std::uint32_t k = 0, n = in.get_count(8); k < n; ++k)
        t.updates.push_back(in.get<std::int64_t>());
      const auto rows = in.get<std::uint64_t>();
      const auto candidates = in.get<std::uint64_t>();
      const std::uint64_t evicted = version >= 3 ? in.get<std::uint64_t>() : 0;
      if (table_rows != nullptr) table_rows->insert(table_rows->end(), {rows, evicted});
      counts.push_back({rows, candidates, evicted});
      if (t.spec.dim == 0 || t.spec.dim > (std::size_t{1} << 16U) || t.slot_names.size() > 64) {
        in.bad("table '" + t.spec.name + "' has dim " + std::to_string(t.spec.dim) + " and " +
               std::to_string(t.slot_names.size()) + " slots");
      }
      // Sizes are checked against the data file before anything is allocated.
      const std::uint64_t stride_bytes = t.stride() * sizeof(float);
      const std::string what = "table '" + t.spec.name + "'";
      auto array = [&](std::uint64_t count, std::uint64_t each, std::string part) {
        PendingArray a;
        a.what = what + " (" + std::move(part) + ")";
        if (count > (std::uint64_t{1} << 48U) / each) in.bad(a.what + " has too many elements");
        // Laid out as the writer does: whole chunks of kChunkBytes, the last one shorter.
        const std::uint64_t bytes_n = count * each;
        const std::uint64_t chunks = (bytes_n + kChunkBytes - 1) / kChunkBytes;
        if (in.get_count(20) != chunks) in.bad(a.what + " is not cut into chunks of 64 MiB");
        for (std::uint64_t c = 0; c < chunks; ++c) {
          a.chunks.push_back(detail::get_ref(in));
          if (a.chunks.back().floats !=
              std::min<std::uint64_t>(kChunkBytes, bytes_n - c * kChunkBytes)) {
            in.bad(a.what + " is not cut into chunks of 64 MiB");
          }
        }
        array_bytes += bytes_n;
        if (array_bytes > (std::uint64_t{1} << 62U)) in.bad("tables larger than any data file");
        arrays.push_back(std::move(a));
      };
      array(rows, 8, "ids");
      array(rows, stride_bytes, "rows");
      array(rows, 4, "steps");
      array(candidates, 8, "candidate ids");
      array(candidates, 4, "candidate counts");
      array(candidates, 4, "candidate steps");
      if (version >= 3) array(evicted, 8, "evicted ids");
    }
  }
  if (in.left() != 0) in.bad("bytes after the last table");
  // Slot tensors point into the slots now that the vectors will not move.
  {
    std::size_t t = 0;
    for (VariableState& v : state.variables) {
      ++t;
      for (SlotState& s : v.slots) tensors[t++].into = &s.values;
    }
  }
  for (const VariableState& v : state.variables) {
    for (const PartCounters& c : v.counters) {
      if (c.rows.empty() || c.rows.end > v.spec.rows())
        in.bad("counters of '" + v.spec.name + "' for rows it does not have");
    }
  }
  std::optional<detail::TensorPool> pool;
  if (reuse != nullptr && values) pool.emplace(*reuse);
  detail::File data(dir / "data", O_RDONLY);
  const std::uint64_t data_size = data.size();
  for (std::size_t t = 0, vi = 0; t < tensors.size(); ++vi) {
    const VariableState& v = state.variables[vi];
    for (std::size_t k = 0; k <= v.slots.size(); ++k, ++t) {
      const Pending& p = tensors[t];
      if (p.ref.floats != v.spec.size()) in.bad(p.what + " has the wrong number of elements");
      const std::uint64_t bytes_n = p.ref.floats * sizeof(float);
      if (p.ref.offset > data_size || bytes_n > data_size - p.ref.offset) {
        throw Error(ErrorCode::kDataLoss, where + ": the data file is truncated (" + p.what + ")");
      }
      if (!values) continue;
      if (pool) pool->take(v.spec.name, k == 0 ? std::string() : v.slots[k - 1].name, *p.into);
      detail::size_for_read(*p.into, static_cast<std::size_t>(p.ref.floats));
      if (detail::read_summed(data, std::as_writable_bytes(std::span(*p.into)), p.ref.offset) !=
          p.ref.crc) {
        throw Error(ErrorCode::kDataLoss, where + ": " + p.what + " is damaged (CRC-32C mismatch)");
      }
    }
  }
  // The tables' arrays: each chunk checked to lie in the data file, and all of them to fit
  // it, before anything is allocated; then read and summed.
  if (array_bytes > data_size)
    throw Error(ErrorCode::kDataLoss, where + ": the data file is truncated (tables)");
  for (const PendingArray& a : arrays) {
    for (const detail::TensorRef& c : a.chunks) {
      if (c.offset > data_size || c.floats > data_size - c.offset) {
        throw Error(ErrorCode::kDataLoss, where + ": the data file is truncated (" + a.what + ")");
      }
    }
  }
  if (values) {
    std::size_t k = 0;
    for (TableState& t : state.tables) {
      auto bytes_of = [](auto& vector, std::size_t n) {
        vector.resize(n);
        return std::as_writable_bytes(std::span(vector));
      };
      const Counts& n = counts[static_cast<std::size_t>(&t - state.tables.data())];
      const std::span<std::byte> into[7] = {bytes_of(t.ids, n.rows),
                                            bytes_of(t.rows, n.rows * t.stride()),
                                            bytes_of(t.touched, n.rows),
                                            bytes_of(t.candidate_ids, n.candidates),
                                            bytes_of(t.candidate_counts, n.candidates),
                                            bytes_of(t.candidate_steps, n.candidates),
                                            bytes_of(t.evicted, n.evicted)};
      for (const std::span<std::byte> target : std::span(into).first(version >= 3 ? 7 : 6)) {
        const PendingArray& a = arrays[k++];
        std::size_t at = 0;
        for (const detail::TensorRef& c : a.chunks) {
          if (c.floats > target.size() - at)
            throw Error(ErrorCode::kInternal, where + ": " + a.what + " overflows");
          const std::span<std::byte> chunk = target.subspan(at, c.floats);
          if (detail::read_summed(data, chunk, c.offset) != c.crc) {
            throw Error(ErrorCode::kDataLoss,
                        where + ": " + a.what + " is damaged (CRC-32C mismatch)");
          }
          at += chunk.size();
        }
      }
    }
  }
  return state;
}

}  // namespace pulley::checkpoint
// ---- end pulley/checkpoint/read.hpp ----
// ---- begin pulley/checkpoint/write.hpp ----

/// write_checkpoint: a ModelState written as a checkpoint (checkpoint/format.hpp describes
/// the format), both files flushed to the disk before it returns.

#include <fcntl.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace pulley::checkpoint {

/// Writes `state` as a checkpoint in the directory `dir`, which must not exist yet (it is
/// created): the data file, then the index, each flushed to the disk, then the directory.
/// Throws kInvalidArgument for a state whose tensors do not fit its specs, kUnavailable when
/// the disk refuses.
inline void write_checkpoint(const std::filesystem::path& dir, const ModelState& state) {
  for (const VariableState& v : state.variables) {
    const std::size_t n = v.spec.size();
    bool fits = v.values.size() == n;
    for (const SlotState& s : v.slots) fits = fits && s.values.size() == n;
    for (const PartCounters& c : v.counters)
      fits = fits && c.values.size() == v.counter_names.size();
    if (!fits) {
      throw Error(ErrorCode::kInvalidArgument,
                  "checkpoint: the tensors of '" + v.spec.name + "' do not fit its shape");
    }
  }
  for (const TableState& t : state.tables) {
    const std::size_t n = t.ids.size(), c = t.candidate_ids.size();
    if (t.spec.dim == 0 || t.rows.size() != n * t.stride() || t.touched.size() != n ||
        t.candidate_counts.size() != c || t.candidate_steps.size() != c) {
      throw Error(ErrorCode::kInvalidArgument,
                  "checkpoint: the rows of table '" + t.spec.name + "' do not fit it");
    }
  }
  std::error_code ec;
  if (!std::filesystem::create_directory(dir, ec)) {
    throw Error(ErrorCode::kUnavailable, "cannot create " + dir.string() + ": " +
                                             (ec ? ec.message() : std::string("it exists")));
  }
  detail::IndexWriter index;
  index.bytes().append(kMagic, sizeof kMagic);
  index.put(kFormatVersion);
  index.put(state.global_step);
  index.put(static_cast<std::uint32_t>(state.pacer.size()));
  for (const std::int64_t x : state.pacer) index.put(x);
  index.put(static_cast<std::uint32_t>(state.variables.size()));
  {
    detail::File data(dir / "data", O_WRONLY | O_CREAT | O_EXCL);
    std::uint64_t offset = 0;
    static constexpr std::byte kZeros[kAlignment] = {};
    // Writes `bytes` at the next multiple of kAlignment; returns where they start.
    auto write_aligned = [&](std::span<const std::byte> bytes) {
      const std::uint64_t at = offset;
      data.write(bytes);
      offset += bytes.size();
      const std::size_t pad = (kAlignment - offset % kAlignment) % kAlignment;
      data.write(std::span(kZeros, pad));
      offset += pad;
      return at;
    };
    auto put_tensor = [&](const std::vector<float>& values) {
      const auto bytes = std::as_bytes(std::span(values));
      detail::put_ref(index, {write_aligned(bytes), values.size(), crc32c(bytes)});
    };
    for (const VariableState& v : state.variables) {
      index.put(std::string_view(v.spec.name));
      index.put(static_cast<std::uint32_t>(v.spec.shape.size()));
      for (const std::size_t d : v.spec.shape) index.put(static_cast<std::uint64_t>(d));
      index.put(static_cast<std::uint8_t>(v.spec.initializer.kind));
      index.put(v.spec.initializer.value);
      put_tensor(v.values);
      index.put(static_cast<std::uint32_t>(v.slots.size()));
      for (const SlotState& s : v.slots) {
        index.put(std::string_view(s.name));
        put_tensor(s.values);
      }
      index.put(static_cast<std::uint32_t>(v.counter_names.size()));
      for (const std::string& name : v.counter_names) index.put(std::string_view(name));
      index.put(static_cast<std::uint32_t>(v.counters.size()));
      for (const PartCounters& c : v.counters) {
        index.put(static_cast<std::uint64_t>(c.rows.begin));
        index.put(static_cast<std::uint64_t>(c.rows.end));
        for (const std::int64_t x : c.values) index.put(x);
      }
    }
    // Each table's arrays, chunk by chunk: where each chunk lies and its CRC-32C (a chunk's
    // TensorRef counts bytes, not floats).
    auto put_array = [&](std::span<const std::byte> bytes) {
      const std::size_t chunks = (bytes.size() + kChunkBytes - 1) / kChunkBytes;
      index.put(static_cast<std::uint32_t>(chunks));
      for (std::size_t c = 0; c < chunks; ++c) {
        const std::span<const std::byte> chunk =
            bytes.subspan(c * kChunkBytes, std::min(kChunkBytes, bytes.size() - c * kChunkBytes));
        detail::put_ref(index, {write_aligned(chunk), chunk.size(), crc32c(chunk)});
      }
    };
    index.put(static_cast<std::uint32_t>(state.tables.size()));
    index.put(state.table_seed);
    index.put(state.base_step);
    for (const TableState& t : state.tables) {
      index.put(std::string_view(t.spec.name));
      index.put(static_cast<std::uint64_t>(t.spec.dim));
      index.put(static_cast<std::uint8_t>(t.spec.initializer.kind));
      index.put(t.spec.initializer.value);
      index.put(t.spec.admit_after);
      index.put(t.spec.evict_after_steps);
      index.put(t.spec.max_rows);
      index.put(static_cast<std::uint32_t>(t.slot_names.size()));
      for (const std::string& name : t.slot_names) index.put(std::string_view(name));
      index.put(static_cast<std::uint32_t>(t.updates.size()));
      for (const std::int64_t u : t.updates) index.put(u);
      index.put(static_cast<std::uint64_t>(t.ids.size()));
      index.put(static_cast<std::uint64_t>(t.candidate_ids.size()));
      index.put(static_cast<std::uint64_t>(t.evicted.size()));
      put_array(std::as_bytes(std::span(t.ids)));
      put_array(std::as_bytes(std::span(t.rows)));
      put_array(std::as_bytes(std::span(t.touched)));
      put_array(std::as_bytes(std::span(t.candidate_ids)));
      put_array(std::as_bytes(std::span(t.candidate_counts)));
      put_array(std::as_bytes(std::span(t.candidate_steps)));
      put_array(std::as_bytes(std::span(t.evicted)));
    }
    data.sync();
  }
  index.put(crc32c(std::as_bytes(std::span(index.bytes().data(), index.bytes().size()))));
  {
    detail::File file(dir / "index", O_WRONLY | O_CREAT | O_EXCL);
    file.write(std::as_bytes(std::span(index.bytes().data(), index.bytes().size())));
    file.sync();
  }
  detail::sync_directory(dir);
}

}  // namespace pulley::checkpoint
// ---- end pulley/checkpoint/write.hpp ----
// ---- end pulley/checkpoint/format.hpp ----
// ---- begin pulley/core/log.hpp ----

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <mutex>
#include <string>
#include <string>
#include <string_view>
#include <utility>

namespace pulley {

/// How much a log line matters.
enum class LogLevel : unsigned char {
  kInfo,     ///< progress: a task started, training reached a step
  kWarning,  ///< something went wrong and was dealt with (a connection dropped)
  kError,    ///< a task is about to fail
};

/// Where pulley's log lines go: called with one line at a time (no trailing newline), from
/// any thread, never concurrently (calls are serialized). It must not throw.
using LogSink = std::function<void(LogLevel, std::string_view)>;

namespace detail {

struct LogState {
  std::mutex mutex;
  LogSink sink;  ///< empty: stderr
};

inline LogState& log_state() {
  static LogState state;
  return state;
}

}  // namespace detail

/// Sends pulley's log lines to `sink` instead of stderr (an empty sink restores stderr);
/// returns the sink it replaces.
inline LogSink set_log_sink(LogSink sink) {
  detail::LogState& state = detail::log_state();
  std::scoped_lock lock(state.mutex);
  return std::exchange(state.sink, std::move(sink));
}

/// Writes one log line through the sink (by default to stderr, prefixed "pulley: ").
inline void log(LogLevel level, std::string_view line) noexcept {
  detail::LogState& state = detail::log_state();
  std::scoped_lock lock(state.mutex);
  if (state.sink) {
    try {
      state.sink(level, line);
    } catch (...) {  // a log line is never worth a failure
    }
    return;
  }
  static constexpr const char* kPrefix[] = {"", "warning: ", "error: "};
  std::fprintf(stderr, "pulley: %s%.*s\n", kPrefix[static_cast<int>(level)],
               static_cast<int>(line.size()), line.data());
  std::fflush(stderr);
}

/// Passes at most `per_second` lines a second on to `log`, and counts the rest, which the
/// next line that passes reports: a flood of bad requests must not flood the log. Not
/// thread-safe: one per thread that logs through it (a ps's, a server's).
class LimitedLog {
 public:
  explicit LimitedLog(int per_second = 20) noexcept : per_second_(per_second) {}

  /// Logs `line` at `level` unless this second's allowance is spent.
  void operator()(LogLevel level, const std::string& line) noexcept {
    const auto now = std::chrono::steady_clock::now();
    if (now - window_ > std::chrono::seconds(1)) {
      window_ = now;
      used_ = 0;
    }
    if (++used_ > per_second_) {
      ++suppressed_;
      return;
    }
    if (suppressed_ == 0) return log(level, line);
    try {
      log(level, line + " (" + std::to_string(std::exchange(suppressed_, 0)) +
                     " similar lines suppressed)");
    } catch (...) {  // no memory for the longer line: the line alone
      log(level, line);
    }
  }

 private:
  int per_second_;
  std::chrono::steady_clock::time_point window_{};
  int used_ = 0;
  std::uint64_t suppressed_ = 0;
};

}  // namespace pulley
// ---- end pulley/core/log.hpp ----

namespace pulley {

/// A directory of checkpoints, as the chief writes them and a restarted job or an evaluator
/// reads them: `ckpt-<global step>/` each (checkpoint/format.hpp), the last `keep` kept.
///
/// A checkpoint may be incremental (ModelState::base_step): its tables hold the rows changed
/// since the checkpoint of its base step, which it needs. `load` and `latest` read the
/// newest full checkpoint of its chain and apply the incremental ones after it, and `keep`
/// keeps every checkpoint a kept one needs.
///
/// A checkpoint is written whole or not at all: into a temporary directory (`.tmp-...`),
/// its files flushed to the disk, then renamed to its name and the parent flushed. A crash
/// at any instant leaves every earlier checkpoint as it was, and at most a temporary
/// directory, which the next save removes. Reading skips, with a log line, any checkpoint
/// that does not read back whole (truncated, damaged, of another format version).
class CheckpointDirectory {
 public:
  /// @param root the directory (created if missing)
  /// @param keep how many checkpoints to keep, newest first (TensorFlow's max_to_keep: 5); 0
  ///             keeps all
  explicit CheckpointDirectory(std::filesystem::path root, std::size_t keep = 5)
      : root_(std::move(root)), keep_(keep) {
    std::error_code ec;
    std::filesystem::create_directories(root_, ec);
    if (ec || !std::filesystem::is_directory(root_)) {
      throw Error(ErrorCode::kInvalidArgument,
                  "cannot use " + root_.string() + " as a checkpoint directory: " +
                      (ec ? ec.message() : std::string("not a directory")));
    }
  }

  /// The directory.
  [[nodiscard]] const std::filesystem::path& root() const noexcept { return root_; }

  /// The name of the checkpoint of global step `step`.
  static std::string name_of(std::int64_t step) {
    char name[32];
    std::snprintf(name, sizeof name, "ckpt-%012lld", static_cast<long long>(step));
    return name;
  }

  /// Writes `state` as the checkpoint of its global step and returns its path; keeps the
  /// last `keep` that read back whole. A checkpoint of that step that is already there is
  /// kept as it is if it reads back whole, and replaced (with a log line) if it does not.
  std::filesystem::path save(const ModelState& state) {
    remove_temporaries();
    const std::filesystem::path target = root_ / name_of(state.global_step);
    std::error_code ec;
    wrote_ = false;
    const bool there = std::filesystem::exists(target, ec);
    whole_.erase(state.global_step);  // read it again: this is the one chance to replace it
    if (there && reads_whole(state.global_step, target)) return target;
    const std::string suffix = "-" + std::to_string(::getpid());
    const std::filesystem::path temporary = root_ / (".tmp-" + name_of(state.global_step) + suffix);
    const std::filesystem::path damaged = root_ / (".tmp-" + name_of(state.global_step) + "-damaged" + suffix);
    std::filesystem::remove_all(temporary, ec);
    try {
      checkpoint::write_checkpoint(temporary, state);
      if (there) {  // out of the way first: a crash between the renames leaves only a temporary
        log(LogLevel::kWarning, "checkpoint " + target.string() + " does not read back whole: written again");
        std::filesystem::rename(target, damaged);
      }
      std::filesystem::rename(temporary, target);
      checkpoint::detail::sync_directory(root_);
      std::filesystem::remove_all(damaged, ec);
    } catch (const std::filesystem::filesystem_error& e) {
      std::filesystem::remove_all(temporary, ec);
      throw Error(ErrorCode::kUnavailable, "cannot save " + target.string() + ": " + e.what());
    } catch (...) {
      std::filesystem::remove_all(temporary, ec);
      throw;
    }
    whole_.insert(state.global_step);
    wrote_ = true;
    prune();
    return target;
  }

  /// Whether the last `save` wrote its state (false: a checkpoint of that step was there
  /// already and was kept, so what is on disk may differ from the state, and an
  /// incremental checkpoint must not be taken over it).
  [[nodiscard]] bool wrote() const noexcept { return wrote_; }

  /// The checkpoints there (finished ones: named `ckpt-<step>`), newest first.
  [[nodiscard]] std::vector<std::pair<std::int64_t, std::filesystem::path>> list() const {
    return list(root_);
  }

  /// The checkpoints in `root` (empty if it does not exist), newest first.
  static std::vector<std::pair<std::int64_t, std::filesystem::path>> list(
      const std::filesystem::path& root) {
    std::vector<std::pair<std::int64_t, std::filesystem::path>> found;
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(root, ec)) {
      const std::string name = entry.path().filename().string();
      if (name.size() != 17 || name.rfind("ckpt-", 0) != 0) continue;
      if (name.find_first_not_of("0123456789", 5) != std::string::npos) continue;
      found.emplace_back(std::stoll(name.substr(5)), entry.path());
    }
    std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    return found;
  }

  /// The newest checkpoint that reads back whole (every CRC checked, an incremental one with
  /// the checkpoints it needs), and where it is; any newer one that does not is logged and
  /// skipped. nullopt when there is none.
  [[nodiscard]] std::optional<std::pair<ModelState, std::filesystem::path>> latest() const {
    for (const auto& [step, path] : list()) {
      try {
        return std::pair{load(path), path};
      } catch (const Error& e) {
        log(LogLevel::kWarning, "skipping checkpoint " + path.string() + ": " + e.what());
      }
    }
    return std::nullopt;
  }

  /// The whole state the checkpoint in `path` holds: read, and if it is incremental, applied
  /// over the whole state of its base, found beside it (`apply_delta`), back to a full
  /// checkpoint. Throws kDataLoss when any of them does not read back whole or is missing.
  static ModelState load(const std::filesystem::path& path) {
    ModelState state;
    load_into(path, state);
    return state;
  }

  /// As load, into `state`; when `state` already holds the whole state of the checkpoint's
  /// base (an evaluator that reads checkpoints in order), only the checkpoint itself is
  /// read. On an error `state` is left valid but unspecified.
  static void load_into(const std::filesystem::path& path, ModelState& state) {
    // The chain, newest first: each checkpoint's base until a full one (or `state`'s step).
    std::vector<std::filesystem::path> chain{path};
    const bool have = !state.incremental() && !state.variables.empty();
    for (;;) {
      const ModelState head = checkpoint::read_checkpoint(chain.back(), false);
      if (!head.incremental() || (have && head.base_step == state.global_step)) break;
      if (chain.size() > kMaxChain) {
        throw Error(ErrorCode::kDataLoss, "checkpoint " + path.string() + ": more than " +
                                              std::to_string(kMaxChain) + " incremental checkpoints in a row");
      }
      const std::filesystem::path base = path.parent_path() / name_of(head.base_step);
      std::error_code ec;
      if (!std::filesystem::exists(base, ec)) {
        throw Error(ErrorCode::kDataLoss, "checkpoint " + chain.back().string() +
                                              " is incremental over global step " +
                                              std::to_string(head.base_step) + ", whose checkpoint is gone");
      }
      chain.push_back(base);
    }
    const ModelState first = checkpoint::read_checkpoint(chain.back(), false);
    if (!first.incremental()) {
      checkpoint::read_checkpoint_into(chain.back(), state);
      chain.pop_back();
    }
    for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
      ModelState delta = checkpoint::read_checkpoint(*it);
      try {
        apply_delta(state, std::move(delta));
      } catch (const Error& e) {
        throw Error(ErrorCode::kDataLoss, "checkpoint " + it->string() + ": " + e.what());
      }
    }
  }

  /// The most incremental checkpoints in a row `load` follows.
  static constexpr std::size_t kMaxChain = 10000;

 private:
  /// What a save cut short left behind.
  void remove_temporaries() {
    std::error_code ec;
    std::vector<std::filesystem::path> stale;
    for (const auto& entry : std::filesystem::directory_iterator(root_, ec)) {
      if (entry.path().filename().string().rfind(".tmp-ckpt-", 0) == 0) stale.push_back(entry.path());
    }
    for (const auto& path : stale) std::filesystem::remove_all(path, ec);
  }

  /// True if the checkpoint of `step` at `path` reads back whole (its own files, every CRC:
  /// not the checkpoints an incremental one needs). Each is read once: what this object
  /// wrote or read whole before is known.
  bool reads_whole(std::int64_t step, const std::filesystem::path& path) {
    if (whole_.contains(step)) return true;
    try {
      (void)checkpoint::read_checkpoint(path);
    } catch (const Error&) {
      return false;
    }
    whole_.insert(step);
    return true;
  }

  /// Removes all but the newest `keep` checkpoints that read back whole and those they need
  /// (an incremental checkpoint's base, back to a full one). A damaged checkpoint does not
  /// count: it goes once `keep` whole ones are newer.
  void prune() {
    if (keep_ == 0) return;
    const auto all = list();  // newest first
    std::vector<std::int64_t> needed;
    std::size_t kept_whole = 0;
    for (const auto& [step, path] : all) {
      const bool needed_by_a_kept_one = std::find(needed.begin(), needed.end(), step) != needed.end();
      if (kept_whole >= keep_ && !needed_by_a_kept_one) {
        std::error_code ec;
        std::filesystem::remove_all(path, ec);
        whole_.erase(step);
        continue;
      }
      if (!reads_whole(step, path)) continue;  // unreadable: it counts for nothing, needs nothing
      ++kept_whole;
      const ModelState head = checkpoint::read_checkpoint(path, false);
      if (head.incremental()) needed.push_back(head.base_step);
    }
  }

  std::filesystem::path root_;
  std::size_t keep_;
  bool wrote_ = false;
  std::set<std::int64_t> whole_;  ///< steps of the checkpoints known to read back whole
};

}  // namespace pulley
// ---- end pulley/checkpoint/directory.hpp ----
// ---- begin pulley/checkpoint/rows.hpp ----

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

// ---- begin pulley/core/id_index.hpp ----

#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <utility>
#include <vector>

// ---- begin pulley/core/hash.hpp ----

#include <cstdint>
#include <string_view>

namespace pulley {

/// pulley's hashes, each defined once: what seeds initial values, spreads table rows over
/// the ps tasks, keys id indexes and names a cluster. They depend only on their input, so
/// every process computes the same value.

/// FNV-1a (64 bits) of `text`, continuing from `hash` (the offset basis by default): mixes
/// a variable's name into its seed, so its initial values do not change when other
/// variables are added or reordered.
constexpr std::uint64_t name_hash(std::string_view text,
                                  std::uint64_t hash = 0xCBF29CE484222325ULL) noexcept {
  for (const char c : text) {
    hash ^= static_cast<unsigned char>(c);
    hash *= 0x100000001B3ULL;
  }
  return hash;
}

/// The SplitMix64 finalizer: neighbouring 64-bit ids give unrelated values.
constexpr std::uint64_t mix_id(std::uint64_t id) noexcept {
  id = (id ^ (id >> 30U)) * 0xBF58476D1CE4E5B9ULL;
  id = (id ^ (id >> 27U)) * 0x94D049BB133111EBULL;
  return id ^ (id >> 31U);
}

}  // namespace pulley
// ---- end pulley/core/hash.hpp ----
// ---- begin pulley/core/prefetch.hpp ----

#include <cstddef>

namespace pulley {

/// Asks the cache for the line holding `p` (the instruction never faults, whatever the
/// address; `p` must still point into an object or one past it).
///
/// On x86 it is an `asm volatile` prefetch, not `__builtin_prefetch`, which the compiler
/// may delete: GCC 12 at -O2 compiled a loop prefetching the lines of an embedding table's
/// record to nothing (and an unrolled form with a branch per line too, taking the first,
/// unconditional prefetch with it), and a sparse apply built that way ran 2.4x slower.
inline void prefetch(const void* p) noexcept {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p);
#endif
}

/// Asks the cache for every line of the `bytes` bytes at `p`.
inline void prefetch(const void* p, std::size_t bytes) noexcept {
  constexpr std::size_t kLine = 64;
  const auto* begin = static_cast<const char*>(p);
  for (std::size_t at = 0; at < bytes; at += kLine) prefetch(begin + at);
  if (bytes > 0) prefetch(begin + bytes - 1);  // the last line, when `p` is not line-aligned
}

}  // namespace pulley
// ---- end pulley/core/prefetch.hpp ----

namespace pulley {

/// pulley's one hash index of 64-bit ids: open addressing with linear probing over 32-bit
/// buckets, each holding an entry number + 1 (0: empty). It does not store the ids: the
/// caller keeps them where they belong (an embedding table's records, IdPositions' list)
/// and `key_of(entry)` gives an entry's id back, so a bucket costs 4 bytes. Removal shifts
/// entries back (no tombstones), so lookups never slow down with churn.
///
/// Ids are hashed with `mix_id(id ^ key)`: where ids come from a peer, give a random key,
/// so that chosen ids cannot pile onto one bucket (std::unordered_map hashes a 64-bit id to
/// itself). At most 2^32 - 2 entries.
class IdIndex {
 public:
  /// "No entry".
  static constexpr std::uint32_t kNone = std::numeric_limits<std::uint32_t>::max();

  /// @param key            keys the hash (see above)
  /// @param max_load_num   the index grows past `max_load_num / 4` full (2: half, 3: 3/4)
  explicit IdIndex(std::uint64_t key = 0, unsigned max_load_num = 3) noexcept
      : key_(key), max_load_num_(max_load_num) {}

  /// The entry whose id is `id`, or kNone.
  template <class KeyOf>
  [[nodiscard]] std::uint32_t find(std::uint64_t id, KeyOf&& key_of) const noexcept {
    if (buckets_.empty()) return kNone;
    for (std::size_t at = home(id);; at = next(at)) {
      const std::uint32_t bucket = buckets_[at];
      if (bucket == 0) return kNone;
      if (key_of(bucket - 1) == id) return bucket - 1;
    }
  }

  /// Adds `entry`, whose id (`key_of(entry)`) is not in the index yet. Grows first when
  /// full; a failed allocation leaves the index as it was.
  template <class KeyOf>
  void insert(std::uint32_t entry, KeyOf&& key_of) {
    if ((size_ + 1) * 4 > buckets_.size() * max_load_num_) grow(buckets_.size() * 2, key_of);
    place(key_of(entry), entry);
    ++size_;
  }

  /// The entry whose id is `id`, or, when there is none, `entry` added for it (its id must
  /// then be `id`); true if added. One probe either way.
  template <class KeyOf>
  std::pair<std::uint32_t, bool> emplace(std::uint64_t id, std::uint32_t entry, KeyOf&& key_of) {
    if ((size_ + 1) * 4 > buckets_.size() * max_load_num_) grow(buckets_.size() * 2, key_of);
    for (std::size_t at = home(id);; at = next(at)) {
      const std::uint32_t bucket = buckets_[at];
      if (bucket == 0) {
        buckets_[at] = entry + 1;
        ++size_;
        return {entry, true};
      }
      if (key_of(bucket - 1) == id) return {bucket - 1, false};
    }
  }

  /// Removes `entry` (present): the entries after it in its probe run move back into the
  /// hole unless their home lies between.
  template <class KeyOf>
  void erase(std::uint32_t entry, KeyOf&& key_of) noexcept {
    std::size_t hole = bucket_of(entry, key_of);
    for (std::size_t at = next(hole); buckets_[at] != 0; at = next(at)) {
      const std::size_t want = home(key_of(buckets_[at] - 1));
      const bool stays = hole <= at ? (want > hole && want <= at) : (want > hole || want <= at);
      if (!stays) {
        buckets_[hole] = buckets_[at];
        hole = at;
      }
    }
    buckets_[hole] = 0;
    --size_;
  }

  /// Entry `from` is now numbered `to` (its id unchanged; `key_of(from)` still gives it).
  template <class KeyOf>
  void renumber(std::uint32_t from, std::uint32_t to, KeyOf&& key_of) noexcept {
    buckets_[bucket_of(from, key_of)] = to + 1;
  }

  /// Room for `n` entries without growing.
  template <class KeyOf>
  void reserve(std::size_t n, KeyOf&& key_of) {
    if (n * 4 > buckets_.size() * max_load_num_) grow(n * 4 / max_load_num_ + 1, key_of);
  }

  /// Forgets every entry. An index much larger than what it held keeps less memory, so that
  /// one outsized batch does not make every later clear cost its size.
  void clear() noexcept {
    if (buckets_.size() > 64 && size_ * 16 < buckets_.size()) {
      std::vector<std::uint32_t>().swap(buckets_);
    } else {
      std::fill(buckets_.begin(), buckets_.end(), 0U);
    }
    size_ = 0;
  }

  /// Entries held.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// Bytes of its buckets.
  [[nodiscard]] std::size_t bytes() const noexcept { return buckets_.size() * sizeof(std::uint32_t); }

  /// Asks the cache for the bucket where `id`'s probe starts (a batch's lookups then wait
  /// for memory together, not one after the other).
  void prefetch(std::uint64_t id) const noexcept {
    if (!buckets_.empty()) pulley::prefetch(&buckets_[home(id)]);
  }
  /// The entry in the bucket where `id`'s probe starts (maybe another id's), or kNone: what
  /// to prefetch of the caller's records ahead of `find`.
  [[nodiscard]] std::uint32_t first_entry(std::uint64_t id) const noexcept {
    if (buckets_.empty()) return kNone;
    const std::uint32_t bucket = buckets_[home(id)];
    return bucket == 0 ? kNone : bucket - 1;
  }

 private:
  [[nodiscard]] std::size_t home(std::uint64_t id) const noexcept {
    return static_cast<std::size_t>(mix_id(id ^ key_)) & (buckets_.size() - 1);
  }
  [[nodiscard]] std::size_t next(std::size_t at) const noexcept { return (at + 1) & (buckets_.size() - 1); }

  void place(std::uint64_t id, std::uint32_t entry) noexcept {
    std::size_t at = home(id);
    while (buckets_[at] != 0) at = next(at);
    buckets_[at] = entry + 1;
  }

  template <class KeyOf>
  [[nodiscard]] std::size_t bucket_of(std::uint32_t entry, KeyOf&& key_of) const noexcept {
    std::size_t at = home(key_of(entry));
    while (buckets_[at] != entry + 1) at = next(at);
    return at;
  }

  /// At least `capacity` buckets (a power of two, 16 or more); the entries move over. The new
  /// buckets are allocated before the old ones are let go.
  template <class KeyOf>
  void grow(std::size_t capacity, KeyOf&& key_of) {
    std::vector<std::uint32_t> grown(std::bit_ceil(std::max<std::size_t>(16, capacity)), 0U);
    grown.swap(buckets_);
    for (const std::uint32_t bucket : grown) {
      if (bucket != 0) place(key_of(bucket - 1), bucket - 1);
    }
  }

  std::uint64_t key_;
  unsigned max_load_num_;
  std::size_t size_ = 0;
  std::vector<std::uint32_t> buckets_;
};

/// Distinct 64-bit ids numbered in the order they were added (their positions), found in
/// about one probe: what a worker's batch, a TableBatch and a ps's sparse accumulator look
/// ids up in. Kept at most half full, reused from batch to batch.
class IdPositions {
  /// An entry's id: its place in the list.
  struct KeyOf {
    const std::vector<std::uint64_t>* ids;
    std::uint64_t operator()(std::uint32_t entry) const noexcept { return (*ids)[entry]; }
  };

 public:
  /// "Not there".
  static constexpr std::size_t npos = std::numeric_limits<std::size_t>::max();

  /// @param key keys the hash (see IdIndex): random where ids come from a peer
  explicit IdPositions(std::uint64_t key = 0) noexcept : index_(key, 2) {}

  /// The position of `id`, and true if it was added now (its position is then size() - 1).
  std::pair<std::size_t, bool> insert(std::uint64_t id) {
    ids_.push_back(id);  // taken back below unless it is new
    std::pair<std::uint32_t, bool> placed;
    try {
      placed = index_.emplace(id, static_cast<std::uint32_t>(ids_.size() - 1), key_of());
    } catch (...) {
      ids_.pop_back();
      throw;
    }
    if (!placed.second) ids_.pop_back();
    return {placed.first, placed.second};
  }

  /// The position of `id`, or npos.
  [[nodiscard]] std::size_t find(std::uint64_t id) const noexcept {
    const std::uint32_t found = index_.find(id, key_of());
    return found == IdIndex::kNone ? npos : found;
  }

  /// The first id of `ids` that comes twice, or nullptr; afterwards the positions hold
  /// `ids` up to it (all of them when none comes twice).
  const std::uint64_t* first_duplicate(std::span<const std::uint64_t> ids) {
    clear();
    reserve(ids.size());
    for (const std::uint64_t& id : ids) {
      if (!insert(id).second) return &id;
    }
    return nullptr;
  }

  /// Room for `n` ids without growing.
  void reserve(std::size_t n) {
    ids_.reserve(n);
    index_.reserve(n, key_of());
  }
  /// Forgets every id.
  void clear() noexcept {
    ids_.clear();
    index_.clear();
  }
  /// The ids held.
  [[nodiscard]] std::size_t size() const noexcept { return ids_.size(); }
  /// The ids, by position.
  [[nodiscard]] std::span<const std::uint64_t> ids() const noexcept { return ids_; }

 private:
  [[nodiscard]] KeyOf key_of() const noexcept { return KeyOf{&ids_}; }

  std::vector<std::uint64_t> ids_;
  IdIndex index_;
};

}  // namespace pulley
// ---- end pulley/core/id_index.hpp ----
// ---- begin pulley/core/initializers.hpp ----

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

/// Fills `row` (`spec.dim` floats) with the initial value of row `id` of table `spec`: a
/// function of the initializer, the table's name, the id and `seed` alone. Glorot's rule has
/// no fans in a table; it is refused where a table is registered.
inline void initialize_row(const TableSpec& spec, std::uint64_t seed, std::uint64_t id,
                           std::span<float> row) {
  const VariableSpec as_vector{spec.name, {row.size()}, spec.initializer};
  initialize(as_vector, seed ^ mix_id(id ^ 0x9E3779B97F4A7C15ULL), row);
}

}  // namespace pulley
// ---- end pulley/core/initializers.hpp ----

namespace pulley {

/// Rows of one embedding table of a checkpoint, looked up by id without a cluster: for
/// serving, offline evaluation, or an evaluator task scoring checkpoints. A row the
/// checkpoint does not hold reads as its initial value (as a ps reads it to a reader that
/// creates nothing), from the checkpoint's table seed.
///
/// It views `table` (which must outlive it) and adds an index of 4 to 8 bytes per row.
class CheckpointRows {
 public:
  /// Rows of `table`, whose absent rows start from `seed` (ModelState::table_seed).
  CheckpointRows(const TableState& table, std::uint64_t seed) : table_(&table), seed_(seed) {
    if (table.ids.size() >= IdIndex::kNone) {
      throw Error(ErrorCode::kInvalidArgument, "table '" + table.spec.name + "' has too many rows to index");
    }
    index_.reserve(table.ids.size(), key_of());
    for (std::uint32_t row = 0; row < table.ids.size(); ++row) {
      if (!index_.emplace(table.ids[row], row, key_of()).second) {
        throw Error(ErrorCode::kDataLoss, "table '" + table.spec.name + "' holds row " +
                                              std::to_string(table.ids[row]) + " twice");
      }
    }
  }

  /// The table's spec.
  [[nodiscard]] const TableSpec& spec() const noexcept { return table_->spec; }
  /// True if the checkpoint holds the row of `id`.
  [[nodiscard]] bool contains(std::uint64_t id) const noexcept { return index_.find(id, key_of()) != IdIndex::kNone; }

  /// Writes the values of the rows of `ids` into `out` (`ids.size() × dim` floats, in order).
  void lookup(std::span<const std::uint64_t> ids, std::span<float> out) const {
    const std::size_t dim = table_->spec.dim, stride = table_->stride();
    if (out.size() != ids.size() * dim) {
      throw Error(ErrorCode::kInvalidArgument, "lookup of table '" + table_->spec.name + "': " +
                                                   std::to_string(out.size()) + " floats for " +
                                                   std::to_string(ids.size()) + " rows of dim " + std::to_string(dim));
    }
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const std::span<float> into = out.subspan(i * dim, dim);
      const std::uint32_t row = index_.find(ids[i], key_of());
      if (row == IdIndex::kNone) {
        initialize_row(table_->spec, seed_, ids[i], into);
      } else {
        const float* values = table_->rows.data() + static_cast<std::size_t>(row) * stride;
        std::copy(values, values + dim, into.begin());
      }
    }
  }

 private:
  struct KeyOf {
    const std::vector<std::uint64_t>* ids;
    std::uint64_t operator()(std::uint32_t row) const noexcept { return (*ids)[row]; }
  };
  [[nodiscard]] KeyOf key_of() const noexcept { return KeyOf{&table_->ids}; }

  const TableState* table_;
  std::uint64_t seed_;
  IdIndex index_{0x243F6A8885A308D3ULL};  ///< keyed: the ids came from the checkpoint, not a client
};

/// Every table of `state`, by the model's order: what an evaluator reads rows from. `state`
/// must be whole (a full checkpoint, or CheckpointDirectory::load's): an incremental one
/// alone lacks the rows it did not change, and is refused with kInvalidArgument.
inline std::vector<CheckpointRows> checkpoint_rows(const ModelState& state) {
  if (state.incremental()) {
    throw Error(ErrorCode::kInvalidArgument, "the rows of an incremental checkpoint (over global step " +
                                                 std::to_string(state.base_step) +
                                                 ") are looked up once it is applied over its base (CheckpointDirectory::load)");
  }
  std::vector<CheckpointRows> out;
  out.reserve(state.tables.size());
  for (const TableState& t : state.tables) out.emplace_back(t, state.table_seed);
  return out;
}

}  // namespace pulley
// ---- end pulley/checkpoint/rows.hpp ----
// ---- begin pulley/client/all_reduce_worker.hpp ----

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

// ---- begin pulley/collective/ring_all_reduce.hpp ----

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

// ---- begin pulley/concepts/ring.hpp ----

#include <concepts>
#include <cstddef>
#include <span>

namespace pulley {

/// The link a worker has in a ring of workers (the all-reduce architecture, seed 004
/// section 2): N ranks 0 .. N − 1, each sending to the next rank, (rank + 1) mod N, and
/// receiving from the previous one, (rank + N − 1) mod N. `collective/ring_all_reduce.hpp`
/// runs the reduce-scatter and all-gather over it; `InProcessRing` (threads of one
/// process) and `TcpRing` (processes, proving the job's secret) are the stock links.
///
/// Required:
///   - `r.rank()`, `r.size()` → this worker's rank and the ring's size (convertible to
///     std::size_t), fixed for the link's lifetime
///   - `r.send(bytes)` with a `std::span<const std::byte>`: queues `bytes` for the next rank
///   - `r.receive(bytes)` with a `std::span<std::byte>`: fills `bytes` with what the previous
///     rank sent next, waiting until it has come
///   - `r.flush()`: returns once everything queued by `send` has left this rank
///
/// Semantic contract:
///   - what one rank sends arrives at the next in the order sent, as one byte stream: a
///     `receive` need not match a `send` in size;
///   - `send` never waits for the next rank to receive: sends in flight make progress while
///     the rank waits in `receive` (so that every rank may send a chunk before any receives
///     one without a deadlock). The caller keeps `bytes` unchanged and alive until `flush`
///     returns or, sooner, until a `receive` has returned bytes that the next rank could
///     only have sent after reading them (a ring's causality: the all-reduce relies on it);
///   - a lost or stopped neighbour makes `receive`, `send` or `flush` throw pulley::Error
///     (`kUnavailable`, or `kDeadlineExceeded` after the link's timeout) naming it; the link
///     is then unusable, and no bytes received before the failure are valid;
///   - a ring of size 1 never sends or receives.
template <class R>
concept Ring = requires(R& ring, const R& cring, std::span<const std::byte> out, std::span<std::byte> in) {
  { cring.rank() } -> std::convertible_to<std::size_t>;
  { cring.size() } -> std::convertible_to<std::size_t>;
  { ring.send(out) } -> std::same_as<void>;
  { ring.receive(in) } -> std::same_as<void>;
  { ring.flush() } -> std::same_as<void>;
};

}  // namespace pulley
// ---- end pulley/concepts/ring.hpp ----

namespace pulley {

/// The ring all-reduce of seed 004 (section 2) over any Ring: the tensor is cut into as many
/// chunks as ranks; N − 1 reduce-scatter steps leave each rank with the sum of one chunk,
/// and N − 1 all-gather steps pass the sums on, so that every rank ends with the whole sum.
/// Each rank sends 2 (N − 1) / N of the tensor, whatever N.
///
/// Pipelined: a chunk travels in segments, and a segment received is reduced and queued for
/// the next rank at once, while the rest of its chunk is still arriving; the link sends it
/// while the rank waits for the next segment (Ring's contract).
///
/// Replicas stay bit-identical: each chunk's sum is added up by the ranks in one fixed order
/// (starting at the rank whose index is the chunk's) and then copied to every other rank, so
/// every rank ends with the same bits, not merely the same value.
///
/// Each call starts with a 32-byte header naming the call's kind, its number, its size and
/// (a broadcast) its root: ranks that disagree (a rank that missed a call, another tensor
/// size) fail the call with kFailedPrecondition instead of adding unrelated bytes. One
/// RingAllReduce per link: it numbers that link's calls. A call that failed (a lost
/// neighbour, ranks out of step) leaves the ring's streams where nobody can follow them:
/// every later call fails with kFailedPrecondition, and the ring must be formed again.
class RingAllReduce {
 public:
  /// Floats per segment by default: 32 Ki floats, 128 KiB, well inside a socket's buffer,
  /// small enough that the next rank starts forwarding early.
  static constexpr std::size_t kDefaultSegment = std::size_t{32} << 10U;

  /// @param segment floats per segment (at least 1)
  explicit RingAllReduce(std::size_t segment = kDefaultSegment) : segment_(std::max<std::size_t>(segment, 1)) {}

  /// Replaces `data` on every rank by the element-wise sum of every rank's `data`. Every rank
  /// calls it with a tensor of the same size. Throws what the link throws (a lost
  /// neighbour), and `data` is then partly summed: use it for nothing.
  template <Ring R>
  void sum(R& ring, std::span<float> data) {
    guarded([&] { sum_now(ring, data); });
  }

  /// Copies rank `root`'s `data` to every other rank's (the same size on every rank): how a
  /// ring starts its replicas from one set of parameters.
  template <Ring R>
  void broadcast(R& ring, std::span<float> data, std::size_t root) {
    if (root >= ring.size()) {
      throw Error(ErrorCode::kInvalidArgument, "broadcast from rank " + std::to_string(root) +
                                                   " in a ring of " + std::to_string(ring.size()));
    }
    guarded([&] { broadcast_now(ring, data, root); });
  }

  /// Floats per segment.
  [[nodiscard]] std::size_t segment() const noexcept { return segment_; }
  /// Calls made on this link so far (each rank's count is the same in a healthy ring).
  [[nodiscard]] std::uint64_t calls() const noexcept { return calls_; }
  /// Bytes this rank has queued for the next one, headers included.
  [[nodiscard]] std::uint64_t bytes_sent() const noexcept { return bytes_sent_; }

 private:
  static constexpr std::uint64_t kMagic = 0x474E4952594C4C50ULL;  // "PLLYRING"
  static constexpr std::uint64_t kSum = 1;
  static constexpr std::uint64_t kBroadcast = 2;

  struct Header {
    std::uint64_t magic = 0;
    std::uint64_t call = 0;  ///< kind in the top byte, the call's number below
    std::uint64_t floats = 0;
    std::uint64_t root = 0;  ///< a broadcast's
  };

  template <class Body>
  void guarded(Body body) {
    if (broken_) {
      throw Error(ErrorCode::kFailedPrecondition, "ring: an earlier call on this link failed: form the ring again");
    }
    try {
      body();
    } catch (...) {
      broken_ = true;
      throw;
    }
  }

  template <Ring R>
  void sum_now(R& ring, std::span<float> data) {
    const std::size_t n = ring.size();
    const std::size_t rank = ring.rank();
    start(ring, kSum, data.size());
    if (n == 1) return;
    scratch_.resize(std::min(segment_, data.size() / n + 1));
    auto chunk = [&](std::size_t c) {
      const std::size_t begin = data.size() * c / n;
      return data.subspan(begin, data.size() * (c + 1) / n - begin);
    };
    send_floats(ring, chunk(rank));
    // Rounds 0 .. n − 2 reduce (chunk rank − 1 − round arrives, partly summed); rounds
    // n − 1 .. 2n − 3 gather (chunk rank − round + n − 1 arrives, whole). Each chunk that
    // arrives goes on to the next rank, but for the last round's.
    for (std::size_t round = 0; round + 2 < 2 * n; ++round) {
      const std::size_t c = (rank + 2 * n - 1 - round) % n;
      const std::span<float> into = chunk(c);
      const bool forward = round + 3 < 2 * n;
      for (std::size_t at = 0; at < into.size(); at += segment_) {
        const std::span<float> part = into.subspan(at, std::min(segment_, into.size() - at));
        if (round + 1 < n) {
          const std::span<float> got(scratch_.data(), part.size());
          receive_floats(ring, got);
          for (std::size_t i = 0; i < part.size(); ++i) part[i] += got[i];
        } else {
          receive_floats(ring, part);
        }
        if (forward) send_floats(ring, part);
      }
    }
    ring.flush();
  }

  template <Ring R>
  void broadcast_now(R& ring, std::span<float> data, std::size_t root) {
    const std::size_t n = ring.size();
    start(ring, kBroadcast, data.size(), root);
    if (n == 1) return;
    const std::size_t rank = ring.rank();
    const bool last = (rank + 1) % n == root;
    for (std::size_t at = 0; at < data.size(); at += segment_) {
      const std::span<float> part = data.subspan(at, std::min(segment_, data.size() - at));
      if (rank != root) receive_floats(ring, part);
      if (!last) send_floats(ring, part);
    }
    ring.flush();
  }

  /// Sends this call's header and checks the previous rank's against it.
  template <Ring R>
  void start(R& ring, std::uint64_t kind, std::size_t floats, std::size_t root = 0) {
    const std::uint64_t call = calls_++;
    if (ring.size() == 1) return;
    header_ = {kMagic, (kind << 56U) | call, floats, root};
    ring.send(std::as_bytes(std::span(&header_, 1)));
    bytes_sent_ += sizeof(Header);
    Header got;
    ring.receive(std::as_writable_bytes(std::span(&got, 1)));
    if (got.magic != kMagic || got.call != header_.call || got.floats != floats || got.root != header_.root) {
      auto say = [](const Header& h) {
        return "call " + std::to_string(h.call & ((std::uint64_t{1} << 56U) - 1)) +
               ((h.call >> 56U) == kSum ? " (sum" : " (broadcast from rank " + std::to_string(h.root)) + " of " +
               std::to_string(h.floats) + " floats)";
      };
      throw Error(ErrorCode::kFailedPrecondition,
                  got.magic != kMagic
                      ? "ring: the previous rank sent no all-reduce header (is it another program?)"
                      : "ring: out of step: rank " + std::to_string(ring.rank()) + " is at " + say(header_) +
                            ", the previous rank at " + say(got));
    }
  }

  template <Ring R>
  void send_floats(R& ring, std::span<const float> values) {
    if (values.empty()) return;
    ring.send(std::as_bytes(values));
    bytes_sent_ += values.size_bytes();
  }

  template <Ring R>
  static void receive_floats(R& ring, std::span<float> values) {
    if (!values.empty()) ring.receive(std::as_writable_bytes(values));
  }

  std::size_t segment_;
  std::vector<float> scratch_;  ///< one segment as it arrives, before it is added
  Header header_;               ///< this call's, alive until the call's flush
  std::uint64_t calls_ = 0;
  std::uint64_t bytes_sent_ = 0;
  bool broken_ = false;  ///< a call failed
};

}  // namespace pulley
// ---- end pulley/collective/ring_all_reduce.hpp ----
// ---- begin pulley/concepts/model.hpp ----

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace pulley {

/// The rows of one embedding table that a batch touches, as a worker pulled them for a step:
/// what a TableModel computes with and writes its row gradients into.
struct TableBatch {
  std::size_t dim = 0;                  ///< floats per row
  std::span<const std::uint64_t> ids;   ///< the batch's distinct ids, in the worker's order
  std::span<const float> rows;          ///< ids.size() × dim: the rows, in that order
  std::span<float> gradients;           ///< ids.size() × dim, zero before the step: add into it
  const IdPositions* positions = nullptr;  ///< id → index in ids

  /// The index of `id` in `ids`; throws std::out_of_range if it is not one of them.
  [[nodiscard]] std::size_t index(std::uint64_t id) const {
    const std::size_t at = positions->find(id);
    if (at == IdPositions::npos) {
      throw std::out_of_range("id " + std::to_string(id) + " is not one of the batch's ids");
    }
    return at;
  }
  /// The row of `id`.
  [[nodiscard]] std::span<const float> row(std::uint64_t id) const {
    return rows.subspan(index(id) * dim, dim);
  }
  /// Where the gradient of `id`'s row goes (add to it: an id used twice in a batch sums).
  [[nodiscard]] std::span<float> gradient(std::uint64_t id) const {
    return gradients.subspan(index(id) * dim, dim);
  }
};

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
///   - `m.compute_gradients(batch)` → the batch's mean loss (convertible to float); or, in
///     a model with embedding tables, the members of TableModel in its place
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
  requires requires { { model.compute_gradients(batch) } -> std::convertible_to<float>; } ||
      requires(std::vector<std::uint64_t>& ids, std::span<const TableBatch> tables) {
        { cmodel.tables() } -> std::convertible_to<std::span<const TableSpec>>;
        { cmodel.lookup(batch, i, ids) } -> std::same_as<void>;
        { model.compute_gradients(batch, tables) } -> std::convertible_to<float>;
      };
};

/// A model with embedding tables (a recommendation model): dense variables as a Model has,
/// plus tables of rows keyed by 64-bit ids, of which a batch touches a few. The worker
/// pulls only the rows of the batch's ids, and pushes only their gradients.
///
/// Required:
///   - `typename M::Batch`, `m.variables()`, `m.parameter(i)`, `m.gradient(i)` as for Model
///   - `m.tables()` → the table specs, in a fixed order (a range of TableSpec)
///   - `m.lookup(batch, t, ids)`: appends to `ids` (a std::vector<std::uint64_t>) the ids of
///     table t that `batch` uses, duplicates allowed (the worker removes them)
///   - `m.compute_gradients(batch, tables)` with `tables` a std::span<const TableBatch>, one
///     per table: the batch's mean loss; the dense gradients go to `gradient(i)` as for
///     Model, each row's gradient is added into `tables[t].gradient(id)`
///
/// Optional: `static constexpr bool kAppliesWhenComputed = true` in a model whose
/// `compute_gradients` applies part of the step itself (DenseOnRing applies the dense
/// variables' there): a Worker then never computes a step twice: where it would (the job
/// was rolled back, or its members changed, while the step's push was on its way), it fails
/// with kAborted instead (AppliesWhenComputed).
///
/// Semantic contract: as Model's; `lookup` lists every id that `compute_gradients` reads or
/// writes, and the row gradients are of the batch's mean loss.
template <class M>
concept TableModel = Model<M> &&
    requires(M& model, const M& cmodel, std::size_t i, const typename M::Batch& batch,
             std::vector<std::uint64_t>& ids, std::span<const TableBatch> tables) {
  { cmodel.tables() } -> std::convertible_to<std::span<const TableSpec>>;
  { cmodel.lookup(batch, i, ids) } -> std::same_as<void>;
  { model.compute_gradients(batch, tables) } -> std::convertible_to<float>;
};

/// A model whose `compute_gradients` applies part of the step (TableModel's optional
/// `kAppliesWhenComputed`).
template <class M>
concept AppliesWhenComputed = requires { requires M::kAppliesWhenComputed; };

}  // namespace pulley
// ---- end pulley/concepts/model.hpp ----
// ---- begin pulley/concepts/optimizer.hpp ----

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

// ---- begin pulley/core/magnitude.hpp ----

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>

/// Ordinary magnitudes: what lets a ps prove an update finite without reading the part
/// (BoundsMagnitudes, concepts/optimizer.hpp). The checks fold exponent fields in integer
/// operations in independent lanes (`detail::fold_lanes`), as detail/finite.hpp's
/// `all_finite` does, so that their loops vectorize without -ffast-math and cost a read.

namespace pulley {

/// The magnitude below which a value is "ordinary" (2^60): far beyond any parameter,
/// optimizer slot or gradient of real training, and far enough below float's range that
/// optimizers prove updates of ordinary values finite from it alone (BoundsMagnitudes):
/// the square of an ordinary gradient, 2^120, still leaves room under kFiniteBound.
inline constexpr float kOrdinaryMagnitude = 0x1p60F;

namespace detail {

// Where the build targets x86-64 below AVX2 (its default: SSE2, 4 floats per instruction),
// the loops that most pushes and pulls run (the checks, Sgd's update) are compiled a second
// time for AVX2 (8 floats), and that copy runs where the CPU has AVX2.
// Not AVX-512 nor FMA: with FMA the compiler fuses a multiply and an add into one rounding,
// and an update would differ in its last bit from the same update on a CPU without it,
// where AVX2's lanes do each element's IEEE operations as SSE2's do, bit for bit. A build
// for AVX2 or more (-mavx2, -march=native) takes what it asked for instead.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__AVX2__) && \
    !defined(__FMA__)
#define PULLEY_DETAIL_AVX2_COPY 1
#endif

/// Runs `fold(i, lane)` for every i in [0, n), the values of 32 consecutive i folded into
/// 32 independent lanes, and returns the lanes OR-ed together: `fold_lanes`'s loop, in the
/// instruction set of the function it is inlined into.
template <class Fold>
[[gnu::always_inline]] inline std::uint32_t fold_in_lanes(std::size_t n, Fold& fold) noexcept {
  constexpr std::size_t kLanes = 32;
  std::uint32_t lanes[kLanes] = {};
  std::size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (std::size_t l = 0; l < kLanes; ++l) fold(i + l, lanes[l]);
  }
  std::uint32_t all = 0;
  for (; i < n; ++i) fold(i, all);
  for (const std::uint32_t lane : lanes) all |= lane;
  return all;
}

#if defined(PULLEY_DETAIL_AVX2_COPY)
/// True if this CPU, and its OS, run AVX2 instructions. Read at static initialization; a
/// loop run before that (another static initializer's) sees false and takes SSE2's copy,
/// which gives the same values.
inline const bool kCpuHasAvx2 = [] {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") != 0;
}();

/// Runs `kernel()`, a loop written a value at a time, with what it calls inlined
/// (`flatten`; clang inlines only the calls in this body, so what the kernel calls in turn
/// is `always_inline`) into this function, compiled for AVX2: the loop vectorizes for 8
/// floats. GCC's -O2 vectorizes only loops that need no run-time check of overlap or trip
/// count, which these loops need, so this function asks GCC for the cost model of -O3
/// (the `optimize` attribute, which GCC's manual calls meant for debugging: it works here
/// as documented, adding one option to the command line's, and a test checks the values).
template <class Kernel>
#if defined(__clang__)
[[gnu::target("avx2"), gnu::flatten]]
#else
[[gnu::target("avx2"), gnu::flatten, gnu::optimize("vect-cost-model=dynamic")]]
#endif
auto run_avx2(Kernel& kernel) {
  return kernel();
}
#endif

/// Runs `fold(i, lane)` for every i in [0, n), the values of 32 consecutive i folded into
/// 32 independent lanes, and returns the lanes OR-ed together. The checks of pulley fold a
/// value's bits with integer operations into a lane (its top bit set for a value out of
/// bounds): written as one lane, the loop vectorizes but each vector waits on the OR of the
/// one before; with 32 lanes the compiler keeps several vector accumulators, and a check
/// alone reads at about twice the speed (a 1 MB gradient: 66-71 GB/s against 29-31 with
/// one lane, SSE2, the host of BENCHMARKS.md), faster than memcpy copies it. With AVX2's
/// 8 floats where the CPU has them (`run_avx2`).
template <class Fold>
std::uint32_t fold_lanes(std::size_t n, Fold&& fold) noexcept {
#if defined(PULLEY_DETAIL_AVX2_COPY)
  if (kCpuHasAvx2) {
    const auto kernel = [n, &fold] { return fold_in_lanes(n, fold); };
    return run_avx2(kernel);
  }
#endif
  return fold_in_lanes(n, fold);
}

/// A float's exponent field, in its bits.
inline constexpr std::uint32_t kExponentBits = 0x7F800000U;
/// A float's sign bit, where the folds below gather what they found.
inline constexpr std::uint32_t kSignBit = 0x80000000U;
/// 69 in the exponent field's bits: added to the field, it carries into the sign bit
/// exactly for exponents of 187 (127 + 60, so 2^60) and up, as 187 + 69 = 256.
inline constexpr std::uint32_t kOrdinaryCarry = 0x22800000U;
static_assert(kOrdinaryMagnitude == 0x1p60F, "kOrdinaryCarry is for 2^60");

/// Folds `x` into `lane`: its top bit becomes set unless |x| < kOrdinaryMagnitude (NaN and
/// Inf included). As `all_finite`, with the carry moved (kOrdinaryCarry).
inline void fold_ordinary(std::uint32_t& lane, float x) noexcept {
  std::uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  lane |= (bits & kExponentBits) + kOrdinaryCarry;
}

/// `fold_ordinary` of a value that must not be negative either (-0 counts as negative).
inline void fold_ordinary_non_negative(std::uint32_t& lane, float x) noexcept {
  std::uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  lane |= ((bits & kExponentBits) + kOrdinaryCarry) | (bits & kSignBit);
}

/// True if every element is below kOrdinaryMagnitude in magnitude (so finite): one
/// vectorized pass, as `all_finite`.
inline bool all_ordinary(std::span<const float> values) noexcept {
  const float* p = values.data();
  return (fold_lanes(values.size(),
                     [p](std::size_t i, std::uint32_t& lane) { fold_ordinary(lane, p[i]); }) &
          kSignBit) == 0;
}

/// True if every element is below kOrdinaryMagnitude in magnitude and none is negative.
inline bool all_ordinary_non_negative(std::span<const float> values) noexcept {
  const float* p = values.data();
  return (fold_lanes(
              values.size(),
              [p](std::size_t i, std::uint32_t& lane) { fold_ordinary_non_negative(lane, p[i]); }) &
          kSignBit) == 0;
}

}  // namespace detail

/// A bound of the magnitudes `all_ordinary` (or the like) found `ordinary` or not:
/// kOrdinaryMagnitude, or +infinity (nothing known).
inline float magnitude_bound(bool ordinary) noexcept {
  return ordinary ? kOrdinaryMagnitude : std::numeric_limits<float>::infinity();
}

}  // namespace pulley
// ---- end pulley/core/magnitude.hpp ----

namespace pulley {

/// What an optimizer may know about one update besides the weights and the gradient.
struct UpdateContext {
  /// Global steps completed before this update (sync: this update completes step
  /// `global_step + 1`; async: pushes applied before this one). For schedules.
  std::int64_t global_step = 0;
  std::string_view variable;  ///< the variable's name
  RowRange rows;              ///< the rows of the variable this part holds
  std::size_t row_size = 0;   ///< elements per row: element i is row `rows.begin + i / row_size`
};

/// The largest magnitude the stock optimizers' `stays_finite` lets a parameter or a slot
/// reach: just under 2^127, half of float's range, so that rounding (of a mean of
/// gradients, of the update itself) cannot carry a value it passed into infinity. A value
/// passes exactly when its exponent field is at most 253 (see `bounded`).
inline constexpr float kFiniteBound = 0x1.fffffep126F;

namespace detail {

/// Folds `x` into `lane`: its top bit becomes set if |x| > kFiniteBound or x is NaN. Integer
/// operations, so that loops of it vectorize without -ffast-math: the exponent field plus 2
/// carries into the sign bit exactly for exponents of 254 (2^127 and up) and 255 (Inf, NaN).
inline void fold_bound(std::uint32_t& lane, float x) noexcept {
  std::uint32_t bits = 0;
  std::memcpy(&bits, &x, sizeof bits);
  lane |= (bits & 0x7F800000U) + 0x01000000U;
}

/// `fold_bound` of a value that must not be negative (a sum of squares, whose square root
/// is taken): a negative one also sets the top bit.
inline void fold_bound_non_negative(std::uint32_t& lane, float x) noexcept {
  std::uint32_t bits = 0;
  std::memcpy(&bits, &x, sizeof bits);
  lane |= ((bits & 0x7F800000U) + 0x01000000U) | (bits & 0x80000000U);
}

/// The class that declares a const member function.
template <class F>
struct MemberOf;
template <class R, class C, class... A>
struct MemberOf<R (C::*)(A...) const> {
  using type = C;
};
template <class R, class C, class... A>
struct MemberOf<R (C::*)(A...) const noexcept> {
  using type = C;
};

}  // namespace detail

/// True if `x`, an upper bound computed in double of what an update writes, leaves room
/// for float rounding under kFiniteBound (a proof of `stays_finite_given`).
[[nodiscard]] inline bool proven_finite(double x) noexcept { return x <= 0x1p126; }

/// True if every value `fold(i, lane)` folds (with `detail::fold_bound`) for i in [0, n) is
/// within kFiniteBound. Consecutive i go to independent lanes (detail::fold_lanes), so the
/// loop vectorizes: a stock optimizer's `stays_finite` costs about one read of its operands.
template <class Fold>
bool bounded(std::size_t n, Fold&& fold) noexcept {
  return (detail::fold_lanes(n, fold) & detail::kSignBit) == 0;
}

/// An optimizer: a small value type holding hyper-parameters, plus a per-part `State`
/// (slots such as momentum or Adam's moments) that the ps keeps beside the part it updates.
///
/// Required:
///   - `typename O::State`, movable
///   - `o.make_state(n)` → `O::State` for a part of `n` elements
///   - `o.apply(state, weights, gradient)` or `o.apply(state, weights, gradient, context)`:
///     updates `weights` in place (the second form also sees an UpdateContext)
/// Optional:
///   - `o.stays_finite(state, weights, gradient)` → bool, with `state` const: true only if
///     `apply` with these arguments would leave every weight and every slot finite. It may
///     be conservative (false for a few updates that would have stayed finite, far beyond
///     any real gradient) but never optimistic. The ps asks it about every update before
///     applying it: a push that is an update by itself (Async, BoundedStaleness) is refused
///     when it answers false, naming the variable and the sender; an update averaged from
///     several pushes (SyncReplicas) is rolled back on that ps, and logged. Without it, the
///     ps applies each update to a copy of the part and its State (which must then be
///     copyable), keeps the copy only if the weights stayed finite (a push that was an
///     update by itself is then refused as above), and fails if the State cannot be copied
///     and the weights went non-finite; `stays_finite` saves that copy and guards the
///     slots too.
///   - `o.apply_bounded(state, weights, gradient)` and `o.stays_finite_given(state,
///     largest, largest_gradient)` (BoundsMagnitudes, with `stays_finite`): the ps then
///     proves most updates finite in O(1), from magnitudes, and reads the part once.
///   - `o.settings_error()` → `std::optional<std::string>`: what is wrong with its
///     hyper-parameters (a learning rate that is NaN, infinite or negative; a decay
///     outside [0, 1)), or nullopt. A ps, and the role runner in every task, ask it before
///     anything else and refuse to start with kInvalidArgument naming the field
///     (`check_optimizer_settings`); `SettingsCheck` writes one in a line per field.
///   - `o.slots(state)` → a range of `OptimizerSlot` (name, `std::span<float>` of n values,
///     one per element of the part) and `o.counters(state)` → a range of `OptimizerCounter`
///     (name, `std::int64_t*`): the State as checkpoints save and restore it. A State that
///     holds anything else is not checkpointed (a restore starts it from `make_state`, and
///     the chief says so in its log); an empty State needs neither.
///
/// Semantic contract (the compiler cannot check it):
///   - `gradient` is the mean of the gradients the sync policy aggregated for this update
///     (SyncReplicas: of R workers' batches; Async: one worker's), each the gradient of its
///     batch's mean loss;
///   - `apply` is called once per global step (sync) or once per accepted push (async) for
///     each part, with `weights.size() == gradient.size() == n` of the `make_state(n)` call;
///   - calls are never concurrent: one ps applies one update at a time;
///   - `gradient` may alias the sync policy's accumulator or the sender's message: it is
///     valid only during the call, and must not be kept;
///   - it is deterministic: the same state, weights and gradient give the same result;
///   - it is element-wise or at least part-local: a variable split over several ps tasks is
///     updated part by part, so a rule that needs the whole variable (a global norm) does
///     not belong here (the UpdateContext tells which rows a part holds, for row-wise rules);
///   - a throw while applying fails the ps (half an update cannot be undone), so `apply`
///     should not throw; `make_state` may throw (the model is then refused);
///   - the optimizer object is shared by all parts and is never modified after construction
///     (`apply` is const); everything that changes lives in `State`.
template <class O>
concept Optimizer = std::copy_constructible<O> && std::movable<typename O::State> &&
    requires(const O& optimizer, typename O::State& state, std::span<float> weights,
             std::span<const float> gradient, std::size_t n, const UpdateContext& context) {
  { optimizer.make_state(n) } -> std::same_as<typename O::State>;
  requires requires { { optimizer.apply(state, weights, gradient) } -> std::same_as<void>; } ||
      requires { { optimizer.apply(state, weights, gradient, context) } -> std::same_as<void>; };
};

/// The checks an optimizer's `settings_error` makes of its hyper-parameters, each naming
/// the field and the value it refuses, the first failing one kept:
///   `return SettingsCheck().positive("learning_rate", learning_rate).error();`
class SettingsCheck {
 public:
  /// A finite number above 0 (FTRL's learning rate, which it divides by).
  SettingsCheck& positive(std::string_view name, float value) {
    return rule(name, value, value > 0, "a finite number above 0");
  }
  /// A finite number of 0 or more (a learning rate: 0 freezes the weights; a
  /// regularization strength, an initial accumulator).
  SettingsCheck& non_negative(std::string_view name, float value) {
    return rule(name, value, value >= 0, "a finite number of 0 or more");
  }
  /// A finite number of 0 or less (FTRL's learning_rate_power).
  SettingsCheck& non_positive(std::string_view name, float value) {
    return rule(name, value, value <= 0, "a finite number of 0 or less");
  }
  /// A decay in [0, 1) (Adam's betas, RMSProp's rho).
  SettingsCheck& decay(std::string_view name, float value) {
    return rule(name, value, value >= 0 && value < 1, "in [0, 1)");
  }
  /// A fraction in [0, 1] (a momentum).
  SettingsCheck& fraction(std::string_view name, float value) {
    return rule(name, value, value >= 0 && value <= 1, "in [0, 1]");
  }
  /// The first rule that failed, or nullopt.
  [[nodiscard]] std::optional<std::string> error() const { return error_; }

 private:
  SettingsCheck& rule(std::string_view name, float value, bool holds, const char* must) {
    if (!error_ && !(std::isfinite(value) && holds)) {
      char shown[32];
      std::snprintf(shown, sizeof shown, "%g", static_cast<double>(value));
      error_ = std::string(name) + " is " + shown + ": it must be " + must;
    }
    return *this;
  }
  std::optional<std::string> error_;
};

/// Throws kInvalidArgument ("<who>: learning_rate is nan: ...") when `optimizer` has a
/// `settings_error` that names a problem; an optimizer without one is taken as it is.
template <class O>
void check_optimizer_settings(const O& optimizer, std::string_view who = "the optimizer") {
  if constexpr (requires { { optimizer.settings_error() } -> std::convertible_to<std::optional<std::string>>; }) {
    if (const std::optional<std::string> error = optimizer.settings_error()) {
      throw Error(ErrorCode::kInvalidArgument, std::string(who) + ": " + *error);
    }
  }
}

/// One element-wise slot of an optimizer's State (Adam's "m"): one value per element.
struct OptimizerSlot {
  std::string_view name;
  std::span<float> values;
};

/// One counter of an optimizer's State (Adam's "t").
struct OptimizerCounter {
  std::string_view name;
  std::int64_t* value;
};

/// True if the optimizer names its State's slots and counters, for checkpoints.
template <class O>
concept ExposesState = Optimizer<O> && requires(const O& optimizer, typename O::State& state) {
  { optimizer.slots(state) } -> std::ranges::range;
  { optimizer.counters(state) } -> std::ranges::range;
};

/// The slots of `state`, or none if the optimizer does not name them.
template <Optimizer O>
std::vector<OptimizerSlot> slots_of(const O& optimizer, typename O::State& state) {
  std::vector<OptimizerSlot> out;
  if constexpr (ExposesState<O>) {
    for (const OptimizerSlot& slot : optimizer.slots(state)) out.push_back(slot);
  }
  return out;
}

/// The counters of `state`, or none if the optimizer does not name them.
template <Optimizer O>
std::vector<OptimizerCounter> counters_of(const O& optimizer, typename O::State& state) {
  std::vector<OptimizerCounter> out;
  if constexpr (ExposesState<O>) {
    for (const OptimizerCounter& counter : optimizer.counters(state)) out.push_back(counter);
  }
  return out;
}

/// True if a checkpoint holds all of the optimizer's State: it names its slots and
/// counters, or its State is empty.
template <Optimizer O>
inline constexpr bool checkpoints_whole_state_v =
    ExposesState<O> || std::is_empty_v<typename O::State>;

namespace detail {

/// True if `Check` (a pointer to a member function: `&O::stays_finite`, say) is declared by
/// the class that declares `Apply` (`&O::apply`) or by one derived from it: the check was
/// written for the rule it checks. A class derived from a stock optimizer that brings an
/// `apply` of its own does not take the stock checks with it; one that brings a check of
/// its own (stricter, or counted) keeps the stock rule.
template <class Apply, class Check>
concept DeclaredWith = std::is_base_of_v<typename MemberOf<Apply>::type, typename MemberOf<Check>::type>;

/// True if `&O::apply` and `&O::stays_finite` each name one non-static member function (not
/// an overload set, a template or a static function), so that DeclaredWith can tell.
template <class O>
concept NamesApplyAndCheck = requires {
  typename MemberOf<decltype(&O::apply)>::type;
  typename MemberOf<decltype(&O::stays_finite)>::type;
};

}  // namespace detail

/// True if the optimizer can tell in advance whether an update stays finite:
/// `o.stays_finite(state, weights, gradient)` → bool, true only if `apply` keeps every
/// weight and slot within kFiniteBound (never optimistic). Where `apply` and
/// `stays_finite` each name one member function, `stays_finite` must come with the `apply`
/// it checks (detail::DeclaredWith): a derived class with a rule of its own is checked by
/// applying to copies, as an optimizer without `stays_finite`. (An overloaded or template
/// `apply` is taken at its word, as a check cannot be told from its rule then.)
template <class O>
concept PredictsFiniteness = Optimizer<O> &&
    requires(const O& optimizer, const typename O::State& state, std::span<const float> weights,
             std::span<const float> gradient) {
  { optimizer.stays_finite(state, weights, gradient) } -> std::convertible_to<bool>;
} && (!detail::NamesApplyAndCheck<O> || detail::DeclaredWith<decltype(&O::apply), decltype(&O::stays_finite)>);

/// True if the optimizer proves an update finite from magnitudes alone, so that the ps
/// checks an update without reading the part (the check costs nothing per element):
///   - `o.apply_bounded(state, weights, gradient)` → float: does what `apply` does, and
///     returns a bound that no weight or slot of the part exceeds in magnitude afterwards
///     (the stock ones: kOrdinaryMagnitude when all are below it and the slots that must
///     not be negative are not, else +infinity: nothing known); the ps hands
///     `stays_finite_given` nothing finer than kOrdinaryMagnitude, so it must prove the
///     updates of real training from that bound;
///   - `o.stays_finite_given(state, largest, largest_gradient)` → bool, O(1): true only if
///     `apply` keeps every weight and slot within kFiniteBound whenever none of them is
///     larger than `largest` in magnitude (and the slots that must not be negative are
///     not) and no gradient element larger than `largest_gradient`. Conservative, never
///     optimistic, as `stays_finite`. It is asked only of a part as this optimizer's
///     `apply_bounded` last left it, having returned `largest`, so it may also count on
///     what that pass made sure of (Ftrl: each weight solved from its slots, no
///     accumulator below its start).
/// The ps keeps each part's `largest` from its last `apply_bounded`, and asks
/// `stays_finite` where `stays_finite_given` cannot tell (or the part was written
/// otherwise since: initialized, restored): a refused update is refused as before.
/// `apply_bounded` must be declared by the class that declares its one `apply` (it is the
/// same rule), and `stays_finite_given` must come with that `apply` as `stays_finite` does.
template <class O>
concept BoundsMagnitudes = PredictsFiniteness<O> &&
    requires(const O& optimizer, typename O::State& state, const typename O::State& held,
             std::span<float> weights, std::span<const float> gradient, float magnitude) {
  { optimizer.apply_bounded(state, weights, gradient) } -> std::same_as<float>;
  { optimizer.stays_finite_given(held, magnitude, magnitude) } -> std::convertible_to<bool>;
  &O::apply;  // one apply, not an overload set
  &O::apply_bounded;
  &O::stays_finite_given;
} && std::same_as<typename detail::MemberOf<decltype(&O::apply)>::type,
                  typename detail::MemberOf<decltype(&O::apply_bounded)>::type> &&
    detail::DeclaredWith<decltype(&O::apply), decltype(&O::stays_finite_given)>;

/// What a row-wise (sparse) update of one row of an embedding table may know.
struct RowContext {
  /// Global steps completed before this update (as UpdateContext::global_step).
  std::int64_t global_step = 0;
  /// Updates of this table on this ps so far, this one included: 1 for the first. Lazy
  /// Adam's `t`, the same for every row of one update.
  std::int64_t updates = 0;
  std::string_view table;  ///< the table's name
  std::uint64_t id = 0;    ///< the row's id
};

/// An optimizer that can also update embedding tables row by row (sparse apply), as
/// TensorFlow's `sparse_apply_*` kernels do: only the rows pushed in an update are touched,
/// with slots of their own kept beside each row. An optimizer says it supports tables by
/// having these members; a table used with one that lacks them fails to compile, naming
/// them.
///
/// Required (besides Optimizer):
///   - `O::kRowSlots`, a `static constexpr std::size_t`: slots per row (Adagrad 1, Adam 2)
///   - `o.row_slot_names()` → `std::array<std::string_view, O::kRowSlots>`, for checkpoints
///   - `o.init_row(slots)`: fills a new row's slots; `slots` holds kRowSlots × dim floats,
///     slot k at [k × dim, (k + 1) × dim)
///   - `o.apply_row(weights, slots, gradient, context)`: updates one row (`weights` and
///     `gradient` of dim floats, `slots` as above) in place
///
/// Semantic contract (the compiler cannot check it):
///   - `gradient` is the mean of the gradients pushed for this row in this update (sync: over
///     the replicas whose push held the row, as TensorFlow's sparse conditional accumulator
///     averages; async: one worker's, duplicates summed by the worker);
///   - `apply_row` is called once per update for each row pushed in it and never for the
///     others ("lazy": an untouched row's slots do not decay), one row at a time;
///   - it is deterministic, touches nothing but its arguments, and does not throw;
///   - what it does to a row with a zero gradient is its business (FTRL's weights move);
///   - the ps checks every updated row for finite values and drops the whole update of the
///     table if one is not, so `apply_row` need not guard against overflow (the check is a
///     copy of each row and a pass over it, unless the optimizer proves rows finite from
///     magnitudes: BoundsRowMagnitudes, below).
template <class O>
concept RowWiseOptimizer = Optimizer<O> &&
    requires(const O& optimizer, std::span<float> weights, std::span<float> slots,
             std::span<const float> gradient, const RowContext& context) {
  { O::kRowSlots } -> std::convertible_to<std::size_t>;
  { optimizer.row_slot_names() } -> std::ranges::range;
  { optimizer.init_row(slots) } -> std::same_as<void>;
  { optimizer.apply_row(weights, slots, gradient, context) } -> std::same_as<void>;
};

/// True if a row-wise optimizer proves a row's update finite from magnitudes alone, as
/// BoundsMagnitudes does for a dense part, so that an embedding table updates proven rows
/// in place, judging each value in the pass that computes it (EmbeddingTable::apply then
/// reads and writes each row once, with no copy aside and no second pass):
///   - `o.apply_row_bounded(weights, slots, gradient, context)` → float: does what
///     `apply_row` does, and returns a bound that no value or slot of the row exceeds in
///     magnitude afterwards (the stock ones: kOrdinaryMagnitude when all are below it and
///     the slots that must not be negative are not, else +infinity: nothing known);
///   - `o.row_stays_finite_given(largest, largest_gradient, context)` → bool, O(1): true
///     only if `apply_row` with this `context` (its global_step, updates and table; not its
///     id) keeps every value and slot of a row within kFiniteBound whenever none of them is
///     larger than `largest` in magnitude (and the slots that must not be negative are
///     not) and no gradient element is larger than `largest_gradient`. Conservative, never
///     optimistic, as `stays_finite`.
/// A table asks `row_stays_finite_given(kOrdinaryMagnitude, kOrdinaryMagnitude, ...)` once
/// per update. It holds a row proven while the row's last `apply_row_bounded` returned
/// kOrdinaryMagnitude or less, or, for a row created or restored since, while every value
/// and slot of it is ordinary and no slot is negative; any other row is updated in a copy
/// first and checked, as for an optimizer without these members. Both must be declared by
/// the class that declares `apply_row` (the same rule), so that a class derived from a stock
/// optimizer with an `apply_row` of its own is checked by copies.
template <class O>
concept BoundsRowMagnitudes = RowWiseOptimizer<O> &&
    requires(const O& optimizer, std::span<float> weights, std::span<float> slots,
             std::span<const float> gradient, const RowContext& context, float magnitude) {
  { optimizer.apply_row_bounded(weights, slots, gradient, context) } -> std::same_as<float>;
  { optimizer.row_stays_finite_given(magnitude, magnitude, context) } -> std::convertible_to<bool>;
  &O::apply_row;  // one apply_row, not an overload set
  &O::apply_row_bounded;
  &O::row_stays_finite_given;
} && std::same_as<typename detail::MemberOf<decltype(&O::apply_row)>::type,
                  typename detail::MemberOf<decltype(&O::apply_row_bounded)>::type> &&
    detail::DeclaredWith<decltype(&O::apply_row), decltype(&O::row_stays_finite_given)>;

/// Calls whichever form of `apply` the optimizer has.
template <Optimizer O>
void apply_update(const O& optimizer, typename O::State& state, std::span<float> weights,
                  std::span<const float> gradient, const UpdateContext& context) {
  if constexpr (requires { optimizer.apply(state, weights, gradient, context); }) {
    optimizer.apply(state, weights, gradient, context);
  } else {
    optimizer.apply(state, weights, gradient);
  }
}

}  // namespace pulley
// ---- end pulley/concepts/optimizer.hpp ----
// ---- begin pulley/core/detail/finite.hpp ----

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

namespace pulley::detail {

/// True if no element is NaN or Inf: both have an all-ones exponent, so adding one to the
/// exponent field carries into the sign bit exactly for them. Every push is checked on
/// both sides, so this runs at about a read's speed (`fold_lanes`), and on the values'
/// bits, so no -ffast-math build can compile it away.
inline bool all_finite(std::span<const float> values) noexcept {
  constexpr std::uint32_t kExponentOne = 0x00800000U;
  const float* p = values.data();
  const std::uint32_t carried = fold_lanes(values.size(), [p](std::size_t i, std::uint32_t& lane) {
    std::uint32_t bits;
    std::memcpy(&bits, p + i, sizeof bits);
    lane |= (bits & kExponentBits) + kExponentOne;
  });
  return (carried & kSignBit) == 0;
}

}  // namespace pulley::detail
// ---- end pulley/core/detail/finite.hpp ----

namespace pulley {

/// What one all-reduce step did.
struct AllReduceStep {
  float loss = 0.0F;             ///< the mean of every rank's batch loss
  std::int64_t global_step = 0;  ///< steps this replica has taken, this one included
  /// False if the averaged gradient (or what it would make of a parameter or a slot) was not
  /// finite: no rank applied it, and every replica stays as it was.
  bool applied = true;
  /// Some rank voted to form the ring again after this step (`step`'s `regroup`): every
  /// rank sees the same answer.
  bool regroup = false;
};

/// A worker of the all-reduce architecture (seed 004, section 2): no ps task; every worker
/// holds the whole model and the optimizer's state, computes a gradient on its own batch,
/// and the ring sums the gradients (`RingAllReduce`) so that every worker applies the same
/// mean with the same optimizer. The replicas stay bit-identical: the same starting values
/// (`initialize` broadcasts rank 0's), the same averaged gradient bits on every rank, and a
/// deterministic optimizer (Optimizer's contract) give the same parameters after any number
/// of steps. It is synchronous data parallelism, as SyncReplicas with R = N is on ps tasks.
///
/// Nothing non-finite is applied, and a step is applied whole or not at all, on every rank
/// alike: the averaged gradient is checked, and then `stays_finite` of each variable
/// (PredictsFiniteness), or the update is made into a copy that replaces the variable and its
/// state only if every value stayed finite.
///
/// @tparam M the Model it trains (owned; the parameters are its own buffers)
/// @tparam O the Optimizer every rank applies (the same settings on every rank)
/// @tparam R the Ring that links it to the other workers (owned)
template <Model M, Optimizer O, Ring R>
class AllReduceWorker {
  static_assert(PredictsFiniteness<O> || std::copyable<typename O::State>,
                "AllReduceWorker undoes an update that went non-finite: give the optimizer stays_finite "
                "(PredictsFiniteness), or a copyable State");
  static_assert(checkpoints_whole_state_v<O>,
                "AllReduceWorker copies the optimizer's State from one replica to the others (synchronize) and "
                "checkpoints it: name its slots and counters (slots(state), counters(state): ExposesState), or "
                "keep it empty");

 public:
  /// @param segment floats per segment of the ring's pipeline (RingAllReduce::kDefaultSegment)
  AllReduceWorker(M model, O optimizer, R ring, std::size_t segment = RingAllReduce::kDefaultSegment)
      : model_(std::move(model)), optimizer_(std::move(optimizer)), ring_(std::move(ring)), reduce_(segment) {
    const auto variables = std::span<const VariableSpec>(model_.variables());
    std::size_t offset = 0;
    for (const VariableSpec& spec : variables) {
      offsets_.push_back(offset);
      offset += spec.size();
      states_.push_back(optimizer_.make_state(spec.size()));
    }
    offsets_.push_back(offset);
    flat_.resize(offset + 3);  // the loss, the ranks that added a gradient and the vote ride at the end
  }

  AllReduceWorker(const AllReduceWorker&) = delete;
  AllReduceWorker& operator=(const AllReduceWorker&) = delete;
  /// Movable between calls (a `Worker` takes the `DenseOnRing` holding one by value).
  AllReduceWorker(AllReduceWorker&&) = default;
  AllReduceWorker& operator=(AllReduceWorker&&) = default;

  /// Starts every replica from rank 0's parameters: rank 0 fills each variable from its
  /// initializer and `seed` (as a chief fills the ps tasks), and `synchronize` copies them,
  /// with the fresh optimizer state, to the others. Every rank calls it once, before the
  /// first step (or `restore` instead).
  void initialize(std::uint64_t seed) {
    const auto variables = std::span<const VariableSpec>(model_.variables());
    if (ring_.rank() == 0) {
      for (std::size_t v = 0; v < variables.size(); ++v) pulley::initialize(variables[v], seed, model_.parameter(v));
    }
    synchronize(0);
  }

  /// Copies rank `root`'s replica to every rank: the parameters, every optimizer slot and
  /// counter, and the step count. Every rank calls it, at the same point of its calls (after
  /// a checkpoint restored on one rank only, say).
  void synchronize(std::size_t root) {
    for (std::size_t v = 0; v < states_.size(); ++v) {
      reduce_.broadcast(ring_, model_.parameter(v), root);
      for (const OptimizerSlot& slot : slots_of(optimizer_, states_[v])) reduce_.broadcast(ring_, slot.values, root);
    }
    // The counters and the step, their bits carried as floats (a broadcast copies bits).
    std::vector<std::int64_t> counts{global_step_, refused_};
    for (auto& state : states_) {
      for (const OptimizerCounter& c : counters_of(optimizer_, state)) counts.push_back(*c.value);
    }
    std::vector<float> bits(counts.size() * 2);
    std::memcpy(bits.data(), counts.data(), counts.size() * sizeof(std::int64_t));
    reduce_.broadcast(ring_, bits, root);
    std::memcpy(counts.data(), bits.data(), counts.size() * sizeof(std::int64_t));
    global_step_ = counts[0];
    refused_ = counts[1];
    std::size_t at = 2;
    for (auto& state : states_) {
      for (const OptimizerCounter& c : counters_of(optimizer_, state)) *c.value = counts[at++];
    }
  }

  /// This replica as a checkpoint holds a model (any rank's: they are the same): each
  /// variable's values, slots and counters (one part: the whole variable), at global_step().
  /// `CheckpointDirectory::save` writes it.
  [[nodiscard]] ModelState state() {
    ModelState out;
    out.global_step = global_step_;
    const auto variables = std::span<const VariableSpec>(model_.variables());
    for (std::size_t v = 0; v < states_.size(); ++v) {
      VariableState held;
      held.spec = variables[v];
      const std::span<float> w = model_.parameter(v);
      held.values.assign(w.begin(), w.end());
      for (const OptimizerSlot& slot : slots_of(optimizer_, states_[v])) {
        held.slots.push_back({std::string(slot.name), {slot.values.begin(), slot.values.end()}});
      }
      PartCounters counters{{0, variables[v].rows()}, {}};
      for (const OptimizerCounter& c : counters_of(optimizer_, states_[v])) {
        held.counter_names.emplace_back(c.name);
        counters.values.push_back(*c.value);
      }
      held.counters.push_back(std::move(counters));
      out.variables.push_back(std::move(held));
    }
    return out;
  }

  /// Takes `state` (a checkpoint of this model: this worker's or a ps job's) into this
  /// replica: values, the slots and counters it names, and its global step. Every rank
  /// restores the same checkpoint, or one rank restores and all `synchronize` from it.
  /// Throws kInvalidArgument naming the first variable that differs from the model's, or a
  /// slot or counter the optimizer does not have (a checkpoint of another optimizer).
  void restore(const ModelState& state) {
    const auto variables = std::span<const VariableSpec>(model_.variables());
    if (state.global_step < 0) {
      throw Error(ErrorCode::kInvalidArgument, "the checkpoint's global step " + std::to_string(state.global_step) +
                                                   " is negative");
    }
    if (state.variables.size() != variables.size()) {
      throw Error(ErrorCode::kInvalidArgument, "the checkpoint holds " + std::to_string(state.variables.size()) +
                                                   " variables, the model " + std::to_string(variables.size()));
    }
    for (std::size_t v = 0; v < variables.size(); ++v) {
      const VariableState& held = state.variables[v];
      if (!(held.spec.name == variables[v].name && held.spec.shape == variables[v].shape) ||
          held.values.size() != variables[v].size()) {
        throw Error(ErrorCode::kInvalidArgument, "the checkpoint's variable '" + held.spec.name +
                                                     "' is not the model's '" + variables[v].name + "'");
      }
      bool finite = detail::all_finite(held.values);
      for (const SlotState& slot : held.slots) finite = finite && detail::all_finite(slot.values);
      if (!finite) {
        throw Error(ErrorCode::kInvalidArgument, "the checkpoint's '" + held.spec.name + "' holds non-finite values");
      }
      for (const OptimizerSlot& slot : slots_of(optimizer_, states_[v])) {
        auto it = std::find_if(held.slots.begin(), held.slots.end(),
                               [&](const SlotState& s) { return s.name == slot.name; });
        if (it == held.slots.end() || it->values.size() != slot.values.size()) {
          throw Error(ErrorCode::kInvalidArgument, "the checkpoint holds no slot '" + std::string(slot.name) +
                                                       "' of the right size for '" + held.spec.name + "'");
        }
      }
      for (const OptimizerCounter& c : counters_of(optimizer_, states_[v])) {
        const auto k = static_cast<std::size_t>(
            std::find(held.counter_names.begin(), held.counter_names.end(), c.name) - held.counter_names.begin());
        const bool counted = std::any_of(held.counters.begin(), held.counters.end(),
                                         [&](const PartCounters& part) { return k < part.values.size(); });
        if (k == held.counter_names.size() || !counted) {
          throw Error(ErrorCode::kInvalidArgument, "the checkpoint holds no counter '" + std::string(c.name) +
                                                       "' for '" + held.spec.name + "'");
        }
      }
    }
    for (std::size_t v = 0; v < variables.size(); ++v) {
      const VariableState& held = state.variables[v];
      std::copy(held.values.begin(), held.values.end(), model_.parameter(v).begin());
      for (const OptimizerSlot& slot : slots_of(optimizer_, states_[v])) {
        auto it = std::find_if(held.slots.begin(), held.slots.end(),
                               [&](const SlotState& s) { return s.name == slot.name; });
        std::copy(it->values.begin(), it->values.end(), slot.values.begin());
      }
      const auto names = held.counter_names;
      for (const OptimizerCounter& c : counters_of(optimizer_, states_[v])) {
        // A ps job's checkpoint holds one count per part: the parts of a variable were
        // updated alike, and the largest count is the variable's.
        const auto k = static_cast<std::size_t>(std::find(names.begin(), names.end(), c.name) - names.begin());
        std::int64_t largest = 0;
        for (const PartCounters& part : held.counters) {
          if (k < part.values.size()) largest = std::max(largest, part.values[k]);
        }
        *c.value = largest;
      }
    }
    global_step_ = state.global_step;
  }

  /// One synchronous step on this rank's `batch`: compute the gradient, sum it with every
  /// other rank's, apply the mean. Every rank calls it the same number of times. A lost
  /// neighbour throws what the ring throws (kUnavailable, kDeadlineExceeded) before
  /// anything is applied: no partial sum ever reaches the parameters (though a rank that
  /// had its whole sum before the ring broke has applied it: ranks may then stand a step
  /// apart, and `synchronize` from the one furthest on brings them together). `regroup`
  /// is this rank's vote to form the ring again after this step (a worker waits to join):
  /// the sum carries it, and AllReduceStep::regroup tells every rank alike.
  AllReduceStep step(const typename M::Batch& batch, bool regroup = false) {
    return sum_and_apply(static_cast<float>(model_.compute_gradients(batch)), regroup);
  }

  /// `step` for a model with embedding tables (TableModel): `tables` are the rows the batch
  /// uses, as a ps worker pulled them, and their gradients are written into them as
  /// `compute_gradients(batch, tables)` writes them; only the dense gradients are summed on
  /// the ring and applied here (`DenseOnRing` pushes the rows' to the ps tasks).
  AllReduceStep step(const typename M::Batch& batch, std::span<const TableBatch> tables, bool regroup = false)
    requires TableModel<M>
  {
    return sum_and_apply(static_cast<float>(model_.compute_gradients(batch, tables)), regroup);
  }

 private:
  /// Sums the gradients `compute_gradients` left in the model (none when `adds` is false:
  /// zeros), `loss`, a count of the ranks that added one, and the vote with every rank's,
  /// and applies the mean over the ranks that added one.
  AllReduceStep sum_and_apply(float loss, bool regroup, bool adds = true) {
    const std::size_t nvars = states_.size();
    if (adds) {
      for (std::size_t v = 0; v < nvars; ++v) {
        const std::span<const float> g = model_.gradient(v);
        std::copy(g.begin(), g.end(), flat_.begin() + static_cast<std::ptrdiff_t>(offsets_[v]));
      }
    } else {
      std::fill(flat_.begin(), flat_.end(), -0.0F);  // the exact identity of +: x + -0 is x, -0 too
    }
    const std::size_t tail = offsets_.back();
    flat_[tail] = adds ? loss : 0.0F;
    flat_[tail + 1] = adds ? 1.0F : 0.0F;
    flat_[tail + 2] = regroup ? 1.0F : 0.0F;
    reduce_.sum(ring_, flat_);
    const bool voted = flat_[tail + 2] > 0.0F;
    const float added = flat_[tail + 1];
    if (added < 1.0F) {
      throw Error(ErrorCode::kFailedPrecondition, "ring: no rank added a gradient to step " +
                                                      std::to_string(global_step_ + 1) + " (every rank follows)");
    }
    for (float& x : std::span<float>(flat_).first(tail + 1)) x /= added;
    ++global_step_;
    AllReduceStep result{flat_[tail], global_step_, apply(), voted};
    if (!result.applied) ++refused_;
    return result;
  }

 public:
  /// Takes the step the other ranks take without a batch of its own: this rank adds no
  /// gradient (nor loss), and every rank applies the mean over the ranks that added one, so
  /// this replica stays bit-identical to theirs. A replica that follows training: the
  /// chief's of a hybrid job (runner/hybrid.hpp), which it checkpoints and evaluates. Every
  /// rank of the ring calls `step` or `follow` once a step; at least one calls `step`.
  AllReduceStep follow() { return sum_and_apply(0.0F, false, false); }

  /// Returns once every rank has called it: a sum of one float per rank, which no rank
  /// holds whole before every rank has added its part (torch.distributed's barrier). Every
  /// rank calls it at the same point of its calls. Each rank's part is its step count, so
  /// it also checks that every rank has taken as many steps as this one: kFailedPrecondition
  /// if not. A lost neighbour throws as in `step`.
  void barrier() {
    // Each rank's step in its own slot (the others add zeros, exactly): every rank sees every
    // rank's step, its low 24 bits, which a float holds exactly.
    const auto mine = static_cast<float>(global_step_ % (std::int64_t{1} << 24));
    std::vector<float> parts(ring_.size(), 0.0F);
    parts[ring_.rank()] = mine;
    reduce_.sum(ring_, parts);
    for (const float part : parts) {
      if (part != mine) {
        throw Error(ErrorCode::kFailedPrecondition, "ring: rank " + std::to_string(ring_.rank()) +
                                                        " reached the barrier at global step " +
                                                        std::to_string(global_step_) + ", another rank at another");
      }
    }
  }

  /// Goes on over `ring` (one formed again after the old one broke, or to take a worker
  /// in): every rank of it then calls `synchronize` from the same root before its next step.
  void reform(R ring) {
    ring_ = std::move(ring);
    sent_before_ += reduce_.bytes_sent();
    reduce_ = RingAllReduce(reduce_.segment());
  }

  /// The model, its parameters those of every replica.
  [[nodiscard]] M& model() noexcept { return model_; }
  [[nodiscard]] const M& model() const noexcept { return model_; }
  /// The optimizer's state of variable `v`.
  [[nodiscard]] const typename O::State& optimizer_state(std::size_t v) const { return states_.at(v); }
  /// Steps taken (the same on every rank).
  [[nodiscard]] std::int64_t global_step() const noexcept { return global_step_; }
  /// Steps whose mean gradient was not applied (non-finite).
  [[nodiscard]] std::int64_t refused_steps() const noexcept { return refused_; }
  /// This rank, the ring's size, and the bytes it has sent.
  [[nodiscard]] std::size_t rank() const { return ring_.rank(); }
  [[nodiscard]] std::size_t num_workers() const { return ring_.size(); }
  [[nodiscard]] std::uint64_t bytes_sent() const noexcept { return sent_before_ + reduce_.bytes_sent(); }

 private:
  /// Applies the mean in flat_ to every variable, or to none; true if it did.
  bool apply() {
    const auto variables = std::span<const VariableSpec>(model_.variables());
    const std::size_t nvars = states_.size();
    // The loss rides at the end: a non-finite loss is reported, not a reason to refuse.
    if (!detail::all_finite(std::span<const float>(flat_).first(offsets_.back()))) return false;
    auto gradient = [&](std::size_t v) {
      return std::span<const float>(flat_).subspan(offsets_[v], offsets_[v + 1] - offsets_[v]);
    };
    auto context = [&](std::size_t v) {
      return UpdateContext{global_step_ - 1, variables[v].name, {0, variables[v].rows()}, variables[v].row_size()};
    };
    if constexpr (PredictsFiniteness<O>) {
      for (std::size_t v = 0; v < nvars; ++v) {
        if (!optimizer_.stays_finite(states_[v], model_.parameter(v), gradient(v))) return false;
      }
      for (std::size_t v = 0; v < nvars; ++v) {
        apply_update(optimizer_, states_[v], model_.parameter(v), gradient(v), context(v));
      }
    } else {
      std::vector<std::vector<float>> values(nvars);
      std::vector<typename O::State> states;
      states.reserve(nvars);
      for (std::size_t v = 0; v < nvars; ++v) {
        const std::span<float> w = model_.parameter(v);
        values[v].assign(w.begin(), w.end());
        states.push_back(states_[v]);
        apply_update(optimizer_, states.back(), std::span<float>(values[v]), gradient(v), context(v));
        if (!detail::all_finite(values[v])) return false;
        for (const OptimizerSlot& slot : slots_of(optimizer_, states.back())) {
          if (!detail::all_finite(slot.values)) return false;
        }
      }
      for (std::size_t v = 0; v < nvars; ++v) {
        std::copy(values[v].begin(), values[v].end(), model_.parameter(v).begin());
        states_[v] = std::move(states[v]);
      }
    }
    return true;
  }

  M model_;
  O optimizer_;
  R ring_;
  RingAllReduce reduce_;
  std::vector<typename O::State> states_;  ///< one per variable
  std::vector<std::size_t> offsets_;       ///< where each variable's gradient starts in flat_
  std::vector<float> flat_;  ///< every gradient, the loss, the ranks that added, the vote: what the ring sums
  std::int64_t global_step_ = 0;
  std::int64_t refused_ = 0;
  std::uint64_t sent_before_ = 0;  ///< over the rings before this one
};

}  // namespace pulley
// ---- end pulley/client/all_reduce_worker.hpp ----
// ---- begin pulley/client/checkpoint_cut.hpp ----

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

// ---- begin pulley/client/client.hpp ----

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

// ---- begin pulley/client/detail/push_builder.hpp ----

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

// ---- begin pulley/client/detail/split.hpp ----

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

// ---- begin pulley/client/requests.hpp ----

#include <cstddef>
#include <cstdint>
#include <span>

// ---- begin pulley/core/placement.hpp ----

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <span>
#include <vector>

namespace pulley {

/// One contiguous slice of a variable (rows `rows` of variable `variable`) held by ps task
/// `ps`. A whole variable is a single part; a partitioned one has several, ordered by row.
struct Part {
  std::uint32_t variable = 0;  ///< index into the model's variable list
  std::uint32_t index = 0;     ///< position among the variable's parts
  std::uint32_t ps = 0;        ///< ps task that holds it
  RowRange rows;

  /// Its fields on the wire (see messages.hpp).
  template <class Archive>
  void serialize(Archive& archive) {
    archive(variable, index, ps, rows);
  }

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

  /// Its fields on the wire (see messages.hpp).
  template <class Archive>
  void serialize(Archive& archive) {
    archive(parts, first_part);
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

/// Which ps task holds the copy of ps `shard`'s shard in a job whose ps tasks keep copies
/// of each other's shards (`--ps-replicas 1`, ps/shard_copies.hpp), the job's ps tasks
/// being `members` (ascending): the next member after `shard`, the first one after the
/// last. `shard` itself when it is no member, or the only one: its shard has no copy then.
/// With every ps task of the cluster a member, ps k's copy is on ps (k + 1) mod P; when
/// a member leaves, only the copy it held moves (to the member after it).
[[nodiscard]] inline std::uint32_t copy_holder(std::span<const std::uint32_t> members,
                                               std::uint32_t shard) {
  const auto at = std::lower_bound(members.begin(), members.end(), shard);
  if (at == members.end() || *at != shard || members.size() < 2) return shard;
  return std::next(at) == members.end() ? members.front() : *std::next(at);
}

}  // namespace pulley
// ---- end pulley/core/placement.hpp ----

namespace pulley {

/// One destination of a pull: rows `rows` of variable `variable`, written to `into`.
struct PullRequest {
  std::size_t variable = 0;
  RowRange rows;
  std::span<float> into;
};

/// Rows of one embedding table to pull into `values`, or whose gradients in `values` to
/// push. The ids are grouped by the ps that holds them: `ps_begin[p]` to `ps_begin[p + 1]`
/// are ps p's (num_ps + 1 offsets), so each ps's share of `values` is one contiguous span
/// that a reply is written into, or a push sent from, with no copy.
struct RowRequest {
  std::size_t table = 0;
  std::span<const std::uint64_t> ids;
  std::span<const std::size_t> ps_begin;
  std::span<float> values;  ///< ids.size() × dim
};

}  // namespace pulley
// ---- end pulley/client/requests.hpp ----
// ---- begin pulley/concepts/transport.hpp ----

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

// ---- begin pulley/protocol/call.hpp ----

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>

// ---- begin pulley/core/spin.hpp ----

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

namespace pulley {

namespace spin_detail {
inline std::atomic<std::int64_t>& microseconds() noexcept {
  static std::atomic<std::int64_t> spin{200};
  return spin;
}
}  // namespace spin_detail

/// How long a wait whose answer may come at any moment looks again before it sleeps, giving
/// its core away between looks (default 200 µs): a worker's wait for its push's answers,
/// either end of a shared-memory link, an all-reduce rank's wait for its neighbours. The
/// answer often comes within it (the other worker's push that completes a sync step, the
/// other process's bytes) and is then taken at once, where a sleep and its wake-up cost tens
/// of microseconds, more on a virtual machine whose idle core the host halted. The price is
/// up to this much of a core's time per wait, which any other thread that wants the core
/// gets first.
[[nodiscard]] inline std::chrono::microseconds spin_before_sleep() noexcept {
  return std::chrono::microseconds(spin_detail::microseconds().load(std::memory_order_relaxed));
}

/// Sets `spin_before_sleep` for every wait this process starts from now on; 0 (or less)
/// makes a wait sleep at once. Less suits a host with many more busy threads than cores,
/// whose waits then yield to each other; the runner's flag `--spin-us` sets it.
inline void set_spin_before_sleep(std::chrono::microseconds spin) noexcept {
  spin_detail::microseconds().store(std::max<std::int64_t>(spin.count(), 0),
                                    std::memory_order_relaxed);
}

/// Looks at `ready()` until it is true (true) or `end` has passed (false), yielding the core
/// between looks.
template <class Ready>
bool spin_until(Ready&& ready, std::chrono::steady_clock::time_point end) {
  while (!ready()) {
    if (std::chrono::steady_clock::now() >= end) return ready();
    std::this_thread::yield();
  }
  return true;
}

}  // namespace pulley
// ---- end pulley/core/spin.hpp ----
// ---- begin pulley/protocol/messages.hpp ----

#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

// ---- begin pulley/core/node.hpp ----

#include <compare>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>

namespace pulley {

/// A task of the cluster, named as in TF_CONFIG: its role ("ps", "worker", "chief",
/// "evaluator"; TF_CONFIG's task "type", the name of its job in a TensorFlow cluster spec)
/// and its index among the tasks of that role.
struct Node {
  /// What a task does.
  enum class Role : std::uint8_t { kPs, kWorker, kChief, kEvaluator };
  Role role = Role::kWorker;
  std::uint32_t index = 0;

  static constexpr Node ps(std::uint32_t i) noexcept { return {Role::kPs, i}; }
  static constexpr Node worker(std::uint32_t i) noexcept { return {Role::kWorker, i}; }
  static constexpr Node chief() noexcept { return {Role::kChief, 0}; }
  static constexpr Node evaluator() noexcept { return {Role::kEvaluator, 0}; }

  /// "ps", "worker", "chief" or "evaluator".
  static constexpr const char* role_name(Role role) noexcept {
    constexpr const char* roles[] = {"ps", "worker", "chief", "evaluator"};
    return static_cast<unsigned>(role) < 4 ? roles[static_cast<unsigned>(role)] : "unknown";
  }

  /// "ps:1", "worker:0", ...
  [[nodiscard]] std::string name() const {
    return std::string(role_name(role)) + ":" + std::to_string(index);
  }

  /// Its fields on the wire (see protocol/messages.hpp).
  template <class Archive>
  void serialize(Archive& archive) {
    archive(role, index);
  }

  friend constexpr auto operator<=>(const Node&, const Node&) = default;
};

/// A set of roles: who may send a message (`kSenders` on each request, in protocol/messages/).
class RoleSet {
 public:
  /// The roles listed.
  constexpr RoleSet(std::initializer_list<Node::Role> roles) noexcept {
    for (const Node::Role role : roles) bits_ = static_cast<std::uint8_t>(bits_ | bit(role));
  }
  /// Every role.
  static constexpr RoleSet all() noexcept {
    return {Node::Role::kPs, Node::Role::kWorker, Node::Role::kChief, Node::Role::kEvaluator};
  }
  /// True if `role` is in the set.
  [[nodiscard]] constexpr bool contains(Node::Role role) const noexcept {
    return (bits_ & bit(role)) != 0;
  }
  /// "chief", "worker or chief", ...
  [[nodiscard]] std::string describe() const {
    std::string out;
    for (unsigned j = 0; j < 4; ++j) {
      if (!contains(static_cast<Node::Role>(j))) continue;
      if (!out.empty()) out += " or ";
      out += Node::role_name(static_cast<Node::Role>(j));
    }
    return out.empty() ? "nobody" : out;
  }

 private:
  static constexpr std::uint8_t bit(Node::Role role) noexcept {
    return static_cast<std::uint8_t>(1U << static_cast<unsigned>(role));
  }
  std::uint8_t bits_ = 0;
};

/// Why `tasks` is no set of the job's task indices of one role (its ps tasks, or its
/// workers), or "" when it is one: not empty, ascending, each listed once. `role` names
/// one of them in the answer ("ps task", "worker").
[[nodiscard]] inline std::string check_task_set(std::span<const std::uint32_t> tasks, std::string_view role) {
  if (tasks.empty()) return "a job needs at least one " + std::string(role);
  for (std::size_t i = 1; i < tasks.size(); ++i) {
    if (tasks[i] <= tasks[i - 1]) return "the " + std::string(role) + "s must be ascending task indices, each listed once";
  }
  return {};
}

/// Throws kInvalidArgument, `context` before the reason, unless `tasks` is a set of task
/// indices of one role (check_task_set).
inline void require_task_set(std::span<const std::uint32_t> tasks, std::string_view role, std::string_view context = {}) {
  if (std::string why = check_task_set(tasks, role); !why.empty()) throw Error(ErrorCode::kInvalidArgument, std::string(context) + why);
}

/// Task indices (the job's ps tasks, or its workers) as log lines name them: "{0, 2}".
[[nodiscard]] inline std::string describe_members(std::span<const std::uint32_t> members) {
  std::string text = "{";
  for (std::size_t i = 0; i < members.size(); ++i) text += (i == 0 ? "" : ", ") + std::to_string(members[i]);
  return text + "}";
}

}  // namespace pulley
// ---- end pulley/core/node.hpp ----
// ---- begin pulley/protocol/messages/checkpoint.hpp ----

/// The messages of a checkpoint's cut and of a restore (protocol/messages.hpp lists every
/// message): the chief pauses every ps, reads its state and its tables' rows in chunks and
/// lets it go on; or sets a state and rows from a checkpoint.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

// ---- begin pulley/protocol/messages/fields.hpp ----

/// The fields that messages share (protocol/messages.hpp lists the messages): a part's
/// values and its optimizer state, an embedding table's rows, a slice of a part, and the
/// most that one message may carry.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace pulley {

/// Values for one part, addressed by its global index in `Placement::parts`.
struct PartValues {
  std::uint32_t part = 0;
  std::span<const float> values;  ///< a tensor

  template <class Archive>
  void serialize(Archive& archive) {
    archive(part, values);
  }
};

/// One part with its optimizer state, as a checkpoint reads and restores it: its values, its
/// optimizer slots (one value per element each, in the order the ps names them) and its
/// counters.
struct PartState {
  std::uint32_t part = 0;
  std::span<const float> values;              ///< a tensor
  std::vector<std::span<const float>> slots;  ///< tensors
  std::vector<std::int64_t> counters;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(part, values, slots, counters);
  }
};

/// The most ids one PullRows or Push carries to one ps, over all its tables (2 MiB of ids,
/// half the metadata a TCP frame may hold): a client splits a larger row pull into several
/// and refuses a larger push (its batch is too large), a ps refuses more.
inline constexpr std::size_t kMaxIdsPerMessage = std::size_t{1} << 18U;
/// The most bytes of rows of one table that one PullRows answer or Push carries: a client
/// splits larger row pulls, a ps refuses more.
inline constexpr std::size_t kMaxRowBytesPerMessage = std::size_t{256} << 20U;

/// Rows of one embedding table: which ids, and in a push one row of the table's dim floats
/// per id. The ids ride in the metadata (8 bytes each); the rows are a tensor.
struct TableRows {
  std::uint32_t table = 0;         ///< index into the model's tables
  std::vector<std::uint64_t> ids;  ///< distinct
  std::span<const float> values;   ///< a tensor: ids.size() × dim (empty in a pull)

  template <class Archive>
  void serialize(Archive& archive) {
    archive(table, ids, values);
  }
};

/// Rows `rows` (relative to the variable, inside the part) of part `part`.
struct Slice {
  std::uint32_t part = 0;
  RowRange rows;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(part, rows);
  }
};

}  // namespace pulley
// ---- end pulley/protocol/messages/fields.hpp ----

namespace pulley {

/// Worker `w`'s entry of a cut's by-worker vector (PauseReply::pushes, ReadState::until,
/// the last pushes' numbers and series), 0 past its end: a vector may be shorter than the
/// workers another ps knows of, and a ps that never heard of a worker took none of its
/// pushes.
inline std::uint64_t of_worker(const std::vector<std::uint64_t>& by_worker,
                               std::size_t w) noexcept {
  return w < by_worker.size() ? by_worker[w] : 0;
}

// ---- requests ---------------------------------------------------------------------------

/// Chief → every ps, to read a checkpoint's cut: once the ps has completed `at_step` global
/// steps (at once for 0; the moment that step completes otherwise, as a step-gated pull),
/// hold the pushes that arrive from then on (their workers wait), and say how many pushes
/// of each worker were taken so far. Ends with Resume, or when the chief's connection
/// closes.
struct Pause {
  static constexpr std::string_view kName = "Pause";
  static constexpr RoleSet kSenders{Node::Role::kChief};
  std::int64_t at_step = 0;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(at_step);
  }
};

/// Chief → a paused ps: once it has taken the cut's pushes of each worker w (taking held
/// ones as needed, in order), answer with its state: every part it holds with its optimizer
/// state, and the sync policy's. The cut is `until[w]` pushes, the largest count over all
/// ps tasks, less a push this ps will never take: one that is short of `until[w]` and whose
/// own last push of w is the one named here (the furthest ps's last) took every push still
/// to come, and what it lacks was lost with an earlier process of w, written to other ps
/// tasks only; one whose last differs waits for that one push (CheckpointCut::own_until).
/// Each ps judges by what it took itself (with copies, the copy read from, which is the
/// one that gets it), so every one answers at the same cut.
struct ReadState {
  static constexpr std::string_view kName = "ReadState";
  /// Held pushes taken to reach the cut are applied.
  static constexpr bool kChangesParameters = true;
  static constexpr RoleSet kSenders{Node::Role::kChief};
  std::vector<std::uint64_t> until;
  /// An incremental checkpoint's cut: the tables' rows touched at or after this global step
  /// only, with the ids evicted since (ReadRows::evicted); -1: every row. A ps whose log of
  /// evictions starts later (PauseReply::evictions_since) refuses it.
  std::int64_t since = -1;
  /// Evictions before this global step are forgotten: no later cut will be since an
  /// earlier step (the newest checkpoint on disk). -1: none.
  std::int64_t forget_evictions_before = -1;
  /// By worker: the number (Push::sequence) and series of the last push taken by the ps
  /// with the most (PauseReply::last_sequences); 0 and 0: unnumbered, `until` stands.
  std::vector<std::uint64_t> last_sequences = {};
  std::vector<std::uint64_t> last_series = {};

  template <class Archive>
  void serialize(Archive& archive) {
    archive(until, since, forget_evictions_before, last_sequences, last_series);
  }
};

/// Chief → a paused ps: take the held pushes, and go on.
struct Resume {
  static constexpr std::string_view kName = "Resume";
  /// The held pushes are applied.
  static constexpr bool kChangesParameters = true;
  static constexpr RoleSet kSenders{Node::Role::kChief};
  /// Training goes on, but the tables' rows stay readable as they were at the cut
  /// (ReadRows; the ps copies a row aside before it first updates it) until a Resume
  /// without it, or until the chief's connection closes.
  bool keep_rows = false;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(keep_rows);
  }
};

/// Chief → ps: set every part this ps holds, with its optimizer state, and the sync
/// policy's state, from a checkpoint: to resume a job, or to roll every ps back to one
/// when a ps was lost (TensorFlow restores every variable then). The ps is ready after it,
/// at epoch `epoch`: what waited there, and whatever arrives for an earlier epoch, is
/// refused (`kFailedPrecondition`), so that clients start their step again.
struct Restore {
  static constexpr std::string_view kName = "Restore";
  static constexpr bool kChangesParameters = true;
  static constexpr RoleSet kSenders{Node::Role::kChief};
  std::uint64_t epoch = 0;
  std::vector<std::int64_t> pacer;  ///< SyncPolicy::save's, or {global step}
  std::vector<PartState> parts;     ///< every part held here
  /// True: the tables are emptied, and their rows follow in RestoreRows; the ps is not
  /// ready (WaitReady waits, pulls are refused) until the one with `done`.
  bool tables_follow = false;
  /// The job's workers (ChangeWorkers), counted by the restored pacer; empty: the cluster
  /// spec's, or as the ps has them.
  std::vector<std::uint32_t> workers = {};

  template <class Archive>
  void serialize(Archive& archive) {
    archive(epoch, pacer, parts, tables_follow, workers);
  }
};

/// Admission counts one ReadRows answer or RestoreRows carries at most: 16 bytes each (id,
/// count, step), 2 MiB of metadata in all.
inline constexpr std::size_t kMaxCandidatesPerMessage = std::size_t{1} << 17U;

/// Rows of `stride` floats one ReadRows answer carries at most: kMaxIdsPerMessage, and 64 MiB.
inline std::size_t rows_per_chunk(std::size_t stride) noexcept {
  constexpr std::size_t kBytes = std::size_t{64} << 20U;
  return std::max<std::size_t>(
      1, std::min(kMaxIdsPerMessage, kBytes / (std::max<std::size_t>(stride, 1) * sizeof(float))));
}

/// Chief → a ps paused at a checkpoint's cut, after its ReadState: the rows of table `table`
/// the cut holds (every row, or those changed since ReadState::since), from the `begin`-th
/// on, at most `max_rows` of them (the ps caps a chunk at kMaxIdsPerMessage rows and 64 MiB,
/// so its memory for a checkpoint is bounded however large its tables are); with
/// `candidates`, the ids admission was counting instead; with `evicted`, the ids an
/// incremental cut says were evicted. Answered with a RowsChunk.
struct ReadRows {
  static constexpr std::string_view kName = "ReadRows";
  /// Its reply views buffers the next request reuses (as a pull of rows).
  static constexpr bool kChangesParameters = true;
  static constexpr RoleSet kSenders{Node::Role::kChief};
  std::uint32_t table = 0;
  std::uint64_t begin = 0;
  std::uint32_t max_rows = 0;
  bool candidates = false;
  bool evicted = false;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(table, begin, max_rows, candidates, evicted);
  }
};

/// Chief → ps, after a Restore with `tables_follow`: rows of table `table` (each its values,
/// then one dim of floats per name in `slot_names`, the checkpoint's optimizer slots) with
/// the step each was last touched, or with `candidates` admission counts (`counts`,
/// `steps`; `rows` empty); the ps keeps those its id sharding gives it and ignores the rest.
/// Slots named otherwise than the ps's optimizer names its own are dropped (the rows'
/// optimizer starts afresh). `updates` sets the table's update count (-1: leave it). The
/// message with `done` ends the restore: the ps turns ready.
struct RestoreRows {
  static constexpr std::string_view kName = "RestoreRows";
  static constexpr bool kChangesParameters = true;
  static constexpr RoleSet kSenders{Node::Role::kChief};
  std::uint64_t epoch = 0;
  std::uint32_t table = 0;
  std::int64_t updates = -1;
  std::vector<std::string> slot_names;
  std::vector<std::uint64_t> ids;
  std::span<const float> rows;        ///< a tensor: ids.size() × (1 + slot_names.size()) × dim
  std::vector<std::uint32_t> steps;   ///< per id: last touched (rows) or last pulled (candidates)
  std::vector<std::uint32_t> counts;  ///< per id, candidates only
  bool candidates = false;
  bool done = false;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(epoch, table, updates, slot_names, ids, rows, steps, counts, candidates, done);
  }
};

// ---- replies ----------------------------------------------------------------------------

/// Answer to Pause: where this ps stands, and what its parts' optimizer state is made of.
struct PauseReply {
  static constexpr std::string_view kName = "PauseReply";
  std::int64_t global_step = 0;
  std::uint64_t epoch = 0;
  std::vector<std::uint64_t> pushes;       ///< by worker: pushes taken so far
  std::vector<std::string> slot_names;     ///< the optimizer's slots, in PartState order
  std::vector<std::string> counter_names;  ///< the optimizer's counters
  bool whole = true;  ///< the optimizer's State is all in the slots and counters
  /// The global step from which this ps knows every row its tables evicted: the earliest
  /// an incremental checkpoint's cut may be since (ReadState::since).
  std::int64_t evictions_since = 0;
  /// The furthest step a push taken since the last restore was made for (Push::local_step;
  /// -1: none). Under BoundedStaleness it may be past `global_step`: a change of workers is
  /// set for a step no push was taken for yet, so that every ps takes the same pushes of a
  /// worker that leaves (those made for earlier steps).
  std::int64_t furthest_pushed = -1;
  /// By worker: the number (Push::sequence) and series of the last push taken, 0 and 0 when
  /// none was numbered. The cut names the furthest ps's (ReadState::last_sequences).
  std::vector<std::uint64_t> last_sequences = {};
  std::vector<std::uint64_t> last_series = {};

  template <class Archive>
  void serialize(Archive& archive) {
    archive(global_step, epoch, pushes, slot_names, counter_names, whole, evictions_since,
            furthest_pushed, last_sequences, last_series);
  }
};

/// Answer to ReadState: this ps's part of the cut.
struct StateReply {
  static constexpr std::string_view kName = "StateReply";
  std::int64_t global_step = 0;
  std::vector<std::int64_t> pacer;  ///< SyncPolicy::save's
  std::vector<PartState> parts;     ///< every part held here, in part order

  template <class Archive>
  void serialize(Archive& archive) {
    archive(global_step, pacer, parts);
  }
};

/// Answer to ReadRows: one chunk of a table's rows at the cut (or of its candidates).
struct RowsChunk {
  static constexpr std::string_view kName = "RowsChunk";
  std::uint64_t total = 0;   ///< rows (or candidates) at the cut: read until `begin` reaches it
  std::int64_t updates = 0;  ///< the table's update count on this ps
  std::vector<std::string> slot_names;  ///< the row-wise optimizer's, in row order
  std::vector<std::uint64_t> ids;
  std::span<const float> rows;        ///< a tensor: ids.size() × stride (empty for candidates)
  std::vector<std::uint32_t> steps;   ///< per id: last touched (rows) or last pulled (candidates)
  std::vector<std::uint32_t> counts;  ///< per id, candidates only
  std::int64_t since = -1;            ///< the cut's ReadState::since

  template <class Archive>
  void serialize(Archive& archive) {
    archive(total, updates, slot_names, ids, rows, steps, counts, since);
  }
};

}  // namespace pulley
// ---- end pulley/protocol/messages/checkpoint.hpp ----
// ---- begin pulley/protocol/messages/membership.hpp ----

/// The messages that change who is in the job (protocol/messages.hpp lists every message):
/// a task that joins or leaves, or asks the job's shape (all three at the chief's JoinDesk),
/// a question whether a ps is lost, and the chief's change of the job's workers; the
/// requests, then their replies.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace pulley {

// ---- requests ---------------------------------------------------------------------------

/// A new task → the chief (its JoinDesk, runner/join_desk.hpp; never a ps). The task index
/// is the one its handshake proved.
///   - A ps, started beyond the job's ps tasks, serves at `address` and asks to take a
///     share of the model. Its index must be the next one (the count of ps tasks the job
///     has known; a lower one, a joined ps started again, is answered and left alone: the
///     chief takes it back by a rollback, as any ps started again). Answered with an Ack
///     once the chief has queued it: the chief takes it in as soon as it is free
///     (Chief::join; ChiefLoop), which registers the model on it.
///   - A worker (no address) asks to train with the job: an index that is not one of the
///     job's workers (the next one, or one that left). Answered kUnavailable while it waits
///     (ask again), a JoinReply once the chief counted it in (Chief::change_workers, as
///     soon as it is free): the ps tasks then let it connect.
struct Join {
  static constexpr std::string_view kName = "Join";
  static constexpr RoleSet kSenders{Node::Role::kPs, Node::Role::kWorker};
  std::string address;  ///< host:port where the new ps serves (a ps's Join)

  template <class Archive>
  void serialize(Archive& archive) {
    archive(address);
  }
};

/// A task of the job → the chief (its JoinDesk, runner/join_desk.hpp; never a ps): take it
/// out of the job, which goes on without it (the operator sent its process SIGTERM: a job
/// scaled down). The task index is the one its handshake proved.
///   - A worker: the chief takes it out of the job's workers (Chief::change_workers) as
///     soon as it is free; it trains until then, and its token request of the first step
///     the job counts it no more is refused (kPermissionDenied): then it ends.
///   - A ps: the chief moves its share to the other ps tasks through one cut, nothing
///     trained lost (Chief::retire); then it ends.
/// Answered LeaveReply (out or not yet: ask again), or kFailedPrecondition when it cannot
/// leave (the job's last worker or ps task, or the others refused to take its share).
struct Leave {
  static constexpr std::string_view kName = "Leave";
  static constexpr RoleSet kSenders{Node::Role::kPs, Node::Role::kWorker};

  template <class Archive>
  void serialize(Archive& /*archive*/) {}
};

/// A task about to join, started with the chief's address alone (`--join --chief-host`,
/// no cluster spec: under Slurm a job step of its own, say) → the chief's JoinDesk: the
/// job's shape now, from which it makes its cluster spec and takes the next task index of
/// its role (an evaluator: the ps tasks to read from). It asks as task 0 of its role (it
/// has no index yet): the desk answers whoever proved the job's secret. Answered ShapeReply.
struct Shape {
  static constexpr std::string_view kName = "Shape";
  static constexpr RoleSet kSenders{Node::Role::kPs, Node::Role::kWorker, Node::Role::kEvaluator};

  template <class Archive>
  void serialize(Archive& /*archive*/) {}
};

/// A worker or the evaluator → the chief's JoinDesk (never a ps), in a job whose ps tasks
/// keep copies of each other's shards (`--ps-replicas 1`): process `process` of ps `ps`
/// (wire::Welcome::server; 0: one this task never reached), which this task reached
/// before, is out of its reach (`why`: its address refuses connections, or it stayed out of
/// reach for the copy timeout). Is it lost for the job, so that its copies are given up?
/// The chief rules by its own look at the address (runner/copy_rulings.hpp): lost if it
/// refuses connections, something else answers there, or it stays silent for the copy
/// timeout; not lost if that very process serves there. Answered LostPsReply, or
/// kUnavailable while the chief looks (ask again).
struct LostPs {
  static constexpr std::string_view kName = "LostPs";
  static constexpr RoleSet kSenders{Node::Role::kWorker, Node::Role::kEvaluator};
  std::uint32_t ps = 0;
  std::uint64_t process = 0;
  std::string why;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(ps, process, why);
  }
};

/// Chief → every ps, paused (Pause): the job's workers are `workers` (task indices,
/// ascending) from global step `from_step` on: workers joined, or left for good. Each ps
/// counts them (SyncPolicy::reshape) the moment its global step reaches `from_step`, and
/// lets a new worker connect at once (its requests wait until then). The chief picks a step beyond
/// every ps's while they are paused; a ps already there refuses it (kFailedPrecondition). A later
/// ChangeWorkers replaces one still waiting for its step; one with no workers takes back the one of
/// `from_step` (another ps refused it). Under SyncReplicas every ps counts them at the
/// same step boundary (a push of that step needs a pull of it, which waits until the ps
/// is there); see BoundedStaleness for how its clocks take a change.
struct ChangeWorkers {
  static constexpr std::string_view kName = "ChangeWorkers";
  static constexpr RoleSet kSenders{Node::Role::kChief};
  std::vector<std::uint32_t> workers;
  std::int64_t from_step = 0;
  /// The job's workers until then, as the chief has them (the cluster spec's, the first
  /// time), so that a ps that never heard them knows who leaves; empty: not known.
  std::vector<std::uint32_t> before = {};

  template <class Archive>
  void serialize(Archive& archive) {
    archive(workers, from_step, before);
  }
};

// ---- replies ----------------------------------------------------------------------------

/// The chief's answer to a worker's Join once it counted the worker in: the job's
/// schedule as the chief runs it, which the new worker follows rather than what its own
/// flags give (they may derive it from another count of workers).
struct JoinReply {
  static constexpr std::string_view kName = "JoinReply";
  std::int64_t last_step = 0;          ///< training ends at this global step
  std::vector<std::uint32_t> workers;  ///< the job's workers now, ascending

  template <class Archive>
  void serialize(Archive& archive) {
    archive(last_step, workers);
  }
};

/// The chief's answer to a Leave: whether the task is out of the job now (a ps may end:
/// its share is held by the others), or the chief has it queued (ask again).
struct LeaveReply {
  static constexpr std::string_view kName = "LeaveReply";
  bool out = false;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(out);
  }
};

/// The chief's ruling on a LostPs: whether that process is lost for the job (every task
/// gives its copies up), or the chief still reaches it (the task waits for it).
struct LostPsReply {
  static constexpr std::string_view kName = "LostPsReply";
  bool lost = false;
  std::string why;  ///< the chief's reason, for the asker's log

  template <class Archive>
  void serialize(Archive& archive) {
    archive(lost, why);
  }
};

/// The chief's answer to a Shape: the job as it stands. The next ps to join takes task
/// index `ps.size()`, the next worker `next_worker`.
struct ShapeReply {
  static constexpr std::string_view kName = "ShapeReply";
  std::vector<std::string> ps;         ///< every ps task's address by task index, members or not
  std::vector<std::uint32_t> members;  ///< the job's ps tasks now, ascending
  std::vector<std::uint32_t> workers;  ///< the job's workers now, ascending
  std::uint32_t next_worker = 0;       ///< the task index the next worker to join takes

  template <class Archive>
  void serialize(Archive& archive) {
    archive(ps, members, workers, next_worker);
  }
};

}  // namespace pulley
// ---- end pulley/protocol/messages/membership.hpp ----
// ---- begin pulley/protocol/messages/monitoring.hpp ----

/// The messages by which tasks watch each other (protocol/messages.hpp lists every
/// message): a ps's counters (GetStats), a task's heartbeat, and the StatsReply that answers
/// both.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace pulley {

// ---- requests ---------------------------------------------------------------------------

/// Any client → ps: counters for monitoring and tests.
struct GetStats {
  static constexpr std::string_view kName = "GetStats";
  /// A worker found lost on the way may complete the step that waited for it.
  static constexpr bool kChangesParameters = true;
  static constexpr RoleSet kSenders{Node::Role::kWorker, Node::Role::kChief,
                                    Node::Role::kEvaluator};

  template <class Archive>
  void serialize(Archive& /*archive*/) {}
};

/// Worker or chief → every ps, every second or so from a thread of its own
/// (`HeartbeatSender`, heartbeat.hpp): the task is alive. A ps that heard a worker once and
/// then hears nothing for its worker timeout holds it lost: the sync policy stops waiting
/// for it (`SyncPolicy::on_worker_lost`) until its heartbeats come back. A chief silent for
/// as long is held lost too: the ps keeps the model and waits for a chief to come back
/// (ParameterServer::set_chief_wait), then gives up and ends training as aborted. Answered
/// with a StatsReply, whose `lost` and `chief_lost` tell the task who is gone.
struct Heartbeat {
  static constexpr std::string_view kName = "Heartbeat";
  /// Another worker found lost on the way may complete the step that waited for it.
  static constexpr bool kChangesParameters = true;
  static constexpr RoleSet kSenders{Node::Role::kWorker, Node::Role::kChief};
  std::uint32_t worker = 0;  ///< the sender's task index (its worker index; 0 for the chief)
  /// The worker ends (its training is over): the ps forgets it instead of holding it lost
  /// once it is quiet.
  bool leaving = false;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(worker, leaving);
  }
};

// ---- replies ----------------------------------------------------------------------------

/// Counters of one ps task.
struct Stats {
  std::int64_t global_step = 0;              ///< steps completed (sync) or pushes applied (async)
  std::int64_t updates_applied = 0;          ///< optimizer applications over all parts
  std::int64_t gradients_accepted = 0;       ///< part gradients taken into an accumulator
  std::int64_t stale_gradients_dropped = 0;  ///< part gradients older than the step, dropped
  std::int64_t requests_rejected = 0;        ///< requests answered with an ErrorReply
  std::int64_t bytes_pushed = 0;             ///< gradient payload received
  std::int64_t bytes_pulled = 0;             ///< parameter payload sent
  /// Pushes refused, and updates skipped, because applying them would have made a
  /// parameter or an optimizer slot non-finite.
  std::int64_t updates_refused = 0;
  /// Times a worker was held lost: heard once, then silent for the worker timeout.
  std::int64_t workers_lost = 0;
  std::int64_t table_rows = 0;          ///< embedding-table rows held now
  std::int64_t table_rows_evicted = 0;  ///< rows removed for being untouched too long
  /// Pushed rows dropped: not admitted yet (or evicted), or stale.
  std::int64_t table_rows_dropped = 0;
  /// Rows evicted, or not created, to keep a table within its max_rows (TableSpec).
  std::int64_t table_rows_capped = 0;
  /// Pushes that came again after a lost connection (the same sequence number as one taken
  /// or held): answered as the first, not counted again.
  std::int64_t pushes_repeated = 0;
  /// Pushes taken to the sync policy (each once, whatever its verdict).
  std::int64_t pushes_taken = 0;
  /// Times a worker held lost was heard from again and counted again.
  std::int64_t workers_returned = 0;
  /// Time spent applying updates (the optimizer, dense and rows), in microseconds.
  std::int64_t apply_microseconds = 0;
  /// Requests held now until the global step moves, token requests and step-gated pulls:
  /// the ps's queue (a gauge, not a counter).
  std::int64_t requests_waiting = 0;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(global_step, updates_applied, gradients_accepted, stale_gradients_dropped,
            requests_rejected, bytes_pushed, bytes_pulled, updates_refused, workers_lost,
            table_rows, table_rows_evicted, table_rows_dropped, table_rows_capped, pushes_repeated,
            pushes_taken, workers_returned, apply_microseconds, requests_waiting);
  }
};

/// Answer to GetStats and Heartbeat: the counters, what the sync policy waits for before
/// the next step, to explain a wait that lasts ("step 812: 1 of 2 gradients in; waiting for
/// worker:1 (last heard 14.2 s ago)"), the workers this ps holds lost now, whether it holds
/// the chief lost, and whether it serves training (holds an initialized or restored model).
struct StatsReply {
  static constexpr std::string_view kName = "StatsReply";
  Stats stats;
  std::string waiting_for;
  std::vector<std::uint32_t> lost;  ///< workers held lost, ascending
  bool chief_lost = false;          ///< the chief's heartbeats stopped, and no chief is back yet
  bool ready = false;               ///< the ps serves training (a new chief goes on from it)
  std::uint64_t epoch = 0;          ///< the restores it has seen (a new chief needs them alike)
  /// The job's ps tasks as this ps knows them (empty before registration), and their
  /// version: how a client that lost a ps learns whether the job went on without it.
  std::vector<std::uint32_t> members = {};
  std::uint64_t membership = 0;
  /// Every ps task's address, once one joined beyond the cluster spec (Register::ps_addresses).
  std::vector<std::string> ps_addresses = {};
  /// The job's workers, ascending, once they changed (ChangeWorkers); empty: the spec's.
  std::vector<std::uint32_t> workers = {};

  template <class Archive>
  void serialize(Archive& archive) {
    archive(stats, waiting_for, lost, chief_lost, ready, epoch, members, membership, ps_addresses,
            workers);
  }
};

}  // namespace pulley
// ---- end pulley/protocol/messages/monitoring.hpp ----
// ---- begin pulley/protocol/messages/training.hpp ----

/// The messages of setting up and training (protocol/messages.hpp lists every message):
/// the chief's registration of the model and its initial values, a client's wait for them,
/// a worker's token, pulls and pushes, and the end of training; the requests, then their
/// replies.

#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

// ---- begin pulley/protocol/token.hpp ----

#include <cstdint>

namespace pulley {

/// A sync token: leave for one step, and what that step must read. TF's `sync_token_queue`
/// holds only the step number; pulley's tokens also say which parameters to pull, so that
/// one mechanism serves every pacing rule.
struct Token {
  /// Tags the step's push (TF's `local_step`): the policy judges staleness by it.
  std::int64_t local_step = 0;
  /// The step's parameters must include every update of the global steps before this one:
  /// the worker pulls with `Pull::min_step = pull_step` (0: whatever the ps holds).
  std::int64_t pull_step = 0;
  /// What the worker pulls together with this step's push, for its next step: the earliest
  /// `pull_step` its next token can have, so that the prefetch can serve it.
  std::int64_t next_pull_step = 0;
  /// False when tokens never wait (Async): the worker need not ask for another.
  bool paced = true;
  /// Which batch of the job's data the step reads, counted from the job's start, when the
  /// policy numbers them (-1: it does not, and each worker reads its own share). A step's
  /// batches are numbered by the step, not by who takes its tokens: under SyncReplicas,
  /// step s reads batches s × max(R, N) ... s × max(R, N) + max(R, N) - 1, so a token a
  /// lost worker gave back reads, in whichever worker takes it, the batch the lost worker
  /// would have read (DataShard::batch, runner/training.hpp).
  std::int64_t batch = -1;
  /// The step needs all R gradients although workers are lost (a SyncReplicas refill
  /// step): the live workers bring the lost ones'. The pacing ps (the lowest member: ps 0 while none left) decides it; the
  /// worker's push carries it (Push::refill), and every ps follows the pacing ps's word for the
  /// step (`SyncPolicy::follow`), so that no ps waits for gradients the tokens will not bring.
  bool refill = false;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(local_step, pull_step, next_pull_step, paced, batch, refill);
  }
  friend bool operator==(const Token&, const Token&) = default;
};

}  // namespace pulley
// ---- end pulley/protocol/token.hpp ----

namespace pulley {

// ---- requests ---------------------------------------------------------------------------

/// Chief → every ps: the model's variables. Each ps computes the placement with its Sharding
/// policy and answers with it, so the chief can check that all ps tasks agree. Repeating the
/// same registration is harmless; a different one is refused.
///
/// A registration of a later membership (a ps task left the job for good) places the same
/// model over `members` (sharding/rebalance.hpp): each member drops what it held and waits,
/// unready, for the Restore that fills its new share.
struct Register {
  static constexpr std::string_view kName = "Register";
  static constexpr RoleSet kSenders{Node::Role::kChief};
  /// A registration of a later membership drops what the ps held (and may replace the
  /// copy a ShardCopies holds): no reply may still view it.
  static constexpr bool kChangesParameters = true;
  std::vector<VariableSpec> variables;
  /// The model's embedding tables: each ps creates the rows it holds as they are first
  /// pulled, from `table_seed` (no Initialize).
  std::vector<TableSpec> tables = {};
  std::uint64_t table_seed = 0;
  /// The ps tasks of the job, ascending task indices; empty: every ps task of the cluster.
  std::vector<std::uint32_t> members = {};
  /// The membership's version: 0 for the cluster's first shape, one more for each change.
  std::uint64_t membership = 0;
  /// Every ps task's address by task index, once a ps joined beyond the cluster spec
  /// (Chief::join); empty: the spec's. The placement is computed over this many tasks.
  std::vector<std::string> ps_addresses = {};

  template <class Archive>
  void serialize(Archive& archive) {
    archive(variables, tables, table_seed, members, membership, ps_addresses);
  }
};

/// Chief → ps: initial values of parts this ps holds. Each part is initialized once.
struct Initialize {
  static constexpr std::string_view kName = "Initialize";
  static constexpr RoleSet kSenders{Node::Role::kChief};
  static constexpr bool kChangesParameters = true;
  std::vector<PartValues> parts;
  /// True: the ps is paused for the sender's checkpoint cut from the moment it is
  /// initialized (pushes are held until Resume), so the chief reads global step 0 exactly
  /// however fast the workers start.
  bool hold = false;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(parts, hold);
  }
};

/// Client → ps: answered with the placement once every part on this ps is initialized.
struct WaitReady {
  static constexpr std::string_view kName = "WaitReady";
  static constexpr RoleSet kSenders{Node::Role::kWorker, Node::Role::kChief,
                                    Node::Role::kEvaluator};

  template <class Archive>
  void serialize(Archive& /*archive*/) {}
};

/// Worker → the pacing ps (the lowest member, ps 0 while none left): take a sync token before a
/// step (TF's `sync_token_queue.dequeue()`). Waits while the sync policy has no token to give this
/// worker.
struct TakeToken {
  static constexpr std::string_view kName = "TakeToken";
  static constexpr RoleSet kSenders{Node::Role::kWorker};
  std::uint32_t worker = 0;
  std::uint64_t epoch = 0;  ///< the restore the worker knows of (PlacementReply::epoch)

  template <class Archive>
  void serialize(Archive& archive) {
    archive(worker, epoch);
  }
};

/// Client → ps: read slices. Waits until the ps has completed `min_step` global steps, so a
/// worker holding a token reads parameters that include every update its token requires.
/// A pull that waits is answered the moment the step completes, before any later push.
struct Pull {
  static constexpr std::string_view kName = "Pull";
  static constexpr RoleSet kSenders{Node::Role::kWorker, Node::Role::kChief,
                                    Node::Role::kEvaluator};
  std::int64_t min_step = 0;
  std::vector<Slice> slices;
  /// The restore the client knows of: a pull that waits for a step of an earlier one is
  /// refused (`kFailedPrecondition`), as that step means something else now.
  std::uint64_t epoch = 0;
  /// From a worker: `TokenReply::pushes_taken` of its latest token, the pushes of its task
  /// the pacing ps had taken. A ps that took fewer, asked for the next step without this
  /// worker's push of the one in progress, learns that the push was lost on the way here
  /// and counts it as taken (on_pull_ahead: every ps then counts the same pushes).
  std::uint64_t pushes_paced = 0;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(min_step, slices, epoch, pushes_paced);
  }
};

/// Worker → ps: gradients computed from parameters of `local_step`. Every worker pushes to
/// every ps once per step (possibly with no parts): the message also counts towards the
/// ps's global step (`SyncPolicy::on_push`).
struct Push {
  static constexpr std::string_view kName = "Push";
  static constexpr bool kChangesParameters = true;
  static constexpr RoleSet kSenders{Node::Role::kWorker};
  std::uint32_t worker = 0;
  std::int64_t local_step = 0;
  std::vector<PartValues> gradients;
  /// The restore the worker knows of: a push of an earlier one is refused.
  std::uint64_t epoch = 0;
  /// Numbers the worker's pushes (0: none): a push sent again after a lost connection (the
  /// same push: same number, same gradients) is answered as the first was, counted once.
  std::uint64_t sequence = 0;
  /// Gradient rows of embedding tables held here, duplicates summed by the worker; they
  /// share the push's verdict (stale rows are dropped with its parts).
  std::vector<TableRows> rows = {};
  /// Whose numbers `sequence` counts in: drawn at random by each client (0: none). A push
  /// numbered below the last one the ps took of the same series is an old copy that came
  /// late on a connection its worker gave up (the worker sent it again and went on): it is
  /// refused, never counted.
  std::uint64_t series = 0;
  /// The token it was made for said its step is a refill step (Token::refill).
  bool refill = false;
  /// No element of `gradients` is larger in magnitude, as the client that made the push
  /// measured it while checking it finite (kOrdinaryMagnitude, or +infinity: not known).
  /// Not on the wire: it serves a ps in the client's own process, which trusts its checks
  /// (RequestContext::tensors_finite); over TCP the ps measures the push as it reads it.
  float largest = std::numeric_limits<float>::infinity();

  template <class Archive>
  void serialize(Archive& archive) {
    archive(worker, local_step, gradients, epoch, sequence, rows, series, refill);
  }
};

/// Client → ps: read rows of embedding tables (`TableRows::values` empty), gated on
/// `min_step` and `epoch` as Pull is. Rows not held yet are created (or read as their
/// initial value until admitted), so it counts as changing the ps.
struct PullRows {
  static constexpr std::string_view kName = "PullRows";
  static constexpr RoleSet kSenders{Node::Role::kWorker, Node::Role::kChief,
                                    Node::Role::kEvaluator};
  static constexpr bool kChangesParameters = true;
  std::int64_t min_step = 0;
  std::uint64_t epoch = 0;
  std::vector<TableRows> tables;  ///< distinct ids per table, each table at most once
  /// Only what the pull does to the rows (a worker's creates, admits and touches them), no
  /// rows back: the ps answers Ack. A client sends it to the copy of a shard it does not
  /// read from, which must see the same pulls (ShardCopies).
  bool touch_only = false;
  /// From a worker: as Pull::pushes_paced.
  std::uint64_t pushes_paced = 0;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(min_step, epoch, tables, touch_only, pushes_paced);
  }
};

/// Chief → ps: training is over. Every request waiting there and every later one is
/// answered `kOutOfRange` ("training finished"), or `kAborted` with `reason` when the chief
/// gave up, so each task learns how the job ended; the ps then stops serving.
///
/// With `restart`, training goes on without this process: the chief ruled it lost (a job
/// with copies: it was stopped, hung or cut off past the copy timeout) and it came back.
/// Both copies it holds end, answering `kUnavailable`, and the process serves again empty,
/// as one started in its place would, for the chief to take it back (Chief::take_back).
struct Shutdown {
  static constexpr std::string_view kName = "Shutdown";
  static constexpr RoleSet kSenders{Node::Role::kChief};
  bool aborted = false;  ///< the job failed: tasks end with an error, not with success
  std::string reason;    ///< why it was aborted
  bool restart = false;  ///< the job gave this process up: it starts again empty

  template <class Archive>
  void serialize(Archive& archive) {
    archive(aborted, reason, restart);
  }
};

// ---- replies ----------------------------------------------------------------------------

/// Answer to Register and WaitReady: the registered variables and where they live, so a
/// client can check that its model is the one the chief registered.
struct PlacementReply {
  static constexpr std::string_view kName = "PlacementReply";
  std::vector<VariableSpec> variables;
  Placement placement;
  std::uint64_t epoch = 0;                 ///< restores so far: requests carry it
  std::vector<std::string> slot_names;     ///< the optimizer's slots, in PartState order
  std::vector<std::string> counter_names;  ///< the optimizer's counters
  std::vector<TableSpec> tables = {};      ///< the registered embedding tables
  /// Where the ps's IdSharding puts the tables' rows (`id_sharding_fingerprint`): a worker
  /// with another one is refused when it gets ready.
  std::uint64_t id_sharding = 0;
  std::vector<std::uint32_t> members = {};  ///< the job's ps tasks, ascending (Register::members)
  std::uint64_t membership = 0;             ///< their version (Register::membership)
  std::vector<std::string> ps_addresses = {};  ///< every ps task's address (Register::ps_addresses)
  /// The seed the tables' rows start from (Register::table_seed): a chief that takes over a
  /// lost one's job keeps it in its checkpoints and restores.
  std::uint64_t table_seed = 0;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(variables, placement, epoch, slot_names, counter_names, tables, id_sharding, members,
            membership, ps_addresses, table_seed);
  }
};

/// Answer to TakeToken: the sync policy's token, and the global step (steps completed), for
/// progress and stopping.
struct TokenReply {
  static constexpr std::string_view kName = "TokenReply";
  Token token;
  std::int64_t global_step = 0;
  /// Pushes of the asking worker's task this ps had taken (since its last restore) when it
  /// handed out the token: the worker's pulls carry it (Pull::pushes_paced).
  std::uint64_t pushes_taken = 0;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(token, global_step, pushes_taken);
  }
};

/// Answer to Pull: one tensor per requested slice, in request order.
struct PullReply {
  static constexpr std::string_view kName = "PullReply";
  std::int64_t global_step = 0;
  std::vector<std::span<const float>> values;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(global_step, values);
  }
};

/// Answer to PullRows: one tensor per requested table, its rows in the order of its ids.
struct RowsReply {
  static constexpr std::string_view kName = "RowsReply";
  std::int64_t global_step = 0;
  std::vector<std::span<const float>> rows;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(global_step, rows);
  }
};

/// Answer to Push: how many of its part gradients were dropped as stale.
struct PushReply {
  static constexpr std::string_view kName = "PushReply";
  std::uint32_t stale_parts = 0;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(stale_parts);
  }
};

}  // namespace pulley
// ---- end pulley/protocol/messages/training.hpp ----

namespace pulley {

// The protocol between clients (workers, the chief, the evaluator) and ps tasks. Every
// transport carries exactly these structs: in-process they are moved, over TCP they are
// encoded. A message is declared once, in the header of its concern under
// protocol/messages/ (training, checkpoint, membership, monitoring; the fields they share
// in fields.hpp; Ack and ErrorReply, which answer any request, here), and listed here in Request or
// Response, whose order gives each message its tag on the wire. A message declares:
//
//   - `kName`, for logs and errors;
//   - `serialize(archive)` lists its fields in wire order, for cereal and for pulley's own
//     walkers. A `std::span<const float>` field is a tensor: its size travels with the
//     other fields, its values in the frame's payload, in field order, so that a sender
//     writes them from its own buffers and a receiver reads them into place;
//   - `kChangesParameters = true` on a request that may change the ps's parameters, by
//     itself or by what it sets off (a push held, a step that waited for a worker found
//     lost): a transport must not let a reply still being sent see them change;
//   - `kSenders`, on a request: the roles whose tasks may send it (the ps refuses it from
//     any other with `kPermissionDenied`): only the chief registers, initializes and ends
//     training, only workers take tokens and push, evaluators only read.
//
// Adding a message is its declaration in the header of its concern, its place in Request
// or Response here (with `wire::kVersion` bumped: the tags change), and its handler in the
// ps (an `on` overload in ps/parameter_server.hpp, which hands it to the part that owns
// what it reads or changes).
//
// Tensors are views, never owned vectors. A view in a request stays valid until its call
// is answered or cancelled. A view in a reply stays valid and unchanged until the service
// handles a request that `changes_parameters` (see Responder, concepts/service.hpp): a
// transport copies it to the caller's destination, or writes it onto the wire, before then.

/// Everything a ps task (or the chief's JoinDesk: Join, Leave, Shape, LostPs) is asked.
using Request = std::variant<Register, Initialize, WaitReady, TakeToken, Pull, Push, GetStats,
                             Shutdown, Pause, ReadState, Resume, Restore, Heartbeat, PullRows,
                             ReadRows, RestoreRows, Join, ChangeWorkers, Leave, Shape, LostPs>;

/// Success with nothing to say.
struct Ack {
  static constexpr std::string_view kName = "Ack";

  template <class Archive>
  void serialize(Archive& /*archive*/) {}
};

/// A refused or failed request.
struct ErrorReply {
  static constexpr std::string_view kName = "ErrorReply";
  ErrorCode code = ErrorCode::kInvalidArgument;
  std::string message;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(code, message);
  }
};

/// Everything a ps task answers.
using Response = std::variant<Ack, ErrorReply, PlacementReply, TokenReply, PullReply, PushReply,
                              StatsReply, PauseReply, StateReply, RowsReply, RowsChunk, JoinReply, LeaveReply,
                              ShapeReply, LostPsReply>;

// ---- what follows from the declarations ---------------------------------------------------

/// True for a message declared with `kChangesParameters = true`.
template <class Message>
inline constexpr bool changes_parameters_v = [] {
  if constexpr (requires { Message::kChangesParameters; }) {
    return Message::kChangesParameters;
  } else {
    return false;
  }
}();

/// The roles that may send `request` (its declared `kSenders`).
inline RoleSet senders(const Request& request) noexcept {
  return std::visit([](const auto& m) { return std::remove_cvref_t<decltype(m)>::kSenders; },
                    request);
}

/// True if handling `request` may change the ps's parameters.
inline bool changes_parameters(const Request& request) noexcept {
  return std::visit(
      [](const auto& m) { return changes_parameters_v<std::remove_cvref_t<decltype(m)>>; },
      request);
}

/// The declared name of the message a Request or Response holds.
template <class Variant>
std::string_view message_name(const Variant& message) noexcept {
  return std::visit([](const auto& m) { return std::remove_cvref_t<decltype(m)>::kName; },
                    message);
}

namespace detail {

/// Walks a message's fields as its `serialize` lists them, calling `f` on each tensor.
template <class F>
class TensorWalker {
 public:
  explicit TensorWalker(F& f) : f_(f) {}

  template <class... Fields>
  void operator()(Fields&... fields) {
    (visit(fields), ...);
  }

 private:
  void visit(std::span<const float>& tensor) { f_(tensor); }
  template <class T, class A>
  void visit(std::vector<T, A>& items) {
    if constexpr (!std::is_arithmetic_v<T> && !std::is_same_v<T, std::string>) {
      for (T& item : items) visit(item);
    }
  }
  template <class T>
  void visit(T& field) {
    if constexpr (requires(TensorWalker& w) { field.serialize(w); }) field.serialize(*this);
  }

  F& f_;
};

}  // namespace detail

/// Calls `f(std::span<const float>&)` on every tensor of `message` (a message struct, a
/// Request or a Response), in wire order. `f` may re-point the views.
template <class Message, class F>
void for_each_tensor(Message& message, F&& f) {
  if constexpr (requires { std::visit([](auto&) {}, message); }) {
    std::visit([&](auto& m) { for_each_tensor(m, f); }, message);
  } else {
    detail::TensorWalker<std::remove_reference_t<F>> walker(f);
    message.serialize(walker);
  }
}

/// Returns the reply of type `T` or throws the Error the server sent.
template <class T>
T expect(Response&& response) {
  if (auto* error = std::get_if<ErrorReply>(&response)) throw Error(error->code, error->message);
  if (auto* reply = std::get_if<T>(&response)) return std::move(*reply);
  throw Error(ErrorCode::kInvalidArgument, "unexpected reply kind " +
                                               std::string(message_name(response)) +
                                               " from server, expected " + std::string(T::kName));
}

}  // namespace pulley
// ---- end pulley/protocol/messages.hpp ----

namespace pulley {

// A call is one request in flight and its answer to come. The caller holds a PendingCall
// (one call) or a CallGroup (several, call_group.hpp); a transport holds the shared
// CallControl, which it derives its per-call state from.

class CallControl;

/// Wakes a thread that waits for any of several calls: each answer bumps a count. An answer
/// nobody waits for yet costs no lock.
class CallSignal {
 public:
  /// One more answer arrived.
  void notify() {
    count_.fetch_add(1);
    if (waiters_.load() > 0) {
      std::scoped_lock lock(mutex_);  // a waiter between its check and its sleep holds it
      changed_.notify_all();
    }
  }
  /// Answers so far.
  [[nodiscard]] std::uint64_t count() const { return count_.load(); }
  /// Waits until `count()` differs from `seen` or `deadline` passes: first for up to
  /// spin_before_sleep() without sleeping (spin_until), then asleep.
  void wait_until(std::uint64_t seen, std::chrono::steady_clock::time_point deadline) {
    const auto changed = [&] { return count_.load() != seen; };
    if (spin_until(changed,
                   std::min(deadline, std::chrono::steady_clock::now() + spin_before_sleep())))
      return;
    std::unique_lock lock(mutex_);
    waiters_.fetch_add(1);
    changed_.wait_until(lock, deadline, changed);
    waiters_.fetch_sub(1);
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::atomic<std::uint64_t> count_{0};
  std::atomic<int> waiters_{0};
};

/// The part of a transport that needs the caller's thread. A transport with no thread of its
/// own (Tcp) moves its I/O forward while its caller waits, and cuts a transfer under way
/// when its caller gives up on it. A transport that answers on threads of its own
/// (InProcess) has no driver.
class CallDriver {
 public:
  /// Runs the transport's I/O on this thread until `done()` (checked after each I/O event)
  /// or until `deadline` passes.
  virtual void run_until(const std::function<bool()>& done,
                         std::chrono::steady_clock::time_point deadline) = 0;
  /// `call`'s caller gives up while the transport uses its buffers (see `CallControl::cancel`):
  /// end that use now, e.g. by closing a connection that stalled mid-frame.
  virtual void abort(CallControl& call) = 0;

 protected:
  ~CallDriver() = default;
};

/// What a caller and a transport share about one call: its answer, and whether the caller
/// gave up.
///
/// Transport side: `answer` once; bracket every use of the request's views or the reply
/// targets with `begin_use`/`end_use` (or `unless_cancelled`), and begin none after the
/// caller gave up. Caller side: through PendingCall or CallGroup. The caller sees the call
/// `answered` only once it has its answer and no use is under way, so acting on an answer
/// (freeing buffers) never races a transport thread that still touches them.
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
    if (--users_ == 0) {
      changed_.notify_all();
      settle();
    }
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
  /// Wakes the caller once no use is under way.
  bool answer(Response&& response) {
    std::scoped_lock lock(mutex_);
    if (cancelled_ || has_answer_) return false;
    response_ = std::move(response);
    has_answer_.store(true, std::memory_order_release);
    settle();
    return true;
  }
  /// True once the call has an answer, whether or not a use is still under way. Takes no
  /// lock.
  [[nodiscard]] bool has_answer() const { return has_answer_.load(std::memory_order_acquire); }
  /// The transport is going away: it answered every call it held or ended their uses, and
  /// neither waiting nor cancelling may reach it any more.
  void detach_driver() {
    std::scoped_lock lock(mutex_);
    driver_ = nullptr;
  }

  // ---- caller side ------------------------------------------------------------------------

  /// True once the call has its answer and no use of its buffers is under way (and stays
  /// true after `take`). Takes no lock.
  [[nodiscard]] bool answered() const { return answered_.load(std::memory_order_acquire); }
  /// The transport's driver, or null (then answers come from other threads).
  [[nodiscard]] CallDriver* driver() const {
    std::scoped_lock lock(mutex_);
    return driver_;
  }
  /// `signal` is notified when the call turns `answered` (null: nothing is); it is notified
  /// at once if it is already. Returns the transport's driver, or null.
  CallDriver* watch(CallSignal* signal) {
    std::scoped_lock lock(mutex_);
    signal_ = signal;
    if (signal_ != nullptr && answered_) signal_->notify();
    return driver_;
  }
  /// Waits until the call is answered or `deadline` passes; true if it is answered. With a
  /// driver, the waiting thread runs the transport's I/O meanwhile.
  bool wait_until(std::chrono::steady_clock::time_point deadline) {
    std::unique_lock lock(mutex_);
    if (answered_) return true;
    if (CallDriver* driver = driver_) {
      lock.unlock();
      driver->run_until([this] { return answered(); }, deadline);
      return answered();
    }
    return changed_.wait_until(lock, deadline, [&] { return answered_.load(); });
  }
  /// The answer, once the call is answered; only once.
  Response take() {
    std::scoped_lock lock(mutex_);
    return std::move(*response_);
  }
  /// Gives the call up: ends a use under way (the driver's `abort`) and waits until no use is
  /// left; afterwards the transport begins none, so the caller may free the request's
  /// buffers and the reply targets. An answer that arrives later is dropped. Every caller
  /// of `cancel` waits, the second one too.
  void cancel() {
    CallDriver* driver = nullptr;
    {
      std::scoped_lock lock(mutex_);
      signal_ = nullptr;
      if (!cancelled_ && users_ > 0) driver = driver_;
      cancelled_ = true;
    }
    if (driver != nullptr) driver->abort(*this);
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return users_ == 0; });
  }

 protected:
  ~CallControl() = default;  // owned through the transport's derived per-call state

 private:
  /// The caller may act on the answer once there is one and no use is under way. The caller
  /// holds `mutex_`.
  void settle() {
    if (!has_answer_ || users_ > 0 || answered_) return;
    answered_.store(true, std::memory_order_release);
    changed_.notify_all();
    if (signal_ != nullptr) signal_->notify();
  }

  mutable std::mutex mutex_;
  std::condition_variable changed_;  ///< an answer settled, or the last use ended
  std::optional<Response> response_;
  CallDriver* driver_;  ///< for the call's whole life: a use may outlast the answer
  CallSignal* signal_ = nullptr;
  int users_ = 0;
  std::atomic<bool> has_answer_{false};  ///< set under `mutex_`, read without it
  std::atomic<bool> answered_{false};    ///< has an answer and no use: set under `mutex_`
  bool cancelled_ = false;
};

/// One call in flight, as its caller holds it: the answer to come, and the way to give it
/// up. A call whose transport has a driver (Tcp) is waited on by the thread that uses the
/// transport, while the transport lives. To wait for several calls, use a CallGroup.
class PendingCall {
 public:
  using Clock = std::chrono::steady_clock;

  explicit PendingCall(std::shared_ptr<CallControl> control) : control_(std::move(control)) {}
  PendingCall(PendingCall&&) noexcept = default;
  PendingCall& operator=(PendingCall&&) noexcept = default;
  /// One caller per call: a copy could give it up behind its other holder's back.
  PendingCall(const PendingCall&) = delete;
  PendingCall& operator=(const PendingCall&) = delete;

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
  /// touches the request's buffers or the reply targets.
  void cancel() { control_->cancel(); }
  /// The shared state, for a CallGroup.
  [[nodiscard]] CallControl& control() const noexcept { return *control_; }

 private:
  std::shared_ptr<CallControl> control_;
};

}  // namespace pulley
// ---- end pulley/protocol/call.hpp ----

namespace pulley {

/// Where a reply's tensors go: one destination per tensor of the reply, in order (for a
/// Pull, one per requested slice).
using PullTargets = std::vector<std::span<float>>;

/// The client half of a transport: how a worker, the chief or an evaluator reaches the ps
/// tasks. The server half is a transport's serving loop, which hands every request to a
/// `Service` (concepts/service.hpp).
///
/// Required:
///   - `t.num_ps()` → number of ps tasks
///   - `t.call(ps, request, targets)` → `PendingCall`
///
/// Semantic contract:
///   - `call` never waits for another task (a request that must wait for a token or a step
///     returns a PendingCall that is answered later), so calls to different ps tasks never
///     wait for each other;
///   - a transport may hold a request until its caller waits on any of its calls, so that
///     requests made together leave together (a push and a pull in one write);
///   - requests from one client to one ps are handled in the order they were made;
///   - the caller has checked every tensor of `request` finite (pulley's clients do, before
///     anything is sent); a transport that carries requests from another process checks
///     them again (or lets the service check them: `RequestContext::tensors_finite`);
///   - a reply's tensors are copied into `targets` (tensor by tensor) before the call is
///     answered, and the reply's views then point into `targets`; a reply whose tensors do
///     not fit `targets` is answered as a `kInvalidArgument` error instead;
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

/// A transport that can reach ps tasks beyond those it was made with: a job whose ps tasks
/// grow (Chief::join). Clients of such a transport follow a ps that joins; others refuse
/// the membership that names one.
///
/// Required, beyond Transport:
///   - `t.add_ps(address, connect)` → reaches one more ps task, task `num_ps()` before the
///     call, at `address` (a std::string): with `connect` it is reached now, and a failure
///     throws, leaving the transport as it was; without, at its first call (a task the job
///     has known, which may be gone since: its calls then fail as a lost ps's do)
///   - `ct.address(ps)` → std::string: ps task `ps`'s address as `add_ps` takes it
template <class T>
concept GrowingTransport = Transport<T> && requires(T& transport, const T& ctransport, const std::string& address,
                                                    std::size_t ps) {
  transport.add_ps(address, true);
  { ctransport.address(ps) } -> std::convertible_to<std::string>;
};

/// A transport whose ps tasks keep a copy of each other's shards (Tcp with
/// `TcpOptions::replicas`): it gives a copy up when its ps is lost for good, serves the
/// shard from the other copy alone, and serves it from both again once a process started in
/// the lost one's place was given its shards back (Chief::take_back).
///
/// Required, beyond Transport:
///   - `ct.given_up()` → std::vector<std::uint32_t>: the ps tasks some of whose copies this
///     transport gave up, ascending (none without copies)
///   - `t.reach_again(ps, serve, unreached_too)` → bool: once a copy of ps task `ps` was
///     given up, connects anew to every copy it holds (giving up those not given up yet:
///     the process behind them is gone), and true once each reached one process other than
///     the one given up (started in its place; the process given up may be alive but cut
///     off, and its state is old); with `serve` they serve again at once, without they stay
///     given up until `serve_again(ps)`; false, with every copy of `ps` given up, when one
///     is not reached, unless `serve` and `unreached_too`: then a copy not reached serves
///     again all the same (the chief reached it; this task may be the one cut off)
///   - `t.serve_again(ps)` → the copies of `ps` reached again serve their shards with the
///     other copies: what changes a shard goes to both from now on
///   - `t.give_up(ps, why)` → gives every copy of `ps` up again (taking it back failed)
///   - `t.place_copies(members)` → the job's ps tasks are now `members` (a
///     std::span<const std::uint32_t>, ascending, at least 2): member k's copy is reached at
///     copy_holder(members, k), where the ps tasks hold it once the chief registered the
///     model over them; a ps that is no member is reached alone
///
/// Optional:
///   - `ct.given_up_whole(ps)` → bool: every copy it reaches at member ps `ps` is given up
///     (none is read there as the last copy of its shard). Then the process given up, if
///     it lives on, may start again empty (Chief::given_up_whole); without it, never.
///   - `ct.copies_whole()` → bool: false when the last WaitReady of some shard was answered
///     by one copy while the other was out of reach, and that copy is still not given up
///     (reads go on; writes wait for it). A Worker counts the ps tasks as back after a
///     failure only when it holds, so a task cut off from one process for good gives up
///     within its recovery timeout rather than once per answer (detail::Recovery::answered).
///
/// Semantic contract: a copy is served again only once the chief restored it with the
/// others from one cut (Chief::take_back), at a membership newer than the one it was given
/// up at; the other tasks then follow when they learn that membership (`renew_copies`),
/// before their first request of the epoch the restore began. Likewise, copies move only
/// with the membership (a ps that left or joined: Chief::retire, Chief::join), and every
/// task places them anew (`place_copies`) when it learns it, before its first request at it.
template <class T>
concept CopyingTransport = Transport<T> &&
    requires(T& transport, const T& ctransport, std::uint32_t ps, const std::string& why,
             std::span<const std::uint32_t> members) {
  { ctransport.given_up() } -> std::same_as<std::vector<std::uint32_t>>;
  { transport.reach_again(ps, true, true) } -> std::same_as<bool>;
  transport.serve_again(ps);
  transport.give_up(ps, why);
  transport.place_copies(members);
};

/// The job's ps tasks are now `members` (ascending): a CopyingTransport places the copies
/// of their shards for them (`place_copies`); any other transport has nothing to place.
template <Transport T>
void place_copies(T& transport, std::span<const std::uint32_t> members) {
  if constexpr (CopyingTransport<T>) transport.place_copies(members);
}

/// A task that learned a newer membership of the job's ps tasks serves again the copies its
/// transport gave up whose ps is back (a process in its place: one the chief took back,
/// Chief::take_back, since only a take-back changes the membership of a job with copies
/// and keeps its members); true if it serves any again. Without copies, false.
/// `first_look`: the task learns the job's membership for the first time (it started
/// since): the copies it gave up were given up at that membership, and only those it
/// reaches now are served again (`reach_again`'s `unreached_too` false), not one it cannot
/// reach (its process may have been taken back and lost since).
template <Transport T>
bool renew_copies(T& transport, bool first_look = false) {
  if constexpr (CopyingTransport<T>) {
    bool renewed = false;
    for (const std::uint32_t ps : transport.given_up()) {
      renewed = transport.reach_again(ps, true, !first_look) || renewed;
    }
    return renewed;
  } else {
    return false;
  }
}

/// Makes `transport` know every ps task of `ps_addresses` (by task index; empty: the ones
/// it knows already), adding those beyond its count, each reached at its first call.
/// Throws kFailedPrecondition when the transport cannot grow (not a GrowingTransport).
template <Transport T>
void reach_all(T& transport, std::span<const std::string> ps_addresses) {
  if (ps_addresses.size() <= transport.num_ps()) return;
  if constexpr (GrowingTransport<T>) {
    while (transport.num_ps() < ps_addresses.size()) transport.add_ps(ps_addresses[transport.num_ps()], false);
  } else {
    throw Error(ErrorCode::kFailedPrecondition,
                "ps task " + std::to_string(transport.num_ps()) + " joined the job at " +
                    ps_addresses[transport.num_ps()] + ", and this task's transport reaches only the " +
                    std::to_string(transport.num_ps()) + " it was made with (not a GrowingTransport)");
  }
}

}  // namespace pulley
// ---- end pulley/concepts/transport.hpp ----

namespace pulley::detail {

/// Each ps's share of a pull: its Pull message (no slices: nothing to send) and where the
/// reply's tensors go.
struct PullSplit {
  std::vector<Pull> pulls;
  std::vector<PullTargets> targets;
};

/// Splits `requests` (checked against the variables' shapes) over the parts `placement`
/// puts on each of `num_ps` ps tasks: each part's rows become a slice of its ps's Pull, and
/// the matching span of the caller's buffer its target.
inline PullSplit split_pulls(const Placement& placement, const std::vector<VariableSpec>& variables,
                             std::size_t num_ps, std::span<const PullRequest> requests, std::int64_t min_step,
                             std::uint64_t epoch) {
  PullSplit out{std::vector<Pull>(num_ps, Pull{min_step, {}, epoch}), std::vector<PullTargets>(num_ps)};
  for (const PullRequest& r : requests) {
    if (placement.first_part.empty()) {
      throw Error(ErrorCode::kFailedPrecondition, "no placement yet: call wait_ready() first");
    }
    if (r.variable >= variables.size()) {
      throw Error(ErrorCode::kNotFound, "unknown variable index " + std::to_string(r.variable));
    }
    const VariableSpec& spec = variables[r.variable];
    if (r.rows.empty() || r.rows.end > spec.rows() || r.into.size() != r.rows.size() * spec.row_size()) {
      throw Error(ErrorCode::kInvalidArgument,
                  "pull of '" + spec.name + "' rows [" + std::to_string(r.rows.begin) + ", " +
                      std::to_string(r.rows.end) + ") into " + std::to_string(r.into.size()) +
                      " floats does not fit its shape");
    }
    for (const Part& part : placement.parts_of(r.variable)) {
      const std::size_t begin = std::max(part.rows.begin, r.rows.begin);
      const std::size_t end = std::min(part.rows.end, r.rows.end);
      if (begin >= end) continue;
      out.pulls[part.ps].slices.push_back({static_cast<std::uint32_t>(&part - placement.parts.data()), {begin, end}});
      out.targets[part.ps].push_back(
          r.into.subspan((begin - r.rows.begin) * spec.row_size(), (end - begin) * spec.row_size()));
    }
  }
  return out;
}

/// Checks a row request against `tables`: a known table, ids grouped by `num_ps` ps tasks
/// as `ps_begin` says, values of ids × dim.
inline void check_rows(const RowRequest& r, const std::vector<TableSpec>& tables, std::size_t num_ps) {
  if (r.table >= tables.size()) throw Error(ErrorCode::kNotFound, "unknown table index " + std::to_string(r.table));
  const TableSpec& spec = tables[r.table];
  if (r.ps_begin.size() != num_ps + 1 || r.ps_begin.front() != 0 || r.ps_begin.back() != r.ids.size() ||
      !std::is_sorted(r.ps_begin.begin(), r.ps_begin.end()) || r.values.size() != r.ids.size() * spec.dim) {
    throw Error(ErrorCode::kInvalidArgument,
                "rows of table '" + spec.name + "': " + std::to_string(r.ids.size()) + " ids, " +
                    std::to_string(r.values.size()) + " values of dim " + std::to_string(spec.dim) +
                    ", grouped by " + std::to_string(r.ps_begin.size()) + " offsets for " + std::to_string(num_ps) +
                    " ps tasks: they do not fit");
  }
}

/// Splits row pulls (checked) into PullRows messages, one per kMaxIdsPerMessage ids and
/// table piece at most (a larger share of a ps goes as several), and calls
/// `send(ps, message, targets)` for each: its replies are written into place.
template <class Send>
void split_row_pulls(const std::vector<TableSpec>& tables, std::size_t num_ps, std::span<const RowRequest> requests,
                     std::int64_t min_step, std::uint64_t epoch, Send&& send) {
  for (const RowRequest& r : requests) check_rows(r, tables, num_ps);
  for (std::size_t ps = 0; ps < num_ps; ++ps) {
    PullRows pull{min_step, epoch, {}};
    PullTargets targets;
    std::size_t ids = 0;
    auto flush = [&] {
      if (pull.tables.empty()) return;
      send(ps, std::move(pull), std::move(targets));
      pull = PullRows{min_step, epoch, {}};
      targets = {};
      ids = 0;
    };
    for (const RowRequest& r : requests) {
      const std::size_t dim = tables[r.table].dim;
      for (std::size_t begin = r.ps_begin[ps], end = r.ps_begin[ps + 1]; begin < end;) {
        if (ids == kMaxIdsPerMessage) flush();
        const std::size_t n = std::min({end - begin, kMaxIdsPerMessage - ids,
                                        std::max<std::size_t>(1, kMaxRowBytesPerMessage / (dim * sizeof(float)))});
        pull.tables.push_back({static_cast<std::uint32_t>(r.table),
                               std::vector<std::uint64_t>(r.ids.begin() + static_cast<std::ptrdiff_t>(begin),
                                                          r.ids.begin() + static_cast<std::ptrdiff_t>(begin + n)),
                               {}});
        targets.push_back(r.values.subspan(begin * dim, n * dim));
        ids += n;
        begin += n;
        // A table comes once per request: the next piece of this one goes in the next.
        if (begin < end) flush();
      }
    }
    flush();
  }
}

}  // namespace pulley::detail
// ---- end pulley/client/detail/split.hpp ----
// ---- begin pulley/core/detail/random.hpp ----

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <random>

#if defined(__linux__)
#include <sys/random.h>
#endif

namespace pulley::detail {

/// Fills `out` with `n` bytes from the operating system's random source: getrandom(2) on
/// Linux (no file descriptor, so it works in a process that has used up its descriptors),
/// std::random_device elsewhere.
inline void random_bytes(void* out, std::size_t n) {
  auto* bytes = static_cast<unsigned char*>(out);
#if defined(__linux__)
  std::size_t filled = 0;
  while (filled < n) {
    const ssize_t got = ::getrandom(bytes + filled, n - filled, 0);
    if (got > 0) {
      filled += static_cast<std::size_t>(got);
    } else if (errno != EINTR) {
      break;
    }
  }
  if (filled == n) return;
#endif
  std::random_device source;
  for (std::size_t i = 0; i < n; ++i) bytes[i] = static_cast<unsigned char>(source());
}

/// A random 64-bit number.
inline std::uint64_t random_u64() {
  std::uint64_t value = 0;
  random_bytes(&value, sizeof value);
  return value;
}

}  // namespace pulley::detail
// ---- end pulley/core/detail/random.hpp ----

namespace pulley::detail {

/// Turns a worker's gradients (one span per variable, and the rows of its tables) into one
/// Push per ps: each ps gets the gradient of every part it holds, viewed in place, and its
/// share of the rows. Everything is checked before anything is sent (one finite gradient
/// of the right size per variable, rows that fit one message per ps): a push refused by
/// one ps but applied by another would leave the ps tasks on different steps. Gradients are
/// clipped by their global norm first when asked (TensorFlow's clip_by_global_norm), into
/// buffers of its own.
class PushBuilder {
 public:
  /// @param clip_norm clips gradients whose global norm is larger (0: never)
  explicit PushBuilder(float clip_norm = 0.0F) : clip_norm_(clip_norm) {}

  /// One Push per ps of `num_ps`, all numbered alike (a push sent again is recognized by
  /// its number on every ps).
  std::vector<Push> build(const Placement& placement, const std::vector<VariableSpec>& variables,
                          const std::vector<TableSpec>& tables, std::size_t num_ps, std::uint32_t worker,
                          std::int64_t local_step, std::uint64_t epoch,
                          std::span<const std::span<const float>> gradients, std::span<const RowRequest> rows) {
    if (gradients.size() != variables.size()) {
      throw Error(ErrorCode::kInvalidArgument, "push needs one gradient per variable");
    }
    for (const RowRequest& r : rows) check_rows(r, tables, num_ps);
    if (clip_norm_ > 0.0F) gradients = clipped(gradients, rows);
    const std::uint64_t sequence = ++sequence_;
    std::vector<Push> pushes(num_ps, Push{worker, local_step, {}, epoch, sequence, {}, series_});
    for (const Part& part : placement.parts) {
      const VariableSpec& spec = variables[part.variable];
      const std::span<const float> g = gradients[part.variable];
      if (g.size() != spec.size()) {
        throw Error(ErrorCode::kInvalidArgument, "gradient of '" + spec.name + "' has " + std::to_string(g.size()) +
                                                     " elements, expected " + std::to_string(spec.size()));
      }
      pushes[part.ps].gradients.push_back({static_cast<std::uint32_t>(&part - placement.parts.data()),
                                           g.subspan(part.rows.begin * spec.row_size(), part.rows.size() * spec.row_size())});
    }
    // One read of each gradient says it is finite and, mostly, ordinary: a ps in this
    // process then proves the update finite without reading it again (Push::largest).
    bool ordinary = true;
    for (std::size_t v = 0; v < gradients.size(); ++v) {
      if (all_ordinary(gradients[v])) continue;
      ordinary = false;
      if (!all_finite(gradients[v])) {
        throw Error(ErrorCode::kInvalidArgument,
                    "non-finite (NaN or Inf) gradient for '" + variables[v].name + "'; nothing was pushed");
      }
    }
    for (Push& push : pushes) push.largest = magnitude_bound(ordinary);
    // One push per ps, whole: its rows must fit in one message.
    std::vector<std::size_t> ids_to(num_ps, 0);
    for (const RowRequest& r : rows) {
      for (std::size_t ps = 0; ps < num_ps; ++ps) {
        const std::size_t n = r.ps_begin[ps + 1] - r.ps_begin[ps];
        ids_to[ps] += n;
        if (ids_to[ps] > kMaxIdsPerMessage || n * tables[r.table].dim * sizeof(float) > kMaxRowBytesPerMessage) {
          throw Error(ErrorCode::kInvalidArgument,
                      "a push to ps " + std::to_string(ps) + " of more rows than one message carries (" +
                          std::to_string(kMaxIdsPerMessage) +
                          " ids, and 256 MiB of rows of a table): use smaller batches, or more ps tasks");
        }
      }
    }
    for (const RowRequest& r : rows) {
      if (!all_finite(r.values)) {
        throw Error(ErrorCode::kInvalidArgument,
                    "non-finite (NaN or Inf) row gradients for table '" + tables[r.table].name + "'; nothing was pushed");
      }
      const std::size_t dim = tables[r.table].dim;
      for (std::size_t ps = 0; ps < num_ps; ++ps) {
        const std::size_t begin = r.ps_begin[ps], end = r.ps_begin[ps + 1];
        if (begin == end) continue;
        pushes[ps].rows.push_back({static_cast<std::uint32_t>(r.table),
                                   std::vector<std::uint64_t>(r.ids.begin() + static_cast<std::ptrdiff_t>(begin),
                                                              r.ids.begin() + static_cast<std::ptrdiff_t>(end)),
                                   std::span<const float>(r.values).subspan(begin * dim, (end - begin) * dim)});
      }
    }
    return pushes;
  }

  /// Pushes whose gradients clipping scaled down.
  [[nodiscard]] std::int64_t clipped_steps() const noexcept { return clipped_steps_; }
  /// The global norm of the last push's gradients, when clipping is on (else 0).
  [[nodiscard]] double last_gradient_norm() const noexcept { return last_norm_; }

 private:
  /// `gradients` scaled by clip_norm / their global norm when that norm is larger, copied
  /// into buffers of this builder; as they are otherwise. A non-finite norm leaves them as
  /// they are, for the finiteness check to refuse. The rows' gradients count in the norm
  /// too (as TensorFlow's clip_by_global_norm counts IndexedSlices), and are scaled where
  /// they are: they are the worker's own buffers.
  std::span<const std::span<const float>> clipped(std::span<const std::span<const float>> gradients,
                                                 std::span<const RowRequest> rows) {
    double squares = 0.0;
    for (const std::span<const float> g : gradients) {
      for (const float x : g) squares += static_cast<double>(x) * static_cast<double>(x);
    }
    for (const RowRequest& r : rows) {
      for (const float x : r.values) squares += static_cast<double>(x) * static_cast<double>(x);
    }
    const double norm = std::sqrt(squares);
    last_norm_ = norm;
    if (!(norm > clip_norm_) || !std::isfinite(norm)) return gradients;
    const auto scale = static_cast<float>(clip_norm_ / norm);
    for (const RowRequest& r : rows) {
      for (float& x : r.values) x *= scale;
    }
    clipped_.resize(gradients.size());
    views_.clear();
    for (std::size_t v = 0; v < gradients.size(); ++v) {
      clipped_[v].resize(gradients[v].size());
      std::transform(gradients[v].begin(), gradients[v].end(), clipped_[v].begin(),
                     [scale](float x) { return x * scale; });
      views_.emplace_back(clipped_[v]);
    }
    ++clipped_steps_;
    return views_;
  }

  float clip_norm_;
  /// Numbers the pushes: from a random start, so that a client that restarts is not taken
  /// for the one before it (and never wraps).
  std::uint64_t sequence_ = random_u64() >> 1U;
  std::uint64_t series_ = random_u64() | 1U;  ///< never 0 (Push::series)
  std::vector<std::vector<float>> clipped_;    ///< gradients scaled by clipping
  std::vector<std::span<const float>> views_;  ///< views of them, by variable
  std::int64_t clipped_steps_ = 0;
  double last_norm_ = 0.0;
};

}  // namespace pulley::detail
// ---- end pulley/client/detail/push_builder.hpp ----
// ---- begin pulley/client/detail/stall.hpp ----

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

// ---- begin pulley/client/options.hpp ----

#include <chrono>

namespace pulley {

/// How a client (worker, chief, evaluator) calls the ps tasks: its requests' deadlines (a
/// request past its deadline fails with `kDeadlineExceeded` and is cancelled: the transport
/// no longer touches its buffers), and a worker's gradient clipping.
struct ClientOptions {
  /// For requests a ps answers at once (push, ungated pull, stats, initialize).
  std::chrono::milliseconds request_timeout{std::chrono::seconds(60)};
  /// For requests that wait on other tasks: readiness, sync tokens, step-gated pulls.
  std::chrono::milliseconds wait_timeout{std::chrono::minutes(30)};
  /// A wait with no progress for this long logs what the ps tasks wait for, and again each
  /// time as long again passes ("step 812: waiting for worker:1 (last heard 14.2 s ago)").
  std::chrono::milliseconds stall_report{std::chrono::seconds(10)};
  /// Workers: when positive, each push's gradients are scaled down to this global norm
  /// (the L2 norm over every variable together) when theirs is larger, as TensorFlow's
  /// `clip_by_global_norm` before `apply_gradients`; a gradient that explodes then moves
  /// the parameters no further than a normal one. 0: no clipping.
  float clip_norm = 0.0F;
  /// How long a worker (and the role runner's chief and evaluator) waits for lost ps tasks
  /// to be back and restored, retrying, before it fails naming the ps; and how long the
  /// role runner's ps tasks wait for a lost chief to come back (ParameterServer::set_chief_wait).
  std::chrono::milliseconds recovery_timeout{std::chrono::minutes(5)};
  /// The chief: how long a lost ps may stay away before the job goes on without it (it
  /// leaves for good: its shard is placed on the other ps tasks, restored from the newest
  /// checkpoint: ChiefLoop; with copies, `TcpOptions::replicas`, moved from the copies that
  /// served it meanwhile, once 3 ps tasks or more are members). 0: never; the job waits for
  /// it as long as `recovery_timeout` (with copies, the copies serve until a process takes
  /// its place). Below `recovery_timeout`, so that the other tasks still wait when it happens.
  std::chrono::milliseconds ps_leave_after{0};
  /// The chief: a worker the ps tasks hold lost for this long (its heartbeats stopped)
  /// leaves the job for good: the sync policies stop counting it (Chief::change_workers),
  /// and a restarted process in its place asks to join again. 0: never; the job goes on
  /// without it as a lost worker, and takes it back when it returns.
  std::chrono::milliseconds worker_leave_after{0};
  /// Workers run by the role runner: how often they tell every ps they are alive
  /// (HeartbeatSender). Keep it well below the ps tasks' worker timeout.
  std::chrono::milliseconds heartbeat_interval{std::chrono::seconds(1)};
};

}  // namespace pulley
// ---- end pulley/client/options.hpp ----
// ---- begin pulley/protocol/call_group.hpp ----

#include <chrono>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace pulley {

/// A set of calls awaited together, with one deadline: the answer of every call, or the
/// first error among them, whichever comes first. The calls are those of one transport
/// (one driver, or none).
///
/// It never returns or throws while a call may still touch its caller's buffers: at the
/// deadline, at the first error (a refused push, a dead ps: the other answers need not be
/// awaited), and when the group is destroyed, the unfinished calls are cancelled first.
///
///     CallGroup group;
///     for (std::size_t ps = 0; ps < transport.num_ps(); ++ps)
///       group.add(transport.call(ps, GetStats{}));
///     group.wait(std::chrono::seconds(10), "stats");   // throws pulley::Error
///     StatsReply first = group.take_as<StatsReply>(0);
class CallGroup {
 public:
  using Clock = std::chrono::steady_clock;

  CallGroup() = default;
  CallGroup(const CallGroup&) = delete;
  CallGroup& operator=(const CallGroup&) = delete;
  ~CallGroup() { cancel(); }

  /// Adds a call; returns its index. Throws kInvalidArgument for a call of another
  /// transport than the group's first.
  std::size_t add(PendingCall call) {
    calls_.reserve(calls_.size() + 1);  // nothing below throws once the call is watched
    answers_.reserve(answers_.size() + 1);
    CallDriver* driver = call.control().watch(&signal_);
    // A driver runs only its own transport's I/O: it would not see another transport's
    // answer, nor one from another thread.
    const bool threaded = driver == nullptr && !call.control().answered();
    if ((driver != nullptr && driver_ != nullptr && driver != driver_) ||
        (driver != nullptr && threaded_) || (threaded && driver_ != nullptr)) {
      call.control().watch(nullptr);
      call.cancel();
      throw Error(ErrorCode::kInvalidArgument, "a CallGroup waits for calls of one transport");
    }
    if (driver != nullptr) driver_ = driver;
    threaded_ = threaded_ || threaded;
    calls_.push_back(std::move(call));
    answers_.emplace_back();
    return calls_.size() - 1;
  }

  /// Number of calls in the group.
  [[nodiscard]] std::size_t size() const noexcept { return calls_.size(); }

  /// Waits until every call is answered. Throws the first ErrorReply as an Error, or
  /// kDeadlineExceeded ("<what>: no answer within <timeout> ms") once `timeout` passes; the
  /// calls still unanswered are cancelled before it throws.
  void wait(std::chrono::milliseconds timeout, std::string_view what) {
    if (wait_for(timeout)) return;
    cancel();
    throw Error(ErrorCode::kDeadlineExceeded, std::string(what) + ": no answer within " +
                                                  std::to_string(timeout.count()) + " ms");
  }

  /// Waits at most `timeout` for every call to be answered; true if they are. Throws the
  /// first ErrorReply as an Error (cancelling the rest first); at the timeout the calls
  /// stay in flight, to be waited for again or cancelled.
  bool wait_for(std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    try {
      for (;;) {
        const std::uint64_t seen = signal_.count();
        if (collect()) return true;
        if (Clock::now() >= deadline) return false;
        if (driver_ != nullptr) {
          driver_->run_until([&] { return signal_.count() != seen; }, deadline);
        } else {
          signal_.wait_until(seen, deadline);
        }
      }
    } catch (...) {
      cancel();
      throw;
    }
  }

  /// True when every call is answered, without blocking (a driver handles what arrived);
  /// throws the first error as `wait` does.
  bool ready() {
    // A deadline in the past: the driver handles what arrived, and returns.
    if (driver_ != nullptr) driver_->run_until([] { return false; }, Clock::time_point::min());
    try {
      return collect();
    } catch (...) {
      cancel();
      throw;
    }
  }

  /// The answer of call `i`, after `wait` (moved out: once).
  Response take(std::size_t i) { return std::move(*answers_.at(i)); }
  /// The answer of call `i` as reply type R (`expect`).
  template <class R>
  R take_as(std::size_t i) {
    return expect<R>(take(i));
  }

  /// Gives every unanswered call up (`PendingCall::cancel`): when it returns, no transport
  /// touches their buffers any more. (An answered call's transport touches them no more
  /// already: the Transport contract.)
  void cancel() noexcept {
    for (std::size_t i = 0; i < calls_.size(); ++i) {
      if (answers_[i]) continue;  // taken: answered, and its signal will not be used again
      calls_[i].control().watch(nullptr);
      calls_[i].cancel();
    }
  }

 private:
  /// Takes the answers that arrived; true once all have. Throws the first error.
  bool collect() {
    bool all = true;
    for (std::size_t i = 0; i < calls_.size(); ++i) {
      if (!answers_[i]) {
        if (!calls_[i].control().answered()) {
          all = false;
          continue;
        }
        answers_[i] = calls_[i].take();
      }
      if (const auto* error = std::get_if<ErrorReply>(&*answers_[i])) {
        throw Error(error->code, error->message);
      }
    }
    return all;
  }

  CallSignal signal_;
  CallDriver* driver_ = nullptr;  ///< the calls' transport runs its I/O on the waiting thread
  bool threaded_ = false;         ///< a call is answered from another thread
  std::vector<PendingCall> calls_;
  std::vector<std::optional<Response>> answers_;
};

}  // namespace pulley
// ---- end pulley/protocol/call_group.hpp ----

namespace pulley::detail {

/// How often `wait_progressing` runs its `meanwhile` while calls wait.
inline constexpr std::chrono::milliseconds kMeanwhileEvery{500};

/// Every member ps's global step (`members`: the job's ps tasks), and in `why` what each
/// waits for; empty if a ps does not answer in time (the question is a courtesy: the wait
/// is what matters).
template <Transport T>
std::vector<std::int64_t> global_steps(T& transport, std::span<const std::uint32_t> members,
                                       const ClientOptions& options, std::string& why) {
  std::vector<std::int64_t> steps;
  try {
    CallGroup group;
    for (const std::uint32_t ps : members) group.add(transport.call(ps, GetStats{}, {}));
    group.wait(std::min(options.request_timeout, std::chrono::milliseconds(5000)), "ask the ps tasks what they wait for");
    for (std::size_t k = 0; k < group.size(); ++k) {
      const std::uint32_t ps = members[k];
      const StatsReply reply = group.take_as<StatsReply>(k);
      steps.push_back(reply.stats.global_step);
      why += "; ps " + std::to_string(ps) + " is at step " + std::to_string(reply.stats.global_step) +
             ", waiting for " + reply.waiting_for;
    }
  } catch (const Error& e) {
    why += std::string("; the ps tasks do not say why (") + e.what() + ")";
    steps.clear();
  }
  return steps;
}

/// Waits for `group`, whose calls wait for other tasks (a token, a step), for as long as
/// the ps tasks make progress: every so often it asks them their global steps, logs what
/// they wait for once none has moved for `stall_report` ("worker 2 at clock 5", "worker:1
/// (last heard 14.2 s ago)"), and gives up (kDeadlineExceeded, cancelling the calls) once
/// none has moved for `wait_timeout`, naming the same: a long wait for a step far ahead is
/// no stall. With a `deadline`, returns false (the calls cancelled) when it passes first.
///
/// `meanwhile`, if given, runs on the waiting thread every `kMeanwhileEvery` while the calls
/// wait (the chief counts in workers that asked to join while it waits for a step); what
/// it throws ends the wait (the calls cancelled), and when it returns true, what it did
/// voids the wait: false is returned, the calls cancelled, as for a deadline.
template <Transport T>
bool wait_progressing(T& transport, std::span<const std::uint32_t> members, const ClientOptions& options, CallGroup& group, std::string_view what,
                      std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max(),
                      const std::function<bool()>& meanwhile = {}) {
  using Clock = std::chrono::steady_clock;
  const auto patience = options.wait_timeout;
  const auto look_every = std::min({patience, options.stall_report, std::chrono::milliseconds(10000)});
  std::vector<std::int64_t> steps;  // the ps tasks' global steps when last looked at
  auto still_since = Clock::now();
  // The first look comes early: it is the steps later looks compare with, so that a wait
  // that outlasts `stall_report` while the ps tasks advance is not reported as stalled
  // (the later looks stay on the `look_every` grid).
  const auto first = std::max(look_every / 8, std::chrono::milliseconds(1));
  auto wait = first;
  bool looked = false;
  for (;;) {
    const auto now0 = Clock::now();
    const auto slice = deadline == Clock::time_point::max()
                           ? wait
                           : std::min<std::chrono::milliseconds>(
                                 wait, std::chrono::duration_cast<std::chrono::milliseconds>(
                                           std::max(deadline - now0, Clock::duration::zero())));
    wait = looked ? look_every : std::max(look_every - first, std::chrono::milliseconds(1));
    looked = true;
    if (!meanwhile) {
      if (group.wait_for(slice)) return true;
    } else {
      bool voided = false;
      for (const auto end = Clock::now() + slice; !voided;) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now());
        if (group.wait_for(std::clamp(left, std::chrono::milliseconds(0), kMeanwhileEvery))) return true;
        if (Clock::now() >= end) break;
        voided = meanwhile();
      }
      if (voided) {
        group.cancel();
        return false;
      }
    }
    if (Clock::now() >= deadline) {
      group.cancel();
      return false;
    }
    std::string why;
    const std::vector<std::int64_t> now_steps = global_steps(transport, members, options, why);
    const auto now = Clock::now();
    if (!now_steps.empty()) {
      // Moved since the last look, or the first answer (what came before it is unknown):
      // the stall clock starts again.
      if (steps.empty() || now_steps != steps) still_since = now;
      steps = now_steps;
    }
    const auto stalled = std::chrono::duration_cast<std::chrono::milliseconds>(now - still_since);
    if (stalled >= patience) {
      group.cancel();
      throw Error(ErrorCode::kDeadlineExceeded,
                  std::string(what) + ": no progress for " + std::to_string(stalled.count()) + " ms" + why);
    }
    if (stalled >= options.stall_report) {  // a hang explains itself while it lasts
      char seconds[32];
      std::snprintf(seconds, sizeof seconds, "%.1f", static_cast<double>(stalled.count()) / 1000.0);
      log(LogLevel::kWarning, std::string(what) + ": no progress for " + seconds + " s" + why);
    }
  }
}

/// Waits for `group`, whose calls wait for the ps tasks to complete global step `min_step`
/// (none when it is 0: then they are answered at once).
template <Transport T>
void wait_gated(T& transport, std::span<const std::uint32_t> members, const ClientOptions& options, CallGroup& group, std::int64_t min_step,
                std::string_view what) {
  if (min_step <= 0) return group.wait(options.request_timeout, what);
  (void)wait_progressing(transport, members, options, group, what);
}

}  // namespace pulley::detail
// ---- end pulley/client/detail/stall.hpp ----
// ---- begin pulley/concepts/sharding.hpp ----

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string_view>
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
///
/// Optional, for a job whose ps tasks change (sharding/rebalance.hpp):
///   - `s.rebalance(variables, before, members)` → `Placement`: `before`'s parts (the same
///     parts, the same rows) placed over the ps tasks `members` (task indices, ascending,
///     not empty); as pure and deterministic as `place`, every part on a member. Without
///     it, `rebalance_parts` moves as few whole parts as keeps the ps tasks balanced.
template <class S>
concept Sharding = std::copy_constructible<S> &&
    requires(const S& sharding, std::span<const VariableSpec> variables, std::size_t num_ps) {
  { sharding.place(variables, num_ps) } -> std::same_as<Placement>;
};

/// An id sharding policy decides which ps task holds each row of an embedding table.
///
/// Required:
///   - `s.ps_of(table, id, num_ps)` → `std::uint32_t`: the ps task that holds row `id` of the
///     table named `table`
///
/// Semantic contract:
///   - pure and deterministic, as `Sharding::place`: every worker and every ps computes it
///     and they must agree;
///   - the result is below `num_ps` (a ps refuses rows that are not its own).
template <class S>
concept IdSharding = std::copy_constructible<S> &&
    requires(const S& sharding, std::string_view table, std::uint64_t id, std::uint32_t num_ps) {
  { sharding.ps_of(table, id, num_ps) } -> std::convertible_to<std::uint32_t>;
};

/// An id sharding that also places rows over any set of ps tasks, for a job whose ps tasks
/// change (one lost for good, one added); one that does not is written for a fixed count.
///
/// Required, beyond IdSharding:
///   - `s.ps_of(table, id, members)` → `std::uint32_t`: the ps task among `members` (task
///     indices, ascending, not empty) that holds row `id` of `table`
///
/// Semantic contract:
///   - pure and deterministic, the result one of `members`;
///   - with `members` = 0 .. num_ps − 1 it equals `ps_of(table, id, num_ps)`, so that a job
///     whose ps tasks never change places rows as before;
///   - it should move few rows when `members` changes: HashIds moves only the rows that
///     must (those of a task that left, or a new task's share).
template <class S>
concept ElasticIdSharding = IdSharding<S> &&
    requires(const S& sharding, std::string_view table, std::uint64_t id, std::span<const std::uint32_t> members) {
  { sharding.ps_of(table, id, members) } -> std::convertible_to<std::uint32_t>;
};

/// True when `members` (ascending task indices, not empty) are ps tasks 0 .. n − 1: the
/// shape of a job whose ps tasks never changed, where every IdSharding places rows.
[[nodiscard]] inline bool first_tasks(std::span<const std::uint32_t> members) noexcept {
  return !members.empty() && members.back() + 1 == members.size();
}

/// The ps task among `members` (ascending task indices, not empty) that holds row `id` of
/// `table`: `ps_of(table, id, n)` while the members are ps tasks 0 .. n − 1, else the
/// ElasticIdSharding's `ps_of(table, id, members)`. Throws kFailedPrecondition for an id
/// sharding written for a fixed count once a ps task has left (a ps refuses such a
/// membership when it is registered, so a job meets this only by misuse).
template <IdSharding I>
[[nodiscard]] std::uint32_t row_owner(const I& sharding, std::string_view table, std::uint64_t id,
                                      std::span<const std::uint32_t> members) {
  if (first_tasks(members)) return sharding.ps_of(table, id, static_cast<std::uint32_t>(members.size()));
  if constexpr (ElasticIdSharding<I>) {
    return sharding.ps_of(table, id, members);
  } else {
    throw Error(ErrorCode::kFailedPrecondition,
                "this IdSharding places rows over ps tasks 0 .. n-1 only: give it ps_of(table, id, members) "
                "(ElasticIdSharding) for a job whose ps tasks change");
  }
}

/// Where `sharding` puts rows of `tables` over the ps tasks `members`, as one number: the
/// ps of 64 small ids and 64 ids spread over the whole id space, for every table, hashed.
/// The ps tasks say theirs when a client gets ready (PlacementReply::id_sharding), so that
/// a worker (or a ps) whose id sharding puts rows elsewhere is refused then, by name,
/// instead of having each push refused. Every sharding agrees with every other on one ps
/// task.
template <IdSharding I>
std::uint64_t id_sharding_fingerprint(const I& sharding, std::span<const TableSpec> tables,
                                      std::span<const std::uint32_t> members) {
  std::uint64_t hash = name_hash("id sharding");
  for (const TableSpec& table : tables) {
    hash = name_hash(table.name, hash);
    for (std::uint64_t k = 0; k < 64; ++k) {
      hash = mix_id(hash ^ row_owner(sharding, table.name, k, members));
      hash = mix_id(hash ^ row_owner(sharding, table.name, mix_id(k + 1), members));
    }
  }
  return hash;
}

}  // namespace pulley
// ---- end pulley/concepts/sharding.hpp ----
// ---- begin pulley/sharding/rebalance.hpp ----

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace pulley {

// When the ps tasks of a job change (one lost for good, one added), the parts of the dense
// variables are placed again: the parts stay as they are (their rows, hence their optimizer
// slots, move whole), and as few of them as keeps the ps tasks balanced change ps task.
// Ps tasks are named by their task index for the job's life: after ps 1 of {0, 1, 2} is
// lost, the members are {0, 2}.

/// One part of a dense variable that changes ps task between two placements.
struct PartMove {
  std::uint32_t variable = 0;  ///< index into the model's variable list
  std::uint32_t index = 0;     ///< position among the variable's parts
  std::uint32_t from = 0;      ///< the ps task that held it
  std::uint32_t to = 0;        ///< the ps task that holds it now
  std::uint64_t bytes = 0;     ///< its values (its optimizer slots move with it)
};

/// The bytes of values a part holds.
[[nodiscard]] inline std::uint64_t part_bytes(const Part& part, std::span<const VariableSpec> variables) {
  return std::uint64_t{part.rows.size()} * variables[part.variable].row_size() * sizeof(float);
}

/// The bytes of values each ps task holds under `placement`, by task index (the vector is
/// as long as the highest ps task named, plus one).
[[nodiscard]] inline std::vector<std::uint64_t> bytes_per_ps(const Placement& placement,
                                                             std::span<const VariableSpec> variables) {
  std::vector<std::uint64_t> bytes;
  for (const Part& part : placement.parts) {
    if (part.ps >= bytes.size()) bytes.resize(part.ps + 1, 0);
    bytes[part.ps] += part_bytes(part, variables);
  }
  return bytes;
}

/// The parts that changed ps task from `before` to `after`, two placements of the same parts
/// (rebalance keeps them); throws kInvalidArgument when the parts differ.
[[nodiscard]] inline std::vector<PartMove> moves_between(const Placement& before, const Placement& after,
                                                         std::span<const VariableSpec> variables) {
  if (before.parts.size() != after.parts.size() || before.first_part != after.first_part) {
    throw Error(ErrorCode::kInvalidArgument, "the two placements do not hold the same parts");
  }
  std::vector<PartMove> moves;
  for (std::size_t i = 0; i < before.parts.size(); ++i) {
    const Part& a = before.parts[i];
    const Part& b = after.parts[i];
    if (a.variable != b.variable || a.index != b.index || a.rows != b.rows) {
      throw Error(ErrorCode::kInvalidArgument, "the two placements do not hold the same parts");
    }
    if (a.ps != b.ps) moves.push_back({a.variable, a.index, a.ps, b.ps, part_bytes(a, variables)});
  }
  return moves;
}

/// `before`'s parts placed over the ps tasks `members` (ascending task indices) moving as
/// few bytes as it can: the parts of a ps task no longer a member go, largest first, to the
/// member holding least; then, while the ps task holding most holds more than
/// (1 + `tolerance`) × the least any placement of these parts can give (the mean, or the
/// largest part), it hands the one holding least the part that brings both closest to the
/// mean. A new
/// member starts empty and takes its share from the others this way. Deterministic (every
/// process computes the same). Throws kInvalidArgument for bad members or a `before` that
/// does not place `variables`.
[[nodiscard]] inline Placement rebalance_parts(std::span<const VariableSpec> variables, const Placement& before,
                                               std::span<const std::uint32_t> members, double tolerance = 0.05) {
  require_task_set(members, "ps task");
  if (before.num_variables() != variables.size()) {
    throw Error(ErrorCode::kInvalidArgument, "the placement holds " + std::to_string(before.num_variables()) +
                                                 " variables, the model " + std::to_string(variables.size()));
  }
  Placement after = before;
  const auto slot_of = [&](std::uint32_t ps) -> std::size_t {
    const auto it = std::lower_bound(members.begin(), members.end(), ps);
    return it != members.end() && *it == ps ? static_cast<std::size_t>(it - members.begin()) : members.size();
  };
  std::vector<std::uint64_t> load(members.size(), 0);
  std::vector<std::size_t> orphans;  // parts of ps tasks no longer members
  std::uint64_t total = 0;
  std::uint64_t largest = 0;
  for (std::size_t i = 0; i < after.parts.size(); ++i) {
    const std::uint64_t bytes = part_bytes(after.parts[i], variables);
    total += bytes;
    largest = std::max(largest, bytes);
    const std::size_t slot = slot_of(after.parts[i].ps);
    if (slot == members.size()) {
      orphans.push_back(i);
    } else {
      load[slot] += bytes;
    }
  }
  const auto least = [&] { return static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin()); };
  const auto most = [&] { return static_cast<std::size_t>(std::max_element(load.begin(), load.end()) - load.begin()); };
  std::stable_sort(orphans.begin(), orphans.end(), [&](std::size_t a, std::size_t b) {
    return part_bytes(after.parts[a], variables) > part_bytes(after.parts[b], variables);
  });
  for (const std::size_t i : orphans) {
    const std::size_t to = least();
    after.parts[i].ps = members[to];
    load[to] += part_bytes(after.parts[i], variables);
  }
  const std::uint64_t mean = (total + members.size() - 1) / members.size();
  const auto bound = static_cast<double>(std::max(mean, largest)) * (1.0 + tolerance);
  // Each move lowers the sum of squared loads, so the loop ends; the cap is a second guard.
  for (std::size_t round = 0; round < 4 * after.parts.size() + 4; ++round) {
    const std::size_t h = most();
    const std::size_t l = least();
    if (static_cast<double>(load[h]) <= bound) break;
    // A part b with 0 < b < gap lowers the larger of the two; the best brings them towards
    // the mean without overshooting it (bytes moved between two ps tasks that both hold
    // their share would be bytes moved for nothing).
    const std::uint64_t gap = load[h] - load[l];
    const std::uint64_t desired = std::min(load[h] - std::min(load[h], mean), mean - std::min(mean, load[l]));
    std::size_t best = after.parts.size();
    std::uint64_t best_miss = 0;
    for (std::size_t i = 0; i < after.parts.size(); ++i) {
      if (after.parts[i].ps != members[h]) continue;
      const std::uint64_t b = part_bytes(after.parts[i], variables);
      if (b == 0 || b >= gap) continue;
      const std::uint64_t miss = b > desired ? b - desired : desired - b;
      if (best == after.parts.size() || miss < best_miss) {
        best = i;
        best_miss = miss;
      }
    }
    if (best == after.parts.size()) break;  // no part of it helps: as balanced as parts allow
    const std::uint64_t bytes = part_bytes(after.parts[best], variables);
    after.parts[best].ps = members[l];
    load[h] -= bytes;
    load[l] += bytes;
  }
  return after;
}

/// `before` placed again over `members` by `sharding`: its own `rebalance(variables,
/// before, members)` when it has one (see the Sharding concept), else `rebalance_parts`.
template <Sharding S>
[[nodiscard]] Placement rebalance(const S& sharding, std::span<const VariableSpec> variables, const Placement& before,
                                  std::span<const std::uint32_t> members) {
  if constexpr (requires { { sharding.rebalance(variables, before, members) } -> std::same_as<Placement>; }) {
    require_task_set(members, "ps task");
    return sharding.rebalance(variables, before, members);
  } else {
    return rebalance_parts(variables, before, members);
  }
}

}  // namespace pulley
// ---- end pulley/sharding/rebalance.hpp ----

namespace pulley {

/// What every client role (Worker, Chief, Evaluator) is made of: a transport to the ps
/// tasks, the model as they registered it (variables, tables, placement, epoch), and the
/// calls that turn variable-level pulls and pushes into one request per ps, sent
/// concurrently and awaited together. Waits for other tasks (a token, a step) last as long
/// as training progresses and explain themselves when it does not (`ClientOptions`).
///
/// A Client is used from one thread at a time, as the role that owns it.
///
/// It speaks to the job's ps tasks, its members (`members()`): every ps task of the
/// cluster until one leaves the job for good (the chief's `Chief::leave`); it learns a
/// change from the ps tasks when it gets ready again (`wait_ready`).
///
/// @tparam T the Transport that reaches the ps tasks
template <Transport T>
class Client {
 public:
  // The members whose bodies are longer than a line or two are defined in client/impl/, by
  // concern (included at the end of this header): client_model.hpp (the model: looking it
  // up, registering it, waiting until the ps tasks are ready, adopting their placement),
  // client_membership.hpp (the job's ps tasks and the copies) and client_calls.hpp (the
  // calls to every ps and their answers).

  Client(T transport, ClientOptions options)
      : transport_(std::move(transport)), options_(options), pushes_(options.clip_norm) {
    for (std::uint32_t ps = 0; ps < transport_.num_ps(); ++ps) members_.push_back(ps);
  }

  /// The ps tasks of the cluster (its spec), members of the job or not: task indices are
  /// below it.
  [[nodiscard]] std::size_t num_ps() const { return transport_.num_ps(); }
  /// The job's ps tasks, ascending task indices, as last learned.
  [[nodiscard]] std::span<const std::uint32_t> members() const noexcept { return members_; }
  /// Their version: 0 for the cluster's own shape, one more for each change.
  [[nodiscard]] std::uint64_t membership() const noexcept { return membership_; }
  /// The ps task that paces the workers (hands out sync tokens): the lowest member.
  [[nodiscard]] std::uint32_t pacing_ps() const noexcept { return members_.front(); }
  /// Where each variable lives, once registered or ready.
  [[nodiscard]] const Placement& placement() const noexcept { return placement_; }
  /// The registered variables.
  [[nodiscard]] const std::vector<VariableSpec>& variables() const noexcept { return variables_; }
  /// The embedding tables the ps tasks hold.
  [[nodiscard]] const std::vector<TableSpec>& tables() const noexcept { return tables_; }
  /// Where the ps tasks' IdSharding puts the tables' rows (`id_sharding_fingerprint`).
  [[nodiscard]] std::uint64_t id_sharding() const noexcept { return id_sharding_; }
  /// True if `sharding` puts the tables' rows where the ps tasks' own IdSharding does (or
  /// the model has no tables).
  template <IdSharding I>
  [[nodiscard]] bool same_id_sharding(const I& sharding) const;
  /// Throws kFailedPrecondition, naming the fix, unless `sharding` (a worker's, or the
  /// chief's read_rows') puts the tables' rows where the ps tasks' own sharding does.
  template <IdSharding I>
  void check_id_sharding(const I& sharding) const;
  /// The seed of the tables' rows, as this client registered it or learned it from the ps tasks.
  [[nodiscard]] std::uint64_t table_seed() const noexcept { return table_seed_; }
  /// True once the placement is known.
  [[nodiscard]] bool has_placement() const noexcept { return !placement_.first_part.empty(); }
  /// The ps tasks' epoch (restores so far), as last learned.
  [[nodiscard]] std::uint64_t epoch() const noexcept { return epoch_; }
  /// The ps tasks were restored at `epoch` (by this client).
  void adopt_epoch(std::uint64_t epoch) noexcept { epoch_ = epoch; }
  /// The optimizer's slot and counter names, as the ps tasks said at registration.
  [[nodiscard]] const std::vector<std::string>& slot_names() const noexcept { return slot_names_; }
  [[nodiscard]] const std::vector<std::string>& counter_names() const noexcept { return counter_names_; }
  [[nodiscard]] T& transport() noexcept { return transport_; }
  [[nodiscard]] const T& transport() const noexcept { return transport_; }
  [[nodiscard]] const ClientOptions& options() const noexcept { return options_; }

  /// Index of the variable called `name`; throws kNotFound naming it.
  [[nodiscard]] std::size_t variable_index(std::string_view name) const;

  /// Sends `make_request(ps)` to every member ps at once and returns the replies of type
  /// R, in member order.
  template <class R, class MakeRequest>
  std::vector<R> broadcast(MakeRequest make_request, std::chrono::milliseconds timeout,
                           std::string_view what);

  /// Registers the model (its variables, and its embedding tables with the seed of their
  /// rows) on every member ps, over the members, and checks that their placements agree.
  void register_model(std::span<const VariableSpec> variables,
                      std::span<const TableSpec> tables = {}, std::uint64_t table_seed = 0);

  /// The job's ps tasks are now `members` (ascending task indices, not empty), at version
  /// `membership` (above the one known), with every ps task's address `ps_addresses` once
  /// one joined beyond the cluster spec (the transport then reaches them: reach_all): what
  /// the next `register_model` places the model over. For the chief, which decides it
  /// (Chief::leave, Chief::join).
  void change_members(std::vector<std::uint32_t> members, std::uint64_t membership,
                      std::vector<std::string> ps_addresses = {});

  /// Every ps task's address, once a ps joined beyond the cluster spec (empty before).
  [[nodiscard]] const std::vector<std::string>& ps_addresses() const noexcept { return ps_addresses_; }

  /// The job's workers, ascending, once workers joined or left (ChangeWorkers), as last
  /// learned (StatsReply::workers) or set; empty while they are the cluster spec's.
  [[nodiscard]] std::span<const std::uint32_t> workers() const noexcept { return workers_; }
  /// Takes `workers` as the job's (an empty list leaves them as they are).
  void set_workers(std::vector<std::uint32_t> workers) {
    if (!workers.empty()) workers_ = std::move(workers);
  }

  /// Waits until every member ps is initialized and learns the placement; with `tables`,
  /// checks that the ps tasks hold exactly those embedding tables. The members are asked
  /// first which ps tasks the job has (a ps that left it for good, or a process started
  /// again in its place, is not waited for), and again when one cannot be reached
  /// (kUnavailable): it may have left meanwhile.
  void wait_ready(std::span<const VariableSpec> variables,
                  std::optional<std::span<const TableSpec>> tables = std::nullopt);

  /// Asks every member ps it can reach (each alone: one that is gone hides no other's
  /// answer) which ps tasks the job has now, and takes a newer membership than it knows.
  /// True if it took one.
  bool learn_membership();

  /// Sends `request` to every ps task of the cluster that is no member of the job (one that
  /// left it, or a process started in its place), each awaited alone until `timeout`
  /// passes; answers and failures are ignored: a courtesy (a Shutdown, so that it ends too).
  void tell_others(const Request& request, std::chrono::milliseconds timeout) noexcept;

  /// GetStats to every member ps, each answer awaited alone until `timeout` passes: the
  /// answers in member order, nullopt for a ps that did not answer in time or refused.
  std::vector<std::optional<StatsReply>> ask_each(std::chrono::milliseconds timeout);

  /// Takes a sync token from the pacing ps (the lowest member).
  TokenReply take_token(std::uint32_t worker);

  /// Pulls every request's rows into its destination, from all ps tasks at once; no ps
  /// answers before it completed `min_step` steps. Returns the lowest global step the ps
  /// tasks reported: every value pulled is at least that recent.
  std::int64_t pull(std::span<const PullRequest> requests, std::int64_t min_step);

  /// Pulls the rows of every request into its values, from all ps tasks at once; no ps
  /// answers before it completed `min_step` steps. Returns the lowest global step the ps
  /// tasks reported.
  std::int64_t pull_rows(std::span<const RowRequest> requests, std::int64_t min_step);

  /// `pull` and `pull_rows` together, in one round trip; returns the lowest global step
  /// reported.
  std::int64_t pull_with_rows(std::span<const PullRequest> requests,
                              std::span<const RowRequest> rows, std::int64_t min_step);

  /// Pushes the gradients of whole variables (one span per variable, in variable order)
  /// tagged with `local_step`; every ps gets a message, which counts towards its step.
  /// Returns the number of part gradients dropped as stale.
  std::uint32_t push(std::uint32_t worker, std::int64_t local_step,
                     std::span<const std::span<const float>> gradients,
                     std::span<const RowRequest> rows = {});

  /// What push_pull did.
  struct PushPullResult {
    std::uint32_t stale_parts = 0;  ///< part gradients dropped as stale
    std::int64_t pulled_step = 0;   ///< lowest global step of the pulled values
  };

  /// `push`, then `pull` once each ps has completed `min_step` steps, in one round trip:
  /// both requests go out together, and each ps handles the pull after the push (requests
  /// from one client to one ps keep their order). A refused push ends the wait at once,
  /// although its pull may be waiting for a step that will not come. Both are checked
  /// before either is sent.
  PushPullResult push_pull(std::uint32_t worker, std::int64_t local_step,
                           std::span<const std::span<const float>> gradients,
                           std::span<const PullRequest> requests, std::int64_t min_step,
                           std::span<const RowRequest> rows = {}, bool refill = false);

  /// True if the last push was not answered by every ps (a connection was lost while it was
  /// on its way) and the ps tasks are still at the restore it was sent at: the same push
  /// can be sent again (`push_pull_again`), and each ps counts it once.
  [[nodiscard]] bool push_unanswered() const noexcept {
    return !unanswered_.empty() && unanswered_.front().epoch == epoch_;
  }

  /// Forgets the last push, answered or not (a new step begins).
  void forget_push() noexcept { unanswered_.clear(); }

  /// Sends the last push again as it was (its number and gradients: the buffers it views
  /// must hold what they held), then pulls as `push_pull` does. A ps that took it answers
  /// as it did the first time; one that did not takes it now. Needs `push_unanswered()`.
  PushPullResult push_pull_again(std::span<const PullRequest> requests, std::int64_t min_step);

  /// Blocks until every ps has completed `step` steps; returns the lowest global step they
  /// report.
  std::int64_t wait_for_step(std::int64_t step) {
    return *wait_for_step_until(step, std::chrono::steady_clock::time_point::max());
  }

  /// Like wait_for_step, but nullopt once `deadline` passes first, or `meanwhile` voided
  /// the wait (detail::wait_progressing).
  std::optional<std::int64_t> wait_for_step_until(std::int64_t step,
                                                  std::chrono::steady_clock::time_point deadline,
                                                  const std::function<bool()>& meanwhile = {});

  /// Blocks until the chief ends training: returns when the ps tasks answer kOutOfRange,
  /// throws anything else they answer (kAborted: the chief aborted training, or the ps
  /// tasks gave up waiting for a lost chief; kFailedPrecondition: the job was rolled back;
  /// kUnavailable: a ps was lost). A wait during which no ps advances for `wait_timeout`
  /// fails kDeadlineExceeded; long waits are logged as any step-gated one.
  void wait_for_end();

  /// Counters of every member ps, in member order (by task index while no ps left).
  std::vector<Stats> stats();

  /// Sends each ps its share of `requests` (checked), answered once it completed
  /// `min_step` steps, into `group`: the pulls of one round trip, awaited by the caller.
  void send_pulls(CallGroup& group, std::span<const PullRequest> requests, std::int64_t min_step) {
    send(group, split(requests, min_step));
  }

  /// Sends each ps its share of row pulls (checked) into `group`.
  void send_row_pulls(CallGroup& group, std::span<const RowRequest> requests,
                      std::int64_t min_step);

  /// The lowest global step of the replies of type R in `group` from `first` to `end`
  /// (0 when there are none).
  template <class R>
  static std::int64_t lowest_step(CallGroup& group, std::size_t first, std::size_t end);

  /// Pushes whose gradients `ClientOptions::clip_norm` scaled down.
  [[nodiscard]] std::int64_t clipped_steps() const noexcept { return pushes_.clipped_steps(); }
  /// The global norm of the last push's gradients, when clipping is on (else 0).
  [[nodiscard]] double last_gradient_norm() const noexcept { return pushes_.last_gradient_norm(); }

 private:
  detail::PullSplit split(std::span<const PullRequest> requests, std::int64_t min_step) const;

  /// What the pulls say of this worker's pushes the pacing ps took: its latest token's
  /// count, if taken at the restore the client is at (0: none known).
  [[nodiscard]] std::uint64_t pushes_paced() const noexcept {
    return paced_.epoch == epoch_ ? paced_.pushes : 0;
  }

  void send(CallGroup& group, detail::PullSplit&& split);

  /// Builds one push per ps, kept (in `unanswered_`) until every ps has answered them.
  void build_pushes(std::uint32_t worker, std::int64_t local_step,
                    std::span<const std::span<const float>> gradients,
                    std::span<const RowRequest> rows);

  /// Sends a copy of each kept push (the copies view the same tensors).
  void send_pushes(CallGroup& group) {
    for (const std::uint32_t ps : members_) group.add(transport_.call(ps, Push(unanswered_[ps]), {}));
  }

  /// The kept pushes, then `pulls`, in one round trip; the pushes are forgotten once every
  /// ps has answered.
  PushPullResult push_pull_sent(detail::PullSplit&& pulls, std::int64_t min_step);

  static std::uint32_t stale_parts(CallGroup& group, std::size_t first, std::size_t end);

  /// Rounds of `wait_ready` that may follow a change of the ps tasks: changes come one at a
  /// time, and each takes a round or two.
  static constexpr std::size_t kMembershipRounds = 8;
  /// How long `learn_membership` waits for the ps tasks' answers.
  static constexpr std::chrono::milliseconds kAskPatience{5000};

  /// The job's ps tasks are `members` at version `membership`, with `ps_addresses`, as a
  /// ps said.
  /// `first_look`: the first membership this client hears of (renew_copies).
  void take_membership(std::vector<std::uint32_t> members, std::uint64_t membership,
                       std::vector<std::string> ps_addresses, bool first_look);

  /// Takes `members` at `membership` after reaching every ps of `ps_addresses`; a member
  /// this client cannot reach is refused with `code`.
  void set_members(std::vector<std::uint32_t> members, std::uint64_t membership,
                   std::vector<std::string> ps_addresses, ErrorCode code);

  /// True if a reply of `replies` (one per member) names a newer membership with other
  /// members than were asked, or with the same members and copies that serve again (a ps
  /// the chief took back): they are taken, to be asked again.
  bool follow_membership(std::vector<PlacementReply>& replies);

  /// Learns the model from every member ps's PlacementReply, checking that they agree with
  /// each other and with `variables` (and `tables`, when given).
  void adopt(std::vector<PlacementReply> replies, std::vector<VariableSpec>& variables,
             const std::vector<TableSpec>* tables = nullptr);

  T transport_;
  ClientOptions options_;
  detail::PushBuilder pushes_;
  /// The last push, one message per ps, until every ps has answered it: what a retry after
  /// a lost connection sends again.
  std::vector<Push> unanswered_;
  std::uint64_t epoch_ = 0;  ///< the ps tasks' restores so far, as last learned
  /// The latest token's TokenReply::pushes_taken, and the epoch it was taken at.
  struct Paced {
    std::uint64_t epoch = 0;
    std::uint64_t pushes = 0;
  } paced_;
  std::vector<std::uint32_t> members_;  ///< the job's ps tasks, ascending, as last learned
  std::uint64_t membership_ = 0;        ///< their version
  /// A ps told this client the membership (any, the spec's too): changes after this are
  /// ones it lived through (renew_copies' `first_look` before).
  bool membership_heard_ = false;
  std::vector<std::string> ps_addresses_;  ///< every ps task's, once one joined (else empty)
  std::vector<std::uint32_t> workers_;     ///< the job's workers, once they changed (else empty)
  std::vector<std::string> slot_names_;     ///< the optimizer's slots, as the ps tasks name them
  std::vector<std::string> counter_names_;  ///< the optimizer's counters
  Placement placement_;
  std::vector<VariableSpec> variables_;
  std::vector<TableSpec> tables_;  ///< the embedding tables the ps tasks hold
  std::uint64_t table_seed_ = 0;   ///< as registered (kept for a restore's registration)
  std::uint64_t id_sharding_ = 0;  ///< where the ps tasks put the tables' rows
};

}  // namespace pulley

// Client's member functions' definitions, by concern.
// ---- begin pulley/client/impl/client_calls.hpp ----

/// Client's calls to the ps tasks and their answers (declared in client/client.hpp, which
/// includes this header after the class): a request to every member, tokens, pulls of
/// values and rows, pushes (kept until answered, sent again), the waits for a step or for
/// the end, and the counters.

namespace pulley {

template <Transport T>
template <class R, class MakeRequest>
std::vector<R> Client<T>::broadcast(MakeRequest make_request, std::chrono::milliseconds timeout,
                                    std::string_view what) {
  CallGroup group;
  for (const std::uint32_t ps : members_)
    group.add(transport_.call(ps, Request{make_request(ps)}, {}));
  group.wait(timeout, what);
  std::vector<R> replies;
  for (std::size_t k = 0; k < members_.size(); ++k) replies.push_back(group.take_as<R>(k));
  return replies;
}

template <Transport T>
TokenReply Client<T>::take_token(std::uint32_t worker) {
  CallGroup group;
  group.add(transport_.call(pacing_ps(), TakeToken{worker, epoch_}, {}));
  (void)detail::wait_progressing(transport_, members_, options_, group,
                                 "worker " + std::to_string(worker) + ": take a sync token");
  TokenReply reply = group.take_as<TokenReply>(0);
  paced_ = {epoch_, reply.pushes_taken};
  return reply;
}

template <Transport T>
std::int64_t Client<T>::pull(std::span<const PullRequest> requests, std::int64_t min_step) {
  CallGroup group;
  send_pulls(group, requests, min_step);
  detail::wait_gated(transport_, members_, options_, group, min_step, "pull");
  return lowest_step<PullReply>(group, 0, group.size());
}

template <Transport T>
std::int64_t Client<T>::pull_rows(std::span<const RowRequest> requests, std::int64_t min_step) {
  CallGroup group;
  send_row_pulls(group, requests, min_step);
  detail::wait_gated(transport_, members_, options_, group, min_step, "pull rows");
  return lowest_step<RowsReply>(group, 0, group.size());
}

template <Transport T>
std::int64_t Client<T>::pull_with_rows(std::span<const PullRequest> requests,
                                       std::span<const RowRequest> rows, std::int64_t min_step) {
  // The rows first: a row pull counts as changing the ps (it may create rows), which makes
  // a TCP server copy whatever of the dense replies before it is still unsent.
  CallGroup group;
  send_row_pulls(group, rows, min_step);
  const std::size_t row_pulls = group.size();
  send_pulls(group, requests, min_step);
  detail::wait_gated(transport_, members_, options_, group, min_step, "pull");
  std::int64_t step = std::numeric_limits<std::int64_t>::max();
  for (std::size_t i = 0; i < row_pulls; ++i)
    step = std::min(step, group.take_as<RowsReply>(i).global_step);
  for (std::size_t i = row_pulls; i < group.size(); ++i)
    step = std::min(step, group.take_as<PullReply>(i).global_step);
  return group.size() == 0 ? 0 : step;
}

template <Transport T>
std::uint32_t Client<T>::push(std::uint32_t worker, std::int64_t local_step,
                              std::span<const std::span<const float>> gradients,
                              std::span<const RowRequest> rows) {
  build_pushes(worker, local_step, gradients, rows);
  CallGroup group;
  send_pushes(group);
  group.wait(options_.request_timeout, "push");
  unanswered_.clear();
  return stale_parts(group, 0, group.size());
}

template <Transport T>
auto Client<T>::push_pull(std::uint32_t worker, std::int64_t local_step,
                          std::span<const std::span<const float>> gradients,
                          std::span<const PullRequest> requests, std::int64_t min_step,
                          std::span<const RowRequest> rows, bool refill) -> PushPullResult {
  detail::PullSplit pulls = split(requests, min_step);
  build_pushes(worker, local_step, gradients, rows);
  for (Push& p : unanswered_) p.refill = refill;  // the token's word, for every ps (Token::refill)
  return push_pull_sent(std::move(pulls), min_step);
}

template <Transport T>
auto Client<T>::push_pull_again(std::span<const PullRequest> requests, std::int64_t min_step)
    -> PushPullResult {
  if (!push_unanswered())
    throw Error(ErrorCode::kFailedPrecondition, "no unanswered push to send again");
  return push_pull_sent(split(requests, min_step), min_step);
}

template <Transport T>
std::optional<std::int64_t> Client<T>::wait_for_step_until(
    std::int64_t step, std::chrono::steady_clock::time_point deadline,
    const std::function<bool()>& meanwhile) {
  CallGroup group;
  for (const std::uint32_t ps : members_)
    group.add(transport_.call(ps, Pull{step, {}, epoch_}, {}));
  if (step <= 0) {
    group.wait(options_.request_timeout, "read the global step");
  } else if (!detail::wait_progressing(transport_, members_, options_, group,
                                       "wait for step " + std::to_string(step), deadline,
                                       meanwhile)) {
    return std::nullopt;
  }
  return lowest_step<PullReply>(group, 0, group.size());
}

template <Transport T>
void Client<T>::wait_for_end() {
  CallGroup group;
  constexpr std::int64_t kNever =
      std::numeric_limits<std::int64_t>::max() / 2;  // a step no job reaches
  for (const std::uint32_t ps : members_)
    group.add(transport_.call(ps, Pull{kNever, {}, epoch_}, {}));
  (void)detail::wait_progressing(transport_, members_, options_, group,
                                 "wait for the chief to end training");
  for (std::size_t ps = 0; ps < group.size(); ++ps)
    (void)group.take_as<PullReply>(ps);  // throws its error
}

template <Transport T>
std::vector<Stats> Client<T>::stats() {
  std::vector<Stats> all;
  for (auto& r : broadcast<StatsReply>([](std::size_t) { return GetStats{}; },
                                       options_.request_timeout, "stats")) {
    all.push_back(r.stats);
  }
  return all;
}

template <Transport T>
void Client<T>::send_row_pulls(CallGroup& group, std::span<const RowRequest> requests,
                               std::int64_t min_step) {
  detail::split_row_pulls(tables_, num_ps(), requests, min_step, epoch_,
                          [&](std::size_t ps, PullRows&& message, PullTargets&& targets) {
                            message.pushes_paced = pushes_paced();
                            group.add(transport_.call(ps, std::move(message), std::move(targets)));
                          });
}

template <Transport T>
template <class R>
std::int64_t Client<T>::lowest_step(CallGroup& group, std::size_t first, std::size_t end) {
  std::int64_t step = std::numeric_limits<std::int64_t>::max();
  for (std::size_t i = first; i < end; ++i) step = std::min(step, group.take_as<R>(i).global_step);
  return first == end ? 0 : step;
}

template <Transport T>
detail::PullSplit Client<T>::split(std::span<const PullRequest> requests,
                                   std::int64_t min_step) const {
  detail::PullSplit out =
      detail::split_pulls(placement_, variables_, num_ps(), requests, min_step, epoch_);
  for (Pull& pull : out.pulls) pull.pushes_paced = pushes_paced();
  return out;
}

template <Transport T>
void Client<T>::send(CallGroup& group, detail::PullSplit&& split) {
  for (const std::uint32_t ps : members_) {
    if (split.pulls[ps].slices.empty()) continue;
    group.add(transport_.call(ps, std::move(split.pulls[ps]), std::move(split.targets[ps])));
  }
}

template <Transport T>
void Client<T>::build_pushes(std::uint32_t worker, std::int64_t local_step,
                             std::span<const std::span<const float>> gradients,
                             std::span<const RowRequest> rows) {
  unanswered_.clear();
  unanswered_ = pushes_.build(placement_, variables_, tables_, num_ps(), worker, local_step, epoch_,
                              gradients, rows);
}

template <Transport T>
auto Client<T>::push_pull_sent(detail::PullSplit&& pulls, std::int64_t min_step) -> PushPullResult {
  CallGroup group;
  send_pushes(group);
  const std::size_t pushes = group.size();
  send(group, std::move(pulls));
  detail::wait_gated(transport_, members_, options_, group, min_step, "push and pull");
  unanswered_.clear();
  return {stale_parts(group, 0, pushes), lowest_step<PullReply>(group, pushes, group.size())};
}

template <Transport T>
std::uint32_t Client<T>::stale_parts(CallGroup& group, std::size_t first, std::size_t end) {
  std::uint32_t stale = 0;
  for (std::size_t i = first; i < end; ++i) stale += group.take_as<PushReply>(i).stale_parts;
  return stale;
}

}  // namespace pulley
// ---- end pulley/client/impl/client_calls.hpp ----
// ---- begin pulley/client/impl/client_membership.hpp ----

/// Client's view of the job's ps tasks (declared in client/client.hpp, which includes this
/// header after the class): the members the chief sets or a ps names, asking each ps
/// which members the job has, telling the ps tasks outside it, and the copies placed or
/// renewed when the members change.

namespace pulley {

template <Transport T>
void Client<T>::change_members(std::vector<std::uint32_t> members, std::uint64_t membership,
                               std::vector<std::string> ps_addresses) {
  if (membership <= membership_) {
    throw Error(ErrorCode::kInvalidArgument, "membership " + std::to_string(membership) +
                                                 " is not newer than " +
                                                 std::to_string(membership_));
  }
  set_members(std::move(members), membership, std::move(ps_addresses), ErrorCode::kInvalidArgument);
}

template <Transport T>
bool Client<T>::learn_membership() {
  std::optional<StatsReply> newest;
  bool heard = false;
  // A few seconds: the ps tasks that answer do so at once; one that is gone may never.
  for (std::optional<StatsReply>& reply :
       ask_each(std::min(options_.request_timeout, kAskPatience))) {
    heard = heard || reply.has_value();
    if (!reply || reply->members.empty()) continue;
    if (!newest || reply->membership > newest->membership) newest = std::move(reply);
  }
  const bool first_look = !membership_heard_;
  membership_heard_ = membership_heard_ || heard;
  if (!newest || newest->membership <= membership_) return false;
  take_membership(std::move(newest->members), newest->membership, std::move(newest->ps_addresses),
                  first_look);
  return true;
}

template <Transport T>
void Client<T>::tell_others(const Request& request, std::chrono::milliseconds timeout) noexcept {
  try {
    std::vector<PendingCall> calls;
    for (std::uint32_t ps = 0; ps < num_ps(); ++ps) {
      if (!std::binary_search(members_.begin(), members_.end(), ps))
        calls.push_back(transport_.call(ps, Request(request), {}));
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (PendingCall& call : calls) {
      if (!call.wait_until(deadline)) call.cancel();
    }
  } catch (...) {  // no memory, a transport that throws: it was a courtesy
  }
}

template <Transport T>
std::vector<std::optional<StatsReply>> Client<T>::ask_each(std::chrono::milliseconds timeout) {
  std::vector<PendingCall> calls;
  for (const std::uint32_t ps : members_) calls.push_back(transport_.call(ps, GetStats{}, {}));
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<std::optional<StatsReply>> answers(calls.size());
  for (std::size_t k = 0; k < calls.size(); ++k) {
    if (!calls[k].wait_until(deadline)) {
      calls[k].cancel();
      continue;
    }
    Response answer = calls[k].take();
    if (auto* reply = std::get_if<StatsReply>(&answer)) answers[k] = std::move(*reply);
  }
  return answers;
}

template <Transport T>
void Client<T>::take_membership(std::vector<std::uint32_t> members, std::uint64_t membership,
                                std::vector<std::string> ps_addresses, bool first_look) {
  log(LogLevel::kInfo, "the job's ps tasks are now " + describe_members(members) + " (membership " +
                           std::to_string(membership) + ", was " + std::to_string(membership_) +
                           ")");
  const bool same = members == members_;
  set_members(std::move(members), membership, std::move(ps_addresses),
              ErrorCode::kFailedPrecondition);
  // A ps the chief took back (Chief::take_back, which keeps the members) is written to
  // again; a ps that left or joined changes nobody's given-up copies.
  if (same || first_look) (void)renew_copies(transport_, first_look);
}

template <Transport T>
void Client<T>::set_members(std::vector<std::uint32_t> members, std::uint64_t membership,
                            std::vector<std::string> ps_addresses, ErrorCode code) {
  require_task_set(members, "ps task");
  reach_all(transport_, ps_addresses);
  if (members.back() >= num_ps()) {
    throw Error(code, "ps " + std::to_string(members.back()) +
                          " is named a member of the job, and this task knows " +
                          std::to_string(num_ps()) +
                          " ps tasks: are they configured with the same cluster?");
  }
  place_copies(transport_, members);  // (before any request at the new membership)
  members_ = std::move(members);
  membership_ = membership;
  if (!ps_addresses.empty()) ps_addresses_ = std::move(ps_addresses);
  unanswered_.clear();  // a push of the shape before is not sent again
}

template <Transport T>
bool Client<T>::follow_membership(std::vector<PlacementReply>& replies) {
  const auto newest =
      std::max_element(replies.begin(), replies.end(),
                       [](const auto& a, const auto& b) { return a.membership < b.membership; });
  const bool first_look = !membership_heard_;
  membership_heard_ = true;
  if (newest->membership < membership_) return false;  // a ps behind: `adopt` names the mismatch
  if (newest->membership == membership_ && newest->members == members_) return false;
  if (newest->members == members_) {
    membership_ = newest->membership;
    // A ps the chief took back (its shards restored beside their copies): asked again,
    // both copies, before anything of the new epoch is sent.
    return renew_copies(transport_, first_look);
  }
  take_membership(std::move(newest->members), newest->membership, std::move(newest->ps_addresses),
                  first_look);
  return true;
}

}  // namespace pulley
// ---- end pulley/client/impl/client_membership.hpp ----
// ---- begin pulley/client/impl/client_model.hpp ----

/// Client's model as the ps tasks hold it (declared in client/client.hpp, which includes
/// this header after the class): looking a variable up, checking a task's IdSharding,
/// registering the model, waiting until every member ps is ready, and adopting their
/// placement once their answers agree.

namespace pulley {

template <Transport T>
template <IdSharding I>
bool Client<T>::same_id_sharding(const I& sharding) const {
  return tables_.empty() ||
         id_sharding_fingerprint(sharding, tables_, std::span<const std::uint32_t>(members_)) ==
             id_sharding_;
}

template <Transport T>
template <IdSharding I>
void Client<T>::check_id_sharding(const I& sharding) const {
  if (same_id_sharding(sharding)) return;
  throw Error(
      ErrorCode::kFailedPrecondition,
      "this task's IdSharding puts rows of table '" + tables_.front().name +
          "' on other ps tasks than the ps tasks' own does: give it the IdSharding of the ps "
          "tasks' Tables policy (Worker<M, T, MyTables::Sharding>, read_rows(..., "
          "MyTables::Sharding{}))");
}

template <Transport T>
std::size_t Client<T>::variable_index(std::string_view name) const {
  for (std::size_t i = 0; i < variables_.size(); ++i) {
    if (variables_[i].name == name) return i;
  }
  throw Error(ErrorCode::kNotFound, "unknown variable '" + std::string(name) + "'");
}

template <Transport T>
void Client<T>::register_model(std::span<const VariableSpec> variables,
                               std::span<const TableSpec> tables, std::uint64_t table_seed) {
  std::vector<VariableSpec> list(variables.begin(), variables.end());
  std::vector<TableSpec> table_list(tables.begin(), tables.end());
  adopt(broadcast<PlacementReply>(
            [&](std::size_t) {
              return Register{list, table_list, table_seed, members_, membership_, ps_addresses_};
            },
            options_.request_timeout, "register"),
        list, &table_list);
  table_seed_ = table_seed;
}

template <Transport T>
void Client<T>::wait_ready(std::span<const VariableSpec> variables,
                           std::optional<std::span<const TableSpec>> tables) {
  std::vector<VariableSpec> list(variables.begin(), variables.end());
  std::optional<std::vector<TableSpec>> table_list;
  if (tables) table_list.emplace(tables->begin(), tables->end());
  (void)learn_membership();
  for (std::size_t round = 0;; ++round) {
    std::vector<PlacementReply> replies;
    try {
      replies = broadcast<PlacementReply>([](std::size_t) { return WaitReady{}; },
                                          options_.wait_timeout, "wait for initialization");
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kUnavailable || round >= kMembershipRounds || !learn_membership())
        throw;
      continue;
    }
    if (round < kMembershipRounds && follow_membership(replies)) continue;
    adopt(std::move(replies), list, table_list ? &*table_list : nullptr);
    return;
  }
}

template <Transport T>
void Client<T>::adopt(std::vector<PlacementReply> replies, std::vector<VariableSpec>& variables,
                      const std::vector<TableSpec>* tables) {
  if (replies.empty()) throw Error(ErrorCode::kInvalidArgument, "the cluster has no ps task");
  if (tables != nullptr && replies[0].tables != *tables) {
    throw Error(
        ErrorCode::kFailedPrecondition,
        "the ps tasks hold " + std::to_string(replies[0].tables.size()) +
            " embedding table(s), and this model declares " + std::to_string(tables->size()) +
            " that differ from them (name, dim, initializer, admission, eviction must match)");
  }
  for (std::size_t k = 1; k < replies.size(); ++k) {
    const std::string ps = std::to_string(members_[k]);
    const std::string first = std::to_string(members_[0]);
    if (replies[k].members != replies[0].members ||
        replies[k].membership != replies[0].membership) {
      throw Error(ErrorCode::kUnavailable,
                  "ps " + first + " and ps " + ps +
                      " are at different memberships of the job's ps tasks (" +
                      std::to_string(replies[0].membership) + " and " +
                      std::to_string(replies[k].membership) + "): a change is under way");
    }
    if (replies[k].id_sharding != replies[0].id_sharding) {
      throw Error(
          ErrorCode::kFailedPrecondition,
          "ps " + first + " and ps " + ps +
              " spread the rows of embedding tables differently: are they configured with the same "
              "Tables policy (IdSharding)?");
    }
    if (!(replies[k].placement == replies[0].placement)) {
      throw Error(
          ErrorCode::kFailedPrecondition,
          "ps " + first + " and ps " + ps +
              " place the variables differently: are they configured with the same sharding policy "
              "and number of ps tasks?");
    }
  }
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
  if (replies[0].members != members_) {
    throw Error(ErrorCode::kFailedPrecondition, "the ps tasks say the job's ps tasks are " +
                                                    describe_members(replies[0].members) +
                                                    ", not " + describe_members(members_) +
                                                    ": are they configured with the same cluster?");
  }
  for (const Part& part : replies[0].placement.parts) {
    if (!std::binary_search(members_.begin(), members_.end(), part.ps)) {
      throw Error(ErrorCode::kFailedPrecondition,
                  "the ps tasks place parts on ps " + std::to_string(part.ps) +
                      ", which is not among the job's " + describe_members(members_) +
                      ": are they configured with the same cluster?");
    }
  }
  if (replies[0].placement.num_variables() != variables.size()) {
    throw Error(ErrorCode::kFailedPrecondition,
                "the ps tasks' placement does not cover this model's variables");
  }
  membership_ = replies[0].membership;
  if (!replies[0].ps_addresses.empty()) ps_addresses_ = std::move(replies[0].ps_addresses);
  placement_ = std::move(replies[0].placement);
  variables_ = std::move(variables);
  epoch_ = 0;
  for (const PlacementReply& r : replies) epoch_ = std::max(epoch_, r.epoch);
  slot_names_ = std::move(replies[0].slot_names);
  counter_names_ = std::move(replies[0].counter_names);
  tables_ = std::move(replies[0].tables);
  id_sharding_ = replies[0].id_sharding;
  // A chief that did not register the model (it took over a lost one's) cuts with it.
  table_seed_ = replies[0].table_seed;
}

}  // namespace pulley
// ---- end pulley/client/impl/client_model.hpp ----
// ---- end pulley/client/client.hpp ----
// ---- begin pulley/core/detail/pages.hpp ----
/// \file
/// Large buffers on huge pages. Memory a process has not written yet costs a page fault per
/// 4 KiB page at its first write; in a virtual machine that fault is dear (measured on the
/// 2-vCPU VM of BENCHMARKS.md: 64 MiB of fresh memory took 190 ms to zero, 4 ms once
/// resident). A buffer of megabytes that is filled once (a cut's values and rows at the
/// chief, their gathering for a restore, a chunk of rows a ps sends) is advised onto
/// transparent huge pages before its first write: one fault per 2 MiB, 5 ms for the same
/// 64 MiB there. Not what a peer's bytes fill (wire::FrameReader): a huge page is resident
/// whole once touched, so memory bounded by a budget would grow by up to 2 MiB a buffer.

#include <cstddef>
#include <cstdint>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace pulley::detail {

/// The size of a transparent huge page on x86-64 and most AArch64 kernels.
inline constexpr std::size_t kHugePageBytes = std::size_t{2} << 20U;

/// Asks the kernel to back the whole huge pages inside [data, data + bytes) with huge pages
/// at their first write (Linux: madvise MADV_HUGEPAGE, which takes effect where the system
/// enables transparent huge pages "always" or "madvise"). Advice only: nothing changes
/// where the kernel declines, on other systems, or for a range under two huge pages.
inline void advise_huge_pages(const void* data, std::size_t bytes) noexcept {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (data == nullptr || bytes < 2 * kHugePageBytes) return;
  const auto from = reinterpret_cast<std::uintptr_t>(data);
  const std::uintptr_t begin = (from + kHugePageBytes - 1) & ~(std::uintptr_t{kHugePageBytes} - 1);
  const std::uintptr_t end = (from + bytes) & ~(std::uintptr_t{kHugePageBytes} - 1);
  if (end > begin) (void)::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

/// `v.reserve(n)`, the new memory advised onto huge pages (advise_huge_pages) before any of
/// it is written: for a vector about to be filled with megabytes.
template <class T, class A>
void reserve_on_huge_pages(std::vector<T, A>& v, std::size_t n) {
  if (n <= v.capacity()) return;
  v.reserve(n);
  advise_huge_pages(v.data(), v.capacity() * sizeof(T));
}

/// `v.resize(n)`, the memory advised onto huge pages before the new elements are written
/// (reserve_on_huge_pages): for a vector about to hold megabytes, e.g. read straight into.
template <class T, class A>
void resize_on_huge_pages(std::vector<T, A>& v, std::size_t n) {
  reserve_on_huge_pages(v, n);
  v.resize(n);
}

}  // namespace pulley::detail
// ---- end pulley/core/detail/pages.hpp ----
// ---- begin pulley/sharding/ids.hpp ----

#include <cstdint>
#include <span>
#include <string_view>

namespace pulley {

/// Rows of embedding tables spread by a hash of the id (and the table's name, so that the
/// same id in many tables does not always land on the same ps): the default, which keeps
/// the load even whatever the ids look like (TensorFlow's `mod` partition strategy does the
/// same with the id itself, which skewed ids defeat).
///
/// Rendezvous (highest random weight) hashing: each ps task scores each row by a hash of
/// the row and the task's index, and the highest score holds it. When the ps tasks change,
/// only the rows that must move do: a ps task added takes about 1/(P + 1) of the rows, from
/// every other one alike, and the rows of a ps task that leaves spread over the rest; no
/// other row changes hands. A lookup costs P + 1 hashes.
struct HashIds {
  /// The ps task that holds row `id` of `table` among ps tasks 0 .. num_ps − 1.
  [[nodiscard]] std::uint32_t ps_of(std::string_view table, std::uint64_t id,
                                    std::uint32_t num_ps) const noexcept {
    Best best(row_key(table, id), 0);
    for (std::uint32_t ps = 1; ps < num_ps; ++ps) best.offer(ps);
    return best.ps;
  }

  /// The ps task that holds row `id` of `table` among the ps tasks `members` (task indices,
  /// ascending, not empty): the same as above when they are 0 .. num_ps − 1.
  [[nodiscard]] std::uint32_t ps_of(std::string_view table, std::uint64_t id,
                                    std::span<const std::uint32_t> members) const noexcept {
    Best best(row_key(table, id), members.front());
    for (const std::uint32_t ps : members.subspan(1)) best.offer(ps);
    return best.ps;
  }

 private:
  static constexpr std::uint64_t row_key(std::string_view table, std::uint64_t id) noexcept {
    return mix_id(id ^ name_hash(table));
  }
  static constexpr std::uint64_t score(std::uint64_t row, std::uint32_t ps) noexcept {
    return mix_id(row + (std::uint64_t{ps} + 1) * 0x9E3779B97F4A7C15ULL);
  }
  /// The task scoring a row highest among those offered, in ascending order: the first on
  /// a tie.
  struct Best {
    std::uint64_t row;
    std::uint32_t ps;
    std::uint64_t score_of_ps;
    Best(std::uint64_t r, std::uint32_t first) noexcept : row(r), ps(first), score_of_ps(score(r, first)) {}
    void offer(std::uint32_t task) noexcept {
      const std::uint64_t s = score(row, task);
      if (s > score_of_ps) {
        ps = task;
        score_of_ps = s;
      }
    }
  };
};
static_assert(IdSharding<HashIds>);
static_assert(ElasticIdSharding<HashIds>);
/// Rows of embedding tables spread by range: the id space [0, 2^64) cut into `num_ps` equal
/// contiguous ranges, ps i holding [i·2^64/num_ps, (i+1)·2^64/num_ps) (TensorFlow's `div`
/// strategy over the whole id space). Ids that are already hashes spread evenly; small
/// sequential ids all land on ps 0, so use it for ids drawn over the whole 64-bit range.
///
/// When the ps tasks change, the ranges are cut again among them, in task order: adding a
/// ps task to P moves about half the rows (HashIds moves 1/(P + 1)).
struct RangeIds {
  /// The ps task that holds row `id` (the table does not matter).
  [[nodiscard]] std::uint32_t ps_of(std::string_view /*table*/, std::uint64_t id,
                                    std::uint32_t num_ps) const noexcept {
    // floor(id · num_ps / 2^64), in two 32-bit halves so that nothing overflows.
    const std::uint64_t high = (id >> 32U) * num_ps;
    const std::uint64_t low = ((id & 0xFFFFFFFFU) * num_ps) >> 32U;
    return static_cast<std::uint32_t>((high + low) >> 32U);
  }
  /// The ps task that holds row `id` among the ps tasks `members` (not empty): the i-th
  /// range is the i-th member's.
  [[nodiscard]] std::uint32_t ps_of(std::string_view table, std::uint64_t id,
                                    std::span<const std::uint32_t> members) const noexcept {
    return members[ps_of(table, id, static_cast<std::uint32_t>(members.size()))];
  }
};
static_assert(ElasticIdSharding<RangeIds>);

}  // namespace pulley
// ---- end pulley/sharding/ids.hpp ----

namespace pulley {

namespace detail {

/// Reads table `t`'s rows and admission counts at the cut from every ps (paused, its cut
/// read), chunk by chunk: each ps holds at most one chunk more than its rows meanwhile. An
/// `incremental` cut's rows are those changed since its base, and its evicted ids follow;
/// nullopt when a ps could not make its part incremental (its eviction log no longer
/// reaches back to the base: RowsChunk::since).
template <Transport T>
std::optional<TableState> read_table(Client<T>& client, std::uint32_t t, bool incremental) {
  const std::size_t num_ps = client.num_ps();
  const auto timeout = client.options().request_timeout;
  TableState table;
  table.spec = client.tables()[t];
  // What each ps holds: its rows at the cut, its update count, the optimizer's slots.
  // Rows by task index: the members' (the others hold nothing).
  std::vector<std::uint64_t> total(num_ps, 0);
  const std::span<const std::uint32_t> members = client.members();
  {
    CallGroup group;
    for (const std::uint32_t ps : members) {
      group.add(client.transport().call(ps, ReadRows{t, 0, 0, false, false}, PullTargets{std::span<float>()}));
    }
    group.wait(timeout, "read the rows of table '" + table.spec.name + "'");
    for (std::size_t k = 0; k < members.size(); ++k) {
      const std::uint32_t ps = members[k];
      RowsChunk head = group.take_as<RowsChunk>(k);
      if (incremental && head.since < 0) return std::nullopt;
      if (k == 0) table.slot_names = std::move(head.slot_names);
      total[ps] = head.total;
      table.updates.push_back(head.updates);
    }
  }
  if (!first_tasks(members) && !table.updates.empty()) {
    // The counts are read in member order, which is task order while the members are the
    // cluster's first ps tasks (TableState::updates); with one gone, all are the largest.
    table.updates.assign(table.updates.size(), *std::max_element(table.updates.begin(), table.updates.end()));
  }
  const std::size_t stride = table.stride();
  std::uint64_t rows = 0;
  for (const std::uint64_t n : total) rows += n;
  table.ids.reserve(rows);
  table.touched.reserve(rows);
  detail::resize_on_huge_pages(table.rows, rows * stride);
  // Chunks of every ps at once, round after round, each read straight into its place.
  std::vector<std::uint64_t> begin(num_ps, 0);
  std::size_t filled = 0;
  for (;;) {
    CallGroup group;
    std::vector<std::size_t> asked;
    std::vector<std::size_t> at;
    for (std::size_t ps = 0; ps < num_ps; ++ps) {
      if (begin[ps] >= total[ps]) continue;
      const std::size_t n = std::min<std::size_t>(total[ps] - begin[ps], rows_per_chunk(stride));
      PullTargets target{std::span(table.rows).subspan(filled * stride, n * stride)};
      group.add(client.transport().call(ps, ReadRows{t, begin[ps], static_cast<std::uint32_t>(n), false, false},
                                        std::move(target)));
      asked.push_back(ps);
      at.push_back(n);
      filled += n;
    }
    if (asked.empty()) break;
    group.wait(timeout, "read the rows of table '" + table.spec.name + "'");
    for (std::size_t k = 0; k < asked.size(); ++k) {
      RowsChunk chunk = group.take_as<RowsChunk>(k);
      if (chunk.ids.size() != at[k] || chunk.steps.size() != at[k]) {
        throw Error(ErrorCode::kInternal, "ps " + std::to_string(asked[k]) + " answered a chunk of table '" +
                                              table.spec.name + "' of the wrong size");
      }
      table.ids.insert(table.ids.end(), chunk.ids.begin(), chunk.ids.end());
      table.touched.insert(table.touched.end(), chunk.steps.begin(), chunk.steps.end());
      begin[asked[k]] += at[k];
    }
  }
  // The ids admission was counting, and those an incremental cut says were evicted, a ps
  // after the other (their chunks' rows are empty).
  auto read_ids = [&](bool evicted, auto&& take, const std::string& what) {
    for (const std::uint32_t ps : members) {
      for (std::uint64_t from = 0;;) {
        CallGroup group;
        ReadRows r{t, from, static_cast<std::uint32_t>(kMaxCandidatesPerMessage), !evicted, evicted};
        group.add(client.transport().call(ps, r, PullTargets{std::span<float>()}));
        group.wait(timeout, what);
        RowsChunk chunk = group.take_as<RowsChunk>(0);
        take(chunk);
        from += chunk.ids.size();
        if (chunk.ids.empty() || from >= chunk.total) break;
      }
    }
  };
  read_ids(false, [&](const RowsChunk& chunk) {
    table.candidate_ids.insert(table.candidate_ids.end(), chunk.ids.begin(), chunk.ids.end());
    table.candidate_counts.insert(table.candidate_counts.end(), chunk.counts.begin(), chunk.counts.end());
    table.candidate_steps.insert(table.candidate_steps.end(), chunk.steps.begin(), chunk.steps.end());
  }, "read the admission counts of table '" + table.spec.name + "'");
  if (incremental) {
    read_ids(true, [&](const RowsChunk& chunk) {
      table.evicted.insert(table.evicted.end(), chunk.ids.begin(), chunk.ids.end());
    }, "read the evicted ids of table '" + table.spec.name + "'");
  }
  return table;
}

/// Sends table `t` of `table` to the ps tasks in chunks, at epoch `epoch`: each row (and
/// admission count) to the ps `sharding` gives it when that is where the ps tasks' own
/// IdSharding puts it (`routed`), else every chunk to every ps, each keeping its own. The
/// table's update count goes to every ps: as saved when the ps tasks are those that wrote
/// it, else the largest.
template <Transport T, IdSharding I>
void restore_table(Client<T>& client, std::uint32_t t, const TableState& table, std::uint64_t epoch,
                   const I& sharding, bool routed) {
  const std::size_t num_ps = client.num_ps();
  const auto timeout = client.options().request_timeout;
  const std::string what = "restore the rows of table '" + table.spec.name + "'";
  const std::int64_t largest =
      table.updates.empty() ? 0 : *std::max_element(table.updates.begin(), table.updates.end());
  const std::size_t stride = table.stride();
  const std::size_t rows = table.ids.size();
  // The counts were saved by task index (TableState::updates; all the largest when a ps
  // had left): they stay each ps's while the ps tasks are the cluster's first ones, as
  // many as wrote them.
  const bool same_tasks = table.updates.size() == num_ps && first_tasks(client.members()) &&
                          client.members().size() == num_ps;
  std::vector<std::vector<std::size_t>> mine(num_ps);  // a chunk's rows, by ps (routed)
  std::vector<std::vector<float>> values(num_ps);
  // Rows, then candidates; the first message to each ps carries its update count.
  bool first = true;
  auto send = [&](std::size_t from, std::size_t n, bool candidates) {
    if (routed) {
      for (auto& m : mine) m.clear();
      const auto& ids = candidates ? table.candidate_ids : table.ids;
      for (std::size_t i = from; i < from + n; ++i) {
        const std::uint32_t ps = row_owner(sharding, table.spec.name, ids[i], client.members());
        if (ps >= num_ps) throw Error(ErrorCode::kInternal, "the id sharding put a row outside the cluster");
        mine[ps].push_back(i);
      }
    }
    client.template broadcast<Ack>(
        [&](std::size_t ps) {
          RestoreRows m;
          m.epoch = epoch;
          m.table = t;
          if (first) m.updates = same_tasks ? table.updates[ps] : largest;
          m.slot_names = table.slot_names;
          m.candidates = candidates;
          if (routed) {
            values[ps].clear();
            detail::reserve_on_huge_pages(values[ps], candidates ? 0 : mine[ps].size() * stride);
            m.ids.reserve(mine[ps].size());
            m.steps.reserve(mine[ps].size());
            if (candidates) m.counts.reserve(mine[ps].size());
            for (const std::size_t i : mine[ps]) {
              if (candidates) {
                m.ids.push_back(table.candidate_ids[i]);
                m.counts.push_back(table.candidate_counts[i]);
                m.steps.push_back(table.candidate_steps[i]);
              } else {
                m.ids.push_back(table.ids[i]);
                values[ps].insert(values[ps].end(), table.rows.begin() + static_cast<std::ptrdiff_t>(i * stride),
                                  table.rows.begin() + static_cast<std::ptrdiff_t>((i + 1) * stride));
                m.steps.push_back(table.touched[i]);
              }
            }
            m.rows = values[ps];
          } else if (candidates) {
            m.ids.assign(table.candidate_ids.begin() + from, table.candidate_ids.begin() + from + n);
            m.counts.assign(table.candidate_counts.begin() + from, table.candidate_counts.begin() + from + n);
            m.steps.assign(table.candidate_steps.begin() + from, table.candidate_steps.begin() + from + n);
          } else {
            m.ids.assign(table.ids.begin() + from, table.ids.begin() + from + n);
            m.rows = std::span(table.rows).subspan(from * stride, n * stride);
            m.steps.assign(table.touched.begin() + from, table.touched.begin() + from + n);
          }
          return m;
        },
        timeout, what);
    first = false;
  };
  const std::size_t chunk = rows_per_chunk(stride);
  for (std::size_t from = 0; from < rows; from += chunk) send(from, std::min(chunk, rows - from), false);
  const std::size_t candidates = table.candidate_ids.size();
  for (std::size_t from = 0; from < candidates; from += kMaxCandidatesPerMessage) {
    send(from, std::min(kMaxCandidatesPerMessage, candidates - from), true);
  }
  if (first) send(0, 0, false);  // an empty table: its update count still goes
}

/// Why `table` cannot be restored (its name or dim differs from `spec`, the model's, or
/// its rows do not fit its shape), or "".
inline std::string check_table(const TableState& table, const TableSpec& spec) {
  if (table.spec.name != spec.name || table.spec.dim != spec.dim) {
    return "the checkpoint's table '" + table.spec.name + "' (dim " + std::to_string(table.spec.dim) +
           ") is not the model's '" + spec.name + "' (dim " + std::to_string(spec.dim) + ")";
  }
  const std::size_t n = table.ids.size();
  if (table.rows.size() != n * table.stride() || table.touched.size() != n ||
      table.candidate_counts.size() != table.candidate_ids.size() ||
      table.candidate_steps.size() != table.candidate_ids.size()) {
    return "the checkpoint's table '" + spec.name + "' has rows that do not fit its shape";
  }
  return {};
}

/// The cut that every ps is read at (ReadState), from what each answered to Pause: for
/// each worker, the largest count of its pushes taken over all ps tasks, and the last push
/// taken by the ps with that count. Each ps holds itself to it by its own ledger (a ps
/// short of the count by a push lost with an earlier process is not waited for:
/// CheckpointCut::own_until).
inline ReadState cut_of(std::span<const PauseReply> paused) {
  std::size_t workers = 0;
  for (const PauseReply& p : paused) workers = std::max(workers, p.pushes.size());
  ReadState cut;
  cut.until.assign(workers, 0);
  cut.last_sequences.assign(workers, 0);
  cut.last_series.assign(workers, 0);
  for (std::size_t w = 0; w < workers; ++w) {
    const PauseReply* furthest = &paused.front();
    for (const PauseReply& p : paused) {
      if (of_worker(p.pushes, w) > of_worker(furthest->pushes, w)) furthest = &p;
    }
    cut.until[w] = of_worker(furthest->pushes, w);
    cut.last_sequences[w] = of_worker(furthest->last_sequences, w);
    cut.last_series[w] = of_worker(furthest->last_series, w);
  }
  return cut;
}

}  // namespace detail

/// Which of the tables' rows a checkpoint's cut reads.
struct CutRows {
  /// An incremental checkpoint's base: the global step of the checkpoint it is relative
  /// to. Only the rows touched since are read, with the ids evicted since. -1: every row (a
  /// full checkpoint).
  std::int64_t since = -1;
  /// The ps tasks forget the evictions before this global step (the newest checkpoint on
  /// disk: no later incremental one will be relative to an older one). -1: none.
  std::int64_t forget_evictions_before = -1;
};

/// The chief's half of a checkpoint's cut (the ps's half is `ps/checkpoint_cut.hpp`): every
/// variable with its optimizer state, and the sync policy's state, read as one cut across
/// all ps tasks. Every ps is paused (at once, or the moment it completes `at_step`; pushes
/// that arrive then wait), each is brought to the same count of pushes taken from every
/// worker (the largest any had, with that ps's last push, cut_of; each ps less a push lost
/// with its worker's process, CheckpointCut::own_until),
/// read there, and resumed. Training stands still only while
/// the dense state is read: the tables' rows are read after the ps tasks resume, each ps
/// answering with the rows as they were at the cut (copy-on-write). With `rows.since` ≥ 0 the
/// tables' part is incremental (ModelState:: base_step); when a ps no longer knows every eviction
/// since then (its log overflowed, or it was restored later), the cut reads every row instead, with
/// a log line.
///
/// With `hold`, the ps tasks stay paused once the state is read (every row at the cut
/// included): nothing trains until the caller registers the model again (which ends the
/// pause, as Chief::join does) or resumes them. A failure resumes them all the same.
template <Transport T>
ModelState read_state(Client<T>& client, std::int64_t at_step = 0, CutRows rows = {}, bool hold = false) {
  if (!client.has_placement()) throw Error(ErrorCode::kFailedPrecondition, "no model registered yet");
  struct Resumer {  // whatever happens, the ps tasks go on (unless held on success)
    Client<T>& client;
    bool armed = true;
    ~Resumer() {
      if (!armed) return;
      try {
        client.template broadcast<Ack>([](std::size_t) { return Resume{}; }, client.options().request_timeout,
                                       "resume the ps tasks");
      } catch (const Error&) {  // a ps that is gone resumes when the chief's link closes
      }
    }
  } resumer{client};
  std::vector<PauseReply> paused;
  {
    CallGroup group;
    for (const std::uint32_t ps : client.members()) group.add(client.transport().call(ps, Pause{at_step}, {}));
    detail::wait_gated(client.transport(), client.members(), client.options(), group, at_step, "pause the ps tasks at step " + std::to_string(at_step));
    for (std::size_t k = 0; k < group.size(); ++k) paused.push_back(group.take_as<PauseReply>(k));
  }
  if (rows.since >= 0) {
    for (std::size_t k = 0; k < paused.size(); ++k) {
      if (paused[k].evictions_since <= rows.since) continue;
      log(LogLevel::kInfo, "ps " + std::to_string(client.members()[k]) + " knows its evictions from global step " +
                               std::to_string(paused[k].evictions_since) + " on only, not since " +
                               std::to_string(rows.since) + ": this checkpoint holds every row");
      rows.since = -1;
      break;
    }
  }
  ReadState cut = detail::cut_of(paused);
  cut.since = rows.since;
  cut.forget_evictions_before = rows.forget_evictions_before;
  ModelState state;
  const std::size_t num_slots = paused[0].slot_names.size();
  for (const VariableSpec& spec : client.variables()) {
    VariableState v;
    v.spec = spec;
    detail::resize_on_huge_pages(v.values, spec.size());
    for (const std::string& name : paused[0].slot_names) {
      std::vector<float> slot;
      detail::resize_on_huge_pages(slot, spec.size());
      v.slots.push_back({name, std::move(slot)});
    }
    v.counter_names = paused[0].counter_names;
    state.variables.push_back(std::move(v));
  }
  const Placement& placement = client.placement();
  CallGroup group;
  for (std::size_t m = 0; m < client.members().size(); ++m) {
    const std::uint32_t ps = client.members()[m];
    PullTargets targets;
    for (const Part& part : placement.parts) {
      if (part.ps != ps) continue;
      VariableState& v = state.variables[part.variable];
      const std::size_t row = v.spec.row_size();
      const std::size_t at = part.rows.begin * row, n = part.rows.size() * row;
      targets.push_back(std::span(v.values).subspan(at, n));
      for (std::size_t k = 0; k < num_slots; ++k) {
        targets.push_back(std::span(v.slots[k].values).subspan(at, n));
      }
    }
    group.add(client.transport().call(ps, cut, std::move(targets)));
  }
  group.wait(client.options().request_timeout, "read the ps tasks' state at one cut");
  for (std::size_t k = 0; k < group.size(); ++k) {
    const std::uint32_t ps = client.members()[k];
    const StateReply reply = group.take_as<StateReply>(k);
    if (k == 0) {
      state.global_step = reply.global_step;
      state.pacer = reply.pacer;
    } else if (reply.pacer != state.pacer) {
      log(LogLevel::kWarning, "ps " + std::to_string(ps) + " and ps " + std::to_string(client.pacing_ps()) +
                                  " disagree on the sync policy's state at the cut: the checkpoint keeps ps " +
                                  std::to_string(client.pacing_ps()) + "'s");
    }
    for (const PartState& p : reply.parts) {
      if (p.part >= placement.parts.size() || placement.parts[p.part].ps != ps) {
        throw Error(ErrorCode::kInternal, "ps " + std::to_string(ps) + " answered for a part it does not hold");
      }
      const Part& part = placement.parts[p.part];
      state.variables[part.variable].counters.push_back({part.rows, p.counters});
    }
  }
  for (VariableState& v : state.variables) {
    std::sort(v.counters.begin(), v.counters.end(),
              [](const PartCounters& a, const PartCounters& b) { return a.rows.begin < b.rows.begin; });
  }
  if (!client.tables().empty() && !hold) {
    // Training goes on while the rows are read: each ps reads them as they were at the cut.
    client.template broadcast<Ack>([](std::size_t) { return Resume{true}; }, client.options().request_timeout,
                                   "resume the ps tasks");
  }
  for (std::uint32_t t = 0; t < client.tables().size(); ++t) {
    std::optional<TableState> table = detail::read_table(client, t, rows.since >= 0);
    if (!table) {
      log(LogLevel::kInfo, "a ps lost track of its evictions since global step " + std::to_string(rows.since) +
                               " while it was paused: the checkpoint is cut again, with every row");
      resumer.armed = false;  // the cut made again resumes (or holds) the ps tasks itself
      return read_state(client, 0, CutRows{-1, rows.forget_evictions_before}, hold);
    }
    state.tables.push_back(std::move(*table));
  }
  resumer.armed = !hold;
  state.table_seed = client.table_seed();
  if (!state.tables.empty()) state.base_step = rows.since;
  // At global step 0 nothing was applied yet: state a restore starts afresh is exact then.
  if (!paused[0].whole && state.global_step > 0) {
    log(LogLevel::kWarning, "the optimizer keeps state it does not name (slots, counters): this cut at global "
                            "step " + std::to_string(state.global_step) + " holds the rest, and a restore from "
                            "it starts that afresh");
  }
  return state;
}

/// Registers `state`'s model and sets every ps from it (Restore): values, optimizer state
/// (slots and counters matched by name: a checkpoint of another optimizer restores the
/// values alone), the sync policy's state, at a new epoch. The placement may differ from
/// the checkpoint's (another number of ps tasks): tensors are split anew, and each part
/// takes the counters of the saved part that held its first row. The embedding tables'
/// rows follow in chunks, each row sent to the ps `sharding` gives it when that is the ps
/// tasks' own IdSharding (else to every ps, each keeping its own), so any number of ps
/// tasks can take them, and no ps serves until its rows are in; rows created later
/// start from the checkpoint's table seed (or `table_seed` for a checkpoint without tables).
template <Transport T, IdSharding I = HashIds>
void restore_state(Client<T>& client, const ModelState& state, std::uint64_t table_seed, const I& sharding = {}) {
  if (state.incremental()) {
    throw Error(ErrorCode::kInvalidArgument,
                "an incremental checkpoint (over global step " + std::to_string(state.base_step) +
                    ") restores only applied over its base (apply_delta, or CheckpointDirectory::load)");
  }
  // The model's tables when this client knows them (it registered them), else the
  // checkpoint's; a checkpoint's tables must be the model's.
  const std::vector<TableSpec> tables = client.tables().empty() ? state.table_specs() : client.tables();
  if (!state.tables.empty() && tables.size() != state.tables.size()) {
    throw Error(ErrorCode::kInvalidArgument, "the checkpoint has " + std::to_string(state.tables.size()) +
                                                 " embedding tables, the model " + std::to_string(tables.size()));
  }
  for (std::size_t t = 0; t < state.tables.size(); ++t) {
    if (auto problem = detail::check_table(state.tables[t], tables[t]); !problem.empty()) {
      throw Error(ErrorCode::kInvalidArgument, problem);
    }
  }
  // A checkpoint with tables says their seed; one without keeps the caller's.
  client.register_model(state.specs(), tables, state.tables.empty() ? table_seed : state.table_seed);
  const std::uint64_t epoch = client.epoch() + 1;
  const Placement& placement = client.placement();
  const std::vector<std::string>& slot_names = client.slot_names();
  const std::vector<std::string>& counter_names = client.counter_names();
  const std::vector<std::uint32_t> workers(client.workers().begin(), client.workers().end());
  std::vector<Restore> messages(client.num_ps(), Restore{epoch, state.pacer, {}, !state.tables.empty(), workers});
  bool whole = true;
  for (const Part& part : placement.parts) {
    const VariableState& v = state.variables[part.variable];
    const std::size_t row = v.spec.row_size();
    const std::size_t at = part.rows.begin * row, n = part.rows.size() * row;
    PartState ps{static_cast<std::uint32_t>(&part - placement.parts.data()), std::span<const float>(v.values).subspan(at, n), {}, {}};
    for (const std::string& name : slot_names) {
      const auto it = std::find_if(v.slots.begin(), v.slots.end(),
                                   [&](const SlotState& s) { return s.name == name; });
      if (it == v.slots.end() || v.slots.size() != slot_names.size()) {
        ps.slots.clear();
        whole = false;
        break;
      }
      ps.slots.push_back(std::span<const float>(it->values).subspan(at, n));
    }
    const auto saved = std::find_if(v.counters.begin(), v.counters.end(), [&](const PartCounters& c) {
      return c.rows.begin <= part.rows.begin && part.rows.begin < c.rows.end;
    });
    for (const std::string& name : counter_names) {
      const auto k = std::find(v.counter_names.begin(), v.counter_names.end(), name);
      if (saved == v.counters.end() || k == v.counter_names.end() ||
          v.counter_names.size() != counter_names.size()) {
        ps.counters.clear();
        whole = false;
        break;
      }
      ps.counters.push_back(saved->values[static_cast<std::size_t>(k - v.counter_names.begin())]);
    }
    messages[part.ps].parts.push_back(std::move(ps));
  }
  if (!whole) {
    log(LogLevel::kWarning, "the checkpoint's optimizer state does not match this optimizer's "
                            "slots and counters: the values are restored, the optimizer starts afresh");
  }
  client.template broadcast<Ack>([&](std::size_t ps) { return std::move(messages[ps]); },
                                 client.options().request_timeout, "restore the ps tasks");
  if (!state.tables.empty()) {
    const bool routed = client.same_id_sharding(sharding);
    for (std::uint32_t t = 0; t < state.tables.size(); ++t) {
      detail::restore_table(client, t, state.tables[t], epoch, sharding, routed);
    }
    client.template broadcast<Ack>(
        [&](std::size_t) {
          RestoreRows done;
          done.epoch = epoch;
          done.done = true;
          return done;
        },
        client.options().request_timeout, "end the restore of the tables");
  }
  client.adopt_epoch(epoch);
}

}  // namespace pulley
// ---- end pulley/client/checkpoint_cut.hpp ----
// ---- begin pulley/client/chief.hpp ----

#include <algorithm>
#include <chrono>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <iterator>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

// ---- begin pulley/client/snapshot.hpp ----

#include <algorithm>
#include <chrono>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace pulley {

/// The values of every variable, read from every ps task at one global step.
struct Snapshot {
  /// The global step every ps had completed when it was read (the lowest of them when
  /// `consistent` is false).
  std::int64_t step = 0;
  /// Every ps was read at the same global step. Under SyncReplicas that makes the values
  /// one step's: `step` updates applied on every ps, nothing after them. Under Async and
  /// BoundedStaleness a ps's global step counts what that ps has seen, so even equal steps
  /// may hold different pushes, and while training runs they seldom agree.
  bool consistent = false;
  std::vector<std::vector<float>> values;  ///< one vector per variable, in variable order
};

namespace detail {

/// Reads every variable into `values` once every ps has completed `min_step` steps, and
/// returns the lowest and highest global step the ps tasks were read at. `patient`: as long
/// as training makes progress (or until `deadline`, `meanwhile` running as
/// wait_progressing says); otherwise only briefly, and nullopt (the values half read) if
/// the ps tasks do not answer at once.
template <Transport T>
std::optional<std::pair<std::int64_t, std::int64_t>> read_into(
    Client<T>& client, std::vector<std::vector<float>>& values, std::int64_t min_step, bool patient,
    std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max(),
    const std::function<bool()>& meanwhile = {}) {
  const auto& variables = client.variables();
  std::vector<PullRequest> requests;
  values.resize(variables.size());
  for (std::size_t v = 0; v < variables.size(); ++v) {
    values[v].resize(variables[v].size());
    requests.push_back({v, {0, variables[v].rows()}, values[v]});
  }
  const ClientOptions& options = client.options();
  CallGroup group;
  client.send_pulls(group, requests, min_step);
  if (patient) {
    if (min_step <= 0) {
      group.wait(options.request_timeout, "read the variables");
    } else if (!wait_progressing(client.transport(), client.members(), options, group,
                                 "read the variables at step " + std::to_string(min_step), deadline, meanwhile)) {
      return std::nullopt;
    }
  } else if (!group.wait_for(std::min(options.request_timeout, std::chrono::milliseconds(2000)))) {
    return std::nullopt;  // the group cancels the reads as it goes
  }
  std::int64_t lowest = std::numeric_limits<std::int64_t>::max();
  std::int64_t highest = std::numeric_limits<std::int64_t>::min();
  for (std::size_t i = 0; i < group.size(); ++i) {
    const std::int64_t step = group.take_as<PullReply>(i).global_step;
    lowest = std::min(lowest, step);
    highest = std::max(highest, step);
  }
  if (group.size() == 0) lowest = highest = 0;
  return std::pair{lowest, highest};
}

}  // namespace detail

/// Current values of every variable, pulled from every ps at once once it has completed
/// `min_step` steps (while training runs, the ps tasks may be at different steps: use
/// `snapshot` for one step's values).
template <Transport T>
std::vector<std::vector<float>> read_variables(Client<T>& client, std::int64_t min_step = 0) {
  std::vector<std::vector<float>> values;
  detail::read_into(client, values, min_step, true);
  return values;
}

/// Every variable at one global step of at least `step`, the same on every ps when the ps
/// tasks can agree (see Snapshot): each ps is read once it reaches the target step, and
/// answers at that step's end (pulls waiting for a step are answered the moment it
/// completes). A ps read past the target sets the next round's target; a few rounds settle
/// it while sync training runs. A later round that does not complete at once (the ps tasks
/// count pushes that will never agree) leaves the last read as it is. nullopt if `deadline`
/// passes before the ps tasks reach `step`, or `meanwhile` voided the wait
/// (detail::wait_progressing).
template <Transport T>
std::optional<Snapshot> snapshot_until(Client<T>& client, std::int64_t step,
                                       std::chrono::steady_clock::time_point deadline,
                                       const std::function<bool()>& meanwhile = {}) {
  constexpr int kRounds = 8;
  Snapshot shot;
  const auto first = detail::read_into(client, shot.values, step, true, deadline, meanwhile);  // (lowest, highest)
  if (!first) return std::nullopt;
  auto steps = *first;
  for (int round = 1; round < kRounds && steps.first != steps.second; ++round) {
    std::vector<std::vector<float>> again;
    const auto read = detail::read_into(client, again, steps.second, false);
    if (!read) break;
    steps = *read;
    shot.values = std::move(again);
  }
  shot.step = steps.first;
  shot.consistent = steps.first == steps.second;
  return shot;
}

/// Like snapshot_until, with no deadline: waits as long as training progresses.
template <Transport T>
Snapshot snapshot(Client<T>& client, std::int64_t step) {
  return *snapshot_until(client, step, std::chrono::steady_clock::time_point::max());
}

/// The current rows `ids` of embedding table `table` (ids.size() × dim floats, in order),
/// read from the ps tasks that hold them under id sharding `sharding` (the ps tasks'); a
/// row not held reads as its initial value, and the read creates, admits and touches
/// nothing (only a worker's pull does). The rows are each ps's as it holds them when read
/// (not one global step's while training runs). Ids, any number and any of them more than
/// once, go in messages of kMaxIdsPerMessage at most, each id once.
template <Transport T, IdSharding I = HashIds>
std::vector<float> read_rows(Client<T>& client, std::string_view table,
                             std::span<const std::uint64_t> ids, I sharding = {}) {
  const auto& tables = client.tables();
  const auto it = std::find_if(tables.begin(), tables.end(),
                               [&](const TableSpec& t) { return t.name == table; });
  if (it == tables.end()) throw Error(ErrorCode::kNotFound, "unknown table '" + std::string(table) + "'");
  client.check_id_sharding(sharding);
  const auto num_ps = static_cast<std::uint32_t>(client.num_ps());
  // Each id once, grouped by ps for the pull (a ps refuses an id twice in a request), then
  // every one of the caller's ids gets its row back, in the caller's order.
  struct Wanted {
    std::uint32_t ps;
    std::uint64_t id;
    std::size_t at;  ///< in the caller's ids
    auto operator<=>(const Wanted&) const = default;
  };
  std::vector<Wanted> order;
  order.reserve(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const std::uint32_t ps = row_owner(sharding, table, ids[i], client.members());
    if (ps >= num_ps) {
      throw Error(ErrorCode::kInvalidArgument, "the id sharding put row " + std::to_string(ids[i]) +
                                                   " on ps " + std::to_string(ps) + " of " + std::to_string(num_ps));
    }
    order.push_back({ps, ids[i], i});
  }
  std::sort(order.begin(), order.end());
  std::vector<std::uint64_t> grouped;
  std::vector<std::size_t> row_of(ids.size());  // caller's index → index in grouped
  std::vector<std::size_t> ps_begin(num_ps + 1, 0);
  for (const Wanted& w : order) {
    if (grouped.empty() || grouped.back() != w.id) {  // an id always has the same ps
      grouped.push_back(w.id);
      ++ps_begin[w.ps + 1];
    }
    row_of[w.at] = grouped.size() - 1;
  }
  for (std::uint32_t p = 0; p < num_ps; ++p) ps_begin[p + 1] += ps_begin[p];
  std::vector<float> rows(grouped.size() * it->dim);
  const RowRequest request{static_cast<std::size_t>(it - tables.begin()), grouped, ps_begin, rows};
  (void)client.pull_rows(std::span(&request, 1), 0);
  std::vector<float> out(ids.size() * it->dim);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    std::copy_n(rows.begin() + static_cast<std::ptrdiff_t>(row_of[i] * it->dim), it->dim,
                out.begin() + static_cast<std::ptrdiff_t>(i * it->dim));
  }
  return out;
}

}  // namespace pulley
// ---- end pulley/client/snapshot.hpp ----

namespace pulley {

/// The chief task: registers the model with the ps tasks, initializes every variable from a
/// seed, releases the workers (the ps tasks turn ready), reads variables back for
/// evaluation and checkpoints, and ends training: `shutdown` when it is complete (every
/// task then learns so and ends successfully), `abort` when it failed.
///
/// @tparam T the Transport that reaches the ps tasks
template <Transport T>
class Chief {
 public:
  // The longer bodies are defined in client/impl/ (included at the end of this header), by
  // concern: initializing, taking over and ending the job in chief_state.hpp; the job's
  // shape (ps tasks and workers that leave, join or come back, and the copies) in
  // chief_membership.hpp.

  /// @param seed initial values depend only on it and the variables' names
  Chief(T transport, std::uint64_t seed, ClientOptions options = {})
      : seed_(seed), client_(std::move(transport), options) {}

  /// Registers `variables`, fills them with their initializers and sends the values to the
  /// ps tasks that hold them. When it returns, every ps is ready and workers proceed.
  ///
  /// `tables` are the model's embedding tables: registered with the same seed, their rows
  /// are created by the ps tasks as they are first pulled (nothing is sent for them).
  const Placement& initialize(std::span<const VariableSpec> variables,
                              std::span<const TableSpec> tables = {}) {
    return send_initial(variables, initial_values(variables), tables, false);
  }

  /// Same with explicit initial values, one vector per variable (e.g. a restored checkpoint).
  const Placement& initialize(std::span<const VariableSpec> variables,
                              std::span<const std::vector<float>> values,
                              std::span<const TableSpec> tables = {}) {
    return send_initial(variables, values, tables, false);
  }

  /// Initializes as `initialize` does and returns the job's state at global step 0 exactly,
  /// optimizer slots included: every ps holds the workers' first pushes until it is read
  /// (however fast they start). It is the checkpoint TensorFlow's saver writes before the
  /// first step, and what a lost ps rolls the job back to when there is no checkpoint.
  ModelState initialize_and_save(std::span<const VariableSpec> variables,
                                 std::span<const TableSpec> tables = {});

  /// Current values of every variable, as each ps holds them now (while training runs, the
  /// ps tasks may be at different steps: use `snapshot` for one step's values).
  std::vector<std::vector<float>> read_variables() { return pulley::read_variables(client_); }

  /// Every variable at one global step of at least `step`, read from every ps at that same
  /// step (see Snapshot); waits until the ps tasks reach it.
  Snapshot snapshot(std::int64_t step) { return pulley::snapshot(client_, step); }

  /// Like snapshot, but nullopt if `deadline` passes before the ps tasks reach `step`, or
  /// `meanwhile` (run while it waits) voided the wait: see pulley::snapshot_until.
  std::optional<Snapshot> snapshot_until(std::int64_t step, std::chrono::steady_clock::time_point deadline,
                                         const std::function<bool()>& meanwhile = {}) {
    return pulley::snapshot_until(client_, step, deadline, meanwhile);
  }

  /// Blocks until every ps task has completed `step` global steps; returns the lowest
  /// global step they report.
  std::int64_t wait_for_step(std::int64_t step) { return client_.wait_for_step(step); }

  /// Like wait_for_step, but gives up at `deadline`, or when `meanwhile` (run while it
  /// waits) voided the wait: nullopt then. See Client::wait_for_step_until.
  std::optional<std::int64_t> wait_for_step_until(std::int64_t step, std::chrono::steady_clock::time_point deadline,
                                                  const std::function<bool()>& meanwhile = {}) {
    return client_.wait_for_step_until(step, deadline, meanwhile);
  }

  /// Counters of every member ps, in member order (Client::stats).
  std::vector<Stats> stats() { return client_.stats(); }

  /// The current rows `ids` of embedding table `table` (ids.size() × dim floats, in order)
  /// under id sharding `sharding` (the ps tasks'); see pulley::read_rows. For evaluation and
  /// tests: training never needs the chief to read rows.
  template <IdSharding I = HashIds>
  std::vector<float> read_rows(std::string_view table, std::span<const std::uint64_t> ids,
                               I sharding = {}) {
    return pulley::read_rows(client_, table, ids, std::move(sharding));
  }

  /// Every variable with its optimizer state and the sync policy's state, as one consistent
  /// cut across all ps tasks, for a checkpoint (`CheckpointDirectory::save`). How the cut is
  /// made: every ps is paused (pushes that arrive wait, unanswered), tells how many pushes
  /// of each worker it has taken, and is brought to the largest of those counts (taking the
  /// pushes that were on their way to it) before it is read and resumed. So every ps holds
  /// the same pushes at the cut, under any sync policy: Async and BoundedStaleness, whose
  /// ps tasks apply pushes as they come, included. Training stands still while the state
  /// is read, not while it is written. `rows` makes the tables' part incremental: the rows
  /// changed since an earlier checkpoint (CutRows, ModelState::base_step).
  ModelState save_state(CutRows rows = {}) { return read_state(client_, 0, rows); }

  /// The same, cut the moment every ps completes global step `step` (waiting for it as long
  /// as training progresses): under SyncReplicas every ps is then exactly at that step, with
  /// nothing of the next one taken.
  ModelState save_state_at(std::int64_t step, CutRows rows = {}) { return read_state(client_, step, rows); }

  /// Sets every ps from `state` (a checkpoint): registers its model, and restores values,
  /// optimizer state and the sync policy's state, at a new epoch. Use it in place of
  /// `initialize` to resume a job, or while training runs to roll every ps back to the
  /// checkpoint (after a ps was lost): what waited on the ps tasks is refused, and their
  /// clients start their step again. When it returns, every ps is ready.
  /// `sharding`: where the ps tasks' Tables policy puts rows (each row is then sent to its
  /// ps only; another sharding sends every row to every ps, which is slower, not wrong).
  template <IdSharding I = HashIds>
  void restore(const ModelState& state, const I& sharding = {}) {
    restore_state(client_, state, seed_, sharding);
  }

  /// Ends training successfully: every ps answers what waits there and everything sent
  /// later with `kOutOfRange` ("training finished"), so workers and the evaluator stop
  /// cleanly (`Worker::step` returns nullopt); the ps tasks then stop serving.
  void shutdown() { end({false, {}}); }

  /// True if every ps task answers that it serves training already, all at the same
  /// epoch: this chief was started again in place of a lost one, and may go on from their
  /// live state (`adopt`). False when any does not (a restore its predecessor left half
  /// done, a ps restarted), or cannot be reached within the request timeout.
  [[nodiscard]] bool ps_serving();

  /// Takes over a job that every ps serves (`ps_serving`), in place of a lost chief:
  /// learns where each variable lives and the epoch (kFailedPrecondition when the ps tasks
  /// hold another model), and returns the lowest global step of the ps tasks.
  std::int64_t adopt(std::span<const VariableSpec> variables,
                     std::span<const TableSpec> tables = {});

  /// Ends training as failed, for `reason`: the ps tasks answer `kAborted` with it, so every
  /// task stops with an error naming it.
  void abort(const std::string& reason) { end({true, reason}); }

  /// The member ps tasks that do not answer within `timeout` (each asked alone), ascending.
  std::vector<std::uint32_t> unreachable(std::chrono::milliseconds timeout);

  /// Takes the member ps tasks `gone` out of the job for good: the next `restore` places
  /// the model over the others, each part of theirs on the member that holds least
  /// (sharding/rebalance.hpp), at a membership one newer, and the workers follow when they
  /// get ready again. Throws kInvalidArgument for a ps that is not a member, or when none
  /// would be left (with copies, fewer than 2: Tcp::place_copies), with nothing changed.
  void leave(std::span<const std::uint32_t> gone);

  /// Takes the ps task serving at `address` into the job, as task `num_ps()` (the next
  /// index), and returns that index. The new ps is reached first (and must hold no model
  /// yet). Then every ps is paused and read at one cut (dense parts, optimizer slots and
  /// counters, table rows, the sync policy's state: read_state, held), the model is
  /// registered over the members and the new task at a membership one newer (placed for
  /// that many ps tasks: the sharding policy's placement for the count, rebalanced over
  /// the members; rows by the IdSharding over them), and every ps is restored from the
  /// cut. No update is lost: training stands still from the cut to the end of the
  /// restore, and the workers follow when they get ready again. `sharding`: the ps tasks'
  /// IdSharding, as for `restore`.
  ///
  /// Throws, with the job as it was (every ps serving, nothing lost):
  ///   - kFailedPrecondition before the model is registered, for a transport that cannot
  ///     grow (a GrowingTransport can), for a new ps that
  ///     holds a model, or that refused the registration or its restore: then the members
  ///     before are restored from the same cut, at a membership newer still, and the new
  ///     ps is told to end (Shutdown, aborted, with the reason);
  ///   - kFailedPrecondition for an address it cannot reach (nothing changed).
  /// Throws kUnavailable when a ps was lost on the way: the ps tasks may then wait for a
  /// restore (roll them back, as ChiefLoop does); a join tried again takes the same index.
  template <IdSharding I = HashIds>
  std::uint32_t join(const std::string& address, const I& sharding = {});

  /// The member ps tasks some of whose copies this chief's transport gave up (lost for
  /// good: their shards are served by one copy only), ascending; none without copies
  /// (a CopyingTransport's `given_up`).
  [[nodiscard]] std::vector<std::uint32_t> given_up() const;
  /// True when this chief's transport gave up every copy member ps `ps`'s process holds
  /// (a CopyingTransport's optional `given_up_whole`): no shard is read there as its last
  /// copy, so that process, if it lives on, may start again empty (Shutdown::restart) and
  /// be taken back. False without copies.
  [[nodiscard]] bool given_up_whole(std::uint32_t ps) const;

  /// Takes member ps `ps` back into a job whose ps tasks keep copies of each other's shards,
  /// after it was lost and a process was started in its place (beyond TensorFlow; a
  /// CopyingTransport). The new process is reached first (one attempt: false while none is
  /// there, the job going on as it was). Then every ps is paused and read at one cut, from the
  /// copies that served meanwhile (dense parts, slots and counters, table rows, the sync
  /// policy's state); the new process's copies serve again, the model is registered over
  /// the same members at a membership one newer, and every ps, both copies of every
  /// shard, is restored from the cut. No update is lost: training stands still from the
  /// cut to the end of the restore; the workers, the evaluator and every heartbeat follow
  /// when they learn the membership (their transports' `renew_copies`), before their first
  /// request of the new epoch. Every shard has two copies again, so the job survives the
  /// next lost ps without a rollback. `sharding`: the ps tasks' IdSharding.
  ///
  /// True once taken back. False (logged) when the cut fails (the ps tasks go on as they
  /// were), or when its registration or restore fails: its copies are given up again and
  /// the others go on as they were (resumed, or restored from the same cut at a membership
  /// and epoch newer still: move_state). Throws kUnavailable when a ps was lost on the way
  /// (roll them back).
  template <IdSharding I = HashIds>
  bool take_back(std::uint32_t ps, const I& sharding = {});

  /// Makes both copies of every shard alike again, in a job whose ps tasks keep copies of
  /// each other's shards (beyond TensorFlow; a CopyingTransport). Each copy judges the
  /// workers on its own clock, so the two may part where a worker was lost: a push it sent
  /// just before it died (or was cut off from one ps) can reach one copy only, which counts
  /// it in its step while the other completes the step without it. Every ps is paused and
  /// read at one cut, from the copies the tasks read (each shard's own, unless given up),
  /// the model is registered over the same members at a membership one newer, and both
  /// copies of every shard are restored from the cut, as `take_back` does; training stands
  /// still from the cut to the end of the restore, and nothing the tasks read changes.
  /// `sharding`: the ps tasks' IdSharding.
  ///
  /// True once done; false (logged) without copies, or when the cut or the restore failed
  /// (the ps tasks go on as they were, or restored from the same cut: move_state). Throws
  /// kUnavailable when a ps was lost on the way (roll them back).
  template <IdSharding I = HashIds>
  bool align_copies(const I& sharding = {});

  /// Takes member ps `ps` out of the job with its share moved to the other members (it
  /// asked to leave: the operator scaled the job down). Every ps is paused and read at one
  /// cut (as `join` reads it), the model is registered over the other members at a
  /// membership one newer (the part placement rebalanced over them, rows where the
  /// IdSharding puts them over them), and they are restored from the cut. Nothing trained
  /// is lost: training stands still from the cut to the end of the restore, and the
  /// workers follow when they get ready again. `ps` stays paused (what is sent to it waits
  /// there, never taken) until it ends; with copies (a CopyingTransport) the copy it held
  /// of another's shard moves to the member after it (copy_holder), and the copy of its
  /// own shard that the member after it held is let go. `sharding`: the ps tasks' IdSharding.
  ///
  /// Throws, with the job as it was: kInvalidArgument for a ps that is no member;
  /// kFailedPrecondition for the job's last ps, for tables whose IdSharding places rows
  /// over ps tasks 0 .. n-1 only and a ps that is not the last (nothing is cut), or when
  /// the others refuse the registration or the restore (with copies, also when fewer than
  /// 2 members would be left: the transport refuses to place the copies, after the cut):
  /// then every member, `ps` among them, is resumed or restored from the same cut at a
  /// membership newer still. Throws kUnavailable
  /// when a ps was lost on the way and that restore failed too (roll them back).
  template <IdSharding I = HashIds>
  void retire(std::uint32_t ps, const I& sharding = {});

  /// The job's workers are `workers` (task indices, ascending, not empty) from the next
  /// global step on: workers joined (a worker started beyond the cluster spec's asks the
  /// chief, runner/join_desk.hpp) or left for good. Every member ps is paused at once (no
  /// step completes meanwhile), the step after the furthest one a ps reached or took a push
  /// for is chosen (under BoundedStaleness a worker pushes up to s steps ahead), and each ps
  /// is told (ChangeWorkers) and resumed: each counts the new workers from that step on
  /// (SyncPolicy::reshape; under SyncReplicas every ps at the same step boundary), and lets
  /// a new worker connect at once. Nothing is read or moved: training stands still for a few
  /// round trips. Restores from then on (a rollback, a ps joining) carry the workers.
  /// Returns the step they count from.
  ///
  /// Throws, the ps tasks counting the workers as before: kInvalidArgument for an empty or
  /// unordered set; the refusal of a ps that cannot (kFailedPrecondition: its sync policy
  /// has no SyncPolicy::reshape), the others taking the change back. Throws kUnavailable
  /// when a ps was lost on the way, or one that took the change cannot be told to take it
  /// back: it may then count the new workers from that step alone, until the next change
  /// (the ChiefLoop tries again) or a restore (which carries the workers) sets them all.
  std::int64_t change_workers(std::vector<std::uint32_t> workers);

  /// The workers some member ps holds lost now (their heartbeats stopped), ascending. Each
  /// ps is asked alone; one that does not answer within `timeout` (stopped, or gone: the
  /// chief learns that elsewhere) says nothing. With `all_answered`, whether every member
  /// answered.
  [[nodiscard]] std::vector<std::uint32_t> lost_workers(
      std::chrono::milliseconds timeout = std::chrono::seconds(2), bool* all_answered = nullptr);

  /// Takes `workers` (ascending) as the job's, before this chief hears the ps tasks (the
  /// cluster spec's): restores carry them, and the ps tasks' own word replaces them
  /// (`ps_serving`). An empty list changes nothing.
  void set_workers(std::vector<std::uint32_t> workers) { client_.set_workers(std::move(workers)); }

  /// The job's workers, once they changed (change_workers, or as the ps tasks said when
  /// this chief took over); empty while they are the cluster spec's.
  [[nodiscard]] std::span<const std::uint32_t> workers() const noexcept { return client_.workers(); }

  /// The task index a `join(address)` takes now: the next one (`num_ps()`), or the last
  /// one known when it has that address and is no member (a join tried again after a ps
  /// was lost on the way).
  [[nodiscard]] std::size_t join_index(const std::string& address) const;

  /// The ps tasks the job has known, members or not: the cluster spec's, and those that
  /// joined since (the next to join gets this index).
  [[nodiscard]] std::size_t num_ps() const { return client_.num_ps(); }
  /// Where each of them serves, by task index (`GrowingTransport::address`).
  [[nodiscard]] std::vector<std::string> ps_addresses() const;

  /// The job's ps tasks (ascending) and their version (Client::members).
  [[nodiscard]] std::span<const std::uint32_t> members() const noexcept { return client_.members(); }
  [[nodiscard]] std::uint64_t membership() const noexcept { return client_.membership(); }

  /// Where each variable lives, after `initialize`.
  [[nodiscard]] const Placement& placement() const noexcept { return client_.placement(); }
  /// The registered variables, after `initialize`.
  [[nodiscard]] const std::vector<VariableSpec>& variables() const noexcept {
    return client_.variables();
  }

 private:
  /// Every ps paused and read at one cut, and left paused (a take-back's or an alignment's
  /// move follows); resumed if the cut fails: nullopt then, logged as "chief: `what`, the
  /// cut failed: ...". Throws kUnavailable when a ps was lost (roll them back).
  std::optional<ModelState> paused_cut(const std::string& what);

  /// Moves the state of the paused ps tasks, read at `cut`, to `members`: the model
  /// registered over them at a membership one newer (reaching `addresses` first), then
  /// every member restored from the cut (a join's, a leave's or a take-back's move). Returns
  /// nullopt once done, else why not, with nothing lost: a registration that failed leaves
  /// the ps tasks as they were (resumed); a restore that failed is followed by the members
  /// `before` taking the same cut back at a membership and epoch newer still (what the first
  /// restore began is refused as late). `undo(error)` runs first on either failure (a
  /// take-back gives the copies it served again up). Throws kUnavailable when that restore
  /// fails too (a ps lost: roll them back).
  template <IdSharding I, class Undo = void (*)(const Error&)>
  std::optional<Error> move_state(
      const ModelState& cut, std::vector<std::uint32_t> members,
      const std::vector<std::uint32_t>& before, const std::vector<std::string>& addresses,
      const I& sharding, Undo undo = [](const Error&) {});

  [[nodiscard]] const ClientOptions& timeouts() const { return client_.options(); }

  /// `request` to ps task `ps` alone, its answer awaited until `timeout` passes (then the
  /// call is given up, and the answer is kDeadlineExceeded).
  Response ask_one(std::uint32_t ps, Request request, std::chrono::milliseconds timeout);

  /// Every variable filled by its initializer, from the job's seed.
  std::vector<std::vector<float>> initial_values(std::span<const VariableSpec> variables) const;

  /// Registers the model and sends each ps its parts' values (`hold`: see Initialize::hold).
  const Placement& send_initial(std::span<const VariableSpec> variables,
                                std::span<const std::vector<float>> values,
                                std::span<const TableSpec> tables, bool hold);

  /// Resumes every ps that answers (after a failed `initialize_and_save`).
  void resume_all() noexcept;

  /// Tells every member ps `message`, each answer awaited for `request_timeout` (else
  /// kDeadlineExceeded is thrown, as any refusal is). Shutdown (not an abort: that is told
  /// once) is sent again to a ps whose link broke on the way, every kEndRetry for
  /// kEndPatience: a ps that took it already answers that training finished. One that
  /// still refuses connections then is named in a warning, not thrown: it may have taken
  /// the message and stopped (a ps that ended takes connections for its end grace after
  /// its last client left: TcpServerOptions::end_grace), and one that did not fails on
  /// its own once it hears nothing from the chief.
  void end(const Shutdown& message);

  /// How long `end` sends Shutdown again to a ps whose link broke (a ps that ended takes
  /// connections for its end grace, 1 s by default, and a connection attempt may take
  /// TcpOptions::attempt_timeout), and how often.
  static constexpr std::chrono::milliseconds kEndPatience{std::chrono::seconds(4)};
  static constexpr std::chrono::milliseconds kEndRetry{100};

  std::uint64_t seed_;
  Client<T> client_;
  /// A join that added its ps task and was cut short by a lost ps: its index and address.
  std::optional<std::pair<std::uint32_t, std::string>> unfinished_join_;
};

}  // namespace pulley

// Chief's member functions' definitions, by concern.
// ---- begin pulley/client/impl/chief_membership.hpp ----

/// Chief's handling of the job's shape (declared in client/chief.hpp, which includes this
/// header after the class): ps tasks that cannot be reached, leave, join, are taken back or
/// retire (unreachable, leave, join, given_up, take_back, retire), the copies of every shard
/// made alike (align_copies), the job's workers changed or lost (change_workers,
/// lost_workers), where the ps tasks serve (join_index, ps_addresses), and the cut and
/// move of the state that those changes share (paused_cut, move_state, ask_one).

namespace pulley {

template <Transport T>
std::vector<std::uint32_t> Chief<T>::unreachable(std::chrono::milliseconds timeout) {
  const auto answers = client_.ask_each(timeout);
  std::vector<std::uint32_t> gone;
  for (std::size_t k = 0; k < answers.size(); ++k) {
    if (!answers[k]) gone.push_back(client_.members()[k]);
  }
  return gone;
}

template <Transport T>
void Chief<T>::leave(std::span<const std::uint32_t> gone) {
  const auto members = client_.members();
  for (const std::uint32_t ps : gone) {
    if (!std::binary_search(members.begin(), members.end(), ps)) {
      throw Error(ErrorCode::kInvalidArgument,
                  "ps " + std::to_string(ps) + " is not a member of the job");
    }
  }
  std::vector<std::uint32_t> left;
  std::copy_if(members.begin(), members.end(), std::back_inserter(left), [&](std::uint32_t ps) {
    return std::find(gone.begin(), gone.end(), ps) == gone.end();
  });
  if (left.empty())
    throw Error(ErrorCode::kInvalidArgument, "a job cannot go on without any ps task");
  client_.change_members(std::move(left), client_.membership() + 1);
}

template <Transport T>
template <IdSharding I>
std::uint32_t Chief<T>::join(const std::string& address, const I& sharding) {
  if constexpr (!GrowingTransport<T>) {
    throw Error(ErrorCode::kFailedPrecondition,
                "ps at " + address +
                    " cannot join: this chief's transport cannot reach ps tasks beyond those "
                    "it was made with (not a GrowingTransport)");
  } else {
    if (!client_.has_placement()) {
      throw Error(ErrorCode::kFailedPrecondition,
                  "a ps joins a job whose model is registered: initialize first");
    }
    T& transport = client_.transport();
    const std::vector<std::uint32_t> before(client_.members().begin(), client_.members().end());
    const auto task = static_cast<std::uint32_t>(join_index(address));
    if (task == transport.num_ps()) {
      try {
        transport.add_ps(address, true);
      } catch (const Error& e) {  // nothing changed: not a lost ps of the job
        throw Error(ErrorCode::kFailedPrecondition,
                    "ps at " + address + " cannot join: " + e.message());
      }
    }
    unfinished_join_.emplace(task, address);  // until it joined, or was told to end
    const std::string who = "ps " + std::to_string(task) + " at " + address;
    const auto refuse = [&](const std::string& why) {  // the new ps ends, saying why
      unfinished_join_.reset();
      (void)ask_one(task, Shutdown{true, who + " could not join the job: " + why},
                    std::chrono::seconds(2));
      return Error(ErrorCode::kFailedPrecondition,
                   who + " cannot join: " + why + "; the job goes on as it was");
    };
    {
      const Response answer = ask_one(task, GetStats{}, timeouts().request_timeout);
      const auto* stats = std::get_if<StatsReply>(&answer);
      if (const auto* error = std::get_if<ErrorReply>(&answer))
        throw refuse("it answered: " + error->message);
      if (stats == nullptr) throw refuse("it answered GetStats with something else");
      if (stats->ready || !stats->members.empty())
        throw refuse("it holds a model already (another job's?)");
    }
    std::vector<std::string> addresses;
    for (std::uint32_t ps = 0; ps <= task; ++ps) addresses.push_back(transport.address(ps));
    std::vector<std::uint32_t> members = before;
    members.push_back(task);
    std::optional<ModelState> cut;
    try {
      cut = read_state(client_, 0, {}, true);  // the ps tasks stay paused (resumed if it throws)
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kUnavailable) throw;  // a ps of the job lost: tried again after
      throw refuse(std::string("the cut failed: ") + e.message());
    }
    std::optional<Error> failed;
    try {
      failed = move_state(*cut, std::move(members), before, addresses, sharding);
    } catch (const Error& e) {
      (void)refuse(e.message());
      throw Error(ErrorCode::kUnavailable, who + " was registered: " + e.message());
    }
    if (failed) throw refuse(failed->message());
    unfinished_join_.reset();
    return task;
  }
}

template <Transport T>
std::vector<std::uint32_t> Chief<T>::given_up() const {
  if constexpr (CopyingTransport<T>) {
    std::vector<std::uint32_t> members;
    for (const std::uint32_t ps : client_.transport().given_up()) {
      if (std::binary_search(client_.members().begin(), client_.members().end(), ps))
        members.push_back(ps);
    }
    return members;
  } else {
    return {};
  }
}

template <Transport T>
bool Chief<T>::given_up_whole(std::uint32_t ps) const {
  if constexpr (requires(const T& t) {
                  { t.given_up_whole(std::uint32_t{}) } -> std::convertible_to<bool>;
                }) {
    return client_.transport().given_up_whole(ps);
  } else {
    (void)ps;
    return false;
  }
}

template <Transport T>
template <IdSharding I>
bool Chief<T>::take_back(std::uint32_t ps, const I& sharding) {
  if constexpr (!CopyingTransport<T>) {
    (void)ps;
    (void)sharding;
    return false;
  } else {
    T& transport = client_.transport();
    if (!transport.reach_again(ps, false, true)) return false;
    const std::string who = "ps " + std::to_string(ps);
    const std::vector<std::uint32_t> members(client_.members().begin(), client_.members().end());
    const std::optional<ModelState> cut = paused_cut(who + " cannot take its shards back yet");
    if (!cut) return false;
    transport.serve_again(ps);
    const std::optional<Error> failed =
        move_state(*cut, members, members, {}, sharding, [&](const Error& e) {
          transport.give_up(ps, std::string("taking it back failed: ") + e.message());
        });
    const std::vector<std::uint32_t> still = transport.given_up();
    if (!failed && !std::binary_search(still.begin(), still.end(), ps)) return true;
    // A copy it holds was given up again on the way (lost, or not ready in time): the
    // restore went to the other copies alone.
    log(LogLevel::kWarning,
        "chief: " + who + " could not take its shards back (" +
            (failed ? std::string(failed->message()) : "a copy it holds was given up on the way") +
            "): they stay served by one copy each");
    return false;
  }
}

template <Transport T>
template <IdSharding I>
bool Chief<T>::align_copies(const I& sharding) {
  if constexpr (!CopyingTransport<T>) {
    (void)sharding;
    return false;
  } else {
    const std::vector<std::uint32_t> members(client_.members().begin(), client_.members().end());
    const std::optional<ModelState> cut = paused_cut("cannot make the copies of every shard alike");
    if (!cut) return false;
    if (const std::optional<Error> failed = move_state(*cut, members, members, {}, sharding)) {
      log(LogLevel::kWarning,
          std::string("chief: could not make the copies of every shard alike: ") +
              failed->message());
      return false;
    }
    return true;
  }
}

template <Transport T>
template <IdSharding I>
void Chief<T>::retire(std::uint32_t ps, const I& sharding) {
  const std::vector<std::uint32_t> before(client_.members().begin(), client_.members().end());
  if (!std::binary_search(before.begin(), before.end(), ps)) {
    throw Error(ErrorCode::kInvalidArgument,
                "ps " + std::to_string(ps) + " is not a member of the job");
  }
  const std::string who = "ps " + std::to_string(ps);
  if (before.size() == 1)
    throw Error(ErrorCode::kFailedPrecondition,
                who + " is the job's last ps task: it cannot leave");
  std::vector<std::uint32_t> after;
  std::copy_if(before.begin(), before.end(), std::back_inserter(after),
               [ps](std::uint32_t m) { return m != ps; });
  if constexpr (!ElasticIdSharding<I>) {
    if (!client_.tables().empty() && !first_tasks(after)) {
      throw Error(
          ErrorCode::kFailedPrecondition,
          who +
              " cannot leave: the tables' IdSharding places rows over ps tasks 0 .. n-1 only (an "
              "ElasticIdSharding, HashIds or RangeIds, can place them over the others)");
    }
  }
  const ModelState cut =
      read_state(client_, 0, {}, true);  // the ps tasks stay paused (resumed if it throws)
  std::optional<Error> failed;
  try {
    failed = move_state(cut, std::move(after), before, {}, sharding);
  } catch (const Error& e) {
    throw Error(ErrorCode::kUnavailable, who + " could not leave: " + e.message());
  }
  if (failed) {
    throw Error(ErrorCode::kFailedPrecondition,
                who + " cannot leave: " + failed->message() + "; the job goes on as it was");
  }
}

template <Transport T>
std::int64_t Chief<T>::change_workers(std::vector<std::uint32_t> workers) {
  require_task_set(workers, "worker");
  const std::span<const std::uint32_t> members = client_.members();
  std::int64_t furthest = 0;
  try {
    const auto paused = client_.template broadcast<PauseReply>(
        [](std::size_t) { return Pause{0}; }, timeouts().request_timeout, "pause the ps tasks");
    for (const PauseReply& p : paused)
      furthest = std::max({furthest, p.global_step, p.furthest_pushed});
    const std::int64_t from = furthest + 1;
    const std::vector<std::uint32_t> before(client_.workers().begin(), client_.workers().end());
    // Each ps is asked alone: every answer is looked at. One that refused is told to take
    // the change back too: with no answer in time it may have taken it (the change is
    // given up as a lost ps's would be, and tried again), and with copies one copy may
    // have taken what the other refused. Taking back a change never taken changes nothing.
    std::vector<std::uint32_t> took;
    std::optional<Error> refused;
    for (const std::uint32_t ps : members) {
      const Response answer =
          ask_one(ps, ChangeWorkers{workers, from, before}, timeouts().request_timeout);
      took.push_back(ps);
      if (std::holds_alternative<Ack>(answer)) continue;
      const auto* error = std::get_if<ErrorReply>(&answer);
      const ErrorCode code = error != nullptr ? error->code : ErrorCode::kInternal;
      refused.emplace(
          code == ErrorCode::kDeadlineExceeded ? ErrorCode::kUnavailable : code,
          "ps " + std::to_string(ps) + " cannot count the workers " + describe_members(workers) +
              ": " +
              (error != nullptr ? error->message : std::string("it answered something else")));
      break;
    }
    if (refused) {  // those that took it take it back, before anyone trains on
      for (const std::uint32_t ps : took) {
        if (!std::holds_alternative<Ack>(
                ask_one(ps, ChangeWorkers{{}, from}, timeouts().request_timeout))) {
          throw Error(ErrorCode::kUnavailable,
                      std::string(refused->message()) + "; and ps " + std::to_string(ps) +
                          ", which took the change, could not be told to take it back");
        }
      }
      throw *refused;
    }
    client_.template broadcast<Ack>([](std::size_t) { return Resume{}; },
                                    timeouts().request_timeout, "resume the ps tasks");
    client_.set_workers(std::move(workers));
    return from;
  } catch (const Error&) {
    resume_all();  // a ps that is gone resumes when the chief's link closes
    throw;
  }
}

template <Transport T>
std::vector<std::uint32_t> Chief<T>::lost_workers(std::chrono::milliseconds timeout,
                                                  bool* all_answered) {
  std::vector<std::uint32_t> lost;
  bool all = true;
  for (const std::optional<StatsReply>& r :
       client_.ask_each(std::min(timeouts().request_timeout, timeout))) {
    if (r) {
      lost.insert(lost.end(), r->lost.begin(), r->lost.end());
    } else {
      all = false;
    }
  }
  if (all_answered != nullptr) *all_answered = all;
  std::sort(lost.begin(), lost.end());
  lost.erase(std::unique(lost.begin(), lost.end()), lost.end());
  return lost;
}

template <Transport T>
std::size_t Chief<T>::join_index(const std::string& address) const {
  if (unfinished_join_ && unfinished_join_->second == address) return unfinished_join_->first;
  return client_.num_ps();
}

template <Transport T>
std::vector<std::string> Chief<T>::ps_addresses() const {
  std::vector<std::string> addresses;
  for (std::size_t ps = 0; ps < client_.num_ps(); ++ps)
    addresses.push_back(client_.transport().address(ps));
  return addresses;
}

template <Transport T>
std::optional<ModelState> Chief<T>::paused_cut(const std::string& what) {
  try {
    return read_state(client_, 0, {}, true);
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kUnavailable) throw;
    log(LogLevel::kWarning, "chief: " + what + ", the cut failed: " + e.message());
    return std::nullopt;
  }
}

template <Transport T>
template <IdSharding I, class Undo>
std::optional<Error> Chief<T>::move_state(const ModelState& cut, std::vector<std::uint32_t> members,
                                          const std::vector<std::uint32_t>& before,
                                          const std::vector<std::string>& addresses,
                                          const I& sharding, Undo undo) {
  try {
    client_.change_members(std::move(members), client_.membership() + 1, addresses);
  } catch (const Error& e) {
    undo(e);
    resume_all();
    return e;
  }
  try {
    restore_state(client_, cut, seed_, sharding);
    return std::nullopt;
  } catch (const Error& e) {
    undo(e);
    try {
      client_.adopt_epoch(client_.epoch() + 1);
      client_.change_members(before, client_.membership() + 1, addresses);
      restore_state(client_, cut, seed_, sharding);
    } catch (const Error& again) {
      throw Error(ErrorCode::kUnavailable,
                  "its restore failed (" + std::string(e.message()) +
                      "), and so did restoring the ps tasks before: " + again.message());
    }
    return e;
  }
}

template <Transport T>
Response Chief<T>::ask_one(std::uint32_t ps, Request request, std::chrono::milliseconds timeout) {
  PendingCall call = client_.transport().call(ps, std::move(request), {});
  if (call.wait_until(std::chrono::steady_clock::now() + timeout)) return call.take();
  call.cancel();
  return ErrorReply{ErrorCode::kDeadlineExceeded,
                    "no answer within " + std::to_string(timeout.count()) + " ms"};
}

}  // namespace pulley
// ---- end pulley/client/impl/chief_membership.hpp ----
// ---- begin pulley/client/impl/chief_state.hpp ----

/// Chief's state as it is set, taken over and ended (declared in client/chief.hpp, which
/// includes this header after the class): the first values sent and read back
/// (initialize_and_save, initial_values, send_initial), a lost chief's job taken over
/// (ps_serving, adopt), and the end of training (end, resume_all).

namespace pulley {

template <Transport T>
ModelState Chief<T>::initialize_and_save(std::span<const VariableSpec> variables,
                                         std::span<const TableSpec> tables) {
  try {
    send_initial(variables, initial_values(variables), tables, true);
  } catch (const Error&) {
    resume_all();  // the ps tasks that were initialized, and so paused, go on
    throw;
  }
  return read_state(client_);  // resumes every ps, whatever happens
}

template <Transport T>
bool Chief<T>::ps_serving() {
  try {
    (void)client_.learn_membership();  // a ps its predecessor let go is not waited for
    const auto replies = client_.template broadcast<StatsReply>(
        [](std::size_t) { return GetStats{}; }, timeouts().request_timeout, "look at the ps tasks");
    for (const StatsReply& r : replies)
      client_.set_workers(r.workers);  // as its predecessor left them
    return std::all_of(replies.begin(), replies.end(), [&](const StatsReply& r) {
      return r.ready && r.epoch == replies.front().epoch;
    });
  } catch (const Error&) {
    return false;
  }
}

template <Transport T>
std::int64_t Chief<T>::adopt(std::span<const VariableSpec> variables,
                             std::span<const TableSpec> tables) {
  client_.wait_ready(variables, tables);
  return client_.wait_for_step(0);
}

template <Transport T>
std::vector<std::vector<float>> Chief<T>::initial_values(
    std::span<const VariableSpec> variables) const {
  std::vector<std::vector<float>> values;
  values.reserve(variables.size());
  for (const VariableSpec& spec : variables) {
    values.emplace_back(spec.size());
    pulley::initialize(spec, seed_, values.back());
  }
  return values;
}

template <Transport T>
const Placement& Chief<T>::send_initial(std::span<const VariableSpec> variables,
                                        std::span<const std::vector<float>> values,
                                        std::span<const TableSpec> tables, bool hold) {
  if (values.size() != variables.size()) {
    throw Error(ErrorCode::kInvalidArgument, "initialize needs one value vector per variable");
  }
  for (std::size_t v = 0; v < variables.size(); ++v) {
    if (values[v].size() != variables[v].size()) {
      throw Error(ErrorCode::kInvalidArgument, "initial value of '" + variables[v].name + "' has " +
                                                   std::to_string(values[v].size()) +
                                                   " elements, expected " +
                                                   std::to_string(variables[v].size()));
    }
    if (!detail::all_finite(values[v])) {
      throw Error(ErrorCode::kInvalidArgument,
                  "initial value of '" + variables[v].name + "' is not finite (NaN or Inf)");
    }
  }
  client_.register_model(variables, tables, seed_);
  const Placement& placement = client_.placement();
  std::vector<Initialize> messages(client_.num_ps());
  for (Initialize& m : messages) m.hold = hold;
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

template <Transport T>
void Chief<T>::resume_all() noexcept {
  try {
    client_.template broadcast<Ack>([](std::size_t) { return Resume{}; },
                                    timeouts().request_timeout, "resume the ps tasks");
  } catch (const Error&) {  // a ps that is gone resumes when the chief's link closes
  }
}

template <Transport T>
void Chief<T>::end(const Shutdown& message) {
  using Clock = std::chrono::steady_clock;
  const auto answer_by = Clock::now() + timeouts().request_timeout;
  const auto retry_until = Clock::now() + std::min(timeouts().request_timeout, kEndPatience);
  // What a ps that ended already answers: finished, or (to an abort) either end.
  const auto ended = [&](ErrorCode code) {
    return code == ErrorCode::kOutOfRange || (message.aborted && code == ErrorCode::kAborted);
  };
  std::vector<std::uint32_t> left(client_.members().begin(), client_.members().end());
  std::vector<std::string> why;
  while (!left.empty()) {
    std::vector<PendingCall> calls;
    for (const std::uint32_t ps : left)
      calls.push_back(client_.transport().call(ps, Request{message}, {}));
    std::vector<std::uint32_t> again;
    why.clear();
    for (std::size_t k = 0; k < calls.size(); ++k) {
      const std::string ps = "ps " + std::to_string(left[k]);
      if (!calls[k].wait_until(answer_by)) {
        calls[k].cancel();
        throw Error(ErrorCode::kDeadlineExceeded,
                    "shutdown: " + ps + ": no answer within " +
                        std::to_string(timeouts().request_timeout.count()) + " ms");
      }
      const Response answer = calls[k].take();
      const auto* error = std::get_if<ErrorReply>(&answer);
      if (error == nullptr || ended(error->code)) continue;
      if (error->code != ErrorCode::kUnavailable)
        throw Error(error->code, "shutdown: " + ps + ": " + error->message);
      again.push_back(left[k]);
      why.push_back(ps + ": " + error->message);
    }
    left = std::move(again);
    if (left.empty() || message.aborted || Clock::now() + kEndRetry >= retry_until) break;
    std::this_thread::sleep_for(kEndRetry);
  }
  if (!left.empty()) {
    std::string reasons;
    for (const std::string& w : why) reasons += (reasons.empty() ? "" : "; ") + w;
    log(LogLevel::kWarning, "chief: the ps tasks " + describe_members(left) +
                                " could not be told that training " +
                                (message.aborted ? "was aborted" : "finished") + " (" + reasons +
                                "): each ended with its answer lost, or is gone");
  }
  // A ps that left the job and lives on (cut off for a while, or started again) ends too.
  client_.tell_others(Request{message},
                      std::min(timeouts().request_timeout, std::chrono::milliseconds(2000)));
}

}  // namespace pulley
// ---- end pulley/client/impl/chief_state.hpp ----
// ---- end pulley/client/chief.hpp ----
// ---- begin pulley/client/dense_on_ring.hpp ----

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace pulley {

/// The hybrid of the two architectures of seed 004, as recommender systems train (PERSIA,
/// HugeCTR, TorchRec): a TableModel's embedding tables stay on the ps tasks, its dense
/// variables are all-reduced among the workers. DenseOnRing wraps the model a `Worker`
/// trains: to the ps tasks it is a TableModel with the same tables and no dense variables,
/// so the ps tasks hold, pull and push rows only; inside `compute_gradients` it runs the
/// wrapped model's, sums the dense gradients with every other worker's on the ring and
/// applies their mean with its own optimizer (`AllReduceWorker`), while the rows'
/// gradients go to the ps tasks in the worker's push, as they would without it.
///
/// Every worker of the job wraps its model over a link of one ring (rank = its place in
/// it), and every worker calls `compute_gradients` once a step, the same number of times:
/// sync training with R = N (SyncReplicas::kEveryWorker), where each global step is every
/// worker's step. The dense replicas start from rank 0's (`initialize(seed)`, or `restore`
/// on one rank and `synchronize` from it) on the first step and stay bit-identical.
///
/// @tparam M the TableModel (owned)
/// @tparam O the optimizer of the dense variables (the tables' is the ps tasks')
/// @tparam R the Ring linking the workers (owned)
template <TableModel M, Optimizer O, Ring R>
class DenseOnRing {
 public:
  using Batch = typename M::Batch;
  /// `compute_gradients` applies the dense step: a Worker never computes a step twice
  /// (where it would, it fails with kAborted instead of applying it again).
  static constexpr bool kAppliesWhenComputed = true;

  /// @param seed the dense variables' initial values are rank 0's from this seed, unless
  ///   `dense().restore` or `dense().synchronize` ran first on every rank
  DenseOnRing(M model, O optimizer, R ring, std::uint64_t seed,
              std::size_t segment = RingAllReduce::kDefaultSegment)
      : dense_(std::move(model), std::move(optimizer), std::move(ring), segment), seed_(seed) {}

  /// None: the dense variables are not the ps tasks'.
  [[nodiscard]] std::span<const VariableSpec> variables() const { return {}; }
  /// There is no variable `i` (`variables()` is empty): throws std::out_of_range.
  std::span<float> parameter(std::size_t i) { throw std::out_of_range(no_variable(i)); }
  /// There is no variable `i` (`variables()` is empty): throws std::out_of_range.
  [[nodiscard]] std::span<const float> gradient(std::size_t i) const { throw std::out_of_range(no_variable(i)); }

  /// The wrapped model's tables.
  [[nodiscard]] std::span<const TableSpec> tables() const { return dense_.model().tables(); }
  /// The wrapped model's lookup.
  void lookup(const Batch& batch, std::size_t table, std::vector<std::uint64_t>& ids) const {
    dense_.model().lookup(batch, table, ids);
  }

  /// One step of the wrapped model on `batch`: the rows' gradients into `tables`, the dense
  /// variables updated by the mean of every worker's gradient. Returns the mean of every
  /// worker's batch loss. The first call starts the replicas (`initialize(seed)`) unless
  /// they were started. Throws what the ring throws when a worker is lost.
  float compute_gradients(const Batch& batch, std::span<const TableBatch> tables) {
    try {
      if (!started_) start();
      last_ = dense_.step(batch, tables);
    } catch (const Error& e) {
      // Not kUnavailable: a Worker would take it for a lost ps and compute the step again.
      throw Error(ErrorCode::kAborted, std::string("the ring of the dense variables failed: ") + e.what());
    }
    return last_.loss;
  }

  /// Starts the replicas, on every rank at the same point: from rank 0's initial values,
  /// or from rank `start_from`'s replica; the first `compute_gradients` calls it if nothing did.
  void start() {
    if (started_) return;
    if (source_) {
      dense_.synchronize(*source_);
    } else {
      dense_.initialize(seed_);
    }
    started_ = true;
  }
  /// The replicas start from rank `root`'s, which its owner started (the chief's follower
  /// in a hybrid job: initialized from the seed or restored from a checkpoint), instead
  /// of from rank 0's initial values.
  DenseOnRing& start_from(std::size_t root) {
    source_ = root;
    return *this;
  }
  /// The replicas were started otherwise (every rank restored, or synchronized from one):
  /// the first step starts from them.
  void started() noexcept { started_ = true; }

  /// The all-reduce worker holding the dense replica: the model (`dense().model()`), the
  /// optimizer's state, the step count, checkpoints of the dense part (`state`, `restore`).
  [[nodiscard]] AllReduceWorker<M, O, R>& dense() noexcept { return dense_; }
  [[nodiscard]] const AllReduceWorker<M, O, R>& dense() const noexcept { return dense_; }
  /// What the last step did (`applied` false: its mean dense gradient was not finite and no
  /// worker applied it; the rows' gradients went to the ps tasks all the same).
  [[nodiscard]] const AllReduceStep& last_step() const noexcept { return last_; }

 private:
  static std::string no_variable(std::size_t i) {
    return "DenseOnRing holds no ps variable " + std::to_string(i) + ": its dense variables are all-reduced";
  }

  AllReduceWorker<M, O, R> dense_;
  std::uint64_t seed_;
  std::optional<std::size_t> source_;  ///< start_from's root
  bool started_ = false;
  AllReduceStep last_;
};

}  // namespace pulley
// ---- end pulley/client/dense_on_ring.hpp ----
// ---- begin pulley/client/evaluator.hpp ----

#include <cstdint>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

namespace pulley {

/// The evaluator task: follows training without taking part in it. It waits for the chief's
/// initialization, then reads parameter snapshots at chosen global steps to score on
/// held-out data. It takes no tokens and pushes nothing, so it never slows a sync step.
/// When the chief ends training, its calls throw `kOutOfRange`.
///
/// @tparam T the Transport that reaches the ps tasks
template <Transport T>
class Evaluator {
 public:
  /// @param transport reaches the ps tasks
  /// @param options   its calls' deadlines
  explicit Evaluator(T transport, ClientOptions options = {})
      : client_(std::move(transport), options) {}

  /// Blocks until the chief has initialized every ps and checks that `variables` (the
  /// evaluator's model) are the registered ones.
  void wait_ready(std::span<const VariableSpec> variables) { client_.wait_ready(variables); }

  /// Blocks until every ps has completed `step` global steps; returns the lowest global
  /// step they report.
  std::int64_t wait_for_step(std::int64_t step) { return client_.wait_for_step(step); }

  /// Every variable at one global step of at least `step`, the same on every ps (see
  /// Snapshot); waits until the ps tasks reach it.
  Snapshot snapshot(std::int64_t step) { return pulley::snapshot(client_, step); }

  /// Current values of every variable, one vector per variable, as each ps holds them now.
  std::vector<std::vector<float>> read_variables() { return pulley::read_variables(client_); }

  /// The current rows `ids` of embedding table `table` (ids.size() × dim floats, in
  /// order) under id sharding `sharding` (the ps tasks'); see pulley::read_rows. A row not
  /// held reads as its initial value; reading creates and touches nothing.
  template <IdSharding I = HashIds>
  std::vector<float> read_rows(std::string_view table, std::span<const std::uint64_t> ids,
                               I sharding = {}) {
    return pulley::read_rows(client_, table, ids, std::move(sharding));
  }

  /// Counters of every member ps, in member order (Client::stats).
  std::vector<Stats> stats() { return client_.stats(); }
  /// Blocks until the chief ends training (Client::wait_for_end).
  void wait_for_end() { client_.wait_for_end(); }

 private:
  Client<T> client_;
};

}  // namespace pulley
// ---- end pulley/client/evaluator.hpp ----
// ---- begin pulley/client/heartbeat.hpp ----

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

namespace pulley {

/// What the heartbeats of a HeartbeatSender brought back.
struct HeartbeatReplies {
  /// The counters each ps task answered with, by task index (nullopt: not heard yet, or no
  /// member of the job any more); a ps that did not answer the last beat keeps its earlier
  /// ones.
  std::vector<std::optional<Stats>> stats;
  /// When the last beat that a ps task answered was sent (the clock's epoch before any was).
  std::chrono::steady_clock::time_point at;
};

/// A worker's heartbeats (or the chief's: the ps tasks then wait for a lost chief to come
/// back, and end training as aborted when none does): while it lives, a thread of its own sends `Heartbeat` to every ps
/// task every `interval`, over a transport of its own (so a worker blocked on a token or
/// computing a long step still beats). A ps that heard it once and then hears nothing for
/// its worker timeout (`ParameterServer::set_worker_timeout`, default 5 s: keep `interval`
/// well below it) holds the worker lost, and the sync policy stops waiting for it; the
/// next heartbeat that arrives makes it count again. Destroying it says goodbye: the ps
/// tasks forget the worker instead of holding it lost once it is quiet; a worker that
/// failed calls `abandon` first, and is held lost.
///
/// It also tells the worker which others are lost (`lost`), so that a data source can
/// hand their share of the data to the workers that remain (runner/run.hpp's DataShard).
/// It beats the job's ps tasks: every ps task of the cluster until the replies name a
/// newer membership without some (a ps that left the job for good, Chief::leave).
///
///     HeartbeatSender beat(index, InProcess(network, Node::worker(index)));
///     Worker worker(index, model, InProcess(network, Node::worker(index)));
template <Transport T>
class HeartbeatSender {
 public:
  /// Starts beating at once, on its own thread, as worker `worker` (or as the task its
  /// transport names: the chief's is index 0); `who` names it in log lines ("worker 3").
  HeartbeatSender(std::uint32_t worker, T transport,
            std::chrono::milliseconds interval = std::chrono::seconds(1), std::string who = {})
      : worker_(worker), interval_(interval), transport_(std::move(transport)),
        who_(who.empty() ? "worker " + std::to_string(worker) : std::move(who)) {
    thread_ = std::thread([this] { beat(); });
  }

  HeartbeatSender(const HeartbeatSender&) = delete;
  HeartbeatSender& operator=(const HeartbeatSender&) = delete;

  /// Stops beating, after telling the ps tasks the worker leaves (best effort, one
  /// interval at most).
  ~HeartbeatSender() {
    {
      std::scoped_lock lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }

  /// Stops beating without the goodbye: the worker failed, and the ps tasks must hold it
  /// lost once its silence lasts (as a killed worker's), not forget it as one that ended
  /// normally (their sync policy would go on waiting for its pushes). Call it before the
  /// sender is destroyed on a failure path.
  void abandon() noexcept {
    {
      std::scoped_lock lock(mutex_);
      abandoned_ = stopping_ = true;
    }
    wake_.notify_all();
  }

  /// True if some ps task holds the chief lost, as of the last beat answered.
  [[nodiscard]] bool chief_lost() const {
    std::scoped_lock lock(mutex_);
    return chief_lost_;
  }

  /// The workers some ps task holds lost, as of the last beat answered, ascending.
  [[nodiscard]] std::vector<std::uint32_t> lost() const {
    std::scoped_lock lock(mutex_);
    return lost_;
  }

  /// The job's workers as the ps tasks last said, once workers joined or left, ascending;
  /// empty while they are the cluster spec's.
  [[nodiscard]] std::vector<std::uint32_t> workers() const {
    std::scoped_lock lock(mutex_);
    return workers_;
  }

  /// What the ps tasks answered the last beats with, and when the last answered beat was
  /// sent (one moment: both are read together).
  [[nodiscard]] HeartbeatReplies heard() const {
    std::scoped_lock lock(mutex_);
    return {stats_, heard_at_};
  }

  /// Beats that at least one ps task answered.
  [[nodiscard]] std::uint64_t beats() const {
    std::scoped_lock lock(mutex_);
    return beats_;
  }

 private:
  void beat() {
    std::unique_lock lock(mutex_);
    // The first beat goes out even when the worker failed before this thread ran (`abandon`
    // under load): a ps tracks a worker once it hears a beat, and one it never heard is never
    // held lost, so a sync policy would wait for its pushes for ever.
    for (bool first = true;; first = false) {
      if (abandoned_ && !first) return;
      const bool leaving = stopping_ && !abandoned_;
      lock.unlock();
      std::set<std::uint32_t> lost;
      bool chief_lost = false;
      std::vector<std::optional<Stats>> stats;
      std::vector<std::uint32_t> workers;
      const auto sent = std::chrono::steady_clock::now();
      const bool heard = send_all(leaving, lost, chief_lost, stats, workers);
      lock.lock();
      if (heard) heard_at_ = sent;
      stats_.resize(std::max(stats_.size(), stats.size()));
      for (std::size_t ps = 0; ps < stats.size(); ++ps) {
        if (stats[ps]) stats_[ps] = stats[ps];
        if (!member(static_cast<std::uint32_t>(ps))) stats_[ps].reset();  // left the job
      }
      if (heard) {
        lost_.assign(lost.begin(), lost.end());
        if (!workers.empty()) workers_ = std::move(workers);
        ++beats_;
        if (chief_lost != chief_lost_ && !leaving) {
          log(chief_lost ? LogLevel::kWarning : LogLevel::kInfo,
              who_ + (chief_lost ? ": the ps tasks hold the chief lost: they keep the model and wait for a chief "
                                "to come back"
                              : ": the chief is back"));
        }
        chief_lost_ = chief_lost;
      }
      if (leaving) return;
      wake_.wait_for(lock, interval_, [this] { return stopping_; });
    }
  }

  /// One Heartbeat to every ps, answered within an interval or given up; true if any
  /// answered. A ps that is down, or refuses, is simply not heard this time.
  bool send_all(bool leaving, std::set<std::uint32_t>& lost, bool& chief_lost,
                std::vector<std::optional<Stats>>& counters, std::vector<std::uint32_t>& workers) noexcept {
    try {
      std::vector<std::optional<PendingCall>> calls(transport_.num_ps());
      for (std::size_t ps = 0; ps < transport_.num_ps(); ++ps) {
        if (member(static_cast<std::uint32_t>(ps))) calls[ps].emplace(transport_.call(ps, Heartbeat{worker_, leaving}, {}));
      }
      const auto deadline = std::chrono::steady_clock::now() + interval_;
      bool heard = false;
      counters.resize(calls.size());
      for (std::size_t ps = 0; ps < calls.size(); ++ps) {
        if (!calls[ps]) continue;
        PendingCall& call = *calls[ps];
        if (!call.wait_until(deadline)) {
          call.cancel();
          continue;
        }
        const Response answer = call.take();
        if (const auto* stats = std::get_if<StatsReply>(&answer)) {
          heard = true;
          counters[ps] = stats->stats;
          lost.insert(stats->lost.begin(), stats->lost.end());
          chief_lost = chief_lost || stats->chief_lost;
          if (workers.empty()) workers = stats->workers;  // the first member's word
          if (!stats->members.empty() && stats->membership > membership_) {
            std::vector<std::uint32_t> before = members_;  // (none heard yet: every ps task)
            for (std::uint32_t k = 0; membership_ == 0 && k < transport_.num_ps(); ++k)
              before.push_back(k);
            reach_all(transport_, stats->ps_addresses);  // a ps that joined (throws: next beat)
            first_look_ = !membership_heard_;
            // (A take-back keeps the members: a ps that left or joined renews nothing.)
            if (stats->members == before || first_look_) renewals_left_ = kRenewals;
            members_ = stats->members;  // beaten from the next beat on
            membership_ = stats->membership;
            copies_placed_ = false;
          }
          membership_heard_ = true;
        }
      }
      // Copies that moved with the membership, after every answer is read (a link may move).
      if (!copies_placed_) {
        place_copies(transport_, members_);
        copies_placed_ = true;
      }
      // A ps the chief took back hears this task again: after every answer is read (it may
      // connect anew), and tried again at the next beats while it finds none to serve again.
      if (renewals_left_ > 0)
        renewals_left_ = renew_copies(transport_, first_look_) ? 0 : renewals_left_ - 1;
      return heard;
    } catch (...) {  // no memory, a transport that throws: try again next beat
      return false;
    }
  }

  /// True if ps task `ps` is a member of the job, as the replies last said.
  [[nodiscard]] bool member(std::uint32_t ps) const {
    return membership_ == 0 || std::binary_search(members_.begin(), members_.end(), ps);
  }

  std::uint32_t worker_;
  std::chrono::milliseconds interval_;
  std::vector<std::uint32_t> members_;  ///< the job's ps tasks (the beating thread's own)
  std::uint64_t membership_ = 0;        ///< their version: 0, every ps task of the cluster
  /// Beats left that renew copies given up (`renew_copies`) since the membership changed.
  static constexpr int kRenewals = 5;
  int renewals_left_ = 0;
  bool membership_heard_ = false;  ///< a ps told this sender the membership (Client's likewise)
  bool first_look_ = false;  ///< the renewals are of the first membership heard (renew_copies)
  bool copies_placed_ = true;  ///< place_copies took the membership heard last
  T transport_;
  std::string who_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  bool abandoned_ = false;  ///< stopping without the goodbye (`abandon`)
  std::vector<std::uint32_t> lost_;
  std::vector<std::uint32_t> workers_;  ///< the job's workers, once they changed
  bool chief_lost_ = false;
  std::uint64_t beats_ = 0;
  std::vector<std::optional<Stats>> stats_;
  std::chrono::steady_clock::time_point heard_at_{};
  std::thread thread_;
};

}  // namespace pulley
// ---- end pulley/client/heartbeat.hpp ----
// ---- begin pulley/client/worker.hpp ----

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

// ---- begin pulley/client/detail/recovery.hpp ----

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <utility>

namespace pulley::detail {

/// A client's wait for lost ps tasks to come back: retries with a growing pause (0.1 s to
/// 2 s), logs the first failure, and gives up once `ClientOptions::recovery_timeout` has
/// passed since it, naming the last failure. A failure after the ps tasks answered again
/// (`answered`) is a fault of its own, whose deadline runs from it; after `kMaxAnswered`
/// of those the deadline runs on (a call that breaks whenever it is made ends in time).
class Recovery {
 public:
  using Clock = std::chrono::steady_clock;

  /// @param who "worker 2", "chief": who waits, for the log and the error
  Recovery(std::string who, const ClientOptions& options)
      : who_(std::move(who)), timeout_(options.recovery_timeout), deadline_(Clock::now() + timeout_) {}

  /// True for what a lost ps gives: `kUnavailable` (it is gone, or not reachable). (A
  /// ps restarted and not restored yet, or restored since the request's epoch, answers
  /// `kFailedPrecondition`: a client tells that from a request it got wrong by waiting
  /// until ready and seeing whether the epoch moved.)
  static bool may_recover(ErrorCode code) noexcept { return code == ErrorCode::kUnavailable; }

  /// Pauses before the next try after `failure`; throws kUnavailable once the deadline
  /// has passed.
  void wait(const Error& failure) {
    const std::string seconds = std::to_string(timeout_.count() / 1000);
    if (tries_++ == 0) {
      log(LogLevel::kWarning, who_ + ": " + failure.what() + "; waiting for the ps tasks to be back " +
                                  "(at most " + seconds + " s)");
    }
    const auto now = Clock::now();
    if (std::exchange(answered_, false) && answers_ < kMaxAnswered) {
      ++answers_;
      deadline_ = now + timeout_;
      pause_ = std::chrono::milliseconds(100);
    }
    if (now >= deadline_) {
      throw Error(ErrorCode::kUnavailable,
                  who_ +
                      (answers_ < kMaxAnswered
                           ? ": the ps tasks were not back within " + seconds + " s ("
                           : ": the ps tasks answered again " + std::to_string(answers_) +
                                 " times, and the call broke each time (") +
                      std::to_string(tries_) + " tries); last: " + failure.what());
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(pause_, deadline_ - now));
    pause_ = std::min<std::chrono::milliseconds>(pause_ * 2, std::chrono::seconds(2));
  }

  /// The ps tasks answered since the last failure: the next one is a fault of its own, with
  /// its own deadline and pauses.
  void answered() noexcept { answered_ = true; }

  /// How many times `answered` gives a failure a deadline of its own.
  static constexpr int kMaxAnswered = 20;

  /// Time since the wait began (or since the ps tasks last answered).
  [[nodiscard]] Clock::duration waited() const noexcept { return Clock::now() - (deadline_ - timeout_); }

  /// Tries so far.
  [[nodiscard]] int tries() const noexcept { return tries_; }

 private:
  std::string who_;
  std::chrono::milliseconds timeout_;
  Clock::time_point deadline_;
  std::chrono::milliseconds pause_{100};
  int tries_ = 0;
  int answers_ = 0;  ///< failures given a deadline of their own
  bool answered_ = false;
};

}  // namespace pulley::detail
// ---- end pulley/client/detail/recovery.hpp ----

namespace pulley {

/// What one training step did.
struct StepResult {
  float loss = 0.0F;              ///< the batch's mean loss
  std::int64_t local_step = 0;    ///< the step its gradient was computed for
  std::int64_t global_step = 0;   ///< steps completed when its token was taken
  std::uint32_t stale_parts = 0;  ///< part gradients the ps dropped as stale
  /// Updates of other pushes applied between the parameters its gradient was computed on
  /// and the pull that ended the step (0 under SyncReplicas with R = N; under Async, how
  /// many pushes of other workers came in between).
  std::int64_t staleness = 0;
};

/// A worker task: pulls parameters into its model, computes gradients on its own batches
/// and pushes them (seed 002's pull → feed → compute → push; the ps does the update).
///
/// With a TableModel, each step also pulls the rows of the embedding tables its batch
/// touches (their distinct ids, grouped by the ps that holds them: `lookup`), in the same
/// round trip as the dense parameters it needs then, and pushes their gradients with the
/// dense ones. A worker never holds, pulls or pushes a whole table.
///
/// @tparam M the Model or TableModel it trains (owned: the worker pulls into its parameters
///           in place)
/// @tparam T the Transport that reaches the ps tasks
/// @tparam I the IdSharding of the tables' rows: the ps tasks' (HashIds by default; name it
///           once, `MyTables::Sharding` of the ps tasks' `Tables<O, MyIds>`): a worker whose
///           sharding puts rows elsewhere is refused by `wait_ready`
template <Model M, Transport T, IdSharding I = HashIds>
class Worker {
 public:
  /// @param index this worker's task index (tags its pushes and token requests)
  Worker(std::uint32_t index, M model, T transport, ClientOptions options = {}, I sharding = {})
      : index_(index),
        model_(std::move(model)),
        client_(std::move(transport), options),
        sharding_(std::move(sharding)) {
    const auto variables = std::span<const VariableSpec>(model_.variables());
    all_.reserve(variables.size());
    for (std::size_t v = 0; v < variables.size(); ++v) {
      all_.push_back({v, {0, variables[v].rows()}, model_.parameter(v)});
      gradients_.push_back(model_.gradient(v));
    }
    if constexpr (TableModel<M>) {
      const auto tables = std::span<const TableSpec>(model_.tables());
      batches_.resize(tables.size());
      for (std::size_t t = 0; t < tables.size(); ++t) batches_[t].spec = tables[t];
    }
  }

  /// Not copyable or movable: it keeps views of its model's buffers.
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  /// Blocks until the chief has initialized every ps, and learns where variables live.
  void wait_ready() {
    if constexpr (TableModel<M>) {
      client_.wait_ready(model_.variables(), std::span<const TableSpec>(model_.tables()));
      client_.check_id_sharding(sharding_);  // a worker that would send rows astray is refused now
    } else {
      client_.wait_ready(model_.variables());
    }
  }

  /// One training step on `batch`, paced by the sync policy: take a sync token (under
  /// Async, whose tokens never wait, only once: the pulls report the global step), make sure
  /// the model holds the parameters the token requires (pulling them unless the last step
  /// already did), compute the gradient, then push it and pull the next step's parameters
  /// in one round trip (`push_pull`). Under Async that prefetch is what the next step
  /// computes on (as MXNet's kvstore does): after a long pause, `pull()` first to start
  /// from the newest values.
  ///
  /// Returns nullopt when training is over: the token shows that `last_step` global steps
  /// are done (TF's StopAtStepHook), or the chief has ended training (the ps tasks answer
  /// `kOutOfRange`); `finished()` then says so.
  ///
  /// A ps that is lost (`kUnavailable`) or a job rolled back to a checkpoint while the step
  /// ran (`kFailedPrecondition`: the chief restored the ps tasks after losing one) is
  /// waited out: the worker waits until every ps is ready again and learns the epoch. If
  /// the ps tasks were not rolled back and the step's push had gone out, the same push
  /// (same number, same gradients) is sent again, so a ps that took it counts it once and
  /// every ps ends the step with the same pushes; otherwise the step starts again on the
  /// same batch, as TensorFlow's workers do after a ps failure. It gives up after `ClientOptions::recovery_timeout` with `kUnavailable`
  /// naming the last failure (the ps). Any other failure throws at once.
  std::optional<StepResult> step(
      const typename M::Batch& batch,
      std::int64_t last_step = std::numeric_limits<std::int64_t>::max()) {
    return run_step([&](const Token&) -> const typename M::Batch& { return batch; }, last_step);
  }

  /// One training step, as `step(batch)`, on the batch `source(number)` gives once the step's
  /// token is taken: `number` is the token's batch number (Token::batch), -1 when the sync
  /// policy does not number batches. A step retried after a failure reads again only if its
  /// new token numbers another batch (a source numbered -1 is read once a step). So a worker
  /// that takes a lost worker's token reads the lost worker's batch.
  template <class Source>
    requires std::invocable<Source&, std::int64_t> &&
             std::convertible_to<std::invoke_result_t<Source&, std::int64_t>, typename M::Batch>
  std::optional<StepResult> step(Source&& source,
                                 std::int64_t last_step = std::numeric_limits<std::int64_t>::max()) {
    std::optional<typename M::Batch> read;
    std::int64_t number = -1;
    return run_step(
        [&](const Token& token) -> const typename M::Batch& {
          if (!read || token.batch != number) {
            read.reset();
            read.emplace(source(token.batch));
            number = token.batch;
          }
          return *read;
        },
        last_step);
  }

  /// Pushes the model's current gradients tagged with `local_step`, then pulls every
  /// variable once the ps tasks have completed `pull_step` steps (0: at once, with this
  /// push applied), in one round trip: both requests go out together and each ps answers
  /// the pull after handling the push. Returns the number of part gradients dropped as
  /// stale.
  std::uint32_t push_pull(std::int64_t local_step, std::int64_t pull_step) {
    pulled_step_ = -1;  // a pull that fails part way leaves the model mixed: pull again
    const auto done = client_.push_pull(index_, local_step, gradients_, all_, pull_step, push_rows_);
    pulled_step_ = done.pulled_step;
    return done.stale_parts;
  }

  /// After `step` returned nullopt for reaching `last_step`, before the chief ended
  /// training: waits until it does, so that no worker ends successfully unless the chief
  /// ended the job (its last checkpoint and evaluation done). Returns true once it has
  /// (`ended()`), false when the job must train on (it was rolled back below `last_step`
  /// after a lost ps, or a ps went away and is back: `step` again). A ps that is away is
  /// waited for here with the recovery's pauses, and fails this wait (kUnavailable) after
  /// `ClientOptions::recovery_timeout`; a break after every ps answered again is a fault of
  /// its own, 20 times at most (detail::Recovery); a ps that answers, once back, that the
  /// chief ended training meanwhile ends this wait with true. Throws kAborted
  /// when the chief aborted training, or the ps tasks gave up waiting for a lost chief;
  /// kDeadlineExceeded when no ps advanced for `ClientOptions::wait_timeout` (the chief's
  /// last checkpoint and evaluation take longer).
  bool wait_for_end() {
    if (ended_) return true;
    try {
      client_.wait_for_end();
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kOutOfRange) {
        if (e.code() != ErrorCode::kFailedPrecondition && !detail::Recovery::may_recover(e.code())) throw;
        if (!ending_) ending_.emplace("worker " + std::to_string(index_), client_.options());
        if (e.code() == ErrorCode::kFailedPrecondition || !ended_while_away(e)) {
          finished_ = false;
          pulled_step_ = -1;
          return false;
        }
      }
    }
    ending_.reset();
    finished_ = ended_ = true;
    return true;
  }

  /// True once the chief ended training (a step or `wait_for_end` was answered so).
  [[nodiscard]] bool ended() const noexcept { return ended_; }

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
  /// returns the number of part gradients dropped as stale. (Unlike `step`, a failed call
  /// is not retried here: calling it again sends a new push, which a ps that took the
  /// first also counts.)
  std::uint32_t push(std::int64_t local_step) {
    return client_.push(index_, local_step, gradients_, push_rows_);
  }

  /// The model it trains, with the parameters of the last pull.
  [[nodiscard]] M& model() noexcept { return model_; }
  /// The model it trains, with the parameters of the last pull.
  [[nodiscard]] const M& model() const noexcept { return model_; }
  /// Counters of every member ps, in member order (their global steps among them).
  std::vector<Stats> stats() { return client_.stats(); }
  /// Steps whose gradients `ClientOptions::clip_norm` scaled down.
  [[nodiscard]] std::int64_t clipped_steps() const noexcept { return client_.clipped_steps(); }
  /// The global norm of the last pushed gradients before clipping (0 unless clipping is on).
  [[nodiscard]] double last_gradient_norm() const noexcept { return client_.last_gradient_norm(); }
  /// This worker's task index.
  [[nodiscard]] std::uint32_t index() const noexcept { return index_; }
  /// True once `step` returned nullopt: training is over.
  [[nodiscard]] bool finished() const noexcept { return finished_; }
  /// The global step seen with the last token (Async: with the last pull).
  [[nodiscard]] std::int64_t global_step() const noexcept { return global_step_; }
  /// Where each variable lives, once `wait_ready` returned.
  [[nodiscard]] const Placement& placement() const noexcept { return client_.placement(); }

 private:
  /// A step, its batch read by `read(token)` once the token is taken.
  template <class Read>
  std::optional<StepResult> run_step(Read&& read, std::int64_t last_step) {
    if (finished_) return std::nullopt;
    pushing_ = false;
    client_.forget_push();  // what an earlier step left unanswered is not this step's
    std::optional<detail::Recovery> recovery;
    for (bool again = false;; again = true) {
      try {
        if (again) {
          recover();
          if (recovery && whole_again())
            recovery->answered();  // a break after this is a fault of its own
        }
        if (again && pushing_ && client_.push_unanswered()) return finish_step();
        if constexpr (AppliesWhenComputed<M>) {
          if (again && pushing_) {
            throw Error(ErrorCode::kAborted, "worker " + std::to_string(index_) +
                                                 ": the step's push cannot be sent again as it was (the job was "
                                                 "rolled back, or its members changed), and the model applied part "
                                                 "of the step when it computed it: it cannot be computed again");
          }
        }
        std::optional<StepResult> result = try_step(read, last_step);
        if (result) ending_.reset();  // training went on: a later wait for the end starts afresh
        return result;
      } catch (const Error& e) {
        if (e.code() == ErrorCode::kOutOfRange) {
          finished_ = ended_ = true;  // the chief ended training; this step's gradient is not needed
          return std::nullopt;
        }
        if (e.code() == ErrorCode::kFailedPrecondition && !rolled_back()) throw;
        if (!recovery) recovery.emplace("worker " + std::to_string(index_), client_.options());
        if (e.code() != ErrorCode::kFailedPrecondition) {
          if (!detail::Recovery::may_recover(e.code())) throw;
          recovery->wait(e);  // throws once the ps tasks stay lost too long
        }
      }
    }
  }

  template <class Read>
  std::optional<StepResult> try_step(Read& read, std::int64_t last_step) {
    // Unpaced (Async) tokens are never waited for: after the first, the step the last
    // pull reported serves as the token, and the round trip is saved.
    const TokenReply reply = paced_ || pulled_step_ < 0
                                 ? client_.take_token(index_)
                                 : TokenReply{Token{0, 0, 0, false}, pulled_step_};
    const Token& token = reply.token;
    paced_ = token.paced;
    global_step_ = reply.global_step;
    if (reply.global_step >= last_step) {
      finished_ = true;
      return std::nullopt;
    }
    const typename M::Batch& batch = read(token);
    StepResult result;
    if constexpr (TableModel<M>) {
      gather_rows(batch);
      if (pulled_step_ < token.pull_step) {
        pulled_step_ = -1;
        pulled_step_ = client_.pull_with_rows(all_, row_requests_, token.pull_step);
      } else {
        (void)client_.pull_rows(row_requests_, token.pull_step);
      }
      for (TableState& t : batches_) std::fill(t.gradients.begin(), t.gradients.end(), 0.0F);
      result.loss = static_cast<float>(model_.compute_gradients(batch, std::span<const TableBatch>(views_)));
    } else {
      if (pulled_step_ < token.pull_step) pull_all(token.pull_step);
      result.loss = static_cast<float>(model_.compute_gradients(batch));
    }
    result.local_step = token.local_step;
    result.global_step = reply.global_step;
    interrupted_ = result;  // what finish_step completes if the push loses a connection
    interrupted_pull_step_ = token.next_pull_step;
    pushing_ = true;
    const std::int64_t computed_on = pulled_step_;
    pulled_step_ = -1;  // a pull that fails part way leaves the model mixed: pull again
    const auto done = client_.push_pull(index_, token.local_step, gradients_, all_, token.next_pull_step,
                                        push_rows_, token.refill);
    pulled_step_ = done.pulled_step;
    result.stale_parts = done.stale_parts;
    result.staleness = std::max<std::int64_t>(0, done.pulled_step - computed_on - 1);
    return result;
  }

  /// Completes the step whose push a lost connection interrupted: the same push again (a
  /// ps that took it answers as it did), then the pull the step ends with.
  StepResult finish_step() {
    StepResult result = interrupted_;
    pulled_step_ = -1;
    const auto done = client_.push_pull_again(all_, interrupted_pull_step_);
    pulled_step_ = done.pulled_step;
    result.stale_parts = done.stale_parts;
    return result;
  }

  /// After `recover`: every ps answered, with every copy of its shard that a write needs
  /// (with copies, one out of reach and not given up is the fault still under way: a
  /// worker cut off from a process the chief still reaches; Tcp::copies_whole).
  [[nodiscard]] bool whole_again() const {
    if constexpr (requires(const T& t) {
                    { t.copies_whole() } -> std::convertible_to<bool>;
                  }) {
      return client_.transport().copies_whole();
    } else {
      return true;
    }
  }

  /// After a lost ps or a rollback: ready again, at the ps tasks' epoch, pulling afresh.
  void recover() {
    pulled_step_ = -1;
    paced_ = true;
    wait_ready();
  }

  /// `wait_for_end`'s wait for the ps tasks after `failure`: tries `recover` with the
  /// recovery's pauses until it succeeds (with every copy whole, the next break is then a
  /// fault of its own), a rollback is coming (kFailedPrecondition), a ps says the chief
  /// ended training meanwhile (kOutOfRange: true), or `ending_`'s deadline passes
  /// (kUnavailable). Trying once and leaving the rest to `step` would let the step's token
  /// (one ps) answer while another ps stays unreached, and the deadline run out across
  /// faults that were each over long before it.
  bool ended_while_away(Error failure) {
    while (true) {
      ending_->wait(failure);  // no busy loop while a ps is away
      try {
        recover();
        if (whole_again()) ending_->answered();
        return false;
      } catch (const Error& away) {
        if (away.code() == ErrorCode::kOutOfRange) return true;
        if (away.code() == ErrorCode::kFailedPrecondition) return false;
        if (!detail::Recovery::may_recover(away.code())) throw;
        failure = away;
      }
    }
  }

  /// After a kFailedPrecondition: true if the ps tasks were restored since this worker
  /// last looked (it is then ready at the new epoch); false if the refusal was about the
  /// request itself. Waits while a restarted ps is not restored yet; a ps lost meanwhile
  /// counts as a rollback to come.
  bool rolled_back() {
    const std::uint64_t before = client_.epoch();
    try {
      recover();
    } catch (const Error& e) {
      return detail::Recovery::may_recover(e.code());
    }
    return client_.epoch() != before;
  }

  void pull_all(std::int64_t min_step) {
    pulled_step_ = -1;  // a pull that fails part way leaves the model mixed: pull again
    pulled_step_ = client_.pull(all_, min_step);
  }

  /// One table's rows for the current batch: its distinct ids grouped by ps (ascending
  /// within each), where each id is, the rows pulled and their gradients.
  struct TableState {
    TableSpec spec;
    std::vector<std::uint64_t> ids;
    std::vector<std::size_t> ps_begin;
    IdPositions positions;  ///< id → index in ids
    std::vector<float> rows;
    std::vector<float> gradients;
  };

  /// Asks the model which ids the batch uses, and lays out every table's buffers for them.
  void gather_rows(const typename M::Batch& batch) {
    const auto num_ps = static_cast<std::uint32_t>(client_.num_ps());
    row_requests_.clear();
    push_rows_.clear();
    views_.clear();
    for (std::size_t t = 0; t < batches_.size(); ++t) {
      TableState& table = batches_[t];
      table.ids.clear();
      model_.lookup(batch, t, table.ids);
      // The distinct ids in the order the batch first uses them, then grouped by ps by a
      // stable counting sort: each ps's ids are one run, in the same order on every run.
      table.positions.clear();
      table.positions.reserve(table.ids.size());
      table.ps_begin.assign(num_ps + 1, 0);
      ps_of_.clear();
      for (const std::uint64_t id : table.ids) {
        if (!table.positions.insert(id).second) continue;
        const std::uint32_t ps = row_owner(sharding_, table.spec.name, id, client_.members());
        if (ps >= num_ps) {
          throw Error(ErrorCode::kInvalidArgument, "the id sharding put row " + std::to_string(id) +
                                                       " of table '" + table.spec.name + "' on ps " +
                                                       std::to_string(ps) + " of " + std::to_string(num_ps));
        }
        ps_of_.push_back(ps);
        ++table.ps_begin[ps + 1];
      }
      for (std::uint32_t p = 0; p < num_ps; ++p) table.ps_begin[p + 1] += table.ps_begin[p];
      const std::span<const std::uint64_t> distinct = table.positions.ids();
      if (num_ps == 1) {
        table.ids.assign(distinct.begin(), distinct.end());
      } else {
        table.ids.resize(distinct.size());
        next_.assign(table.ps_begin.begin(), table.ps_begin.end() - 1);
        for (std::size_t i = 0; i < distinct.size(); ++i) table.ids[next_[ps_of_[i]]++] = distinct[i];
        table.positions.clear();
        for (const std::uint64_t id : table.ids) (void)table.positions.insert(id);  // numbered as ids
      }
      table.rows.resize(table.ids.size() * table.spec.dim);
      table.gradients.resize(table.ids.size() * table.spec.dim);
      // The pulls write into the rows; the pushes send the gradients.
      row_requests_.push_back({t, table.ids, table.ps_begin, table.rows});
      push_rows_.push_back({t, table.ids, table.ps_begin, table.gradients});
      views_.push_back({table.spec.dim, table.ids, table.rows, table.gradients, &table.positions});
    }
  }

  std::uint32_t index_;
  M model_;
  Client<T> client_;
  std::vector<PullRequest> all_;                   ///< every variable into the model
  std::vector<std::span<const float>> gradients_;  ///< the model's gradient buffers
  [[no_unique_address]] I sharding_;
  std::vector<TableState> batches_;                ///< by table: the current batch's rows
  std::vector<RowRequest> row_requests_;           ///< pulls into batches_' rows
  std::vector<RowRequest> push_rows_;              ///< pushes of batches_' gradients
  std::vector<TableBatch> views_;                  ///< what the model computes with
  std::vector<std::uint32_t> ps_of_;               ///< scratch: each distinct id's ps
  std::vector<std::size_t> next_;                  ///< scratch: where each ps's next id goes
  std::int64_t global_step_ = 0;
  bool pushing_ = false;                    ///< this step's push went out (or may have)
  StepResult interrupted_;                 ///< the step whose push is on its way
  std::int64_t interrupted_pull_step_ = 0;  ///< and the step its pull waits for
  std::int64_t pulled_step_ = -1;  ///< the model holds every variable as of this step or later
  bool paced_ = true;              ///< the sync policy makes workers wait for tokens
  bool finished_ = false;          ///< training is over
  bool ended_ = false;             ///< the chief ended it
  std::optional<detail::Recovery> ending_;  ///< wait_for_end's wait for a ps that is away
};

}  // namespace pulley
// ---- end pulley/client/worker.hpp ----
// ---- begin pulley/concepts/row_aggregation.hpp ----

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>

namespace pulley {

/// A row aggregation policy decides how the rows of one embedding table pushed for one
/// update become the rows its optimizer applies: TensorFlow's SparseConditionalAccumulator
/// and its `reduction_type`. The ps keeps one `Accumulator` per table; the sync policy
/// decides which pushes belong to an update (their rows share the push's verdict), this
/// policy what their rows add up to.
///
/// Required:
///   - `typename A::Accumulator`, movable
///   - `a.make_accumulator(dim)` → an empty accumulator of rows of `dim` floats
///   - `a.add(acc, ids, rows)` → void: one push's rows, `ids` distinct, `rows` holding
///     `ids.size() × dim` floats in the order of `ids`
///   - `a.ids(acc)` → `std::span<const std::uint64_t>`: the distinct ids added since the last
///     `clear`, each once
///   - `a.take(acc)` → `std::span<const float>`: the update's rows, `ids(acc).size() × dim`
///     floats in the order of `ids(acc)`
///   - `a.clear(acc)`, noexcept: forgets everything added (memory may be kept)
///
/// Semantic contract:
///   - deterministic: the same pushes in the same order give the same rows;
///   - `take` is called once per update, after at least one `add`; its span stays valid
///     until the next `add` or `clear`, and the ps clears the accumulator after each update
///     (applied or rolled back);
///   - ids come from peers: an accumulator that hashes them should key its hash at random,
///     so that chosen ids cannot pile onto one slot;
///   - the policy object is never modified after construction; everything that changes
///     lives in the Accumulator.
template <class A>
concept RowAggregation = std::copy_constructible<A> && std::movable<typename A::Accumulator> &&
    requires(const A& policy, typename A::Accumulator& acc, const typename A::Accumulator& cacc,
             std::span<const std::uint64_t> ids, std::span<const float> rows, std::size_t dim) {
  { policy.make_accumulator(dim) } -> std::same_as<typename A::Accumulator>;
  { policy.add(acc, ids, rows) } -> std::same_as<void>;
  { policy.ids(cacc) } -> std::convertible_to<std::span<const std::uint64_t>>;
  { policy.take(acc) } -> std::convertible_to<std::span<const float>>;
  { policy.clear(acc) } noexcept;
};

}  // namespace pulley
// ---- end pulley/concepts/row_aggregation.hpp ----
// ---- begin pulley/concepts/service.hpp ----

#include <concepts>
#include <span>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <utility>

namespace pulley {

/// How a service answers one request: called exactly once, now or later, from the thread
/// that serves it. A Responder never throws. It may keep the Response's views (a TCP server
/// writes a pull reply straight from the parameters as the socket drains), so a service
/// keeps what they view valid and unchanged until it handles a request that
/// `changes_parameters`, or is destroyed; a transport finishes with the views before it
/// hands the service such a request.
using Responder = std::function<void(Response&&)>;

/// Answers through `reply`, which is empty afterwards: a request is answered once, and a
/// reply already given (or parked elsewhere) is left alone.
inline void respond(Responder& reply, Response&& response) {
  Responder r = std::exchange(reply, nullptr);
  if (r) r(std::move(response));
}

/// What a transport vouches for about a request, besides its content.
struct RequestContext {
  /// Every tensor of the request is finite: the transport checked it as it arrived, or the
  /// request comes from a client in this process (pulley's clients check before sending).
  bool tensors_finite = false;
  /// The task that sent it, as the transport knows it (over TCP: as the handshake proved
  /// it); the service refuses what that task's role may not send (`kSenders`). nullopt: a
  /// caller the transport does not name, trusted (pulley's transports always name it).
  std::optional<Node> peer;
  /// The connection (or in-process endpoint) it came on, unique while the transport lives;
  /// 0: unknown. What a peer takes on a connection (a sync token) it holds while that
  /// connection lives: see `disconnected`.
  std::uint64_t session = 0;
  /// The shard the connection asked for at its handshake (wire::Hello::shard): nullopt for
  /// the service's own, or the index of a shard whose copy it may hold (`holds_copy`).
  std::optional<std::uint32_t> shard = std::nullopt;
  /// With `tensors_finite`: no float of the request is larger in magnitude, as the
  /// transport measured it while checking (+infinity: not measured). A ps proves updates
  /// finite from it without reading the gradient again (BoundsMagnitudes).
  float tensors_largest = std::numeric_limits<float>::infinity();
};

/// The server half of a transport's contract: what a transport serves. A ParameterServer is
/// one; `TcpServer` and `InProcessNetwork` serve any Service.
///
/// Required:
///   - `s.handle(request, context, reply)`, declared noexcept
///   - `s.task()` → this ps task's index
///   - `s.stopped()` → bool: true once it serves no more (shut down, or failed)
///
/// Optional:
///   - `s.disconnected(node, session)`, noexcept: the transport lost connection `session`
///     from task `node` (its process ended, or the link broke; session 0: every connection
///     of that task, e.g. an in-process task that was killed). The service gives back what
///     was taken on it, such as a sync token whose push will not come (a lease).
///   - `s.holds_copy(shard)` → bool: a connection may ask for a copy of ps `shard`'s shard
///     besides its own (ShardCopies: the one it holds, or one the chief may move to it); a
///     transport refuses a connection that asks for any other shard.
///   - `s.max_request_payload()` → std::uint64_t: the most tensor bytes a request can
///     legitimately carry now (a ParameterServer: the bytes of the parts it holds). A
///     transport refuses a frame that claims more before it receives any of it.
///   - `s.fenced(node)` → std::string: why task `node` may not be served now, or "" (it
///     may). A transport closes that task's connections at their next request or reply,
///     or within a second while they wait, and refuses its new ones for now
///     (kUnavailable), so that the task finds this ps out of reach (ShardCopies: a process
///     that lost the chief's lease).
///   - `s.tick()`, noexcept: time passed with no request, at least once a second while the
///     transport serves (its own clock: a deadline that must pass even while nobody sends,
///     such as the chief's recovery timeout at a ps no task may reach). Called between
///     requests, never during one.
///   - `s.awaits_workers()` → bool: once stopped, true while a worker may still come to
///     hear that it stopped (its answer lost with its link, its process stopped a while):
///     the transport keeps taking connections for it, every client gone or not.
///   - `s.restarts()` → bool: it stopped to start again empty (the job gave its process
///     up: Shutdown::restart). Whoever is still connected holds a process given up: the
///     transport ends within a second, not `linger`, so that it serves anew at once.
///   - `s.workers()` → `std::span<const std::uint32_t>`: the job's workers now, ascending,
///     once workers joined or left (ChangeWorkers); empty while they are the cluster
///     spec's. A transport that checks who connects lets a worker in only if it is one.
///
/// Semantic contract:
///   - the transport calls `handle` (and `disconnected`) for one request at a time (never
///     concurrently), in the order each client sent them, and never after the service is
///     destroyed;
///   - `handle` answers every request exactly once through `reply`, now or later (a request
///     that waits for a token or a step is answered when another request completes it);
///     whatever goes wrong, including a throwing policy, becomes an answer: `handle` does
///     not throw, so the transport has no failure of the service to decide about;
///   - a stopped service still answers what it is sent (with the error that says why it
///     stopped): the transport keeps serving it until its clients have heard, then ends.
template <class S>
concept Service = requires(S& service, const S& cservice, Request&& request,
                           const RequestContext& context, Responder reply) {
  requires noexcept(service.handle(std::move(request), context, std::move(reply)));
  { cservice.task() } -> std::convertible_to<std::uint32_t>;
  { cservice.stopped() } -> std::convertible_to<bool>;
};

/// Tells `service` that connection `session` of task `node` is gone, if the service cares
/// (`disconnected`).
template <Service S>
void notify_disconnected(S& service, const Node& node, std::uint64_t session) noexcept {
  if constexpr (requires { service.disconnected(node, session); }) {
    static_assert(noexcept(service.disconnected(node, session)),
                  "Service::disconnected must be noexcept");
    service.disconnected(node, session);
  }
}

/// True if `service` serves a copy of shard `shard` (`holds_copy`); none by default.
template <Service S>
bool holds_copy(const S& service, std::uint32_t shard) noexcept {
  if constexpr (requires { { service.holds_copy(shard) } -> std::convertible_to<bool>; }) {
    return service.holds_copy(shard);
  } else {
    return false;
  }
}

/// Lets `service` look at its clock between requests (`tick`), if it cares.
template <Service S>
void tick(S& service) noexcept {
  if constexpr (requires { service.tick(); }) {
    static_assert(noexcept(service.tick()), "Service::tick must be noexcept");
    service.tick();
  }
}

/// Why `service` serves task `node` no more for now (`fenced`), or "" (it does, as by
/// default).
template <Service S>
std::string fence_reason(S& service, const Node& node) {
  if constexpr (requires { { service.fenced(node) } -> std::convertible_to<std::string>; }) {
    return service.fenced(node);
  } else {
    return {};
  }
}

/// True if `service` stopped to start again empty (`restarts`); false by default.
template <Service S>
bool restarts(const S& service) {
  if constexpr (requires {
                  { service.restarts() } -> std::convertible_to<bool>;
                }) {
    return service.restarts();
  } else {
    return false;
  }
}

/// True if `service` stopped and a worker may still come to hear it (`awaits_workers`);
/// false by default.
template <Service S>
bool awaits_workers(const S& service) {
  if constexpr (requires {
                  { service.awaits_workers() } -> std::convertible_to<bool>;
                }) {
    return service.awaits_workers();
  } else {
    return false;
  }
}

/// The job's workers as `service` has them (`workers`), or none (the cluster spec's).
template <Service S>
std::span<const std::uint32_t> job_workers(const S& service) noexcept {
  if constexpr (requires { { service.workers() } -> std::convertible_to<std::span<const std::uint32_t>>; }) {
    return service.workers();
  } else {
    return {};
  }
}

/// The most tensor bytes a request to `service` can carry now (`max_request_payload`), or no
/// limit if it does not say.
template <Service S>
std::uint64_t max_request_payload(const S& service) noexcept {
  if constexpr (requires { { service.max_request_payload() } -> std::convertible_to<std::uint64_t>; }) {
    return service.max_request_payload();
  } else {
    return std::numeric_limits<std::uint64_t>::max();
  }
}

}  // namespace pulley
// ---- end pulley/concepts/service.hpp ----
// ---- begin pulley/concepts/sync_policy.hpp ----

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace pulley {

/// What one push message counts for (`SyncPolicy::on_push`).
enum class Verdict : std::uint8_t {
  kStale,    ///< too old: its gradients are dropped (and counted), never applied
  kPending,  ///< its gradients are accumulated; the step needs more
  kReady,    ///< its gradients are accumulated and complete an update: take and apply it
};

/// An aggregation (sync) policy decides when gradients are applied and how workers are
/// paced. It has two halves, both state the policy defines and the ps keeps:
///   - an `Accumulator` per part the ps holds (TF's ConditionalAccumulator): it gathers the
///     part's gradients of one update and hands the optimizer their mean;
///   - one `Pacer` per ps task: it counts push messages towards the ps's global step, judges
///     them fresh or stale, and (on the pacing ps: the lowest member, ps 0 while none left) hands
///     out sync tokens.
///
/// Required:
///   - `typename P::Accumulator`, `typename P::Pacer` (both movable)
///   - `p.make_accumulator(n)` → an empty accumulator for `n`-element gradients
///   - `p.accumulate(acc, gradient)` → void: adds one fresh gradient
///   - `p.take(acc)` → `std::span<const float>`: what the optimizer applies; empties `acc`
///   - `p.make_pacer()` → the pacer at global step 0
///   - `p.on_push(pacer, worker, local_step)` → `Verdict` for one push message
///   - `p.global_step(pacer)` → `std::int64_t`: global steps completed on this ps
///   - `p.take_token(pacer, worker)` → `std::optional<Token>`; nullopt: the request waits
/// Optional:
///   - `p.waiting_for(pacer)` → `std::string`: what the next step waits for, in words; the
///     ps reports it (StatsReply) and clients quote it when a token or a step never comes
///   - `p.save(pacer)` → `std::vector<std::int64_t>` and `p.load(pacer, state)` (state: a
///     `std::span<const std::int64_t>` that `save` gave): the pacer as a checkpoint keeps it.
///     The ps saves at a cut where no push is half counted (every ps took the same pushes),
///     and loads into a fresh pacer; `load` throws `pulley::Error` for a state it cannot take
///     (say, of another number of workers), leaving the pacer as it was. Without them a
///     checkpoint keeps only the global step, and a restore starts the pacer afresh.
///   - `p.release(pacer, worker)` → void, noexcept: the connection worker `worker` took its
///     last token on is gone (its process ended, or its link broke): give back the tokens
///     it took and did not push for, so a vanished taker cannot hold a step up (a token is
///     a lease). The worker, or a process restarted in its place, may take tokens again; a
///     worker that pushed for a step still may not take a second token of it when R <= N.
///   - `p.held_token(pacer, worker)` → `std::optional<Token>`: a token of the step in
///     progress that `worker` took and has not pushed for (else nullopt). A worker pushes
///     for each token before it asks for another, so one that asks on the connection that
///     took it is asking again (its answer was lost with another ps's connection): it gets
///     that token again, counted once. Asked on another connection, the request waits for
///     the first to go, as any.
///   - `p.on_worker_lost(pacer, worker)` → `Verdict`: the ps holds `worker` lost (its
///     heartbeats stopped): stop waiting for it. kReady when that completes the update in
///     progress (the ps then takes and applies it as after a push), else kPending. The
///     policy gives back its tokens as `release` does. `p.on_worker_back(pacer, worker)` →
///     void: its heartbeats came back; it counts again from the step in progress. A throw
///     from either fails the ps. Without them a lost worker is only released, and the
///     policy waits for it.
///   - `p.on_pull_ahead(pacer, worker, min_step)` → `std::optional<Verdict>`: `worker`
///     (not held lost) asks for the parameters of step `min_step`, the one after the step in
///     progress, for which it has not pushed here. A worker pushes a step on a connection
///     before it pulls the next there, so this one will not push it: its push was lost with
///     its process (killed while it wrote the push to several ps tasks; those that took it
///     went on, and the process started in its place pulls the step they are at), or it
///     skipped the step (a backup worker, given the next step's token). A policy whose step
///     waits for that very worker stops waiting for it for this step alone (the update is
///     the mean of the others' gradients, or none), and says so: kReady when that
///     completes the step, else kPending; nullopt when the pull changes nothing (it waits,
///     as any gated pull). A push of the worker for that step that comes all the same is
///     stale. The ps asks again while the pull waits, whenever what the policy judges by
///     changed (a push taken, a worker back). Without it, such a pull waits
///     until the ps holds the worker lost, which it may never do while the worker's new
///     process beats.
///   - `p.awaited(pacer)` → `std::vector<std::uint32_t>`: the workers the next step waits
///     for; the ps quotes each with how long ago it last heard it.
///   - `p.reshape(pacer, workers)` → void: the job's workers are now `workers` (task
///     indices, ascending, not empty; workers joined or left for good): count them from the
///     step in progress on. The ps calls it the moment its global step reaches the step the
///     chief chose (ChangeWorkers), before it hands out a token of that step (under
///     SyncReplicas every ps is then at the same boundary, the step untouched), and after a
///     `load` when the job's workers are not the cluster spec's. A worker outside them is
///     not waited for; its token requests may wait and its pushes be stale. A throw
///     (`pulley::Error`) refuses the change and leaves the pacer as it was. Without it, no worker
///     can join or leave the job for good.
///   - `p.follow(pacer, local_step, refill)` → void, noexcept: called before `on_push` with
///     what the token the push was made for said (`Token::refill`, which the pacing ps's
///     policy sets): every ps follows the pacing ps's word on the push's step.
///
/// Semantic contract:
///   - the ps calls `on_push` once per push message, after checking it and before touching
///     any part: kStale drops every part gradient of the message, kPending accumulates them,
///     kReady accumulates them and then takes and applies every part's update. So the parts
///     one ps holds all see the same verdicts and never drift apart. (Parts on different ps
///     tasks are paced by each ps's own pacer, as TensorFlow's accumulators are: with
///     backup workers, two ps may average the gradients of different workers for one step.)
///   - `take` returns the mean of the gradients accumulated since the last `take` (or the
///     one gradient); the span stays valid until the next `accumulate` and may alias the
///     last gradient passed in; `accumulate` may keep a view of its gradient until then;
///   - `global_step` never decreases. A Pull with `min_step` waits until it reaches
///     `min_step`, and is answered the moment it does (before the ps handles anything
///     else), so the values it reads are this ps's at that step;
///   - `take_token` is asked for every TakeToken (sent to the pacing ps only); a request it answers
///     nullopt waits, and is asked again, in arrival order, after every push the ps handles;
///   - `on_push` and `take_token` may refuse a request by throwing `pulley::Error` (e.g. a
///     worker index out of range), and must then leave the pacer unchanged. Any other throw
///     from a policy while the ps changes its state fails the ps (it stops serving, and says
///     why), since half an update cannot be undone;
///   - the ps calls the policy from one thread at a time; the policy object itself is never
///     modified after construction: everything that changes lives in the Accumulators and
///     the Pacer.
template <class P>
concept SyncPolicy = std::copy_constructible<P> && std::movable<typename P::Accumulator> &&
    std::movable<typename P::Pacer> &&
    requires(const P& policy, typename P::Accumulator& acc, typename P::Pacer& pacer,
             const typename P::Pacer& cpacer, std::span<const float> gradient,
             std::uint32_t worker, std::int64_t local_step, std::size_t n) {
  { policy.make_accumulator(n) } -> std::same_as<typename P::Accumulator>;
  { policy.accumulate(acc, gradient) } -> std::same_as<void>;
  { policy.take(acc) } -> std::same_as<std::span<const float>>;
  { policy.make_pacer() } -> std::same_as<typename P::Pacer>;
  { policy.on_push(pacer, worker, local_step) } -> std::same_as<Verdict>;
  { policy.global_step(cpacer) } -> std::same_as<std::int64_t>;
  { policy.take_token(pacer, worker) } -> std::same_as<std::optional<Token>>;
};

/// What `policy` says the next step waits for, or "" when it does not say.
template <SyncPolicy P>
std::string waiting_for(const P& policy, const typename P::Pacer& pacer) {
  if constexpr (requires { { policy.waiting_for(pacer) } -> std::convertible_to<std::string>; }) {
    return policy.waiting_for(pacer);
  } else {
    return {};
  }
}

/// The pacer's state for a checkpoint (`save`), or {global step} when the policy has none.
template <SyncPolicy P>
std::vector<std::int64_t> save_pacer(const P& policy, const typename P::Pacer& pacer) {
  if constexpr (requires { { policy.save(pacer) } -> std::convertible_to<std::vector<std::int64_t>>; }) {
    return policy.save(pacer);
  } else {
    return {policy.global_step(pacer)};
  }
}

/// A pacer restored from `state` (`load` on a fresh one), or a fresh one when the policy
/// cannot load.
template <SyncPolicy P>
typename P::Pacer load_pacer(const P& policy, std::span<const std::int64_t> state) {
  typename P::Pacer pacer = policy.make_pacer();
  if constexpr (requires { policy.load(pacer, state); }) policy.load(pacer, state);
  return pacer;
}

/// Gives back what worker `worker` held, if the policy leases tokens (`release`).
template <SyncPolicy P>
void release(const P& policy, typename P::Pacer& pacer, std::uint32_t worker) noexcept {
  if constexpr (requires { policy.release(pacer, worker); }) {
    static_assert(noexcept(policy.release(pacer, worker)), "SyncPolicy::release must be noexcept");
    policy.release(pacer, worker);
  }
}

/// The token of the current step `worker` holds, if the policy says (`held_token`).
template <SyncPolicy P>
std::optional<Token> held_token(const P& policy, const typename P::Pacer& pacer, std::uint32_t worker) {
  if constexpr (requires { { policy.held_token(pacer, worker) } -> std::same_as<std::optional<Token>>; }) {
    return policy.held_token(pacer, worker);
  } else {
    return std::nullopt;
  }
}

/// Tells the policy `worker` is lost (`on_worker_lost`; without it, `release`): kReady
/// when the update in progress is complete without it.
template <SyncPolicy P>
Verdict worker_lost(const P& policy, typename P::Pacer& pacer, std::uint32_t worker) {
  if constexpr (requires { { policy.on_worker_lost(pacer, worker) } -> std::same_as<Verdict>; }) {
    return policy.on_worker_lost(pacer, worker);
  } else {
    release(policy, pacer, worker);
    return Verdict::kPending;
  }
}

/// Tells the policy `worker` pulls step `min_step` past the one in progress without having
/// pushed for it (`on_pull_ahead`, if it has one): nullopt when that changes nothing.
template <SyncPolicy P>
std::optional<Verdict> pull_ahead(const P& policy, typename P::Pacer& pacer, std::uint32_t worker,
                                  std::int64_t min_step) {
  if constexpr (requires {
                  {
                    policy.on_pull_ahead(pacer, worker, min_step)
                    } -> std::same_as<std::optional<Verdict>>;
                }) {
    return policy.on_pull_ahead(pacer, worker, min_step);
  } else {
    return std::nullopt;
  }
}

/// Tells the policy a lost `worker` is back (`on_worker_back`, if it has one).
template <SyncPolicy P>
void worker_back(const P& policy, typename P::Pacer& pacer, std::uint32_t worker) {
  if constexpr (requires { policy.on_worker_back(pacer, worker); }) {
    policy.on_worker_back(pacer, worker);
  }
}

/// True if the policy can count workers that join or leave (`reshape`).
template <SyncPolicy P>
inline constexpr bool kReshapes = requires(const P& policy, typename P::Pacer& pacer,
                                           std::span<const std::uint32_t> workers) {
  policy.reshape(pacer, workers);
};

/// Tells the policy what the pacing ps said about the push's step (`follow`, if it has one).
template <SyncPolicy P>
void follow(const P& policy, typename P::Pacer& pacer, std::int64_t local_step, bool refill) noexcept {
  if constexpr (requires { policy.follow(pacer, local_step, refill); }) {
    static_assert(noexcept(policy.follow(pacer, local_step, refill)), "SyncPolicy::follow must be noexcept");
    policy.follow(pacer, local_step, refill);
  }
}

/// The workers the next step waits for (`awaited`), or none when the policy does not say.
template <SyncPolicy P>
std::vector<std::uint32_t> awaited(const P& policy, const typename P::Pacer& pacer) {
  if constexpr (requires { { policy.awaited(pacer) } -> std::convertible_to<std::vector<std::uint32_t>>; }) {
    return policy.awaited(pacer);
  } else {
    return {};
  }
}

}  // namespace pulley
// ---- end pulley/concepts/sync_policy.hpp ----
// ---- begin pulley/core/address.hpp ----

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace pulley {

/// Where a task listens: a host (a name, an IPv4 address, or an IPv6 address without its
/// brackets) and a port. Compared as written: "localhost:80" and "127.0.0.1:80" differ.
struct Address {
  /// A host name or numeric address; never empty, never bracketed, no whitespace.
  std::string host;
  /// The TCP port, 1..65535 once parsed (0 only in a default-constructed Address).
  std::uint16_t port = 0;

  /// "host:port", brackets around IPv6 hosts ("[::1]:2222"), so that parse_address reads it
  /// back as the same Address.
  [[nodiscard]] std::string to_string() const {
    const bool v6 = host.find(':') != std::string::npos;
    return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
  }

  /// Same host (exactly, case included) and same port.
  friend bool operator==(const Address&, const Address&) = default;
};

namespace detail {

/// An address split into its parts without allocating, or why it cannot be: when `problem`
/// is not empty, `host` and `port` mean nothing.
struct AddressParts {
  std::string_view host;
  std::uint16_t port = 0;
  std::string_view problem;
};

/// The port `text` spells in 1..65535 with one to five decimal digits and nothing else (no
/// sign, no space); 0 when it spells none.
constexpr std::uint16_t address_port(std::string_view text) noexcept {
  if (text.empty() || text.size() > 5) return 0;
  std::uint32_t value = 0;
  for (const char c : text) {
    if (c < '0' || c > '9') return 0;
    value = value * 10 + static_cast<std::uint32_t>(c - '0');
  }
  return value <= 65535 ? static_cast<std::uint16_t>(value) : 0;
}

/// The rules of parse_address, for callers that report a bad address in their own words.
constexpr AddressParts scan_address(std::string_view text) noexcept {
  AddressParts parts;
  std::size_t colon = 0;  // the ':' before the port
  if (!text.empty() && text.front() == '[') {
    const std::size_t close = text.find(']');
    if (close == std::string_view::npos) return {{}, 0, "'[' without ']'"};
    parts.host = text.substr(1, close - 1);
    colon = close + 1;
    if (colon >= text.size() || text[colon] != ':') return {{}, 0, "no ':' after ']'"};
  } else {
    colon = text.rfind(':');
    if (colon == std::string_view::npos) return {{}, 0, "no ':' before the port"};
    parts.host = text.substr(0, colon);
    if (parts.host.find(':') != std::string_view::npos) {
      return {{}, 0, "an IPv6 host needs brackets, as in [::1]:2222"};
    }
  }
  if (parts.host.empty()) return {{}, 0, "the host is empty"};
  for (const char c : parts.host) {
    const auto u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u == 0x7f) return {{}, 0, "the host holds a space or a control character"};
    if (c == '[' || c == ']') return {{}, 0, "a '[' or ']' that does not enclose the host"};
  }
  parts.port = address_port(text.substr(colon + 1));
  if (parts.port == 0) return {{}, 0, "the port must be 1..65535 in decimal digits"};
  return parts;
}

/// `text` with its control characters written as \xNN, so that a message quoting it stays
/// one readable line.
inline std::string printable_text(std::string_view text) {
  std::string out;
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u != 0x7f) {
      out += c;
    } else {
      constexpr std::string_view kHex = "0123456789abcdef";
      out += "\\x";
      out += kHex[u >> 4];
      out += kHex[u & 0xf];
    }
  }
  return out;
}

}  // namespace detail

/// Parses "host:port" or "[v6::addr]:port" (the brackets are dropped from `host`). The port
/// is 1..65535 in at most five decimal digits, with no sign and no space; the host is not
/// empty and holds no whitespace. An IPv6 host must be bracketed, as "::1:80" could split
/// in more than one place. Throws kInvalidArgument "address '<text>' is not host:port: <why>".
inline Address parse_address(std::string_view text) {
  const detail::AddressParts parts = detail::scan_address(text);
  if (!parts.problem.empty()) {
    throw Error(ErrorCode::kInvalidArgument,
                "address '" + detail::printable_text(text) +
                    "' is not host:port: " + std::string(parts.problem));
  }
  return Address{std::string(parts.host), parts.port};
}

}  // namespace pulley
// ---- end pulley/core/address.hpp ----
// ---- begin pulley/core/version.hpp ----

/// pulley's version, as `project(pulley VERSION ...)` in CMakeLists.txt says (a test checks
/// that they agree) and as the release tag `v<major>.<minor>.<patch>` names it.
#define PULLEY_VERSION_MAJOR 0
#define PULLEY_VERSION_MINOR 3
#define PULLEY_VERSION_PATCH 0

namespace pulley {

/// A version number; compare it to require a minimum.
struct Version {
  int major = 0;
  int minor = 0;
  int patch = 0;

  friend constexpr auto operator<=>(const Version&, const Version&) = default;
};

/// The version of these headers.
inline constexpr Version version{PULLEY_VERSION_MAJOR, PULLEY_VERSION_MINOR, PULLEY_VERSION_PATCH};

}  // namespace pulley
// ---- end pulley/core/version.hpp ----
// ---- begin pulley/optimizers/adagrad.hpp ----

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

// ---- begin pulley/core/detail/lanes.hpp ----

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#if __has_include(<experimental/simd>)
#include <experimental/simd>
#endif

// GCC 12's AVX-512 square root (_mm512_sqrt_ps, reached through std::experimental::simd's
// sqrt where the target has AVX-512, e.g. -march=native) starts from _mm512_undefined_ps,
// which it defines as a variable initialized from itself: -Wuninitialized and
// -Wmaybe-uninitialized then warn in every function it is inlined into (GCC bug 105593,
// fixed in GCC 13), and a -Werror build of the user's own code fails. Off for this file's
// code, where every rule's square root is taken (`lane_sqrt`), and for what it inlines
// (tests/warnings/ builds the optimizers so).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace pulley::detail {

/// True where `lanewise` runs a vector of lanes at a time (the standard library has
/// std::experimental::simd: libstdc++ 11 and later), false where it runs one value at a
/// time.
#if defined(__cpp_lib_experimental_parallel_simd) && __cpp_lib_experimental_parallel_simd >= 201803L
#define PULLEY_DETAIL_VECTOR_LANES 1
inline constexpr bool kVectorLanes = true;
#else
inline constexpr bool kVectorLanes = false;
#endif

/// `lanewise` and `lanewise_ordinary` (below): with `kCheck`, also whether each value
/// written is ordinary, and so is each value the rule returns, if it returns one (a
/// condition it asserts, such as a slot at or above a floor: not negative either). On the
/// values' bits, as `fold_ordinary` does (integer operations, which no floating-point
/// option such as -ffinite-math-only lets the compiler rewrite): the exponent field plus 69
/// carries into the top bit exactly for magnitudes of 2^60 and up, Inf and NaN among them;
/// for the arrays that must not be negative, the sign bit too.
template <bool kCheck, std::size_t kSigned, class Rule, std::same_as<float>... Out>
bool lanes(std::size_t begin, std::size_t end, Rule rule, const float* in, Out*... out) {
  // `rule` is a copy of the caller's, local here: no store through `out` can reach what it
  // captured by value, so its constants stay in registers for the whole loop.
  static_assert(sizeof...(Out) > 0, "lanewise writes at least one array");
  constexpr std::size_t kOut = sizeof...(Out);
  // Folds `bits`, a value written to array k (or a vector of them), into `lane`.
  const auto fold = []<std::size_t k>(std::integral_constant<std::size_t, k>, auto& lane, const auto& bits) {
    if constexpr (k < kSigned) {
      lane |= (bits & kExponentBits) + kOrdinaryCarry;
    } else {
      lane |= ((bits & kExponentBits) + kOrdinaryCarry) | (bits & kSignBit);
    }
  };
  constexpr std::size_t kAsserted = kOut;  // fold's index of what the rule returns: not negative
  std::uint32_t lane = 0;  // the scalar values' fold
  const auto fold_scalars = [&](std::size_t i, const auto&... arrays) {
    [&]<std::size_t... k>(std::index_sequence<k...>) {
      const std::array<float, kOut> written{arrays[i]...};
      (fold(std::integral_constant<std::size_t, k>{}, lane, std::bit_cast<std::uint32_t>(written[k])), ...);
    }(std::make_index_sequence<kOut>{});
  };
#if defined(PULLEY_DETAIL_VECTOR_LANES)
  namespace stdx = std::experimental;
  // AVX without AVX2 (-mavx, -march=sandybridge) has vectors of 8 floats but none of 8
  // integers, so the folds of the values' bits run at SSE2's width of 4 there.
#if defined(__AVX__) && !defined(__AVX2__)
  using V = stdx::simd<float, stdx::simd_abi::deduce_t<float, 4>>;
#else
  using V = stdx::native_simd<float>;
#endif
  using U = stdx::rebind_simd_t<std::uint32_t, V>;
  static_assert(sizeof(U) == sizeof(V) && std::is_trivially_copyable_v<U> && std::is_trivially_copyable_v<V>,
                "a vector of floats and one of their bits are bit casts of each other");
  constexpr std::size_t kWidth = V::size();
  // Two accumulators of folded lanes, a vector each: consecutive vectors fold into
  // different ones, so that no vector waits on the fold of the one before. Sgd's light
  // rule runs a fifth faster than with one (Momentum's about a twentieth); four gained no
  // more, and Ftrl's heavy rule measured slower with them (BENCHMARKS.md).
  constexpr std::size_t kAccumulators = 2;
  U folded[kAccumulators] = {};
  // What the rule returns for the padded tail (below), checked for its elements only.
  [[maybe_unused]] float asserted_tail[kWidth] = {};
  // One vector: the rule over kWidth values of `x` and of each `ys[k]`, written back there
  // (with kCheck, the values written folded into `lanes_folded`, one of `folded`).
  const auto run = [&](const float* x, const std::array<float*, kOut>& ys, bool check,
                       U& lanes_folded) {
    [&]<std::size_t... k>(std::index_sequence<k...>) {
      V values[kOut] = {V(ys[k], stdx::element_aligned)...};
      if constexpr (std::is_void_v<decltype(rule(V(x, stdx::element_aligned), values[k]...))>) {
        rule(V(x, stdx::element_aligned), values[k]...);
      } else {
        const V asserted = rule(V(x, stdx::element_aligned), values[k]...);
        if (kCheck && check)
          fold(std::integral_constant<std::size_t, kAsserted>{}, lanes_folded,
               std::bit_cast<U>(asserted));
        if (kCheck && !check) asserted.copy_to(asserted_tail, stdx::element_aligned);
      }
      if (kCheck && check)
        (fold(std::integral_constant<std::size_t, k>{}, lanes_folded, std::bit_cast<U>(values[k])),
         ...);
      (values[k].copy_to(ys[k], stdx::element_aligned), ...);
    }
    (std::make_index_sequence<kOut>{});
  };
  std::size_t i = begin;
  for (; i + kAccumulators * kWidth <= end; i += kAccumulators * kWidth) {
    for (std::size_t a = 0; a < kAccumulators; ++a) {
      run(in + i + a * kWidth, {(out + i + a * kWidth)...}, true, folded[a]);
    }
  }
  for (; i + kWidth <= end; i += kWidth) run(in + i, {(out + i)...}, true, folded[0]);
  if (i < end) {
    // The last end - i < kWidth elements, in one vector padded with zeros; what the rule
    // makes of the padding is dropped, and only the elements written are checked.
    const std::size_t n = end - i;
    const std::array<float*, kOut> arrays{(out + i)...};
    float padded_in[kWidth] = {};
    float padded[kOut][kWidth] = {};
    std::array<float*, kOut> to_padded{};
    std::copy_n(in + i, n, padded_in);
    for (std::size_t k = 0; k < kOut; ++k) {
      std::copy_n(arrays[k], n, padded[k]);
      to_padded[k] = padded[k];
    }
    run(padded_in, to_padded, false, folded[0]);
    for (std::size_t k = 0; k < kOut; ++k) std::copy_n(padded[k], n, arrays[k]);
    if constexpr (kCheck) {
      for (std::size_t j = 0; j < n; ++j) {
        fold_scalars(j, (out + i)...);
        fold(std::integral_constant<std::size_t, kAsserted>{}, lane,
             std::bit_cast<std::uint32_t>(asserted_tail[j]));
      }
    }
  }
  if constexpr (!kCheck) return true;
  for (std::size_t a = 1; a < kAccumulators; ++a) folded[0] |= folded[a];
  return (lane & kSignBit) == 0 && stdx::none_of((folded[0] & kSignBit) != 0U);
#else
  for (std::size_t i = begin; i < end; ++i) {
    if constexpr (std::is_void_v<decltype(rule(in[i], out[i]...))>) {
      rule(in[i], out[i]...);
    } else {
      const float asserted = rule(in[i], out[i]...);
      if constexpr (kCheck)
        fold(std::integral_constant<std::size_t, kAsserted>{}, lane,
             std::bit_cast<std::uint32_t>(asserted));
    }
    if constexpr (kCheck) fold_scalars(i, out...);
  }
  return (lane & kSignBit) == 0;
#endif
}

/// Runs `rule(in[i], out[i]...)` for every i in [begin, end): `in` is read, each `out` is
/// read and written through the references the rule gets. The rule is a generic lambda
/// written once for a value and for a vector of them: it takes square roots with
/// `lane_sqrt` (below), and mixes its arguments with plain floats. The rule is copied (so it
/// must be copyable, and a state of its own does not outlive the call): one that captures
/// its constants by value has them kept in registers (captured by reference, they are read
/// again for every vector, as a store through `out` might have changed them).
///
/// Why not a plain loop: `std::sqrt` may set errno, so a loop over it does not vectorize
/// unless the user builds with -fno-math-errno, which a header-only library cannot ask
/// for; Adam's, Adagrad's and RMSProp's updates were a scalar square root and division per
/// element. With std::experimental::simd every element goes through native_simd<float> (4
/// lanes with SSE2, 8 with AVX, 16 with AVX-512): the range in whole vectors, and the last
/// few elements in one vector padded with zeros, so that each element of an update is
/// computed by the same code whatever its position. Each lane does the scalar rule's IEEE
/// operations in the same order (square root and division are correctly rounded in both),
/// so the results are the plain loop's bit for bit where the compiler does not fuse a
/// multiply and an add into one rounding (x86-64's baseline, which has no FMA); where it
/// does (`-march=native`, aarch64) an element may differ from the plain loop's in its last
/// bit, alike on every task built the same way.
template <class Rule, std::same_as<float>... Out>
void lanewise(std::size_t begin, std::size_t end, Rule&& rule, const float* in, Out*... out) {
  (void)lanes<false, 0>(begin, end, rule, in, out...);
}

/// The square root of one value, or of each lane of a vector of them: what a `lanewise`
/// rule calls (std::sqrt, or std::experimental::sqrt, whose AVX-512 form GCC 12 warns about
/// wherever it is inlined: see the top of this file).
template <class V>
V lane_sqrt(V x) {
  using std::sqrt;
  return sqrt(x);
}

/// `mask ? a : b` for one value: the conditional a `lanewise` rule writes, which for a
/// vector of lanes (below) picks lane by lane.
inline float choose(bool mask, float a, float b) noexcept { return mask ? a : b; }
#if defined(PULLEY_DETAIL_VECTOR_LANES)
/// `choose` for a vector of lanes: a's lanes where `mask` is set, b's elsewhere.
template <class T, class Abi>
std::experimental::simd<T, Abi> choose(const std::experimental::simd_mask<T, Abi>& mask,
                                       const std::experimental::simd<T, Abi>& a, std::experimental::simd<T, Abi> b) {
  std::experimental::where(mask, b) = a;
  return b;
}
#endif

/// `lanewise`, and true if every value it wrote is ordinary (its magnitude below
/// kOrdinaryMagnitude, so neither NaN nor Inf), the values of the first `kSigned` arrays of
/// `out` of any sign and those of the others not negative either, -0 included (sums of
/// squares, whose square root an optimizer takes): what an optimizer's `apply_bounded` says
/// of the values it leaves (BoundsMagnitudes), judged in the lanes that computed them,
/// while they are in registers, not by reading them again. A rule may also return a value
/// (a float, or a vector as its arguments are) that must be ordinary and not negative: a
/// condition of the values it wrote that the proof of the next update needs (Ftrl returns
/// its accumulator less the floor the proof assumes).
template <std::size_t kSigned, class Rule, std::same_as<float>... Out>
bool lanewise_ordinary(std::size_t begin, std::size_t end, Rule&& rule, const float* in, Out*... out) {
  static_assert(kSigned <= sizeof...(Out), "kSigned counts arrays of out");
  return lanes<true, kSigned>(begin, end, rule, in, out...);
}

/// `lanewise_ordinary` for a rule of additions, subtractions and multiplications only (no
/// division, no `lane_sqrt`, no `choose`), such as Sgd's: where the build targets less than
/// AVX2 and the CPU has it, the rule runs a value at a time in a loop the compiler
/// vectorizes for AVX2 (`run_avx2`, core/magnitude.hpp), each value folded as `lanes` folds
/// it; elsewhere it is `lanewise_ordinary`. The values written are
/// the same in both, bit for bit (no FMA in either). Not for a rule with a square root,
/// which would not vectorize so (std::sqrt may set errno), nor one with a division, which
/// -ffast-math lets the compiler turn into an approximate reciprocal in the vectors and not
/// in the loop's scalar tail; nor with a condition that changes from one element to the
/// next (GCC does not vectorize the branch): make such a choice outside the loop.
template <std::size_t kSigned, class Rule, std::same_as<float>... Out>
bool arithmetic_lanewise_ordinary(std::size_t begin, std::size_t end, Rule&& rule, const float* in,
                                  Out*... out) {
  static_assert(kSigned <= sizeof...(Out), "kSigned counts arrays of out");
#if defined(PULLEY_DETAIL_AVX2_COPY)
  if (kCpuHasAvx2) {
    const auto one_at_a_time = [&, r = rule] {
      std::uint32_t lane = 0;
      for (std::size_t i = begin; i < end; ++i) {
        if constexpr (std::is_void_v<decltype(r(in[i], out[i]...))>) {
          r(in[i], out[i]...);
        } else {
          fold_ordinary_non_negative(lane, r(in[i], out[i]...));
        }
        std::size_t k = 0;
        ((k++ < kSigned ? fold_ordinary(lane, out[i]) : fold_ordinary_non_negative(lane, out[i])),
         ...);
      }
      return (lane & kSignBit) == 0;
    };
    return run_avx2(one_at_a_time);
  }
#endif
  return lanes<true, kSigned>(begin, end, rule, in, out...);
}

}  // namespace pulley::detail

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
// ---- end pulley/core/detail/lanes.hpp ----

namespace pulley {

/// Adagrad with Keras' defaults and rule:
///   accumulator += g^2
///   w -= learning_rate * g / (sqrt(accumulator) + epsilon)
/// The same rule updates a dense part (`apply`) or one row of an embedding table
/// (`apply_row`, TF's SparseApplyAdagrad), whose accumulator is its one row slot.
struct Adagrad {
  float learning_rate = 0.001F;            ///< step size
  float initial_accumulator_value = 0.1F;  ///< starting sum of squares
  float epsilon = 1e-7F;                   ///< keeps the division finite

  /// What is wrong with the settings, or nullopt (Optimizer: settings_error).
  [[nodiscard]] std::optional<std::string> settings_error() const {
    std::optional<std::string> error = SettingsCheck()
                                           .non_negative("learning_rate", learning_rate)
                                           .non_negative("initial_accumulator_value", initial_accumulator_value)
                                           .non_negative("epsilon", epsilon)
                                           .error();
    if (!error && epsilon == 0 && initial_accumulator_value == 0) {
      error = "epsilon and initial_accumulator_value are both 0: a zero gradient would divide 0 by 0";
    }
    return error;
  }

  /// The sum of squared gradients, one value per element.
  struct State {
    std::vector<float> accumulator;
  };

  /// Fresh slots for a part of n elements.
  [[nodiscard]] State make_state(std::size_t n) const {
    return {std::vector<float>(n, initial_accumulator_value)};
  }

  /// Updates `w` in place from gradient `g` (same size as the state).
  void apply(State& state, std::span<float> w, std::span<const float> g) const { (void)apply_bounded(state, w, g); }

  /// `apply`, returning a bound of the magnitudes of the weights and accumulators
  /// afterwards (+infinity if an accumulator is negative: BoundsMagnitudes).
  float apply_bounded(State& state, std::span<float> w, std::span<const float> g) const {
    return update(w.data(), state.accumulator.data(), g.data(), w.size());
  }

  /// True if no weight or accumulator can leave kFiniteBound when each is at most `largest`
  /// (the accumulators not negative) and each gradient element at most `largest_gradient`
  /// in magnitude (BoundsMagnitudes). A step is then at most learning_rate × (1 + 2^-20):
  /// where g² rounds to nothing (|g| < 2^-63), |g| / epsilon is below 2^-23 for an epsilon
  /// of 2^-40 or more. With a smaller epsilon a zero accumulator lets a tiny gradient make
  /// a huge step (or 0/0), so nothing is proven then.
  [[nodiscard]] bool stays_finite_given(const State& /*state*/, float largest, float largest_gradient) const {
    const double s = largest;
    const double g = largest_gradient;
    return epsilon >= 0x1p-40F && proven_finite(s + g * g) && proven_finite(s + std::abs(double{learning_rate}));
  }

  /// The accumulator, for checkpoints.
  [[nodiscard]] std::array<OptimizerSlot, 1> slots(State& state) const {
    return {OptimizerSlot{"accumulator", state.accumulator}};
  }
  /// No counters.
  [[nodiscard]] std::array<OptimizerCounter, 0> counters(State& /*state*/) const { return {}; }

  /// True if `apply` keeps every weight and the accumulator within kFiniteBound. It works
  /// out the update itself (as `apply` does, without storing it), so it holds for any
  /// accumulators and settings (epsilon = 0 with a zero accumulator and gradient is 0/0);
  /// it costs about as much as `apply`, and is asked only what `stays_finite_given` left.
  [[nodiscard]] bool stays_finite(const State& state, std::span<const float> w,
                                  std::span<const float> g) const {
    const float lr = learning_rate;
    const float eps = epsilon;
    const float* wp = w.data();
    const float* gp = g.data();
    const float* ap = state.accumulator.data();
    return bounded(w.size(), [&](std::size_t i, std::uint32_t& lane) {
      const float a = ap[i] + gp[i] * gp[i];
      detail::fold_bound_non_negative(lane, a);  // else its square root is NaN
      detail::fold_bound(lane, wp[i] - lr * gp[i] / (std::sqrt(a) + eps));
    });
  }

  /// A table row keeps one slot: its accumulator.
  static constexpr std::size_t kRowSlots = 1;

  /// The row slot's name, the same as the dense slot's.
  [[nodiscard]] std::array<std::string_view, kRowSlots> row_slot_names() const {
    return {"accumulator"};
  }

  /// Starts a new row's accumulator at initial_accumulator_value.
  void init_row(std::span<float> slots) const {
    std::ranges::fill(slots, initial_accumulator_value);
  }

  /// Updates one table row `w` in place from its gradient `g`, as `apply` does; `slots`
  /// holds the row's accumulator (w.size() floats).
  void apply_row(std::span<float> w, std::span<float> slots, std::span<const float> g,
                 const RowContext& context) const {
    (void)apply_row_bounded(w, slots, g, context);
  }

  /// `apply_row`, returning a bound of the row's magnitudes afterwards (+infinity if its
  /// accumulator is negative: BoundsRowMagnitudes).
  float apply_row_bounded(std::span<float> w, std::span<float> slots, std::span<const float> g,
                          const RowContext& /*context*/) const {
    return update(w.data(), slots.data(), g.data(), w.size());
  }

  /// `stays_finite_given` for a row (BoundsRowMagnitudes): the same rule.
  [[nodiscard]] bool row_stays_finite_given(float largest, float largest_gradient, const RowContext& /*context*/) const {
    return stays_finite_given(State{}, largest, largest_gradient);
  }

 private:
  /// The rule over n elements, behind `apply` and `apply_row`: a bound of the magnitudes
  /// it leaves (BoundsMagnitudes).
  float update(float* __restrict w, float* __restrict accumulator, const float* __restrict g,
               std::size_t n) const {
    const float lr = learning_rate;
    const float eps = epsilon;
    const bool ordinary =
        detail::lanewise_ordinary<1>(  // w of any sign, the accumulator not negative
            0, n,
            [=](auto gi, auto& wi, auto& ai) {  // (by value: the constants stay in registers)
              ai += gi * gi;
              wi -= lr * gi / (detail::lane_sqrt(ai) + eps);
            },
            g, w, accumulator);
    return magnitude_bound(ordinary);
  }
};
static_assert(Optimizer<Adagrad>);
static_assert(BoundsMagnitudes<Adagrad>);
static_assert(RowWiseOptimizer<Adagrad>);
static_assert(BoundsRowMagnitudes<Adagrad>);

}  // namespace pulley
// ---- end pulley/optimizers/adagrad.hpp ----
// ---- begin pulley/optimizers/adam.hpp ----

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace pulley {

/// Adam (Kingma & Ba) in TensorFlow's form, which folds bias correction into the step size:
///   t += 1
///   lr_t = learning_rate * sqrt(1 - beta_2^t) / (1 - beta_1^t)
///   m = beta_1 * m + (1 - beta_1) * g
///   v = beta_2 * v + (1 - beta_2) * g^2
///   w -= lr_t * m / (sqrt(v) + epsilon)
/// Defaults are Keras'. `t` counts this part's updates, i.e. the global step in sync mode.
///
/// A row of an embedding table (`apply_row`) follows TensorFlow's LazyAdam: its moments are
/// its two row slots and advance only when the row is pushed (an untouched row's do not
/// decay), while `t` is the table's update count `RowContext::updates`, the same for every
/// row of one update. A row pushed at every update therefore moves exactly as `apply` moves
/// a dense element.
struct Adam {
  float learning_rate = 0.001F;  ///< step size
  float beta_1 = 0.9F;           ///< decay of the first moment
  float beta_2 = 0.999F;         ///< decay of the second moment
  float epsilon = 1e-7F;         ///< keeps the division finite

  /// What is wrong with the settings, or nullopt (Optimizer: settings_error).
  [[nodiscard]] std::optional<std::string> settings_error() const {
    return SettingsCheck()
        .non_negative("learning_rate", learning_rate)
        .decay("beta_1", beta_1)
        .decay("beta_2", beta_2)
        .non_negative("epsilon", epsilon)
        .error();
  }

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
  void apply(State& state, std::span<float> w, std::span<const float> g) const { (void)apply_bounded(state, w, g); }

  /// `apply`, returning a bound of the magnitudes of the weights and moments afterwards
  /// (+infinity if a second moment is negative: BoundsMagnitudes).
  float apply_bounded(State& state, std::span<float> w, std::span<const float> g) const {
    ++state.t;
    return update(step_size(state.t), w.data(), state.m.data(), state.v.data(), g.data(), w.size());
  }

  /// True if no weight or moment can leave kFiniteBound when each is at most `largest` (the
  /// second moments not negative) and each gradient element at most `largest_gradient` in
  /// magnitude: `stays_finite`'s bounds over magnitudes (BoundsMagnitudes).
  [[nodiscard]] bool stays_finite_given(const State& state, float largest, float largest_gradient) const {
    return proven_at(step_size(state.t + 1), largest, largest_gradient);
  }

  /// The moments, for checkpoints.
  [[nodiscard]] std::array<OptimizerSlot, 2> slots(State& state) const {
    return {OptimizerSlot{"m", state.m}, OptimizerSlot{"v", state.v}};
  }
  /// The update count, for checkpoints.
  [[nodiscard]] std::array<OptimizerCounter, 1> counters(State& state) const {
    return {OptimizerCounter{"t", &state.t}};
  }

  /// True if `apply` keeps every weight and both moments within kFiniteBound (and the second
  /// moments not negative, as a restore could have set them). A step is at most
  /// lr_t * |m| / epsilon, which bounds it without a square root or a division.
  [[nodiscard]] bool stays_finite(const State& state, std::span<const float> w,
                                  std::span<const float> g) const {
    const float reach = std::abs(step_size(state.t + 1)) / epsilon;
    const float b1 = beta_1;
    const float b2 = beta_2;
    const float* wp = w.data();
    const float* gp = g.data();
    const float* mp = state.m.data();
    const float* vp = state.v.data();
    return bounded(w.size(), [&](std::size_t i, std::uint32_t& lane) {
      const float m1 = b1 * mp[i] + (1.0F - b1) * gp[i];
      const float v1 = b2 * vp[i] + (1.0F - b2) * gp[i] * gp[i];
      detail::fold_bound(lane, m1);
      detail::fold_bound_non_negative(lane, v1);  // else its square root is NaN
      detail::fold_bound(lane, std::abs(wp[i]) + reach * std::abs(m1));
    });
  }

  /// A table row keeps two slots: its first and second moments.
  static constexpr std::size_t kRowSlots = 2;

  /// The row slots' names, the same as the dense slots'.
  [[nodiscard]] std::array<std::string_view, kRowSlots> row_slot_names() const {
    return {"m", "v"};
  }

  /// Starts a new row's moments at zero.
  void init_row(std::span<float> slots) const { std::ranges::fill(slots, 0.0F); }

  /// Updates one table row `w` in place from its gradient `g` (LazyAdam): `slots` holds the
  /// row's m then v (w.size() floats each), and `t` is `context.updates`, which must be at
  /// least 1 (the step size of t = 0 is 0/0).
  void apply_row(std::span<float> w, std::span<float> slots, std::span<const float> g,
                 const RowContext& context) const {
    (void)apply_row_bounded(w, slots, g, context);
  }

  /// `apply_row`, returning a bound of the row's magnitudes afterwards (+infinity if a
  /// second moment is negative: BoundsRowMagnitudes).
  float apply_row_bounded(std::span<float> w, std::span<float> slots, std::span<const float> g,
                          const RowContext& context) const {
    const std::size_t n = w.size();
    return update(step_size(context.updates), w.data(), slots.data(), slots.data() + n, g.data(), n);
  }

  /// `stays_finite_given` for a row at the table's update `context.updates`
  /// (BoundsRowMagnitudes): the same bounds at that update's step size.
  [[nodiscard]] bool row_stays_finite_given(float largest, float largest_gradient, const RowContext& context) const {
    return proven_at(step_size(context.updates), largest, largest_gradient);
  }

 private:
  /// `stays_finite_given`'s bounds at step size lr_t.
  [[nodiscard]] bool proven_at(float lr_t, float largest, float largest_gradient) const {
    const double s = largest;
    const double g = largest_gradient;
    const double m1 = beta_1 * s + (1.0 - beta_1) * g;
    const double v1 = beta_2 * s + (1.0 - beta_2) * g * g;
    const double reach = std::abs(double{lr_t}) / epsilon;
    return proven_finite(m1) && proven_finite(v1) && proven_finite(s + reach * m1);
  }

  /// The rule over n elements at step size lr_t, behind `apply` and `apply_row`: a bound
  /// of the magnitudes it leaves (BoundsMagnitudes).
  float update(float lr_t, float* __restrict w, float* __restrict m, float* __restrict v,
               const float* __restrict g, std::size_t n) const {
    const float b1 = beta_1;
    const float b2 = beta_2;
    const float eps = epsilon;
    const bool ordinary = detail::lanewise_ordinary<2>(  // w and m of any sign, v not negative
        0, n,
        [=](auto gi, auto& wi, auto& mi, auto& vi) {  // (by value: the constants stay in registers)
          mi = b1 * mi + (1.0F - b1) * gi;
          vi = b2 * vi + (1.0F - b2) * gi * gi;
          wi -= lr_t * mi / (detail::lane_sqrt(vi) + eps);
        },
        g, w, m, v);
    return magnitude_bound(ordinary);
  }

  /// lr_t of update number t.
  [[nodiscard]] float step_size(std::int64_t t) const {
    const auto td = static_cast<double>(t);
    return static_cast<float>(learning_rate * std::sqrt(1.0 - std::pow(double{beta_2}, td)) /
                              (1.0 - std::pow(double{beta_1}, td)));
  }
};
static_assert(Optimizer<Adam>);
static_assert(BoundsMagnitudes<Adam>);
static_assert(RowWiseOptimizer<Adam>);
static_assert(BoundsRowMagnitudes<Adam>);

}  // namespace pulley
// ---- end pulley/optimizers/adam.hpp ----
// ---- begin pulley/optimizers/ftrl.hpp ----

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace pulley {

/// FTRL-Proximal (McMahan et al., "Ad Click Prediction", 2013) with TensorFlow's rule
/// (ApplyFtrlV2) and Keras' defaults, Keras' `beta` folded into the L2 strength as Keras
/// does. Per element, with p = learning_rate_power and l2_adj = l2 + beta / (2 * lr):
///   g_shrink   = g + 2 * l2_shrinkage * w
///   accum_new  = accumulator + g^2
///   linear    += g_shrink - (accum_new^(-p) - accumulator^(-p)) / lr * w
///   quadratic  = accum_new^(-p) / lr + 2 * l2_adj
///   w          = |linear| > l1 ? (sign(linear) * l1 - linear) / quadratic : 0
///   accumulator = accum_new
/// The weight is worked out from the slots, not stepped from its old value: L1 sets it to
/// exactly 0 while |linear| stays within l1, which is what makes FTRL's models sparse. The
/// hyper-parameters must be those Keras accepts: learning_rate > 0, learning_rate_power
/// <= 0, initial_accumulator_value >= 0, and the regularization strengths and beta >= 0.
///
/// The same rule updates a dense part (`apply`) or one row of an embedding table
/// (`apply_row`, TF's SparseApplyFtrlV2), whose accumulator and linear are its two row
/// slots. A row's weights can move on a zero gradient: its first update replaces its
/// initial value with the solution from its slots, and l2_shrinkage keeps pulling it to 0.
///
/// Finiteness is proven from magnitudes (BoundsMagnitudes) for Keras' learning_rate_power
/// of -0.5 and an initial_accumulator_value of about 2^-10 or more (or an L2 strength):
/// `apply_bounded` judges in its pass that the weights and slots it wrote are ordinary and
/// that no accumulator is below initial_accumulator_value (which the rule only adds to).
/// The weight it wrote is then |linear| / quadratic at most, and quadratic at least
/// sqrt(initial_accumulator_value) / lr + 2 * l2_adj, which bounds the next update's
/// change of linear (at most |g| * |w| / lr) without reading the part. Other powers, and
/// parts restored or initialized since, are checked by `stays_finite`.
struct Ftrl {
  float learning_rate = 0.001F;                       ///< lr: step size
  float learning_rate_power = -0.5F;                  ///< p: how lr decays with the accumulator
  float initial_accumulator_value = 0.1F;             ///< starting sum of squares
  float l1_regularization_strength = 0.0F;            ///< l1: zeroes weights with small |linear|
  float l2_regularization_strength = 0.0F;            ///< l2: shrinks weights towards 0
  float l2_shrinkage_regularization_strength = 0.0F;  ///< l2_shrinkage: a magnitude penalty
  float beta = 0.0F;                                  ///< Keras' beta: adds beta / (2 * lr) to l2

  /// What is wrong with the settings, or nullopt (Optimizer: settings_error).
  [[nodiscard]] std::optional<std::string> settings_error() const {
    return SettingsCheck()
        .positive("learning_rate", learning_rate)
        .non_positive("learning_rate_power", learning_rate_power)
        .non_negative("initial_accumulator_value", initial_accumulator_value)
        .non_negative("l1_regularization_strength", l1_regularization_strength)
        .non_negative("l2_regularization_strength", l2_regularization_strength)
        .non_negative("l2_shrinkage_regularization_strength", l2_shrinkage_regularization_strength)
        .non_negative("beta", beta)
        .error();
  }

  /// The accumulator (sum of squared gradients) and linear slots, one value per element.
  struct State {
    std::vector<float> accumulator;
    std::vector<float> linear;
  };

  /// Fresh slots for a part of n elements.
  [[nodiscard]] State make_state(std::size_t n) const {
    return {std::vector<float>(n, initial_accumulator_value), std::vector<float>(n, 0.0F)};
  }

  /// Updates `w` in place from gradient `g` (same size as the state).
  void apply(State& state, std::span<float> w, std::span<const float> g) const {
    (void)apply_bounded(state, w, g);
  }

  /// `apply`, returning a bound of the magnitudes of the weights and slots afterwards:
  /// kOrdinaryMagnitude when every one is below it and no accumulator is below
  /// initial_accumulator_value (for learning_rate_power -0.5), else +infinity: nothing
  /// known (BoundsMagnitudes).
  float apply_bounded(State& state, std::span<float> w, std::span<const float> g) const {
    return update<true>(w.data(), state.accumulator.data(), state.linear.data(), g.data(),
                        w.size());
  }

  /// True if no weight or slot can leave kFiniteBound when each is at most `largest`, no
  /// accumulator below initial_accumulator_value and each weight what the rule made of its
  /// slots (as `apply_bounded` leaves them when it returns a finite bound), and each
  /// gradient element at most `largest_gradient` in magnitude (BoundsMagnitudes). Bounds,
  /// in double, with room for float's rounding:
  ///   accumulator <= largest + g^2
  ///   |linear|    <= largest + g + 2 * l2_shrinkage * |w| + root_step / lr * |w|, where
  ///                  root_step = sqrt(accum_new) - sqrt(accum) is at most g, and |w| is at
  ///                  most largest / q_least; root_step / lr is worked out first (as the
  ///                  rule does), so it too must stay finite (a learning rate below 1e-20)
  ///   |w|         <= (l1 + |linear|) / q_least, where
  ///                  q_least = sqrt(initial_accumulator_value) / lr + 2 * l2_adj
  /// For another learning_rate_power nothing is proven.
  [[nodiscard]] bool stays_finite_given(const State& /*state*/, float largest,
                                        float largest_gradient) const {
    if (learning_rate_power != -0.5F) return false;
    const double lr = learning_rate;
    const double held = largest;
    const double g = largest_gradient;
    const double q_least = std::sqrt(double{initial_accumulator_value}) / lr +
                           2.0 * (double{l2_regularization_strength} + double{beta} / (2.0 * lr));
    if (!(q_least > 0.0)) return false;  // a zero accumulator and no L2: a quotient by 0
    constexpr double kRounding = 1.01;   // the float rule's roundings, each a part in 2^23
    const double accumulator = held + g * g;
    // sqrt(accum_new) - sqrt(accum) in float: at most g, and each root's rounding.
    const double root_step = g + 0x1p-22 * std::sqrt(accumulator);
    const double w = std::min(held, held / q_least * kRounding);
    const double linear =
        kRounding *
        (held + g + 2.0 * double{l2_shrinkage_regularization_strength} * w + root_step * w / lr);
    const double w_new = kRounding * (double{l1_regularization_strength} + linear) / q_least;
    return proven_finite(accumulator) && proven_finite(kRounding * root_step / lr) &&
           proven_finite(linear) && proven_finite(w_new);
  }

  /// The accumulator and linear slots, for checkpoints.
  [[nodiscard]] std::array<OptimizerSlot, 2> slots(State& state) const {
    return {OptimizerSlot{"accumulator", state.accumulator}, OptimizerSlot{"linear", state.linear}};
  }
  /// No counters.
  [[nodiscard]] std::array<OptimizerCounter, 0> counters(State& /*state*/) const { return {}; }

  /// True if `apply` keeps every weight and both slots within kFiniteBound. The new weight
  /// is a quotient of two terms that depend on the slots, so no cheap bound holds for every
  /// state: this runs the update itself (`apply`'s own code) on copies of blocks of
  /// kCheckBlock elements, which stay in L1, and checks its results; it costs about as much
  /// as `apply`.
  [[nodiscard]] bool stays_finite(const State& state, std::span<const float> w,
                                  std::span<const float> g) const {
    const std::size_t n = w.size();
    float wb[kCheckBlock];
    float ab[kCheckBlock];
    float lb[kCheckBlock];
    for (std::size_t begin = 0; begin < n; begin += kCheckBlock) {
      const std::size_t m = std::min(kCheckBlock, n - begin);
      std::copy_n(w.data() + begin, m, wb);
      std::copy_n(state.accumulator.data() + begin, m, ab);
      std::copy_n(state.linear.data() + begin, m, lb);
      (void)update<false>(wb, ab, lb, g.data() + begin, m);
      const bool within = bounded(m, [&](std::size_t i, std::uint32_t& lane) {
        detail::fold_bound(lane, wb[i]);
        detail::fold_bound(lane, ab[i]);
        detail::fold_bound(lane, lb[i]);
      });
      if (!within) return false;
    }
    return true;
  }

  /// A table row keeps two slots: its accumulator and its linear term.
  static constexpr std::size_t kRowSlots = 2;

  /// The row slots' names, the same as the dense slots'.
  [[nodiscard]] std::array<std::string_view, kRowSlots> row_slot_names() const {
    return {"accumulator", "linear"};
  }

  /// Starts a new row's accumulator at initial_accumulator_value and its linear at 0.
  void init_row(std::span<float> slots) const {
    const std::size_t n = slots.size() / kRowSlots;
    std::ranges::fill(slots.first(n), initial_accumulator_value);
    std::ranges::fill(slots.subspan(n), 0.0F);
  }

  /// Updates one table row `w` in place from its gradient `g`, as `apply` does; `slots`
  /// holds the row's accumulator then its linear (w.size() floats each).
  void apply_row(std::span<float> w, std::span<float> slots, std::span<const float> g,
                 const RowContext& /*context*/) const {
    const std::size_t n = w.size();
    (void)update<false>(w.data(), slots.data(), slots.data() + n, g.data(), n);
  }

 private:
  /// The hyper-parameters as one update uses them, copied out of the object once.
  struct Terms {
    float lr;
    float l1;
    float two_l2_adj;        ///< 2 * (l2 + beta / (2 * lr))
    float two_l2_shrinkage;  ///< 2 * l2_shrinkage
    float floor;             ///< initial_accumulator_value: no accumulator falls below it
  };

  /// This object's Terms.
  [[nodiscard]] Terms terms() const {
    const float lr = learning_rate;
    return {lr, l1_regularization_strength,
            2.0F * (l2_regularization_strength + beta / (2.0F * lr)),
            2.0F * l2_shrinkage_regularization_strength, initial_accumulator_value};
  }

  /// Elements `stays_finite` updates in copies at a time.
  static constexpr std::size_t kCheckBlock = 256;

  /// x^(-p) for p = -0.5, Keras' default: a square root, far cheaper than std::pow, of a
  /// value or of a vector of lanes (detail::lanewise).
  struct SqrtPower {
    template <class V>
    V operator()(V x) const {
      return detail::lane_sqrt(x);
    }
  };
  /// x^(-p) for any other p.
  struct AnyPower {
    float minus_p;
    float operator()(float x) const { return std::pow(x, minus_p); }
  };

  /// The rule for one element, or for a vector of them (detail::lanewise), behind `update`.
  /// Returns the new accumulator less `floor`: not negative where the proof holds.
  template <class V, class Power>
  static V step(const Terms& k, Power power, V& w, V& accumulator, V& linear, V g) {
    using std::abs;
    using detail::choose;
    const V zero(0.0F);
    const V g_shrink = g + k.two_l2_shrinkage * w;
    const V accum_new = accumulator + g * g;
    const V power_new = power(accum_new);
    linear += g_shrink - (power_new - power(accumulator)) / k.lr * w;
    const V quadratic = power_new / k.lr + k.two_l2_adj;
    const V sign = choose(linear > zero, V(1.0F), choose(linear < zero, V(-1.0F), zero));
    w = choose(abs(linear) > V(k.l1), (sign * k.l1 - linear) / quadratic, zero);
    accumulator = accum_new;
    return accum_new - k.floor;
  }

  /// The rule over n elements, behind `apply_bounded`, `apply_row` and `stays_finite`: in
  /// vector lanes for Keras' learning_rate_power of -0.5 (a square root, bit for bit the
  /// scalar rule where no multiply and add are fused: detail::lanewise), else one element
  /// at a time (std::pow has no vector form here). With `kBound`, returns `apply_bounded`'s
  /// bound, judged in the lanes (detail::lanewise_ordinary: every value written ordinary,
  /// and the accumulators not below the floor, which also keeps them from being negative);
  /// without, +infinity.
  template <bool kBound>
  float update(float* __restrict w, float* __restrict accumulator, float* __restrict linear,
               const float* __restrict g, std::size_t n) const {
    const Terms k = terms();
    if (learning_rate_power == -0.5F) {
      const auto rule = [k](auto gi, auto& wi, auto& li, auto& ai) {
        return step(k, SqrtPower{}, wi, ai, li, gi);
      };
      if constexpr (kBound) {
        return magnitude_bound(detail::lanewise_ordinary<3>(0, n, rule, g, w, linear, accumulator));
      } else {
        detail::lanewise(0, n, rule, g, w, linear, accumulator);
        return std::numeric_limits<float>::infinity();
      }
    }
    const AnyPower power{-learning_rate_power};
    for (std::size_t i = 0; i < n; ++i) (void)step(k, power, w[i], accumulator[i], linear[i], g[i]);
    return std::numeric_limits<float>::infinity();
  }
};
static_assert(Optimizer<Ftrl>);
static_assert(PredictsFiniteness<Ftrl>);
static_assert(BoundsMagnitudes<Ftrl>);
static_assert(RowWiseOptimizer<Ftrl>);

}  // namespace pulley
// ---- end pulley/optimizers/ftrl.hpp ----
// ---- begin pulley/optimizers/momentum.hpp ----

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
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

  /// What is wrong with the settings, or nullopt (Optimizer: settings_error).
  [[nodiscard]] std::optional<std::string> settings_error() const {
    return SettingsCheck().non_negative("learning_rate", learning_rate).fraction("momentum", momentum).error();
  }

  /// The accumulation slot, one value per element.
  struct State {
    std::vector<float> accumulation;
  };

  /// Fresh slots for a part of n elements.
  [[nodiscard]] State make_state(std::size_t n) const { return {std::vector<float>(n, 0.0F)}; }

  /// Updates `w` in place from gradient `g` (same size as the state).
  void apply(State& state, std::span<float> w, std::span<const float> g) const { (void)apply_bounded(state, w, g); }

  /// `apply`, returning a bound of the magnitudes of the weights and the accumulation
  /// afterwards, judged in the lanes that wrote them (BoundsMagnitudes).
  float apply_bounded(State& state, std::span<float> w, std::span<const float> g) const {
    const float lr = learning_rate;
    const float mu = momentum;
    const std::size_t n = w.size();
    const bool nesterov = use_nesterov;
    const auto rule = [lr, mu, nesterov](auto gi, auto& ai, auto& wi) {
      ai = mu * ai + gi;
      wi -= lr * (nesterov ? gi + mu * ai : ai);
    };
    // Both arrays of any sign.
    const bool ordinary =
        detail::lanewise_ordinary<2>(0, n, rule, g.data(), state.accumulation.data(), w.data());
    return magnitude_bound(ordinary);
  }

  /// True if no weight or accumulation can leave kFiniteBound when each is at most
  /// `largest` and each gradient element at most `largest_gradient` in magnitude
  /// (BoundsMagnitudes).
  [[nodiscard]] bool stays_finite_given(const State& /*state*/, float largest, float largest_gradient) const {
    const double s = largest;
    const double g = largest_gradient;
    const double mu = std::abs(double{momentum});
    const double acc = mu * s + g;
    const double step = use_nesterov ? g + mu * acc : acc;
    return proven_finite(acc) && proven_finite(s + std::abs(double{learning_rate}) * step);
  }

  /// The accumulation, for checkpoints.
  [[nodiscard]] std::array<OptimizerSlot, 1> slots(State& state) const {
    return {OptimizerSlot{"accumulation", state.accumulation}};
  }
  /// No counters.
  [[nodiscard]] std::array<OptimizerCounter, 0> counters(State& /*state*/) const { return {}; }

  /// True if `apply` keeps every weight and the accumulation within kFiniteBound.
  [[nodiscard]] bool stays_finite(const State& state, std::span<const float> w,
                                  std::span<const float> g) const {
    const float lr = learning_rate;
    const float mu = momentum;
    const float* wp = w.data();
    const float* gp = g.data();
    const float* ap = state.accumulation.data();
    return bounded(w.size(), [&](std::size_t i, std::uint32_t& lane) {
      const float acc = mu * ap[i] + gp[i];
      // Nesterov's step g + mu * acc; plain momentum's acc (the same float ops as apply's).
      const float step = use_nesterov ? gp[i] + mu * acc : acc;
      detail::fold_bound(lane, acc);
      detail::fold_bound(lane, wp[i] - lr * step);
    });
  }
};
static_assert(Optimizer<Momentum>);
static_assert(BoundsMagnitudes<Momentum>);

}  // namespace pulley
// ---- end pulley/optimizers/momentum.hpp ----
// ---- begin pulley/optimizers/rmsprop.hpp ----

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace pulley {

/// RMSProp with TensorFlow's rule (ApplyRMSProp) and Keras' defaults, where `ms` is the
/// slot "rms" and `mom` the slot "momentum":
///   ms  = rho * ms + (1 - rho) * g^2
///   mom = momentum * mom + learning_rate * g / sqrt(ms + epsilon)
///   w  -= mom
/// At the default momentum = 0, `mom` is just the last step. Not centered: the mean
/// gradient is not subtracted from `ms` (TF's ApplyCenteredRMSProp, Keras'
/// `centered=True`, is another rule with a third slot).
///
/// The same rule updates a dense part (`apply`) or one row of an embedding table
/// (`apply_row`, TF's SparseApplyRMSProp), whose rms and momentum are its two row slots.
struct RmsProp {
  float learning_rate = 0.001F;  ///< step size
  float rho = 0.9F;              ///< decay of the mean square
  float momentum = 0.0F;         ///< decay of the momentum slot (0: plain RMSProp)
  float epsilon = 1e-7F;         ///< keeps the division finite

  /// What is wrong with the settings, or nullopt (Optimizer: settings_error).
  [[nodiscard]] std::optional<std::string> settings_error() const {
    return SettingsCheck()
        .non_negative("learning_rate", learning_rate)
        .decay("rho", rho)
        .fraction("momentum", momentum)
        .non_negative("epsilon", epsilon)
        .error();
  }

  /// The mean-square and momentum slots, one value per element.
  struct State {
    std::vector<float> rms;
    std::vector<float> momentum;
  };

  /// Fresh slots for a part of n elements.
  [[nodiscard]] State make_state(std::size_t n) const {
    return {std::vector<float>(n, 0.0F), std::vector<float>(n, 0.0F)};
  }

  /// Updates `w` in place from gradient `g` (same size as the state).
  void apply(State& state, std::span<float> w, std::span<const float> g) const { (void)apply_bounded(state, w, g); }

  /// `apply`, returning a bound of the magnitudes of the weights and slots afterwards
  /// (+infinity if a mean square is negative: BoundsMagnitudes).
  float apply_bounded(State& state, std::span<float> w, std::span<const float> g) const {
    return update(w.data(), state.rms.data(), state.momentum.data(), g.data(), w.size());
  }

  /// True if no weight or slot can leave kFiniteBound when each is at most `largest` (the
  /// mean squares not negative) and each gradient element at most `largest_gradient` in
  /// magnitude: a step's new part is at most learning_rate * |g| / sqrt(epsilon)
  /// (BoundsMagnitudes; nothing is proven with epsilon = 0).
  [[nodiscard]] bool stays_finite_given(const State& /*state*/, float largest, float largest_gradient) const {
    const double s = largest;
    const double g = largest_gradient;
    const double mom = std::abs(double{momentum}) * s + std::abs(double{learning_rate}) * g / std::sqrt(double{epsilon});
    return epsilon > 0 && proven_finite(s + g * g) && proven_finite(mom) && proven_finite(s + mom);
  }

  /// The rms and momentum slots, for checkpoints.
  [[nodiscard]] std::array<OptimizerSlot, 2> slots(State& state) const {
    return {OptimizerSlot{"rms", state.rms}, OptimizerSlot{"momentum", state.momentum}};
  }
  /// No counters.
  [[nodiscard]] std::array<OptimizerCounter, 0> counters(State& /*state*/) const { return {}; }

  /// True if `apply` keeps every weight and both slots within kFiniteBound. It works out
  /// the update itself (as `apply` does, without storing it) and checks its results, so it
  /// holds for any slots and hyper-parameters (a bound through sqrt(epsilon) would assume
  /// rms >= 0); it costs about as much as `apply`.
  [[nodiscard]] bool stays_finite(const State& state, std::span<const float> w,
                                  std::span<const float> g) const {
    const Terms k = terms();
    const float* wp = w.data();
    const float* gp = g.data();
    const float* rp = state.rms.data();
    const float* mp = state.momentum.data();
    return bounded(w.size(), [&](std::size_t i, std::uint32_t& lane) {
      float wi = wp[i];
      float ri = rp[i];
      float mi = mp[i];
      step(k, wi, ri, mi, gp[i]);
      detail::fold_bound(lane, wi);
      detail::fold_bound(lane, ri);
      detail::fold_bound(lane, mi);
    });
  }

  /// A table row keeps two slots: its mean square and its momentum.
  static constexpr std::size_t kRowSlots = 2;

  /// The row slots' names, the same as the dense slots'.
  [[nodiscard]] std::array<std::string_view, kRowSlots> row_slot_names() const {
    return {"rms", "momentum"};
  }

  /// Starts a new row's slots at zero.
  void init_row(std::span<float> slots) const { std::ranges::fill(slots, 0.0F); }

  /// Updates one table row `w` in place from its gradient `g`, as `apply` does; `slots`
  /// holds the row's rms then its momentum (w.size() floats each).
  void apply_row(std::span<float> w, std::span<float> slots, std::span<const float> g,
                 const RowContext& context) const {
    (void)apply_row_bounded(w, slots, g, context);
  }

  /// `apply_row`, returning a bound of the row's magnitudes afterwards (+infinity if a mean
  /// square is negative: BoundsRowMagnitudes).
  float apply_row_bounded(std::span<float> w, std::span<float> slots, std::span<const float> g,
                          const RowContext& /*context*/) const {
    const std::size_t n = w.size();
    return update(w.data(), slots.data(), slots.data() + n, g.data(), n);
  }

  /// `stays_finite_given` for a row (BoundsRowMagnitudes): the same rule.
  [[nodiscard]] bool row_stays_finite_given(float largest, float largest_gradient, const RowContext& /*context*/) const {
    return stays_finite_given(State{}, largest, largest_gradient);
  }

 private:
  /// The hyper-parameters, copied out of the object once per update.
  struct Terms {
    float lr;
    float rho;
    float momentum;
    float epsilon;
  };

  /// This object's Terms.
  [[nodiscard]] Terms terms() const { return {learning_rate, rho, momentum, epsilon}; }

  /// The rule for one element, or a vector of them (detail::lanewise), behind `update`
  /// and `stays_finite`.
  template <class V>
  static void step(const Terms& k, V& w, V& ms, V& mom, V g) {
    ms = k.rho * ms + (1.0F - k.rho) * g * g;
    mom = k.momentum * mom + k.lr * g / detail::lane_sqrt(ms + k.epsilon);
    w -= mom;
  }

  /// The rule over n elements, behind `apply` and `apply_row`: a bound of the magnitudes
  /// it leaves (BoundsMagnitudes).
  float update(float* __restrict w, float* __restrict ms, float* __restrict mom,
               const float* __restrict g, std::size_t n) const {
    const Terms k = terms();
    const bool ordinary = detail::lanewise_ordinary<2>(  // w and the momentum of any sign, ms not negative
        0, n, [k](auto gi, auto& wi, auto& momi, auto& msi) { step(k, wi, msi, momi, gi); }, g, w, mom, ms);
    return magnitude_bound(ordinary);
  }
};
static_assert(Optimizer<RmsProp>);
static_assert(BoundsMagnitudes<RmsProp>);
static_assert(RowWiseOptimizer<RmsProp>);
static_assert(BoundsRowMagnitudes<RmsProp>);

}  // namespace pulley
// ---- end pulley/optimizers/rmsprop.hpp ----
// ---- begin pulley/optimizers/sgd.hpp ----

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace pulley {

/// Plain stochastic gradient descent: `w -= learning_rate * g` (TF's GradientDescentOptimizer).
/// The same rule updates a dense part (`apply`) or one row of an embedding table
/// (`apply_row`, TF's sparse_apply of GradientDescent), which keeps no slots either.
struct Sgd {
  float learning_rate = 0.01F;  ///< step size

  /// What is wrong with the settings, or nullopt (Optimizer: settings_error).
  [[nodiscard]] std::optional<std::string> settings_error() const {
    return SettingsCheck().non_negative("learning_rate", learning_rate).error();
  }

  /// SGD keeps no slots.
  struct State {};

  /// Fresh slots for a part of n elements.
  [[nodiscard]] State make_state(std::size_t /*n*/) const { return {}; }

  /// Updates `w` in place from gradient `g` (same size as the state).
  void apply(State& state, std::span<float> w, std::span<const float> g) const { (void)apply_bounded(state, w, g); }

  /// `apply`, returning a bound of the weights' magnitudes afterwards (BoundsMagnitudes).
  float apply_bounded(State& /*state*/, std::span<float> w, std::span<const float> g) const {
    return update(learning_rate, w.data(), g.data(), w.size());
  }

  /// True if no weight can leave kFiniteBound when each is at most `largest` and each
  /// gradient element at most `largest_gradient` in magnitude (BoundsMagnitudes).
  [[nodiscard]] bool stays_finite_given(const State& /*state*/, float largest, float largest_gradient) const {
    return proven_finite(double{largest} + std::abs(double{learning_rate}) * largest_gradient);
  }

  /// True if `apply` keeps every weight within kFiniteBound.
  [[nodiscard]] bool stays_finite(const State& /*state*/, std::span<const float> w,
                                  std::span<const float> g) const {
    const float lr = learning_rate;
    const float* wp = w.data();
    const float* gp = g.data();
    return bounded(w.size(), [&](std::size_t i, std::uint32_t& lane) {
      detail::fold_bound(lane, wp[i] - lr * gp[i]);
    });
  }

  /// A table row keeps no slots.
  static constexpr std::size_t kRowSlots = 0;

  /// No slot names.
  [[nodiscard]] std::array<std::string_view, kRowSlots> row_slot_names() const { return {}; }

  /// Nothing to fill: a row has no slots.
  void init_row(std::span<float> /*slots*/) const {}

  /// Updates one table row `w` in place from its gradient `g`, as `apply` does.
  void apply_row(std::span<float> w, std::span<float> slots, std::span<const float> g,
                 const RowContext& context) const {
    (void)apply_row_bounded(w, slots, g, context);
  }

  /// `apply_row`, returning a bound of the row's magnitudes afterwards (BoundsRowMagnitudes).
  float apply_row_bounded(std::span<float> w, std::span<float> /*slots*/, std::span<const float> g,
                          const RowContext& /*context*/) const {
    return update(learning_rate, w.data(), g.data(), w.size());
  }

  /// `stays_finite_given` for a row (BoundsRowMagnitudes): the same rule.
  [[nodiscard]] bool row_stays_finite_given(float largest, float largest_gradient, const RowContext& /*context*/) const {
    return stays_finite_given(State{}, largest, largest_gradient);
  }

 private:
  /// The rule over n elements, behind `apply` and `apply_row`: a bound of the weights'
  /// magnitudes after (kOrdinaryMagnitude or +infinity), judged in the lanes that wrote them.
  static float update(float lr, float* w, const float* g, std::size_t n) {
    return magnitude_bound(detail::arithmetic_lanewise_ordinary<1>(
        0, n, [lr](auto gi, auto& wi) { wi -= lr * gi; }, g, w));
  }
};
static_assert(Optimizer<Sgd>);
static_assert(BoundsMagnitudes<Sgd>);
static_assert(RowWiseOptimizer<Sgd>);
static_assert(BoundsRowMagnitudes<Sgd>);

}  // namespace pulley
// ---- end pulley/optimizers/sgd.hpp ----
// ---- begin pulley/ps/parameter_server.hpp ----

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

// ---- begin pulley/ps/checkpoint_cut.hpp ----

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <optional>
#include <utility>
#include <vector>

// ---- begin pulley/ps/push_ledger.hpp ----

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace pulley {

/// What a ps task has taken from each worker since the last restore: how many pushes (a
/// checkpoint's cut brings every ps to the same counts, see CheckpointCut), the furthest
/// step one was made for, and the sequence number and answer of the last one, so that a push sent
/// again after a lost connection is answered as the first was and counted once (a worker has one
/// push in flight at a time, and sends again only its last). A push lost with its worker's process
/// and counted all the same (`count_lost`) is counted once too: a copy of it that still
/// comes, written before the process was lost and read after, is `counted_lost`.
class PushLedger {
 public:
  /// What a push taken was answered.
  struct Answer {
    std::uint32_t stale_parts = 0;  ///< part gradients dropped as stale
    std::string refused;            ///< why the update was refused ("" if it was not)
  };

  /// The answer to a push of `worker` numbered `sequence` of `series` if it is the last one
  /// taken again, else nullptr. Sequence 0 numbers nothing.
  [[nodiscard]] const Answer* repeated(std::uint32_t worker, std::uint64_t sequence, std::uint64_t series = 0) const {
    if (sequence == 0 || worker >= last_.size() || last_[worker].sequence != sequence ||
        last_[worker].series != series) {
      return nullptr;
    }
    return &last_[worker].answer;
  }

  /// True if a push of `worker` numbered `sequence` of `series` (not 0) is older than the
  /// last one taken of that series: a late copy its worker gave up on.
  [[nodiscard]] bool older(std::uint32_t worker, std::uint64_t sequence, std::uint64_t series) const {
    return series != 0 && sequence != 0 && worker < last_.size() && last_[worker].series == series &&
           sequence < last_[worker].sequence;
  }

  /// Counts one push of `worker` for step `local_step` taken (its verdict not known yet).
  void count(std::uint32_t worker, std::int64_t local_step) {
    if (taken_.size() <= worker) taken_.resize(worker + 1, 0);
    ++taken_[worker];
    furthest_ = std::max(furthest_, local_step);
  }

  /// Counts the push of `worker` for step `step` or before that its process was lost while
  /// writing: the pacing ps took it, this ps never did (ParameterServer::pulls_ahead).
  void count_lost(std::uint32_t worker, std::int64_t step) {
    count(worker, step);
    if (lost_.size() <= worker) lost_.resize(worker + 1, -1);
    lost_[worker] = std::max(lost_[worker], step);
  }

  /// True if a push of `worker` for `local_step` would be one counted by `count_lost`
  /// already: the process that wrote it was lost, and the one in its place pulled past it.
  [[nodiscard]] bool counted_lost(std::uint32_t worker, std::int64_t local_step) const noexcept {
    return worker < lost_.size() && local_step <= lost_[worker];
  }

  /// Remembers the answer to push `sequence` of `series` of `worker` (0: unnumbered,
  /// nothing kept).
  void answered(std::uint32_t worker, std::uint64_t sequence, Answer answer, std::uint64_t series = 0) {
    if (sequence == 0) return;
    if (last_.size() <= worker) last_.resize(worker + 1);
    last_[worker] = {sequence, series, std::move(answer)};
  }

  /// Pushes of `worker` taken so far.
  [[nodiscard]] std::uint64_t taken(std::uint32_t worker) const noexcept {
    return worker < taken_.size() ? taken_[worker] : 0;
  }
  /// Pushes taken so far, by worker.
  [[nodiscard]] const std::vector<std::uint64_t>& taken() const noexcept { return taken_; }
  /// The number and series of the last numbered push taken of `worker` (0 and 0: none).
  [[nodiscard]] std::pair<std::uint64_t, std::uint64_t> last(std::uint32_t worker) const noexcept {
    if (worker >= last_.size()) return {0, 0};
    return {last_[worker].sequence, last_[worker].series};
  }
  /// last() of every worker, into `sequences` and `series` (what PauseReply says beside
  /// `taken`).
  void last_pushes(std::vector<std::uint64_t>& sequences,
                   std::vector<std::uint64_t>& series) const {
    sequences.clear();
    series.clear();
    for (const Last& l : last_) {
      sequences.push_back(l.sequence);
      series.push_back(l.series);
    }
  }
  /// The furthest step a push taken so far was made for (Push::local_step), -1 if none.
  [[nodiscard]] std::int64_t furthest() const noexcept { return furthest_; }

  /// Forgets everything (a restore starts a new epoch).
  void clear() noexcept {
    taken_.clear();
    last_.clear();
    lost_.clear();
    furthest_ = -1;
  }

 private:
  struct Last {
    std::uint64_t sequence = 0;
    std::uint64_t series = 0;
    Answer answer;
  };
  std::vector<std::uint64_t> taken_;
  std::vector<Last> last_;
  std::vector<std::int64_t> lost_;  ///< by worker: the furthest step a lost push was counted for
  std::int64_t furthest_ = -1;
};

}  // namespace pulley
// ---- end pulley/ps/push_ledger.hpp ----
// ---- begin pulley/ps/step_gate.hpp ----

#include <cstdint>
#include <utility>
#include <vector>

namespace pulley {

/// Requests parked until the ps's global step reaches theirs: a Pull or PullRows with a
/// `min_step` ahead (a worker holding a token reads parameters that include every update
/// its token requires), a Pause for a step to come. Each is answered the moment its step
/// completes, before the ps handles anything else, in the order it came.
///
/// @tparam R what is kept of each request until it is answered
template <class R>
class StepGate {
 public:
  /// Parks `request` (with its reply) until global step `step`.
  void park(std::int64_t step, R request, Responder& reply) {
    Waiting& w = waiting_.emplace_back(Waiting{step, std::move(request), nullptr});
    w.reply = std::exchange(reply, nullptr);
  }

  /// Calls `answer(request, reply)` for every request whose step `global_step` reached, in
  /// the order they came, and forgets them.
  template <class Answer>
  void release(std::int64_t global_step, Answer&& answer) {
    std::erase_if(waiting_, [&](Waiting& w) {
      if (global_step < w.step) return false;
      answer(w.request, w.reply);
      return true;
    });
  }

  /// Answers every parked request with `error`.
  void answer_all(const ErrorReply& error) {
    for (Waiting& w : std::exchange(waiting_, {})) respond(w.reply, ErrorReply{error});
  }

  /// Requests parked now.
  [[nodiscard]] std::size_t size() const noexcept { return waiting_.size(); }

 private:
  struct Waiting {
    std::int64_t step;
    R request;
    Responder reply;
  };
  std::vector<Waiting> waiting_;
};

}  // namespace pulley
// ---- end pulley/ps/step_gate.hpp ----

namespace pulley {

/// A ps task's half of a checkpoint's cut (Pause, ReadState, Resume; the chief's half is
/// `client/checkpoint_cut.hpp`): while paused, pushes that arrive are held, copied out of
/// the transport's buffers; a ReadState names the largest count of each worker's pushes any
/// ps had taken and that ps's last push, the ps works out its own count from them (less a
/// push lost with its worker's process that never comes here: own_until), and takes held
/// pushes, in the order they came, until it has taken exactly that many of every worker,
/// then answers with its state.
/// So every ps is read at the same pushes, under any sync policy.
///
/// The part keeps the pause, the held pushes and the pending read; the ps takes the pushes
/// and builds the state (the callbacks of `advance` and `resume`).
class CheckpointCut {
 public:
  using Clock = std::chrono::steady_clock;

  /// A push that arrived while paused, with its tensors copied.
  struct HeldPush {
    Push push;
    std::vector<std::vector<float>> storage;
    Responder reply;
  };

  /// True while paused: pushes are held.
  [[nodiscard]] bool paused() const noexcept { return paused_; }

  /// Pauses, for the chief's connection `session`.
  void pause(std::uint64_t session) noexcept {
    paused_ = true;
    session_ = session;
  }

  /// True if a pause is on and connection `session` made it (0: any connection).
  [[nodiscard]] bool paused_by(std::uint64_t session) const noexcept {
    return paused_ && (session == 0 || session == session_);
  }

  /// Holds `push`, with its reply, until the cut or Resume takes it.
  void hold(const Push& push, Responder& reply) {
    HeldPush& held = held_.emplace_back();
    held.push = Push{push.worker, push.local_step, {}, push.epoch, push.sequence, {}, push.series, push.refill};
    held.storage.reserve(push.gradients.size() + push.rows.size());
    for (const PartValues& pv : push.gradients) {
      held.storage.emplace_back(pv.values.begin(), pv.values.end());
      held.push.gradients.push_back({pv.part, held.storage.back()});
    }
    for (const TableRows& tr : push.rows) {
      held.storage.emplace_back(tr.values.begin(), tr.values.end());
      held.push.rows.push_back({tr.table, tr.ids, held.storage.back()});
    }
    held.reply = std::exchange(reply, nullptr);
  }

  /// If the cut holds a push of `push`'s worker with its sequence number (a push sent again
  /// after its connection was lost), its answer goes to `reply` instead, and true.
  bool rehold(const Push& push, Responder& reply) {
    if (push.sequence == 0) return false;
    for (HeldPush& held : held_) {
      if (held.push.worker == push.worker && held.push.sequence == push.sequence &&
          held.push.series == push.series) {
        held.reply = std::exchange(reply, nullptr);
        return true;
      }
    }
    return false;
  }

  /// Asks for the state at the cut `until` (pushes of each worker), answered through
  /// `reply` by `advance`; a read asked before is cancelled.
  void read_at(std::vector<std::uint64_t> until, Responder& reply) {
    if (pending_) respond(pending_->reply, ErrorReply{ErrorCode::kCancelled, "a newer ReadState came"});
    pending_.emplace(PendingRead{std::move(until), std::exchange(reply, nullptr), Clock::now()});
  }

  /// A worker that the pending read, asked `patience` before `now` or earlier, still waits
  /// for (short of the cut and `awaited`), with the count of its pushes the cut holds: once
  /// per read (what an operator is told of a cut that stands still), else nullopt.
  template <class Awaited>
  std::optional<std::pair<std::uint32_t, std::uint64_t>> overdue(const PushLedger& ledger,
                                                                 Clock::time_point now,
                                                                 Clock::duration patience,
                                                                 Awaited&& awaited) {
    if (!pending_ || pending_->told || now - pending_->asked < patience) return std::nullopt;
    const std::optional<std::uint32_t> w = awaited_short(ledger, awaited);
    if (!w) return std::nullopt;
    pending_->told = true;
    return std::pair{*w, pending_->until[*w]};
  }

  /// The pushes of each worker that `read` holds this ps to, by what its `ledger` took: the
  /// cut's count (ReadState::until), but a worker of whom it took fewer is waited for one
  /// push at most, and none when its own last push is the one the cut names (the furthest
  /// ps's last). A worker has one push in flight at a time and sends again only its last,
  /// so what such a ps lacks was lost with an earlier process of that worker, written to
  /// other ps tasks only: under Async and BoundedStaleness nothing counts it here, and
  /// waiting for it stood the cut still until the request timeout once no push came any
  /// more, as at the end of training. The ps judges by its own ledger: with copies, the
  /// copy read from (the one ReadState goes to) by its own, not by the answer folded from
  /// both copies' pauses. An unnumbered last push (sequence 0): the cut's count.
  ///
  /// Left as it was: a ps at the cut's count whose last push differs from the one named
  /// (the furthest ps took a push lost with an earlier process and one more, this ps the
  /// new process's push and holds its next) is read without the push it holds.
  [[nodiscard]] static std::vector<std::uint64_t> own_until(const PushLedger& ledger,
                                                            const ReadState& read) {
    std::vector<std::uint64_t> until = read.until;
    for (std::uint32_t w = 0; w < until.size(); ++w) {
      const std::uint64_t taken = ledger.taken(w), sequence = of_worker(read.last_sequences, w);
      if (taken >= until[w] || sequence == 0) continue;
      const bool took_last = ledger.last(w) == std::pair{sequence, of_worker(read.last_series, w)};
      until[w] = took_last ? taken : taken + 1;
    }
    return until;
  }

  /// A worker of whom the ps has taken more pushes than `until` allows, if any.
  [[nodiscard]] static std::optional<std::uint32_t> past(const PushLedger& ledger,
                                                         const std::vector<std::uint64_t>& until) {
    const auto& taken = ledger.taken();
    for (std::size_t w = 0; w < taken.size(); ++w) {
      if (taken[w] > of_worker(until, w)) return static_cast<std::uint32_t>(w);
    }
    return std::nullopt;
  }

  /// Takes held pushes (`take(push, reply)`), in the order they came, while their workers
  /// are short of the cut; once every worker is exactly at it, answers the pending read
  /// with `state()` (a StateReply). A worker for whom `awaited(w)` is false (held lost,
  /// silent for the worker timeout, or no longer the job's) is not waited for: a push it
  /// sent another ps before it died may never come here. What of it is held is still taken
  /// up to the cut. Called again as time passes (a worker falls silent while paused).
  template <class Take, class State, class Awaited>
  void advance(const PushLedger& ledger, Take&& take, State&& state, Awaited&& awaited) {
    if (!pending_) return;
    const std::vector<std::uint64_t>& until = pending_->until;
    auto short_of_cut = [&](std::uint32_t w) { return ledger.taken(w) < of_worker(until, w); };
    std::deque<HeldPush> later;
    for (HeldPush& held : std::exchange(held_, {})) {
      // A worker's pushes are taken in the order they came: one held back holds back the rest.
      const bool blocked = std::any_of(later.begin(), later.end(), [&](const HeldPush& h) {
        return h.push.worker == held.push.worker;
      });
      if (!blocked && short_of_cut(held.push.worker)) {
        take(held.push, held.reply);
      } else {
        later.push_back(std::move(held));
      }
    }
    held_ = std::move(later);
    if (awaited_short(ledger, awaited)) return;  // its push is still on its way here
    Responder reply = std::move(pending_->reply);
    pending_.reset();
    respond(reply, state());
  }

  /// Ends the pause: a cut not reached is given up, and the held pushes are taken in order.
  template <class Take>
  void resume(Take&& take) {
    if (!paused_) return;
    paused_ = false;
    if (pending_) {
      respond(pending_->reply, ErrorReply{ErrorCode::kCancelled, "resumed before the cut was reached"});
      pending_.reset();
    }
    for (HeldPush& held : std::exchange(held_, {})) take(held.push, held.reply);
  }

  /// Parks a Pause of connection `session` that waits for global step `at_step`.
  void park_pause(std::int64_t at_step, std::uint64_t session, Responder& reply) {
    pauses_.park(at_step, session, reply);
  }

  /// Pauses for each parked Pause whose step `step` reached: `pause(session, reply)`.
  template <class Pause>
  void release_pauses(std::int64_t step, Pause&& pause) {
    pauses_.release(step, pause);
  }

  /// Answers everything held or waiting with `answer`, and ends the pause.
  void answer_all(const ErrorReply& answer) {
    for (HeldPush& h : std::exchange(held_, {})) respond(h.reply, ErrorReply{answer});
    pauses_.answer_all(answer);
    if (pending_) {
      respond(pending_->reply, ErrorReply{answer});
      pending_.reset();
    }
    paused_ = false;
  }

 private:
  struct PendingRead {
    std::vector<std::uint64_t> until;
    Responder reply;
    Clock::time_point asked;
    bool told = false;  ///< overdue() said it
  };

  /// The first worker the pending read still waits for: short of the cut and `awaited`.
  template <class Awaited>
  std::optional<std::uint32_t> awaited_short(const PushLedger& ledger, Awaited&& awaited) const {
    const std::vector<std::uint64_t>& until = pending_->until;
    for (std::uint32_t w = 0; w < until.size(); ++w) {
      if (ledger.taken(w) < until[w] && awaited(w)) return w;
    }
    return std::nullopt;
  }

  bool paused_ = false;
  std::uint64_t session_ = 0;        ///< the chief's connection that paused it
  std::deque<HeldPush> held_;        ///< pushes that arrived while paused, in order
  std::optional<PendingRead> pending_;  ///< a ReadState waiting for its cut
  StepGate<std::uint64_t> pauses_;      ///< Pauses for a step to come, by the chief's connection
};

}  // namespace pulley
// ---- end pulley/ps/checkpoint_cut.hpp ----
// ---- begin pulley/ps/liveness.hpp ----

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace pulley {

/// Where a ps task detects a lost worker: the workers it heard from (a heartbeat, a token
/// request) and when, and which of them it holds lost. A worker is held lost once it was
/// heard and then stays silent for the worker timeout; one never heard is never lost (a
/// Worker made by hand without a HeartbeatSender, as in TensorFlow). The ps tells its sync
/// policy of every change; this part keeps only the clock and the verdicts.
///
/// A ps that heard no task at all (no worker, nor the chief) for a whole timeout was most
/// likely the one cut off (a partition, a stopped process, a long pause of its own): every
/// task then gets a fresh timeout to be heard from again, once, instead of being held lost
/// for the ps's own silence. (If every task really is gone, they are held lost after two
/// timeouts.)
///
/// The chief beats too, and is judged by the same timeout and grace: a ps that holds it
/// lost keeps the model and waits for a chief to come back.
class Liveness {
 public:
  using Clock = std::chrono::steady_clock;

  /// How long a worker heard before may be silent (default 5 s).
  void set_timeout(std::chrono::milliseconds timeout) noexcept { timeout_ = timeout; }
  /// The timeout.
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return timeout_; }

  /// `worker` was heard at `now` (its lost verdict stands until `back`).
  void heard(std::uint32_t worker, Clock::time_point now) {
    heard_any(now);
    workers_[worker].last = now;
  }

  /// `worker`, heard before, was heard again at `now`: its clock alone (no fresh timeout for
  /// the others after a silence: for a ps that ended, which holds nobody lost any more).
  void touch(std::uint32_t worker, Clock::time_point now) {
    if (const auto it = workers_.find(worker); it != workers_.end()) it->second.last = now;
  }

  /// The chief was heard at `now`; true if it was held lost until then (it is back).
  bool heard_chief(Clock::time_point now) {
    heard_any(now);
    const bool was_lost = chief_ && chief_->lost;
    chief_ = Heard{now, false};
    return was_lost;
  }

  /// The ps refused every task but the chief from `since` to `now` (ShardCopies' fence):
  /// that silence was its own doing, and so was any time before it in which it heard
  /// nobody at all (it was stopped or cut off: its lease ran out in that time). Neither
  /// counts against a worker not held lost; a worker's silence while others were heard
  /// still does.
  void forgive(Clock::time_point since, Clock::time_point now) noexcept {
    since = std::min(since, last_heard_any_);
    if (now <= since) return;
    for (auto& [w, heard] : workers_) {
      if (!heard.lost) heard.last = heard.last < since ? heard.last + (now - since) : now;
    }
    last_heard_any_ = now;
    grace_ = false;
  }

  /// The chief ended normally (or never beat): nothing to hold lost.
  void chief_left() noexcept { chief_.reset(); }

  /// Since when the chief is held lost (its last heartbeat), if it is.
  [[nodiscard]] std::optional<Clock::time_point> chief_lost_since() const {
    if (chief_ && chief_->lost) return chief_->last;
    return std::nullopt;
  }

  /// True if `worker` is held lost now.
  [[nodiscard]] bool is_lost(std::uint32_t worker) const {
    const auto it = workers_.find(worker);
    return it != workers_.end() && it->second.lost;
  }

  /// True if `worker`, heard before and not held lost, has been silent for the timeout at
  /// `now` while others were heard: `expire` would hold it lost at `now`. For a ps that
  /// may not hold anyone lost now (paused for a cut) but must not wait for the dead.
  [[nodiscard]] bool silent(std::uint32_t worker, Clock::time_point now) const {
    const auto it = workers_.find(worker);
    if (it == workers_.end() || it->second.lost || now - it->second.last < timeout_) return false;
    return grace_ || now - last_heard_any_ < timeout_;  // else the silence may be the ps's own
  }

  /// True if some worker heard before, not held lost and not left, was heard within the
  /// timeout at `now`: it may still come with a request.
  [[nodiscard]] bool awaits_any(Clock::time_point now) const {
    return std::any_of(workers_.begin(), workers_.end(), [&](const auto& entry) {
      return !entry.second.lost && now - entry.second.last < timeout_;
    });
  }

  /// A lost `worker` counts again, heard at `now`.
  void back(std::uint32_t worker, Clock::time_point now) {
    Heard& heard = workers_[worker];
    heard.lost = false;
    heard.last = now;
  }

  /// `worker` ended normally: forgotten, so it is not held lost once quiet (one already
  /// lost stays lost).
  void leave(std::uint32_t worker) {
    if (const auto it = workers_.find(worker); it != workers_.end() && !it->second.lost) {
      workers_.erase(it);
    }
  }

  /// True if `worker` was heard (lost or not); `any`: if any worker was.
  [[nodiscard]] bool known(std::uint32_t worker) const { return workers_.contains(worker); }
  [[nodiscard]] bool any() const noexcept { return !workers_.empty(); }

  /// `worker` left the job for good: forgotten, lost or not.
  void forget(std::uint32_t worker) { workers_.erase(worker); }

  /// Holds the chief lost if it was silent for the timeout at `now`, calling
  /// `on_chief_lost(last_heard)` right after marking it.
  template <class OnChiefLost>
  void expire_chief(Clock::time_point now, OnChiefLost&& on_chief_lost) {
    if (start_grace(now)) return;
    if (chief_ && !chief_->lost && now - chief_->last >= timeout_) {
      chief_->lost = true;
      on_chief_lost(chief_->last);
    }
  }

  /// Holds lost every worker silent for the timeout at `now`, calling
  /// `on_lost(worker, last_heard)` for each, in worker order, right after marking it.
  template <class OnLost>
  void expire(Clock::time_point now, OnLost&& on_lost) {
    if (start_grace(now)) return;
    std::vector<std::pair<std::uint32_t, Clock::time_point>> lost;  // `on_lost` may forget workers
    for (auto& [worker, heard] : workers_) {
      if (heard.lost || now - heard.last < timeout_) continue;
      heard.lost = true;
      lost.emplace_back(worker, heard.last);
    }
    for (const auto& [worker, last] : lost) on_lost(worker, last);
  }

  /// The workers held lost, ascending.
  [[nodiscard]] std::vector<std::uint32_t> lost() const {
    std::vector<std::uint32_t> out;
    for (const auto& [worker, heard] : workers_) {
      if (heard.lost) out.push_back(worker);
    }
    return out;
  }

  /// " (last heard 14.2 s ago)" for a worker heard before `now`, else "".
  [[nodiscard]] std::string last_heard(std::uint32_t worker, Clock::time_point now) const {
    const auto it = workers_.find(worker);
    if (it == workers_.end()) return {};
    return " (last heard " + seconds_between(it->second.last, now) + " s ago)";
  }

  /// "worker:1 (last heard 14.2 s ago), worker:2": `workers` with how long ago each was
  /// heard (the first 8, then how many more).
  [[nodiscard]] std::string describe(const std::vector<std::uint32_t>& workers, Clock::time_point now) const {
    std::string text;
    for (std::size_t i = 0; i < workers.size(); ++i) {
      if (i == 8) return text + ", and " + std::to_string(workers.size() - i) + " more";
      if (i > 0) text += ", ";
      text += "worker:" + std::to_string(workers[i]) + last_heard(workers[i], now);
    }
    return text;
  }

  /// "14.2": seconds from `then` to `now`, one decimal.
  static std::string seconds_between(Clock::time_point then, Clock::time_point now) {
    char text[32];
    std::snprintf(text, sizeof text, "%.1f", std::chrono::duration<double>(now - then).count());
    return text;
  }

 private:
  struct Heard {
    Clock::time_point last;
    bool lost = false;
  };
  /// Nobody heard for a whole timeout at `now`: a fresh one each, from now, once (true).
  bool start_grace(Clock::time_point now) {
    if (grace_ || (workers_.empty() && !chief_) || now - last_heard_any_ < timeout_) return false;
    grace_ = true;
    for (auto& [w, heard] : workers_) heard.last = now;
    if (chief_ && !chief_->lost) chief_->last = now;
    last_heard_any_ = now;
    return true;
  }

  /// Heard at `now`: after a silence of a whole timeout, everyone gets a fresh one (also
  /// when the grace for that silence began before: the first word after it counts).
  void heard_any(Clock::time_point now) {
    if (grace_ || now - last_heard_any_ >= timeout_) {
      for (auto& [w, heard] : workers_) heard.last = now;
      if (chief_ && !chief_->lost) chief_->last = now;
    }
    last_heard_any_ = now;
    grace_ = false;
  }

  std::map<std::uint32_t, Heard> workers_;
  std::optional<Heard> chief_;  ///< once the chief beat
  std::chrono::milliseconds timeout_{std::chrono::seconds(5)};
  Clock::time_point last_heard_any_;
  bool grace_ = false;  ///< the fresh timeout after hearing nobody is running
};

}  // namespace pulley
// ---- end pulley/ps/liveness.hpp ----
// ---- begin pulley/ps/pacing.hpp ----

#include <cstdint>
#include <deque>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace pulley {

/// Where a ps task hands out sync tokens: the front of the ps that its sync policy drives.
/// It holds the policy's `Pacer` (the global step, fresh or stale, tokens), the TakeToken
/// requests that wait for a token, and each worker's lease: the connection it took its
/// last token on. When that connection closes before the push, the policy gets the tokens
/// back (`SyncPolicy::release`), so a vanished worker cannot hold a step up.
///
/// Every call that changes the pacer may throw from the policy; the ps decides what a
/// throw costs (a refusal before anything changed, else the ps fails).
///
/// @tparam P the SyncPolicy
template <SyncPolicy P>
class Pacing {
 public:
  explicit Pacing(P sync) : sync_(std::move(sync)), pacer_(sync_.make_pacer()) {}

  /// The sync policy (its accumulators are the ps's parts').
  [[nodiscard]] const P& policy() const noexcept { return sync_; }
  /// Global steps completed on this ps.
  [[nodiscard]] std::int64_t global_step() const { return sync_.global_step(pacer_); }

  /// The policy's verdict on one push message (`SyncPolicy::on_push`); a `pulley::Error`
  /// refuses the push and leaves the pacer as it was.
  Verdict on_push(std::uint32_t worker, std::int64_t local_step, bool refill = false) {
    follow(sync_, pacer_, local_step, refill);
    return sync_.on_push(pacer_, worker, local_step);
  }

  /// Parks a TakeToken of `worker`, which came on connection `session`, until `hand_out`
  /// gives it a token. Asked again on the connection that holds the worker's lease, for
  /// the step it took a token of and has not pushed for (its answer was lost), it is
  /// answered that token again at once (`SyncPolicy::held_token`). A token says how many
  /// of the worker's pushes `ledger` holds taken (TokenReply::pushes_taken).
  void wait_for_token(std::uint32_t worker, std::uint64_t session, Responder& reply,
                      const PushLedger& ledger) {
    if (const auto lease = leases_.find(worker); lease != leases_.end() && lease->second == session) {
      if (const std::optional<Token> token = held_token(sync_, pacer_, worker)) {
        return respond(reply, TokenReply{*token, global_step(), ledger.taken(worker)});
      }
    }
    TokenWaiter& waiter = waiters_.emplace_back(TokenWaiter{worker, session, nullptr});
    waiter.reply = std::exchange(reply, nullptr);
  }

  /// Asks the policy again for every waiting token request, in arrival order: a token is
  /// answered (with the pushes `ledger` holds taken of its worker), a refusal
  /// (`pulley::Error`) goes to `refuse(reply, code, message)`, nullopt keeps waiting. The
  /// worker's lease moves to the connection it took the token on. Any other throw is the
  /// caller's to handle (the pacer may be half changed).
  template <class Refuse>
  void hand_out(const PushLedger& ledger, Refuse&& refuse) {
    std::erase_if(waiters_, [&](TokenWaiter& w) {
      std::optional<Token> token;
      try {
        token = sync_.take_token(pacer_, w.worker);
      } catch (const Error& e) {
        refuse(w.reply, e.code(), std::string("TakeToken refused: ") + e.message());
        return true;
      }
      if (!token) return false;
      leases_[w.worker] = w.session;
      respond(w.reply, TokenReply{*token, global_step(), ledger.taken(w.worker)});
      return true;
    });
  }

  /// Connection `session` of `worker` is gone (0: all of them): its waiting token requests
  /// are answered `gone` (kUnavailable). Returns true if it held the worker's lease, whose
  /// tokens then went back to the policy.
  bool disconnected(std::uint32_t worker, std::uint64_t session, const std::string& gone) {
    std::erase_if(waiters_, [&](TokenWaiter& w) {
      if (w.worker != worker || (session != 0 && w.session != session)) return false;
      respond(w.reply, ErrorReply{ErrorCode::kUnavailable, gone});
      return true;
    });
    const auto lease = leases_.find(worker);
    if (lease == leases_.end() || (session != 0 && lease->second != session)) return false;
    leases_.erase(lease);
    release(sync_, pacer_, worker);
    return true;
  }

  /// `worker` left the job: its waiting token requests are answered `refusal`, and the
  /// tokens it took and did not push for go back.
  void refuse(std::uint32_t worker, const ErrorReply& refusal) {
    std::erase_if(waiters_, [&](TokenWaiter& w) {
      if (w.worker != worker) return false;
      respond(w.reply, ErrorReply{refusal});
      return true;
    });
    leave(worker);
  }

  /// `worker` ends normally: the tokens it took and did not push for go back.
  void leave(std::uint32_t worker) {
    leases_.erase(worker);
    release(sync_, pacer_, worker);
  }

  /// The ps holds `worker` lost: the policy stops waiting for it, and its lease goes with
  /// it. kReady when that completes the update in progress.
  Verdict lost(std::uint32_t worker) {
    const Verdict verdict = worker_lost(sync_, pacer_, worker);
    leases_.erase(worker);
    return verdict;
  }

  /// `worker` pulls step `min_step` without a push for the step in progress here
  /// (SyncPolicy::on_pull_ahead): nullopt when that changes nothing; else its lease goes
  /// with its tokens, and kReady when the update in progress is complete without it.
  std::optional<Verdict> pulled_ahead(std::uint32_t worker, std::int64_t min_step) {
    const std::optional<Verdict> verdict = pull_ahead(sync_, pacer_, worker, min_step);
    if (verdict) leases_.erase(worker);
    return verdict;
  }

  /// A lost `worker` is back: it counts again from the step in progress.
  void back(std::uint32_t worker) { worker_back(sync_, pacer_, worker); }

  /// Counts the job's workers `workers` from the step in progress on (SyncPolicy::reshape);
  /// a `pulley::Error` refuses the change and leaves the pacer as it was.
  void reshape(std::span<const std::uint32_t> workers) { reshape(pacer_, workers); }
  /// The same on `pacer` (one loaded aside).
  void reshape(typename P::Pacer& pacer, std::span<const std::uint32_t> workers) const {
    if constexpr (kReshapes<P>) {
      sync_.reshape(pacer, workers);
    } else {
      throw Error(ErrorCode::kFailedPrecondition,
                  "the sync policy cannot count workers that join or leave (it has no SyncPolicy::reshape)");
    }
  }

  /// Token requests waiting for a token.
  [[nodiscard]] std::size_t waiting() const noexcept { return waiters_.size(); }

  /// What the next step waits for, in the policy's words ("" if it does not say).
  [[nodiscard]] std::string waiting_for() const { return pulley::waiting_for(sync_, pacer_); }
  /// The workers the next step waits for (none if the policy does not say).
  [[nodiscard]] std::vector<std::uint32_t> awaited() const { return pulley::awaited(sync_, pacer_); }

  /// The pacer as a checkpoint keeps it.
  [[nodiscard]] std::vector<std::int64_t> save() const { return save_pacer(sync_, pacer_); }
  /// A pacer loaded from `state`, aside (a `pulley::Error` refuses the state); `reset`
  /// puts it in place.
  [[nodiscard]] typename P::Pacer load(std::span<const std::int64_t> state) const {
    return load_pacer(sync_, state);
  }
  /// Puts `pacer` in place (a restore): leases are forgotten, and waiting token requests
  /// are answered `gone`.
  void reset(typename P::Pacer pacer, const ErrorReply& gone) {
    pacer_ = std::move(pacer);
    leases_.clear();
    answer_all(gone);
  }

  /// Answers every waiting token request with `error`.
  void answer_all(const ErrorReply& error) {
    for (TokenWaiter& w : std::exchange(waiters_, {})) respond(w.reply, ErrorReply{error});
  }

 private:
  struct TokenWaiter {
    std::uint32_t worker;
    std::uint64_t session;  ///< the connection it came on
    Responder reply;
  };

  P sync_;
  typename P::Pacer pacer_;
  std::deque<TokenWaiter> waiters_;
  /// By worker: the connection it took its last token on, which holds its tokens' lease.
  std::map<std::uint32_t, std::uint64_t> leases_;
};

}  // namespace pulley
// ---- end pulley/ps/pacing.hpp ----
// ---- begin pulley/ps/registration.hpp ----

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

namespace pulley {

/// Where a ps task learns its model, and whether it may serve: what the chief registers is
/// checked (names, shapes, initializers, tables), placed with the sharding policy (every
/// ps computes the same placement, and the chief compares them), and the ps turns ready
/// once every part it holds is initialized or restored; WaitReady requests wait until
/// then. It also keeps the epoch: the restores so far, which every request of a step
/// carries, so that what a client began before a rollback is refused after it.
///
/// @tparam S the Sharding policy
template <Sharding S>
class Registration {
 public:
  /// Elements a variable may have: 4 TiB of floats, beyond any ps, and no product of its
  /// shape wraps around on the way.
  static constexpr std::size_t kMaxElements = std::size_t{1} << 40U;
  /// Floats in a row of an embedding table.
  static constexpr std::size_t kMaxTableDim = std::size_t{1} << 16U;

  Registration(std::uint32_t task, std::uint32_t num_ps, S sharding)
      : task_(task), num_ps_(num_ps), sharding_(std::move(sharding)) {}

  /// Why the model of `r` cannot be registered, or nullopt with its placement in `placement`.
  /// `serves_tables`: the ps has a table policy.
  [[nodiscard]] std::optional<ErrorReply> check(const Register& r, bool serves_tables, Placement& placement) const {
    if (auto problem = check_variables(r.variables); !problem.empty()) {
      return ErrorReply{ErrorCode::kInvalidArgument, std::move(problem)};
    }
    if (!r.tables.empty() && !serves_tables) {
      return ErrorReply{ErrorCode::kFailedPrecondition,
                        "the model has embedding tables, and this ps serves none: its optimizer has no "
                        "row-wise apply (RowWiseOptimizer); compose ParameterServer<S, O, P, "
                        "Tables<Adagrad>> or another RowWiseOptimizer for the tables"};
    }
    if (auto problem = check_tables(r.tables, r.variables); !problem.empty()) {
      return ErrorReply{ErrorCode::kInvalidArgument, std::move(problem)};
    }
    const std::vector<std::uint32_t> members = members_of(r);
    if (auto problem = check_members(r, members); !problem.empty()) {
      return ErrorReply{ErrorCode::kInvalidArgument, std::move(problem)};
    }
    const std::uint32_t tasks = tasks_of(r);
    placement = sharding_.place(r.variables, tasks);
    if (auto problem = check_placement(r.variables, placement, all_tasks(tasks)); !problem.empty()) {
      return ErrorReply{ErrorCode::kInvalidArgument, "the sharding policy is broken: " + problem};
    }
    if (members.size() != tasks) {
      // Placed again from the cluster's first placement, so that every process computes
      // the same from the members alone, whatever changes came before.
      try {
        placement = rebalance(sharding_, r.variables, placement, members);
      } catch (const Error& e) {
        return ErrorReply{ErrorCode::kInvalidArgument, std::string("the sharding policy cannot rebalance: ") + e.what()};
      }
      if (auto problem = check_placement(r.variables, placement, members); !problem.empty()) {
        return ErrorReply{ErrorCode::kInvalidArgument, "the sharding policy's rebalance is broken: " + problem};
      }
    }
    return std::nullopt;
  }

  /// The ps tasks `r` registers the model over: its members, or every ps task.
  [[nodiscard]] std::vector<std::uint32_t> members_of(const Register& r) const {
    return r.members.empty() ? all_tasks(num_ps_) : r.members;
  }

  /// The ps tasks the job has known when `r` is registered (members or not): the cluster
  /// spec's, or as many as `r` names addresses of once a ps joined. The placement is
  /// computed over this many, then placed again over the members.
  [[nodiscard]] std::uint32_t tasks_of(const Register& r) const {
    return r.ps_addresses.empty() ? num_ps_ : static_cast<std::uint32_t>(r.ps_addresses.size());
  }

  /// The job's ps tasks, ascending, as last registered (every ps task before that).
  [[nodiscard]] const std::vector<std::uint32_t>& members() const noexcept { return members_; }
  /// Their version (Register::membership).
  [[nodiscard]] std::uint64_t membership() const noexcept { return membership_; }
  /// Every ps task's address once a ps joined beyond the cluster spec (empty before).
  [[nodiscard]] const std::vector<std::string>& ps_addresses() const noexcept { return ps_addresses_; }
  /// A model is registered over `members` (members_of), at version `membership`, with the
  /// ps tasks' addresses `ps_addresses` (Register::ps_addresses).
  void registered(std::vector<std::uint32_t> members, std::uint64_t membership,
                  std::vector<std::string> ps_addresses) {
    members_ = std::move(members);
    membership_ = membership;
    ps_addresses_ = std::move(ps_addresses);
  }

  /// True once every part held here is initialized (or restored): the ps serves training.
  [[nodiscard]] bool ready() const noexcept { return ready_; }

  /// Parks a WaitReady until the ps is ready.
  void wait_ready(Responder& reply) { waiters_.emplace_back(std::exchange(reply, nullptr)); }

  /// The ps is ready: each waiting WaitReady gets `answer()` (a PlacementReply).
  template <class Answer>
  void become_ready(Answer&& answer) {
    ready_ = true;
    for (Responder& waiter : std::exchange(waiters_, {})) respond(waiter, answer());
  }

  /// The ps stops serving training until it is ready again (a restore in progress).
  void unready() noexcept { ready_ = false; }

  /// Answers every waiting WaitReady with `error`.
  void answer_all(const ErrorReply& error) {
    for (Responder& waiter : std::exchange(waiters_, {})) respond(waiter, ErrorReply{error});
  }

  /// Restores so far.
  [[nodiscard]] std::uint64_t epoch() const noexcept { return epoch_; }
  /// A restore at global step `step` began epoch `epoch`.
  void restored(std::uint64_t epoch, std::int64_t step) noexcept {
    epoch_ = epoch;
    restored_step_ = step;
  }
  /// The global step of the last restore.
  [[nodiscard]] std::int64_t restored_step() const noexcept { return restored_step_; }

  /// Why a request (`what`) of epoch `epoch` is refused, or nullopt if it is this ps's. A
  /// later epoch: the sender saw another ps restored already, and this one's restore is on
  /// its way (kUnavailable: try again). An earlier one: the job was rolled back since its
  /// sender last looked (kFailedPrecondition: start the step again).
  [[nodiscard]] std::optional<ErrorReply> check_epoch(std::uint64_t epoch, std::string_view what) const {
    if (epoch == epoch_) return std::nullopt;
    if (epoch > epoch_) {
      return ErrorReply{ErrorCode::kUnavailable, "ps " + std::to_string(task_) + " is not restored to epoch " +
                                                     std::to_string(epoch) + " yet (it is at epoch " +
                                                     std::to_string(epoch_) + "): try again"};
    }
    return ErrorReply{ErrorCode::kFailedPrecondition,
                      std::string(what) + " of epoch " + std::to_string(epoch) + " refused: the job was " +
                          "restored at global step " + std::to_string(restored_step_) + " (restore epoch " +
                          std::to_string(epoch_) + "; from a checkpoint, or its state moved between ps tasks): "
                          "wait until ready and start the step again"};
  }

  /// Why `variables` cannot be registered, or "": a name missing or used twice, no
  /// elements, more than kMaxElements, an unknown initializer.
  static std::string check_variables(const std::vector<VariableSpec>& variables) {
    std::unordered_set<std::string_view> names;
    for (std::size_t i = 0; i < variables.size(); ++i) {
      const VariableSpec& v = variables[i];
      if (v.name.empty()) return "variable " + std::to_string(i) + " has no name";
      std::size_t elements = 1;  // the shape's product, which must not wrap around
      for (const std::size_t d : v.shape) {
        if (d != 0 && elements > kMaxElements / d) {
          return "variable '" + v.name + "' has more elements than a ps can hold (2^40 at most)";
        }
        elements *= d;
      }
      if (elements == 0) return "variable '" + v.name + "' has no elements";
      if (v.initializer.kind > Initializer::Kind::kGlorotUniform) {
        return "variable '" + v.name + "' has an unknown initializer";
      }
      if (!names.insert(v.name).second) return "variable name '" + v.name + "' is used twice";
    }
    return {};
  }

  /// Why `tables` cannot be registered beside `variables`, or "".
  static std::string check_tables(const std::vector<TableSpec>& tables, const std::vector<VariableSpec>& variables) {
    std::unordered_set<std::string_view> names;
    for (const VariableSpec& v : variables) names.insert(v.name);
    for (std::size_t i = 0; i < tables.size(); ++i) {
      const TableSpec& t = tables[i];
      if (t.name.empty()) return "table " + std::to_string(i) + " has no name";
      if (t.dim == 0 || t.dim > kMaxTableDim) {
        return "table '" + t.name + "' has dim " + std::to_string(t.dim) + " (1 to " + std::to_string(kMaxTableDim) +
               ")";
      }
      if (t.initializer.kind > Initializer::Kind::kNormal) {
        return "table '" + t.name +
               "': its rows need zeros, constant, uniform or normal initial values (Glorot's rule has no "
               "fans in a table)";
      }
      if (t.admit_after == 0) return "table '" + t.name + "' has admit_after 0 (1 admits at once)";
      if (t.evict_after_steps < 0) return "table '" + t.name + "' has a negative evict_after_steps";
      if (!names.insert(t.name).second) return "name '" + t.name + "' is used twice";
    }
    return {};
  }

  /// Why `placement` is not one of `variables` over the ps tasks `members` (ascending), or
  /// "": each variable's parts in order, on members, covering its rows exactly once.
  static std::string check_placement(const std::vector<VariableSpec>& variables, const Placement& placement,
                                     std::span<const std::uint32_t> members) {
    if (placement.num_variables() != variables.size()) return "wrong number of variables";
    for (std::size_t v = 0; v < variables.size(); ++v) {
      std::size_t next_row = 0;
      std::uint32_t index = 0;
      for (const Part& part : placement.parts_of(v)) {
        if (part.variable != v || part.index != index++) return "parts are out of order";
        if (!std::binary_search(members.begin(), members.end(), part.ps)) {
          return "a part is placed on ps " + std::to_string(part.ps) + ", which is not a ps task of the job";
        }
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

 private:
  /// Why `members` cannot be the job's ps tasks, or "": each a ps task of the cluster, once,
  /// ascending, this one among them; its tables' rows placeable over them.
  [[nodiscard]] std::string check_members(const Register& r, const std::vector<std::uint32_t>& members) const {
    if (std::string why = check_task_set(members, "ps task"); !why.empty()) return why;
    if (!r.ps_addresses.empty()) {
      // A new ps's own cluster spec may list tasks beyond the job's: the chief's list rules.
      if (r.ps_addresses.size() <= task_ || r.ps_addresses.size() > kMaxTasks) {
        return "the registration names " + std::to_string(r.ps_addresses.size()) + " ps addresses: not this ps " +
               std::to_string(task_) + ", or more than a job's " + std::to_string(kMaxTasks);
      }
      for (const std::string& address : r.ps_addresses) {
        if (address.empty() || address.size() > 255) return "a ps address of the registration is empty or too long";
      }
      if (r.membership == 0) return "ps addresses beyond the cluster spec come with a membership above 0";
    }
    const std::uint32_t tasks = tasks_of(r);
    for (std::size_t i = 0; i < members.size(); ++i) {
      if (members[i] >= tasks) {
        return "ps " + std::to_string(members[i]) + " is not a ps task of the cluster (it has " +
               std::to_string(tasks) + ")";
      }
    }
    if (!std::binary_search(members.begin(), members.end(), task_)) {
      return "ps " + std::to_string(task_) + " is not among the members registered";
    }
    if (members.size() != tasks && r.membership == 0) {
      return "the members differ from the cluster's ps tasks at membership 0 (the cluster's own shape)";
    }
    return {};
  }

  [[nodiscard]] static std::vector<std::uint32_t> all_tasks(std::uint32_t n) {
    std::vector<std::uint32_t> all(n);
    for (std::uint32_t i = 0; i < n; ++i) all[i] = i;
    return all;
  }

  /// Ps tasks a job may ever have known: a bound on what a registration may name.
  static constexpr std::size_t kMaxTasks = 4096;

  std::uint32_t task_;
  std::uint32_t num_ps_;
  std::vector<std::uint32_t> members_ = all_tasks(num_ps_);
  std::uint64_t membership_ = 0;
  std::vector<std::string> ps_addresses_;
  [[no_unique_address]] S sharding_;
  bool ready_ = false;
  std::vector<Responder> waiters_;
  std::uint64_t epoch_ = 0;           ///< restores so far (Restore::epoch)
  std::int64_t restored_step_ = 0;    ///< the global step of the last restore
};

}  // namespace pulley
// ---- end pulley/ps/registration.hpp ----
// ---- begin pulley/ps/shard.hpp ----

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

// ---- begin pulley/ps/table_shard.hpp ----

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <string>
#include <vector>

// ---- begin pulley/ps/embedding_table.hpp ----

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace pulley {

/// What an embedding table on one ps has done, for monitoring and tests.
struct TableStats {
  std::uint64_t rows = 0;              ///< rows held now
  std::uint64_t rows_created = 0;      ///< rows created (admitted), evicted ones included
  std::uint64_t rows_evicted = 0;      ///< rows removed for being untouched too long
  std::uint64_t candidates = 0;        ///< ids pulled but not admitted yet
  std::uint64_t pushes_dropped = 0;    ///< pushed rows dropped: not admitted (or evicted)
  std::uint64_t updates_refused = 0;   ///< updates dropped whole: a row would go non-finite
  std::uint64_t rows_capped = 0;       ///< rows evicted, or not created, for the spec's max_rows
  std::uint64_t bytes = 0;             ///< memory held for rows, ids and the index
};

/// The rows of one embedding table that one ps holds: a hash map from 64-bit id to a row of
/// `dim` values and the optimizer's `kRowSlots` slots, created lazily, updated row-wise.
///
/// Rows live in chunks of kChunkRows records, allocated whole: a record is the row's id and
/// last-touched step (16 bytes), then its `(1 + kRowSlots) × dim` floats (values, then slot
/// after slot), so that finding, reading and updating a row touch the same cache lines. The
/// index is an IdIndex over row numbers (4 bytes a bucket, at most 3/4 full), whose ids are
/// read from the records.
/// So a row costs its floats plus 16 bytes plus 5.3 to 10.7 bytes of index (the benchmark
/// prints the measured bytes per row), and memory never holds more than one chunk of
/// slack. Lookups of a batch are pipelined: the index buckets and records of ids a few
/// places ahead are prefetched. At most 2^32 − 2 rows per table per ps.
///
/// The index hashes ids with a random key of its own, so that no choice of ids piles them
/// onto one bucket (ids a client picked to collide would otherwise make every lookup walk
/// them all). It is the rows of one table on one ps, part of the ps's Shard (TableShard);
/// it does no I/O and takes no lock: the ps calls it for one request at a time.
///
/// @tparam O RowWiseOptimizer that updates the rows (a dense-only optimizer fails here,
///           naming the member it lacks)
template <RowWiseOptimizer O>
class EmbeddingTable {
 public:
  // The longer bodies are defined in ps/impl/ (included at the end of this header), by
  // concern: the rows, their index and the counters in embedding_table_rows.hpp; updates
  // and the proven rows in embedding_table_updates.hpp; a checkpoint's cut, its reads, the
  // eviction log and a restore in embedding_table_cut.hpp.

  static constexpr std::size_t kChunkRows = 1024;  ///< rows allocated at a time

  /// An empty table of `spec` (its dim must be positive), updated by `optimizer`, whose rows
  /// start from `initialize_row(spec, seed, id, ...)`.
  EmbeddingTable(TableSpec spec, O optimizer, std::uint64_t seed)
      : spec_(std::move(spec)),
        optimizer_(std::move(optimizer)),
        seed_(seed),
        stride_((1 + O::kRowSlots) * spec_.dim),
        record_(kHeader + stride_) {
    if (spec_.dim == 0) throw Error(ErrorCode::kInvalidArgument, "table '" + spec_.name + "' has dim 0");
  }

  [[nodiscard]] const TableSpec& spec() const noexcept { return spec_; }
  [[nodiscard]] std::size_t dim() const noexcept { return spec_.dim; }
  [[nodiscard]] std::size_t size() const noexcept { return rows_; }
  [[nodiscard]] const O& optimizer() const noexcept { return optimizer_; }

  /// Writes the rows of `ids` into `out` (`ids.size() × dim` floats, in order), at global
  /// step `step`. With `create` (a worker's pull), a row not held is created when its id is
  /// admitted (pulled `spec.admit_after` times), else read as its initial value, and a row
  /// read counts as touched; without (a reader's: the chief's, an evaluator's), nothing is
  /// created, counted or touched. Duplicate ids are allowed (each counts towards admission).
  /// `headroom`, if given, is the bytes the ps's tables may still grow by (Tables::max_bytes):
  /// each row created (budget_row_bytes()) and each id admission starts counting
  /// (kCandidateBytes) takes from it; when it is short, the table makes room as at its
  /// max_rows, and failing that the row is not created. An empty `out` reads nothing: the
  /// pull's effects on the table alone (PullRows::touch_only).
  void pull(std::span<const std::uint64_t> ids, std::span<float> out, std::int64_t step,
            bool create = true, std::uint64_t* headroom = nullptr);

  /// What a row costs against a ps's table budget: its record and its index entry.
  [[nodiscard]] std::uint64_t budget_row_bytes() const noexcept { return record_ * sizeof(float) + 8; }
  /// What an id admission counts costs against it.
  static constexpr std::uint64_t kCandidateBytes = 48;
  /// The bytes this table holds against a ps's table budget: rows (and the copies a cut
  /// being read keeps of rows updated since) and admission counts.
  [[nodiscard]] std::uint64_t budget_bytes() const noexcept {
    return (rows_ + kept_touched_.size()) * budget_row_bytes() + candidates_.size() * kCandidateBytes;
  }

  /// Applies one update at global step `step` (steps completed before it; `updates` of this
  /// table so far, this one included): for each of `ids`, which must be distinct, the mean
  /// gradient in `gradients` (`ids.size() × dim`). A row not held is dropped and counted.
  /// All or nothing: if any updated row would hold a non-finite value, nothing changes and
  /// false is returned (counted in `updates_refused`).
  ///
  /// With an optimizer that bounds rows' magnitudes (BoundsRowMagnitudes), an update whose
  /// gradient is ordinary and whose rows are all proven (see `proven`) is proven finite
  /// before a row is read, and each row is updated in place in one pass, the pass judging
  /// the values it writes; only the rows not proven are updated in a copy first and checked.
  bool apply(std::span<const std::uint64_t> ids, std::span<const float> gradients,
             std::int64_t step, std::int64_t updates);

  /// The first half of `apply`: returns true if every updated row stays finite, having
  /// computed the rows it could not prove finite in advance into scratch memory; nothing
  /// changes until `commit`, and `ids` and `gradients` must stay valid until then. A ps
  /// prepares every table of an update, and commits them only if all (and its dense parts)
  /// stay finite.
  bool prepare(std::span<const std::uint64_t> ids, std::span<const float> gradients,
               std::int64_t step, std::int64_t updates);

  /// The second half of `apply`: updates the proven rows in place and writes the others'
  /// copies back (nothing if the last `prepare` failed or was committed already).
  void commit(std::int64_t step);

  /// True if `row` (< size()) is proven (BoundsRowMagnitudes): its last update returned a
  /// bound of kOrdinaryMagnitude or less, or, created or restored since, each of its values
  /// and slots is ordinary and no slot is negative. Always false for other optimizers.
  [[nodiscard]] bool proven(std::uint32_t row) const noexcept;
  /// Rows held that are not proven.
  [[nodiscard]] std::size_t unproven() const noexcept { return unproven_; }
  /// Removes the rows untouched (neither pulled nor pushed) since global step
  /// `step - spec.evict_after_steps`, and forgets admission counts as old; returns the rows
  /// removed. Does nothing when the spec keeps rows for ever.
  std::size_t evict(std::int64_t step);

  /// Floats per row: its values and slots.
  [[nodiscard]] std::size_t stride() const noexcept { return stride_; }
  /// Ids pulled and not admitted yet.
  [[nodiscard]] std::size_t candidates() const noexcept { return candidates_.size(); }

  // ---- what a checkpoint reads and restores --------------------------------------------
  // Rows are numbered 0 to size() − 1; pulls append rows and only an update's eviction
  // renumbers them, so a ps paused for a checkpoint's cut reads rows [0, n) of the cut by
  // number, chunk after chunk, however many pulls come meanwhile.

  /// Appends rows [begin, begin + n) to `ids`, `rows` (stride() floats each: values, then
  /// slots) and `touched` (the step each was last pulled or pushed).
  void read_rows(std::size_t begin, std::size_t n, std::vector<std::uint64_t>& ids,
                 std::vector<float>& rows, std::vector<std::uint32_t>& touched) const;

  /// Appends the numbers of the rows touched at or after global step `since` to `out`: the
  /// rows an incremental checkpoint since then holds.
  void rows_touched_since(std::int64_t since, std::vector<std::uint32_t>& out) const;

  /// Appends rows `numbers` (each < size()) to `ids`, `rows` and `touched`, as read_rows.
  void read_rows(std::span<const std::uint32_t> numbers, std::vector<std::uint64_t>& ids,
                 std::vector<float>& rows, std::vector<std::uint32_t>& touched) const;

  // ---- evictions, for incremental checkpoints -------------------------------------------
  // Every row removed (by evict_after_steps or by max_rows) is logged with its step, so that
  // a checkpoint holding only the rows changed since an earlier one can say which rows went:
  // restored over the earlier one, an evicted row does not come back. The log holds the
  // evictions from `evictions_since()` on; at kMaxEvictionLog entries, or as many as the
  // table's rows if more, it is dropped and starts again (the next checkpoint is then full).

  /// Entries the eviction log holds at least before it is dropped.
  static constexpr std::size_t kMaxEvictionLog = std::size_t{1} << 20U;

  /// The global step from which every eviction is in the log.
  [[nodiscard]] std::int64_t evictions_since() const noexcept { return evictions_since_; }

  /// Appends the ids evicted at or after global step `since` (≥ evictions_since()).
  void read_evicted(std::int64_t since, std::vector<std::uint64_t>& out) const;

  /// Forgets the evictions before global step `step`: no checkpoint since an earlier step
  /// will be asked for.
  void forget_evictions_before(std::int64_t step);

  /// Appends the ids admission is counting, each with its count and the step last pulled.
  void read_candidates(std::vector<std::uint64_t>& ids, std::vector<std::uint32_t>& counts,
                       std::vector<std::uint32_t>& steps) const;

  /// A checkpoint's cut begins: until end_cut, read_rows gives rows [0, size()) as they are
  /// now, however training changes them meanwhile (an update copies a row aside the first
  /// time it changes it: copy-on-write), and no row is evicted or renumbered (the max_rows
  /// cap and evict_after_steps wait). So the ps trains on while the cut is read; the memory
  /// it costs is the rows updated meanwhile.
  void begin_cut();
  /// The cut has been read: what it kept aside goes.
  void end_cut() noexcept;
  /// Rows copied aside for the cut (updated since it began).
  [[nodiscard]] std::size_t kept_for_cut() const noexcept { return kept_touched_.size(); }

  /// Forgets every row and candidate: a restore at global step `step` follows (whose
  /// evictions are logged from then on).
  void clear(std::int64_t step) noexcept;

  /// Sets the row of `id` to `row` (stride() floats: values, then slots; or dim() floats:
  /// values, with fresh slots), last touched at `touched`, creating it if it is not held.
  /// Throws kResourceExhausted at the row limit.
  void restore_row(std::uint64_t id, std::span<const float> row, std::uint32_t touched);

  /// Sets the admission count of `id`, which has no row, to `count` pulls, the last at `step`.
  void restore_candidate(std::uint64_t id, std::uint32_t count, std::uint32_t step);

  /// Calls `f(id, values, slots)` for every row held (values: dim floats; slots:
  /// kRowSlots × dim floats), in no particular order: what a checkpoint saves.
  template <class F>
  void for_each_row(F&& f) const;

  /// Counters and the memory held now.
  [[nodiscard]] TableStats stats() const noexcept;

 private:
  static constexpr std::uint32_t kNone = IdIndex::kNone;

  /// One chunk of kChunkRows rows: their floats, ids and last-touched steps.
  /// Floats of a record's header: the id (two floats' bytes), the step last touched, and
  /// whether the row is proven (see `proven`). Read and written with memcpy: they are
  /// bytes, never arithmetic.
  static constexpr std::size_t kHeader = 4;
  struct Chunk {
    std::vector<float> records;  ///< kChunkRows records
  };
  /// An id pulled, not admitted yet.
  struct Candidate {
    std::uint32_t count = 0;
    std::uint32_t last = 0;  ///< step last pulled
  };

  [[nodiscard]] float* record(std::uint32_t row) noexcept {
    return chunks_[row / kChunkRows].records.data() + (row % kChunkRows) * record_;
  }
  [[nodiscard]] const float* record(std::uint32_t row) const noexcept {
    return chunks_[row / kChunkRows].records.data() + (row % kChunkRows) * record_;
  }
  /// The row's values, then its slots.
  [[nodiscard]] float* at(std::uint32_t row) noexcept { return record(row) + kHeader; }
  [[nodiscard]] const float* at(std::uint32_t row) const noexcept { return record(row) + kHeader; }
  [[nodiscard]] std::uint64_t id_of(std::uint32_t row) const noexcept {
    std::uint64_t id = 0;
    std::memcpy(&id, record(row), sizeof id);
    return id;
  }
  void set_id(std::uint32_t row, std::uint64_t id) noexcept { std::memcpy(record(row), &id, sizeof id); }
  [[nodiscard]] std::uint32_t touched_step(std::uint32_t row) const noexcept {
    std::uint32_t step = 0;
    std::memcpy(&step, record(row) + 2, sizeof step);
    return step;
  }
  void set_touched(std::uint32_t row, std::uint32_t step) noexcept {
    std::memcpy(record(row) + 2, &step, sizeof step);
  }
  static std::uint32_t clamp_step(std::int64_t step) noexcept {
    return static_cast<std::uint32_t>(std::clamp<std::int64_t>(step, 0, kNone - 1));
  }
  /// Marks `row` proven or not, keeping unproven_.
  void set_proven(std::uint32_t row, bool is) noexcept;
  /// Marks `row`, just created or restored, proven if every value and slot of it is
  /// ordinary and no slot is negative (a slot that must not be negative is then not):
  /// BoundsRowMagnitudes. Does nothing for other optimizers.
  void prove_as_held(std::uint32_t row) noexcept;
  /// Updates `row` in place from the pending update's gradient of `ids[i]` (proven finite
  /// in advance), keeping it for a cut first, and marks it proven by the bound it returns.
  void update_in_place(std::uint32_t row, std::size_t i,
                       std::int64_t step) requires BoundsRowMagnitudes<O>;
  void touch(std::uint32_t row, std::int64_t step);

  /// Asks the cache for the first lines of `row`'s record, at most kPrefetchBytes of it (the
  /// hardware prefetcher streams the rest of a long one; more would overrun the few line
  /// fills a core keeps in flight).
  void prefetch_record(std::uint32_t row) const noexcept {
    pulley::prefetch(record(row), std::min<std::size_t>(record_ * sizeof(float), kPrefetchBytes));
  }
  static constexpr std::size_t kPrefetchBytes = 256;

  /// Calls `f(i, row)` for each of `ids` with the row that holds it (kNone if none), in
  /// order, prefetching the index bucket 16 ids ahead and the record its entry names 8 ids
  /// ahead (prefetch_record): a batch's lookups then wait for memory in parallel, not one
  /// after the other.
  template <class F>
  void for_each_found(std::span<const std::uint64_t> ids, F&& f);

  /// Reads a row's id from its record: what the index hashes.
  struct IdOf {
    const EmbeddingTable* table;
    std::uint64_t operator()(std::uint32_t row) const noexcept { return table->id_of(row); }
  };
  [[nodiscard]] IdOf ids() const noexcept { return IdOf{this}; }

  /// The row of `id`, or kNone.
  [[nodiscard]] std::uint32_t find(std::uint64_t id) const noexcept { return index_.find(id, ids()); }

  /// Counts a pull of `id`, which has no row: true once it is admitted.
  bool admit(std::uint64_t id, std::int64_t step);

  /// True if a row can be created under the spec's max_rows: when the table is full, the
  /// least recently touched eighth of its rows go first (rows touched at `step`, which the
  /// step in progress may push, stay; none goes while rows are frozen for a cut).
  bool make_room(std::int64_t step);

  /// A new row for `id` (absent), with its initial value and fresh slots.
  /// With `values_only`, the values are left for the caller to set (a restore).
  std::uint32_t create(std::uint64_t id, bool values_only = false);

  /// Forgets the admission counts of the ids pulled longest ago: at least half of them.
  void forget_oldest_candidates();

  /// Copies `row` aside as the cut saw it, unless it was already.
  void keep_for_cut(std::uint32_t row);

  /// Appends `row` as the cut saw it (its copy, if an update changed it since).
  void read_row(std::uint32_t row, std::vector<std::uint64_t>& ids, std::vector<float>& rows,
                std::vector<std::uint32_t>& touched) const;

  void log_eviction(std::uint64_t id, std::int64_t step);

  /// Removes `row`: its index entry goes, and the last row moves into its place.
  void erase(std::uint32_t row);

  TableSpec spec_;
  [[no_unique_address]] O optimizer_;
  std::uint64_t seed_;
  std::size_t stride_;  ///< floats per row: values and slots
  std::size_t record_;  ///< floats per record: the header, values and slots
  std::vector<Chunk> chunks_;
  IdIndex index_{detail::random_u64()};  ///< id → row, the ids read from the records
  std::size_t rows_ = 0;
  std::unordered_map<std::uint64_t, Candidate> candidates_;
  TableStats stats_;
  std::uint64_t* headroom_ = nullptr;  ///< during a pull: the ps's table budget left (see pull)
  bool frozen_ = false;  ///< a cut is being read: see begin_cut
  std::size_t cut_rows_ = 0;  ///< rows at the cut
  std::unordered_map<std::uint32_t, std::size_t> kept_at_;  ///< row → its copy, as the cut saw it
  std::vector<float> kept_;                 ///< the copies, stride_ floats each
  std::vector<std::uint32_t> kept_touched_;  ///< their last-touched steps
  std::uint32_t full_at_ = kNone;  ///< the step at which no row could go (the cap's scan waits)
  std::vector<std::pair<std::uint64_t, std::uint32_t>> evicted_;  ///< id, step: see read_evicted
  std::int64_t evictions_since_ = 0;
  std::size_t unproven_ = 0;  ///< rows held that are not proven (see `proven`)
  /// The update between prepare and commit.
  struct Pending {
    std::span<const std::uint64_t> ids;
    std::span<const float> gradients;
    std::int64_t updates = 0;
    bool in_place = false;  ///< proven rows are updated in place
    bool one_pass = false;  ///< every row is: commit finds them
  };
  Pending pending_;
  std::vector<std::pair<std::uint32_t, std::size_t>> in_place_rows_;  ///< row, position in ids: proven rows
  std::vector<std::pair<std::uint32_t, std::size_t>> scratch_rows_;   ///< row, position in ids: the others
  std::vector<float> scratch_;                                        ///< the others' rows being updated
  std::vector<bool> scratch_proven_;                                  ///< whether each came out proven
};

}  // namespace pulley

// EmbeddingTable's member functions' definitions, by concern.
// ---- begin pulley/ps/impl/embedding_table_cut.hpp ----

/// EmbeddingTable's state for a checkpoint (declared in ps/embedding_table.hpp, which
/// includes this header after the class): a checkpoint's cut (begin_cut, keep_for_cut,
/// end_cut), the rows and admission counts it reads (read_rows, read_row,
/// rows_touched_since, read_candidates, for_each_row), the eviction log (log_eviction,
/// read_evicted, forget_evictions_before) and a restore (clear, restore_row,
/// restore_candidate).

namespace pulley {

template <RowWiseOptimizer O>
void EmbeddingTable<O>::read_rows(std::size_t begin, std::size_t n, std::vector<std::uint64_t>& ids,
                                  std::vector<float>& rows,
                                  std::vector<std::uint32_t>& touched) const {
  n = std::min(n, rows_ - std::min(begin, rows_));
  detail::reserve_on_huge_pages(rows, rows.size() + n * stride_);
  for (std::size_t k = 0; k < n; ++k)
    read_row(static_cast<std::uint32_t>(begin + k), ids, rows, touched);
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::rows_touched_since(std::int64_t since,
                                           std::vector<std::uint32_t>& out) const {
  const std::uint32_t from = clamp_step(since);
  for (std::uint32_t row = 0; row < rows_; ++row) {
    if (touched_step(row) >= from) out.push_back(row);
  }
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::read_rows(std::span<const std::uint32_t> numbers,
                                  std::vector<std::uint64_t>& ids, std::vector<float>& rows,
                                  std::vector<std::uint32_t>& touched) const {
  detail::reserve_on_huge_pages(rows, rows.size() + numbers.size() * stride_);
  for (const std::uint32_t row : numbers) read_row(row, ids, rows, touched);
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::read_evicted(std::int64_t since, std::vector<std::uint64_t>& out) const {
  for (const auto& [id, step] : evicted_) {
    if (static_cast<std::int64_t>(step) >= since) out.push_back(id);
  }
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::forget_evictions_before(std::int64_t step) {
  if (step <= evictions_since_) return;
  std::erase_if(evicted_,
                [&](const auto& e) { return static_cast<std::int64_t>(e.second) < step; });
  evictions_since_ = step;
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::read_candidates(std::vector<std::uint64_t>& ids,
                                        std::vector<std::uint32_t>& counts,
                                        std::vector<std::uint32_t>& steps) const {
  for (const auto& [id, c] : candidates_) {
    ids.push_back(id);
    counts.push_back(c.count);
    steps.push_back(c.last);
  }
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::begin_cut() {
  end_cut();
  frozen_ = true;
  cut_rows_ = rows_;
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::end_cut() noexcept {
  frozen_ = false;
  cut_rows_ = 0;
  kept_at_.clear();
  std::vector<float>().swap(kept_);
  std::vector<std::uint32_t>().swap(kept_touched_);
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::clear(std::int64_t step) noexcept {
  chunks_.clear();
  index_.clear();
  rows_ = 0;
  candidates_.clear();
  scratch_rows_.clear();
  in_place_rows_.clear();
  pending_ = Pending{};
  unproven_ = 0;
  evicted_.clear();
  evictions_since_ = step;
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::restore_row(std::uint64_t id, std::span<const float> row,
                                    std::uint32_t touched) {
  std::uint32_t r = find(id);
  if (r == kNone) {
    r = create(id, true);
    --stats_.rows_created;  // restored, not created
  } else if (row.size() < stride_) {
    optimizer_.init_row(std::span<float>(at(r) + spec_.dim, stride_ - spec_.dim));
  }
  std::copy(row.begin(), row.begin() + static_cast<std::ptrdiff_t>(std::min(row.size(), stride_)),
            at(r));
  set_touched(r, clamp_step(touched));
  prove_as_held(r);
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::restore_candidate(std::uint64_t id, std::uint32_t count,
                                          std::uint32_t step) {
  if (spec_.admit_after <= 1 || find(id) != kNone) return;
  candidates_[id] = Candidate{std::min(count, spec_.admit_after - 1), clamp_step(step)};
}

template <RowWiseOptimizer O>
template <class F>
void EmbeddingTable<O>::for_each_row(F&& f) const {
  const std::size_t d = spec_.dim;
  for (std::uint32_t row = 0; row < rows_; ++row) {
    const float* r = at(row);
    f(id_of(row), std::span<const float>(r, d), std::span<const float>(r + d, stride_ - d));
  }
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::keep_for_cut(std::uint32_t row) {
  const auto [it, fresh] = kept_at_.try_emplace(row, kept_touched_.size());
  if (!fresh) return;
  kept_.insert(kept_.end(), at(row), at(row) + stride_);
  kept_touched_.push_back(touched_step(row));
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::read_row(std::uint32_t row, std::vector<std::uint64_t>& ids,
                                 std::vector<float>& rows,
                                 std::vector<std::uint32_t>& touched) const {
  ids.push_back(id_of(row));
  if (!kept_at_.empty()) {
    if (const auto it = kept_at_.find(row); it != kept_at_.end()) {
      const float* from = kept_.data() + it->second * stride_;
      rows.insert(rows.end(), from, from + stride_);
      touched.push_back(kept_touched_[it->second]);
      return;
    }
  }
  rows.insert(rows.end(), at(row), at(row) + stride_);
  touched.push_back(touched_step(row));
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::log_eviction(std::uint64_t id, std::int64_t step) {
  if (evicted_.size() >= std::max(kMaxEvictionLog, rows_)) {  // too many: a full checkpoint is next
    evicted_.clear();
    evictions_since_ = step + 1;
    return;
  }
  evicted_.emplace_back(id, clamp_step(step));
}

}  // namespace pulley
// ---- end pulley/ps/impl/embedding_table_cut.hpp ----
// ---- begin pulley/ps/impl/embedding_table_rows.hpp ----

/// EmbeddingTable's rows (declared in ps/embedding_table.hpp, which includes this header
/// after the class): a pull (pull: admit, make_room, create), the index's lookups
/// (for_each_found), a row touched (touch), rows removed (evict, erase) and admission
/// counts forgotten (forget_oldest_candidates), and the counters (stats).

namespace pulley {

template <RowWiseOptimizer O>
void EmbeddingTable<O>::pull(std::span<const std::uint64_t> ids, std::span<float> out,
                             std::int64_t step, bool create, std::uint64_t* headroom) {
  const std::size_t d = spec_.dim;
  headroom_ = headroom;
  struct Reset {  // whatever happens (a failed allocation throws), the pointer goes
    std::uint64_t*& headroom;
    ~Reset() { headroom = nullptr; }
  } reset{headroom_};
  const bool read = !out.empty();
  for_each_found(ids, [&](std::size_t i, std::uint32_t row) {
    if (row == kNone && create && admit(ids[i], step) && make_room(step))
      row = this->create(ids[i]);
    if (row != kNone && create) touch(row, step);
    if (!read) return;
    const std::span<float> into = out.subspan(i * d, d);
    if (row == kNone) {
      initialize_row(spec_, seed_, ids[i], into);
      return;
    }
    const float* values = at(row);
    std::copy(values, values + d, into.begin());
  });
}

template <RowWiseOptimizer O>
std::size_t EmbeddingTable<O>::evict(std::int64_t step) {
  if (spec_.evict_after_steps <= 0 || frozen_) return 0;  // (no row goes during a cut)
  const std::int64_t before = step - spec_.evict_after_steps;
  if (before <= 0) return 0;
  std::size_t removed = 0;
  for (std::uint32_t row = 0; row < rows_;) {
    if (static_cast<std::int64_t>(touched_step(row)) < before) {
      log_eviction(id_of(row), step);
      erase(row);  // the last row moves here: look at this row again
      ++removed;
    } else {
      ++row;
    }
  }
  std::erase_if(candidates_,
                [&](const auto& c) { return static_cast<std::int64_t>(c.second.last) < before; });
  stats_.rows_evicted += removed;
  return removed;
}

template <RowWiseOptimizer O>
TableStats EmbeddingTable<O>::stats() const noexcept {
  TableStats s = stats_;
  s.rows = rows_;
  s.candidates = candidates_.size();
  s.bytes = chunks_.size() * kChunkRows * record_ * sizeof(float) + index_.bytes() +
            candidates_.size() * (sizeof(std::uint64_t) + sizeof(Candidate) + 2 * sizeof(void*));
  return s;
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::touch(std::uint32_t row, std::int64_t step) {
  const std::uint32_t now = clamp_step(step);
  if (now <= touched_step(row)) return;
  if (frozen_ && row < cut_rows_) keep_for_cut(row);  // the cut reads the step it saw
  set_touched(row, now);
}

template <RowWiseOptimizer O>
template <class F>
void EmbeddingTable<O>::for_each_found(std::span<const std::uint64_t> ids, F&& f) {
  constexpr std::size_t kIndexAhead = 16;
  constexpr std::size_t kRecordAhead = 8;
  const std::size_t n = ids.size();
  for (std::size_t i = 0; i < n; ++i) {
    if (i + kIndexAhead < n) index_.prefetch(ids[i + kIndexAhead]);
    if (i + kRecordAhead < n) {
      const std::uint32_t row = index_.first_entry(ids[i + kRecordAhead]);
      if (row != kNone) prefetch_record(row);
    }
    f(i, find(ids[i]));
  }
}

template <RowWiseOptimizer O>
bool EmbeddingTable<O>::admit(std::uint64_t id, std::int64_t step) {
  if (spec_.admit_after <= 1) return true;
  if (!candidates_.contains(id)) {
    if (spec_.max_rows > 0 && candidates_.size() >= spec_.max_rows) forget_oldest_candidates();
    if (headroom_ != nullptr && *headroom_ < kCandidateBytes) {
      const std::size_t before = candidates_.size();
      if (before > 0) forget_oldest_candidates();
      *headroom_ += (before - candidates_.size()) * kCandidateBytes;
      if (*headroom_ < kCandidateBytes) {
        ++stats_.rows_capped;  // not even its count fits: it is not counted
        return false;
      }
    }
    if (headroom_ != nullptr) *headroom_ -= kCandidateBytes;
  }
  Candidate& c = candidates_[id];
  ++c.count;
  c.last = clamp_step(step);
  return c.count >= spec_.admit_after;  // its count goes once its row exists (create)
}

template <RowWiseOptimizer O>
bool EmbeddingTable<O>::make_room(std::int64_t step) {
  const std::uint64_t cap = spec_.max_rows;
  auto fits = [&] {
    return (cap == 0 || rows_ < cap) && (headroom_ == nullptr || *headroom_ >= budget_row_bytes());
  };
  if (fits()) return true;
  const std::uint32_t now = clamp_step(step);
  if (!frozen_ && full_at_ != now && rows_ > 0) {  // one fruitless pass per step is enough
    std::vector<std::uint32_t> steps(rows_);
    for (std::uint32_t row = 0; row < rows_; ++row) steps[row] = touched_step(row);
    const std::size_t k = std::max<std::size_t>(1, rows_ / 8) - 1;
    std::nth_element(steps.begin(), steps.begin() + static_cast<std::ptrdiff_t>(k), steps.end());
    const std::uint32_t oldest = steps[k];  // an eighth of the rows were touched at or before it
    // Those touched before it, then those touched at it, up to an eighth in all.
    std::size_t removed = 0;
    for (const bool ties : {false, true}) {
      for (std::uint32_t row = 0; row < rows_ && removed <= k;) {
        const std::uint32_t touched = touched_step(row);
        if (touched < now && (ties ? touched == oldest : touched < oldest)) {
          log_eviction(id_of(row), now);
          erase(row);  // the last row moves here: look at this row again
          ++removed;
        } else {
          ++row;
        }
      }
    }
    stats_.rows_capped += removed;
    if (headroom_ != nullptr) *headroom_ += removed * budget_row_bytes();
    if (removed == 0) full_at_ = now;
  }
  if (fits()) return true;
  ++stats_.rows_capped;  // nothing could go: this row is not created
  return false;
}

template <RowWiseOptimizer O>
std::uint32_t EmbeddingTable<O>::create(std::uint64_t id, bool values_only) {
  if (rows_ >= kNone - 1) {
    throw Error(ErrorCode::kResourceExhausted,
                "table '" + spec_.name + "' holds 2^32 - 2 rows on this ps");
  }
  if (rows_ == chunks_.size() * kChunkRows) {
    chunks_.push_back(Chunk{std::vector<float>(kChunkRows * record_)});
  }
  const auto row = static_cast<std::uint32_t>(rows_);
  float* r = at(row);
  if (!values_only) initialize_row(spec_, seed_, id, std::span<float>(r, spec_.dim));
  optimizer_.init_row(std::span<float>(r + spec_.dim, stride_ - spec_.dim));
  set_id(row, id);
  set_touched(row, 0);
  const std::uint32_t not_proven = 0;  // (a fresh chunk's records hold 0; a reused one's may not)
  std::memcpy(record(row) + 3, &not_proven, sizeof not_proven);
  index_.insert(row, ids());  // (a failed allocation leaves the row unused)
  ++rows_;
  ++unproven_;
  if (!values_only) prove_as_held(row);  // (a restore proves it once its values are in)
  if (headroom_ != nullptr) *headroom_ -= std::min(*headroom_, budget_row_bytes());
  ++stats_.rows_created;
  if (spec_.admit_after > 1 && candidates_.erase(id) > 0 && headroom_ != nullptr) {
    *headroom_ += kCandidateBytes;  // admitted: its count is done
  }
  return row;
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::forget_oldest_candidates() {
  std::vector<std::uint32_t> last;
  last.reserve(candidates_.size());
  for (const auto& entry : candidates_) last.push_back(entry.second.last);
  const auto middle = last.begin() + static_cast<std::ptrdiff_t>(last.size() / 2);
  std::nth_element(last.begin(), middle, last.end());
  const std::uint32_t keep_after = *middle;
  std::erase_if(candidates_, [&](const auto& c) { return c.second.last <= keep_after; });
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::erase(std::uint32_t row) {
  if (!proven(row)) --unproven_;
  index_.erase(row, ids());
  const auto last = static_cast<std::uint32_t>(rows_ - 1);
  if (row != last) {
    index_.renumber(last, row, ids());
    std::copy(record(last), record(last) + record_, record(row));
  }
  --rows_;
  const std::size_t needed = (rows_ + kChunkRows - 1) / kChunkRows;
  while (chunks_.size() > needed + 1) chunks_.pop_back();  // one spare chunk at most
}

}  // namespace pulley
// ---- end pulley/ps/impl/embedding_table_rows.hpp ----
// ---- begin pulley/ps/impl/embedding_table_updates.hpp ----

/// EmbeddingTable's updates (declared in ps/embedding_table.hpp, which includes this
/// header after the class): an update applied (apply), or prepared and committed (prepare,
/// commit: update_in_place for the rows proven finite in advance), and the proven rows'
/// bookkeeping (proven, set_proven, prove_as_held).

namespace pulley {

template <RowWiseOptimizer O>
bool EmbeddingTable<O>::apply(std::span<const std::uint64_t> ids, std::span<const float> gradients,
                              std::int64_t step, std::int64_t updates) {
  if (!prepare(ids, gradients, step, updates)) return false;
  commit(step);
  return true;
}

template <RowWiseOptimizer O>
bool EmbeddingTable<O>::prepare(std::span<const std::uint64_t> ids,
                                std::span<const float> gradients, std::int64_t step,
                                std::int64_t updates) {
  const std::size_t d = spec_.dim;
  scratch_rows_.clear();
  in_place_rows_.clear();
  pending_ = Pending{ids, gradients, updates, false, false};
  if constexpr (BoundsRowMagnitudes<O>) {
    const RowContext context{step, updates, spec_.name, 0};
    pending_.in_place =
        optimizer_.row_stays_finite_given(kOrdinaryMagnitude, kOrdinaryMagnitude, context) &&
        detail::all_ordinary(gradients);
    if (pending_.in_place && unproven_ == 0) {
      pending_.one_pass = true;  // every row held is proven: commit finds and updates them
      return true;
    }
  }
  // A row not proven is updated into a copy first, so that a row going non-finite changes
  // nothing; each is copied the moment it is found, while its prefetched record is in
  // cache.
  scratch_.resize(ids.size() * stride_);
  for_each_found(ids, [&](std::size_t i, std::uint32_t row) {
    if (row == kNone) {
      ++stats_.pushes_dropped;
      return;
    }
    if (pending_.in_place && proven(row)) {
      in_place_rows_.push_back({row, i});
      return;
    }
    std::copy(at(row), at(row) + stride_, scratch_.data() + scratch_rows_.size() * stride_);
    scratch_rows_.push_back({row, i});
  });
  scratch_.resize(scratch_rows_.size() * stride_);
  scratch_proven_.assign(scratch_rows_.size(), false);
  for (std::size_t k = 0; k < scratch_rows_.size(); ++k) {
    const std::size_t i = scratch_rows_[k].second;
    float* copy = scratch_.data() + k * stride_;
    const RowContext context{step, updates, spec_.name, ids[i]};
    const std::span<float> values(copy, d);
    const std::span<float> slots(copy + d, stride_ - d);
    if constexpr (BoundsRowMagnitudes<O>) {
      scratch_proven_[k] = optimizer_.apply_row_bounded(values, slots, gradients.subspan(i * d, d),
                                                        context) <= kOrdinaryMagnitude;
    } else {
      optimizer_.apply_row(values, slots, gradients.subspan(i * d, d), context);
    }
  }
  if (!detail::all_finite(scratch_)) {
    ++stats_.updates_refused;
    scratch_rows_.clear();
    in_place_rows_.clear();
    pending_ = Pending{};
    return false;
  }
  return true;
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::commit(std::int64_t step) {
  constexpr std::size_t kAhead = 8;
  if constexpr (BoundsRowMagnitudes<O>) {  // (only then are rows updated in place)
    if (pending_.one_pass) {
      for_each_found(pending_.ids, [&](std::size_t i, std::uint32_t row) {
        if (row == kNone) {
          ++stats_.pushes_dropped;
          return;
        }
        update_in_place(row, i, step);
      });
    }
    for (std::size_t k = 0; k < in_place_rows_.size(); ++k) {
      if (k + kAhead < in_place_rows_.size()) prefetch_record(in_place_rows_[k + kAhead].first);
      update_in_place(in_place_rows_[k].first, in_place_rows_[k].second, step);
    }
  }
  for (std::size_t k = 0; k < scratch_rows_.size(); ++k) {
    if (k + kAhead < scratch_rows_.size()) prefetch_record(scratch_rows_[k + kAhead].first);
    const std::uint32_t row = scratch_rows_[k].first;
    if (frozen_ && row < cut_rows_) keep_for_cut(row);
    std::copy(scratch_.data() + k * stride_, scratch_.data() + (k + 1) * stride_, at(row));
    if constexpr (BoundsRowMagnitudes<O>) set_proven(row, scratch_proven_[k]);
    touch(row, step);
  }
  scratch_rows_.clear();
  in_place_rows_.clear();
  pending_ = Pending{};
}

template <RowWiseOptimizer O>
bool EmbeddingTable<O>::proven(std::uint32_t row) const noexcept {
  std::uint32_t flag = 0;
  std::memcpy(&flag, record(row) + 3, sizeof flag);
  return flag != 0;
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::set_proven(std::uint32_t row, bool is) noexcept {
  if (proven(row) == is) return;
  const std::uint32_t flag = is ? 1 : 0;
  std::memcpy(record(row) + 3, &flag, sizeof flag);
  if (is) {
    --unproven_;
  } else {
    ++unproven_;
  }
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::prove_as_held(std::uint32_t row) noexcept {
  if constexpr (BoundsRowMagnitudes<O>) {
    const float* r = at(row);
    set_proven(row, detail::all_ordinary(std::span<const float>(r, spec_.dim)) &&
                        detail::all_ordinary_non_negative(
                            std::span<const float>(r + spec_.dim, stride_ - spec_.dim)));
  }
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::update_in_place(std::uint32_t row, std::size_t i,
                                        std::int64_t step) requires BoundsRowMagnitudes<O> {
  const std::size_t d = spec_.dim;
  if (frozen_ && row < cut_rows_) keep_for_cut(row);
  float* r = at(row);
  const RowContext context{step, pending_.updates, spec_.name, pending_.ids[i]};
  const float bound =
      optimizer_.apply_row_bounded(std::span<float>(r, d), std::span<float>(r + d, stride_ - d),
                                   pending_.gradients.subspan(i * d, d), context);
  set_proven(row, bound <= kOrdinaryMagnitude);
  touch(row, step);
}

}  // namespace pulley
// ---- end pulley/ps/impl/embedding_table_updates.hpp ----
// ---- end pulley/ps/embedding_table.hpp ----
// ---- begin pulley/tables/tables.hpp ----

#include <cstdint>
#include <type_traits>

// ---- begin pulley/tables/row_aggregation.hpp ----

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace pulley {

/// The rows of one table pushed for one update, summed by id, with the number of pushes
/// that held each row: what RowMean and RowSum keep. The first push of an update is kept
/// as it came, with no lookups (every push of Async, the first of a sync step); ids are
/// indexed only when a second one comes, with a hash keyed at random.
class RowSums {
 public:
  /// Rows of `dim` floats.
  explicit RowSums(std::size_t dim = 0) : dim_(dim) {}

  /// Adds one push: `rows` (`ids.size() × dim` floats) of the distinct `ids`.
  void add(std::span<const std::uint64_t> ids, std::span<const float> rows) {
    if (ids_.empty()) {
      ids_.assign(ids.begin(), ids.end());
      counts_.assign(ids.size(), 1);
      sums_.assign(rows.begin(), rows.begin() + static_cast<std::ptrdiff_t>(ids.size() * dim_));
      return;
    }
    if (positions_.size() == 0) {  // positions are numbered as ids_ is ordered
      positions_.reserve(ids_.size() + ids.size());
      for (const std::uint64_t id : ids_) positions_.insert(id);
    }
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const auto [at, fresh] = positions_.insert(ids[i]);
      const float* row = rows.data() + i * dim_;
      if (fresh) {
        ids_.push_back(ids[i]);
        counts_.push_back(1);
        sums_.insert(sums_.end(), row, row + dim_);
      } else {
        ++counts_[at];
        float* sum = sums_.data() + at * dim_;
        for (std::size_t k = 0; k < dim_; ++k) sum[k] += row[k];
      }
    }
  }

  /// The distinct ids added, in the order they first came.
  [[nodiscard]] std::span<const std::uint64_t> ids() const noexcept { return ids_; }
  /// The sums, `ids().size() × dim` floats in ids() order.
  [[nodiscard]] std::span<float> sums() noexcept { return sums_; }
  /// How many pushes held each row, in ids() order.
  [[nodiscard]] std::span<const std::uint32_t> counts() const noexcept { return counts_; }
  /// Floats in a row.
  [[nodiscard]] std::size_t dim() const noexcept { return dim_; }

  /// Forgets everything added (memory is kept for the next update).
  void clear() noexcept {
    positions_.clear();
    ids_.clear();
    counts_.clear();
    sums_.clear();
  }

 private:
  std::size_t dim_;
  IdPositions positions_{detail::random_u64()};  ///< id → place in ids_, from the second push
  std::vector<std::uint64_t> ids_;
  std::vector<std::uint32_t> counts_;
  std::vector<float> sums_;
};

/// Each row's update is the sum of its gradients over the update's pushes, as TensorFlow's
/// SparseConditionalAccumulator with `reduction_type='SUM'`: with gradients of each
/// replica's mean loss, a row many replicas pushed moves by all of them.
struct RowSum {
  using Accumulator = RowSums;
  [[nodiscard]] RowSums make_accumulator(std::size_t dim) const { return RowSums(dim); }
  void add(RowSums& acc, std::span<const std::uint64_t> ids, std::span<const float> rows) const {
    acc.add(ids, rows);
  }
  [[nodiscard]] std::span<const std::uint64_t> ids(const RowSums& acc) const noexcept { return acc.ids(); }
  [[nodiscard]] std::span<const float> take(RowSums& acc) const noexcept { return acc.sums(); }
  void clear(RowSums& acc) const noexcept { acc.clear(); }
};
static_assert(RowAggregation<RowSum>);

/// Each row's update is its mean over the pushes of the update that held it, as
/// TensorFlow's SparseConditionalAccumulator with `reduction_type='MEAN'` (element-wise by
/// each row's own count, not by the number of pushes): a row that 1 of R replicas pushed
/// moves by that replica's gradient, not by a 1/R share of it. The default. RowSum's
/// accumulator, divided at the end.
struct RowMean : RowSum {
  /// Divides each sum by its count, in place.
  [[nodiscard]] std::span<const float> take(RowSums& acc) const noexcept {
    const std::span<float> sums = acc.sums();
    const std::size_t dim = acc.dim();
    for (std::size_t r = 0; r < acc.counts().size(); ++r) {
      const std::uint32_t n = acc.counts()[r];
      if (n == 1) continue;
      for (float& x : sums.subspan(r * dim, dim)) x /= static_cast<float>(n);
    }
    return sums;
  }
};
static_assert(RowAggregation<RowMean>);

}  // namespace pulley
// ---- end pulley/tables/row_aggregation.hpp ----

namespace pulley {

/// The embedding-table policy of a ParameterServer (its fourth policy): the row-wise
/// optimizer its tables are updated with (it may differ from the dense variables' one:
/// Adagrad or FTRL for embeddings and Adam for the rest is common), how their rows are
/// spread over the ps tasks, and how the rows pushed for one update are combined. Workers
/// must use the same id sharding: name it once (`using MyTables = Tables<...>`) and give
/// the workers `MyTables::Sharding`; ps tasks and workers that disagree are refused when
/// the workers get ready.
///
/// @tparam O RowWiseOptimizer of the tables; a dense-only one fails to compile here
/// @tparam I IdSharding of the rows (HashIds by default)
/// @tparam A RowAggregation of an update's rows (RowMean by default, as TensorFlow's
///           SparseConditionalAccumulator)
template <RowWiseOptimizer O, IdSharding I = HashIds, RowAggregation A = RowMean>
struct Tables {
  using Optimizer = O;
  using Sharding = I;
  using Aggregation = A;
  [[no_unique_address]] O optimizer{};    ///< updates every table's rows
  [[no_unique_address]] I sharding{};     ///< which ps holds which row
  [[no_unique_address]] A aggregation{};  ///< what an update's pushed rows add up to
  /// The bytes each ps's tables may hold, rows and admission counts (a row costs its
  /// values, slots and a 16-byte header, plus 8 bytes of index; 0: no budget). A worker's
  /// pull that would pass it first evicts the least recently touched eighth of the rows of
  /// the table it creates a row in, as TableSpec::max_rows does; failing that, the row is
  /// not created (it reads as its initial value, its pushes are dropped), counted in
  /// Stats::table_rows_capped. No worker request grows a ps's tables past it.
  std::uint64_t max_bytes = 0;
};

/// The table policy of a ParameterServer that serves no embedding tables: a model that
/// declares some is refused at registration, naming the fix. The default when the
/// ParameterServer's optimizer has no row-wise apply (Momentum).
struct NoTables {};

/// True for `Tables<...>` and any policy of its shape; NoTables is not one.
template <class T>
concept TablePolicy = RowWiseOptimizer<typename T::Optimizer> && IdSharding<typename T::Sharding> &&
    RowAggregation<typename T::Aggregation> && requires(const T& tables) {
  { tables.optimizer } -> std::convertible_to<const typename T::Optimizer&>;
  { tables.sharding } -> std::convertible_to<const typename T::Sharding&>;
  { tables.aggregation } -> std::convertible_to<const typename T::Aggregation&>;
};

/// A ParameterServer's fourth policy: a TablePolicy, or NoTables.
template <class T>
concept TablesOrNone = TablePolicy<T> || std::is_same_v<T, NoTables>;

namespace detail {
template <class O, bool = RowWiseOptimizer<O>>
struct default_tables {
  using type = NoTables;
};
template <class O>
struct default_tables<O, true> {
  using type = Tables<O>;
};
}  // namespace detail

/// Tables<O> when O can update rows, NoTables otherwise: a ParameterServer's default.
template <class O>
using DefaultTables = typename detail::default_tables<O>::type;

/// The table policy a ParameterServer gets when none is given: T{}, its optimizer a copy of
/// the dense `optimizer` (the same settings) when it is of the same type.
template <TablesOrNone T, class O>
T default_table_policy(const O& optimizer) {
  T tables{};
  if constexpr (TablePolicy<T>) {
    if constexpr (std::is_same_v<typename T::Optimizer, O>) tables.optimizer = optimizer;
  }
  return tables;
}

}  // namespace pulley
// ---- end pulley/tables/tables.hpp ----

namespace pulley {

/// The rows of embedding tables a ps task holds: one EmbeddingTable per table of the model,
/// the accumulator of each table's rows pushed for the update in progress (the table
/// policy's RowAggregation), its update count (lazy Adam's t) and the step of its next
/// eviction pass. Part of the ps's Shard. `TableShard<NoTables>` holds none and refuses
/// every row.
///
/// An update of the tables is two-phase: `prepare` computes every pushed row's new value
/// aside and says whether all stay finite, `commit` writes them; the ps commits only when
/// its dense parts stay finite too, so an update is applied whole or not at all.
///
/// @tparam T the ParameterServer's table policy (Tables<...>)
template <class T>
class TableShard {
 public:
  using Optimizer = typename T::Optimizer;
  /// Floats in one row of a table.
  static constexpr std::size_t kMaxDim = std::size_t{1} << 16U;

  explicit TableShard(T policy = {}) : policy_(std::move(policy)) {}

  /// The table policy.
  [[nodiscard]] const T& policy() const noexcept { return policy_; }

  /// Empty tables for `specs` (checked: see ParameterServer), whose rows start from
  /// `seed`, on ps `task` of the job's ps tasks `members`. All of it is built before any
  /// of it is kept.
  void assign(std::uint32_t task, std::span<const std::uint32_t> members, const std::vector<TableSpec>& specs,
              std::uint64_t seed) {
    std::vector<Table> tables;
    tables.reserve(specs.size());
    for (const TableSpec& spec : specs) {
      tables.push_back(Table{EmbeddingTable<Optimizer>(spec, policy_.optimizer, seed),
                             policy_.aggregation.make_accumulator(spec.dim), 0, 0, false, 0, -1, 0, false, {}, {}, {}});
    }
    std::vector<std::uint32_t> kept(members.begin(), members.end());
    tables_ = std::move(tables);
    task_ = task;
    members_ = std::move(kept);
  }

  /// Tables held.
  [[nodiscard]] std::size_t size() const noexcept { return tables_.size(); }
  /// Where this ps's id sharding puts the tables' rows (`id_sharding_fingerprint`).
  [[nodiscard]] std::uint64_t id_sharding(const std::vector<TableSpec>& specs) const {
    return id_sharding_fingerprint(policy_.sharding, specs, members_);
  }
  /// The spec of table `t`.
  [[nodiscard]] const TableSpec& spec(std::size_t t) const { return tables_[t].rows.spec(); }

  /// Why `rows` (of a pull, or with values of a push) cannot be served here, or nullopt: a
  /// table that does not exist or comes twice, too many ids or bytes, an id twice, an id
  /// another ps holds, rows of the wrong size, non-finite values (unless `finite_known`).
  /// So a reply is never larger than the rows it names once each.
  [[nodiscard]] std::optional<ErrorReply> check(const std::vector<TableRows>& rows, bool with_values,
                                                bool finite_known) {
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const TableRows& tr = rows[i];
      if (tr.table >= tables_.size()) {
        return refuse("unknown table " + std::to_string(tr.table) + " (the model has " +
                      std::to_string(tables_.size()) + ")");
      }
      const TableSpec& s = spec(tr.table);
      for (std::size_t j = 0; j < i; ++j) {
        if (rows[j].table == tr.table) return refuse("table '" + s.name + "' comes twice");
      }
      if (tr.ids.size() > kMaxIdsPerMessage || tr.ids.size() * s.dim * sizeof(float) > kMaxRowBytesPerMessage) {
        return refuse(std::to_string(tr.ids.size()) + " ids of table '" + s.name + "' in one request (at most " +
                      std::to_string(std::min<std::size_t>(kMaxIdsPerMessage,
                                                           kMaxRowBytesPerMessage / sizeof(float) / s.dim)) +
                      ")");
      }
      if (tr.values.size() != (with_values ? tr.ids.size() * s.dim : 0)) {
        return refuse("table '" + s.name + "': " + std::to_string(tr.values.size()) + " values for " +
                      std::to_string(tr.ids.size()) + " rows of dim " + std::to_string(s.dim));
      }
      if (const std::uint64_t* twice = seen_.first_duplicate(tr.ids)) {
        return refuse("row " + std::to_string(*twice) + " of table '" + s.name +
                      "' comes twice in one request (a worker sums a row's gradients before it pushes)");
      }
      for (const std::uint64_t id : tr.ids) {
        const std::uint32_t owner = row_owner(policy_.sharding, s.name, id, members_);
        if (owner != task_) {
          return refuse("row " + std::to_string(id) + " of table '" + s.name + "' is held by ps " +
                        std::to_string(owner) + ", not here (do the worker and the ps use the same " +
                        "id sharding?)");
        }
      }
      if (with_values && !finite_known && !detail::all_finite(tr.values)) {
        return refuse("non-finite (NaN or Inf) rows for table '" + s.name + "'; nothing was applied");
      }
    }
    return std::nullopt;
  }

  /// The rows `request` asks for, at global step `step`, in buffers that stay valid until
  /// `free_replies` (none for `PullRows::touch_only`); `create` (a worker's pull) creates,
  /// admits and touches rows.
  RowsReply pull(const PullRows& request, bool create, std::int64_t step, Stats& stats) {
    if (used_ == replies_.size()) replies_.emplace_back();
    std::vector<std::vector<float>>& buffers = replies_[used_++];
    buffers.resize(request.tables.size());
    RowsReply answer{step, {}};
    // The ps's budget for its tables (Tables::max_bytes) left, shared by the tables pulled.
    std::uint64_t headroom = 0;
    const std::uint64_t budget = max_bytes();
    if (budget > 0 && create) {
      std::uint64_t used = 0;
      for (const Table& t : tables_) used += t.rows.budget_bytes();
      headroom = budget - std::min(budget, used);
    }
    for (std::size_t i = 0; i < request.tables.size(); ++i) {
      const TableRows& tr = request.tables[i];
      EmbeddingTable<Optimizer>& table = tables_[tr.table].rows;
      buffers[i].resize(request.touch_only ? 0 : tr.ids.size() * table.dim());
      const std::uint64_t capped = table.stats().rows_capped;
      table.pull(tr.ids, buffers[i], step, create, budget > 0 && create ? &headroom : nullptr);
      if (!tables_[tr.table].warned && table.stats().rows_capped > capped) {
        tables_[tr.table].warned = true;  // once: Stats::table_rows_capped counts the rest
        log(LogLevel::kWarning, "ps " + std::to_string(task_) + ": table '" + table.spec().name +
                                    "' is full (" + full_because(table.spec(), budget) +
                                    "): rows not created read as their initial values and their pushes "
                                    "are dropped, counted in Stats::table_rows_capped");
      }
      answer.rows.emplace_back(buffers[i]);
      stats.bytes_pulled += static_cast<std::int64_t>(buffers[i].size() * sizeof(float));
    }
    return answer;
  }

  /// Makes every row reply buffer free for reuse (a transport is done with the replies'
  /// views before it hands the ps a request that changes it). Buffers over 64 MiB are given
  /// back, and those of more than 64 requests: an outsized pull (a careless or hostile
  /// worker's) does not hold its memory for the job's life.
  void free_replies() noexcept {
    while (replies_.size() > 64) replies_.pop_back();
    used_ = 0;
    for (auto& buffers : replies_) {
      for (std::vector<float>& b : buffers) {
        if (b.capacity() > (std::size_t{64} << 20U) / sizeof(float)) std::vector<float>().swap(b);
      }
    }
  }

  /// Adds a fresh push's rows to the update in progress.
  void add(const TableRows& rows) { policy_.aggregation.add(tables_[rows.table].accumulator, rows.ids, rows.values); }

  /// Computes every table's update from its accumulated rows, at global step `step`
  /// (steps completed before it), aside; returns the name of a table whose rows would go
  /// non-finite (the update must then be dropped: `clear`), or nullopt.
  [[nodiscard]] std::optional<std::string> prepare(std::int64_t step) {
    for (Table& table : tables_) {
      const auto ids = policy_.aggregation.ids(table.accumulator);
      if (ids.empty()) continue;
      const auto means = policy_.aggregation.take(table.accumulator);
      table.prepared = table.rows.prepare(ids, means, step, table.updates + 1);
      if (!table.prepared) return table.rows.spec().name;
    }
    return std::nullopt;
  }

  /// Writes the prepared rows back and evicts rows gone untouched too long (every eighth of
  /// the eviction window: a pass costs one look at every row). Returns the tables updated.
  std::int64_t commit(std::int64_t step) {
    std::int64_t updated = 0;
    for (Table& table : tables_) {
      if (!std::exchange(table.prepared, false)) continue;  // no row pushed in this update
      table.rows.commit(step);
      ++table.updates;
      policy_.aggregation.clear(table.accumulator);
      ++updated;
    }
    const std::int64_t next = step + 1;
    for (Table& table : tables_) {
      const std::int64_t window = table.rows.spec().evict_after_steps;
      if (window <= 0 || next < table.next_eviction) continue;
      table.rows.evict(next);
      table.next_eviction = next + std::max<std::int64_t>(1, window / 8);
    }
    return updated;
  }

  /// Drops the update in progress.
  void clear() noexcept {
    for (Table& table : tables_) {
      policy_.aggregation.clear(table.accumulator);
      table.prepared = false;
    }
  }

  // ---- a checkpoint's cut and a restore ---------------------------------------------------

  /// The global step from which this ps can say every row evicted: an incremental cut
  /// since an earlier step would miss some (see mark_cut).
  [[nodiscard]] std::int64_t evictions_since() const noexcept {
    std::int64_t since = 0;
    for (const Table& t : tables_) since = std::max(since, t.rows.evictions_since());
    return since;
  }

  /// The cut was read (the ps is paused): remembers each table's rows and admission counts
  /// at this moment, which ReadRows then reads chunk by chunk, as they were then, whether
  /// the ps stays paused or trains on (EmbeddingTable::begin_cut), until end_cut. With `since` ≥ 0 (an
  /// incremental checkpoint, `since` ≥ evictions_since()), the rows are those touched at or
  /// after global step `since`, with the ids evicted since; else every row (also when the
  /// table's eviction log no longer reaches back to `since`: RowsChunk::since then says -1,
  /// and the chief takes a full checkpoint instead). Evictions before `forget_before` are
  /// forgotten first (no later cut will be since an earlier step).
  void mark_cut(std::int64_t since = -1, std::int64_t forget_before = -1) {
    for (Table& t : tables_) {
      if (forget_before > 0) t.rows.forget_evictions_before(forget_before);
      t.cut_rows = t.rows.size();
      t.cut_updates = t.updates;
      t.cut_selected.clear();
      t.cut_evicted.clear();
      t.cut_since = since >= 0 && since >= t.rows.evictions_since() ? since : -1;
      if (t.cut_since >= 0) {
        t.rows.rows_touched_since(since, t.cut_selected);
        t.rows.read_evicted(since, t.cut_evicted);
      }
      t.cut_candidates = {};
      t.rows.read_candidates(t.cut_candidates.ids, t.cut_candidates.counts, t.cut_candidates.steps);
      t.rows.begin_cut();  // read as it is now, while training goes on (copy-on-write)
    }
    cut_marked_ = true;
  }
  /// The cut has been read (or given up): what it remembered goes.
  void end_cut() noexcept {
    for (Table& t : tables_) {
      t.cut_candidates = {};
      std::vector<std::uint32_t>().swap(t.cut_selected);
      std::vector<std::uint64_t>().swap(t.cut_evicted);
      t.cut_since = -1;
      t.rows.end_cut();
    }
    cut_marked_ = false;
  }

  /// A cut's rows are being read.
  [[nodiscard]] bool cut_marked() const noexcept { return cut_marked_; }

  /// Why `r` cannot be read, or nullopt.
  [[nodiscard]] std::optional<ErrorReply> check(const ReadRows& r) const {
    if (!cut_marked_) return ErrorReply{ErrorCode::kFailedPrecondition, "ReadRows before the cut was read"};
    if (r.table >= tables_.size()) return refuse("unknown table " + std::to_string(r.table));
    return std::nullopt;
  }

  /// A chunk of the rows (or candidates, or evicted ids) of `r.table` at the cut
  /// (`check`ed): rows [r.begin, r.begin + n) of those the cut holds, n = min(r.max_rows,
  /// rows_per_chunk(stride), rows left), in a buffer valid until `free_replies`.
  RowsChunk read(const ReadRows& r) {
    const Table& t = tables_[r.table];
    RowsChunk answer;
    answer.updates = t.cut_updates;
    answer.since = t.cut_since;
    for (const std::string_view name : policy_.optimizer.row_slot_names()) answer.slot_names.emplace_back(name);
    if (r.evicted) {
      const std::vector<std::uint64_t>& gone = t.cut_evicted;
      answer.total = gone.size();
      const std::size_t begin = std::min<std::size_t>(r.begin, gone.size());
      const std::size_t n = std::min<std::size_t>({r.max_rows, kMaxCandidatesPerMessage, gone.size() - begin});
      answer.ids.assign(gone.begin() + begin, gone.begin() + begin + n);
      return answer;
    }
    if (r.candidates) {
      const Candidates& c = t.cut_candidates;
      answer.total = c.ids.size();
      const std::size_t begin = std::min<std::size_t>(r.begin, c.ids.size());
      const std::size_t n = std::min<std::size_t>({r.max_rows, kMaxCandidatesPerMessage, c.ids.size() - begin});
      answer.ids.assign(c.ids.begin() + begin, c.ids.begin() + begin + n);
      answer.counts.assign(c.counts.begin() + begin, c.counts.begin() + begin + n);
      answer.steps.assign(c.steps.begin() + begin, c.steps.begin() + begin + n);
      return answer;
    }
    const bool selected = t.cut_since >= 0;
    answer.total = selected ? t.cut_selected.size() : t.cut_rows;
    const std::size_t begin = std::min<std::size_t>(r.begin, answer.total);
    const std::size_t n = std::min<std::size_t>({r.max_rows, rows_per_chunk(t.rows.stride()), answer.total - begin});
    if (used_ == replies_.size()) replies_.emplace_back();
    std::vector<std::vector<float>>& buffers = replies_[used_++];
    buffers.resize(1);
    buffers[0].clear();
    if (selected) {
      t.rows.read_rows(std::span(t.cut_selected).subspan(begin, n), answer.ids, buffers[0], answer.steps);
    } else {
      t.rows.read_rows(begin, n, answer.ids, buffers[0], answer.steps);
    }
    answer.rows = buffers[0];
    return answer;
  }

  /// Empties every table for a restore at global step `step`: their rows follow
  /// (`restore`), or the tables start afresh.
  void begin_restore(std::int64_t step) noexcept {
    for (Table& t : tables_) {
      t.rows.clear(step);
      policy_.aggregation.clear(t.accumulator);
      t.updates = 0;
      t.next_eviction = 0;
      t.prepared = false;
    }
    end_cut();
  }

  /// Why the rows of `r` cannot be restored, or nullopt: an unknown table, sizes that do not
  /// match, non-finite values.
  [[nodiscard]] std::optional<ErrorReply> check(const RestoreRows& r) const {
    if (r.table >= tables_.size()) {
      if (r.ids.empty() && r.done) return std::nullopt;
      return refuse("unknown table " + std::to_string(r.table));
    }
    const std::size_t n = r.ids.size();
    const std::size_t stride = (1 + r.slot_names.size()) * spec(r.table).dim;
    const bool fits = r.steps.size() == n && (r.candidates ? r.rows.empty() && r.counts.size() == n
                                                           : r.rows.size() == n * stride && r.counts.empty());
    if (!fits) return refuse("RestoreRows of table '" + spec(r.table).name + "': sizes do not match its rows");
    if (!detail::all_finite(r.rows)) return refuse("RestoreRows of table '" + spec(r.table).name + "': non-finite rows");
    return std::nullopt;
  }

  /// Takes the rows (or candidates) of `r` (`check`ed) that this ps's id sharding gives it;
  /// returns how many.
  std::size_t restore(const RestoreRows& r) {
    if (r.table >= tables_.size()) return 0;
    Table& t = tables_[r.table];
    if (r.updates >= 0) t.updates = r.updates;
    const std::string& name = spec(r.table).name;
    const std::size_t dim = spec(r.table).dim;
    const std::size_t stride = (1 + r.slot_names.size()) * dim;
    // The checkpoint's slots when they are this optimizer's, else the values alone.
    const auto own = policy_.optimizer.row_slot_names();
    const bool same_slots = std::equal(own.begin(), own.end(), r.slot_names.begin(), r.slot_names.end());
    const std::size_t take = same_slots ? stride : dim;
    std::size_t kept = 0;
    for (std::size_t i = 0; i < r.ids.size(); ++i) {
      if (row_owner(policy_.sharding, name, r.ids[i], members_) != task_) continue;
      if (r.candidates) {
        t.rows.restore_candidate(r.ids[i], r.counts[i], r.steps[i]);
      } else {
        t.rows.restore_row(r.ids[i], r.rows.subspan(i * stride, take), r.steps[i]);
      }
      ++kept;
    }
    return kept;
  }

  /// The most row bytes one request can carry to this ps: a push's rows, or a chunk of a
  /// restore (RestoreRows: 64 MiB at most, whatever its slots).
  [[nodiscard]] std::uint64_t max_payload() const noexcept {
    std::uint64_t bytes = 0;
    for (const Table& t : tables_) {
      bytes += std::min<std::uint64_t>(kMaxIdsPerMessage * t.rows.dim() * sizeof(float), kMaxRowBytesPerMessage);
    }
    constexpr std::uint64_t kRestoreChunk = std::uint64_t{64} << 20U;
    return tables_.empty() ? 0 : std::max(bytes, kRestoreChunk);
  }

  /// Adds the tables' rows held, evicted and dropped to `stats`.
  void count(Stats& stats) const noexcept {
    for (const Table& t : tables_) {
      const TableStats ts = t.rows.stats();
      stats.table_rows += static_cast<std::int64_t>(ts.rows);
      stats.table_rows_evicted += static_cast<std::int64_t>(ts.rows_evicted);
      stats.table_rows_dropped += static_cast<std::int64_t>(ts.pushes_dropped);
      stats.table_rows_capped += static_cast<std::int64_t>(ts.rows_capped);
    }
  }

  /// Each table's counters, in the model's order.
  [[nodiscard]] std::vector<TableStats> stats() const {
    std::vector<TableStats> out;
    for (const Table& t : tables_) out.push_back(t.rows.stats());
    return out;
  }

 private:
  /// Admission counts as a cut saw them.
  struct Candidates {
    std::vector<std::uint64_t> ids;
    std::vector<std::uint32_t> counts, steps;
  };
  struct Table {
    EmbeddingTable<Optimizer> rows;
    typename T::Aggregation::Accumulator accumulator;
    std::int64_t updates = 0;
    std::int64_t next_eviction = 0;
    bool prepared = false;  ///< its rows of the update being applied wait for commit
    std::size_t cut_rows = 0;       ///< rows held at the last cut
    std::int64_t cut_since = -1;    ///< an incremental cut's step (-1: every row)
    std::int64_t cut_updates = 0;   ///< the update count at the cut
    bool warned = false;            ///< it was logged full once
    std::vector<std::uint32_t> cut_selected;  ///< an incremental cut's rows, by number
    std::vector<std::uint64_t> cut_evicted;   ///< ids an incremental cut says went
    Candidates cut_candidates;      ///< admission counts at the last cut
  };

  static ErrorReply refuse(std::string message) { return ErrorReply{ErrorCode::kInvalidArgument, std::move(message)}; }

  /// Why a table is full: its max_rows, the ps's budget, or both.
  static std::string full_because(const TableSpec& spec, std::uint64_t budget) {
    std::string why;
    if (spec.max_rows > 0) why = "max_rows " + std::to_string(spec.max_rows) + " per ps";
    if (budget > 0) {
      if (!why.empty()) why += " or ";
      why += "the ps's budget of " + std::to_string(budget) + " bytes";
    }
    return why;
  }

  /// The policy's budget for this ps's tables (0: none); a policy without one has none.
  [[nodiscard]] std::uint64_t max_bytes() const noexcept {
    if constexpr (requires { policy_.max_bytes; }) {
      return static_cast<std::uint64_t>(policy_.max_bytes);
    } else {
      return 0;
    }
  }

  T policy_;
  bool cut_marked_ = false;  ///< a cut was read and the pause goes on
  std::uint32_t task_ = 0;
  std::vector<std::uint32_t> members_{0};  ///< the job's ps tasks (Register::members)
  std::vector<Table> tables_;
  IdPositions seen_{detail::random_u64()};  ///< finds an id twice in a request
  /// Buffers of row replies, by request: those before `used_` may be viewed by a transport
  /// until the next request that changes the ps.
  std::deque<std::vector<std::vector<float>>> replies_;
  std::size_t used_ = 0;
};

/// A ps that serves no embedding tables: it holds none, and refuses any row.
template <>
class TableShard<NoTables> {
 public:
  explicit TableShard(NoTables = {}) noexcept {}
  [[nodiscard]] NoTables policy() const noexcept { return {}; }
  void assign(std::uint32_t, std::span<const std::uint32_t>, const std::vector<TableSpec>&, std::uint64_t) noexcept {}
  [[nodiscard]] std::size_t size() const noexcept { return 0; }
  [[nodiscard]] std::uint64_t id_sharding(const std::vector<TableSpec>&) const noexcept { return 0; }
  [[nodiscard]] std::optional<ErrorReply> check(const std::vector<TableRows>& rows, bool, bool) const {
    if (rows.empty()) return std::nullopt;
    return ErrorReply{ErrorCode::kInvalidArgument,
                      "unknown table " + std::to_string(rows.front().table) + " (the model has 0)"};
  }
  RowsReply pull(const PullRows&, bool, std::int64_t step, Stats&) const { return RowsReply{step, {}}; }
  void free_replies() noexcept {}
  void add(const TableRows&) noexcept {}
  [[nodiscard]] std::optional<std::string> prepare(std::int64_t) noexcept { return std::nullopt; }
  std::int64_t commit(std::int64_t) noexcept { return 0; }
  void clear() noexcept {}
  [[nodiscard]] std::int64_t evictions_since() const noexcept { return 0; }
  [[nodiscard]] bool cut_marked() const noexcept { return false; }
  void mark_cut(std::int64_t = -1, std::int64_t = -1) noexcept {}
  void end_cut() noexcept {}
  [[nodiscard]] std::optional<ErrorReply> check(const ReadRows& r) const {
    return ErrorReply{ErrorCode::kInvalidArgument, "unknown table " + std::to_string(r.table) + " (the model has 0)"};
  }
  RowsChunk read(const ReadRows&) const { return {}; }
  void begin_restore(std::int64_t) noexcept {}
  [[nodiscard]] std::optional<ErrorReply> check(const RestoreRows& r) const {
    if (r.ids.empty()) return std::nullopt;
    return ErrorReply{ErrorCode::kInvalidArgument, "unknown table " + std::to_string(r.table) + " (the model has 0)"};
  }
  std::size_t restore(const RestoreRows&) const noexcept { return 0; }
  [[nodiscard]] std::uint64_t max_payload() const noexcept { return 0; }
  void count(Stats&) const noexcept {}
  [[nodiscard]] std::vector<TableStats> stats() const { return {}; }
};

}  // namespace pulley
// ---- end pulley/ps/table_shard.hpp ----

namespace pulley {

/// A part of a dense variable held by a ps task, with what the ps keeps beside it.
template <Optimizer O, SyncPolicy P>
struct HeldPart {
  Part part;                            ///< which rows of which variable
  std::uint32_t index = 0;              ///< its global index in the placement
  std::size_t row_size = 0;             ///< elements per row
  std::vector<float> values;            ///< the parameters
  typename O::State optimizer_state;    ///< the optimizer's slots and counters for it
  typename P::Accumulator accumulator;  ///< gradients of the update in progress
  bool initialized = false;
  /// The largest magnitude among its values and slots as the last `apply_bounded` left
  /// them (BoundsMagnitudes); +infinity while unknown: set otherwise since (initialized,
  /// restored), or never measured.
  float largest = std::numeric_limits<float>::infinity();
};

/// What one ps task holds of the model: the parts of dense variables placed on it, each
/// with its optimizer State and the sync policy's accumulator, and the rows of every
/// embedding table it holds (TableShard). It is the unit a checkpoint reads and a restore
/// sets; it also knows the model it is a shard of (variables, tables, placement), to check
/// requests against it and to name what it refuses.
///
/// It neither paces nor applies: the ps's Update applies the pushes the sync policy lets
/// through.
///
/// @tparam O the dense variables' Optimizer
/// @tparam P the SyncPolicy (its Accumulator is kept per part)
/// @tparam T the table policy (Tables<...>, or NoTables)
template <Optimizer O, SyncPolicy P, class T>
class Shard {
 public:
  using Part = HeldPart<O, P>;
  static constexpr std::size_t kNotHere = static_cast<std::size_t>(-1);

  Shard(std::uint32_t task, O optimizer, T tables)
      : task_(task), optimizer_(std::move(optimizer)), tables_(std::move(tables)) {}

  /// Holds the parts of `r`'s model that `placement` puts on this ps (zeros, a fresh
  /// optimizer State, an empty accumulator; not initialized) and empty tables. Everything
  /// that may throw (allocation, `make_state`) happens before anything is kept: a throw
  /// leaves the shard as it was.
  void assign(Register&& r, Placement&& placement, std::span<const std::uint32_t> members, const P& sync) {
    std::vector<Part> parts;
    std::vector<std::size_t> local(placement.parts.size(), kNotHere);
    for (std::size_t i = 0; i < placement.parts.size(); ++i) {
      const pulley::Part& part = placement.parts[i];
      if (part.ps != task_) continue;
      const std::size_t row_size = r.variables[part.variable].row_size();
      const std::size_t n = part.rows.size() * row_size;
      local[i] = parts.size();
      parts.push_back(Part{part, static_cast<std::uint32_t>(i), row_size, std::vector<float>(n, 0.0F),
                           optimizer_.make_state(n), sync.make_accumulator(n), false});
    }
    TableShard<T> tables(tables_.policy());
    tables.assign(task_, members, r.tables, r.table_seed);
    std::uint64_t bytes = 0;
    for (const Part& part : parts) bytes += part.values.size() * sizeof(float);
    std::vector<std::string> slot_names, counter_names;
    state_names(slot_names, counter_names);
    tables_ = std::move(tables);
    parts_ = std::move(parts);
    local_ = std::move(local);
    variables_ = std::move(r.variables);
    table_specs_ = std::move(r.tables);
    table_seed_ = r.table_seed;
    placement_ = std::move(placement);
    held_bytes_ = bytes;
    slots_per_part_ = slot_names.size();
    initialized_ = 0;
    assigned_ = true;
  }

  /// Bytes of the values of the dense parts held here.
  [[nodiscard]] std::uint64_t held_bytes() const noexcept { return held_bytes_; }
  /// True once `assign`ed: a model is registered.
  [[nodiscard]] bool assigned() const noexcept { return assigned_; }
  /// True if `r` registers the model held here.
  [[nodiscard]] bool holds(const Register& r) const {
    return r.variables == variables_ && r.tables == table_specs_ && r.table_seed == table_seed_;
  }

  [[nodiscard]] std::uint32_t task() const noexcept { return task_; }
  [[nodiscard]] const O& optimizer() const noexcept { return optimizer_; }
  [[nodiscard]] const std::vector<VariableSpec>& variables() const noexcept { return variables_; }
  [[nodiscard]] const std::vector<TableSpec>& table_specs() const noexcept { return table_specs_; }
  [[nodiscard]] std::uint64_t table_seed() const noexcept { return table_seed_; }
  [[nodiscard]] const Placement& placement() const noexcept { return placement_; }
  [[nodiscard]] std::span<Part> parts() noexcept { return parts_; }
  [[nodiscard]] std::span<const Part> parts() const noexcept { return parts_; }
  [[nodiscard]] TableShard<T>& tables() noexcept { return tables_; }
  [[nodiscard]] const TableShard<T>& tables() const noexcept { return tables_; }

  /// The part of global index `part` if it is held here, else null.
  [[nodiscard]] Part* find(std::uint32_t part) noexcept {
    return part < local_.size() && local_[part] != kNotHere ? &parts_[local_[part]] : nullptr;
  }

  /// True once every part held here is initialized (or restored).
  [[nodiscard]] bool initialized() const noexcept { return initialized_ == parts_.size(); }

  /// The names of the optimizer's slots and counters (those of a fresh State: they do not
  /// depend on its size).
  void state_names(std::vector<std::string>& slots, std::vector<std::string>& counters) const {
    typename O::State probe = optimizer_.make_state(0);
    for (const OptimizerSlot& slot : slots_of(optimizer_, probe)) slots.emplace_back(slot.name);
    for (const OptimizerCounter& counter : counters_of(optimizer_, probe)) counters.emplace_back(counter.name);
  }

  /// The most tensor bytes a request can carry: a push or an initialization has one value
  /// per element held here, a restore one more per optimizer slot, a push its rows.
  [[nodiscard]] std::uint64_t max_request_payload() const noexcept {
    return held_bytes_ * (1 + slots_per_part_) + tables_.max_payload();
  }

  /// Why `parts` (of an Initialize or a Push) cannot be taken, or nullopt: a part not held
  /// here, sent twice, of the wrong size, or with non-finite values (unless `finite_known`).
  [[nodiscard]] std::optional<ErrorReply> check(const std::vector<PartValues>& parts, bool finite_known) {
    for (std::size_t i = 0; i < parts.size(); ++i) {
      const PartValues& pv = parts[i];
      const Part* held = find(pv.part);
      if (held == nullptr) return ErrorReply{ErrorCode::kNotFound, unknown_part(pv.part)};
      if (pv.values.size() != held->values.size()) {
        return ErrorReply{ErrorCode::kInvalidArgument, describe(held->part) + " has " +
                                                           std::to_string(held->values.size()) +
                                                           " elements, got " + std::to_string(pv.values.size())};
      }
      for (std::size_t j = 0; j < i; ++j) {
        if (parts[j].part == pv.part) {
          return ErrorReply{ErrorCode::kInvalidArgument, describe(held->part) + " is sent twice"};
        }
      }
      if (!finite_known && !detail::all_finite(pv.values)) {
        return ErrorReply{ErrorCode::kInvalidArgument, "non-finite (NaN or Inf) values for " +
                                                           describe(held->part) + "; nothing was applied"};
      }
    }
    return std::nullopt;
  }

  /// Why `slices` (of a Pull) cannot be read here, or nullopt: a part not held here, rows
  /// outside it, or rows asked twice (so a reply is never larger than what is held here).
  [[nodiscard]] std::optional<ErrorReply> check(const std::vector<Slice>& slices) {
    for (const Slice& s : slices) {
      const Part* held = find(s.part);
      if (held == nullptr) return ErrorReply{ErrorCode::kNotFound, unknown_part(s.part)};
      if (s.rows.empty() || s.rows.begin < held->part.rows.begin || s.rows.end > held->part.rows.end) {
        return ErrorReply{ErrorCode::kInvalidArgument, "rows [" + std::to_string(s.rows.begin) + ", " +
                                                           std::to_string(s.rows.end) + ") are outside " +
                                                           describe(held->part)};
      }
    }
    if (const Slice* twice = overlapping(slices)) {
      return ErrorReply{ErrorCode::kInvalidArgument,
                        "a pull asks for rows of " + describe(find(twice->part)->part) + " twice (around rows [" +
                            std::to_string(twice->rows.begin) + ", " + std::to_string(twice->rows.end) + "))"};
    }
    return std::nullopt;
  }

  /// Why `parts` cannot be initialized (a part initialized already), or nullopt; checked
  /// with `check` first.
  [[nodiscard]] std::optional<ErrorReply> check_fresh(const std::vector<PartValues>& parts) {
    for (const PartValues& pv : parts) {
      const Part& held = *find(pv.part);
      if (held.initialized) {
        return ErrorReply{ErrorCode::kAlreadyExists, describe(held.part) + " is already initialized"};
      }
    }
    return std::nullopt;
  }

  /// Sets the initial values of `parts` (checked).
  void initialize(const std::vector<PartValues>& parts) {
    for (const PartValues& pv : parts) {
      Part& held = *find(pv.part);
      std::copy(pv.values.begin(), pv.values.end(), held.values.begin());
      held.initialized = true;
      held.largest = std::numeric_limits<float>::infinity();
      ++initialized_;
    }
  }

  /// The values `slices` (checked) name, as views of the parts, at global step `step`.
  PullReply read(const std::vector<Slice>& slices, std::int64_t step, Stats& stats) {
    PullReply answer{step, {}};
    answer.values.reserve(slices.size());
    for (const Slice& s : slices) {
      const Part& held = *find(s.part);
      const std::size_t offset = (s.rows.begin - held.part.rows.begin) * held.row_size;
      answer.values.push_back(std::span<const float>(held.values).subspan(offset, s.rows.size() * held.row_size));
      stats.bytes_pulled += static_cast<std::int64_t>(answer.values.back().size_bytes());
    }
    return answer;
  }

  /// Every part with its optimizer State, as views: a checkpoint's share of this ps.
  std::vector<PartState> read_state() {
    std::vector<PartState> out;
    out.reserve(parts_.size());
    for (Part& held : parts_) {
      PartState part{held.index, held.values, {}, {}};
      for (const OptimizerSlot& s : slots_of(optimizer_, held.optimizer_state)) part.slots.push_back(s.values);
      for (const OptimizerCounter& c : counters_of(optimizer_, held.optimizer_state)) part.counters.push_back(*c.value);
      out.push_back(std::move(part));
    }
    return out;
  }

  /// Why `parts` cannot restore this shard, or nullopt; else fills `by_part` (one per part
  /// held here, in part order) for `restore`. Each part held here must come once, with its
  /// size, finite values and the optimizer's slots and counters (or none: the optimizer
  /// then starts afresh, as for a checkpoint of another optimizer).
  [[nodiscard]] std::optional<ErrorReply> check_restore(const std::vector<PartState>& parts,
                                                        std::vector<const PartState*>& by_part) {
    if (parts.size() != parts_.size()) {
      return ErrorReply{ErrorCode::kInvalidArgument, "a restore must carry each of the " +
                                                         std::to_string(parts_.size()) + " parts held here, got " +
                                                         std::to_string(parts.size())};
    }
    by_part.assign(parts_.size(), nullptr);
    for (const PartState& ps : parts) {
      Part* held = find(ps.part);
      if (held == nullptr) return ErrorReply{ErrorCode::kNotFound, unknown_part(ps.part)};
      const std::size_t k = local_[ps.part];
      const auto slots = slots_of(optimizer_, held->optimizer_state);
      const auto counters = counters_of(optimizer_, held->optimizer_state);
      bool fits = by_part[k] == nullptr && ps.values.size() == held->values.size() &&
                  (ps.counters.empty() || ps.counters.size() == counters.size()) &&
                  (ps.slots.empty() || ps.slots.size() == slots.size());
      for (const auto& s : ps.slots) fits = fits && s.size() == held->values.size();
      if (!fits) {
        return ErrorReply{ErrorCode::kInvalidArgument,
                          "the restored state of " + describe(held->part) +
                              " does not fit it (its size, or the optimizer's slots and counters)"};
      }
      if (!detail::all_finite(ps.values)) {
        return ErrorReply{ErrorCode::kInvalidArgument, "non-finite values restored for " + describe(held->part)};
      }
      by_part[k] = &ps;
    }
    return std::nullopt;
  }

  /// Sets every part from `by_part` (checked by `check_restore`), its accumulator emptied.
  void restore(const std::vector<const PartState*>& by_part, const P& sync) {
    for (std::size_t k = 0; k < parts_.size(); ++k) {
      Part& held = parts_[k];
      const PartState& ps = *by_part[k];
      std::copy(ps.values.begin(), ps.values.end(), held.values.begin());
      held.optimizer_state = optimizer_.make_state(held.values.size());
      const auto slots = slots_of(optimizer_, held.optimizer_state);
      for (std::size_t s = 0; s < ps.slots.size(); ++s) {
        std::copy(ps.slots[s].begin(), ps.slots[s].end(), slots[s].values.begin());
      }
      const auto counters = counters_of(optimizer_, held.optimizer_state);
      for (std::size_t c = 0; c < ps.counters.size(); ++c) *counters[c].value = ps.counters[c];
      held.accumulator = sync.make_accumulator(held.values.size());
      held.initialized = true;
      held.largest = std::numeric_limits<float>::infinity();
    }
    initialized_ = parts_.size();
    tables_.clear();
  }

  /// "variable 'w' part 2".
  [[nodiscard]] std::string describe(const pulley::Part& part) const {
    return "variable '" + variables_[part.variable].name + "' part " + std::to_string(part.index);
  }

  /// Why part `part` is not held here.
  [[nodiscard]] std::string unknown_part(std::uint32_t part) const {
    if (part >= placement_.parts.size()) {
      return "unknown part " + std::to_string(part) + " (the model has " +
             std::to_string(placement_.parts.size()) + " parts)";
    }
    return describe(placement_.parts[part]) + " is held by ps " + std::to_string(placement_.parts[part].ps) +
           ", not here";
  }

 private:
  /// A slice that overlaps another of `slices` (of the same part), or null.
  const Slice* overlapping(const std::vector<Slice>& slices) {
    if (slices.size() < 2) return nullptr;
    order_.resize(slices.size());
    for (std::size_t i = 0; i < slices.size(); ++i) order_[i] = &slices[i];
    std::sort(order_.begin(), order_.end(), [](const Slice* a, const Slice* b) {
      return a->part != b->part ? a->part < b->part : a->rows.begin < b->rows.begin;
    });
    for (std::size_t i = 1; i < order_.size(); ++i) {
      if (order_[i]->part == order_[i - 1]->part && order_[i]->rows.begin < order_[i - 1]->rows.end) {
        return order_[i];
      }
    }
    return nullptr;
  }

  std::uint32_t task_;
  [[no_unique_address]] O optimizer_;
  std::vector<Part> parts_;
  std::vector<std::size_t> local_;  ///< global part index → index in parts_, or kNotHere
  bool assigned_ = false;
  std::size_t initialized_ = 0;
  std::uint64_t held_bytes_ = 0;      ///< bytes of the parts' values
  std::uint64_t slots_per_part_ = 0;  ///< the optimizer's slots, which a Restore also carries
  std::vector<VariableSpec> variables_;
  std::vector<TableSpec> table_specs_;
  std::uint64_t table_seed_ = 0;
  Placement placement_;
  TableShard<T> tables_;
  std::vector<const Slice*> order_;  ///< scratch: a pull's slices, sorted
};

}  // namespace pulley
// ---- end pulley/ps/shard.hpp ----
// ---- begin pulley/ps/update.hpp ----

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace pulley {

/// Where a push is applied: the update in progress on one ps task. Each push comes with
/// the sync policy's verdict: a stale one is dropped and counted; a fresh one's gradients
/// go into the parts' accumulators (and its rows into the tables' ones); the push that
/// completes an update (kReady) makes every part apply its accumulator's mean with the
/// optimizer, and every table its rows.
///
/// Nothing non-finite is ever applied, and an update is applied whole or not at all:
///   - a push that is an update by itself (Async, BoundedStaleness; SyncReplicas with
///     R = 1) is checked against the state it would be applied to, and refused, naming its
///     sender, if anything would go non-finite; it still counts towards the step (the other
///     ps tasks may have taken their share of it, and steps must not drift apart);
///   - an update averaged from several pushes is checked once, when it is applied, and
///     rolled back on this ps (logged, with the workers whose pushes made it) if anything
///     would go non-finite.
/// Optimizers with `stays_finite` are asked before applying; others apply into a copy of
/// the part and its State that replaces them only if it stayed finite (or, if the State
/// cannot be copied, fail the ps when the part goes non-finite). An optimizer that bounds
/// magnitudes (BoundsMagnitudes, every stock one) is asked first with what its
/// last update measured and a bound of the gradient's magnitudes: what it proves finite is
/// applied without reading the part twice, and `stays_finite` decides the rest.
///
/// @tparam O, P, T as the Shard it updates
template <Optimizer O, SyncPolicy P, class T>
class Update {
 public:
  /// What taking one push did.
  struct Outcome {
    std::uint32_t stale_parts = 0;  ///< part gradients dropped as stale
    std::string refused;            ///< why the push was refused (it counts towards the step), or ""
  };

  /// Takes push `r` (checked) with the sync policy's `verdict`, made at global step
  /// `step_before`, and applies the update it completes. `largest`: no value of the push
  /// is larger in magnitude (the transport measured it as it checked the push arrived
  /// finite: RequestContext::tensors_largest), or +infinity; `r.largest` bounds its
  /// gradients too, where the client in this process measured it. A throw from the optimizer or
  /// the policy leaves the update half applied: the ps then fails.
  Outcome take(Shard<O, P, T>& shard, const P& sync, const Push& r, Verdict verdict,
               std::int64_t step_before, Stats& stats,
               float largest = std::numeric_limits<float>::infinity()) {
    largest = std::min(largest, r.largest);  // the client in this process measured it, maybe
    const bool stale = verdict == Verdict::kStale;
    const bool alone = verdict == Verdict::kReady && contributors_.empty();
    Outcome out;
    std::string refused = alone ? would_overflow(shard, r, largest) : std::string();
    for (const PartValues& pv : r.gradients) {
      stats.bytes_pushed += static_cast<std::int64_t>(pv.values.size_bytes());
      if (stale) {
        ++stats.stale_gradients_dropped;
        ++out.stale_parts;
        continue;
      }
      if (!refused.empty()) continue;
      ++stats.gradients_accepted;
      sync.accumulate(shard.find(pv.part)->accumulator, pv.values);
    }
    for (const TableRows& tr : r.rows) {
      stats.bytes_pushed += static_cast<std::int64_t>(tr.values.size_bytes());
      if (stale) {
        stats.table_rows_dropped += static_cast<std::int64_t>(tr.ids.size());
        continue;
      }
      if (refused.empty()) shard.tables().add(tr);
    }
    if (!stale && refused.empty()) {
      contributors_.push_back(r.worker);
      pushed_largest_ = std::max(pushed_largest_, largest);
    }
    std::string rolled_back;
    if (verdict == Verdict::kReady) {
      // An update of nothing (its one push refused here) applies nothing.
      if (!contributors_.empty()) rolled_back = timed_apply(shard, sync, step_before, alone, stats);
      clear();
    }
    if (alone && refused.empty() && !rolled_back.empty()) {
      refused = "push from worker " + std::to_string(r.worker) + " refused: it would make " + rolled_back +
                " non-finite; none of it was applied (it counts towards the step, as on the other ps tasks)";
    } else if (!refused.empty()) {
      ++stats.updates_refused;  // (a rollback counted itself)
    }
    out.refused = std::move(refused);
    return out;
  }

  /// The update in progress needs no more pushes (a worker it waited for was held lost):
  /// applies what it has, at global step `step_before`.
  void complete(Shard<O, P, T>& shard, const P& sync, std::int64_t step_before, Stats& stats) {
    if (!contributors_.empty()) (void)timed_apply(shard, sync, step_before, /*checked=*/false, stats);
    clear();
  }

  /// Forgets the update in progress (a restore empties the shard's accumulators).
  void clear() noexcept {
    contributors_.clear();
    pushed_largest_ = 0.0F;
  }

 private:
  /// `apply`, its time added to `Stats::apply_microseconds`.
  std::string timed_apply(Shard<O, P, T>& shard, const P& sync, std::int64_t step_before, bool checked,
                          Stats& stats) {
    const auto began = std::chrono::steady_clock::now();
    std::string rolled_back = apply(shard, sync, step_before, checked, stats);
    stats.apply_microseconds += std::chrono::duration_cast<std::chrono::microseconds>(
                                    std::chrono::steady_clock::now() - began).count();
    return rolled_back;
  }

  /// Why applying push `r` alone would make a parameter or a slot non-finite (the
  /// optimizer's `stays_finite`, asked of every part against the state it would be applied
  /// to), or "" when it would not, or when the optimizer cannot tell (`apply` guards those).
  std::string would_overflow(Shard<O, P, T>& shard, const Push& r, float largest) const {
    if constexpr (PredictsFiniteness<O>) {
      for (const PartValues& pv : r.gradients) {
        const auto& held = *shard.find(pv.part);
        if (proven_by_magnitudes(shard.optimizer(), held, pv.values, largest)) continue;
        if (!shard.optimizer().stays_finite(held.optimizer_state, held.values, pv.values)) {
          return "push from worker " + std::to_string(r.worker) + " refused: its gradient for " +
                 shard.describe(held.part) +
                 " would make a parameter or an optimizer slot non-finite (or larger than float's "
                 "range allows); none of it was applied (it counts towards the step, as on the other "
                 "ps tasks)";
        }
      }
    }
    return {};
  }

  /// Takes every part's update from its accumulator and applies it, unless that would make
  /// a parameter (or, for an optimizer that predicts it, a slot) non-finite: the update is
  /// then skipped on this ps. With `stays_finite`, the update is asked about once, unless
  /// its one push already was (`checked`). Returns what would have gone non-finite when the
  /// update was skipped, "" when applied.
  std::string apply(Shard<O, P, T>& shard, const P& sync, std::int64_t step_before, bool checked, Stats& stats) {
    const auto parts = shard.parts();
    const O& optimizer = shard.optimizer();
    updates_.clear();
    for (auto& held : parts) updates_.push_back(sync.take(held.accumulator));
    // The tables' rows first, into scratch memory: committed with the dense parts below, or
    // not at all.
    if (const auto table = shard.tables().prepare(step_before)) {
      return skip(shard, step_before, "table '" + *table + "'", stats);
    }
    if constexpr (PredictsFiniteness<O>) {
      // A mean of pushes is no larger than the largest of them; a policy that sums them
      // (against the contract) gets at most as many times that as there were pushes.
      const float pushed = pushed_largest_ * static_cast<float>(contributors_.size());
      for (std::size_t i = 0; !checked && i < parts.size(); ++i) {
        if (proven_by_magnitudes(optimizer, parts[i], updates_[i], pushed)) continue;
        if (!optimizer.stays_finite(parts[i].optimizer_state, parts[i].values, updates_[i])) {
          return skip(shard, step_before, shard.describe(parts[i].part), stats);
        }
      }
      for (std::size_t i = 0; i < parts.size(); ++i) {
        if constexpr (BoundsMagnitudes<O>) {
          parts[i].largest = optimizer.apply_bounded(parts[i].optimizer_state, parts[i].values, updates_[i]);
        } else {
          apply_to(shard, parts[i], parts[i].values, parts[i].optimizer_state, updates_[i], step_before);
        }
      }
    } else if constexpr (std::is_copy_assignable_v<typename O::State>) {
      shadows_.resize(parts.size());
      for (std::size_t i = 0; i < parts.size(); ++i) {
        Shadow& shadow = shadows_[i];
        shadow.values = parts[i].values;  // copy-assignments reuse the shadows' memory
        if (!shadow.state) {
          shadow.state.emplace(parts[i].optimizer_state);
        } else {
          *shadow.state = parts[i].optimizer_state;
        }
        apply_to(shard, parts[i], shadow.values, *shadow.state, updates_[i], step_before);
        if (!detail::all_finite(shadow.values)) return skip(shard, step_before, shard.describe(parts[i].part), stats);
      }
      for (std::size_t i = 0; i < parts.size(); ++i) {
        std::swap(parts[i].values, shadows_[i].values);
        std::swap(parts[i].optimizer_state, *shadows_[i].state);
      }
    } else {
      for (std::size_t i = 0; i < parts.size(); ++i) {
        apply_to(shard, parts[i], parts[i].values, parts[i].optimizer_state, updates_[i], step_before);
        if (!detail::all_finite(parts[i].values)) {
          throw std::runtime_error("the parameters of " + shard.describe(parts[i].part) +
                                   " went non-finite, and the optimizer's State cannot be copied to "
                                   "undo it (give the optimizer stays_finite)");
        }
      }
    }
    stats.updates_applied += static_cast<std::int64_t>(parts.size());
    stats.updates_applied += shard.tables().commit(step_before);
    return {};
  }

  /// True if the optimizer proves from magnitudes alone (BoundsMagnitudes) that applying
  /// `update` to `held` stays finite: from what its last update measured of the part, and
  /// `largest` (no element of `update` is larger; +infinity: not known, so the update is
  /// read here, once, for whether all of it is ordinary: detail::all_ordinary).
  static bool proven_by_magnitudes(const O& optimizer, const HeldPart<O, P>& held,
                                   std::span<const float> update, float largest) {
    if constexpr (BoundsMagnitudes<O>) {
      if (!(held.largest < std::numeric_limits<float>::infinity())) return false;
      if (!(largest < std::numeric_limits<float>::infinity())) {
        largest = magnitude_bound(detail::all_ordinary(update));
      }
      return optimizer.stays_finite_given(held.optimizer_state, held.largest, largest);
    } else {
      return false;
    }
  }

  static void apply_to(const Shard<O, P, T>& shard, const HeldPart<O, P>& held, std::span<float> values,
                       typename O::State& state, std::span<const float> update, std::int64_t step_before) {
    const UpdateContext context{step_before, shard.variables()[held.part.variable].name, held.part.rows,
                                held.row_size};
    apply_update(shard.optimizer(), state, values, update, context);
  }

  /// Drops the update (counted, and logged with the workers whose pushes made it).
  std::string skip(Shard<O, P, T>& shard, std::int64_t step_before, const std::string& what, Stats& stats) {
    ++stats.updates_refused;
    shard.tables().clear();
    std::string from;
    for (const std::uint32_t w : contributors_) from += (from.empty() ? "worker " : ", worker ") + std::to_string(w);
    log(LogLevel::kWarning, "ps " + std::to_string(shard.task()) + ": rolled back the update of global step " +
                                std::to_string(step_before + 1) + " (gradients from " + from +
                                "): it would have made " + what + " non-finite");
    return what;
  }

  /// A part's values and State as an update leaves them, kept only if they stay finite
  /// (optimizers without `stays_finite`).
  struct Shadow {
    std::vector<float> values;
    std::optional<typename O::State> state;
  };

  /// Whose gradients are in the accumulators, a worker once per push (for a rollback's log).
  std::vector<std::uint32_t> contributors_;
  float pushed_largest_ = 0.0F;  ///< a bound of the magnitudes of those gradients
  std::vector<Shadow> shadows_;
  std::vector<std::span<const float>> updates_;  ///< scratch: each part's update
};

}  // namespace pulley
// ---- end pulley/ps/update.hpp ----
// ---- begin pulley/ps/workers.hpp ----

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace pulley {

/// The job's workers as a ps counts them: the set the chief last made the job's
/// (ChangeWorkers, Restore::workers), and a change it set for a step to come. Only the
/// set and its rules live here; the ps applies a change that comes due to its sync
/// policy's pacer and its liveness (ParameterServer::count_next_workers).
///
/// The set is kept here as well as in the pacer (SyncReplicas and BoundedStaleness count
/// their workers): a policy that counts none (Async) still needs it, for the handshake
/// and to refuse a worker that left.
class JobWorkers {
 public:
  /// Worker indices a ps keeps counts for.
  static constexpr std::uint32_t kMaxIndex = std::uint32_t{1} << 20U;
  /// Workers a job has at most at once.
  static constexpr std::size_t kMaxSet = std::size_t{1} << 16U;

  /// A change that came due: the job's workers before it and after.
  struct Change {
    std::vector<std::uint32_t> before;  ///< empty when nobody said (the cluster spec's)
    std::vector<std::uint32_t> after;
  };

  /// Why `workers` cannot be the job's workers, or "".
  [[nodiscard]] static std::string check(std::span<const std::uint32_t> workers) {
    if (workers.size() > kMaxSet) return "more than " + std::to_string(kMaxSet) + " workers";
    if (std::string why = check_task_set(workers, "worker"); !why.empty()) return why;
    if (workers.back() >= kMaxIndex) return "worker index " + std::to_string(workers.back()) + " is too large";
    return {};
  }

  /// The job's workers now, ascending; empty while they are the cluster spec's.
  [[nodiscard]] const std::vector<std::uint32_t>& now() const noexcept { return now_; }

  /// Who may connect: the workers of the change to come once the chief set one (a worker
  /// joining connects before its step), else those of now.
  [[nodiscard]] std::span<const std::uint32_t> admitted() const noexcept {
    return next_ ? std::span<const std::uint32_t>(next_->change.after) : std::span<const std::uint32_t>(now_);
  }

  /// True unless `worker` left the job: one of the workers now, or of the change to come,
  /// or any while they are the cluster spec's (the transport checked who connects).
  [[nodiscard]] bool counted(std::uint32_t worker) const {
    if (now_.empty() || std::binary_search(now_.begin(), now_.end(), worker)) return true;
    return next_ && std::binary_search(next_->change.after.begin(), next_->change.after.end(), worker);
  }

  /// True if the change to come takes `worker` out of the job at `step` or before. Its
  /// push for that step is refused here already, as at a ps that counted the change (under
  /// BoundedStaleness a worker may hold a token of a step past the change, taken before the
  /// ps that gave it counted the change): no ps takes, or counts, a push another refuses.
  [[nodiscard]] bool leaves_by(std::uint32_t worker, std::int64_t step) const {
    return next_ && step >= next_->from_step &&
           !std::binary_search(next_->change.after.begin(), next_->change.after.end(), worker);
  }

  /// The workers are `after` from global step `from_step` on (the chief's ChangeWorkers;
  /// `before`: the set until then as the chief has it, for a ps that knows none). Checked
  /// by the caller (`check`, a step to come).
  void change_at(std::vector<std::uint32_t> after, std::int64_t from_step, std::vector<std::uint32_t> before) {
    next_ = Next{{std::move(before), std::move(after)}, from_step};
  }

  /// Takes back the change set for `from_step` (another ps refused it); none else.
  void take_back(std::int64_t from_step) noexcept {
    if (next_ && next_->from_step == from_step) next_.reset();
  }

  /// The change set for a step at or before `global_step`, taken out (it is now's); none
  /// while its step has not come.
  [[nodiscard]] std::optional<Change> due(std::int64_t global_step) {
    if (!next_ || global_step < next_->from_step) return std::nullopt;
    Change change = std::move(next_->change);
    next_.reset();
    if (!now_.empty()) change.before = now_;
    now_ = change.after;
    return change;
  }

  /// The workers are `workers` now (a restore says them as they are); a change to come is
  /// dropped. An empty list keeps those of now.
  void restore(std::vector<std::uint32_t> workers) {
    if (!workers.empty()) now_ = std::move(workers);
    next_.reset();
  }

  /// What a worker the job no longer counts, or will not from the change to come, is told.
  [[nodiscard]] std::string left_message(std::uint32_t worker) const {
    const bool leaving = next_ && !std::binary_search(next_->change.after.begin(), next_->change.after.end(), worker);
    const std::string workers = leaving ? describe_members(next_->change.after) + " from global step " +
                                              std::to_string(next_->from_step)
                                        : describe_members(now_) + " now";
    return Node::worker(worker).name() + " is not one of the job's workers " + workers +
           ": the chief took it out of the job (to train in it again, a worker asks to join: --join)";
  }

 private:
  struct Next {
    Change change;
    std::int64_t from_step = 0;
  };

  std::vector<std::uint32_t> now_;
  std::optional<Next> next_;
};

}  // namespace pulley
// ---- end pulley/ps/workers.hpp ----

namespace pulley {

/// One ps task: holds the parts of every variable placed on it (and the rows of embedding
/// tables), aggregates the gradients pushed to them and applies the optimizer.
///
/// It is a message handler (a `Service`) and does no I/O: a transport calls `handle` for
/// one request at a time, so the same logic runs in-process and over the network, and
/// nothing here needs a lock. It is a thin host over named parts, each in `ps/`:
///
///   Registration   the model's checks and placement, readiness, epoch  Register, WaitReady
///   Shard          the parts and table rows held here                 Initialize, Pull, PullRows,
///                                                                     ReadState, ReadRows,
///                                                                     Restore, RestoreRows
///   Pacing         the sync policy's pacer, tokens and their leases   TakeToken
///   Update         the update in progress: where a push is applied    Push
///   PushLedger     pushes taken from each worker, resends             Push, ReadState
///   CheckpointCut  the pause, held pushes, the cut                    Pause, ReadState, Resume
///   Liveness       workers heard and lost                             Heartbeat, GetStats
///   JobWorkers     the job's workers, and a change to come            ChangeWorkers, Restore,
///                                                                     TakeToken
///
/// Bad requests are answered with an ErrorReply and change nothing; the ps keeps serving.
/// A push is all-or-nothing: it is checked whole (known parts, sizes, finite values unless
/// the transport vouches for them, the sync policy's verdict) before any of it is applied.
/// This is the one place that decides what a throwing policy costs: a throw before the ps
/// changes anything refuses that request; a throw while it changes its state (half an
/// update applied) fails the ps: it answers every request from then on with `kInternal`
/// and the reason, and `stopped()` turns true, so its transport ends and the task exits
/// with an error instead of serving parameters it cannot vouch for.
///
/// @tparam S Sharding policy: which ps holds which rows (every ps computes the same placement)
/// @tparam O Optimizer applied to each part, with its per-part slots kept beside the part
/// @tparam P SyncPolicy: Async, SyncReplicas, BoundedStaleness... paces and aggregates
/// @tparam T Tables<RowWiseOptimizer, IdSharding, RowAggregation> for models with embedding
///           tables, or NoTables; by default Tables<O> when O can update rows (Sgd, Adagrad,
///           Adam, Ftrl, RmsProp), NoTables otherwise (Momentum)
template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T = DefaultTables<O>>
class ParameterServer {
 public:
  /// @param task    this ps task's index
  /// @param num_ps  the number of ps tasks in the cluster
  /// @param tables  the embedding tables' policy; by default, when the tables' optimizer is
  ///                of the dense one's type, a copy of `optimizer` (the same settings)
  ParameterServer(std::uint32_t task, std::uint32_t num_ps, O optimizer, P sync, S sharding = {},
                  std::optional<T> tables = std::nullopt)
      : task_(task),
        name_("ps " + std::to_string(task)),
        registration_(task, num_ps, std::move(sharding)),
        shard_(task, optimizer, tables ? std::move(*tables) : default_table_policy<T>(optimizer)),
        pacing_(std::move(sync)) {
    if (num_ps == 0 || task >= num_ps) {
      throw Error(ErrorCode::kInvalidArgument, "ps task " + std::to_string(task) +
                                                   " is outside a cluster of " +
                                                   std::to_string(num_ps) + " ps tasks");
    }
    check_optimizer_settings(optimizer);  // a NaN learning rate would have every update refused
    if constexpr (TablePolicy<T>)
      check_optimizer_settings(shard_.tables().policy().optimizer, "the tables' optimizer");
  }

  /// Handles one request; `reply` is called exactly once, now or later.
  void handle(Request&& request, const RequestContext& context, Responder reply) noexcept {
    if (end_) {
      ++stats_.requests_rejected;
      if (context.peer && context.peer->role == Node::Role::kWorker)
        heard_after_end(context.peer->index, request);
      respond(reply, ErrorReply{*end_});
      return;
    }
    changing_ = false;
    // A transport is done with every reply's views before it hands over a request that
    // changes the ps: the buffers of earlier row replies are free again.
    if (changes_parameters(request)) shard_.tables().free_replies();
    try {
      if (context.peer && !senders(request).contains(context.peer->role)) {
        return reject(reply, ErrorCode::kPermissionDenied,
                      "refused " + std::string(message_name(request)) + " from " +
                          context.peer->name() + ": only a " + senders(request).describe() +
                          " may send it");
      }
      std::visit([&](auto& r) { on(r, context, reply); }, request);
    } catch (const Error& e) {
      settle(reply, e.code(), e.message(), message_name(request));
    } catch (const std::exception& e) {
      settle(reply, ErrorCode::kInternal, e.what(), message_name(request));
    } catch (...) {
      settle(reply, ErrorCode::kInternal, "unknown exception", message_name(request));
    }
  }

  /// True once it serves no more: shut down by the chief, or failed.
  [[nodiscard]] bool stopped() const noexcept { return end_.has_value(); }
  /// Once it serves no more: true while a worker it heard has neither said it is leaving
  /// (its last heartbeat, sent once it learnt that training ended) nor been silent for the
  /// worker timeout. That worker may still come to hear the end: its answer was lost with
  /// its link, or its process was stopped a while. The transport serves on for it (up to
  /// TcpServerOptions::linger).
  [[nodiscard]] bool awaits_workers() const {
    return end_.has_value() && !restarts_ && liveness_.awaits_any(Clock::now());
  }
  /// True once the chief told it to start again empty (Shutdown::restart): its process
  /// serves anew, as one started in its place (the role runner's ps task does).
  [[nodiscard]] bool restarts() const noexcept { return restarts_; }
  /// How it ended, as it now answers every request: kOutOfRange (training finished),
  /// kAborted (the chief aborted training, or no chief came back in place of a lost one:
  /// set_chief_wait) or kInternal (it failed); nullopt while serving.
  [[nodiscard]] const std::optional<ErrorReply>& ended() const noexcept { return end_; }
  /// This ps task's index (of the shard it holds).
  [[nodiscard]] std::uint32_t task() const noexcept { return task_; }
  /// How log lines and errors name it ("ps 3"; a copy: "ps 4's copy of ps 3").
  void set_name(std::string name) { name_ = std::move(name); }
  /// How long a worker that sent heartbeats may fall silent before this ps holds it lost
  /// (default 5 s; see Liveness). Workers that never sent one are never held lost.
  void set_worker_timeout(std::chrono::milliseconds timeout) noexcept {
    liveness_.set_timeout(timeout);
  }
  /// How long this ps waits for a chief to come back once it holds the chief lost (its
  /// heartbeats stopped for the worker timeout; default 5 min): meanwhile it keeps the model
  /// and serves the workers (unless `set_serves_without_chief(false)`), and a chief started
  /// again goes on from it. Then it ends training as aborted (every task fails, naming the
  /// chief). A chief that never beat is never held lost.
  void set_chief_wait(std::chrono::milliseconds wait) noexcept { chief_wait_ = wait; }
  /// False: this ps serves no task while it misses the chief (ShardCopies' lease), so a
  /// lost chief pauses the job here rather than letting the workers go on; its log says so.
  void set_serves_without_chief(bool serves) noexcept { serves_without_chief_ = serves; }

  /// Counters, as GetStats answers them.
  [[nodiscard]] Stats stats() const noexcept {
    Stats s = stats_;
    s.global_step = pacing_.global_step();
    s.requests_waiting =
        static_cast<std::int64_t>(pacing_.waiting() + pulls_.size() + row_pulls_.size());
    shard_.tables().count(s);
    return s;
  }
  /// Hands the counters (`stats()`) to `sink` now and then: when a heartbeat or a GetStats
  /// comes and `every` has passed since the last time (clients beat every second, so a ps
  /// with clients reports about that often). `sink` runs on the thread that handles
  /// requests and must not call back into this ps. What the role runner's metrics read.
  void report_stats(std::function<void(const Stats&)> sink,
                    std::chrono::milliseconds every = std::chrono::milliseconds(500)) {
    stats_sink_ = std::move(sink);
    stats_every_ = every;
  }

  /// The counters of each embedding table held here, in the model's table order.
  [[nodiscard]] std::vector<TableStats> table_stats() const { return shard_.tables().stats(); }

  /// Time passed with no request (Service::tick): the chief is held lost, and given up on,
  /// even when no task sends anything (a ps with copies serves none while the chief is
  /// away: ShardCopies). Workers are judged by what they send only.
  void tick() noexcept {
    if (end_) return;
    try {
      (void)check_chief(Clock::now());
    } catch (const std::exception&) {  // no memory for a log line: the next tick tries again
    }
  }

  /// It serves the tasks again after refusing all but the chief since `since` (ShardCopies'
  /// fence): the workers' silence meanwhile, and before it while this ps heard nobody
  /// at all, was this ps's doing and is not held against them (Liveness::forgive).
  void fence_lifted(Liveness::Clock::time_point since) noexcept {
    liveness_.forgive(since, Clock::now());
  }

  /// Its shard moves elsewhere (a copy ShardCopies holds no more): every request waiting
  /// here is answered kUnavailable with `why`, so that its sender asks the job's ps tasks
  /// again. Then it may be destroyed.
  void let_go(const std::string& why) {
    end_ = ErrorReply{ErrorCode::kUnavailable, why};
    answer_all_waiting(*end_);
  }

  /// The transport lost connection `session` of task `node` (0: all of them). A worker's
  /// token requests parked on it are answered kUnavailable, and if it is the connection
  /// the worker took its last token on, the tokens it took and did not push for go back to
  /// the sync policy: a worker that vanished holding one cannot stall a step, even while a
  /// process restarted in its place is already connected. A chief that paused this ps for
  /// a checkpoint's cut and left resumes it.
  void disconnected(const Node& node, std::uint64_t session) noexcept;

  /// The job's workers as the chief last set them (ChangeWorkers, Restore::workers),
  /// ascending; empty while they are the cluster spec's. A transport lets a worker connect
  /// if it is one of them (a worker joining is, from the moment the chief counted it in).
  [[nodiscard]] std::span<const std::uint32_t> workers() const noexcept {
    return workers_.admitted();
  }

  /// The most tensor bytes a request can carry now: a push or an initialization has one
  /// value per element held here, a restore one more per optimizer slot, a push its rows
  /// (0 before registration: nothing can carry a tensor yet).
  [[nodiscard]] std::uint64_t max_request_payload() const noexcept {
    return shard_.max_request_payload();
  }

 private:
  // Every handler and helper below is defined in ps/impl/, in the header its section
  // names (included at the end of this one).

  using Clock = Liveness::Clock;

  // ---- answering, refusing, failing: impl/parameter_server_answers.hpp -----------------

  /// Refuses a request: answers the error, counts it, and logs it (at most 20 lines a
  /// second), so that an operator sees what a careless or hostile client tried.
  void reject(Responder& reply, ErrorCode code, const std::string& message);
  /// Refuses with a part's verdict; true if there was one.
  bool refused(Responder& reply, std::optional<ErrorReply>&& refusal);

  /// A handler threw: refuse the request if nothing changed yet, else fail the ps.
  void settle(Responder& reply, ErrorCode code, const char* what,
              std::string_view request) noexcept;

  /// The ps can no longer vouch for its state: it answers everything with `reason` from now.
  void fail(const std::string& reason);
  void fail_quietly(const std::string& reason) noexcept;

  void answer_all_waiting(const ErrorReply& answer);

  /// Checks that a worker's request names the worker that sent it (and a sane index).
  bool is_sender(std::uint32_t worker, const RequestContext& context, Responder& reply,
                 std::string_view what);

  /// `problem` with a request of epoch `epoch`, unless the request is of an earlier epoch
  /// than this ps's: then the epoch's refusal (kFailedPrecondition: start again), since
  /// what it names may have moved with the restore (a membership's change places parts
  /// and rows anew). A read unbound to a step (min_step 0) is not refused for its epoch
  /// alone.
  [[nodiscard]] std::optional<ErrorReply> of_epoch(std::optional<ErrorReply> problem,
                                                   std::uint64_t epoch,
                                                   std::string_view what) const;

  /// True if the ps is ready for `what`; otherwise refuses it.
  bool is_ready(Responder& reply, std::string_view what);

  // ---- Register / Initialize / WaitReady (registration.hpp): impl/parameter_server_state.hpp

  void on(Register& r, const RequestContext&, Responder& reply);

  void on(Initialize& r, const RequestContext& context, Responder& reply);

  void on(WaitReady&, const RequestContext&, Responder& reply);

  void become_ready();

  /// What Register and WaitReady answer: the model, where it lives, the epoch, and the
  /// names of the optimizer's slots and counters.
  PlacementReply placement_reply() const;

  // ---- TakeToken (pacing.hpp): impl/parameter_server_training.hpp --------------------------

  void on(TakeToken& r, const RequestContext& context, Responder& reply);

  /// Asks the sync policy again for every waiting token request (once the workers the
  /// chief set are counted, if their step came). A refusal answers that request; any other
  /// throw fails the ps (the policy may have changed its pacer half way).
  void hand_out_tokens();

  /// A worker's pull gated at the step after the one in progress, from a worker that has
  /// not pushed that step here: it will not push it here (a worker pushes a step on a
  /// connection before it pulls the next there). Either its push was lost with its process
  /// (killed while it wrote the push to several ps tasks, which took it or not; the process
  /// started in its place pulls the step the others are at), or, with backup workers, it
  /// skipped the step. The sync policy may then go on without it for this step
  /// (SyncPolicy::on_pull_ahead), as the ps tasks that took the push went on with it: a
  /// step would otherwise wait for a push that never comes while the new process beats.
  /// The push is counted as taken when the pacing ps took more of the worker's pushes than
  /// this ps (`pushes_paced`, from the worker's token): a checkpoint's cut brings every ps to
  /// the same counts. The worker is remembered until the step moves, and asked about again
  /// when what the policy judges by changed (a push taken, a worker back, a cut's pause
  /// ended); never while paused for a cut, which must see no step complete on its own.
  /// A lost push is logged; a skipped step is not.
  void pulls_ahead(const RequestContext& context, std::int64_t min_step,
                   std::uint64_t pushes_paced);

  /// Asks the sync policy about each worker remembered by `pulls_ahead` at the step in
  /// progress.
  void judge_pulls_ahead();

  /// Forgets the workers that pulled ahead of a step that went on without a verdict on them
  /// (held lost here, or a refill step): a push of one that the pacing ps took and this ps
  /// never did counts as taken all the same, so that a checkpoint's cut finds them alike.
  void forget_pulls_ahead();

  /// The sync policy stops waiting for a worker at the step in progress, as `change` (the
  /// pacing call) says: an update that needed only that worker is applied now, and the
  /// tokens and step gates that waited are answered. False when the policy still waits.
  template <class Change>
  bool go_on_without(Change change);

  /// The global step moved: the pulls and pauses waiting for it are answered.
  void release_step_gates();

  // ---- Pull / PullRows (shard.hpp, table_shard.hpp): impl/parameter_server_training.hpp ----

  void on(Pull& r, const RequestContext& context, Responder& reply);

  void on(PullRows& r, const RequestContext& context, Responder& reply);

  /// The rows of `r` at global step `step`, or only Ack when the client wants no rows back
  /// (`PullRows::touch_only`: what the pull does to them is done all the same).
  void answer_rows(const PullRows& r, bool create, std::int64_t step, Responder& reply);

  // ---- Push (update.hpp, push_ledger.hpp): impl/parameter_server_training.hpp -------------

  void on(Push& r, const RequestContext& context, Responder& reply);

  /// Refuses `r` if it is the push of a process lost while writing it, counted when the
  /// process in its place pulled past its step here (PushLedger::count_lost): its bytes
  /// read late from the lost process's connection, or held by a cut meanwhile.
  bool counted_lost(const Push& r, Responder& reply);

  /// Takes a push that passed every check: the sync policy's verdict, then the update
  /// (`largest`: its largest magnitude, +infinity when not known: Update::take). A push a
  /// cut held is checked again here for a lost push counted meanwhile.
  void take(const Push& r, Responder& reply,
            float largest = std::numeric_limits<float>::infinity());

  // ---- ChangeWorkers (pacing.hpp): impl/parameter_server_training.hpp ----------------------

  void on(ChangeWorkers& r, const RequestContext& context, Responder& reply);

  /// Counts the workers the chief set (ChangeWorkers) once this ps reached their step.
  /// Under SyncReplicas that is the boundary of that step on every ps: a push of the step
  /// needs a pull of it, which waits until this ps is there (BoundedStaleness's slowest
  /// clock may reach it on one ps before another, see there). A new worker is heard now
  /// (where workers send heartbeats), so that one that never comes is held lost after the
  /// worker timeout; those gone are forgotten, and their waiting token requests refused.
  /// A throw from the policy fails the ps (it would disagree with the others).
  void count_next_workers();

  // ---- Pause / ReadState / ReadRows / Resume (checkpoint_cut.hpp):
  //      impl/parameter_server_state.hpp

  void on(Pause& r, const RequestContext& context, Responder& reply);

  void pause(std::uint64_t session, Responder& reply);

  void on(ReadState& r, const RequestContext&, Responder& reply);

  /// Takes held pushes toward the pending cut, and answers it once reached; tells the
  /// operator once of a cut that waited kCutPatience for a worker's push.
  void advance_cut();
  static constexpr std::chrono::seconds kCutPatience{2};

  void on(ReadRows& r, const RequestContext& context, Responder& reply);

  void on(Resume& r, const RequestContext& context, Responder& reply);

  /// Ends the pause; with `keep_rows`, the cut's rows stay readable while training goes on.
  void resume(bool keep_rows = false);

  // ---- Restore / RestoreRows (shard.hpp): impl/parameter_server_state.hpp ------------------

  void on(Restore& r, const RequestContext&, Responder& reply);

  void on(RestoreRows& r, const RequestContext&, Responder& reply);

  // ---- Heartbeat / GetStats / Join / Leave / Shape / LostPs (liveness.hpp):
  //      impl/parameter_server_liveness.hpp

  /// A request of worker `worker` after the end (answered with it): heard, or gone for good
  /// with its leaving heartbeat (awaits_workers).
  void heard_after_end(std::uint32_t worker, const Request& request) noexcept;

  void on(Heartbeat& r, const RequestContext& context, Responder& reply);

  void on(Join&, const RequestContext&, Responder& reply);

  void on(Leave&, const RequestContext&, Responder& reply);

  void on(Shape&, const RequestContext&, Responder& reply);

  void on(LostPs&, const RequestContext&, Responder& reply);

  void on(GetStats&, const RequestContext&, Responder& reply);

  /// Hands the counters to the sink of `report_stats` when it is due (or `now`).
  void report(bool now_anyway = false);

  /// A worker held lost was heard from (a heartbeat, a token request): it counts again.
  /// Not while paused for a checkpoint's cut, which must see no pacing change on its own.
  void revive(std::uint32_t worker);

  /// Holds lost every worker heard before and silent for the worker timeout: the sync
  /// policy stops waiting for it, and an update that needed only it is applied now. Not
  /// while paused for a checkpoint's cut, which must see no step complete on its own; a
  /// read of the cut then stops waiting for such a worker's pushes instead. The
  /// same for the chief, which is waited for (`set_chief_wait`), then given up on.
  void check_heartbeats();

  /// Holds the chief lost once silent for the worker timeout, and ends training as aborted
  /// once no chief came back within the chief wait after that; false then.
  bool check_chief(Clock::time_point now);

  /// No chief came back in time: training cannot end, so it ends here as aborted, and
  /// every task hears why.
  void fail_for_chief(Clock::time_point since, Clock::time_point now);

  /// What GetStats and Heartbeat answer.
  StatsReply stats_reply() const;

  /// The sync policy's wait in words, with how long ago each awaited worker was heard:
  /// "step 812: 1 of 2 gradients in, 1 of 2 tokens left; waiting for worker:1 (last heard
  /// 14.2 s ago)".
  std::string describe_wait() const;

  // ---- Shutdown: impl/parameter_server_state.hpp ---------------------------------------------

  void on(Shutdown& r, const RequestContext&, Responder& reply);

  /// A row pull waiting for its step.
  struct RowPull {
    PullRows request;
    bool create;  ///< a worker's: creates, admits and touches rows
  };

  std::uint32_t task_;
  std::string name_;       ///< "ps 3", as log lines and errors name it
  bool changing_ = false;  ///< inside a change that a throw would leave half done
  bool replaced_ = false;  ///< placed anew for another membership, not restored yet
  std::optional<std::uint64_t> restoring_rows_;  ///< a Restore of this epoch awaits its rows
  std::size_t restored_rows_ = 0;                ///< rows of that restore kept so far
  std::optional<ErrorReply> end_;  ///< set once stopped: what every request is answered
  bool restarts_ = false;          ///< stopped by a Shutdown with `restart`
  Registration<S> registration_;
  Shard<O, P, T> shard_;
  Pacing<P> pacing_;
  Update<O, P, T> update_;
  PushLedger ledger_;
  /// A worker that pulled step `ahead_step_` + 1 without a push of `ahead_step_` here.
  struct Ahead {
    std::uint32_t worker = 0;
    bool lost_here = false;  ///< the pacing ps took a push of it this ps did not
  };
  /// Such workers, not judged yet (pulls_ahead).
  std::vector<Ahead> ahead_;
  std::int64_t ahead_step_ = -1;
  CheckpointCut cut_;
  std::int64_t cut_since_ = -1;          ///< the cut read last: rows since (ReadState::since)
  std::uint64_t rows_cut_session_ = 0;   ///< the chief's connection reading the cut's rows
  std::int64_t cut_forget_before_ = -1;  ///< and evictions forgotten before
  Liveness liveness_;
  JobWorkers workers_;  ///< the job's workers once changed, and a change waiting for its step
  std::chrono::milliseconds chief_wait_{std::chrono::minutes(5)};  ///< see set_chief_wait
  bool serves_without_chief_ = true;                               ///< see set_serves_without_chief
  StepGate<Pull> pulls_;                                           ///< pulls waiting for their step
  StepGate<RowPull> row_pulls_;  ///< row pulls waiting for their step
  Stats stats_;
  std::function<void(const Stats&)> stats_sink_;  ///< report_stats
  std::chrono::milliseconds stats_every_{500};
  Clock::time_point last_report_{};
  LimitedLog rejections_;  ///< logs refused requests, a few a second at most
};

}  // namespace pulley

// The member functions' definitions, by concern.
// ---- begin pulley/ps/impl/parameter_server_answers.hpp ----

/// ParameterServer's answers, refusals and failure (declared in ps/parameter_server.hpp,
/// which includes this header after the class): what every handler replies with, and the
/// checks of a request's sender, epoch and readiness.

namespace pulley {

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::reject(Responder& reply, ErrorCode code,
                                         const std::string& message) {
  ++stats_.requests_rejected;
  std::string line = name_ + ": " + message;
  rejections_(LogLevel::kWarning, line);
  respond(reply, ErrorReply{code, std::move(line)});
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
bool ParameterServer<S, O, P, T>::refused(Responder& reply, std::optional<ErrorReply>&& refusal) {
  if (!refusal) return false;
  reject(reply, refusal->code, refusal->message);
  return true;
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::settle(Responder& reply, ErrorCode code, const char* what,
                                         std::string_view request) noexcept {
  try {
    if (!changing_) {
      if (reply) reject(reply, code, std::string(request) + " refused: " + what);
      return;
    }
    fail("a policy threw while applying a " + std::string(request) + ": " + what);
    if (reply) respond(reply, ErrorReply{*end_});
  } catch (...) {  // no memory even for the message
    end_ = ErrorReply{ErrorCode::kInternal, {}};
    if (reply) respond(reply, ErrorReply{ErrorCode::kInternal, {}});
  }
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::fail(const std::string& reason) {
  end_ = ErrorReply{ErrorCode::kInternal, name_ + " failed: " + reason};
  log(LogLevel::kError, end_->message);
  answer_all_waiting(*end_);
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::fail_quietly(const std::string& reason) noexcept {
  try {
    fail(reason);
  } catch (...) {  // no memory even for the message
    end_ = ErrorReply{ErrorCode::kInternal, {}};
  }
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::answer_all_waiting(const ErrorReply& answer) {
  registration_.answer_all(answer);
  pacing_.answer_all(answer);
  pulls_.answer_all(answer);
  row_pulls_.answer_all(answer);
  cut_.answer_all(answer);
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
bool ParameterServer<S, O, P, T>::is_sender(std::uint32_t worker, const RequestContext& context,
                                            Responder& reply, std::string_view what) {
  if (context.peer && context.peer->index != worker) {
    reject(reply, ErrorCode::kPermissionDenied,
           "refused " + std::string(what) + " for worker " + std::to_string(worker) + " from " +
               context.peer->name());
    return false;
  }
  if (worker >= JobWorkers::kMaxIndex) {
    reject(reply, ErrorCode::kInvalidArgument,
           "worker index " + std::to_string(worker) + " is too large");
    return false;
  }
  return true;
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
std::optional<ErrorReply> ParameterServer<S, O, P, T>::of_epoch(std::optional<ErrorReply> problem,
                                                                std::uint64_t epoch,
                                                                std::string_view what) const {
  if (problem && epoch < registration_.epoch()) return registration_.check_epoch(epoch, what);
  return problem;
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
bool ParameterServer<S, O, P, T>::is_ready(Responder& reply, std::string_view what) {
  if (registration_.ready()) return true;
  reject(reply, ErrorCode::kFailedPrecondition, std::string(what) + " before initialization");
  return false;
}

}  // namespace pulley
// ---- end pulley/ps/impl/parameter_server_answers.hpp ----
// ---- begin pulley/ps/impl/parameter_server_liveness.hpp ----

/// ParameterServer's tasks heard and lost (declared in ps/parameter_server.hpp, which
/// includes this header after the class): connections that close, heartbeats and the
/// chief's silence, the membership requests a ps only refuses, and the counters
/// (GetStats).

namespace pulley {

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::disconnected(const Node& node, std::uint64_t session) noexcept {
  if (end_) return;
  try {
    if (node.role == Node::Role::kChief && cut_.paused_by(session)) {
      // (the chief ended, or it moved this shard's copy elsewhere and closed its
      // connection here before letting go of it)
      log(LogLevel::kWarning,
          name_ + ": the chief's connection closed while it paused this ps: resuming");
      changing_ = true;
      resume();
    } else if (node.role == Node::Role::kChief && rows_cut_session_ == session && session != 0) {
      log(LogLevel::kWarning,
          name_ + ": the chief left while it read a checkpoint's rows: the cut ends");
      changing_ = true;
      shard_.tables().end_cut();
      rows_cut_session_ = 0;
    } else if (node.role == Node::Role::kWorker) {
      const std::string gone = name_ + ": " + node.name() + " disconnected";
      const std::string before = pacing_.waiting_for();
      changing_ = true;
      if (pacing_.disconnected(node.index, session, gone)) {
        if (pacing_.waiting_for() != before) {
          log(LogLevel::kInfo,
              gone + " holding its token: given back (" + pacing_.waiting_for() + ")");
        }
        hand_out_tokens();
      }
    }
    changing_ = false;
  } catch (const std::exception& e) {
    fail_quietly(std::string("after a disconnection: ") + e.what());
  } catch (...) {
    fail_quietly("after a disconnection: unknown exception");
  }
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::heard_after_end(std::uint32_t worker,
                                                  const Request& request) noexcept {
  const auto* beat = std::get_if<Heartbeat>(&request);
  if (beat != nullptr && beat->leaving) {
    liveness_.leave(worker);  // (a find and an erase: nothing allocates)
  } else {
    liveness_.touch(worker, Clock::now());
  }
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(Heartbeat& r, const RequestContext& context,
                                     Responder& reply) {
  if (!is_sender(r.worker, context, reply, "Heartbeat")) return;
  report();
  if (context.peer && context.peer->role == Node::Role::kChief) {
    if (r.leaving) {
      liveness_.chief_left();
    } else if (liveness_.heard_chief(Clock::now())) {
      log(LogLevel::kInfo, name_ + ": the chief is back; training goes on");
    }
    check_heartbeats();
    return respond(reply, stats_reply());
  }
  if (r.leaving) {
    // Done: forgotten rather than held lost once quiet, and the tokens it took and did
    // not push for (it found training over) go back.
    liveness_.leave(r.worker);
    if (registration_.ready()) {
      changing_ = true;
      pacing_.leave(r.worker);
      changing_ = false;
      hand_out_tokens();
    }
    return respond(reply, stats_reply());
  }
  liveness_.heard(r.worker, Clock::now());
  revive(r.worker);
  check_heartbeats();
  respond(reply, stats_reply());
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(Join&, const RequestContext&, Responder& reply) {
  reject(
      reply, ErrorCode::kInvalidArgument,
      name_ +
          " is a ps task: a new ps or worker asks the chief to join (the chief's address, --join)");
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(Leave&, const RequestContext&, Responder& reply) {
  reject(reply, ErrorCode::kInvalidArgument,
         name_ + " is a ps task: a task asks the chief to leave the job");
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(Shape&, const RequestContext&, Responder& reply) {
  reject(reply, ErrorCode::kInvalidArgument,
         name_ + " is a ps task: a task asks the chief for the job's shape");
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(LostPs&, const RequestContext&, Responder& reply) {
  reject(reply, ErrorCode::kInvalidArgument,
         name_ + " is a ps task: a task asks the chief whether a ps is lost");
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(GetStats&, const RequestContext&, Responder& reply) {
  report();
  check_heartbeats();
  respond(reply, stats_reply());
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::report(bool now_anyway) {
  if (!stats_sink_) return;
  const auto now = Clock::now();
  if (!now_anyway && now - last_report_ < stats_every_) return;
  last_report_ = now;
  stats_sink_(stats());
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::revive(std::uint32_t worker) {
  if (!liveness_.is_lost(worker) || !registration_.ready() || cut_.paused()) return;
  changing_ = true;  // a throw from the policy leaves its pacer half changed
  pacing_.back(worker);
  liveness_.back(worker, Clock::now());
  ++stats_.workers_returned;
  changing_ = false;
  log(LogLevel::kInfo, name_ + ": " + Node::worker(worker).name() + " is back; " + describe_wait());
  hand_out_tokens();
  judge_pulls_ahead();
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::check_heartbeats() {
  const auto now = Clock::now();
  // The chief first, even while a cut it made is paused: a chief lost mid-cut ends the
  // job once nobody came back in its place.
  if (!check_chief(now) || !registration_.ready()) return;
  if (cut_.paused()) return advance_cut();  // a worker that fell silent is no longer awaited
  liveness_.expire(now, [&](std::uint32_t worker, Clock::time_point last) {
    ++stats_.workers_lost;
    go_on_without([&]() -> std::optional<Verdict> { return pacing_.lost(worker); });
    log(LogLevel::kWarning, name_ + ": " + Node::worker(worker).name() + " lost (last heard " +
                                Liveness::seconds_between(last, now) +
                                " s ago): training goes on without it; " + describe_wait());
  });
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
bool ParameterServer<S, O, P, T>::check_chief(Clock::time_point now) {
  liveness_.expire_chief(now, [&](Clock::time_point last) {
    log(LogLevel::kWarning,
        name_ + ": the chief is lost (last heard " + Liveness::seconds_between(last, now) +
            " s ago): the model is kept and " +
            (serves_without_chief_ ? "the workers go on" : "no task is served meanwhile") +
            "; waiting up to " + std::to_string(chief_wait_.count() / 1000) +
            " s for a chief to come back");
  });
  if (const auto since = liveness_.chief_lost_since();
      since && now - *since >= chief_wait_ + liveness_.timeout()) {
    fail_for_chief(*since, now);
    return false;
  }
  return true;
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::fail_for_chief(Clock::time_point since, Clock::time_point now) {
  end_ =
      ErrorReply{ErrorCode::kAborted,
                 name_ + ": the chief was lost " + Liveness::seconds_between(since, now) +
                     " s ago and no chief came back (--recovery-timeout-ms): training cannot end; "
                     "restart the job (it resumes from its newest checkpoint)"};
  log(LogLevel::kError, end_->message);
  answer_all_waiting(*end_);
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
StatsReply ParameterServer<S, O, P, T>::stats_reply() const {
  return StatsReply{stats(),
                    describe_wait(),
                    liveness_.lost(),
                    liveness_.chief_lost_since().has_value(),
                    registration_.ready(),
                    registration_.epoch(),
                    shard_.assigned() ? registration_.members() : std::vector<std::uint32_t>{},
                    registration_.membership(),
                    registration_.ps_addresses(),
                    std::vector<std::uint32_t>(workers().begin(), workers().end())};
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
std::string ParameterServer<S, O, P, T>::describe_wait() const {
  std::string text = pacing_.waiting_for();
  const std::string workers = liveness_.describe(pacing_.awaited(), Clock::now());
  if (workers.empty()) return text;
  return text + (text.empty() ? "waiting for " : "; waiting for ") + workers;
}

}  // namespace pulley
// ---- end pulley/ps/impl/parameter_server_liveness.hpp ----
// ---- begin pulley/ps/impl/parameter_server_state.hpp ----

/// ParameterServer's state as it is set, cut and moved (declared in
/// ps/parameter_server.hpp, which includes this header after the class): registration
/// (Register, Initialize, WaitReady), a checkpoint's cut (Pause, ReadState, ReadRows,
/// Resume), a restore (Restore, RestoreRows) and the end (Shutdown).

namespace pulley {

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(Register& r, const RequestContext&, Responder& reply) {
  const bool again = shard_.assigned();
  if (again) {
    if (!shard_.holds(r))
      return reject(reply, ErrorCode::kAlreadyExists, "a different model is already registered");
    if (r.membership == registration_.membership() &&
        registration_.members_of(r) == registration_.members()) {
      return respond(reply, placement_reply());
    }
    if (r.membership <= registration_.membership()) {
      return reject(reply, ErrorCode::kFailedPrecondition,
                    name_ + " holds the job at membership " +
                        std::to_string(registration_.membership()) + ": membership " +
                        std::to_string(r.membership) + " is not newer");
    }
  }
  Placement placement;
  if (refused(reply, registration_.check(r, TablePolicy<T>, placement))) return;
  const std::vector<std::uint32_t> members = registration_.members_of(r);
  if constexpr (TablePolicy<T>) {
    if (!r.tables.empty() && !first_tasks(members) && !ElasticIdSharding<typename T::Sharding>) {
      return reject(
          reply, ErrorCode::kFailedPrecondition,
          "the tables' IdSharding places rows over ps tasks 0 .. n-1 only: a job without ps " +
              std::string("task(s) of its cluster needs an ElasticIdSharding (HashIds, RangeIds)"));
    }
  }
  const std::uint64_t bytes_before = shard_.held_bytes();
  const std::uint64_t membership = r.membership;
  std::vector<std::string> addresses = r.ps_addresses;
  shard_.assign(std::move(r), std::move(placement), members,
                pacing_.policy());  // a throw changes nothing
  registration_.registered(members, membership, std::move(addresses));
  if (again) {
    // The ps tasks changed: what this ps held is placed anew and comes back with the
    // Restore that follows; what waited belongs to the shape before.
    const ErrorReply gone{ErrorCode::kFailedPrecondition,
                          name_ + ": the job's ps tasks changed (membership " +
                              std::to_string(membership) +
                              "): wait until ready and start the step again"};
    registration_.unready();
    pacing_.answer_all(gone);
    pulls_.answer_all(gone);
    row_pulls_.answer_all(gone);
    cut_.answer_all(gone);
    update_.clear();
    ledger_.clear();
    ahead_.clear();
    replaced_ = true;
    log(LogLevel::kInfo, name_ + ": the job's ps tasks are now " + describe_members(members) +
                             " (membership " + std::to_string(registration_.membership()) +
                             "): holds " + std::to_string(shard_.held_bytes()) +
                             " bytes of dense parts' values, " + std::to_string(bytes_before) +
                             " before; waits for its restore");
  }
  respond(reply, placement_reply());
  if (!again && shard_.initialized()) become_ready();  // no part is held here
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(Initialize& r, const RequestContext& context,
                                     Responder& reply) {
  if (!shard_.assigned()) {
    return reject(reply, ErrorCode::kFailedPrecondition,
                  "initialize before the model is registered");
  }
  if (refused(reply, shard_.check(r.parts, context.tensors_finite)) ||
      refused(reply, shard_.check_fresh(r.parts))) {
    return;
  }
  shard_.initialize(r.parts);
  if (r.hold) cut_.pause(context.session);  // before any worker can see it ready
  respond(reply, Ack{});
  if (shard_.initialized() && !registration_.ready() && !restoring_rows_) become_ready();
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(WaitReady&, const RequestContext&, Responder& reply) {
  if (registration_.ready()) return respond(reply, placement_reply());
  registration_.wait_ready(reply);
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::become_ready() {
  registration_.become_ready([this] { return placement_reply(); });
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
PlacementReply ParameterServer<S, O, P, T>::placement_reply() const {
  PlacementReply answer{shard_.variables(),
                        shard_.placement(),
                        registration_.epoch(),
                        {},
                        {},
                        shard_.table_specs(),
                        shard_.tables().id_sharding(shard_.table_specs()),
                        registration_.members(),
                        registration_.membership(),
                        registration_.ps_addresses(),
                        shard_.table_seed()};
  shard_.state_names(answer.slot_names, answer.counter_names);
  return answer;
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(Pause& r, const RequestContext& context, Responder& reply) {
  if (!is_ready(reply, "pause")) return;
  if (pacing_.global_step() < r.at_step) return cut_.park_pause(r.at_step, context.session, reply);
  pause(context.session, reply);
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::pause(std::uint64_t session, Responder& reply) {
  rows_cut_session_ = 0;  // a new cut: what an earlier one kept readable goes with its ReadState
  PauseReply answer{pacing_.global_step(),
                    registration_.epoch(),
                    ledger_.taken(),
                    {},
                    {},
                    checkpoints_whole_state_v<O>,
                    shard_.tables().evictions_since(),
                    ledger_.furthest()};
  ledger_.last_pushes(answer.last_sequences, answer.last_series);
  shard_.state_names(answer.slot_names, answer.counter_names);
  cut_.pause(session);
  respond(reply, std::move(answer));
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(ReadState& r, const RequestContext&, Responder& reply) {
  if (!cut_.paused())
    return reject(reply, ErrorCode::kFailedPrecondition, "ReadState without Pause");
  const std::vector<std::uint64_t> furthest = r.until;
  r.until = CheckpointCut::own_until(ledger_, r);
  if (const auto worker = CheckpointCut::past(ledger_, r.until)) {
    return reject(reply, ErrorCode::kFailedPrecondition,
                  "ReadState: this ps has taken more pushes of worker " + std::to_string(*worker) +
                      " than the cut");
  }
  for (std::uint32_t w = 0; w < r.until.size(); ++w) {
    if (r.until[w] >= furthest[w] || r.until[w] != ledger_.taken(w)) continue;
    log(LogLevel::kInfo,
        name_ + ": the cut holds " + Node::worker(w).name() + " at the " +
            std::to_string(r.until[w]) + " pushes taken here, " +
            std::to_string(furthest[w] - r.until[w]) +
            " fewer than the furthest ps (or this shard's other copy): its last push here is "
            "the furthest's last, and what this ps lacks was lost with an earlier process of "
            "that worker");
  }
  shard_.tables().end_cut();  // a cut read before is given up
  rows_cut_session_ = 0;
  cut_since_ = r.since;
  cut_forget_before_ = r.forget_evictions_before;
  cut_.read_at(std::move(r.until), reply);
  advance_cut();
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::advance_cut() {
  const auto now = Clock::now();
  const auto awaited = [this, now](std::uint32_t w) {
    return workers_.counted(w) && !liveness_.is_lost(w) && !liveness_.silent(w, now);
  };
  cut_.advance(
      ledger_, [this](const Push& push, Responder& reply) { take(push, reply); },
      [this] {
        // The rows at the cut, read next (ReadRows).
        shard_.tables().mark_cut(cut_since_, cut_forget_before_);
        return StateReply{pacing_.global_step(), pacing_.save(), shard_.read_state()};
      },
      awaited);
  if (const auto waits = cut_.overdue(ledger_, now, kCutPatience, awaited)) {
    log(LogLevel::kInfo,
        name_ + ": the chief's cut has waited over " +
            std::to_string(std::chrono::duration_cast<std::chrono::seconds>(kCutPatience).count()) +
            " s for a push of " + Node::worker(waits->first).name() + " (taken here " +
            std::to_string(ledger_.taken(waits->first)) + " of the cut's " +
            std::to_string(waits->second) +
            "): it is on its way, or the worker is held lost after the worker timeout and the "
            "cut goes on without it");
  }
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(ReadRows& r, const RequestContext& context, Responder& reply) {
  if (!cut_.paused_by(context.session) &&
      (rows_cut_session_ != context.session || rows_cut_session_ == 0)) {
    return reject(reply, ErrorCode::kFailedPrecondition,
                  "ReadRows without Pause (of this connection)");
  }
  if (refused(reply, shard_.tables().check(r))) return;
  respond(reply, shard_.tables().read(r));
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(Resume& r, const RequestContext& context, Responder& reply) {
  if (r.keep_rows && cut_.paused_by(context.session) && shard_.tables().cut_marked()) {
    rows_cut_session_ = context.session;
  }
  resume(r.keep_rows);
  respond(reply, Ack{});
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::resume(bool keep_rows) {
  if (!keep_rows) {
    shard_.tables().end_cut();
    rows_cut_session_ = 0;
  }
  cut_.resume([this](const Push& push, Responder& reply) { take(push, reply); });
  judge_pulls_ahead();  // once every push the cut held was taken: a held push is a push
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(Restore& r, const RequestContext&, Responder& reply) {
  if (!shard_.assigned())
    return reject(reply, ErrorCode::kFailedPrecondition, "restore before the model is registered");
  // Everything is checked, and the pacer loaded aside, before anything changes.
  std::vector<const PartState*> by_part;
  if (refused(reply, shard_.check_restore(r.parts, by_part))) return;
  typename P::Pacer pacer = pacing_.load(r.pacer);  // a pulley::Error refuses it
  if (!r.workers.empty()) {
    if (const std::string why = JobWorkers::check(r.workers); !why.empty()) {
      return reject(reply, ErrorCode::kInvalidArgument, "Restore: " + why);
    }
  }
  const std::vector<std::uint32_t>& counting = r.workers.empty() ? workers_.now() : r.workers;
  // A policy that cannot count workers that change has the spec's (ChangeWorkers is refused).
  if (kReshapes<P> && !counting.empty())
    pacing_.reshape(pacer, counting);      // a pulley::Error refuses it
  workers_.restore(std::move(r.workers));  // the chief's Restore says the workers as they are now
  changing_ = true;
  // Served before (ready, or placed anew for another membership): a rollback.
  const std::int64_t step_before = registration_.ready() || replaced_ ? pacing_.global_step() : -1;
  replaced_ = false;
  const std::int64_t step = pacing_.policy().global_step(pacer);
  shard_.restore(by_part, pacing_.policy());
  shard_.tables().begin_restore(step);
  rows_cut_session_ = 0;
  if (shard_.tables().size() > 0 && !r.tables_follow) {
    log(LogLevel::kWarning,
        name_ +
            ": the restore holds no rows of the embedding tables: their rows start "
            "again from their initial values");
  }
  update_.clear();
  ledger_.clear();
  ahead_.clear();
  // What waited belongs to the time before: its clients start their step again.
  const ErrorReply gone{
      ErrorCode::kFailedPrecondition,
      name_ + ": the job was restored at global step " + std::to_string(step) +
          " (from a checkpoint, or its state moved between ps tasks): wait until ready and "
          "start the step again"};
  pacing_.reset(std::move(pacer), gone);
  for (const std::uint32_t worker : liveness_.lost()) (void)pacing_.lost(worker);  // still lost
  registration_.restored(r.epoch, step);
  pulls_.answer_all(gone);
  row_pulls_.answer_all(gone);
  cut_.answer_all(gone);
  // A rollback (a ps was lost) undoes what this ps applied since the checkpoint; a move
  // (a ps joined or left) restores the step it was at, or, for a copy of a shard one step
  // behind its twin when the cut was read, the step its twin was at.
  std::string undone;
  if (step_before == step) {
    undone = ", the step it was at: nothing lost";
  } else if (step_before >= 0 && step_before < step) {
    undone =
        ", ahead of global step " + std::to_string(step_before) + " where it was: nothing lost";
  } else if (step_before >= 0) {
    undone = ", rolled back from global step " + std::to_string(step_before) + ": " +
             std::to_string(std::max<std::int64_t>(step_before - step, 0)) + " steps' updates lost";
  }
  log(LogLevel::kInfo, name_ + ": restored at global step " + std::to_string(step) +
                           " (restore epoch " + std::to_string(registration_.epoch()) + ")" +
                           undone);
  respond(reply, Ack{});
  changing_ = false;
  restoring_rows_ = r.tables_follow ? std::optional(r.epoch) : std::nullopt;
  if (restoring_rows_) {
    registration_.unready();  // until the rows are in (RestoreRows with done)
  } else if (!registration_.ready()) {
    become_ready();
  }
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(RestoreRows& r, const RequestContext&, Responder& reply) {
  if (restoring_rows_ != r.epoch) {
    return reject(
        reply, ErrorCode::kFailedPrecondition,
        "RestoreRows without a Restore of epoch " + std::to_string(r.epoch) + " that awaits rows");
  }
  if (refused(reply, shard_.tables().check(r))) return;
  try {
    restored_rows_ += shard_.tables().restore(r);
  } catch (const Error& e) {  // the row limit: the restore cannot complete
    return reject(reply, e.code(), e.what());
  }
  respond(reply, Ack{});
  if (r.done) {
    restoring_rows_.reset();
    log(LogLevel::kInfo, name_ + ": " + std::to_string(std::exchange(restored_rows_, 0)) +
                             " rows of the embedding tables restored");
    become_ready();
  }
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(Shutdown& r, const RequestContext&, Responder& reply) {
  report(true);  // the figures end where training did
  const std::string ps = name_;
  restarts_ = r.restart;
  end_ = r.restart ? ErrorReply{ErrorCode::kUnavailable,
                                ps + ": the job gave this process up and went on without it: it "
                                     "starts again empty, to be taken back by the chief"}
         : r.aborted
             ? ErrorReply{ErrorCode::kAborted, ps + ": training aborted by the chief: " + r.reason}
             : ErrorReply{
                   ErrorCode::kOutOfRange,
                   ps + ": training finished (the chief shut the ps tasks down at global step " +
                       std::to_string(pacing_.global_step()) + ")"};
  answer_all_waiting(*end_);
  respond(reply, Ack{});
}

}  // namespace pulley
// ---- end pulley/ps/impl/parameter_server_state.hpp ----
// ---- begin pulley/ps/impl/parameter_server_training.hpp ----

/// ParameterServer's training path (declared in ps/parameter_server.hpp, which includes
/// this header after the class): tokens (TakeToken, pacing.hpp), pulls (Pull, PullRows),
/// pushes (Push: update.hpp, push_ledger.hpp) and the workers the chief sets
/// (ChangeWorkers).

namespace pulley {

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(TakeToken& r, const RequestContext& context,
                                     Responder& reply) {
  if (!is_ready(reply, "token requested") || !is_sender(r.worker, context, reply, "TakeToken") ||
      refused(reply, registration_.check_epoch(r.epoch, "token request"))) {
    return;
  }
  if (!workers_.counted(r.worker))
    return reject(reply, ErrorCode::kPermissionDenied, workers_.left_message(r.worker));
  revive(r.worker);  // before its heartbeat, maybe: it starts from the step in progress
  pacing_.wait_for_token(r.worker, context.session, reply, ledger_);
  hand_out_tokens();
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::hand_out_tokens() {
  count_next_workers();
  const bool changing = std::exchange(changing_, true);
  pacing_.hand_out(ledger_, [this](Responder& reply, ErrorCode code, const std::string& message) {
    reject(reply, code, message);
  });
  changing_ = changing;
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::pulls_ahead(const RequestContext& context, std::int64_t min_step,
                                              std::uint64_t pushes_paced) {
  if (!context.peer || context.peer->role != Node::Role::kWorker ||
      min_step != pacing_.global_step() + 1)
    return;
  if (ahead_step_ != pacing_.global_step()) forget_pulls_ahead();
  ahead_step_ = pacing_.global_step();
  const std::uint32_t worker = context.peer->index;
  const bool lost_here =
      pushes_paced > ledger_.taken(worker);  // judged now: its later pushes count later
  const auto known = std::find_if(ahead_.begin(), ahead_.end(),
                                  [&](const Ahead& a) { return a.worker == worker; });
  if (known == ahead_.end()) {
    ahead_.push_back({worker, lost_here});
  } else {
    known->lost_here = known->lost_here || lost_here;
  }
  judge_pulls_ahead();
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::judge_pulls_ahead() {
  if (ahead_.empty() || cut_.paused()) return;
  const std::int64_t step_before = pacing_.global_step();
  if (ahead_step_ != step_before) return forget_pulls_ahead();
  for (std::size_t i = 0; i < ahead_.size() && pacing_.global_step() == step_before;) {
    const std::uint32_t worker = ahead_[i].worker;
    const bool lost_here = ahead_[i].lost_here;
    const bool judged = go_on_without([&]() -> std::optional<Verdict> {
      std::optional<Verdict> verdict = pacing_.pulled_ahead(worker, step_before + 1);
      if (verdict && lost_here) ledger_.count_lost(worker, step_before);
      return verdict;
    });
    if (!judged) {
      ++i;
      continue;
    }
    ahead_.erase(ahead_.begin() + static_cast<std::ptrdiff_t>(i));
    // A backup that skipped the step (the pacing ps took no push of it either) is no news.
    if (!lost_here) continue;
    log(LogLevel::kWarning,
        name_ + ": " + Node::worker(worker).name() + " pulls step " +
            std::to_string(step_before + 1) + " without a push for step " +
            std::to_string(step_before) +
            " here: its push was lost with its process (the ps tasks that took it "
            "went on); this step goes on without it; " +
            describe_wait());
  }
  if (pacing_.global_step() != step_before) forget_pulls_ahead();
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::forget_pulls_ahead() {
  for (const Ahead& a : ahead_) {
    if (a.lost_here) ledger_.count_lost(a.worker, ahead_step_);
  }
  ahead_.clear();
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
template <class Change>
bool ParameterServer<S, O, P, T>::go_on_without(Change change) {
  const std::int64_t step_before = pacing_.global_step();
  changing_ = true;  // a throw from the policy leaves its pacer half changed
  const std::optional<Verdict> verdict = change();
  if (verdict == Verdict::kReady) update_.complete(shard_, pacing_.policy(), step_before, stats_);
  changing_ = false;
  if (!verdict) return false;
  hand_out_tokens();
  if (pacing_.global_step() != step_before) release_step_gates();
  return true;
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::release_step_gates() {
  const std::int64_t step = pacing_.global_step();
  pulls_.release(step, [&](Pull& pull, Responder& reply) {
    respond(reply, shard_.read(pull.slices, step, stats_));
  });
  row_pulls_.release(step, [&](RowPull& pull, Responder& reply) {
    // A row pull that cannot be answered (no memory for its rows) is refused alone: it is
    // answered inside the push that completed the step, which must not fail the ps.
    try {
      answer_rows(pull.request, pull.create, step, reply);
    } catch (const std::exception& e) {
      if (reply)
        reject(reply, ErrorCode::kResourceExhausted, std::string("PullRows refused: ") + e.what());
    }
  });
  cut_.release_pauses(step,
                      [&](std::uint64_t session, Responder& reply) { pause(session, reply); });
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(Pull& r, const RequestContext& context, Responder& reply) {
  if (!is_ready(reply, "pull") ||
      (r.min_step > 0 && refused(reply, registration_.check_epoch(r.epoch, "pull"))) ||
      refused(reply, of_epoch(shard_.check(r.slices), r.epoch, "pull"))) {
    return;
  }
  pulls_ahead(context, r.min_step, r.pushes_paced);
  const std::int64_t step = pacing_.global_step();
  if (step < r.min_step) return pulls_.park(r.min_step, std::move(r), reply);
  respond(reply, shard_.read(r.slices, step, stats_));
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(PullRows& r, const RequestContext& context, Responder& reply) {
  if (!is_ready(reply, "row pull") ||
      (r.min_step > 0 && refused(reply, registration_.check_epoch(r.epoch, "row pull"))) ||
      refused(reply, of_epoch(shard_.tables().check(r.tables, false, context.tensors_finite),
                              r.epoch, "row pull"))) {
    return;
  }
  // Only a worker's pull creates, admits and touches rows: the chief and evaluators read.
  const bool create = !context.peer || context.peer->role == Node::Role::kWorker;
  pulls_ahead(context, r.min_step, r.pushes_paced);
  const std::int64_t step = pacing_.global_step();
  if (step < r.min_step) return row_pulls_.park(r.min_step, RowPull{std::move(r), create}, reply);
  answer_rows(r, create, step, reply);
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::answer_rows(const PullRows& r, bool create, std::int64_t step,
                                              Responder& reply) {
  RowsReply rows = shard_.tables().pull(r, create, step, stats_);
  if (r.touch_only) return respond(reply, Ack{});
  respond(reply, std::move(rows));
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(Push& r, const RequestContext& context, Responder& reply) {
  if (!registration_.ready()) {
    return reject(reply, ErrorCode::kFailedPrecondition,
                  "push before initialization: the chief has not initialized the variables");
  }
  // The epoch first: a push of the shape before a restore (another membership's parts and
  // rows) is refused as late, to be started again, not as malformed.
  if (!is_sender(r.worker, context, reply, "Push") ||
      refused(reply, registration_.check_epoch(r.epoch, "push")) ||
      refused(reply, shard_.check(r.gradients, context.tensors_finite)) ||
      refused(reply, shard_.tables().check(r.rows, true, context.tensors_finite))) {
    return;
  }
  if (r.gradients.size() != shard_.parts().size()) {
    // Every part must see every push's verdict, or parts drift apart.
    return reject(reply, ErrorCode::kInvalidArgument,
                  "a push must carry a gradient for each of the " +
                      std::to_string(shard_.parts().size()) + " parts held here, got " +
                      std::to_string(r.gradients.size()));
  }
  if (const PushLedger::Answer* answer = ledger_.repeated(r.worker, r.sequence, r.series)) {
    ++stats_.pushes_repeated;  // sent again after a lost connection: answered, counted once
    if (!answer->refused.empty())
      return reject(reply, ErrorCode::kInvalidArgument, answer->refused);
    return respond(reply, PushReply{answer->stale_parts});
  }
  count_next_workers();  // a change due at this step is counted before the sender is judged
  // Under Async too, which takes no token a step; and a push for a step past the change
  // to come that takes its worker out, as a ps that counted the change refuses it.
  if (!workers_.counted(r.worker) || workers_.leaves_by(r.worker, r.local_step)) {
    return reject(reply, ErrorCode::kPermissionDenied, workers_.left_message(r.worker));
  }
  if (ledger_.older(r.worker, r.sequence, r.series)) {
    ++stats_.pushes_repeated;
    return reject(
        reply, ErrorCode::kAborted,
        "push " + std::to_string(r.sequence) + " of worker " + std::to_string(r.worker) +
            " came after a later one of the same client: a late copy from a connection it gave "
            "up (it sent the push again), not counted");
  }
  if (counted_lost(r, reply)) return;
  if (cut_.paused()) {
    if (cut_.rehold(r, reply)) {
      ++stats_.pushes_repeated;  // the cut holds it already: this connection gets the answer
      return;
    }
    cut_.hold(r, reply);
    return advance_cut();
  }
  take(r, reply,
       context.tensors_finite ? context.tensors_largest : std::numeric_limits<float>::infinity());
  judge_pulls_ahead();  // (the push may have said whether the step is a refill step)
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
bool ParameterServer<S, O, P, T>::counted_lost(const Push& r, Responder& reply) {
  if (!ledger_.counted_lost(r.worker, r.local_step)) return false;
  ++stats_.pushes_repeated;
  reject(reply, ErrorCode::kAborted,
         "push of step " + std::to_string(r.local_step) + " of worker " + std::to_string(r.worker) +
             " came after the process in its place pulled past that step here, which "
             "counted it then as a push lost with its process: a late copy, not counted again");
  return true;
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::take(const Push& r, Responder& reply, float largest) {
  if (counted_lost(r, reply)) return;
  const std::int64_t step_before = pacing_.global_step();
  changing_ = true;  // the policy's own refusal (pulley::Error) leaves its pacer unchanged
  Verdict verdict = Verdict::kStale;
  try {
    verdict = pacing_.on_push(r.worker, r.local_step, r.refill);
  } catch (const Error& e) {
    changing_ = false;
    return reject(reply, e.code(), std::string("Push refused: ") + e.message());
  }
  ledger_.count(r.worker, r.local_step);
  // A push judged lost here when its worker pulled ahead came after all (read late from the
  // connection of the process lost): counted now, it is not counted again when its step moves.
  if (r.local_step <= ahead_step_) {
    for (Ahead& a : ahead_) a.lost_here = a.lost_here && a.worker != r.worker;
  }
  ++stats_.pushes_taken;
  const auto outcome =
      update_.take(shard_, pacing_.policy(), r, verdict, step_before, stats_, largest);
  ledger_.answered(r.worker, r.sequence, {outcome.stale_parts, outcome.refused}, r.series);
  if (outcome.refused.empty()) {
    respond(reply, PushReply{outcome.stale_parts});
  } else {
    reject(reply, ErrorCode::kInvalidArgument, outcome.refused);
  }
  hand_out_tokens();
  if (pacing_.global_step() != step_before) release_step_gates();
  changing_ = false;
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(ChangeWorkers& r, const RequestContext& context,
                                     Responder& reply) {
  if (!is_ready(reply, "change the workers")) return;
  if (!cut_.paused_by(context.session)) {
    return reject(reply, ErrorCode::kFailedPrecondition,
                  "ChangeWorkers without Pause (of this connection)");
  }
  if (r.workers.empty()) {  // the chief takes back the change of that step (another ps refused it)
    workers_.take_back(r.from_step);
    return respond(reply, Ack{});
  }
  if (std::string why = JobWorkers::check(r.workers);
      !why.empty() || (!r.before.empty() && !(why = JobWorkers::check(r.before)).empty())) {
    return reject(reply, ErrorCode::kInvalidArgument, "ChangeWorkers: " + why);
  }
  if constexpr (!kReshapes<P>) {
    return reject(
        reply, ErrorCode::kFailedPrecondition,
        name_ +
            ": its sync policy cannot count workers that join or leave (no SyncPolicy::reshape)");
  }
  if (r.from_step <= pacing_.global_step()) {
    return reject(reply, ErrorCode::kFailedPrecondition,
                  name_ + " is at global step " + std::to_string(pacing_.global_step()) +
                      " already: the workers change at a step to come, not " +
                      std::to_string(r.from_step));
  }
  workers_.change_at(std::move(r.workers), r.from_step, std::move(r.before));
  respond(reply, Ack{});
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::count_next_workers() {
  const std::optional<JobWorkers::Change> change = workers_.due(pacing_.global_step());
  if (!change) return;
  const std::vector<std::uint32_t>& before = change->before;
  const std::vector<std::uint32_t>& after = change->after;
  const auto in = [](const std::vector<std::uint32_t>& set, std::uint32_t w) {
    return std::binary_search(set.begin(), set.end(), w);
  };
  const bool changing = std::exchange(changing_, true);
  for (const std::uint32_t w : after) {  // a new one is not lost unless this ps holds it so
    if ((before.empty() || !in(before, w)) && !liveness_.is_lost(w)) pacing_.back(w);
  }
  pacing_.reshape(after);
  for (const std::uint32_t w : before) {
    if (in(after, w)) continue;
    liveness_.forget(w);
    pacing_.back(w);  // not held lost by the policy either: counted again, it starts afresh
    pacing_.refuse(w, ErrorReply{ErrorCode::kPermissionDenied, workers_.left_message(w)});
  }
  for (const std::uint32_t w : after) {
    // Where workers beat their hearts, a new one is held lost if it never comes.
    if ((before.empty() || !in(before, w)) && !liveness_.known(w) && liveness_.any()) {
      liveness_.heard(w, Clock::now());
    }
  }
  changing_ = changing;
  log(LogLevel::kInfo, name_ + ": the job's workers are " + describe_members(after) +
                           " from global step " + std::to_string(pacing_.global_step()) + " on");
}

}  // namespace pulley
// ---- end pulley/ps/impl/parameter_server_training.hpp ----
// ---- end pulley/ps/parameter_server.hpp ----
// ---- begin pulley/ps/shard_copies.hpp ----

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>

namespace pulley {

/// One ps task of a job that keeps a copy of every shard (`--ps-replicas 1`, beyond
/// TensorFlow): it serves its own shard, ps k's, and a copy of ps k − 1's (mod P), each a
/// whole ParameterServer: parts, optimizer slots, table rows and the sync policy's state.
///
/// It holds no replication logic of its own. The clients keep the copies alike: what
/// changes a shard they send to both of its copies, and they count it done once both have
/// answered (Tcp with `TcpOptions::replicas`); both copies take the same requests, so
/// under SyncReplicas with R = N their state is the same at every step boundary (bit for
/// bit with 2 workers, or one; with more, each copy may sum a step's gradients in another
/// order). With backup workers each copy takes the first R fresh pushes it sees, and
/// under Async and BoundedStaleness each applies pushes in the order they reach it: the
/// copies may then differ by what arrived first. When a ps is lost, the clients read its
/// shard from the copy, and training goes on without a rollback.
///
/// A connection names the shard it wants at its handshake (wire::Hello::shard,
/// RequestContext::shard). Heartbeats reach both copies whichever connection brings them,
/// as does a lost connection: each copy judges the workers and the chief on its own. A
/// push a worker sent just before it was lost may have reached one copy of a shard only,
/// which then counts it where the other completes the step without it: the role runner's
/// chief makes both copies alike again once the lost workers stop changing
/// (Chief::align_copies).
///
/// The chief's lease (`set_chief_lease`): only the chief gives a ps process up for the
/// job (CopyRulings), and it does so once it could not reach the process for the copy
/// timeout. A process cut off from the chief but reached by some tasks would go on serving
/// them after that ruling, while the tasks that heard it write the other copies alone: the
/// copies of its shards would part. So a process serves the tasks only while it heard the
/// chief (any request of the chief's) within its lease: with the role runner, three
/// quarters of the shorter of the copy timeout (so it ends before the chief can rule after
/// a silence) and the worker timeout (before it may complete a step without a worker cut
/// off with the chief); the chief beats every sixth of that (TrainingOptions::chief_lease). Then it
/// refuses every task but the chief (`fenced`, which the transport asks: a connection is closed at
/// its next request or reply, and new ones are refused for now) until it hears the chief again; a
/// task refused so finds the process out of reach and asks the chief about it, as for a
/// process gone. A chief lost or stopped therefore pauses a job with copies until a chief
/// comes back: nobody else may rule which copies stand.
///
/// Which copy it holds follows the job's ps tasks (copy_holder): when a ps leaves the job
/// (Chief::retire), the member after it holds the copy the leaving one held, in place of
/// the leaving one's; when a ps joins (Chief::join) as the last task, the first member
/// holds the new ps's copy in place of the last one's, which the new ps holds. The chief's
/// registration of the model at the new membership, sent on a connection that asks for that shard,
/// makes the new copy (`make_copy`), empty until the chief restores it; what waited on the copy
/// held before is answered kUnavailable, and so is what comes later on a connection to it (its
/// sender learns the membership again).
///
/// @tparam PS the ParameterServer type of both copies
template <class PS>
class ShardCopies {
 public:
  /// @param own       ps k, serving its own shard
  /// @param copy      the copy of ps (k − 1) mod P's shard, of the same type
  /// @param make_copy makes an empty copy of ps j's shard (as `copy` was made for j =
  ///                  k − 1), when the job's ps tasks change; none: the copy never moves
  ShardCopies(PS own, PS copy,
              std::type_identity_t<std::function<PS(std::uint32_t)>> make_copy = {})
      : own_(std::move(own)), copy_(std::move(copy)), make_copy_(std::move(make_copy)) {
    copy_.set_name(copy_name(copy_.task()));
  }

  /// Serves the tasks only while the chief was heard within `lease` (zero, the default:
  /// always). The lease runs from the chief's first request on, and ends with the chief's
  /// leaving heartbeat (training over). Keep it below the copy timeout of the chief's
  /// rulings by more than a request's way from the chief, and above the chief's heartbeat
  /// interval by some (the role runner's: TrainingOptions::chief_lease).
  void set_chief_lease(std::chrono::milliseconds lease) noexcept {
    lease_ = lease;
    own_.set_serves_without_chief(lease.count() <= 0);
    copy_.set_serves_without_chief(lease.count() <= 0);
  }

  /// Why task `peer` may not be served now (its lease ran out: see the class comment), or
  /// "" when it may. The chief always may, and so may everyone once training ended here
  /// (the answer says how). Logs when the process stops serving the tasks.
  [[nodiscard]] std::string fenced(const Node& peer) {
    if (lease_.count() <= 0 || !chief_heard_ || peer.role == Node::Role::kChief || stopped()) return {};
    const auto silent = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - *chief_heard_);
    if (silent < lease_) return {};
    std::string why = "ps " + std::to_string(own_.task()) + " has not heard the chief for " +
                      std::to_string(silent.count()) + " ms (its lease: " + std::to_string(lease_.count()) +
                      " ms): it serves no task until it does, since the chief may give its copies up";
    if (!std::exchange(fenced_, true)) log(LogLevel::kWarning, why);
    return why;
  }

  /// Hands `request` to the copy its connection asked for; a heartbeat, and a Shutdown that
  /// restarts the process, to both. A
  /// connection to a copy it holds no more is answered kUnavailable (but for heartbeats),
  /// unless the chief registers the model there at a membership that places that copy
  /// here: the copy then moves (see the class comment).
  void handle(Request&& request, const RequestContext& context, Responder reply) noexcept {
    const bool chief = context.peer && context.peer->role == Node::Role::kChief;
    if (chief) heard_chief(request);
    if (context.shard && *context.shard != copy_.task() &&
        !take_copy_of(*context.shard, request, chief) &&
        !std::holds_alternative<Heartbeat>(request)) {
      std::string why;
      try {
        why = "ps " + std::to_string(own_.task()) + " holds no copy of ps " +
              std::to_string(*context.shard) + "'s shard now (it holds ps " +
              std::to_string(copy_.task()) + "'s): the job's ps tasks changed, ask them again";
      } catch (...) {  // (no memory for the words: the code says enough)
      }
      respond(reply, ErrorReply{ErrorCode::kUnavailable, std::move(why)});
      return;
    }
    const bool to_copy = context.shard && *context.shard == copy_.task();
    if (const auto* beat = std::get_if<Heartbeat>(&request)) {
      Heartbeat twin = *beat;
      (to_copy ? own_ : copy_).handle(Request{std::move(twin)}, context, [](Response&&) {});
    }
    if (const auto* end = std::get_if<Shutdown>(&request); end != nullptr && end->restart) {
      (to_copy ? own_ : copy_).handle(Request{Shutdown{*end}}, context, [](Response&&) {});
    }
    (to_copy ? copy_ : own_).handle(std::move(request), context, std::move(reply));
  }

  /// ps k's index.
  [[nodiscard]] std::uint32_t task() const noexcept { return own_.task(); }
  /// True if a task may connect to a copy of ps `shard`'s shard here: the one it holds, or,
  /// when its copy may move (`make_copy`), any other than its own (the chief's registration
  /// moves it; anyone else's request there is refused until then).
  [[nodiscard]] bool holds_copy(std::uint32_t shard) const noexcept {
    return shard == copy_.task() || (make_copy_ && shard != own_.task());
  }
  /// True once both copies serve no more (the chief shuts both down).
  [[nodiscard]] bool stopped() const noexcept { return own_.stopped() && copy_.stopped(); }
  /// Once both serve no more: a worker may still come to hear it (ParameterServer::awaits_workers).
  [[nodiscard]] bool awaits_workers() const {
    return stopped() && (own_.awaits_workers() || copy_.awaits_workers());
  }
  /// True once the chief told the process to start again empty (Shutdown::restart).
  [[nodiscard]] bool restarts() const noexcept { return own_.restarts(); }
  /// How it ended: its own shard's end, else the copy's.
  [[nodiscard]] const std::optional<ErrorReply>& ended() const noexcept {
    return own_.ended() ? own_.ended() : copy_.ended();
  }
  /// Time passed with no request: each copy holds the chief lost, and gives up on it, by
  /// its own clock (a process fenced off hears nobody but the chief).
  void tick() noexcept {
    own_.tick();
    copy_.tick();
  }
  void disconnected(const Node& node, std::uint64_t session) noexcept {
    own_.disconnected(node, session);
    copy_.disconnected(node, session);
  }
  /// The job's workers, as ps k's own copy has them (both take every ChangeWorkers).
  [[nodiscard]] std::span<const std::uint32_t> workers() const noexcept { return own_.workers(); }
  [[nodiscard]] std::uint64_t max_request_payload() const noexcept {
    return std::max(own_.max_request_payload(), copy_.max_request_payload());
  }

  /// ps k's own shard.
  [[nodiscard]] PS& own() noexcept { return own_; }
  /// The copy it holds: of ps k − 1's shard (mod P), or of the member before it once the
  /// job's ps tasks changed (copy_holder).
  [[nodiscard]] PS& copy() noexcept { return copy_; }

 private:
  using Clock = std::chrono::steady_clock;

  /// The chief sent `request`: its lease runs again (it ends when the chief leaves), and
  /// after a fence both copies forgive the workers the silence that was the process's own
  /// (Liveness::forgive). A look
  /// (GetStats) renews a lease but starts none: a chief started again looks at the ps
  /// tasks before it begins (runner/run.hpp), and at a job's start it must not fence the
  /// ones up while it waits for the others.
  void heard_chief(const Request& request) noexcept {
    // The fence began when the lease ran out (fenced_ is set only after it did).
    const bool fence_ends = fenced_ && chief_heard_.has_value();
    const Clock::time_point fence_began = fence_ends ? *chief_heard_ + lease_ : Clock::time_point{};
    const auto* beat = std::get_if<Heartbeat>(&request);
    if (beat != nullptr && beat->leaving) {
      chief_heard_.reset();
    } else if (chief_heard_ || !std::holds_alternative<GetStats>(request)) {
      chief_heard_ = Clock::now();
    }
    if (std::exchange(fenced_, false)) {
      if (fence_ends) {
        own_.fence_lifted(fence_began);
        copy_.fence_lifted(fence_began);
      }
      try {
        log(LogLevel::kInfo, "ps " + std::to_string(own_.task()) + " heard the chief again: it serves the tasks again");
      } catch (...) {  // (no memory for a log line: the lease runs again all the same)
      }
    }
  }

  /// The chief registers the model over members that place ps `shard`'s copy here (the
  /// copy held until now went with a ps that left): the copy held is let go, and an empty
  /// one of `shard` takes its place, for the chief to restore. True if it moved.
  bool take_copy_of(std::uint32_t shard, const Request& request, bool chief) noexcept {
    const auto* registration = std::get_if<Register>(&request);
    if (!chief || registration == nullptr || !make_copy_ || shard == own_.task() ||
        copy_holder(registration->members, shard) != own_.task()) {
      return false;
    }
    std::string line;
    try {  // everything that may throw, before the copy held is let go
      PS fresh = make_copy_(shard);
      const std::string now = "ps " + std::to_string(own_.task()) + " holds a copy of ps " +
                              std::to_string(shard) + "'s shard";
      const std::string instead = "in place of ps " + std::to_string(copy_.task()) + "'s";
      line =
          now + " from membership " + std::to_string(registration->membership) + " on, " + instead;
      fresh.set_name(copy_name(shard));
      fresh.set_serves_without_chief(lease_.count() <= 0);
      copy_.let_go(now + " now, " + instead);
      copy_ = std::move(fresh);
    } catch (...) {  // (the request is refused: the chief's move fails, and it moves nothing)
      try {
        log(LogLevel::kError, "ps " + std::to_string(own_.task()) +
                                  " could not make a copy of ps " + std::to_string(shard) +
                                  "'s shard");
      } catch (...) {
      }
      return false;
    }
    try {
      log(LogLevel::kInfo, line);
    } catch (...) {  // (no memory for the line: the copy moved all the same)
    }
    return true;
  }

  /// How its copy of ps `shard`'s shard is named in log lines and errors.
  [[nodiscard]] std::string copy_name(std::uint32_t shard) const {
    return "ps " + std::to_string(own_.task()) + "'s copy of ps " + std::to_string(shard);
  }

  PS own_;
  PS copy_;
  std::function<PS(std::uint32_t)> make_copy_;  ///< an empty copy of ps j's shard (may be empty)
  std::chrono::milliseconds lease_{0};
  std::optional<Clock::time_point> chief_heard_;  ///< the chief's last request, once it sent one
  bool fenced_ = false;                           ///< the lease ran out: logged once
};

}  // namespace pulley
// ---- end pulley/ps/shard_copies.hpp ----
// ---- begin pulley/sharding/partition.hpp ----

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace pulley {

// Building blocks of the stock sharding policies, for writing your own.

/// Splits `rows` rows into `k` contiguous ranges as TensorFlow's partitioned variables do:
/// the first `rows % k` ranges get one row more. `k` is clamped to [1, rows] (a variable of
/// 0 rows gets one empty range).
inline std::vector<RowRange> partition_rows(std::size_t rows, std::size_t k) {
  if (k < 1) k = 1;
  if (k > rows && rows > 0) k = rows;
  const std::size_t base = rows / k;
  const std::size_t extra = rows % k;
  std::vector<RowRange> ranges;
  ranges.reserve(k);
  std::size_t begin = 0;
  for (std::size_t i = 0; i < k; ++i) {
    const std::size_t end = begin + base + (i < extra ? 1 : 0);
    ranges.push_back({begin, end});
    begin = end;
  }
  return ranges;
}

/// Splits every variable into `parts_for(spec)` parts (`partition_rows`) and deals all the
/// parts to the ps tasks round-robin in creation order, as `replica_device_setter` does
/// with each part. Throws kInvalidArgument when `num_ps` is 0.
template <class PartsFor>
Placement place_round_robin(std::span<const VariableSpec> variables, std::size_t num_ps,
                            PartsFor parts_for) {
  if (num_ps == 0) throw Error(ErrorCode::kInvalidArgument, "sharding needs at least one ps task");
  PlacementBuilder builder;
  std::size_t next_ps = 0;
  for (const VariableSpec& spec : variables) {
    builder.begin_variable();
    for (const RowRange& rows : partition_rows(spec.rows(), parts_for(spec))) {
      builder.add(static_cast<std::uint32_t>(next_ps), rows);
      next_ps = (next_ps + 1) % num_ps;
    }
  }
  return std::move(builder).finish();
}

}  // namespace pulley
// ---- end pulley/sharding/partition.hpp ----
// ---- begin pulley/sharding/partitioned.hpp ----

#include <cstddef>
#include <span>

namespace pulley {

/// Splits every variable along its first dimension into `num_shards` parts (fewer when it
/// has fewer rows), like TF's `fixed_size_partitioner`; parts are dealt round-robin.
struct FixedShards {
  std::size_t num_shards = 1;  ///< parts per variable (fewer if it has fewer rows)

  /// The placement of `variables` over `num_ps` ps tasks.
  [[nodiscard]] Placement place(std::span<const VariableSpec> variables, std::size_t num_ps) const {
    return place_round_robin(variables, num_ps,
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
    return place_round_robin(variables, num_ps,
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
    return place_round_robin(variables, num_ps, [](const VariableSpec&) { return std::size_t{1}; });
  }
};
static_assert(Sharding<RoundRobin>);

}  // namespace pulley
// ---- end pulley/sharding/round_robin.hpp ----
// ---- begin pulley/sync/async.hpp ----

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace pulley {

/// Asynchronous training: every push is applied as soon as it arrives and no worker ever
/// waits for another. Nothing is stale, tokens never wait, and the global step counts push
/// messages.
struct Async {
  /// Only remembers the gradient it was handed, so `take` returns it without a copy.
  struct Accumulator {
    std::span<const float> pending;
  };

  /// Counts push messages.
  struct Pacer {
    std::int64_t pushes = 0;
  };

  /// An accumulator for n-element gradients.
  [[nodiscard]] Accumulator make_accumulator(std::size_t /*n*/) const { return {}; }
  /// Keeps a view of `gradient` until `take`.
  void accumulate(Accumulator& acc, std::span<const float> gradient) const {
    acc.pending = gradient;
  }
  /// The gradient handed last.
  std::span<const float> take(Accumulator& acc) const { return acc.pending; }

  /// At step 0.
  [[nodiscard]] Pacer make_pacer() const { return {}; }
  /// Every push is applied at once and is one step.
  Verdict on_push(Pacer& pacer, std::uint32_t /*worker*/, std::int64_t /*local_step*/) const {
    ++pacer.pushes;
    return Verdict::kReady;
  }
  /// Push messages handled.
  [[nodiscard]] std::int64_t global_step(const Pacer& pacer) const { return pacer.pushes; }
  /// Always a token, which need not be asked for again.
  std::optional<Token> take_token(Pacer& /*pacer*/, std::uint32_t /*worker*/) const {
    return Token{0, 0, 0, false};
  }
  /// The pushes counted.
  [[nodiscard]] std::vector<std::int64_t> save(const Pacer& pacer) const { return {pacer.pushes}; }
  /// Goes on from the saved count.
  void load(Pacer& pacer, std::span<const std::int64_t> state) const {
    if (state.size() != 1 || state[0] < 0) {
      throw Error(ErrorCode::kInvalidArgument, "Async cannot load a pacer of another policy");
    }
    pacer.pushes = state[0];
  }
  /// Async counts no workers: any number may join or leave.
  void reshape(Pacer& /*pacer*/, std::span<const std::uint32_t> /*workers*/) const noexcept {}
  /// Async never waits.
  [[nodiscard]] std::string waiting_for(const Pacer& /*pacer*/) const { return "nothing (async)"; }
};
static_assert(SyncPolicy<Async>);

}  // namespace pulley
// ---- end pulley/sync/async.hpp ----
// ---- begin pulley/sync/bounded_staleness.hpp ----

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace pulley {

/// Stale-synchronous parallel training (SSP, as in Petuum's Bösen; the OSDI'14 parameter
/// server calls it bounded delay): each worker has a clock, the number of steps it has
/// pushed, and a worker at clock c may start its next step only while the slowest worker is
/// at clock c - s or later. Its step then reads parameters that include every update of
/// clocks before c - s from every worker, and possibly newer ones.
///
/// Every push is applied as it arrives (as in Async): nothing is averaged, and nothing is
/// stale but a repeated push of a clock already counted. A ps's global step is the slowest worker's clock as that ps has seen it, so a
/// pull of step c - s waits until every worker's updates of earlier clocks are applied
/// there. s = 0 is lockstep; `kUnbounded` never waits, which is Async with tokens.
///
/// A worker that dies holds the others back once they are s clocks ahead: its clock no
/// longer moves. Their token requests then wait, and their client reports what the ps
/// waits for ("worker 2 at clock 5"), until the ps holds the worker lost (its heartbeats
/// stopped, parameter_server.hpp): the slowest clock is then taken over the others. A
/// lost worker that comes back starts at the slowest clock (its clocks in between are
/// skipped; what it pushes for them is stale), so the global step never goes back.
///
/// Workers that join or leave the job (`reshape`): a worker that joins starts at the
/// slowest clock and holds nobody back until a ps hears from it. Its first push there sets
/// its clock to the one its token named, on every ps alike (the ps tasks count the change
/// when their own slowest clocks reach the step the chief chose, which one may do a clock
/// or two before another, so each counts it in at a clock of its own). Its tokens read the
/// step it starts at until then, so that its first push reaches every ps after that ps
/// counted it in. If the others ran ahead meanwhile, it catches up from there, holding the
/// slowest clock until it does. One that left no longer holds anyone back (what it still
/// pushes is stale). Batches are numbered clock × N + rank among the workers, N their
/// count: while the fastest run ahead of the change, up to s clocks' batches may be read
/// twice or not at all.
class BoundedStaleness {
 public:
  /// A staleness bound that never binds.
  static constexpr std::int64_t kUnbounded = std::numeric_limits<std::int64_t>::max();

  /// @param staleness          s, how many clocks a worker may run ahead of the slowest (≥ 0)
  /// @param total_num_replicas N, the workers, with task indices 0 .. N-1 (≥ 1)
  BoundedStaleness(std::int64_t staleness, int total_num_replicas)
      : staleness_(staleness), total_num_replicas_(total_num_replicas) {
    if (staleness < 0 || total_num_replicas < 1) {
      throw Error(ErrorCode::kInvalidArgument,
                  "BoundedStaleness needs staleness >= 0 and total_num_replicas >= 1, got " +
                      std::to_string(staleness) + " and " + std::to_string(total_num_replicas));
    }
  }

  /// s: how many clocks a worker may run ahead of the slowest.
  [[nodiscard]] std::int64_t staleness() const noexcept { return staleness_; }
  /// N: the number of workers.
  [[nodiscard]] int total_num_replicas() const noexcept { return total_num_replicas_; }

  /// Only remembers the gradient it was handed: each push is applied as it arrives.
  struct Accumulator {
    std::span<const float> pending;
  };

  /// Every worker's clock as this ps has seen it.
  struct Pacer {
    std::vector<std::int64_t> clocks;  ///< by worker: steps pushed
    std::int64_t slowest = 0;          ///< the lowest clock of a worker not lost: the global step
    std::vector<char> lost;            ///< by worker: held lost by the ps
    /// The job's workers, ascending, once they changed (`reshape`); empty: 0 .. N-1.
    std::vector<std::uint32_t> workers;
    /// By worker: counted in by `reshape` and not heard since: it holds nobody back, and
    /// its first push sets its clock (another ps may have counted it in at another clock).
    std::vector<char> joined;
  };

  /// An accumulator for n-element gradients.
  [[nodiscard]] Accumulator make_accumulator(std::size_t /*n*/) const { return {}; }
  /// Keeps a view of `gradient` until `take`.
  void accumulate(Accumulator& acc, std::span<const float> gradient) const {
    acc.pending = gradient;
  }
  /// The gradient handed last.
  std::span<const float> take(Accumulator& acc) const { return acc.pending; }

  /// Every worker at clock 0.
  [[nodiscard]] Pacer make_pacer() const {
    const auto n = static_cast<std::size_t>(total_num_replicas_);
    return {std::vector<std::int64_t>(n, 0), 0, std::vector<char>(n, 0), {}, std::vector<char>(n, 0)};
  }

  /// A push for the worker's clock moves it on and is applied at once. A push for a clock
  /// it has passed is a repeat (a retried step): stale, dropped, so that no update counts
  /// twice; so is one of a worker outside the job's. Refused (Error) for a clock the worker
  /// cannot have had a token of. The first push of a worker counted in says its clock (its
  /// token's, from the pacing ps), even one behind this ps's slowest clock.
  Verdict on_push(Pacer& pacer, std::uint32_t worker, std::int64_t local_step) const {
    if (!member(pacer, worker)) return Verdict::kStale;  // it left, or is not counted here yet
    std::int64_t& clock = clock_of(pacer, worker);
    if (unheard(pacer, worker) && local_step >= 0) {
      clock = local_step;
      pacer.joined[worker] = 0;
    }
    if (local_step < 0 || local_step > clock) {
      throw Error(ErrorCode::kInvalidArgument,
                  "worker " + std::to_string(worker) + " pushed for clock " +
                      std::to_string(local_step) + " but is at clock " + std::to_string(clock));
    }
    if (local_step < clock) return Verdict::kStale;
    ++clock;
    update_slowest(pacer);
    return Verdict::kReady;
  }

  /// Takes the slowest clock over the other workers from now on.
  Verdict on_worker_lost(Pacer& pacer, std::uint32_t worker) const {
    if (worker < pacer.lost.size()) pacer.lost[worker] = 1;
    update_slowest(pacer);
    return Verdict::kPending;  // every push was applied as it came: nothing is pending
  }

  /// Counts `worker` again, from the slowest clock if it fell behind.
  void on_worker_back(Pacer& pacer, std::uint32_t worker) const {
    if (worker >= pacer.lost.size()) return;
    pacer.lost[worker] = 0;
    pacer.clocks[worker] = std::max(pacer.clocks[worker], pacer.slowest);
  }

  /// The workers at the slowest clock, or catching up to it (the others wait for them once
  /// s clocks ahead).
  [[nodiscard]] std::vector<std::uint32_t> awaited(const Pacer& pacer) const {
    std::vector<std::uint32_t> workers;
    for (std::uint32_t w = 0; w < pacer.clocks.size(); ++w) {
      if (counts(pacer, w) && pacer.clocks[w] <= pacer.slowest) workers.push_back(w);
    }
    return workers;
  }

  /// The slowest worker's clock.
  [[nodiscard]] std::int64_t global_step(const Pacer& pacer) const { return pacer.slowest; }

  /// The token of the worker's next clock c, once c is at most s ahead of the slowest; it
  /// reads step c - s (step c for a worker counted in and not heard yet), and batch
  /// c × N + its rank among the workers (each worker its own share of every clock). Asking
  /// again before pushing gives the same token. A worker outside the job's waits (it is
  /// let in at the next step, or it left).
  std::optional<Token> take_token(Pacer& pacer, std::uint32_t worker) const {
    if (!member(pacer, worker)) return std::nullopt;
    const std::int64_t clock = clock_of(pacer, worker);
    if (clock - pacer.slowest > staleness_) return std::nullopt;
    std::int64_t workers = total_num_replicas_;
    std::int64_t rank = worker;
    if (!pacer.workers.empty()) {
      workers = static_cast<std::int64_t>(pacer.workers.size());
      rank = std::lower_bound(pacer.workers.begin(), pacer.workers.end(), worker) - pacer.workers.begin();
    }
    const std::int64_t pull_step = unheard(pacer, worker) ? clock : read_step(clock);
    return Token{clock, pull_step, read_step(clock + 1), true, clock * workers + rank};
  }

  /// The job's workers are `workers` (task indices, ascending, not empty): one that joins
  /// starts at the slowest clock, one that left no longer counts. Throws kInvalidArgument
  /// for an empty or unordered set (the pacer is then as it was).
  void reshape(Pacer& pacer, std::span<const std::uint32_t> workers) const {
    require_task_set(workers, "worker", "BoundedStaleness: ");
    std::vector<std::uint32_t> set(workers.begin(), workers.end());
    const std::size_t size = std::max<std::size_t>(pacer.clocks.size(), set.back() + std::size_t{1});
    pacer.clocks.reserve(size);
    pacer.lost.reserve(size);
    pacer.joined.reserve(size);
    pacer.joined.resize(pacer.clocks.size(), 0);
    for (const std::uint32_t w : set) {  // nothing throws from here on
      if (w >= pacer.clocks.size()) {
        pacer.clocks.resize(w + std::size_t{1}, pacer.slowest);
        pacer.lost.resize(w + std::size_t{1}, 0);
        pacer.joined.resize(w + std::size_t{1}, 0);
        pacer.joined[w] = 1;
      } else if (!member(pacer, w)) {
        pacer.clocks[w] = std::max(pacer.clocks[w], pacer.slowest);
        pacer.joined[w] = 1;
      }
    }
    pacer.workers = std::move(set);
    update_slowest(pacer);
  }

  /// Every worker's clock; one that left the job, or joined and was not heard yet, at the
  /// slowest (a resumed job does not go back for it).
  [[nodiscard]] std::vector<std::int64_t> save(const Pacer& pacer) const {
    std::vector<std::int64_t> clocks = pacer.clocks;
    for (std::uint32_t w = 0; w < clocks.size(); ++w) {
      if (!member(pacer, w) || unheard(pacer, w)) clocks[w] = std::max(clocks[w], pacer.slowest);
    }
    return clocks;
  }

  /// Goes on from the saved clocks. A job resumed with more workers starts the new ones at
  /// the slowest clock saved; with fewer, the clocks of the workers gone are dropped.
  void load(Pacer& pacer, std::span<const std::int64_t> state) const {
    if (state.empty() || *std::min_element(state.begin(), state.end()) < 0) {
      throw Error(ErrorCode::kInvalidArgument, "BoundedStaleness cannot load a pacer of another policy");
    }
    const std::int64_t slowest = *std::min_element(state.begin(), state.end());
    std::vector<std::int64_t> clocks(static_cast<std::size_t>(total_num_replicas_), slowest);
    std::copy_n(state.begin(), std::min(state.size(), clocks.size()), clocks.begin());
    pacer.lost.assign(clocks.size(), 0);  // who is lost is the ps's to say, not the checkpoint's
    pacer.joined.assign(clocks.size(), 0);
    pacer.clocks = std::move(clocks);
    pacer.slowest = 0;
    update_slowest(pacer);
  }

  /// "the slowest: worker 2 at clock 5 (fastest: 8, staleness 3)"; a worker that joined
  /// behind it: "worker 3 catching up at clock 4".
  [[nodiscard]] std::string waiting_for(const Pacer& pacer) const {
    std::string slowest;
    for (std::uint32_t w = 0; w < pacer.clocks.size(); ++w) {
      if (pacer.clocks[w] > pacer.slowest || !counts(pacer, w)) continue;
      slowest += (slowest.empty() ? "worker " : ", worker ") + std::to_string(w);
      if (pacer.clocks[w] < pacer.slowest) slowest += " catching up at clock " + std::to_string(pacer.clocks[w]);
    }
    return "the slowest: " + slowest + " at clock " + std::to_string(pacer.slowest) +
           " (fastest: " +
           std::to_string(*std::max_element(pacer.clocks.begin(), pacer.clocks.end())) +
           ", staleness " + std::to_string(staleness_) + ")";
  }

 private:
  /// The lowest clock of the workers not lost; it never goes back (nor moves while every
  /// worker is lost).
  void update_slowest(Pacer& pacer) const {
    std::int64_t slowest = std::numeric_limits<std::int64_t>::max();
    for (std::uint32_t w = 0; w < pacer.clocks.size(); ++w) {
      if (counts(pacer, w)) slowest = std::min(slowest, pacer.clocks[w]);
    }
    if (slowest != std::numeric_limits<std::int64_t>::max()) {
      pacer.slowest = std::max(pacer.slowest, slowest);
    }
  }

  /// True if `worker` is one of the job's workers.
  [[nodiscard]] bool member(const Pacer& pacer, std::uint32_t worker) const noexcept {
    if (pacer.workers.empty()) return worker < static_cast<std::uint32_t>(total_num_replicas_);
    return std::binary_search(pacer.workers.begin(), pacer.workers.end(), worker);
  }
  /// True if `worker` holds the others back: one of the job's, heard, and not lost.
  [[nodiscard]] bool counts(const Pacer& pacer, std::uint32_t worker) const noexcept {
    return worker < pacer.lost.size() && pacer.lost[worker] == 0 && member(pacer, worker) && !unheard(pacer, worker);
  }
  /// True if `worker` was counted in by `reshape` and has not pushed here since.
  [[nodiscard]] static bool unheard(const Pacer& pacer, std::uint32_t worker) noexcept {
    return worker < pacer.joined.size() && pacer.joined[worker] != 0;
  }

  [[nodiscard]] std::int64_t read_step(std::int64_t clock) const {
    return clock > staleness_ ? clock - staleness_ : 0;
  }

  std::int64_t& clock_of(Pacer& pacer, std::uint32_t worker) const {
    if (worker >= pacer.clocks.size()) {
      throw Error(ErrorCode::kInvalidArgument,
                  "worker " + std::to_string(worker) + " is outside total_num_replicas " +
                      std::to_string(total_num_replicas_));
    }
    return pacer.clocks[worker];
  }

  std::int64_t staleness_;
  int total_num_replicas_;
};
static_assert(SyncPolicy<BoundedStaleness>);

}  // namespace pulley
// ---- end pulley/sync/bounded_staleness.hpp ----
// ---- begin pulley/sync/sync_replicas.hpp ----

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

namespace pulley {

/// Synchronous training with TensorFlow's `SyncReplicasOptimizer` semantics.
///
/// The ps's global step is at some step s. A push tagged with local step < s is stale: its
/// gradients are dropped. When `replicas_to_aggregate` (R) fresh pushes are in, the mean of
/// their gradients is applied once, part by part, and the step advances; each time it
/// does, `max(R, N)` tokens carrying the new step are released. A worker takes a token
/// before each step, and pulls the parameters of the token's step.
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
///
/// The max(R, N) tokens of a step are numbered 0, 1, ... and the token numbered k of step
/// s reads batch s × max(R, N) + k of the job's data (Token::batch): a step's examples are
/// the same whoever takes its tokens. With R <= N, worker w's first token of a step is token
/// w whatever the order the workers ask in, so a copy of the pacing ps that did not hand a
/// token out (ps/shard_copies.hpp) hands out the same; a refill step's further tokens, and
/// every token with R > N, are the lowest-numbered left. A token given back (`release`,
/// a lost worker) is handed out again with its number.
///
/// Lost workers (a deviation from TensorFlow, which waits for them forever): when the ps
/// holds a worker lost (its heartbeats stopped, parameter_server.hpp), training goes on
/// without it, losing at most the batches of the step in progress:
///   - a step that begins with L workers lost and N - L < R is a refill step (a step no
///     token or push touched yet begins again when a worker is lost, so the step a restore
///     makes is judged as the unbroken job judged it): it still needs R fresh gradients,
///     and the live workers take the lost ones' tokens (each its
///     own first, then one more at a time while more tokens are left than live workers
///     still to take theirs), so every step keeps its R batches, the lost worker's among
///     them. Its tokens pull at once after their push (`next_pull_step` is the step), since
///     the worker may bring another gradient of the same step. The pacing ps (the lowest member)
///     decides it when the step begins, and its tokens say so (Token::refill); every other
///     ps takes that word from the step's pushes (`follow`), whatever its own lost workers;
///   - a worker lost during a step that is not a refill step (its tokens were handed out
///     to wait for the next step) leaves that step needing min(R, N - L') fresh gradients
///     (at least 1), L' counting the lost workers that have not pushed for it; a step that
///     already has them all completes the moment the worker is lost. The update is the
///     mean of the fresh gradients the step got.
/// With R > N nothing changes: a step always needs R, and any worker takes any token. A
/// lost worker whose heartbeats come back counts again from the step in progress (and
/// takes its own token from the next); what it pushes for a step that completed without
/// it is stale and dropped.
///
/// A worker that pulls the next step without a push of this one here (`on_pull_ahead`:
/// its push was lost with its process, killed while it wrote the push to several ps tasks
/// and started again; or, with backup workers, it skipped the step): where each worker
/// brings at most one gradient (R <= N, not a refill step), the step goes on without it,
/// once, as if it had been lost for that step alone, whatever other workers the ps holds
/// lost. With backups the step still needs R from the others while they can bring R (and
/// this ps holds none of them lost).
///
/// Workers that join or leave the job (`reshape`, at a step boundary every ps reaches
/// alike): the workers are then a set of task indices, N its size, and "its own token" is
/// a worker's rank in it. From that step on a step has max(R, N) tokens (R = N when made
/// with `kEveryWorker`), numbered after the batches of the steps before, so the data goes
/// on where it was and the epoch's remaining batches are shared among the new workers. A
/// worker outside the set waits for a token (it is let in at the next step, or it left)
/// and what it pushes is stale.
class SyncReplicas {
 public:
  /// Pass as replicas_to_aggregate: R = N, and R follows N when workers join or leave.
  static constexpr int kEveryWorker = 0;

  /// @param replicas_to_aggregate R, gradients averaged into one update (≥ 1), or
  ///                              kEveryWorker: one of every worker's, however many
  /// @param total_num_replicas    N, the number of workers (≥ 1), task indices 0 .. N-1
  SyncReplicas(int replicas_to_aggregate, int total_num_replicas)
      : every_worker_(replicas_to_aggregate == kEveryWorker),
        replicas_to_aggregate_(every_worker_ ? total_num_replicas : replicas_to_aggregate),
        total_num_replicas_(total_num_replicas) {
    if (replicas_to_aggregate_ < 1 || total_num_replicas < 1) {
      throw Error(ErrorCode::kInvalidArgument,
                  "SyncReplicas needs replicas_to_aggregate >= 1 (or kEveryWorker) and total_num_replicas >= 1, "
                  "got " +
                      std::to_string(replicas_to_aggregate) + " and " +
                      std::to_string(total_num_replicas));
    }
  }

  /// R: gradients averaged into one update (N at the start, with kEveryWorker).
  [[nodiscard]] int replicas_to_aggregate() const noexcept { return replicas_to_aggregate_; }
  /// N: the number of workers at the start.
  [[nodiscard]] int total_num_replicas() const noexcept { return total_num_replicas_; }
  /// True if R follows N (kEveryWorker).
  [[nodiscard]] bool every_worker() const noexcept { return every_worker_; }

  /// Running sum of the current step's fresh gradients of one part.
  struct Accumulator {
    std::vector<float> sum;
    int count = 0;
  };

  /// The global step, its fresh pushes so far, and its tokens.
  struct Pacer {
    std::int64_t step = 0;
    int fresh = 0;                                ///< fresh pushes of `step`
    std::vector<std::uint32_t> free;              ///< numbers of `step`'s tokens not taken, ascending
    std::map<std::uint32_t, std::int64_t> taken;  ///< tokens of `step` taken, by worker
    /// By worker: the numbers of the tokens of `step` it took and did not push for yet,
    /// oldest first.
    std::map<std::uint32_t, std::vector<std::uint32_t>> held;
    std::set<std::uint32_t> pushed;               ///< workers with a fresh push of `step`
    std::set<std::uint32_t> lost;                 ///< workers the ps holds lost
    /// Workers whose push of `step` was lost with their process (`on_pull_ahead`): not
    /// waited for in this step, their push of it stale.
    std::set<std::uint32_t> forfeited;
    bool refill = false;  ///< `step` began short of workers: the live ones take the lost ones' tokens
    /// The job's workers, ascending, once they changed (`reshape`); empty: 0 .. N-1.
    std::vector<std::uint32_t> workers;
    std::int64_t base_step = 0;   ///< the step the workers last changed at
    std::int64_t base_batch = 0;  ///< the batch of token 0 of `base_step`
  };

  /// An empty accumulator for n-element gradients.
  [[nodiscard]] Accumulator make_accumulator(std::size_t n) const {
    return {std::vector<float>(n, 0.0F), 0};
  }

  /// Adds one fresh gradient.
  void accumulate(Accumulator& acc, std::span<const float> gradient) const {
    if (acc.count++ == 0) {
      std::copy(gradient.begin(), gradient.end(), acc.sum.begin());
      return;
    }
    float* __restrict s = acc.sum.data();
    const float* __restrict g = gradient.data();
    for (std::size_t i = 0, n = acc.sum.size(); i < n; ++i) s[i] += g[i];
  }

  /// The mean of the gradients accumulated.
  std::span<const float> take(Accumulator& acc) const {
    const float scale = 1.0F / static_cast<float>(acc.count);
    for (float& v : acc.sum) v *= scale;
    acc.count = 0;
    return acc.sum;
  }

  /// Step 0, with max(R, N) tokens.
  [[nodiscard]] Pacer make_pacer() const {
    Pacer pacer;
    pacer.step = -1;
    next_step(pacer);
    return pacer;
  }

  /// Stale if tagged before the current step, or pushed by a worker outside the job's; the
  /// R-th fresh push completes the step.
  Verdict on_push(Pacer& pacer, std::uint32_t worker, std::int64_t local_step) const {
    if (local_step < pacer.step || !member(pacer, worker) ||
        (local_step == pacer.step && pacer.forfeited.contains(worker))) {
      return Verdict::kStale;
    }
    pacer.pushed.insert(worker);  // first: an insertion that throws leaves the pacer as it was
    if (const auto held = pacer.held.find(worker); held != pacer.held.end()) {
      if (held->second.size() <= 1) {
        pacer.held.erase(held);  // erasing cannot throw
      } else {
        held->second.erase(held->second.begin());
      }
    }
    if (++pacer.fresh < required(pacer)) return Verdict::kPending;
    next_step(pacer);
    return Verdict::kReady;
  }

  /// Stops waiting for `worker` (and gives back its tokens): the step completes now if the
  /// others' fresh gradients are all it needs. A step no token or push has touched yet
  /// begins with the worker lost, and is judged as such (a refill step or not): a step
  /// made by a restore (`load`, then every worker the ps still holds lost) is the step the
  /// unbroken job had, not one that lost a worker on the way.
  Verdict on_worker_lost(Pacer& pacer, std::uint32_t worker) const {
    const bool untouched =
        pacer.fresh == 0 && pacer.taken.empty() && pacer.pushed.empty() && pacer.forfeited.empty();
    pacer.lost.insert(worker);
    release(pacer, worker);
    if (untouched) {
      judge_refill(pacer);
      return Verdict::kPending;
    }
    return complete_without(pacer);
  }

  /// A push for `local_step` says what the pacing ps decided about that step (Token::refill):
  /// before the step's first fresh push, the step in progress takes its word, so that every
  /// ps needs what the tokens bring (this ps's own lost workers may differ for a heartbeat).
  void follow(Pacer& pacer, std::int64_t local_step, bool refill) const noexcept {
    if (local_step == pacer.step && pacer.fresh == 0) pacer.refill = refill && one_each(pacer);
  }

  /// `worker` pulls step `min_step` without a push for the step in progress here: when the
  /// step is the one before `min_step` and each worker brings at most one gradient to it
  /// (R <= N, not a refill step), the step stops waiting for that worker, as
  /// `on_worker_lost` would for this step alone (its tokens go back; a push of it for this
  /// step is stale from now on): kReady when that completes the step, whatever workers this
  /// ps holds lost. With backup workers (R < N) the worker may have skipped the step (the
  /// others went on, and it took the next step's token) or lost its push on the way: either
  /// way it brings none here, and the step needs min(R, N less those that owe one) of the
  /// others'. At most N - R skip a step (R workers pushed it to the pacing ps, and to every
  /// ps unless lost), so a step goes on short of R only when pushes were lost or this ps
  /// holds workers lost (whose pushes it then stops waiting for, as ever). nullopt
  /// otherwise: R > N or a refill step (the step needs R gradients from whoever brings them,
  /// and the pull waits), or a worker held lost here (the step does not wait for it).
  std::optional<Verdict> on_pull_ahead(Pacer& pacer, std::uint32_t worker,
                                       std::int64_t min_step) const {
    if (min_step != pacer.step + 1 || !member(pacer, worker) || pacer.pushed.contains(worker) ||
        pacer.forfeited.contains(worker) || pacer.lost.contains(worker) || !one_each(pacer) ||
        pacer.refill) {
      return std::nullopt;
    }
    pacer.forfeited.insert(worker);  // first: an insertion that throws leaves the pacer as it was
    release(pacer, worker);
    return complete_without(pacer);
  }

  /// Waits for `worker` again, from the step in progress.
  void on_worker_back(Pacer& pacer, std::uint32_t worker) const { pacer.lost.erase(worker); }

  /// The workers that have not pushed for the step in progress and are not lost (R <= N:
  /// each owes one gradient; with R > N any of them may bring the rest).
  [[nodiscard]] std::vector<std::uint32_t> awaited(const Pacer& pacer) const {
    std::vector<std::uint32_t> workers;
    for_each_worker(pacer, [&](std::uint32_t w) {
      if (!pacer.pushed.contains(w) && !pacer.lost.contains(w) && !pacer.forfeited.contains(w))
        workers.push_back(w);
    });
    return workers;
  }

  /// The global step, and the number of its first batch where the workers' changes moved
  /// it from step × max(R, N): a checkpoint's cut has no step half aggregated (what was is
  /// redone). The workers are the job's to say, not the checkpoint's (`reshape` after
  /// `load`).
  [[nodiscard]] std::vector<std::int64_t> save(const Pacer& pacer) const {
    const std::int64_t batch = first_batch(pacer);
    if (batch == pacer.step * std::max(replicas_to_aggregate_, total_num_replicas_)) return {pacer.step};
    return {pacer.step, batch};
  }

  /// Starts at the saved global step with all its tokens, numbered from the saved batch
  /// (a state of the global step alone: from step × max(R, N)).
  void load(Pacer& pacer, std::span<const std::int64_t> state) const {
    if (state.empty() || state.size() > 2 || state[0] < 0 || (state.size() == 2 && state[1] < 0)) {
      throw Error(ErrorCode::kInvalidArgument, "SyncReplicas cannot load a pacer of another policy");
    }
    Pacer fresh = make_pacer();
    fresh.step = state[0];
    fresh.base_step = state[0];
    fresh.base_batch = state.size() == 2 ? state[1] : state[0] * tokens_per_step(fresh);
    pacer = std::move(fresh);
  }

  /// The job's workers are `workers` (task indices, ascending, not empty) from the step in
  /// progress on, which must have had no push and no token taken. Its tokens are made
  /// again, max(R, N) of them, numbered on from the batch its first token had; R follows
  /// when made with kEveryWorker. Throws kInvalidArgument for an empty or unordered set,
  /// kFailedPrecondition in the middle of a step; the pacer is then as it was.
  void reshape(Pacer& pacer, std::span<const std::uint32_t> workers) const {
    require_task_set(workers, "worker", "SyncReplicas: ");
    if (pacer.fresh != 0 || !pacer.taken.empty() || !pacer.pushed.empty()) {
      throw Error(ErrorCode::kFailedPrecondition, "SyncReplicas: the workers change between steps only");
    }
    const std::int64_t batch = first_batch(pacer);
    std::vector<std::uint32_t> set(workers.begin(), workers.end());
    pacer.free.reserve(std::max<std::size_t>(set.size(), static_cast<std::size_t>(replicas_to_aggregate_)));
    pacer.workers = std::move(set);
    pacer.base_step = pacer.step;
    pacer.base_batch = batch;
    --pacer.step;  // the step begins again, with the new workers' tokens
    next_step(pacer);
  }

  /// Gives back the tokens of the current step `worker` took and did not push for, with
  /// their numbers; it may take them again (one per step still holds when R <= N).
  void release(Pacer& pacer, std::uint32_t worker) const noexcept {
    const auto held = pacer.held.find(worker);
    if (held == pacer.held.end()) return;
    // `free` has room for every token of the step (reserved in next_step): no allocation.
    for (const std::uint32_t number : held->second) {
      pacer.free.insert(std::lower_bound(pacer.free.begin(), pacer.free.end(), number), number);
    }
    const auto count = static_cast<std::int64_t>(held->second.size());
    const auto taken = pacer.taken.find(worker);
    if (taken != pacer.taken.end() && (taken->second -= count) <= 0) pacer.taken.erase(taken);
    pacer.held.erase(held);
  }

  /// A token of the current step `worker` took and has not pushed for, if it holds one (a
  /// worker pushes for each token before it asks for the next, so asking while holding
  /// one is asking again).
  [[nodiscard]] std::optional<Token> held_token(const Pacer& pacer, std::uint32_t worker) const {
    const auto held = pacer.held.find(worker);
    if (held == pacer.held.end() || held->second.empty() || !pacer.taken.contains(worker)) return std::nullopt;
    return token(pacer, held->second.front());
  }

  /// Steps completed.
  [[nodiscard]] std::int64_t global_step(const Pacer& pacer) const { return pacer.step; }

  /// A token of the current step, if `worker` may take one more (its own number, or the
  /// lowest-numbered left: see above):
  /// when R <= N, one per step, and in a refill step one more at a time while more tokens
  /// are left than live workers still to take their first.
  std::optional<Token> take_token(Pacer& pacer, std::uint32_t worker) const {
    if (pacer.free.empty() || !member(pacer, worker)) return std::nullopt;
    const bool each = one_each(pacer);
    if (each && pacer.forfeited.contains(worker))
      return std::nullopt;  // its next token is the next step's
    if (each && (pacer.taken.contains(worker) || pacer.pushed.contains(worker))) {
      const auto held = pacer.held.find(worker);
      if (!pacer.refill || (held != pacer.held.end() && !held->second.empty())) return std::nullopt;
      std::size_t owed = 0;  // live workers that have not taken their token of the step
      for_each_worker(pacer, [&](std::uint32_t w) {
        if (!pacer.lost.contains(w) && !pacer.taken.contains(w) && !pacer.pushed.contains(w)) ++owed;
      });
      if (pacer.free.size() <= owed) return std::nullopt;
    }
    // Allocations first (an entry in `held` left empty by a throw is as good as none).
    std::vector<std::uint32_t>& held = pacer.held[worker];
    held.reserve(held.size() + 1);
    ++pacer.taken[worker];
    auto number = pacer.free.begin();
    if (each) {  // its own first, so that the numbers do not hang on the order
      const std::uint32_t rank = rank_of(pacer, worker);
      const auto own = std::lower_bound(pacer.free.begin(), pacer.free.end(), rank);
      if (own != pacer.free.end() && *own == rank) number = own;
    }
    held.push_back(*number);
    pacer.free.erase(number);
    return token(pacer, held.back());
  }

  /// "step 12: 1 of 2 gradients in, 0 of 2 tokens left" (of those the step needs: fewer
  /// than R while workers are lost)
  [[nodiscard]] std::string waiting_for(const Pacer& pacer) const {
    return "step " + std::to_string(pacer.step) + ": " + std::to_string(pacer.fresh) + " of " +
           std::to_string(required(pacer)) + " gradients in, " +
           std::to_string(pacer.free.size()) + " of " + std::to_string(tokens_per_step(pacer)) +
           " tokens left" + (pacer.refill ? " (live workers take the lost ones' tokens)" : "");
  }

 private:
  /// A step that stopped waiting for a worker (lost, or its push lost with its process)
  /// completes with the others' fresh gradients once it has the R it needs, or with none
  /// (an empty update) once its pushes were all lost with their workers' processes and no
  /// live worker owes one, as it would in the other order.
  Verdict complete_without(Pacer& pacer) const {
    const bool complete = pacer.fresh == 0 ? !pacer.forfeited.empty() && awaited(pacer).empty()
                                           : pacer.fresh >= required(pacer);
    if (!complete) return Verdict::kPending;
    next_step(pacer);
    return Verdict::kReady;
  }

  /// N: the job's workers now.
  [[nodiscard]] int workers(const Pacer& pacer) const noexcept {
    return pacer.workers.empty() ? total_num_replicas_ : static_cast<int>(pacer.workers.size());
  }
  /// R now: N with kEveryWorker.
  [[nodiscard]] int replicas(const Pacer& pacer) const noexcept {
    return every_worker_ ? workers(pacer) : replicas_to_aggregate_;
  }
  /// True if `worker` is one of the job's workers.
  [[nodiscard]] bool member(const Pacer& pacer, std::uint32_t worker) const noexcept {
    if (pacer.workers.empty()) return worker < static_cast<std::uint32_t>(total_num_replicas_);
    return std::binary_search(pacer.workers.begin(), pacer.workers.end(), worker);
  }
  /// A member's rank among the job's workers (its own token's number).
  [[nodiscard]] static std::uint32_t rank_of(const Pacer& pacer, std::uint32_t worker) noexcept {
    if (pacer.workers.empty()) return worker;
    return static_cast<std::uint32_t>(std::lower_bound(pacer.workers.begin(), pacer.workers.end(), worker) -
                                      pacer.workers.begin());
  }
  /// Calls `f(w)` for each of the job's workers, ascending.
  template <class F>
  void for_each_worker(const Pacer& pacer, F&& f) const {
    if (!pacer.workers.empty()) {
      for (const std::uint32_t w : pacer.workers) f(w);
      return;
    }
    for (std::uint32_t w = 0; w < static_cast<std::uint32_t>(total_num_replicas_); ++w) f(w);
  }

  /// One token per worker per step (R <= N), refill steps aside.
  [[nodiscard]] bool one_each(const Pacer& pacer) const noexcept { return replicas(pacer) <= workers(pacer); }

  /// The batch of token 0 of the step in progress.
  [[nodiscard]] std::int64_t first_batch(const Pacer& pacer) const {
    return pacer.base_batch + (pacer.step - pacer.base_step) * tokens_per_step(pacer);
  }

  /// Token number `number` of the step in progress. With one token per step (and not a
  /// refill step) the worker's next token is of the next global step, so its push can
  /// bring that step's parameters back; otherwise its next token may be of this step.
  [[nodiscard]] Token token(const Pacer& pacer, std::uint32_t number) const {
    const bool next = one_each(pacer) && !pacer.refill;
    return Token{pacer.step, pacer.step, next ? pacer.step + 1 : pacer.step, true,
                 first_batch(pacer) + number, pacer.refill};
  }

  /// Fresh gradients the step in progress needs: R in a refill step (or with R > N), else
  /// R less the lost workers that owe one.
  [[nodiscard]] int required(const Pacer& pacer) const {
    if (!one_each(pacer) || pacer.refill) return replicas(pacer);
    int owing = 0;
    for (const std::uint32_t w : pacer.lost) {
      if (member(pacer, w) && !pacer.pushed.contains(w)) ++owing;
    }
    for (const std::uint32_t w : pacer.forfeited) {
      if (!pacer.lost.contains(w)) ++owing;
    }
    return std::max(1, std::min(replicas(pacer), workers(pacer) - owing));
  }

  /// Moves on to the next step, withdrawing the old step's untaken tokens; it is a refill
  /// step when the live workers are fewer than R.
  void next_step(Pacer& pacer) const {
    ++pacer.step;
    pacer.fresh = 0;
    pacer.free.resize(static_cast<std::size_t>(tokens_per_step(pacer)));  // capacity stays: no throw after the first
    for (std::size_t k = 0; k < pacer.free.size(); ++k) pacer.free[k] = static_cast<std::uint32_t>(k);
    pacer.taken.clear();
    pacer.held.clear();
    pacer.pushed.clear();
    pacer.forfeited.clear();
    judge_refill(pacer);
  }

  /// Whether the step in progress, beginning with the workers lost now, is a refill step.
  void judge_refill(Pacer& pacer) const {
    const auto lost = static_cast<int>(std::count_if(pacer.lost.begin(), pacer.lost.end(), [&](std::uint32_t w) {
      return member(pacer, w);
    }));
    pacer.refill = one_each(pacer) && lost > 0 && workers(pacer) - lost < replicas(pacer);
  }

  [[nodiscard]] std::int64_t tokens_per_step(const Pacer& pacer) const {
    return std::max(replicas(pacer), workers(pacer));
  }

  bool every_worker_;
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
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

// ---- begin pulley/transport/detail/reply_targets.hpp ----

#include <algorithm>
#include <cstddef>
#include <span>

namespace pulley::detail {

/// True if the reply's tensors match `targets` one for one, in number and size.
inline bool fits(Response& reply, std::span<const std::span<float>> targets) {
  std::size_t i = 0;
  bool fit = true;
  for_each_tensor(reply, [&](std::span<const float>& t) {
    fit = fit && i < targets.size() && targets[i].size() == t.size();
    ++i;
  });
  return fit && i == targets.size();
}

/// Points the reply's tensors at `targets`, which hold their values (they were received
/// there).
inline void point_at(Response& reply, std::span<const std::span<float>> targets) {
  std::size_t i = 0;
  for_each_tensor(reply, [&](std::span<const float>& t) { t = targets[i++]; });
}

/// Copies the reply's tensors into the caller's targets (one per tensor, in order) and
/// points the reply's views at them; false, copying nothing, when the reply does not fit.
inline bool copy_into(Response& reply, std::span<const std::span<float>> targets) {
  if (!fits(reply, targets)) return false;
  std::size_t i = 0;
  for_each_tensor(reply, [&](std::span<const float>& t) {
    std::copy(t.begin(), t.end(), targets[i].begin());
    t = targets[i++];
  });
  return true;
}

}  // namespace pulley::detail
// ---- end pulley/transport/detail/reply_targets.hpp ----

namespace pulley {

/// The fabric of an in-process cluster: it owns the ps tasks (any `Service`, typically a
/// ParameterServer) and their request queues, and injects faults. Workers, the chief and
/// the evaluator reach it through `InProcess` endpoints from threads of their own. Requests
/// travel as the same structs the TCP transport encodes, and each ps handles them one at a
/// time, in arrival order, as it handles a socket.
///
/// A request to an idle ps task is handled on the thread that sends it, under the task's
/// lock: no thread hand-off, so a push+pull costs about what its copies cost. A request to
/// a task that is busy (handling another sender's request), slowed down by `delay`, or has
/// requests queued is queued instead, so `call` never blocks on a busy ps and requests from
/// one sender keep their order: the sender handling one takes the queue on after it, else
/// (a slowed task, one whose own thread is at work) the task's own thread serves it. A request that
/// must wait (a token, a step-gated pull) is answered later by whichever thread completes what it
/// waits for.
///
/// Each endpoint holds one "connection" (session) per ps task, as a TCP client does.
///
/// Faults, for tests: `drop_next` loses requests (the caller's deadline fires),
/// `lose_replies` breaks a connection between a request taking effect and its answer,
/// `delay` slows a node down, `restart` serves a fresh ps in place of a killed one, `kill` makes a
/// node fail as a crashed process would: the requests it
/// held and everything sent to or by it afterwards are answered `kUnavailable`, and every
/// ps hears that a killed client left (`Service::disconnected`).
///
/// Lifetimes take care of themselves: the network owns the services it serves and joins
/// their threads before destroying them; an endpoint that outlives the network gets
/// `kUnavailable` answers.
class InProcessNetwork {
 public:
  /// @param num_ps   the number of ps tasks (served with `serve`)
  /// @param joinable ps tasks beyond them that may be served later and join the job
  ///                 (Chief::join): tasks num_ps .. num_ps + joinable - 1, which endpoints
  ///                 reach once they learn of them (`InProcess::add_ps`)
  explicit InProcessNetwork(std::uint32_t num_ps, std::uint32_t joinable = 0)
      : fabric_(std::make_shared<Fabric>(num_ps + joinable)), spec_ps_(num_ps) {}
  InProcessNetwork(const InProcessNetwork&) = delete;
  InProcessNetwork& operator=(const InProcessNetwork&) = delete;

  /// Ends every ps task still serving (their waiting requests fail), joins their threads
  /// and destroys the services.
  ~InProcessNetwork() { fabric_->close(); }

  /// Number of ps tasks, joinable ones included.
  [[nodiscard]] std::uint32_t num_ps() const noexcept { return fabric_->num_ps(); }

  /// Serves ps task `service.task()`, which the network now owns (ask it through its
  /// protocol: GetStats). Requests sent before are handled now.
  template <Service S>
  void serve(S service) {
    fabric_->serve(std::make_unique<HostOf<S>>(std::move(service)));
  }

  /// Waits until every served ps task has stopped (after Shutdown, a failure, or killed).
  void join() { fabric_->join(); }

  /// Loses the next `count` requests sent to ps `ps` (from `from` only, if given).
  void drop_next(std::uint32_t ps, std::size_t count, std::optional<Node> from = {}) {
    fabric_->drop_next(ps, count, from);
  }

  /// Breaks the connection that carries each of the next `count` requests sent to ps `ps`
  /// (from `from` only, if given) once the ps has handled it: the request takes effect and
  /// its answer is lost (the caller gets kUnavailable), the ps hears that connection close
  /// (`Service::disconnected`), and the sender's next request to that ps opens a new one.
  void lose_replies(std::uint32_t ps, std::size_t count, std::optional<Node> from = {}) {
    fabric_->lose_replies(ps, count, from);
  }

  /// Like `lose_replies`, at random: each request sent to ps `ps` (from `from` only, if
  /// given) loses its answer with probability `probability` (0 ends it); `seed` makes the
  /// draws repeatable for a given order of requests.
  void lose_replies_at_random(std::uint32_t ps, double probability, std::uint64_t seed,
                              std::optional<Node> from = {}) {
    fabric_->lose_replies_at_random(ps, probability, seed, from);
  }

  /// Makes `node` slow: a client waits `delay` before each request it sends, a ps before
  /// each request it handles. A zero delay ends the slowdown.
  void delay(Node node, std::chrono::microseconds delay) { fabric_->set_delay(node, delay); }

  /// Kills `node` as a crash would.
  void kill(Node node) { fabric_->kill(node); }

  /// True once `node` was killed.
  [[nodiscard]] bool is_dead(Node node) const { return fabric_->is_dead(node); }

  /// Serves `service` in place of killed ps task `service.task()`, as a process started
  /// again on its address: the old service is destroyed, and the new one (fresh, until the
  /// chief restores it) answers from now on. Throws kFailedPrecondition if that task was
  /// not killed.
  template <Service S>
  void restart(S service) {
    fabric_->restart(std::make_unique<HostOf<S>>(std::move(service)));
  }

 private:
  friend class InProcess;

  /// A served ps task, whatever its Service type.
  struct Host {
    virtual ~Host() = default;
    virtual void handle(Request&& request, Node from, std::uint64_t session,
                        Responder reply) noexcept = 0;
    /// Connection `session` of `node` closed (0: every connection of it).
    virtual void disconnected(Node node, std::uint64_t session) noexcept = 0;
    [[nodiscard]] virtual std::uint32_t task() const = 0;
    [[nodiscard]] virtual bool stopped() const = 0;
  };
  template <Service S>
  struct HostOf final : Host {
    explicit HostOf(S s) : service(std::move(s)) {}
    void handle(Request&& request, Node from, std::uint64_t session,
                Responder reply) noexcept override {
      // Requests come from this process's own clients, which check every tensor before
      // they send anything.
      service.handle(std::move(request), RequestContext{true, from, session}, std::move(reply));
    }
    void disconnected(Node node, std::uint64_t session) noexcept override {
      notify_disconnected(service, node, session);
    }
    [[nodiscard]] std::uint32_t task() const override { return service.task(); }
    [[nodiscard]] bool stopped() const override { return service.stopped(); }
    S service;
  };

  /// One call in flight: where its answer goes. Answered at most once, and not at all
  /// once the caller cancelled (then the targets may be gone).
  struct Call : CallControl {
    PullTargets targets;
    /// Its connection breaks once the ps has handled it (`lose_replies`): the answer
    /// becomes this kUnavailable.
    std::optional<std::string> lost_reply;

    // Defined in impl/in_process_requests.hpp.
    void complete(Response&& response);
  };
  using CallPtr = std::shared_ptr<Call>;

  struct Envelope {
    Request request;
    CallPtr call;
    Node from;
    std::uint64_t session = 0;
  };

  struct Mailbox {
    std::mutex serving;  ///< held while the service handles a request, on whichever thread
    std::mutex mutex;    ///< guards the rest; taken after `serving`
    std::condition_variable wake;
    std::deque<Envelope> queue;       ///< for the task's own thread; no sender skips it
    std::unique_ptr<Host> host;       ///< set by serve()
    std::vector<CallPtr> in_service;  ///< handed to the service; pruned as they are answered
    bool thread_running = false;      ///< the task's own thread serves the queue
    bool combining = false;           ///< a sender serves here (send), and takes the queue on after
    bool stopped = false;             ///< the service stopped: its thread ends once idle
    bool killed = false;
    bool closed = false;  ///< the network is gone
  };

  struct DropRule {
    std::uint32_t ps;
    std::size_t remaining;
    std::optional<Node> from;
  };

  struct RandomLoss {
    std::uint32_t ps;
    double probability;
    std::optional<Node> from;
    std::mt19937_64 rng;
  };

  /// Everything the network and its endpoints share; it outlives both.
  class Fabric {
   public:
    explicit Fabric(std::uint32_t num_ps) {
      for (std::uint32_t i = 0; i < num_ps; ++i) mailboxes_.push_back(std::make_unique<Mailbox>());
    }

    [[nodiscard]] std::uint32_t num_ps() const noexcept {
      return static_cast<std::uint32_t>(mailboxes_.size());
    }

    // A ps task served: its thread and its queue, and the network's close
    // (impl/in_process_serving.hpp).

    void serve(std::unique_ptr<Host> host);

    void join();

    /// The network is going away: everything waiting fails, the threads end, the services
    /// are destroyed; later calls fail.
    void close();

    // Faults injected, and a killed ps task served again (impl/in_process_faults.hpp).

    void drop_next(std::uint32_t ps, std::size_t count, std::optional<Node> from);

    void lose_replies(std::uint32_t ps, std::size_t count, std::optional<Node> from);

    void lose_replies_at_random(std::uint32_t ps, double probability, std::uint64_t seed,
                                std::optional<Node> from);

    /// True if connection `session` was broken by `lose_replies` (its endpoint opens a new
    /// one; what was sent on it and not handled yet is lost).
    bool is_broken(std::uint64_t session) const;

    void set_delay(Node node, std::chrono::microseconds delay);

    void kill(Node node);

    void restart(std::unique_ptr<Host> host);

    [[nodiscard]] bool is_dead(Node node) const;

    /// A session id for a new connection.
    std::uint64_t new_session() noexcept { return next_session_.fetch_add(1) + 1; }

    // A request sent, handed to the service and answered (impl/in_process_requests.hpp).

    PendingCall send(Node from, std::uint64_t session, std::uint32_t ps, Request&& request,
                     PullTargets&& targets);

   private:
    static Response unavailable(const std::string& why) {
      return ErrorReply{ErrorCode::kUnavailable, why};
    }

    // Defined in impl/: gone_reason, fail_held, delay_of, take_reply_loss, take_rule and
    // break_session in in_process_faults.hpp; handle_queued, stop_combining and run in
    // in_process_serving.hpp; handle in in_process_requests.hpp.

    static std::optional<std::string> gone_reason(const Mailbox& box, std::uint32_t ps);

    /// Fails every request the task holds, queued or handed to its service (as a crashed
    /// process's connections would break). The caller holds `box.mutex`.
    static void fail_held(Mailbox& box, const std::string& why);

    /// After a sender handled its request here (`send`, holding `box.serving`): what other
    /// senders queued meanwhile, in order, on this thread rather than the task's own. With
    /// two workers on two cores a hand-off woke a third thread for each request that found
    /// the ps busy (a quarter of an async job's requests) and waited for a core for it.
    /// At most kMaxCombined, so that the sender's own caller is not held up by a busy job's
    /// stream of requests: the task's thread takes the rest (as it does for a slowed task).
    void handle_queued(Mailbox& box, std::uint32_t task);

    /// Ends a sender's turn at the queue (handle_queued) early: the task's thread takes it.
    static void stop_combining(Mailbox& box) noexcept;

    /// Hands one request to the service; the caller holds `box.serving`.
    static void handle(Fabric& fabric, Mailbox& box, std::uint32_t task, Request&& request,
                       Node from, std::uint64_t session, const CallPtr& call);

    /// The task's own thread: serves the queue until the service stops (and the queue is
    /// drained) or the task is killed.
    void run(Mailbox& box, std::uint32_t task);

    std::chrono::microseconds delay_of(Node node) const;

    bool take_drop(std::uint32_t ps, Node from) { return take_rule(drops_, ps, from); }
    bool take_reply_loss(std::uint32_t ps, Node from);

    bool take_rule(std::vector<DropRule>& rules, std::uint32_t ps, Node from);

    void break_session(std::uint64_t session);

    std::vector<std::unique_ptr<Mailbox>> mailboxes_;
    std::mutex threads_mutex_;
    std::vector<std::thread> threads_;
    mutable std::mutex faults_mutex_;
    std::vector<DropRule> drops_;
    std::vector<DropRule> reply_losses_;
    std::vector<RandomLoss> random_losses_;
    std::set<std::uint64_t> broken_;  ///< connections broken by lose_replies
    std::atomic<bool> any_broken_{false};
    std::map<Node, std::chrono::microseconds> delays_;
    std::map<Node, bool> dead_;
    std::vector<CallPtr> lost_;
    std::atomic<std::uint64_t> next_session_{0};
  };

  std::shared_ptr<Fabric> fabric_;
  std::uint32_t spec_ps_;  ///< ps tasks endpoints reach from the start
};

/// A client endpoint on an InProcessNetwork: the in-process `Transport`.
class InProcess {
 public:
  /// @param network the cluster's fabric
  /// @param self    who is calling: the ps tasks check what its job may send, and the fault
  ///                injector acts on it
  InProcess(InProcessNetwork& network, Node self) : fabric_(network.fabric_), self_(self) {
    for (std::uint32_t ps = 0; ps < network.spec_ps_; ++ps) sessions_.push_back(fabric_->new_session());
  }

  /// Number of ps tasks this endpoint reaches: the network's, without the joinable ones
  /// it has not learned of (`add_ps`).
  [[nodiscard]] std::size_t num_ps() const noexcept { return sessions_.size(); }

  /// Reaches the next joinable ps task (task num_ps()); `address` names it in messages
  /// only, and `connect` changes nothing in-process. Throws kFailedPrecondition when the
  /// network has no more.
  void add_ps(const std::string& address, bool /*connect*/ = true) {
    if (sessions_.size() >= fabric_->num_ps()) {
      throw Error(ErrorCode::kFailedPrecondition, "ps at " + address + ": the in-process network has no joinable ps task left");
    }
    sessions_.push_back(fabric_->new_session());
  }

  /// Ps task `ps`'s address in-process: "in-process:" and its index.
  [[nodiscard]] std::string address(std::size_t ps) const { return "in-process:" + std::to_string(ps); }
  /// Who this endpoint speaks for.
  [[nodiscard]] Node self() const noexcept { return self_; }

  /// Sends `request` to ps `ps`; see the Transport concept for the contract.
  PendingCall call(std::size_t ps, Request&& request, PullTargets targets = {}) {
    std::uint64_t session = 0;
    if (ps < sessions_.size()) {
      if (fabric_->is_broken(sessions_[ps])) sessions_[ps] = fabric_->new_session();  // reconnects
      session = sessions_[ps];
    }
    return fabric_->send(self_, session, static_cast<std::uint32_t>(ps), std::move(request), std::move(targets));
  }

 private:
  std::shared_ptr<InProcessNetwork::Fabric> fabric_;
  Node self_;
  std::vector<std::uint64_t> sessions_;  ///< by ps: this endpoint's connection to it
};
static_assert(GrowingTransport<InProcess>);

}  // namespace pulley

// InProcessNetwork's member functions' definitions, by concern.
// ---- begin pulley/transport/impl/in_process_faults.hpp ----

/// InProcessNetwork's faults and failures (declared in transport/in_process.hpp, which
/// includes this header after the class): requests dropped, replies lost (counted or at
/// random) and the connections they break, delays, kills, a killed ps task served again,
/// and what a task gone answers.

namespace pulley {

inline void InProcessNetwork::Fabric::drop_next(std::uint32_t ps, std::size_t count,
                                                std::optional<Node> from) {
  std::scoped_lock lock(faults_mutex_);
  drops_.push_back({ps, count, from});
}

inline void InProcessNetwork::Fabric::lose_replies(std::uint32_t ps, std::size_t count,
                                                   std::optional<Node> from) {
  std::scoped_lock lock(faults_mutex_);
  reply_losses_.push_back({ps, count, from});
}

inline void InProcessNetwork::Fabric::lose_replies_at_random(std::uint32_t ps, double probability,
                                                             std::uint64_t seed,
                                                             std::optional<Node> from) {
  std::scoped_lock lock(faults_mutex_);
  std::erase_if(random_losses_, [&](const RandomLoss& r) { return r.ps == ps && r.from == from; });
  if (probability > 0.0) random_losses_.push_back({ps, probability, from, std::mt19937_64(seed)});
}

inline bool InProcessNetwork::Fabric::is_broken(std::uint64_t session) const {
  if (!any_broken_.load(std::memory_order_acquire)) return false;
  std::scoped_lock lock(faults_mutex_);
  return broken_.contains(session);
}

inline void InProcessNetwork::Fabric::set_delay(Node node, std::chrono::microseconds delay) {
  std::scoped_lock lock(faults_mutex_);
  delays_[node] = delay;
}

inline void InProcessNetwork::Fabric::kill(Node node) {
  {
    std::scoped_lock lock(faults_mutex_);
    dead_[node] = true;
  }
  if (node.role != Node::Role::kPs) {
    // Its connections break: what it sent and no ps handled yet is lost, and every ps
    // hears that it left, as a TCP ps would. (handle() refuses what slips past.)
    for (auto& box : mailboxes_) {
      std::scoped_lock lock(box->serving, box->mutex);
      std::erase_if(box->queue, [&](Envelope& e) {
        if (e.from != node) return false;
        e.call->complete(unavailable(node.name() + " is unavailable (killed)"));
        return true;
      });
      if (box->host && !box->closed) box->host->disconnected(node, 0);
    }
    return;
  }
  if (node.index >= num_ps()) return;
  Mailbox& box = *mailboxes_[node.index];
  std::scoped_lock lock(box.mutex);
  box.killed = true;
  fail_held(box, node.name() + " is unavailable (killed)");
  box.wake.notify_all();
}

inline void InProcessNetwork::Fabric::restart(std::unique_ptr<Host> host) {
  const std::uint32_t task = host->task();
  if (task >= num_ps() || !is_dead(Node::ps(task))) {
    throw Error(ErrorCode::kFailedPrecondition,
                "ps task " + std::to_string(task) + " was not killed: nothing to restart");
  }
  Mailbox& box = *mailboxes_[task];
  for (;;) {  // the killed task's thread sees the kill and ends
    std::scoped_lock lock(box.mutex);
    if (!box.thread_running) break;
    box.wake.notify_all();
    std::this_thread::yield();
  }
  std::unique_ptr<Host> old;
  {
    std::scoped_lock lock(box.serving, box.mutex);
    if (box.closed) return;
    old = std::exchange(box.host, std::move(host));
    box.killed = false;
    box.stopped = false;
    box.thread_running = true;
  }
  {
    std::scoped_lock lock(faults_mutex_);
    dead_[Node::ps(task)] = false;
  }
  std::scoped_lock lock(threads_mutex_);
  threads_.emplace_back([this, &box, task] { run(box, task); });
}

inline bool InProcessNetwork::Fabric::is_dead(Node node) const {
  std::scoped_lock lock(faults_mutex_);
  auto it = dead_.find(node);
  return it != dead_.end() && it->second;
}

inline std::optional<std::string> InProcessNetwork::Fabric::gone_reason(const Mailbox& box,
                                                                        std::uint32_t ps) {
  if (box.closed) return "the in-process network was shut down";
  if (box.killed) return Node::ps(ps).name() + " is unavailable (killed)";
  return std::nullopt;
}

inline void InProcessNetwork::Fabric::fail_held(Mailbox& box, const std::string& why) {
  for (Envelope& e : std::exchange(box.queue, {})) e.call->complete(unavailable(why));
  for (const CallPtr& c : std::exchange(box.in_service, {})) c->complete(unavailable(why));
}

inline std::chrono::microseconds InProcessNetwork::Fabric::delay_of(Node node) const {
  std::scoped_lock lock(faults_mutex_);
  auto it = delays_.find(node);
  return it == delays_.end() ? std::chrono::microseconds{0} : it->second;
}

inline bool InProcessNetwork::Fabric::take_reply_loss(std::uint32_t ps, Node from) {
  if (take_rule(reply_losses_, ps, from)) return true;
  std::scoped_lock lock(faults_mutex_);
  for (RandomLoss& r : random_losses_) {
    if (r.ps == ps && (!r.from || *r.from == from) &&
        std::uniform_real_distribution<double>(0.0, 1.0)(r.rng) < r.probability) {
      return true;
    }
  }
  return false;
}

inline bool InProcessNetwork::Fabric::take_rule(std::vector<DropRule>& rules, std::uint32_t ps,
                                                Node from) {
  std::scoped_lock lock(faults_mutex_);
  for (DropRule& rule : rules) {
    if (rule.ps == ps && rule.remaining > 0 && (!rule.from || *rule.from == from)) {
      --rule.remaining;
      std::erase_if(rules, [](const DropRule& r) { return r.remaining == 0; });
      return true;
    }
  }
  return false;
}

inline void InProcessNetwork::Fabric::break_session(std::uint64_t session) {
  std::scoped_lock lock(faults_mutex_);
  broken_.insert(session);
  any_broken_.store(true, std::memory_order_release);
}

}  // namespace pulley
// ---- end pulley/transport/impl/in_process_faults.hpp ----
// ---- begin pulley/transport/impl/in_process_requests.hpp ----

/// InProcessNetwork's requests (declared in transport/in_process.hpp, which includes this
/// header after the class): a request sent, on the sender's thread when the ps task is
/// idle or queued for it when not, handed to the service, and its answer copied into the
/// caller's targets (or lost, when its connection breaks).

namespace pulley {

inline void InProcessNetwork::Call::complete(Response&& response) {
  unless_cancelled([&] {
    if (has_answer()) return;
    if (lost_reply) response = ErrorReply{ErrorCode::kUnavailable, *lost_reply};
    if (!std::holds_alternative<ErrorReply>(response) && !detail::copy_into(response, targets)) {
      response = ErrorReply{ErrorCode::kInvalidArgument, "reply does not fit its targets"};
    }
    answer(std::move(response));
  });
}

inline PendingCall InProcessNetwork::Fabric::send(Node from, std::uint64_t session,
                                                  std::uint32_t ps, Request&& request,
                                                  PullTargets&& targets) {
  auto call = std::make_shared<Call>();
  call->targets = std::move(targets);
  PendingCall pending(call);
  if (ps >= num_ps()) {
    call->complete(ErrorReply{ErrorCode::kInvalidArgument,
                              "no ps task " + std::to_string(ps) + " in this cluster"});
    return pending;
  }
  if (is_dead(from)) {
    call->complete(unavailable(from.name() + " is unavailable (killed)"));
    return pending;
  }
  if (auto d = delay_of(from); d.count() > 0) std::this_thread::sleep_for(d);
  if (take_drop(ps, from)) {
    std::scoped_lock lock(faults_mutex_);
    lost_.push_back(std::move(call));  // never answered; the caller's deadline fires
    return pending;
  }
  if (take_reply_loss(ps, from)) {
    call->lost_reply =
        "the connection to " + Node::ps(ps).name() + " was lost before its answer came";
  }
  Mailbox& box = *mailboxes_[ps];
  std::unique_lock serving(box.serving, std::try_to_lock);
  bool idle = false;
  {
    std::scoped_lock lock(box.mutex);
    if (const auto gone = gone_reason(box, ps)) {
      call->complete(unavailable(*gone));
      return pending;
    }
    idle =
        serving.owns_lock() && box.host && box.queue.empty() && delay_of(Node::ps(ps)).count() == 0;
    if (!idle && (box.thread_running || !box.host)) {
      box.queue.push_back({std::move(request), std::move(call), from, session});
      if (!box.combining) box.wake.notify_one();  // (else the sender serving takes it)
      return pending;
    }
    if (idle) box.combining = true;
  }
  // Idle, or stopped with no thread left: handled here (a stopped service answers at
  // once, so waiting for another sender's turn is short).
  if (!serving.owns_lock()) serving.lock();
  try {
    handle(*this, box, ps, std::move(request), from, session, call);
    if (idle) handle_queued(box, ps);
  } catch (...) {  // (an allocation failed): what is queued goes to the task's thread
    if (idle) stop_combining(box);
    throw;
  }
  return pending;
}

inline void InProcessNetwork::Fabric::handle(Fabric& fabric, Mailbox& box, std::uint32_t task,
                                             Request&& request, Node from, std::uint64_t session,
                                             const CallPtr& call) {
  {
    std::scoped_lock lock(box.mutex);
    if (const auto gone = gone_reason(box, task)) {
      call->complete(unavailable(*gone));
      return;
    }
    if (fabric.is_dead(from)) {  // killed after it sent this: a dead process sends nothing
      call->complete(unavailable(from.name() + " is unavailable (killed)"));
      return;
    }
    if (fabric.is_broken(session)) {  // sent on a connection that broke before its turn
      call->complete(unavailable("the connection to " + Node::ps(task).name() + " was lost"));
      return;
    }
    std::erase_if(box.in_service, [](const CallPtr& c) { return c->has_answer(); });
    box.in_service.push_back(call);
  }
  // One use while the service reads the request's views: a caller that gives up waits
  // for it.
  call->unless_cancelled([&] {
    box.host->handle(std::move(request), from, session,
                     [call](Response&& r) { call->complete(std::move(r)); });
  });
  if (call->lost_reply) {  // its connection breaks now: the caller and the ps hear it
    fabric.break_session(session);
    call->complete(ErrorReply{ErrorCode::kUnavailable, *call->lost_reply});
    box.host->disconnected(from, session);
  }
  if (box.host->stopped()) {
    std::scoped_lock lock(box.mutex);
    box.stopped = true;
    box.wake.notify_all();
  }
}

}  // namespace pulley
// ---- end pulley/transport/impl/in_process_requests.hpp ----
// ---- begin pulley/transport/impl/in_process_serving.hpp ----

/// InProcessNetwork's ps tasks served (declared in transport/in_process.hpp, which includes
/// this header after the class): a service taken on and its thread started, the queue served
/// by that thread or by a sender that found the task idle, the threads joined, and the
/// network's close.

namespace pulley {

inline void InProcessNetwork::Fabric::serve(std::unique_ptr<Host> host) {
  const std::uint32_t task = host->task();
  if (task >= num_ps()) {
    throw Error(ErrorCode::kInvalidArgument, "no ps task " + std::to_string(task) + " here");
  }
  Mailbox& box = *mailboxes_[task];
  {
    std::scoped_lock lock(box.serving, box.mutex);
    if (box.host) {
      throw Error(ErrorCode::kAlreadyExists,
                  "ps task " + std::to_string(task) + " is served already");
    }
    if (box.closed) return;
    box.host = std::move(host);
    box.thread_running = true;
  }
  std::scoped_lock lock(threads_mutex_);
  threads_.emplace_back([this, &box, task] { run(box, task); });
}

inline void InProcessNetwork::Fabric::join() {
  std::vector<std::thread> threads;
  {
    std::scoped_lock lock(threads_mutex_);
    threads.swap(threads_);
  }
  for (std::thread& t : threads) t.join();
}

inline void InProcessNetwork::Fabric::close() {
  for (auto& box : mailboxes_) {
    std::scoped_lock lock(box->mutex);
    box->closed = true;
    fail_held(*box, "the in-process network was shut down");
    box->wake.notify_all();
  }
  join();
  for (auto& box : mailboxes_) {
    std::scoped_lock serving(box->serving);
    box->host.reset();
  }
}

inline void InProcessNetwork::Fabric::handle_queued(Mailbox& box, std::uint32_t task) {
  constexpr int kMaxCombined = 8;
  for (int handled = 0;; ++handled) {
    Envelope next;
    {
      std::scoped_lock lock(box.mutex);
      if (box.queue.empty() || box.killed || box.closed || handled == kMaxCombined ||
          delay_of(Node::ps(task)).count() > 0) {
        box.combining = false;
        if (!box.queue.empty()) box.wake.notify_one();
        return;
      }
      next = std::move(box.queue.front());
      box.queue.pop_front();
    }
    handle(*this, box, task, std::move(next.request), next.from, next.session, next.call);
  }
}

inline void InProcessNetwork::Fabric::stop_combining(Mailbox& box) noexcept {
  std::scoped_lock lock(box.mutex);
  box.combining = false;
  box.wake.notify_one();
}

inline void InProcessNetwork::Fabric::run(Mailbox& box, std::uint32_t task) {
  for (;;) {
    {
      std::unique_lock lock(box.mutex);
      box.wake.wait(lock,
                    [&] { return box.killed || box.closed || box.stopped || !box.queue.empty(); });
      if (box.killed || box.closed || box.queue.empty()) {
        box.thread_running = false;
        return;
      }
    }
    if (auto d = delay_of(Node::ps(task)); d.count() > 0) std::this_thread::sleep_for(d);
    std::scoped_lock serving(box.serving);
    Envelope envelope;
    {
      std::scoped_lock lock(box.mutex);
      if (box.queue.empty()) continue;
      envelope = std::move(box.queue.front());
      box.queue.pop_front();
    }
    handle(*this, box, task, std::move(envelope.request), envelope.from, envelope.session,
           envelope.call);
  }
}

}  // namespace pulley
// ---- end pulley/transport/impl/in_process_serving.hpp ----
// ---- end pulley/transport/in_process.hpp ----
// ---- begin pulley/transport/in_process_ring.hpp ----

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

namespace pulley {

/// A Ring among threads of one process: `InProcessRing::make(n)` gives the n links, one for
/// each thread. A send copies the caller's bytes into a buffer the link recycles, so a rank
/// that fails and drops its tensors leaves nothing its neighbour could read after them; the
/// next rank's receive copies out, and `flush` waits until it has taken everything. A link
/// destroyed (or `leave`d) counts as a lost worker, as a process that dies closes its
/// sockets: its neighbours' waits fail with kUnavailable naming it.
class InProcessRing {
 public:
  /// The links of a ring of `n` ranks (n ≥ 1); a wait for a neighbour gives up after
  /// `timeout` with kDeadlineExceeded.
  static std::vector<InProcessRing> make(std::size_t n,
                                         std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
    if (n == 0) throw Error(ErrorCode::kInvalidArgument, "a ring needs at least one rank");
    auto hub = std::make_shared<Hub>(n, timeout);
    std::vector<InProcessRing> ring;
    ring.reserve(n);
    for (std::size_t r = 0; r < n; ++r) ring.push_back(InProcessRing(hub, r));
    return ring;
  }

  InProcessRing(InProcessRing&&) noexcept = default;
  InProcessRing& operator=(InProcessRing&& other) noexcept {
    if (this != &other) {
      leave();
      hub_ = std::move(other.hub_);
      rank_ = other.rank_;
    }
    return *this;
  }
  InProcessRing(const InProcessRing&) = delete;
  InProcessRing& operator=(const InProcessRing&) = delete;
  ~InProcessRing() { leave(); }

  [[nodiscard]] std::size_t rank() const noexcept { return rank_; }
  [[nodiscard]] std::size_t size() const noexcept { return hub_ ? hub_->links.size() : 0; }

  void send(std::span<const std::byte> bytes) {
    Link& out = hub_->links[rank_];
    std::lock_guard lock(out.mutex);
    if (out.closed) throw lost(next());
    if (bytes.empty()) return;
    std::vector<std::byte> copy;
    if (!out.spare.empty()) {
      copy = std::move(out.spare.back());
      out.spare.pop_back();
    }
    copy.assign(bytes.begin(), bytes.end());
    out.queued.push_back(std::move(copy));
    out.changed.notify_all();
  }

  void receive(std::span<std::byte> bytes) {
    Link& in = hub_->links[previous()];
    while (!bytes.empty()) {
      std::span<const std::byte> front;
      {
        std::unique_lock lock(in.mutex);
        wait(in, lock, [&] { return in.closed || !in.queued.empty(); }, previous(), "send");
        if (in.queued.empty()) throw lost(previous());
        front = std::span<const std::byte>(in.queued.front()).subspan(in.offset);
      }
      // Copied outside the lock: only this rank takes from the front of its incoming link.
      const std::size_t n = std::min(front.size(), bytes.size());
      std::memcpy(bytes.data(), front.data(), n);
      bytes = bytes.subspan(n);
      std::lock_guard lock(in.mutex);
      in.offset += n;
      if (in.offset == in.queued.front().size()) {
        in.spare.push_back(std::move(in.queued.front()));
        in.queued.pop_front();
        in.offset = 0;
        in.changed.notify_all();
      }
    }
  }

  void flush() {
    Link& out = hub_->links[rank_];
    std::unique_lock lock(out.mutex);
    wait(out, lock, [&] { return out.closed || out.queued.empty(); }, next(), "receive");
    if (!out.queued.empty()) throw lost(next());
  }

  /// Leaves the ring as a lost worker does: both neighbours' waits on it fail. The link is
  /// unusable afterwards (the destructor does this too).
  void leave() noexcept {
    if (!hub_) return;
    for (Link* link : {&hub_->links[rank_], &hub_->links[previous()]}) {
      std::lock_guard lock(link->mutex);
      link->closed = true;  // what it sent stays readable, as bytes in a socket's buffer do
      link->changed.notify_all();
    }
    hub_.reset();
  }

 private:
  /// The bytes one rank sent the next and the next has not taken yet.
  struct Link {
    std::mutex mutex;
    std::condition_variable changed;
    std::deque<std::vector<std::byte>> queued;
    std::vector<std::vector<std::byte>> spare;  ///< taken buffers, for the next sends
    std::size_t offset = 0;  ///< bytes of queued.front() taken
    bool closed = false;     ///< one of its ends left
  };
  struct Hub {
    Hub(std::size_t n, std::chrono::milliseconds t) : links(n), timeout(t) {}
    std::vector<Link> links;  ///< links[r]: from rank r to rank r + 1
    std::chrono::milliseconds timeout;
  };

  InProcessRing(std::shared_ptr<Hub> hub, std::size_t rank) : hub_(std::move(hub)), rank_(rank) {}

  [[nodiscard]] std::size_t next() const noexcept { return (rank_ + 1) % size(); }
  [[nodiscard]] std::size_t previous() const noexcept { return (rank_ + size() - 1) % size(); }

  template <class Ready>
  void wait(Link& link, std::unique_lock<std::mutex>& lock, Ready ready, std::size_t peer, const char* what) const {
    if (!link.changed.wait_for(lock, hub_->timeout, ready)) {
      throw Error(ErrorCode::kDeadlineExceeded,
                  "ring: rank " + std::to_string(rank_) + " waited " + std::to_string(hub_->timeout.count()) +
                      " ms for rank " + std::to_string(peer) + " to " + what);
    }
  }

  [[nodiscard]] Error lost(std::size_t peer) const {
    return Error(ErrorCode::kUnavailable,
                 "ring: rank " + std::to_string(rank_) + " lost its neighbour, rank " + std::to_string(peer));
  }

  std::shared_ptr<Hub> hub_;
  std::size_t rank_ = 0;
};

static_assert(Ring<InProcessRing>);

}  // namespace pulley
// ---- end pulley/transport/in_process_ring.hpp ----
// ---- end pulley/pulley.hpp ----
