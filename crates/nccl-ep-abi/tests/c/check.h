/* The test programs' CHECK (C and C++): a failed condition is printed with its line and
 * counted in `failures`, which each program returns at its end. */
#ifndef EPFLOW_TEST_CHECK_H
#define EPFLOW_TEST_CHECK_H

#include <stdio.h>

static int failures = 0;

#define CHECK(cond)                                                          \
    do {                                                                     \
        if (!(cond)) {                                                       \
            fprintf(stderr, "FAILED %s:%d: %s\n", __FILE__, __LINE__, #cond); \
            failures++;                                                      \
        }                                                                    \
    } while (0)

#endif
