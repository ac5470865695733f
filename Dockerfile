# queue-tinker: one image for the gateway, the workers and the one-shot migration.
#   docker build -t queue-tinker .                       (GPU build: torch with CUDA)
#   docker build --build-arg TORCH_INSTALL="pip install torch==2.13.0 --index-url <PyTorch's CPU
#                wheel index>" -t queue-tinker:cpu .     (CPU-only: a much smaller image)
FROM python:3.11-slim

# torch goes in first, pinned, so nothing after it pulls a different build (the locks leave it out).
# The default wheel carries ~3 GB of CUDA libraries; override the line for a CPU image (above).
ARG TORCH_INSTALL="pip install torch==2.13.0"

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    QT_DATA_DIR=/data \
    QT_STORAGE=/data/checkpoints

RUN ${TORCH_INSTALL}

WORKDIR /app
# The worker and server extras at the versions CI tested (requirements-image.lock, made by
# scripts/lock within requirements.lock), in a layer of their own: editing the sources does
# not reinstall them.
COPY requirements-image.lock ./
RUN pip install -r requirements-image.lock
# Sources only (no tests, no local venv), so edits elsewhere don't bust the layer cache.
COPY pyproject.toml README.md ./
COPY queue_tinker ./queue_tinker
COPY workers ./workers
COPY migrations ./migrations
RUN pip install --no-deps .

# Run unprivileged; /data is created here so named volumes mounted on it inherit the owner.
RUN useradd --create-home --uid 1000 qt && mkdir -p /data/checkpoints && chown -R qt:qt /data
USER qt
VOLUME ["/data"]

EXPOSE 8000
ENTRYPOINT ["queue-tinker"]
CMD ["--help"]
