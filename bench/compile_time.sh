#!/usr/bin/env bash
# The compile-time target: bench/compile_time.cpp (the umbrella header, select() of every catalogue preset) must
# compile in under 20 s. Times it with g++ and clang++ at the dev and the release flags, for float storage (the
# target) and for float, half, bfloat16 and double storage (-DKVEVICT_PROBE_EVERY_STORAGE):
#   bench/compile_time.sh   (run on an idle machine: the times are wall-clock)
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp)
trap 'rm -f "$out"' EXIT
TIMEFORMAT=%R
for cxx in g++ clang++; do
  command -v "$cxx" > /dev/null || continue
  for flags in "-O0 -g" "-O3 -DNDEBUG -march=native" "-O0 -g -DKVEVICT_PROBE_EVERY_STORAGE" \
               "-O3 -DNDEBUG -march=native -DKVEVICT_PROBE_EVERY_STORAGE"; do
    t=$( { time "$cxx" -std=c++17 $flags -Iinclude -isystem /usr/include/eigen3 -c bench/compile_time.cpp \
             -o "$out" > /dev/null; } 2>&1 )
    printf '%-8s %-56s %6s s\n' "$cxx" "$flags" "$t"
  done
done
