"""One module per workload (the interface: :mod:`benchmarks.harness`), by suite. Importing a
module imports no GPU library: those load inside the measurements."""

SUITES = {
    "cpu_logmel": "cpu", "cpu_clips": "cpu", "cpu_rnnt_feed": "cpu", "cpu_extract": "cpu",
    "cpu_shards": "cpu", "cpu_index": "cpu", "cpu_open": "cpu",
    "video": "gpu", "audio": "gpu", "image": "gpu", "feeds": "gpu", "augment": "gpu",
    "extract": "gpu", "gpu_shards": "gpu", "soak": "gpu",
}
NAMES = tuple(SUITES)
