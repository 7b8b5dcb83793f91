"""avpipe's benchmark harness: ``python -m benchmarks run --suite cpu|gpu|all`` and
``python -m benchmarks report`` (see benchmarks/README.md)."""
