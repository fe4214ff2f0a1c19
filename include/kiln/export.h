/* kiln — symbol visibility. Only what is marked KILN_API is exported. */
#ifndef KILN_EXPORT_H
#define KILN_EXPORT_H

#if defined(KILN_STATIC_DEFINE)
#define KILN_API
#elif defined(__GNUC__)
#define KILN_API __attribute__((visibility("default")))
#else
#define KILN_API
#endif

#endif
