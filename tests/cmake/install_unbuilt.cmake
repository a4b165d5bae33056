# SPDX-License-Identifier: MIT
#
# ctest: README's install line, run as printed on a tree that is configured and not built
# (`cmake -S SOURCE -B build`, nothing else), with its prefix (/opt/pulley) replaced by
# WORK/prefix; the headers and the CMake package must land there.
#   cmake -DSOURCE=<dir> -DWORK=<dir> -DGENERATOR=<gen> -P install_unbuilt.cmake
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")
file(READ "${SOURCE}/README.md" readme)
string(REGEX MATCH "cmake --install build --prefix /opt/pulley" line "${readme}")
if(NOT line)
  message(FATAL_ERROR "README.md no longer prints `cmake --install build --prefix /opt/pulley`")
endif()
execute_process(COMMAND "${CMAKE_COMMAND}" -S "${SOURCE}" -B build -G "${GENERATOR}"
                WORKING_DIRECTORY "${WORK}" RESULT_VARIABLE configured OUTPUT_QUIET)
if(NOT configured EQUAL 0)
  message(FATAL_ERROR "cmake -S ${SOURCE} -B build failed (${configured})")
endif()
string(REPLACE "/opt/pulley" "${WORK}/prefix" line "${line}")
separate_arguments(command UNIX_COMMAND "${line}")
list(POP_FRONT command)  # "cmake": the one running this script
message(STATUS "running, in ${WORK}: cmake ${command}")
execute_process(COMMAND "${CMAKE_COMMAND}" ${command} WORKING_DIRECTORY "${WORK}" RESULT_VARIABLE installed)
if(NOT installed EQUAL 0)
  message(FATAL_ERROR "README's install line failed on a tree not built (${installed})")
endif()
foreach(file include/pulley/pulley.hpp share/cmake/pulley/pulleyConfig.cmake)
  if(NOT EXISTS "${WORK}/prefix/${file}")
    message(FATAL_ERROR "the install holds no ${file}")
  endif()
endforeach()
file(REMOVE_RECURSE "${WORK}")
