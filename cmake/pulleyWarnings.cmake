# SPDX-License-Identifier: MIT
#
# pulley_target_warnings(<target>): the warning set for pulley's own targets (tests,
# examples, benchmarks). Never attached to pulley::pulley itself, so consumers keep
# their own flags, and dependencies come in as SYSTEM headers so their warnings stay theirs.
include_guard(GLOBAL)

function(pulley_target_warnings target)
  set(gnu_like -Wall -Wextra -Wpedantic -Wshadow -Wconversion)
  set(msvc /W4 /permissive-)
  if(PULLEY_WARNINGS_AS_ERRORS)
    list(APPEND gnu_like -Werror)
    list(APPEND msvc /WX)
  endif()
  target_compile_options(${target} PRIVATE
    "$<$<CXX_COMPILER_ID:GNU,Clang,AppleClang>:${gnu_like}>"
    "$<$<CXX_COMPILER_ID:MSVC>:${msvc}>")
endfunction()
