# KnitTrans image: one image for every process kind (control plane, store, rollout, trainer).
#
#   docker build -t knittrans:dev .
#   docker run --rm knittrans:dev knittrans --help
#
# CPU-only torch from the PyTorch CPU index (no CUDA wheels, ~200 MB instead of GBs). For GPU
# nodes build from an image with CUDA and install the matching torch wheel instead.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OMP_NUM_THREADS=1 \
    HF_HUB_OFFLINE=1

# torch first, from the CPU index, so the package install below finds it satisfied.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

# A non-root user owning the directories compose mounts named volumes on (a fresh named volume
# takes the ownership of the image directory it is mounted over).
RUN groupadd --gid 10001 knittrans \
 && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin knittrans \
 && mkdir -p /var/lib/knittrans /models /weights /results \
 && chown -R knittrans:knittrans /var/lib/knittrans /models /weights /results

WORKDIR /opt/knittrans
COPY pyproject.toml README.md ./
COPY knittrans ./knittrans
RUN pip install . && knittrans --help >/dev/null

USER knittrans:knittrans
WORKDIR /home/knittrans
CMD ["knittrans", "--help"]
