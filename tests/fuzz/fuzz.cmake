# Fuzz targets for kiln's parsers of outside data (tests/fuzz/README.md).
# Included from tests/CMakeLists.txt.
#
# By default each target is linked with driver.c, a deterministic mutation loop
# over its seed corpus, and registered with CTest (labels cpu;fuzz): CI runs
# them with every other test, under ASan and UBSan when KILN_SANITIZE is ON.
# With KILN_LIBFUZZER=ON and clang, the targets are linked with
# -fsanitize=fuzzer instead (ASan and UBSan included) against a copy of the
# library built with coverage instrumentation, and no tests are registered.

option(KILN_LIBFUZZER "Build the fuzz targets for libFuzzer (clang only); registers no tests" OFF)

set(KILN_FUZZ_DIR ${CMAKE_CURRENT_LIST_DIR})
set(KILN_FUZZ_DEPS SQLite::SQLite3 OpenSSL::Crypto PkgConfig::ZSTD)
# target, seed corpus, mutated inputs per CTest run: a few seconds each with
# ASan on two cores, far under the 60 s each may take. KILN_FUZZ_RUNS in the
# environment replaces the count (and KILN_FUZZ_SEED the fixed seed).
set(KILN_FUZZ_TARGETS
  fuzz_config corpus_config 100000
  fuzz_cache_row corpus_cache 10000
  fuzz_safetensors corpus_safetensors 200000
  fuzz_manifest corpus_manifest 2000
  fuzz_remote corpus_remote 200000
  fuzz_tuning_row corpus_tuning 5000)

set(KILN_FUZZ_WITH_LIBFUZZER OFF)
if(KILN_LIBFUZZER)
  if(CMAKE_C_COMPILER_ID MATCHES "Clang")
    set(KILN_FUZZ_WITH_LIBFUZZER ON)
  else()
    message(WARNING "KILN_LIBFUZZER needs clang (CC=clang), not ${CMAKE_C_COMPILER_ID}: "
                    "building the fuzz targets with the standalone driver instead")
  endif()
endif()

if(KILN_FUZZ_WITH_LIBFUZZER)
  set(KILN_FUZZ_SANITIZERS -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer)
  # The library again, from the same sources, with coverage so that libFuzzer
  # sees kiln's branches and not only the target's.
  if(DEFINED KILN_SOURCES)
    set(kiln_fuzz_sources)
    foreach(src IN LISTS KILN_SOURCES)
      if(IS_ABSOLUTE "${src}")
        list(APPEND kiln_fuzz_sources "${src}")
      else()
        list(APPEND kiln_fuzz_sources "${PROJECT_SOURCE_DIR}/${src}")
      endif()
    endforeach()
    set_source_files_properties(${KILN_EMBEDDED_C} PROPERTIES GENERATED TRUE)
    add_library(kiln_fuzz_core STATIC ${kiln_fuzz_sources})
    add_dependencies(kiln_fuzz_core kiln_objects) # kiln_objects generates the embedded templates
    target_include_directories(kiln_fuzz_core PUBLIC
      ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR} ${CUDAToolkit_INCLUDE_DIRS})
    target_compile_options(kiln_fuzz_core PRIVATE -fsanitize=fuzzer-no-link ${KILN_FUZZ_SANITIZERS})
    target_link_libraries(kiln_fuzz_core PUBLIC ${KILN_DEPS})
    set(KILN_FUZZ_LIBRARY kiln_fuzz_core)
  else()
    message(WARNING "KILN_SOURCES is not set: the fuzz targets link kiln_static, whose code has no coverage")
    set(KILN_FUZZ_LIBRARY kiln_static)
  endif()
endif()

while(KILN_FUZZ_TARGETS)
  list(POP_FRONT KILN_FUZZ_TARGETS name corpus runs)
  if(KILN_FUZZ_WITH_LIBFUZZER)
    add_executable(${name} ${KILN_FUZZ_DIR}/${name}.c)
    target_compile_options(${name} PRIVATE -fsanitize=fuzzer ${KILN_FUZZ_SANITIZERS})
    target_link_options(${name} PRIVATE -fsanitize=fuzzer ${KILN_FUZZ_SANITIZERS})
    target_link_libraries(${name} PRIVATE ${KILN_FUZZ_LIBRARY} ${KILN_FUZZ_DEPS})
  else()
    add_executable(${name} ${KILN_FUZZ_DIR}/${name}.c ${KILN_FUZZ_DIR}/driver.c)
    target_link_libraries(${name} PRIVATE kiln_static ${KILN_FUZZ_DEPS})
    add_test(NAME ${name} COMMAND ${name} --runs ${runs} ${KILN_FUZZ_DIR}/${corpus})
    # A failing fuzz_cache_row leaves its database under TMPDIR for a look.
    set_tests_properties(${name} PROPERTIES LABELS "cpu;fuzz" TIMEOUT 300
      ENVIRONMENT "TMPDIR=${CMAKE_CURRENT_BINARY_DIR}")
  endif()
endwhile()
