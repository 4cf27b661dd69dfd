# Build glue for the external dependencies. Everything the project links comes through the
# `trainer_deps` interface target, so the rest of the tree never calls find_package.
#
# LibTorch: Debian's libtorch-dev (1.13, CPU) is found with no hints. Any other LibTorch (pytorch.org's
# zip, or the `torch` folder of PyTorch's pip wheel, which is the same layout) is named by its root:
#   -DCMAKE_PREFIX_PATH=/path/to/libtorch
#   -DCMAKE_PREFIX_PATH=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')
# scripts/install-torch.sh sets this up for the pinned wheel (torch==2.11.0, CUDA 13.0).
# A CUDA LibTorch needs nvcc at configure time (its TorchConfig runs find_package(CUDAToolkit)).
if(NOT DEFINED CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
  set(ENV{CUDACXX} /usr/local/cuda/bin/nvcc)
endif()
find_package(Torch REQUIRED)
# TorchConfig.cmake looks for libtorch.so and libc10.so on the system's library path before its own
# lib/: with Debian's libtorch-dev installed, 2.x headers would be linked against 1.13 libraries. That
# happens when CMAKE_PREFIX_PATH names torch/share/cmake (torch.utils.cmake_prefix_path) instead of
# the LibTorch root. Stop with the fix rather than build a binary that mixes versions.
get_filename_component(_torch_own_lib "${TORCH_INSTALL_PREFIX}/lib" REALPATH)
set(TRAINER_SELF_CONTAINED_TORCH OFF)  # pytorch.org's zip or the wheel (not Debian's split packages)
if(EXISTS "${_torch_own_lib}/libtorch.so")
  set(TRAINER_SELF_CONTAINED_TORCH ON)
  foreach(_lib IN ITEMS TORCH_LIBRARY c10_LIBRARY)
    get_filename_component(_found "${${_lib}}" REALPATH)
    get_filename_component(_found_dir "${_found}" DIRECTORY)
    if(NOT _found_dir STREQUAL _torch_own_lib)
      message(FATAL_ERROR "trainer: LibTorch ${Torch_VERSION} is in ${TORCH_INSTALL_PREFIX}, but ${_lib} "
        "resolved to ${${_lib}} (another LibTorch on the system). Configure a fresh build folder with "
        "-DCMAKE_PREFIX_PATH=${TORCH_INSTALL_PREFIX} (the LibTorch root, not its share/cmake).")
    endif()
  endforeach()
endif()
find_package(spdlog REQUIRED)
find_package(yaml-cpp REQUIRED)
find_package(HDF5 REQUIRED COMPONENTS C)
find_package(ZLIB REQUIRED)
# Image decoding (data/pixels/jpeg.cpp): libjpeg-turbo's libjpeg API (Debian: libjpeg62-turbo-dev) and libpng
# (libpng-dev). Both are the system's, also under a pip-wheel LibTorch, which ships neither.
find_package(JPEG REQUIRED)
find_package(PNG REQUIRED)
find_package(Threads REQUIRED)
# MLflow's REST API (trainer/track/): libcurl (Debian: libcurl4-openssl-dev), for HTTPS, proxies and logins.
find_package(CURL REQUIRED)
# GPT-2's pre-tokenizer (data/text/pretokenize.cpp): PCRE2's 8-bit library, with Unicode properties and
# its JIT (Debian: libpcre2-dev). PCRE2 ships no CMake package in Debian; its header and library are found
# by name (no pkg-config needed).
find_path(TRAINER_PCRE2_INCLUDE_DIR pcre2.h REQUIRED)
find_library(TRAINER_PCRE2_LIBRARY pcre2-8 REQUIRED)
add_library(trainer_pcre2 INTERFACE)
target_include_directories(trainer_pcre2 SYSTEM INTERFACE ${TRAINER_PCRE2_INCLUDE_DIR})
target_link_libraries(trainer_pcre2 INTERFACE ${TRAINER_PCRE2_LIBRARY})
# tokenizer.json's NFC normalizer (data/text/normalize.cpp): ICU's common library (Debian: libicu-dev),
# linked with PCRE2 wherever the text code is.
find_package(ICU REQUIRED COMPONENTS uc)
target_link_libraries(trainer_pcre2 INTERFACE ICU::uc)

# cxxopts and nlohmann-json are header-only; their CMake packages are optional.
find_path(CXXOPTS_INCLUDE_DIR cxxopts.hpp REQUIRED)
find_path(NLOHMANN_JSON_INCLUDE_DIR nlohmann/json.hpp REQUIRED)

add_library(trainer_deps INTERFACE)
# The wheel's libtorch.so exports pieces of a newer libstdc++ it was linked with (std::filesystem,
# std::chrono's tzdb): when libtorch.so comes before libstdc++.so.6 in the executable's NEEDED list, the
# executable's own std::filesystem calls bind to those copies, and std::filesystem::remove_all crashes
# (a null call). Linking libstdc++ first makes the system's libstdc++ the one every call binds to.
if(TRAINER_SELF_CONTAINED_TORCH)
  target_link_libraries(trainer_deps INTERFACE -Wl,--push-state,--no-as-needed stdc++ -Wl,--pop-state)
endif()
target_link_libraries(trainer_deps INTERFACE
  ${TORCH_LIBRARIES} spdlog::spdlog ${HDF5_C_LIBRARIES} JPEG::JPEG PNG::PNG ZLIB::ZLIB Threads::Threads)
# yaml-cpp's exported target name changed between releases.
if(TARGET yaml-cpp::yaml-cpp)
  target_link_libraries(trainer_deps INTERFACE yaml-cpp::yaml-cpp)
else()
  target_link_libraries(trainer_deps INTERFACE yaml-cpp)
endif()
target_include_directories(trainer_deps SYSTEM INTERFACE
  ${HDF5_C_INCLUDE_DIRS} ${CXXOPTS_INCLUDE_DIR} ${NLOHMANN_JSON_INCLUDE_DIR} ${YAML_CPP_INCLUDE_DIR})
target_compile_options(trainer_deps INTERFACE ${TORCH_CXX_FLAGS})

# fmt: the wheel (2.10+) ships fmt 12's headers in torch/include, which would shadow the fmt that
# spdlog was built with (Debian: fmt 9, libfmt.so.9); spdlog 1.10 does not compile against fmt 12. A
# folder holding only spdlog's fmt goes on the include path before LibTorch's.
find_package(fmt REQUIRED)
get_target_property(_fmt_includes fmt::fmt INTERFACE_INCLUDE_DIRECTORIES)
if(TRAINER_SELF_CONTAINED_TORCH AND EXISTS "${TORCH_INSTALL_PREFIX}/include/fmt/format.h")
  find_path(TRAINER_FMT_INCLUDE_DIR fmt/format.h HINTS ${_fmt_includes} NO_CMAKE_PATH NO_CMAKE_ENVIRONMENT_PATH)
  set(_overlay "${PROJECT_BINARY_DIR}/fmt-overlay")
  file(MAKE_DIRECTORY "${_overlay}")
  file(CREATE_LINK "${TRAINER_FMT_INCLUDE_DIR}/fmt" "${_overlay}/fmt" SYMBOLIC)
  target_include_directories(trainer_deps SYSTEM BEFORE INTERFACE "${_overlay}")
  message(STATUS "trainer: fmt ${fmt_VERSION} from ${TRAINER_FMT_INCLUDE_DIR} before LibTorch's own fmt headers")
endif()

# Where LibTorch was built with CUDA, the trainer compiles its CUDA seams (memory backend, generators,
# NCCL). TORCH_CUDA_LIBRARIES is set by TorchConfig.cmake of a CUDA build only.
set(TRAINER_WITH_CUDA OFF)
if(TORCH_CUDA_LIBRARIES)
  set(TRAINER_WITH_CUDA ON)
  target_compile_definitions(trainer_deps INTERFACE TRAINER_WITH_CUDA=1)
endif()

# c10d's process groups are compiled into LibTorch; their headers also need Gloo's and, for NCCL,
# nccl.h. Each backend is built in where its headers are found; trainer/dist/dist.cpp reports a missing one
# at run time, only if a job asks for it.
# - Gloo: Debian's LibTorch links Debian's libgloo.so; a self-contained LibTorch (pytorch.org's zip, the
#   pip wheel) has Gloo inside libtorch_cpu.so but ships no Gloo headers, so Debian's headers
#   (libgloo-dev) are used and Debian's library is not linked.
# - NCCL: the wheel's nvidia-nccl headers (next to torch/, the library libtorch_cuda.so loads) come
#   before NCCL_HOME and the CUDA toolkit's.
find_path(TRAINER_GLOO_INCLUDE_DIR gloo/config.h HINTS ${TORCH_INCLUDE_DIRS})
set(TRAINER_DIST_DEFINITIONS "")
if(TRAINER_GLOO_INCLUDE_DIR)
  list(APPEND TRAINER_DIST_DEFINITIONS USE_C10D_GLOO TRAINER_HAS_GLOO=1)
  if(NOT TRAINER_SELF_CONTAINED_TORCH)
    find_library(TRAINER_GLOO_LIBRARY gloo)
    if(TRAINER_GLOO_LIBRARY)
      target_link_libraries(trainer_deps INTERFACE ${TRAINER_GLOO_LIBRARY})
    endif()
  endif()
else()
  message(WARNING "trainer: Gloo headers not found (Debian: libgloo-dev); distributed CPU training is off")
endif()
set(TRAINER_NCCL_VERSION "none")
if(TRAINER_WITH_CUDA)
  find_path(TRAINER_NCCL_INCLUDE_DIR nccl.h NO_DEFAULT_PATH HINTS
    "${TORCH_INSTALL_PREFIX}/../nvidia/nccl/include" ${TORCH_INCLUDE_DIRS} "$ENV{NCCL_HOME}/include"
    ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include /usr/include)
  if(TRAINER_NCCL_INCLUDE_DIR)
    file(STRINGS "${TRAINER_NCCL_INCLUDE_DIR}/nccl.h" _nccl_v REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
    string(REGEX REPLACE "[^0-9;]" "" _nccl_v "${_nccl_v}")
    string(REPLACE ";" "." TRAINER_NCCL_VERSION "${_nccl_v}")
    string(APPEND TRAINER_NCCL_VERSION " (${TRAINER_NCCL_INCLUDE_DIR}/nccl.h)")
    list(APPEND TRAINER_DIST_DEFINITIONS USE_C10D_NCCL TRAINER_HAS_NCCL=1)
    target_include_directories(trainer_deps SYSTEM INTERFACE ${TRAINER_NCCL_INCLUDE_DIR})
  else()
    message(WARNING "trainer: nccl.h not found (the wheel's nvidia-nccl, NCCL_HOME, the CUDA toolkit); "
                    "distributed CUDA training is off")
  endif()
endif()
set_source_files_properties(${PROJECT_SOURCE_DIR}/trainer/dist/dist.cpp PROPERTIES
  COMPILE_DEFINITIONS "${TRAINER_DIST_DEFINITIONS}")

message(STATUS "trainer: Torch ${Torch_VERSION} (${TORCH_INSTALL_PREFIX}), CUDA ${TRAINER_WITH_CUDA}, "
               "NCCL ${TRAINER_NCCL_VERSION}, HDF5 ${HDF5_VERSION}, spdlog ${spdlog_VERSION}")
