#!/usr/bin/env bash
# Local multi-node stack on one Docker host: base image (once), project image, `docker-compose up`.
#
#   bash scripts/compose_up.sh            # build what is missing, start the stack, wait for health
#   bash scripts/compose_up.sh --build    # only the images (base image when missing + knittrans:dev)
#   bash scripts/compose_up.sh --down     # stop and remove containers, networks and volumes
#
# Needs a running Docker engine and docker-compose (v1 `docker-compose` or the v2 plugin).
# Base image: Docker Hub may be unreachable, so `knittrans-base:bookworm` is made with debootstrap
# from the Debian mirror apt uses here (KNITTRANS_DEBIAN_MIRROR overrides it). Python packages:
# the wheels are downloaded on the host with the host's pip configuration into .wheelhouse/ and
# installed in the image with --no-index (the build itself needs no network).
# Tokens: KNITTRANS_{WORKER,STORE,ADMIN}_TOKEN from the environment; missing ones are generated
# once into .compose.env (mode 600, git-ignored), which this script and docker-compose read.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_IMAGE=${KNITTRANS_BASE_IMAGE:-knittrans-base:bookworm}
IMAGE=knittrans:dev
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
log() { printf '[compose %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose); else COMPOSE=(docker-compose); fi
export COMPOSE_PROJECT_NAME=${COMPOSE_PROJECT_NAME:-knittrans}

tokens() {
  local name new=0 saved
  for name in KNITTRANS_WORKER_TOKEN KNITTRANS_STORE_TOKEN KNITTRANS_ADMIN_TOKEN; do
    if [ -z "${!name:-}" ] && [ -f .compose.env ]; then   # the environment wins over the file
      saved=$(sed -n "s/^$name=//p" .compose.env | head -n1)
      if [ -n "$saved" ]; then printf -v "$name" '%s' "$saved"; export "${name?}"; fi
    fi
    if [ -z "${!name:-}" ]; then
      printf -v "$name" '%s' "$(python3 -c 'import secrets; print(secrets.token_hex(16))')"
      export "${name?}"; new=1
    fi
  done
  if [ "$new" = 1 ]; then
    umask 077
    printf 'KNITTRANS_WORKER_TOKEN=%s\nKNITTRANS_STORE_TOKEN=%s\nKNITTRANS_ADMIN_TOKEN=%s\n' \
      "$KNITTRANS_WORKER_TOKEN" "$KNITTRANS_STORE_TOKEN" "$KNITTRANS_ADMIN_TOKEN" > .compose.env
    log "tokens written to .compose.env (source it to use the admin token)"
  fi
}

base_image() {
  if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then return; fi
  local mirror=${KNITTRANS_DEBIAN_MIRROR:-}
  if [ -z "$mirror" ]; then
    mirror=$(grep -h -o -E '^(URIs:|deb) +https?://[^ ]+' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list \
               2>/dev/null | grep -v security | head -n1 | awk '{print $2}' || true)
  fi
  mirror=${mirror:-http://deb.debian.org/debian}
  command -v debootstrap >/dev/null || { echo "debootstrap is missing: apt-get install -y debootstrap" >&2; exit 1; }
  local root; root=$(mktemp -d /tmp/knittrans-rootfs.XXXXXX)
  log "making $BASE_IMAGE with debootstrap from $mirror (about 1-2 min)"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$mirror" \
    > /tmp/knittrans-debootstrap.log 2>&1 || { tail -n 20 /tmp/knittrans-debootstrap.log >&2; rm -rf "$root"; exit 1; }
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | docker import - "$BASE_IMAGE" >/dev/null
  rm -rf "$root"
  log "$BASE_IMAGE ready"
}

wheelhouse() {
  # Every runtime dependency as a wheel, resolved by the host's pip (its find-links hold the CPU torch).
  mkdir -p .wheelhouse
  "$PY" - > .wheelhouse/requirements.txt <<'PYEOF'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
# core + the demo extra: one image serves every role (store, control plane, rollout, trainer, demo)
deps = project["dependencies"] + project["optional-dependencies"]["demo"]
print("\n".join(["torch==2.13.0", "setuptools>=68", "wheel", *[d for d in deps if not d.startswith("torch")]]))
PYEOF
  if [ -f .wheelhouse/.done ] && cmp -s .wheelhouse/requirements.txt .wheelhouse/.done; then return; fi
  log "downloading wheels into .wheelhouse/"
  "$PY" -m pip download -q --only-binary=:all: -d .wheelhouse -r .wheelhouse/requirements.txt
  cp .wheelhouse/requirements.txt .wheelhouse/.done
}

images() {
  base_image
  wheelhouse
  log "building $IMAGE"
  DOCKER_BUILDKIT=0 docker build -q --build-arg BASE_IMAGE="$BASE_IMAGE" -t "$IMAGE" . >/dev/null
  log "$IMAGE ready"
}

case "${1:-up}" in
  --down|down)
    tokens
    "${COMPOSE[@]}" down -v --remove-orphans --timeout 5
    ;;
  --build|build)
    images
    ;;
  up|--up)
    tokens
    images
    log "starting the stack (project $COMPOSE_PROJECT_NAME)"
    "${COMPOSE[@]}" up -d --no-build
    log "up; admin API on http://127.0.0.1:${KNITTRANS_ADMIN_PORT:-8700} (dashboard /ui)"
    ;;
  *)
    echo "usage: $0 [up|--build|--down]" >&2; exit 2
    ;;
esac
