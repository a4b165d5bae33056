# SPDX-License-Identifier: MIT
#
# ctest driver for one compile-fail test:
#   cmake -DSOURCE=<file.cpp> -DBUILD_DIR=<dir> -DTARGET=<object library> [-DCONFIG=<cfg>]
#         -P compile_fail.cmake
# Builds TARGET (an EXCLUDE_FROM_ALL object library holding only SOURCE, with pulley's
# include dirs and warning flags) and passes only when the build FAILS and its output
# matches the regex on SOURCE's first line, `// expect: <regex>`.
foreach(var SOURCE BUILD_DIR TARGET)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "compile_fail.cmake: -D${var}=... is required")
  endif()
endforeach()

file(STRINGS "${SOURCE}" first_line LIMIT_COUNT 1)
if(NOT first_line MATCHES "^//[ \t]*expect:[ \t]*(.+)$")
  message(FATAL_ERROR "${SOURCE}: the first line must be `// expect: <regex>`")
endif()
string(STRIP "${CMAKE_MATCH_1}" expect)

set(config_args "")
if(CONFIG)
  set(config_args --config "${CONFIG}")
endif()
execute_process(
  COMMAND "${CMAKE_COMMAND}" --build "${BUILD_DIR}" --target "${TARGET}" ${config_args}
  RESULT_VARIABLE result
  OUTPUT_VARIABLE output
  ERROR_VARIABLE output)

# message(FATAL_ERROR) rewraps its text, so the build output goes out verbatim first.
if(result EQUAL 0)
  message(NOTICE "${output}")
  message(FATAL_ERROR "${SOURCE} compiled, but it must not.")
endif()
if(NOT output MATCHES "${expect}")
  message(NOTICE "${output}")
  message(FATAL_ERROR "${SOURCE} failed to compile, as it should, but the build output "
    "above does not match its `// expect:` regex: ${expect}")
endif()
message(STATUS "${SOURCE}: rejected as expected (matched `${expect}`)")
