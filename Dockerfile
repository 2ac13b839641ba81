# syntax=docker/dockerfile:1
# One image for every radixserve service; the command picks the service:
#   python -m worker_service | python -m router_service | python -m gateway_service | radixserve up
# CPU torch by default. For the GPU profile build a CUDA torch instead, e.g.
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t radixserve:0.1.0-cuda .
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

# Which torch wheel to install. The default index holds CPU-only wheels (the plain PyPI wheel
# pulls gigabytes of CUDA libraries); an empty TORCH_INDEX_URL installs from PyPI as is.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG APP_UID=10001

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    RADIXSERVE_HOST=0.0.0.0 \
    RADIXSERVE_MODEL=/models/smollm2-135m-instruct

WORKDIR /app

# Torch first, in its own layer: it is by far the largest and changes least often.
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL" --extra-index-url https://pypi.org/simple} \
        "torch==${TORCH_VERSION}"

# The other dependencies (and the `model` extra that prepare_model needs), read from
# pyproject.toml so that editing the source does not reinstall them. torch is already there.
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['model']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# The project itself; the protobuf code is generated here (it is not committed) and then
# installed along with the packages.
COPY . .
RUN python -m radixserve.gen_protos \
    && pip install --no-deps . \
    && python -c "import radixserve.v1.generation_pb2_grpc, radixserve.health_probe"

# Run as an unprivileged user; /models is where the model volume is mounted.
RUN useradd --uid "${APP_UID}" --create-home --shell /usr/sbin/nologin radixserve \
    && mkdir -p /models \
    && chown radixserve /models
USER ${APP_UID}

# gateway, router, worker rank 0 (rank r listens on 50060 + r in the local layout)
EXPOSE 50051 50052 50060
STOPSIGNAL SIGTERM
CMD ["radixserve", "up", "--model", "/models/smollm2-135m-instruct", "--host", "0.0.0.0"]
