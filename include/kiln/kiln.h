/* kiln — a CUDA runtime that generates its kernels on demand. The umbrella header. */
#ifndef KILN_H
#define KILN_H

#include "kiln/export.h"
#include "kiln/version.h"
#include "kiln/status.h"
#include "kiln/cache.h"
#include "kiln/runtime.h"
#include "kiln/jit.h"
#include "kiln/model.h"
#include "kiln/ops.h"
#include "kiln/catalog.h"

#endif
