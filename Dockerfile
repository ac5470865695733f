# queue-tinker: one image for the gateway, the workers and the one-shot migration.
#   docker build -t queue-tinker .                       (GPU build: torch with CUDA)
#   docker build --build-arg TORCH_INSTALL="pip install torch==2.13.0 --index-url <PyTorch's CPU
#                wheel index>" -t queue-tinker:cpu .     (CPU-only: a much smaller image)
FROM python:3.11-slim

# torch goes in first, pinned, so installing the worker extra never pulls a different build.
# The default wheel carries ~3 GB of CUDA libraries; override the line for a CPU image (above).
ARG TORCH_INSTALL="pip install torch==2.13.0"

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    QT_DATA_DIR=/data \
    QT_STORAGE=/data/checkpoints

RUN ${TORCH_INSTALL}

WORKDIR /app
# Sources only (no tests, no local venv), so edits elsewhere don't bust the layer cache.
COPY pyproject.toml README.md ./
COPY queue_tinker ./queue_tinker
COPY workers ./workers
COPY migrations ./migrations
RUN pip install ".[worker]"

# Run unprivileged; /data is created here so named volumes mounted on it inherit the owner.
RUN useradd --create-home --uid 1000 qt && mkdir -p /data/checkpoints && chown -R qt:qt /data
USER qt
VOLUME ["/data"]

EXPOSE 8000
ENTRYPOINT ["queue-tinker"]
CMD ["--help"]
