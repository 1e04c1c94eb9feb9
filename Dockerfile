# Speedtronic job-runner image: one entrypoint (`speedtronic run`), CUDA from the torch wheels.
#
#   docker build -t speedtronic:latest .                  # CUDA 12.8 (torch cu128 wheels)
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
#                -t speedtronic:cpu .                     # CPU only, much smaller
#
# One copy of CUDA: the base is a plain OS image and the CUDA user-space libraries (cuBLAS,
# cuDNN, NCCL, ...) come only from the nvidia-* wheels that torch from TORCH_INDEX_URL depends
# on. The driver comes from the host (NVIDIA Container Toolkit, `--gpus` or a device request).
# Any BASE_IMAGE with python3 (>= 3.11) and python3-venv in its apt archive works; CI builds on a
# local Debian image with a local wheel index (docs/deploy.md, "Testing the containers").
#
# Layers, from the least to the most often changed: OS packages; torch; the other
# dependencies (read from pyproject.toml alone); the package. A source edit rebuilds only the
# last, small layer. The file needs nothing but the classic builder: no `# syntax=` line, no
# BuildKit-only instruction, so builds work offline against a local base image.
#
# No secret is ever passed at build time: the Hub token arrives at run time as the file
# /run/secrets/hf_token (compose secret / Kubernetes Secret) or as HF_TOKEN.

# The base image is a build argument so CI can build on a local image; its default is pinned
# to a release tag. checkov reads FROM without expanding the argument, hence the skip below
# (tests/test_deploy_checkov.py checks the default's tag instead).
# checkov:skip=CKV_DOCKER_7:FROM is the BASE_IMAGE build argument, its default is pinned
ARG BASE_IMAGE=ubuntu:24.04

FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Distribution packages float with the base image's security updates; pinning them would break
# the build whenever the archive moves on.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 speedtronic \
    && useradd --system --uid 10001 --gid speedtronic --create-home \
        --home-dir /home/speedtronic --shell /usr/sbin/nologin speedtronic \
    && mkdir -p /data /config \
    && chown speedtronic:speedtronic /data \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# torch first, from the index that matches the wanted accelerator (cu128, cpu, ...). The build
# arguments are declared here, so changing them keeps the OS layer above cached.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG TORCH_VERSION=2.8.0
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# The other runtime dependencies, from pyproject.toml only (plus the build backend, so the
# package layer below needs no network).
COPY pyproject.toml /tmp/speedtronic-deps/pyproject.toml
RUN python3 -c "import pathlib, tomllib; \
p = pathlib.Path('/tmp/speedtronic-deps'); \
deps = tomllib.loads((p / 'pyproject.toml').read_text())['project']['dependencies']; \
(p / 'requirements.txt').write_text('\n'.join(deps) + '\n')" \
    && pip install --no-cache-dir -r /tmp/speedtronic-deps/requirements.txt \
        "setuptools>=69" wheel \
    && rm -rf /tmp/speedtronic-deps

# The package itself: no dependency resolution, no build isolation, no network.
COPY pyproject.toml README.md /tmp/speedtronic-src/
COPY speedtronic /tmp/speedtronic-src/speedtronic
RUN pip install --no-cache-dir --no-deps --no-build-isolation /tmp/speedtronic-src \
    && rm -rf /tmp/speedtronic-src

COPY configs /opt/speedtronic/configs

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HOME=/data/.cache/huggingface \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    SPEEDTRONIC_CONFIG=/opt/speedtronic/configs/smoke.yaml

USER 10001:10001
WORKDIR /data
VOLUME ["/data"]
EXPOSE 8000

# /healthz answers 200 while the training loop's heartbeat is fresh (metrics.stall_seconds); a
# loop stalled past that ends the process with exit code 1, so restart policies act on it.
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('SPEEDTRONIC_METRICS__PORT', '8000') + '/healthz', timeout=4)"]

STOPSIGNAL SIGTERM
ENTRYPOINT ["speedtronic", "run"]
