// SPDX-License-Identifier: MIT
#pragma once

/// The TCP client's machinery behind `Tcp` (transport/tcp_client.hpp): its connections
/// (links), the calls on them, and the pairs of calls that reach both copies of a shard.
/// The class is declared here, every member with its comment; the member functions are
/// defined by concern in five headers included at the end of this one:
///   - tcp_client_calls.hpp: the transport made and closed, calls made, their frames
///     written and their replies read, what waited on a lost connection failed, and what
///     `Tcp` answers about a connection (address, local, shared_memory);
///   - tcp_client_connect.hpp: a ps added, connecting, the handshake, local sockets and
///     shared memory;
///   - tcp_client_copies.hpp: the copies of each shard: where each copy is (placed, moved,
///     renumbered), where a call goes, and which copies are whole or given up;
///   - tcp_client_pairs.hpp: how the answers of both copies settle into one (WaitReady's
///     too, and the grace a copy not ready is given);
///   - tcp_client_losses.hpp: when a copy is dropped or given up, what the referee rules,
///     and a ps's copies reached and served again.
/// `Tcp` documents the behaviour; the comments here say how each part gets it.

#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <asio.hpp>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
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

namespace pulley::transport_detail {

/// The state of one `Tcp`: every link, and what waits on them. Used from one thread at a
/// time (the caller's, while it waits: run_until), as `Tcp` says.
class TcpClient final : public CallDriver {
 public:
  TcpClient(Node self, std::vector<Address> addresses, TcpOptions options,
            std::optional<std::span<const std::uint32_t>> reach_now = std::nullopt);

  TcpClient(const TcpClient&) = delete;
  TcpClient& operator=(const TcpClient&) = delete;

  ~TcpClient();

  // What Tcp offers (its comments say what each does).

  [[nodiscard]] std::size_t num_ps() const noexcept { return shards_; }
  PendingCall call(std::size_t ps, Request&& request, PullTargets targets);
  void add_ps(Address where, bool connect_now);
  void place_copies(std::span<const std::uint32_t> members);
  [[nodiscard]] std::vector<std::uint32_t> given_up() const;
  [[nodiscard]] bool given_up_whole(std::uint32_t ps) const;
  [[nodiscard]] bool copies_whole() const;
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
  bool reach_again(std::uint32_t ps, bool serve, bool unreached_too);
  void serve_again(std::uint32_t ps);
  void give_up(std::uint32_t ps, const std::string& why);
  [[nodiscard]] std::string address(std::size_t ps) const;
  [[nodiscard]] bool local(std::size_t ps) const;
  [[nodiscard]] bool shared_memory(std::size_t ps) const;

  // CallDriver: a caller waits, or gives a call up.

  void run_until(const std::function<bool()>& done,
                 std::chrono::steady_clock::time_point deadline) override;

  void abort(CallControl& call) override;

 private:
  struct Pair;

  /// One call on one connection: what the caller shares with the transport, and the frame
  /// to send. Half of a call sent to both copies of a shard (`pair`) shares the caller's
  /// control, the Pair: its uses of the caller's buffers are the Pair's, and its answer
  /// goes to the Pair.
  struct Pending : CallControl {
    Pending(CallDriver* driver, std::size_t link_index) : CallControl(driver), ps(link_index) {}
    std::size_t ps;  ///< the link it is on
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
    bool both_ready;        ///< WaitReady: answered once both copies are ready (`copy_grace`)
    bool followed = false;  ///< both_ready: answered by the newer membership (settle_ready)
    std::array<std::weak_ptr<Pending>, 2> halves;
    std::array<std::size_t, 2> links{};  ///< the link of each half
    std::array<std::optional<Response>, 2> answers;
    std::array<bool, 2> waited{};  ///< a half's connection was tried again once
    /// The other copy's answer lacks what the caller asked (a gate, tensors unread).
    bool other_partial = false;
    bool refusal_stands = false;  ///< ChangeWorkers: a refusal by one copy is the answer
    /// Shutdown: a copy the call may not have reached (kUnavailable) is the answer when the
    /// other says training ended: the chief sends it again until both have it.
    bool unreached_stands = false;
    std::unique_ptr<asio::steady_timer> grace;  ///< both_ready: the laggard's time
  };

  enum class State { kConnected, kConnecting, kHandshaking, kBroken };

  /// One connection. Every handler captures the `generation` it was started in and ignores
  /// its completion once the connection was replaced.
  struct Link {
    Link(asio::io_context& io, Address where, const wire::FrameLimits& limits,
         std::uint32_t ps_task, std::uint32_t shard_asked)
        : task(ps_task),
          shard(shard_asked),
          address(where.to_string()),
          host(std::move(where.host)),
          port(std::to_string(where.port)),
          socket(io),
          resolver(io),
          timer(io),
          reader(limits) {}

    std::uint32_t task;           ///< the ps it reaches, as its challenge must name it
    std::uint32_t shard;          ///< the shard it asks for (wire::Hello::shard)
    bool ever_connected = false;  ///< a handshake completed once
    bool dropped = false;         ///< a copy given up (replicas), until served again
    bool renewing = false;        ///< reach_again's attempt: a new process is what it looks for
    bool renewed = false;         ///< given up, and reached again in a new process (not served yet)
    std::string not_back;         ///< why reach_again last failed here, as logged (once a reason)
    /// Replicas: calls whose connection broke, waiting for the attempt to reach the copy
    /// again (`parked`, then `parked_next` for the attempt after it): dropped, the other
    /// copy takes them; reached, they fail kUnavailable as without copies.
    std::vector<PendingPtr> parked, parked_next;
    std::vector<std::weak_ptr<Pair>> awaiting;  ///< Pairs that wait for that attempt too
    std::uint64_t server = 0;  ///< the ps process it reached (wire::Welcome::server), 0: none yet
    /// The process it was given up for losing (its `server` then), 0: none, or one given up
    /// only for not being ready yet (it may be the one the chief takes back), or unreached:
    /// reach_again takes any process but this one (and, when 0, asks the referee about
    /// the one it reaches: reached_ruled_lost).
    std::uint64_t lost = 0;
    /// Replicas: since when the copy has been out of reach (a connection broke and no new
    /// one completed), for `TcpOptions::copy_timeout`.
    std::optional<std::chrono::steady_clock::time_point> failing_since;
    bool dispatching = false;  ///< its receive handler is handing frames on: no second receive
    std::string address;       ///< "host:port", for messages
    std::string host;
    std::string port;
    StreamSocket socket;
    bool local = false;     ///< `socket` is (being) connected to the ps's local socket
    SharedRings rings;      ///< its bytes' path once both ends took shared memory
    SharedRing offered;     ///< this side's ring, until the ps answers with its own
    bool unshared = false;  ///< the ps's ring could not be used: no more offers to it
    asio::ip::tcp::resolver resolver;
    asio::steady_timer timer;  ///< bounds a connection attempt
    State state = State::kBroken;
    std::uint64_t generation = 0;
    std::string broken_reason = "not connected";
    std::optional<ErrorReply> refused;               ///< the last handshake failed for good: why
    std::optional<wire::Challenge> challenge;        ///< the ps's, while handshaking
    wire::Hello said;                                ///< this side's hello, while handshaking
    wire::Frame hello;                               ///< it encoded, being written
    std::function<void(std::error_code)> connected;  ///< the attempt's `done`
    wire::FrameReader reader;
    ReceiveBuffers receive_buffers;
    std::map<std::uint64_t, PendingPtr> pending;  ///< sent or queued, awaiting a reply
    std::deque<PendingPtr> outbox;                ///< made since the caller last waited
    std::deque<PendingPtr> writing;               ///< in write_list, not all written yet
    GatherList write_list;                        ///< their frames, as the kernel takes them
    bool write_waiting = false;                   ///< waits for the socket to take more
    bool receiving = false;                       ///< a receive is armed
    PendingPtr reading;              ///< the call whose reply is being received into its targets
    Response reading_response;       ///< that reply, decoded but for its tensors' values
    std::vector<std::size_t> sizes;  ///< scratch: tensor sizes of a reply to route
    std::chrono::steady_clock::time_point last_active;  ///< the last reply, or connection
    /// Replicas: when the ps last showed life (bytes came: its handshake, a reply; or it
    /// took bytes this side waited to write), and since when the process, silent while
    /// calls wait, has been asked a question it answers at once (look_at_silence).
    std::chrono::steady_clock::time_point heard;
    std::optional<std::chrono::steady_clock::time_point> asked_since;
  };

  // Calls and their bytes (tcp_client_calls.hpp).

  /// An attempt runs only while a caller waits (run_until). One left behind by a wait that
  /// ended on another link's failure, whose attempt_timeout passed since, would fail the
  /// next call at once, when the caller waits again: it ends now (as its timer would have:
  /// a copy out of reach long enough may be dropped, and the call then goes to the other),
  /// and the call begins a new one.
  void begin_again_if_stale(Link& link);

  /// Sends `request` on link `index` alone.
  PendingCall call_on(std::size_t index, Request&& request, PullTargets targets);

  /// Queues `pending`'s frame of `request` on `link`, reconnecting it if it is broken.
  void queue(Link& link, PendingPtr pending, const Request& request);

  /// True if the ps closed a connection that has been quiet for a second or more (it
  /// closes idle ones: TcpServerOptions::idle_timeout), so that a call made now goes out
  /// on a new connection instead of failing on the old one. A busy link is not asked:
  /// one look costs a system call.
  static bool closed_while_quiet(Link& link);

  void abort_one(Pending& pending);

  /// A call's answer: to its caller, or to the Pair it is half of.
  void deliver(Pending& pending, Response&& response);

  /// Writes the requests made since the last wait in one gather-write, straight from their
  /// buffers: what the kernel takes now, the rest as the socket drains. A call's use of
  /// its buffers ends once its own frame is written.
  void flush(Link& link);

  static void end_writing(Pending& p);

  /// The call a reply answers, or null if nobody waits for it any more. Throws Malformed
  /// for a reply to a request not yet sent whole: the ps answered bytes it cannot have
  /// received, so the stream is not to be trusted.
  static Pending* replied(Link& link, std::uint64_t call);

  /// Arms a receive while calls wait for replies on the link. Between calls none is armed:
  /// re-arming right after the last reply would cost the caller a receive that finds
  /// nothing; a connection that broke meanwhile is noticed by the next call.
  void receive(Link& link);

  /// Where a reply's payload goes: a reply whose tensors fit its call's targets one for
  /// one goes straight into them; anything else stays in the reader (and is decoded from
  /// there).
  static std::span<const std::span<float>> route(Link& link, const wire::Header& header,
                                                 std::span<const char> meta);

  void on_reply(Link& link, const wire::FrameReader::Frame& frame);

  static Response unavailable(const Link& link);

  /// Every call waiting on the link, sent or queued, fails with kUnavailable; with
  /// replicas, a call to a copy reached before waits once for the copy to be tried again
  /// (parked_next): the other copy takes it if this one is lost for good.
  void fail_all(Link& link, bool park = true);

  /// The connection is gone: its handlers become stale, the uses of callers' buffers
  /// end, everything waiting on it fails, and the next call reconnects.
  void fail(Link& link, const std::string& reason);

  // Connections (tcp_client_connect.hpp).

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
  void connect_all(std::optional<std::span<const std::uint32_t>> reach_now);

  /// Connects one of `links`, whichever answers first: one attempt at each in turn,
  /// with backoff, for up to `patience`; false when none did. Throws when one refuses
  /// this task at its handshake (another job, say).
  bool connect_first(std::initializer_list<Link*> links, std::chrono::milliseconds patience);

  void connect_with_backoff(Link& link, std::chrono::milliseconds patience);

  /// One connection attempt of at most attempt_timeout, handshake included; `done(ec)`
  /// follows, with the link connected (and receiving) or broken with the reason (and
  /// `refused` set when the handshake failed for good).
  template <class Done>
  void connect(Link& link, Done done);

  /// The local socket names to try for a ps at `address`:`port` (none unless it is this
  /// host's and TcpOptions::local_sockets).
  [[nodiscard]] std::vector<std::string> local_names(const asio::ip::address& address,
                                                     std::uint16_t port) const;

  /// Connects `link` to the first of `names` from `next` on that takes it, then calls
  /// `finish`; when none does (no ps listens under them), calls `over_tcp` on a fresh
  /// socket. A local connection is taken or refused at once, so this adds nothing to a
  /// TCP attempt; the attempt's deadline covers both.
  template <class Finish, class OverTcp>
  void reach_locally(Link& link, std::uint64_t gen, std::shared_ptr<bool> timed_out,
                     std::vector<std::string> names, std::size_t next, Finish finish,
                     OverTcp over_tcp);

  /// Ends a connection attempt: calls its `done`. With replicas, the calls and Pairs that
  /// waited for its outcome learn it: a dropped copy's were taken on by the other (drop);
  /// a copy reached again answers them kUnavailable, as a lost connection does.
  void connected(Link& link, std::error_code ec);

  /// A handshake frame from the ps: its challenge (answered with this task's hello), then
  /// its welcome (checked: it must prove the secret too) or its refusal.
  void on_handshake(Link& link, const wire::FrameReader::Frame& frame);

  [[nodiscard]] bool offers_shared_memory(const Link& link) const;

  /// The ps took this side's offer of shared memory: this side's ring goes to it (or word
  /// that there is none), then its own comes back; the connection is welcomed once both
  /// are settled, on the rings where both ends have one, else on the socket's bytes.
  void share_memory(Link& link, std::uint64_t server);

  void await_rings(Link& link, std::uint64_t server);

  /// The handshake is done: the link serves calls (or is dropped, for a process that is
  /// no copy).
  void welcomed(Link& link, std::uint64_t server);

  /// This side refuses the ps it reached, for good.
  void refuse(Link& link, const std::string& why);

  // The copies of each shard (tcp_client_copies.hpp; the answers of both settled,
  // tcp_client_pairs.hpp; a copy dropped, given up or ruled on, tcp_client_losses.hpp).

  /// Where a request goes when the job keeps copies: to the copy read from, to both, to
  /// both and answered once both are ready (WaitReady), or its values from the copy read from
  /// and a wait for the same step from the other (a Pull that waits for a step).
  enum class Spread { kOne, kBoth, kBothReady, kGate };

  [[nodiscard]] Spread spread_of(const Request& request) const noexcept;

  /// The link of copy `copy` (0: ps k's own, 1: the one ps k + 1 holds) of shard `shard`.
  [[nodiscard]] std::size_t link_of(std::size_t shard, std::size_t copy) const noexcept;

  /// The link of the other copy of `link`'s shard.
  [[nodiscard]] std::size_t partner_of(const Link& link) const;

  [[nodiscard]] std::size_t index_of(const Link& link) const;

  /// True if ps `ps` is a member of the job, as place_copies last said (all until then).
  [[nodiscard]] bool member(std::uint32_t ps) const;

  /// The copies' links move `by` places (a ps added before them, or taken back out): what
  /// names them by place (each call's link, each Pair's two) follows.
  void renumber_copies(std::ptrdiff_t by);

  /// Logs a change of the copies, unless another transport of this task says it.
  void log_copies(LogLevel level, const std::string& line) const;

  /// An error, of any code.
  static bool is_error(const Response& response);
  /// Training's end: finished, or aborted.
  static bool is_ended(const Response& response);
  static bool is_unavailable(const Response& response);

  /// Answers a Pair once its halves allow: both answers in (the one read from), or the
  /// ready one for WaitReady; a dropped copy's half is not waited for.
  void settle(const std::shared_ptr<Pair>& held);

  /// WaitReady to both copies: answered once both are ready (ps k's own copy's answer),
  /// or by the ready one when the other is gone or refuses. Answering when only one is
  /// ready would let a worker push to a copy the chief's Initialize has not reached yet
  /// (it comes on another connection). A copy still not ready `copy_grace` after the
  /// other was is a process started in a lost one's place, holding nothing: it is
  /// dropped, and the call answered by the copy left. So is one ready at an older
  /// membership or epoch than the other.
  void settle_ready(const std::shared_ptr<Pair>& held, bool a_gone, bool b_gone);

  [[nodiscard]] static bool grace_over(const Pair& pair) {
    return pair.grace && pair.grace->expiry() <= asio::steady_timer::clock_type::now();
  }

  void start_grace(const std::shared_ptr<Pair>& pair);

  /// Answers `pair` with half `half`'s answer. (Which copy is read from changes only when
  /// one is dropped: every task reads ps k's own copy while it can, tokens included.)
  void answer_pair(Pair& pair, std::size_t half);

  /// Logs why reach_again failed at `link`, once for each reason in a row.
  void not_back(Link& link, const std::string& why);
  /// Gives up a copy for good: calls waiting on it go to the other copy (halves of a
  /// Pair are just no longer waited for), and the other copy is read from.
  void drop(Link& link, const std::string& why, bool lost = true);

  /// Shard `shard`'s copy moved to ps `holder` (place_copies): the connection to the ps
  /// that held it ends (reset, as drop closes one), what waited on it fails with
  /// kUnavailable (a call to both copies then fails so too: the caller sends again), and
  /// the link reaches `holder` at its next call. Until it first does, it counts as out of
  /// reach since the move (copy_timeout), and a refusal there is "for now" where `holder`
  /// let this task in before, as on `holder`'s own link.
  void move_copy(Link& link, std::uint32_t shard, std::uint32_t holder);

  /// With copies, while a caller waits: arms look_at_silence, every quarter of
  /// `copy_timeout`, unless it is armed already.
  void watch_silence();

  /// A process stopped or hung keeps its connections open, so no error ever says that a
  /// copy is out of reach: a connected copy with calls waiting (a step's pull may wait
  /// long) that has shown no life (Link::heard) for half of `copy_timeout` is asked a
  /// question it answers at once (GetStats), and one that still shows none, `copy_timeout`
  /// after the last sign, is out of reach since then: its connection ends as a broken one
  /// does, and the next attempt that fails asks the referee (drop_if_lost), which rules by
  /// its own look. Bytes that wait unread (this side's caller was away) are a sign of
  /// life.
  void look_at_silence();

  /// After an attempt that failed with `ec`: a copy reached before and not now is lost for
  /// good once its address refuses (no process listens there), or after `copy_timeout`
  /// out of reach (a host gone): it is dropped, or, with a referee, the referee is asked
  /// whether its process is lost for the job.
  void drop_if_lost(Link& link, std::error_code ec);

  /// What this transport asked the referee of one ps process, and heard.
  struct Asked {
    bool in_flight = false;
    std::chrono::steady_clock::time_point answered;  ///< when the last answer came
    bool told = false;  ///< the wait for this process is logged (until it is reached again)
  };
  /// The referee's answers, handed from whatever thread gives them to this transport's.
  struct Rulings {
    std::mutex mutex;
    TcpClient* client = nullptr;  ///< null once the transport is gone
  };

  /// Asks the referee whether the process behind `link` (and every copy it holds) is lost
  /// for the job: once at a time, and not again within a second of its last answer.
  void ask_referee(Link& link, std::string why);

  /// The referee's answer about process `process` of ps `task`: lost, every copy it holds
  /// is dropped (the last copy of a shard excepted); not lost, this task waits for it.
  void ruled(std::uint32_t task, std::uint64_t process, const std::string& why, bool lost);

  /// At construction: true if the referee rules ps `link.task`'s process, which this task
  /// never reached (`why`), lost; asked every second for as long as a silent process
  /// takes to be ruled lost (`copy_timeout`, and a few looks of `attempt_timeout`).
  bool ruled_lost_now(const Link& link, const std::string& why);

  /// The referee's answer, waited for until `deadline`, on process `process` of ps `task`
  /// (0: whichever process this task would reach there; `reached`: LostProcess::reached);
  /// nullopt when none came in time.
  std::optional<bool> ask_referee_now(std::uint32_t task, std::uint64_t process,
                                      const std::string& why,
                                      std::chrono::steady_clock::time_point deadline,
                                      bool reached = false);

  /// True if the referee ruled the process `link` reached lost for the job: one stopped or
  /// cut off past the copy timeout, then continued, whose copies are old. A link reaches
  /// one so where this task never reached the process given up there: at construction,
  /// after its first attempt missed (the process was stopped, and continued since), and in
  /// reach_again when the copy was given up unreached (`Link::lost` is 0). Asked once,
  /// waited for a look or two (`attempt_timeout` each); no answer in time: not lost.
  bool reached_ruled_lost(const Link& link);

  Node self_;
  TcpOptions options_;
  asio::io_context io_{1};
  asio::executor_work_guard<asio::io_context::executor_type> work_ =
      asio::make_work_guard(io_);  ///< waits block until their deadline, never run dry
  std::size_t shards_;             ///< ps tasks: their shards
  /// Per shard: its last WaitReady was answered by one copy, the other out of reach.
  std::vector<bool> ready_alone_ = std::vector<bool>(shards_, false);
  std::vector<std::unique_ptr<Link>> retired_;  ///< links of add_ps calls that failed
  std::vector<std::uint32_t> members_;          ///< the job's ps tasks (place_copies); empty: all
  /// By ps task, then the copies by shard; destroyed before io_.
  std::vector<std::unique_ptr<Link>> links_;
  asio::steady_timer watch_{io_};  ///< look_at_silence's, while armed (`watching_`)
  bool watching_ = false;
  bool closing_ = false;                     ///< the transport is being destroyed
  std::vector<std::weak_ptr<Pair>> graced_;  ///< Pairs with a copy_grace timer on io_
  std::uint64_t next_call_ = 1;
  /// The referee is asked about a process at most this often (copy_referee).
  static constexpr std::chrono::seconds kAskAgainAfter{1};
  std::map<std::uint32_t, Asked> asked_;  ///< by ps task: the referee's questions
  std::shared_ptr<Rulings> rulings_ = std::make_shared<Rulings>();
};

}  // namespace pulley::transport_detail

// The member functions' definitions, by concern.
#include "pulley/transport/detail/tcp_client_calls.hpp"
#include "pulley/transport/detail/tcp_client_connect.hpp"
#include "pulley/transport/detail/tcp_client_copies.hpp"
#include "pulley/transport/detail/tcp_client_losses.hpp"
#include "pulley/transport/detail/tcp_client_pairs.hpp"
