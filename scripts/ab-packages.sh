#!/usr/bin/env bash
# Copies of the package for benchmarks/package_ab.py, built here (the GPU host has no git):
# each argument is a patch of experiments/ applied to REV's mqa_bwd (REV defaults to HEAD), several
# patches joined by + applied in turn (one copy, named by all of them), or a bare revision
# (rev:COMMIT) taken whole. The copies land in .ab/<name>/mqa_bwd (carry .ab
# in the device call); the script prints the device command that compiles each copy's kernels
# in parallel and times them all together with package_ab.
#   bash scripts/ab-packages.sh experiments/no_bounds.patch rev:4727d9b experiments/a.patch+experiments/b.patch
set -euo pipefail
rev=${REV:-HEAD}
[[ $# -gt 0 ]] || { echo "usage: [REV=commit] $0 experiments/NAME.patch | rev:COMMIT ..." >&2; exit 2; }
items=()
for item in "$@"; do  # patch paths as given, before moving to the repository's root
  if [[ $item == rev:* ]]; then items+=("$item"); continue; fi
  IFS=+ read -ra parts <<< "$item"
  resolved=()
  for part in "${parts[@]}"; do
    [[ -f $part ]] || { echo "$part: no such patch" >&2; exit 2; }
    resolved+=("$(realpath "$part")")
  done
  items+=("$(IFS=+; echo "${resolved[*]}")")
done
cd "$(dirname "$(realpath "$0")")/.."
mkdir -p .ab
against=() names=()
for item in "${items[@]}"; do
  if [[ $item == rev:* ]]; then
    name=${item#rev:} source=${item#rev:}
  else
    IFS=+ read -ra patches <<< "$item"
    name=$(for patch in "${patches[@]}"; do basename "$patch" .patch; done | paste -sd+) source=$rev
  fi
  rm -rf ".ab/$name" && mkdir -p ".ab/$name"
  git archive "$source" mqa_bwd | tar -x -C ".ab/$name"
  if [[ $item != rev:* ]]; then
    # git apply outside a repository: a throwaway one, so that --include works as in a checkout.
    (cd ".ab/$name" && git init -q && for patch in "${patches[@]}"; do git apply --include='mqa_bwd/*' "$patch"; done && rm -rf .git)
  fi
  against+=(--against ".ab/$name/mqa_bwd") names+=("$name")
  if [[ $item == rev:* ]]; then echo "built .ab/$name/mqa_bwd: $source" >&2
  else echo "built .ab/$name/mqa_bwd: $source with $item" >&2; fi
done
# Each copy's kernels compile from inside its folder: python3 -m puts the working directory ahead
# of PYTHONPATH, so from the root it would compile this tree's again. The copies compile side by
# side, each only what the bench shapes launch (d_k 576, 32-head groups; the small kernels share
# this tree's cache entries); a copy older than those options compiles everything.
bench_only='--d_k 576 --group-heads 32'  # this tree's compile too (gpu-run.sh's COMPILE_ONLY)
compile='PYTHONPATH=/tmp/site python3 -W ignore -m mqa_bwd.kernels --workers 4'
echo "COMPILE_ONLY='$bench_only' bash scripts/gpu-run.sh 'for v in ${names[*]}; do (cd .ab/\$v && { $compile $bench_only || $compile; }) & done; wait' 'python3 benchmarks/package_ab.py ${against[*]} --shapes dsv32,fleet'   # carry .gpu/tilelang.tar.xz and .ab"
