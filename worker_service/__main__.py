"""`python -m worker_service`: serve one tensor-parallel rank until SIGINT or SIGTERM."""

from radixserve.serving import run_service
from worker_service.config import PROGRAM
from worker_service.server import Worker

if __name__ == "__main__":
    run_service(PROGRAM, Worker.start)
