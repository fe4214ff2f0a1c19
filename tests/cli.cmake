# The command-line tool, end to end: prewarm, ls, stats and their failures.
# Needs no GPU (prewarm compiles offline); python3 checks the JSON output.
add_test(NAME cli COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli_test.sh $<TARGET_FILE:kiln_cli> ${CMAKE_CURRENT_BINARY_DIR}/cli_scratch)
set_tests_properties(cli PROPERTIES LABELS "cpu")
