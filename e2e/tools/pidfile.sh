# Processes the e2e scripts start in the background and know by a pid file. Sourced.
# shellcheck shell=bash

# pidfile_running FILE: whether the process FILE names is alive.
pidfile_running() {
  [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

# pidfile_stop FILE: stops the process FILE names (TERM, up to 10 s, then KILL), waits for
# it, and removes FILE. Nothing to do when FILE is missing.
pidfile_stop() {
  [ -f "$1" ] || return 0
  local pid
  pid=$(cat "$1")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$1"
}
