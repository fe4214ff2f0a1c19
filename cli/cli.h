/* kiln CLI internals: the commands and the helpers they share. Not API. */
#ifndef KILN_CLI_H
#define KILN_CLI_H

#include <stdarg.h>
#include <stddef.h>

#include <kiln/kiln.h>

/* Exit statuses, the same for every command. */
#define CLI_EXIT_OK 0
#define CLI_EXIT_FAILURE 1 /* the command ran and failed: bad config, arch, database, compile error */
#define CLI_EXIT_USAGE 2   /* the command line is wrong: unknown option, bad -j, stray argument */

/* Room for a database path (kiln_cache_open accepts up to 4095 bytes). */
#define CLI_PATH_MAX 4096

/* Each command takes argv with argv[0] = its name ("prewarm") and returns an exit status. */
int cli_prewarm(int argc, char **argv);
int cli_ls(int argc, char **argv);
int cli_stats(int argc, char **argv);

/* Prints "kiln <cmd>: <message>" to stderr and returns CLI_EXIT_FAILURE. */
int cli_fail(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Prints "kiln <cmd>: <message>" and a pointer to --help to stderr; returns CLI_EXIT_USAGE. */
int cli_usage_error(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* The database a command works on: db when given, else the default path
 * (KILN_CACHE_DIR, XDG_CACHE_HOME, HOME). Returns CLI_EXIT_OK or reports the
 * failure and returns CLI_EXIT_FAILURE. */
int cli_db_path(const char *cmd, const char *db, char *buf, size_t cap);
/* Opens an existing database read-only (nothing is created or written).
 * Returns CLI_EXIT_OK or reports the failure and returns CLI_EXIT_FAILURE. */
int cli_open_existing(const char *cmd, const char *db, kiln_cache **out);

/* Reports what getopt_long (run with opterr = 0 and an optstring that starts
 * with ':') returned for c = '?' or ':'; returns CLI_EXIT_USAGE. */
int cli_getopt_error(const char *cmd, int c, char **argv);

/* Parses a whole decimal number in [lo, hi]; 0 on success, -1 otherwise. */
int cli_parse_long(const char *text, long lo, long hi, long *out);

#endif
