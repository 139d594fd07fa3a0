#!/usr/bin/env bash
# Local multi-node stack on one Docker host: base image (once), project image, `docker-compose up`.
#
#   bash scripts/compose_up.sh            # build what is missing, start the stack, wait for health
#   bash scripts/compose_up.sh --build    # only the images (base image when missing + knittrans:dev)
#   bash scripts/compose_up.sh --down     # stop and remove containers, networks and volumes
#   eval "$(bash scripts/compose_up.sh env)"   # export what docker-compose needs (tokens, TLS), then
#                                              # `docker-compose ps/logs/...` work on the stack directly
#
# Needs a running Docker engine and docker-compose (v1 `docker-compose` or the v2 plugin).
# Base image: Docker Hub may be unreachable, so `knittrans-base:bookworm` is made with debootstrap
# from the Debian mirror apt uses here (KNITTRANS_DEBIAN_MIRROR overrides it). Python packages:
# the wheels are downloaded on the host with the host's pip configuration into .wheelhouse/ and
# installed in the image with --no-index (the build itself needs no network).
# Tokens: KNITTRANS_{WORKER,STORE,ADMIN}_TOKEN and KNITTRANS_TICKET_KEY from the environment;
# missing ones are generated once into .compose.env (mode 600, git-ignored), which this script reads.
# Each rollout worker, rank and store then gets its own scoped token (`knittrans token`, signed with
# the admin token): a worker of job `demo`, rank r of `demo`, a store node. Plan tickets carry grants
# signed with the ticket key, which only the control plane and the stores hold.
# TLS (default on; KNITTRANS_TLS=off for plain text): a CA and one server certificate for the
# stack's names (control-plane, store-a, store-b, localhost, 127.0.0.1) are made once with openssl
# in KNITTRANS_TLS_DIR (default ./deploy/tls; the CA's key is deleted after signing). The control
# plane serves HTTPS, stores grpc+tls, and every client verifies the CA (host side:
# $KNITTRANS_TLS_DIR/ca.pem, e.g. `curl --cacert deploy/tls/ca.pem https://127.0.0.1:8700/...`).
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
  for name in KNITTRANS_WORKER_TOKEN KNITTRANS_STORE_TOKEN KNITTRANS_ADMIN_TOKEN KNITTRANS_TICKET_KEY; do
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
    printf 'KNITTRANS_WORKER_TOKEN=%s\nKNITTRANS_STORE_TOKEN=%s\nKNITTRANS_ADMIN_TOKEN=%s\nKNITTRANS_TICKET_KEY=%s\n' \
      "$KNITTRANS_WORKER_TOKEN" "$KNITTRANS_STORE_TOKEN" "$KNITTRANS_ADMIN_TOKEN" "$KNITTRANS_TICKET_KEY" > .compose.env
    log "tokens written to .compose.env (source it to use the admin token)"
  fi
  # one scoped credential per process (the shared worker token stays valid for tools and tests)
  local mint=("$PY" -m knittrans.cli token)
  KNITTRANS_ROLLOUT_TOKEN=$("${mint[@]}" --role worker --job demo)
  # rank 0 leads the ranks' collective progress: it reports fetched and acks for every rank of the job
  KNITTRANS_RANK0_TOKEN=$("${mint[@]}" --role rank --job demo)
  KNITTRANS_RANK1_TOKEN=$("${mint[@]}" --role rank --job demo --rank 1)
  KNITTRANS_NODE_TOKEN=$("${mint[@]}" --role store)
  export KNITTRANS_ROLLOUT_TOKEN KNITTRANS_RANK0_TOKEN KNITTRANS_RANK1_TOKEN KNITTRANS_NODE_TOKEN
}

tls() {
  export KNITTRANS_TLS_DIR=${KNITTRANS_TLS_DIR:-./deploy/tls}
  if [ "${KNITTRANS_TLS:-on}" = off ]; then
    export KNITTRANS_CONTROL_SCHEME=http KNITTRANS_FLIGHT_SCHEME=grpc
    export KNITTRANS_TLS_CERT= KNITTRANS_TLS_KEY= KNITTRANS_TLS_CA=
    return
  fi
  local dir=$KNITTRANS_TLS_DIR
  if [ ! -s "$dir/cert.pem" ] || [ ! -s "$dir/key.pem" ] || [ ! -s "$dir/ca.pem" ]; then
    command -v openssl >/dev/null || { echo "openssl is missing (apt-get install -y openssl), or KNITTRANS_TLS=off" >&2; exit 1; }
    log "making a CA and the stack's server certificate in $dir"
    mkdir -p "$dir"
    local ec=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)
    openssl req -x509 "${ec[@]}" -days 30 -subj "/CN=knittrans-compose-ca" -keyout "$dir/ca.key" -out "$dir/ca.pem" 2>/dev/null
    openssl req "${ec[@]}" -subj "/CN=knittrans" -keyout "$dir/key.pem" -out "$dir/cert.csr" 2>/dev/null
    printf '%s\n' "subjectAltName=DNS:control-plane,DNS:store-a,DNS:store-b,DNS:localhost,IP:127.0.0.1" \
      "basicConstraints=CA:FALSE" "extendedKeyUsage=serverAuth" > "$dir/ext.cnf"
    openssl x509 -req -in "$dir/cert.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" -CAcreateserial -days 30 \
      -extfile "$dir/ext.cnf" -out "$dir/cert.pem" 2>/dev/null
    rm -f "$dir/ca.key" "$dir/ca.srl" "$dir/cert.csr" "$dir/ext.cnf"   # the CA signs nothing else
    chmod 644 "$dir/ca.pem" "$dir/cert.pem"
    if [ "$(id -u)" = 0 ]; then   # readable by the image's user (uid 10001) only
      chown 10001:10001 "$dir/key.pem"; chmod 600 "$dir/key.pem"
    else
      chmod 644 "$dir/key.pem"; log "warning: $dir/key.pem is world-readable (run as root to give it to uid 10001)"
    fi
  fi
  # paths inside the containers (the folder is mounted read-only at /etc/knittrans/tls)
  export KNITTRANS_CONTROL_SCHEME=https KNITTRANS_FLIGHT_SCHEME=grpc+tls
  export KNITTRANS_TLS_CERT=/etc/knittrans/tls/cert.pem KNITTRANS_TLS_KEY=/etc/knittrans/tls/key.pem
  export KNITTRANS_TLS_CA=/etc/knittrans/tls/ca.pem
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
    tls
    "${COMPOSE[@]}" down -v --remove-orphans --timeout 5
    ;;
  --build|build)
    images
    ;;
  up|--up)
    tokens
    tls
    images
    log "starting the stack (project $COMPOSE_PROJECT_NAME)"
    "${COMPOSE[@]}" up -d --no-build
    log "up; admin API on $KNITTRANS_CONTROL_SCHEME://127.0.0.1:${KNITTRANS_ADMIN_PORT:-8700} (dashboard /ui)"
    ;;
  env|--env)
    tokens >&2
    tls >&2
    for name in KNITTRANS_WORKER_TOKEN KNITTRANS_STORE_TOKEN KNITTRANS_ADMIN_TOKEN KNITTRANS_TICKET_KEY \
                KNITTRANS_ROLLOUT_TOKEN KNITTRANS_RANK0_TOKEN KNITTRANS_RANK1_TOKEN KNITTRANS_NODE_TOKEN \
                KNITTRANS_TLS_DIR KNITTRANS_CONTROL_SCHEME KNITTRANS_FLIGHT_SCHEME KNITTRANS_TLS_CERT \
                KNITTRANS_TLS_KEY KNITTRANS_TLS_CA COMPOSE_PROJECT_NAME; do
      printf 'export %s=%q\n' "$name" "${!name}"
    done
    ;;
  *)
    echo "usage: $0 [up|--build|--down|env]" >&2; exit 2
    ;;
esac
