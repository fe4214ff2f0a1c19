/* Opening files from outside (model/file.h). */
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/internal.h"
#include "model/file.h"

kiln_status kiln__open_regular(const char *path, int *fd, size_t *size)
{
    int f = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (f < 0)
        return kiln__fail(NULL, KILN_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(f, &sb) != 0) {
        int e = errno;
        close(f);
        return kiln__fail(NULL, KILN_ERR_IO, "%s: cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(f);
        return kiln__fail(NULL, KILN_ERR_IO, "%s: not a regular file (%s)", path, kiln__file_kind(sb.st_mode));
    }
    int flags = fcntl(f, F_GETFL);
    if (flags < 0 || fcntl(f, F_SETFL, flags & ~O_NONBLOCK) < 0) {
        int e = errno;
        close(f);
        return kiln__fail(NULL, KILN_ERR_IO, "%s: cannot make the descriptor blocking: %s", path, strerror(e));
    }
    *fd = f;
    if (size)
        *size = (size_t)sb.st_size;
    return KILN_OK;
}
