# vLLM's official OpenAI server image (CUDA) with kvtier added, for compose.yaml's `vllm` service.
# Build context: the repository root.
#
#   docker build -f docker/vllm.Dockerfile -t kvtier-vllm:local .
#
# kvtier supports vLLM >=0.32,<0.34 (the `gpu` extra); bump the tag only within that range.

# ---- build: a wheel of kvtier, so the final image gets no source tree.
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
FROM vllm/vllm-openai:v0.33.0
# kvtier alone, without extras: the image already has vLLM and torch, and installing the `gpu` extra
# could move vLLM to another version. The wheel is pure Python, so the image's Python version is fine.
COPY --from=build /wheels /wheels
RUN python3 -m pip install --no-cache-dir /wheels/*.whl \
 && rm -rf /wheels \
 && python3 -c "import kvtier.connector, kvtier.app.settings; print('kvtier connector importable')"

# The connector registers itself through the vllm.general_plugins entry point "kvtier", so
# {"kv_connector":"KVTierConnector"} works with or without kv_connector_module_path.
ENTRYPOINT ["vllm", "serve"]
