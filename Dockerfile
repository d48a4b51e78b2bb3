# syntax=docker/dockerfile:1
# CUDA runtime base: the app uses the GPU when one is passed (--gpus all) and the CPU otherwise.
# The tag matches the torch pin in requirements.txt, so pip keeps the image's torch.
FROM pytorch/pytorch:2.14.1-cuda13.0-cudnn9-runtime

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    DATA_DIR=/data \
    PORT=7860

# redis-server: the private L2 when REDIS_URL is not set.
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server curl \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
# Requirements before code, so code edits reuse the dependency layer.
COPY requirements.txt .
RUN pip install --no-cache-dir -r requirements.txt

RUN useradd --create-home --uid 1000 app && mkdir -p /data && chown app:app /data
COPY --chown=app:app . .
# Numeric, so Kubernetes' runAsNonRoot can verify it (hadolint DL3066).
USER 1000

VOLUME ["/data"]
EXPOSE 7860
# Shell form on purpose: ${PORT} is expanded when the check runs, so PORT=... at run time still works.
# hadolint ignore=DL3025
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD curl -fsS "http://127.0.0.1:${PORT}/healthz" || exit 1
CMD ["python", "app.py"]
