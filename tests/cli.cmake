# The command-line tool, end to end: prewarm, ls, stats and their failures.
# Needs no GPU (prewarm compiles offline); python3 checks the JSON output.
add_test(NAME cli COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli_test.sh $<TARGET_FILE:kiln_cli> ${CMAKE_CURRENT_BINARY_DIR}/cli_scratch)
set_tests_properties(cli PROPERTIES LABELS "cpu")

# Corruption trials: damaged copies of a prewarmed database under verify,
# prewarm and lookups (cache_lookup); fails only if a key loads another
# cubin or a command crashes. KILN_CORRUPTION_TRIALS (default 60) and
# KILN_TEST_SEED in the environment choose the trials.
add_executable(cache_lookup cache_lookup.c)
target_link_libraries(cache_lookup PRIVATE kiln_static)
add_test(NAME corruption_trials COMMAND python3 ${CMAKE_CURRENT_SOURCE_DIR}/corruption_trials.py
  $<TARGET_FILE:kiln_cli> $<TARGET_FILE:cache_lookup> ${CMAKE_CURRENT_SOURCE_DIR}/data/qwen2.5-0.5b.json
  ${CMAKE_CURRENT_BINARY_DIR}/corruption_scratch)
set_tests_properties(corruption_trials PROPERTIES LABELS "cpu" TIMEOUT 900)

# Coverage records and tuning rows through the CLI (no GPU needed).
add_test(NAME cli_coverage COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli_coverage_test.sh $<TARGET_FILE:kiln_cli>
  ${CMAKE_CURRENT_SOURCE_DIR}/data/qwen2.5-0.5b.json ${CMAKE_CURRENT_BINARY_DIR}/cli_coverage_scratch)
set_tests_properties(cli_coverage PROPERTIES LABELS "cpu" TIMEOUT 600)
