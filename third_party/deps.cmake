# Build glue for the external dependencies. Everything the project links comes through the
# `trainer_deps` interface target, so the rest of the tree never calls find_package.
#
# LibTorch: Debian's libtorch-dev (1.13, CPU) is found with no hints. For a pip-installed PyTorch 2.x
# with CUDA, pass -DCMAKE_PREFIX_PATH=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)').
find_package(Torch REQUIRED)
find_package(spdlog REQUIRED)
find_package(yaml-cpp REQUIRED)
find_package(HDF5 REQUIRED COMPONENTS C)
find_package(ZLIB REQUIRED)
find_package(Threads REQUIRED)

# cxxopts and nlohmann-json are header-only; their CMake packages are optional.
find_path(CXXOPTS_INCLUDE_DIR cxxopts.hpp REQUIRED)
find_path(NLOHMANN_JSON_INCLUDE_DIR nlohmann/json.hpp REQUIRED)

add_library(trainer_deps INTERFACE)
target_link_libraries(trainer_deps INTERFACE
  ${TORCH_LIBRARIES} spdlog::spdlog ${HDF5_C_LIBRARIES} ZLIB::ZLIB Threads::Threads)
# yaml-cpp's exported target name changed between releases.
if(TARGET yaml-cpp::yaml-cpp)
  target_link_libraries(trainer_deps INTERFACE yaml-cpp::yaml-cpp)
else()
  target_link_libraries(trainer_deps INTERFACE yaml-cpp)
endif()
target_include_directories(trainer_deps SYSTEM INTERFACE
  ${HDF5_C_INCLUDE_DIRS} ${CXXOPTS_INCLUDE_DIR} ${NLOHMANN_JSON_INCLUDE_DIR} ${YAML_CPP_INCLUDE_DIR})
target_compile_options(trainer_deps INTERFACE ${TORCH_CXX_FLAGS})

# cpp-httplib (the metrics endpoint, trainer/http.cpp). Debian splits it into a declarations-only header
# and a shared library built with OpenSSL, zlib and brotli; its pkg-config file carries the matching
# CPPHTTPLIB_*_SUPPORT defines, which http.cpp must see or the header's classes (httplib::Request)
# differ from the library's. They are set on that one file only. Elsewhere (the container) the
# single-file header is used as it is: no defines, no library, no OpenSSL.
find_package(PkgConfig QUIET)
if(PkgConfig_FOUND)
  pkg_check_modules(CPP_HTTPLIB QUIET cpp-httplib)
endif()
find_path(HTTPLIB_INCLUDE_DIR httplib.h HINTS ${CPP_HTTPLIB_INCLUDE_DIRS} REQUIRED)
target_include_directories(trainer_deps SYSTEM INTERFACE ${HTTPLIB_INCLUDE_DIR})
if(CPP_HTTPLIB_FOUND)
  target_link_directories(trainer_deps INTERFACE ${CPP_HTTPLIB_LIBRARY_DIRS})
  target_link_libraries(trainer_deps INTERFACE ${CPP_HTTPLIB_LIBRARIES})
  set_source_files_properties(${PROJECT_SOURCE_DIR}/trainer/http.cpp PROPERTIES
    COMPILE_OPTIONS "${CPP_HTTPLIB_CFLAGS_OTHER}")
endif()

# Where LibTorch was built with CUDA, the trainer compiles its CUDA seams (memory statistics, caps).
if(TORCH_CUDA_LIBRARIES OR CUDA_FOUND OR CUDAToolkit_FOUND)
  target_compile_definitions(trainer_deps INTERFACE TRAINER_WITH_CUDA=1)
endif()

# c10d's process groups are compiled into LibTorch; their headers also need Gloo's (Debian: libgloo-dev,
# pip wheels: bundled under torch/include) and, for NCCL, nccl.h. Each backend is built in where its
# headers are found; trainer/dist.cpp reports a missing one at run time, only if a job asks for it.
find_path(TRAINER_GLOO_INCLUDE_DIR gloo/config.h HINTS ${TORCH_INCLUDE_DIRS})
find_library(TRAINER_GLOO_LIBRARY gloo)
set(TRAINER_DIST_DEFINITIONS "")
if(TRAINER_GLOO_INCLUDE_DIR)
  list(APPEND TRAINER_DIST_DEFINITIONS USE_C10D_GLOO TRAINER_HAS_GLOO=1)
  if(TRAINER_GLOO_LIBRARY)
    target_link_libraries(trainer_deps INTERFACE ${TRAINER_GLOO_LIBRARY})
  endif()
else()
  message(WARNING "trainer: Gloo headers not found (Debian: libgloo-dev); distributed CPU training is off")
endif()
if(TORCH_CUDA_LIBRARIES OR CUDA_FOUND OR CUDAToolkit_FOUND)
  find_path(TRAINER_NCCL_INCLUDE_DIR nccl.h HINTS ${TORCH_INCLUDE_DIRS} $ENV{NCCL_HOME}/include ${CUDAToolkit_INCLUDE_DIRS})
  if(TRAINER_NCCL_INCLUDE_DIR)
    list(APPEND TRAINER_DIST_DEFINITIONS USE_C10D_NCCL TRAINER_HAS_NCCL=1)
    target_include_directories(trainer_deps SYSTEM INTERFACE ${TRAINER_NCCL_INCLUDE_DIR})
  endif()
endif()
set_source_files_properties(${PROJECT_SOURCE_DIR}/trainer/dist.cpp PROPERTIES
  COMPILE_DEFINITIONS "${TRAINER_DIST_DEFINITIONS}")

message(STATUS "trainer: Torch ${Torch_VERSION}, HDF5 ${HDF5_VERSION}, spdlog ${spdlog_VERSION}")
