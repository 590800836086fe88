"""Clients of a specinfer Triton deployment: HTTP and gRPC, sync and asyncio, streaming or not.

    from specinfer.client import Client, AsyncClient, ClientError, run_bench

Needs the ``triton`` extra (``tritonclient[all]``). The ``specinfer client`` command (:mod:`.cli`)
and the load bench (:mod:`.bench`) are built on these.
"""
from .client import AsyncClient, Client
from .messages import ClientError, Result

__all__ = ["AsyncClient", "Client", "ClientError", "Result", "run_bench"]


def __getattr__(name):
    if name == "run_bench":
        from .bench import run_bench
        return run_bench
    raise AttributeError(name)
