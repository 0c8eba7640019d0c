/* The library's one translation unit: the files of each concern, compiled together as one (the
 * compiler inlines across them as it did when they were one file). graftlm/native/build.py builds
 * this file; every file of csrc/ is part of its cache key. */
#include "graftlm.h"

int gl_abi_version(void) { return 25; }

#include "quant.c"
#include "attn.c"
#include "lora.c"
#include "layer.c"
