#!/usr/bin/env bash
# A hash of the code in a checkout (the package, the native pool, the benches, the tests, the build files),
# from the files themselves, not from git: the device machine gets a copy of the working tree whose git
# metadata may be older than the files. bench/smoke_gpu.sh writes it in its log's first line; run this in a
# checkout of a commit to find which commit a log's tree was.
set -eu
cd "$(dirname "$0")/.."
find harli_train allocator bench tests -type f \( -name '*.py' -o -name '*.sh' -o -name '*.cpp' -o -name '*.h' \) \
  -not -path '*/__pycache__/*' | LC_ALL=C sort | while read -r f; do printf '%s\n' "$f"; cat "$f"; done |
  sha1sum | cut -c1-12
