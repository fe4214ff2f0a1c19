/* Opening files from outside for the model/ parsers; private to model/. */
#ifndef KILN_MODEL_FILE_H
#define KILN_MODEL_FILE_H

#include <stddef.h>

#include "kiln/status.h"

/* Opens path read-only, refusing anything but a regular file: the open is
 * non-blocking, so a FIFO or a device cannot hang it, and fstat decides
 * before a byte is read; the descriptor is then made blocking again. Returns
 * KILN_OK with *fd (the caller closes it) and *size (when size is not
 * NULL), else KILN_ERR_IO with a
 * message naming the path: "<path>: cannot open: <errno text>", "<path>: not
 * a regular file (a FIFO)". */
kiln_status kiln__open_regular(const char *path, int *fd, size_t *size);

#endif
