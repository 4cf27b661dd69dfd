# Registers trainer_tests with CTest one GoogleTest suite per test, not one test case per test (run after
# each link of trainer_tests, as gtest_discover_tests would; its output is a CTest include file).
#
# Why suites: each process loads LibTorch (about 1 s; on 2.11 the CUDA libraries too) before its first
# test, and the suite is the unit that shares a fixture (SetUpTestSuite): 509 processes became 123.
# Each suite writes GoogleTest's XML report to RESULTS_DIR/<suite>.xml: every test case's time, read by
# scripts/test-times.py.
#
# A test that changes what the rest of its process sees (signal dispositions, the process-wide CPU
# allocator's cap, the working folder, the environment) and cannot put it back carries "Alone" at the
# end of its suite's name and gets a process per test case (docs/TESTING.md).
#
# COSTS_FILE (tests/costs.txt) holds each suite's measured seconds; CTest starts the most costly first so
# that the long suites do not end up alone on one core at the end. A suite missing from it costs 0.
# ONE_TOOLCHAIN_FILE (tests/one_toolchain.txt) names the suites labelled `one_toolchain`, which
# scripts/test.sh leaves out of the 2.11 leg when the 1.13 leg runs them (`ctest -LE one_toolchain`).
#
#   cmake -D TEST_EXECUTABLE=... -D CTEST_FILE=... -D RESULTS_DIR=... -D COSTS_FILE=... \
#         -D ONE_TOOLCHAIN_FILE=... -P add_suites.cmake
cmake_minimum_required(VERSION 3.18)

execute_process(COMMAND "${TEST_EXECUTABLE}" --gtest_list_tests
                OUTPUT_VARIABLE listing ERROR_VARIABLE listing_err RESULT_VARIABLE rc TIMEOUT 120)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${TEST_EXECUTABLE} --gtest_list_tests failed (${rc}):\n${listing}${listing_err}")
endif()

set(costs "")
if(EXISTS "${COSTS_FILE}")
  file(STRINGS "${COSTS_FILE}" costs REGEX "^[^#]")
endif()
set(one_toolchain "")
if(EXISTS "${ONE_TOOLCHAIN_FILE}")
  file(STRINGS "${ONE_TOOLCHAIN_FILE}" entries REGEX "^[^# ]")
  foreach(entry IN LISTS entries)
    string(REGEX REPLACE " .*" "" entry "${entry}")
    list(APPEND one_toolchain "${entry}")
  endforeach()
endif()

# The listing: "Suite." lines (a typed or parametrized one followed by "  # TypeParam = ..."), then
# "  Case" lines. DISABLED_ suites and cases are left to GoogleTest, which never runs them by default.
string(REPLACE ";" "\\;" listing "${listing}")
string(REPLACE "\n" ";" lines "${listing}")
set(suites "")
set(suite "")
foreach(line IN LISTS lines)
  if(line MATCHES "^([^ #][^ ]*)\\.( .*)?$")
    set(suite "${CMAKE_MATCH_1}")
    if(NOT suite MATCHES "(^|/)DISABLED_")
      list(APPEND suites "${suite}")
      set("cases_${suite}" "")
    endif()
  elseif(line MATCHES "^  ([^ #]+)" AND NOT suite STREQUAL "")
    set(case "${CMAKE_MATCH_1}")  # the next MATCHES clears CMAKE_MATCH_1
    if(NOT case MATCHES "^DISABLED_")
      list(APPEND "cases_${suite}" "${case}")
    endif()
  endif()
endforeach()

set(script "")
foreach(suite IN LISTS suites)
  if("${cases_${suite}}" STREQUAL "")
    continue()
  endif()
  set(cost 0)
  foreach(entry IN LISTS costs)
    if(entry MATCHES "^([^ ]+) +([0-9.]+)$" AND CMAKE_MATCH_1 STREQUAL suite)
      set(cost ${CMAKE_MATCH_2})
    endif()
  endforeach()
  if(suite MATCHES "Alone$")
    set(filters "")
    foreach(case IN LISTS "cases_${suite}")
      list(APPEND filters "${suite}.${case}")
    endforeach()
  else()
    set(filters "${suite}.*")
  endif()
  set(labels "")
  if("${suite}" IN_LIST one_toolchain)
    set(labels " LABELS one_toolchain")
  endif()
  foreach(filter IN LISTS filters)
    string(REGEX REPLACE "\\.\\*$" "" name "${filter}")
    string(REPLACE "/" "_" xml "${name}")
    string(APPEND script
      "add_test([==[${name}]==] \"${TEST_EXECUTABLE}\" [==[--gtest_filter=${filter}]==] "
      "[==[--gtest_output=xml:${RESULTS_DIR}/${xml}.xml]==])\n"
      "set_tests_properties([==[${name}]==] PROPERTIES TIMEOUT 1800 COST ${cost}${labels})\n")
  endforeach()
endforeach()
foreach(entry IN LISTS one_toolchain)
  if(NOT "${entry}" IN_LIST suites)
    message(FATAL_ERROR "${ONE_TOOLCHAIN_FILE}: no suite '${entry}' in ${TEST_EXECUTABLE}")
  endif()
endforeach()
file(WRITE "${CTEST_FILE}" "${script}")
