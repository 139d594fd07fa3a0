# KnitTrans image: one image for every process kind (control plane, store, rollout, trainer).
#
#   bash scripts/compose_up.sh --build     # makes the base image when missing, the wheelhouse, this image
#
# The base is a Debian bookworm minbase (python3 3.11, python3-venv) made with debootstrap and
# `docker import` (no registry needed); any image with Python 3.11 and venv works:
#   docker build --build-arg BASE_IMAGE=python:3.11-slim -t knittrans:dev .
# Python packages come from .wheelhouse/ (filled on the host by scripts/compose_up.sh: CPU-only torch
# 2.13.0, the package's core dependencies and its `demo` extra, i.e. every role's stack) and are
# installed with --no-index: the build needs no network.
# For GPU nodes build from an image with CUDA and put the matching torch wheel into the wheelhouse.
ARG BASE_IMAGE=knittrans-base:bookworm

# Stage 1: the dependencies' virtual environment from the wheelhouse (the wheels stay out of the image).
FROM ${BASE_IMAGE} AS deps
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:/usr/bin:/bin
COPY .wheelhouse /tmp/wheels
RUN python3 -m venv /opt/venv \
 && pip install -q --no-index --find-links /tmp/wheels -r /tmp/wheels/requirements.txt

# Stage 2: the runtime image.
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OMP_NUM_THREADS=1 \
    HF_HUB_OFFLINE=1 \
    PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# A non-root user owning the directories compose mounts named volumes on (a fresh named volume
# takes the ownership of the image directory it is mounted over).
RUN groupadd --gid 10001 knittrans \
 && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin knittrans \
 && mkdir -p /var/lib/knittrans /models /weights /results \
 && chown -R knittrans:knittrans /var/lib/knittrans /models /weights /results

# Dependencies (cached until the wheelhouse changes), then the package itself.
COPY --from=deps /opt/venv /opt/venv
WORKDIR /opt/knittrans
COPY pyproject.toml README.md ./
COPY knittrans ./knittrans
RUN pip install -q --no-index --no-deps --no-build-isolation . && rm -rf build && knittrans --help >/dev/null

USER knittrans:knittrans
WORKDIR /home/knittrans
CMD ["knittrans", "--help"]
