# One image for every radixserve service; the command picks the service:
#   python -m worker_service | python -m router_service | python -m gateway_service | radixserve up
# CPU torch by default; the CUDA image for the GPU profile:
#   docker build --build-arg TORCH_VARIANT=cu128 -t radixserve:0.1.0-cuda .
# Plain Dockerfile syntax only (no `# syntax=` line, no BuildKit-only flags): the classic builder
# and offline or mirrored BuildKit builds work as they are.

# Any Python 3.11+ image with pip (a site's own base image: --build-arg PYTHON_IMAGE=...).
ARG PYTHON_IMAGE=python:3.11-slim

# The torch version is pyproject.toml's pin, read in this small stage. Only the version file
# reaches the image, so editing pyproject.toml elsewhere keeps the torch layer cached.
FROM ${PYTHON_IMAGE} AS torch-pin
COPY pyproject.toml deploy/image/torch_build.py /pin/
RUN python /pin/torch_build.py pin /pin/pyproject.toml > /pin/torch-version

FROM ${PYTHON_IMAGE}

# Which torch build: `cpu` or a CUDA one such as `cu128`. It comes from TORCH_INDEX_URL alone,
# by default the PyTorch index of that variant (a mirror of it works the same).
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX_URL=
ARG APP_UID=10001

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    RADIXSERVE_HOST=0.0.0.0 \
    RADIXSERVE_MODEL=/models/smollm2-135m-instruct

WORKDIR /app

# Torch first, in its own layer: it is by far the largest and changes least often. The wheel
# comes from the torch index only (no fallback index that could hand over another build), its
# dependencies from the regular index; then the build is checked, so a wrong one fails here.
COPY --from=torch-pin /pin/torch-version /pin/torch_build.py /opt/radixserve-build/
RUN version="$(cat /opt/radixserve-build/torch-version)" \
    && pip install --no-deps \
        --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/${TORCH_VARIANT}}" \
        "torch==${version}" \
    && pip install "torch==${version}" \
    && python /opt/radixserve-build/torch_build.py check --version "${version}" \
        --variant "${TORCH_VARIANT}"

# A C++ compiler: workers build their decode attention kernel for the CPU they run on, on first
# use (worker_service/attention/native.py). Without one they use the slower torch path.
RUN if ! command -v g++ >/dev/null && command -v apt-get >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*; \
    fi

# The other dependencies (and the `model` extra that prepare_model needs), read from
# pyproject.toml so that editing the source does not reinstall them. torch is already there.
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['model']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# The project itself; the protobuf code is generated here (it is not committed) and then
# installed along with the packages. The torch check runs again: nothing above may have
# replaced the checked build.
COPY . .
RUN python -m radixserve.gen_protos \
    && pip install --no-deps . \
    && python -c "import radixserve.v1.generation_pb2_grpc, radixserve.health_probe" \
    && python /opt/radixserve-build/torch_build.py check \
        --version "$(cat /opt/radixserve-build/torch-version)" --variant "${TORCH_VARIANT}"

# Run as an unprivileged user; /models and /certs are where the model and certificate
# volumes are mounted (a new named volume takes the owner of its mount point).
RUN useradd --uid "${APP_UID}" --create-home --shell /usr/sbin/nologin radixserve \
    && mkdir -p /models /certs \
    && chown radixserve /models /certs
USER ${APP_UID}

# gateway, router, worker rank 0 (rank r listens on 50060 + r in the local layout)
EXPOSE 50051 50052 50060
STOPSIGNAL SIGTERM
CMD ["radixserve", "up", "--model", "/models/smollm2-135m-instruct", "--host", "0.0.0.0"]
