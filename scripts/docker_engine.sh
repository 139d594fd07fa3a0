#!/usr/bin/env bash
# Make sure a Docker engine runs here (CI: root on a fresh machine). Installs Debian's docker.io,
# docker-compose (v1) and debootstrap when missing, starts dockerd in the background when no engine
# answers, and waits for it. Exit 0 when `docker info` works; otherwise says exactly why (with the
# tail of dockerd's log) and exits 1.
set -uo pipefail
LOG=${KNITTRANS_DOCKERD_LOG:-/tmp/knittrans-dockerd.log}
say() { printf '[docker-engine] %s\n' "$*"; }

missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v docker-compose >/dev/null || docker compose version >/dev/null 2>&1 || missing+=(docker-compose)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then say "missing ${missing[*]} and not root: cannot install them"; exit 1; fi
  say "installing ${missing[*]}"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } >/tmp/knittrans-apt.log 2>&1 \
    || { say "apt-get install ${missing[*]} failed:"; tail -n 20 /tmp/knittrans-apt.log; exit 1; }
fi
if docker info >/dev/null 2>&1; then say "engine already running: $(docker info --format '{{.ServerVersion}} {{.Driver}}')"; exit 0; fi
if [ "$(id -u)" != 0 ]; then say "no engine answers and not root: cannot start dockerd"; exit 1; fi
say "starting dockerd (log: $LOG)"
nohup dockerd >"$LOG" 2>&1 &
for _ in $(seq 1 60); do
  if docker info >/dev/null 2>&1; then say "engine up: $(docker info --format '{{.ServerVersion}} {{.Driver}} cgroup v{{.CgroupVersion}}')"; exit 0; fi
  if ! kill -0 $! 2>/dev/null; then break; fi
  sleep 1
done
say "the Docker engine did not start; last lines of $LOG:"
tail -n 25 "$LOG"
exit 1
