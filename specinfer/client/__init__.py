"""Clients of a specinfer Triton deployment (HTTP and gRPC over `tritonclient`).

Not written yet: it arrives with the Triton serving work (the `triton` extra). Until then, use the
library in-process: :class:`specinfer.Pipeline`.
"""
