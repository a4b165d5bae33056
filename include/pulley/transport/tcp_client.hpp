// SPDX-License-Identifier: MIT
#pragma once

#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <asio.hpp>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <deque>
#include <future>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "pulley/concepts/transport.hpp"
#include "pulley/core/address.hpp"
#include "pulley/core/log.hpp"
#include "pulley/core/node.hpp"
#include "pulley/protocol/call.hpp"
#include "pulley/transport/detail/copies.hpp"
#include "pulley/transport/detail/reply_targets.hpp"
#include "pulley/transport/detail/shared_rings.hpp"
#include "pulley/transport/detail/sockets.hpp"
#include "pulley/transport/tcp_options.hpp"
#include "pulley/transport/wire/codec.hpp"
#include "pulley/transport/wire/frame_reader.hpp"
#include "pulley/transport/wire/handshake.hpp"

namespace pulley {

/// The TCP `Transport`: one connection per ps task. Tensors are gather-written from the
/// caller's own buffers, and a reply's tensors are received straight into the call's
/// targets.
///
/// It has no thread of its own: its I/O runs on the caller's thread while the caller waits
/// on a PendingCall (the client waits right after sending). Requests made before a wait
/// leave together when it begins, one gather-write per ps (a push and its pull in one), to
/// every ps at once; replies are read as they arrive, several per receive when small. A
/// round trip thus costs the network's two wake-ups and no thread hand-off. The price: a
/// Tcp and its PendingCalls are used from one thread at a time, and a transfer moves only
/// while that thread waits.
///
/// Every connection opens with the handshake: the client proves its job, its task and the
/// job's secret, and the ps proves the same back, naming its task index. A ps of another
/// job, one that cannot prove the secret, or one listed at the wrong index is refused at
/// once with a message that says so (kUnauthenticated), and so is this client by a ps that
/// refuses it; neither is retried while the transport is made. A refusal for now (its task
/// is another live process's: TcpServerOptions::takeover_after) is retried as an
/// unreachable ps is, within `connect_timeout`, then fails kUnavailable. A worker beyond
/// the cluster spec's, refused by an address that let it in before, fails its calls with
/// kUnavailable too (the caller waits as for a lost ps): a ps started again in a lost one's
/// place knows the spec's workers only until the chief restores it.
///
/// A lost connection fails the calls waiting on it with kUnavailable (whether a request in
/// flight was handled is then unknown). The next call to that ps reconnects first (one
/// attempt, `attempt_timeout`), so a ps that restarts on the same address is reached
/// again; a restarted ps has lost its state and says so (kFailedPrecondition) until the
/// chief initializes it anew. A caller that gives up on a call in the middle of its
/// transfer (its deadline passed while a stalled peer was not reading) closes that
/// connection, the only way to stop a transfer half done.
///
/// With `TcpOptions::replicas` = 1 (a job whose ps tasks hold copies: ps/shard_copies.hpp)
/// it also connects to the copy of ps k's shard that the next member of the job holds
/// (copy_holder: ps (k + 1) mod P while every ps is a member; `place_copies` moves it when
/// the membership changes), and `call(k)` reaches shard k wherever it is whole:
///   - what changes a shard (Register, Initialize, Push, a worker's PullRows, Pause,
///     Resume, Restore, RestoreRows, Shutdown) goes to both copies and is
///     answered once both have answered: the answer of the copy it reads from (a row pull
///     reaches the other copy as `PullRows::touch_only`: it creates and touches the rows
///     and sends none back; a Shutdown one copy answers with training's end while the
///     other was not reached is answered kUnavailable, so that the chief sends it again);
///   - reads (TakeToken, Pull, GetStats, ReadState, ReadRows, the chief's row reads) and
///     heartbeats (a ps process hands them to both copies it holds) go to the copy it
///     reads from: ps k's own unless that one was dropped, so every task reads tokens from
///     the same pacer. A Pull that waits for a step also asks the other copy to
///     say when it completed that step (no values), so that no worker pushes for the next
///     step before both copies took this one's pushes. WaitReady goes to both and is
///     answered once both are ready, so that no push reaches a copy the chief has not
///     initialized yet: by ps k's own copy, or by the one left when the other is lost,
///     refuses, or is still not ready `copy_grace` after the first was (then it is dropped);
///   - a copy is dropped (given up), with one log line, when it is lost
///     for sure: its address refuses connections after it was reached (no process listens
///     there), another process answers there (wire::Welcome::server: one started in a lost
///     one's place holds nothing), it stays out of reach for `copy_timeout`, or it is still
///     not ready `copy_grace` after the other copy was. Calls waiting for it go to the
///     other copy; a connection that merely broke is reconnected as without copies (the
///     caller sends again, and each copy counts a push once). The last copy of a shard is
///     never dropped: it is waited for as a ps without copies is. A copy that refuses what
///     the other took is not dropped either: the answer of the copy read from stands;
///   - a dropped copy serves again once the chief gave a process started in the lost one's
///     place its shards back (Chief::take_back, at a newer membership): every task that
///     learns that membership reaches it again (`renew_copies`: `reach_again`, which takes
///     only a new process, and `serve_again`) before its first request of the new epoch.
/// Whether a process that refuses connections, or stays out of reach for `copy_timeout`, is
/// lost is ruled by `TcpOptions::copy_referee` when it is set (the role runner's chief):
/// the task drops its copies when told to, and until then waits for it as for a ps without
/// copies, so that a task cut off from a ps the rest of the job reaches (a partition) gives
/// up nothing that the others still write to. Without a referee each task decides alone,
/// and a ps cut off from some tasks for `copy_timeout` is dropped by those tasks only.
class Tcp {
 public:
  /// Connects task `self` to every ps ("host:port", by task index), retrying with backoff
  /// while they start; throws kInvalidArgument for a malformed address (`parse_address`) or
  /// job name, kUnavailable naming the first address that stays unreachable, and
  /// kUnauthenticated when a ps and this task do not belong to the same job (or secret).
  /// With `reach_now`, it connects now to those ps tasks only (task indices: the job's
  /// members, when some ps task left the job); the others are reached at their first call,
  /// as after a broken connection (ps tasks the job has known, which may be gone since).
  Tcp(Node self, const std::vector<std::string>& ps_addresses, TcpOptions options = {},
      std::optional<std::span<const std::uint32_t>> reach_now = std::nullopt)
      : impl_(std::make_unique<Impl>(self, parse_all(ps_addresses), std::move(options), reach_now)) {}
  /// The same with parsed addresses.
  Tcp(Node self, std::vector<Address> ps_addresses, TcpOptions options = {})
      : impl_(std::make_unique<Impl>(self, std::move(ps_addresses), std::move(options))) {}

  /// Number of ps tasks.
  [[nodiscard]] std::size_t num_ps() const noexcept { return impl_->num_ps(); }

  /// Sends `request` to ps `ps`; see the Transport concept for the contract.
  PendingCall call(std::size_t ps, Request&& request, PullTargets targets = {}) {
    return impl_->call(ps, std::move(request), std::move(targets));
  }

  /// Reaches one more ps task, at `address`, as task num_ps() (a ps that joined the job:
  /// Chief::join). With `connect`, connects to it now as the constructor does, and throws
  /// as it does (the transport is unchanged then); else it connects at its first call, as
  /// after a broken connection (a ps the job has known, which may be gone since). With
  /// `TcpOptions::replicas` it is no member until `place_copies` names it: its shard has
  /// no copy until then.
  void add_ps(const std::string& address, bool connect = true) { impl_->add_ps(parse_address(address), connect); }

  /// Places the copies of the shards for the job's ps tasks `members` (ascending, at least
  /// 2; with `TcpOptions::replicas`, else nothing changes): member k's copy is on the next
  /// member (copy_holder), as the ps tasks place them once the chief registered the model
  /// over those members; the shard of a ps that is no member is reached at that ps alone.
  /// A copy that moved is reached at its new ps from its next call on: what waited on the
  /// old connection fails with kUnavailable (the caller sends again). Every task does this
  /// when it learns a new membership (Client), before its first request at it.
  void place_copies(std::span<const std::uint32_t> members) { impl_->place_copies(members); }

  /// The member ps tasks (place_copies; every ps task until then) some of whose copies this
  /// transport gave up (lost for good), ascending; none without `TcpOptions::replicas`. See
  /// CopyingTransport.
  [[nodiscard]] std::vector<std::uint32_t> given_up() const { return impl_->given_up(); }
  /// False when the last WaitReady of some shard was answered by one copy while the other
  /// was out of reach, and that copy is still not given up: the shard reads, but a write
  /// waits for it (a task cut off from a process the chief still reaches). True without
  /// copies. A Worker counts the ps tasks as back after a failure only when this holds
  /// (detail::Recovery::answered).
  [[nodiscard]] bool copies_whole() const { return impl_->copies_whole(); }
  /// Once a copy of ps `ps` was given up, connects anew to every copy it holds (those not
  /// given up yet are given up first, but the last copy of a shard): true once each reached
  /// one process other than the one given up (started in its place), with the copies served
  /// again at once when `serve`, else left given up until serve_again(ps). False, with
  /// them given up, when one is not reached (in one attempt of `attempt_timeout`; with
  /// `serve`, within `copy_grace` unless its address refuses), refuses this task, or is the
  /// process given up (alive but cut off: its state is old). With `serve` a copy not
  /// reached is served all the same (the chief reached it: this task may be cut off), unless
  /// `unreached_too` is false: then only the copies reached serve again (a task that learns
  /// the job's membership for the first time, whose copies were given up at that very
  /// membership). See CopyingTransport.
  bool reach_again(std::uint32_t ps, bool serve, bool unreached_too) {
    return impl_->reach_again(ps, serve, unreached_too);
  }
  /// The given-up copies of `ps` serve their shards again: what changes a shard goes to both
  /// copies from now on, and ps k's own copy is read from again. Logged once per copy.
  void serve_again(std::uint32_t ps) { impl_->serve_again(ps); }
  /// Gives every copy that ps `ps` holds up again (`why` is logged), unless it is the last
  /// copy of its shard.
  void give_up(std::uint32_t ps, const std::string& why) { impl_->give_up(ps, why); }

  /// Ps task `ps`'s address, "host:port".
  [[nodiscard]] std::string address(std::size_t ps) const { return impl_->address(ps); }
  /// True if this task's connection to ps `ps` (to its own copy, with replicas) is through
  /// the ps's local socket (TcpOptions::local_sockets), false over TCP or not connected.
  [[nodiscard]] bool local(std::size_t ps) const { return impl_->local(ps); }
  /// True if that connection moves its bytes through memory shared with the ps
  /// (TcpOptions::shared_memory), false on a socket's bytes or not connected.
  [[nodiscard]] bool shared_memory(std::size_t ps) const { return impl_->shared_memory(ps); }

 private:
  static std::vector<Address> parse_all(const std::vector<std::string>& addresses) {
    std::vector<Address> parsed;
    for (const std::string& a : addresses) parsed.push_back(parse_address(a));
    return parsed;
  }

  struct Pair;

  /// One call on one connection: what the caller shares with the transport, and the frame
  /// to send. Half of a call sent to both copies of a shard (`pair`) shares the caller's
  /// control, the Pair: its uses of the caller's buffers are the Pair's, and its answer
  /// goes to the Pair.
  struct Pending : CallControl {
    Pending(CallDriver* driver, std::size_t link_index) : CallControl(driver), ps(link_index) {}
    std::size_t ps;               ///< the link it is on
    PullTargets targets;
    wire::Frame frame;            ///< its payload views alias the caller's tensors
    std::uint64_t frame_end = 0;  ///< where its frame ends in the link's write list
    bool writing = false;         ///< in the write list, not all written: one use
    bool sent = false;            ///< its frame is written whole: a reply may come
    std::shared_ptr<Pair> pair;   ///< the call it is half of, or null
    std::size_t half = 0;         ///< 0: to the copy read from (with the targets), 1: the other
    bool is_pair = false;         ///< it is a Pair
    bool parked_once = false;     ///< replicas: it waited once for a lost connection's copy
    /// Whose uses of the caller's buffers these are.
    CallControl& use() noexcept { return pair ? static_cast<CallControl&>(*pair) : *this; }
  };
  using PendingPtr = std::shared_ptr<Pending>;

  /// A call sent to both copies of a shard: the caller's control, on no connection itself.
  struct Pair : Pending {
    Pair(CallDriver* driver, std::size_t shard_index, bool ready_both)
        : Pending(driver, 0), shard(shard_index), both_ready(ready_both) {
      is_pair = true;
    }
    std::size_t shard;
    bool both_ready;  ///< WaitReady: answered once both copies are ready (`copy_grace`)
    bool followed = false;  ///< both_ready: answered by the newer membership (settle_ready)
    std::array<std::weak_ptr<Pending>, 2> halves;
    std::array<std::size_t, 2> links{};            ///< the link of each half
    std::array<std::optional<Response>, 2> answers;
    std::array<bool, 2> waited{};                  ///< a half's connection was tried again once
    bool other_partial = false;  ///< the other copy's answer lacks what the caller asked (a gate, tensors unread)
    bool refusal_stands = false;  ///< ChangeWorkers: a refusal by one copy is the answer
    /// Shutdown: a copy the call may not have reached (kUnavailable) is the answer when the
    /// other says training ended: the chief sends it again until both have it.
    bool unreached_stands = false;
    std::unique_ptr<asio::steady_timer> grace;     ///< both_ready: the laggard's time
  };

  enum class State { kConnected, kConnecting, kHandshaking, kBroken };

  /// One connection. Every handler captures the `generation` it was started in and ignores
  /// its completion once the connection was replaced.
  struct Link {
    Link(asio::io_context& io, Address where, const wire::FrameLimits& limits, std::uint32_t ps_task,
         std::uint32_t shard_asked)
        : task(ps_task),
          shard(shard_asked),
          address(where.to_string()),
          host(std::move(where.host)),
          port(std::to_string(where.port)),
          socket(io),
          resolver(io),
          timer(io),
          reader(limits) {}

    std::uint32_t task;   ///< the ps it reaches, as its challenge must name it
    std::uint32_t shard;  ///< the shard it asks for (wire::Hello::shard)
    bool ever_connected = false;  ///< a handshake completed once
    bool dropped = false;         ///< a copy given up (replicas), until served again
    bool renewing = false;        ///< reach_again's attempt: a new process is what it looks for
    bool renewed = false;         ///< given up, and reached again in a new process (not served yet)
    /// Replicas: calls whose connection broke, waiting for the attempt to reach the copy
    /// again (`parked`, then `parked_next` for the attempt after it): dropped, the other
    /// copy takes them; reached, they fail kUnavailable as without copies.
    std::vector<PendingPtr> parked, parked_next;
    std::vector<std::weak_ptr<Pair>> awaiting;  ///< Pairs that wait for that attempt too
    std::uint64_t server = 0;  ///< the ps process it reached (wire::Welcome::server), 0: none yet
    /// The process it was given up for losing (its `server` then), 0: none, or one given up
    /// only for not being ready yet (it may be the one the chief takes back): reach_again
    /// takes any process but this one.
    std::uint64_t lost = 0;
    /// Replicas: since when the copy has been out of reach (a connection broke and no new
    /// one completed), for `TcpOptions::copy_timeout`.
    std::optional<std::chrono::steady_clock::time_point> failing_since;
    bool dispatching = false;  ///< its receive handler is handing frames on: no second receive
    std::string address;  ///< "host:port", for messages
    std::string host;
    std::string port;
    transport_detail::StreamSocket socket;
    bool local = false;  ///< `socket` is (being) connected to the ps's local socket
    transport_detail::SharedRings rings;   ///< its bytes' path once both ends took shared memory
    transport_detail::SharedRing offered;  ///< this side's ring, until the ps answers with its own
    bool unshared = false;  ///< the ps's ring could not be used: no more offers to it
    asio::ip::tcp::resolver resolver;
    asio::steady_timer timer;  ///< bounds a connection attempt
    State state = State::kBroken;
    std::uint64_t generation = 0;
    std::string broken_reason = "not connected";
    std::optional<ErrorReply> refused;   ///< the last handshake failed for good: why
    std::optional<wire::Challenge> challenge;  ///< the ps's, while handshaking
    wire::Hello said;                    ///< this side's hello, while handshaking
    wire::Frame hello;                   ///< it encoded, being written
    std::function<void(std::error_code)> connected;  ///< the attempt's `done`
    wire::FrameReader reader;
    transport_detail::ReceiveBuffers receive_buffers;
    std::map<std::uint64_t, PendingPtr> pending;  ///< sent or queued, awaiting a reply
    std::deque<PendingPtr> outbox;                ///< made since the caller last waited
    std::deque<PendingPtr> writing;               ///< in write_list, not all written yet
    transport_detail::GatherList write_list;      ///< their frames, as the kernel takes them
    bool write_waiting = false;                   ///< waits for the socket to take more
    bool receiving = false;                       ///< a receive is armed
    PendingPtr reading;         ///< the call whose reply is being received into its targets
    Response reading_response;  ///< that reply, decoded but for its tensors' values
    std::vector<std::size_t> sizes;  ///< scratch: tensor sizes of a reply to route
    std::chrono::steady_clock::time_point last_active;  ///< the last reply, or connection
  };

  class Impl final : public CallDriver {
   public:
    Impl(Node self, std::vector<Address> addresses, TcpOptions options,
         std::optional<std::span<const std::uint32_t>> reach_now = std::nullopt)
        : self_(self), options_(std::move(options)), shards_(addresses.size()) {
      rulings_->impl = this;
      wire::check_credentials(options_.credentials);
      if (options_.replicas > 1) {
        throw Error(ErrorCode::kInvalidArgument, "replicas must be 0 or 1, got " + std::to_string(options_.replicas));
      }
      if (options_.replicas == 1 && shards_ < 2) {
        throw Error(ErrorCode::kInvalidArgument, "a copy of each ps's shard needs at least 2 ps tasks");
      }
      const auto count = static_cast<std::uint32_t>(shards_);
      for (std::uint32_t k = 0; k < count; ++k) {
        links_.push_back(std::make_unique<Link>(io_, addresses[k], options_.limits, k, wire::Hello::kOwnShard));
      }
      if (options_.replicas == 1) {  // ps k's shard, as ps k + 1 holds its copy
        for (std::uint32_t k = 0; k < count; ++k) {
          links_.push_back(std::make_unique<Link>(io_, addresses[(k + 1) % count], options_.limits, (k + 1) % count, k));
        }
      }
      connect_all(reach_now);
    }

    Impl(const Impl&) = delete;
    Impl& operator=(const Impl&) = delete;

    ~Impl() {
      {  // a ruling that comes later finds no transport
        const std::scoped_lock lock(rulings_->mutex);
        rulings_->impl = nullptr;
      }
      // Every call still waiting is answered kUnavailable, so none waits on this driver.
      closing_ = true;
      for (auto& link : links_) fail(*link, "transport closed");
      for (const auto& weak : graced_) {
        if (const std::shared_ptr<Pair> pair = weak.lock()) pair->grace.reset();
      }
    }

    [[nodiscard]] std::size_t num_ps() const noexcept { return shards_; }

    void add_ps(Address where, bool connect_now) {
      const auto task = static_cast<std::uint32_t>(shards_);
      if (options_.replicas == 0) {
        links_.push_back(std::make_unique<Link>(io_, std::move(where), options_.limits, task,
                                                wire::Hello::kOwnShard));
      } else {
        // Its own link goes before the copies' links (link_of), which move up one; its copy
        // is reached at the new ps itself, as a shard of no member, until the chief's
        // membership places it (place_copies).
        auto copy = std::make_unique<Link>(io_, where, options_.limits, task, task);
        copy->dropped = true;
        if (members_.empty()) {  // (every ps known so far was a member: the new one is not yet)
          for (std::uint32_t k = 0; k < task; ++k) members_.push_back(k);
        }
        renumber_copies(1);
        links_.insert(links_.begin() + static_cast<std::ptrdiff_t>(shards_),
                      std::make_unique<Link>(io_, std::move(where), options_.limits, task,
                                             wire::Hello::kOwnShard));
        links_.push_back(std::move(copy));
        ready_alone_.push_back(false);
      }
      ++shards_;
      try {
        if (connect_now) connect_with_backoff(*links_[task], options_.connect_timeout);
      } catch (...) {  // (the links are kept alive: their handlers may still run)
        --shards_;
        retired_.push_back(std::move(links_[task]));  // broken: its attempt ended
        links_.erase(links_.begin() + static_cast<std::ptrdiff_t>(task));
        if (options_.replicas != 0) {
          retired_.push_back(std::move(links_.back()));  // never connected
          links_.pop_back();
          ready_alone_.pop_back();
          renumber_copies(-1);
        }
        throw;
      }
    }

    /// The copies' links move `by` places (a ps added before them, or taken back out): what
    /// names them by place (each call's link, each Pair's two) follows.
    void renumber_copies(std::ptrdiff_t by) {
      const std::size_t first = shards_;  // (their place now)
      std::set<Pending*> calls;
      std::set<Pair*> pairs;
      const auto note = [&](const PendingPtr& p) {
        if (!p) return;
        calls.insert(p.get());
        if (p->pair) pairs.insert(p->pair.get());
      };
      for (const auto& link : links_) {
        for (const auto& [id, p] : link->pending) note(p);
        for (const auto* list : {&link->outbox, &link->writing}) {
          for (const PendingPtr& p : *list) note(p);
        }
        for (const auto* list : {&link->parked, &link->parked_next}) {
          for (const PendingPtr& p : *list) note(p);
        }
        note(link->reading);
        for (const auto& weak : link->awaiting) {
          if (const std::shared_ptr<Pair> pair = weak.lock()) pairs.insert(pair.get());
        }
      }
      for (const auto& weak : graced_) {
        if (const std::shared_ptr<Pair> pair = weak.lock()) pairs.insert(pair.get());
      }
      const auto moved = [&](std::size_t& index) {
        if (index >= first)
          index = static_cast<std::size_t>(static_cast<std::ptrdiff_t>(index) + by);
      };
      for (Pending* p : calls) moved(p->ps);
      for (Pair* pair : pairs) {
        for (std::size_t& index : pair->links) moved(index);
      }
    }

    void place_copies(std::span<const std::uint32_t> members) {
      if (options_.replicas == 0) return;
      if (members.size() < 2) {
        throw Error(ErrorCode::kInvalidArgument,
                    "a job whose ps tasks keep copies of each other's shards (--ps-replicas 1) "
                    "keeps 2 ps tasks "
                    "or more: each copy is on another ps than its shard's own");
      }
      if (!std::is_sorted(members.begin(), members.end()) || members.back() >= shards_) {
        throw Error(
            ErrorCode::kInvalidArgument,
            "the job's ps tasks must be ascending task indices below " + std::to_string(shards_));
      }
      members_.assign(members.begin(), members.end());
      for (std::uint32_t shard = 0; shard < shards_; ++shard) {
        const std::uint32_t holder = copy_holder(members, shard);
        Link& link = *links_[link_of(shard, 1)];
        if (link.task != holder) move_copy(link, shard, holder);
        // No member: its own ps alone (a courtesy Shutdown reaches it), never a Pair.
        if (holder == shard) link.dropped = true;
      }
    }

    [[nodiscard]] bool copies_whole() const {
      // A shard with a copy given up since is served by the other alone: whole for writes.
      for (std::size_t k = 0; k < ready_alone_.size(); ++k) {
        if (ready_alone_[k] && !links_[link_of(k, 0)]->dropped && !links_[link_of(k, 1)]->dropped)
          return false;
      }
      return true;
    }

    [[nodiscard]] std::vector<std::uint32_t> given_up() const {
      std::vector<std::uint32_t> tasks;
      for (const auto& link : links_) {
        if (link->dropped && member(link->task)) tasks.push_back(link->task);
      }
      std::sort(tasks.begin(), tasks.end());
      tasks.erase(std::unique(tasks.begin(), tasks.end()), tasks.end());
      return tasks;
    }

    /// Reaches every copy that ps `ps` holds anew. Once one of them was given up, every
    /// connection to `ps` is to a process that is gone (one address, one process), seen
    /// broken or not yet: a copy not given up yet is given up first (drop: its calls go to
    /// the other copy), unless it is the last of its shard. One attempt each, of at most
    /// `attempt_timeout`, for the chief (it looks again soon); a task that serves them at
    /// once follows the chief, which reached and restored them already, and tries again
    /// within `copy_grace` unless the address refuses (the process is gone again). Such a
    /// task serves them again even when it does not reach them in time (it is cut off from
    /// the new process, say): the chief's take-back says both copies are whole, and writing
    /// the other copy alone would leave the one taken back behind. Its connection then takes
    /// whatever process it reaches next but the one given up (`Link::lost`), and its calls
    /// wait for it as for a ps without copies (a referee rules if it stays out of reach).
    bool reach_again(std::uint32_t ps, bool serve, bool unreached_too) {
      if (options_.replicas == 0) return false;
      std::vector<Link*> copies;
      for (const auto& link : links_) {
        if (link->task == ps) copies.push_back(link.get());
      }
      std::stable_partition(copies.begin(), copies.end(), [](const Link* link) { return link->dropped; });
      if (copies.empty() || !copies.front()->dropped) return false;
      const auto deadline = std::chrono::steady_clock::now() + (serve ? options_.copy_grace : std::chrono::milliseconds(0));
      std::uint64_t fresh = 0;  // the process started in the lost one's place
      for (Link* link : copies) {
        if (!link->dropped) {
          drop(*link, "another copy ps " + std::to_string(ps) + " held was given up: its process is gone");
          if (!link->dropped) continue;  // the last copy of its shard: left as it is
        }
        if (link->state == State::kConnected && link->renewed && (fresh == 0 || link->server == fresh)) {
          fresh = link->server;  // reached it already
          continue;
        }
        link->renewed = false;
        fail(*link, "reached again");
        for (auto backoff = options_.initial_backoff;; backoff = std::min(backoff * 2, std::chrono::milliseconds(1000))) {
          link->renewing = true;
          bool done = false;
          std::error_code attempt;
          connect(*link, [&](std::error_code ec) {
            done = true;
            attempt = ec;
          });
          while (!done) io_.run_one();
          link->renewing = false;
          if (link->state == State::kConnected) break;
          if (link->refused || attempt == asio::error::connection_refused ||
              std::chrono::steady_clock::now() + backoff > deadline) {
            if (serve && unreached_too) break;  // served unreached (above)
            return false;  // not there, or gone again: the next look tries again
          }
          std::this_thread::sleep_for(backoff);
        }
        if (link->state != State::kConnected) {
          link->server = 0;  // the next process it reaches is taken, but the one given up
          continue;
        }
        if ((link->lost != 0 && link->server == link->lost) || (fresh != 0 && link->server != fresh)) {
          // The very process given up (alive but cut off: its copies are old), or yet
          // another since: nothing served.
          fail(*link, "not the process taken back");
          if (!serve || !unreached_too) return false;
          link->server = 0;
          continue;
        }
        fresh = link->server;
        link->renewed = true;
      }
      if (serve) serve_again(ps);
      return true;
    }

    /// Logs a change of the copies, unless another transport of this task says it.
    void log_copies(LogLevel level, const std::string& line) const {
      if (options_.logs_copies) log(level, line);
    }

    void serve_again(std::uint32_t ps) {
      for (const auto& link : links_) {
        if (!link->dropped || link->task != ps) continue;
        link->dropped = false;
        if (link->server != 0) link->lost = 0;  // (one served unreached still refuses the process given up)
        link->renewed = false;
        link->failing_since.reset();
        const std::size_t shard = index_of(*link) % shards_;
        log_copies(LogLevel::kInfo,
                   self_.name() + ": ps " + std::to_string(shard) +
                       "'s shard is served by two copies again (ps " + std::to_string(link->task) +
                       " at " + link->address + " holds one again" +
                       (link->server == 0 ? "; not reached yet: this task waits for it" : "") +
                       ")");
        if (link->server == 0) link->failing_since = std::chrono::steady_clock::now();
      }
    }

    void give_up(std::uint32_t ps, const std::string& why) {
      for (const auto& link : links_) {
        if (link->task != ps) continue;
        link->renewed = false;
        drop(*link, why);
      }
    }

    [[nodiscard]] std::string address(std::size_t ps) const {
      if (ps >= shards_) throw Error(ErrorCode::kInvalidArgument, "no ps task " + std::to_string(ps));
      return links_[ps]->address;
    }

    [[nodiscard]] bool local(std::size_t ps) const {
      if (ps >= shards_) throw Error(ErrorCode::kInvalidArgument, "no ps task " + std::to_string(ps));
      const Link& link = *links_[ps];
      return link.local && link.state == State::kConnected;
    }

    [[nodiscard]] bool shared_memory(std::size_t ps) const {
      if (ps >= shards_)
        throw Error(ErrorCode::kInvalidArgument, "no ps task " + std::to_string(ps));
      const Link& link = *links_[ps];
      return link.rings.active() && link.state == State::kConnected;
    }

    PendingCall call(std::size_t ps, Request&& request, PullTargets targets) {
      if (ps >= shards_) {
        auto refused = std::make_shared<Pending>(this, 0);
        PendingCall result(refused);
        refused->answer(ErrorReply{ErrorCode::kInvalidArgument, "no ps task " + std::to_string(ps)});
        return result;
      }
      begin_again_if_stale(*links_[ps]);
      if (options_.replicas == 0) return call_on(ps, std::move(request), std::move(targets));
      begin_again_if_stale(*links_[link_of(ps, 1)]);  // (before a copy it may drop is chosen)
      // ps k's own copy is read from while it lives (every task then takes tokens from the
      // same pacer), the one ps k + 1 holds once it was dropped.
      const std::size_t reading = links_[ps]->dropped ? link_of(ps, 1) : ps;
      const std::size_t other = reading == ps ? link_of(ps, 1) : ps;
      const Spread spread = spread_of(request);
      if (links_[other]->dropped || spread == Spread::kOne) {
        return call_on(reading, std::move(request), std::move(targets));
      }
      auto pair = std::make_shared<Pair>(this, ps, spread == Spread::kBothReady);
      PendingCall result(pair);
      pair->links = {reading, other};
      pair->refusal_stands = std::holds_alternative<ChangeWorkers>(request);
      pair->unreached_stands = std::holds_alternative<Shutdown>(request);
      for (std::size_t half = 0; half < 2; ++half) {
        auto pending = std::make_shared<Pending>(this, pair->links[half]);
        pending->pair = pair;
        pending->half = half;
        if (half == 0) pending->targets = targets;
        pair->halves[half] = pending;
        if (half == 1 && spread == Spread::kGate) {  // the other copy only says when it got there
          pair->other_partial = true;
          const Pull& pull = std::get<Pull>(request);
          queue(*links_[pair->links[half]], std::move(pending),
                Request{Pull{pull.min_step, {}, pull.epoch, pull.pushes_paced}});
        } else if (half == 1 && std::holds_alternative<PullRows>(request)) {  // it creates the rows, sends none
          pair->other_partial = true;
          PullRows touch = std::get<PullRows>(request);
          touch.touch_only = true;
          queue(*links_[pair->links[half]], std::move(pending), Request{std::move(touch)});
        } else {
          queue(*links_[pair->links[half]], std::move(pending), request);
        }
      }
      return result;
    }

    /// An attempt runs only while a caller waits (run_until). One left behind by a wait that
    /// ended on another link's failure, whose attempt_timeout passed since, would fail the
    /// next call at once, when the caller waits again: it ends now (as its timer would have:
    /// a copy out of reach long enough may be dropped, and the call then goes to the other),
    /// and the call begins a new one.
    void begin_again_if_stale(Link& link) {
      if ((link.state == State::kConnecting || link.state == State::kHandshaking) &&
          link.timer.expiry() <= std::chrono::steady_clock::now()) {
        fail(link, "an attempt left behind by an earlier call outlived attempt_timeout");
      }
    }

    /// Sends `request` on link `index` alone.
    PendingCall call_on(std::size_t index, Request&& request, PullTargets targets) {
      auto pending = std::make_shared<Pending>(this, index);
      pending->targets = std::move(targets);
      PendingCall result(pending);
      queue(*links_[index], std::move(pending), request);
      return result;
    }

    /// Queues `pending`'s frame of `request` on `link`, reconnecting it if it is broken.
    void queue(Link& link, PendingPtr pending, const Request& request) {
      if (link.state == State::kConnected && link.pending.empty() && closed_while_quiet(link)) {
        fail(link, "closed by the ps while idle");  // reconnect below, not fail this call
      }
      const std::uint64_t id = next_call_++;
      // The payload views alias the request's tensors (the caller's buffers), which stay
      // valid until the call is answered or cancelled; the rest is serialized here.
      pending->frame = wire::encode(request, id);
      link.pending.emplace(id, pending);
      link.outbox.push_back(std::move(pending));
      if (link.state == State::kBroken) connect(link, [](std::error_code) {});
    }

    void run_until(const std::function<bool()>& done,
                   std::chrono::steady_clock::time_point deadline) override {
      for (auto& link : links_) {
        flush(*link);
        receive(*link);
      }
      while (!done()) {
        if (deadline <= std::chrono::steady_clock::now()) {
          io_.poll();  // what already arrived
          return;
        }
        io_.run_one_until(deadline);
      }
    }

    /// True if the ps closed a connection that has been quiet for a second or more (it
    /// closes idle ones: TcpServerOptions::idle_timeout), so that a call made now goes out
    /// on a new connection instead of failing on the old one. A busy link is not asked:
    /// one look costs a system call.
    static bool closed_while_quiet(Link& link) {
      const auto now = std::chrono::steady_clock::now();
      if (now - link.last_active < std::chrono::seconds(1)) return false;
      link.last_active = now;
      if (link.rings.active()) return link.rings.peer_closed();
      char byte = 0;
      const ssize_t n = ::recv(link.socket.native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
      return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
    }

    void abort(CallControl& call) override {
      auto& pending = static_cast<Pending&>(call);
      if (pending.is_pair) {
        for (const auto& weak : static_cast<Pair&>(pending).halves) {
          if (const PendingPtr half = weak.lock()) abort_one(*half);
        }
        return;
      }
      abort_one(pending);
    }

   private:
    /// Where a request goes when the job keeps copies: to the copy read from, to both, to
    /// both and answered once both are ready (WaitReady), or its values from the copy read from
    /// and a wait for the same step from the other (a Pull that waits for a step).
    enum class Spread { kOne, kBoth, kBothReady, kGate };

    [[nodiscard]] Spread spread_of(const Request& request) const noexcept {
      if (std::holds_alternative<WaitReady>(request)) return Spread::kBothReady;
      if (std::holds_alternative<PullRows>(request)) {  // a worker's creates rows: both copies must
        return self_.role == Node::Role::kWorker ? Spread::kBoth : Spread::kOne;
      }
      // A pull for a step waits for both copies to complete it: no worker then pushes for the
      // next step before both took every push of this one (each completes steps on its own).
      if (const auto* pull = std::get_if<Pull>(&request)) return pull->min_step > 0 ? Spread::kGate : Spread::kOne;
      // A heartbeat reaches both copies a ps process holds (ShardCopies hands it to each).
      if (std::holds_alternative<TakeToken>(request) || std::holds_alternative<Heartbeat>(request) ||
          std::holds_alternative<GetStats>(request) || std::holds_alternative<ReadState>(request) ||
          std::holds_alternative<ReadRows>(request)) {
        return Spread::kOne;
      }
      return Spread::kBoth;
    }

    /// The link of copy `copy` (0: ps k's own, 1: the one ps k + 1 holds) of shard `shard`.
    [[nodiscard]] std::size_t link_of(std::size_t shard, std::size_t copy) const noexcept {
      return copy == 0 ? shard : shards_ + shard;
    }

    void abort_one(Pending& pending) {
      Link& link = *links_[pending.ps];
      if (pending.writing || link.reading.get() == &pending) {
        fail(link, "a call was given up mid-transfer");
      }
    }

    static bool is_error(const Response& response) { return std::holds_alternative<ErrorReply>(response); }
    /// Training's end: finished, or aborted.
    static bool is_ended(const Response& response) {
      const auto* error = std::get_if<ErrorReply>(&response);
      return error != nullptr &&
             (error->code == ErrorCode::kOutOfRange || error->code == ErrorCode::kAborted);
    }
    static bool is_unavailable(const Response& response) {
      const auto* error = std::get_if<ErrorReply>(&response);
      return error != nullptr && error->code == ErrorCode::kUnavailable;
    }

    /// A call's answer: to its caller, or to the Pair it is half of.
    void deliver(Pending& pending, Response&& response) {
      if (!pending.pair) {
        pending.answer(std::move(response));
        return;
      }
      const std::shared_ptr<Pair> pair = pending.pair;
      pair->answers[pending.half] = std::move(response);
      settle(pair);
    }

    /// Answers a Pair once its halves allow: both answers in (the one read from), or the
    /// ready one for WaitReady; a dropped copy's half is not waited for.
    void settle(const std::shared_ptr<Pair>& held) {
      Pair& pair = *held;
      if (closing_) {
        pair.answer(ErrorReply{ErrorCode::kUnavailable, "transport closed"});
        return;
      }
      if (pair.has_answer() && !pair.both_ready) return;
      auto& a = pair.answers[0];
      auto& b = pair.answers[1];
      const bool a_gone = links_[pair.links[0]]->dropped;
      const bool b_gone = links_[pair.links[1]]->dropped;
      if (a_gone && b_gone) {
        pair.answer(ErrorReply{ErrorCode::kUnavailable, "both copies of ps " + std::to_string(pair.shard) +
                                                            "'s shard are lost"});
        return;
      }
      if (pair.both_ready) return settle_ready(held, a_gone, b_gone);
      if (a_gone) {
        if (b) answer_pair(pair, 1);
        return;
      }
      if (b_gone) {
        if (a) answer_pair(pair, 0);
        return;
      }
      if (!a || !b) return;
      const bool a_ok = !is_error(*a);
      const bool b_ok = !is_error(*b);
      if (a_ok && b_ok) transport_detail::merge_copy_answers(*a, *b);
      // A Shutdown that one copy took (it answers that training ended) and the other may not
      // have: sent again until both have it.
      if (!a_ok && !b_ok && pair.unreached_stands &&
          (is_unavailable(*a) ? is_ended(*b) : is_ended(*a) && is_unavailable(*b))) {
        return answer_pair(pair, is_unavailable(*a) ? 0 : 1);
      }
      if (a_ok == b_ok) return answer_pair(pair, a_ok || !is_unavailable(*a) ? 0 : 1);
      const std::size_t ok = a_ok ? 0 : 1;
      const Response& refused = a_ok ? *b : *a;
      // A connection that broke: whether the copy is lost for good shows when it is tried
      // again. Dropped, the other copy's answer stands; reached, the call fails as without
      // copies (the caller sends again: each copy counts a push once).
      if (is_unavailable(refused)) {
        Link& link = *links_[pair.links[1 - ok]];
        if (!pair.waited[1 - ok] && link.state != State::kConnected) {
          pair.waited[1 - ok] = true;
          link.awaiting.push_back(held);
          if (link.state == State::kBroken) connect(link, [](std::error_code) {});
          return;
        }
        return answer_pair(pair, 1 - ok);
      }
      // A refusal by one copy only (a restore that reached one first, a replaced process
      // not yet known as one): the answer of the copy read from stands. Copies are dropped
      // only when lost for sure: each task decides alone, and a copy dropped by some tasks
      // and not others would miss their updates. A change of the workers is the exception:
      // a copy that refused it would count other workers than its twin from that step on,
      // and wait forever for a push that never comes, so the chief must hear the refusal
      // (and takes the change back from both).
      answer_pair(pair, pair.refusal_stands ? 1 - ok : 0);
    }

    /// WaitReady to both copies: answered once both are ready (ps k's own copy's answer),
    /// or by the ready one when the other is gone or refuses. Answering when only one is
    /// ready would let a worker push to a copy the chief's Initialize has not reached yet
    /// (it comes on another connection). A copy still not ready `copy_grace` after the
    /// other was is a process started in a lost one's place, holding nothing: it is
    /// dropped, and the call answered by the copy left. So is one ready at an older
    /// membership or epoch than the other.
    void settle_ready(const std::shared_ptr<Pair>& held, bool a_gone, bool b_gone) {
      Pair& pair = *held;
      const auto& a = pair.answers[0];
      const auto& b = pair.answers[1];
      bool a_ready = a && !is_error(*a) && !a_gone;
      bool b_ready = b && !is_error(*b) && !b_gone;
      const auto* a_placed = a_ready ? std::get_if<PlacementReply>(&*a) : nullptr;
      const auto* b_placed = b_ready ? std::get_if<PlacementReply>(&*b) : nullptr;
      if (pair.followed || (!pair.has_answer() && a_placed != nullptr && b_placed != nullptr &&
                            a_placed->members != b_placed->members)) {
        // The job's ps tasks changed between the two answers (a ps left or joined): the newer
        // one is the answer, and the caller follows it (placing the copies anew) and asks
        // again; neither copy is given up for it, however late the grace's timer fires.
        if (!std::exchange(pair.followed, true))
          answer_pair(pair, a_placed->membership < b_placed->membership ? 1 : 0);
        if (pair.grace) pair.grace->cancel();
        return;
      }
      if (a_placed != nullptr && b_placed != nullptr &&
          (a_placed->membership != b_placed->membership || a_placed->epoch != b_placed->epoch)) {
        // Both ready, one at an older restore (a process the chief began to take back and
        // then gave up): it is no copy of this shard now, and waits out the grace as a copy
        // not ready does.
        (std::pair(a_placed->membership, a_placed->epoch) < std::pair(b_placed->membership, b_placed->epoch) ? a_ready
                                                                                                          : b_ready) = false;
      }
      if (!pair.has_answer()) {
        // Ready by one copy while the other, not given up, is out of reach: copies_whole.
        if (a_ready && (b_ready || b_gone || (b && is_error(*b)))) {
          ready_alone_.at(pair.shard) = !b_ready && !b_gone && is_unavailable(*b);
          answer_pair(pair, 0);
        } else if (b_ready && (a_gone || (a && is_error(*a)))) {
          ready_alone_.at(pair.shard) = !a_gone && is_unavailable(*a);
          answer_pair(pair, 1);
        } else if (!a_ready && !b_ready && (a || a_gone) && (b || b_gone)) {  // neither is ready: an error
          answer_pair(pair, a && !a_gone && (!is_unavailable(*a) || b_gone) ? 0 : 1);
        }
      }
      if (a_ready == b_ready || (a_ready ? b_gone || (b && is_error(*b)) : a_gone || (a && is_error(*a)))) return;
      if (!pair.grace) return start_grace(held);
      if (!grace_over(pair)) return;
      Link& late = *links_[pair.links[a_ready ? 1 : 0]];
      drop(late,
           "not ready " + std::to_string(options_.copy_grace.count()) +
               " ms after its other copy was: a process started in place of a lost ps holds nothing",
           false);
      // One that answered (ready at an older restore) left no call behind for drop to settle.
      if (late.dropped && !pair.has_answer()) answer_pair(pair, a_ready ? 0 : 1);
    }

    [[nodiscard]] static bool grace_over(const Pair& pair) { return pair.grace && pair.grace->expiry() <= asio::steady_timer::clock_type::now(); }

    void start_grace(const std::shared_ptr<Pair>& pair) {
      std::erase_if(graced_, [](const std::weak_ptr<Pair>& p) { return p.expired(); });
      graced_.push_back(pair);  // its timer goes before io_ does (~Impl)
      pair->grace = std::make_unique<asio::steady_timer>(io_, options_.copy_grace);
      pair->grace->async_wait([this, weak = std::weak_ptr<Pair>(pair)](std::error_code ec) {
        if (ec) return;
        if (const std::shared_ptr<Pair> held = weak.lock()) settle(held);
      });
    }

    /// Answers `pair` with half `half`'s answer. (Which copy is read from changes only when
    /// one is dropped: every task reads ps k's own copy while it can, tokens included.)
    void answer_pair(Pair& pair, std::size_t half) {
      Response response = std::move(*pair.answers[half]);
      if (half == 1 && pair.other_partial) {
        // The other copy was asked for less, or its tensors were not received into the
        // caller's targets: the caller sends again, to the copy left.
        response = ErrorReply{ErrorCode::kUnavailable, "the copy read from was lost during the call"};
      }
      pair.answer(std::move(response));
    }

    /// Gives up a copy for good: calls waiting on it go to the other copy (halves of a
    /// Pair are just no longer waited for), and the other copy is read from.
    void drop(Link& link, const std::string& why, bool lost = true) {
      if (link.dropped || options_.replicas == 0) return;
      const std::size_t index = index_of(link);
      const std::size_t shard = index % shards_;
      const std::size_t other = partner_of(link);
      if (links_[other]->dropped) return;  // the last copy: waited for as a ps without copies
      link.dropped = true;
      link.lost = lost ? link.server : 0;
      log_copies(LogLevel::kWarning, self_.name() + ": dropping the copy of ps " +
                                         std::to_string(shard) + "'s shard held by ps " +
                                         std::to_string(link.task) + " at " + link.address + " (" +
                                         why + "): it is served by the copy at " +
                                         links_[other]->address + " alone from now on");
      // Closed with a reset, not a FIN: what the kernel still holds to send (held back by
      // a silent cut, delivered when it heals) is discarded, so nothing this task sent
      // before reaches a process it gave up (a chief's request would renew its lease). Over
      // TCP only: on one host (a local socket, shared memory) what was sent is still read by
      // a process that was only stopped, as there is no cut to heal.
      std::error_code ignored;
      link.socket.set_option(asio::socket_base::linger(true, 0), ignored);
      fail(link, "dropped: " + why);  // what it sent waits in parked_next
      Link& to = *links_[other];
      std::vector<PendingPtr> moved;
      for (auto& [id, out] : std::exchange(link.pending, {})) moved.push_back(out);
      link.outbox.clear();
      for (auto* list : {&link.parked, &link.parked_next}) {
        for (PendingPtr& out : std::exchange(*list, {})) moved.push_back(std::move(out));
      }
      std::vector<std::shared_ptr<Pair>> halves;  // no longer waited for
      for (PendingPtr& out : moved) {
        if (out->pair) {
          halves.push_back(out->pair);
          continue;
        }
        out->ps = other;
        out->sent = false;
        to.pending.emplace(out->frame.header.call, out);
        to.outbox.push_back(std::move(out));
      }
      if (to.state == State::kBroken) {
        connect(to, [](std::error_code) {});
      } else {
        flush(to);  // the caller may be waiting already
        receive(to);
      }
      for (const auto& pair : halves) settle(pair);
    }

    /// Shard `shard`'s copy moved to ps `holder` (place_copies): the connection to the ps
    /// that held it ends (reset, as drop closes one), what waited on it fails with
    /// kUnavailable (a call to both copies then fails so too: the caller sends again), and
    /// the link reaches `holder` at its next call. Until it first does, it counts as out of
    /// reach since the move (copy_timeout), and a refusal there is "for now" where `holder`
    /// let this task in before, as on `holder`'s own link.
    void move_copy(Link& link, std::uint32_t shard, std::uint32_t holder) {
      std::error_code ignored;
      link.socket.set_option(asio::socket_base::linger(true, 0), ignored);
      link.dropped = true;  // (no attempt at the old ps follows; Pairs settle without it)
      fail(link, "ps " + std::to_string(shard) + "'s copy moved to ps " + std::to_string(holder));
      fail_all(link, false);  // calls queued on a link that was broken already
      for (auto* list : {&link.parked, &link.parked_next}) {
        for (PendingPtr& p : std::exchange(*list, {})) {
          deliver(*p, unavailable(link));
          p->detach_driver();
        }
      }
      for (const auto& weak : std::exchange(link.awaiting, {})) {
        if (const std::shared_ptr<Pair> pair = weak.lock()) settle(pair);
      }
      const Link& at = *links_[holder];
      if (holder != shard) {  // (a ps that is no member has no copy: nothing to say)
        log_copies(LogLevel::kInfo, self_.name() + ": ps " + std::to_string(shard) +
                                        "'s copy is held by ps " + std::to_string(holder) + " at " +
                                        at.address + " now (was ps " + std::to_string(link.task) +
                                        ")");
      }
      link.task = holder;
      link.address = at.address;
      link.host = at.host;
      link.port = at.port;
      link.local = false;
      link.server = 0;
      link.lost = 0;
      link.renewed = false;
      link.refused.reset();
      link.failing_since = std::chrono::steady_clock::now();
      link.ever_connected = at.ever_connected;
      link.dropped = false;
      ready_alone_.at(shard) = false;
    }

    /// True if ps `ps` is a member of the job, as place_copies last said (all until then).
    [[nodiscard]] bool member(std::uint32_t ps) const {
      return members_.empty() || std::binary_search(members_.begin(), members_.end(), ps);
    }

    [[nodiscard]] std::size_t index_of(const Link& link) const {
      for (std::size_t i = 0; i < links_.size(); ++i) {
        if (links_[i].get() == &link) return i;
      }
      return 0;
    }

    /// Connects every link (those of `reach_now`'s tasks only, when given). Without copies,
    /// each within connect_timeout, or throws. With copies, each first within
    /// copy_connect_timeout (when set; a process is waited for once, not once per copy it
    /// holds). A shard neither of whose copies was reached then is waited for
    /// connect_timeout, as a ps without copies, by whichever copy comes first (one may be
    /// gone for good, the other stalled). A copy whose twin was reached is tried once more
    /// (one attempt: its process may have come meanwhile), then dropped (when the referee, if
    /// any, rules its process lost, asked once per process; if it does not, the process is
    /// there after all, started or continued meanwhile: one more connect_timeout). So a task
    /// started in a job under way whose ps process is gone for good reaches its shards
    /// within one attempt and the chief's ruling, and its heartbeats begin before the ps
    /// tasks' worker timeout holds it lost.
    void connect_all(std::optional<std::span<const std::uint32_t>> reach_now) {
      const bool quick = options_.replicas != 0 && options_.copy_connect_timeout.count() > 0;
      std::vector<std::optional<Error>> missed(links_.size());
      // The first link missed at each task: the others at its address are not waited for.
      const auto missed_at = [&](std::size_t i) -> const std::optional<Error>* {
        for (std::size_t j = 0; j < i; ++j) {
          if (missed[j] && links_[j]->task == links_[i]->task) return &missed[j];
        }
        return nullptr;
      };
      for (std::size_t i = 0; i < links_.size(); ++i) {
        if (reach_now &&
            std::find(reach_now->begin(), reach_now->end(), links_[i]->task) == reach_now->end())
          continue;
        if (const std::optional<Error>* before = quick ? missed_at(i) : nullptr) {
          missed[i] = **before;
          continue;
        }
        try {
          connect_with_backoff(*links_[i],
                               quick ? options_.copy_connect_timeout : options_.connect_timeout);
        } catch (const Error& e) {
          if (options_.replicas == 0 || e.code() != ErrorCode::kUnavailable) throw;
          missed[i] = e;
        }
      }
      const auto twin_reached = [&](std::size_t i) {
        const Link& twin = *links_[partner_of(*links_[i])];
        return twin.state == State::kConnected && !twin.dropped;
      };
      for (std::size_t i = 0; i < links_.size(); ++i) {  // the last copies first
        if (!missed[i] || twin_reached(i)) continue;
        if (!quick) throw *missed[i];
        const std::size_t j = partner_of(*links_[i]);
        if (!missed[j]) {  // its twin was not tried (not among reach_now): this one alone
          connect_with_backoff(*links_[i], options_.connect_timeout);
          missed[i].reset();
          continue;
        }
        // Neither copy reached: whichever comes first (one may be gone for good, the
        // other stalled a while).
        if (!connect_first({links_[i].get(), links_[j].get()}, options_.connect_timeout)) {
          throw Error(ErrorCode::kUnavailable,
                      "neither copy of ps " + std::to_string(i % shards_) +
                          "'s shard reached within " +
                          std::to_string(options_.connect_timeout.count()) +
                          " ms: " + missed[i]->message() + "; " + missed[j]->message());
        }
        missed[links_[i]->state == State::kConnected ? i : j].reset();
      }
      std::vector<std::uint32_t> ruled_lost;  // the processes the referee ruled lost here
      for (std::size_t i = 0; i < links_.size(); ++i) {
        if (!missed[i]) continue;
        const bool ruled =
            std::find(ruled_lost.begin(), ruled_lost.end(), links_[i]->task) != ruled_lost.end();
        if (quick && !ruled) {
          // One attempt, or the first wait's attempts when another link reached the process
          // meanwhile (it was stalled, not gone).
          const bool process_back =
              std::any_of(links_.begin(), links_.end(), [&](const auto& other) {
                return other->task == links_[i]->task && other->state == State::kConnected;
              });
          try {
            connect_with_backoff(*links_[i], process_back ? std::max(options_.copy_connect_timeout,
                                                                     options_.attempt_timeout)
                                                          : std::chrono::milliseconds(0));
            continue;
          } catch (const Error& e) {  // (the first miss stays the one logged)
            if (e.code() != ErrorCode::kUnavailable) throw;
          }
        }
        if (options_.copy_referee && !ruled && !ruled_lost_now(*links_[i], missed[i]->message())) {
          try {
            connect_with_backoff(*links_[i], options_.connect_timeout);
            continue;
          } catch (const Error& again) {
            if (again.code() != ErrorCode::kUnavailable) throw;
            throw Error(again.code(),
                        std::string(again.message()) +
                            "; its copy is not given up: the chief did not rule its process lost");
          }
        }
        ruled_lost.push_back(links_[i]->task);
        links_[i]->dropped = true;
        log_copies(LogLevel::kWarning, self_.name() + ": " + missed[i]->what() + ": ps " +
                                           std::to_string(i % shards_) +
                                           "'s shard is served by one copy only");
      }
    }

    /// Connects one of `links`, whichever answers first: one attempt at each in turn,
    /// with backoff, for up to `patience`; false when none did. Throws when one refuses
    /// this task at its handshake (another job, say).
    bool connect_first(std::initializer_list<Link*> links, std::chrono::milliseconds patience) {
      const auto deadline = std::chrono::steady_clock::now() + patience;
      auto backoff = options_.initial_backoff;
      for (;;) {
        for (Link* link : links) {
          bool done = false;
          connect(*link, [&](std::error_code) { done = true; });
          while (!done) io_.run_one();
          if (link->state == State::kConnected) return true;
          if (link->refused) throw Error(link->refused->code, link->refused->message);
        }
        if (std::chrono::steady_clock::now() + backoff > deadline) return false;
        std::this_thread::sleep_for(backoff);
        backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
      }
    }

    void connect_with_backoff(Link& link, std::chrono::milliseconds patience) {
      if (connect_first({&link}, patience)) return;
      const std::string tried = patience < options_.attempt_timeout
                                    ? " (one attempt)"
                                    : " for " + std::to_string(patience.count()) + " ms";
      throw Error(ErrorCode::kUnavailable,
                  "ps at " + link.address + " unreachable" + tried + ": " + link.broken_reason);
    }

    /// One connection attempt of at most attempt_timeout, handshake included; `done(ec)`
    /// follows, with the link connected (and receiving) or broken with the reason (and
    /// `refused` set when the handshake failed for good).
    template <class Done>
    void connect(Link& link, Done done) {
      const std::uint64_t gen = ++link.generation;
      link.state = State::kConnecting;
      link.rings.stop();  // (a link is connected again only once broken: stopped already)
      link.offered = {};
      link.socket = transport_detail::StreamSocket(io_);
      link.local = false;
      link.refused.reset();
      link.connected = std::move(done);
      auto timed_out = std::make_shared<bool>(false);
      link.timer.expires_after(options_.attempt_timeout);
      link.timer.async_wait([this, &link, gen, timed_out](std::error_code ec) {
        if (ec || gen != link.generation ||
            (link.state != State::kConnecting && link.state != State::kHandshaking)) {
          return;
        }
        *timed_out = true;
        link.resolver.cancel();
        if (link.state == State::kHandshaking) {
          return fail(link, "no handshake within " +
                                std::to_string(options_.attempt_timeout.count()) + " ms");
        }
        std::error_code ignored;
        link.socket.close(ignored);
      });
      auto finish = [this, &link, gen, timed_out](std::error_code ec) {
        if (gen != link.generation) return;
        if (!ec && !link.local) link.socket.set_option(asio::ip::tcp::no_delay(true), ec);
        if (!ec && link.local) transport_detail::widen_local_buffers(link.socket);
        if (!ec) link.socket.non_blocking(true, ec);  // requests are first written directly
        if (ec) {
          link.timer.cancel();
          link.state = State::kBroken;
          link.broken_reason = *timed_out
                                   ? "no connection within " +
                                         std::to_string(options_.attempt_timeout.count()) + " ms"
                                   : ec.message();
          drop_if_lost(link, ec);  // then its calls go to the other copy
          fail_all(link, false);   // else what waited for this attempt learns its outcome now
          return connected(link, ec);
        }
        // Connected: the ps speaks first (its challenge), and the handshake follows.
        link.state = State::kHandshaking;
        link.reader.reset();
        link.reader.set_limits(wire::kHandshakeLimits);
        link.receive_buffers = {};  // a new socket: low watermark 1
        link.receiving = false;
        receive(link);
      };
      // A numeric address needs no resolver (whose first use starts a thread). A ps on this
      // host is reached through its local socket when it has one, else over TCP.
      const auto port = static_cast<std::uint16_t>(std::stoi(link.port));
      std::error_code not_numeric;
      const asio::ip::address numeric = asio::ip::make_address(link.host, not_numeric);
      if (!not_numeric) {
        const asio::ip::tcp::endpoint endpoint(numeric, port);
        reach_locally(link, gen, timed_out, local_names(numeric, port), 0, finish, [&link, endpoint, finish] {
          link.socket.async_connect(endpoint, [finish](std::error_code ec) mutable { finish(ec); });
        });
        return;
      }
      link.resolver.async_resolve(
          link.host, link.port,
          [this, &link, gen, timed_out, port, finish](std::error_code ec,
                                                      asio::ip::tcp::resolver::results_type endpoints) mutable {
            if (ec) return finish(ec);
            std::vector<asio::generic::stream_protocol::endpoint> tcp;  // (as the socket takes them)
            for (const auto& entry : endpoints) tcp.emplace_back(entry.endpoint());
            reach_locally(link, gen, timed_out, local_names(endpoints.begin()->endpoint().address(), port), 0, finish,
                          [&link, tcp = std::move(tcp), finish] {
                            asio::async_connect(link.socket, tcp,
                                                [finish](std::error_code ec2, const auto& /*endpoint*/) mutable {
                                                  finish(ec2);
                                                });
                          });
          });
    }

    /// The local socket names to try for a ps at `address`:`port` (none unless it is this
    /// host's and TcpOptions::local_sockets).
    [[nodiscard]] std::vector<std::string> local_names(const asio::ip::address& address, std::uint16_t port) const {
      if (!options_.local_sockets) return {};
      return transport_detail::local_socket_names(address, port);
    }

    /// Connects `link` to the first of `names` from `next` on that takes it, then calls
    /// `finish`; when none does (no ps listens under them), calls `over_tcp` on a fresh
    /// socket. A local connection is taken or refused at once, so this adds nothing to a
    /// TCP attempt; the attempt's deadline covers both.
    template <class Finish, class OverTcp>
    void reach_locally(Link& link, std::uint64_t gen, std::shared_ptr<bool> timed_out, std::vector<std::string> names,
                       std::size_t next, Finish finish, OverTcp over_tcp) {
#if defined(__linux__)
      if (next < names.size()) {
        link.local = true;
        link.socket = transport_detail::StreamSocket(io_);
        const asio::generic::stream_protocol::endpoint endpoint{asio::local::stream_protocol::endpoint(names[next])};
        link.socket.async_connect(endpoint, [this, &link, gen, timed_out, names = std::move(names), next, finish,
                                             over_tcp](std::error_code ec) mutable {
          if (gen != link.generation) return;
          if (!ec || *timed_out) return finish(ec);
          reach_locally(link, gen, timed_out, std::move(names), next + 1, std::move(finish), std::move(over_tcp));
        });
        return;
      }
#else
      (void)gen, (void)timed_out, (void)names, (void)next, (void)finish;
#endif
      if (link.local) link.socket = transport_detail::StreamSocket(io_);
      link.local = false;
      over_tcp();
    }

    /// After an attempt that failed with `ec`: a copy reached before and not now is lost for
    /// good once its address refuses (no process listens there), or after `copy_timeout`
    /// out of reach (a host gone): it is dropped, or, with a referee, the referee is asked
    /// whether its process is lost for the job.
    void drop_if_lost(Link& link, std::error_code ec) {
      if (!ec || options_.replicas == 0 || !link.ever_connected || link.dropped || closing_) return;
      const bool refused = ec == asio::error::connection_refused;
      if (refused || (link.failing_since && std::chrono::steady_clock::now() - *link.failing_since >= options_.copy_timeout)) {
        std::string why = refused ? "its address refuses connections"
                                  : "out of reach for " + std::to_string(options_.copy_timeout.count()) + " ms";
        if (options_.copy_referee) return ask_referee(link, std::move(why));
        drop(link, why);
      }
    }

    /// What this transport asked the referee of one ps process, and heard.
    struct Asked {
      bool in_flight = false;
      std::chrono::steady_clock::time_point answered;  ///< when the last answer came
      bool told = false;  ///< the wait for this process is logged (until it is reached again)
    };
    /// The referee's answers, handed from whatever thread gives them to this transport's.
    struct Rulings {
      std::mutex mutex;
      Impl* impl = nullptr;  ///< null once the transport is gone
    };

    /// Asks the referee whether the process behind `link` (and every copy it holds) is lost
    /// for the job: once at a time, and not again within a second of its last answer.
    void ask_referee(Link& link, std::string why) {
      if (links_[partner_of(link)]->dropped) return;  // the last copy of a shard: waited for
      Asked& asked = asked_[link.task];
      const auto now = std::chrono::steady_clock::now();
      if (asked.in_flight || now - asked.answered < kAskAgainAfter) return;
      asked.in_flight = true;
      if (!std::exchange(asked.told, true)) {
        log_copies(
            LogLevel::kWarning,
            self_.name() + ": ps " + std::to_string(link.task) + " at " + link.address + ": " +
                why + "; asks the chief whether it is lost for the job (until then, waits for it)");
      }
      std::shared_ptr<Rulings> box = rulings_;
      options_.copy_referee(LostProcess{link.task, link.server, why},
                            [box, task = link.task, process = link.server, why](bool lost) {
                              const std::scoped_lock lock(box->mutex);
                              if (box->impl == nullptr) return;
                              Impl* impl = box->impl;
                              asio::post(impl->io_, [impl, task, process, why, lost] { impl->ruled(task, process, why, lost); });
                            });
    }

    /// The referee's answer about process `process` of ps `task`: lost, every copy it holds
    /// is dropped (the last copy of a shard excepted); not lost, this task waits for it.
    void ruled(std::uint32_t task, std::uint64_t process, const std::string& why, bool lost) {
      Asked& asked = asked_[task];
      asked.in_flight = false;
      asked.answered = std::chrono::steady_clock::now();
      if (!lost) return;
      for (const auto& link : links_) {
        // (A link that reached another process since, one the chief took back, stays.)
        if (link->task == task && !link->dropped && (process == 0 || link->server == process)) {
          drop(*link, why + "; the chief ruled it lost for the job");
        }
      }
    }

    /// At construction: true if the referee rules ps `link.task`'s process, which this task
    /// never reached (`why`), lost; asked every second for as long as a silent process
    /// takes to be ruled lost (`copy_timeout`, and a few looks of `attempt_timeout`).
    bool ruled_lost_now(const Link& link, const std::string& why) {
      const auto deadline = std::chrono::steady_clock::now() + options_.copy_timeout + 4 * options_.attempt_timeout;
      while (std::chrono::steady_clock::now() < deadline) {
        auto promise = std::make_shared<std::promise<bool>>();
        std::future<bool> ruling = promise->get_future();
        options_.copy_referee(LostProcess{link.task, 0, why}, [promise](bool lost) { promise->set_value(lost); });
        if (ruling.wait_until(deadline) != std::future_status::ready) return false;
        if (ruling.get()) return true;
        std::this_thread::sleep_for(kAskAgainAfter);
      }
      return false;
    }

    /// Ends a connection attempt: calls its `done`. With replicas, the calls and Pairs that
    /// waited for its outcome learn it: a dropped copy's were taken on by the other (drop);
    /// a copy reached again answers them kUnavailable, as a lost connection does.
    void connected(Link& link, std::error_code ec) {
      if (auto done = std::exchange(link.connected, nullptr)) done(ec);
      drop_if_lost(link, ec);
      if (!link.dropped) {  // (a dropped copy's calls went to the other: drop)
        for (PendingPtr& p : std::exchange(link.parked, {})) {
          deliver(*p, unavailable(link));
          p->detach_driver();
        }
      }
      for (const auto& weak : std::exchange(link.awaiting, {})) {
        if (const std::shared_ptr<Pair> pair = weak.lock()) settle(pair);
      }
    }

    /// A handshake frame from the ps: its challenge (answered with this task's hello), then
    /// its welcome (checked: it must prove the secret too) or its refusal.
    void on_handshake(Link& link, const wire::FrameReader::Frame& frame) {
      wire::Handshake message = wire::decode_handshake(frame.header, frame.meta);
      if (!link.challenge) {
        auto* challenge = std::get_if<wire::Challenge>(&message);
        if (challenge == nullptr) throw wire::Malformed("the ps did not open with a challenge");
        if (challenge->job != options_.credentials.job) {
          return refuse(link, "it serves job '" + challenge->job.substr(0, wire::kMaxJobName) +
                                  "', and this task belongs to job '" + options_.credentials.job + "'");
        }
        if (challenge->ps != link.task) {
          return refuse(link, "it is ps " + std::to_string(challenge->ps) + ", but is listed as ps " +
                                  std::to_string(link.task) + " (are the ps addresses in task order?)");
        }
        if (challenge->nonce.size() != wire::kNonceBytes) throw wire::Malformed("a malformed challenge");
        link.challenge = std::move(*challenge);
        link.said = wire::hello_for(options_.credentials, *link.challenge, self_, link.shard);
        link.hello = wire::encode(wire::Handshake{link.said}, 0);
        if (offers_shared_memory(link)) link.hello.header.flags = wire::kSharedMemoryFlag;
        link.write_list.append(link.hello);
        return flush(link);
      }
      if (auto* refusal = std::get_if<wire::Refusal>(&message)) {
        // Its words are quoted, its code is not trusted: whoever answers on the port has
        // proved nothing yet, and must not make a worker believe training finished.
        const std::string said = refusal->reason.substr(0, 1024);
        // kUnavailable only asks for a retry (its task is held by a process still heard):
        // the worst an impostor gets from it is retries until the recovery timeout. So does
        // kFailedPrecondition where this task was let in before: a ps started again in a
        // lost one's place knows the cluster spec's workers only until the chief restores
        // it, so it refuses a worker that joined the job since (the caller waits as for a
        // lost ps). Anything else (another secret, a task taken out) is final.
        if (refusal->code == ErrorCode::kUnavailable ||
            (refusal->code == ErrorCode::kFailedPrecondition && link.ever_connected)) {
          return fail(link, "refused by the ps for now: " + said);
        }
        link.refused = ErrorReply{ErrorCode::kUnauthenticated,
                                  "ps at " + link.address + " refused the connection: \"" + said + "\""};
        return fail(link, "refused by the ps: " + said);
      }
      auto* welcome = std::get_if<wire::Welcome>(&message);
      if (welcome == nullptr) throw wire::Malformed("the ps answered the hello with neither welcome nor refusal");
      if (!wire::welcome_proves(options_.credentials, *link.challenge, link.said, *welcome)) {
        return refuse(link, "it did not prove the job's shared secret (a ps of another job, or a "
                            "wrong PULLEY_SECRET?)");
      }
      if ((frame.header.flags & wire::kSharedMemoryFlag) != 0) {
        if (!offers_shared_memory(link))
          throw wire::Malformed("the ps took an offer of shared memory never made");
        return share_memory(link, welcome->server);
      }
      welcomed(link, welcome->server);
    }

    [[nodiscard]] bool offers_shared_memory(const Link& link) const {
      return link.local && !link.unshared && options_.shared_memory &&
             transport_detail::kSharedRings;
    }

    /// The ps took this side's offer of shared memory: this side's ring goes to it (or word
    /// that there is none), then its own comes back; the connection is welcomed once both
    /// are settled, on the rings where both ends have one, else on the socket's bytes.
    void share_memory(Link& link, std::uint64_t server) {
#if defined(__linux__)
      link.offered = transport_detail::SharedRing::make(transport_detail::kLinkRingBytes);
      if (!transport_detail::send_fd(link.socket.native_handle(),
                                     link.offered ? link.offered.fd() : -1)) {
        return fail(link, "cannot hand the ps the memory it took");
      }
      await_rings(link, server);
#else
      (void)server;
      throw wire::Malformed("the ps took an offer of shared memory never made");
#endif
    }

    void await_rings(Link& link, std::uint64_t server) {
#if defined(__linux__)
      link.receiving = true;  // (no receive may read the ps's answer as frame bytes)
      link.socket.async_wait(asio::socket_base::wait_read, [this, &link, gen = link.generation,
                                                            server](std::error_code ec) {
        if (gen != link.generation) return;
        link.receiving = false;
        if (ec) return fail(link, ec.message());
        int fd = -1;
        const int got = transport_detail::receive_fd(link.socket.native_handle(), fd);
        if (got == 0) return await_rings(link, server);  // (woken for nothing)
        if (got == -2) return fail(link, "the ps closed the connection after its welcome");
        if (got < 0) return fail(link, "the ps answered the memory it took with something else");
        transport_detail::SharedRing in;
        if (fd >= 0) {
          in = transport_detail::SharedRing::open(fd);
          if (!in || in.capacity() > transport_detail::kLinkRingBytes || !link.offered) {
            // The ps uses its rings now: this connection cannot go on, and the next ones
            // to this ps keep their bytes on the socket.
            link.unshared = true;
            return fail(link, "the ps's shared memory is not a ring this side can use");
          }
          link.rings.start(std::move(link.offered), std::move(in), link.socket);
        }
        link.offered = {};
        welcomed(link, server);
        if (gen == link.generation) receive(link);
      });
#else
      (void)link, (void)server;
#endif
    }

    /// The handshake is done: the link serves calls (or is dropped, for a process that is
    /// no copy).
    void welcomed(Link& link, std::uint64_t server) {
      link.challenge.reset();
      link.timer.cancel();
      link.state = State::kConnected;
      link.ever_connected = true;
      link.failing_since.reset();
      if (const auto asked = asked_.find(link.task); asked != asked_.end()) asked->second.told = false;
      link.last_active = std::chrono::steady_clock::now();
      link.reader.set_limits(options_.limits);
      // Another process than the one reached before: it holds nothing of the job. With a
      // copy elsewhere it is dropped (drop ends this attempt); as the last copy it is used,
      // and the job rolls back as without copies.
      if (link.lost != 0 && server == link.lost && !link.dropped && !link.renewing) {
        // A copy served again unreached (reach_again): the process given up is no copy.
        return fail(link, "the process given up answers on its address, not the one the chief took back");
      }
      const std::uint64_t before = std::exchange(link.server, server);
      if (options_.replicas == 1 && before != 0 && before != server && !link.renewing &&
          !links_[partner_of(link)]->dropped) {
        link.server = before;  // the process given up (reach_again takes only another)
        if (link.dropped) return fail(link, "another process answers on the address of a copy given up");
        return drop(link, "another process answers on its address: a ps started in place of a lost one holds nothing");
      }
      flush(link);  // the receive handler that brought the welcome arms the next receive
      connected(link, {});
    }

    /// This side refuses the ps it reached, for good.
    void refuse(Link& link, const std::string& why) {
      const std::string reason = "ps at " + link.address + " cannot be used: " + why;
      link.refused = ErrorReply{ErrorCode::kUnauthenticated, reason};
      fail(link, why);
    }

    /// Writes the requests made since the last wait in one gather-write, straight from their
    /// buffers: what the kernel takes now, the rest as the socket drains. A call's use of
    /// its buffers ends once its own frame is written.
    void flush(Link& link) {
      if (link.state != State::kConnected && link.state != State::kHandshaking) return;
      while (link.state == State::kConnected && !link.outbox.empty()) {
        PendingPtr out = std::move(link.outbox.front());
        link.outbox.pop_front();
        if (!out->use().begin_use()) {  // given up before it went out: forget it
          link.pending.erase(out->frame.header.call);
          out->detach_driver();
          continue;
        }
        link.write_list.append(out->frame);
        out->frame_end = link.write_list.appended();
        out->writing = true;
        link.writing.push_back(std::move(out));
      }
      if (link.write_waiting || link.write_list.empty()) return;
      std::error_code ec;
      if (!link.rings.write_now(link.write_list, link.socket, ec)) return fail(link, ec.message());
      while (!link.writing.empty() &&
             link.writing.front()->frame_end <= link.write_list.written()) {
        end_writing(*link.writing.front());
        link.writing.pop_front();
      }
      if (link.write_list.empty()) return link.write_list.clear();
      link.write_waiting = true;
      link.rings.async_wait_write(link.socket,
                                  [this, &link, gen = link.generation](std::error_code wait) {
                                    if (gen != link.generation) return;  // fail() reset the link
                                    link.write_waiting = false;
                                    if (wait) return fail(link, wait.message());
                                    flush(link);
                                  });
    }

    static void end_writing(Pending& p) {
      if (!std::exchange(p.writing, false)) return;
      p.sent = true;
      p.use().end_use();
    }

    /// The call a reply answers, or null if nobody waits for it any more. Throws Malformed
    /// for a reply to a request not yet sent whole: the ps answered bytes it cannot have
    /// received, so the stream is not to be trusted.
    static Pending* replied(Link& link, std::uint64_t call) {
      const auto it = link.pending.find(call);
      if (it == link.pending.end()) return nullptr;
      if (!it->second->sent) throw wire::Malformed("a reply to a request not yet sent whole");
      return it->second.get();
    }

    /// Arms a receive while calls wait for replies on the link. Between calls none is armed:
    /// re-arming right after the last reply would cost the caller a receive that finds
    /// nothing; a connection that broke meanwhile is noticed by the next call.
    void receive(Link& link) {
      if (link.receiving || link.dispatching) return;  // (the handler arms the next receive)
      if (link.state != State::kHandshaking && (link.state != State::kConnected || link.pending.empty())) {
        return;
      }
      link.receiving = true;
      if (!link.local) link.receive_buffers.watermark(link.socket, link.reader.payload_left());
      link.rings.async_read_some(
          link.socket, link.receive_buffers.of(link.reader.buffers()),
          [this, &link, gen = link.generation](std::error_code ec, std::size_t n) {
            if (gen != link.generation) return;
            link.receiving = false;
            if (ec) return fail(link, ec.message());
            // While it hands frames on, an answer may lead elsewhere to this link again (a
            // Pair settled): no second receive may start into the reader's buffers.
            link.dispatching = true;
            try {
              link.reader.commit(n);  // may fail to grow a payload buffer
              while (auto frame =
                         link.reader.next([&](const wire::Header& h, std::span<const char> meta) {
                           return route(link, h, meta);
                         })) {
                if (link.state == State::kHandshaking) {
                  on_handshake(link, *frame);
                  if (link.state != State::kConnected && link.state != State::kHandshaking) break;
                } else {
                  on_reply(link, *frame);
                }
                if (gen != link.generation)
                  break;  // failed or dropped meanwhile: the reader was reset
              }
            } catch (const std::exception& e) {  // a bad frame, or no memory: this link only
              link.dispatching = false;
              return fail(link, e.what());
            }
            link.dispatching = false;
            if (gen == link.generation) receive(link);
          });
    }

    /// Where a reply's payload goes: a reply whose tensors fit its call's targets one for
    /// one goes straight into them; anything else stays in the reader (and is decoded from
    /// there).
    static std::span<const std::span<float>> route(Link& link, const wire::Header& header,
                                                   std::span<const char> meta) {
      if (link.state != State::kConnected) return {};   // the handshake has no payload
      if (header.kind < wire::kResponseKind) return {};  // not a reply: on_reply refuses it
      if (replied(link, header.call) == nullptr) return {};
      const PendingPtr& pending = link.pending.at(header.call);
      if (pending->targets.empty()) return {};
      Response response = wire::decode_response_meta(header, meta, link.sizes);
      const auto& targets = pending->targets;
      bool fits = link.sizes.size() == targets.size();
      for (std::size_t i = 0; fits && i < targets.size(); ++i) {
        fits = link.sizes[i] == targets[i].size();
      }
      if (!fits || !pending->use().begin_use()) return {};  // a misfit, or a call given up
      link.reading = pending;
      link.reading_response = std::move(response);
      return targets;
    }

    void on_reply(Link& link, const wire::FrameReader::Frame& frame) {
      replied(link, frame.header.call);  // throws for a reply before its request
      link.last_active = std::chrono::steady_clock::now();
      const auto it = link.pending.find(frame.header.call);
      if (frame.routed) {
        const PendingPtr pending = std::exchange(link.reading, nullptr);
        Response response = std::move(link.reading_response);
        detail::point_at(response, pending->targets);
        link.pending.erase(it);
        deliver(*pending, std::move(response));
        pending->use().end_use();
        return;
      }
      Response response = wire::decode_response(frame.header, frame.meta, frame.payload);
      if (it == link.pending.end()) return;  // an answer nobody waits for any more
      const PendingPtr pending = it->second;
      link.pending.erase(it);
      if (pending->pair && pending->half == 1) {
        // The other copy's tensors are not read, only its outcome.
        if (!is_error(response) && !detail::copy_into(response, pending->targets)) {
          pending->pair->other_partial = true;
          response = Ack{};
        }
      } else if (!std::holds_alternative<ErrorReply>(response)) {
        bool fits = true;  // (a caller that gave up gets no copy, and no answer)
        pending->use().unless_cancelled([&] { fits = detail::copy_into(response, pending->targets); });
        if (!fits) {
          response = ErrorReply{ErrorCode::kInvalidArgument, "reply does not fit its targets"};
        }
      }
      deliver(*pending, std::move(response));
    }

    static Response unavailable(const Link& link) {
      if (link.refused) return ErrorReply{*link.refused};
      return ErrorReply{ErrorCode::kUnavailable,
                        "connection to ps at " + link.address + " lost: " + link.broken_reason};
    }

    /// Every call waiting on the link, sent or queued, fails with kUnavailable; with
    /// replicas, a call to a copy reached before waits once for the copy to be tried again
    /// (parked_next): the other copy takes it if this one is lost for good.
    void fail_all(Link& link, bool park = true) {
      link.outbox.clear();
      const bool may_park = park && options_.replicas == 1 && !closing_ && (link.ever_connected || link.dropped) &&
                            !links_[partner_of(link)]->dropped;
      for (auto& [id, pending] : std::exchange(link.pending, {})) {
        if (may_park && !pending->pair && !pending->parked_once) {
          pending->parked_once = true;
          link.parked_next.push_back(pending);
          continue;
        }
        deliver(*pending, unavailable(link));
        pending->detach_driver();  // answered or given up: it needs the transport no more
      }
    }

    /// The link of the other copy of `link`'s shard.
    [[nodiscard]] std::size_t partner_of(const Link& link) const {
      const std::size_t index = index_of(link);
      return index < shards_ ? shards_ + index : index - shards_;
    }

    /// The connection is gone: its handlers become stale, the uses of callers' buffers
    /// end, everything waiting on it fails, and the next call reconnects.
    void fail(Link& link, const std::string& reason) {
      if (link.state == State::kBroken) return;
      if (link.state == State::kConnected) link.failing_since = std::chrono::steady_clock::now();
      link.state = State::kBroken;
      link.broken_reason = reason;
      ++link.generation;
      std::error_code ignored;
      link.timer.cancel();
      link.resolver.cancel();
      link.rings.stop();
      link.offered = {};
      link.socket.close(ignored);  // the operations under way end without touching buffers
      for (const PendingPtr& p : std::exchange(link.writing, {})) end_writing(*p);
      link.write_list.clear();
      link.write_waiting = false;  // its wait completes as stale
      if (link.reading) std::exchange(link.reading, nullptr)->use().end_use();
      link.reader.reset();
      link.challenge.reset();
      connected(link, asio::error::connection_aborted);  // an attempt under way ends
      fail_all(link);  // (a Pair may start the next attempt: settle)
      if (!link.parked_next.empty() && !link.dropped) {  // is the copy lost? try it again
        for (PendingPtr& p : std::exchange(link.parked_next, {})) link.parked.push_back(std::move(p));
        if (link.state == State::kBroken) connect(link, [](std::error_code) {});
      }
    }

    Node self_;
    TcpOptions options_;
    asio::io_context io_{1};
    asio::executor_work_guard<asio::io_context::executor_type> work_ =
        asio::make_work_guard(io_);             ///< waits block until their deadline, never run dry
    std::size_t shards_;                        ///< ps tasks: their shards
    /// Per shard: its last WaitReady was answered by one copy, the other out of reach.
    std::vector<bool> ready_alone_ = std::vector<bool>(shards_, false);
    std::vector<std::unique_ptr<Link>> retired_;  ///< links of add_ps calls that failed
    std::vector<std::uint32_t> members_;          ///< the job's ps tasks (place_copies); empty: all
    std::vector<std::unique_ptr<Link>> links_;  ///< by ps task, then copies by shard; destroyed before io_
    bool closing_ = false;                      ///< the transport is being destroyed
    std::vector<std::weak_ptr<Pair>> graced_;   ///< Pairs with a copy_grace timer on io_
    std::uint64_t next_call_ = 1;
    /// The referee is asked about a process at most this often (copy_referee).
    static constexpr std::chrono::seconds kAskAgainAfter{1};
    std::map<std::uint32_t, Asked> asked_;      ///< by ps task: the referee's questions
    std::shared_ptr<Rulings> rulings_ = std::make_shared<Rulings>();
  };

  std::unique_ptr<Impl> impl_;
};
static_assert(GrowingTransport<Tcp>);
static_assert(CopyingTransport<Tcp>);

}  // namespace pulley
