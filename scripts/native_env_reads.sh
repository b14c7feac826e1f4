#!/usr/bin/env bash
# Which environment variables native code reads (getenv/secure_getenv) while python imports the
# given modules: the source of settings.NATIVE_ENV. Reads of the C library's own (TZ, LC_*,
# MALLOC_*) do not go through the exported getenv and are not seen.
#
#     bash scripts/native_env_reads.sh torch,megatron.core,modelopt.torch
set -euo pipefail
modules=${1:-torch}
python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat > "$work/getenv.c" <<'C'
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <unistd.h>
static void say(const char *key) {
    char line[512];
    int n = snprintf(line, sizeof line, "GETENV %s\n", key);
    if (n > 0) write(2, line, n < (int)sizeof line ? n : (int)sizeof line - 1);
}
char *getenv(const char *key) {
    static char *(*real)(const char *);
    if (!real) real = dlsym(RTLD_NEXT, "getenv");
    say(key);
    return real(key);
}
char *secure_getenv(const char *key) {
    static char *(*real)(const char *);
    if (!real) real = dlsym(RTLD_NEXT, "secure_getenv");
    say(key);
    return real(key);
}
C
cc -shared -fPIC -O2 -o "$work/getenv.so" "$work/getenv.c" -ldl
# Python's own start-up reads come first; each module's reads follow its name.
LD_PRELOAD="$work/getenv.so" "$python" -c "
import importlib, sys
sys.stderr.write('GETENV ==start-up-done\n')
for name in sys.argv[1].split(','):
    importlib.import_module(name)
    sys.stderr.write(f'GETENV ==after-{name}\n')
" "$modules" 2>&1 >/dev/null | awk '$1 == "GETENV" && !seen[$2]++ {print $2}' \
    | sed -n '/^==start-up-done$/,$p'
