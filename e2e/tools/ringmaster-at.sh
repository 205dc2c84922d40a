#!/usr/bin/env bash
# Builds the operator (release) as it was at a commit of this repository, for before/after
# benchmarks, into the cache (one binary per commit, not rebuilt), and prints its path.
#   e2e/tools/ringmaster-at.sh 539e17c
# The commit is checked out in a worktree under the cache and built with the shared cargo
# target directory, so only the crates that changed since are compiled again.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$(dirname "$here")")
cache=${RINGMASTER_CACHE:-$HOME/.cache/ringmaster}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$cache/target}
[ $# = 1 ] || { echo "usage: $0 COMMIT" >&2; exit 2; }
commit=$(git -C "$root" rev-parse --verify --short=12 "$1^{commit}")
out="$cache/bench/ringmaster-$commit"
if [ ! -x "$out" ]; then
  printf '[ringmaster-at] building the operator at %s (release)\n' "$commit" >&2
  tree="$cache/bench/tree-$commit"
  rm -rf "$tree"; git -C "$root" worktree prune
  git -C "$root" worktree add --detach --force "$tree" "$commit" >&2
  (cd "$tree" && cargo build --release --locked -p ringmaster --bin ringmaster >&2)
  mkdir -p "$(dirname "$out")"
  cp "$CARGO_TARGET_DIR/release/ringmaster" "$out"
  git -C "$root" worktree remove --force "$tree"
fi
echo "$out"
