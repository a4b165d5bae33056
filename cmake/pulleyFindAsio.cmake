# SPDX-License-Identifier: MIT
#
# Provides the IMPORTED INTERFACE target asio::asio for standalone Asio (header-only,
# no Boost) when it can be found, and sets pulley_asio_FOUND. Debian's libasio-dev ships no
# CMake package, so we look for asio.hpp; a package manager's asio config (vcpkg, Conan)
# is used first when present. Hint: -DASIO_ROOT=<prefix> or -DPULLEY_ASIO_INCLUDE_DIR=<dir>.
# Included by pulley's CMakeLists.txt and by the installed pulleyConfig.cmake.
include_guard(GLOBAL)

if(NOT TARGET asio::asio)
  find_package(asio CONFIG QUIET)
endif()

if(NOT TARGET asio::asio)
  find_path(PULLEY_ASIO_INCLUDE_DIR
    NAMES asio.hpp
    HINTS "${ASIO_ROOT}" "$ENV{ASIO_ROOT}"
    PATH_SUFFIXES include asio/include
    DOC "Directory holding standalone Asio's asio.hpp")
  mark_as_advanced(PULLEY_ASIO_INCLUDE_DIR)
  if(PULLEY_ASIO_INCLUDE_DIR)
    if(NOT TARGET Threads::Threads)
      find_package(Threads REQUIRED)
    endif()
    # GLOBAL: when pulley is added with add_subdirectory, the parent's targets that link
    # pulley::tcp must see it too.
    add_library(asio::asio INTERFACE IMPORTED GLOBAL)
    set_target_properties(asio::asio PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES "${PULLEY_ASIO_INCLUDE_DIR}"
      INTERFACE_COMPILE_DEFINITIONS "ASIO_STANDALONE"
      INTERFACE_LINK_LIBRARIES Threads::Threads)
  endif()
endif()

if(TARGET asio::asio)
  set(pulley_asio_FOUND TRUE)
else()
  set(pulley_asio_FOUND FALSE)
endif()
