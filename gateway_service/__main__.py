"""`python -m gateway_service`: serve GenerationService on --host:--port until SIGINT/SIGTERM."""

from gateway_service.config import PROGRAM
from gateway_service.server import Gateway
from radixserve.serving import run_service

if __name__ == "__main__":
    run_service(PROGRAM, Gateway.start)
