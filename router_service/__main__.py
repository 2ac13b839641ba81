"""`python -m router_service`: serve the router until SIGINT or SIGTERM."""

from radixserve.serving import run_service
from router_service.config import PROGRAM
from router_service.server import Router

if __name__ == "__main__":
    run_service(PROGRAM, Router.start)
