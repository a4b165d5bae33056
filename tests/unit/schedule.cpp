// SPDX-License-Identifier: MIT
// The chief's calendar (runner/schedule.hpp): which step it waits for next and what is due
// there, through checkpoints by steps and by time, a resume and a rollback.
#include "pulley/runner/schedule.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

using pulley::ChiefSchedule;
using namespace std::chrono_literals;

namespace {

const ChiefSchedule::Clock::time_point kT0{};

/// "20:e 25:c 40:e 60:cel" — each step due, with e (evaluation), c (checkpoint), l (last),
/// acting on each as the chief does (a checkpoint is written at its step).
std::string walk(ChiefSchedule schedule) {
  std::string out;
  for (int guard = 0; !schedule.done() && guard < 100; ++guard) {
    const auto due = schedule.next();
    if (!out.empty()) out += ' ';
    out += std::to_string(due.step);
    out += ':';
    if (due.checkpoint) out += 'c';
    if (due.evaluation) out += 'e';
    if (due.last) out += 'l';
    if (due.checkpoint) schedule.saved(due.step, kT0);
    if (due.evaluation) schedule.evaluated();
  }
  return out;
}

}  // namespace

TEST_CASE("evaluations every n steps and at the last, with no checkpoint directory") {
  CHECK(walk(ChiefSchedule({60, 20, false, 0, 0s}, 0, kT0)) == "20:e 40:e 60:el");
  CHECK(walk(ChiefSchedule({60, 0, false, 0, 0s}, 0, kT0)) == "60:el");
  CHECK(walk(ChiefSchedule({50, 20, false, 0, 0s}, 0, kT0)) == "20:e 40:e 50:el");
  // Checkpoints by steps need a directory: without one, none are due.
  CHECK(walk(ChiefSchedule({60, 20, false, 25, 600s}, 0, kT0)) == "20:e 40:e 60:el");
}

TEST_CASE("checkpoints every n steps interleave with evaluations, and the last step has both") {
  CHECK(walk(ChiefSchedule({60, 20, true, 25, 0s}, 0, kT0)) == "20:e 25:c 40:e 50:c 60:cel");
  CHECK(walk(ChiefSchedule({60, 20, true, 20, 0s}, 0, kT0)) == "20:ce 40:ce 60:cel");
  // With a directory and no checkpoints by steps, the last step still has one.
  CHECK(walk(ChiefSchedule({60, 30, true, 0, 0s}, 0, kT0)) == "30:e 60:cel");
}

TEST_CASE("a checkpoint cut late, at the last step, is that step's: it is not written twice") {
  ChiefSchedule schedule({40, 0, true, 10, 0s}, 0, kT0);
  CHECK(schedule.next().step == 10);
  schedule.saved(40, kT0);  // the workers outran the chief: the cut due at 10 came at 40
  const auto due = schedule.next();
  CHECK(due.step == 40);
  CHECK(due.evaluation);
  CHECK_FALSE(due.checkpoint);
}

TEST_CASE("a checkpoint by time is due save_secs after the last one, wherever training is") {
  ChiefSchedule schedule({1000, 100, true, 0, 600s}, 0, kT0);
  CHECK(schedule.next().deadline == kT0 + 600s);
  schedule.saved(37, kT0 + 600s);  // written by time, at step 37
  CHECK(schedule.next().deadline == kT0 + 1200s);
  CHECK(schedule.next().step == 100);  // the evaluation is still what is waited for
  ChiefSchedule untimed({1000, 100, true, 0, 0s}, 0, kT0);
  CHECK(untimed.next().deadline == ChiefSchedule::Clock::time_point::max());
}

TEST_CASE("a resumed or rolled back job evaluates again from the step it is at") {
  // Resumed at step 45 of 60: evaluations after 45 only.
  CHECK(walk(ChiefSchedule({60, 20, true, 25, 0s}, 45, kT0)) == "50:c 60:cel");
  // Resumed from the checkpoint of the last step: its evaluation once more, to end cleanly,
  // and no second checkpoint of that step.
  CHECK(walk(ChiefSchedule({60, 20, true, 25, 0s}, 60, kT0)) == "60:el");
  // Rolled back from 40 to the checkpoint of step 25: the evaluation of 40 is due again,
  // and the next checkpoint counts from 25.
  ChiefSchedule schedule({60, 20, true, 25, 0s}, 0, kT0);
  schedule.evaluated();   // 20
  schedule.saved(25, kT0);
  schedule.evaluated();   // 40
  schedule.restart(25, kT0 + 5s);
  CHECK(walk(schedule) == "40:e 50:c 60:cel");
}
