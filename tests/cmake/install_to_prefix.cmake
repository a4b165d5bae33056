# SPDX-License-Identifier: MIT
#
# ctest fixture: installs the pulley build in BUILD_DIR into a fresh PREFIX.
#   cmake -DBUILD_DIR=<dir> -DPREFIX=<dir> [-DCONFIG=<cfg>] -P install_to_prefix.cmake
file(REMOVE_RECURSE "${PREFIX}")
set(config_args "")
if(CONFIG)
  set(config_args --config "${CONFIG}")
endif()
execute_process(
  COMMAND "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${PREFIX}" ${config_args}
  RESULT_VARIABLE result)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "cmake --install ${BUILD_DIR} --prefix ${PREFIX} failed (${result})")
endif()
