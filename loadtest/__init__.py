"""Load tests of the Triton ``llm`` model with Locust: streaming users over HTTP and gRPC (``locustfile``), the
workload they send (``workload``), client-side stream timing (``streaming``), Triton's metrics (``server_metrics``)
and the summary of a run (``report``). Run ``python -m loadtest --help``.
"""
