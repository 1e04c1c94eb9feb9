# syntax=docker/dockerfile:1
# Speedtronic job-runner image: one CUDA runtime image, one entrypoint (`speedtronic run`).
#
#   docker build -t speedtronic:latest .
#   docker build --build-arg BASE_IMAGE=ubuntu:24.04 \
#                --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t speedtronic:cpu .
#
# BASE_IMAGE and TORCH_INDEX_URL must match: the CUDA 12.8 runtime pairs with the cu128 wheels.
# No secret is ever passed at build time: the Hub token arrives at run time as the file
# /run/secrets/hf_token (compose secret / Kubernetes Secret) or as HF_TOKEN.

ARG BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

# ---------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS builder
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG TORCH_VERSION=2.8.0
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Distribution packages float with the base image's security updates; pinning them would break
# the build whenever the archive moves on.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the index that matches the base image's CUDA runtime.
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY speedtronic ./speedtronic
RUN pip install --no-cache-dir .

# ---------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS runtime
ENV DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 speedtronic \
    && useradd --system --uid 10001 --gid speedtronic --create-home \
        --home-dir /home/speedtronic --shell /usr/sbin/nologin speedtronic \
    && mkdir -p /data /config \
    && chown speedtronic:speedtronic /data

COPY --from=builder /opt/venv /opt/venv
COPY configs /opt/speedtronic/configs

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HOME=/data/.cache/huggingface \
    SPEEDTRONIC_CONFIG=/opt/speedtronic/configs/smoke.yaml

USER 10001:10001
WORKDIR /data
VOLUME ["/data"]
EXPOSE 8000

# /healthz answers 200 while the training loop's heartbeat is fresh (metrics.stall_seconds).
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('SPEEDTRONIC_METRICS__PORT', '8000') + '/healthz', timeout=4)"]

STOPSIGNAL SIGTERM
ENTRYPOINT ["speedtronic", "run"]
